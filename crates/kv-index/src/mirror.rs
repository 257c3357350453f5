//! One worker's cache as its own event stream implies it, for a consumer that subscribed late.
//!
//! Events describe changes: an index that starts after a worker cached its blocks never learns
//! of them, and every block later stored on top of them names an unknown parent, so it is
//! skipped too. A long-lived shared prefix (a system prompt) would keep that worker invisible
//! indefinitely. The publisher keeps a [`CacheMirror`] of its own stream and hands a late
//! consumer its [`snapshot`](CacheMirror::snapshot), which
//! [`KvIndex::restore_worker`](crate::KvIndex::restore_worker) applies before the stream goes
//! on from [`next_seq`](CacheMirror::next_seq).

use rustc_hash::FxHashMap;

use crate::event::{BlockContent, EngineBlockId, KvEvent, KvEventKind, StoredBlock};
use crate::hash::LocalBlockHash;

/// Most blocks a mirror tracks: the index's default bound. A worker's cache is far smaller;
/// past this the mirror no longer vouches for anything ([`CacheMirror::snapshot`] is `None`)
/// rather than grow without limit.
pub const MAX_MIRROR_BLOCKS: usize = crate::DEFAULT_MAX_BLOCKS;

/// Per block its parent and local hash, from the worker's own events, in order.
#[derive(Debug, Default, Clone)]
pub struct CacheMirror {
    blocks: FxHashMap<EngineBlockId, (Option<EngineBlockId>, LocalBlockHash)>,
    next_seq: Option<u64>,
    overflowed: bool,
}

impl CacheMirror {
    /// Follows `events` (one worker's, in sequence order).
    pub fn apply(&mut self, events: &[KvEvent]) {
        for event in events {
            self.next_seq = Some(event.seq.wrapping_add(1));
            match &event.kind {
                KvEventKind::Stored { parent, blocks } => {
                    let mut parent = *parent;
                    for block in blocks {
                        if self.blocks.len() >= MAX_MIRROR_BLOCKS
                            && !self.blocks.contains_key(&block.id)
                        {
                            self.overflowed = true;
                            break;
                        }
                        self.blocks
                            .insert(block.id, (parent, block.content.local_hash()));
                        parent = Some(block.id);
                    }
                }
                KvEventKind::Removed { blocks } => {
                    for id in blocks {
                        self.blocks.remove(id);
                    }
                }
                KvEventKind::Cleared => {
                    self.blocks = FxHashMap::default();
                    self.overflowed = false;
                }
            }
        }
    }

    /// Blocks tracked.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// The sequence number of the first event the mirror has not seen (`None`: none seen).
    pub fn next_seq(&self) -> Option<u64> {
        self.next_seq
    }

    /// The cache as `Stored` events, one per chain, parents before children, in an order
    /// fixed by the blocks' ids (not the map's). Blocks whose parent is gone are left out: a
    /// match could never reach them. `None` once the mirror overflowed.
    pub fn snapshot(&self) -> Option<Vec<KvEventKind>> {
        if self.overflowed {
            return None;
        }
        let mut children: FxHashMap<Option<EngineBlockId>, Vec<EngineBlockId>> =
            FxHashMap::default();
        for (&id, &(parent, _)) in &self.blocks {
            children.entry(parent).or_default().push(id);
        }
        for list in children.values_mut() {
            list.sort_unstable();
        }
        let mut out = Vec::new();
        // Chains still to write, each from its first block (under its parent).
        let mut starts: Vec<(Option<EngineBlockId>, EngineBlockId)> = children
            .get(&None)
            .map(|roots| roots.iter().rev().map(|&r| (None, r)).collect())
            .unwrap_or_default();
        while let Some((parent, first)) = starts.pop() {
            let mut blocks = Vec::new();
            let mut id = first;
            loop {
                let local = self.blocks.get(&id).map_or(LocalBlockHash(0), |b| b.1);
                blocks.push(StoredBlock {
                    id,
                    content: BlockContent::LocalHash(local),
                });
                let next = children.get(&Some(id)).map(Vec::as_slice).unwrap_or(&[]);
                // Other children start chains of their own, written after this one.
                starts.extend(next.iter().skip(1).rev().map(|&c| (Some(id), c)));
                match next.first() {
                    Some(&child) => id = child,
                    None => break,
                }
            }
            out.push(KvEventKind::Stored { parent, blocks });
        }
        Some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{BlockHasher, IndexConfig, KvIndex, WorkerId};

    const B: usize = 4;

    fn block(id: u64, local: u64) -> StoredBlock {
        StoredBlock {
            id: EngineBlockId(id),
            content: BlockContent::LocalHash(LocalBlockHash(local)),
        }
    }

    /// A conversation tree like an engine's: a shared system prompt, branches off it, some
    /// branch tips evicted, blocks named by their sequence hashes.
    fn events(worker: WorkerId) -> Vec<KvEvent> {
        let hasher = BlockHasher::new(B).unwrap();
        let mut out = Vec::new();
        let mut push = |kind| {
            let seq = out.len() as u64;
            out.push(KvEvent { worker, seq, kind });
        };
        let system: Vec<u32> = (0..3 * B as u32).collect();
        push(KvEventKind::stored_prompt(&hasher, &system));
        let system_ids = hasher.sequence_hashes(&system);
        let tip = system_ids.last().map(|h| EngineBlockId(h.0));
        for branch in 0..40u32 {
            let mut prompt = system.clone();
            prompt.extend((0..(2 + branch % 5) * B as u32).map(|t| 1_000 * (branch + 1) + t));
            let ids = hasher.sequence_hashes(&prompt);
            let locals = hasher.local_hashes(&prompt);
            let blocks = ids
                .iter()
                .zip(&locals)
                .skip(system_ids.len())
                .map(|(id, local)| block(id.0, local.0))
                .collect();
            push(KvEventKind::Stored {
                parent: tip,
                blocks,
            });
            if branch % 7 == 3 {
                let last = ids.last().map(|h| EngineBlockId(h.0)).into_iter().collect();
                push(KvEventKind::Removed { blocks: last });
            }
        }
        out
    }

    #[test]
    fn a_snapshot_rebuilds_the_index_the_stream_built() {
        let worker = WorkerId(5);
        let events = events(worker);
        let mut live = KvIndex::new(IndexConfig::default());
        let mut mirror = CacheMirror::default();
        for event in &events {
            live.apply(event).unwrap();
        }
        mirror.apply(&events);
        assert_eq!(mirror.len(), live.blocks_of(worker));
        let mut index = KvIndex::new(IndexConfig::default());
        let snapshot = mirror.snapshot().unwrap();
        index
            .restore_worker(worker, mirror.next_seq(), &snapshot)
            .unwrap();
        index.check_invariants();
        assert_eq!(index.blocks_of(worker), live.blocks_of(worker));
        assert_eq!(index.next_seq(worker), live.next_seq(worker));
        let hasher = BlockHasher::new(B).unwrap();
        for branch in 0..40u32 {
            let mut prompt: Vec<u32> = (0..3 * B as u32).collect();
            prompt.extend((0..8 * B as u32).map(|t| 1_000 * (branch + 1) + t));
            assert_eq!(
                index.find_matches_for_tokens(&hasher, &prompt),
                live.find_matches_for_tokens(&hasher, &prompt),
                "branch {branch}"
            );
        }
        // The same stream, the same snapshot, whatever the map's order.
        let mut again = CacheMirror::default();
        again.apply(&events);
        assert_eq!(again.snapshot(), Some(snapshot));
    }

    #[test]
    fn orphans_are_left_out_and_a_clear_empties_it() {
        let worker = WorkerId(3);
        let mut mirror = CacheMirror::default();
        assert_eq!((mirror.next_seq(), mirror.snapshot()), (None, Some(vec![])));
        mirror.apply(&[
            KvEvent {
                worker,
                seq: 7,
                kind: KvEventKind::Stored {
                    parent: None,
                    blocks: vec![block(1, 1), block(2, 2), block(3, 3)],
                },
            },
            KvEvent {
                worker,
                seq: 8,
                kind: KvEventKind::Removed {
                    blocks: vec![EngineBlockId(2)],
                },
            },
        ]);
        assert_eq!(
            mirror.snapshot(),
            Some(vec![KvEventKind::Stored {
                parent: None,
                blocks: vec![block(1, 1)],
            }])
        );
        assert_eq!(mirror.len(), 2);
        mirror.apply(&[KvEvent {
            worker,
            seq: 9,
            kind: KvEventKind::Cleared,
        }]);
        assert!(mirror.is_empty());
        assert_eq!(mirror.next_seq(), Some(10));
    }
}
