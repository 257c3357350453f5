//! The engine server's OpenAI API over real loopback HTTP: responses, streams, usage, the
//! round trip of generated replies into the next turn's cache, cancellation on disconnect, and
//! every error status.

mod common;

use std::time::Duration;

use common::{
    MODEL, client, config, get_json, get_text, metric, post, post_json, post_ok, read_sse, start,
    wait_for_metric,
};
use futures::StreamExt;
use serde_json::{Value, json};

async fn error_of(response: reqwest::Response) -> (u16, Value) {
    let status = response.status().as_u16();
    let body: Value = response.json().await.unwrap();
    assert!(body["error"]["message"].is_string(), "{body}");
    assert!(body["error"]["type"].is_string(), "{body}");
    (status, body["error"].clone())
}

/// A streamed completion of 5,000 tokens: minutes of generation at real-time speed, so it is
/// still running whenever the test looks.
fn endless_stream(prompt: &str) -> Value {
    json!({"model": MODEL, "prompt": prompt, "max_tokens": 5000, "ignore_eos": true,
           "stream": true})
}

#[tokio::test]
async fn chat_honours_max_tokens_with_ignore_eos_and_reports_usage() {
    let (_server, base) = start(config(1_000.0)).await;
    let response = post_ok(
        &base,
        "/v1/chat/completions",
        &json!({"model": MODEL, "messages": [{"role": "user", "content": "What is prefix caching?"}],
                "max_tokens": 57, "ignore_eos": true}),
    ).await;
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["choices"][0]["message"]["role"], "assistant");
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    assert_eq!(body["usage"]["completion_tokens"], 57);
    let text = body["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(
        text.split_whitespace().count() > 10,
        "readable words: {text}"
    );

    // The reply is exactly 57 tokens of our tokenizer.
    let tokens = post_json(&base, "/tokenize", &json!({"prompt": text})).await;
    assert_eq!(tokens["count"], 57);

    // The prompt is the Llama-3 template's tokens.
    let prompt = post_json(
        &base,
        "/tokenize",
        &json!({"messages": [{"role": "user", "content": "What is prefix caching?"}]}),
    )
    .await;
    assert_eq!(body["usage"]["prompt_tokens"], prompt["count"]);
    assert_eq!(
        body["usage"]["total_tokens"],
        prompt["count"].as_u64().unwrap() + 57
    );
}

#[tokio::test]
async fn natural_length_follows_the_distribution_and_max_tokens_caps_it() {
    let mut cfg = config(2_000.0);
    cfg.reply_length = engine_server::ReplyLength {
        mean: 60,
        spread: 0.5,
    };
    let (_server, base) = start(cfg).await;
    let mut lengths = Vec::new();
    for i in 0..6 {
        let body = post_json(
            &base,
            "/v1/completions",
            &json!({"model": MODEL, "prompt": format!("question number {i}"), "max_tokens": 1000}),
        )
        .await;
        assert_eq!(body["choices"][0]["finish_reason"], "stop", "{body}");
        lengths.push(body["usage"]["completion_tokens"].as_u64().unwrap());
    }
    assert!(
        lengths.iter().all(|&n| (30..=90).contains(&n)),
        "{lengths:?}"
    );
    assert!(
        lengths.iter().any(|&n| n != lengths[0]),
        "lengths vary: {lengths:?}"
    );
    let capped = post_json(
        &base,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": "question number 0", "max_tokens": 5}),
    )
    .await;
    assert_eq!(capped["choices"][0]["finish_reason"], "length");
    assert_eq!(capped["usage"]["completion_tokens"], 5);
}

#[tokio::test]
async fn streaming_relays_every_token_then_usage_then_done() {
    let (_server, base) = start(config(200.0)).await;
    let request = json!({"model": MODEL, "prompt": [1, 2, 3, 4, 5, 6, 7, 8, 9], "max_tokens": 40,
                         "ignore_eos": true, "return_token_ids": true});
    let full = post_json(&base, "/v1/completions", &request).await;
    let mut streamed = request.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let response = post_ok(&base, "/v1/completions", &streamed).await;
    assert_eq!(
        response.headers()["content-type"].to_str().unwrap(),
        "text/event-stream"
    );
    let events = read_sse(response).await;
    let (usage_chunk, chunks) = events.split_last().unwrap();
    assert!(chunks.len() > 1, "tokens arrive over several chunks");
    assert!(usage_chunk["choices"].as_array().unwrap().is_empty());
    assert_eq!(usage_chunk["usage"]["completion_tokens"], 40);
    assert_eq!(usage_chunk["usage"]["prompt_tokens"], 9);
    assert!(
        usage_chunk["usage"]["prompt_tokens_details"]["cached_tokens"].is_u64(),
        "{usage_chunk}"
    );
    let text: String = chunks
        .iter()
        .map(|c| c["choices"][0]["text"].as_str().unwrap())
        .collect();
    let ids: Vec<u64> = chunks
        .iter()
        .flat_map(|c| c["choices"][0]["token_ids"].as_array().unwrap().clone())
        .map(|v| v.as_u64().unwrap())
        .collect();
    // Same prompt, same seed: the same reply, streamed or not.
    assert_eq!(text, full["choices"][0]["text"].as_str().unwrap());
    assert_eq!(ids.len(), 40);
    assert_eq!(json!(ids), full["choices"][0]["token_ids"]);
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "length"
    );
    assert!(
        chunks[..chunks.len() - 1]
            .iter()
            .all(|c| c["choices"][0]["finish_reason"].is_null())
    );
}

#[tokio::test]
async fn chat_stream_puts_role_on_the_first_token() {
    let (_server, base) = start(config(500.0)).await;
    let response = post(
        &base,
        "/v1/chat/completions",
        &json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                "ignore_eos": true, "stream": true}),
    )
    .await;
    let events = read_sse(response).await;
    assert_eq!(events[0]["object"], "chat.completion.chunk");
    assert_eq!(events[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(
        !events[0]["choices"][0]["delta"]["content"]
            .as_str()
            .unwrap()
            .is_empty()
    );
    assert!(
        events.iter().all(|e| e.get("usage").is_none()),
        "no usage unless asked"
    );
}

/// The reason replies must be the model's own tokens: turn 2's prompt contains turn 1's
/// prompt and reply (as text, re-tokenized by the template), and the engine cached both.
#[tokio::test]
async fn second_turn_hits_the_cache_for_the_first_turns_prompt_and_reply() {
    let (server, base) = start(config(1_000.0)).await;
    let block = u64::from(server.info().block_size.unwrap());
    let system = "You are a helpful assistant. Answer in detail about distributed systems.";
    let mut messages = vec![
        json!({"role": "system", "content": system}),
        json!({"role": "user", "content": "Explain how a KV cache aware router works."}),
    ];
    let first = post_json(
        &base,
        "/v1/chat/completions",
        &json!({"model": MODEL, "messages": messages, "max_tokens": 300}),
    )
    .await;
    let p1 = first["usage"]["prompt_tokens"].as_u64().unwrap();
    let r1 = first["usage"]["completion_tokens"].as_u64().unwrap();
    assert!(r1 > 100, "a real reply: {r1} tokens");
    let reply = first["choices"][0]["message"]["content"].as_str().unwrap();
    messages.push(json!({"role": "assistant", "content": reply}));
    messages.push(json!({"role": "user", "content": "And what happens when a worker dies?"}));
    let response = post(
        &base,
        "/v1/chat/completions",
        &json!({"model": MODEL, "messages": messages, "max_tokens": 50,
                "stream": true, "stream_options": {"include_usage": true}}),
    )
    .await;
    let events = read_sse(response).await;
    let usage = &events.last().unwrap()["usage"];
    let cached = usage["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    // Everything the engine computed in turn 1 is cached: the prompt and every output token
    // but the last (whose KV is never computed), in whole blocks.
    let computed = p1 + r1 - 1;
    assert_eq!(cached, computed / block * block, "turn 1: {p1} + {r1}");
    assert!(
        cached > p1 + r1 / 2,
        "covers the prompt and most of the reply"
    );
}

#[tokio::test]
async fn client_disconnect_cancels_the_engine_request() {
    let (_server, base) = start(config(1.0)).await;
    let response = post_ok(
        &base,
        "/v1/completions",
        &endless_stream("tell me a long story"),
    )
    .await;
    let mut stream = response.bytes_stream();
    let first = stream.next().await.unwrap().unwrap();
    assert!(first.starts_with(b"data: "));
    assert_eq!(metric(&base, "vllm:num_requests_running").await, Some(1.0));
    drop(stream);
    assert_cancelled(&base).await;

    // A non-streaming client that gives up cancels too.
    let gave_up = tokio::spawn(
        client()
            .post(format!("{base}/v1/completions"))
            .timeout(Duration::from_millis(500))
            .json(
                &json!({"model": MODEL, "prompt": "another long story", "max_tokens": 5000,
                          "ignore_eos": true}),
            )
            .send(),
    );
    wait_for_metric(
        &base,
        "vllm:num_requests_running",
        1.0,
        Duration::from_secs(5),
    )
    .await;
    let gave_up = gave_up.await.unwrap();
    assert!(gave_up.unwrap_err().is_timeout());
    assert_cancelled(&base).await;
}

/// Waits for the engine to run nothing, then checks that nothing finished: the long requests
/// were cancelled, their 5,000 tokens never all generated.
async fn assert_cancelled(base: &str) {
    wait_for_metric(
        base,
        "vllm:num_requests_running",
        0.0,
        Duration::from_secs(10),
    )
    .await;
    assert_eq!(metric(base, "vllm:request_success_total").await, Some(0.0));
}

#[tokio::test]
async fn models_health_info_and_metrics() {
    let (server, base) = start(config(1_000.0)).await;
    let models: Value = get_json(&format!("{base}/v1/models")).await;
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], MODEL);
    let health = client().get(format!("{base}/health")).send().await.unwrap();
    assert_eq!(health.status(), 200);
    let info: protocol::WorkerCard = get_json(&format!("{base}/info")).await;
    assert_eq!(&info, server.info());
    assert_eq!(info.block_size, Some(32));
    assert_eq!(info.limits.max_num_seqs, Some(64));
    assert!(info.limits.kv_capacity_blocks.unwrap() > 1_000);
    assert!(
        info.limits.timing.is_some_and(|t| t.is_usable()),
        "it declares its timing for kv_load"
    );
    assert!(info.returns_token_ids);

    post(
        &base,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": (0..100).collect::<Vec<u32>>(), "max_tokens": 3}),
    )
    .await;
    let text = get_text(&format!("{base}/metrics")).await;
    for name in [
        "vllm:num_requests_running{",
        "vllm:num_requests_waiting{",
        "vllm:gpu_cache_usage_perc{",
        "vllm:prefix_cache_hits_total{",
        "vllm:prefix_cache_queries_total{",
        "trtllm_request_queue_time_seconds_sum{",
        "DCGM_FI_DEV_GPU_UTIL{gpu=\"0\",Hostname=",
        "DCGM_FI_DEV_FB_USED{gpu=\"0\",Hostname=",
    ] {
        assert!(text.contains(name), "{name} missing from\n{text}");
    }
    assert_eq!(
        metric(&base, "vllm:prefix_cache_queries_total").await,
        Some(100.0)
    );
    assert_eq!(
        metric(&base, "trtllm_request_queue_time_seconds_count").await,
        Some(1.0)
    );
    // Weights alone are ~70 GB of the 141 GB H200.
    assert!(metric(&base, "DCGM_FI_DEV_FB_USED").await.unwrap() > 60_000.0);
}

/// How an error case reaches the server.
enum Call {
    /// A body that is not JSON, sent as JSON.
    Raw(&'static str, &'static str),
    Post(&'static str, Value),
    Get(&'static str),
}

/// One refused request: the status, and fields of the error object it must carry.
struct ErrorCase {
    name: &'static str,
    call: Call,
    status: u16,
    fields: &'static [(&'static str, &'static str)],
}

#[tokio::test]
async fn every_error_status() {
    let mut cfg = config(1.0);
    cfg.body_limit_bytes = 4_096;
    cfg.engine.max_num_seqs = 1;
    cfg.engine.max_waiting = 1;
    let (server, base) = start(cfg).await;

    let cases = [
        ErrorCase {
            name: "malformed JSON",
            call: Call::Raw("/v1/chat/completions", "{\"model\": "),
            status: 400,
            fields: &[("type", "invalid_request_error")],
        },
        ErrorCase {
            name: "wrong field type",
            call: Call::Post("/v1/completions", json!({"model": MODEL, "prompt": [-3]})),
            status: 400,
            fields: &[],
        },
        ErrorCase {
            name: "unknown model",
            call: Call::Post(
                "/v1/chat/completions",
                json!({"model": "gpt-nope", "messages": [{"role": "user", "content": "hi"}]}),
            ),
            status: 404,
            fields: &[("code", "model_not_found")],
        },
        ErrorCase {
            name: "prompt + max_tokens over the 131,072-token context",
            call: Call::Post(
                "/v1/completions",
                json!({"model": MODEL, "prompt": "hello", "max_tokens": 131_072}),
            ),
            status: 400,
            fields: &[("code", "context_length_exceeded"), ("param", "prompt")],
        },
        ErrorCase {
            name: "body over the 4 KiB limit",
            call: Call::Post(
                "/v1/completions",
                json!({"model": MODEL, "prompt": "x".repeat(10_000)}),
            ),
            status: 413,
            fields: &[],
        },
        ErrorCase {
            name: "n > 1",
            call: Call::Post(
                "/v1/completions",
                json!({"model": MODEL, "prompt": "a", "n": 2}),
            ),
            status: 400,
            fields: &[("param", "n")],
        },
        ErrorCase {
            name: "unknown path, in the same shape",
            call: Call::Get("/v2/nothing"),
            status: 404,
            fields: &[],
        },
    ];
    for case in cases {
        let response = match &case.call {
            Call::Raw(path, body) => client()
                .post(format!("{base}{path}"))
                .header("content-type", "application/json")
                .body(*body)
                .send()
                .await
                .expect("request sent"),
            Call::Post(path, body) => post(&base, path, body).await,
            Call::Get(path) => client()
                .get(format!("{base}{path}"))
                .send()
                .await
                .expect("request sent"),
        };
        let (status, error) = error_of(response).await;
        assert_eq!(status, case.status, "{}: {error}", case.name);
        for (field, want) in case.fields {
            assert_eq!(error[field], *want, "{}: {field} of {error}", case.name);
        }
    }

    // Engine queue full: one running (max_num_seqs 1), one waiting (max_waiting 1), the
    // third is refused with 429. Streams return their headers once admitted.
    let long = endless_stream("long");
    let running = post(&base, "/v1/completions", &long).await;
    assert_eq!(running.status(), 200);
    let waiting = post(&base, "/v1/completions", &long).await;
    assert_eq!(waiting.status(), 200);
    wait_for_metric(
        &base,
        "vllm:num_requests_waiting",
        1.0,
        Duration::from_secs(5),
    )
    .await;
    let (status, error) = error_of(post(&base, "/v1/completions", &long).await).await;
    assert_eq!(
        (status, error["type"].as_str()),
        (429, Some("rate_limit_error"))
    );
    drop((running, waiting));
    server.shutdown().await;
}

#[tokio::test]
async fn shutdown_ends_open_streams_with_an_error_event() {
    let (server, base) = start(config(1.0)).await;
    let response = post_ok(&base, "/v1/completions", &endless_stream("story")).await;
    let reader = tokio::spawn(read_sse(response));
    tokio::time::sleep(Duration::from_millis(100)).await;
    tokio::time::timeout(Duration::from_secs(10), server.shutdown())
        .await
        .expect("shutdown finishes");
    let events = tokio::time::timeout(Duration::from_secs(5), reader)
        .await
        .expect("stream ends")
        .unwrap();
    let last = events.last().unwrap();
    assert_eq!(last["error"]["code"], "no_healthy_worker", "{last}");
}

/// vLLM's `continue_final_message`: the final (assistant) message is left open, so the prompt
/// is the chat's prompt followed by that message's text; with `add_generation_prompt` also
/// true it is a 400, as in vLLM.
#[tokio::test]
async fn a_chat_can_continue_its_final_message() {
    let (_server, base) = start(config(1_000.0)).await;
    let question = json!({"role": "user", "content": "What is prefix caching?"});
    let partial = "Prefix caching keeps";
    let prompt = post_json(&base, "/tokenize", &json!({"messages": [question]})).await;
    let partial_tokens = post_json(&base, "/tokenize", &json!({"prompt": partial})).await;
    let request = json!({"model": MODEL, "max_tokens": 5, "ignore_eos": true,
        "messages": [question, {"role": "assistant", "content": partial}],
        "continue_final_message": true, "add_generation_prompt": false});
    let response = post_ok(&base, "/v1/chat/completions", &request).await;
    let body: Value = response.json().await.unwrap();
    assert_eq!(
        body["usage"]["prompt_tokens"].as_u64().unwrap(),
        prompt["count"].as_u64().unwrap() + partial_tokens["count"].as_u64().unwrap(),
        "{body}"
    );
    let mut both = request.clone();
    both["add_generation_prompt"] = json!(true);
    let (status, error) = error_of(post(&base, "/v1/chat/completions", &both).await).await;
    assert_eq!(status, 400);
    assert_eq!(error["param"], "continue_final_message", "{error}");
}

/// A method a path does not serve: 405 with OpenAI error JSON, as the gateway answers it, and
/// the `Allow` header naming what it serves.
#[tokio::test]
async fn a_wrong_method_is_a_405_in_openai_json_with_allow() {
    let (_server, base) = start(config(1_000.0)).await;
    for (method, path, allow, says) in [
        (
            reqwest::Method::PUT,
            "/v1/chat/completions",
            "POST",
            "PUT is not allowed on /v1/chat/completions; use POST.",
        ),
        (
            reqwest::Method::GET,
            "/v1/completions",
            "POST",
            "GET is not allowed on /v1/completions; use POST.",
        ),
        (
            reqwest::Method::POST,
            "/v1/models",
            "GET,HEAD",
            "POST is not allowed on /v1/models; use GET.",
        ),
        (
            reqwest::Method::DELETE,
            "/health",
            "GET,HEAD",
            "DELETE is not allowed on /health; use GET.",
        ),
    ] {
        let response = client()
            .request(method.clone(), format!("{base}{path}"))
            .send()
            .await
            .expect("request sent");
        assert_eq!(response.headers()["allow"], allow, "{method} {path}");
        assert_eq!(
            response.headers()["content-type"],
            "application/json",
            "{method} {path}"
        );
        let (status, error) = error_of(response).await;
        assert_eq!(status, 405, "{method} {path}: {error}");
        assert_eq!(error["code"], "method_not_allowed", "{method} {path}");
        assert_eq!(error["type"], "invalid_request_error", "{method} {path}");
        assert_eq!(error["message"], says, "{method} {path}");
    }
    // The right methods still work behind the same router; an unknown path is still a 404.
    let models: Value = get_json(&format!("{base}/v1/models")).await;
    assert_eq!(models["data"][0]["id"], MODEL);
    let (status, _) = error_of(client().get(format!("{base}/v9")).send().await.unwrap()).await;
    assert_eq!(status, 404);
}
