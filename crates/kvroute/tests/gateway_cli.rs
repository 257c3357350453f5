//! `kvroute gateway` as an operator runs it: flags and help, real `kvroute engine`
//! processes behind it, one of them killed mid-stream, registration over a real nats-server,
//! and a graceful stop on SIGTERM.

use std::process::Stdio;
use std::time::{Duration, Instant};

use common::{Running, Server, failure, get_json, get_text, kvroute};
use futures::StreamExt;
mod common;
// The gateway's tests' nats-server harness, shared rather than copied.
#[path = "../../gateway/tests/common/nats.rs"]
mod nats;
use nats::NatsServer;
use serde_json::{Value, json};

fn chat(content: &str, max_tokens: u32) -> Value {
    json!({
        "model": "llama-3.1-70b-instruct",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "ignore_eos": true,
        "stream": true,
    })
}

/// Streams a one-message chat through the gateway at `url`; the response (status 200 checked)
/// and the worker that served it (`x-kvroute-worker`).
async fn stream_chat(url: &str, content: &str, max_tokens: u32) -> (reqwest::Response, usize) {
    let response = reqwest::Client::new()
        .post(format!("{url}/v1/chat/completions"))
        .json(&chat(content, max_tokens))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let worker = response.headers()["x-kvroute-worker"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    (response, worker)
}

async fn health(url: &str) -> Value {
    get_json(&format!("{url}/health")).await
}

async fn wait_health(url: &str, routable: u64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while health(url).await["routable_workers"] != routable {
        assert!(
            Instant::now() < deadline,
            "never {routable} routable workers: {}",
            health(url).await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `kvroute engine` workers 1 and 2 on free ports, with `args`.
fn engines(args: &[&str]) -> Vec<Server> {
    (1..=2)
        .map(|id| {
            let id = id.to_string();
            Server::start(&[&["engine", "--port", "0", "--worker-id", &id], args].concat())
        })
        .collect()
}

#[test]
fn help_lists_router_modes_defaults_and_dynamo_variables() {
    let out = kvroute().args(["gateway", "--help"]).output().unwrap();
    assert!(out.status.success());
    let help = String::from_utf8(out.stdout).unwrap();
    for needle in [
        "--router-mode",
        "[env: DYN_ROUTER_MODE=]",
        "[default: kv_load]",
        "kv_load",
        "round_robin",
        "random",
        "--kv-block-size",
        "[env: DYN_KV_CACHE_BLOCK_SIZE=]",
        "Default: the block size the workers declare",
        "--kv-overlap-score-weight",
        "--router-temperature",
        "--no-kv-events",
        "--worker",
        "--nats",
        "--max-request-bytes",
        "--max-response-bytes",
        "--connect-timeout",
        "--first-byte-timeout",
        "--stall-timeout",
        "--migration-limit",
        "--ejection-time",
        "--header-timeout",
        "--body-timeout",
        "--queue-capacity",
        "--tokenizer-config",
    ] {
        assert!(help.contains(needle), "help lacks {needle}:\n{help}");
    }
}

#[test]
fn bad_flags_fail_with_a_message_that_says_what_to_do() {
    let run = |args: &[&str]| failure(&[&["gateway"], args].concat());
    let err = run(&["--router-mode", "cheapest"]);
    assert!(err.contains("round_robin") && err.contains("kv"), "{err}");
    let err = run(&["--worker", "localhost:8000"]);
    assert!(err.contains("http://"), "{err}");
    let err = run(&["--kv-block-size", "0"]);
    assert!(err.contains("--kv-block-size"), "{err}");
    let err = run(&["--kv-load-set", "stall_weight=-1", "--port", "0"]);
    assert!(err.contains("stall_weight") && err.contains("≥ 0"), "{err}");
    assert_eq!(err.matches("stall_weight").count(), 1, "said once: {err}");
    let err = run(&["--kv-load-set", "stall=1"]);
    assert!(
        err.contains("no field `stall`") && err.contains("stall_weight"),
        "{err}"
    );
    // Dynamo's spelling of the mode is accepted (the error is about the next flag).
    let err = run(&["--router-mode", "round-robin", "--queue-timeout", "0"]);
    assert!(err.contains("--queue-timeout"), "{err}");
    let err = run(&["--tokenizer", "/nonexistent/tokenizer.json", "--port", "0"]);
    assert!(err.contains("/nonexistent/tokenizer.json"), "{err}");
    let err = run(&["--nats", "nats://127.0.0.1:1", "--replica-flush-ms", "5000"]);
    assert!(
        err.contains("--replica-flush-ms") && err.contains("milliseconds"),
        "{err}"
    );
    let err = run(&["--no-replica-sync"]);
    assert!(err.contains("--nats"), "replica flags need NATS: {err}");
    let err = run(&["--worker", "http://localhost:8000,role=producer"]);
    assert!(
        err.contains("role") && err.contains("both, prefill or decode"),
        "{err}"
    );
    let err = run(&["--prefill-timeout", "0"]);
    assert!(err.contains("--prefill-timeout"), "{err}");
    let err = run(&["--local-prefill-max-tokens", "lots"]);
    assert!(err.contains("--local-prefill-max-tokens"), "{err}");
    for flag in ["--stall-timeout", "--first-byte-timeout", "--body-timeout"] {
        let err = run(&[flag, "0"]);
        assert!(err.contains(flag), "{err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_killed_mid_stream_gives_the_client_an_error_and_leaves_the_routing_set() {
    let mut engines = engines(&["--speedup", "20"]);
    // Without migration (tests/migration.rs has it): the stream ends with an error event.
    let mut gateway = Server::start(&[
        "gateway",
        "--port",
        "0",
        "--migration-limit",
        "0",
        "--worker",
        &engines[0].url,
        "--worker",
        &engines[1].url,
        "--router-mode",
        "round_robin",
        "--health-interval",
        "0.2",
    ]);
    wait_health(&gateway.url, 2).await;

    // A long stream; kill the engine serving it after a few chunks.
    let (response, worker) = stream_chat(&gateway.url, "Tell me a long story.", 5000).await;
    let mut body = String::new();
    let mut stream = response.bytes_stream();
    let mut killed = false;
    let read = tokio::time::timeout(Duration::from_secs(20), async {
        while let Some(chunk) = stream.next().await {
            body.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
            if !killed && body.matches("data: ").count() >= 3 {
                engines[worker - 1].running.kill();
                killed = true;
            }
        }
    })
    .await;
    assert!(
        read.is_ok(),
        "the client hung after the engine died:\n{body}"
    );
    assert!(killed, "the stream ended before the kill:\n{body}");
    assert!(body.contains("\"code\":\"worker_failed\""), "{body}");
    assert!(body.trim_end().ends_with("data: [DONE]"), "{body}");
    wait_health(&gateway.url, 1).await;

    // The survivor serves everything now.
    for _ in 0..3 {
        let (response, served) = stream_chat(&gateway.url, "Short answer please.", 8).await;
        assert_ne!(served, worker);
        let text = response.text().await.unwrap();
        assert!(
            text.ends_with("data: [DONE]\n\n") && !text.contains("error"),
            "{text}"
        );
    }
    let metrics = get_text(&format!("{}/metrics", gateway.url)).await;
    assert!(
        metrics.contains("kvroute_gateway_worker_failures_total 1"),
        "{metrics}"
    );
    let status = gateway.running.stop(libc::SIGTERM, Duration::from_secs(10));
    assert!(status.success(), "gateway exit: {status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_register_over_nats_and_a_killed_one_expires() {
    let nats = NatsServer::start();
    let nats_url = nats.url();
    let mut engines = engines(&[
        "--speedup",
        "50",
        "--nats",
        &nats_url,
        "--namespace",
        "cli",
        "--lease-ms",
        "1000",
    ]);
    let gateway = common::nats_gateway(&nats.url(), "cli", &[]);
    wait_health(&gateway.url, 2).await;
    let (first, _) = stream_chat(&gateway.url, "What is a KV cache?", 8).await;
    assert!(first.text().await.unwrap().ends_with("data: [DONE]\n\n"));
    // SIGKILL: no goodbye; the lease runs out.
    engines[0].running.kill();
    wait_health(&gateway.url, 1).await;
}

/// A gateway whose only worker does not answer waits for it before listening (to learn the KV
/// block size), and says so at once rather than after the wait.
#[test]
fn a_gateway_waiting_for_its_workers_says_so_at_once() {
    let mut gateway = Running::spawn(
        &["gateway", "--port", "0", "--worker", "http://127.0.0.1:1"],
        Stdio::piped(),
    );
    let lines = gateway.merged_lines();
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut seen = Vec::new();
    let said = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match lines.recv_timeout(left) {
            Ok(line) if line.contains("waiting for one to learn the KV block size") => {
                break Some(line);
            }
            Ok(line) => seen.push(line),
            Err(_) => break None,
        }
    };
    gateway.kill();
    let said = said.unwrap_or_else(|| panic!("nothing said within 10 s: {seen:?}"));
    assert!(said.contains("--kv-block-size"), "{said}");
}
