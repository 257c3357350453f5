//! The routers users run, from PyPI, in front of `kvroute engine` processes: sglang-router
//! (its `cache_aware` policy) and vllm-router (its `kv_aware` policy, fed by the engines' ZMQ
//! KV events). A change that breaks what they probe, what they parse or the events they
//! index fails here.
//!
//! Needs `python3` with `sglang-router==0.3.2` and `vllm-router==0.1.17` (`.ci/run` installs
//! them; `$KVROUTE_PYTHON` names another interpreter).

use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

mod common;

use common::{Running, Server, http};

const MODEL: &str = "llama-3.1-70b-instruct";

fn python() -> String {
    std::env::var("KVROUTE_PYTHON").unwrap_or_else(|_| "python3".to_string())
}

/// Fails with what to install when a router package is missing, rather than skipping.
fn require_module(module: &str, package: &str) {
    let found = Command::new(python())
        .args(["-c", &format!("import {module}")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        found,
        "{} cannot import {module}: install it with `{} -m pip install {package}` (or set \
         KVROUTE_PYTHON to an interpreter that has it)",
        python(),
        python()
    );
}

fn free_port() -> u16 {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

/// One HTTP/1.1 exchange with a router on loopback: (status, body).
fn call(port: u16, method: &str, path: &str, body: &str) -> (u16, String) {
    http(&format!("127.0.0.1:{port}"), method, path, body)
}

/// A simulated engine publishing vLLM-format KV events on ZMQ (by default, on a free port
/// its `/info` names).
struct Engine {
    server: Server,
    zmq: String,
}

fn start_engines(count: u64) -> Vec<Engine> {
    (1..=count)
        .map(|id| {
            let id = id.to_string();
            let server = Server::start(&[
                "engine",
                "--port",
                "0",
                "--speedup",
                "50",
                "--worker-id",
                &id,
            ]);
            let (status, card) = http(server.addr(), "GET", "/info", "");
            assert_eq!(status, 200, "{card}");
            let card: serde_json::Value = serde_json::from_str(&card).expect("JSON card");
            let zmq = card["zmq_endpoint"]
                .as_str()
                .unwrap_or_else(|| panic!("no ZMQ endpoint in {card}"))
                .to_string();
            Engine { server, zmq }
        })
        .collect()
}

/// Starts a router module and waits until it lists the engines' model: it found the
/// workers healthy and learned their model from their info endpoints.
fn start_router(module: &str, args: &[String], port: u16) -> Running {
    // The router's log goes to a file, shown when it fails to come up.
    let log_path = std::env::temp_dir().join(format!("kvroute-test-{module}-{port}.log"));
    let log = std::fs::File::create(&log_path).expect("router log file");
    let child = Command::new(python())
        .args(["-m", module])
        .args(args)
        .stdout(log.try_clone().expect("log handle"))
        .stderr(log)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {} -m {module}: {e}", python()));
    let router = Running(child);
    let log_tail = || {
        let text = std::fs::read_to_string(&log_path).unwrap_or_default();
        let start = text.len().saturating_sub(3000);
        text.get(start..).unwrap_or_default().to_string()
    };
    let deadline = Instant::now() + Duration::from_secs(180);
    let mut last = String::from("not listening");
    while Instant::now() < deadline {
        if TcpStream::connect((Ipv4Addr::LOCALHOST, port)).is_ok() {
            let (status, body) = call(port, "GET", "/v1/models", "");
            if status == 200 && body.contains(MODEL) {
                return router;
            }
            last = format!("{status} {body}");
        }
        thread::sleep(Duration::from_millis(250));
    }
    panic!(
        "{module} never listed {MODEL} (last answer: {last}); its log:\n{}",
        log_tail()
    );
}

/// Where a router listens, and its metrics exporter on a port of its own (both routers
/// default to 29000, so two at once would collide).
fn listen_args(port: u16) -> Vec<String> {
    let metrics = free_port().to_string();
    let port = port.to_string();
    [
        "--host",
        "127.0.0.1",
        "--port",
        &port,
        "--prometheus-host",
        "127.0.0.1",
    ]
    .into_iter()
    .chain(["--prometheus-port", &metrics])
    .map(String::from)
    .collect()
}

/// A router's command line: where it listens, the engines, the policy.
fn router_args(port: u16, engines: &[Engine], policy: &str) -> Vec<String> {
    let mut args = listen_args(port);
    args.push("--worker-urls".into());
    args.extend(engines.iter().map(|e| e.server.url.clone()));
    args.extend(["--policy".to_string(), policy.to_string()]);
    args
}

fn cached_tokens(body: &str) -> u64 {
    let json: serde_json::Value =
        serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"));
    json["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("no cached_tokens in {body}"))
}

/// A multi-turn conversation through the router: each turn resends the history. Returns the
/// cached prompt tokens of each turn.
fn converse(port: u16, topic: &str, turns: usize) -> Vec<u64> {
    let mut messages = vec![serde_json::json!({
        "role": "system",
        "content": format!("You are a patient tutor. Today's lesson is about {topic}, explained \
            slowly, with examples, over several questions from the same student."),
    })];
    let mut cached = Vec::new();
    for turn in 0..turns {
        messages.push(serde_json::json!({
            "role": "user",
            "content": format!("Question {turn} about {topic}: what comes next, and why?"),
        }));
        let request = serde_json::json!({
            "model": MODEL, "messages": messages, "max_tokens": 24, "ignore_eos": true,
        });
        let (status, body) = call(port, "POST", "/v1/chat/completions", &request.to_string());
        assert_eq!(status, 200, "turn {turn} of {topic}: {body}");
        cached.push(cached_tokens(&body));
        let json: serde_json::Value = serde_json::from_str(&body).expect("JSON");
        let reply = json["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or_else(|| panic!("no reply content: {body}"))
            .to_string();
        messages.push(serde_json::json!({"role": "assistant", "content": reply}));
    }
    cached
}

#[test]
fn sglang_router_fronts_kvroute_engines() {
    require_module("sglang_router.launch_router", "sglang-router==0.3.2");
    let engines = start_engines(3);
    let port = free_port();
    let args = router_args(port, &engines, "cache_aware");
    let _router = start_router("sglang_router.launch_router", &args, port);

    // Conversations stay on the worker that holds their history: every later turn finds
    // the earlier turns in that worker's prefix cache.
    for topic in ["tides", "lighthouses", "knots"] {
        let cached = converse(port, topic, 3);
        assert_eq!(cached[0], 0, "{topic}: a first turn has nothing cached");
        for (turn, &hit) in cached.iter().enumerate().skip(1) {
            assert!(
                hit >= 32,
                "{topic} turn {turn}: {hit} cached tokens; cache_aware lost the history's worker"
            );
        }
    }

    // A streamed request relays the engine's SSE to the end (the relay may merge events into
    // fewer HTTP chunks, so count what they say, not how they are framed).
    let request = serde_json::json!({
        "model": MODEL, "stream": true, "max_tokens": 8, "ignore_eos": true,
        "messages": [{"role": "user", "content": "Say something about harbours."}],
    });
    let (status, body) = call(port, "POST", "/v1/chat/completions", &request.to_string());
    assert_eq!(status, 200, "{body}");
    assert!(body.matches("data: {").count() >= 1, "{body}");
    assert_eq!(
        body.matches(r#""finish_reason":"length""#).count(),
        1,
        "{body}"
    );
    assert!(body.contains("data: [DONE]"), "{body}");
}

#[test]
fn vllm_router_kv_aware_indexes_kvroute_engine_events() {
    require_module("vllm_router.launch_router", "vllm-router==0.1.17");
    let engines = start_engines(3);
    let port = free_port();
    let mut args = router_args(port, &engines, "kv_aware");
    for engine in &engines {
        args.push("--kv-event-source".into());
        args.push(format!("{}={}", engine.server.url, engine.zmq));
    }
    args.extend(["--kv-event-block-size", "32", "--kv-event-model", MODEL].map(String::from));
    let _router = start_router("vllm_router.launch_router", &args, port);

    // Each prompt twice: the second copy goes where the engine's events said the first one's
    // blocks are. Without the events (or with events it cannot decode) it would be priced
    // cold and land anywhere.
    let passage = "The history of harbours is long and varied, and ships have always needed \
                   safe places to rest. In the old days sailors tied their boats to wooden posts \
                   and hoped for calm weather, while merchants waited on the docks for cargo.";
    let mut hits = 0;
    let prompts = 6;
    for n in 0..prompts {
        let request = serde_json::json!({
            "model": MODEL, "max_tokens": 4, "ignore_eos": true,
            "prompt": format!("Passage {n}. {passage}"),
        })
        .to_string();
        let (status, body) = call(port, "POST", "/v1/completions", &request);
        assert_eq!(status, 200, "{body}");
        // The events travel asynchronously; give the router's subscriber a moment.
        thread::sleep(Duration::from_millis(300));
        let (status, body) = call(port, "POST", "/v1/completions", &request);
        assert_eq!(status, 200, "{body}");
        if cached_tokens(&body) >= 32 {
            hits += 1;
        }
    }
    assert_eq!(
        hits, prompts,
        "every repeat should reach the worker whose events announced its blocks"
    );
}
