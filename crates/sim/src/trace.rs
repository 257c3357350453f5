//! Public trace replay as the simulator's [`Workload`]: Mooncake's FAST'25 format
//! (`workload::Trace`), open loop at the recorded times scaled by a speed factor.
//!
//! Each record is one single-turn request: its prompt is [`PromptSynth`]'s tokens (equal hash
//! ids ⇒ equal 512-token blocks, which engine blocks of 16, 32 or 64 tokens tile exactly), its
//! reply is `output_length` tokens. A record without a session is issued at its scaled
//! timestamp, and so is a session's first; a later request of a session (the `session_id` /
//! `delay` extension) is issued `delay` (scaled) after the previous one of its session ended,
//! finished or failed. A failed request is counted, never retried.
//!
//! Bounds: the workload holds the parsed trace (shared, [`Arc`]) and, per request at most,
//! one entry in its ready queue or its session timers, so everything is bounded by the trace.
//! Prompts are synthesized when a request is issued, so only requests in flight hold tokens.
//!
//! [`run_trace_job`] runs one trace replay as a benchmark job (what `kvroute sim --trace` and
//! a bench cell at 1×, 2× or 4× speed call); [`replay_span`] is the virtual time a replay
//! needs.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::sync::Arc;

use nanotime::Nanos;
use serde::Serialize;
use workload::{PromptSynth, Speed, Trace};

use crate::bench::{BenchJob, BenchSpec, JobResult, run_job};
use crate::driver::SimError;
use crate::workload::{ServingPath, Turn, TurnKey, Workload};

/// Virtual time after the last arrival that a default replay keeps running, so that the
/// requests sent last can finish and be measured.
pub const DRAIN: Nanos = Nanos::from_secs(60);

/// How far a replay got.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct TraceStats {
    /// Requests in the trace (after any limit).
    pub requests: u64,
    pub issued: u64,
    pub finished: u64,
    pub failed: u64,
}

/// A trace replayed open loop (see the module docs).
#[derive(Debug)]
pub struct TraceWorkload {
    trace: Arc<Trace>,
    speed: Speed,
    synth: PromptSynth,
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
    stats: TraceStats,
}

impl TraceWorkload {
    /// Replays `trace` at `speed`, with prompts from `synth`, from time zero.
    pub fn new(trace: Arc<Trace>, speed: Speed, synth: PromptSynth) -> Self {
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
        let mut w = TraceWorkload {
            stats: TraceStats {
                requests: trace.len() as u64,
                ..TraceStats::default()
            },
            trace,
            speed,
            synth,
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

    pub fn trace(&self) -> &Trace {
        &self.trace
    }

    pub fn speed(&self) -> Speed {
        self.speed
    }

    pub fn stats(&self) -> TraceStats {
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

    /// The request `key` ended (either way): its session's next one is due after its delay.
    fn ended(&mut self, key: TurnKey, now: Nanos) {
        self.now = self.now.max(now);
        let Some(&(Some(next), _)) = self.sessions.get(key.conversation as usize) else {
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
}

impl Workload for TraceWorkload {
    fn poll_timeout(&self) -> Option<Nanos> {
        let session = self.session_timers.peek().map(|Reverse((t, _))| *t);
        match (self.next_arrival(), session) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    fn handle_timeout(&mut self, now: Nanos) {
        self.now = self.now.max(now);
        self.collect_due();
    }

    fn poll_request(&mut self) -> Option<Turn> {
        let (issued_at, index) = self.ready.pop_front()?;
        let record = &self.trace.records()[index];
        self.stats.issued += 1;
        // The request's place in its session, for the turn-1 / turns-2+ split of TTFT.
        let turn = self.sessions.get(index).map_or(0, |&(_, turn)| turn);
        Some(Turn {
            key: TurnKey {
                conversation: index as u64,
                turn,
            },
            prompt: Arc::from(self.synth.prompt_tokens(record)),
            output: Arc::from(self.synth.reply_tokens(record)),
            issued_at,
        })
    }

    fn on_turn_finished(&mut self, key: TurnKey, now: Nanos) {
        self.stats.finished += 1;
        self.ended(key, now);
    }

    fn on_turn_failed(&mut self, key: TurnKey, now: Nanos) {
        self.stats.failed += 1;
        self.ended(key, now);
    }

    /// A trace sets its own load: concurrency levels do not apply.
    fn set_concurrency(&mut self, _: u32, now: Nanos) {
        self.now = self.now.max(now);
    }

    /// Requests issued and not yet ended.
    fn active_conversations(&self) -> u32 {
        let open = self.stats.issued - self.stats.finished - self.stats.failed;
        u32::try_from(open).unwrap_or(u32::MAX)
    }
}

/// The virtual time a replay of `trace` at `speed` needs: the last arrival, plus [`DRAIN`]
/// for the last requests to finish.
pub fn replay_span(trace: &Trace, speed: Speed) -> Nanos {
    speed.scale(trace.duration()) + DRAIN
}

/// Runs one trace replay as a benchmark job: `spec`'s fleet, `job`'s router and seed, over
/// `spec`'s phases (a whole replay: one phase, warmup zero, window [`replay_span`]). The
/// requests reach the router over `spec.base.path_latency`, as the chat's do; `progress(k)`
/// after each phase. The run's totals count the requests issued, finished and failed.
pub fn run_trace_job(
    spec: &BenchSpec,
    job: &BenchJob,
    trace: Arc<Trace>,
    speed: Speed,
    progress: impl FnMut(usize),
) -> Result<JobResult, SimError> {
    let workload = TraceWorkload::new(trace, speed, PromptSynth::default());
    let workload = ServingPath::new(workload, spec.base.path_latency);
    run_job(spec, job, workload, progress)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(lines: &[&str]) -> Arc<Trace> {
        Arc::new(Trace::parse(&lines.join("\n")).unwrap())
    }

    fn drain(w: &mut TraceWorkload) -> Vec<(u64, Nanos)> {
        std::iter::from_fn(|| w.poll_request())
            .map(|t| (t.key.conversation, t.issued_at))
            .collect()
    }

    #[test]
    fn open_loop_arrivals_at_the_scaled_timestamps() {
        let trace = parse(&[
            r#"{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}"#,
            r#"{"timestamp": 0, "input_length": 700, "output_length": 4, "hash_ids": [1, 3]}"#,
            r#"{"timestamp": 1000, "input_length": 10, "output_length": 5, "hash_ids": [9]}"#,
        ]);
        let mut w = TraceWorkload::new(trace, Speed::new(2.0).unwrap(), PromptSynth::default());
        let first = w.poll_request().unwrap();
        assert_eq!((first.prompt.len(), first.output.len()), (600, 3));
        let second = w.poll_request().unwrap();
        assert_eq!(first.prompt[..512], second.prompt[..512]);
        assert_ne!(first.prompt[512..], second.prompt[512..600]);
        assert!(w.poll_request().is_none());
        assert_eq!(w.poll_timeout(), Some(Nanos::from_millis(500)));
        // Nothing waits on a finish in the open loop.
        w.on_turn_failed(first.key, Nanos::from_millis(100));
        assert!(w.poll_request().is_none());
        w.handle_timeout(Nanos::from_millis(500));
        assert_eq!(drain(&mut w), [(2, Nanos::from_millis(500))]);
        assert_eq!(w.poll_timeout(), None);
        assert_eq!(w.active_conversations(), 2);
        let s = w.stats();
        assert_eq!((s.requests, s.issued, s.finished, s.failed), (3, 3, 0, 1));
    }

    #[test]
    fn a_sessions_next_request_follows_the_previous_end_by_its_delay() {
        let trace = parse(&[
            r#"{"timestamp": 0, "input_length": 9, "output_length": 1, "hash_ids": [], "session_id": "a"}"#,
            r#"{"timestamp": 5, "input_length": 9, "output_length": 1, "hash_ids": [], "session_id": "a", "delay": 2000}"#,
            r#"{"timestamp": 10, "input_length": 9, "output_length": 1, "hash_ids": []}"#,
            r#"{"timestamp": 20, "input_length": 9, "output_length": 1, "hash_ids": [], "session_id": "a", "delay": 100}"#,
        ]);
        let mut w = TraceWorkload::new(trace, Speed::REAL_TIME, PromptSynth::default());
        let a0 = w.poll_request().unwrap();
        assert_eq!(
            a0.key,
            TurnKey {
                conversation: 0,
                turn: 0
            }
        );
        // Record 1 waits for record 0; record 2 arrives at its own time.
        assert_eq!(w.poll_timeout(), Some(Nanos::from_millis(10)));
        w.handle_timeout(Nanos::from_millis(10));
        assert_eq!(drain(&mut w), [(2, Nanos::from_millis(10))]);
        assert_eq!(w.poll_timeout(), None, "record 3 follows record 1");
        w.on_turn_finished(a0.key, Nanos::from_secs(1));
        assert_eq!(w.poll_timeout(), Some(Nanos::from_secs(3)));
        w.handle_timeout(Nanos::from_secs(3));
        let a1 = w.poll_request().unwrap();
        assert_eq!(
            a1.key,
            TurnKey {
                conversation: 1,
                turn: 1
            }
        );
        // A failure releases the session's next request too (counted, not retried).
        w.on_turn_failed(a1.key, Nanos::from_secs(4));
        w.handle_timeout(Nanos::from_millis(4_100));
        let a2 = w.poll_request().unwrap();
        assert_eq!((a2.key.conversation, a2.key.turn), (3, 2));
        assert_eq!(a2.issued_at, Nanos::from_millis(4_100));
        assert_eq!(w.poll_timeout(), None);
    }
}
