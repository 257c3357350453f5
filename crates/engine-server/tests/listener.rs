//! The engine server's listener (the gateway's, shared: `protocol::listener`) as a slow or
//! idle client meets it over real TCP: a partial header, an idle keep-alive connection and a
//! body that never finishes are each closed or answered within their deadline; oversized
//! headers get JSON.

mod common;

use std::time::{Duration, Instant};

use common::{config, start};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Reads until the server closes the connection, for at most `limit`: what it sent, and
/// whether it closed in time.
async fn read_until_closed(stream: &mut TcpStream, limit: Duration) -> (String, bool) {
    let mut received = Vec::new();
    let closed = tokio::time::timeout(limit, async {
        let mut buf = [0u8; 4096];
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => received.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await
    .is_ok();
    (String::from_utf8_lossy(&received).into_owned(), closed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_and_idle_clients_are_cut_off_at_their_deadlines() {
    let mut cfg = config(100.0);
    cfg.header_timeout = Duration::from_millis(800);
    cfg.body_timeout = Duration::from_millis(1200);
    let (server, base) = start(cfg).await;
    let addr = server.local_addr();

    // A partial header (slowloris).
    let mut partial = TcpStream::connect(addr).await.unwrap();
    partial
        .write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    let (_, closed) = read_until_closed(&mut partial, Duration::from_secs(5)).await;
    assert!(closed, "a partial header kept its connection");

    // An idle keep-alive connection after one answered request.
    let mut idle = TcpStream::connect(addr).await.unwrap();
    idle.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let started = Instant::now();
    let (response, closed) = read_until_closed(&mut idle, Duration::from_secs(5)).await;
    assert!(response.starts_with("HTTP/1.1 200"), "{response:?}");
    assert!(closed, "an idle keep-alive connection stayed open");
    assert!(
        started.elapsed() >= Duration::from_millis(500),
        "closed before idling"
    );

    // A body declared at 1 MiB, one byte sent: 408 JSON after the body deadline.
    let mut trickle = TcpStream::connect(addr).await.unwrap();
    trickle
        .write_all(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
              Content-Length: 1048576\r\n\r\n{",
        )
        .await
        .unwrap();
    let (response, closed) = read_until_closed(&mut trickle, Duration::from_secs(5)).await;
    assert!(response.starts_with("HTTP/1.1 408"), "{response:?}");
    assert!(response.contains("request_timeout"), "{response:?}");
    assert!(closed, "the trickling connection stayed open");

    // 150 headers: 431 with OpenAI error JSON.
    let mut request = reqwest::Client::new().get(format!("{base}/health"));
    for i in 0..150 {
        request = request.header(format!("x-h{i}"), "v");
    }
    let response = request.send().await.unwrap();
    assert_eq!(response.status(), 431);
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(body["error"]["code"], "request_headers_too_large", "{body}");
    server.shutdown().await;
}
