//! NATS worker registration as a hostile publisher would try it, over a real nats-server:
//! forged announcements and goodbyes take no traffic from live workers, bogus URLs get none,
//! and with a registration token only workers carrying it register.

mod common;

use std::time::Duration;

use common::nats::NatsServer;
use common::*;
use engine_server::{EngineServerConfig, EngineServerHandle, NatsConfig};
use gateway::GatewayConfig;
use kv_index::WorkerId;
use protocol::{WorkerAnnounce, WorkerCard, WorkerMessage};

/// Worker `id` announcing itself on `nats` in `namespace`, carrying `token`.
async fn engine_with_token(
    id: u64,
    nats: &NatsServer,
    namespace: &str,
    token: Option<&str>,
) -> EngineServerHandle {
    start_engine(EngineServerConfig {
        nats: Some(NatsConfig {
            url: nats.url(),
            namespace: namespace.to_string(),
            lease_ms: 1_000,
            registration_token: token.map(str::to_owned),
            security: Default::default(),
        }),
        ..engine_config(id)
    })
    .await
}

/// An announcement of worker `id` at `url`, as anyone on the NATS server could publish it.
fn announcement(id: u64, instance: u64, url: &str, token: Option<&str>) -> WorkerMessage {
    WorkerMessage::Announce(WorkerAnnounce {
        card: WorkerCard {
            worker: Some(WorkerId(id)),
            instance,
            url: url.to_owned(),
            model: MODEL.into(),
            block_size: Some(32),
            ..WorkerCard::default()
        },
        lease_ms: 60_000,
        token: token.map(str::to_owned),
    })
}

async fn publish(client: &async_nats::Client, namespace: &str, message: &WorkerMessage) {
    client
        .publish(
            format!("kvroute.{namespace}.workers"),
            message.encode().unwrap().into(),
        )
        .await
        .unwrap();
    client.flush().await.unwrap();
}

fn refused(gw: &gateway::Gateway) -> u64 {
    let metrics = gw.metrics_text();
    metrics
        .lines()
        .find_map(|l| l.strip_prefix("kvroute_gateway_worker_registrations_refused_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("the refusal counter is exported: {metrics}"))
}

/// The URL the gateway routes `worker` to, if it is routable.
fn routed_url(gw: &gateway::Gateway, worker: WorkerId) -> Option<String> {
    gw.dispatcher()
        .workers()
        .into_iter()
        .find(|(info, _, routable)| info.id == worker && *routable)
        .map(|(info, _, _)| info.url.clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_announcements_and_goodbyes_take_no_traffic_from_live_workers() {
    let nats = NatsServer::start();
    let namespace = "forge";
    let engines = vec![
        engine_with_token(21, &nats, namespace, None).await,
        engine_with_token(22, &nats, namespace, None).await,
    ];
    let gw = gateway(GatewayConfig {
        nats_url: Some(nats.url()),
        namespace: namespace.into(),
        ..gateway_config(&[])
    })
    .await;
    wait_for("two announced workers", Duration::from_secs(5), || {
        gw.dispatcher().routable_workers() == vec![WorkerId(21), WorkerId(22)]
    })
    .await;
    let real_url = engines[0].url();
    let real_instance = engines[0].info().instance;
    let client = async_nats::connect(nats.url()).await.unwrap();

    // Worker 21's id at a URL nothing listens on (a new instance, as a restart would say).
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead_url = format!("http://{}", dead.local_addr().unwrap());
    drop(dead);
    publish(&client, namespace, &announcement(21, 5, &dead_url, None)).await;
    // (One check per worker at a time: the next announcement of 21 waits for this one.)
    wait_for("the first refusal", Duration::from_secs(10), || {
        refused(&gw) >= 1
    })
    .await;
    // A new worker at that dead URL.
    publish(&client, namespace, &announcement(50, 1, &dead_url, None)).await;
    // An impostor that answers /info claiming to be worker 21: the real one still answers.
    let impostor = fake_worker::FakeWorker::start_with_info(
        fake_worker::Script::Complete { tokens: 1 },
        Some(serde_json::json!({"worker": 21, "instance": 6})),
    )
    .await;
    publish(
        &client,
        namespace,
        &announcement(21, 6, &impostor.url(), None),
    )
    .await;
    // An announcement naming a URL that answers as another worker.
    publish(
        &client,
        namespace,
        &announcement(51, 1, &engines[1].url(), None),
    )
    .await;
    // A goodbye naming another instance than the live worker's.
    publish(
        &client,
        namespace,
        &WorkerMessage::Goodbye {
            worker: 22,
            instance: engines[1].info().instance ^ 1,
            token: None,
        },
    )
    .await;
    wait_for("five refusals", Duration::from_secs(10), || {
        refused(&gw) >= 5
    })
    .await;

    assert_eq!(
        gw.dispatcher().routable_workers(),
        vec![WorkerId(21), WorkerId(22)]
    );
    assert_eq!(routed_url(&gw, WorkerId(21)), Some(real_url));
    for _ in 0..6 {
        let s = short_chat_stream(&gw.url()).await;
        assert_eq!(s.status, 200, "{s:?}");
        assert!(s.done && s.error().is_none(), "{s:?}");
    }
    assert!(
        impostor.requests.lock().unwrap().is_empty(),
        "the impostor received no prompt"
    );

    // The worker's own announcements still renew it, and its real goodbye removes it.
    let (left, stays) = (WorkerId(22), WorkerId(21));
    publish(
        &client,
        namespace,
        &WorkerMessage::Goodbye {
            worker: 21,
            instance: real_instance,
            token: None,
        },
    )
    .await;
    wait_for("the goodbye", Duration::from_secs(5), || {
        !gw.dispatcher().routable_workers().contains(&stays)
    })
    .await;
    // Its next heartbeat (every third of a second) brings it back, checked again.
    wait_for("the heartbeat", Duration::from_secs(5), || {
        gw.dispatcher().routable_workers() == vec![stays, left]
    })
    .await;
    shut_down(gw, engines).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_registration_token_only_workers_carrying_it_register() {
    let nats = NatsServer::start();
    let namespace = "tok";
    let token = "t0ken";
    let engines = vec![
        engine_with_token(31, &nats, namespace, Some(token)).await,
        engine_with_token(32, &nats, namespace, None).await,
        engine_with_token(33, &nats, namespace, Some("other")).await,
    ];
    let gw = gateway(GatewayConfig {
        nats_url: Some(nats.url()),
        namespace: namespace.into(),
        registration_token: Some(token.into()),
        ..gateway_config(&[])
    })
    .await;
    wait_for("the worker with the token", Duration::from_secs(5), || {
        gw.dispatcher().routable_workers() == vec![WorkerId(31)]
    })
    .await;
    // Both others heartbeat three times a second: each message is refused and counted.
    wait_for("refusals", Duration::from_secs(5), || refused(&gw) >= 4).await;
    assert_eq!(gw.dispatcher().routable_workers(), vec![WorkerId(31)]);

    // A goodbye with the right instance but no token, or a wrong one, removes nothing.
    let client = async_nats::connect(nats.url()).await.unwrap();
    let instance = engines[0].info().instance;
    for forged in [None, Some("t0keN")] {
        publish(
            &client,
            namespace,
            &WorkerMessage::Goodbye {
                worker: 31,
                instance,
                token: forged.map(str::to_owned),
            },
        )
        .await;
    }
    let before = refused(&gw);
    wait_for(
        "the forged goodbyes' refusal",
        Duration::from_secs(5),
        || refused(&gw) >= before + 2,
    )
    .await;
    assert!(gw.dispatcher().routable_workers().contains(&WorkerId(31)));
    for _ in 0..3 {
        let s = short_chat_stream(&gw.url()).await;
        assert_eq!((s.status, s.worker), (200, Some(31)), "{s:?}");
    }
    // The worker's own goodbye (it carries the token) removes it at once.
    let mut engines = engines;
    engines.remove(0).shutdown().await;
    wait_for("the real goodbye", Duration::from_secs(5), || {
        gw.dispatcher().routable_workers().is_empty()
    })
    .await;
    shut_down(gw, engines).await;
}

/// A `--worker` that also announces itself over NATS stays a `--worker` when it says goodbye
/// (a clean shutdown): out of the routing set while it is gone, back through its health check
/// when it restarts on its URL. (The goodbye used to forget it: it came back only by
/// announcing itself again, as a worker with a lease, and never without NATS.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_static_worker_that_says_goodbye_stays_static_and_comes_back_when_healthy() {
    let nats = NatsServer::start();
    let namespace = "bye";
    let worker = WorkerId(31);
    let first = engine_with_token(31, &nats, namespace, None).await;
    let addr = first.local_addr();
    let gw = gateway(GatewayConfig {
        nats_url: Some(nats.url()),
        namespace: namespace.into(),
        ..gateway_config(&[&first])
    })
    .await;
    wait_for("the worker", Duration::from_secs(5), || {
        gw.dispatcher().routable_workers() == vec![worker]
    })
    .await;
    // Its heartbeats (every third of its 1 s lease) register the running instance, whose
    // goodbye is then taken.
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    first.shutdown().await;
    wait_for("out of the routing set", Duration::from_secs(5), || {
        gw.dispatcher().routable_workers().is_empty()
    })
    .await;
    assert_eq!(refused(&gw), 0, "the goodbye was taken");
    assert_eq!(
        gw.dispatcher().origin(worker),
        Some(gateway::dispatch::Origin::Static),
        "still known as a --worker"
    );
    let second = start_engine(EngineServerConfig {
        listen: addr,
        ..engine_config(31)
    })
    .await;
    wait_for("its health check", Duration::from_secs(10), || {
        gw.dispatcher().routable_workers() == vec![worker]
    })
    .await;
    assert_eq!(
        gw.dispatcher().origin(worker),
        Some(gateway::dispatch::Origin::Static)
    );
    let s = short_chat_stream(&gw.url()).await;
    assert!(s.done && s.error().is_none(), "{s:?}");
    shut_down(gw, vec![second]).await;
}
