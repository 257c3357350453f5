//! The report of `kvroute bench --disagg`: aggregated and disaggregated fleets of the same
//! GPU count, per workload and load (closed-loop concurrency levels, open-loop arrival
//! rates): TTFT and ITL p50/p95, goodput against the SLOs, throughput, the routes conditional
//! disaggregation took and the KV it moved; goodput against the arrival rate per layout; plots
//! with one line per layout.

use std::fmt::Write;

use crate::results::{BenchResults, DisaggMeta, Row};
use crate::svg::{Chart, PALETTE, Series, Threshold};

/// One load a comparison ran at: a closed loop's conversations open at once, or an open
/// loop's arrival rate (sessions per second).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Load {
    Concurrency(u32),
    Rate(f64),
}

impl Load {
    fn matches(self, r: &Row) -> bool {
        match self {
            Load::Concurrency(c) => r.rate_rps.is_none() && r.concurrency == c,
            Load::Rate(x) => r.rate_rps == Some(x),
        }
    }

    /// A table heading.
    fn heading(self) -> String {
        match self {
            Load::Concurrency(c) => format!("{c} concurrent conversations (closed loop)"),
            Load::Rate(x) => format!("{x} sessions/s arriving (open loop, Poisson)"),
        }
    }

    /// A table cell.
    pub fn label(self) -> String {
        match self {
            Load::Concurrency(c) => format!("{c} conv."),
            Load::Rate(x) => format!("{x}/s"),
        }
    }
}

/// Every load of the results: the closed loop's levels, then the open loop's rates.
pub fn loads(results: &BenchResults) -> Vec<Load> {
    let rates = results.bench.disagg.as_ref().map_or(&[][..], |d| &d.rates);
    (results.bench.levels.iter().map(|&c| Load::Concurrency(c)))
        .chain(rates.iter().map(|&x| Load::Rate(x)))
        .collect()
}

/// The closed-loop summary rows of `layout` on `workload`, by level.
pub fn rows<'a>(results: &'a BenchResults, workload: &str, layout: &str) -> Vec<&'a Row> {
    crate::results::summary_rows(results, |r| {
        r.rate_rps.is_none()
            && r.workload.as_deref() == Some(workload)
            && r.layout.as_deref() == Some(layout)
    })
}

/// The open-loop summary rows of `layout` on `workload`, by rate.
pub fn rate_rows<'a>(results: &'a BenchResults, workload: &str, layout: &str) -> Vec<&'a Row> {
    let mut rows = crate::results::summary_rows(results, |r| {
        r.rate_rps.is_some()
            && r.workload.as_deref() == Some(workload)
            && r.layout.as_deref() == Some(layout)
    });
    rows.sort_by(|a, b| {
        a.rate_rps
            .unwrap_or(0.0)
            .total_cmp(&b.rate_rps.unwrap_or(0.0))
    });
    rows
}

/// The summary row of `layout` on `workload` at `load`.
pub fn row<'a>(
    results: &'a BenchResults,
    workload: &str,
    layout: &str,
    load: Load,
) -> Option<&'a Row> {
    results.summary.iter().find(|r| {
        load.matches(r)
            && r.workload.as_deref() == Some(workload)
            && r.layout.as_deref() == Some(layout)
    })
}

use crate::results::cell as n;

fn pair(p: crate::Percentiles, decimals: usize) -> String {
    format!("{} / {}", n(p.p50, decimals), n(p.p95, decimals))
}

fn pct(v: Option<f64>) -> String {
    v.map_or("–".to_string(), |x| format!("{:.0}%", x * 100.0))
}

/// Goodput of a row, requests per second (0 without the serving block).
pub fn goodput(r: &Row) -> f64 {
    r.metrics.serving.as_ref().map_or(0.0, |s| s.goodput_rps)
}

/// `new` against `old` in percent, higher being better.
fn gain(old: f64, new: f64) -> String {
    if old > 0.0 {
        format!("{:+.0}%", (new - old) / old * 100.0)
    } else if new > 0.0 {
        "+∞".to_string()
    } else {
        "–".to_string()
    }
}

/// `report.md` of a disaggregation benchmark.
pub fn markdown(results: &BenchResults, plots: &[String]) -> String {
    let b = &results.bench;
    let mut out = String::new();
    out.push_str("# kvroute bench --disagg: aggregated vs disaggregated fleets\n\n");
    let Some(d) = &b.disagg else {
        out.push_str("(no disaggregation metadata in these results)\n");
        return out;
    };
    let _ = writeln!(
        out,
        "Every layout has the same GPUs: `{}` workers (one GPU each), either all aggregated \
         or split into a prefill pool and a decode pool. KV moves from the prefill pool to \
         the decode pool over {}{}; a decode worker prefills a request itself when at most {} \
         of its prompt tokens are uncached there (conditional disaggregation, \
         `router::DisaggFrontend`). Same conversations for every layout (seed {}, {} \
         sweep(s) × ({} s warmup + {} s window read as {} snapshot(s) of the last {} s)); \
         TTFT and E2E include {} ms of serving path outside the GPUs. Simulated in virtual \
         time; percentiles: {}.\n",
        b.profile,
        d.kv_link,
        match d.kv_link_sharing.as_deref() {
            Some("shared") => ", concurrent transfers sharing each worker's port fairly",
            Some(_) => ", each transfer with the whole link to itself",
            None => "",
        },
        d.local_prefill_max_tokens,
        b.seed,
        b.sweeps,
        b.warmup_s,
        b.window_s,
        b.snapshots,
        b.snapshot_lookback_s,
        b.path_latency_ms.unwrap_or(0.0),
        b.percentiles
    );
    let _ = writeln!(
        out,
        "**Goodput** is the finished requests per second that met both SLOs: TTFT ≤ {:.0} ms \
         and mean ITL ≤ {:.0} ms (seed 004's KEDA thresholds for the prefill and decode pools, \
         applied per request). Routes count finished requests: *split* (prefilled on the \
         prefill pool, KV transferred), *local* (prefilled on the decode worker: short \
         uncached prompt, or no prefill worker free in time). TTFT split / local: TTFT of each \
         kind. Transfer: the modelled time of a split request's KV transfer and its size.\n",
        d.slo.ttft_ms, d.slo.itl_ms
    );
    if !d.rates.is_empty() {
        let rates: Vec<String> = d.rates.iter().map(f64::to_string).collect();
        let _ = writeln!(
            out,
            "**Open loop**: besides the closed loop's conversations, every layout served each \
             workload at {} sessions arriving per second (Poisson, the same arrivals for every \
             layout; a B or C session is one request, an A session a whole conversation), one \
             cold run per rate and sweep with the same warmup and window. The rate does not \
             slow down when the fleet does, so a saturated layout shows as a growing queue: \
             TTFT climbs and goodput falls below the rate.\n",
            rates.join(", ")
        );
    }
    layouts_table(&mut out, d);
    for workload in &d.workloads {
        workload_section(&mut out, results, d, workload);
    }
    if !plots.is_empty() {
        out.push_str("## Plots\n\n");
        for p in plots {
            let _ = writeln!(out, "![{p}]({p})");
        }
        out.push('\n');
    }
    out
}

fn layouts_table(out: &mut String, d: &DisaggMeta) {
    out.push_str("| layout | aggregated | prefill | decode | GPUs |\n|---|---|---|---|---|\n");
    for l in &d.layouts {
        let _ = writeln!(
            out,
            "| `{}` | {} | {} | {} | {} |",
            l.name, l.aggregated, l.prefill, l.decode, l.gpus
        );
    }
    out.push('\n');
}

fn workload_section(out: &mut String, results: &BenchResults, d: &DisaggMeta, workload: &str) {
    let loads = loads(results);
    let _ = writeln!(out, "## Workload `{workload}`\n");
    let baseline = d.layouts.first().map(|l| l.name.as_str()).unwrap_or("");
    if !d.rates.is_empty() {
        rate_table(out, results, d, workload);
    }
    for &level in &loads {
        let _ = writeln!(out, "### {}\n", level.heading());
        out.push_str(
            "| layout | TTFT p50 / p95 (ms) | ITL p50 / p95 (ms) | goodput (req/s) | met SLOs \
             | goodput vs first | TOPS | req/s | split / local | TTFT split p50 / local p50 \
             (ms) | transfer p50 (ms) | MB per transfer | prefill / decode GPU util |\n",
        );
        out.push_str("|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
        let base = row(results, workload, baseline, level).map(goodput);
        for l in &d.layouts {
            let Some(r) = row(results, workload, &l.name, level) else {
                continue;
            };
            let m = &r.metrics;
            let s = m.serving.clone().unwrap_or_default();
            let routes = if s.routed() > 0.0 {
                format!("{:.0} / {:.0}", s.split, s.routed() - s.split)
            } else {
                "–".to_string()
            };
            let util = match (s.prefill_utilisation, s.decode_utilisation) {
                (None, None) => format!("{} (all)", pct(Some(r.balance.utilisation))),
                (p, d) => format!("{} / {}", pct(p), pct(d)),
            };
            let _ = writeln!(
                out,
                "| `{}` | {} | {} | {:.2} | {} | {} | {:.0} | {:.2} | {} | {} / {} | {} | {} | {} |",
                l.name,
                pair(m.ttft_ms, 0),
                pair(m.itl_ms, 1),
                s.goodput_rps,
                pct(s.goodput_share),
                if l.name == baseline {
                    "–".to_string()
                } else {
                    base.map_or("–".into(), |b| gain(b, s.goodput_rps))
                },
                m.output_tokens_per_s,
                m.requests_per_s,
                routes,
                n(s.ttft_split_ms.p50, 0),
                n(s.ttft_local_ms.p50, 0),
                n(s.kv_transfer_ms.p50, 1),
                n(s.kv_transfer_mb, 0),
                util,
            );
        }
        out.push('\n');
    }
    // The best layout per level, by goodput (ties: the earlier layout).
    let _ = writeln!(out, "### Best layout by goodput, `{workload}`\n");
    out.push_str("| load | best | goodput (req/s) | first layout's goodput |\n|---|---|---|---|\n");
    for &level in &loads {
        let mut best: Option<(&str, f64)> = None;
        for l in &d.layouts {
            if let Some(r) = row(results, workload, &l.name, level) {
                let g = goodput(r);
                if best.is_none_or(|(_, b)| g > b) {
                    best = Some((&l.name, g));
                }
            }
        }
        if let Some((name, g)) = best {
            let base = row(results, workload, baseline, level).map(goodput);
            let _ = writeln!(
                out,
                "| {} | `{name}` | {g:.2} | {} |",
                level.label(),
                n(base, 2)
            );
        }
    }
    out.push('\n');
}

/// Goodput against the open loop's arrival rate, one column per layout (the best in bold),
/// with the requests per second each layout finished: where a layout's goodput stops
/// following the rate, it is saturated.
fn rate_table(out: &mut String, results: &BenchResults, d: &DisaggMeta, workload: &str) {
    let _ = writeln!(out, "### Goodput against the arrival rate, `{workload}`\n");
    out.push_str(
        "Open loop: sessions arrive Poisson at the rate whatever the fleet serves. Each cell: \
         goodput (req/s) / finished req/s.\n\n| sessions/s |",
    );
    for l in &d.layouts {
        let _ = write!(out, " `{}` |", l.name);
    }
    out.push_str("\n|---|");
    for _ in &d.layouts {
        out.push_str("---|");
    }
    out.push('\n');
    for &rate in &d.rates {
        let load = Load::Rate(rate);
        let cells: Vec<Option<&Row>> = d
            .layouts
            .iter()
            .map(|l| row(results, workload, &l.name, load))
            .collect();
        let best = cells
            .iter()
            .map(|r| r.map_or(0.0, goodput))
            .fold(0.0, f64::max);
        let _ = write!(out, "| {rate} |");
        for r in cells {
            let _ = match r {
                Some(r) if best > 0.0 && goodput(r) == best => write!(
                    out,
                    " **{:.2}** / {:.2} |",
                    goodput(r),
                    r.metrics.requests_per_s
                ),
                Some(r) => write!(
                    out,
                    " {:.2} / {:.2} |",
                    goodput(r),
                    r.metrics.requests_per_s
                ),
                None => write!(out, " – |"),
            };
        }
        out.push('\n');
    }
    out.push('\n');
}

/// One plot: a metric against the load level, one line per layout.
struct PlotSpec {
    file: &'static str,
    title: &'static str,
    axis: &'static str,
    get: fn(&Row) -> Option<f64>,
    slo: fn(&DisaggMeta) -> Option<f64>,
}

/// The SVG plots of a disaggregation benchmark, per workload: (file name, document).
pub fn plots(results: &BenchResults) -> Vec<(String, String)> {
    let Some(d) = &results.bench.disagg else {
        return Vec::new();
    };
    let specs = [
        PlotSpec {
            file: "goodput",
            title: "Goodput (requests meeting both SLOs)",
            axis: "goodput (req/s)",
            get: |r| Some(goodput(r)),
            slo: |_| None,
        },
        PlotSpec {
            file: "ttft_p95",
            title: "TTFT p95",
            axis: "TTFT p95 (ms)",
            get: |r| r.metrics.ttft_ms.p95,
            slo: |d| Some(d.slo.ttft_ms),
        },
        PlotSpec {
            file: "itl_p95",
            title: "ITL p95",
            axis: "ITL p95 (ms)",
            get: |r| r.metrics.itl_ms.p95,
            slo: |d| Some(d.slo.itl_ms),
        },
        PlotSpec {
            file: "tops",
            title: "Output tokens per second",
            axis: "output tokens/s",
            get: |r| Some(r.metrics.output_tokens_per_s),
            slo: |_| None,
        },
    ];
    let mut out = Vec::new();
    // (file infix, x axis, the rows and their x): the closed loop, then the open loop.
    type Axis = fn(&BenchResults, &str, &str) -> Vec<(f64, Row)>;
    let axes: [(&str, &str, Axis, bool); 2] = [
        (
            "",
            "concurrent conversations",
            |res, w, l| {
                rows(res, w, l)
                    .into_iter()
                    .map(|r| (f64::from(r.concurrency), r.clone()))
                    .collect()
            },
            !results.bench.levels.is_empty(),
        ),
        (
            "rate_",
            "arrival rate (sessions/s, open loop)",
            |res, w, l| {
                rate_rows(res, w, l)
                    .into_iter()
                    .map(|r| (r.rate_rps.unwrap_or(0.0), r.clone()))
                    .collect()
            },
            !d.rates.is_empty(),
        ),
    ];
    for workload in &d.workloads {
        for &(infix, x_label, points_of, present) in &axes {
            if !present {
                continue;
            }
            for spec in &specs {
                let series = d
                    .layouts
                    .iter()
                    .enumerate()
                    .map(|(i, l)| Series {
                        name: l.name.clone(),
                        points: points_of(results, workload, &l.name)
                            .iter()
                            .map(|(x, r)| (*x, (spec.get)(r)))
                            .collect(),
                        color: PALETTE[i % PALETTE.len()],
                        dashed: l.aggregated > 0,
                    })
                    .collect();
                let chart = Chart {
                    title: format!("{} by layout: {workload}", spec.title),
                    x_label: x_label.into(),
                    y_label: spec.axis.to_string(),
                    series,
                    threshold: (spec.slo)(d).map(|value| Threshold {
                        value,
                        label: format!("SLO {value:.0} ms"),
                    }),
                    y_from_zero: true,
                };
                out.push((
                    format!("{workload}_{infix}{}.svg", spec.file),
                    chart.render(),
                ));
            }
        }
    }
    out
}
