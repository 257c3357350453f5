//! With a Prometheus URL, the KV hit rate, the queue and the GPU view come from a real
//! Prometheus server (Debian's `prometheus`, installed by `.ci/run`) scraping the gateway and
//! the engines, through seed 001's queries; when it goes away the dashboard says so.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use loadgen::{LaneSpec, Loadgen};
use serde_json::Value;

mod common;

use common::{Cluster, MODEL, get, loadgen_config, worker_names};
const SPEEDUP: f64 = 50.0;

/// A Prometheus server on a free port with its own data directory, killed on drop.
struct Prometheus {
    child: Child,
    url: String,
    dir: std::path::PathBuf,
}

impl Prometheus {
    fn start(targets: &[String]) -> Prometheus {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let dir =
            std::env::temp_dir().join(format!("kvroute-prometheus-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let targets: Vec<String> = targets.iter().map(|t| format!("'{t}'")).collect();
        let config = format!(
            "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: kvroute\n    \
             static_configs:\n      - targets: [{}]\n",
            targets.join(", ")
        );
        std::fs::write(dir.join("prometheus.yml"), config).unwrap();
        let child = Command::new("prometheus")
            .arg(format!(
                "--config.file={}",
                dir.join("prometheus.yml").display()
            ))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("prometheus runs this test: install Debian's prometheus (.ci/run does)");
        Prometheus {
            child,
            url: format!("http://127.0.0.1:{port}"),
            dir,
        }
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

async fn get_status(url: &str) -> Value {
    get(&format!("{url}/api/status")).await.1
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hit_rate_queue_and_gpus_come_from_prometheus() {
    let cluster = Cluster::start(0..2, SPEEDUP, "gpu-node-").await;
    let mut targets = vec![cluster.gateway.local_addr().to_string()];
    targets.extend(cluster.engines.iter().map(|e| e.local_addr().to_string()));
    let mut prometheus = Prometheus::start(&targets);

    let mut lane = LaneSpec::for_gateway("live", None, &cluster.gateway.url(), MODEL);
    // Direct scraping off: every figure below must come through Prometheus.
    lane.gateway_metrics = None;
    lane.prometheus = Some(prometheus.url.clone());
    let mut config = loadgen_config(vec![lane], 4, SPEEDUP);
    config.autostart = true;
    let loadgen = Loadgen::bind(config).await.unwrap();
    let url = loadgen.url();

    let deadline = Instant::now() + Duration::from_secs(90);
    let status = loop {
        let s = get_status(&url).await;
        let lane = &s["lanes"][0];
        if lane["metrics"]["kv_hit_rate"].is_number()
            && lane["workers"]["list"]
                .as_array()
                .is_some_and(|l| l.len() == 2)
            && lane["metrics"]["queued"].is_number()
        {
            break s;
        }
        assert!(Instant::now() < deadline, "no figures from Prometheus: {s}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    let lane = &status["lanes"][0];
    let hit = lane["metrics"]["kv_hit_rate"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&hit), "{hit}");
    assert_eq!(lane["metrics"]["queued"], 0.0);
    let workers = &lane["workers"];
    assert_eq!(workers["available"], true);
    assert_eq!(worker_names(workers), ["gpu-node-0", "gpu-node-1"]);
    assert!(workers["gpu"].as_str().unwrap().contains("H200"));
    let memory = workers["list"][0]["gpus"][0]["memory_pct"]
        .as_f64()
        .unwrap();
    assert!((1.0..=100.0).contains(&memory), "{memory}");

    // Prometheus goes away: the GPU view says it is unavailable, and why.
    let _ = prometheus.child.kill();
    let _ = prometheus.child.wait();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let s = get_status(&url).await;
        let workers = &s["lanes"][0]["workers"];
        if workers["available"] == false {
            let error = workers["error"].as_str().unwrap();
            assert!(error.starts_with("Prometheus unavailable"), "{error}");
            assert_eq!(s["lanes"][0]["metrics"]["kv_hit_rate"], Value::Null);
            break;
        }
        assert!(Instant::now() < deadline, "still available: {s}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    loadgen.shutdown().await;
    cluster.gateway.shutdown().await;
}

/// Seed 004's pools through Prometheus: the workers' roles (`kvroute_engine_role`, matched to
/// their GPU series by scrape target) and each pool's TTFT and ITL from the gateway's
/// histograms by `pool` (`histogram_quantile` over `rate(…[1m])`), on the lane clock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pools_and_roles_come_from_prometheus() {
    let cluster = Cluster::disaggregated(1, 1, SPEEDUP).await;
    let mut targets = vec![cluster.gateway.local_addr().to_string()];
    targets.extend(cluster.engines.iter().map(|e| e.local_addr().to_string()));
    let prometheus = Prometheus::start(&targets);

    let mut lane = LaneSpec::for_gateway("live", None, &cluster.gateway.url(), MODEL);
    lane.gateway_metrics = None;
    lane.prometheus = Some(prometheus.url.clone());
    let mut config = loadgen_config(vec![lane], 4, SPEEDUP);
    config.autostart = true;
    let loadgen = Loadgen::bind(config).await.unwrap();
    let url = loadgen.url();

    let pool = |s: &Value, name: &str| -> Value {
        s["lanes"][0]["workers"]["pools"]
            .as_array()
            .and_then(|pools| pools.iter().find(|p| p["pool"] == name).cloned())
            .unwrap_or(Value::Null)
    };
    let deadline = Instant::now() + Duration::from_secs(120);
    let status = loop {
        let s = get_status(&url).await;
        if pool(&s, "prefill")["ttft_ms"]["p95"].is_number()
            && pool(&s, "decode")["itl_ms"]["p95"].is_number()
        {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "no pool figures from Prometheus: {s}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    let workers = &status["lanes"][0]["workers"];
    assert_eq!(worker_names(workers), ["worker-0", "worker-1"]);
    assert_eq!(
        common::strings(&workers["list"], "role"),
        ["prefill", "decode"]
    );
    // The gateway's wall-clock ITL × 50 is of the order of the client's (model time).
    let pool_itl = pool(&status, "decode")["itl_ms"]["p50"].as_f64().unwrap();
    assert!((1.0..500.0).contains(&pool_itl), "{pool_itl}");
    loadgen.shutdown().await;
    cluster.gateway.shutdown().await;
}
