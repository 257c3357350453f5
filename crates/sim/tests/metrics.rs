//! The seed's metric definitions on scenarios small enough to compute by hand.

mod common;

use common::{Script, fixed_step_engine};
use nanotime::Nanos;
use router::PolicyKind;
use sim::{Phase, SimConfig, Simulation, Turn, TurnKey};

fn one_worker(coalesce: bool) -> SimConfig {
    let mut cfg = SimConfig::new(1, engine::HardwareProfile::dynamo_mocker(), PolicyKind::Kv);
    cfg.engine = fixed_step_engine(100.0, 10.0);
    cfg.engine.coalesce_decode = coalesce;
    cfg.keep_all_records = true;
    cfg
}

fn phase(window_s: u64, snapshots: u32) -> Phase {
    Phase {
        concurrency: 1,
        warmup: Nanos::ZERO,
        window: Nanos::from_secs(window_s),
        snapshots,
        lookback: None,
    }
}

fn turn(conversation: u64, turn: u32, prompt: Vec<u32>, output: Vec<u32>, at: Nanos) -> Turn {
    Turn {
        key: TurnKey { conversation, turn },
        prompt: prompt.into(),
        output: output.into(),
        issued_at: at,
    }
}

/// One request, prompt 1,000 tokens, 101 output tokens, issued at 0: the prefill step
/// (100 ms) yields token 0, then 100 decode steps of 10 ms.
/// TTFT = 100 ms; E2E = 100 + 100 × 10 = 1,100 ms; TPOT = ITL = (1,100 − 100) / 100 = 10 ms.
/// Two 1 s snapshots: tokens at 0.1, 0.11, …, 1.1 s → 91 in (0, 1], 10 in (1, 2].
#[test]
fn one_request_exact_ttft_tpot_itl_e2e_and_tokens_per_window() {
    for coalesce in [false, true] {
        let prompt: Vec<u32> = (0..1000).collect();
        let output: Vec<u32> = (5000..5101).collect();
        let script = Script::new(vec![turn(0, 0, prompt, output, Nanos::ZERO)]);
        let sim = Simulation::new(one_worker(coalesce), script, vec![phase(2, 2)]).unwrap();
        let out = sim.run(|_| {}).unwrap();
        let r = &out.records[0];
        assert_eq!(
            r.ttft(),
            Some(Nanos::from_millis(100)),
            "coalesce {coalesce}"
        );
        assert_eq!(r.e2e(), Some(Nanos::from_millis(1100)));
        assert!((r.tpot_secs().unwrap() - 0.010).abs() < 1e-12);
        assert!((r.itl_secs().unwrap() - 0.010).abs() < 1e-12);
        assert_eq!(r.output_tokens, 101);
        assert_eq!((r.prompt_tokens, r.cached_prompt_tokens), (1000, 0));
        let snaps = &out.phases[0].snapshots;
        assert_eq!(snaps[0].output_tokens_per_s, 91.0, "coalesce {coalesce}");
        assert_eq!(snaps[1].output_tokens_per_s, 10.0, "coalesce {coalesce}");
        // TTFT observed in the first window, the finish (E2E, TPOT, RPS) in the second.
        assert_eq!(snaps[0].ttft_ms.p50, Some(100.0));
        assert_eq!(snaps[0].e2e_s.p50, None);
        assert_eq!(snaps[1].e2e_s.p50, Some(1.1));
        assert_eq!(snaps[1].requests_per_s, 1.0);
        if coalesce {
            assert!(
                r.token_spans < 10,
                "speed mode reports stretches: {}",
                r.token_spans
            );
        } else {
            assert_eq!(r.token_spans, 101, "one span per step");
        }
        // The averaged phase metrics are the mean of the two snapshots.
        let m = &out.phases[0].metrics;
        assert_eq!(m.output_tokens_per_s, 50.5);
        assert_eq!(m.ttft_ms.p95, Some(100.0));
        assert_eq!(out.totals.tokens_emitted, 101);
    }
}

/// The second turn of a conversation resends the first turn's prompt and answer: the engine
/// finds every full block of `prompt₁ + answer₁` minus the last answer token cached, and the
/// hit rate is cached / prompt tokens over both turns. The oracle sees the same.
#[test]
fn second_turn_hits_its_history_and_hit_rate_is_token_weighted() {
    let p1: Vec<u32> = (0..1000).collect();
    let a1: Vec<u32> = (10_000..10_101).collect();
    let mut p2 = p1.clone();
    p2.extend_from_slice(&a1);
    p2.extend(20_000..20_050u32); // 1,151 tokens
    let script = Script::new(vec![
        turn(0, 0, p1, a1, Nanos::ZERO),
        turn(0, 1, p2, (30_000..30_010).collect(), Nanos::from_secs(2)),
    ]);
    let sim = Simulation::new(one_worker(true), script, vec![phase(4, 1)]).unwrap();
    let out = sim.run(|_| {}).unwrap();
    let second = &out.records[1];
    // Cached during turn 1: ⌊(1,000 + 101 − 1) / 32⌋ = 34 blocks = 1,088 tokens.
    assert_eq!(second.cached_prompt_tokens, 1088);
    assert_eq!(second.oracle_cached_tokens, 1088);
    // Second TTFT: issued at 2 s, prefill step of the 63 uncached tokens = 100 ms.
    assert_eq!(second.ttft(), Some(Nanos::from_millis(100)));
    let m = &out.phases[0].metrics;
    let expected = 1088.0 / (1000.0 + 1151.0);
    assert!((m.kv_hit_rate.unwrap() - expected).abs() < 1e-12);
    assert!((m.oracle_hit_rate.unwrap() - expected).abs() < 1e-12);
    assert_eq!(m.requests, 2.0);
    assert_eq!(m.requests_per_s, 0.5);
}

/// A turn the engine cannot hold (longer than the model's context) is an error, reported to
/// the workload, counted in the window, and does not stall the next turn.
#[test]
fn rejected_turns_are_errors_and_reach_the_workload() {
    let mut cfg = one_worker(true);
    cfg.engine.profile.max_context_tokens = 2_000;
    let script = Script::new(vec![
        turn(
            0,
            0,
            (0..3_000).collect(),
            vec![1, 2, 3],
            Nanos::from_millis(10),
        ),
        turn(
            1,
            0,
            (0..100).collect(),
            vec![1, 2, 3],
            Nanos::from_millis(20),
        ),
    ]);
    let mut sim = Simulation::new(cfg, script, vec![phase(2, 1)]).unwrap();
    sim.run_until(Nanos::from_secs(2)).unwrap();
    assert_eq!(sim.workload().failed.len(), 1);
    assert_eq!(sim.workload().failed[0].0.conversation, 0);
    assert_eq!(sim.workload().finished.len(), 1);
    let out = sim.finish();
    assert_eq!(out.phases[0].metrics.errors, 1.0);
    assert_eq!((out.totals.failed, out.totals.finished), (1, 1));
}

/// With a per-worker cap of one request, the second turn waits at the frontend until the
/// first finishes: its TTFT includes the wait (client-side, from `issued_at`).
#[test]
fn frontend_queue_holds_turns_while_every_worker_is_at_its_cap() {
    let mut cfg = one_worker(true);
    cfg.frontend.max_in_flight_per_worker = std::num::NonZeroU32::new(1);
    let script = Script::new(vec![
        turn(0, 0, (0..500).collect(), (0..11).collect(), Nanos::ZERO),
        turn(
            1,
            0,
            (600..1100).collect(),
            (0..11).collect(),
            Nanos::from_millis(50),
        ),
    ]);
    let sim = Simulation::new(cfg, script, vec![phase(2, 1)]).unwrap();
    let out = sim.run(|_| {}).unwrap();
    let (a, b) = (&out.records[0], &out.records[1]);
    // First: 100 ms prefill + 10 × 10 ms decode = finishes at 200 ms.
    assert_eq!(a.ended_at, Nanos::from_millis(200));
    assert_eq!(b.routed_at, Some(Nanos::from_millis(200)));
    assert_eq!(b.ttft(), Some(Nanos::from_millis(250)));
    assert_eq!(out.phases[0].workers[0].peak_in_flight, 1);
}

/// KV events delayed like the NATS event plane: a turn routed before its history's events
/// arrive is placed without knowing the cache, so KV routing degrades to load balancing.
#[test]
fn delayed_kv_events_are_applied_after_the_delay() {
    let history: Vec<u32> = (0..640).collect();
    let make = |delay_ms: u64| {
        let mut cfg = one_worker(true);
        cfg.workers = 2;
        cfg.router.kv_event_delay = Nanos::from_millis(delay_ms);
        // Turn 1 on worker A; turn 2 (same prefix) 300 ms after turn 1 was issued, while
        // turn 1 is still decoding, so load alone would send it to the idle worker B.
        let mut p2 = history.clone();
        p2.extend(9000..9010u32);
        let script = Script::new(vec![
            turn(0, 0, history.clone(), (0..50).collect(), Nanos::ZERO),
            turn(1, 0, p2, (0..5).collect(), Nanos::from_millis(300)),
        ]);
        let sim = Simulation::new(cfg, script, vec![phase(3, 1)]).unwrap();
        let mut records = sim.run(|_| {}).unwrap().records;
        // Records come in finish order; the short second turn finishes first.
        records.sort_by_key(|r| r.id);
        records
    };
    let prompt_blocks = 650 / 32;
    let fresh = make(0);
    assert_eq!(
        fresh[1].worker, fresh[0].worker,
        "events applied: follows the cache"
    );
    assert_eq!(fresh[1].router_overlap_blocks, 20.min(prompt_blocks));
    let late = make(1000);
    assert_eq!(late[1].router_overlap_blocks, 0, "events still in flight");
}

/// Reuse attribution: round-robin sends a conversation's second turn away from the worker
/// holding its history. The router knew the history was available (on worker A), predicted
/// none of it on the chosen worker B, and B reused none.
#[test]
fn reuse_attribution_separates_available_from_predicted_and_reused() {
    let history: Vec<u32> = (0..640).collect();
    let mut cfg = one_worker(true);
    cfg.workers = 2;
    cfg.router.policy = PolicyKind::RoundRobin;
    cfg.reuse_attribution = true;
    let mut p2 = history.clone();
    p2.extend(9000..9010u32);
    let script = Script::new(vec![
        turn(0, 0, history, (0..50).collect(), Nanos::ZERO),
        turn(1, 0, p2, (0..5).collect(), Nanos::from_secs(1)),
    ]);
    let sim = Simulation::new(cfg, script, vec![phase(3, 1)]).unwrap();
    let out = sim.run(|_| {}).unwrap();
    let mut records = out.records.clone();
    records.sort_by_key(|r| r.id);
    assert_ne!(records[1].worker, records[0].worker, "round-robin moved it");
    assert_eq!(
        records[1].router_available_blocks, 20,
        "the history, on worker A"
    );
    assert_eq!(records[1].router_overlap_blocks, 0);
    assert_eq!(records[1].cached_prompt_tokens, 0);
    let m = &out.phases[0].snapshots[0];
    let reuse = m.reuse.expect("kept when asked");
    assert!((reuse.available - 640.0 / 1290.0).abs() < 1e-9, "{reuse:?}");
    assert_eq!(reuse.predicted, 0.0);
    assert_eq!(m.kv_hit_rate, Some(0.0));
}
