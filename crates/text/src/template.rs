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
    /// The template refused the conversation (its `raise_exception`): the client's business.
    #[error("chat template failed to render: {0}")]
    Render(String),
    /// The template itself failed on a valid conversation: out of fuel (an endless loop),
    /// too deep a recursion, or a runtime error of its own. The operator's business.
    #[error("{template} failed: {message}")]
    Failed { template: String, message: String },
}

impl TemplateError {
    /// Whether the template is at fault (not the conversation it was given).
    pub fn is_template_failure(&self) -> bool {
        matches!(self, TemplateError::Failed { .. })
    }
}

/// Fuel of a render before the conversation's share: enough for any real template's own
/// logic (the Llama-3.1 template with tools runs a few thousand instructions).
const FUEL_BASE: u64 = 200_000;
/// Fuel per message: the built-in template spends about 10 (see the tests' measurement).
const FUEL_PER_MESSAGE: u64 = 500;
/// Bytes of message content per unit of fuel: minijinja charges one per 64 bytes of data
/// it reads in filters, builds or writes (the built-in template spends about 3 per 64 bytes
/// of content: `trim`, its result, the output), so 1 per 2 bytes leaves a template room to
/// go over each message ten times.
const CONTENT_BYTES_PER_FUEL: u64 = 2;
/// Deepest macro or include recursion: chat templates recurse a few levels at most
/// (formatting nested JSON schemas of tools); minijinja's own default is 500.
const RECURSION_LIMIT: usize = 64;

/// The fuel a render of `messages` gets: a budget that bounds its time and memory (see
/// minijinja's `set_fuel`) while growing with the conversation, so that no valid
/// conversation is too long for a sound template and no template loops forever.
pub fn fuel_for(messages: &[ChatMessage]) -> u64 {
    let bytes: u64 = messages
        .iter()
        .map(|m| (m.role.len() + m.content.len()) as u64)
        .sum();
    FUEL_BASE + FUEL_PER_MESSAGE * messages.len() as u64 + bytes / CONTENT_BYTES_PER_FUEL
}

/// Marks the error of the template's `raise_exception`, to tell it from the template's own
/// failures.
#[derive(Debug)]
struct RaisedByTemplate;

impl std::fmt::Display for RaisedByTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("raised by the template")
    }
}

impl std::error::Error for RaisedByTemplate {}

/// The conversation rendered once when a template is loaded, so that a template that fails
/// (or runs out of fuel) on any chat is refused at start-up, not on every request.
fn smoke_conversation() -> [ChatMessage; 3] {
    [
        ChatMessage::user("Hello."),
        ChatMessage::assistant("Hello! How can I help?"),
        ChatMessage::user("Tell me about KV caches."),
    ]
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
    /// What error messages call it ("the chat template FILE", "the built-in Llama-3 template").
    name: String,
    bos_token: String,
    eos_token: String,
    is_builtin_llama3: bool,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("name", &self.name)
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
        .expect("the built-in template compiles and renders");
        me.is_builtin_llama3 = true;
        me.name = "the built-in Llama-3 template".to_string();
        me
    }

    /// The same template, called `name` in error messages ("the chat template FILE").
    pub fn named(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// Where it came from, as error messages name it.
    pub fn name(&self) -> &str {
        &self.name
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
        env.set_recursion_limit(RECURSION_LIMIT);
        env.add_template_owned("chat", source)
            .map_err(|e| TemplateError::Compile(e.to_string()))?;
        let template = ChatTemplate {
            env,
            name: "the chat template".to_string(),
            bos_token,
            eos_token,
            is_builtin_llama3: false,
        };
        // A template that fails on a plain chat would fail every request: refuse it now. One
        // that refuses the chat itself (`raise_exception`: say, it wants a system message)
        // may still serve others.
        match template.render(&smoke_conversation(), true) {
            Err(TemplateError::Failed { message, .. }) => Err(TemplateError::Compile(format!(
                "it fails on a three-message chat: {message}"
            ))),
            _ => Ok(template),
        }
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
        // Fuel is set per environment: a copy (its templates and functions are shared, not
        // copied) carries this conversation's budget.
        let mut env = self.env.clone();
        let fuel = fuel_for(messages);
        env.set_fuel(Some(fuel));
        let failed = |e: minijinja::Error| self.failure(e, fuel);
        env.get_template("chat")
            .map_err(failed)?
            .render(context! {
                messages => Value::from(minijinja::value::Serde(messages)),
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos_token.as_str(),
                eos_token => self.eos_token.as_str(),
            })
            .map_err(failed)
    }

    /// A render's error: the template's `raise_exception` refusing the conversation, or the
    /// template failing (fuel, recursion, its own bugs), named.
    fn failure(&self, error: minijinja::Error, fuel: u64) -> TemplateError {
        let raised = std::error::Error::source(&error).is_some_and(|s| s.is::<RaisedByTemplate>());
        if raised {
            return TemplateError::Render(error.to_string());
        }
        let message = match error.kind() {
            ErrorKind::OutOfFuel => format!(
                "it did more work than this conversation allows ({fuel} units of minijinja \
                 fuel): an endless or runaway loop?"
            ),
            _ => error.to_string(),
        };
        TemplateError::Failed {
            template: self.name.clone(),
            message,
        }
    }
}

/// `raise_exception(msg)`: how Hugging Face templates reject a conversation they cannot format.
fn raise_exception(message: String) -> Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message).with_source(RaisedByTemplate))
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

#[cfg(test)]
mod limits {
    use super::*;

    /// Fuel the template spends on `messages` (rendered with a generation prompt), with the
    /// budget [`ChatTemplate::render`] gives it.
    fn fuel_spent(template: &ChatTemplate, messages: &[ChatMessage]) -> (u64, u64) {
        let budget = fuel_for(messages);
        let mut env = template.env.clone();
        env.set_fuel(Some(budget));
        let captured = env
            .get_template("chat")
            .unwrap()
            .render_captured(context! {
                messages => Value::from(minijinja::value::Serde(messages)),
                add_generation_prompt => true,
                bos_token => template.bos_token.as_str(),
                eos_token => template.eos_token.as_str(),
            })
            .unwrap();
        let (spent, _) = captured.state().fuel_levels().expect("fuel is on");
        (spent, budget)
    }

    #[test]
    fn the_built_in_template_spends_a_small_share_of_its_budget_on_the_longest_chats() {
        let llama3 = ChatTemplate::llama3();
        // The gateway takes bodies up to 16 MiB: one huge message, or as many tiny ones as
        // fit, or a long multi-turn chat.
        let cases = [
            (
                "one 16 MiB message",
                vec![ChatMessage::user("x".repeat(16 << 20))],
            ),
            (
                "100,000 one-byte messages",
                (0..100_000).map(|_| ChatMessage::user("x")).collect(),
            ),
            (
                "2,000 messages of 8 KiB",
                (0..2_000)
                    .map(|i| ChatMessage::new(["user", "assistant"][i % 2], "y".repeat(8 << 10)))
                    .collect(),
            ),
        ];
        for (what, messages) in cases {
            let (spent, budget) = fuel_spent(&llama3, &messages);
            eprintln!("{what}: {spent} of {budget} fuel");
            assert!(
                spent * 10 <= budget,
                "{what}: spent {spent} of {budget} fuel"
            );
        }
    }

    fn refused_at_load(source: &str) -> String {
        match ChatTemplate::from_source(source, "<s>", "</s>") {
            Err(TemplateError::Compile(message)) => message,
            other => panic!("{source}: loaded, {other:?}"),
        }
    }

    #[test]
    fn a_template_that_loops_recurses_or_fails_on_every_chat_is_refused_at_load() {
        let endless = refused_at_load(
            "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
        );
        assert!(
            endless.contains("more work than this conversation allows"),
            "{endless}"
        );
        let huge_range = refused_at_load("{% for i in range(100000000) %}{{ i }}{% endfor %}");
        assert!(huge_range.contains("too many elements"), "{huge_range}");
        let recursion = refused_at_load("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}");
        assert!(recursion.contains("recursion"), "{recursion}");
        let huge_output = refused_at_load(
            "{% set s = 'x' * 1000000 %}{% for i in range(100000) %}{{ s }}{% endfor %}",
        );
        assert!(huge_output.contains("more work"), "{huge_output}");
    }

    #[test]
    fn a_template_that_loops_on_some_chats_fails_them_naming_itself() {
        let template = ChatTemplate::from_source(
            "{% if messages | length > 3 %}{% for i in range(100000) %}\
             {% for j in range(100000) %}x{% endfor %}{% endfor %}{% endif %}\
             {% for m in messages %}{{ m.content }}{% endfor %}",
            "",
            "",
        )
        .expect("fine on the three-message smoke chat")
        .named("the chat template loops.jinja");
        let four = vec![ChatMessage::user("a"); 4];
        let error = template.render(&four, true).unwrap_err();
        assert!(error.is_template_failure());
        let message = error.to_string();
        assert!(
            message.starts_with("the chat template loops.jinja failed: it did more work"),
            "{message}"
        );
        // Shorter chats are served.
        assert_eq!(template.render(&four[..2], true).unwrap(), "aa");
    }

    #[test]
    fn a_template_refusing_a_chat_is_the_clients_error_not_a_failure() {
        let template = ChatTemplate::from_source(
            "{% if messages[0].role == 'system' %}{{ raise_exception('no system messages') }}\
             {% endif %}{% for m in messages %}{{ m.content }}{% endfor %}",
            "",
            "",
        )
        .unwrap();
        let error = template
            .render(&[ChatMessage::system("s")], false)
            .unwrap_err();
        assert!(!error.is_template_failure(), "{error:?}");
        assert!(error.to_string().contains("no system messages"), "{error}");
    }
}
