//! KV event ingestion: in-process, NATS (our msgpack format) and ZMQ SUB (vLLM's format).
//!
//! Every source ends in [`Dispatcher::apply_events`], which applies events under the core
//! lock and turns a sequence gap into a clear of that worker's blocks plus a counted resync.
//! Transport-level losses get the same treatment: a vLLM batch-number gap or restart
//! ([`protocol::vllm::Continuity`]), a frame that cannot be converted, or a NATS batch from a
//! new worker `instance` (a restart: empty cache, sequence numbers from 0).
//!
//! Bad input is counted in the metrics (`decode_errors`, `resyncs`) frame by frame, but logged
//! sparingly ([`WarnBudget`]): a flood of garbage frames writes a few lines and a periodic
//! summary, not a line per frame. A stored event over `protocol::kv_events::MAX_STORED_BLOCKS`
//! blocks or `MAX_STORED_TOKENS` tokens is refused like any other bad frame.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use kv_index::{KvEvent, WorkerId};
use protocol::vllm::{VllmEventStream, decode_multipart};
use protocol::{KvEventBatch, Subjects};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use zeromq::{Socket, SocketRecv};

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

/// Consumes `kvroute.<ns>.kv.*` until cancelled.
pub(crate) async fn run_nats_events(
    client: async_nats::Client,
    subjects: Subjects,
    dispatcher: Arc<Dispatcher>,
    max_workers: usize,
    cancel: CancellationToken,
) {
    let mut subscriber = match client.subscribe(subjects.kv_events_all()).await {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "cannot subscribe to KV events over NATS");
            return;
        }
    };
    let source = EventSource::Nats;
    // The last `instance` seen per worker, to notice restarts. Bounded: past the bound the
    // map is cleared, which at worst costs one unnecessary clear per worker.
    let mut instances: BTreeMap<WorkerId, u64> = BTreeMap::new();
    let mut warnings = WarnBudget::new();
    loop {
        let message = tokio::select! {
            _ = cancel.cancelled() => break,
            m = subscriber.next() => match m { Some(m) => m, None => break },
        };
        warnings.tick(source);
        let Some(worker) = subjects.parse_kv_events(message.subject.as_str()) else {
            dispatcher.count_decode_error(source);
            continue;
        };
        let batch = match KvEventBatch::decode(&message.payload) {
            Ok(batch) if batch.worker == worker.0 => batch,
            Ok(batch) => {
                if warnings.allow(source) {
                    tracing::warn!(%worker, batch_worker = batch.worker, "KV batch names another worker than its subject; dropped");
                }
                dispatcher.count_decode_error(source);
                continue;
            }
            Err(e) => {
                if warnings.allow(source) {
                    tracing::warn!(%worker, error = %e, "undecodable KV event batch; clearing the worker's blocks");
                }
                dispatcher.count_decode_error(source);
                dispatcher.resync_worker(source, worker);
                continue;
            }
        };
        if instances.len() >= max_workers && !instances.contains_key(&worker) {
            instances.clear();
        }
        let previous = instances.insert(worker, batch.instance);
        if previous.is_some_and(|p| p != batch.instance) {
            tracing::info!(%worker, "worker restarted (new instance); clearing its blocks");
            dispatcher.resync_worker(source, worker);
        }
        match batch.to_kv_events() {
            Ok(events) => dispatcher.apply_events(source, &events),
            Err(e) => {
                if warnings.allow(source) {
                    tracing::warn!(%worker, error = %e, "bad KV event batch; clearing the worker's blocks");
                }
                dispatcher.count_decode_error(source);
                dispatcher.resync_worker(source, worker);
            }
        }
    }
}

/// Subscribes to one vLLM publisher and feeds its events as `worker`'s until cancelled or
/// aborted. Reconnects by itself (the ZMQ socket does).
pub(crate) async fn run_zmq_events(
    endpoint: String,
    worker: WorkerId,
    block_size: u32,
    dispatcher: Arc<Dispatcher>,
    cancel: CancellationToken,
) {
    let source = EventSource::Zmq;
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
    tracing::info!(%worker, %endpoint, "subscribed to vLLM KV events");
    let mut stream = VllmEventStream::new(worker, block_size);
    let mut warnings = WarnBudget::new();
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
                dispatcher.resync_worker(source, worker);
                continue;
            }
        };
        match stream.accept(&frame) {
            Ok(accepted) => {
                if accepted.continuity.needs_clear() {
                    if warnings.allow(source) {
                        tracing::warn!(%worker, continuity = ?accepted.continuity, "vLLM KV event sequence broken; clearing the worker's blocks");
                    }
                    dispatcher.resync_worker(source, worker);
                }
                dispatcher.apply_events(source, &accepted.events);
            }
            Err(e) => {
                if warnings.allow(source) {
                    tracing::warn!(%worker, error = %e, "vLLM KV events not usable; clearing the worker's blocks");
                }
                dispatcher.count_decode_error(source);
                dispatcher.resync_worker(source, worker);
            }
        }
    }
}

/// One ZMQ subscription per worker, started and stopped as workers come and go.
#[derive(Debug, Default)]
pub(crate) struct ZmqSubscriptions {
    tasks: std::sync::Mutex<BTreeMap<WorkerId, (String, JoinHandle<()>)>>,
}

impl ZmqSubscriptions {
    /// Subscribes to `endpoint` for `worker` unless already subscribed there.
    pub(crate) fn ensure(
        &self,
        worker: WorkerId,
        endpoint: &str,
        block_size: u32,
        dispatcher: &Arc<Dispatcher>,
        cancel: &CancellationToken,
    ) {
        let mut tasks = self.tasks.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((current, handle)) = tasks.get(&worker) {
            if current == endpoint && !handle.is_finished() {
                return;
            }
            handle.abort();
        }
        let task = tokio::spawn(run_zmq_events(
            endpoint.to_string(),
            worker,
            block_size,
            dispatcher.clone(),
            cancel.child_token(),
        ));
        tasks.insert(worker, (endpoint.to_string(), task));
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
