//! Pool autoscaling with KEDA's semantics (seed 004), sans-IO.
//!
//! Seed 004 scales each worker pool with a KEDA `ScaledObject` whose one Prometheus trigger is
//! a latency quantile: the prefill pool on the frontend's TTFT p95 (`pool="prefill"`), the
//! decode pool on its ITL p95 (`pool="decode"`), both over a 5-minute `rate()` window. This
//! module makes the same decisions the KEDA operator and the Kubernetes HPA it drives would
//! make, so that the simulator and the demo scale a pool exactly as a cluster would:
//!
//! - [`HistogramWindow`] evaluates `histogram_quantile(q, sum by (le) (rate(x_bucket[w])))`
//!   over cumulative bucket snapshots, as Prometheus does (the increase over the window; linear
//!   interpolation inside the bucket; the highest finite bound when the quantile falls in
//!   `+Inf`; no answer without observations). The simulator feeds it the same buckets the
//!   gateway exports ([`FRONTEND_TTFT_BUCKETS`], [`FRONTEND_ITL_BUCKETS`]).
//! - [`Autoscaler`] is one `ScaledObject`: every `polling_interval` the driver gives it the
//!   query's value and the pool's size and gets back at most one [`ScaleDecision`].
//!   - **Activation and cooldown** (KEDA): the trigger is *active* when the value exceeds
//!     `activation_threshold`. They govern only the 0 ↔ 1 step, as in KEDA: a pool at zero
//!     goes to one when the trigger activates; a pool goes back to zero (only when
//!     `min_replicas` is 0) once the trigger has been inactive for `cooldown`.
//!   - **From one to many** (the HPA): KEDA's default `metricType` for Prometheus is
//!     `AverageValue`, for which the HPA wants `ceil(value / threshold)` replicas; with `Value`
//!     it wants `ceil(current × value / threshold)`. No change while the ratio is within the
//!     HPA's 10 % tolerance. Scale-up is limited per period by the HPA's default policies
//!     (double, or add four, whichever is more); scale-down takes the highest recommendation of
//!     the last `scale_down_stabilization` (the HPA's stabilization window, 300 s by default).
//!     A missing value (no observations) counts as 0, as KEDA's `ignoreNullValues` does.
//!   - **Bounds and pause**: the result is clamped to `min_replicas..=max_replicas`; a paused
//!     scaler (the `autoscaling.keda.sh/paused` annotation, set while the scenario controller
//!     drives the pools) decides nothing and forgets its history.
//!
//! **Architecture invariant:** no clock, no I/O. Time comes in as [`Nanos`]; the driver asks
//! [`Autoscaler::poll_timeout`] when to evaluate next and applies the decisions itself.
//!
//! ```
//! use nanotime::Nanos;
//! use router::autoscale::{Autoscaler, ScalerConfig};
//!
//! // Seed 004's prefill scaler: TTFT p95 against 0.5 s, polled every 15 s, 1–4 replicas.
//! let mut scaler = Autoscaler::new(ScalerConfig::seed004_prefill(), Nanos::ZERO).unwrap();
//! assert_eq!(scaler.poll_timeout(), Some(Nanos::ZERO));
//! // TTFT p95 of 1.2 s on one prefill worker: KEDA's AverageValue wants ceil(1.2 / 0.5) = 3.
//! let decision = scaler.on_poll(Nanos::ZERO, Some(1.2), 1).unwrap();
//! assert_eq!((decision.from, decision.to), (1, 3));
//! assert_eq!(scaler.poll_timeout(), Some(Nanos::from_secs(15)));
//! // Recovered at 0.3 s: the stabilization window keeps 3 for 300 s before scaling down.
//! assert!(scaler.on_poll(Nanos::from_secs(15), Some(0.3), 3).is_none());
//! let down = scaler.on_poll(Nanos::from_secs(315), Some(0.3), 3).unwrap();
//! assert_eq!(down.to, 1);
//! ```

use std::collections::VecDeque;
use std::fmt;

use nanotime::Nanos;
use serde::{Deserialize, Serialize};

/// The gateway's TTFT histogram buckets (seconds): the `le` bounds of
/// `dynamo_frontend_time_to_first_token_seconds`. One list, so that a quantile computed in the
/// simulator interpolates inside the same buckets Prometheus would.
pub const FRONTEND_TTFT_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0,
    30.0, 60.0,
];

/// The gateway's ITL histogram buckets (seconds): the `le` bounds of
/// `dynamo_frontend_inter_token_latency_seconds`.
pub const FRONTEND_ITL_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.06, 0.075, 0.1, 0.15,
    0.25, 0.5, 1.0,
];

/// The HPA's default tolerance: no change while `|ratio − 1| ≤ 0.1`.
pub const HPA_TOLERANCE: f64 = 0.1;

/// The most snapshots a [`HistogramWindow`] keeps; older ones are dropped first. At the
/// seed's 15 s polling a 5-minute window needs 21.
pub const MAX_WINDOW_SAMPLES: usize = 4_096;

/// Observation counts per bucket (not cumulative; the last is `+Inf`), for a driver that
/// observes latencies itself (the simulator). [`BucketCounts::cumulative`] is what a
/// Prometheus scrape would read.
#[derive(Debug, Clone, PartialEq)]
pub struct BucketCounts {
    bounds: &'static [f64],
    counts: Vec<u64>,
}

impl BucketCounts {
    pub fn new(bounds: &'static [f64]) -> BucketCounts {
        BucketCounts {
            bounds,
            counts: vec![0; bounds.len() + 1],
        }
    }

    /// Counts `value` in the first bucket whose bound is ≥ it (Prometheus' `le`).
    pub fn observe(&mut self, value: f64) {
        let bucket = self.bounds.partition_point(|bound| *bound < value);
        self.counts[bucket] += 1;
    }

    /// Counts `value` `n` times (the gateway's `observe_n`: a chunk of tokens sharing a gap).
    pub fn observe_n(&mut self, value: f64, n: u64) {
        let bucket = self.bounds.partition_point(|bound| *bound < value);
        self.counts[bucket] += n;
    }

    pub fn bounds(&self) -> &'static [f64] {
        self.bounds
    }

    /// Cumulative counts, one per bound and the last for `+Inf` (the `_bucket` series).
    pub fn cumulative(&self) -> Vec<u64> {
        self.counts
            .iter()
            .scan(0u64, |sum, count| {
                *sum += count;
                Some(*sum)
            })
            .collect()
    }
}

/// `histogram_quantile(q, rate(x_bucket[window]))` over cumulative snapshots taken by the
/// driver (a scrape, or the simulator's own counts).
#[derive(Debug, Clone)]
pub struct HistogramWindow {
    bounds: Vec<f64>,
    window: Nanos,
    samples: VecDeque<(Nanos, Vec<u64>)>,
}

impl HistogramWindow {
    /// `bounds` are the finite `le` bounds, ascending; every snapshot has one more count
    /// (`+Inf`).
    pub fn new(bounds: &[f64], window: Nanos) -> HistogramWindow {
        HistogramWindow {
            bounds: bounds.to_vec(),
            window,
            samples: VecDeque::new(),
        }
    }

    /// Records the cumulative counts read at `now`. A snapshot of the wrong length is
    /// ignored (it cannot be compared); a counter that went down (a restarted process) starts
    /// the window again, as Prometheus' counter-reset handling would.
    pub fn record(&mut self, now: Nanos, cumulative: Vec<u64>) {
        if cumulative.len() != self.bounds.len() + 1 {
            return;
        }
        if let Some((_, last)) = self.samples.back()
            && cumulative.iter().zip(last).any(|(new, old)| new < old)
        {
            self.samples.clear();
        }
        self.samples.push_back((now, cumulative));
        // Keep the newest sample at or before the window's start as the baseline.
        let start = now.saturating_sub(self.window);
        while self.samples.len() > 2 && self.samples[1].0 <= start {
            self.samples.pop_front();
        }
        while self.samples.len() > MAX_WINDOW_SAMPLES {
            self.samples.pop_front();
        }
    }

    /// The `q` quantile (0–1) of what was observed in the window ending at the latest
    /// snapshot, or `None` with no observations in it (PromQL's `NaN`).
    pub fn quantile(&self, q: f64) -> Option<f64> {
        let (_, newest) = self.samples.back()?;
        let zero = vec![0; newest.len()];
        let oldest = match self.samples.front() {
            Some((_, first)) if self.samples.len() > 1 => first,
            // One snapshot: everything observed so far (the window covers the process' life).
            _ => &zero,
        };
        let increase: Vec<f64> = newest
            .iter()
            .zip(oldest)
            .map(|(new, old)| new.saturating_sub(*old) as f64)
            .collect();
        histogram_quantile(q, &self.bounds, &increase)
    }
}

/// PromQL's `histogram_quantile` over cumulative per-bucket values (`bounds.len() + 1` of
/// them, the last `+Inf`).
pub fn histogram_quantile(q: f64, bounds: &[f64], cumulative: &[f64]) -> Option<f64> {
    let total = *cumulative.last()?;
    if total <= 0.0 || !(0.0..=1.0).contains(&q) {
        return None;
    }
    let rank = q * total;
    let bucket = cumulative.iter().position(|count| *count >= rank)?;
    if bucket == bounds.len() {
        // In +Inf: the highest finite bound, as Prometheus answers.
        return bounds.last().copied();
    }
    let upper = bounds[bucket];
    let (lower, below) = if bucket == 0 {
        (0.0_f64.min(upper), 0.0)
    } else {
        (bounds[bucket - 1], cumulative[bucket - 1])
    };
    let in_bucket = cumulative[bucket] - below;
    if in_bucket <= 0.0 {
        return Some(upper);
    }
    Some(lower + (upper - lower) * (rank - below) / in_bucket)
}

/// How the HPA compares the trigger's value with its threshold (KEDA's `metricType`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum MetricType {
    /// `ceil(value / threshold)` replicas: KEDA's default for a Prometheus trigger.
    #[default]
    AverageValue,
    /// `ceil(current × value / threshold)` replicas.
    Value,
}

/// One `ScaledObject`'s settings. Defaults: seed 004's shared settings (polling 15 s,
/// cooldown 60 s) and the HPA's (300 s scale-down stabilization).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScalerConfig {
    /// The target value per replica (seconds for a latency quantile).
    pub threshold: f64,
    /// Above this the trigger is active (the 0 → 1 step).
    pub activation_threshold: f64,
    pub polling_interval: Nanos,
    /// How long the trigger must be inactive before a pool with `min_replicas` 0 goes to zero.
    pub cooldown: Nanos,
    /// The HPA's scale-down stabilization window.
    pub scale_down_stabilization: Nanos,
    pub min_replicas: u32,
    pub max_replicas: u32,
    pub metric_type: MetricType,
}

impl ScalerConfig {
    /// Seed 004's prefill scaler: TTFT p95 against 0.5 s (activation 0.1 s), 1–4 replicas.
    pub fn seed004_prefill() -> ScalerConfig {
        ScalerConfig {
            threshold: 0.5,
            activation_threshold: 0.1,
            polling_interval: Nanos::from_secs(15),
            cooldown: Nanos::from_secs(60),
            scale_down_stabilization: Nanos::from_secs(300),
            min_replicas: 1,
            max_replicas: 4,
            metric_type: MetricType::AverageValue,
        }
    }

    /// Seed 004's decode scaler: ITL p95 against 0.05 s (activation 0.01 s), 1–5 replicas.
    pub fn seed004_decode() -> ScalerConfig {
        ScalerConfig {
            threshold: 0.05,
            activation_threshold: 0.01,
            max_replicas: 5,
            ..ScalerConfig::seed004_prefill()
        }
    }

    pub fn validate(&self) -> Result<(), ScalerConfigError> {
        if !(self.threshold.is_finite() && self.threshold > 0.0) {
            return Err(ScalerConfigError::Threshold(self.threshold));
        }
        if !(self.activation_threshold.is_finite() && self.activation_threshold >= 0.0) {
            return Err(ScalerConfigError::ActivationThreshold(
                self.activation_threshold,
            ));
        }
        if self.polling_interval == Nanos::ZERO {
            return Err(ScalerConfigError::PollingInterval);
        }
        if self.max_replicas == 0 || self.min_replicas > self.max_replicas {
            return Err(ScalerConfigError::Bounds {
                min: self.min_replicas,
                max: self.max_replicas,
            });
        }
        Ok(())
    }
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ScalerConfigError {
    #[error("threshold must be a positive number, got {0}")]
    Threshold(f64),
    #[error("activation threshold must be zero or more, got {0}")]
    ActivationThreshold(f64),
    #[error("polling interval must be more than zero")]
    PollingInterval,
    #[error("replica bounds must satisfy 0 ≤ min ≤ max and max ≥ 1, got min {min}, max {max}")]
    Bounds { min: u32, max: u32 },
}

/// Why a [`ScaleDecision`] was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScaleReason {
    /// The trigger activated a pool at zero (KEDA's 0 → 1).
    Activated,
    /// The trigger was inactive for the cooldown (KEDA's → 0).
    Deactivated,
    /// The HPA's recommendation went up.
    AboveThreshold,
    /// The HPA's recommendation, stabilized, went down.
    BelowThreshold,
    /// The pool was outside `min_replicas..=max_replicas`.
    Bounds,
}

impl ScaleReason {
    pub fn as_str(self) -> &'static str {
        match self {
            ScaleReason::Activated => "activated",
            ScaleReason::Deactivated => "deactivated",
            ScaleReason::AboveThreshold => "above_threshold",
            ScaleReason::BelowThreshold => "below_threshold",
            ScaleReason::Bounds => "bounds",
        }
    }
}

impl fmt::Display for ScaleReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Set the pool to `to` replicas (it has `from`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ScaleDecision {
    pub at: Nanos,
    pub from: u32,
    pub to: u32,
    /// The trigger's value that led to it (0 when there was none).
    pub value: f64,
    pub reason: ScaleReason,
}

/// One pool's scaler: a KEDA `ScaledObject` and the HPA behind it.
#[derive(Debug, Clone)]
pub struct Autoscaler {
    config: ScalerConfig,
    paused: bool,
    next_poll: Nanos,
    /// When the trigger was last active; `None` before it ever was.
    last_active: Option<Nanos>,
    /// The HPA's recommendations inside the stabilization window, oldest first.
    recommendations: VecDeque<(Nanos, u32)>,
}

impl Autoscaler {
    /// A scaler whose first evaluation is due at `now`.
    pub fn new(config: ScalerConfig, now: Nanos) -> Result<Autoscaler, ScalerConfigError> {
        config.validate()?;
        Ok(Autoscaler {
            config,
            paused: false,
            next_poll: now,
            last_active: None,
            recommendations: VecDeque::new(),
        })
    }

    pub fn config(&self) -> &ScalerConfig {
        &self.config
    }

    pub fn is_paused(&self) -> bool {
        self.paused
    }

    /// When to call [`Autoscaler::on_poll`] next; `None` while paused.
    pub fn poll_timeout(&self) -> Option<Nanos> {
        (!self.paused).then_some(self.next_poll)
    }

    /// Stops deciding (KEDA's paused annotation). The pool keeps its size.
    pub fn pause(&mut self) {
        self.paused = true;
        self.recommendations.clear();
    }

    /// Decides again from `now` on, with no memory of the time before the pause.
    pub fn resume(&mut self, now: Nanos) {
        if self.paused {
            self.paused = false;
            self.next_poll = now;
            self.last_active = None;
        }
    }

    /// One evaluation: `value` is the trigger query's result (`None`: no data, read as 0),
    /// `current` the pool's size now. Returns the new size when it should change. Calls
    /// before [`Autoscaler::poll_timeout`] or while paused decide nothing.
    pub fn on_poll(
        &mut self,
        now: Nanos,
        value: Option<f64>,
        current: u32,
    ) -> Option<ScaleDecision> {
        if self.paused || now < self.next_poll {
            return None;
        }
        self.next_poll = now.saturating_add(self.config.polling_interval);
        let value = value.filter(|v| v.is_finite() && *v >= 0.0).unwrap_or(0.0);
        let config = &self.config;
        let active = value > config.activation_threshold;
        if active {
            self.last_active = Some(now);
        }
        let decision = |to: u32, reason| {
            (to != current).then_some(ScaleDecision {
                at: now,
                from: current,
                to,
                value,
                reason,
            })
        };

        // Outside the bounds (the bounds changed, or someone else resized the pool).
        let clamped = current.clamp(config.min_replicas, config.max_replicas);
        if clamped != current {
            self.recommendations.clear();
            return decision(clamped, ScaleReason::Bounds);
        }
        // KEDA's own step: 0 ↔ 1.
        if current == 0 {
            return if active {
                decision(1, ScaleReason::Activated)
            } else {
                None
            };
        }
        if !active && config.min_replicas == 0 {
            let inactive_since = self.last_active.unwrap_or(Nanos::ZERO);
            if now.saturating_sub(inactive_since) >= config.cooldown {
                self.recommendations.clear();
                return decision(0, ScaleReason::Deactivated);
            }
        }

        // The HPA from one replica up.
        let ratio = match config.metric_type {
            MetricType::AverageValue => value / (config.threshold * f64::from(current)),
            MetricType::Value => value / config.threshold,
        };
        let wanted = if (ratio - 1.0).abs() <= HPA_TOLERANCE {
            current
        } else {
            let raw = (f64::from(current) * ratio).ceil();
            // ≥ 1: the HPA never scales to zero (KEDA's deactivation does that).
            raw.clamp(1.0, f64::from(config.max_replicas)) as u32
        };
        let up_limit = current.saturating_mul(2).max(current.saturating_add(4));
        let recommendation = wanted
            .min(up_limit)
            .clamp(config.min_replicas.max(1), config.max_replicas);
        self.recommendations.push_back((now, recommendation));
        let window_start = now.saturating_sub(config.scale_down_stabilization);
        while self
            .recommendations
            .front()
            .is_some_and(|(at, _)| *at < window_start)
        {
            self.recommendations.pop_front();
        }
        if recommendation > current {
            return decision(recommendation, ScaleReason::AboveThreshold);
        }
        let stabilized = self
            .recommendations
            .iter()
            .map(|(_, r)| *r)
            .max()
            .unwrap_or(recommendation);
        if stabilized < current {
            decision(stabilized, ScaleReason::BelowThreshold)
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantile_interpolates_inside_the_bucket_like_promql() {
        // 10 observations ≤ 0.1, 10 in (0.1, 0.25]: the median is the top of the first.
        let bounds = [0.1, 0.25, 0.5];
        assert_eq!(
            histogram_quantile(0.5, &bounds, &[10.0, 20.0, 20.0, 20.0]),
            Some(0.1)
        );
        // p75: halfway through (0.1, 0.25].
        let p75 = histogram_quantile(0.75, &bounds, &[10.0, 20.0, 20.0, 20.0]).unwrap();
        assert!((p75 - 0.175).abs() < 1e-12);
        // In +Inf: the highest finite bound.
        assert_eq!(
            histogram_quantile(0.99, &bounds, &[0.0, 0.0, 0.0, 5.0]),
            Some(0.5)
        );
        assert_eq!(histogram_quantile(0.5, &bounds, &[0.0; 4]), None);
    }
}
