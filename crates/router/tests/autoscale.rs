//! The autoscaler's rules (KEDA's activation and cooldown, the HPA's formula, tolerance,
//! scale-up limit and stabilization, bounds, pause), with a clock the test drives.

use nanotime::Nanos;
use router::autoscale::{
    Autoscaler, BucketCounts, FRONTEND_TTFT_BUCKETS, HistogramWindow, MetricType, ScaleReason,
    ScalerConfig, ScalerConfigError,
};

fn secs(s: u64) -> Nanos {
    Nanos::from_secs(s)
}

/// Polls every 15 s from `start` with `value` on a pool of `size`, applying each decision,
/// until `end`; returns the pool's size and the decisions made.
fn run(
    scaler: &mut Autoscaler,
    mut size: u32,
    start: u64,
    end: u64,
    value: Option<f64>,
) -> (u32, Vec<(u64, u32, u32, ScaleReason)>) {
    let mut decisions = Vec::new();
    let mut t = start;
    while t <= end {
        if let Some(d) = scaler.on_poll(secs(t), value, size) {
            decisions.push((t, d.from, d.to, d.reason));
            size = d.to;
        }
        t += 15;
    }
    (size, decisions)
}

#[test]
fn average_value_asks_for_value_over_threshold_replicas() {
    let mut scaler = Autoscaler::new(ScalerConfig::seed004_prefill(), Nanos::ZERO).unwrap();
    // 1.6 s TTFT p95 against 0.5 s: ceil(3.2) = 4, the maximum.
    let d = scaler.on_poll(Nanos::ZERO, Some(1.6), 1).unwrap();
    assert_eq!(
        (d.from, d.to, d.reason),
        (1, 4, ScaleReason::AboveThreshold)
    );
    // Far above: still bounded by max_replicas.
    let mut scaler = Autoscaler::new(ScalerConfig::seed004_prefill(), Nanos::ZERO).unwrap();
    assert_eq!(scaler.on_poll(Nanos::ZERO, Some(50.0), 1).unwrap().to, 4);
}

#[test]
fn value_metric_type_scales_the_current_count() {
    let config = ScalerConfig {
        metric_type: MetricType::Value,
        max_replicas: 10,
        ..ScalerConfig::seed004_decode()
    };
    let mut scaler = Autoscaler::new(config, Nanos::ZERO).unwrap();
    // ITL p95 of 75 ms on 2 decode workers against 50 ms: ceil(2 × 1.5) = 3.
    assert_eq!(scaler.on_poll(Nanos::ZERO, Some(0.075), 2).unwrap().to, 3);
}

#[test]
fn within_tolerance_nothing_changes() {
    let config = ScalerConfig {
        metric_type: MetricType::Value,
        ..ScalerConfig::seed004_prefill()
    };
    let mut scaler = Autoscaler::new(config, Nanos::ZERO).unwrap();
    // 0.54 s against 0.5 s is 8 % over: inside the HPA's 10 % tolerance.
    let (size, decisions) = run(&mut scaler, 2, 0, 600, Some(0.54));
    assert_eq!(size, 2);
    assert!(decisions.is_empty(), "{decisions:?}");
}

#[test]
fn scale_up_is_limited_per_period_like_the_hpa() {
    let config = ScalerConfig {
        metric_type: MetricType::Value,
        max_replicas: 100,
        ..ScalerConfig::seed004_prefill()
    };
    let mut scaler = Autoscaler::new(config, Nanos::ZERO).unwrap();
    // 20× over on 10 replicas wants 200: the HPA allows max(double, +4) = 20 per period.
    assert_eq!(scaler.on_poll(Nanos::ZERO, Some(10.0), 10).unwrap().to, 20);
    assert_eq!(scaler.on_poll(secs(15), Some(10.0), 20).unwrap().to, 40);
}

#[test]
fn scale_down_waits_for_the_stabilization_window() {
    let mut scaler = Autoscaler::new(ScalerConfig::seed004_prefill(), Nanos::ZERO).unwrap();
    let (size, _) = run(&mut scaler, 1, 0, 0, Some(1.2));
    assert_eq!(size, 3);
    // Recovered: nothing for 300 s after the last high recommendation, then down to 1.
    let (size, decisions) = run(&mut scaler, size, 15, 600, Some(0.2));
    assert_eq!(size, 1);
    assert_eq!(decisions, vec![(315, 3, 1, ScaleReason::BelowThreshold)]);
}

#[test]
fn activation_only_governs_the_step_from_zero() {
    let config = ScalerConfig {
        min_replicas: 0,
        ..ScalerConfig::seed004_prefill()
    };
    let mut scaler = Autoscaler::new(config, Nanos::ZERO).unwrap();
    // At zero, 80 ms is under the 100 ms activation threshold: stays at zero.
    let (size, decisions) = run(&mut scaler, 0, 0, 120, Some(0.08));
    assert_eq!((size, decisions.len()), (0, 0));
    // 150 ms activates it: zero to one (KEDA), not to ceil(0.15/0.5) by the HPA formula.
    let d = scaler.on_poll(secs(135), Some(0.15), 0).unwrap();
    assert_eq!((d.to, d.reason), (1, ScaleReason::Activated));
    // With min 1 the same low value never takes the pool to zero.
    let mut scaler = Autoscaler::new(ScalerConfig::seed004_prefill(), Nanos::ZERO).unwrap();
    let (size, _) = run(&mut scaler, 1, 0, 900, Some(0.0));
    assert_eq!(size, 1);
}

#[test]
fn cooldown_takes_an_inactive_pool_to_zero() {
    let config = ScalerConfig {
        min_replicas: 0,
        ..ScalerConfig::seed004_prefill()
    };
    let mut scaler = Autoscaler::new(config, Nanos::ZERO).unwrap();
    assert!(scaler.on_poll(Nanos::ZERO, Some(0.4), 1).is_none()); // active, in tolerance-ish
    // Inactive (no data) from 15 s: still one until 60 s after the last active poll.
    let (size, decisions) = run(&mut scaler, 1, 15, 120, None);
    assert_eq!(size, 0);
    assert_eq!(decisions, vec![(60, 1, 0, ScaleReason::Deactivated)]);
}

#[test]
fn bounds_pull_a_pool_back_inside() {
    let mut scaler = Autoscaler::new(ScalerConfig::seed004_decode(), Nanos::ZERO).unwrap();
    // Someone else scaled the decode pool to 7; max is 5.
    let d = scaler.on_poll(Nanos::ZERO, Some(0.03), 7).unwrap();
    assert_eq!((d.to, d.reason), (5, ScaleReason::Bounds));
    let mut scaler = Autoscaler::new(ScalerConfig::seed004_decode(), Nanos::ZERO).unwrap();
    let d = scaler.on_poll(Nanos::ZERO, Some(0.03), 0).unwrap();
    assert_eq!((d.to, d.reason), (1, ScaleReason::Bounds));
}

#[test]
fn paused_scaler_decides_nothing_and_resumes_fresh() {
    let mut scaler = Autoscaler::new(ScalerConfig::seed004_prefill(), Nanos::ZERO).unwrap();
    assert_eq!(run(&mut scaler, 1, 0, 0, Some(1.2)).0, 3);
    scaler.pause();
    assert_eq!(scaler.poll_timeout(), None);
    let (size, decisions) = run(&mut scaler, 3, 15, 900, Some(5.0));
    assert_eq!((size, decisions.len()), (3, 0));
    // Resumed at 900 s: evaluates at once, with no memory of the time before the pause (KEDA
    // removes the HPA while paused), so a low value scales down at the first poll.
    scaler.resume(secs(900));
    assert_eq!(scaler.poll_timeout(), Some(secs(900)));
    let (size, decisions) = run(&mut scaler, 3, 900, 1_500, Some(0.2));
    assert_eq!(size, 1);
    assert_eq!(decisions[0].0, 900, "{decisions:?}");
}

#[test]
fn polls_before_their_time_are_ignored() {
    let mut scaler = Autoscaler::new(ScalerConfig::seed004_prefill(), secs(10)).unwrap();
    assert!(scaler.on_poll(secs(5), Some(9.0), 1).is_none());
    assert!(scaler.on_poll(secs(10), Some(9.0), 1).is_some());
    assert!(scaler.on_poll(secs(20), Some(9.0), 4).is_none()); // next is at 25 s
}

#[test]
fn bad_settings_are_refused_with_the_reason() {
    let bad = |change: fn(&mut ScalerConfig)| {
        let mut config = ScalerConfig::seed004_prefill();
        change(&mut config);
        Autoscaler::new(config, Nanos::ZERO).unwrap_err()
    };
    assert_eq!(
        bad(|c| c.threshold = 0.0),
        ScalerConfigError::Threshold(0.0)
    );
    assert!(matches!(
        bad(|c| c.activation_threshold = -1.0),
        ScalerConfigError::ActivationThreshold(_)
    ));
    assert_eq!(
        bad(|c| c.polling_interval = Nanos::ZERO),
        ScalerConfigError::PollingInterval
    );
    assert_eq!(
        bad(|c| c.min_replicas = 5),
        ScalerConfigError::Bounds { min: 5, max: 4 }
    );
}

#[test]
fn window_quantile_sees_only_the_window_like_rate() {
    let mut counts = BucketCounts::new(FRONTEND_TTFT_BUCKETS);
    let mut window = HistogramWindow::new(FRONTEND_TTFT_BUCKETS, Nanos::from_secs(300));
    // The first five minutes are slow (2.5 s), then everything is fast (80 ms).
    window.record(secs(0), counts.cumulative());
    for _ in 0..100 {
        counts.observe(2.5);
    }
    window.record(secs(300), counts.cumulative());
    let slow = window.quantile(0.95).unwrap();
    assert!((2.0..=3.0).contains(&slow), "{slow}");
    for _ in 0..100 {
        counts.observe(0.08);
    }
    window.record(secs(600), counts.cumulative());
    let fast = window.quantile(0.95).unwrap();
    assert!((0.05..=0.1).contains(&fast), "{fast}");
    // Nothing observed in the last window: no value (PromQL's NaN), not the old one.
    window.record(secs(1_000), counts.cumulative());
    assert_eq!(window.quantile(0.95), None);
}

#[test]
fn window_restarts_when_a_counter_goes_down() {
    let mut window = HistogramWindow::new(&[0.1, 1.0], Nanos::from_secs(300));
    window.record(secs(0), vec![0, 0, 0]);
    window.record(secs(15), vec![0, 50, 50]);
    // The gateway restarted: its counters start again from zero.
    window.record(secs(30), vec![4, 4, 4]);
    let q = window.quantile(0.5).unwrap();
    assert!(q <= 0.1, "{q}");
    // A snapshot of the wrong shape is ignored.
    window.record(secs(45), vec![1]);
    assert!(window.quantile(0.5).is_some());
}
