//! The gateway's shared state: the admission core ([`router::DisaggFrontend`], which owns a
//! router per pool) and the worker table, behind one mutex held only for short, non-blocking
//! sections.
//!
//! This is a thin async shell: every admission decision — route at once, queue, refuse (429
//! when the queue is full, 503 after the queue timeout or without workers), which worker, and
//! for a fleet with prefill workers whether the prompt is prefilled there or on its decode
//! worker — is the core's, the same code the simulator runs. Workers of role `both` and
//! `decode` serve in the decode pool, `prefill` workers in the prefill pool; with no prefill
//! worker every request is routed locally on the decode pool, exactly as the aggregated
//! [`router::Frontend`] routes it. The shell keeps one oneshot channel per
//! queued request, wakes it from the frontend's events, and runs one timer task
//! ([`Dispatcher::run_timers`]) that sleeps until the frontend's `poll_timeout`. The [`Ticket`]
//! a request gets holds its place in the router's accounting: dropping it (the stream ended,
//! failed, or the client went away) releases the slot and lets the queue move.
//!
//! Only routable workers (registered and healthy) are in the router; a worker that fails
//! leaves it, which also drops its blocks from the prefix index.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kv_index::{FirstWord, KvEvent, StreamSync, SyncStep, WorkerId};
use nanotime::Nanos;
use protocol::WorkerRole;
pub use router::AdmitError;
pub use router::LocalReason;
use router::{
    CacheView, DeadlineVerdict, DisaggConfig, DisaggEvent, DisaggFrontend, Ejections, PeerSnapshot,
    PeerUpdate, Pool, ReplicaId, ReplicaSync, RequestId, Route, RouteDecision, RouteError,
    RoutingKey,
};
use tokio::sync::{Notify, oneshot};
use tokio_util::sync::CancellationToken;

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
    /// When its last KV event was applied (`None`: none yet).
    last_event: Option<Instant>,
    /// Event gaps that cleared its blocks.
    resyncs: u64,
    /// Event gaps its publisher's replay filled.
    replays: u64,
    /// When it last sent output on any request ([`OutputClock`]), shared with its tickets.
    last_output: Arc<OutputClock>,
}

/// When a worker last sent output on any of its requests, in router time: set by every relay
/// reading from it without taking the dispatcher's lock, read at a request's deadline to tell
/// a busy worker from a silent one ([`router::judge_deadline`]).
#[derive(Debug, Default)]
pub struct OutputClock(AtomicU64);

impl OutputClock {
    fn set(&self, now: Nanos) {
        // 0 means "never": a reading at time 0 counts as 1 ns.
        self.0.store(now.0.max(1), Ordering::Relaxed);
    }

    fn get(&self) -> Option<Nanos> {
        match self.0.load(Ordering::Relaxed) {
            0 => None,
            t => Some(Nanos(t)),
        }
    }
}

/// Where the router's view of a worker's cache comes from: its events when it announced an
/// endpoint or registered over NATS (where it publishes them), else the router's own
/// predictions until an event arrives (a static worker's events may still come over NATS).
fn initial_cache_view(info: &WorkerInfo, origin: Origin) -> CacheView {
    match (&info.zmq, origin) {
        (Some(_), _) | (None, Origin::Dynamic { .. }) => CacheView::Events,
        (None, Origin::Static) => CacheView::Predicted,
    }
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
    /// The worker's [`OutputClock`].
    last_output: Arc<OutputClock>,
    pub decision: RouteDecision,
    /// The request waited in the frontend queue.
    pub queued: bool,
    first_token_seen: bool,
    /// The worker served the request to the end (resets its ejection count), with a reply
    /// of this many tokens.
    served: Option<u32>,
    /// A split route's prefill leg (its worker and decision), until it is done or failed.
    pub prefill: Option<(Arc<WorkerInfo>, RouteDecision)>,
    /// Why a local route prefills on its decode worker (`None` for a split route).
    pub local_reason: Option<LocalReason>,
}

impl Ticket {
    /// The worker sent output on this request (any bytes of its reply).
    pub fn output_seen(&self) {
        self.last_output.set(self.dispatcher.now());
    }

    /// The request waited `timeout` for its worker (first bytes, or the next chunk): whether
    /// the worker is silent (eject it, route again) or only busy, and then how long to wait
    /// before judging again ([`router::judge_deadline`]; `recheck` is the health-check
    /// interval).
    pub fn judge_deadline(&self, timeout: Duration, recheck: Duration) -> Option<Duration> {
        let now = self.dispatcher.now();
        let healthy = self.dispatcher.is_routable(self.worker.id);
        match router::judge_deadline(
            healthy,
            self.last_output.get(),
            now,
            timeout.into(),
            recheck.into(),
        ) {
            DeadlineVerdict::Silent => None,
            DeadlineVerdict::WaitUntil(t) => Some(Duration::from(t.saturating_sub(now))),
        }
    }

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

    /// Tokens of the longest prefix the router knew cached on any worker it could pick.
    pub fn available_cached_tokens(&self, prompt_tokens: u64) -> u64 {
        let block = self.worker.block_size as u64;
        (u64::from(self.decision.available_blocks) * block).min(prompt_tokens)
    }

    /// The worker failed while serving this request: take it out of the routing set.
    pub fn worker_failed(&self) {
        self.dispatcher.worker_failed(self.worker.id);
    }

    /// The worker served this request to the end, with a reply of `output_tokens` tokens.
    pub fn served(&mut self, output_tokens: u64) {
        self.served = Some(u32::try_from(output_tokens).unwrap_or(u32::MAX));
    }

    /// The prefill leg succeeded: its slot is free and the decode worker has no prefill of
    /// its own to do.
    pub fn prefill_done(&mut self) {
        if self.prefill.take().is_some() {
            // The core counts the decode worker's first token with the hand-off.
            self.first_token_seen = true;
            self.dispatcher.prefill_done(self.id);
        }
    }

    /// The prefill leg failed: the core re-issues the request as a local prefill on its
    /// decode worker (this ticket now says so).
    pub fn prefill_failed(&mut self) {
        if self.prefill.take().is_some() {
            if let Some(Ok(local)) = self.dispatcher.prefill_failed(self.id) {
                self.worker = local.worker;
                self.decision = local.decision;
                self.local_reason = local.reason;
            } else {
                self.local_reason = Some(LocalReason::PrefillFailed);
            }
        }
    }

    /// Whether the fleet is disaggregated (some worker declared a prefill or decode role).
    pub fn fleet_disaggregated(&self) -> bool {
        self.dispatcher.is_disaggregated()
    }

    /// The route's labels: `split` with reason `remote_prefill`, or `local` with its reason.
    pub fn route_labels(&self) -> (&'static str, &'static str) {
        match &self.local_reason {
            None => ("split", "remote_prefill"),
            Some(LocalReason::ShortPrefill) => ("local", "short_prefill"),
            Some(LocalReason::PrefillUnavailable(_)) => ("local", "prefill_unavailable"),
            Some(LocalReason::PrefillFailed) => ("local", "prefill_failed"),
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let served = self.served.map(|tokens| (self.worker.id, tokens));
        self.dispatcher.finish(self.id, served);
    }
}

/// A route, resolved to the workers' descriptions.
#[derive(Debug)]
struct Assigned {
    worker: Arc<WorkerInfo>,
    last_output: Arc<OutputClock>,
    decision: RouteDecision,
    prefill: Option<(Arc<WorkerInfo>, RouteDecision)>,
    reason: Option<LocalReason>,
}

type Assignment = Result<Assigned, AdmitError>;

/// The pool a worker of `role` serves in.
pub fn pool_of(role: WorkerRole) -> Pool {
    match role {
        WorkerRole::Prefill => Pool::Prefill,
        WorkerRole::Both | WorkerRole::Decode => Pool::Decode,
    }
}

#[derive(Debug)]
struct Core {
    frontend: DisaggFrontend,
    workers: BTreeMap<WorkerId, WorkerEntry>,
    /// The channels of queued requests, woken from the frontend's events; bounded by its
    /// queue capacity.
    waiters: HashMap<RequestId, oneshot::Sender<Assignment>>,
    /// Failed workers and until when each stays out, whatever its health checks say.
    ejections: Ejections,
    /// The deadline the timer task sleeps toward; a call that makes the frontend's next
    /// timeout earlier wakes it.
    timer_at: Option<Nanos>,
    /// Replica sync with peer gateways, when on.
    replica: Option<ReplicaCore>,
    /// Per event source, when to ask a worker for its cache snapshot and what its events do
    /// meanwhile (the simulator's gateways decide with the same core).
    streams: [StreamSync; EventSource::ALL.len()],
}

/// This replica's side of the replica sync ([`crate::replicas`]).
#[derive(Debug)]
struct ReplicaCore {
    sync: ReplicaSync,
    /// Keys of submitted requests until they are routed (the update that says where one went
    /// carries it); bounded by the frontend's queue plus the admissions in progress.
    keys: HashMap<RequestId, RoutingKey>,
    /// To the publisher task; bounded: when full, the update is dropped and counted, and
    /// peers see the gap in this replica's next header and fetch a snapshot.
    outbox: tokio::sync::mpsc::Sender<PeerUpdate>,
    /// Wakes the task that fetches the peers' snapshots again: updates were lost, or a
    /// worker joined (a peer's requests on a worker this replica did not know yet were
    /// refused).
    resync: Arc<Notify>,
}

/// A peer's message, decoded ([`Dispatcher::apply_peer_batch`]).
#[derive(Debug)]
pub(crate) struct PeerBatch {
    pub replica: ReplicaId,
    pub epoch: u64,
    pub next_seq: u64,
    pub goodbye: bool,
    pub updates: Vec<PeerUpdate>,
}

/// What the replica sync looks like at scrape time.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReplicaStatus {
    pub id: u32,
    pub peers: usize,
    pub peer_requests: usize,
    pub counters: router::replica::ReplicaSyncCounters,
}

/// The replica transport's own counts, updated without the core lock.
#[derive(Debug, Default)]
pub(crate) struct ReplicaStats {
    /// Updates dropped because the publisher's queue was full.
    pub outbox_full: AtomicU64,
    pub messages_sent: AtomicU64,
    pub messages_received: AtomicU64,
    /// Messages refused: undecodable, oversize, or a snapshot part out of order.
    pub messages_refused: AtomicU64,
    pub snapshots_served: AtomicU64,
}

/// Event ingestion counters, updated without the core lock.
#[derive(Debug, Default)]
struct EventStats {
    received: [AtomicU64; 3],
    decode_errors: [AtomicU64; 3],
    resyncs: [AtomicU64; 3],
    replays: [AtomicU64; 3],
    dropped: [AtomicU64; 3],
}

/// Shared state of one gateway. See the module docs.
#[derive(Debug)]
pub struct Dispatcher {
    core: Mutex<Core>,
    epoch: Instant,
    next_request: AtomicU64,
    hasher: kv_index::BlockHasher,
    /// Wakes the timer task ([`Dispatcher::run_timers`]) when the next timeout moved earlier.
    timer: Notify,
    max_workers: usize,
    kv_events: bool,
    /// Some known worker takes text prompts (so chat requests also render the text).
    text_workers: std::sync::atomic::AtomicBool,
    /// Some worker ever declared a prefill or decode role (the fleet is disaggregated).
    disaggregated: std::sync::atomic::AtomicBool,
    /// Longest wait for a prefill leg's answer.
    prefill_timeout: Duration,
    events: EventStats,
    metrics: std::sync::OnceLock<Arc<Metrics>>,
    pub(crate) replica_stats: ReplicaStats,
}

/// Most batches held per worker while its snapshot comes; past this the wait ends.
const MAX_HELD_BATCHES: usize = 1_024;

/// A gap in a worker's own sequence numbers: its blocks were cleared (one line per gap, as a
/// gap is a lost message, not a flood of bad ones).
fn warn_gap(source: EventSource, worker: WorkerId, step: &SyncStep) {
    if step.resynced > 0 {
        tracing::warn!(%worker, ?source, "KV event gap; cleared the worker's blocks");
    }
}

fn lock(core: &Mutex<Core>) -> MutexGuard<'_, Core> {
    // A panic while holding the lock leaves plain data behind; keep serving.
    core.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Dispatcher {
    /// State for a gateway configured by `config`. Spawn [`run_timers`](Dispatcher::run_timers)
    /// beside it, or queued requests never time out.
    pub fn new(config: &GatewayConfig) -> Result<Arc<Dispatcher>, router::RouterConfigError> {
        let frontend = DisaggFrontend::new(
            config.router.clone(),
            DisaggConfig {
                frontend: config.frontend,
                local_prefill_max_tokens: config.local_prefill_max_tokens,
            },
        )?;
        let hasher = *frontend.pool(Pool::Decode).router().hasher();
        Ok(Arc::new(Dispatcher {
            core: Mutex::new(Core {
                frontend,
                workers: BTreeMap::new(),
                waiters: HashMap::new(),
                ejections: Ejections::new(config.ejection, config.max_workers.max(1)),
                timer_at: None,
                replica: None,
                streams: std::array::from_fn(|_| {
                    StreamSync::new(config.max_workers.max(1), MAX_HELD_BATCHES, FirstWord::Ask)
                }),
            }),
            epoch: Instant::now(),
            next_request: AtomicU64::new(1),
            hasher,
            timer: Notify::new(),
            max_workers: config.max_workers.max(1),
            kv_events: config.kv_events(),
            text_workers: std::sync::atomic::AtomicBool::new(false),
            disaggregated: std::sync::atomic::AtomicBool::new(false),
            prefill_timeout: config.prefill_timeout,
            events: EventStats::default(),
            metrics: std::sync::OnceLock::new(),
            replica_stats: ReplicaStats::default(),
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
            let now = self.now();
            if let Some(replica) = core.replica.as_mut() {
                replica.keys.insert(id, key.clone());
            }
            core.frontend.submit(id, key, now);
            if let Some(outcome) = self.deliver(&mut core, Some(id)) {
                return Ok(self.ticket(id, outcome?, false));
            }
            let (tx, rx) = oneshot::channel();
            core.waiters.insert(id, tx);
            rx
        };
        // Leaves the queue if the caller is dropped (client gone) while waiting.
        let mut waiting = Waiting {
            dispatcher: self,
            id,
            rx,
            done: false,
        };
        let outcome = (&mut waiting.rx).await;
        waiting.done = true;
        let assigned = outcome.unwrap_or(Err(AdmitError::ShuttingDown))?;
        Ok(self.ticket(id, assigned, true))
    }

    fn ticket(self: &Arc<Self>, id: RequestId, assigned: Assigned, queued: bool) -> Ticket {
        Ticket {
            dispatcher: self.clone(),
            id,
            worker: assigned.worker,
            last_output: assigned.last_output,
            decision: assigned.decision,
            queued,
            first_token_seen: false,
            served: None,
            prefill: assigned.prefill,
            local_reason: assigned.reason,
        }
    }

    /// Whether some worker ever declared a prefill or decode role.
    pub fn is_disaggregated(&self) -> bool {
        self.disaggregated.load(Ordering::Relaxed)
    }

    /// Longest wait for a prefill leg's answer.
    pub fn prefill_timeout(&self) -> Duration {
        self.prefill_timeout
    }

    /// Resolves a route to the workers' descriptions.
    fn resolve(&self, core: &mut Core, id: RequestId, route: Route) -> Assignment {
        let decode = *route.decode();
        let prefill = match &route {
            Route::Split { prefill, .. } => Some(*prefill),
            Route::Local { .. } => None,
        };
        let worker = core
            .workers
            .get(&decode.worker)
            .map(|w| (w.info.clone(), w.last_output.clone()));
        let prefill_worker =
            prefill.and_then(|p| core.workers.get(&p.worker).map(|w| w.info.clone()));
        match (worker, route) {
            (Some((worker, last_output)), Route::Local { decode, reason }) => Ok(Assigned {
                worker,
                last_output,
                decision: decode,
                prefill: None,
                reason: Some(reason),
            }),
            (Some((worker, last_output)), Route::Split { prefill, decode })
                if prefill_worker.is_some() =>
            {
                Ok(Assigned {
                    worker,
                    last_output,
                    decision: decode,
                    prefill: prefill_worker.map(|w| (w, prefill)),
                    reason: None,
                })
            }
            _ => {
                // In the router but not in the table (cannot happen): release.
                core.frontend.on_finished(id, self.now());
                Err(AdmitError::NoWorkers)
            }
        }
    }

    /// Hands the frontend's outcomes to their waiters and returns `mine`'s, if it has one.
    /// Every call that changes the frontend ends here, under the same lock, so an outcome
    /// never waits for a channel that is not there yet.
    fn deliver(&self, core: &mut Core, mine: Option<RequestId>) -> Option<Assignment> {
        let mut own = None;
        while let Some(event) = core.frontend.poll_event() {
            let id = event.id();
            let outcome = match event {
                DisaggEvent::Assigned { route, .. } => {
                    let worker = route.decode().worker;
                    let outcome = self.resolve(core, id, route);
                    self.tell_peers_routed(core, id, worker, outcome.is_ok());
                    outcome
                }
                DisaggEvent::Refused { error, .. } => {
                    if let Some(replica) = core.replica.as_mut() {
                        replica.keys.remove(&id);
                    }
                    Err(error)
                }
            };
            if Some(id) == mine {
                own = Some(outcome);
                continue;
            }
            let routed = outcome.is_ok();
            let delivered = match core.waiters.remove(&id) {
                Some(tx) => tx.send(outcome).is_ok(),
                None => false,
            };
            if routed && !delivered {
                // The waiter left between its event and now: release the slot it got.
                self.release(core, id);
            }
        }
        self.set_queued(core.frontend.queued());
        let next = core.frontend.poll_timeout();
        if next.is_some_and(|t| core.timer_at.is_none_or(|armed| t < armed)) {
            core.timer_at = next;
            self.timer.notify_one();
        }
        own
    }

    /// Drives the frontend's timeouts (queue deadlines, approximate-mode expiry): sleeps until
    /// its `poll_timeout`, or until a call makes that earlier, until `cancel`.
    pub async fn run_timers(self: Arc<Self>, cancel: CancellationToken) {
        loop {
            let next = {
                let mut core = lock(&self.core);
                let next = core.frontend.poll_timeout();
                core.timer_at = next;
                next
            };
            let deadline = next.map(|t| {
                let at = self.epoch.checked_add(Duration::from(t));
                // Beyond what the clock can express: as good as never.
                at.unwrap_or_else(|| Instant::now() + Duration::from_secs(86_400 * 365))
            });
            tokio::select! {
                () = cancel.cancelled() => return,
                () = self.timer.notified() => {}
                () = sleep_until(deadline) => {
                    let mut core = lock(&self.core);
                    core.frontend.handle_timeout(self.now());
                    self.deliver(&mut core, None);
                }
            }
        }
    }

    fn first_token(&self, id: RequestId) {
        let now = self.now();
        let mut core = lock(&self.core);
        core.frontend.on_first_token(id, now);
        self.tell_peers(&mut core, id, ReplicaSync::first_token);
    }

    fn prefill_done(&self, id: RequestId) {
        let now = self.now();
        let mut core = lock(&self.core);
        core.frontend.on_prefill_done(id, now);
        // The core counts the decode worker's first token with the hand-off.
        self.tell_peers(&mut core, id, ReplicaSync::first_token);
        self.deliver(&mut core, None);
    }

    /// Releases a routed request's slots, and tells the peers it ended.
    fn release(&self, core: &mut Core, id: RequestId) {
        core.frontend.on_finished(id, self.now());
        self.tell_peers(core, id, ReplicaSync::finished);
    }

    /// Tells the peers about `id` (when it is one this replica told them it routed).
    fn tell_peers(
        &self,
        core: &mut Core,
        id: RequestId,
        change: fn(&mut ReplicaSync, RequestId) -> PeerUpdate,
    ) {
        if let Some(replica) = core.replica.as_mut()
            && replica.sync.is_own(id)
        {
            let update = change(&mut replica.sync, id);
            self.send_to_peers(replica, update);
        }
    }

    /// A request was assigned (`ok`) or failed to resolve: tell the peers where it went.
    fn tell_peers_routed(&self, core: &mut Core, id: RequestId, worker: WorkerId, ok: bool) {
        let Some(replica) = core.replica.as_mut() else {
            return;
        };
        // A re-issued route (a failed prefill leg) keeps its worker: the key is gone by then.
        if let Some(key) = replica.keys.remove(&id)
            && ok
        {
            let update = replica.sync.routed(id, worker, &key);
            self.send_to_peers(replica, update);
        }
    }

    fn send_to_peers(&self, replica: &ReplicaCore, update: PeerUpdate) {
        if replica.outbox.try_send(update).is_err() {
            self.replica_stats
                .outbox_full
                .fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Turns replica sync on: this gateway's decisions go to `outbox`, and its peers'
    /// updates count in its load accounting.
    pub(crate) fn enable_replica_sync(
        &self,
        sync: ReplicaSync,
        outbox: tokio::sync::mpsc::Sender<PeerUpdate>,
        resync: Arc<Notify>,
    ) {
        lock(&self.core).replica = Some(ReplicaCore {
            sync,
            keys: HashMap::new(),
            outbox,
            resync,
        });
    }

    fn resync_replicas(core: &Core) {
        if let Some(replica) = &core.replica {
            replica.resync.notify_one();
        }
    }

    /// Applies a peer's message (its updates, then its header); when it shows updates lost,
    /// the peers' snapshots are fetched again.
    pub(crate) fn apply_peer_batch(&self, batch: PeerBatch) {
        let now = self.now();
        let mut guard = lock(&self.core);
        let core = &mut *guard;
        let Some(replica) = core.replica.as_mut() else {
            return;
        };
        let sync = &mut replica.sync;
        core.frontend.with_decode_pool(now, |frontend| {
            for update in batch.updates {
                sync.apply(update, frontend, now);
            }
            sync.heard_from(batch.replica, batch.epoch, batch.next_seq, frontend, now);
            if batch.goodbye && batch.replica != sync.id() {
                tracing::info!(replica = batch.replica.0, "peer replica said goodbye");
                sync.forget_peer(batch.replica, frontend, now);
            }
        });
        if sync.take_resync_wanted() {
            replica.resync.notify_one();
        }
        self.deliver(&mut guard, None);
    }

    /// This replica's in-flight requests, for a peer that asks.
    pub(crate) fn replica_snapshot(&self) -> Option<PeerSnapshot> {
        lock(&self.core).replica.as_ref().map(|r| r.sync.snapshot())
    }

    /// Starts holding peers' updates until their snapshots arrive.
    pub(crate) fn await_peer_snapshots(&self) {
        if let Some(replica) = lock(&self.core).replica.as_mut() {
            replica.sync.await_snapshots();
        }
    }

    pub(crate) fn apply_peer_snapshot(&self, snapshot: PeerSnapshot) {
        self.with_sync(|sync, frontend, now| sync.apply_snapshot(snapshot, frontend, now));
    }

    pub(crate) fn end_snapshot_wait(&self) {
        self.with_sync(|sync, frontend, now| sync.end_snapshot_wait(frontend, now));
    }

    /// Forgets peers silent for longer than `lease`; returns them.
    pub(crate) fn expire_peers(&self, lease: Duration) -> Vec<ReplicaId> {
        self.with_sync(|sync, frontend, now| sync.expire_peers(now, lease.into(), frontend))
            .unwrap_or_default()
    }

    fn with_sync<R>(
        &self,
        f: impl FnOnce(&mut ReplicaSync, &mut router::Frontend, Nanos) -> R,
    ) -> Option<R> {
        let now = self.now();
        let mut guard = lock(&self.core);
        let core = &mut *guard;
        let replica = core.replica.as_mut()?;
        let sync = &mut replica.sync;
        let result = core
            .frontend
            .with_decode_pool(now, |frontend| f(sync, frontend, now));
        self.deliver(&mut guard, None);
        Some(result)
    }

    /// The replica sync's state, when on.
    pub fn replica_status(&self) -> Option<ReplicaStatus> {
        lock(&self.core).replica.as_ref().map(|r| ReplicaStatus {
            id: r.sync.id().0,
            peers: r.sync.peers(),
            peer_requests: r.sync.peer_requests(),
            counters: r.sync.counters(),
        })
    }

    /// Reports a failed prefill leg; the core's local re-issue of the request.
    fn prefill_failed(&self, id: RequestId) -> Option<Assignment> {
        let now = self.now();
        let mut core = lock(&self.core);
        core.frontend.on_prefill_failed(id, now);
        self.deliver(&mut core, Some(id))
    }

    /// The request ended; `served`: its worker served it to the end with a reply of so many
    /// tokens.
    fn finish(&self, id: RequestId, served: Option<(WorkerId, u32)>) {
        let now = self.now();
        let mut core = lock(&self.core);
        if let Some((worker, reply_tokens)) = served {
            core.ejections.succeeded(worker, now);
            core.frontend.on_reply(reply_tokens);
        }
        self.release(&mut core, id);
        self.deliver(&mut core, None);
    }

    /// Takes a worker out of the routing set after a failure, for at least the ejection
    /// time (then health checks bring a static worker back; a dynamic one must announce
    /// itself again).
    pub fn worker_failed(&self, worker: WorkerId) {
        let mut core = lock(&self.core);
        if !core.workers.contains_key(&worker) {
            return;
        }
        let now = self.now();
        let until = core.ejections.eject(worker, now);
        tracing::warn!(%worker, for_s = (until - now).as_secs_f64(), "worker ejected");
        let Some(entry) = core.workers.get_mut(&worker) else {
            return;
        };
        match entry.origin {
            Origin::Static => {
                if entry.routable {
                    entry.routable = false;
                    core.frontend.remove_worker(worker, self.now());
                    tracing::warn!(%worker, "worker failed; out of the routing set until healthy");
                }
            }
            Origin::Dynamic { .. } => {
                core.workers.remove(&worker);
                core.frontend.remove_worker(worker, self.now());
                tracing::warn!(%worker, "dynamic worker failed; removed until it announces again");
            }
        }
        self.deliver(&mut core, None);
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
        if info.role != WorkerRole::Both {
            self.disaggregated.store(true, Ordering::Relaxed);
        }
        let pool = pool_of(info.role);
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
        let (last_event, resyncs, replays, last_output) = core
            .workers
            .get(&id)
            .map_or((None, 0, 0, Arc::default()), |w| {
                (w.last_event, w.resyncs, w.replays, w.last_output.clone())
            });
        let view = initial_cache_view(&info, origin);
        // An ejected worker stays out until its ejection is over, healthy or not.
        let routable = routable && core.ejections.may_return(id, self.now());
        core.workers.insert(
            id,
            WorkerEntry {
                info: Arc::new(info),
                origin,
                routable,
                last_event,
                resyncs,
                replays,
                last_output,
            },
        );
        if routable {
            if let Err(e) = core.frontend.add_worker(id, pool, limits, self.now()) {
                if let Some(entry) = core.workers.get_mut(&id) {
                    entry.routable = false;
                }
                self.deliver(&mut core, None);
                return Err(RegistryError::Router(e));
            }
            // Only when it enters the router: a later description must not undo the switch
            // its first event made.
            if !was_routable && self.kv_events {
                core.frontend.set_cache_view(id, view);
            }
            if !was_routable {
                Self::resync_replicas(&core);
            }
        } else if was_routable {
            core.frontend.remove_worker(id, self.now());
        }
        self.deliver(&mut core, None);
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
        if routable && !core.ejections.may_return(worker, self.now()) {
            return;
        }
        let Some(entry) = core.workers.get_mut(&worker) else {
            return;
        };
        entry.routable = routable;
        let limits = entry.info.limits;
        let pool = pool_of(entry.info.role);
        let view = initial_cache_view(&entry.info, entry.origin);
        if routable {
            if core
                .frontend
                .add_worker(worker, pool, limits, self.now())
                .is_err()
            {
                if let Some(entry) = core.workers.get_mut(&worker) {
                    entry.routable = false;
                }
            } else {
                if self.kv_events {
                    core.frontend.set_cache_view(worker, view);
                }
                Self::resync_replicas(&core);
                // At the level of the warning that took it out, so that a log read at the
                // default level (warn) shows the worker come back too.
                tracing::warn!(%worker, "worker healthy; back in the routing set");
            }
        } else {
            core.frontend.remove_worker(worker, self.now());
            tracing::warn!(%worker, "worker unhealthy; out of the routing set");
        }
        self.deliver(&mut core, None);
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

    /// Whether `worker` is in the routing set (known, healthy and not ejected).
    pub fn is_routable(&self, worker: WorkerId) -> bool {
        lock(&self.core)
            .workers
            .get(&worker)
            .is_some_and(|w| w.routable)
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
            core.frontend.remove_worker(worker, self.now());
            self.deliver(&mut core, None);
        }
        known
    }

    /// Starts draining a routable worker (scaling its pool down): it gets no new request,
    /// those it serves finish; [`take_drained`](Self::take_drained) names it once idle.
    /// `false` for a worker the router does not know.
    pub fn drain_worker(&self, worker: WorkerId) -> bool {
        let mut core = lock(&self.core);
        let now = self.now();
        let known = core.frontend.drain_worker(worker, now);
        self.deliver(&mut core, None);
        known
    }

    /// Draining workers whose last request has finished, oldest first (each named once).
    pub fn take_drained(&self) -> Vec<WorkerId> {
        let mut core = lock(&self.core);
        std::iter::from_fn(|| core.frontend.take_drained()).collect()
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
            core.frontend.remove_worker(*id, self.now());
            tracing::warn!(worker = %id, "worker lease expired; removed");
        }
        if !expired.is_empty() {
            self.deliver(&mut core, None);
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
        let core = lock(&self.core);
        let mut ids: Vec<WorkerId> = [Pool::Decode, Pool::Prefill]
            .into_iter()
            .flat_map(|pool| {
                core.frontend
                    .pool(pool)
                    .router()
                    .workers()
                    .map(|(id, _)| id)
            })
            .collect();
        ids.sort_unstable();
        ids
    }

    /// Routable workers of the decode pool (every worker of an aggregated fleet).
    pub fn routable_decode_workers(&self) -> usize {
        lock(&self.core)
            .frontend
            .pool(Pool::Decode)
            .router()
            .workers()
            .count()
    }

    /// Applies KV events from `source`. A sequence gap clears that worker's blocks and
    /// re-applies the event as a new baseline, so the index never keeps a state it cannot
    /// vouch for; the resync is counted. In approximate mode workers' events are ignored (the
    /// router predicts caches itself). Returns whether a gap cleared a worker's blocks.
    pub fn apply_events(&self, source: EventSource, events: &[KvEvent]) -> bool {
        let s = source as usize;
        self.events.received[s].fetch_add(events.len() as u64, Ordering::Relaxed);
        if !self.kv_events || events.is_empty() {
            return false;
        }
        let mut any_resync = false;
        let mut core = lock(&self.core);
        let now = Instant::now();
        for event in events {
            // The gap policy is the index's (`KvIndex::apply_resyncing`), shared with the
            // simulator: a gap clears the worker's blocks and re-baselines on this event.
            let outcome = core.frontend.apply_event_resyncing(event);
            let resynced = matches!(outcome, Ok(o) if o.resynced);
            any_resync |= resynced;
            if let Some(w) = core.workers.get_mut(&event.worker) {
                w.last_event = Some(now);
                w.resyncs += u64::from(resynced);
            }
            match outcome {
                Ok(_) if resynced => {
                    tracing::warn!(worker = %event.worker, seq = event.seq, ?source, "KV event gap; cleared the worker's blocks and resynced");
                    self.events.resyncs[s].fetch_add(1, Ordering::Relaxed);
                }
                Ok(_) => {}
                Err(e) => tracing::debug!(error = %e, "KV event not applied"),
            }
        }
        any_resync
    }

    /// One batch of `worker`'s events from run `instance`, through `source`'s
    /// [`StreamSync`]: applied, or held while the worker's snapshot is asked for. Returns
    /// whether to ask the worker for its snapshot now (and answer with
    /// [`stream_snapshot`](Self::stream_snapshot)). In approximate mode nothing is asked.
    pub fn stream_events(
        &self,
        source: EventSource,
        worker: WorkerId,
        instance: u64,
        events: &[KvEvent],
    ) -> bool {
        self.events.received[source as usize].fetch_add(events.len() as u64, Ordering::Relaxed);
        if !self.kv_events {
            return false;
        }
        let mut core = lock(&self.core);
        let core = &mut *core;
        let step =
            core.streams[source as usize].on_events(&mut core.frontend, worker, instance, events);
        warn_gap(source, worker, &step);
        self.record_step(core, source, worker, &step)
    }

    /// `source` heard of `worker` before any event from it (an announcement). Returns whether
    /// to ask it for its snapshot.
    pub fn stream_heard(&self, source: EventSource, worker: WorkerId) -> bool {
        self.kv_events && lock(&self.core).streams[source as usize].heard(worker).ask
    }

    /// `source` announced that `worker` now runs `instance` (a restart): its blocks are
    /// dropped now, once; the new run's first batch does not drop (or count) them again.
    pub fn stream_restarted(&self, source: EventSource, worker: WorkerId, instance: u64) {
        if !self.kv_events {
            self.resync_worker(source, worker);
            return;
        }
        let mut core = lock(&self.core);
        let core = &mut *core;
        let step = core.streams[source as usize].restarted(&mut core.frontend, worker, instance);
        self.record_step(core, source, worker, &step);
    }

    /// `worker` said goodbye: if it comes back, its snapshot is asked for again.
    pub fn stream_forget(&self, source: EventSource, worker: WorkerId) {
        lock(&self.core).streams[source as usize].forget(worker);
    }

    /// `worker`'s stream lost messages its sequence numbers cannot show (an undecodable
    /// batch): its blocks are dropped. Returns whether to ask it for its snapshot.
    pub fn stream_lost(&self, source: EventSource, worker: WorkerId) -> bool {
        if !self.kv_events {
            self.resync_worker(source, worker);
            return false;
        }
        let mut core = lock(&self.core);
        let core = &mut *core;
        let step = core.streams[source as usize].on_lost(&mut core.frontend, worker);
        self.record_step(core, source, worker, &step)
    }

    /// The answer to an ask: `worker`'s snapshot, or `None` when it has none to give. Returns
    /// whether to ask again (events were lost after the snapshot too).
    pub fn stream_snapshot(
        &self,
        source: EventSource,
        worker: WorkerId,
        state: Option<&protocol::KvState>,
    ) -> bool {
        let mut core = lock(&self.core);
        let core = &mut *core;
        let snapshot = state.map(|s| kv_index::Snapshot {
            instance: s.instance,
            next_seq: s.next_seq,
            stored: &s.stored,
        });
        let step = core.streams[source as usize].on_snapshot(&mut core.frontend, worker, snapshot);
        warn_gap(source, worker, &step);
        self.record_step(core, source, worker, &step)
    }

    /// Counts and logs what one [`StreamSync`] step did (a lost batch's clear is logged by
    /// its caller, within its warning budget); returns whether it asks.
    fn record_step(
        &self,
        core: &mut Core,
        source: EventSource,
        worker: WorkerId,
        step: &SyncStep,
    ) -> bool {
        let s = source as usize;
        if step.restarted {
            tracing::info!(%worker, ?source, "worker restarted (new instance); cleared its blocks");
        }
        if step.gave_up {
            tracing::info!(%worker, ?source, "the worker's cache snapshot is too slow to come; its blocks are learnt from its events");
        }
        if let Some(blocks) = step.restored {
            tracing::info!(%worker, ?source, blocks, "learnt the worker's cache from its snapshot");
            self.events.replays[s].fetch_add(1, Ordering::Relaxed);
        }
        if step.stale + step.errors > 0 {
            tracing::debug!(%worker, stale = step.stale, errors = step.errors, "KV events not applied");
        }
        let resyncs = u64::from(step.resynced) + u64::from(step.restarted);
        self.events.resyncs[s].fetch_add(resyncs, Ordering::Relaxed);
        if let Some(w) = core.workers.get_mut(&worker) {
            w.resyncs += resyncs;
            w.replays += u64::from(step.restored.is_some());
            if step.applied > 0 || step.restored.is_some() {
                w.last_event = Some(Instant::now());
            }
        }
        step.ask
    }

    /// A worker's event stream lost messages at the transport level (e.g. a ZMQ batch
    /// sequence gap): drop its blocks and count a resync.
    pub fn resync_worker(&self, source: EventSource, worker: WorkerId) {
        self.events.resyncs[source as usize].fetch_add(1, Ordering::Relaxed);
        let mut core = lock(&self.core);
        if let Some(w) = core.workers.get_mut(&worker) {
            w.resyncs += 1;
        }
        if self.kv_events {
            core.frontend.clear_worker(worker);
        }
    }

    /// A gap in a worker's event stream was filled by its publisher's replay: nothing cleared.
    pub fn count_replay(&self, source: EventSource, worker: WorkerId) {
        self.events.replays[source as usize].fetch_add(1, Ordering::Relaxed);
        if let Some(w) = lock(&self.core).workers.get_mut(&worker) {
            w.replays += 1;
        }
    }

    pub fn count_decode_error(&self, source: EventSource) {
        self.events.decode_errors[source as usize].fetch_add(1, Ordering::Relaxed);
    }

    pub fn count_dropped(&self, source: EventSource, n: u64) {
        self.events.dropped[source as usize].fetch_add(n, Ordering::Relaxed);
    }

    /// How many leading blocks of a prompt each worker holds, as the index knows it.
    /// (The decode pool's: every worker of an aggregated fleet.)
    pub fn overlaps(&self, key: &RoutingKey) -> kv_index::OverlapScores {
        lock(&self.core)
            .frontend
            .pool(Pool::Decode)
            .router()
            .overlaps(key)
    }

    /// Blocks the index holds for `worker` (for tests and diagnostics).
    pub fn cached_blocks(&self, worker: WorkerId) -> usize {
        let core = lock(&self.core);
        let pool = core.frontend.pool_of(worker).unwrap_or(Pool::Decode);
        core.frontend.pool(pool).router().index().blocks_of(worker)
    }

    /// Stops admitting requests and fails every queued one.
    pub fn shut_down(&self) {
        let mut core = lock(&self.core);
        core.frontend.shut_down();
        self.deliver(&mut core, None);
    }

    /// Router, index, worker and event state for metrics.
    pub fn snapshot(&self) -> RouterSnapshot {
        let core = lock(&self.core);
        let router = core.frontend.pool(Pool::Decode).router();
        let prefill = core.frontend.pool(Pool::Prefill).router();
        let index = router.index();
        let loads: BTreeMap<WorkerId, router::WorkerLoad> =
            router.workers().chain(prefill.workers()).collect();
        let workers = core
            .workers
            .values()
            .map(|w| {
                let load = loads.get(&w.info.id).copied().unwrap_or_default();
                let index = match pool_of(w.info.role) {
                    Pool::Prefill => prefill.index(),
                    Pool::Decode => index,
                };
                WorkerSnapshot {
                    role: w.info.role.as_str(),
                    id: w.info.id.0,
                    url: w.info.url.clone(),
                    routable: w.routable,
                    in_flight: load.in_flight,
                    pending_prefill_tokens: load.pending_prefill_tokens,
                    awaiting_first_token: load.awaiting_first_token,
                    active_blocks: load.active_blocks,
                    cached_blocks: index.blocks_of(w.info.id),
                    cache_view: core.frontend.cache_view(w.info.id),
                    event_age: w.last_event.map(|t| t.elapsed()),
                    resyncs: w.resyncs,
                    replays: w.replays,
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
            policy: router.policy_name(),
            counters: router.counters(),
            index: index.counters(),
            index_entries: index.len() + prefill.index().len(),
            index_distinct_blocks: index.distinct_blocks() + prefill.index().distinct_blocks(),
            workers,
            events: EventCounters {
                received: read(&self.events.received),
                decode_errors: read(&self.events.decode_errors),
                resyncs: read(&self.events.resyncs),
                replays: read(&self.events.replays),
                dropped: read(&self.events.dropped),
            },
            replica: core.replica.as_ref().map(|r| {
                let stats = &self.replica_stats;
                crate::metrics::ReplicaMetrics {
                    status: ReplicaStatus {
                        id: r.sync.id().0,
                        peers: r.sync.peers(),
                        peer_requests: r.sync.peer_requests(),
                        counters: r.sync.counters(),
                    },
                    outbox_full: stats.outbox_full.load(Ordering::Relaxed),
                    messages_sent: stats.messages_sent.load(Ordering::Relaxed),
                    messages_received: stats.messages_received.load(Ordering::Relaxed),
                    messages_refused: stats.messages_refused.load(Ordering::Relaxed),
                    snapshots_served: stats.snapshots_served.load(Ordering::Relaxed),
                }
            }),
        }
    }
}

/// A queued request's wait; dropped before its outcome arrives (the client went away), it
/// takes the request out of the queue, or releases the slot it was just given.
struct Waiting<'a> {
    dispatcher: &'a Arc<Dispatcher>,
    id: RequestId,
    rx: oneshot::Receiver<Assignment>,
    done: bool,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let d = self.dispatcher;
        let mut core = lock(&d.core);
        if core.frontend.cancel(self.id, d.now()) {
            core.waiters.remove(&self.id);
            if let Some(replica) = core.replica.as_mut() {
                replica.keys.remove(&self.id);
            }
        } else if let Ok(Ok(_)) = self.rx.try_recv() {
            // Outcomes are sent under the lock: not queued means it is already here.
            d.release(&mut core, self.id);
        }
        d.deliver(&mut core, None);
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dispatcher(cap: u32, queue: usize, timeout_ms: u64) -> Arc<Dispatcher> {
        let config = GatewayConfig {
            frontend: router::FrontendConfig {
                max_in_flight_per_worker: std::num::NonZeroU32::new(cap),
                queue_capacity: queue,
                queue_timeout: Some(Nanos::from_millis(timeout_ms)),
            },
            router: router::RouterConfig {
                policy: router::PolicyKind::Kv,
                block_size: 4,
                ..Default::default()
            },
            ..GatewayConfig::default()
        };
        let d = Dispatcher::new(&config).unwrap();
        tokio::spawn(d.clone().run_timers(CancellationToken::new()));
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

    /// A dispatcher whose two workers (cap 1) are both busy, with the tickets that hold them.
    async fn busy(queue: usize, timeout_ms: u64) -> (Arc<Dispatcher>, Ticket, Ticket) {
        let d = dispatcher(1, queue, timeout_ms);
        let a = d.admit(key(&d, 1)).await.unwrap();
        let b = d.admit(key(&d, 2)).await.unwrap();
        (d, a, b)
    }

    fn in_flight(d: &Dispatcher) -> u32 {
        d.snapshot().workers.iter().map(|w| w.in_flight).sum()
    }

    /// Starts a request that has to wait, and returns once it is in the queue.
    async fn spawn_waiter(
        d: &Arc<Dispatcher>,
        n: u32,
    ) -> tokio::task::JoinHandle<Result<(), AdmitError>> {
        let queued = lock(&d.core).frontend.queued();
        let waiter = tokio::spawn({
            let d = d.clone();
            async move { d.admit(key(&d, n)).await.map(|_| ()) }
        });
        while lock(&d.core).frontend.queued() == queued {
            tokio::task::yield_now().await;
        }
        waiter
    }

    #[tokio::test]
    async fn waiters_are_served_in_arrival_order_and_a_full_queue_refuses() {
        let (d, a, b) = busy(3, 5_000).await;
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
            while lock(&d.core).frontend.queued() < (n + 1) as usize {
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
        assert_eq!(in_flight(&d), 0);
    }

    #[tokio::test]
    async fn a_waiter_times_out_and_a_cancelled_one_leaves_no_slot_behind() {
        let (d, _a, _b) = busy(4, 50).await;
        assert!(matches!(
            d.admit(key(&d, 3)).await,
            Err(AdmitError::QueueTimeout { .. })
        ));
        assert_eq!(lock(&d.core).frontend.queued(), 0);
        // A waiter dropped while queued (client gone) leaves the queue.
        let pending = spawn_waiter(&d, 4).await;
        pending.abort();
        let _ = pending.await;
        assert_eq!(lock(&d.core).frontend.queued(), 0);
        assert_eq!(lock(&d.core).waiters.len(), 0, "its channel is gone too");
        assert_eq!(in_flight(&d), 2);
    }

    #[tokio::test]
    async fn losing_every_worker_fails_the_waiters_at_once() {
        let (d, _a, _b) = busy(4, 60_000).await;
        let waiter = spawn_waiter(&d, 3).await;
        d.worker_failed(WorkerId(1));
        d.set_routable(WorkerId(2), false);
        assert_eq!(waiter.await.unwrap(), Err(AdmitError::NoWorkers));
        assert!(matches!(
            d.admit(key(&d, 4)).await,
            Err(AdmitError::NoWorkers)
        ));
    }

    /// A waiter whose client goes away just after the frontend gave it a slot (the outcome
    /// is in its channel, unread) gives the slot back, to the next waiter.
    #[tokio::test]
    async fn a_slot_given_to_a_departing_waiter_goes_to_the_next() {
        let (d, a, _b) = busy(4, 60_000).await;
        let departing = spawn_waiter(&d, 3).await;
        let next = spawn_waiter(&d, 4).await;
        // One thread: the departing waiter's task does not run between these two lines.
        drop(a);
        departing.abort();
        assert!(departing.await.unwrap_err().is_cancelled());
        next.await.unwrap().unwrap();
        assert_eq!(in_flight(&d), 1, "only request 2 runs; no slot leaked");
        assert_eq!(lock(&d.core).waiters.len(), 0);
    }

    /// A worker that failed a request stays out for the ejection time even though its
    /// health check passes (Envoy's `base_ejection_time`); then it may return.
    #[tokio::test]
    async fn a_failed_worker_stays_out_for_the_ejection_time_whatever_its_health() {
        let config = GatewayConfig {
            router: router::RouterConfig {
                block_size: 4,
                ..Default::default()
            },
            ejection: router::EjectionConfig {
                // Long enough that a loaded machine still checks "still out" within it.
                base: Nanos::from_secs(1),
                max: Nanos::from_secs(10),
            },
            ..GatewayConfig::default()
        };
        let d = Dispatcher::new(&config).unwrap();
        let mut info = WorkerInfo::new(WorkerId(1), "http://w1");
        info.block_size = 4;
        d.upsert_worker(info.clone(), Origin::Static, true).unwrap();
        d.worker_failed(WorkerId(1));
        // Health checks pass at once, and a fresh description arrives: still out.
        d.set_routable(WorkerId(1), true);
        d.upsert_worker(info, Origin::Static, true).unwrap();
        assert!(d.routable_workers().is_empty());
        tokio::time::sleep(Duration::from_millis(1_100)).await;
        d.set_routable(WorkerId(1), true);
        assert_eq!(d.routable_workers(), vec![WorkerId(1)]);
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

#[cfg(test)]
mod disagg_tests {
    use super::*;

    /// Worker 1 prefills, worker 2 decodes; block size 4, local prefill up to 8 tokens.
    fn fleet() -> Arc<Dispatcher> {
        let config = GatewayConfig {
            router: router::RouterConfig {
                policy: router::PolicyKind::Kv,
                block_size: 4,
                ..Default::default()
            },
            local_prefill_max_tokens: 8,
            ..GatewayConfig::default()
        };
        let d = Dispatcher::new(&config).unwrap();
        for (id, role) in [(1, WorkerRole::Prefill), (2, WorkerRole::Decode)] {
            let mut info = WorkerInfo::new(WorkerId(id), &format!("http://w{id}"));
            info.block_size = 4;
            info.role = role;
            d.upsert_worker(info, Origin::Static, true).unwrap();
        }
        d
    }

    #[tokio::test]
    async fn long_prompts_split_short_ones_stay_local_and_a_failed_prefill_goes_local() {
        let d = fleet();
        assert!(d.is_disaggregated());
        let long = d.key(&(0..64).collect::<Vec<_>>());
        let mut split = d.admit(long.clone()).await.unwrap();
        assert_eq!(split.worker.id, WorkerId(2));
        assert_eq!(split.prefill.as_ref().map(|(w, _)| w.id), Some(WorkerId(1)));
        assert_eq!(split.route_labels(), ("split", "remote_prefill"));
        split.prefill_failed();
        assert!(split.prefill.is_none());
        assert_eq!(split.worker.id, WorkerId(2));
        assert_eq!(split.route_labels(), ("local", "prefill_failed"));
        drop(split);

        let short = d.key(&[1, 2, 3, 4, 5]);
        let local = d.admit(short).await.unwrap();
        assert!(local.prefill.is_none());
        assert_eq!(local.route_labels(), ("local", "short_prefill"));
        drop(local);

        // Another long prompt: the first one was prefilled on the decode worker, which the
        // router (predicting a worker without events) now sends there locally.
        let other = d.key(&(100..164).collect::<Vec<_>>());
        let mut done = d.admit(other).await.unwrap();
        done.prefill_done();
        assert!(done.prefill.is_none());
        assert_eq!(done.route_labels(), ("split", "remote_prefill"));
        drop(done);
        let loads: u32 = d.snapshot().workers.iter().map(|w| w.in_flight).sum();
        assert_eq!(loads, 0, "every slot released");

        // Without a decode worker nothing can be served.
        d.worker_failed(WorkerId(2));
        assert!(matches!(d.admit(long).await, Err(AdmitError::NoWorkers)));
    }
}
