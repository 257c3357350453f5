//! Turn generation speed: one iteration finishes a turn and issues the next one (question
//! encode, reply draw, one copy of the prompt). `cargo bench -p workload --bench turns`.

use std::collections::VecDeque;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use nanotime::Nanos;
use std::hint::black_box;
use workload::{Assets, ChatWorkload, TurnKey, WorkloadConfig};

struct Loop {
    workload: ChatWorkload,
    in_flight: VecDeque<TurnKey>,
    now: Nanos,
}

impl Loop {
    fn new(concurrency: u32) -> Loop {
        let config = WorkloadConfig {
            concurrency,
            ramp_s: 0.0,
            ..WorkloadConfig::default()
        };
        let assets = Assets::builtin().expect("assets");
        let mut workload = ChatWorkload::new(config, assets, 1, Nanos::ZERO).expect("workload");
        let mut in_flight = VecDeque::new();
        while let Some(r) = workload.poll_request() {
            in_flight.push_back(r.key);
        }
        Loop {
            workload,
            in_flight,
            now: Nanos::ZERO,
        }
    }

    /// Finishes the oldest turn, lets time pass to the next timer, and issues what is ready.
    /// Returns the prompt tokens issued.
    fn step(&mut self) -> usize {
        self.now += Nanos::from_millis(10);
        if let Some(id) = self.in_flight.pop_front() {
            self.workload.on_turn_finished(id, self.now);
        }
        if let Some(t) = self.workload.poll_timeout() {
            if self.in_flight.is_empty() || t <= self.now {
                self.now = self.now.max(t);
            }
        }
        self.workload.handle_timeout(self.now);
        let mut tokens = 0;
        while let Some(r) = self.workload.poll_request() {
            tokens += r.prompt.len();
            self.in_flight.push_back(r.key);
            black_box(&r);
        }
        tokens
    }
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("workload");
    group.throughput(Throughput::Elements(1));
    for concurrency in [100u32, 10_000] {
        let mut lp = Loop::new(concurrency);
        // Warm up into the steady state (later turns, longer prompts).
        for _ in 0..concurrency * 3 {
            lp.step();
        }
        group.bench_function(format!("turn_cycle_concurrency_{concurrency}"), |b| {
            b.iter(|| black_box(lp.step()))
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20);
    targets = bench
}
criterion_main!(benches);
