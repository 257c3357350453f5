//! The gateway's shared state: the router core, the worker table and the frontend queue,
//! behind one mutex held only for short, non-blocking sections.
//!
//! A request is admitted with [`Dispatcher::admit`]: it is routed at once when a worker has a
//! free slot (fewer than `max_inflight_per_worker` requests in flight, as the router accounts
//! them) and nobody is waiting; otherwise it waits in a bounded FIFO queue until a slot frees,
//! or is refused (429 when the queue is full, 503 after the queue timeout). The [`Ticket`] it
//! gets back holds the request's place in the router's accounting: dropping it (the stream
//! ended, failed, or the client went away) releases the slot and lets the queue move.
//!
//! Only routable workers (registered and healthy) are in the router; a worker that fails
//! leaves it, which also drops its blocks from the prefix index.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kv_index::{EventError, KvEvent, WorkerId};
use nanotime::Nanos;
use rand_chacha::ChaCha8Rng;
use router::{
    Candidate, RequestId, RouteDecision, RouteError, Router, RoutingKey, RoutingPolicy,
    SelectionContext,
};
use tokio::sync::oneshot;

use crate::config::{GatewayConfig, PromptFormat};
use crate::metrics::{EventCounters, EventSource, Metrics, RouterSnapshot, WorkerSnapshot};
use crate::registry::WorkerInfo;

/// How a worker joined.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// `--worker`: kept until the gateway stops; health checks move it in and out of the
    /// routing set.
    Static,
    /// Announced over NATS: leaves when its lease runs out, it says goodbye, or it fails.
    Dynamic { lease_deadline: Instant },
}

#[derive(Debug)]
struct WorkerEntry {
    info: Arc<WorkerInfo>,
    origin: Origin,
    routable: bool,
}

/// Why a request got no worker.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdmitError {
    #[error("no healthy worker is available")]
    NoWorkers,
    #[error("all workers are at capacity and {capacity} requests are already queued")]
    QueueFull { capacity: usize },
    #[error("no worker slot became free within {waited:?}")]
    QueueTimeout { waited: Duration },
    #[error("the gateway is shutting down")]
    ShuttingDown,
    #[error("routing failed: {0}")]
    Route(RouteError),
}

/// Why a worker could not be registered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegistryError {
    #[error("the gateway already knows its limit of {limit} workers")]
    Full { limit: usize },
    #[error(
        "{worker} uses KV blocks of {worker_block_size} tokens but the gateway's router uses \
         {router_block_size} (set --kv-block-size to match the workers)"
    )]
    BlockSizeMismatch {
        worker: WorkerId,
        worker_block_size: usize,
        router_block_size: usize,
    },
    #[error(
        "{worker} is already registered at {existing}; {url} reports the same id. Give each \
         worker its own id (kvroute engine --worker-id N, or id=N in --worker)"
    )]
    DuplicateId {
        worker: WorkerId,
        existing: String,
        url: String,
    },
    #[error("{0}")]
    Router(RouteError),
}

/// A routed request's claim on a worker slot; released when dropped.
#[derive(Debug)]
pub struct Ticket {
    dispatcher: Arc<Dispatcher>,
    pub id: RequestId,
    pub worker: Arc<WorkerInfo>,
    pub decision: RouteDecision,
    /// The request waited in the frontend queue.
    pub queued: bool,
    first_token_seen: bool,
}

impl Ticket {
    /// The worker produced the request's first token: its prefill is done.
    pub fn first_token(&mut self) {
        if !self.first_token_seen {
            self.first_token_seen = true;
            self.dispatcher.first_token(self.id);
        }
    }

    /// Tokens of the prompt the router believes are cached on the chosen worker.
    pub fn predicted_cached_tokens(&self, prompt_tokens: u64) -> u64 {
        let block = self.worker.block_size as u64;
        (u64::from(self.decision.overlap_blocks) * block).min(prompt_tokens)
    }

    /// The worker failed while serving this request: take it out of the routing set.
    pub fn worker_failed(&self) {
        self.dispatcher.worker_failed(self.worker.id);
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.dispatcher.finish(self.id);
    }
}

type Assignment = Result<(RequestId, Arc<WorkerInfo>, RouteDecision), AdmitError>;

#[derive(Debug)]
struct Waiter {
    id: RequestId,
    key: RoutingKey,
    tx: oneshot::Sender<Assignment>,
}

#[derive(Debug)]
struct Core {
    router: Router,
    workers: BTreeMap<WorkerId, WorkerEntry>,
    queue: VecDeque<Waiter>,
    shutting_down: bool,
}

/// Event ingestion counters, updated without the core lock.
#[derive(Debug, Default)]
struct EventStats {
    received: [AtomicU64; 3],
    decode_errors: [AtomicU64; 3],
    resyncs: [AtomicU64; 3],
    dropped: [AtomicU64; 3],
}

/// Shared state of one gateway. See the module docs.
#[derive(Debug)]
pub struct Dispatcher {
    core: Mutex<Core>,
    epoch: Instant,
    next_request: AtomicU64,
    hasher: kv_index::BlockHasher,
    queue_capacity: usize,
    queue_timeout: Duration,
    max_inflight_per_worker: u32,
    max_workers: usize,
    kv_events: bool,
    /// Some known worker takes text prompts (so chat requests also render the text).
    text_workers: std::sync::atomic::AtomicBool,
    events: EventStats,
    metrics: std::sync::OnceLock<Arc<Metrics>>,
}

/// Restricts any policy to the workers with a free slot, so a full worker is never chosen
/// while another has room (the router's policies see load but do not enforce a cap).
#[derive(Debug)]
struct CapacityGate {
    inner: Box<dyn RoutingPolicy>,
    cap: u32,
    open: Vec<Candidate>,
    positions: Vec<usize>,
}

impl RoutingPolicy for CapacityGate {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn select(&mut self, ctx: &SelectionContext<'_>, rng: &mut ChaCha8Rng) -> usize {
        if self.cap == 0 {
            return self.inner.select(ctx, rng);
        }
        self.open.clear();
        self.positions.clear();
        for (i, c) in ctx.candidates.iter().enumerate() {
            if c.load.in_flight < self.cap {
                self.open.push(*c);
                self.positions.push(i);
            }
        }
        if self.open.is_empty() || self.open.len() == ctx.candidates.len() {
            return self.inner.select(ctx, rng);
        }
        let open = SelectionContext {
            prompt_tokens: ctx.prompt_tokens,
            prompt_blocks: ctx.prompt_blocks,
            block_size: ctx.block_size,
            candidates: &self.open,
        };
        let chosen = self.inner.select(&open, rng);
        self.positions.get(chosen).copied().unwrap_or(usize::MAX)
    }
}

fn lock(core: &Mutex<Core>) -> MutexGuard<'_, Core> {
    // A panic while holding the lock leaves plain data behind; keep serving.
    core.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Dispatcher {
    /// State for a gateway configured by `config`.
    pub fn new(config: &GatewayConfig) -> Result<Arc<Dispatcher>, router::RouterConfigError> {
        let gate = CapacityGate {
            inner: config.router.policy.build(config.router.params),
            cap: config.max_inflight_per_worker,
            open: Vec::new(),
            positions: Vec::new(),
        };
        let router = Router::with_policy(config.router.clone(), Box::new(gate))?;
        let hasher = *router.hasher();
        Ok(Arc::new(Dispatcher {
            core: Mutex::new(Core {
                router,
                workers: BTreeMap::new(),
                queue: VecDeque::new(),
                shutting_down: false,
            }),
            epoch: Instant::now(),
            next_request: AtomicU64::new(1),
            hasher,
            queue_capacity: config.queue_capacity,
            queue_timeout: config.queue_timeout,
            max_inflight_per_worker: config.max_inflight_per_worker,
            max_workers: config.max_workers.max(1),
            kv_events: config.kv_events(),
            text_workers: std::sync::atomic::AtomicBool::new(false),
            events: EventStats::default(),
            metrics: std::sync::OnceLock::new(),
        }))
    }

    /// Connects the metrics whose queue gauge this dispatcher keeps current.
    pub(crate) fn set_metrics(&self, metrics: Arc<Metrics>) {
        let _ = self.metrics.set(metrics);
    }

    /// Router time: nanoseconds since this dispatcher was created.
    pub fn now(&self) -> Nanos {
        Nanos(u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX))
    }

    /// Tokens per KV block of the router.
    pub fn block_size(&self) -> usize {
        self.hasher.block_size()
    }

    /// Hashes a prompt for routing (outside the lock).
    pub fn key(&self, tokens: &[u32]) -> RoutingKey {
        RoutingKey::new(&self.hasher, tokens)
    }

    fn set_queued(&self, len: usize) {
        if let Some(m) = self.metrics.get() {
            m.queued.set(i64::try_from(len).unwrap_or(i64::MAX));
        }
    }

    /// Routes a request, waiting in the frontend queue while every worker is at capacity.
    pub async fn admit(self: &Arc<Self>, key: RoutingKey) -> Result<Ticket, AdmitError> {
        let id = RequestId(self.next_request.fetch_add(1, Ordering::Relaxed));
        let rx = {
            let mut core = lock(&self.core);
            if core.shutting_down {
                return Err(AdmitError::ShuttingDown);
            }
            if core.router.workers().next().is_none() {
                return Err(AdmitError::NoWorkers);
            }
            if core.queue.is_empty() && self.has_free_slot(&core) {
                let now = self.now();
                let decision = core.router.route(id, &key, now).map_err(route_error)?;
                let worker = core
                    .workers
                    .get(&decision.worker)
                    .map(|w| w.info.clone())
                    .ok_or(AdmitError::NoWorkers)?;
                return Ok(self.ticket(id, worker, decision, false));
            }
            if core.queue.len() >= self.queue_capacity {
                return Err(AdmitError::QueueFull {
                    capacity: self.queue_capacity,
                });
            }
            let (tx, rx) = oneshot::channel();
            core.queue.push_back(Waiter { id, key, tx });
            self.set_queued(core.queue.len());
            rx
        };
        // Leaves the queue if the caller is dropped (client gone) while waiting.
        let mut rx = rx;
        let mut guard = QueueGuard {
            dispatcher: self,
            id,
            armed: true,
        };
        let outcome = tokio::time::timeout(self.queue_timeout, &mut rx).await;
        guard.armed = false;
        let assignment = match outcome {
            Ok(Ok(assignment)) => assignment,
            Ok(Err(_closed)) => Err(AdmitError::ShuttingDown),
            Err(_elapsed) => {
                if self.leave_queue(id) {
                    Err(AdmitError::QueueTimeout {
                        waited: self.queue_timeout,
                    })
                } else {
                    // Assigned just as the wait ran out (under the lock, so it is there now).
                    rx.try_recv().unwrap_or(Err(AdmitError::ShuttingDown))
                }
            }
        };
        let (id, worker, decision) = assignment?;
        Ok(self.ticket(id, worker, decision, true))
    }

    fn ticket(
        self: &Arc<Self>,
        id: RequestId,
        worker: Arc<WorkerInfo>,
        decision: RouteDecision,
        queued: bool,
    ) -> Ticket {
        Ticket {
            dispatcher: self.clone(),
            id,
            worker,
            decision,
            queued,
            first_token_seen: false,
        }
    }

    fn has_free_slot(&self, core: &Core) -> bool {
        let cap = self.max_inflight_per_worker;
        core.router
            .workers()
            .any(|(_, load)| cap == 0 || load.in_flight < cap)
    }

    /// Removes a waiter; `false` when it was no longer queued (already assigned).
    fn leave_queue(&self, id: RequestId) -> bool {
        let mut core = lock(&self.core);
        let Some(pos) = core.queue.iter().position(|w| w.id == id) else {
            return false;
        };
        core.queue.remove(pos);
        self.set_queued(core.queue.len());
        true
    }

    /// Hands free slots to the queue's head, in order.
    fn pump(&self, core: &mut Core) {
        let mut changed = false;
        while !core.queue.is_empty() && self.has_free_slot(core) {
            let Some(waiter) = core.queue.pop_front() else {
                break;
            };
            changed = true;
            if waiter.tx.is_closed() {
                continue;
            }
            let now = self.now();
            let assignment = match core.router.route(waiter.id, &waiter.key, now) {
                Ok(decision) => match core.workers.get(&decision.worker) {
                    Some(w) => Ok((waiter.id, w.info.clone(), decision)),
                    None => {
                        core.router.on_finished(waiter.id, now);
                        Err(AdmitError::NoWorkers)
                    }
                },
                Err(e) => Err(route_error(e)),
            };
            let routed = assignment.is_ok();
            if waiter.tx.send(assignment).is_err() && routed {
                // The waiter left between the check and the send: release its slot.
                core.router.on_finished(waiter.id, now);
            }
        }
        if core.router.workers().next().is_none() {
            // Nobody can serve the waiters: fail them now rather than at their timeout.
            changed |= !core.queue.is_empty();
            for waiter in core.queue.drain(..) {
                let _ = waiter.tx.send(Err(AdmitError::NoWorkers));
            }
        }
        if changed {
            self.set_queued(core.queue.len());
        }
    }

    fn first_token(&self, id: RequestId) {
        let now = self.now();
        lock(&self.core).router.on_first_token(id, now);
    }

    fn finish(&self, id: RequestId) {
        let now = self.now();
        let mut core = lock(&self.core);
        core.router.on_finished(id, now);
        self.pump(&mut core);
    }

    /// Takes a worker out of the routing set after a failure (health checks bring a static
    /// worker back; a dynamic one must announce itself again).
    pub fn worker_failed(&self, worker: WorkerId) {
        let mut core = lock(&self.core);
        let Some(entry) = core.workers.get_mut(&worker) else {
            return;
        };
        match entry.origin {
            Origin::Static => {
                if entry.routable {
                    entry.routable = false;
                    core.router.remove_worker(worker);
                    tracing::warn!(%worker, "worker failed; out of the routing set until healthy");
                }
            }
            Origin::Dynamic { .. } => {
                core.workers.remove(&worker);
                core.router.remove_worker(worker);
                tracing::warn!(%worker, "dynamic worker failed; removed until it announces again");
            }
        }
        self.pump(&mut core);
    }

    /// Adds or updates a worker. A routable worker enters the router at once.
    pub fn upsert_worker(
        &self,
        info: WorkerInfo,
        origin: Origin,
        routable: bool,
    ) -> Result<(), RegistryError> {
        if info.block_size != self.block_size() {
            return Err(RegistryError::BlockSizeMismatch {
                worker: info.id,
                worker_block_size: info.block_size,
                router_block_size: self.block_size(),
            });
        }
        if info.prompt == PromptFormat::Text {
            self.text_workers.store(true, Ordering::Relaxed);
        }
        let mut core = lock(&self.core);
        let id = info.id;
        if let Some(existing) = core.workers.get(&id) {
            // A dynamic worker may come back at a new address; a static one may not share
            // its id with another.
            let both_static = existing.origin == Origin::Static && origin == Origin::Static;
            if both_static && existing.info.url != info.url {
                return Err(RegistryError::DuplicateId {
                    worker: id,
                    existing: existing.info.url.clone(),
                    url: info.url.clone(),
                });
            }
        }
        if !core.workers.contains_key(&id) && core.workers.len() >= self.max_workers {
            return Err(RegistryError::Full {
                limit: self.max_workers,
            });
        }
        let limits = info.limits;
        let was_routable = core.workers.get(&id).is_some_and(|w| w.routable);
        core.workers.insert(
            id,
            WorkerEntry {
                info: Arc::new(info),
                origin,
                routable,
            },
        );
        if routable {
            if let Err(e) = core.router.add_worker(id, limits) {
                if let Some(entry) = core.workers.get_mut(&id) {
                    entry.routable = false;
                }
                return Err(RegistryError::Router(e));
            }
        } else if was_routable {
            core.router.remove_worker(id);
        }
        self.pump(&mut core);
        Ok(())
    }

    /// Moves a known worker in or out of the routing set (health checks).
    pub fn set_routable(&self, worker: WorkerId, routable: bool) {
        let mut core = lock(&self.core);
        let Some(entry) = core.workers.get_mut(&worker) else {
            return;
        };
        if entry.routable == routable {
            return;
        }
        entry.routable = routable;
        let limits = entry.info.limits;
        if routable {
            if core.router.add_worker(worker, limits).is_err() {
                if let Some(entry) = core.workers.get_mut(&worker) {
                    entry.routable = false;
                }
            } else {
                tracing::info!(%worker, "worker healthy; back in the routing set");
            }
        } else {
            core.router.remove_worker(worker);
            tracing::warn!(%worker, "worker unhealthy; out of the routing set");
        }
        self.pump(&mut core);
    }

    /// Extends a dynamic worker's lease; `false` if the worker is unknown (it must announce).
    pub fn renew_lease(&self, worker: WorkerId, deadline: Instant) -> bool {
        let mut core = lock(&self.core);
        match core.workers.get_mut(&worker) {
            Some(WorkerEntry {
                origin: Origin::Dynamic { lease_deadline },
                ..
            }) => {
                *lease_deadline = deadline;
                true
            }
            Some(_) => true,
            None => false,
        }
    }

    /// How a known worker joined.
    pub fn origin(&self, worker: WorkerId) -> Option<Origin> {
        lock(&self.core).workers.get(&worker).map(|w| w.origin)
    }

    /// Forgets a worker entirely (goodbye, lease expiry); its blocks leave the index.
    pub fn remove_worker(&self, worker: WorkerId) -> bool {
        let mut core = lock(&self.core);
        let known = core.workers.remove(&worker).is_some();
        if known {
            core.router.remove_worker(worker);
            self.pump(&mut core);
        }
        known
    }

    /// Removes dynamic workers whose lease ran out before `now`; returns them.
    pub fn expire_leases(&self, now: Instant) -> Vec<WorkerId> {
        let mut core = lock(&self.core);
        let expired: Vec<WorkerId> = core
            .workers
            .iter()
            .filter(|(_, w)| matches!(w.origin, Origin::Dynamic { lease_deadline } if lease_deadline < now))
            .map(|(id, _)| *id)
            .collect();
        for id in &expired {
            core.workers.remove(id);
            core.router.remove_worker(*id);
            tracing::warn!(worker = %id, "worker lease expired; removed");
        }
        if !expired.is_empty() {
            self.pump(&mut core);
        }
        expired
    }

    /// Known workers with their routability, ascending by id.
    pub fn workers(&self) -> Vec<(Arc<WorkerInfo>, Origin, bool)> {
        lock(&self.core)
            .workers
            .values()
            .map(|w| (w.info.clone(), w.origin, w.routable))
            .collect()
    }

    /// Whether any worker ever registered takes text prompts.
    pub fn has_text_workers(&self) -> bool {
        self.text_workers.load(Ordering::Relaxed)
    }

    /// Routable workers, ascending by id.
    pub fn routable_workers(&self) -> Vec<WorkerId> {
        lock(&self.core)
            .router
            .workers()
            .map(|(id, _)| id)
            .collect()
    }

    /// Applies KV events from `source`. A sequence gap clears that worker's blocks and
    /// re-applies the event as a new baseline, so the index never keeps a state it cannot
    /// vouch for; the resync is counted. In approximate mode workers' events are ignored (the
    /// router predicts caches itself).
    pub fn apply_events(&self, source: EventSource, events: &[KvEvent]) {
        let s = source as usize;
        self.events.received[s].fetch_add(events.len() as u64, Ordering::Relaxed);
        if !self.kv_events || events.is_empty() {
            return;
        }
        let mut core = lock(&self.core);
        for event in events {
            match core.router.apply_event(event) {
                Ok(_) => {}
                Err(EventError::Gap {
                    worker,
                    expected,
                    got,
                }) => {
                    tracing::warn!(%worker, expected, got, ?source, "KV event gap; clearing the worker's blocks and resyncing");
                    core.router.index_mut().clear_worker(worker);
                    self.events.resyncs[s].fetch_add(1, Ordering::Relaxed);
                    let _ = core.router.apply_event(event);
                }
                Err(e) => tracing::debug!(error = %e, "KV event not applied"),
            }
        }
    }

    /// A worker's event stream lost messages at the transport level (e.g. a ZMQ batch
    /// sequence gap): drop its blocks and count a resync.
    pub fn resync_worker(&self, source: EventSource, worker: WorkerId) {
        self.events.resyncs[source as usize].fetch_add(1, Ordering::Relaxed);
        if self.kv_events {
            lock(&self.core).router.index_mut().clear_worker(worker);
        }
    }

    pub fn count_decode_error(&self, source: EventSource) {
        self.events.decode_errors[source as usize].fetch_add(1, Ordering::Relaxed);
    }

    pub fn count_dropped(&self, source: EventSource, n: u64) {
        self.events.dropped[source as usize].fetch_add(n, Ordering::Relaxed);
    }

    /// Expires approximate-mode predictions that are due.
    pub fn tick(&self) {
        let now = self.now();
        lock(&self.core).router.handle_timeout(now);
    }

    /// How many leading blocks of a prompt each worker holds, as the index knows it.
    pub fn overlaps(&self, key: &RoutingKey) -> kv_index::OverlapScores {
        lock(&self.core).router.overlaps(key)
    }

    /// Blocks the index holds for `worker` (for tests and diagnostics).
    pub fn cached_blocks(&self, worker: WorkerId) -> usize {
        lock(&self.core).router.index().blocks_of(worker)
    }

    /// Stops admitting requests and fails every queued one.
    pub fn shut_down(&self) {
        let mut core = lock(&self.core);
        core.shutting_down = true;
        for waiter in core.queue.drain(..) {
            let _ = waiter.tx.send(Err(AdmitError::ShuttingDown));
        }
        self.set_queued(0);
    }

    /// Router, index, worker and event state for metrics.
    pub fn snapshot(&self) -> RouterSnapshot {
        let core = lock(&self.core);
        let index = core.router.index();
        let loads: BTreeMap<WorkerId, router::WorkerLoad> = core.router.workers().collect();
        let workers = core
            .workers
            .values()
            .map(|w| {
                let load = loads.get(&w.info.id).copied().unwrap_or_default();
                WorkerSnapshot {
                    id: w.info.id.0,
                    url: w.info.url.clone(),
                    routable: w.routable,
                    in_flight: load.in_flight,
                    pending_prefill_tokens: load.pending_prefill_tokens,
                    active_blocks: load.active_blocks,
                    cached_blocks: index.blocks_of(w.info.id),
                }
            })
            .collect();
        let read = |a: &[AtomicU64; 3]| {
            [
                a[0].load(Ordering::Relaxed),
                a[1].load(Ordering::Relaxed),
                a[2].load(Ordering::Relaxed),
            ]
        };
        RouterSnapshot {
            policy: core.router.policy_name(),
            counters: core.router.counters(),
            index: index.counters(),
            index_entries: index.len(),
            index_distinct_blocks: index.distinct_blocks(),
            workers,
            events: EventCounters {
                received: read(&self.events.received),
                decode_errors: read(&self.events.decode_errors),
                resyncs: read(&self.events.resyncs),
                dropped: read(&self.events.dropped),
            },
        }
    }
}

/// Takes a cancelled waiter out of the queue.
struct QueueGuard<'a> {
    dispatcher: &'a Arc<Dispatcher>,
    id: RequestId,
    armed: bool,
}

impl Drop for QueueGuard<'_> {
    fn drop(&mut self) {
        if self.armed && !self.dispatcher.leave_queue(self.id) {
            // Assigned while being cancelled: the assignment is lost with the receiver, so
            // release the slot it took.
            self.dispatcher.finish(self.id);
        }
    }
}

fn route_error(e: RouteError) -> AdmitError {
    match e {
        RouteError::NoWorkers => AdmitError::NoWorkers,
        other => AdmitError::Route(other),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dispatcher(cap: u32, queue: usize, timeout_ms: u64) -> Arc<Dispatcher> {
        let config = GatewayConfig {
            max_inflight_per_worker: cap,
            queue_capacity: queue,
            queue_timeout: Duration::from_millis(timeout_ms),
            router: router::RouterConfig {
                policy: router::PolicyKind::Kv,
                block_size: 4,
                ..Default::default()
            },
            ..GatewayConfig::default()
        };
        let d = Dispatcher::new(&config).unwrap();
        for id in [1, 2] {
            let mut info = WorkerInfo::new(WorkerId(id), &format!("http://w{id}"));
            info.block_size = 4;
            d.upsert_worker(info, Origin::Static, true).unwrap();
        }
        d
    }

    fn key(d: &Dispatcher, n: u32) -> RoutingKey {
        d.key(&(n * 100..n * 100 + 16).collect::<Vec<_>>())
    }

    #[tokio::test]
    async fn a_full_worker_is_never_chosen_while_another_has_room() {
        let d = dispatcher(1, 8, 1000);
        // Make worker 1 hold the prompt: the KV policy would pick it every time.
        let prompt: Vec<u32> = (0..16).collect();
        d.apply_events(
            EventSource::InProcess,
            &[KvEvent {
                worker: WorkerId(1),
                seq: 0,
                kind: kv_index::KvEventKind::stored_prompt(&d.hasher, &prompt),
            }],
        );
        let first = d.admit(d.key(&prompt)).await.unwrap();
        assert_eq!(first.worker.id, WorkerId(1));
        let second = d.admit(d.key(&prompt)).await.unwrap();
        assert_eq!(second.worker.id, WorkerId(2), "worker 1 is at its cap");
        drop(first);
        let third = d.admit(d.key(&prompt)).await.unwrap();
        assert_eq!(third.worker.id, WorkerId(1));
    }

    #[tokio::test]
    async fn waiters_are_served_in_arrival_order_and_a_full_queue_refuses() {
        let d = dispatcher(1, 3, 5_000);
        let a = d.admit(key(&d, 1)).await.unwrap();
        let b = d.admit(key(&d, 2)).await.unwrap();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let mut waiters = Vec::new();
        for n in 0..3u32 {
            let shared = d.clone();
            let tx = tx.clone();
            waiters.push(tokio::spawn(async move {
                let ticket = shared.admit(key(&shared, 10 + n)).await.unwrap();
                tx.send(n).unwrap();
                // Hold the slot briefly so the order of release is the order of service.
                tokio::time::sleep(Duration::from_millis(5)).await;
                drop(ticket);
            }));
            // Queue them in a known order.
            while lock(&d.core).queue.len() < (n + 1) as usize {
                tokio::task::yield_now().await;
            }
        }
        assert!(matches!(
            d.admit(key(&d, 99)).await,
            Err(AdmitError::QueueFull { capacity: 3 })
        ));
        drop(a);
        drop(b);
        for w in waiters {
            w.await.unwrap();
        }
        let order: Vec<u32> = std::iter::from_fn(|| rx.try_recv().ok()).collect();
        assert_eq!(order, vec![0, 1, 2]);
        assert_eq!(
            d.snapshot()
                .workers
                .iter()
                .map(|w| w.in_flight)
                .sum::<u32>(),
            0
        );
    }

    #[tokio::test]
    async fn a_waiter_times_out_and_a_cancelled_one_leaves_no_slot_behind() {
        let d = dispatcher(1, 4, 50);
        let _a = d.admit(key(&d, 1)).await.unwrap();
        let _b = d.admit(key(&d, 2)).await.unwrap();
        assert!(matches!(
            d.admit(key(&d, 3)).await,
            Err(AdmitError::QueueTimeout { .. })
        ));
        assert_eq!(lock(&d.core).queue.len(), 0);
        // A waiter dropped while queued (client gone) leaves the queue.
        let pending = tokio::spawn({
            let d = d.clone();
            async move { d.admit(key(&d, 4)).await.map(|_| ()) }
        });
        while lock(&d.core).queue.is_empty() {
            tokio::task::yield_now().await;
        }
        pending.abort();
        let _ = pending.await;
        assert_eq!(lock(&d.core).queue.len(), 0);
        assert_eq!(
            d.snapshot()
                .workers
                .iter()
                .map(|w| w.in_flight)
                .sum::<u32>(),
            2
        );
    }

    #[tokio::test]
    async fn losing_every_worker_fails_the_waiters_at_once() {
        let d = dispatcher(1, 4, 60_000);
        let _a = d.admit(key(&d, 1)).await.unwrap();
        let _b = d.admit(key(&d, 2)).await.unwrap();
        let waiter = tokio::spawn({
            let d = d.clone();
            async move { d.admit(key(&d, 3)).await.map(|_| ()) }
        });
        while lock(&d.core).queue.is_empty() {
            tokio::task::yield_now().await;
        }
        d.worker_failed(WorkerId(1));
        d.set_routable(WorkerId(2), false);
        assert_eq!(waiter.await.unwrap(), Err(AdmitError::NoWorkers));
        assert!(matches!(
            d.admit(key(&d, 4)).await,
            Err(AdmitError::NoWorkers)
        ));
    }

    #[tokio::test]
    async fn two_static_workers_with_one_id_are_refused() {
        let d = dispatcher(0, 4, 100);
        let mut info = WorkerInfo::new(WorkerId(1), "http://elsewhere");
        info.block_size = 4;
        let err = d.upsert_worker(info, Origin::Static, true).unwrap_err();
        assert!(err.to_string().contains("--worker-id"), "{err}");
    }

    #[tokio::test]
    async fn workers_with_another_block_size_are_refused() {
        let d = dispatcher(0, 4, 100);
        let mut info = WorkerInfo::new(WorkerId(9), "http://w9");
        info.block_size = 16;
        assert!(matches!(
            d.upsert_worker(info, Origin::Static, true),
            Err(RegistryError::BlockSizeMismatch { .. })
        ));
    }
}
