//! A simulated LLM inference worker that behaves like vLLM / TensorRT-LLM on a named GPU.
//!
//! Sans-IO, as `quinn-proto` does it: no clock, no I/O, no tokio, no threads. Time is an
//! argument ([`Nanos`](nanotime::Nanos)), randomness comes from a seeded RNG, so a run is a
//! pure function of its inputs. The virtual-time simulator and the real-time engine server
//! drive the very same [`Engine`].
//!
//! # Driving it
//!
//! ```
//! use std::sync::Arc;
//! use engine::{Engine, EngineConfig, EngineEvent, EngineRequest, Leg, OutputSpec, RequestId};
//! use kv_index::WorkerId;
//! use nanotime::Nanos;
//!
//! let mut engine = Engine::new(EngineConfig::seed_002(), WorkerId(1)).unwrap();
//! let prompt: Arc<[u32]> = (0..3_500).collect();
//! engine.submit(EngineRequest { id: RequestId(1), prompt, output: OutputSpec::Count(8), leg: Leg::ByRole }, Nanos::ZERO);
//! let mut finished_at = None;
//! while let Some(t) = engine.poll_timeout() {      // end of the running step
//!     engine.handle_timeout(t);                     // a real-time driver sleeps until t
//!     while let Some(ev) = engine.poll_event() {
//!         if let EngineEvent::Finished { at, .. } = ev {
//!             finished_at = Some(at);
//!         }
//!     }
//! }
//! assert!(finished_at.unwrap() > Nanos::from_millis(300)); // prefill + 7 decode steps
//! ```
//!
//! Inputs: [`Engine::submit`], [`Engine::cancel`], [`Engine::handle_timeout`]. The engine says
//! when it next needs the clock ([`Engine::poll_timeout`]) and outputs are drained in order
//! ([`Engine::poll_event`]: [`EngineEvent::FirstToken`], [`EngineEvent::Tokens`] with output
//! indices, [`EngineEvent::Finished`], [`EngineEvent::PrefillDone`], cancellations,
//! rejections and [`EngineEvent::Kv`] cache events). [`Engine::metrics`] is a cheap snapshot.
//!
//! # Scheduler (vLLM V1)
//!
//! Continuous batching with chunked prefill. Each step has a token budget
//! (`max_num_batched_tokens`, seed 002: 16,384) and at most `max_num_seqs` (64) sequences.
//! Running requests are served first, in admission order: a decoding sequence takes 1 token
//! (1 + K with speculative decoding), a sequence still prefilling takes the next chunk of its
//! prompt that fits the budget. When the pool has no block for a running request, the newest
//! running request is preempted: its blocks are released (its full blocks stay cached) and it
//! goes back to the front of the queue to be recomputed. Then, if nothing was preempted,
//! waiting requests are admitted first-come first-served while sequences, budget and blocks
//! allow; the first that does not fit stops admission (no skipping ahead). A request's prefix
//! hit is counted when it is first scheduled, as vLLM does; the last known token is always
//! recomputed, because sampling needs its logits.
//!
//! A request's token sequence is its prompt followed by its outputs; the step that computes
//! the last known token samples the next one. So one rule covers the end of a prefill (first
//! token), a decode step, and the recomputation after a preemption.
//!
//! # Block pool and prefix cache ([`BlockPool`])
//!
//! Blocks of `block_size` tokens (seed: 32); capacity from the profile's memory arithmetic
//! ([`HardwareProfile::kv_capacity_blocks`], TRT-LLM's meaning of `free_gpu_memory_fraction`)
//! or an explicit override. Full blocks are keyed by their
//! [`SequenceHash`](kv_index::SequenceHash) from `kv-index`, the scheme the router uses, so the
//! events line up with the router's view. Blocks are cached as soon as they are full and computed — prompt blocks
//! after their prefill chunk, output blocks during decode — so the next turn of a conversation
//! hits its own history. Released cached blocks stay until evicted, least recently released
//! first; a referenced block is never evicted.
//!
//! KV events: `Stored { parent, blocks }` (block id = its sequence hash, content = its local
//! hash, parent = the previous block's id), `Removed` on eviction, `Cleared` on
//! [`Engine::reset_prefix_cache`], each with the worker's next sequence number.
//!
//! # Timing ([`HardwareProfile`], [`StepShape`])
//!
//! A step's duration is [`HardwareProfile::step_time`] of its shape, a pure function. The
//! roofline model: `overhead + max(GEMM FLOPs, one weight read) + prefill attention FLOPs +
//! decode KV reads + all-reduces under tensor parallelism (+ draft passes)`; the
//! `dynamo-mocker` model reproduces Dynamo 1.6.1's polynomials. Formulas and the reasons for
//! them are in [`profile`]. Built-ins: `h200-llama70b-fp8`, `h100-tp4-llama70b-fp8` (seed
//! 003's replica: four H100s at TP=4), `h100-llama8b`, `dynamo-mocker`; profiles load from
//! TOML or JSON.
//!
//! # Speculative decoding ([`SpecDecodeConfig`])
//!
//! Draft length K and a per-token acceptance probability α (optionally per class of content,
//! a request's class drawn from a hash of its prompt): the accepted drafts per sequence per
//! step are drawn from a counter-based generator keyed by (seed, request, step), giving
//! `E[tokens/step] = (1 − α^(K+1)) / (1 − α)`. The verification pass feeds K + 1 tokens per
//! sequence to the target; the drafter's K passes, and its share of every prefill, are priced
//! from its size ([`Drafter`]: an 8B draft model or an EAGLE-3 head), whose weights and KV per
//! token come out of the pool. Profiles carry named configurations (`draft`, `eagle3`);
//! [`EngineMetrics`] counts drafts, drafted and accepted tokens, acceptance per position and
//! draft time, under vLLM's and TensorRT-LLM's definitions.
//!
//! # Roles ([`Role`])
//!
//! Aggregated (default). Prefill-only: computes the prompt, produces output index 0, emits
//! [`EngineEvent::PrefillDone`] and keeps the blocks cached. Decode-only: a submitted request
//! is admitted when sequences and blocks allow (its locally cached prefix is reused), its
//! remaining prompt KV arrives after `latency + bytes / bandwidth` over NVLink or the network
//! ([`HardwareProfile::kv_transfer_time`]), then it decodes from output index 1.
//!
//! # Speed mode (`EngineConfig::coalesce_decode`)
//!
//! Between two changes of the batch, decode-only steps are identical but for one more context
//! token per sequence. With `coalesce_decode`, when a planned step is decode-only, holds every
//! running request and nothing waiting can be admitted, the engine plans the following steps
//! up to the first finish (or the step that would run out of blocks) in O(1) per step, and
//! [`Engine::poll_timeout`] returns the end of that stretch. It then emits one `Tokens` event
//! per request per stretch. A `submit`/`cancel`/KV arrival in the middle first applies the
//! steps already ended, keeps the step in progress, and replans at its end — so finish times,
//! token counts and the set of KV events equal one-step-at-a-time mode. KV events of a stretch
//! are emitted when it is applied. With speculative decoding every step's outcome differs per
//! sequence, so planning a stretch is O(batch) per step: each sequence's acceptance is drawn
//! at planning (the same counter-based draw step-by-step mode makes), its context and
//! lookahead blocks advanced, the step priced.
//!
//! # Bounds
//!
//! Pool structures are bounded by the capacity in blocks; requests (and their per-request
//! block and hash lists) by `max_waiting + max_num_seqs` and the model's context; a stretch by
//! 512 steps; the event queue by what one call produces — drivers drain it after each call.

mod engine;
pub mod pool;
pub mod profile;
pub mod spec;
mod types;

pub use engine::Engine;
pub use pool::BlockPool;
pub use profile::{
    DynamoMockerTiming, EngineDefaults, HardwareProfile, KvLink, KvTransferProfile, ProfileError,
    RooflineTiming, Speculation, StepShape, TensorParallel, TimingModel,
};
pub use spec::{
    ContentAcceptance, Drafter, MAX_DRAFT_LEN, SpecDecodeConfig, SpecMethod,
    expected_tokens_per_step,
};
pub use types::{
    EngineConfig, EngineConfigError, EngineEvent, EngineMetrics, EngineRequest, Leg, OutputSpec,
    RejectReason, RequestId, Role, TransferStart, pseudo_token,
};
pub use worker_limits::{WorkerLimits, WorkerTiming};
