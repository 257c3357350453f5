//! Seed 002's benchmark as independent runs, and their results as the JSON contract's rows.
//!
//! Method (seed 002, "Benchmarking Methodology"): for each router, `sweeps` independent
//! sweeps over the concurrency levels; at each level a warmup (60 s), then a measurement
//! window (300 s) read as snapshots (3 × 100 s) that are averaged; the sweeps are averaged.
//!
//! By default a sweep is one continuous run that moves through the levels in order, as the
//! seed's operator moved the slider (the caches and conversations of one level carry into the
//! next; the warmup absorbs the change). With `continuous = false` every level is its own cold
//! run. Sweep `s` uses seed `derive_seed(seed, s)` for every router, so the routers face the
//! same conversations (common random numbers).
//!
//! [`BenchSpec::jobs`] lists the independent runs; a caller may run them on threads (this
//! crate starts none) and hand the results to [`aggregate`], which orders them by job index,
//! so the output never depends on scheduling. Every float in a [`Row`] is rounded to a fixed
//! number of decimals, so `results.json` is byte-identical for the same command.

use nanotime::Nanos;
use router::PolicyKind;
use serde::Serialize;

use crate::config::{Phase, SimConfig};
use crate::driver::{PhaseResult, RunTotals, SimError, Simulation, derive_seed};
use crate::metrics::{Metrics, Percentiles};
use crate::workload::Workload;

/// The benchmark to run.
#[derive(Debug, Clone)]
pub struct BenchSpec {
    /// Routers to compare, in report order (the first is the baseline of Δ columns).
    pub routers: Vec<PolicyKind>,
    /// Concurrency levels, in the order a sweep visits them.
    pub levels: Vec<u32>,
    pub sweeps: u32,
    pub warmup: Nanos,
    pub window: Nanos,
    pub snapshots: u32,
    /// What each snapshot covers (see [`Phase`]); the seed's summary window is 60 s.
    pub lookback: Option<Nanos>,
    pub seed: u64,
    /// Levels back to back in one run per sweep (seed method) or one cold run per level.
    pub continuous: bool,
    /// Fleet, engine, router and frontend settings; `router.policy` and `seed` are set per job.
    pub base: SimConfig,
}

/// One independent run of the benchmark.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BenchJob {
    /// Position in [`BenchSpec::jobs`]; results are ordered by it.
    pub index: usize,
    pub router: PolicyKind,
    pub sweep: u32,
    pub seed: u64,
    /// The levels this run visits, in order.
    pub levels: Vec<u32>,
}

impl BenchSpec {
    /// The independent runs, router-major then sweep then level.
    pub fn jobs(&self) -> Vec<BenchJob> {
        let mut jobs = Vec::new();
        for &router in &self.routers {
            for sweep in 0..self.sweeps {
                let seed = derive_seed(self.seed, u64::from(sweep));
                if self.continuous {
                    jobs.push(BenchJob {
                        index: jobs.len(),
                        router,
                        sweep,
                        seed,
                        levels: self.levels.clone(),
                    });
                } else {
                    for (i, &level) in self.levels.iter().enumerate() {
                        jobs.push(BenchJob {
                            index: jobs.len(),
                            router,
                            sweep,
                            seed: derive_seed(seed, 1000 + i as u64),
                            levels: vec![level],
                        });
                    }
                }
            }
        }
        jobs
    }

    /// The phases of a job's run.
    pub fn phases(&self, job: &BenchJob) -> Vec<Phase> {
        job.levels
            .iter()
            .map(|&concurrency| Phase {
                concurrency,
                warmup: self.warmup,
                window: self.window,
                snapshots: self.snapshots,
                lookback: self.lookback,
            })
            .collect()
    }

    /// The simulator settings of a job's run.
    pub fn config(&self, job: &BenchJob) -> SimConfig {
        let mut cfg = self.base.clone();
        cfg.router.policy = job.router;
        cfg.seed = job.seed;
        cfg
    }

    /// Simulated time of the whole benchmark.
    pub fn simulated(&self) -> Nanos {
        let per_level = self.warmup + self.window;
        per_level.saturating_mul(
            (self.routers.len() * self.levels.len()) as u64 * u64::from(self.sweeps),
        )
    }
}

/// What one job produced.
#[derive(Debug, Clone)]
pub struct JobResult {
    pub job: BenchJob,
    pub phases: Vec<PhaseResult>,
    pub totals: RunTotals,
}

/// Runs one job with `workload` (built for the job's seed and first level);
/// `progress(k)` after each level.
pub fn run_job<W: Workload>(
    spec: &BenchSpec,
    job: &BenchJob,
    workload: W,
    progress: impl FnMut(usize),
) -> Result<JobResult, SimError> {
    let sim = Simulation::new(spec.config(job), workload, spec.phases(job))?;
    let out = sim.run(progress)?;
    Ok(JobResult {
        job: job.clone(),
        phases: out.phases,
        totals: out.totals,
    })
}

/// p50 / p95 of one metric in a row, rounded; `null` when no request was observed.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Pct {
    pub p50: Option<f64>,
    pub p95: Option<f64>,
}

/// How evenly a run spread its load.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Balance {
    /// Busiest worker's routed requests over the mean (1.0 = perfectly even).
    pub request_skew: f64,
    /// Highest time-averaged in-flight count over the mean (the seed's "mean inflight skew").
    pub in_flight_skew: f64,
    /// Largest in-flight count any worker reached.
    pub peak_in_flight: f64,
    /// Mean GPU utilisation over the workers.
    pub utilisation: f64,
}

/// One worker's share of a run (runs only).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WorkerRow {
    pub worker: u32,
    pub routed: u64,
    pub peak_in_flight: u32,
    pub mean_in_flight: f64,
    pub utilisation: f64,
    pub prefill_tokens: u64,
    pub preemptions: u64,
}

/// A line of `results.json` (the dashboard's contract): one router at one level, for one run
/// (`runs`, with `seed`) or averaged over the sweeps (`summary`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Row {
    pub router: String,
    pub workers: u32,
    pub concurrency: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sweep: Option<u32>,
    /// Sweeps averaged (summary rows).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sweeps: Option<u32>,
    pub ttft_ms: Pct,
    pub tpot_ms: Pct,
    pub itl_ms: Pct,
    pub e2e_s: Pct,
    pub output_tokens_per_s: f64,
    pub requests_per_s: f64,
    pub kv_hit_rate: Option<f64>,
    pub oracle_hit_rate: Option<f64>,
    /// Failed turns per snapshot window.
    pub errors: f64,
    /// Finished requests per snapshot window.
    pub requests: f64,
    pub mean_prompt_tokens: Option<f64>,
    pub mean_output_tokens: Option<f64>,
    pub balance: Balance,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub per_worker: Vec<WorkerRow>,
}

/// `results.json`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BenchResults {
    pub summary: Vec<Row>,
    pub runs: Vec<Row>,
    pub bench: BenchMeta,
}

/// How the results were produced (no wall times: the file is byte-identical per command).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BenchMeta {
    pub routers: Vec<String>,
    pub levels: Vec<u32>,
    pub sweeps: u32,
    pub workers: u32,
    pub profile: String,
    pub warmup_s: f64,
    pub window_s: f64,
    pub snapshots: u32,
    pub snapshot_lookback_s: f64,
    pub seed: u64,
    pub continuous: bool,
    pub coalesce_decode: bool,
    pub kv_event_delay_ms: f64,
    /// Seconds after which the oracle forgets an unseen block (`null`: never).
    pub oracle_horizon_s: Option<f64>,
    pub percentiles: &'static str,
}

fn round(x: f64, decimals: i32) -> f64 {
    let f = 10f64.powi(decimals);
    let r = (x * f).round() / f;
    if r == 0.0 { 0.0 } else { r } // no "-0.0"
}

fn round_opt(x: Option<f64>, decimals: i32) -> Option<f64> {
    x.filter(|v| v.is_finite()).map(|v| round(v, decimals))
}

fn pct(p: &Percentiles, decimals: i32) -> Pct {
    Pct {
        p50: round_opt(p.p50, decimals),
        p95: round_opt(p.p95, decimals),
    }
}

fn balance_of(phase: &PhaseResult) -> Balance {
    let w = &phase.workers;
    let n = w.len().max(1) as f64;
    let skew = |v: Vec<f64>| {
        let mean = v.iter().sum::<f64>() / n;
        let max = v.iter().copied().fold(0.0, f64::max);
        if mean > 0.0 { max / mean } else { 1.0 }
    };
    Balance {
        request_skew: skew(w.iter().map(|s| s.routed as f64).collect()),
        in_flight_skew: skew(w.iter().map(|s| s.mean_in_flight).collect()),
        peak_in_flight: w
            .iter()
            .map(|s| f64::from(s.peak_in_flight))
            .fold(0.0, f64::max),
        utilisation: w.iter().map(|s| s.utilisation).sum::<f64>() / n,
    }
}

fn mean_balance(all: &[Balance]) -> Balance {
    let n = all.len().max(1) as f64;
    let avg = |f: fn(&Balance) -> f64| all.iter().map(f).sum::<f64>() / n;
    Balance {
        request_skew: avg(|b| b.request_skew),
        in_flight_skew: avg(|b| b.in_flight_skew),
        peak_in_flight: avg(|b| b.peak_in_flight),
        utilisation: avg(|b| b.utilisation),
    }
}

fn rounded_balance(b: &Balance) -> Balance {
    Balance {
        request_skew: round(b.request_skew, 4),
        in_flight_skew: round(b.in_flight_skew, 4),
        peak_in_flight: round(b.peak_in_flight, 2),
        utilisation: round(b.utilisation, 4),
    }
}

/// Builds a row from (unrounded) metrics, rounding every float.
#[allow(clippy::too_many_arguments)]
fn row(
    router: PolicyKind,
    workers: u32,
    concurrency: u32,
    seed: Option<u64>,
    sweep: Option<u32>,
    sweeps: Option<u32>,
    m: &Metrics,
    balance: &Balance,
    per_worker: Vec<WorkerRow>,
) -> Row {
    Row {
        router: router.name().to_string(),
        workers,
        concurrency,
        seed,
        sweep,
        sweeps,
        ttft_ms: pct(&m.ttft_ms, 3),
        tpot_ms: pct(&m.tpot_ms, 3),
        itl_ms: pct(&m.itl_ms, 3),
        e2e_s: pct(&m.e2e_s, 4),
        output_tokens_per_s: round(m.output_tokens_per_s, 3),
        requests_per_s: round(m.requests_per_s, 5),
        kv_hit_rate: round_opt(m.kv_hit_rate, 5),
        oracle_hit_rate: round_opt(m.oracle_hit_rate, 5),
        errors: round(m.errors, 3),
        requests: round(m.requests, 3),
        mean_prompt_tokens: round_opt(m.mean_prompt_tokens, 1),
        mean_output_tokens: round_opt(m.mean_output_tokens, 1),
        balance: rounded_balance(balance),
        per_worker,
    }
}

/// Orders the jobs' results by job index and averages the sweeps: one summary row per router
/// and level, one run row per router, level and sweep.
pub fn aggregate(spec: &BenchSpec, mut results: Vec<JobResult>, profile: &str) -> BenchResults {
    results.sort_by_key(|r| r.job.index);
    let workers = spec.base.workers;
    let mut runs = Vec::new();
    let mut summary = Vec::new();
    for &router in &spec.routers {
        for &level in &spec.levels {
            let mut metrics = Vec::new();
            let mut balances = Vec::new();
            for r in results.iter().filter(|r| r.job.router == router) {
                for p in r.phases.iter().filter(|p| p.concurrency == level) {
                    let balance = balance_of(p);
                    let per_worker = p
                        .workers
                        .iter()
                        .map(|w| WorkerRow {
                            worker: w.worker,
                            routed: w.routed,
                            peak_in_flight: w.peak_in_flight,
                            mean_in_flight: round(w.mean_in_flight, 3),
                            utilisation: round(w.utilisation, 4),
                            prefill_tokens: w.prefill_tokens,
                            preemptions: w.preemptions,
                        })
                        .collect();
                    runs.push(row(
                        router,
                        workers,
                        level,
                        Some(r.job.seed),
                        Some(r.job.sweep),
                        None,
                        &p.metrics,
                        &balance,
                        per_worker,
                    ));
                    metrics.push(p.metrics.clone());
                    balances.push(balance);
                }
            }
            if metrics.is_empty() {
                continue;
            }
            summary.push(row(
                router,
                workers,
                level,
                None,
                None,
                Some(metrics.len() as u32),
                &Metrics::mean(&metrics),
                &mean_balance(&balances),
                Vec::new(),
            ));
        }
    }
    BenchResults {
        summary,
        runs,
        bench: BenchMeta {
            routers: spec.routers.iter().map(|r| r.name().to_string()).collect(),
            levels: spec.levels.clone(),
            sweeps: spec.sweeps,
            workers,
            profile: profile.to_string(),
            warmup_s: spec.warmup.as_secs_f64(),
            window_s: spec.window.as_secs_f64(),
            snapshots: spec.snapshots,
            snapshot_lookback_s: spec
                .lookback
                .unwrap_or(Nanos(spec.window.0 / u64::from(spec.snapshots.max(1))))
                .as_secs_f64(),
            seed: spec.seed,
            continuous: spec.continuous,
            coalesce_decode: spec.base.engine.coalesce_decode,
            kv_event_delay_ms: spec.base.router.kv_event_delay.as_millis_f64(),
            oracle_horizon_s: spec.base.oracle_horizon.map(Nanos::as_secs_f64),
            percentiles: "exact nearest-rank over each snapshot window, averaged over snapshots then sweeps",
        },
    }
}
