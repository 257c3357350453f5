//! End to end over loopback: the gateway in front of three real engine servers, KV events
//! over a real nats-server.

mod common;

use std::time::Duration;

use common::nats::NatsServer;
use common::*;
use gateway::GatewayConfig;
use kv_index::WorkerId;
use router::PolicyKind;

/// Turn 1 of a conversation, then turn 2 with turn 1's reply in the history, streamed.
/// Returns (worker, prompt tokens, cached tokens) per turn.
async fn conversation(gw: &gateway::Gateway, index: usize, turns: usize) -> Vec<(u64, u64, u64)> {
    let system = passage(index, 1200);
    let mut history = vec![("system", system)];
    let mut out = Vec::new();
    let preprocessor = gateway::preprocess::Preprocessor::builtin();
    for turn in 0..turns {
        history.push(("user", format!("Question {turn} about passage {index}?")));
        let s = stream_chat(&gw.url(), &history, 24).await;
        assert_eq!(s.status, 200, "{s:?}");
        assert!(s.done, "stream ended without [DONE]: {s:?}");
        assert!(s.error().is_none(), "{s:?}");
        let usage = s.usage().expect("usage chunk").clone();
        let prompt = usage["prompt_tokens"].as_u64().unwrap();
        let cached = usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        let worker = s.worker.expect("x-kvroute-worker header");
        out.push((worker, prompt, cached));
        let reply = s.text();
        // The engine published the prompt's blocks; wait until the index has them all, as a
        // client's think time would.
        let chat_messages: Vec<text::ChatMessage> = history
            .iter()
            .map(|(r, c)| text::ChatMessage::new(*r, c.as_str()))
            .collect();
        let tokens = preprocessor.chat(&chat_messages, false).unwrap().tokens;
        assert_eq!(
            tokens.len() as u64,
            prompt,
            "the engine saw the gateway's tokens"
        );
        let key = gw.dispatcher().key(&tokens);
        wait_for("the turn's KV events", Duration::from_secs(5), || {
            gw.dispatcher().overlaps(&key).get(WorkerId(worker)) == key.num_blocks()
        })
        .await;
        history.push(("assistant", reply));
    }
    out
}

async fn cluster(
    nats: &NatsServer,
    namespace: &str,
    mode: PolicyKind,
) -> (Vec<engine_server::EngineServerHandle>, gateway::Gateway) {
    let engines = engines(1..=3, Some((&nats.url(), namespace))).await;
    let refs: Vec<_> = engines.iter().collect();
    let mut config = gateway_config(&refs);
    config.router.policy = mode;
    config.nats_url = Some(nats.url());
    config.namespace = namespace.to_string();
    let gw = gateway(config).await;
    wait_for("three routable workers", Duration::from_secs(5), || {
        gw.dispatcher().routable_workers().len() == 3
    })
    .await;
    (engines, gw)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_routing_sends_each_next_turn_to_the_worker_that_cached_the_last() {
    next_turns_go_to_the_worker_that_cached_the_last(PolicyKind::Kv).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_load_routing_sends_each_next_turn_to_the_worker_that_cached_the_last() {
    next_turns_go_to_the_worker_that_cached_the_last(PolicyKind::KvLoad).await;
}

async fn next_turns_go_to_the_worker_that_cached_the_last(mode: PolicyKind) {
    let nats = NatsServer::start();
    let (engines, gw) = cluster(&nats, mode.name(), mode).await;
    let mut first_workers = Vec::new();
    for c in 0..4 {
        let turns = conversation(&gw, c, 3).await;
        let (first, first_prompt, _) = turns[0];
        first_workers.push(first);
        for window in turns.windows(2) {
            let (prev_worker, prev_prompt, _) = window[0];
            let (worker, prompt, cached) = window[1];
            assert_eq!(worker, prev_worker, "conversation {c}: {turns:?}");
            assert!(prompt > prev_prompt);
            // The whole previous prompt (full blocks) is a hit, and so is most of the reply
            // the engine generated, because its tokens round-trip through the history.
            let floor = prev_prompt / 32 * 32;
            assert!(
                cached >= floor,
                "conversation {c}: cached {cached} < {floor}: {turns:?}"
            );
        }
        assert!(first_prompt > 1000, "{turns:?}");
    }
    let metrics = gw.metrics_text();
    let decisions = format!(
        "kvroute_router_decisions_total{{policy=\"{}\"}} 12",
        mode.name()
    );
    assert!(metrics.contains(&decisions), "{metrics}");
    let cached_sum: f64 = metrics
        .lines()
        .find_map(|l| {
            l.strip_prefix("dynamo_frontend_cached_tokens_sum{model=\"llama-3.1-70b-instruct\"} ")
        })
        .expect("cached tokens metric")
        .parse()
        .unwrap();
    assert!(cached_sum > 8.0 * 1000.0, "{cached_sum}");
    shut_down(gw, engines).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_robin_spreads_the_turns_of_a_conversation() {
    let nats = NatsServer::start();
    let (engines, gw) = cluster(&nats, "rrtest", PolicyKind::RoundRobin).await;
    let turns = conversation(&gw, 7, 3).await;
    let workers: std::collections::BTreeSet<u64> = turns.iter().map(|t| t.0).collect();
    assert_eq!(workers.len(), 3, "{turns:?}");
    // Each turn lands on a worker that never saw the conversation: little is cached.
    for &(_, prompt, cached) in &turns[1..] {
        assert!(cached < prompt / 4, "{turns:?}");
    }
    shut_down(gw, engines).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_register_over_nats_and_leave_by_goodbye_or_lease() {
    let nats = NatsServer::start();
    let namespace = "dyn";
    let mut engines = engines(11..=13, Some((&nats.url(), namespace))).await;
    let gw = gateway(GatewayConfig {
        nats_url: Some(nats.url()),
        namespace: namespace.into(),
        ..gateway_config(&[])
    })
    .await;
    // Announcements repeat every third of the 1 s lease, so all three appear quickly.
    wait_for("three announced workers", Duration::from_secs(5), || {
        gw.dispatcher().routable_workers() == vec![WorkerId(11), WorkerId(12), WorkerId(13)]
    })
    .await;

    let turns = conversation(&gw, 3, 2).await;
    assert_eq!(turns[0].0, turns[1].0, "{turns:?}");
    assert!(turns[1].2 >= turns[0].1 / 32 * 32, "{turns:?}");

    // Goodbye: the worker leaves at once and its blocks leave the index.
    let served = WorkerId(turns[0].0);
    assert!(gw.dispatcher().cached_blocks(served) > 0);
    let position = engines
        .iter()
        .position(|e| e.info().worker == Some(served))
        .unwrap();
    engines.remove(position).shutdown().await;
    wait_for("the goodbye", Duration::from_secs(5), || {
        !gw.dispatcher().routable_workers().contains(&served)
    })
    .await;
    assert_eq!(gw.dispatcher().cached_blocks(served), 0);

    // A worker that stops heartbeating leaves when its lease runs out (it stays healthy, so
    // only the lease can remove it).
    let silent = common::fake_worker::FakeWorker::start_with_info(
        common::fake_worker::Script::Complete { tokens: 1 },
        Some(serde_json::json!({"worker": 99, "instance": 1})),
    )
    .await;
    let client = async_nats::connect(nats.url()).await.unwrap();
    let announce = protocol::WorkerMessage::Announce(protocol::WorkerAnnounce {
        card: protocol::WorkerCard {
            worker: Some(WorkerId(99)),
            instance: 1,
            url: silent.url(),
            model: MODEL.into(),
            block_size: Some(32),
            limits: router::WorkerLimits {
                max_num_seqs: Some(8),
                kv_capacity_blocks: Some(1000),
                timing: None,
            },
            nats_kv_subject: Some("kvroute.dyn.kv.99".into()),
            returns_token_ids: true,
            ..protocol::WorkerCard::default()
        },
        lease_ms: 300,
        token: None,
    });
    client
        .publish("kvroute.dyn.workers", announce.encode().unwrap().into())
        .await
        .unwrap();
    client.flush().await.unwrap();
    wait_for("the announced worker", Duration::from_secs(5), || {
        gw.dispatcher().routable_workers().contains(&WorkerId(99))
    })
    .await;
    wait_for("the lease to run out", Duration::from_secs(5), || {
        !gw.dispatcher().routable_workers().contains(&WorkerId(99))
    })
    .await;
    assert_eq!(gw.dispatcher().routable_workers().len(), 2);
    shut_down(gw, engines).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn approximate_mode_keeps_conversations_on_their_worker_without_events() {
    // No NATS, no ZMQ: the router predicts caches from its own decisions.
    let engines = engines(1..=3, None).await;
    let refs: Vec<_> = engines.iter().collect();
    let mut config = gateway_config(&refs);
    config.router.kv_source = router::KvSource::Approximate {
        ttl: nanotime::Nanos::from_secs(120),
    };
    let gw = gateway(config).await;
    for c in 0..3 {
        let system = passage(20 + c, 1000);
        let mut history = vec![
            ("system", system.clone()),
            ("user", "First question?".to_string()),
        ];
        let first = stream_chat(&gw.url(), &history, 16).await;
        assert!(first.done && first.error().is_none(), "{first:?}");
        history.push(("assistant", first.text()));
        history.push(("user", "Second question?".to_string()));
        let second = stream_chat(&gw.url(), &history, 16).await;
        assert_eq!(second.worker, first.worker, "conversation {c}");
        // The engine really had it cached.
        let prompt = first.usage().unwrap()["prompt_tokens"].as_u64().unwrap();
        let cached = second.usage().unwrap()["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        assert!(cached >= prompt / 32 * 32, "{cached} < {prompt}");
    }
    let metrics = gw.metrics_text();
    // Predictions, not events, filled the index.
    assert!(
        metrics.contains("kvroute_router_kv_events_received_total{source=\"nats\"} 0"),
        "{metrics}"
    );
    assert!(
        !metrics.contains("kvroute_router_index_blocks 0\n"),
        "{metrics}"
    );
    shut_down(gw, engines).await;
}
