//! The shared listener's connection bound (`protocol::listener::serve_with_limit`): past it a
//! client gets a 503 `too_many_connections` JSON answer and a closed connection, and a slot
//! freed by a closing client is served again. Needs the `axum` feature (on in the workspace's
//! test build, through the servers that enable it).
#![cfg(feature = "axum")]

use std::time::Duration;

use axum::Router;
use axum::routing::get;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const REQUEST: &[u8] = b"GET /ok HTTP/1.1\r\nHost: test\r\n\r\n";

/// Sends one request on `stream` and reads one answer: (status, headers and body as text).
async fn ask(stream: &mut TcpStream) -> (u16, String) {
    stream.write_all(REQUEST).await.unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf))
            .await
            .expect("an answer within 5 s")
            .unwrap();
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
                let status = text[9..12].parse().unwrap();
                return (status, text);
            }
        }
        assert!(n > 0, "connection closed before a whole answer: {text:?}");
    }
}

#[tokio::test]
async fn past_its_connection_bound_a_server_answers_503_json_and_serves_again_when_one_closes() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = Router::new().route("/ok", get(|| async { "ok" }));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(protocol::listener::serve_with_limit(
        listener,
        app,
        Duration::from_secs(30),
        2,
        async move {
            let _ = stopped.await;
        },
    ));

    // Two kept-alive connections take both slots.
    let mut first = TcpStream::connect(addr).await.unwrap();
    let mut second = TcpStream::connect(addr).await.unwrap();
    assert_eq!(ask(&mut first).await.0, 200);
    assert_eq!(ask(&mut second).await.0, 200);

    // A third is told why, then closed.
    let mut third = TcpStream::connect(addr).await.unwrap();
    let (status, answer) = ask(&mut third).await;
    assert_eq!(status, 503, "{answer}");
    assert!(
        answer.contains("\"code\":\"too_many_connections\""),
        "{answer}"
    );
    assert!(
        answer.contains("maximum of 2 client connections"),
        "{answer}"
    );
    assert!(
        answer.to_ascii_lowercase().contains("retry-after: 1"),
        "{answer}"
    );
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(5), third.read_to_end(&mut rest)).await;
    assert!(
        matches!(closed, Ok(Ok(0))),
        "the refused connection is closed: {closed:?}"
    );

    // The served connections are unaffected; once one closes, a new client is served.
    assert_eq!(ask(&mut second).await.0, 200);
    drop(first);
    let mut served = false;
    for _ in 0..50 {
        let mut next = TcpStream::connect(addr).await.unwrap();
        if ask(&mut next).await.0 == 200 {
            served = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(served, "a freed slot is served again");

    let _ = stop.send(());
    drop(second);
    let _ = tokio::time::timeout(Duration::from_secs(5), server).await;
}

#[test]
fn the_default_bound_leaves_a_descriptor_for_each_connection_of_the_servers_own() {
    let max = protocol::listener::default_max_connections();
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit only writes the struct it is given.
    assert_eq!(
        unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) },
        0
    );
    if limit.rlim_cur != libc::RLIM_INFINITY {
        assert!(max >= 1);
        assert!(
            2 * max as u64 <= limit.rlim_cur,
            "{max} of {}",
            limit.rlim_cur
        );
    }
}
