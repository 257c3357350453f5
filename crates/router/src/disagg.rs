//! Disaggregated prefill/decode admission: two worker pools, one decision per request.
//!
//! A request is first admitted to the **decode pool** (a [`Frontend`]: the configured
//! policy, so the decode worker is chosen by load and by the history it already holds). With
//! its decode worker known, the plan is made on what that worker still has to compute, the
//! *effective input length* (prompt minus the prefix the router believes is cached there):
//!
//! - at most [`DisaggConfig::local_prefill_max_tokens`] → [`Route::Local`]: the decode worker
//!   prefills itself and no KV moves (conditional disaggregation, as Dynamo's router does it).
//!   A later chat turn whose history the decode worker produced is the typical case: only
//!   the new question is uncached. A short reasoning prompt is another.
//! - longer → admitted to the **prefill pool** (a second [`Frontend`], KV-aware on the
//!   prefill workers' caches) and served as [`Route::Split`]: prefill there, KV transferred
//!   to the decode worker, decode there.
//!
//! When the prefill pool cannot take the request (no prefill worker, its queue full or timed
//! out) the request falls back to [`Route::Local`] with the reason, rather than failing —
//! the decode worker can always prefill. A prefill leg that fails after assignment (its
//! worker died) is reported with [`DisaggFrontend::on_prefill_failed`] and the request is
//! re-issued as a local prefill on its decode worker, so a client never hangs on a lost
//! prefill worker.
//!
//! Both drivers (the gateway and the simulator) run this code; they only carry out the
//! [`DisaggEvent`]s and report each leg's progress.

use std::collections::VecDeque;

use kv_index::{ApplyOutcome, EventError, KvEvent, WorkerId};
use nanotime::Nanos;
use rustc_hash::FxHashMap;
use worker_limits::WorkerLimits;

use crate::RequestId;
use crate::frontend::{AdmitError, Frontend, FrontendConfig, FrontendEvent};
use crate::router::{
    CacheView, RouteDecision, RouteError, RouterConfig, RouterConfigError, RoutingKey,
};

/// The pool a worker serves in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Pool {
    Prefill,
    Decode,
}

impl Pool {
    /// The label metrics and logs use.
    pub fn as_str(self) -> &'static str {
        match self {
            Pool::Prefill => "prefill",
            Pool::Decode => "decode",
        }
    }
}

/// Settings of disaggregated admission.
#[derive(Debug, Clone, PartialEq)]
pub struct DisaggConfig {
    /// Admission of each pool (its per-worker cap, queue and timeout).
    pub frontend: FrontendConfig,
    /// A request whose prompt has at most this many tokens uncached on its decode worker is
    /// prefilled there. Default 512: such a prefill fits in one step beside the decode batch
    /// (the default step budget is 16,384 tokens) and costs it a few milliseconds, less than
    /// the second queue, the prefill step and the KV transfer a remote prefill adds. `0`
    /// disaggregates every request.
    pub local_prefill_max_tokens: u32,
}

impl Default for DisaggConfig {
    fn default() -> Self {
        Self {
            frontend: FrontendConfig::default(),
            local_prefill_max_tokens: 512,
        }
    }
}

/// Why a request is prefilled on its decode worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LocalReason {
    /// Its effective input length is within `local_prefill_max_tokens`.
    ShortPrefill,
    /// The prefill pool refused it (no prefill worker, queue full or timed out).
    PrefillUnavailable(AdmitError),
    /// Its prefill leg failed after assignment (the prefill worker went away).
    PrefillFailed,
}

/// Where a request runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// Prefill and decode on `decode.worker`.
    Local {
        decode: RouteDecision,
        reason: LocalReason,
    },
    /// Prefill on `prefill.worker`, KV transferred to `decode.worker`, decode there.
    Split {
        prefill: RouteDecision,
        decode: RouteDecision,
    },
}

impl Route {
    /// The decode worker's decision (every route has one).
    pub fn decode(&self) -> &RouteDecision {
        match self {
            Route::Local { decode, .. } | Route::Split { decode, .. } => decode,
        }
    }
}

/// What became of a submitted request. Each gets exactly one `Assigned` or `Refused`, plus a
/// second `Assigned` (a local re-issue) after [`DisaggFrontend::on_prefill_failed`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DisaggEvent {
    Assigned { id: RequestId, route: Route },
    Refused { id: RequestId, error: AdmitError },
}

impl DisaggEvent {
    pub fn id(&self) -> RequestId {
        match self {
            Self::Assigned { id, .. } | Self::Refused { id, .. } => *id,
        }
    }
}

/// Where a request stands between submission and its route.
#[derive(Debug)]
enum Stage {
    /// Waiting for a decode worker; the key is kept for the prefill pool.
    Decode(RoutingKey),
    /// Has a decode worker, waiting for a prefill worker.
    Prefill(RouteDecision),
    /// Routed; `prefill_pending`: its prefill leg holds a prefill slot.
    Routed {
        decode: RouteDecision,
        prefill_pending: bool,
    },
}

/// Admission for a disaggregated fleet. See the module docs.
///
/// Bounds: `stages` holds each request from submission to [`on_finished`] or refusal, so it
/// is bounded by the decode pool's queue plus its in-flight requests.
///
/// [`on_finished`]: DisaggFrontend::on_finished
#[derive(Debug)]
pub struct DisaggFrontend {
    decode: Frontend,
    prefill: Frontend,
    local_prefill_max_tokens: u64,
    pools: FxHashMap<WorkerId, Pool>,
    stages: FxHashMap<RequestId, Stage>,
    events: VecDeque<DisaggEvent>,
}

impl DisaggFrontend {
    /// Two pools, each routed by the policy named in `router`.
    pub fn new(router: RouterConfig, config: DisaggConfig) -> Result<Self, RouterConfigError> {
        Ok(Self {
            decode: Frontend::new(router.clone(), config.frontend)?,
            prefill: Frontend::new(router, config.frontend)?,
            local_prefill_max_tokens: u64::from(config.local_prefill_max_tokens),
            pools: FxHashMap::default(),
            stages: FxHashMap::default(),
            events: VecDeque::new(),
        })
    }

    /// A pool's admission, for questions (loads, queue length, counters).
    pub fn pool(&self, pool: Pool) -> &Frontend {
        match pool {
            Pool::Prefill => &self.prefill,
            Pool::Decode => &self.decode,
        }
    }

    fn pool_mut(&mut self, pool: Pool) -> &mut Frontend {
        match pool {
            Pool::Prefill => &mut self.prefill,
            Pool::Decode => &mut self.decode,
        }
    }

    /// Runs `f` on the decode pool's admission, then routes whatever that freed: how a
    /// router replica's driver applies its peers' updates ([`crate::ReplicaSync`]), whose
    /// requests count in the decode pool (the pool of an aggregated fleet).
    pub fn with_decode_pool<R>(&mut self, now: Nanos, f: impl FnOnce(&mut Frontend) -> R) -> R {
        let result = f(&mut self.decode);
        self.pump(now);
        result
    }

    /// The pool `worker` serves in.
    pub fn pool_of(&self, worker: WorkerId) -> Option<Pool> {
        self.pools.get(&worker).copied()
    }

    /// The routing key of `tokens` (both pools hash alike).
    pub fn key(&self, tokens: &[u32]) -> RoutingKey {
        self.decode.router().key(tokens)
    }

    /// Registers a worker in a pool (moving it if it served in the other one).
    pub fn add_worker(
        &mut self,
        worker: WorkerId,
        pool: Pool,
        limits: WorkerLimits,
        now: Nanos,
    ) -> Result<(), RouteError> {
        if let Some(old) = self.pools.get(&worker).copied()
            && old != pool
        {
            let orphans = self.pool_mut(old).remove_worker(worker, now);
            debug_assert!(orphans.is_empty(), "moved a worker with requests in flight");
        }
        self.pool_mut(pool).add_worker(worker, limits, now)?;
        self.pools.insert(worker, pool);
        self.pump(now);
        Ok(())
    }

    /// Forgets a worker; returns the requests it was serving (a prefill worker's: report
    /// each with [`on_prefill_failed`](Self::on_prefill_failed); a decode worker's have
    /// failed).
    pub fn remove_worker(&mut self, worker: WorkerId, now: Nanos) -> Vec<RequestId> {
        let Some(pool) = self.pools.remove(&worker) else {
            return Vec::new();
        };
        let orphans = self.pool_mut(pool).remove_worker(worker, now);
        self.pump(now);
        orphans
    }

    /// Starts draining a worker in its pool (see [`Frontend::drain_worker`]): no new legs
    /// go to it; [`take_drained`](Self::take_drained) names it once its legs have finished.
    pub fn drain_worker(&mut self, worker: WorkerId, now: Nanos) -> bool {
        let Some(pool) = self.pools.get(&worker).copied() else {
            return false;
        };
        let drained = self.pool_mut(pool).drain_worker(worker, now);
        self.pump(now);
        drained
    }

    /// Sets where the router's view of `worker`'s cache comes from, in its pool
    /// ([`Router::set_cache_view`](crate::Router::set_cache_view)); `false` for an unknown worker.
    pub fn set_cache_view(&mut self, worker: WorkerId, view: CacheView) -> bool {
        let Some(pool) = self.pools.get(&worker).copied() else {
            return false;
        };
        self.pool_mut(pool)
            .router_mut()
            .set_cache_view(worker, view)
    }

    /// Where the router's view of `worker`'s cache comes from (`None`: unknown worker).
    pub fn cache_view(&self, worker: WorkerId) -> Option<CacheView> {
        let pool = self.pools.get(&worker).copied()?;
        self.pool(pool).router().cache_view(worker)
    }

    /// A draining worker of either pool whose last leg has finished.
    pub fn take_drained(&mut self) -> Option<WorkerId> {
        self.decode
            .take_drained()
            .or_else(|| self.prefill.take_drained())
    }

    /// Feeds a KV event to the index of its worker's pool (both, for a worker not yet
    /// registered: it may register just after its first events).
    pub fn apply_event(&mut self, event: &KvEvent) -> Result<ApplyOutcome, EventError> {
        match self.pools.get(&event.worker).copied() {
            Some(pool) => self.pool_mut(pool).router_mut().apply_event(event),
            None => {
                let prefill = self.prefill.router_mut().apply_event(event);
                self.decode.router_mut().apply_event(event).and(prefill)
            }
        }
    }

    /// [`apply_event`](Self::apply_event) with the index's gap policy
    /// (`KvIndex::apply_resyncing`): a sequence gap drops the worker's blocks and the event
    /// becomes a new baseline (`resynced` in the outcome).
    pub fn apply_event_resyncing(&mut self, event: &KvEvent) -> Result<ApplyOutcome, EventError> {
        match self.pools.get(&event.worker).copied() {
            Some(pool) => self
                .pool_mut(pool)
                .router_mut()
                .apply_event_resyncing(event),
            None => {
                let prefill = self.prefill.router_mut().apply_event_resyncing(event);
                self.decode
                    .router_mut()
                    .apply_event_resyncing(event)
                    .and(prefill)
            }
        }
    }

    /// Replaces what the index of `worker`'s pool holds for it (both pools' indexes, for a
    /// worker not registered) with the worker's snapshot of its cache.
    pub fn restore_worker(
        &mut self,
        worker: WorkerId,
        next_seq: Option<u64>,
        stored: &[kv_index::KvEventKind],
    ) -> Result<ApplyOutcome, EventError> {
        match self.pools.get(&worker).copied() {
            Some(pool) => self
                .pool_mut(pool)
                .router_mut()
                .restore_worker(worker, next_seq, stored),
            None => {
                let prefill = self
                    .prefill
                    .router_mut()
                    .restore_worker(worker, next_seq, stored);
                self.decode
                    .router_mut()
                    .restore_worker(worker, next_seq, stored)
                    .and(prefill)
            }
        }
    }

    /// Drops every block the index of `worker`'s pool holds for it (both pools' indexes, for
    /// a worker not registered): its event stream lost messages, so what the index held
    /// cannot be vouched for.
    pub fn clear_worker(&mut self, worker: WorkerId) {
        match self.pools.get(&worker).copied() {
            Some(pool) => self.pool_mut(pool).router_mut().clear_worker(worker),
            None => {
                self.prefill.router_mut().clear_worker(worker);
                self.decode.router_mut().clear_worker(worker);
            }
        }
    }

    /// Admits a request. Ids must be unique among the requests this frontend holds.
    pub fn submit(&mut self, id: RequestId, key: RoutingKey, now: Nanos) {
        self.stages.insert(id, Stage::Decode(key.clone()));
        self.decode.submit(id, key, now);
        self.pump(now);
    }

    /// The prefill leg ended (its KV is on its way to the decode worker): the prefill slot
    /// is free, and the decode worker has no prefill of its own to do.
    pub fn on_prefill_done(&mut self, id: RequestId, now: Nanos) {
        if let Some(Stage::Routed {
            prefill_pending, ..
        }) = self.stages.get_mut(&id)
            && *prefill_pending
        {
            *prefill_pending = false;
            self.prefill.on_first_token(id, now);
            self.prefill.on_finished(id, now);
            self.decode.on_first_token(id, now);
        }
        self.pump(now);
    }

    /// The request's first token reached its client.
    pub fn on_first_token(&mut self, id: RequestId, now: Nanos) {
        self.decode.on_first_token(id, now);
    }

    /// The prefill leg failed after assignment: its slot is released and the request is
    /// re-issued as a local prefill on its decode worker (a new `Assigned` event).
    pub fn on_prefill_failed(&mut self, id: RequestId, now: Nanos) {
        if let Some(Stage::Routed {
            decode,
            prefill_pending,
        }) = self.stages.get_mut(&id)
            && *prefill_pending
        {
            *prefill_pending = false;
            let decode = *decode;
            self.prefill.on_finished(id, now);
            self.events.push_back(DisaggEvent::Assigned {
                id,
                route: Route::Local {
                    decode,
                    reason: LocalReason::PrefillFailed,
                },
            });
        }
        self.pump(now);
    }

    /// A request completed with a reply of `output_tokens` tokens: both pools' policies learn
    /// it ([`Router::on_reply`](crate::Router::on_reply)).
    pub fn on_reply(&mut self, output_tokens: u32) {
        self.prefill.on_reply(output_tokens);
        self.decode.on_reply(output_tokens);
    }

    /// The request finished, failed or was cancelled after routing: its slots are free.
    pub fn on_finished(&mut self, id: RequestId, now: Nanos) {
        if let Some(Stage::Routed {
            prefill_pending, ..
        }) = self.stages.remove(&id)
        {
            if prefill_pending {
                self.prefill.on_finished(id, now);
            }
            self.decode.on_finished(id, now);
        }
        self.pump(now);
    }

    /// Takes a request that has no route yet out of admission (its client went away);
    /// `false` when it is routed (finish it instead) or unknown.
    pub fn cancel(&mut self, id: RequestId, now: Nanos) -> bool {
        let cancelled = match self.stages.get(&id) {
            Some(Stage::Decode(_)) => self.decode.cancel(id),
            Some(Stage::Prefill(_)) => {
                let cancelled = self.prefill.cancel(id);
                if cancelled {
                    self.decode.on_finished(id, now);
                }
                cancelled
            }
            Some(Stage::Routed { .. }) | None => false,
        };
        if cancelled {
            self.stages.remove(&id);
        }
        self.pump(now);
        cancelled
    }

    /// Refuses every waiter and every later submission.
    pub fn shut_down(&mut self) {
        self.decode.shut_down();
        self.prefill.shut_down();
        self.pump(Nanos::ZERO);
    }

    /// When [`handle_timeout`](Self::handle_timeout) is next due.
    pub fn poll_timeout(&self) -> Option<Nanos> {
        match (self.decode.poll_timeout(), self.prefill.poll_timeout()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    pub fn handle_timeout(&mut self, now: Nanos) {
        self.decode.handle_timeout(now);
        self.prefill.handle_timeout(now);
        self.pump(now);
    }

    /// The next outcome, oldest first.
    pub fn poll_event(&mut self) -> Option<DisaggEvent> {
        self.events.pop_front()
    }

    /// Requests waiting in either pool's queue.
    pub fn queued(&self) -> usize {
        self.decode.queued() + self.prefill.queued()
    }

    /// Turns the pools' outcomes into routes. The decode pool's first: a request it assigns
    /// may go on to the prefill pool in the same call.
    fn pump(&mut self, now: Nanos) {
        while let Some(ev) = self.decode.poll_event() {
            match ev {
                FrontendEvent::Assigned { id, decision, .. } => self.plan(id, decision, now),
                FrontendEvent::Refused { id, error } => {
                    self.stages.remove(&id);
                    self.events.push_back(DisaggEvent::Refused { id, error });
                }
            }
        }
        while let Some(ev) = self.prefill.poll_event() {
            let id = ev.id();
            let Some(Stage::Prefill(decode)) = self.stages.get(&id) else {
                continue;
            };
            let decode = *decode;
            let (route, prefill_pending) = match ev {
                FrontendEvent::Assigned { decision, .. } => (
                    Route::Split {
                        prefill: decision,
                        decode,
                    },
                    true,
                ),
                FrontendEvent::Refused { error, .. } => (
                    Route::Local {
                        decode,
                        reason: LocalReason::PrefillUnavailable(error),
                    },
                    false,
                ),
            };
            self.stages.insert(
                id,
                Stage::Routed {
                    decode,
                    prefill_pending,
                },
            );
            self.events.push_back(DisaggEvent::Assigned { id, route });
        }
    }

    /// A decode worker is chosen: prefill there, or ask the prefill pool.
    fn plan(&mut self, id: RequestId, decode: RouteDecision, now: Nanos) {
        let Some(Stage::Decode(key)) = self.stages.remove(&id) else {
            return;
        };
        if decode.new_prefill_tokens <= self.local_prefill_max_tokens {
            self.stages.insert(
                id,
                Stage::Routed {
                    decode,
                    prefill_pending: false,
                },
            );
            self.events.push_back(DisaggEvent::Assigned {
                id,
                route: Route::Local {
                    decode,
                    reason: LocalReason::ShortPrefill,
                },
            });
            return;
        }
        self.stages.insert(id, Stage::Prefill(decode));
        // Its events are drained by the caller's `pump` loop.
        self.prefill.submit(id, key, now);
    }
}

/// Both pools' indexes: [`kv_index::StreamSync`] drives them as one consumer.
impl kv_index::EventSink for DisaggFrontend {
    fn apply_resyncing(&mut self, event: &KvEvent) -> Result<ApplyOutcome, EventError> {
        self.apply_event_resyncing(event)
    }

    fn clear_worker(&mut self, worker: WorkerId) {
        DisaggFrontend::clear_worker(self, worker);
    }

    fn restore_worker(
        &mut self,
        worker: WorkerId,
        next_seq: Option<u64>,
        stored: &[kv_index::KvEventKind],
    ) -> Result<ApplyOutcome, EventError> {
        DisaggFrontend::restore_worker(self, worker, next_seq, stored)
    }
}
