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
    /// Migration is off for it: `migration_limit` 0, or several choices (`n` > 1), whose
    /// continuation is not one prompt.
    Off,
    /// It has been resent `migration_limit` times already.
    LimitReached,
    /// Its choice already ended (a finish reason came): nothing is left to resend.
    ChoiceFinished,
    /// Its output so far is over the response byte cap, or a second choice appeared: it is no
    /// longer kept.
    NotKept,
    /// Every token of `max_tokens` was generated: nothing is left to generate.
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
    /// The prompt's tokens followed by the output's.
    pub tokens: Vec<u32>,
    /// The output text so far, for a worker that takes the prompt as text (appended to it).
    pub output_text: String,
    /// What is left of `max_tokens` (`None`: the request set none).
    pub max_tokens: Option<u32>,
    /// Output tokens generated before this resend, by every earlier worker.
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

/// The output so far of a request that may still migrate.
#[derive(Debug, Clone, Default)]
struct SoFar {
    text: String,
    /// The ids, while every chunk with text carried them; `None` otherwise.
    ids: Option<Vec<u32>>,
    tokens: u64,
}

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

/// One request's migrations: what it generated so far (only what a resend needs, within a
/// byte cap), how many resends are left, and what earlier workers generated.
#[derive(Debug, Clone)]
pub struct MigrationState {
    attempts_left: u32,
    max_output_bytes: usize,
    /// `None`: it cannot migrate (off, or no longer kept).
    so_far: Option<SoFar>,
    /// Why `so_far` is `None`.
    not_kept: NotMigrated,
    choice_finished: bool,
    /// Output tokens of the workers before the current one.
    earlier_tokens: u64,
}

impl MigrationState {
    /// A request with `choices` choices (`n`), resent at most `limit` times, whose output is
    /// kept for a resend up to `max_output_bytes` of text.
    pub fn new(limit: u32, choices: u32, max_output_bytes: usize) -> MigrationState {
        let on = limit > 0 && choices == 1;
        MigrationState {
            attempts_left: limit,
            max_output_bytes,
            so_far: on.then(|| SoFar {
                ids: Some(Vec::new()),
                ..SoFar::default()
            }),
            not_kept: NotMigrated::Off,
            choice_finished: false,
            earlier_tokens: 0,
        }
    }

    /// Whether it may still migrate (its output is kept).
    pub fn is_kept(&self) -> bool {
        self.so_far.is_some()
    }

    /// Output tokens of the workers before the current one.
    pub fn earlier_tokens(&self) -> u64 {
        self.earlier_tokens
    }

    /// Keeps what a resend needs of one choice of a worker's chunk; stops keeping (no
    /// migration) at a second choice or past the byte cap.
    pub fn on_choice(&mut self, choice: ChoiceOutput<'_>) {
        if choice.finished {
            self.choice_finished = true;
        }
        let Some(so_far) = &mut self.so_far else {
            return;
        };
        if choice.index != 0 {
            self.stop_keeping();
            return;
        }
        so_far.text.push_str(choice.text);
        so_far.tokens += choice.tokens;
        if let Some(ids) = &mut so_far.ids {
            match choice.ids {
                ChunkIds::Ids(more) => ids.extend_from_slice(more),
                // A chunk with only a finish reason may carry no ids.
                ChunkIds::Missing if choice.text.is_empty() => {}
                ChunkIds::Missing | ChunkIds::Unreadable => so_far.ids = None,
            }
        }
        if so_far.text.len() > self.max_output_bytes {
            self.stop_keeping();
        }
    }

    fn stop_keeping(&mut self) {
        self.so_far = None;
        self.not_kept = NotMigrated::NotKept;
    }

    /// The current worker failed for `reason`: migrate (using up one attempt) or end. The
    /// continuation is `prompt` followed by the worker's ids when every chunk carried them,
    /// else by `tokenize` of the text; `max_tokens` is the client's.
    pub fn decide(
        &mut self,
        reason: FailureReason,
        prompt: &[u32],
        max_tokens: Option<u32>,
        tokenize: impl FnOnce(&str) -> Vec<u32>,
    ) -> Decision {
        let end = |why| Decision::End { reason, why };
        let Some(so_far) = &self.so_far else {
            return end(self.not_kept);
        };
        if self.choice_finished {
            return end(NotMigrated::ChoiceFinished);
        }
        if self.attempts_left == 0 {
            return end(NotMigrated::LimitReached);
        }
        let generated = u32::try_from(so_far.tokens).unwrap_or(u32::MAX);
        let max_tokens = match max_tokens {
            Some(max) => match max.saturating_sub(generated) {
                0 => return end(NotMigrated::NothingLeft),
                left => Some(left),
            },
            None => None,
        };
        self.attempts_left -= 1;
        let mut tokens = Vec::with_capacity(prompt.len() + so_far.tokens as usize);
        tokens.extend_from_slice(prompt);
        match &so_far.ids {
            Some(ids) if ids.len() as u64 == so_far.tokens => tokens.extend_from_slice(ids),
            // Without the worker's ids: the text's, as the model's tokenizer writes it.
            _ => tokens.extend(tokenize(&so_far.text)),
        }
        self.earlier_tokens = so_far.tokens;
        Decision::Migrate(Continuation {
            tokens,
            output_text: so_far.text.clone(),
            max_tokens,
            generated: so_far.tokens,
            reason,
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
        assert_eq!(end(MigrationState::new(3, 2, 100), None), NotMigrated::Off);
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
        // A second choice.
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
