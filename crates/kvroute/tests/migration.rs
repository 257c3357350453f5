//! Request migration (issue 20): real `kvroute engine` processes behind a `kvroute gateway`;
//! the engine serving a stream is killed (`SIGKILL`) or stopped (`SIGSTOP`) mid-stream, and the
//! gateway resends the request with its output so far to another engine. The client sees one
//! whole, unbroken stream: 200, the same `id` in every chunk, one role, the requested number
//! of tokens (counted from the token ids every chunk carries, so none is lost or repeated), a
//! usage that adds up, `[DONE]` and no error event. A non-streamed request whose engine dies
//! gets one whole reply the same way.

use std::time::{Duration, Instant};

use common::{Server, engines, get_text, wait_routable};
use futures::StreamExt;
use serde_json::{Value, json};

mod common;

const MAX_TOKENS: u64 = 400;

/// A gateway over `engines` with short health checks, stall timeout and ejection time.
fn gateway(engines: &[Server], extra: &[&str]) -> Server {
    let mut args = vec![
        "gateway",
        "--port",
        "0",
        "--router-mode",
        "round_robin",
        "--health-interval",
        "0.2",
        "--stall-timeout",
        "1",
        "--ejection-time",
        "0.5",
    ];
    for engine in engines {
        args.extend(["--worker", engine.url.as_str()]);
    }
    args.extend(extra);
    Server::start(&args)
}

fn long_chat(stream: bool) -> Value {
    json!({
        "model": "llama-3.1-70b-instruct",
        "messages": [{"role": "user", "content": "Tell me a long story about caches."}],
        "max_tokens": MAX_TOKENS,
        "ignore_eos": true,
        "stream": stream,
        "stream_options": {"include_usage": true},
        "return_token_ids": true,
    })
}

/// Requests each engine finished, as its `vllm:request_success_total` says.
async fn successes(engine: &Server) -> f64 {
    let metrics = get_text(&format!("{}/metrics", engine.url)).await;
    metrics
        .lines()
        .filter(|l| l.starts_with("vllm:request_success_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn migrations(metrics: &str, reason: &str) -> f64 {
    let prefix = format!("kvroute_gateway_migrations_total{{reason=\"{reason}\"}} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&prefix)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {prefix} in\n{metrics}"))
}

/// Streams a long chat and applies `fault` to its engine after a few chunks; returns the
/// whole body and the engine's index.
async fn stream_with_fault(url: &str, engines: &[Server], fault: libc::c_int) -> (String, usize) {
    let response = reqwest::Client::new()
        .post(format!("{url}/v1/chat/completions"))
        .json(&long_chat(true))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let worker: usize = response.headers()["x-kvroute-worker"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let mut stream = response.bytes_stream();
    let mut body = String::new();
    let mut hit = false;
    let read = tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(chunk) = stream.next().await {
            body.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
            if !hit && body.matches("data: ").count() >= 5 {
                engines[worker - 1].signal(fault);
                hit = true;
            }
        }
    })
    .await;
    assert!(read.is_ok(), "the client hung:\n{body}");
    assert!(hit, "the stream ended before the fault:\n{body}");
    (body, worker)
}

/// The stream is whole: one id, one role, `MAX_TOKENS` token ids, one finish reason at the
/// end, a usage that adds up, `[DONE]`, no error.
fn assert_whole_stream(body: &str) {
    assert!(!body.contains("\"error\""), "{body}");
    assert!(body.trim_end().ends_with("data: [DONE]"), "{body}");
    let chunks: Vec<Value> = body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let id = &chunks[0]["id"];
    let created = &chunks[0]["created"];
    let (mut roles, mut ids, mut finishes) = (0, 0u64, Vec::new());
    let mut usage = None;
    for chunk in &chunks {
        assert_eq!(&chunk["id"], id, "{chunk}");
        assert_eq!(&chunk["created"], created, "{chunk}");
        assert_eq!(chunk["model"], "llama-3.1-70b-instruct");
        for choice in chunk["choices"].as_array().unwrap() {
            roles += usize::from(choice["delta"]["role"] == "assistant");
            ids += choice["token_ids"].as_array().map_or(0, |a| a.len() as u64);
            if let Some(f) = choice["finish_reason"].as_str() {
                finishes.push(f.to_string());
            }
        }
        if !chunk["usage"].is_null() {
            usage = Some(chunk["usage"].clone());
        }
    }
    assert_eq!(roles, 1, "one role, in the first chunk");
    assert_eq!(ids, MAX_TOKENS, "every token once");
    assert_eq!(finishes, ["length"]);
    let usage = usage.expect("a usage chunk");
    assert_eq!(usage["completion_tokens"], MAX_TOKENS, "{usage}");
    assert_eq!(
        usage["total_tokens"].as_u64().unwrap(),
        usage["prompt_tokens"].as_u64().unwrap() + MAX_TOKENS,
        "{usage}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_whose_engine_is_killed_or_stopped_goes_on_on_another_engine() {
    let engines = engines(3);
    let gateway = gateway(&engines, &[]);
    let url = gateway.url.clone();
    wait_routable(&url, 3, Duration::from_secs(10)).await;
    // A short request first: the prompt's length, as a whole request reports it.
    let reply: Value = reqwest::Client::new()
        .post(format!("{url}/v1/chat/completions"))
        .json(&json!({
            "model": "llama-3.1-70b-instruct",
            "messages": [{"role": "user", "content": "Tell me a long story about caches."}],
            "max_tokens": 1,
        }))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let prompt_tokens = reply["usage"]["prompt_tokens"].clone();
    let before: Vec<f64> = futures::future::join_all(engines.iter().map(successes)).await;

    // Killed mid-stream: the stream goes on, on another engine.
    let (body, killed) = stream_with_fault(&url, &engines, libc::SIGKILL).await;
    assert_whole_stream(&body);
    assert!(
        body.contains(&format!("\"prompt_tokens\":{prompt_tokens}")),
        "{body}"
    );
    let mut continued = 0.0;
    for (i, engine) in engines.iter().enumerate() {
        if i + 1 != killed {
            continued += successes(engine).await - before[i];
        }
    }
    assert_eq!(continued, 1.0, "one other engine finished the request");
    let metrics = get_text(&format!("{url}/metrics")).await;
    assert_eq!(migrations(&metrics, "worker_failed"), 1.0);
    wait_routable(&url, 2, Duration::from_secs(10)).await;

    // Stopped mid-stream: after the stall timeout, the stream goes on elsewhere.
    let (body, stopped) = stream_with_fault(&url, &engines, libc::SIGSTOP).await;
    assert_ne!(stopped, killed);
    assert_whole_stream(&body);
    let metrics = get_text(&format!("{url}/metrics")).await;
    assert_eq!(migrations(&metrics, "worker_timeout"), 1.0);
    engines[stopped - 1].signal(libc::SIGCONT);
    // Back after its (short) ejection and a passing health check.
    wait_routable(&url, 2, Duration::from_secs(10)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_streamed_request_whose_engine_dies_gets_one_whole_reply() {
    let engines = engines(2);
    let gateway = gateway(&engines, &[]);
    let url = gateway.url.clone();
    wait_routable(&url, 2, Duration::from_secs(10)).await;
    let request = tokio::spawn({
        let url = url.clone();
        async move {
            reqwest::Client::new()
                .post(format!("{url}/v1/chat/completions"))
                .timeout(Duration::from_secs(30))
                .json(&long_chat(false))
                .send()
                .await
                .unwrap()
        }
    });
    // Kill the engine that runs it once it has generated a little.
    let deadline = Instant::now() + Duration::from_secs(10);
    let victim = 'found: loop {
        for (i, engine) in engines.iter().enumerate() {
            let metrics = get_text(&format!("{}/metrics", engine.url)).await;
            let running = metrics
                .lines()
                .filter(|l| l.starts_with("vllm:num_requests_running"))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum::<f64>();
            if running > 0.0 {
                break 'found i;
            }
        }
        assert!(Instant::now() < deadline, "the request never ran");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    engines[victim].signal(libc::SIGKILL);
    let response = request.await.unwrap();
    assert_eq!(response.status(), 200);
    let reply: Value = response.json().await.unwrap();
    assert_eq!(reply["usage"]["completion_tokens"], MAX_TOKENS, "{reply}");
    assert_eq!(reply["choices"][0]["finish_reason"], "length", "{reply}");
    assert_eq!(
        reply["choices"][0]["message"]["role"], "assistant",
        "{reply}"
    );
    let text = reply["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(text.len() > 1000, "{text}");
    let metrics = get_text(&format!("{url}/metrics")).await;
    assert_eq!(migrations(&metrics, "worker_failed"), 1.0);
    assert!(
        successes(&engines[1 - victim]).await >= 1.0,
        "the other engine finished it"
    );
}
