//! Outlier ejection with a minimum ejection time, as Envoy's `base_ejection_time`: a worker
//! that failed a request (broke, timed out) stays out of the routing set for at least
//! `base × (ejections in a row)`, capped at `max`, even when its health check passes, so a
//! worker that answers `/health` but hangs completions is not probed straight back in. A
//! request the worker then serves to the end resets the count.
//!
//! Sans-IO: time is an argument. The gateway asks [`Ejections::may_return`] before a health
//! check puts a worker back; the simulator can do the same.

use std::collections::BTreeMap;

use kv_index::WorkerId;
use nanotime::Nanos;

/// How long an ejected worker stays out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EjectionConfig {
    /// The first ejection's length; the n-th in a row lasts n times it.
    pub base: Nanos,
    /// The longest ejection.
    pub max: Nanos,
}

impl Default for EjectionConfig {
    fn default() -> Self {
        // Envoy's defaults: 30 s, at most 300 s.
        EjectionConfig::with_base(Nanos::from_secs(30))
    }
}

impl EjectionConfig {
    /// Longest ejection, in first ejections: `--ejection-time`'s ten times.
    pub const MAX_FACTOR: u64 = 10;

    /// Ejections of `base` growing with failures in a row up to [`Self::MAX_FACTOR`] times
    /// it (zero: no minimum ejection, health checks alone decide).
    pub fn with_base(base: Nanos) -> EjectionConfig {
        EjectionConfig {
            base,
            max: base.saturating_mul(Self::MAX_FACTOR),
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Ejection {
    until: Nanos,
    in_a_row: u32,
}

/// The ejected workers and until when each stays out; bounded by a capacity (the most
/// workers the driver knows).
#[derive(Debug, Clone)]
pub struct Ejections {
    config: EjectionConfig,
    entries: BTreeMap<WorkerId, Ejection>,
    capacity: usize,
}

impl Ejections {
    pub fn new(config: EjectionConfig, capacity: usize) -> Ejections {
        Ejections {
            config,
            entries: BTreeMap::new(),
            capacity: capacity.max(1),
        }
    }

    /// `worker` failed at `now`: it stays out until the returned time. Failures while it is
    /// out (its other requests breaking with it) are the same ejection, not new ones.
    pub fn eject(&mut self, worker: WorkerId, now: Nanos) -> Nanos {
        if !self.entries.contains_key(&worker) && self.entries.len() >= self.capacity {
            // Forget ejections that are over (their count of failures in a row goes too).
            self.entries.retain(|_, e| e.until > now);
            if self.entries.len() >= self.capacity {
                return now;
            }
        }
        let entry = self.entries.entry(worker).or_insert(Ejection {
            until: now,
            in_a_row: 0,
        });
        if entry.until > now {
            return entry.until;
        }
        entry.in_a_row = entry.in_a_row.saturating_add(1);
        let length = self
            .config
            .base
            .saturating_mul(u64::from(entry.in_a_row))
            .min(self.config.max);
        entry.until = now + length;
        entry.until
    }

    /// Whether `worker` may enter the routing set again at `now` (its ejection is over).
    pub fn may_return(&self, worker: WorkerId, now: Nanos) -> bool {
        self.entries.get(&worker).is_none_or(|e| now >= e.until)
    }

    /// When `worker`'s ejection ends, if it is ejected at `now`.
    pub fn ejected_until(&self, worker: WorkerId, now: Nanos) -> Option<Nanos> {
        self.entries
            .get(&worker)
            .map(|e| e.until)
            .filter(|&until| until > now)
    }

    /// `worker` served a request to the end: its next failure counts as the first again.
    pub fn succeeded(&mut self, worker: WorkerId, now: Nanos) {
        if self.entries.get(&worker).is_some_and(|e| e.until <= now) {
            self.entries.remove(&worker);
        }
    }

    /// Ejected workers known (for tests and metrics).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> EjectionConfig {
        EjectionConfig {
            base: Nanos::from_secs(10),
            max: Nanos::from_secs(25),
        }
    }

    #[test]
    fn an_ejected_worker_stays_out_longer_each_time_in_a_row_up_to_the_cap() {
        let mut e = Ejections::new(config(), 8);
        let w = WorkerId(1);
        assert!(e.may_return(w, Nanos::ZERO));
        assert_eq!(e.eject(w, Nanos::ZERO), Nanos::from_secs(10));
        // Its other requests failing with it: the same ejection.
        assert_eq!(e.eject(w, Nanos::from_secs(1)), Nanos::from_secs(10));
        assert!(!e.may_return(w, Nanos::from_secs(9)));
        assert!(e.may_return(w, Nanos::from_secs(10)));
        assert_eq!(e.eject(w, Nanos::from_secs(10)), Nanos::from_secs(30));
        assert_eq!(
            e.eject(w, Nanos::from_secs(30)),
            Nanos::from_secs(55),
            "capped"
        );
        // Serving to the end resets the count.
        e.succeeded(w, Nanos::from_secs(60));
        assert_eq!(e.eject(w, Nanos::from_secs(60)), Nanos::from_secs(70));
        // A success reported while still ejected (a request that began before) changes
        // nothing.
        e.succeeded(w, Nanos::from_secs(61));
        assert!(!e.may_return(w, Nanos::from_secs(65)));
    }

    #[test]
    fn the_table_is_bounded_and_forgets_finished_ejections_first() {
        let mut e = Ejections::new(config(), 2);
        e.eject(WorkerId(1), Nanos::ZERO);
        e.eject(WorkerId(2), Nanos::from_secs(5));
        // Full, and both still out: the third is not recorded (it may return at once).
        assert_eq!(
            e.eject(WorkerId(3), Nanos::from_secs(6)),
            Nanos::from_secs(6)
        );
        assert!(e.may_return(WorkerId(3), Nanos::from_secs(6)));
        // Worker 1's ejection is over: its place is taken.
        e.eject(WorkerId(3), Nanos::from_secs(11));
        assert!(!e.may_return(WorkerId(3), Nanos::from_secs(12)));
        assert_eq!(e.len(), 2);
    }
}
