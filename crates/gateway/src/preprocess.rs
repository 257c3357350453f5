//! Preprocessing lives in [`text::Preprocessor`] (chat template + tokens, with its bounded
//! message cache); this loads the tokenizer and template files it is given.

use std::path::Path;
use std::sync::Arc;

use text::{ChatTemplate, Tokenizer};
pub use text::{Prepared, Preprocessor};

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

fn read(path: &Path) -> Result<String, PreprocessError> {
    std::fs::read_to_string(path).map_err(|source| PreprocessError::Read {
        path: path.display().to_string(),
        source,
    })
}

fn invalid(path: &Path, error: impl std::fmt::Display) -> PreprocessError {
    PreprocessError::Load {
        path: path.display().to_string(),
        message: error.to_string(),
    }
}

/// The built-in tokenizer and template, or the given Hugging Face files.
pub fn load(
    tokenizer_json: Option<&Path>,
    tokenizer_config: Option<&Path>,
) -> Result<Preprocessor, PreprocessError> {
    let tokenizer = match tokenizer_json {
        None => Tokenizer::builtin(),
        Some(path) => {
            Arc::new(Tokenizer::from_hf_json(read(path)?.as_bytes()).map_err(|e| invalid(path, e))?)
        }
    };
    let template = match tokenizer_config {
        None => ChatTemplate::llama3(),
        Some(path) => ChatTemplate::from_tokenizer_config(&read(path)?)
            .map_err(|e| invalid(path, e))?
            .named(format!("the chat template of {}", path.display())),
    };
    Ok(Preprocessor::new(tokenizer, template))
}

#[cfg(test)]
mod tests {
    use super::*;
    use text::ChatMessage;

    #[test]
    fn a_tokenizer_config_file_is_loaded_and_a_missing_one_named() {
        let dir = std::env::temp_dir().join(format!("gw-pre-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tokenizer_config.json");
        std::fs::write(
            &path,
            r#"{"bos_token": "<s>", "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"}"#,
        )
        .unwrap();
        let pre = load(None, Some(&path)).unwrap();
        let prepared = pre.chat(&[ChatMessage::user("hi")], true).unwrap();
        assert_eq!(prepared.text.as_deref(), Some("<s>[user] hi\n[assistant] "));
        assert_eq!(
            prepared.tokens,
            pre.tokenizer().encode("<s>[user] hi\n[assistant] ")
        );
        let missing = load(None, Some(&dir.join("nope.json"))).unwrap_err();
        assert!(missing.to_string().contains("nope.json"), "{missing}");
    }
}
