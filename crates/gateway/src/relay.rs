//! The streaming relay: a worker's `/v1/completions` SSE stream in, the client's chat or
//! completion stream (or one aggregated response) out.
//!
//! Cost per upstream event: one incremental SSE decode (`protocol::SseDecoder`, handing the
//! event out as a slice of its buffer), one JSON parse that borrows the text from the event
//! (`protocol::ResponseView`), one JSON write (`protocol::ResponseHead`) into a buffer that
//! collects everything decoded from the same network read, so the client gets one body frame
//! per upstream read, not per token.
//!
//! Deadlines: one timer per relay, reset before each upstream read (no allocation per read),
//! ends a stream whose worker goes silent for longer than the stall timeout; a non-streamed
//! reply is gathered up to a byte cap.
//!
//! Migration: when the worker's stream breaks or stalls, the request's
//! [`router::MigrationState`] (the core's decision, the simulator's too) says whether to resend
//! it, with the output so far appended to its prompt and `max_tokens` reduced by it; a
//! [`Migration`] resends it to another worker, and the relay goes on with that worker's
//! stream: the client's stream keeps its `id`, `created` and `model`, the role is not sent
//! twice, and the usage counts both workers' tokens. Only what a resend needs is kept (the
//! text and token ids so far of each choice), up to the response byte cap over all choices.
//! With several choices (`n` > 1), each choice that has not finished is resent on its own
//! (`n` = 1), one after the other on the same client stream: each continuation's chunks are
//! labelled with its choice's index, and the next choice is resent when the continuation
//! before it ends ([`router::MigrationState::next_continuation`]).
//!
//! Whatever ends a request — `[DONE]`, a broken worker stream, the client going away (the
//! body stream is dropped, which drops the upstream response and so cancels the worker's
//! request) — releases its [`Ticket`] and records its metrics exactly once
//! ([`RequestRecord`]'s `Drop`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use futures::StreamExt;
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use protocol::sse::{self, SseDecoder, SseEvent};
use protocol::{Api, ApiError, ChoiceOut, ChoiceView, ResponseHead, ResponseView, TokenIds, Usage};
use router::{
    ChoiceOutput, ChunkIds, Continuation, Decision, FailureReason, MigrationState, NotMigrated,
    TokenUsage,
};

use crate::dispatch::Ticket;
use crate::metrics::{Endpoint, Metrics, PoolLabel, Reuse};

/// The metrics label of the API the client called.
pub fn endpoint(api: Api) -> Endpoint {
    match api {
        Api::Chat => Endpoint::ChatCompletions,
        Api::Completion => Endpoint::Completions,
    }
}

/// Most choices (`n`) aggregated for a non-streaming response.
pub const MAX_CHOICES: usize = 128;

/// Initial capacity of each client body frame.
const FRAME_CAPACITY: usize = 512;

/// Longest upstream SSE event accepted.
pub const MAX_EVENT_BYTES: usize = 1 << 20;

/// An upstream body: its first read (made before the relay, to retry a silent worker), when
/// that read returned, and the rest.
pub type Upstream = (
    Option<Bytes>,
    Instant,
    BoxStream<'static, reqwest::Result<Bytes>>,
);

/// Resends a request whose worker failed mid-stream to another worker.
pub trait Resend: Send {
    /// The core's decision for the request ([`MigrationState::decide`]), with its prompt,
    /// `max_tokens` and tokenizer.
    fn decide(&self, state: &mut MigrationState, reason: FailureReason) -> Decision;

    /// The next choice left by a failed worker, once the continuation before it ended
    /// ([`MigrationState::next_continuation`]).
    fn next(&self, state: &mut MigrationState) -> Option<Continuation>;

    /// Sends `continuation`, routed again; answers the new worker's ticket and stream.
    fn resend(
        &mut self,
        continuation: Continuation,
    ) -> BoxFuture<'_, Result<(Ticket, Upstream), ApiError>>;
}

/// A relay's migrations: how to resend, and the request's migration state (attempts left,
/// output so far).
pub struct Migration {
    pub resend: Box<dyn Resend>,
    pub state: MigrationState,
}

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
    /// The router's view at routing: (available, predicted) prefix tokens ([`Reuse`]).
    pub routed_reuse: Option<(u64, u64)>,
    /// `cached_tokens` came from the worker (not the router's estimate).
    pub cached_reported: bool,
    pub success: bool,
    /// The gateway's own time before forwarding (queue waits excluded), once forwarded.
    pub pre_forward: Option<Duration>,
    /// The pools that prefilled and decoded it (the `pool` of its TTFT and ITL).
    pub pools: (PoolLabel, PoolLabel),
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
            routed_reuse: None,
            cached_reported: false,
            success: false,
            pre_forward: None,
            pools: (PoolLabel::Aggregated, PoolLabel::Aggregated),
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
                    .get(self.pools.0)
                    .observe(now.duration_since(self.started).as_secs_f64());
                // The other tokens of a first chunk came with no gap.
                self.metrics.itl.get(self.pools.1).observe_n(0.0, n - 1);
                true
            }
            Some(last) => {
                let gap = now.duration_since(last).as_secs_f64() / n as f64;
                self.metrics.itl.get(self.pools.1).observe_n(gap, n);
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
            // Only requests whose worker reported what it reused: guessing it would hide
            // the stale index the counters are there to show.
            if let (true, true, Some((available, predicted)), Some(reused)) = (
                self.success,
                self.cached_reported,
                self.routed_reuse,
                self.cached_tokens,
            ) {
                m.count_reuse(Reuse {
                    prompt,
                    available,
                    predicted,
                    reused: reused.min(prompt),
                });
            }
        }
    }
}

/// Per-request constants of the output.
#[derive(Debug, Clone)]
pub struct OutputCtx {
    /// The API, id, model and creation time every chunk repeats.
    pub head: ResponseHead,
    pub include_usage: bool,
    /// The client asked for `return_token_ids`.
    pub return_token_ids: bool,
    pub prompt_tokens: u32,
    /// The router's estimate, used when the worker does not report `cached_tokens`.
    pub predicted_cached_tokens: u32,
}

/// Tokens a worker's choice carries: the length of `token_ids` when the worker sends them,
/// else one per chunk with text (or without a finish reason).
fn choice_tokens(choice: &ChoiceView<'_>) -> u64 {
    choice.token_id_count().unwrap_or_else(|| {
        u64::from(!choice.content().is_empty() || choice.finish_reason.is_none())
    })
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
    /// The worker reported an error in its stream, or the relay could not write its output.
    Error(ApiError),
    /// The worker's stream broke (connection lost, garbage): the worker is taken out of the
    /// routing set.
    Broken(ApiError),
}

/// Deadlines and caps of one relay.
#[derive(Debug, Clone, Copy)]
pub struct RelayLimits {
    /// Longest silence between two upstream reads (while the worker is silent on every
    /// request: a busy one is waited for, [`crate::dispatch::Ticket::judge_deadline`]).
    pub stall: Duration,
    /// How often a stream past its stall deadline on a busy worker is judged again.
    pub recheck: Duration,
    /// Most text bytes gathered for a non-streamed reply.
    pub max_response_bytes: usize,
}

/// One request's relay: the worker's stream, its decoder, and what is made of it.
pub struct Relay {
    body: BoxStream<'static, reqwest::Result<Bytes>>,
    /// The first upstream read, made before the relay started (to retry a silent worker).
    first: Option<Bytes>,
    resend: Option<Box<dyn Resend>>,
    /// Reset before each read: the stream's only timer.
    stall: std::pin::Pin<Box<tokio::time::Sleep>>,
    stall_after: Duration,
    recheck: Duration,
    /// Apart from [`Output`] so that an event borrowed from it can be handled.
    decoder: SseDecoder,
    output: Output,
}

/// Everything of a relay but its input.
struct Output {
    ctx: OutputCtx,
    stream: bool,
    ticket: Option<Ticket>,
    record: RequestRecord,
    out: BytesMut,
    role_sent: bool,
    usage: Option<Usage>,
    aggregate: Aggregate,
    /// Text bytes in `aggregate`, against `max_response_bytes`.
    aggregate_bytes: usize,
    max_response_bytes: usize,
    ending: Option<Ending>,
    finished: bool,
    /// When the latest upstream read returned.
    last_read: Option<Instant>,
    /// When the read holding the first token returned, until its frame goes out.
    first_token_read: Option<Instant>,
    /// The output so far and the migrations left (the core's state).
    migration: MigrationState,
    /// The client's choice the current worker continues (its chunks' index 0), for a
    /// request with several choices after a migration.
    relabel: Option<u32>,
}

impl Relay {
    /// A relay of `body`, whose `first` read (if any) was already made at `first_read`; with
    /// a `migration`, a failed worker's stream is continued by another.
    pub fn new(
        ctx: OutputCtx,
        stream: bool,
        (first, first_read, body): Upstream,
        (ticket, migration): (Ticket, Option<Migration>),
        record: RequestRecord,
        limits: RelayLimits,
    ) -> Relay {
        let (resend, state) = match migration {
            Some(m) => (Some(m.resend), m.state),
            None => (None, MigrationState::new(0, 1, 0)),
        };
        Relay {
            body,
            first,
            resend,
            stall: Box::pin(tokio::time::sleep(limits.stall)),
            stall_after: limits.stall,
            recheck: limits.recheck,
            decoder: SseDecoder::new(MAX_EVENT_BYTES),
            output: Output {
                ctx,
                stream,
                ticket: Some(ticket),
                record,
                out: BytesMut::with_capacity(FRAME_CAPACITY),
                role_sent: false,
                usage: None,
                aggregate: Aggregate::default(),
                aggregate_bytes: 0,
                max_response_bytes: limits.max_response_bytes,
                ending: None,
                finished: false,
                last_read: Some(first_read),
                first_token_read: None,
                migration: state,
                relabel: None,
            },
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
        match self.output.ending.take() {
            Some(Ending::Done) | None => self.output.response_json(),
            Some(Ending::Error(e)) | Some(Ending::Broken(e)) => Err(e),
        }
    }

    /// Resends the request to another worker after its worker broke or stalled, if the core
    /// says it may be ([`MigrationState::decide`]: attempts left, a choice that has not
    /// ended, output within the cap, tokens left), or, after a continuation ended, the next
    /// choice its failed worker left. On success the relay reads the new worker's stream from
    /// now on.
    async fn migrate(&mut self) -> bool {
        let reason = match &self.output.ending {
            Some(Ending::Broken(e)) if e.status == 504 => Some(FailureReason::WorkerTimeout),
            Some(Ending::Broken(_)) => Some(FailureReason::WorkerFailed),
            // A continuation ended: another choice of the failed worker may be left.
            Some(Ending::Done) if self.output.migration.has_pending() => None,
            _ => return false,
        };
        let Some(resend) = &mut self.resend else {
            return false;
        };
        // What the current worker generated, before the core counts it as earlier.
        let served = (self.output.record.output_tokens)
            .saturating_sub(self.output.migration.earlier_tokens());
        let continuation = match reason {
            Some(reason) => match resend.decide(&mut self.output.migration, reason) {
                Decision::Migrate(continuation) => continuation,
                Decision::End { why, .. } => {
                    if why != NotMigrated::Off {
                        tracing::info!(
                            ?why,
                            reason = reason.as_str(),
                            "request not migrated; it ends with its worker's error"
                        );
                    }
                    return false;
                }
            },
            None => match resend.next(&mut self.output.migration) {
                Some(continuation) => continuation,
                None => return false,
            },
        };
        let from = self.output.ticket.as_ref().map(|t| t.worker.id);
        let tokens = continuation.generated;
        let choice = continuation.index;
        let several = self.output.migration.choices() > 1;
        // The earlier worker's slot is released before routing again; one that finished its
        // continuation served it.
        if let (None, Some(ticket)) = (reason, &mut self.output.ticket) {
            ticket.served(served);
        }
        self.output.ticket = None;
        match resend.resend(continuation).await {
            Ok((ticket, (first, first_read, body))) => {
                match reason {
                    Some(reason) => {
                        let reason = reason.as_str();
                        tracing::info!(?from, to = %ticket.worker.id, choice, tokens, reason, "request migrated to another worker");
                        self.output.record.metrics.count_migration(reason);
                    }
                    None => {
                        tracing::info!(?from, to = %ticket.worker.id, choice, tokens, "next choice of a migrated request resent");
                    }
                }
                self.output.relabel = several.then_some(choice);
                self.output.ticket = Some(ticket);
                self.output.ending = None;
                self.output.usage = None;
                self.output.last_read = Some(first_read);
                self.first = first;
                self.body = body;
                self.decoder = SseDecoder::new(MAX_EVENT_BYTES);
                true
            }
            Err(e) => {
                tracing::warn!(?from, choice, error = %e.detail.message, "could not migrate the request; it ends with an error");
                if reason.is_none() {
                    // The stream ended well, but a choice is left: the request fails.
                    self.output.ending = Some(Ending::Error(e));
                }
                false
            }
        }
    }

    async fn next_output(&mut self) -> Option<Bytes> {
        // How long the next read may take: the stall timeout, or, past it on a busy worker,
        // until it is judged again.
        let mut wait = self.stall_after;
        loop {
            while self.output.ending.is_none() {
                match self.decoder.next_event() {
                    Some(SseEvent::Data(data)) => self.output.handle(data),
                    Some(SseEvent::Done) => self.output.ending = Some(Ending::Done),
                    None => break,
                }
            }
            if self.output.ending.is_some() && !self.output.finished {
                // What came before the failure goes out before any resend is waited for.
                if !self.output.out.is_empty() {
                    return Some(self.output.take_frame());
                }
                if self.migrate().await {
                    wait = self.stall_after;
                    continue;
                }
                self.output.finish();
            }
            let output = &mut self.output;
            if !output.out.is_empty() {
                return Some(output.take_frame());
            }
            if output.finished {
                return None;
            }
            // The first read was timed when it was made (`last_read`).
            let (read, timed) = match self.first.take() {
                Some(bytes) => (Some(Ok(bytes)), true),
                None => {
                    let deadline = tokio::time::Instant::now() + wait;
                    self.stall.as_mut().reset(deadline);
                    tokio::select! {
                        biased;
                        read = self.body.next() => {
                            wait = self.stall_after;
                            (read, false)
                        }
                        () = self.stall.as_mut() => {
                            let busy = output
                                .ticket
                                .as_ref()
                                .and_then(|t| t.judge_deadline(self.stall_after, self.recheck));
                            match busy {
                                Some(more) => wait = more,
                                None => output.stalled(self.stall_after),
                            }
                            continue;
                        }
                    }
                }
            };
            match read {
                Some(Ok(bytes)) => {
                    if let Some(ticket) = &output.ticket {
                        ticket.output_seen();
                    }
                    // Only the read that brings the first token is timed.
                    if output.record.first_token.is_none() && !timed {
                        output.last_read = Some(Instant::now());
                    }
                    if let Err(e) = self.decoder.push(&bytes) {
                        output.break_worker(format!("the worker's stream is not valid SSE: {e}"));
                    }
                }
                Some(Err(e)) => {
                    output.break_worker(format!("the worker's stream broke: {e}"));
                }
                None => {
                    output.break_worker("the worker closed its stream before [DONE]".to_string());
                }
            }
        }
    }
}

impl Output {
    /// The frame written so far, timing the first token's on the way out.
    fn take_frame(&mut self) -> Bytes {
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
        frame
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

    /// The worker went silent mid-stream: the request ends with an error and the worker is
    /// ejected until it passes a health check (it may be stopped or wedged).
    fn stalled(&mut self, after: Duration) {
        let worker = self.ticket.as_ref().map(|t| t.worker.id);
        tracing::warn!(?worker, ?after, "worker stream stalled; worker ejected");
        if let Some(ticket) = &self.ticket {
            ticket.worker_failed();
        }
        self.record.metrics.worker_timeouts.inc();
        self.ending = Some(Ending::Broken(ApiError::new(
            504,
            protocol::error::kind::SERVER,
            format!(
                "the worker sent nothing for {:.1} s mid-stream (stall timeout); the worker \
                 is ejected until it answers its health check",
                after.as_secs_f64()
            ),
            None,
            Some("worker_timeout"),
        )));
    }

    /// Ends the request with an error of our own (a chunk that could not be written).
    fn fail(&mut self, e: serde_json::Error) {
        tracing::error!(error = %e, "could not write a chunk");
        self.ending = Some(Ending::Error(ApiError::internal(format!(
            "the gateway could not write a chunk: {e}"
        ))));
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
                        let written = self.ctx.head.write_chunk(
                            &mut self.out,
                            std::iter::empty(),
                            Some(&usage),
                        );
                        if let Err(e) = written {
                            tracing::error!(error = %e, "could not write the usage chunk");
                        }
                    }
                    sse::write_done(&mut self.out);
                }
            }
            Some(Ending::Error(e)) | Some(Ending::Broken(e)) if self.stream => {
                sse::write_error_and_done(&mut self.out, e);
            }
            Some(Ending::Error(_)) | Some(Ending::Broken(_)) | None => {}
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
        self.record.cached_reported = self
            .usage
            .is_some_and(|u| u.prompt_tokens_details.is_some());
        let usage = self.final_usage();
        self.record.cached_tokens = usage
            .prompt_tokens_details
            .map(|d| u64::from(d.cached_tokens));
        if self.record.success
            && let Some(ticket) = &mut self.ticket
        {
            ticket.served(self.record.output_tokens);
        }
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

    /// Handles one upstream event's data (a chunk of the worker's `/v1/completions` stream).
    fn handle(&mut self, data: &str) {
        let mut chunk: ResponseView<'_> = match serde_json::from_str(data) {
            Ok(chunk) => chunk,
            Err(e) => {
                self.break_worker(format!("the worker sent a chunk that is not JSON: {e}"));
                return;
            }
        };
        if let Some(error) = chunk.error {
            self.ending = Some(Ending::Error(ApiError {
                status: 502,
                detail: error,
            }));
            return;
        }
        if let Some(usage) = chunk.usage {
            self.usage = Some(self.with_earlier_workers(usage));
        }
        if chunk.choices.is_empty() {
            return;
        }
        if let Some(index) = self.relabel {
            // A continuation of one choice: its worker's choice 0 is the client's `index`.
            for c in &mut chunk.choices {
                c.index = index;
            }
        }
        let tokens = chunk.choices.iter().map(choice_tokens).sum();
        if self.record.tokens(tokens, Instant::now()) {
            self.first_token_read = self.last_read;
        }
        if tokens > 0 {
            // This worker's first token (after a migration, not the request's).
            if let Some(ticket) = &mut self.ticket {
                ticket.first_token();
            }
        }
        if self.migration.is_kept() {
            self.track(&chunk.choices);
        }
        if self.stream {
            let role = (self.ctx.head.api == Api::Chat && !self.role_sent).then_some("assistant");
            self.role_sent = true;
            let token_ids = self.ctx.return_token_ids;
            let choices = chunk.choices.iter().map(|c| {
                let text = c.content();
                ChoiceOut {
                    index: c.index,
                    role,
                    // A chat delta with only a finish reason has no content.
                    content: (!text.is_empty() || c.finish_reason.is_none()).then_some(text),
                    logprobs: c.logprobs,
                    finish_reason: c.finish_reason.as_deref(),
                    token_ids: c.token_ids.filter(|_| token_ids).map(TokenIds::Raw),
                }
            });
            if let Err(e) = self.ctx.head.write_chunk(&mut self.out, choices, None) {
                self.fail(e);
            }
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
                let text = c.content();
                self.aggregate_bytes += text.len();
                if self.aggregate_bytes > self.max_response_bytes {
                    let limit = self.max_response_bytes;
                    tracing::warn!(limit, "a worker's non-streamed reply is over the cap");
                    self.ending = Some(Ending::Error(ApiError::new(
                        502,
                        protocol::error::kind::SERVER,
                        format!(
                            "the worker's reply is over the gateway's limit of {limit} bytes \
                             (--max-response-bytes); ask for fewer tokens or stream it"
                        ),
                        None,
                        Some("response_too_large"),
                    )));
                    return;
                }
                self.aggregate.texts[i].push_str(text);
                if let Some(f) = &c.finish_reason {
                    self.aggregate.finish[i] = Some(f.to_string());
                }
            }
        }
    }

    /// Hands the core what a resend needs of each choice (its text, ids and tokens); the
    /// core stops keeping it at a choice past `n` or past the response cap.
    fn track(&mut self, choices: &[ChoiceView<'_>]) {
        for c in choices {
            let parsed = c
                .token_ids
                .map(|raw| serde_json::from_str::<Vec<u32>>(raw.get()));
            let ids = match &parsed {
                Some(Ok(ids)) => ChunkIds::Ids(ids),
                Some(Err(_)) => ChunkIds::Unreadable,
                None => ChunkIds::Missing,
            };
            self.migration.on_choice(ChoiceOutput {
                index: c.index,
                text: c.content(),
                ids,
                tokens: choice_tokens(c),
                finished: c.finish_reason.is_some(),
            });
        }
    }

    /// A worker's usage after a migration, for the whole request: the client's prompt, and
    /// the earlier workers' tokens added to this one's (the core's accounting).
    fn with_earlier_workers(&self, usage: Usage) -> Usage {
        if self.migration.earlier_tokens() == 0 {
            return usage;
        }
        let whole = self.migration.request_usage(
            self.ctx.prompt_tokens,
            TokenUsage {
                prompt_tokens: usage.prompt_tokens,
                completion_tokens: usage.completion_tokens,
                cached_tokens: usage.prompt_tokens_details.map(|d| d.cached_tokens),
            },
        );
        Usage {
            prompt_tokens: whole.prompt_tokens,
            completion_tokens: whole.completion_tokens,
            total_tokens: whole.total_tokens(),
            prompt_tokens_details: whole
                .cached_tokens
                .map(|cached_tokens| protocol::PromptTokensDetails { cached_tokens }),
        }
    }

    /// The whole response of the aggregating mode.
    fn response_json(&self) -> Result<Vec<u8>, ApiError> {
        let choices = self
            .aggregate
            .texts
            .iter()
            .zip(&self.aggregate.finish)
            .zip(0u32..)
            .map(|((text, finish), index)| ChoiceOut {
                index,
                content: Some(text),
                finish_reason: finish.as_deref(),
                ..ChoiceOut::default()
            });
        self.ctx
            .head
            .response_json(choices, Some(&self.final_usage()))
            .map_err(|e| {
                ApiError::internal(format!("the gateway could not write the response: {e}"))
            })
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
