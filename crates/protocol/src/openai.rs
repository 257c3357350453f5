//! OpenAI-compatible API types: chat completions, completions, streaming chunks, usage, models.
//!
//! Requests keep every field they do not interpret in `extra` (a `#[serde(flatten)]` map), so a
//! gateway that deserializes a request, reads what it needs and serializes it again forwards
//! unknown fields (`logprobs`, `response_format`, vendor extensions…) to the worker unchanged.
//! Optional fields are skipped when absent, so a round trip does not add `null`s.

use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::{Map, Value};

/// `stream_options` of a streaming request.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StreamOptions {
    /// Send a last chunk with `usage` (and no choices) before `data: [DONE]`.
    #[serde(default)]
    pub include_usage: bool,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// `stop`: one string or several.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

/// The sampling and length fields shared by both request kinds.
///
/// Flattened into [`ChatCompletionRequest`] and [`CompletionRequest`]: on the wire these are
/// ordinary top-level fields.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u32>,
    /// Chat only in OpenAI's API; the newer name of `max_tokens` (wins when both are given).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_completion_tokens: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_options: Option<StreamOptions>,
    /// vLLM extension: generate exactly `max_tokens`, never stop at end-of-sequence.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ignore_eos: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop: Option<Stop>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    /// vLLM extension: return generated token ids in each choice (`token_ids`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub return_token_ids: Option<bool>,
}

impl SamplingParams {
    /// The output length limit: `max_completion_tokens`, else `max_tokens`.
    pub fn max_output_tokens(&self) -> Option<u32> {
        self.max_completion_tokens.or(self.max_tokens)
    }

    /// Whether the response is streamed (SSE).
    pub fn is_stream(&self) -> bool {
        self.stream.unwrap_or(false)
    }

    /// Whether a streamed response ends with a usage chunk.
    pub fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .is_some_and(|options| options.include_usage)
    }

    pub fn ignore_eos(&self) -> bool {
        self.ignore_eos.unwrap_or(false)
    }

    pub fn return_token_ids(&self) -> bool {
        self.return_token_ids.unwrap_or(false)
    }
}

/// One part of a multi-part message `content` (`{"type": "text", "text": "…"}`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// A message's `content`: a string or a list of parts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

/// One message of a chat request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestMessage {
    pub role: String,
    /// Absent or `null` for an assistant message that only calls tools.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<MessageContent>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl RequestMessage {
    /// A plain text message.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        RequestMessage {
            role: role.into(),
            content: Some(MessageContent::Text(content.into())),
            name: None,
            extra: Map::new(),
        }
    }

    /// The message's text: the string, or its text parts joined without separator (other
    /// part types, such as images, carry no text and are skipped).
    pub fn text(&self) -> String {
        match &self.content {
            None => String::new(),
            Some(MessageContent::Text(text)) => text.clone(),
            Some(MessageContent::Parts(parts)) => parts
                .iter()
                .filter_map(|part| part.text.as_deref())
                .collect(),
        }
    }
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatCompletionRequest {
    pub model: String,
    pub messages: Vec<RequestMessage>,
    #[serde(flatten)]
    pub params: SamplingParams,
    /// Every other field, forwarded unchanged.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// A completion request's `prompt`: a string, strings, token ids, or lists of token ids.
///
/// Token ids must fit in `u32`. The batch forms are parsed so a server can refuse them with
/// a clear error (ours serve one prompt per request).
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    Text(String),
    TextBatch(Vec<String>),
    Tokens(Vec<u32>),
    TokenBatch(Vec<Vec<u32>>),
}

impl Prompt {
    /// Number of prompts in the request.
    pub fn len(&self) -> usize {
        match self {
            Prompt::Text(_) | Prompt::Tokens(_) => 1,
            Prompt::TextBatch(batch) => batch.len(),
            Prompt::TokenBatch(batch) => batch.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Serialize for Prompt {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Prompt::Text(text) => text.serialize(serializer),
            Prompt::TextBatch(batch) => batch.serialize(serializer),
            Prompt::Tokens(tokens) => tokens.serialize(serializer),
            Prompt::TokenBatch(batch) => batch.serialize(serializer),
        }
    }
}

impl<'de> Deserialize<'de> for Prompt {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        // Through `Value` so that each malformed shape gets its own message instead of
        // serde's "did not match any variant".
        let value = Value::deserialize(deserializer)?;
        prompt_from_value(value).map_err(D::Error::custom)
    }
}

fn token_from_value(value: &Value) -> Result<u32, String> {
    value
        .as_u64()
        .and_then(|id| u32::try_from(id).ok())
        .ok_or_else(|| format!("prompt token ids must be integers in 0..2^32, got {value}"))
}

fn prompt_from_value(value: Value) -> Result<Prompt, String> {
    let items = match value {
        Value::String(text) => return Ok(Prompt::Text(text)),
        Value::Array(items) => items,
        other => {
            return Err(format!(
                "`prompt` must be a string, an array of strings, an array of token ids or an array of arrays of token ids, got {other}"
            ));
        }
    };
    match items.first() {
        None => Err("`prompt` is an empty array".to_string()),
        Some(Value::String(_)) => items
            .into_iter()
            .map(|item| match item {
                Value::String(text) => Ok(text),
                other => Err(format!("`prompt` mixes strings and {other}")),
            })
            .collect::<Result<_, _>>()
            .map(Prompt::TextBatch),
        Some(Value::Array(_)) => items
            .iter()
            .map(|item| match item {
                Value::Array(tokens) => tokens.iter().map(token_from_value).collect(),
                other => Err(format!("`prompt` mixes token arrays and {other}")),
            })
            .collect::<Result<_, _>>()
            .map(Prompt::TokenBatch),
        Some(_) => items
            .iter()
            .map(token_from_value)
            .collect::<Result<_, _>>()
            .map(Prompt::Tokens),
    }
}

/// `POST /v1/completions`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompletionRequest {
    pub model: String,
    pub prompt: Prompt,
    #[serde(flatten)]
    pub params: SamplingParams,
    /// Every other field, forwarded unchanged.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// The model ended its answer (end of sequence or a stop string).
    Stop,
    /// `max_tokens` was reached.
    Length,
    /// The request was cancelled or failed (vLLM reports `abort`).
    Abort,
}

/// `usage.prompt_tokens_details`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens served from the prefix cache.
    #[serde(default)]
    pub cached_tokens: u32,
}

/// Token counts of a request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub total_tokens: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens_details: Option<PromptTokensDetails>,
}

impl Usage {
    /// Usage with `total_tokens` computed and `cached_tokens` reported.
    pub fn new(prompt_tokens: u32, completion_tokens: u32, cached_tokens: u32) -> Usage {
        Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens.saturating_add(completion_tokens),
            prompt_tokens_details: Some(PromptTokensDetails { cached_tokens }),
        }
    }

    /// `prompt_tokens_details.cached_tokens`, 0 when absent.
    pub fn cached_tokens(&self) -> u32 {
        self.prompt_tokens_details
            .map(|details| details.cached_tokens)
            .unwrap_or(0)
    }
}

/// A message in a chat response.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResponseMessage {
    pub role: String,
    pub content: String,
}

/// One choice of a non-streaming chat response.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatChoice {
    pub index: u32,
    pub message: ResponseMessage,
    pub finish_reason: Option<FinishReason>,
    #[serde(default)]
    pub logprobs: Option<Value>,
    /// Generated token ids, when the request set `return_token_ids`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

/// A non-streaming chat response (`object: "chat.completion"`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatCompletionResponse {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// The new part of a streamed chat message.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatDelta {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
}

/// One choice of a streamed chat chunk.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatChunkChoice {
    pub index: u32,
    pub delta: ChatDelta,
    pub finish_reason: Option<FinishReason>,
    #[serde(default)]
    pub logprobs: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

/// A streamed chat chunk (`object: "chat.completion.chunk"`). The usage chunk has no choices.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatCompletionChunk {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChunkChoice>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// One choice of a completion response or chunk.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompletionChoice {
    pub index: u32,
    pub text: String,
    pub finish_reason: Option<FinishReason>,
    #[serde(default)]
    pub logprobs: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

/// A completion response (`object: "text_completion"`); streamed chunks have the same shape.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompletionResponse {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// `object` values.
pub mod object {
    pub const CHAT_COMPLETION: &str = "chat.completion";
    pub const CHAT_COMPLETION_CHUNK: &str = "chat.completion.chunk";
    pub const TEXT_COMPLETION: &str = "text_completion";
    pub const MODEL: &str = "model";
    pub const LIST: &str = "list";
}

/// One entry of `GET /v1/models`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Model {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub owned_by: String,
    /// vLLM reports the context length here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_model_len: Option<u32>,
}

impl Model {
    pub fn new(id: impl Into<String>, owned_by: impl Into<String>, created: u64) -> Model {
        Model {
            id: id.into(),
            object: object::MODEL.to_string(),
            created,
            owned_by: owned_by.into(),
            max_model_len: None,
        }
    }
}

/// `GET /v1/models`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelList {
    pub object: String,
    pub data: Vec<Model>,
}

impl ModelList {
    pub fn new(data: Vec<Model>) -> ModelList {
        ModelList {
            object: object::LIST.to_string(),
            data,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn chat_request_keeps_unknown_fields_and_round_trips() {
        let body = json!({
            "model": "llama",
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}
            ],
            "max_tokens": 7,
            "stream": true,
            "stream_options": {"include_usage": true},
            "ignore_eos": true,
            "temperature": 0.5,
            "response_format": {"type": "json_object"},
            "nvext": {"annotations": ["x"]}
        });
        let request: ChatCompletionRequest = serde_json::from_value(body.clone()).unwrap();
        assert_eq!(request.params.max_output_tokens(), Some(7));
        assert!(request.params.is_stream());
        assert!(request.params.include_usage());
        assert!(request.params.ignore_eos());
        assert_eq!(request.messages[1].text(), "hi there");
        assert_eq!(
            request.extra["response_format"],
            json!({"type": "json_object"})
        );
        assert_eq!(serde_json::to_value(&request).unwrap(), body);
    }

    #[test]
    fn max_completion_tokens_wins_over_max_tokens() {
        let request: ChatCompletionRequest = serde_json::from_value(json!({
            "model": "m", "messages": [], "max_tokens": 9, "max_completion_tokens": 3
        }))
        .unwrap();
        assert_eq!(request.params.max_output_tokens(), Some(3));
    }

    #[test]
    fn prompt_shapes() {
        let parse = |v: Value| serde_json::from_value::<Prompt>(v);
        assert_eq!(parse(json!("hi")).unwrap(), Prompt::Text("hi".into()));
        assert_eq!(
            parse(json!(["a", "b"])).unwrap(),
            Prompt::TextBatch(vec!["a".into(), "b".into()])
        );
        assert_eq!(
            parse(json!([1, 2, 3])).unwrap(),
            Prompt::Tokens(vec![1, 2, 3])
        );
        assert_eq!(
            parse(json!([[1], [2, 3]])).unwrap(),
            Prompt::TokenBatch(vec![vec![1], vec![2, 3]])
        );
        for bad in [
            json!([]),
            json!([-1]),
            json!([1.5]),
            json!([4294967296u64]),
            json!(["a", 1]),
            json!([[1], 2]),
            json!({"a": 1}),
            json!(null),
        ] {
            let err = parse(bad.clone()).unwrap_err().to_string();
            assert!(err.contains("prompt"), "{bad}: {err}");
        }
        for prompt in [json!("x"), json!(["x"]), json!([7]), json!([[7, 8]])] {
            assert_eq!(
                serde_json::to_value(parse(prompt.clone()).unwrap()).unwrap(),
                prompt
            );
        }
    }

    #[test]
    fn completion_request_round_trips_with_extras() {
        let body =
            json!({"model": "m", "prompt": [1, 2], "max_tokens": 4, "echo": false, "logprobs": 2});
        let request: CompletionRequest = serde_json::from_value(body.clone()).unwrap();
        assert_eq!(request.prompt, Prompt::Tokens(vec![1, 2]));
        assert_eq!(request.extra.len(), 2);
        assert_eq!(serde_json::to_value(&request).unwrap(), body);
    }

    #[test]
    fn usage_serializes_cached_tokens() {
        let usage = Usage::new(100, 20, 64);
        assert_eq!(
            serde_json::to_value(usage).unwrap(),
            json!({"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120,
                   "prompt_tokens_details": {"cached_tokens": 64}})
        );
        let parsed: Usage = serde_json::from_value(
            json!({"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}),
        )
        .unwrap();
        assert_eq!(parsed.cached_tokens(), 0);
    }

    #[test]
    fn finish_reason_names() {
        assert_eq!(
            serde_json::to_value(FinishReason::Length).unwrap(),
            json!("length")
        );
        assert_eq!(
            serde_json::to_value(FinishReason::Stop).unwrap(),
            json!("stop")
        );
    }
}
