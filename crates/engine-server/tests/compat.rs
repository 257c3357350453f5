//! What other routers probe before they route to a worker (sglang-router, vllm-router):
//! answered with the served model, the KV block size and where the KV events are.
//! `crates/kvroute/tests/python_routers.rs` runs the routers themselves against engines.

mod common;

use common::{MODEL, client, config, start};
use serde_json::{Value, json};

async fn get(base: &str, path: &str) -> Value {
    let response = client().get(format!("{base}{path}")).send().await.unwrap();
    assert_eq!(response.status(), 200, "{path}");
    response.json().await.unwrap()
}

#[tokio::test]
async fn router_probes_name_the_model_blocks_and_event_sources() {
    let mut settings = config(100.0);
    settings.zmq_pub = Some("tcp://127.0.0.1:0".into());
    let (server, base) = start(settings).await;
    let card = get(&base, "/info").await;
    let zmq = card["zmq_endpoint"]
        .as_str()
        .expect("the card names the ZMQ endpoint");

    for path in ["/server_info", "/get_server_info"] {
        let info = get(&base, path).await;
        assert_eq!(info["model_path"], MODEL, "{path}: {info}");
        assert_eq!(info["model_id"], MODEL, "{path}: {info}");
        assert_eq!(info["kv_block_size"], card["block_size"], "{path}: {info}");
        assert_eq!(info["dp_size"], 1, "{path}: {info}");
        assert_eq!(
            info["max_running_requests"], card["max_num_seqs"],
            "{path}: {info}"
        );
        assert_eq!(
            info["context_length"], card["max_model_len"],
            "{path}: {info}"
        );
    }
    for path in ["/model_info", "/get_model_info"] {
        let info = get(&base, path).await;
        assert_eq!(info["model_path"], MODEL, "{path}: {info}");
        assert_eq!(info["is_generation"], true, "{path}: {info}");
    }
    assert!(
        get(&base, "/version").await["version"]
            .as_str()
            .is_some_and(|v| v.starts_with("kvroute-"))
    );
    assert_eq!(get(&base, "/health_generate").await, json!({}));
    assert_eq!(get(&base, "/load").await, json!({"server_load": 0}));
    assert_eq!(
        get(&base, "/kv_event_sources").await,
        json!({"0": {
            "endpoint": zmq, "replay_endpoint": null, "topic": "",
            "publisher": "zmq", "enable_kv_cache_events": true,
        }})
    );

    // Tokenize and detokenize round-trip; an id outside the vocabulary is a 400, not a panic.
    let tokens = client()
        .post(format!("{base}/tokenize"))
        .json(&json!({"prompt": "Harbours shelter ships."}))
        .send()
        .await
        .unwrap()
        .json::<Value>()
        .await
        .unwrap()["tokens"]
        .clone();
    let text = client()
        .post(format!("{base}/detokenize"))
        .json(&json!({"model": MODEL, "tokens": tokens}))
        .send()
        .await
        .unwrap()
        .json::<Value>()
        .await
        .unwrap();
    assert_eq!(text, json!({"prompt": "Harbours shelter ships."}));
    let bad = client()
        .post(format!("{base}/detokenize"))
        .json(&json!({"tokens": [u32::MAX]}))
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);
    let error: Value = bad.json().await.unwrap();
    assert_eq!(error["error"]["param"], "tokens", "{error}");
    server.shutdown().await;
}

#[tokio::test]
async fn without_zmq_events_no_source_is_listed() {
    let (server, base) = start(config(100.0)).await;
    assert_eq!(get(&base, "/kv_event_sources").await, json!({}));
    assert_eq!(
        get(&base, "/server_info").await["kv_events_endpoint"],
        Value::Null
    );
    server.shutdown().await;
}
