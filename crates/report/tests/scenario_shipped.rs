//! The committed scenario run (`kvroute sim --scenario seed004 --out docs/results/scenario`)
//! read back with the report's types renders to the very files beside it: results.json
//! loses nothing on a round trip, and report.md and timeline.svg are a pure function of it.

// A test is a driver: it reads the shipped files the core is given (clippy.toml).
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

use std::path::PathBuf;

use report::scenario::{ScenarioResults, files};

fn shipped(name: &str) -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../docs/results/scenario")
        .join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn results() -> ScenarioResults {
    serde_json::from_str(&shipped("results.json")).expect("results.json reads as ScenarioResults")
}

#[test]
fn results_json_round_trips_byte_for_byte() {
    let results = results();
    assert_eq!(results.meta.scenario, "seed004");
    assert!(!results.phases.is_empty() && !results.samples.is_empty());
    let written = serde_json::to_string_pretty(&results).unwrap() + "\n";
    assert!(
        written == shipped("results.json"),
        "results.json changed on a round trip"
    );
}

#[test]
fn report_and_timeline_render_to_the_shipped_files() {
    let results = results();
    let rendered = files(&results);
    let names: Vec<&str> = rendered.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["report.md", "timeline.svg"]);
    for (name, body) in rendered {
        assert!(
            body == shipped(&name),
            "{name} differs from what results.json renders"
        );
    }
}

#[test]
fn the_shipped_cycle_accounts_for_every_request_and_reports_each_scale_up() {
    let r = results();
    let t = &r.totals;
    assert_eq!(t.issued, t.finished + t.failed + t.in_flight_at_end);
    let ups = r.events.iter().filter(|e| e.to > e.from).count();
    assert_eq!(r.recoveries.len(), ups);
    let phases: Vec<&str> = r.phases.iter().map(|p| p.name.as_str()).collect();
    assert!(phases.contains(&"PREFILL_RECOVERY") && phases.contains(&"DECODE_RECOVERY"));
}
