//! NATS subject names and the worker registration messages.
//!
//! - `kvroute.<namespace>.kv.<worker>`: a worker's KV event batches
//!   ([`KvEventBatch`](crate::KvEventBatch), msgpack).
//! - `kvroute.<namespace>.workers`: [`WorkerMessage`]s (JSON): announcements, repeated as
//!   heartbeats within each lease, and goodbyes.
//!
//! A namespace is one NATS subject token: non-empty, at most 128 bytes, no `.`, `*`, `>` or
//! whitespace (so several clusters share one NATS server without seeing each other).

use kv_index::WorkerId;
use serde::{Deserialize, Serialize};
use thiserror::Error;

const PREFIX: &str = "kvroute";
/// Longest namespace accepted.
pub const MAX_NAMESPACE_LEN: usize = 128;

/// A namespace that cannot be a NATS subject token.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error(
    "namespace {0:?} is not a NATS subject token: use 1-128 characters without '.', '*', '>' or whitespace"
)]
pub struct BadNamespace(pub String);

/// The subjects of one namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subjects {
    namespace: String,
}

impl Subjects {
    pub fn new(namespace: &str) -> Result<Subjects, BadNamespace> {
        let valid = !namespace.is_empty()
            && namespace.len() <= MAX_NAMESPACE_LEN
            && !namespace
                .chars()
                .any(|c| c == '.' || c == '*' || c == '>' || c.is_whitespace());
        if valid {
            Ok(Subjects {
                namespace: namespace.to_string(),
            })
        } else {
            Err(BadNamespace(namespace.to_string()))
        }
    }

    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// Where `worker` publishes its KV events.
    pub fn kv_events(&self, worker: WorkerId) -> String {
        format!("{PREFIX}.{}.kv.{}", self.namespace, worker.0)
    }

    /// Subscribe here to receive every worker's KV events.
    pub fn kv_events_all(&self) -> String {
        format!("{PREFIX}.{}.kv.*", self.namespace)
    }

    /// The worker a KV event subject belongs to (`None` for another subject or namespace).
    pub fn parse_kv_events(&self, subject: &str) -> Option<WorkerId> {
        let rest = subject
            .strip_prefix(PREFIX)?
            .strip_prefix('.')?
            .strip_prefix(self.namespace.as_str())?
            .strip_prefix(".kv.")?;
        // Canonical decimal only, so one worker has one subject.
        if rest.is_empty() || (rest.len() > 1 && rest.starts_with('0')) {
            return None;
        }
        if !rest.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        rest.parse().ok().map(WorkerId)
    }

    /// Worker announcements, heartbeats and goodbyes.
    pub fn workers(&self) -> String {
        format!("{PREFIX}.{}.workers", self.namespace)
    }
}

/// A worker telling gateways it exists (repeated as a heartbeat) or is leaving.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum WorkerMessage {
    Announce(WorkerAnnounce),
    Goodbye {
        worker: u64,
        #[serde(default)]
        instance: u64,
    },
}

/// What a gateway needs to route to a worker. Sent on start-up and then every
/// `lease_ms / 3` or so; a gateway drops a worker it has not heard from for `lease_ms`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerAnnounce {
    pub worker: u64,
    /// The process run (random at start-up); a new value means the worker restarted with an
    /// empty cache and sequence numbers from 0.
    #[serde(default)]
    pub instance: u64,
    /// Base URL of its OpenAI-compatible HTTP API, e.g. `http://10.0.0.5:8000`.
    pub url: String,
    pub model: String,
    /// Tokens per KV block.
    pub block_size: u32,
    pub kv_capacity_blocks: u64,
    pub max_num_seqs: u32,
    /// How long this announcement is valid.
    pub lease_ms: u64,
    /// The model's context length in tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_model_len: Option<u32>,
    /// Where it publishes vLLM-format KV events over ZMQ, if it does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zmq_endpoint: Option<String>,
    /// Whether it publishes KV events on [`Subjects::kv_events`].
    #[serde(default)]
    pub nats_kv_events: bool,
    /// Modelled seconds to prefill one more prompt token (not divided by any speedup), for
    /// load-aware routing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_secs_per_token: Option<f64>,
    /// Modelled seconds one more token of context adds to each decode step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode_secs_per_context_token: Option<f64>,
}

/// `GET /info` of a kvroute engine server: what a gateway needs to route to it and where its
/// KV events are published.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerInfo {
    pub worker: u64,
    /// The process run (random at start-up).
    pub instance: u64,
    /// Base URL of its HTTP API.
    pub url: String,
    pub model: String,
    /// Hardware profile name (e.g. `h200-llama70b-fp8`).
    pub profile: String,
    /// Simulated GPU.
    pub gpu: String,
    pub block_size: u32,
    pub kv_capacity_blocks: u64,
    pub max_num_seqs: u32,
    pub max_model_len: u32,
    /// Modelled time runs this many times faster than wall time.
    pub speedup: f64,
    /// NATS server and subject of its KV events (our format), if it publishes there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nats_url: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nats_kv_subject: Option<String>,
    /// ZMQ endpoint of its KV events (vLLM's format), if it publishes there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zmq_endpoint: Option<String>,
    /// Modelled seconds to prefill one more prompt token (not divided by any speedup), for
    /// load-aware routing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_secs_per_token: Option<f64>,
    /// Modelled seconds one more token of context adds to each decode step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode_secs_per_context_token: Option<f64>,
}

impl WorkerInfo {
    /// The announcement a worker with this info sends, valid for `lease_ms`.
    pub fn announce(&self, lease_ms: u64) -> WorkerAnnounce {
        WorkerAnnounce {
            worker: self.worker,
            instance: self.instance,
            url: self.url.clone(),
            model: self.model.clone(),
            block_size: self.block_size,
            kv_capacity_blocks: self.kv_capacity_blocks,
            max_num_seqs: self.max_num_seqs,
            lease_ms,
            max_model_len: Some(self.max_model_len),
            zmq_endpoint: self.zmq_endpoint.clone(),
            nats_kv_events: self.nats_kv_subject.is_some(),
            prefill_secs_per_token: self.prefill_secs_per_token,
            decode_secs_per_context_token: self.decode_secs_per_context_token,
        }
    }
}

impl WorkerMessage {
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    pub fn decode(bytes: &[u8]) -> Result<WorkerMessage, serde_json::Error> {
        serde_json::from_slice(bytes)
    }

    /// The worker the message is about.
    pub fn worker(&self) -> WorkerId {
        match self {
            WorkerMessage::Announce(announce) => WorkerId(announce.worker),
            WorkerMessage::Goodbye { worker, .. } => WorkerId(*worker),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects_build_and_parse() {
        let s = Subjects::new("demo").unwrap();
        assert_eq!(s.kv_events(WorkerId(12)), "kvroute.demo.kv.12");
        assert_eq!(s.kv_events_all(), "kvroute.demo.kv.*");
        assert_eq!(s.workers(), "kvroute.demo.workers");
        assert_eq!(s.parse_kv_events("kvroute.demo.kv.12"), Some(WorkerId(12)));
        for other in [
            "kvroute.other.kv.12",
            "kvroute.demo.kv.",
            "kvroute.demo.kv.012",
            "kvroute.demo.kv.1x",
            "kvroute.demo.kv.-1",
            "kvroute.demo.workers",
            "kvroute.demox.kv.1",
            "kvroute.demo.kv.99999999999999999999999",
        ] {
            assert_eq!(s.parse_kv_events(other), None, "{other}");
        }
    }

    #[test]
    fn bad_namespaces() {
        for bad in ["", "a.b", "a*", "a>", "a b", &"x".repeat(129)] {
            assert!(Subjects::new(bad).is_err(), "{bad}");
        }
        assert!(Subjects::new("team-a_1").is_ok());
    }

    #[test]
    fn worker_messages_round_trip() {
        let announce = WorkerMessage::Announce(WorkerAnnounce {
            worker: 3,
            instance: 77,
            url: "http://127.0.0.1:9000".into(),
            model: "llama".into(),
            block_size: 32,
            kv_capacity_blocks: 100_000,
            max_num_seqs: 64,
            lease_ms: 3_000,
            max_model_len: Some(131_072),
            zmq_endpoint: None,
            nats_kv_events: true,
            prefill_secs_per_token: None,
            decode_secs_per_context_token: None,
        });
        let bytes = announce.encode();
        let json: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(json["type"], "announce");
        assert_eq!(WorkerMessage::decode(&bytes).unwrap(), announce);
        let bye = WorkerMessage::Goodbye {
            worker: 3,
            instance: 77,
        };
        assert_eq!(WorkerMessage::decode(&bye.encode()).unwrap(), bye);
        assert_eq!(bye.worker(), WorkerId(3));
        assert!(WorkerMessage::decode(b"{\"type\":\"hello\"}").is_err());
    }
}
