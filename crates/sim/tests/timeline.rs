//! The per-worker timeline on a small chat: deterministic, bounded, exact against the
//! router's and engines' own state at every sample, and without effect on the run.

mod common;

use common::{TestChat, WORKERS, small_pool_config};
use kv_index::WorkerId;
use nanotime::Nanos;
use router::PolicyKind;
use sim::{
    Outcome, Phase, SimConfig, SimError, Simulation, Timeline, TimelineConfig, TimelineError,
};

/// Ten conversations per worker against a batch limit of eight: engines must queue.
const CONCURRENCY: u32 = 30;
const MAX_NUM_SEQS: u32 = 8;

fn config(seed: u64) -> SimConfig {
    let mut cfg = small_pool_config(PolicyKind::Kv, seed);
    cfg.engine.max_num_seqs = MAX_NUM_SEQS;
    cfg
}

fn phases() -> Vec<Phase> {
    vec![Phase {
        concurrency: CONCURRENCY,
        warmup: Nanos::from_secs(10),
        window: Nanos::from_secs(50),
        snapshots: 1,
        lookback: None,
    }]
}

fn simulation(seed: u64) -> Simulation<TestChat> {
    let workload = TestChat::new(4, 1_500, CONCURRENCY, seed);
    Simulation::new(config(seed), workload, phases()).unwrap()
}

fn with_timeline(seed: u64, cfg: TimelineConfig) -> Result<Simulation<TestChat>, SimError> {
    simulation(seed).with_timeline(cfg)
}

fn timeline_of(seed: u64) -> Timeline {
    let out = with_timeline(seed, TimelineConfig::default())
        .unwrap()
        .run(|_| {})
        .unwrap();
    out.timeline.unwrap()
}

#[test]
fn same_seed_same_timeline_byte_for_byte() {
    let (a, b) = (timeline_of(3), timeline_of(3));
    assert_eq!(a, b);
    assert_eq!(a.to_csv(), b.to_csv());
    // Not trivially equal: something happened, and another seed tells a different story.
    assert!(a.samples.iter().any(|s| s.first_tokens > 0));
    assert_ne!(a, timeline_of(4));
}

#[test]
fn off_by_default_and_recording_changes_nothing_in_the_run() {
    let plain = simulation(5).run(|_| {}).unwrap();
    assert!(plain.timeline.is_none());
    let mut recorded = with_timeline(5, TimelineConfig::default())
        .unwrap()
        .run(|_| {})
        .unwrap();
    assert!(recorded.timeline.take().is_some());
    assert_eq!(plain, recorded);
}

#[test]
fn the_grid_covers_the_run_within_its_row_bound() {
    // 60 s at 1 s: 60 samples × 3 workers = 180 rows.
    let exact = TimelineConfig {
        interval: Nanos::from_secs(1),
        max_rows: 180,
    };
    let out = with_timeline(1, exact).unwrap().run(|_| {}).unwrap();
    let t = out.timeline.unwrap();
    assert_eq!(t.rows(), 180);
    let instants: Vec<Nanos> = t.samples.iter().map(|s| s.at).collect();
    let grid: Vec<Nanos> = (1..=60).map(Nanos::from_secs).collect();
    assert_eq!(instants, grid);
    assert!(
        t.samples
            .iter()
            .all(|s| s.workers.len() == WORKERS as usize)
    );

    let over = TimelineConfig {
        max_rows: 179,
        ..exact
    };
    match with_timeline(1, over) {
        Err(SimError::Timeline(TimelineError::TooManyRows { rows, max_rows, .. })) => {
            assert_eq!((rows, max_rows), (180, 179));
        }
        other => panic!("expected the bound to refuse the run, got {other:?}"),
    }
    let zero = TimelineConfig {
        interval: Nanos::ZERO,
        ..exact
    };
    assert!(matches!(
        with_timeline(1, zero),
        Err(SimError::Timeline(TimelineError::ZeroInterval))
    ));
}

/// At every sample instant the row equals the router's accounting and the engine's own
/// counts at that instant; the engines' queues account for every request the router sent.
#[test]
fn samples_match_router_and_engines_at_the_instant() {
    let interval = Nanos::from_millis(700);
    let cfg = TimelineConfig {
        interval,
        ..TimelineConfig::default()
    };
    let mut sim = with_timeline(9, cfg).unwrap();
    let end = sim.end();
    let mut t = Nanos::ZERO;
    let mut queued_somewhere = false;
    while t + interval <= end {
        t += interval;
        sim.run_until(t).unwrap();
        let timeline = sim.timeline().unwrap();
        let sample = timeline.samples.last().unwrap();
        assert_eq!(sample.at, t);
        let mut total = 0;
        for (w, row) in sample.workers.iter().enumerate() {
            let load = sim.router().load(WorkerId(w as u64)).unwrap();
            let m = sim.engines()[w].metrics();
            assert_eq!(row.in_flight, load.in_flight, "worker {w} at {t}");
            assert_eq!(
                row.pending_prefill_tokens, load.pending_prefill_tokens,
                "worker {w} at {t}"
            );
            assert_eq!(
                (row.running, row.waiting, row.kv_blocks_used),
                (m.running, m.waiting, m.kv_blocks_used),
                "worker {w} at {t}"
            );
            // What the router sent and has not seen finish is in the engine, admitted or not.
            assert_eq!(
                row.in_flight,
                row.running + row.waiting,
                "worker {w} at {t}"
            );
            assert!(row.running <= MAX_NUM_SEQS, "worker {w} at {t}: {row:?}");
            queued_somewhere |= row.waiting > 0;
            total += row.in_flight;
        }
        // No think time, no frontend cap: every conversation has exactly one turn routed.
        assert_eq!(sample.queued, 0);
        assert_eq!(total, CONCURRENCY, "at {t}");
    }
    assert!(
        queued_somewhere,
        "30 conversations on 3 × 8 slots must queue"
    );
    assert_eq!(sim.timeline().unwrap().samples.len(), 85, "⌊60 s / 0.7 s⌋");
}

/// Each sample's TTFT figures, for the fleet and per worker, are those of the requests whose
/// first token came in its interval, as their records tell.
#[test]
fn interval_ttft_agrees_with_the_records() {
    let mut sim = with_timeline(11, TimelineConfig::default()).unwrap();
    let end = sim.end();
    // Past the end the grid stops; turns whose first token came before it get to finish,
    // so that their records exist.
    sim.run_until(end + Nanos::from_secs(120)).unwrap();
    let out = sim.finish();
    let timeline = out.timeline.unwrap();
    assert_eq!(timeline.samples.last().unwrap().at, end);
    let mut spikes = 0;
    for s in &timeline.samples {
        let from = s.at - timeline.interval;
        let in_interval: Vec<_> = out
            .records
            .iter()
            .filter(|r| r.first_token_at.is_some_and(|f| f > from && f <= s.at))
            .collect();
        let ms = |r: &&sim::RequestRecord| r.ttft().unwrap().0 as f64 / 1e6;
        let mut ttfts: Vec<f64> = in_interval.iter().map(ms).collect();
        assert_eq!(s.first_tokens as usize, ttfts.len(), "at {}", s.at);
        let max = ttfts.iter().copied().reduce(f64::max);
        assert_eq!(s.ttft_max_ms, max, "at {}", s.at);
        let p = sim::Percentiles::of(&mut ttfts);
        assert_eq!(
            (s.ttft_p50_ms, s.ttft_p95_ms),
            (p.p50, p.p95),
            "at {}",
            s.at
        );
        for (w, row) in s.workers.iter().enumerate() {
            let mine: Vec<f64> = in_interval
                .iter()
                .filter(|r| r.worker == Some(w as u32))
                .map(ms)
                .collect();
            assert_eq!(
                row.first_tokens as usize,
                mine.len(),
                "worker {w} at {}",
                s.at
            );
            let max = mine.iter().copied().reduce(f64::max);
            assert_eq!(row.ttft_max_ms, max, "worker {w} at {}", s.at);
        }
        spikes += usize::from(s.ttft_max_ms.is_some_and(|m| m > 1_000.0));
    }
    assert!(
        out.records.iter().all(|r| r.outcome == Outcome::Finished),
        "every turn of this run finishes"
    );
    assert!(spikes > 0, "queueing behind 8 slots shows as TTFT over 1 s");
}
