//! Public trace replay as the simulator's [`Workload`]: Mooncake's FAST'25 format
//! (`workload::Trace`), open loop at the recorded times scaled by a speed factor.
//!
//! The schedule (which request is due when, sessions' `delay` after the previous end) is the
//! workload crate's [`TraceReplay`], which the load generator drives in real time too. Each
//! request is one single-turn request: its prompt is [`PromptSynth`]'s tokens (equal hash ids
//! ⇒ equal 512-token blocks, which engine blocks of 16, 32 or 64 tokens tile exactly), its
//! reply `output_length` tokens. A failed request is counted, never retried. Prompts are
//! synthesized when a request is issued, so only requests in flight hold tokens.
//!
//! [`run_trace_job`] runs one trace replay as a benchmark job (what `kvroute sim --trace` and
//! a bench cell at 1×, 2× or 4× speed call); [`replay_span`] is the virtual time a replay
//! needs. [`slo_ceiling`] is what no router can beat: each request served alone, with every
//! block of the requests before it cached.

use std::sync::Arc;

use nanotime::Nanos;
pub use workload::replay::{ReplayStats, TraceReplay};
use workload::{PromptSynth, Speed, Trace};

use crate::bench::{BenchJob, BenchSpec, JobResult, run_job};
use crate::config::{Phase, ReplicaSetup, SimConfig};
use crate::driver::{SimError, Simulation};
use crate::workload::{ServingPath, Turn, TurnKey, Workload};

/// Virtual time after the last arrival that a default replay keeps running, so that the
/// requests sent last can finish and be measured.
pub const DRAIN: Nanos = Nanos::from_secs(60);

/// A trace replayed open loop (see the module docs).
#[derive(Debug)]
pub struct TraceWorkload {
    replay: TraceReplay,
    synth: PromptSynth,
}

impl TraceWorkload {
    /// Replays `trace` at `speed`, with prompts from `synth`, from time zero.
    pub fn new(trace: Arc<Trace>, speed: Speed, synth: PromptSynth) -> Self {
        TraceWorkload {
            replay: TraceReplay::new(trace, speed),
            synth,
        }
    }

    pub fn trace(&self) -> &Trace {
        self.replay.trace()
    }

    pub fn speed(&self) -> Speed {
        self.replay.speed()
    }

    pub fn stats(&self) -> ReplayStats {
        self.replay.stats()
    }
}

impl Workload for TraceWorkload {
    fn poll_timeout(&self) -> Option<Nanos> {
        self.replay.poll_timeout()
    }

    fn handle_timeout(&mut self, now: Nanos) {
        self.replay.handle_timeout(now);
    }

    fn poll_request(&mut self) -> Option<Turn> {
        let due = self.replay.poll_request()?;
        let record = &self.replay.trace().records()[due.record];
        Some(Turn {
            key: TurnKey {
                conversation: due.record as u64,
                turn: due.turn,
            },
            prompt: Arc::from(self.synth.prompt_tokens(record)),
            output: Arc::from(self.synth.reply_tokens(record)),
            issued_at: due.at,
        })
    }

    fn on_turn_finished(&mut self, key: TurnKey, now: Nanos) {
        self.replay.on_finished(key.conversation as usize, now);
    }

    fn on_turn_failed(&mut self, key: TurnKey, now: Nanos) {
        self.replay.on_failed(key.conversation as usize, now);
    }

    /// A trace sets its own load: concurrency levels do not apply.
    fn set_concurrency(&mut self, _: u32, now: Nanos) {
        self.replay.handle_timeout(now);
    }

    /// Requests issued and not yet ended.
    fn active_conversations(&self) -> u32 {
        u32::try_from(self.replay.stats().open()).unwrap_or(u32::MAX)
    }
}

/// The virtual time a replay of `trace` at `speed` needs: the last arrival, plus [`DRAIN`]
/// for the last requests to finish.
pub fn replay_span(trace: &Trace, speed: Speed) -> Nanos {
    speed.scale(trace.duration()) + DRAIN
}

/// Runs one trace replay as a benchmark job: `spec`'s fleet, `job`'s router and seed, over
/// `spec`'s phases (a whole replay: one phase, warmup zero, window [`replay_span`]). The
/// requests reach the router over `spec.base.path_latency`, as the chat's do; `progress(k)`
/// after each phase. The run's totals count the requests issued, finished and failed.
pub fn run_trace_job(
    spec: &BenchSpec,
    job: &BenchJob,
    trace: Arc<Trace>,
    speed: Speed,
    progress: impl FnMut(usize),
) -> Result<JobResult, SimError> {
    let workload = TraceWorkload::new(trace, speed, PromptSynth::default());
    let workload = ServingPath::new(workload, spec.base.path_latency);
    run_job(spec, job, workload, progress)
}

/// How many of a trace's requests can meet the objectives at all on a profile: each served
/// alone, in trace order, on an idle worker whose cache holds every block of the requests
/// before it (the oracle's infinite shared cache), behind the same serving path. A replay
/// sends the requests in that order (those at one instant too), so no router, fleet size or
/// load gives a request a larger cached prefix or an emptier batch: a request that misses an
/// objective here by more than [`CHUNKING_SLACK`] misses it in every run, and
/// `within / window` bounds the goodput of every run of the trace
/// ([`SloCeiling::goodput_rps`]). Not for a trace with sessions: a session's request goes
/// out when its previous one ends, which may be after requests later in the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SloCeiling {
    pub requests: u64,
    /// Requests within both objectives alone, the TTFT objective widened by
    /// [`CHUNKING_SLACK`]: at least every request any run gets within them.
    pub within: u64,
    /// Requests whose TTFT misses even so.
    pub ttft_misses: u64,
    /// Requests whose mean ITL misses its objective even so.
    pub itl_misses: u64,
    /// The prefill time the requests need alone, from reaching the worker to their first
    /// token: the least GPU time any fleet spends prefilling the trace.
    pub prefill: Nanos,
}

/// How much faster than alone a request's prefill can be in some run, from how its prompt is
/// cut into chunks. Alone, an engine prefills in full chunks first; sharing steps with other
/// requests can cut it otherwise. On `dynamo-mocker` (step time quadratic in a step's prefill
/// tokens) an even cut of a prompt near a 600 ms objective (at most 3 chunks of 8,192) saves
/// at most 19 ms; on the H200 roofline a short last chunk that rides in another step saves at
/// most one weight read (16 ms). A request alone within the TTFT objective plus this slack
/// counts as one that might be within it.
pub const CHUNKING_SLACK: Nanos = Nanos::from_millis(30);

impl SloCeiling {
    /// The goodput no run can exceed when it measures the whole trace over `window`.
    pub fn goodput_rps(&self, window: Nanos) -> f64 {
        self.within as f64 / window.as_secs_f64().max(f64::MIN_POSITIVE)
    }

    /// The least prefill time over the GPU time of `workers` while the requests arrive
    /// (`arrivals`): above 1, no fleet that size keeps up with the trace, even caching as the
    /// oracle does.
    pub fn prefill_load(&self, workers: u32, arrivals: Nanos) -> f64 {
        self.prefill.as_secs_f64()
            / (f64::from(workers.max(1)) * arrivals.as_secs_f64()).max(f64::MIN_POSITIVE)
    }
}

/// Computes [`SloCeiling`] for `trace` on `cfg`'s profile, engine settings and serving path
/// against `slo`. One simulated worker with room for every block of the trace, so nothing is
/// evicted; the rest of `cfg` (fleet, router, faults) does not apply.
pub fn slo_ceiling(
    cfg: &SimConfig,
    trace: Arc<Trace>,
    slo: report::Slo,
) -> Result<SloCeiling, SimError> {
    let mut cfg = cfg.clone();
    cfg.workers = 1;
    cfg.max_workers = None;
    cfg.disagg = None;
    cfg.replicas = ReplicaSetup::default();
    cfg.oracle = false;
    cfg.keep_all_records = true;
    cfg.slo = Some(slo);
    // One worker takes every request: the router needs no view of its cache, and an index of
    // the whole trace's blocks would double the run's memory.
    cfg.router.kv_source = router::KvSource::Approximate { ttl: Nanos(1) };
    let block = u64::from(cfg.engine.block_size.max(1));
    let tokens = trace.total_input_tokens() + trace.total_output_tokens();
    // Every token's block, plus a partial block per request: an upper bound on what the
    // trace ever holds.
    let blocks = tokens / block + 2 * trace.len() as u64;
    cfg.engine.num_gpu_blocks_override = Some(u32::try_from(blocks).unwrap_or(u32::MAX));
    let requests = trace.len() as u64;
    let workload = ServingPath::new(OneAtATime::new(trace), cfg.path_latency);
    // One phase that outlasts the trace: the run ends when its last request has.
    let phases = vec![Phase {
        concurrency: 1,
        warmup: Nanos::ZERO,
        window: Nanos::from_secs(u64::from(u32::MAX)),
        snapshots: 1,
        lookback: None,
    }];
    let out = Simulation::new(cfg, workload, phases)?.run(|_| {})?;
    let mut ceiling = SloCeiling {
        requests,
        within: 0,
        ttft_misses: 0,
        itl_misses: 0,
        prefill: Nanos::ZERO,
    };
    let widened = report::Slo {
        ttft_ms: slo.ttft_ms + CHUNKING_SLACK.as_millis_f64(),
        ..slo
    };
    for r in &out.records {
        let ttft_ok = r
            .ttft()
            .is_some_and(|t| t.as_millis_f64() <= widened.ttft_ms);
        let itl_ok = r.itl_secs().is_none_or(|s| s * 1e3 <= slo.itl_ms);
        ceiling.ttft_misses += u64::from(!ttft_ok);
        ceiling.itl_misses += u64::from(!itl_ok);
        ceiling.within += u64::from(r.meets(&widened));
        if let (Some(routed), Some(first)) = (r.routed_at, r.first_token_at) {
            ceiling.prefill += first.saturating_sub(routed);
        }
    }
    Ok(ceiling)
}

/// A trace's requests one at a time, in order: the next is issued the instant the previous
/// ends, so each runs alone.
#[derive(Debug)]
struct OneAtATime {
    trace: Arc<Trace>,
    synth: PromptSynth,
    next: usize,
    /// When the next request may be issued (`None` while one is in flight).
    ready_at: Option<Nanos>,
}

impl OneAtATime {
    fn new(trace: Arc<Trace>) -> Self {
        Self {
            trace,
            synth: PromptSynth::default(),
            next: 0,
            ready_at: Some(Nanos::ZERO),
        }
    }
}

impl Workload for OneAtATime {
    fn poll_timeout(&self) -> Option<Nanos> {
        None
    }

    fn handle_timeout(&mut self, _now: Nanos) {}

    fn poll_request(&mut self) -> Option<Turn> {
        let record = self.trace.records().get(self.next)?;
        let at = self.ready_at.take()?;
        let turn = Turn {
            key: TurnKey {
                conversation: self.next as u64,
                turn: 0,
            },
            prompt: Arc::from(self.synth.prompt_tokens(record)),
            output: Arc::from(self.synth.reply_tokens(record)),
            issued_at: at,
        };
        self.next += 1;
        Some(turn)
    }

    fn on_turn_finished(&mut self, _key: TurnKey, now: Nanos) {
        self.ready_at = Some(now);
    }

    fn on_turn_failed(&mut self, _key: TurnKey, now: Nanos) {
        self.ready_at = Some(now);
    }

    fn set_concurrency(&mut self, _n: u32, _now: Nanos) {}

    fn active_conversations(&self) -> u32 {
        u32::from(self.ready_at.is_none())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(lines: &[&str]) -> Arc<Trace> {
        Arc::new(Trace::parse(&lines.join("\n")).unwrap())
    }

    fn drain(w: &mut TraceWorkload) -> Vec<(u64, Nanos)> {
        std::iter::from_fn(|| w.poll_request())
            .map(|t| (t.key.conversation, t.issued_at))
            .collect()
    }

    #[test]
    fn open_loop_arrivals_at_the_scaled_timestamps() {
        let trace = parse(&[
            r#"{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}"#,
            r#"{"timestamp": 0, "input_length": 700, "output_length": 4, "hash_ids": [1, 3]}"#,
            r#"{"timestamp": 1000, "input_length": 10, "output_length": 5, "hash_ids": [9]}"#,
        ]);
        let mut w = TraceWorkload::new(trace, Speed::new(2.0).unwrap(), PromptSynth::default());
        let first = w.poll_request().unwrap();
        assert_eq!((first.prompt.len(), first.output.len()), (600, 3));
        let second = w.poll_request().unwrap();
        assert_eq!(first.prompt[..512], second.prompt[..512]);
        assert_ne!(first.prompt[512..], second.prompt[512..600]);
        assert!(w.poll_request().is_none());
        assert_eq!(w.poll_timeout(), Some(Nanos::from_millis(500)));
        // Nothing waits on a finish in the open loop.
        w.on_turn_failed(first.key, Nanos::from_millis(100));
        assert!(w.poll_request().is_none());
        w.handle_timeout(Nanos::from_millis(500));
        assert_eq!(drain(&mut w), [(2, Nanos::from_millis(500))]);
        assert_eq!(w.poll_timeout(), None);
        assert_eq!(w.active_conversations(), 2);
        let s = w.stats();
        assert_eq!((s.requests, s.issued, s.finished, s.failed), (3, 3, 0, 1));
    }

    #[test]
    fn a_sessions_next_request_follows_the_previous_end_by_its_delay() {
        let trace = parse(&[
            r#"{"timestamp": 0, "input_length": 9, "output_length": 1, "hash_ids": [], "session_id": "a"}"#,
            r#"{"timestamp": 5, "input_length": 9, "output_length": 1, "hash_ids": [], "session_id": "a", "delay": 2000}"#,
            r#"{"timestamp": 10, "input_length": 9, "output_length": 1, "hash_ids": []}"#,
            r#"{"timestamp": 20, "input_length": 9, "output_length": 1, "hash_ids": [], "session_id": "a", "delay": 100}"#,
        ]);
        let mut w = TraceWorkload::new(trace, Speed::REAL_TIME, PromptSynth::default());
        let a0 = w.poll_request().unwrap();
        assert_eq!(
            a0.key,
            TurnKey {
                conversation: 0,
                turn: 0
            }
        );
        // Record 1 waits for record 0; record 2 arrives at its own time.
        assert_eq!(w.poll_timeout(), Some(Nanos::from_millis(10)));
        w.handle_timeout(Nanos::from_millis(10));
        assert_eq!(drain(&mut w), [(2, Nanos::from_millis(10))]);
        assert_eq!(w.poll_timeout(), None, "record 3 follows record 1");
        w.on_turn_finished(a0.key, Nanos::from_secs(1));
        assert_eq!(w.poll_timeout(), Some(Nanos::from_secs(3)));
        w.handle_timeout(Nanos::from_secs(3));
        let a1 = w.poll_request().unwrap();
        assert_eq!(
            a1.key,
            TurnKey {
                conversation: 1,
                turn: 1
            }
        );
        // A failure releases the session's next request too (counted, not retried).
        w.on_turn_failed(a1.key, Nanos::from_secs(4));
        w.handle_timeout(Nanos::from_millis(4_100));
        let a2 = w.poll_request().unwrap();
        assert_eq!((a2.key.conversation, a2.key.turn), (3, 2));
        assert_eq!(a2.issued_at, Nanos::from_millis(4_100));
        assert_eq!(w.poll_timeout(), None);
    }

    /// Four requests at once: a short one, one extending it, one whose 8k-token prompt takes
    /// longer than the TTFT objective to prefill on an H200, and one extending that.
    fn ceiling_trace() -> Arc<Trace> {
        let ids = |r: std::ops::Range<u32>| r.map(|i| i.to_string()).collect::<Vec<_>>().join(", ");
        let line = |input: u32, hash_ids: String| {
            format!(
                r#"{{"timestamp": 0, "input_length": {input}, "output_length": 10, "hash_ids": [{hash_ids}]}}"#
            )
        };
        let lines = [
            line(1024, ids(1..3)),
            line(1536, ids(1..4)),
            line(8192, ids(10..26)),
            line(8704, ids(10..27)),
        ];
        Arc::new(Trace::parse(&lines.join("\n")).unwrap())
    }

    fn h200(workers: u32) -> SimConfig {
        let mut cfg = SimConfig::new(
            workers,
            engine::HardwareProfile::h200_llama70b_fp8(),
            router::PolicyKind::KvLoad,
        );
        cfg.path_latency = Nanos::from_millis(200);
        cfg
    }

    const SLO: report::Slo = report::Slo {
        ttft_ms: 600.0,
        itl_ms: 60.0,
    };

    #[test]
    fn the_slo_ceiling_serves_each_request_alone_on_a_warm_cache_and_no_run_beats_it() {
        let trace = ceiling_trace();
        let ceiling = slo_ceiling(&h200(3), Arc::clone(&trace), SLO).unwrap();
        // Alone, the long prompt's prefill misses 600 ms; its extension finds it cached.
        assert_eq!(
            ceiling,
            SloCeiling {
                requests: 4,
                within: 3,
                ttft_misses: 1,
                itl_misses: 0,
                prefill: ceiling.prefill,
            }
        );
        // The long prompt alone takes about 1.2 s to prefill at 7,100 tokens/s; the others
        // a fraction of that.
        let prefill = ceiling.prefill.as_secs_f64();
        assert!((1.3..2.0).contains(&prefill), "{prefill}");
        assert!((ceiling.prefill_load(2, Nanos::from_secs(1)) - prefill / 2.0).abs() < 1e-12);
        assert!((ceiling.goodput_rps(Nanos::from_secs(2)) - 1.5).abs() < 1e-12);
        // Sent together, as the trace has them, the extension cannot reuse a prefix still
        // being computed: no fleet does better than the ceiling.
        for workers in [1, 2] {
            let mut cfg = h200(workers);
            cfg.keep_all_records = true;
            cfg.slo = Some(SLO);
            let workload = ServingPath::new(
                TraceWorkload::new(Arc::clone(&trace), Speed::REAL_TIME, PromptSynth::default()),
                cfg.path_latency,
            );
            let phase = Phase {
                concurrency: 1,
                warmup: Nanos::ZERO,
                window: Nanos::from_secs(60),
                snapshots: 1,
                lookback: None,
            };
            let out = Simulation::new(cfg, workload, vec![phase])
                .unwrap()
                .run(|_| {})
                .unwrap();
            assert_eq!(out.records.len(), 4);
            let within = out.records.iter().filter(|r| r.meets(&SLO)).count() as u64;
            assert!(within <= ceiling.within, "{workers} workers: {within}");
        }
    }
}
