//! `results.json` as the simulator writes it reads back, field for field, with the `report`
//! crate's types: the writer and every reader share one definition.

mod common;

use engine::HardwareProfile;
use nanotime::Nanos;
use report::BenchResults;
use router::PolicyKind;
use sim::SimConfig;
use sim::bench::{BenchSpec, aggregate};

#[test]
fn results_written_by_a_bench_read_back_identically() {
    let spec = BenchSpec {
        routers: vec![PolicyKind::RoundRobin, PolicyKind::Kv],
        levels: vec![6, 12],
        sweeps: 2,
        warmup: Nanos::from_secs(20),
        window: Nanos::from_secs(40),
        snapshots: 2,
        lookback: None,
        seed: 3,
        continuous: true,
        base: SimConfig::new(2, HardwareProfile::h200_llama70b_fp8(), PolicyKind::Kv),
    };
    let jobs = common::run_jobs(&spec);
    let results = aggregate(&spec, jobs, "h200-llama70b-fp8");
    assert_eq!(results.summary.len(), 4, "2 routers × 2 levels");
    assert_eq!(results.runs.len(), 8, "× 2 sweeps");
    assert!(
        results
            .summary
            .iter()
            .all(|r| r.metrics.ttft_ms.p50.is_some())
    );

    let json = serde_json::to_string_pretty(&results).unwrap();
    let read: BenchResults = serde_json::from_str(&json).unwrap();
    assert_eq!(read, results);
    assert_eq!(serde_json::to_string_pretty(&read).unwrap(), json);
}
