//! `kvroute demo` and `kvroute loadgen` as a presenter runs them: one command starts the
//! cluster, the gateway, the load generator and the dashboard, prints the URL, serves the API,
//! and stops cleanly on Ctrl-C (SIGINT); bad arguments fail with a clear error.

use std::io::{BufRead, BufReader, Read};
use std::process::{ChildStdout, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

mod common;

use common::{Running, assert_failures, failure, get_json, get_text, post_json};

/// Reads stdout lines until one contains `marker`; returns every line read.
fn lines_until(stdout: &mut BufReader<ChildStdout>, marker: &str) -> Vec<String> {
    let mut lines = Vec::new();
    loop {
        let mut line = String::new();
        let n = stdout.read_line(&mut line).expect("stdout");
        assert!(
            n > 0,
            "the demo exited before printing {marker:?}: {lines:?}"
        );
        let done = line.contains(marker);
        lines.push(line.trim_end().to_owned());
        if done {
            return lines;
        }
    }
}

/// The dashboard's URL from the demo's "open URL" line.
fn dashboard_url(lines: &[String]) -> String {
    lines
        .last()
        .and_then(|line| line.split_whitespace().find(|w| w.starts_with("http://")))
        .expect("the demo prints its URL")
        .to_owned()
}

/// `kvroute demo` on free ports, read up to its "open URL" line.
struct Demo {
    running: Running,
    /// The rest of its stdout.
    stdout: BufReader<ChildStdout>,
    /// The lines it printed up to and with the "open" line.
    lines: Vec<String>,
    /// The dashboard's URL.
    url: String,
}

impl Demo {
    /// Starts `kvroute demo --port 0 --gateway-port 0 ARGS`.
    fn start(args: &[&str]) -> Demo {
        let args = [&["demo", "--port", "0", "--gateway-port", "0"], args].concat();
        let mut running = Running::spawn(&args, Stdio::piped());
        let mut stdout = running.take_stdout();
        let lines = lines_until(&mut stdout, "kvroute demo: open ");
        let url = dashboard_url(&lines);
        Demo {
            running,
            stdout,
            lines,
            url,
        }
    }

    /// Polls `/api/status` every 200 ms until `done` says so, for up to two minutes.
    fn wait_for_status(&self, what: &str, done: impl Fn(&Value) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let status = get(&format!("{}/api/status", self.url));
            if done(&status) {
                return;
            }
            assert!(Instant::now() < deadline, "{what}: {status}");
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Ctrl-C, as a presenter stops it; the exit status within 20 s.
    fn interrupt(&mut self) -> std::process::ExitStatus {
        self.running.stop(libc::SIGINT, Duration::from_secs(20))
    }
}

fn block_on<T>(work: impl Future<Output = T>) -> T {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(work)
}

fn get(url: &str) -> Value {
    block_on(get_json(url))
}

fn post(url: &str) -> u16 {
    block_on(async {
        reqwest::Client::new()
            .post(url)
            .send()
            .await
            .unwrap()
            .status()
            .as_u16()
    })
}

#[test]
fn demo_runs_the_whole_system_and_stops_on_ctrl_c() {
    let mut demo = Demo::start(&[
        "--workers",
        "2",
        "--speedup",
        "50",
        "--concurrency",
        "3",
        "--start",
    ]);
    let (lines, url) = (&demo.lines, &demo.url);
    // The recorded comparison is simulated for this very cluster at start-up.
    assert!(
        lines[0].contains("simulated the recorded comparison (round_robin vs kv_load)"),
        "{lines:?}"
    );
    assert!(lines[1].contains("2 simulated h200-llama70b-fp8 workers behind the kv_load gateway"));

    let baseline = get(&format!("{url}/api/baseline"));
    assert!(
        baseline["source"].as_str().unwrap().contains("--workers 2"),
        "{baseline}"
    );
    assert_eq!(baseline["kv_router"], "kv_load");
    assert_eq!(baseline["levels"].as_array().unwrap().len(), 7);

    demo.wait_for_status("no finished turns", |status| {
        let lane = &status["lanes"][0];
        assert_eq!(status["running"], true);
        assert_eq!(lane["router"], "kv_load");
        let done = lane["metrics"]["requests"].as_u64().unwrap() >= 3
            && lane["workers"]["list"].as_array().unwrap().len() == 2;
        if done {
            assert_eq!(lane["metrics"]["errors"], 0);
        }
        done
    });
    // The page is served from the binary.
    let page = block_on(get_text(&format!("{url}/")));
    assert!(page.contains("<script type=\"module\""), "{page}");

    let status = demo.interrupt();
    assert!(status.success(), "{status:?}");
    let mut rest = String::new();
    demo.stdout.read_to_string(&mut rest).unwrap();
    assert!(rest.contains("kvroute demo: stopped"), "{rest}");
}

/// `demo --prefill-workers 1 --decode-workers 2`: the pools start, the gateway serves the
/// conversations through them without errors.
#[test]
fn demo_starts_prefill_and_decode_pools() {
    let mut demo = Demo::start(&[
        "--prefill-workers",
        "1",
        "--decode-workers",
        "2",
        "--speedup",
        "50",
        "--concurrency",
        "3",
        "--start",
    ]);
    assert!(
        demo.lines
            .iter()
            .any(|l| l.contains("3 simulated h200-llama70b-fp8 workers (1 prefill, 2 decode)")),
        "{:?}",
        demo.lines
    );
    demo.wait_for_status("no finished turns", |status| {
        let lane = &status["lanes"][0];
        let done = lane["metrics"]["requests"].as_u64().unwrap() >= 3;
        if done {
            assert_eq!(lane["metrics"]["errors"], 0, "{status}");
        }
        done
    });
    // The gateway split requests across the pools (the conversations open with long
    // passages) and labels the TTFT of those with the prefill pool.
    let line = demo
        .lines
        .iter()
        .find(|l| l.contains(" gateway on "))
        .expect("the gateway's line");
    let gateway = line.rsplit(" gateway on ").next().unwrap().trim();
    let metrics = block_on(get_text(&format!("{gateway}/metrics")));
    assert!(
        metrics.contains("kvroute_gateway_routes_total{route=\"split\",reason=\"remote_prefill\"}"),
        "{metrics}"
    );
    assert!(
        metrics.contains("kvroute_worker_role{worker_id=\"0\",worker=")
            && metrics.contains("role=\"prefill\"} 1"),
        "{metrics}"
    );
    let status = demo.interrupt();
    assert!(status.success(), "{status:?}");
}

#[test]
fn compare_mode_runs_two_clusters_on_the_same_conversations() {
    let mut demo = Demo::start(&[
        "--workers",
        "1",
        "--speedup",
        "50",
        "--concurrency",
        "2",
        "--no-baseline",
        "--compare",
        "round_robin,kv",
    ]);
    let url = &demo.url;
    let status = get(&format!("{url}/api/status"));
    let names: Vec<&str> = status["lanes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["round_robin", "kv"]);
    assert_eq!(status["running"], false, "not started without --start");
    assert_eq!(status["baseline"], Value::Null);
    assert_eq!(post(&format!("{url}/api/workload/start")), 200);
    demo.wait_for_status("both lanes progress", |status| {
        let done = |i: usize| status["lanes"][i]["metrics"]["requests"].as_u64().unwrap();
        done(0) >= 2 && done(1) >= 2
    });
    assert!(demo.interrupt().success());
}

#[test]
fn bad_arguments_fail_with_a_clear_error() {
    assert_failures(&[
        (
            &["demo", "--compare", "kv,kv"],
            "--compare takes two different routers",
        ),
        (
            &["demo", "--workers", "0"],
            "--workers must be between 1 and 64",
        ),
        (
            &["demo", "--prefill-workers", "0", "--decode-workers", "2"],
            "--prefill-workers must be between 1 and 32",
        ),
        (
            &["demo", "--prefill-workers", "1", "--decode-workers", "99"],
            "--decode-workers must be between 1 and 32",
        ),
        (&["demo", "--prefill-workers", "2"], "--decode-workers"),
        (
            &[
                "demo",
                "--workers",
                "3",
                "--prefill-workers",
                "1",
                "--decode-workers",
                "1",
            ],
            "cannot be used with",
        ),
        (&["demo", "--router", "best"], "router \"best\""),
        (
            &["demo", "--phase", "medusa"],
            "the ladder's phases are baseline, kv, draft, eagle3",
        ),
        (
            &[
                "demo",
                "--profile",
                "h100-llama8b",
                "--spec-decode",
                "eagle3",
            ],
            "has no speculative-decoding configurations",
        ),
        (
            &["demo", "--phase-reference", "/nonexistent-phases.json"],
            "reading /nonexistent-phases.json",
        ),
        (&["demo", "--think-time=-1"], "--think-time must be"),
        (
            &["demo", "--scenario", "/nonexistent-scenario.toml"],
            "--scenario: reading /nonexistent-scenario.toml",
        ),
        (
            &["demo", "--ttft-threshold", "0"],
            "--ttft-threshold must be a positive number",
        ),
        (
            &["loadgen", "--target", "localhost:8000"],
            "--target must be an http:// or https:// URL",
        ),
        (
            &[
                "loadgen",
                "--target",
                "http://x",
                "--baseline",
                "/nonexistent.json",
            ],
            "reading /nonexistent.json",
        ),
    ]);
}

/// `demo --phase eagle3`: KV-aware routing and EAGLE-3 workers; the dashboard's status
/// carries the workers' acceptance and tokens per step, and the shipped ladder's reference
/// lines for this cluster (3 × H200).
#[test]
fn demo_starts_at_a_phase_with_speculative_workers_and_reference_lines() {
    let mut demo = Demo::start(&[
        "--workers",
        "3",
        "--speedup",
        "50",
        "--concurrency",
        "4",
        "--start",
        "--no-baseline",
        "--phase",
        "eagle3",
    ]);
    assert!(
        demo.lines
            .iter()
            .any(|l| l.contains("(speculative decoding: eagle3) behind the kv_load gateway")),
        "{:?}",
        demo.lines
    );
    demo.wait_for_status("acceptance reported", |status| {
        assert_eq!(status["references"]["setup"], "h200x3", "{status}");
        let m = &status["lanes"][0]["metrics"];
        match (m["acceptance_rate"].as_f64(), m["tokens_per_step"].as_f64()) {
            (Some(a), Some(t)) => {
                assert!((0.5..1.0).contains(&a) && (1.5..6.0).contains(&t), "{m}");
                true
            }
            _ => false,
        }
    });
    assert!(demo.interrupt().success());
}

/// A scenario file in the temporary directory, unique to this test.
fn scenario_file(name: &str, toml: &str) -> std::path::PathBuf {
    let path = std::env::temp_dir().join(format!("kvroute-{}-{name}.toml", std::process::id()));
    std::fs::write(&path, toml).expect("scenario file written");
    path
}

/// The gateway's URL from the demo's cluster line.
fn gateway_url(lines: &[String]) -> String {
    let line = lines
        .iter()
        .find(|l| l.contains(" gateway on "))
        .expect("the gateway's line");
    line.rsplit(" gateway on ")
        .next()
        .unwrap()
        .trim()
        .to_owned()
}

/// The worker ids the gateway knows, from its `kvroute_worker_role` series.
fn gateway_workers(gateway: &str) -> Vec<u64> {
    let metrics = block_on(get_text(&format!("{gateway}/metrics")));
    let mut ids: Vec<u64> = metrics
        .lines()
        .filter(|l| l.starts_with("kvroute_worker_role{") && l.ends_with(" 1"))
        .filter_map(|l| {
            let rest = l.split("worker_id=\"").nth(1)?;
            rest.split('"').next()?.parse().ok()
        })
        .collect();
    ids.sort_unstable();
    ids.dedup();
    ids
}

/// The demo's Prometheus URL, from its "Prometheus on URL" line.
fn prometheus_url(lines: &[String]) -> String {
    lines
        .iter()
        .find_map(|l| l.strip_prefix("kvroute demo: Prometheus on "))
        .and_then(|rest| rest.split_whitespace().next())
        .expect(
            "the demo printed no Prometheus URL: is `prometheus` installed? (Debian: apt-get \
             install prometheus; .ci/run does)",
        )
        .to_owned()
}

/// The workers Prometheus scrapes, as (`pod`, `pool`) of its active engine targets.
fn scraped_workers(prometheus: &str) -> Vec<(String, String)> {
    let targets = get(&format!("{prometheus}/api/v1/targets?state=active"));
    let mut workers: Vec<(String, String)> = targets["data"]["activeTargets"]
        .as_array()
        .expect("Prometheus's targets")
        .iter()
        .filter(|t| t["labels"]["job"] == "kvroute-engine")
        .map(|t| {
            let label = |name: &str| t["labels"][name].as_str().unwrap_or("").to_owned();
            (label("pod"), label("pool"))
        })
        .collect();
    workers.sort();
    workers
}

/// Waits up to a minute for Prometheus to scrape exactly `expected` (its file-based discovery
/// follows the demo's target file).
fn wait_for_scraped(prometheus: &str, expected: &[(&str, &str)]) {
    let expected: Vec<(String, String)> = expected
        .iter()
        .map(|(pod, pool)| ((*pod).to_owned(), (*pool).to_owned()))
        .collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let scraped = scraped_workers(prometheus);
        if scraped == expected {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "Prometheus scrapes {scraped:?}, not {expected:?}"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// `demo --auto` with a cycle of short phases: the scenario grows both pools (new engines
/// start and register with the gateway), then shrinks them back (the newest workers drain
/// and leave the gateway), with no request failing on the way; `--prometheus` scrapes the
/// workers as they come and go, each labelled with its pool.
#[test]
fn auto_mode_grows_and_drains_the_pools() {
    let scenario = scenario_file(
        "grow",
        r#"
rate_rps = 0.25
initial = { prefill = 1, decode = 1 }
max = { prefill = 3, decode = 3 }
[[phase]]
name = "BASE"
duration_s = 200
mix = { A = 100 }
prefill = "initial"
decode = "initial"
[[phase]]
name = "GROW"
duration_s = 300
prefill = "+1"
decode = "+1"
[[phase]]
name = "BACK"
duration_s = 600
prefill = "initial"
decode = "initial"
"#,
    );
    let mut demo = Demo::start(&[
        "--prefill-workers",
        "1",
        "--decode-workers",
        "1",
        "--speedup",
        "20",
        "--no-baseline",
        "--scenario",
        scenario.to_str().unwrap(),
        "--auto",
        "--prometheus",
        "--prometheus-port",
        "0",
    ]);
    let gateway = gateway_url(&demo.lines);
    // BASE lasts 10 wall seconds: on a loaded machine 2 s (its earlier 40 simulated s) had
    // passed before this read and the pools had grown already.
    assert_eq!(gateway_workers(&gateway), [0, 1]);
    let prometheus = prometheus_url(&demo.lines);
    let status = get(&format!("{}/api/status", demo.url));
    assert_eq!(status["scenario"]["mode"], "auto", "{status}");
    assert_eq!(status["scenario"]["fleet"], "demo");
    assert_eq!(status["running"], true, "auto mode starts the workload");

    // GROW: worker-2 and worker-3 join, one per pool, and the gateway routes to them.
    demo.wait_for_status("the pools grow", |s| {
        let events = s["scenario"]["events"].as_array().unwrap();
        s["scenario"]["pools"] == serde_json::json!({"prefill": 2, "decode": 2})
            && ["prefill", "decode"].iter().all(|pool| {
                events.iter().any(|e| {
                    e["pool"] == *pool
                        && e["from"] == 1
                        && e["to"] == 2
                        && e["source"] == "scenario"
                        && e["phase"] == "GROW"
                        && e["applied"] == true
                })
            })
    });
    assert_eq!(gateway_workers(&gateway), [0, 1, 2, 3]);
    // Every worker scraped, each with its pool's label (GROW lasts 15 wall seconds: time for
    // Prometheus's discovery, which batches target updates over 5 s).
    demo.wait_for_status("Prometheus scrapes the new workers", |_| {
        let scraped = scraped_workers(&prometheus);
        let mut new_pools: Vec<&str> = scraped
            .iter()
            .filter(|(pod, _)| pod == "worker-2" || pod == "worker-3")
            .map(|(_, pool)| pool.as_str())
            .collect();
        new_pools.sort_unstable();
        scraped.len() == 4
            && scraped.contains(&("worker-0".to_owned(), "prefill".to_owned()))
            && scraped.contains(&("worker-1".to_owned(), "decode".to_owned()))
            && new_pools == ["decode", "prefill"]
    });
    // The GPU view follows the fleet.
    demo.wait_for_status("four worker cards", |s| {
        s["lanes"][0]["workers"]["list"].as_array().map(Vec::len) == Some(4)
    });

    // BACK: the newest leave by draining, and the gateway forgets them.
    demo.wait_for_status("the pools shrink", |s| {
        let events = s["scenario"]["events"].as_array().unwrap();
        ["prefill", "decode"].iter().all(|pool| {
            events.iter().any(|e| {
                e["pool"] == *pool && e["from"] == 2 && e["to"] == 1 && e["applied"] == true
            })
        })
    });
    let workers = gateway_workers(&gateway);
    assert!(
        !workers.contains(&2) && !workers.contains(&3),
        "the drained workers left the gateway: {workers:?}"
    );
    wait_for_scraped(
        &prometheus,
        &[("worker-0", "prefill"), ("worker-1", "decode")],
    );
    let status = get(&format!("{}/api/status", demo.url));
    let history = status["scenario"]["pool_history"].as_array().unwrap();
    assert!(history.len() >= 3, "{history:?}");
    let lane = &status["lanes"][0];
    assert!(
        lane["metrics"]["requests"].as_u64().unwrap() > 0,
        "{status}"
    );
    assert_eq!(
        lane["metrics"]["errors"], 0,
        "no request fails in a drain: {status}"
    );

    assert!(demo.interrupt().success());
    let mut rest = String::new();
    demo.stdout.read_to_string(&mut rest).unwrap();
    let everything = format!("{}\n{rest}", demo.lines.join("\n"));
    assert!(everything.contains("worker-2 joined the"), "{everything}");
    assert!(everything.contains("left the"), "{everything}");
    let _ = std::fs::remove_file(scenario);
}

/// Manual mode: the prefill pool's autoscaler (a tiny TTFT threshold, a 2 s polling
/// interval) sees TTFT p95 over its threshold in the gateway's metrics and adds prefill
/// workers, up to seed 004's max of 4.
#[test]
fn the_autoscaler_scales_a_pool_over_its_threshold() {
    let mut demo = Demo::start(&[
        "--prefill-workers",
        "1",
        "--decode-workers",
        "1",
        "--speedup",
        "20",
        "--no-baseline",
        "--start",
        "--rate",
        "0.25",
        "--autoscale-interval",
        "2",
        "--ttft-threshold",
        "0.0001",
    ]);
    let gateway = gateway_url(&demo.lines);
    demo.wait_for_status("the prefill pool grows", |s| {
        let scenario = &s["scenario"];
        assert_eq!(scenario["mode"], "manual");
        assert_eq!(scenario["autoscaler"]["prefill"]["paused"], false);
        scenario["pools"]["prefill"].as_u64().unwrap_or(0) >= 2
            && scenario["events"]
                .as_array()
                .unwrap()
                .iter()
                .any(|e| e["pool"] == "prefill" && e["source"] == "autoscaler")
    });
    let status = get(&format!("{}/api/status", demo.url));
    let scenario = &status["scenario"];
    let event = scenario["events"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["pool"] == "prefill" && e["source"] == "autoscaler")
        .unwrap_or_else(|| panic!("{scenario}"));
    assert_eq!(event["applied"], true, "{event}");
    assert!(
        event["reason"]
            .as_str()
            .unwrap()
            .starts_with("above_threshold"),
        "{event}"
    );
    assert!(
        scenario["autoscaler"]["prefill"]["value"].as_f64().unwrap() > 0.0001,
        "{scenario}"
    );
    assert!(gateway_workers(&gateway).len() >= 3);
    // Auto mode pauses it.
    let code = post(&format!("{}/api/scenario/auto", demo.url));
    assert_eq!(code, 200);
    let status = get(&format!("{}/api/status", demo.url));
    assert_eq!(status["scenario"]["autoscaler"]["prefill"]["paused"], true);
    assert!(demo.interrupt().success());
}

/// A --scenario file that does not parse or check fails before anything starts, saying what
/// is wrong and where.
#[test]
fn a_bad_scenario_file_fails_before_anything_starts() {
    let scenario = scenario_file(
        "bad",
        r#"
rate_rps = 1.0
initial = { prefill = 1, decode = 1 }
max = { prefill = 2, decode = 2 }
[[phase]]
name = "ODD"
duration_s = 10
mix = { A = 40, B = 30 }
"#,
    );
    let path = scenario.to_str().unwrap();
    let stderr = failure(&[
        "demo",
        "--port",
        "0",
        "--gateway-port",
        "0",
        "--scenario",
        path,
    ]);
    assert!(
        stderr.contains(&format!("--scenario {path}: phase.mix"))
            && stderr.contains("must add up to 100"),
        "{stderr}"
    );
    assert_eq!(stderr.matches("error").count(), 1, "printed once: {stderr}");
    assert!(!stderr.contains("simulated"), "{stderr}");
    let _ = std::fs::remove_file(scenario);
}

/// The sum of `series` over the workers' `/metrics` (`None` when a worker does not export it).
fn worker_counter(metrics_urls: &[String], series: &str) -> Option<f64> {
    let mut total = 0.0;
    for url in metrics_urls {
        let text = block_on(get_text(url));
        total += text
            .lines()
            .filter(|l| l.starts_with(series) && l[series.len()..].starts_with(['{', ' ']))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .reduce(|a, b| a + b)?;
    }
    Some(total)
}

/// The running workers' metrics URLs from the status's ladder.
fn ladder_workers(status: &Value) -> Vec<String> {
    status["ladder"]["workers"]
        .as_array()
        .expect("the ladder's workers")
        .iter()
        .map(|w| w["metrics_url"].as_str().unwrap().to_owned())
        .collect()
}

/// Seed 003's ladder stepped live, as a presenter does from the dashboard: the demo starts at
/// phase kv (no speculative counters), `POST /api/phase {"phase": "eagle3"}` restarts the
/// workers with EAGLE-3 (their `vllm:spec_decode_*` counters appear and grow) behind the same
/// gateway URL, the workload resumes by itself with a fresh window and no failed turn, and the
/// status reports the phase; then baseline puts round-robin in. Bad bodies get a 400 naming
/// the field.
#[test]
fn switching_phase_live_restarts_the_workers_and_keeps_the_dashboard() {
    let mut demo = Demo::start(&[
        "--workers",
        "2",
        "--speedup",
        "50",
        "--concurrency",
        "4",
        "--start",
        "--no-baseline",
        "--phase",
        "kv",
    ]);
    let addr = demo.url.trim_start_matches("http://").to_owned();
    let gateway = gateway_url(&demo.lines);
    let status = get(&format!("{}/api/status", demo.url));
    let ladder = &status["ladder"];
    assert_eq!(ladder["phase"], "kv", "{status}");
    assert_eq!(ladder["router"], "kv_load");
    assert_eq!(ladder["spec_decode"], "off");
    let names: Vec<&str> = ladder["phases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["baseline", "kv", "draft", "eagle3"]);
    let kv_workers = ladder_workers(&status);
    assert_eq!(kv_workers.len(), 2);
    assert_eq!(
        worker_counter(&kv_workers, "vllm:spec_decode_num_drafts_total"),
        None,
        "no speculative decoding at phase kv"
    );
    demo.wait_for_status("turns at phase kv", |s| {
        s["lanes"][0]["metrics"]["requests"].as_u64() > Some(2)
    });

    // Bad values: 400 naming the field, and nothing restarts.
    for (body, code) in [
        (json!({"phase": "medusa"}), "invalid_phase"),
        (json!({"phase": 3}), "invalid_phase"),
        (json!({"phase": null}), "invalid_phase"),
        (json!({}), "missing_field"),
        (json!({"phaze": "kv"}), "invalid_json"),
        (json!(["eagle3"]), "invalid_json"),
    ] {
        let (status, answer) = post_json(&addr, "/api/phase", &body);
        assert_eq!(status, 400, "{body}: {answer}");
        assert_eq!(answer["error"]["code"], code, "{body}: {answer}");
        if code == "invalid_phase" {
            assert_eq!(answer["error"]["param"], "phase", "{answer}");
            let message = answer["error"]["message"].as_str().unwrap();
            assert!(message.contains("baseline, kv, draft, eagle3"), "{message}");
        }
    }
    let (status, _) = common::http(&addr, "POST", "/api/phase", "{\"phase\": ");
    assert_eq!(status, 400);
    assert_eq!(
        ladder_workers(&get(&format!("{}/api/status", demo.url))),
        kv_workers,
        "a refused switch restarted the workers"
    );

    // The switch: answered once the new phase runs.
    let (code, status) = post_json(&addr, "/api/phase", &json!({"phase": "eagle3"}));
    assert_eq!(code, 200, "{status}");
    let ladder = &status["ladder"];
    assert_eq!(ladder["phase"], "eagle3", "{status}");
    assert_eq!(ladder["spec_decode"], "eagle3");
    assert_eq!(ladder["router"], "kv_load");
    assert_eq!(ladder["switching"], Value::Null);
    assert_eq!(ladder["switches"][0]["phase"], "eagle3");
    assert_eq!(status["running"], true, "the workload resumes by itself");
    // Fresh window: nothing of phase kv is counted any more.
    assert_eq!(status["lanes"][0]["metrics"]["requests"], 0, "{status}");
    let eagle_workers = ladder_workers(&status);
    assert_eq!(eagle_workers.len(), 2);
    assert_ne!(eagle_workers, kv_workers, "new engines");
    // The old engines are gone.
    for url in &kv_workers {
        let gone = block_on(async { reqwest::get(url).await.is_err() });
        assert!(gone, "{url} still answers");
    }
    let (stdout, lines) = (&mut demo.stdout, &mut demo.lines);
    lines.extend(lines_until(stdout, "kvroute demo: phase eagle3"));
    assert!(
        lines
            .last()
            .unwrap()
            .contains(&format!("gateway on {gateway}")),
        "the gateway keeps its URL: {lines:?}"
    );

    // The new workers' speculative counters grow as the workload goes on.
    let drafts = |urls: &[String]| {
        worker_counter(urls, "vllm:spec_decode_num_drafts_total")
            .expect("EAGLE-3 workers export vllm:spec_decode_num_drafts_total")
    };
    let first = drafts(&eagle_workers);
    let deadline = Instant::now() + Duration::from_secs(60);
    while drafts(&eagle_workers) <= first {
        assert!(Instant::now() < deadline, "the draft counter does not grow");
        std::thread::sleep(Duration::from_millis(200));
    }
    let accepted = worker_counter(&eagle_workers, "vllm:spec_decode_num_accepted_tokens_total");
    assert!(accepted.is_some_and(|a| a > 0.0), "{accepted:?}");
    demo.wait_for_status("acceptance at phase eagle3", |s| {
        let m = &s["lanes"][0]["metrics"];
        m["acceptance_rate"]
            .as_f64()
            .is_some_and(|a| (0.5..1.0).contains(&a))
            && m["requests"].as_u64() > Some(2)
    });
    let status = get(&format!("{}/api/status", demo.url));
    // The cancelled turns of phase kv are not failures, and the target kept its URL.
    assert_eq!(status["lanes"][0]["metrics"]["errors"], 0, "{status}");
    assert_eq!(status["lanes"][0]["target"], gateway.as_str());

    // Down the ladder: round-robin, no speculative decoding.
    let (code, status) = post_json(&addr, "/api/phase", &json!({"phase": "baseline"}));
    assert_eq!(code, 200, "{status}");
    assert_eq!(status["ladder"]["router"], "round_robin");
    assert_eq!(status["lanes"][0]["router"], "round_robin");
    assert_eq!(status["ladder"]["switches"].as_array().unwrap().len(), 2);
    assert_eq!(
        worker_counter(
            &ladder_workers(&status),
            "vllm:spec_decode_num_drafts_total"
        ),
        None
    );
    demo.wait_for_status("turns at phase baseline", |s| {
        s["lanes"][0]["metrics"]["requests"].as_u64() > Some(2)
    });
    assert!(demo.interrupt().success());
}

/// The engine targets Prometheus scrapes, as their scrape URLs (sorted).
fn scraped_urls(prometheus: &str) -> Vec<String> {
    let targets = get(&format!("{prometheus}/api/v1/targets?state=active"));
    let mut urls: Vec<String> = targets["data"]["activeTargets"]
        .as_array()
        .expect("Prometheus's targets")
        .iter()
        .filter(|t| t["labels"]["job"] == "kvroute-engine")
        .filter_map(|t| t["scrapeUrl"].as_str().map(str::to_owned))
        .collect();
    urls.sort();
    urls
}

/// With `--prometheus`, a phase switch moves Prometheus's engine targets to the new workers,
/// and the dashboard's speculative cards, read through PromQL, fill at phase eagle3.
#[test]
fn a_phase_switch_moves_prometheus_to_the_new_workers() {
    let mut demo = Demo::start(&[
        "--workers",
        "1",
        "--speedup",
        "50",
        "--concurrency",
        "4",
        "--start",
        "--no-baseline",
        "--phase",
        "kv",
        "--prometheus",
        "--prometheus-port",
        "0",
    ]);
    let prometheus = prometheus_url(&demo.lines);
    let addr = demo.url.trim_start_matches("http://").to_owned();
    let wait_for_targets = |expected: &[String]| {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let scraped = scraped_urls(&prometheus);
            if scraped == expected {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "Prometheus scrapes {scraped:?}, not {expected:?}"
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    };
    let kv_workers = ladder_workers(&get(&format!("{}/api/status", demo.url)));
    wait_for_targets(&kv_workers);

    let (code, status) = post_json(&addr, "/api/phase", &json!({"phase": "eagle3"}));
    assert_eq!(code, 200, "{status}");
    let eagle_workers = ladder_workers(&status);
    assert_ne!(eagle_workers, kv_workers);
    wait_for_targets(&eagle_workers);
    demo.wait_for_status("acceptance through Prometheus", |s| {
        let m = &s["lanes"][0]["metrics"];
        m["acceptance_rate"]
            .as_f64()
            .is_some_and(|a| (0.5..1.0).contains(&a))
            && m["tokens_per_step"].as_f64().is_some_and(|t| t > 1.5)
    });
    assert!(demo.interrupt().success());
}
