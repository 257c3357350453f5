//! The simulator's timer heap: one live deadline per source, stale entries skipped lazily.
//!
//! A source (an engine, the workload, the router, the KV event queue, the run's schedule)
//! re-arms its deadline whenever it may have changed; the old heap entry is not removed but
//! recognised as stale when popped, because it no longer equals the source's live deadline.
//! So re-arming is O(log n) and 1,000 engines cost nothing per event beyond their own.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use nanotime::Nanos;

/// Who a deadline belongs to. The derived order breaks ties between equal times: KV events
/// first (they were sent before), then KV transfers landing (a decode worker stepping at `t`
/// sees the KV that arrived at `t`), then engines by index, then the router, the workload, and
/// the run's schedule last (a snapshot at `t` sees everything that happened at `t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Source {
    KvDelivery,
    /// Shared KV-transfer links ([`crate::links::LinkShare`]).
    KvLinks,
    Engine(u32),
    Router,
    Workload,
    Schedule,
    /// Injected faults and the gateway's timeouts they set off (`kvroute sim --faults`);
    /// last, so a fault at `t` sees everything else that happened at `t`.
    Fault,
}

/// Deadlines by source, with a heap ordered by (time, source).
#[derive(Debug)]
pub struct Timers {
    heap: BinaryHeap<Reverse<(Nanos, Source)>>,
    engines: Vec<Option<Nanos>>,
    /// KvDelivery, Router, Workload, Schedule, Fault, KvLinks.
    others: [Option<Nanos>; 6],
}

impl Timers {
    pub fn new(engines: usize) -> Self {
        Self {
            heap: BinaryHeap::new(),
            engines: vec![None; engines],
            others: [None; 6],
        }
    }

    /// One more engine source (`Source::Engine(previous count)`), with no deadline.
    pub fn add_engine(&mut self) {
        self.engines.push(None);
    }

    fn slot(&mut self, source: Source) -> &mut Option<Nanos> {
        match source {
            Source::Engine(i) => &mut self.engines[i as usize],
            Source::KvDelivery => &mut self.others[0],
            Source::Router => &mut self.others[1],
            Source::Workload => &mut self.others[2],
            Source::Schedule => &mut self.others[3],
            Source::Fault => &mut self.others[4],
            Source::KvLinks => &mut self.others[5],
        }
    }

    /// Sets `source`'s deadline (`None`: it needs no timer).
    pub fn arm(&mut self, source: Source, at: Option<Nanos>) {
        let slot = self.slot(source);
        if *slot == at {
            return;
        }
        *slot = at;
        if let Some(t) = at {
            self.heap.push(Reverse((t, source)));
            self.compact_if_stale();
        }
    }

    /// The earliest live deadline, without removing it.
    pub fn peek(&mut self) -> Option<(Nanos, Source)> {
        while let Some(&Reverse((t, source))) = self.heap.peek() {
            if *self.slot(source) == Some(t) {
                return Some((t, source));
            }
            self.heap.pop();
        }
        None
    }

    /// Removes and returns the earliest live deadline; the source is disarmed.
    pub fn pop(&mut self) -> Option<(Nanos, Source)> {
        let next = self.peek()?;
        self.heap.pop();
        *self.slot(next.1) = None;
        Some(next)
    }

    /// Entries in the heap, live or stale.
    pub fn heap_len(&self) -> usize {
        self.heap.len()
    }

    /// Bound: the heap never holds more than twice the sources plus 1,024 entries. Stale
    /// entries pile up when a source re-arms earlier than its previous deadline (an engine's
    /// stretch cut short by a new request); past the bound the heap is rebuilt from the live
    /// deadlines.
    fn compact_if_stale(&mut self) {
        let sources = self.engines.len() + self.others.len();
        if self.heap.len() <= 2 * sources + 1024 {
            return;
        }
        let mut live: Vec<Reverse<(Nanos, Source)>> = Vec::with_capacity(sources);
        for (i, d) in self.engines.iter().enumerate() {
            if let Some(t) = d {
                live.push(Reverse((*t, Source::Engine(i as u32))));
            }
        }
        let others = [
            Source::KvDelivery,
            Source::Router,
            Source::Workload,
            Source::Schedule,
            Source::Fault,
            Source::KvLinks,
        ];
        for (d, s) in self.others.iter().zip(others) {
            if let Some(t) = d {
                live.push(Reverse((*t, s)));
            }
        }
        self.heap = BinaryHeap::from(live);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_deadlines_are_skipped_and_ties_follow_source_order() {
        let mut t = Timers::new(3);
        t.arm(Source::Engine(2), Some(Nanos(50)));
        t.arm(Source::Engine(0), Some(Nanos(100)));
        t.arm(Source::Engine(0), Some(Nanos(40))); // re-armed earlier: the 100 entry is stale
        t.arm(Source::Schedule, Some(Nanos(50)));
        t.arm(Source::Workload, Some(Nanos(50)));
        t.arm(Source::Engine(1), Some(Nanos(70)));
        t.arm(Source::Engine(1), None);
        let order: Vec<_> = std::iter::from_fn(|| t.pop()).collect();
        assert_eq!(
            order,
            vec![
                (Nanos(40), Source::Engine(0)),
                (Nanos(50), Source::Engine(2)),
                (Nanos(50), Source::Workload),
                (Nanos(50), Source::Schedule),
            ]
        );
    }

    #[test]
    fn heap_stays_bounded_under_constant_rearming() {
        let mut t = Timers::new(2);
        // Sources: 2 engines and 6 others.
        for i in 0..100_000u64 {
            t.arm(Source::Engine(0), Some(Nanos(1_000_000 - i)));
            assert!(t.heap_len() <= 2 * 8 + 1024 + 1);
        }
        assert_eq!(
            t.pop(),
            Some((Nanos(1_000_000 - 99_999), Source::Engine(0)))
        );
        assert_eq!(t.pop(), None);
    }
}
