//! `kvroute sim --scenario` as a user runs it: a short cycle writes report.md, results.json
//! and timeline.svg, the same bytes on a second run; manual mode's autoscaler resizes the
//! pools; bad files and flags get one clear error naming what is wrong.

use std::path::{Path, PathBuf};

mod common;

use common::{assert_failures, kvroute, ok};

fn temp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "kvroute-scenario-cli-{}-{name}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A 70-second cycle: B-heavy load, a prefill and a decode worker join, back to 1:1.
const SHORT: &str = r#"
rate_rps = 0.6
initial = { prefill = 1, decode = 1 }
max = { prefill = 3, decode = 3 }

[[phase]]
name = "STRESS"
duration_s = 30
mix = { B = 80, C = 20 }

[[phase]]
name = "RECOVERY"
duration_s = 25
prefill = "+1"
decode = "+1"

[[phase]]
name = "RESET"
duration_s = 15
prefill = "initial"
decode = "initial"
"#;

fn write(dir: &Path, name: &str, text: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path.to_string_lossy().into_owned()
}

fn run(args: &[&str]) -> String {
    let out = ok(kvroute().args(args).output().unwrap());
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn a_short_cycle_writes_its_report_and_is_byte_identical_on_a_second_run() {
    let dir = temp("good");
    let file = write(&dir, "short.toml", SHORT);
    let (a, b) = (dir.join("a"), dir.join("b"));
    let base = ["sim", "--scenario", &file, "--sizing-steps", "0", "--out"];
    let stdout = run(&[&base[..], &[a.to_str().unwrap()]].concat());
    run(&[&base[..], &[b.to_str().unwrap()]].concat());
    for name in ["results.json", "report.md", "timeline.svg"] {
        let (x, y) = (
            std::fs::read(a.join(name)).unwrap(),
            std::fs::read(b.join(name)).unwrap(),
        );
        assert!(!x.is_empty() && x == y, "{name} differs between runs");
    }
    let report = std::fs::read_to_string(a.join("report.md")).unwrap();
    assert_eq!(stdout, report, "stdout is the report");
    assert!(
        report.contains("# Scenario `short` in virtual time"),
        "{report}"
    );
    assert!(report.contains("Layout `seed004-dev`"), "{report}");
    for phase in ["| 0 | STRESS |", "| 0 | RECOVERY |", "| 0 | RESET |"] {
        assert!(report.contains(phase), "{phase}: {report}");
    }
    assert!(
        report.contains("| 30 | RECOVERY | prefill | 1 | 2 | scenario |"),
        "{report}"
    );
    assert!(
        report.contains("| 55 | RESET | decode | 2 | 1 | scenario |"),
        "{report}"
    );
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(a.join("results.json")).unwrap()).unwrap();
    assert_eq!(json["meta"]["mode"], "auto");
    let t = &json["totals"];
    let n = |k: &str| t[k].as_u64().unwrap();
    assert_eq!(
        n("issued"),
        n("finished") + n("failed") + n("in_flight_at_end")
    );
    // One sample every 5 s, from 0 to 70.
    let samples = json["samples"].as_array().unwrap();
    assert_eq!(samples.len(), 15);
    // Both workers the reset removed have left, or are still finishing their requests.
    let last = &samples[14];
    let draining =
        last["prefill_draining"].as_u64().unwrap() + last["decode_draining"].as_u64().unwrap();
    assert_eq!(n("workers_retired") + draining, 2);
    assert_eq!(
        (last["prefill"].as_u64(), last["decode"].as_u64()),
        (Some(1), Some(1))
    );
    let svg = std::fs::read_to_string(a.join("timeline.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("RECOVERY"));
}

#[test]
fn manual_mode_scales_on_the_autoscaler_not_the_scenario() {
    let dir = temp("manual");
    let file = write(&dir, "short.toml", SHORT);
    let out = run(&[
        "sim",
        "--scenario",
        &file,
        "--sizing-steps",
        "0",
        "--autoscale",
        "--ttft-threshold",
        "0.05",
        "--polling-interval",
        "10",
        "--json",
    ]);
    let json: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(json["meta"]["mode"], "autoscale");
    assert_eq!(json["meta"]["polling_interval_s"], 10.0);
    let events = json["events"].as_array().unwrap();
    assert!(!events.is_empty(), "{out}");
    for e in events {
        assert!(
            e["cause"].as_str().unwrap().starts_with("autoscaler"),
            "{e}"
        );
        assert_eq!(e["t_s"].as_f64().unwrap() % 10.0, 0.0, "{e}");
    }
    assert_eq!(events[0]["pool"], "prefill");
}

#[test]
fn bad_scenarios_and_flags_get_one_clear_error() {
    let dir = temp("bad");
    let edit = |name: &str, from: &str, to: &str| {
        assert!(SHORT.contains(from), "{from}");
        write(&dir, name, &SHORT.replacen(from, to, 1))
    };
    let garbage = write(&dir, "garbage.toml", "rate_rps = [\n");
    let mix = edit("mix.toml", "{ B = 80, C = 20 }", "{ B = 80, C = 30 }");
    let rate = edit("rate.toml", "rate_rps = 0.6", "rate_rps = -2");
    let unknown = edit(
        "loop.toml",
        "max = { prefill = 3, decode = 3 }",
        "max = { prefill = 3, decode = 3 }\nloop_to = \"LUNCH\"",
    );
    let field = edit("field.toml", "duration_s = 30", "duration = 30");
    let missing = dir.join("missing.toml");
    let missing = missing.to_str().unwrap();
    assert_failures(&[
        (&["sim", "--scenario", missing], "--scenario: cannot read"),
        (&["sim", "--scenario", &garbage], "scenario file:"),
        (
            &["sim", "--scenario", &mix],
            "phase.mix: the mix of phase STRESS must add up to 100, got 110",
        ),
        (&["sim", "--scenario", &rate], "rate_rps: must be between 0"),
        (
            &["sim", "--scenario", &unknown],
            "loop_to: unknown phase `LUNCH` (phases: STRESS, RECOVERY, RESET)",
        ),
        (&["sim", "--scenario", &field], "unknown field `duration`"),
        (
            &["sim", "--scenario", "seed004", "--cycles", "0"],
            "--cycles",
        ),
        (
            &["sim", "--scenario", "seed004", "--cycles", "101"],
            "--cycles",
        ),
        (&["sim", "--autoscale"], "--scenario"),
        (&["sim", "--cycles", "2"], "--scenario"),
        (
            &["sim", "--scenario", "seed004", "--ttft-threshold=-1"],
            "--ttft-threshold must be a number of seconds > 0, got -1",
        ),
        (
            &["sim", "--scenario", "seed004", "--polling-interval", "0"],
            "--polling-interval must be a number of seconds > 0",
        ),
        (
            &["sim", "--scenario", "seed004", "--rate", "2"],
            "--scenario sets the mix and the rate itself",
        ),
        (
            &["sim", "--scenario", "seed004", "--layout", "nope"],
            "--layout: unknown layout",
        ),
        (
            &[
                "sim",
                "--scenario",
                "seed004",
                "--prefill-workers",
                "2000",
                "--decode-workers",
                "1",
            ],
            "--prefill-workers/--decode-workers: initial.prefill: must be at most 1024, got 2000",
        ),
    ]);
    // Printed once: the message is not repeated by an error chain.
    let stderr = common::failure(&["sim", "--scenario", &mix]);
    assert_eq!(stderr.matches("must add up to 100").count(), 1, "{stderr}");
}
