//! KV event ingestion from each source into the router's index: vLLM frames over a real ZMQ
//! socket (both msgpack encodings), our batches over a real nats-server, and the in-process
//! sink. A sequence gap must clear the worker's blocks (counted), never leave a wrong index,
//! unless the publisher's replay socket fills it (a fake vLLM publisher, and our own engine).

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::fake_worker::dead_port;
use common::nats::NatsServer;
use common::*;
use engine_server::EngineServerConfig;
use gateway::{Gateway, GatewayConfig, WorkerSpec};
use kv_index::{BlockHasher, KvEvent, KvEventKind, WorkerId};
use rmpv::Value;
use zeromq::{Socket, SocketSend, ZmqMessage};

const BLOCK: usize = 4;

fn config() -> GatewayConfig {
    GatewayConfig {
        router: router::RouterConfig {
            block_size: BLOCK,
            ..Default::default()
        },
        ..gateway_config(&[])
    }
}

fn metric(gw: &Gateway, line_prefix: &str) -> f64 {
    gw.metrics_text()
        .lines()
        .find_map(|l| l.strip_prefix(line_prefix))
        .unwrap_or_else(|| panic!("no {line_prefix}"))
        .trim()
        .parse()
        .unwrap()
}

fn ints(values: impl IntoIterator<Item = u64>) -> Value {
    Value::Array(values.into_iter().map(Value::from).collect())
}

/// `BlockStored` as vLLM's msgspec writes it with `array_like=True`.
fn stored_array(hashes: &[u64], parent: Option<u64>, tokens: std::ops::Range<u64>) -> Value {
    Value::Array(vec![
        "BlockStored".into(),
        ints(hashes.iter().copied()),
        parent.map_or(Value::Nil, Value::from),
        ints(tokens),
        Value::from(BLOCK as u64),
        Value::Nil,
        "GPU".into(),
        Value::Nil,
    ])
}

/// `BlockStored` as a tagged map (vLLM without `array_like`).
fn stored_map(hashes: &[u64], parent: Option<u64>, tokens: std::ops::Range<u64>) -> Value {
    Value::Map(vec![
        ("type".into(), "BlockStored".into()),
        ("block_hashes".into(), ints(hashes.iter().copied())),
        (
            "parent_block_hash".into(),
            parent.map_or(Value::Nil, Value::from),
        ),
        ("token_ids".into(), ints(tokens)),
        ("block_size".into(), Value::from(BLOCK as u64)),
        ("lora_id".into(), Value::Nil),
        ("medium".into(), "GPU".into()),
    ])
}

fn removed_map(hashes: &[u64]) -> Value {
    Value::Map(vec![
        ("type".into(), "BlockRemoved".into()),
        ("block_hashes".into(), ints(hashes.iter().copied())),
        ("medium".into(), "GPU".into()),
    ])
}

fn batch_array(events: Vec<Value>) -> Vec<u8> {
    let batch = Value::Array(vec![
        Value::F64(1.7e9),
        Value::Array(events),
        Value::from(0),
    ]);
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &batch).unwrap();
    out
}

fn batch_map(events: Vec<Value>) -> Vec<u8> {
    let batch = Value::Map(vec![
        ("ts".into(), Value::F64(1.7e9)),
        ("events".into(), Value::Array(events)),
        ("data_parallel_rank".into(), Value::Nil),
    ]);
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &batch).unwrap();
    out
}

/// A vLLM worker's KV event publisher: numbers its batches as vLLM does.
struct VllmPublisher {
    socket: zeromq::PubSocket,
    seq: u64,
}

impl VllmPublisher {
    /// Sends one batch as a (topic, seq, payload) frame, under the next sequence number.
    async fn send(&mut self, payload: Vec<u8>) {
        let parts = vec![
            Bytes::from_static(b"kv-events"),
            Bytes::copy_from_slice(&self.seq.to_be_bytes()),
            Bytes::from(payload),
        ];
        self.socket
            .send(ZmqMessage::try_from(parts).unwrap())
            .await
            .unwrap();
        self.seq += 1;
    }

    /// A batch lost on the way: its sequence number is never received.
    fn lose_one(&mut self) {
        self.seq += 1;
    }
}

/// Waits until the gateway's index holds `blocks` blocks of `worker`.
async fn wait_for_blocks(gw: &Gateway, worker: WorkerId, blocks: usize, what: &str) {
    wait_for(what, Duration::from_secs(5), || {
        gw.dispatcher().cached_blocks(worker) == blocks
    })
    .await;
}

fn tokens(range: std::ops::Range<u32>) -> Vec<u32> {
    range.collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_zmq_frames_of_both_encodings_feed_the_index_and_a_gap_clears_it() {
    let mut socket = zeromq::PubSocket::new();
    let endpoint = socket.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
    // A vLLM worker the gateway cannot reach over HTTP (not needed here): its events flow
    // all the same.
    let http = dead_port().await;
    let worker = WorkerId(5);
    let gw = gateway(GatewayConfig {
        workers: vec![
            format!("http://{http},id=5,block_size={BLOCK},zmq={endpoint}")
                .parse::<WorkerSpec>()
                .unwrap(),
        ],
        ..config()
    })
    .await;

    let mut publisher = VllmPublisher { socket, seq: 0 };
    // ZMQ's slow joiner: send harmless frames until the subscription is live.
    let received = "kvroute_router_kv_events_received_total{source=\"zmq\"} ";
    while metric(&gw, received) == 0.0 {
        publisher.send(batch_array(vec![removed_map(&[999])])).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // Array encoding: two blocks of tokens 0..8 with vLLM's own ids 101, 102.
    publisher
        .send(batch_array(vec![stored_array(&[101, 102], None, 0..8)]))
        .await;
    wait_for_blocks(&gw, worker, 2, "the array-encoded batch").await;
    // Map encoding: a child block, chained by vLLM's parent id.
    publisher
        .send(batch_map(vec![stored_map(&[103], Some(102), 8..12)]))
        .await;
    wait_for_blocks(&gw, worker, 3, "the map-encoded batch").await;
    // The index hashed the tokens itself: the prompt 0..14 matches 3 leading blocks there.
    let key = gw.dispatcher().key(&tokens(0..14));
    assert_eq!(gw.dispatcher().overlaps(&key).get(worker), 3);
    assert_eq!(
        metric(&gw, "kvroute_router_kv_resyncs_total{source=\"zmq\"} "),
        0.0
    );

    // Batch seq+1 is lost: the next one reveals the gap. The worker's blocks are cleared
    // (they may no longer be true), counted, and the new batch is applied on a clean slate.
    publisher.lose_one();
    publisher
        .send(batch_array(vec![stored_array(&[201], None, 100..104)]))
        .await;
    wait_for("the resync", Duration::from_secs(5), || {
        metric(&gw, "kvroute_router_kv_resyncs_total{source=\"zmq\"} ") == 1.0
    })
    .await;
    wait_for_blocks(&gw, worker, 1, "the post-gap state").await;
    assert_eq!(gw.dispatcher().overlaps(&key).get(worker), 0);
    let other = gw.dispatcher().key(&tokens(100..104));
    assert_eq!(gw.dispatcher().overlaps(&other).get(worker), 1);

    // Removal (map form) and a clear.
    publisher.send(batch_map(vec![removed_map(&[201])])).await;
    wait_for_blocks(&gw, worker, 0, "the removal").await;
    publisher
        .send(batch_array(vec![stored_array(&[301], None, 0..4)]))
        .await;
    publisher
        .send(batch_array(vec![Value::Array(vec![
            "AllBlocksCleared".into(),
        ])]))
        .await;
    wait_for("the clear", Duration::from_secs(5), || {
        metric(&gw, received) >= 7.0 && gw.dispatcher().cached_blocks(worker) == 0
    })
    .await;
    // Garbage is counted and clears the worker rather than being half-applied.
    publisher
        .socket
        .send(ZmqMessage::try_from(vec![Bytes::from_static(b"kv-events")]).unwrap())
        .await
        .unwrap();
    wait_for("the decode error", Duration::from_secs(5), || {
        metric(
            &gw,
            "kvroute_router_kv_event_decode_errors_total{source=\"zmq\"} ",
        ) == 1.0
    })
    .await;
    gw.shutdown().await;
}

/// Publishes `payload` on `subject` and waits until the server has it.
async fn publish_to(client: &async_nats::Client, subject: &str, payload: Vec<u8>) {
    client
        .publish(subject.to_owned(), payload.into())
        .await
        .unwrap();
    client.flush().await.unwrap();
}

/// `worker`'s `events` of run `instance`, as one NATS batch on `subject`.
async fn publish_batch(
    client: &async_nats::Client,
    subject: &str,
    worker: WorkerId,
    instance: u64,
    events: &[KvEvent],
) {
    let batch = protocol::KvEventBatch::from_events(worker, instance, events).unwrap();
    publish_to(client, subject, batch.encode()).await;
}

fn stored(worker: WorkerId, seq: u64, prompt: &[u32]) -> KvEvent {
    KvEvent {
        worker,
        seq,
        kind: KvEventKind::stored_prompt(&BlockHasher::new(BLOCK).unwrap(), prompt),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_batches_feed_the_index_and_gaps_and_restarts_clear_the_worker() {
    let nats = NatsServer::start();
    let gw = gateway(GatewayConfig {
        nats_url: Some(nats.url()),
        namespace: "ev".into(),
        ..config()
    })
    .await;
    let client = async_nats::connect(nats.url()).await.unwrap();
    let worker = WorkerId(3);
    let publish = |events: Vec<KvEvent>, instance: u64| {
        let client = client.clone();
        async move { publish_batch(&client, "kvroute.ev.kv.3", worker, instance, &events).await }
    };
    publish(
        vec![
            stored(worker, 0, &tokens(0..8)),
            stored(worker, 1, &tokens(50..58)),
        ],
        1,
    )
    .await;
    wait_for_blocks(&gw, worker, 4, "two stored prompts").await;
    // seq 2 is lost: seq 3 reveals the gap → the worker is cleared, then seq 3 applies.
    publish(vec![stored(worker, 3, &tokens(200..204))], 1).await;
    wait_for_blocks(&gw, worker, 1, "the resync").await;
    let resyncs = "kvroute_router_kv_resyncs_total{source=\"nats\"} ";
    assert_eq!(metric(&gw, resyncs), 1.0);
    assert_eq!(
        gw.dispatcher()
            .overlaps(&gw.dispatcher().key(&tokens(0..8)))
            .get(worker),
        0
    );
    // In order again: applied.
    publish(vec![stored(worker, 4, &tokens(0..8))], 1).await;
    wait_for_blocks(&gw, worker, 3, "in-order events").await;
    // A new instance (the worker restarted, seq from 0): the old blocks go.
    publish(vec![stored(worker, 0, &tokens(300..304))], 2).await;
    wait_for("the restart", Duration::from_secs(5), || {
        gw.dispatcher().cached_blocks(worker) == 1 && metric(&gw, resyncs) == 2.0
    })
    .await;
    // Garbage on the subject: counted, worker cleared.
    client
        .publish("kvroute.ev.kv.3", Bytes::from_static(b"\xc1not msgpack"))
        .await
        .unwrap();
    client.flush().await.unwrap();
    wait_for("the decode error", Duration::from_secs(5), || {
        metric(
            &gw,
            "kvroute_router_kv_event_decode_errors_total{source=\"nats\"} ",
        ) == 1.0
            && gw.dispatcher().cached_blocks(worker) == 0
    })
    .await;
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_in_process_sink_feeds_the_index_with_the_same_gap_policy() {
    let gw = gateway(config()).await;
    let sink = gw.kv_event_sink();
    let worker = WorkerId(8);
    sink.publish(&[stored(worker, 10, &tokens(0..16))]);
    assert_eq!(gw.dispatcher().cached_blocks(worker), 4);
    sink.publish(&[stored(worker, 12, &tokens(40..44))]);
    assert_eq!(gw.dispatcher().cached_blocks(worker), 1);
    assert_eq!(
        metric(
            &gw,
            "kvroute_router_kv_resyncs_total{source=\"in_process\"} "
        ),
        1.0
    );
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_stored_event_and_a_flood_of_garbage_are_refused_and_counted() {
    let mut socket = zeromq::PubSocket::new();
    let endpoint = socket.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
    let http = dead_port().await;
    let worker = WorkerId(6);
    let gw = gateway(GatewayConfig {
        workers: vec![
            format!("http://{http},id=6,block_size={BLOCK},zmq={endpoint}")
                .parse::<WorkerSpec>()
                .unwrap(),
        ],
        ..config()
    })
    .await;
    let mut publisher = VllmPublisher { socket, seq: 0 };
    let received = "kvroute_router_kv_events_received_total{source=\"zmq\"} ";
    while metric(&gw, received) == 0.0 {
        publisher.send(batch_array(vec![removed_map(&[999])])).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    publisher
        .send(batch_array(vec![stored_array(&[101], None, 0..4)]))
        .await;
    wait_for_blocks(&gw, worker, 1, "a normal event").await;

    // A million tokens in one BlockStored: refused whole (counted), the worker's blocks
    // cleared since the index now misses what it said; nothing of it is indexed.
    let tokens = 1u64 << 20;
    let hashes: Vec<u64> = (0..tokens / BLOCK as u64).map(|h| h + 1000).collect();
    publisher
        .send(batch_array(vec![stored_array(&hashes, None, 0..tokens)]))
        .await;
    let errors = "kvroute_router_kv_event_decode_errors_total{source=\"zmq\"} ";
    wait_for(
        "the oversized event's error",
        Duration::from_secs(10),
        || metric(&gw, errors) == 1.0,
    )
    .await;
    assert_eq!(gw.dispatcher().cached_blocks(worker), 0);

    // A flood of garbage frames: each counted, none applied, the gateway still serving.
    for _ in 0..300 {
        publisher.send(b"\xc1garbage".to_vec()).await;
    }
    wait_for("the flood's errors", Duration::from_secs(10), || {
        metric(&gw, errors) == 301.0
    })
    .await;
    publisher
        .send(batch_array(vec![stored_array(&[102], None, 4..8)]))
        .await;
    wait_for_blocks(&gw, worker, 1, "an event after the flood").await;
    gw.shutdown().await;
}

/// Tokens 0..16 are indexed on `worker` as one prefix of four blocks: `filler` filled the
/// gap, and the live batch on top extends it. `resyncs` is the clears counter's line prefix,
/// and `cleared` how many the gap cost. Returns the key.
fn assert_first_four_blocks_known(
    gw: &Gateway,
    worker: WorkerId,
    (resyncs, cleared): (&str, f64),
    filler: &str,
) -> router::RoutingKey {
    let key = gw.dispatcher().key(&tokens(0..16));
    assert_eq!(
        gw.dispatcher().overlaps(&key).get(worker),
        4,
        "{filler} and the live batch on top keep the whole prefix known"
    );
    assert_eq!(metric(gw, resyncs), cleared);
    key
}

/// A vLLM (or SGLang) publisher with its replay socket: every batch it numbers is kept in a
/// bounded buffer, and its ROUTER answers replay requests from there, as their
/// `ZmqEventPublisher` does. A batch can be numbered and buffered but never reach the
/// subscriber (lost on the way), which is what a replay is for.
struct ReplayingPublisher {
    live: VllmPublisher,
    buffer: std::sync::Arc<std::sync::Mutex<protocol::vllm::ReplayBuffer>>,
    router: tokio::task::JoinHandle<()>,
    replay_endpoint: String,
}

impl ReplayingPublisher {
    async fn bind(capacity: usize) -> (ReplayingPublisher, String) {
        use zeromq::SocketRecv;
        let mut socket = zeromq::PubSocket::new();
        let endpoint = socket.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
        let mut router = zeromq::RouterSocket::new();
        let replay_endpoint = router.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
        let buffer = std::sync::Arc::new(std::sync::Mutex::new(protocol::vllm::ReplayBuffer::new(
            capacity,
        )));
        let served = buffer.clone();
        let router = tokio::spawn(async move {
            while let Ok(request) = router.recv().await {
                let (identity, start) =
                    protocol::vllm::decode_replay_request(&request.into_vec()).unwrap();
                let mut replies: Vec<_> = served
                    .lock()
                    .unwrap()
                    .since(start)
                    .map(|(seq, payload)| {
                        protocol::vllm::encode_replay_frame(&identity, seq, payload)
                    })
                    .collect();
                replies.push(protocol::vllm::encode_replay_end(&identity));
                for parts in replies {
                    let parts: Vec<Bytes> = parts.into_iter().map(Bytes::from).collect();
                    router
                        .send(ZmqMessage::try_from(parts).unwrap())
                        .await
                        .unwrap();
                }
            }
        });
        let publisher = ReplayingPublisher {
            live: VllmPublisher { socket, seq: 0 },
            buffer,
            router,
            replay_endpoint,
        };
        (publisher, endpoint)
    }

    async fn send(&mut self, payload: Vec<u8>) {
        self.buffer
            .lock()
            .unwrap()
            .push(self.live.seq, payload.clone());
        self.live.send(payload).await;
    }

    /// Numbered and buffered, but lost on its way to the subscriber.
    fn lose(&mut self, payload: Vec<u8>) {
        self.buffer.lock().unwrap().push(self.live.seq, payload);
        self.live.lose_one();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_is_filled_from_the_replay_socket_and_cleared_only_when_it_cannot_be() {
    // A buffer of 4 batches: a gap of one is replayed, a gap wider than the buffer is not.
    let (mut publisher, endpoint) = ReplayingPublisher::bind(4).await;
    let http = dead_port().await;
    let worker = WorkerId(6);
    let gw = gateway(GatewayConfig {
        workers: vec![
            format!(
                "http://{http},id=6,block_size={BLOCK},zmq={endpoint},zmq_replay={}",
                publisher.replay_endpoint
            )
            .parse::<WorkerSpec>()
            .unwrap(),
        ],
        ..config()
    })
    .await;
    let received = "kvroute_router_kv_events_received_total{source=\"zmq\"} ";
    let resyncs = "kvroute_router_kv_resyncs_total{source=\"zmq\"} ";
    let replays = "kvroute_router_kv_replays_total{source=\"zmq\"} ";
    let worker_replays = "kvroute_worker_kv_replays_total{worker_id=\"6\",";
    while metric(&gw, received) == 0.0 {
        publisher.send(batch_map(vec![removed_map(&[999])])).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let replays_before = metric(&gw, replays);

    // Blocks 0..8, then block 8..12 lost on the way, then 12..16: the gap is noticed at the
    // third, the publisher replays the second, and all four blocks are indexed in order.
    publisher
        .send(batch_array(vec![stored_array(&[101, 102], None, 0..8)]))
        .await;
    wait_for_blocks(&gw, worker, 2, "the first batch").await;
    publisher.lose(batch_map(vec![stored_map(&[103], Some(102), 8..12)]));
    publisher
        .send(batch_map(vec![stored_map(&[104], Some(103), 12..16)]))
        .await;
    wait_for_blocks(&gw, worker, 4, "the replayed and the live batch").await;
    // Nothing was cleared: the replay filled the gap before any event was applied.
    let key = assert_first_four_blocks_known(&gw, worker, (resyncs, 0.0), "the replay");
    assert_eq!(metric(&gw, replays), replays_before + 1.0);
    let per_worker = gw
        .metrics_text()
        .lines()
        .find(|l| l.starts_with(worker_replays))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap());
    assert_eq!(per_worker, Some(replays_before + 1.0));

    // Five batches lost: the buffer of four no longer reaches back to the first of them, so
    // the worker's blocks are cleared after all, and the live batch applied on a clean slate.
    for n in 0..5 {
        publisher.lose(batch_map(vec![removed_map(&[900 + n])]));
    }
    publisher
        .send(batch_array(vec![stored_array(&[201], None, 100..104)]))
        .await;
    wait_for("the resync", Duration::from_secs(5), || {
        metric(&gw, resyncs) == 1.0
    })
    .await;
    wait_for_blocks(&gw, worker, 1, "the post-resync state").await;
    assert_eq!(gw.dispatcher().overlaps(&key).get(worker), 0);
    assert_eq!(metric(&gw, replays), replays_before + 1.0);

    // The replay socket goes away: a gap falls back to a resync, the stream goes on.
    publisher.router.abort();
    publisher.lose(batch_map(vec![removed_map(&[1])]));
    publisher
        .send(batch_array(vec![stored_array(&[301], None, 200..204)]))
        .await;
    wait_for("the resync without replay", Duration::from_secs(10), || {
        metric(&gw, resyncs) == 2.0
    })
    .await;
    wait_for_blocks(&gw, worker, 1, "the state after the failed replay").await;
    gw.shutdown().await;
}

/// A worker whose `/info` offers a ZMQ stream with no replay socket but a whole-cache answer
/// (`/kv_state`, as a kvroute engine does), serving `state` there.
async fn snapshotting_worker(
    id: u64,
    events: &str,
    state: std::sync::Arc<std::sync::Mutex<Vec<u8>>>,
) -> std::net::SocketAddr {
    use axum::routing::get;
    let card = serde_json::json!({
        "worker": id, "instance": 1, "url": "", "model": MODEL, "block_size": BLOCK,
        "zmq_endpoint": events, "zmq_kv_state_path": "/kv_state", "returns_token_ids": true,
    });
    let app = axum::Router::new()
        .route("/info", get(move || async move { axum::Json(card) }))
        .route("/health", get(|| async { "ok" }))
        .route(
            "/kv_state",
            get(move || async move { state.lock().unwrap().clone() }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// A gap that no replay can fill is filled from the worker's snapshot of its whole cache: the
/// worker's blocks are cleared and restored from it, and the stream goes on after the batches
/// the snapshot covers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_no_replay_fills_is_filled_from_the_workers_cache_snapshot() {
    use kv_index::{BlockContent, EngineBlockId, StoredBlock};
    let mut socket = zeromq::PubSocket::new();
    let endpoint = socket.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
    let mut publisher = VllmPublisher { socket, seq: 0 };
    let worker = WorkerId(8);
    let snapshot = |blocks: &[(u64, std::ops::Range<u32>)], next_batch: u64| {
        let stored = vec![KvEventKind::Stored {
            parent: None,
            blocks: blocks
                .iter()
                .map(|(id, range)| StoredBlock {
                    id: EngineBlockId(*id),
                    content: BlockContent::Tokens(range.clone().collect()),
                })
                .collect(),
        }];
        let parts = protocol::state_parts(worker, 1, None, &stored);
        protocol::ZmqKvState { next_batch, parts }.encode()
    };
    // Nothing cached yet when the gateway subscribes.
    let state = std::sync::Arc::new(std::sync::Mutex::new(snapshot(&[], 0)));
    let http = snapshotting_worker(8, &endpoint, state.clone()).await;
    let gw = gateway(GatewayConfig {
        workers: vec![format!("http://{http}").parse::<WorkerSpec>().unwrap()],
        ..config()
    })
    .await;
    let replays = "kvroute_router_kv_replays_total{source=\"zmq\"} ";
    let resyncs = "kvroute_router_kv_resyncs_total{source=\"zmq\"} ";
    wait_for("the first snapshot", Duration::from_secs(5), || {
        metric(&gw, replays) == 1.0
    })
    .await;
    // The subscription may join after the first frames: send until one is in.
    while gw.dispatcher().cached_blocks(worker) == 0 {
        publisher.seq = 0;
        publisher
            .send(batch_array(vec![stored_array(&[101, 102], None, 0..8)]))
            .await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Batches 1 to 3 are lost and there is no replay socket: the worker's snapshot, which
    // covers them, fills the gap the live batch 4 reveals.
    *state.lock().unwrap() = snapshot(&[(101, 0..4), (102, 4..8), (103, 8..12)], 4);
    for _ in 0..3 {
        publisher.lose_one();
    }
    publisher
        .send(batch_map(vec![stored_map(&[104], Some(103), 12..16)]))
        .await;
    wait_for_blocks(&gw, worker, 4, "the snapshot and the live batch").await;
    // The gap cleared the worker's blocks (counted, as over NATS: the index must not claim
    // what the lost batches may have removed), and the snapshot gave them back.
    assert_first_four_blocks_known(&gw, worker, (resyncs, 1.0), "the snapshot");
    assert_eq!(metric(&gw, replays), 2.0);
    gw.shutdown().await;
}

/// The end-to-end path with kvroute's own engine, which offers vLLM's replay socket and its
/// whole cache (`/kv_state`): a gateway that starts after the engine has served requests
/// takes the engine's snapshot and routes on the cache the engine already holds. A gateway
/// told the same engine's event endpoint by flag (as for vLLM) starts cold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_gateway_replays_the_engines_buffer_instead_of_starting_cold() {
    let engine = start_engine(EngineServerConfig {
        zmq_pub: Some("tcp://127.0.0.1:0".into()),
        zmq_replay: Some("tcp://127.0.0.1:0".into()),
        ..engine_config(7)
    })
    .await;
    let card = engine.info();
    let events = card.zmq_endpoint.clone().expect("ZMQ events on");
    assert!(
        card.zmq_replay_endpoint.is_some(),
        "the card announces replay"
    );
    let worker = WorkerId(7);
    let completion = |prompt: std::ops::Range<u32>| {
        serde_json::json!({
            "model": MODEL,
            "prompt": prompt.collect::<Vec<u32>>(),
            "max_tokens": 2,
        })
    };
    // Served before any gateway subscribed: its KV events reached nobody.
    let early = 1000..1160;
    let (status, _, _) =
        post_json(&engine.url(), "/v1/completions", &completion(early.clone())).await;
    assert_eq!(status, 200);

    // One gateway reads the engine's /info (events and replay); the other is told only the
    // event endpoint.
    let replaying = gateway(gateway_config(&[&engine])).await;
    let cold = gateway(GatewayConfig {
        workers: vec![
            format!("{},zmq={events}", engine.url())
                .parse::<WorkerSpec>()
                .unwrap(),
        ],
        ..gateway_config(&[])
    })
    .await;
    // New requests make new batches; the first each gateway receives reveals how late it is.
    let received = "kvroute_router_kv_events_received_total{source=\"zmq\"} ";
    let mut next = 5000u32;
    while metric(&replaying, received) == 0.0 || metric(&cold, received) == 0.0 {
        let url = format!("http://{}", replaying.local_addr());
        let (status, _, _) = post_json(&url, "/v1/completions", &completion(next..next + 64)).await;
        assert_eq!(status, 200);
        next += 64;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let replays = "kvroute_router_kv_replays_total{source=\"zmq\"} ";
    wait_for("the replay", Duration::from_secs(5), || {
        metric(&replaying, replays) == 1.0
    })
    .await;

    let block = replaying.dispatcher().block_size();
    let early_blocks = (early.len() / block) as u32;
    let key = replaying
        .dispatcher()
        .key(&early.clone().collect::<Vec<u32>>());
    assert_eq!(
        replaying.dispatcher().overlaps(&key).get(worker),
        early_blocks,
        "the replaying gateway knows what the engine cached before it started"
    );
    let key = cold.dispatcher().key(&early.collect::<Vec<u32>>());
    assert_eq!(
        cold.dispatcher().overlaps(&key).get(worker),
        0,
        "cold start"
    );
    assert_eq!(metric(&cold, replays), 0.0);
    for gw in [&replaying, &cold] {
        assert_eq!(
            metric(gw, "kvroute_router_kv_resyncs_total{source=\"zmq\"} "),
            0.0
        );
    }
    cold.shutdown().await;
    shut_down(replaying, vec![engine]).await;
}

/// A `--worker` that crashes and comes back on its URL as a new run, announced over NATS: its
/// blocks are dropped once, at the announcement, and the new run's first batch neither drops
/// them again nor counts a second resync.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_static_workers_restart_announced_over_nats_clears_it_once() {
    use common::fake_worker::{FakeWorker, Script};
    use protocol::{WorkerAnnounce, WorkerCard, WorkerMessage};

    let nats = NatsServer::start();
    let worker = WorkerId(41);
    let card = |instance: u64| serde_json::json!({"worker": 41, "instance": instance, "block_size": BLOCK});
    let first = FakeWorker::start_with_info(Script::Complete { tokens: 1 }, Some(card(1))).await;
    let gw = gateway(GatewayConfig {
        nats_url: Some(nats.url()),
        namespace: "rs".into(),
        workers: vec![WorkerSpec::new(first.url())],
        ..config()
    })
    .await;
    let client = async_nats::connect(nats.url()).await.unwrap();
    let announce = |instance: u64| {
        let message = WorkerMessage::Announce(WorkerAnnounce {
            card: WorkerCard {
                worker: Some(worker),
                instance,
                url: first.url(),
                model: MODEL.into(),
                block_size: Some(BLOCK as u32),
                ..WorkerCard::default()
            },
            lease_ms: 60_000,
            token: None,
        });
        let client = client.clone();
        async move { publish_to(&client, "kvroute.rs.workers", message.encode().unwrap()).await }
    };
    let publish = |events: Vec<KvEvent>, instance: u64| {
        let client = client.clone();
        async move { publish_batch(&client, "kvroute.rs.kv.41", worker, instance, &events).await }
    };
    announce(1).await;
    publish(vec![stored(worker, 0, &tokens(0..8))], 1).await;
    wait_for_blocks(&gw, worker, 2, "the first run's blocks").await;
    let resyncs = "kvroute_router_kv_resyncs_total{source=\"nats\"} ";
    assert_eq!(metric(&gw, resyncs), 0.0);

    // A crash (no goodbye), then a new run on the same URL.
    let addr = first.addr;
    first.kill();
    let _second = FakeWorker::start_at(addr, Script::Complete { tokens: 1 }, Some(card(2))).await;
    announce(2).await;
    wait_for_blocks(&gw, worker, 0, "the restart's clear").await;
    publish(vec![stored(worker, 0, &tokens(300..304))], 2).await;
    wait_for_blocks(&gw, worker, 1, "the new run's first block").await;
    assert_eq!(metric(&gw, resyncs), 1.0, "one restart, one resync");
    assert_eq!(
        gw.dispatcher().routable_workers(),
        vec![worker],
        "the flag's worker stays"
    );
    gw.shutdown().await;
}
