//! `results.json`: the rows `kvroute bench` and `kvroute sim` write and the dashboard reads.
//!
//! One type per thing in the file, both ways (Serialize + Deserialize), so the writer (the
//! simulator's aggregation) and the readers (the report, the load generator's baseline) can
//! never disagree on a field. Every float is rounded to a fixed number of decimals before it
//! goes in ([`Metrics::rounded`], [`Balance::rounded`]), so the file is byte-identical for
//! the same command.

use serde::{Deserialize, Serialize};

use crate::percentiles::{Percentiles, mean_some, round, round_opt};

/// How the percentiles of [`BenchMeta::percentiles`] were computed, as the file says it.
pub const PERCENTILES_METHOD: &str =
    "exact nearest-rank over each snapshot window, averaged over snapshots then sweeps";

/// The seed's metrics over one window, or averaged over several (their definitions, and which
/// requests a window covers, are the simulator's: `sim::metrics`).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Metrics {
    pub ttft_ms: Percentiles,
    pub tpot_ms: Percentiles,
    pub itl_ms: Percentiles,
    pub e2e_s: Percentiles,
    pub output_tokens_per_s: f64,
    pub requests_per_s: f64,
    /// Cached / prompt tokens of finished requests, 0..1 (`None` when none finished).
    pub kv_hit_rate: Option<f64>,
    /// The oracle's hit rate over the same requests (`None` when the oracle is off).
    pub oracle_hit_rate: Option<f64>,
    /// Failed turns.
    pub errors: f64,
    /// Finished requests.
    pub requests: f64,
    /// Mean prompt tokens of finished requests.
    pub mean_prompt_tokens: Option<f64>,
    /// Mean output tokens of finished requests.
    pub mean_output_tokens: Option<f64>,
    /// TTFT of first turns (nothing of the conversation can be cached yet), and of turns 2+
    /// (their history can be): seed 003's main observation. Written by `kvroute bench
    /// --phases` and `kvroute sim`; absent from the files seed 002's bench writes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttft_turn1_ms: Option<Percentiles>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttft_later_ms: Option<Percentiles>,
    /// Speculative decoding: the per-token acceptance probability observed over the
    /// measurement period (accepted draft tokens / draft positions evaluated), 0..1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub acceptance_rate: Option<f64>,
    /// Output tokens per decode step per sequence (1.0 without speculative decoding).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_step: Option<f64>,
    /// Goodput against SLOs, and with prefill/decode pools the routes, per-route TTFT and KV
    /// transfers (`kvroute bench --disagg`, `kvroute sim --prefill-workers`); absent from
    /// every other file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serving: Option<ServingMetrics>,
    /// Reuse attribution (`kvroute sim`; absent from the bench files): beside
    /// `kv_hit_rate`, what the engines reused, the share of prompt tokens the router's index
    /// said some worker held and the share it predicted on the worker it chose.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reuse: Option<ReuseRates>,
}

/// Reuse attribution over finished requests, as shares of their prompt tokens: the longest
/// prefix any worker held when the request was routed (as the router's index knew it), and
/// the prefix it predicted on the chosen worker. With `kv_hit_rate` (what the engine reused)
/// they tell a workload that offers little (`available` low) from routing that traded reuse
/// for balance (`predicted` below `available`) and from a stale index (`kv_hit_rate` below
/// `predicted`).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct ReuseRates {
    pub available: f64,
    pub predicted: f64,
}

impl Metrics {
    /// The mean of several windows (snapshots, or sweeps), as the seed averages them.
    pub fn mean(all: &[Metrics]) -> Self {
        let n = all.len().max(1) as f64;
        let avg = |f: fn(&Metrics) -> f64| all.iter().map(f).sum::<f64>() / n;
        let avg_some = |f: fn(&Metrics) -> Option<f64>| mean_some(all.iter().map(f));
        Self {
            ttft_ms: Percentiles::mean(all.iter().map(|m| &m.ttft_ms)),
            tpot_ms: Percentiles::mean(all.iter().map(|m| &m.tpot_ms)),
            itl_ms: Percentiles::mean(all.iter().map(|m| &m.itl_ms)),
            e2e_s: Percentiles::mean(all.iter().map(|m| &m.e2e_s)),
            output_tokens_per_s: avg(|m| m.output_tokens_per_s),
            requests_per_s: avg(|m| m.requests_per_s),
            kv_hit_rate: avg_some(|m| m.kv_hit_rate),
            oracle_hit_rate: avg_some(|m| m.oracle_hit_rate),
            errors: avg(|m| m.errors),
            requests: avg(|m| m.requests),
            mean_prompt_tokens: avg_some(|m| m.mean_prompt_tokens),
            mean_output_tokens: avg_some(|m| m.mean_output_tokens),
            ttft_turn1_ms: mean_of(all.iter().map(|m| m.ttft_turn1_ms.as_ref())),
            ttft_later_ms: mean_of(all.iter().map(|m| m.ttft_later_ms.as_ref())),
            acceptance_rate: avg_some(|m| m.acceptance_rate),
            tokens_per_step: avg_some(|m| m.tokens_per_step),
            serving: ServingMetrics::mean(all.iter().filter_map(|m| m.serving.as_ref())),
            reuse: {
                let some: Vec<ReuseRates> = all.iter().filter_map(|m| m.reuse).collect();
                (!some.is_empty()).then(|| ReuseRates {
                    available: mean_some(some.iter().map(|r| Some(r.available))).unwrap_or(0.0),
                    predicted: mean_some(some.iter().map(|r| Some(r.predicted))).unwrap_or(0.0),
                })
            },
        }
    }

    /// Rounded as the results file keeps it: latencies to µs (ms with 3 decimals, E2E
    /// seconds with 4), rates to 3–5 decimals, token means to 0.1.
    pub fn rounded(&self) -> Metrics {
        Metrics {
            ttft_ms: self.ttft_ms.rounded(3),
            tpot_ms: self.tpot_ms.rounded(3),
            itl_ms: self.itl_ms.rounded(3),
            e2e_s: self.e2e_s.rounded(4),
            output_tokens_per_s: round(self.output_tokens_per_s, 3),
            requests_per_s: round(self.requests_per_s, 5),
            kv_hit_rate: round_opt(self.kv_hit_rate, 5),
            oracle_hit_rate: round_opt(self.oracle_hit_rate, 5),
            errors: round(self.errors, 3),
            requests: round(self.requests, 3),
            mean_prompt_tokens: round_opt(self.mean_prompt_tokens, 1),
            mean_output_tokens: round_opt(self.mean_output_tokens, 1),
            ttft_turn1_ms: self.ttft_turn1_ms.map(|p| p.rounded(3)),
            ttft_later_ms: self.ttft_later_ms.map(|p| p.rounded(3)),
            acceptance_rate: round_opt(self.acceptance_rate, 5),
            tokens_per_step: round_opt(self.tokens_per_step, 4),
            serving: self.serving.as_ref().map(ServingMetrics::rounded),
            reuse: self.reuse.map(|r| ReuseRates {
                available: round(r.available, 5),
                predicted: round(r.predicted, 5),
            }),
        }
    }
}

/// Service-level objectives a request is held to: its TTFT, and its mean inter-token latency.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Slo {
    pub ttft_ms: f64,
    pub itl_ms: f64,
}

impl Slo {
    /// Seed 002's objectives (the dashboard's colours) held per request: TTFT 600 ms and mean
    /// ITL 60 ms (its TPOT p95 objective).
    pub const SEED_002: Slo = Slo {
        ttft_ms: crate::seed002::SLO_TTFT_P95_MS,
        itl_ms: crate::seed002::SLO_TPOT_P95_MS,
    };

    /// Seed 004's scaling thresholds, read as per-request objectives: TTFT 500 ms (the prefill
    /// pool's KEDA trigger) and ITL 50 ms (the decode pool's).
    pub const SEED_004: Slo = Slo {
        ttft_ms: 500.0,
        itl_ms: 50.0,
    };
}

/// Goodput against [`Slo`]s and, with prefill/decode pools, what disaggregation did: over one
/// window (or averaged). Counts are of requests that finished in the window; TTFT samples of
/// requests whose first token came in it (as [`Metrics`]).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ServingMetrics {
    /// Finished requests per second that met both SLOs (TTFT and mean ITL).
    pub goodput_rps: f64,
    /// Of the finished requests, the share that met both (`None` when none finished).
    pub goodput_share: Option<f64>,
    /// Finished requests by route: prefilled on the prefill pool and decoded on the decode
    /// pool; prefilled on their decode worker because the uncached prompt was short; because
    /// the prefill pool could not take them; because their prefill worker failed (a retry).
    /// All zero on an aggregated fleet.
    pub split: f64,
    pub local_short: f64,
    pub local_unavailable: f64,
    pub local_retry: f64,
    /// TTFT of split requests (first token from the prefill pool) and of local ones (from the
    /// decode pool).
    pub ttft_split_ms: Percentiles,
    pub ttft_local_ms: Percentiles,
    /// Per split request: the KV transfer's modelled time, and its mean size in MB (10^6 B).
    pub kv_transfer_ms: Percentiles,
    pub kv_transfer_mb: Option<f64>,
    /// KV moved between pools, MB per second of window.
    pub kv_transfer_mb_per_s: f64,
    /// Mean GPU utilisation of each pool over the measurement period (`None`: no such pool).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_utilisation: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode_utilisation: Option<f64>,
}

impl ServingMetrics {
    /// The mean of several windows; `None` when there is none.
    pub fn mean<'a>(all: impl Iterator<Item = &'a ServingMetrics> + Clone) -> Option<Self> {
        let n = all.clone().count();
        if n == 0 {
            return None;
        }
        let avg = |f: fn(&ServingMetrics) -> f64| all.clone().map(f).sum::<f64>() / n as f64;
        let avg_some = |f: fn(&ServingMetrics) -> Option<f64>| mean_some(all.clone().map(f));
        Some(Self {
            goodput_rps: avg(|m| m.goodput_rps),
            goodput_share: avg_some(|m| m.goodput_share),
            split: avg(|m| m.split),
            local_short: avg(|m| m.local_short),
            local_unavailable: avg(|m| m.local_unavailable),
            local_retry: avg(|m| m.local_retry),
            ttft_split_ms: Percentiles::mean(all.clone().map(|m| &m.ttft_split_ms)),
            ttft_local_ms: Percentiles::mean(all.clone().map(|m| &m.ttft_local_ms)),
            kv_transfer_ms: Percentiles::mean(all.clone().map(|m| &m.kv_transfer_ms)),
            kv_transfer_mb: avg_some(|m| m.kv_transfer_mb),
            kv_transfer_mb_per_s: avg(|m| m.kv_transfer_mb_per_s),
            prefill_utilisation: avg_some(|m| m.prefill_utilisation),
            decode_utilisation: avg_some(|m| m.decode_utilisation),
        })
    }

    /// Rounded as the results file keeps it.
    pub fn rounded(&self) -> Self {
        Self {
            goodput_rps: round(self.goodput_rps, 5),
            goodput_share: round_opt(self.goodput_share, 5),
            split: round(self.split, 3),
            local_short: round(self.local_short, 3),
            local_unavailable: round(self.local_unavailable, 3),
            local_retry: round(self.local_retry, 3),
            ttft_split_ms: self.ttft_split_ms.rounded(3),
            ttft_local_ms: self.ttft_local_ms.rounded(3),
            kv_transfer_ms: self.kv_transfer_ms.rounded(3),
            kv_transfer_mb: round_opt(self.kv_transfer_mb, 3),
            kv_transfer_mb_per_s: round(self.kv_transfer_mb_per_s, 3),
            prefill_utilisation: round_opt(self.prefill_utilisation, 4),
            decode_utilisation: round_opt(self.decode_utilisation, 4),
        }
    }

    /// Requests that finished, by any route (zero on an aggregated fleet).
    pub fn routed(&self) -> f64 {
        self.split + self.local_short + self.local_unavailable + self.local_retry
    }
}

/// The mean of the present percentile pairs (`None` when none is: the field was not
/// measured in any window).
fn mean_of<'a>(all: impl Iterator<Item = Option<&'a Percentiles>> + Clone) -> Option<Percentiles> {
    let present = all.flatten();
    present
        .clone()
        .next()
        .is_some()
        .then(|| Percentiles::mean(present))
}

/// How evenly a run spread its load.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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

impl Balance {
    /// The field-by-field mean of several runs' balance (sweeps).
    pub fn mean(all: &[Balance]) -> Balance {
        let n = all.len().max(1) as f64;
        let avg = |f: fn(&Balance) -> f64| all.iter().map(f).sum::<f64>() / n;
        Balance {
            request_skew: avg(|b| b.request_skew),
            in_flight_skew: avg(|b| b.in_flight_skew),
            peak_in_flight: avg(|b| b.peak_in_flight),
            utilisation: avg(|b| b.utilisation),
        }
    }

    /// Rounded as the results file keeps it.
    pub fn rounded(&self) -> Balance {
        Balance {
            request_skew: round(self.request_skew, 4),
            in_flight_skew: round(self.in_flight_skew, 4),
            peak_in_flight: round(self.peak_in_flight, 2),
            utilisation: round(self.utilisation, 4),
        }
    }
}

/// One worker's share of a run (run rows only).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerRow {
    pub worker: u32,
    pub routed: u64,
    pub peak_in_flight: u32,
    pub mean_in_flight: f64,
    pub utilisation: f64,
    pub prefill_tokens: u64,
    pub preemptions: u64,
    /// With prefill/decode pools: `prefill` or `decode`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,
}

/// A line of `results.json` (the dashboard's contract): one router at one level, for one run
/// (`runs`, with `seed`) or averaged over the sweeps (`summary`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Row {
    /// `kvroute bench --phases`: the step of seed 003's ladder (`baseline`, `kv`, `draft`,
    /// `eagle3`) and the hardware it ran on (a [`Setup`] name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub setup: Option<String>,
    /// `kvroute bench --disagg`: the fleet's layout (a [`Layout`] name: `4agg`, `1p3d`) and
    /// the workload it served (`chat`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layout: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workload: Option<String>,
    /// `kvroute bench --suite robustness`: the grid's cell (`workload/workers/profile`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cell: Option<String>,
    pub router: String,
    pub workers: u32,
    /// Conversations open at once (the closed loop); 0 in an open-loop row.
    pub concurrency: u32,
    /// `kvroute bench --disagg --rates`: the open loop's arrival rate, sessions per second
    /// (Poisson; a session is one request of B or C, a whole conversation of A). Absent from
    /// closed-loop rows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_rps: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sweep: Option<u32>,
    /// Sweeps averaged (summary rows).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sweeps: Option<u32>,
    /// Per snapshot window (errors and requests too), rounded ([`Metrics::rounded`]); its
    /// fields sit in the row itself in JSON.
    #[serde(flatten)]
    pub metrics: Metrics,
    /// `kvroute bench --suite robustness`: finished requests per second that met both SLOs
    /// (`serving.goodput_rps`, at the top of the row for the grid's readers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub goodput_rps: Option<f64>,
    pub balance: Balance,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub per_worker: Vec<WorkerRow>,
    /// Seed 004's workloads A, B and C, each on its own (runs of a mix only; absent from
    /// files written before it).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub per_class: Vec<ClassRow>,
}

/// One workload's share of a run of a mix (seed 004: `A` chat, `B` summarisation, `C`
/// reasoning): the same metrics over the same window, for its requests only. Tokens per
/// second there count the output of its finished requests.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClassRow {
    /// `A`, `B` or `C`.
    pub class: String,
    /// `chat`, `summarisation` or `reasoning`.
    pub name: String,
    #[serde(flatten)]
    pub metrics: Metrics,
}

/// `results.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BenchResults {
    pub summary: Vec<Row>,
    pub runs: Vec<Row>,
    pub bench: BenchMeta,
}

/// How the results were produced (no wall times: the file is byte-identical per command).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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
    /// How the percentiles were computed ([`PERCENTILES_METHOD`]).
    pub percentiles: String,
    /// `kvroute bench --phases`: the ladder's phases and the hardware setups, in order (the
    /// fields above then describe the first setup).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub phases: Vec<PhaseMeta>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub setups: Vec<Setup>,
    /// The serving path's round trip added to TTFT and E2E, milliseconds (written by
    /// `--phases`; seed 002's files leave it out).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path_latency_ms: Option<f64>,
    /// `kvroute bench --disagg`: the layouts compared, the workloads and the SLOs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disagg: Option<DisaggMeta>,
    /// `kvroute bench --suite robustness`: the grid's families, cells and verdict terms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub robustness: Option<crate::robustness::RobustnessMeta>,
}

/// What a `kvroute bench --disagg` compared.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DisaggMeta {
    /// In report order; the first (the aggregated fleet) is the baseline.
    pub layouts: Vec<Layout>,
    pub workloads: Vec<String>,
    /// The objectives of goodput.
    pub slo: Slo,
    /// The conditional-disaggregation threshold: uncached prompt tokens a decode worker
    /// prefills itself.
    pub local_prefill_max_tokens: u32,
    /// How KV moves from the prefill pool to the decode pool (`nvlink`, `network`).
    pub kv_link: String,
    /// The open-loop arrival rates run (sessions per second), ascending; empty when only the
    /// closed loop ran (and in files written before the rate sweep).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rates: Vec<f64>,
    /// `shared`: concurrent transfers share each worker's link port; `exclusive`: each has
    /// the whole link. Absent from files written before link sharing was modelled (exclusive).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_link_sharing: Option<String>,
}

/// One fleet of a `kvroute bench --disagg`: aggregated workers, or prefill and decode pools.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Layout {
    /// `4agg`, `1p3d`, …
    pub name: String,
    /// Aggregated workers (0 in a disaggregated layout).
    pub aggregated: u32,
    pub prefill: u32,
    pub decode: u32,
    /// GPUs in all.
    pub gpus: u32,
}

/// One step of seed 003's ladder.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PhaseMeta {
    /// `baseline`, `kv`, `draft`, `eagle3`.
    pub name: String,
    /// The router of this phase.
    pub router: String,
    /// Speculative decoding (`off`, `draft`, `eagle3`).
    pub spec_decode: String,
    /// For people: what changes at this step.
    pub description: String,
}

/// One hardware setup of a phase ladder: a fleet of identical workers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Setup {
    /// Short name, the rows' `setup` (`h100x8-tp4`).
    pub name: String,
    /// For people (`one 8×H100 node: 2 replicas of Llama-70B FP8 at TP=4`).
    pub description: String,
    pub profile: String,
    pub workers: u32,
    /// GPUs per worker.
    pub gpus_per_worker: u32,
}

impl BenchResults {
    /// The summary rows of one router, in level order.
    pub fn summary_of<'a>(&'a self, router: &'a str) -> impl Iterator<Item = &'a Row> + 'a {
        self.summary.iter().filter(move |r| r.router == router)
    }

    /// The summary row of `router` at `concurrency`.
    pub fn summary_at(&self, router: &str, concurrency: u32) -> Option<&Row> {
        self.summary
            .iter()
            .find(|r| r.router == router && r.concurrency == concurrency)
    }
}

/// The summary rows `keep` selects, by concurrency level: one curve of a bench that runs
/// several series (phases × setups, workloads × layouts).
pub fn summary_rows(results: &BenchResults, keep: impl Fn(&Row) -> bool) -> Vec<&Row> {
    let mut rows: Vec<&Row> = results.summary.iter().filter(|r| keep(r)).collect();
    rows.sort_by_key(|r| r.concurrency);
    rows
}

/// A table cell: the number to `decimals` places, or a dash when absent.
pub(crate) fn cell(v: Option<f64>, decimals: usize) -> String {
    v.map_or("–".to_string(), |x| format!("{x:.decimals$}"))
}
