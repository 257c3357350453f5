//! The router core: index + load accounting + a policy.

use std::collections::VecDeque;
use std::fmt;

pub use kv_index::RequestId;
use kv_index::{
    BlockHasher, EngineBlockId, IndexConfig, KvEvent, KvEventKind, KvIndex, LocalBlockHash,
    OverlapScores, SequenceHash, StoredBlock, WorkerId,
};
use nanotime::Nanos;
use rustc_hash::FxHashMap;

use crate::kv_load::KvLoadParamError;
use crate::load::{FleetActive, WorkerAccount, WorkerLoad};
use crate::policy::{
    Candidate, PolicyKind, PolicyParams, PolicyRng, RoutingPolicy, SelectionContext, WorkerLimits,
};

/// Where the router learns what each worker has cached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvSource {
    /// From the workers' KV events, fed through [`Router::apply_event`].
    Events,
    /// Without events: every routed prompt is assumed cached on its worker for `ttl` after it
    /// was last routed (Dynamo's `--no-kv-events`, default TTL 120 s).
    Approximate { ttl: Nanos },
}

/// Where the router's view of one worker's cache comes from, under [`KvSource::Events`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CacheView {
    /// The worker's KV events.
    #[default]
    Events,
    /// The router's own predictions (as in approximate mode), for a worker that announced no
    /// event source: routing blind to its cache would be worse. Its first KV event switches
    /// it to [`CacheView::Events`] and drops the predictions.
    Predicted,
}

impl CacheView {
    pub fn label(self) -> &'static str {
        match self {
            CacheView::Events => "events",
            CacheView::Predicted => "predicted",
        }
    }
}

/// Router settings. [`Default`] gives Dynamo's defaults with kvroute's `kv_load` policy.
#[derive(Debug, Clone)]
pub struct RouterConfig {
    /// Policy built by [`Router::new`]; [`Router::with_policy`] takes any policy instead.
    pub policy: PolicyKind,
    /// Parameters of the built-in policies (`kv`'s cost, `kv_load`'s), validated by
    /// [`Router::new`] and [`Router::with_policy`].
    pub params: PolicyParams,
    /// Tokens per KV block; must match the workers' block size.
    pub block_size: usize,
    /// Seed of the router's RNG (random policy, tie breaks, softmax sampling).
    pub seed: u64,
    /// Events or approximate mode.
    pub kv_source: KvSource,
    /// Bounds of the prefix index.
    pub index: IndexConfig,
    /// Most requests tracked in flight at once; routing more is refused with
    /// [`RouteError::TooManyInFlight`] rather than growing without bound.
    pub max_in_flight: usize,
    /// Most (worker, block) predictions kept (approximate mode, and workers whose
    /// [`CacheView`] is predicted); the oldest go first.
    pub max_predicted_blocks: usize,
    /// Under [`KvSource::Events`]: how long a prediction lasts for a worker whose
    /// [`CacheView`] is predicted (Dynamo's `--router-ttl` default, 120 s).
    pub predicted_ttl: Nanos,
}

impl Default for RouterConfig {
    fn default() -> Self {
        Self {
            policy: PolicyKind::DEFAULT,
            params: PolicyParams::default(),
            block_size: kv_index::DEFAULT_BLOCK_SIZE,
            seed: 0,
            kv_source: KvSource::Events,
            index: IndexConfig::default(),
            max_in_flight: 1 << 20,
            max_predicted_blocks: 1 << 20,
            predicted_ttl: Nanos::from_secs(120),
        }
    }
}

/// Settings the router refuses.
#[derive(Debug, Clone, PartialEq)]
pub enum RouterConfigError {
    ZeroBlockSize,
    NegativeOverlapWeight(f64),
    InvalidTemperature(f64),
    /// A `kv_load` parameter out of range.
    InvalidKvLoad(KvLoadParamError),
}

impl fmt::Display for RouterConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::ZeroBlockSize => write!(f, "KV block size must be at least 1 token"),
            Self::NegativeOverlapWeight(w) => {
                write!(f, "overlap weight must be a finite number ≥ 0, got {w}")
            }
            Self::InvalidTemperature(t) => {
                write!(f, "router temperature must be a finite number ≥ 0, got {t}")
            }
            Self::InvalidKvLoad(why) => write!(f, "kv_load parameters: {why}"),
        }
    }
}

impl std::error::Error for RouterConfigError {}

/// Why a request could not be routed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RouteError {
    /// No worker is registered.
    NoWorkers,
    /// A request with this id is already in flight.
    DuplicateRequest(RequestId),
    /// [`Router::on_routed`] named a worker the router does not know.
    UnknownWorker(WorkerId),
    /// [`Router::add_worker`] would exceed the index's `max_workers`.
    TooManyWorkers { limit: usize },
    /// The bound on tracked in-flight requests is reached.
    TooManyInFlight { limit: usize },
    /// The policy returned an index outside the candidate list (a bug in the policy).
    PolicyOutOfRange { policy: &'static str, index: usize },
}

impl fmt::Display for RouteError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NoWorkers => write!(f, "no worker is registered with the router"),
            Self::DuplicateRequest(id) => write!(f, "{id} is already in flight"),
            Self::UnknownWorker(w) => write!(f, "{w} is not registered with the router"),
            Self::TooManyWorkers { limit } => write!(
                f,
                "router already has its limit of {limit} workers; remove gone ones or raise \
                 IndexConfig::max_workers"
            ),
            Self::TooManyInFlight { limit } => {
                write!(
                    f,
                    "router is tracking its limit of {limit} in-flight requests"
                )
            }
            Self::PolicyOutOfRange { policy, index } => {
                write!(
                    f,
                    "policy `{policy}` chose candidate {index}, which does not exist"
                )
            }
        }
    }
}

impl std::error::Error for RouteError {}

/// A prompt, hashed once for routing: its blocks' local and sequence hashes.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RoutingKey {
    pub local: Vec<LocalBlockHash>,
    pub seq: Vec<SequenceHash>,
    pub num_tokens: u64,
}

impl RoutingKey {
    /// Hashes `tokens` with `hasher` (full blocks only; the partial tail is not cacheable).
    pub fn new(hasher: &BlockHasher, tokens: &[u32]) -> Self {
        let local = hasher.local_hashes(tokens);
        let seq = kv_index::hash::chain_local_hashes(None, local.iter().copied()).collect();
        Self {
            local,
            seq,
            num_tokens: tokens.len() as u64,
        }
    }

    pub fn num_blocks(&self) -> u32 {
        u32::try_from(self.seq.len()).unwrap_or(u32::MAX)
    }
}

/// The router's answer for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RouteDecision {
    pub worker: WorkerId,
    /// Leading blocks of the prompt the router believes are cached on `worker`.
    pub overlap_blocks: u32,
    /// The longest cached prefix the router knew of on any worker it could pick, in blocks
    /// (≥ `overlap_blocks`): what routing could have reused. Below it, the policy traded
    /// reuse for balance; the engine's own count below `overlap_blocks` means a stale index.
    pub available_blocks: u32,
    /// Full blocks in the prompt.
    pub prompt_blocks: u32,
    /// Tokens `worker` is expected to prefill (prompt minus the cached prefix).
    pub new_prefill_tokens: u64,
}

/// What the router did, for metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RouterCounters {
    pub routed: u64,
    pub refused: u64,
    /// Sum over routed requests of the chosen worker's overlap, in blocks.
    pub overlap_blocks: u64,
    /// Sum over routed requests of the longest overlap on any candidate worker, in blocks
    /// (see [`RouteDecision::available_blocks`]).
    pub available_blocks: u64,
    /// Sum over routed requests of their full prompt blocks.
    pub prompt_blocks: u64,
    pub first_tokens: u64,
    pub finished: u64,
    /// Lifecycle calls for requests the router was not tracking (already finished, never
    /// routed, or on a worker that left).
    pub unknown_requests: u64,
    /// In-flight requests dropped because their worker was removed.
    pub orphaned: u64,
    /// Approximate mode: predicted blocks expired or evicted by the bound.
    pub predictions_expired: u64,
}

#[derive(Debug)]
struct WorkerEntry {
    id: WorkerId,
    limits: WorkerLimits,
    account: WorkerAccount,
    /// Leaving: no new requests, its in-flight ones finish (see [`Router::set_draining`]).
    draining: bool,
    cache_view: CacheView,
}

#[derive(Debug)]
struct Tracked {
    worker: WorkerId,
    blocks: Vec<SequenceHash>,
    pending_prefill_tokens: u64,
    prompt_tokens: u64,
    awaiting_first_token: bool,
}

/// The router: a prefix index, per-worker load accounting and a routing policy.
///
/// Sans-IO: time comes in as an argument and nothing here blocks or does I/O. The caller
/// drives the request lifecycle — [`route`](Router::route), then
/// [`on_first_token`](Router::on_first_token), then [`on_finished`](Router::on_finished) —
/// and feeds KV events with [`apply_event`](Router::apply_event). In approximate mode it also
/// calls [`handle_timeout`](Router::handle_timeout) at [`poll_timeout`](Router::poll_timeout)
/// so predictions expire on time (routing expires them too).
#[derive(Debug)]
pub struct Router {
    hasher: BlockHasher,
    block_size: u32,
    index: KvIndex,
    /// Ascending by id, so candidates come in a stable order.
    workers: Vec<WorkerEntry>,
    /// `workers`' ids, in the same order: the active-prefix merge walks a thousand ids per
    /// decision, which a dense array keeps in a few cache lines.
    worker_ids: Vec<WorkerId>,
    requests: FxHashMap<RequestId, Tracked>,
    policy: Box<dyn RoutingPolicy>,
    rng: PolicyRng,
    /// Cache predictions: for every worker in approximate mode, otherwise for workers whose
    /// [`CacheView`] is predicted (empty when there are none).
    predictions: Predictions,
    /// Approximate mode: every worker is predicted and workers' events are not expected.
    approximate: bool,
    max_in_flight: usize,
    counters: RouterCounters,
    /// Scratch space reused by every decision so routing does not allocate per worker.
    candidates: Vec<Candidate>,
    /// The workers each active block is active on (see [`FleetActive`]).
    fleet_active: FleetActive,
    /// Scratch: the request's possible active-prefix lengths, and each worker's.
    cuts: Vec<usize>,
    prefix_lens: Vec<usize>,
}

impl Router {
    /// A router with the built-in policy named in `config`.
    pub fn new(config: RouterConfig) -> Result<Self, RouterConfigError> {
        let policy = config.policy.build(config.params);
        Self::with_policy(config, policy)
    }

    /// A router with any policy (for example one defined outside this crate).
    pub fn with_policy(
        config: RouterConfig,
        policy: Box<dyn RoutingPolicy>,
    ) -> Result<Self, RouterConfigError> {
        let hasher = BlockHasher::new(config.block_size).ok_or(RouterConfigError::ZeroBlockSize)?;
        let block_size =
            u32::try_from(config.block_size).map_err(|_| RouterConfigError::ZeroBlockSize)?;
        let w = config.params.kv.overlap_weight;
        if !(w.is_finite() && w >= 0.0) {
            return Err(RouterConfigError::NegativeOverlapWeight(w));
        }
        let t = config.params.kv.temperature;
        if !(t.is_finite() && t >= 0.0) {
            return Err(RouterConfigError::InvalidTemperature(t));
        }
        config
            .params
            .kv_load
            .validate()
            .map_err(RouterConfigError::InvalidKvLoad)?;
        let (ttl, approximate) = match config.kv_source {
            KvSource::Events => (config.predicted_ttl, false),
            KvSource::Approximate { ttl } => (ttl, true),
        };
        let predictions = Predictions::new(ttl, config.max_predicted_blocks.max(1));
        Ok(Self {
            hasher,
            block_size,
            index: KvIndex::new(config.index),
            workers: Vec::new(),
            worker_ids: Vec::new(),
            requests: FxHashMap::default(),
            policy,
            rng: PolicyRng::seed_from_u64(config.seed),
            predictions,
            approximate,
            max_in_flight: config.max_in_flight.max(1),
            counters: RouterCounters::default(),
            candidates: Vec::new(),
            fleet_active: FleetActive::default(),
            cuts: Vec::new(),
            prefix_lens: Vec::new(),
        })
    }

    /// The policy's name.
    pub fn policy_name(&self) -> &'static str {
        self.policy.name()
    }

    /// The block hasher matching the router's block size.
    pub fn hasher(&self) -> &BlockHasher {
        &self.hasher
    }

    /// Hashes a prompt for [`route`](Router::route).
    pub fn key(&self, tokens: &[u32]) -> RoutingKey {
        RoutingKey::new(&self.hasher, tokens)
    }

    /// Registers a worker (or updates its limits if already known). Refused beyond the
    /// index's `max_workers`, so a misbehaving discovery source cannot grow the router
    /// without bound.
    pub fn add_worker(&mut self, worker: WorkerId, limits: WorkerLimits) -> Result<(), RouteError> {
        match self.workers.binary_search_by_key(&worker, |w| w.id) {
            Ok(i) => self.workers[i].limits = limits,
            Err(i) => {
                let limit = self.index.config().max_workers;
                if self.workers.len() >= limit {
                    return Err(RouteError::TooManyWorkers { limit });
                }
                self.worker_ids.insert(i, worker);
                self.workers.insert(
                    i,
                    WorkerEntry {
                        id: worker,
                        limits,
                        account: WorkerAccount::default(),
                        draining: false,
                        cache_view: CacheView::Events,
                    },
                );
            }
        }
        Ok(())
    }

    /// Forgets a worker: it receives no more requests and its cached blocks leave the index.
    /// Returns the ids of its in-flight requests, which the router stops tracking (the caller
    /// fails or retries them).
    pub fn remove_worker(&mut self, worker: WorkerId) -> Vec<RequestId> {
        if let Ok(i) = self.workers.binary_search_by_key(&worker, |w| w.id) {
            let mut entry = self.workers.remove(i);
            self.worker_ids.remove(i);
            entry.account.forget(worker, &mut self.fleet_active);
        }
        self.index.remove_worker(worker);
        self.predictions.forget_worker(worker);
        let mut orphans: Vec<RequestId> = self
            .requests
            .iter()
            .filter(|(_, t)| t.worker == worker)
            .map(|(id, _)| *id)
            .collect();
        orphans.sort_unstable();
        for id in &orphans {
            self.requests.remove(id);
        }
        self.counters.orphaned += orphans.len() as u64;
        orphans
    }

    /// Registered workers, ascending by id.
    pub fn workers(&self) -> impl Iterator<Item = (WorkerId, WorkerLoad)> + '_ {
        self.workers.iter().map(|w| (w.id, w.account.load))
    }

    /// Registered workers that take new requests (not draining), ascending by id.
    pub fn routable_workers(&self) -> impl Iterator<Item = (WorkerId, WorkerLoad)> + '_ {
        self.workers
            .iter()
            .filter(|w| !w.draining)
            .map(|w| (w.id, w.account.load))
    }

    /// Marks a worker as leaving (`true`) or back in service (`false`). A draining worker is
    /// offered to no policy, so it gets no new request, while its in-flight requests finish
    /// and are accounted as usual; the caller removes it once its `in_flight` is 0 (a pool
    /// scaling down drains a worker before stopping it). `false` for an unknown worker.
    pub fn set_draining(&mut self, worker: WorkerId, draining: bool) -> bool {
        match find_worker(&mut self.workers, worker) {
            Some(entry) => {
                entry.draining = draining;
                true
            }
            None => false,
        }
    }

    /// The worker a tracked request was routed to.
    pub fn worker_of(&self, id: RequestId) -> Option<WorkerId> {
        self.requests.get(&id).map(|t| t.worker)
    }

    /// Whether `worker` is draining.
    pub fn is_draining(&self, worker: WorkerId) -> bool {
        self.workers
            .binary_search_by_key(&worker, |w| w.id)
            .is_ok_and(|i| self.workers[i].draining)
    }

    /// The router's accounting of one worker's load.
    pub fn load(&self, worker: WorkerId) -> Option<WorkerLoad> {
        self.workers
            .binary_search_by_key(&worker, |w| w.id)
            .ok()
            .map(|i| self.workers[i].account.load)
    }

    /// Sets where the router's view of `worker`'s cache comes from (see [`CacheView`]);
    /// `false` for an unknown worker. Leaving [`CacheView::Predicted`] drops the worker's
    /// predicted blocks, and entering it the blocks its events had stored. Approximate mode
    /// predicts every worker whatever its view.
    pub fn set_cache_view(&mut self, worker: WorkerId, view: CacheView) -> bool {
        let Some(entry) = find_worker(&mut self.workers, worker) else {
            return false;
        };
        let was = std::mem::replace(&mut entry.cache_view, view);
        // Predictions and events are two sequence streams for the index: whichever it held
        // of the other cannot continue, so the worker starts from an empty baseline.
        if was != view && !self.approximate {
            self.predictions.forget_worker(worker);
            self.index.clear_worker(worker);
        }
        true
    }

    /// Where the router's view of `worker`'s cache comes from (`None`: unknown worker).
    pub fn cache_view(&self, worker: WorkerId) -> Option<CacheView> {
        if self.approximate {
            return self.load(worker).map(|_| CacheView::Predicted);
        }
        self.workers
            .binary_search_by_key(&worker, |w| w.id)
            .ok()
            .map(|i| self.workers[i].cache_view)
    }

    /// A worker whose view was predicted sends its first event: from now on its events
    /// describe its cache.
    fn on_worker_event(&mut self, worker: WorkerId) {
        if !self.approximate && self.cache_view(worker) == Some(CacheView::Predicted) {
            self.set_cache_view(worker, CacheView::Events);
        }
    }

    /// Feeds one KV event into the index. Events for unknown workers are indexed too (the
    /// worker may register just after its first events). In approximate mode the router
    /// writes its own predicted events into the index; do not feed workers' events as well.
    pub fn apply_event(
        &mut self,
        event: &KvEvent,
    ) -> Result<kv_index::ApplyOutcome, kv_index::EventError> {
        self.on_worker_event(event.worker);
        self.index.apply(event)
    }

    /// [`apply_event`](Self::apply_event) with the index's gap policy
    /// ([`KvIndex::apply_resyncing`]): a sequence gap drops the worker's blocks and the event
    /// becomes a new baseline (`resynced` in the outcome). What every driver feeds workers'
    /// events through.
    pub fn apply_event_resyncing(
        &mut self,
        event: &KvEvent,
    ) -> Result<kv_index::ApplyOutcome, kv_index::EventError> {
        self.on_worker_event(event.worker);
        self.index.apply_resyncing(event)
    }

    /// Replaces the index's view of `worker` with the worker's own snapshot of its cache
    /// (`KvIndex::restore_worker`): what a gateway that subscribed late asks an engine for.
    pub fn restore_worker(
        &mut self,
        worker: WorkerId,
        next_seq: Option<u64>,
        stored: &[KvEventKind],
    ) -> Result<kv_index::ApplyOutcome, kv_index::EventError> {
        self.on_worker_event(worker);
        self.index.restore_worker(worker, next_seq, stored)
    }

    /// Drops what the index holds of `worker` and its sequence baseline: its stream lost
    /// messages, so those blocks cannot be vouched for.
    pub fn clear_worker(&mut self, worker: WorkerId) {
        self.index.clear_worker(worker);
    }

    /// The prefix index (read-only), e.g. for metrics.
    pub fn index(&self) -> &KvIndex {
        &self.index
    }

    /// Mutable access to the index, e.g. to clear a worker after an event gap.
    pub fn index_mut(&mut self) -> &mut KvIndex {
        &mut self.index
    }

    /// Cache overlap of a prompt on every worker, without routing it.
    pub fn overlaps(&self, key: &RoutingKey) -> OverlapScores {
        self.index.find_matches(&key.seq)
    }

    /// What the policy would see for this request on every worker, without routing it.
    pub fn candidates(&mut self, key: &RoutingKey, now: Nanos) -> &[Candidate] {
        self.expire_predictions(now);
        self.fill_candidates(key);
        &self.candidates
    }

    /// Picks a worker for a request and starts accounting for it there.
    pub fn route(
        &mut self,
        id: RequestId,
        key: &RoutingKey,
        now: Nanos,
    ) -> Result<RouteDecision, RouteError> {
        let refused = |router: &mut Self, e| {
            router.counters.refused += 1;
            Err(e)
        };
        if self.workers.is_empty() {
            return refused(self, RouteError::NoWorkers);
        }
        if let Err(e) = self.can_track(id) {
            return refused(self, e);
        }
        self.expire_predictions(now);
        self.fill_candidates(key);
        if self.candidates.is_empty() {
            // Every worker is draining.
            return refused(self, RouteError::NoWorkers);
        }
        let ctx = SelectionContext {
            prompt_tokens: key.num_tokens,
            prompt_blocks: key.num_blocks(),
            block_size: self.block_size,
            candidates: &self.candidates,
        };
        let index = self.policy.select(&ctx, &mut self.rng);
        let Some(chosen) = self.candidates.get(index).copied() else {
            let policy = self.policy.name();
            return refused(self, RouteError::PolicyOutOfRange { policy, index });
        };
        let available_blocks = self
            .candidates
            .iter()
            .map(|c| c.overlap_blocks)
            .max()
            .unwrap_or(0);
        self.account(id, chosen.worker, key, chosen.new_prefill_tokens, now);
        self.counters.routed += 1;
        self.counters.overlap_blocks += u64::from(chosen.overlap_blocks);
        self.counters.available_blocks += u64::from(available_blocks);
        self.counters.prompt_blocks += u64::from(key.num_blocks());
        Ok(RouteDecision {
            worker: chosen.worker,
            overlap_blocks: chosen.overlap_blocks,
            available_blocks,
            prompt_blocks: key.num_blocks(),
            new_prefill_tokens: chosen.new_prefill_tokens,
        })
    }

    /// Records a request that was sent to `worker` without [`route`](Router::route) — by
    /// another router replica, or pinned by the caller — so this router's load accounting
    /// and (in approximate mode) cache predictions include it. Follow it with
    /// [`on_first_token`](Router::on_first_token) and [`on_finished`](Router::on_finished) as
    /// for a routed request.
    pub fn on_routed(
        &mut self,
        id: RequestId,
        worker: WorkerId,
        key: &RoutingKey,
        now: Nanos,
    ) -> Result<RouteDecision, RouteError> {
        if self
            .workers
            .binary_search_by_key(&worker, |w| w.id)
            .is_err()
        {
            return Err(RouteError::UnknownWorker(worker));
        }
        self.can_track(id)?;
        self.expire_predictions(now);
        let matches = self.index.find_matches(&key.seq);
        let overlap = matches.get(worker).min(key.num_blocks());
        let available_blocks = matches
            .iter()
            .map(|(_, blocks)| blocks)
            .max()
            .unwrap_or(0)
            .min(key.num_blocks());
        let cached_tokens = (u64::from(overlap) * u64::from(self.block_size)).min(key.num_tokens);
        let new_prefill_tokens = key.num_tokens - cached_tokens;
        self.account(id, worker, key, new_prefill_tokens, now);
        Ok(RouteDecision {
            worker,
            overlap_blocks: overlap,
            available_blocks,
            prompt_blocks: key.num_blocks(),
            new_prefill_tokens,
        })
    }

    /// Whether one more request, with this id, may be tracked.
    fn can_track(&self, id: RequestId) -> Result<(), RouteError> {
        if self.requests.contains_key(&id) {
            return Err(RouteError::DuplicateRequest(id));
        }
        if self.requests.len() >= self.max_in_flight {
            let limit = self.max_in_flight;
            return Err(RouteError::TooManyInFlight { limit });
        }
        Ok(())
    }

    /// The request produced its first token: its prefill is done.
    pub fn on_first_token(&mut self, id: RequestId, _now: Nanos) {
        let Some(tracked) = self.requests.get_mut(&id) else {
            self.counters.unknown_requests += 1;
            return;
        };
        let pending = std::mem::take(&mut tracked.pending_prefill_tokens);
        let awaiting = std::mem::take(&mut tracked.awaiting_first_token);
        if let Some(entry) = find_worker(&mut self.workers, tracked.worker) {
            let load = &mut entry.account.load;
            load.pending_prefill_tokens = load.pending_prefill_tokens.saturating_sub(pending);
            load.awaiting_first_token = load
                .awaiting_first_token
                .saturating_sub(u32::from(awaiting));
        }
        self.counters.first_tokens += 1;
    }

    /// A request completed with a reply of `output_tokens` tokens: the policy learns how long
    /// replies are. Drivers call it for completed requests only (a failed or cancelled
    /// request's partial reply says nothing about reply lengths), next to
    /// [`on_finished`](Self::on_finished).
    pub fn on_reply(&mut self, output_tokens: u32) {
        self.policy.observe_reply(output_tokens);
    }

    /// The request finished (completed, failed or cancelled): release its load.
    pub fn on_finished(&mut self, id: RequestId, _now: Nanos) {
        let Some(tracked) = self.requests.remove(&id) else {
            self.counters.unknown_requests += 1;
            return;
        };
        if let Some(entry) = find_worker(&mut self.workers, tracked.worker) {
            let load = &mut entry.account.load;
            load.in_flight = load.in_flight.saturating_sub(1);
            load.pending_prefill_tokens = load
                .pending_prefill_tokens
                .saturating_sub(tracked.pending_prefill_tokens);
            load.awaiting_first_token = load
                .awaiting_first_token
                .saturating_sub(u32::from(tracked.awaiting_first_token));
            load.context_tokens = load.context_tokens.saturating_sub(tracked.prompt_tokens);
            entry
                .account
                .release(tracked.worker, &tracked.blocks, &mut self.fleet_active);
        }
        self.counters.finished += 1;
    }

    /// Requests the router is tracking.
    pub fn in_flight(&self) -> usize {
        self.requests.len()
    }

    pub fn counters(&self) -> RouterCounters {
        self.counters
    }

    /// When the next prediction expires (approximate mode); `None` otherwise.
    pub fn poll_timeout(&self) -> Option<Nanos> {
        self.predictions.next_expiry()
    }

    /// Expires predictions due at or before `now` (approximate mode).
    pub fn handle_timeout(&mut self, now: Nanos) {
        self.expire_predictions(now);
    }

    fn account(
        &mut self,
        id: RequestId,
        worker: WorkerId,
        key: &RoutingKey,
        new_prefill_tokens: u64,
        now: Nanos,
    ) {
        let mut predict = self.approximate;
        if let Some(entry) = find_worker(&mut self.workers, worker) {
            predict |= entry.cache_view == CacheView::Predicted;
            entry.account.load.in_flight += 1;
            entry.account.load.pending_prefill_tokens += new_prefill_tokens;
            entry.account.load.awaiting_first_token += 1;
            entry.account.load.context_tokens += key.num_tokens;
            entry
                .account
                .acquire(worker, &key.seq, &mut self.fleet_active);
        }
        self.requests.insert(
            id,
            Tracked {
                worker,
                blocks: key.seq.clone(),
                pending_prefill_tokens: new_prefill_tokens,
                prompt_tokens: key.num_tokens,
                awaiting_first_token: true,
            },
        );
        if predict {
            self.predictions.predict(&mut self.index, worker, key, now);
        }
    }

    fn expire_predictions(&mut self, now: Nanos) {
        self.counters.predictions_expired += self.predictions.expire(&mut self.index, now);
    }

    fn fill_candidates(&mut self, key: &RoutingKey) {
        let overlaps = self.index.find_matches(&key.seq);
        let prompt_blocks = key.seq.len();
        let block_size = u64::from(self.block_size);
        self.fleet_active.prefix_cuts(&key.seq, &mut self.cuts);
        self.fleet_active.prefix_lens(
            &key.seq,
            &self.cuts,
            &self.worker_ids,
            |w| *w,
            &mut self.prefix_lens,
        );
        self.candidates.clear();
        // Both lists are ascending by worker id: walk them together instead of a lookup per
        // worker (fleets of a thousand workers route often).
        let mut matched = overlaps.iter().peekable();
        for (w, &already_active) in self.workers.iter().zip(&self.prefix_lens) {
            while matched.next_if(|&(id, _)| id < w.id).is_some() {}
            let overlap = matched
                .next_if(|&(id, _)| id == w.id)
                .map_or(0, |(_, blocks)| blocks)
                .min(key.num_blocks());
            if w.draining {
                continue;
            }
            let cached_tokens = (u64::from(overlap) * block_size).min(key.num_tokens);
            self.candidates.push(Candidate {
                worker: w.id,
                overlap_blocks: overlap,
                new_prefill_tokens: key.num_tokens - cached_tokens,
                potential_active_blocks: w.account.load.active_blocks
                    + (prompt_blocks - already_active) as u64,
                load: w.account.load,
                limits: w.limits,
            });
        }
    }
}

fn find_worker(workers: &mut [WorkerEntry], id: WorkerId) -> Option<&mut WorkerEntry> {
    workers
        .binary_search_by_key(&id, |w| w.id)
        .ok()
        .map(|i| &mut workers[i])
}

/// Approximate mode's predictions: routed prompts assumed cached until they expire.
///
/// Every block of a routed prompt gets the same expiry, and routing any prompt refreshes all
/// of its prefix blocks, so a block never expires before its descendants: expiring in deadline
/// order never leaves a hole in a cached prefix.
#[derive(Debug)]
struct Predictions {
    ttl: Nanos,
    max_entries: usize,
    /// (deadline, worker, block) in deadline order; stale entries (refreshed since) are
    /// skipped when popped.
    queue: VecDeque<(Nanos, WorkerId, SequenceHash)>,
    /// The current deadline of every predicted (worker, block).
    deadline: FxHashMap<(WorkerId, SequenceHash), Nanos>,
    /// Next event sequence number per worker for the synthetic events fed to the index.
    next_seq: FxHashMap<WorkerId, u64>,
}

impl Predictions {
    fn new(ttl: Nanos, max_entries: usize) -> Self {
        Self {
            ttl,
            max_entries,
            queue: VecDeque::new(),
            deadline: FxHashMap::default(),
            next_seq: FxHashMap::default(),
        }
    }

    fn next_expiry(&self) -> Option<Nanos> {
        self.queue.front().map(|e| e.0)
    }

    fn event(&mut self, worker: WorkerId, kind: KvEventKind) -> KvEvent {
        let seq = self.next_seq.entry(worker).or_insert(0);
        let event = KvEvent {
            worker,
            seq: *seq,
            kind,
        };
        *seq += 1;
        event
    }

    fn predict(&mut self, index: &mut KvIndex, worker: WorkerId, key: &RoutingKey, now: Nanos) {
        if key.seq.is_empty() {
            return;
        }
        let deadline = now + self.ttl;
        for &seq in &key.seq {
            self.deadline.insert((worker, seq), deadline);
            self.queue.push_back((deadline, worker, seq));
        }
        // Refreshed blocks leave stale entries behind in the queue; compact it before they
        // outnumber the live ones, so it stays within twice the bound (amortised O(log n)).
        if self.queue.len() > 2 * self.max_entries.max(self.deadline.len()) {
            self.compact();
        }
        let blocks = StoredBlock::from_hashes(&key.seq, &key.local);
        let event = self.event(
            worker,
            KvEventKind::Stored {
                parent: None,
                blocks,
            },
        );
        // Our own, gap-free event stream: it cannot be refused.
        let _ = index.apply(&event);
        self.enforce_bound(index);
    }

    /// Pops entries due at `now` (and, under the bound, the oldest); returns blocks removed.
    fn expire(&mut self, index: &mut KvIndex, now: Nanos) -> u64 {
        let mut expired = Vec::new();
        while self.queue.front().is_some_and(|e| e.0 <= now) {
            expired.extend(self.pop_front());
        }
        self.remove(index, expired)
    }

    fn enforce_bound(&mut self, index: &mut KvIndex) {
        let mut evicted = Vec::new();
        while self.deadline.len() > self.max_entries && !self.queue.is_empty() {
            evicted.extend(self.pop_front());
        }
        self.remove(index, evicted);
    }

    /// Pops the queue's oldest entry; returns it when it was still live (not refreshed
    /// since it was queued) and is now forgotten.
    fn pop_front(&mut self) -> Option<(WorkerId, SequenceHash)> {
        let (deadline, worker, seq) = self.queue.pop_front()?;
        if self.deadline.get(&(worker, seq)) != Some(&deadline) {
            return None;
        }
        self.deadline.remove(&(worker, seq));
        Some((worker, seq))
    }

    /// Takes forgotten predictions out of the index: one `Removed` event per worker.
    fn remove(&mut self, index: &mut KvIndex, mut blocks: Vec<(WorkerId, SequenceHash)>) -> u64 {
        let removed = blocks.len() as u64;
        // Stable: each worker's blocks keep their expiry order.
        blocks.sort_by_key(|b| b.0);
        for run in blocks.chunk_by(|a, b| a.0 == b.0) {
            let worker = run[0].0;
            let ids = run.iter().map(|b| EngineBlockId(b.1.0)).collect();
            let event = self.event(worker, KvEventKind::Removed { blocks: ids });
            // Our own, gap-free event stream: it cannot be refused.
            let _ = index.apply(&event);
        }
        removed
    }

    /// Rebuilds the queue from the live deadlines, in deadline order.
    fn compact(&mut self) {
        let mut live: Vec<(Nanos, WorkerId, SequenceHash)> = self
            .deadline
            .iter()
            .map(|(&(worker, seq), &deadline)| (deadline, worker, seq))
            .collect();
        // The full tuple orders ties, so the result does not depend on hash-map order.
        live.sort_unstable();
        self.queue = live.into();
    }

    fn forget_worker(&mut self, worker: WorkerId) {
        self.deadline.retain(|(w, _), _| *w != worker);
        self.queue.retain(|e| e.1 != worker);
        self.next_seq.remove(&worker);
    }
}

/// A router is where a consumer's events go: [`kv_index::StreamSync`] drives it.
impl kv_index::EventSink for Router {
    fn apply_resyncing(
        &mut self,
        event: &KvEvent,
    ) -> Result<kv_index::ApplyOutcome, kv_index::EventError> {
        self.apply_event_resyncing(event)
    }

    fn clear_worker(&mut self, worker: WorkerId) {
        Router::clear_worker(self, worker);
    }

    fn restore_worker(
        &mut self,
        worker: WorkerId,
        next_seq: Option<u64>,
        stored: &[KvEventKind],
    ) -> Result<kv_index::ApplyOutcome, kv_index::EventError> {
        Router::restore_worker(self, worker, next_seq, stored)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::WorkerLimits;

    #[test]
    fn refreshing_the_same_prediction_keeps_the_queue_bounded() {
        let mut router = Router::new(RouterConfig {
            policy: PolicyKind::RoundRobin,
            kv_source: KvSource::Approximate {
                ttl: Nanos::from_secs(120),
            },
            max_predicted_blocks: 100,
            ..RouterConfig::default()
        })
        .unwrap();
        router
            .add_worker(WorkerId(0), WorkerLimits::default())
            .unwrap();
        let tokens: Vec<u32> = (0..32 * 50).collect();
        let key = router.key(&tokens);
        for i in 0..10_000u64 {
            let now = Nanos::from_millis(i);
            router.route(RequestId(i), &key, now).unwrap();
            router.on_finished(RequestId(i), now);
            let approx = &router.predictions;
            assert!(approx.queue.len() <= 2 * 100 + 50, "{}", approx.queue.len());
        }
        // Still predicted, and it expires a TTL after the last refresh, not the first.
        let last = Nanos::from_millis(9_999);
        router.handle_timeout(last + Nanos::from_secs(119));
        assert_eq!(router.overlaps(&key).get(WorkerId(0)), 50);
        router.handle_timeout(last + Nanos::from_secs(120));
        assert!(router.overlaps(&key).is_empty());
    }
}
