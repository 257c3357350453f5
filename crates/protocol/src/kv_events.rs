//! KV events over NATS, kvroute's own format: one msgpack map per batch of a worker's events.
//!
//! ```text
//! {"worker": u64, "instance": u64, "events": [
//!     {"seq": u64, "kind": {"Stored": {"parent": u64 | nil,
//!                                      "blocks": [{"id": u64, "tokens": [u32…]}
//!                                               | {"id": u64, "local_hash": u64}]}}},
//!     {"seq": u64, "kind": {"Removed": {"ids": [u64…]}}},
//!     {"seq": u64, "kind": "Cleared"}
//! ]}
//! ```
//!
//! Published on [`Subjects::kv_events`](crate::Subjects::kv_events). It maps 1:1 to
//! [`kv_index::KvEvent`]: a block carries its tokens (the receiver hashes them itself, as
//! DESIGN.md requires) or, from a producer that already uses `kv-index`'s scheme, the local
//! hash. `instance` names one run of the worker process: a receiver that sees it change knows
//! the worker restarted (its sequence numbers start again at 0 and its cache is empty), so it
//! clears that worker's blocks instead of taking the new events for stale ones. Maps with field
//! names (not msgpack arrays) so later fields can be added; unknown fields are ignored.

use kv_index::WorkerId;
use kv_index::{BlockContent, EngineBlockId, KvEvent, KvEventKind, LocalBlockHash, StoredBlock};
use serde::{Deserialize, Serialize};
use thiserror::Error;

/// A batch of one worker's events, in sequence order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvEventBatch {
    pub worker: u64,
    /// The worker process's run id (random at start-up); 0 when the producer does not say.
    #[serde(default)]
    pub instance: u64,
    pub events: Vec<WireKvEvent>,
}

/// One event of a batch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireKvEvent {
    pub seq: u64,
    pub kind: WireKvKind,
}

/// What happened.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum WireKvKind {
    Stored {
        parent: Option<u64>,
        blocks: Vec<WireBlock>,
    },
    Removed {
        ids: Vec<u64>,
    },
    Cleared,
}

/// One stored block: its engine id and either its tokens or its local hash.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireBlock {
    pub id: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<Vec<u32>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local_hash: Option<u64>,
}

/// A batch that cannot be decoded.
#[derive(Debug, Error)]
pub enum KvWireError {
    #[error("KV event batch is not valid msgpack of kvroute's format: {0}")]
    Decode(#[from] rmp_serde::decode::Error),
    #[error(
        "KV event batch: block {id:#x} carries {what}, expected exactly one of tokens or local_hash"
    )]
    BadBlock { id: u64, what: &'static str },
    #[error("a cache snapshot holds an event other than Stored")]
    NotStored,
    #[error("KV event batch from worker {batch} holds an event of worker {event}")]
    MixedWorkers { batch: u64, event: u64 },
    #[error(
        "KV event batch: a Stored event of {blocks} blocks and {tokens} tokens is over the \
         limit of {} blocks and {} tokens per event",
        MAX_STORED_BLOCKS,
        MAX_STORED_TOKENS
    )]
    TooLarge { blocks: usize, tokens: usize },
}

/// Most blocks one stored event may add to the index (a 512k-token prompt in blocks of 32):
/// a larger event is refused whole, so a bogus one cannot grow the index by itself.
pub const MAX_STORED_BLOCKS: usize = 16_384;
/// Most tokens one stored event may carry.
pub const MAX_STORED_TOKENS: usize = 1 << 19;

/// Refuses a stored event over [`MAX_STORED_BLOCKS`] or [`MAX_STORED_TOKENS`].
pub fn check_stored_size(blocks: usize, tokens: usize) -> Result<(), KvWireError> {
    if blocks > MAX_STORED_BLOCKS || tokens > MAX_STORED_TOKENS {
        Err(KvWireError::TooLarge { blocks, tokens })
    } else {
        Ok(())
    }
}

impl From<&KvEvent> for WireKvEvent {
    fn from(event: &KvEvent) -> Self {
        let kind = match &event.kind {
            KvEventKind::Stored { parent, blocks } => WireKvKind::Stored {
                parent: parent.map(|p| p.0),
                blocks: blocks
                    .iter()
                    .map(|block| match &block.content {
                        BlockContent::Tokens(tokens) => WireBlock {
                            id: block.id.0,
                            tokens: Some(tokens.clone()),
                            local_hash: None,
                        },
                        BlockContent::LocalHash(hash) => WireBlock {
                            id: block.id.0,
                            tokens: None,
                            local_hash: Some(hash.0),
                        },
                    })
                    .collect(),
            },
            KvEventKind::Removed { blocks } => WireKvKind::Removed {
                ids: blocks.iter().map(|b| b.0).collect(),
            },
            KvEventKind::Cleared => WireKvKind::Cleared,
        };
        WireKvEvent {
            seq: event.seq,
            kind,
        }
    }
}

impl WireKvEvent {
    /// The `kv-index` event, attributed to `worker`.
    pub fn to_kv_event(&self, worker: WorkerId) -> Result<KvEvent, KvWireError> {
        let kind = match &self.kind {
            WireKvKind::Stored { parent, blocks } => KvEventKind::Stored {
                parent: {
                    let tokens = blocks
                        .iter()
                        .map(|b| b.tokens.as_ref().map_or(0, Vec::len))
                        .sum();
                    check_stored_size(blocks.len(), tokens)?;
                    parent.map(EngineBlockId)
                },
                blocks: blocks
                    .iter()
                    .map(|block| {
                        let content = match (&block.tokens, block.local_hash) {
                            (Some(tokens), None) => BlockContent::Tokens(tokens.clone()),
                            (None, Some(hash)) => BlockContent::LocalHash(LocalBlockHash(hash)),
                            (Some(_), Some(_)) => {
                                return Err(KvWireError::BadBlock {
                                    id: block.id,
                                    what: "both",
                                });
                            }
                            (None, None) => {
                                return Err(KvWireError::BadBlock {
                                    id: block.id,
                                    what: "neither",
                                });
                            }
                        };
                        Ok(StoredBlock {
                            id: EngineBlockId(block.id),
                            content,
                        })
                    })
                    .collect::<Result<_, _>>()?,
            },
            WireKvKind::Removed { ids } => KvEventKind::Removed {
                blocks: ids.iter().copied().map(EngineBlockId).collect(),
            },
            WireKvKind::Cleared => KvEventKind::Cleared,
        };
        Ok(KvEvent {
            worker,
            seq: self.seq,
            kind,
        })
    }
}

impl KvEventBatch {
    /// A batch of `events`, all of which must be `worker`'s.
    pub fn from_events(
        worker: WorkerId,
        instance: u64,
        events: &[KvEvent],
    ) -> Result<KvEventBatch, KvWireError> {
        if let Some(other) = events.iter().find(|e| e.worker != worker) {
            return Err(KvWireError::MixedWorkers {
                batch: worker.0,
                event: other.worker.0,
            });
        }
        Ok(KvEventBatch {
            worker: worker.0,
            instance,
            events: events.iter().map(WireKvEvent::from).collect(),
        })
    }

    /// The batch's events as `kv-index` events.
    pub fn to_kv_events(&self) -> Result<Vec<KvEvent>, KvWireError> {
        self.events
            .iter()
            .map(|event| event.to_kv_event(WorkerId(self.worker)))
            .collect()
    }

    /// msgpack bytes (maps with field names).
    pub fn encode(&self) -> Vec<u8> {
        // Writing plain integers, strings and arrays to a Vec cannot fail.
        rmp_serde::to_vec_named(self).unwrap_or_default()
    }

    /// Parses msgpack bytes. Garbage or truncated input is an error, never a panic.
    pub fn decode(bytes: &[u8]) -> Result<KvEventBatch, KvWireError> {
        Ok(rmp_serde::from_slice(bytes)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_index::BlockHasher;

    fn sample_events() -> Vec<KvEvent> {
        let hasher = BlockHasher::new(4).unwrap();
        let tokens: Vec<u32> = (0..12).collect();
        vec![
            KvEvent {
                worker: WorkerId(7),
                seq: 0,
                kind: KvEventKind::stored_prompt(&hasher, &tokens),
            },
            KvEvent {
                worker: WorkerId(7),
                seq: 1,
                kind: KvEventKind::Stored {
                    parent: Some(EngineBlockId(42)),
                    blocks: vec![StoredBlock {
                        id: EngineBlockId(u64::MAX),
                        content: BlockContent::Tokens(vec![1, 2, 3, 4]),
                    }],
                },
            },
            KvEvent {
                worker: WorkerId(7),
                seq: 2,
                kind: KvEventKind::Removed {
                    blocks: vec![EngineBlockId(42), EngineBlockId(u64::MAX)],
                },
            },
            KvEvent {
                worker: WorkerId(7),
                seq: 3,
                kind: KvEventKind::Cleared,
            },
        ]
    }

    #[test]
    fn round_trips_every_kind() {
        let events = sample_events();
        let batch = KvEventBatch::from_events(WorkerId(7), 99, &events).unwrap();
        let decoded = KvEventBatch::decode(&batch.encode()).unwrap();
        assert_eq!(decoded, batch);
        assert_eq!(decoded.instance, 99);
        assert_eq!(decoded.to_kv_events().unwrap(), events);
    }

    #[test]
    fn wire_uses_field_names() {
        let batch = KvEventBatch::from_events(WorkerId(7), 1, &sample_events()[1..2]).unwrap();
        let value: rmpv::Value = rmpv::decode::read_value(&mut &batch.encode()[..]).unwrap();
        let text = value.to_string();
        for name in [
            "worker", "instance", "events", "seq", "Stored", "parent", "blocks", "tokens",
        ] {
            assert!(text.contains(name), "{name} missing from {text}");
        }
    }

    #[test]
    fn garbage_and_truncation_are_errors() {
        let bytes = KvEventBatch::from_events(WorkerId(7), 1, &sample_events())
            .unwrap()
            .encode();
        for cut in 0..bytes.len() {
            assert!(KvEventBatch::decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        assert!(KvEventBatch::decode(b"\xc1garbage").is_err());
    }

    #[test]
    fn block_needs_exactly_one_content() {
        let event = WireKvEvent {
            seq: 0,
            kind: WireKvKind::Stored {
                parent: None,
                blocks: vec![WireBlock {
                    id: 1,
                    tokens: None,
                    local_hash: None,
                }],
            },
        };
        assert!(matches!(
            event.to_kv_event(WorkerId(1)),
            Err(KvWireError::BadBlock {
                what: "neither",
                ..
            })
        ));
    }

    #[test]
    fn mixed_workers_are_refused() {
        let mut events = sample_events();
        events[1].worker = WorkerId(8);
        assert!(KvEventBatch::from_events(WorkerId(7), 0, &events).is_err());
    }
}
