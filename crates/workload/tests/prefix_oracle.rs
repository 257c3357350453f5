//! `PrefixOracle`: the trace's prefix-hit bound over the requests of a replay that finished so
//! far. It is the whole-trace bound once every request finished, whatever the order; and at
//! every step of any replay it is at least what a cache that started empty served the finished
//! requests (checked against a token-level cache of 32-token engine blocks).

// A test is a driver: it reads the shipped files the core is given (clippy.toml).
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

use std::collections::HashSet;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::path::PathBuf;

use proptest::prelude::*;
use workload::{PrefixOracle, PromptSynth, Trace, TraceRecord};

fn shipped() -> Trace {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../traces/mooncake_conversation_trace.jsonl");
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    Trace::parse_bytes(&bytes).unwrap()
}

fn trace(records: &[(u64, &[u64])]) -> Trace {
    let text: Vec<String> = records
        .iter()
        .enumerate()
        .map(|(ts, (input, ids))| {
            format!(
                "{{\"timestamp\": {ts}, \"input_length\": {input}, \"output_length\": 1, \
                 \"hash_ids\": {ids:?}}}"
            )
        })
        .collect();
    Trace::parse(&text.join("\n")).unwrap()
}

#[test]
fn every_request_finished_in_any_order_gives_the_whole_trace_bound() {
    let whole = shipped();
    let slice = whole.first(400).unwrap();
    let records = slice.records();
    let mut reversed = PrefixOracle::default();
    for r in records {
        reversed.sent(r);
    }
    // Requests finish out of order (the short ones first); the bound only reaches the
    // whole slice's once the last one is in.
    for r in records.iter().rev() {
        assert_eq!(
            reversed.hit_rate().is_some(),
            reversed.finished_requests() > 0
        );
        reversed.finished(r);
    }
    assert_eq!(reversed.hit_tokens(), slice.oracle_prefix_hit_tokens());
    assert_eq!(reversed.finished_input_tokens(), slice.total_input_tokens());
    assert_eq!(reversed.finished_requests(), 400);
    assert_eq!(reversed.hit_rate(), Some(slice.oracle_prefix_hit_rate()));
    // The slice's bound is the file-order count of a trie over it (as the shipped trace's
    // 54,098,411 tokens are, in tests/trace.rs), computed here the plain way.
    let mut seen = HashSet::new();
    let file_order: u64 = records
        .iter()
        .map(|r| {
            let mut matched = 0;
            for depth in 1..=r.hash_ids().len() {
                if !seen.insert(r.hash_ids()[..depth].to_vec()) {
                    matched = depth;
                }
            }
            (matched as u64 * 512).min(u64::from(r.input_length()))
        })
        .sum();
    assert_eq!(slice.oracle_prefix_hit_tokens(), file_order);
}

#[test]
fn a_block_counts_for_a_finished_request_unless_a_finished_visitor_computed_it() {
    // Three requests share block 1.
    let t = trace(&[(600, &[1, 2]), (700, &[1, 3]), (512, &[1])]);
    let [a, b, c] = [0, 1, 2].map(|i| &t.records()[i]);
    let mut oracle = PrefixOracle::default();
    assert_eq!(oracle.hit_rate(), None);
    oracle.sent(a);
    oracle.finished(a);
    // A slice's first request: nothing anyone could have cached.
    assert_eq!((oracle.hit_tokens(), oracle.hit_rate()), (0, Some(0.0)));
    // B and C are sent after A finished, and C finishes: A computed block 1 and C could
    // have been served it, whatever B does.
    oracle.sent(b);
    oracle.sent(c);
    oracle.finished(c);
    assert_eq!(oracle.hit_tokens(), 512);
    assert_eq!(oracle.finished_input_tokens(), 600 + 512);
    oracle.finished(b);
    assert_eq!(oracle.hit_tokens(), 512 + 512);

    // B and C sent together, C finished first: B, still in flight, may have reached the
    // server first and computed block 1 for C.
    let mut oracle = PrefixOracle::default();
    oracle.sent(b);
    oracle.sent(c);
    oracle.finished(c);
    assert_eq!(oracle.hit_tokens(), 512);
    // B finished too: one of the two computed it.
    oracle.finished(b);
    assert_eq!(oracle.hit_tokens(), 512);
    assert_eq!(oracle.hit_rate(), Some(512.0 / 1212.0));

    // B sent with C and failed: it stays sent, so C's visit stays a possible hit; A, sent
    // after C finished, changes nothing for C.
    let mut oracle = PrefixOracle::default();
    oracle.sent(b);
    oracle.sent(c);
    oracle.finished(c);
    oracle.sent(a);
    assert_eq!(oracle.hit_tokens(), 512);
    oracle.finished(a);
    assert_eq!(oracle.hit_tokens(), 512 + 512);
    assert_eq!(oracle.finished_requests(), 2);
}

#[test]
fn a_partial_block_serves_only_the_tokens_it_has() {
    // Block 2 is 88 tokens of A's prompt and all 512 of B's: whichever came first, the other
    // was served at most 88 of them.
    let t = trace(&[(600, &[1, 2]), (1024, &[1, 2])]);
    let mut oracle = PrefixOracle::default();
    for r in t.records() {
        oracle.sent(r);
    }
    for r in t.records() {
        oracle.finished(r);
    }
    assert_eq!(oracle.hit_tokens(), 512 + 88);
    assert_eq!(t.oracle_prefix_hit_tokens(), 512 + 88);
}

#[test]
fn reporting_a_request_never_sent_or_twice_leaves_the_bound_as_it_was() {
    let t = trace(&[(1024, &[1, 2]), (1024, &[1, 2])]);
    let mut oracle = PrefixOracle::default();
    oracle.sent(&t.records()[0]);
    oracle.finished(&t.records()[0]);
    oracle.finished(&t.records()[0]);
    oracle.finished(&t.records()[1]);
    assert_eq!((oracle.finished_requests(), oracle.hit_tokens()), (1, 0));
}

/// What a server with an infinite cache of 32-token blocks, empty at the start, serves.
#[derive(Default)]
struct EngineCache {
    blocks: HashSet<u64>,
}

impl EngineCache {
    const BLOCK: usize = 32;

    /// Prefills `prompt`: the cached tokens it was served, then its full blocks are cached.
    fn prefill(&mut self, prompt: &[u32]) -> u64 {
        let mut parent = 0u64;
        let mut served = 0;
        let mut missed = false;
        for block in prompt.chunks_exact(Self::BLOCK) {
            let mut h = DefaultHasher::new();
            (parent, block).hash(&mut h);
            parent = h.finish();
            if !missed && self.blocks.contains(&parent) {
                served += Self::BLOCK as u64;
            } else {
                missed = true;
            }
            self.blocks.insert(parent);
        }
        served
    }
}

/// A small trace: ids from a small alphabet so prefixes are shared, some last blocks partial,
/// some records with fewer ids than blocks.
fn small_trace() -> impl Strategy<Value = Trace> {
    let record = (1usize..=4, 0u64..512, 0usize..=1).prop_flat_map(|(blocks, short, fewer)| {
        let input = (blocks as u64 * 512 - short).max(1);
        let ids = blocks.saturating_sub(fewer);
        (Just(input), prop::collection::vec(0u64..3, ids))
    });
    prop::collection::vec(record, 1..10).prop_map(|records| {
        let refs: Vec<(u64, &[u64])> = records.iter().map(|(i, ids)| (*i, &ids[..])).collect();
        trace(&refs)
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Each request is sent, prefilled and ends (finished, or failed after its prefill or
    /// before it) in any interleaving with the others'; after every step, what the engine
    /// served the finished requests is within the bound, and once every request finished the
    /// bound is the whole trace's.
    #[test]
    fn no_replay_order_beats_the_bound(
        trace in small_trace(),
        order in prop::collection::vec(any::<u32>(), 30),
        fails in prop::collection::vec(0u8..6, 10),
    ) {
        let synth = PromptSynth::default();
        let records: &[TraceRecord] = trace.records();
        // Events (key, request, step): step 0 sent, 1 prefilled, 2 ended; sorting by key and
        // then step keeps each request's own steps in order.
        let mut events: Vec<(u32, usize, u8)> = Vec::new();
        for (i, _) in records.iter().enumerate() {
            let mut keys = [order[3 * i], order[3 * i + 1], order[3 * i + 2]];
            keys.sort_unstable();
            for (step, key) in keys.into_iter().enumerate() {
                events.push((key, i, step as u8));
            }
        }
        events.sort_unstable_by_key(|&(key, i, step)| (key, step, i));
        // 0: failed before its prefill, 1: failed after it, else finished.
        let fate = |i: usize| fails[i];
        let mut engine = EngineCache::default();
        let mut oracle = PrefixOracle::default();
        let mut served = vec![0u64; records.len()];
        let mut served_finished = 0u64;
        for (_, i, step) in events {
            let r = &records[i];
            match step {
                0 => oracle.sent(r),
                1 if fate(i) != 0 => served[i] = engine.prefill(&synth.prompt_tokens(r)),
                2 if fate(i) >= 2 => {
                    oracle.finished(r);
                    served_finished += served[i];
                }
                _ => {}
            }
            prop_assert!(
                served_finished <= oracle.hit_tokens(),
                "served {} over a bound of {}", served_finished, oracle.hit_tokens()
            );
        }
        if (0..records.len()).all(|i| fate(i) >= 2) {
            prop_assert_eq!(oracle.hit_tokens(), trace.oracle_prefix_hit_tokens());
            prop_assert_eq!(oracle.finished_input_tokens(), trace.total_input_tokens());
        }
    }
}
