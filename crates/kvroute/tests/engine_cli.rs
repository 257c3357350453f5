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
            &["engine", "--nats", "nats://127.0.0.1:1", "--port", "0"],
            "cannot connect to NATS at nats://127.0.0.1:1",
        ),
    ]);
}
