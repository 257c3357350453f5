//! Seed 004's workload mix and open loop on the command line: `--mix` and `--rate` of `sim`,
//! `loadgen` and `demo` refuse bad values with the flag and the reason; `kvroute sim` reports
//! each workload on its own, reproducibly, and counts refused arrivals.

mod common;

use common::{assert_failures, kvroute, ok};

#[test]
fn bad_mixes_and_rates_are_refused_naming_the_flag() {
    for command in ["sim", "loadgen", "demo"] {
        assert_failures(&[
            (
                &[command, "--mix", "A=40,B=30,D=30"],
                "unknown workload `D`",
            ),
            (&[command, "--mix", "A=0,B=0,C=0"], "every weight is zero"),
            (&[command, "--mix", "A=-5,B=10"], "non-negative integer"),
            (&[command, "--mix", "A=1,A=2"], "A is given twice"),
            (&[command, "--mix", "chat"], "expected LETTER=WEIGHT"),
            (&[command, "--rate", "0"], "sessions per second"),
            (&[command, "--rate=-3"], "sessions per second"),
            (&[command, "--rate", "fast"], "sessions per second"),
            (&[command, "--rate", "inf"], "sessions per second"),
        ]);
        let stderr = common::failure(&[command, "--mix", "A=x"]);
        assert!(stderr.contains("--mix"), "{stderr}");
        let stderr = common::failure(&[command, "--rate", "0"]);
        assert!(stderr.contains("--rate"), "{stderr}");
    }
}

fn mixed_sim(extra: &[&str]) -> serde_json::Value {
    let mut args = vec![
        "sim",
        "--mix",
        "A=40,B=30,C=30",
        "--duration",
        "120",
        "--warmup",
        "20",
        "--json",
    ];
    args.extend_from_slice(extra);
    let out = ok(kvroute().args(&args).output().unwrap());
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn sim_reports_each_workload_of_an_open_loop_mix() {
    let v = mixed_sim(&["--rate", "1.5"]);
    let classes = v["runs"][0]["per_class"]
        .as_array()
        .expect("per_class rows");
    let by = |c: &str| {
        classes
            .iter()
            .find(|r| r["class"] == c)
            .unwrap_or_else(|| panic!("no {c} row: {v}"))
    };
    let (a, b, c) = (by("A"), by("B"), by("C"));
    assert_eq!(b["name"], "summarisation");
    // B: long prompts, short answers; C: short prompts, long answers; A: the chat in between.
    let mean = |r: &serde_json::Value, k: &str| r[k].as_f64().unwrap_or(0.0);
    assert!(mean(b, "mean_prompt_tokens") > 3_500.0, "{b}");
    assert!(mean(b, "mean_output_tokens") < 320.0, "{b}");
    assert!(mean(c, "mean_prompt_tokens") < 150.0, "{c}");
    assert!(mean(c, "mean_output_tokens") > 900.0, "{c}");
    assert!(mean(a, "mean_prompt_tokens") > 3_000.0, "{a}");
    for row in [a, b, c] {
        assert!(row["ttft_ms"]["p50"].is_number(), "{row}");
        assert!(row["itl_ms"]["p95"].is_number(), "{row}");
    }
    let w = &v["workload"];
    assert_eq!(w["mix"], "A=40,B=30,C=30");
    assert_eq!(w["rate_rps"], 1.5);
    assert_eq!(w["arrivals_dropped"], 0);
    // About 1.5 × 120 sessions arrived, split about 40/30/30.
    let started: Vec<u64> = w["sessions_by_class"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_u64().unwrap())
        .collect();
    let total: u64 = started.iter().sum();
    assert!((130..=230).contains(&total), "{started:?}");
    assert!(started.iter().all(|n| *n > 20), "{started:?}");
    // The same command, the same bytes.
    assert_eq!(v, mixed_sim(&["--rate", "1.5"]));
}

#[test]
fn an_open_loop_beyond_capacity_is_bounded_and_counted() {
    let v = mixed_sim(&[
        "--rate",
        "200",
        "--workers",
        "1",
        "--workload-set",
        "max_open=50",
    ]);
    let dropped = v["workload"]["arrivals_dropped"].as_u64().unwrap();
    assert!(dropped > 10_000, "{dropped} refused of ~24,000 arrivals");
    let t = &v["totals"];
    assert!(t["in_flight_at_end"].as_u64().unwrap() <= 50, "{t}");
}

#[test]
fn a_closed_loop_mix_keeps_the_concurrency() {
    let v = mixed_sim(&["--concurrency", "20"]);
    assert_eq!(v["runs"][0]["concurrency"], 20);
    assert_eq!(v["workload"]["rate_rps"], serde_json::Value::Null);
    assert_eq!(v["runs"][0]["per_class"].as_array().map(Vec::len), Some(3));
}
