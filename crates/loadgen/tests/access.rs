//! Who may use the control API, over real HTTP and WebSockets: cross-origin requests and
//! non-JSON POSTs are refused even on loopback, a token is required off loopback, and every
//! refusal is OpenAI error JSON.

use std::time::Duration;

use loadgen::{LaneSpec, Loadgen, LoadgenError};
use reqwest::header::{AUTHORIZATION, CONTENT_TYPE, HOST, ORIGIN};
use serde_json::{Value, json};
use tokio_tungstenite::tungstenite;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;

mod common;

use common::{MODEL, loadgen_config};

/// A lane whose target refuses connections: the workload starts (its turns fail), which is
/// all these tests need.
fn dead_lane() -> LaneSpec {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead = format!("http://{}", listener.local_addr().unwrap());
    drop(listener);
    let mut lane = LaneSpec::for_gateway("live", None, &dead, MODEL);
    lane.gateway_metrics = None;
    lane
}

async fn answer(request: reqwest::RequestBuilder) -> (u16, Value) {
    let response = request.send().await.expect("request");
    let status = response.status().as_u16();
    let is_json = response
        .headers()
        .get(CONTENT_TYPE)
        .is_some_and(|v| v.to_str().unwrap().starts_with("application/json"));
    let body: Value = response.json().await.unwrap_or(Value::Null);
    assert!(is_json, "a {status} answer is JSON: {body}");
    (status, body)
}

fn code(body: &Value) -> &str {
    body["error"]["code"].as_str().unwrap_or("")
}

async fn running(url: &str, token: Option<&str>) -> bool {
    let mut request = reqwest::Client::new().get(format!("{url}/api/status"));
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    let (status, body) = answer(request).await;
    assert_eq!(status, 200, "{body}");
    body["running"].as_bool().unwrap()
}

/// Opens `/ws` (with `path_and_query` appended) sending `origin`; the first status, or the
/// HTTP status of the refused handshake and its body.
async fn websocket(
    addr: &str,
    path_and_query: &str,
    origin: Option<&str>,
) -> Result<Value, (u16, Value)> {
    let mut request = format!("ws://{addr}{path_and_query}")
        .into_client_request()
        .unwrap();
    if let Some(origin) = origin {
        request
            .headers_mut()
            .insert("origin", origin.parse().unwrap());
    }
    match tokio_tungstenite::connect_async(request).await {
        Ok((mut socket, _)) => {
            use futures::StreamExt;
            let message = tokio::time::timeout(Duration::from_secs(10), socket.next())
                .await
                .expect("a first message")
                .expect("open")
                .expect("a message");
            let tungstenite::Message::Text(text) = message else {
                panic!("a text message, got {message:?}");
            };
            Ok(serde_json::from_str(&text).unwrap())
        }
        Err(tungstenite::Error::Http(response)) => {
            let body = response
                .body()
                .as_deref()
                .and_then(|b| serde_json::from_slice(b).ok())
                .unwrap_or(Value::Null);
            Err((response.status().as_u16(), body))
        }
        Err(e) => panic!("WebSocket: {e}"),
    }
}

#[tokio::test]
async fn cross_origin_requests_and_non_json_posts_are_refused_on_loopback() {
    let loadgen = Loadgen::bind(loadgen_config(vec![dead_lane()], 2, 1.0))
        .await
        .unwrap();
    let url = loadgen.url();
    let addr = loadgen.local_addr().to_string();
    let client = reqwest::Client::new();
    let start = format!("{url}/api/workload/start");

    // What a page on another origin can send without a preflight: a text/plain POST.
    let (status, body) = answer(
        client
            .post(&start)
            .header(CONTENT_TYPE, "text/plain")
            .body(r#"{"concurrency": 2}"#),
    )
    .await;
    assert_eq!(
        (status, code(&body)),
        (415, "unsupported_media_type"),
        "{body}"
    );
    // A body without any content type, or a form.
    let (status, _) = answer(client.post(&start).body("{}")).await;
    assert_eq!(status, 415);
    let (status, _) = answer(
        client
            .post(&start)
            .header(CONTENT_TYPE, "application/x-www-form-urlencoded")
            .body("concurrency=2"),
    )
    .await;
    assert_eq!(status, 415);
    // JSON from another origin (the browser sends its Origin on every POST).
    let (status, body) = answer(
        client
            .post(&start)
            .header(ORIGIN, "http://evil.example")
            .json(&json!({"concurrency": 2})),
    )
    .await;
    assert_eq!((status, code(&body)), (403, "cross_origin"), "{body}");
    // The phase switch is a control endpoint like the others.
    let phase = format!("{url}/api/phase");
    let (status, body) = answer(
        client
            .post(&phase)
            .header(ORIGIN, "http://evil.example")
            .json(&json!({"phase": "eagle3"})),
    )
    .await;
    assert_eq!((status, code(&body)), (403, "cross_origin"), "{body}");
    let (status, _) = answer(
        client
            .post(&phase)
            .header(CONTENT_TYPE, "text/plain")
            .body(r#"{"phase": "eagle3"}"#),
    )
    .await;
    assert_eq!(status, 415);
    // Another loopback port is another origin too, and so is `null` (a sandboxed page).
    for origin in ["http://127.0.0.1:1", "null", "https://localhost"] {
        let (status, _) = answer(client.post(&start).header(ORIGIN, origin).json(&json!({}))).await;
        assert_eq!(status, 403, "{origin}");
    }
    let (status, _) = answer(
        client
            .get(format!("{url}/api/conversations"))
            .header(ORIGIN, "http://evil.example"),
    )
    .await;
    assert_eq!(status, 403, "cross-origin reads are refused too");
    // DNS rebinding: a page on evil.example whose name now resolves to 127.0.0.1.
    let (status, body) = answer(
        client
            .post(&start)
            .header(HOST, "evil.example")
            .header(ORIGIN, "http://evil.example")
            .json(&json!({})),
    )
    .await;
    assert_eq!((status, code(&body)), (403, "forbidden_host"), "{body}");
    assert!(
        !running(&url, None).await,
        "no refused request started the workload"
    );

    // The WebSocket: another origin is refused at the handshake, its own origin and no origin
    // (a script, curl) pass.
    let (status, body) = websocket(&addr, "/ws", Some("http://evil.example"))
        .await
        .expect_err("a cross-origin WebSocket is refused");
    assert_eq!((status, code(&body)), (403, "cross_origin"), "{body}");
    let first = websocket(&addr, "/ws", Some(&url))
        .await
        .expect("same origin");
    assert_eq!(first["type"], "status");
    websocket(&addr, "/ws", None).await.expect("no origin");

    // The page's own requests: same Origin, JSON (or no body at all).
    let (status, body) = answer(
        client
            .post(&start)
            .header(ORIGIN, &url)
            .json(&json!({"concurrency": 2})),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert!(running(&url, None).await);
    let (status, _) = answer(
        client
            .post(format!("{url}/api/workload/stop"))
            .header(ORIGIN, &url)
            .header(CONTENT_TYPE, "application/json; charset=utf-8"),
    )
    .await;
    assert_eq!(status, 200);
    let (status, _) = answer(client.post(&start)).await;
    assert_eq!(status, 200, "curl -X POST without a body still works");

    // axum's own refusals come back as JSON too: a body over its limit, a query it cannot
    // read, a plain GET of /ws, a wrong method.
    let big = format!(r#"{{"mix": "{}"}}"#, "A".repeat(3 << 20));
    let (status, body) = answer(
        client
            .post(format!("{url}/api/workload/config"))
            .header(CONTENT_TYPE, "application/json")
            .body(big),
    )
    .await;
    assert_eq!((status, code(&body)), (413, "payload_too_large"), "{body}");
    let (status, body) = answer(client.get(format!("{url}/api/conversations?limit=many"))).await;
    assert_eq!(status, 400, "{body}");
    assert!(
        body["error"]["message"].as_str().unwrap().contains("limit"),
        "{body}"
    );
    let (status, _) = answer(client.get(format!("{url}/ws"))).await;
    assert!((400..500).contains(&status), "{status}");
    let (status, body) = answer(client.get(format!("{url}/api/workload/start"))).await;
    assert!((404..=405).contains(&status), "{status} {body}");
    let (status, _) = answer(client.delete(format!("{url}/index.html"))).await;
    assert_eq!(status, 405);
    loadgen.shutdown().await;
}

#[tokio::test]
async fn off_loopback_a_token_is_required_and_checked() {
    let mut config = loadgen_config(vec![dead_lane()], 2, 1.0);
    config.listen = "0.0.0.0:0".parse().unwrap();
    let refused = Loadgen::bind(config.clone())
        .await
        .err()
        .expect("no token off loopback");
    let LoadgenError::Config(message) = &refused else {
        panic!("a configuration error, got {refused}");
    };
    assert!(
        message.contains("--api-token") && message.contains("KVROUTE_API_TOKEN"),
        "{message}"
    );

    let token = "s3cret+/=";
    config.api_token = Some(token.to_owned());
    let loadgen = Loadgen::bind(config).await.unwrap();
    let addr = format!("127.0.0.1:{}", loadgen.local_addr().port());
    let url = format!("http://{addr}");
    let client = reqwest::Client::new();
    let start = format!("{url}/api/workload/start");

    // The page and /metrics stay open: the page needs the token from its own URL.
    let page = client.get(format!("{url}/?token=x")).send().await.unwrap();
    assert_eq!(page.status(), 200);
    let metrics = client.get(format!("{url}/metrics")).send().await.unwrap();
    assert_eq!(metrics.status(), 200);

    // Without the token, or with a wrong one, nothing of /api answers.
    for request in [
        client.post(&start).json(&json!({})),
        client.post(&start).bearer_auth("s3cret").json(&json!({})),
        client.get(format!("{url}/api/status")),
        client.get(format!("{url}/api/status?token=s3cret%2B%2F%3D")),
        client
            .post(format!("{url}/api/scenario/auto"))
            .bearer_auth("wrong"),
        client
            .post(format!("{url}/api/phase"))
            .json(&json!({"phase": "eagle3"})),
    ] {
        let response = request.send().await.unwrap();
        assert_eq!(response.status(), 401);
        assert_eq!(response.headers()["www-authenticate"], "Bearer");
        let body: Value = response.json().await.unwrap();
        assert_eq!(code(&body), "invalid_api_key", "{body}");
    }
    assert!(!running(&url, Some(token)).await);
    let (status, body) = answer(
        client
            .post(&start)
            .header(AUTHORIZATION, format!("Bearer {token}"))
            .json(&json!({"concurrency": 2})),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert!(running(&url, Some(token)).await);

    // The WebSocket takes the token in its query (a browser cannot set its headers).
    let (status, _) = websocket(&addr, "/ws", Some(&url))
        .await
        .expect_err("no token");
    assert_eq!(status, 401);
    let (status, _) = websocket(&addr, "/ws?token=s3cret", Some(&url))
        .await
        .expect_err("a wrong token");
    assert_eq!(status, 401);
    let first = websocket(&addr, "/ws?token=s3cret%2B%2F%3D", Some(&url))
        .await
        .expect("the right token, percent-encoded as the page sends it");
    assert_eq!(first["data"]["running"], true);
    // The token does not excuse another origin.
    let (status, _) = websocket(
        &addr,
        "/ws?token=s3cret%2B%2F%3D",
        Some("http://evil.example"),
    )
    .await
    .expect_err("cross-origin");
    assert_eq!(status, 403);
    loadgen.shutdown().await;
}

/// Reads what the server sends on `tcp` until it closes the connection (or 10 s pass).
async fn read_to_close(tcp: &mut tokio::net::TcpStream) -> String {
    use tokio::io::AsyncReadExt;
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), tcp.read_to_end(&mut answer)).await;
    assert!(read.is_ok(), "the server closes the connection");
    String::from_utf8_lossy(&answer).into_owned()
}

#[tokio::test]
async fn connections_are_bounded_websockets_included_and_slow_clients_are_cut_off() {
    use tokio::io::AsyncWriteExt;
    let mut config = loadgen_config(vec![dead_lane()], 2, 1.0);
    config.max_connections = Some(2);
    config.header_timeout = Duration::from_millis(500);
    config.body_timeout = Duration::from_millis(500);
    let loadgen = Loadgen::bind(config).await.unwrap();
    let url = loadgen.url();
    let addr = loadgen.local_addr().to_string();
    let connect = || async {
        tokio_tungstenite::connect_async(format!("ws://{addr}/ws"))
            .await
            .expect("WebSocket")
            .0
    };

    // Two open WebSockets hold both slots after their upgrade: the next client is refused.
    let first = connect().await;
    let second = connect().await;
    let fresh = || {
        reqwest::Client::builder()
            .pool_max_idle_per_host(0)
            .build()
            .unwrap()
    };
    let (status, body) = answer(fresh().get(format!("{url}/api/status"))).await;
    assert_eq!(
        (status, code(&body)),
        (503, "too_many_connections"),
        "{body}"
    );
    // Closing one frees its slot.
    drop(first);
    common::wait_until(
        "a slot freed by the closed WebSocket",
        Duration::from_secs(10),
        async || {
            fresh()
                .get(format!("{url}/api/status"))
                .send()
                .await
                .is_ok_and(|r| r.status() == 200)
        },
    )
    .await;
    drop(second);

    // A partial header (slowloris) is closed after the header deadline.
    let mut slow = tokio::net::TcpStream::connect(&addr).await.unwrap();
    slow.write_all(b"GET /api/status HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        .await
        .unwrap();
    let answer_to_slow = read_to_close(&mut slow).await;
    assert!(!answer_to_slow.contains("200 OK"), "{answer_to_slow}");

    // A body declared at 1 MiB with one byte sent gets 408 JSON after the body deadline.
    let mut trickle = tokio::net::TcpStream::connect(&addr).await.unwrap();
    trickle
        .write_all(
            b"POST /api/workload/config HTTP/1.1\r\nHost: 127.0.0.1\r\n\
              Content-Type: application/json\r\nContent-Length: 1048576\r\n\r\n{",
        )
        .await
        .unwrap();
    let answer_to_trickle = read_to_close(&mut trickle).await;
    assert!(
        answer_to_trickle.starts_with("HTTP/1.1 408")
            && answer_to_trickle.contains("request_timeout"),
        "{answer_to_trickle}"
    );
    loadgen.shutdown().await;
}
