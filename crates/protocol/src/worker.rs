//! How a worker describes itself: one [`WorkerCard`], served by `GET /info`, embedded in the
//! NATS announcement ([`WorkerMessage::Announce`], plus a lease), and read back by gateways.
//!
//! The card is what a worker *declares*; every field a foreign backend may not know is
//! optional, and the names other servers use are accepted as aliases (`worker_id`/`id`,
//! `kv_block_size`, `num_gpu_blocks`/`capacity_blocks`, `zmq`), so any JSON object parses as a
//! card, declaring what it names. The numbers the router uses are a [`WorkerLimits`], the very
//! type the router takes, flattened into the card: a new declared figure is a field there,
//! filled in by the engine, and no type here changes.

use kv_index::WorkerId;
use serde::{Deserialize, Serialize};
use thiserror::Error;
use worker_limits::WorkerLimits;

/// What a worker declares about itself: who and where it is, what it serves, what the
/// router needs to price it ([`WorkerLimits`]) and where its KV events are published.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct WorkerCard {
    /// Its id across the system (`kvroute engine --worker-id`). A foreign backend may have
    /// none; gateways then derive one from its URL.
    #[serde(alias = "worker_id", alias = "id")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub worker: Option<WorkerId>,
    /// The process run (random at start-up); a new value means the worker restarted with an
    /// empty cache and sequence numbers from 0.
    pub instance: u64,
    /// Base URL of its OpenAI-compatible HTTP API, e.g. `http://10.0.0.5:8000`.
    pub url: String,
    /// The model it serves.
    pub model: String,
    /// Hardware profile name (e.g. `h200-llama70b-fp8`) of a simulated engine.
    pub profile: Option<String>,
    /// The GPU it runs on (simulated engines: the profile's).
    pub gpu: Option<String>,
    /// Tokens per KV block; gateways refuse a worker whose blocks differ from their router's.
    #[serde(alias = "kv_block_size")]
    pub block_size: Option<u32>,
    /// The model's context length in tokens.
    pub max_model_len: Option<u32>,
    /// Batch limit, KV capacity and marginal timing, for load-aware routing (flat fields on
    /// the wire: `max_num_seqs`, `kv_capacity_blocks`, `prefill_secs_per_token`, …).
    #[serde(flatten)]
    pub limits: WorkerLimits,
    /// Modelled time runs this many times faster than wall time (simulated engines).
    pub speedup: Option<f64>,
    /// NATS server of its KV events in kvroute's format, if it publishes there.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nats_url: Option<String>,
    /// The subject of those events (`kvroute.<ns>.kv.<worker>`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nats_kv_subject: Option<String>,
    /// ZMQ endpoint of its KV events in vLLM's format, if it publishes there.
    #[serde(alias = "zmq", skip_serializing_if = "Option::is_none")]
    pub zmq_endpoint: Option<String>,
    /// The ROUTER endpoint that replays those events' recent batches after a gap (vLLM's
    /// and SGLang's `replay_endpoint`), if it offers one.
    #[serde(alias = "replay_endpoint", skip_serializing_if = "Option::is_none")]
    pub zmq_replay_endpoint: Option<String>,
    /// The path on its URL that answers, over HTTP, the whole cache its ZMQ stream implies
    /// ([`crate::ZmqKvState`]; a kvroute engine's `/kv_state`), for a subscriber that joined
    /// late or lost batches its replay no longer holds. vLLM and SGLang offer none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub zmq_kv_state_path: Option<String>,
    /// It returns generated token ids when a request asks (`return_token_ids`), so a
    /// gateway counts tokens exactly even when one chunk carries several.
    pub returns_token_ids: bool,
    /// What it serves in disaggregated serving (`kvroute engine --role`); a card that does
    /// not say is `both` (aggregated).
    pub role: WorkerRole,
    /// Its speculative decoding, when on (`kvroute engine --spec-decode`). The timing in
    /// `limits` already prices it; this says why the timing is what it is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub speculative: Option<SpeculativeInfo>,
}

/// A worker's speculative-decoding settings, as declared in its card.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SpeculativeInfo {
    /// `draft` (a draft model) or `eagle3` (EAGLE-3 heads).
    pub method: String,
    /// Draft tokens proposed per step (K).
    pub draft_len: u32,
    /// The configured per-token acceptance probability (α), averaged over content classes.
    pub acceptance_rate: f64,
    /// Tokens a sequence gains per step on average, E = (1 − α^(K+1)) / (1 − α).
    pub tokens_per_step: f64,
}

/// A worker's part in disaggregated prefill/decode serving. The wire names are kvroute's
/// (`both`, `prefill`, `decode`); vLLM's `kv_role` names (`kv_both`, `kv_producer`,
/// `kv_consumer`, from `--kv-transfer-config`) are accepted as aliases.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WorkerRole {
    /// Prefills and decodes (vLLM's `kv_both`); serves every leg.
    #[default]
    #[serde(alias = "kv_both", alias = "aggregated")]
    Both,
    /// Computes prompts and hands their KV to a decode worker (vLLM's `kv_producer`).
    #[serde(alias = "kv_producer")]
    Prefill,
    /// Decodes after pulling a prompt's KV from a prefill worker, or serves a whole request
    /// when the gateway prefills locally (vLLM's `kv_consumer`).
    #[serde(alias = "kv_consumer")]
    Decode,
}

impl WorkerRole {
    pub const ALL: [WorkerRole; 3] = [WorkerRole::Both, WorkerRole::Prefill, WorkerRole::Decode];

    /// The wire name (`both`, `prefill`, `decode`), also the metrics label.
    pub fn as_str(self) -> &'static str {
        match self {
            WorkerRole::Both => "both",
            WorkerRole::Prefill => "prefill",
            WorkerRole::Decode => "decode",
        }
    }

    /// vLLM's `kv_role` of the same part.
    pub fn vllm_kv_role(self) -> &'static str {
        match self {
            WorkerRole::Both => "kv_both",
            WorkerRole::Prefill => "kv_producer",
            WorkerRole::Decode => "kv_consumer",
        }
    }
}

impl std::fmt::Display for WorkerRole {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A role name that is none of [`WorkerRole`]'s.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error(
    "unknown worker role `{0}`: expected both, prefill or decode (or vLLM's kv_both, kv_producer, kv_consumer)"
)]
pub struct UnknownRole(pub String);

impl std::str::FromStr for WorkerRole {
    type Err = UnknownRole;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "both" | "kv_both" | "aggregated" => Ok(WorkerRole::Both),
            "prefill" | "kv_producer" => Ok(WorkerRole::Prefill),
            "decode" | "kv_consumer" => Ok(WorkerRole::Decode),
            _ => Err(UnknownRole(s.to_string())),
        }
    }
}

/// A worker telling gateways it exists (repeated as a heartbeat) or is leaving.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
// One message per heartbeat, decoded and dropped at once: boxing the card would buy nothing.
#[allow(clippy::large_enum_variant)]
pub enum WorkerMessage {
    Announce(WorkerAnnounce),
    Goodbye {
        worker: u64,
        instance: u64,
        /// The registration token (see [`WorkerAnnounce::token`]).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        token: Option<String>,
    },
}

/// A worker's card, valid for `lease_ms`. Sent on start-up and then every `lease_ms / 3` or
/// so; a gateway drops a worker it has not heard from for `lease_ms`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerAnnounce {
    #[serde(flatten)]
    pub card: WorkerCard,
    /// How long this announcement is valid.
    pub lease_ms: u64,
    /// The shared registration token (`--registration-token`), when the cluster has one: a
    /// gateway with a token ignores messages without it. Never part of the card (`/info`
    /// is public).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
}

/// A worker message that cannot be read.
#[derive(Debug, Error)]
pub enum WorkerMessageError {
    #[error("worker message is not kvroute's JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("a worker announcement must name its {0}")]
    Incomplete(&'static str),
}

impl WorkerMessage {
    /// The message as JSON. Fails only if a type here stops being plain data (the error
    /// says which), never silently.
    pub fn encode(&self) -> Result<Vec<u8>, serde_json::Error> {
        serde_json::to_vec(self)
    }

    /// Reads a message; an announcement must name its worker, URL and block size.
    pub fn decode(bytes: &[u8]) -> Result<WorkerMessage, WorkerMessageError> {
        let message: WorkerMessage = serde_json::from_slice(bytes)?;
        if let WorkerMessage::Announce(WorkerAnnounce { card, .. }) = &message {
            if card.worker.is_none() {
                return Err(WorkerMessageError::Incomplete("worker"));
            }
            if card.url.is_empty() {
                return Err(WorkerMessageError::Incomplete("url"));
            }
            if card.block_size.is_none() {
                return Err(WorkerMessageError::Incomplete("block_size"));
            }
        }
        Ok(message)
    }

    /// The worker the message is about ([`WorkerMessage::decode`] checked that an
    /// announcement names one).
    pub fn worker(&self) -> WorkerId {
        match self {
            WorkerMessage::Announce(announce) => announce.card.worker.unwrap_or_default(),
            WorkerMessage::Goodbye { worker, .. } => WorkerId(*worker),
        }
    }

    /// The registration token the message carries.
    pub fn token(&self) -> Option<&str> {
        match self {
            WorkerMessage::Announce(announce) => announce.token.as_deref(),
            WorkerMessage::Goodbye { token, .. } => token.as_deref(),
        }
    }

    /// Whether the message carries `expected` (compared without an early exit, so the time
    /// taken hints nothing about the token); any message passes when `expected` is `None`.
    pub fn has_token(&self, expected: Option<&str>) -> bool {
        let Some(expected) = expected else {
            return true;
        };
        self.token().is_some_and(|given| {
            given.len() == expected.len()
                && given
                    .bytes()
                    .zip(expected.bytes())
                    .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                    == 0
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use worker_limits::WorkerTiming;

    fn card() -> WorkerCard {
        WorkerCard {
            worker: Some(WorkerId(3)),
            instance: 77,
            url: "http://127.0.0.1:9000".into(),
            model: "llama".into(),
            profile: Some("h200-llama70b-fp8".into()),
            gpu: Some("H200".into()),
            block_size: Some(32),
            max_model_len: Some(131_072),
            limits: WorkerLimits {
                max_num_seqs: Some(64),
                kv_capacity_blocks: Some(100_000),
                timing: Some(WorkerTiming::H200_LLAMA70B_FP8),
            },
            speedup: Some(1.0),
            nats_url: Some("nats://127.0.0.1:4222".into()),
            nats_kv_subject: Some("kvroute.demo.kv.3".into()),
            zmq_endpoint: None,
            zmq_replay_endpoint: None,
            zmq_kv_state_path: None,
            returns_token_ids: true,
            role: WorkerRole::Decode,
            speculative: Some(SpeculativeInfo {
                method: "eagle3".into(),
                draft_len: 5,
                acceptance_rate: 0.78,
                tokens_per_step: 3.4,
            }),
        }
    }

    #[test]
    fn worker_messages_round_trip() {
        let announce = WorkerMessage::Announce(WorkerAnnounce {
            card: card(),
            lease_ms: 3_000,
            token: None,
        });
        let bytes = announce.encode().unwrap();
        let json: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(json["type"], "announce");
        assert_eq!(json["worker"], 3, "the card is flat in the announcement");
        assert_eq!(json["lease_ms"], 3_000);
        assert_eq!(json["kv_capacity_blocks"], 100_000);
        assert_eq!(WorkerMessage::decode(&bytes).unwrap(), announce);
        assert_eq!(announce.worker(), WorkerId(3));
        let bye = WorkerMessage::Goodbye {
            worker: 3,
            instance: 77,
            token: None,
        };
        assert_eq!(WorkerMessage::decode(&bye.encode().unwrap()).unwrap(), bye);
        assert_eq!(bye.worker(), WorkerId(3));
        assert!(WorkerMessage::decode(b"{\"type\":\"hello\"}").is_err());
        assert!(announce.has_token(None));
        assert!(
            !announce.has_token(Some("s")),
            "no token where one is expected"
        );
    }

    #[test]
    fn tokens_travel_beside_the_card_and_are_checked() {
        let announce = WorkerMessage::Announce(WorkerAnnounce {
            card: card(),
            lease_ms: 3_000,
            token: Some("secret".into()),
        });
        let json: serde_json::Value = serde_json::from_slice(&announce.encode().unwrap()).unwrap();
        assert_eq!(json["token"], "secret");
        let back = WorkerMessage::decode(&announce.encode().unwrap()).unwrap();
        assert_eq!(back, announce);
        assert!(back.has_token(Some("secret")));
        assert!(!back.has_token(Some("secres")));
        assert!(!back.has_token(Some("secret2")));
        let card_json = serde_json::to_value(card()).unwrap();
        assert!(
            card_json.get("token").is_none(),
            "the card never carries it"
        );
        let bye: WorkerMessage =
            WorkerMessage::decode(br#"{"type":"goodbye","worker":3,"instance":1,"token":"t"}"#)
                .unwrap();
        assert!(bye.has_token(Some("t")) && !bye.has_token(Some("u")));
    }

    #[test]
    fn roles_read_kvroute_and_vllm_names_and_default_to_both() {
        let plain: WorkerCard = serde_json::from_str(r#"{"url":"http://w:1"}"#).unwrap();
        assert_eq!(plain.role, WorkerRole::Both);
        for (name, role) in [
            ("prefill", WorkerRole::Prefill),
            ("kv_producer", WorkerRole::Prefill),
            ("decode", WorkerRole::Decode),
            ("kv_consumer", WorkerRole::Decode),
            ("kv_both", WorkerRole::Both),
        ] {
            let named: WorkerCard =
                serde_json::from_str(&format!(r#"{{"role":"{name}"}}"#)).unwrap();
            assert_eq!(named.role, role, "{name}");
            assert_eq!(name.parse::<WorkerRole>().unwrap(), role);
        }
        let err = "producer".parse::<WorkerRole>().unwrap_err().to_string();
        assert!(err.contains("prefill") && err.contains("producer"), "{err}");
        let json = serde_json::to_value(card()).unwrap();
        assert_eq!(json["role"], "decode");
    }

    #[test]
    fn announcements_must_name_their_worker_url_and_block_size() {
        let nameless = br#"{"type":"announce","url":"http://w:1","block_size":32,"lease_ms":300}"#;
        assert!(matches!(
            WorkerMessage::decode(nameless),
            Err(WorkerMessageError::Incomplete("worker"))
        ));
        let nowhere = br#"{"type":"announce","worker":4,"block_size":32,"lease_ms":300}"#;
        assert!(matches!(
            WorkerMessage::decode(nowhere),
            Err(WorkerMessageError::Incomplete("url"))
        ));
        let blockless = br#"{"type":"announce","worker":4,"url":"http://w:1","lease_ms":300}"#;
        assert!(matches!(
            WorkerMessage::decode(blockless),
            Err(WorkerMessageError::Incomplete("block_size"))
        ));
        let leaseless = br#"{"type":"announce","worker":4,"url":"http://w:1","block_size":32}"#;
        assert!(matches!(
            WorkerMessage::decode(leaseless),
            Err(WorkerMessageError::Json(_))
        ));
    }

    #[test]
    fn cards_round_trip_and_foreign_info_documents_parse() {
        let card = card();
        let json = serde_json::to_value(&card).unwrap();
        assert_eq!(json["prefill_secs_per_token"], 1.4074e-4);
        assert_eq!(serde_json::from_value::<WorkerCard>(json).unwrap(), card);

        // Another server's `/info`, in its own names; what it does not say stays unknown.
        let foreign: WorkerCard = serde_json::from_str(
            r#"{"worker_id": 9, "kv_block_size": 16, "num_gpu_blocks": 1000,
                "zmq": "tcp://w:5557", "version": "0.11"}"#,
        )
        .unwrap();
        assert_eq!(foreign.worker, Some(WorkerId(9)));
        assert_eq!(foreign.block_size, Some(16));
        assert_eq!(foreign.limits.kv_capacity_blocks, Some(1000));
        assert_eq!(foreign.limits.max_num_seqs, None);
        assert_eq!(foreign.limits.timing, None);
        assert_eq!(foreign.zmq_endpoint.as_deref(), Some("tcp://w:5557"));
        assert!(!foreign.returns_token_ids);
        let by_id: WorkerCard = serde_json::from_str(r#"{"id": 2, "capacity_blocks": 5}"#).unwrap();
        assert_eq!(by_id.worker, Some(WorkerId(2)));
        assert_eq!(by_id.limits.kv_capacity_blocks, Some(5));
        assert_eq!(
            serde_json::from_str::<WorkerCard>("{}").unwrap(),
            WorkerCard::default()
        );
    }
}
