//! Hot paths of the KV index at realistic sizes.
//!
//! `cargo bench -p kv-index -- --warm-up-time 1 --measurement-time 3`
//!
//! Fixture (per worker count W and entry count N): every worker holds an 8-block system
//! prompt; 4 workers hold the request's first 200, 160, 120 and 40 blocks; the rest of the N
//! entries are 256-block conversations spread round-robin over the workers, one worker each.
//! The request is 8,192 tokens = 256 blocks of 32.

// A benchmark is a driver: it reads the clock to time the core (crates' clippy.toml).
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

use std::collections::VecDeque;
use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kv_index::{
    BlockContent, BlockHasher, EngineBlockId, IndexConfig, KvEvent, KvEventKind, KvIndex,
    LocalBlockHash, SequenceHash, StoredBlock, WorkerId,
};

const BLOCK: usize = 32;
const REQUEST_TOKENS: usize = 8192;
const SYSTEM_BLOCKS: usize = 8;
const CHAIN_BLOCKS: usize = 256;
/// How deep the request's prefix is held by the "few workers" that served its conversation.
const REQUEST_HOLDERS: [usize; 4] = [200, 160, 120, 40];

/// splitmix64: a fast, deterministic stream of well-mixed u64s for fixture content.
struct Mix(u64);
impl Mix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

struct Fixture {
    index: KvIndex,
    hasher: BlockHasher,
    request: Vec<u32>,
    request_hashes: Vec<SequenceHash>,
    /// Per worker: next sequence number and the id of its last system-prompt block.
    next_seq: Vec<u64>,
    system_tip: Vec<EngineBlockId>,
    /// Sequence hashes (256 each) of some filler conversations, for cache-cold lookups.
    cold_requests: Vec<Vec<SequenceHash>>,
    next_id: u64,
    mix: Mix,
}

fn local_blocks(ids: impl Iterator<Item = u64>, locals: &[LocalBlockHash]) -> Vec<StoredBlock> {
    ids.zip(locals)
        .map(|(id, l)| StoredBlock {
            id: EngineBlockId(id),
            content: BlockContent::LocalHash(*l),
        })
        .collect()
}

impl Fixture {
    fn new(workers: u64, entries: usize, max_blocks: usize) -> Self {
        let hasher = BlockHasher::new(BLOCK).expect("block size");
        let mut mix = Mix(workers ^ entries as u64);
        let request: Vec<u32> = (0..REQUEST_TOKENS)
            .map(|_| (mix.next() % 128_000) as u32)
            .collect();
        let request_hashes = hasher.sequence_hashes(&request);
        let request_locals = hasher.local_hashes(&request);
        let mut f = Fixture {
            index: KvIndex::new(IndexConfig {
                max_blocks,
                ..IndexConfig::default()
            }),
            hasher,
            request,
            request_hashes,
            next_seq: vec![0; workers as usize],
            system_tip: Vec::new(),
            cold_requests: Vec::new(),
            next_id: 1,
            mix,
        };
        let system = &request_locals[..SYSTEM_BLOCKS];
        for w in 0..workers {
            let ids = f.take_ids(SYSTEM_BLOCKS);
            f.system_tip.push(EngineBlockId(ids.end - 1));
            f.apply(w, None, local_blocks(ids, system));
        }
        for (i, &depth) in REQUEST_HOLDERS.iter().enumerate() {
            let w = i as u64 % workers;
            let ids = f.take_ids(depth - SYSTEM_BLOCKS);
            let parent = f.system_tip[w as usize];
            f.apply(
                w,
                Some(parent),
                local_blocks(ids, &request_locals[SYSTEM_BLOCKS..depth]),
            );
        }
        let system_seq = f.request_hashes[SYSTEM_BLOCKS - 1];
        let mut w = 0;
        while f.index.len() + CHAIN_BLOCKS <= entries {
            let locals: Vec<LocalBlockHash> = (0..CHAIN_BLOCKS)
                .map(|_| LocalBlockHash(f.mix.next()))
                .collect();
            if f.cold_requests.len() < 4096 {
                let mut hashes = f.request_hashes[..SYSTEM_BLOCKS].to_vec();
                hashes.extend(kv_index::hash::chain_local_hashes(
                    Some(system_seq),
                    locals[..CHAIN_BLOCKS - SYSTEM_BLOCKS].iter().copied(),
                ));
                f.cold_requests.push(hashes);
            }
            let ids = f.take_ids(CHAIN_BLOCKS);
            let parent = f.system_tip[w as usize];
            f.apply(w, Some(parent), local_blocks(ids, &locals));
            w = (w + 1) % workers;
        }
        f
    }

    fn take_ids(&mut self, n: usize) -> std::ops::Range<u64> {
        let start = self.next_id;
        self.next_id += n as u64;
        start..self.next_id
    }

    fn event(&mut self, w: u64, kind: KvEventKind) -> KvEvent {
        let seq = &mut self.next_seq[w as usize];
        let event = KvEvent {
            worker: WorkerId(w),
            seq: *seq,
            kind,
        };
        *seq += 1;
        event
    }

    fn apply(&mut self, w: u64, parent: Option<EngineBlockId>, blocks: Vec<StoredBlock>) {
        let event = self.event(w, KvEventKind::Stored { parent, blocks });
        self.index
            .apply(&event)
            .expect("fixture events are in order");
    }
}

const SIZES: [(u64, usize, &str); 4] = [
    (64, 100_000, "64w_100k"),
    (64, 1_000_000, "64w_1M"),
    (1024, 100_000, "1024w_100k"),
    (1024, 1_000_000, "1024w_1M"),
];

fn bench_hashing(c: &mut Criterion) {
    let hasher = BlockHasher::new(BLOCK).expect("block size");
    let mut mix = Mix(7);
    let tokens: Vec<u32> = (0..REQUEST_TOKENS)
        .map(|_| (mix.next() % 128_000) as u32)
        .collect();
    let mut g = c.benchmark_group("hash");
    g.throughput(Throughput::Elements(REQUEST_TOKENS as u64));
    g.bench_function("sequence_hashes_8k_tokens", |b| {
        b.iter(|| hasher.sequence_hashes(black_box(&tokens)))
    });
    g.finish();
}

fn bench_find_matches(c: &mut Criterion) {
    let mut g = c.benchmark_group("find_matches");
    for (workers, entries, name) in SIZES {
        let f = Fixture::new(workers, entries, entries * 2);
        let expect = f.index.find_matches(&f.request_hashes);
        assert_eq!(expect.max(), REQUEST_HOLDERS[0] as u32);
        assert_eq!(expect.len(), workers as usize);
        // Pre-hashed request: the index's own cost.
        g.bench_with_input(BenchmarkId::new("hashed", name), &f, |b, f| {
            b.iter(|| f.index.find_matches(black_box(&f.request_hashes)))
        });
        // One routing decision's index work: hash 8,192 tokens and match (lazy hashing).
        g.bench_with_input(BenchmarkId::new("tokens_8k", name), &f, |b, f| {
            b.iter(|| {
                f.index
                    .find_matches_for_tokens(&f.hasher, black_box(&f.request))
            })
        });
        // A different 256-block conversation each time: the blocks are not in CPU cache.
        g.bench_with_input(BenchmarkId::new("hashed_cold", name), &f, |b, f| {
            let mut i = 0;
            b.iter(|| {
                i = (i + 1) % f.cold_requests.len();
                f.index.find_matches(black_box(&f.cold_requests[i]))
            })
        });
    }
    g.finish();
}

/// Steady-state ingestion against a 1M-entry index: each step stores a 16-block chain on one
/// worker and removes the chain stored 4,096 steps earlier (as engines evict), or, with
/// `evict`, only stores and lets the bound evict.
fn ingest(c: &mut Criterion, workers: u64, tokens: bool, evict: bool, name: &str) {
    const CHAIN: usize = 16;
    const LAG: usize = 4096;
    const BATCH: u64 = 1024;
    let entries = 1_000_000;
    let max_blocks = if evict { entries } else { entries * 2 };
    let mut f = Fixture::new(workers, entries, max_blocks);
    let mut in_flight: VecDeque<(u64, Vec<EngineBlockId>)> = VecDeque::new();
    let mut w = 0u64;
    let mut g = c.benchmark_group("ingest");
    g.throughput(Throughput::Elements(CHAIN as u64));
    g.bench_function(name, |b| {
        b.iter_custom(|iters| {
            let mut spent = Duration::ZERO;
            let mut done = 0;
            while done < iters {
                // Build a batch of events outside the timed section.
                let n = BATCH.min(iters - done);
                let mut events = Vec::with_capacity(2 * n as usize);
                for _ in 0..n {
                    let ids = f.take_ids(CHAIN);
                    let blocks: Vec<StoredBlock> = ids
                        .clone()
                        .map(|id| StoredBlock {
                            id: EngineBlockId(id),
                            content: if tokens {
                                BlockContent::Tokens(
                                    (0..BLOCK).map(|_| f.mix.next() as u32).collect(),
                                )
                            } else {
                                BlockContent::LocalHash(LocalBlockHash(f.mix.next()))
                            },
                        })
                        .collect();
                    let parent = Some(f.system_tip[w as usize]);
                    events.push(f.event(w, KvEventKind::Stored { parent, blocks }));
                    if !evict {
                        in_flight.push_back((w, ids.map(EngineBlockId).collect()));
                        if in_flight.len() > LAG {
                            if let Some((old_w, old)) = in_flight.pop_front() {
                                events.push(f.event(old_w, KvEventKind::Removed { blocks: old }));
                            }
                        }
                    }
                    w = (w + 1) % workers;
                }
                let start = Instant::now();
                for e in &events {
                    let _ = black_box(f.index.apply(black_box(e)));
                }
                spent += start.elapsed();
                done += n;
            }
            spent
        })
    });
    g.finish();
    assert_eq!(f.index.counters().gaps, 0);
}

fn bench_ingest(c: &mut Criterion) {
    ingest(c, 64, false, false, "store_remove_local_hash/64w_1M");
    ingest(c, 64, true, false, "store_remove_tokens/64w_1M");
    ingest(c, 1024, false, false, "store_remove_local_hash/1024w_1M");
    ingest(c, 64, false, true, "store_evicting_local_hash/64w_1M");
}

fn bench_fixture(c: &mut Criterion) {
    // Building a 1M-entry index from events: bulk ingestion, one core.
    let mut g = c.benchmark_group("fixture");
    g.sample_size(10);
    g.throughput(Throughput::Elements(1_000_000));
    g.bench_function("build_64w_1M", |b| {
        b.iter(|| Fixture::new(64, 1_000_000, 2_000_000).index.len())
    });
    g.finish();
}

criterion_group!(
    benches,
    bench_hashing,
    bench_find_matches,
    bench_ingest,
    bench_fixture
);
criterion_main!(benches);
