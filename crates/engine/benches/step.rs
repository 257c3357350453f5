//! One scheduler step at 64 running sequences (seed 002's batch), the simulator's unit of work.
//!
//! Each iteration completes one decode step of 64 sequences (5,000-token contexts, KV events
//! as blocks fill) and plans the next one, then drains the events, as a driver would.

// A benchmark is a driver: it reads the clock to time the core (crates' clippy.toml).
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use engine::{Engine, EngineConfig, EngineRequest, Leg, OutputSpec, RequestId};
use kv_index::WorkerId;
use nanotime::Nanos;

const OUTPUT: u32 = 100_000;

/// An engine with 64 sequences past prefill, decoding.
fn warm_engine(coalesce: bool) -> Engine {
    let mut cfg = EngineConfig::seed_002();
    // Room for 64 long generations without preemption.
    cfg.num_gpu_blocks_override = Some(400_000);
    cfg.coalesce_decode = coalesce;
    let mut e = Engine::new(cfg, WorkerId(1)).expect("config");
    for i in 0..64u64 {
        let prompt: Vec<u32> = (0..5_000).map(|t| (i as u32) << 16 | t).collect();
        let req = EngineRequest {
            id: RequestId(i),
            prompt: prompt.into(),
            output: OutputSpec::Count(OUTPUT),
            leg: Leg::ByRole,
        };
        e.submit(req, Nanos::ZERO);
    }
    // Prefill: 64 × 5,000 tokens at 16,384 per step.
    while e.metrics().prefill_tokens_computed < 64 * 5_000 {
        let t = e.poll_timeout().expect("busy");
        e.handle_timeout(t);
        while e.poll_event().is_some() {}
    }
    e
}

/// Time of `iters` driver calls (`handle_timeout` at `poll_timeout`, then drain the events),
/// on fresh warm engines, each used for at most `calls_per_engine` calls so no request
/// finishes mid-measurement.
fn time_calls(coalesce: bool, calls_per_engine: u64, iters: u64) -> Duration {
    let mut total = Duration::ZERO;
    let mut left = iters;
    while left > 0 {
        let mut e = warm_engine(coalesce);
        let n = left.min(calls_per_engine);
        let start = Instant::now();
        for _ in 0..n {
            let t = e.poll_timeout().unwrap_or(Nanos::ZERO);
            e.handle_timeout(t);
            while let Some(ev) = e.poll_event() {
                black_box(ev);
            }
        }
        total += start.elapsed();
        left -= n;
    }
    total
}

fn bench_step(c: &mut Criterion) {
    // One call is one decode step: stay well inside the outputs.
    c.bench_function("step_decode_batch64", |b| {
        b.iter_custom(|iters| time_calls(false, u64::from(OUTPUT) / 2, iters))
    });
}

/// Speed mode: one call advances a whole stretch (up to 512 decode steps of 64 sequences).
fn bench_stretch(c: &mut Criterion) {
    c.bench_function("stretch_decode_batch64", |b| {
        b.iter_custom(|iters| time_calls(true, u64::from(OUTPUT) / 1_024, iters))
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(50).measurement_time(Duration::from_secs(5));
    targets = bench_step, bench_stretch
}
criterion_main!(benches);
