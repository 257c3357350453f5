//! `kvroute sim --timeline DIR` as a user runs it: both files, every worker at every sample,
//! the same bytes on a second run, and a clear error for a bad interval.

use std::path::PathBuf;
use std::process::{Command, Output};

fn kvroute() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvroute"))
}

/// A fresh, empty directory for one test's output.
fn out_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "kvroute-timeline-cli-{}-{name}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn ok(out: Output) -> Output {
    assert!(
        out.status.success(),
        "status {}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// 4 workers, 40 simulated seconds sampled every 2 s: 20 samples.
fn sim_with_timeline(dir: &PathBuf) -> Output {
    kvroute()
        .args([
            "sim",
            "--router",
            "kv",
            "--workers",
            "4",
            "--concurrency",
            "24",
            "--duration",
            "40",
            "--warmup",
            "10",
            "--timeline-interval",
            "2",
            "--timeline",
        ])
        .arg(dir)
        .output()
        .unwrap()
}

#[test]
fn sim_timeline_writes_a_row_per_worker_per_sample_and_a_chart() {
    let (a, b) = (out_dir("a"), out_dir("b"));
    ok(sim_with_timeline(&a));
    ok(sim_with_timeline(&b));
    let csv = std::fs::read_to_string(a.join("timeline.csv")).unwrap();
    assert_eq!(
        csv,
        std::fs::read_to_string(b.join("timeline.csv")).unwrap(),
        "same seed, same timeline"
    );

    let mut lines = csv.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    assert_eq!(
        &header[..5],
        ["time_s", "worker", "in_flight", "running", "waiting"]
    );
    let col = |name: &str| header.iter().position(|h| *h == name).unwrap();
    let rows: Vec<Vec<&str>> = lines.map(|l| l.split(',').collect()).collect();
    assert_eq!(rows.len(), 20 * 4, "20 samples × 4 workers");
    for (i, row) in rows.iter().enumerate() {
        assert_eq!(row.len(), header.len(), "row {i}: {row:?}");
        let time: f64 = row[col("time_s")].parse().unwrap();
        assert_eq!(time, 2.0 * (i / 4 + 1) as f64, "row {i}");
        assert_eq!(row[col("worker")], (i % 4).to_string(), "row {i}");
        let n = |name: &str| row[col(name)].parse::<u32>().unwrap();
        assert_eq!(
            n("in_flight"),
            n("running") + n("waiting"),
            "row {i}: {row:?}"
        );
    }
    // Requests were in flight, and first tokens came with a TTFT.
    assert!(rows.iter().any(|r| r[col("in_flight")] != "0"));
    assert!(rows.iter().any(|r| !r[col("ttft_max_ms")].is_empty()));

    let svg = std::fs::read_to_string(a.join("timeline.svg")).unwrap();
    let doc = roxmltree::Document::parse(&svg).expect("timeline.svg is well-formed XML");
    let text: String = doc
        .descendants()
        .filter(|n| n.is_text())
        .filter_map(|n| n.text())
        .collect::<Vec<_>>()
        .join("\n");
    for needle in [
        "kv, 4 workers, 24 conversations",
        "max_num_seqs 64",
        "SLO 600 ms",
        "waiting in each engine",
        "largest TTFT per worker per 2 s",
        "worker 3",
    ] {
        assert!(text.contains(needle), "{needle} missing from the chart");
    }
    let _ = std::fs::remove_dir_all(&a);
    let _ = std::fs::remove_dir_all(&b);
}

#[test]
fn a_zero_timeline_interval_is_refused_before_the_run() {
    let dir = out_dir("zero");
    let out = kvroute()
        .args(["sim", "--duration", "20", "--warmup", "5"])
        .args(["--timeline-interval", "0", "--timeline"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(
        stderr.contains("interval must be longer than zero"),
        "{stderr}"
    );
    assert!(!dir.join("timeline.csv").exists());
    let _ = std::fs::remove_dir_all(&dir);
}
