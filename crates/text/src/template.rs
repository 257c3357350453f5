//! Chat templates: a list of messages to the prompt text a model was trained on.

use minijinja::{Environment, ErrorKind, Value, context};
use serde::{Deserialize, Serialize};

/// One chat message, as in the OpenAI API (`{"role": "user", "content": "..."}`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }

    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }

    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }

    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }
}

/// Why a template could not be loaded or rendered.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error("tokenizer_config.json is not valid JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error(
        "tokenizer_config.json has no usable `chat_template` (a string, or a list with a \"default\" entry)"
    )]
    MissingTemplate,
    #[error("chat template does not compile: {0}")]
    Compile(String),
    #[error("chat template failed to render: {0}")]
    Render(String),
}

/// The Llama-3 instruct format, written for this crate: `<|begin_of_text|>`, then for each
/// message `<|start_header_id|>ROLE<|end_header_id|>\n\nCONTENT<|eot_id|>` with the content
/// trimmed of surrounding whitespace, then the assistant header when a generation prompt is
/// asked for.
const LLAMA3_TEMPLATE: &str = "{{- bos_token -}}\
{%- for m in messages -%}\
<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content | trim }}<|eot_id|>\
{%- endfor -%}\
{%- if add_generation_prompt -%}<|start_header_id|>assistant<|end_header_id|>{{ \"\\n\\n\" }}{%- endif -%}";

/// A compiled chat template with its BOS/EOS strings.
///
/// Rendering is pure (no clock: a template that asks for `strftime_now` finds it undefined and
/// falls back, as Llama-3.1's does, to its `date_string` default).
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    is_builtin_llama3: bool,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .field("is_builtin_llama3", &self.is_builtin_llama3)
            .finish()
    }
}

impl ChatTemplate {
    /// The built-in Llama-3 instruct template (see the crate docs for the exact format).
    pub fn llama3() -> Self {
        let mut me = Self::compile(
            LLAMA3_TEMPLATE.to_owned(),
            crate::tokenizer::BEGIN_OF_TEXT.to_owned(),
            crate::tokenizer::EOT_ID.to_owned(),
        )
        .expect("the built-in template compiles");
        me.is_builtin_llama3 = true;
        me
    }

    /// A template from a Hugging Face `tokenizer_config.json`: its `chat_template` (a string,
    /// or a list of `{name, template}` of which `default` is used) and `bos_token` /
    /// `eos_token` (strings or `{"content": ...}` objects).
    pub fn from_tokenizer_config(json: &str) -> Result<Self, TemplateError> {
        let config: serde_json::Value = serde_json::from_str(json)?;
        let template = match config.get("chat_template") {
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(serde_json::Value::Array(list)) => list
                .iter()
                .find(|entry| entry.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|entry| entry.get("template"))
                .and_then(|t| t.as_str())
                .ok_or(TemplateError::MissingTemplate)?
                .to_owned(),
            _ => return Err(TemplateError::MissingTemplate),
        };
        let (bos, eos) = special_tokens(&config);
        Self::compile(template, bos, eos)
    }

    /// A template from its Jinja source (vLLM's `--chat-template`), with the BOS/EOS strings
    /// of a Hugging Face `tokenizer_config.json` when one is given.
    pub fn from_source_and_config(
        source: impl Into<String>,
        tokenizer_config: Option<&str>,
    ) -> Result<Self, TemplateError> {
        let (bos, eos) = match tokenizer_config {
            Some(json) => special_tokens(&serde_json::from_str(json)?),
            None => (String::new(), String::new()),
        };
        Self::compile(source.into(), bos, eos)
    }

    /// A template from its Jinja source, with the BOS/EOS strings it may refer to.
    pub fn from_source(
        source: impl Into<String>,
        bos_token: impl Into<String>,
        eos_token: impl Into<String>,
    ) -> Result<Self, TemplateError> {
        Self::compile(source.into(), bos_token.into(), eos_token.into())
    }

    fn compile(
        source: String,
        bos_token: String,
        eos_token: String,
    ) -> Result<Self, TemplateError> {
        let mut env = Environment::new();
        // Hugging Face templates are written for Python's Jinja2: `.strip()`, `.startswith()`…
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_template_owned("chat", source)
            .map_err(|e| TemplateError::Compile(e.to_string()))?;
        Ok(ChatTemplate {
            env,
            bos_token,
            eos_token,
            is_builtin_llama3: false,
        })
    }

    /// Whether this is [`ChatTemplate::llama3`], whose output [`crate::ChatTokens`] can
    /// produce incrementally.
    pub fn is_builtin_llama3(&self) -> bool {
        self.is_builtin_llama3
    }

    pub fn bos_token(&self) -> &str {
        &self.bos_token
    }

    pub fn eos_token(&self) -> &str {
        &self.eos_token
    }

    /// The prompt text for `messages`; with `add_generation_prompt` it ends with the header
    /// that makes the model answer as the assistant.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TemplateError> {
        let template = self
            .env
            .get_template("chat")
            .map_err(|e| TemplateError::Render(e.to_string()))?;
        template
            .render(context! {
                messages => Value::from(minijinja::value::Serde(messages)),
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos_token.as_str(),
                eos_token => self.eos_token.as_str(),
            })
            .map_err(|e| TemplateError::Render(e.to_string()))
    }
}

/// `raise_exception(msg)`: how Hugging Face templates reject a conversation they cannot format.
fn raise_exception(message: String) -> Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
}

/// `bos_token` and `eos_token` of a `tokenizer_config.json` (strings or `{"content": ...}`).
fn special_tokens(config: &serde_json::Value) -> (String, String) {
    let token = |key: &str| match config.get(key) {
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(obj @ serde_json::Value::Object(_)) => obj
            .get("content")
            .and_then(|c| c.as_str())
            .unwrap_or_default()
            .to_owned(),
        _ => String::new(),
    };
    (token("bos_token"), token("eos_token"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conversation() -> Vec<ChatMessage> {
        vec![
            ChatMessage::system("Be brief."),
            ChatMessage::user("  What is a KV cache?\n"),
            ChatMessage::assistant("Stored keys and values."),
        ]
    }

    #[test]
    fn llama3_renders_the_documented_format() {
        let t = ChatTemplate::llama3();
        let text = t.render(&conversation(), true).unwrap();
        assert_eq!(
            text,
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>\
             <|start_header_id|>user<|end_header_id|>\n\nWhat is a KV cache?<|eot_id|>\
             <|start_header_id|>assistant<|end_header_id|>\n\nStored keys and values.<|eot_id|>\
             <|start_header_id|>assistant<|end_header_id|>\n\n"
        );
        let without = t.render(&conversation(), false).unwrap();
        assert!(without.ends_with("values.<|eot_id|>"));
        assert_eq!(t.render(&[], false).unwrap(), "<|begin_of_text|>");
    }

    #[test]
    fn loads_a_tokenizer_config_with_python_methods_and_token_objects() {
        let config = serde_json::json!({
            "bos_token": {"content": "<s>", "lstrip": false},
            "eos_token": "</s>",
            "chat_template": "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'].strip() }} [/INST]{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
        });
        let t = ChatTemplate::from_tokenizer_config(&config.to_string()).unwrap();
        let text = t
            .render(
                &[ChatMessage::user(" hi "), ChatMessage::assistant("hello")],
                false,
            )
            .unwrap();
        assert_eq!(text, "<s>[INST] hi [/INST]hello</s>");
    }

    #[test]
    fn named_template_lists_pick_default() {
        let config = serde_json::json!({
            "chat_template": [
                {"name": "tool_use", "template": "TOOLS"},
                {"name": "default", "template": "{% for m in messages %}{{ m.content }};{% endfor %}"}
            ]
        });
        let t = ChatTemplate::from_tokenizer_config(&config.to_string()).unwrap();
        assert_eq!(
            t.render(&[ChatMessage::user("a"), ChatMessage::user("b")], false)
                .unwrap(),
            "a;b;"
        );
    }

    #[test]
    fn bad_configs_and_raise_exception_are_errors() {
        assert!(matches!(
            ChatTemplate::from_tokenizer_config("{"),
            Err(TemplateError::Json(_))
        ));
        assert!(matches!(
            ChatTemplate::from_tokenizer_config("{}"),
            Err(TemplateError::MissingTemplate)
        ));
        assert!(matches!(
            ChatTemplate::from_source("{% for %}", "", ""),
            Err(TemplateError::Compile(_))
        ));
        let strict = ChatTemplate::from_source(
            "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be the user') }}{% endif %}ok",
            "",
            "",
        )
        .unwrap();
        let err = strict
            .render(&[ChatMessage::assistant("x")], false)
            .unwrap_err();
        assert!(err.to_string().contains("first message must be the user"));
        assert_eq!(
            strict.render(&[ChatMessage::user("x")], false).unwrap(),
            "ok"
        );
    }
}
