//! The gateway's disaggregated flow against scripted prefill workers (a vLLM-shaped one, a
//! failing one, a silent one) and a real decode engine: what the prefill leg carries (vLLM's
//! proxy request), that its answer reaches the decode worker, and that every prefill failure
//! ends in a local prefill, never a hang.

mod common;

use std::time::Duration;

use common::fake_worker::{FakeWorker, Script};
use common::{MODEL, chat, engine_config, gateway, gateway_config, passage, start_engine};
use engine::Role;
use gateway::WorkerSpec;
use protocol::WorkerRole;
use serde_json::Value;

/// A gateway in front of `prefill` (declared by flag, as a vLLM worker is) and a decode
/// engine; sends one long chat; returns (status, route header, the answer, prefill requests).
async fn serve_one(script: Script) -> (u16, String, Value, Vec<Value>, String) {
    let prefill = FakeWorker::start(script).await;
    let decode = start_engine({
        let mut config = engine_config(2);
        config.engine.role = Role::DecodeOnly;
        config
    })
    .await;
    let mut spec = WorkerSpec::new(prefill.url());
    spec.role = Some(WorkerRole::Prefill);
    spec.id = Some(kv_index::WorkerId(1));
    let mut config = gateway_config(&[&decode]);
    config.workers.push(spec);
    config.prefill_timeout = Duration::from_millis(300);
    let gw = gateway(config).await;
    let url = gw.url();
    let long = passage(1, 700);
    let request = chat(&[("user", &long)], 6, false);
    let response = tokio::time::timeout(Duration::from_secs(30), async {
        reqwest::Client::new()
            .post(format!("{url}/v1/chat/completions"))
            .json(&request)
            .send()
            .await
            .unwrap()
    })
    .await
    .expect("no hang");
    let status = response.status().as_u16();
    let route = response.headers()["x-kvroute-route"]
        .to_str()
        .unwrap()
        .to_string();
    let body: Value = response.json().await.unwrap();
    let metrics = reqwest::get(format!("{url}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let requests = prefill.requests.lock().unwrap().clone();
    gw.shutdown().await;
    decode.shutdown().await;
    (status, route, body, requests, metrics)
}

#[tokio::test]
async fn a_vllm_shaped_prefill_answer_reaches_the_decode_worker() {
    let (status, route, body, requests, metrics) = serve_one(Script::Prefill).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(route, "split");
    assert_eq!(body["usage"]["completion_tokens"], 6, "{body}");
    // vLLM's proxy request: one token, unary, do_remote_decode, the model's name.
    let leg = &requests[0];
    assert_eq!(leg["kv_transfer_params"]["do_remote_decode"], true, "{leg}");
    assert_eq!(leg["max_tokens"], 1, "{leg}");
    assert_eq!(leg["stream"], false, "{leg}");
    assert_eq!(leg["model"], MODEL);
    assert!(leg.get("stream_options").is_none(), "{leg}");
    assert!(
        metrics
            .contains("kvroute_gateway_routes_total{route=\"split\",reason=\"remote_prefill\"} 1")
    );
}

#[tokio::test]
async fn every_prefill_failure_is_served_by_a_local_prefill() {
    for (script, failures) in [
        (Script::Fail { status: 500 }, 1),
        (Script::Fail { status: 400 }, 0),
        (Script::Complete { tokens: 1 }, 0),
        (Script::Hang, 0),
    ] {
        let name = format!("{script:?}");
        let (status, route, body, requests, metrics) = serve_one(script).await;
        assert_eq!(status, 200, "{name}: {body}");
        assert_eq!(route, "prefill_failed", "{name}");
        assert_eq!(requests.len(), 1, "{name}");
        assert_eq!(body["usage"]["completion_tokens"], 6, "{name}: {body}");
        assert!(
            metrics.contains("kvroute_gateway_prefill_failures_total 1"),
            "{name}: {metrics}"
        );
        // Only a worker that failed (5xx, unreachable) leaves the routing set.
        assert!(
            metrics.contains(&format!("kvroute_gateway_worker_failures_total {failures}")),
            "{name}: {metrics}"
        );
    }
}
