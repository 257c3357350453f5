//! Benchmark results as one typed contract, and what is drawn from them.
//!
//! `kvroute bench` and `kvroute sim` write `results.json`; the load generator's dashboard
//! reads it back as its baseline; `report.md` and the SVG plots are rendered from it. All of
//! them use the types here, so a field exists once:
//!
//! - [`Percentiles`]: the project's one p50/p95 pair (nearest rank, `None` without samples),
//!   used by the simulator's metrics, the results rows and the load generator's window;
//! - [`results`]: the seed's [`Metrics`] of a window and the rows of `results.json`
//!   ([`BenchResults`], [`Row`], [`BenchMeta`]), Serialize + Deserialize;
//! - [`markdown`](mod@markdown) and [`plots`](mod@plots): `report.md` and the plots, beside
//!   seed 002's published numbers ([`seed002`]);
//! - [`ladder`]: the report and plots of seed 003's phase ladder (`kvroute bench --phases`);
//! - [`scenario`]: seed 004's scenario cycle in virtual time (`kvroute sim --scenario`):
//!   its results, report and timeline plot;
//! - [`robustness`]: the robustness grid's merge, verdicts and report (`kvroute bench
//!   --suite robustness`);
//! - [`svg`]: hand-written, deterministic line charts (also the simulator's timeline).
//!
//! # Invariant
//!
//! Pure: no I/O, no clock. Functions return text (`String`) and the caller writes the
//! files, so the same results give the same bytes.

pub mod disagg;
pub mod ladder;
pub mod markdown;
pub mod percentiles;
pub mod plots;
pub mod results;
pub mod robustness;
pub mod scenario;
pub mod seed002;
pub mod svg;

pub use markdown::{compare_seed_002, highest_slo_level, markdown};
pub use percentiles::Percentiles;
pub use plots::plots;
pub use results::{
    Balance, BenchMeta, BenchResults, ClassRow, DisaggMeta, Layout, Metrics, PERCENTILES_METHOD,
    PhaseMeta, ReuseRates, Row, ServingMetrics, Setup, Slo, WorkerRow,
};
pub use seed002::{SLO_TPOT_P95_MS, SLO_TTFT_P95_MS};
