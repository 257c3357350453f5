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
