//! `kvroute bench --suite robustness` as a user runs it, on a small grid (one family, one
//! fleet, one profile, three routers, short windows): results.json's rows carry `cell` and
//! `goodput_rps`, report.md has the family's table with a verdict, the same command writes
//! the same bytes, and bad grid flags fail with a clear error.

use std::path::{Path, PathBuf};
use std::process::Output;

mod common;

use common::{assert_failures, kvroute, ok};

fn out_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "kvroute-robustness-cli-{}-{name}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// The chat family on 3 workers of the mocker profile, 4 conversations per worker.
fn small_grid(dir: &Path) -> Output {
    kvroute()
        .args([
            "bench",
            "--suite",
            "robustness",
            "--families",
            "chat",
            "--fleets",
            "3",
            "--profiles",
            "dynamo-mocker",
            "--routers",
            "round_robin,kv,kv_load",
            "--levels",
            "4",
            "--warmup",
            "10",
            "--window",
            "30",
            "--lookback",
            "30",
            "--snapshots",
            "1",
            "--jobs",
            "2",
            "--out",
        ])
        .arg(dir)
        .output()
        .unwrap()
}

#[test]
fn a_small_grid_writes_cells_goodput_and_a_verdict_byte_identically() {
    let (a, b) = (out_dir("a"), out_dir("b"));
    let out = ok(small_grid(&a));
    ok(small_grid(&b));
    for file in ["results.json", "report.md"] {
        assert!(
            std::fs::read(a.join(file)).unwrap() == std::fs::read(b.join(file)).unwrap(),
            "{file} differs between two runs of the same command"
        );
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("chat/3w/dynamo-mocker") && stdout.contains("kv_load: wins"),
        "{stdout}"
    );

    let results: serde_json::Value =
        serde_json::from_slice(&std::fs::read(a.join("results.json")).unwrap()).unwrap();
    let summary = results["summary"].as_array().unwrap();
    assert_eq!(summary.len(), 3, "one row per router at the one level");
    for row in summary {
        assert_eq!(row["cell"], "chat/3w/dynamo-mocker");
        assert_eq!(row["concurrency"], 12, "4 per worker on 3 workers");
        // Today's row fields are kept.
        for field in [
            "router",
            "workers",
            "ttft_ms",
            "output_tokens_per_s",
            "kv_hit_rate",
        ] {
            assert!(!row[field].is_null(), "{field} missing from {row}");
        }
        let goodput = row["goodput_rps"].as_f64().unwrap();
        assert_eq!(Some(goodput), row["serving"]["goodput_rps"].as_f64());
        assert!(goodput > 0.0, "a light load meets the SLOs: {row}");
    }
    let meta = &results["bench"]["robustness"];
    assert_eq!(meta["default_router"], "kv_load");
    assert_eq!(meta["cells"][0]["name"], "chat/3w/dynamo-mocker");
    assert!(
        meta["cells"][0]["goodput_ceiling"].is_null(),
        "a closed-loop chat has no ceiling of its own"
    );

    let report = std::fs::read_to_string(a.join("report.md")).unwrap();
    assert!(report.contains("## chat"), "{report}");
    assert!(report.contains("| verdict |"), "{report}");
    let ours = report
        .lines()
        .find(|l| l.contains("**kv_load**"))
        .expect("the default policy's row");
    assert!(ours.contains('✓') || ours.contains('✗'), "{ours}");
    // The other routers are judged by the same verdict, each out of the one cell-level.
    let others = report
        .lines()
        .find(|l| l.starts_with("Every other router by the same verdict"))
        .expect("the other routers' tally");
    for router in ["round_robin", "kv"] {
        assert!(
            others.contains(&format!("`{router}` 0")) || others.contains(&format!("`{router}` 1")),
            "{router} in {others}"
        );
    }
    assert!(!others.contains("`kv_load`"), "{others}");
    assert!(
        stdout.contains("by the same verdict: round_robin "),
        "{stdout}"
    );
}

#[test]
fn bad_grid_flags_fail_with_a_clear_error() {
    assert_failures(&[
        (
            &[
                "bench",
                "--suite",
                "robustness",
                "--families",
                "chat,trace9",
            ],
            "the grid's families are chat, lockstep, think, trace, groups",
        ),
        (
            &["bench", "--suite", "robustness", "--fleets", "0"],
            "at least 1 worker",
        ),
        (
            &["bench", "--suite", "robustness", "--profiles", "tpu-v9"],
            "tpu-v9",
        ),
        (&["bench", "--families", "chat"], "--suite"),
        (
            &["bench", "--suite", "robustness", "--disagg"],
            "cannot be used with",
        ),
    ]);
}

/// The trace family replays the shipped Mooncake trace at 1×, 2× and 4×: one level each (the
/// trace sets the load), each run measured whole, rows for every router, requests served, and
/// no goodput above the cell's ceiling. `--snapshots` does not cut the replay into snapshots,
/// and the command says so.
#[test]
fn the_trace_family_replays_the_shipped_trace_at_three_speeds() {
    let dir = out_dir("trace");
    let out = ok(kvroute()
        .args([
            "bench",
            "--suite",
            "robustness",
            "--families",
            "trace",
            "--fleets",
            "3",
            "--profiles",
            "dynamo-mocker",
            "--routers",
            "round_robin,kv_load",
            "--snapshots",
            "2",
            "--out",
        ])
        .arg(&dir)
        .output()
        .unwrap());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        stderr
            .matches("the trace cells are measured whole, as one window")
            .count(),
        1,
        "{stderr}"
    );
    let results: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("results.json")).unwrap()).unwrap();
    let summary = results["summary"].as_array().unwrap();
    assert_eq!(summary.len(), 6, "3 speeds × 2 routers");
    for speed in ["1", "2", "4"] {
        let cell = format!("trace-{speed}x/3w/dynamo-mocker");
        let rows: Vec<_> = summary.iter().filter(|r| r["cell"] == cell).collect();
        assert_eq!(rows.len(), 2, "{cell}");
        // The goodput ceiling: what each request gets alone on a warm worker.
        let meta = results["bench"]["robustness"]["cells"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == cell)
            .unwrap_or_else(|| panic!("{cell} in the cells' meta"));
        let ceiling = &meta["goodput_ceiling"];
        let within = ceiling["within"].as_u64().unwrap();
        assert_eq!(ceiling["requests"], 2000, "{ceiling}");
        assert!(within > 0 && within < 2000, "{ceiling}");
        let ceiling_rps = ceiling["rps"].as_f64().unwrap();
        for row in rows {
            let requests = row["requests"].as_f64().unwrap();
            if speed == "1" {
                // Measured whole (not a minute's snapshot): 3 workers keep up at 1×.
                assert_eq!(requests, 2000.0, "{row}");
            }
            assert!(requests > 0.0, "{row}");
            let hit = row["kv_hit_rate"].as_f64().unwrap();
            let oracle = row["oracle_hit_rate"].as_f64().unwrap();
            assert!(
                hit <= oracle + 1e-9,
                "{cell}: hit {hit} above the oracle {oracle}"
            );
            let goodput = row["goodput_rps"].as_f64().unwrap();
            assert!(
                goodput <= ceiling_rps + 1e-9,
                "{cell}: goodput {goodput} above its ceiling {ceiling}"
            );
        }
    }
    let report = std::fs::read_to_string(dir.join("report.md")).unwrap();
    assert!(
        report.contains("## trace") && report.contains("Mooncake"),
        "{report}"
    );
    assert!(
        report.contains("| trace-1x/3w/dynamo-mocker | 1757 of 2000 |"),
        "the ceilings' table: {report}"
    );
}
