//! The shipped benchmark (`kvroute bench --out docs/results --compare-seed002`) read back with
//! the report's types renders to the very files beside it: the types lose nothing of
//! results.json, and report.md and the plots are a pure function of it.

// A test is a driver: it reads the shipped files the core is given (clippy.toml).
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

use std::path::PathBuf;

use report::BenchResults;

fn shipped(name: &str) -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../docs/results")
        .join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn results() -> BenchResults {
    serde_json::from_str(&shipped("results.json")).expect("results.json reads as BenchResults")
}

#[test]
fn results_json_round_trips_byte_for_byte() {
    let results = results();
    assert!(!results.summary.is_empty() && !results.runs.is_empty());
    assert!(
        results
            .summary
            .iter()
            .all(|r| r.sweeps.is_some() && r.per_worker.is_empty())
    );
    assert!(
        results
            .runs
            .iter()
            .all(|r| r.seed.is_some() && !r.per_worker.is_empty())
    );
    let written = serde_json::to_string_pretty(&results).unwrap() + "\n";
    assert!(
        written == shipped("results.json"),
        "results.json changed on a round trip"
    );
}

#[test]
fn report_and_plots_render_to_the_shipped_files() {
    let results = results();
    let plots = report::plots(&results, true);
    let names: Vec<String> = plots.iter().map(|(name, _)| name.clone()).collect();
    assert_eq!(
        names,
        [
            "ttft_p95.svg",
            "tpot_p95.svg",
            "tops.svg",
            "hit_rate.svg",
            "e2e_p50.svg"
        ]
    );
    for (name, svg) in &plots {
        assert!(
            *svg == shipped(name),
            "{name} differs from docs/results/{name}"
        );
    }
    let markdown = report::markdown(&results, &names);
    assert!(markdown == shipped("report.md"), "report.md differs");
    assert!(markdown.contains(&report::compare_seed_002(&results)));
}

fn shipped_phases(name: &str) -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../docs/phases")
        .join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The shipped phase ladder (`kvroute bench --phases --out docs/phases`) likewise: its
/// results.json round-trips, report.md and the plots are a pure function of it.
#[test]
fn the_phase_ladder_renders_to_the_shipped_files() {
    let text = shipped_phases("results.json");
    let results: BenchResults = serde_json::from_str(&text).expect("phases results.json reads");
    assert_eq!(serde_json::to_string_pretty(&results).unwrap() + "\n", text);
    assert!(
        results
            .summary
            .iter()
            .all(|r| r.phase.is_some() && r.setup.is_some())
    );
    let plots = report::ladder::plots(&results);
    for (name, svg) in &plots {
        assert!(*svg == shipped_phases(name), "docs/phases/{name} differs");
    }
    let names: Vec<String> = plots.into_iter().map(|(name, _)| name).collect();
    assert!(report::ladder::markdown(&results, &names) == shipped_phases("report.md"));
}

fn shipped_disagg(name: &str) -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../docs/disagg")
        .join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The shipped disaggregation comparison (`kvroute bench --disagg --out docs/disagg`)
/// likewise.
#[test]
fn the_disaggregation_bench_renders_to_the_shipped_files() {
    let text = shipped_disagg("results.json");
    let results: BenchResults = serde_json::from_str(&text).expect("disagg results.json reads");
    assert_eq!(serde_json::to_string_pretty(&results).unwrap() + "\n", text);
    assert!(
        results
            .summary
            .iter()
            .all(|r| r.layout.is_some() && r.workload.is_some() && r.metrics.serving.is_some())
    );
    let plots = report::disagg::plots(&results);
    for (name, svg) in &plots {
        assert!(*svg == shipped_disagg(name), "docs/disagg/{name} differs");
    }
    let names: Vec<String> = plots.into_iter().map(|(name, _)| name).collect();
    assert!(report::disagg::markdown(&results, &names) == shipped_disagg("report.md"));
}
