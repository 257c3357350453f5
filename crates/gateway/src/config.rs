//! Gateway settings: what `kvroute gateway` flags become, and what [`Gateway::bind`] takes.
//!
//! [`Gateway::bind`]: crate::Gateway::bind

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use kv_index::WorkerId;
use protocol::WorkerRole;
use router::{KvSource, RouterConfig, WorkerLimits};

/// How a worker wants its prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PromptFormat {
    /// Token ids (`/v1/completions` with `"prompt": [ids]`): tokenized once, by the gateway.
    #[default]
    Tokens,
    /// The rendered text, for backends that tokenize themselves.
    Text,
}

/// One `--worker` entry: a worker's base URL plus what the gateway cannot learn from its
/// `/info` card (foreign backends such as vLLM have none).
///
/// Written `URL[,key=value]…` with keys `id`, `block_size`, `capacity` (KV blocks),
/// `max_num_seqs`, `zmq` (a vLLM- or SGLang-format KV event endpoint, e.g.
/// `tcp://host:5557`), `zmq_replay` (that publisher's replay endpoint, its
/// `replay_endpoint`, e.g. `tcp://host:5558`), `prompt` (`tokens` or `text`) and `role` (`both`, `prefill` or `decode`: its pool in
/// disaggregated serving; vLLM's `kv_both`, `kv_producer`, `kv_consumer` are accepted too).
/// Values given here win over the worker's `/info`.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerSpec {
    /// Base URL, without a trailing slash (`http://10.0.0.5:8000`).
    pub url: String,
    pub id: Option<WorkerId>,
    pub block_size: Option<usize>,
    /// `capacity` and `max_num_seqs`; each wins over the worker's card.
    pub limits: WorkerLimits,
    /// ZMQ endpoint publishing this worker's KV events in vLLM's (or SGLang's) format.
    pub zmq: Option<String>,
    /// That publisher's replay endpoint (a ROUTER), to fill sequence gaps.
    pub zmq_replay: Option<String>,
    pub prompt: PromptFormat,
    /// Its part in disaggregated serving, when the flag says (else its card's).
    pub role: Option<WorkerRole>,
}

impl WorkerSpec {
    /// A worker at `url` with nothing else specified.
    pub fn new(url: impl Into<String>) -> WorkerSpec {
        WorkerSpec {
            url: url.into().trim_end_matches('/').to_string(),
            id: None,
            block_size: None,
            limits: WorkerLimits::default(),
            zmq: None,
            zmq_replay: None,
            prompt: PromptFormat::Tokens,
            role: None,
        }
    }

    /// The id the gateway gives a worker that does not name itself: a hash of its URL, so
    /// every gateway replica derives the same one.
    pub fn default_id(url: &str) -> WorkerId {
        WorkerId(xxhash_rust::xxh3::xxh3_64(url.as_bytes()) >> 1)
    }
}

/// A `--worker` value the gateway cannot use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerSpecError(String);

impl fmt::Display for WorkerSpecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}; expected URL[,id=N][,block_size=N][,capacity=BLOCKS][,max_num_seqs=N]\
             [,zmq=tcp://HOST:PORT[,zmq_replay=tcp://HOST:PORT]][,prompt=tokens|text][,role=both|prefill|decode]",
            self.0
        )
    }
}

impl std::error::Error for WorkerSpecError {}

impl FromStr for WorkerSpec {
    type Err = WorkerSpecError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut parts = s.split(',').map(str::trim);
        let url = parts.next().unwrap_or_default();
        if !(url.starts_with("http://") || url.starts_with("https://")) || url.len() < 8 {
            return Err(WorkerSpecError(format!(
                "worker `{s}`: the first part must be an http:// or https:// URL"
            )));
        }
        let mut spec = WorkerSpec::new(url);
        for part in parts.filter(|p| !p.is_empty()) {
            let Some((key, value)) = part.split_once('=') else {
                return Err(WorkerSpecError(format!(
                    "worker `{s}`: `{part}` is not key=value"
                )));
            };
            let number = |what: &str| -> Result<u64, WorkerSpecError> {
                value.parse::<u64>().map_err(|_| {
                    WorkerSpecError(format!(
                        "worker `{s}`: {what} must be a non-negative integer, got `{value}`"
                    ))
                })
            };
            match key {
                "id" => spec.id = Some(WorkerId(number("id")?)),
                "block_size" => {
                    let n = number("block_size")?;
                    if n == 0 {
                        return Err(WorkerSpecError(format!(
                            "worker `{s}`: block_size must be at least 1"
                        )));
                    }
                    spec.block_size = Some(n as usize);
                }
                "capacity" => spec.limits.kv_capacity_blocks = Some(number("capacity")?),
                "max_num_seqs" => {
                    spec.limits.max_num_seqs =
                        Some(u32::try_from(number("max_num_seqs")?).map_err(|_| {
                            WorkerSpecError(format!("worker `{s}`: max_num_seqs is too large"))
                        })?)
                }
                "zmq" => {
                    if !value.starts_with("tcp://") {
                        return Err(WorkerSpecError(format!(
                            "worker `{s}`: zmq must be a tcp:// endpoint, got `{value}`"
                        )));
                    }
                    spec.zmq = Some(value.to_string());
                }
                "zmq_replay" => {
                    if !value.starts_with("tcp://") {
                        return Err(WorkerSpecError(format!(
                            "worker `{s}`: zmq_replay must be a tcp:// endpoint, got `{value}`"
                        )));
                    }
                    spec.zmq_replay = Some(value.to_string());
                }
                "prompt" => {
                    spec.prompt = match value {
                        "tokens" => PromptFormat::Tokens,
                        "text" => PromptFormat::Text,
                        _ => {
                            return Err(WorkerSpecError(format!(
                                "worker `{s}`: prompt must be `tokens` or `text`, got `{value}`"
                            )));
                        }
                    }
                }
                "role" => {
                    spec.role = Some(value.parse().map_err(|e: protocol::UnknownRole| {
                        WorkerSpecError(format!("worker `{s}`: {e}"))
                    })?)
                }
                _ => {
                    return Err(WorkerSpecError(format!(
                        "worker `{s}`: unknown key `{key}`"
                    )));
                }
            }
        }
        if spec.zmq_replay.is_some() && spec.zmq.is_none() {
            return Err(WorkerSpecError(format!(
                "worker `{s}`: zmq_replay replays the events of a zmq= endpoint; give that too"
            )));
        }
        Ok(spec)
    }
}

/// Everything [`Gateway::bind`](crate::Gateway::bind) needs.
#[derive(Debug, Clone)]
pub struct GatewayConfig {
    /// Address to listen on; port 0 picks a free one (see `Gateway::local_addr`).
    pub listen: SocketAddr,
    /// The model name clients must ask for (`GET /v1/models` lists it).
    pub model: String,
    /// The model's context length in tokens: longer prompts get `context_length_exceeded`.
    pub context_length: u32,
    /// Static workers.
    pub workers: Vec<WorkerSpec>,
    /// The router core's settings (policy and its parameters, block size, seed, KV events or
    /// approximate mode), as `kvroute gateway` builds them from its flags.
    pub router: RouterConfig,
    /// Take the router's block size from the static workers (their flags, else their
    /// `/info`) instead of `router.block_size`, which stays the default when none declares
    /// one. Workers that disagree are an error.
    pub block_size_from_workers: bool,
    /// With `block_size_from_workers`: how long to wait at start-up for one static worker
    /// to answer `/info` when none does yet.
    pub block_size_wait: Duration,
    /// NATS server for KV events in our format and dynamic worker registration.
    pub nats_url: Option<String>,
    /// TLS and credentials for `nats_url`.
    pub nats_security: protocol::nats_client::NatsSecurity,
    /// Namespace of NATS subjects (`kvroute.<namespace>.…`).
    pub namespace: String,
    /// The shared registration token: NATS worker messages without it are ignored
    /// (`--registration-token`; the engines' must match).
    pub registration_token: Option<String>,
    /// Per-client rate limit of `/v1/*` (429 with `Retry-After` beyond); `None`: none.
    pub rate_limit: Option<crate::rate_limit::RateLimit>,
    /// Largest request body accepted (413 beyond).
    pub max_body_bytes: usize,
    /// Admission: requests in flight per worker before new ones queue, requests that may wait
    /// for a free slot (429 beyond), how long one may wait (503 after). The simulator's
    /// settings and defaults too.
    pub frontend: router::FrontendConfig,
    /// How often workers' `/health` is checked.
    pub health_interval: Duration,
    /// Timeout of one health check or `/info` probe.
    pub probe_timeout: Duration,
    /// A HF `tokenizer.json`; the built-in tokenizer otherwise.
    pub tokenizer: Option<PathBuf>,
    /// A HF `tokenizer_config.json` with a `chat_template`; the built-in Llama-3 template
    /// otherwise.
    pub tokenizer_config: Option<PathBuf>,
    /// Most workers known at once (static and dynamic); registrations beyond are refused.
    pub max_workers: usize,
    /// Disaggregated serving, when workers declare prefill and decode roles: a request with
    /// at most this many prompt tokens uncached on its decode worker is prefilled there
    /// (see [`router::DisaggConfig::local_prefill_max_tokens`]).
    pub local_prefill_max_tokens: u32,
    /// Longest wait for a prefill worker's answer before the request is prefilled on its
    /// decode worker instead.
    pub prefill_timeout: Duration,
    /// Timeouts of the gateway's calls to workers and of its clients' connections.
    pub timeouts: Timeouts,
    /// Largest non-streamed reply gathered from a worker (the text of all its choices); a
    /// worker sending more gets the client a 502.
    pub max_response_bytes: usize,
    /// How long a failed worker stays out of the routing set, whatever its health checks say.
    pub ejection: router::EjectionConfig,
    /// Times one request may be resent to another worker after its worker broke or stalled
    /// mid-stream (0: the stream ends with an error event).
    pub migration_limit: u32,
    /// With `nats_url`: this gateway is one of several replicas that route as one.
    pub replica: ReplicaSettings,
    /// Client connections served at once (more get 503 `too_many_connections`); `None`: what
    /// the open-file limit allows (`protocol::listener::default_max_connections`).
    pub max_connections: Option<usize>,
}

/// A gateway as one of several replicas behind one address ([`crate::replicas`]): with NATS,
/// replicas tell each other what they routed and when it ended, so each one's load view
/// counts its peers' requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplicaSettings {
    /// This replica's id among its peers; `None`: derived from the host, process and start
    /// time (printed at start-up).
    pub id: Option<u32>,
    /// Share routing decisions with the peers (`--no-replica-sync` turns it off).
    pub sync: bool,
    /// Longest an update waits to be batched with others: with NATS delivery, the bound on
    /// how stale a peer's view of this replica's load is.
    pub flush_interval: Duration,
    /// A header-only message at least this often, so peers know this replica lives.
    pub heartbeat: Duration,
    /// A peer not heard from for this long died without a goodbye: its requests are released.
    pub peer_lease: Duration,
    /// How long a starting replica waits for its peers' snapshots.
    pub snapshot_timeout: Duration,
}

impl Default for ReplicaSettings {
    fn default() -> Self {
        let timing = router::ReplicaTiming::default();
        ReplicaSettings {
            id: None,
            sync: true,
            flush_interval: timing.flush_interval.into(),
            heartbeat: timing.heartbeat.into(),
            peer_lease: timing.peer_lease.into(),
            snapshot_timeout: timing.snapshot_timeout.into(),
        }
    }
}

/// How long each phase of a connection may take, upstream (gateway to worker) and downstream
/// (client to gateway). A worker that misses an upstream deadline is ejected from the routing
/// set until it passes a health check again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// Opening a TCP connection to a worker.
    pub connect: Duration,
    /// From sending a request to a worker to its first body bytes (response headers and the
    /// first SSE event: the worker's queueing and prefill). Missed before anything reached the
    /// client, the request is retried once on another worker.
    pub first_byte: Duration,
    /// Longest silence between two reads of a worker's stream once it started; a stream that
    /// stalls longer ends with an error event.
    pub stall: Duration,
    /// A client's request headers, and an idle keep-alive connection's next request (hyper's
    /// header read timeout covers both): the connection is closed after it.
    pub header: Duration,
    /// A client's whole request body: 408 after it.
    pub body: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        let failover = router::FailoverConfig::default();
        Timeouts {
            connect: Duration::from_secs(2),
            first_byte: failover.first_byte_timeout.into(),
            stall: failover.stall_timeout.into(),
            header: Duration::from_secs(30),
            body: Duration::from_secs(30),
        }
    }
}

impl Default for GatewayConfig {
    fn default() -> Self {
        // The failover defaults live in the router core, where the simulator reads them too.
        let failover = router::FailoverConfig::default();
        GatewayConfig {
            listen: SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 8000),
            model: "kvroute".to_string(),
            context_length: 131_072,
            workers: Vec::new(),
            router: RouterConfig::default(),
            block_size_from_workers: false,
            block_size_wait: Duration::from_secs(30),
            nats_url: None,
            nats_security: Default::default(),
            namespace: "default".to_string(),
            registration_token: None,
            rate_limit: None,
            max_body_bytes: 16 << 20,
            frontend: router::FrontendConfig::default(),
            health_interval: failover.health_interval.into(),
            probe_timeout: failover.probe_timeout.into(),
            tokenizer: None,
            tokenizer_config: None,
            max_workers: 1024,
            local_prefill_max_tokens: router::DisaggConfig::default().local_prefill_max_tokens,
            prefill_timeout: Duration::from_secs(60),
            timeouts: Timeouts::default(),
            max_response_bytes: 16 << 20,
            ejection: failover.ejection,
            migration_limit: failover.migration_limit,
            replica: ReplicaSettings::default(),
            max_connections: None,
        }
    }
}

impl GatewayConfig {
    /// Whether the router reads workers' KV events (otherwise it predicts caches itself).
    pub fn kv_events(&self) -> bool {
        self.router.kv_source == KvSource::Events
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_spec_parses_every_key() {
        let spec: WorkerSpec = "http://h:8000/,id=7,block_size=16,capacity=1000,max_num_seqs=64,\
                                zmq=tcp://h:5557,zmq_replay=tcp://h:5558,prompt=text,role=prefill"
            .parse()
            .unwrap();
        assert_eq!(spec.role, Some(WorkerRole::Prefill));
        assert_eq!(spec.url, "http://h:8000");
        assert_eq!(spec.id, Some(WorkerId(7)));
        assert_eq!(spec.block_size, Some(16));
        assert_eq!(spec.limits.kv_capacity_blocks, Some(1000));
        assert_eq!(spec.limits.max_num_seqs, Some(64));
        assert_eq!(spec.zmq.as_deref(), Some("tcp://h:5557"));
        assert_eq!(spec.zmq_replay.as_deref(), Some("tcp://h:5558"));
        assert_eq!(spec.prompt, PromptFormat::Text);
    }

    #[test]
    fn worker_spec_refuses_what_it_cannot_use() {
        for bad in [
            "h:8000",
            "http://h,id=x",
            "http://h,block_size=0",
            "http://h,zmq=ipc://x",
            "http://h,zmq=tcp://h:1,zmq_replay=h:2",
            "http://h,zmq_replay=tcp://h:2",
            "http://h,prompt=words",
            "http://h,colour=red",
            "http://h,role=producer",
            "http://h,id",
        ] {
            let err = bad.parse::<WorkerSpec>().unwrap_err().to_string();
            assert!(err.contains("expected URL"), "{bad}: {err}");
        }
    }

    #[test]
    fn default_ids_are_stable_and_distinct() {
        let a = WorkerSpec::default_id("http://a:1");
        assert_eq!(a, WorkerSpec::default_id("http://a:1"));
        assert_ne!(a, WorkerSpec::default_id("http://a:2"));
    }
}
