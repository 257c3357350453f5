//! `kvroute demo` and `kvroute loadgen` as a presenter runs them: one command starts the
//! cluster, the gateway, the load generator and the dashboard, prints the URL, serves the API,
//! and stops cleanly on Ctrl-C (SIGINT); bad arguments fail with a clear error.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, ChildStdout, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

mod common;

use common::{Running, kvroute};

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

fn block_on<T>(work: impl Future<Output = T>) -> T {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(work)
}

fn get(url: &str) -> Value {
    block_on(async { reqwest::get(url).await.unwrap().json().await.unwrap() })
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

fn sigint(child: &Child) {
    // SAFETY: kill(2) on our own child's pid.
    let rc = unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGINT) };
    assert_eq!(rc, 0);
}

fn wait_exit(running: &mut Running, timeout: Duration) -> std::process::ExitStatus {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = running.0.try_wait().unwrap() {
            return status;
        }
        assert!(
            Instant::now() < deadline,
            "the demo did not stop within {timeout:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn demo_runs_the_whole_system_and_stops_on_ctrl_c() {
    let child = kvroute()
        .args([
            "demo",
            "--port",
            "0",
            "--gateway-port",
            "0",
            "--workers",
            "2",
        ])
        .args(["--speedup", "50", "--concurrency", "3", "--start"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut running = Running(child);
    let mut stdout = BufReader::new(running.0.stdout.take().unwrap());
    let lines = lines_until(&mut stdout, "kvroute demo: open ");
    // The recorded comparison is simulated for this very cluster at start-up.
    assert!(
        lines[0].contains("simulated the recorded comparison (round_robin vs kv_load)"),
        "{lines:?}"
    );
    assert!(lines[1].contains("2 simulated h200-llama70b-fp8 workers behind the kv_load gateway"));
    let url = dashboard_url(&lines);

    let baseline = get(&format!("{url}/api/baseline"));
    assert!(
        baseline["source"].as_str().unwrap().contains("--workers 2"),
        "{baseline}"
    );
    assert_eq!(baseline["kv_router"], "kv_load");
    assert_eq!(baseline["levels"].as_array().unwrap().len(), 7);

    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let status = get(&format!("{url}/api/status"));
        let lane = &status["lanes"][0];
        assert_eq!(status["running"], true);
        assert_eq!(lane["router"], "kv_load");
        if lane["metrics"]["requests"].as_u64().unwrap() >= 3
            && lane["workers"]["list"].as_array().unwrap().len() == 2
        {
            assert_eq!(lane["metrics"]["errors"], 0);
            break;
        }
        assert!(Instant::now() < deadline, "no finished turns: {status}");
        std::thread::sleep(Duration::from_millis(200));
    }
    // The page is served from the binary.
    let page = block_on(async {
        reqwest::get(format!("{url}/"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    });
    assert!(page.contains("<script type=\"module\""), "{page}");

    sigint(&running.0);
    let status = wait_exit(&mut running, Duration::from_secs(20));
    assert!(status.success(), "{status:?}");
    let mut rest = String::new();
    stdout.read_to_string(&mut rest).unwrap();
    assert!(rest.contains("kvroute demo: stopped"), "{rest}");
}

#[test]
fn compare_mode_runs_two_clusters_on_the_same_conversations() {
    let child = kvroute()
        .args([
            "demo",
            "--port",
            "0",
            "--gateway-port",
            "0",
            "--workers",
            "1",
        ])
        .args(["--speedup", "50", "--concurrency", "2", "--no-baseline"])
        .args(["--compare", "round_robin,kv"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut running = Running(child);
    let mut stdout = BufReader::new(running.0.stdout.take().unwrap());
    let lines = lines_until(&mut stdout, "kvroute demo: open ");
    let url = dashboard_url(&lines);
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
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let status = get(&format!("{url}/api/status"));
        let done = |i: usize| status["lanes"][i]["metrics"]["requests"].as_u64().unwrap();
        if done(0) >= 2 && done(1) >= 2 {
            break;
        }
        assert!(Instant::now() < deadline, "both lanes progress: {status}");
        std::thread::sleep(Duration::from_millis(200));
    }
    sigint(&running.0);
    assert!(wait_exit(&mut running, Duration::from_secs(20)).success());
}

#[test]
fn bad_arguments_fail_with_a_clear_error() {
    for (args, expected) in [
        (
            vec!["demo", "--compare", "kv,kv"],
            "--compare takes two different routers",
        ),
        (
            vec!["demo", "--workers", "0"],
            "--workers must be between 1 and 64",
        ),
        (vec!["demo", "--router", "best"], "router \"best\""),
        (
            vec!["demo", "--phase", "medusa"],
            "the ladder's phases are baseline, kv, draft, eagle3",
        ),
        (
            vec![
                "demo",
                "--profile",
                "h100-llama8b",
                "--spec-decode",
                "eagle3",
            ],
            "has no speculative-decoding configurations",
        ),
        (
            vec!["demo", "--phase-reference", "/nonexistent-phases.json"],
            "reading /nonexistent-phases.json",
        ),
        (vec!["demo", "--think-time=-1"], "--think-time must be"),
        (
            vec!["loadgen", "--target", "localhost:8000"],
            "--target must be an http:// or https:// URL",
        ),
        (
            vec![
                "loadgen",
                "--target",
                "http://x",
                "--baseline",
                "/nonexistent.json",
            ],
            "reading /nonexistent.json",
        ),
    ] {
        let output = kvroute().args(&args).output().unwrap();
        assert!(!output.status.success(), "{args:?} should fail");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
    }
}

/// `demo --phase eagle3`: KV-aware routing and EAGLE-3 workers; the dashboard's status
/// carries the workers' acceptance and tokens per step, and the shipped ladder's reference
/// lines for this cluster (3 × H200).
#[test]
fn demo_starts_at_a_phase_with_speculative_workers_and_reference_lines() {
    let child = kvroute()
        .args([
            "demo",
            "--port",
            "0",
            "--gateway-port",
            "0",
            "--workers",
            "3",
        ])
        .args([
            "--speedup",
            "50",
            "--concurrency",
            "4",
            "--start",
            "--no-baseline",
        ])
        .args(["--phase", "eagle3"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut running = Running(child);
    let mut stdout = BufReader::new(running.0.stdout.take().unwrap());
    let lines = lines_until(&mut stdout, "kvroute demo: open ");
    assert!(
        lines
            .iter()
            .any(|l| l.contains("(speculative decoding: eagle3) behind the kv_load gateway")),
        "{lines:?}"
    );
    let url = dashboard_url(&lines);
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let status = get(&format!("{url}/api/status"));
        assert_eq!(status["references"]["setup"], "h200x3", "{status}");
        let m = &status["lanes"][0]["metrics"];
        if let (Some(a), Some(t)) = (m["acceptance_rate"].as_f64(), m["tokens_per_step"].as_f64()) {
            assert!((0.5..1.0).contains(&a) && (1.5..6.0).contains(&t), "{m}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no acceptance reported: {status}"
        );
        std::thread::sleep(Duration::from_millis(300));
    }
    sigint(&running.0);
    assert!(wait_exit(&mut running, Duration::from_secs(20)).success());
}
