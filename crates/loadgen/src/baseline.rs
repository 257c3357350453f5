//! The recorded baseline: `results.json` as `kvroute bench` writes it, read with the
//! `report` crate's types (the writer's own). The dashboard's RR columns and its static table
//! come from here. The shipped default is our simulator's run of seed 002
//! (`docs/results/results.json`); `--baseline FILE` replaces it with a user's own.

use report::{BenchResults, Percentiles, Row};
use serde::Serialize;

/// The results file the binary ships (`kvroute bench --out docs/results --compare-seed002`).
pub const SHIPPED_RESULTS: &str = include_str!("../../../docs/results/results.json");

/// Where the shipped baseline comes from, as the dashboard says it.
pub const SHIPPED_SOURCE: &str = "docs/results/results.json: 3 × H200, Llama-3.1-70B FP8, \
     seed 002's workload, simulated in virtual time";

/// One router at one concurrency level: the figures of a summary [`Row`] the dashboard
/// shows, under the names of its live metrics (`tops`).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct BaselineRow {
    pub router: String,
    pub concurrency: u32,
    pub ttft_ms: Percentiles,
    pub tpot_ms: Percentiles,
    pub itl_ms: Percentiles,
    pub e2e_s: Percentiles,
    pub tops: f64,
    pub kv_hit_rate: Option<f64>,
}

impl From<Row> for BaselineRow {
    fn from(r: Row) -> BaselineRow {
        BaselineRow {
            router: r.router,
            concurrency: r.concurrency,
            ttft_ms: r.metrics.ttft_ms,
            tpot_ms: r.metrics.tpot_ms,
            itl_ms: r.metrics.itl_ms,
            e2e_s: r.metrics.e2e_s,
            tops: r.metrics.output_tokens_per_s,
            kv_hit_rate: r.metrics.kv_hit_rate,
        }
    }
}

/// A level of the static table: the baseline router and the KV router side by side.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct BaselineLevel {
    pub concurrency: u32,
    pub baseline: BaselineRow,
    pub kv: Option<BaselineRow>,
}

/// The whole recorded comparison.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Baseline {
    pub source: String,
    pub baseline_router: String,
    pub kv_router: Option<String>,
    pub levels: Vec<BaselineLevel>,
}

/// Why a results file cannot serve as the baseline.
#[derive(Debug, thiserror::Error)]
pub enum BaselineError {
    #[error("not a kvroute bench results.json: {0}")]
    Format(#[from] serde_json::Error),
    #[error("results.json has no {0:?} rows (routers in it: {1})")]
    NoRouter(String, String),
}

impl Baseline {
    /// Reads `results.json`: `baseline_router` rows (normally `round_robin`) are the RR
    /// columns; the KV column is `kv_load` when present, else `kv`.
    pub fn from_results_json(
        json: &str,
        source: &str,
        baseline_router: &str,
    ) -> Result<Baseline, BaselineError> {
        Baseline::from_results_json_preferring(json, source, baseline_router, &["kv_load", "kv"])
    }

    /// As [`Baseline::from_results_json`], with the KV column the first of `kv_routers` in the
    /// file.
    pub fn from_results_json_preferring(
        json: &str,
        source: &str,
        baseline_router: &str,
        kv_routers: &[&str],
    ) -> Result<Baseline, BaselineError> {
        let file: BenchResults = serde_json::from_str(json)?;
        let rows: Vec<BaselineRow> = file.summary.into_iter().map(BaselineRow::from).collect();
        let mut routers: Vec<&str> = rows.iter().map(|r| r.router.as_str()).collect();
        routers.dedup();
        let kv_router = kv_routers
            .iter()
            .copied()
            .find(|k| *k != baseline_router && routers.contains(k))
            .map(str::to_owned);
        let mut levels: Vec<BaselineLevel> = rows
            .iter()
            .filter(|r| r.router == baseline_router)
            .map(|b| BaselineLevel {
                concurrency: b.concurrency,
                baseline: b.clone(),
                kv: kv_router.as_ref().and_then(|k| {
                    rows.iter()
                        .find(|r| &r.router == k && r.concurrency == b.concurrency)
                        .cloned()
                }),
            })
            .collect();
        if levels.is_empty() {
            return Err(BaselineError::NoRouter(
                baseline_router.to_owned(),
                routers.join(", "),
            ));
        }
        levels.sort_by_key(|l| l.concurrency);
        Ok(Baseline {
            source: source.to_owned(),
            baseline_router: baseline_router.to_owned(),
            kv_router,
            levels,
        })
    }

    /// The shipped baseline (round-robin vs kv_load, simulated).
    pub fn shipped() -> Result<Baseline, BaselineError> {
        Baseline::from_results_json(SHIPPED_RESULTS, SHIPPED_SOURCE, "round_robin")
    }

    /// The baseline row at the level nearest `concurrency` (the lower one on a tie).
    pub fn row_near(&self, concurrency: u32) -> Option<&BaselineRow> {
        self.levels
            .iter()
            .min_by_key(|l| (l.concurrency.abs_diff(concurrency), l.concurrency))
            .map(|l| &l.baseline)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shipped_results_give_seven_levels_with_both_routers() {
        let b = Baseline::shipped().unwrap();
        let levels: Vec<u32> = b.levels.iter().map(|l| l.concurrency).collect();
        assert_eq!(levels, vec![60, 80, 100, 120, 140, 160, 180]);
        assert_eq!(b.kv_router.as_deref(), Some("kv_load"));
        for level in &b.levels {
            assert_eq!(level.baseline.router, "round_robin");
            let kv = level.kv.as_ref().unwrap();
            assert_eq!(kv.concurrency, level.concurrency);
            assert!(kv.ttft_ms.p95.unwrap() < level.baseline.ttft_ms.p95.unwrap());
        }
        assert_eq!(b.row_near(130).unwrap().concurrency, 120);
        assert_eq!(b.row_near(131).unwrap().concurrency, 140);
        assert_eq!(b.row_near(5_000).unwrap().concurrency, 180);
    }

    #[test]
    fn a_file_without_the_baseline_router_is_refused() {
        // The shipped file without its round-robin rows.
        let mut results: BenchResults = serde_json::from_str(SHIPPED_RESULTS).unwrap();
        results.summary.retain(|r| r.router != "round_robin");
        let json = serde_json::to_string(&results).unwrap();
        let err = Baseline::from_results_json(&json, "x", "round_robin").unwrap_err();
        assert!(err.to_string().contains("no \"round_robin\" rows"), "{err}");
        assert!(err.to_string().contains("kv, kv_load"), "{err}");
        assert!(Baseline::from_results_json("{}", "x", "round_robin").is_err());
    }
}
