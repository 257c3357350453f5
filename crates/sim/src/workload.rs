//! What the simulator needs from a workload: turns to issue, and to hear how they ended.
//!
//! The seed's chat workload (`workload::ChatWorkload`) implements it (see [`crate::chat`]);
//! tests and other traffic shapes implement it directly. A workload is sans-IO like every
//! core: it says when it next needs the clock ([`Workload::poll_timeout`]), and turns are
//! drained with [`Workload::poll_request`] after every call into it.

use nanotime::Nanos;

/// A turn's key and a turn in token ids are the workload crate's own types.
pub use workload::{Turn, TurnKey};

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

    /// The workload behind the path, to change it mid-run (a new mix or rate).
    pub fn inner_mut(&mut self) -> &mut W {
        &mut self.inner
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
        let due = self
            .in_transit
            .front()
            .is_some_and(|t| self.arrival(t) <= self.now);
        if due {
            self.in_transit.pop_front()
        } else {
            None
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// Issues one turn of conversation `k` whenever told to, at the instant it is told.
    #[derive(Default)]
    struct Script {
        now: Nanos,
        ready: Vec<TurnKey>,
    }

    impl Workload for Script {
        fn poll_timeout(&self) -> Option<Nanos> {
            None
        }
        fn handle_timeout(&mut self, now: Nanos) {
            self.now = now;
        }
        fn poll_request(&mut self) -> Option<Turn> {
            let key = self.ready.pop()?;
            Some(Turn {
                key,
                prompt: Arc::from(vec![1u32; 4]),
                output: Arc::from(vec![2u32; 2]),
                issued_at: self.now,
            })
        }
        fn on_turn_finished(&mut self, key: TurnKey, now: Nanos) {
            self.now = now;
            self.ready.push(TurnKey {
                conversation: key.conversation,
                turn: key.turn + 1,
            });
        }
        fn on_turn_failed(&mut self, _: TurnKey, now: Nanos) {
            self.now = now;
        }
        fn set_concurrency(&mut self, _: u32, now: Nanos) {
            self.now = now;
        }
        fn active_conversations(&self) -> u32 {
            1
        }
    }

    #[test]
    fn turns_reach_the_router_one_round_trip_after_the_client_sent_them() {
        let latency = Nanos::from_millis(200);
        let mut path = ServingPath::new(Script::default(), latency);
        let first = TurnKey {
            conversation: 7,
            turn: 0,
        };
        // The previous turn ends at 10 s: the client sends the next one at once.
        path.on_turn_finished(first, Nanos::from_secs(10));
        assert!(path.poll_request().is_none(), "still on the wire");
        assert_eq!(
            path.poll_timeout(),
            Some(Nanos::from_secs(10) + latency),
            "the driver is woken when it arrives"
        );
        path.handle_timeout(Nanos::from_secs(10) + latency);
        let turn = path.poll_request().expect("arrived");
        assert_eq!(turn.key.turn, 1);
        // The client's clock: TTFT and E2E measured from here include the round trip.
        assert_eq!(turn.issued_at, Nanos::from_secs(10));
        assert!(path.poll_request().is_none());
        assert_eq!(path.poll_timeout(), None);
    }

    #[test]
    fn zero_latency_is_transparent() {
        let mut path = ServingPath::new(Script::default(), Nanos::ZERO);
        path.on_turn_finished(
            TurnKey {
                conversation: 1,
                turn: 0,
            },
            Nanos::from_secs(3),
        );
        let turn = path.poll_request().expect("no delay");
        assert_eq!(turn.issued_at, Nanos::from_secs(3));
    }
}
