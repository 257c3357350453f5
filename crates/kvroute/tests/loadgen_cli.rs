//! `kvroute loadgen` as a script or CI job runs it: a headless run (`--trace --headless`,
//! `--json`, `--run-for`) in which requests failed exits non-zero, after its summary or
//! report, with one last line on stderr counting the failures; a `--target` pasted as an
//! OpenAI SDK base URL (ending in `/v1`) is used without it, and said so; a target with
//! another path gets 404s that say what to check.

use std::path::PathBuf;
use std::process::Output;

mod common;

use common::{engines, kvroute};

fn shipped() -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../traces/mooncake_conversation_trace.jsonl")
        .display()
        .to_string()
}

/// A loopback URL nothing listens on (a port just bound and released).
fn nothing_listening() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    drop(listener);
    format!("http://127.0.0.1:{port}")
}

fn run(args: &[&str]) -> Output {
    kvroute().args(args).output().expect("kvroute runs")
}

fn last_stderr_line(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr)
        .lines()
        .last()
        .unwrap_or_default()
        .to_owned()
}

#[test]
fn a_headless_replay_with_failed_requests_exits_non_zero_after_its_summary() {
    let target = nothing_listening();
    let trace = shipped();
    let args = [
        "loadgen",
        "--target",
        &target,
        "--trace",
        &trace,
        "--trace-limit",
        "5",
        "--trace-speed",
        "100",
    ];
    let mut headless = args.to_vec();
    headless.push("--headless");
    let out = run(&headless);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "{stdout}");
    assert_eq!(out.status.code(), Some(1));
    // The summary first, as before, then the verdict.
    assert!(stdout.contains("0 finished, 5 failed"), "{stdout}");
    assert!(stdout.contains("  error: connection:"), "{stdout}");
    assert_eq!(
        last_stderr_line(&out),
        "error: 5 of 5 requests failed (why: the errors above)"
    );

    let mut json = args.to_vec();
    json.push("--json");
    let out = run(&json);
    assert_eq!(out.status.code(), Some(1));
    let status: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("--json still prints the summary as JSON");
    assert_eq!(
        (&status["finished"], &status["failed"]),
        (&0.into(), &5.into())
    );
    assert_eq!(
        last_stderr_line(&out),
        "error: 5 of 5 requests failed (why: `errors` in the JSON above)"
    );
}

#[test]
fn a_run_for_measurement_with_failed_requests_exits_non_zero_after_its_report() {
    let target = nothing_listening();
    let report = std::env::temp_dir().join(format!(
        "kvroute-loadgen-cli-{}-report.json",
        std::process::id()
    ));
    let _ = std::fs::remove_file(&report);
    let out = run(&[
        "loadgen",
        "--target",
        &target,
        "--port",
        "0",
        "--no-baseline",
        "--no-gateway-metrics",
        "--concurrency",
        "2",
        "--start",
        "--run-for",
        "1",
        "--report",
        report.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    // The figures and the report, as before.
    assert!(stdout.contains("report: "), "{stdout}");
    let written: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&report).expect("the report is written"))
            .unwrap();
    let _ = std::fs::remove_file(&report);
    let errors = written["lanes"][0]["metrics"]["errors"].as_u64().unwrap();
    let finished = written["lanes"][0]["metrics"]["requests"].as_u64().unwrap();
    assert!(errors > 0, "{written}");
    let last = last_stderr_line(&out);
    assert!(
        last.starts_with(&format!(
            "error: {errors} of {} requests failed; the latest: connection: ",
            errors + finished
        )),
        "{last}"
    );
}

#[test]
fn a_target_ending_in_v1_is_used_without_it_and_another_path_gets_a_hint() {
    let engine = engines(1).remove(0);
    let trace = shipped();
    let replay = |target: &str| {
        run(&[
            "loadgen",
            "--target",
            target,
            "--trace",
            &trace,
            "--trace-limit",
            "3",
            "--trace-speed",
            "50",
            "--json",
        ])
    };
    // As an OpenAI SDK's base URL is written, with and without the final slash.
    for pasted in [format!("{}/v1", engine.url), format!("{}/v1/", engine.url)] {
        let out = replay(&pasted);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{pasted}: {stderr}");
        assert!(
            stderr.contains(&format!(
                "kvroute loadgen: note: --target {pasted} ends in /v1; using {}",
                engine.url
            )),
            "{stderr}"
        );
        assert!(
            stderr.contains(&format!("against {}/v1/completions", engine.url)),
            "{stderr}"
        );
        let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(
            (&status["finished"], &status["failed"]),
            (&3.into(), &0.into())
        );
    }
    // Another path is kept: every request is a 404, which says what to check.
    let out = replay(&format!("{}/openai", engine.url));
    assert_eq!(out.status.code(), Some(1));
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(status["failed"], 3, "{status}");
    let error = status["errors"][0].as_str().unwrap();
    assert!(
        error.starts_with("HTTP 404: ")
            && error.contains(&format!(
                "(POST {}/openai/v1/completions: is the target the server's base URL, without \
                 /v1 or another path, and the model one it serves?)",
                engine.url
            )),
        "{error}"
    );
    assert_eq!(
        last_stderr_line(&out),
        "error: 3 of 3 requests failed (why: `errors` in the JSON above)"
    );
}
