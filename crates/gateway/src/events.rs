//! KV event ingestion: in-process, NATS (our msgpack format) and ZMQ SUB (vLLM's format,
//! which SGLang's publisher shares: `protocol::vllm` reads both).
//!
//! NATS and ZMQ batches go through the dispatcher's `kv_index::StreamSync`, one per source
//! ([`Dispatcher::stream_events`] and its siblings), which applies them under the core lock,
//! turns a sequence gap into a clear of that worker's blocks plus a counted resync, and says
//! when to ask the worker for its cache snapshot. Transport-level losses get the same
//! treatment: a vLLM batch-number gap or restart ([`protocol::vllm::Continuity`]), a frame
//! that cannot be converted, or a batch from a new worker `instance` (a restart: empty cache,
//! sequence numbers from 0). The in-process sink loses nothing and has no snapshot to ask
//! for: it applies with the index's gap policy alone ([`Dispatcher::apply_events`]).
//!
//! A ZMQ publisher with a replay socket (vLLM's and SGLang's `replay_endpoint`; `kvroute
//! engine --zmq-replay`) is asked to fill a gap before anything is cleared: a DEALER requests
//! the batches from the first missing one, they are applied in order, and only a replay that
//! fails, times out (`REPLAY_TIMEOUT`) or no longer reaches back falls back to the clear.
//! A subscriber that joins late (its first batch is not the publisher's first) replays the
//! publisher's buffer too, so a gateway restart does not start from a cold view. Over NATS a
//! kvroute engine answers the same need with its whole cache: the first announcement or batch
//! this gateway hears from a worker, and a gap that cleared its blocks, ask it for a snapshot
//! (`protocol::kv_state`), and its batches wait until the snapshot is applied
//! (`NatsStreams`). Replays that filled their gap and snapshots applied are counted
//! (`kvroute_worker_kv_replays_total`), resyncs as before.
//!
//! Bad input is counted in the metrics (`decode_errors`, `resyncs`) frame by frame, but logged
//! sparingly (`WarnBudget`): a flood of garbage frames writes a few lines and a periodic
//! summary, not a line per frame. A stored event over `protocol::kv_events::MAX_STORED_BLOCKS`
//! blocks or `MAX_STORED_TOKENS` tokens is refused like any other bad frame.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use kv_index::{KvEvent, WorkerId};
use protocol::vllm::{
    Continuity, ReplayReply, VllmEventStream, decode_multipart, decode_replay_reply,
    encode_replay_request,
};
use protocol::{KvEventBatch, Subjects};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::dispatch::Dispatcher;
use crate::metrics::EventSource;

/// Feeds KV events from inside the process (the demo's simulated engines) into the router.
///
/// Cheap to clone. Events must come in each worker's sequence order, as from any source.
#[derive(Debug, Clone)]
pub struct KvEventSink {
    dispatcher: Arc<Dispatcher>,
}

impl KvEventSink {
    pub(crate) fn new(dispatcher: Arc<Dispatcher>) -> KvEventSink {
        KvEventSink { dispatcher }
    }

    /// Applies `events` now (a short critical section, no waiting).
    pub fn publish(&self, events: &[KvEvent]) {
        // In process nothing is lost: no gap to fill.
        self.dispatcher.apply_events(EventSource::InProcess, events);
    }
}

/// Warnings about one source's bad input: the first [`WarnBudget::PER_WINDOW`] of each
/// [`WarnBudget::WINDOW`] are logged, the rest counted and summed up in one line when the
/// window has passed.
#[derive(Debug)]
pub(crate) struct WarnBudget {
    window_start: Instant,
    logged: u32,
    suppressed: u64,
}

impl WarnBudget {
    pub(crate) const PER_WINDOW: u32 = 5;
    pub(crate) const WINDOW: Duration = Duration::from_secs(10);

    pub(crate) fn new() -> WarnBudget {
        WarnBudget {
            window_start: Instant::now(),
            logged: 0,
            suppressed: 0,
        }
    }

    /// Ends the window if it has passed, logging what it suppressed.
    fn roll(&mut self, now: Instant, source: impl std::fmt::Debug) {
        if now.duration_since(self.window_start) < Self::WINDOW {
            return;
        }
        if self.suppressed > 0 {
            tracing::warn!(
                ?source,
                suppressed = self.suppressed,
                window_s = Self::WINDOW.as_secs(),
                "more bad messages were not logged (see the gateway's metrics)"
            );
        }
        self.window_start = now;
        self.logged = 0;
        self.suppressed = 0;
    }

    /// Whether to log one more bad message now.
    pub(crate) fn allow(&mut self, source: impl std::fmt::Debug) -> bool {
        self.roll(Instant::now(), source);
        if self.logged < Self::PER_WINDOW {
            self.logged += 1;
            true
        } else {
            self.suppressed += 1;
            false
        }
    }

    /// Called for good messages too, so a flood's summary is written once it ends.
    pub(crate) fn tick(&mut self, source: impl std::fmt::Debug) {
        if self.suppressed > 0 {
            self.roll(Instant::now(), source);
        }
    }
}

/// How long the gateway waits for a worker's cache snapshot (its first batches are held
/// meanwhile) before it applies them and learns that worker's cache from new events only.
pub(crate) const STATE_TIMEOUT: Duration = Duration::from_secs(2);

/// Snapshots fetched at once: a gateway (re)starting before a thousand engines asks them all
/// within a heartbeat, and each answer is up to a few MiB until applied.
const MAX_CONCURRENT_FETCHES: usize = 16;

/// A worker's snapshot as fetched: the cache, or why there is none.
type FetchedState = (WorkerId, Result<protocol::KvState, String>);

/// The NATS event consumer: decodes, fetches the snapshots the dispatcher's
/// [`kv_index::StreamSync`] asks for, and hands everything to it.
struct NatsStreams {
    client: async_nats::Client,
    subjects: Subjects,
    dispatcher: Arc<Dispatcher>,
    fetched: tokio::sync::mpsc::Sender<FetchedState>,
    /// [`MAX_CONCURRENT_FETCHES`] permits.
    fetching: Arc<tokio::sync::Semaphore>,
    warnings: WarnBudget,
}

impl NatsStreams {
    /// Asks `worker` for its snapshot; the answer comes back through `fetched`.
    fn ask(&self, worker: WorkerId) {
        let (client, subject) = (self.client.clone(), self.subjects.kv_state(worker));
        let (fetched, fetching) = (self.fetched.clone(), self.fetching.clone());
        tokio::spawn(async move {
            // Held until the answer is handed to the loop: with the channel's capacity, it
            // bounds the answers in memory, not just the requests in flight.
            let Ok(_permit) = fetching.acquire_owned().await else {
                return;
            };
            let state = fetch_kv_state(&client, subject, worker).await;
            // The loop may have ended; nothing to do then.
            let _ = fetched.send((worker, state)).await;
        });
    }

    /// Announcements (and their heartbeats) name workers before they publish anything: an
    /// idle engine's cache is learnt at once, not when its next event comes.
    fn on_announcement(&mut self, payload: &[u8]) {
        match protocol::WorkerMessage::decode(payload) {
            // Asked once per worker: heartbeats repeat the announcement.
            Ok(m @ protocol::WorkerMessage::Announce(_))
                if self.dispatcher.stream_heard(EventSource::Nats, m.worker()) =>
            {
                self.ask(m.worker());
            }
            // Back later, it is asked again.
            Ok(m @ protocol::WorkerMessage::Goodbye { .. }) => {
                self.dispatcher.stream_forget(EventSource::Nats, m.worker());
            }
            _ => {}
        }
    }

    /// A snapshot came (or will not).
    fn on_fetched(&mut self, (worker, state): FetchedState) {
        if let Err(why) = &state {
            tracing::info!(%worker, %why, "no cache snapshot from the worker; its blocks are learnt from its new events");
        }
        if self
            .dispatcher
            .stream_snapshot(EventSource::Nats, worker, state.as_ref().ok())
        {
            self.ask(worker);
        }
    }

    /// A decoded batch from `worker`.
    fn on_batch(&mut self, worker: WorkerId, batch: KvEventBatch) {
        let source = EventSource::Nats;
        match batch.to_kv_events() {
            Ok(events) => {
                if self
                    .dispatcher
                    .stream_events(source, worker, batch.instance, &events)
                {
                    self.ask(worker);
                }
            }
            Err(e) => {
                if self.warnings.allow(source) {
                    tracing::warn!(%worker, error = %e, "bad KV event batch; clearing the worker's blocks");
                }
                self.dispatcher.count_decode_error(source);
                self.on_bad_batch(worker);
            }
        }
    }

    /// A batch that cannot be used: the worker's blocks cannot be vouched for any more.
    fn on_bad_batch(&mut self, worker: WorkerId) {
        if self.dispatcher.stream_lost(EventSource::Nats, worker) {
            self.ask(worker);
        }
    }
}

/// Consumes `kvroute.<ns>.kv.*` until cancelled.
///
/// The first word from each worker (its announcement or first batch: this gateway may have
/// started long after the worker cached its blocks), and any gap in its stream, asks the
/// worker for its whole cache (`protocol::kv_state`); that worker's batches are held until the
/// snapshot is applied or [`STATE_TIMEOUT`] passes ([`kv_index::StreamSync`] decides, in the
/// dispatcher).
pub(crate) async fn run_nats_events(
    client: async_nats::Client,
    subjects: Subjects,
    dispatcher: Arc<Dispatcher>,
    cancel: CancellationToken,
) {
    let mut subscriber = match client.subscribe(subjects.kv_events_all()).await {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "cannot subscribe to KV events over NATS");
            return;
        }
    };
    let mut announcements = match client.subscribe(subjects.workers()).await {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::warn!(error = %e, "cannot hear worker announcements for cache snapshots; each worker's snapshot is asked for at its first KV event");
            None
        }
    };
    let source = EventSource::Nats;
    let (fetched, mut snapshots) = tokio::sync::mpsc::channel(MAX_CONCURRENT_FETCHES);
    let mut state = NatsStreams {
        client,
        subjects,
        dispatcher,
        fetched,
        fetching: Arc::new(tokio::sync::Semaphore::new(MAX_CONCURRENT_FETCHES)),
        warnings: WarnBudget::new(),
    };
    loop {
        let message = tokio::select! {
            _ = cancel.cancelled() => break,
            Some(announcement) = next_message(&mut announcements) => {
                state.on_announcement(&announcement.payload);
                continue;
            }
            Some(snapshot) = snapshots.recv() => {
                state.on_fetched(snapshot);
                continue;
            }
            m = subscriber.next() => match m { Some(m) => m, None => break },
        };
        state.warnings.tick(source);
        let Some(worker) = state.subjects.parse_kv_events(message.subject.as_str()) else {
            state.dispatcher.count_decode_error(source);
            continue;
        };
        match KvEventBatch::decode(&message.payload) {
            Ok(batch) if batch.worker == worker.0 => state.on_batch(worker, batch),
            Ok(batch) => {
                if state.warnings.allow(source) {
                    tracing::warn!(%worker, batch_worker = batch.worker, "KV batch names another worker than its subject; dropped");
                }
                state.dispatcher.count_decode_error(source);
            }
            Err(e) => {
                if state.warnings.allow(source) {
                    tracing::warn!(%worker, error = %e, "undecodable KV event batch; clearing the worker's blocks");
                }
                state.dispatcher.count_decode_error(source);
                state.on_bad_batch(worker);
            }
        }
    }
}

/// The next message of an optional subscription; never when there is none (or it ended).
async fn next_message(
    subscription: &mut Option<async_nats::Subscriber>,
) -> Option<async_nats::Message> {
    match subscription {
        Some(s) => match s.next().await {
            Some(m) => Some(m),
            None => {
                *subscription = None;
                std::future::pending().await
            }
        },
        None => std::future::pending().await,
    }
}

/// Asks `worker` for its whole cache on `subject` and gathers the parts, within
/// [`STATE_TIMEOUT`].
async fn fetch_kv_state(
    client: &async_nats::Client,
    subject: String,
    worker: WorkerId,
) -> Result<protocol::KvState, String> {
    let inbox = client.new_inbox();
    let mut answers = client
        .subscribe(inbox.clone())
        .await
        .map_err(|e| format!("cannot subscribe for the answer: {e}"))?;
    let request = protocol::KvStateRequest { worker: worker.0 };
    client
        .publish_with_reply(subject, inbox, request.encode().into())
        .await
        .map_err(|e| format!("cannot ask: {e}"))?;
    let mut assembly = protocol::KvStateAssembly::new(worker);
    let gather = async {
        loop {
            let Some(message) = answers.next().await else {
                return Err("the answer subscription closed".to_string());
            };
            let part =
                protocol::KvStatePart::decode(&message.payload).map_err(|e| e.to_string())?;
            if let Some(state) = assembly.push(&part).map_err(|e| e.to_string())? {
                return Ok(state);
            }
        }
    };
    tokio::time::timeout(STATE_TIMEOUT, gather)
        .await
        .map_err(|_| format!("no complete answer within {STATE_TIMEOUT:?} (an engine older than this gateway, or not a kvroute engine)"))?
}

/// How long one replay may take, connecting included, before its gap falls back to a resync.
pub(crate) const REPLAY_TIMEOUT: Duration = Duration::from_secs(2);

/// Most batches one replay reads (vLLM's and SGLang's default buffer holds 10,000); a gap
/// wider than this is resynced without asking.
pub(crate) const MAX_REPLAY_BATCHES: u64 = 16_384;

/// Asks `endpoint` (a publisher's replay ROUTER) for its batches from `from` on and applies
/// those `stream` misses before `until`, in order. `Ok(applied)` once the stream expects
/// `until` (the gap is filled); otherwise why not. A fresh DEALER per replay, dropped after,
/// so a late answer never reaches the next replay. Reads at most [`MAX_REPLAY_BATCHES`]
/// messages, one at a time, within [`REPLAY_TIMEOUT`].
/// What a replay applied: how many batches, and the number of the first (the publisher's
/// oldest kept, for a late subscriber).
struct Replayed {
    batches: u64,
    first: Option<u64>,
}

async fn replay(
    endpoint: &str,
    stream: &mut VllmEventStream,
    instance: u64,
    (from, until): (u64, u64),
    dispatcher: &Dispatcher,
) -> Result<Replayed, String> {
    let deadline = tokio::time::Instant::now() + REPLAY_TIMEOUT;
    let timed_out = |what: &str| format!("timed out {what} after {REPLAY_TIMEOUT:?}");
    let mut socket = zeromq::DealerSocket::new();
    tokio::time::timeout_at(deadline, socket.connect(endpoint))
        .await
        .map_err(|_| timed_out("connecting"))?
        .map_err(|e| format!("cannot connect: {e}"))?;
    let request: Vec<Bytes> = encode_replay_request(from)
        .into_iter()
        .map(Bytes::from)
        .collect();
    let request = ZmqMessage::try_from(request).map_err(|e| e.to_string())?;
    tokio::time::timeout_at(deadline, socket.send(request))
        .await
        .map_err(|_| timed_out("sending the request"))?
        .map_err(|e| format!("cannot send the request: {e}"))?;
    let mut applied = Replayed {
        batches: 0,
        first: None,
    };
    for _ in 0..MAX_REPLAY_BATCHES {
        if stream.next_frame_seq() == Some(until) {
            return Ok(applied);
        }
        let message = tokio::time::timeout_at(deadline, socket.recv())
            .await
            .map_err(|_| timed_out("waiting for batches"))?
            .map_err(|e| format!("receive failed: {e}"))?;
        match decode_replay_reply(&message.into_vec()).map_err(|e| e.to_string())? {
            ReplayReply::End => break,
            ReplayReply::Frame(frame) => {
                if let Some(accepted) = stream
                    .accept_replayed(&frame, until)
                    .map_err(|e| e.to_string())?
                {
                    // The stream numbers replayed events on from the live ones: in order,
                    // so the core applies them (nothing is held while this task waits).
                    dispatcher.stream_events(
                        EventSource::Zmq,
                        stream.worker(),
                        instance,
                        &accepted.events,
                    );
                    applied.batches += 1;
                    applied.first.get_or_insert(frame.seq);
                }
            }
        }
    }
    if stream.next_frame_seq() == Some(until) {
        Ok(applied)
    } else {
        Err(format!(
            "the replay ended before batch {until} (the stream expects {:?})",
            stream.next_frame_seq()
        ))
    }
}

/// The batches a replay should fill before a live frame numbered `seq`: from the first
/// missing one after a gap, from the oldest the publisher may hold for a late subscriber.
fn replay_start(continuity: Continuity, seq: u64) -> Option<u64> {
    match continuity {
        Continuity::Gap { expected, got } if got - expected <= MAX_REPLAY_BATCHES => Some(expected),
        Continuity::First if seq > 0 => Some(seq.saturating_sub(MAX_REPLAY_BATCHES)),
        _ => None,
    }
}

/// How long after a snapshot live batches below its number are taken as covered by it. A
/// subscriber holds at most a few moments of batches while it asks; a batch numbered below
/// after that is a restarted publisher's, which must clear the worker.
const COVERED_FOR: Duration = Duration::from_secs(5);

/// The batches a snapshot covered: below `next_batch`, while they can still be in flight.
#[derive(Debug, Clone, Copy)]
struct Covered {
    next_batch: u64,
    until: tokio::time::Instant,
}

impl Covered {
    fn covers(&self, seq: u64) -> bool {
        seq < self.next_batch && tokio::time::Instant::now() < self.until
    }
}

/// Most bytes of one `/kv_state` answer (about 40 bytes per block on the wire, and at most
/// `kv_index::MAX_MIRROR_BLOCKS` blocks).
const MAX_STATE_BYTES: usize = 64 * kv_index::MAX_MIRROR_BLOCKS;

/// Asks the worker for its whole cache (`GET /kv_state`) and hands it to the dispatcher's
/// [`kv_index::StreamSync`], which asked for it (it replaces the index's view of the worker);
/// resumes `stream` after the batches it covers.
async fn restore_from_state(
    http: &reqwest::Client,
    url: &str,
    stream: &mut VllmEventStream,
    instance: u64,
    dispatcher: &Dispatcher,
) -> Result<Covered, String> {
    let worker = stream.worker();
    let fetch = async {
        let mut response = http
            .get(url)
            .send()
            .await
            .map_err(|e| format!("GET {url}: {e}"))?;
        let status = response.status();
        if !status.is_success() {
            let body = response.text().await.unwrap_or_default();
            return Err(format!("GET {url}: {status} {}", body.trim()));
        }
        let too_large = || format!("GET {url}: the answer is over {MAX_STATE_BYTES} bytes");
        if response
            .content_length()
            .is_some_and(|n| n > MAX_STATE_BYTES as u64)
        {
            return Err(too_large());
        }
        // Read in chunks, so an answer without a length is bounded too.
        let mut body = Vec::new();
        while let Some(chunk) = response
            .chunk()
            .await
            .map_err(|e| format!("GET {url}: {e}"))?
        {
            if body.len() + chunk.len() > MAX_STATE_BYTES {
                return Err(too_large());
            }
            body.extend_from_slice(&chunk);
        }
        protocol::ZmqKvState::decode(&body, worker).map_err(|e| e.to_string())
    };
    let (next_batch, mut state) = tokio::time::timeout(STATE_TIMEOUT, fetch)
        .await
        .map_err(|_| format!("GET {url}: no answer within {STATE_TIMEOUT:?}"))??;
    // The index numbers this worker's events as the stream converts them, and the stream
    // counts the publisher's runs itself (frames carry no instance).
    state.next_seq = Some(stream.next_event_seq());
    state.instance = instance;
    if dispatcher.stream_snapshot(EventSource::Zmq, worker, Some(&state)) {
        // Nothing is held while this task waits, so nothing after the snapshot can show a
        // gap; should it ask again, the stream goes on from its events.
        dispatcher.stream_snapshot(EventSource::Zmq, worker, None);
    }
    stream.resume_at(next_batch);
    tracing::info!(%worker, next_batch, "the worker's cache snapshot replaced this gateway's view of it");
    Ok(Covered {
        next_batch,
        until: tokio::time::Instant::now() + COVERED_FOR,
    })
}

/// Answers the dispatcher's ask for `worker`'s snapshot: its `/kv_state` when it serves one,
/// else none (the index goes on from the events). Returns the live batches the snapshot
/// covers, or why there is none.
async fn answer_ask(
    http: &reqwest::Client,
    state_url: Option<&str>,
    stream: &mut VllmEventStream,
    instance: u64,
    dispatcher: &Dispatcher,
) -> Result<Covered, String> {
    let fetched = match state_url {
        Some(url) => restore_from_state(http, url, stream, instance, dispatcher).await,
        None => Err("the worker serves no cache snapshot".to_string()),
    };
    if fetched.is_err() {
        dispatcher.stream_snapshot(EventSource::Zmq, stream.worker(), None);
    }
    fetched
}

/// Subscribes to one vLLM (or SGLang) publisher and feeds its events as `worker`'s until
/// cancelled or aborted. Reconnects by itself (the ZMQ socket does). With `replay`, the
/// publisher's replay endpoint, gaps are filled from there before falling back to a resync.
pub(crate) async fn run_zmq_events(
    source_at: ZmqSource,
    http: reqwest::Client,
    worker: WorkerId,
    block_size: u32,
    dispatcher: Arc<Dispatcher>,
    cancel: CancellationToken,
) {
    let source = EventSource::Zmq;
    let ZmqSource {
        endpoint,
        replay: replay_endpoint,
        state: state_url,
    } = source_at;
    let mut socket = zeromq::SubSocket::new();
    loop {
        let connected = tokio::select! {
            _ = cancel.cancelled() => return,
            r = socket.connect(&endpoint) => r,
        };
        match connected {
            Ok(()) => break,
            Err(e) => {
                tracing::debug!(%worker, %endpoint, error = %e, "ZMQ connect failed; retrying");
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_millis(200)) => {}
                }
                socket = zeromq::SubSocket::new();
            }
        }
    }
    if let Err(e) = socket.subscribe("").await {
        tracing::error!(%worker, %endpoint, error = %e, "ZMQ subscribe failed");
        return;
    }
    tracing::info!(%worker, %endpoint, replay = ?replay_endpoint, "subscribed to vLLM-format KV events");
    let mut stream = VllmEventStream::new(worker, block_size);
    let mut warnings = WarnBudget::new();
    // Live batches the last snapshot already covers: skipped, not taken for a restart.
    let mut covered: Option<Covered> = None;
    // Counts the publisher's restarts (its sequence going backwards): a new run, whose cache
    // starts empty, for the dispatcher's `StreamSync`.
    let mut instance = 0u64;
    // A new subscription: whatever the worker cached before is unknown here. Subscribed
    // first, then asked: every batch after the snapshot arrives on the socket.
    dispatcher.stream_forget(source, worker);
    if dispatcher.stream_heard(source, worker) {
        let answered = tokio::select! {
            _ = cancel.cancelled() => return,
            r = answer_ask(&http, state_url.as_deref(), &mut stream, instance, &dispatcher) => r,
        };
        match answered {
            Ok(c) => covered = Some(c),
            Err(why) if state_url.is_some() => {
                tracing::warn!(%worker, %why, "the worker's cache snapshot is not available; replaying its recent KV event batches instead");
            }
            Err(_) => {}
        }
    }
    loop {
        let message = tokio::select! {
            _ = cancel.cancelled() => return,
            m = socket.recv() => m,
        };
        warnings.tick(source);
        let message = match message {
            Ok(m) => m,
            Err(e) => {
                // The socket reconnects on its own; events sent meanwhile are lost and the
                // next frame's sequence number reveals the gap.
                tracing::debug!(%worker, error = %e, "ZMQ receive error");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let parts = message.into_vec();
        let frame = match decode_multipart(&parts) {
            Ok(frame) => frame,
            Err(e) => {
                if warnings.allow(source) {
                    tracing::warn!(%worker, error = %e, "undecodable vLLM KV event frame; clearing the worker's blocks");
                }
                dispatcher.count_decode_error(source);
                // Cleared, and not asked: a flood of garbage must not become a flood of
                // snapshot fetches. A later gap asks.
                if dispatcher.stream_lost(source, worker) {
                    dispatcher.stream_snapshot(source, worker, None);
                }
                continue;
            }
        };
        if let Some(c) = covered {
            if c.covers(frame.seq) {
                continue;
            }
            covered = None;
        }
        let continuity = stream.continuity(frame.seq);
        if let (Some(replay_endpoint), Some(from)) =
            (&replay_endpoint, replay_start(continuity, frame.seq))
        {
            let replayed = tokio::select! {
                _ = cancel.cancelled() => return,
                r = replay(replay_endpoint, &mut stream, instance, (from, frame.seq), &dispatcher) => r,
            };
            match replayed {
                Ok(Replayed { batches, first }) => {
                    tracing::info!(%worker, ?continuity, batches, "KV event replay filled the gap");
                    dispatcher.count_replay(source, worker);
                    // A late subscriber whose replay does not reach the publisher's first
                    // batch misses what was cached before it: say so, once per subscription.
                    let oldest = first.unwrap_or(frame.seq);
                    if matches!(continuity, Continuity::First) && oldest > 0 {
                        tracing::warn!(%worker, oldest_batch = oldest, "this gateway subscribed after the worker's first {oldest} KV event batches, which its replay buffer no longer holds: blocks it cached before are unknown here until stored again (a larger --zmq-replay-buffer on the worker, or NATS, where kvroute engines answer with their whole cache)");
                    }
                }
                Err(why) => {
                    if warnings.allow(source) {
                        tracing::warn!(%worker, ?continuity, %why, "KV event replay failed");
                    }
                }
            }
        }
        // A gap the replay could not fill (or nothing to replay from): the worker's blocks
        // cannot be vouched for; the dispatcher's `StreamSync` drops them and asks for the
        // whole cache.
        // Cleared with no snapshot since: this frame's gap needs no second clear.
        let mut cleared = false;
        if let Continuity::Gap { .. } = stream.continuity(frame.seq) {
            if warnings.allow(source) {
                tracing::warn!(%worker, continuity = ?stream.continuity(frame.seq), "vLLM KV event sequence broken; clearing the worker's blocks");
            }
            cleared = true;
            if dispatcher.stream_lost(source, worker) {
                let answered = tokio::select! {
                    _ = cancel.cancelled() => return,
                    r = answer_ask(&http, state_url.as_deref(), &mut stream, instance, &dispatcher) => r,
                };
                match answered {
                    Ok(c) if c.covers(frame.seq) => {
                        covered = Some(c);
                        continue;
                    }
                    // The snapshot stops short of this frame: the batches between are lost.
                    Ok(_) => cleared = false,
                    Err(why) => {
                        if state_url.is_some() && warnings.allow(source) {
                            tracing::warn!(%worker, %why, "the worker's cache snapshot is not available to fill a KV event gap");
                        }
                    }
                }
            }
        }
        match stream.accept(&frame) {
            Ok(accepted) => {
                if let Continuity::Restart { .. } = accepted.continuity {
                    tracing::info!(%worker, continuity = ?accepted.continuity, "vLLM KV event sequence restarted (a new publisher); clearing the worker's blocks");
                    instance += 1;
                } else if accepted.continuity.needs_clear() && !cleared {
                    // A gap that a snapshot answered without reaching this frame.
                    if dispatcher.stream_lost(source, worker) {
                        dispatcher.stream_snapshot(source, worker, None);
                    }
                }
                if dispatcher.stream_events(source, worker, instance, &accepted.events) {
                    // The events themselves showed a gap (the stream numbers them in order,
                    // so only after a clear elsewhere): ask, as over NATS.
                    let answered = tokio::select! {
                        _ = cancel.cancelled() => return,
                        r = answer_ask(&http, state_url.as_deref(), &mut stream, instance, &dispatcher) => r,
                    };
                    covered = answered.ok();
                }
            }
            Err(e) => {
                if warnings.allow(source) {
                    tracing::warn!(%worker, error = %e, "vLLM KV events not usable; clearing the worker's blocks");
                }
                dispatcher.count_decode_error(source);
                if dispatcher.stream_lost(source, worker) {
                    dispatcher.stream_snapshot(source, worker, None);
                }
            }
        }
    }
}

/// One ZMQ subscription per worker, started and stopped as workers come and go.
#[derive(Debug, Default)]
pub(crate) struct ZmqSubscriptions {
    tasks: std::sync::Mutex<BTreeMap<WorkerId, Subscription>>,
}

/// Where one worker's vLLM-format events come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ZmqSource {
    /// The PUB endpoint.
    pub(crate) endpoint: String,
    /// Its replay ROUTER, asked to fill a gap.
    pub(crate) replay: Option<String>,
    /// Its whole-cache answer over HTTP ([`protocol::ZmqKvState`]).
    pub(crate) state: Option<String>,
}

/// A worker's event source and the task reading it.
type Subscription = (ZmqSource, JoinHandle<()>);

impl ZmqSubscriptions {
    /// Subscribes to `wanted` for `worker` unless already subscribed there.
    pub(crate) fn ensure(
        &self,
        worker: WorkerId,
        wanted: ZmqSource,
        block_size: u32,
        http: &reqwest::Client,
        dispatcher: &Arc<Dispatcher>,
        cancel: &CancellationToken,
    ) {
        let mut tasks = self.tasks.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((current, handle)) = tasks.get(&worker) {
            if *current == wanted && !handle.is_finished() {
                return;
            }
            handle.abort();
        }
        let task = tokio::spawn(run_zmq_events(
            wanted.clone(),
            http.clone(),
            worker,
            block_size,
            dispatcher.clone(),
            cancel.child_token(),
        ));
        tasks.insert(worker, (wanted, task));
    }

    pub(crate) fn stop(&self, worker: WorkerId) {
        let mut tasks = self.tasks.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, handle)) = tasks.remove(&worker) {
            handle.abort();
        }
    }

    pub(crate) fn stop_all(&self) {
        let mut tasks = self.tasks.lock().unwrap_or_else(|p| p.into_inner());
        for (_, (_, handle)) in std::mem::take(&mut *tasks) {
            handle.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flood_of_bad_messages_logs_a_few_then_a_summary_per_window() {
        let mut budget = WarnBudget::new();
        let allowed = (0..1000).filter(|_| budget.allow(EventSource::Zmq)).count();
        assert_eq!(allowed, WarnBudget::PER_WINDOW as usize);
        assert_eq!(budget.suppressed, 1000 - u64::from(WarnBudget::PER_WINDOW));
        // The window passes: the summary resets the count and logging resumes.
        budget.roll(budget.window_start + WarnBudget::WINDOW, EventSource::Zmq);
        assert_eq!(budget.suppressed, 0);
        assert!(budget.allow(EventSource::Zmq));
    }
}
