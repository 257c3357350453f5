//! Disaggregated fleets in virtual time: prefill and decode pools behind
//! `router::DisaggFrontend`, the prefill → decode hand-off, conditional disaggregation on a
//! chat's next turn, a prefill worker lost mid-request, determinism.

mod common;

use engine::{HardwareProfile, KvLink};
use kv_index::WorkerId;
use nanotime::Nanos;
use router::{PolicyKind, Pool};
use sim::metrics::RouteTag;
use sim::{
    ConfigError, DisaggSetup, Outcome, Phase, SimConfig, SimError, Simulation, Turn, TurnKey,
};

use common::{Rng, Script, TestChat};

const BLOCK: u32 = 32;

fn phase(window_s: u64) -> Vec<Phase> {
    vec![Phase {
        concurrency: 1,
        warmup: Nanos::ZERO,
        window: Nanos::from_secs(window_s),
        snapshots: 1,
        lookback: None,
    }]
}

fn config(prefill: u32, decode: u32) -> SimConfig {
    let mut cfg = SimConfig::disaggregated(
        DisaggSetup::new(prefill, decode),
        HardwareProfile::h200_llama70b_fp8(),
        PolicyKind::Kv,
    );
    cfg.keep_all_records = true;
    cfg
}

fn turn(conversation: u64, turn: u32, prompt: Vec<u32>, output: Vec<u32>, at_s: u64) -> Turn {
    Turn {
        key: TurnKey { conversation, turn },
        prompt: prompt.into(),
        output: output.into(),
        issued_at: Nanos::from_secs(at_s),
    }
}

#[test]
fn a_split_request_lands_cached_on_its_decode_worker_and_the_next_turn_stays_there() {
    let mut rng = Rng::new(7);
    let first_prompt = rng.tokens(4_000);
    let first_answer = rng.tokens(64);
    let mut second_prompt = first_prompt.clone();
    second_prompt.extend(&first_answer);
    second_prompt.extend(rng.tokens(100));
    let turns = vec![
        turn(0, 0, first_prompt.clone(), first_answer, 0),
        turn(0, 1, second_prompt, rng.tokens(20), 30),
    ];
    let mut sim = Simulation::new(config(1, 2), Script::new(turns), phase(60)).unwrap();

    sim.run_until(Nanos::from_secs(20)).unwrap();
    // The first turn went prefill worker 0 → a decode worker, and that worker now holds the
    // transferred prompt: its engine caches it and the decode pool's index knows.
    let key = sim.router().key(&first_prompt);
    let overlaps = sim.router().overlaps(&key);
    let (decode, blocks) = overlaps
        .iter()
        .max_by_key(|p| p.1)
        .expect("a decode worker");
    assert!(decode == WorkerId(1) || decode == WorkerId(2), "{decode:?}");
    assert_eq!(blocks, 4_000 / BLOCK, "the prompt's full blocks");
    let engine = &sim.engines()[decode.0 as usize];
    assert!(engine.metrics().kv_blocks_cached >= 4_000 / BLOCK);
    let d = sim.disagg().expect("a disaggregated fleet");
    assert_eq!(d.pool_of(WorkerId(0)), Some(Pool::Prefill));
    assert_eq!(d.pool_of(decode), Some(Pool::Decode));

    let out = sim.run(|_| {}).unwrap();
    let [first, second] = out.records.as_slice() else {
        panic!("two records: {:?}", out.records)
    };
    assert_eq!(first.outcome, Outcome::Finished);
    assert_eq!(first.route, Some(RouteTag::Split));
    assert_eq!(first.prefill_worker, Some(0));
    assert_eq!(first.worker, Some(decode.0 as u32));
    let transfer = first.kv_transfer.expect("a transfer");
    assert_eq!(
        transfer.tokens, 4_000,
        "nothing was cached on the decode worker"
    );
    assert_eq!(transfer.bytes, 4_000 * 163_840);
    assert!(transfer.time > Nanos::ZERO);
    assert_eq!(first.output_tokens, 64);
    // The client's first token is the prefill worker's; the transfer sits inside ITL.
    assert!(first.ttft().unwrap() < Nanos::from_secs(2));

    // Next turn: only the answer and the new question are uncached on that decode worker,
    // under the 512-token threshold, so it prefills there and nothing moves.
    assert_eq!(second.outcome, Outcome::Finished);
    assert_eq!(second.route, Some(RouteTag::LocalShort));
    assert_eq!(second.worker, Some(decode.0 as u32));
    assert_eq!(second.prefill_worker, None);
    assert_eq!(second.kv_transfer, None);
    assert!(second.cached_prompt_tokens >= 4_000, "{second:?}");
    let t = out.totals.disagg.expect("disaggregated totals");
    assert_eq!((t.split, t.local_short, t.kv_transfers), (1, 1, 1));
}

#[test]
fn a_prefill_worker_lost_mid_request_is_retried_on_the_decode_worker() {
    let mut rng = Rng::new(8);
    let turns = vec![turn(0, 0, rng.tokens(12_000), rng.tokens(30), 0)];
    let mut sim = Simulation::new(config(1, 1), Script::new(turns), phase(30)).unwrap();
    // Twelve thousand tokens of a 70B model take a prefill worker most of a second.
    sim.run_until(Nanos::from_millis(100)).unwrap();
    assert_eq!(sim.engines()[0].num_requests(), 1, "prefilling");
    assert!(sim.fail_worker(0));
    assert!(!sim.fail_worker(0), "already failed");
    let out = sim.run(|_| {}).unwrap();
    let [r] = out.records.as_slice() else {
        panic!("one record: {:?}", out.records)
    };
    assert_eq!(r.outcome, Outcome::Finished, "retried, not lost");
    assert_eq!(r.route, Some(RouteTag::LocalRetry));
    assert_eq!(r.worker, Some(1));
    assert_eq!(r.output_tokens, 30);
    assert_eq!(r.kv_transfer, None);
    let t = out.totals.disagg.expect("disaggregated totals");
    assert_eq!((t.split, t.local_retry, t.prefill_failures), (1, 1, 1));
    assert_eq!((out.totals.finished, out.totals.failed), (1, 0));
}

#[test]
fn a_decode_worker_lost_mid_request_fails_its_requests_and_frees_their_prefill() {
    let mut rng = Rng::new(9);
    let turns = vec![turn(0, 0, rng.tokens(12_000), rng.tokens(30), 0)];
    let mut sim = Simulation::new(config(1, 1), Script::new(turns), phase(30)).unwrap();
    sim.run_until(Nanos::from_millis(100)).unwrap();
    assert!(sim.fail_worker(1));
    let out = sim.run(|_| {}).unwrap();
    assert_eq!(out.records.len(), 1);
    assert_eq!(out.records[0].outcome, Outcome::Dropped);
    assert!(sim_idle(&out), "{:?}", out.totals);
}

fn sim_idle(out: &sim::RunOutput) -> bool {
    out.totals.in_flight_at_end == 0 && out.totals.queued_at_end == 0
}

fn chat_run(seed: u64, link: KvLink) -> sim::RunOutput {
    let mut setup = DisaggSetup::new(1, 2);
    setup.kv_link = link;
    let mut cfg = SimConfig::disaggregated(
        setup,
        HardwareProfile::h200_llama70b_fp8(),
        PolicyKind::KvLoad,
    );
    cfg.seed = seed;
    cfg.extended_metrics = true;
    // Many passages: most first turns find nothing cached and are split.
    let workload = TestChat::new(400, 3_000, 24, seed);
    let phases = vec![Phase {
        concurrency: 24,
        warmup: Nanos::from_secs(30),
        window: Nanos::from_secs(90),
        snapshots: 3,
        lookback: None,
    }];
    Simulation::new(cfg, workload, phases)
        .unwrap()
        .run(|_| {})
        .unwrap()
}

#[test]
fn a_chat_on_pools_splits_first_turns_keeps_later_ones_local_and_is_deterministic() {
    let a = chat_run(3, KvLink::Nvlink);
    assert_eq!(a, chat_run(3, KvLink::Nvlink), "same seed, same run");
    let t = a.totals.disagg.clone().expect("disaggregated totals");
    assert!(t.split > 0 && t.local_short > t.split, "{t:?}");
    assert_eq!(t.local_retry + t.prefill_failures, 0);
    assert_eq!(a.totals.failed, 0);
    assert_eq!(
        a.totals.issued,
        a.totals.finished + a.totals.in_flight_at_end,
        "{:?}",
        a.totals
    );
    let m = &a.phases[0].metrics;
    let s = m.serving.as_ref().expect("serving metrics");
    assert!(s.goodput_rps > 0.0 && s.goodput_share.unwrap() <= 1.0);
    assert!(s.ttft_split_ms.p50.is_some() && s.ttft_local_ms.p50.is_some());
    assert!(s.kv_transfer_ms.p50.unwrap() > 0.0);
    assert!(s.prefill_utilisation.unwrap() > 0.0 && s.decode_utilisation.unwrap() > 0.0);
    let pools: Vec<_> = a.phases[0].workers.iter().map(|w| w.pool).collect();
    assert_eq!(pools, [Some("prefill"), Some("decode"), Some("decode")]);

    // Over the network the same transfers take longer (and the decode leg waits for them).
    let slow = chat_run(3, KvLink::Network);
    let s_slow = slow.phases[0].metrics.serving.clone().unwrap();
    assert!(s_slow.kv_transfer_ms.p50.unwrap() > s.kv_transfer_ms.p50.unwrap());
}

#[test]
fn a_fleet_without_decode_workers_or_with_a_wrong_count_is_refused() {
    let mk = |cfg: SimConfig| Simulation::new(cfg, Script::new(Vec::new()), phase(10));
    let mut cfg = config(2, 1);
    cfg.disagg = Some(DisaggSetup::new(2, 0));
    cfg.workers = 2;
    assert!(matches!(
        mk(cfg),
        Err(SimError::Config(ConfigError::NoDecodeWorkers))
    ));
    let mut cfg = config(1, 1);
    cfg.workers = 3;
    assert!(matches!(
        mk(cfg),
        Err(SimError::Config(ConfigError::DisaggWorkers { .. }))
    ));
}

#[test]
fn an_aggregated_fleet_measures_exactly_what_it_did_before() {
    // No pools and no SLOs: no serving metrics, no pool labels, no route totals, so the
    // results files of aggregated runs stay byte for byte what they were.
    let mut cfg = SimConfig::new(3, HardwareProfile::h200_llama70b_fp8(), PolicyKind::KvLoad);
    cfg.seed = 3;
    let phases = vec![Phase {
        concurrency: 12,
        warmup: Nanos::from_secs(20),
        window: Nanos::from_secs(40),
        snapshots: 2,
        lookback: None,
    }];
    let out = Simulation::new(cfg, TestChat::new(20, 2_000, 12, 3), phases)
        .unwrap()
        .run(|_| {})
        .unwrap();
    assert!(out.totals.finished > 0);
    assert_eq!(out.totals.disagg, None);
    assert!(out.phases[0].metrics.serving.is_none());
    assert!(out.phases[0].workers.iter().all(|w| w.pool.is_none()));
    let json = serde_json::to_string(&out.phases[0]).unwrap();
    assert!(
        !json.contains("serving") && !json.contains("pool"),
        "{json}"
    );
}

/// Two long prompts at the same instant on two prefill workers, handed to the one decode
/// worker together: with shared links their KV crosses its way in side by side, each at half
/// the bandwidth, so each transfer's data takes twice as long as alone.
#[test]
fn simultaneous_hand_offs_into_one_decode_worker_share_its_link() {
    let run = |shared: bool| {
        let mut rng = Rng::new(11);
        let turns = vec![
            turn(0, 0, rng.tokens(6_000), rng.tokens(16), 0),
            turn(1, 0, rng.tokens(6_000), rng.tokens(16), 0),
        ];
        let mut cfg = config(2, 1);
        cfg.disagg = cfg.disagg.map(|d| DisaggSetup {
            kv_link: KvLink::Network,
            shared_links: shared,
            ..d
        });
        let out = Simulation::new(cfg, Script::new(turns), phase(60))
            .unwrap()
            .run(|_| {})
            .unwrap();
        let mut prefill_workers: Vec<Option<u32>> =
            out.records.iter().map(|r| r.prefill_worker).collect();
        prefill_workers.sort();
        assert_eq!(prefill_workers, [Some(0), Some(1)], "{:?}", out.records);
        out.records
            .iter()
            .map(|r| {
                assert_eq!(r.outcome, Outcome::Finished);
                r.kv_transfer.expect("a transfer").time
            })
            .collect::<Vec<Nanos>>()
    };
    let latency = Nanos(HardwareProfile::h200_llama70b_fp8().kv_transfer.latency_ns);
    let data = |t: Nanos| t.saturating_sub(latency).as_secs_f64();
    let (alone, shared) = (run(false), run(true));
    assert_eq!(alone.len(), 2);
    for (a, s) in alone.iter().zip(&shared) {
        let ratio = data(*s) / data(*a);
        assert!((ratio - 2.0).abs() < 0.01, "shared {s} vs alone {a}");
    }
    // Same inputs, same transfers.
    assert_eq!(run(true), shared);
}
