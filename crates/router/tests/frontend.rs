//! Admission: the one test suite for the frontend both drivers use (the gateway's async shell
//! and the simulator's loop only forward its events).

use std::collections::{BTreeMap, BTreeSet};
use std::num::NonZeroU32;

use kv_index::{KvEvent, KvEventKind, WorkerId};
use nanotime::Nanos;
use proptest::prelude::*;
use router::{
    AdmitError, Frontend, FrontendConfig, FrontendEvent, KvSource, PolicyKind, RequestId,
    RouteDecision, Router, RouterConfig, RoutingKey, WorkerLimits,
};

const BLOCK: usize = 4;

fn router_config(policy: PolicyKind) -> RouterConfig {
    RouterConfig {
        policy,
        block_size: BLOCK,
        seed: 11,
        ..RouterConfig::default()
    }
}

fn frontend_with(
    router: RouterConfig,
    cap: u32,
    queue: usize,
    timeout_ms: Option<u64>,
) -> Frontend {
    let config = FrontendConfig {
        max_in_flight_per_worker: NonZeroU32::new(cap),
        queue_capacity: queue,
        queue_timeout: timeout_ms.map(Nanos::from_millis),
    };
    let mut f = Frontend::new(router, config).unwrap();
    for w in [1, 2] {
        f.add_worker(WorkerId(w), WorkerLimits::default(), Nanos::ZERO)
            .unwrap();
    }
    assert_eq!(f.poll_event(), None);
    f
}

/// Round robin, so which worker frees up is known: request 1 on worker 1, request 2 on 2.
fn frontend(cap: u32, queue: usize, timeout_ms: Option<u64>) -> Frontend {
    frontend_with(
        router_config(PolicyKind::RoundRobin),
        cap,
        queue,
        timeout_ms,
    )
}

fn key(f: &Frontend, n: u32) -> RoutingKey {
    f.router().key(&(n * 100..n * 100 + 16).collect::<Vec<_>>())
}

fn events(f: &mut Frontend) -> Vec<FrontendEvent> {
    std::iter::from_fn(|| f.poll_event()).collect()
}

/// Submits requests `ids` (each with its own prompt) at `now`; returns what came out.
fn submit<const N: usize>(f: &mut Frontend, ids: [u64; N], now: Nanos) -> Vec<FrontendEvent> {
    for id in ids {
        let k = key(f, id as u32);
        f.submit(RequestId(id), k, now);
    }
    events(f)
}

/// The one event a call produced: the request's worker when assigned.
fn assigned(f: &mut Frontend) -> (RequestId, WorkerId, bool) {
    match events(f).as_slice() {
        [
            FrontendEvent::Assigned {
                id,
                decision,
                queued,
            },
        ] => (*id, decision.worker, *queued),
        other => panic!("expected one assignment, got {other:?}"),
    }
}

fn in_flight(f: &Frontend) -> Vec<u32> {
    f.router().workers().map(|(_, l)| l.in_flight).collect()
}

#[test]
fn a_full_worker_is_never_chosen_while_another_has_room() {
    let mut f = frontend_with(router_config(PolicyKind::Kv), 1, 8, None);
    // Worker 1 holds the prompt: the KV policy would pick it every time.
    let prompt: Vec<u32> = (0..16).collect();
    let hasher = *f.router().hasher();
    f.router_mut()
        .apply_event(&KvEvent {
            worker: WorkerId(1),
            seq: 0,
            kind: KvEventKind::stored_prompt(&hasher, &prompt),
        })
        .unwrap();
    let k = f.router().key(&prompt);
    f.submit(RequestId(1), k.clone(), Nanos::ZERO);
    assert_eq!(assigned(&mut f), (RequestId(1), WorkerId(1), false));
    f.submit(RequestId(2), k.clone(), Nanos::ZERO);
    assert_eq!(
        assigned(&mut f),
        (RequestId(2), WorkerId(2), false),
        "worker 1 is at its cap"
    );
    // Both full: the third waits, then takes the slot that frees.
    f.submit(RequestId(3), k, Nanos::ZERO);
    assert_eq!(events(&mut f), vec![]);
    assert_eq!(f.queued(), 1);
    f.on_finished(RequestId(1), Nanos::from_millis(5));
    assert_eq!(assigned(&mut f), (RequestId(3), WorkerId(1), true));
    assert_eq!(in_flight(&f), vec![1, 1]);
}

#[test]
fn waiters_are_served_in_arrival_order() {
    let mut f = frontend(1, 8, None);
    assert_eq!(submit(&mut f, [1, 2], Nanos::ZERO).len(), 2);
    for id in 10..15 {
        f.submit(RequestId(id), key(&f, id as u32), Nanos::from_millis(id));
    }
    assert_eq!(f.queued(), 5);
    let mut running = vec![RequestId(1), RequestId(2)];
    let mut served = Vec::new();
    let mut t = 100;
    while let Some(done) = running.first().copied() {
        running.remove(0);
        t += 1;
        f.on_finished(done, Nanos::from_millis(t));
        for e in events(&mut f) {
            running.push(e.id());
            served.push(e.id().0);
        }
    }
    assert_eq!(served, vec![10, 11, 12, 13, 14]);
    assert_eq!(in_flight(&f), vec![0, 0]);
}

#[test]
fn a_full_queue_refuses_at_once() {
    let mut f = frontend(1, 2, None);
    assert_eq!(
        submit(&mut f, [1, 2, 3, 4], Nanos::ZERO).len(),
        2,
        "two routed, two queued"
    );
    assert_eq!(
        submit(&mut f, [5], Nanos::ZERO),
        vec![FrontendEvent::Refused {
            id: RequestId(5),
            error: AdmitError::QueueFull { capacity: 2 },
        }]
    );
    // No queue at all: whatever cannot be routed at once is refused.
    let mut f = frontend(1, 0, None);
    let refused: Vec<_> = submit(&mut f, [1, 2, 3], Nanos::ZERO)
        .into_iter()
        .filter(|e| matches!(e, FrontendEvent::Refused { .. }))
        .map(|e| e.id())
        .collect();
    assert_eq!(refused, vec![RequestId(3)]);
}

#[test]
fn a_waiter_times_out_exactly_at_its_deadline() {
    let mut f = frontend(1, 8, Some(100));
    submit(&mut f, [1, 2], Nanos::ZERO);
    assert_eq!(
        f.poll_timeout(),
        None,
        "nobody waits, no prediction expires"
    );
    f.submit(RequestId(3), key(&f, 3), Nanos::from_millis(10));
    f.submit(RequestId(4), key(&f, 4), Nanos::from_millis(30));
    assert_eq!(f.poll_timeout(), Some(Nanos::from_millis(110)));
    f.handle_timeout(Nanos::from_millis(109));
    assert_eq!(events(&mut f), vec![]);
    f.handle_timeout(Nanos::from_millis(110));
    assert_eq!(
        events(&mut f),
        vec![FrontendEvent::Refused {
            id: RequestId(3),
            error: AdmitError::QueueTimeout {
                waited: Nanos::from_millis(100)
            },
        }]
    );
    assert_eq!(f.poll_timeout(), Some(Nanos::from_millis(130)));
    // Served before its deadline: no timeout left to fire.
    f.on_finished(RequestId(1), Nanos::from_millis(120));
    assert_eq!(assigned(&mut f), (RequestId(4), WorkerId(1), true));
    assert_eq!(f.poll_timeout(), None);
}

#[test]
fn the_next_timeout_includes_the_routers_prediction_expiry() {
    let router = RouterConfig {
        kv_source: KvSource::Approximate {
            ttl: Nanos::from_secs(120),
        },
        ..router_config(PolicyKind::Kv)
    };
    let mut f = frontend_with(router, 1, 8, Some(30_000));
    f.submit(RequestId(1), key(&f, 1), Nanos::ZERO);
    f.submit(RequestId(2), key(&f, 2), Nanos::from_secs(1));
    events(&mut f);
    assert_eq!(f.poll_timeout(), Some(Nanos::from_secs(120)));
    f.submit(RequestId(3), key(&f, 3), Nanos::from_secs(2));
    assert_eq!(f.poll_timeout(), Some(Nanos::from_secs(32)));
    f.handle_timeout(Nanos::from_secs(120));
    assert_eq!(events(&mut f).len(), 1, "the waiter timed out");
    assert_eq!(f.poll_timeout(), Some(Nanos::from_secs(121)));
}

#[test]
fn a_cancelled_waiter_frees_nothing_and_is_never_served() {
    let mut f = frontend(1, 8, Some(1_000));
    submit(&mut f, [1, 2], Nanos::ZERO);
    assert_eq!(submit(&mut f, [3, 4], Nanos::ZERO), vec![]);
    assert!(f.cancel(RequestId(3)));
    assert!(!f.cancel(RequestId(3)), "already gone");
    assert!(!f.cancel(RequestId(1)), "assigned, not waiting");
    assert_eq!(events(&mut f), vec![], "a cancel produces no event");
    assert_eq!(in_flight(&f), vec![1, 1], "and takes no slot");
    f.on_finished(RequestId(2), Nanos::from_millis(5));
    assert_eq!(assigned(&mut f), (RequestId(4), WorkerId(2), true));
    f.handle_timeout(Nanos::from_secs(5));
    assert_eq!(
        events(&mut f),
        vec![],
        "the cancelled waiter's deadline is gone too"
    );
    assert_eq!(f.router().in_flight(), 2);
}

#[test]
fn losing_every_worker_fails_the_waiters_at_once() {
    let mut f = frontend(1, 8, Some(60_000));
    submit(&mut f, [1, 2], Nanos::ZERO);
    assert_eq!(submit(&mut f, [3], Nanos::ZERO), vec![]);
    assert_eq!(
        f.remove_worker(WorkerId(1), Nanos::ZERO),
        vec![RequestId(1)]
    );
    // Worker 1's slot is gone with it; worker 2 is still full: request 3 keeps waiting.
    assert_eq!(events(&mut f), vec![]);
    assert_eq!(
        f.remove_worker(WorkerId(2), Nanos::ZERO),
        vec![RequestId(2)]
    );
    assert_eq!(
        events(&mut f),
        vec![FrontendEvent::Refused {
            id: RequestId(3),
            error: AdmitError::NoWorkers
        }]
    );
    assert_eq!(f.queued(), 0);
    f.submit(RequestId(4), key(&f, 4), Nanos::ZERO);
    assert_eq!(
        events(&mut f),
        vec![FrontendEvent::Refused {
            id: RequestId(4),
            error: AdmitError::NoWorkers
        }]
    );
    // A worker coming back serves new requests.
    f.add_worker(WorkerId(3), WorkerLimits::default(), Nanos::ZERO)
        .unwrap();
    f.submit(RequestId(5), key(&f, 5), Nanos::ZERO);
    assert_eq!(assigned(&mut f), (RequestId(5), WorkerId(3), false));
}

#[test]
fn a_worker_joining_serves_the_waiters() {
    let mut f = frontend(1, 8, None);
    assert_eq!(submit(&mut f, [1, 2, 3], Nanos::ZERO).len(), 2);
    f.add_worker(WorkerId(7), WorkerLimits::default(), Nanos::ZERO)
        .unwrap();
    assert_eq!(assigned(&mut f), (RequestId(3), WorkerId(7), true));
}

#[test]
fn the_routers_own_bound_keeps_the_request_waiting_at_the_head() {
    let router = RouterConfig {
        max_in_flight: 2,
        ..router_config(PolicyKind::RoundRobin)
    };
    // No per-worker cap: only the router's bound on tracked requests holds requests back.
    let mut f = frontend_with(router, 0, 8, None);
    for id in 1..=4 {
        f.submit(RequestId(id), key(&f, id as u32), Nanos::ZERO);
    }
    assert_eq!(events(&mut f).len(), 2);
    assert_eq!(f.queued(), 2, "TooManyInFlight waits instead of failing");
    f.on_finished(RequestId(2), Nanos::from_millis(1));
    assert_eq!(assigned(&mut f).0, RequestId(3));
    f.on_finished(RequestId(1), Nanos::from_millis(2));
    assert_eq!(assigned(&mut f).0, RequestId(4));
    assert_eq!(f.queued(), 0);
}

#[test]
fn shutting_down_refuses_waiters_and_newcomers() {
    let mut f = frontend(1, 8, None);
    submit(&mut f, [1, 2, 3], Nanos::ZERO);
    f.shut_down();
    f.submit(RequestId(4), key(&f, 4), Nanos::ZERO);
    let refused: Vec<_> = events(&mut f)
        .into_iter()
        .map(|e| match e {
            FrontendEvent::Refused { id, error } => (id.0, error),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(
        refused,
        vec![(3, AdmitError::ShuttingDown), (4, AdmitError::ShuttingDown)]
    );
}

/// Below the cap the frontend changes no decision: every policy, same seed, same workers,
/// same choices and the same random draws as the bare router.
#[test]
fn below_the_cap_decisions_are_the_routers_own() {
    for policy in PolicyKind::ALL {
        let mut f = frontend_with(router_config(policy), 1_000, 8, None);
        let mut r = Router::new(router_config(policy)).unwrap();
        for w in [1, 2] {
            r.add_worker(WorkerId(w), WorkerLimits::default()).unwrap();
        }
        for id in 0..200u64 {
            let now = Nanos::from_millis(id);
            // A few prompts repeat, so cache affinity and ties both come up.
            let k = key(&f, (id % 7) as u32);
            let expected: RouteDecision = r.route(RequestId(id), &k, now).unwrap();
            f.submit(RequestId(id), k, now);
            assert_eq!(assigned(&mut f), (RequestId(id), expected.worker, false));
            if id % 3 == 0 {
                r.on_finished(RequestId(id / 2), now);
                f.on_finished(RequestId(id / 2), now);
            }
        }
    }
}

#[derive(Debug, Clone)]
enum Op {
    Submit,
    FinishOldest,
    FinishNewest,
    CancelOldestWaiter,
    Advance(u16),
    RemoveWorker(u8),
    AddWorker(u8),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => Just(Op::Submit),
        2 => Just(Op::FinishOldest),
        1 => Just(Op::FinishNewest),
        1 => Just(Op::CancelOldestWaiter),
        2 => (1u16..400).prop_map(Op::Advance),
        1 => (0u8..3).prop_map(Op::RemoveWorker),
        1 => (0u8..3).prop_map(Op::AddWorker),
    ]
}

proptest! {
    /// Whatever happens: no worker passes the cap, the queue stays within its capacity,
    /// every request gets at most one outcome (none once cancelled), waiters are served in
    /// arrival order, and nobody waits past its deadline.
    #[test]
    fn admission_invariants_hold(ops in prop::collection::vec(op(), 1..200), cap in 1u32..3) {
        let config = FrontendConfig {
            max_in_flight_per_worker: NonZeroU32::new(cap),
            queue_capacity: 4,
            queue_timeout: Some(Nanos::from_millis(500)),
        };
        let mut f = Frontend::new(router_config(PolicyKind::KvLoad), config).unwrap();
        let mut now = Nanos::ZERO;
        let mut next = 0u64;
        let mut running: Vec<RequestId> = Vec::new();
        let mut waiting: BTreeMap<RequestId, Nanos> = BTreeMap::new();
        let mut decided: BTreeSet<RequestId> = BTreeSet::new();
        let mut cancelled: BTreeSet<RequestId> = BTreeSet::new();
        let mut last_served = RequestId(0);
        for op in ops {
            match op {
                Op::Submit => {
                    next += 1;
                    f.submit(RequestId(next), key(&f, (next % 5) as u32), now);
                    waiting.insert(RequestId(next), now);
                }
                Op::FinishOldest if !running.is_empty() => {
                    let id = running.remove(0);
                    f.on_finished(id, now);
                }
                Op::FinishNewest => {
                    if let Some(id) = running.pop() {
                        f.on_finished(id, now);
                    }
                }
                Op::CancelOldestWaiter => {
                    if let Some((&id, _)) = waiting.iter().next() {
                        if f.cancel(id) {
                            waiting.remove(&id);
                            cancelled.insert(id);
                        }
                    }
                }
                Op::Advance(ms) => {
                    now += Nanos::from_millis(u64::from(ms));
                    if f.poll_timeout().is_some_and(|t| t <= now) {
                        f.handle_timeout(now);
                    }
                }
                Op::RemoveWorker(w) => {
                    for orphan in f.remove_worker(WorkerId(u64::from(w)), now) {
                        running.retain(|&id| id != orphan);
                    }
                }
                Op::AddWorker(w) => {
                    let _ = f.add_worker(WorkerId(u64::from(w)), WorkerLimits::default(), now);
                }
                Op::FinishOldest => {}
            }
            while let Some(e) = f.poll_event() {
                let id = e.id();
                prop_assert!(decided.insert(id), "{id} got two outcomes");
                prop_assert!(!cancelled.contains(&id), "{id} was cancelled");
                waiting.remove(&id);
                if let FrontendEvent::Assigned { queued, .. } = e {
                    running.push(id);
                    if queued {
                        prop_assert!(id > last_served, "FIFO: {id} after {last_served}");
                        last_served = id;
                    }
                }
            }
            prop_assert!(
                waiting.values().all(|&since| since + Nanos::from_millis(500) > now),
                "a waiter outlived its deadline"
            );
            prop_assert!(f.queued() <= 4);
            prop_assert_eq!(f.queued(), waiting.len());
            for (_, load) in f.router().workers() {
                prop_assert!(load.in_flight <= cap, "{} in flight over a cap of {cap}", load.in_flight);
            }
        }
    }
}

#[test]
fn a_draining_worker_gets_no_new_request_and_is_named_when_idle() {
    let mut f = frontend(4, 8, None);
    // Round robin: request 1 on worker 1, request 2 on worker 2.
    for id in [1, 2] {
        f.submit(RequestId(id), key(&f, id as u32), Nanos::ZERO);
    }
    assert_eq!(events(&mut f).len(), 2);
    assert!(f.drain_worker(WorkerId(1), Nanos::ZERO));
    assert!(!f.drain_worker(WorkerId(9), Nanos::ZERO));
    assert_eq!(
        f.take_drained(),
        None,
        "request 1 is still in flight on worker 1"
    );
    // Every new request goes to worker 2, whatever the policy's turn.
    for id in 3..7 {
        f.submit(RequestId(id), key(&f, id as u32), Nanos::ZERO);
    }
    for event in events(&mut f) {
        let FrontendEvent::Assigned { decision, .. } = event else {
            panic!("{event:?}")
        };
        assert_eq!(decision.worker, WorkerId(2));
    }
    // Request 1 finishes: worker 1 is idle and named once; removing it forgets it.
    f.on_finished(RequestId(1), Nanos::from_secs(1));
    assert_eq!(f.take_drained(), Some(WorkerId(1)));
    assert_eq!(f.take_drained(), None);
    assert!(f.remove_worker(WorkerId(1), Nanos::from_secs(1)).is_empty());
    assert_eq!(f.router().workers().count(), 1);
}

#[test]
fn when_every_worker_drains_new_requests_are_refused() {
    let mut f = frontend(4, 8, None);
    f.drain_worker(WorkerId(1), Nanos::ZERO);
    f.drain_worker(WorkerId(2), Nanos::ZERO);
    // Both idle at once.
    assert_eq!(f.take_drained(), Some(WorkerId(1)));
    assert_eq!(f.take_drained(), Some(WorkerId(2)));
    f.submit(RequestId(1), key(&f, 1), Nanos::ZERO);
    assert!(matches!(
        f.poll_event(),
        Some(FrontendEvent::Refused {
            error: AdmitError::NoWorkers,
            ..
        })
    ));
    // Back in service: routed again.
    f.router_mut().set_draining(WorkerId(2), false);
    f.submit(RequestId(2), key(&f, 2), Nanos::ZERO);
    assert!(matches!(
        f.poll_event(),
        Some(FrontendEvent::Assigned { .. })
    ));
}

/// Remembers the reply lengths it is told, and routes to the first candidate.
#[derive(Debug)]
struct ReplyRecorder(std::sync::Arc<std::sync::Mutex<Vec<u32>>>);

impl router::RoutingPolicy for ReplyRecorder {
    fn name(&self) -> &'static str {
        "reply_recorder"
    }

    fn select(&mut self, _: &router::SelectionContext<'_>, _: &mut router::PolicyRng) -> usize {
        0
    }

    fn observe_reply(&mut self, output_tokens: u32) {
        self.0.lock().unwrap().push(output_tokens);
    }
}

#[test]
fn completed_replies_reach_the_policy_through_the_capacity_gate() {
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let config = FrontendConfig {
        max_in_flight_per_worker: NonZeroU32::new(1),
        queue_capacity: 4,
        queue_timeout: None,
    };
    let policy = Box::new(ReplyRecorder(seen.clone()));
    let mut f = Frontend::with_policy(router_config(PolicyKind::KvLoad), policy, config).unwrap();
    f.add_worker(WorkerId(1), WorkerLimits::default(), Nanos::ZERO)
        .unwrap();
    let assigned = submit(&mut f, [1], Nanos::ZERO);
    assert!(matches!(
        assigned.as_slice(),
        [FrontendEvent::Assigned { .. }]
    ));
    f.on_reply(150);
    f.on_finished(RequestId(1), Nanos::from_millis(10));
    f.on_reply(7);
    assert_eq!(*seen.lock().unwrap(), [150, 7]);
}
