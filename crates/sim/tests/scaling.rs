//! Pools that change size in virtual time: a worker added mid-run starts cold and takes
//! requests; a worker drained takes no new request, finishes its own, then leaves and the
//! router forgets its blocks; no request is lost. And the scenario runner on top: the
//! scenario's actions and the KEDA autoscaler resize the pools through that same path,
//! deterministically.

mod common;

use std::sync::Arc;

use engine::HardwareProfile;
use kv_index::WorkerId;
use nanotime::Nanos;
use router::autoscale::ScalerConfig;
use router::{PolicyKind, Pool};
use sim::scenario::{ScalingMode, ScenarioSpec, run_scenario};
use sim::{
    ConfigError, DisaggSetup, Outcome, Phase, SimConfig, SimError, Simulation, Turn, TurnKey,
};
use workload::scenario::ScenarioConfig;
use workload::{Assets, WorkloadConfig};

use common::{Rng, Script};

fn config(prefill: u32, decode: u32, max_workers: u32) -> SimConfig {
    let mut cfg = SimConfig::disaggregated(
        DisaggSetup::new(prefill, decode),
        HardwareProfile::h200_llama70b_fp8(),
        PolicyKind::Kv,
    );
    cfg.keep_all_records = true;
    cfg.max_workers = Some(max_workers);
    cfg
}

fn phase(window_s: u64) -> Vec<Phase> {
    vec![Phase {
        concurrency: 1,
        warmup: Nanos::ZERO,
        window: Nanos::from_secs(window_s),
        snapshots: 1,
        lookback: None,
    }]
}

/// `n` single-turn requests, one every `gap_ms`, each a shared 512-token prefix (a system
/// prompt) and its own 4,000-token tail, answering 300 tokens: prefill load enough to spread
/// over a second prefill worker.
fn requests(n: u64, gap_ms: u64) -> (Vec<Turn>, Vec<u32>) {
    let mut rng = Rng::new(11);
    let prefix = rng.tokens(512);
    let turns = (0..n)
        .map(|i| {
            let mut prompt = prefix.clone();
            prompt.extend(rng.tokens(4_000));
            Turn {
                key: TurnKey {
                    conversation: i,
                    turn: 0,
                },
                prompt: prompt.into(),
                output: rng.tokens(300).into(),
                issued_at: Nanos::from_millis(i * gap_ms),
            }
        })
        .collect();
    (turns, prefix)
}

#[test]
fn a_pool_grows_cold_and_shrinks_by_draining_without_losing_a_request() {
    let (turns, prefix) = requests(200, 300);
    let mut sim = Simulation::new(config(1, 1, 8), Script::new(turns), phase(120)).unwrap();
    sim.run_until(Nanos::from_secs(10)).unwrap();

    // A decode worker joins: the next id, empty cache, registered in the decode pool.
    let added = sim.add_worker(Some(Pool::Decode)).unwrap();
    assert_eq!(added, 2);
    assert_eq!(sim.engines()[2].metrics().kv_blocks_cached, 0, "cold");
    let d = sim.disagg().unwrap();
    assert_eq!(d.pool_of(WorkerId(2)), Some(Pool::Decode));
    assert_eq!(sim.pool_workers(Some(Pool::Decode)), (vec![1, 2], vec![]));
    // And a prefill worker.
    assert_eq!(sim.add_worker(Some(Pool::Prefill)).unwrap(), 3);
    assert_eq!(sim.pool_workers(Some(Pool::Prefill)), (vec![0, 3], vec![]));

    sim.run_until(Nanos::from_secs(30)).unwrap();
    let load = sim
        .disagg()
        .unwrap()
        .pool(Pool::Decode)
        .router()
        .load(WorkerId(2));
    let busy = load.map_or(0, |l| l.in_flight);
    assert!(busy > 0, "the new decode worker serves requests");
    assert!(
        sim.engines()[3].metrics().prefill_tokens_computed > 0,
        "the new prefill worker prefills"
    );
    // The prefix is cached on the new workers now (the router's index says so too).
    let key = sim.router().key(&prefix);
    assert!(
        sim.router()
            .overlaps(&key)
            .iter()
            .any(|p| p.0 == WorkerId(2))
    );

    // Drain the new decode worker while it holds requests: it finishes them, takes none.
    let drained_at = sim.now();
    assert!(sim.drain_worker(2));
    assert!(!sim.drain_worker(2), "already draining");
    assert_eq!(sim.pool_workers(Some(Pool::Decode)), (vec![1], vec![2]));
    // And the original prefill worker: its pool goes on with the new one.
    assert!(sim.drain_worker(0));
    sim.run_until(Nanos::from_secs(120)).unwrap();
    let retired: Vec<u32> = sim.retired().iter().map(|(w, _)| *w).collect();
    assert!(retired.contains(&2) && retired.contains(&0), "{retired:?}");
    assert!(sim.retired().iter().all(|(_, at)| *at >= drained_at));
    assert_eq!(sim.pool_workers(Some(Pool::Decode)), (vec![1], vec![]));
    assert_eq!(sim.pool_workers(Some(Pool::Prefill)), (vec![3], vec![]));
    // The router forgot the retired worker and its blocks.
    assert_eq!(sim.disagg().unwrap().pool_of(WorkerId(2)), None);
    assert!(
        sim.router()
            .overlaps(&key)
            .iter()
            .all(|p| p.0 != WorkerId(2))
    );

    let out = sim.finish();
    let t = &out.totals;
    assert_eq!(t.issued, 200);
    assert_eq!(t.failed, 0, "draining loses nothing");
    assert_eq!(t.issued, t.finished + t.failed + t.in_flight_at_end);
    // Nothing was routed to a draining worker after it began to drain.
    for r in &out.records {
        assert_eq!(r.outcome, Outcome::Finished);
        if r.routed_at.is_some_and(|at| at > drained_at) {
            assert_ne!(
                r.worker,
                Some(2),
                "request {} went to a draining worker",
                r.id
            );
            assert_ne!(
                r.prefill_worker,
                Some(0),
                "request {} prefilled on a draining worker",
                r.id
            );
        }
    }
    // Worker 2 served some requests to the end after the drain began.
    assert!(
        out.records
            .iter()
            .any(|r| r.worker == Some(2) && r.ended_at > drained_at)
    );
}

#[test]
fn adding_past_the_bound_or_to_the_wrong_kind_of_fleet_is_refused() {
    let (turns, _) = requests(4, 1_000);
    let mut sim = Simulation::new(config(1, 1, 3), Script::new(turns), phase(10)).unwrap();
    assert!(matches!(
        sim.add_worker(None),
        Err(SimError::Config(ConfigError::PoolMismatch))
    ));
    assert_eq!(sim.add_worker(Some(Pool::Decode)).unwrap(), 2);
    assert!(matches!(
        sim.add_worker(Some(Pool::Decode)),
        Err(SimError::Config(ConfigError::TooManyWorkers { limit: 3 }))
    ));
    assert!(!sim.drain_worker(9), "no such worker");
}

/// A three-phase cycle on the dev layout: B-heavy load on one prefill worker, then a second
/// joins, then the pools go back to their initial sizes.
const SHORT: &str = r#"
rate_rps = 0.8
initial = { prefill = 1, decode = 1 }
max = { prefill = 3, decode = 3 }

[[phase]]
name = "STRESS"
duration_s = 40
mix = { B = 80, C = 20 }

[[phase]]
name = "RECOVERY"
duration_s = 40
prefill = "+1"
decode = "+1"

[[phase]]
name = "RESET"
duration_s = 20
prefill = "initial"
decode = "initial"
"#;

fn short_spec(mode: ScalingMode) -> ScenarioSpec {
    let layout = sim::disagg::layout("seed004-dev").unwrap();
    let profile = HardwareProfile::builtin(layout.profile).unwrap();
    let mut base = SimConfig::disaggregated(layout.setup(), profile, PolicyKind::Kv);
    base.seed = 3;
    let scenario = ScenarioConfig::from_toml(SHORT).unwrap();
    let mut spec = ScenarioSpec::new(base, WorkloadConfig::default(), scenario);
    spec.mode = mode;
    spec.sizing_steps = 0;
    spec
}

#[test]
fn the_scenario_resizes_pools_through_the_same_path_and_is_deterministic() {
    let assets = Assets::builtin().unwrap();
    let spec = short_spec(ScalingMode::Auto);
    let a = run_scenario(&spec, Arc::clone(&assets)).unwrap();
    let b = run_scenario(&spec, assets).unwrap();
    assert_eq!(a, b, "same seed, same results");

    let names: Vec<&str> = a.phases.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(names, ["STRESS", "RECOVERY", "RESET"]);
    let ups: Vec<(&str, u32, u32)> = a
        .events
        .iter()
        .map(|e| (e.pool.as_str(), e.from, e.to))
        .collect();
    assert_eq!(
        ups,
        [
            ("prefill", 1, 2),
            ("decode", 1, 2),
            ("prefill", 2, 1),
            ("decode", 2, 1)
        ]
    );
    assert!(a.events.iter().all(|e| e.cause == "scenario"));
    assert_eq!(a.events[0].t_s, 40.0);
    let recovery = &a.phases[1];
    assert_eq!((recovery.prefill_start, recovery.decode_start), (2, 2));
    // Scale-ups get a recovery row each; the scale-down drained two workers, which left.
    assert_eq!(a.recoveries.len(), 2);
    assert_eq!(a.totals.workers_added, 2);
    assert_eq!(a.totals.workers_retired, 2);
    let last = a.samples.last().unwrap();
    assert_eq!((last.prefill, last.decode), (1, 1));
    // Every request finished, failed (counted) or was still in flight.
    let t = &a.totals;
    assert!(t.issued > 40);
    assert_eq!(t.issued, t.finished + t.failed + t.in_flight_at_end);
    // The KEDA query's 5-minute value lags the 30-s one: both exist once requests flowed.
    assert!(a.samples.iter().any(|s| s.keda_ttft_p95_s.is_some()));
    // The report and the plot render from the results.
    let md = report::scenario::markdown(&a);
    assert!(md.contains("| 0 | RECOVERY |"), "{md}");
    assert!(report::scenario::timeline_svg(&a).contains("STRESS"));
}

#[test]
fn in_manual_mode_the_autoscaler_scales_and_the_scenario_actions_are_ignored() {
    // A TTFT threshold every B request is over: the prefill scaler must grow its pool at its
    // first poll with data, as KEDA's AverageValue would (ceil(value / threshold), bounded
    // by max_replicas and the HPA's doubling).
    let prefill = ScalerConfig {
        threshold: 0.05,
        max_replicas: 3,
        ..ScalerConfig::seed004_prefill()
    };
    let decode = ScalerConfig::seed004_decode();
    let mut spec = short_spec(ScalingMode::Autoscale {
        prefill: prefill.clone(),
        decode,
    });
    spec.prefill_scaler = prefill;
    let r = run_scenario(&spec, Assets::builtin().unwrap()).unwrap();
    assert_eq!(r.meta.mode, "autoscale");
    assert!(!r.events.is_empty());
    assert!(
        r.events.iter().all(|e| e.cause.starts_with("autoscaler")),
        "{:?}",
        r.events
    );
    let first = &r.events[0];
    assert_eq!((first.pool.as_str(), first.from), ("prefill", 1));
    assert!(first.to > 1 && first.to <= 3);
    assert!(first.value.is_some_and(|v| v > 0.05));
    // Polls happen on the 15-s grid.
    assert!(
        r.events.iter().all(|e| e.t_s % 15.0 == 0.0),
        "{:?}",
        r.events
    );
    let t = &r.totals;
    assert_eq!(t.issued, t.finished + t.failed + t.in_flight_at_end);
}
