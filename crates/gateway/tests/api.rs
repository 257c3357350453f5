//! The OpenAI API as a client sees it: every error status, the streaming format, the
//! non-streaming shape, what reaches the worker, and a worker dying mid-stream.

mod common;

use std::time::Duration;

use common::fake_worker::{FakeWorker, Script, dead_port};
use common::*;
use engine_server::EngineServerConfig;
use gateway::{GatewayConfig, PromptFormat, WorkerSpec};
use serde_json::{Value, json};

fn assert_error(status: u16, body: &Value, want_status: u16, want_type: &str) {
    assert_eq!(status, want_status, "{body}");
    let error = &body["error"];
    assert_eq!(error["type"], want_type, "{body}");
    assert!(
        error["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{body}"
    );
}

async fn raw_post(url: &str, path: &str, body: impl Into<reqwest::Body>) -> (u16, Value) {
    let response = reqwest::Client::new()
        .post(format!("{url}{path}"))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap())
}

/// Sends a chat `request` through a gateway of its own, started from `config`, and returns the
/// answer's status and body.
async fn chat_through(config: GatewayConfig, request: &Value) -> (u16, Value) {
    let gw = gateway(config).await;
    let (status, _, body) = post_json(&gw.url(), "/v1/chat/completions", request).await;
    gw.shutdown().await;
    (status, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_client_error_has_its_status_and_openai_json() {
    let engine = engine(1, None).await;
    let gw = gateway(GatewayConfig {
        context_length: 512,
        max_body_bytes: 8 << 10,
        ..gateway_config(&[&engine])
    })
    .await;
    let url = gw.url();

    // Malformed JSON: 400.
    let (status, body) = raw_post(&url, "/v1/chat/completions", "{\"model\": ").await;
    assert_error(status, &body, 400, "invalid_request_error");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("not valid JSON")
    );
    // Valid JSON of the wrong shape: 400 too.
    let (status, body) = raw_post(&url, "/v1/chat/completions", "{\"model\": \"m\"}").await;
    assert_error(status, &body, 400, "invalid_request_error");

    // Unknown model: 404 model_not_found.
    let mut request = chat(&[("user", "hi")], 4, false);
    request["model"] = json!("gpt-9");
    let (status, _, body) = post_json(&url, "/v1/chat/completions", &request).await;
    assert_error(status, &body, 404, "invalid_request_error");
    assert_eq!(body["error"]["code"], "model_not_found");

    // Prompt longer than the context: 400 context_length_exceeded, for both APIs.
    let long = passage(0, 600);
    let (status, _, body) = post_json(
        &url,
        "/v1/chat/completions",
        &chat(&[("user", &long)], 4, false),
    )
    .await;
    assert_error(status, &body, 400, "invalid_request_error");
    assert_eq!(body["error"]["code"], "context_length_exceeded");
    assert_eq!(body["error"]["param"], "messages");
    let (status, _, body) = post_json(
        &url,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": (0..400).collect::<Vec<u32>>(), "max_tokens": 200}),
    )
    .await;
    assert_eq!(body["error"]["code"], "context_length_exceeded", "{body}");
    assert_eq!(status, 400);

    // Body over the limit: 413, whether the length is declared or not.
    let huge = chat(&[("user", &"x ".repeat(10_000))], 4, false).to_string();
    let (status, body) = raw_post(&url, "/v1/chat/completions", huge.clone()).await;
    assert_error(status, &body, 413, "invalid_request_error");
    let chunks: Vec<Result<String, std::io::Error>> = huge
        .as_bytes()
        .chunks(1000)
        .map(|c| Ok(String::from_utf8_lossy(c).into_owned()))
        .collect();
    let streamed = reqwest::Body::wrap_stream(futures::stream::iter(chunks));
    let (status, body) = raw_post(&url, "/v1/chat/completions", streamed).await;
    assert_error(status, &body, 413, "invalid_request_error");

    // A batch prompt is refused clearly; an empty message list too.
    let (status, _, body) = post_json(
        &url,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": ["a", "b"]}),
    )
    .await;
    assert_error(status, &body, 400, "invalid_request_error");
    let (status, _, body) = post_json(
        &url,
        "/v1/chat/completions",
        &json!({"model": MODEL, "messages": []}),
    )
    .await;
    assert_error(status, &body, 400, "invalid_request_error");

    // Unknown path: 404 in the same format.
    let (status, body) = raw_post(&url, "/v2/nothing", "{}").await;
    assert_error(status, &body, 404, "not_found_error");

    // Errors are counted as requests with status="error".
    let metrics = gw.metrics_text();
    assert!(
        metrics.contains("dynamo_frontend_requests_total{model=\"llama-3.1-70b-instruct\",endpoint=\"chat_completions\",request_type=\"unary\",status=\"error\"}"),
        "{metrics}"
    );
    shut_down(gw, vec![engine]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_healthy_worker_is_503() {
    // No worker at all.
    let gw = gateway(gateway_config(&[])).await;
    let (status, _, body) = short_chat_json(&gw.url()).await;
    assert_error(status, &body, 503, "service_unavailable_error");
    let health = reqwest::get(format!("{}/health", gw.url())).await.unwrap();
    assert_eq!(health.status().as_u16(), 503);
    gw.shutdown().await;

    // A configured worker that does not answer HTTP: known, never routable.
    let dead = dead_port().await;
    let gw = gateway(GatewayConfig {
        workers: vec![WorkerSpec::new(format!("http://{dead}"))],
        ..gateway_config(&[])
    })
    .await;
    assert_eq!(gw.dispatcher().workers().len(), 1);
    assert!(gw.dispatcher().routable_workers().is_empty());
    let s = short_chat_stream(&gw.url()).await;
    assert_eq!(s.status, 503);
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_frontend_queue_is_429_and_a_long_wait_is_503() {
    // One worker slot, one queue place; the worker streams slowly enough to hold its slot.
    let slow = slow_engine(2.0).await;
    let gw = gateway(GatewayConfig {
        frontend: gateway::FrontendConfig {
            max_in_flight_per_worker: std::num::NonZeroU32::new(1),
            queue_capacity: 1,
            queue_timeout: Some(Duration::from_millis(300).into()),
        },
        ..gateway_config(&[&slow])
    })
    .await;
    let url = gw.url();
    let long = chat(&[("user", "tell me everything")], 2000, true);
    let first = tokio::spawn({
        let url = url.clone();
        let long = long.clone();
        async move { post_stream(&url, "/v1/chat/completions", &long).await }
    });
    wait_for(
        "the first request to hold the slot",
        Duration::from_secs(5),
        || gw.dispatcher().snapshot().workers[0].in_flight == 1,
    )
    .await;
    let second = tokio::spawn({
        let url = url.clone();
        async move {
            post_json(
                &url,
                "/v1/chat/completions",
                &chat(&[("user", "q")], 4, false),
            )
            .await
        }
    });
    wait_for(
        "the second request to queue",
        Duration::from_secs(5),
        || {
            gw.metrics_text()
                .contains("dynamo_frontend_queued_requests{model=\"llama-3.1-70b-instruct\"} 1")
        },
    )
    .await;
    // The queue is full: the third is refused at once.
    let (status, _, body) = post_json(
        &url,
        "/v1/chat/completions",
        &chat(&[("user", "q3")], 4, false),
    )
    .await;
    assert_error(status, &body, 429, "rate_limit_error");
    // The second waited past the queue timeout: 503.
    let (status, _, body) = second.await.unwrap();
    assert_error(status, &body, 503, "service_unavailable_error");
    assert!(
        body["error"]["message"].as_str().unwrap().contains("free"),
        "{body}"
    );
    assert!(
        gw.metrics_text()
            .contains("dynamo_frontend_queued_requests{model=\"llama-3.1-70b-instruct\"} 0")
    );
    first.abort();
    shut_down(gw, vec![slow]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_requests_all_complete_as_slots_free() {
    let engine = engine(1, None).await;
    let gw = gateway(GatewayConfig {
        frontend: gateway::FrontendConfig {
            max_in_flight_per_worker: std::num::NonZeroU32::new(1),
            queue_capacity: 64,
            ..Default::default()
        },
        ..gateway_config(&[&engine])
    })
    .await;
    let url = gw.url();
    let tasks: Vec<_> = (0..8)
        .map(|i| {
            let url = url.clone();
            tokio::spawn(async move {
                post_stream(
                    &url,
                    "/v1/chat/completions",
                    &chat(&[("user", &format!("question {i}"))], 16, true),
                )
                .await
            })
        })
        .collect();
    for task in tasks {
        let s = task.await.unwrap();
        assert_eq!(s.status, 200);
        assert!(s.done && s.error().is_none(), "{s:?}");
    }
    shut_down(gw, vec![engine]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_stream_chunks_are_openai_chunks_with_done_last_and_usage_when_asked() {
    let engine = engine(1, None).await;
    let gw = gateway(gateway_config(&[&engine])).await;
    let url = gw.url();

    let s = post_stream(
        &url,
        "/v1/chat/completions",
        &chat(&[("user", "Explain caches.")], 20, true),
    )
    .await;
    assert_eq!(s.status, 200);
    assert!(s.done);
    let (content, usage) = s.chunks.split_at(s.chunks.len() - 1);
    let id = content[0]["id"].as_str().unwrap();
    assert!(id.starts_with("chatcmpl-"), "{id}");
    assert_eq!(content[0]["choices"][0]["delta"]["role"], "assistant");
    for c in content {
        assert_eq!(c["object"], "chat.completion.chunk", "{c}");
        assert_eq!(c["id"], id);
        assert_eq!(c["model"], MODEL);
        assert!(c["created"].as_u64().is_some());
        let choice = &c["choices"][0];
        assert_eq!(choice["index"], 0);
        assert!(choice["delta"].is_object(), "{c}");
        assert!(c.get("usage").is_none(), "{c}");
    }
    assert_eq!(
        content.last().unwrap()["choices"][0]["finish_reason"],
        "length"
    );
    let usage_chunk = &usage[0];
    assert_eq!(usage_chunk["choices"], json!([]));
    assert_eq!(usage_chunk["object"], "chat.completion.chunk");
    let u = &usage_chunk["usage"];
    assert_eq!(u["completion_tokens"], 20);
    assert_eq!(
        u["total_tokens"].as_u64(),
        Some(u["prompt_tokens"].as_u64().unwrap() + 20)
    );
    assert!(u["prompt_tokens_details"]["cached_tokens"].is_u64());
    assert!(!s.text().is_empty());

    // Without include_usage: no usage chunk.
    let mut request = chat(&[("user", "Explain caches.")], 5, true);
    request.as_object_mut().unwrap().remove("stream_options");
    let s = post_stream(&url, "/v1/chat/completions", &request).await;
    assert!(s.done);
    assert!(s.usage().is_none(), "{s:?}");
    assert!(
        s.chunks
            .iter()
            .all(|c| c["choices"].as_array().unwrap().len() == 1)
    );

    // Each streamed request's added TTFT was measured once; the unary one below adds none.
    let added_count = |metrics: &str| -> u64 {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix("kvroute_gateway_added_ttft_seconds_count "))
            .expect("the added-TTFT histogram")
            .parse()
            .unwrap()
    };
    assert_eq!(added_count(&gw.metrics_text()), 2);

    // Not streamed: one chat.completion with the whole message.
    let (status, worker, body) = post_json(
        &url,
        "/v1/chat/completions",
        &chat(&[("user", "Explain caches.")], 12, false),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(worker, Some(1));
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["choices"][0]["message"]["role"], "assistant");
    assert!(
        !body["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .is_empty()
    );
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    assert_eq!(body["usage"]["completion_tokens"], 12);
    assert_eq!(
        added_count(&gw.metrics_text()),
        2,
        "unary requests have no TTFT to add to"
    );

    // Completions with token ids, streamed, with the ids passed back when asked.
    let s = post_stream(
        &url,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": [1, 2, 3, 4, 5], "max_tokens": 8, "ignore_eos": true,
                "stream": true, "return_token_ids": true}),
    )
    .await;
    assert!(s.done);
    assert!(s.chunks.iter().all(|c| c["object"] == "text_completion"));
    let ids: usize = s
        .chunks
        .iter()
        .filter_map(|c| c["choices"][0]["token_ids"].as_array())
        .map(Vec::len)
        .sum();
    assert_eq!(ids, 8);
    // Completions with a text prompt, not streamed.
    let (status, _, body) = post_json(
        &url,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 6, "ignore_eos": true}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "text_completion");
    assert!(body["choices"][0]["text"].as_str().is_some());
    assert_eq!(body["usage"]["completion_tokens"], 6);

    // Models, health, metrics.
    let models: Value = reqwest::get(format!("{url}/v1/models"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], MODEL);
    let health = reqwest::get(format!("{url}/health")).await.unwrap();
    assert_eq!(health.status().as_u16(), 200);
    let metrics = reqwest::get(format!("{url}/metrics")).await.unwrap();
    assert!(
        metrics.headers()["content-type"]
            .to_str()
            .unwrap()
            .contains("openmetrics")
    );
    let text = metrics.text().await.unwrap();
    for name in [
        "dynamo_frontend_requests_total{model=\"llama-3.1-70b-instruct\",endpoint=\"chat_completions\",request_type=\"stream\",status=\"success\"} 2",
        "dynamo_frontend_output_tokens_total{model=\"llama-3.1-70b-instruct\"} 51",
        "dynamo_frontend_time_to_first_token_seconds_count{model=\"llama-3.1-70b-instruct\",pool=\"aggregated\"} 5",
        "dynamo_frontend_inflight_requests{model=\"llama-3.1-70b-instruct\"} 0",
    ] {
        assert!(text.contains(name), "missing {name}:\n{text}");
    }
    shut_down(gw, vec![engine]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_get_token_ids_and_unknown_fields_or_text_when_configured() {
    let tokens_worker = FakeWorker::start(Script::Complete { tokens: 3 }).await;
    let text_worker = FakeWorker::start(Script::Complete { tokens: 3 }).await;
    let mut text_spec: WorkerSpec = format!("{},id=2,prompt=text", text_worker.url())
        .parse()
        .unwrap();
    text_spec.prompt = PromptFormat::Text;
    let gw = gateway(round_robin(vec![
        format!("{},id=1", tokens_worker.url()).parse().unwrap(),
        text_spec,
    ]))
    .await;
    let mut request = chat(&[("system", "Be brief."), ("user", "Hi")], 3, false);
    request["response_format"] = json!({"type": "json_object"});
    request["nvext"] = json!({"annotations": ["x"]});
    request["max_completion_tokens"] = json!(3);
    request.as_object_mut().unwrap().remove("max_tokens");
    request.as_object_mut().unwrap().remove("stream_options");
    for _ in 0..2 {
        let (status, _, body) = post_json(&gw.url(), "/v1/chat/completions", &request).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["choices"][0]["message"]["content"], " w0 w1 w2");
        // The worker's cache report reaches the client.
        assert_eq!(body["usage"]["prompt_tokens_details"]["cached_tokens"], 3);
    }
    for worker in [&tokens_worker, &text_worker] {
        let sent = worker.last_request();
        assert_eq!(sent["model"], MODEL);
        assert_eq!(sent["stream"], true, "{sent}");
        assert_eq!(sent["stream_options"]["include_usage"], true, "{sent}");
        assert_eq!(sent["max_tokens"], 3, "{sent}");
        assert!(sent.get("max_completion_tokens").is_none(), "{sent}");
        assert!(sent.get("messages").is_none(), "{sent}");
        assert_eq!(sent["response_format"], json!({"type": "json_object"}));
        assert_eq!(sent["nvext"], json!({"annotations": ["x"]}));
        assert_eq!(sent["ignore_eos"], true);
    }
    let ids = tokens_worker.last_request()["prompt"].clone();
    assert!(ids.as_array().unwrap().iter().all(Value::is_u64), "{ids}");
    let text = text_worker.last_request()["prompt"].clone();
    assert!(
        text.as_str()
            .unwrap()
            .starts_with("<|begin_of_text|><|start_header_id|>system"),
        "{text}"
    );
    // A worker's own error is relayed with its status.
    let failing = FakeWorker::start(Script::Fail { status: 400 }).await;
    let (status, body) = chat_through(
        GatewayConfig {
            workers: vec![WorkerSpec::new(failing.url())],
            ..gateway_config(&[])
        },
        &request,
    )
    .await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["code"], "scripted");
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_dying_mid_stream_gives_a_clean_error_and_leaves_the_routing_set() {
    let crashing = FakeWorker::start(Script::CrashAfter { tokens: 3 }).await;
    let healthy = FakeWorker::start(Script::Complete { tokens: 4 }).await;
    let gw = gateway(GatewayConfig {
        // Health checks would hide the request-triggered removal; keep them out of the way.
        health_interval: Duration::from_secs(3600),
        // Without migration: the stream ends with the worker's error.
        migration_limit: 0,
        ..round_robin(vec![
            format!("{},id=1", crashing.url()).parse().unwrap(),
            format!("{},id=2", healthy.url()).parse().unwrap(),
        ])
    })
    .await;
    assert_eq!(gw.dispatcher().routable_workers().len(), 2);
    // Round robin starts at worker 1, the one that crashes.
    let s = tokio::time::timeout(
        Duration::from_secs(5),
        post_stream(
            &gw.url(),
            "/v1/chat/completions",
            &chat(&[("user", "hi")], 10, true),
        ),
    )
    .await
    .expect("no hang");
    assert_eq!(s.status, 200);
    assert_eq!(s.worker, Some(1));
    assert_eq!(s.text(), " w0 w1 w2", "the tokens before the crash arrive");
    let error = s.error().expect("an SSE error event");
    assert_eq!(error["code"], "worker_failed", "{error}");
    assert!(s.done, "[DONE] after the error");
    assert_eq!(
        gw.dispatcher().routable_workers(),
        vec![kv_index::WorkerId(2)],
        "the crashed worker left the routing set"
    );
    // The next requests go to the healthy worker.
    for _ in 0..2 {
        let s = short_chat_stream(&gw.url()).await;
        assert_eq!(s.worker, Some(2));
        assert!(s.error().is_none() && s.done);
    }
    // Non-streaming: the error JSON, 502.
    let crash_only = GatewayConfig {
        workers: vec![format!("{},id=1", crashing.url()).parse().unwrap()],
        health_interval: Duration::from_secs(3600),
        migration_limit: 0,
        ..gateway_config(&[])
    };
    let (status, body) = chat_through(crash_only, &chat(&[("user", "hi")], 4, false)).await;
    assert_eq!(status, 502, "{body}");
    assert_eq!(body["error"]["code"], "worker_failed");
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_dying_mid_stream_is_continued_by_another_with_the_output_so_far() {
    let crashing = FakeWorker::start(Script::CrashAfter { tokens: 3 }).await;
    let healthy = FakeWorker::start(Script::Complete { tokens: 4 }).await;
    let workers = vec![
        format!("{},id=1", crashing.url()).parse().unwrap(),
        format!("{},id=2", healthy.url()).parse().unwrap(),
    ];
    let gw = gateway(GatewayConfig {
        health_interval: Duration::from_secs(3600),
        ..round_robin(workers)
    })
    .await;
    // Round robin starts at worker 1, the one that crashes; worker 2 continues.
    let mut request = chat(&[("user", "hi")], 10, true);
    request["stream_options"] = json!({"include_usage": true});
    let s = tokio::time::timeout(
        Duration::from_secs(5),
        post_stream(&gw.url(), "/v1/chat/completions", &request),
    )
    .await
    .expect("no hang");
    assert_eq!(s.status, 200);
    assert!(s.error().is_none(), "no error event");
    assert!(s.done);
    // The fake worker does not continue the text; it writes its own four tokens.
    assert_eq!(s.text(), " w0 w1 w2 w0 w1 w2 w3");
    let first = crashing.last_request();
    let resent = healthy.last_request();
    assert_eq!(first["max_tokens"], 10);
    assert_eq!(resent["max_tokens"], 7, "reduced by the 3 tokens generated");
    let (first, resent) = (
        first["prompt"].as_array().unwrap().clone(),
        resent["prompt"].as_array().unwrap().clone(),
    );
    assert!(
        resent.len() > first.len() && resent[..first.len()] == first[..],
        "the prompt, then the output so far: {first:?} → {resent:?}"
    );
    assert_eq!(
        gw.dispatcher().routable_workers(),
        vec![kv_index::WorkerId(2)],
        "the crashed worker left the routing set"
    );
    let metrics = reqwest::get(format!("{}/metrics", gw.url()))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("kvroute_gateway_migrations_total{reason=\"worker_failed\"} 1"),
        "{metrics}"
    );
    gw.shutdown().await;
}

/// A gateway whose first worker (round robin) dies after two tokens of choice 0, three of
/// choice 1 and the whole of choice 2 (one token, `stop`); the second, which takes prompts
/// as text, continues with four tokens of its own.
async fn multi_choice_crash() -> (FakeWorker, FakeWorker, gateway::Gateway) {
    let crashing = FakeWorker::start(Script::CrashMidChoices {
        choices: vec![(2, false), (3, false), (1, true)],
    })
    .await;
    let healthy = FakeWorker::start(Script::Complete { tokens: 4 }).await;
    let mut text_spec: WorkerSpec = format!("{},id=2", healthy.url()).parse().unwrap();
    text_spec.prompt = PromptFormat::Text;
    let gw = gateway(GatewayConfig {
        health_interval: Duration::from_secs(3600),
        ..round_robin(vec![
            format!("{},id=1", crashing.url()).parse().unwrap(),
            text_spec,
        ])
    })
    .await;
    (crashing, healthy, gw)
}

/// The prompts the continuing worker got, in order: each `n` = 1, for its choice's rest.
fn resent_prompts(healthy: &FakeWorker, max_tokens: &[u64]) -> Vec<String> {
    let requests = healthy.requests.lock().unwrap().clone();
    assert_eq!(
        requests.len(),
        2,
        "choices 0 and 1 resent, 2 finished: {requests:?}"
    );
    requests
        .iter()
        .zip(max_tokens)
        .map(|(r, &max)| {
            assert_eq!(r["n"], 1, "{r}");
            assert_eq!(r["max_tokens"], max, "reduced by that choice's tokens: {r}");
            r["prompt"].as_str().expect("a text prompt").to_string()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_multi_choice_stream_whose_worker_dies_continues_each_unfinished_choice() {
    let (crashing, healthy, gw) = multi_choice_crash().await;
    let mut request = chat(&[("user", "hi")], 8, true);
    request["n"] = json!(3);
    let s = tokio::time::timeout(
        Duration::from_secs(5),
        post_stream(&gw.url(), "/v1/chat/completions", &request),
    )
    .await
    .expect("no hang");
    assert_eq!(s.status, 200);
    assert!(s.error().is_none(), "no error event: {:?}", s.chunks);
    assert!(s.done, "one [DONE], last");
    let mut texts = vec![String::new(); 3];
    let mut finishes = vec![Vec::new(); 3];
    for choice in s
        .chunks
        .iter()
        .flat_map(|c| c["choices"].as_array().unwrap())
    {
        let i = choice["index"].as_u64().unwrap() as usize;
        assert!(i < 3, "{choice}");
        if let Some(text) = choice["delta"]["content"].as_str() {
            texts[i].push_str(text);
        }
        if let Some(finish) = choice["finish_reason"].as_str() {
            finishes[i].push(finish.to_string());
        }
    }
    // Each choice's tokens once, in order: the dead worker's, then its continuation's.
    assert_eq!(texts[0], " c0t0 c0t1 w0 w1 w2 w3");
    assert_eq!(texts[1], " c1t0 c1t1 c1t2 w0 w1 w2 w3");
    assert_eq!(texts[2], " c2t0");
    assert_eq!(finishes, [vec!["length"], vec!["length"], vec!["stop"]]);
    let first = crashing.last_request();
    assert_eq!(
        (first["n"].clone(), first["max_tokens"].clone()),
        (json!(3), json!(8))
    );
    let prompt_tokens = first["prompt"].as_array().unwrap().len() as u64;
    // The client's prompt once, every choice's tokens over both workers: 6 + 4 + 4.
    let usage = s.usage().expect("usage");
    assert_eq!(usage["prompt_tokens"], prompt_tokens);
    assert_eq!(usage["completion_tokens"], 14);
    assert_eq!(usage["total_tokens"], prompt_tokens + 14);
    // Each resend is the (text) prompt followed by its own choice's output.
    let resent = resent_prompts(&healthy, &[6, 5]);
    let prompt = resent[0]
        .strip_suffix(" c0t0 c0t1")
        .expect("choice 0's output appended");
    assert!(prompt.starts_with("<|begin_of_text|>"), "{prompt}");
    assert_eq!(resent[1], format!("{prompt} c1t0 c1t1 c1t2"));
    let metrics = reqwest::get(format!("{}/metrics", gw.url()))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("kvroute_gateway_migrations_total{reason=\"worker_failed\"} 1"),
        "one failure, one migration: {metrics}"
    );
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_streamed_multi_choice_request_whose_worker_dies_gets_every_choice_whole() {
    let (crashing, healthy, gw) = multi_choice_crash().await;
    let request = json!({"model": MODEL, "prompt": "Say hi", "max_tokens": 8, "n": 3});
    let (status, _, body) = tokio::time::timeout(
        Duration::from_secs(5),
        post_json(&gw.url(), "/v1/completions", &request),
    )
    .await
    .expect("no hang");
    assert_eq!(status, 200, "{body}");
    let choices: Vec<(u64, &str, &str)> = body["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["index"].as_u64().unwrap(),
                c["text"].as_str().unwrap(),
                c["finish_reason"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        choices,
        [
            (0, " c0t0 c0t1 w0 w1 w2 w3", "length"),
            (1, " c1t0 c1t1 c1t2 w0 w1 w2 w3", "length"),
            (2, " c2t0", "stop"),
        ]
    );
    let prompt_tokens = crashing.last_request()["prompt"].as_array().unwrap().len() as u64;
    assert_eq!(body["usage"]["prompt_tokens"], prompt_tokens);
    assert_eq!(body["usage"]["completion_tokens"], 14);
    assert_eq!(
        resent_prompts(&healthy, &[6, 5]),
        ["Say hi c0t0 c0t1", "Say hi c1t0 c1t1 c1t2"]
    );
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_worker_is_skipped_and_health_checks_bring_workers_back() {
    let engine = engine(1, None).await;
    let dead = dead_port().await;
    let gw = gateway(GatewayConfig {
        workers: vec![
            format!("http://{dead},id=7").parse().unwrap(),
            WorkerSpec::new(engine.url()),
        ],
        ..gateway_config(&[])
    })
    .await;
    // The dead one never became routable; requests succeed on the live one.
    assert_eq!(
        gw.dispatcher().routable_workers(),
        vec![kv_index::WorkerId(1)]
    );
    let s = short_chat_stream(&gw.url()).await;
    assert_eq!(s.worker, Some(1));
    // The engine stops: the health check takes it out; 503 follows.
    let engine_url = engine.url();
    engine.shutdown().await;
    wait_for(
        "the health check to drop the engine",
        Duration::from_secs(5),
        || gw.dispatcher().routable_workers().is_empty(),
    )
    .await;
    let (status, _, _) = short_chat_json(&gw.url()).await;
    assert_eq!(status, 503);
    // A worker comes back on the same address: routable again.
    let port: u16 = engine_url.rsplit(':').next().unwrap().parse().unwrap();
    let revived = start_engine(EngineServerConfig {
        listen: ([127, 0, 0, 1], port).into(),
        ..engine_config(1)
    })
    .await;
    wait_for(
        "the health check to bring it back",
        Duration::from_secs(5),
        || gw.dispatcher().routable_workers() == vec![kv_index::WorkerId(1)],
    )
    .await;
    let s = short_chat_stream(&gw.url()).await;
    assert!(s.done && s.error().is_none());
    shut_down(gw, vec![revived]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_cancels_the_worker_request() {
    let engine = slow_engine(5.0).await;
    let gw = gateway(gateway_config(&[&engine])).await;
    let running = || async {
        let text = reqwest::get(format!("{}/metrics", engine.url()))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        text.lines()
            .find(|l| l.starts_with("vllm:num_requests_running"))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
            .expect("vllm:num_requests_running")
    };
    // A reply that would take minutes at this speed.
    let response = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", gw.url()))
        .json(&chat(&[("user", "Tell me everything.")], 20_000, true))
        .send()
        .await
        .unwrap();
    let mut stream = response.bytes_stream();
    let mut chunks = 0;
    while chunks < 3 {
        use futures::StreamExt;
        stream.next().await.unwrap().unwrap();
        chunks += 1;
    }
    assert_eq!(running().await, 1.0);
    assert_eq!(gw.dispatcher().snapshot().workers[0].in_flight, 1);
    drop(stream);
    // The gateway drops its upstream response: the engine cancels the request, and the
    // router's accounting releases it.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while running().await != 0.0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the engine kept generating"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    wait_for(
        "the router to release the request",
        Duration::from_secs(5),
        || gw.dispatcher().snapshot().workers[0].in_flight == 0,
    )
    .await;
    let metrics = gw.metrics_text();
    assert!(
        metrics.contains("dynamo_frontend_inflight_requests{model=\"llama-3.1-70b-instruct\"} 0"),
        "{metrics}"
    );
    shut_down(gw, vec![engine]).await;
}
