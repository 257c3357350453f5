//! A real cluster for the load generator's tests: simulated engines (fast) behind the real
//! gateway.

#![allow(dead_code)]

use engine_server::{EngineServer, EngineServerConfig, EngineServerHandle};
use gateway::{Gateway, GatewayConfig, WorkerSpec};
use kv_index::WorkerId;
use serde_json::Value;

pub const MODEL: &str = "llama-3.1-70b-instruct";

/// Seed 002's H200 worker, `speedup` times faster than real time, publishing its KV events
/// over ZMQ and its DCGM-style metrics under `hostname`.
pub async fn engine(id: u64, speedup: f64, hostname: &str) -> EngineServerHandle {
    engine_with_spec(id, speedup, hostname, None).await
}

/// [`engine`] with speculative decoding: a configuration the H200 profile names (`draft`,
/// `eagle3`).
pub async fn engine_with_spec(
    id: u64,
    speedup: f64,
    hostname: &str,
    spec: Option<&str>,
) -> EngineServerHandle {
    let mut config = EngineServerConfig::new();
    config.engine.spec_decode = spec.map(|name| {
        config
            .engine
            .profile
            .speculative_config(name)
            .expect("a named configuration")
    });
    config.worker_id = WorkerId(id);
    config.speedup = speedup;
    config.seed = id;
    config.model = MODEL.to_owned();
    config.zmq_pub = Some("tcp://127.0.0.1:0".to_owned());
    config.hostname = hostname.to_owned();
    EngineServer::bind(config).await.expect("engine starts")
}

/// The gateway (default router, `kv_load`) in front of `engines`, on a free port.
pub async fn gateway(engines: &[EngineServerHandle]) -> Gateway {
    Gateway::bind(GatewayConfig {
        listen: "127.0.0.1:0".parse().expect("address"),
        model: MODEL.to_owned(),
        workers: engines.iter().map(|e| WorkerSpec::new(e.url())).collect(),
        ..GatewayConfig::default()
    })
    .await
    .expect("gateway starts")
}

/// The names on the worker cards of a lane's `workers` view.
pub fn worker_names(workers: &Value) -> Vec<String> {
    workers["list"]
        .as_array()
        .map(|list| {
            list.iter()
                .filter_map(|w| w["name"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}
