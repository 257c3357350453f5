//! Frontend admission: the one decision of which waiting request goes to the router, and when.
//!
//! Both drivers use this core — the gateway (real time, a thin async shell) and the simulator
//! (virtual time) — so a request is admitted, queued, refused or timed out by the same rules in
//! both. A [`Frontend`] owns the [`Router`] and adds:
//!
//! - a per-worker in-flight cap applied to *selection*: the policy only ever sees the workers
//!   with a free slot, so a full worker is never chosen while another has room;
//! - a bounded FIFO queue for requests that arrive while every worker is full (or while the
//!   router's own bound on tracked requests is reached); a release pumps the queue in order;
//! - a queue timeout, driven like every core here: [`Frontend::poll_timeout`] says when the
//!   clock is next needed (the queue's head or the router's prediction expiry, whichever is
//!   first), [`Frontend::handle_timeout`] acts on it;
//! - outcomes drained as [`FrontendEvent`]s with [`Frontend::poll_event`]: assigned or refused
//!   (queue full, no workers, shutting down, a routing error, a queue timeout).

use std::collections::VecDeque;
use std::num::NonZeroU32;

use kv_index::WorkerId;
use nanotime::Nanos;

use crate::policy::{Candidate, PolicyRng, RoutingPolicy, SelectionContext, WorkerLimits};
use crate::router::{
    RequestId, RouteDecision, RouteError, Router, RouterConfig, RouterConfigError, RoutingKey,
};

/// Admission settings, shared by the gateway and the simulator (one set of defaults).
///
/// The defaults are the gateway's, chosen for a real service where every bound must hold:
///
/// - `max_in_flight_per_worker = 256`: vLLM's largest default `max_num_seqs`. Past a worker's
///   batch limit a request only waits inside that engine, where nothing can move it to a worker
///   that frees up first; 256 sits far above the limits load-aware policies already respect
///   (seed 002's engines run 64), so the cap is a safety net against a stuck worker, not a
///   second policy. It never binds in seed 002's benchmark (at most 180 conversations in flight
///   over the whole fleet, 81 at most on one worker), so the simulator's results are those of
///   an uncapped frontend there.
/// - `queue_capacity = 1024`: a burst of four workers' caps may wait; beyond that the service
///   is overloaded and refuses at once rather than holding memory and clients.
/// - `queue_timeout = 30 s`: two orders of magnitude above any TTFT objective; a request that
///   waited that long is better refused, so its client can retry or give up.
///
/// In the simulator a refused or timed-out turn fails and is reported to the workload, as a
/// gateway client would see a 429 or a 503.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrontendConfig {
    /// Requests in flight on one worker (as the router accounts them) before the policy stops
    /// seeing it; `None`: no cap (the queue then only holds requests while the router's
    /// `max_in_flight` bound is reached).
    pub max_in_flight_per_worker: Option<NonZeroU32>,
    /// Most requests waiting at once; a request arriving at a full queue is refused. Zero
    /// refuses every request that cannot be routed at once.
    pub queue_capacity: usize,
    /// Longest wait in the queue before the request is refused; `None`: wait until served.
    pub queue_timeout: Option<Nanos>,
}

impl FrontendConfig {
    /// The default per-worker cap (see the type's docs).
    pub const DEFAULT_MAX_IN_FLIGHT_PER_WORKER: NonZeroU32 = NonZeroU32::new(256).unwrap();
    pub const DEFAULT_QUEUE_CAPACITY: usize = 1024;
    pub const DEFAULT_QUEUE_TIMEOUT: Nanos = Nanos::from_secs(30);
}

impl Default for FrontendConfig {
    fn default() -> Self {
        Self {
            max_in_flight_per_worker: Some(Self::DEFAULT_MAX_IN_FLIGHT_PER_WORKER),
            queue_capacity: Self::DEFAULT_QUEUE_CAPACITY,
            queue_timeout: Some(Self::DEFAULT_QUEUE_TIMEOUT),
        }
    }
}

/// Why a request got no worker.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdmitError {
    #[error("no healthy worker is available")]
    NoWorkers,
    #[error("all workers are at capacity and {capacity} requests are already queued")]
    QueueFull { capacity: usize },
    #[error("no worker slot became free within {waited}")]
    QueueTimeout { waited: Nanos },
    #[error("the frontend is shutting down")]
    ShuttingDown,
    #[error("routing failed: {0}")]
    Route(RouteError),
}

impl From<RouteError> for AdmitError {
    fn from(e: RouteError) -> Self {
        match e {
            RouteError::NoWorkers => AdmitError::NoWorkers,
            other => AdmitError::Route(other),
        }
    }
}

/// What became of a submitted request. Each submitted request gets exactly one event, unless
/// it is cancelled while queued.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FrontendEvent {
    /// Routed to `decision.worker`: the router accounts for it there until
    /// [`Frontend::on_finished`].
    Assigned {
        id: RequestId,
        decision: RouteDecision,
        /// It waited in the queue first.
        queued: bool,
    },
    /// Not routed, and no longer held by the frontend.
    Refused { id: RequestId, error: AdmitError },
}

impl FrontendEvent {
    pub fn id(&self) -> RequestId {
        match self {
            Self::Assigned { id, .. } | Self::Refused { id, .. } => *id,
        }
    }
}

#[derive(Debug)]
struct Waiter {
    id: RequestId,
    key: RoutingKey,
    since: Nanos,
    deadline: Option<Nanos>,
}

/// The admission core: a [`Router`] behind a bounded FIFO queue and a per-worker cap. See the
/// module docs.
///
/// Sans-IO: time is an argument, outcomes are drained with [`poll_event`](Frontend::poll_event)
/// after every call. Requests go in through [`submit`](Frontend::submit) and leave the
/// accounting through [`on_finished`](Frontend::on_finished) (which also serves the queue);
/// workers join and leave through [`add_worker`](Frontend::add_worker) and
/// [`remove_worker`](Frontend::remove_worker), so waiters are served or failed at once. KV
/// events and read-only questions go to the router itself ([`router`](Frontend::router),
/// [`router_mut`](Frontend::router_mut)).
#[derive(Debug)]
pub struct Frontend {
    router: Router,
    config: FrontendConfig,
    /// Waiting requests, oldest first; bounded by `config.queue_capacity`. Deadlines are
    /// nondecreasing from front to back (one timeout, arrival order).
    queue: VecDeque<Waiter>,
    /// Outcomes not yet drained; each call adds at most one per request it touches, so this
    /// holds at most the queue plus one.
    events: VecDeque<FrontendEvent>,
    /// The router refused the queue's head for lack of tracking room: wait for a release.
    router_full: bool,
    shutting_down: bool,
    /// Draining workers now idle, for [`Frontend::take_drained`]; at most one entry per
    /// registered worker.
    drained: VecDeque<WorkerId>,
}

impl Frontend {
    /// A frontend whose router runs the built-in policy named in `router`.
    pub fn new(router: RouterConfig, config: FrontendConfig) -> Result<Self, RouterConfigError> {
        let policy = router.policy.build(router.params);
        Self::with_policy(router, policy, config)
    }

    /// A frontend whose router runs any policy; the cap restricts what the policy sees.
    pub fn with_policy(
        router: RouterConfig,
        policy: Box<dyn RoutingPolicy>,
        config: FrontendConfig,
    ) -> Result<Self, RouterConfigError> {
        let gate = CapacityGate {
            inner: policy,
            cap: config.max_in_flight_per_worker.map(NonZeroU32::get),
            open: Vec::new(),
            positions: Vec::new(),
        };
        Ok(Self {
            router: Router::with_policy(router, Box::new(gate))?,
            config,
            queue: VecDeque::new(),
            events: VecDeque::new(),
            router_full: false,
            shutting_down: false,
            drained: VecDeque::new(),
        })
    }

    pub fn config(&self) -> &FrontendConfig {
        &self.config
    }

    /// The router, for questions (loads, overlaps, counters, hashing).
    pub fn router(&self) -> &Router {
        &self.router
    }

    /// The router, for KV events and index maintenance. Route requests and change workers
    /// through the frontend instead, or the queue is not served.
    pub fn router_mut(&mut self) -> &mut Router {
        &mut self.router
    }

    /// Requests waiting in the queue.
    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    /// Admits a request: routed at once when a worker has a free slot and nobody waits,
    /// queued otherwise, refused when the queue is full, no worker is registered or the
    /// frontend is shutting down. Ids must be unique among the requests the frontend holds.
    pub fn submit(&mut self, id: RequestId, key: RoutingKey, now: Nanos) {
        if self.shutting_down {
            return self.refuse(id, AdmitError::ShuttingDown);
        }
        if self.router.routable_workers().next().is_none() {
            return self.refuse(id, AdmitError::NoWorkers);
        }
        if self.queue.is_empty() && self.may_route() {
            match self.router.route(id, &key, now) {
                Ok(decision) => {
                    return self.events.push_back(FrontendEvent::Assigned {
                        id,
                        decision,
                        queued: false,
                    });
                }
                // Wait for a release like any queued request.
                Err(RouteError::TooManyInFlight { .. }) => self.router_full = true,
                Err(e) => return self.refuse(id, e.into()),
            }
        }
        if self.queue.len() >= self.config.queue_capacity {
            let capacity = self.config.queue_capacity;
            return self.refuse(id, AdmitError::QueueFull { capacity });
        }
        self.queue.push_back(Waiter {
            id,
            key,
            since: now,
            deadline: self.config.queue_timeout.map(|t| now.saturating_add(t)),
        });
    }

    /// Takes a waiting request out of the queue (its client went away). `false` when it was
    /// not waiting: already assigned or refused (its event says which), or never submitted.
    pub fn cancel(&mut self, id: RequestId) -> bool {
        let Some(pos) = self.queue.iter().position(|w| w.id == id) else {
            return false;
        };
        self.queue.remove(pos);
        true
    }

    /// The request produced its first token (see [`Router::on_first_token`]).
    pub fn on_first_token(&mut self, id: RequestId, now: Nanos) {
        self.router.on_first_token(id, now);
    }

    /// Counts a request another router replica sent to `worker` (see [`Router::on_routed`]);
    /// it leaves the accounting through [`on_finished`](Frontend::on_finished) like a routed
    /// one. It takes a slot without waiting: the peer has already sent it.
    pub fn on_peer_routed(
        &mut self,
        id: RequestId,
        worker: WorkerId,
        key: &RoutingKey,
        now: Nanos,
    ) -> Result<RouteDecision, RouteError> {
        self.router.on_routed(id, worker, key, now)
    }

    /// A request completed with a reply of `output_tokens` tokens ([`Router::on_reply`]).
    pub fn on_reply(&mut self, output_tokens: u32) {
        self.router.on_reply(output_tokens);
    }

    /// The request finished, failed or was cancelled after routing: its slot goes to the
    /// queue's head.
    pub fn on_finished(&mut self, id: RequestId, now: Nanos) {
        let worker = self.router.worker_of(id);
        self.router.on_finished(id, now);
        if let Some(worker) = worker {
            self.note_if_drained(worker);
        }
        self.router_full = false;
        self.serve_queue(now);
    }

    /// Registers a worker (or updates its limits); waiters may now be served.
    pub fn add_worker(
        &mut self,
        worker: WorkerId,
        limits: WorkerLimits,
        now: Nanos,
    ) -> Result<(), RouteError> {
        let added = self.router.add_worker(worker, limits);
        self.serve_queue(now);
        added
    }

    /// Forgets a worker (see [`Router::remove_worker`], whose orphaned requests it returns).
    /// When no worker is left, every waiter is refused at once rather than at its timeout.
    pub fn remove_worker(&mut self, worker: WorkerId, now: Nanos) -> Vec<RequestId> {
        self.drained.retain(|w| *w != worker);
        let orphans = self.router.remove_worker(worker);
        if !orphans.is_empty() {
            self.router_full = false;
        }
        self.serve_queue(now);
        orphans
    }

    /// Starts draining `worker` (scaling its pool down): it gets no new request; once its
    /// in-flight requests have finished, [`take_drained`](Frontend::take_drained) names it and
    /// the driver stops it and calls [`remove_worker`](Frontend::remove_worker). Waiters
    /// with no other worker left are refused. `false` for an unknown worker.
    pub fn drain_worker(&mut self, worker: WorkerId, now: Nanos) -> bool {
        if !self.router.set_draining(worker, true) {
            return false;
        }
        self.note_if_drained(worker);
        self.serve_queue(now);
        true
    }

    /// A draining worker whose last request has finished, oldest first.
    pub fn take_drained(&mut self) -> Option<WorkerId> {
        self.drained.pop_front()
    }

    fn note_if_drained(&mut self, worker: WorkerId) {
        if self.router.is_draining(worker)
            && self.router.load(worker).is_some_and(|l| l.in_flight == 0)
            && !self.drained.contains(&worker)
        {
            self.drained.push_back(worker);
        }
    }

    /// Refuses every waiter and every later submission.
    pub fn shut_down(&mut self) {
        self.shutting_down = true;
        self.refuse_all(AdmitError::ShuttingDown);
    }

    /// When [`handle_timeout`](Frontend::handle_timeout) is next due: the queue's first
    /// deadline or the router's next prediction expiry, whichever is earlier.
    pub fn poll_timeout(&self) -> Option<Nanos> {
        let queue = self.queue.front().and_then(|w| w.deadline);
        match (queue, self.router.poll_timeout()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Refuses waiters whose deadline is at or before `now`, and expires the router's due
    /// predictions.
    pub fn handle_timeout(&mut self, now: Nanos) {
        self.router.handle_timeout(now);
        while let Some(w) = self.queue.front() {
            if w.deadline.is_none_or(|d| d > now) {
                break;
            }
            let waited = now.saturating_sub(w.since);
            let id = w.id;
            self.queue.pop_front();
            self.refuse(id, AdmitError::QueueTimeout { waited });
        }
    }

    /// The next outcome, oldest first.
    pub fn poll_event(&mut self) -> Option<FrontendEvent> {
        self.events.pop_front()
    }

    /// Whether a request may be routed now: the router has tracking room and some worker a
    /// free slot.
    fn may_route(&self) -> bool {
        if self.router_full {
            return false;
        }
        match self.config.max_in_flight_per_worker {
            None => true,
            Some(cap) => self
                .router
                .routable_workers()
                .any(|(_, load)| load.in_flight < cap.get()),
        }
    }

    /// Routes waiters, in order, while there is room; refuses them all when no worker is left.
    fn serve_queue(&mut self, now: Nanos) {
        if self.router.routable_workers().next().is_none() {
            return self.refuse_all(AdmitError::NoWorkers);
        }
        while !self.queue.is_empty() && self.may_route() {
            let Some(w) = self.queue.pop_front() else {
                break;
            };
            match self.router.route(w.id, &w.key, now) {
                Ok(decision) => self.events.push_back(FrontendEvent::Assigned {
                    id: w.id,
                    decision,
                    queued: true,
                }),
                Err(RouteError::TooManyInFlight { .. }) => {
                    // Keep its place at the head until a request finishes.
                    self.router_full = true;
                    self.queue.push_front(w);
                }
                Err(e) => self.refuse(w.id, e.into()),
            }
        }
    }

    fn refuse(&mut self, id: RequestId, error: AdmitError) {
        self.events.push_back(FrontendEvent::Refused { id, error });
    }

    fn refuse_all(&mut self, error: AdmitError) {
        while let Some(w) = self.queue.pop_front() {
            self.refuse(w.id, error.clone());
        }
    }
}

/// Restricts any policy to the workers with a free slot, so a full worker is never chosen
/// while another has room (the policies see load but do not enforce a cap). With every worker
/// open — always, below the cap — the policy sees the router's own candidate list, so its
/// decisions (and its random draws) are exactly those of the ungated policy.
#[derive(Debug)]
struct CapacityGate {
    inner: Box<dyn RoutingPolicy>,
    cap: Option<u32>,
    /// Scratch: the open candidates and their positions in the full list.
    open: Vec<Candidate>,
    positions: Vec<usize>,
}

impl RoutingPolicy for CapacityGate {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn observe_reply(&mut self, output_tokens: u32) {
        self.inner.observe_reply(output_tokens);
    }

    fn select(&mut self, ctx: &SelectionContext<'_>, rng: &mut PolicyRng) -> usize {
        let Some(cap) = self.cap else {
            return self.inner.select(ctx, rng);
        };
        // Counted before copying: below the cap (almost always) every worker is open and a
        // fleet of a thousand candidates is not copied per decision.
        let open = ctx
            .candidates
            .iter()
            .filter(|c| c.load.in_flight < cap)
            .count();
        if open == 0 || open == ctx.candidates.len() {
            return self.inner.select(ctx, rng);
        }
        self.open.clear();
        self.positions.clear();
        for (i, c) in ctx.candidates.iter().enumerate() {
            if c.load.in_flight < cap {
                self.open.push(*c);
                self.positions.push(i);
            }
        }
        let open = SelectionContext {
            candidates: &self.open,
            ..*ctx
        };
        let chosen = self.inner.select(&open, rng);
        // Out of range stays out of range, so the router reports the policy's bug.
        self.positions.get(chosen).copied().unwrap_or(usize::MAX)
    }
}
