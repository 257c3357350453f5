//! Reference lines for the booth dashboard (seed 003): what each phase of the ladder measured
//! — baseline, KV routing, draft model, EAGLE-3 — read from the `results.json` that `kvroute
//! bench --phases` writes, so the live charts can show where the earlier phases stood. The
//! shipped default is `docs/phases/results.json`.

use report::{BenchResults, Row};
use serde::Serialize;

/// The ladder the binary ships (`kvroute bench --phases --out docs/phases`).
pub const SHIPPED_PHASES: &str = include_str!("../../../docs/phases/results.json");

/// Where the shipped ladder comes from, as the dashboard says it.
pub const SHIPPED_PHASES_SOURCE: &str =
    "docs/phases/results.json (kvroute bench --phases, simulated)";

/// One phase's figures at one level: the values its reference lines are drawn at.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PhaseLine {
    pub phase: String,
    pub ttft_turn1_p50_ms: Option<f64>,
    pub ttft_later_p50_ms: Option<f64>,
    pub itl_p50_ms: Option<f64>,
    pub itl_p95_ms: Option<f64>,
    pub acceptance_rate: Option<f64>,
    pub tokens_per_step: Option<f64>,
}

impl PhaseLine {
    fn of(r: &Row) -> Option<PhaseLine> {
        let m = &r.metrics;
        Some(PhaseLine {
            phase: r.phase.clone()?,
            ttft_turn1_p50_ms: m.ttft_turn1_ms.and_then(|p| p.p50),
            ttft_later_p50_ms: m.ttft_later_ms.and_then(|p| p.p50),
            itl_p50_ms: m.itl_ms.p50,
            itl_p95_ms: m.itl_ms.p95,
            acceptance_rate: m.acceptance_rate,
            tokens_per_step: m.tokens_per_step,
        })
    }
}

/// Every phase at one concurrency level, in ladder order.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PhaseLevel {
    pub concurrency: u32,
    pub phases: Vec<PhaseLine>,
}

/// One setup's ladder.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PhaseReference {
    pub source: String,
    /// The setup's name (`h200x3`) and what it is.
    pub setup: String,
    pub description: String,
    pub levels: Vec<PhaseLevel>,
}

/// Why a results file cannot give reference lines.
#[derive(Debug, thiserror::Error)]
pub enum ReferenceError {
    #[error("not a kvroute bench results.json: {0}")]
    Format(#[from] serde_json::Error),
    #[error("results.json has no phase ladder (write one with `kvroute bench --phases --out DIR`)")]
    NoLadder,
    #[error("results.json has no setup {0:?} (it has: {1})")]
    NoSetup(String, String),
}

impl PhaseReference {
    /// The ladder of `setup` (the file's first setup when `None`) in a `bench --phases`
    /// results file.
    pub fn from_results_json(
        json: &str,
        source: &str,
        setup: Option<&str>,
    ) -> Result<PhaseReference, ReferenceError> {
        let file: BenchResults = serde_json::from_str(json)?;
        if file.bench.setups.is_empty() || file.bench.phases.is_empty() {
            return Err(ReferenceError::NoLadder);
        }
        let chosen = match setup {
            None => &file.bench.setups[0],
            Some(name) => file
                .bench
                .setups
                .iter()
                .find(|s| s.name == name)
                .ok_or_else(|| {
                    let known: Vec<&str> =
                        file.bench.setups.iter().map(|s| s.name.as_str()).collect();
                    ReferenceError::NoSetup(name.to_owned(), known.join(", "))
                })?,
        };
        let mut levels: Vec<u32> = file
            .summary
            .iter()
            .filter(|r| r.setup.as_deref() == Some(&chosen.name))
            .map(|r| r.concurrency)
            .collect();
        levels.sort_unstable();
        levels.dedup();
        let levels = levels
            .into_iter()
            .map(|concurrency| PhaseLevel {
                concurrency,
                phases: file
                    .bench
                    .phases
                    .iter()
                    .filter_map(|p| {
                        file.summary.iter().find(|r| {
                            r.setup.as_deref() == Some(&chosen.name)
                                && r.phase.as_deref() == Some(&p.name)
                                && r.concurrency == concurrency
                        })
                    })
                    .filter_map(PhaseLine::of)
                    .collect(),
            })
            .collect();
        Ok(PhaseReference {
            source: source.to_owned(),
            setup: chosen.name.clone(),
            description: chosen.description.clone(),
            levels,
        })
    }

    /// The shipped ladder's setup that runs `workers` workers of `profile`, if it has one.
    pub fn shipped_for(profile: &str, workers: u32) -> Option<PhaseReference> {
        let file: BenchResults = serde_json::from_str(SHIPPED_PHASES).ok()?;
        let setup = file
            .bench
            .setups
            .iter()
            .find(|s| s.profile == profile && s.workers == workers)?;
        PhaseReference::from_results_json(SHIPPED_PHASES, SHIPPED_PHASES_SOURCE, Some(&setup.name))
            .ok()
    }

    /// The level nearest `concurrency` (the lower one on a tie).
    pub fn near(&self, concurrency: u32) -> Option<&PhaseLevel> {
        self.levels
            .iter()
            .min_by_key(|l| (l.concurrency.abs_diff(concurrency), l.concurrency))
    }
}

/// What `/api/status` says about the reference lines at the current concurrency.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ReferenceStatus {
    pub source: String,
    pub setup: String,
    pub concurrency: u32,
    pub phases: Vec<PhaseLine>,
}

impl PhaseReference {
    /// The reference lines at the level nearest `concurrency`.
    pub fn status(&self, concurrency: u32) -> Option<ReferenceStatus> {
        let level = self.near(concurrency)?;
        Some(ReferenceStatus {
            source: self.source.clone(),
            setup: self.setup.clone(),
            concurrency: level.concurrency,
            phases: level.phases.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shipped_ladder_gives_every_phase_per_level() {
        let r = PhaseReference::shipped_for("h200-llama70b-fp8", 3).unwrap();
        assert_eq!(r.setup, "h200x3");
        let level = r.status(55).unwrap();
        assert_eq!(level.concurrency, 60);
        let names: Vec<&str> = level.phases.iter().map(|p| p.phase.as_str()).collect();
        assert_eq!(names, ["baseline", "kv", "draft", "eagle3"]);
        let itl = |i: usize| level.phases[i].itl_p50_ms.unwrap();
        assert!(itl(3) < itl(1));
        assert!(level.phases[0].acceptance_rate.is_none());
        assert!(level.phases[3].acceptance_rate.unwrap() > 0.7);
        assert!(PhaseReference::shipped_for("h200-llama70b-fp8", 5).is_none());
        let tp4 = PhaseReference::shipped_for("h100-tp4-llama70b-fp8", 2).unwrap();
        assert_eq!(tp4.setup, "h100x8-tp4");
    }

    #[test]
    fn a_file_without_a_ladder_is_refused() {
        let err = PhaseReference::from_results_json(crate::baseline::SHIPPED_RESULTS, "x", None)
            .unwrap_err();
        assert!(err.to_string().contains("bench --phases"), "{err}");
        let err = PhaseReference::from_results_json(SHIPPED_PHASES, "x", Some("tpu"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("h100x8-tp4, h200x3"), "{err}");
    }
}
