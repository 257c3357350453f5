//! Helpers shared by the gateway's integration tests: real engine servers, a real
//! nats-server, and an OpenAI client that checks the stream format as it reads.

#![allow(dead_code)]

pub mod fake_worker;
pub mod nats;

use std::time::{Duration, Instant};

use engine_server::{EngineServer, EngineServerConfig, EngineServerHandle, NatsConfig};
use gateway::{Gateway, GatewayConfig, WorkerSpec};
use kv_index::WorkerId;
use serde_json::{Value, json};

pub const MODEL: &str = "llama-3.1-70b-instruct";

/// An engine server (seed 002's H200 worker) 200× faster than real time.
pub async fn engine(id: u64, nats: Option<(&str, &str)>) -> EngineServerHandle {
    let mut config = EngineServerConfig::new();
    config.worker_id = WorkerId(id);
    config.speedup = 200.0;
    config.seed = id;
    config.model = MODEL.to_string();
    config.nats = nats.map(|(url, namespace)| NatsConfig {
        url: url.to_string(),
        namespace: namespace.to_string(),
        lease_ms: 1_000,
    });
    EngineServer::bind(config)
        .await
        .expect("engine server starts")
}

/// A gateway config on a free port for `workers`.
pub fn gateway_config(workers: &[&EngineServerHandle]) -> GatewayConfig {
    GatewayConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        model: MODEL.to_string(),
        workers: workers.iter().map(|w| WorkerSpec::new(w.url())).collect(),
        health_interval: Duration::from_millis(200),
        probe_timeout: Duration::from_millis(500),
        ..GatewayConfig::default()
    }
}

pub async fn gateway(config: GatewayConfig) -> Gateway {
    Gateway::bind(config).await.expect("gateway starts")
}

/// Polls `condition` every 20 ms for up to `timeout`.
pub async fn wait_for(what: &str, timeout: Duration, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !condition() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A streamed response, read to its end with its format checked on the way: every event is
/// `data: <json>` or `data: [DONE]`, and `[DONE]` comes last.
#[derive(Debug)]
pub struct Streamed {
    pub status: u16,
    pub worker: Option<u64>,
    pub chunks: Vec<Value>,
    pub done: bool,
}

impl Streamed {
    /// The generated text (chat deltas or completion texts of choice 0).
    pub fn text(&self) -> String {
        self.chunks
            .iter()
            .filter_map(|c| c["choices"].get(0))
            .filter_map(|c| c["delta"]["content"].as_str().or(c["text"].as_str()))
            .collect()
    }

    pub fn usage(&self) -> Option<&Value> {
        self.chunks
            .iter()
            .find_map(|c| c.get("usage").filter(|u| !u.is_null()))
    }

    pub fn error(&self) -> Option<&Value> {
        self.chunks.iter().find_map(|c| c.get("error"))
    }
}

pub async fn post_stream(url: &str, path: &str, body: &Value) -> Streamed {
    let response = reqwest::Client::new()
        .post(format!("{url}{path}"))
        .json(body)
        .send()
        .await
        .expect("request sent");
    let status = response.status().as_u16();
    let worker = response
        .headers()
        .get("x-kvroute-worker")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok());
    let text = response.text().await.expect("body read");
    if status != 200 {
        // An error before the stream started: OpenAI error JSON, not SSE.
        return Streamed {
            status,
            worker,
            chunks: vec![serde_json::from_str(&text).expect("error JSON")],
            done: false,
        };
    }
    let mut chunks = Vec::new();
    let mut done = false;
    for event in text.split("\n\n").filter(|e| !e.is_empty()) {
        assert!(!done, "an event after [DONE]: {event:?}\n{text}");
        let data = event
            .strip_prefix("data: ")
            .unwrap_or_else(|| panic!("not a data event: {event:?}"));
        if data == "[DONE]" {
            done = true;
        } else {
            chunks.push(serde_json::from_str(data).expect("chunk is JSON"));
        }
    }
    Streamed {
        status,
        worker,
        chunks,
        done,
    }
}

pub async fn post_json(url: &str, path: &str, body: &Value) -> (u16, Option<u64>, Value) {
    let response = reqwest::Client::new()
        .post(format!("{url}{path}"))
        .json(body)
        .send()
        .await
        .expect("request sent");
    let status = response.status().as_u16();
    let worker = response
        .headers()
        .get("x-kvroute-worker")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok());
    let body = response.json().await.expect("JSON body");
    (status, worker, body)
}

/// A long system prompt: a distinct excerpt of the shipped corpus per conversation, `words`
/// words.
pub fn passage(conversation: usize, words: usize) -> String {
    let excerpt = text::Corpus::builtin().excerpt(conversation * 997, words);
    format!("Passage {conversation}. {excerpt}")
}

/// A chat request body.
pub fn chat(messages: &[(&str, &str)], max_tokens: u32, stream: bool) -> Value {
    let messages: Vec<Value> = messages
        .iter()
        .map(|(role, content)| json!({"role": role, "content": content}))
        .collect();
    json!({
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "ignore_eos": true,
        "stream": stream,
        "stream_options": {"include_usage": true},
    })
}
