//! What a run simulates (fleet, router, frontend) and how it is measured (phases, snapshots).

use engine::{EngineConfig, HardwareProfile, KvLink};
use nanotime::Nanos;
use router::{FailoverConfig, FrontendConfig, KvSource, PolicyKind, PolicyParams};
use thiserror::Error;

/// The router in front of the fleet.
#[derive(Debug, Clone, PartialEq)]
pub struct RouterSetup {
    /// The policy, chosen by name through [`PolicyKind`]'s `FromStr` (the router crate owns
    /// the list, so a new policy there is a new name here).
    pub policy: PolicyKind,
    /// Parameters of the built-in policies: `kv`'s cost (overlap weight, softmax
    /// temperature) and `kv_load`'s.
    pub params: PolicyParams,
    /// KV events from the engines, or approximate mode (no events, predictions with a TTL).
    pub kv_source: KvSource,
    /// Fixed delay between an engine emitting a KV event and the router applying it (models
    /// the NATS event plane). Zero delivers in-process at once.
    pub kv_event_delay: Nanos,
}

impl RouterSetup {
    pub fn new(policy: PolicyKind) -> Self {
        Self {
            policy,
            params: PolicyParams::default(),
            kv_source: KvSource::Events,
            kv_event_delay: Nanos::ZERO,
        }
    }
}

/// One simulated cluster.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// Number of workers (engines), ids `0..workers`.
    pub workers: u32,
    /// Every worker's engine settings. Each worker's speculative-decoding seed is derived
    /// from [`SimConfig::seed`].
    pub engine: EngineConfig,
    pub router: RouterSetup,
    /// Admission in front of the router: the gateway's settings, with its defaults.
    pub frontend: FrontendConfig,
    /// What the gateway does when a worker fails a request (deadlines, migration limit,
    /// ejection time), with its defaults; acted on under injected faults
    /// ([`crate::faults`]).
    pub failover: FailoverConfig,
    /// Round trip of the serving path outside the GPUs (client, load balancer, frontend,
    /// network), added to every turn's TTFT and E2E ([`crate::ServingPath`]).
    pub path_latency: Nanos,
    /// The run's seed: router, engines and workload seeds derive from it.
    pub seed: u64,
    /// Compute the oracle hit rate beside the real one ([`crate::oracle`]).
    pub oracle: bool,
    /// Let the oracle forget blocks unseen for this long (`None`: never, the definition);
    /// bounds its memory on fleet-scale runs of hours.
    pub oracle_horizon: Option<Nanos>,
    /// Keep every request's record in [`crate::RunOutput::records`] (metrics never need
    /// them: windows keep only their samples).
    pub keep_all_records: bool,
    /// Also measure TTFT by turn (turn 1 vs turns 2+) and decode tokens per step (seed 003's
    /// figures). Off, the metrics are exactly seed 002's, so its results files stay as they
    /// are; acceptance and tokens per step are measured whenever speculative decoding is on.
    pub extended_metrics: bool,
    /// Also measure reuse attribution ([`report::ReuseRates`]: the prefix any worker held
    /// and the one the router predicted, beside the engines' hit rate). Off, the results
    /// files stay as they are.
    pub reuse_attribution: bool,
    /// Prefill and decode pools instead of aggregated workers (`None`: every worker does
    /// both, as the seeds' fleets).
    pub disagg: Option<DisaggSetup>,
    /// Measure goodput against these objectives (and, with pools, the routes and KV
    /// transfers): [`report::ServingMetrics`] in every window. `None` keeps the metrics
    /// exactly seed 002's. Set by itself when `disagg` is.
    pub slo: Option<report::Slo>,
    /// The most workers a run may create in all, counting those added at run time by
    /// [`crate::Simulation::add_worker`] (ids are never reused); sizes the router's index.
    /// `None`: [`SimConfig::workers`], a fleet that never grows.
    pub max_workers: Option<u32>,
    /// Router replicas in front of the fleet, and how they share their routing decisions.
    /// One replica (the default) is a single gateway, exactly as before replicas existed.
    pub replicas: ReplicaSetup,
}

/// Several gateway replicas behind one address (`kvroute sim --gateway-replicas`): each turn
/// goes to the next replica in turn (a client spreading requests round-robin), every replica
/// applies every worker's KV events, and each counts its peers' requests in its load only as
/// `router::ReplicaSync` updates reach it, `sync` after they happen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplicaSetup {
    /// Replicas, at least one.
    pub count: u32,
    /// Delivery delay of a replica's updates to its peers (the staleness bound of each
    /// replica's view of the others' load); `None`: no sync, each replica sees only its own
    /// requests.
    pub sync: Option<Nanos>,
}

impl Default for ReplicaSetup {
    fn default() -> Self {
        Self {
            count: 1,
            sync: Some(Nanos::ZERO),
        }
    }
}

/// A disaggregated fleet: `prefill_workers` engines of role prefill-only (ids
/// `0..prefill_workers`), then `decode_workers` of role decode-only, behind
/// `router::DisaggFrontend`. [`SimConfig::workers`] is their sum.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DisaggSetup {
    pub prefill_workers: u32,
    pub decode_workers: u32,
    /// Uncached prompt tokens up to which a decode worker prefills a request itself
    /// (`router::DisaggConfig::local_prefill_max_tokens`).
    pub local_prefill_max_tokens: u32,
    /// How a decode worker receives KV from a prefill worker: NVLink inside a node, the
    /// network between nodes.
    pub kv_link: KvLink,
    /// Concurrent transfers share each worker's port (`crate::links::LinkShare`: a prefill
    /// worker's way out, a decode worker's way in); false: every transfer has the whole
    /// link to itself (the profile's `kv_transfer_time`).
    pub shared_links: bool,
}

impl DisaggSetup {
    /// `prefill` + `decode` workers with the router's default threshold, over NVLink.
    pub fn new(prefill: u32, decode: u32) -> Self {
        Self {
            prefill_workers: prefill,
            decode_workers: decode,
            local_prefill_max_tokens: router::DisaggConfig::default().local_prefill_max_tokens,
            kv_link: KvLink::Nvlink,
            shared_links: true,
        }
    }

    pub fn workers(&self) -> u32 {
        self.prefill_workers.saturating_add(self.decode_workers)
    }
}

impl SimConfig {
    /// `workers` engines of `profile` with its engine defaults, speed mode on
    /// (`coalesce_decode`), the given policy, KV events in-process, the gateway's admission
    /// defaults, no serving-path latency.
    pub fn new(workers: u32, profile: HardwareProfile, policy: PolicyKind) -> Self {
        let mut engine = EngineConfig::from_profile(profile);
        engine.coalesce_decode = true;
        Self {
            workers,
            engine,
            router: RouterSetup::new(policy),
            frontend: FrontendConfig::default(),
            failover: FailoverConfig::default(),
            path_latency: Nanos::ZERO,
            seed: 0,
            oracle: true,
            oracle_horizon: None,
            keep_all_records: false,
            extended_metrics: false,
            reuse_attribution: false,
            disagg: None,
            slo: None,
            max_workers: None,
            replicas: ReplicaSetup::default(),
        }
    }

    /// A disaggregated fleet of `setup` on `profile` (goodput measured against seed 004's
    /// objectives).
    pub fn disaggregated(setup: DisaggSetup, profile: HardwareProfile, policy: PolicyKind) -> Self {
        let mut cfg = Self::new(setup.workers(), profile, policy);
        cfg.disagg = Some(setup);
        cfg.slo = Some(report::Slo::SEED_004);
        cfg
    }
}

/// One concurrency level of a run: warm up, then measure.
///
/// The measurement window is cut into `snapshots` equal intervals. Snapshot `k` (1-based) is
/// taken at `start + warmup + k × window / snapshots` and, like the seed's Prometheus summary,
/// covers the `lookback` before that instant: `(T_k − lookback, T_k]`. With `lookback = None`
/// it covers its own interval, so the snapshots tile the window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Phase {
    pub concurrency: u32,
    pub warmup: Nanos,
    pub window: Nanos,
    pub snapshots: u32,
    pub lookback: Option<Nanos>,
}

impl Phase {
    pub fn duration(&self) -> Nanos {
        self.warmup + self.window
    }

    /// Interval between snapshots.
    pub fn interval(&self) -> Nanos {
        Nanos(self.window.0 / u64::from(self.snapshots.max(1)))
    }

    pub fn lookback(&self) -> Nanos {
        self.lookback.unwrap_or_else(|| self.interval())
    }

    /// The snapshot windows `(from, to]` of this phase when it starts at `start`.
    pub fn windows(&self, start: Nanos) -> Vec<(Nanos, Nanos)> {
        let interval = self.interval();
        (1..=u64::from(self.snapshots))
            .map(|k| {
                let to = if k == u64::from(self.snapshots) {
                    start + self.warmup + self.window
                } else {
                    start + self.warmup + interval.saturating_mul(k)
                };
                (to.saturating_sub(self.lookback()), to)
            })
            .collect()
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.snapshots == 0 {
            return Err(ConfigError::NoSnapshots);
        }
        if self.window == Nanos::ZERO {
            return Err(ConfigError::EmptyWindow);
        }
        let lookback = self.lookback();
        if lookback == Nanos::ZERO || lookback > self.warmup + self.interval() {
            return Err(ConfigError::BadLookback {
                lookback_s: lookback.as_secs_f64(),
                max_s: (self.warmup + self.interval()).as_secs_f64(),
            });
        }
        Ok(())
    }
}

/// A run's settings the simulator refuses.
#[derive(Debug, Error)]
pub enum ConfigError {
    #[error("the fleet needs at least one worker")]
    NoWorkers,
    #[error(
        "a disaggregated fleet needs at least one decode worker (prefill workers hand every \
         request to one)"
    )]
    NoDecodeWorkers,
    #[error(
        "workers ({workers}) must equal prefill workers ({prefill}) + decode workers ({decode})"
    )]
    DisaggWorkers {
        workers: u32,
        prefill: u32,
        decode: u32,
    },
    #[error("a run needs at least one phase (concurrency level)")]
    NoPhases,
    #[error("a phase needs at least one snapshot")]
    NoSnapshots,
    #[error("the measurement window must be longer than zero")]
    EmptyWindow,
    #[error(
        "a snapshot's lookback of {lookback_s} s must be > 0 and at most warmup + one snapshot \
         interval ({max_s} s), so that the first snapshot stays inside its own phase"
    )]
    BadLookback { lookback_s: f64, max_s: f64 },
    #[error(
        "the fleet may hold at most {limit} workers in all (SimConfig::max_workers); \
         raise it to add more"
    )]
    TooManyWorkers { limit: u32 },
    #[error("workers cannot be added while a timeline is recorded")]
    ResizeWithTimeline,
    #[error(
        "a worker added to a disaggregated fleet needs a pool, and one added to an \
         aggregated fleet none"
    )]
    PoolMismatch,
    #[error("gateway replicas must be at least 1")]
    NoReplicas,
    #[error("gateway replicas run an aggregated fleet only; drop the prefill/decode pools")]
    ReplicasWithPools,
    // These carry the cause in their message, not as a `source` too, so an error chain does
    // not print it twice.
    #[error("engine: {0}")]
    Engine(engine::EngineConfigError),
    #[error("router: {0}")]
    Router(router::RouterConfigError),
    #[error("router: {0}")]
    Route(router::RouteError),
    #[error(
        "the router's block size ({router}) differs from the engines' ({engine}); KV events \
         would never match"
    )]
    BlockSizeMismatch { router: usize, engine: u32 },
}

impl From<engine::EngineConfigError> for ConfigError {
    fn from(e: engine::EngineConfigError) -> Self {
        ConfigError::Engine(e)
    }
}

impl From<router::RouterConfigError> for ConfigError {
    fn from(e: router::RouterConfigError) -> Self {
        ConfigError::Router(e)
    }
}

impl From<router::RouteError> for ConfigError {
    fn from(e: router::RouteError) -> Self {
        ConfigError::Route(e)
    }
}
