//! The README's set-up, flag for flag: engines started alike (no `--worker-id`, no event
//! flags) behind a gateway given only their URLs. The engines publish their KV events by
//! default, the gateway subscribes by itself, and a conversation's later turns find its
//! history cached; nothing routes blind.

use std::time::Duration;

use serde_json::{Value, json};

mod common;

use common::{Server, post_json};

fn chat(addr: &str, messages: &[Value]) -> Value {
    let request = json!({
        "model": "llama-3.1-70b-instruct", "messages": messages,
        "max_tokens": 16, "ignore_eos": true,
    });
    let (status, reply) = post_json(addr, "/v1/chat/completions", &request);
    assert_eq!(status, 200, "{reply}");
    reply
}

#[test]
fn engines_started_alike_behind_a_plain_gateway_give_cache_hits() {
    let engines: Vec<Server> = (0..2)
        .map(|_| Server::start(&["engine", "--port", "0", "--speedup", "100"]))
        .collect();
    let urls: Vec<String> = engines.iter().map(|e| e.url.clone()).collect();
    let mut args = vec!["gateway", "--port", "0"];
    for url in &urls {
        args.extend(["--worker", url.as_str()]);
    }
    let gateway = Server::start(&args);

    // Both engines are routable (distinct ids) and each one's cache view is its events.
    let views: Vec<String> = (0..2)
        .map(|_| {
            gateway
                .lines
                .recv_timeout(Duration::from_secs(10))
                .expect("a cache-view line per worker")
        })
        .collect();
    for url in &urls {
        assert!(
            views
                .iter()
                .any(|v| v.contains(url.as_str()) && v.contains("KV events over ZMQ")),
            "{url}: {views:?}"
        );
    }

    let mut messages = vec![json!({
        "role": "system",
        "content": "You answer questions about harbours, tides and the ships that use them, \
                    patiently and with examples, for as long as the student keeps asking.",
    })];
    let mut later_cached = 0;
    for turn in 0..3 {
        messages.push(json!({"role": "user", "content": format!("Question {turn}, please.")}));
        let reply = chat(gateway.addr(), &messages);
        if turn > 0 {
            later_cached += reply["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap_or_else(|| panic!("no cached_tokens: {reply}"));
        }
        let text = reply["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        messages.push(json!({"role": "assistant", "content": text}));
    }
    assert!(
        later_cached >= 2 * 32,
        "turns 2 and 3 found {later_cached} cached tokens: the gateway routed blind"
    );
}
