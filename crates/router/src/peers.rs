//! The routers users compare kvroute with, as their public documentation describes them, so
//! the simulator can run them head to head on the same fleet and workload. Written from the
//! documentation only (never from their code); each type names its source and version.
//!
//! Both see what every kvroute policy sees ([`SelectionContext`]): the overlap the router's
//! index gives (exact from KV events, or approximate from routing history — the latter is
//! what SGLang's and llm-d's default scorers use; pick it with the router's `KvSource`), and
//! the router's own load accounting. Where a peer reads a signal kvroute's router does not
//! track, the approximation is stated on the field.

use kv_index::WorkerId;
use rustc_hash::FxHashMap;

use crate::policy::{
    KvCost, KvCostParams, PolicyKind, PolicyRng, RoutingPolicy, SelectionContext,
    argmin_random_tie, pick_lowest,
};

/// Parameters of SGLang's `cache_aware` policy; defaults are sglang-router 0.3.2's
/// (`python -m sglang_router.launch_router --help`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SglangCacheAwareParams {
    /// `--cache-threshold`: the prefix match rate above which the best-matching worker wins.
    pub cache_threshold: f64,
    /// `--balance-abs-threshold`: the load gap (requests) that, with the relative one, makes
    /// the fleet imbalanced.
    pub balance_abs_threshold: u32,
    /// `--balance-rel-threshold`: imbalanced when `max_load > min_load × this` as well.
    pub balance_rel_threshold: f64,
    /// `--max-tree-size`: the most each worker's approximate tree holds (SGLang counts
    /// characters; here tokens, at ~4 characters each).
    pub max_tree_tokens: u64,
}

impl Default for SglangCacheAwareParams {
    fn default() -> Self {
        Self {
            cache_threshold: 0.3,
            balance_abs_threshold: 64,
            balance_rel_threshold: 1.5,
            max_tree_tokens: (1 << 26) / 4,
        }
    }
}

/// SGLang's `cache_aware` routing (SGLang Model Gateway documentation, sglang-router 0.3.2):
///
/// 1. The fleet is *imbalanced* when `max_load − min_load > balance_abs_threshold` and
///    `max_load > min_load × balance_rel_threshold` (load: requests the router has in flight
///    on the worker). Then the least-loaded worker wins.
/// 2. Otherwise, with `match_rate` = matched prefix / prompt length on the best-matching
///    worker: above `cache_threshold` that worker wins; else the worker whose approximate
///    tree is smallest (the most room for new cache) wins.
///
/// The tree sizes are this policy's own accounting of what it routed (the prompt's uncached
/// tokens added to the chosen worker, capped at `max_tree_tokens` as SGLang's periodic LRU
/// eviction caps it), like SGLang's router-side tree.
#[derive(Debug, Default)]
pub struct SglangCacheAware {
    params: SglangCacheAwareParams,
    /// Tokens routed to each worker; bounded by pruning to the current candidates.
    tree_tokens: FxHashMap<WorkerId, u64>,
    scratch: Vec<f64>,
}

impl SglangCacheAware {
    pub fn new(params: SglangCacheAwareParams) -> Self {
        Self {
            params,
            ..Self::default()
        }
    }
}

impl RoutingPolicy for SglangCacheAware {
    fn name(&self) -> &'static str {
        PolicyKind::SglangCacheAware.name()
    }

    /// Reply lengths do not enter this policy.
    fn observe_reply(&mut self, _output_tokens: u32) {}

    fn select(&mut self, ctx: &SelectionContext<'_>, rng: &mut PolicyRng) -> usize {
        let p = self.params;
        let loads = ctx.candidates.iter().map(|c| c.load.in_flight);
        let max_load = loads.clone().max().unwrap_or(0);
        let min_load = loads.min().unwrap_or(0);
        let imbalanced = max_load - min_load > p.balance_abs_threshold
            && f64::from(max_load) > f64::from(min_load) * p.balance_rel_threshold;
        self.scratch.clear();
        let choice = if imbalanced {
            self.scratch
                .extend(ctx.candidates.iter().map(|c| f64::from(c.load.in_flight)));
            argmin_random_tie(&self.scratch, rng)
        } else {
            let block = u64::from(ctx.block_size);
            let matched = |i: usize| {
                (u64::from(ctx.candidates[i].overlap_blocks) * block).min(ctx.prompt_tokens)
            };
            let best = (0..ctx.candidates.len())
                .max_by_key(|&i| (matched(i), std::cmp::Reverse(i)))
                .unwrap_or(0);
            let rate = matched(best) as f64 / ctx.prompt_tokens.max(1) as f64;
            if rate > p.cache_threshold {
                best
            } else {
                let sizes = &self.tree_tokens;
                self.scratch.extend(
                    ctx.candidates
                        .iter()
                        .map(|c| sizes.get(&c.worker).copied().unwrap_or(0) as f64),
                );
                argmin_random_tie(&self.scratch, rng)
            }
        };
        let chosen = &ctx.candidates[choice];
        if self.tree_tokens.len() > 2 * ctx.candidates.len() {
            self.tree_tokens
                .retain(|w, _| ctx.candidates.iter().any(|c| c.worker == *w));
        }
        let size = self.tree_tokens.entry(chosen.worker).or_insert(0);
        *size = (*size + chosen.new_prefill_tokens).min(p.max_tree_tokens);
        choice
    }
}

/// Weights of llm-d's default scorer stack.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LlmdWeights {
    /// `prefix-cache-scorer`.
    pub prefix: f64,
    /// `queue-scorer`.
    pub queue: f64,
    /// `kv-cache-utilization-scorer`.
    pub kv_utilization: f64,
}

impl Default for LlmdWeights {
    /// Prefix 3 and queue 2 are the default profile documented for llm-d's scheduler in Red
    /// Hat OpenShift AI 3.4 ("Configuring scheduler settings for LLM inference services");
    /// llm-d's inference-scheduling guide adds the KV-utilisation scorer at weight 2.
    fn default() -> Self {
        Self {
            prefix: 3.0,
            queue: 2.0,
            kv_utilization: 2.0,
        }
    }
}

/// llm-d's endpoint picker with its default scorers (llm-d v0.8 documentation, "Request
/// Scheduler": filter → score → pick): each scorer gives every endpoint a score in [0, 1],
/// the weighted sum is taken and the max-score picker chooses (ties at random).
///
/// - prefix: the fraction of the prompt's blocks cached on the endpoint;
/// - queue: min-max normalised waiting queue, 1 for the shortest. llm-d reads vLLM's
///   `num_requests_waiting`; here it is the router's in-flight count beyond the worker's
///   batch limit (`max_num_seqs`), or its in-flight count when the limit is unknown;
/// - KV utilisation: 1 − the fraction of the endpoint's KV blocks in use (the router's
///   active blocks over the declared capacity; 1 when the capacity is unknown).
#[derive(Debug, Default)]
pub struct LlmdScorers {
    weights: LlmdWeights,
    scratch: Vec<f64>,
}

impl LlmdScorers {
    pub fn new(weights: LlmdWeights) -> Self {
        Self {
            weights,
            scratch: Vec::new(),
        }
    }
}

impl RoutingPolicy for LlmdScorers {
    fn name(&self) -> &'static str {
        PolicyKind::LlmdDefault.name()
    }

    /// Reply lengths do not enter this policy.
    fn observe_reply(&mut self, _output_tokens: u32) {}

    fn select(&mut self, ctx: &SelectionContext<'_>, rng: &mut PolicyRng) -> usize {
        let w = self.weights;
        let queue = |c: &crate::Candidate| {
            let in_flight = u64::from(c.load.in_flight);
            c.limits
                .max_num_seqs
                .map_or(in_flight, |max| in_flight.saturating_sub(u64::from(max)))
        };
        let queues = ctx.candidates.iter().map(queue);
        let (min_q, max_q) = (queues.clone().min().unwrap_or(0), queues.max().unwrap_or(0));
        self.scratch.clear();
        // Negated scores: the shared arg-min helper then picks the highest, ties at random.
        self.scratch.extend(ctx.candidates.iter().map(|c| {
            let prefix = f64::from(c.overlap_blocks) / f64::from(ctx.prompt_blocks.max(1));
            let queue_score = if max_q == min_q {
                1.0
            } else {
                (max_q - queue(c)) as f64 / (max_q - min_q) as f64
            };
            let kv_free = c.limits.kv_capacity_blocks.map_or(1.0, |cap| {
                1.0 - (c.load.active_blocks as f64 / cap.max(1) as f64).min(1.0)
            });
            -(w.prefix * prefix.min(1.0) + w.queue * queue_score + w.kv_utilization * kv_free)
        }));
        argmin_random_tie(&self.scratch, rng)
    }
}

/// Dynamo's `lmetric` worker selection (the `--router-selection-policy lmetric` proposal,
/// ai-dynamo/dynamo issue #11029 and pull request #11028, June 2026, after Zhang et al.,
/// "Simple is Better: Multiplication May Be All You Need for LLM Request Scheduling",
/// arXiv:2603.15202): the same two terms as Dynamo's default cost ([`KvCost`]), multiplied
/// instead of added:
///
/// `cost = prefill_blocks × (decode_blocks + 1)`, lowest wins,
///
/// with `prefill_blocks` the worker's prefill still pending first token plus this request's
/// uncached tokens, over the block size (the proposal requires that prefill-token tracking),
/// and `decode_blocks` the worker's active blocks with this request's. A scale on either
/// term does not change the order, so `kv`'s overlap weight does not enter; its temperature
/// does (0: lowest cost, ties at random; above 0: the same softmax over min-max normalised
/// costs).
#[derive(Debug)]
pub struct Lmetric {
    temperature: f64,
    costs: Vec<f64>,
}

impl Lmetric {
    pub fn new(params: KvCostParams) -> Self {
        Self {
            temperature: params.temperature,
            costs: Vec::new(),
        }
    }

    /// The cost of sending the request to `c`.
    pub fn cost(block_size: u32, c: &crate::Candidate) -> f64 {
        let decode_blocks = c.potential_active_blocks as f64;
        KvCost::prefill_blocks(block_size, c) * (decode_blocks + 1.0)
    }
}

impl RoutingPolicy for Lmetric {
    fn name(&self) -> &'static str {
        PolicyKind::Lmetric.name()
    }

    /// Reply lengths do not enter this policy.
    fn observe_reply(&mut self, _output_tokens: u32) {}

    fn select(&mut self, ctx: &SelectionContext<'_>, rng: &mut PolicyRng) -> usize {
        self.costs.clear();
        self.costs
            .extend(ctx.candidates.iter().map(|c| Self::cost(ctx.block_size, c)));
        pick_lowest(&self.costs, self.temperature, rng)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Candidate, WorkerLimits, WorkerLoad};

    const BLOCK: u32 = 16;
    const PROMPT_BLOCKS: u32 = 100;

    fn candidate(worker: u64, overlap: u32, in_flight: u32) -> Candidate {
        let cached = u64::from(overlap * BLOCK);
        Candidate {
            worker: WorkerId(worker),
            overlap_blocks: overlap,
            new_prefill_tokens: u64::from(PROMPT_BLOCKS * BLOCK) - cached,
            potential_active_blocks: 0,
            load: WorkerLoad {
                in_flight,
                ..WorkerLoad::default()
            },
            limits: WorkerLimits::default(),
        }
    }

    fn pick(policy: &mut dyn RoutingPolicy, candidates: &[Candidate]) -> u64 {
        let ctx = SelectionContext {
            prompt_tokens: u64::from(PROMPT_BLOCKS * BLOCK),
            prompt_blocks: PROMPT_BLOCKS,
            block_size: BLOCK,
            candidates,
        };
        let i = policy.select(&ctx, &mut PolicyRng::seed_from_u64(3));
        candidates[i].worker.0
    }

    #[test]
    fn sglang_follows_the_cache_above_its_threshold_and_balances_below_it() {
        let mut p = SglangCacheAware::new(SglangCacheAwareParams::default());
        // 40% of the prompt cached on worker 2 (> 0.3): it wins, though it is busier.
        assert_eq!(pick(&mut p, &[candidate(1, 0, 0), candidate(2, 40, 10)]), 2);
        // 20% (< 0.3): the worker with the smallest routed tree wins — worker 1, to which
        // nothing was routed yet; then worker 2 for the next one, as 1's tree has grown.
        let mut p = SglangCacheAware::new(SglangCacheAwareParams::default());
        assert_eq!(pick(&mut p, &[candidate(1, 0, 0), candidate(2, 20, 0)]), 1);
        assert_eq!(pick(&mut p, &[candidate(1, 0, 0), candidate(2, 0, 0)]), 2);
        // Imbalanced (gap 70 > 64 and 80 > 10 × 1.5): least loaded, whatever the cache.
        let mut p = SglangCacheAware::new(SglangCacheAwareParams::default());
        assert_eq!(
            pick(&mut p, &[candidate(1, 0, 10), candidate(2, 100, 80)]),
            1
        );
        // A gap of 60 is within the absolute threshold: the cache wins again.
        assert_eq!(
            pick(&mut p, &[candidate(1, 0, 20), candidate(2, 100, 80)]),
            2
        );
    }

    #[test]
    fn llmd_weighs_prefix_against_queue_and_free_kv() {
        let mut p = LlmdScorers::new(LlmdWeights::default());
        let limits = WorkerLimits {
            max_num_seqs: Some(4),
            kv_capacity_blocks: Some(1_000),
            ..WorkerLimits::default()
        };
        let with = |mut c: Candidate| {
            c.limits = limits;
            c
        };
        // Full prefix (3 × 1) but the longest queue (2 × 0) beats an idle worker with
        // nothing cached (2 × 1): 5 against 4, both with free KV (2 × 1).
        let busy_cached = with(candidate(1, 100, 12));
        let idle = with(candidate(2, 0, 0));
        assert_eq!(pick(&mut p, &[busy_cached, idle]), 1);
        // Half the prefix (1.5 + 0 + 2 = 3.5 < 4): the idle worker wins.
        let busy_half = with(candidate(1, 50, 12));
        assert_eq!(pick(&mut p, &[busy_half, idle]), 2);
        // Equal queues: KV utilisation decides between equal prefixes.
        let mut full = with(candidate(1, 0, 0));
        full.load.active_blocks = 900;
        assert_eq!(pick(&mut p, &[full, idle]), 2);
    }

    #[test]
    fn lmetric_multiplies_prefill_by_decode_so_a_busy_cached_worker_can_lose() {
        let mut p = Lmetric::new(KvCostParams::default());
        let with_active = |mut c: Candidate, active: u64| {
            c.potential_active_blocks = active;
            c
        };
        // 90 of 100 blocks cached: 10 × (200 + 1) = 2,010 against 100 × (50 + 1) = 5,100.
        let cached = with_active(candidate(1, 90, 4), 200);
        let idle = with_active(candidate(2, 0, 0), 50);
        assert_eq!(pick(&mut p, &[cached, idle]), 1);
        // Ten times the decode load: 10 × 2,001 = 20,010 > 5,100, the idle worker wins,
        // where Dynamo's sum (10 + 2,000 against 100 + 50) had already chosen it.
        let overloaded = with_active(candidate(1, 90, 40), 2_000);
        assert_eq!(pick(&mut p, &[overloaded, idle]), 2);
        // Pending prefill counts as the request's own: 10 blocks cached but 2,000 tokens
        // queued on worker 1 ((10 + 125) × 201) lose to the idle worker.
        let mut queued = with_active(candidate(1, 90, 4), 200);
        queued.load.pending_prefill_tokens = 2_000;
        assert_eq!(pick(&mut p, &[queued, idle]), 2);
        assert!((Lmetric::cost(BLOCK, &cached) - 2_010.0).abs() < 1e-9);
    }
}
