//! Disaggregated serving as vLLM's proxy drives it: a prefill worker answers a
//! `do_remote_decode` request with the `kv_transfer_params` a decode worker needs; the decode
//! worker, given them, pulls the KV (a priced transfer) and streams the answer, and then
//! holds the prompt's blocks in its own cache.

mod common;

use common::{MODEL, config, get_json, get_text, post, post_json, read_sse, start};
use engine::{KvLink, Role};
use serde_json::{Value, json};

fn prompt() -> Vec<u32> {
    (1000..1300).collect()
}

fn request(prompt: &[u32], max_tokens: u32, stream: bool, params: Option<Value>) -> Value {
    let mut body = json!({
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": true,
        "stream": stream,
        "stream_options": {"include_usage": true},
    });
    if let Some(params) = params {
        body["kv_transfer_params"] = params;
    }
    body
}

fn error_param(body: &Value) -> &str {
    body["error"]["param"].as_str().unwrap_or_default()
}

#[tokio::test]
async fn a_prefill_worker_hands_its_kv_to_a_decode_worker_that_then_caches_it() {
    let mut prefill = config(100.0);
    prefill.engine.role = Role::PrefillOnly;
    let (_p, prefill_url) = start(prefill).await;
    let mut decode = config(100.0);
    decode.engine.role = Role::DecodeOnly;
    decode.engine.kv_link = KvLink::Network;
    let (_d, decode_url) = start(decode).await;

    let card: Value = get_json(&format!("{prefill_url}/info")).await;
    assert_eq!(card["role"], "prefill");
    let card: Value = get_json(&format!("{decode_url}/info")).await;
    assert_eq!(card["role"], "decode");
    let metrics = get_text(&format!("{prefill_url}/metrics")).await;
    assert!(
        metrics.contains("kvroute_engine_role{role=\"prefill\",kv_role=\"kv_producer\"} 1"),
        "{metrics}"
    );

    let prompt = prompt();
    // A prefill worker serves only prefill legs, answered in one response.
    let response = post(
        &prefill_url,
        "/v1/completions",
        &request(&prompt, 8, true, None),
    )
    .await;
    assert_eq!(response.status(), 400);
    let body: Value = response.json().await.unwrap();
    assert_eq!(error_param(&body), "kv_transfer_params", "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("--role prefill")
    );
    let streamed = request(&prompt, 1, true, Some(json!({"do_remote_decode": true})));
    let body = post_json(&prefill_url, "/v1/completions", &streamed).await;
    assert_eq!(error_param(&body), "stream", "{body}");
    // Nor does a decode worker prefill for another.
    let wrong = request(&prompt, 1, false, Some(json!({"do_remote_decode": true})));
    let body = post_json(&decode_url, "/v1/completions", &wrong).await;
    assert_eq!(error_param(&body), "kv_transfer_params", "{body}");

    // The proxy's first leg: max_tokens 1, not streamed, do_remote_decode.
    let first = request(&prompt, 1, false, Some(json!({"do_remote_decode": true})));
    let response = post(&prefill_url, "/v1/completions", &first).await;
    assert_eq!(response.status(), 200);
    let answer: Value = response.json().await.unwrap();
    let params = answer["kv_transfer_params"].clone();
    assert_eq!(params["do_remote_prefill"], true, "{answer}");
    assert_eq!(params["do_remote_decode"], false, "{answer}");
    assert!(
        params["remote_engine_id"]
            .as_str()
            .unwrap()
            .starts_with("kvroute-")
    );
    assert_eq!(params["remote_block_ids"].as_array().unwrap().len(), 10);
    assert_eq!(params["remote_host"], "127.0.0.1");
    assert!(params["remote_port"].as_u64().is_some());
    assert_eq!(answer["usage"]["completion_tokens"], 1, "{answer}");
    assert_eq!(answer["usage"]["prompt_tokens"], 300, "{answer}");

    // The second leg: the original request plus those parameters, streamed by the decode
    // worker, every token (the first included) in its stream.
    let second = request(&prompt, 8, true, Some(params.clone()));
    let response = post(&decode_url, "/v1/completions", &second).await;
    assert_eq!(response.status(), 200);
    let chunks = read_sse(response).await;
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(usage["completion_tokens"], 8, "{chunks:?}");
    assert_eq!(usage["prompt_tokens"], 300, "{chunks:?}");
    assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 0);

    // The transferred blocks are the decode worker's now: a whole request (no
    // kv_transfer_params, as a gateway's local prefill sends it) with the same prefix hits.
    let mut longer = prompt.clone();
    longer.extend(5000..5040);
    let local = request(&longer, 4, false, None);
    let answer = post_json(&decode_url, "/v1/completions", &local).await;
    let cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        cached >= 288,
        "the decode worker's cache holds the prompt: {answer}"
    );
    // Both set at once is a contradiction.
    let both = request(
        &prompt,
        1,
        false,
        Some(json!({"do_remote_decode": true, "do_remote_prefill": true})),
    );
    let body = post_json(&decode_url, "/v1/completions", &both).await;
    assert_eq!(error_param(&body), "kv_transfer_params", "{body}");
}
