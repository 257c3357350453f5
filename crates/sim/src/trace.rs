//! Public trace replay as the simulator's [`Workload`]: Mooncake's FAST'25 format
//! (`workload::Trace`), open loop at the recorded times scaled by a speed factor.
//!
//! The schedule (which request is due when, sessions' `delay` after the previous end) is the
//! workload crate's [`TraceReplay`], which the load generator drives in real time too. Each
//! request is one single-turn request: its prompt is [`PromptSynth`]'s tokens (equal hash ids
//! ⇒ equal 512-token blocks, which engine blocks of 16, 32 or 64 tokens tile exactly), its
//! reply `output_length` tokens. A failed request is counted, never retried. Prompts are
//! synthesized when a request is issued, so only requests in flight hold tokens.
//!
//! [`run_trace_job`] runs one trace replay as a benchmark job (what `kvroute sim --trace` and
//! a bench cell at 1×, 2× or 4× speed call); [`replay_span`] is the virtual time a replay
//! needs.

use std::sync::Arc;

use nanotime::Nanos;
pub use workload::replay::{ReplayStats, TraceReplay};
use workload::{PromptSynth, Speed, Trace};

use crate::bench::{BenchJob, BenchSpec, JobResult, run_job};
use crate::driver::SimError;
use crate::workload::{ServingPath, Turn, TurnKey, Workload};

/// Virtual time after the last arrival that a default replay keeps running, so that the
/// requests sent last can finish and be measured.
pub const DRAIN: Nanos = Nanos::from_secs(60);

/// A trace replayed open loop (see the module docs).
#[derive(Debug)]
pub struct TraceWorkload {
    replay: TraceReplay,
    synth: PromptSynth,
}

impl TraceWorkload {
    /// Replays `trace` at `speed`, with prompts from `synth`, from time zero.
    pub fn new(trace: Arc<Trace>, speed: Speed, synth: PromptSynth) -> Self {
        TraceWorkload {
            replay: TraceReplay::new(trace, speed),
            synth,
        }
    }

    pub fn trace(&self) -> &Trace {
        self.replay.trace()
    }

    pub fn speed(&self) -> Speed {
        self.replay.speed()
    }

    pub fn stats(&self) -> ReplayStats {
        self.replay.stats()
    }
}

impl Workload for TraceWorkload {
    fn poll_timeout(&self) -> Option<Nanos> {
        self.replay.poll_timeout()
    }

    fn handle_timeout(&mut self, now: Nanos) {
        self.replay.handle_timeout(now);
    }

    fn poll_request(&mut self) -> Option<Turn> {
        let due = self.replay.poll_request()?;
        let record = &self.replay.trace().records()[due.record];
        Some(Turn {
            key: TurnKey {
                conversation: due.record as u64,
                turn: due.turn,
            },
            prompt: Arc::from(self.synth.prompt_tokens(record)),
            output: Arc::from(self.synth.reply_tokens(record)),
            issued_at: due.at,
        })
    }

    fn on_turn_finished(&mut self, key: TurnKey, now: Nanos) {
        self.replay.on_finished(key.conversation as usize, now);
    }

    fn on_turn_failed(&mut self, key: TurnKey, now: Nanos) {
        self.replay.on_failed(key.conversation as usize, now);
    }

    /// A trace sets its own load: concurrency levels do not apply.
    fn set_concurrency(&mut self, _: u32, now: Nanos) {
        self.replay.handle_timeout(now);
    }

    /// Requests issued and not yet ended.
    fn active_conversations(&self) -> u32 {
        u32::try_from(self.replay.stats().open()).unwrap_or(u32::MAX)
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
