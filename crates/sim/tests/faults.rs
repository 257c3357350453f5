//! Seeded fault simulation (`kvroute sim --faults`): the invariants hold over hundreds of
//! seeds and every scenario, and each fault really happens (so these tests could fail).

mod common;

use std::sync::{Arc, OnceLock};

use nanotime::Nanos;
use router::PolicyKind;
use sim::chat::Chat;
use sim::faults::FaultSpec;
use sim::{Phase, ReplicaSetup, RunOutput, SimConfig, SimError, Simulation};
use workload::{Assets, Distribution, WorkloadConfig};

fn assets() -> Arc<Assets> {
    static ASSETS: OnceLock<Arc<Assets>> = OnceLock::new();
    Arc::clone(ASSETS.get_or_init(|| Assets::builtin().expect("built-in assets")))
}

/// A small fleet (three workers with 600-block pools, so blocks are evicted and removal
/// events matter) under 16 conversations with short replies, measured over `seconds`.
fn config(seed: u64) -> SimConfig {
    let mut cfg = common::small_pool_config(PolicyKind::Kv, seed);
    cfg.engine.num_gpu_blocks_override = Some(600);
    cfg.keep_all_records = false;
    cfg
}

/// The same fleet behind three gateway replicas that share their decisions 5 ms late.
fn replica_config(seed: u64) -> SimConfig {
    let mut cfg = config(seed);
    cfg.replicas = ReplicaSetup {
        count: 3,
        sync: Some(Nanos::from_millis(5)),
    };
    cfg
}

fn simulation(
    cfg: SimConfig,
    faults: Option<&str>,
    seconds: u64,
) -> Result<Simulation<Chat>, SimError> {
    let workload = WorkloadConfig {
        output_tokens: Distribution::Uniform {
            min: 50.0,
            max: 250.0,
        },
        ..WorkloadConfig::default()
    };
    let concurrency = 16;
    let chat = Chat::new(&workload, assets(), cfg.seed, concurrency).expect("workload");
    let phase = Phase {
        concurrency,
        warmup: Nanos::from_secs(10),
        window: Nanos::from_secs(seconds - 10),
        snapshots: 1,
        lookback: None,
    };
    let sim = Simulation::new(cfg, chat, vec![phase])?;
    match faults {
        Some(spec) => sim.with_faults(&spec.parse::<FaultSpec>().expect("spec")),
        None => Ok(sim),
    }
}

fn run_with(cfg: SimConfig, faults: Option<&str>, seconds: u64) -> Result<RunOutput, SimError> {
    simulation(cfg, faults, seconds)?.run(|_| {})
}

fn run(seed: u64, faults: Option<&str>, seconds: u64) -> RunOutput {
    run_with(config(seed), faults, seconds)
        .unwrap_or_else(|e| panic!("seed {seed}, faults {faults:?}: {e}"))
}

/// The simulated gateway before migration: a failed stream ends with its error, and a
/// worker returns at its first passing health check (`--migration-limit 0 --ejection-time 0`).
fn run_without_migration(seed: u64, faults: &str, seconds: u64) -> RunOutput {
    let mut cfg = config(seed);
    cfg.failover.migration_limit = 0;
    cfg.failover.ejection = router::EjectionConfig::with_base(Nanos::ZERO);
    run_with(cfg, Some(faults), seconds)
        .unwrap_or_else(|e| panic!("seed {seed}, faults {faults}: {e}"))
}

/// Every token a worker emitted is counted once: in the record of the turn it belongs to
/// (a migrated turn's record counts every worker's tokens), or in a turn still in flight.
fn assert_tokens_counted_once(out: &RunOutput) {
    let recorded: u64 = out.records.iter().map(|r| u64::from(r.output_tokens)).sum();
    assert_eq!(
        out.totals.tokens_emitted,
        recorded + out.totals.in_flight_tokens_at_end,
        "tokens emitted vs recorded"
    );
}

fn hit_rate(out: &RunOutput) -> f64 {
    out.phases[0].metrics.kv_hit_rate.expect("hit rate")
}

fn ttft_p95(out: &RunOutput) -> f64 {
    out.phases[0].metrics.ttft_ms.p95.expect("ttft")
}

const SCENARIOS: &[&str] = &[
    "worker-crash=20",
    "worker-hang=70",
    "slow-worker",
    "event-loss=0.05",
    "event-delay=300",
    "event-duplicate=0.05",
    "event-reorder=0.05",
    "event-loss=0.02,event-delay=200,event-duplicate=0.02,event-reorder=0.02",
    "worker-crash=10,worker-hang=40,slow-worker,event-loss=0.02,event-reorder=0.02",
];

#[test]
fn hundreds_of_seeded_runs_keep_every_invariant() {
    let mut runs = 0;
    for seed in 0..300u64 {
        let spec = SCENARIOS[seed as usize % SCENARIOS.len()];
        let out = run(seed, Some(spec), 120);
        let t = &out.totals;
        assert_eq!(
            t.issued,
            t.finished + t.failed + t.in_flight_at_end,
            "seed {seed}, {spec}"
        );
        assert!(t.finished > 0, "seed {seed}, {spec}: nothing finished");
        let report = out.faults.expect("a fault report");
        assert!(report.checked_steps > 1_000, "seed {seed}, {spec}");
        runs += 1;
    }
    assert_eq!(runs, 300);
}

const REPLICA_SCENARIOS: &[&str] = &[
    "replica-restart=5",
    "partition=2",
    "partition=8",
    "replica-restart=10,partition=5,worker-crash=10,event-loss=0.02,event-delay=200",
];

fn notes(out: &RunOutput) -> Vec<String> {
    let report = out.faults.as_ref().expect("a fault report");
    report.timeline.iter().map(|(_, w)| w.clone()).collect()
}

fn noted(notes: &[String], what: &str) -> bool {
    notes.iter().any(|n| n.contains(what))
}

#[test]
fn hundreds_of_seeded_runs_with_gateway_replicas_keep_every_invariant() {
    for seed in 0..120u64 {
        let spec = REPLICA_SCENARIOS[seed as usize % REPLICA_SCENARIOS.len()];
        let out = run_with(replica_config(seed), Some(spec), 120)
            .unwrap_or_else(|e| panic!("seed {seed}, faults {spec}: {e}"));
        let t = &out.totals;
        assert_eq!(
            t.issued,
            t.finished + t.failed + t.in_flight_at_end,
            "seed {seed}, {spec}"
        );
        assert!(t.finished > 0, "seed {seed}, {spec}: nothing finished");
        let notes = notes(&out);
        let report = out.faults.as_ref().unwrap();
        assert!(report.checked_steps > 1_000, "seed {seed}, {spec}");
        // Each fault really happened.
        if spec.contains("replica-restart") {
            assert!(noted(&notes, "died"), "seed {seed}: {notes:?}");
            assert!(noted(&notes, "started again"), "seed {seed}: {notes:?}");
        }
        if spec.contains("partition") {
            assert!(noted(&notes, "cut off NATS"), "seed {seed}: {notes:?}");
            assert!(noted(&notes, "back on NATS"), "seed {seed}: {notes:?}");
            assert!(report.kv_events_missed > 0, "seed {seed}: {report:?}");
            assert!(report.peer_updates_lost > 0, "seed {seed}: {report:?}");
        }
        // Every failure is one the faults explain, each reported.
        assert_eq!(
            t.failed,
            report.gateway_failed_requests
                + report.worker_failed_requests
                + report.timed_out_requests,
            "seed {seed}, {spec}"
        );
    }
}

/// The first seed from `from` whose plan puts `fault` (`replica_restart` or `partition`) on
/// replica 0, whose view the simulation exposes; with its (start, end).
fn seed_on_replica_0(spec: &str, from: u64, fault: &str) -> (u64, Nanos, Nanos) {
    for seed in from..from + 50 {
        let sim = simulation(replica_config(seed), Some(spec), 120).unwrap();
        let plan = sim.fault_report().unwrap().plan.unwrap();
        let slot = match fault {
            "replica_restart" => plan.replica_restart,
            _ => plan.partition,
        };
        if let Some((0, at, until)) = slot {
            return (seed, at, until);
        }
    }
    panic!("no seed puts {fault} on replica 0");
}

#[test]
fn a_restarted_replica_fails_its_connections_and_rebuilds_its_view_from_snapshots() {
    let spec = "replica-restart=5";
    let mut lost = 0;
    for from in [0, 100] {
        let (seed, down, up) = seed_on_replica_0(spec, from, "replica_restart");
        let mut sim = simulation(replica_config(seed), Some(spec), 120).unwrap();
        sim.run_until(down + Nanos::from_secs(1)).unwrap();
        // Down: its fresh router counts nothing, while the fleet is busy.
        assert_eq!(sim.router().in_flight(), 0, "seed {seed}");
        assert!(sim.in_flight() > 3, "seed {seed}");
        // Started again: its peers' snapshots (two round trips of 5 ms) gave it the fleet's
        // load at once, not as their requests end.
        assert_eq!(
            sim.router().index().len(),
            0,
            "seed {seed}: down, its index is empty"
        );
        sim.run_until(up + Nanos::from_millis(50)).unwrap();
        // The workers' snapshots gave it their caches as it started.
        assert!(sim.router().index().len() > 100, "seed {seed}");
        let (counted, actual) = (sim.router().in_flight(), sim.in_flight());
        assert!(
            counted.abs_diff(actual) <= 3,
            "seed {seed}: counts {counted} of {actual} after its restart"
        );
        let out = sim.run(|_| {}).unwrap();
        let report = out.faults.as_ref().unwrap();
        assert!(report.snapshots_applied >= 2, "seed {seed}: {report:?}");
        assert_eq!(out.totals.failed, report.gateway_failed_requests);
        assert!(noted(&notes(&out), "its peers forget it"), "seed {seed}");
        lost += report.gateway_failed_requests;
        // Started again, it asked each worker for its cache.
        assert_eq!(report.kv_snapshots, 3, "seed {seed}: {report:?}");
        // It served again.
        assert!(sim_turns_of_replica_0(&out) > 0, "seed {seed}");
    }
    // The turns it held ended with `gateway_failed`, each reported.
    assert!(lost > 0);
}

fn sim_turns_of_replica_0(out: &RunOutput) -> u64 {
    out.totals.replicas.as_ref().expect("replicas").turns[0]
}

#[test]
fn a_partitioned_replica_misses_events_and_updates_then_resyncs() {
    // Shorter than the peer lease: when NATS is back, each side's header shows the updates
    // it lost, so it fetches snapshots; each worker's next event shows a gap, so the index
    // clears its blocks and re-baselines.
    let spec = "partition=2";
    let (seed, at, until) = seed_on_replica_0(spec, 0, "partition");
    let mut sim = simulation(replica_config(seed), Some(spec), 120).unwrap();
    sim.run_until(at + Nanos::from_secs(1)).unwrap();
    let missed = sim.fault_report().unwrap();
    sim.run_until(until + Nanos::from_millis(50)).unwrap();
    let healed = sim.fault_report().unwrap();
    let (counted, actual) = (sim.router().in_flight(), sim.in_flight());
    assert!(
        counted.abs_diff(actual) <= 3,
        "seed {seed}: counts {counted} of {actual} after the partition"
    );
    let out = sim.run(|_| {}).unwrap();
    let report = out.faults.unwrap();
    assert!(missed.kv_events_missed > 0, "{missed:?}");
    assert!(healed.snapshots_applied > 0, "{healed:?}");
    assert!(report.kv_resyncs > 0, "{report:?}");
    assert!(report.peer_updates_lost > 0, "{report:?}");
    // Nothing failed: its clients were served throughout.
    assert_eq!(out.totals.failed, 0);
    // The stated bound: a claim the partition made stale lasts at most the partition and the
    // worker's next event after it (the checker fails the run past that).
    assert!(
        report.max_stale_claim_s <= (until - at).as_secs_f64() + 1.0,
        "{report:?}"
    );

    // Longer than the lease: the replica and its peers forget each other meanwhile.
    let out = run_with(replica_config(seed), Some("partition=8"), 120).unwrap();
    assert!(
        noted(&notes(&out), "its peers forget it"),
        "{:?}",
        notes(&out)
    );
}

#[test]
fn an_empty_spec_only_adds_checks_and_changes_no_number() {
    let clean = run(3, None, 120);
    let checked = run(3, Some("none"), 120);
    assert_eq!(clean.phases, checked.phases);
    assert_eq!(clean.totals, checked.totals);
    assert!(checked.faults.unwrap().checked_steps > 1_000);
}

#[test]
fn without_migration_a_crash_loses_its_requests_and_its_cache() {
    let (mut clean_hits, mut crash_hits) = (0.0, 0.0);
    for seed in 0..4 {
        let clean = run(seed, None, 240);
        let crashed = run_without_migration(seed, "worker-crash=5", 240);
        let report = crashed.faults.as_ref().unwrap();
        assert!(
            report.timeline.iter().any(|(_, w)| w.contains("crashed")),
            "{report:?}"
        );
        assert!(
            report.timeline.iter().any(|(_, w)| w.contains("joined")),
            "{report:?}"
        );
        // Its requests in flight ended with the crash's error, each reported.
        assert!(report.worker_failed_requests > 0, "{report:?}");
        assert_eq!(crashed.totals.failed, report.worker_failed_requests);
        assert_eq!(report.migrations.total(), 0);
        clean_hits += hit_rate(&clean);
        crash_hits += hit_rate(&crashed);
    }
    // The conversations of the crashed worker and those sent to its empty replacement
    // recompute their history.
    assert!(
        crash_hits < clean_hits - 0.01,
        "crash {crash_hits:.3} vs clean {clean_hits:.3} (sum of 4 seeds)"
    );
}

#[test]
fn with_migration_a_crash_loses_no_request_and_counts_each_token_once() {
    for seed in 0..4 {
        let mut cfg = config(seed);
        cfg.keep_all_records = true;
        let out = run_with(cfg, Some("worker-crash=5"), 240).unwrap();
        let report = out.faults.as_ref().unwrap();
        assert!(
            report.timeline.iter().any(|(_, w)| w.contains("crashed")),
            "{report:?}"
        );
        // Every request in flight on the crashed worker went on on another one.
        assert!(
            report.migrations.worker_failed > 0,
            "seed {seed}: {report:?}"
        );
        assert_eq!(report.worker_failed_requests, 0, "seed {seed}: {report:?}");
        assert_eq!(out.totals.failed, 0, "seed {seed}: {report:?}");
        assert_tokens_counted_once(&out);
        // A migrated turn is one turn: its TTFT is its first token's, before its E2E.
        for r in &out.records {
            if let (Some(first), Some(last)) = (r.first_token_at, r.last_token_at) {
                assert!(first <= last && last <= r.ended_at, "{r:?}");
            }
        }
    }
}

#[test]
fn without_migration_a_hung_worker_costs_timeouts_and_retries_then_comes_back() {
    let mut retried = 0;
    for seed in 0..4 {
        let out = run_without_migration(seed, "worker-hang=90", 240);
        let report = out.faults.unwrap();
        let notes: Vec<&str> = report.timeline.iter().map(|(_, w)| w.as_str()).collect();
        for expected in [
            "stopped answering",
            "ejected",
            "answers again",
            "back in the",
        ] {
            assert!(
                notes.iter().any(|n| n.contains(expected)),
                "seed {seed}: no `{expected}` in {notes:?}"
            );
        }
        // Streams that had started end with the stall timeout's error.
        assert!(report.timed_out_requests > 0, "seed {seed}: {report:?}");
        assert_eq!(out.totals.failed, report.timed_out_requests);
        retried += report.retried_requests;
    }
    // Requests sent to it before the health check ejected it are routed again after the
    // first-byte timeout.
    assert!(retried > 0);
}

#[test]
fn with_migration_a_stalled_stream_goes_on_elsewhere_and_the_worker_stays_out() {
    let mut migrated = 0;
    for seed in 0..4 {
        let mut cfg = config(seed);
        cfg.keep_all_records = true;
        let out = run_with(cfg, Some("worker-hang=40"), 240).unwrap();
        let report = out.faults.as_ref().unwrap();
        // Streams that had started are migrated at their stall timeout; what still fails is
        // a request silent twice before its first token (the gateway's 504).
        assert_eq!(
            out.totals.failed, report.timed_out_requests,
            "seed {seed}: {report:?}"
        );
        assert_eq!(report.worker_failed_requests, 0);
        migrated += report.migrations.worker_timeout;
        assert_tokens_counted_once(&out);
        // The worker continues after 40 s, but a request's timeout ejected it for the
        // ejection time (30 s): it returns only after that, not at its next health check.
        let at = |what: &str| {
            report
                .timeline
                .iter()
                .find(|(_, w)| w.contains(what))
                .map(|(t, _)| *t)
        };
        let (Some(answers), Some(back), Some(ejected)) =
            (at("answers again"), at("back in the"), at("ejected until"))
        else {
            panic!("seed {seed}: {:?}", report.timeline)
        };
        assert!(back >= ejected + 30.0, "seed {seed}: {:?}", report.timeline);
        assert!(back > answers + 2.0, "seed {seed}: {:?}", report.timeline);
    }
    assert!(migrated > 0, "no stalled stream was migrated");
}

#[test]
fn a_slow_worker_raises_ttft() {
    let (mut clean, mut slow) = (0.0, 0.0);
    for seed in 0..3 {
        clean += ttft_p95(&run(seed, None, 180));
        slow += ttft_p95(&run(seed, Some("slow-worker=3"), 180));
    }
    assert!(
        slow > clean * 1.2,
        "slow {slow:.0} ms vs clean {clean:.0} ms"
    );
}

#[test]
fn lost_events_leave_stale_claims_that_resyncs_clear() {
    // In-process delivery reveals a loss at the worker's next event, usually of the same
    // step; over a delayed plane the claims last until that event arrives. (At a few percent
    // loss the index is cleared so often that it holds little to be stale about.)
    let out = run(5, Some("event-loss=0.005,event-delay=100"), 180);
    let report = out.faults.unwrap();
    assert!(report.kv_events_lost > 0, "{report:?}");
    // Lost removals left the index claiming evicted blocks for a while...
    assert!(report.stale_claims > 0, "{report:?}");
    // ...until the worker's next event revealed the gap and cleared them (the checker fails
    // the run if a claim outlives that).
    assert!(report.kv_resyncs > 0, "{report:?}");
    assert!(report.max_stale_claim_s > 0.0);
}

#[test]
fn lost_events_are_filled_from_the_workers_snapshots() {
    // Each gap clears the worker's blocks, and the worker's snapshot of its cache (what a
    // kvroute engine answers the gateway) gives them back: routing goes on as if nothing was
    // lost. Without the snapshots seed 1 fell from 0.96 to 0.83.
    for seed in [1, 2] {
        let clean = run(seed, None, 120);
        let lossy = run(seed, Some("event-loss=0.05"), 120);
        let report = lossy.faults.as_ref().unwrap();
        assert!(report.kv_resyncs > 10, "{report:?}");
        assert_eq!(report.kv_snapshots, report.kv_resyncs, "{report:?}");
        assert!(
            hit_rate(&lossy) >= hit_rate(&clean) - 0.02,
            "seed {seed}: hit rate {} against {} without loss",
            hit_rate(&lossy),
            hit_rate(&clean)
        );
    }
}

#[test]
fn duplicated_and_reordered_events_are_refused_as_stale() {
    let dup = run(6, Some("event-duplicate=0.05"), 120).faults.unwrap();
    assert!(dup.kv_events_duplicated > 0 && dup.kv_stale_events >= dup.kv_events_duplicated);
    assert_eq!(dup.kv_resyncs, 0, "{dup:?}");
    let reorder = run(6, Some("event-reorder=0.05"), 120).faults.unwrap();
    assert!(reorder.kv_events_reordered > 0, "{reorder:?}");
    assert!(
        reorder.kv_resyncs > 0 && reorder.kv_stale_events > 0,
        "{reorder:?}"
    );
}

#[test]
fn the_same_seed_gives_the_same_faulty_run() {
    let spec = "worker-crash=10,worker-hang=40,event-loss=0.02,event-reorder=0.02";
    let a = run(9, Some(spec), 120);
    let b = run(9, Some(spec), 120);
    assert_eq!(a, b);
    let spec = "replica-restart=5,partition=5,event-loss=0.02";
    let a = run_with(replica_config(9), Some(spec), 120).unwrap();
    let b = run_with(replica_config(9), Some(spec), 120).unwrap();
    assert_eq!(a, b);
}

#[test]
fn an_empty_spec_behind_replicas_changes_no_number() {
    let clean = run_with(replica_config(4), None, 120).unwrap();
    let checked = run_with(replica_config(4), Some("none"), 120).unwrap();
    assert_eq!(clean.phases, checked.phases);
    assert_eq!(clean.totals, checked.totals);
}

#[test]
fn faults_refuse_what_they_cannot_simulate() {
    let mut cfg = config(1);
    cfg.disagg = Some(sim::DisaggSetup::new(1, 2));
    let err = run_with(cfg, Some("event-loss"), 30).unwrap_err();
    assert!(err.to_string().contains("aggregated"), "{err}");
}
