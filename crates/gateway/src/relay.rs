//! The streaming relay: a worker's `/v1/completions` SSE stream in, the client's chat or
//! completion stream (or one aggregated response) out.
//!
//! Cost per upstream event: one incremental SSE decode, one JSON parse that borrows the text
//! from the event, one JSON write into a buffer that collects everything decoded from the same
//! network read, so the client gets one body frame per upstream read, not per token.
//!
//! Whatever ends a request — `[DONE]`, a broken worker stream, the client going away (the
//! body stream is dropped, which drops the upstream response and so cancels the worker's
//! request) — releases its [`Ticket`] and records its metrics exactly once
//! ([`RequestRecord`]'s `Drop`).

use std::borrow::Cow;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{BufMut, Bytes, BytesMut};
use futures::StreamExt;
use futures::stream::BoxStream;
use protocol::{ApiError, ErrorBody, ErrorDetail, Usage};
use serde::ser::SerializeSeq;
use serde::{Deserialize, Serialize, Serializer};
use serde_json::value::RawValue;

use crate::dispatch::Ticket;
use crate::metrics::{Endpoint, Metrics};
use crate::sse::{DONE, SseReader};

/// Which API the client called; decides the output shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    Chat,
    Completion,
}

impl Api {
    pub fn endpoint(self) -> Endpoint {
        match self {
            Api::Chat => Endpoint::ChatCompletions,
            Api::Completion => Endpoint::Completions,
        }
    }
}

/// Most choices (`n`) aggregated for a non-streaming response.
pub const MAX_CHOICES: usize = 128;

/// Initial capacity of each client body frame.
const FRAME_CAPACITY: usize = 512;

/// Longest upstream SSE event accepted.
pub const MAX_EVENT_BYTES: usize = 1 << 20;

/// A request's metrics, recorded once when it ends, however it ends.
#[derive(Debug)]
pub struct RequestRecord {
    metrics: Arc<Metrics>,
    endpoint: Endpoint,
    stream: bool,
    started: Instant,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    pub output_tokens: u64,
    /// Set once the prompt is known (routing happened).
    pub prompt_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
    pub success: bool,
    /// The gateway's own time before forwarding (queue waits excluded), once forwarded.
    pub pre_forward: Option<Duration>,
}

impl RequestRecord {
    /// Starts counting a request (in flight from now).
    pub fn start(metrics: Arc<Metrics>, endpoint: Endpoint, stream: bool) -> RequestRecord {
        metrics.inflight.inc();
        RequestRecord {
            metrics,
            endpoint,
            stream,
            started: Instant::now(),
            first_token: None,
            last_token: None,
            output_tokens: 0,
            prompt_tokens: None,
            cached_tokens: None,
            success: false,
            pre_forward: None,
        }
    }

    /// When the request arrived.
    pub fn started(&self) -> Instant {
        self.started
    }

    pub fn set_stream(&mut self, stream: bool) {
        self.stream = stream;
    }

    /// `n` tokens arrived now. Returns whether they are the request's first.
    fn tokens(&mut self, n: u64, now: Instant) -> bool {
        if n == 0 {
            return false;
        }
        self.output_tokens += n;
        self.metrics.output_tokens_total.inc_by(n);
        let first = match self.last_token {
            None => {
                self.first_token = Some(now);
                self.metrics
                    .ttft
                    .observe(now.duration_since(self.started).as_secs_f64());
                // The other tokens of a first chunk came with no gap.
                self.metrics.itl.observe_n(0.0, n - 1);
                true
            }
            Some(last) => {
                let gap = now.duration_since(last).as_secs_f64() / n as f64;
                self.metrics.itl.observe_n(gap, n);
                false
            }
        };
        self.last_token = Some(now);
        first
    }
}

impl Drop for RequestRecord {
    fn drop(&mut self) {
        let m = &self.metrics;
        m.inflight.dec();
        m.count_request(self.endpoint, self.stream, self.success);
        m.duration.observe(self.started.elapsed().as_secs_f64());
        if let Some(prompt) = self.prompt_tokens {
            m.input_tokens.observe(prompt as f64);
            m.cached_tokens
                .observe(self.cached_tokens.unwrap_or(0) as f64);
            m.output_tokens.observe(self.output_tokens as f64);
        }
    }
}

/// Per-request constants of the output.
#[derive(Debug, Clone)]
pub struct OutputCtx {
    pub api: Api,
    /// `chatcmpl-…` or `cmpl-…`.
    pub id: String,
    pub model: Arc<str>,
    pub created: u64,
    pub include_usage: bool,
    /// The client asked for `return_token_ids`.
    pub return_token_ids: bool,
    pub prompt_tokens: u32,
    /// The router's estimate, used when the worker does not report `cached_tokens`.
    pub predicted_cached_tokens: u32,
}

#[derive(Deserialize)]
struct UpChoice<'a> {
    #[serde(default)]
    index: u32,
    #[serde(borrow, default)]
    text: Cow<'a, str>,
    #[serde(borrow, default)]
    logprobs: Option<&'a RawValue>,
    #[serde(borrow, default)]
    finish_reason: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    token_ids: Option<&'a RawValue>,
}

impl UpChoice<'_> {
    /// Tokens this choice carries: the length of `token_ids` when the worker sends them,
    /// else one per chunk with text (or without a finish reason).
    fn tokens(&self) -> u64 {
        match self.token_ids {
            Some(ids) => {
                let raw = ids.get();
                if raw.bytes().any(|b| b.is_ascii_digit()) {
                    raw.bytes().filter(|b| *b == b',').count() as u64 + 1
                } else {
                    0
                }
            }
            None => u64::from(!self.text.is_empty() || self.finish_reason.is_none()),
        }
    }
}

#[derive(Deserialize)]
struct UpChunk<'a> {
    #[serde(borrow, default)]
    choices: Vec<UpChoice<'a>>,
    #[serde(default)]
    usage: Option<Usage>,
    #[serde(default)]
    error: Option<ErrorDetail>,
}

#[derive(Serialize)]
struct ChunkOut<'a, C: Serialize> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: C,
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<&'a Usage>,
}

#[derive(Serialize)]
struct DeltaOut<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    content: Option<&'a str>,
}

#[derive(Serialize)]
struct ChatChoiceOut<'a> {
    index: u32,
    delta: DeltaOut<'a>,
    logprobs: Option<&'a RawValue>,
    finish_reason: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    token_ids: Option<&'a RawValue>,
}

#[derive(Serialize)]
struct TextChoiceOut<'a> {
    index: u32,
    text: &'a str,
    logprobs: Option<&'a RawValue>,
    finish_reason: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    token_ids: Option<&'a RawValue>,
}

/// The choices of one upstream chunk, written as chat deltas or completion choices without
/// building an intermediate vector.
struct ChoicesOut<'a> {
    api: Api,
    choices: &'a [UpChoice<'a>],
    role: bool,
    /// Pass `token_ids` on (the client asked for them).
    token_ids: bool,
}

impl Serialize for ChoicesOut<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut seq = serializer.serialize_seq(Some(self.choices.len()))?;
        for c in self.choices {
            match self.api {
                Api::Chat => seq.serialize_element(&ChatChoiceOut {
                    index: c.index,
                    delta: DeltaOut {
                        role: self.role.then_some("assistant"),
                        content: (!c.text.is_empty() || c.finish_reason.is_none())
                            .then_some(c.text.as_ref()),
                    },
                    logprobs: c.logprobs,
                    finish_reason: c.finish_reason.as_deref(),
                    token_ids: c.token_ids.filter(|_| self.token_ids),
                })?,
                Api::Completion => seq.serialize_element(&TextChoiceOut {
                    index: c.index,
                    text: &c.text,
                    logprobs: c.logprobs,
                    finish_reason: c.finish_reason.as_deref(),
                    token_ids: c.token_ids.filter(|_| self.token_ids),
                })?,
            }
        }
        seq.end()
    }
}

fn object(api: Api, stream: bool) -> &'static str {
    match (api, stream) {
        (Api::Chat, true) => "chat.completion.chunk",
        (Api::Chat, false) => "chat.completion",
        (Api::Completion, _) => "text_completion",
    }
}

/// Appends `data: <json>\n\n`.
fn write_event(out: &mut BytesMut, value: &impl Serialize) {
    out.put_slice(b"data: ");
    // Serializing into memory only fails for non-string map keys, which we never write.
    let _ = serde_json::to_writer((&mut *out).writer(), value);
    out.put_slice(b"\n\n");
}

/// Appends an SSE error event.
pub fn write_error_event(out: &mut BytesMut, error: &ApiError) {
    write_event(out, &error.body());
}

/// What the aggregating (non-streaming) mode collects.
#[derive(Debug, Default)]
struct Aggregate {
    texts: Vec<String>,
    finish: Vec<Option<String>>,
}

/// How one request's upstream stream ended.
#[derive(Debug)]
pub enum Ending {
    Done,
    /// The worker reported an error in its stream.
    WorkerError(ApiError),
    /// The worker's stream broke (connection lost, garbage): the worker is taken out of the
    /// routing set.
    Broken(ApiError),
}

/// One request's relay state.
pub struct Relay {
    ctx: OutputCtx,
    stream: bool,
    body: BoxStream<'static, reqwest::Result<Bytes>>,
    reader: SseReader,
    ticket: Option<Ticket>,
    record: RequestRecord,
    out: BytesMut,
    role_sent: bool,
    usage: Option<Usage>,
    aggregate: Aggregate,
    ending: Option<Ending>,
    finished: bool,
    /// When the latest upstream read returned.
    last_read: Option<Instant>,
    /// When the read holding the first token returned, until its frame goes out.
    first_token_read: Option<Instant>,
}

impl Relay {
    pub fn new(
        ctx: OutputCtx,
        stream: bool,
        body: BoxStream<'static, reqwest::Result<Bytes>>,
        ticket: Ticket,
        record: RequestRecord,
    ) -> Relay {
        Relay {
            ctx,
            stream,
            body,
            reader: SseReader::new(MAX_EVENT_BYTES),
            ticket: Some(ticket),
            record,
            out: BytesMut::with_capacity(FRAME_CAPACITY),
            role_sent: false,
            usage: None,
            aggregate: Aggregate::default(),
            ending: None,
            finished: false,
            last_read: None,
            first_token_read: None,
        }
    }

    /// The client's SSE body: each item is everything produced from one upstream read.
    pub fn into_sse_stream(self) -> BoxStream<'static, Result<Bytes, std::convert::Infallible>> {
        futures::stream::unfold(self, |mut relay| async move {
            relay.next_output().await.map(|bytes| (Ok(bytes), relay))
        })
        .boxed()
    }

    /// Reads the whole upstream stream and builds the non-streaming response body (or the
    /// error to answer with).
    pub async fn into_response_body(mut self) -> Result<Vec<u8>, ApiError> {
        while self.next_output().await.is_some() {}
        match self.ending.take() {
            Some(Ending::Done) | None => Ok(self.response_json()),
            Some(Ending::WorkerError(e)) | Some(Ending::Broken(e)) => Err(e),
        }
    }

    async fn next_output(&mut self) -> Option<Bytes> {
        loop {
            while self.ending.is_none() {
                match self.reader.next_event() {
                    Ok(Some(data)) => self.handle(data.as_bytes()),
                    Ok(None) => break,
                    Err(e) => {
                        self.break_worker(format!("the worker's stream is not valid SSE: {e}"))
                    }
                }
            }
            if self.ending.is_some() && !self.finished {
                self.finish();
            }
            if !self.out.is_empty() {
                if let (Some(read), Some(pre), true) = (
                    self.first_token_read.take(),
                    self.record.pre_forward,
                    self.stream,
                ) {
                    let added = pre + read.elapsed();
                    self.record.metrics.added_ttft.observe(added.as_secs_f64());
                }
                let frame = self.out.split().freeze();
                // One allocation per frame, sized for a typical chunk, instead of growth steps.
                self.out.reserve(FRAME_CAPACITY);
                return Some(frame);
            }
            if self.finished {
                return None;
            }
            match self.body.next().await {
                Some(Ok(bytes)) => {
                    // Only the read that brings the first token is timed.
                    if self.record.first_token.is_none() {
                        self.last_read = Some(Instant::now());
                    }
                    if let Err(e) = self.reader.push(&bytes) {
                        self.break_worker(format!("the worker's stream is not valid SSE: {e}"));
                    }
                }
                Some(Err(e)) => {
                    self.break_worker(format!("the worker's stream broke: {e}"));
                }
                None => {
                    self.break_worker("the worker closed its stream before [DONE]".to_string());
                }
            }
        }
    }

    fn break_worker(&mut self, message: String) {
        let worker = self.ticket.as_ref().map(|t| t.worker.id);
        tracing::warn!(?worker, %message, "worker stream failed");
        if let Some(ticket) = &self.ticket {
            ticket.worker_failed();
        }
        self.record.metrics.worker_failures.inc();
        self.ending = Some(Ending::Broken(ApiError::new(
            502,
            protocol::error::kind::SERVER,
            message,
            None,
            Some("worker_failed"),
        )));
    }

    /// Writes the tail of the stream and releases the worker slot.
    fn finish(&mut self) {
        self.finished = true;
        match &self.ending {
            Some(Ending::Done) => {
                self.record.success = true;
                if self.stream {
                    if self.ctx.include_usage {
                        let usage = self.final_usage();
                        let chunk = ChunkOut {
                            id: &self.ctx.id,
                            object: object(self.ctx.api, true),
                            created: self.ctx.created,
                            model: &self.ctx.model,
                            choices: [0u8; 0],
                            usage: Some(&usage),
                        };
                        write_event(&mut self.out, &chunk);
                    }
                    self.out.put_slice(b"data: [DONE]\n\n");
                }
            }
            Some(Ending::WorkerError(e)) | Some(Ending::Broken(e)) if self.stream => {
                write_error_event(&mut self.out, e);
                self.out.put_slice(b"data: [DONE]\n\n");
            }
            Some(Ending::WorkerError(_)) | Some(Ending::Broken(_)) | None => {}
        }
        if let Some(usage) = self.usage {
            // Chunks without token ids were counted one token each; the worker's count wins.
            let reported = u64::from(usage.completion_tokens);
            if reported > self.record.output_tokens {
                let missing = reported - self.record.output_tokens;
                self.record.metrics.output_tokens_total.inc_by(missing);
                self.record.output_tokens = reported;
            }
        }
        let usage = self.final_usage();
        self.record.cached_tokens = usage
            .prompt_tokens_details
            .map(|d| u64::from(d.cached_tokens));
        // Release the slot now rather than when the client finishes reading.
        self.ticket = None;
    }

    fn final_usage(&self) -> Usage {
        let completion = u32::try_from(self.record.output_tokens).unwrap_or(u32::MAX);
        match self.usage {
            Some(mut usage) => {
                if usage.prompt_tokens_details.is_none() {
                    usage.prompt_tokens_details = Some(protocol::PromptTokensDetails {
                        cached_tokens: self.ctx.predicted_cached_tokens,
                    });
                }
                usage
            }
            None => Usage::new(
                self.ctx.prompt_tokens,
                completion,
                self.ctx.predicted_cached_tokens,
            ),
        }
    }

    fn handle(&mut self, data: &[u8]) {
        if data == DONE {
            self.ending = Some(Ending::Done);
            return;
        }
        let chunk: UpChunk<'_> = match serde_json::from_slice(data) {
            Ok(chunk) => chunk,
            Err(e) => {
                self.break_worker(format!("the worker sent a chunk that is not JSON: {e}"));
                return;
            }
        };
        if let Some(error) = chunk.error {
            self.ending = Some(Ending::WorkerError(ApiError {
                status: 502,
                detail: error,
            }));
            return;
        }
        if let Some(usage) = chunk.usage {
            self.usage = Some(usage);
        }
        if chunk.choices.is_empty() {
            return;
        }
        let tokens = chunk.choices.iter().map(UpChoice::tokens).sum();
        if self.record.tokens(tokens, Instant::now()) {
            if let Some(ticket) = &mut self.ticket {
                ticket.first_token();
            }
            self.first_token_read = self.last_read;
        }
        if self.stream {
            let role = self.ctx.api == Api::Chat && !self.role_sent;
            self.role_sent = true;
            let out = ChunkOut {
                id: &self.ctx.id,
                object: object(self.ctx.api, true),
                created: self.ctx.created,
                model: &self.ctx.model,
                choices: ChoicesOut {
                    api: self.ctx.api,
                    choices: &chunk.choices,
                    role,
                    token_ids: self.ctx.return_token_ids,
                },
                usage: None,
            };
            write_event(&mut self.out, &out);
        } else {
            for c in &chunk.choices {
                let i = c.index as usize;
                if i >= MAX_CHOICES {
                    continue;
                }
                if self.aggregate.texts.len() <= i {
                    self.aggregate.texts.resize_with(i + 1, String::new);
                    self.aggregate.finish.resize(i + 1, None);
                }
                self.aggregate.texts[i].push_str(&c.text);
                if let Some(f) = &c.finish_reason {
                    self.aggregate.finish[i] = Some(f.to_string());
                }
            }
        }
    }

    fn response_json(&self) -> Vec<u8> {
        #[derive(Serialize)]
        struct Message<'a> {
            role: &'static str,
            content: &'a str,
        }
        #[derive(Serialize)]
        struct ChatChoice<'a> {
            index: usize,
            message: Message<'a>,
            logprobs: Option<()>,
            finish_reason: Option<&'a str>,
        }
        #[derive(Serialize)]
        struct TextChoice<'a> {
            index: usize,
            text: &'a str,
            logprobs: Option<()>,
            finish_reason: Option<&'a str>,
        }
        #[derive(Serialize)]
        #[serde(untagged)]
        enum Choice<'a> {
            Chat(ChatChoice<'a>),
            Text(TextChoice<'a>),
        }
        let choices: Vec<Choice<'_>> = self
            .aggregate
            .texts
            .iter()
            .zip(&self.aggregate.finish)
            .enumerate()
            .map(|(index, (text, finish))| match self.ctx.api {
                Api::Chat => Choice::Chat(ChatChoice {
                    index,
                    message: Message {
                        role: "assistant",
                        content: text,
                    },
                    logprobs: None,
                    finish_reason: finish.as_deref(),
                }),
                Api::Completion => Choice::Text(TextChoice {
                    index,
                    text,
                    logprobs: None,
                    finish_reason: finish.as_deref(),
                }),
            })
            .collect();
        let usage = self.final_usage();
        let body = ChunkOut {
            id: &self.ctx.id,
            object: object(self.ctx.api, false),
            created: self.ctx.created,
            model: &self.ctx.model,
            choices,
            usage: Some(&usage),
        };
        serde_json::to_vec(&body).unwrap_or_default()
    }
}

/// The error body of a worker's non-2xx answer, bounded.
pub async fn read_error(response: reqwest::Response) -> ApiError {
    const LIMIT: usize = 64 << 10;
    let status = response.status().as_u16();
    let mut body = Vec::new();
    let mut stream = response.bytes_stream();
    while let Some(Ok(chunk)) = stream.next().await {
        let room = LIMIT.saturating_sub(body.len());
        body.extend_from_slice(&chunk[..chunk.len().min(room)]);
        if body.len() >= LIMIT {
            break;
        }
    }
    let mut error = ApiError::from_body(status, &body);
    if status >= 500 {
        error.status = 502;
    }
    error
}

/// `{"error": …}` as bytes.
pub fn error_json(error: &ApiError) -> Vec<u8> {
    serde_json::to_vec(&ErrorBody {
        error: error.detail.clone(),
    })
    .unwrap_or_default()
}
