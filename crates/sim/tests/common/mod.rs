//! Test workloads: small, deterministic, hand-checkable.
#![allow(dead_code)]

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use engine::{DynamoMockerTiming, EngineConfig, HardwareProfile, TimingModel};
use nanotime::Nanos;
use router::PolicyKind;
use sim::bench::{BenchSpec, JobResult};
use sim::chat::run_chat_job;
use sim::{PhaseResult, SimConfig, Turn, TurnKey, Workload};
use workload::{Assets, WorkloadConfig};

/// SplitMix64: a tiny seeded generator, enough for test traffic.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }

    pub fn tokens(&mut self, n: usize) -> Vec<u32> {
        (0..n).map(|_| (self.next() % 128_000) as u32).collect()
    }
}

/// A small version of the seed's chat: shared starter passages, 3–5 turns that resend the
/// whole history plus a new question, unique answers, constant concurrency.
pub struct TestChat {
    starters: Vec<Vec<u32>>,
    concurrency: u32,
    active: BTreeMap<u64, Conv>,
    ready: VecDeque<Turn>,
    /// Think timers: (due, conversation).
    thinking: BTreeMap<(Nanos, u64), ()>,
    rng: Rng,
    next_conversation: u64,
    pub output_tokens: (u64, u64),
    pub question_tokens: (u64, u64),
    pub think: Nanos,
    pub finished_turns: u64,
    pub failed_turns: u64,
}

struct Conv {
    history: Vec<u32>,
    turn: u32,
    turns: u32,
}

impl TestChat {
    pub fn new(starters: usize, starter_tokens: usize, concurrency: u32, seed: u64) -> Self {
        let mut rng = Rng::new(seed);
        let starters = (0..starters).map(|_| rng.tokens(starter_tokens)).collect();
        let mut w = Self {
            starters,
            concurrency: 0,
            active: BTreeMap::new(),
            ready: VecDeque::new(),
            thinking: BTreeMap::new(),
            rng,
            next_conversation: 0,
            output_tokens: (150, 350),
            question_tokens: (30, 80),
            think: Nanos::ZERO,
            finished_turns: 0,
            failed_turns: 0,
        };
        w.set_concurrency(concurrency, Nanos::ZERO);
        w
    }

    fn start(&mut self, now: Nanos) {
        let id = self.next_conversation;
        self.next_conversation += 1;
        let s = self.rng.range(0, self.starters.len() as u64 - 1) as usize;
        let turns = self.rng.range(3, 5) as u32;
        let conv = Conv {
            history: self.starters[s].clone(),
            turn: 0,
            turns,
        };
        self.active.insert(id, conv);
        self.issue(id, now);
    }

    fn issue(&mut self, id: u64, now: Nanos) {
        let q = self
            .rng
            .range(self.question_tokens.0, self.question_tokens.1) as usize;
        let question = self.rng.tokens(q);
        let n_out = self.rng.range(self.output_tokens.0, self.output_tokens.1) as usize;
        let output = self.rng.tokens(n_out);
        let Some(c) = self.active.get_mut(&id) else {
            return;
        };
        c.history.extend_from_slice(&question);
        let prompt: Arc<[u32]> = c.history.clone().into();
        c.history.extend_from_slice(&output);
        self.ready.push_back(Turn {
            key: TurnKey {
                conversation: id,
                turn: c.turn,
            },
            prompt,
            output: output.into(),
            issued_at: now,
        });
    }

    fn refill(&mut self, now: Nanos) {
        while (self.active.len() as u32) < self.concurrency {
            self.start(now);
        }
    }
}

impl Workload for TestChat {
    fn poll_timeout(&self) -> Option<Nanos> {
        self.thinking.keys().next().map(|k| k.0)
    }

    fn handle_timeout(&mut self, now: Nanos) {
        while let Some((&(due, id), _)) = self.thinking.iter().next() {
            if due > now {
                break;
            }
            self.thinking.remove(&(due, id));
            self.issue(id, now);
        }
    }

    fn poll_request(&mut self) -> Option<Turn> {
        self.ready.pop_front()
    }

    fn on_turn_finished(&mut self, key: TurnKey, now: Nanos) {
        self.finished_turns += 1;
        let Some(c) = self.active.get_mut(&key.conversation) else {
            return;
        };
        c.turn += 1;
        if c.turn >= c.turns {
            self.active.remove(&key.conversation);
            self.refill(now);
        } else if self.think == Nanos::ZERO {
            self.issue(key.conversation, now);
        } else {
            self.thinking
                .insert((now + self.think, key.conversation), ());
        }
    }

    fn on_turn_failed(&mut self, key: TurnKey, now: Nanos) {
        self.failed_turns += 1;
        self.active.remove(&key.conversation);
        self.refill(now);
    }

    fn set_concurrency(&mut self, n: u32, now: Nanos) {
        self.concurrency = n;
        self.refill(now);
    }

    fn active_conversations(&self) -> u32 {
        self.active.len() as u32
    }
}

/// Turns given up front, each issued at its time; nothing follows a finish.
pub struct Script {
    pending: VecDeque<Turn>,
    ready: VecDeque<Turn>,
    pub finished: Vec<(TurnKey, Nanos)>,
    pub failed: Vec<(TurnKey, Nanos)>,
}

impl Script {
    pub fn new(mut turns: Vec<Turn>) -> Self {
        turns.sort_by_key(|t| t.issued_at);
        Self {
            pending: turns.into(),
            ready: VecDeque::new(),
            finished: Vec::new(),
            failed: Vec::new(),
        }
    }
}

impl Workload for Script {
    fn poll_timeout(&self) -> Option<Nanos> {
        self.pending.front().map(|t| t.issued_at)
    }

    fn handle_timeout(&mut self, now: Nanos) {
        while self.pending.front().is_some_and(|t| t.issued_at <= now) {
            self.ready.extend(self.pending.pop_front());
        }
    }

    fn poll_request(&mut self) -> Option<Turn> {
        self.ready.pop_front()
    }

    fn on_turn_finished(&mut self, key: TurnKey, now: Nanos) {
        self.finished.push((key, now));
    }

    fn on_turn_failed(&mut self, key: TurnKey, now: Nanos) {
        self.failed.push((key, now));
    }

    fn set_concurrency(&mut self, _: u32, _: Nanos) {}

    fn active_conversations(&self) -> u32 {
        (self.pending.len() + self.ready.len()) as u32
    }
}

/// An engine whose steps take fixed times: any prefill step `prefill_ms`, any decode-only
/// step `decode_ms` (the Dynamo mocker's polynomials with only constant terms), block size
/// 32, a large pool, seed 002's batch limits.
pub fn fixed_step_engine(prefill_ms: f64, decode_ms: f64) -> EngineConfig {
    let mut profile = HardwareProfile::dynamo_mocker();
    profile.name = "fixed-steps".into();
    profile.timing = TimingModel::DynamoMocker(DynamoMockerTiming {
        prefill_ms_coefficients: [0.0, 0.0, prefill_ms],
        decode_ms_coefficients: [0.0, 0.0, decode_ms],
        min_decode_ms: 0.0,
    });
    let mut cfg = EngineConfig::new(profile);
    cfg.block_size = 32;
    cfg.num_gpu_blocks_override = Some(100_000);
    cfg
}

/// The workers of [`small_pool_config`].
pub const WORKERS: u32 = 3;

/// [`WORKERS`] seed 002 workers with a small pool (1,500 blocks), so that eviction, and therefore
/// routing, matters; every request's record kept.
pub fn small_pool_config(policy: PolicyKind, seed: u64) -> SimConfig {
    let mut cfg = SimConfig::new(WORKERS, HardwareProfile::h200_llama70b_fp8(), policy);
    cfg.engine.num_gpu_blocks_override = Some(1_500);
    cfg.seed = seed;
    cfg.keep_all_records = true;
    cfg
}

/// In every phase, KV routing's hit rate beats round robin's by more than `margin`; `run`
/// names the runs in the message.
pub fn assert_kv_hits_more(rr: &[PhaseResult], kv: &[PhaseResult], margin: f64, run: &str) {
    for (a, b) in rr.iter().zip(kv) {
        let (h_rr, h_kv) = (
            a.metrics.kv_hit_rate.unwrap(),
            b.metrics.kv_hit_rate.unwrap(),
        );
        assert!(
            h_kv > h_rr + margin,
            "{run}, concurrency {}: kv {h_kv:.3} vs rr {h_rr:.3}",
            a.concurrency
        );
    }
}

/// Every job of `spec` run as `kvroute bench` runs them (the default chat workload, the
/// built-in assets), in order.
pub fn run_jobs(spec: &BenchSpec) -> Vec<JobResult> {
    let assets = Assets::builtin().expect("the built-in assets");
    spec.jobs()
        .iter()
        .map(|job| {
            run_chat_job(
                spec,
                job,
                &WorkloadConfig::default(),
                Arc::clone(&assets),
                |_| {},
            )
            .expect("a bench job runs")
        })
        .collect()
}
