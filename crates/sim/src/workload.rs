//! What the simulator needs from a workload: turns to issue, and to hear how they ended.
//!
//! The seed's chat workload (`workload::ChatWorkload`) implements it (see [`crate::chat`]);
//! tests and other traffic shapes implement it directly. A workload is sans-IO like every
//! core: it says when it next needs the clock ([`Workload::poll_timeout`]), and turns are
//! drained with [`Workload::poll_request`] after every call into it.

use std::sync::Arc;

use nanotime::Nanos;

/// Identifies a turn: its conversation and its index in that conversation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TurnKey {
    pub conversation: u64,
    pub turn: u32,
}

/// One request the workload wants served.
#[derive(Debug, Clone)]
pub struct Turn {
    pub key: TurnKey,
    /// Prompt token ids (chat template applied, whole history resent).
    pub prompt: Arc<[u32]>,
    /// The answer's token ids: the engine generates exactly these, so the next turn's prompt
    /// (which contains them) hits the blocks cached during decode.
    pub output: Arc<[u32]>,
    /// When the client issued it (the start of its TTFT and E2E).
    pub issued_at: Nanos,
}

/// A traffic source driven by the simulator.
pub trait Workload {
    /// When the workload next needs [`handle_timeout`](Workload::handle_timeout) (a think
    /// time ending), `None` when it waits only on turns in flight.
    fn poll_timeout(&self) -> Option<Nanos>;
    fn handle_timeout(&mut self, now: Nanos);
    /// The next turn to issue, if any.
    fn poll_request(&mut self) -> Option<Turn>;
    /// The turn's last token arrived at `now`.
    fn on_turn_finished(&mut self, key: TurnKey, now: Nanos);
    /// The turn failed (rejected by an engine, dropped by a full frontend queue).
    fn on_turn_failed(&mut self, key: TurnKey, now: Nanos);
    /// Sets the number of concurrent conversations (the seed's slider).
    fn set_concurrency(&mut self, n: u32, now: Nanos);
    /// Conversations currently open.
    fn active_conversations(&self) -> u32;
}

/// A workload seen through the serving path: every turn reaches the router `latency` after
/// the client issued it, while its `issued_at` stays the client's instant.
///
/// `latency` is the whole round trip outside the GPUs (client ↔ load balancer ↔ frontend ↔
/// worker: network, HTTP, the frontend's tokenization, detokenization and streaming). Charging
/// the round trip on the way in is exact for every client-side metric: TTFT and E2E include it
/// once, ITL does not, and the next turn of a conversation starts it later by the same amount.
/// A constant latency keeps arrival order, so the queue is FIFO; it holds at most one turn per
/// open conversation.
#[derive(Debug)]
pub struct ServingPath<W> {
    inner: W,
    latency: Nanos,
    now: Nanos,
    in_transit: std::collections::VecDeque<Turn>,
}

impl<W: Workload> ServingPath<W> {
    pub fn new(inner: W, latency: Nanos) -> Self {
        Self {
            inner,
            latency,
            now: Nanos::ZERO,
            in_transit: std::collections::VecDeque::new(),
        }
    }

    /// The workload behind the path.
    pub fn inner(&self) -> &W {
        &self.inner
    }

    fn advance(&mut self, now: Nanos) {
        self.now = self.now.max(now);
    }

    /// Moves every turn the workload has issued onto the path.
    fn collect(&mut self) {
        while let Some(turn) = self.inner.poll_request() {
            self.in_transit.push_back(turn);
        }
    }

    fn arrival(&self, turn: &Turn) -> Nanos {
        turn.issued_at + self.latency
    }
}

impl<W: Workload> Workload for ServingPath<W> {
    fn poll_timeout(&self) -> Option<Nanos> {
        let arrival = self.in_transit.front().map(|t| self.arrival(t));
        match (self.inner.poll_timeout(), arrival) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    fn handle_timeout(&mut self, now: Nanos) {
        self.advance(now);
        self.inner.handle_timeout(now);
    }

    fn poll_request(&mut self) -> Option<Turn> {
        self.collect();
        let due = self.in_transit.front().is_some_and(|t| self.arrival(t) <= self.now);
        if due { self.in_transit.pop_front() } else { None }
    }

    fn on_turn_finished(&mut self, key: TurnKey, now: Nanos) {
        self.advance(now);
        self.inner.on_turn_finished(key, now);
    }

    fn on_turn_failed(&mut self, key: TurnKey, now: Nanos) {
        self.advance(now);
        self.inner.on_turn_failed(key, now);
    }

    fn set_concurrency(&mut self, n: u32, now: Nanos) {
        self.advance(now);
        self.inner.set_concurrency(n, now);
    }

    fn active_conversations(&self) -> u32 {
        self.inner.active_conversations()
    }
}
