//! The upstream API keys never leak (issue 20, item 6): `kvroute loadgen` reads the target's
//! key (`OPENAI_API_KEY`) and the user model's (`USER_MODEL_API_KEY`) from the environment
//! and sends them as bearer tokens; a user model that echoes its key in its 401 errors (as
//! OpenAI's "Incorrect API key provided: …" does, unmasked here) must not carry it anywhere.
//! Real processes (`kvroute engine`, `kvroute gateway`, `kvroute loadgen`) at debug log
//! level, real traffic; then neither key's bytes appear in any process's stdout or stderr,
//! `/api/status`, the conversations, `/metrics` of every process, the page, the WebSocket
//! messages, or the error bodies any of them answers.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use futures::StreamExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const TARGET_KEY: &str = "sk-target-7f3a9c1e5b2d4086";
const USER_MODEL_KEY: &str = "sk-user-model-c4e8a2f6d0b19375";

/// A `kvroute` process with both keys in its environment, its stdout and stderr captured
/// whole; killed on drop.
struct Captured {
    child: Child,
    output: Arc<Mutex<String>>,
    lines: mpsc::Receiver<String>,
}

impl Captured {
    fn spawn(args: &[&str]) -> Captured {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvroute"))
            .args(args)
            .env("OPENAI_API_KEY", TARGET_KEY)
            .env("USER_MODEL_API_KEY", USER_MODEL_KEY)
            .env("RUST_LOG", "debug")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("kvroute runs");
        let output = Arc::new(Mutex::new(String::new()));
        let (tx, lines) = mpsc::channel();
        let stdout = child.stdout.take().expect("piped");
        let stderr = child.stderr.take().expect("piped");
        for (stream, tx) in [
            (
                Box::new(stdout) as Box<dyn std::io::Read + Send>,
                tx.clone(),
            ),
            (Box::new(stderr), tx),
        ] {
            let output = Arc::clone(&output);
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    if let Ok(mut all) = output.lock() {
                        all.push_str(&line);
                        all.push('\n');
                    }
                    let _ = tx.send(line);
                }
            });
        }
        Captured {
            child,
            output,
            lines,
        }
    }

    /// Waits up to 120 s for a line containing `marker` and returns what follows it.
    fn url_after(&self, marker: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) if line.contains(marker) => {
                    let url = line.rsplit(marker).next().unwrap_or_default();
                    return url.trim().to_string();
                }
                Ok(_) => {}
                Err(_) => panic!("no line with {marker:?}:\n{}", self.output()),
            }
        }
    }

    fn output(&self) -> String {
        self.output.lock().map(|o| o.clone()).unwrap_or_default()
    }
}

impl Drop for Captured {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A user model that wants `USER_MODEL_KEY` and answers the first two requests with a 401
/// that echoes the key it was sent, the rest with a question.
struct UserModel {
    url: String,
    /// Requests that carried the right key.
    keyed: Arc<AtomicU64>,
    requests: Arc<AtomicU64>,
}

async fn user_model() -> UserModel {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!(
        "http://{}/v1/chat/completions",
        listener.local_addr().unwrap()
    );
    let keyed = Arc::new(AtomicU64::new(0));
    let requests = Arc::new(AtomicU64::new(0));
    let (k, r) = (Arc::clone(&keyed), Arc::clone(&requests));
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let (keyed, requests) = (Arc::clone(&k), Arc::clone(&r));
            tokio::spawn(async move {
                let Some(head) = read_request(&mut socket).await else {
                    return;
                };
                let n = requests.fetch_add(1, Ordering::SeqCst);
                let bearer = head
                    .lines()
                    .find_map(|l| {
                        let (name, value) = l.split_once(':')?;
                        name.eq_ignore_ascii_case("authorization")
                            .then(|| value.trim().trim_start_matches("Bearer ").to_string())
                    })
                    .unwrap_or_default();
                if bearer == USER_MODEL_KEY {
                    keyed.fetch_add(1, Ordering::SeqCst);
                }
                let (status, body) = if n < 2 {
                    (
                        "401 Unauthorized",
                        serde_json::json!({"error": {
                            "message": format!("Incorrect API key provided: {bearer}."),
                            "type": "invalid_request_error", "code": "invalid_api_key"}}),
                    )
                } else {
                    (
                        "200 OK",
                        serde_json::json!({"id": "u", "object": "chat.completion",
                            "created": 0, "model": "user",
                            "choices": [{"index": 0, "finish_reason": "stop",
                                "message": {"role": "assistant",
                                    "content": "How does the cache decide what to evict?"}}]}),
                    )
                };
                let body = body.to_string();
                let response = format!(
                    "HTTP/1.1 {status}\r\ncontent-type: application/json\r\n\
                     content-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = socket.write_all(response.as_bytes()).await;
            });
        }
    });
    UserModel {
        url,
        keyed,
        requests,
    }
}

/// Reads one request (headers, and the body by its `Content-Length`, bounded); returns the
/// head.
async fn read_request(socket: &mut tokio::net::TcpStream) -> Option<String> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    let head_end = loop {
        let n = socket.read(&mut chunk).await.ok()?;
        if n == 0 || buf.len() > 1 << 20 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let length: usize = head
        .lines()
        .find_map(|l| {
            let (name, value) = l.split_once(':')?;
            name.eq_ignore_ascii_case("content-length")
                .then(|| value.trim().parse().ok())?
        })
        .unwrap_or(0);
    while buf.len() < head_end + length.min(1 << 20) {
        let n = socket.read(&mut chunk).await.ok()?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    Some(head)
}

/// Fails the test if `text` (from `what`) holds either key.
fn assert_no_key(what: &str, text: &str) {
    for key in [TARGET_KEY, USER_MODEL_KEY] {
        assert!(
            !text.contains(key),
            "{what} leaks the key {key}:\n{}",
            text.lines()
                .filter(|l| l.contains(key))
                .take(5)
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
}

/// Status and body of a request, the target's key sent as a bearer token.
async fn keyed_request(method: reqwest::Method, url: &str, body: &str) -> (u16, String) {
    let response = reqwest::Client::new()
        .request(method, url)
        .bearer_auth(TARGET_KEY)
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .expect("request sent");
    let status = response.status().as_u16();
    (status, response.text().await.unwrap_or_default())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_api_keys_appear_in_no_log_status_metrics_page_socket_or_error() {
    let user = user_model().await;
    let engine = Captured::spawn(&[
        "engine",
        "--port",
        "0",
        "--worker-id",
        "1",
        "--speedup",
        "20",
    ]);
    let engine_url = engine.url_after("listening on ");
    let gateway = Captured::spawn(&["gateway", "--port", "0", "--worker", &engine_url]);
    let gateway_url = gateway.url_after("listening on ");
    common::wait_routable(&gateway_url, 1, Duration::from_secs(30)).await;
    let loadgen = Captured::spawn(&[
        "loadgen",
        "--port",
        "0",
        "--target",
        &gateway_url,
        "--user-model-url",
        &user.url,
        "--user-model",
        "user",
        "--concurrency",
        "3",
        "--ramp",
        "0",
        "--speedup",
        "20",
        "--start",
    ]);
    let loadgen_url = loadgen.url_after("dashboard on ");

    // The WebSocket, read while the traffic runs.
    let ws_url = format!("{}/ws", loadgen_url.replace("http://", "ws://"));
    let (mut socket, _) = tokio_tungstenite::connect_async(ws_url.as_str())
        .await
        .expect("WebSocket");
    let socket_text = tokio::spawn(async move {
        let mut all = String::new();
        let mut messages = 0;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
        while let Ok(Some(Ok(message))) = tokio::time::timeout_at(deadline, socket.next()).await {
            if let Ok(text) = message.into_text() {
                all.push_str(&text);
                messages += 1;
            }
            if messages >= 20 && all.contains("user_model_errors") {
                break;
            }
        }
        (messages, all)
    });

    // Traffic until the user model was asked past its two echoing errors and turns finished.
    let deadline = Instant::now() + Duration::from_secs(180);
    let status = loop {
        let status = common::get_json(&format!("{loadgen_url}/api/status")).await;
        let requests = status["lanes"][0]["metrics"]["requests"]
            .as_u64()
            .unwrap_or(0);
        if user.requests.load(Ordering::SeqCst) >= 4 && requests >= 6 {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "not enough traffic: user model asked {} times; status {status}",
            user.requests.load(Ordering::SeqCst)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    // The keys were used: the user model got its key on every request, and its echoing
    // errors were counted (the turns fell back to built-in questions).
    assert_eq!(
        user.keyed.load(Ordering::SeqCst),
        user.requests.load(Ordering::SeqCst),
        "the user model's key was not sent"
    );
    assert!(
        status["lanes"][0]["metrics"]["user_model_errors"]
            .as_u64()
            .unwrap_or(0)
            >= 1,
        "{status}"
    );
    let (messages, socket_text) = socket_text.await.expect("socket reader");
    assert!(messages > 0, "no WebSocket message");
    assert_no_key("the WebSocket messages", &socket_text);

    assert_no_key("/api/status", &status.to_string());
    let conversations = common::get_text(&format!("{loadgen_url}/api/conversations")).await;
    assert_no_key("/api/conversations", &conversations);
    let listed: serde_json::Value = serde_json::from_str(&conversations).expect("JSON");
    let ids: Vec<String> = listed["conversations"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|c| c["id"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default();
    assert!(!ids.is_empty(), "no conversation listed: {conversations}");
    for id in ids.iter().take(10) {
        let one = common::get_text(&format!("{loadgen_url}/api/conversations/{id}")).await;
        assert_no_key("a conversation", &one);
    }
    for url in [&loadgen_url, &gateway_url, &engine_url] {
        let metrics = common::get_text(&format!("{url}/metrics")).await;
        assert!(!metrics.is_empty(), "{url}/metrics is empty");
        assert_no_key(&format!("{url}/metrics"), &metrics);
    }
    let page = common::get_text(&format!("{loadgen_url}/")).await;
    assert!(
        page.contains("<html") || page.contains("<!DOCTYPE"),
        "{page}"
    );
    assert_no_key("the page", &page);

    // Error bodies, each with the key sent as a bearer token.
    use reqwest::Method;
    let errors = [
        (
            Method::POST,
            format!("{gateway_url}/v1/chat/completions"),
            "{not json",
        ),
        (
            Method::POST,
            format!("{gateway_url}/v1/chat/completions"),
            r#"{"model":"nope","messages":[{"role":"user","content":"hi"}]}"#,
        ),
        (
            Method::GET,
            format!("{gateway_url}/v1/chat/completions"),
            "",
        ),
        (
            Method::POST,
            format!("{engine_url}/v1/chat/completions"),
            "{not json",
        ),
        (
            Method::POST,
            format!("{loadgen_url}/api/workload/config"),
            "{not json",
        ),
        (
            Method::GET,
            format!("{loadgen_url}/api/conversations/0-999999"),
            "",
        ),
        (Method::GET, format!("{loadgen_url}/api/nothing"), ""),
    ];
    for (method, url, body) in errors {
        let (code, text) = keyed_request(method.clone(), &url, body).await;
        assert!(code >= 400, "{method} {url}: {code} {text}");
        assert_no_key(&format!("the {code} answer to {method} {url}"), &text);
    }

    // Stop the workload, then read every process's whole output.
    let _ = common::post_json(
        loadgen_url.trim_start_matches("http://"),
        "/api/workload/stop",
        &serde_json::json!({}),
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    for (name, process) in [
        ("kvroute loadgen", &loadgen),
        ("kvroute gateway", &gateway),
        ("kvroute engine", &engine),
    ] {
        let output = process.output();
        assert!(!output.is_empty(), "{name} wrote nothing");
        assert_no_key(&format!("{name}'s stdout and stderr"), &output);
    }
    // The echoed errors were logged, redacted.
    let loadgen_log = loadgen.output();
    assert!(
        loadgen_log.contains("user model failed") && loadgen_log.contains("[redacted]"),
        "{loadgen_log}"
    );
}
