//! `--max-connections` and the open-file limit, with real `kvroute engine` and `kvroute
//! gateway` processes: past the bound, extra clients get 503 `too_many_connections` JSON
//! while the ones within it are served; the soft open-file limit is raised to the hard one
//! at start-up; a bound the limit cannot serve, or 0, stops start-up with one message.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::time::Duration;

use common::{Server, kvroute};

/// Sends `GET /health` on a kept-alive connection and reads one answer: (status, text).
fn ask(stream: &mut TcpStream) -> (u16, String) {
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .expect("read timeout");
    stream
        .write_all(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")
        .expect("request sent");
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = stream.read(&mut buf).expect("an answer");
        got.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&got).to_string();
        if let Some(head_end) = text.find("\r\n\r\n") {
            let length: usize = text[..head_end]
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length: ")
                        .map(str::to_owned)
                })
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0);
            if got.len() >= head_end + 4 + length {
                let status = text[9..12].parse().expect("a status");
                return (status, text);
            }
        }
        assert!(n > 0, "connection closed before a whole answer: {text:?}");
    }
}

/// With `--max-connections 3`: three kept-alive clients are served, the next two are told
/// 503 `too_many_connections` JSON and closed, the three are still served.
fn serves_three_and_refuses_the_rest(server: &Server) {
    let mut served: Vec<TcpStream> = (0..3)
        .map(|_| TcpStream::connect(server.addr()).expect("connect"))
        .collect();
    for stream in &mut served {
        let (status, answer) = ask(stream);
        assert_eq!(status, 200, "{answer}");
    }
    for _ in 0..2 {
        let mut extra = TcpStream::connect(server.addr()).expect("connect");
        let (status, answer) = ask(&mut extra);
        assert_eq!(status, 503, "{answer}");
        let body = &answer[answer.find("\r\n\r\n").expect("a body") + 4..];
        let json: serde_json::Value = serde_json::from_str(body).expect("JSON body");
        assert_eq!(json["error"]["code"], "too_many_connections", "{json}");
        assert!(
            json["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("maximum of 3 client connections")),
            "{json}"
        );
        let mut rest = Vec::new();
        assert_eq!(
            extra.read_to_end(&mut rest).expect("closed, not reset"),
            0,
            "the refused connection is closed"
        );
    }
    for stream in &mut served {
        assert_eq!(ask(stream).0, 200);
    }
}

#[test]
fn engine_and_gateway_serve_max_connections_clients_and_refuse_the_extras_with_json() {
    let engine = Server::start(&[
        "engine",
        "--port",
        "0",
        "--speedup",
        "20",
        "--max-connections",
        "3",
    ]);
    assert!(
        engine
            .line_with("client connections")
            .contains("at most 3 client connections"),
    );
    serves_three_and_refuses_the_rest(&engine);

    let gateway = Server::start(&[
        "gateway",
        "--port",
        "0",
        "--worker",
        &engine.url,
        "--max-connections",
        "3",
    ]);
    serves_three_and_refuses_the_rest(&gateway);
}

/// `kvroute ARGS` with its open-file limit set to `soft`:`hard` before it starts.
fn with_open_file_limit(soft: u64, hard: u64) -> Command {
    let mut command = kvroute();
    // SAFETY: setrlimit is async-signal-safe and touches only the child being started.
    unsafe {
        command.pre_exec(move || {
            let limit = libc::rlimit {
                rlim_cur: soft,
                rlim_max: hard,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    command
}

#[test]
fn the_soft_open_file_limit_is_raised_to_the_hard_one_and_bounds_the_flag() {
    // Under 256:1024 the soft limit alone would allow 64 connections; raised: (1024-128)/2.
    let engine = Server::start_command(
        with_open_file_limit(256, 1024),
        &["engine", "--port", "0", "--speedup", "20"],
    );
    let line = engine.line_with("client connections");
    assert!(
        line.contains("at most 448 client connections; open-file limit 1024 (raised from 256)"),
        "{line}"
    );

    // More than the hard limit allows: refused before listening, saying what to do, once.
    let out = with_open_file_limit(256, 1024)
        .args([
            "gateway",
            "--port",
            "0",
            "--worker",
            "http://127.0.0.1:9",
            "--max-connections",
            "449",
        ])
        .output()
        .expect("kvroute runs");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--max-connections 449 is more than the open-file limit allows")
            && stderr.contains("at most 448 client connections")
            && stderr.contains("LimitNOFILE")
            && stderr.contains("ulimit"),
        "{stderr}"
    );
    assert_eq!(
        stderr.matches("--max-connections 449").count(),
        1,
        "{stderr}"
    );
    assert!(out.stdout.is_empty(), "nothing listened: {:?}", out.stdout);

    common::assert_failures(&[
        (
            &["engine", "--port", "0", "--max-connections", "0"],
            "--max-connections must be at least 1",
        ),
        (
            &["gateway", "--port", "0", "--max-connections", "0"],
            "--max-connections must be at least 1",
        ),
    ]);
}
