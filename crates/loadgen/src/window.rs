//! The 60-second sliding window of finished turns and its percentiles.

use std::collections::VecDeque;
use std::time::Duration;

use report::Percentiles;

/// What one finished turn measured, as the client saw it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TurnSample {
    /// When the turn ended, seconds on the lane's clock.
    pub at_s: f64,
    /// Send to the first content chunk.
    pub ttft_s: f64,
    /// (E2E − TTFT) / (tokens − 1); `None` for a one-token reply.
    pub tpot_s: Option<f64>,
    /// Mean gap between content chunks; `None` with fewer than two chunks.
    pub itl_s: Option<f64>,
    /// Send to the end of the stream.
    pub e2e_s: f64,
    pub output_tokens: u64,
    /// The conversation's first turn (nothing of it can be cached yet; seed 003 splits TTFT
    /// by turn 1 vs turns 2+).
    pub first_turn: bool,
}

/// The window's figures; a metric is `None` when no turn in the window measured it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct WindowStats {
    pub ttft_s: Option<Percentiles>,
    /// TTFT of first turns, and of turns 2+.
    pub ttft_turn1_s: Option<Percentiles>,
    pub ttft_later_s: Option<Percentiles>,
    pub tpot_s: Option<Percentiles>,
    pub itl_s: Option<Percentiles>,
    pub e2e_s: Option<Percentiles>,
    /// Finished turns per second over the window.
    pub rps: Option<f64>,
    /// Output tokens per second over the window.
    pub tops: Option<f64>,
    pub samples: usize,
}

/// Finished turns of the last `span`, oldest first. Bounded: at most `max_samples` are kept
/// (the oldest go first), far above what any cluster here finishes in a minute.
#[derive(Debug)]
pub struct Window {
    span_s: f64,
    max_samples: usize,
    samples: VecDeque<TurnSample>,
    /// Since the workload (re)started, for the window's denominator before it is full.
    started_at_s: f64,
}

impl Window {
    pub fn new(span: Duration, max_samples: usize) -> Window {
        Window {
            span_s: span.as_secs_f64(),
            max_samples: max_samples.max(1),
            samples: VecDeque::new(),
            started_at_s: 0.0,
        }
    }

    /// Forgets everything; rates then count from `now_s`.
    pub fn reset(&mut self, now_s: f64) {
        self.samples.clear();
        self.started_at_s = now_s;
    }

    pub fn push(&mut self, sample: TurnSample) {
        if self.samples.len() == self.max_samples {
            self.samples.pop_front();
        }
        self.samples.push_back(sample);
    }

    fn expire(&mut self, now_s: f64) {
        while self
            .samples
            .front()
            .is_some_and(|s| s.at_s < now_s - self.span_s)
        {
            self.samples.pop_front();
        }
    }

    /// Percentiles and rates of the turns that ended in `(now − span, now]`. Rates divide by
    /// the span, or by the time since the start while the window is not yet full.
    pub fn stats(&mut self, now_s: f64) -> WindowStats {
        self.expire(now_s);
        let n = self.samples.len();
        if n == 0 {
            return WindowStats::default();
        }
        let covered = (now_s - self.started_at_s).clamp(1.0, self.span_s);
        let tokens: u64 = self.samples.iter().map(|s| s.output_tokens).sum();
        WindowStats {
            ttft_s: quantiles(self.samples.iter().map(|s| Some(s.ttft_s))),
            ttft_turn1_s: quantiles(
                self.samples
                    .iter()
                    .map(|s| s.first_turn.then_some(s.ttft_s)),
            ),
            ttft_later_s: quantiles(
                self.samples
                    .iter()
                    .map(|s| (!s.first_turn).then_some(s.ttft_s)),
            ),
            tpot_s: quantiles(self.samples.iter().map(|s| s.tpot_s)),
            itl_s: quantiles(self.samples.iter().map(|s| s.itl_s)),
            e2e_s: quantiles(self.samples.iter().map(|s| Some(s.e2e_s))),
            rps: Some(n as f64 / covered),
            tops: Some(tokens as f64 / covered),
            samples: n,
        }
    }
}

/// Nearest-rank p50 and p95 of the values present (NaN and infinities are skipped); `None`
/// without any.
pub fn quantiles(values: impl Iterator<Item = Option<f64>>) -> Option<Percentiles> {
    let mut v: Vec<f64> = values.flatten().filter(|x| x.is_finite()).collect();
    Percentiles::of(&mut v).observed()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(at_s: f64, ttft_s: f64) -> TurnSample {
        TurnSample {
            at_s,
            ttft_s,
            tpot_s: Some(ttft_s / 10.0),
            itl_s: None,
            e2e_s: ttft_s * 2.0,
            output_tokens: 100,
            // Every other turn opens its conversation.
            first_turn: (at_s as u64) % 2 == 0,
        }
    }

    #[test]
    fn ttft_splits_by_turn() {
        let mut w = Window::new(Duration::from_secs(60), 1_000);
        w.reset(0.0);
        for i in 0..10 {
            // First turns slow (1 s), later ones fast (0.1 s).
            let mut s = sample(f64::from(i), if i % 2 == 0 { 1.0 } else { 0.1 });
            s.first_turn = i % 2 == 0;
            w.push(s);
        }
        let s = w.stats(10.0);
        assert_eq!(s.ttft_turn1_s.unwrap().p95, Some(1.0));
        assert_eq!(s.ttft_later_s.unwrap().p95, Some(0.1));
        assert_eq!(s.ttft_s.unwrap().p95, Some(1.0));
    }

    #[test]
    fn nearest_rank_percentiles() {
        let q = quantiles((1..=100).map(|i| Some(f64::from(i)))).unwrap();
        assert_eq!(q.p50, Some(50.0));
        assert_eq!(q.p95, Some(95.0));
        let one = quantiles([Some(7.0)].into_iter()).unwrap();
        assert_eq!((one.p50, one.p95), (Some(7.0), Some(7.0)));
        assert!(quantiles([None, Some(f64::NAN)].into_iter()).is_none());
    }

    #[test]
    fn old_turns_leave_the_window_and_rates_use_the_covered_span() {
        let mut w = Window::new(Duration::from_secs(60), 1_000);
        w.reset(0.0);
        for i in 0..30 {
            w.push(sample(f64::from(i), 1.0 + f64::from(i)));
        }
        // 30 turns in the first 30 s: 1 per second, 100 tokens per second.
        let s = w.stats(30.0);
        assert_eq!(s.samples, 30);
        assert!((s.rps.unwrap() - 1.0).abs() < 1e-9);
        assert!((s.tops.unwrap() - 100.0).abs() < 1e-9);
        assert!(s.itl_s.is_none());
        // At 75 s the window is [15, 75]: turns 15..=29 remain.
        let s = w.stats(75.0);
        assert_eq!(s.samples, 15);
        assert_eq!(s.ttft_s.unwrap().p50, Some(1.0 + 22.0));
        assert!((s.rps.unwrap() - 15.0 / 60.0).abs() < 1e-9);
        assert_eq!(w.stats(200.0), WindowStats::default());
    }

    #[test]
    fn the_sample_bound_drops_the_oldest() {
        let mut w = Window::new(Duration::from_secs(60), 3);
        for i in 0..5 {
            w.push(sample(10.0, f64::from(i)));
        }
        let s = w.stats(10.0);
        assert_eq!(s.samples, 3);
        assert_eq!(s.ttft_s.unwrap().p50, Some(3.0));
    }
}
