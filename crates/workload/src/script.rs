//! The one source of a conversation's content: which passage it is about, how many turns it
//! has, and per turn the user's question, the planned answer and the pause before the next
//! question. Both renderings ([`crate::TokenContent`] for the simulator, [`crate::TextContent`]
//! for the load generator) write out the same [`TurnPlan`]s, so conversation *k* of a seed is
//! the same conversation in `kvroute sim` and in `kvroute demo`.
//!
//! Workloads B (summarisation: long documents, short answers) and C (reasoning: short
//! prompts, long answers) are scripts of the same shape with one turn: a document or a prompt
//! from [`text::TaskAssets`] ([`text::Assets::tasks`]), and a reply whose length comes from
//! [`crate::WorkloadConfig::summary_tokens`] or from the prompt's expected output length
//! scaled by [`crate::WorkloadConfig::reasoning_scale`]. They yield [`TurnPlan`]s like chat's,
//! so the schedule, both renderings and every driver handle them alike; the simulator and the
//! load generator send the same B and C requests for a seed.

use std::sync::Arc;

use nanotime::Nanos;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use text::{Assets, QuestionPlan, Reply};

use crate::{Class, WorkloadConfig, WorkloadError};

/// What a turn asks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ask {
    /// A: the user's question about the conversation's passage.
    Chat(QuestionPlan),
    /// B: summarise document `document` of [`text::TaskAssets::documents`]; with `request`,
    /// the user message starts with that request's own line
    /// ([`text::TaskAssets::request_line`]), so that requests share no block beyond the
    /// template and the instruction.
    Summarise {
        document: usize,
        request: Option<u64>,
    },
    /// C: answer reasoning prompt `i` of [`text::TaskAssets::bank`].
    Reason(usize),
    /// A lock-step turn ([`crate::LockStep`]): the user message is this new material (token
    /// ids that tokenize back to themselves).
    NewMaterial(Arc<[u32]>),
}

/// What one turn says, before it is written as tokens or text: what it asks and the planned
/// reply (its ids fix the answer's length; for chat, its topic feeds the next question).
#[derive(Clone, Debug)]
pub struct TurnPlan {
    pub ask: Ask,
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
    class: Class,
    /// The passage (A), document (B) or prompt (C).
    passage: usize,
    /// The system prompt the rendering opens the conversation with: the passage's, or with
    /// [`crate::SystemGroups`] the conversation's group.
    system: usize,
    turns: u32,
    /// The last reply's term, for the next question.
    topic: Option<usize>,
    /// The session's number (B's request line).
    session: u64,
}

impl Script {
    /// Conversation `conversation` of the workload seeded `seed`, on one of the first
    /// `passages` passages.
    pub fn new(seed: u64, conversation: u64, config: &WorkloadConfig, passages: usize) -> Script {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        rng.set_stream(conversation);
        let (system, passage) = match config.system_groups {
            // A group's questions are about the passage its text was drawn from.
            Some(groups) => {
                let group = rng.random_range(0..groups.groups.max(1) as usize);
                (group, group % passages.max(1))
            }
            None => {
                let passage = rng.random_range(0..passages);
                (passage, passage)
            }
        };
        let turns = config.turns.sample(&mut rng);
        Script {
            rng,
            class: Class::A,
            passage,
            system,
            turns,
            topic: None,
            session: conversation,
        }
    }

    /// Session `session` of class `class`: [`Script::new`] for A; for B and C one turn on a
    /// document or prompt drawn uniformly from the same RNG stream.
    pub fn for_class(
        class: Class,
        seed: u64,
        session: u64,
        config: &WorkloadConfig,
        assets: &Assets,
    ) -> Result<Script, WorkloadError> {
        let items = match class {
            Class::A => return Ok(Script::new(seed, session, config, config.passages as usize)),
            Class::B => assets.tasks()?.documents().len(),
            Class::C => assets.tasks()?.bank().len(),
        };
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        rng.set_stream(session);
        let passage = rng.random_range(0..items.max(1));
        Ok(Script {
            rng,
            class,
            passage,
            system: passage,
            turns: 1,
            topic: None,
            session,
        })
    }

    /// The passage (A), document (B) or reasoning prompt (C) index.
    pub fn passage(&self) -> usize {
        self.passage
    }

    /// The system prompt the conversation opens with: its passage, or its group with
    /// [`crate::SystemGroups`].
    pub fn system(&self) -> usize {
        self.system
    }

    pub fn class(&self) -> Class {
        self.class
    }

    pub fn turns(&self) -> u32 {
        self.turns
    }

    /// Turn `turn`'s question and planned reply. Call once per turn, in order;
    /// `history_tokens` is the previous prompt plus its reply in tokens (a lock-step turn's new
    /// material is sized on it).
    pub fn next_turn(
        &mut self,
        assets: &Assets,
        config: &WorkloadConfig,
        turn: u32,
        history_tokens: usize,
    ) -> Result<TurnPlan, WorkloadError> {
        match self.class {
            Class::A => {}
            Class::B => {
                let tokens = config.summary_tokens.sample(&mut self.rng).round().max(1.0);
                let ask = Ask::Summarise {
                    document: self.passage,
                    request: (!config.repeat_documents).then_some(self.session),
                };
                return self.single(assets, ask, tokens as usize);
            }
            Class::C => {
                let tasks = assets.tasks()?;
                let expected = tasks
                    .bank()
                    .prompts()
                    .get(self.passage)
                    .map_or(1, |p| p.expected_output_length);
                let scale = config.reasoning_scale.sample(&mut self.rng);
                let tokens = (f64::from(expected) * scale).round().max(1.0) as usize;
                let tokens = tokens.min(assets.replies().max_tokens());
                return self.single(assets, Ask::Reason(self.passage), tokens);
            }
        }
        if let (Some(lockstep), true) = (config.lockstep, turn > 0) {
            let tokens =
                lockstep.new_tokens(history_tokens, crate::LockStep::max_new_tokens(assets));
            let material =
                crate::families::new_material(assets, self.passage, tokens, &mut self.rng)?;
            let tokens = config.output_tokens.sample(&mut self.rng).round().max(1.0) as usize;
            let reply = assets
                .replies()
                .generate(self.passage, tokens, &mut self.rng)?;
            return Ok(TurnPlan {
                ask: Ask::NewMaterial(material.ids),
                reply,
            });
        }
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
        Ok(TurnPlan {
            ask: Ask::Chat(question),
            reply,
        })
    }

    /// B's and C's one turn: the reply is readable text from the reply generator (its words
    /// come from a chat passage; only its length matters to a server).
    fn single(
        &mut self,
        assets: &Assets,
        ask: Ask,
        tokens: usize,
    ) -> Result<TurnPlan, WorkloadError> {
        let passages = assets.replies().passages().max(1);
        let reply = assets
            .replies()
            .generate(self.passage % passages, tokens, &mut self.rng)?;
        Ok(TurnPlan { ask, reply })
    }

    /// The user's pause before the next question.
    pub fn think_time(&mut self, config: &WorkloadConfig) -> Nanos {
        Nanos::from_secs_f64(config.think_time_s.sample(&mut self.rng))
    }
}
