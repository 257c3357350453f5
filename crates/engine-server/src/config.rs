//! What an engine server runs: the engine's settings plus serving, text and publishing options.

use std::net::SocketAddr;
use std::sync::Arc;

use engine::{EngineConfig, HardwareProfile};
use kv_index::WorkerId;
use protocol::vllm::EventEncoding;

/// How long generated replies are when the request does not fix the length (`ignore_eos`).
///
/// Uniform in `mean × (1 ± spread)`, at least 1 token, then capped by `max_tokens` and the
/// context (a capped reply finishes with `length`, an uncapped one with `stop`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReplyLength {
    /// Mean reply length in tokens (seed 002's conversations: ~830).
    pub mean: u32,
    /// Half-width of the uniform spread, as a fraction of the mean (0 = always `mean`).
    pub spread: f64,
}

impl Default for ReplyLength {
    fn default() -> Self {
        ReplyLength {
            mean: 830,
            spread: 0.25,
        }
    }
}

/// Publish KV events and registrations to NATS.
#[derive(Debug, Clone, PartialEq)]
pub struct NatsConfig {
    /// `nats://host:port`.
    pub url: String,
    /// Subject namespace (`kvroute.<namespace>.…`).
    pub namespace: String,
    /// Lease of each announcement; heartbeats go out every third of it.
    pub lease_ms: u64,
    /// The shared registration token carried in announcements, heartbeats and goodbyes
    /// (`--registration-token`); gateways with a token ignore workers without it.
    pub registration_token: Option<String>,
    /// TLS and credentials for `url`.
    pub security: protocol::nats_client::NatsSecurity,
}

/// Everything an engine server needs. [`EngineServerConfig::new`] gives seed 002's worker
/// serving on `127.0.0.1:0` at real speed.
#[derive(Debug, Clone)]
pub struct EngineServerConfig {
    /// Where to listen (port 0: any free port; see `EngineServerHandle::local_addr`).
    pub listen: SocketAddr,
    /// The URL gateways should use to reach this server (announced over NATS); default
    /// `http://<local_addr>`.
    pub advertise_url: Option<String>,
    /// The engine core's settings (profile, block size, batch limits, queue bound…).
    /// `coalesce_decode` is forced off: the server runs step by step, in real time.
    pub engine: EngineConfig,
    pub worker_id: WorkerId,
    /// The model name served (`/v1/models`, request `model` must match).
    pub model: String,
    /// Divides every modelled duration: 10 runs the simulated GPU ten times faster.
    pub speedup: f64,
    /// Seed of the reply generator and reply lengths.
    pub seed: u64,
    pub reply_length: ReplyLength,
    /// Largest request body accepted (bigger: 413).
    pub body_limit_bytes: usize,
    /// A client's request headers, and an idle keep-alive connection's wait for its next
    /// request: the connection is closed after it (the gateway's listener, shared).
    pub header_timeout: std::time::Duration,
    /// A client's whole request body: 408 after it.
    pub body_timeout: std::time::Duration,
    /// Client connections served at once (more get 503 `too_many_connections`); `None`: what
    /// the open-file limit allows (`protocol::listener::default_max_connections`).
    pub max_connections: Option<usize>,
    /// Submissions and cancellations waiting for the engine task (full: 429).
    pub command_queue: usize,
    /// KV event batches waiting for the publishers; when full, batches are dropped, counted
    /// in `kvroute_engine_kv_batches_dropped_total`, and receivers see a sequence gap.
    pub kv_event_queue: usize,
    pub nats: Option<NatsConfig>,
    /// Publish KV events in vLLM's ZMQ format on this endpoint (bound: `tcp://127.0.0.1:5557`,
    /// port 0 picks a free port).
    pub zmq_pub: Option<String>,
    /// How each event is written on that socket: tagged maps (current vLLM, what vllm-router
    /// decodes) or arrays (earlier vLLM). kvroute's gateway reads both.
    pub zmq_event_encoding: EventEncoding,
    /// Answer replay requests for the last `zmq_replay_buffer` batches on this ROUTER
    /// endpoint (vLLM's `replay_endpoint`; port 0 picks a free port). Needs `zmq_pub`.
    pub zmq_replay: Option<String>,
    /// Batches kept for replay (vLLM's `buffer_steps`).
    pub zmq_replay_buffer: usize,
    /// The model's tokenizer and chat template (`--tokenizer`, `--chat-template`); `None`
    /// serves the built-in cl100k tokenizer with Llama-3's template.
    pub text: Option<Arc<text::Preprocessor>>,
    /// The `Hostname` label of the simulated DCGM metrics.
    pub hostname: String,
}

impl EngineServerConfig {
    /// Seed 002's worker (`h200-llama70b-fp8`) as worker 0, model `llama-3.1-70b-instruct`.
    pub fn new() -> Self {
        Self::with_profile(HardwareProfile::h200_llama70b_fp8())
    }

    /// A worker on `profile` with the profile's engine defaults.
    pub fn with_profile(profile: HardwareProfile) -> Self {
        EngineServerConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            advertise_url: None,
            engine: EngineConfig::from_profile(profile),
            worker_id: WorkerId(0),
            model: "llama-3.1-70b-instruct".to_string(),
            speedup: 1.0,
            seed: 0,
            reply_length: ReplyLength::default(),
            body_limit_bytes: 32 << 20,
            header_timeout: std::time::Duration::from_secs(30),
            body_timeout: std::time::Duration::from_secs(30),
            max_connections: None,
            command_queue: 4096,
            kv_event_queue: 4096,
            nats: None,
            zmq_pub: None,
            zmq_event_encoding: EventEncoding::default(),
            zmq_replay: None,
            zmq_replay_buffer: protocol::vllm::ReplayBuffer::DEFAULT_CAPACITY,
            text: None,
            hostname: std::env::var("HOSTNAME").unwrap_or_else(|_| "localhost".to_string()),
        }
    }
}

impl Default for EngineServerConfig {
    fn default() -> Self {
        Self::new()
    }
}
