//! The OpenAI-compatible HTTP API and the operational endpoints.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use engine::{EngineRequest, OutputSpec, RejectReason, RequestId};
use futures::StreamExt;
use protocol::openai::object;
use protocol::{
    ApiError, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
    ChatCompletionResponse, ChatDelta, CompletionChoice, CompletionRequest, CompletionResponse,
    FinishReason, Model, ModelList, Prompt, ResponseMessage, SamplingParams, Usage, WorkerCard,
};
use serde::Deserialize;
use tokio::sync::{mpsc, watch};

use crate::config::ReplyLength;
use crate::driver::{Clock, Command, FinishInfo, Progress, RequestState, Snapshot, Submission};
use crate::metrics::ServerMetrics;
use crate::replies::{LengthRequest, PlannedReply, TextAssets, plan_reply};

/// Shared by every handler.
pub struct AppState {
    pub info: WorkerCard,
    pub commands: mpsc::Sender<Command>,
    pub next_id: AtomicU64,
    pub assets: &'static TextAssets,
    pub reply_length: ReplyLength,
    pub seed: u64,
    pub body_limit: usize,
    pub metrics: Arc<ServerMetrics>,
    pub snapshot: Arc<Mutex<Snapshot>>,
    pub clock: Clock,
    /// Unix seconds at start-up (`created` of `/v1/models`).
    pub started: u64,
}

pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/info", get(info))
        .route("/tokenize", post(tokenize))
        .route("/metrics", get(metrics))
        .fallback(|| async { ApiError::not_found("no such endpoint") })
        .with_state(state)
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Reads the body, refusing more than `limit` bytes with 413 (checked against
/// `Content-Length` first, then while reading).
async fn read_body(headers: &HeaderMap, body: Body, limit: usize) -> Result<Bytes, ApiError> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|len| len > limit as u64) {
        return Err(ApiError::payload_too_large(limit));
    }
    let mut stream = body.into_data_stream();
    let mut buf = Vec::with_capacity(declared.unwrap_or(0).min(limit as u64) as usize);
    while let Some(chunk) = stream.next().await {
        let chunk =
            chunk.map_err(|e| ApiError::invalid_request(format!("reading the body: {e}")))?;
        if buf.len() + chunk.len() > limit {
            return Err(ApiError::payload_too_large(limit));
        }
        buf.extend_from_slice(&chunk);
    }
    Ok(Bytes::from(buf))
}

fn parse_json<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(bytes)
        .map_err(|e| ApiError::invalid_request(format!("invalid JSON body: {e}")))
}

fn check_model(state: &AppState, model: &str) -> Result<(), ApiError> {
    if model == state.info.model {
        Ok(())
    } else {
        Err(ApiError::model_not_found(model))
    }
}

async fn chat_completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let result = async {
        let bytes = read_body(&headers, body, state.body_limit).await?;
        let request: ChatCompletionRequest = parse_json(&bytes)?;
        check_model(&state, &request.model)?;
        if request.messages.is_empty() {
            return Err(ApiError::invalid_param("messages", "`messages` is empty"));
        }
        let messages: Vec<text::ChatMessage> = request
            .messages
            .iter()
            .map(|m| text::ChatMessage::new(m.role.clone(), m.text()))
            .collect();
        let prompt = state
            .assets
            .chat_prompt(&messages)
            .map_err(ApiError::internal)?;
        serve(&state, prompt, &request.params, Kind::Chat, &request.model).await
    }
    .await;
    result.unwrap_or_else(IntoResponse::into_response)
}

async fn completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let result = async {
        let bytes = read_body(&headers, body, state.body_limit).await?;
        let request: CompletionRequest = parse_json(&bytes)?;
        check_model(&state, &request.model)?;
        let prompt = match request.prompt {
            Prompt::Tokens(tokens) => tokens,
            Prompt::Text(text) => state.assets.tokenizer.encode(&text),
            Prompt::TokenBatch(mut batch) if batch.len() == 1 => batch.remove(0),
            Prompt::TextBatch(batch) if batch.len() == 1 => {
                state.assets.tokenizer.encode(&batch[0])
            }
            _ => {
                return Err(ApiError::invalid_param(
                    "prompt",
                    "this server takes one prompt per request",
                ));
            }
        };
        serve(
            &state,
            prompt,
            &request.params,
            Kind::Completion,
            &request.model,
        )
        .await
    }
    .await;
    result.unwrap_or_else(IntoResponse::into_response)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Completion,
}

impl Kind {
    fn prompt_param(self) -> &'static str {
        match self {
            Kind::Chat => "messages",
            Kind::Completion => "prompt",
        }
    }
}

/// Cancels the engine request when dropped while armed (the client went away).
struct CancelGuard {
    id: RequestId,
    commands: mpsc::Sender<Command>,
    armed: bool,
}

impl Drop for CancelGuard {
    fn drop(&mut self) {
        if self.armed {
            // If the queue is full, the engine task still cancels the request at its next
            // token, when it finds the progress channel closed.
            let _ = self.commands.try_send(Command::Cancel(self.id));
        }
    }
}

fn reject_error(
    reason: &RejectReason,
    param: &str,
    prompt_tokens: u64,
    max_output: u64,
) -> ApiError {
    match reason {
        RejectReason::QueueFull { .. } => {
            ApiError::overloaded(format!("engine overloaded: {reason}; retry later"))
        }
        RejectReason::ContextTooLong { max, .. } => {
            ApiError::context_length_exceeded(param, prompt_tokens, max_output, u64::from(*max))
        }
        RejectReason::EmptyPrompt => ApiError::invalid_param(param, "the prompt is empty"),
        RejectReason::NoOutput | RejectReason::TooLargeForPool { .. } => {
            ApiError::invalid_request(reason.to_string())
        }
        RejectReason::DuplicateId => ApiError::internal(reason.to_string()),
    }
}

async fn serve(
    state: &Arc<AppState>,
    prompt: Vec<u32>,
    params: &SamplingParams,
    kind: Kind,
    model: &str,
) -> Result<Response, ApiError> {
    let param = kind.prompt_param();
    if prompt.is_empty() {
        return Err(ApiError::invalid_param(param, "the prompt is empty"));
    }
    if params.n.is_some_and(|n| n != 1) {
        return Err(ApiError::invalid_param("n", "only n = 1 is supported"));
    }
    let max_tokens = params.max_output_tokens();
    if max_tokens == Some(0) {
        return Err(ApiError::invalid_param(
            "max_tokens",
            "max_tokens must be at least 1",
        ));
    }
    // The server always declares its context (`EngineServer::bind`).
    let context = state.info.max_model_len.unwrap_or(u32::MAX);
    let prompt_len = prompt.len() as u64;
    let requested = u64::from(max_tokens.unwrap_or(1));
    if prompt_len + requested > u64::from(context) {
        return Err(ApiError::context_length_exceeded(
            param,
            prompt_len,
            requested,
            u64::from(context),
        ));
    }
    let room = context - prompt.len() as u32;
    let request_seed = params.seed.unwrap_or(0).rotate_left(17);
    let reply = plan_reply(
        state.assets,
        &prompt,
        &LengthRequest {
            max_tokens,
            ignore_eos: params.ignore_eos(),
            room,
        },
        state.reply_length,
        state.seed ^ request_seed,
    )
    .map_err(ApiError::internal)?;

    let id = RequestId(state.next_id.fetch_add(1, Ordering::Relaxed));
    let (progress_tx, mut progress) = watch::channel(Progress::new());
    let submission = Submission {
        request: EngineRequest {
            id,
            prompt: prompt.into(),
            output: OutputSpec::Tokens(reply.ids.clone()),
        },
        progress: progress_tx,
    };
    match state
        .commands
        .try_send(Command::Submit(Box::new(submission)))
    {
        Ok(()) => {}
        Err(mpsc::error::TrySendError::Full(_)) => {
            return Err(ApiError::overloaded(
                "engine overloaded: its submission queue is full; retry later",
            ));
        }
        Err(mpsc::error::TrySendError::Closed(_)) => {
            return Err(ApiError::service_unavailable("the engine is shutting down"));
        }
    }
    let mut guard = CancelGuard {
        id,
        commands: state.commands.clone(),
        armed: true,
    };
    let admitted = progress
        .wait_for(|p| p.state != RequestState::Submitted)
        .await
        .map(|p| p.state.clone())
        .map_err(|_| ApiError::service_unavailable("the engine stopped"))?;
    match admitted {
        RequestState::Rejected(reason) => {
            guard.armed = false;
            return Err(reject_error(&reason, param, prompt_len, requested));
        }
        RequestState::Cancelled => {
            guard.armed = false;
            return Err(ApiError::service_unavailable("the engine is shutting down"));
        }
        _ => {}
    }
    let reply = Arc::new(reply);
    let meta = ResponseMeta {
        id: match kind {
            Kind::Chat => format!(
                "chatcmpl-{}-{}",
                state.info.worker.unwrap_or_default().0,
                id.0
            ),
            Kind::Completion => {
                format!("cmpl-{}-{}", state.info.worker.unwrap_or_default().0, id.0)
            }
        },
        created: unix_now(),
        model: model.to_string(),
        kind,
        include_usage: params.include_usage(),
        token_ids: params.return_token_ids(),
    };
    if params.is_stream() {
        let relay = Relay {
            progress,
            reply,
            meta,
            sent: 0,
            phase: Phase::Streaming,
            guard,
        };
        let body = Body::from_stream(futures::stream::unfold(relay, Relay::next_bytes));
        return Ok((
            [
                (header::CONTENT_TYPE, "text/event-stream"),
                (header::CACHE_CONTROL, "no-cache"),
            ],
            body,
        )
            .into_response());
    }
    let done = progress
        .wait_for(|p| {
            matches!(
                p.state,
                RequestState::Finished(_) | RequestState::Cancelled | RequestState::Rejected(_)
            )
        })
        .await
        .map(|p| p.state.clone())
        .map_err(|_| ApiError::service_unavailable("the engine stopped"))?;
    guard.armed = false;
    let RequestState::Finished(finish) = done else {
        return Err(ApiError::service_unavailable(
            "the request was cancelled: the engine is shutting down",
        ));
    };
    Ok(axum::Json(meta.full_response(&reply, &finish)).into_response())
}

/// What every response and chunk of one request repeats.
struct ResponseMeta {
    id: String,
    created: u64,
    model: String,
    kind: Kind,
    include_usage: bool,
    token_ids: bool,
}

fn usage(finish: &FinishInfo) -> Usage {
    Usage::new(
        finish.prompt_tokens,
        finish.output_tokens,
        finish.cached_prompt_tokens,
    )
}

fn finish_reason(reply: &PlannedReply) -> FinishReason {
    if reply.truncated {
        FinishReason::Length
    } else {
        FinishReason::Stop
    }
}

impl ResponseMeta {
    fn full_response(&self, reply: &PlannedReply, finish: &FinishInfo) -> serde_json::Value {
        let text = reply.text_upto(finish.output_tokens).to_string();
        let ids = self
            .token_ids
            .then(|| reply.ids[..finish.output_tokens as usize].to_vec());
        let reason = Some(finish_reason(reply));
        let value = match self.kind {
            Kind::Chat => serde_json::to_value(ChatCompletionResponse {
                id: self.id.clone(),
                object: object::CHAT_COMPLETION.to_string(),
                created: self.created,
                model: self.model.clone(),
                choices: vec![ChatChoice {
                    index: 0,
                    message: ResponseMessage {
                        role: "assistant".to_string(),
                        content: text,
                    },
                    finish_reason: reason,
                    logprobs: None,
                    token_ids: ids,
                }],
                usage: Some(usage(finish)),
            }),
            Kind::Completion => serde_json::to_value(CompletionResponse {
                id: self.id.clone(),
                object: object::TEXT_COMPLETION.to_string(),
                created: self.created,
                model: self.model.clone(),
                choices: vec![CompletionChoice {
                    index: 0,
                    text,
                    finish_reason: reason,
                    logprobs: None,
                    token_ids: ids,
                }],
                usage: Some(usage(finish)),
            }),
        };
        value.unwrap_or_default()
    }

    /// One chunk: new text (tokens `from..to`), an optional finish reason.
    fn chunk(
        &self,
        reply: &PlannedReply,
        from: u32,
        to: u32,
        finish: Option<FinishReason>,
    ) -> String {
        let done = reply.text_upto(from).len();
        let text = reply.text_upto(to)[done..].to_string();
        let ids = self
            .token_ids
            .then(|| reply.ids[from as usize..to as usize].to_vec());
        let json = match self.kind {
            Kind::Chat => serde_json::to_string(&ChatCompletionChunk {
                id: self.id.clone(),
                object: object::CHAT_COMPLETION_CHUNK.to_string(),
                created: self.created,
                model: self.model.clone(),
                choices: vec![ChatChunkChoice {
                    index: 0,
                    delta: ChatDelta {
                        // The role rides on the first content chunk, so the first event a
                        // client sees is the first token (TTFT measured on it is right).
                        role: (from == 0).then(|| "assistant".to_string()),
                        content: Some(text),
                    },
                    finish_reason: finish,
                    logprobs: None,
                    token_ids: ids,
                }],
                usage: None,
            }),
            Kind::Completion => serde_json::to_string(&CompletionResponse {
                id: self.id.clone(),
                object: object::TEXT_COMPLETION.to_string(),
                created: self.created,
                model: self.model.clone(),
                choices: vec![CompletionChoice {
                    index: 0,
                    text,
                    finish_reason: finish,
                    logprobs: None,
                    token_ids: ids,
                }],
                usage: None,
            }),
        };
        protocol::sse::event(&json.unwrap_or_default())
    }

    /// The last chunk of `stream_options.include_usage`: no choices, the usage.
    fn usage_chunk(&self, finish: &FinishInfo) -> String {
        let json = match self.kind {
            Kind::Chat => serde_json::to_string(&ChatCompletionChunk {
                id: self.id.clone(),
                object: object::CHAT_COMPLETION_CHUNK.to_string(),
                created: self.created,
                model: self.model.clone(),
                choices: Vec::new(),
                usage: Some(usage(finish)),
            }),
            Kind::Completion => serde_json::to_string(&CompletionResponse {
                id: self.id.clone(),
                object: object::TEXT_COMPLETION.to_string(),
                created: self.created,
                model: self.model.clone(),
                choices: Vec::new(),
                usage: Some(usage(finish)),
            }),
        };
        protocol::sse::event(&json.unwrap_or_default())
    }
}

#[derive(PartialEq)]
enum Phase {
    Streaming,
    Done,
}

/// The SSE body of one streamed request. Dropping it (the client disconnected) drops the
/// progress receiver and the armed guard, which cancel the engine request.
struct Relay {
    progress: watch::Receiver<Progress>,
    reply: Arc<PlannedReply>,
    meta: ResponseMeta,
    sent: u32,
    phase: Phase,
    guard: CancelGuard,
}

impl Relay {
    async fn next_bytes(mut self) -> Option<(Result<Bytes, Infallible>, Relay)> {
        if self.phase == Phase::Done {
            return None;
        }
        loop {
            let (produced, state) = {
                let progress = self.progress.borrow_and_update();
                (progress.produced, progress.state.clone())
            };
            let mut out = String::new();
            match state {
                RequestState::Finished(finish) => {
                    let last = finish.output_tokens.max(self.sent);
                    out.push_str(&self.meta.chunk(
                        &self.reply,
                        self.sent,
                        last,
                        Some(finish_reason(&self.reply)),
                    ));
                    if self.meta.include_usage {
                        out.push_str(&self.meta.usage_chunk(&finish));
                    }
                    out.push_str(protocol::sse::done_event());
                    self.guard.armed = false;
                    self.phase = Phase::Done;
                    return Some((Ok(Bytes::from(out)), self));
                }
                RequestState::Cancelled | RequestState::Rejected(_) => {
                    let error = ApiError::service_unavailable(
                        "the request was cancelled: the engine is shutting down",
                    );
                    out.push_str(&protocol::sse::event(&error.to_json()));
                    out.push_str(protocol::sse::done_event());
                    self.guard.armed = false;
                    self.phase = Phase::Done;
                    return Some((Ok(Bytes::from(out)), self));
                }
                RequestState::Submitted | RequestState::Accepted => {
                    if produced > self.sent {
                        out.push_str(&self.meta.chunk(&self.reply, self.sent, produced, None));
                        self.sent = produced;
                        return Some((Ok(Bytes::from(out)), self));
                    }
                }
            }
            if self.progress.changed().await.is_err() {
                let error = ApiError::service_unavailable("the engine stopped");
                let mut out = protocol::sse::event(&error.to_json());
                out.push_str(protocol::sse::done_event());
                self.guard.armed = false;
                self.phase = Phase::Done;
                return Some((Ok(Bytes::from(out)), self));
            }
        }
    }
}

async fn models(State(state): State<Arc<AppState>>) -> Response {
    let mut model = Model::new(state.info.model.clone(), "kvroute", state.started);
    model.max_model_len = state.info.max_model_len;
    axum::Json(ModelList::new(vec![model])).into_response()
}

async fn health(State(state): State<Arc<AppState>>) -> Response {
    if state.commands.is_closed() {
        ApiError::service_unavailable("the engine stopped").into_response()
    } else {
        axum::Json(serde_json::json!({"status": "ok"})).into_response()
    }
}

async fn info(State(state): State<Arc<AppState>>) -> Response {
    axum::Json(state.info.clone()).into_response()
}

/// `POST /tokenize`, as vLLM takes it: `{"prompt": "…"}` or `{"messages": […]}`.
#[derive(Deserialize)]
struct TokenizeRequest {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    prompt: Option<String>,
    #[serde(default)]
    messages: Option<Vec<protocol::RequestMessage>>,
}

async fn tokenize(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    let result = async {
        let bytes = read_body(&headers, body, state.body_limit).await?;
        let request: TokenizeRequest = parse_json(&bytes)?;
        if let Some(model) = &request.model {
            check_model(&state, model)?;
        }
        let tokens = match (request.prompt, request.messages) {
            (Some(prompt), None) => state.assets.tokenizer.encode(&prompt),
            (None, Some(messages)) => {
                let messages: Vec<text::ChatMessage> = messages
                    .iter()
                    .map(|m| text::ChatMessage::new(m.role.clone(), m.text()))
                    .collect();
                state
                    .assets
                    .chat_prompt(&messages)
                    .map_err(ApiError::internal)?
            }
            _ => {
                return Err(ApiError::invalid_request(
                    "give exactly one of `prompt` or `messages`",
                ));
            }
        };
        Ok(axum::Json(serde_json::json!({
            "count": tokens.len(),
            "max_model_len": state.info.max_model_len,
            "tokens": tokens,
        }))
        .into_response())
    }
    .await;
    result.unwrap_or_else(IntoResponse::into_response)
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let busy = state
        .snapshot
        .lock()
        .map(|s| s.metrics.busy_time)
        .unwrap_or_default();
    state.metrics.sample_utilisation(state.clock.now(), busy);
    (
        StatusCode::OK,
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.metrics.encode(),
    )
        .into_response()
}
