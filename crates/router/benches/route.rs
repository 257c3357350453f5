//! One routing decision for an 8k-token request, hashing included, against a realistically
//! filled index: `cargo bench -p router --bench route`.

// A benchmark is a driver: it reads the clock to time the core (crates' clippy.toml).
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use kv_index::{BlockHasher, IndexConfig, KvEvent, KvEventKind, WorkerId};
use nanotime::Nanos;
use router::{PolicyKind, RequestId, Router, RouterConfig, WorkerLimits};

const BLOCK: usize = 32;
const REQUEST_TOKENS: usize = 8192;
const PASSAGES: u32 = 10;
const PASSAGE_BLOCKS: usize = 110;

/// Tokens of conversation `conv`: one of 10 shared passages, then its own history.
fn conversation(conv: u32, blocks: usize) -> Vec<u32> {
    let passage = conv % PASSAGES;
    (0..blocks * BLOCK)
        .map(|i| {
            if i < PASSAGE_BLOCKS * BLOCK {
                passage * 1_000_003 + i as u32
            } else {
                0x8000_0000 | (conv.wrapping_mul(7919) ^ i as u32)
            }
        })
        .collect()
}

fn stored(hasher: &BlockHasher, worker: u64, seq: u64, tokens: &[u32]) -> KvEvent {
    KvEvent {
        worker: WorkerId(worker),
        seq,
        kind: KvEventKind::stored_prompt(hasher, tokens),
    }
}

/// A router over `workers` workers whose index holds about `blocks` (worker, block) entries:
/// every worker holds three passages, and 256-block conversations are spread round-robin.
/// Returns the router and the number of conversations stored (ids `PASSAGES..`).
fn filled_router(workers: u64, blocks: usize) -> (Router, u32) {
    let mut router = Router::new(RouterConfig {
        policy: PolicyKind::Kv,
        index: IndexConfig {
            max_blocks: blocks * 2,
            ..IndexConfig::default()
        },
        ..RouterConfig::default()
    })
    .expect("valid config");
    let hasher = *router.hasher();
    let mut next_seq = vec![0u64; workers as usize];
    let mut store = |router: &mut Router, w: u64, tokens: &[u32]| {
        let seq = &mut next_seq[w as usize];
        router
            .apply_event(&stored(&hasher, w, *seq, tokens))
            .expect("gap-free");
        *seq += 1;
    };
    for w in 0..workers {
        router
            .add_worker(WorkerId(w), WorkerLimits::default())
            .expect("within the worker bound");
        // Three of the ten passages per worker (under RR every worker ends up with all ten;
        // under KV routing they concentrate).
        for p in (0..3).map(|k| (w as u32 + k) % PASSAGES) {
            store(&mut router, w, &conversation(p, PASSAGE_BLOCKS));
        }
    }
    let conv_blocks = REQUEST_TOKENS / BLOCK;
    let mut conv = PASSAGES;
    while router.index().len() < blocks {
        store(
            &mut router,
            u64::from(conv) % workers,
            &conversation(conv, conv_blocks),
        );
        conv += 1;
    }
    (router, conv - PASSAGES)
}

fn bench_route(c: &mut Criterion) {
    let mut group = c.benchmark_group("route_8k_tokens");
    group.sample_size(30);
    let cases = [
        (64u64, 100_000usize, 0u64),
        (64, 1_000_000, 0),
        (64, 1_000_000, 60),
        (1024, 1_000_000, 0),
    ];
    for (workers, blocks, in_flight_per_worker) in cases {
        let (mut router, conversations) = filled_router(workers, blocks);
        // Busy workers: `in_flight_per_worker` long conversations each, so the decode-load
        // term (distinct active blocks per worker) is computed against real active sets.
        let busy = workers * in_flight_per_worker;
        for i in 0..busy {
            let key = router.key(&conversation(PASSAGES + i as u32, 200));
            router
                .route(RequestId(u64::MAX - i), &key, Nanos::ZERO)
                .expect("routable");
        }
        // Next turns of 512 different stored conversations, taken in turn so that each
        // decision walks parts of the index the previous one did not (cold caches, as in
        // production): each history (200 blocks) is cached on one worker, its passage on several.
        let requests: Vec<Vec<u32>> = (0..512u32)
            .map(|c| {
                let stored = PASSAGES + (c * 7919) % conversations.max(1);
                let mut tokens = conversation(stored, 200);
                tokens.extend(
                    (0..REQUEST_TOKENS - tokens.len()).map(|i| 0xC000_0000 | (c << 14) | i as u32),
                );
                tokens
            })
            .collect();
        let label = format!(
            "{workers}_workers_{}k_blocks_{in_flight_per_worker}_in_flight_per_worker",
            blocks / 1000
        );
        group.bench_function(BenchmarkId::from_parameter(label), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for i in 0..iters {
                    let start = Instant::now();
                    let tokens = &requests[i as usize % requests.len()];
                    let key = router.key(black_box(tokens));
                    let decision = router.route(RequestId(i), &key, Nanos::ZERO);
                    total += start.elapsed();
                    black_box(&decision);
                    // Untimed: keep the router's load steady between iterations.
                    router.on_finished(RequestId(i), Nanos::ZERO);
                }
                total
            });
        });
    }
    group.finish();
}

criterion_group!(benches, bench_route);
criterion_main!(benches);
