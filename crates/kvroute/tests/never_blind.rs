//! The README's set-up, flag for flag: engines started alike (no `--worker-id`, no event
//! flags) behind a gateway given only their URLs. The engines publish their KV events by
//! default, the gateway subscribes by itself, and a conversation's later turns find its
//! history cached; nothing routes blind.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::Stdio;
use std::sync::mpsc;
use std::time::Duration;

use serde_json::{Value, json};

mod common;

use common::{Running, kvroute};

/// Starts `kvroute ARGS`; returns it, its address, and its stdout lines as they come.
fn start(args: &[&str]) -> (Running, String, mpsc::Receiver<String>) {
    let child = kvroute()
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn kvroute");
    let mut running = Running(child);
    let stdout = BufReader::new(running.0.stdout.take().expect("stdout"));
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in stdout.lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let first = rx
        .recv_timeout(Duration::from_secs(60))
        .unwrap_or_else(|_| panic!("kvroute {args:?} printed nothing"));
    let addr = first
        .rsplit("http://")
        .next()
        .unwrap_or_else(|| panic!("no address in {first:?}"))
        .trim()
        .to_string();
    (running, addr, rx)
}

fn chat(addr: &str, messages: &[Value]) -> Value {
    let body = json!({
        "model": "llama-3.1-70b-instruct", "messages": messages,
        "max_tokens": 16, "ignore_eos": true,
    })
    .to_string();
    let mut stream = TcpStream::connect(addr).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .expect("timeout");
    write!(
        stream,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .expect("send");
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("read");
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    response
        .split_once("\r\n\r\n")
        .and_then(|(_, b)| serde_json::from_str(b).ok())
        .unwrap_or_else(|| panic!("no JSON body: {response}"))
}

#[test]
fn engines_started_alike_behind_a_plain_gateway_give_cache_hits() {
    let engine = |_| start(&["engine", "--port", "0", "--speedup", "100"]);
    let engines: Vec<_> = (0..2).map(engine).collect();
    let urls: Vec<String> = engines
        .iter()
        .map(|(_, addr, _)| format!("http://{addr}"))
        .collect();
    let mut args = vec!["gateway", "--port", "0"];
    for url in &urls {
        args.extend(["--worker", url.as_str()]);
    }
    let (_gateway, addr, lines) = start(&args);

    // Both engines are routable (distinct ids) and each one's cache view is its events.
    let views: Vec<String> = (0..2)
        .map(|_| {
            lines
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
        let reply = chat(&addr, &messages);
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
