//! The seed's multi-turn chat workload (seeds 000 and 002), sans-IO.
//!
//! Conversations start from a pool of ten technical passages (~3,500–3,800 tokens each, in the
//! system message after a short instruction), last 3–5 turns, and resend their whole history
//! every turn with the Llama-3 chat template and a new user question; replies are ~830 tokens.
//! A simulated user thinks between a reply and the next question; a finished conversation is
//! replaced at once, so the number of open conversations (the concurrency) stays constant.
//! Everything is configurable through [`WorkloadConfig`], whose `Default` is the seed.
//!
//! Seed 004 adds two single-turn workloads and a mix ([`Mix`], [`Class`]): **B**
//! summarisation (an instruction and one document of ≈ 4k, 10k or 18k tokens, a 100–300-token
//! answer) and **C** reasoning (a short prompt from a bank of 64, a 1,000–4,000-token answer),
//! both from [`text::TaskAssets`] (each B request's message starts with its own request line
//! unless [`WorkloadConfig::repeat_documents`], so B stays prefill-heavy); each new session
//! draws its class from
//! [`WorkloadConfig::mix`]. And an open loop ([`Arrivals::Open`], [`WorkloadConfig::rate_rps`]):
//! sessions arrive Poisson at a rate instead of a constant number being open; an A
//! conversation that arrived runs all its turns (each after the previous reply and the think
//! time), at most [`WorkloadConfig::max_open`] sessions are open and further arrivals are
//! refused and counted. A chat-only mix in the closed loop (the default) draws nothing new:
//! the seeds' workload is unchanged, request for request.
//!
//! Three layers, so that the simulator and the load generator send the same conversations:
//! - the **schedule** ([`ChatWorkload`]): which conversations are open, when each sends its
//!   next turn (think time, the start ramp), how many are open ([`Arrivals`]);
//! - the **script** ([`Script`]): conversation *k*'s passage, turn count, and per turn the
//!   question and planned reply ([`TurnPlan`]), drawn from one source ([`text::Assets`]);
//! - the **content** ([`Content`]): the plans written out as token ids for the simulator
//!   ([`TokenContent`], the default) or as text for the load generator ([`TextContent`]).
//!   The text form tokenized (with the planned replies as answers) is the token form.
//!
//! Token ids come from a real tokenizer over a real corpus ([`text`]): prompts are built
//! incrementally (each turn's prompt is the previous prompt + the previous reply +
//! `<|eot_id|>` + the new user message + the assistant header, equal to tokenizing the
//! rendered conversation), and planned replies are token sequences that tokenize back to
//! themselves, so the prefix caching a real engine would get is exactly what a simulated one
//! gets.
//!
//! **Architecture invariant:** no I/O, no clock, no threads. Time comes in as
//! [`nanotime::Nanos`]; randomness from ChaCha8 seeded by the workload seed and the
//! conversation id, so a run is a pure function of (config, seed, the driver's calls), and a
//! conversation's script (passage, turns, questions, lengths, think times) does not depend on
//! timing at all.
//!
//! ```
//! use nanotime::Nanos;
//! use workload::{Assets, ChatWorkload, WorkloadConfig};
//!
//! let assets = Assets::builtin().unwrap();
//! let config = WorkloadConfig { concurrency: 2, ramp_s: 0.0, ..WorkloadConfig::default() };
//! let mut workload = ChatWorkload::new(config, assets, 7, Nanos::ZERO).unwrap();
//! let first = workload.poll_request().unwrap();
//! assert!(first.prompt.len() > 3_000); // the passage
//! assert!((530..=1_130).contains(&first.output.len()));
//! let _second = workload.poll_request().unwrap();
//! assert!(workload.poll_request().is_none()); // both conversations wait on their turn
//!
//! // The reply arrives; the user thinks, then asks again with the whole history.
//! workload.on_turn_finished(first.key, Nanos::from_secs(40));
//! let wake = workload.poll_timeout().unwrap();
//! workload.handle_timeout(wake);
//! let next = workload.poll_request().unwrap();
//! assert_eq!(next.key.turn, 1);
//! assert!(next.prompt.starts_with(&first.prompt));
//! assert_eq!(&next.prompt[first.prompt.len()..][..first.output.len()], &*first.output);
//! ```

mod config;
mod content;
mod families;
mod mix;
pub mod replay;
pub mod scenario;
mod schedule;
mod script;
pub mod trace;

pub use config::{
    DEFAULT_MAX_OPEN, DEFAULT_SYSTEM_PROMPT, Distribution, MAX_CONCURRENCY, MAX_RATE, MAX_SECONDS,
    MAX_TURNS, TurnRange, WorkloadConfig,
};
pub use content::{Content, TextContent, TextTurn, TokenContent, TokenHistory, Turn, TurnKey};
pub use families::{LockStep, MAX_NEW_TOKENS_RATIO, MAX_SYSTEM_GROUPS, SystemGroups};
pub use mix::{Class, MAX_MIX_TOTAL, Mix, MixError};
pub use schedule::{Arrivals, ChatWorkload, ConversationInfo, WorkloadStats};
pub use script::{Ask, Script, TurnPlan};
pub use text::Assets;
pub use trace::{
    PrefixOracle, PromptSynth, SessionStep, Speed, TRACE_BLOCK_TOKENS, Trace, TraceError,
    TraceRecord,
};

/// Why a workload could not be built.
#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    #[error("invalid workload config: {0}")]
    InvalidConfig(String),
    // The cause is in the message, not a `source` too, so an error chain prints it once.
    #[error("workload assets: {0}")]
    Assets(text::TextError),
    #[error("no open conversation {0}")]
    UnknownConversation(u64),
}

impl From<text::TextError> for WorkloadError {
    fn from(e: text::TextError) -> Self {
        WorkloadError::Assets(e)
    }
}
