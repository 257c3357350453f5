//! A gateway that starts after its engines cached blocks learns those blocks: a real
//! nats-server, three `kvroute engine` processes publishing KV events and registering over
//! NATS, a gateway that routes first turns and is SIGKILLed, and a fresh gateway that must
//! route every second turn back to the engine holding its history.
//!
//! Without the engines' cache snapshots (`protocol::kv_state`) the fresh gateway's index
//! would never hold the first turns' blocks (they are not stored again), nor any block stored
//! on top of them (its parent unknown), so it would route blind: each second turn would find
//! its history with probability 1/3. A gap in a worker's stream, which clears its blocks,
//! is filled the same way.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

mod common;

use common::{Server, get_text, nats_engine, nats_gateway, wait_routable};

#[path = "../../gateway/tests/common/nats.rs"]
mod nats;
use nats::NatsServer;

const NAMESPACE: &str = "restart";

fn engine(nats: &NatsServer, id: u32) -> Server {
    nats_engine(&nats.url(), NAMESPACE, id, 20, &[])
}

fn gateway(nats: &NatsServer) -> Server {
    nats_gateway(&nats.url(), NAMESPACE, &[])
}

/// `kvroute_worker_cached_blocks` per `worker_id`: what the gateway's index holds.
async fn indexed_blocks(gateway: &str) -> BTreeMap<String, u64> {
    let text = get_text(&format!("{gateway}/metrics")).await;
    text.lines()
        .filter_map(|l| l.strip_prefix("kvroute_worker_cached_blocks{"))
        .filter_map(|rest| {
            let id = rest.split("worker_id=\"").nth(1)?.split('"').next()?;
            let value = rest.rsplit(' ').next()?.parse().ok()?;
            Some((id.to_string(), value))
        })
        .collect()
}

async fn chat(client: &reqwest::Client, gateway: &str, messages: &Value) -> Value {
    let response = client
        .post(format!("{gateway}/v1/chat/completions"))
        .json(&json!({"model": "llama-3.1-70b-instruct", "messages": messages, "max_tokens": 12}))
        .send()
        .await
        .expect("the gateway answers");
    let status = response.status();
    let reply: Value = response.json().await.expect("JSON");
    assert!(status.is_success(), "{status}: {reply}");
    reply
}

/// A long first message, distinct per conversation, so its history spans many blocks.
fn opening(conversation: usize) -> String {
    (0..120)
        .map(|i| format!("item {conversation}-{i} of the ledger"))
        .collect::<Vec<_>>()
        .join(", ")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_gateway_learns_what_engines_cached_before_it_started_or_across_a_gap() {
    let nats = NatsServer::start();
    let engines: Vec<Server> = (1..=3).map(|id| engine(&nats, id)).collect();
    let client = reqwest::Client::new();

    let first = gateway(&nats);
    wait_routable(&first.url, 3, Duration::from_secs(20)).await;
    let conversations = 6;
    let mut histories = Vec::new();
    for c in 0..conversations {
        let messages = json!([{"role": "user", "content": opening(c)}]);
        let reply = chat(&client, &first.url, &messages).await;
        let prompt = reply["usage"]["prompt_tokens"].as_u64().unwrap();
        let answer = reply["choices"][0]["message"]["content"].clone();
        histories.push((messages, answer, prompt));
    }
    // Wait until the first gateway has applied every event, then remember its view.
    let mut before = indexed_blocks(&first.url).await;
    let settled = Instant::now() + Duration::from_secs(10);
    loop {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let now = indexed_blocks(&first.url).await;
        if now == before && now.values().sum::<u64>() > 0 {
            break;
        }
        assert!(Instant::now() < settled, "the index never settled: {now:?}");
        before = now;
    }
    first.signal(libc::SIGKILL);
    drop(first);

    // A fresh gateway: nothing is stored again while it starts, so only the engines'
    // snapshots can tell it what they hold.
    let fresh = gateway(&nats);
    wait_routable(&fresh.url, 3, Duration::from_secs(20)).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let now = indexed_blocks(&fresh.url).await;
        if now == before {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the fresh gateway's index is {now:?}, the engines hold {before:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let metrics = get_text(&format!("{}/metrics", fresh.url)).await;
    assert!(
        metrics.contains("kvroute_router_kv_replays_total{source=\"nats\"} 3\n"),
        "one snapshot per engine:\n{metrics}"
    );

    // A gap in one worker's stream (a batch far ahead of the last, as after lost messages)
    // clears its blocks; its snapshot brings them back, and the forged block goes with the
    // clear.
    let (worker, blocks) = before
        .iter()
        .max_by_key(|(_, blocks)| **blocks)
        .map(|(w, b)| (w.clone(), *b))
        .unwrap();
    let engine = &engines[worker.parse::<usize>().unwrap() - 1];
    let instance = common::get_json(&format!("{}/info", engine.url)).await["instance"]
        .as_u64()
        .expect("the engine's card has its instance");
    let forged = protocol::KvEventBatch {
        worker: worker.parse().unwrap(),
        instance,
        events: vec![protocol::WireKvEvent {
            seq: 1 << 40,
            kind: protocol::WireKvKind::Stored {
                parent: None,
                blocks: vec![protocol::WireBlock {
                    id: 1,
                    tokens: None,
                    local_hash: Some(1),
                }],
            },
        }],
    };
    let publisher = async_nats::connect(nats.url()).await.expect("NATS");
    publisher
        .publish(
            format!("kvroute.{NAMESPACE}.kv.{worker}"),
            forged.encode().into(),
        )
        .await
        .expect("published");
    publisher.flush().await.expect("flushed");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let metrics = get_text(&format!("{}/metrics", fresh.url)).await;
        let restored = metrics.contains("kvroute_router_kv_replays_total{source=\"nats\"} 4\n");
        let resynced = metrics.contains("kvroute_router_kv_resyncs_total{source=\"nats\"} 1\n");
        if restored && resynced && indexed_blocks(&fresh.url).await[&worker] == blocks {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "worker {worker} after a gap: {:?} blocks (engine: {blocks}), restored {restored}, resynced {resynced}",
            indexed_blocks(&fresh.url).await
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Every second turn goes back to its history.
    for (c, (messages, answer, first_prompt)) in histories.into_iter().enumerate() {
        let mut messages = messages.as_array().unwrap().clone();
        messages.push(json!({"role": "assistant", "content": answer}));
        messages.push(json!({"role": "user", "content": "And the total?"}));
        let reply = chat(&client, &fresh.url, &Value::Array(messages)).await;
        let cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0);
        assert!(
            cached + 64 >= first_prompt,
            "conversation {c}: {cached} of its {first_prompt} history tokens cached: {reply}"
        );
    }
}
