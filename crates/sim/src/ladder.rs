//! Seed 003's phase ladder: baseline → KV-aware routing → draft-model speculative decoding →
//! EAGLE-3, each phase one optimisation more than the last, on one or more hardware setups.
//!
//! A ladder is a set of [`BenchSpec`]s, one per (setup, phase), that share their seed, levels
//! and sweeps (so every phase faces the same conversations: common random numbers). Each is
//! run and aggregated as any benchmark ([`crate::bench`]); [`merge`] then tags the rows with
//! their phase and setup and puts them into one `results.json` ([`BenchResults`]) whose
//! `bench.phases` and `bench.setups` say what each name means.

use report::{BenchResults, PhaseMeta, Setup};
use router::PolicyKind;

use crate::bench::BenchSpec;

/// One step of the ladder.
#[derive(Debug, Clone, PartialEq)]
pub struct LadderPhase {
    /// `baseline`, `kv`, `draft`, `eagle3`.
    pub name: &'static str,
    pub router: PolicyKind,
    /// The profile's named speculative configuration, or `None` for off.
    pub spec_decode: Option<&'static str>,
    pub description: &'static str,
}

/// The phase names, in ladder order.
pub const PHASES: [&str; 4] = ["baseline", "kv", "draft", "eagle3"];

/// Seed 003's ladder with `kv_router` as the KV-aware router of phases 2 onwards.
pub fn ladder(kv_router: PolicyKind) -> Vec<LadderPhase> {
    vec![
        LadderPhase {
            name: "baseline",
            router: PolicyKind::RoundRobin,
            spec_decode: None,
            description: "round-robin routing, no speculative decoding",
        },
        LadderPhase {
            name: "kv",
            router: kv_router,
            spec_decode: None,
            description: "KV-aware routing",
        },
        LadderPhase {
            name: "draft",
            router: kv_router,
            spec_decode: Some("draft"),
            description: "KV-aware routing + Llama-3.1-8B FP8 draft model (K = 5)",
        },
        LadderPhase {
            name: "eagle3",
            router: kv_router,
            spec_decode: Some("eagle3"),
            description: "KV-aware routing + EAGLE-3 heads on Llama-3.3-70B (K = 5)",
        },
    ]
}

/// One hardware setup a ladder runs on.
#[derive(Debug, Clone, PartialEq)]
pub struct LadderSetup {
    /// The rows' `setup` (`h100x8-tp4`).
    pub name: &'static str,
    pub description: &'static str,
    /// A built-in hardware profile.
    pub profile: &'static str,
    pub workers: u32,
}

/// Seed 003's node (one 8×H100: two TP=4 replicas of Llama-70B FP8), then seed 002's three
/// H200s.
pub fn setups() -> Vec<LadderSetup> {
    vec![
        LadderSetup {
            name: "h100x8-tp4",
            description: "seed 003: one 8×H100 node, 2 replicas of Llama-70B FP8 at TP=4",
            profile: "h100-tp4-llama70b-fp8",
            workers: 2,
        },
        LadderSetup {
            name: "h200x3",
            description: "seed 002: 3 × H200, one Llama-3.1-70B FP8 replica each",
            profile: "h200-llama70b-fp8",
            workers: 3,
        },
    ]
}

/// The setup named `name`.
pub fn setup(name: &str) -> Option<LadderSetup> {
    setups().into_iter().find(|s| s.name == name)
}

/// One run of a ladder: what it measured and where it sits.
#[derive(Debug, Clone)]
pub struct LadderPart {
    pub setup: LadderSetup,
    pub phase: LadderPhase,
    pub spec: BenchSpec,
    /// The aggregated results of `spec` ([`crate::bench::aggregate`]).
    pub results: BenchResults,
}

/// One `results.json` for the whole ladder: every part's rows tagged with its phase and setup,
/// in the parts' order; the metadata of the first part, plus the phases and setups met.
/// `None` without parts.
pub fn merge(parts: Vec<LadderPart>) -> Option<BenchResults> {
    let mut parts = parts.into_iter();
    let first = parts.next()?;
    let mut phases: Vec<PhaseMeta> = Vec::new();
    let mut setups: Vec<Setup> = Vec::new();
    let mut routers: Vec<String> = Vec::new();
    let mut out = BenchResults {
        summary: Vec::new(),
        runs: Vec::new(),
        bench: first.results.bench.clone(),
    };
    for part in std::iter::once(first).chain(parts) {
        let gpus = part.spec.base.engine.profile.gpus();
        if !setups.iter().any(|s| s.name == part.setup.name) {
            setups.push(Setup {
                name: part.setup.name.to_string(),
                description: part.setup.description.to_string(),
                profile: part.setup.profile.to_string(),
                workers: part.setup.workers,
                gpus_per_worker: gpus,
            });
        }
        if !phases.iter().any(|p| p.name == part.phase.name) {
            phases.push(PhaseMeta {
                name: part.phase.name.to_string(),
                router: part.phase.router.name().to_string(),
                spec_decode: part.phase.spec_decode.unwrap_or("off").to_string(),
                description: part.phase.description.to_string(),
            });
        }
        let router = part.phase.router.name().to_string();
        if !routers.contains(&router) {
            routers.push(router);
        }
        let tag = |mut row: report::Row| {
            row.phase = Some(part.phase.name.to_string());
            row.setup = Some(part.setup.name.to_string());
            row
        };
        out.summary
            .extend(part.results.summary.into_iter().map(tag));
        out.runs.extend(part.results.runs.into_iter().map(tag));
    }
    out.bench.routers = routers;
    out.bench.phases = phases;
    out.bench.setups = setups;
    Some(out)
}
