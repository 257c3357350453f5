//! A worker's whole prefix cache on the wire, for a gateway that subscribed to its KV events
//! late (why: `kv_index::mirror`).
//!
//! A kvroute engine keeps a [`kv_index::CacheMirror`] of its published stream and answers a
//! [`KvStateRequest`] on `kvroute.<ns>.kv_state.<worker>` with [`KvStatePart`]s
//! ([`state_parts`]): `Stored` events, parents before children, and the sequence number of
//! the first event the snapshot does not cover. The gateway holds that worker's live batches
//! while it waits, puts the parts back together ([`KvStateAssembly`], bounded), applies them
//! with `KvIndex::restore_worker`, then the held batches from that number on.

use kv_index::{KvEventKind, MAX_MIRROR_BLOCKS, WorkerId};
use serde::{Deserialize, Serialize};

use crate::kv_events::{KvWireError, MAX_STORED_BLOCKS, WireKvEvent, WireKvKind};

/// Blocks per [`KvStatePart`]: about 300 KiB of msgpack, under NATS's default 1 MiB payload.
pub const STATE_PART_BLOCKS: usize = 8_192;

/// Asks one worker for its cache (the subject names the worker; the body says it again, so a
/// misrouted request is noticed).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvStateRequest {
    pub worker: u64,
}

/// One part of a worker's answer; the receiver applies the parts together once the `last`
/// one came.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvStatePart {
    pub worker: u64,
    /// The worker process's run id, as in its event batches.
    pub instance: u64,
    /// The sequence number of the first event the snapshot does not cover; `None` when the
    /// worker has published no event yet.
    pub next_seq: Option<u64>,
    pub part: u32,
    pub last: bool,
    /// `Stored` events, parents before children (across parts too).
    pub stored: Vec<WireKvKind>,
}

impl KvStateRequest {
    pub fn encode(&self) -> Vec<u8> {
        // Plain integers to a Vec cannot fail.
        rmp_serde::to_vec_named(self).unwrap_or_default()
    }

    pub fn decode(bytes: &[u8]) -> Result<KvStateRequest, KvWireError> {
        Ok(rmp_serde::from_slice(bytes)?)
    }
}

impl KvStatePart {
    pub fn encode(&self) -> Vec<u8> {
        // Plain integers and arrays to a Vec cannot fail.
        rmp_serde::to_vec_named(self).unwrap_or_default()
    }

    pub fn decode(bytes: &[u8]) -> Result<KvStatePart, KvWireError> {
        Ok(rmp_serde::from_slice(bytes)?)
    }

    /// The part's events as `kv-index` kinds, each checked as a live event's would be.
    fn kinds(&self) -> Result<Vec<KvEventKind>, KvWireError> {
        self.stored
            .iter()
            .map(|kind| match kind {
                WireKvKind::Stored { .. } => WireKvEvent {
                    seq: 0,
                    kind: kind.clone(),
                }
                .to_kv_event(WorkerId(self.worker))
                .map(|e| e.kind),
                _ => Err(KvWireError::NotStored),
            })
            .collect()
    }
}

/// A snapshot (`kv_index::CacheMirror::snapshot`) in parts of at most
/// [`STATE_PART_BLOCKS`] blocks, each event at most [`MAX_STORED_BLOCKS`]: a longer chain
/// continues in another event under its last block.
pub fn state_parts(
    worker: WorkerId,
    instance: u64,
    next_seq: Option<u64>,
    snapshot: &[KvEventKind],
) -> Vec<KvStatePart> {
    let mut parts = Vec::new();
    let mut stored = Vec::new();
    let mut in_part = 0;
    let finish = |stored: &mut Vec<WireKvKind>, parts: &mut Vec<KvStatePart>, last| {
        parts.push(KvStatePart {
            worker: worker.0,
            instance,
            next_seq,
            part: u32::try_from(parts.len()).unwrap_or(u32::MAX),
            last,
            stored: std::mem::take(stored),
        });
    };
    for kind in snapshot {
        let KvEventKind::Stored { parent, blocks } = kind else {
            continue;
        };
        let mut parent = *parent;
        let mut rest = blocks.as_slice();
        while !rest.is_empty() {
            let room = (STATE_PART_BLOCKS - in_part).min(MAX_STORED_BLOCKS);
            let (now, later) = rest.split_at(room.min(rest.len()));
            let event = kv_index::KvEvent {
                worker,
                seq: 0,
                kind: KvEventKind::Stored {
                    parent,
                    blocks: now.to_vec(),
                },
            };
            stored.push(WireKvEvent::from(&event).kind);
            parent = now.last().map(|b| b.id);
            in_part += now.len();
            rest = later;
            if in_part >= STATE_PART_BLOCKS {
                finish(&mut stored, &mut parts, false);
                in_part = 0;
            }
        }
    }
    finish(&mut stored, &mut parts, true);
    parts
}

/// A worker's snapshot, put back together.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvState {
    pub worker: WorkerId,
    pub instance: u64,
    pub next_seq: Option<u64>,
    /// `Stored` events, parents first: what `KvIndex::restore_worker` takes.
    pub stored: Vec<KvEventKind>,
}

/// Gathers one worker's [`KvStatePart`]s, in order, up to `kv_index::MAX_MIRROR_BLOCKS`
/// blocks.
#[derive(Debug)]
pub struct KvStateAssembly {
    worker: WorkerId,
    state: Option<KvState>,
    next_part: u32,
    blocks: usize,
}

/// Why a snapshot was not usable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvStateError {
    #[error("cache snapshot part {got} came when part {expected} was due")]
    OutOfOrder { expected: u32, got: u32 },
    #[error("cache snapshot of worker {got} answered a request for worker {asked}")]
    OtherWorker { asked: u64, got: u64 },
    #[error("cache snapshot parts disagree on the worker's instance or sequence number")]
    Inconsistent,
    #[error("cache snapshot is over {MAX_MIRROR_BLOCKS} blocks")]
    TooLarge,
    #[error("cache snapshot part is malformed: {0}")]
    Wire(String),
}

impl KvStateAssembly {
    pub fn new(worker: WorkerId) -> Self {
        Self {
            worker,
            state: None,
            next_part: 0,
            blocks: 0,
        }
    }

    /// Adds the next part; the whole snapshot once the last one came.
    pub fn push(&mut self, part: &KvStatePart) -> Result<Option<KvState>, KvStateError> {
        if part.worker != self.worker.0 {
            return Err(KvStateError::OtherWorker {
                asked: self.worker.0,
                got: part.worker,
            });
        }
        if part.part != self.next_part {
            return Err(KvStateError::OutOfOrder {
                expected: self.next_part,
                got: part.part,
            });
        }
        let kinds = part
            .kinds()
            .map_err(|e| KvStateError::Wire(e.to_string()))?;
        self.blocks += kinds
            .iter()
            .map(|k| match k {
                KvEventKind::Stored { blocks, .. } => blocks.len(),
                _ => 0,
            })
            .sum::<usize>();
        if self.blocks > MAX_MIRROR_BLOCKS {
            return Err(KvStateError::TooLarge);
        }
        let state = self.state.get_or_insert_with(|| KvState {
            worker: WorkerId(part.worker),
            instance: part.instance,
            next_seq: part.next_seq,
            stored: Vec::new(),
        });
        if state.instance != part.instance || state.next_seq != part.next_seq {
            return Err(KvStateError::Inconsistent);
        }
        state.stored.extend(kinds);
        self.next_part = self.next_part.saturating_add(1);
        Ok(if part.last { self.state.take() } else { None })
    }
}

/// A kvroute engine's answer to `GET /kv_state` (msgpack): its whole cache as the parts
/// [`state_parts`] makes, and the number of the first ZMQ batch the snapshot does not cover.
/// vLLM numbers batches, not events, so a ZMQ subscriber resumes its stream at `next_batch`:
/// batches below it are in the snapshot already.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ZmqKvState {
    pub next_batch: u64,
    pub parts: Vec<KvStatePart>,
}

impl ZmqKvState {
    pub fn encode(&self) -> Vec<u8> {
        // Plain integers and arrays to a Vec cannot fail.
        rmp_serde::to_vec_named(self).unwrap_or_default()
    }

    /// Decodes and assembles the answer for `worker` (checked as NATS parts are).
    pub fn decode(bytes: &[u8], worker: WorkerId) -> Result<(u64, KvState), KvStateError> {
        let answer: ZmqKvState =
            rmp_serde::from_slice(bytes).map_err(|e| KvStateError::Wire(e.to_string()))?;
        let mut assembly = KvStateAssembly::new(worker);
        for part in &answer.parts {
            if let Some(state) = assembly.push(part)? {
                return Ok((answer.next_batch, state));
            }
        }
        Err(KvStateError::Wire(
            "the answer has no last part".to_string(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_index::{
        BlockContent, CacheMirror, EngineBlockId, IndexConfig, KvEvent, KvIndex, LocalBlockHash,
        StoredBlock,
    };

    fn assembled(parts: &[KvStatePart], worker: WorkerId) -> KvState {
        let mut assembly = KvStateAssembly::new(worker);
        let mut state = None;
        for part in parts {
            let decoded = KvStatePart::decode(&part.encode()).unwrap();
            assert!(state.is_none(), "only the last part completes it");
            state = assembly.push(&decoded).unwrap();
        }
        state.expect("the last part completes the snapshot")
    }

    #[test]
    fn long_chains_and_big_caches_split_into_parts_that_rebuild_the_cache() {
        let worker = WorkerId(1);
        let mut mirror = CacheMirror::default();
        // One chain of 20,000 blocks (longer than a part and than one stored event) and a
        // branch off its middle.
        let block = |i: u64| StoredBlock {
            id: EngineBlockId(i),
            content: BlockContent::LocalHash(LocalBlockHash(i)),
        };
        let events = [
            KvEvent {
                worker,
                seq: 40,
                kind: KvEventKind::Stored {
                    parent: None,
                    blocks: (1..=20_000).map(block).collect(),
                },
            },
            KvEvent {
                worker,
                seq: 41,
                kind: KvEventKind::Stored {
                    parent: Some(EngineBlockId(9_000)),
                    blocks: (30_000..30_010).map(block).collect(),
                },
            },
        ];
        let mut live = KvIndex::new(IndexConfig::default());
        for event in &events {
            live.apply(event).unwrap();
        }
        mirror.apply(&events);
        let parts = state_parts(worker, 7, mirror.next_seq(), &mirror.snapshot().unwrap());
        assert_eq!(parts.len(), 3);
        assert!(
            parts
                .iter()
                .all(|p| p.next_seq == Some(42) && p.instance == 7)
        );
        assert!(parts.iter().all(|p| p.encode().len() < 1 << 20));
        let state = assembled(&parts, worker);
        let mut index = KvIndex::new(IndexConfig::default());
        index
            .restore_worker(worker, state.next_seq, &state.stored)
            .unwrap();
        index.check_invariants();
        assert_eq!(index.blocks_of(worker), 20_010);
        for id in [1, 8_192, 8_193, 16_384, 16_385, 20_000, 30_009] {
            assert!(index.holds(worker, EngineBlockId(id)), "{id}");
        }
        // Out of order, another worker's, or another kind of event: refused.
        assert!(matches!(
            KvStateAssembly::new(worker).push(&parts[1]),
            Err(KvStateError::OutOfOrder { .. })
        ));
        assert!(matches!(
            KvStateAssembly::new(WorkerId(2)).push(&parts[0]),
            Err(KvStateError::OtherWorker { .. })
        ));
        let mut bad = parts[0].clone();
        bad.stored.push(WireKvKind::Cleared);
        assert!(matches!(
            KvStateAssembly::new(worker).push(&bad),
            Err(KvStateError::Wire(_))
        ));
        let mut other_seq = parts[1].clone();
        other_seq.next_seq = Some(41);
        let mut assembly = KvStateAssembly::new(worker);
        assembly.push(&parts[0]).unwrap();
        assert_eq!(assembly.push(&other_seq), Err(KvStateError::Inconsistent));
    }

    #[test]
    fn an_empty_cache_is_one_last_part() {
        let parts = state_parts(WorkerId(3), 0, None, &[]);
        assert_eq!(parts.len(), 1);
        let state = assembled(&parts, WorkerId(3));
        assert_eq!((state.next_seq, state.stored.len()), (None, 0));
    }
}
