//! Whole-run properties on a small multi-turn chat: conservation, determinism, the oracle
//! bound, KV routing against round-robin, and speed mode against step-by-step decoding.

mod common;

use common::{TestChat, WORKERS, assert_kv_hits_more, small_pool_config};
use nanotime::Nanos;
use router::PolicyKind;
use sim::{Outcome, Phase, RunOutput, SimConfig, Simulation};

fn config(policy: PolicyKind, coalesce: bool, seed: u64) -> SimConfig {
    let mut cfg = small_pool_config(policy, seed);
    cfg.engine.coalesce_decode = coalesce;
    cfg
}

fn phases() -> Vec<Phase> {
    [12, 24]
        .into_iter()
        .map(|concurrency| Phase {
            concurrency,
            warmup: Nanos::from_secs(20),
            window: Nanos::from_secs(60),
            snapshots: 3,
            lookback: None,
        })
        .collect()
}

fn run(policy: PolicyKind, coalesce: bool, seed: u64) -> RunOutput {
    let workload = TestChat::new(4, 1_500, 12, seed);
    Simulation::new(config(policy, coalesce, seed), workload, phases())
        .unwrap()
        .run(|_| {})
        .unwrap()
}

#[test]
fn every_turn_ends_once_and_every_token_is_accounted_for() {
    for policy in PolicyKind::ALL {
        let out = run(policy, true, 7);
        let t = &out.totals;
        assert!(t.issued > 100, "{policy}: {t:?}");
        assert_eq!(
            t.issued,
            t.finished + t.failed + t.in_flight_at_end,
            "{policy}: {t:?}"
        );
        assert_eq!(
            t.tokens_emitted,
            t.finished_output_tokens + t.in_flight_tokens_at_end,
            "{policy}"
        );
        assert_eq!(t.kv_event_errors, 0, "{policy}");
        // Every record is one turn; finished ones produced exactly their tokens.
        let mut ids: Vec<u64> = out.records.iter().map(|r| r.id).collect();
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), out.records.len());
        assert_eq!(out.records.len() as u64, t.finished + t.failed);
        let finished_tokens: u64 = out
            .records
            .iter()
            .filter(|r| r.outcome == Outcome::Finished)
            .map(|r| u64::from(r.output_tokens))
            .sum();
        assert_eq!(finished_tokens, t.finished_output_tokens);
        // Each window's streaming accumulators agree with a recomputation from the records.
        for p in &out.phases {
            for (snap, &(from, to)) in p.snapshots.iter().zip(&p.windows_s) {
                let again = sim::metrics::of_window(
                    &out.records,
                    Nanos::from_secs_f64(from),
                    Nanos::from_secs_f64(to),
                    0,
                    true,
                );
                assert_eq!(
                    (
                        &snap.ttft_ms,
                        &snap.e2e_s,
                        &snap.itl_ms,
                        snap.kv_hit_rate,
                        snap.requests
                    ),
                    (
                        &again.ttft_ms,
                        &again.e2e_s,
                        &again.itl_ms,
                        again.kv_hit_rate,
                        again.requests
                    ),
                    "{policy}"
                );
            }
        }
        for p in &out.phases {
            assert_eq!(p.workers.len(), WORKERS as usize);
            assert!(
                p.workers
                    .iter()
                    .all(|w| w.utilisation > 0.0 && w.utilisation <= 1.0)
            );
        }
    }
}

#[test]
fn same_seed_same_results_different_seed_different_results() {
    let a = run(PolicyKind::Kv, true, 3);
    let b = run(PolicyKind::Kv, true, 3);
    assert_eq!(a, b);
    let c = run(PolicyKind::Kv, true, 4);
    assert_ne!(a.records, c.records);
}

#[test]
fn oracle_bounds_every_policy() {
    for policy in PolicyKind::ALL {
        let out = run(policy, true, 11);
        for r in &out.records {
            assert!(
                r.oracle_cached_tokens >= r.cached_prompt_tokens,
                "{policy}: request {} cached {} > oracle {}",
                r.id,
                r.cached_prompt_tokens,
                r.oracle_cached_tokens
            );
        }
        for p in &out.phases {
            for s in &p.snapshots {
                assert!(
                    s.oracle_hit_rate.unwrap() >= s.kv_hit_rate.unwrap(),
                    "{policy}"
                );
            }
        }
    }
}

#[test]
fn kv_routing_hits_more_than_round_robin() {
    for seed in [1, 2] {
        let rr = run(PolicyKind::RoundRobin, true, seed);
        let kv = run(PolicyKind::Kv, true, seed);
        assert_kv_hits_more(&rr.phases, &kv.phases, 0.05, &format!("seed {seed}"));
    }
}

/// Speed mode advances identical decode steps together; the engine guarantees the same
/// finish times, so for a KV-blind policy every request's timestamps are identical and only
/// the tokens-per-window interpolation inside a stretch differs. With the KV policy the
/// router sees a stretch's KV events at its end, which may change a few decisions.
#[test]
fn speed_mode_matches_step_by_step() {
    let step = run(PolicyKind::RoundRobin, false, 5);
    let fast = run(PolicyKind::RoundRobin, true, 5);
    assert_eq!(step.records.len(), fast.records.len());
    for (a, b) in step.records.iter().zip(&fast.records) {
        assert_eq!(
            (a.first_token_at, a.ended_at, a.cached_prompt_tokens),
            (b.first_token_at, b.ended_at, b.cached_prompt_tokens)
        );
    }
    for (a, b) in step.phases.iter().zip(&fast.phases) {
        assert_eq!(a.metrics.ttft_ms, b.metrics.ttft_ms);
        assert_eq!(a.metrics.e2e_s, b.metrics.e2e_s);
        // Tokens of a stretch that crosses a window edge are spread evenly over it, so each
        // running request may put a token or two on the wrong side of each edge: a few
        // tenths of a percent of a 20-second window.
        let (x, y) = (a.metrics.output_tokens_per_s, b.metrics.output_tokens_per_s);
        assert!((x - y).abs() / x < 0.005, "TOPS {x} vs {y}");
    }
    let step = run(PolicyKind::Kv, false, 5);
    let fast = run(PolicyKind::Kv, true, 5);
    for (a, b) in step.phases.iter().zip(&fast.phases) {
        let close = |x: f64, y: f64, tol: f64| (x - y).abs() / x.abs().max(1e-9) < tol;
        let (m, n) = (&a.metrics, &b.metrics);
        assert!(
            close(m.output_tokens_per_s, n.output_tokens_per_s, 0.03),
            "{m:?}\n{n:?}"
        );
        assert!(
            close(m.e2e_s.p50.unwrap(), n.e2e_s.p50.unwrap(), 0.05),
            "{m:?}\n{n:?}"
        );
        assert!(
            close(m.kv_hit_rate.unwrap(), n.kv_hit_rate.unwrap(), 0.02),
            "{m:?}\n{n:?}"
        );
        assert!(
            close(m.itl_ms.p50.unwrap(), n.itl_ms.p50.unwrap(), 0.05),
            "{m:?}\n{n:?}"
        );
    }
}

#[test]
fn bad_settings_are_refused_with_a_reason() {
    let mut cfg = config(PolicyKind::Kv, true, 0);
    cfg.workers = 0;
    let err = Simulation::new(cfg, TestChat::new(1, 100, 1, 0), phases()).unwrap_err();
    assert!(err.to_string().contains("at least one worker"), "{err}");
    let mut p = phases();
    p[0].lookback = Some(Nanos::from_secs(1000));
    let err = Simulation::new(
        config(PolicyKind::Kv, true, 0),
        TestChat::new(1, 100, 1, 0),
        p,
    )
    .unwrap_err();
    assert!(err.to_string().contains("lookback"), "{err}");
}
