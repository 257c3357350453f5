//! Preprocessing, once per request: chat template, then tokenization.
//!
//! The built-in pair (cl100k + Llama-3 specials, Llama-3 template) takes a fast path that
//! encodes each message on its own ([`text::Llama3Format`]), which gives the same ids as
//! rendering and encoding the whole conversation. Any other template renders the text first
//! and encodes it as a whole.

use std::path::Path;
use std::sync::Arc;

use text::{ChatMessage, ChatTemplate, Llama3Format, Tokenizer};

/// Why a tokenizer or template could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum PreprocessError {
    #[error("reading {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Load { path: String, message: String },
}

/// A prompt ready for routing: its token ids, and its text when a worker needs text.
#[derive(Debug, Clone, PartialEq)]
pub struct Prepared {
    pub tokens: Vec<u32>,
    pub text: Option<String>,
}

/// Tokenizer + chat template.
#[derive(Debug)]
pub struct Preprocessor {
    tokenizer: Arc<Tokenizer>,
    template: ChatTemplate,
    fast: Option<Llama3Format>,
}

fn read(path: &Path) -> Result<String, PreprocessError> {
    std::fs::read_to_string(path).map_err(|source| PreprocessError::Read {
        path: path.display().to_string(),
        source,
    })
}

impl Preprocessor {
    /// The built-in tokenizer and template, or the given HF files.
    pub fn load(
        tokenizer_json: Option<&Path>,
        tokenizer_config: Option<&Path>,
    ) -> Result<Preprocessor, PreprocessError> {
        let tokenizer = match tokenizer_json {
            None => Tokenizer::builtin(),
            Some(path) => {
                let bytes = read(path)?;
                Arc::new(Tokenizer::from_hf_json(bytes.as_bytes()).map_err(|e| {
                    PreprocessError::Load {
                        path: path.display().to_string(),
                        message: e.to_string(),
                    }
                })?)
            }
        };
        let template = match tokenizer_config {
            None => ChatTemplate::llama3(),
            Some(path) => ChatTemplate::from_tokenizer_config(&read(path)?).map_err(|e| {
                PreprocessError::Load {
                    path: path.display().to_string(),
                    message: e.to_string(),
                }
            })?,
        };
        Ok(Preprocessor::new(tokenizer, template))
    }

    pub fn new(tokenizer: Arc<Tokenizer>, template: ChatTemplate) -> Preprocessor {
        let fast = if template.is_builtin_llama3() {
            Llama3Format::new(&tokenizer).ok()
        } else {
            None
        };
        Preprocessor {
            tokenizer,
            template,
            fast,
        }
    }

    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    /// A chat's prompt, ending with the assistant header. `with_text` also returns the
    /// rendered text (for workers that take text).
    pub fn chat(&self, messages: &[ChatMessage], with_text: bool) -> Result<Prepared, String> {
        let rendered = |template: &ChatTemplate| {
            template
                .render(messages, true)
                .map_err(|e| format!("the chat template cannot format these messages: {e}"))
        };
        match &self.fast {
            Some(format) => {
                let mut tokens = Vec::new();
                format.push_conversation(&self.tokenizer, messages, true, &mut tokens);
                let text = if with_text {
                    Some(rendered(&self.template)?)
                } else {
                    None
                };
                Ok(Prepared { tokens, text })
            }
            None => {
                let text = rendered(&self.template)?;
                let tokens = self.tokenizer.encode(&text);
                Ok(Prepared {
                    tokens,
                    text: with_text.then_some(text),
                })
            }
        }
    }

    /// A completion prompt given as text.
    pub fn text(&self, prompt: &str) -> Vec<u32> {
        self.tokenizer.encode(prompt)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_path_equals_render_then_encode() {
        let pre = Preprocessor::load(None, None).unwrap();
        let messages = vec![
            ChatMessage::system("You explain caches."),
            ChatMessage::user("  What is a prefix cache? "),
            ChatMessage::assistant("A cache of prompt prefixes."),
            ChatMessage::user("And a KV block?"),
        ];
        let prepared = pre.chat(&messages, true).unwrap();
        let text = prepared.text.unwrap();
        assert_eq!(prepared.tokens, pre.tokenizer().encode(&text));
        assert!(text.ends_with("<|start_header_id|>assistant<|end_header_id|>\n\n"));
    }

    #[test]
    fn a_tokenizer_config_template_is_used() {
        let dir = std::env::temp_dir().join(format!("gw-pre-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tokenizer_config.json");
        std::fs::write(
            &path,
            r#"{"bos_token": "<s>", "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"}"#,
        )
        .unwrap();
        let pre = Preprocessor::load(None, Some(&path)).unwrap();
        let prepared = pre.chat(&[ChatMessage::user("hi")], true).unwrap();
        assert_eq!(prepared.text.as_deref(), Some("<s>[user] hi\n[assistant] "));
        assert_eq!(
            prepared.tokens,
            pre.tokenizer().encode("<s>[user] hi\n[assistant] ")
        );
        let missing = Preprocessor::load(None, Some(&dir.join("nope.json"))).unwrap_err();
        assert!(missing.to_string().contains("nope.json"), "{missing}");
    }
}
