//! A tiny virtual-time driver for the engine tests.
#![allow(dead_code)]

use std::collections::BTreeSet;
use std::sync::Arc;

use engine::{Engine, EngineConfig, EngineEvent, EngineRequest, Leg, OutputSpec, RequestId};
use kv_index::{KvEventKind, LocalBlockHash, SequenceHash, WorkerId};
use nanotime::Nanos;

#[derive(Debug, Clone)]
pub enum Action {
    Submit(EngineRequest),
    /// `Engine::submit_hashed` with these local and sequence hashes of the prompt.
    SubmitHashed(EngineRequest, Vec<LocalBlockHash>, Vec<SequenceHash>),
    Cancel(RequestId),
}

/// Events with the driver time at which they were drained.
#[derive(Debug, Default)]
pub struct Run {
    pub events: Vec<EngineEvent>,
}

impl Run {
    pub fn finished(&self) -> Vec<(RequestId, Nanos, u32, u32)> {
        let mut v: Vec<_> = self
            .events
            .iter()
            .filter_map(|e| match e {
                EngineEvent::Finished {
                    id,
                    at,
                    output_tokens,
                    cached_prompt_tokens,
                    ..
                } => Some((*id, *at, *output_tokens, *cached_prompt_tokens)),
                _ => None,
            })
            .collect();
        v.sort();
        v
    }

    pub fn first_token(&self, want: RequestId) -> Option<Nanos> {
        self.events.iter().find_map(|e| match e {
            EngineEvent::FirstToken { id, at } if *id == want => Some(*at),
            _ => None,
        })
    }

    /// Output indices produced per request, checking they are contiguous from `first`.
    pub fn token_counts(&self) -> Vec<(RequestId, u32)> {
        let mut next: std::collections::BTreeMap<RequestId, u32> = Default::default();
        for e in &self.events {
            if let EngineEvent::Tokens { id, start, end, .. } = e {
                let n = next.entry(*id).or_insert(*start);
                assert_eq!(*n, *start, "tokens of {id:?} not contiguous");
                assert!(end > start);
                *n = *end;
            }
        }
        next.into_iter().collect()
    }

    pub fn stored(&self) -> BTreeSet<u64> {
        let mut s = BTreeSet::new();
        for e in &self.events {
            if let EngineEvent::Kv(kv) = e {
                if let KvEventKind::Stored { blocks, .. } = &kv.kind {
                    s.extend(blocks.iter().map(|b| b.id.0));
                }
            }
        }
        s
    }

    pub fn removed(&self) -> BTreeSet<u64> {
        let mut s = BTreeSet::new();
        for e in &self.events {
            if let EngineEvent::Kv(kv) = e {
                if let KvEventKind::Removed { blocks } = &kv.kind {
                    s.extend(blocks.iter().map(|b| b.0));
                }
            }
        }
        s
    }

    pub fn kv_seqs_are_dense(&self) -> bool {
        let seqs: Vec<u64> = self
            .events
            .iter()
            .filter_map(|e| match e {
                EngineEvent::Kv(kv) => Some(kv.seq),
                _ => None,
            })
            .collect();
        seqs.iter().enumerate().all(|(i, &s)| s == i as u64)
    }
}

/// Runs `actions` (sorted by time) to completion. Step ends at the same time as an action are
/// handled first, as a discrete-event simulator popping the earliest timeout does.
pub fn run(engine: &mut Engine, mut actions: Vec<(Nanos, Action)>, check: bool) -> Run {
    actions.sort_by_key(|(t, _)| *t);
    let mut out = Run::default();
    let mut i = 0;
    loop {
        let next_action = actions.get(i).map(|(t, _)| *t);
        let timeout = engine.poll_timeout();
        match (timeout, next_action) {
            (Some(t), a) if a.is_none_or(|a| t <= a) => engine.handle_timeout(t),
            (_, Some(t)) => {
                match actions[i].1.clone() {
                    Action::Submit(r) => engine.submit(r, t),
                    Action::SubmitHashed(r, local, seq) => engine.submit_hashed(r, local, seq, t),
                    Action::Cancel(id) => engine.cancel(id, t),
                }
                i += 1;
            }
            (None, None) => break,
            (Some(_), None) => unreachable!(),
        }
        if check {
            engine.check_invariants();
        }
        while let Some(e) = engine.poll_event() {
            out.events.push(e);
        }
    }
    out
}

pub fn req(id: u64, prompt: impl IntoIterator<Item = u32>, out: u32) -> EngineRequest {
    EngineRequest {
        id: RequestId(id),
        prompt: prompt.into_iter().collect::<Vec<_>>().into(),
        output: OutputSpec::Count(out),
        leg: Leg::ByRole,
    }
}

pub fn req_tokens(id: u64, prompt: &[u32], output: &[u32]) -> EngineRequest {
    EngineRequest {
        id: RequestId(id),
        prompt: Arc::from(prompt),
        output: OutputSpec::Tokens(Arc::from(output)),
        leg: Leg::ByRole,
    }
}

pub fn engine(cfg: EngineConfig) -> Engine {
    Engine::new(cfg, WorkerId(7)).expect("valid config")
}

/// Requests 0..`n`, all submitted at time zero, each with its own prompt of `prompt_len`
/// tokens and `out` output tokens.
pub fn burst(n: u64, prompt_len: u32, out: u32) -> Vec<(Nanos, Action)> {
    (0..n)
        .map(|i| {
            (
                Nanos::ZERO,
                Action::Submit(req(i, text(i as u32, prompt_len), out)),
            )
        })
        .collect()
}

/// Prompt tokens unique to `tag`.
pub fn text(tag: u32, len: u32) -> Vec<u32> {
    (0..len).map(|i| tag * 1_000_003 + i).collect()
}
