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
//!    only when every worker is in that state (overload: the request waits for a slot wherever
//!    it goes, and the cost below, whose slot penalty keeps growing past the limit, decides).
//!    Passing the batch limit queues the request in the engine until a
//!    running one finishes (most of a second at 64 per batch and replies of tens of seconds,
//!    far over a 600 ms TTFT objective); spilling to another worker costs one prefill. The
//!    spill is paid knowingly.
//! 2. **Among workers with headroom, the lowest predicted cost** (seconds):
//!    - *time to first token*: the worker's pending prefill plus this request's uncached
//!      tokens, at the worker's prefill rate;
//!    - *stall*: with chunked prefill, the worker's running batch waits while this request's
//!      uncached tokens are computed: prefill time × `stall_weight` × (the requests still
//!      waiting for their first token, whose TTFT grows by all of it, + `decode_stall_weight`
//!      × the decoding ones, for whom it is one late token among many);
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

use serde::{Deserialize, Serialize};

use kv_index::WorkerId;

use crate::policy::{
    Candidate, PolicyKind, PolicyRng, RoutingPolicy, SelectionContext, WorkerTiming,
    argmin_random_tie,
};

/// Parameters of [`KvLoad`]. Defaults are the ones `docs/ROUTING.md` measures.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KvLoadParams {
    /// Reply tokens whose decode the cost charges: the starting value when
    /// `learn_output_tokens` is on (then the mean of recent replies takes over), the fixed
    /// value when it is off. 100 by default, a horizon rather than a reply length: the load
    /// the cost reads (running requests, their context) is the load of the next few
    /// seconds, about 100 decode steps, and pricing a whole reply against it overweights a
    /// batch that will have turned over (docs/ROUTING.md, "Parameters").
    pub expected_output_tokens: f64,
    /// Learn `expected_output_tokens` from the replies that complete (an exponentially
    /// weighted mean over about the last `REPLY_MEMORY` (64) replies). Off by default: it prices
    /// long replies (the seed's ~845 tokens) far past the horizon that pays on the robustness
    /// grid (docs/ROUTING.md, "What did not work").
    pub learn_output_tokens: bool,
    /// Weight of the stall a prefill imposes on the worker's running batch (1 = its full cost
    /// in seconds of everyone's latency; 0 = only the request's own TTFT).
    pub stall_weight: f64,
    /// Weight of the stall when the uncached tokens replicate a prefix other in-flight
    /// requests use (a shared document or system prompt): a one-time cost that lets later
    /// requests sharing it go to this worker too.
    pub replication_stall_weight: f64,
    /// Weight, within the stall, of the running requests that are decoding. Those still
    /// waiting for their first token count fully: the prefill is added to their TTFT. A
    /// decoding request gets one token late, a delay its whole reply shares. 0.05 by default,
    /// measured on the robustness grid (docs/ROUTING.md, "Parameters"): it is what lets a
    /// turn leave a wave of simultaneous prefills on its history's worker.
    pub decode_stall_weight: f64,
    /// Fraction of `max_num_seqs` from which the slot penalty starts to grow.
    pub slot_soft_limit: f64,
    /// Seconds of penalty when the last free slot would be taken (quadratic from the soft
    /// limit up to there). 1.5 by default: about half of what moving a 6,000-token history
    /// off a full batch costs, so the penalty spreads new conversations before the cliff
    /// without pushing existing ones off their cache (30 until the stall weighed decoding
    /// requests at 0.05, which it then outweighed: docs/ROUTING.md, "Parameters").
    pub slot_penalty_secs: f64,
    /// Timing used for workers that did not declare theirs.
    pub default_timing: WorkerTiming,
    /// Send a request whose cached prefix is the same on every eligible worker (a new
    /// conversation whose shared system prompt or passage is everywhere, or nothing cached
    /// anywhere) to the eligible workers in turn instead of by cost. Off by default: it halves
    /// the lock-step TTFT p50 on 3 H200s but does not win the robustness grid
    /// (docs/ROUTING.md, "What did not work").
    pub spread_fresh_requests: bool,
    /// Multiply the request's prefill terms (its TTFT and the stall it imposes) by
    /// `1 + prefill_load_factor × a`, `a` the share of the worker's KV capacity its in-flight
    /// requests would use with this one: the additive form of Dynamo's `lmetric` (prefill
    /// times decode load). 0 (off) by default: it does not win more of the robustness grid
    /// (docs/ROUTING.md, "What did not work").
    pub prefill_load_factor: f64,
}

impl Default for KvLoadParams {
    fn default() -> Self {
        Self {
            expected_output_tokens: 100.0,
            learn_output_tokens: false,
            stall_weight: 1.0,
            replication_stall_weight: 0.0,
            decode_stall_weight: 0.05,
            slot_soft_limit: 0.85,
            slot_penalty_secs: 1.5,
            default_timing: WorkerTiming::H200_LLAMA70B_FP8,
            spread_fresh_requests: false,
            prefill_load_factor: 0.0,
        }
    }
}

/// A [`KvLoadParams`] value that would make costs meaningless.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum KvLoadParamError {
    #[error("{name} must be a finite number ≥ 0, got {value}")]
    NotNonNegative { name: &'static str, value: f64 },
    #[error("slot_soft_limit must be within [0, 1] (a fraction of max_num_seqs), got {0}")]
    SoftLimitOutOfRange(f64),
}

impl KvLoadParams {
    /// Refuses values that would make costs meaningless (NaN, negative, a soft limit
    /// outside [0, 1]), naming the parameter.
    pub fn validate(&self) -> Result<(), KvLoadParamError> {
        let non_negative = [
            ("expected_output_tokens", self.expected_output_tokens),
            ("stall_weight", self.stall_weight),
            ("replication_stall_weight", self.replication_stall_weight),
            ("decode_stall_weight", self.decode_stall_weight),
            ("slot_penalty_secs", self.slot_penalty_secs),
            ("prefill_load_factor", self.prefill_load_factor),
            (
                "default_timing.prefill_secs_per_token",
                self.default_timing.prefill_secs_per_token,
            ),
            (
                "default_timing.decode_secs_per_context_token",
                self.default_timing.decode_secs_per_context_token,
            ),
        ];
        for (name, value) in non_negative {
            if !(value.is_finite() && value >= 0.0) {
                return Err(KvLoadParamError::NotNonNegative { name, value });
            }
        }
        if !(0.0..=1.0).contains(&self.slot_soft_limit) {
            return Err(KvLoadParamError::SoftLimitOutOfRange(self.slot_soft_limit));
        }
        Ok(())
    }
}

/// Replies the learned reply length remembers: the weight of a new reply is
/// `1 / min(replies + 1, REPLY_MEMORY)`, so the configured value counts as one reply and the
/// mean follows a change of workload within a few hundred requests.
pub const REPLY_MEMORY: f64 = 64.0;

/// kvroute's load-aware KV policy (module docs).
#[derive(Debug)]
pub struct KvLoad {
    /// The parameters; `expected_output_tokens` is the learned value when learning is on.
    params: KvLoadParams,
    /// Replies learned from.
    replies: u64,
    /// Scratch buffers reused across decisions so routing does not allocate.
    costs: Vec<f64>,
    eligible: Vec<usize>,
    /// The worker the last spread fresh request went to (`spread_fresh_requests`).
    last_fresh_worker: Option<WorkerId>,
}

impl KvLoad {
    pub fn new(params: KvLoadParams) -> Self {
        Self {
            params,
            replies: 0,
            costs: Vec::new(),
            eligible: Vec::new(),
            last_fresh_worker: None,
        }
    }

    /// The reply length decode is priced with now.
    pub fn expected_output_tokens(&self) -> f64 {
        self.params.expected_output_tokens
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
        let awaiting = c.load.awaiting_first_token.min(running);
        let stalled =
            f64::from(awaiting) + params.decode_stall_weight * f64::from(running - awaiting);
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
            * stalled
            * (params.stall_weight * private + params.replication_stall_weight * replicated);
        let own_decode = out * timing.decode_secs_per_context_token * (context + prompt);
        let imposed_decode = running * (out / 2.0) * timing.decode_secs_per_context_token * prompt;
        let prefill = (ttft + stall) * Self::prefill_scale(params, c);
        prefill + own_decode + imposed_decode + Self::slot_penalty(params, c)
    }

    /// With `spread_fresh_requests`: when every eligible worker holds the same prefix of the
    /// request, the eligible worker after the last one a fresh request went to (in worker-id
    /// order, wrapping); `None` when some worker holds more of it.
    fn next_fresh_worker(&mut self, ctx: &SelectionContext<'_>) -> Option<usize> {
        let mut overlaps = self
            .eligible
            .iter()
            .map(|&i| ctx.candidates[i].overlap_blocks);
        let first = overlaps.next()?;
        if overlaps.any(|o| o != first) {
            return None;
        }
        let worker_of = |i: usize| ctx.candidates[i].worker;
        let after = |i: &usize| {
            self.last_fresh_worker
                .is_none_or(|last| worker_of(*i) > last)
        };
        let lowest = self
            .eligible
            .iter()
            .copied()
            .min_by_key(|&i| worker_of(i))?;
        let next = self
            .eligible
            .iter()
            .copied()
            .filter(after)
            .min_by_key(|&i| worker_of(i))
            .unwrap_or(lowest);
        self.last_fresh_worker = Some(worker_of(next));
        Some(next)
    }

    /// `1 + prefill_load_factor ×` the share of `c`'s KV capacity its in-flight requests
    /// would use with this one (1 when the factor is 0 or the capacity unknown).
    fn prefill_scale(params: &KvLoadParams, c: &Candidate) -> f64 {
        match c.limits.kv_capacity_blocks {
            Some(cap) if cap > 0 && params.prefill_load_factor > 0.0 => {
                1.0 + params.prefill_load_factor * c.potential_active_blocks as f64 / cap as f64
            }
            _ => 1.0,
        }
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

    fn select(&mut self, ctx: &SelectionContext<'_>, rng: &mut PolicyRng) -> usize {
        self.eligible.clear();
        self.eligible.extend(
            ctx.candidates
                .iter()
                .enumerate()
                .filter(|(_, c)| Self::has_headroom(c))
                .map(|(i, _)| i),
        );
        if self.eligible.is_empty() {
            // Overload: the request waits for a slot wherever it goes. Recomputing its history
            // elsewhere would also stall a full batch, so the cost (with its slot penalty,
            // which keeps growing past the limit) decides among all workers.
            self.eligible.extend(0..ctx.candidates.len());
        }
        if self.params.spread_fresh_requests
            && let Some(i) = self.next_fresh_worker(ctx)
        {
            return i;
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

    fn observe_reply(&mut self, output_tokens: u32) {
        if !self.params.learn_output_tokens {
            return;
        }
        self.replies += 1;
        let weight = 1.0 / (self.replies as f64 + 1.0).min(REPLY_MEMORY);
        let mean = &mut self.params.expected_output_tokens;
        *mean += weight * (f64::from(output_tokens) - *mean);
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

#[cfg(test)]
mod tests {
    use kv_index::WorkerId;

    use super::*;
    use crate::WorkerLoad;
    use crate::policy::WorkerLimits;

    const BLOCK: u32 = 32;
    /// A conversation's turn: a 3,712-token shared document (116 blocks) plus 2,688 tokens of
    /// its own history and question (84 blocks).
    const DOC_BLOCKS: u32 = 116;
    const PROMPT_BLOCKS: u32 = 200;
    const PROMPT_TOKENS: u64 = PROMPT_BLOCKS as u64 * BLOCK as u64;

    /// A worker of seed 002's fleet (64 seqs, 13,022 blocks, H200 timing) with `in_flight`
    /// requests of `context_per_request` tokens each.
    struct Worker {
        id: u64,
        in_flight: u32,
        context_per_request: u64,
        /// Leading blocks of the request this worker has cached.
        cached: u32,
        /// Leading blocks of the request in use by this worker's in-flight requests.
        active: u32,
    }

    impl Worker {
        fn new(id: u64, in_flight: u32) -> Self {
            Worker {
                id,
                in_flight,
                context_per_request: 6_000,
                cached: 0,
                active: 0,
            }
        }
        fn cached(mut self, blocks: u32) -> Self {
            self.cached = blocks;
            self
        }
        fn active(mut self, blocks: u32) -> Self {
            self.active = blocks;
            self.cached = self.cached.max(blocks);
            self
        }
        fn candidate(&self) -> Candidate {
            let context = u64::from(self.in_flight) * self.context_per_request;
            let active_blocks = context / u64::from(BLOCK) / 2;
            Candidate {
                worker: WorkerId(self.id),
                overlap_blocks: self.cached,
                new_prefill_tokens: PROMPT_TOKENS - u64::from(self.cached) * u64::from(BLOCK),
                potential_active_blocks: active_blocks + u64::from(PROMPT_BLOCKS - self.active),
                load: WorkerLoad {
                    in_flight: self.in_flight,
                    pending_prefill_tokens: 0,
                    awaiting_first_token: 0,
                    active_blocks,
                    context_tokens: context,
                },
                limits: WorkerLimits {
                    max_num_seqs: Some(64),
                    kv_capacity_blocks: Some(13_022),
                    timing: Some(WorkerTiming::H200_LLAMA70B_FP8),
                },
            }
        }
    }

    fn pick(workers: &[Worker]) -> u64 {
        pick_with(KvLoadParams::default(), workers)
    }

    fn pick_with(params: KvLoadParams, workers: &[Worker]) -> u64 {
        let candidates: Vec<Candidate> = workers.iter().map(Worker::candidate).collect();
        choose(&mut KvLoad::new(params), &candidates)
    }

    /// The worker `policy` picks for the test's request among `candidates`.
    fn choose(policy: &mut KvLoad, candidates: &[Candidate]) -> u64 {
        let ctx = SelectionContext {
            prompt_tokens: PROMPT_TOKENS,
            prompt_blocks: PROMPT_BLOCKS,
            block_size: BLOCK,
            candidates,
        };
        let mut rng = PolicyRng::seed_from_u64(7);
        candidates[policy.select(&ctx, &mut rng)].worker.0
    }

    #[test]
    fn a_conversation_stays_with_its_history_on_a_busier_worker() {
        // Worker 1 holds the whole history (idle between turns) and has 8 more requests
        // running than the others: moving would recompute 6,400 tokens while 28 requests wait.
        let workers = [
            Worker::new(1, 28).cached(PROMPT_BLOCKS - 1),
            Worker::new(2, 20).active(DOC_BLOCKS),
            Worker::new(3, 20).active(DOC_BLOCKS),
        ];
        assert_eq!(pick(&workers), 1);
    }

    #[test]
    fn a_turn_leaves_a_wave_of_prefills_for_a_worker_that_is_only_decoding() {
        // Worker 1 holds 160 of the request's 200 blocks, but the 12 requests it runs all
        // came back together and wait for their first token (lock-step clients: equal
        // replies, no think time); worker 2's 12 are decoding. Joining the wave would make
        // this turn and those 12 wait for everyone's prefill; recomputing the history on
        // worker 2 delays each of its decoding requests by one late token.
        let wave = |awaiting: u32| {
            let mut history = Worker::new(1, 12).cached(160).candidate();
            history.load.awaiting_first_token = awaiting;
            history.load.pending_prefill_tokens = u64::from(awaiting) * 40 * u64::from(BLOCK);
            [history, Worker::new(2, 12).candidate()]
        };
        // Each waiting request is charged the whole prefill of this turn's 40 new blocks, each
        // decoding one `decode_stall_weight` of it.
        let params = KvLoadParams::default();
        let ctx = |candidates| SelectionContext {
            prompt_tokens: PROMPT_TOKENS,
            prompt_blocks: PROMPT_BLOCKS,
            block_size: BLOCK,
            candidates,
        };
        let (mut waiting, decoding) = (wave(12), wave(0));
        // The same pending prefill either way, so only the stall differs.
        waiting[0].load.pending_prefill_tokens = 0;
        let extra = KvLoad::cost(&params, &ctx(&waiting), 0, &waiting[0])
            - KvLoad::cost(&params, &ctx(&decoding), 0, &decoding[0]);
        let turn_prefill =
            40.0 * f64::from(BLOCK) * WorkerTiming::H200_LLAMA70B_FP8.prefill_secs_per_token;
        let expected = 12.0 * (1.0 - params.decode_stall_weight) * turn_prefill;
        assert!((extra - expected).abs() < 1e-9, "{extra} vs {expected}");
        let mut policy = KvLoad::new(params);
        assert_eq!(choose(&mut policy, &wave(12)), 2);
        // Without the wave the conversation stays with its history.
        assert_eq!(choose(&mut policy, &wave(0)), 1);
        // Pricing a decoding request's delay like a waiting one's keeps it in the wave.
        let mut flat = KvLoad::new(KvLoadParams {
            decode_stall_weight: 1.0,
            ..KvLoadParams::default()
        });
        assert_eq!(choose(&mut flat, &wave(12)), 1);
    }

    #[test]
    fn spreading_sends_fresh_requests_to_the_workers_in_turn_and_history_home() {
        let params = KvLoadParams {
            spread_fresh_requests: true,
            ..KvLoadParams::default()
        };
        let mut policy = KvLoad::new(params);
        // The same passage cached everywhere, unequal loads: by cost the idle worker 3 would
        // take every fresh request; spread, they go 1, 2, 3, 1.
        let fresh = [
            Worker::new(1, 20).cached(DOC_BLOCKS),
            Worker::new(2, 12).cached(DOC_BLOCKS),
            Worker::new(3, 0).cached(DOC_BLOCKS),
        ];
        let candidates: Vec<Candidate> = fresh.iter().map(Worker::candidate).collect();
        let picks: Vec<u64> = (0..4).map(|_| choose(&mut policy, &candidates)).collect();
        assert_eq!(picks, [1, 2, 3, 1]);
        assert_eq!(pick(&fresh), 3, "without spreading the cost decides");
        // A worker holding the conversation's history keeps it: that request is not fresh.
        let history = [
            Worker::new(1, 20).cached(DOC_BLOCKS),
            Worker::new(2, 24).cached(PROMPT_BLOCKS - 1),
            Worker::new(3, 20).cached(DOC_BLOCKS),
        ];
        let candidates: Vec<Candidate> = history.iter().map(Worker::candidate).collect();
        assert_eq!(choose(&mut policy, &candidates), 2);
    }

    #[test]
    fn a_full_worker_spills_to_one_with_a_free_slot() {
        // The history's worker is at max_num_seqs: the request would queue behind a whole
        // reply there, so it pays the prefill elsewhere.
        let workers = [
            Worker::new(1, 64).cached(PROMPT_BLOCKS - 1),
            Worker::new(2, 60).active(DOC_BLOCKS),
            Worker::new(3, 63),
        ];
        assert_eq!(pick(&workers), 2);
    }

    #[test]
    fn a_worker_out_of_kv_blocks_is_avoided_while_another_has_room() {
        // Same requests and context on both; worker 1 holds the history but its active
        // blocks plus the request's would pass its 13,022-block pool (the engine would
        // preempt), so the request goes to worker 2 although it recomputes everything there.
        let with_history = Worker::new(1, 20).cached(PROMPT_BLOCKS - 1);
        let without = Worker::new(2, 20);
        let mut candidates = [with_history.candidate(), without.candidate()];
        assert!(
            KvLoad::has_headroom(&candidates[0]),
            "within its pool, the history's worker is chosen"
        );
        candidates[0].load.active_blocks = 12_900;
        candidates[0].potential_active_blocks = 12_900 + u64::from(PROMPT_BLOCKS);
        assert!(!KvLoad::has_headroom(&candidates[0]));
        let pick_among = |candidates: &[Candidate]| {
            WorkerId(choose(
                &mut KvLoad::new(KvLoadParams::default()),
                candidates,
            ))
        };
        assert_eq!(pick_among(&candidates), WorkerId(2));
        // With room in its pool the history wins.
        candidates[0].load.active_blocks = 1_000;
        candidates[0].potential_active_blocks = 1_000 + u64::from(PROMPT_BLOCKS);
        assert_eq!(pick_among(&candidates), WorkerId(1));
    }

    #[test]
    fn in_overload_a_conversation_keeps_its_cache_within_reason() {
        // Every worker is at its batch limit: the request waits for a slot anywhere, and
        // recomputing 6,400 tokens elsewhere would stall 64 running requests.
        let workers = [
            Worker::new(1, 66).cached(PROMPT_BLOCKS - 1),
            Worker::new(2, 64),
            Worker::new(3, 65),
        ];
        assert_eq!(pick(&workers), 1);
        // Far past its limit, a worker loses the request to the one with the shortest queue.
        let workers = [
            Worker::new(1, 100).cached(PROMPT_BLOCKS - 1),
            Worker::new(2, 64),
            Worker::new(3, 65),
        ];
        assert_eq!(pick(&workers), 2);
    }

    #[test]
    fn a_shared_document_is_replicated_to_balance_load() {
        // A new conversation on a document only worker 1 holds, and worker 1 is 6 requests
        // busier: computing the document on worker 2 makes a copy later conversations reuse,
        // so its stall is not charged, and the lighter worker wins.
        let workers = [Worker::new(1, 26).active(DOC_BLOCKS), Worker::new(2, 20)];
        assert_eq!(pick(&workers), 2);
        // The same prefix as one conversation's private history (cached, idle) keeps it.
        let workers = [Worker::new(1, 26).cached(DOC_BLOCKS), Worker::new(2, 20)];
        assert_eq!(pick(&workers), 1);
        // Charging replication like private history would keep it on the busy worker too:
        // the behaviour the parameter exists to avoid.
        let params = KvLoadParams {
            replication_stall_weight: 1.0,
            ..KvLoadParams::default()
        };
        let workers = [Worker::new(1, 26).active(DOC_BLOCKS), Worker::new(2, 20)];
        assert_eq!(pick_with(params, &workers), 1);
    }

    #[test]
    fn new_conversations_go_where_decode_is_cheapest() {
        // Same cache everywhere, same request counts: the worker whose running requests have
        // the least context decodes fastest.
        let mut long = Worker::new(1, 20).active(DOC_BLOCKS);
        long.context_per_request = 9_000;
        let mut short = Worker::new(2, 20).active(DOC_BLOCKS);
        short.context_per_request = 4_000;
        let workers = [long, short];
        assert_eq!(pick(&workers), 2);
    }

    #[test]
    fn equal_costs_go_to_the_fewest_in_flight() {
        let idle = |id| Worker {
            context_per_request: 0,
            ..Worker::new(id, 0)
        };
        let mut busy = idle(1);
        busy.in_flight = 3;
        // Requests with no context yet (all prefilling) cost the same decode everywhere.
        assert_eq!(pick(&[busy, idle(2)]), 2);
    }

    /// The cost of the request on an idle worker that caches none of it, with no decode
    /// horizon and no slot penalty, the other parameters as `params` sets them.
    fn cost_alone(params: KvLoadParams) -> f64 {
        let params = KvLoadParams {
            expected_output_tokens: 0.0,
            slot_soft_limit: 1.0,
            ..params
        };
        let idle = Worker {
            context_per_request: 0,
            ..Worker::new(1, 0)
        };
        let candidates = [idle.candidate()];
        let ctx = SelectionContext {
            prompt_tokens: PROMPT_TOKENS,
            prompt_blocks: PROMPT_BLOCKS,
            block_size: BLOCK,
            candidates: &candidates,
        };
        KvLoad::cost(&params, &ctx, 0, &candidates[0])
    }

    #[test]
    fn cost_is_in_seconds_from_the_worker_timing() {
        // Nothing running, nothing cached: the cost is the request's own prefill time.
        let cost = cost_alone(KvLoadParams::default());
        let expected =
            PROMPT_TOKENS as f64 * WorkerTiming::H200_LLAMA70B_FP8.prefill_secs_per_token;
        assert!((cost - expected).abs() < 1e-9, "{cost} vs {expected}");
        assert!(
            (0.8..1.0).contains(&cost),
            "6,400 tokens take about 0.9 s: {cost}"
        );
    }

    #[test]
    fn the_prefill_load_factor_scales_the_prefill_by_the_kv_share_in_use() {
        let params = |factor| KvLoadParams {
            prefill_load_factor: factor,
            ..KvLoadParams::default()
        };
        let off = cost_alone(params(0.0));
        let on = cost_alone(params(2.0));
        // The request alone would use 200 of the worker's 13,022 blocks.
        let share = f64::from(PROMPT_BLOCKS) / 13_022.0;
        assert!(
            (on - off * (1.0 + 2.0 * share)).abs() < 1e-12,
            "{on} vs {off}"
        );
        // At λ = 1 a conversation still stays with its history on a busy worker: the load
        // multiplies a prefill of 50 blocks there, against 200 elsewhere.
        let workers = [Worker::new(1, 40).active(150), Worker::new(2, 2)];
        let prefill_only = KvLoadParams {
            expected_output_tokens: 0.0,
            slot_soft_limit: 1.0,
            ..params(1.0)
        };
        assert_eq!(pick_with(prefill_only, &workers), 1);
        assert!(params(-1.0).validate().is_err());
    }

    /// Two workers that cache nothing of the request: `queued` has prefill waiting but little
    /// context, `decoding` has no queue but four times the context.
    fn queue_or_decode() -> [Candidate; 2] {
        let candidate = |id, pending, in_flight, context| {
            let mut c = Worker::new(id, in_flight).candidate();
            c.load.pending_prefill_tokens = pending;
            c.load.context_tokens = context;
            c
        };
        [candidate(1, 4_000, 10, 20_000), candidate(2, 0, 10, 80_000)]
    }

    #[test]
    fn learned_short_replies_weigh_queued_prefill_over_decode() {
        let candidates = queue_or_decode();
        let learning = KvLoadParams {
            expected_output_tokens: 512.0,
            learn_output_tokens: true,
            ..KvLoadParams::default()
        };
        let mut policy = KvLoad::new(learning);
        // Priced with 512-token replies, decoding beside 80k tokens of context costs more than
        // waiting behind 4,000 tokens of prefill.
        assert_eq!(choose(&mut policy, &candidates), 1);
        // The first reply counts as much as the configured value; later ones follow a
        // moving mean.
        policy.observe_reply(150);
        assert!((policy.expected_output_tokens() - 331.0).abs() < 1e-9);
        for _ in 0..500 {
            policy.observe_reply(20);
        }
        assert!((policy.expected_output_tokens() - 20.0).abs() < 0.5);
        // With 20-token replies the queue is the larger cost.
        assert_eq!(choose(&mut policy, &candidates), 2);
    }

    #[test]
    fn reply_lengths_are_ignored_unless_learning_is_on() {
        let mut policy = KvLoad::new(KvLoadParams {
            expected_output_tokens: 512.0,
            ..KvLoadParams::default()
        });
        for _ in 0..500 {
            policy.observe_reply(20);
        }
        assert_eq!(policy.expected_output_tokens(), 512.0);
        assert_eq!(choose(&mut policy, &queue_or_decode()), 1);
    }
}
