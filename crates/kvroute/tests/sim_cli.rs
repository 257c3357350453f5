//! `kvroute sim` and `kvroute bench` as a user runs them: determinism of results.json, the
//! JSON contract, the report and plots, `sim --timeline` (both files, every worker at every
//! sample, the same bytes on a second run), and clear errors.

use std::path::{Path, PathBuf};
use std::process::Output;

mod common;

use common::{assert_failures, failure, kvroute, ok};

/// A fresh, empty directory for one test's output.
fn out_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvroute-sim-cli-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// A small bench: two levels, one sweep, short windows. Seconds of simulated time, not of
/// wall time.
fn small_bench(dir: &Path, jobs: &str) -> Output {
    kvroute()
        .args([
            "bench",
            "--levels",
            "12,24",
            "--sweeps",
            "2",
            "--warmup",
            "20",
            "--window",
            "60",
            "--snapshots",
            "3",
            "--lookback",
            "20",
            "--seed",
            "5",
            "--jobs",
            jobs,
            "--out",
        ])
        .arg(dir)
        .output()
        .unwrap()
}

#[test]
fn bench_is_byte_identical_across_runs_and_thread_counts_and_writes_report_and_plots() {
    let (a, b) = (out_dir("a"), out_dir("b"));
    ok(small_bench(&a, "1"));
    ok(small_bench(&b, "2"));
    let json_a = std::fs::read(a.join("results.json")).unwrap();
    let json_b = std::fs::read(b.join("results.json")).unwrap();
    assert!(json_a == json_b, "results.json differs between runs");
    assert_eq!(
        std::fs::read(a.join("report.md")).unwrap(),
        std::fs::read(b.join("report.md")).unwrap()
    );

    // The dashboard's contract.
    let results: serde_json::Value = serde_json::from_slice(&json_a).unwrap();
    let summary = results["summary"].as_array().unwrap();
    let runs = results["runs"].as_array().unwrap();
    // The default routers: round_robin, kv and kv_load, in that order.
    let routers: Vec<&str> = summary
        .iter()
        .map(|r| r["router"].as_str().unwrap())
        .collect();
    assert_eq!(
        routers,
        [
            "round_robin",
            "round_robin",
            "kv",
            "kv",
            "kv_load",
            "kv_load"
        ]
    );
    assert_eq!(summary.len(), 3 * 2, "routers × levels");
    assert_eq!(runs.len(), 3 * 2 * 2, "routers × levels × sweeps");
    for row in summary.iter().chain(runs) {
        for key in ["router", "workers", "concurrency", "output_tokens_per_s"] {
            assert!(!row[key].is_null(), "{key} missing in {row}");
        }
        for key in ["ttft_ms", "tpot_ms", "itl_ms", "e2e_s"] {
            assert!(row[key]["p50"].is_number(), "{key}.p50 in {row}");
            assert!(row[key]["p95"].is_number(), "{key}.p95 in {row}");
        }
        let hit = row["kv_hit_rate"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&hit));
        assert!(row["oracle_hit_rate"].as_f64().unwrap() >= hit);
        assert!(row["requests_per_s"].as_f64().unwrap() > 0.0);
        assert!(row["errors"].is_number());
    }
    assert!(runs.iter().all(|r| r["seed"].is_u64()));
    assert!(summary.iter().all(|r| r["seed"].is_null()));

    let report = std::fs::read_to_string(a.join("report.md")).unwrap();
    for heading in [
        "## TTFT — Time to First Token",
        "## Throughput and actual RPS",
        "## ITL — Inter-Token Latency",
        "## End-to-end latency",
        "## Results summary",
        "## Hit rate against the oracle bound",
        "## Per-worker balance",
    ] {
        assert!(report.contains(heading), "{heading} missing:\n{report}");
    }
    for plot in [
        "ttft_p95.svg",
        "tpot_p95.svg",
        "tops.svg",
        "hit_rate.svg",
        "e2e_p50.svg",
    ] {
        let svg = std::fs::read_to_string(a.join(plot)).unwrap();
        let doc = roxmltree::Document::parse(&svg)
            .unwrap_or_else(|e| panic!("{plot} is not well-formed XML: {e}"));
        assert_eq!(doc.root_element().tag_name().name(), "svg");
        let lines = doc
            .descendants()
            .filter(|n| n.has_tag_name("polyline"))
            .count();
        assert!(lines >= 2, "{plot}: one line per router, got {lines}");
        assert!(report.contains(plot), "report links {plot}");
    }
    let ttft = std::fs::read_to_string(a.join("ttft_p95.svg")).unwrap();
    assert!(ttft.contains("SLO 600 ms"));
    let _ = std::fs::remove_dir_all(&a);
    let _ = std::fs::remove_dir_all(&b);
}

#[test]
fn sim_prints_a_table_or_the_json_contract() {
    let args = [
        "sim",
        "--router",
        "kv",
        "--concurrency",
        "12",
        "--duration",
        "60",
        "--warmup",
        "20",
    ];
    let table = ok(kvroute().args(args).output().unwrap());
    let text = String::from_utf8(table.stdout).unwrap();
    for needle in ["TTFT", "TPOT", "ITL", "E2E", "KV hit rate", "per worker"] {
        assert!(text.contains(needle), "{needle} missing:\n{text}");
    }
    let json = ok(kvroute().args(args).arg("--json").output().unwrap());
    let v: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    let row = &v["runs"][0];
    assert_eq!(row["router"], "kv");
    assert_eq!(row["concurrency"], 12);
    assert_eq!(row["workers"], 3);
    assert_eq!(row["per_worker"].as_array().unwrap().len(), 3);
    let t = &v["totals"];
    assert_eq!(
        t["issued"].as_u64().unwrap(),
        t["finished"].as_u64().unwrap()
            + t["failed"].as_u64().unwrap()
            + t["in_flight_at_end"].as_u64().unwrap()
    );
}

#[test]
fn bad_arguments_fail_with_a_clear_error() {
    assert_failures(&[
        (
            &["bench", "--routers", "round_robin,best"],
            "round_robin, random, kv",
        ),
        (
            &["bench", "--phases", "baseline,medusa"],
            "the ladder's phases are baseline, kv, draft, eagle3",
        ),
        (
            &["bench", "--phases", "--setups", "tpu"],
            "known: h100x8-tp4, h200x3",
        ),
        (
            &["bench", "--phases", "--compare-seed002"],
            "does not apply to --phases",
        ),
        (
            &["sim", "--spec-decode", "medusa"],
            "has no speculative-decoding configuration \"medusa\"; it has: draft, eagle3",
        ),
        (
            &["sim", "--spec-decode", "eagle3", "--draft-len", "40"],
            "--draft-len must be between 1 and 16",
        ),
        (&["sim", "--profile", "tpu-v9"], "h200-llama70b-fp8"),
        (
            &["sim", "--profile-set", "timing.warp_factor=9"],
            "no field `timing.warp_factor`",
        ),
        (
            &["sim", "--workload-set", "lockstep.new_token_ratio=1"],
            "no field `lockstep.new_token_ratio` (unknown field `new_token_ratio`, expected \
             `new_tokens_ratio`)",
        ),
        (
            &["sim", "--workload-set", "think_time_s.kind.x=1"],
            "no field `think_time_s.kind.x`",
        ),
        (
            &["sim", "--workload-set", "lockstep.new_tokens_ratio=often"],
            "workload settings",
        ),
        (&["sim", "--warmup", "100", "--duration", "50"], "--warmup"),
        (&["sim", "--engine-set", "max_num_seqs"], "KEY=VALUE"),
    ]);
}

#[test]
fn an_optional_workload_section_that_is_off_can_be_set_from_the_command_line() {
    // `lockstep` is absent from the default workload; setting one of its fields turns it on.
    let run = |extra: &[&str]| {
        let mut args = vec![
            "sim",
            "--concurrency",
            "1",
            "--duration",
            "60",
            "--warmup",
            "0",
            "--json",
            "--workload-set",
            r#"turns={"min":4,"max":4}"#,
            "--workload-set",
            r#"output_tokens={"kind":"constant","value":150}"#,
        ];
        args.extend_from_slice(extra);
        let out = ok(kvroute().args(&args).output().unwrap());
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v["runs"][0]["mean_prompt_tokens"].as_f64().unwrap()
    };
    let chat = run(&[]);
    let lockstep = run(&["--workload-set", "lockstep.new_tokens_ratio=2"]);
    // Each lock-step turn adds twice its history, so prompts grow several-fold.
    assert!(
        lockstep > 2.0 * chat,
        "lock-step prompts {lockstep} vs chat {chat}"
    );
}

/// docs/ROUTING.md's lock-step cell ("Why lock-step queues: waves"): 3 H200s, 60 conversations of
/// 4 turns, each turn adding a quarter of its history, 150-token answers, no think time. Turns
/// come back in waves; `kv_load`'s default stall weights let a turn leave a worker where a wave
/// waits, so its TTFT beats round-robin's, and weighing decoding requests like waiting ones
/// (the former weights) brings the waves back.
#[test]
fn kv_load_breaks_up_lock_step_waves() {
    let ttft = |extra: &[&str]| {
        let mut args = vec![
            "sim",
            "--workers",
            "3",
            "--concurrency",
            "60",
            "--duration",
            "150",
            "--warmup",
            "30",
            "--json",
            "--workload-set",
            "lockstep.new_tokens_ratio=0.25",
            "--workload-set",
            r#"turns={"min":4,"max":4}"#,
            "--workload-set",
            r#"think_time_s={"kind":"constant","value":0}"#,
            "--workload-set",
            r#"output_tokens={"kind":"constant","value":150}"#,
        ];
        args.extend_from_slice(extra);
        let out = ok(kvroute().args(&args).output().unwrap());
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let t = &v["runs"][0]["ttft_ms"];
        (t["p50"].as_f64().unwrap(), t["p95"].as_f64().unwrap())
    };
    let kv_load = ttft(&[]);
    let round_robin = ttft(&["--router", "round_robin"]);
    let former = ttft(&[
        "--kv-load-set",
        "decode_stall_weight=1",
        "--kv-load-set",
        "slot_penalty_secs=30",
    ]);
    assert!(
        kv_load.0 < round_robin.0 && kv_load.1 < round_robin.1,
        "kv_load {kv_load:?} vs round_robin {round_robin:?} (TTFT p50, p95 ms)"
    );
    assert!(
        kv_load.1 < 0.9 * former.1,
        "kv_load {kv_load:?} vs the former stall weights {former:?}"
    );
}

#[test]
fn sim_with_faults_reports_what_happened_and_refuses_what_it_cannot_simulate() {
    let args = [
        "sim",
        "--concurrency",
        "12",
        "--duration",
        "90",
        "--warmup",
        "20",
        "--seed",
        "4",
        "--faults",
        "worker-crash=10,event-loss=0.01",
    ];
    let table = ok(kvroute().args(args).output().unwrap());
    let text = String::from_utf8(table.stdout).unwrap();
    for needle in [
        "faults `worker-crash=10,event-loss=0.01` (--seed 4)",
        "crashed",
        "joined",
    ] {
        assert!(text.contains(needle), "{needle} missing:\n{text}");
    }
    let json = ok(kvroute().args(args).arg("--json").output().unwrap());
    let v: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    let faults = &v["faults"];
    assert_eq!(faults["spec"], "worker-crash=10,event-loss=0.01");
    assert!(faults["kv_events_lost"].as_u64().unwrap() > 0, "{faults}");
    assert!(faults["checked_steps"].as_u64().unwrap() > 0);
    assert_eq!(
        v["totals"]["failed"].as_u64().unwrap(),
        faults["worker_failed_requests"].as_u64().unwrap()
    );
    // The simulated gateway migrates the crashed worker's requests, as `kvroute gateway`
    // does; with `--migration-limit 0` they end with the error, as before migration.
    assert!(
        faults["migrations"]["worker_failed"].as_u64().unwrap() > 0,
        "{faults}"
    );
    assert_eq!(faults["worker_failed_requests"], 0, "{faults}");
    let off = ok(kvroute()
        .args(args)
        .args(["--migration-limit", "0", "--ejection-time", "0", "--json"])
        .output()
        .unwrap());
    let v: serde_json::Value = serde_json::from_slice(&off.stdout).unwrap();
    let faults = &v["faults"];
    assert_eq!(faults["migrations"]["worker_failed"], 0, "{faults}");
    assert!(
        faults["worker_failed_requests"].as_u64().unwrap() > 0,
        "{faults}"
    );
    // A fault-free run's JSON has no `faults` key (its output is unchanged).
    let clean = ok(kvroute()
        .args(&args[..args.len() - 2])
        .arg("--json")
        .output()
        .unwrap());
    let v: serde_json::Value = serde_json::from_slice(&clean.stdout).unwrap();
    assert!(v.get("faults").is_none());
    // Behind gateway replicas: one dies and restarts, another loses NATS for a while.
    let mut replicas = args[..args.len() - 1].to_vec();
    replicas.extend(["replica-restart=5,partition=5", "--gateway-replicas", "3"]);
    let table = ok(kvroute().args(&replicas).output().unwrap());
    let text = String::from_utf8(table.stdout).unwrap();
    for needle in [
        "gateway replica",
        "died",
        "started again",
        "cut off NATS",
        "back on NATS",
        "snapshots applied",
    ] {
        assert!(text.contains(needle), "{needle} missing:\n{text}");
    }
    assert_failures(&[
        (
            &["sim", "--faults", "worker-explode"],
            "known: worker-crash",
        ),
        (
            &["sim", "--faults", "partition"],
            "--gateway-replicas 2 or more",
        ),
        (
            &["sim", "--faults", "event-loss=1.5"],
            "probability between 0 and 1",
        ),
        (
            &["sim", "--faults", "worker-crash", "--ejection-time=-1"],
            "--ejection-time must be a number of seconds between 0 and 86400",
        ),
        (
            &["sim", "--faults", "worker-crash", "--migration-limit=-1"],
            "--migration-limit",
        ),
        (&["sim", "--migration-limit", "2"], "--faults"),
        (
            &[
                "sim",
                "--faults",
                "event-loss",
                "--prefill-workers",
                "1",
                "--decode-workers",
                "2",
            ],
            "aggregated fleets only",
        ),
    ]);
}

/// 4 workers, 40 simulated seconds sampled every 2 s: 20 samples.
fn sim_with_timeline(dir: &Path) -> Output {
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
    let (a, b) = (out_dir("timeline-a"), out_dir("timeline-b"));
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
    let dir = out_dir("timeline-zero");
    let stderr = failure(&[
        "sim",
        "--duration",
        "20",
        "--warmup",
        "5",
        "--timeline-interval",
        "0",
        "--timeline",
        dir.to_str().expect("a UTF-8 temporary directory"),
    ]);
    assert!(
        stderr.contains("interval must be longer than zero"),
        "{stderr}"
    );
    assert!(!dir.join("timeline.csv").exists());
    let _ = std::fs::remove_dir_all(&dir);
}

/// `bench --phases` on a short ladder: one results.json whose rows carry phase, setup,
/// acceptance and tokens per step beside today's fields; the report and per-setup plots; the
/// expected shape (KV routing lowers turn-2+ TTFT, speculation lowers ITL, EAGLE-3 more).
#[test]
fn bench_phases_writes_one_report_of_the_ladder() {
    let dir = out_dir("phases");
    let out = ok(kvroute()
        .args([
            "bench",
            "--phases",
            "--setups",
            "h100x8-tp4",
            "--levels",
            "16",
            "--sweeps",
            "1",
            "--warmup",
            "30",
            "--window",
            "60",
            "--lookback",
            "30",
            "--out",
        ])
        .arg(&dir)
        .output()
        .unwrap());
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(stdout.contains("h100x8-tp4"), "{stdout}");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("results.json")).unwrap()).unwrap();
    let rows = json["summary"].as_array().unwrap();
    let phases: Vec<&str> = rows.iter().map(|r| r["phase"].as_str().unwrap()).collect();
    assert_eq!(phases, ["baseline", "kv", "draft", "eagle3"]);
    let get = |phase: &str, field: &str| {
        let row = rows.iter().find(|r| r["phase"] == phase).unwrap();
        assert_eq!(row["setup"], "h100x8-tp4");
        row[field].clone()
    };
    let p50 = |phase: &str, field: &str| get(phase, field)["p50"].as_f64().unwrap();
    assert!(p50("kv", "ttft_later_ms") < p50("baseline", "ttft_later_ms"));
    assert!(p50("draft", "itl_ms") < p50("kv", "itl_ms"));
    assert!(p50("eagle3", "itl_ms") < p50("draft", "itl_ms"));
    assert!(get("kv", "acceptance_rate").is_null());
    assert_eq!(get("kv", "tokens_per_step").as_f64(), Some(1.0));
    let draft = get("draft", "acceptance_rate").as_f64().unwrap();
    let eagle = get("eagle3", "acceptance_rate").as_f64().unwrap();
    assert!((0.55..0.70).contains(&draft) && (0.70..0.85).contains(&eagle));
    assert!(get("eagle3", "tokens_per_step").as_f64().unwrap() > 3.0);
    assert_eq!(json["bench"]["setups"][0]["gpus_per_worker"], 4);
    assert_eq!(json["bench"]["phases"][2]["spec_decode"], "draft");
    let report = std::fs::read_to_string(dir.join("report.md")).unwrap();
    for needle in [
        "TTFT turn 1 p50 / p95",
        "TTFT turns 2+",
        "### SLOs",
        "h100x8-tp4_itl_p50.svg",
    ] {
        assert!(report.contains(needle), "{needle} missing from report.md");
    }
    assert!(dir.join("h100x8-tp4_ttft_later_p50.svg").exists());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn disaggregation_flags_with_bad_values_fail_with_a_clear_error() {
    assert_failures(&[
        (
            &["sim", "--prefill-workers", "two", "--decode-workers", "2"],
            "invalid value 'two' for '--prefill-workers <N>'",
        ),
        (
            &["sim", "--prefill-workers", "1", "--decode-workers", "0"],
            "invalid value '0' for '--decode-workers <M>'",
        ),
        (&["sim", "--prefill-workers", "1"], "--decode-workers <M>"),
        (
            &[
                "sim",
                "--workers",
                "4",
                "--prefill-workers",
                "1",
                "--decode-workers",
                "3",
            ],
            "'--workers <WORKERS>' cannot be used with '--prefill-workers <N>'",
        ),
        (
            &["sim", "--local-prefill-max-tokens", "256"],
            "add --prefill-workers N --decode-workers M, or --layout",
        ),
        (
            &[
                "sim",
                "--prefill-workers",
                "1",
                "--decode-workers",
                "1",
                "--local-prefill-max-tokens=-5",
            ],
            "invalid value '-5' for '--local-prefill-max-tokens <TOKENS>'",
        ),
        (
            &["sim", "--layout", "seed005-moon"],
            "known: seed004-dev, seed004-prod",
        ),
        (
            &[
                "sim",
                "--layout",
                "seed004-dev",
                "--profile",
                "h200-llama70b-fp8",
            ],
            "cannot be used with",
        ),
        (
            &[
                "sim",
                "--layout",
                "seed004-dev",
                "--kv-link",
                "carrier-pigeon",
            ],
            "invalid value 'carrier-pigeon' for '--kv-link <KV_LINK>'",
        ),
        (&["bench", "--disagg", "--gpus", "1"], "1 is not in 2..=16"),
        (&["bench", "--gpus", "4"], "--disagg"),
        (
            &["bench", "--disagg", "--disagg-workloads", "chat,poetry"],
            "unknown workload \"poetry\"; known: chat",
        ),
        (
            &["bench", "--disagg", "--slo-ttft-ms", "0"],
            "--slo-ttft-ms must be",
        ),
        (
            &["bench", "--disagg", "--slo-itl-ms=-3"],
            "--slo-itl-ms must be",
        ),
        (
            &["bench", "--disagg", "--local-prefill-max-tokens", "lots"],
            "invalid value 'lots'",
        ),
        (
            &["bench", "--disagg", "--kv-link", "wifi"],
            "invalid value 'wifi'",
        ),
        (&["bench", "--disagg", "--phases"], "cannot be used with"),
        (
            &["bench", "--disagg", "--rates", "0"],
            "invalid value '0' for '--rates <RPS>': must be a number of sessions per second",
        ),
        (
            &["bench", "--disagg", "--rates", "1,fast"],
            "expected a number of sessions per second, got `fast`",
        ),
        (&["bench", "--rates", "1"], "--disagg"),
        (
            &["bench", "--disagg", "--kv-link-sharing", "sometimes"],
            "invalid value 'sometimes' for '--kv-link-sharing <MODE>'",
        ),
        (
            &["sim", "--kv-link-sharing", "exclusive"],
            "add --prefill-workers N --decode-workers M, or --layout",
        ),
        (
            &[
                "sim",
                "--layout",
                "seed004-dev",
                "--kv-link-sharing",
                "fair",
            ],
            "invalid value 'fair' for '--kv-link-sharing <MODE>'",
        ),
        (
            &["bench", "--disagg", "--rates", "1,0.5,1"],
            "--rates: 1 is given twice",
        ),
        (
            &["bench", "--disagg", "--workers", "4"],
            "cannot be used with",
        ),
    ]);
}

#[test]
fn sim_with_prefill_and_decode_pools_reports_routes_and_transfers() {
    let out = ok(kvroute()
        .args([
            "sim",
            "--prefill-workers",
            "1",
            "--decode-workers",
            "2",
            "--concurrency",
            "12",
            "--duration",
            "90",
            "--warmup",
            "30",
            "--json",
        ])
        .output()
        .unwrap());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let row = &v["runs"][0];
    let pools: Vec<&str> = row["per_worker"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["pool"].as_str().unwrap())
        .collect();
    assert_eq!(pools, ["prefill", "decode", "decode"]);
    let s = &row["serving"];
    assert!(s["goodput_rps"].as_f64().unwrap() > 0.0, "{s}");
    let d = &v["totals"]["disagg"];
    assert!(d["split"].as_u64().unwrap() > 0, "{d}");
    assert!(d["local_short"].as_u64().unwrap() > 0, "{d}");
    assert!(d["kv_transfer_bytes"].as_u64().unwrap() > 0, "{d}");
    assert_eq!(v["totals"]["failed"].as_u64(), Some(0));

    // The table says the same in words.
    let table = ok(kvroute()
        .args([
            "sim",
            "--layout",
            "seed004-dev",
            "--concurrency",
            "4",
            "--duration",
            "40",
            "--warmup",
            "10",
        ])
        .output()
        .unwrap());
    let text = String::from_utf8(table.stdout).unwrap();
    assert!(
        text.contains("h100-llama8b") && text.contains("goodput"),
        "{text}"
    );
    assert!(text.contains("KV transfers"), "{text}");
}

fn small_disagg_bench(dir: &Path, jobs: &str) -> Output {
    kvroute()
        .args([
            "bench",
            "--disagg",
            "--disagg-workloads",
            "chat,summarise",
            "--gpus",
            "3",
            "--levels",
            "6,18",
            "--sweeps",
            "1",
            "--warmup",
            "20",
            "--window",
            "40",
            "--snapshots",
            "2",
            "--lookback",
            "20",
            "--seed",
            "3",
            "--jobs",
            jobs,
            "--out",
        ])
        .arg(dir)
        .output()
        .unwrap()
}

#[test]
fn bench_disagg_compares_layouts_of_equal_gpus_byte_identically() {
    let (a, b) = (out_dir("disagg-a"), out_dir("disagg-b"));
    let out = ok(small_disagg_bench(&a, "1"));
    ok(small_disagg_bench(&b, "2"));
    for file in [
        "results.json",
        "report.md",
        "chat_goodput.svg",
        "summarise_goodput.svg",
    ] {
        assert!(
            std::fs::read(a.join(file)).unwrap() == std::fs::read(b.join(file)).unwrap(),
            "{file} differs between runs"
        );
    }
    let stdout = String::from_utf8(out.stdout).unwrap();
    for layout in ["3agg", "1p2d", "2p1d"] {
        assert!(stdout.contains(layout), "{stdout}");
    }
    let v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(a.join("results.json")).unwrap()).unwrap();
    let summary = v["summary"].as_array().unwrap();
    assert_eq!(summary.len(), 2 * 3 * 2, "workloads × layouts × levels");
    assert_eq!(v["bench"]["disagg"]["slo"]["ttft_ms"].as_f64(), Some(500.0));
    let split: Vec<&serde_json::Value> = summary.iter().filter(|r| r["layout"] == "1p2d").collect();
    assert_eq!(split.len(), 4);
    assert!(
        split
            .iter()
            .all(|r| r["serving"]["split"].as_f64().unwrap() > 0.0)
    );
    // Summarisation documents are uncached everywhere: every one of them is split.
    let summarise_local: Vec<f64> = summary
        .iter()
        .filter(|r| r["workload"] == "summarise" && r["layout"] == "2p1d")
        .map(|r| r["serving"]["local_short"].as_f64().expect("local_short"))
        .collect();
    assert_eq!(summarise_local, [0.0, 0.0], "{summary:?}");
    let report = std::fs::read_to_string(a.join("report.md")).unwrap();
    assert!(
        report.contains("Goodput") && report.contains("`2p1d`"),
        "{report}"
    );
}

fn open_loop_disagg_bench(dir: &Path, jobs: &str) -> Output {
    kvroute()
        .args([
            "bench",
            "--disagg",
            "--disagg-workloads",
            "summarise",
            "--gpus",
            "2",
            "--rates",
            "2,0.2",
            "--sweeps",
            "1",
            "--warmup",
            "20",
            "--window",
            "40",
            "--snapshots",
            "2",
            "--lookback",
            "20",
            "--seed",
            "3",
            "--jobs",
            jobs,
            "--out",
        ])
        .arg(dir)
        .output()
        .unwrap()
}

#[test]
fn bench_disagg_at_open_loop_rates_shows_saturation_byte_identically() {
    let (a, b) = (out_dir("disagg-rate-a"), out_dir("disagg-rate-b"));
    let out = ok(open_loop_disagg_bench(&a, "1"));
    ok(open_loop_disagg_bench(&b, "2"));
    for file in ["results.json", "report.md", "summarise_rate_goodput.svg"] {
        assert!(
            std::fs::read(a.join(file)).unwrap() == std::fs::read(b.join(file)).unwrap(),
            "{file} differs between runs"
        );
    }
    // Only --rates given: no closed-loop rows or plots.
    assert!(!a.join("summarise_goodput.svg").exists());
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(
        stdout.contains("0.2/s") && stdout.contains("2/s"),
        "{stdout}"
    );
    let v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(a.join("results.json")).unwrap()).unwrap();
    let meta = &v["bench"]["disagg"];
    assert_eq!(meta["rates"], serde_json::json!([0.2, 2.0]));
    assert_eq!(meta["kv_link_sharing"], "shared");
    let summary = v["summary"].as_array().unwrap();
    assert_eq!(summary.len(), 2 * 2, "layouts × rates");
    assert!(summary.iter().all(|r| r["concurrency"] == 0), "{summary:?}");
    let at = |layout: &str, rate: f64| {
        summary
            .iter()
            .find(|r| r["layout"] == layout && r["rate_rps"].as_f64() == Some(rate))
            .unwrap_or_else(|| panic!("no row for {layout} at {rate}/s"))
    };
    for layout in ["2agg", "1p1d"] {
        let (light, heavy) = (at(layout, 0.2), at(layout, 2.0));
        let rps = |r: &serde_json::Value| r["requests_per_s"].as_f64().unwrap();
        // Two GPUs finish what arrives at 0.2 documents/s; at 2/s (a 10k-token 70B prefill
        // takes about a second) they fall behind, and the open loop keeps sending: fewer
        // than half the arrivals finish and the first tokens that come are far later.
        assert!(rps(light) > 0.1, "{layout} light: {light}");
        assert!(rps(heavy) < 1.0, "{layout} heavy: {heavy}");
        let light_ttft = light["ttft_ms"]["p95"].as_f64().unwrap();
        if let Some(heavy_ttft) = heavy["ttft_ms"]["p95"].as_f64() {
            assert!(
                heavy_ttft > 4.0 * light_ttft,
                "{layout}: {heavy} vs {light}"
            );
        }
    }
    // Documents are uncached everywhere: every one is split, and its KV moved.
    let split = at("1p1d", 0.2);
    assert_eq!(
        split["serving"]["local_short"].as_f64(),
        Some(0.0),
        "{split}"
    );
    assert!(split["serving"]["kv_transfer_ms"]["p50"].as_f64().unwrap() > 0.0);
    let report = std::fs::read_to_string(a.join("report.md")).unwrap();
    assert!(
        report.contains("Goodput against the arrival rate, `summarise`")
            && report.contains("2 sessions/s arriving (open loop, Poisson)"),
        "{report}"
    );
}

#[test]
fn sim_with_gateway_replicas_reports_them_and_refuses_what_it_cannot_simulate() {
    let args = [
        "sim",
        "--concurrency",
        "12",
        "--duration",
        "40",
        "--warmup",
        "10",
        "--gateway-replicas",
        "3",
        "--replica-sync-ms",
        "5",
    ];
    let table = ok(kvroute().args(args).output().unwrap());
    let text = String::from_utf8(table.stdout).unwrap();
    assert!(
        text.contains("gateway replicas: 3 (sync 5 ms); busiest worker's peak in flight"),
        "{text}"
    );
    let json = ok(kvroute().args(args).arg("--json").output().unwrap());
    let v: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    let r = &v["gateway_replicas"];
    assert_eq!(r["replicas"], 3);
    assert_eq!(r["sync_delay"], 5_000_000);
    assert!(r["busiest_peak_in_flight"].as_u64().unwrap() > 0, "{r}");
    assert!(r["updates_applied"].as_u64().unwrap() > 0, "{r}");
    // One replica adds nothing to the report.
    let single = ok(kvroute().args(&args[..7]).arg("--json").output().unwrap());
    let v: serde_json::Value = serde_json::from_slice(&single.stdout).unwrap();
    assert!(v.get("gateway_replicas").is_none());
    assert!(v["totals"].get("replicas").is_none());
    assert_failures(&[
        (
            &["sim", "--gateway-replicas", "0"],
            "--gateway-replicas must be at least 1",
        ),
        (
            &["sim", "--faults", "replica-restart"],
            "--gateway-replicas 2 or more",
        ),
        (
            &[
                "sim",
                "--gateway-replicas",
                "2",
                "--prefill-workers",
                "1",
                "--decode-workers",
                "2",
            ],
            "aggregated fleet only",
        ),
        (
            &["sim", "--no-replica-sync", "--replica-sync-ms", "5"],
            "cannot be used with",
        ),
        (
            &["sim", "--gateway-replicas", "2", "--replica-sync-ms=-3"],
            "--replica-sync-ms must be a number of milliseconds ≥ 0, got -3",
        ),
    ]);
}
