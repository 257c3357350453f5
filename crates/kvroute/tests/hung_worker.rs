//! A hung worker must not hang its clients (issue 20): real `kvroute engine` processes behind a
//! `kvroute gateway`, one stopped with `SIGSTOP` (it keeps accepting connections and answers
//! nothing), then continued with `SIGCONT`; and a worker that passes its health checks but
//! never answers a completion. Requests routed to a silent worker are retried elsewhere after
//! the first-byte timeout, a stream whose worker stops ends with an error event after the
//! stall timeout (with `--migration-limit 0`; tests/migration.rs has the stream go on), and
//! the stopped worker is ejected, then probed back in once it answers and its ejection time
//! is over.

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use common::{Server, engines, get_json, get_text, wait_routable};
use futures::StreamExt;
use serde_json::{Value, json};

mod common;

fn chat(content: &str, max_tokens: u32, stream: bool) -> Value {
    json!({
        "model": "llama-3.1-70b-instruct",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "ignore_eos": true,
        "stream": stream,
    })
}

/// POSTs a chat; a gateway that leaves the client waiting 30 s fails the test.
async fn post(url: &str, body: &Value) -> reqwest::Response {
    reqwest::Client::new()
        .post(format!("{url}/v1/chat/completions"))
        .timeout(Duration::from_secs(30))
        .json(body)
        .send()
        .await
        .expect("the gateway answers")
}

fn served_by(response: &reqwest::Response) -> u64 {
    response.headers()["x-kvroute-worker"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap()
}

fn metric(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name} in\n{metrics}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_engine_costs_its_clients_a_retry_or_an_error_event_never_a_hang() {
    let engines = engines(3);
    let mut args = vec![
        "gateway",
        "--port",
        "0",
        "--router-mode",
        "round_robin",
        "--health-interval",
        "0.2",
        "--first-byte-timeout",
        "1.5",
        "--stall-timeout",
        "1",
        // The old behaviour of a stalled stream (tests/migration.rs migrates it), and a
        // short ejection so that a continued engine is probed back in at once.
        "--migration-limit",
        "0",
        "--ejection-time",
        "0.5",
    ];
    for engine in &engines {
        args.extend(["--worker", engine.url.as_str()]);
    }
    let gateway = Server::start(&args);
    let url = gateway.url.clone();
    wait_routable(&url, 3, Duration::from_secs(10)).await;

    // Stop engine 2 while it is still routable (its health check takes 2 s to fail): the
    // requests routed to it get nothing, time out and are served by another engine.
    engines[1].signal(libc::SIGSTOP);
    let started = Instant::now();
    let replies = futures::future::join_all((0..6).map(|i| {
        let url = url.clone();
        async move {
            let sent = Instant::now();
            let response = post(&url, &chat(&format!("Question {i}?"), 4, i % 2 == 0)).await;
            let status = response.status().as_u16();
            let worker = served_by(&response);
            let body = response.text().await.unwrap();
            (status, worker, body, sent.elapsed())
        }
    }))
    .await;
    for (status, worker, body, took) in &replies {
        assert_eq!(*status, 200, "{body}");
        assert_ne!(*worker, 2, "the stopped engine served: {body}");
        assert!(!body.contains("\"error\""), "{body}");
        assert!(*took < Duration::from_secs(8), "took {took:?}: {body}");
    }
    let metrics = get_text(&format!("{url}/metrics")).await;
    assert!(
        metric(&metrics, "kvroute_gateway_worker_timeouts_total") >= 1.0,
        "no request met the stopped engine in {:?}",
        started.elapsed()
    );
    wait_routable(&url, 2, Duration::from_secs(10)).await;

    // Continued, it answers its health check and is probed back in.
    engines[1].signal(libc::SIGCONT);
    wait_routable(&url, 3, Duration::from_secs(10)).await;

    // A long stream; stop its engine after a few chunks: the client gets an error event
    // after the stall timeout, not silence, and the engine is ejected.
    let response = post(&url, &chat("Tell me a long story.", 5000, true)).await;
    assert_eq!(response.status(), 200);
    let worker = served_by(&response);
    let stopped = &engines[usize::try_from(worker).unwrap() - 1];
    let mut stream = response.bytes_stream();
    let mut body = String::new();
    let mut stopped_at = None;
    let read = tokio::time::timeout(Duration::from_secs(20), async {
        while let Some(chunk) = stream.next().await {
            body.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
            if stopped_at.is_none() && body.matches("data: ").count() >= 3 {
                stopped.signal(libc::SIGSTOP);
                stopped_at = Some(Instant::now());
            }
        }
    })
    .await;
    assert!(read.is_ok(), "the client hung on a stopped engine:\n{body}");
    let stopped_at = stopped_at.expect("the stream ended before the stop");
    assert!(
        stopped_at.elapsed() < Duration::from_secs(6),
        "{:?}",
        stopped_at.elapsed()
    );
    assert!(body.contains("\"code\":\"worker_timeout\""), "{body}");
    assert!(body.trim_end().ends_with("data: [DONE]"), "{body}");
    wait_routable(&url, 2, Duration::from_secs(10)).await;
    // Nothing new goes to it meanwhile.
    for i in 0..4 {
        let response = post(&url, &chat(&format!("Short {i}."), 4, false)).await;
        assert_eq!(response.status(), 200);
        assert_ne!(served_by(&response), worker);
    }
    stopped.signal(libc::SIGCONT);
    wait_routable(&url, 3, Duration::from_secs(10)).await;
}

/// A worker that answers `/health` (and has no `/info`, like a foreign backend) but never
/// answers a completion: it accepts the request and holds the connection.
fn silent_worker() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for tcp in listener.incoming().map_while(Result::ok) {
            std::thread::spawn(move || serve_silently(tcp));
        }
    });
    format!("http://{addr}")
}

fn serve_silently(tcp: TcpStream) {
    let mut writer = tcp.try_clone().unwrap();
    let mut reader = BufReader::new(tcp);
    loop {
        let mut request_line = String::new();
        if reader.read_line(&mut request_line).unwrap_or(0) == 0 {
            return;
        }
        // Skip the headers.
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line).unwrap_or(0) == 0 {
                return;
            }
            if line == "\r\n" {
                break;
            }
        }
        let answer: &[u8] = if request_line.starts_with("GET /health") {
            b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
        } else if request_line.starts_with("GET ") {
            b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n"
        } else {
            // A completion: hold the connection, answer nothing, until the gateway hangs up.
            let mut rest = Vec::new();
            let _ = std::io::Read::read_to_end(&mut reader, &mut rest);
            return;
        };
        if writer.write_all(answer).is_err() {
            return;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_accepts_and_never_answers_costs_one_retry_then_stays_ejected() {
    let engine = Server::start(&["engine", "--port", "0", "--worker-id", "1"]);
    let silent = silent_worker();
    let gateway = Server::start(&[
        "gateway",
        "--port",
        "0",
        "--router-mode",
        "round_robin",
        "--health-interval",
        "0.2",
        "--first-byte-timeout",
        "1",
        "--worker",
        &engine.url,
        "--worker",
        &silent,
    ]);
    let url = gateway.url.clone();
    wait_routable(&url, 2, Duration::from_secs(10)).await;
    for i in 0..4 {
        let sent = Instant::now();
        let response = post(&url, &chat(&format!("Question {i}?"), 4, i % 2 == 1)).await;
        assert_eq!(response.status(), 200);
        assert_eq!(served_by(&response), 1);
        let body = response.text().await.unwrap();
        assert!(!body.contains("\"error\""), "{body}");
        assert!(
            sent.elapsed() < Duration::from_secs(5),
            "{:?}",
            sent.elapsed()
        );
    }
    let metrics = get_text(&format!("{url}/metrics")).await;
    assert_eq!(
        metric(&metrics, "kvroute_gateway_worker_timeouts_total"),
        1.0
    );
    // Its health check passes every 0.2 s, yet it stays ejected (the default ejection time
    // is 30 s): later requests do not meet it again.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let health = get_json(&format!("{url}/health")).await;
    assert_eq!(health["routable_workers"], 1, "{health}");
    for i in 0..4 {
        let response = post(&url, &chat(&format!("Again {i}?"), 4, false)).await;
        assert_eq!(response.status(), 200);
        assert_eq!(served_by(&response), 1);
    }
    let metrics = get_text(&format!("{url}/metrics")).await;
    assert_eq!(
        metric(&metrics, "kvroute_gateway_worker_timeouts_total"),
        1.0
    );
}
