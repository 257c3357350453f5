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
use bytes::{Bytes, BytesMut};
use engine::{EngineRequest, Leg, OutputSpec, RejectReason, RequestId};
use protocol::http::{check_model, json_response, read_json_within};
use protocol::{
    Api, ApiError, ApiRequest, ChatCompletionRequest, ChoiceOut, CompletionRequest, FinishReason,
    KvTransferParams, Model, ModelList, Prompt, ResponseHead, SamplingParams, TokenIds, Usage,
    WorkerCard, WorkerRole, openai::Stop, sse,
};
use serde::Deserialize;
use tokio::sync::{mpsc, watch};

use crate::config::ReplyLength;
use crate::driver::{Clock, Command, FinishInfo, Progress, RequestState, Snapshot, Submission};
use crate::metrics::ServerMetrics;
use crate::replies::{
    ChatPromptError, LengthRequest, PlannedReply, StopHold, TextAssets, plan_reply,
};

/// Shared by every handler.
pub struct AppState {
    pub info: WorkerCard,
    pub commands: mpsc::Sender<Command>,
    pub next_id: AtomicU64,
    pub assets: Arc<TextAssets>,
    pub reply_length: ReplyLength,
    pub seed: u64,
    pub body_limit: usize,
    /// A client's whole request body (408 after it).
    pub body_timeout: std::time::Duration,
    pub metrics: Arc<ServerMetrics>,
    pub snapshot: Arc<Mutex<Snapshot>>,
    pub clock: Clock,
    /// Unix seconds at start-up (`created` of `/v1/models`).
    pub started: u64,
    /// The NATS connection's state, when KV events and registration go over NATS.
    pub nats: Option<protocol::nats_client::NatsStatus>,
    /// Asks the KV publisher for its whole cache (`GET /kv_state`), when it publishes on ZMQ.
    pub zmq_state: Option<mpsc::Sender<crate::publish::ZmqStateRequest>>,
}

pub fn router(state: Arc<AppState>) -> Router {
    let api = Router::new()
        .route("/v1/completions", post(handle::<CompletionRequest>))
        .route(
            "/v1/chat/completions",
            post(handle::<ChatCompletionRequest>),
        )
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/info", get(info))
        .route("/kv_state", get(kv_state))
        .route("/tokenize", post(tokenize))
        .route("/metrics", get(metrics));
    let app = crate::compat::routes(api)
        .fallback(|| async { ApiError::not_found("no such endpoint") })
        .with_state(state);
    // axum sets the `Allow` of its 405 outside a route's own layers: the body is written
    // around the whole router, where the header is known.
    Router::new()
        .fallback_service(app)
        .layer(axum::middleware::map_response(
            protocol::http::method_not_allowed_json,
        ))
        .layer(axum::middleware::from_fn(protocol::listener::limit_headers))
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A request kind the engine serves: its prompt as token ids.
trait TakePrompt: ApiRequest + Send + 'static {
    /// Takes the prompt out of the request, tokenized.
    fn take_prompt(&mut self, state: &AppState) -> Result<Vec<u32>, ApiError>;
}

/// Reads and checks a request of either API, takes its prompt out as token ids, then serves
/// it.
async fn handle<R: TakePrompt>(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let result = async {
        let mut request: R =
            read_json_within(&headers, body, state.body_limit, state.body_timeout).await?;
        check_model(&state.info.model, request.model())?;
        let prompt = request.take_prompt(&state)?;
        serve(&state, prompt, request.params(), R::API, request.model()).await
    }
    .await;
    result.unwrap_or_else(IntoResponse::into_response)
}

impl TakePrompt for ChatCompletionRequest {
    fn take_prompt(&mut self, state: &AppState) -> Result<Vec<u32>, ApiError> {
        if self.messages.is_empty() {
            return Err(ApiError::invalid_param("messages", "`messages` is empty"));
        }
        let flag = |name: &str| -> Result<Option<bool>, ApiError> {
            match self.extra.get(name) {
                None | Some(serde_json::Value::Null) => Ok(None),
                Some(serde_json::Value::Bool(b)) => Ok(Some(*b)),
                Some(_) => Err(ApiError::invalid_param(
                    name,
                    format!("`{name}` must be true or false"),
                )),
            }
        };
        // vLLM's defaults and rule: a generation prompt unless told otherwise, and never with
        // an open final message.
        let continue_final = flag("continue_final_message")?.unwrap_or(false);
        let generation_prompt = flag("add_generation_prompt")?.unwrap_or(true);
        let ending = match (continue_final, generation_prompt) {
            (true, true) => {
                return Err(ApiError::invalid_param(
                    "continue_final_message",
                    "`continue_final_message` and `add_generation_prompt` cannot both be true; \
                     set `add_generation_prompt: false` to continue the final message",
                ));
            }
            (true, false) => text::ChatEnding::ContinueFinal,
            (false, true) => text::ChatEnding::GenerationPrompt,
            (false, false) => text::ChatEnding::Closed,
        };
        chat_prompt(state, &self.messages, ending)
    }
}

impl TakePrompt for CompletionRequest {
    fn take_prompt(&mut self, state: &AppState) -> Result<Vec<u32>, ApiError> {
        match std::mem::replace(&mut self.prompt, Prompt::Tokens(Vec::new())) {
            Prompt::Tokens(tokens) => Ok(tokens),
            Prompt::Text(text) => Ok(state.assets.encode(&text)),
            Prompt::TokenBatch(mut batch) if batch.len() == 1 => Ok(batch.remove(0)),
            Prompt::TextBatch(batch) if batch.len() == 1 => Ok(state.assets.encode(&batch[0])),
            _ => Err(ApiError::invalid_param(
                "prompt",
                "this server takes one prompt per request",
            )),
        }
    }
}

/// The chat template applied to `messages`, tokenized.
fn chat_prompt(
    state: &AppState,
    messages: &[protocol::RequestMessage],
    ending: text::ChatEnding,
) -> Result<Vec<u32>, ApiError> {
    let messages: Vec<text::ChatMessage> = messages
        .iter()
        .map(|m| text::ChatMessage::new(m.role.clone(), m.text()))
        .collect();
    state
        .assets
        .chat_prompt_ending(&messages, ending)
        .map_err(|e| match e {
            ChatPromptError::Refused(e) => ApiError::chat_template(false, e.to_string()),
            ChatPromptError::Failed(message) => ApiError::chat_template(true, message),
        })
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
        RejectReason::NoOutput
        | RejectReason::TooLargeForPool { .. }
        | RejectReason::LegNotServed { .. } => ApiError::invalid_request(reason.to_string()),
        RejectReason::DuplicateId => ApiError::internal(reason.to_string()),
    }
}

async fn serve(
    state: &Arc<AppState>,
    prompt: Vec<u32>,
    params: &SamplingParams,
    api: Api,
    model: &str,
) -> Result<Response, ApiError> {
    let param = api.prompt_field();
    if prompt.is_empty() {
        return Err(ApiError::invalid_param(param, "the prompt is empty"));
    }
    if params.n.is_some_and(|n| n != 1) {
        return Err(ApiError::invalid_param("n", "only n = 1 is supported"));
    }
    let stops = stop_strings(params.stop.as_ref())?;
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
    let leg = request_leg(state.info.role, params)?;
    let room = context - prompt.len() as u32;
    let request_seed = params.seed.unwrap_or(0).rotate_left(17);
    let mut reply = plan_reply(
        &state.assets,
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
    // The reply is planned whole, so a stop string is found before the engine runs it: the
    // engine generates the tokens up to the one completing it and no more, finishing the
    // request there (no simulated GPU time after it), as a real engine does once it decodes
    // the stop string.
    reply.stop_at(&stops);

    let id = RequestId(state.next_id.fetch_add(1, Ordering::Relaxed));
    let (progress_tx, mut progress) = watch::channel(Progress::new());
    let submission = Submission {
        request: EngineRequest {
            id,
            prompt: prompt.into(),
            output: OutputSpec::Tokens(reply.ids.clone()),
            leg,
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
        head: ResponseHead {
            api,
            id: format!(
                "{}-{}-{}",
                api.id_prefix(),
                state.info.worker.unwrap_or_default().0,
                id.0
            ),
            model: model.into(),
            created: unix_now(),
        },
        include_usage: params.include_usage(),
        token_ids: params.return_token_ids(),
    };
    if params.is_stream() {
        let relay = Relay {
            progress,
            reply,
            meta,
            sent: 0,
            sent_text: 0,
            hold: (!stops.is_empty()).then(|| StopHold::new(&stops)),
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
    let body = if leg == Leg::Prefill {
        let params = remote_prefill_params(&state.info, prompt_len);
        meta.prefill_response(&reply, &finish, params)?
    } else {
        meta.full_response(&reply, &finish)?
    };
    Ok(([(header::CONTENT_TYPE, "application/json")], body).into_response())
}

/// OpenAI's limit on `stop` strings.
const MAX_STOP_STRINGS: usize = 4;

/// OpenAI's `stop`: a string or a list of at most four, none empty (400 naming `stop`
/// otherwise; a value of another type is refused when the body is read). The reply's text is
/// matched, which the engine has whatever the prompt's form (text or token ids).
fn stop_strings(stop: Option<&Stop>) -> Result<Vec<&str>, ApiError> {
    let stops: Vec<&str> = match stop {
        None => Vec::new(),
        Some(Stop::One(one)) => vec![one.as_str()],
        Some(Stop::Many(many)) => many.iter().map(String::as_str).collect(),
    };
    if stops.len() > MAX_STOP_STRINGS {
        return Err(ApiError::invalid_param(
            "stop",
            format!(
                "`stop` takes at most {MAX_STOP_STRINGS} strings; this request has {}",
                stops.len()
            ),
        ));
    }
    if stops.iter().any(|s| s.is_empty()) {
        return Err(ApiError::invalid_param(
            "stop",
            "`stop` strings must not be empty",
        ));
    }
    Ok(stops)
}

/// The leg a request runs as here, from its `kv_transfer_params` as vLLM's disaggregated
/// proxy sends them: `do_remote_decode` (prefill here, a decode worker continues) is a
/// prefill leg, `do_remote_prefill` (a prefill worker computed the prompt; pull its KV) a
/// decode leg, neither a whole request. A prefill worker serves only prefill legs, answered
/// in one response (its `kv_transfer_params` are what the decode worker needs).
fn request_leg(role: WorkerRole, params: &SamplingParams) -> Result<Leg, ApiError> {
    let transfer = params.kv_transfer_params.as_ref();
    let remote_decode = transfer.is_some_and(|t| t.do_remote_decode);
    let remote_prefill = transfer.is_some_and(|t| t.do_remote_prefill);
    let leg = match (remote_decode, remote_prefill) {
        (true, true) => {
            return Err(ApiError::invalid_param(
                "kv_transfer_params",
                "do_remote_decode and do_remote_prefill cannot both be true: a request is \
                 either prefilled here for a decode worker or decoded here after a prefill \
                 worker",
            ));
        }
        (true, false) => Leg::Prefill,
        (false, true) => Leg::Decode,
        (false, false) => Leg::Whole,
    };
    match (role, leg) {
        (WorkerRole::Prefill, Leg::Whole) => Err(ApiError::invalid_param(
            "kv_transfer_params",
            "this is a prefill worker (kvroute engine --role prefill): it serves only the \
             prefill leg of a disaggregated request; send `kv_transfer_params: \
             {\"do_remote_decode\": true}` with `stream: false` (a gateway with prefill and \
             decode pools does this), or send the request to a decode or aggregated worker",
        )),
        (WorkerRole::Prefill, Leg::Decode) => Err(ApiError::invalid_param(
            "kv_transfer_params",
            "this is a prefill worker (kvroute engine --role prefill): it cannot decode a \
             request prefilled elsewhere (do_remote_prefill); send it to a decode worker",
        )),
        (WorkerRole::Decode, Leg::Prefill) => Err(ApiError::invalid_param(
            "kv_transfer_params",
            "this is a decode worker (kvroute engine --role decode): it does not prefill for \
             another worker (do_remote_decode); send it to a prefill worker",
        )),
        (_, Leg::Prefill) if params.is_stream() => Err(ApiError::invalid_param(
            "stream",
            "a prefill leg (kv_transfer_params.do_remote_decode) is answered in one response \
             carrying the KV transfer parameters; send `stream: false`",
        )),
        _ => Ok(leg),
    }
}

/// What a prefill leg hands on, as vLLM's NixlConnector answers it: the decode worker pulls
/// the prompt's KV from this engine (`remote_engine_id`, its address, the blocks holding the
/// prompt). The simulated transfer is priced by the decode worker's link, so the block ids
/// are the prompt's block indices here.
fn remote_prefill_params(card: &WorkerCard, prompt_tokens: u64) -> KvTransferParams {
    let block = u64::from(card.block_size.unwrap_or(1).max(1));
    let blocks: Vec<u64> = (0..prompt_tokens.div_ceil(block)).collect();
    let authority = card
        .url
        .split_once("://")
        .map_or(card.url.as_str(), |(_, rest)| rest)
        .split('/')
        .next()
        .unwrap_or_default();
    let (host, port) = match authority.rsplit_once(':') {
        Some((host, port)) => (host, port.parse().ok()),
        None => (authority, None),
    };
    KvTransferParams {
        do_remote_decode: false,
        do_remote_prefill: true,
        remote_engine_id: Some(format!(
            "kvroute-{}-{:016x}",
            card.worker.unwrap_or_default().0,
            card.instance
        )),
        remote_block_ids: Some(serde_json::json!(blocks)),
        remote_host: Some(host.to_string()),
        remote_port: port,
        tp_size: Some(1),
        extra: serde_json::Map::new(),
    }
}

/// What every response and chunk of one request repeats.
struct ResponseMeta {
    head: ResponseHead,
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
    /// A choice of the reply's tokens `from..to` (their ids, when asked for) and of the bytes
    /// `text` of its text (behind the tokens' own while a stream holds back a possible stop
    /// string).
    fn choice<'a>(
        &self,
        reply: &'a PlannedReply,
        (from, to): (u32, u32),
        text: std::ops::Range<usize>,
        finish: Option<FinishReason>,
    ) -> ChoiceOut<'a> {
        ChoiceOut {
            index: 0,
            // The role rides on the first content chunk, so the first event a client sees is
            // the first token (TTFT measured on it is right).
            role: (from == 0).then_some("assistant"),
            content: Some(reply.text.get(text).unwrap_or_default()),
            logprobs: None,
            finish_reason: finish.map(FinishReason::as_str),
            token_ids: self
                .token_ids
                .then(|| TokenIds::Ids(&reply.ids[from as usize..to as usize])),
        }
    }

    fn full_response(
        &self,
        reply: &PlannedReply,
        finish: &FinishInfo,
    ) -> Result<Vec<u8>, ApiError> {
        let choice = self.choice(
            reply,
            (0, finish.output_tokens),
            0..reply.text_upto(finish.output_tokens).len(),
            Some(finish_reason(reply)),
        );
        self.head
            .response_json(std::iter::once(choice), Some(&usage(finish)))
            .map_err(|e| ApiError::internal(format!("could not write the response: {e}")))
    }

    /// A prefill leg's response: its one token, and the top-level `kv_transfer_params` a
    /// decode worker needs (vLLM adds them beside `choices`).
    fn prefill_response(
        &self,
        reply: &PlannedReply,
        finish: &FinishInfo,
        params: KvTransferParams,
    ) -> Result<Vec<u8>, ApiError> {
        let written = |e: serde_json::Error| {
            ApiError::internal(format!("could not write the prefill response: {e}"))
        };
        let choice = self.choice(
            reply,
            (0, finish.output_tokens),
            0..reply.text_upto(finish.output_tokens).len(),
            Some(FinishReason::Length),
        );
        let body = self
            .head
            .response_json(std::iter::once(choice), Some(&usage(finish)))
            .map_err(written)?;
        let mut response: serde_json::Map<String, serde_json::Value> =
            serde_json::from_slice(&body).map_err(written)?;
        let params = serde_json::to_value(params).map_err(written)?;
        response.insert("kv_transfer_params".to_string(), params);
        serde_json::to_vec(&response).map_err(written)
    }

    /// Appends one chunk: tokens `from..to`, the reply's new text `text`, an optional finish
    /// reason.
    fn write_chunk(
        &self,
        out: &mut BytesMut,
        reply: &PlannedReply,
        tokens: (u32, u32),
        text: std::ops::Range<usize>,
        finish: Option<FinishReason>,
    ) -> Result<(), serde_json::Error> {
        let choice = self.choice(reply, tokens, text, finish);
        self.head.write_chunk(out, std::iter::once(choice), None)
    }

    /// Appends the last chunk of `stream_options.include_usage`: no choices, the usage.
    fn write_usage_chunk(
        &self,
        out: &mut BytesMut,
        finish: &FinishInfo,
    ) -> Result<(), serde_json::Error> {
        self.head
            .write_chunk(out, std::iter::empty(), Some(&usage(finish)))
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
    /// Tokens sent.
    sent: u32,
    /// Bytes of the reply's text sent.
    sent_text: usize,
    /// With `stop` strings: the text that may begin one is held back until the next tokens
    /// show it does not (or the reply ends before it).
    hold: Option<StopHold>,
    phase: Phase,
    guard: CancelGuard,
}

type Item = (Result<Bytes, Infallible>, Relay);

impl Relay {
    async fn next_bytes(mut self) -> Option<Item> {
        if self.phase == Phase::Done {
            return None;
        }
        loop {
            let (produced, state) = {
                let progress = self.progress.borrow_and_update();
                (progress.produced, progress.state.clone())
            };
            let mut out = BytesMut::new();
            match state {
                RequestState::Finished(finish) => {
                    let last = finish.output_tokens.max(self.sent);
                    let reason = Some(finish_reason(&self.reply));
                    let text = self.sent_text..self.reply.text_upto(last).len();
                    let mut written = self.meta.write_chunk(
                        &mut out,
                        &self.reply,
                        (self.sent, last),
                        text,
                        reason,
                    );
                    if written.is_ok() && self.meta.include_usage {
                        written = self.meta.write_usage_chunk(&mut out, &finish);
                    }
                    if let Err(e) = written {
                        return self
                            .fail(ApiError::internal(format!("could not write a chunk: {e}")));
                    }
                    sse::write_done(&mut out);
                    return self.end(out);
                }
                RequestState::Cancelled | RequestState::Rejected(_) => {
                    return self.fail(ApiError::service_unavailable(
                        "the request was cancelled: the engine is shutting down",
                    ));
                }
                RequestState::Submitted | RequestState::Accepted => {
                    if produced > self.sent {
                        let upto = self.reply.text_upto(produced);
                        let end = match &mut self.hold {
                            None => upto.len(),
                            Some(hold) => floor_char_boundary(upto, hold.sendable(upto)),
                        };
                        // All the new text held back: its tokens go with the next chunk.
                        if self.hold.is_none() || end > self.sent_text {
                            let written = self.meta.write_chunk(
                                &mut out,
                                &self.reply,
                                (self.sent, produced),
                                self.sent_text..end,
                                None,
                            );
                            if let Err(e) = written {
                                return self.fail(ApiError::internal(format!(
                                    "could not write a chunk: {e}"
                                )));
                            }
                            self.sent = produced;
                            self.sent_text = end;
                            return Some((Ok(out.freeze()), self));
                        }
                    }
                }
            }
            if self.progress.changed().await.is_err() {
                return self.fail(ApiError::service_unavailable("the engine stopped"));
            }
        }
    }

    /// Ends the stream with `error`.
    fn fail(self, error: ApiError) -> Option<Item> {
        let mut out = BytesMut::new();
        sse::write_error_and_done(&mut out, &error);
        self.end(out)
    }

    /// The stream's last bytes: the request is over, there is nothing left to cancel.
    fn end(mut self, out: BytesMut) -> Option<Item> {
        self.guard.armed = false;
        self.phase = Phase::Done;
        Some((Ok(out.freeze()), self))
    }
}

/// `at`, or the character boundary before it.
fn floor_char_boundary(text: &str, mut at: usize) -> usize {
    at = at.min(text.len());
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    at
}

async fn models(State(state): State<Arc<AppState>>) -> Response {
    let mut model = Model::new(state.info.model.clone(), "kvroute", state.started);
    model.max_model_len = state.info.max_model_len;
    json_response(200, &ModelList::new(vec![model]))
}

/// 200 while the engine serves. With NATS, its state too: a lost connection or a server
/// that refuses this worker's publishes (its KV events and announcements reach no gateway,
/// which then routes to it blind) does not stop it serving, so it stays a 200 and says so.
async fn health(State(state): State<Arc<AppState>>) -> Response {
    if state.commands.is_closed() {
        return ApiError::service_unavailable("the engine stopped").into_response();
    }
    match &state.nats {
        Some(nats) => json_response(
            200,
            &serde_json::json!({"status": "ok", "nats": nats.health()}),
        ),
        None => json_response(200, &serde_json::json!({"status": "ok"})),
    }
}

async fn info(State(state): State<Arc<AppState>>) -> Response {
    json_response(200, &state.info)
}

/// How long `GET /kv_state` waits for the publisher, which answers between batches.
const KV_STATE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// `GET /kv_state`: the whole cache the ZMQ event stream implies, and the batch it covers up
/// to ([`protocol::ZmqKvState`], msgpack), for a gateway that subscribed late or lost
/// batches the replay buffer no longer holds.
async fn kv_state(State(state): State<Arc<AppState>>) -> Response {
    let Some(requests) = &state.zmq_state else {
        return ApiError::not_found(
            "this engine publishes no ZMQ KV events (--zmq-pub off), so it keeps no cache \
             snapshot to go with them",
        )
        .into_response();
    };
    let (answer, answered) = tokio::sync::oneshot::channel();
    if requests.try_send(answer).is_err() {
        return ApiError::service_unavailable("too many cache snapshots asked at once; retry")
            .into_response();
    }
    match tokio::time::timeout(KV_STATE_TIMEOUT, answered).await {
        Ok(Ok(Ok(body))) => (
            [(axum::http::header::CONTENT_TYPE, "application/msgpack")],
            body,
        )
            .into_response(),
        Ok(Ok(Err(why))) => ApiError::service_unavailable(why).into_response(),
        Ok(Err(_)) => ApiError::service_unavailable("the KV publisher stopped").into_response(),
        Err(_) => ApiError::service_unavailable(format!(
            "the KV publisher did not answer within {KV_STATE_TIMEOUT:?}"
        ))
        .into_response(),
    }
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
        let request: TokenizeRequest =
            read_json_within(&headers, body, state.body_limit, state.body_timeout).await?;
        if let Some(model) = &request.model {
            check_model(&state.info.model, model)?;
        }
        let tokens = match (request.prompt, request.messages) {
            (Some(prompt), None) => state.assets.encode(&prompt),
            (None, Some(messages)) => {
                chat_prompt(&state, &messages, text::ChatEnding::GenerationPrompt)?
            }
            _ => {
                return Err(ApiError::invalid_request(
                    "give exactly one of `prompt` or `messages`",
                ));
            }
        };
        Ok(json_response(
            200,
            &serde_json::json!({
                "count": tokens.len(),
                "max_model_len": state.info.max_model_len,
                "tokens": tokens,
            }),
        ))
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
