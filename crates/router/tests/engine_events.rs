//! The wire contract between workers and the router, end to end: KV events emitted by the
//! engine simulator, fed to the router, must make the router's view of each worker's cache
//! equal to what that worker really reuses.

use std::sync::Arc;

use engine::{Engine, EngineConfig, EngineEvent, EngineRequest, Leg, OutputSpec};
use kv_index::WorkerId;
use nanotime::Nanos;
use router::{PolicyKind, RequestId, Router, RouterConfig, WorkerLimits};

const BLOCK: u32 = 32;
const WORKERS: u64 = 3;

/// Runs one engine until it is idle, feeding its KV events to the router; returns the
/// `Finished` event's prefix-hit tokens for `id`, and the time it ended.
fn serve(engine: &mut Engine, router: &mut Router, id: u64, now: Nanos) -> (u32, Nanos) {
    let mut cached = None;
    let mut end = now;
    while let Some(t) = engine.poll_timeout() {
        engine.handle_timeout(t);
        end = t;
        while let Some(event) = engine.poll_event() {
            match event {
                EngineEvent::Kv(kv) => {
                    router
                        .apply_event(&kv)
                        .expect("engine streams are gap-free");
                }
                EngineEvent::Finished {
                    id: done,
                    cached_prompt_tokens,
                    ..
                } if done.0 == id => cached = Some(cached_prompt_tokens),
                EngineEvent::Rejected { reason, .. } => panic!("rejected: {reason:?}"),
                _ => {}
            }
        }
    }
    (cached.expect("request finished"), end)
}

/// Conversations over a shared pool of passages, turns interleaved, on engines small enough
/// that their caches evict: after every request, the router's predicted overlap on the
/// chosen worker must equal the prefix the engine actually reused.
#[test]
fn router_overlap_equals_engine_prefix_hits_through_eviction() {
    let mut router = Router::new(RouterConfig {
        policy: PolicyKind::Kv,
        seed: 5,
        ..RouterConfig::default()
    })
    .unwrap();
    let mut engines: Vec<Engine> = (0..WORKERS)
        .map(|w| {
            let mut config = EngineConfig::seed_002();
            config.num_gpu_blocks_override = Some(200); // 6,400 tokens: forces eviction
            config.seed = w;
            router
                .add_worker(WorkerId(w), WorkerLimits::default())
                .unwrap();
            Engine::new(config, WorkerId(w)).unwrap()
        })
        .collect();

    let passages: Vec<Vec<u32>> = (0..3u32)
        .map(|p| (0..2_000 + 37 * p).map(|i| p * 1_000_000 + i).collect())
        .collect();
    let mut histories: Vec<Vec<u32>> = (0..8).map(|c| passages[c % 3].clone()).collect();
    let mut now = Nanos::ZERO;
    let mut checked_hits = 0u64;
    let mut evictions_seen = false;
    for turn in 0..4u32 {
        for (c, history) in histories.iter_mut().enumerate() {
            let id = u64::from(turn) * 100 + c as u64;
            // The user's question for this turn.
            history.extend((0..45 + c as u32).map(|i| 0x4000_0000 | (id as u32) << 8 | i));
            let prompt: Arc<[u32]> = history.as_slice().into();
            let key = router.key(&prompt);
            let decision = router.route(RequestId(id), &key, now).unwrap();
            let answer: Arc<[u32]> = (0..300 + 7 * c as u32)
                .map(|i| 0x2000_0000 | (id as u32) << 12 | i)
                .collect();
            let engine = &mut engines[decision.worker.0 as usize];
            engine.submit(
                EngineRequest {
                    id: engine::RequestId(id),
                    prompt: prompt.clone(),
                    output: OutputSpec::Tokens(answer.clone()),
                    leg: Leg::ByRole,
                },
                now,
            );
            let (cached, end) = serve(engine, &mut router, id, now);
            router.on_first_token(RequestId(id), end);
            router.on_finished(RequestId(id), end);
            now = end;

            // The engine always recomputes the last prompt token (it needs its logits).
            let engine_max_blocks = (prompt.len() as u32 - 1) / BLOCK;
            let expected = decision.overlap_blocks.min(engine_max_blocks) * BLOCK;
            assert_eq!(
                cached, expected,
                "turn {turn} conversation {c} on {}: router predicted {} blocks",
                decision.worker, decision.overlap_blocks
            );
            checked_hits += u64::from(cached);
            history.extend(answer.iter());
        }
        evictions_seen |= router.index().counters().blocks_removed > 0;
    }
    assert!(evictions_seen, "the scenario must exercise eviction events");
    assert!(checked_hits > 0, "the scenario must exercise prefix hits");
    assert_eq!(router.index().counters().gaps, 0);
}
