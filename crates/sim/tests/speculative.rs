//! Speculative decoding through the simulator: acceptance and tokens per step reach the
//! results, ITL falls, speed mode still equals step-by-step, and TTFT splits by turn.

mod common;

use common::TestChat;
use engine::HardwareProfile;
use nanotime::Nanos;
use router::PolicyKind;
use sim::bench::{BenchSpec, JobResult, aggregate};
use sim::{Phase, RunOutput, SimConfig, Simulation};

fn seed_003(spec: Option<&str>) -> SimConfig {
    let profile = HardwareProfile::h100_tp4_llama70b_fp8();
    let mut cfg = SimConfig::new(2, profile.clone(), PolicyKind::KvLoad);
    cfg.engine.spec_decode = spec.map(|s| profile.speculative_config(s).unwrap());
    cfg.extended_metrics = true;
    cfg
}

fn chat(base: SimConfig) -> (BenchSpec, Vec<JobResult>) {
    let spec = BenchSpec {
        routers: vec![PolicyKind::KvLoad],
        levels: vec![24],
        sweeps: 1,
        warmup: Nanos::from_secs(60),
        window: Nanos::from_secs(120),
        snapshots: 2,
        lookback: None,
        seed: 5,
        continuous: true,
        base,
    };
    let results = common::run_jobs(&spec);
    (spec, results)
}

#[test]
fn acceptance_and_tokens_per_step_reach_the_results_and_itl_falls() {
    let (spec_off, off) = chat(seed_003(None));
    let off = aggregate(&spec_off, off, "h100-tp4-llama70b-fp8");
    let plain = &off.summary[0].metrics;
    assert_eq!(plain.tokens_per_step, Some(1.0));
    assert_eq!(plain.acceptance_rate, None);
    for name in ["draft", "eagle3"] {
        let (spec, results) = chat(seed_003(Some(name)));
        let config = spec.base.engine.spec_decode.clone().unwrap();
        let results = aggregate(&spec, results, "h100-tp4-llama70b-fp8");
        let m = &results.summary[0].metrics;
        let alpha = m.acceptance_rate.unwrap();
        // Near the shares' mean (positions are evaluated more often in the more predictable
        // class, which pulls it up a little; sampling moves it either way).
        let mean = config.mean_acceptance_rate();
        assert!((alpha - mean).abs() < 0.03, "{name}: {alpha} vs {mean}");
        let tps = m.tokens_per_step.unwrap();
        let want = config.mean_tokens_per_step();
        assert!((tps / want - 1.0).abs() < 0.05, "{name}: {tps} vs {want}");
        // An 8B draft model pays K passes of its own, reading its own KV each time; an
        // EAGLE-3 head is nearly free: at 12 sequences per replica the first gains little,
        // the second a lot.
        let (itl, itl_plain) = (m.itl_ms.p50.unwrap(), plain.itl_ms.p50.unwrap());
        let most = if name == "draft" { 0.95 } else { 0.6 };
        assert!(itl < most * itl_plain, "{name}: ITL {itl} vs {itl_plain}");
        // The run rows carry them too, and the JSON has the fields.
        assert!(results.runs[0].metrics.acceptance_rate.is_some());
        let json = serde_json::to_string(&results).unwrap();
        assert!(json.contains("\"acceptance_rate\"") && json.contains("\"tokens_per_step\""));
    }
    // TTFT split by turn (which way it leans depends on the router and the corpus: the
    // passages are shared, so under KV routing turn 1 hits them too).
    let (t1, later) = (plain.ttft_turn1_ms.unwrap(), plain.ttft_later_ms.unwrap());
    assert!(t1.p50.unwrap() > 0.0 && later.p95.unwrap() > 0.0);
}

#[test]
fn seed_002_results_keep_their_fields() {
    let mut cfg = SimConfig::new(3, HardwareProfile::h200_llama70b_fp8(), PolicyKind::Kv);
    cfg.extended_metrics = false;
    let (spec, results) = chat(cfg);
    let json = serde_json::to_string(&aggregate(&spec, results, "h200-llama70b-fp8")).unwrap();
    for field in [
        "ttft_turn1_ms",
        "ttft_later_ms",
        "acceptance_rate",
        "tokens_per_step",
        "\"phase\"",
        "\"setup\"",
    ] {
        assert!(!json.contains(field), "{field} in a seed 002 results file");
    }
}

fn small(coalesce: bool, seed: u64) -> RunOutput {
    let mut cfg = seed_003(Some("eagle3"));
    cfg.engine.coalesce_decode = coalesce;
    cfg.engine.num_gpu_blocks_override = Some(3_000);
    cfg.seed = seed;
    let phases = [8, 16]
        .into_iter()
        .map(|concurrency| Phase {
            concurrency,
            warmup: Nanos::from_secs(10),
            window: Nanos::from_secs(40),
            snapshots: 2,
            lookback: None,
        })
        .collect();
    Simulation::new(cfg, TestChat::new(3, 1_200, 8, seed), phases)
        .unwrap()
        .run(|_| {})
        .unwrap()
}

/// Speed mode with speculation gives the run step-by-step mode gives, and runs are
/// reproducible.
#[test]
fn speed_mode_equals_step_by_step_with_speculation() {
    let (slow, fast) = (small(false, 3), small(true, 3));
    // (Tokens still in a stretch at the end are not emitted yet in speed mode, so compare
    // what finished.)
    assert_eq!(slow.totals.finished, fast.totals.finished);
    assert_eq!(
        slow.totals.finished_output_tokens,
        fast.totals.finished_output_tokens
    );
    for (a, b) in slow.phases.iter().zip(&fast.phases) {
        assert_eq!(a.metrics.ttft_ms, b.metrics.ttft_ms);
        assert_eq!(a.metrics.e2e_s, b.metrics.e2e_s);
        // Engine counters are read at the period's edges, where speed mode has applied the
        // stretch in progress only up to its last boundary: equal within that stretch.
        let close = |x: Option<f64>, y: Option<f64>| (x.unwrap() / y.unwrap() - 1.0).abs() < 0.01;
        assert!(close(a.metrics.acceptance_rate, b.metrics.acceptance_rate));
        assert!(close(a.metrics.tokens_per_step, b.metrics.tokens_per_step));
        assert_eq!(a.metrics.requests, b.metrics.requests);
    }
    assert_eq!(small(true, 3), fast);
}
