//! The engine's inputs, outputs and settings.

use std::sync::Arc;

use kv_index::KvEvent;
use nanotime::Nanos;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::profile::{HardwareProfile, KvLink};
use crate::spec::{SpecDecodeConfig, SpecMethod};

/// A request's id, unique among the requests a worker holds at once; the router's type too.
pub use kv_index::RequestId;

/// What a request generates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OutputSpec {
    /// Generate exactly these token ids (the workload decides the answer, so the next turn's
    /// prompt, which contains it, hits the blocks cached during decode).
    Tokens(Arc<[u32]>),
    /// Generate this many deterministic pseudo tokens ([`pseudo_token`]).
    Count(u32),
}

impl OutputSpec {
    /// Number of output tokens.
    pub fn len(&self) -> u32 {
        match self {
            OutputSpec::Tokens(t) => u32::try_from(t.len()).unwrap_or(u32::MAX),
            OutputSpec::Count(n) => *n,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The pseudo token an [`OutputSpec::Count`] request produces at output index `index`: a
/// deterministic mix of the request id and the index, in a 128k-entry vocabulary.
pub fn pseudo_token(id: RequestId, index: u32) -> u32 {
    let mut z =
        id.0.wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .wrapping_add(u64::from(index).wrapping_mul(0xBF58_476D_1CE4_E5B9))
            .wrapping_add(0x94D0_49BB_1331_11EB);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z % 128_000) as u32
}

/// One inference request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineRequest {
    pub id: RequestId,
    /// Prompt token ids (after the chat template).
    pub prompt: Arc<[u32]>,
    pub output: OutputSpec,
    /// Which part of serving the request runs on this worker.
    pub leg: Leg,
}

/// The part of a request a worker serves. Disaggregated serving splits a request into a
/// prefill leg (on a prefill worker) and a decode leg (on a decode worker, after the KV
/// transfer); under conditional disaggregation a decode worker serves the whole request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Leg {
    /// What the worker's [`Role`] does: aggregated → whole, prefill-only → prefill,
    /// decode-only → decode.
    #[default]
    ByRole,
    /// Prefill and decode here.
    Whole,
    /// Compute the prompt, produce output index 0, emit [`EngineEvent::PrefillDone`].
    Prefill,
    /// Receive the prompt's KV (minus what is cached here) over the worker's link, then
    /// decode from output index 1.
    Decode,
}

impl Leg {
    /// The leg this request runs as on a worker of `role`, or `None` when the role does not
    /// serve it: a prefill worker serves only prefills; a decode worker decodes and, for
    /// conditional disaggregation, serves whole requests; an aggregated worker serves all
    /// three (vLLM's `kv_both`).
    pub fn on(self, role: Role) -> Option<Leg> {
        match (self, role) {
            (Leg::ByRole, Role::Aggregated) => Some(Leg::Whole),
            (Leg::ByRole, Role::PrefillOnly) => Some(Leg::Prefill),
            (Leg::ByRole, Role::DecodeOnly) => Some(Leg::Decode),
            (Leg::Whole | Leg::Decode, Role::PrefillOnly) => None,
            (Leg::Prefill, Role::DecodeOnly) => None,
            (leg, _) => Some(leg),
        }
    }
}

impl EngineRequest {
    /// The token id at output index `index` (`None` past the end).
    pub fn output_token(&self, index: u32) -> Option<u32> {
        match &self.output {
            OutputSpec::Tokens(t) => t.get(index as usize).copied(),
            OutputSpec::Count(n) => (index < *n).then(|| pseudo_token(self.id, index)),
        }
    }
}

/// Why a request was refused at submission.
#[derive(Debug, Clone, PartialEq, Eq, Error, Serialize, Deserialize)]
pub enum RejectReason {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("the request asks for no output tokens")]
    NoOutput,
    #[error("prompt + output = {tokens} tokens exceeds the model's context of {max}")]
    ContextTooLong { tokens: u64, max: u32 },
    #[error("the request needs {blocks} KV blocks but the pool holds {capacity}")]
    TooLargeForPool { blocks: u64, capacity: u32 },
    #[error("a request with this id is already in the engine")]
    DuplicateId,
    #[error("the waiting queue is full ({max} requests)")]
    QueueFull { max: u32 },
    #[error("a {role:?} worker does not serve the {leg:?} leg of a request")]
    LegNotServed { role: Role, leg: Leg },
}

/// What the engine reports, drained in order by [`crate::Engine::poll_event`].
#[derive(Debug, Clone, PartialEq)]
pub enum EngineEvent {
    /// The request's first output token (index 0) was produced at `at`. A `Tokens` event
    /// covering index 0 follows.
    FirstToken { id: RequestId, at: Nanos },
    /// Output tokens with indices `start..end` were produced; the last of them at `at`. One
    /// event per request per step, or per stretch in speed mode.
    Tokens {
        id: RequestId,
        start: u32,
        end: u32,
        at: Nanos,
    },
    /// The request produced its last token and left the engine.
    Finished {
        id: RequestId,
        at: Nanos,
        prompt_tokens: u32,
        /// Prompt tokens found in the prefix cache when the request was first scheduled.
        cached_prompt_tokens: u32,
        output_tokens: u32,
        preemptions: u32,
    },
    /// A prefill leg ended: the prompt's KV is ready for a decode worker and the first token
    /// (index 0) was produced. The request has left this worker; its blocks stay cached.
    PrefillDone {
        id: RequestId,
        at: Nanos,
        prompt_tokens: u32,
        cached_prompt_tokens: u32,
    },
    /// The request was cancelled and has left the engine.
    Cancelled { id: RequestId, at: Nanos },
    /// The request was refused at submission and never entered the engine.
    Rejected { id: RequestId, reason: RejectReason },
    /// A change to the prefix cache, in `kv-index`'s types.
    Kv(KvEvent),
}

/// A decode leg's KV transfer the driver times ([`EngineConfig::external_kv_transfers`]):
/// admitted at `at`, `tokens` of the prompt (what this worker does not hold) to receive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransferStart {
    pub id: RequestId,
    pub tokens: u64,
    /// `tokens` × the profile's KV bytes per token.
    pub bytes: u64,
    pub at: Nanos,
}

/// What this worker does with a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Prefill and decode (the seeds' demo).
    #[default]
    Aggregated,
    /// Prefill, produce the first token, emit `PrefillDone`, keep the blocks cached.
    PrefillOnly,
    /// Receive the prompt's KV from a prefill worker (after a transfer), then decode from
    /// output index 1 (index 0 came from the prefill worker).
    DecodeOnly,
}

/// A worker's settings. Defaults are seed 002's (`max_num_seqs` 64, 16,384 batched tokens,
/// block size 32, `free_gpu_memory_fraction` 0.90).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EngineConfig {
    pub profile: HardwareProfile,
    #[serde(default = "defaults::block_size")]
    pub block_size: u32,
    #[serde(default = "defaults::max_num_seqs")]
    pub max_num_seqs: u32,
    #[serde(default = "defaults::max_num_batched_tokens")]
    pub max_num_batched_tokens: u32,
    #[serde(default)]
    pub role: Role,
    #[serde(default)]
    pub spec_decode: Option<SpecDecodeConfig>,
    #[serde(default = "defaults::free_gpu_memory_fraction")]
    pub free_gpu_memory_fraction: f64,
    /// Pool size in blocks, instead of the memory arithmetic.
    #[serde(default)]
    pub num_gpu_blocks_override: Option<u32>,
    /// Link used to receive KV in the decode-only role.
    #[serde(default)]
    pub kv_link: KvLink,
    /// Decode-only role: the driver times KV transfers (links shared with other workers'
    /// transfers, as the simulator's `LinkShare`) instead of the engine's own
    /// `kv_transfer_time`: an admitted decode leg is announced by
    /// [`crate::Engine::poll_transfer_start`] and waits for [`crate::Engine::kv_arrived`].
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub external_kv_transfers: bool,
    /// Reuse cached prompt prefixes (vLLM `enable_prefix_caching`).
    #[serde(default = "defaults::yes")]
    pub enable_prefix_caching: bool,
    /// Speed mode: advance runs of identical decode-only steps as one stretch.
    #[serde(default)]
    pub coalesce_decode: bool,
    /// Most requests waiting for admission; later submissions are rejected.
    #[serde(default = "defaults::max_waiting")]
    pub max_waiting: u32,
    /// Seed of the speculative-decoding acceptance sampler.
    #[serde(default)]
    pub seed: u64,
    /// `Stored` events carry each block's token ids, as vLLM's `BlockStored` does, so a
    /// publisher forwards them as they are; otherwise only local hashes (enough for an
    /// in-process router, and cheaper in the simulator).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub kv_event_tokens: bool,
    /// Every step takes this many times the profile's step time (1: as the profile says).
    /// Models a degraded GPU (throttled, a bad link) that still declares the profile's
    /// timing: the simulator's `slow-worker` fault sets 2 (half speed).
    #[serde(default = "defaults::one", skip_serializing_if = "defaults::is_one")]
    pub slowdown: f64,
}

mod defaults {
    pub fn block_size() -> u32 {
        32
    }
    pub fn max_num_seqs() -> u32 {
        64
    }
    pub fn max_num_batched_tokens() -> u32 {
        16_384
    }
    pub fn free_gpu_memory_fraction() -> f64 {
        0.90
    }
    pub fn yes() -> bool {
        true
    }
    pub fn max_waiting() -> u32 {
        65_536
    }
    pub fn one() -> f64 {
        1.0
    }
    pub fn is_one(x: &f64) -> bool {
        *x == 1.0
    }
}

impl EngineConfig {
    /// Seed 002's settings on `profile`, ignoring the profile's own engine defaults.
    pub fn new(profile: HardwareProfile) -> Self {
        EngineConfig {
            profile,
            block_size: defaults::block_size(),
            max_num_seqs: defaults::max_num_seqs(),
            max_num_batched_tokens: defaults::max_num_batched_tokens(),
            role: Role::Aggregated,
            spec_decode: None,
            free_gpu_memory_fraction: defaults::free_gpu_memory_fraction(),
            num_gpu_blocks_override: None,
            kv_link: KvLink::Nvlink,
            external_kv_transfers: false,
            enable_prefix_caching: true,
            coalesce_decode: false,
            max_waiting: defaults::max_waiting(),
            seed: 0,
            kv_event_tokens: false,
            slowdown: 1.0,
        }
    }

    /// Seed 002's settings overridden by the profile's `engine_defaults` (the Dynamo mocker
    /// profile brings its 64-token blocks, 16,384-block pool, 256 sequences, 8,192 tokens).
    pub fn from_profile(profile: HardwareProfile) -> Self {
        let d = profile.engine_defaults.clone();
        let c = Self::new(profile);
        EngineConfig {
            block_size: d.block_size.unwrap_or(c.block_size),
            max_num_seqs: d.max_num_seqs.unwrap_or(c.max_num_seqs),
            max_num_batched_tokens: d.max_num_batched_tokens.unwrap_or(c.max_num_batched_tokens),
            num_gpu_blocks_override: d.num_gpu_blocks,
            ..c
        }
    }

    /// Seed 002's worker: `h200-llama70b-fp8` with the seed's settings.
    pub fn seed_002() -> Self {
        Self::new(HardwareProfile::h200_llama70b_fp8())
    }
}

/// A configuration the engine cannot run.
#[derive(Debug, Error)]
pub enum EngineConfigError {
    #[error("block_size must be at least 1")]
    ZeroBlockSize,
    #[error("max_num_seqs must be at least 1")]
    ZeroMaxNumSeqs,
    #[error("max_num_batched_tokens must be at least 1")]
    ZeroBatchedTokens,
    #[error("free_gpu_memory_fraction must be in (0, 1], got {0}")]
    BadMemoryFraction(f64),
    #[error("slowdown must be a finite number ≥ 1 (2 is half speed), got {0}")]
    BadSlowdown(f64),
    #[error(
        "the KV pool has no blocks: profile {profile:?} leaves no memory for the cache (set num_gpu_blocks_override or fix the memory fields)"
    )]
    NoKvCapacity { profile: String },
    #[error("speculative decoding: {0}")]
    BadSpecDecode(String),
    #[error(transparent)]
    Profile(#[from] crate::profile::ProfileError),
}

/// A snapshot of a worker's state and cumulative counters ([`crate::Engine::metrics`]).
///
/// Counters are cumulative since the engine was created; a driver derives rates and ratios
/// over a window from two snapshots (e.g. GPU utilisation = Δ`busy_time` / Δwall time).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct EngineMetrics {
    /// Requests in the running batch.
    pub running: u32,
    /// Requests waiting for admission (including preempted ones).
    pub waiting: u32,
    /// Decode-only role: requests whose KV is on its way.
    pub transferring: u32,
    /// Pool size in blocks.
    pub kv_blocks_total: u32,
    /// Blocks referenced by requests.
    pub kv_blocks_used: u32,
    /// Blocks in the prefix cache (referenced or not).
    pub kv_blocks_cached: u32,
    /// `kv_blocks_used / kv_blocks_total`.
    pub kv_usage: f64,
    /// Prompt tokens of requests when first scheduled.
    pub prompt_tokens: u64,
    /// Of those, tokens found in the prefix cache.
    pub prefix_hit_tokens: u64,
    /// Prompt tokens computed (prefill chunks, including recomputation after preemption).
    pub prefill_tokens_computed: u64,
    /// Output tokens produced.
    pub tokens_generated: u64,
    /// Completed steps.
    pub steps: u64,
    /// Simulated time the GPU spent in completed steps.
    pub busy_time: Nanos,
    /// Sequence-steps of decoding (one per decoding sequence per step).
    pub decode_seq_steps: u64,
    /// Tokens those decode sequence-steps produced.
    pub decode_tokens_generated: u64,
    /// Speculative decoding: the method, when on.
    pub spec_method: Option<SpecMethod>,
    /// Drafts proposed: one per decoding sequence per step (vLLM's `num_drafts`).
    pub spec_drafts: u64,
    /// Draft tokens proposed and accepted.
    pub spec_draft_tokens: u64,
    pub spec_accepted_tokens: u64,
    /// Per draft position `j`: drafts whose token `j` was accepted (vLLM's
    /// `num_accepted_tokens_per_pos`; non-increasing in `j`).
    pub spec_accepted_per_pos: Vec<u64>,
    /// Simulated time spent in draft passes (within `busy_time`).
    pub spec_draft_time: Nanos,
    pub preemptions: u64,
    pub finished: u64,
    pub cancelled: u64,
    pub rejected: u64,
    /// Weights (and drafter) resident on the GPU.
    pub weight_bytes: u64,
    /// KV bytes of the blocks in use.
    pub kv_used_bytes: u64,
    /// `weight_bytes + kv_used_bytes`.
    pub memory_used_bytes: u64,
    /// Device memory.
    pub gpu_memory_bytes: u64,
}

impl EngineMetrics {
    /// Prefix cache hit rate over prompt tokens (0 before any request).
    pub fn prefix_hit_rate(&self) -> f64 {
        ratio(self.prefix_hit_tokens, self.prompt_tokens)
    }

    /// Observed per-token acceptance probability α: accepted draft tokens over the draft
    /// positions the target evaluated (a position after a rejection is never evaluated). The
    /// estimate of the α in `(1 − α^(K+1)) / (1 − α)`, and the "acceptance rate" seed 003
    /// quotes (55–70% for a draft model, 70–85% for EAGLE-3). 0 before any draft.
    pub fn acceptance_rate(&self) -> f64 {
        // Position 0 is evaluated in every draft, position j > 0 when j − 1 was accepted.
        let k = self.spec_accepted_per_pos.len();
        let evaluated = self.spec_drafts
            + self
                .spec_accepted_per_pos
                .iter()
                .take(k.saturating_sub(1))
                .sum::<u64>();
        ratio(self.spec_accepted_tokens, evaluated)
    }

    /// vLLM's draft acceptance rate: accepted / proposed draft tokens (lower than
    /// [`EngineMetrics::acceptance_rate`]: every rejection also wastes the drafts after it).
    pub fn draft_acceptance_rate(&self) -> f64 {
        ratio(self.spec_accepted_tokens, self.spec_draft_tokens)
    }

    /// TensorRT-LLM's acceptance length: tokens per speculative step, bonus token included,
    /// `1 + accepted / drafts` (0 before any draft).
    pub fn acceptance_length(&self) -> f64 {
        if self.spec_drafts == 0 {
            0.0
        } else {
            1.0 + ratio(self.spec_accepted_tokens, self.spec_drafts)
        }
    }

    /// Observed tokens per decode step per sequence (1.0 without speculation).
    pub fn tokens_per_step(&self) -> f64 {
        ratio(self.decode_tokens_generated, self.decode_seq_steps)
    }

    /// TensorRT-LLM's draft overhead: the share of busy time spent in draft passes.
    pub fn draft_overhead(&self) -> f64 {
        ratio(self.spec_draft_time.0, self.busy_time.0)
    }

    /// GPU utilisation between `earlier` and this snapshot, `wall` apart.
    pub fn utilisation_since(&self, earlier: &EngineMetrics, wall: Nanos) -> f64 {
        ratio(self.busy_time.saturating_sub(earlier.busy_time).0, wall.0).min(1.0)
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 { 0.0 } else { a as f64 / b as f64 }
}
