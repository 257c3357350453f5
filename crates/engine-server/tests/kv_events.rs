//! KV events leave the engine server over a real nats-server (our format, with worker
//! registration) and a real ZMQ PUB socket (vLLM's format, with vLLM's replay socket), and
//! rebuild, in a `KvIndex` on the receiving side, exactly the prefix the engine cached.

mod common;

use std::time::Duration;

use common::{MODEL, NatsServer, config, post, post_json, start};
use futures::StreamExt;
use kv_index::{BlockHasher, IndexConfig, KvIndex, WorkerId};
use protocol::vllm::{VllmEventStream, decode_multipart};
use protocol::{KvEventBatch, Subjects, WorkerMessage};
use serde_json::{Value, json};
use zeromq::{Socket, SocketRecv};

/// What one chat turn must leave in an index rebuilt from a worker's KV events.
struct Expected {
    worker: WorkerId,
    hasher: BlockHasher,
    /// The turn's prompt and reply tokens.
    sequence: Vec<u32>,
    /// Blocks the engine computed for them: all but the last output token, whole blocks.
    blocks: u32,
}

impl Expected {
    /// Sends one chat turn to `worker` (32-token blocks).
    async fn after_turn(base: &str, worker: WorkerId, question: &str) -> Expected {
        let messages = json!([
            {"role": "system", "content": "You are a concise assistant for infrastructure engineers."},
            {"role": "user", "content": question}
        ]);
        let prompt = post_json(base, "/tokenize", &json!({"messages": messages})).await;
        let response = post_json(
            base,
            "/v1/chat/completions",
            &json!({"model": MODEL, "messages": messages, "max_tokens": 120,
                    "ignore_eos": true, "return_token_ids": true}),
        )
        .await;
        let ids = |v: &Value| -> Vec<u32> {
            v.as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap() as u32)
                .collect()
        };
        let mut sequence = ids(&prompt["tokens"]);
        sequence.extend(ids(&response["choices"][0]["token_ids"]));
        Expected {
            worker,
            hasher: BlockHasher::new(32).unwrap(),
            blocks: ((sequence.len() - 1) / 32) as u32,
            sequence,
        }
    }

    /// Blocks of the turn that `index` holds for the worker.
    fn cached(&self, index: &KvIndex) -> u32 {
        index
            .find_matches_for_tokens(&self.hasher, &self.sequence)
            .get(self.worker)
    }
}

#[tokio::test]
async fn nats_events_rebuild_the_engines_cache_and_registration_has_a_lease() {
    let nats = NatsServer::start();
    let subjects = Subjects::new("kvtest").unwrap();
    let observer = async_nats::connect(nats.url()).await.unwrap();
    let mut kv = observer.subscribe(subjects.kv_events_all()).await.unwrap();
    let mut workers = observer.subscribe(subjects.workers()).await.unwrap();
    observer.flush().await.unwrap();

    let mut cfg = config(500.0);
    cfg.worker_id = WorkerId(7);
    cfg.nats = Some(engine_server::NatsConfig {
        url: nats.url(),
        namespace: "kvtest".into(),
        lease_ms: 300,
        registration_token: None,
        security: Default::default(),
    });
    let (server, base) = start(cfg).await;
    assert_eq!(
        server.info().nats_kv_subject.as_deref(),
        Some("kvroute.kvtest.kv.7")
    );

    // Announcements, repeated within the lease.
    for _ in 0..2 {
        let message = tokio::time::timeout(Duration::from_secs(5), workers.next())
            .await
            .expect("an announcement within the lease")
            .unwrap();
        let WorkerMessage::Announce(announce) = WorkerMessage::decode(&message.payload).unwrap()
        else {
            panic!("expected an announcement")
        };
        assert_eq!(announce.card.worker, Some(WorkerId(7)));
        assert_eq!(announce.card.url, base);
        assert_eq!(announce.card.model, MODEL);
        assert_eq!(announce.card.block_size, Some(32));
        assert_eq!(announce.lease_ms, 300);
        assert_eq!(
            announce.card.nats_kv_subject.as_deref(),
            Some("kvroute.kvtest.kv.7")
        );
        assert_eq!(announce.card.instance, server.info().instance);
        assert_eq!(
            &announce.card,
            server.info(),
            "the announcement carries the /info card"
        );
    }

    let expected = Expected::after_turn(
        &base,
        WorkerId(7),
        "How do KV events keep a router's index fresh?",
    )
    .await;
    let mut index = KvIndex::new(IndexConfig::default());
    let mut next_seq = 0;
    while expected.cached(&index) < expected.blocks {
        let message = tokio::time::timeout(Duration::from_secs(5), kv.next())
            .await
            .expect("KV events arrive")
            .unwrap();
        assert_eq!(
            subjects.parse_kv_events(&message.subject),
            Some(WorkerId(7))
        );
        let batch = KvEventBatch::decode(&message.payload).unwrap();
        assert_eq!(batch.instance, server.info().instance);
        for event in batch.to_kv_events().unwrap() {
            assert_eq!(event.seq, next_seq, "no gap, no reorder");
            next_seq += 1;
            // Our engine server attaches tokens, so the index hashes them itself.
            if let kv_index::KvEventKind::Stored { blocks, .. } = &event.kind {
                assert!(blocks.iter().all(
                    |b| matches!(b.content, kv_index::BlockContent::Tokens(ref t) if t.len() == 32)
                ));
            }
            index.apply(&event).unwrap();
        }
    }
    assert_eq!(expected.cached(&index), expected.blocks);

    // A clean shutdown says goodbye.
    server.shutdown().await;
    let goodbye = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            let message = workers.next().await.unwrap();
            if let WorkerMessage::Goodbye { worker, .. } =
                WorkerMessage::decode(&message.payload).unwrap()
            {
                return worker;
            }
        }
    })
    .await
    .expect("a goodbye");
    assert_eq!(goodbye, 7);
}

#[tokio::test]
async fn zmq_frames_in_vllm_format_rebuild_the_engines_cache() {
    let mut cfg = config(500.0);
    cfg.worker_id = WorkerId(3);
    cfg.zmq_pub = Some("tcp://127.0.0.1:0".into());
    let (server, base) = start(cfg).await;
    let endpoint = server.info().zmq_endpoint.clone().unwrap();
    assert!(endpoint.starts_with("tcp://127.0.0.1:") && !endpoint.ends_with(":0"));

    let mut sub = zeromq::SubSocket::new();
    sub.connect(&endpoint).await.unwrap();
    sub.subscribe("").await.unwrap();
    // PUB drops messages until the subscription has reached it: warm up with short requests
    // until a frame arrives.
    let mut first = None;
    for attempt in 0..50u32 {
        let prompt: Vec<u32> = (0..40).map(|t| t + attempt * 1000).collect();
        post(
            &base,
            "/v1/completions",
            &json!({"model": MODEL, "prompt": prompt, "max_tokens": 2, "ignore_eos": true}),
        )
        .await;
        if let Ok(message) = tokio::time::timeout(Duration::from_millis(200), sub.recv()).await {
            first = Some(message.unwrap());
            break;
        }
    }
    let first = first.expect("the subscription reaches the publisher");

    let mut index = KvIndex::new(IndexConfig::default());
    let mut stream = VllmEventStream::new(WorkerId(3), 32);
    let mut next_seq = None;
    let mut apply = |message: zeromq::ZmqMessage, index: &mut KvIndex| {
        let parts: Vec<Vec<u8>> = message.into_vec().into_iter().map(|b| b.to_vec()).collect();
        assert_eq!(parts.len(), 3, "(topic, seq, payload)");
        let frame = decode_multipart(&parts).unwrap();
        if let Some(expected) = next_seq {
            assert_eq!(frame.seq, expected, "consecutive batch sequence numbers");
        }
        next_seq = Some(frame.seq + 1);
        assert_eq!(frame.batch.data_parallel_rank, Some(0));
        let accepted = stream.accept(&frame).unwrap();
        assert!(
            !accepted.continuity.needs_clear(),
            "{:?}",
            accepted.continuity
        );
        for event in accepted.events {
            index.apply(&event).unwrap();
        }
    };
    apply(first, &mut index);

    let expected =
        Expected::after_turn(&base, WorkerId(3), "What does a ZMQ KV event carry?").await;
    while expected.cached(&index) < expected.blocks {
        let message = tokio::time::timeout(Duration::from_secs(5), sub.recv())
            .await
            .expect("ZMQ frames arrive")
            .unwrap();
        apply(message, &mut index);
    }
    assert_eq!(expected.cached(&index), expected.blocks);
    server.shutdown().await;
}

/// Asks the engine's replay socket for its batches from `start` on, as a DEALER: every frame
/// up to the end marker.
async fn replay_from(endpoint: &str, start: u64) -> Vec<protocol::vllm::VllmFrame> {
    use protocol::vllm::{ReplayReply, decode_replay_reply, encode_replay_request};
    use zeromq::SocketSend;
    let mut dealer = zeromq::DealerSocket::new();
    dealer.connect(endpoint).await.unwrap();
    let request: Vec<bytes::Bytes> = encode_replay_request(start)
        .into_iter()
        .map(bytes::Bytes::from)
        .collect();
    dealer
        .send(zeromq::ZmqMessage::try_from(request).unwrap())
        .await
        .unwrap();
    let mut frames = Vec::new();
    loop {
        let message = tokio::time::timeout(Duration::from_secs(5), dealer.recv())
            .await
            .expect("the replay answers")
            .unwrap();
        match decode_replay_reply(&message.into_vec()).unwrap() {
            ReplayReply::Frame(frame) => frames.push(frame),
            ReplayReply::End => return frames,
        }
    }
}

#[tokio::test]
async fn the_replay_socket_answers_from_its_ring_in_order_with_an_end_marker() {
    let mut cfg = config(500.0);
    cfg.worker_id = WorkerId(4);
    cfg.zmq_pub = Some("tcp://127.0.0.1:0".into());
    cfg.zmq_replay = Some("tcp://127.0.0.1:0".into());
    cfg.zmq_replay_buffer = 1000;
    let (server, base) = start(cfg).await;
    let replay = server.info().zmq_replay_endpoint.clone().unwrap();
    assert!(replay.starts_with("tcp://127.0.0.1:") && !replay.ends_with(":0"));

    // Nobody subscribes: the live frames reach no one, the ring keeps them.
    let expected = Expected::after_turn(&base, WorkerId(4), "What does a replay send?").await;
    let mut frames = Vec::new();
    let mut complete = false;
    for _ in 0..100 {
        frames = replay_from(&replay, 0).await;
        let mut index = KvIndex::new(IndexConfig::default());
        let mut stream = VllmEventStream::new(WorkerId(4), 32);
        for frame in &frames {
            for event in stream.accept(frame).unwrap().events {
                index.apply(&event).unwrap();
            }
        }
        complete = expected.cached(&index) == expected.blocks;
        if complete {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(complete, "the replayed batches rebuild the engine's cache");
    let seqs: Vec<u64> = frames.iter().map(|f| f.seq).collect();
    assert_eq!(
        seqs,
        (0..frames.len() as u64).collect::<Vec<_>>(),
        "in order from 0"
    );
    assert!(!frames.is_empty());
    // From the middle: only the rest; past the end: just the end marker.
    let last = frames.len() as u64 - 1;
    let tail = replay_from(&replay, last).await;
    assert_eq!(tail.iter().map(|f| f.seq).collect::<Vec<_>>(), [last]);
    assert_eq!(tail[0].batch, frames[last as usize].batch);
    assert!(replay_from(&replay, last + 100).await.is_empty());
    server.shutdown().await;
}
