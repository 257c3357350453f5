//! `report.md` and the comparison with seed 002's published numbers.
//!
//! Pure functions from [`BenchResults`] to text; the caller writes the files. The first
//! router of a benchmark is the baseline of every Δ column, as round-robin is in seed 002.
//! Improvements follow the seed's sign convention: positive is better (lower latency, higher
//! throughput).

use std::fmt::Write;

use crate::results::{BenchResults, Row};
use crate::seed002::{SLO_TPOT_P95_MS, SLO_TTFT_P95_MS, SeedSide, label, seed_002};

/// Relative improvement of `other` over `base`, in percent (positive = better).
fn improvement(base: Option<f64>, other: Option<f64>, lower_is_better: bool) -> Option<f64> {
    let (b, o) = (base?, other?);
    if b == 0.0 {
        return None;
    }
    Some(if lower_is_better {
        (b - o) / b * 100.0
    } else {
        (o - b) / b * 100.0
    })
}

fn f(v: Option<f64>, decimals: usize) -> String {
    v.map_or("–".to_string(), |x| format!("{x:.decimals$}"))
}

fn delta(v: Option<f64>) -> String {
    match v {
        None => "–".to_string(),
        Some(x) if x > 0.0 => format!("**{x:+.1}%**"),
        Some(x) => format!("{x:+.1}%"),
    }
}

fn pct(v: Option<f64>) -> String {
    v.map_or("–".to_string(), |x| format!("{:.1}%", x * 100.0))
}

/// The summary rows of one router, by level.
pub(crate) fn rows_of<'a>(results: &'a BenchResults, router: &'a str) -> Vec<&'a Row> {
    results.summary_of(router).collect()
}

fn find<'a>(results: &'a BenchResults, router: &str, c: u32) -> Option<&'a Row> {
    results.summary_at(router, c)
}

/// One number of a summary row (`None`: not measured).
pub(crate) type Getter = fn(&Row) -> Option<f64>;

/// How a table shows a number.
#[derive(Debug, Clone, Copy)]
enum Shown {
    Decimals(usize),
    /// A 0..1 rate as a percentage.
    Percent,
}

/// One metric of a table: a column per router, then (with `delta`) a Δ column per
/// non-baseline router.
struct Col {
    name: &'static str,
    get: Getter,
    /// `Some(lower_is_better)` adds Δ columns.
    delta: Option<bool>,
    shown: Shown,
}

const fn col(name: &'static str, get: Getter, delta: Option<bool>, shown: Shown) -> Col {
    Col {
        name,
        get,
        delta,
        shown,
    }
}

fn metric_table(out: &mut String, results: &BenchResults, cols: &[Col]) {
    let routers = &results.bench.routers;
    let base = &routers[0];
    let mut header = vec!["Concurrency".to_string()];
    for c in cols {
        for r in routers {
            header.push(format!("{} {}", label(r), c.name));
        }
        if c.delta.is_some() {
            for r in &routers[1..] {
                let suffix = if routers.len() > 2 {
                    format!(" ({})", label(r))
                } else {
                    String::new()
                };
                let short = c.name.split(' ').next().unwrap_or(c.name);
                header.push(format!("{short} Δ{suffix}"));
            }
        }
    }
    let _ = writeln!(out, "| {} |", header.join(" | "));
    let _ = writeln!(
        out,
        "|{}|",
        header.iter().map(|_| ":---:").collect::<Vec<_>>().join("|")
    );
    for &level in &results.bench.levels {
        let mut cells = vec![level.to_string()];
        for c in cols {
            let value = |r: &str| find(results, r, level).and_then(c.get);
            for r in routers {
                cells.push(match c.shown {
                    Shown::Decimals(d) => f(value(r), d),
                    Shown::Percent => pct(value(r)),
                });
            }
            if let Some(lower_is_better) = c.delta {
                for r in &routers[1..] {
                    cells.push(delta(improvement(value(base), value(r), lower_is_better)));
                }
            }
        }
        let _ = writeln!(out, "| {} |", cells.join(" | "));
    }
    out.push('\n');
}

/// `report.md`: the seed 002 tables for these results, the summary, the oracle bound,
/// per-worker balance and (when the levels match) the comparison with seed 002.
pub fn markdown(results: &BenchResults, plots: &[String]) -> String {
    let b = &results.bench;
    let mut out = String::new();
    let _ = writeln!(out, "# kvroute bench: {}\n", b.routers.join(" vs "));
    let _ = writeln!(
        out,
        "{} workers of `{}`, concurrency {}, {} sweep(s) × ({} s warmup + {} s window read as {} \
         snapshot(s) of the last {} s), seed {}, {}. Simulated by `kvroute bench` (virtual time, \
         deterministic). Percentiles: {}.\n",
        b.workers,
        b.profile,
        b.levels
            .iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(", "),
        b.sweeps,
        b.warmup_s,
        b.window_s,
        b.snapshots,
        b.snapshot_lookback_s,
        b.seed,
        if b.continuous {
            "levels run back to back in each sweep"
        } else {
            "each level a cold run"
        },
        b.percentiles
    );

    out.push_str("## TTFT — Time to First Token\n\n");
    metric_table(
        &mut out,
        results,
        &[
            col(
                "p50 (ms)",
                |r| r.metrics.ttft_ms.p50,
                Some(true),
                Shown::Decimals(0),
            ),
            col(
                "p95 (ms)",
                |r| r.metrics.ttft_ms.p95,
                Some(true),
                Shown::Decimals(0),
            ),
            col("hit rate", |r| r.metrics.kv_hit_rate, None, Shown::Percent),
        ],
    );

    out.push_str("## Throughput and actual RPS\n\n");
    throughput_table(&mut out, results);

    out.push_str("## ITL — Inter-Token Latency\n\n");
    metric_table(
        &mut out,
        results,
        &[
            col(
                "p50 (ms)",
                |r| r.metrics.itl_ms.p50,
                None,
                Shown::Decimals(1),
            ),
            col(
                "p95 (ms)",
                |r| r.metrics.itl_ms.p95,
                None,
                Shown::Decimals(1),
            ),
        ],
    );
    out.push_str(
        "TPOT = (E2E − TTFT) / (output tokens − 1) is each request's mean gap between tokens, \
         which is how ITL is measured too (from the engine's token times, no network between), \
         so TPOT percentiles equal these; seed 002 calls them synonymous. The TPOT SLO reads \
         the p95 column.\n\n",
    );
    out.push_str("## End-to-end latency\n\n");
    metric_table(
        &mut out,
        results,
        &[
            col("p50 (s)", |r| r.metrics.e2e_s.p50, None, Shown::Decimals(1)),
            col("p95 (s)", |r| r.metrics.e2e_s.p95, None, Shown::Decimals(1)),
        ],
    );

    out.push_str("## Results summary\n\n");
    summary_table(&mut out, results);

    out.push_str("## Hit rate against the oracle bound\n\n");
    out.push_str(
        "The oracle routes every turn to the worker holding the longest prefix and never \
         evicts: its hit rate is the longest prefix of each prompt seen in any earlier prompt \
         or output, over the same requests. No policy can beat it on this traffic.\n\n",
    );
    metric_table(
        &mut out,
        results,
        &[
            col("hit rate", |r| r.metrics.kv_hit_rate, None, Shown::Percent),
            col(
                "oracle",
                |r| r.metrics.oracle_hit_rate,
                None,
                Shown::Percent,
            ),
        ],
    );

    out.push_str("## Per-worker balance\n\n");
    out.push_str(
        "Request skew = busiest worker's routed requests / mean; in-flight skew = highest \
         time-averaged in-flight count / mean (seed 002: 1.02× KV, 1.11× RR at 170); peak = \
         the most requests one worker held at once; utilisation = share of the window its GPU \
         spent in steps.\n\n",
    );
    metric_table(
        &mut out,
        results,
        &[
            col(
                "req skew",
                |r| Some(r.balance.request_skew),
                None,
                Shown::Decimals(3),
            ),
            col(
                "in-flight skew",
                |r| Some(r.balance.in_flight_skew),
                None,
                Shown::Decimals(3),
            ),
            col(
                "peak in-flight",
                |r| Some(r.balance.peak_in_flight),
                None,
                Shown::Decimals(1),
            ),
            col(
                "GPU util",
                |r| Some(r.balance.utilisation),
                None,
                Shown::Percent,
            ),
        ],
    );

    if has_seed_levels(results) {
        out.push_str("## Beside seed 002\n\n");
        out.push_str(&compare_seed_002(results));
    }

    if !plots.is_empty() {
        out.push_str("## Plots\n\n");
        for p in plots {
            let _ = writeln!(out, "![{p}]({p})\n");
        }
    }
    out
}

fn throughput_table(out: &mut String, results: &BenchResults) {
    let routers = &results.bench.routers;
    let base = &routers[0];
    let mut header = vec!["Concurrency".to_string()];
    header.extend(routers.iter().map(|r| format!("{} TOPS", label(r))));
    header.extend(routers[1..].iter().map(|r| {
        if routers.len() > 2 {
            format!("Improvement ({})", label(r))
        } else {
            "Improvement".to_string()
        }
    }));
    header.extend(routers.iter().map(|r| format!("{} RPS", label(r))));
    let _ = writeln!(out, "| {} |", header.join(" | "));
    let _ = writeln!(
        out,
        "|{}|",
        header.iter().map(|_| ":---:").collect::<Vec<_>>().join("|")
    );
    for &c in &results.bench.levels {
        let tops = |r: &str| find(results, r, c).map(|x| x.metrics.output_tokens_per_s);
        let rps = |r: &str| find(results, r, c).map(|x| x.metrics.requests_per_s);
        let mut cells = vec![c.to_string()];
        cells.extend(routers.iter().map(|r| f(tops(r), 1)));
        cells.extend(
            routers[1..]
                .iter()
                .map(|r| delta(improvement(tops(base), tops(r), false))),
        );
        cells.extend(routers.iter().map(|r| f(rps(r), 2)));
        let _ = writeln!(out, "| {} |", cells.join(" | "));
    }
    out.push('\n');
}

fn range_avg(values: &[f64], fmt: impl Fn(f64) -> String) -> String {
    if values.is_empty() {
        return "–".to_string();
    }
    let lo = values.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let avg = values.iter().sum::<f64>() / values.len() as f64;
    format!("{}–{}, avg {}", fmt(lo), fmt(hi), fmt(avg))
}

/// Highest level at which TTFT p95 ≤ 600 ms and TPOT p95 ≤ 60 ms (every lower level too is
/// not required: the seed reads the highest compliant level).
pub fn highest_slo_level(results: &BenchResults, router: &str) -> Option<u32> {
    rows_of(results, router)
        .iter()
        .filter(|r| {
            r.metrics.ttft_ms.p95.is_some_and(|v| v <= SLO_TTFT_P95_MS)
                && r.metrics.tpot_ms.p95.is_some_and(|v| v <= SLO_TPOT_P95_MS)
        })
        .map(|r| r.concurrency)
        .max()
}

fn summary_table(out: &mut String, results: &BenchResults) {
    let routers = &results.bench.routers;
    let base = &routers[0];
    let levels = &results.bench.levels;
    let _ = writeln!(out, "| Metric | Value |\n|--------|-------|");
    for other in &routers[1..] {
        let who = format!("{} vs {}", label(other), label(base));
        let imp = |get: Getter, lower: bool| -> Vec<(u32, f64)> {
            levels
                .iter()
                .filter_map(|&c| {
                    let b = find(results, base, c).and_then(get);
                    let o = find(results, other, c).and_then(get);
                    improvement(b, o, lower).map(|v| (c, v))
                })
                .collect()
        };
        let avg = |v: &[(u32, f64)]| {
            if v.is_empty() {
                "–".to_string()
            } else {
                format!(
                    "{:+.1}%",
                    v.iter().map(|x| x.1).sum::<f64>() / v.len() as f64
                )
            }
        };
        let peak = |v: &[(u32, f64)]| {
            v.iter()
                .copied()
                .max_by(|a, b| a.1.total_cmp(&b.1))
                .map_or("–".to_string(), |(c, x)| {
                    format!("{x:+.1}% at concurrency {c}")
                })
        };
        let p50 = imp(|r| r.metrics.ttft_ms.p50, true);
        let p95 = imp(|r| r.metrics.ttft_ms.p95, true);
        let tops = imp(|r| Some(r.metrics.output_tokens_per_s), false);
        let itl = imp(|r| r.metrics.itl_ms.p50, true);
        let e2e = imp(|r| r.metrics.e2e_s.p50, true);
        let vals = |v: &[(u32, f64)]| v.iter().map(|x| x.1).collect::<Vec<_>>();
        let _ = writeln!(
            out,
            "| Average TTFT p50 improvement, {who} | {} |",
            avg(&p50)
        );
        let _ = writeln!(out, "| Peak TTFT p50 improvement, {who} | {} |", peak(&p50));
        let _ = writeln!(
            out,
            "| Average TTFT p95 improvement, {who} | {} |",
            avg(&p95)
        );
        let _ = writeln!(out, "| Peak TTFT p95 improvement, {who} | {} |", peak(&p95));
        let _ = writeln!(
            out,
            "| Throughput advantage, {who} | {} |",
            range_avg(&vals(&tops), |x| format!("{x:+.1}%"))
        );
        let _ = writeln!(
            out,
            "| ITL p50 advantage, {who} | {} |",
            range_avg(&vals(&itl), |x| format!("{x:+.1}%"))
        );
        let _ = writeln!(
            out,
            "| E2E p50 advantage, {who} | {} |",
            range_avg(&vals(&e2e), |x| format!("{x:+.1}%"))
        );
    }
    for r in routers {
        let rows = rows_of(results, r);
        let hits: Vec<f64> = rows.iter().filter_map(|x| x.metrics.kv_hit_rate).collect();
        let oracle: Vec<f64> = rows
            .iter()
            .filter_map(|x| x.metrics.oracle_hit_rate)
            .collect();
        let _ = writeln!(
            out,
            "| KV cache hit rate ({}) | {} |",
            label(r),
            range_avg(&hits, |x| format!("{:.1}%", x * 100.0))
        );
        let _ = writeln!(
            out,
            "| Oracle hit rate (same requests, {}) | {} |",
            label(r),
            range_avg(&oracle, |x| format!("{:.1}%", x * 100.0))
        );
        let peak = rows.iter().max_by(|a, b| {
            a.metrics
                .output_tokens_per_s
                .total_cmp(&b.metrics.output_tokens_per_s)
        });
        if let Some(p) = peak {
            let _ = writeln!(
                out,
                "| Peak throughput ({}) | {:.1} tokens/s at concurrency {} |",
                label(r),
                p.metrics.output_tokens_per_s,
                p.concurrency
            );
        }
        let _ = writeln!(
            out,
            "| Highest concurrency meeting both SLOs (TTFT p95 ≤ 600 ms, TPOT p95 ≤ 60 ms), {} | {} |",
            label(r),
            highest_slo_level(results, r).map_or("none".to_string(), |c| c.to_string())
        );
    }
    out.push('\n');
}

fn has_seed_levels(results: &BenchResults) -> bool {
    results
        .summary
        .iter()
        .any(|r| seed_002(&r.router, r.concurrency).is_some() && results.bench.workers == 3)
}

fn vs(ours: Option<f64>, seed: f64, decimals: usize) -> String {
    match ours {
        None => format!("– / {seed:.decimals$}"),
        Some(o) => {
            let d = if seed != 0.0 {
                (o - seed) / seed * 100.0
            } else {
                0.0
            };
            format!("{o:.decimals$} / {seed:.decimals$} ({d:+.1}%)")
        }
    }
}

/// Our summary beside seed 002's published numbers, per router (`round_robin`, `kv`), with
/// the difference in percent: the calibration loop's view. Cells read `ours / seed (Δ%)`.
pub fn compare_seed_002(results: &BenchResults) -> String {
    let mut out = String::new();
    let mut rr_errors: Vec<(u32, &str, f64)> = Vec::new();
    for router in ["round_robin", "kv"] {
        let rows: Vec<(&Row, SeedSide)> = rows_of(results, router)
            .into_iter()
            .filter_map(|r| seed_002(router, r.concurrency).map(|s| (r, s)))
            .collect();
        if rows.is_empty() {
            continue;
        }
        let _ = writeln!(
            out,
            "**{}** — cells: ours / seed 002 (difference)\n",
            label(router)
        );
        let _ = writeln!(
            out,
            "| Concurrency | TOPS | ITL p50 (ms) | E2E p50 (s) | hit rate (%) | TTFT p50 (ms) | TTFT p95 (ms) | RPS | E2E p95 (s) |"
        );
        let _ = writeln!(
            out,
            "|:---:|:---:|:---:|:---:|:---:|:---:|:---:|:---:|:---:|"
        );
        for (r, s) in &rows {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                r.concurrency,
                vs(Some(r.metrics.output_tokens_per_s), s.tops, 0),
                vs(r.metrics.itl_ms.p50, s.itl_p50_ms, 1),
                vs(r.metrics.e2e_s.p50, s.e2e_p50_s, 1),
                vs(
                    r.metrics.kv_hit_rate.map(|h| h * 100.0),
                    s.hit_rate * 100.0,
                    1
                ),
                vs(r.metrics.ttft_ms.p50, s.ttft_p50_ms, 0),
                vs(r.metrics.ttft_ms.p95, s.ttft_p95_ms, 0),
                vs(Some(r.metrics.requests_per_s), s.rps, 2),
                vs(r.metrics.e2e_s.p95, s.e2e_p95_s, 1),
            );
            if router == "round_robin" {
                let rel = |o: Option<f64>, s: f64| o.map_or(f64::INFINITY, |o| (o - s) / s * 100.0);
                rr_errors.push((
                    r.concurrency,
                    "TOPS",
                    rel(Some(r.metrics.output_tokens_per_s), s.tops),
                ));
                rr_errors.push((
                    r.concurrency,
                    "ITL p50",
                    rel(r.metrics.itl_ms.p50, s.itl_p50_ms),
                ));
                rr_errors.push((
                    r.concurrency,
                    "E2E p50",
                    rel(r.metrics.e2e_s.p50, s.e2e_p50_s),
                ));
            }
        }
        out.push('\n');
    }
    if !rr_errors.is_empty() {
        let within = rr_errors.iter().filter(|e| e.2.abs() <= 10.0).count();
        let worst = rr_errors
            .iter()
            .max_by(|a, b| a.2.abs().total_cmp(&b.2.abs()))
            .map(|e| format!("{} at {}: {:+.1}%", e.1, e.0, e.2))
            .unwrap_or_default();
        let hits: Vec<f64> = rows_of(results, "round_robin")
            .iter()
            .filter(|r| seed_002("round_robin", r.concurrency).is_some())
            .filter_map(|r| r.metrics.kv_hit_rate)
            .collect();
        let mean_hit = if hits.is_empty() {
            "–".to_string()
        } else {
            format!(
                "{:.1}%",
                hits.iter().sum::<f64>() / hits.len() as f64 * 100.0
            )
        };
        let _ = writeln!(
            out,
            "Calibration target (issue 4): RR TOPS, ITL p50 and E2E p50 within ±10% of seed 002 \
             at every level — {within}/{} within; worst {worst}. RR hit rate: mean {mean_hit} \
             (seed 87.8%).\n",
            rr_errors.len()
        );
    }
    out
}
