//! A real cluster for the load generator's tests: simulated engines (fast) behind the real
//! gateway.

#![allow(dead_code)]

pub mod browser;

use std::time::{Duration, Instant};

use engine_server::{EngineServer, EngineServerConfig, EngineServerHandle};
use gateway::{Gateway, GatewayConfig, WorkerSpec};
use kv_index::WorkerId;
use loadgen::{LaneSpec, LoadgenConfig};
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
    EngineServer::bind(engine_config(id, speedup, hostname, spec))
        .await
        .expect("engine starts")
}

/// The configuration of [`engine_with_spec`].
pub fn engine_config(
    id: u64,
    speedup: f64,
    hostname: &str,
    spec: Option<&str>,
) -> EngineServerConfig {
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
    config
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

/// Engines behind one gateway.
pub struct Cluster {
    pub engines: Vec<EngineServerHandle>,
    pub gateway: Gateway,
}

impl Cluster {
    /// Workers `ids` (see [`engine`]), named `{host_prefix}{id}`, behind [`gateway`].
    pub async fn start(ids: std::ops::Range<u64>, speedup: f64, host_prefix: &str) -> Cluster {
        let mut engines = Vec::new();
        for id in ids {
            engines.push(engine(id, speedup, &format!("{host_prefix}{id}")).await);
        }
        let gateway = gateway(&engines).await;
        Cluster { engines, gateway }
    }

    /// Seed 004's disaggregated fleet: `prefill` prefill-only workers (ids first) and `decode`
    /// decode-only ones, named `worker-{id}`, behind [`gateway`], which reads their roles from
    /// their `/info`.
    pub async fn disaggregated(prefill: u64, decode: u64, speedup: f64) -> Cluster {
        let mut engines = Vec::new();
        for id in 0..prefill + decode {
            let mut config = engine_config(id, speedup, &format!("worker-{id}"), None);
            config.engine.role = if id < prefill {
                engine::Role::PrefillOnly
            } else {
                engine::Role::DecodeOnly
            };
            engines.push(EngineServer::bind(config).await.expect("engine starts"));
        }
        let gateway = gateway(&engines).await;
        Cluster { engines, gateway }
    }

    /// A lane `name` driving this cluster's gateway (shown as `router`), scraping every
    /// engine's `/metrics`.
    pub fn lane(&self, name: &str, router: Option<&str>) -> LaneSpec {
        let mut lane = LaneSpec::for_gateway(name, router, &self.gateway.url(), MODEL);
        lane.worker_metrics = self
            .engines
            .iter()
            .map(|e| format!("{}/metrics", e.url()))
            .collect();
        lane
    }
}

/// A load generator on a free port driving `lanes` with `concurrency` conversations at once,
/// no ramp, its clock `speedup` times faster (the engines' speed).
pub fn loadgen_config(lanes: Vec<LaneSpec>, concurrency: u32, speedup: f64) -> LoadgenConfig {
    let mut config = LoadgenConfig::new(lanes);
    config.listen = "127.0.0.1:0".parse().expect("address");
    config.drive.workload.concurrency = concurrency;
    config.drive.workload.ramp_s = 0.0;
    config.drive.time_scale = speedup;
    config
}

/// GETs `url`; the status and the JSON body (null when the body is not JSON).
pub async fn get(url: &str) -> (u16, Value) {
    let response = reqwest::get(url).await.expect("GET");
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

/// Runs `check` every 100 ms until it holds, for up to `timeout`.
pub async fn wait_until(what: &str, timeout: Duration, mut check: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !check().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Polls the load generator at `url` until its `/api/status` satisfies `check`, for up to
/// `timeout`.
pub async fn wait_for_status(
    url: &str,
    what: &str,
    timeout: Duration,
    check: impl Fn(&Value) -> bool,
) {
    wait_until(what, timeout, async || {
        check(&get(&format!("{url}/api/status")).await.1)
    })
    .await;
}

/// The `key` string of every item of the JSON array `list`.
pub fn strings<'a>(list: &'a Value, key: &str) -> Vec<&'a str> {
    list.as_array()
        .expect("a JSON array")
        .iter()
        .map(|item| item[key].as_str().expect("a string"))
        .collect()
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
