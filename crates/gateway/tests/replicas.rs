//! A gateway replica's side of the replica sync over a real nats-server, against a peer played
//! by the test: bad messages are refused and counted, a peer is counted until it says goodbye,
//! and a second process with the replica's own id is detected.

mod common;

use std::time::{Duration, Instant};

use common::nats::NatsServer;
use gateway::{Gateway, GatewayConfig, ReplicaSettings};
use protocol::{ReplicaBatch, Subjects};

fn series(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0)
}

/// Waits up to 5 s for the gateway's metric `name` to reach `at_least`.
async fn wait_metric(gateway: &Gateway, name: &str, at_least: f64) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let value = series(&gateway.metrics_text(), name);
        if value >= at_least {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{name} is {value}, expected {at_least}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn batch(replica: u32, epoch: u64, goodbye: bool) -> ReplicaBatch {
    ReplicaBatch {
        replica,
        epoch,
        next_seq: 0,
        sent_unix_ns: 0,
        goodbye,
        updates: Vec::new(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_refuses_bad_messages_tracks_peers_and_detects_a_shared_id() {
    let nats = NatsServer::start();
    let config = GatewayConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        nats_url: Some(nats.url()),
        namespace: "rep".into(),
        replica: ReplicaSettings {
            id: Some(7),
            snapshot_timeout: Duration::from_millis(100),
            ..ReplicaSettings::default()
        },
        ..GatewayConfig::default()
    };
    let gateway = Gateway::bind(config).await.unwrap();
    let replica = gateway.replica().expect("a replica with NATS");
    assert_eq!(replica.id.0, 7);
    assert!(replica.sync);

    let peer = async_nats::connect(nats.url()).await.unwrap();
    let subject = Subjects::new("rep").unwrap().replicas();
    let publish = |bytes: Vec<u8>| {
        let (peer, subject) = (peer.clone(), subject.clone());
        async move {
            peer.publish(subject, bytes.into()).await.unwrap();
            peer.flush().await.unwrap();
        }
    };
    // Garbage, and a prompt over the block limit: refused and counted, nothing else.
    publish(b"\x93not a batch".to_vec()).await;
    let mut long = batch(8, 1, false);
    long.updates.push(protocol::WireUpdate {
        seq: 0,
        request: 1,
        change: protocol::WireChange::Routed {
            worker: 1,
            num_tokens: 1 << 20,
            local: vec![7; protocol::replicas::MAX_KEY_BLOCKS + 1],
        },
    });
    publish(long.encode()).await;
    wait_metric(&gateway, "kvroute_replica_messages_refused_total", 2.0).await;
    assert_eq!(
        series(&gateway.metrics_text(), "kvroute_replica_peers"),
        0.0
    );

    // A peer's heartbeat makes it a peer; its goodbye forgets it.
    publish(batch(8, 1, false).encode()).await;
    wait_metric(&gateway, "kvroute_replica_peers", 1.0).await;
    publish(batch(8, 1, true).encode()).await;
    let deadline = Instant::now() + Duration::from_secs(5);
    while series(&gateway.metrics_text(), "kvroute_replica_peers") != 0.0 {
        assert!(
            Instant::now() < deadline,
            "the peer's goodbye was not heard"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // Another process using id 7: detected.
    publish(batch(7, replica.epoch + 1, false).encode()).await;
    wait_metric(&gateway, "kvroute_replica_same_id_total", 1.0).await;
    // Its own heartbeats went out meanwhile.
    assert!(
        series(
            &gateway.metrics_text(),
            "kvroute_replica_messages_sent_total"
        ) >= 1.0
    );
    gateway.shutdown().await;
}
