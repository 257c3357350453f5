//! Time for sans-IO cores: a plain count of nanoseconds.
//!
//! The cores (`kv-index`, `router`, `engine`, `workload`) never read a clock. Their drivers pass
//! the time in: the virtual-time simulator passes its event-loop time, the real-time servers
//! pass nanoseconds since they started. [`Nanos`] serves both as an instant (since the driver's
//! epoch) and as a duration; arithmetic saturates instead of wrapping or panicking.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::ops::{Add, AddAssign, Sub};

/// Nanoseconds since the driver's epoch, or a span of nanoseconds.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct Nanos(pub u64);

impl Nanos {
    pub const ZERO: Nanos = Nanos(0);
    pub const MAX: Nanos = Nanos(u64::MAX);

    pub const fn from_secs(secs: u64) -> Self {
        Nanos(secs.saturating_mul(1_000_000_000))
    }

    pub const fn from_millis(ms: u64) -> Self {
        Nanos(ms.saturating_mul(1_000_000))
    }

    pub const fn from_micros(us: u64) -> Self {
        Nanos(us.saturating_mul(1_000))
    }

    /// Seconds as a float, rounded to the nearest nanosecond; negative and NaN give zero,
    /// too large saturates.
    pub fn from_secs_f64(secs: f64) -> Self {
        // `as` saturates for floats: NaN → 0, negative → 0, huge → u64::MAX.
        Nanos((secs * 1e9).round() as u64)
    }

    /// Milliseconds as a float (same rounding as [`Nanos::from_secs_f64`]).
    pub fn from_millis_f64(ms: f64) -> Self {
        Nanos((ms * 1e6).round() as u64)
    }

    pub fn as_secs_f64(self) -> f64 {
        self.0 as f64 / 1e9
    }

    pub fn as_millis_f64(self) -> f64 {
        self.0 as f64 / 1e6
    }

    pub const fn as_nanos(self) -> u64 {
        self.0
    }

    pub const fn saturating_sub(self, rhs: Nanos) -> Nanos {
        Nanos(self.0.saturating_sub(rhs.0))
    }

    pub const fn saturating_add(self, rhs: Nanos) -> Nanos {
        Nanos(self.0.saturating_add(rhs.0))
    }

    /// `self × n`, saturating.
    pub const fn saturating_mul(self, n: u64) -> Nanos {
        Nanos(self.0.saturating_mul(n))
    }
}

impl Add for Nanos {
    type Output = Nanos;
    fn add(self, rhs: Nanos) -> Nanos {
        self.saturating_add(rhs)
    }
}

impl AddAssign for Nanos {
    fn add_assign(&mut self, rhs: Nanos) {
        *self = self.saturating_add(rhs);
    }
}

impl Sub for Nanos {
    type Output = Nanos;
    /// Saturating: an earlier instant minus a later one is zero, never a panic.
    fn sub(self, rhs: Nanos) -> Nanos {
        self.saturating_sub(rhs)
    }
}

impl From<std::time::Duration> for Nanos {
    fn from(d: std::time::Duration) -> Self {
        Nanos(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
    }
}

impl From<Nanos> for std::time::Duration {
    fn from(n: Nanos) -> Self {
        std::time::Duration::from_nanos(n.0)
    }
}

impl fmt::Display for Nanos {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0 >= 1_000_000_000 {
            write!(f, "{:.3}s", self.as_secs_f64())
        } else if self.0 >= 1_000_000 {
            write!(f, "{:.3}ms", self.as_millis_f64())
        } else if self.0 >= 1_000 {
            write!(f, "{:.3}µs", self.0 as f64 / 1e3)
        } else {
            write!(f, "{}ns", self.0)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arithmetic_saturates() {
        assert_eq!(Nanos(5) - Nanos(7), Nanos::ZERO);
        assert_eq!(Nanos::MAX + Nanos(1), Nanos::MAX);
        assert_eq!(Nanos::from_secs(u64::MAX), Nanos::MAX);
    }

    #[test]
    fn float_conversions_round_and_clamp() {
        assert_eq!(Nanos::from_secs_f64(1.5), Nanos(1_500_000_000));
        assert_eq!(Nanos::from_millis_f64(0.0000004), Nanos(0));
        assert_eq!(Nanos::from_millis_f64(0.0000006), Nanos(1));
        assert_eq!(Nanos::from_secs_f64(-3.0), Nanos::ZERO);
        assert_eq!(Nanos::from_secs_f64(f64::NAN), Nanos::ZERO);
        assert_eq!(Nanos::from_secs_f64(1e30), Nanos::MAX);
        assert_eq!(Nanos::from_millis(250).as_secs_f64(), 0.25);
    }

    #[test]
    fn display_picks_a_readable_unit() {
        assert_eq!(Nanos(12).to_string(), "12ns");
        assert_eq!(Nanos::from_micros(3).to_string(), "3.000µs");
        assert_eq!(Nanos::from_millis(42).to_string(), "42.000ms");
        assert_eq!(Nanos::from_secs(2).to_string(), "2.000s");
    }
}
