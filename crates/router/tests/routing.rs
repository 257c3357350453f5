//! The router end to end: index + accounting + policy, driven as the gateway and simulator
//! drive it.

use kv_index::{KvEvent, KvEventKind, WorkerId};
use nanotime::Nanos;
use proptest::prelude::*;
use router::{
    CacheView, KvSource, PolicyKind, RequestId, RouteError, Router, RouterConfig, RoutingKey,
    WorkerLimits, WorkerLoad,
};

const BLOCK: usize = 32;

fn config(policy: PolicyKind) -> RouterConfig {
    RouterConfig {
        policy,
        seed: 42,
        ..RouterConfig::default()
    }
}

fn router_with_workers(config: RouterConfig, n: u64) -> Router {
    let mut router = Router::new(config).expect("valid config");
    for w in 0..n {
        router
            .add_worker(WorkerId(w), WorkerLimits::default())
            .unwrap();
    }
    router
}

/// A prompt of `blocks` full blocks whose content is determined by `seed` (different seeds,
/// different prompts), plus a partial tail block.
fn prompt(seed: u32, blocks: usize) -> Vec<u32> {
    (0..(blocks * BLOCK + 5) as u32)
        .map(|i| seed.wrapping_mul(100_003) ^ i)
        .collect()
}

/// The Stored event a worker would emit after caching `tokens`' full blocks.
fn stored_event(router: &Router, worker: u64, seq: u64, tokens: &[u32]) -> KvEvent {
    KvEvent {
        worker: WorkerId(worker),
        seq,
        kind: KvEventKind::stored_prompt(router.hasher(), tokens),
    }
}

#[test]
fn kv_sends_the_next_turn_to_the_worker_holding_its_history() {
    let mut router = router_with_workers(config(PolicyKind::Kv), 3);
    let turn1 = prompt(1, 100);
    let event = stored_event(&router, 2, 0, &turn1);
    router.apply_event(&event).expect("first event of worker 2");

    // Turn 2 resends turn 1 plus an answer and a question.
    let mut turn2 = turn1.clone();
    turn2.extend(prompt(2, 20));
    let key = router.key(&turn2);
    let decision = router.route(RequestId(1), &key, Nanos::ZERO).unwrap();
    assert_eq!(decision.worker, WorkerId(2));
    assert_eq!(decision.overlap_blocks, 100);
    assert_eq!(decision.prompt_blocks, 120);
    assert_eq!(
        decision.new_prefill_tokens,
        turn2.len() as u64 - 100 * BLOCK as u64
    );
}

#[test]
fn load_accounting_follows_the_request_lifecycle() {
    let mut router = router_with_workers(config(PolicyKind::RoundRobin), 1);
    let tokens = prompt(3, 10);
    let key = router.key(&tokens);
    let d = router.route(RequestId(9), &key, Nanos::ZERO).unwrap();
    assert_eq!(
        router.load(d.worker),
        Some(WorkerLoad {
            in_flight: 1,
            pending_prefill_tokens: tokens.len() as u64,
            awaiting_first_token: 1,
            active_blocks: 10,
            context_tokens: tokens.len() as u64,
        })
    );
    router.on_first_token(RequestId(9), Nanos::from_millis(200));
    assert_eq!(router.load(d.worker).unwrap().pending_prefill_tokens, 0);
    assert_eq!(router.load(d.worker).unwrap().awaiting_first_token, 0);
    // A second first token (a duplicate report) does not count it twice.
    router.on_first_token(RequestId(9), Nanos::from_millis(210));
    assert_eq!(router.load(d.worker).unwrap().awaiting_first_token, 0);
    assert_eq!(router.load(d.worker).unwrap().in_flight, 1);
    router.on_finished(RequestId(9), Nanos::from_secs(20));
    assert_eq!(router.load(d.worker), Some(WorkerLoad::default()));
    assert_eq!(router.in_flight(), 0);

    // Late or duplicate lifecycle calls are counted, never panic, never go negative.
    router.on_finished(RequestId(9), Nanos::from_secs(21));
    router.on_first_token(RequestId(404), Nanos::from_secs(21));
    assert_eq!(router.counters().unknown_requests, 2);
    assert_eq!(router.load(d.worker), Some(WorkerLoad::default()));
}

#[test]
fn finishing_before_first_token_releases_pending_prefill() {
    let mut router = router_with_workers(config(PolicyKind::Kv), 1);
    let key = router.key(&prompt(4, 8));
    router.route(RequestId(1), &key, Nanos::ZERO).unwrap();
    router.on_finished(RequestId(1), Nanos::from_millis(5)); // cancelled during prefill
    assert_eq!(router.load(WorkerId(0)), Some(WorkerLoad::default()));
}

#[test]
fn kv_spreads_unrelated_requests_by_decode_load() {
    let mut router = router_with_workers(config(PolicyKind::Kv), 3);
    let mut counts = [0u32; 3];
    for i in 0..30 {
        let key = router.key(&prompt(100 + i, 50));
        let d = router
            .route(RequestId(u64::from(i)), &key, Nanos::ZERO)
            .unwrap();
        counts[d.worker.0 as usize] += 1;
    }
    assert_eq!(
        counts,
        [10, 10, 10],
        "no overlap anywhere: pure load balance"
    );
}

#[test]
fn kv_leaves_a_cached_worker_while_it_is_busy_and_returns_when_it_is_free() {
    let mut router = router_with_workers(config(PolicyKind::Kv), 1);
    // Worker 0 alone receives 10 long uncached prompts: 1,000 blocks of pending prefill.
    for i in 0..10 {
        let key = router.key(&prompt(200 + i, 100));
        router
            .route(RequestId(u64::from(i)), &key, Nanos::ZERO)
            .unwrap();
    }
    router
        .add_worker(WorkerId(1), WorkerLimits::default())
        .unwrap();
    let shared = prompt(5, 40);
    router
        .apply_event(&stored_event(&router, 0, 0, &shared))
        .unwrap();
    let key = router.key(&shared);
    let candidates = router.candidates(&key, Nanos::ZERO).to_vec();
    assert_eq!(candidates[0].overlap_blocks, 40);
    assert_eq!(candidates[0].new_prefill_tokens, 5);
    assert_eq!(candidates[1].overlap_blocks, 0);
    assert_eq!(
        candidates[0].load.pending_prefill_tokens,
        10 * (100 * 32 + 5)
    );
    let busy = router.route(RequestId(100), &key, Nanos::ZERO).unwrap();
    assert_eq!(
        busy.worker,
        WorkerId(1),
        "cache hit is not worth 1,000 queued blocks"
    );
    router.on_finished(RequestId(100), Nanos::ZERO);

    for i in 0..10 {
        router.on_finished(RequestId(i), Nanos::from_secs(60));
    }
    let free = router
        .route(RequestId(101), &key, Nanos::from_secs(60))
        .unwrap();
    assert_eq!(free.worker, WorkerId(0), "idle again: the cache wins");
}

#[test]
fn approximate_mode_predicts_from_routing_and_expires() {
    let ttl = Nanos::from_secs(120);
    let mut router = router_with_workers(
        RouterConfig {
            kv_source: KvSource::Approximate { ttl },
            ..config(PolicyKind::Kv)
        },
        4,
    );
    let turn1 = prompt(7, 60);
    let key1 = router.key(&turn1);
    let first = router.route(RequestId(1), &key1, Nanos::ZERO).unwrap();
    router.on_finished(RequestId(1), Nanos::from_secs(30));
    assert_eq!(router.poll_timeout(), Some(ttl));

    let mut turn2 = turn1.clone();
    turn2.extend(prompt(8, 10));
    let key2 = router.key(&turn2);
    let second = router
        .route(RequestId(2), &key2, Nanos::from_secs(40))
        .unwrap();
    assert_eq!(
        second.worker, first.worker,
        "no events, yet the history is found"
    );
    assert_eq!(second.overlap_blocks, 60);
    router.on_finished(RequestId(2), Nanos::from_secs(70));

    // The second turn refreshed the prefix: still predicted at 40 s + TTL − 1 ns.
    router.handle_timeout(Nanos::from_secs(159));
    assert_eq!(router.overlaps(&key2).get(first.worker), 70);
    router.handle_timeout(Nanos::from_secs(160));
    assert!(router.overlaps(&key2).is_empty(), "expired after the TTL");
    assert_eq!(router.poll_timeout(), None);
    assert_eq!(router.counters().predictions_expired, 70);
}

#[test]
fn a_worker_without_events_is_predicted_until_its_first_event() {
    let mut router = router_with_workers(config(PolicyKind::Kv), 2);
    assert!(router.set_cache_view(WorkerId(1), CacheView::Predicted));
    assert!(
        !router.set_cache_view(WorkerId(9), CacheView::Predicted),
        "unknown worker"
    );
    assert_eq!(router.cache_view(WorkerId(0)), Some(CacheView::Events));

    // Pin turn 1 on the predicted worker: the router remembers what it sent there.
    let turn1 = prompt(11, 40);
    let key1 = router.key(&turn1);
    router
        .on_routed(RequestId(1), WorkerId(1), &key1, Nanos::ZERO)
        .unwrap();
    router.on_finished(RequestId(1), Nanos::from_secs(1));
    let mut turn2 = turn1.clone();
    turn2.extend(prompt(12, 5));
    let key2 = router.key(&turn2);
    assert_eq!(router.overlaps(&key2).get(WorkerId(1)), 40, "predicted");
    let decision = router
        .route(RequestId(2), &key2, Nanos::from_secs(2))
        .unwrap();
    assert_eq!(
        decision.worker,
        WorkerId(1),
        "the history is found without events"
    );
    router.on_finished(RequestId(2), Nanos::from_secs(3));
    assert!(router.poll_timeout().is_some(), "predictions expire");

    // Worker 0 (events) routes without predictions: nothing appears for it.
    let other = router.key(&prompt(13, 20));
    router
        .on_routed(RequestId(3), WorkerId(0), &other, Nanos::from_secs(3))
        .unwrap();
    assert_eq!(router.overlaps(&other).get(WorkerId(0)), 0, "events only");

    // Worker 1's first real event: its view becomes its events, predictions dropped.
    let event = stored_event(&router, 1, 0, &prompt(14, 3));
    router.apply_event_resyncing(&event).unwrap();
    assert_eq!(router.cache_view(WorkerId(1)), Some(CacheView::Events));
    assert_eq!(
        router.overlaps(&key2).get(WorkerId(1)),
        0,
        "predictions gone"
    );
    assert_eq!(
        router.index().blocks_of(WorkerId(1)),
        3,
        "the event is the baseline"
    );
    router.on_finished(RequestId(3), Nanos::from_secs(4));
    let turn3 = router.key(&prompt(15, 4));
    router
        .on_routed(RequestId(4), WorkerId(1), &turn3, Nanos::from_secs(5))
        .unwrap();
    assert_eq!(
        router.index().blocks_of(WorkerId(1)),
        3,
        "no more predictions"
    );
}

#[test]
fn the_decision_says_how_much_reuse_was_available() {
    // Worker 1 holds 30 blocks of the prompt; round-robin sends it to worker 0.
    let mut router = router_with_workers(config(PolicyKind::RoundRobin), 2);
    let tokens = prompt(21, 30);
    let event = stored_event(&router, 1, 0, &tokens);
    router.apply_event(&event).unwrap();
    let key = router.key(&tokens);
    let decision = router.route(RequestId(1), &key, Nanos::ZERO).unwrap();
    assert_eq!(decision.worker, WorkerId(0));
    assert_eq!(
        (decision.overlap_blocks, decision.available_blocks),
        (0, 30)
    );
    let pinned = router
        .on_routed(RequestId(2), WorkerId(1), &key, Nanos::ZERO)
        .unwrap();
    assert_eq!((pinned.overlap_blocks, pinned.available_blocks), (30, 30));
    let c = router.counters();
    assert_eq!(
        (c.overlap_blocks, c.available_blocks),
        (0, 30),
        "routed requests only"
    );
}

#[test]
fn approximate_mode_is_bounded() {
    let mut router = router_with_workers(
        RouterConfig {
            kv_source: KvSource::Approximate {
                ttl: Nanos::from_secs(120),
            },
            max_predicted_blocks: 100,
            ..config(PolicyKind::RoundRobin)
        },
        1,
    );
    for i in 0..10 {
        let key = router.key(&prompt(300 + i, 30));
        router
            .route(RequestId(u64::from(i)), &key, Nanos::ZERO)
            .unwrap();
    }
    assert!(router.index().len() <= 100, "{}", router.index().len());
    let last = router.key(&prompt(309, 30));
    assert_eq!(router.overlaps(&last).get(WorkerId(0)), 30, "newest kept");
    let oldest = router.key(&prompt(300, 30));
    assert_eq!(
        router.overlaps(&oldest).get(WorkerId(0)),
        0,
        "oldest evicted"
    );
}

/// Two workers; worker 1 holds a prompt of `blocks` full blocks (and a partial tail).
fn prompt_cached_on_worker_1(policy: PolicyKind, seed: u32, blocks: usize) -> (Router, Vec<u32>) {
    let mut router = router_with_workers(config(policy), 2);
    let tokens = prompt(seed, blocks);
    router
        .apply_event(&stored_event(&router, 1, 0, &tokens))
        .unwrap();
    (router, tokens)
}

#[test]
fn removing_a_worker_orphans_its_requests_and_forgets_its_cache() {
    let (mut router, tokens) = prompt_cached_on_worker_1(PolicyKind::RoundRobin, 9, 10);
    let key = router.key(&tokens);
    let a = router.route(RequestId(1), &key, Nanos::ZERO).unwrap();
    let b = router.route(RequestId(2), &key, Nanos::ZERO).unwrap();
    assert_ne!(a.worker, b.worker);
    let orphans = router.remove_worker(WorkerId(1));
    let on_1 = if a.worker == WorkerId(1) {
        RequestId(1)
    } else {
        RequestId(2)
    };
    assert_eq!(orphans, vec![on_1]);
    assert!(router.overlaps(&key).is_empty());
    for i in 10..20 {
        let d = router.route(RequestId(i), &key, Nanos::ZERO).unwrap();
        assert_eq!(d.worker, WorkerId(0));
    }
    router.remove_worker(WorkerId(0));
    assert_eq!(
        router.route(RequestId(99), &key, Nanos::ZERO),
        Err(RouteError::NoWorkers)
    );
}

#[test]
fn duplicate_ids_and_the_in_flight_bound_are_refused() {
    let mut router = router_with_workers(
        RouterConfig {
            max_in_flight: 2,
            ..config(PolicyKind::Random)
        },
        2,
    );
    let key = router.key(&prompt(10, 4));
    router.route(RequestId(1), &key, Nanos::ZERO).unwrap();
    assert_eq!(
        router.route(RequestId(1), &key, Nanos::ZERO),
        Err(RouteError::DuplicateRequest(RequestId(1)))
    );
    router.route(RequestId(2), &key, Nanos::ZERO).unwrap();
    assert_eq!(
        router.route(RequestId(3), &key, Nanos::ZERO),
        Err(RouteError::TooManyInFlight { limit: 2 })
    );
    router.on_finished(RequestId(1), Nanos::ZERO);
    assert!(router.route(RequestId(3), &key, Nanos::ZERO).is_ok());
    assert_eq!(router.counters().refused, 2);
}

/// The default router config with its policy parameters changed by `change`.
fn with_params(change: impl FnOnce(&mut router::PolicyParams)) -> RouterConfig {
    let mut config = RouterConfig::default();
    change(&mut config.params);
    config
}

#[test]
fn bad_configs_are_refused_with_a_reason() {
    for (case, bad) in [
        (
            "block size 0",
            RouterConfig {
                block_size: 0,
                ..RouterConfig::default()
            },
        ),
        (
            "negative overlap weight",
            with_params(|p| p.kv.overlap_weight = -1.0),
        ),
        (
            "NaN temperature",
            with_params(|p| p.kv.temperature = f64::NAN),
        ),
        (
            "NaN stall weight",
            with_params(|p| p.kv_load.stall_weight = f64::NAN),
        ),
        (
            "slot soft limit over 1",
            with_params(|p| p.kv_load.slot_soft_limit = 1.5),
        ),
    ] {
        let err = Router::new(bad).expect_err(case);
        assert!(!err.to_string().is_empty(), "{case}");
    }
    let err = Router::new(with_params(|p| p.kv_load.stall_weight = -2.0)).unwrap_err();
    assert!(
        err.to_string().contains("stall_weight") && err.to_string().contains("-2"),
        "the error names the parameter and its value: {err}"
    );
}

#[test]
fn prompts_shorter_than_a_block_route_fine() {
    for policy in PolicyKind::ALL {
        let mut router = router_with_workers(config(policy), 3);
        for (i, tokens) in [vec![], vec![1, 2, 3]].iter().enumerate() {
            let key = router.key(tokens);
            let d = router
                .route(RequestId(i as u64), &key, Nanos::ZERO)
                .unwrap();
            assert_eq!(d.prompt_blocks, 0);
            assert_eq!(d.new_prefill_tokens, tokens.len() as u64);
        }
    }
}

/// One decision sequence for a policy and seed, over a stream of overlapping prompts.
fn decisions(policy: PolicyKind, seed: u64) -> Vec<WorkerId> {
    let mut router = router_with_workers(
        RouterConfig {
            seed,
            ..config(policy)
        },
        5,
    );
    (0..300u64)
        .map(|i| {
            let key = router.key(&prompt((i % 7) as u32, 20 + (i % 5) as usize));
            let d = router.route(RequestId(i), &key, Nanos::ZERO).unwrap();
            if i >= 10 {
                router.on_finished(RequestId(i - 10), Nanos::ZERO);
            }
            d.worker
        })
        .collect()
}

#[test]
fn same_seed_same_decisions() {
    for policy in PolicyKind::ALL {
        assert_eq!(decisions(policy, 1), decisions(policy, 1), "{policy}");
    }
    assert_ne!(
        decisions(PolicyKind::Random, 1),
        decisions(PolicyKind::Random, 2)
    );
}

#[derive(Debug, Clone)]
enum Op {
    Route { id: u8, prompt: u8, blocks: u8 },
    FirstToken { id: u8 },
    Finish { id: u8 },
    RemoveWorker { worker: u8 },
    AddWorker { worker: u8 },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (any::<u8>(), 0u8..6, 0u8..12).prop_map(|(id, prompt, blocks)| Op::Route { id, prompt, blocks }),
        2 => any::<u8>().prop_map(|id| Op::FirstToken { id }),
        3 => any::<u8>().prop_map(|id| Op::Finish { id }),
        1 => (0u8..4).prop_map(|worker| Op::RemoveWorker { worker }),
        1 => (0u8..4).prop_map(|worker| Op::AddWorker { worker }),
    ]
}

proptest! {
    /// Whatever the order of lifecycle calls, the per-worker accounting equals a recount from
    /// the requests still in flight, and draining everything leaves every worker idle.
    #[test]
    fn accounting_matches_a_recount(ops in prop::collection::vec(op(), 1..120), policy in 0usize..3) {
        let policy = PolicyKind::ALL[policy];
        let mut router = router_with_workers(config(policy), 3);
        // Our model: id → (worker, prompt key, prefill pending, awaiting its first token).
        let mut model: std::collections::BTreeMap<u8, (WorkerId, RoutingKey, u64, bool)> = Default::default();
        for op in ops {
            match op {
                Op::Route { id, prompt: p, blocks } => {
                    let key = router.key(&prompt(u32::from(p), usize::from(blocks)));
                    match router.route(RequestId(u64::from(id)), &key, Nanos::ZERO) {
                        Ok(d) => {
                            prop_assert!(!model.contains_key(&id));
                            model.insert(id, (d.worker, key, d.new_prefill_tokens, true));
                        }
                        Err(RouteError::DuplicateRequest(_)) => prop_assert!(model.contains_key(&id)),
                        Err(RouteError::NoWorkers) => prop_assert_eq!(router.workers().count(), 0),
                        Err(e) => prop_assert!(false, "unexpected {e}"),
                    }
                }
                Op::FirstToken { id } => {
                    router.on_first_token(RequestId(u64::from(id)), Nanos::ZERO);
                    if let Some(entry) = model.get_mut(&id) { entry.2 = 0; entry.3 = false; }
                }
                Op::Finish { id } => {
                    router.on_finished(RequestId(u64::from(id)), Nanos::ZERO);
                    model.remove(&id);
                }
                Op::RemoveWorker { worker } => {
                    let orphans = router.remove_worker(WorkerId(u64::from(worker)));
                    for o in orphans {
                        let id = u8::try_from(o.0).unwrap();
                        prop_assert_eq!(model.remove(&id).map(|e| e.0), Some(WorkerId(u64::from(worker))));
                    }
                    prop_assert!(model.values().all(|e| e.0 != WorkerId(u64::from(worker))));
                }
                Op::AddWorker { worker } => router.add_worker(WorkerId(u64::from(worker)), WorkerLimits::default()).unwrap(),
            }
            prop_assert_eq!(router.in_flight(), model.len());
            for (worker, load) in router.workers() {
                let mine: Vec<_> = model.values().filter(|e| e.0 == worker).collect();
                let mut blocks = std::collections::HashSet::new();
                for e in &mine { blocks.extend(e.1.seq.iter().copied()); }
                prop_assert_eq!(load, WorkerLoad {
                    in_flight: mine.len() as u32,
                    pending_prefill_tokens: mine.iter().map(|e| e.2).sum(),
                    awaiting_first_token: mine.iter().filter(|e| e.3).count() as u32,
                    active_blocks: blocks.len() as u64,
                    context_tokens: mine.iter().map(|e| e.1.num_tokens).sum(),
                });
            }
            // What a policy would see: each worker's active blocks plus the probe's blocks
            // not already active there, against a recount of the longest active prefix.
            for probe in 0..6u32 {
                let key = router.key(&prompt(probe, 11));
                let candidates = router.candidates(&key, Nanos::ZERO).to_vec();
                for c in candidates {
                    let mut blocks = std::collections::HashSet::new();
                    for e in model.values().filter(|e| e.0 == c.worker) {
                        blocks.extend(e.1.seq.iter().copied());
                    }
                    let prefix = key.seq.iter().take_while(|h| blocks.contains(h)).count();
                    prop_assert_eq!(
                        c.potential_active_blocks,
                        blocks.len() as u64 + (key.seq.len() - prefix) as u64
                    );
                }
            }
        }
        let ids: Vec<u8> = model.keys().copied().collect();
        for id in ids { router.on_finished(RequestId(u64::from(id)), Nanos::ZERO); }
        prop_assert!(router.workers().all(|(_, l)| l == WorkerLoad::default()));
    }
}

#[test]
fn requests_routed_elsewhere_are_accounted_like_routed_ones() {
    let (mut router, tokens) = prompt_cached_on_worker_1(PolicyKind::Kv, 11, 20);
    let key = router.key(&tokens);
    // Another replica pinned this request on worker 0, which holds nothing of it.
    let d = router
        .on_routed(RequestId(1), WorkerId(0), &key, Nanos::ZERO)
        .unwrap();
    assert_eq!((d.worker, d.overlap_blocks), (WorkerId(0), 0));
    assert_eq!(
        router.load(WorkerId(0)),
        Some(WorkerLoad {
            in_flight: 1,
            pending_prefill_tokens: tokens.len() as u64,
            awaiting_first_token: 1,
            active_blocks: 20,
            context_tokens: tokens.len() as u64,
        })
    );
    let d = router
        .on_routed(RequestId(2), WorkerId(1), &key, Nanos::ZERO)
        .unwrap();
    assert_eq!(d.overlap_blocks, 20);
    assert_eq!(d.new_prefill_tokens, 5, "only the partial tail block");
    assert_eq!(
        router.on_routed(RequestId(2), WorkerId(1), &key, Nanos::ZERO),
        Err(RouteError::DuplicateRequest(RequestId(2)))
    );
    assert_eq!(
        router.on_routed(RequestId(3), WorkerId(9), &key, Nanos::ZERO),
        Err(RouteError::UnknownWorker(WorkerId(9)))
    );
    router.on_finished(RequestId(1), Nanos::ZERO);
    router.on_finished(RequestId(2), Nanos::ZERO);
    assert!(router.workers().all(|(_, l)| l == WorkerLoad::default()));
}

#[test]
fn workers_beyond_the_bound_are_refused() {
    let mut router = Router::new(RouterConfig {
        index: kv_index::IndexConfig {
            max_workers: 2,
            ..kv_index::IndexConfig::default()
        },
        ..config(PolicyKind::Kv)
    })
    .unwrap();
    router
        .add_worker(WorkerId(1), WorkerLimits::default())
        .unwrap();
    router
        .add_worker(WorkerId(2), WorkerLimits::default())
        .unwrap();
    // Updating a known worker's limits is not growth.
    let limits = WorkerLimits {
        max_num_seqs: Some(64),
        kv_capacity_blocks: Some(13_022),
        timing: None,
    };
    router.add_worker(WorkerId(2), limits).unwrap();
    assert_eq!(
        router.add_worker(WorkerId(3), WorkerLimits::default()),
        Err(RouteError::TooManyWorkers { limit: 2 })
    );
    assert_eq!(router.workers().count(), 2);
    let key = router.key(&prompt(1, 4));
    assert_eq!(router.candidates(&key, Nanos::ZERO)[1].limits, limits);
}

/// The timing `kv_load` assumes for workers that declare none is the calibrated seed-002
/// worker's, as the engine's profile derives it.
#[test]
fn default_worker_timing_is_the_calibrated_h200_profile() {
    let derived = engine::HardwareProfile::h200_llama70b_fp8().marginal_timing(32, 13_022);
    let assumed = router::WorkerTiming::H200_LLAMA70B_FP8;
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-3 * b.abs();
    assert!(
        close(
            assumed.prefill_secs_per_token,
            derived.prefill_secs_per_token
        ) && close(
            assumed.decode_secs_per_context_token,
            derived.decode_secs_per_context_token
        ),
        "assumed {assumed:?}, profile gives {derived:?}"
    );
}
