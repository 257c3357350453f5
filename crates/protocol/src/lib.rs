//! Wire formats shared by kvroute's services: OpenAI API types and errors, server-sent events,
//! KV events over NATS (our format), worker cards and registration, and vLLM's ZMQ KV event format.
//!
//! Pure data and codecs: no tokio, no sockets, no clock. The engine server, the gateway and the
//! tests all speak through these types, so a format changes in one place.
//!
//! | module | what |
//! | --- | --- |
//! | [`openai`] | `/v1/chat/completions`, `/v1/completions` requests (unknown fields kept in `extra`); responses and stream chunks read ([`ResponseView`]) and written ([`ResponseHead`]) borrowed; `usage` with `cached_tokens`; `/v1/models` |
//! | [`error`] | [`ApiError`]: OpenAI's error JSON with its HTTP status (400, 404, 413, 429, 503, 500); with the `axum` feature, the one way it becomes a response |
//! | [`http`] | what both HTTP servers do to a request: [`http::parse_json`], [`http::check_model`]; with the `axum` feature, a size-limited `read_body` and `json_response` |
//! | [`sse`] | `data:` event writers and the one incremental, bounded, zero-copy [`SseDecoder`] |
//! | [`kv_events`] | [`KvEventBatch`]: a worker's KV events in msgpack, 1:1 with [`kv_index::KvEvent`] |
//! | [`kv_state`] | [`KvStatePart`]: a worker's whole prefix cache, for a gateway that subscribed late |
//! | [`subjects`] | NATS subjects `kvroute.<ns>.kv.<worker>`, `kvroute.<ns>.workers`, `kvroute.<ns>.replicas[.snapshot]` |
//! | [`replicas`] | [`ReplicaBatch`], [`SnapshotRequest`], [`SnapshotPart`]: gateway replicas' routing updates and snapshots in msgpack |
//! | [`worker`] | [`WorkerCard`]: what a worker declares (`GET /info`, and the [`WorkerMessage`] announce/heartbeat/goodbye over NATS) |
//! | [`vllm`] | vLLM's and SGLang's `KVEventBatch` over ZMQ (one wire-compatible codec), array- or map-encoded; [`VllmEventStream`] → `kv-index` events with gap detection; the replay socket's messages and a `ReplayBuffer` |
//!
//! # Invariant
//!
//! Decoders never panic on input: truncated, garbage or oversized input is an error value.
//! Every buffer is bounded (SSE lines, msgpack nesting depth); message sizes are bounded by
//! the transport that hands the bytes in.
//!
//! # Example: a worker's KV events through our NATS format
//!
//! ```
//! use kv_index::{BlockHasher, KvEvent, KvEventKind, WorkerId};
//! use protocol::{KvEventBatch, Subjects};
//!
//! let hasher = BlockHasher::new(32).unwrap();
//! let prompt: Vec<u32> = (0..64).collect();
//! let event = KvEvent {
//!     worker: WorkerId(3),
//!     seq: 0,
//!     kind: KvEventKind::stored_prompt(&hasher, &prompt),
//! };
//! let subjects = Subjects::new("demo").unwrap();
//! let subject = subjects.kv_events(WorkerId(3)); // "kvroute.demo.kv.3"
//! let bytes = KvEventBatch::from_events(WorkerId(3), 1, &[event.clone()]).unwrap().encode();
//!
//! // The receiver:
//! assert_eq!(subjects.parse_kv_events(&subject), Some(WorkerId(3)));
//! let batch = KvEventBatch::decode(&bytes).unwrap();
//! assert_eq!(batch.to_kv_events().unwrap(), vec![event]);
//! ```
//!
//! # Example: reading an OpenAI stream
//!
//! ```
//! use protocol::sse::{SseDecoder, SseEvent};
//!
//! let mut decoder = SseDecoder::default();
//! decoder.push(b"data: {\"id\":\"x\"}\r\n\r\ndata: [DO").unwrap();
//! assert_eq!(decoder.next_event(), Some(SseEvent::Data("{\"id\":\"x\"}")));
//! decoder.push(b"NE]\n\n").unwrap();
//! assert_eq!(decoder.next_event(), Some(SseEvent::Done));
//! ```

pub mod error;
pub mod http;
pub mod kv_events;
pub mod kv_state;
#[cfg(feature = "axum")]
pub mod listener;
#[cfg(feature = "nats")]
pub mod nats_client;
pub mod openai;
pub mod replicas;
pub mod sse;
pub mod subjects;
pub mod vllm;
pub mod worker;

pub use error::{ApiError, ErrorBody, ErrorDetail};
pub use kv_events::{KvEventBatch, KvWireError, WireBlock, WireKvEvent, WireKvKind};
pub use kv_state::{
    KvState, KvStateAssembly, KvStateError, KvStatePart, KvStateRequest, ZmqKvState, state_parts,
};
pub use openai::{
    Api, ApiRequest, ChatCompletionRequest, ChoiceOut, ChoiceView, CompletionRequest, FinishReason,
    KvTransferParams, MessageContent, MessageView, Model, ModelList, Prompt, PromptTokensDetails,
    RequestMessage, ResponseHead, ResponseView, SamplingParams, StreamOptions, TokenIds, Usage,
};
pub use replicas::{
    ReplicaBatch, ReplicaWireError, SnapshotPart, SnapshotRequest, WireChange, WireSnapshotRequest,
    WireUpdate,
};
pub use sse::{SseDecoder, SseError, SseEvent};
pub use subjects::{BadNamespace, Subjects};
pub use vllm::{VllmEventBatch, VllmEventStream, VllmFrame};
pub use worker::{
    SpeculativeInfo, UnknownRole, WorkerAnnounce, WorkerCard, WorkerMessage, WorkerMessageError,
    WorkerRole,
};
pub use worker_limits::{WorkerLimits, WorkerTiming};
