//! The shipped Grafana dashboards (`deploy/grafana/*.json`) against a real Prometheus: `kvroute
//! demo --prometheus` scrapes a running demo through `deploy/prometheus/demo.yml`, and every
//! panel's every query, its variables substituted, must return data — so a renamed metric or
//! a label the scrape configuration no longer adds fails here, not in front of an audience.
//!
//! Panels whose metrics a laptop cannot have (kube-state-metrics' replica counts) sit in a
//! collapsed row of their dashboard and are listed in `EXPECTED_ABSENT` with the reason; the
//! test checks that they return nothing here, so the day their metric appears it asks for them
//! to be moved into the checked set instead of letting them pass unchecked.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

mod common;

use common::kvroute;

/// (dashboard uid, panel title, why its metrics do not exist yet).
const EXPECTED_ABSENT: &[(&str, &str, &str)] = &[
    (
        "kvroute-scaling",
        "Worker Pools (ready / desired replicas)",
        "autoscaling: replica counts come from kube-state-metrics on a cluster whose pools KEDA \
         scales; the demo resizes its pools itself",
    ),
    (
        "kvroute-scaling",
        "Scaling Events",
        "autoscaling: replica changes come from kube-state-metrics on a cluster",
    ),
];

/// The value every dashboard's `namespace` variable must default to: what the demo's scrape
/// configuration and the Kubernetes base put the series in.
const NAMESPACE: &str = "kvroute";

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

struct Query {
    dashboard: String,
    panel: String,
    ref_id: String,
    expr: String,
    /// In a collapsed row: a panel for a later feature.
    gated: bool,
}

fn dashboards() -> Vec<(PathBuf, Value)> {
    let dir = repo_root().join("deploy/grafana");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|entry| entry.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    files.sort();
    assert!(
        files.len() >= 2,
        "dashboards in {}: {files:?}",
        dir.display()
    );
    files
        .into_iter()
        .map(|path| {
            let text = std::fs::read_to_string(&path).unwrap();
            let json: Value = serde_json::from_str(&text)
                .unwrap_or_else(|e| panic!("{} is not JSON: {e}", path.display()));
            (path, json)
        })
        .collect()
}

/// Variable name → the value a query gets: `namespace` → NAMESPACE, textboxes → their
/// default.
fn substitutions(dashboard: &Value) -> BTreeMap<String, String> {
    let mut subs = BTreeMap::new();
    for var in dashboard["templating"]["list"].as_array().unwrap() {
        let name = var["name"].as_str().unwrap().to_owned();
        match var["type"].as_str().unwrap() {
            "textbox" => {
                let value = var["query"].as_str().unwrap().to_owned();
                assert!(value.parse::<f64>().is_ok(), "{name} = {value:?}");
                subs.insert(name, value);
            }
            "query" => {
                assert_eq!(name, "namespace", "an unexpected query variable");
                assert_eq!(var["current"]["value"], NAMESPACE);
                subs.insert(name, NAMESPACE.to_owned());
            }
            "datasource" => assert_eq!(var["query"], "prometheus"),
            other => panic!("variable {name} of type {other}"),
        }
    }
    assert!(subs.contains_key("namespace"), "no namespace variable");
    subs
}

fn substitute(expr: &str, subs: &BTreeMap<String, String>) -> String {
    let mut out = expr.to_owned();
    // Longest names first, so that `$ref_ttft_kv` is not cut by a shorter `$ref_ttft`.
    let mut names: Vec<&String> = subs.keys().collect();
    names.sort_by_key(|n| std::cmp::Reverse(n.len()));
    for name in names {
        out = out
            .replace(&format!("${{{name}}}"), &subs[name])
            .replace(&format!("${name}"), &subs[name]);
    }
    assert!(!out.contains('$'), "unsubstituted variable in {out}");
    out
}

/// Every query of every panel, rows' nested panels included.
fn queries() -> Vec<Query> {
    let mut out = Vec::new();
    for (path, dashboard) in dashboards() {
        let uid = dashboard["uid"].as_str().unwrap().to_owned();
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(
            !text.contains("dynamo-workload"),
            "{}: the namespace must be the $namespace variable",
            path.display()
        );
        let subs = substitutions(&dashboard);
        let mut panels: Vec<(&Value, bool)> = Vec::new();
        for panel in dashboard["panels"].as_array().unwrap() {
            if panel["type"] == "row" {
                let collapsed = panel["collapsed"] == true;
                for nested in panel["panels"].as_array().unwrap() {
                    panels.push((nested, collapsed));
                }
                // An open row's panels follow it at the top level.
                assert!(collapsed || panel["panels"].as_array().unwrap().is_empty());
            } else {
                panels.push((panel, false));
            }
        }
        for (panel, gated) in panels {
            let title = panel["title"].as_str().unwrap();
            assert_eq!(
                panel["datasource"]["uid"], "${datasource}",
                "{uid}/{title}: every panel uses the datasource variable"
            );
            let targets = panel["targets"].as_array().unwrap();
            assert!(!targets.is_empty(), "{uid}/{title} has no query");
            for target in targets {
                out.push(Query {
                    dashboard: uid.clone(),
                    panel: title.to_owned(),
                    ref_id: target["refId"].as_str().unwrap().to_owned(),
                    expr: substitute(target["expr"].as_str().unwrap(), &subs),
                    gated,
                });
            }
        }
    }
    out
}

/// The panels of later features are exactly the panels in collapsed rows, so a reader of the
/// dashboard and of this test sees the same two sets.
#[test]
fn later_feature_panels_are_the_collapsed_rows_and_listed_with_a_reason() {
    let gated: BTreeSet<(String, String)> = queries()
        .into_iter()
        .filter(|q| q.gated)
        .map(|q| (q.dashboard, q.panel))
        .collect();
    let listed: BTreeSet<(String, String)> = EXPECTED_ABSENT
        .iter()
        .map(|(d, p, _)| ((*d).to_owned(), (*p).to_owned()))
        .collect();
    assert_eq!(gated, listed);
}

#[test]
fn seed_001_display_2_is_all_there() {
    // Seed 001's panels with its queries, only `namespace="dynamo-workload"` replaced.
    let ns = format!("namespace=\"{NAMESPACE}\"");
    let seed = [
        (
            "Request Rate",
            format!("sum(rate(dynamo_frontend_requests_total{{{ns}}}[1m]))"),
        ),
        (
            "Inflight",
            format!("sum(dynamo_frontend_inflight_requests{{{ns}}})"),
        ),
        (
            "Queued",
            format!("sum(dynamo_frontend_queued_requests{{{ns}}})"),
        ),
        (
            "Output Tokens/s",
            format!("sum(rate(dynamo_frontend_output_tokens_total{{{ns}}}[1m]))"),
        ),
        (
            "TTFT p95 (SLO: 600ms)",
            "loadgen_ttft_all_seconds{quantile=\"0.95\"}".to_owned(),
        ),
        (
            "TTFT p95 (SLO: 600ms)",
            format!("sum(dynamo_frontend_inflight_requests{{{ns}}})"),
        ),
        (
            "TPOT p95 (SLO: 60ms)",
            "loadgen_tpot_all_seconds{quantile=\"0.95\"}".to_owned(),
        ),
        (
            "TPOT p95 (SLO: 60ms)",
            format!("sum(dynamo_frontend_inflight_requests{{{ns}}})"),
        ),
        (
            "TTFT (p50 and p95)",
            "loadgen_ttft_all_seconds{quantile=\"0.5\"}".to_owned(),
        ),
        (
            "TTFT (p50 and p95)",
            "loadgen_ttft_all_seconds{quantile=\"0.95\"}".to_owned(),
        ),
        (
            "TPOT (p50 and p95)",
            "loadgen_tpot_all_seconds{quantile=\"0.5\"}".to_owned(),
        ),
        (
            "TPOT (p50 and p95)",
            "loadgen_tpot_all_seconds{quantile=\"0.95\"}".to_owned(),
        ),
        (
            "Latency",
            format!(
                "sum(rate(dynamo_frontend_request_duration_seconds_sum{{{ns}}}[1m])) / \
                 sum(rate(dynamo_frontend_request_duration_seconds_count{{{ns}}}[1m]))"
            ),
        ),
        (
            "KV Cache",
            format!(
                "rate(dynamo_frontend_cached_tokens_sum{{{ns}}}[1m]) / \
                 rate(dynamo_frontend_input_sequence_tokens_sum{{{ns}}}[1m])"
            ),
        ),
        (
            "Inflight Requests (per worker)",
            format!("dynamo_component_inflight_requests{{{ns}}}"),
        ),
        (
            "GPU Utilization (per GPU)",
            format!("DCGM_FI_DEV_GPU_UTIL{{exported_namespace=\"{NAMESPACE}\"}}"),
        ),
        (
            "Engine Queue Wait Time (per worker)",
            format!(
                "rate(trtllm_request_queue_time_seconds_sum{{{ns}}}[1m]) / \
                 rate(trtllm_request_queue_time_seconds_count{{{ns}}}[1m])"
            ),
        ),
    ];
    let queries = queries();
    for (panel, expr) in seed {
        assert!(
            queries
                .iter()
                .any(|q| q.dashboard == "kvroute-demo" && q.panel == panel && q.expr == expr),
            "kvroute-demo has no panel {panel:?} with {expr}"
        );
    }
}

/// The demo, stopped with Ctrl-C (so that it stops its Prometheus) even when the test fails.
struct Demo(Child);

impl Drop for Demo {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.0.id() as libc::pid_t, libc::SIGINT) };
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A blocking client for Prometheus's query API.
struct Http {
    runtime: tokio::runtime::Runtime,
    client: reqwest::Client,
}

impl Http {
    fn new() -> Http {
        Http {
            runtime: tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap(),
            client: reqwest::Client::new(),
        }
    }

    fn get_json(&self, url: &str, query: &[(&str, &str)]) -> reqwest::Result<Value> {
        let url = reqwest::Url::parse_with_params(url, query).expect("a valid URL");
        self.runtime.block_on(async {
            self.client
                .get(url)
                .timeout(Duration::from_secs(10))
                .send()
                .await?
                .json()
                .await
        })
    }
}

fn prometheus_query(http: &Http, url: &str, expr: &str) -> Vec<Value> {
    let response = http
        .get_json(&format!("{url}/api/v1/query"), &[("query", expr)])
        .unwrap_or_else(|e| panic!("querying {expr}: {e}"));
    assert_eq!(response["status"], "success", "{expr}: {response}");
    response["data"]["result"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

/// Some series with a finite value (a ratio of two idle rates is NaN: not data).
fn has_data(result: &[Value]) -> bool {
    result.iter().any(|series| {
        series["value"][1]
            .as_str()
            .and_then(|v| v.parse::<f64>().ok())
            .is_some_and(f64::is_finite)
    })
}

#[test]
fn every_panel_query_returns_data_from_a_real_prometheus_scraping_the_demo() {
    let queries = queries();
    let mut child = kvroute()
        .args(["demo", "--prometheus", "--prometheus-port", "0"])
        .args(["--port", "0", "--gateway-port", "0"])
        // Disaggregated pools (the pool panels) and speculative decoding (the spec-decode
        // panels); the phase panel reads IDLE in manual mode. Every panel but the cluster-only
        // ones has data.
        .args(["--prefill-workers", "1", "--decode-workers", "2"])
        .args(["--spec-decode", "eagle3"])
        .args(["--speedup", "50", "--concurrency", "4", "--ramp", "0"])
        .args(["--start", "--no-baseline"])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let demo = Demo(child);
    let mut prometheus = None;
    let mut lines = BufReader::new(stdout).lines();
    for line in lines.by_ref() {
        let line = line.unwrap();
        if let Some(rest) = line.strip_prefix("kvroute demo: Prometheus on ") {
            prometheus = rest.split_whitespace().next().map(str::to_owned);
        }
        if line.contains("kvroute demo: open ") {
            break;
        }
    }
    // Keep reading, so that the demo's last lines do not meet a closed pipe.
    std::thread::spawn(move || lines.for_each(drop));
    let url = prometheus.expect(
        "the demo printed no Prometheus URL: is `prometheus` installed? (Debian: apt-get \
         install prometheus; .ci/run does)",
    );

    let http = Http::new();
    let (checked, absent): (Vec<&Query>, Vec<&Query>) = queries.iter().partition(|q| !q.gated);
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut missing: Vec<&Query> = checked.clone();
    while !missing.is_empty() {
        missing.retain(|q| !has_data(&prometheus_query(&http, &url, &q.expr)));
        if Instant::now() > deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    let report: Vec<String> = missing
        .iter()
        .map(|q| format!("{}/{} [{}]: {}", q.dashboard, q.panel, q.ref_id, q.expr))
        .collect();
    assert!(
        report.is_empty(),
        "panel queries that returned no data from Prometheus:\n{}",
        report.join("\n")
    );
    for q in &absent {
        let result = prometheus_query(&http, &url, &q.expr);
        assert!(
            result.is_empty(),
            "{}/{} now returns data ({:?}): its feature has arrived, so take it out of \
             EXPECTED_ABSENT and out of its collapsed row",
            q.dashboard,
            q.panel,
            result
        );
    }
    println!(
        "checked {} queries of {} panels: all return data; expected absent ({} queries):",
        checked.len(),
        checked
            .iter()
            .map(|q| (&q.dashboard, &q.panel))
            .collect::<BTreeSet<_>>()
            .len(),
        absent.len()
    );
    for (dashboard, panel, why) in EXPECTED_ABSENT {
        println!("  {dashboard}/{panel}: {why}");
    }
    drop(demo);
}

#[test]
fn demo_prometheus_says_what_to_install_when_prometheus_is_missing() {
    let output = kvroute()
        .args([
            "demo",
            "--prometheus",
            "--prometheus-bin",
            "/nonexistent/prometheus",
        ])
        .args(["--port", "0", "--gateway-port", "0", "--workers", "1"])
        .args(["--prometheus-port", "0", "--no-baseline"])
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("error: --prometheus needs a Prometheus server")
            && stderr.contains("apt-get install prometheus")
            && stderr.contains("--prometheus-bin"),
        "{stderr}"
    );
}

#[test]
fn demo_prometheus_is_for_one_simulated_cluster() {
    for extra in [
        &["--compare", "round_robin,kv"][..],
        &["--target", "http://127.0.0.1:1"][..],
    ] {
        let output = kvroute()
            .args(["demo", "--prometheus"])
            .args(extra)
            .output()
            .unwrap();
        assert!(!output.status.success());
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains("cannot be used with"), "{stderr}");
    }
}
