//! The chat workload's state machine: conversations, their turns, timers, concurrency.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, VecDeque};
use std::sync::Arc;

use nanotime::Nanos;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use text::{ChatMessage, QuestionGenerator, QuestionPlan, Reply, ReplyGenerator};

use crate::{Assets, WorkloadConfig, WorkloadError};

/// A conversation's number, unique within a workload, in order of creation.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConversationId(pub u64);

/// A turn: its conversation and its index there (0 = the first turn).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TurnId {
    pub conversation: ConversationId,
    pub turn: u32,
}

/// One request to serve.
#[derive(Clone, Debug)]
pub struct TurnRequest {
    pub id: TurnId,
    /// The templated history plus the new question and the assistant header: starts with the
    /// previous turn's `prompt` followed by its `output`.
    pub prompt: Arc<[u32]>,
    /// The planned reply: an engine generates exactly these tokens.
    pub output: Arc<[u32]>,
    /// When the simulated user sent it (the start of TTFT and E2E).
    pub issued_at: Nanos,
}

/// Counters since the workload started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WorkloadStats {
    pub conversations_started: u64,
    pub conversations_completed: u64,
    /// Abandoned after a failed turn.
    pub conversations_failed: u64,
    /// Closed by a shrink of the concurrency before their first turn.
    pub conversations_closed: u64,
    pub turns_issued: u64,
    pub turns_finished: u64,
    pub prompt_tokens_issued: u64,
    pub output_tokens_issued: u64,
    /// Turns that could not be built (cannot happen with a validated config); their
    /// conversations were closed without replacement.
    pub issue_errors: u64,
}

/// A conversation as seen from outside (transcripts, dashboards).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConversationInfo {
    pub id: ConversationId,
    /// Index of the passage in the corpus.
    pub passage: usize,
    /// Turns this conversation will have.
    pub turns: u32,
    /// Turns issued so far (including one in flight).
    pub turns_issued: u32,
    /// Tokens of the latest prompt (0 before the first turn).
    pub prompt_tokens: usize,
    pub in_flight: bool,
}

/// What the simulated user of one conversation does, independent of token bookkeeping: the
/// passage, the number of turns, and per turn the question, the reply length and the think
/// time. Drawn from the conversation's own RNG (seeded by the workload seed and the
/// conversation id), so conversation *k* is the same in every run with the same seed, whatever
/// the timing — two routers compared on one seed see the same conversations.
#[derive(Clone, Debug)]
pub struct Script {
    rng: ChaCha8Rng,
    passage: usize,
    turns: u32,
}

impl Script {
    fn new(seed: u64, id: ConversationId, config: &WorkloadConfig, passages: usize) -> Script {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        rng.set_stream(id.0);
        let passage = rng.random_range(0..passages);
        let turns = config.turns.sample(&mut rng);
        Script {
            rng,
            passage,
            turns,
        }
    }

    pub fn passage(&self) -> usize {
        self.passage
    }

    pub fn turns(&self) -> u32 {
        self.turns
    }

    /// The user's question for turn `turn`; `topic` is the last reply's term.
    pub fn question(
        &mut self,
        questions: &QuestionGenerator,
        turn: u32,
        topic: Option<usize>,
    ) -> QuestionPlan {
        if turn == 0 {
            questions.plan_first(self.passage, &mut self.rng)
        } else {
            questions.plan_follow_up(self.passage, topic, &mut self.rng)
        }
    }

    /// The planned reply length of the next turn, in tokens.
    pub fn output_tokens(&mut self, config: &WorkloadConfig) -> usize {
        config.output_tokens.sample(&mut self.rng).round().max(1.0) as usize
    }

    /// The planned reply of `tokens` tokens.
    pub fn reply(
        &mut self,
        replies: &ReplyGenerator,
        tokens: usize,
    ) -> Result<Reply, WorkloadError> {
        Ok(replies.generate(self.passage, tokens, &mut self.rng)?)
    }

    /// The user's pause before the next question.
    pub fn think_time(&mut self, config: &WorkloadConfig) -> Nanos {
        Nanos::from_secs_f64(config.think_time_s.sample(&mut self.rng))
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Thinking, or waiting for its ramp slot: ready at `until`.
    Waiting { until: Nanos },
    /// In the ready queue since `since`.
    Ready { since: Nanos },
    /// Turn `turn` was issued and has not ended.
    InFlight { turn: u32 },
}

#[derive(Debug)]
struct Conversation {
    script: Script,
    /// Index of the next turn to issue (or of the turn in flight).
    next_turn: u32,
    phase: Phase,
    /// The latest prompt; the next prompt starts with it.
    history: Option<Arc<[u32]>>,
    /// The latest planned reply (follows `history` in the next prompt).
    reply: Option<Arc<[u32]>>,
    /// The latest reply's term, for the next question.
    topic: Option<usize>,
}

/// The seed's multi-turn chat workload, sans-IO (quinn-proto style).
///
/// Drive it with the time: [`ChatWorkload::handle_timeout`] at [`ChatWorkload::poll_timeout`],
/// drain [`ChatWorkload::poll_request`] after every call, report each turn's end with
/// [`ChatWorkload::on_turn_finished`] or [`ChatWorkload::on_turn_failed`].
///
/// Bounds: the conversation table holds at most the largest concurrency set (≤
/// [`crate::MAX_CONCURRENCY`]); the timer heap and ready queue hold at most one live entry per
/// conversation plus entries of conversations removed by a shrink, which are dropped as they
/// come up. Per turn the work is one encode of the new question and one copy of the prompt;
/// passages' tokens are shared by all conversations.
#[derive(Debug)]
pub struct ChatWorkload {
    config: WorkloadConfig,
    assets: Arc<Assets>,
    seed: u64,
    /// Per passage in use: `<|begin_of_text|>` + system message.
    prefixes: Vec<Arc<[u32]>>,
    target: u32,
    conversations: BTreeMap<ConversationId, Conversation>,
    next_id: u64,
    timers: BinaryHeap<Reverse<(Nanos, u64, ConversationId)>>,
    timer_seq: u64,
    ready: VecDeque<ConversationId>,
    now: Nanos,
    stats: WorkloadStats,
}

impl ChatWorkload {
    /// A workload of `config.concurrency` conversations whose starts spread over
    /// `config.ramp_s` from `now`.
    pub fn new(
        config: WorkloadConfig,
        assets: Arc<Assets>,
        seed: u64,
        now: Nanos,
    ) -> Result<Self, WorkloadError> {
        config.validate()?;
        let available = assets.corpus().len();
        if config.passages as usize > available {
            return Err(WorkloadError::InvalidConfig(format!(
                "passages: the corpus has {available}, {} asked for",
                config.passages
            )));
        }
        let max_reply = assets.replies().max_tokens();
        if config.output_tokens.bounds().1 > max_reply as f64 {
            return Err(WorkloadError::InvalidConfig(format!(
                "output_tokens: at most {max_reply} tokens per reply"
            )));
        }
        let prefixes = (0..config.passages as usize)
            .map(|p| assets.prefix(&config.system_prompt, p))
            .collect();
        let target = config.concurrency;
        let mut me = ChatWorkload {
            config,
            assets,
            seed,
            prefixes,
            target,
            conversations: BTreeMap::new(),
            next_id: 0,
            timers: BinaryHeap::new(),
            timer_seq: 0,
            ready: VecDeque::new(),
            now,
            stats: WorkloadStats::default(),
        };
        let ramp = Nanos::from_secs_f64(me.config.ramp_s);
        for i in 0..u64::from(target) {
            // Evenly spaced: conversation i starts at ramp × i / n.
            let offset = (u128::from(ramp.as_nanos()) * u128::from(i) / u128::from(target)) as u64;
            me.open_conversation(now + Nanos(offset));
        }
        Ok(me)
    }

    fn open_conversation(&mut self, start: Nanos) {
        let id = ConversationId(self.next_id);
        self.next_id += 1;
        let script = Script::new(self.seed, id, &self.config, self.prefixes.len());
        let mut conversation = Conversation {
            script,
            next_turn: 0,
            phase: Phase::Ready { since: start },
            history: None,
            reply: None,
            topic: None,
        };
        if start <= self.now {
            self.ready.push_back(id);
        } else {
            conversation.phase = Phase::Waiting { until: start };
            self.push_timer(start, id);
        }
        self.conversations.insert(id, conversation);
        self.stats.conversations_started += 1;
    }

    fn push_timer(&mut self, at: Nanos, id: ConversationId) {
        self.timers.push(Reverse((at, self.timer_seq, id)));
        self.timer_seq += 1;
    }

    /// Opens conversations until `target` are open.
    fn refill(&mut self) {
        while (self.conversations.len() as u64) < u64::from(self.target) {
            self.open_conversation(self.now);
        }
    }

    /// Sets the number of open conversations. Growth starts new conversations at `now`;
    /// shrinking first closes conversations that have not sent their first turn yet (newest
    /// first), then lets the rest end naturally without replacing them.
    pub fn set_concurrency(&mut self, n: u32, now: Nanos) {
        self.advance(now);
        self.target = n.min(crate::MAX_CONCURRENCY);
        let excess = self
            .conversations
            .len()
            .saturating_sub(self.target as usize);
        if excess > 0 {
            let unstarted: Vec<ConversationId> = self
                .conversations
                .iter()
                .rev()
                .filter(|(_, c)| c.next_turn == 0 && !matches!(c.phase, Phase::InFlight { .. }))
                .map(|(id, _)| *id)
                .take(excess)
                .collect();
            for id in unstarted {
                // Their timer and ready-queue entries go stale and are skipped.
                self.conversations.remove(&id);
                self.stats.conversations_closed += 1;
            }
        }
        self.refill();
    }

    /// The target number of open conversations.
    pub fn concurrency(&self) -> u32 {
        self.target
    }

    /// When [`ChatWorkload::handle_timeout`] is next needed: the earliest end of a think time
    /// or ramp slot. `None` when every conversation waits on a turn in flight.
    pub fn poll_timeout(&self) -> Option<Nanos> {
        self.timers.peek().map(|Reverse((at, _, _))| *at)
    }

    /// Moves conversations whose wait ended by `now` to the ready queue.
    pub fn handle_timeout(&mut self, now: Nanos) {
        self.advance(now);
        while let Some(&Reverse((at, _, id))) = self.timers.peek() {
            if at > self.now {
                break;
            }
            self.timers.pop();
            if let Some(c) = self.conversations.get_mut(&id) {
                if c.phase == (Phase::Waiting { until: at }) {
                    c.phase = Phase::Ready { since: at };
                    self.ready.push_back(id);
                }
            }
        }
    }

    fn advance(&mut self, now: Nanos) {
        self.now = self.now.max(now);
    }

    /// The next turn to send, in a deterministic order (by the time it became ready, then by
    /// when it was queued).
    pub fn poll_request(&mut self) -> Option<TurnRequest> {
        while let Some(id) = self.ready.pop_front() {
            let Some(c) = self.conversations.get(&id) else {
                continue;
            };
            let Phase::Ready { since } = c.phase else {
                continue;
            };
            match self.issue(id, since) {
                Ok(request) => return Some(request),
                Err(_) => {
                    // Unreachable with a validated config (reply lengths are checked against
                    // the generator's maximum). Counted, and not replaced, so that a persistent
                    // error cannot loop.
                    self.conversations.remove(&id);
                    self.stats.issue_errors += 1;
                }
            }
        }
        None
    }

    fn issue(
        &mut self,
        id: ConversationId,
        issued_at: Nanos,
    ) -> Result<TurnRequest, WorkloadError> {
        let assets = &self.assets;
        let format = assets.format();
        let c = self
            .conversations
            .get_mut(&id)
            .ok_or(WorkloadError::UnknownConversation(id))?;
        let turn = c.next_turn;
        let question = c.script.question(assets.questions(), turn, c.topic);
        let mut user = Vec::with_capacity(96);
        assets.push_user_question(&question, &mut user);
        let tokens = c.script.output_tokens(&self.config);
        let reply = c.script.reply(assets.replies(), tokens)?;
        let generation = format.generation_prompt();
        let eot = [format.eot()];
        // Slices are copied with memcpy into one buffer (an iterator chain of elements was
        // a third of the turn's cost), then once into the shared allocation.
        let parts: [&[u32]; 5] = match (&c.history, &c.reply) {
            (Some(history), Some(previous)) => [history, previous, &eot, &user, generation],
            _ => [
                &self.prefixes[c.script.passage()],
                &user,
                generation,
                &[],
                &[],
            ],
        };
        let mut ids = Vec::with_capacity(parts.iter().map(|p| p.len()).sum());
        for part in parts {
            ids.extend_from_slice(part);
        }
        let prompt: Arc<[u32]> = ids.into();
        c.history = Some(prompt.clone());
        c.reply = Some(reply.ids.clone());
        c.topic = reply.topic;
        c.phase = Phase::InFlight { turn };
        self.stats.turns_issued += 1;
        self.stats.prompt_tokens_issued += prompt.len() as u64;
        self.stats.output_tokens_issued += reply.ids.len() as u64;
        Ok(TurnRequest {
            id: TurnId {
                conversation: id,
                turn,
            },
            prompt,
            output: reply.ids,
            issued_at,
        })
    }

    /// The turn's reply arrived in full at `now`: it becomes history; the user thinks, then
    /// asks the next question, or the conversation ends and a new one replaces it at once.
    /// Unknown or stale ids are ignored.
    pub fn on_turn_finished(&mut self, id: TurnId, now: Nanos) {
        self.advance(now);
        let Some(c) = self.conversations.get_mut(&id.conversation) else {
            return;
        };
        if c.phase != (Phase::InFlight { turn: id.turn }) {
            return;
        }
        self.stats.turns_finished += 1;
        c.next_turn += 1;
        if c.next_turn >= c.script.turns() {
            self.conversations.remove(&id.conversation);
            self.stats.conversations_completed += 1;
            self.refill();
            return;
        }
        let until = self.now + c.script.think_time(&self.config);
        c.phase = Phase::Waiting { until };
        self.push_timer(until, id.conversation);
    }

    /// The turn failed (rejected, dropped, timed out): the conversation is abandoned and a new
    /// one replaces it at once. Unknown or stale ids are ignored.
    pub fn on_turn_failed(&mut self, id: TurnId, now: Nanos) {
        self.advance(now);
        let in_flight = self
            .conversations
            .get(&id.conversation)
            .is_some_and(|c| c.phase == (Phase::InFlight { turn: id.turn }));
        if in_flight {
            self.conversations.remove(&id.conversation);
            self.stats.conversations_failed += 1;
            self.refill();
        }
    }

    /// Conversations open now (started or waiting for their ramp slot).
    pub fn active_conversations(&self) -> u32 {
        self.conversations.len() as u32
    }

    pub fn stats(&self) -> WorkloadStats {
        self.stats
    }

    pub fn config(&self) -> &WorkloadConfig {
        &self.config
    }

    pub fn assets(&self) -> &Arc<Assets> {
        &self.assets
    }

    /// The open conversations, by id.
    pub fn conversations(&self) -> impl Iterator<Item = ConversationInfo> + '_ {
        self.conversations
            .keys()
            .filter_map(|id| self.conversation(*id))
    }

    /// One open conversation, in O(log n) (drivers that keep their own per-conversation state
    /// look up a new conversation's passage and turn count here).
    pub fn conversation(&self, id: ConversationId) -> Option<ConversationInfo> {
        let c = self.conversations.get(&id)?;
        Some(ConversationInfo {
            id,
            passage: c.script.passage(),
            turns: c.script.turns(),
            turns_issued: c.next_turn + u32::from(matches!(c.phase, Phase::InFlight { .. })),
            prompt_tokens: c.history.as_ref().map_or(0, |h| h.len()),
            in_flight: matches!(c.phase, Phase::InFlight { .. }),
        })
    }

    /// A conversation as text messages (system, user, assistant, …), decoded from its token
    /// history on demand; a reply in flight shows as its planned text.
    pub fn messages(&self, id: ConversationId) -> Option<Vec<ChatMessage>> {
        let c = self.conversations.get(&id)?;
        let tokenizer = self.assets.tokenizer();
        let format = self.assets.format();
        let Some(history) = &c.history else {
            return Some(Vec::new());
        };
        let mut messages = format.parse(tokenizer, history);
        // The history ends with the open assistant header; its content is the planned reply.
        if let (Some(last), Some(reply)) = (messages.last_mut(), &c.reply) {
            if last.role == "assistant" && last.content.is_empty() {
                last.content = tokenizer.decode_lossy(reply);
            }
        }
        Some(messages)
    }
}
