//! The SVG plots of a benchmark: each metric against concurrency, one line per router.

use crate::markdown::{Getter, rows_of};
use crate::results::BenchResults;
use crate::seed002::{SLO_TPOT_P95_MS, SLO_TTFT_P95_MS, SeedSide, label, seed_002};
use crate::svg::{Chart, PALETTE, Series, Threshold};

/// One plot of [`plots`].
struct PlotSpec {
    file: &'static str,
    title: &'static str,
    /// The y axis: what and in which unit.
    axis: &'static str,
    get: Getter,
    /// Seed 002's value of the same metric, when it publishes one.
    seed: Option<fn(&SeedSide) -> f64>,
    /// An SLO line: (value, label).
    slo: Option<(f64, &'static str)>,
    from_zero: bool,
}

/// The SVG plots of a benchmark: (file name, document). With `with_seed`, seed 002's
/// published lines are drawn dashed beside ours where the seed has the metric.
pub fn plots(results: &BenchResults, with_seed: bool) -> Vec<(String, String)> {
    let specs = [
        PlotSpec {
            file: "ttft_p95.svg",
            title: "TTFT p95",
            axis: "TTFT p95 (ms)",
            get: |r| r.metrics.ttft_ms.p95,
            seed: Some(|s| s.ttft_p95_ms),
            slo: Some((SLO_TTFT_P95_MS, "SLO 600 ms")),
            from_zero: true,
        },
        PlotSpec {
            file: "tpot_p95.svg",
            title: "TPOT p95",
            axis: "TPOT p95 (ms)",
            get: |r| r.metrics.tpot_ms.p95,
            // The seed publishes ITL, "synonymous with TPOT in this context".
            seed: Some(|s| s.itl_p95_ms),
            slo: Some((SLO_TPOT_P95_MS, "SLO 60 ms")),
            from_zero: true,
        },
        PlotSpec {
            file: "tops.svg",
            title: "Output tokens per second",
            axis: "output tokens/s",
            get: |r| Some(r.metrics.output_tokens_per_s),
            seed: Some(|s| s.tops),
            slo: None,
            from_zero: true,
        },
        PlotSpec {
            file: "hit_rate.svg",
            title: "KV cache hit rate (dashed: oracle bound)",
            axis: "hit rate (%)",
            get: |r| r.metrics.kv_hit_rate.map(|h| h * 100.0),
            seed: Some(|s| s.hit_rate * 100.0),
            slo: None,
            from_zero: false,
        },
        PlotSpec {
            file: "e2e_p50.svg",
            title: "End-to-end latency p50",
            axis: "E2E p50 (s)",
            get: |r| r.metrics.e2e_s.p50,
            seed: Some(|s| s.e2e_p50_s),
            slo: None,
            from_zero: true,
        },
    ];
    let routers = &results.bench.routers;
    let mut out = Vec::new();
    for PlotSpec {
        file,
        title,
        axis,
        get,
        seed: seed_get,
        slo,
        from_zero,
    } in specs
    {
        let mut series = Vec::new();
        for (i, r) in routers.iter().enumerate() {
            let color = PALETTE[i % PALETTE.len()];
            series.push(Series {
                name: label(r),
                points: rows_of(results, r)
                    .iter()
                    .map(|x| (f64::from(x.concurrency), get(x)))
                    .collect(),
                color,
                dashed: false,
            });
            if file == "hit_rate.svg" {
                series.push(Series {
                    name: format!("{} oracle", label(r)),
                    points: rows_of(results, r)
                        .iter()
                        .map(|x| {
                            (
                                f64::from(x.concurrency),
                                x.metrics.oracle_hit_rate.map(|h| h * 100.0),
                            )
                        })
                        .collect(),
                    color,
                    dashed: true,
                });
            }
            if let (true, Some(sg)) = (with_seed, seed_get) {
                let points: Vec<(f64, Option<f64>)> = rows_of(results, r)
                    .iter()
                    .filter_map(|x| {
                        seed_002(r, x.concurrency).map(|s| (f64::from(x.concurrency), Some(sg(&s))))
                    })
                    .collect();
                if !points.is_empty() {
                    series.push(Series {
                        name: format!("{} seed 002", label(r)),
                        points,
                        color: if r == "round_robin" {
                            "#f4a3a3"
                        } else {
                            "#9ecae1"
                        },
                        dashed: true,
                    });
                }
            }
        }
        let chart = Chart {
            title: format!("{title} vs concurrency ({} workers)", results.bench.workers),
            x_label: "concurrent conversations".into(),
            y_label: axis.to_string(),
            series,
            threshold: slo.map(|(value, label)| Threshold {
                value,
                label: label.to_string(),
            }),
            y_from_zero: from_zero,
        };
        out.push((file.to_string(), chart.render()));
    }
    out
}
