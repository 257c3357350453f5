//! A prefix held by a whole fleet, with workers dropping out at different depths: the case
//! where matching compares large holder sets block after block.

use kv_index::{BlockHasher, EngineBlockId, IndexConfig, KvEvent, KvEventKind, KvIndex, WorkerId};

fn stored(hasher: &BlockHasher, worker: u64, seq: u64, tokens: &[u32]) -> KvEvent {
    KvEvent {
        worker: WorkerId(worker),
        seq,
        kind: KvEventKind::stored_prompt(hasher, tokens),
    }
}

#[test]
fn each_of_a_thousand_workers_scores_its_own_depth() {
    let hasher = BlockHasher::new(4).unwrap();
    let tokens: Vec<u32> = (0..4 * 300).collect();
    let mut index = KvIndex::new(IndexConfig::default());
    // Worker w holds the first 100 + (w % 200) blocks; some also hold an unrelated prompt.
    for w in 0..1000u64 {
        let depth = 100 + (w as usize % 200);
        index
            .apply(&stored(&hasher, w, 0, &tokens[..depth * 4]))
            .unwrap();
        if w % 3 == 0 {
            let other: Vec<u32> = (0..40).map(|t| 1_000_000 + t + w as u32).collect();
            index.apply(&stored(&hasher, w, 1, &other)).unwrap();
        }
    }
    let scores = index.find_matches(&hasher.sequence_hashes(&tokens));
    assert_eq!(scores.len(), 1000);
    for w in 0..1000u64 {
        assert_eq!(
            scores.get(WorkerId(w)),
            100 + (w as u32 % 200),
            "worker {w}"
        );
    }
    // Remove a block in the middle of some workers' chains: they stop matching there.
    let middle = hasher.sequence_hashes(&tokens)[150];
    for w in (0..1000u64).filter(|w| w % 7 == 0 && 100 + (w % 200) > 150) {
        let seq = if w % 3 == 0 { 2 } else { 1 };
        index
            .apply(&KvEvent {
                worker: WorkerId(w),
                seq,
                kind: KvEventKind::Removed {
                    blocks: vec![EngineBlockId(middle.0)],
                },
            })
            .unwrap();
    }
    let scores = index.find_matches(&hasher.sequence_hashes(&tokens));
    for w in 0..1000u64 {
        let held = 100 + (w as u32 % 200);
        let expected = if w % 7 == 0 && held > 150 { 150 } else { held };
        assert_eq!(scores.get(WorkerId(w)), expected, "worker {w}");
    }
    index.check_invariants();
}
