//! Shared by the engine server's tests: a real nats-server subprocess, engines on port 0, SSE
//! reading.

#![allow(dead_code)]

use std::time::{Duration, Instant};

use engine_server::{EngineServer, EngineServerConfig, EngineServerHandle};
use protocol::sse::{SseDecoder, SseEvent};
use serde_json::Value;

// The gateway's tests' nats-server harness, shared rather than copied.
#[path = "../../../gateway/tests/common/nats.rs"]
mod nats;
#[allow(unused_imports)] // Not every test binary starts a nats-server.
pub use nats::NatsServer;

pub const MODEL: &str = "llama-3.1-70b-instruct";

/// A fast engine: seed 002's worker at `speedup`.
pub fn config(speedup: f64) -> EngineServerConfig {
    let mut config = EngineServerConfig::new();
    config.speedup = speedup;
    config
}

/// Starts a server; returns it and its base URL.
pub async fn start(config: EngineServerConfig) -> (EngineServerHandle, String) {
    let server = EngineServer::bind(config)
        .await
        .expect("engine server starts");
    let base = server.url();
    (server, base)
}

pub fn client() -> reqwest::Client {
    reqwest::Client::new()
}

/// POSTs `body` as JSON to `{base}{path}`.
pub async fn post(base: &str, path: &str, body: &Value) -> reqwest::Response {
    client()
        .post(format!("{base}{path}"))
        .json(body)
        .send()
        .await
        .expect("request sent")
}

/// POSTs `body` as JSON and checks the server took it (200).
pub async fn post_ok(base: &str, path: &str, body: &Value) -> reqwest::Response {
    let response = post(base, path, body).await;
    assert_eq!(response.status(), 200, "{path} refused {body}");
    response
}

/// POSTs `body` as JSON and reads the JSON answer, whatever its status.
pub async fn post_json(base: &str, path: &str, body: &Value) -> Value {
    post(base, path, body)
        .await
        .json()
        .await
        .expect("JSON body")
}

/// GETs `url` and reads the body as text.
pub async fn get_text(url: &str) -> String {
    let response = client().get(url).send().await.expect("request sent");
    response.text().await.expect("body read")
}

/// GETs `url` and reads the body as JSON.
pub async fn get_json<T: serde::de::DeserializeOwned>(url: &str) -> T {
    let response = client().get(url).send().await.expect("request sent");
    response.json().await.expect("JSON body")
}

/// Reads a whole SSE body into its `data` payloads (JSON values), checking it ends with
/// `[DONE]`.
pub async fn read_sse(response: reqwest::Response) -> Vec<serde_json::Value> {
    let mut decoder = SseDecoder::default();
    let mut events = Vec::new();
    let mut done = false;
    let mut stream = response.bytes_stream();
    use futures::StreamExt;
    while let Some(chunk) = stream.next().await {
        decoder.push(&chunk.unwrap()).unwrap();
        while let Some(event) = decoder.next_event() {
            assert!(!done, "data after [DONE]");
            match event {
                SseEvent::Data(data) => events.push(serde_json::from_str(data).unwrap()),
                SseEvent::Done => done = true,
            }
        }
    }
    assert!(done, "stream ended without [DONE]");
    events
}

/// Polls `/metrics` until `name` reads `value`, or panics after `timeout`.
pub async fn wait_for_metric(base: &str, name: &str, value: f64, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    loop {
        let now = metric(base, name).await;
        if now == Some(value) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "metric {name} stayed at {now:?} for {timeout:?}, not {value}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The value of the first sample of metric `name` (labels ignored).
pub async fn metric(base: &str, name: &str) -> Option<f64> {
    get_text(&format!("{base}/metrics"))
        .await
        .lines()
        .filter(|line| !line.starts_with('#'))
        .find(|line| {
            line.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .and_then(|line| line.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}
