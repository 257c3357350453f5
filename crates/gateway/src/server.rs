//! The HTTP API: routes, request validation, preprocessing, routing and forwarding.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::Router as HttpRouter;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures::StreamExt;
use futures::future::BoxFuture;
use protocol::http::{check_model, json_response, read_json_within};
use protocol::{
    Api, ApiError, ApiRequest, ChatCompletionRequest, CompletionRequest, KvTransferParams, Model,
    ModelList, Prompt, ResponseHead, StreamOptions,
};
use router::{Continuation, Decision, FailureReason, MigrationState};
use serde_json::Value;

use crate::config::{PromptFormat, Timeouts};
use crate::dispatch::{AdmitError, Dispatcher, Ticket};
use crate::metrics::{CONTENT_TYPE, Metrics, PoolLabel};
use crate::preprocess::{Prepared, Preprocessor};
use crate::registry::WorkerInfo;
use crate::relay::{
    Migration, OutputCtx, Relay, RelayLimits, RequestRecord, Resend, Upstream, endpoint, read_error,
};

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
    pub max_response_bytes: usize,
    pub timeouts: Timeouts,
    /// How often workers' health is checked: how often a request waiting on a busy worker
    /// past its deadline is judged again.
    pub health_interval: Duration,
    /// Times a request may be resent after its worker failed mid-stream.
    pub migration_limit: u32,
    pub started: u64,
    pub next_id: AtomicU64,
    /// The NATS connection's state, with `--nats` (for `/health`).
    pub nats: Option<protocol::nats_client::NatsStatus>,
}

pub(crate) fn routes(state: Arc<AppState>) -> HttpRouter {
    let app = HttpRouter::new()
        .route(
            "/v1/chat/completions",
            post(handle::<ChatCompletionRequest>),
        )
        .route("/v1/completions", post(handle::<CompletionRequest>))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .with_state(state);
    // axum sets the `Allow` of its 405 outside a route's own layers: the body is written
    // around the whole router, where the header is known (as the engine server does).
    HttpRouter::new()
        .fallback_service(app)
        .layer(axum::middleware::map_response(
            protocol::http::method_not_allowed_json,
        ))
        .layer(axum::middleware::from_fn(protocol::listener::limit_headers))
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

async fn not_found() -> Response {
    ApiError::not_found(
        "Unknown path. This gateway serves /v1/chat/completions, /v1/completions, /v1/models, \
         /health and /metrics.",
    )
    .into_response()
}

async fn models(State(state): State<Arc<AppState>>) -> Response {
    let mut model = Model::new(state.model.as_ref(), "kvroute", state.started);
    model.max_model_len = Some(state.context_length);
    json_response(200, &ModelList::new(vec![model]))
}

async fn health(State(state): State<Arc<AppState>>) -> Response {
    let routable = state.dispatcher.routable_workers().len();
    let known = state.dispatcher.workers().len();
    // Prefill workers alone serve nothing: healthy takes a decode (or aggregated) worker.
    let serving = state.dispatcher.routable_decode_workers();
    let (status, word) = if serving > 0 {
        (200, "healthy")
    } else {
        (503, "unhealthy")
    };
    let mut body = serde_json::json!({
        "status": word,
        "model": state.model.as_ref(),
        "workers": known,
        "routable_workers": routable,
        "routable_decode_workers": serving,
    });
    if let Some(nats) = &state.nats {
        // A lost connection or refused subscriptions leave the index blind but the gateway
        // serving: reported, not a 503.
        body["nats"] = serde_json::json!(nats.health());
    }
    json_response(status, &body)
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let mut response = Response::new(Body::from(state.metrics.encode()));
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(CONTENT_TYPE));
    response
}

impl AppState {
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
        format!("{}-{:x}-{n}", api.id_prefix(), self.started)
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

/// Which leg of a request a worker request is, in vLLM's disaggregated flow.
#[derive(Debug, Clone)]
enum Leg {
    /// The whole request (an aggregated worker, or a local prefill on a decode worker).
    Whole,
    /// The prefill leg: `kv_transfer_params.do_remote_decode`, one token, not streamed.
    Prefill,
    /// The decode leg: the prefill worker's answer, for the decode worker to pull the KV.
    Decode(KvTransferParams),
}

/// The worker request: a `/v1/completions` body with the prompt as token ids (or text),
/// streamed with usage so the gateway sees every token and the cache hit count (a prefill
/// leg: one token, one response, as vLLM's disaggregated proxy sends it).
fn worker_body(
    model: &str,
    prepared: &Prepared,
    worker: &WorkerInfo,
    mut params: protocol::SamplingParams,
    extra: &serde_json::Map<String, Value>,
    leg: &Leg,
) -> Result<Vec<u8>, ApiError> {
    if worker.token_ids {
        params.return_token_ids = Some(true);
    }
    params.kv_transfer_params = match leg {
        Leg::Whole => None,
        Leg::Prefill => Some(KvTransferParams {
            do_remote_decode: true,
            ..KvTransferParams::default()
        }),
        Leg::Decode(transfer) => Some(transfer.clone()),
    };
    let prompt = match (worker.prompt, &prepared.text) {
        (PromptFormat::Text, Some(text)) => Prompt::Text(text.clone()),
        _ => Prompt::Tokens(prepared.tokens.clone()),
    };
    params.max_tokens = params.max_output_tokens();
    params.max_completion_tokens = None;
    if let Leg::Prefill = leg {
        params.max_tokens = Some(1);
        params.stream = Some(false);
        params.stream_options = None;
    } else {
        params.stream = Some(true);
        let mut options = params.stream_options.take().unwrap_or_default();
        options.include_usage = true;
        params.stream_options = Some(StreamOptions {
            include_usage: true,
            extra: options.extra,
        });
    }
    let request = CompletionRequest {
        model: model.to_string(),
        prompt,
        params,
        extra: extra.clone(),
    };
    serde_json::to_vec(&request)
        .map_err(|e| ApiError::internal(format!("could not write the worker's request: {e}")))
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

/// Why a prefill leg handed on no KV; the request is then prefilled on its decode worker.
#[derive(Debug, thiserror::Error)]
enum PrefillError {
    #[error("the prefill worker could not be reached: {0}")]
    Unreachable(String),
    #[error("the prefill worker did not answer within {0:?}")]
    Timeout(Duration),
    #[error("the prefill worker failed: {0}")]
    Failed(String),
    #[error("the prefill worker refused the request: {0}")]
    Refused(String),
    #[error("the prefill worker's answer carries no kv_transfer_params: {0}")]
    NoParams(String),
}

impl PrefillError {
    /// The worker itself failed (not the request): it leaves the routing set.
    fn worker_failed(&self) -> bool {
        matches!(self, PrefillError::Unreachable(_) | PrefillError::Failed(_))
    }
}

/// Largest prefill answer read (one token, usage and the KV parameters).
const MAX_PREFILL_ANSWER: usize = 4 << 20;

/// The prefill answer's field the decode leg needs.
#[derive(serde::Deserialize)]
struct PrefillAnswer {
    #[serde(default)]
    kv_transfer_params: Option<KvTransferParams>,
}

/// Runs a prefill leg on `worker` and returns the parameters its decode leg carries.
async fn run_prefill(
    state: &AppState,
    worker: &WorkerInfo,
    body: Vec<u8>,
) -> Result<KvTransferParams, PrefillError> {
    let timeout = state.dispatcher.prefill_timeout();
    let sent = state
        .http
        .post(&worker.completions_url)
        .header(header::CONTENT_TYPE, "application/json")
        .timeout(timeout)
        .body(body)
        .send()
        .await;
    let response = match sent {
        Ok(r) => r,
        Err(e) if e.is_timeout() => return Err(PrefillError::Timeout(timeout)),
        Err(e) => return Err(PrefillError::Unreachable(e.to_string())),
    };
    let status = response.status();
    if !status.is_success() {
        let error = read_error(response).await;
        let message = format!("{status}: {}", error.detail.message);
        return Err(if status.is_server_error() {
            PrefillError::Failed(message)
        } else {
            PrefillError::Refused(message)
        });
    }
    let mut answer = Vec::new();
    let mut stream = response.bytes_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| {
            if e.is_timeout() {
                PrefillError::Timeout(timeout)
            } else {
                PrefillError::Unreachable(e.to_string())
            }
        })?;
        if answer.len() + chunk.len() > MAX_PREFILL_ANSWER {
            return Err(PrefillError::NoParams(format!(
                "the answer is over {MAX_PREFILL_ANSWER} bytes"
            )));
        }
        answer.extend_from_slice(&chunk);
    }
    let answer: PrefillAnswer = serde_json::from_slice(&answer)
        .map_err(|e| PrefillError::NoParams(format!("not JSON: {e}")))?;
    match answer.kv_transfer_params {
        Some(params) if params.do_remote_prefill => Ok(params),
        Some(_) => Err(PrefillError::NoParams(
            "do_remote_prefill is not set".to_string(),
        )),
        None => Err(PrefillError::NoParams(
            "is it a disaggregated worker (vLLM: --kv-transfer-config with a KV connector)?"
                .to_string(),
        )),
    }
}

struct Parsed {
    api: Api,
    model: String,
    prepared: Prepared,
    params: protocol::SamplingParams,
    extra: serde_json::Map<String, Value>,
}

/// A request kind the gateway serves: its prompt, prepared for routing and forwarding.
trait Prepare: ApiRequest + Send + 'static {
    /// Templates and tokenizes the prompt (taking it out of the request).
    fn prepare(&mut self, state: &AppState) -> Result<Prepared, ApiError>;
}

/// Reads, checks and prepares a request of either API, then serves it; every outcome is
/// counted under the request's endpoint.
async fn handle<R: Prepare>(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let mut record = RequestRecord::start(state.metrics.clone(), endpoint(R::API), false);
    let parsed = async {
        let mut request: R =
            read_json_within(&headers, body, state.max_body_bytes, state.timeouts.body).await?;
        record.set_stream(request.params().is_stream());
        check_model(&state.model, request.model())?;
        let prepared = request.prepare(&state)?;
        state.check_context(
            R::API.prompt_field(),
            prepared.tokens.len(),
            request.params().max_output_tokens(),
        )?;
        let (model, params, extra) = request.into_parts();
        Ok::<_, ApiError>(Parsed {
            api: R::API,
            model,
            prepared,
            params,
            extra: match R::API {
                Api::Chat => chat_extra_for_completions(extra),
                Api::Completion => extra,
            },
        })
    }
    .await;
    match parsed {
        Ok(parsed) => serve(state, parsed, record).await,
        Err(e) => e.into_response(),
    }
}

impl Prepare for ChatCompletionRequest {
    fn prepare(&mut self, state: &AppState) -> Result<Prepared, ApiError> {
        if self.messages.is_empty() {
            return Err(ApiError::invalid_param(
                "messages",
                "`messages` must contain at least one message",
            ));
        }
        let messages: Vec<text::ChatMessage> = self
            .messages
            .iter()
            .map(|m| text::ChatMessage::new(m.role.clone(), m.text()))
            .collect();
        let need_text = state.dispatcher.has_text_workers();
        state
            .preprocessor
            .chat(&messages, need_text)
            .map_err(|e| ApiError::chat_template(e.is_template_failure(), e.to_string()))
    }
}

impl Prepare for CompletionRequest {
    fn prepare(&mut self, state: &AppState) -> Result<Prepared, ApiError> {
        let prepared = match std::mem::replace(&mut self.prompt, Prompt::Tokens(Vec::new())) {
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
        Ok(prepared)
    }
}

/// Routes, forwards and relays one validated request.
async fn serve(state: Arc<AppState>, parsed: Parsed, mut record: RequestRecord) -> Response {
    let stream = parsed.params.is_stream();
    let include_usage = parsed.params.include_usage();
    let prompt_tokens = parsed.prepared.tokens.len();
    record.prompt_tokens = Some(prompt_tokens as u64);
    let opened = match open(&state, &parsed, record.started()).await {
        Ok(opened) => opened,
        Err(e) => return e.into_response(),
    };
    record.pools = opened.pools;
    record.pre_forward = Some(opened.pre_forward);
    state
        .metrics
        .overhead
        .observe(opened.pre_forward.as_secs_f64());
    let ticket = opened.ticket;
    let predicted = ticket.predicted_cached_tokens(prompt_tokens as u64);
    record.routed_reuse = Some((
        ticket.available_cached_tokens(prompt_tokens as u64),
        predicted,
    ));
    let ctx = OutputCtx {
        head: ResponseHead {
            api: parsed.api,
            id: state.request_id(parsed.api),
            model: state.model.clone(),
            created: unix_now(),
        },
        include_usage,
        return_token_ids: parsed.params.return_token_ids(),
        prompt_tokens: u32::try_from(prompt_tokens).unwrap_or(u32::MAX),
        predicted_cached_tokens: u32::try_from(predicted).unwrap_or(u32::MAX),
    };
    let limits = RelayLimits {
        recheck: state.health_interval,
        stall: state.timeouts.stall,
        max_response_bytes: state.max_response_bytes,
    };
    // The core turns it off for a limit of 0 and for more choices than it keeps.
    let migration = MigrationState::new(
        state.migration_limit,
        parsed.params.n.unwrap_or(1),
        state.max_response_bytes,
    );
    let migration = migration.is_kept().then(|| Migration {
        state: migration,
        resend: Box::new(Migrator {
            state: state.clone(),
            parsed,
        }),
    });
    respond(
        ctx,
        stream,
        opened.upstream,
        (ticket, migration),
        record,
        limits,
    )
    .await
}

/// A worker's stream for a request, opened.
struct Opened {
    ticket: Ticket,
    upstream: Upstream,
    /// The pools that prefill and decode it.
    pools: (PoolLabel, PoolLabel),
    /// The gateway's own time before forwarding (queue waits excluded).
    pre_forward: Duration,
}

/// Routes a request and opens a worker's stream for it: up to [`CONNECT_ATTEMPTS`] workers
/// that refuse the connection, and `first_byte_retries` ([`router::FailoverConfig`]) that
/// send nothing in time, are
/// ejected and the request routed again.
async fn open(state: &AppState, parsed: &Parsed, started: Instant) -> Result<Opened, ApiError> {
    let key = state.dispatcher.key(&parsed.prepared.tokens);
    let mut last_error = None;
    let mut timeouts = 0;
    for _attempt in 0..CONNECT_ATTEMPTS {
        let admit_start = Instant::now();
        let mut ticket = match state.dispatcher.admit(key.clone()).await {
            Ok(t) => t,
            Err(AdmitError::NoWorkers) if state.dispatcher.is_disaggregated() => {
                return Err(ApiError::service_unavailable(
                    "no decode worker is available: a disaggregated fleet needs a decode (or \
                     aggregated) worker to serve a request; prefill workers cannot serve one \
                     alone",
                ));
            }
            Err(e) => return Err(admit_error(e)),
        };
        let mut leg = Leg::Whole;
        if let Some((prefill, _)) = ticket.prefill.clone() {
            let body = worker_body(
                &parsed.model,
                &parsed.prepared,
                &prefill,
                parsed.params.clone(),
                &parsed.extra,
                &Leg::Prefill,
            )?;
            match run_prefill(state, &prefill, body).await {
                Ok(transfer) => {
                    ticket.prefill_done();
                    leg = Leg::Decode(transfer);
                }
                Err(e) => {
                    tracing::warn!(worker = %prefill.id, error = %e, "prefill leg failed; prefilling on the decode worker");
                    state.metrics.prefill_failures.inc();
                    ticket.prefill_failed();
                    if e.worker_failed() {
                        state.metrics.worker_failures.inc();
                        state.dispatcher.worker_failed(prefill.id);
                    }
                }
            }
        }
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
            &leg,
        )?;
        let serving = PoolLabel::of_role(ticket.worker.role);
        let prefilled = match leg {
            Leg::Decode(_) => PoolLabel::Prefill,
            Leg::Whole | Leg::Prefill => serving,
        };
        let pre_forward = started.elapsed().saturating_sub(queue_wait);
        // Response headers and the first body bytes, within one deadline: a worker that
        // accepts and stays silent (stopped, wedged) is ejected and the request, of which
        // nothing reached the client yet, goes to another worker once.
        let deadline = tokio::time::Instant::now() + state.timeouts.first_byte;
        let sent = state
            .http
            .post(&ticket.worker.completions_url)
            .header(header::CONTENT_TYPE, "application/json")
            .body(body)
            .send();
        let response = match wait_for_worker(state, &ticket, deadline, sent).await {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => {
                tracing::warn!(worker = %ticket.worker.id, error = %e, "worker unreachable; routing again");
                state.metrics.worker_failures.inc();
                ticket.worker_failed();
                last_error = Some(e.to_string());
                continue;
            }
            Err(_) => match silent_worker(state, &ticket, &mut timeouts) {
                Some(error) => return Err(error),
                None => continue,
            },
        };
        if !response.status().is_success() {
            return match wait_for_worker(state, &ticket, deadline, read_error(response)).await {
                Ok(error) => Err(error),
                Err(_) => match silent_worker(state, &ticket, &mut timeouts) {
                    Some(error) => Err(error),
                    None => continue,
                },
            };
        }
        let mut upstream = response.bytes_stream().boxed();
        let first = match wait_for_worker(state, &ticket, deadline, upstream.next()).await {
            Ok(Some(Ok(bytes))) => {
                ticket.output_seen();
                Some(bytes)
            }
            // A broken or empty stream: the relay reports it as today.
            Ok(Some(Err(e))) => {
                upstream = futures::stream::once(async { Err(e) }).boxed();
                None
            }
            Ok(None) => None,
            Err(_) => match silent_worker(state, &ticket, &mut timeouts) {
                Some(error) => return Err(error),
                None => continue,
            },
        };
        let first_read = Instant::now();
        if state.dispatcher.is_disaggregated() {
            state.metrics.count_route(ticket.route_labels());
        }
        return Ok(Opened {
            ticket,
            upstream: (first, first_read, upstream),
            pools: (prefilled, serving),
            pre_forward,
        });
    }
    Err(ApiError::service_unavailable(format!(
        "no worker could be reached after {CONNECT_ATTEMPTS} attempts (last error: {})",
        last_error.unwrap_or_default()
    )))
}

/// Resends a request whose worker failed mid-stream, as Dynamo's request migration does: its
/// prompt followed by the output so far (for a chat, the rendered prompt ends with the
/// assistant header, so this is the partial assistant message continued, as vLLM's
/// `continue_final_message`), `max_tokens` reduced by the tokens already generated, routed
/// again (the failed worker is out of the routing set).
struct Migrator {
    state: Arc<AppState>,
    parsed: Parsed,
}

impl Migrator {
    /// The request to send for the core's `continuation`: its tokens, the output text
    /// appended to a text prompt, `max_tokens` reduced.
    fn continued(&self, continuation: Continuation) -> Parsed {
        let parsed = &self.parsed;
        let mut params = parsed.params.clone();
        if let Some(left) = continuation.max_tokens {
            params.max_tokens = Some(left);
            params.max_completion_tokens = None;
        }
        // One choice of several is continued on its own.
        if params.n.is_some_and(|n| n > 1) {
            params.n = Some(1);
        }
        let text = parsed.prepared.text.as_ref().map(|prompt| {
            let output = &continuation.output_text;
            let mut text = String::with_capacity(prompt.len() + output.len());
            text.push_str(prompt);
            text.push_str(output);
            text
        });
        Parsed {
            api: parsed.api,
            model: parsed.model.clone(),
            prepared: Prepared {
                tokens: continuation.tokens,
                text,
            },
            params,
            extra: parsed.extra.clone(),
        }
    }
}

impl Resend for Migrator {
    fn decide(&self, state: &mut MigrationState, reason: FailureReason) -> Decision {
        let parsed = &self.parsed;
        state.decide(
            reason,
            &parsed.prepared.tokens,
            parsed.params.max_output_tokens(),
            // Output without the worker's ids: the text's, as the model's tokenizer writes it.
            |text| self.state.preprocessor.tokenizer().encode_ordinary(text),
        )
    }

    fn next(&self, state: &mut MigrationState) -> Option<Continuation> {
        let parsed = &self.parsed;
        state.next_continuation(
            &parsed.prepared.tokens,
            parsed.params.max_output_tokens(),
            |text| self.state.preprocessor.tokenizer().encode_ordinary(text),
        )
    }

    fn resend(
        &mut self,
        continuation: Continuation,
    ) -> BoxFuture<'_, Result<(Ticket, Upstream), ApiError>> {
        Box::pin(async move {
            let continued = self.continued(continuation);
            let opened = open(&self.state, &continued, Instant::now()).await?;
            Ok((opened.ticket, opened.upstream))
        })
    }
}

/// Awaits `reply` from `ticket`'s worker until `deadline`, the first-byte deadline. Past it the
/// worker is judged ([`Ticket::judge_deadline`]): a busy worker (still streaming its other
/// requests) is waited for, judged again later; a silent one gives `Err`.
async fn wait_for_worker<F: std::future::Future>(
    state: &AppState,
    ticket: &Ticket,
    deadline: tokio::time::Instant,
    reply: F,
) -> Result<F::Output, tokio::time::error::Elapsed> {
    let mut reply = std::pin::pin!(reply);
    let mut deadline = deadline;
    loop {
        match tokio::time::timeout_at(deadline, reply.as_mut()).await {
            Ok(out) => return Ok(out),
            Err(elapsed) => {
                match ticket.judge_deadline(state.timeouts.first_byte, state.health_interval) {
                    Some(wait) => deadline = tokio::time::Instant::now() + wait,
                    None => return Err(elapsed),
                }
            }
        }
    }
}

/// A worker sent nothing by the first-byte deadline: it is ejected (health checks bring it
/// back) and the request is routed again, or, past `first_byte_retries`
/// ([`router::FailoverConfig`], the simulator's too), answered with 504.
fn silent_worker(state: &AppState, ticket: &Ticket, timeouts: &mut u32) -> Option<ApiError> {
    let after = state.timeouts.first_byte;
    tracing::warn!(worker = %ticket.worker.id, ?after, "worker sent nothing on any request in time; ejected, routing again");
    state.metrics.worker_timeouts.inc();
    ticket.worker_failed();
    *timeouts += 1;
    let retries = router::FailoverConfig::default().first_byte_retries;
    (*timeouts > retries).then(|| {
        ApiError::new(
            504,
            protocol::error::kind::SERVER,
            format!(
                "{} workers in a row sent nothing within {:.1} s (first-byte timeout); they \
                 are ejected until they answer their health checks. Retry later.",
                *timeouts,
                after.as_secs_f64()
            ),
            None,
            Some("worker_timeout"),
        )
    })
}

async fn respond(
    ctx: OutputCtx,
    stream: bool,
    upstream: Upstream,
    (ticket, migration): (Ticket, Option<Migration>),
    record: RequestRecord,
    limits: RelayLimits,
) -> Response {
    let worker = HeaderValue::from(ticket.worker.id.0);
    let (route, reason) = ticket.route_labels();
    // Only a disaggregated fleet has routes to tell apart.
    let route = ticket
        .fleet_disaggregated()
        .then(|| HeaderValue::from_static(if route == "split" { "split" } else { reason }));
    let relay = Relay::new(ctx, stream, upstream, (ticket, migration), record, limits);
    let mut response = respond_relay(stream, relay).await;
    // Which worker served the request: for debugging and tests (not an OpenAI header).
    response.headers_mut().insert(WORKER_HEADER, worker);
    if let Some(route) = route {
        response.headers_mut().insert(ROUTE_HEADER, route);
    }
    response
}

/// Response header of a disaggregated fleet naming the route: `split` (prefill worker, then the decode worker that
/// served it), or why it was prefilled locally (`short_prefill`, `prefill_unavailable`,
/// `prefill_failed`); not an OpenAI header.
pub const ROUTE_HEADER: &str = "x-kvroute-route";

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
            Ok(body) => ([(header::CONTENT_TYPE, "application/json")], body).into_response(),
            Err(e) => e.into_response(),
        }
    }
}
