//! `kvroute engine` as a script runs it: start on port 0, read the address from stdout, serve a
//! request, stop cleanly on SIGTERM; bad arguments fail with a clear error.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::Duration;

mod common;

use common::{Running, kvroute};

/// One HTTP/1.1 request with `Connection: close`; returns (status, body).
fn http(addr: &str, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let status = response[9..12].parse().unwrap();
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

#[test]
fn engine_serves_and_stops_on_sigterm() {
    let child = kvroute()
        .args([
            "engine",
            "--port",
            "0",
            "--speedup",
            "1000",
            "--worker-id",
            "5",
        ])
        .args(["--model", "tiny", "--profile", "h100-llama8b"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut child = Running(child);
    let mut stdout = BufReader::new(child.0.stdout.take().unwrap());
    let mut line = String::new();
    stdout.read_line(&mut line).unwrap();
    assert!(line.contains("worker 5"), "{line}");
    assert!(line.contains("h100-llama8b"), "{line}");
    let addr = line.rsplit("http://").next().unwrap().trim().to_string();

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

    let pid = child.0.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = child.0.try_wait().unwrap() {
            break status;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no exit after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "clean exit on SIGTERM: {status}");
}

#[test]
fn engine_refuses_bad_arguments_with_a_clear_error() {
    let cases: [(&[&str], &str); 3] = [
        (&["--speedup", "0"], "--speedup must be a positive number"),
        (&["--profile", "a100-nope"], "unknown profile"),
        (
            &["--nats", "nats://127.0.0.1:1", "--port", "0"],
            "cannot connect to NATS at nats://127.0.0.1:1",
        ),
    ];
    for (args, expected) in cases {
        let out = kvroute().arg("engine").args(args).output().unwrap();
        assert!(!out.status.success(), "{args:?} should fail");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
    }
}
