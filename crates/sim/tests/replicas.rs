//! Gateway replicas (`SimConfig::replicas`): one replica is the single gateway, several share
//! their routing decisions through `router::ReplicaSync` (every update applied once, in
//! order) so each sees the whole fleet's load, and without sharing each sees only its own.

mod common;

use common::{TestChat, small_pool_config};
use nanotime::Nanos;
use router::PolicyKind;
use sim::faults::FaultSpec;
use sim::{ConfigError, DisaggSetup, Phase, ReplicaSetup, RunOutput, SimError, Simulation};

const CONCURRENCY: u32 = 60;

fn phases() -> Vec<Phase> {
    vec![Phase {
        concurrency: CONCURRENCY,
        warmup: Nanos::from_secs(10),
        window: Nanos::from_secs(60),
        snapshots: 1,
        lookback: None,
    }]
}

fn simulation(replicas: ReplicaSetup, seed: u64) -> Result<Simulation<TestChat>, SimError> {
    let mut cfg = small_pool_config(PolicyKind::DEFAULT, seed);
    cfg.replicas = replicas;
    let workload = TestChat::new(4, 1_500, CONCURRENCY, seed);
    Simulation::new(cfg, workload, phases())
}

fn run(replicas: ReplicaSetup, seed: u64) -> RunOutput {
    simulation(replicas, seed).unwrap().run(|_| {}).unwrap()
}

fn replicas(count: u32, sync_ms: Option<u64>) -> ReplicaSetup {
    ReplicaSetup {
        count,
        sync: sync_ms.map(Nanos::from_millis),
    }
}

#[test]
fn one_replica_is_the_single_gateway_whatever_its_sync() {
    let single = run(ReplicaSetup::default(), 5);
    assert_eq!(single, run(replicas(1, None), 5));
    assert_eq!(single, run(replicas(1, Some(50)), 5));
    assert_eq!(single.totals.replicas, None);
}

#[test]
fn synced_replicas_apply_each_peer_update_once_in_order() {
    let out = run(replicas(3, Some(5)), 5);
    assert_eq!(out, run(replicas(3, Some(5)), 5), "same seed, same run");
    let t = &out.totals;
    let r = t.replicas.as_ref().unwrap();
    assert_eq!(r.replicas, 3);
    // Round robin: every replica got a third of the turns.
    assert_eq!(r.turns.iter().sum::<u64>(), t.issued);
    let (lo, hi) = (r.turns.iter().min().unwrap(), r.turns.iter().max().unwrap());
    assert!(hi - lo <= 1, "turns per replica {:?}", r.turns);
    // Each update reaches both peers; only those still on their way at the end are missing.
    assert!(r.updates_applied <= 2 * r.updates_sent);
    assert!(r.updates_applied + 2 * 3 * t.in_flight_at_end + 60 >= 2 * r.updates_sent);
    assert_eq!(
        (r.updates_stale, r.updates_skipped, r.updates_refused),
        (0, 0, 0)
    );
    assert_eq!(t.issued, t.finished + t.failed + t.in_flight_at_end);
}

#[test]
fn with_sync_a_replica_sees_the_whole_fleets_load_without_only_its_own() {
    // Replica 0's router counts what it routed plus what its peers' updates told it.
    let seen_by_replica_0 = |sync_ms| {
        let mut sim = simulation(replicas(3, sync_ms), 5).unwrap();
        let mut seen = Vec::new();
        for s in (20..=70).step_by(10) {
            sim.run_until(Nanos::from_secs(s)).unwrap();
            seen.push((sim.router().in_flight(), sim.in_flight()));
        }
        seen
    };
    for (counted, actual) in seen_by_replica_0(Some(5)) {
        // Only what changed in the last 5 ms is missing.
        assert!(
            counted.abs_diff(actual) <= 3,
            "synced: counts {counted} of {actual}"
        );
    }
    for (counted, actual) in seen_by_replica_0(None) {
        assert!(
            3 * counted <= 2 * actual,
            "no sync: counts {counted} of {actual}"
        );
    }
}

#[test]
fn replicas_refuse_what_they_do_not_model() {
    let zero = simulation(replicas(0, None), 1).unwrap_err();
    assert!(matches!(zero, SimError::Config(ConfigError::NoReplicas)));
    let mut cfg = small_pool_config(PolicyKind::DEFAULT, 1);
    cfg = sim::SimConfig {
        replicas: replicas(2, Some(5)),
        ..sim::SimConfig::disaggregated(
            DisaggSetup::new(1, 2),
            cfg.engine.profile.clone(),
            cfg.router.policy,
        )
    };
    let pools = Simulation::new(cfg, TestChat::new(4, 1_500, 10, 1), phases()).unwrap_err();
    assert!(matches!(
        pools,
        SimError::Config(ConfigError::ReplicasWithPools)
    ));
    // Replica faults need replicas.
    let faults = simulation(replicas(1, Some(5)), 1)
        .unwrap()
        .with_faults(&"replica-restart".parse::<FaultSpec>().unwrap());
    match faults {
        Err(SimError::Faults(why)) => assert!(why.contains("--gateway-replicas 2"), "{why}"),
        other => panic!("expected a refusal, got {other:?}"),
    }
}
