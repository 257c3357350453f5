//! The seed's own workload (real tokenizer, real passages) through the simulator: KV routing
//! beats round-robin on hit rate, the oracle bounds both, turns are conserved.

use engine::HardwareProfile;
use nanotime::Nanos;
use router::PolicyKind;
use sim::SimConfig;
use sim::bench::BenchSpec;

mod common;

use common::assert_kv_hits_more;

fn spec(routers: Vec<PolicyKind>) -> BenchSpec {
    BenchSpec {
        routers,
        levels: vec![30, 60],
        sweeps: 1,
        warmup: Nanos::from_secs(60),
        window: Nanos::from_secs(120),
        snapshots: 2,
        lookback: None,
        seed: 9,
        continuous: true,
        base: SimConfig::new(3, HardwareProfile::h200_llama70b_fp8(), PolicyKind::Kv),
    }
}

#[test]
fn kv_routing_beats_round_robin_on_hit_rate_and_the_oracle_bounds_both() {
    let spec = spec(vec![PolicyKind::RoundRobin, PolicyKind::Kv]);
    let results = common::run_jobs(&spec);
    let (rr, kv) = (&results[0], &results[1]);
    assert_eq!(rr.job.router, PolicyKind::RoundRobin);
    assert_kv_hits_more(&rr.phases, &kv.phases, 0.03, "seed 9");
    for (a, b) in rr.phases.iter().zip(&kv.phases) {
        for p in [a, b] {
            let oracle = p.metrics.oracle_hit_rate.unwrap();
            assert!(oracle >= p.metrics.kv_hit_rate.unwrap(), "{oracle}");
            assert!(p.metrics.errors == 0.0);
            // The seed's shape of work: ~830 output tokens, prompts of several thousand.
            let out = p.metrics.mean_output_tokens.unwrap();
            assert!((700.0..960.0).contains(&out), "{out}");
            assert!(p.metrics.mean_prompt_tokens.unwrap() > 3_500.0);
        }
    }
    for r in &results {
        let t = &r.totals;
        assert_eq!(t.issued, t.finished + t.failed + t.in_flight_at_end);
        assert_eq!(
            t.tokens_emitted,
            t.finished_output_tokens + t.in_flight_tokens_at_end
        );
        assert_eq!(t.kv_event_errors, 0);
    }
}

#[test]
fn a_bench_job_is_a_pure_function_of_its_spec() {
    let spec = spec(vec![PolicyKind::Kv]);
    let a = common::run_jobs(&spec);
    let b = common::run_jobs(&spec);
    assert_eq!(a[0].phases, b[0].phases);
    assert_eq!(a[0].totals, b[0].totals);
}
