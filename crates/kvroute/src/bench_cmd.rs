//! `kvroute bench`: seed 002's benchmark (routers × concurrency levels × sweeps) in virtual
//! time, with its tables, plots and the comparison against the seed's published numbers.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use report::BenchResults;
use router::PolicyKind;
use sim::bench::{BenchSpec, JobResult};
use sim::chat::{ChatJobError, run_chat_job};

use crate::sim_cmd::{ClusterArgs, parse_router, progress_bar, router_names};

#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// Concurrency levels, in the order each sweep visits them.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "60,80,100,120,140,160,180"
    )]
    pub levels: Vec<u32>,
    /// Independent sweeps per router (different seeds), averaged.
    #[arg(long, default_value_t = 6)]
    pub sweeps: u32,
    /// Simulated seconds of warmup at each level.
    #[arg(long, default_value_t = 60.0)]
    pub warmup: f64,
    /// Simulated seconds measured at each level.
    #[arg(long, default_value_t = 300.0)]
    pub window: f64,
    /// Snapshots the window is read as (averaged).
    #[arg(long, default_value_t = 3)]
    pub snapshots: u32,
    /// Seconds each snapshot's percentiles look back: 60 is the seed's Prometheus summary
    /// window; window / snapshots makes the snapshots tile the window.
    #[arg(long, default_value_t = 60.0, value_name = "SECONDS")]
    pub lookback: f64,
    /// Routers to compare; the first is the baseline of the Δ columns.
    #[arg(long, value_delimiter = ',', default_value = "round_robin,kv,kv_load", value_parser = parse_router, help = format!("Routers to compare, comma-separated ({}); the first is the baseline", router_names()))]
    pub routers: Vec<PolicyKind>,
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

pub fn run(args: BenchArgs) -> Result<()> {
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
    if args.levels.is_empty() || args.routers.is_empty() || args.sweeps == 0 {
        bail!("--levels, --routers and --sweeps need at least one value each");
    }
    let cluster = args.cluster.build()?;
    let secs = |s: f64, flag: &str| -> Result<nanotime::Nanos> {
        if !(s.is_finite() && s >= 0.0) {
            bail!("{flag} must be a number of seconds ≥ 0, got {s}");
        }
        Ok(nanotime::Nanos::from_secs_f64(s))
    };
    let spec = BenchSpec {
        routers: args.routers.clone(),
        levels: args.levels.clone(),
        sweeps: args.sweeps,
        warmup: secs(args.warmup, "--warmup")?,
        window: secs(args.window, "--window")?,
        snapshots: args.snapshots,
        lookback: Some(secs(args.lookback, "--lookback")?),
        seed: args.cluster.seed,
        continuous: !args.cold,
        base: cluster.base.clone(),
    };
    let jobs = spec.jobs();
    let threads = args
        .jobs
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .clamp(1, jobs.len().max(1));
    let phases_total: usize = jobs.iter().map(|j| j.levels.len()).sum();
    let bar = progress
        .then(|| progress_bar(phases_total as u64, "levels"))
        .flatten();

    // Independent runs on threads; each result goes back to its job's slot, so the output
    // never depends on which thread ran what.
    let next = AtomicUsize::new(0);
    let slots: Mutex<Vec<Option<Result<JobResult, ChatJobError>>>> =
        Mutex::new((0..jobs.len()).map(|_| None).collect());
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(job) = jobs.get(i) else {
                        break;
                    };
                    let result = run_chat_job(
                        &spec,
                        job,
                        &cluster.workload,
                        Arc::clone(&cluster.assets),
                        |_| {
                            if let Some(bar) = &bar {
                                bar.inc(1);
                            }
                        },
                    );
                    if let Ok(mut slots) = slots.lock() {
                        slots[i] = Some(result);
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
    let mut results = Vec::with_capacity(jobs.len());
    for (job, slot) in jobs.iter().zip(slots) {
        let result = slot.context("a simulation thread stopped early")?;
        results.push(result.with_context(|| {
            format!(
                "run of {} (sweep {}, levels {:?})",
                job.router, job.sweep, job.levels
            )
        })?);
    }
    let results = sim::bench::aggregate(&spec, results, &cluster.profile_name);
    Ok((results, spec, threads))
}

fn write_out(dir: &Path, results: &BenchResults, with_seed: bool) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let write = |name: &str, text: &str| {
        let path = dir.join(name);
        std::fs::write(&path, text).with_context(|| format!("cannot write {}", path.display()))
    };
    write(
        "results.json",
        &(serde_json::to_string_pretty(results)? + "\n"),
    )?;
    let plots = report::plots(results, with_seed);
    let names: Vec<String> = plots.iter().map(|p| p.0.clone()).collect();
    for (name, svg) in &plots {
        write(name, svg)?;
    }
    write("report.md", &report::markdown(results, &names))
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
