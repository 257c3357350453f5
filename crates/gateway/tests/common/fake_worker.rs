//! A scripted worker on a real loopback HTTP port: records what the gateway sends and answers
//! with a fixed SSE script, optionally dropping the connection mid-stream (a crash).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use axum::routing::{get, post};
use serde_json::{Value, json};
use tokio::io::AsyncWriteExt;

/// What the fake worker does with a completion request.
#[derive(Debug, Clone)]
pub enum Script {
    /// Streams `tokens` one-token chunks, a usage chunk and `[DONE]`.
    Complete { tokens: u32 },
    /// Streams `tokens` chunks, then closes the connection without `[DONE]`.
    CrashAfter { tokens: u32 },
    /// Streams several choices, one token of each in turn: choice `i` gets `choices[i].0`
    /// chunks (` c{i}t{j}`), the last with finish reason `stop` when `choices[i].1`; then
    /// closes the connection without `[DONE]`.
    CrashMidChoices { choices: Vec<(u32, bool)> },
    /// Answers with this status and OpenAI error JSON.
    Fail { status: u16 },
    /// A vLLM prefill worker (NixlConnector): one token, unary, with the
    /// `kv_transfer_params` a decode worker pulls the KV by.
    Prefill,
    /// Never answers.
    Hang,
    /// Streams `tokens` chunks, then stays silent with the connection open (a stopped
    /// process).
    StallAfter { tokens: u32 },
    /// Streams SSE chunks of 64 KiB of text each, without end (a runaway reply).
    Flood,
    /// Answers with one JSON body that never ends and has no line break (not SSE).
    FloodJson,
}

#[derive(Clone)]
struct FakeState {
    script: Script,
    requests: Arc<Mutex<Vec<Value>>>,
}

pub struct FakeWorker {
    pub addr: SocketAddr,
    pub requests: Arc<Mutex<Vec<Value>>>,
    task: tokio::task::JoinHandle<()>,
}

impl FakeWorker {
    pub async fn start(script: Script) -> FakeWorker {
        FakeWorker::start_with_info(script, None).await
    }

    /// A fake worker whose `/info` answers `info` (a worker card), when given.
    pub async fn start_with_info(script: Script, info: Option<Value>) -> FakeWorker {
        FakeWorker::start_at("127.0.0.1:0".parse().unwrap(), script, info).await
    }

    /// The same, listening on `addr` (a restart on a [`kill`](Self::kill)ed worker's port).
    pub async fn start_at(addr: SocketAddr, script: Script, info: Option<Value>) -> FakeWorker {
        let requests = Arc::new(Mutex::new(Vec::new()));
        let state = FakeState {
            script,
            requests: requests.clone(),
        };
        let mut app = Router::new()
            .route("/v1/completions", post(completions))
            .route("/health", get(|| async { "ok" }));
        if let Some(info) = info {
            app = app.route("/info", get(move || async move { axum::Json(info) }));
        }
        let app = app.with_state(state);
        // A killed worker's listener closes when its aborted task is dropped, shortly after.
        let mut tries = 0;
        let listener = loop {
            match tokio::net::TcpListener::bind(addr).await {
                Ok(l) => break l,
                Err(e) if tries < 100 => {
                    tries += 1;
                    tracing::debug!(%addr, %e, "port still taken; retrying");
                    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                }
                Err(e) => panic!("cannot listen on {addr}: {e}"),
            }
        };
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        FakeWorker {
            addr,
            requests,
            task,
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn last_request(&self) -> Value {
        self.requests
            .lock()
            .unwrap()
            .last()
            .cloned()
            .expect("a request arrived")
    }

    /// Stops serving (in-flight connections die with the task).
    pub fn kill(&self) {
        self.task.abort();
    }
}

impl Drop for FakeWorker {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn chunk(text: &str, finish: Option<&str>) -> String {
    choice_chunk(0, text, finish)
}

fn choice_chunk(index: u32, text: &str, finish: Option<&str>) -> String {
    let body = json!({
        "id": "cmpl-fake", "object": "text_completion", "created": 1, "model": "fake",
        "choices": [{"index": index, "text": text, "logprobs": null, "finish_reason": finish}],
    });
    format!("data: {body}\n\n")
}

/// A body of `chunks`, then an error: hyper aborts the connection without the chunked
/// terminator, as a dying process would.
fn crashing_body(chunks: Vec<String>) -> Response {
    let chunks: Vec<Result<Bytes, std::io::Error>> =
        chunks.into_iter().map(|c| Ok(Bytes::from(c))).collect();
    let stream = futures::stream::iter(chunks).chain(futures::stream::once(async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        Err(std::io::Error::other("worker crashed"))
    }));
    Response::builder()
        .header("content-type", "text/event-stream")
        .body(Body::from_stream(stream))
        .unwrap()
}

async fn completions(State(state): State<FakeState>, body: Bytes) -> Response {
    let request: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    state.requests.lock().unwrap().push(request);
    match state.script {
        Script::Hang => {
            std::future::pending::<()>().await;
            unreachable!()
        }
        Script::Prefill => Response::builder()
            .header("content-type", "application/json")
            .body(Body::from(
                json!({
                    "id": "cmpl-fake", "object": "text_completion", "created": 1, "model": "fake",
                    "choices": [{"index": 0, "text": " w0", "logprobs": null, "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
                    "kv_transfer_params": {
                        "do_remote_prefill": true, "do_remote_decode": false,
                        "remote_engine_id": "fake-engine", "remote_block_ids": [1, 2, 3],
                        "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1,
                    },
                })
                .to_string(),
            ))
            .unwrap(),
        Script::Fail { status } => Response::builder()
            .status(StatusCode::from_u16(status).unwrap())
            .header("content-type", "application/json")
            .body(Body::from(
                json!({"error": {"message": "scripted failure", "type": "invalid_request_error", "param": null, "code": "scripted"}})
                    .to_string(),
            ))
            .unwrap(),
        Script::Complete { tokens } => {
            let mut out = String::new();
            for i in 0..tokens {
                let finish = (i + 1 == tokens).then_some("length");
                out.push_str(&chunk(&format!(" w{i}"), finish));
            }
            let usage = json!({"id": "cmpl-fake", "object": "text_completion", "created": 1, "model": "fake", "choices": [],
                "usage": {"prompt_tokens": 5, "completion_tokens": tokens, "total_tokens": 5 + tokens, "prompt_tokens_details": {"cached_tokens": 3}}});
            out.push_str(&format!("data: {usage}\n\ndata: [DONE]\n\n"));
            Response::builder()
                .header("content-type", "text/event-stream")
                .body(Body::from(out))
                .unwrap()
        }
        Script::StallAfter { tokens } => {
            let chunks: Vec<Result<Bytes, std::io::Error>> = (0..tokens)
                .map(|i| Ok(Bytes::from(chunk(&format!(" w{i}"), None))))
                .collect();
            let stream = futures::stream::iter(chunks).chain(futures::stream::pending());
            Response::builder()
                .header("content-type", "text/event-stream")
                .body(Body::from_stream(stream))
                .unwrap()
        }
        Script::Flood => {
            let event = Bytes::from(chunk(&"x".repeat(64 << 10), None));
            let stream = futures::stream::repeat_with(move || Ok::<_, std::io::Error>(event.clone()));
            Response::builder()
                .header("content-type", "text/event-stream")
                .body(Body::from_stream(stream))
                .unwrap()
        }
        Script::FloodJson => {
            let head = Bytes::from_static(b"{\"choices\": [{\"text\": \"");
            let filler = Bytes::from("x".repeat(64 << 10));
            let stream = futures::stream::once(async move { Ok::<_, std::io::Error>(head) })
                .chain(futures::stream::repeat_with(move || Ok(filler.clone())));
            Response::builder()
                .header("content-type", "application/json")
                .body(Body::from_stream(stream))
                .unwrap()
        }
        Script::CrashAfter { tokens } => {
            crashing_body((0..tokens).map(|i| chunk(&format!(" w{i}"), None)).collect())
        }
        Script::CrashMidChoices { choices } => {
            let longest = choices.iter().map(|c| c.0).max().unwrap_or(0);
            let mut chunks = Vec::new();
            for j in 0..longest {
                for (i, &(tokens, finishes)) in (0u32..).zip(&choices) {
                    if j < tokens {
                        let finish = (finishes && j + 1 == tokens).then_some("stop");
                        chunks.push(choice_chunk(i, &format!(" c{i}t{j}"), finish));
                    }
                }
            }
            crashing_body(chunks)
        }
    }
}

use futures::StreamExt;

/// A TCP port that accepts and immediately drops connections (a worker that is not an HTTP
/// server any more).
pub async fn dead_port() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let _ = socket.shutdown().await;
        }
    });
    addr
}
