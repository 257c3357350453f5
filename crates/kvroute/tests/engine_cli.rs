//! `kvroute engine` as a script runs it: start on port 0, read the address from stdout, serve a
//! request, stop cleanly on SIGTERM; bad arguments fail with a clear error.

use std::time::Duration;

mod common;

use common::{Server, assert_failures, http};

#[test]
fn engine_serves_and_stops_on_sigterm() {
    let mut engine = Server::start(&[
        "engine",
        "--port",
        "0",
        "--speedup",
        "1000",
        "--worker-id",
        "5",
        "--model",
        "tiny",
        "--profile",
        "h100-llama8b",
    ]);
    let line = &engine.line;
    assert!(line.contains("worker 5"), "{line}");
    assert!(line.contains("h100-llama8b"), "{line}");
    let addr = engine
        .url
        .strip_prefix("http://")
        .expect("an http:// URL")
        .to_string();

    let (status, body) = http(&addr, "GET", "/health", "");
    assert_eq!(status, 200, "{body}");
    let (status, body) = http(
        &addr,
        "POST",
        "/v1/chat/completions",
        r#"{"model":"tiny","messages":[{"role":"user","content":"hi"}],"max_tokens":12,"ignore_eos":true}"#,
    );
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"completion_tokens\":12"), "{body}");
    let (status, body) = http(&addr, "GET", "/info", "");
    assert_eq!(status, 200);
    assert!(body.contains("\"worker\":5"), "{body}");
    // vLLM's replay socket is on by default, announced beside the event endpoint.
    assert!(
        body.contains("\"zmq_replay_endpoint\":\"tcp://127.0.0.1:"),
        "{body}"
    );

    let status = engine.running.stop(libc::SIGTERM, Duration::from_secs(10));
    assert!(status.success(), "clean exit on SIGTERM: {status}");
}

#[test]
fn engine_refuses_bad_arguments_with_a_clear_error() {
    assert_failures(&[
        (
            &["engine", "--speedup", "0"],
            "--speedup must be a positive number",
        ),
        (&["engine", "--profile", "a100-nope"], "unknown profile"),
        (
            &[
                "engine",
                "--profile",
                "h100-llama8b",
                "--spec-decode",
                "draft",
            ],
            "has no speculative-decoding configurations",
        ),
        (
            &[
                "engine",
                "--spec-decode",
                "eagle3",
                "--acceptance-rate",
                "1.5",
            ],
            "--acceptance-rate must be a probability",
        ),
        (
            &["engine", "--draft-len", "3"],
            "need --spec-decode draft|eagle3",
        ),
        (
            &["engine", "--nats", "nats://127.0.0.1:1", "--port", "0"],
            "cannot connect to NATS at nats://127.0.0.1:1",
        ),
        (
            &["engine", "--role", "producer"],
            "expected both, prefill or decode",
        ),
        (&["engine", "--kv-link", "pcie"], "nvlink"),
        (
            &["engine", "--zmq-replay", "5558"],
            "--zmq-replay must be auto, off or a ZMQ endpoint",
        ),
        (
            &[
                "engine",
                "--zmq-pub",
                "off",
                "--zmq-replay",
                "tcp://127.0.0.1:5558",
            ],
            "it needs --zmq-pub on",
        ),
        (
            &["engine", "--zmq-replay-buffer", "0"],
            "--zmq-replay-buffer must be at least 1 batch",
        ),
    ]);
}

/// Reads one sample's value from a Prometheus text body: the line starting with `series`.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(series))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// `kvroute engine --spec-decode eagle3` exports vLLM's and TensorRT-LLM's speculative
/// decoding series on /metrics, read here over HTTP after a request.
#[test]
fn engine_with_eagle3_exports_speculative_metrics() {
    let engine = Server::start(&[
        "engine",
        "--port",
        "0",
        "--speedup",
        "1000",
        "--profile",
        "h100-tp4-llama70b-fp8",
        "--spec-decode",
        "eagle3",
    ]);
    let addr = engine.addr();
    let spec_line = engine.line_with("speculative decoding");
    assert!(
        spec_line.contains("speculative decoding eagle3 (K = 5"),
        "{spec_line}"
    );

    let (status, body) = http(
        addr,
        "POST",
        "/v1/chat/completions",
        r#"{"model":"llama-3.1-70b-instruct","messages":[{"role":"user","content":"Tell me about the tides."}],"max_tokens":400,"ignore_eos":true}"#,
    );
    assert_eq!(status, 200, "{body}");
    let (status, text) = http(addr, "GET", "/metrics", "");
    assert_eq!(status, 200);
    let get =
        |series: &str| sample(&text, series).unwrap_or_else(|| panic!("{series} missing:\n{text}"));
    let drafts = get("vllm:spec_decode_num_drafts_total{");
    let drafted = get("vllm:spec_decode_num_draft_tokens_total{");
    let accepted = get("vllm:spec_decode_num_accepted_tokens_total{");
    // 399 tokens after the first, K = 5 per draft.
    assert!(drafts > 50.0 && drafts < 399.0, "{drafts}");
    assert_eq!(drafted, 5.0 * drafts);
    assert!(accepted > 0.0 && accepted < drafted);
    let per_pos: Vec<f64> = (0..5)
        .map(|j| get(&format!("vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name=\"llama-3.1-70b-instruct\",position=\"{j}\"}}")))
        .collect();
    assert_eq!(per_pos.iter().sum::<f64>(), accepted);
    assert!(per_pos.windows(2).all(|w| w[0] >= w[1]), "{per_pos:?}");
    assert_eq!(get("trtllm_spec_decode_num_draft_tokens_total{"), drafted);
    assert_eq!(
        get("trtllm_spec_decode_num_accepted_tokens_total{"),
        accepted
    );
    let length = get("trtllm_spec_decode_acceptance_length{");
    assert!(length > 1.0 && length <= 6.0, "{length}");
    let overhead = get("trtllm_spec_decode_draft_overhead{");
    assert!(overhead > 0.0 && overhead < 0.5, "{overhead}");
    let alpha = get("kvroute_engine_spec_acceptance_rate{");
    assert!((0.5..1.0).contains(&alpha), "{alpha}");

    // /info declares the settings, and its timing (what kv_load prices) is the speculative
    // one: each token of context is read for fewer steps per generated token than plain.
    let (status, info) = http(addr, "GET", "/info", "");
    assert_eq!(status, 200, "{info}");
    let info: serde_json::Value = serde_json::from_str(&info).unwrap();
    let spec = &info["speculative"];
    assert_eq!(spec["method"], "eagle3", "{info}");
    assert_eq!(spec["draft_len"], 5, "{info}");
    let tokens_per_step = spec["tokens_per_step"].as_f64().unwrap();
    assert!((2.0..6.0).contains(&tokens_per_step), "{info}");
    let plain = Server::start(&[
        "engine",
        "--port",
        "0",
        "--profile",
        "h100-tp4-llama70b-fp8",
    ]);
    let (_, plain_info) = http(plain.addr(), "GET", "/info", "");
    let plain_info: serde_json::Value = serde_json::from_str(&plain_info).unwrap();
    assert!(plain_info.get("speculative").is_none(), "{plain_info}");
    let per_context =
        |card: &serde_json::Value| card["decode_secs_per_context_token"].as_f64().unwrap();
    assert!(
        per_context(&info) < per_context(&plain_info) / 1.5,
        "{info}\n{plain_info}"
    );
}
