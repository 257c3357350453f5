//! Unit tests of each behaviour of the index, one at a time.

use super::*;
use crate::event::BlockContent;

const B: usize = 4;

fn hasher() -> BlockHasher {
    BlockHasher::new(B).unwrap()
}

/// Blocks of `B` tokens, block `i` filled with `tokens[i]`, with engine ids `ids`.
fn blocks(ids: &[u64], tokens: &[u32]) -> Vec<StoredBlock> {
    ids.iter()
        .zip(tokens)
        .map(|(&id, &t)| StoredBlock {
            id: EngineBlockId(id),
            content: BlockContent::Tokens(vec![t; B]),
        })
        .collect()
}

fn prompt(tokens: &[u32]) -> Vec<u32> {
    tokens.iter().flat_map(|&t| [t; B]).collect()
}

fn stored(worker: u64, seq: u64, parent: Option<u64>, ids: &[u64], tokens: &[u32]) -> KvEvent {
    KvEvent {
        worker: WorkerId(worker),
        seq,
        kind: KvEventKind::Stored {
            parent: parent.map(EngineBlockId),
            blocks: blocks(ids, tokens),
        },
    }
}

fn removed(worker: u64, seq: u64, ids: &[u64]) -> KvEvent {
    KvEvent {
        worker: WorkerId(worker),
        seq,
        kind: KvEventKind::Removed {
            blocks: ids.iter().copied().map(EngineBlockId).collect(),
        },
    }
}

fn cleared(worker: u64, seq: u64) -> KvEvent {
    KvEvent {
        worker: WorkerId(worker),
        seq,
        kind: KvEventKind::Cleared,
    }
}

fn scores(index: &KvIndex, tokens: &[u32]) -> Vec<(u64, u32)> {
    let by_tokens = index.find_matches_for_tokens(&hasher(), &prompt(tokens));
    let by_hashes = index.find_matches(&hasher().sequence_hashes(&prompt(tokens)));
    assert_eq!(by_tokens, by_hashes);
    by_hashes.iter().map(|(w, k)| (w.0, k)).collect()
}

fn index() -> KvIndex {
    KvIndex::new(IndexConfig::default())
}

/// An index bounded to `max_blocks` entries.
fn bounded(max_blocks: usize) -> KvIndex {
    KvIndex::new(IndexConfig {
        max_blocks,
        ..IndexConfig::default()
    })
}

/// A fresh index that has applied `events`, each of them accepted.
fn index_after(events: &[KvEvent]) -> KvIndex {
    let mut idx = index();
    for event in events {
        idx.apply(event).unwrap();
    }
    idx
}

#[test]
fn empty_index_matches_nothing() {
    let idx = index();
    assert!(scores(&idx, &[1, 2, 3]).is_empty());
    assert!(idx.find_matches(&[]).is_empty());
    // `scores` looks up twice (by tokens and by hashes).
    assert_eq!(idx.counters().lookups, 3);
    assert!(idx.is_empty());
}

#[test]
fn leading_prefix_scores() {
    let idx = index_after(&[
        stored(1, 0, None, &[10, 11, 12], &[1, 2, 3]),
        stored(2, 0, None, &[20, 21], &[1, 2]),
        stored(3, 0, None, &[30], &[9]),
    ]);
    assert_eq!(scores(&idx, &[1, 2, 3, 4]), vec![(1, 3), (2, 2)]);
    assert_eq!(scores(&idx, &[1, 7, 3]), vec![(1, 1), (2, 1)]);
    assert_eq!(scores(&idx, &[9, 2]), vec![(3, 1)]);
    // Same block content after a different prefix does not match.
    assert_eq!(scores(&idx, &[2, 3]), vec![]);
    assert_eq!(idx.len(), 6);
    assert_eq!(idx.blocks_of(WorkerId(1)), 3);
    assert_eq!(idx.blocks_of(WorkerId(9)), 0);
    let mut workers: Vec<_> = idx.workers().collect();
    workers.sort();
    assert_eq!(workers, vec![WorkerId(1), WorkerId(2), WorkerId(3)]);
    idx.check_invariants();
}

#[test]
fn parent_chains_across_events_and_local_hash_content() {
    let mut idx = index_after(&[
        stored(1, 0, None, &[10], &[1]),
        stored(1, 1, Some(10), &[11], &[2]),
    ]);
    // Content given as a local hash gives the same sequence hash as the tokens.
    let ev = KvEvent {
        worker: WorkerId(1),
        seq: 2,
        kind: KvEventKind::Stored {
            parent: Some(EngineBlockId(11)),
            blocks: vec![StoredBlock {
                id: EngineBlockId(12),
                content: BlockContent::LocalHash(LocalBlockHash::of_tokens(&[3; B])),
            }],
        },
    };
    idx.apply(&ev).unwrap();
    assert_eq!(scores(&idx, &[1, 2, 3]), vec![(1, 3)]);
    idx.check_invariants();
}

#[test]
fn a_hole_stops_the_match() {
    let mut idx = index_after(&[stored(1, 0, None, &[10, 11, 12], &[1, 2, 3])]);
    let out = idx.apply(&removed(1, 1, &[11])).unwrap();
    assert_eq!(out.removed, 1);
    assert_eq!(scores(&idx, &[1, 2, 3]), vec![(1, 1)]);
    assert_eq!(idx.len(), 2);
    idx.check_invariants();
}

#[test]
fn unknown_parent_is_skipped_and_counted() {
    let mut idx = index_after(&[stored(1, 0, None, &[10], &[1])]);
    let out = idx
        .apply(&stored(1, 1, Some(99), &[11, 12], &[2, 3]))
        .unwrap();
    assert_eq!(out.unknown_parent_blocks, 2);
    assert_eq!(out.stored, 0);
    // The parent known to *another* worker does not count either.
    idx.apply(&stored(2, 0, Some(10), &[21], &[2])).unwrap();
    assert_eq!(idx.len(), 1);
    let c = idx.counters();
    assert_eq!((c.unknown_parent_events, c.unknown_parent_blocks), (2, 3));
    assert_eq!(c.events_applied, 3);
    idx.check_invariants();
}

#[test]
fn restore_is_idempotent_and_reuse_of_an_id_replaces() {
    let mut idx = index_after(&[stored(1, 0, None, &[10, 11], &[1, 2])]);
    let out = idx.apply(&stored(1, 1, None, &[10, 11], &[1, 2])).unwrap();
    assert_eq!((out.stored, out.refreshed), (0, 2));
    assert_eq!(idx.len(), 2);
    // Id 11 now names other content.
    let out = idx.apply(&stored(1, 2, Some(10), &[11], &[5])).unwrap();
    assert_eq!((out.stored, out.removed), (1, 1));
    assert_eq!(scores(&idx, &[1, 2]), vec![(1, 1)]);
    assert_eq!(scores(&idx, &[1, 5]), vec![(1, 2)]);
    assert_eq!(idx.len(), 2);
    let c = idx.counters();
    assert_eq!(
        (c.blocks_stored, c.blocks_refreshed, c.blocks_removed),
        (3, 2, 1)
    );
    idx.check_invariants();
}

#[test]
fn same_content_under_two_ids_is_held_until_both_go() {
    let mut idx = index_after(&[
        stored(1, 0, None, &[10], &[1]),
        stored(1, 1, None, &[11], &[1]),
    ]);
    assert_eq!(idx.len(), 2);
    assert_eq!(idx.distinct_blocks(), 1);
    idx.apply(&removed(1, 2, &[10])).unwrap();
    assert_eq!(scores(&idx, &[1]), vec![(1, 1)]);
    idx.apply(&removed(1, 3, &[11])).unwrap();
    assert_eq!(scores(&idx, &[1]), vec![]);
    assert_eq!(idx.distinct_blocks(), 0);
    idx.check_invariants();
}

#[test]
fn unknown_removal_is_counted_and_ignored() {
    let mut idx = index_after(&[stored(1, 0, None, &[10], &[1])]);
    let out = idx.apply(&removed(1, 1, &[10, 77])).unwrap();
    assert_eq!((out.removed, out.unknown_removals), (1, 1));
    assert_eq!(idx.counters().unknown_removals, 1);
    idx.check_invariants();
}

#[test]
fn cleared_event_drops_the_worker_blocks_only() {
    let mut idx = index_after(&[
        stored(1, 0, None, &[10, 11], &[1, 2]),
        stored(2, 0, None, &[20], &[1]),
    ]);
    let out = idx.apply(&cleared(1, 1)).unwrap();
    assert_eq!(out.removed, 2);
    assert_eq!(scores(&idx, &[1, 2]), vec![(2, 1)]);
    // The stream continues: seq 2 is expected.
    assert!(idx.apply(&stored(1, 2, None, &[10], &[1])).is_ok());
    assert_eq!(idx.counters().blocks_cleared, 2);
    idx.check_invariants();
}

#[test]
fn first_event_sets_the_baseline() {
    let mut idx = index();
    let out = idx.apply(&stored(1, 41, None, &[10], &[1])).unwrap();
    assert!(out.baseline);
    let out = idx.apply(&stored(1, 42, Some(10), &[11], &[2])).unwrap();
    assert!(!out.baseline);
}

#[test]
fn gap_is_reported_and_not_applied_until_clear_worker() {
    let mut idx = index_after(&[stored(1, 0, None, &[10], &[1])]);
    let err = idx.apply(&stored(1, 2, Some(10), &[11], &[2])).unwrap_err();
    assert_eq!(
        err,
        EventError::Gap {
            worker: WorkerId(1),
            expected: 1,
            got: 2
        }
    );
    let msg = err.to_string();
    assert!(msg.contains("clear_worker(worker-1)"), "{msg}");
    assert_eq!(idx.len(), 1);
    // Later events keep failing: the expected seq did not move.
    assert!(matches!(
        idx.apply(&removed(1, 3, &[10])),
        Err(EventError::Gap { expected: 1, .. })
    ));
    // A late arrival of the missing event repairs a reorder.
    idx.apply(&stored(1, 1, Some(10), &[11], &[2])).unwrap();
    assert_eq!(scores(&idx, &[1, 2]), vec![(1, 2)]);
    // Resync: clear, and the next event is a new baseline.
    assert!(idx.apply(&removed(1, 9, &[10])).is_err());
    idx.clear_worker(WorkerId(1));
    assert_eq!(idx.len(), 0);
    assert_eq!(idx.workers().collect::<Vec<_>>(), vec![WorkerId(1)]);
    assert!(
        idx.apply(&stored(1, 9, None, &[10], &[1]))
            .unwrap()
            .baseline
    );
    assert_eq!(idx.counters().gaps, 3);
    idx.check_invariants();
}

#[test]
fn stale_and_duplicate_events_are_ignored() {
    let mut idx = index_after(&[stored(1, 5, None, &[10], &[1])]);
    let err = idx.apply(&removed(1, 5, &[10])).unwrap_err();
    assert_eq!(
        err,
        EventError::Stale {
            worker: WorkerId(1),
            expected: 6,
            got: 5
        }
    );
    assert!(idx.apply(&removed(1, 0, &[10])).is_err());
    assert_eq!(idx.len(), 1);
    assert_eq!(idx.counters().stale_events, 2);
    assert_eq!(idx.counters().events_applied, 1);
}

#[test]
fn remove_worker_forgets_blocks_and_cursor() {
    let mut idx = index_after(&[
        stored(1, 0, None, &[10, 11], &[1, 2]),
        stored(2, 0, None, &[20, 21], &[1, 2]),
    ]);
    idx.remove_worker(WorkerId(1));
    idx.remove_worker(WorkerId(7)); // unknown: no-op
    assert_eq!(scores(&idx, &[1, 2]), vec![(2, 2)]);
    assert_eq!(idx.workers().collect::<Vec<_>>(), vec![WorkerId(2)]);
    assert_eq!(idx.len(), 2);
    assert_eq!(idx.counters().workers_removed, 1);
    // Coming back starts a new baseline; its old slot is reused.
    assert!(
        idx.apply(&stored(1, 100, None, &[10], &[1]))
            .unwrap()
            .baseline
    );
    assert_eq!(scores(&idx, &[1, 2]), vec![(1, 1), (2, 2)]);
    idx.check_invariants();
}

#[test]
fn many_workers_drop_out_at_different_depths() {
    let mut idx = index();
    // Enough workers for the many-matches path, arriving out of id order.
    let worker = |w: u64| (w * 7919) % 1000;
    for w in 0..40u64 {
        let depth = (w % 7) as usize + 1;
        let ids: Vec<u64> = (0..depth as u64).map(|i| w * 100 + i).collect();
        let toks: Vec<u32> = (1..=depth as u32).collect();
        idx.apply(&stored(worker(w), 0, None, &ids, &toks)).unwrap();
    }
    idx.remove_worker(WorkerId(worker(3)));
    let got = idx.find_matches_for_tokens(&hasher(), &prompt(&[1, 2, 3, 4, 5, 6, 7, 8]));
    assert_eq!(got.len(), 39);
    for w in (0..40u64).filter(|&w| w != 3) {
        assert_eq!(
            got.get(WorkerId(worker(w))),
            (w % 7) as u32 + 1,
            "worker {w}"
        );
    }
    let ids: Vec<_> = got.iter().map(|p| p.0).collect();
    assert!(ids.windows(2).all(|p| p[0] < p[1]));
    idx.check_invariants();
}

#[test]
fn bound_evicts_coldest_chain_from_its_tip() {
    let mut idx = bounded(6);
    // Worker 1's chain is older than worker 2's.
    idx.apply(&stored(1, 0, None, &[10, 11, 12], &[1, 2, 3]))
        .unwrap();
    idx.apply(&stored(2, 0, None, &[20, 21, 22], &[1, 2, 3]))
        .unwrap();
    assert_eq!(idx.len(), 6);
    let out = idx.apply(&stored(3, 0, None, &[30], &[7])).unwrap();
    assert_eq!(out.evicted, 1);
    // Worker 1 lost its deepest block, not its first.
    assert_eq!(scores(&idx, &[1, 2, 3]), vec![(1, 2), (2, 3)]);
    // Two more: worker 1's chain keeps shrinking from the tip.
    idx.apply(&stored(3, 1, Some(30), &[31, 32], &[8, 9]))
        .unwrap();
    assert_eq!(scores(&idx, &[1, 2, 3]), vec![(2, 3)]);
    assert_eq!(idx.blocks_of(WorkerId(1)), 0);
    assert_eq!(idx.counters().blocks_evicted, 3);
    assert_eq!(idx.len(), 6);
    idx.check_invariants();
}

#[test]
fn bound_extending_a_chain_keeps_it_warm() {
    let mut idx = bounded(4);
    idx.apply(&stored(1, 0, None, &[10], &[1])).unwrap();
    idx.apply(&stored(2, 0, None, &[20], &[5])).unwrap();
    // Worker 1 extends its chain: its tip is now newer than worker 2's block.
    idx.apply(&stored(1, 1, Some(10), &[11, 12], &[2, 3]))
        .unwrap();
    idx.apply(&stored(3, 0, None, &[30], &[9])).unwrap();
    assert_eq!(scores(&idx, &[5]), vec![]);
    assert_eq!(scores(&idx, &[1, 2, 3]), vec![(1, 3)]);
    // Re-storing a leaf refreshes it.
    idx.apply(&stored(1, 2, Some(11), &[12], &[3])).unwrap();
    idx.apply(&stored(4, 0, None, &[40], &[6])).unwrap();
    assert_eq!(scores(&idx, &[9]), vec![]);
    assert_eq!(scores(&idx, &[1, 2, 3]), vec![(1, 3)]);
    idx.check_invariants();
}

#[test]
fn tiny_bounds_do_not_break() {
    for max_blocks in 0..3 {
        let mut idx = bounded(max_blocks);
        idx.apply(&stored(1, 0, None, &[10, 11, 12, 13], &[1, 2, 3, 4]))
            .unwrap();
        idx.apply(&stored(1, 1, Some(12), &[14], &[5])).unwrap();
        assert!(idx.len() <= max_blocks);
        let s = scores(&idx, &[1, 2, 3, 4, 5]);
        assert!(s.iter().all(|&(_, k)| k as usize <= max_blocks), "{s:?}");
        idx.check_invariants();
    }
}

#[test]
fn error_messages_say_what_to_do() {
    let gap = EventError::Gap {
        worker: WorkerId(3),
        expected: 5,
        got: 7,
    };
    assert!(gap.to_string().contains("expected seq 5, got 7"));
    let stale = EventError::Stale {
        worker: WorkerId(3),
        expected: 5,
        got: 2,
    };
    assert!(stale.to_string().contains("ignored"));
}

#[test]
fn worker_bound_refuses_new_workers() {
    let mut idx = KvIndex::new(IndexConfig {
        max_workers: 2,
        ..IndexConfig::default()
    });
    idx.apply(&stored(1, 0, None, &[10], &[1])).unwrap();
    idx.apply(&stored(2, 0, None, &[20], &[1])).unwrap();
    let err = idx.apply(&stored(3, 0, None, &[30], &[1])).unwrap_err();
    assert_eq!(
        err,
        EventError::TooManyWorkers {
            worker: WorkerId(3),
            max: 2
        }
    );
    assert_eq!(idx.counters().refused_workers, 1);
    // Known workers still get through; a removed one frees room.
    idx.apply(&stored(1, 1, Some(10), &[11], &[2])).unwrap();
    idx.remove_worker(WorkerId(2));
    idx.apply(&stored(3, 0, None, &[30], &[1])).unwrap();
    assert_eq!(scores(&idx, &[1, 2]), vec![(1, 2), (3, 1)]);
    idx.check_invariants();
}

#[test]
fn apply_resyncing_clears_on_a_gap_and_refuses_stale_events() {
    let mut index = index();
    index
        .apply_resyncing(&stored(1, 0, None, &[10, 11], &[1, 2]))
        .unwrap();
    assert!(index.holds(WorkerId(1), EngineBlockId(11)));
    assert_eq!(index.next_seq(WorkerId(1)), Some(1));
    // Event 1 (which removed block 11) is lost: event 2 reveals the gap.
    let out = index
        .apply_resyncing(&stored(1, 2, None, &[20], &[9]))
        .unwrap();
    assert!(out.resynced && out.baseline);
    assert!(!index.holds(WorkerId(1), EngineBlockId(10)));
    assert!(!index.holds(WorkerId(1), EngineBlockId(11)));
    assert!(index.holds(WorkerId(1), EngineBlockId(20)));
    assert_eq!(index.next_seq(WorkerId(1)), Some(3));
    // The late event 1, or a duplicate of 2, is stale and changes nothing.
    for late in [removed(1, 1, &[20]), stored(1, 2, None, &[30], &[7])] {
        assert!(matches!(
            index.apply_resyncing(&late),
            Err(EventError::Stale { .. })
        ));
    }
    assert!(index.holds(WorkerId(1), EngineBlockId(20)));
    assert!(!index.holds(WorkerId(1), EngineBlockId(30)));
    // In sequence, nothing is resynced.
    let out = index.apply_resyncing(&removed(1, 3, &[20])).unwrap();
    assert!(!out.resynced && out.removed == 1);
    assert_eq!(index.next_seq(WorkerId(7)), None);
}

#[test]
fn restore_worker_rebuilds_what_the_stream_built_and_continues_it() {
    // What worker 1's stream built: a shared root with two branches, one block removed.
    let history = [
        stored(1, 0, None, &[10, 11], &[1, 2]),
        stored(1, 1, Some(11), &[12], &[3]),
        stored(1, 2, Some(11), &[13, 14], &[4, 5]),
        removed(1, 3, &[14]),
    ];
    let live = index_after(&history);
    // The same cache as a snapshot (parents first), into an index that holds stale blocks
    // of that worker and another worker's blocks.
    let snapshot: Vec<KvEventKind> = [
        stored(1, 0, None, &[10, 11], &[1, 2]),
        stored(1, 0, Some(11), &[12], &[3]),
        stored(1, 0, Some(11), &[13], &[4]),
        // An orphan (its parent is not in the snapshot) is skipped.
        stored(1, 0, Some(99), &[15], &[6]),
    ]
    .into_iter()
    .map(|e| e.kind)
    .collect();
    let mut restored = index_after(&[
        stored(1, 7, None, &[50], &[9]),
        stored(2, 0, None, &[10], &[1]),
    ]);
    let out = restored
        .restore_worker(WorkerId(1), Some(4), &snapshot)
        .unwrap();
    assert_eq!(
        (out.removed, out.stored, out.unknown_parent_blocks),
        (1, 4, 1)
    );
    restored.check_invariants();
    for tokens in [&[1, 2, 3][..], &[1, 2, 4, 5], &[9], &[1]] {
        let want: Vec<(u64, u32)> = {
            // Worker 2 keeps its block; worker 1's stale block (tokens [9]) is gone.
            let mut s = scores(&live, tokens);
            if tokens[0] == 1 {
                s.push((2, 1));
            }
            s
        };
        assert_eq!(scores(&restored, tokens), want, "{tokens:?}");
    }
    // The stream continues after the snapshot: event 4 applies, a replayed 3 is stale.
    assert_eq!(restored.next_seq(WorkerId(1)), Some(4));
    assert!(matches!(
        restored.apply(&removed(1, 3, &[13])),
        Err(EventError::Stale { .. })
    ));
    restored.apply(&removed(1, 4, &[13])).unwrap();
    assert_eq!(scores(&restored, &[1, 2, 4]), vec![(1, 2), (2, 1)]);
    // With nothing published yet, the next event sets the baseline.
    let out = restored.restore_worker(WorkerId(3), None, &[]).unwrap();
    assert!(out.baseline && out.stored == 0);
    restored.apply(&stored(3, 41, None, &[60], &[8])).unwrap();
    assert_eq!(restored.next_seq(WorkerId(3)), Some(42));
}
