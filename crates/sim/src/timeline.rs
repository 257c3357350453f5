//! A per-worker timeline of a run, sampled on a fixed virtual-time grid.
//!
//! Averages over a measurement window hide how a router fails: one worker briefly holding
//! more requests than its batch limit while another has free slots. The timeline shows it.
//! Every `interval` of virtual time (instants `k × interval`, `k ≥ 1`, up to the run's end)
//! it records, per worker, the requests in flight as the router accounts them, the engine's
//! running and waiting counts, its KV blocks in use and the largest TTFT of its requests
//! whose first token came in the interval just ended; and, for the fleet, the frontend queue
//! and the TTFT percentiles of every first token in the interval.
//!
//! A sample at `T` sees every event at times `≤ T` and none after (the same convention as
//! the measurement windows). It is off by default: [`Simulation::with_timeline`] turns it on,
//! and a run without it pays one comparison per event.
//!
//! # Bounds
//!
//! Rows (samples × workers) are bounded by [`TimelineConfig::max_rows`]: a run whose grid
//! would need more is refused when the timeline is enabled ([`TimelineError::TooManyRows`]),
//! so memory is known before the run starts (about 40 bytes a row). The TTFT values of one
//! interval are held until its sample is taken, so at most the first tokens of one interval.
//!
//! [`Simulation::with_timeline`]: crate::Simulation::with_timeline

use std::fmt::Write;

use nanotime::Nanos;
use report::svg::{Chart, PALETTE, Series, Threshold};
use report::{Percentiles, SLO_TTFT_P95_MS};
use serde::Serialize;
use thiserror::Error;

/// How often to sample and how much to keep.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TimelineConfig {
    /// Virtual time between samples.
    pub interval: Nanos,
    /// Most rows (samples × workers) a run may keep.
    pub max_rows: usize,
}

impl TimelineConfig {
    /// Default bound on rows: a million (about 40 MB), e.g. 3 workers for 92 hours at 1 s or
    /// 1,000 workers for 16 minutes.
    pub const DEFAULT_MAX_ROWS: usize = 1_000_000;
}

impl Default for TimelineConfig {
    /// One sample a second, at most [`TimelineConfig::DEFAULT_MAX_ROWS`] rows.
    fn default() -> Self {
        Self {
            interval: Nanos::from_secs(1),
            max_rows: Self::DEFAULT_MAX_ROWS,
        }
    }
}

/// A timeline the simulator refuses to record.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum TimelineError {
    #[error("the timeline's sampling interval must be longer than zero")]
    ZeroInterval,
    #[error(
        "the timeline would keep {samples} samples × {workers} workers = {rows} rows, more than \
         its bound of {max_rows}; sample less often or run shorter"
    )]
    TooManyRows {
        samples: u64,
        workers: u32,
        rows: u128,
        max_rows: usize,
    },
}

/// One worker at one sample instant.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct WorkerSample {
    /// Requests routed to it and not finished, as the router accounts them.
    pub in_flight: u32,
    /// Requests in the engine's running batch (at most `max_num_seqs`).
    pub running: u32,
    /// Requests queued inside the engine, waiting for admission (preempted ones included).
    pub waiting: u32,
    /// KV blocks referenced by its requests.
    pub kv_blocks_used: u32,
    /// Prompt tokens the router believes it still has to prefill.
    pub pending_prefill_tokens: u64,
    /// Its requests whose first token came in `(at − interval, at]`.
    pub first_tokens: u32,
    /// Their largest client-side TTFT, in ms (`None` without any).
    pub ttft_max_ms: Option<f64>,
}

/// The fleet at one sample instant.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Sample {
    pub at: Nanos,
    /// Turns waiting at the frontend (not routed yet).
    pub queued: u32,
    /// Requests whose first token came in `(at − interval, at]`, on any worker.
    pub first_tokens: u32,
    /// Their client-side TTFT, in ms: nearest-rank percentiles and the largest (`None`
    /// without any). With fewer than 20 first tokens p95 is the largest.
    pub ttft_p50_ms: Option<f64>,
    pub ttft_p95_ms: Option<f64>,
    pub ttft_max_ms: Option<f64>,
    /// One entry per worker, by worker id.
    pub workers: Vec<WorkerSample>,
}

/// Every sample of a run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Timeline {
    pub interval: Nanos,
    /// The engines' batch limit (the chart's threshold).
    pub max_num_seqs: u32,
    pub samples: Vec<Sample>,
}

/// Column names of [`Timeline::to_csv`].
pub const CSV_HEADER: &str = "time_s,worker,in_flight,running,waiting,kv_blocks_used,\
pending_prefill_tokens,first_tokens,ttft_max_ms,queued,fleet_first_tokens,fleet_ttft_p50_ms,\
fleet_ttft_p95_ms,fleet_ttft_max_ms";

fn opt(v: Option<f64>) -> String {
    v.map_or(String::new(), |x| format!("{x:.1}"))
}

impl Timeline {
    /// One row per sample per worker, ordered by time then worker. The fleet columns
    /// (`queued`, `fleet_*`) repeat on every worker's row of a sample; an empty TTFT means no
    /// first token in that interval.
    pub fn to_csv(&self) -> String {
        let mut s = String::with_capacity(80 * (1 + self.rows()));
        s.push_str(CSV_HEADER);
        s.push('\n');
        for sample in &self.samples {
            let t = sample.at.as_secs_f64();
            let fleet = format!(
                "{},{},{},{},{}",
                sample.queued,
                sample.first_tokens,
                opt(sample.ttft_p50_ms),
                opt(sample.ttft_p95_ms),
                opt(sample.ttft_max_ms)
            );
            for (w, ws) in sample.workers.iter().enumerate() {
                let _ = writeln!(
                    s,
                    "{t:.3},{w},{},{},{},{},{},{},{},{fleet}",
                    ws.in_flight,
                    ws.running,
                    ws.waiting,
                    ws.kv_blocks_used,
                    ws.pending_prefill_tokens,
                    ws.first_tokens,
                    opt(ws.ttft_max_ms),
                );
            }
        }
        s
    }

    /// Rows kept: samples × workers.
    pub fn rows(&self) -> usize {
        self.samples.iter().map(|s| s.workers.len()).sum()
    }

    /// Three charts over the samples in `[from, to]` seconds (`None`: the whole run), titled
    /// `title`, one colour per worker: requests in flight against `max_num_seqs`; requests
    /// waiting inside each engine; each worker's largest TTFT of the interval against the
    /// seed's 600 ms SLO (a gap: no first token there). With more workers than the palette
    /// has colours, the busiest (highest peak in flight) are drawn.
    pub fn charts(&self, title: &str, window: Option<(f64, f64)>) -> [Chart; 3] {
        let samples: Vec<&Sample> = self
            .samples
            .iter()
            .filter(|s| {
                let t = s.at.as_secs_f64();
                window.is_none_or(|(from, to)| t >= from && t <= to)
            })
            .collect();
        let workers = samples.first().map_or(0, |s| s.workers.len());
        let mut drawn: Vec<usize> = (0..workers).collect();
        if workers > PALETTE.len() {
            let peak = |w: usize| samples.iter().map(|s| s.workers[w].in_flight).max();
            // Busiest first; ties by id so the choice is deterministic.
            drawn.sort_by_key(|&w| (std::cmp::Reverse(peak(w)), w));
            drawn.truncate(PALETTE.len());
            drawn.sort_unstable();
        }
        let per_worker = |f: fn(&WorkerSample) -> Option<f64>| -> Vec<Series> {
            drawn
                .iter()
                .enumerate()
                .map(|(k, &w)| Series {
                    name: format!("worker {w}"),
                    points: samples
                        .iter()
                        .map(|s| (s.at.as_secs_f64(), f(&s.workers[w])))
                        .collect(),
                    color: PALETTE[k],
                    dashed: false,
                })
                .collect()
        };
        let shown = if drawn.len() < workers {
            format!(" ({} busiest of {workers} workers)", drawn.len())
        } else {
            String::new()
        };
        let x_label = "simulated time (s)".to_string();
        let secs = self.interval.as_secs_f64();
        [
            Chart {
                title: format!("{title}: in flight per worker{shown}"),
                x_label: x_label.clone(),
                y_label: "requests in flight (router)".into(),
                series: per_worker(|w| Some(f64::from(w.in_flight))),
                threshold: Some(Threshold {
                    value: f64::from(self.max_num_seqs),
                    label: format!("max_num_seqs {}", self.max_num_seqs),
                }),
                y_from_zero: false,
            },
            Chart {
                title: format!("{title}: waiting in each engine"),
                x_label: x_label.clone(),
                y_label: "requests waiting (engine)".into(),
                series: per_worker(|w| Some(f64::from(w.waiting))),
                threshold: None,
                y_from_zero: true,
            },
            Chart {
                title: format!("{title}: largest TTFT per worker per {secs} s"),
                x_label,
                y_label: "TTFT (ms)".into(),
                series: per_worker(|w| w.ttft_max_ms),
                threshold: Some(Threshold {
                    value: SLO_TTFT_P95_MS,
                    label: format!("SLO {SLO_TTFT_P95_MS} ms"),
                }),
                y_from_zero: true,
            },
        ]
    }
}

/// What the simulator keeps while a timeline is on.
#[derive(Debug)]
pub(crate) struct Recorder {
    timeline: Timeline,
    /// The last instant of the grid (the run's end, rounded down).
    last: Nanos,
    /// TTFTs (ms) of first tokens since the previous sample.
    ttfts: Vec<f64>,
    /// Per worker since the previous sample: first tokens and their largest TTFT (ms).
    worker_ttft: Vec<(u32, Option<f64>)>,
}

impl Recorder {
    /// A recorder sampling from the first grid instant after `now` to `end`, for `workers`
    /// workers; refuses a grid over `cfg.max_rows` rows.
    pub(crate) fn new(
        cfg: TimelineConfig,
        now: Nanos,
        end: Nanos,
        workers: u32,
        max_num_seqs: u32,
    ) -> Result<(Self, Nanos), TimelineError> {
        if cfg.interval == Nanos::ZERO {
            return Err(TimelineError::ZeroInterval);
        }
        let step = cfg.interval.0;
        let first = now.0 / step + 1;
        let last = end.0 / step;
        let samples = (last + 1).saturating_sub(first);
        let rows = u128::from(samples) * u128::from(workers);
        if rows > cfg.max_rows as u128 {
            return Err(TimelineError::TooManyRows {
                samples,
                workers,
                rows,
                max_rows: cfg.max_rows,
            });
        }
        let next = if samples == 0 {
            Nanos::MAX
        } else {
            Nanos(first * step)
        };
        let recorder = Self {
            timeline: Timeline {
                interval: cfg.interval,
                max_num_seqs,
                samples: Vec::with_capacity(samples as usize),
            },
            last: Nanos(last * step),
            ttfts: Vec::new(),
            worker_ttft: vec![(0, None); workers as usize],
        };
        Ok((recorder, next))
    }

    /// A request on `worker` got its first token, `ttft` after the client issued it.
    pub(crate) fn first_token(&mut self, worker: u32, ttft: Nanos) {
        let ms = ttft.0 as f64 / 1e6;
        self.ttfts.push(ms);
        if let Some((n, max)) = self.worker_ttft.get_mut(worker as usize) {
            *n += 1;
            *max = Some(max.map_or(ms, |m| m.max(ms)));
        }
    }

    /// Stores the sample at `at` (the driver filled each worker's state; the interval's TTFTs
    /// are added here) and returns the next sample instant (`Nanos::MAX` after the last).
    pub(crate) fn push(&mut self, at: Nanos, queued: u32, mut workers: Vec<WorkerSample>) -> Nanos {
        for (ws, (n, max)) in workers.iter_mut().zip(&mut self.worker_ttft) {
            ws.first_tokens = std::mem::take(n);
            ws.ttft_max_ms = max.take();
        }
        let first_tokens = self.ttfts.len() as u32;
        let max = self.ttfts.iter().copied().reduce(f64::max);
        let Percentiles { p50, p95 } = Percentiles::of(&mut self.ttfts);
        self.ttfts.clear();
        self.timeline.samples.push(Sample {
            at,
            queued,
            first_tokens,
            ttft_p50_ms: p50,
            ttft_p95_ms: p95,
            ttft_max_ms: max,
            workers,
        });
        if at >= self.last {
            Nanos::MAX
        } else {
            at + self.timeline.interval
        }
    }

    pub(crate) fn into_timeline(self) -> Timeline {
        self.timeline
    }

    pub(crate) fn timeline(&self) -> &Timeline {
        &self.timeline
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grid_covers_the_run_and_the_bound_is_enforced() {
        let cfg = TimelineConfig {
            interval: Nanos::from_secs(1),
            max_rows: 30,
        };
        // 10 s × 3 workers = 30 rows: exactly at the bound.
        let (r, next) = Recorder::new(cfg, Nanos::ZERO, Nanos::from_secs(10), 3, 64).unwrap();
        assert_eq!(next, Nanos::from_secs(1));
        assert_eq!(r.last, Nanos::from_secs(10));
        // One more second is one sample too many.
        let err = Recorder::new(cfg, Nanos::ZERO, Nanos::from_secs(11), 3, 64).unwrap_err();
        assert_eq!(
            err,
            TimelineError::TooManyRows {
                samples: 11,
                workers: 3,
                rows: 33,
                max_rows: 30
            }
        );
        // Enabled mid-run: the grid starts after now.
        let (_, next) =
            Recorder::new(cfg, Nanos::from_millis(2_500), Nanos::from_secs(10), 3, 64).unwrap();
        assert_eq!(next, Nanos::from_secs(3));
        let zero = TimelineConfig {
            interval: Nanos::ZERO,
            ..cfg
        };
        assert_eq!(
            Recorder::new(zero, Nanos::ZERO, Nanos::from_secs(1), 1, 64).unwrap_err(),
            TimelineError::ZeroInterval
        );
    }

    #[test]
    fn interval_ttft_is_max_and_nearest_rank_p95_then_resets() {
        let cfg = TimelineConfig::default();
        let (mut r, _) = Recorder::new(cfg, Nanos::ZERO, Nanos::from_secs(2), 2, 64).unwrap();
        // Worker 0 gets 100..=1,900 ms, worker 1 gets 2,000 ms.
        for ms in 1..=20 {
            r.first_token(u32::from(ms == 20), Nanos::from_millis(ms * 100));
        }
        let idle = || vec![WorkerSample::default(); 2];
        let next = r.push(Nanos::from_secs(1), 0, idle());
        assert_eq!(next, Nanos::from_secs(2));
        let next = r.push(Nanos::from_secs(2), 3, idle());
        assert_eq!(next, Nanos::MAX, "the grid ends at the run's end");
        let t = r.into_timeline();
        let first = &t.samples[0];
        assert_eq!(first.first_tokens, 20);
        assert_eq!(first.ttft_max_ms, Some(2_000.0));
        // ⌈0.95 × 20⌉ = 19th smallest, ⌈0.5 × 20⌉ = 10th.
        assert_eq!(first.ttft_p95_ms, Some(1_900.0));
        assert_eq!(first.ttft_p50_ms, Some(1_000.0));
        assert_eq!(first.workers[0].first_tokens, 19);
        assert_eq!(first.workers[0].ttft_max_ms, Some(1_900.0));
        assert_eq!(first.workers[1].first_tokens, 1);
        assert_eq!(first.workers[1].ttft_max_ms, Some(2_000.0));
        assert_eq!(t.samples[1].first_tokens, 0);
        assert_eq!(t.samples[1].ttft_max_ms, None);
        assert_eq!(t.samples[1].workers[0].ttft_max_ms, None, "reset");
        let csv = t.to_csv();
        let lines: Vec<&str> = csv.lines().collect();
        assert_eq!(lines[0], CSV_HEADER);
        assert_eq!(
            lines[1],
            "1.000,0,0,0,0,0,0,19,1900.0,0,20,1000.0,1900.0,2000.0"
        );
        assert_eq!(
            lines[2],
            "1.000,1,0,0,0,0,0,1,2000.0,0,20,1000.0,1900.0,2000.0"
        );
        assert_eq!(lines[3], "2.000,0,0,0,0,0,0,0,,3,0,,,");
    }
}
