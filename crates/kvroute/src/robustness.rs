//! `kvroute bench --suite robustness`: every router on a grid of workload families × fleets ×
//! hardware profiles, in virtual time, and the verdict on the default policy per cell
//! (`report::robustness`).
//!
//! The grid is data: [`families`] lists each family's workloads (a name, the conversations
//! per worker at each level, and what generates the requests); a cell is one workload on one
//! fleet of one profile, run as one `kvroute bench` of every router.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use report::robustness::{CellMeta, CellPart, FamilyMeta, RobustnessMeta};
use router::PolicyKind;
use sim::bench::BenchSpec;
use workload::{Distribution, LockStep, Speed, SystemGroups, Trace, TurnRange, WorkloadConfig};

use crate::bench_cmd::{BenchArgs, run_parallel_with, write_out_with};
use crate::sim_cmd::Cluster;

/// Fleet sizes of the grid (workers).
const FLEETS: [u32; 3] = [3, 8, 32];
/// Hardware profiles of the grid.
const PROFILES: [&str; 2] = ["h200-llama70b-fp8", "dynamo-mocker"];
/// Simulated seconds of warmup and of measurement per level: short enough that the whole grid
/// runs in under 10 minutes on a 2-core machine, long enough for several turns of every
/// conversation (the seed's turns take 25–60 s).
const WARMUP_S: f64 = 30.0;
const WINDOW_S: f64 = 120.0;
/// Independent sweeps per router (seeds).
const SWEEPS: u32 = 1;
/// Conversations per worker at each level: the seed's 60 and 180 on 3 workers, scaled with
/// the fleet as ROUTING.md's 8- and 32-worker sections do.
const CHAT_LEVELS_PER_WORKER: [u32; 2] = [20, 60];
/// Lock-step conversations per worker: their prompts grow to tens of thousands of tokens, so
/// fewer fit a worker's KV cache than the seed's.
const LOCKSTEP_LEVELS_PER_WORKER: [u32; 2] = [10, 20];
/// Lock-step: new tokens per turn over the history, and the answers' lengths.
const LOCKSTEP_RATIOS: [(&str, f64); 3] = [("r0.25", 0.25), ("r1", 1.0), ("r2", 2.0)];
const LOCKSTEP_ANSWERS: [u32; 2] = [150, 800];
/// Think times between a reply and the next question, seconds.
const THINK_TIMES_S: [u32; 3] = [0, 5, 30];
/// Shared system-prompt groups: how many, and each prompt's tokens.
const GROUPS: SystemGroups = SystemGroups {
    groups: 150,
    tokens: 6_000,
};
/// Goodput's objectives: seed 002's, per request (TTFT 600 ms, mean ITL 60 ms).
const SLO: report::Slo = report::Slo::SEED_002;
/// The public trace's cells: Mooncake's conversation trace (shipped in `traces/`), its first
/// requests replayed open loop at these speeds. A slice keeps the grid inside its time budget;
/// its oracle bound is printed with each run of `kvroute sim --trace`.
const TRACE_FILE: &str = "traces/mooncake_conversation_trace.jsonl";
const TRACE_REQUESTS: usize = 2_000;
const TRACE_SPEEDS: [f64; 3] = [1.0, 2.0, 4.0];
/// "No worse than round-robin" allows this much.
const TOLERANCE: f64 = 0.05;
/// The router the default must not lose to on TTFT and TOPS, and the one it must beat on
/// goodput.
const BASELINE: PolicyKind = PolicyKind::RoundRobin;
const GOODPUT_RIVAL: PolicyKind = PolicyKind::Kv;

/// What generates a workload's requests.
#[derive(Debug, Clone)]
enum Source {
    /// The chat schedule with these settings (the seed's, or a family's).
    Chat(Box<WorkloadConfig>),
    /// The public trace's first [`TRACE_REQUESTS`] requests at this speed (one level: the
    /// trace sets its own load).
    Trace(f64),
}

/// One workload of a family.
#[derive(Debug, Clone)]
struct GridWorkload {
    name: String,
    levels_per_worker: &'static [u32],
    source: Source,
}

/// One family: one table of the report.
#[derive(Debug, Clone)]
struct Family {
    name: &'static str,
    description: String,
    workloads: Vec<GridWorkload>,
}

/// The grid's families, in report order.
fn families() -> Vec<Family> {
    let seed = WorkloadConfig::default();
    let chat = |name: String, levels: &'static [u32], config: WorkloadConfig| GridWorkload {
        name,
        levels_per_worker: levels,
        source: Source::Chat(Box::new(config)),
    };
    let lockstep = LOCKSTEP_RATIOS
        .iter()
        .flat_map(|&(tag, ratio)| {
            let seed = seed.clone();
            LOCKSTEP_ANSWERS.iter().map(move |&answer| {
                chat(
                    format!("lockstep-{tag}-a{answer}"),
                    &LOCKSTEP_LEVELS_PER_WORKER,
                    WorkloadConfig {
                        lockstep: Some(LockStep {
                            new_tokens_ratio: ratio,
                        }),
                        output_tokens: Distribution::Constant {
                            value: f64::from(answer),
                        },
                        think_time_s: Distribution::Constant { value: 0.0 },
                        turns: TurnRange { min: 4, max: 4 },
                        ..seed.clone()
                    },
                )
            })
        })
        .collect();
    let think = THINK_TIMES_S
        .iter()
        .map(|&s| {
            chat(
                format!("think-{s}s"),
                &CHAT_LEVELS_PER_WORKER,
                WorkloadConfig {
                    think_time_s: Distribution::Constant {
                        value: f64::from(s),
                    },
                    ..seed.clone()
                },
            )
        })
        .collect();
    vec![
        Family {
            name: "chat",
            description: "The seed's chat (seed 002's workload): 3–5 turns on one of 10 \
                          passages of ~3.6k tokens, ~845-token answers, no think time."
                .into(),
            workloads: vec![chat("chat".into(), &CHAT_LEVELS_PER_WORKER, seed.clone())],
        },
        Family {
            name: "lockstep",
            description: format!(
                "Lock-step multi-turn (an AIPerf-style client): 4 turns, no think time; the \
                 first turn is the seed's (passage + question), each later turn adds new \
                 user tokens of {} × (previous prompt + its answer), at most the reply \
                 generator's longest text; answers of exactly {} tokens.",
                LOCKSTEP_RATIOS.map(|r| r.1.to_string()).join(", "),
                LOCKSTEP_ANSWERS.map(|a| a.to_string()).join(" or ")
            ),
            workloads: lockstep,
        },
        Family {
            name: "think",
            description: format!(
                "The seed's chat with a constant think time of {} s between an answer and \
                 the next question (0 s is the chat family's workload).",
                THINK_TIMES_S.map(|s| s.to_string()).join(", ")
            ),
            workloads: think,
        },
        Family {
            name: "trace",
            description: format!(
                "Mooncake's FAST'25 conversation trace ({TRACE_FILE}): its first \
                 {TRACE_REQUESTS} requests (about 10 minutes), open loop at their recorded \
                 times × {} speed; prompts synthesized so that equal hash ids are equal \
                 512-token blocks. One level: the trace sets the load. Each run is measured \
                 whole, from the first arrival to 60 s after the last, as one window (not the \
                 chat's snapshots).",
                TRACE_SPEEDS.map(|s| s.to_string()).join(", ")
            ),
            workloads: TRACE_SPEEDS
                .iter()
                .map(|&speed| GridWorkload {
                    name: format!("trace-{speed}x"),
                    levels_per_worker: &[0],
                    source: Source::Trace(speed),
                })
                .collect(),
        },
        Family {
            name: "groups",
            description: format!(
                "Shared system-prompt groups: {} groups, each with its own system prompt of \
                 the instruction + {} tokens of text; each conversation draws its group \
                 uniformly and then runs the seed's turns.",
                GROUPS.groups, GROUPS.tokens
            ),
            workloads: vec![chat(
                format!("groups-{}x{}", GROUPS.groups, GROUPS.tokens),
                &CHAT_LEVELS_PER_WORKER,
                WorkloadConfig {
                    system_groups: Some(GROUPS),
                    ..seed
                },
            )],
        },
    ]
}

/// `--families`' names.
fn family_names() -> String {
    families()
        .iter()
        .map(|f| f.name)
        .collect::<Vec<_>>()
        .join(", ")
}

/// The families `args` selects, in the grid's order.
fn selected_families(args: &BenchArgs) -> Result<Vec<Family>> {
    let all = families();
    let Some(wanted) = &args.families else {
        return Ok(all);
    };
    for name in wanted {
        if !all.iter().any(|f| f.name == name.trim()) {
            bail!(
                "--families: unknown family {name:?}; the grid's families are {}",
                family_names()
            );
        }
    }
    Ok(all
        .into_iter()
        .filter(|f| wanted.iter().any(|w| w.trim() == f.name))
        .collect())
}

pub fn run(args: &BenchArgs) -> Result<()> {
    let started = Instant::now();
    let families = selected_families(args)?;
    let fleets = args.fleets.clone().unwrap_or_else(|| FLEETS.to_vec());
    let profiles = args
        .profiles
        .clone()
        .unwrap_or_else(|| PROFILES.map(str::to_string).to_vec());
    let routers = args.routers_or(&PolicyKind::ALL);
    let sweeps = args.sweeps.unwrap_or(SWEEPS);
    if families.is_empty() || fleets.is_empty() || profiles.is_empty() || routers.is_empty() {
        bail!("--families, --fleets, --profiles and --routers need at least one value each");
    }
    if sweeps == 0 {
        bail!("--sweeps must be at least 1");
    }
    if fleets.contains(&0) {
        bail!("--fleets: every fleet needs at least 1 worker");
    }
    if args
        .levels
        .as_ref()
        .is_some_and(|l| l.is_empty() || l.contains(&0))
    {
        bail!("--levels: with --suite robustness, conversations per worker, each at least 1");
    }
    for needed in [PolicyKind::DEFAULT, BASELINE, GOODPUT_RIVAL] {
        if !routers.contains(&needed) {
            eprintln!(
                "bench --suite robustness: {} is not among --routers, so the verdicts that \
                 need it are left out",
                needed.name()
            );
        }
    }

    // One cluster per (fleet, profile); one benchmark per cell.
    let mut clusters: Vec<((u32, String), Cluster)> = Vec::new();
    for profile in &profiles {
        for &workers in &fleets {
            let mut flags = args.cluster.clone();
            flags.workers = workers;
            flags.profile = profile.trim().to_string();
            flags.profile_file = None;
            let mut cluster = flags
                .build()
                .with_context(|| format!("--profiles: {profile:?}"))?;
            cluster.base.slo = Some(SLO);
            clusters.push(((workers, profile.trim().to_string()), cluster));
        }
    }
    // The trace, read once when a trace family is selected.
    let has_trace = families
        .iter()
        .flat_map(|f| &f.workloads)
        .any(|w| matches!(w.source, Source::Trace(_)));
    if has_trace && (args.snapshots.is_some() || args.lookback.is_some()) {
        eprintln!(
            "bench --suite robustness: --snapshots and --lookback apply to the other families; \
             the trace cells are measured whole, as one window over the replay"
        );
    }
    let trace = has_trace.then(load_trace).transpose()?;
    // Each cell: its shared cluster with the cell's workload, and its benchmark.
    let mut cells: Vec<(CellMeta, Cluster, BenchSpec)> = Vec::new();
    // The trace's requests that can meet the objectives at all, per profile (the fleet and
    // the speed do not change what one request alone on a warm worker gets).
    let mut within_alone: Vec<(String, sim::trace::SloCeiling)> = Vec::new();
    for family in &families {
        for w in &family.workloads {
            for ((workers, profile), shared) in &clusters {
                let per_worker = match (&w.source, &args.levels) {
                    (Source::Chat(_), Some(levels)) => levels.clone(),
                    _ => w.levels_per_worker.to_vec(),
                };
                let levels: Vec<u32> = per_worker.iter().map(|l| l * workers).collect();
                let mut cluster = shared.clone();
                let mut goodput_ceiling = None;
                let durations = match (&w.source, &trace) {
                    (Source::Chat(config), _) => {
                        config
                            .validate()
                            .with_context(|| format!("workload {}", w.name))?;
                        cluster.workload = (**config).clone();
                        (WARMUP_S, WINDOW_S)
                    }
                    (Source::Trace(speed), Some(trace)) => {
                        let speed = Speed::new(*speed).context("trace speed")?;
                        cluster.replay = Some((Arc::clone(trace), speed));
                        // The whole replay is measured, with its drain.
                        let span = sim::trace::replay_span(trace, speed);
                        // The shipped trace has no sessions, which `slo_ceiling` needs.
                        let alone = match within_alone.iter().find(|(p, _)| p == profile) {
                            Some((_, c)) => *c,
                            None => {
                                let c =
                                    sim::trace::slo_ceiling(&cluster.base, Arc::clone(trace), SLO)
                                        .with_context(|| {
                                            format!("the trace's SLO ceiling on {profile}")
                                        })?;
                                within_alone.push((profile.clone(), c));
                                c
                            }
                        };
                        goodput_ceiling = Some(report::robustness::GoodputCeiling {
                            requests: alone.requests,
                            within: alone.within,
                            rps: report::percentiles::round(alone.goodput_rps(span), 3),
                            prefill_load: report::percentiles::round(
                                alone.prefill_load(*workers, speed.scale(trace.duration())),
                                3,
                            ),
                        });
                        (0.0, span.as_secs_f64())
                    }
                    (Source::Trace(_), None) => bail!("the trace was not loaded"),
                };
                let mut spec =
                    args.spec_with(routers.clone(), &cluster, levels.clone(), sweeps, durations)?;
                if matches!(w.source, Source::Trace(_)) {
                    // The whole replay is one measurement, as `sim --trace` reads it: the
                    // chat's snapshots of the last minute would sample a third of it, the last
                    // one mostly its drain.
                    spec.snapshots = 1;
                    spec.lookback = Some(spec.window);
                }
                let meta = CellMeta {
                    name: format!("{}/{workers}w/{profile}", w.name),
                    family: family.name.to_string(),
                    workload: w.name.clone(),
                    workers: *workers,
                    profile: profile.clone(),
                    levels,
                    goodput_ceiling,
                };
                cells.push((meta, cluster, spec));
            }
        }
    }
    let refs: Vec<(&BenchSpec, &Cluster)> = cells
        .iter()
        .map(|(_, cluster, spec)| (spec, cluster))
        .collect();
    let runs: usize = cells.iter().map(|(.., s)| s.jobs().len()).sum();
    eprintln!(
        "bench --suite robustness: {} cells × {} routers = {runs} runs",
        cells.len(),
        routers.len()
    );
    let (grouped, threads) =
        run_parallel_with(&refs, args.jobs, true, Some("bench --suite robustness"))?;
    let simulated: f64 = cells
        .iter()
        .map(|(.., s)| s.simulated().as_secs_f64())
        .sum();
    let parts: Vec<CellPart> = cells
        .into_iter()
        .zip(grouped)
        .map(|((cell, cluster, spec), results)| {
            let results = sim::bench::aggregate(&spec, results, &cluster.profile_name);
            CellPart { cell, results }
        })
        .collect();
    let meta = RobustnessMeta {
        families: families
            .iter()
            .map(|f| FamilyMeta {
                name: f.name.to_string(),
                description: f.description.clone(),
            })
            .collect(),
        cells: Vec::new(),
        slo: SLO,
        default_router: PolicyKind::DEFAULT.name().to_string(),
        baseline_router: BASELINE.name().to_string(),
        goodput_rival: GOODPUT_RIVAL.name().to_string(),
        tolerance: TOLERANCE,
    };
    let mut results = report::robustness::merge(parts, meta).context("no cell to run")?;
    results.bench.path_latency_ms = Some(args.cluster.path_latency_ms);
    if let Some(dir) = &args.out {
        write_out_with(dir, &results, Vec::new(), report::robustness::markdown)?;
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&results)?);
    } else {
        print_verdicts(&results);
    }
    let wall = started.elapsed().as_secs_f64();
    eprintln!(
        "bench --suite robustness: {runs} runs on {threads} thread(s), {simulated:.0} \
         simulated s in {wall:.1} s wall ({:.0}× real time)",
        simulated / wall.max(1e-9)
    );
    Ok(())
}

/// The trace cells' slice of the shipped trace: at the path from the current directory (the
/// repository root), else from this source tree's.
fn load_trace() -> Result<Arc<Trace>> {
    let built_in = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(TRACE_FILE);
    let path = [Path::new(TRACE_FILE), built_in.as_path()]
        .into_iter()
        .find(|p| p.is_file())
        .with_context(|| {
            format!(
                "the trace family replays {TRACE_FILE}, which is not here: run from the \
                 repository root, or leave the family out with --families"
            )
        })?;
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    let trace = Trace::parse_bytes(&bytes).with_context(|| path.display().to_string())?;
    let slice = trace
        .first(TRACE_REQUESTS)
        .context("the trace has no request")?;
    Ok(Arc::new(slice))
}

/// One line per cell and level: the verdict on the default policy.
fn print_verdicts(results: &report::BenchResults) {
    let verdicts = report::robustness::verdicts(results);
    let won = verdicts.iter().filter(|(_, _, v)| v.wins()).count();
    for (cell, level, verdict) in &verdicts {
        let outcome = if verdict.wins() {
            "✓".to_string()
        } else {
            format!("✗ {}", verdict.misses.join("; "))
        };
        println!("{:<48} {:>6}  {outcome}", cell.name, level);
    }
    println!(
        "{}: wins {won} of {} cell-levels",
        PolicyKind::DEFAULT.name(),
        verdicts.len()
    );
    let others: Vec<String> = report::robustness::wins_by_router(results)
        .into_iter()
        .filter(|(router, _)| *router != PolicyKind::DEFAULT.name())
        .map(|(router, won)| format!("{router} {won}"))
        .collect();
    if !others.is_empty() {
        println!("by the same verdict: {}", others.join(", "));
    }
}
