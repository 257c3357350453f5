//! `kv_load`: kvroute's load-aware KV policy.
//!
//! Dynamo's `kv` cost adds prefill *blocks* to active *blocks*. Both are block counts, but they
//! are not the same currency: a worker's active blocks run into the thousands and drift by
//! hundreds as conversations come and go, while a conversation's whole history is a few hundred
//! blocks. The load term therefore moves conversations off the worker that holds their history
//! (seed 002's hit rate stays near 94%), and nothing in the cost sees the batch limit, so a
//! worker that passes `max_num_seqs` queues requests inside the engine while another has free
//! slots (seed 002's TTFT p95 of 3.1 s at concurrency 180).
//!
//! `kv_load` prices every candidate in **seconds of latency**, from the worker's own timing
//! ([`WorkerTiming`], derived from its hardware profile), and respects the worker's limits:
//!
//! 1. **Headroom first.** Workers whose predicted in-flight requests would pass their
//!    `max_num_seqs`, or whose predicted active blocks would pass their KV capacity, are chosen
//!    only when every worker is in that state. Passing the batch limit queues the request in
//!    the engine behind a whole reply (tens of seconds at 60 per batch); spilling to another
//!    worker costs one prefill. The spill is paid knowingly.
//! 2. **Among workers with headroom, the lowest predicted cost** (seconds):
//!    - *time to first token*: the worker's pending prefill plus this request's uncached
//!      tokens, at the worker's prefill rate;
//!    - *stall*: with chunked prefill, the worker's running batch waits while this request's
//!      uncached tokens are computed: prefill time × running requests × `stall_weight`;
//!    - *decode*: each decode step reads the KV of every running sequence, so the request's
//!      own reply costs `expected_output_tokens` × (the worker's active tokens + its own new
//!      active tokens) × the worker's seconds per context token; and it slows each running
//!      request by its new active tokens for the part of the reply they overlap
//!      (`expected_output_tokens / 2` on average);
//!    - *slots*: a smooth penalty as the in-flight count approaches `max_num_seqs`, so
//!      conversations spread before the cliff and not at it.
//!
//! Ties go to the fewest in-flight requests, then at random.
//!
//! The result: a conversation stays on the worker holding its history (a full-history miss
//! stalls a whole batch for most of a second, which no realistic imbalance outweighs), new
//! conversations go where decode is cheapest, and no worker is pushed into queueing while
//! another has a free slot. Design, measurements and what did not work: `docs/ROUTING.md`.

use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::policy::{
    Candidate, PolicyKind, RoutingPolicy, SelectionContext, WorkerTiming, argmin_random_tie,
};

/// Parameters of [`KvLoad`]. Defaults are the ones `docs/ROUTING.md` measures.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KvLoadParams {
    /// Expected tokens in a reply, used to price decode load. Routing needs an order of
    /// magnitude, not the exact length: the decode terms scale with it as a whole.
    pub expected_output_tokens: f64,
    /// Weight of the stall a prefill imposes on the worker's running batch (1 = its full cost
    /// in seconds of everyone's latency; 0 = only the request's own TTFT).
    pub stall_weight: f64,
    /// Weight of the stall when the uncached tokens replicate a prefix other in-flight
    /// requests use (a shared document or system prompt): a one-time cost that lets later
    /// requests sharing it go to this worker too.
    pub replication_stall_weight: f64,
    /// Fraction of `max_num_seqs` from which the slot penalty starts to grow.
    pub slot_soft_limit: f64,
    /// Seconds of penalty when the last free slot would be taken (quadratic from the soft
    /// limit up to there).
    pub slot_penalty_secs: f64,
    /// Timing used for workers that did not declare theirs.
    pub default_timing: WorkerTiming,
}

impl Default for KvLoadParams {
    fn default() -> Self {
        Self {
            expected_output_tokens: 512.0,
            stall_weight: 1.0,
            replication_stall_weight: 0.0,
            slot_soft_limit: 0.85,
            slot_penalty_secs: 30.0,
            default_timing: WorkerTiming::H200_LLAMA70B_FP8,
        }
    }
}

/// kvroute's load-aware KV policy (module docs).
#[derive(Debug)]
pub struct KvLoad {
    params: KvLoadParams,
    /// Scratch buffers reused across decisions so routing does not allocate.
    costs: Vec<f64>,
    eligible: Vec<usize>,
}

impl KvLoad {
    pub fn new(params: KvLoadParams) -> Self {
        Self {
            params,
            costs: Vec::new(),
            eligible: Vec::new(),
        }
    }

    pub fn params(&self) -> &KvLoadParams {
        &self.params
    }

    /// Whether sending the request to `c` keeps it within its declared limits.
    pub fn has_headroom(c: &Candidate) -> bool {
        let seqs_ok = c.limits.max_num_seqs.is_none_or(|m| c.load.in_flight < m);
        let kv_ok = c
            .limits
            .kv_capacity_blocks
            .is_none_or(|cap| c.potential_active_blocks <= cap);
        seqs_ok && kv_ok
    }

    /// Leading blocks of the request that some in-flight request on some worker is using:
    /// a prefix shared across conversations (a system prompt, a document), as opposed to one
    /// conversation's own history, which is idle between its turns.
    pub fn shared_prefix_blocks(ctx: &SelectionContext<'_>) -> u64 {
        ctx.candidates
            .iter()
            .map(|c| active_prefix_blocks(ctx, c))
            .max()
            .unwrap_or(0)
    }

    /// Predicted cost, in seconds, of sending the request to `c` (module docs, step 2).
    /// `shared_blocks` is [`KvLoad::shared_prefix_blocks`] of the request.
    pub fn cost(
        params: &KvLoadParams,
        ctx: &SelectionContext<'_>,
        shared_blocks: u64,
        c: &Candidate,
    ) -> f64 {
        let block_size = ctx.block_size;
        let prompt_tokens = ctx.prompt_tokens;
        let timing = c.limits.timing.unwrap_or(params.default_timing);
        let block = f64::from(block_size.max(1));
        let running = match c.limits.max_num_seqs {
            Some(m) => c.load.in_flight.min(m),
            None => c.load.in_flight,
        };
        let running = f64::from(running);
        let new_prefill = c.new_prefill_tokens as f64;
        // Uncached tokens of a prefix other requests are using: computing them here
        // replicates that prefix, which later requests sharing it will reuse.
        let replicated = (shared_blocks.saturating_sub(u64::from(c.overlap_blocks)) as f64 * block)
            .min(new_prefill);
        let private = new_prefill - replicated;
        let pending = c.load.pending_prefill_tokens as f64;
        let context = c.load.context_tokens as f64;
        let prompt = prompt_tokens as f64;
        let out = params.expected_output_tokens;

        let ttft = timing.prefill_secs_per_token * (pending + new_prefill);
        let stall = timing.prefill_secs_per_token
            * running
            * (params.stall_weight * private + params.replication_stall_weight * replicated);
        let own_decode = out * timing.decode_secs_per_context_token * (context + prompt);
        let imposed_decode = running * (out / 2.0) * timing.decode_secs_per_context_token * prompt;
        ttft + stall + own_decode + imposed_decode + Self::slot_penalty(params, c)
    }

    /// Quadratic penalty from `slot_soft_limit × max_num_seqs` to the last slot.
    fn slot_penalty(params: &KvLoadParams, c: &Candidate) -> f64 {
        let Some(m) = c.limits.max_num_seqs.filter(|&m| m > 0) else {
            return 0.0;
        };
        let soft = params.slot_soft_limit.clamp(0.0, 1.0) * f64::from(m);
        let after = f64::from(c.load.in_flight) + 1.0;
        if after <= soft {
            return 0.0;
        }
        let span = (f64::from(m) - soft).max(1.0);
        let x = ((after - soft) / span).min(4.0);
        params.slot_penalty_secs * x * x
    }
}

impl RoutingPolicy for KvLoad {
    fn name(&self) -> &'static str {
        PolicyKind::KvLoad.name()
    }

    fn select(&mut self, ctx: &SelectionContext<'_>, rng: &mut ChaCha8Rng) -> usize {
        self.eligible.clear();
        self.eligible.extend(
            ctx.candidates
                .iter()
                .enumerate()
                .filter(|(_, c)| Self::has_headroom(c))
                .map(|(i, _)| i),
        );
        if self.eligible.is_empty() {
            // Every worker is at a limit: all are eligible, and the cost (with its slot
            // penalty) picks the least bad.
            self.eligible.extend(0..ctx.candidates.len());
        }
        let shared = Self::shared_prefix_blocks(ctx);
        self.costs.clear();
        self.costs.extend(
            self.eligible
                .iter()
                .map(|&i| Self::cost(&self.params, ctx, shared, &ctx.candidates[i])),
        );
        // Equal costs (an idle fleet, identical loads) go to the fewest in flight first.
        let min = self.costs.iter().copied().fold(f64::INFINITY, f64::min);
        let fewest = self
            .eligible
            .iter()
            .zip(&self.costs)
            .filter(|(_, c)| **c == min)
            .map(|(&i, _)| ctx.candidates[i].load.in_flight)
            .min()
            .unwrap_or(0);
        for (slot, &i) in self.costs.iter_mut().zip(&self.eligible) {
            if *slot == min && ctx.candidates[i].load.in_flight != fewest {
                *slot = f64::INFINITY;
            }
        }
        let pick = argmin_random_tie(&self.costs, rng);
        self.eligible.get(pick).copied().unwrap_or(0)
    }
}

/// Leading blocks of the request active on `c`'s worker (held by one of its in-flight
/// requests): all of the request's blocks except those routing it there would add.
fn active_prefix_blocks(ctx: &SelectionContext<'_>, c: &Candidate) -> u64 {
    let added = c
        .potential_active_blocks
        .saturating_sub(c.load.active_blocks);
    u64::from(ctx.prompt_blocks).saturating_sub(added)
}
