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

/// Worker `id`, an engine server (seed 002's H200 worker) serving `MODEL` 200× faster than
/// real time.
pub fn engine_config(id: u64) -> EngineServerConfig {
    EngineServerConfig {
        worker_id: WorkerId(id),
        speedup: 200.0,
        seed: id,
        model: MODEL.to_string(),
        ..EngineServerConfig::new()
    }
}

pub async fn start_engine(config: EngineServerConfig) -> EngineServerHandle {
    EngineServer::bind(config)
        .await
        .expect("engine server starts")
}

/// Worker 0 at `speedup` instead: slow enough for a request to hold its slot a while.
pub async fn slow_engine(speedup: f64) -> EngineServerHandle {
    start_engine(EngineServerConfig {
        speedup,
        ..engine_config(0)
    })
    .await
}

/// Worker `id` (see [`engine_config`]), announcing itself on `nats` (url, namespace) if given.
pub async fn engine(id: u64, nats: Option<(&str, &str)>) -> EngineServerHandle {
    start_engine(EngineServerConfig {
        nats: nats.map(|(url, namespace)| NatsConfig {
            url: url.to_string(),
            namespace: namespace.to_string(),
            lease_ms: 1_000,
            registration_token: None,
            security: Default::default(),
        }),
        ..engine_config(id)
    })
    .await
}

/// Workers `ids` (see [`engine`]).
pub async fn engines(
    ids: std::ops::RangeInclusive<u64>,
    nats: Option<(&str, &str)>,
) -> Vec<EngineServerHandle> {
    let mut engines = Vec::new();
    for id in ids {
        engines.push(engine(id, nats).await);
    }
    engines
}

/// Stops the gateway, then the engines behind it.
pub async fn shut_down(gw: Gateway, engines: Vec<EngineServerHandle>) {
    gw.shutdown().await;
    for engine in engines {
        engine.shutdown().await;
    }
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

/// A gateway config for `workers` that routes round robin, so a test knows which worker
/// serves which request.
pub fn round_robin(workers: Vec<WorkerSpec>) -> GatewayConfig {
    GatewayConfig {
        workers,
        router: router::RouterConfig {
            policy: router::PolicyKind::RoundRobin,
            ..Default::default()
        },
        ..gateway_config(&[])
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

/// POSTs `body` as JSON; returns the status, the worker the gateway says served it
/// (`x-kvroute-worker`), and the response.
async fn post(url: &str, path: &str, body: &Value) -> (u16, Option<u64>, reqwest::Response) {
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
    (status, worker, response)
}

pub async fn post_stream(url: &str, path: &str, body: &Value) -> Streamed {
    let (status, worker, response) = post(url, path, body).await;
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
    let (status, worker, response) = post(url, path, body).await;
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

/// Streams a chat of `history`'s (role, content) messages.
pub async fn stream_chat(url: &str, history: &[(&str, String)], max_tokens: u32) -> Streamed {
    let messages: Vec<(&str, &str)> = history.iter().map(|(r, c)| (*r, c.as_str())).collect();
    post_stream(
        url,
        "/v1/chat/completions",
        &chat(&messages, max_tokens, true),
    )
    .await
}

/// A short chat ("hi", 4 tokens), streamed: the request of tests about where requests go.
pub async fn short_chat_stream(url: &str) -> Streamed {
    let request = chat(&[("user", "hi")], 4, true);
    post_stream(url, "/v1/chat/completions", &request).await
}

/// The same short chat, not streamed.
pub async fn short_chat_json(url: &str) -> (u16, Option<u64>, Value) {
    let request = chat(&[("user", "hi")], 4, false);
    post_json(url, "/v1/chat/completions", &request).await
}
