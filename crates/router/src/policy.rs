//! Routing policies: given each worker's cache overlap and load, pick one.
//!
//! A policy sees a [`SelectionContext`] — one [`Candidate`] per routable worker, in a stable
//! order — and returns the index of the chosen candidate. Policies own no accounting: the
//! [`Router`](crate::Router) computes overlaps and loads and applies the decision, so a new
//! policy (for example a load-aware one) plugs in by implementing [`RoutingPolicy`] alone.

use std::fmt;
use std::str::FromStr;

use kv_index::WorkerId;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::load::WorkerLoad;

/// What a policy knows about one worker for one request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    pub worker: WorkerId,
    /// Leading blocks of the request already cached on this worker.
    pub overlap_blocks: u32,
    /// Tokens of the request this worker would have to prefill (prompt minus cached prefix).
    pub new_prefill_tokens: u64,
    /// The worker's active blocks if the request were sent there: its current active blocks
    /// plus the request's blocks it does not already hold in an active sequence.
    pub potential_active_blocks: u64,
    /// The worker's load before this request, as the router accounts it.
    pub load: WorkerLoad,
    /// What the worker declared about itself (batch limit, KV capacity), when known.
    pub limits: WorkerLimits,
}

/// What a worker declares about itself (batch limit, KV capacity, timing): one type from the
/// engine through the wire to the router, defined in the `worker-limits` leaf crate.
pub use worker_limits::{WorkerLimits, WorkerTiming};

/// Everything a policy may look at to decide.
#[derive(Debug)]
pub struct SelectionContext<'a> {
    /// Tokens in the request's prompt.
    pub prompt_tokens: u64,
    /// Full blocks in the request's prompt.
    pub prompt_blocks: u32,
    /// Tokens per KV block.
    pub block_size: u32,
    /// One entry per routable worker, ascending by worker id; never empty.
    pub candidates: &'a [Candidate],
}

/// The router's seeded source of randomness, as policies see it: the generator behind it is
/// the router's business (a policy written against these methods keeps working if it changes),
/// and the same seed gives the same draws.
#[derive(Debug, Clone)]
pub struct PolicyRng(ChaCha8Rng);

impl PolicyRng {
    pub fn seed_from_u64(seed: u64) -> Self {
        Self(ChaCha8Rng::seed_from_u64(seed))
    }

    /// A uniform index in `0..n`; `n` must be at least 1.
    pub fn index_below(&mut self, n: usize) -> usize {
        self.0.random_range(0..n)
    }

    /// A uniform number in `[0, 1)`.
    pub fn unit_f64(&mut self) -> f64 {
        self.0.random::<f64>()
    }
}

/// A routing policy. Implementations must be deterministic given the RNG they are handed.
pub trait RoutingPolicy: Send + fmt::Debug {
    /// The policy's name as `--router-mode` spells it.
    fn name(&self) -> &'static str;

    /// Index into `ctx.candidates` of the chosen worker. `ctx.candidates` is never empty;
    /// returning an out-of-range index is a bug the router reports as an error.
    fn select(&mut self, ctx: &SelectionContext<'_>, rng: &mut PolicyRng) -> usize;

    /// A request completed with a reply of `output_tokens` tokens: policies that price decode
    /// learn how long replies are, the others ignore it. No default, so a policy that wraps
    /// another cannot forget to pass it on.
    fn observe_reply(&mut self, output_tokens: u32);
}

/// The built-in policies, by the names `--router-mode` accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PolicyKind {
    RoundRobin,
    Random,
    /// Dynamo's KV cost ([`KvCost`]).
    Kv,
    /// kvroute's load-aware KV policy ([`KvLoad`](crate::KvLoad)).
    KvLoad,
    /// SGLang's `cache_aware`, from its documentation ([`SglangCacheAware`](crate::peers::SglangCacheAware)).
    SglangCacheAware,
    /// llm-d's default scorer stack, from its documentation ([`LlmdScorers`](crate::peers::LlmdScorers)).
    LlmdDefault,
    /// Dynamo's proposed `lmetric` selection, from its public proposal ([`Lmetric`](crate::peers::Lmetric)).
    Lmetric,
}

impl PolicyKind {
    pub const ALL: [PolicyKind; 7] = [
        PolicyKind::RoundRobin,
        PolicyKind::Random,
        PolicyKind::Kv,
        PolicyKind::KvLoad,
        PolicyKind::SglangCacheAware,
        PolicyKind::LlmdDefault,
        PolicyKind::Lmetric,
    ];

    /// The policy a router uses when none is named: kvroute's own.
    pub const DEFAULT: PolicyKind = PolicyKind::KvLoad;

    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::RoundRobin => "round_robin",
            PolicyKind::Random => "random",
            PolicyKind::Kv => "kv",
            PolicyKind::KvLoad => "kv_load",
            PolicyKind::SglangCacheAware => "sglang_cache_aware",
            PolicyKind::LlmdDefault => "llmd_default",
            PolicyKind::Lmetric => "lmetric",
        }
    }

    /// A fresh policy of this kind with the given parameters (each policy reads its own).
    pub fn build(self, params: PolicyParams) -> Box<dyn RoutingPolicy> {
        match self {
            PolicyKind::RoundRobin => Box::new(RoundRobin::default()),
            PolicyKind::Random => Box::new(Random),
            PolicyKind::Kv => Box::new(KvCost::new(params.kv)),
            PolicyKind::KvLoad => Box::new(crate::KvLoad::new(params.kv_load)),
            PolicyKind::SglangCacheAware => {
                Box::new(crate::peers::SglangCacheAware::new(params.sglang))
            }
            PolicyKind::LlmdDefault => Box::new(crate::peers::LlmdScorers::new(params.llmd)),
            // Shares `kv`'s temperature: the proposal adds a selection policy to Dynamo's
            // router, not a new set of knobs.
            PolicyKind::Lmetric => Box::new(crate::peers::Lmetric::new(params.kv)),
        }
    }
}

/// Parameters of the parameterised policies ([`RouterConfig::params`](crate::RouterConfig)).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct PolicyParams {
    /// `kv` (Dynamo's cost).
    pub kv: KvCostParams,
    /// `kv_load`.
    pub kv_load: crate::KvLoadParams,
    /// `sglang_cache_aware`.
    pub sglang: crate::peers::SglangCacheAwareParams,
    /// `llmd_default`.
    pub llmd: crate::peers::LlmdWeights,
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A policy name that is not one of [`PolicyKind::ALL`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownPolicy(pub String);

impl fmt::Display for UnknownPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = PolicyKind::ALL.iter().map(|k| k.name()).collect();
        write!(
            f,
            "unknown router mode `{}`; expected one of: {}",
            self.0,
            names.join(", ")
        )
    }
}

impl std::error::Error for UnknownPolicy {}

impl FromStr for PolicyKind {
    type Err = UnknownPolicy;

    /// Accepts the canonical names and Dynamo's spelling `round-robin`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().replace('-', "_").as_str() {
            "round_robin" | "roundrobin" | "rr" => Ok(PolicyKind::RoundRobin),
            "random" => Ok(PolicyKind::Random),
            "kv" => Ok(PolicyKind::Kv),
            "kv_load" | "kvload" => Ok(PolicyKind::KvLoad),
            "sglang_cache_aware" | "cache_aware" => Ok(PolicyKind::SglangCacheAware),
            "llmd_default" | "llmd" => Ok(PolicyKind::LlmdDefault),
            "lmetric" => Ok(PolicyKind::Lmetric),
            _ => Err(UnknownPolicy(s.to_string())),
        }
    }
}

/// Cycles through the workers in ascending id order, skipping none.
#[derive(Debug, Default)]
pub struct RoundRobin {
    /// Id of the worker chosen last; the next choice is the first worker after it. Keyed by
    /// id rather than position so workers joining or leaving do not reset the cycle.
    last: Option<WorkerId>,
}

impl RoutingPolicy for RoundRobin {
    fn name(&self) -> &'static str {
        PolicyKind::RoundRobin.name()
    }

    /// Reply lengths do not enter this policy.
    fn observe_reply(&mut self, _output_tokens: u32) {}

    fn select(&mut self, ctx: &SelectionContext<'_>, _rng: &mut PolicyRng) -> usize {
        let index = match self.last {
            None => 0,
            Some(last) => ctx
                .candidates
                .iter()
                .position(|c| c.worker > last)
                .unwrap_or(0),
        };
        self.last = Some(ctx.candidates[index].worker);
        index
    }
}

/// Picks a worker uniformly at random (seeded).
#[derive(Debug, Default)]
pub struct Random;

impl RoutingPolicy for Random {
    fn name(&self) -> &'static str {
        PolicyKind::Random.name()
    }

    /// Reply lengths do not enter this policy.
    fn observe_reply(&mut self, _output_tokens: u32) {}

    fn select(&mut self, ctx: &SelectionContext<'_>, rng: &mut PolicyRng) -> usize {
        rng.index_below(ctx.candidates.len())
    }
}

/// Parameters of the Dynamo-compatible KV cost.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvCostParams {
    /// Weight of prefill blocks against decode blocks (Dynamo's `kv_overlap_score_weight`,
    /// default 1.0). 0 ignores the cache entirely.
    pub overlap_weight: f64,
    /// Softmax temperature over normalised costs (Dynamo's `router_temperature`). 0 picks the
    /// lowest cost, ties broken at random.
    pub temperature: f64,
}

impl Default for KvCostParams {
    fn default() -> Self {
        Self {
            overlap_weight: 1.0,
            temperature: 0.0,
        }
    }
}

/// Dynamo's KV cost (seed 002):
/// `cost = overlap_weight × prefill_blocks + decode_blocks`, lowest wins.
///
/// - `prefill_blocks` = (the worker's prefill tokens still pending first token + this
///   request's uncached tokens on that worker) / block size — fractional, as Dynamo divides
///   tokens by the block size;
/// - `decode_blocks` = the worker's active blocks including this request's
///   ([`Candidate::potential_active_blocks`]).
///
/// With temperature 0, ties are broken uniformly at random. With temperature `t > 0`, costs
/// are min-max normalised to [0, 1] and a worker is sampled with probability
/// ∝ `exp(−normalised_cost / t)`.
#[derive(Debug)]
pub struct KvCost {
    params: KvCostParams,
    /// Scratch buffer reused across decisions so routing does not allocate.
    costs: Vec<f64>,
}

impl KvCost {
    pub fn new(params: KvCostParams) -> Self {
        Self {
            params,
            costs: Vec::new(),
        }
    }

    /// The cost of sending the request to `c`.
    pub fn cost(params: &KvCostParams, block_size: u32, c: &Candidate) -> f64 {
        params.overlap_weight * Self::prefill_blocks(block_size, c)
            + c.potential_active_blocks as f64
    }

    /// The prefill term: the worker's prefill still pending first token plus the request's
    /// uncached tokens on it, over the block size (fractional, as Dynamo divides).
    pub fn prefill_blocks(block_size: u32, c: &Candidate) -> f64 {
        let prefill_tokens = c.load.pending_prefill_tokens + c.new_prefill_tokens;
        prefill_tokens as f64 / f64::from(block_size.max(1))
    }
}

impl RoutingPolicy for KvCost {
    fn name(&self) -> &'static str {
        PolicyKind::Kv.name()
    }

    /// Reply lengths do not enter this policy.
    fn observe_reply(&mut self, _output_tokens: u32) {}

    fn select(&mut self, ctx: &SelectionContext<'_>, rng: &mut PolicyRng) -> usize {
        self.costs.clear();
        self.costs.extend(
            ctx.candidates
                .iter()
                .map(|c| Self::cost(&self.params, ctx.block_size, c)),
        );
        pick_lowest(&self.costs, self.params.temperature, rng)
    }
}

/// Dynamo's pick over costs: the lowest (ties at random) at temperature 0, else a softmax
/// sample over min-max normalised costs ([`softmax_sample`]).
pub fn pick_lowest(costs: &[f64], temperature: f64, rng: &mut PolicyRng) -> usize {
    if temperature > 0.0 {
        softmax_sample(costs, temperature, rng)
    } else {
        argmin_random_tie(costs, rng)
    }
}

/// Index of the smallest value; among equal minima, one chosen uniformly at random.
pub fn argmin_random_tie(values: &[f64], rng: &mut PolicyRng) -> usize {
    let min = values.iter().copied().fold(f64::INFINITY, f64::min);
    let ties = values.iter().filter(|&&v| v == min).count();
    if ties <= 1 {
        return values.iter().position(|&v| v == min).unwrap_or(0);
    }
    let pick = rng.index_below(ties);
    values
        .iter()
        .enumerate()
        .filter(|(_, v)| **v == min)
        .nth(pick)
        .map_or(0, |(i, _)| i)
}

/// Samples an index with probability ∝ exp(−normalised cost / temperature), costs min-max
/// normalised to [0, 1]. All-equal costs sample uniformly.
pub fn softmax_sample(costs: &[f64], temperature: f64, rng: &mut PolicyRng) -> usize {
    let min = costs.iter().copied().fold(f64::INFINITY, f64::min);
    let max = costs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let range = max - min;
    let weight = |c: f64| {
        let norm = if range > 0.0 { (c - min) / range } else { 0.0 };
        (-norm / temperature).exp()
    };
    let total: f64 = costs.iter().map(|&c| weight(c)).sum();
    let mut target = rng.unit_f64() * total;
    for (i, &c) in costs.iter().enumerate() {
        target -= weight(c);
        if target < 0.0 {
            return i;
        }
    }
    costs.len().saturating_sub(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn candidate(worker: u64, overlap: u32, new_prefill: u64, active: u64) -> Candidate {
        Candidate {
            worker: WorkerId(worker),
            overlap_blocks: overlap,
            new_prefill_tokens: new_prefill,
            potential_active_blocks: active,
            load: WorkerLoad::default(),
            limits: WorkerLimits::default(),
        }
    }

    fn ctx(candidates: &[Candidate]) -> SelectionContext<'_> {
        SelectionContext {
            prompt_tokens: 3200,
            prompt_blocks: 100,
            block_size: 32,
            candidates,
        }
    }

    /// The worked example of seed 002: 100 request blocks, weight 1.0 → costs 90, 30, 99.
    #[test]
    fn kv_cost_reproduces_seed_002_example() {
        let cands = [
            candidate(1, 20, 80 * 32, 10),
            candidate(2, 75, 25 * 32, 5),
            candidate(3, 10, 90 * 32, 9),
        ];
        let params = KvCostParams::default();
        let costs: Vec<f64> = cands.iter().map(|c| KvCost::cost(&params, 32, c)).collect();
        assert_eq!(costs, vec![90.0, 30.0, 99.0]);
        let mut rng = PolicyRng::seed_from_u64(0);
        assert_eq!(KvCost::new(params).select(&ctx(&cands), &mut rng), 1);
    }

    #[test]
    fn kv_cost_counts_pending_prefill_of_the_worker() {
        let mut busy = candidate(1, 75, 25 * 32, 5);
        busy.load.pending_prefill_tokens = 100 * 32;
        let idle = candidate(2, 0, 100 * 32, 5);
        let params = KvCostParams::default();
        assert_eq!(KvCost::cost(&params, 32, &busy), 125.0 + 5.0);
        let mut rng = PolicyRng::seed_from_u64(0);
        assert_eq!(
            KvCost::new(params).select(&ctx(&[busy, idle]), &mut rng),
            1,
            "a worker with a long prefill queue loses its cache advantage"
        );
    }

    #[test]
    fn overlap_weight_zero_balances_decode_load_only() {
        let cached_but_loaded = candidate(1, 100, 0, 50);
        let cold_but_idle = candidate(2, 0, 100 * 32, 10);
        let params = KvCostParams {
            overlap_weight: 0.0,
            temperature: 0.0,
        };
        let mut rng = PolicyRng::seed_from_u64(0);
        let cands = [cached_but_loaded, cold_but_idle];
        assert_eq!(KvCost::new(params).select(&ctx(&cands), &mut rng), 1);
    }

    #[test]
    fn ties_are_broken_at_random_but_deterministically() {
        let cands: Vec<Candidate> = (0..4).map(|w| candidate(w, 0, 3200, 0)).collect();
        let picks = |seed| {
            let mut rng = PolicyRng::seed_from_u64(seed);
            let mut policy = KvCost::new(KvCostParams::default());
            (0..400)
                .map(|_| policy.select(&ctx(&cands), &mut rng))
                .collect::<Vec<_>>()
        };
        let a = picks(7);
        assert_eq!(a, picks(7), "same seed, same choices");
        for w in 0..4 {
            let n = a.iter().filter(|&&i| i == w).count();
            assert!((60..140).contains(&n), "worker {w} picked {n}/400 times");
        }
    }

    #[test]
    fn softmax_prefers_cheap_workers_and_temperature_flattens() {
        let costs = [0.0, 10.0, 10.0];
        let share_of_cheapest = |t| {
            let mut rng = PolicyRng::seed_from_u64(1);
            let n = (0..2000)
                .filter(|_| softmax_sample(&costs, t, &mut rng) == 0)
                .count();
            n as f64 / 2000.0
        };
        // Normalised costs 0, 1, 1: p0 = 1 / (1 + 2e^(−1/t)).
        let cold = share_of_cheapest(0.1);
        let hot = share_of_cheapest(10.0);
        assert!(cold > 0.99, "t=0.1 → {cold}");
        let expected_hot = 1.0 / (1.0 + 2.0 * (-0.1f64).exp());
        assert!((hot - expected_hot).abs() < 0.04, "t=10 → {hot}");
    }

    #[test]
    fn round_robin_cycles_by_id_across_membership_changes() {
        let mut rr = RoundRobin::default();
        let mut rng = PolicyRng::seed_from_u64(0);
        let three: Vec<Candidate> = [1, 2, 3].map(|w| candidate(w, 0, 0, 0)).to_vec();
        let seq: Vec<usize> = (0..4).map(|_| rr.select(&ctx(&three), &mut rng)).collect();
        assert_eq!(seq, vec![0, 1, 2, 0]);
        // Worker 2 leaves after worker 1 was chosen: the next is worker 3, not a reset to 1.
        let two: Vec<Candidate> = [1, 3].map(|w| candidate(w, 0, 0, 0)).to_vec();
        assert_eq!(three[rr.select(&ctx(&three), &mut rng)].worker, WorkerId(2));
        assert_eq!(two[rr.select(&ctx(&two), &mut rng)].worker, WorkerId(3));
        assert_eq!(two[rr.select(&ctx(&two), &mut rng)].worker, WorkerId(1));
    }

    #[test]
    fn random_is_uniform_and_seeded() {
        let cands: Vec<Candidate> = (0..3).map(|w| candidate(w, 0, 0, 0)).collect();
        let mut rng = PolicyRng::seed_from_u64(3);
        let mut counts = [0usize; 3];
        for _ in 0..3000 {
            counts[Random.select(&ctx(&cands), &mut rng)] += 1;
        }
        assert!(
            counts.iter().all(|&n| (900..1100).contains(&n)),
            "{counts:?}"
        );
    }

    #[test]
    fn policy_names_round_trip_and_errors_list_choices() {
        for kind in PolicyKind::ALL {
            assert_eq!(kind.name().parse::<PolicyKind>(), Ok(kind));
            assert_eq!(kind.build(PolicyParams::default()).name(), kind.name());
        }
        assert_eq!("round-robin".parse(), Ok(PolicyKind::RoundRobin));
        let err = "kv-best".parse::<PolicyKind>().unwrap_err().to_string();
        assert!(err.contains("round_robin, random, kv"), "{err}");
    }
}
