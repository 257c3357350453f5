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

/// Sums each worker's speculative counters (drafts, accepted, evaluated positions) as read
/// from its own `/metrics`: the lifetime figures the windowed ones are checked against.
async fn direct_spec_totals(cluster: &Cluster) -> loadgen::SpecPoint {
    let mut total: Option<loadgen::SpecPoint> = None;
    for engine in &cluster.engines {
        let text = reqwest::get(format!("{}/metrics", engine.url()))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let point = loadgen::SpecPoint::from_samples(0.0, &loadgen::parse_text(&text))
            .expect("the engine exports vllm:spec_decode_* counters");
        total = Some(match total {
            None => point,
            Some(sum) => sum + point,
        });
    }
    total.unwrap()
}

/// Speculative decoding through Prometheus: the acceptance and tokens-per-step cards come from
/// `rate()` of the workers' `vllm:spec_decode_*` counters (direct scraping off), and agree
/// with the same ratios of the engines' own lifetime counters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn speculative_figures_come_from_prometheus() {
    let mut engines = Vec::new();
    for id in 0..2 {
        engines.push(
            common::engine_with_spec(id, SPEEDUP, &format!("worker-{id}"), Some("eagle3")).await,
        );
    }
    let gateway = common::gateway(&engines).await;
    let cluster = Cluster { engines, gateway };
    let mut targets = vec![cluster.gateway.local_addr().to_string()];
    targets.extend(cluster.engines.iter().map(|e| e.local_addr().to_string()));
    let prometheus = Prometheus::start(&targets);

    let mut lane = LaneSpec::for_gateway("live", None, &cluster.gateway.url(), MODEL);
    lane.gateway_metrics = None;
    // No --worker-metrics either: only Prometheus can give the speculative figures.
    lane.worker_metrics = Vec::new();
    lane.prometheus = Some(prometheus.url.clone());
    let mut config = loadgen_config(vec![lane], 4, SPEEDUP);
    config.autostart = true;
    let loadgen = Loadgen::bind(config).await.unwrap();
    let url = loadgen.url();

    let deadline = Instant::now() + Duration::from_secs(120);
    let metrics = loop {
        let s = get_status(&url).await;
        let m = s["lanes"][0]["metrics"].clone();
        if m["acceptance_rate"].is_number() && m["tokens_per_step"].is_number() {
            break m;
        }
        assert!(
            Instant::now() < deadline,
            "no speculative figures from Prometheus: {s}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    let alpha = metrics["acceptance_rate"].as_f64().unwrap();
    let per_step = metrics["tokens_per_step"].as_f64().unwrap();
    let lifetime = direct_spec_totals(&cluster).await;
    let lifetime_alpha = lifetime.acceptance_rate().unwrap();
    let lifetime_per_step = lifetime.tokens_per_step().unwrap();
    // The window (1 minute of wall time) covers all or nearly all of the run, so the windowed
    // ratios are the lifetime ones up to the sampling noise of a few hundred drafts.
    assert!(
        (alpha - lifetime_alpha).abs() < 0.08,
        "α from Prometheus {alpha} vs the engines' counters {lifetime_alpha}"
    );
    assert!(
        (per_step - lifetime_per_step).abs() < 0.3,
        "tokens per step from Prometheus {per_step} vs the engines' counters {lifetime_per_step}"
    );
    // EAGLE-3 accepts most drafts: more than one token per step, never more than K + 1.
    assert!((0.5..1.0).contains(&alpha), "{alpha}");
    assert!(per_step > 1.5, "{per_step}");
    loadgen.shutdown().await;
    cluster.gateway.shutdown().await;
}
