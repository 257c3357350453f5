//! A trace's schedule, sans-IO: which request is due when, for any driver (the simulator's
//! virtual time, the load generator's real time).
//!
//! A record without a session is due at its timestamp divided by the speed factor, and so is
//! a session's first; a later request of a session (the `session_id` / `delay` extension) is
//! due `delay` (scaled) after the previous one of its session ended, finished, failed or
//! dropped. Nothing is retried: the driver reports each request's end once.
//!
//! Bounds: the replay shares the parsed trace ([`Arc`]) and holds, per request at most, one
//! entry in its ready queue or its session timers.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::sync::Arc;

use nanotime::Nanos;
use serde::Serialize;

use crate::trace::{Speed, Trace};

/// How far a replay got.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ReplayStats {
    /// Requests in the trace.
    pub requests: u64,
    /// Requests handed to the driver.
    pub issued: u64,
    pub finished: u64,
    pub failed: u64,
    /// Requests the driver refused to send (too many open), counted apart from failures.
    pub dropped: u64,
}

impl ReplayStats {
    /// Requests issued and not yet ended.
    pub fn open(&self) -> u64 {
        self.issued - self.finished - self.failed - self.dropped
    }
}

/// One request due: the record's index in the trace, when it was due, and its place in its
/// session (0 for a first request or one without a session).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Due {
    pub record: usize,
    pub at: Nanos,
    pub turn: u32,
}

/// A trace replayed open loop at a speed factor (see the module docs).
#[derive(Debug)]
pub struct TraceReplay {
    trace: Arc<Trace>,
    speed: Speed,
    /// The next record (in file order) that is not a session's later request.
    cursor: usize,
    /// Per record: its session's next request (`None` for the last) and the record's place in
    /// its session (0 for the first). Empty when the trace has no sessions.
    sessions: Vec<(Option<u32>, u32)>,
    /// Sessions' next requests and when they are due.
    session_timers: BinaryHeap<Reverse<(Nanos, usize)>>,
    /// Requests due and not yet taken by the driver, with their due time.
    ready: VecDeque<(Nanos, usize)>,
    now: Nanos,
    stats: ReplayStats,
}

impl TraceReplay {
    /// Replays `trace` at `speed` from time zero.
    pub fn new(trace: Arc<Trace>, speed: Speed) -> Self {
        let sessions = if trace.session_count() == 0 {
            Vec::new()
        } else {
            let mut sessions = vec![(None, 0u32); trace.len()];
            for r in trace.records() {
                if let Some(previous) = r.session().and_then(|s| s.previous) {
                    sessions[previous].0 = Some(r.index() as u32);
                    sessions[r.index()].1 = sessions[previous].1 + 1;
                }
            }
            sessions
        };
        let mut w = TraceReplay {
            stats: ReplayStats {
                requests: trace.len() as u64,
                ..ReplayStats::default()
            },
            trace,
            speed,
            cursor: 0,
            sessions,
            session_timers: BinaryHeap::new(),
            ready: VecDeque::new(),
            now: Nanos::ZERO,
        };
        w.skip_session_followers();
        w.collect_due();
        w
    }

    pub fn trace(&self) -> &Arc<Trace> {
        &self.trace
    }

    pub fn speed(&self) -> Speed {
        self.speed
    }

    pub fn stats(&self) -> ReplayStats {
        self.stats
    }

    /// Moves the cursor past records that their session's previous request will release.
    fn skip_session_followers(&mut self) {
        let records = self.trace.records();
        while records
            .get(self.cursor)
            .is_some_and(|r| r.session().is_some_and(|s| s.previous.is_some()))
        {
            self.cursor += 1;
        }
    }

    fn next_arrival(&self) -> Option<Nanos> {
        let r = self.trace.records().get(self.cursor)?;
        Some(self.speed.scale(r.timestamp()))
    }

    /// Moves every request due by `now` into the ready queue, in due order.
    fn collect_due(&mut self) {
        loop {
            let arrival = self.next_arrival().filter(|&t| t <= self.now);
            let session = self
                .session_timers
                .peek()
                .map(|Reverse((t, _))| *t)
                .filter(|&t| t <= self.now);
            // Ties go to the file's arrival, then to the earliest session timer.
            let take_arrival = match (arrival, session) {
                (Some(a), Some(s)) => a <= s,
                (Some(_), None) => true,
                (None, Some(_)) => false,
                (None, None) => return,
            };
            if take_arrival {
                if let Some(a) = arrival {
                    self.ready.push_back((a, self.cursor));
                }
                self.cursor += 1;
                self.skip_session_followers();
            } else if let Some(Reverse(due)) = self.session_timers.pop() {
                self.ready.push_back(due);
            }
        }
    }

    /// Request `record` ended (either way): its session's next one is due after its delay.
    fn ended(&mut self, record: usize, now: Nanos) {
        self.now = self.now.max(now);
        let Some(&(Some(next), _)) = self.sessions.get(record) else {
            return;
        };
        let next = next as usize;
        let delay = self.trace.records()[next]
            .session()
            .map_or(Nanos::ZERO, |s| s.delay);
        self.session_timers
            .push(Reverse((now + self.speed.scale(delay), next)));
        self.collect_due();
    }

    /// Every request issued and ended: nothing more will come.
    pub fn is_done(&self) -> bool {
        self.stats.issued == self.stats.requests && self.stats.open() == 0
    }

    /// When the next request is due, `None` when the replay waits only on requests in flight
    /// (or is done).
    pub fn poll_timeout(&self) -> Option<Nanos> {
        let session = self.session_timers.peek().map(|Reverse((t, _))| *t);
        match (self.next_arrival(), session) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// The clock reached `now`: requests due by then become ready.
    pub fn handle_timeout(&mut self, now: Nanos) {
        self.now = self.now.max(now);
        self.collect_due();
    }

    /// The next request due, in due order; the driver sends it (or drops it) and reports its
    /// end once.
    pub fn poll_request(&mut self) -> Option<Due> {
        let (at, record) = self.ready.pop_front()?;
        self.stats.issued += 1;
        let turn = self.sessions.get(record).map_or(0, |&(_, turn)| turn);
        Some(Due { record, at, turn })
    }

    pub fn on_finished(&mut self, record: usize, now: Nanos) {
        self.stats.finished += 1;
        self.ended(record, now);
    }

    pub fn on_failed(&mut self, record: usize, now: Nanos) {
        self.stats.failed += 1;
        self.ended(record, now);
    }

    /// The driver did not send request `record` (too many open).
    pub fn on_dropped(&mut self, record: usize, now: Nanos) {
        self.stats.dropped += 1;
        self.ended(record, now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dropped_request_releases_its_session_and_the_replay_ends_when_all_ended() {
        let text = [
            r#"{"timestamp": 0, "input_length": 9, "output_length": 1, "hash_ids": [], "session_id": 7}"#,
            r#"{"timestamp": 0, "input_length": 9, "output_length": 1, "hash_ids": [], "session_id": 7, "delay": 10}"#,
        ]
        .join("\n");
        let mut replay = TraceReplay::new(Arc::new(Trace::parse(&text).unwrap()), Speed::REAL_TIME);
        let first = replay.poll_request().unwrap();
        assert_eq!((first.record, first.turn), (0, 0));
        assert!(replay.poll_request().is_none());
        replay.on_dropped(0, Nanos::from_millis(1));
        assert_eq!(replay.poll_timeout(), Some(Nanos::from_millis(11)));
        replay.handle_timeout(Nanos::from_millis(11));
        let second = replay.poll_request().unwrap();
        assert_eq!(
            (second.record, second.turn, second.at),
            (1, 1, Nanos::from_millis(11))
        );
        assert!(!replay.is_done());
        replay.on_finished(1, Nanos::from_millis(20));
        assert!(replay.is_done());
        let s = replay.stats();
        assert_eq!((s.issued, s.finished, s.dropped, s.open()), (2, 1, 1, 0));
    }
}
