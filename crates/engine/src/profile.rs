//! Hardware profiles: what a GPU + model pair costs per step, as data.
//!
//! A [`HardwareProfile`] names a GPU and a model, gives the memory arithmetic that sizes the KV
//! block pool, the bandwidths that price a disaggregated KV transfer, and a [`TimingModel`] that
//! turns the shape of one scheduler step ([`StepShape`]) into its duration
//! ([`HardwareProfile::step_time`], a pure function).
//!
//! Profiles are plain serde data: load one from TOML or JSON ([`HardwareProfile::from_toml_str`],
//! [`HardwareProfile::from_json_str`]) to add a GPU without code, or take a built-in
//! ([`HardwareProfile::builtin`]).
//!
//! # Memory → KV capacity
//!
//! `free_gpu_memory_fraction` has TensorRT-LLM's meaning (the seed's workers run TRT-LLM): the
//! fraction of the memory left **after** weights and activations that goes to the KV cache.
//!
//! ```text
//! kv_pool_bytes  = floor((G·gpu_memory − weights − draft_weights − G·activation_reserve) × fraction)
//! capacity       = floor(kv_pool_bytes / ((kv_bytes_per_token + draft_kv_bytes_per_token) × block_size))
//! ```
//!
//! `G` is the worker's GPU count (its tensor-parallel size, 1 by default): weights and KV heads
//! are split over the GPUs, so the pool is the sum of what each GPU has left. A speculative
//! drafter's weights and its own KV per token come out of the same memory.
//!
//! KV bytes per token = layers × kv_heads × head_dim × 2 (K and V) × bytes per element. For
//! Llama-3.1-70B (80 layers, 8 KV heads, head dim 128) with an FP8 cache:
//! 80 × 8 × 128 × 2 × 1 = 163,840 B/token, so a 32-token block is 5,242,880 B.
//!
//! # Roofline timing
//!
//! One step is one fused forward pass over every scheduled token. Its time is modelled as a sum
//! over the kernel families it runs, each priced by its own bottleneck:
//!
//! ```text
//! tokens     = prefill_tokens + decode_tokens
//! t_linear   = max(2·params·tokens / (peak_flops·flops_eff),          (GEMMs: compute …
//!                  weight_bytes / (mem_bw·weight_read_eff))           …or one weight read)
//! t_attn_pf  = attn_flops_per_pair · prefill_attention_pairs / (peak_flops·flops_eff)
//! t_kv_read  = kv_bytes_per_token · decode_context_tokens / (mem_bw·kv_read_eff)
//! t_allreduce = 2·layers·(latency + 2(G−1)/G · tokens·hidden·act_bytes / bus_bw)  (G > 1)
//! t_draft    = see below                                               (speculative decoding)
//! step       = overhead + t_linear + t_attn_pf + t_kv_read + t_allreduce + t_draft
//! ```
//!
//! With tensor parallelism over `G` GPUs (seed 003: Llama-70B at TP=4), every GPU holds 1/G of
//! the weights and KV heads and does 1/G of the FLOPs, so `peak_flops` and the bandwidths above
//! are multiplied by `G`; in exchange each layer ends its attention and its MLP with an
//! all-reduce of the step's activations over NVLink (Megatron-style TP), priced with NCCL's bus
//! bandwidth and a fixed latency per collective. At decode batch sizes the latency term
//! dominates: 160 all-reduces per step for an 80-layer model.
//!
//! Speculative decoding ([`crate::SpecDecodeConfig`]) adds, priced the same way from the
//! drafter's size ([`crate::spec::Drafter`]):
//!
//! ```text
//! t_draft_pass = pass_overhead + max(2·P_d·n / F, W_d / BW_w) + kv_d·decode_context / BW_kv
//!                + t_allreduce(layers_d, n)
//! t_draft      = Σ over the step's draft passes (n = prefill tokens + decoding sequences on
//!                the first pass, the decoding sequences on the K − 1 others)
//! ```
//!
//! while the target's verification pass is the ordinary formula with K + 1 tokens per
//! decoding sequence. A configured `draft_cost_ratio` replaces `t_draft` by
//! `draft_passes · ratio · t_decode_only` (the Dynamo mocker always does this).
//!
//! Why a sum and not `max(prefill, decode)`: vLLM and TRT-LLM run prefill chunks and decodes in
//! one forward pass, so the weights are read once for both (hence the `max` *inside* the linear
//! layers: a decode-only batch is weight-bandwidth bound, a batch with a large prefill chunk is
//! compute bound), but the attention kernels for prefill (compute bound) and for decode (KV-read
//! bound) run one after another and do not overlap. Summing them is what makes decode ITL rise
//! when a prefill chunk rides along, which is the effect routing comparisons depend on.
//!
//! Attention FLOPs per (query, key) pair = 4 × layers × heads × head_dim (QKᵀ and PV, 2 FLOPs a
//! multiply-add); a chunk of `n` new tokens after `c` computed ones has `n·c + n(n+1)/2` pairs.
//!
//! # Dynamo mocker timing
//!
//! [`TimingModel::DynamoMocker`] reproduces NVIDIA Dynamo 1.6.1's mocker so its users can compare
//! like with like (`T` = new prefill tokens in the step, `p` = fraction of the KV pool held by
//! the step's decoding sequences):
//!
//! ```text
//! prefill_ms = 4.209989e-07·T² + 1.518344e-02·T + 16.50142        (only when T > 0)
//! decode_ms  = max(1, −25.74·p² + 54.01·p + 5.74)                   (only when decoding)
//! step_ms    = prefill_ms + decode_ms
//! ```

use std::collections::BTreeMap;

use nanotime::Nanos;
use serde::{Deserialize, Serialize};
use thiserror::Error;
use worker_limits::WorkerTiming;

use crate::spec::{Drafter, SpecDecodeConfig};

/// How a decode worker receives KV from a prefill worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KvLink {
    /// Same node, GPU to GPU (seed 004's production: one 8×H200 node).
    #[default]
    Nvlink,
    /// Across nodes (seed 004's dev environment: three single-GPU H100 nodes).
    Network,
}

/// Bandwidths and latency of a KV cache transfer between workers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KvTransferProfile {
    /// NVLink bandwidth, bytes per second, one direction.
    pub nvlink_bytes_per_sec: f64,
    /// Network bandwidth between nodes, bytes per second.
    pub network_bytes_per_sec: f64,
    /// Fixed cost of one transfer (handshake, descriptor exchange), nanoseconds.
    pub latency_ns: u64,
}

/// Parameters of the roofline step-time model (see the module docs for the formula).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RooflineTiming {
    /// Peak memory bandwidth, bytes per second (H200: 4.8e12).
    pub memory_bandwidth_bytes_per_sec: f64,
    /// Fraction of peak bandwidth achieved while streaming weights (large sequential reads).
    pub weight_read_efficiency: f64,
    /// Fraction of peak bandwidth achieved by decode attention reading paged KV (small,
    /// scattered blocks; much lower than a weight stream).
    pub kv_read_efficiency: f64,
    /// Peak dense FLOP/s at the model's GEMM precision (H200 FP8: 1.979e15).
    pub peak_flops: f64,
    /// Fraction of peak FLOP/s achieved by prefill GEMMs and attention.
    pub flops_efficiency: f64,
    /// Parameters of the model; a token costs 2·params FLOPs in the linear layers.
    pub params: f64,
    /// FLOPs per (query token, context token) pair: 4 × layers × heads × head_dim.
    pub attention_flops_per_pair: f64,
    /// Fixed cost of one step (scheduling, kernel launches, sampling), nanoseconds.
    pub step_overhead_ns: u64,
}

/// Parameters of Dynamo 1.6.1's mocker polynomials (see the module docs).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DynamoMockerTiming {
    /// `[a, b, c]` in `prefill_ms = a·T² + b·T + c`, T = new prefill tokens in the step.
    pub prefill_ms_coefficients: [f64; 3],
    /// `[a, b, c]` in `decode_ms = a·p² + b·p + c`, p = decoding sequences' share of the pool.
    pub decode_ms_coefficients: [f64; 3],
    /// Lower bound of `decode_ms`.
    pub min_decode_ms: f64,
}

/// How a step's shape becomes a duration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum TimingModel {
    /// Physical model: compute-bound prefill, bandwidth-bound decode.
    Roofline(RooflineTiming),
    /// Dynamo 1.6.1 mocker polynomials.
    DynamoMocker(DynamoMockerTiming),
}

/// One worker spanning several GPUs with tensor parallelism (Megatron-style: column- then
/// row-parallel layers, an all-reduce after each layer's attention and after its MLP).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TensorParallel {
    /// GPUs per worker (TP size).
    pub size: u32,
    /// Transformer layers of the model: two all-reduces each per forward pass.
    pub layers: u32,
    /// Hidden size: an all-reduce moves `tokens × hidden_size × activation_bytes` bytes.
    pub hidden_size: u32,
    /// Bytes per activation element (2: BF16 activations, also under FP8 weights).
    pub activation_bytes: u32,
    /// Fixed cost of one all-reduce (launch, synchronisation across GPUs), nanoseconds.
    pub allreduce_latency_ns: u64,
    /// NCCL's bus bandwidth of an all-reduce, bytes per second: a message of `b` bytes takes
    /// `2(G−1)/G · b / bus_bw`.
    pub allreduce_bytes_per_sec: f64,
}

/// Engine settings a profile recommends; [`crate::EngineConfig::from_profile`] applies them.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct EngineDefaults {
    pub block_size: Option<u32>,
    pub max_num_seqs: Option<u32>,
    pub max_num_batched_tokens: Option<u32>,
    /// A fixed pool size instead of the memory arithmetic (the Dynamo mocker has no memory).
    pub num_gpu_blocks: Option<u32>,
}

/// One GPU running one model: memory, bandwidths and timing, as data.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HardwareProfile {
    /// Profile name (`h200-llama70b-fp8`).
    pub name: String,
    /// GPU, for people (`NVIDIA H200 SXM 141GB`).
    pub gpu: String,
    /// Model, for people.
    pub model: String,
    /// Device memory in bytes, as the driver reports it.
    pub gpu_memory_bytes: u64,
    /// Bytes of model weights resident on the GPU.
    pub weight_bytes: u64,
    /// Memory kept for activations, workspaces, CUDA graphs and the runtime.
    pub activation_reserve_bytes: u64,
    /// KV cache bytes per token (all layers, K and V).
    pub kv_bytes_per_token: u64,
    /// Longest prompt + output the model accepts.
    pub max_context_tokens: u32,
    /// KV transfer bandwidths for disaggregated serving.
    pub kv_transfer: KvTransferProfile,
    /// Step-time model.
    pub timing: TimingModel,
    /// Engine settings this profile is meant to run with (optional).
    #[serde(default)]
    pub engine_defaults: EngineDefaults,
    /// Tensor parallelism: one worker spans `size` GPUs of this kind (`None`: one GPU).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tensor_parallel: Option<TensorParallel>,
    /// Named speculative-decoding configurations for this model (`--spec-decode NAME`):
    /// `draft` and `eagle3` on the Llama-70B profiles.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub speculative: BTreeMap<String, SpecDecodeConfig>,
}

/// A speculative decoder as the marginal timing prices it (the engine's resolved settings).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Speculation {
    /// Draft length K: draft passes per step, K + 1 tokens verified per sequence.
    pub draft_passes: u32,
    /// Priced from its size, or `None` to price each pass as `draft_cost_ratio` of a step.
    pub drafter: Option<Drafter>,
    pub draft_cost_ratio: f64,
    /// Tokens a sequence gains per step on average, E = (1 − α^(K+1)) / (1 − α).
    pub tokens_per_step: f64,
}

/// What one scheduler step computes; the input of [`HardwareProfile::step_time`].
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepShape {
    /// New prompt tokens computed (prefill chunks, including recomputation after preemption).
    pub prefill_tokens: u64,
    /// Σ over prefill chunks of (query, key) pairs: `n·c + n(n+1)/2`.
    pub prefill_attention_pairs: u64,
    /// Sequences decoding in this step.
    pub decode_seqs: u64,
    /// Tokens fed to the target model by decoding sequences (1 each, 1 + K with speculation).
    pub decode_tokens: u64,
    /// Σ over decoding sequences of the context each one's attention reads.
    pub decode_context_tokens: u64,
    /// KV blocks held by decoding sequences (the Dynamo mocker's `p` numerator).
    pub decode_kv_blocks: u64,
    /// Size of the KV pool in blocks (the Dynamo mocker's `p` denominator).
    pub kv_pool_blocks: u64,
    /// Draft forward passes in this step (speculative decoding draft length K, or 0).
    pub draft_passes: u32,
    /// With a drafter, what its passes cost is priced from its size (see the module docs);
    /// without one, each pass costs `draft_cost_ratio` of a plain decode step.
    pub drafter: Option<Drafter>,
    /// Cost of one draft pass as a fraction of a plain (one token per sequence) decode step,
    /// when `drafter` is `None`.
    pub draft_cost_ratio: f64,
}

/// A profile that cannot be loaded or does not make sense.
impl StepShape {
    /// One prefill chunk of `tokens` new tokens after `context` tokens already in the KV
    /// cache (a cached prefix or earlier chunks).
    pub fn prefill(tokens: u64, context: u64) -> Self {
        Self {
            prefill_tokens: tokens,
            prefill_attention_pairs: tokens
                .saturating_mul(context)
                .saturating_add(tokens.saturating_mul(tokens + 1) / 2),
            ..Self::default()
        }
    }

    /// A plain decode step (one token each) of `seqs` sequences with `context` tokens each,
    /// in a pool of `pool_blocks` blocks of `block_size` tokens.
    pub fn decode(seqs: u64, context: u64, block_size: u32, pool_blocks: u64) -> Self {
        Self {
            decode_seqs: seqs,
            decode_tokens: seqs,
            decode_context_tokens: seqs.saturating_mul(context),
            decode_kv_blocks: seqs.saturating_mul(context.div_ceil(u64::from(block_size.max(1)))),
            kv_pool_blocks: pool_blocks,
            ..Self::default()
        }
    }
}

#[derive(Debug, Error)]
pub enum ProfileError {
    #[error("unknown hardware profile {name:?}; built-in profiles: {known}")]
    UnknownBuiltin { name: String, known: String },
    #[error("invalid profile TOML: {0}")]
    Toml(#[from] toml::de::Error),
    #[error("cannot write profile as TOML: {0}")]
    TomlWrite(#[from] toml::ser::Error),
    #[error("invalid profile JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("profile {profile:?}: field `{field}` {reason}")]
    Invalid {
        profile: String,
        field: &'static str,
        reason: &'static str,
    },
}

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// The named speculative configurations of the Llama-70B profiles (seed 003's phases 3a, 3b).
fn seed_003_speculative() -> BTreeMap<String, SpecDecodeConfig> {
    BTreeMap::from([
        ("draft".to_string(), SpecDecodeConfig::seed_003_draft()),
        ("eagle3".to_string(), SpecDecodeConfig::seed_003_eagle3()),
    ])
}

impl HardwareProfile {
    /// Names of the built-in profiles.
    pub fn builtin_names() -> &'static [&'static str] {
        &[
            "h200-llama70b-fp8",
            "h100-tp4-llama70b-fp8",
            "h100-llama8b",
            "dynamo-mocker",
        ]
    }

    /// A built-in profile by name.
    pub fn builtin(name: &str) -> Result<HardwareProfile, ProfileError> {
        match name {
            "h200-llama70b-fp8" => Ok(Self::h200_llama70b_fp8()),
            "h100-tp4-llama70b-fp8" => Ok(Self::h100_tp4_llama70b_fp8()),
            "h100-llama8b" => Ok(Self::h100_llama8b()),
            "dynamo-mocker" => Ok(Self::dynamo_mocker()),
            _ => Err(ProfileError::UnknownBuiltin {
                name: name.to_owned(),
                known: Self::builtin_names().join(", "),
            }),
        }
    }

    /// Seed 002's worker: one H200 running Llama-3.1-70B-Instruct FP8 with an FP8 KV cache, TP=1.
    ///
    /// - memory: 143,771 MiB as the driver reports it (marketed as 141 GB);
    /// - weights: 70.6 GB (70.6 B parameters at one byte);
    /// - KV: 80 layers × 8 KV heads × 128 dims × 2 × 1 byte = 163,840 B/token;
    /// - bandwidth 4.8 TB/s; FP8 dense 1,979 TFLOP/s;
    /// - attention: 4 × 80 layers × 64 heads × 128 dims = 2,621,440 FLOPs per pair.
    ///
    /// The efficiency factors and the step overhead are fitted so that the simulator
    /// reproduces seed 002's round-robin TOPS, ITL p50 and E2E p50 within ±10% at every
    /// concurrency 60–180 (docs/CALIBRATION.md: the search, the fit, what it leaves out).
    pub fn h200_llama70b_fp8() -> HardwareProfile {
        HardwareProfile {
            name: "h200-llama70b-fp8".into(),
            gpu: "NVIDIA H200 SXM 141GB".into(),
            model: "meta-llama/Llama-3.1-70B-Instruct (FP8 weights, FP8 KV cache)".into(),
            gpu_memory_bytes: 143_771 * MIB,
            weight_bytes: 70_600_000_000,
            activation_reserve_bytes: 4 * GIB,
            kv_bytes_per_token: 80 * 8 * 128 * 2,
            max_context_tokens: 131_072,
            kv_transfer: KvTransferProfile {
                nvlink_bytes_per_sec: 450e9,
                network_bytes_per_sec: 50e9,
                latency_ns: 200_000,
            },
            timing: TimingModel::Roofline(RooflineTiming {
                memory_bandwidth_bytes_per_sec: 4.8e12,
                weight_read_efficiency: 0.94,
                kv_read_efficiency: 0.345,
                peak_flops: 1.979e15,
                flops_efficiency: 0.55,
                params: 70.6e9,
                attention_flops_per_pair: (4 * 80 * 64 * 128) as f64,
                step_overhead_ns: 300_000,
            }),
            engine_defaults: EngineDefaults::default(),
            tensor_parallel: None,
            speculative: seed_003_speculative(),
        }
    }

    /// Seed 003's replica: four H100 SXM 80GB of an 8-GPU NVLink node running
    /// Llama-3.1-70B-Instruct FP8 (or 3.3, the same architecture) with tensor parallelism 4.
    ///
    /// - memory per GPU: 81,559 MiB; weights 70.6 GB in all (17.65 GB per GPU); 4 GiB per GPU
    ///   for activations and the runtime;
    /// - bandwidth 3.35 TB/s and FP8 dense 1,979 TFLOP/s per GPU;
    /// - tensor parallelism: 80 layers × 2 all-reduces of BF16 activations (hidden 8,192) per
    ///   pass, 8 µs each plus the bytes at 360 GB/s of NCCL bus bandwidth over NVLink 4;
    /// - efficiencies and step overhead: the ones fitted to seed 002's H200s (the same kernels
    ///   on the same architecture; no published measurement of this node to fit them to).
    pub fn h100_tp4_llama70b_fp8() -> HardwareProfile {
        let h200 = Self::h200_llama70b_fp8();
        let timing = match h200.timing {
            TimingModel::Roofline(fitted) => TimingModel::Roofline(RooflineTiming {
                memory_bandwidth_bytes_per_sec: 3.35e12,
                ..fitted
            }),
            other => other,
        };
        HardwareProfile {
            name: "h100-tp4-llama70b-fp8".into(),
            gpu: "4 × NVIDIA H100 SXM 80GB (TP=4, NVLink)".into(),
            gpu_memory_bytes: 81_559 * MIB,
            timing,
            tensor_parallel: Some(TensorParallel {
                size: 4,
                layers: 80,
                hidden_size: 8192,
                activation_bytes: 2,
                allreduce_latency_ns: 8_000,
                allreduce_bytes_per_sec: 360e9,
            }),
            // The model, KV layout, transfer links and speculative configurations are the
            // H200 replica's.
            ..h200
        }
    }

    /// Seed 004's dev environment: one H100 80GB running Llama-3.1-8B-Instruct in BF16.
    ///
    /// KV: 32 layers × 8 KV heads × 128 dims × 2 × 2 bytes = 131,072 B/token. Bandwidth
    /// 3.35 TB/s, BF16 dense 989 TFLOP/s; attention 4 × 32 × 32 × 128 FLOPs per pair. The dev
    /// nodes hold one GPU each, so KV moves over the network (assumed 25 Gb/s).
    pub fn h100_llama8b() -> HardwareProfile {
        HardwareProfile {
            name: "h100-llama8b".into(),
            gpu: "NVIDIA H100 SXM 80GB".into(),
            model: "meta-llama/Llama-3.1-8B-Instruct (BF16)".into(),
            gpu_memory_bytes: 81_559 * MIB,
            weight_bytes: 16_060_000_000,
            activation_reserve_bytes: 2 * GIB,
            kv_bytes_per_token: 32 * 8 * 128 * 2 * 2,
            max_context_tokens: 131_072,
            kv_transfer: KvTransferProfile {
                nvlink_bytes_per_sec: 450e9,
                network_bytes_per_sec: 3.125e9,
                latency_ns: 500_000,
            },
            timing: TimingModel::Roofline(RooflineTiming {
                memory_bandwidth_bytes_per_sec: 3.35e12,
                weight_read_efficiency: 0.85,
                kv_read_efficiency: 0.50,
                peak_flops: 989e12,
                flops_efficiency: 0.55,
                params: 8.03e9,
                attention_flops_per_pair: (4 * 32 * 32 * 128) as f64,
                step_overhead_ns: 800_000,
            }),
            engine_defaults: EngineDefaults::default(),
            tensor_parallel: None,
            speculative: BTreeMap::new(),
        }
    }

    /// NVIDIA Dynamo 1.6.1's mocker: its polynomials and its defaults (16,384 blocks of 64
    /// tokens, 256 sequences, 8,192 batched tokens). It models no memory, so the memory fields
    /// are zero and the pool size comes from `engine_defaults.num_gpu_blocks`.
    pub fn dynamo_mocker() -> HardwareProfile {
        HardwareProfile {
            name: "dynamo-mocker".into(),
            gpu: "none (NVIDIA Dynamo 1.6.1 mocker timing)".into(),
            model: "any".into(),
            gpu_memory_bytes: 0,
            weight_bytes: 0,
            activation_reserve_bytes: 0,
            kv_bytes_per_token: 0,
            max_context_tokens: 1_048_576,
            kv_transfer: KvTransferProfile {
                nvlink_bytes_per_sec: 450e9,
                network_bytes_per_sec: 50e9,
                latency_ns: 0,
            },
            timing: TimingModel::DynamoMocker(DynamoMockerTiming {
                prefill_ms_coefficients: [4.209989e-07, 1.518344e-02, 16.50142],
                decode_ms_coefficients: [-25.74, 54.01, 5.74],
                min_decode_ms: 1.0,
            }),
            engine_defaults: EngineDefaults {
                block_size: Some(64),
                max_num_seqs: Some(256),
                max_num_batched_tokens: Some(8192),
                num_gpu_blocks: Some(16_384),
            },
            tensor_parallel: None,
            speculative: BTreeMap::new(),
        }
    }

    /// Parses a profile from TOML and validates it.
    pub fn from_toml_str(s: &str) -> Result<HardwareProfile, ProfileError> {
        let p: HardwareProfile = toml::from_str(s)?;
        p.validate()?;
        Ok(p)
    }

    /// Writes the profile as TOML.
    pub fn to_toml_string(&self) -> Result<String, ProfileError> {
        Ok(toml::to_string(self)?)
    }

    /// Parses a profile from JSON and validates it.
    pub fn from_json_str(s: &str) -> Result<HardwareProfile, ProfileError> {
        let p: HardwareProfile = serde_json::from_str(s)?;
        p.validate()?;
        Ok(p)
    }

    /// Writes the profile as pretty JSON.
    pub fn to_json_string(&self) -> Result<String, ProfileError> {
        Ok(serde_json::to_string_pretty(self)?)
    }

    /// Checks that every number can be used in the formulas (finite, positive where divided
    /// by, efficiencies in (0, 1]).
    pub fn validate(&self) -> Result<(), ProfileError> {
        let bad = |field: &'static str, reason: &'static str| {
            Err(ProfileError::Invalid {
                profile: self.name.clone(),
                field,
                reason,
            })
        };
        let positive = |x: f64| x.is_finite() && x > 0.0;
        let fraction = |x: f64| x.is_finite() && x > 0.0 && x <= 1.0;
        if self.max_context_tokens == 0 {
            return bad("max_context_tokens", "must be at least 1");
        }
        let t = &self.kv_transfer;
        if !positive(t.nvlink_bytes_per_sec) {
            return bad(
                "kv_transfer.nvlink_bytes_per_sec",
                "must be a positive number",
            );
        }
        if !positive(t.network_bytes_per_sec) {
            return bad(
                "kv_transfer.network_bytes_per_sec",
                "must be a positive number",
            );
        }
        if let Some(tp) = &self.tensor_parallel {
            if !(1..=64).contains(&tp.size) {
                return bad("tensor_parallel.size", "must be between 1 and 64");
            }
            if tp.layers == 0 || tp.hidden_size == 0 {
                return bad("tensor_parallel.layers / hidden_size", "must be at least 1");
            }
            if !positive(tp.allreduce_bytes_per_sec) {
                return bad(
                    "tensor_parallel.allreduce_bytes_per_sec",
                    "must be positive",
                );
            }
            if matches!(self.timing, TimingModel::DynamoMocker(_)) && tp.size > 1 {
                return bad(
                    "tensor_parallel",
                    "is not modelled by the dynamo_mocker timing (its polynomials are per worker)",
                );
            }
        }
        if self.speculative.len() > 16 {
            return bad("speculative", "holds at most 16 named configurations");
        }
        if self.speculative.values().any(|c| !c.is_valid()) {
            return bad(
                "speculative",
                "has a configuration that is not valid (draft_len ≤ 16, rates in [0, 1])",
            );
        }
        match &self.timing {
            TimingModel::Roofline(r) => {
                if !positive(r.memory_bandwidth_bytes_per_sec) {
                    return bad("timing.memory_bandwidth_bytes_per_sec", "must be positive");
                }
                if !fraction(r.weight_read_efficiency) {
                    return bad("timing.weight_read_efficiency", "must be in (0, 1]");
                }
                if !fraction(r.kv_read_efficiency) {
                    return bad("timing.kv_read_efficiency", "must be in (0, 1]");
                }
                if !positive(r.peak_flops) {
                    return bad("timing.peak_flops", "must be positive");
                }
                if !fraction(r.flops_efficiency) {
                    return bad("timing.flops_efficiency", "must be in (0, 1]");
                }
                if !(r.params.is_finite() && r.params >= 0.0) {
                    return bad("timing.params", "must be a non-negative number");
                }
                if !(r.attention_flops_per_pair.is_finite() && r.attention_flops_per_pair >= 0.0) {
                    return bad(
                        "timing.attention_flops_per_pair",
                        "must be a non-negative number",
                    );
                }
            }
            TimingModel::DynamoMocker(m) => {
                let all = m
                    .prefill_ms_coefficients
                    .iter()
                    .chain(&m.decode_ms_coefficients)
                    .chain(std::iter::once(&m.min_decode_ms));
                if all.into_iter().any(|x| !x.is_finite()) {
                    return bad("timing coefficients", "must be finite numbers");
                }
                if m.min_decode_ms < 0.0 {
                    return bad("timing.min_decode_ms", "must not be negative");
                }
            }
        }
        Ok(())
    }

    /// KV cache bytes of one block.
    pub fn block_bytes(&self, block_size: u32) -> u64 {
        self.kv_bytes_per_token
            .saturating_mul(u64::from(block_size))
    }

    /// GPUs one worker spans (its tensor-parallel size; 1 without tensor parallelism).
    pub fn gpus(&self) -> u32 {
        self.tensor_parallel.as_ref().map_or(1, |tp| tp.size.max(1))
    }

    /// The named speculative configuration `name` (`draft`, `eagle3`), or an error listing
    /// the ones this profile has.
    pub fn speculative_config(&self, name: &str) -> Result<SpecDecodeConfig, String> {
        self.speculative.get(name).cloned().ok_or_else(|| {
            let known: Vec<&str> = self.speculative.keys().map(String::as_str).collect();
            if known.is_empty() {
                format!(
                    "profile {:?} has no speculative-decoding configurations (the Llama-70B \
                     profiles have draft and eagle3; add a [speculative.NAME] table to a profile file)",
                    self.name
                )
            } else {
                format!(
                    "profile {:?} has no speculative-decoding configuration {name:?}; it has: {}",
                    self.name,
                    known.join(", ")
                )
            }
        })
    }

    /// Blocks that fit in the memory left for the KV cache (TensorRT-LLM's meaning of
    /// `free_gpu_memory_fraction`, see the module docs). `extra_weight_bytes` is memory taken by
    /// anything else resident, e.g. a speculative-decoding draft model. Zero when the profile
    /// models no KV memory or nothing is left.
    pub fn kv_capacity_blocks(
        &self,
        block_size: u32,
        free_gpu_memory_fraction: f64,
        extra_weight_bytes: u64,
    ) -> u64 {
        self.kv_capacity_blocks_with(block_size, free_gpu_memory_fraction, extra_weight_bytes, 0)
    }

    /// [`HardwareProfile::kv_capacity_blocks`] when every token also keeps
    /// `extra_kv_bytes_per_token` of a drafter's own KV in the same pool.
    pub fn kv_capacity_blocks_with(
        &self,
        block_size: u32,
        free_gpu_memory_fraction: f64,
        extra_weight_bytes: u64,
        extra_kv_bytes_per_token: u64,
    ) -> u64 {
        let block_bytes = self
            .block_bytes(block_size)
            .saturating_add(extra_kv_bytes_per_token.saturating_mul(u64::from(block_size)));
        if self.kv_bytes_per_token == 0 || block_bytes == 0 || !free_gpu_memory_fraction.is_finite()
        {
            return 0;
        }
        let gpus = u64::from(self.gpus());
        let left = self
            .gpu_memory_bytes
            .saturating_mul(gpus)
            .saturating_sub(self.weight_bytes)
            .saturating_sub(extra_weight_bytes)
            .saturating_sub(self.activation_reserve_bytes.saturating_mul(gpus));
        // Below 2^53 bytes (8 PiB) this product is exact enough: the floor is what TRT-LLM does.
        let pool = (left as f64 * free_gpu_memory_fraction.clamp(0.0, 1.0)).floor() as u64;
        pool / block_bytes
    }

    /// Time to move `tokens` tokens of KV cache over `link`: latency + bytes / bandwidth.
    pub fn kv_transfer_time(&self, tokens: u64, link: KvLink) -> Nanos {
        let bw = match link {
            KvLink::Nvlink => self.kv_transfer.nvlink_bytes_per_sec,
            KvLink::Network => self.kv_transfer.network_bytes_per_sec,
        };
        let bytes = tokens.saturating_mul(self.kv_bytes_per_token) as f64;
        let secs = if bw > 0.0 { bytes / bw } else { 0.0 };
        Nanos(self.kv_transfer.latency_ns) + Nanos::from_secs_f64(secs)
    }

    /// What one more token costs, in seconds, on an engine with a pool of `pool_blocks` KV
    /// blocks of `block_size` tokens: prefilling it (the mean over a 4,096-token chunk after
    /// 4,096 cached tokens, above the cost of a 1-token chunk), and keeping it in the context
    /// of a decoding batch (the step time's slope in the batch's total context, 64 sequences
    /// filling 20% to 40% of the pool). Load-aware routing prices workers with these.
    pub fn marginal_timing(&self, block_size: u32, pool_blocks: u64) -> WorkerTiming {
        self.marginal_timing_with(block_size, pool_blocks, None)
    }

    /// [`HardwareProfile::marginal_timing`] of a worker that decodes speculatively: a prompt
    /// token also costs the drafter's share of the prefill, and a token of context is read
    /// once per verification step (by the target and, with a draft model, by the drafter on
    /// each of its passes), which yields `tokens_per_step` tokens, so per generated token it
    /// costs that step's marginal time divided by `tokens_per_step`.
    pub fn marginal_timing_with(
        &self,
        block_size: u32,
        pool_blocks: u64,
        speculation: Option<&Speculation>,
    ) -> WorkerTiming {
        let with_drafter = |mut shape: StepShape| {
            if let Some(spec) = speculation {
                shape.drafter = spec.drafter;
                shape.draft_cost_ratio = spec.draft_cost_ratio;
                if shape.decode_seqs > 0 {
                    shape.draft_passes = spec.draft_passes;
                    shape.decode_tokens = shape.decode_seqs * (1 + u64::from(spec.draft_passes));
                }
            }
            self.step_secs(&shape)
        };
        let chunk = 4096u64;
        let prefill = (with_drafter(StepShape::prefill(chunk, 4096))
            - with_drafter(StepShape::prefill(1, 4096)))
            / (chunk - 1) as f64;
        let seqs = 64u64;
        let pool_tokens = pool_blocks
            .max(1)
            .saturating_mul(u64::from(block_size.max(1)));
        let per_seq = |share: u64| (pool_tokens * share / 10 / seqs).max(1);
        let (short, long) = (per_seq(2), per_seq(4).max(per_seq(2) + 1));
        let per_step = (with_drafter(StepShape::decode(seqs, long, block_size, pool_blocks))
            - with_drafter(StepShape::decode(seqs, short, block_size, pool_blocks)))
            / (seqs * (long - short)) as f64;
        let tokens_per_step = speculation.map_or(1.0, |s| s.tokens_per_step.max(1.0));
        WorkerTiming {
            prefill_secs_per_token: prefill.max(0.0),
            decode_secs_per_context_token: (per_step / tokens_per_step).max(0.0),
        }
    }

    /// Duration of one step of this shape. Pure; an empty shape takes no time.
    pub fn step_time(&self, shape: &StepShape) -> Nanos {
        Nanos::from_secs_f64(self.step_secs(shape))
    }

    /// [`HardwareProfile::step_time`] in seconds, unrounded.
    pub fn step_secs(&self, s: &StepShape) -> f64 {
        self.target_secs(s) + self.draft_secs(s)
    }

    /// The part of a step that is the target model's forward pass (the verification pass
    /// under speculative decoding), in seconds.
    pub fn target_secs(&self, s: &StepShape) -> f64 {
        if s.prefill_tokens == 0 && s.decode_seqs == 0 {
            return 0.0;
        }
        match &self.timing {
            TimingModel::Roofline(r) => {
                let g = f64::from(self.gpus());
                let flops = r.peak_flops * r.flops_efficiency * g;
                let weights = self.weight_bytes as f64
                    / (r.memory_bandwidth_bytes_per_sec * r.weight_read_efficiency * g);
                let kv_bw = r.memory_bandwidth_bytes_per_sec * r.kv_read_efficiency * g;
                let kv_read =
                    self.kv_bytes_per_token as f64 * s.decode_context_tokens as f64 / kv_bw;
                let tokens = s.prefill_tokens + s.decode_tokens;
                let linear = (2.0 * r.params * tokens as f64 / flops).max(weights);
                let attn_pf = r.attention_flops_per_pair * s.prefill_attention_pairs as f64 / flops;
                let layers = self.tensor_parallel.as_ref().map_or(0, |tp| tp.layers);
                r.step_overhead_ns as f64 * 1e-9
                    + linear
                    + attn_pf
                    + kv_read
                    + self.allreduce_secs(layers, tokens)
            }
            TimingModel::DynamoMocker(m) => {
                let [pa, pb, pc] = m.prefill_ms_coefficients;
                let prefill_ms = if s.prefill_tokens > 0 {
                    let t = s.prefill_tokens as f64;
                    pa * t * t + pb * t + pc
                } else {
                    0.0
                };
                (prefill_ms + self.mocker_decode_ms(s)).max(0.0) * 1e-3
            }
        }
    }

    /// The part of a step spent in a speculative drafter's passes, in seconds (0 without
    /// drafts). See the module docs for the formula.
    pub fn draft_secs(&self, s: &StepShape) -> f64 {
        let drafting = s.draft_passes > 0 && s.decode_seqs > 0;
        match (&self.timing, s.drafter) {
            (TimingModel::Roofline(r), Some(d)) if drafting || s.prefill_tokens > 0 => {
                let g = f64::from(self.gpus());
                let flops = r.peak_flops * r.flops_efficiency * g;
                let weights = d.weight_bytes as f64
                    / (r.memory_bandwidth_bytes_per_sec * r.weight_read_efficiency * g);
                let kv_bw = r.memory_bandwidth_bytes_per_sec * r.kv_read_efficiency * g;
                let kv_read = d.kv_bytes_per_token as f64 * s.decode_context_tokens as f64 / kv_bw;
                let pass = |tokens: u64, decoding: bool| {
                    d.pass_overhead_ns as f64 * 1e-9
                        + (2.0 * d.params * tokens as f64 / flops).max(weights)
                        + if decoding { kv_read } else { 0.0 }
                        + self.allreduce_secs(d.layers, tokens)
                };
                let seqs = if drafting { s.decode_seqs } else { 0 };
                // The first pass also builds the drafter's KV of this step's prompt tokens.
                let first = pass(s.prefill_tokens + seqs, drafting);
                let rest = if drafting {
                    f64::from(s.draft_passes - 1) * pass(seqs, true)
                } else {
                    0.0
                };
                first + rest
            }
            (TimingModel::Roofline(r), None) if drafting => {
                // A plain decode step of the same batch: one token per sequence.
                let plain = self.target_secs(&StepShape {
                    prefill_tokens: 0,
                    prefill_attention_pairs: 0,
                    decode_tokens: s.decode_seqs,
                    draft_passes: 0,
                    ..*s
                }) - r.step_overhead_ns as f64 * 1e-9;
                f64::from(s.draft_passes) * s.draft_cost_ratio.max(0.0) * plain.max(0.0)
            }
            (TimingModel::DynamoMocker(_), _) if drafting => {
                let plain = self.mocker_decode_ms(s);
                plain * f64::from(s.draft_passes) * s.draft_cost_ratio.max(0.0) * 1e-3
            }
            _ => 0.0,
        }
    }

    /// The Dynamo mocker's decode term of a step, in milliseconds (0 without decodes).
    fn mocker_decode_ms(&self, s: &StepShape) -> f64 {
        let TimingModel::DynamoMocker(m) = &self.timing else {
            return 0.0;
        };
        if s.decode_seqs == 0 {
            return 0.0;
        }
        let [da, db, dc] = m.decode_ms_coefficients;
        let p = if s.kv_pool_blocks > 0 {
            s.decode_kv_blocks as f64 / s.kv_pool_blocks as f64
        } else {
            0.0
        };
        (da * p * p + db * p + dc).max(m.min_decode_ms)
    }

    /// Time of the all-reduces of one forward pass over `tokens` tokens through `layers`
    /// layers under this profile's tensor parallelism (0 on one GPU).
    fn allreduce_secs(&self, layers: u32, tokens: u64) -> f64 {
        match &self.tensor_parallel {
            Some(tp) if tp.size > 1 && tokens > 0 => {
                let g = f64::from(tp.size);
                let bytes =
                    tokens as f64 * f64::from(tp.hidden_size) * f64::from(tp.activation_bytes);
                let one = tp.allreduce_latency_ns as f64 * 1e-9
                    + 2.0 * (g - 1.0) / g * bytes / tp.allreduce_bytes_per_sec;
                2.0 * f64::from(layers) * one
            }
            _ => 0.0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64, rel: f64) -> bool {
        (a - b).abs() <= rel * b.abs().max(1e-12)
    }

    #[test]
    fn builtins_resolve_and_validate() {
        for name in HardwareProfile::builtin_names() {
            let p = HardwareProfile::builtin(name).unwrap();
            assert_eq!(&p.name, name);
            p.validate().unwrap();
        }
        let err = HardwareProfile::builtin("a100-nope")
            .unwrap_err()
            .to_string();
        assert!(err.contains("h200-llama70b-fp8"), "{err}");
    }

    #[test]
    fn llama70b_kv_bytes_per_token_is_163840() {
        assert_eq!(
            HardwareProfile::h200_llama70b_fp8().kv_bytes_per_token,
            163_840
        );
        assert_eq!(HardwareProfile::h100_llama8b().kv_bytes_per_token, 131_072);
    }

    /// Hand computation: (143,771 MiB − 70.6 GB − 4 GiB) × 0.9 / (163,840 B × 32).
    #[test]
    fn h200_capacity_matches_hand_computation() {
        let p = HardwareProfile::h200_llama70b_fp8();
        let mem: u64 = 150_754_820_096; // 143,771 × 1,048,576
        let left = mem - 70_600_000_000 - 4_294_967_296; // 75,859,852,800
        assert_eq!(left, 75_859_852_800);
        let pool = 68_273_867_520u64; // × 0.9
        assert_eq!(pool / 5_242_880, 13_022);
        assert_eq!(p.kv_capacity_blocks(32, 0.9, 0), 13_022);
        // A draft model's weights come out of the same memory.
        assert!(p.kv_capacity_blocks(32, 0.9, 8_000_000_000) < 13_022);
        assert_eq!(
            HardwareProfile::dynamo_mocker().kv_capacity_blocks(64, 0.9, 0),
            0
        );
    }

    /// Decode of 20 sequences × 5,600 tokens on the H200 profile, by hand:
    /// weights 70.6e9 / (4.8e12 × 0.94) = 15.647 ms; GEMM compute 2 × 70.6e9 × 20 /
    /// (1.979e15 × 0.55) = 2.594 ms < weights; KV 163,840 × 112,000 / (4.8e12 × 0.345) =
    /// 11.081 ms; overhead 0.3 ms → 27.028 ms.
    #[test]
    fn roofline_decode_by_hand() {
        let p = HardwareProfile::h200_llama70b_fp8();
        let shape = StepShape {
            decode_seqs: 20,
            decode_tokens: 20,
            decode_context_tokens: 112_000,
            ..StepShape::default()
        };
        let ms = p.step_secs(&shape) * 1e3;
        let want =
            0.3 + 70.6e9 / (4.8e12 * 0.94) * 1e3 + 163_840.0 * 112_000.0 / (4.8e12 * 0.345) * 1e3;
        assert!(close(ms, want, 1e-12), "{ms} vs {want}");
        assert!(close(ms, 27.028, 1e-3), "{ms}");
        // Seed 002's high-load point: 58 running × 5,800 tokens → about 47 ms.
        let busy = StepShape {
            decode_seqs: 58,
            decode_tokens: 58,
            decode_context_tokens: 58 * 5_800,
            ..StepShape::default()
        };
        let ms = p.step_secs(&busy) * 1e3;
        assert!((45.0..52.0).contains(&ms), "{ms}");
    }

    /// Prefill of 3,500 new tokens, no cached prefix: compute bound.
    /// linear = 2 × 70.6e9 × 3,500 / (1.979e15 × 0.55); pairs = 3,500 × 3,501 / 2;
    /// attention = 2,621,440 × pairs / (1.979e15 × 0.55).
    #[test]
    fn roofline_prefill_by_hand() {
        let p = HardwareProfile::h200_llama70b_fp8();
        let n = 3_500u64;
        let pairs = n * (n + 1) / 2;
        let shape = StepShape {
            prefill_tokens: n,
            prefill_attention_pairs: pairs,
            ..StepShape::default()
        };
        let flops = 1.979e15 * 0.55;
        let want = 0.3e-3 + 2.0 * 70.6e9 * 3_500.0 / flops + 2_621_440.0 * pairs as f64 / flops;
        let got = p.step_secs(&shape);
        assert!(close(got, want, 1e-12));
        assert!((0.2..0.7).contains(&got), "a few hundred ms, got {got}");
        // A tiny chunk is weight-bandwidth bound, not compute bound: at least the 15.6 ms
        // weight read (70.6e9 / (4.8e12 × 0.94)).
        let tiny = StepShape {
            prefill_tokens: 10,
            prefill_attention_pairs: 55,
            ..StepShape::default()
        };
        assert!(p.step_secs(&tiny) > 0.0156);
    }

    #[test]
    fn dynamo_mocker_formulas_by_hand() {
        let p = HardwareProfile::dynamo_mocker();
        // Prefill only, T = 1,000: 0.4209989 + 15.18344 + 16.50142 = 32.1058589 ms.
        let pf = StepShape {
            prefill_tokens: 1_000,
            ..StepShape::default()
        };
        assert!(close(p.step_secs(&pf) * 1e3, 32.105_858_9, 1e-9));
        // Decode only, p = 0.5: −6.435 + 27.005 + 5.74 = 26.31 ms.
        let dec = StepShape {
            decode_seqs: 10,
            decode_tokens: 10,
            decode_kv_blocks: 8_192,
            kv_pool_blocks: 16_384,
            ..StepShape::default()
        };
        assert!(close(p.step_secs(&dec) * 1e3, 26.31, 1e-9));
        // p = 0: 5.74 ms; p = 2.2: −124.58 + 118.82 + 5.74 < 1 → clamped to 1 ms.
        let empty_pool = StepShape {
            decode_kv_blocks: 0,
            ..dec
        };
        assert!(close(p.step_secs(&empty_pool) * 1e3, 5.74, 1e-9));
        let over = StepShape {
            decode_kv_blocks: 36_045,
            ..dec
        };
        assert!(close(p.step_secs(&over) * 1e3, 1.0, 1e-9));
        // Mixed: the sum.
        let mixed = StepShape {
            prefill_tokens: 1_000,
            ..dec
        };
        assert!(close(p.step_secs(&mixed) * 1e3, 32.105_858_9 + 26.31, 1e-9));
        assert_eq!(p.step_time(&StepShape::default()), Nanos::ZERO);
    }

    #[test]
    fn transfer_time_by_hand() {
        let p = HardwareProfile::h200_llama70b_fp8();
        // 4,096 tokens × 163,840 B = 671,088,640 B; / 450e9 = 1.491308 ms; + 0.2 ms.
        let t = p.kv_transfer_time(4_096, KvLink::Nvlink);
        assert_eq!(
            t,
            Nanos(200_000) + Nanos::from_secs_f64(671_088_640.0 / 450e9)
        );
        let slow = p.kv_transfer_time(4_096, KvLink::Network);
        assert!(slow > t.saturating_mul(5));
    }

    #[test]
    fn toml_and_json_round_trip() {
        for name in HardwareProfile::builtin_names() {
            let p = HardwareProfile::builtin(name).unwrap();
            let toml = p.to_toml_string().unwrap();
            assert_eq!(HardwareProfile::from_toml_str(&toml).unwrap(), p, "{toml}");
            let json = p.to_json_string().unwrap();
            assert_eq!(HardwareProfile::from_json_str(&json).unwrap(), p);
        }
    }

    #[test]
    fn bad_profiles_get_clear_errors() {
        let mut p = HardwareProfile::h200_llama70b_fp8();
        if let TimingModel::Roofline(r) = &mut p.timing {
            r.kv_read_efficiency = 1.5;
        }
        let toml = p.to_toml_string().unwrap();
        let err = HardwareProfile::from_toml_str(&toml)
            .unwrap_err()
            .to_string();
        assert!(err.contains("kv_read_efficiency"), "{err}");
        let err = HardwareProfile::from_toml_str("name = 3")
            .unwrap_err()
            .to_string();
        assert!(err.contains("TOML"), "{err}");
    }
}
