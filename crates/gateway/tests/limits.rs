//! Deadlines and caps as a hostile client or a broken worker meets them: bodies that never
//! finish, partial headers, idle keep-alive connections, oversized headers, wrong methods, a
//! worker that never answers, one that stalls mid-stream, one whose reply never ends. Every
//! case ends in bounded time with OpenAI-style JSON (or a closed connection), never a hang.

mod common;

use std::time::{Duration, Instant};

use common::fake_worker::{FakeWorker, Script};
use common::*;
use gateway::{GatewayConfig, Timeouts, WorkerSpec};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Deadlines short enough for a test, each distinct from the others.
fn short_timeouts() -> Timeouts {
    Timeouts {
        connect: Duration::from_secs(1),
        first_byte: Duration::from_secs(1),
        stall: Duration::from_secs(1),
        header: Duration::from_millis(800),
        body: Duration::from_millis(1200),
    }
}

/// A round-robin gateway over `workers` with [`short_timeouts`].
fn config(workers: Vec<WorkerSpec>) -> GatewayConfig {
    GatewayConfig {
        timeouts: short_timeouts(),
        ..round_robin(workers)
    }
}

/// Reads until the server closes the connection, for at most `limit`: what it sent, and
/// whether it closed in time.
async fn read_until_closed(stream: &mut TcpStream, limit: Duration) -> (String, bool) {
    let mut received = Vec::new();
    let closed = tokio::time::timeout(limit, async {
        let mut chunk = [0u8; 4096];
        loop {
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => break,
                Ok(n) => received.extend_from_slice(&chunk[..n]),
            }
        }
    })
    .await
    .is_ok();
    (String::from_utf8_lossy(&received).into_owned(), closed)
}

/// The status and JSON body of one raw HTTP/1.1 response.
fn status_and_json(response: &str) -> (u16, Value) {
    let status = response
        .get(9..12)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP response: {response:?}"));
    let body = response.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    let json = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {response:?}"));
    (status, json)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_declaring_a_big_body_and_sending_one_byte_get_408_and_are_closed() {
    let gw = gateway(config(vec![])).await;
    let addr = gw.local_addr();
    let started = Instant::now();
    let mut connections = Vec::new();
    for _ in 0..40 {
        let mut tcp = TcpStream::connect(addr).await.unwrap();
        let head = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: \
             application/json\r\nContent-Length: {}\r\n\r\n{{",
            16 << 20
        );
        tcp.write_all(head.as_bytes()).await.unwrap();
        connections.push(tcp);
    }
    let answers = futures::future::join_all(
        connections
            .iter_mut()
            .map(|tcp| read_until_closed(tcp, Duration::from_secs(10))),
    )
    .await;
    for (response, closed) in answers {
        assert!(closed, "the connection stayed open: {response:?}");
        let (status, body) = status_and_json(&response);
        assert_eq!(status, 408, "{body}");
        assert_eq!(body["error"]["code"], "request_timeout", "{body}");
    }
    // The body deadline (1.2 s), not a client's patience, ended them.
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "{:?}",
        started.elapsed()
    );
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partial_header_and_an_idle_keep_alive_connection_are_closed() {
    let gw = gateway(config(vec![])).await;
    let addr = gw.local_addr();

    let mut partial = TcpStream::connect(addr).await.unwrap();
    partial
        .write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    let (_, closed) = read_until_closed(&mut partial, Duration::from_secs(5)).await;
    assert!(closed, "a partial header kept its connection");

    let mut idle = TcpStream::connect(addr).await.unwrap();
    idle.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let started = Instant::now();
    let (response, closed) = read_until_closed(&mut idle, Duration::from_secs(5)).await;
    assert!(response.starts_with("HTTP/1.1 503"), "{response:?}");
    assert!(closed, "an idle keep-alive connection stayed open");
    assert!(
        started.elapsed() >= Duration::from_millis(500),
        "closed before idling"
    );
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_methods_oversized_headers_and_bodies_get_openai_json() {
    let gw = gateway(GatewayConfig {
        max_body_bytes: 8 << 10,
        ..config(vec![])
    })
    .await;
    let url = gw.url();
    let client = reqwest::Client::new();
    let error_of = |status: u16, body: &Value, code: &str| {
        assert_eq!(body["error"]["code"], code, "{status}: {body}");
        assert!(
            body["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty())
        );
    };

    let response = client
        .get(format!("{url}/v1/chat/completions"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 405);
    assert_eq!(response.headers()["allow"], "POST");
    error_of(405, &response.json().await.unwrap(), "method_not_allowed");
    let response = client.post(format!("{url}/metrics")).send().await.unwrap();
    assert_eq!(response.status(), 405);
    error_of(405, &response.json().await.unwrap(), "method_not_allowed");

    let mut many = client.get(format!("{url}/health"));
    for i in 0..150 {
        many = many.header(format!("x-filler-{i}"), "v");
    }
    let response = many.send().await.unwrap();
    assert_eq!(response.status(), 431);
    error_of(
        431,
        &response.json().await.unwrap(),
        "request_headers_too_large",
    );
    let response = client
        .get(format!("{url}/health"))
        .header("x-filler", "v".repeat(100 << 10))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 431);
    error_of(
        431,
        &response.json().await.unwrap(),
        "request_headers_too_large",
    );

    // A chunked body (no Content-Length) over the cap: counted as it arrives, refused as
    // soon as it is over (the client has not even finished sending).
    let mut tcp = TcpStream::connect(gw.local_addr()).await.unwrap();
    tcp.write_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
          Transfer-Encoding: chunked\r\n\r\n",
    )
    .await
    .unwrap();
    for _ in 0..9 {
        tcp.write_all(format!("400\r\n{}\r\n", " ".repeat(1024)).as_bytes())
            .await
            .unwrap();
    }
    let (response, _) = read_until_closed(&mut tcp, Duration::from_secs(5)).await;
    let (status, body) = status_and_json(&response);
    assert_eq!(status, 413);
    error_of(413, &body, "payload_too_large");
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_never_answers_costs_one_timeout_and_a_retry() {
    let silent = FakeWorker::start(Script::Hang).await;
    let good = FakeWorker::start(Script::Complete { tokens: 3 }).await;
    let gw = gateway(config(vec![
        WorkerSpec::new(silent.url()),
        WorkerSpec::new(good.url()),
    ]))
    .await;
    for stream in [false, true, false, true] {
        let started = Instant::now();
        let request = chat(&[("user", "hello")], 3, stream);
        let answered = tokio::time::timeout(Duration::from_secs(10), async {
            if stream {
                let reply = post_stream(&gw.url(), "/v1/chat/completions", &request).await;
                assert_eq!(reply.status, 200, "{:?}", reply.chunks);
                assert!(reply.done && reply.error().is_none(), "{:?}", reply.chunks);
            } else {
                let (status, _, body) =
                    post_json(&gw.url(), "/v1/chat/completions", &request).await;
                assert_eq!(status, 200, "{body}");
            }
        })
        .await;
        assert!(answered.is_ok(), "the client was left waiting");
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
    }
    assert!(
        !gw.metrics_text()
            .contains("kvroute_gateway_worker_timeouts_total 0"),
        "no timeout was counted"
    );
    gw.shutdown().await;
}

/// A worker that is only busy is not a silent one: a burst of long prompts queues on one real
/// engine (in real time) for several first-byte timeouts, while the engine streams the replies
/// it has reached. Every request is answered, nothing is counted as a timeout, and the worker
/// stays in the routing set (it used to be ejected at the first deadline, and the burst got
/// 503s for the next 30 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_worker_is_waited_for_past_the_first_byte_timeout_and_never_ejected() {
    // Eight times real time: an engine step with a full prefill chunk takes a fraction of a
    // second, so the worker streams something within every 1 s timeout while its queue is
    // several seconds long.
    let engine = slow_engine(8.0).await;
    let gw = gateway(GatewayConfig {
        timeouts: short_timeouts(),
        ..gateway_config(&[&engine])
    })
    .await;
    let started = Instant::now();
    let replies = futures::future::join_all((0..32).map(|c| {
        let url = gw.url();
        async move {
            // About 5,000 tokens each: the burst's prefill is several seconds of the engine's.
            let prompt = passage(c, 3_700);
            let request = chat(&[("user", &prompt)], 5, c % 2 == 0);
            if c % 2 == 0 {
                let reply = post_stream(&url, "/v1/chat/completions", &request).await;
                (reply.status, reply.error().cloned())
            } else {
                let (status, _, body) = post_json(&url, "/v1/chat/completions", &request).await;
                (status, (status != 200).then_some(body))
            }
        }
    }))
    .await;
    let took = started.elapsed();
    for (status, error) in &replies {
        assert_eq!((*status, error), (200, &None), "{replies:?}");
    }
    assert!(
        took > Duration::from_millis(1_500),
        "the burst did not queue past the 1 s first-byte timeout ({took:?}): the test proves nothing"
    );
    let metrics = gw.metrics_text();
    assert!(
        metrics.contains("kvroute_gateway_worker_timeouts_total 0"),
        "{metrics}"
    );
    assert_eq!(
        gw.dispatcher().routable_workers(),
        vec![kv_index::WorkerId(0)],
        "the busy worker was ejected"
    );
    gw.shutdown().await;
    engine.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_stalls_ends_with_an_error_event() {
    let stalling = FakeWorker::start(Script::StallAfter { tokens: 3 }).await;
    let gw = gateway(config(vec![WorkerSpec::new(stalling.url())])).await;
    let started = Instant::now();
    let reply = tokio::time::timeout(
        Duration::from_secs(10),
        post_stream(
            &gw.url(),
            "/v1/chat/completions",
            &chat(&[("user", "hello")], 50, true),
        ),
    )
    .await
    .expect("the stream ended (no silent stall)");
    assert_eq!(reply.status, 200);
    assert_eq!(reply.text(), " w0 w1 w2");
    let error = reply.error().expect("an error event");
    assert_eq!(error["code"], "worker_timeout", "{error}");
    assert!(reply.done);
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    assert!(
        gw.metrics_text()
            .contains("kvroute_gateway_worker_timeouts_total 1"),
    );
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_that_never_ends_gets_the_client_a_502_at_the_cap() {
    for (script, code) in [
        (Script::Flood, "response_too_large"),
        (Script::FloodJson, "worker_failed"),
    ] {
        let worker = FakeWorker::start(script).await;
        let gw = gateway(GatewayConfig {
            max_response_bytes: 1 << 20,
            ..config(vec![WorkerSpec::new(worker.url())])
        })
        .await;
        let started = Instant::now();
        let (status, _, body) = tokio::time::timeout(
            Duration::from_secs(30),
            post_json(
                &gw.url(),
                "/v1/chat/completions",
                &chat(&[("user", "hello")], 4, false),
            ),
        )
        .await
        .expect("an answer, not a reply gathered without end");
        assert_eq!(status, 502, "{body}");
        assert_eq!(body["error"]["code"], code, "{body}");
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{:?}",
            started.elapsed()
        );
        gw.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_over_its_rate_limit_gets_429_with_retry_after() {
    // Slow enough (one request per 100 s after a burst of 3) that the test's own pace
    // cannot refill a token.
    let limit = gateway::rate_limit::RateLimit::new(0.01, Some(3)).unwrap();
    let gw = gateway(GatewayConfig {
        rate_limit: Some(limit),
        ..config(vec![])
    })
    .await;
    let url = gw.url();
    let client = reqwest::Client::new();
    for _ in 0..3 {
        let response = client.get(format!("{url}/v1/models")).send().await.unwrap();
        assert_eq!(response.status(), 200);
    }
    let refused = client.get(format!("{url}/v1/models")).send().await.unwrap();
    assert_eq!(refused.status(), 429);
    let retry_after: u64 = refused.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=100).contains(&retry_after), "{retry_after}");
    let body: Value = refused.json().await.unwrap();
    assert_eq!(body["error"]["code"], "rate_limit_exceeded", "{body}");
    assert_eq!(body["error"]["type"], "rate_limit_error", "{body}");
    // A completion is refused the same way, before its body is read.
    let (status, _, body) = short_chat_json(&url).await;
    assert_eq!(status, 429, "{body}");
    // Probes and Prometheus are not limited.
    for path in ["/health", "/metrics"] {
        let response = client.get(format!("{url}{path}")).send().await.unwrap();
        assert_ne!(response.status(), 429, "{path}");
    }
    gw.shutdown().await;
}
