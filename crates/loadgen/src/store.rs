//! Conversations kept for the UI: the open ones, plus the most recent ended ones.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use serde::Serialize;

/// A conversation's state as the UI shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ConversationStatus {
    Active,
    Completed,
    /// A turn failed; the workload replaced the conversation.
    Error,
    /// The workload was stopped while it was open.
    Stopped,
}

/// A turn's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TurnState {
    Streaming,
    Done,
    Failed,
}

/// One turn: the question, the reply and what it measured.
#[derive(Clone, Debug, Serialize)]
pub struct TurnRecord {
    pub index: u32,
    pub user: Arc<str>,
    pub assistant: Arc<str>,
    pub ttft_ms: Option<f64>,
    pub itl_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
    pub tokens: u64,
    pub latency_s: Option<f64>,
    pub worker: Option<String>,
    pub error: Option<String>,
    pub state: TurnState,
}

impl TurnRecord {
    /// A turn just sent: its question, nothing measured yet.
    pub fn streaming(index: u32, user: Arc<str>) -> TurnRecord {
        TurnRecord {
            index,
            user,
            assistant: "".into(),
            ttft_ms: None,
            itl_ms: None,
            tpot_ms: None,
            tokens: 0,
            latency_s: None,
            worker: None,
            error: None,
            state: TurnState::Streaming,
        }
    }
}

/// One conversation and its transcript.
#[derive(Debug)]
pub struct ConversationRecord {
    pub number: u64,
    pub status: ConversationStatus,
    pub passage: usize,
    pub topic: Arc<str>,
    pub turns_planned: u32,
    pub turns: Vec<TurnRecord>,
    pub started_at_ms: u64,
    /// Lane clock (seconds) at the first request and at the end.
    pub started_s: f64,
    pub ended_s: Option<f64>,
}

impl ConversationRecord {
    pub fn turns_done(&self) -> u32 {
        self.turns
            .iter()
            .filter(|t| t.state == TurnState::Done)
            .count() as u32
    }

    /// First request to the last response, or to `now_s` while open.
    pub fn duration_s(&self, now_s: f64) -> f64 {
        (self.ended_s.unwrap_or(now_s) - self.started_s).max(0.0)
    }
}

/// Open conversations plus at most `kept` ended ones (the oldest ended are dropped first).
/// Open conversations are bounded by the workload's concurrency.
#[derive(Debug)]
pub struct Store {
    kept: usize,
    conversations: BTreeMap<u64, ConversationRecord>,
    ended: VecDeque<u64>,
    /// Conversations ever recorded (the UI shows "kept of total").
    total: u64,
}

impl Store {
    pub fn new(kept: usize) -> Store {
        Store {
            kept,
            conversations: BTreeMap::new(),
            ended: VecDeque::new(),
            total: 0,
        }
    }

    pub fn insert(&mut self, record: ConversationRecord) {
        // Numbers are never reused (they continue across restarts).
        self.total += 1;
        self.conversations.insert(record.number, record);
    }

    pub fn get(&self, number: u64) -> Option<&ConversationRecord> {
        self.conversations.get(&number)
    }

    pub fn get_mut(&mut self, number: u64) -> Option<&mut ConversationRecord> {
        self.conversations.get_mut(&number)
    }

    /// Marks an open conversation ended and drops the oldest ended ones over the bound.
    pub fn end(&mut self, number: u64, status: ConversationStatus, now_s: f64) {
        let Some(record) = self.conversations.get_mut(&number) else {
            return;
        };
        if record.status != ConversationStatus::Active {
            return;
        }
        record.status = status;
        record.ended_s = Some(now_s);
        self.ended.push_back(number);
        while self.ended.len() > self.kept {
            if let Some(old) = self.ended.pop_front() {
                if self
                    .conversations
                    .get(&old)
                    .is_some_and(|r| r.status != ConversationStatus::Active)
                {
                    self.conversations.remove(&old);
                }
            }
        }
    }

    /// Ends every open conversation (the workload stopped); their streaming turns fail.
    pub fn stop_all(&mut self, now_s: f64) {
        let open: Vec<u64> = self
            .conversations
            .iter()
            .filter(|(_, r)| r.status == ConversationStatus::Active)
            .map(|(n, _)| *n)
            .collect();
        for number in open {
            if let Some(record) = self.conversations.get_mut(&number) {
                for turn in &mut record.turns {
                    if turn.state == TurnState::Streaming {
                        turn.state = TurnState::Failed;
                        turn.error = Some("the workload was stopped".to_owned());
                    }
                }
            }
            self.end(number, ConversationStatus::Stopped, now_s);
        }
    }

    /// Newest first.
    pub fn newest(&self, limit: usize) -> impl Iterator<Item = &ConversationRecord> {
        self.conversations.values().rev().take(limit)
    }

    pub fn len(&self) -> usize {
        self.conversations.len()
    }

    pub fn is_empty(&self) -> bool {
        self.conversations.is_empty()
    }

    pub fn total(&self) -> u64 {
        self.total
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(number: u64) -> ConversationRecord {
        ConversationRecord {
            number,
            status: ConversationStatus::Active,
            passage: 0,
            topic: "t".into(),
            turns_planned: 3,
            turns: Vec::new(),
            started_at_ms: 0,
            started_s: 0.0,
            ended_s: None,
        }
    }

    #[test]
    fn ended_conversations_are_bounded_and_open_ones_stay() {
        let mut store = Store::new(2);
        for n in 0..5 {
            store.insert(record(n));
        }
        store.end(0, ConversationStatus::Completed, 1.0);
        store.end(1, ConversationStatus::Error, 2.0);
        store.end(2, ConversationStatus::Completed, 3.0);
        // 0 was the oldest ended: dropped. 3 and 4 are open.
        let numbers: Vec<u64> = store.newest(10).map(|r| r.number).collect();
        assert_eq!(numbers, vec![4, 3, 2, 1]);
        assert_eq!(store.total(), 5);
        assert_eq!(store.get(1).unwrap().status, ConversationStatus::Error);
        assert_eq!(store.get(1).unwrap().duration_s(100.0), 2.0);
        assert_eq!(store.get(4).unwrap().duration_s(100.0), 100.0);
    }

    #[test]
    fn stopping_fails_streaming_turns() {
        let mut store = Store::new(10);
        let mut r = record(7);
        r.turns.push(TurnRecord::streaming(0, "q".into()));
        store.insert(r);
        store.stop_all(5.0);
        let r = store.get(7).unwrap();
        assert_eq!(r.status, ConversationStatus::Stopped);
        assert_eq!(r.turns[0].state, TurnState::Failed);
        assert_eq!(r.turns_done(), 0);
    }
}
