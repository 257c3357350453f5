//! Issue 16's "done when" for real processes: `kvroute engine --role prefill` and
//! `--role decode` behind a `kvroute gateway`. A long chat is split (prefilled on the prefill
//! worker, its KV handed to the decode worker by vLLM's `kv_transfer_params`), the decode
//! worker reports the transferred blocks as its own (KV events the gateway indexes), the next
//! turn hits them and is prefilled locally there; a prefill worker killed mid-request costs
//! the client nothing but a local prefill, and a fleet without a decode worker answers with a
//! clear error, never a hang.

use std::time::{Duration, Instant};

use common::{Server, get_text, wait_routable};
use serde_json::{Value, json};

mod common;

const MODEL: &str = "llama-3.1-70b-instruct";

fn chat(messages: &[Value], stream: bool) -> Value {
    json!({
        "model": MODEL,
        "messages": messages,
        "max_tokens": 16,
        "ignore_eos": true,
        "stream": stream,
    })
}

fn user(text: &str) -> Value {
    json!({"role": "user", "content": text})
}

/// POSTs a chat to the gateway within 60 s: (status, route header, worker header, body).
async fn post_chat(gateway: &str, body: &Value) -> (u16, String, String, String) {
    let send = async {
        let response = reqwest::Client::new()
            .post(format!("{gateway}/v1/chat/completions"))
            .json(body)
            .send()
            .await
            .expect("the gateway answers");
        let header = |name: &str| {
            response
                .headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_string()
        };
        let route = header("x-kvroute-route");
        let worker = header("x-kvroute-worker");
        let status = response.status().as_u16();
        (
            status,
            route,
            worker,
            response.text().await.expect("a body"),
        )
    };
    tokio::time::timeout(Duration::from_secs(60), send)
        .await
        .expect("the client got its answer (no hang)")
}

/// The assistant's text in an SSE chat stream.
fn streamed_text(body: &str) -> String {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter_map(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .map(String::from)
        })
        .collect()
}

/// A sample's value: the first line of `metrics` that starts with `series`.
fn sample(metrics: &str, series: &str) -> Option<f64> {
    metrics
        .lines()
        .find(|l| l.starts_with(series))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chat_is_split_its_next_turn_hits_the_decode_worker_and_a_dead_prefill_worker_costs_no_answer()
 {
    // The prefill worker runs 10× slower than real time, so a long prefill takes seconds:
    // long enough to kill it mid-request.
    let mut prefill = Server::start(&[
        "engine",
        "--port",
        "0",
        "--worker-id",
        "1",
        "--role",
        "prefill",
        "--speedup",
        "0.1",
    ]);
    let mut decode = Server::start(&[
        "engine",
        "--port",
        "0",
        "--worker-id",
        "2",
        "--role",
        "decode",
        "--kv-link",
        "network",
        "--speedup",
        "20",
    ]);
    let gateway = Server::start(&[
        "gateway",
        "--port",
        "0",
        "--worker",
        &prefill.url,
        "--worker",
        &decode.url,
        "--health-interval",
        "0.2",
    ]);
    let url = gateway.url.clone();
    wait_routable(&url, 2, Duration::from_secs(20)).await;

    // Turn 1: a long prompt, nothing cached → split.
    let question = "The harbour master logs every ship that enters the bay at dawn. ".repeat(80);
    let (status, route, worker, body) = post_chat(&url, &chat(&[user(&question)], true)).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(route, "split", "{body}");
    assert_eq!(worker, "2", "the decode worker streams the answer");
    assert!(body.trim_end().ends_with("data: [DONE]"), "{body}");
    let answer = streamed_text(&body);
    assert!(!answer.is_empty(), "{body}");

    // The decode worker now holds the prompt's blocks: its KV events say so.
    let cached = "kvroute_worker_cached_blocks{worker_id=\"2\"";
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let metrics = get_text(&format!("{url}/metrics")).await;
        if sample(&metrics, cached).is_some_and(|n| n >= 20.0) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no cached blocks on the decode worker:\n{metrics}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Turn 2: the history is on the decode worker; only the new question is uncached →
    // prefilled locally there, its prompt a cache hit.
    let turn2 = chat(
        &[
            user(&question),
            json!({"role": "assistant", "content": answer}),
            user("And in one sentence?"),
        ],
        false,
    );
    let (status, route, worker, body) = post_chat(&url, &turn2).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(route, "short_prefill", "{body}");
    assert_eq!(worker, "2");
    let reply: Value = serde_json::from_str(&body).unwrap();
    let hit = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_default();
    assert!(
        hit >= 640,
        "the next turn hits the decode worker's cache: {reply}"
    );

    let metrics = get_text(&format!("{url}/metrics")).await;
    for series in [
        "kvroute_gateway_routes_total{route=\"split\",reason=\"remote_prefill\"} 1",
        "kvroute_gateway_routes_total{route=\"local\",reason=\"short_prefill\"} 1",
        "dynamo_frontend_time_to_first_token_seconds_count{model=\"llama-3.1-70b-instruct\",pool=\"prefill\"} 1",
        "dynamo_frontend_time_to_first_token_seconds_count{model=\"llama-3.1-70b-instruct\",pool=\"decode\"} 1",
        "kvroute_worker_role{worker_id=\"1\"",
    ] {
        assert!(metrics.contains(series), "missing {series}:\n{metrics}");
    }

    // A prefill worker killed mid-request: the client still gets its answer, prefilled on
    // the decode worker.
    let long = "A lighthouse keeper counts the waves against the northern rocks. ".repeat(250);
    let request = chat(&[user(&long)], true);
    let pending = tokio::spawn({
        let url = url.clone();
        async move { post_chat(&url, &request).await }
    });
    tokio::time::sleep(Duration::from_millis(1000)).await;
    prefill.running.kill();
    let (status, route, worker, body) = pending.await.unwrap();
    assert_eq!(status, 200, "{body}");
    assert_eq!(route, "prefill_failed", "{body}");
    assert_eq!(worker, "2");
    assert!(
        body.trim_end().ends_with("data: [DONE]") && !body.contains("\"error\""),
        "{body}"
    );
    let metrics = get_text(&format!("{url}/metrics")).await;
    assert!(
        metrics.contains("kvroute_gateway_prefill_failures_total 1"),
        "{metrics}"
    );

    // No prefill worker left: long prompts are prefilled locally.
    let other = "Tide tables list the hours of high water for each port. ".repeat(80);
    let (status, route, _, body) = post_chat(&url, &chat(&[user(&other)], false)).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(route, "prefill_unavailable", "{body}");

    // No decode worker: a clear OpenAI error at once.
    decode.running.kill();
    wait_routable(&url, 0, Duration::from_secs(20)).await;
    let (status, _, _, body) = post_chat(&url, &chat(&[user(&other)], false)).await;
    assert_eq!(status, 503, "{body}");
    let error: Value = serde_json::from_str(&body).unwrap();
    assert!(
        error["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("no decode worker")),
        "{body}"
    );
}
