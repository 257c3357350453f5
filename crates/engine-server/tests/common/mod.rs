//! Shared by the engine server's tests: a real nats-server subprocess, engines on port 0, SSE
//! reading.

#![allow(dead_code)]

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use engine_server::{EngineServer, EngineServerConfig, EngineServerHandle};
use protocol::sse::{SseDecoder, SseEvent};

pub const MODEL: &str = "llama-3.1-70b-instruct";

/// A nats-server on a free port, killed on drop.
pub struct NatsServer {
    child: Child,
    pub url: String,
}

fn nats_binary() -> PathBuf {
    if let Ok(path) = std::env::var("NATS_SERVER_BIN") {
        return PathBuf::from(path);
    }
    let in_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join("nats-server"))
            .find(|candidate| candidate.is_file())
    });
    in_path
        .or_else(|| {
            ["/usr/sbin/nats-server", "/usr/local/bin/nats-server"]
                .into_iter()
                .map(PathBuf::from)
                .find(|p| p.is_file())
        })
        .unwrap_or_else(|| {
            panic!("nats-server not found: install nats-server (apt-get install nats-server)")
        })
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl NatsServer {
    pub fn start() -> NatsServer {
        let binary = nats_binary();
        let port = free_port();
        let child = Command::new(&binary)
            .args(["-a", "127.0.0.1", "-p", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot run {}: {e}; install nats-server (apt-get install nats-server)",
                    binary.display()
                )
            });
        let server = NatsServer {
            child,
            url: format!("nats://127.0.0.1:{port}"),
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "nats-server did not accept connections within 10 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        server
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A fast engine: seed 002's worker at `speedup`.
pub fn config(speedup: f64) -> EngineServerConfig {
    let mut config = EngineServerConfig::new();
    config.speedup = speedup;
    config
}

pub async fn start(config: EngineServerConfig) -> EngineServerHandle {
    EngineServer::bind(config)
        .await
        .expect("engine server starts")
}

pub fn client() -> reqwest::Client {
    reqwest::Client::new()
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

/// Polls `/metrics` until `name`'s value satisfies `ok`, or panics after `timeout`.
pub async fn wait_for_metric(
    base: &str,
    name: &str,
    timeout: Duration,
    ok: impl Fn(f64) -> bool,
) -> f64 {
    let deadline = Instant::now() + timeout;
    loop {
        let value = metric(base, name).await;
        if value.is_some_and(&ok) {
            return value.unwrap();
        }
        assert!(
            Instant::now() < deadline,
            "metric {name} stayed at {value:?} for {timeout:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The value of the first sample of metric `name` (labels ignored).
pub async fn metric(base: &str, name: &str) -> Option<f64> {
    let text = client()
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .find(|line| {
            line.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .and_then(|line| line.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}
