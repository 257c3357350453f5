//! Virtual-time cluster simulator: engines, router, frontend queue and workload in one
//! deterministic loop.
//!
//! The same cores the real-time servers run — `engine::Engine` workers, the `router::Router`,
//! a [`Workload`] such as the seed's multi-turn chat — composed in a discrete-event loop over
//! virtual time ([`Nanos`](nanotime::Nanos)). A run is a pure function of its
//! [`SimConfig`], workload and phases: same inputs, same bytes out.
//!
//! # The loop ([`Simulation`])
//!
//! Every component is sans-IO and says when it next needs the clock. A timer heap with lazy
//! invalidation ([`timers`]) holds one live deadline per source (each engine's step end, the
//! workload's next think-time end, the router's next prediction expiry, the next delayed KV
//! event, the run's schedule); the loop pops the earliest, hands it to its source, then drains
//! what came out until nothing moves: turns from the workload are hashed, routed and
//! submitted; engine events update the request records, the router's accounting
//! (`on_first_token`, `on_finished`), the workload (`on_turn_finished`) and, through KV
//! events, the router's prefix index — in-process at once, or after a fixed delay that
//! models the NATS event plane. Ties at one instant are broken by source (KV events, engines
//! by index, router, workload, schedule), so the order never depends on a hash map.
//!
//! Admission is the gateway's own core, [`router::Frontend`], with the same settings and
//! defaults ([`FrontendConfig`]): a worker at its in-flight cap is not offered to the policy,
//! a bounded queue holds turns while every worker is at it (or while the router refuses for
//! lack of tracking room), and a turn refused or timed out there fails. On the seed workload
//! the cap never binds, so turns are routed at once as Dynamo's frontend does.
//! Engines run in speed mode (`coalesce_decode`) by default: identical decode steps are
//! advanced together, with the same finish times as step-by-step mode.
//!
//! # Disaggregated fleets ([`DisaggSetup`])
//!
//! With [`SimConfig::disagg`] the fleet is a prefill pool (engines of role prefill-only) and
//! a decode pool (decode-only, receiving KV over the setup's link), behind
//! [`router::DisaggFrontend`] — the admission core the gateway runs too, which decides per
//! request between a split route and a local one (conditional disaggregation). The driver
//! only carries the routes out: a split request's prefill leg runs on its prefill worker
//! (whose first token is the client's), and at `PrefillDone` its decode leg is submitted to
//! the decode worker, which waits for its KV transfer; a local one runs whole on the decode
//! worker. KV events of both pools feed the core. Transfers share the links ([`links`],
//! [`DisaggSetup::shared_links`]): concurrent ones out of one prefill worker or into one
//! decode worker split its port's bandwidth, so bursts of long-prompt hand-offs queue.
//! [`Simulation::fail_worker`] takes a worker away mid-run: a prefill leg lost with it is
//! re-issued locally by the core, a request on a lost decode worker fails.
//!
//! # Faults ([`faults`])
//!
//! [`Simulation::with_faults`] injects seeded faults (`kvroute sim --faults`): a crashed,
//! stopped or slow worker, KV events lost, delayed, duplicated or reordered on their way to
//! the index, with the gateway's timeouts and gap policy; invariants are checked after every
//! step and the first violation ends the run with [`SimError::Invariant`].
//!
//! # Measuring ([`Phase`], [`metrics`])
//!
//! A run is a sequence of phases (concurrency levels) back to back, as the seed's operator
//! moved the slider: each phase sets the workload's concurrency, warms up, then measures over
//! snapshot windows whose metrics are averaged. Metric definitions, and exactly which
//! requests each window covers, are in [`metrics`]. The oracle hit rate ([`oracle`]) is
//! computed beside the engines' own.
//!
//! An optional per-worker [`timeline`] (off by default; [`Simulation::with_timeline`])
//! samples every worker's in-flight, running and waiting requests on a fixed virtual-time
//! grid, with the TTFT of each interval, to show what averages hide.
//!
//! # Sweeps ([`bench`](mod@bench))
//!
//! [`bench::BenchSpec`] describes the seed 002 benchmark (routers × levels × sweeps);
//! [`bench::BenchSpec::jobs`] cuts it into independent runs that a caller may run on
//! threads (this crate starts none), and [`bench::aggregate`] puts their results back in a
//! fixed order and averages them into `results.json`'s rows ([`report::BenchResults`]); the
//! `report` crate renders the seed's tables and SVG plots from them.
//!
//! # Module order
//!
//! The modules form a DAG; each uses only those above it (and the `report` crate for the
//! percentile type, the results rows and the SVG charts):
//!
//! 1. [`timers`], [`oracle`], `workload`, `config`, [`faults`] (fault specs, the KV event
//!    delivery layer and the invariant checker), [`links`] (shared KV-transfer links):
//!    leaves;
//! 2. [`metrics`]: request records and window metrics;
//! 3. [`timeline`]: per-worker samples and their charts;
//! 4. `driver`: the event loop ([`Simulation`]), over 1–3;
//! 5. [`bench`](mod@bench): sweeps as jobs, aggregated into results rows;
//! 6. [`chat`]: the seed's chat workload (and seed 004's mix of chat, summarisation and
//!    reasoning, closed or open loop: `workload::WorkloadConfig::mix`, `rate_rps`) run as
//!    bench jobs; [`mix`]: a run's metrics per workload from its records; [`trace`](mod@trace):
//!    a public trace (Mooncake's FAST'25 format) replayed open loop, run as a bench job;
//! 7. [`ladder`]: seed 003's phase ladder (baseline → KV routing → draft model → EAGLE-3) as
//!    a set of benchmarks, merged into one results file; [`disagg`](mod@disagg): seed 004's
//!    named disaggregated layouts, and aggregated vs disaggregated fleets of equal GPU count
//!    as a set of benchmarks, merged the same way.
//!
//! # Invariant and bounds
//!
//! No I/O, no clock, no threads: time is [`Nanos`](nanotime::Nanos), randomness comes from
//! seeds derived from [`SimConfig::seed`] ([`derive_seed`]), ties are broken by a fixed
//! order, so a run is reproducible byte for byte. Memory is bounded by what is simulated:
//! turns in flight (the workload's concurrency, or its `max_open` in the open loop, plus the
//! frontend queue's capacity), the
//! engines' pools and the router's index (sized above the fleet's KV capacity), four samples
//! per request per snapshot window, and the oracle (unbounded by definition unless
//! [`SimConfig::oracle_horizon`] is set). Per-request records are kept only with
//! [`SimConfig::keep_all_records`]; the timeline's rows are bounded by
//! [`TimelineConfig::max_rows`].
//!
//! ```
//! use std::sync::Arc;
//! use engine::HardwareProfile;
//! use nanotime::Nanos;
//! use router::PolicyKind;
//! use sim::{Phase, SimConfig, Simulation, Turn, TurnKey, Workload};
//!
//! /// One conversation of one turn, issued at time zero.
//! struct OneTurn(Option<Turn>, bool);
//! impl Workload for OneTurn {
//!     fn poll_timeout(&self) -> Option<Nanos> { None }
//!     fn handle_timeout(&mut self, _: Nanos) {}
//!     fn poll_request(&mut self) -> Option<Turn> { self.0.take() }
//!     fn on_turn_finished(&mut self, _: TurnKey, _: Nanos) { self.1 = true; }
//!     fn on_turn_failed(&mut self, _: TurnKey, _: Nanos) {}
//!     fn set_concurrency(&mut self, _: u32, _: Nanos) {}
//!     fn active_conversations(&self) -> u32 { u32::from(!self.1) }
//! }
//!
//! let turn = Turn {
//!     key: TurnKey { conversation: 0, turn: 0 },
//!     prompt: (0..3_500).collect::<Vec<u32>>().into(),
//!     output: (0..100).collect::<Vec<u32>>().into(),
//!     issued_at: Nanos::ZERO,
//! };
//! let cfg = SimConfig::new(3, HardwareProfile::h200_llama70b_fp8(), PolicyKind::Kv);
//! let phase = Phase {
//!     concurrency: 1,
//!     warmup: Nanos::ZERO,
//!     window: Nanos::from_secs(10),
//!     snapshots: 1,
//!     lookback: None,
//! };
//! let sim = Simulation::new(cfg, OneTurn(Some(turn), false), vec![phase]).unwrap();
//! let out = sim.run(|_| {}).unwrap();
//! assert_eq!(out.totals.finished, 1);
//! let ttft = out.phases[0].metrics.ttft_ms.p50.unwrap();
//! assert!(ttft > 50.0 && ttft < 2_000.0, "{ttft}");
//! ```

pub mod bench;
pub mod chat;
mod config;
pub mod disagg;
mod driver;
pub mod faults;
pub mod ladder;
pub mod links;
pub mod metrics;
pub mod mix;
pub mod oracle;
mod replicas;
pub mod scenario;
pub mod timeline;
pub mod timers;
pub mod trace;
mod workload;

pub use config::{ConfigError, DisaggSetup, Phase, ReplicaSetup, RouterSetup, SimConfig};
pub use driver::{
    PhaseResult, PoolMetrics, RunOutput, RunTotals, SimError, Simulation, WorkerStats, derive_seed,
    streams,
};
pub use metrics::{Metrics, Outcome, RequestRecord};
pub use replicas::ReplicaTotals;
pub use report::Percentiles;
pub use router::{FailoverConfig, FrontendConfig};
pub use timeline::{Timeline, TimelineConfig, TimelineError};
pub use workload::{ServingPath, Turn, TurnKey, Workload};

/// The serving path's round trip outside the GPUs in seed 002's deployment (load generator,
/// cloud load balancer, Dynamo frontend, network), fitted to its TTFT at low load where no
/// queueing happens (docs/CALIBRATION.md). `kvroute sim` / `bench` use it by default.
pub const SEED_002_PATH_LATENCY_MS: f64 = 200.0;
