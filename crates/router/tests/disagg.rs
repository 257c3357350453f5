//! Disaggregated admission: the one decision both drivers make — which decode worker, and
//! whether the prefill runs there or on a prefill worker.

use std::num::NonZeroU32;

use kv_index::{KvEvent, KvEventKind, WorkerId};
use nanotime::Nanos;
use router::{
    AdmitError, DisaggConfig, DisaggEvent, DisaggFrontend, FrontendConfig, LocalReason, PolicyKind,
    Pool, RequestId, Route, RouterConfig, WorkerLimits,
};

const BLOCK: usize = 16;
const PREFILL: [u64; 2] = [1, 2];
const DECODE: [u64; 2] = [11, 12];

fn fleet(prefill: &[u64], cap: u32, queue: usize) -> DisaggFrontend {
    let router = RouterConfig {
        policy: PolicyKind::Kv,
        block_size: BLOCK,
        seed: 5,
        ..RouterConfig::default()
    };
    let config = DisaggConfig {
        frontend: FrontendConfig {
            max_in_flight_per_worker: NonZeroU32::new(cap),
            queue_capacity: queue,
            queue_timeout: Some(Nanos::from_secs(1)),
        },
        local_prefill_max_tokens: 256,
    };
    let mut f = DisaggFrontend::new(router, config).unwrap();
    for &w in prefill {
        f.add_worker(
            WorkerId(w),
            Pool::Prefill,
            WorkerLimits::default(),
            Nanos::ZERO,
        )
        .unwrap();
    }
    for w in DECODE {
        f.add_worker(
            WorkerId(w),
            Pool::Decode,
            WorkerLimits::default(),
            Nanos::ZERO,
        )
        .unwrap();
    }
    assert_eq!(f.poll_event(), None);
    f
}

fn prompt(tag: u32, len: u32) -> Vec<u32> {
    (0..len).map(|i| tag << 20 | i).collect()
}

fn next(f: &mut DisaggFrontend) -> DisaggEvent {
    f.poll_event().expect("an event")
}

#[test]
fn a_long_uncached_prompt_is_prefilled_on_the_prefill_pool() {
    let mut f = fleet(&PREFILL, 8, 8);
    let key = f.key(&prompt(1, 4_000));
    f.submit(RequestId(1), key, Nanos::ZERO);
    let DisaggEvent::Assigned {
        route: Route::Split { prefill, decode },
        ..
    } = next(&mut f)
    else {
        panic!("expected a split route")
    };
    assert!(PREFILL.contains(&prefill.worker.0));
    assert!(DECODE.contains(&decode.worker.0));
    assert_eq!(prefill.new_prefill_tokens, 4_000);
    assert_eq!(f.pool(Pool::Prefill).router().in_flight(), 1);
    // The prefill leg ends: its slot is free, the decode worker keeps the request.
    f.on_prefill_done(RequestId(1), Nanos::from_millis(300));
    assert_eq!(f.pool(Pool::Prefill).router().in_flight(), 0);
    assert_eq!(f.pool(Pool::Decode).router().in_flight(), 1);
    f.on_finished(RequestId(1), Nanos::from_secs(5));
    assert_eq!(f.pool(Pool::Decode).router().in_flight(), 0);
    assert_eq!(f.poll_event(), None);
}

#[test]
fn a_short_prompt_or_a_cached_history_is_prefilled_on_the_decode_worker() {
    let mut f = fleet(&PREFILL, 8, 8);
    let key = f.key(&prompt(2, 200));
    f.submit(RequestId(1), key, Nanos::ZERO);
    assert!(matches!(
        next(&mut f),
        DisaggEvent::Assigned {
            route: Route::Local {
                reason: LocalReason::ShortPrefill,
                ..
            },
            ..
        }
    ));
    f.on_finished(RequestId(1), Nanos::from_secs(1));

    // Decode worker 12 holds a 4,000-token history (it received its KV last turn); the next
    // turn adds 100 tokens: it stays there and prefills the 100 itself.
    let history = prompt(3, 4_000);
    let stored = KvEvent {
        worker: WorkerId(12),
        seq: 0,
        kind: KvEventKind::stored_prompt(f.pool(Pool::Decode).router().hasher(), &history),
    };
    f.apply_event(&stored).unwrap();
    let mut turn = history.clone();
    turn.extend(prompt(4, 100));
    f.submit(RequestId(2), f.key(&turn), Nanos::from_secs(2));
    let DisaggEvent::Assigned {
        route: Route::Local { decode, reason },
        ..
    } = next(&mut f)
    else {
        panic!("expected a local route")
    };
    assert_eq!(
        (decode.worker, reason),
        (WorkerId(12), LocalReason::ShortPrefill)
    );
    assert!(decode.new_prefill_tokens <= 256, "{decode:?}");
    assert_eq!(f.pool(Pool::Prefill).router().in_flight(), 0);
}

#[test]
fn without_prefill_workers_the_decode_worker_prefills() {
    let mut f = fleet(&[], 8, 8);
    f.submit(RequestId(1), f.key(&prompt(5, 4_000)), Nanos::ZERO);
    assert!(matches!(
        next(&mut f),
        DisaggEvent::Assigned {
            route: Route::Local {
                reason: LocalReason::PrefillUnavailable(AdmitError::NoWorkers),
                ..
            },
            ..
        }
    ));
}

#[test]
fn a_failed_prefill_is_reissued_locally_and_its_slots_are_freed() {
    let mut f = fleet(&[1], 8, 8);
    f.submit(RequestId(1), f.key(&prompt(6, 4_000)), Nanos::ZERO);
    let DisaggEvent::Assigned {
        route: Route::Split { decode, .. },
        ..
    } = next(&mut f)
    else {
        panic!("expected a split route")
    };
    // Its prefill worker dies mid-request.
    assert_eq!(
        f.remove_worker(WorkerId(1), Nanos::from_millis(100)),
        vec![RequestId(1)]
    );
    f.on_prefill_failed(RequestId(1), Nanos::from_millis(100));
    assert_eq!(
        next(&mut f),
        DisaggEvent::Assigned {
            id: RequestId(1),
            route: Route::Local {
                decode,
                reason: LocalReason::PrefillFailed
            },
        }
    );
    f.on_finished(RequestId(1), Nanos::from_secs(3));
    assert_eq!(f.pool(Pool::Decode).router().in_flight(), 0);
    // A later long prompt finds no prefill worker and is served locally.
    f.submit(RequestId(2), f.key(&prompt(7, 4_000)), Nanos::from_secs(4));
    assert!(matches!(
        next(&mut f),
        DisaggEvent::Assigned {
            route: Route::Local {
                reason: LocalReason::PrefillUnavailable(_),
                ..
            },
            ..
        }
    ));
}

#[test]
fn a_full_prefill_pool_queues_and_a_cancelled_waiter_frees_its_decode_slot() {
    // One prefill worker with one slot; the second long prompt waits for it.
    let mut f = fleet(&[1], 1, 4);
    f.submit(RequestId(1), f.key(&prompt(8, 4_000)), Nanos::ZERO);
    assert!(matches!(
        next(&mut f),
        DisaggEvent::Assigned {
            route: Route::Split { .. },
            ..
        }
    ));
    f.submit(RequestId(2), f.key(&prompt(9, 4_000)), Nanos::ZERO);
    f.submit(RequestId(3), f.key(&prompt(10, 4_000)), Nanos::ZERO);
    assert_eq!(f.poll_event(), None);
    assert_eq!(
        f.queued(),
        2,
        "request 3 waits for a decode slot, 2 for prefill"
    );
    assert_eq!(f.pool(Pool::Prefill).queued(), 1);
    // Request 2's client goes away: its decode slot goes to request 3, which then waits
    // for the prefill slot in turn.
    assert!(f.cancel(RequestId(2), Nanos::from_millis(10)));
    assert_eq!(f.pool(Pool::Decode).queued(), 0);
    assert_eq!(f.pool(Pool::Prefill).queued(), 1);
    f.on_prefill_done(RequestId(1), Nanos::from_millis(400));
    let DisaggEvent::Assigned {
        id,
        route: Route::Split { prefill, .. },
    } = next(&mut f)
    else {
        panic!("expected request 3's split route")
    };
    assert_eq!((id, prefill.worker), (RequestId(3), WorkerId(1)));
    // Request 1 ends (a decode slot frees up) but nobody frees the prefill slot: a waiter
    // past its timeout is served locally.
    f.on_finished(RequestId(1), Nanos::from_secs(1));
    f.submit(RequestId(4), f.key(&prompt(11, 4_000)), Nanos::from_secs(1));
    assert_eq!(f.poll_event(), None);
    let due = f.poll_timeout().unwrap();
    f.handle_timeout(due);
    assert!(matches!(
        next(&mut f),
        DisaggEvent::Assigned {
            id: RequestId(4),
            route: Route::Local {
                reason: LocalReason::PrefillUnavailable(AdmitError::QueueTimeout { .. }),
                ..
            },
        }
    ));
}
