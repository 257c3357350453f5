//! OpenAI's `stop` through `kvroute gateway` to a `kvroute engine`: the gateway passes it on
//! unchanged (its worker request is a token-id `/v1/completions`), so a chat ends just before
//! the stop string with `finish_reason: "stop"`, streamed or not, and a bad `stop` is the
//! engine's 400, relayed.

use std::time::{Duration, Instant};

mod common;

use common::{Server, engines, http, post_json};
use serde_json::{Value, json};

/// One engine behind a gateway whose worker is routable.
fn cluster() -> (Vec<Server>, Server) {
    let engines = engines(1);
    let gateway = Server::start(&[
        "gateway",
        "--port",
        "0",
        "--health-interval",
        "0.2",
        "--worker",
        &engines[0].url,
    ]);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !http(gateway.addr(), "GET", "/health", "")
        .1
        .contains("\"routable_workers\":1")
    {
        assert!(
            Instant::now() < deadline,
            "the worker never became routable"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    (engines, gateway)
}

/// The `data:` payloads of an SSE body, `[DONE]` last.
fn sse_events(body: &str) -> Vec<Value> {
    let payloads: Vec<&str> = body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(payloads.last(), Some(&"[DONE]"), "{body}");
    payloads[..payloads.len() - 1]
        .iter()
        .map(|p| serde_json::from_str(p).unwrap())
        .collect()
}

#[test]
fn the_gateway_passes_stop_on_and_chats_end_before_it() {
    let (_engines, gateway) = cluster();
    let addr = gateway.addr();
    let request = json!({"model": "llama-3.1-70b-instruct", "max_tokens": 150,
        "ignore_eos": true,
        "messages": [{"role": "user", "content": "How does a KV-aware router pick a worker?"}]});
    let (code, full) = post_json(addr, "/v1/chat/completions", &request);
    assert_eq!(code, 200, "{full}");
    let text = full["choices"][0]["message"]["content"].as_str().unwrap();
    // A word of the second half, cut where it first appears.
    let (stop, at) = text
        .split_whitespace()
        .map(|w| w.trim_matches(|c: char| !c.is_alphanumeric()))
        .filter(|w| w.len() >= 5)
        .find_map(|w| {
            text.find(w)
                .filter(|&at| at > text.len() / 2)
                .map(|at| (w, at))
        })
        .expect("a word first appearing in the second half");

    let mut stopped = request.clone();
    stopped["stop"] = json!([stop]);
    let (code, body) = post_json(addr, "/v1/chat/completions", &stopped);
    assert_eq!(code, 200, "{body}");
    assert_eq!(
        body["choices"][0]["message"]["content"].as_str(),
        Some(&text[..at]),
        "{body}"
    );
    assert_eq!(body["choices"][0]["finish_reason"], "stop", "{body}");
    let tokens = body["usage"]["completion_tokens"].as_u64().unwrap();
    assert!(tokens < 150, "{body}");

    stopped["stream"] = json!(true);
    stopped["stream_options"] = json!({"include_usage": true});
    let (code, raw) = http(addr, "POST", "/v1/chat/completions", &stopped.to_string());
    assert_eq!(code, 200, "{raw}");
    let events = sse_events(&raw);
    let streamed: String = events
        .iter()
        .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(streamed, &text[..at]);
    let reasons: Vec<&str> = events
        .iter()
        .filter_map(|e| e["choices"][0]["finish_reason"].as_str())
        .collect();
    assert_eq!(reasons, ["stop"], "{raw}");
    let usage = events
        .iter()
        .rev()
        .find(|e| e["usage"].is_object())
        .unwrap();
    assert_eq!(usage["usage"]["completion_tokens"], tokens, "{raw}");

    // A bad stop: the engine's 400, naming the field, through the gateway.
    let mut bad = request.clone();
    bad["stop"] = json!(["a", "b", "c", "d", "e"]);
    let (code, error) = post_json(addr, "/v1/chat/completions", &bad);
    assert_eq!(code, 400, "{error}");
    assert_eq!(error["error"]["param"], "stop", "{error}");
    assert_eq!(error["error"]["type"], "invalid_request_error", "{error}");
}
