//! The README's set-up, flag for flag: engines started alike (no `--worker-id`, no event
//! flags) behind a gateway given only their URLs. The engines publish their KV events by
//! default, the gateway subscribes by itself, and a conversation's later turns find its
//! history cached; nothing routes blind.

use std::time::Duration;

use serde_json::{Value, json};

mod common;

use common::{Server, post_json};

fn chat(addr: &str, messages: &[Value]) -> Value {
    let request = json!({
        "model": "llama-3.1-70b-instruct", "messages": messages,
        "max_tokens": 16, "ignore_eos": true,
    });
    let (status, reply) = post_json(addr, "/v1/chat/completions", &request);
    assert_eq!(status, 200, "{reply}");
    reply
}

#[test]
fn engines_started_alike_behind_a_plain_gateway_give_cache_hits() {
    let engines = two_engines(&[]);
    let urls: Vec<String> = engines.iter().map(|e| e.url.clone()).collect();
    let mut args = vec!["gateway", "--port", "0"];
    for url in &urls {
        args.extend(["--worker", url.as_str()]);
    }
    let gateway = Server::start(&args);

    // Both engines are routable (distinct ids) and each one's cache view is its events.
    let views: Vec<String> =
        std::iter::from_fn(|| gateway.lines.recv_timeout(Duration::from_secs(10)).ok())
            .filter(|line| line.contains("cache view"))
            .take(2)
            .collect();
    for url in &urls {
        assert!(
            views
                .iter()
                .any(|v| v.contains(url.as_str()) && v.contains("KV events over ZMQ")),
            "{url}: {views:?}"
        );
    }

    let later_cached =
        conversation_cached_tokens(&gateway, "harbours, tides and the ships that use them");
    assert!(
        later_cached >= 2 * 32,
        "turns 2 and 3 found {later_cached} cached tokens: the gateway routed blind"
    );
}

/// Three turns of one conversation; the cached tokens of turns 2 and 3 together.
fn conversation_cached_tokens(gateway: &Server, topic: &str) -> u64 {
    let mut messages = vec![json!({
        "role": "system",
        "content": format!("You answer questions about {topic}, patiently and with examples, \
                            for as long as the student keeps asking, in plain words."),
    })];
    let mut later_cached = 0;
    for turn in 0..3 {
        messages.push(json!({"role": "user", "content": format!("Question {turn}, please.")}));
        let reply = chat(gateway.addr(), &messages);
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
    later_cached
}

/// The value of the exposition line that starts with `series` (labels included).
fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {series} in:\n{text}"))
}

/// Two `kvroute engine` processes on free ports at 100× speed, with `extra` flags.
fn two_engines(extra: &[&str]) -> Vec<Server> {
    (0..2)
        .map(|_| Server::start(&[&["engine", "--port", "0", "--speedup", "100"], extra].concat()))
        .collect()
}

fn gateway_over(engines: &[Server]) -> Server {
    let mut args = vec!["gateway", "--port", "0"];
    for e in engines {
        args.extend(["--worker", e.url.as_str()]);
    }
    Server::start(&args)
}

#[test]
fn the_block_size_comes_from_the_workers() {
    // dynamo-mocker engines use blocks of 64 tokens; the gateway is not told.
    let engines = two_engines(&["--profile", "dynamo-mocker"]);
    let gateway = gateway_over(&engines);
    gateway.line_with("KV blocks of 64 tokens (from the workers)");
    assert!(
        conversation_cached_tokens(&gateway, "lighthouses") >= 64,
        "later turns found their history"
    );

    // Engines that disagree: one clear error, printed once, naming both sizes.
    let other = Server::start(&["engine", "--port", "0", "--block-size", "32"]);
    let stderr = common::failure(&[
        "gateway",
        "--port",
        "0",
        "--worker",
        &engines[0].url,
        "--worker",
        &other.url,
    ]);
    assert_eq!(
        stderr.matches("different KV block sizes").count(),
        1,
        "{stderr}"
    );
    assert!(
        stderr.contains("64 tokens") && stderr.contains("32 tokens"),
        "{stderr}"
    );
}

#[test]
fn workers_without_events_are_predicted_and_reuse_is_attributed() {
    // Engines that publish no KV events: the router predicts their caches from its own
    // decisions instead of routing blind.
    let engines = two_engines(&["--zmq-pub", "off"]);
    let gateway = gateway_over(&engines);
    gateway.line_with("KV blocks of");
    let cached = conversation_cached_tokens(&gateway, "tides")
        + conversation_cached_tokens(&gateway, "canals");
    assert!(
        cached >= 4 * 32,
        "later turns found their history: {cached}"
    );

    let (status, text) = common::http(gateway.addr(), "GET", "/metrics", "");
    assert_eq!(status, 200);
    for e in &engines {
        assert!(
            text.lines()
                .any(|l| l.starts_with("kvroute_worker_cache_view")
                    && l.contains(e.url.as_str())
                    && l.contains("view=\"predicted\"")),
            "{}: {text}",
            e.url
        );
    }
    let kind = |k: &str| {
        metric(
            &text,
            &format!("kvroute_gateway_reuse_tokens_total{{kind=\"{k}\"}}"),
        )
    };
    let (prompt, available, predicted, reused) = (
        kind("prompt"),
        kind("available"),
        kind("predicted"),
        kind("reused"),
    );
    assert!(
        reused >= cached as f64,
        "every cached token counted: {reused} < {cached}"
    );
    assert!(reused <= prompt && predicted <= available && available <= prompt);
    assert!(predicted > 0.0, "the router predicted the histories");
}

/// The engine's `/info` card.
fn card(engine: &Server) -> Value {
    let (status, body) = common::http(engine.addr(), "GET", "/info", "");
    assert_eq!(status, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

/// A gateway that starts after its kvroute engine cached conversations (a restart, a rolling
/// update) learns that whole cache from the engine's `/kv_state` when it subscribes, not only
/// the batches the replay buffer still holds: a conversation from before it started is
/// predicted on its worker, as much as the engine then reuses.
#[test]
fn a_late_gateway_learns_the_whole_cache_from_the_engines_snapshot() {
    let engine = Server::start(&["engine", "--port", "0", "--zmq-replay-buffer", "2"]);
    assert_eq!(card(&engine)["zmq_kv_state_path"], "/kv_state");
    let long = "a message long enough to fill several blocks of the cache ".repeat(8);
    let first = [json!({"role": "user", "content": format!("0 {long}")})];
    // More batches than the buffer keeps, before any gateway subscribes.
    chat(engine.addr(), &first);
    for i in 1..6 {
        chat(
            engine.addr(),
            &[json!({"role": "user", "content": format!("{i} {long}")})],
        );
    }
    let gateway = gateway_over(std::slice::from_ref(&engine));
    let replays = "kvroute_router_kv_replays_total{source=\"zmq\"}";
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let (_, text) = common::http(gateway.addr(), "GET", "/metrics", "");
        if text.contains(replays) && metric(&text, replays) >= 1.0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no snapshot applied:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // The first conversation again, through the gateway: its blocks were cached before the
    // gateway existed and are far outside the replay buffer.
    let reply = chat(gateway.addr(), &first);
    let reused = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(reused >= 64, "the engine reused {reused} tokens: {reply}");
    let (_, text) = common::http(gateway.addr(), "GET", "/metrics", "");
    let predicted = metric(
        &text,
        "kvroute_gateway_reuse_tokens_total{kind=\"predicted\"}",
    );
    assert!(
        predicted >= reused as f64,
        "the router predicted {predicted} cached tokens where the engine reused {reused}: \
         the gateway did not know what the engine cached before it started"
    );

    // An engine that publishes no ZMQ events keeps no snapshot, and says why.
    let quiet = Server::start(&["engine", "--port", "0", "--zmq-pub", "off"]);
    assert!(card(&quiet).get("zmq_kv_state_path").is_none());
    let (status, body) = common::http(quiet.addr(), "GET", "/kv_state", "");
    assert_eq!(status, 404, "{body}");
    assert!(body.contains("--zmq-pub off"), "{body}");
}

/// A gateway that subscribes after the engine's replay buffer has moved on, to a publisher
/// with no snapshot to offer (vLLM and SGLang: here the engine's endpoints given by flag, as
/// for them), cannot learn what the engine cached before: it says so, once, instead of
/// counting a partial replay as a whole one.
#[test]
fn a_late_gateway_whose_replay_does_not_reach_back_says_so() {
    use std::process::Stdio;

    let engine = Server::start(&["engine", "--port", "0", "--zmq-replay-buffer", "2"]);
    let long = "a message long enough to fill several blocks of the cache ".repeat(8);
    // More batches than the buffer keeps, before any gateway subscribes.
    for i in 0..6 {
        chat(
            engine.addr(),
            &[json!({"role": "user", "content": format!("{i} {long}")})],
        );
    }
    let card = card(&engine);
    let worker = format!(
        "{},zmq={},zmq_replay={}",
        engine.url,
        card["zmq_endpoint"].as_str().unwrap(),
        card["zmq_replay_endpoint"].as_str().unwrap()
    );
    let mut gateway = common::Running::spawn(
        &["gateway", "--port", "0", "--worker", &worker],
        Stdio::piped(),
    );
    let lines = gateway.merged_lines();
    let mut seen: Vec<String> = Vec::new();
    let mut wait_for = |needle: &str| -> String {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(line) = seen.iter().find(|l| l.contains(needle)) {
                return line.clone();
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match lines.recv_timeout(left) {
                Ok(line) => seen.push(line),
                Err(_) => panic!("no line with {needle:?}: {seen:#?}"),
            }
        }
    };
    let listening = wait_for("listening on ");
    let url = listening.rsplit("listening on ").next().unwrap().trim();
    let addr = url.trim_start_matches("http://").to_string();
    // Its first batch shows the gateway how late it is.
    chat(
        &addr,
        &[json!({"role": "user", "content": format!("late {long}")})],
    );
    let warning = wait_for("replay buffer no longer holds");
    assert!(warning.contains("oldest_batch="), "{warning}");
    chat(
        &addr,
        &[json!({"role": "user", "content": format!("later {long}")})],
    );
    std::thread::sleep(Duration::from_millis(500));
    while let Ok(line) = lines.try_recv() {
        seen.push(line);
    }
    gateway.kill();
    let warnings = seen
        .iter()
        .filter(|l| l.contains("replay buffer no longer holds"))
        .count();
    assert_eq!(warnings, 1, "{seen:#?}");
}
