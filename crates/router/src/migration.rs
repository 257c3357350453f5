//! Request migration (Dynamo's semantics) and the failover defaults both drivers use.
//!
//! When a worker's stream breaks (`worker_failed`) or stalls past the stall timeout
//! (`worker_timeout`) mid-stream, the request is resent to another worker: its prompt followed
//! by the output so far, `max_tokens` reduced by the tokens already generated, and the
//! client's usage counts every worker's tokens. [`MigrationState`] is one request's side of
//! that decision: the driver feeds it what each worker generated ([`MigrationState::on_choice`])
//! and asks it, when the worker fails, whether to migrate or end
//! ([`MigrationState::decide`]). The gateway's relay and the simulator make the decision
//! here, once.
//!
//! [`FailoverConfig`] holds the deadlines, limits and ejection time with their one set of
//! defaults: `kvroute gateway`'s flags and `kvroute sim` read them from here.
//!
//! Sans-IO: no clock, no I/O; the driver times the deadlines and routes the continuation.

use std::collections::VecDeque;

use nanotime::Nanos;
use serde::Serialize;

use crate::ejection::EjectionConfig;

/// The gateway's failover settings: how long a worker may stay silent, how a request whose
/// worker failed goes on, how long the worker stays out. The defaults are `kvroute gateway`'s
/// and the simulator's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FailoverConfig {
    /// From sending a request to a worker to its first bytes (its queueing and prefill);
    /// missed, the worker is ejected and the request routed again.
    pub first_byte_timeout: Nanos,
    /// Times a request is routed again after a first-byte timeout before it fails (504).
    pub first_byte_retries: u32,
    /// Longest silence between two chunks of a worker's stream once it started.
    pub stall_timeout: Nanos,
    /// Times one request may be resent to another worker after its worker broke or stalled
    /// mid-stream (0: migration off, the stream ends with the error).
    pub migration_limit: u32,
    /// How long a worker that failed a request stays out of the routing set.
    pub ejection: EjectionConfig,
    /// How often workers' health is checked.
    pub health_interval: Nanos,
    /// How long one health probe may take before it counts as failed.
    pub probe_timeout: Nanos,
}

impl Default for FailoverConfig {
    fn default() -> Self {
        FailoverConfig {
            first_byte_timeout: Nanos::from_secs(60),
            first_byte_retries: 1,
            stall_timeout: Nanos::from_secs(30),
            migration_limit: 3,
            ejection: EjectionConfig::default(),
            health_interval: Nanos::from_secs(2),
            probe_timeout: Nanos::from_secs(2),
        }
    }
}

/// What a request's deadline (first byte, or stall mid-stream) says about its worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeadlineVerdict {
    /// Stopped or wedged: eject it and route the request again (or migrate it).
    Silent,
    /// Busy, not silent: it is still streaming its other requests (queueing, a long prefill
    /// batch), so the request waits, and is judged again at this time.
    WaitUntil(Nanos),
}

/// Judges a worker at one of its requests' deadlines (`now`, past the request's own
/// `timeout`). The worker is silent when its health check fails (`healthy` false) or it sent
/// nothing on any of its requests for the whole `timeout` (`last_output`: its latest output,
/// `None`: none yet). Otherwise it is busy: a request waiting behind others on a loaded worker
/// is not a sign of a dead one, and ejecting it would only move its queue to workers as
/// loaded, so that a burst would eject the whole fleet. The request is judged again when the
/// worker will have been silent for `timeout`, or at the next health check (`recheck`),
/// whichever is first.
pub fn judge_deadline(
    healthy: bool,
    last_output: Option<Nanos>,
    now: Nanos,
    timeout: Nanos,
    recheck: Nanos,
) -> DeadlineVerdict {
    match last_output {
        Some(last) if healthy && last + timeout > now => {
            DeadlineVerdict::WaitUntil((last + timeout).min(now + recheck.max(Nanos(1))))
        }
        _ => DeadlineVerdict::Silent,
    }
}

/// Why a worker failed a request mid-stream: the error event the client gets when the request
/// does not migrate, and the label migrations are counted under.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureReason {
    /// The worker's stream broke (connection lost, invalid stream, process gone).
    WorkerFailed,
    /// The worker sent nothing for the stall timeout.
    WorkerTimeout,
}

impl FailureReason {
    /// The OpenAI error `code` (and metrics label): `worker_failed`, `worker_timeout`.
    pub fn as_str(self) -> &'static str {
        match self {
            FailureReason::WorkerFailed => "worker_failed",
            FailureReason::WorkerTimeout => "worker_timeout",
        }
    }
}

/// Why a failed request is not migrated: it ends with its worker's error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotMigrated {
    /// Migration is off for it: `migration_limit` 0, or more than
    /// [`MAX_MIGRATED_CHOICES`] choices.
    Off,
    /// It has been resent `migration_limit` times already.
    LimitReached,
    /// Its choices already ended (a finish reason came for each): nothing is left to resend.
    ChoiceFinished,
    /// Its output so far is over the response byte cap, or a choice past `n` appeared: it is
    /// no longer kept.
    NotKept,
    /// Every token of `max_tokens` was generated (for a choice that has not finished):
    /// nothing is left to generate.
    NothingLeft,
}

/// What to do with a request whose worker failed mid-stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Resend it, routed again (the failed worker is out of the routing set).
    Migrate(Continuation),
    /// End it with the error event of `reason`.
    End {
        reason: FailureReason,
        why: NotMigrated,
    },
}

/// The request to resend: the prompt followed by the output so far, `max_tokens` reduced by
/// what was generated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Continuation {
    /// The client's choice it continues (0 for a single-choice request).
    pub index: u32,
    /// The prompt's tokens followed by the output's.
    pub tokens: Vec<u32>,
    /// The output text so far, for a worker that takes the prompt as text (appended to it).
    pub output_text: String,
    /// What is left of `max_tokens` (`None`: the request set none).
    pub max_tokens: Option<u32>,
    /// Output tokens of this choice generated before this resend, by every earlier worker.
    pub generated: u64,
    pub reason: FailureReason,
}

/// The token ids a worker's chunk carried for a choice.
#[derive(Debug, Clone, Copy)]
pub enum ChunkIds<'a> {
    Ids(&'a [u32]),
    /// None given (a worker not asked for them, or a chunk with only a finish reason).
    Missing,
    /// Given but unreadable: the text is tokenized again instead.
    Unreadable,
}

/// One choice of one worker chunk, as [`MigrationState::on_choice`] takes it.
#[derive(Debug, Clone, Copy)]
pub struct ChoiceOutput<'a> {
    pub index: u32,
    pub text: &'a str,
    pub ids: ChunkIds<'a>,
    /// Output tokens the chunk counts for this choice.
    pub tokens: u64,
    /// The chunk carried a finish reason.
    pub finished: bool,
}

/// The output so far of one choice that may still migrate.
#[derive(Debug, Clone)]
struct SoFar {
    text: String,
    /// The ids, while every chunk with text carried them; `None` otherwise.
    ids: Option<Vec<u32>>,
    tokens: u64,
    /// A finish reason came: nothing of it is resent.
    finished: bool,
}

impl SoFar {
    fn new() -> SoFar {
        SoFar {
            text: String::new(),
            ids: Some(Vec::new()),
            tokens: 0,
            finished: false,
        }
    }
}

/// Most choices (`n`) a request may have and still migrate: the state kept per choice is
/// bounded by it (the gateway aggregates no more either).
pub const MAX_MIGRATED_CHOICES: u32 = 128;

/// A usage report, the client's view of the whole request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenUsage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub cached_tokens: Option<u32>,
}

impl TokenUsage {
    pub fn total_tokens(&self) -> u32 {
        self.prompt_tokens.saturating_add(self.completion_tokens)
    }
}

/// One request's migrations: what each of its choices generated so far (only what a resend
/// needs, within a byte cap over all choices), how many resends are left, and what earlier
/// workers generated.
///
/// Several choices (`n` > 1): when the worker fails, each choice that has not finished is
/// resent on its own (`n` = 1, its prompt followed by its output so far), one after the
/// other: [`MigrationState::decide`] gives the first, [`MigrationState::next_continuation`]
/// the others as each continuation ends. One worker failure uses one attempt, however many
/// choices it leaves to resend. The driver labels each continuation's output with its
/// [`Continuation::index`].
#[derive(Debug, Clone)]
pub struct MigrationState {
    attempts_left: u32,
    max_output_bytes: usize,
    /// The request's `n`.
    choices: u32,
    /// Each choice's output so far, by index, grown as choices appear (at most `choices`).
    so_far: Vec<SoFar>,
    /// `false`: it cannot migrate (off, or no longer kept); `not_kept` says why.
    kept: bool,
    not_kept: NotMigrated,
    /// Text bytes kept over all choices, against `max_output_bytes`.
    kept_bytes: usize,
    /// Output tokens of every choice, by every worker so far.
    total_tokens: u64,
    /// Output tokens of the workers before the current one.
    earlier_tokens: u64,
    /// Choices of a failed worker still to resend after the current continuation, and why
    /// their worker failed.
    pending: VecDeque<u32>,
    pending_reason: FailureReason,
}

impl MigrationState {
    /// A request with `choices` choices (`n`), resent at most `limit` times, whose output is
    /// kept for a resend up to `max_output_bytes` of text (all choices together).
    pub fn new(limit: u32, choices: u32, max_output_bytes: usize) -> MigrationState {
        let kept = limit > 0 && (1..=MAX_MIGRATED_CHOICES).contains(&choices);
        let mut so_far = Vec::new();
        if kept {
            so_far.push(SoFar::new());
        }
        MigrationState {
            attempts_left: limit,
            max_output_bytes,
            choices,
            so_far,
            kept,
            not_kept: NotMigrated::Off,
            kept_bytes: 0,
            total_tokens: 0,
            earlier_tokens: 0,
            pending: VecDeque::new(),
            pending_reason: FailureReason::WorkerFailed,
        }
    }

    /// Whether it may still migrate (its output is kept).
    pub fn is_kept(&self) -> bool {
        self.kept
    }

    /// The request's choices (`n`).
    pub fn choices(&self) -> u32 {
        self.choices
    }

    /// Output tokens of the workers before the current one.
    pub fn earlier_tokens(&self) -> u64 {
        self.earlier_tokens
    }

    /// Whether choices of a failed worker are still to resend
    /// ([`MigrationState::next_continuation`]) once the current continuation ends.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Keeps what a resend needs of one choice of a worker's chunk (`index`: the client's
    /// choice); stops keeping (no migration) at an index past `n` or past the byte cap.
    pub fn on_choice(&mut self, choice: ChoiceOutput<'_>) {
        if !self.kept {
            return;
        }
        if choice.index >= self.choices {
            self.stop_keeping();
            return;
        }
        let i = choice.index as usize;
        if self.so_far.len() <= i {
            self.so_far.resize_with(i + 1, SoFar::new);
        }
        let so_far = &mut self.so_far[i];
        if choice.finished {
            so_far.finished = true;
        }
        so_far.text.push_str(choice.text);
        so_far.tokens += choice.tokens;
        self.total_tokens += choice.tokens;
        if let Some(ids) = &mut so_far.ids {
            match choice.ids {
                ChunkIds::Ids(more) => ids.extend_from_slice(more),
                // A chunk with only a finish reason may carry no ids.
                ChunkIds::Missing if choice.text.is_empty() => {}
                ChunkIds::Missing | ChunkIds::Unreadable => so_far.ids = None,
            }
        }
        self.kept_bytes += choice.text.len();
        if self.kept_bytes > self.max_output_bytes {
            self.stop_keeping();
        }
    }

    fn stop_keeping(&mut self) {
        self.kept = false;
        self.so_far = Vec::new();
        self.not_kept = NotMigrated::NotKept;
    }

    /// The current worker failed for `reason`: migrate (using up one attempt) or end. The
    /// continuation is `prompt` followed by the worker's ids when every chunk carried them,
    /// else by `tokenize` of the text; `max_tokens` is the client's. With several choices,
    /// it continues the first that has not finished; the others follow
    /// ([`MigrationState::next_continuation`]).
    pub fn decide(
        &mut self,
        reason: FailureReason,
        prompt: &[u32],
        max_tokens: Option<u32>,
        tokenize: impl FnOnce(&str) -> Vec<u32>,
    ) -> Decision {
        let end = |why| Decision::End { reason, why };
        if !self.kept {
            return end(self.not_kept);
        }
        // Choices the worker never started are resent whole.
        if self.so_far.len() < self.choices as usize {
            self.so_far.resize_with(self.choices as usize, SoFar::new);
        }
        let unfinished: VecDeque<u32> = (0..self.choices)
            .filter(|&i| !self.so_far[i as usize].finished)
            .collect();
        if unfinished.is_empty() {
            return end(NotMigrated::ChoiceFinished);
        }
        if self.attempts_left == 0 {
            return end(NotMigrated::LimitReached);
        }
        if let Some(max) = max_tokens {
            let done = |i: &u32| self.so_far[*i as usize].tokens >= u64::from(max);
            if unfinished.iter().any(done) {
                return end(NotMigrated::NothingLeft);
            }
        }
        self.attempts_left -= 1;
        self.pending = unfinished;
        self.pending_reason = reason;
        match self.next_continuation(prompt, max_tokens, tokenize) {
            Some(continuation) => Decision::Migrate(continuation),
            None => end(NotMigrated::ChoiceFinished),
        }
    }

    /// The next choice of a failed worker to resend, after the continuation before it ended
    /// (`None`: none is left). Uses no attempt: the failure that left it did.
    pub fn next_continuation(
        &mut self,
        prompt: &[u32],
        max_tokens: Option<u32>,
        tokenize: impl FnOnce(&str) -> Vec<u32>,
    ) -> Option<Continuation> {
        let index = self.pending.pop_front()?;
        let so_far = self.so_far.get(index as usize)?;
        let generated = u32::try_from(so_far.tokens).unwrap_or(u32::MAX);
        // `decide` checked that some of `max_tokens` is left.
        let max_tokens = max_tokens.map(|max| max.saturating_sub(generated).max(1));
        let mut tokens = Vec::with_capacity(prompt.len() + so_far.tokens as usize);
        tokens.extend_from_slice(prompt);
        match &so_far.ids {
            Some(ids) if ids.len() as u64 == so_far.tokens => tokens.extend_from_slice(ids),
            // Without the worker's ids: the text's, as the model's tokenizer writes it.
            _ => tokens.extend(tokenize(&so_far.text)),
        }
        self.earlier_tokens = self.total_tokens;
        Some(Continuation {
            index,
            tokens,
            output_text: so_far.text.clone(),
            max_tokens,
            generated: so_far.tokens,
            reason: self.pending_reason,
        })
    }

    /// A worker's usage report (of its own prompt and output) as the whole request's: after a
    /// migration, the client's prompt and every worker's output tokens; the cached prefix
    /// never more than the prompt.
    pub fn request_usage(&self, client_prompt_tokens: u32, worker: TokenUsage) -> TokenUsage {
        if self.earlier_tokens == 0 {
            return worker;
        }
        let earlier = u32::try_from(self.earlier_tokens).unwrap_or(u32::MAX);
        TokenUsage {
            prompt_tokens: client_prompt_tokens,
            completion_tokens: worker.completion_tokens.saturating_add(earlier),
            cached_tokens: worker.cached_tokens.map(|c| c.min(client_prompt_tokens)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_deadline_ejects_only_a_silent_or_unhealthy_worker() {
        let s = Nanos::from_secs;
        let (timeout, recheck) = (s(60), s(2));
        // Output 10 s ago: busy; judged again at the next health check.
        assert_eq!(
            judge_deadline(true, Some(s(90)), s(100), timeout, recheck),
            DeadlineVerdict::WaitUntil(s(102))
        );
        // Output 59 s ago: judged again when it will have been silent for the timeout.
        assert_eq!(
            judge_deadline(true, Some(s(41)), s(100), timeout, recheck),
            DeadlineVerdict::WaitUntil(s(101))
        );
        // Silent for the whole timeout, or never sent anything: silent.
        assert_eq!(
            judge_deadline(true, Some(s(40)), s(100), timeout, recheck),
            DeadlineVerdict::Silent
        );
        assert_eq!(
            judge_deadline(true, None, s(100), timeout, recheck),
            DeadlineVerdict::Silent
        );
        // Failing its health check: silent however recent its output.
        assert_eq!(
            judge_deadline(false, Some(s(100)), s(100), timeout, recheck),
            DeadlineVerdict::Silent
        );
        // A zero recheck still moves time forward.
        assert_eq!(
            judge_deadline(true, Some(s(100)), s(100), timeout, Nanos::ZERO),
            DeadlineVerdict::WaitUntil(Nanos(s(100).0 + 1))
        );
    }

    fn chunk(text: &str, ids: &[u32]) -> ChoiceOutput<'static> {
        ChoiceOutput {
            index: 0,
            text: Box::leak(text.to_string().into_boxed_str()),
            ids: ChunkIds::Ids(Box::leak(ids.to_vec().into_boxed_slice())),
            tokens: ids.len() as u64,
            finished: false,
        }
    }

    fn no_tokenizer(_: &str) -> Vec<u32> {
        panic!("the ids were all given")
    }

    #[test]
    fn a_failed_stream_continues_with_the_prompt_and_output_so_far() {
        let mut m = MigrationState::new(3, 1, 1 << 20);
        m.on_choice(chunk("Hello", &[7]));
        m.on_choice(chunk(" world", &[8, 9]));
        let d = m.decide(
            FailureReason::WorkerFailed,
            &[1, 2, 3],
            Some(10),
            no_tokenizer,
        );
        let Decision::Migrate(c) = d else {
            panic!("{d:?}")
        };
        assert_eq!(c.tokens, vec![1, 2, 3, 7, 8, 9]);
        assert_eq!(c.output_text, "Hello world");
        assert_eq!(c.max_tokens, Some(7));
        assert_eq!(c.generated, 3);
        assert_eq!(c.reason, FailureReason::WorkerFailed);
        // The next worker's usage counts the client's prompt and both workers' tokens.
        let worker = TokenUsage {
            prompt_tokens: 6,
            completion_tokens: 7,
            cached_tokens: Some(6),
        };
        let usage = m.request_usage(3, worker);
        assert_eq!(
            usage,
            TokenUsage {
                prompt_tokens: 3,
                completion_tokens: 10,
                cached_tokens: Some(3),
            }
        );
        assert_eq!(usage.total_tokens(), 13);
    }

    #[test]
    fn without_every_id_the_text_is_tokenized_again() {
        let mut m = MigrationState::new(1, 1, 1 << 20);
        m.on_choice(chunk("ab", &[5]));
        m.on_choice(ChoiceOutput {
            ids: ChunkIds::Missing,
            ..chunk("cd", &[0])
        });
        let d = m.decide(FailureReason::WorkerTimeout, &[1], None, |text| {
            assert_eq!(text, "abcd");
            vec![40, 41]
        });
        let Decision::Migrate(c) = d else {
            panic!("{d:?}")
        };
        assert_eq!(c.tokens, vec![1, 40, 41]);
        assert_eq!(c.max_tokens, None);
        // A finish-only chunk without ids keeps the ids.
        let mut m = MigrationState::new(1, 1, 1 << 20);
        m.on_choice(chunk("ab", &[5]));
        m.on_choice(ChoiceOutput {
            ids: ChunkIds::Missing,
            tokens: 0,
            ..chunk("", &[])
        });
        let d = m.decide(FailureReason::WorkerFailed, &[1], None, no_tokenizer);
        assert!(matches!(d, Decision::Migrate(c) if c.tokens == [1, 5]));
    }

    #[test]
    fn the_limit_is_counted_across_migrations_and_usage_adds_up() {
        let mut m = MigrationState::new(2, 1, 1 << 20);
        m.on_choice(chunk("a", &[1]));
        assert!(matches!(
            m.decide(FailureReason::WorkerFailed, &[9], Some(5), no_tokenizer),
            Decision::Migrate(_)
        ));
        m.on_choice(chunk("b", &[2]));
        let Decision::Migrate(c) =
            m.decide(FailureReason::WorkerTimeout, &[9], Some(5), no_tokenizer)
        else {
            panic!()
        };
        assert_eq!(
            (c.tokens, c.max_tokens, c.generated),
            (vec![9, 1, 2], Some(3), 2)
        );
        assert_eq!(m.earlier_tokens(), 2);
        m.on_choice(chunk("c", &[3]));
        assert_eq!(
            m.decide(FailureReason::WorkerTimeout, &[9], Some(5), no_tokenizer),
            Decision::End {
                reason: FailureReason::WorkerTimeout,
                why: NotMigrated::LimitReached
            }
        );
    }

    #[test]
    fn what_cannot_migrate_ends_with_its_workers_error() {
        let end = |mut m: MigrationState, max: Option<u32>| match m.decide(
            FailureReason::WorkerFailed,
            &[1],
            max,
            no_tokenizer,
        ) {
            Decision::End { reason, why } => {
                assert_eq!(reason, FailureReason::WorkerFailed);
                why
            }
            d => panic!("{d:?}"),
        };
        assert_eq!(end(MigrationState::new(0, 1, 100), None), NotMigrated::Off);
        assert_eq!(
            end(MigrationState::new(3, MAX_MIGRATED_CHOICES + 1, 100), None),
            NotMigrated::Off
        );
        // A finished choice.
        let mut m = MigrationState::new(3, 1, 100);
        m.on_choice(ChoiceOutput {
            finished: true,
            ..chunk("a", &[1])
        });
        assert_eq!(end(m, None), NotMigrated::ChoiceFinished);
        // Past the byte cap.
        let mut m = MigrationState::new(3, 1, 4);
        m.on_choice(chunk("abcde", &[1]));
        assert!(!m.is_kept());
        assert_eq!(end(m, None), NotMigrated::NotKept);
        // A choice past `n`.
        let mut m = MigrationState::new(3, 1, 100);
        m.on_choice(ChoiceOutput {
            index: 1,
            ..chunk("a", &[1])
        });
        assert_eq!(end(m, None), NotMigrated::NotKept);
        // Every token generated.
        let mut m = MigrationState::new(3, 1, 100);
        m.on_choice(chunk("ab", &[1, 2]));
        assert_eq!(end(m, Some(2)), NotMigrated::NothingLeft);
    }

    #[test]
    fn each_unfinished_choice_is_continued_on_its_own_for_one_attempt() {
        let mut m = MigrationState::new(2, 3, 1 << 20);
        let of = |index, text, ids: &[u32], finished| ChoiceOutput {
            index,
            finished,
            ..chunk(text, ids)
        };
        m.on_choice(of(0, "a", &[10], false));
        m.on_choice(of(1, "b", &[20], false));
        m.on_choice(of(2, "c", &[30], true));
        m.on_choice(of(0, "d", &[11], false));
        assert!(m.is_kept() && !m.has_pending());
        let d = m.decide(FailureReason::WorkerFailed, &[1], Some(5), no_tokenizer);
        let Decision::Migrate(first) = d else {
            panic!("{d:?}")
        };
        // Choice 0 first, with its own output; choice 2 finished and is not resent.
        assert_eq!(
            (
                first.index,
                &first.tokens[..],
                first.max_tokens,
                first.generated
            ),
            (0, &[1, 10, 11][..], Some(3), 2)
        );
        assert_eq!(first.output_text, "ad");
        assert!(m.has_pending());
        // Choice 0's continuation finishes; choice 1 follows, no attempt used.
        m.on_choice(of(0, "e", &[12], true));
        let second = m
            .next_continuation(&[1], Some(5), no_tokenizer)
            .expect("choice 1 is left");
        assert_eq!(
            (second.index, &second.tokens[..], second.max_tokens),
            (1, &[1, 20][..], Some(4))
        );
        assert_eq!(second.reason, FailureReason::WorkerFailed);
        assert!(!m.has_pending());
        assert_eq!(m.next_continuation(&[1], Some(5), no_tokenizer), None);
        // Every earlier token of every choice counts in the last worker's usage.
        assert_eq!(m.earlier_tokens(), 5);
        let worker = TokenUsage {
            prompt_tokens: 2,
            completion_tokens: 4,
            cached_tokens: None,
        };
        assert_eq!(m.request_usage(1, worker).completion_tokens, 9);
        // Its continuation fails too: the one attempt left resends only choice 1.
        m.on_choice(of(1, "f", &[21], false));
        let d = m.decide(FailureReason::WorkerTimeout, &[1], Some(5), no_tokenizer);
        assert!(
            matches!(&d, Decision::Migrate(c) if c.index == 1 && c.tokens == [1, 20, 21]),
            "{d:?}"
        );
        assert!(!m.has_pending());
        m.on_choice(of(1, "g", &[22], false));
        assert!(matches!(
            m.decide(FailureReason::WorkerFailed, &[1], Some(5), no_tokenizer),
            Decision::End {
                why: NotMigrated::LimitReached,
                ..
            }
        ));
    }

    #[test]
    fn the_byte_cap_covers_all_choices_and_a_choice_without_tokens_left_ends_it() {
        let mut m = MigrationState::new(3, 2, 5);
        m.on_choice(chunk("abc", &[1]));
        m.on_choice(ChoiceOutput {
            index: 1,
            ..chunk("def", &[2])
        });
        assert!(!m.is_kept(), "6 bytes over both choices, against 5");
        let mut m = MigrationState::new(3, 2, 100);
        m.on_choice(chunk("ab", &[1, 2]));
        assert!(matches!(
            m.decide(FailureReason::WorkerFailed, &[9], Some(2), no_tokenizer),
            Decision::End {
                why: NotMigrated::NothingLeft,
                ..
            }
        ));
    }

    #[test]
    fn before_any_migration_a_workers_usage_is_the_requests() {
        let m = MigrationState::new(3, 1, 100);
        let usage = TokenUsage {
            prompt_tokens: 5,
            completion_tokens: 2,
            cached_tokens: None,
        };
        assert_eq!(m.request_usage(99, usage), usage);
    }
}
