//! The discrete-event loop: engines, router, frontend queue, workload and KV events.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use engine::{Engine, EngineEvent, EngineRequest, KvLink, Leg, OutputSpec, Role, TransferStart};
use kv_index::{
    BlockHasher, CacheMirror, IndexConfig, KvEvent, LocalBlockHash, SequenceHash, StreamSync,
    WorkerId,
};
use nanotime::Nanos;
use router::autoscale::{BucketCounts, FRONTEND_ITL_BUCKETS, FRONTEND_TTFT_BUCKETS};
use router::{
    ChoiceOutput, ChunkIds, Decision, DisaggConfig, DisaggEvent, DisaggFrontend, Ejections,
    FailureReason, Frontend, FrontendEvent, KvSource, MigrationState, Pool, RequestId, Route,
    RouteDecision, Router, RouterConfig, RoutingKey, TokenUsage, WorkerLoad,
};
use serde::Serialize;
use thiserror::Error;

use crate::config::{ConfigError, Phase, SimConfig};
use crate::faults::{Checker, EventChannel, FaultPlan, FaultReport, FaultRng, FaultSpec};
use crate::links::{LinkError, LinkShare};
use crate::metrics::{
    KvTransfer, Metrics, Outcome, RequestRecord, RouteTag, WindowAcc, tokens_in_window,
};
use crate::oracle::Oracle;
use crate::replicas::{EventTally, ReplicaTotals, Replicas};
use crate::timeline::{Recorder, Timeline, TimelineConfig, TimelineError, WorkerSample};
use crate::timers::{Source, Timers};
use crate::workload::{Turn, TurnKey, Workload};

/// A run that cannot go on.
#[derive(Debug, Error)]
pub enum SimError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(
        "the workload issued {turns} turns at the single instant {at} without time advancing \
         (every turn failing at once?); stopping instead of spinning"
    )]
    Livelock { turns: u64, at: Nanos },
    #[error("timeline: {0}")]
    Timeline(#[from] TimelineError),
    #[error(
        "invariant broken at step {step} (t = {at}) of the run seeded {seed} with faults \
         `{spec}`: {what}. The same configuration, seed and faults reproduce it"
    )]
    Invariant {
        seed: u64,
        spec: String,
        step: u64,
        at: Nanos,
        what: String,
    },
    #[error("faults: {0}")]
    Faults(&'static str),
    #[error("KV links: {0}")]
    KvLinks(#[from] LinkError),
}

/// Most KV transfers on the shared links at once. A transfer is a decode leg waiting for its
/// KV, so the decode pool's sequence limits bound it far below this; the bound keeps the
/// links' table finite whatever the fleet.
const MAX_LINK_TRANSFERS: usize = 1 << 20;

/// Most turns issued at one instant before the run is declared stuck: far above any real
/// burst (every conversation of a 60k-conversation fleet starting together), far below a
/// spin.
const MAX_TURNS_PER_INSTANT: u64 = 4_000_000;

/// Derives an independent seed for stream `stream` of a run seeded `seed` (SplitMix64).
pub fn derive_seed(seed: u64, stream: u64) -> u64 {
    let mut z = seed
        .wrapping_add(stream.wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Seed streams of a run.
pub mod streams {
    pub const ROUTER: u64 = 1;
    pub const WORKLOAD: u64 = 2;
    /// Where and when faults strike, and the KV event delivery layer's draws.
    pub const FAULTS: u64 = 3;
    /// Engine `i` uses `ENGINE + i`.
    pub const ENGINE: u64 = 1 << 32;
    /// Gateway replica `r ≥ 1`'s router uses `REPLICA + r` (replica 0 uses `ROUTER`, as a
    /// single gateway does).
    pub const REPLICA: u64 = 2 << 32;
}

/// A turn between issue and end.
/// What `EngineEvent::Finished` tells the driver about a request.
#[derive(Debug, Clone, Copy)]
struct Finished {
    prompt_tokens: u32,
    cached_prompt_tokens: u32,
    output_tokens: u32,
    preemptions: u32,
}

#[derive(Debug)]
struct InFlight {
    /// Issue order (the record's id); engines and the router know the turn by its handle.
    id: u64,
    turn: TurnKey,
    prompt: Arc<[u32]>,
    output: Arc<[u32]>,
    issued_at: Nanos,
    /// When it reached the frontend (after the serving path): the gateway's TTFT starts here.
    arrived_at: Nanos,
    routed_at: Option<Nanos>,
    worker: Option<u32>,
    first_token_at: Option<Nanos>,
    last_token_at: Option<Nanos>,
    tokens: u32,
    spans: u32,
    oracle_cached: u32,
    overlap_blocks: u32,
    available_blocks: u32,
    /// Sequence hash of the prompt's last full block (the oracle chains the output from it).
    prompt_last_block: Option<SequenceHash>,
    /// The block hashes of prompt and reply (the prompt's as the router computed them), until
    /// its first worker takes them (engines of the router's block size then skip hashing).
    prompt_hashes: Option<(Vec<LocalBlockHash>, Vec<SequenceHash>)>,
    /// Disaggregated fleets: its route, its prefill worker (split routes), whether its
    /// prefill leg is still running there, and the prompt tokens that leg found cached.
    route: Option<RouteTag>,
    prefill_worker: Option<u32>,
    prefilling: bool,
    prefill_cached: Option<u32>,
    /// How long its KV transfer took on the shared links (contention included).
    kv_transfer_took: Option<Nanos>,
    /// When it was sent to its current worker, and whether that worker sent its first token
    /// (before it, a silent worker costs the first-byte timeout; after, the stall timeout).
    leg_sent_at: Nanos,
    leg_first_token: bool,
    /// After a migration: the prompt its current worker got (the client's prompt followed by
    /// the output so far), and the output tokens earlier workers generated.
    leg_prompt: Option<Arc<[u32]>>,
    leg_offset: u32,
    /// Its migrations (the router core's state), from its first worker failure on.
    migration: Option<Box<MigrationState>>,
    /// Resent after its worker failed and not routed yet: a refusal ends it with that
    /// failure's error, as the gateway's failed resend does.
    migrating: Option<FailureReason>,
}

impl InFlight {
    /// The turn's record as it stands when it ends at `ended_at` without the engine's own
    /// count (a failure); a finished turn overrides the engine-reported fields.
    fn record(&self, ended_at: Nanos, outcome: Outcome) -> RequestRecord {
        RequestRecord {
            id: self.id,
            conversation: self.turn.conversation,
            turn: self.turn.turn,
            worker: self.worker,
            issued_at: self.issued_at,
            routed_at: self.routed_at,
            first_token_at: self.first_token_at,
            last_token_at: self.last_token_at,
            ended_at,
            prompt_tokens: self.prompt.len() as u32,
            cached_prompt_tokens: 0,
            oracle_cached_tokens: self.oracle_cached,
            router_overlap_blocks: self.overlap_blocks,
            router_available_blocks: self.available_blocks,
            output_tokens: self.tokens,
            token_spans: self.spans,
            preemptions: 0,
            outcome,
            route: self.route,
            prefill_worker: self.prefill_worker,
            kv_transfer: None,
        }
    }
}

/// Turns in flight, found by handle (`generation << 32 | slot`) with an index instead of a
/// hash: the loop looks a turn up for every token span. A slot is reused after its turn
/// ends (the engine and router have forgotten the handle by then); the generation makes a
/// stale handle miss. Bounded by the turns in flight at once (the workload's concurrency
/// plus the frontend queue).
#[derive(Debug, Default)]
struct Turns {
    slots: Vec<(u32, Option<InFlight>)>,
    free: Vec<u32>,
    len: usize,
}

impl Turns {
    fn insert(&mut self, turn: InFlight) -> u64 {
        self.len += 1;
        let slot = match self.free.pop() {
            Some(s) => s,
            None => {
                self.slots.push((0, None));
                (self.slots.len() - 1) as u32
            }
        };
        let entry = &mut self.slots[slot as usize];
        entry.1 = Some(turn);
        u64::from(entry.0) << 32 | u64::from(slot)
    }

    fn get_mut(&mut self, handle: u64) -> Option<&mut InFlight> {
        let (generation, slot) = ((handle >> 32) as u32, handle as u32);
        match self.slots.get_mut(slot as usize) {
            Some((g, turn)) if *g == generation => turn.as_mut(),
            _ => None,
        }
    }

    fn remove(&mut self, handle: u64) -> Option<InFlight> {
        let (generation, slot) = ((handle >> 32) as u32, handle as u32);
        let (g, turn) = self.slots.get_mut(slot as usize)?;
        if *g != generation {
            return None;
        }
        let turn = turn.take()?;
        *g = g.wrapping_add(1);
        self.free.push(slot);
        self.len -= 1;
        Some(turn)
    }

    fn len(&self) -> usize {
        self.len
    }

    fn iter(&self) -> impl Iterator<Item = &InFlight> {
        self.slots.iter().filter_map(|s| s.1.as_ref())
    }
}

#[derive(Debug, Clone, Copy)]
enum Action {
    PhaseStart(usize),
    MeasureStart(usize),
    MeasureEnd(usize),
}

/// One worker over one phase's measurement period (`start + warmup` to the phase's end).
#[derive(Debug, Clone, PartialEq, Default, Serialize)]
pub struct WorkerStats {
    pub worker: u32,
    /// Disaggregated fleets: `prefill` or `decode`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pool: Option<&'static str>,
    /// Requests routed to it during the period.
    pub routed: u64,
    /// Most requests it held at once (routed, not finished) during the period.
    pub peak_in_flight: u32,
    /// Share of the period its GPU spent in steps.
    pub utilisation: f64,
    /// Prompt tokens it computed (prefill, including recomputation after preemption).
    pub prefill_tokens: u64,
    pub output_tokens: u64,
    pub preemptions: u64,
    /// Requests it held, averaged over the period.
    pub mean_in_flight: f64,
    /// Decoding: sequence-steps, the tokens they produced; speculative decoding: drafts,
    /// accepted draft tokens, and draft positions the target evaluated (each draft's first,
    /// and each one after an accepted position).
    pub decode_seq_steps: u64,
    pub decode_tokens: u64,
    pub spec_drafts: u64,
    pub spec_accepted: u64,
    pub spec_evaluated: u64,
}

#[derive(Debug, Clone, Copy, Default)]
struct EngineMark {
    busy: Nanos,
    prefill: u64,
    output: u64,
    preemptions: u64,
    decode_seq_steps: u64,
    decode_tokens: u64,
    spec_drafts: u64,
    spec_accepted: u64,
    spec_evaluated: u64,
}

impl EngineMark {
    fn of(m: &engine::EngineMetrics) -> EngineMark {
        let k = m.spec_accepted_per_pos.len();
        EngineMark {
            busy: m.busy_time,
            prefill: m.prefill_tokens_computed,
            output: m.tokens_generated,
            preemptions: m.preemptions,
            decode_seq_steps: m.decode_seq_steps,
            decode_tokens: m.decode_tokens_generated,
            spec_drafts: m.spec_drafts,
            spec_accepted: m.spec_accepted_tokens,
            spec_evaluated: m.spec_drafts
                + m.spec_accepted_per_pos
                    .iter()
                    .take(k.saturating_sub(1))
                    .sum::<u64>(),
        }
    }
}

/// One phase's results.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PhaseResult {
    pub concurrency: u32,
    /// The snapshot windows `(from, to]`, in seconds since the run started.
    pub windows_s: Vec<(f64, f64)>,
    /// One entry per snapshot.
    pub snapshots: Vec<Metrics>,
    /// The snapshots averaged (the seed's method).
    pub metrics: Metrics,
    pub workers: Vec<WorkerStats>,
}

/// Whole-run counters; they check conservation (every issued turn ends or is still in
/// flight, every emitted token belongs to a request).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct RunTotals {
    pub issued: u64,
    pub finished: u64,
    pub failed: u64,
    /// Turns issued and not ended when the run stopped (routed or queued).
    pub in_flight_at_end: u64,
    pub queued_at_end: u64,
    /// Output tokens reported by token events.
    pub tokens_emitted: u64,
    /// Output tokens of finished turns (their `Finished` events).
    pub finished_output_tokens: u64,
    /// Output tokens already emitted by turns still in flight at the end.
    pub in_flight_tokens_at_end: u64,
    pub kv_events: u64,
    /// KV events the router's index refused (gaps); zero unless something is broken.
    pub kv_event_errors: u64,
    /// Engine steps, summed over workers.
    pub engine_steps: u64,
    /// Distinct blocks the oracle remembered.
    pub oracle_blocks: u64,
    /// Virtual time the run covered.
    pub simulated: Nanos,
    /// Disaggregated fleets: routes taken and KV moved over the whole run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub disagg: Option<DisaggTotals>,
    /// Gateway replicas (more than one): turns per replica and the updates they exchanged.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replicas: Option<ReplicaTotals>,
}

/// A disaggregated run's routes (counted when assigned; a retry counts once more as
/// `local_retry`) and transfers.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct DisaggTotals {
    pub split: u64,
    pub local_short: u64,
    pub local_unavailable: u64,
    pub local_retry: u64,
    /// Prefill legs that failed after assignment (their worker failed or refused them).
    pub prefill_failures: u64,
    /// KV transfers that reached their decode worker, and their bytes.
    pub kv_transfers: u64,
    pub kv_transfer_bytes: u64,
}

impl DisaggTotals {
    fn count(&mut self, route: RouteTag) {
        match route {
            RouteTag::Split => self.split += 1,
            RouteTag::LocalShort => self.local_short += 1,
            RouteTag::LocalUnavailable => self.local_unavailable += 1,
            RouteTag::LocalRetry => self.local_retry += 1,
        }
    }
}

/// Admission and routing: the gateway's cores, one per fleet shape.
#[derive(Debug)]
#[allow(
    clippy::large_enum_variant,
    reason = "one per simulation, built once and never moved"
)]
enum Admission {
    /// Aggregated workers behind one [`Frontend`].
    One(Frontend),
    /// Prefill and decode pools behind a [`DisaggFrontend`].
    Two(DisaggFrontend),
    /// Aggregated workers behind several gateway replicas, a [`Frontend`] each.
    Many(Replicas),
}

/// An outcome of either core.
enum Admitted {
    One(FrontendEvent),
    Two(DisaggEvent),
}

impl Admission {
    fn key(&self, tokens: &[u32]) -> RoutingKey {
        match self {
            Admission::One(f) => f.router().key(tokens),
            Admission::Two(d) => d.key(tokens),
            Admission::Many(m) => m.first().router().key(tokens),
        }
    }

    fn submit(&mut self, id: RequestId, key: RoutingKey, now: Nanos) {
        match self {
            Admission::One(f) => f.submit(id, key, now),
            Admission::Two(d) => d.submit(id, key, now),
            Admission::Many(m) => m.submit(id, key, now),
        }
    }

    /// The next outcome; `now` stamps the update a replica sends its peers.
    fn poll_event(&mut self, now: Nanos) -> Option<Admitted> {
        match self {
            Admission::One(f) => f.poll_event().map(Admitted::One),
            Admission::Two(d) => d.poll_event().map(Admitted::Two),
            Admission::Many(m) => m.poll_event(now).map(Admitted::One),
        }
    }

    fn poll_timeout(&self) -> Option<Nanos> {
        match self {
            Admission::One(f) => f.poll_timeout(),
            Admission::Two(d) => d.poll_timeout(),
            Admission::Many(m) => m.poll_timeout(),
        }
    }

    fn handle_timeout(&mut self, now: Nanos) {
        match self {
            Admission::One(f) => f.handle_timeout(now),
            Admission::Two(d) => d.handle_timeout(now),
            Admission::Many(m) => m.handle_timeout(now),
        }
    }

    fn queued(&self) -> usize {
        match self {
            Admission::One(f) => f.queued(),
            Admission::Two(d) => d.queued(),
            Admission::Many(m) => m.queued(),
        }
    }

    fn on_first_token(&mut self, id: RequestId, now: Nanos) {
        match self {
            Admission::One(f) => f.on_first_token(id, now),
            Admission::Two(d) => d.on_first_token(id, now),
            Admission::Many(m) => m.on_first_token(id, now),
        }
    }

    /// A completed request's reply length, for the policies that learn it.
    fn on_reply(&mut self, id: RequestId, output_tokens: u32) {
        match self {
            Admission::One(f) => f.on_reply(output_tokens),
            Admission::Two(d) => d.on_reply(output_tokens),
            Admission::Many(m) => m.on_reply(id, output_tokens),
        }
    }

    fn on_finished(&mut self, id: RequestId, now: Nanos) {
        match self {
            Admission::One(f) => f.on_finished(id, now),
            Admission::Two(d) => d.on_finished(id, now),
            Admission::Many(m) => m.on_finished(id, now),
        }
    }

    fn remove_worker(&mut self, worker: WorkerId, now: Nanos) -> Vec<RequestId> {
        match self {
            Admission::One(f) => f.remove_worker(worker, now),
            Admission::Two(d) => d.remove_worker(worker, now),
            Admission::Many(m) => m.remove_worker(worker, now),
        }
    }

    fn take_drained(&mut self) -> Option<WorkerId> {
        match self {
            Admission::One(f) => f.take_drained(),
            Admission::Two(d) => d.take_drained(),
            Admission::Many(m) => m.take_drained(),
        }
    }

    fn apply_event(&mut self, ev: &KvEvent) -> bool {
        match self {
            Admission::One(f) => f.router_mut().apply_event(ev).is_ok(),
            Admission::Two(d) => d.apply_event(ev).is_ok(),
            Admission::Many(m) => m.apply_event(ev),
        }
    }

    /// The gateway's gap policy (`KvIndex::apply_resyncing`), in every index that receives
    /// the event; an index a gap cleared restores the worker from `fill` (its cache snapshot).
    /// One event through the gateway's gap-and-snapshot decision; `streams` is the one
    /// gateway's view of the event streams (replicas keep their own).
    fn apply_event_resyncing(
        &mut self,
        ev: &KvEvent,
        fill: Option<&CacheMirror>,
        streams: &mut StreamSync,
    ) -> EventTally {
        match self {
            Admission::One(f) => EventTally::deliver(streams, f.router_mut(), ev, fill),
            Admission::Two(d) => EventTally::deliver(streams, d, ev, fill),
            Admission::Many(m) => m.apply_event_resyncing(ev, fill),
        }
    }

    /// The router of the aggregated fleet, or of the decode pool.
    fn router(&self) -> &Router {
        match self {
            Admission::One(f) => f.router(),
            Admission::Two(d) => d.pool(Pool::Decode).router(),
            Admission::Many(m) => m.first().router(),
        }
    }

    /// `worker`'s load as its pool's router accounts it.
    fn load(&self, worker: WorkerId) -> Option<WorkerLoad> {
        match self {
            Admission::One(f) => f.router().load(worker),
            Admission::Two(d) => d.pool(d.pool_of(worker)?).router().load(worker),
            // Replica 0's view: with sync, the fleet's load as it stood `sync` ago.
            Admission::Many(m) => m.first().router().load(worker),
        }
    }

    fn hasher(&self) -> BlockHasher {
        *self.router().hasher()
    }
}

/// The local and sequence hashes of every full block of `prompt` followed by `output`,
/// extending the router's `key` of the prompt: hashed at issue, while the reply the workload
/// just wrote is still in cache, not block by block as the engine decodes it.
fn turn_hashes(
    key: &RoutingKey,
    hasher: BlockHasher,
    prompt: &[u32],
    output: &[u32],
) -> (Vec<LocalBlockHash>, Vec<SequenceHash>) {
    let bs = hasher.block_size();
    let all = (prompt.len() + output.len()) / bs;
    let mut local = Vec::with_capacity(all);
    let mut seq = Vec::with_capacity(all);
    local.extend_from_slice(&key.local);
    seq.extend_from_slice(&key.seq);
    let mut push = |l: LocalBlockHash| {
        seq.push(SequenceHash::chain(seq.last().copied(), l));
        local.push(l);
    };
    // The prompt's partial last block, completed by the reply's first tokens.
    let tail = prompt.get(key.local.len() * bs..).unwrap_or_default();
    let need = bs - tail.len();
    let Some((head, rest)) = output.split_at_checked(need) else {
        return (local, seq);
    };
    if tail.is_empty() {
        push(LocalBlockHash::of_tokens(head));
    } else {
        push(LocalBlockHash::of_tokens(&[tail, head].concat()));
    }
    for block in rest.chunks_exact(bs) {
        push(LocalBlockHash::of_tokens(block));
    }
    (local, seq)
}

/// Everything a run produced.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunOutput {
    pub phases: Vec<PhaseResult>,
    pub totals: RunTotals,
    /// Every request's record, with `keep_all_records` (empty otherwise).
    pub records: Vec<RequestRecord>,
    /// The per-worker timeline, when [`Simulation::with_timeline`] turned it on.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timeline: Option<Timeline>,
    /// What the injected faults did, with [`Simulation::with_faults`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub faults: Option<FaultReport>,
}

/// A fault action or a gateway timeout it sets off, due at a virtual instant.
#[derive(Debug, Clone, Copy)]
enum FaultAction {
    Crash(u32),
    Restart,
    HangStart(u32),
    HangEnd(u32),
    /// The health check that finds the stopped worker down.
    Eject(u32),
    /// The first passing health check after the worker continued.
    Readmit(u32),
    /// A request's first-byte or stall deadline on the stopped worker.
    Deadline(u64, u32),
    /// A gateway replica's process dies.
    ReplicaDown(u32),
    /// It starts again.
    ReplicaUp(u32),
    /// A gateway replica loses NATS.
    PartitionStart(u32),
    /// NATS is back for it.
    PartitionEnd(u32),
    /// A silent replica's lease runs out: its peers forget it.
    LeaseExpired(u32),
}

/// The stopped worker of a `worker-hang` fault.
#[derive(Debug)]
struct Hang {
    worker: u32,
    since: Nanos,
    stopped: bool,
    ejected: bool,
    /// Requests sent to it while stopped: it reads them when it continues.
    inbox: Vec<EngineRequest>,
    /// Requests whose clients gave up on it: cancelled when it continues.
    abandoned: Vec<RequestId>,
}

/// A faulty run's state ([`Simulation::with_faults`]).
#[derive(Debug)]
struct FaultState {
    spec: FaultSpec,
    seed: u64,
    channel: Option<EventChannel>,
    checker: Checker,
    report: FaultReport,
    /// Due actions by (time, order); a handful plus one deadline per request on a stopped
    /// worker.
    actions: BTreeMap<(Nanos, u64), FaultAction>,
    order: u64,
    /// Per worker: how far its engine's clock lags the run's (the time it spent stopped).
    lag: Vec<Nanos>,
    hang: Option<Hang>,
    /// Per live worker, its cache as its own events say (the engine's `CacheMirror`): what it
    /// answers a gateway that lost its events or restarted.
    mirrors: rustc_hash::FxHashMap<WorkerId, CacheMirror>,
    /// The gateway's view of the workers' event streams: when it asks a worker for its
    /// snapshot (`kv_index::StreamSync`, as the real gateway decides).
    kv_streams: StreamSync,
    /// First-byte timeouts so far, per request handle; bounded by the requests in flight.
    timeouts: rustc_hash::FxHashMap<u64, u32>,
    /// Workers that failed a request, out for the ejection time (the gateway's core).
    ejections: Ejections,
    /// When each worker last produced output on any request (by worker index; `None`: not
    /// yet): a deadline ejects only a silent worker (`router::judge_deadline`).
    last_output: Vec<Option<Nanos>>,
    step: u64,
    /// The first invariant violation seen inside an event handler.
    violation: Option<String>,
}

impl FaultState {
    fn schedule(&mut self, at: Nanos, action: FaultAction) {
        self.order += 1;
        self.actions.insert((at, self.order), action);
    }

    fn next_action(&self) -> Option<Nanos> {
        self.actions.keys().next().map(|k| k.0)
    }

    fn violate(&mut self, what: String) {
        self.violation.get_or_insert(what);
    }

    fn stopped(&self, worker: u32) -> bool {
        self.hang
            .as_ref()
            .is_some_and(|h| h.stopped && h.worker == worker)
    }

    fn ejected(&self, worker: u32) -> bool {
        self.hang
            .as_ref()
            .is_some_and(|h| h.ejected && h.worker == worker)
    }

    fn saw_output(&mut self, worker: u32, at: Nanos) {
        let w = worker as usize;
        if self.last_output.len() <= w {
            self.last_output.resize(w + 1, None);
        }
        self.last_output[w] = Some(at);
    }

    fn last_output(&self, worker: u32) -> Option<Nanos> {
        self.last_output.get(worker as usize).copied().flatten()
    }
}

/// The first health check at or after `t` (checks run every `interval` from zero).
fn next_health_check(t: Nanos, interval: Nanos) -> Nanos {
    let i = interval.0.max(1);
    Nanos(t.0.div_ceil(i) * i)
}

/// `ev` with its instants moved `lag` later (a worker's engine clock to the run's).
fn shifted(ev: EngineEvent, lag: Nanos) -> EngineEvent {
    if lag == Nanos::ZERO {
        return ev;
    }
    match ev {
        EngineEvent::FirstToken { id, at } => EngineEvent::FirstToken { id, at: at + lag },
        EngineEvent::Tokens { id, start, end, at } => EngineEvent::Tokens {
            id,
            start,
            end,
            at: at + lag,
        },
        EngineEvent::Finished {
            id,
            at,
            prompt_tokens,
            cached_prompt_tokens,
            output_tokens,
            preemptions,
        } => EngineEvent::Finished {
            id,
            at: at + lag,
            prompt_tokens,
            cached_prompt_tokens,
            output_tokens,
            preemptions,
        },
        EngineEvent::PrefillDone {
            id,
            at,
            prompt_tokens,
            cached_prompt_tokens,
        } => EngineEvent::PrefillDone {
            id,
            at: at + lag,
            prompt_tokens,
            cached_prompt_tokens,
        },
        EngineEvent::Cancelled { id, at } => EngineEvent::Cancelled { id, at: at + lag },
        other => other,
    }
}

/// A deterministic virtual-time cluster: see the crate docs.
pub struct Simulation<W: Workload> {
    cfg: SimConfig,
    phases: Vec<Phase>,
    phase_starts: Vec<Nanos>,
    engines: Vec<Engine>,
    /// Admission and routing: the gateway's cores, which own the routers.
    admission: Admission,
    /// Workers failed by [`Simulation::fail_worker`] or retired after draining: their
    /// engines are gone.
    dead: Vec<bool>,
    /// Each worker's pool (`None`: aggregated).
    pools: Vec<Option<Pool>>,
    /// Workers draining ([`Simulation::drain_worker`]): no new requests, gone once idle.
    draining: Vec<bool>,
    /// Drained workers that left, and when; bounded by the workers ever created.
    retired: Vec<(u32, Nanos)>,
    /// The gateway's TTFT and ITL histograms by pool, when asked for
    /// ([`Simulation::with_pool_metrics`]).
    pool_metrics: Option<PoolMetrics>,
    workload: W,
    timers: Timers,
    now: Nanos,
    next_id: u64,
    in_flight: Turns,
    worker_in_flight: Vec<u32>,
    /// Per worker: ∫ in-flight dt over the measurement period (request·ns) and its last change.
    in_flight_area: Vec<(u128, Nanos)>,
    dirty: Vec<u32>,
    is_dirty: Vec<bool>,
    /// KV events on their way to the router (fixed delay, so in delivery order).
    kv_queue: VecDeque<(Nanos, KvEvent)>,
    /// Disaggregated fleets with shared links ([`crate::DisaggSetup::shared_links`]): the
    /// KV transfers in flight and their shares.
    links: Option<LinkShare>,
    oracle: Option<Oracle>,
    /// Every phase's snapshot windows, flattened, with what each has seen.
    windows: Vec<WindowAcc>,
    /// Every request's record, with `keep_all_records` only.
    records: Vec<RequestRecord>,
    schedule: Vec<(Nanos, Action)>,
    next_action: usize,
    /// Phase whose measurement period is running.
    measuring: Option<usize>,
    worker_stats: Vec<Vec<WorkerStats>>,
    marks: Vec<EngineMark>,
    totals: RunTotals,
    burst: (Nanos, u64),
    fatal: Option<SimError>,
    /// The timeline, when on, and its next sample instant (`Nanos::MAX` when off or done:
    /// a run without a timeline pays one comparison per event).
    timeline: Option<Recorder>,
    next_sample: Nanos,
    /// Injected faults and the invariant checker, with [`Simulation::with_faults`].
    faults: Option<Box<FaultState>>,
}

impl<W: Workload> std::fmt::Debug for Simulation<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Simulation")
            .field("now", &self.now)
            .field("workers", &self.engines.len())
            .field("in_flight", &self.in_flight.len())
            .finish_non_exhaustive()
    }
}

impl<W: Workload> Simulation<W> {
    /// A cluster per `cfg`, driven by `workload` (created for time zero with the first
    /// phase's concurrency), measured over `phases` run back to back from time zero.
    pub fn new(cfg: SimConfig, workload: W, phases: Vec<Phase>) -> Result<Self, SimError> {
        if cfg.workers == 0 {
            return Err(ConfigError::NoWorkers.into());
        }
        if let Some(d) = &cfg.disagg {
            if d.decode_workers == 0 {
                return Err(ConfigError::NoDecodeWorkers.into());
            }
            if d.workers() != cfg.workers {
                return Err(ConfigError::DisaggWorkers {
                    workers: cfg.workers,
                    prefill: d.prefill_workers,
                    decode: d.decode_workers,
                }
                .into());
            }
        }
        if phases.is_empty() {
            return Err(ConfigError::NoPhases.into());
        }
        for p in &phases {
            p.validate()?;
        }
        let n = cfg.workers as usize;
        let mut engines = Vec::with_capacity(n);
        let mut capacity_total = 0u64;
        let mut pools = Vec::with_capacity(n);
        for i in 0..n {
            let pool = cfg.disagg.as_ref().map(|d| {
                if (i as u32) < d.prefill_workers {
                    Pool::Prefill
                } else {
                    Pool::Decode
                }
            });
            let e = new_engine(&cfg, i as u32, pool)?;
            capacity_total += u64::from(e.kv_capacity_blocks());
            engines.push(e);
            pools.push(pool);
        }
        // A fleet that may grow sizes its index for the most workers it may ever hold.
        let max_workers = cfg.max_workers.map_or(n, |m| (m as usize).max(n));
        if max_workers > n {
            capacity_total = capacity_total / n as u64 * max_workers as u64;
        }
        let block_size = cfg.engine.block_size as usize;
        let router_cfg = RouterConfig {
            policy: cfg.router.policy,
            params: cfg.router.params,
            block_size,
            seed: derive_seed(cfg.seed, streams::ROUTER),
            kv_source: cfg.router.kv_source,
            // Above the fleet's whole KV capacity: the index's own eviction stays a safety
            // net and never decides a routing outcome.
            index: IndexConfig {
                max_blocks: usize::try_from(capacity_total + capacity_total / 4 + 1024)
                    .unwrap_or(usize::MAX),
                max_workers: max_workers.max(1),
            },
            ..RouterConfig::default()
        };
        if cfg.replicas.count == 0 {
            return Err(ConfigError::NoReplicas.into());
        }
        if cfg.replicas.count > 1 && cfg.disagg.is_some() {
            return Err(ConfigError::ReplicasWithPools.into());
        }
        let admission = match &cfg.disagg {
            None if cfg.replicas.count > 1 => {
                let seed = cfg.seed;
                let mut replicas =
                    Replicas::new(router_cfg, cfg.frontend, cfg.replicas, |r| match r {
                        0 => derive_seed(seed, streams::ROUTER),
                        r => derive_seed(seed, streams::REPLICA + u64::from(r)),
                    })
                    .map_err(ConfigError::from)?;
                for (i, e) in engines.iter().enumerate() {
                    replicas
                        .add_worker(WorkerId(i as u64), e.limits(), Nanos::ZERO)
                        .map_err(ConfigError::from)?;
                }
                Admission::Many(replicas)
            }
            None => {
                let mut frontend =
                    Frontend::new(router_cfg, cfg.frontend).map_err(ConfigError::from)?;
                for (i, e) in engines.iter().enumerate() {
                    frontend
                        .add_worker(WorkerId(i as u64), e.limits(), Nanos::ZERO)
                        .map_err(ConfigError::from)?;
                }
                Admission::One(frontend)
            }
            Some(d) => {
                let config = DisaggConfig {
                    frontend: cfg.frontend,
                    local_prefill_max_tokens: d.local_prefill_max_tokens,
                };
                let mut two = DisaggFrontend::new(router_cfg, config).map_err(ConfigError::from)?;
                for (i, e) in engines.iter().enumerate() {
                    let pool = if (i as u32) < d.prefill_workers {
                        Pool::Prefill
                    } else {
                        Pool::Decode
                    };
                    two.add_worker(WorkerId(i as u64), pool, e.limits(), Nanos::ZERO)
                        .map_err(ConfigError::from)?;
                }
                Admission::Two(two)
            }
        };
        let oracle = cfg
            .oracle
            .then(|| Oracle::new(admission.hasher(), cfg.oracle_horizon));
        let mut phase_starts = Vec::with_capacity(phases.len());
        let mut schedule = Vec::new();
        let mut windows = Vec::new();
        let mut t = Nanos::ZERO;
        for (k, p) in phases.iter().enumerate() {
            phase_starts.push(t);
            schedule.push((t, Action::PhaseStart(k)));
            schedule.push((t + p.warmup, Action::MeasureStart(k)));
            windows.extend(p.windows(t).into_iter().map(|(a, b)| {
                let mut w = WindowAcc::new(a, b);
                w.split_turns = cfg.extended_metrics;
                w.slo = cfg.slo;
                w.reuse_block_size = cfg
                    .reuse_attribution
                    .then(|| u32::try_from(admission.hasher().block_size()).unwrap_or(u32::MAX));
                w
            }));
            t += p.duration();
            schedule.push((t, Action::MeasureEnd(k)));
        }
        let mut sim = Self {
            phases,
            phase_starts,
            admission,
            dead: vec![false; n],
            pools,
            draining: vec![false; n],
            retired: Vec::new(),
            pool_metrics: None,
            workload,
            timers: Timers::new(n),
            now: Nanos::ZERO,
            next_id: 0,
            in_flight: Turns::default(),
            worker_in_flight: vec![0; n],
            in_flight_area: vec![(0, Nanos::ZERO); n],
            dirty: Vec::new(),
            is_dirty: vec![false; n],
            kv_queue: VecDeque::new(),
            links: cfg
                .disagg
                .filter(|d| d.shared_links)
                .map(|d| shared_links(&cfg.engine.profile, d.kv_link)),
            oracle,
            windows,
            records: Vec::new(),
            schedule,
            next_action: 0,
            measuring: None,
            worker_stats: Vec::new(),
            marks: vec![EngineMark::default(); n],
            totals: RunTotals::default(),
            burst: (Nanos::ZERO, 0),
            fatal: None,
            timeline: None,
            next_sample: Nanos::MAX,
            faults: None,
            engines,
            cfg,
        };
        sim.worker_stats = vec![Vec::new(); sim.phases.len()];
        sim.timers.arm(Source::Schedule, Some(Nanos::ZERO));
        Ok(sim)
    }

    /// Records a per-worker timeline ([`crate::timeline`]) from the first instant of its grid
    /// after [`now`](Self::now) to the run's [`end`](Self::end). Refuses a grid over
    /// `cfg.max_rows` rows.
    pub fn with_timeline(mut self, cfg: TimelineConfig) -> Result<Self, SimError> {
        let (recorder, next) = Recorder::new(
            cfg,
            self.now,
            self.end(),
            self.cfg.workers,
            self.cfg.engine.max_num_seqs,
        )?;
        self.timeline = Some(recorder);
        self.next_sample = next;
        Ok(self)
    }

    /// The timeline so far, when on.
    pub fn timeline(&self) -> Option<&Timeline> {
        self.timeline.as_ref().map(Recorder::timeline)
    }

    /// Injects `spec`'s faults ([`crate::faults`]), placed by a plan drawn from the run's
    /// seed, and checks the invariants after every step: the first violation ends the run
    /// with [`SimError::Invariant`]. An empty spec changes nothing but the checks. Call it
    /// before the run starts; aggregated fleets only, without a timeline (a restarted worker
    /// is a new column).
    pub fn with_faults(mut self, spec: &FaultSpec) -> Result<Self, SimError> {
        if spec.touches_replicas() && self.cfg.replicas.count < 2 {
            return Err(SimError::Faults(
                "replica-restart and partition need gateway replicas: run with \
                 --gateway-replicas 2 or more",
            ));
        }
        if self.cfg.disagg.is_some() {
            return Err(SimError::Faults(
                "fault injection runs on aggregated fleets only (not with prefill and decode \
                 pools yet)",
            ));
        }
        if self.timeline.is_some() && spec.worker_crash.is_some() {
            return Err(SimError::Faults(
                "worker-crash cannot run with a timeline: the restarted worker would be a new \
                 column",
            ));
        }
        if self.now != Nanos::ZERO || self.totals.issued > 0 {
            return Err(SimError::Faults("faults are set before the run starts"));
        }
        let seed = self.cfg.seed;
        let mut rng = FaultRng::new(derive_seed(seed, streams::FAULTS));
        let replicas = self.cfg.replicas.count.max(1);
        let plan = FaultPlan::draw(spec, self.cfg.workers, replicas, self.end(), &mut rng);
        let mut state = FaultState {
            spec: spec.clone(),
            seed,
            channel: spec
                .touches_events()
                .then(|| EventChannel::new(spec, FaultRng::new(rng.next_u64()))),
            checker: Checker::new(replicas as usize),
            report: FaultReport {
                spec: spec.to_string(),
                seed,
                plan: (!spec.is_empty()).then(|| plan.clone()),
                ..FaultReport::default()
            },
            actions: BTreeMap::new(),
            order: 0,
            lag: vec![Nanos::ZERO; self.engines.len()],
            hang: None,
            mirrors: rustc_hash::FxHashMap::default(),
            kv_streams: crate::replicas::kv_streams(
                self.admission.router().index().config().max_workers,
            ),
            timeouts: rustc_hash::FxHashMap::default(),
            ejections: Ejections::new(
                self.cfg.failover.ejection,
                self.cfg.max_workers.unwrap_or(self.cfg.workers) as usize + 1,
            ),
            last_output: Vec::new(),
            step: 0,
            violation: None,
        };
        if let Some((w, factor)) = plan.slow {
            // The slow engine declares the profile's timing, as a throttled GPU would: its
            // limits stay those the frontend registered.
            let mut cfg = self.cfg.clone();
            cfg.engine.slowdown = factor;
            self.engines[w as usize] = new_engine(&cfg, w, None)?;
            state
                .report
                .note(Nanos::ZERO, format!("worker {w} runs {factor}x slower"));
        }
        if let Some((w, at, restart)) = plan.crash {
            state.schedule(at, FaultAction::Crash(w));
            state.schedule(restart, FaultAction::Restart);
            // Room for the replacement (a new id, as a new instance).
            let limit = self.cfg.max_workers.unwrap_or(self.cfg.workers);
            self.cfg.max_workers = Some(limit.max(self.engines.len() as u32 + 1));
        }
        if let Some((w, at, until)) = plan.hang {
            state.schedule(at, FaultAction::HangStart(w));
            state.schedule(until, FaultAction::HangEnd(w));
        }
        let peer_lease = router::ReplicaTiming::default().peer_lease;
        if let Some((r, at, up)) = plan.replica_restart {
            state.schedule(at, FaultAction::ReplicaDown(r));
            state.schedule(at + peer_lease, FaultAction::LeaseExpired(r));
            state.schedule(up, FaultAction::ReplicaUp(r));
        }
        if let Some((r, at, until)) = plan.partition {
            state.schedule(at, FaultAction::PartitionStart(r));
            state.schedule(at + peer_lease, FaultAction::LeaseExpired(r));
            state.schedule(until, FaultAction::PartitionEnd(r));
        }
        self.timers.arm(Source::Fault, state.next_action());
        self.faults = Some(Box::new(state));
        Ok(self)
    }

    /// What the injected faults did so far, with their plan (with
    /// [`Simulation::with_faults`]).
    pub fn fault_report(&self) -> Option<FaultReport> {
        let f = self.faults.as_ref()?;
        Some(self.completed_report(f))
    }

    /// `f`'s report with the figures kept elsewhere (the checker's, the replicas').
    fn completed_report(&self, f: &FaultState) -> FaultReport {
        let mut report = f.report.clone();
        if let Admission::Many(m) = &self.admission {
            let counters = m.fault_counters();
            report.peer_updates_lost = counters.updates_lost;
            report.kv_events_missed = counters.kv_events_missed;
            report.snapshots_applied = counters.snapshots_applied;
        }
        report.stale_claims = f.checker.stale_claims;
        report.blocks_removed = f.checker.removals;
        report.max_stale_claim_s = f.checker.max_stale.as_secs_f64();
        report
    }

    /// How far worker `w`'s engine clock lags the run's (zero unless it was stopped).
    fn lag(&self, w: u32) -> Nanos {
        match &self.faults {
            Some(f) => f.lag.get(w as usize).copied().unwrap_or(Nanos::ZERO),
            None => Nanos::ZERO,
        }
    }

    /// Virtual time reached.
    pub fn now(&self) -> Nanos {
        self.now
    }

    /// When the last phase ends.
    pub fn end(&self) -> Nanos {
        let last = self.phases.len() - 1;
        self.phase_starts[last] + self.phases[last].duration()
    }

    /// When phase `k` ends.
    pub fn phase_end(&self, k: usize) -> Nanos {
        self.phase_starts[k] + self.phases[k].duration()
    }

    pub fn phases(&self) -> &[Phase] {
        &self.phases
    }

    pub fn workload(&self) -> &W {
        &self.workload
    }

    /// The router of an aggregated fleet, or of a disaggregated fleet's decode pool.
    pub fn router(&self) -> &Router {
        self.admission.router()
    }

    /// A disaggregated fleet's admission (both pools), `None` for an aggregated fleet.
    pub fn disagg(&self) -> Option<&DisaggFrontend> {
        match &self.admission {
            Admission::One(_) | Admission::Many(_) => None,
            Admission::Two(d) => Some(d),
        }
    }

    /// The pool of worker `i` (`None` on an aggregated fleet).
    fn pool_label(&self, i: usize) -> Option<&'static str> {
        self.pools.get(i).copied().flatten().map(Pool::as_str)
    }

    pub fn engines(&self) -> &[Engine] {
        &self.engines
    }

    /// Runs every phase; `progress(k)` after phase `k` ends.
    pub fn run(mut self, mut progress: impl FnMut(usize)) -> Result<RunOutput, SimError> {
        for k in 0..self.phases.len() {
            let end = self.phase_end(k);
            self.run_until(end)?;
            progress(k);
        }
        Ok(self.finish())
    }

    /// Processes every event up to and including `t`.
    pub fn run_until(&mut self, t: Nanos) -> Result<(), SimError> {
        while let Some((at, source)) = self.timers.peek() {
            if at > t {
                break;
            }
            if at > self.next_sample {
                // Every event before `at` is in: samples strictly before it are complete.
                self.sample_through(Nanos(at.0 - 1));
            }
            self.timers.pop();
            self.now = at;
            match source {
                Source::Engine(i) => {
                    let engine_now = at.saturating_sub(self.lag(i));
                    self.engines[i as usize].handle_timeout(engine_now);
                    self.mark_dirty(i);
                }
                Source::Workload => self.workload.handle_timeout(at),
                Source::Router => {
                    self.admission.handle_timeout(at);
                    self.drain_frontend();
                }
                Source::KvDelivery => self.deliver_kv(at),
                Source::KvLinks => self.land_transfers(at),
                Source::Schedule => self.run_schedule(at),
                Source::Fault => self.run_faults(at),
            }
            self.pump();
            if self.faults.is_some() {
                self.check_step();
            }
            if let Some(e) = self.fatal.take() {
                return Err(e);
            }
        }
        self.now = self.now.max(t);
        if t >= self.next_sample {
            self.sample_through(t);
        }
        Ok(())
    }

    /// Takes every timeline sample due at or before `t` (all events up to `t` applied).
    fn sample_through(&mut self, t: Nanos) {
        while self.next_sample <= t {
            let Some(recorder) = &mut self.timeline else {
                self.next_sample = Nanos::MAX;
                return;
            };
            let workers = self
                .engines
                .iter()
                .map(|e| {
                    let m = e.metrics();
                    let load = self.admission.load(e.worker()).unwrap_or_default();
                    WorkerSample {
                        in_flight: load.in_flight,
                        running: m.running,
                        waiting: m.waiting,
                        kv_blocks_used: m.kv_blocks_used,
                        pending_prefill_tokens: load.pending_prefill_tokens,
                        ..WorkerSample::default()
                    }
                })
                .collect();
            let queued = u32::try_from(self.admission.queued()).unwrap_or(u32::MAX);
            self.next_sample = recorder.push(self.next_sample, queued, workers);
        }
    }

    /// Stops the run: computes every phase's metrics.
    pub fn finish(mut self) -> RunOutput {
        let mut phases = Vec::with_capacity(self.phases.len());
        let mut windows = std::mem::take(&mut self.windows).into_iter();
        for (k, p) in self.phases.iter().enumerate() {
            let accs: Vec<WindowAcc> = windows.by_ref().take(p.snapshots as usize).collect();
            let windows_s = accs
                .iter()
                .map(|w| (w.from.as_secs_f64(), w.to.as_secs_f64()))
                .collect();
            let snapshots: Vec<Metrics> = accs
                .into_iter()
                .map(|w| w.metrics(self.cfg.oracle))
                .collect();
            let workers = std::mem::take(&mut self.worker_stats[k]);
            let mut metrics = Metrics::mean(&snapshots);
            let spec = self.cfg.engine.spec_decode.is_some();
            if spec || self.cfg.extended_metrics {
                let sum = |f: fn(&WorkerStats) -> u64| workers.iter().map(f).sum::<u64>();
                let ratio = |a: u64, b: u64| (b > 0).then(|| a as f64 / b as f64);
                metrics.tokens_per_step =
                    ratio(sum(|w| w.decode_tokens), sum(|w| w.decode_seq_steps));
                if spec {
                    metrics.acceptance_rate =
                        ratio(sum(|w| w.spec_accepted), sum(|w| w.spec_evaluated));
                }
            }
            if let Some(serving) = &mut metrics.serving {
                let pool_mean = |pool: Pool| {
                    let u: Vec<f64> = workers
                        .iter()
                        .filter(|w| w.pool == Some(pool.as_str()))
                        .map(|w| w.utilisation)
                        .collect();
                    (!u.is_empty()).then(|| u.iter().sum::<f64>() / u.len() as f64)
                };
                serving.prefill_utilisation = pool_mean(Pool::Prefill);
                serving.decode_utilisation = pool_mean(Pool::Decode);
            }
            phases.push(PhaseResult {
                concurrency: p.concurrency,
                windows_s,
                metrics,
                snapshots,
                workers,
            });
        }
        let mut totals = self.totals.clone();
        totals.in_flight_at_end = self.in_flight.len() as u64;
        totals.queued_at_end = self.admission.queued() as u64;
        totals.in_flight_tokens_at_end = self.in_flight.iter().map(|f| u64::from(f.tokens)).sum();
        totals.engine_steps = self.engines.iter().map(|e| e.metrics().steps).sum();
        totals.oracle_blocks = self.oracle.as_ref().map_or(0, |o| o.len() as u64);
        totals.simulated = self.now;
        if let Admission::Many(m) = &self.admission {
            totals.replicas = Some(m.totals());
        }
        let faults = self.faults.as_deref().map(|f| self.completed_report(f));
        RunOutput {
            phases,
            totals,
            records: self.records,
            timeline: self.timeline.map(Recorder::into_timeline),
            faults,
        }
    }

    // ---- the loop's pieces ------------------------------------------------------------------

    /// Drains everything the last input produced: turns from the workload, events from
    /// engines, until nothing moves; then re-arms the workload's and frontend's timers.
    fn pump(&mut self) {
        loop {
            if self.fatal.is_some() {
                return;
            }
            if let Some(turn) = self.workload.poll_request() {
                self.issue(turn);
                continue;
            }
            if let Some(i) = self.dirty.pop() {
                self.drain_engine(i);
                continue;
            }
            if let Some(worker) = self.admission.take_drained() {
                self.retire(worker);
                continue;
            }
            break;
        }
        self.timers
            .arm(Source::Workload, self.workload.poll_timeout());
        self.timers
            .arm(Source::Router, self.admission.poll_timeout());
    }

    fn mark_dirty(&mut self, i: u32) {
        if !self.is_dirty[i as usize] {
            self.is_dirty[i as usize] = true;
            self.dirty.push(i);
        }
    }

    fn drain_engine(&mut self, i: u32) {
        let stopped = self.faults.as_ref().is_some_and(|f| f.stopped(i));
        if self.dead[i as usize] || stopped {
            self.is_dirty[i as usize] = false;
            return;
        }
        let lag = self.lag(i);
        while let Some(ev) = self.engines[i as usize].poll_event() {
            self.on_engine_event(i, shifted(ev, lag));
        }
        while let Some(x) = self.engines[i as usize].poll_transfer_start() {
            self.start_transfer(i, x, lag);
        }
        self.is_dirty[i as usize] = false;
        let next = self.engines[i as usize].poll_timeout().map(|t| t + lag);
        self.timers.arm(Source::Engine(i), next);
    }

    /// Decode worker `to` admitted a split request's decode leg: its KV leaves the request's
    /// prefill worker on the shared links.
    fn start_transfer(&mut self, to: u32, x: TransferStart, lag: Nanos) {
        let Some(links) = &mut self.links else {
            return;
        };
        let from = self
            .in_flight
            .get_mut(x.id.0)
            .and_then(|f| f.prefill_worker)
            .unwrap_or(to);
        let at = (x.at + lag).max(self.now);
        if let Err(e) = links.start(x.id.0, from, to, x.bytes, at) {
            self.fatal = Some(e.into());
            return;
        }
        self.timers.arm(Source::KvLinks, links.poll_timeout());
    }

    /// KV that landed by `at` joins its decode worker's batch.
    fn land_transfers(&mut self, at: Nanos) {
        let Some(links) = &mut self.links else {
            return;
        };
        let arrived = links.handle_timeout(at);
        self.timers.arm(Source::KvLinks, links.poll_timeout());
        for a in arrived {
            if let Some(f) = self.in_flight.get_mut(a.id) {
                f.kv_transfer_took = Some(a.took());
            }
            if self.dead[a.to as usize] {
                continue;
            }
            let engine_at = a.at.saturating_sub(self.lag(a.to));
            if self.engines[a.to as usize].kv_arrived(RequestId(a.id), engine_at) {
                self.mark_dirty(a.to);
            }
        }
    }

    fn run_schedule(&mut self, at: Nanos) {
        while let Some(&(t, action)) = self.schedule.get(self.next_action) {
            if t > at {
                break;
            }
            self.next_action += 1;
            match action {
                Action::PhaseStart(k) => {
                    let c = self.phases[k].concurrency;
                    self.workload.set_concurrency(c, at);
                }
                Action::MeasureStart(k) => {
                    self.measuring = Some(k);
                    for (i, e) in self.engines.iter().enumerate() {
                        self.marks[i] = EngineMark::of(&e.metrics());
                    }
                    self.in_flight_area.fill((0, at));
                    self.worker_stats[k] = (0..self.engines.len())
                        .map(|i| WorkerStats {
                            worker: i as u32,
                            pool: self.pool_label(i),
                            peak_in_flight: self.worker_in_flight[i],
                            ..WorkerStats::default()
                        })
                        .collect();
                }
                Action::MeasureEnd(k) => {
                    let span = self.phases[k].window.as_secs_f64();
                    for (i, e) in self.engines.iter().enumerate() {
                        let now = EngineMark::of(&e.metrics());
                        let mark = self.marks[i];
                        let Some(s) = self.worker_stats[k].get_mut(i) else {
                            continue;
                        };
                        s.utilisation =
                            ((now.busy.saturating_sub(mark.busy)).as_secs_f64() / span).min(1.0);
                        s.prefill_tokens = now.prefill - mark.prefill;
                        s.output_tokens = now.output - mark.output;
                        s.preemptions = now.preemptions - mark.preemptions;
                        s.decode_seq_steps = now.decode_seq_steps - mark.decode_seq_steps;
                        s.decode_tokens = now.decode_tokens - mark.decode_tokens;
                        s.spec_drafts = now.spec_drafts - mark.spec_drafts;
                        s.spec_accepted = now.spec_accepted - mark.spec_accepted;
                        s.spec_evaluated = now.spec_evaluated - mark.spec_evaluated;
                        let (area, last) = self.in_flight_area[i];
                        let area =
                            area + u128::from(self.worker_in_flight[i]) * u128::from((at - last).0);
                        s.mean_in_flight = area as f64 / self.phases[k].window.0 as f64;
                    }
                    self.measuring = None;
                }
            }
        }
        let next = self.schedule.get(self.next_action).map(|a| a.0);
        self.timers.arm(Source::Schedule, next);
    }

    fn deliver_kv(&mut self, at: Nanos) {
        if self.faults.as_ref().is_some_and(|f| f.channel.is_some()) {
            while let Some(ev) = self
                .faults
                .as_mut()
                .and_then(|f| f.channel.as_mut())
                .and_then(|c| c.pop_due(at))
            {
                self.apply_kv(&ev);
            }
            let next = self
                .faults
                .as_ref()
                .and_then(|f| f.channel.as_ref())
                .and_then(EventChannel::next_delivery);
            self.timers.arm(Source::KvDelivery, next);
            return;
        }
        while self.kv_queue.front().is_some_and(|e| e.0 <= at) {
            if let Some((_, ev)) = self.kv_queue.pop_front() {
                self.apply_kv(&ev);
            }
        }
        let next = self.kv_queue.front().map(|e| e.0);
        self.timers.arm(Source::KvDelivery, next);
    }

    fn apply_kv(&mut self, ev: &KvEvent) {
        // A failed worker's last events (still on their way) would only re-add what its
        // removal cleared.
        if self
            .dead
            .get(ev.worker.0 as usize)
            .copied()
            .unwrap_or(false)
        {
            return;
        }
        if let Some(f) = &mut self.faults {
            let tally = self.admission.apply_event_resyncing(
                ev,
                f.mirrors.get(&ev.worker),
                &mut f.kv_streams,
            );
            f.report.kv_resyncs += u64::from(tally.resynced);
            f.report.kv_snapshots += u64::from(tally.filled);
            f.report.kv_stale_events += u64::from(tally.stale);
            self.totals.kv_event_errors += u64::from(tally.errors);
            return;
        }
        if !self.admission.apply_event(ev) {
            self.totals.kv_event_errors += 1;
        }
    }

    // ---- turns ------------------------------------------------------------------------------

    fn issue(&mut self, turn: Turn) {
        let now = self.now;
        if self.burst.0 == now {
            self.burst.1 += 1;
            if self.burst.1 > MAX_TURNS_PER_INSTANT {
                self.fatal = Some(SimError::Livelock {
                    turns: self.burst.1,
                    at: now,
                });
                return;
            }
        } else {
            self.burst = (now, 1);
        }
        let seq = self.next_id;
        self.next_id += 1;
        self.totals.issued += 1;
        if let Some(f) = &mut self.faults
            && let Err(what) = f.checker.on_issue(turn.key)
        {
            f.violate(what);
        }
        let key = self.admission.key(&turn.prompt);
        let oracle_cached = match &mut self.oracle {
            Some(o) => o.issue(now, turn.prompt.len(), &key.seq),
            None => 0,
        };
        let id = self.in_flight.insert(InFlight {
            id: seq,
            turn: turn.key,
            prompt_last_block: key.seq.last().copied(),
            prompt_hashes: Some(turn_hashes(
                &key,
                self.admission.hasher(),
                &turn.prompt,
                &turn.output,
            )),
            prompt: turn.prompt,
            output: turn.output,
            issued_at: turn.issued_at.min(now),
            arrived_at: now,
            routed_at: None,
            worker: None,
            first_token_at: None,
            last_token_at: None,
            tokens: 0,
            spans: 0,
            oracle_cached,
            overlap_blocks: 0,
            available_blocks: 0,
            route: None,
            prefill_worker: None,
            prefilling: false,
            prefill_cached: None,
            kv_transfer_took: None,
            leg_sent_at: now,
            leg_first_token: false,
            leg_prompt: None,
            leg_offset: 0,
            migration: None,
            migrating: None,
        });
        self.admission.submit(RequestId(id), key, now);
        self.drain_frontend();
    }

    /// Acts on the frontend's outcomes: an assigned turn goes to its engine(s), a refused or
    /// timed-out one fails.
    fn drain_frontend(&mut self) {
        while let Some(event) = self.admission.poll_event(self.now) {
            match event {
                Admitted::One(FrontendEvent::Assigned { id, decision, .. }) => {
                    self.start(id.0, decision)
                }
                Admitted::One(FrontendEvent::Refused { id, .. })
                | Admitted::Two(DisaggEvent::Refused { id, .. }) => {
                    // A resend that finds no worker ends with its worker's error.
                    let outcome = match self.in_flight.get_mut(id.0).and_then(|f| f.migrating) {
                        Some(reason) => failure_outcome(reason),
                        None => Outcome::Dropped,
                    };
                    self.fail(id.0, outcome)
                }
                Admitted::Two(DisaggEvent::Assigned { id, route }) => self.start_legs(id.0, route),
            }
        }
    }

    /// A disaggregated route: the prefill leg on its prefill worker (the decode leg follows
    /// at `PrefillDone`), or the whole request on the decode worker.
    fn start_legs(&mut self, id: u64, route: Route) {
        let now = self.now;
        let Some(f) = self.in_flight.get_mut(id) else {
            return;
        };
        let decode = route.decode().worker.0 as u32;
        // A retry keeps the instant it was first routed.
        f.routed_at.get_or_insert(now);
        f.worker = Some(decode);
        let (tag, leg, target, prefix) = match &route {
            Route::Split { prefill, .. } => {
                let p = prefill.worker.0 as u32;
                f.prefill_worker = Some(p);
                (RouteTag::Split, Leg::Prefill, p, prefill)
            }
            Route::Local { decode: d, reason } => (RouteTag::of(reason), Leg::Whole, decode, d),
        };
        f.route = Some(tag);
        f.prefilling = leg == Leg::Prefill;
        f.overlap_blocks = prefix.overlap_blocks;
        f.available_blocks = prefix.available_blocks;
        let req = EngineRequest {
            id: RequestId(id),
            prompt: Arc::clone(&f.prompt),
            output: OutputSpec::Tokens(Arc::clone(&f.output)),
            leg,
        };
        self.totals
            .disagg
            .get_or_insert_with(DisaggTotals::default)
            .count(tag);
        self.add_in_flight(target);
        self.engines[target as usize].submit(req, now);
        self.mark_dirty(target);
    }

    // ---- faults ------------------------------------------------------------------------------

    /// Whether an engine event of `worker` concerns a request that is on it. One that is
    /// not is dropped: a cancellation of a request given up on (it was routed again, or
    /// failed); output for it would be a request answered twice, an invariant violation.
    fn is_on(&mut self, worker: u32, ev: &EngineEvent) -> bool {
        let (id, output) = match ev {
            EngineEvent::FirstToken { id, .. }
            | EngineEvent::Tokens { id, .. }
            | EngineEvent::Finished { id, .. }
            | EngineEvent::PrefillDone { id, .. } => (*id, true),
            EngineEvent::Cancelled { id, .. } | EngineEvent::Rejected { id, .. } => (*id, false),
            EngineEvent::Kv(_) => return true,
        };
        let holder = self.in_flight.get_mut(id.0).map(|f| f.worker);
        let on = holder == Some(Some(worker));
        if !on
            && output
            && let Some(f) = &mut self.faults
        {
            f.violate(format!(
                "worker {worker} produced output for request {} that is not on it (its \
                 worker: {holder:?}; ended, or moved to another worker): answered twice \
                 ({ev:?})",
                id.0
            ));
        }
        on
    }

    /// The invariants after one step of the loop (see [`crate::faults`]).
    fn check_step(&mut self) {
        let Some(f) = self.faults.as_mut() else {
            return;
        };
        f.step += 1;
        f.report.checked_steps += 1;
        let mut broken = f.violation.take();
        let t = &self.totals;
        let in_flight = self.in_flight.len() as u64;
        if broken.is_none() && t.issued != t.finished + t.failed + in_flight {
            broken = Some(format!(
                "{} turns issued but {} finished + {} failed + {in_flight} in flight: a request \
                 was lost or counted twice",
                t.issued, t.finished, t.failed
            ));
        }
        if broken.is_none() && f.checker.open_turns() as u64 != in_flight {
            broken = Some(format!(
                "{} turns open for the checker, {in_flight} in flight for the driver",
                f.checker.open_turns()
            ));
        }
        if broken.is_none() {
            for turn in self.in_flight.iter() {
                if let Some(w) = turn.worker
                    && self.dead.get(w as usize).copied().unwrap_or(true)
                {
                    broken = Some(format!(
                        "turn {} of conversation {} is still on worker {w}, which is gone: lost",
                        turn.turn.turn, turn.turn.conversation
                    ));
                    break;
                }
            }
        }
        if broken.is_none() && self.cfg.router.kv_source == KvSource::Events {
            // Every replica's index (one replica: the router's).
            let indexes: Vec<&kv_index::KvIndex> = match &self.admission {
                Admission::Many(m) => (0..m.count())
                    .filter_map(|r| m.frontend(r))
                    .map(|f| f.router().index())
                    .collect(),
                _ => vec![self.admission.router().index()],
            };
            for (r, index) in indexes.into_iter().enumerate() {
                if let Err(what) = f.checker.check_index(r, self.now, index) {
                    broken = Some(what);
                    break;
                }
            }
        }
        if let Some(what) = broken {
            self.fatal = Some(SimError::Invariant {
                seed: f.seed,
                spec: f.spec.to_string(),
                step: f.step,
                at: self.now,
                what,
            });
        }
    }

    /// Runs the fault actions due at `at`.
    fn run_faults(&mut self, at: Nanos) {
        loop {
            let Some(f) = self.faults.as_mut() else {
                return;
            };
            let Some((&key, _)) = f.actions.iter().next() else {
                break;
            };
            if key.0 > at {
                break;
            }
            let Some(action) = f.actions.remove(&key) else {
                break;
            };
            match action {
                FaultAction::Crash(w) => self.crash(w),
                FaultAction::Restart => self.restart(),
                FaultAction::HangStart(w) => self.hang_start(w),
                FaultAction::HangEnd(w) => self.hang_end(w),
                FaultAction::Eject(w) => self.eject(w, "its health check timed out"),
                FaultAction::Readmit(w) => self.readmit(w),
                FaultAction::Deadline(id, w) => self.deadline(id, w),
                FaultAction::ReplicaDown(r) => self.replica_down(r),
                FaultAction::ReplicaUp(r) => self.replica_up(r),
                FaultAction::PartitionStart(r) => self.partition_start(r),
                FaultAction::PartitionEnd(r) => self.partition_end(r),
                FaultAction::LeaseExpired(r) => self.lease_expired(r),
            }
        }
        let next = self.faults.as_ref().and_then(|f| f.next_action());
        self.timers.arm(Source::Fault, next);
    }

    fn note(&mut self, what: String) {
        let now = self.now;
        if let Some(f) = &mut self.faults {
            f.report.note(now, what);
        }
    }

    /// The worker's process dies: its requests end with `worker_failed`, its engine and
    /// cache are gone, the index forgets it.
    fn crash(&mut self, w: u32) {
        if !self.fail_worker_with(w, Outcome::WorkerFailed) {
            return;
        }
        // Requests the core had already forgotten (the worker was ejected while stopped)
        // die with it too; a dead process never continues.
        let forgotten: Vec<u64> = self
            .in_flight
            .slots
            .iter()
            .enumerate()
            .filter_map(|(slot, (generation, turn))| {
                let on_it = turn.as_ref()?.worker == Some(w);
                on_it.then_some(u64::from(*generation) << 32 | slot as u64)
            })
            .collect();
        for id in forgotten {
            self.remove_in_flight(w);
            if let Some(f) = self.in_flight.get_mut(id) {
                f.worker = None;
            }
            self.migrate_or_fail(id, FailureReason::WorkerFailed);
        }
        if let Some(f) = &mut self.faults {
            if f.hang.as_ref().is_some_and(|h| h.worker == w) {
                f.hang = None;
            }
            f.checker.on_worker_gone(WorkerId(u64::from(w)));
            f.mirrors.remove(&WorkerId(u64::from(w)));
            f.kv_streams.forget(WorkerId(u64::from(w)));
            if let Admission::Many(m) = &mut self.admission {
                m.forget_kv_stream(WorkerId(u64::from(w)));
            }
            if let Some(c) = &mut f.channel {
                c.forget(WorkerId(u64::from(w)));
            }
        }
        self.note(format!("worker {w} crashed"));
    }

    /// The crashed worker's replacement joins with an empty cache, as a new instance.
    fn restart(&mut self) {
        match self.add_worker(None) {
            Ok(id) => self.note(format!("worker {id} joined (restart, empty cache)")),
            Err(e) => self.note(format!("restart refused: {e}")),
        }
    }

    /// The worker's process stops: nothing leaves it; every request on it gets its deadline,
    /// and the next health check finds it down.
    fn hang_start(&mut self, w: u32) {
        let now = self.now;
        if self.dead.get(w as usize).copied().unwrap_or(true) {
            return;
        }
        // What it produced up to now has left it (in speed mode the engine emits a stretch's
        // tokens at its end unless asked for the present).
        let engine_now = now.saturating_sub(self.lag(w));
        self.engines[w as usize].sync(engine_now);
        self.drain_engine(w);
        self.timers.arm(Source::Engine(w), None);
        let failover = self.cfg.failover;
        let deadlines: Vec<(Nanos, u64)> = self
            .in_flight
            .slots
            .iter()
            .enumerate()
            .filter_map(|(slot, (generation, turn))| {
                let turn = turn.as_ref()?;
                (turn.worker == Some(w)).then(|| {
                    let due = match (turn.leg_first_token, turn.last_token_at) {
                        (true, Some(last)) => last + failover.stall_timeout,
                        _ => turn.leg_sent_at + failover.first_byte_timeout,
                    };
                    (due.max(now), u64::from(*generation) << 32 | slot as u64)
                })
            })
            .collect();
        let Some(f) = &mut self.faults else {
            return;
        };
        f.hang = Some(Hang {
            worker: w,
            since: now,
            stopped: true,
            ejected: false,
            inbox: Vec::new(),
            abandoned: Vec::new(),
        });
        for (due, id) in deadlines {
            f.schedule(due, FaultAction::Deadline(id, w));
        }
        f.schedule(
            next_health_check(now, failover.health_interval) + failover.probe_timeout,
            FaultAction::Eject(w),
        );
        self.note(format!("worker {w} stopped answering"));
    }

    /// The stopped worker leaves the routing set and the index (the gateway's ejection);
    /// its requests keep waiting for their own deadlines.
    fn eject(&mut self, w: u32, why: &str) {
        let now = self.now;
        let Some(f) = &mut self.faults else {
            return;
        };
        match &mut f.hang {
            Some(h) if h.worker == w && h.stopped && !h.ejected => h.ejected = true,
            _ => return,
        }
        // The core forgets its requests; the driver still holds them until their deadlines.
        let _orphans = self.admission.remove_worker(WorkerId(u64::from(w)), now);
        self.note(format!("worker {w} ejected: {why}"));
        self.drain_frontend();
    }

    /// A request's deadline on the stopped worker, which ejects it for the ejection time:
    /// before the worker's first token, routed again (the gateway's first-byte retry, up to
    /// `first_byte_retries`) or failed; after it, migrated or failed (the core decides).
    fn deadline(&mut self, id: u64, w: u32) {
        let now = self.now;
        let Some(f) = self.faults.as_ref() else {
            return;
        };
        if !f.stopped(w) {
            return;
        }
        let Some(turn) = self.in_flight.get_mut(id) else {
            return;
        };
        if turn.worker != Some(w) {
            return;
        }
        let first_byte = !turn.leg_first_token;
        // The gateway's judgement: a worker still streaming other requests is busy, not
        // silent, and the request waits (the simulated worker is stopped, so it is silent
        // once its health check fails or its last output is a timeout old).
        let failover = self.cfg.failover;
        let timeout = if first_byte {
            failover.first_byte_timeout
        } else {
            failover.stall_timeout
        };
        if let router::DeadlineVerdict::WaitUntil(at) = router::judge_deadline(
            !f.ejected(w),
            f.last_output(w),
            now,
            timeout,
            failover.health_interval,
        ) {
            if let Some(f) = self.faults.as_mut() {
                f.schedule(at, FaultAction::Deadline(id, w));
                self.timers.arm(Source::Fault, f.next_action());
            }
            return;
        }
        let Some(turn) = self.in_flight.get_mut(id) else {
            return;
        };
        turn.worker = None;
        let prompt = Arc::clone(turn.leg_prompt.as_ref().unwrap_or(&turn.prompt));
        let why = if first_byte {
            "first-byte timeout"
        } else {
            "stall timeout"
        };
        self.eject(w, why);
        self.remove_in_flight(w);
        self.admission.on_finished(RequestId(id), now);
        let Some(f) = self.faults.as_mut() else {
            return;
        };
        if let Some(h) = &mut f.hang {
            // Never read: drop it from the inbox; read: cancelled when the worker continues.
            let before = h.inbox.len();
            h.inbox.retain(|r| r.id != RequestId(id));
            if h.inbox.len() == before {
                h.abandoned.push(RequestId(id));
            }
        }
        // Its other requests timing out too are the same ejection, noted once.
        let already_out = f
            .ejections
            .ejected_until(WorkerId(u64::from(w)), now)
            .is_some();
        let until = f.ejections.eject(WorkerId(u64::from(w)), now);
        if !already_out && until > now {
            f.report.note(
                now,
                format!(
                    "worker {w} ejected until {:.1} s (ejection time)",
                    until.as_secs_f64()
                ),
            );
        }
        if !first_byte {
            self.migrate_or_fail(id, FailureReason::WorkerTimeout);
            return;
        }
        let Some(f) = self.faults.as_mut() else {
            return;
        };
        let timeouts = f.timeouts.entry(id).or_insert(0);
        *timeouts += 1;
        if *timeouts <= self.cfg.failover.first_byte_retries {
            f.report.retried_requests += 1;
            let key = self.admission.key(&prompt);
            self.admission.submit(RequestId(id), key, now);
            self.drain_frontend();
        } else {
            self.fail(id, Outcome::WorkerTimeout);
        }
    }

    /// Request `id`'s worker failed for `reason` (it is no longer on it): the router core
    /// decides, as in the gateway, whether it is resent through the admission core with its
    /// output so far (the engine then gets the prompt followed by that output, and generates
    /// the rest of its tokens), or ends with the failure's error.
    fn migrate_or_fail(&mut self, id: u64, reason: FailureReason) {
        let now = self.now;
        let limit = self.cfg.failover.migration_limit;
        let Some(f) = self.in_flight.get_mut(id) else {
            return;
        };
        // One choice; the simulator's replies have no text, so no byte cap applies.
        let m = f
            .migration
            .get_or_insert_with(|| Box::new(MigrationState::new(limit, 1, usize::MAX)));
        // What it generated since the last decision (its worker's tokens so far).
        let (kept, upto) = (m.earlier_tokens() as usize, f.tokens as usize);
        if let Some(ids) = f.output.get(kept..upto) {
            m.on_choice(ChoiceOutput {
                index: 0,
                text: "",
                ids: ChunkIds::Ids(ids),
                tokens: ids.len() as u64,
                finished: false,
            });
        }
        let max_tokens = u32::try_from(f.output.len()).unwrap_or(u32::MAX);
        // Every id is given, so the text is never tokenized.
        match m.decide(reason, &f.prompt, Some(max_tokens), |_| Vec::new()) {
            Decision::Migrate(c) => {
                let generated = u32::try_from(c.generated).unwrap_or(u32::MAX);
                let prompt: Arc<[u32]> = Arc::from(c.tokens);
                f.leg_offset = generated;
                f.leg_prompt = Some(Arc::clone(&prompt));
                f.leg_first_token = false;
                f.worker = None;
                f.migrating = Some(reason);
                if let Some(faults) = &mut self.faults {
                    // A new worker: its own first-byte retries.
                    faults.timeouts.remove(&id);
                }
                let key = self.admission.key(&prompt);
                self.admission.submit(RequestId(id), key, now);
                self.drain_frontend();
            }
            Decision::End { reason, .. } => self.fail(id, failure_outcome(reason)),
        }
    }

    /// The stopped worker continues where it stopped (its engine clock now lags by the
    /// pause), reads what was sent to it, cancels what was given up on.
    fn hang_end(&mut self, w: u32) {
        let now = self.now;
        let Some(f) = &mut self.faults else {
            return;
        };
        let Some(h) = &mut f.hang else {
            return;
        };
        if h.worker != w || !h.stopped {
            return;
        }
        h.stopped = false;
        let inbox = std::mem::take(&mut h.inbox);
        let abandoned = std::mem::take(&mut h.abandoned);
        let ejected = h.ejected;
        if let Some(lag) = f.lag.get_mut(w as usize) {
            *lag += now.saturating_sub(h.since);
        }
        if ejected {
            f.schedule(
                next_health_check(now, self.cfg.failover.health_interval),
                FaultAction::Readmit(w),
            );
        }
        let engine_now = now.saturating_sub(self.lag(w));
        let engine = &mut self.engines[w as usize];
        for id in abandoned {
            engine.cancel(id, engine_now);
        }
        for req in inbox {
            engine.submit(req, engine_now);
        }
        engine.handle_timeout(engine_now);
        self.mark_dirty(w);
        self.note(format!("worker {w} answers again"));
    }

    /// A passing health check puts the worker back in the routing set, once its ejection
    /// time is over (`router::Ejections`, as the gateway asks before a health check returns
    /// a worker); until then the health check after it is waited for.
    fn readmit(&mut self, w: u32) {
        let now = self.now;
        let Some(f) = &mut self.faults else {
            return;
        };
        match &f.hang {
            Some(h) if h.worker == w && h.ejected && !h.stopped => {}
            _ => return,
        }
        if let Some(until) = f.ejections.ejected_until(WorkerId(u64::from(w)), now) {
            let check = next_health_check(until, self.cfg.failover.health_interval);
            f.schedule(check, FaultAction::Readmit(w));
            return;
        }
        if let Some(h) = &mut f.hang {
            h.ejected = false;
        }
        let limits = self.engines[w as usize].limits();
        let readmitted = match &mut self.admission {
            Admission::One(frontend) => frontend.add_worker(WorkerId(u64::from(w)), limits, now),
            Admission::Many(m) => m.add_worker(WorkerId(u64::from(w)), limits, now),
            Admission::Two(_) => Ok(()),
        };
        if let Err(e) = readmitted {
            self.note(format!("worker {w} not readmitted: {e}"));
            return;
        }
        self.note(format!("worker {w} back in the routing set"));
        self.drain_frontend();
    }

    /// The workers a gateway routes to now: alive, and not ejected.
    fn routing_set(&self) -> Vec<(WorkerId, router::WorkerLimits)> {
        (0..self.engines.len() as u32)
            .filter(|&w| !self.dead[w as usize] && !self.draining[w as usize])
            .filter(|&w| !self.faults.as_ref().is_some_and(|f| f.ejected(w)))
            .map(|w| (WorkerId(u64::from(w)), self.engines[w as usize].limits()))
            .collect()
    }

    /// A gateway replica's process dies: the turns it held end with `gateway_failed` (their
    /// clients' connections broke) and their engines cancel them, as for a client that
    /// disconnects; its index and its view of the fleet are gone.
    fn replica_down(&mut self, r: u32) {
        let now = self.now;
        let workers = self.routing_set();
        let Admission::Many(m) = &mut self.admission else {
            return;
        };
        let lost = match m.kill(r as usize, &workers, now) {
            Ok(lost) => lost,
            Err(e) => {
                self.fatal = Some(e.into());
                return;
            }
        };
        if let Some(f) = &mut self.faults {
            f.checker.on_index_reset(r as usize);
        }
        let n = lost.len();
        for id in lost {
            self.abandon(id);
            self.fail(id.0, Outcome::GatewayFailed);
        }
        self.note(format!(
            "gateway replica {r} died; {n} requests lost with their connections"
        ));
        self.drain_frontend();
    }

    /// Request `id`'s client is gone: its engine cancels it (a stopped one when it continues).
    /// What the engine produced before now reaches the request first (it may even finish).
    fn abandon(&mut self, id: RequestId) {
        let now = self.now;
        let Some(w) = self.in_flight.get_mut(id.0).and_then(|t| t.worker) else {
            return;
        };
        if self.dead.get(w as usize).copied().unwrap_or(true) {
            self.remove_in_flight(w);
            return;
        }
        let stopped = self.faults.as_ref().is_some_and(|f| f.stopped(w));
        if !stopped {
            // In speed mode the engine emits a stretch's tokens at its end unless asked for
            // the present.
            let engine_now = now.saturating_sub(self.lag(w));
            self.engines[w as usize].sync(engine_now);
            self.drain_engine(w);
            if self.in_flight.get_mut(id.0).and_then(|t| t.worker) != Some(w) {
                return;
            }
        }
        self.remove_in_flight(w);
        if let Some(h) = self.faults.as_mut().and_then(|f| f.hang.as_mut())
            && h.worker == w
            && h.stopped
        {
            let before = h.inbox.len();
            h.inbox.retain(|q| q.id != id);
            if h.inbox.len() == before {
                h.abandoned.push(id);
            }
            return;
        }
        let engine_now = now.saturating_sub(self.lag(w));
        self.engines[w as usize].cancel(id, engine_now);
        self.mark_dirty(w);
    }

    /// The dead replica starts again, empty, and fetches its peers' snapshots and the
    /// workers' cache snapshots (the gateway asks each worker it hears announce itself; here
    /// at once, as the heartbeat interval is short against the replica's downtime).
    fn replica_up(&mut self, r: u32) {
        let now = self.now;
        if let Admission::Many(m) = &mut self.admission {
            m.restart(r as usize, now);
            let mut restored = 0u64;
            if let Some(f) = &mut self.faults {
                // In worker order, so the run does not depend on the map's.
                let mut workers: Vec<_> = f.mirrors.keys().copied().collect();
                workers.sort_unstable();
                for worker in workers {
                    if let Some(mirror) = f.mirrors.get(&worker)
                        && m.restore_worker(r as usize, worker, mirror)
                    {
                        restored += 1;
                    }
                }
                f.report.kv_snapshots += restored;
            }
            self.note(format!(
                "gateway replica {r} started again (new epoch), fetching its peers' snapshots \
                 and {restored} workers' cache snapshots"
            ));
        }
        self.drain_frontend();
    }

    fn partition_start(&mut self, r: u32) {
        if let Admission::Many(m) = &mut self.admission {
            m.cut_off(r as usize);
            self.note(format!(
                "gateway replica {r} cut off NATS (no KV events, no peer updates)"
            ));
        }
    }

    fn partition_end(&mut self, r: u32) {
        let now = self.now;
        if let Admission::Many(m) = &mut self.admission {
            m.reconnect(r as usize, now);
            self.note(format!("gateway replica {r} back on NATS"));
        }
        self.drain_frontend();
    }

    fn lease_expired(&mut self, r: u32) {
        let now = self.now;
        if let Admission::Many(m) = &mut self.admission
            && m.lease_expired(r as usize, now)
        {
            self.note(format!(
                "gateway replica {r} silent for the peer lease: its peers forget it"
            ));
        }
        self.drain_frontend();
    }

    fn disagg_mut(&mut self) -> Option<&mut DisaggFrontend> {
        match &mut self.admission {
            Admission::One(_) | Admission::Many(_) => None,
            Admission::Two(d) => Some(d),
        }
    }

    /// Fails worker `worker` now, as a process crash would: its engine and everything in it
    /// are gone and its pool forgets it. A request whose prefill leg ran there is prefilled
    /// again on its decode worker (the admission core re-issues it locally); a request on a
    /// decode or aggregated worker fails, and its prefill leg elsewhere is cancelled. `false`
    /// when there is no such live worker.
    pub fn fail_worker(&mut self, worker: u32) -> bool {
        self.fail_worker_with(worker, Outcome::Dropped)
    }

    /// [`fail_worker`](Self::fail_worker), its lost requests ending with `outcome`.
    fn fail_worker_with(&mut self, worker: u32, outcome: Outcome) -> bool {
        let w = worker as usize;
        if self.dead.get(w).copied().unwrap_or(true) {
            return false;
        }
        self.dead[w] = true;
        self.timers.arm(Source::Engine(worker), None);
        let now = self.now;
        let orphans = self.admission.remove_worker(WorkerId(w as u64), now);
        for id in orphans {
            let Some(f) = self.in_flight.get_mut(id.0) else {
                continue;
            };
            let (prefilling, prefill_worker) = (f.prefilling, f.prefill_worker);
            if prefilling && prefill_worker == Some(worker) {
                f.prefilling = false;
                self.remove_in_flight(worker);
                if let Some(t) = &mut self.totals.disagg {
                    t.prefill_failures += 1;
                }
                if let Some(d) = self.disagg_mut() {
                    d.on_prefill_failed(id, now);
                }
                continue;
            }
            // Lost with its decode (or aggregated) worker.
            match (prefilling, prefill_worker) {
                (true, Some(p)) => {
                    self.engines[p as usize].cancel(id, now);
                    self.remove_in_flight(p);
                    self.mark_dirty(p);
                }
                _ => self.remove_in_flight(worker),
            }
            self.admission.on_finished(id, now);
            if outcome == Outcome::WorkerFailed {
                // A crash under injected faults: the gateway migrates the request.
                if let Some(f) = self.in_flight.get_mut(id.0) {
                    f.worker = None;
                }
                self.migrate_or_fail(id.0, FailureReason::WorkerFailed);
            } else {
                self.fail(id.0, outcome);
            }
        }
        self.drain_frontend();
        self.pump();
        true
    }

    /// Adds a worker to `pool` now (`None`: an aggregated fleet's worker): a new engine with
    /// an empty cache, registered with the admission core at once, so the next request may
    /// go to it. Its id is the next unused one (ids are never reused, so a late KV event of
    /// a retired worker cannot land on a new one). Refused past [`SimConfig::max_workers`],
    /// or with a timeline on (its rows have one column per initial worker).
    pub fn add_worker(&mut self, pool: Option<Pool>) -> Result<u32, SimError> {
        let id = self.engines.len() as u32;
        let limit = self.cfg.max_workers.unwrap_or(self.cfg.workers);
        if id >= limit {
            return Err(ConfigError::TooManyWorkers { limit }.into());
        }
        if self.timeline.is_some() {
            return Err(ConfigError::ResizeWithTimeline.into());
        }
        if pool.is_some() != self.cfg.disagg.is_some() {
            return Err(ConfigError::PoolMismatch.into());
        }
        let engine = new_engine(&self.cfg, id, pool)?;
        let limits = engine.limits();
        let now = self.now;
        let worker = WorkerId(u64::from(id));
        match (&mut self.admission, pool) {
            (Admission::One(f), _) => f.add_worker(worker, limits, now),
            (Admission::Many(m), _) => m.add_worker(worker, limits, now),
            (Admission::Two(d), Some(p)) => d.add_worker(worker, p, limits, now),
            (Admission::Two(_), None) => return Err(ConfigError::PoolMismatch.into()),
        }
        .map_err(ConfigError::from)?;
        let metrics = EngineMark::of(&engine.metrics());
        self.engines.push(engine);
        self.pools.push(pool);
        self.dead.push(false);
        self.draining.push(false);
        self.timers.add_engine();
        self.worker_in_flight.push(0);
        self.in_flight_area.push((0, now));
        self.is_dirty.push(false);
        self.marks.push(metrics);
        if let Some(f) = &mut self.faults {
            f.lag.push(Nanos::ZERO);
        }
        if let Some(k) = self.measuring {
            self.worker_stats[k].push(WorkerStats {
                worker: id,
                pool: pool.map(Pool::as_str),
                ..WorkerStats::default()
            });
        }
        // Waiters may now be routed to it.
        self.drain_frontend();
        self.pump();
        Ok(id)
    }

    /// Starts draining live worker `worker` (scaling its pool down): it gets no new request;
    /// its requests in flight finish there; once it is idle it leaves (its engine stops and
    /// the router forgets it and its blocks), listed in [`Simulation::retired`]. `false`
    /// when there is no such live, non-draining worker.
    pub fn drain_worker(&mut self, worker: u32) -> bool {
        let w = worker as usize;
        if self.dead.get(w).copied().unwrap_or(true) || self.draining[w] {
            return false;
        }
        let now = self.now;
        let id = WorkerId(u64::from(worker));
        let accepted = match &mut self.admission {
            Admission::One(f) => f.drain_worker(id, now),
            Admission::Two(d) => d.drain_worker(id, now),
            Admission::Many(m) => m.drain_worker(id, now),
        };
        if accepted {
            self.draining[w] = true;
            // Waiters with no other worker left are refused now.
            self.drain_frontend();
            self.pump();
        }
        accepted
    }

    /// A drained worker leaves: its engine stops, its pool forgets it (and its blocks).
    fn retire(&mut self, worker: WorkerId) {
        let w = worker.0 as usize;
        if self.dead.get(w).copied().unwrap_or(true) {
            return;
        }
        self.dead[w] = true;
        self.draining[w] = false;
        self.timers.arm(Source::Engine(w as u32), None);
        let now = self.now;
        let orphans = self.admission.remove_worker(worker, now);
        // A drained worker holds no request; should the core disagree, the requests fail
        // (reported, never lost).
        for id in orphans {
            self.remove_in_flight(w as u32);
            self.admission.on_finished(id, now);
            self.fail(id.0, Outcome::Dropped);
        }
        self.retired.push((w as u32, now));
        self.drain_frontend();
    }

    /// Live workers of `pool` (`None`: an aggregated fleet's), ascending by id; draining
    /// ones are listed apart.
    pub fn pool_workers(&self, pool: Option<Pool>) -> (Vec<u32>, Vec<u32>) {
        let mut serving = Vec::new();
        let mut draining = Vec::new();
        for (i, p) in self.pools.iter().enumerate() {
            if *p != pool || self.dead[i] {
                continue;
            }
            if self.draining[i] {
                draining.push(i as u32);
            } else {
                serving.push(i as u32);
            }
        }
        (serving, draining)
    }

    /// Workers that left after draining, with the instant each left.
    pub fn retired(&self) -> &[(u32, Nanos)] {
        &self.retired
    }

    /// Observes every request's TTFT and ITL into the gateway's histograms, labelled by pool
    /// as the gateway labels them ([`PoolMetrics`]).
    pub fn with_pool_metrics(mut self) -> Self {
        self.pool_metrics = Some(PoolMetrics::default());
        self
    }

    /// The gateway's histograms, when on.
    pub fn pool_metrics(&self) -> Option<&PoolMetrics> {
        self.pool_metrics.as_ref()
    }

    /// Changes the workload now (a new mix or rate) and lets the loop see what it issues.
    pub fn update_workload(&mut self, change: impl FnOnce(&mut W, Nanos)) {
        change(&mut self.workload, self.now);
        self.pump();
    }

    /// Turns issued and not yet ended (routed or queued).
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// The run's counters so far.
    pub fn totals(&self) -> &RunTotals {
        &self.totals
    }

    fn start(&mut self, id: u64, decision: RouteDecision) {
        let now = self.now;
        let Some(f) = self.in_flight.get_mut(id) else {
            return;
        };
        let w = decision.worker.0 as u32;
        // A migrated request keeps the instant it was first routed.
        if f.migration.is_none() {
            f.routed_at = Some(now);
        }
        f.leg_sent_at = now;
        // A resend counts as a migration once a worker takes it, as in the gateway.
        if let Some(reason) = f.migrating.take()
            && let Some(faults) = &mut self.faults
        {
            faults.report.migrations.count(reason);
        }
        f.worker = Some(w);
        f.overlap_blocks = decision.overlap_blocks;
        f.available_blocks = decision.available_blocks;
        // After a migration the worker gets the prompt followed by the output so far, and
        // generates the rest.
        // Only the client's own prompt has the router's hashes (a migrated leg's is longer).
        let same_blocks = self
            .engines
            .get(w as usize)
            .map(|e| e.config().block_size as usize)
            == Some(self.admission.hasher().block_size());
        let prompt_hashes = f
            .prompt_hashes
            .take()
            .filter(|_| f.leg_prompt.is_none() && same_blocks);
        let (prompt, output) = match &f.leg_prompt {
            Some(prompt) => (
                Arc::clone(prompt),
                Arc::from(f.output.get(f.leg_offset as usize..).unwrap_or_default()),
            ),
            None => (Arc::clone(&f.prompt), Arc::clone(&f.output)),
        };
        let req = EngineRequest {
            id: RequestId(id),
            prompt,
            output: OutputSpec::Tokens(output),
            leg: Leg::ByRole,
        };
        self.add_in_flight(w);
        if let Some(f) = &mut self.faults {
            if self.dead.get(w as usize).copied().unwrap_or(true) || f.ejected(w) {
                f.violate(format!("request {id} was routed to worker {w}, known dead"));
            }
            if f.stopped(w) {
                // The stopped process reads it when it continues; the client waits for the
                // first-byte deadline.
                let deadline = now + self.cfg.failover.first_byte_timeout;
                f.schedule(deadline, FaultAction::Deadline(id, w));
                self.timers.arm(Source::Fault, f.next_action());
                if let Some(h) = &mut f.hang {
                    h.inbox.push(req);
                }
                return;
            }
        }
        let engine_now = now.saturating_sub(self.lag(w));
        match prompt_hashes {
            Some((local, seq)) => {
                self.engines[w as usize].submit_hashed(req, local, seq, engine_now);
            }
            None => self.engines[w as usize].submit(req, engine_now),
        }
        self.mark_dirty(w);
    }

    /// Accumulates worker `w`'s in-flight area up to now, before its count changes.
    fn integrate_in_flight(&mut self, w: u32) {
        if self.measuring.is_some() {
            let (area, last) = &mut self.in_flight_area[w as usize];
            *area +=
                u128::from(self.worker_in_flight[w as usize]) * u128::from((self.now - *last).0);
            *last = self.now;
        }
    }

    fn add_in_flight(&mut self, w: u32) {
        self.integrate_in_flight(w);
        let n = &mut self.worker_in_flight[w as usize];
        *n += 1;
        let n = *n;
        if self.measuring.is_some() {
            self.worker_stats_mut(w, |s| {
                s.routed += 1;
                s.peak_in_flight = s.peak_in_flight.max(n);
            });
        }
    }

    fn remove_in_flight(&mut self, w: u32) {
        self.integrate_in_flight(w);
        let n = &mut self.worker_in_flight[w as usize];
        *n = n.saturating_sub(1);
    }

    fn worker_stats_mut(&mut self, w: u32, f: impl FnOnce(&mut WorkerStats)) {
        if let Some(k) = self.measuring {
            if let Some(s) = self.worker_stats[k].get_mut(w as usize) {
                f(s);
            }
        }
    }

    fn on_engine_event(&mut self, worker: u32, ev: EngineEvent) {
        if self.faults.is_some() && !self.is_on(worker, &ev) {
            return;
        }
        if matches!(self.admission, Admission::Two(_)) {
            self.on_leg_event(worker, ev);
            return;
        }
        match ev {
            EngineEvent::FirstToken { id, at } => {
                if let Some(f) = self.in_flight.get_mut(id.0) {
                    f.leg_first_token = true;
                    // After a migration, the new worker's first token is not the request's.
                    if f.first_token_at.is_none() {
                        f.first_token_at = Some(at);
                        if let Some(recorder) = &mut self.timeline {
                            recorder.first_token(worker, at.saturating_sub(f.issued_at));
                        }
                        if let Some(m) = &mut self.pool_metrics {
                            m.observe_ttft(None, at.saturating_sub(f.arrived_at));
                        }
                    }
                }
                // The worker's own first token, for its load accounting.
                self.admission.on_first_token(id, at);
            }
            EngineEvent::Tokens { id, start, end, at } => self.on_tokens(id.0, start, end, at),
            EngineEvent::Finished {
                id,
                at,
                prompt_tokens,
                cached_prompt_tokens,
                output_tokens,
                preemptions,
            } => self.finish_turn(
                worker,
                id,
                at,
                Finished {
                    prompt_tokens,
                    cached_prompt_tokens,
                    output_tokens,
                    preemptions,
                },
            ),
            EngineEvent::Rejected { id, .. } => {
                self.admission.on_finished(id, self.now);
                self.remove_in_flight(worker);
                self.fail(id.0, Outcome::Rejected);
                self.after_release();
            }
            // Not produced by aggregated workers the simulator does not cancel; should one
            // appear, the turn ends as an error rather than hanging.
            EngineEvent::Cancelled { id, .. } | EngineEvent::PrefillDone { id, .. } => {
                self.admission.on_finished(id, self.now);
                self.remove_in_flight(worker);
                self.fail(id.0, Outcome::Rejected);
                self.after_release();
            }
            EngineEvent::Kv(ev) => self.on_kv_event(ev),
        }
    }

    /// A request's last token: admission, oracle, totals, its record and its conversation's
    /// next turn — the same for an aggregated request and a disaggregated one's decode leg
    /// (which also records its KV transfer and the prefill leg's cache hit).
    fn finish_turn(&mut self, worker: u32, id: RequestId, at: Nanos, done: Finished) {
        let Finished {
            prompt_tokens,
            cached_prompt_tokens,
            output_tokens,
            preemptions,
        } = done;
        let Some(f) = self.in_flight.remove(id.0) else {
            return;
        };
        // After a migration, the whole request's usage: the client's prompt and every
        // worker's tokens (the core's accounting, as the gateway's usage).
        let (prompt_tokens, cached_prompt_tokens, output_tokens) = match &f.migration {
            Some(m) => {
                let client_prompt = u32::try_from(f.prompt.len()).unwrap_or(u32::MAX);
                let whole = m.request_usage(
                    client_prompt,
                    TokenUsage {
                        prompt_tokens,
                        completion_tokens: output_tokens,
                        cached_tokens: Some(cached_prompt_tokens),
                    },
                );
                (
                    whole.prompt_tokens,
                    whole.cached_tokens.unwrap_or(0),
                    whole.completion_tokens,
                )
            }
            None => (prompt_tokens, cached_prompt_tokens, output_tokens),
        };
        if let Some(faults) = &mut self.faults {
            if let Err(what) = faults.checker.on_end(f.turn) {
                faults.violate(what);
            }
            // Served to the end: its next failure counts as the first again.
            faults.ejections.succeeded(WorkerId(u64::from(worker)), at);
        }
        self.admission.on_reply(id, output_tokens);
        self.admission.on_finished(id, at);
        self.remove_in_flight(worker);
        if let Some(o) = &mut self.oracle {
            o.finish(at, &f.prompt, f.prompt_last_block, &f.output);
        }
        self.totals.finished += 1;
        self.totals.finished_output_tokens += u64::from(output_tokens);
        // A split request's decode leg found `cached_prompt_tokens` on its decode
        // worker and received the rest; its compute hit is the prefill leg's.
        let kv_transfer = (f.route == Some(RouteTag::Split)).then(|| {
            let tokens = prompt_tokens.saturating_sub(cached_prompt_tokens);
            let profile = &self.cfg.engine.profile;
            let link = self.cfg.disagg.map(|d| d.kv_link).unwrap_or_default();
            KvTransfer {
                tokens,
                bytes: u64::from(tokens).saturating_mul(profile.kv_bytes_per_token),
                time: f
                    .kv_transfer_took
                    .unwrap_or_else(|| profile.kv_transfer_time(u64::from(tokens), link)),
            }
        });
        if let (Some(x), Some(t)) = (&kv_transfer, &mut self.totals.disagg) {
            t.kv_transfers += 1;
            t.kv_transfer_bytes += x.bytes;
        }
        let cached = f.prefill_cached.unwrap_or(cached_prompt_tokens);
        let record = RequestRecord {
            prompt_tokens,
            cached_prompt_tokens: cached,
            oracle_cached_tokens: f.oracle_cached.min(prompt_tokens),
            output_tokens,
            preemptions,
            kv_transfer,
            ..f.record(at, Outcome::Finished)
        };
        self.keep(record);
        self.workload.on_turn_finished(f.turn, at);
        self.after_release();
    }

    fn on_kv_event(&mut self, ev: KvEvent) {
        self.totals.kv_events += 1;
        if self.cfg.router.kv_source != KvSource::Events {
            return;
        }
        let delay = self.cfg.router.kv_event_delay;
        if let Some(f) = &mut self.faults {
            f.checker.on_engine_kv(&ev, self.now);
            f.mirrors
                .entry(ev.worker)
                .or_default()
                .apply(std::slice::from_ref(&ev));
            if let Some(channel) = &mut f.channel {
                channel.send(self.now, delay, ev, &mut f.report);
                self.timers.arm(Source::KvDelivery, channel.next_delivery());
                return;
            }
        }
        if delay == Nanos::ZERO {
            self.apply_kv(&ev);
        } else {
            let at = self.now + delay;
            if self.kv_queue.is_empty() {
                self.timers.arm(Source::KvDelivery, Some(at));
            }
            self.kv_queue.push_back((at, ev));
        }
    }

    /// An engine event of a disaggregated fleet (KV events excepted): the client's first
    /// token comes from whichever worker prefills; `PrefillDone` hands the request to its
    /// decode worker; a refused prefill leg is retried on the decode worker.
    fn on_leg_event(&mut self, worker: u32, ev: EngineEvent) {
        let now = self.now;
        match ev {
            EngineEvent::FirstToken { id, at } => {
                let Some(f) = self.in_flight.get_mut(id.0) else {
                    return;
                };
                if f.first_token_at.is_none() {
                    f.first_token_at = Some(at);
                    if let Some(recorder) = &mut self.timeline {
                        recorder.first_token(worker, at.saturating_sub(f.issued_at));
                    }
                    // The gateway's label: the prefill pool for a split request's first
                    // token, the serving (decode) worker's pool for a local one.
                    if let Some(m) = &mut self.pool_metrics {
                        let pool = if f.prefilling {
                            Pool::Prefill
                        } else {
                            Pool::Decode
                        };
                        m.observe_ttft(Some(pool), at.saturating_sub(f.arrived_at));
                    }
                }
                // A split request's decode worker hears of it at `PrefillDone`, next.
                if !f.prefilling
                    && let Some(d) = self.disagg_mut()
                {
                    d.on_first_token(id, at);
                }
            }
            EngineEvent::Tokens { id, start, end, at } => self.on_tokens(id.0, start, end, at),
            EngineEvent::PrefillDone {
                id,
                at,
                cached_prompt_tokens,
                ..
            } => {
                self.remove_in_flight(worker);
                let Some(f) = self.in_flight.get_mut(id.0) else {
                    return;
                };
                f.prefilling = false;
                f.prefill_cached = Some(cached_prompt_tokens);
                let decode = f.worker.unwrap_or(worker);
                let req = EngineRequest {
                    id,
                    prompt: Arc::clone(&f.prompt),
                    output: OutputSpec::Tokens(Arc::clone(&f.output)),
                    leg: Leg::Decode,
                };
                if let Some(d) = self.disagg_mut() {
                    d.on_prefill_done(id, at);
                }
                self.add_in_flight(decode);
                self.engines[decode as usize].submit(req, now);
                self.mark_dirty(decode);
                // The prefill slot it freed may route a waiter.
                self.after_release();
            }
            EngineEvent::Finished {
                id,
                at,
                prompt_tokens,
                cached_prompt_tokens,
                output_tokens,
                preemptions,
            } => self.finish_turn(
                worker,
                id,
                at,
                Finished {
                    prompt_tokens,
                    cached_prompt_tokens,
                    output_tokens,
                    preemptions,
                },
            ),
            EngineEvent::Rejected { id, .. } | EngineEvent::Cancelled { id, .. } => {
                let Some(f) = self.in_flight.get_mut(id.0) else {
                    return;
                };
                let prefill_leg = f.prefilling && f.prefill_worker == Some(worker);
                if prefill_leg {
                    f.prefilling = false;
                }
                self.remove_in_flight(worker);
                if prefill_leg {
                    // The prefill worker refused it: its decode worker prefills instead.
                    if let Some(t) = &mut self.totals.disagg {
                        t.prefill_failures += 1;
                    }
                    if let Some(d) = self.disagg_mut() {
                        d.on_prefill_failed(id, now);
                    }
                } else {
                    self.admission.on_finished(id, now);
                    self.fail(id.0, Outcome::Rejected);
                }
                self.after_release();
            }
            EngineEvent::Kv(ev) => self.on_kv_event(ev),
        }
    }

    /// Hands the slot a release freed (the frontend already chose who gets it) to its turn.
    fn after_release(&mut self) {
        self.drain_frontend();
    }

    fn on_tokens(&mut self, id: u64, start: u32, end: u32, at: Nanos) {
        let Some(f) = self.in_flight.get_mut(id) else {
            return;
        };
        // A migrated request's worker counts from the output so far: the gap since the
        // previous worker's last token (the stall included) is an inter-token gap.
        let (start, end) = (start + f.leg_offset, end + f.leg_offset);
        let count = end.saturating_sub(start);
        if let (Some(faults), Some(w), true) = (&mut self.faults, f.worker, count > 0) {
            faults.saw_output(w, at);
        }
        let prev = match f.last_token_at {
            Some(p) if start > 0 => p,
            _ => at,
        };
        f.last_token_at = Some(at);
        f.tokens = end;
        f.spans += 1;
        if let Some(m) = &mut self.pool_metrics {
            // As the gateway's relay: a first chunk's tokens came with no gap; a later
            // chunk's share the time since the previous one. Labelled by the decoding
            // worker's pool.
            let pool = f
                .worker
                .and_then(|w| self.pools.get(w as usize).copied().flatten());
            if start == 0 {
                m.observe_itl(pool, Nanos::ZERO, u64::from(count.saturating_sub(1)));
            } else if count > 0 {
                let gap = Nanos((at.saturating_sub(prev)).0 / u64::from(count));
                m.observe_itl(pool, gap, u64::from(count));
            }
        }
        self.totals.tokens_emitted += u64::from(count);
        for w in &mut self.windows {
            if prev < w.to && at > w.from {
                w.tokens += tokens_in_window(prev, at, count, w.from, w.to);
            }
        }
    }

    /// Ends a turn that did not finish: records it and tells the workload.
    fn fail(&mut self, id: u64, outcome: Outcome) {
        let Some(f) = self.in_flight.remove(id) else {
            return;
        };
        if let Some(links) = &mut self.links
            && links.cancel(id, self.now)
        {
            self.timers.arm(Source::KvLinks, links.poll_timeout());
        }
        if let Some(faults) = &mut self.faults {
            if let Err(what) = faults.checker.on_end(f.turn) {
                faults.violate(what);
            }
            faults.timeouts.remove(&id);
            match outcome {
                Outcome::WorkerFailed => faults.report.worker_failed_requests += 1,
                Outcome::WorkerTimeout => faults.report.timed_out_requests += 1,
                Outcome::GatewayFailed => faults.report.gateway_failed_requests += 1,
                _ => {}
            }
        }
        self.totals.failed += 1;
        let record = f.record(self.now, outcome);
        self.keep(record);
        self.workload.on_turn_failed(f.turn, self.now);
    }

    /// Counts an ended request in the windows it touches; keeps its record if asked to.
    fn keep(&mut self, record: RequestRecord) {
        for w in &mut self.windows {
            if w.touches(&record) {
                w.add(&record);
            }
        }
        if self.cfg.keep_all_records {
            self.records.push(record);
        }
    }
}

/// A failure's outcome when the request does not migrate.
fn failure_outcome(reason: FailureReason) -> Outcome {
    match reason {
        FailureReason::WorkerFailed => Outcome::WorkerFailed,
        FailureReason::WorkerTimeout => Outcome::WorkerTimeout,
    }
}

/// Engine `id` of the fleet: its seed derived from the run's, its role from its pool.
fn new_engine(cfg: &SimConfig, id: u32, pool: Option<Pool>) -> Result<Engine, ConfigError> {
    let mut ec = cfg.engine.clone();
    ec.seed = derive_seed(cfg.seed, streams::ENGINE + u64::from(id));
    match pool {
        None => {}
        Some(Pool::Prefill) => ec.role = Role::PrefillOnly,
        Some(Pool::Decode) => {
            ec.role = Role::DecodeOnly;
            ec.kv_link = cfg.disagg.map(|d| d.kv_link).unwrap_or_default();
            ec.external_kv_transfers = cfg.disagg.is_some_and(|d| d.shared_links);
        }
    }
    Engine::new(ec, WorkerId(u64::from(id))).map_err(ConfigError::from)
}

/// The fleet's KV links: one port per worker, each of the link's bandwidth in the profile.
fn shared_links(profile: &engine::HardwareProfile, link: KvLink) -> LinkShare {
    let t = &profile.kv_transfer;
    let bytes_per_sec = match link {
        KvLink::Nvlink => t.nvlink_bytes_per_sec,
        KvLink::Network => t.network_bytes_per_sec,
    };
    LinkShare::new(bytes_per_sec, Nanos(t.latency_ns), MAX_LINK_TRANSFERS)
}

/// The gateway's frontend histograms in virtual time: TTFT and ITL by pool, in the
/// gateway's own buckets (`router::autoscale`), observed as its relay observes them — TTFT
/// from the request's arrival at the frontend to its first token, labelled by the pool
/// that prefilled (a split request: `prefill`; a local one: its worker's); ITL per token,
/// labelled by the decoding worker's pool. What a KEDA trigger on the gateway would read.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolMetrics {
    /// Aggregated, prefill, decode.
    ttft: [BucketCounts; 3],
    itl: [BucketCounts; 3],
}

impl Default for PoolMetrics {
    fn default() -> Self {
        Self {
            ttft: std::array::from_fn(|_| BucketCounts::new(FRONTEND_TTFT_BUCKETS)),
            itl: std::array::from_fn(|_| BucketCounts::new(FRONTEND_ITL_BUCKETS)),
        }
    }
}

impl PoolMetrics {
    fn slot(pool: Option<Pool>) -> usize {
        match pool {
            None => 0,
            Some(Pool::Prefill) => 1,
            Some(Pool::Decode) => 2,
        }
    }

    fn observe_ttft(&mut self, pool: Option<Pool>, ttft: Nanos) {
        self.ttft[Self::slot(pool)].observe(ttft.as_secs_f64());
    }

    fn observe_itl(&mut self, pool: Option<Pool>, gap: Nanos, tokens: u64) {
        self.itl[Self::slot(pool)].observe_n(gap.as_secs_f64(), tokens);
    }

    /// `dynamo_frontend_time_to_first_token_seconds{pool}`'s counts.
    pub fn ttft(&self, pool: Option<Pool>) -> &BucketCounts {
        &self.ttft[Self::slot(pool)]
    }

    /// `dynamo_frontend_inter_token_latency_seconds{pool}`'s counts.
    pub fn itl(&self, pool: Option<Pool>) -> &BucketCounts {
        &self.itl[Self::slot(pool)]
    }
}
