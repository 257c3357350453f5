//! The one p50/p95 pair of the project, and the nearest-rank rule behind it.
//!
//! The simulator, `results.json` and the load generator all report a metric as its median and
//! 95th percentile, computed the same way: exact nearest rank (the ⌈q·n⌉-th smallest sample),
//! no histogram. A percentile is `None` when there was no sample.

use serde::{Deserialize, Serialize};

/// p50 and p95 of one metric; `None` (`null` in JSON) when there was no sample.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Percentiles {
    pub p50: Option<f64>,
    pub p95: Option<f64>,
}

impl Percentiles {
    /// Nearest-rank percentiles of `samples` (sorted in place).
    pub fn of(samples: &mut [f64]) -> Self {
        samples.sort_by(f64::total_cmp);
        Self {
            p50: nearest_rank(samples, 0.50),
            p95: nearest_rank(samples, 0.95),
        }
    }

    /// The mean of several windows' percentiles (the seed averages snapshots and sweeps),
    /// over the windows that had samples.
    pub fn mean<'a>(all: impl IntoIterator<Item = &'a Percentiles> + Clone) -> Self {
        Self {
            p50: mean_some(all.clone().into_iter().map(|p| p.p50)),
            p95: mean_some(all.into_iter().map(|p| p.p95)),
        }
    }

    /// Both percentiles through `f` (a change of unit, a rounding).
    pub fn map(self, f: impl Fn(f64) -> f64) -> Self {
        Self {
            p50: self.p50.map(&f),
            p95: self.p95.map(&f),
        }
    }

    /// Rounded to `decimals` for the results file; a non-finite value becomes `None`.
    pub fn rounded(self, decimals: i32) -> Self {
        Self {
            p50: round_opt(self.p50, decimals),
            p95: round_opt(self.p95, decimals),
        }
    }

    /// `None` when there was no sample, so a JSON field reads `null` rather than a pair of
    /// nulls.
    pub fn observed(self) -> Option<Self> {
        (self.p50.is_some() || self.p95.is_some()).then_some(self)
    }
}

/// The ⌈q·n⌉-th smallest of sorted `v`.
pub fn nearest_rank(sorted: &[f64], q: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = (q * sorted.len() as f64).ceil().max(1.0) as usize;
    Some(sorted[rank.min(sorted.len()) - 1])
}

/// Mean of the present values, `None` when none is.
pub fn mean_some(values: impl IntoIterator<Item = Option<f64>>) -> Option<f64> {
    let (mut sum, mut n) = (0.0, 0u32);
    for v in values.into_iter().flatten() {
        sum += v;
        n += 1;
    }
    (n > 0).then(|| sum / f64::from(n))
}

/// `x` rounded to `decimals`, never `-0.0` (so a file does not change with the sign of a
/// rounding error).
pub fn round(x: f64, decimals: i32) -> f64 {
    let f = 10f64.powi(decimals);
    let r = (x * f).round() / f;
    if r == 0.0 { 0.0 } else { r }
}

/// [`round`] of a present, finite value.
pub fn round_opt(x: Option<f64>, decimals: i32) -> Option<f64> {
    x.filter(|v| v.is_finite()).map(|v| round(v, decimals))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let mut v: Vec<f64> = (1..=20).rev().map(f64::from).collect();
        let p = Percentiles::of(&mut v);
        assert_eq!(p.p50, Some(10.0));
        assert_eq!(p.p95, Some(19.0));
        let mut hundred: Vec<f64> = (1..=100).map(f64::from).collect();
        let p = Percentiles::of(&mut hundred);
        assert_eq!((p.p50, p.p95), (Some(50.0), Some(95.0)));
        assert_eq!(Percentiles::of(&mut [7.0]).p95, Some(7.0));
        assert_eq!(Percentiles::of(&mut []).p50, None);
        assert_eq!(Percentiles::of(&mut []).observed(), None);
    }

    #[test]
    fn means_skip_empty_windows_and_rounding_keeps_the_file_stable() {
        let windows = [
            Percentiles {
                p50: Some(1.0),
                p95: Some(3.0),
            },
            Percentiles::default(),
            Percentiles {
                p50: Some(2.0),
                p95: Some(4.0),
            },
        ];
        let m = Percentiles::mean(&windows);
        assert_eq!((m.p50, m.p95), (Some(1.5), Some(3.5)));
        assert_eq!(Percentiles::mean(&[]), Percentiles::default());
        assert_eq!(round(-0.0001, 3).to_string(), "0");
        assert_eq!(round(2.34567, 2), 2.35);
        assert_eq!(round_opt(Some(f64::NAN), 2), None);
        let r = Percentiles {
            p50: Some(1.23456),
            p95: Some(f64::INFINITY),
        }
        .rounded(3);
        assert_eq!((r.p50, r.p95), (Some(1.235), None));
        assert_eq!(m.map(|x| x * 2.0).p95, Some(7.0));
    }

    #[test]
    fn json_is_a_pair_with_nulls_for_no_sample() {
        let p = Percentiles {
            p50: Some(1.5),
            p95: None,
        };
        let json = serde_json::to_string(&p).unwrap();
        assert_eq!(json, r#"{"p50":1.5,"p95":null}"#);
        assert_eq!(serde_json::from_str::<Percentiles>(&json).unwrap(), p);
        let ints: Percentiles = serde_json::from_str(r#"{"p50": 1, "p95": 2}"#).unwrap();
        assert_eq!(ints.p95, Some(2.0));
    }
}
