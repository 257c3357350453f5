//! The router core: which worker should serve this request?
//!
//! Sans-IO: no clock, no I/O, no tokio. The same code routes in the real-time gateway and in
//! the virtual-time simulator; time is an argument and randomness comes from a seeded RNG, so
//! a run is reproducible.
//!
//! - [`Router`]: owns the prefix index (`kv-index`), its own accounting of each worker's load
//!   ([`WorkerLoad`]: in-flight requests, prefill tokens pending until first token, active KV
//!   blocks) and a [`RoutingPolicy`]. The caller drives each request through
//!   [`Router::route`] → [`Router::on_first_token`] → [`Router::on_finished`], and feeds KV
//!   events through [`Router::apply_event`]. A request placed without `route` (by another
//!   router replica, or pinned) enters the accounting through [`Router::on_routed`].
//! - [`policy`]: the built-in policies — `round_robin`, `random` (seeded), `kv`
//!   (Dynamo-compatible cost `overlap_weight × prefill_blocks + decode_blocks`, lowest wins,
//!   random tie break, optional softmax temperature) and [`KvLoad`] (`kv_load`, kvroute's
//!   load-aware KV policy and the default: cache affinity priced in seconds from each worker's
//!   timing, within each worker's batch and KV limits) — and the [`RoutingPolicy`] trait that
//!   new policies implement without touching callers.
//! - Approximate mode ([`KvSource::Approximate`]): without KV events, every routed prompt is
//!   assumed cached on its worker until a TTL after it was last routed.
//! - [`Frontend`]: admission in front of the router, the same code in the gateway and the
//!   simulator — a per-worker in-flight cap applied to selection, a bounded FIFO queue with a
//!   timeout, outcomes drained as [`FrontendEvent`]s ([`FrontendConfig`] holds the one set of
//!   defaults); a worker leaving a pool drains first ([`Frontend::drain_worker`]). Drivers submit requests here rather than calling [`Router::route`].
//! - [`DisaggFrontend`]: disaggregated prefill/decode admission — a decode pool and a prefill
//!   pool (one [`Frontend`] each), and the conditional-disaggregation decision: prefill on the
//!   decode worker when little of the prompt is uncached there, on a prefill worker otherwise,
//!   with a local fallback when no prefill worker can take it ([`Route`], [`DisaggEvent`]).
//! - [`replica`]: router replicas that route as one — each tells its peers what it routed
//!   and when it ended ([`ReplicaSync`], [`PeerUpdate`]), and counts their requests in its
//!   own load accounting, in order, deduplicated and bounded.
//! - [`ejection`]: outlier ejection with a minimum ejection time growing with failures in a
//!   row (Envoy's `base_ejection_time`), asked before a health check returns a worker.
//! - [`migration`]: request migration — whether a request whose worker broke or stalled
//!   mid-stream is resent to another worker, and its continuation (prompt + output so far,
//!   `max_tokens` reduced, usage of every worker) — and [`FailoverConfig`], the deadlines,
//!   migration limit and ejection time with the one set of defaults the gateway and the
//!   simulator read.
//! - [`autoscale`]: pool autoscaling with KEDA's and the HPA's semantics (a latency quantile
//!   against a threshold, activation, cooldown, stabilization, bounds, pause), the same
//!   decisions in the simulator and the demo.
//!
//! ```
//! use std::num::NonZeroU32;
//!
//! use kv_index::WorkerId;
//! use nanotime::Nanos;
//! use router::{
//!     AdmitError, Frontend, FrontendConfig, FrontendEvent, RequestId, RouterConfig, WorkerLimits,
//! };
//!
//! let config = FrontendConfig {
//!     max_in_flight_per_worker: NonZeroU32::new(1),
//!     queue_capacity: 1,
//!     queue_timeout: Some(Nanos::from_secs(5)),
//! };
//! let mut frontend = Frontend::new(RouterConfig::default(), config).unwrap();
//! frontend.add_worker(WorkerId(1), WorkerLimits::default(), Nanos::ZERO).unwrap();
//! let prompt: Vec<u32> = (0..4096).collect();
//! let key = frontend.router().key(&prompt);
//!
//! // The only slot is free: routed at once.
//! frontend.submit(RequestId(7), key.clone(), Nanos::ZERO);
//! let Some(FrontendEvent::Assigned { decision, .. }) = frontend.poll_event() else { panic!() };
//! assert_eq!(decision.worker, WorkerId(1));
//!
//! // The worker is full: the next request waits, the one after finds the queue full.
//! frontend.submit(RequestId(8), key.clone(), Nanos::from_millis(10));
//! frontend.submit(RequestId(9), key.clone(), Nanos::from_millis(20));
//! assert_eq!(frontend.poll_event().unwrap().id(), RequestId(9));
//! assert_eq!(frontend.poll_timeout(), Some(Nanos::from_millis(5_010)));
//!
//! // Request 7's first token and end free the slot for request 8.
//! frontend.on_first_token(RequestId(7), Nanos::from_millis(300));
//! frontend.on_finished(RequestId(7), Nanos::from_secs(3));
//! assert!(matches!(
//!     frontend.poll_event(),
//!     Some(FrontendEvent::Assigned { id: RequestId(8), queued: true, .. })
//! ));
//!
//! // Nobody frees the slot again: a new waiter times out when its deadline comes.
//! frontend.submit(RequestId(10), key, Nanos::from_secs(4));
//! frontend.handle_timeout(Nanos::from_secs(9));
//! assert!(matches!(
//!     frontend.poll_event(),
//!     Some(FrontendEvent::Refused { error: AdmitError::QueueTimeout { .. }, .. })
//! ));
//! ```
//!
//! The [`Router`] alone, for a caller that admits requests itself:
//!
//! ```
//! use kv_index::WorkerId;
//! use nanotime::Nanos;
//! use router::{RequestId, Router, RouterConfig, WorkerLimits};
//!
//! let mut router = Router::new(RouterConfig::default()).unwrap();
//! router.add_worker(WorkerId(1), WorkerLimits::default()).unwrap();
//! router.add_worker(WorkerId(2), WorkerLimits::default()).unwrap();
//! let prompt: Vec<u32> = (0..4096).collect();
//! let key = router.key(&prompt);
//! let decision = router.route(RequestId(7), &key, Nanos::ZERO).unwrap();
//! router.on_first_token(RequestId(7), Nanos::from_millis(300));
//! router.on_finished(RequestId(7), Nanos::from_secs(30));
//! assert!(decision.worker == WorkerId(1) || decision.worker == WorkerId(2));
//! ```

pub mod autoscale;
mod disagg;
pub mod ejection;
mod frontend;
mod kv_load;
mod load;
pub mod migration;
pub mod peers;
pub mod policy;
pub mod replica;
mod router;

pub use disagg::{DisaggConfig, DisaggEvent, DisaggFrontend, LocalReason, Pool, Route};
pub use ejection::{EjectionConfig, Ejections};
pub use frontend::{AdmitError, Frontend, FrontendConfig, FrontendEvent};
pub use kv_load::{KvLoad, KvLoadParamError, KvLoadParams};
pub use load::WorkerLoad;
pub use migration::{
    ChoiceOutput, ChunkIds, Continuation, DeadlineVerdict, Decision, FailoverConfig, FailureReason,
    MAX_MIGRATED_CHOICES, MigrationState, NotMigrated, TokenUsage, judge_deadline,
};
pub use policy::{
    Candidate, KvCost, KvCostParams, PolicyKind, PolicyParams, PolicyRng, Random, RoundRobin,
    RoutingPolicy, SelectionContext, UnknownPolicy, WorkerLimits, WorkerTiming,
};
pub use replica::{
    PeerChange, PeerSnapshot, PeerUpdate, ReplicaId, ReplicaSync, ReplicaSyncConfig, ReplicaTiming,
    SnapshotRequest,
};
pub use router::{
    CacheView, KvSource, RequestId, RouteDecision, RouteError, Router, RouterConfig,
    RouterConfigError, RouterCounters, RoutingKey,
};
