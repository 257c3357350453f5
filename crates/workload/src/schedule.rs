//! The schedule core: which conversations are open, when each sends its next turn (think
//! time, the ramp), and how many are open at once. What a turn says comes from the
//! conversation's [`Script`]; how it is written out (tokens or text) from a [`Content`].
//!
//! Sessions: a conversation of workload A, or one request of B or C, each drawn from the
//! config's [`crate::Mix`] when it opens. Two arrival processes ([`Arrivals`]): the closed loop
//! (`concurrency` sessions open at all times, the seeds' default) and the open loop (sessions
//! arrive at `rate_rps` per second, Poisson; an A conversation that arrived sends its later
//! turns after its replies and think times, as in the closed loop, so the request rate is the
//! arrival rate times the mean turns per session; at most `max_open` sessions are open, and an
//! arrival beyond that is refused and counted).

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, VecDeque};
use std::sync::Arc;

use nanotime::Nanos;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use text::{Assets, ChatMessage};

use crate::{
    Class, Content, MAX_RATE, Mix, Script, TokenContent, TurnKey, WorkloadConfig, WorkloadError,
};

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
    /// Prompt tokens of the turns issued, where the rendering counts tokens (0 in text form:
    /// the server tokenizes).
    pub prompt_tokens_issued: u64,
    pub output_tokens_issued: u64,
    /// Turns that could not be built (cannot happen with a validated config); their
    /// conversations were closed without replacement.
    pub issue_errors: u64,
    /// Open loop: arrivals refused because `max_open` sessions were open.
    pub arrivals_dropped: u64,
    /// Sessions started, per class (A, B, C).
    pub sessions_by_class: [u64; 3],
}

/// A conversation as seen from outside (transcripts, dashboards).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConversationInfo {
    pub id: u64,
    /// Its workload: A (chat), B (summarisation) or C (reasoning).
    pub class: Class,
    /// Index of the passage in the corpus (A), of the document (B) or of the prompt (C).
    pub passage: usize,
    /// Turns this conversation will have.
    pub turns: u32,
    /// Turns issued so far (including one in flight).
    pub turns_issued: u32,
    /// Tokens of the latest prompt (0 before the first turn, and in text form).
    pub prompt_tokens: usize,
    pub in_flight: bool,
}

/// How new sessions (conversations, or B/C requests) arrive.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Arrivals {
    /// `concurrency` sessions are open at all times: a finished one is replaced at once.
    ClosedLoop { concurrency: u32 },
    /// Sessions arrive at `rate_rps` per second, Poisson; finished ones are not replaced.
    Open { rate_rps: f64 },
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
struct Conversation<H> {
    script: Script,
    class: Class,
    /// Index of the next turn to issue (or of the turn in flight).
    next_turn: u32,
    phase: Phase,
    /// What the rendering keeps of the conversation so far.
    history: H,
}

/// The seed's multi-turn chat workload, sans-IO (quinn-proto style): the schedule, over
/// conversations whose turns are written out by `C` (token ids by default, for the simulator;
/// [`crate::TextContent`] for the load generator).
///
/// Drive it with the time: [`ChatWorkload::handle_timeout`] at [`ChatWorkload::poll_timeout`],
/// drain [`ChatWorkload::poll_request`] after every call, report each turn's end with
/// [`ChatWorkload::on_turn_finished`] or [`ChatWorkload::on_turn_failed`].
///
/// Bounds: the conversation table holds at most the largest concurrency set (≤
/// [`crate::MAX_CONCURRENCY`]), or `max_open` sessions in the open loop; the timer heap and ready queue hold at most one live entry per
/// conversation plus entries of conversations removed by a shrink, which are dropped as they
/// come up. Per turn the work is the script's draws and the content's rendering.
#[derive(Debug)]
pub struct ChatWorkload<C: Content = TokenContent> {
    config: WorkloadConfig,
    content: C,
    seed: u64,
    /// The closed loop's target (kept while the loop is open, for a switch back).
    concurrency: u32,
    /// `Some`: the open loop at this rate.
    rate: Option<f64>,
    /// The open loop's next arrival.
    next_arrival: Option<Nanos>,
    /// Draws the open loop's gaps: its own stream, so arrivals do not move sessions' scripts.
    arrival_rng: ChaCha8Rng,
    conversations: BTreeMap<u64, Conversation<C::History>>,
    next_id: u64,
    timers: BinaryHeap<Reverse<(Nanos, u64, u64)>>,
    timer_seq: u64,
    ready: VecDeque<u64>,
    now: Nanos,
    stats: WorkloadStats,
}

impl ChatWorkload {
    /// The workload in token ids (the simulator's form): `config.concurrency` conversations
    /// whose starts spread over `config.ramp_s` from `now`.
    pub fn new(
        config: WorkloadConfig,
        assets: Arc<Assets>,
        seed: u64,
        now: Nanos,
    ) -> Result<Self, WorkloadError> {
        ChatWorkload::with_content(config, assets, seed, now)
    }

    /// A conversation as text messages (system, user, assistant, …), decoded from its token
    /// history on demand; a reply in flight shows as its planned text.
    pub fn messages(&self, id: u64) -> Option<Vec<ChatMessage>> {
        let c = self.conversations.get(&id)?;
        let assets = self.content.assets();
        let tokenizer = assets.tokenizer();
        let Some(history) = c.history.prompt() else {
            return Some(Vec::new());
        };
        let mut messages = assets.format().parse(tokenizer, history);
        // The history ends with the open assistant header; its content is the planned reply.
        if let (Some(last), Some(reply)) = (messages.last_mut(), c.history.reply()) {
            if last.role == "assistant" && last.content.is_empty() {
                last.content = tokenizer.decode_lossy(reply);
            }
        }
        Some(messages)
    }
}

impl<C: Content> ChatWorkload<C> {
    /// A workload of `config.concurrency` conversations whose starts spread over
    /// `config.ramp_s` from `now`, written out by `C`
    /// (`ChatWorkload::<TextContent>::with_content(…)` for text).
    pub fn with_content(
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
        if config.summary_tokens.bounds().1 > max_reply as f64 {
            return Err(WorkloadError::InvalidConfig(format!(
                "summary_tokens: at most {max_reply} tokens per reply"
            )));
        }
        crate::families::validate(&config, Some(&assets))?;
        if !config.mix.is_chat_only() {
            // B's and C's corpora, built once (and checked) before any turn needs them.
            assets.tasks()?;
        }
        let content = C::new(assets, &config);
        let target = config.concurrency;
        let rate = config.rate_rps;
        let mut arrival_rng = ChaCha8Rng::seed_from_u64(seed);
        arrival_rng.set_stream(u64::MAX);
        let mut me = ChatWorkload {
            config,
            content,
            seed,
            concurrency: target,
            rate,
            next_arrival: None,
            arrival_rng,
            conversations: BTreeMap::new(),
            next_id: 0,
            timers: BinaryHeap::new(),
            timer_seq: 0,
            ready: VecDeque::new(),
            now,
            stats: WorkloadStats::default(),
        };
        if let Some(rate) = rate {
            me.next_arrival = Some(now + me.gap(rate));
            return Ok(me);
        }
        let ramp = Nanos::from_secs_f64(me.config.ramp_s);
        for i in 0..u64::from(target) {
            // Evenly spaced: conversation i starts at ramp × i / n.
            let offset = (u128::from(ramp.as_nanos()) * u128::from(i) / u128::from(target)) as u64;
            me.open_conversation(now + Nanos(offset));
        }
        Ok(me)
    }

    /// An exponential gap between arrivals at `rate` per second (at least 1 ns).
    fn gap(&mut self, rate: f64) -> Nanos {
        let u: f64 = self.arrival_rng.random();
        Nanos::from_secs_f64(-(1.0 - u).ln() / rate).max(Nanos(1))
    }

    /// Opens session `next_id` at `start`; false if its script could not be built.
    fn open_conversation(&mut self, start: Nanos) -> bool {
        let id = self.next_id;
        self.next_id += 1;
        let class = self.config.mix.class_of(self.seed, id);
        let script =
            match Script::for_class(class, self.seed, id, &self.config, self.content.assets()) {
                Ok(script) => script,
                Err(_) => {
                    // Unreachable: the corpora were built by `with_content` or `set_mix`.
                    self.stats.issue_errors += 1;
                    return false;
                }
            };
        self.stats.sessions_by_class[class as usize] += 1;
        let mut conversation = Conversation {
            class,
            history: self.content.open(script.system()),
            script,
            next_turn: 0,
            phase: Phase::Ready { since: start },
        };
        if start <= self.now {
            self.ready.push_back(id);
        } else {
            conversation.phase = Phase::Waiting { until: start };
            self.push_timer(start, id);
        }
        self.conversations.insert(id, conversation);
        self.stats.conversations_started += 1;
        true
    }

    fn push_timer(&mut self, at: Nanos, id: u64) {
        self.timers.push(Reverse((at, self.timer_seq, id)));
        self.timer_seq += 1;
    }

    /// Opens conversations until as many are open as the closed loop asks for (nothing in the
    /// open loop).
    fn refill(&mut self) {
        if self.rate.is_some() {
            return;
        }
        while (self.conversations.len() as u64) < u64::from(self.concurrency) {
            if !self.open_conversation(self.now) {
                break;
            }
        }
    }

    /// Sets the number of open conversations. Growth starts new conversations at `now`;
    /// shrinking first closes conversations that have not sent their first turn yet (newest
    /// first), then lets the rest end naturally without replacing them.
    ///
    /// In the open loop this only sets the target for a later switch back to the closed loop
    /// ([`ChatWorkload::set_rate`] with `None`).
    pub fn set_concurrency(&mut self, n: u32, now: Nanos) {
        self.advance(now);
        let target = n.min(crate::MAX_CONCURRENCY);
        self.concurrency = target;
        if self.rate.is_some() {
            return;
        }
        let excess = self.conversations.len().saturating_sub(target as usize);
        if excess > 0 {
            let unstarted: Vec<u64> = self
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

    /// Switches to the open loop at `rate` sessions per second (`Some`), or back to the
    /// closed loop at the last concurrency set (`None`; open sessions are kept and topped up
    /// to it). A new rate takes effect from `now`: the next arrival is drawn afresh.
    pub fn set_rate(&mut self, rate: Option<f64>, now: Nanos) -> Result<(), WorkloadError> {
        if let Some(r) = rate {
            if !(r.is_finite() && r > 0.0 && r <= MAX_RATE) {
                return Err(WorkloadError::InvalidConfig(format!(
                    "rate_rps must be a number of sessions per second in (0, {MAX_RATE}], got {r}"
                )));
            }
        }
        self.advance(now);
        self.rate = rate;
        self.config.rate_rps = rate;
        match rate {
            Some(r) => {
                self.next_arrival = Some(self.now + self.gap(r));
            }
            None => {
                self.next_arrival = None;
                self.refill();
            }
        }
        Ok(())
    }

    /// Sets the mix that sessions opened from now on draw their class from (open sessions
    /// keep theirs).
    pub fn set_mix(&mut self, mix: Mix) -> Result<(), WorkloadError> {
        mix.validate()
            .map_err(|e| WorkloadError::InvalidConfig(format!("mix: {e}")))?;
        if !mix.is_chat_only() {
            self.content.assets().tasks()?;
        }
        self.config.mix = mix;
        Ok(())
    }

    /// The class of session `id`: [`Mix::class_of`] under the current mix, so exact for every
    /// session when the mix has not changed since the workload started (the simulator's
    /// runs); an open session's own class is in [`ChatWorkload::conversation`].
    pub fn class_of(&self, id: u64) -> Class {
        match self.conversations.get(&id) {
            Some(c) => c.class,
            None => self.config.mix.class_of(self.seed, id),
        }
    }

    /// The workload's seed.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The mix new sessions draw from.
    pub fn mix(&self) -> Mix {
        self.config.mix
    }

    /// The open loop's rate, `None` in the closed loop.
    pub fn rate(&self) -> Option<f64> {
        self.rate
    }

    /// The closed loop's target number of open sessions.
    pub fn concurrency(&self) -> u32 {
        self.concurrency
    }

    /// How sessions arrive.
    pub fn arrivals(&self) -> Arrivals {
        match self.rate {
            Some(rate_rps) => Arrivals::Open { rate_rps },
            None => Arrivals::ClosedLoop {
                concurrency: self.concurrency,
            },
        }
    }

    /// When [`ChatWorkload::handle_timeout`] is next needed: the earliest end of a think time
    /// or ramp slot, or the open loop's next arrival. `None` when every conversation waits on
    /// a turn in flight.
    pub fn poll_timeout(&self) -> Option<Nanos> {
        let timer = self.timers.peek().map(|Reverse((at, _, _))| *at);
        match (timer, self.next_arrival) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Moves conversations whose wait ended by `now` to the ready queue, and opens the
    /// sessions that arrived by `now` (in time order, a wait's end first on a tie).
    pub fn handle_timeout(&mut self, now: Nanos) {
        self.advance(now);
        loop {
            let timer = self
                .timers
                .peek()
                .map(|Reverse((at, _, _))| *at)
                .filter(|at| *at <= self.now);
            let arrival = self.next_arrival.filter(|at| *at <= self.now);
            match (timer, arrival) {
                (None, None) => break,
                (None, Some(_)) => {
                    self.arrive();
                    continue;
                }
                (Some(t), Some(a)) if a < t => {
                    self.arrive();
                    continue;
                }
                _ => {}
            }
            let Some(Reverse((at, _, id))) = self.timers.pop() else {
                break;
            };
            if let Some(c) = self.conversations.get_mut(&id) {
                if c.phase == (Phase::Waiting { until: at }) {
                    c.phase = Phase::Ready { since: at };
                    self.ready.push_back(id);
                }
            }
        }
    }

    /// The open loop's next arrival: a session opens then, unless `max_open` are open.
    fn arrive(&mut self) {
        let (Some(at), Some(rate)) = (self.next_arrival, self.rate) else {
            self.next_arrival = None;
            return;
        };
        if self.conversations.len() < self.config.max_open as usize {
            // Opened at its arrival instant (≤ now), so its first turn is issued as of then.
            self.open_conversation(at);
        } else {
            self.stats.arrivals_dropped += 1;
        }
        self.next_arrival = Some(at + self.gap(rate));
    }

    fn advance(&mut self, now: Nanos) {
        self.now = self.now.max(now);
    }

    /// The next turn to send, in a deterministic order (by the time it became ready, then by
    /// when it was queued).
    pub fn poll_request(&mut self) -> Option<C::Turn> {
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

    fn issue(&mut self, id: u64, issued_at: Nanos) -> Result<C::Turn, WorkloadError> {
        let c = self
            .conversations
            .get_mut(&id)
            .ok_or(WorkloadError::UnknownConversation(id))?;
        let turn = c.next_turn;
        let history_tokens = C::history_tokens(&c.history);
        let plan = c
            .script
            .next_turn(self.content.assets(), &self.config, turn, history_tokens)?;
        let output_tokens = plan.reply.ids.len();
        let key = TurnKey {
            conversation: id,
            turn,
        };
        let request = self.content.turn(&mut c.history, plan, key, issued_at);
        c.phase = Phase::InFlight { turn };
        self.stats.turns_issued += 1;
        self.stats.prompt_tokens_issued += C::prompt_tokens(&c.history) as u64;
        self.stats.output_tokens_issued += output_tokens as u64;
        Ok(request)
    }

    /// The turn's reply arrived in full at `now`: it becomes history; the user thinks, then
    /// asks the next question, or the conversation ends and a new one replaces it at once.
    /// Unknown or stale ids are ignored.
    pub fn on_turn_finished(&mut self, id: TurnKey, now: Nanos) {
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
    pub fn on_turn_failed(&mut self, id: TurnKey, now: Nanos) {
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
        self.content.assets()
    }

    /// The open conversations, by id.
    pub fn conversations(&self) -> impl Iterator<Item = ConversationInfo> + '_ {
        self.conversations
            .keys()
            .filter_map(|id| self.conversation(*id))
    }

    /// One open conversation, in O(log n) (drivers that keep their own per-conversation state
    /// look up a new conversation's passage and turn count here).
    pub fn conversation(&self, id: u64) -> Option<ConversationInfo> {
        let c = self.conversations.get(&id)?;
        Some(ConversationInfo {
            id,
            class: c.class,
            passage: c.script.passage(),
            turns: c.script.turns(),
            turns_issued: c.next_turn + u32::from(matches!(c.phase, Phase::InFlight { .. })),
            prompt_tokens: C::prompt_tokens(&c.history),
            in_flight: matches!(c.phase, Phase::InFlight { .. }),
        })
    }
}
