//! Property tests: the index against a naive reference model.
//!
//! The model is the event semantics written as plainly as possible (per worker, a map from
//! engine id to sequence hash; a worker "holds" the values of its map; a score counts leading
//! hashes held). Events come from a tiny alphabet so prefixes, ids and contents collide.

use std::collections::{BTreeMap, BTreeSet};

use kv_index::{
    BlockContent, BlockHasher, EngineBlockId, EventError, IndexConfig, KvEvent, KvEventKind,
    KvIndex, LocalBlockHash, SequenceHash, StoredBlock, WorkerId,
};
use proptest::prelude::*;

const B: usize = 2;

#[derive(Debug, Default)]
struct RefWorker {
    next_seq: Option<u64>,
    blocks: BTreeMap<EngineBlockId, SequenceHash>,
}

#[derive(Debug, Default)]
struct Model {
    workers: BTreeMap<WorkerId, RefWorker>,
    gaps: u64,
    stale: u64,
    unknown_parent_blocks: u64,
    unknown_removals: u64,
}

impl Model {
    fn apply(&mut self, event: &KvEvent) -> Result<(), EventError> {
        let w = self.workers.entry(event.worker).or_default();
        if let Some(expected) = w.next_seq {
            if event.seq > expected {
                self.gaps += 1;
                return Err(EventError::Gap {
                    worker: event.worker,
                    expected,
                    got: event.seq,
                });
            }
            if event.seq < expected {
                self.stale += 1;
                return Err(EventError::Stale {
                    worker: event.worker,
                    expected,
                    got: event.seq,
                });
            }
        }
        w.next_seq = Some(event.seq.wrapping_add(1));
        match &event.kind {
            KvEventKind::Stored { parent, blocks } => {
                let mut parent_seq = match parent {
                    None => None,
                    Some(p) => match w.blocks.get(p) {
                        Some(s) => Some(*s),
                        None => {
                            self.unknown_parent_blocks += blocks.len() as u64;
                            for b in blocks {
                                w.blocks.remove(&b.id);
                            }
                            return Ok(());
                        }
                    },
                };
                for b in blocks {
                    let s = SequenceHash::chain(parent_seq, b.content.local_hash());
                    w.blocks.insert(b.id, s);
                    parent_seq = Some(s);
                }
            }
            KvEventKind::Removed { blocks } => {
                for id in blocks {
                    if w.blocks.remove(id).is_none() {
                        self.unknown_removals += 1;
                    }
                }
            }
            KvEventKind::Cleared => w.blocks.clear(),
        }
        Ok(())
    }

    fn scores(&self, hashes: &[SequenceHash]) -> Vec<(WorkerId, u32)> {
        self.workers
            .iter()
            .map(|(id, w)| {
                let held: BTreeSet<_> = w.blocks.values().collect();
                (
                    *id,
                    hashes.iter().take_while(|h| held.contains(h)).count() as u32,
                )
            })
            .filter(|p| p.1 > 0)
            .collect()
    }

    fn len(&self) -> usize {
        self.workers.values().map(|w| w.blocks.len()).sum()
    }

    fn expected_seq(&self, worker: WorkerId) -> u64 {
        self.workers
            .get(&worker)
            .and_then(|w| w.next_seq)
            .unwrap_or(0)
    }
}

/// How an event's sequence number relates to the one the worker expects.
#[derive(Debug, Clone)]
enum SeqMode {
    Next,
    Offset(i8),
    Any(u64),
}

#[derive(Debug, Clone)]
enum Kind {
    Stored {
        parent: Option<u64>,
        blocks: Vec<(u64, u32, bool)>,
    },
    Removed(Vec<u64>),
    Cleared,
}

#[derive(Debug, Clone)]
enum Op {
    Event {
        worker: u64,
        seq: SeqMode,
        kind: Kind,
    },
    RemoveWorker(u64),
    ClearWorker(u64),
    Query(Vec<u32>),
}

fn content(symbol: u32, as_local_hash: bool) -> BlockContent {
    let tokens = vec![symbol; B];
    if as_local_hash {
        BlockContent::LocalHash(LocalBlockHash::of_tokens(&tokens))
    } else {
        BlockContent::Tokens(tokens)
    }
}

fn to_event(model: &Model, worker: u64, seq: &SeqMode, kind: &Kind) -> KvEvent {
    let worker = WorkerId(worker);
    let expected = model.expected_seq(worker);
    let seq = match *seq {
        SeqMode::Next => expected,
        SeqMode::Offset(d) => expected.saturating_add_signed(i64::from(d)),
        SeqMode::Any(s) => s,
    };
    let kind = match kind {
        Kind::Stored { parent, blocks } => KvEventKind::Stored {
            parent: parent.map(EngineBlockId),
            blocks: blocks
                .iter()
                .map(|&(id, sym, lh)| StoredBlock {
                    id: EngineBlockId(id),
                    content: content(sym, lh),
                })
                .collect(),
        },
        Kind::Removed(ids) => KvEventKind::Removed {
            blocks: ids.iter().copied().map(EngineBlockId).collect(),
        },
        Kind::Cleared => KvEventKind::Cleared,
    };
    KvEvent { worker, seq, kind }
}

/// Ops over a small world: 4 workers, 8 engine ids, 2 block contents.
fn small_op() -> impl Strategy<Value = Op> {
    let seq = prop_oneof![
        8 => Just(SeqMode::Next),
        1 => (-2i8..=2).prop_map(SeqMode::Offset),
    ];
    // Two contents and few ids: chains, parents and reused ids collide often.
    let block = (0u64..8, 0u32..2, any::<bool>());
    let kind = prop_oneof![
        6 => (proptest::option::of(0u64..8), proptest::collection::vec(block, 0..5))
            .prop_map(|(parent, blocks)| Kind::Stored { parent, blocks }),
        3 => proptest::collection::vec(0u64..8, 0..4).prop_map(Kind::Removed),
        1 => Just(Kind::Cleared),
    ];
    prop_oneof![
        12 => (0u64..4, seq, kind).prop_map(|(worker, seq, kind)| Op::Event { worker, seq, kind }),
        1 => (0u64..4).prop_map(Op::RemoveWorker),
        1 => (0u64..4).prop_map(Op::ClearWorker),
        4 => proptest::collection::vec(0u32..2, 0..7).prop_map(Op::Query),
    ]
}

/// Anything goes: huge ids and sequence numbers, odd block lengths, many workers.
fn wild_op() -> impl Strategy<Value = Op> {
    let seq = prop_oneof![
        4 => Just(SeqMode::Next),
        1 => any::<i8>().prop_map(SeqMode::Offset),
        1 => any::<u64>().prop_map(SeqMode::Any),
        1 => Just(SeqMode::Any(u64::MAX)),
    ];
    let id = prop_oneof![0u64..6, any::<u64>()];
    let block = (id.clone(), 0u32..3, any::<bool>());
    let kind = prop_oneof![
        6 => (proptest::option::of(id.clone()), proptest::collection::vec(block, 0..12))
            .prop_map(|(parent, blocks)| Kind::Stored { parent, blocks }),
        3 => proptest::collection::vec(id, 0..6).prop_map(Kind::Removed),
        1 => Just(Kind::Cleared),
    ];
    let worker = prop_oneof![0u64..8, any::<u64>()];
    prop_oneof![
        12 => (worker.clone(), seq, kind).prop_map(|(worker, seq, kind)| Op::Event { worker, seq, kind }),
        1 => worker.clone().prop_map(Op::RemoveWorker),
        1 => worker.prop_map(Op::ClearWorker),
        4 => proptest::collection::vec(0u32..3, 0..14).prop_map(Op::Query),
    ]
}

fn hashes(tokens: &[u32]) -> Vec<SequenceHash> {
    let tokens: Vec<u32> = tokens.iter().flat_map(|&t| [t; B]).collect();
    BlockHasher::new(B).unwrap().sequence_hashes(&tokens)
}

/// Runs `ops` on both; with `exact`, every answer must be equal, otherwise (the bound may
/// evict) the index must never report more than the model.
fn run(ops: &[Op], config: IndexConfig, exact: bool) -> Result<(), TestCaseError> {
    let mut index = KvIndex::new(config.clone());
    let mut model = Model::default();
    for op in ops {
        match op {
            Op::Event { worker, seq, kind } => {
                let event = to_event(&model, *worker, seq, kind);
                let known = model.workers.contains_key(&event.worker);
                let got = index.apply(&event);
                if let Err(EventError::TooManyWorkers { .. }) = got {
                    prop_assert!(!exact, "worker bound hit in an exact run");
                    prop_assert!(!known);
                    continue;
                }
                let want = model.apply(&event);
                prop_assert_eq!(got.map(|_| ()), want);
            }
            Op::RemoveWorker(w) => {
                index.remove_worker(WorkerId(*w));
                model.workers.remove(&WorkerId(*w));
            }
            Op::ClearWorker(w) => {
                index.clear_worker(WorkerId(*w));
                if let Some(rw) = model.workers.get_mut(&WorkerId(*w)) {
                    rw.blocks.clear();
                    rw.next_seq = None;
                }
            }
            Op::Query(tokens) => {
                let h = hashes(tokens);
                let got: Vec<_> = index.find_matches(&h).iter().collect();
                let want = model.scores(&h);
                if exact {
                    prop_assert_eq!(&got, &want, "query {:?}", tokens);
                } else {
                    for (w, k) in &got {
                        let m = want.iter().find(|p| p.0 == *w).map_or(0, |p| p.1);
                        prop_assert!(
                            *k <= m,
                            "over-reported {} for {:?}: {} > {}",
                            w,
                            tokens,
                            k,
                            m
                        );
                    }
                }
                let toks: Vec<u32> = tokens.iter().flat_map(|&t| [t; B]).collect();
                let by_tokens = index.find_matches_for_tokens(&BlockHasher::new(B).unwrap(), &toks);
                prop_assert_eq!(by_tokens.iter().collect::<Vec<_>>(), got);
            }
        }
        index.check_invariants();
        prop_assert!(index.len() <= config.max_blocks);
        let known: BTreeSet<WorkerId> = index.workers().collect();
        prop_assert_eq!(
            &known,
            &model.workers.keys().copied().collect::<BTreeSet<_>>()
        );
        if exact {
            prop_assert_eq!(index.len(), model.len());
            for (w, rw) in &model.workers {
                prop_assert_eq!(index.blocks_of(*w), rw.blocks.len());
            }
        }
    }
    let c = index.counters();
    prop_assert_eq!(c.gaps, model.gaps);
    prop_assert_eq!(c.stale_events, model.stale);
    if exact {
        prop_assert_eq!(c.unknown_parent_blocks, model.unknown_parent_blocks);
        prop_assert_eq!(c.unknown_removals, model.unknown_removals);
        prop_assert_eq!(c.blocks_evicted, 0);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1024, ..ProptestConfig::default() })]

    /// Unbounded (the bound never triggers): same answers as the model, always.
    #[test]
    fn matches_reference_model(ops in proptest::collection::vec(small_op(), 0..80)) {
        run(&ops, IndexConfig::default(), true)?;
    }

    /// Tight bounds: eviction triggers constantly; the index may forget, never invent.
    #[test]
    fn bounded_index_never_over_reports(
        ops in proptest::collection::vec(small_op(), 0..80),
        max_blocks in 0usize..12,
    ) {
        run(&ops, IndexConfig { max_blocks, ..IndexConfig::default() }, false)?;
    }

    /// Arbitrary events (any ids, any sequence numbers, wrap-around, many workers, tight
    /// bounds): no panic, invariants hold, nothing over-reported.
    #[test]
    fn arbitrary_events_never_panic(
        ops in proptest::collection::vec(wild_op(), 0..80),
        max_blocks in 0usize..40,
        max_workers in 0usize..6,
    ) {
        run(&ops, IndexConfig { max_blocks, max_workers }, false)?;
    }
}
