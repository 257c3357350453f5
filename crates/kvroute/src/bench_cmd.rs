//! `kvroute bench`: seed 002's benchmark (routers × concurrency levels × sweeps) in virtual
//! time, with its tables, plots and the comparison against the seed's published numbers.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use report::BenchResults;
use router::PolicyKind;
use sim::bench::{BenchJob, BenchSpec, JobResult};
use sim::chat::run_chat_job;
use sim::ladder::{LadderPart, LadderPhase, LadderSetup};

use crate::sim_cmd::{
    Cluster, ClusterArgs, LinkArg, LinkSharingArg, parse_router, progress_bar, router_names,
};

/// Seed 002's concurrency levels, `kvroute bench`'s default.
const SEED_002_LEVELS: [u32; 7] = [60, 80, 100, 120, 140, 160, 180];
/// `--phases`' default levels: from a quiet booth to beyond the batch limit of two replicas.
const PHASE_LEVELS: [u32; 5] = [20, 40, 60, 90, 120];
/// `--phases`' default sweeps: four phases on two setups are eight benchmarks.
const PHASE_SWEEPS: u32 = 2;
/// Snapshots a window is read as, and how far each looks back: the seed's Prometheus summary
/// window.
const DEFAULT_SNAPSHOTS: u32 = 3;
const DEFAULT_LOOKBACK_SECS: f64 = 60.0;
/// `--disagg`'s default levels and sweeps, and its GPUs per layout.
const DISAGG_LEVELS: [u32; 5] = [20, 40, 80, 120, 160];
const DISAGG_SWEEPS: u32 = 2;
const DISAGG_GPUS: u32 = 4;
/// `--disagg`'s default open-loop rates, sessions per second: from light load on every 4-GPU
/// layout to past saturation of all of them (the weakest, `1p3d` on B and `3p1d` on A and C,
/// saturate below 0.5–1; a chat session is 3–5 requests).
const DISAGG_RATES: [f64; 5] = [0.25, 0.5, 1.0, 1.5, 2.0];
/// The workloads `--disagg` can run today.
/// `--disagg-workloads`: seed 004's workloads by name, and the mix each runs.
const DISAGG_WORKLOADS: [(&str, [u32; 3]); 4] = [
    ("chat", [100, 0, 0]),
    ("summarise", [0, 100, 0]),
    ("reason", [0, 0, 100]),
    ("mix", [40, 30, 30]),
];

fn disagg_workload_names() -> String {
    DISAGG_WORKLOADS.map(|(name, _)| name).join(", ")
}

#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// Concurrency levels, in the order each sweep visits them (default: seed 002's
    /// 60,80,…,180; with --phases 20,40,60,90,120; with --disagg 20,40,80,120,160).
    #[arg(long, value_delimiter = ',')]
    pub levels: Option<Vec<u32>>,
    /// Independent sweeps per router (different seeds), averaged (default 6; with --phases 2).
    #[arg(long)]
    pub sweeps: Option<u32>,
    /// Seed 003's phase ladder instead of a router comparison: baseline (round-robin) → kv
    /// (KV-aware routing) → draft (+ Llama-3.1-8B draft model) → eagle3 (+ EAGLE-3 heads), on
    /// each --setups; one report with TTFT turn 1 vs turns 2+, ITL, TOPS, acceptance, tokens
    /// per step and SLOs per phase. Give a list to run some phases only. --routers, --workers
    /// and --profile do not apply: the setups and phases fix them.
    #[arg(long, value_delimiter = ',', num_args = 0.., value_name = "PHASES",
          default_missing_values = sim::ladder::PHASES)]
    pub phases: Option<Vec<String>>,
    /// With --phases: the hardware setups (h100x8-tp4: seed 003's 8×H100 node as two TP=4
    /// replicas; h200x3: seed 002's three H200s).
    #[arg(long, value_delimiter = ',', default_value = "h100x8-tp4,h200x3")]
    pub setups: Vec<String>,
    /// Aggregated vs disaggregated fleets of the same GPU count (--gpus one-GPU workers: all
    /// aggregated, then 1 prefill + the rest decode, … up to all but one prefill), each
    /// serving --disagg-workloads at every level: TTFT and ITL p50/p95, goodput against
    /// --slo-ttft-ms and --slo-itl-ms, throughput, routes and KV transfers. --routers and
    /// --workers do not apply (--kv-router routes both pools).
    #[arg(long, conflicts_with_all = ["phases", "compare_seed002", "workers"])]
    pub disagg: bool,
    /// With --disagg: open-loop arrival rates, sessions per second (Poisson; a session is one
    /// B or C request, or an A conversation of 3–5 turns), one cold run per rate beside the
    /// closed loop's --levels. Default 0.25,0.5,1,1.5,2; giving only --levels runs the closed
    /// loop only, giving only --rates the open loop only.
    #[arg(long, value_delimiter = ',', value_name = "RPS", requires = "disagg",
          value_parser = crate::sim_cmd::parse_rate)]
    pub rates: Option<Vec<f64>>,
    /// With --disagg: the GPUs of every layout (2–16).
    #[arg(long, value_name = "N", requires = "disagg",
          value_parser = clap::value_parser!(u32).range(2..=16))]
    pub gpus: Option<u32>,
    /// With --disagg: the workloads, comma-separated: chat (A, multi-turn), summarise (B: long
    /// documents, short answers), reason (C: short prompts, long answers), mix (seed 004's
    /// A=40,B=30,C=30). Default: all four.
    #[arg(long, value_delimiter = ',', value_name = "NAMES", requires = "disagg")]
    pub disagg_workloads: Option<Vec<String>>,
    /// With --disagg: a decode worker prefills a request itself when at most this many of
    /// its prompt tokens are uncached there (default: the router's, 512).
    #[arg(long, value_name = "TOKENS", requires = "disagg")]
    pub local_prefill_max_tokens: Option<u32>,
    /// With --disagg: how KV moves from prefill to decode workers.
    #[arg(long, value_enum, default_value = "nvlink", requires = "disagg")]
    pub kv_link: LinkArg,
    /// With --disagg: whether concurrent KV transfers share each worker's link port.
    #[arg(
        long,
        value_enum,
        value_name = "MODE",
        default_value = "shared",
        requires = "disagg"
    )]
    pub kv_link_sharing: LinkSharingArg,
    /// With --disagg: goodput's TTFT objective per request (seed 004's prefill scaler
    /// threshold).
    #[arg(long, value_name = "MS", default_value_t = report::Slo::SEED_004.ttft_ms, requires = "disagg")]
    pub slo_ttft_ms: f64,
    /// With --disagg: goodput's mean-ITL objective per request (seed 004's decode scaler
    /// threshold).
    #[arg(long, value_name = "MS", default_value_t = report::Slo::SEED_004.itl_ms, requires = "disagg")]
    pub slo_itl_ms: f64,
    /// With --phases: the KV-aware router of phases kv, draft and eagle3; with --disagg, the
    /// router of both pools.
    #[arg(long, default_value_t = PolicyKind::DEFAULT, value_parser = parse_router)]
    pub kv_router: PolicyKind,
    /// Simulated seconds of warmup at each level (default 60; with --suite robustness the
    /// grid's, 30).
    #[arg(long)]
    pub warmup: Option<f64>,
    /// Simulated seconds measured at each level (default 300; with --suite robustness the
    /// grid's, 120).
    #[arg(long)]
    pub window: Option<f64>,
    /// Snapshots the window is read as (averaged) [default: 3; the robustness grid's trace
    /// cells are always read whole, as one].
    #[arg(long)]
    pub snapshots: Option<u32>,
    /// Seconds each snapshot's percentiles look back: 60 is the seed's Prometheus summary
    /// window; window / snapshots makes the snapshots tile the window [default: 60].
    #[arg(long, value_name = "SECONDS")]
    pub lookback: Option<f64>,
    /// Routers to compare; the first is the baseline of the Δ columns.
    #[arg(long, value_delimiter = ',', value_parser = parse_router, help = format!("Routers to compare, comma-separated ({}); the first is the baseline [default: round_robin,kv,kv_load; with --suite robustness every router]", router_names()))]
    pub routers: Option<Vec<PolicyKind>>,
    /// A suite of benchmarks instead of one: `robustness` runs every router on a grid of
    /// workload families (the seed's chat, lock-step multi-turn, think times, shared
    /// system-prompt groups) × fleets of 3, 8 and 32 workers × the h200-llama70b-fp8 and
    /// dynamo-mocker profiles, with concurrency proportional to the fleet, and judges the
    /// default policy in every cell (report.md). --levels then counts conversations per
    /// worker; --workers and --profile do not apply (--fleets and --profiles do).
    #[arg(long, value_enum, conflicts_with_all = ["phases", "disagg", "compare_seed002"])]
    pub suite: Option<Suite>,
    /// With --suite robustness: the workload families to run, comma-separated (default:
    /// all).
    #[arg(long, value_delimiter = ',', value_name = "NAMES", requires = "suite")]
    pub families: Option<Vec<String>>,
    /// With --suite robustness: the fleet sizes (default 3,8,32).
    #[arg(
        long,
        value_delimiter = ',',
        value_name = "WORKERS",
        requires = "suite"
    )]
    pub fleets: Option<Vec<u32>>,
    /// With --suite robustness: the hardware profiles (default
    /// h200-llama70b-fp8,dynamo-mocker).
    #[arg(long, value_delimiter = ',', value_name = "NAMES", requires = "suite")]
    pub profiles: Option<Vec<String>>,
    /// Run every level as its own cold run instead of one continuous run per sweep.
    #[arg(long)]
    pub cold: bool,
    /// Print results.json to stdout instead of the summary table.
    #[arg(long)]
    pub json: bool,
    /// Write results.json, report.md and SVG plots into this directory.
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Runs simulated at once, on threads (default: the machine's cores). The results do not
    /// depend on it.
    #[arg(long)]
    pub jobs: Option<usize>,
    /// Print our round-robin and KV numbers beside seed 002's published tables, and draw the
    /// seed's lines in the plots.
    #[arg(long)]
    pub compare_seed002: bool,
    #[command(flatten)]
    pub cluster: ClusterArgs,
}

/// The named suites of `--suite`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Suite {
    /// Every router on workload families × fleets × profiles.
    Robustness,
}

/// `--routers`' default outside a suite.
const DEFAULT_ROUTERS: [PolicyKind; 3] =
    [PolicyKind::RoundRobin, PolicyKind::Kv, PolicyKind::KvLoad];

impl BenchArgs {
    /// The routers given, else `default`.
    pub(crate) fn routers_or(&self, default: &[PolicyKind]) -> Vec<PolicyKind> {
        self.routers.clone().unwrap_or_else(|| default.to_vec())
    }

    fn levels(&self) -> Vec<u32> {
        let default: &[u32] = if self.phases.is_some() {
            &PHASE_LEVELS
        } else if self.disagg {
            &DISAGG_LEVELS
        } else {
            &SEED_002_LEVELS
        };
        self.levels.clone().unwrap_or_else(|| default.to_vec())
    }

    fn sweeps(&self) -> u32 {
        let default = if self.phases.is_some() {
            PHASE_SWEEPS
        } else if self.disagg {
            DISAGG_SWEEPS
        } else {
            6
        };
        self.sweeps.unwrap_or(default)
    }

    /// The benchmark of `routers` on `cluster`.
    fn spec(&self, routers: Vec<PolicyKind>, cluster: &Cluster) -> Result<BenchSpec> {
        self.spec_with(
            routers,
            cluster,
            self.levels(),
            self.sweeps(),
            (60.0, 300.0),
        )
    }

    /// The benchmark of `routers` on `cluster` at `levels`, with `sweeps` and the
    /// (warmup, window) seconds `durations` unless --warmup and --window are given.
    pub(crate) fn spec_with(
        &self,
        routers: Vec<PolicyKind>,
        cluster: &Cluster,
        levels: Vec<u32>,
        sweeps: u32,
        durations: (f64, f64),
    ) -> Result<BenchSpec> {
        let secs = |s: f64, flag: &str| -> Result<nanotime::Nanos> {
            if !(s.is_finite() && s >= 0.0) {
                bail!("{flag} must be a number of seconds ≥ 0, got {s}");
            }
            Ok(nanotime::Nanos::from_secs_f64(s))
        };
        Ok(BenchSpec {
            routers,
            levels,
            sweeps,
            warmup: secs(self.warmup.unwrap_or(durations.0), "--warmup")?,
            window: secs(self.window.unwrap_or(durations.1), "--window")?,
            snapshots: self.snapshots.unwrap_or(DEFAULT_SNAPSHOTS),
            lookback: Some(secs(
                self.lookback.unwrap_or(DEFAULT_LOOKBACK_SECS),
                "--lookback",
            )?),
            seed: self.cluster.seed,
            continuous: !self.cold,
            base: cluster.base.clone(),
        })
    }
}

pub fn run(args: BenchArgs) -> Result<()> {
    if let Some(Suite::Robustness) = args.suite {
        return crate::robustness::run(&args);
    }
    if args.phases.is_some() {
        return run_phases(&args);
    }
    if args.disagg {
        return run_disagg(&args);
    }
    let started = Instant::now();
    let (results, spec, threads) = simulate(&args, true)?;
    let wall = started.elapsed().as_secs_f64();

    if let Some(dir) = &args.out {
        write_out(dir, &results, args.compare_seed002)?;
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&results)?);
    } else {
        print_summary(&results);
    }
    if args.compare_seed002 {
        println!("\n{}", report::compare_seed_002(&results));
    }
    let simulated = spec.simulated().as_secs_f64();
    eprintln!(
        "bench: {} runs on {threads} thread(s), {simulated:.0} simulated s in {wall:.1} s wall \
         ({:.0}× real time)",
        spec.jobs().len(),
        simulated / wall.max(1e-9)
    );
    Ok(())
}

/// Runs the benchmark's simulations (on threads, with a progress bar when `progress`) and
/// aggregates them: `results.json`'s content.
/// Also says on how many threads.
pub fn simulate(args: &BenchArgs, progress: bool) -> Result<(BenchResults, BenchSpec, usize)> {
    let routers = args.routers_or(&DEFAULT_ROUTERS);
    if args.levels().is_empty() || routers.is_empty() || args.sweeps() == 0 {
        bail!("--levels, --routers and --sweeps need at least one value each");
    }
    let cluster = args.cluster.build()?;
    let spec = args.spec(routers, &cluster)?;
    let (mut grouped, threads) = run_parallel(&[(&spec, &cluster)], args.jobs, progress)?;
    let results = grouped.pop().unwrap_or_default();
    let results = sim::bench::aggregate(&spec, results, &cluster.profile_name);
    Ok((results, spec, threads))
}

/// Runs every job of every benchmark on threads (with a progress bar when `progress`) and
/// returns each benchmark's results in job order, and how many threads ran them.
fn run_parallel(
    benches: &[(&BenchSpec, &Cluster)],
    jobs: Option<usize>,
    progress: bool,
) -> Result<(Vec<Vec<JobResult>>, usize)> {
    run_parallel_with(benches, jobs, progress, None)
}

/// [`run_parallel`]; where stderr is no terminal (no bar), a line `label: run i of n done`
/// per finished run when `label` is given.
pub(crate) fn run_parallel_with(
    benches: &[(&BenchSpec, &Cluster)],
    jobs: Option<usize>,
    progress: bool,
    label: Option<&str>,
) -> Result<(Vec<Vec<JobResult>>, usize)> {
    let tasks: Vec<(usize, BenchJob)> = benches
        .iter()
        .enumerate()
        .flat_map(|(b, (spec, _))| spec.jobs().into_iter().map(move |job| (b, job)))
        .collect();
    let threads = jobs
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .clamp(1, tasks.len().max(1));
    let phases_total: usize = tasks.iter().map(|(_, j)| j.levels.len()).sum();
    let bar = progress
        .then(|| progress_bar(phases_total as u64, "levels"))
        .flatten();

    // Independent runs on threads; each result goes back to its task's slot, so the output
    // never depends on which thread ran what.
    let next = AtomicUsize::new(0);
    let done = AtomicUsize::new(0);
    let lines = label.filter(|_| progress && bar.is_none());
    let slots: Mutex<Vec<Option<Result<JobResult>>>> =
        Mutex::new((0..tasks.len()).map(|_| None).collect());
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some((b, job)) = tasks.get(i) else {
                        break;
                    };
                    let (spec, cluster) = benches[*b];
                    let tick = |_| {
                        if let Some(bar) = &bar {
                            bar.inc(1);
                        }
                    };
                    let result = match &cluster.replay {
                        Some((trace, speed)) => {
                            sim::trace::run_trace_job(spec, job, Arc::clone(trace), *speed, tick)
                                .map_err(anyhow::Error::from)
                        }
                        None => run_chat_job(
                            spec,
                            job,
                            &cluster.workload,
                            Arc::clone(&cluster.assets),
                            tick,
                        )
                        .map_err(anyhow::Error::from),
                    };
                    if let Ok(mut slots) = slots.lock() {
                        slots[i] = Some(result);
                    }
                    if let Some(label) = lines {
                        let finished = done.fetch_add(1, Ordering::Relaxed) + 1;
                        eprintln!("{label}: run {finished} of {} done", tasks.len());
                    }
                }
            });
        }
    });
    if let Some(bar) = &bar {
        bar.finish_and_clear();
    }
    let slots = slots
        .into_inner()
        .map_err(|_| anyhow::anyhow!("a simulation thread panicked"))?;
    let mut grouped: Vec<Vec<JobResult>> = benches.iter().map(|_| Vec::new()).collect();
    for ((b, job), slot) in tasks.iter().zip(slots) {
        let result = slot.context("a simulation thread stopped early")?;
        grouped[*b].push(result.with_context(|| {
            format!(
                "run of {} (sweep {}, levels {:?})",
                job.router, job.sweep, job.levels
            )
        })?);
    }
    Ok((grouped, threads))
}

/// `--phases`: seed 003's ladder on each setup, one results.json and report.
fn run_phases(args: &BenchArgs) -> Result<()> {
    let started = Instant::now();
    if args.compare_seed002 {
        bail!(
            "--compare-seed002 compares routers with seed 002's tables; it does not apply to --phases"
        );
    }
    let wanted = args.phases.clone().unwrap_or_default();
    for name in &wanted {
        if !sim::ladder::PHASES.contains(&name.as_str()) {
            bail!(
                "--phases: unknown phase {name:?}; the ladder's phases are {}",
                sim::ladder::PHASES.join(", ")
            );
        }
    }
    let ladder: Vec<LadderPhase> = sim::ladder::ladder(args.kv_router)
        .into_iter()
        .filter(|p| wanted.is_empty() || wanted.iter().any(|w| w == p.name))
        .collect();
    let mut setups: Vec<LadderSetup> = Vec::new();
    for name in &args.setups {
        let setup = sim::ladder::setup(name.trim()).with_context(|| {
            let known: Vec<&str> = sim::ladder::setups().iter().map(|s| s.name).collect();
            format!(
                "--setups: unknown setup {name:?}; known: {}",
                known.join(", ")
            )
        })?;
        setups.push(setup);
    }
    if setups.is_empty() || args.levels().is_empty() || args.sweeps() == 0 {
        bail!("--setups, --levels and --sweeps need at least one value each");
    }
    // One cluster per setup; one benchmark per (setup, phase).
    let mut clusters = Vec::new();
    for setup in &setups {
        let mut cluster = args.cluster.clone();
        cluster.workers = setup.workers;
        cluster.profile = setup.profile.to_string();
        cluster.profile_file = None;
        cluster.spec.spec_decode = "off".into();
        cluster.spec.draft_len = None;
        cluster.spec.acceptance_rate = None;
        let mut built = cluster.build()?;
        built.base.extended_metrics = true;
        clusters.push(built);
    }
    let mut benches = Vec::new();
    for (setup, cluster) in setups.iter().zip(&clusters) {
        for phase in &ladder {
            let mut spec = args.spec(vec![phase.router], cluster)?;
            spec.base.router.policy = phase.router;
            if let Some(name) = phase.spec_decode {
                // The ladder names the configuration; --draft-len and --acceptance-rate still
                // override it.
                let mut flags = args.cluster.spec.clone();
                flags.spec_decode = name.to_string();
                spec.base.engine.spec_decode = flags.resolve(&spec.base.engine)?;
            } else {
                spec.base.engine.spec_decode = None;
            }
            benches.push((setup.clone(), phase.clone(), spec));
        }
    }
    let refs: Vec<(&BenchSpec, &Cluster)> = benches
        .iter()
        .map(|(setup, _, spec)| {
            let i = setups.iter().position(|s| s == setup).unwrap_or(0);
            (spec, &clusters[i])
        })
        .collect();
    let (grouped, threads) = run_parallel(&refs, args.jobs, true)?;
    let simulated: f64 = benches
        .iter()
        .map(|(_, _, spec)| spec.simulated().as_secs_f64())
        .sum();
    let runs: usize = benches.iter().map(|(_, _, s)| s.jobs().len()).sum();
    let parts: Vec<LadderPart> = benches
        .into_iter()
        .zip(grouped)
        .map(|((setup, phase, spec), results)| {
            let results = sim::bench::aggregate(&spec, results, setup.profile);
            LadderPart {
                setup,
                phase,
                spec,
                results,
            }
        })
        .collect();
    let mut results = sim::ladder::merge(parts).context("no phase to run")?;
    results.bench.path_latency_ms = Some(args.cluster.path_latency_ms);
    if let Some(dir) = &args.out {
        write_out_with(
            dir,
            &results,
            report::ladder::plots(&results),
            report::ladder::markdown,
        )?;
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&results)?);
    } else {
        print_ladder(&results);
    }
    let wall = started.elapsed().as_secs_f64();
    eprintln!(
        "bench --phases: {runs} runs on {threads} thread(s), {simulated:.0} simulated s in \
         {wall:.1} s wall ({:.0}× real time)",
        simulated / wall.max(1e-9)
    );
    Ok(())
}

/// `--disagg`: every layout of --gpus GPUs on every workload, one results.json and report.
fn run_disagg(args: &BenchArgs) -> Result<()> {
    let started = Instant::now();
    let workloads = args
        .disagg_workloads
        .clone()
        .unwrap_or_else(|| DISAGG_WORKLOADS.iter().map(|w| w.0.to_string()).collect());
    let mut mixes = Vec::new();
    for w in &workloads {
        let Some((_, [a, b, c])) = DISAGG_WORKLOADS.iter().find(|(name, _)| *name == w.trim())
        else {
            bail!(
                "--disagg-workloads: unknown workload {w:?}; known: {}",
                disagg_workload_names()
            );
        };
        mixes.push(workload::Mix::new(*a, *b, *c)?);
    }
    for (flag, v) in [
        ("--slo-ttft-ms", args.slo_ttft_ms),
        ("--slo-itl-ms", args.slo_itl_ms),
    ] {
        if !(v.is_finite() && v > 0.0) {
            bail!("{flag} must be a number of milliseconds > 0, got {v}");
        }
    }
    // What is named runs: both loops by default, else only the one(s) given.
    let levels = match (&args.levels, &args.rates) {
        (None, Some(_)) => Vec::new(),
        _ => args.levels(),
    };
    let rates = match (&args.levels, &args.rates) {
        (_, Some(rates)) => rates.clone(),
        (Some(_), None) => Vec::new(),
        (None, None) => DISAGG_RATES.to_vec(),
    };
    for (k, rate) in rates.iter().enumerate() {
        if rates[..k].contains(rate) {
            bail!("--rates: {rate} is given twice; give each rate once");
        }
    }
    if workloads.is_empty() || (levels.is_empty() && rates.is_empty()) || args.sweeps() == 0 {
        bail!("--disagg-workloads, --levels or --rates, and --sweeps need at least one value each");
    }
    let slo = report::Slo {
        ttft_ms: args.slo_ttft_ms,
        itl_ms: args.slo_itl_ms,
    };
    let kv_link: engine::KvLink = args.kv_link.into();
    let threshold = args
        .local_prefill_max_tokens
        .unwrap_or(router::DisaggConfig::default().local_prefill_max_tokens);
    let layouts = sim::disagg::equal_gpu_layouts(args.gpus.unwrap_or(DISAGG_GPUS));
    // One cluster per (workload, layout), workload-major; one benchmark each.
    let mut clusters = Vec::new();
    for (mix, layout) in mixes
        .iter()
        .flat_map(|m| layouts.iter().map(move |l| (m, l)))
    {
        let mut cluster = args.cluster.clone();
        cluster.workers = layout.gpus;
        let mut built = cluster.build()?;
        built.workload.mix = *mix;
        built.base.extended_metrics = true;
        built.base.slo = Some(slo);
        if layout.aggregated == 0 {
            built.base.disagg = Some(sim::DisaggSetup {
                prefill_workers: layout.prefill,
                decode_workers: layout.decode,
                local_prefill_max_tokens: threshold,
                kv_link,
                shared_links: args.kv_link_sharing.shared(),
            });
        }
        clusters.push(built);
    }
    // One benchmark per (workload, layout) for the closed loop, and one per rate on top: an
    // open-loop run of one level, its cluster's workload set to the rate (the level's
    // concurrency does not apply there).
    let disagg_spec = |cluster: &Cluster, levels: Vec<u32>| -> Result<BenchSpec> {
        let mut spec = args.spec_with(
            vec![args.kv_router],
            cluster,
            levels,
            args.sweeps(),
            (60.0, 300.0),
        )?;
        spec.base.router.policy = args.kv_router;
        Ok(spec)
    };
    let mut open_clusters: Vec<Cluster> = Vec::new();
    let mut benches = Vec::new();
    for (w, workload) in workloads.iter().enumerate() {
        for (l, layout) in layouts.iter().enumerate() {
            let i = w * layouts.len() + l;
            let name = workload.trim().to_string();
            if !levels.is_empty() {
                let spec = disagg_spec(&clusters[i], levels.clone())?;
                benches.push((Source::Closed(i), layout.clone(), name.clone(), None, spec));
            }
            for &rate in &rates {
                let mut cluster = clusters[i].clone();
                cluster.workload.rate_rps = Some(rate);
                let spec = disagg_spec(&cluster, vec![0])?;
                open_clusters.push(cluster);
                let o = open_clusters.len() - 1;
                benches.push((
                    Source::Open(o),
                    layout.clone(),
                    name.clone(),
                    Some(rate),
                    spec,
                ));
            }
        }
    }
    let cluster_of = |source: &Source| match *source {
        Source::Closed(i) => &clusters[i],
        Source::Open(o) => &open_clusters[o],
    };
    let refs: Vec<(&BenchSpec, &Cluster)> = benches
        .iter()
        .map(|(source, _, _, _, spec)| (spec, cluster_of(source)))
        .collect();
    let (grouped, threads) = run_parallel(&refs, args.jobs, true)?;
    let simulated: f64 = benches
        .iter()
        .map(|(.., spec)| spec.simulated().as_secs_f64())
        .sum();
    let runs: usize = benches.iter().map(|(.., s)| s.jobs().len()).sum();
    let parts: Vec<sim::disagg::DisaggPart> = benches
        .into_iter()
        .zip(grouped)
        .map(|((source, layout, workload, rate_rps, spec), results)| {
            let results = sim::bench::aggregate(&spec, results, &cluster_of(&source).profile_name);
            sim::disagg::DisaggPart {
                layout,
                workload,
                rate_rps,
                spec,
                results,
            }
        })
        .collect();
    let meta = sim::disagg::DisaggBench {
        slo,
        local_prefill_max_tokens: threshold,
        kv_link,
        shared_links: args.kv_link_sharing.shared(),
    };
    let mut results = sim::disagg::merge(parts, &meta).context("no layout to run")?;
    results.bench.path_latency_ms = Some(args.cluster.path_latency_ms);
    if let Some(dir) = &args.out {
        write_out_with(
            dir,
            &results,
            report::disagg::plots(&results),
            report::disagg::markdown,
        )?;
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&results)?);
    } else {
        print_disagg(&results);
    }
    let wall = started.elapsed().as_secs_f64();
    eprintln!(
        "bench --disagg: {runs} runs on {threads} thread(s), {simulated:.0} simulated s in \
         {wall:.1} s wall ({:.0}× real time)",
        simulated / wall.max(1e-9)
    );
    Ok(())
}

/// Which cluster a `--disagg` benchmark runs on: a (workload, layout)'s closed-loop one, or
/// an open-loop copy at one rate.
enum Source {
    Closed(usize),
    Open(usize),
}

fn print_disagg(results: &BenchResults) {
    let Some(d) = &results.bench.disagg else {
        return;
    };
    let o = |v: Option<f64>, dec: usize| v.map_or("–".to_string(), |x| format!("{x:.dec$}"));
    println!(
        "goodput: requests with TTFT ≤ {:.0} ms and mean ITL ≤ {:.0} ms, per second",
        d.slo.ttft_ms, d.slo.itl_ms
    );
    for workload in &d.workloads {
        println!("{workload}:");
        println!(
            "  {:>9}  {:<6} {:>8} {:>8}  {:>8} {:>8}  {:>8} {:>6}  {:>7} {:>6}  {:>13}",
            "load",
            "layout",
            "TTFT p50",
            "p95 ms",
            "ITL p50",
            "p95 ms",
            "goodput",
            "met",
            "TOPS",
            "RPS",
            "split/local"
        );
        for load in report::disagg::loads(results) {
            for layout in &d.layouts {
                let Some(r) = report::disagg::row(results, workload, &layout.name, load) else {
                    continue;
                };
                let m = &r.metrics;
                let s = m.serving.clone().unwrap_or_default();
                println!(
                    "  {:>9}  {:<6} {:>8} {:>8}  {:>8} {:>8}  {:>8.2} {:>5}%  {:>7.0} {:>6.2}  {:>13}",
                    load.label(),
                    layout.name,
                    o(m.ttft_ms.p50, 0),
                    o(m.ttft_ms.p95, 0),
                    o(m.itl_ms.p50, 1),
                    o(m.itl_ms.p95, 1),
                    s.goodput_rps,
                    o(s.goodput_share.map(|g| g * 100.0), 0),
                    m.output_tokens_per_s,
                    m.requests_per_s,
                    if s.routed() > 0.0 {
                        format!("{:.0}/{:.0}", s.split, s.routed() - s.split)
                    } else {
                        "–".to_string()
                    },
                );
            }
        }
    }
}

fn print_ladder(results: &BenchResults) {
    let o = |v: Option<f64>, d: usize| v.map_or("–".to_string(), |x| format!("{x:.d$}"));
    for setup in &results.bench.setups {
        println!("{}: {}", setup.name, setup.description);
        println!(
            "  {:>5}  {:<9} {:>9} {:>9}  {:>8} {:>8}  {:>7} {:>7}  {:>7}  {:>6} {:>6}",
            "conc",
            "phase",
            "TTFT t1",
            "t2+ p50",
            "ITL p50",
            "p95 ms",
            "TPOT95",
            "TOPS",
            "KV hit",
            "accept",
            "tok/st"
        );
        for &level in &results.bench.levels {
            for phase in &results.bench.phases {
                let Some(r) = report::ladder::rows(results, &setup.name, &phase.name)
                    .into_iter()
                    .find(|r| r.concurrency == level)
                else {
                    continue;
                };
                let m = &r.metrics;
                println!(
                    "  {:>5}  {:<9} {:>9} {:>9}  {:>8} {:>8}  {:>7} {:>7.0}  {:>6}%  {:>5}% {:>6}",
                    level,
                    phase.name,
                    o(m.ttft_turn1_ms.and_then(|p| p.p50), 0),
                    o(m.ttft_later_ms.and_then(|p| p.p50), 0),
                    o(m.itl_ms.p50, 1),
                    o(m.itl_ms.p95, 1),
                    o(m.tpot_ms.p95, 1),
                    m.output_tokens_per_s,
                    o(m.kv_hit_rate.map(|h| h * 100.0), 1),
                    o(m.acceptance_rate.map(|a| a * 100.0), 1),
                    o(m.tokens_per_step, 2),
                );
            }
        }
    }
}

fn write_out(dir: &Path, results: &BenchResults, with_seed: bool) -> Result<()> {
    write_out_with(
        dir,
        results,
        report::plots(results, with_seed),
        report::markdown,
    )
}

/// `DIR/results.json`, the plots (`(file name, SVG)`) and `DIR/report.md`, whose Markdown
/// links the plots by name.
pub(crate) fn write_out_with(
    dir: &Path,
    results: &BenchResults,
    plots: Vec<(String, String)>,
    markdown: impl Fn(&BenchResults, &[String]) -> String,
) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let write = |name: &str, text: &str| {
        let path = dir.join(name);
        std::fs::write(&path, text).with_context(|| format!("cannot write {}", path.display()))
    };
    write(
        "results.json",
        &(serde_json::to_string_pretty(results)? + "\n"),
    )?;
    let names: Vec<String> = plots.iter().map(|p| p.0.clone()).collect();
    for (name, svg) in &plots {
        write(name, svg)?;
    }
    write("report.md", &markdown(results, &names))
}

fn print_summary(results: &BenchResults) {
    println!(
        "{:<12} {:>5}  {:>8} {:>8}  {:>8} {:>7}  {:>8}  {:>8} {:>6}  {:>6} {:>6}  {:>6}",
        "router",
        "conc",
        "TTFT p50",
        "p95 ms",
        "TPOT p95",
        "ITL p50",
        "E2E p50",
        "TOPS",
        "RPS",
        "hit",
        "oracle",
        "errors"
    );
    let o = |v: Option<f64>, d: usize| v.map_or("–".to_string(), |x| format!("{x:.d$}"));
    for r in &results.summary {
        println!(
            "{:<12} {:>5}  {:>8} {:>8}  {:>8} {:>7}  {:>8}  {:>8.1} {:>6.2}  {:>5}% {:>5}%  {:>6.1}",
            r.router,
            r.concurrency,
            o(r.metrics.ttft_ms.p50, 0),
            o(r.metrics.ttft_ms.p95, 0),
            o(r.metrics.tpot_ms.p95, 1),
            o(r.metrics.itl_ms.p50, 1),
            o(r.metrics.e2e_s.p50, 1),
            r.metrics.output_tokens_per_s,
            r.metrics.requests_per_s,
            o(r.metrics.kv_hit_rate.map(|h| h * 100.0), 1),
            o(r.metrics.oracle_hit_rate.map(|h| h * 100.0), 1),
            r.metrics.errors
        );
    }
}
