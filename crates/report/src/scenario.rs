//! Seed 004's scenario cycle in virtual time (`kvroute sim --scenario`): the results file's
//! types, `report.md` and the timeline plot.
//!
//! The simulator fills [`ScenarioResults`]; everything here is a pure function of it, so the
//! committed `docs/results/scenario/` re-renders byte for byte from its `results.json`.
//!
//! Two kinds of latency figures, on purpose:
//! - **the gateway's**: TTFT and ITL observed as the gateway's histograms observe them (TTFT
//!   from the request's arrival at the frontend; ITL per token), labelled by pool, in its
//!   buckets. The per-phase p95, the trailing-window p95 that recovery is judged on, and the
//!   KEDA query's value (`histogram_quantile(0.95, rate(...[5m]))`) are all quantiles of
//!   these histograms, interpolated as Prometheus does;
//! - **the client's**: goodput counts finished requests whose TTFT (with the serving path's
//!   round trip) and mean ITL meet the SLOs, per request.

use std::fmt::Write;

use serde::{Deserialize, Serialize};

use crate::results::Slo;
use crate::svg::{self, Annotations, Band, Chart, Marker, PALETTE, Series, Threshold};

/// One scenario run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScenarioResults {
    pub meta: ScenarioMeta,
    pub phases: Vec<ScenarioPhase>,
    pub events: Vec<ScaleEvent>,
    pub recoveries: Vec<Recovery>,
    pub samples: Vec<ScenarioSample>,
    pub totals: ScenarioTotals,
}

/// What was run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScenarioMeta {
    /// `seed004` or the file's name.
    pub scenario: String,
    pub layout: String,
    pub profile: String,
    pub kv_link: String,
    /// `auto` (the scenario's scaling actions drive the pools; the autoscalers are paused) or
    /// `autoscale` (its actions are ignored; the KEDA autoscalers scale the pools).
    pub mode: String,
    pub cycles: u32,
    pub cycle_s: f64,
    pub seed: u64,
    pub initial_prefill: u32,
    pub initial_decode: u32,
    pub max_prefill: u32,
    pub max_decode: u32,
    pub slo: Slo,
    /// The prefill scaler's threshold on the `pool="prefill"` TTFT p95 (seconds).
    pub ttft_threshold_s: f64,
    /// The decode scaler's threshold on the `pool="decode"` ITL p95 (seconds).
    pub itl_threshold_s: f64,
    pub polling_interval_s: f64,
    /// The KEDA query's `rate()` window.
    pub keda_window_s: f64,
    /// The trailing window of the p95 that recovery is judged on.
    pub recovery_window_s: f64,
    pub sample_interval_s: f64,
    /// How long a new worker takes before it serves.
    pub startup_delay_s: f64,
    /// The serving path's round trip, in the client's TTFT (goodput) only.
    pub path_latency_ms: f64,
}

/// One phase of one cycle.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScenarioPhase {
    pub cycle: u64,
    pub name: String,
    pub start_s: f64,
    pub end_s: f64,
    /// The mix sessions opened in the phase draw from (`A=..,B=..,C=..`).
    pub mix: String,
    /// The session arrival rate at the phase's start.
    pub rate_rps: f64,
    /// Requests that arrived in the phase, and how many of those finished or failed.
    pub requests: u64,
    pub finished: u64,
    pub failed: u64,
    /// The gateway's `pool="prefill"` TTFT p95 over the phase (split requests).
    pub ttft_p95_s: Option<f64>,
    /// The gateway's `pool="decode"` TTFT p95 over the phase (requests prefilled locally).
    pub local_ttft_p95_s: Option<f64>,
    /// The gateway's `pool="decode"` ITL p95 over the phase.
    pub itl_p95_s: Option<f64>,
    /// Finished requests (of those that arrived in the phase) meeting both SLOs, per second
    /// of the phase, and as a share of those finished.
    pub goodput_rps: f64,
    pub goodput_share: Option<f64>,
    pub prefill_start: u32,
    pub prefill_end: u32,
    pub decode_start: u32,
    pub decode_end: u32,
}

/// A pool resized.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScaleEvent {
    pub t_s: f64,
    pub pool: String,
    pub from: u32,
    pub to: u32,
    /// `scenario` (a phase's action) or `autoscaler (REASON)`.
    pub cause: String,
    /// The KEDA query's value the autoscaler decided on.
    pub value: Option<f64>,
    pub phase: String,
}

/// What followed a scale-up.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Recovery {
    pub t_s: f64,
    pub pool: String,
    pub phase: String,
    /// What is judged: the pool's metric's p95 over the trailing recovery window.
    pub metric: String,
    pub threshold_s: f64,
    /// The metric at the last sample before the action.
    pub value_at_action_s: Option<f64>,
    /// Seconds from the action to the first sample at or under the threshold from which it
    /// stays under for a whole recovery window (0 when it was not over at the action);
    /// `None`: never, to the run's end.
    pub recovered_after_s: Option<f64>,
    /// Seconds of the phase left after the action.
    pub phase_left_s: f64,
    /// The worst value between the action and the phase's end.
    pub peak_after_s: Option<f64>,
    /// When it did not recover in the phase: the pool size a steady-state run of the
    /// phase's mix and rate needs to stay under the threshold, as the simulator measured it.
    pub needed: Option<Sizing>,
}

/// A steady-state sizing of one pool for one phase's load.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sizing {
    /// Each size tried and the metric's p95 over the measured stretch.
    pub tried: Vec<(u32, Option<f64>)>,
    /// The smallest size under the threshold, if any was.
    pub size: Option<u32>,
    pub warmup_s: f64,
    pub measured_s: f64,
}

/// The fleet and the metrics at one instant.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScenarioSample {
    pub t_s: f64,
    pub phase: String,
    /// Serving workers (not draining; not starting).
    pub prefill: u32,
    pub decode: u32,
    pub prefill_draining: u32,
    pub decode_draining: u32,
    /// `pool="prefill"` TTFT p95 and `pool="decode"` ITL p95 over the trailing recovery
    /// window.
    pub ttft_p95_s: Option<f64>,
    pub itl_p95_s: Option<f64>,
    /// The KEDA queries' values (the same p95s over the 5-minute window).
    pub keda_ttft_p95_s: Option<f64>,
    pub keda_itl_p95_s: Option<f64>,
    pub in_flight: u64,
}

/// Whole-run counters: every request issued finished, failed (and is counted) or was still
/// in flight when the run stopped.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScenarioTotals {
    pub issued: u64,
    pub finished: u64,
    pub failed: u64,
    pub in_flight_at_end: u64,
    pub workers_added: u64,
    pub workers_retired: u64,
    /// Session arrivals the workload refused (over its open-session bound).
    pub arrivals_dropped: u64,
}

fn secs_ms(v: Option<f64>) -> String {
    v.map_or("–".into(), |s| format!("{:.0}", s * 1e3))
}

fn secs_ms1(v: Option<f64>) -> String {
    v.map_or("–".into(), |s| format!("{:.1}", s * 1e3))
}

/// `report.md`.
pub fn markdown(r: &ScenarioResults) -> String {
    let m = &r.meta;
    let mut s = String::new();
    let _ = writeln!(s, "# Scenario `{}` in virtual time\n", m.scenario);
    let mode = if m.mode == "auto" {
        "auto mode: the scenario's scaling actions drive the pools; the autoscalers are paused"
    } else {
        "manual mode (`--autoscale`): the scenario's mixes and rates run, its scaling actions \
         are ignored, and the KEDA autoscalers scale the pools"
    };
    let _ = writeln!(
        s,
        "Layout `{}` ({}, KV over {}), {} cycle(s) of {:.0} s, seed {}; {mode}. Initial pools \
         {}P:{}D, at most {}P:{}D; a new worker serves after {:.0} s, with an empty cache; a \
         worker leaving drains first (the newest leaves first).\n",
        m.layout,
        m.profile,
        m.kv_link,
        m.cycles,
        m.cycle_s,
        m.seed,
        m.initial_prefill,
        m.initial_decode,
        m.max_prefill,
        m.max_decode,
        m.startup_delay_s,
    );
    let _ = writeln!(
        s,
        "Latencies are the gateway's histograms (TTFT from arrival at the frontend, \
         `pool=\"prefill\"` for split requests; ITL per token, `pool=\"decode\"`), in its \
         buckets, with Prometheus' interpolation. Thresholds: TTFT p95 {:.0} ms, ITL p95 {:.0} \
         ms. Recovery is judged on the p95 over the trailing {:.0} s (sampled every {:.0} s): \
         recovered once it is at or under the threshold and stays there for that long; the \
         KEDA query reads {:.0} s. Goodput: finished requests meeting TTFT {:.0} ms (the \
         client's, with {:.0} ms of serving path) and mean ITL {:.0} ms.\n",
        m.ttft_threshold_s * 1e3,
        m.itl_threshold_s * 1e3,
        m.recovery_window_s,
        m.sample_interval_s,
        m.keda_window_s,
        m.slo.ttft_ms,
        m.path_latency_ms,
        m.slo.itl_ms,
    );
    let _ = writeln!(s, "![timeline](timeline.svg)\n");
    let _ = writeln!(s, "## Phases\n");
    let _ = writeln!(
        s,
        "| cycle | phase | from–to (s) | mix | rate (sessions/s) | requests | failed | TTFT p95 prefill (ms) | TTFT p95 local (ms) | ITL p95 (ms) | goodput (req/s) | goodput share | P | D |"
    );
    let _ = writeln!(
        s,
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    );
    for p in &r.phases {
        let pool = |a: u32, b: u32| {
            if a == b {
                a.to_string()
            } else {
                format!("{a}→{b}")
            }
        };
        let _ = writeln!(
            s,
            "| {} | {} | {:.0}–{:.0} | {} | {:.2} | {} | {} | {} | {} | {} | {:.2} | {} | {} | {} |",
            p.cycle,
            p.name,
            p.start_s,
            p.end_s,
            p.mix,
            p.rate_rps,
            p.requests,
            p.failed,
            secs_ms(p.ttft_p95_s),
            secs_ms(p.local_ttft_p95_s),
            secs_ms1(p.itl_p95_s),
            p.goodput_rps,
            p.goodput_share
                .map_or("–".into(), |g| format!("{:.0}%", g * 100.0)),
            pool(p.prefill_start, p.prefill_end),
            pool(p.decode_start, p.decode_end),
        );
    }
    let _ = writeln!(s, "\n## Scaling events\n");
    if r.events.is_empty() {
        let _ = writeln!(s, "None.");
    } else {
        let _ = writeln!(
            s,
            "| t (s) | phase | pool | from | to | cause | KEDA value |"
        );
        let _ = writeln!(s, "|---|---|---|---|---|---|---|");
        for e in &r.events {
            let _ = writeln!(
                s,
                "| {:.0} | {} | {} | {} | {} | {} | {} |",
                e.t_s,
                e.phase,
                e.pool,
                e.from,
                e.to,
                e.cause,
                e.value.map_or("–".into(), |v| format!("{v:.3}")),
            );
        }
    }
    let _ = writeln!(s, "\n## Recovery after each scale-up\n");
    if r.recoveries.is_empty() {
        let _ = writeln!(s, "No scale-up happened.");
    }
    for x in &r.recoveries {
        let metric = format!("{} (threshold {:.0} ms)", x.metric, x.threshold_s * 1e3);
        let at = secs_ms1(x.value_at_action_s);
        let verdict = match x.recovered_after_s {
            Some(0.0) => format!("it was not over the threshold ({at} ms) when the pool grew"),
            Some(after) if after <= x.phase_left_s => format!(
                "**recovered after {after:.0} s** (from {at} ms), {:.0} s before the phase ended",
                x.phase_left_s - after
            ),
            Some(after) => format!(
                "**not recovered within the phase** ({:.0} s left; {at} ms at the action, worst \
                 {} ms after it); back under {after:.0} s after the action, in a later phase",
                x.phase_left_s,
                secs_ms1(x.peak_after_s)
            ),
            None => format!(
                "**not recovered** to the run's end ({at} ms at the action, worst {} ms in the \
                 phase after it)",
                secs_ms1(x.peak_after_s)
            ),
        };
        let _ = writeln!(
            s,
            "- {:.0} s, {} pool in {}: {metric}: {verdict}.",
            x.t_s, x.pool, x.phase
        );
        if let Some(n) = &x.needed {
            let tried: Vec<String> = n
                .tried
                .iter()
                .map(|(size, v)| format!("{size}: {} ms", secs_ms1(*v)))
                .collect();
            let answer = match n.size {
                Some(size) => format!("**{size} {} workers** would hold it", x.pool),
                None => "no size tried holds it".to_string(),
            };
            let _ = writeln!(
                s,
                "  - Sizing (steady state of the phase's mix and rate, {:.0} s warm-up, p95 over \
                 {:.0} s): {}; {answer}.",
                n.warmup_s,
                n.measured_s,
                tried.join(", ")
            );
        }
    }
    let t = &r.totals;
    let _ = writeln!(
        s,
        "\n## Totals\n\n{} requests issued: {} finished, {} failed, {} in flight when the run \
         stopped (none lost); {} session arrivals refused over the open-session bound. {} \
         workers added, {} drained and retired.",
        t.issued,
        t.finished,
        t.failed,
        t.in_flight_at_end,
        t.arrivals_dropped,
        t.workers_added,
        t.workers_retired
    );
    s
}

fn phase_bands(r: &ScenarioResults) -> Vec<Band> {
    r.phases
        .iter()
        .map(|p| Band {
            from: p.start_s,
            to: p.end_s,
            label: p.name.clone(),
        })
        .collect()
}

fn markers(r: &ScenarioResults) -> Vec<Marker> {
    r.events
        .iter()
        .map(|e| Marker {
            x: e.t_s,
            label: format!("{} {}→{}", &e.pool[..1].to_uppercase(), e.from, e.to),
            color: if e.pool == "prefill" {
                PALETTE[0]
            } else {
                PALETTE[1]
            },
        })
        .collect()
}

/// `timeline.svg`: TTFT p95 and ITL p95 over time (trailing window and KEDA's 5 minutes)
/// against their thresholds, and the pools' sizes; phases as bands, scaling events as
/// vertical lines.
pub fn timeline_svg(r: &ScenarioResults) -> String {
    let m = &r.meta;
    let series = |name: String, f: fn(&ScenarioSample) -> Option<f64>, color, dashed| Series {
        name,
        points: r.samples.iter().map(|x| (x.t_s, f(x))).collect(),
        color,
        dashed,
    };
    let x_label = "simulated time (s)".to_string();
    let charts = [
        Chart {
            title: "TTFT p95, pool=\"prefill\"".into(),
            x_label: x_label.clone(),
            y_label: "TTFT p95 (ms)".into(),
            series: vec![
                series(
                    format!("{:.0} s", m.recovery_window_s),
                    |x| x.ttft_p95_s.map(|s| s * 1e3),
                    PALETTE[0],
                    false,
                ),
                series(
                    format!("KEDA {:.0} s", m.keda_window_s),
                    |x| x.keda_ttft_p95_s.map(|s| s * 1e3),
                    PALETTE[0],
                    true,
                ),
            ],
            threshold: Some(Threshold {
                value: m.ttft_threshold_s * 1e3,
                label: format!("threshold {:.0} ms", m.ttft_threshold_s * 1e3),
            }),
            y_from_zero: true,
        },
        Chart {
            title: "ITL p95, pool=\"decode\"".into(),
            x_label: x_label.clone(),
            y_label: "ITL p95 (ms)".into(),
            series: vec![
                series(
                    format!("{:.0} s", m.recovery_window_s),
                    |x| x.itl_p95_s.map(|s| s * 1e3),
                    PALETTE[1],
                    false,
                ),
                series(
                    format!("KEDA {:.0} s", m.keda_window_s),
                    |x| x.keda_itl_p95_s.map(|s| s * 1e3),
                    PALETTE[1],
                    true,
                ),
            ],
            threshold: Some(Threshold {
                value: m.itl_threshold_s * 1e3,
                label: format!("threshold {:.0} ms", m.itl_threshold_s * 1e3),
            }),
            y_from_zero: true,
        },
        Chart {
            title: "Pool sizes (serving workers)".into(),
            x_label,
            y_label: "workers".into(),
            series: vec![
                series(
                    "prefill".into(),
                    |x| Some(f64::from(x.prefill)),
                    PALETTE[0],
                    false,
                ),
                series(
                    "decode".into(),
                    |x| Some(f64::from(x.decode)),
                    PALETTE[1],
                    false,
                ),
                series(
                    "draining".into(),
                    |x| Some(f64::from(x.prefill_draining + x.decode_draining)),
                    PALETTE[3],
                    true,
                ),
            ],
            threshold: None,
            y_from_zero: true,
        },
    ];
    let annotations = Annotations {
        bands: phase_bands(r),
        markers: markers(r),
    };
    svg::stack_annotated(&charts, &annotations)
}

/// Every file of the report: `(name, contents)`.
pub fn files(r: &ScenarioResults) -> Vec<(String, String)> {
    vec![
        ("report.md".into(), markdown(r)),
        ("timeline.svg".into(), timeline_svg(r)),
    ]
}
