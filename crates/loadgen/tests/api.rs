//! The control API, the WebSocket and `/metrics` against a real cluster: simulated engines
//! (fast) behind the real gateway, driven over real HTTP.

use std::time::{Duration, Instant};

use futures::StreamExt;
use loadgen::{LaneSpec, Loadgen};
use serde_json::{Value, json};

mod common;

use common::{
    Cluster, MODEL, get, loadgen_config as config, strings, wait_for_status, wait_until,
    worker_names,
};

/// Workers 0.. `workers` named `worker-{id}` behind the gateway.
async fn cluster(workers: u64, speedup: f64) -> Cluster {
    Cluster::start(0..workers, speedup, "worker-").await
}

/// [`wait_for_status`] of the first lane's metrics.
async fn wait_for_metrics(
    url: &str,
    what: &str,
    timeout: Duration,
    check: impl Fn(&Value) -> bool,
) {
    wait_for_status(url, what, timeout, |s| check(&s["lanes"][0]["metrics"])).await;
}

/// A lane `name` of the `kv_load` gateway of `cluster`.
fn lane(name: &str, cluster: &Cluster) -> LaneSpec {
    cluster.lane(name, Some("kv_load"))
}

async fn post(url: &str, body: Option<Value>) -> (u16, Value) {
    let client = reqwest::Client::new();
    let mut request = client.post(url);
    if let Some(body) = body {
        request = request.json(&body);
    }
    let response = request.send().await.expect("POST");
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

fn error_code(body: &Value) -> &str {
    body["error"]["code"].as_str().unwrap_or("")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_workload_runs_measures_and_obeys_the_api() {
    let speedup = 50.0;
    let cluster = cluster(2, speedup).await;
    let loadgen = Loadgen::bind(config(vec![lane("kv_load", &cluster)], 4, speedup))
        .await
        .unwrap();
    let url = loadgen.url();

    // Stopped: no data, Stop refused.
    let (code, status) = get(&format!("{url}/api/status")).await;
    assert_eq!(code, 200);
    assert_eq!(status["running"], false);
    assert_eq!(status["lanes"][0]["metrics"]["ttft_ms"], Value::Null);
    assert_eq!(status["slider"], json!({"min": 60, "max": 180, "step": 20}));
    let (code, body) = post(&format!("{url}/api/workload/stop"), None).await;
    assert_eq!((code, error_code(&body)), (409, "not_running"));

    // Bad input: clear OpenAI errors.
    for (body, expected) in [
        (json!({"concurrency": 0}), "invalid_concurrency"),
        (json!({"concurrency": -3}), "invalid_concurrency"),
        (json!({"concurrency": 1_000_000}), "invalid_concurrency"),
        (json!({"concurency": 5}), "invalid_json"),
        (json!({}), "missing_field"),
        (json!({"mix": "A=40,B=30,D=30"}), "invalid_mix"),
        (json!({"mix": "A=0,B=0,C=0"}), "invalid_mix"),
        (json!({"mix": "A=-1"}), "invalid_mix"),
        (json!({"mix": {"A": 40, "X": 1}}), "invalid_mix"),
        (json!({"mix": 40}), "invalid_mix"),
        // Percentages: a mix must add up to 100.
        (json!({"mix": "A=40,B=30"}), "invalid_mix"),
        (json!({"mix": {"A": 1, "B": 1}}), "invalid_mix"),
        (json!({"rate": 0}), "invalid_rate"),
        (json!({"rate": -2.5}), "invalid_rate"),
        (json!({"rate": "fast"}), "invalid_rate"),
        (json!({"rate": 1e9}), "invalid_rate"),
    ] {
        let (code, answer) = post(&format!("{url}/api/workload/config"), Some(body.clone())).await;
        assert_eq!((code, error_code(&answer)), (400, expected), "{body}");
        assert_eq!(answer["error"]["type"], "invalid_request_error");
        // The field is named, in `param` and in the message.
        if let Some(field) = expected.strip_prefix("invalid_").filter(|f| *f != "json") {
            assert_eq!(answer["error"]["param"], field, "{answer}");
            assert!(
                answer["error"]["message"]
                    .as_str()
                    .unwrap_or("")
                    .contains(field)
            );
        }
    }
    // Good values, while stopped: kept for the start, shown in the status.
    let (code, status) = post(
        &format!("{url}/api/workload/config"),
        Some(json!({"mix": {"A": 100}, "rate": null})),
    )
    .await;
    assert_eq!(code, 200, "{status}");
    assert_eq!(
        (status["mix"].as_str(), &status["rate"]),
        (Some("A=100,B=0,C=0"), &Value::Null)
    );
    let (code, answer) = get(&format!("{url}/api/conversations/0-999999")).await;
    assert_eq!((code, error_code(&answer)), (404, "not_found"));
    let (code, answer) = get(&format!("{url}/api/conversations/garbage")).await;
    assert_eq!((code, error_code(&answer)), (404, "not_found"));

    // Start: twice is refused.
    let (code, status) = post(
        &format!("{url}/api/workload/start"),
        Some(json!({"concurrency": 4})),
    )
    .await;
    assert_eq!(code, 200, "{status}");
    assert_eq!(status["running"], true);
    let (code, body) = post(&format!("{url}/api/workload/start"), None).await;
    assert_eq!((code, error_code(&body)), (409, "already_running"));

    // Turns finish: the window fills, the gateway's hit rate and the workers' GPUs show.
    wait_for_metrics(
        &url,
        "12 finished turns with a hit rate",
        Duration::from_secs(120),
        |m| m["requests"].as_u64().unwrap_or(0) >= 12 && m["kv_hit_rate"].is_number(),
    )
    .await;
    let (_, status) = get(&format!("{url}/api/status")).await;
    let lane = &status["lanes"][0];
    let m = &lane["metrics"];
    assert_eq!(m["errors"], 0, "{status}");
    for key in ["ttft_ms", "tpot_ms", "itl_ms", "e2e_s"] {
        let (p50, p95) = (
            m[key]["p50"].as_f64().unwrap(),
            m[key]["p95"].as_f64().unwrap(),
        );
        assert!(p50 > 0.0 && p50 <= p95, "{key}: {p50} {p95}");
    }
    // Modelled time: an H200 decodes a token in tens of milliseconds whatever the speedup,
    // and the client-side ITL (per token) is close to TPOT.
    let tpot = m["tpot_ms"]["p50"].as_f64().unwrap();
    assert!((10.0..80.0).contains(&tpot), "TPOT p50 {tpot} ms");
    let itl = m["itl_ms"]["p50"].as_f64().unwrap();
    assert!(
        (itl / tpot - 1.0).abs() < 0.25,
        "ITL p50 {itl} vs TPOT p50 {tpot}"
    );
    assert!(m["tops"].as_f64().unwrap() > 0.0 && m["rps"].as_f64().unwrap() > 0.0);
    // Multi-turn chats on a KV-aware router: most input tokens are cache hits.
    let hit = m["kv_hit_rate"].as_f64().unwrap();
    assert!((0.3..=1.0).contains(&hit), "hit rate {hit}");
    let workers = &lane["workers"];
    assert_eq!(workers["available"], true, "{workers}");
    assert_eq!(worker_names(workers), ["worker-0", "worker-1"]);
    let gpu = &workers["list"][0]["gpus"][0];
    assert!((0.0..=100.0).contains(&gpu["util_pct"].as_f64().unwrap()));
    assert!(
        (1.0..=100.0).contains(&gpu["memory_pct"].as_f64().unwrap()),
        "{gpu}"
    );
    assert!(workers["gpu"].as_str().unwrap().contains("H200"));
    // The baseline row follows the concurrency (4 → the lowest level, 60).
    assert_eq!(status["baseline"]["router"], "round_robin");
    assert_eq!(status["baseline"]["concurrency"], 60);

    // Conversations: transcripts with per-turn metrics; later turns resend the history.
    let (_, list) = get(&format!("{url}/api/conversations")).await;
    let conversations = list["conversations"].as_array().unwrap();
    assert!(!conversations.is_empty());
    let done: Vec<&Value> = conversations
        .iter()
        .filter(|c| c["turns_done"].as_u64().unwrap() >= 2)
        .collect();
    assert!(!done.is_empty(), "{list}");
    let id = done[0]["id"].as_str().unwrap();
    let (code, detail) = get(&format!("{url}/api/conversations/{id}")).await;
    assert_eq!(code, 200);
    assert!(detail["system"].as_str().unwrap().len() > 100);
    let turns = detail["turns"].as_array().unwrap();
    let mut tokens_done = 0;
    for turn in turns.iter().filter(|t| t["state"] == "done") {
        assert!(turn["ttft_ms"].as_f64().unwrap() > 0.0);
        assert!(turn["latency_s"].as_f64().unwrap() > 0.0);
        assert!(!turn["user"].as_str().unwrap().is_empty());
        assert!(turn["assistant"].as_str().unwrap().len() > 200, "{turn}");
        assert!(
            turn["worker"].is_string(),
            "the gateway names the worker: {turn}"
        );
        tokens_done += turn["tokens"].as_u64().unwrap();
    }
    // The planned reply lengths (300–1,024 tokens) were honoured.
    assert!(tokens_done >= 600, "{tokens_done}");

    // /metrics: the summaries the seed's Grafana reads, equal to the status window.
    let text = reqwest::get(format!("{url}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let samples = loadgen::parse_text(&text);
    for name in ["loadgen_ttft_all_seconds", "loadgen_tpot_all_seconds"] {
        for quantile in ["0.5", "0.95"] {
            let s = samples
                .iter()
                .find(|s| s.name == name && s.label("quantile") == Some(quantile))
                .unwrap_or_else(|| panic!("{name} {quantile} missing:\n{text}"));
            assert_eq!(s.label("lane"), Some("kv_load"));
            assert!(s.value > 0.0 && s.value.is_finite(), "{name} {quantile}");
        }
        assert!(
            samples
                .iter()
                .any(|s| s.name == format!("{name}_count") && s.value >= 12.0)
        );
    }

    // Live concurrency change, without stopping.
    let (code, status) = post(
        &format!("{url}/api/workload/config"),
        Some(json!({"concurrency": 7})),
    )
    .await;
    assert_eq!(code, 200);
    assert_eq!(
        (status["running"].clone(), status["concurrency"].clone()),
        (json!(true), json!(7))
    );
    wait_for_metrics(&url, "7 open conversations", Duration::from_secs(30), |m| {
        m["active_conversations"] == 7
    })
    .await;

    // Stop: requests are cancelled, open conversations end as stopped.
    let (code, status) = post(&format!("{url}/api/workload/stop"), None).await;
    assert_eq!(code, 200);
    assert_eq!(status["running"], false);
    assert_eq!(status["lanes"][0]["metrics"]["in_flight"], 0);
    let (_, list) = get(&format!("{url}/api/conversations?limit=500")).await;
    let statuses = strings(&list["conversations"], "status");
    assert!(statuses.contains(&"stopped"), "{statuses:?}");
    assert!(!statuses.contains(&"active"), "{statuses:?}");
    assert!(!statuses.contains(&"error"), "{statuses:?}");

    // A restart counts from zero and keeps the earlier transcripts under their own ids.
    let before: Vec<String> = strings(&list["conversations"], "id")
        .into_iter()
        .map(str::to_owned)
        .collect();
    let (code, status) = post(
        &format!("{url}/api/workload/start"),
        Some(json!({"concurrency": 2})),
    )
    .await;
    assert_eq!(code, 200);
    assert_eq!(status["lanes"][0]["metrics"]["requests"], 0);
    wait_for_metrics(
        &url,
        "a turn after the restart",
        Duration::from_secs(60),
        |m| m["requests"].as_u64().unwrap_or(0) >= 1,
    )
    .await;
    let (_, list) = get(&format!("{url}/api/conversations?limit=500")).await;
    let after: Vec<&Value> = list["conversations"].as_array().unwrap().iter().collect();
    let mut ids: Vec<&str> = after.iter().map(|c| c["id"].as_str().unwrap()).collect();
    assert!(
        before.iter().all(|id| ids.contains(&id.as_str())),
        "earlier transcripts kept"
    );
    let new_active = after.iter().filter(|c| c["status"] == "active").count();
    assert_eq!(new_active, 2);
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), after.len(), "ids stay unique across runs");

    loadgen.shutdown().await;
    cluster.gateway.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_websocket_pushes_status_and_two_lanes_get_the_same_conversations() {
    let speedup = 50.0;
    let a = cluster(1, speedup).await;
    let b = cluster(1, speedup).await;
    let loadgen = Loadgen::bind(config(vec![lane("a", &a), lane("b", &b)], 3, speedup))
        .await
        .unwrap();
    let ws_url = format!("ws://{}/ws", loadgen.local_addr());
    let (mut socket, _) = tokio_tungstenite::connect_async(&ws_url).await.unwrap();
    let next_status = async |socket: &mut tokio_tungstenite::WebSocketStream<_>| -> Value {
        loop {
            let message = tokio::time::timeout(Duration::from_secs(10), socket.next())
                .await
                .expect("a status within 10 s")
                .expect("open")
                .expect("message");
            if let tokio_tungstenite::tungstenite::Message::Text(text) = message {
                let value: Value = serde_json::from_str(&text).unwrap();
                assert_eq!(value["type"], "status");
                return value["data"].clone();
            }
        }
    };
    // The first message comes at once, stopped.
    let first = next_status(&mut socket).await;
    assert_eq!(first["running"], false);
    assert_eq!(first["lanes"].as_array().unwrap().len(), 2);

    // A start is pushed right away.
    let url = loadgen.url();
    let (code, _) = post(&format!("{url}/api/workload/start"), None).await;
    assert_eq!(code, 200);
    let mut pushed = next_status(&mut socket).await;
    while pushed["running"] != true {
        pushed = next_status(&mut socket).await;
    }
    assert_eq!(pushed["concurrency"], 3);

    // Updates keep coming while running; both lanes make progress.
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let s = next_status(&mut socket).await;
        let done = |i: usize| s["lanes"][i]["metrics"]["requests"].as_u64().unwrap_or(0);
        if done(0) >= 3 && done(1) >= 3 {
            break;
        }
        assert!(Instant::now() < deadline, "both lanes finish turns: {s}");
    }

    // The same seed: conversation k has the same topic, plan and first question in both lanes.
    let (_, list_a) = get(&format!("{url}/api/conversations?lane=a")).await;
    let (_, list_b) = get(&format!("{url}/api/conversations?lane=b")).await;
    let (code, unknown) = get(&format!("{url}/api/conversations?lane=zzz")).await;
    assert_eq!((code, error_code(&unknown)), (404, "unknown_lane"));
    let mut matched = 0;
    for conversation in list_a["conversations"].as_array().unwrap() {
        let id = conversation["id"].as_str().unwrap();
        let number = id.split_once('-').unwrap().1;
        let Some(twin) = list_b["conversations"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["id"] == format!("1-{number}"))
        else {
            continue;
        };
        assert_eq!(conversation["topic"], twin["topic"]);
        assert_eq!(conversation["turns_planned"], twin["turns_planned"]);
        let (_, da) = get(&format!("{url}/api/conversations/{id}")).await;
        let (_, db) = get(&format!("{url}/api/conversations/1-{number}")).await;
        assert_eq!(da["turns"][0]["user"], db["turns"][0]["user"]);
        matched += 1;
    }
    assert!(matched >= 3, "{matched} conversations in both lanes");

    // History: chart points for both lanes.
    wait_until("chart points", Duration::from_secs(10), async || {
        let (_, h) = get(&format!("{url}/api/history")).await;
        h["lanes"][1]["points"]
            .as_array()
            .is_some_and(|p| !p.is_empty())
    })
    .await;

    let (code, _) = post(&format!("{url}/api/workload/stop"), None).await;
    assert_eq!(code, 200);
    loadgen.shutdown().await;
}

#[tokio::test]
async fn failed_turns_count_as_errors_and_a_dead_metrics_source_says_why() {
    // Nothing listens on the target: every turn fails at once.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead = format!("http://{}", listener.local_addr().unwrap());
    drop(listener);
    let mut spec = LaneSpec::for_gateway("live", None, &dead, MODEL);
    spec.worker_metrics = vec![format!("{dead}/metrics")];
    let loadgen = Loadgen::bind(config(vec![spec], 2, 1.0)).await.unwrap();
    let url = loadgen.url();
    let (code, _) = post(&format!("{url}/api/workload/start"), None).await;
    assert_eq!(code, 200);
    wait_for_status(&url, "errors and a scrape", Duration::from_secs(20), |s| {
        s["lanes"][0]["metrics"]["errors"].as_u64().unwrap_or(0) >= 4
            && s["lanes"][0]["workers"]["error"].is_string()
    })
    .await;
    let (_, s) = get(&format!("{url}/api/status")).await;
    let lane = &s["lanes"][0];
    assert_eq!(lane["metrics"]["requests"], 0);
    assert_eq!(lane["metrics"]["ttft_ms"], Value::Null);
    assert_eq!(lane["workers"]["available"], false);
    assert!(lane["metrics"]["gateway_error"].is_string());
    // The failed conversations are shown as errors with the reason.
    let (_, list) = get(&format!("{url}/api/conversations")).await;
    let failed = list["conversations"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["status"] == "error")
        .expect("an error conversation")
        .clone();
    let (_, detail) = get(&format!(
        "{url}/api/conversations/{}",
        failed["id"].as_str().unwrap()
    ))
    .await;
    assert_eq!(detail["turns"][0]["state"], "failed");
    assert!(
        detail["turns"][0]["error"]
            .as_str()
            .unwrap()
            .contains("connection"),
        "{detail}"
    );
    // An external target has no phase ladder: the status says so and a switch is refused.
    assert_eq!(s["ladder"], Value::Null);
    let (code, body) = post(
        &format!("{url}/api/phase"),
        Some(serde_json::json!({"phase": "eagle3"})),
    )
    .await;
    assert_eq!((code, error_code(&body)), (409, "no_ladder"), "{body}");
    loadgen.shutdown().await;
}

/// A user model: an OpenAI-compatible chat endpoint that writes the follow-up questions. It
/// records the answers it was shown, and fails every other call when `flaky`.
async fn user_model(flaky: bool) -> (String, std::sync::Arc<std::sync::Mutex<Vec<String>>>) {
    use axum::routing::post;
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let calls = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let record = seen.clone();
    let app = axum::Router::new().route(
        "/v1/chat/completions",
        post(
            move |headers: axum::http::HeaderMap, body: axum::Json<Value>| {
                let record = record.clone();
                let calls = calls.clone();
                async move {
                    assert_eq!(
                        headers.get("authorization").and_then(|v| v.to_str().ok()),
                        Some("Bearer user-secret")
                    );
                    let answer = body["messages"][1]["content"]
                        .as_str()
                        .unwrap_or("")
                        .to_owned();
                    record.lock().unwrap().push(answer);
                    if flaky && calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % 2 == 1 {
                        return (
                            axum::http::StatusCode::INTERNAL_SERVER_ERROR,
                            axum::Json(json!({
                                "error": {"message": "overloaded", "type": "server_error"}
                            })),
                        );
                    }
                    (
                        axum::http::StatusCode::OK,
                        axum::Json(json!({
                            "choices": [{"index": 0, "message": {"role": "assistant",
                                "content": "  Which worker keeps the blocks of my last turn?  "}}]
                        })),
                    )
                }
            },
        ),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!(
        "http://{}/v1/chat/completions",
        listener.local_addr().unwrap()
    );
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, seen)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_model_writes_the_follow_ups_and_its_failures_fall_back_to_built_in_ones() {
    let speedup = 50.0;
    let cluster = cluster(1, speedup).await;
    let (model_url, seen) = user_model(true).await;
    let mut config = config(vec![lane("kv_load", &cluster)], 3, speedup);
    config.drive.user = loadgen::UserSimulator::Model {
        url: model_url,
        model: "user-8b".to_owned(),
        api_key: Some("user-secret".to_owned()),
    };
    config.autostart = true;
    let loadgen = Loadgen::bind(config).await.unwrap();
    let url = loadgen.url();
    wait_for_metrics(
        &url,
        "follow-ups from the user model",
        Duration::from_secs(120),
        |m| {
            m["requests"].as_u64().unwrap_or(0) >= 9
                && m["user_model_errors"].as_u64().unwrap_or(0) >= 1
        },
    )
    .await;
    let (_, status) = get(&format!("{url}/api/status")).await;
    assert_eq!(
        status["lanes"][0]["metrics"]["errors"], 0,
        "a failing user model fails no turn"
    );

    // The model saw the assistant's answers; its question (trimmed) went to the gateway.
    let (_, list) = get(&format!("{url}/api/conversations?limit=100")).await;
    let (mut from_model, mut built_in) = (0, 0);
    for c in list["conversations"].as_array().unwrap() {
        let (_, detail) = get(&format!(
            "{url}/api/conversations/{}",
            c["id"].as_str().unwrap()
        ))
        .await;
        for turn in detail["turns"].as_array().unwrap().iter().skip(1) {
            if turn["state"] != "done" {
                continue;
            }
            if turn["user"] == "Which worker keeps the blocks of my last turn?" {
                from_model += 1;
            } else {
                built_in += 1;
            }
        }
    }
    assert!(
        from_model >= 1 && built_in >= 1,
        "{from_model} from the model, {built_in} built in"
    );
    let seen = seen.lock().unwrap().clone();
    assert!(
        seen.iter()
            .all(|a| a.starts_with("The assistant's last answer:"))
    );
    assert!(
        seen.iter().any(|a| a.len() > 500),
        "the model is shown the answer"
    );
    loadgen.shutdown().await;
}

/// Seed 004: a mix at an open-loop rate, set through the API, runs B and C requests through
/// the gateway; the status shows the mix, the rate and the sessions per workload; the rate
/// goes back to the closed loop live.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mix_at_a_rate_runs_and_changes_live() {
    let speedup = 50.0;
    let cluster = cluster(2, speedup).await;
    let loadgen = Loadgen::bind(config(vec![lane("kv_load", &cluster)], 2, speedup))
        .await
        .unwrap();
    let url = loadgen.url();
    let (code, status) = post(
        &format!("{url}/api/workload/start"),
        Some(json!({"mix": "B=50,C=50", "rate": 4.0})),
    )
    .await;
    assert_eq!(code, 200, "{status}");
    assert_eq!(status["mix"], "A=0,B=50,C=50");
    assert_eq!(status["rate"], 4.0);
    wait_for_metrics(
        &url,
        "6 finished B/C requests",
        Duration::from_secs(120),
        |m| m["requests"].as_u64().unwrap_or(0) >= 6,
    )
    .await;
    let (_, status) = get(&format!("{url}/api/status")).await;
    let lane = &status["lanes"][0];
    assert_eq!(lane["metrics"]["errors"], 0, "{status}");
    let sessions = &lane["sessions_by_class"];
    assert_eq!(sessions[0], 0, "{status}");
    assert!(sessions[1].as_u64().unwrap() > 0 && sessions[2].as_u64().unwrap() > 0);
    // B and C transcripts carry their own instruction and topic.
    let (_, list) = get(&format!("{url}/api/conversations")).await;
    let topics = strings(&list["conversations"], "topic");
    assert!(
        topics
            .iter()
            .all(|t| t.starts_with("summarise: ") || t.starts_with("reasoning: ")),
        "{topics:?}"
    );
    // Live: back to the closed loop, then an invalid rate is refused while running.
    let (code, status) = post(
        &format!("{url}/api/workload/config"),
        Some(json!({"rate": null, "concurrency": 2, "mix": {"A": 100}})),
    )
    .await;
    assert_eq!(code, 200, "{status}");
    assert_eq!(
        (&status["rate"], status["concurrency"].as_u64()),
        (&Value::Null, Some(2))
    );
    let (code, answer) = post(
        &format!("{url}/api/workload/config"),
        Some(json!({"rate": -1})),
    )
    .await;
    assert_eq!((code, error_code(&answer)), (400, "invalid_rate"));
    assert_eq!(answer["error"]["param"], "rate");
    loadgen.shutdown().await;
}

/// A cycle of short phases for the scenario tests: both pools grow in GROW and go back in
/// BACK; without a fleet, those actions are reported as not applied.
const SHORT_SCENARIO: &str = r#"
rate_rps = 0.25
initial = { prefill = 1, decode = 1 }
max = { prefill = 3, decode = 3 }
[[phase]]
name = "CHAT"
duration_s = 40
mix = { A = 100 }
rate_rps = 0.25
prefill = "initial"
decode = "initial"
[[phase]]
name = "GROW"
duration_s = 40
mix = { A = 80, C = 20 }
prefill = "+1"
note = "a prefill worker joins"
[[phase]]
name = "BACK"
duration_s = 40
prefill = "initial"
"#;

/// Seed 004's scenario API against a lane with no fleet to resize (an external target):
/// auto mode walks the phases and drives the workload's mix and rate, pauses the
/// autoscalers and reports its scaling actions as not applied, with the reason; stop and
/// manual resume the autoscalers and keep the workload as the cycle left it; bad input is a
/// 400 naming the field.
/// The phases `loadgen_scenario_phase` marks current (1); every phase of the cycle and IDLE
/// must have a series.
async fn phase_gauges(url: &str) -> Vec<String> {
    let text = reqwest::get(format!("{url}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let samples = loadgen::parse_text(&text);
    let phases: Vec<_> = samples
        .iter()
        .filter(|s| s.name == "loadgen_scenario_phase")
        .collect();
    let named: Vec<&str> = phases.iter().filter_map(|s| s.label("phase")).collect();
    for phase in ["CHAT", "GROW", "BACK", "IDLE"] {
        assert!(named.contains(&phase), "no series for {phase}:\n{text}");
    }
    phases
        .iter()
        .filter(|s| s.value == 1.0)
        .filter_map(|s| s.label("phase").map(str::to_owned))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scenario_walks_its_phases_and_hands_back_to_the_autoscalers() {
    // Phases of 40 modelled seconds at 20× last 2 s.
    let speedup = 20.0;
    let cluster = cluster(1, speedup).await;
    let mut config = config(vec![lane("kv_load", &cluster)], 2, speedup);
    config.scaling.scenario =
        workload::scenario::ScenarioConfig::from_toml(SHORT_SCENARIO).expect("the test's scenario");
    let loadgen = Loadgen::bind(config).await.unwrap();
    let url = loadgen.url();

    // Manual mode at first: the scalers run, nothing is scaled, no fleet.
    let (_, status) = get(&format!("{url}/api/status")).await;
    let scenario = &status["scenario"];
    assert_eq!(scenario["mode"], "manual", "{scenario}");
    assert_eq!(scenario["phase"], "IDLE");
    assert_eq!(scenario["fleet"], "none");
    assert_eq!(scenario["pools"], Value::Null);
    assert_eq!(scenario["autoscaler"]["prefill"]["threshold"], 0.5);
    assert_eq!(scenario["autoscaler"]["decode"]["threshold"], 0.05);
    assert_eq!(scenario["autoscaler"]["decode"]["paused"], false);

    // Bad input: 400 naming the field; unknown routes 404 JSON.
    for (body, code, param) in [
        (json!({"phase": "NOPE"}), "invalid_phase", Some("phase")),
        (json!({"phase": 3}), "invalid_phase", Some("phase")),
        (json!({"from": "CHAT"}), "invalid_json", None),
    ] {
        let (status, answer) = post(&format!("{url}/api/scenario/auto"), Some(body.clone())).await;
        assert_eq!(
            (status, error_code(&answer)),
            (400, code),
            "{body}: {answer}"
        );
        if let Some(param) = param {
            assert_eq!(answer["error"]["param"], param);
            let message = answer["error"]["message"].as_str().unwrap_or("");
            assert!(
                message.contains("phase") && message.contains("CHAT"),
                "{message}"
            );
        }
    }
    let (status, answer) = post(&format!("{url}/api/scenario/bogus"), None).await;
    assert_eq!((status, error_code(&answer)), (404, "not_found"));
    let (_, status) = get(&format!("{url}/api/status")).await;
    assert_eq!(
        status["scenario"]["mode"], "manual",
        "a refused start changes nothing"
    );
    assert_eq!(status["running"], false);

    // Auto from GROW: the workload starts at the phase's mix and the cycle's rate; the
    // scalers pause.
    let (code, status) = post(
        &format!("{url}/api/scenario/auto"),
        Some(json!({"phase": "GROW"})),
    )
    .await;
    assert_eq!(code, 200, "{status}");
    let scenario = &status["scenario"];
    assert_eq!(scenario["mode"], "auto", "{scenario}");
    assert_eq!(scenario["phase"], "GROW");
    assert_eq!(scenario["index"], 1);
    assert_eq!(scenario["note"], "a prefill worker joins");
    assert_eq!(scenario["phase_duration_s"], 40.0);
    assert!(scenario["time_left_s"].as_f64().unwrap() <= 40.0);
    assert_eq!(scenario["autoscaler"]["prefill"]["paused"], true);
    assert_eq!(scenario["autoscaler"]["decode"]["paused"], true);
    assert_eq!(status["running"], true);
    assert_eq!(status["rate"], 0.25);
    assert_eq!(status["mix"], "A=80,B=0,C=20");
    // GROW's "+1" could not be applied: no fleet, and the event says so.
    let events = scenario["events"].as_array().unwrap();
    let grow = events
        .iter()
        .find(|e| e["phase"] == "GROW" && e["pool"] == "prefill")
        .unwrap_or_else(|| panic!("{scenario}"));
    assert_eq!(
        (grow["from"].as_u64(), grow["to"].as_u64()),
        (Some(1), Some(2))
    );
    assert_eq!(grow["source"], "scenario");
    assert_eq!(grow["applied"], false);
    assert!(
        grow["reason"]
            .as_str()
            .unwrap()
            .starts_with("not applied: the load generator drives an external target"),
        "{grow}"
    );

    // Prometheus reads the phase: one series per phase and IDLE, 1 on the current one.
    assert_eq!(phase_gauges(&url).await, vec!["GROW"]);

    // The cycle walks on: BACK, then CHAT (chat only) in its next cycle.
    wait_for_status(&url, "BACK", Duration::from_secs(20), |s| {
        s["scenario"]["phase"] == "BACK"
    })
    .await;
    wait_for_status(&url, "CHAT of cycle 1", Duration::from_secs(20), |s| {
        let done = s["scenario"]["phase"] == "CHAT" && s["scenario"]["cycle"] == 1;
        if done {
            assert_eq!(s["mix"], "A=100,B=0,C=0", "{s}");
        }
        done
    })
    .await;

    // Stop: manual again, the scalers resume, the workload keeps running as it was.
    let (code, status) = post(&format!("{url}/api/scenario/stop"), None).await;
    assert_eq!(code, 200);
    let scenario = &status["scenario"];
    assert_eq!(
        (&scenario["mode"], &scenario["phase"]),
        (&json!("manual"), &json!("IDLE"))
    );
    assert_eq!(scenario["autoscaler"]["prefill"]["paused"], false);
    assert_eq!(scenario["autoscaler"]["decode"]["paused"], false);
    assert_eq!(status["running"], true);
    assert_eq!(status["mix"], "A=100,B=0,C=0");
    // And once more, through /manual.
    let (code, _) = post(&format!("{url}/api/scenario/auto"), None).await;
    assert_eq!(code, 200);
    let (code, status) = post(&format!("{url}/api/scenario/manual"), None).await;
    assert_eq!(code, 200);
    assert_eq!(status["scenario"]["mode"], "manual");
    assert_eq!(status["scenario"]["autoscaler"]["decode"]["paused"], false);
    assert_eq!(phase_gauges(&url).await, vec!["IDLE"]);

    // The WebSocket carries the same object.
    let (mut socket, _) =
        tokio_tungstenite::connect_async(format!("ws://{}/ws", url.trim_start_matches("http://")))
            .await
            .expect("WebSocket");
    let first = socket.next().await.expect("a message").expect("text");
    let message: Value = serde_json::from_str(first.to_text().unwrap()).unwrap();
    assert_eq!(message["data"]["scenario"]["mode"], "manual", "{message}");
    assert!(message["data"]["scenario"]["events"].is_array());

    let (_, status) = get(&format!("{url}/api/status")).await;
    assert_eq!(status["lanes"][0]["metrics"]["errors"], 0, "{status}");
    loadgen.shutdown().await;
}
