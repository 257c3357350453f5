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
//! so the output never depends on scheduling: `results.json` as [`report::BenchResults`].
//! Every float in a [`Row`] is rounded to a fixed number of decimals, so the file is
//! byte-identical for the same command.

use nanotime::Nanos;
use report::percentiles::round;
use report::{Balance, BenchMeta, BenchResults, Metrics, PERCENTILES_METHOD, Row, WorkerRow};
use router::PolicyKind;

use crate::config::{Phase, SimConfig};
use crate::driver::{PhaseResult, RunTotals, SimError, Simulation, derive_seed};
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
        phase: None,
        setup: None,
        layout: None,
        workload: None,
        cell: None,
        router: router.name().to_string(),
        workers,
        concurrency,
        rate_rps: None,
        seed,
        sweep,
        sweeps,
        metrics: m.rounded(),
        goodput_rps: None,
        balance: balance.rounded(),
        per_worker,
        per_class: Vec::new(),
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
                            pool: w.pool.map(str::to_string),
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
                &Balance::mean(&balances),
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
            percentiles: PERCENTILES_METHOD.to_string(),
            phases: Vec::new(),
            setups: Vec::new(),
            path_latency_ms: None,
            disagg: None,
            robustness: None,
        },
    }
}
