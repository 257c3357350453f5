//! OpenAI-compatible API types: chat completions, completions, streaming chunks, usage, models.
//!
//! Requests keep every field they do not interpret in `extra` (a `#[serde(flatten)]` map), so a
//! gateway that deserializes a request, reads what it needs and serializes it again forwards
//! unknown fields (`logprobs`, `response_format`, vendor extensions…) to the worker unchanged.
//! Optional fields are skipped when absent, so a round trip does not add `null`s.
//!
//! Responses and stream chunks have one reader and one writer, both borrowed: the relay reads
//! a worker's chunk ([`ResponseView`]) and writes the client's ([`ResponseHead::write_chunk`])
//! without allocating per chunk beyond the list of choices; the engine server writes with the
//! same [`ResponseHead`], the load generator reads with the same [`ResponseView`].

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

use bytes::BytesMut;
use serde::de::{self, SeqAccess, Visitor};
use serde::ser::SerializeStruct;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use crate::error::ErrorDetail;
use crate::sse;

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
#[serde(untagged, expecting = "`stop` must be a string or a list of strings")]
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
    /// 0 to 2, as OpenAI accepts it.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "temperature"
    )]
    pub temperature: Option<f64>,
    /// Above 0, at most 1.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "top_p"
    )]
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
    /// vLLM extension for disaggregated prefill/decode (see [`KvTransferParams`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_transfer_params: Option<KvTransferParams>,
}

/// vLLM's `kv_transfer_params`, as its disaggregated-serving proxy and Dynamo pass them: the
/// proxy sends the prompt to a prefill worker with `do_remote_decode: true` (and
/// `max_tokens: 1`); the prefill worker answers with the parameters a decode worker needs to
/// pull the KV (`do_remote_prefill: true`, the remote engine, its blocks and address), which
/// the proxy puts on the same request sent to a decode worker. Fields this project does not
/// interpret are kept in `extra` and forwarded as they came.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct KvTransferParams {
    #[serde(default)]
    pub do_remote_decode: bool,
    #[serde(default)]
    pub do_remote_prefill: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_engine_id: Option<String>,
    /// Block ids on the prefill worker: a list of integers (a list of lists for hybrid
    /// models), kept as JSON so any engine's form passes through.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_block_ids: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_host: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_port: Option<u16>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tp_size: Option<u32>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
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
#[serde(
    untagged,
    expecting = "a message's `content` must be a string or a list of content parts ({\"type\": \"text\", \"text\": ...})"
)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

/// The roles OpenAI's chat API accepts.
pub const CHAT_ROLES: [&str; 6] = [
    "system",
    "developer",
    "user",
    "assistant",
    "tool",
    "function",
];

/// One message of a chat request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestMessage {
    /// One of [`CHAT_ROLES`].
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

/// `messages`: at least one, each with a known role, and content unless it is an assistant
/// message (which may carry only tool calls). OpenAI answers 400 to the others; so do we,
/// naming the message.
fn checked_messages<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<Vec<RequestMessage>, D::Error> {
    use serde::de::Error;
    let messages = Vec::<RequestMessage>::deserialize(deserializer)?;
    if messages.is_empty() {
        return Err(D::Error::custom(
            "`messages` must hold at least one message",
        ));
    }
    for (i, m) in messages.iter().enumerate() {
        if !CHAT_ROLES.contains(&m.role.as_str()) {
            return Err(D::Error::custom(format_args!(
                "messages[{i}].role `{}` is not one of: {}",
                m.role,
                CHAT_ROLES.join(", ")
            )));
        }
        if m.content.is_none() && m.role != "assistant" {
            return Err(D::Error::custom(format_args!(
                "messages[{i}] ({} message) has no content",
                m.role
            )));
        }
    }
    Ok(messages)
}

fn bounded_f64<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
    name: &str,
    ok: impl Fn(f64) -> bool,
    range: &str,
) -> Result<Option<f64>, D::Error> {
    use serde::de::Error;
    match Option::<f64>::deserialize(deserializer)? {
        Some(v) if !ok(v) => Err(D::Error::custom(format_args!(
            "`{name}` is {v}; it must be {range}"
        ))),
        v => Ok(v),
    }
}

fn temperature<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
    bounded_f64(
        d,
        "temperature",
        |v| (0.0..=2.0).contains(&v),
        "between 0 and 2",
    )
}

fn top_p<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
    bounded_f64(d, "top_p", |v| v > 0.0 && v <= 1.0, "above 0 and at most 1")
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatCompletionRequest {
    pub model: String,
    #[serde(deserialize_with = "checked_messages")]
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
        // A visitor rather than `#[serde(untagged)]`, so that each malformed shape gets its
        // own message naming `prompt` instead of "did not match any variant".
        match deserializer.deserialize_any(PromptVisitor { nested: false })? {
            PromptItem::Text(text) => Ok(Prompt::Text(text)),
            PromptItem::Batch(prompt) => Ok(prompt),
            other @ (PromptItem::Token(_) | PromptItem::Tokens(_)) => Err(de::Error::custom(
                format_args!("`prompt` must be a string or an array, got {other}"),
            )),
        }
    }
}

/// `prompt` (not `nested`) or one item of its array (`nested`).
struct PromptVisitor {
    nested: bool,
}

/// What [`PromptVisitor`] read.
enum PromptItem {
    Text(String),
    Token(u32),
    Tokens(Vec<u32>),
    /// A whole `prompt` array.
    Batch(Prompt),
}

impl<'de> Visitor<'de> for PromptVisitor {
    type Value = PromptItem;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(if self.nested {
            "a string, a token id or an array of token ids in `prompt`"
        } else {
            "`prompt` as a string, an array of strings, an array of token ids or an array of arrays of token ids"
        })
    }

    fn visit_str<E: de::Error>(self, text: &str) -> Result<PromptItem, E> {
        Ok(PromptItem::Text(text.to_owned()))
    }

    fn visit_string<E: de::Error>(self, text: String) -> Result<PromptItem, E> {
        Ok(PromptItem::Text(text))
    }

    fn visit_u64<E: de::Error>(self, id: u64) -> Result<PromptItem, E> {
        u32::try_from(id)
            .map(PromptItem::Token)
            .map_err(|_| bad_token_id(id))
    }

    fn visit_i64<E: de::Error>(self, id: i64) -> Result<PromptItem, E> {
        u32::try_from(id)
            .map(PromptItem::Token)
            .map_err(|_| bad_token_id(id))
    }

    fn visit_f64<E: de::Error>(self, id: f64) -> Result<PromptItem, E> {
        Err(bad_token_id(id))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<PromptItem, A::Error> {
        if self.nested {
            return same_shape(seq, Vec::new(), "token ids", PromptItem::token)
                .map(PromptItem::Tokens);
        }
        // The first item decides the shape; every other item must have it too.
        let prompt = match seq.next_element::<PromptItem>()? {
            None => return Err(de::Error::custom("`prompt` is an empty array")),
            Some(PromptItem::Text(text)) => {
                same_shape(seq, vec![text], "strings", |item| match item {
                    PromptItem::Text(text) => Ok(text),
                    other => Err(other),
                })
                .map(Prompt::TextBatch)
            }
            Some(PromptItem::Token(id)) => {
                same_shape(seq, vec![id], "token ids", PromptItem::token).map(Prompt::Tokens)
            }
            Some(PromptItem::Tokens(ids)) => {
                same_shape(seq, vec![ids], "token arrays", |item| match item {
                    PromptItem::Tokens(ids) => Ok(ids),
                    other => Err(other),
                })
                .map(Prompt::TokenBatch)
            }
            // Items are read `nested`, which never gives a batch.
            Some(other @ PromptItem::Batch(_)) => Err(de::Error::custom(format_args!(
                "`prompt` holds an unexpected {other}"
            ))),
        };
        prompt.map(PromptItem::Batch)
    }
}

impl<'de> Deserialize<'de> for PromptItem {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(PromptVisitor { nested: true })
    }
}

/// Reads the rest of a `prompt` array, whose items must all have one shape (`take` says
/// which, handing back an item of another).
fn same_shape<'de, A: SeqAccess<'de>, T>(
    mut seq: A,
    mut items: Vec<T>,
    shape: &str,
    take: fn(PromptItem) -> Result<T, PromptItem>,
) -> Result<Vec<T>, A::Error> {
    while let Some(item) = seq.next_element::<PromptItem>()? {
        match take(item) {
            Ok(item) => items.push(item),
            Err(other) => {
                return Err(de::Error::custom(format_args!(
                    "`prompt` mixes {shape} and {other}"
                )));
            }
        }
    }
    Ok(items)
}

impl PromptItem {
    fn token(self) -> Result<u32, PromptItem> {
        match self {
            PromptItem::Token(id) => Ok(id),
            other => Err(other),
        }
    }
}

impl fmt::Display for PromptItem {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        match self {
            PromptItem::Text(text) => write!(f, "{text:?}"),
            PromptItem::Token(id) => write!(f, "{id}"),
            PromptItem::Tokens(ids) => write!(f, "{ids:?}"),
            PromptItem::Batch(prompt) => write!(f, "{prompt:?}"),
        }
    }
}

/// Why a number is not a token id.
fn bad_token_id<E: de::Error>(id: impl fmt::Display) -> E {
    E::custom(format_args!(
        "prompt token ids must be integers in 0..2^32, got {id}"
    ))
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

/// What the two request kinds share, for a server that handles both the same way.
pub trait ApiRequest: serde::de::DeserializeOwned {
    /// The API the request calls.
    const API: Api;
    fn model(&self) -> &str;
    fn params(&self) -> &SamplingParams;
    /// `model`, `params` and the fields not interpreted (`extra`), taken out.
    fn into_parts(self) -> (String, SamplingParams, Map<String, Value>);
}

/// Both request kinds have `model`, `params` and `extra`.
macro_rules! api_request {
    ($request:ty, $api:expr) => {
        impl ApiRequest for $request {
            const API: Api = $api;
            fn model(&self) -> &str {
                &self.model
            }
            fn params(&self) -> &SamplingParams {
                &self.params
            }
            fn into_parts(self) -> (String, SamplingParams, Map<String, Value>) {
                (self.model, self.params, self.extra)
            }
        }
    };
}

api_request!(ChatCompletionRequest, Api::Chat);
api_request!(CompletionRequest, Api::Completion);

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

impl FinishReason {
    /// The name on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        }
    }
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

/// Which API a response answers: decides its `object` and the shape of its choices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    Chat,
    Completion,
}

impl Api {
    /// `object` of a whole response (`stream: false`) or of a stream chunk.
    pub fn object(self, stream: bool) -> &'static str {
        match (self, stream) {
            (Api::Chat, true) => "chat.completion.chunk",
            (Api::Chat, false) => "chat.completion",
            (Api::Completion, _) => "text_completion",
        }
    }

    /// The request field that holds the prompt, for errors about it.
    pub fn prompt_field(self) -> &'static str {
        match self {
            Api::Chat => "messages",
            Api::Completion => "prompt",
        }
    }

    /// Prefix of response ids, as OpenAI's: `chatcmpl` or `cmpl`.
    pub fn id_prefix(self) -> &'static str {
        match self {
            Api::Chat => "chatcmpl",
            Api::Completion => "cmpl",
        }
    }
}

// ---- Responses and stream chunks as read: borrowed, for the relay and the load generator.

/// A response or a stream chunk as read, borrowing its text from the input. It reads chat and
/// completion responses alike: what a client or a relay needs, nothing else.
#[derive(Debug, Deserialize)]
pub struct ResponseView<'a> {
    #[serde(borrow, default)]
    pub choices: Vec<ChoiceView<'a>>,
    #[serde(default)]
    pub usage: Option<Usage>,
    /// An error reported in the middle of a stream.
    #[serde(default)]
    pub error: Option<ErrorDetail>,
}

/// One choice of a [`ResponseView`].
#[derive(Debug, Deserialize)]
pub struct ChoiceView<'a> {
    #[serde(default)]
    pub index: u32,
    /// A completion's text (empty for chat).
    #[serde(borrow, default)]
    pub text: Cow<'a, str>,
    /// A chat stream chunk's new part.
    #[serde(borrow, default)]
    pub delta: Option<MessageView<'a>>,
    /// A whole chat response's message.
    #[serde(borrow, default)]
    pub message: Option<MessageView<'a>>,
    #[serde(borrow, default)]
    pub logprobs: Option<&'a RawValue>,
    #[serde(borrow, default, deserialize_with = "borrowed_str")]
    pub finish_reason: Option<Cow<'a, str>>,
    /// Generated token ids (vLLM's `return_token_ids`), kept raw for relaying.
    #[serde(borrow, default)]
    pub token_ids: Option<&'a RawValue>,
}

/// A chat message or delta as read.
#[derive(Debug, Default, Deserialize)]
pub struct MessageView<'a> {
    #[serde(borrow, default, deserialize_with = "borrowed_str")]
    pub role: Option<Cow<'a, str>>,
    #[serde(borrow, default, deserialize_with = "borrowed_str")]
    pub content: Option<Cow<'a, str>>,
}

/// An optional string borrowed from the input (serde borrows a `Cow` only at the top of a
/// field, not inside an `Option`); `null` is `None`.
fn borrowed_str<'de: 'a, 'a, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<Cow<'a, str>>, D::Error> {
    #[derive(Deserialize)]
    struct Borrowed<'a>(#[serde(borrow)] Cow<'a, str>);
    Ok(Option::<Borrowed<'a>>::deserialize(deserializer)?.map(|b| b.0))
}

impl ChoiceView<'_> {
    /// The new text: a chat delta's or message's `content`, else a completion's `text`.
    pub fn content(&self) -> &str {
        self.delta
            .as_ref()
            .or(self.message.as_ref())
            .and_then(|m| m.content.as_deref())
            .unwrap_or(&self.text)
    }

    /// The number of ids in `token_ids`, when the server sent them (counted on the raw JSON,
    /// without parsing the ids).
    pub fn token_id_count(&self) -> Option<u64> {
        self.token_ids.map(|ids| {
            let raw = ids.get();
            if raw.bytes().any(|b| b.is_ascii_digit()) {
                raw.bytes().filter(|b| *b == b',').count() as u64 + 1
            } else {
                0
            }
        })
    }
}

// ---- Responses and stream chunks as written: borrowed, no intermediate allocation.

/// What every response and stream chunk of one request repeats; writes them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponseHead {
    pub api: Api,
    /// `chatcmpl-…` or `cmpl-…`.
    pub id: String,
    /// Shared by every request of a server.
    pub model: Arc<str>,
    /// Unix seconds.
    pub created: u64,
}

/// One choice to write.
#[derive(Debug, Clone, Copy, Default)]
pub struct ChoiceOut<'a> {
    pub index: u32,
    /// Chat only: the `role` of a delta (on the first chunk) or of a message (`assistant`
    /// when `None`).
    pub role: Option<&'a str>,
    /// Chat: the `content` of a delta (left out when `None`) or of a message; completions:
    /// `text` (`""` when `None`).
    pub content: Option<&'a str>,
    /// Written as is (`null` when `None`).
    pub logprobs: Option<&'a RawValue>,
    pub finish_reason: Option<&'a str>,
    /// Left out when `None`.
    pub token_ids: Option<TokenIds<'a>>,
}

/// `token_ids` to write: relayed raw, or from a slice.
#[derive(Debug, Clone, Copy, Serialize)]
#[serde(untagged)]
pub enum TokenIds<'a> {
    Raw(&'a RawValue),
    Ids(&'a [u32]),
}

impl ResponseHead {
    /// Appends one stream chunk as an SSE event. The last chunk of `include_usage` has no
    /// choices and the usage.
    pub fn write_chunk<'c>(
        &self,
        out: &mut BytesMut,
        choices: impl Iterator<Item = ChoiceOut<'c>> + Clone,
        usage: Option<&Usage>,
    ) -> Result<(), serde_json::Error> {
        sse::write_event(
            out,
            &Envelope {
                head: self,
                stream: true,
                choices: Choices(choices),
                usage,
            },
        )
    }

    /// A whole (not streamed) response as JSON.
    pub fn response_json<'c>(
        &self,
        choices: impl Iterator<Item = ChoiceOut<'c>> + Clone,
        usage: Option<&Usage>,
    ) -> Result<Vec<u8>, serde_json::Error> {
        serde_json::to_vec(&Envelope {
            head: self,
            stream: false,
            choices: Choices(choices),
            usage,
        })
    }
}

struct Envelope<'h, I> {
    head: &'h ResponseHead,
    stream: bool,
    choices: Choices<I>,
    usage: Option<&'h Usage>,
}

impl<'c, I: Iterator<Item = ChoiceOut<'c>> + Clone> Serialize for Envelope<'_, I> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let head = self.head;
        let mut out = serializer.serialize_struct("Response", 6)?;
        out.serialize_field("id", &head.id)?;
        out.serialize_field("object", head.api.object(self.stream))?;
        out.serialize_field("created", &head.created)?;
        out.serialize_field("model", &*head.model)?;
        out.serialize_field(
            "choices",
            &ChoicesAs {
                api: head.api,
                stream: self.stream,
                choices: &self.choices,
            },
        )?;
        if let Some(usage) = self.usage {
            out.serialize_field("usage", usage)?;
        }
        out.end()
    }
}

/// Choices written straight from an iterator, without collecting them.
struct Choices<I>(I);

struct ChoicesAs<'a, I> {
    api: Api,
    stream: bool,
    choices: &'a Choices<I>,
}

impl<'c, I: Iterator<Item = ChoiceOut<'c>> + Clone> Serialize for ChoicesAs<'_, I> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(self.choices.0.clone().map(|choice| ChoiceAs {
            api: self.api,
            stream: self.stream,
            choice,
        }))
    }
}

/// One choice in its API's shape: a chat delta, a chat message, or a completion's text.
struct ChoiceAs<'c> {
    api: Api,
    stream: bool,
    choice: ChoiceOut<'c>,
}

#[derive(Serialize)]
struct MessageOut<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    content: Option<&'a str>,
}

impl Serialize for ChoiceAs<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let c = &self.choice;
        let mut out = serializer.serialize_struct("Choice", 5)?;
        out.serialize_field("index", &c.index)?;
        match (self.api, self.stream) {
            (Api::Chat, true) => out.serialize_field(
                "delta",
                &MessageOut {
                    role: c.role,
                    content: c.content,
                },
            )?,
            (Api::Chat, false) => out.serialize_field(
                "message",
                &MessageOut {
                    role: Some(c.role.unwrap_or("assistant")),
                    content: Some(c.content.unwrap_or("")),
                },
            )?,
            (Api::Completion, _) => out.serialize_field("text", c.content.unwrap_or(""))?,
        }
        out.serialize_field("logprobs", &c.logprobs)?;
        out.serialize_field("finish_reason", &c.finish_reason)?;
        if let Some(ids) = &c.token_ids {
            out.serialize_field("token_ids", ids)?;
        }
        out.end()
    }
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
            object: "model".to_string(),
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
            object: "list".to_string(),
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
            "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9, "max_completion_tokens": 3
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
        for reason in [
            FinishReason::Stop,
            FinishReason::Length,
            FinishReason::Abort,
        ] {
            assert_eq!(
                serde_json::to_value(reason).unwrap(),
                json!(reason.as_str())
            );
        }
    }

    fn head(api: Api) -> ResponseHead {
        ResponseHead {
            api,
            id: "x-1".into(),
            model: "m".into(),
            created: 7,
        }
    }

    /// One chunk written as an SSE event, read back as JSON.
    fn chunk_json(api: Api, choice: Option<ChoiceOut<'_>>, usage: Option<&Usage>) -> Value {
        let mut out = BytesMut::new();
        head(api)
            .write_chunk(&mut out, choice.into_iter(), usage)
            .unwrap();
        let text = std::str::from_utf8(&out).unwrap();
        let payload = text
            .strip_prefix("data: ")
            .unwrap()
            .strip_suffix("\n\n")
            .unwrap();
        serde_json::from_str(payload).unwrap()
    }

    #[test]
    fn chunks_are_written_in_each_apis_shape() {
        let ids = [5u32, 6];
        let choice = ChoiceOut {
            role: Some("assistant"),
            content: Some("hi"),
            token_ids: Some(TokenIds::Ids(&ids)),
            ..ChoiceOut::default()
        };
        assert_eq!(
            chunk_json(Api::Chat, Some(choice), None),
            json!({"id": "x-1", "object": "chat.completion.chunk", "created": 7, "model": "m",
                   "choices": [{"index": 0, "delta": {"role": "assistant", "content": "hi"},
                                "logprobs": null, "finish_reason": null, "token_ids": [5, 6]}]})
        );
        let last = ChoiceOut {
            finish_reason: Some(FinishReason::Length.as_str()),
            ..ChoiceOut::default()
        };
        assert_eq!(
            chunk_json(Api::Completion, Some(last), None),
            json!({"id": "x-1", "object": "text_completion", "created": 7, "model": "m",
                   "choices": [{"index": 0, "text": "", "logprobs": null, "finish_reason": "length"}]})
        );
        let chunk = chunk_json(Api::Chat, None, Some(&Usage::new(10, 2, 8)));
        assert_eq!(chunk["choices"], json!([]));
        assert_eq!(chunk["usage"]["prompt_tokens_details"]["cached_tokens"], 8);
    }

    #[test]
    fn whole_responses_carry_messages() {
        let choice = ChoiceOut {
            content: Some("answer"),
            finish_reason: Some("stop"),
            ..ChoiceOut::default()
        };
        let usage = Usage::new(3, 1, 0);
        let body = head(Api::Chat)
            .response_json(std::iter::once(choice), Some(&usage))
            .unwrap();
        let value: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(value["object"], "chat.completion");
        assert_eq!(
            value["choices"][0]["message"],
            json!({"role": "assistant", "content": "answer"})
        );
        assert_eq!(value["usage"]["total_tokens"], 4);
        let view: ResponseView<'_> = serde_json::from_slice(&body).unwrap();
        assert_eq!(view.choices[0].content(), "answer");
        assert_eq!(view.usage, Some(usage));
    }

    #[test]
    fn views_borrow_what_they_read() {
        let chunk = r#"{"id":"c","choices":[{"index":1,"delta":{"role":"assistant","content":"he"},"logprobs":null,"finish_reason":null,"token_ids":[1,2,3]}]}"#;
        let view: ResponseView<'_> = serde_json::from_str(chunk).unwrap();
        let choice = &view.choices[0];
        assert_eq!((choice.index, choice.content()), (1, "he"));
        assert!(matches!(
            choice.delta.as_ref().and_then(|d| d.content.as_ref()),
            Some(Cow::Borrowed(_))
        ));
        assert_eq!(choice.token_id_count(), Some(3));
        assert!(choice.logprobs.is_none() && choice.finish_reason.is_none());

        let text =
            r#"{"choices":[{"text":"x","finish_reason":"length","token_ids":[]}],"usage":null}"#;
        let view: ResponseView<'_> = serde_json::from_str(text).unwrap();
        assert_eq!(view.choices[0].content(), "x");
        assert_eq!(view.choices[0].finish_reason.as_deref(), Some("length"));
        assert_eq!(view.choices[0].token_id_count(), Some(0));

        let error = r#"{"error":{"message":"boom","type":"server_error"}}"#;
        let view: ResponseView<'_> = serde_json::from_str(error).unwrap();
        assert_eq!(view.error.map(|e| e.message), Some("boom".to_string()));
    }
}
