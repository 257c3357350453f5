//! The one source of a conversation's content: which passage it is about, how many turns it
//! has, and per turn the user's question, the planned answer and the pause before the next
//! question. Both renderings ([`crate::TokenContent`] for the simulator, [`crate::TextContent`]
//! for the load generator) write out the same [`TurnPlan`]s, so conversation *k* of a seed is
//! the same conversation in `kvroute sim` and in `kvroute demo`.
//!
//! Workloads B (summarisation: long documents, short answers) and C (reasoning: short
//! prompts, long answers) are other sources of the same shape: a document pool and question
//! templates in [`text::Assets`] (a corpus of long documents for B; no passage and short
//! prompts for C) and their own length distributions in [`crate::WorkloadConfig`]. They yield
//! [`TurnPlan`]s like this one, so the schedule, both renderings and every driver stay as they
//! are.

use nanotime::Nanos;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use text::{Assets, QuestionPlan, Reply};

use crate::{WorkloadConfig, WorkloadError};

/// What one turn says, before it is written as tokens or text: the question and the planned
/// reply (its ids fix the answer's length; its topic feeds the next question).
#[derive(Clone, Debug)]
pub struct TurnPlan {
    pub question: QuestionPlan,
    pub reply: Reply,
}

/// What the simulated user of one conversation does: the passage, the number of turns, and per
/// turn the question, the reply and the think time. Drawn in that order from the
/// conversation's own RNG (seeded by the workload seed and the conversation number), so
/// conversation *k* is the same in every run with the same seed, whatever the timing and
/// whichever rendering: two routers compared on one seed see the same conversations, and the
/// load generator sends the text of the simulator's tokens.
#[derive(Clone, Debug)]
pub struct Script {
    rng: ChaCha8Rng,
    passage: usize,
    turns: u32,
    /// The last reply's term, for the next question.
    topic: Option<usize>,
}

impl Script {
    /// Conversation `conversation` of the workload seeded `seed`, on one of the first
    /// `passages` passages.
    pub fn new(seed: u64, conversation: u64, config: &WorkloadConfig, passages: usize) -> Script {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        rng.set_stream(conversation);
        let passage = rng.random_range(0..passages);
        let turns = config.turns.sample(&mut rng);
        Script {
            rng,
            passage,
            turns,
            topic: None,
        }
    }

    pub fn passage(&self) -> usize {
        self.passage
    }

    pub fn turns(&self) -> u32 {
        self.turns
    }

    /// Turn `turn`'s question and planned reply. Call once per turn, in order.
    pub fn next_turn(
        &mut self,
        assets: &Assets,
        config: &WorkloadConfig,
        turn: u32,
    ) -> Result<TurnPlan, WorkloadError> {
        let questions = assets.questions();
        let question = if turn == 0 {
            questions.plan_first(self.passage, &mut self.rng)
        } else {
            questions.plan_follow_up(self.passage, self.topic, &mut self.rng)
        };
        let tokens = config.output_tokens.sample(&mut self.rng).round().max(1.0) as usize;
        let reply = assets
            .replies()
            .generate(self.passage, tokens, &mut self.rng)?;
        self.topic = reply.topic;
        Ok(TurnPlan { question, reply })
    }

    /// The user's pause before the next question.
    pub fn think_time(&mut self, config: &WorkloadConfig) -> Nanos {
        Nanos::from_secs_f64(config.think_time_s.sample(&mut self.rng))
    }
}
