//! Workload families beyond the seed's chat, as settings of [`crate::WorkloadConfig`] that
//! the schedule, the script and both renderings read; no driver knows about them.
//!
//! - **Lock-step multi-turn** ([`LockStep`]), as AIPerf's multi-turn client sends it: the
//!   first turn is the seed's (instruction + passage + a question); every later turn's user
//!   message carries new material of `new_tokens_ratio` × the conversation so far (the
//!   previous prompt plus its reply, in tokens), capped at [`LockStep::max_new_tokens`]. The
//!   material is real text (the reply generator's, about the conversation's passage), so the
//!   text rendering tokenizes to the token rendering. With constant answers and no think time
//!   this is the client whose prefills pile up behind each other under a sticky router.
//! - **Shared system-prompt groups** ([`SystemGroups`]): `groups` system prompts of
//!   `tokens` tokens each (the instruction, then readable text drawn for that group);
//!   every conversation draws its group uniformly, so conversations of one group share that
//!   long prefix exactly and groups share nothing beyond the instruction.
//!
//! Think times are the seed's own setting ([`crate::WorkloadConfig::think_time_s`]).

use std::sync::Arc;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use text::{Assets, ChatMessage, Reply};

use crate::{WorkloadConfig, WorkloadError};

/// Upper bound on [`LockStep::new_tokens_ratio`].
pub const MAX_NEW_TOKENS_RATIO: f64 = 16.0;
/// Upper bound on [`SystemGroups::groups`]: bounds the prompts a rendering keeps.
pub const MAX_SYSTEM_GROUPS: u32 = 10_000;
/// Seeds each group's text: fixed, so group `g` is the same prompt for every workload seed.
const GROUP_TEXT_SEED: u64 = 0x6772_6f75_7073;

/// Lock-step multi-turn: each turn after the first adds `new_tokens_ratio` × the history so
/// far as new user tokens.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LockStep {
    /// New user tokens of turn k ≥ 1 over the tokens of turn k − 1's prompt plus its reply.
    pub new_tokens_ratio: f64,
}

impl LockStep {
    /// The new user tokens of a turn whose history (previous prompt + reply) has
    /// `history_tokens` tokens, at most `max_new_tokens` (the longest text the reply
    /// generator writes).
    pub fn new_tokens(&self, history_tokens: usize, max_new_tokens: usize) -> usize {
        let wanted = (self.new_tokens_ratio * history_tokens as f64).round() as usize;
        wanted.clamp(1, max_new_tokens.max(1))
    }

    /// The most new tokens one turn can add with these assets.
    pub fn max_new_tokens(assets: &Assets) -> usize {
        assets.replies().max_tokens()
    }

    fn validate(&self) -> Result<(), WorkloadError> {
        let r = self.new_tokens_ratio;
        if !(r.is_finite() && r > 0.0 && r <= MAX_NEW_TOKENS_RATIO) {
            return Err(WorkloadError::InvalidConfig(format!(
                "lockstep.new_tokens_ratio must be in (0, {MAX_NEW_TOKENS_RATIO}], got {r}"
            )));
        }
        Ok(())
    }
}

/// Conversations drawn into groups that share one long system prompt per group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SystemGroups {
    /// How many distinct system prompts (each conversation draws one uniformly).
    pub groups: u32,
    /// Tokens of each group's text after the instruction.
    pub tokens: u32,
}

impl SystemGroups {
    /// Group `group`'s system message: the instruction, then `tokens` tokens of text about
    /// passage `group % passages` drawn from the group's own seed.
    pub fn system_message(
        &self,
        assets: &Assets,
        config: &WorkloadConfig,
        group: usize,
    ) -> Result<ChatMessage, WorkloadError> {
        let passages = (config.passages as usize).clamp(1, assets.replies().passages().max(1));
        let mut rng = ChaCha8Rng::seed_from_u64(GROUP_TEXT_SEED);
        rng.set_stream(group as u64);
        let body = assets
            .replies()
            .generate(group % passages, self.tokens as usize, &mut rng)?;
        let body = assets.tokenizer().decode(&body.ids)?;
        Ok(ChatMessage::system(format!(
            "{}\n\n{body}",
            config.system_prompt
        )))
    }

    /// `<|begin_of_text|>` + group `group`'s system message, as token ids.
    pub fn prefix(
        &self,
        assets: &Assets,
        config: &WorkloadConfig,
        group: usize,
    ) -> Result<Arc<[u32]>, WorkloadError> {
        let message = self.system_message(assets, config, group)?;
        let mut ids = vec![assets.format().bos()];
        assets
            .format()
            .push_message(assets.tokenizer(), &message, &mut ids);
        Ok(ids.into())
    }

    fn validate(&self, assets_max: Option<usize>) -> Result<(), WorkloadError> {
        if self.groups == 0 || self.groups > MAX_SYSTEM_GROUPS {
            return Err(WorkloadError::InvalidConfig(format!(
                "system_groups.groups must be 1..={MAX_SYSTEM_GROUPS}, got {}",
                self.groups
            )));
        }
        if self.tokens == 0 {
            return Err(WorkloadError::InvalidConfig(
                "system_groups.tokens must be at least 1".into(),
            ));
        }
        if let Some(max) = assets_max {
            if self.tokens as usize > max {
                return Err(WorkloadError::InvalidConfig(format!(
                    "system_groups.tokens: at most {max} tokens per group prompt"
                )));
            }
        }
        Ok(())
    }
}

/// Checks the families' settings of `config` (with `assets`, their lengths too).
pub(crate) fn validate(
    config: &WorkloadConfig,
    assets: Option<&Assets>,
) -> Result<(), WorkloadError> {
    if let Some(lockstep) = &config.lockstep {
        lockstep.validate()?;
    }
    if let Some(groups) = &config.system_groups {
        groups.validate(assets.map(|a| a.replies().max_tokens()))?;
    }
    Ok(())
}

/// The new material of a lock-step turn: `tokens` tokens of text about `passage`.
pub(crate) fn new_material(
    assets: &Assets,
    passage: usize,
    tokens: usize,
    rng: &mut ChaCha8Rng,
) -> Result<Reply, WorkloadError> {
    let passages = assets.replies().passages().max(1);
    Ok(assets.replies().generate(passage % passages, tokens, rng)?)
}
