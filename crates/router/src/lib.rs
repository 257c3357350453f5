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

mod kv_load;
mod load;
pub mod policy;
mod router;

pub use kv_load::{KvLoad, KvLoadParams};
pub use load::WorkerLoad;
pub use policy::{
    Candidate, KvCost, KvCostParams, PolicyKind, PolicyParams, Random, RoundRobin, RoutingPolicy,
    SelectionContext, UnknownPolicy, WorkerLimits, WorkerTiming,
};
pub use router::{
    KvSource, RequestId, RouteDecision, RouteError, Router, RouterConfig, RouterConfigError,
    RouterCounters, RoutingKey,
};
