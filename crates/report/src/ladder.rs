//! The report of seed 003's phase ladder (`kvroute bench --phases`): per hardware setup and
//! concurrency level, what each phase (baseline → KV routing → draft model → EAGLE-3) did to
//! TTFT on turn 1 and on turns 2+, ITL, throughput, acceptance and tokens per step; the SLO
//! table; and plots with one line per phase.

use std::fmt::Write;

use crate::results::{BenchResults, Row, Setup};
use crate::seed002::{SLO_TPOT_P95_MS, SLO_TTFT_P95_MS};
use crate::svg::{Chart, PALETTE, Series, Threshold};

/// The summary rows of `phase` on `setup`, by level.
pub fn rows<'a>(results: &'a BenchResults, setup: &str, phase: &str) -> Vec<&'a Row> {
    crate::results::summary_rows(results, |r| {
        r.setup.as_deref() == Some(setup) && r.phase.as_deref() == Some(phase)
    })
}

fn row<'a>(results: &'a BenchResults, setup: &str, phase: &str, level: u32) -> Option<&'a Row> {
    rows(results, setup, phase)
        .into_iter()
        .find(|r| r.concurrency == level)
}

use crate::results::cell as n;

fn pair(p: Option<crate::Percentiles>, decimals: usize) -> String {
    match p {
        Some(p) => format!("{} / {}", n(p.p50, decimals), n(p.p95, decimals)),
        None => "–".to_string(),
    }
}

fn pct(v: Option<f64>) -> String {
    v.map_or("–".to_string(), |x| format!("{:.1}%", x * 100.0))
}

/// `new` against `old` in percent, lower being better (`−30%`: 30% lower).
fn change(old: Option<f64>, new: Option<f64>) -> String {
    match (old, new) {
        (Some(o), Some(v)) if o > 0.0 => format!("{:+.0}%", (v - o) / o * 100.0),
        _ => "–".to_string(),
    }
}

fn meets_slos(r: &Row) -> bool {
    r.metrics.ttft_ms.p95.is_some_and(|v| v <= SLO_TTFT_P95_MS)
        && r.metrics.tpot_ms.p95.is_some_and(|v| v <= SLO_TPOT_P95_MS)
}

/// The phases and levels of a ladder's results, in order.
fn phases_and_levels(results: &BenchResults) -> (Vec<String>, Vec<u32>) {
    let phases = results
        .bench
        .phases
        .iter()
        .map(|p| p.name.clone())
        .collect();
    (phases, results.bench.levels.clone())
}

/// `report.md` of a ladder.
pub fn markdown(results: &BenchResults, plots: &[String]) -> String {
    let b = &results.bench;
    let (phases, levels) = phases_and_levels(results);
    let mut out = String::new();
    out.push_str("# kvroute bench --phases: seed 003's ladder\n\n");
    let _ = writeln!(
        out,
        "Each phase adds one optimisation to the one before, on the same hardware and the same \
         conversations (seed {}, {} sweep(s) × ({} s warmup + {} s window read as {} snapshot(s) \
         of the last {} s), seed 002's multi-turn chat workload). Simulated by `kvroute bench \
         --phases` in virtual time. TTFT and E2E include {} ms of serving path outside the GPUs \
         (seed 002's fit, docs/CALIBRATION.md). Percentiles: {}.\n",
        b.seed,
        b.sweeps,
        b.warmup_s,
        b.window_s,
        b.snapshots,
        b.snapshot_lookback_s,
        b.path_latency_ms.unwrap_or(0.0),
        b.percentiles
    );
    out.push_str("| phase | router | speculative decoding | what it adds |\n|---|---|---|---|\n");
    for p in &b.phases {
        let _ = writeln!(
            out,
            "| `{}` | `{}` | `{}` | {} |",
            p.name, p.router, p.spec_decode, p.description
        );
    }
    out.push('\n');
    out.push_str(
        "Acceptance is the per-token acceptance probability α the engines observed (accepted \
         draft tokens over the draft positions the target evaluated); tokens/step is output \
         tokens per decode step per sequence, so 1.00 without speculation, and the expected \
         (1 − α^(K+1)) / (1 − α) with it. TTFT turn 1 is the first request of each \
         conversation; turns 2+ resend the conversation's history, which KV-aware routing finds \
         cached. `docs/SPECULATIVE.md` says where the speculative numbers come from.\n\n",
    );
    for setup in &b.setups {
        setup_section(&mut out, results, setup, &phases, &levels);
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

fn setup_section(
    out: &mut String,
    results: &BenchResults,
    setup: &Setup,
    phases: &[String],
    levels: &[u32],
) {
    let _ = writeln!(
        out,
        "## {}: {}\n\n{} workers of `{}` ({} GPU(s) each).\n",
        setup.name, setup.description, setup.workers, setup.profile, setup.gpus_per_worker
    );
    for &level in levels {
        let _ = writeln!(out, "### {level} concurrent conversations\n");
        out.push_str(
            "| phase | TTFT turn 1 p50 / p95 (ms) | TTFT turns 2+ p50 / p95 (ms) | ITL p50 / p95 \
             (ms) | TPOT p95 (ms) | TOPS | KV hit | acceptance | tokens/step | turns 2+ TTFT \
             p50 vs previous | ITL p50 vs previous |\n",
        );
        out.push_str("|---|---|---|---|---|---|---|---|---|---|---|\n");
        let mut previous: Option<&Row> = None;
        for phase in phases {
            let Some(r) = row(results, &setup.name, phase, level) else {
                continue;
            };
            let m = &r.metrics;
            let later = |r: &Row| r.metrics.ttft_later_ms.and_then(|p| p.p50);
            let _ = writeln!(
                out,
                "| `{phase}` | {} | {} | {} | {} | {:.0} | {} | {} | {} | {} | {} |",
                pair(m.ttft_turn1_ms, 0),
                pair(m.ttft_later_ms, 0),
                pair(Some(m.itl_ms), 1),
                n(m.tpot_ms.p95, 1),
                m.output_tokens_per_s,
                pct(m.kv_hit_rate),
                pct(m.acceptance_rate),
                n(m.tokens_per_step, 2),
                previous.map_or("–".into(), |p| change(later(p), later(r))),
                previous.map_or("–".into(), |p| change(p.metrics.itl_ms.p50, m.itl_ms.p50)),
            );
            previous = Some(r);
        }
        out.push('\n');
    }
    let _ = writeln!(
        out,
        "### SLOs (TTFT p95 < {SLO_TTFT_P95_MS:.0} ms and TPOT p95 < {SLO_TPOT_P95_MS:.0} ms)\n"
    );
    let mut header = vec!["phase".to_string()];
    header.extend(levels.iter().map(u32::to_string));
    header.push("highest level meeting both".into());
    let _ = writeln!(out, "| {} |", header.join(" | "));
    let _ = writeln!(
        out,
        "|{}|",
        header.iter().map(|_| "---").collect::<Vec<_>>().join("|")
    );
    for phase in phases {
        let mut cells = vec![format!("`{phase}`")];
        let mut best = None;
        for &level in levels {
            cells.push(match row(results, &setup.name, phase, level) {
                Some(r) if meets_slos(r) => {
                    best = Some(level);
                    format!(
                        "✅ {} / {}",
                        n(r.metrics.ttft_ms.p95, 0),
                        n(r.metrics.tpot_ms.p95, 1)
                    )
                }
                Some(r) => format!(
                    "❌ {} / {}",
                    n(r.metrics.ttft_ms.p95, 0),
                    n(r.metrics.tpot_ms.p95, 1)
                ),
                None => "–".into(),
            });
        }
        cells.push(best.map_or("none".into(), |l| l.to_string()));
        let _ = writeln!(out, "| {} |", cells.join(" | "));
    }
    out.push_str("\n(cells: TTFT p95 ms / TPOT p95 ms)\n\n");
}

/// A plot of a ladder: one line per phase.
struct PlotSpec {
    file: &'static str,
    title: &'static str,
    axis: &'static str,
    get: fn(&Row) -> Option<f64>,
    slo: Option<(f64, &'static str)>,
}

/// The SVG plots of a ladder, per setup: (file name, document).
pub fn plots(results: &BenchResults) -> Vec<(String, String)> {
    let specs = [
        PlotSpec {
            file: "itl_p50",
            title: "ITL p50",
            axis: "ITL p50 (ms)",
            get: |r| r.metrics.itl_ms.p50,
            slo: None,
        },
        PlotSpec {
            file: "ttft_later_p50",
            title: "TTFT p50, turns 2+",
            axis: "TTFT p50 (ms)",
            get: |r| r.metrics.ttft_later_ms.and_then(|p| p.p50),
            slo: None,
        },
        PlotSpec {
            file: "ttft_turn1_p50",
            title: "TTFT p50, turn 1",
            axis: "TTFT p50 (ms)",
            get: |r| r.metrics.ttft_turn1_ms.and_then(|p| p.p50),
            slo: None,
        },
        PlotSpec {
            file: "tpot_p95",
            title: "TPOT p95",
            axis: "TPOT p95 (ms)",
            get: |r| r.metrics.tpot_ms.p95,
            slo: Some((SLO_TPOT_P95_MS, "SLO 60 ms")),
        },
        PlotSpec {
            file: "tops",
            title: "Output tokens per second",
            axis: "output tokens/s",
            get: |r| Some(r.metrics.output_tokens_per_s),
            slo: None,
        },
    ];
    let (phases, _) = phases_and_levels(results);
    let mut out = Vec::new();
    for setup in &results.bench.setups {
        for spec in &specs {
            let series = phases
                .iter()
                .enumerate()
                .map(|(i, phase)| Series {
                    name: phase.clone(),
                    points: rows(results, &setup.name, phase)
                        .iter()
                        .map(|r| (f64::from(r.concurrency), (spec.get)(r)))
                        .collect(),
                    color: PALETTE[i % PALETTE.len()],
                    dashed: false,
                })
                .collect();
            let chart = Chart {
                title: format!("{} by phase: {}", spec.title, setup.name),
                x_label: "concurrent conversations".into(),
                y_label: spec.axis.to_string(),
                series,
                threshold: spec.slo.map(|(value, label)| Threshold {
                    value,
                    label: label.to_string(),
                }),
                y_from_zero: true,
            };
            out.push((format!("{}_{}.svg", setup.name, spec.file), chart.render()));
        }
    }
    out
}
