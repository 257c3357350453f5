//! The HTTP API: routes, request validation, preprocessing, routing and forwarding.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::Router as HttpRouter;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::Response;
use axum::routing::{get, post};
use futures::StreamExt;
use protocol::{
    ApiError, ChatCompletionRequest, CompletionRequest, Model, ModelList, Prompt, StreamOptions,
};
use serde_json::Value;

use crate::config::PromptFormat;
use crate::dispatch::{AdmitError, Dispatcher, Ticket};
use crate::metrics::{CONTENT_TYPE, Metrics};
use crate::preprocess::{Prepared, Preprocessor};
use crate::registry::WorkerInfo;
use crate::relay::{Api, OutputCtx, Relay, RequestRecord, error_json, read_error};

/// Connection attempts per request: a worker that refuses the connection leaves the routing
/// set and the request is routed again (nothing was sent, so this is safe).
const CONNECT_ATTEMPTS: usize = 3;

#[derive(Debug)]
pub(crate) struct AppState {
    pub dispatcher: Arc<Dispatcher>,
    pub metrics: Arc<Metrics>,
    pub preprocessor: Arc<Preprocessor>,
    pub http: reqwest::Client,
    pub model: Arc<str>,
    pub context_length: u32,
    pub max_body_bytes: usize,
    pub started: u64,
    pub next_id: AtomicU64,
}

pub(crate) fn routes(state: Arc<AppState>) -> HttpRouter {
    HttpRouter::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .with_state(state)
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn json_response(status: StatusCode, body: Vec<u8>) -> Response {
    let mut response = Response::new(Body::from(body));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

fn error_response(error: &ApiError) -> Response {
    let status = StatusCode::from_u16(error.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    json_response(status, error_json(error))
}

async fn not_found() -> Response {
    error_response(&ApiError::not_found(
        "Unknown path. This gateway serves /v1/chat/completions, /v1/completions, /v1/models, \
         /health and /metrics.",
    ))
}

async fn models(State(state): State<Arc<AppState>>) -> Response {
    let mut model = Model::new(state.model.as_ref(), "kvroute", state.started);
    model.max_model_len = Some(state.context_length);
    let body = serde_json::to_vec(&ModelList::new(vec![model])).unwrap_or_default();
    json_response(StatusCode::OK, body)
}

async fn health(State(state): State<Arc<AppState>>) -> Response {
    let routable = state.dispatcher.routable_workers().len();
    let known = state.dispatcher.workers().len();
    let (status, word) = if routable > 0 {
        (StatusCode::OK, "healthy")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "unhealthy")
    };
    let body = serde_json::json!({
        "status": word,
        "model": state.model.as_ref(),
        "workers": known,
        "routable_workers": routable,
    });
    json_response(status, serde_json::to_vec(&body).unwrap_or_default())
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let mut response = Response::new(Body::from(state.metrics.encode()));
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(CONTENT_TYPE));
    response
}

/// Reads the body up to the limit: 413 beyond it (by `Content-Length` or by counting).
async fn read_body(headers: &HeaderMap, body: Body, limit: usize) -> Result<Bytes, ApiError> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(ApiError::payload_too_large(limit));
    }
    let capacity = declared.map_or(0, |n| n as usize).min(limit);
    let mut buf = bytes::BytesMut::with_capacity(capacity);
    let mut stream = body.into_data_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| {
            ApiError::invalid_request(format!("could not read the request body: {e}"))
        })?;
        if buf.len() + chunk.len() > limit {
            return Err(ApiError::payload_too_large(limit));
        }
        buf.extend_from_slice(&chunk);
    }
    Ok(buf.freeze())
}

fn parse_json<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(bytes).map_err(|e| {
        if e.is_syntax() || e.is_eof() {
            ApiError::invalid_request(format!("The request body is not valid JSON: {e}"))
        } else {
            ApiError::invalid_request(format!("Invalid request: {e}"))
        }
    })
}

impl AppState {
    fn check_model(&self, model: &str) -> Result<(), ApiError> {
        if model == self.model.as_ref() {
            Ok(())
        } else {
            Err(ApiError::model_not_found(model))
        }
    }

    fn check_context(
        &self,
        param: &str,
        prompt_tokens: usize,
        max_tokens: Option<u32>,
    ) -> Result<(), ApiError> {
        let prompt = prompt_tokens as u64;
        let output = u64::from(max_tokens.unwrap_or(0));
        let context = u64::from(self.context_length);
        if prompt >= context || prompt + output > context {
            Err(ApiError::context_length_exceeded(
                param, prompt, output, context,
            ))
        } else {
            Ok(())
        }
    }

    fn request_id(&self, api: Api) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        match api {
            Api::Chat => format!("chatcmpl-{:x}-{n}", self.started),
            Api::Completion => format!("cmpl-{:x}-{n}", self.started),
        }
    }
}

fn admit_error(e: AdmitError) -> ApiError {
    match e {
        AdmitError::QueueFull { .. } => {
            ApiError::overloaded(format!("The server is overloaded: {e}. Retry later."))
        }
        AdmitError::NoWorkers
        | AdmitError::QueueTimeout { .. }
        | AdmitError::ShuttingDown
        | AdmitError::Route(_) => ApiError::service_unavailable(format!("{e}.")),
    }
}

/// The worker request: a `/v1/completions` body with the prompt as token ids (or text), always
/// streamed with usage so the gateway sees every token and the cache hit count.
fn worker_body(
    model: &str,
    prepared: &Prepared,
    worker: &WorkerInfo,
    mut params: protocol::SamplingParams,
    extra: &serde_json::Map<String, Value>,
) -> Vec<u8> {
    if worker.token_ids {
        params.return_token_ids = Some(true);
    }
    let prompt = match (worker.prompt, &prepared.text) {
        (PromptFormat::Text, Some(text)) => Prompt::Text(text.clone()),
        _ => Prompt::Tokens(prepared.tokens.clone()),
    };
    params.max_tokens = params.max_output_tokens();
    params.max_completion_tokens = None;
    params.stream = Some(true);
    let mut options = params.stream_options.take().unwrap_or_default();
    options.include_usage = true;
    params.stream_options = Some(StreamOptions {
        include_usage: true,
        extra: options.extra,
    });
    let request = CompletionRequest {
        model: model.to_string(),
        prompt,
        params,
        extra: extra.clone(),
    };
    serde_json::to_vec(&request).unwrap_or_default()
}

/// Chat fields whose completions counterpart has another shape.
fn chat_extra_for_completions(
    mut extra: serde_json::Map<String, Value>,
) -> serde_json::Map<String, Value> {
    // Chat: `logprobs: bool` + `top_logprobs: n`; completions: `logprobs: n`.
    let top = extra.remove("top_logprobs").and_then(|v| v.as_u64());
    match extra.remove("logprobs") {
        Some(Value::Bool(true)) => {
            extra.insert("logprobs".into(), Value::from(top.unwrap_or(0)));
        }
        Some(Value::Number(n)) => {
            extra.insert("logprobs".into(), Value::Number(n));
        }
        _ => {}
    }
    extra
}

struct Parsed {
    api: Api,
    model: String,
    prepared: Prepared,
    params: protocol::SamplingParams,
    extra: serde_json::Map<String, Value>,
}

async fn chat_completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let mut record = RequestRecord::start(state.metrics.clone(), Api::Chat.endpoint(), false);
    let parsed = async {
        let bytes = read_body(&headers, body, state.max_body_bytes).await?;
        let request: ChatCompletionRequest = parse_json(&bytes)?;
        record.set_stream(request.params.is_stream());
        state.check_model(&request.model)?;
        if request.messages.is_empty() {
            return Err(ApiError::invalid_param(
                "messages",
                "`messages` must contain at least one message",
            ));
        }
        let messages: Vec<text::ChatMessage> = request
            .messages
            .iter()
            .map(|m| text::ChatMessage::new(m.role.clone(), m.text()))
            .collect();
        let need_text = state.dispatcher.has_text_workers();
        let prepared = state
            .preprocessor
            .chat(&messages, need_text)
            .map_err(|e| ApiError::invalid_param("messages", e))?;
        state.check_context(
            "messages",
            prepared.tokens.len(),
            request.params.max_output_tokens(),
        )?;
        Ok(Parsed {
            api: Api::Chat,
            model: request.model,
            prepared,
            params: request.params,
            extra: chat_extra_for_completions(request.extra),
        })
    }
    .await;
    match parsed {
        Ok(parsed) => serve(state, parsed, record).await,
        Err(e) => error_response(&e),
    }
}

async fn completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let mut record = RequestRecord::start(state.metrics.clone(), Api::Completion.endpoint(), false);
    let parsed = async {
        let bytes = read_body(&headers, body, state.max_body_bytes).await?;
        let request: CompletionRequest = parse_json(&bytes)?;
        record.set_stream(request.params.is_stream());
        state.check_model(&request.model)?;
        let prepared = match request.prompt {
            Prompt::Text(text) => Prepared {
                tokens: state.preprocessor.text(&text),
                text: Some(text),
            },
            Prompt::Tokens(tokens) => {
                // Text workers get the ids' text.
                let text = state
                    .dispatcher
                    .has_text_workers()
                    .then(|| state.preprocessor.tokenizer().decode_lossy(&tokens));
                Prepared { tokens, text }
            }
            Prompt::TextBatch(_) | Prompt::TokenBatch(_) => {
                return Err(ApiError::invalid_param(
                    "prompt",
                    "this gateway serves one prompt per request; send a batch as separate requests",
                ));
            }
        };
        if prepared.tokens.is_empty() {
            return Err(ApiError::invalid_param("prompt", "`prompt` is empty"));
        }
        state.check_context(
            "prompt",
            prepared.tokens.len(),
            request.params.max_output_tokens(),
        )?;
        Ok(Parsed {
            api: Api::Completion,
            model: request.model,
            prepared,
            params: request.params,
            extra: request.extra,
        })
    }
    .await;
    match parsed {
        Ok(parsed) => serve(state, parsed, record).await,
        Err(e) => error_response(&e),
    }
}

/// Routes, forwards and relays one validated request.
async fn serve(state: Arc<AppState>, parsed: Parsed, mut record: RequestRecord) -> Response {
    let stream = parsed.params.is_stream();
    let include_usage = parsed.params.include_usage();
    let prompt_tokens = parsed.prepared.tokens.len();
    record.prompt_tokens = Some(prompt_tokens as u64);
    let key = state.dispatcher.key(&parsed.prepared.tokens);
    let mut last_error = None;
    for _attempt in 0..CONNECT_ATTEMPTS {
        let admit_start = Instant::now();
        let ticket = match state.dispatcher.admit(key.clone()).await {
            Ok(t) => t,
            Err(e) => return error_response(&admit_error(e)),
        };
        let queue_wait = if ticket.queued {
            admit_start.elapsed()
        } else {
            Duration::ZERO
        };
        let body = worker_body(
            &parsed.model,
            &parsed.prepared,
            &ticket.worker,
            parsed.params.clone(),
            &parsed.extra,
        );
        let pre_forward = record.started().elapsed().saturating_sub(queue_wait);
        record.pre_forward = Some(pre_forward);
        state.metrics.overhead.observe(pre_forward.as_secs_f64());
        let sent = state
            .http
            .post(&ticket.worker.completions_url)
            .header(header::CONTENT_TYPE, "application/json")
            .body(body)
            .send()
            .await;
        let response = match sent {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(worker = %ticket.worker.id, error = %e, "worker unreachable; routing again");
                state.metrics.worker_failures.inc();
                ticket.worker_failed();
                last_error = Some(e.to_string());
                continue;
            }
        };
        if !response.status().is_success() {
            let error = read_error(response).await;
            return error_response(&error);
        }
        let predicted = ticket.predicted_cached_tokens(prompt_tokens as u64);
        let ctx = OutputCtx {
            api: parsed.api,
            id: state.request_id(parsed.api),
            model: state.model.clone(),
            created: unix_now(),
            include_usage,
            return_token_ids: parsed.params.return_token_ids(),
            prompt_tokens: u32::try_from(prompt_tokens).unwrap_or(u32::MAX),
            predicted_cached_tokens: u32::try_from(predicted).unwrap_or(u32::MAX),
        };
        return respond(ctx, stream, response, ticket, record).await;
    }
    error_response(&ApiError::service_unavailable(format!(
        "no worker could be reached after {CONNECT_ATTEMPTS} attempts (last error: {})",
        last_error.unwrap_or_default()
    )))
}

async fn respond(
    ctx: OutputCtx,
    stream: bool,
    response: reqwest::Response,
    ticket: Ticket,
    record: RequestRecord,
) -> Response {
    let worker = HeaderValue::from(ticket.worker.id.0);
    let upstream = response.bytes_stream().boxed();
    let relay = Relay::new(ctx, stream, upstream, ticket, record);
    let mut response = respond_relay(stream, relay).await;
    // Which worker served the request: for debugging and tests (not an OpenAI header).
    response.headers_mut().insert(WORKER_HEADER, worker);
    response
}

/// Response header naming the worker that served the request.
pub const WORKER_HEADER: &str = "x-kvroute-worker";

async fn respond_relay(stream: bool, relay: Relay) -> Response {
    if stream {
        let mut response = Response::new(Body::from_stream(relay.into_sse_stream()));
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        );
        headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        response
    } else {
        match relay.into_response_body().await {
            Ok(body) => json_response(StatusCode::OK, body),
            Err(e) => error_response(&e),
        }
    }
}
