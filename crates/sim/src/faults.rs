//! Seeded fault injection (`kvroute sim --faults SPEC`) and the invariants checked at every
//! step of a faulty run.
//!
//! A [`FaultSpec`] names scenarios, combinable: `worker-crash`, `worker-hang`, `slow-worker`,
//! `event-loss`, `event-delay`, `event-duplicate`, `event-reorder`, each with an optional
//! parameter (`event-loss=0.05`). [`Simulation::with_faults`](crate::Simulation::with_faults)
//! turns it into a plan drawn from the run's seed (which worker, when), so a faulty run is
//! as reproducible as a clean one.
//!
//! What each fault does, and what the simulated gateway does about it, is modelled on the
//! gateway's behaviour, with its settings and defaults from the same place the gateway reads
//! them ([`router::FailoverConfig`], `SimConfig::failover`; docs/RELIABILITY.md):
//!
//! - **worker-crash**: the worker's engine is gone with its cache; the worker leaves the
//!   routing set and the index at once. Every request on it is migrated as the gateway
//!   migrates it ([`router::MigrationState`]: resent through the same admission core to
//!   another worker, its prompt followed by its output so far, for the rest of its tokens,
//!   up to `migration_limit` times); past the limit, or with no other worker, it ends with
//!   the reported error `worker_failed`. After the restart delay an engine with an empty
//!   cache joins under a new id (a new instance).
//! - **worker-hang**: the worker's process stops (`SIGSTOP`) for the hang's duration: no
//!   step advances, no event leaves it. The gateway's health check (every
//!   `health_interval`, answered within `probe_timeout`) takes it out of the routing set;
//!   each request routed to it waits its own deadline: `first_byte_timeout` before its
//!   worker's first token (then it is routed again, at most `first_byte_retries` times; one
//!   more timeout fails it, the gateway's 504), `stall_timeout` after its last token (then
//!   it is migrated as above, or fails with `worker_timeout`), judged as the gateway judges
//!   it ([`router::judge_deadline`]: silent once its health check failed or its last output
//!   on any request is a timeout old; until then the request waits). A request's timeout ejects
//!   the worker for the ejection time ([`router::Ejections`]). When the process continues,
//!   its engine picks up where it stopped (it is shifted in time by the hang), cancels the
//!   requests whose clients gave up or moved, and the first passing health check once its
//!   ejection is over puts it back in the routing set (its blocks come back through its
//!   events).
//! - **slow-worker**: one worker's steps take `FACTOR` times as long (2: half speed), while it
//!   declares the profile's timing, as a throttled GPU would.
//! - **event-loss / -delay / -duplicate / -reorder**: KV events between the engines and the
//!   index go through a seeded delivery layer (`EventChannel`) that drops an event with
//!   probability `P`, delays each by up to `MS` (keeping each worker's order, as NATS does),
//!   delivers one twice, or holds one back so the next ones overtake it. The index applies
//!   what arrives with the gap policy the gateway uses ([`kv_index::KvIndex::apply_resyncing`]):
//!   a gap clears the worker's blocks and re-baselines; duplicates and overtaken events are
//!   refused as stale. Then, as the gateway asks a kvroute engine over NATS, the worker's
//!   snapshot of its cache restores its blocks ([`kv_index::KvIndex::restore_worker`] from the
//!   engine side's [`kv_index::CacheMirror`], applied at once).
//!
//! - **replica-restart**: one gateway replica's process dies (with `--gateway-replicas` ≥ 2)
//!   and comes back SECONDS later, as the gateway does (`gateway/src/replicas.rs`): the
//!   clients whose requests it held see their connection break (each turn ends with the
//!   reported error `gateway_failed`, and its engine cancels it, as for a client that
//!   disconnects); the load balancer sends new turns to the other replicas. Its peers count
//!   its requests until its lease ([`router::ReplicaTiming::peer_lease`]) passes without a word from it. It starts
//!   with an empty index, filled at once from each worker's snapshot of its cache (the
//!   gateway asks each worker it hears announce itself), and an empty view of the fleet's
//!   load; before it serves, it asks its peers for their snapshots and
//!   waits for them, at most [`router::ReplicaTiming::snapshot_timeout`]; its first message (a new epoch) makes its
//!   peers release what they still counted for its old incarnation.
//! - **partition**: one replica loses NATS for SECONDS (it still serves its clients and
//!   reaches the workers over HTTP): it receives no KV event and no peer update, and its own
//!   updates reach nobody. Past the peer lease of silence, it and its peers forget each
//!   other (releasing each other's requests). When NATS comes back, each side's next
//!   header shows the updates lost, so it fetches snapshots; the first KV event of each
//!   worker shows a gap, so the index clears that worker's blocks, re-baselines and restores
//!   them from the worker's snapshot (the gap policy above).
//!
//! # Invariants (`Checker`)
//!
//! Checked after every step of the event loop; the first violation stops the run with
//! [`SimError::Invariant`](crate::SimError::Invariant), naming the seed and the step:
//!
//! 1. every issued turn ends exactly once (finished or failed with a reported error), and
//!    `issued = finished + failed + in flight` at every step; a turn in flight is queued or
//!    on a worker that is alive (no request lost with a dead worker); a migrated turn is
//!    the same turn (its tokens counted once, its TTFT its first token's);
//! 2. no request is routed to a worker known dead (crashed, or ejected while hung), and no
//!    request gets output from a worker it is not on (no duplicate answer);
//! 3. the index never claims a block a worker lacks once it has applied, or resynchronised
//!    past, that worker's event removing it: a stale claim lasts at most until the worker's
//!    next event after a lost one is delivered (the event delay after the worker's next KV
//!    event). The longest stale claim seen is reported.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use kv_index::{EngineBlockId, KvEvent, KvEventKind, KvIndex, WorkerId};
use nanotime::Nanos;
use rustc_hash::{FxHashMap, FxHashSet};
use serde::Serialize;
use thiserror::Error;
use workload::TurnKey;

/// Most KV events in transit at once; past it an event is dropped (and the gap policy
/// resynchronises), so a delay fault cannot grow memory without bound.
pub const MAX_EVENTS_IN_TRANSIT: usize = 1 << 20;

/// The scenarios by name, with their parameter and its default, for help texts.
pub const SCENARIOS: &[(&str, &str)] = &[
    (
        "worker-crash[=SECONDS]",
        "a worker dies at a seeded time; it restarts with an empty cache after SECONDS (30)",
    ),
    (
        "worker-hang[=SECONDS]",
        "a worker stops answering for SECONDS (90): health check, first-byte and stall timeouts",
    ),
    (
        "slow-worker[=FACTOR]",
        "one worker's steps take FACTOR (2) times as long",
    ),
    (
        "event-loss[=P]",
        "each KV event is lost with probability P (0.02)",
    ),
    (
        "event-delay[=MS]",
        "each KV event is delayed by up to MS (500) ms, each worker's order kept",
    ),
    (
        "event-duplicate[=P]",
        "each KV event is delivered twice with probability P (0.02)",
    ),
    (
        "event-reorder[=P]",
        "each KV event is held back 20 ms with probability P (0.02), so later ones overtake it",
    ),
    (
        "replica-restart[=SECONDS]",
        "a gateway replica dies and restarts SECONDS (10) later with an empty state, rebuilt \
         from its peers' snapshots (needs --gateway-replicas 2 or more)",
    ),
    (
        "partition[=SECONDS]",
        "a gateway replica loses NATS (KV events, peer updates) for SECONDS (10), then \
         resyncs (needs --gateway-replicas 2 or more)",
    ),
];

/// How long a reordered event is held back.
pub const REORDER_HOLD: Nanos = Nanos::from_millis(20);

/// Which faults a run injects (all off: [`FaultSpec::default`]).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct FaultSpec {
    /// Crash one worker; restart it after this long.
    pub worker_crash: Option<Nanos>,
    /// Hang one worker for this long.
    pub worker_hang: Option<Nanos>,
    /// One worker's slowdown factor (2: half speed).
    pub slow_worker: Option<f64>,
    pub event_loss: f64,
    /// Largest extra delay of a KV event.
    pub event_delay: Option<Nanos>,
    pub event_duplicate: f64,
    pub event_reorder: f64,
    /// Restart one gateway replica; it is down this long.
    pub replica_restart: Option<Nanos>,
    /// Cut one gateway replica off NATS for this long.
    pub partition: Option<Nanos>,
}

/// A `--faults` value the simulator cannot run.
#[derive(Debug, Error, PartialEq)]
pub enum FaultSpecError {
    #[error(
        "unknown fault `{0}`; known: worker-crash, worker-hang, slow-worker, event-loss, \
         event-delay, event-duplicate, event-reorder, replica-restart, partition (or none), \
         combined with commas"
    )]
    Unknown(String),
    #[error("`{name}={value}`: {why}")]
    BadValue {
        name: String,
        value: String,
        why: &'static str,
    },
    #[error("`{0}` is given twice")]
    Twice(String),
}

impl FaultSpec {
    /// Whether any fault is on.
    pub fn is_empty(&self) -> bool {
        *self == FaultSpec::default()
    }

    /// Whether a fault needs several gateway replicas.
    pub fn touches_replicas(&self) -> bool {
        self.replica_restart.is_some() || self.partition.is_some()
    }

    /// Whether KV events go through the faulty delivery layer.
    pub fn touches_events(&self) -> bool {
        self.event_loss > 0.0
            || self.event_delay.is_some()
            || self.event_duplicate > 0.0
            || self.event_reorder > 0.0
    }
}

fn probability(name: &str, value: &str) -> Result<f64, FaultSpecError> {
    match value.parse::<f64>() {
        Ok(p) if (0.0..=1.0).contains(&p) => Ok(p),
        _ => Err(FaultSpecError::BadValue {
            name: name.into(),
            value: value.into(),
            why: "expected a probability between 0 and 1",
        }),
    }
}

fn positive(name: &str, value: &str, why: &'static str) -> Result<f64, FaultSpecError> {
    match value.parse::<f64>() {
        Ok(x) if x.is_finite() && x > 0.0 => Ok(x),
        _ => Err(FaultSpecError::BadValue {
            name: name.into(),
            value: value.into(),
            why,
        }),
    }
}

impl FromStr for FaultSpec {
    type Err = FaultSpecError;

    /// `name[=value]` items separated by commas; `none` alone is the fault-free run.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut spec = FaultSpec::default();
        let mut seen = FxHashSet::default();
        for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let (name, value) = match item.split_once('=') {
                Some((n, v)) => (n.trim(), Some(v.trim())),
                None => (item, None),
            };
            if !seen.insert(name.to_string()) {
                return Err(FaultSpecError::Twice(name.into()));
            }
            let secs = |default: f64| -> Result<Nanos, FaultSpecError> {
                let s = match value {
                    Some(v) => positive(name, v, "expected a number of seconds > 0")?,
                    None => default,
                };
                Ok(Nanos::from_secs_f64(s))
            };
            let prob = |default: f64| match value {
                Some(v) => probability(name, v),
                None => Ok(default),
            };
            match name {
                "none" => {}
                "worker-crash" => spec.worker_crash = Some(secs(30.0)?),
                "worker-hang" => spec.worker_hang = Some(secs(90.0)?),
                "slow-worker" => {
                    let f = match value {
                        Some(v) => positive(name, v, "expected a factor ≥ 1 (2: half speed)")?,
                        None => 2.0,
                    };
                    if f < 1.0 {
                        return Err(FaultSpecError::BadValue {
                            name: name.into(),
                            value: value.unwrap_or_default().into(),
                            why: "expected a factor ≥ 1 (2: half speed)",
                        });
                    }
                    spec.slow_worker = Some(f);
                }
                "event-loss" => spec.event_loss = prob(0.02)?,
                "event-duplicate" => spec.event_duplicate = prob(0.02)?,
                "event-reorder" => spec.event_reorder = prob(0.02)?,
                "event-delay" => {
                    let ms = match value {
                        Some(v) => positive(name, v, "expected milliseconds > 0")?,
                        None => 500.0,
                    };
                    spec.event_delay = Some(Nanos::from_secs_f64(ms / 1e3));
                }
                "replica-restart" => spec.replica_restart = Some(secs(10.0)?),
                "partition" => spec.partition = Some(secs(10.0)?),
                other => return Err(FaultSpecError::Unknown(other.into())),
            }
        }
        Ok(spec)
    }
}

impl fmt::Display for FaultSpec {
    /// The canonical form, every parameter spelled out (`none` when empty).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut items = Vec::new();
        if let Some(d) = self.worker_crash {
            items.push(format!("worker-crash={}", d.as_secs_f64()));
        }
        if let Some(d) = self.worker_hang {
            items.push(format!("worker-hang={}", d.as_secs_f64()));
        }
        if let Some(x) = self.slow_worker {
            items.push(format!("slow-worker={x}"));
        }
        if self.event_loss > 0.0 {
            items.push(format!("event-loss={}", self.event_loss));
        }
        if let Some(d) = self.event_delay {
            items.push(format!("event-delay={}", d.as_secs_f64() * 1e3));
        }
        if self.event_duplicate > 0.0 {
            items.push(format!("event-duplicate={}", self.event_duplicate));
        }
        if self.event_reorder > 0.0 {
            items.push(format!("event-reorder={}", self.event_reorder));
        }
        if let Some(d) = self.replica_restart {
            items.push(format!("replica-restart={}", d.as_secs_f64()));
        }
        if let Some(d) = self.partition {
            items.push(format!("partition={}", d.as_secs_f64()));
        }
        if items.is_empty() {
            f.write_str("none")
        } else {
            f.write_str(&items.join(","))
        }
    }
}

/// SplitMix64: the fault layer's own seeded stream (no dependency, same on every platform).
#[derive(Debug, Clone)]
pub(crate) struct FaultRng(u64);

impl FaultRng {
    pub(crate) fn new(seed: u64) -> Self {
        FaultRng(seed)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub(crate) fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    pub(crate) fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && self.unit() < p
    }

    /// Uniform in `0..n` (`n > 0`).
    pub(crate) fn below(&mut self, n: u32) -> u32 {
        (self.unit() * f64::from(n)) as u32 % n.max(1)
    }
}

/// Where and when a run's faults strike, drawn from the run's seed.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FaultPlan {
    /// The crashing worker, when, and when its replacement joins.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub crash: Option<(u32, Nanos, Nanos)>,
    /// The hanging worker, from when, until when.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hang: Option<(u32, Nanos, Nanos)>,
    /// The slow worker and its slowdown.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slow: Option<(u32, f64)>,
    /// The restarting gateway replica, when it dies, and when it starts again.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replica_restart: Option<(u32, Nanos, Nanos)>,
    /// The gateway replica cut off NATS, from when, until when.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub partition: Option<(u32, Nanos, Nanos)>,
}

impl FaultPlan {
    /// Crash and hang strike at a seeded instant between 20% and 50% of the run, on distinct
    /// workers when there are several; the slow worker is drawn too. A replica restart and a
    /// partition strike in the same span, on distinct replicas (drawn after the workers'
    /// faults, so adding them moves no worker fault of a seed).
    pub(crate) fn draw(
        spec: &FaultSpec,
        workers: u32,
        replicas: u32,
        end: Nanos,
        rng: &mut FaultRng,
    ) -> Self {
        let at = |rng: &mut FaultRng| Nanos((end.0 as f64 * (0.2 + 0.3 * rng.unit())) as u64);
        let crash_worker = rng.below(workers);
        let crash = spec.worker_crash.map(|down| {
            let t = at(rng);
            (crash_worker, t, t + down)
        });
        let hang = spec.worker_hang.map(|d| {
            let w = if workers > 1 && crash.is_some() {
                (crash_worker + 1 + rng.below(workers - 1)) % workers
            } else {
                rng.below(workers)
            };
            let t = at(rng);
            (w, t, t + d)
        });
        let slow = spec.slow_worker.map(|f| (rng.below(workers), f));
        // No draw unless asked for: the event layer's seed, drawn next, stays that of a run
        // without replica faults.
        let replica_restart = spec.replica_restart.map(|down| {
            let r = rng.below(replicas);
            let t = at(rng);
            (r, t, t + down)
        });
        let partition = spec.partition.map(|d| {
            let r = match replica_restart {
                Some((restarting, ..)) if replicas > 1 => {
                    (restarting + 1 + rng.below(replicas - 1)) % replicas
                }
                _ => rng.below(replicas),
            };
            let t = at(rng);
            (r, t, t + d)
        });
        FaultPlan {
            crash,
            hang,
            slow,
            replica_restart,
            partition,
        }
    }
}

/// What a faulty run did and what the invariant checker saw (in `RunOutput::faults`).
#[derive(Debug, Clone, PartialEq, Default, Serialize)]
pub struct FaultReport {
    /// The spec in canonical form.
    pub spec: String,
    /// The run's seed (`SimConfig::seed`; `kvroute sim` derives it from `--seed`).
    pub seed: u64,
    pub plan: Option<FaultPlan>,
    /// Faults and the gateway's reactions, in time order: `(seconds, what)`.
    pub timeline: Vec<(f64, String)>,
    pub kv_events_lost: u64,
    pub kv_events_delayed: u64,
    pub kv_events_duplicated: u64,
    pub kv_events_reordered: u64,
    /// Gaps the index resynchronised after (the worker's blocks cleared).
    pub kv_resyncs: u64,
    /// Events refused as stale (duplicates, overtaken events).
    pub kv_stale_events: u64,
    /// Gaps and restarts after which an index learnt a worker's blocks from the worker's own
    /// cache snapshot (what the gateway asks a kvroute engine for over NATS).
    pub kv_snapshots: u64,
    /// Requests that ended with the error of a crashed worker (`worker_failed`).
    pub worker_failed_requests: u64,
    /// Requests resent to another worker with their output so far, by the failure that
    /// moved them (a request moved twice counts twice).
    pub migrations: MigrationCounts,
    /// Requests that ended with a timeout error (`worker_timeout`, or a 504 after a retry).
    pub timed_out_requests: u64,
    /// Requests routed again after a first-byte timeout.
    pub retried_requests: u64,
    /// Requests whose gateway replica died under them (`gateway_failed`: the client's
    /// connection broke).
    pub gateway_failed_requests: u64,
    /// Peer updates a partition kept from their receivers (each receiver counted).
    pub peer_updates_lost: u64,
    /// KV events a partitioned replica did not receive.
    pub kv_events_missed: u64,
    /// Peers' snapshots the replicas applied (at start, and after lost updates).
    pub snapshots_applied: u64,
    /// Blocks the engines evicted (removal events emitted).
    pub blocks_removed: u64,
    /// Blocks the index claimed after their worker removed them (each counted once), and
    /// the longest such claim.
    pub stale_claims: u64,
    pub max_stale_claim_s: f64,
    /// Steps the invariants were checked after.
    pub checked_steps: u64,
}

/// Migrations by reason, as the gateway's `kvroute_gateway_migrations_total{reason}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct MigrationCounts {
    pub worker_failed: u64,
    pub worker_timeout: u64,
}

impl MigrationCounts {
    pub fn count(&mut self, reason: router::FailureReason) {
        match reason {
            router::FailureReason::WorkerFailed => self.worker_failed += 1,
            router::FailureReason::WorkerTimeout => self.worker_timeout += 1,
        }
    }

    pub fn total(&self) -> u64 {
        self.worker_failed + self.worker_timeout
    }
}

impl FaultReport {
    pub(crate) fn note(&mut self, at: Nanos, what: String) {
        // Bounded: a run has a handful of fault actions, far fewer than this.
        if self.timeline.len() < 1024 {
            self.timeline.push((at.as_secs_f64(), what));
        }
    }
}

/// The seeded delivery layer between the engines and the index.
#[derive(Debug)]
pub(crate) struct EventChannel {
    rng: FaultRng,
    loss: f64,
    delay: Option<Nanos>,
    duplicate: f64,
    reorder: f64,
    /// Events in transit by (delivery time, send order).
    in_transit: BTreeMap<(Nanos, u64), KvEvent>,
    sent: u64,
    /// Each worker's latest in-order delivery time (order is kept per worker).
    last_at: FxHashMap<WorkerId, Nanos>,
}

impl EventChannel {
    pub(crate) fn new(spec: &FaultSpec, rng: FaultRng) -> Self {
        EventChannel {
            rng,
            loss: spec.event_loss,
            delay: spec.event_delay,
            duplicate: spec.event_duplicate,
            reorder: spec.event_reorder,
            in_transit: BTreeMap::new(),
            sent: 0,
            last_at: FxHashMap::default(),
        }
    }

    fn push(&mut self, at: Nanos, ev: KvEvent, report: &mut FaultReport) {
        if self.in_transit.len() >= MAX_EVENTS_IN_TRANSIT {
            report.kv_events_lost += 1;
            return;
        }
        self.sent += 1;
        self.in_transit.insert((at, self.sent), ev);
    }

    /// Sends `ev`, emitted at `now`, with the plane's own `base` delay.
    pub(crate) fn send(&mut self, now: Nanos, base: Nanos, ev: KvEvent, report: &mut FaultReport) {
        if self.rng.chance(self.loss) {
            report.kv_events_lost += 1;
            return;
        }
        let mut at = now + base;
        if let Some(max) = self.delay {
            at += Nanos((max.0 as f64 * self.rng.unit()) as u64);
            report.kv_events_delayed += 1;
        }
        if self.rng.chance(self.reorder) {
            // Held back, without moving the worker's in-order cursor: what follows overtakes it.
            report.kv_events_reordered += 1;
            let at = at + REORDER_HOLD;
            self.push(at, ev, report);
            return;
        }
        let last = self.last_at.entry(ev.worker).or_insert(Nanos::ZERO);
        at = at.max(*last);
        *last = at;
        if self.rng.chance(self.duplicate) {
            report.kv_events_duplicated += 1;
            self.push(at, ev.clone(), report);
        }
        self.push(at, ev, report);
    }

    pub(crate) fn next_delivery(&self) -> Option<Nanos> {
        self.in_transit.keys().next().map(|k| k.0)
    }

    /// The next event due at or before `at`.
    pub(crate) fn pop_due(&mut self, at: Nanos) -> Option<KvEvent> {
        let (&key, _) = self.in_transit.iter().next()?;
        if key.0 > at {
            return None;
        }
        self.in_transit.remove(&key)
    }

    /// Forgets a worker that is gone (its events still in transit are dropped on arrival).
    pub(crate) fn forget(&mut self, worker: WorkerId) {
        self.last_at.remove(&worker);
    }
}

/// A block the engine removed that the index may still claim: the removal's sequence
/// number and when it happened.
#[derive(Debug, Clone, Copy)]
struct Suspect {
    seq: u64,
    since: Nanos,
    counted: bool,
}

/// Blocks each worker removed that one index had not yet caught up with.
type Suspects = FxHashMap<WorkerId, FxHashMap<EngineBlockId, Suspect>>;

/// The invariants of a faulty run, fed by the driver at every step (see the module docs).
#[derive(Debug)]
pub(crate) struct Checker {
    /// Turns issued and not ended; bounded by the turns in flight.
    open: FxHashSet<TurnKey>,
    /// What each live worker's engine holds, from its own KV events (the truth).
    truth: FxHashMap<WorkerId, FxHashSet<EngineBlockId>>,
    /// Per index (one per gateway replica): the removed blocks it may still claim.
    suspects: Vec<Suspects>,
    pub(crate) stale_claims: u64,
    pub(crate) max_stale: Nanos,
    /// Blocks the engines removed (evictions), as they emitted them.
    pub(crate) removals: u64,
}

impl Checker {
    /// A checker of `indexes` prefix indexes (one per gateway replica).
    pub(crate) fn new(indexes: usize) -> Self {
        Checker {
            open: FxHashSet::default(),
            truth: FxHashMap::default(),
            suspects: (0..indexes.max(1)).map(|_| Suspects::default()).collect(),
            stale_claims: 0,
            max_stale: Nanos::ZERO,
            removals: 0,
        }
    }

    pub(crate) fn on_issue(&mut self, key: TurnKey) -> Result<(), String> {
        if self.open.insert(key) {
            Ok(())
        } else {
            Err(format!(
                "turn {} of conversation {} was issued while already in flight (duplicated)",
                key.turn, key.conversation
            ))
        }
    }

    pub(crate) fn on_end(&mut self, key: TurnKey) -> Result<(), String> {
        if self.open.remove(&key) {
            Ok(())
        } else {
            Err(format!(
                "turn {} of conversation {} ended twice, or ended without being issued",
                key.turn, key.conversation
            ))
        }
    }

    pub(crate) fn open_turns(&self) -> usize {
        self.open.len()
    }

    /// An event as the engine emitted it, before the delivery layer.
    pub(crate) fn on_engine_kv(&mut self, ev: &KvEvent, now: Nanos) {
        let truth = self.truth.entry(ev.worker).or_default();
        let suspects = &mut self.suspects;
        let mut removed = |id: EngineBlockId| {
            for per_index in suspects.iter_mut() {
                per_index
                    .entry(ev.worker)
                    .or_default()
                    .entry(id)
                    .and_modify(|s| s.seq = ev.seq)
                    .or_insert(Suspect {
                        seq: ev.seq,
                        since: now,
                        counted: false,
                    });
            }
        };
        match &ev.kind {
            KvEventKind::Stored { blocks, .. } => {
                for b in blocks {
                    truth.insert(b.id);
                }
            }
            KvEventKind::Removed { blocks } => {
                self.removals += blocks.len() as u64;
                for id in blocks {
                    if truth.remove(id) {
                        removed(*id);
                    }
                }
            }
            KvEventKind::Cleared => {
                for id in truth.drain() {
                    removed(id);
                }
            }
        }
    }

    /// A worker whose engine is gone: the index must hold nothing of it.
    pub(crate) fn on_worker_gone(&mut self, worker: WorkerId) {
        self.truth.remove(&worker);
        for per_index in &mut self.suspects {
            per_index.remove(&worker);
        }
    }

    /// A replica whose index starts over (empty): nothing it held before can be stale.
    pub(crate) fn on_index_reset(&mut self, index_no: usize) {
        if let Some(per_index) = self.suspects.get_mut(index_no) {
            per_index.clear();
        }
    }

    /// Invariant 3 for every worker with blocks index `index_no` (replica `index_no`'s) may
    /// still claim.
    pub(crate) fn check_index(
        &mut self,
        index_no: usize,
        now: Nanos,
        index: &KvIndex,
    ) -> Result<(), String> {
        let mut broken = None;
        let Some(per_index) = self.suspects.get_mut(index_no) else {
            return Ok(());
        };
        for (worker, suspects) in per_index {
            if suspects.is_empty() {
                continue;
            }
            let truth = self.truth.get(worker);
            let next = index.next_seq(*worker);
            let stale_claims = &mut self.stale_claims;
            let max_stale = &mut self.max_stale;
            suspects.retain(|id, s| {
                if truth.is_some_and(|t| t.contains(id)) {
                    return false;
                }
                let caught_up = next.is_some_and(|n| n > s.seq);
                if !index.holds(*worker, *id) {
                    return !caught_up;
                }
                if !s.counted {
                    s.counted = true;
                    *stale_claims += 1;
                }
                *max_stale = (*max_stale).max(now.saturating_sub(s.since));
                if caught_up && broken.is_none() {
                    broken = Some(format!(
                        "index {index_no} claims block {:#x} of {worker}, which the worker \
                         removed at \
                         {} (event seq {}), after applying its events up to seq {}",
                        id.0,
                        s.since,
                        s.seq,
                        next.unwrap_or_default().saturating_sub(1)
                    ));
                }
                true
            });
        }
        broken.map_or(Ok(()), Err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_combine_and_print_canonically() {
        let s: FaultSpec = "worker-crash,event-loss=0.05".parse().unwrap();
        assert_eq!(s.worker_crash, Some(Nanos::from_secs(30)));
        assert_eq!(s.event_loss, 0.05);
        assert_eq!(s.to_string(), "worker-crash=30,event-loss=0.05");
        assert_eq!(s.to_string().parse::<FaultSpec>().unwrap(), s);
        assert!("none".parse::<FaultSpec>().unwrap().is_empty());
        let all: FaultSpec = "worker-crash,worker-hang,slow-worker,event-loss,event-delay,\
                              event-duplicate,event-reorder"
            .parse()
            .unwrap();
        assert!(all.touches_events() && all.worker_hang.is_some() && all.slow_worker == Some(2.0));
        assert!(!all.touches_replicas());
        let replicas: FaultSpec = "replica-restart,partition=4".parse().unwrap();
        assert_eq!(replicas.replica_restart, Some(Nanos::from_secs(10)));
        assert_eq!(replicas.partition, Some(Nanos::from_secs(4)));
        assert!(replicas.touches_replicas() && !replicas.touches_events());
        assert_eq!(replicas.to_string(), "replica-restart=10,partition=4");
    }

    #[test]
    fn bad_specs_say_what_is_wrong() {
        let e = |s: &str| s.parse::<FaultSpec>().unwrap_err().to_string();
        assert!(e("worker-explode").contains("known: worker-crash"));
        assert!(e("partition=0").contains("seconds"));
        assert!(e("replica-restart=x").contains("seconds"));
        assert!(e("event-loss=2").contains("probability"));
        assert!(e("event-loss=x").contains("probability"));
        assert!(e("slow-worker=0.5").contains("≥ 1"));
        assert!(e("worker-crash=-1").contains("seconds"));
        assert!(e("event-loss,event-loss=0.1").contains("twice"));
    }

    #[test]
    fn the_channel_keeps_each_workers_order_under_delay() {
        let spec: FaultSpec = "event-delay=100".parse().unwrap();
        let mut ch = EventChannel::new(&spec, FaultRng::new(7));
        let mut report = FaultReport::default();
        for seq in 0..200 {
            let ev = KvEvent {
                worker: WorkerId(1),
                seq,
                kind: KvEventKind::Cleared,
            };
            ch.send(Nanos::from_millis(seq), Nanos::ZERO, ev, &mut report);
        }
        let mut got = Vec::new();
        while let Some(ev) = ch.pop_due(Nanos::MAX) {
            got.push(ev.seq);
        }
        assert_eq!(got, (0..200).collect::<Vec<_>>());
        assert_eq!(report.kv_events_delayed, 200);
    }
}
