//! Trace replay: parsing Mooncake's FAST'25 format (the shipped conversation trace and bad
//! inputs), prompt synthesis, the oracle prefix-hit bound and the speed factor.

// A test is a driver: it reads the shipped files the core is given (clippy.toml).
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

use std::collections::HashSet;
use std::path::PathBuf;

use nanotime::Nanos;
use workload::trace::{LineError, MAX_TRACE_LINE_BYTES, MAX_TRACE_TOKENS};
use workload::{PromptSynth, SessionStep, Speed, TRACE_BLOCK_TOKENS, Trace, TraceError};

fn shipped_bytes() -> Vec<u8> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../traces/mooncake_conversation_trace.jsonl");
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The shipped trace, parsed once per test binary (it is 3 MB).
fn shipped() -> &'static Trace {
    static TRACE: std::sync::OnceLock<Trace> = std::sync::OnceLock::new();
    TRACE.get_or_init(|| Trace::parse_bytes(&shipped_bytes()).unwrap())
}

fn line(ts: u64, input: u64, output: u64, ids: &[u64]) -> String {
    format!(
        "{{\"timestamp\": {ts}, \"input_length\": {input}, \"output_length\": {output}, \
         \"hash_ids\": {ids:?}}}"
    )
}

/// Parses `text` expecting an error on `line`; returns what is wrong.
fn error_at(text: &str, line: usize) -> LineError {
    match Trace::parse(text) {
        Err(TraceError::Line { line: got, kind }) => {
            assert_eq!(got, line, "{text:?}: error {kind} on the wrong line");
            let shown = TraceError::Line {
                line,
                kind: kind.clone(),
            }
            .to_string();
            assert!(
                shown.starts_with(&format!("trace line {line}: ")),
                "{shown}"
            );
            kind
        }
        other => panic!("{text:?}: expected an error on line {line}, got {other:?}"),
    }
}

#[test]
fn the_shipped_conversation_trace_parses() {
    let trace = shipped();
    assert_eq!(trace.len(), 12_031);
    assert!(!trace.is_empty());
    assert_eq!(trace.session_count(), 0);
    let first = &trace.records()[0];
    assert_eq!(first.index(), 0);
    assert_eq!(first.line(), 1);
    assert_eq!(first.timestamp(), Nanos::ZERO);
    assert_eq!((first.input_length(), first.output_length()), (6758, 500));
    assert_eq!(first.hash_ids(), (0..14).collect::<Vec<u64>>());
    assert_eq!(first.session(), None);
    // One hour, averages as published (input 12,035 tokens, output 343).
    assert_eq!(trace.duration(), Nanos::from_millis(3_536_999));
    let n = trace.len() as u64;
    assert_eq!(trace.total_input_tokens() / n, 12_035);
    assert_eq!((trace.total_output_tokens() + n / 2) / n, 343);
    for (i, r) in trace.records().iter().enumerate() {
        assert_eq!((r.index(), r.line()), (i, i + 1));
        // Every record hashes all its blocks, the last one partial.
        assert_eq!(
            r.hash_ids().len(),
            (r.input_length() as usize).div_ceil(TRACE_BLOCK_TOKENS)
        );
    }
    // A pure function of the bytes.
    assert_eq!(
        *trace,
        Trace::parse(std::str::from_utf8(&shipped_bytes()).unwrap()).unwrap()
    );
}

#[test]
fn oracle_prefix_hit_bound_of_the_shipped_trace() {
    let trace = shipped();
    let rate = trace.oracle_prefix_hit_rate();
    println!(
        "oracle prefix-hit bound: {:.4}% ({} of {} input tokens)",
        rate * 100.0,
        trace.oracle_prefix_hit_tokens(),
        trace.total_input_tokens()
    );
    assert!((0.30..0.45).contains(&rate), "{rate}");
    // The exact figure, checked independently (a Python trie over the same file).
    assert_eq!(trace.total_input_tokens(), 144_793_823);
    assert_eq!(trace.oracle_prefix_hit_tokens(), 54_098_411);
}

#[test]
fn oracle_counts_only_prefix_chains_seen_earlier() {
    let text = [
        line(0, 1500, 1, &[1, 2, 3]),
        // Same first block, then new: one block.
        line(1, 1500, 1, &[1, 4, 5]),
        // Id 2 at position 0 is not the chain [1, 2]: nothing.
        line(2, 1024, 1, &[2, 3]),
        // The whole chain [1, 2, 3], capped at its 1,100-token input.
        line(3, 1100, 1, &[1, 2, 3]),
        // A later request's own chain does not count for itself.
        line(4, 600, 1, &[9, 9]),
    ]
    .join("\n");
    let trace = Trace::parse(&text).unwrap();
    let total = 1500 + 1500 + 1024 + 1100 + 600;
    assert_eq!(trace.total_input_tokens(), total);
    assert_eq!(trace.oracle_prefix_hit_tokens(), 512 + 1100);
    assert!((trace.oracle_prefix_hit_rate() - 1612.0 / total as f64).abs() < 1e-15);
}

#[test]
fn distinct_ids_of_the_shipped_trace_give_distinct_first_engine_blocks() {
    let trace = shipped();
    let synth = PromptSynth::default();
    let ids: HashSet<u64> = trace
        .records()
        .iter()
        .flat_map(|r| r.hash_ids())
        .copied()
        .collect();
    assert_eq!(ids.len(), 182_790);
    let mut firsts: HashSet<Vec<u32>> = HashSet::with_capacity(ids.len());
    let mut buf = Vec::with_capacity(32);
    for &id in &ids {
        buf.clear();
        synth.block_into(id, 32, &mut buf);
        assert_eq!(buf.len(), 32);
        assert!(
            firsts.insert(buf.clone()),
            "hash id {id}: first 32 tokens collide"
        );
    }
}

#[test]
fn equal_hash_prefixes_are_equal_token_prefixes_and_nothing_more() {
    let trace = shipped();
    let synth = PromptSynth::default();
    let records = &trace.records()[..300];
    let prompts: Vec<Vec<u32>> = records.iter().map(|r| r.prompt_tokens(&synth)).collect();
    let mut shared_pairs = 0;
    for (a, pa) in records.iter().zip(&prompts) {
        assert_eq!(pa.len(), a.input_length() as usize);
        assert!(pa.iter().all(|t| PromptSynth::DEFAULT_VOCAB.contains(t)));
        for (b, pb) in records.iter().zip(&prompts) {
            if a.index() >= b.index() {
                continue;
            }
            let k = a
                .hash_ids()
                .iter()
                .zip(b.hash_ids())
                .take_while(|(x, y)| x == y)
                .count();
            let equal = (k * TRACE_BLOCK_TOKENS).min(pa.len()).min(pb.len());
            assert_eq!(pa[..equal], pb[..equal]);
            shared_pairs += usize::from(k > 0);
            if k < a.hash_ids().len() && k < b.hash_ids().len() {
                // Diverging ids: the very next engine block (32 or 64 tokens) differs.
                let at = k * TRACE_BLOCK_TOKENS;
                let n = 32.min(pa.len() - at).min(pb.len() - at);
                assert_ne!(
                    pa[at..at + n],
                    pb[at..at + n],
                    "requests {} {}",
                    a.index(),
                    b.index()
                );
            }
            // What an engine with 64-token blocks would reuse: exactly the shared full blocks.
            for engine_block in [32, 64] {
                let same = pa
                    .chunks_exact(engine_block)
                    .zip(pb.chunks_exact(engine_block))
                    .take_while(|(x, y)| x == y)
                    .count();
                assert_eq!(
                    same,
                    equal / engine_block,
                    "requests {} {}",
                    a.index(),
                    b.index()
                );
            }
        }
    }
    assert!(shared_pairs > 1000, "{shared_pairs}");
}

#[test]
fn partial_last_blocks_share_their_prefix_and_tails_are_unique() {
    let text = [
        // Ids 1, 2 with the second block partial (88 tokens) ...
        line(0, 600, 1, &[1, 2]),
        // ... and full (512): the 88 are its start.
        line(0, 1024, 1, &[1, 2]),
        // Fewer ids than blocks: tokens 512.. are this request's own.
        line(0, 1500, 1, &[1]),
        line(0, 1500, 1, &[1]),
        // No ids at all: the whole prompt is unique.
        line(0, 700, 1, &[]),
    ]
    .join("\n");
    let trace = Trace::parse(&text).unwrap();
    let synth = PromptSynth::default();
    let p: Vec<Vec<u32>> = trace
        .records()
        .iter()
        .map(|r| r.prompt_tokens(&synth))
        .collect();
    assert_eq!(
        p.iter().map(Vec::len).collect::<Vec<_>>(),
        [600, 1024, 1500, 1500, 700]
    );
    assert_eq!(p[0][..], p[1][..600]);
    assert_eq!(p[1][512..], synth.block(2)[..]);
    assert_eq!(p[2][..512], p[3][..512]);
    // The tails differ from each other, from the block of id 2 and from the id-less prompt.
    assert_ne!(p[2][512..544], p[3][512..544]);
    assert_ne!(p[2][512..544], p[1][512..544]);
    assert_ne!(p[4][..32], p[2][512..544]);
    assert_ne!(p[4][..32], synth.block(0)[..32]);
    // Deterministic: the same record and synthesizer give the same prompt.
    assert_eq!(trace.records()[2].prompt_tokens(&synth), p[2]);
    let mut reused = vec![7];
    synth.prompt_tokens_into(&trace.records()[2], &mut reused);
    assert_eq!(reused[1..], p[2][..]);
}

#[test]
fn seeds_and_vocabularies() {
    let trace = Trace::parse(&line(0, 1300, 1, &[5, 6])).unwrap();
    let record = &trace.records()[0];
    let a = PromptSynth::new(1, 1000..128_000).unwrap();
    let b = PromptSynth::new(2, 1000..128_000).unwrap();
    assert_eq!(a.seed(), 1);
    assert_ne!(record.prompt_tokens(&a), record.prompt_tokens(&b));
    assert_eq!(record.prompt_tokens(&a), record.prompt_tokens(&a.clone()));
    let small = PromptSynth::new(3, 50_000..50_300).unwrap();
    let long = Trace::parse(&line(0, 6000, 1, &[])).unwrap();
    let tokens = long.records()[0].prompt_tokens(&small);
    assert!(tokens.iter().all(|t| (50_000..50_300).contains(t)));
    // 6,000 draws cover the 300 ids (all but e^-20 of the time; the draws are fixed anyway).
    assert_eq!(tokens.iter().collect::<HashSet<_>>().len(), 300);
    assert_eq!(
        PromptSynth::default(),
        PromptSynth::new(0, PromptSynth::DEFAULT_VOCAB).unwrap()
    );
    #[allow(clippy::reversed_empty_ranges)] // a reversed range is one of the bad inputs
    let bad_vocabs = [10..10, 10..265, 500..100];
    for bad in bad_vocabs {
        let e = PromptSynth::new(0, bad.clone()).unwrap_err();
        assert_eq!(
            e,
            TraceError::InvalidVocab {
                start: bad.start,
                end: bad.end,
                min: 256
            }
        );
    }
    assert!(PromptSynth::new(0, 10..266).is_ok());
}

#[test]
fn bad_lines_are_errors_naming_the_line() {
    let ok = line(5, 600, 10, &[1, 2]);
    // Each bad line comes third, after a good line and a blank one (blank lines count).
    let at3 = |bad: &str| error_at(&format!("{ok}\n\n{bad}\n{ok}\n"), 3);

    assert!(matches!(
        at3("{\"timestamp\": 5,"),
        LineError::NotJson { .. }
    ));
    assert!(matches!(at3("not json"), LineError::NotAnObject));
    assert_eq!(at3("[5, 600, 10, [1, 2]]"), LineError::NotAnObject);
    let e = at3("{\"timestamp\": 5, \"input_length\": \"600\"}");
    assert!(
        matches!(&e, LineError::NotJson { column, .. } if *column > 0),
        "{e:?}"
    );
    assert!(e.to_string().contains("column"), "{e}");
    assert!(!e.to_string().contains("line 1"), "{e}");
    for field in ["timestamp", "input_length", "output_length", "hash_ids"] {
        let mut v: serde_json::Value = serde_json::from_str(&ok).unwrap();
        v.as_object_mut().unwrap().remove(field);
        assert_eq!(at3(&v.to_string()), LineError::MissingField(field));
        v[field] = serde_json::Value::Null;
        assert_eq!(at3(&v.to_string()), LineError::MissingField(field));
    }
    let with = |field: &str, value: &str| {
        let mut v: serde_json::Value = serde_json::from_str(&ok).unwrap();
        v[field] = serde_json::from_str(value).unwrap();
        at3(&v.to_string())
    };
    for field in ["timestamp", "input_length", "output_length"] {
        assert!(matches!(with(field, "-1"), LineError::Negative { field: f, .. } if f == field));
        assert!(matches!(with(field, "-0.5"), LineError::Negative { .. }));
        assert!(matches!(with(field, "1e30"), LineError::TooLarge { .. }));
        assert!(matches!(with(field, "\"7\""), LineError::NotJson { .. }));
    }
    for field in ["input_length", "output_length"] {
        assert_eq!(with(field, "0"), LineError::Zero(field));
        assert!(matches!(
            with(field, "600.5"),
            LineError::NotAnInteger { .. }
        ));
        let big = (MAX_TRACE_TOKENS + 1).to_string();
        assert!(matches!(
            with(field, &big),
            LineError::TooLarge {
                max: MAX_TRACE_TOKENS,
                ..
            }
        ));
    }
    assert_eq!(
        with("hash_ids", "[1, -2]"),
        LineError::BadHashId {
            index: 1,
            value: "-2".into()
        }
    );
    assert!(matches!(
        with("hash_ids", "[1.5]"),
        LineError::BadHashId { index: 0, .. }
    ));
    assert!(matches!(with("hash_ids", "3"), LineError::NotJson { .. }));
    // 600 tokens are two blocks of 512, the second partial.
    assert_eq!(
        with("hash_ids", "[1, 2, 3]"),
        LineError::TooManyHashIds {
            hash_ids: 3,
            input_length: 600,
            max: 2
        }
    );
    // Backwards from 5 ms.
    let e = with("timestamp", "4.5");
    assert_eq!(
        e,
        LineError::TimestampBackwards {
            timestamp_ms: "4.5".into(),
            previous_ms: "5".into()
        }
    );
    assert_eq!(
        e.to_string(),
        "`timestamp` 4.5 ms is before the previous request's 5 ms"
    );
    assert!(matches!(
        with("session_id", "[1]"),
        LineError::BadSessionId(_)
    ));
    assert!(matches!(
        with("session_id", "1.5"),
        LineError::BadSessionId(_)
    ));
    assert_eq!(with("delay", "10"), LineError::DelayWithoutSession);
    let long = format!("{{\"pad\": \"{}\"}}", "x".repeat(MAX_TRACE_LINE_BYTES));
    assert!(matches!(
        at3(&long),
        LineError::TooLong {
            max: MAX_TRACE_LINE_BYTES,
            ..
        }
    ));

    // Not UTF-8, through the bytes entry point.
    let mut bytes = format!("{ok}\n{ok}\n").into_bytes();
    bytes.extend_from_slice(b"{\"timestamp\": \xff}\n");
    let e = Trace::parse_bytes(&bytes).unwrap_err();
    assert_eq!(
        e,
        TraceError::Line {
            line: 3,
            kind: LineError::NotUtf8
        }
    );
    assert_eq!(e.line(), Some(3));
    assert_eq!(e.to_string(), "trace line 3: the line is not UTF-8");

    // Errors on the first line, and an error that is about no line.
    assert_eq!(error_at("{}", 1), LineError::MissingField("timestamp"));
    assert_eq!(Trace::parse("").unwrap_err(), TraceError::Empty);
    assert_eq!(Trace::parse("\n  \r\n\n").unwrap_err(), TraceError::Empty);
    assert_eq!(TraceError::Empty.line(), None);
}

#[test]
fn lenient_where_harmless() {
    // CRLF, surrounding blanks, unknown fields, fractional milliseconds, whole numbers written
    // as floats.
    let text = format!(
        "\r\n{}\r\n   \r\n{{\"timestamp\": 1.25, \"input_length\": 3.0, \"output_length\": 1, \
         \"hash_ids\": [], \"note\": \"x\"}}\r\n{}",
        line(1, 600, 10, &[1, 2]),
        line(2, 600, 10, &[1, 2]),
    );
    let trace = Trace::parse(&text).unwrap();
    assert_eq!(trace.len(), 3);
    let lines: Vec<usize> = trace.records().iter().map(|r| r.line()).collect();
    assert_eq!(lines, [2, 4, 5]);
    assert_eq!(trace.records()[1].timestamp(), Nanos(1_250_000));
    assert_eq!(trace.records()[1].input_length(), 3);
    assert_eq!(trace.duration(), Nanos::from_millis(2));
}

#[test]
fn sessions_and_delays() {
    let text = [
        "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 5, \"hash_ids\": [1, 2], \
         \"session_id\": \"alice\"}",
        "{\"timestamp\": 10, \"input_length\": 100, \"output_length\": 5, \"hash_ids\": [7], \
         \"session_id\": 42, \"delay\": 3}",
        "{\"timestamp\": 20, \"input_length\": 1200, \"output_length\": 5, \
         \"hash_ids\": [1, 2, 3], \"session_id\": \"alice\", \"delay\": 1500.5}",
        "{\"timestamp\": 20, \"input_length\": 100, \"output_length\": 5, \"hash_ids\": [8]}",
        "{\"timestamp\": 30, \"input_length\": 200, \"output_length\": 5, \"hash_ids\": [7], \
         \"session_id\": 42}",
        "{\"timestamp\": 40, \"input_length\": 1300, \"output_length\": 5, \
         \"hash_ids\": [1, 2, 3], \"session_id\": \"alice\", \"delay\": 0, \"session\": null}",
    ]
    .join("\n");
    let trace = Trace::parse(&text).unwrap();
    assert_eq!(trace.session_count(), 2);
    assert_eq!(trace.session_name(0), Some("alice"));
    assert_eq!(trace.session_name(1), Some("42"));
    assert_eq!(trace.session_name(2), None);
    let steps: Vec<Option<SessionStep>> = trace.records().iter().map(|r| r.session()).collect();
    let step = |session, previous, delay| {
        Some(SessionStep {
            session,
            previous,
            delay,
        })
    };
    assert_eq!(
        steps,
        [
            step(0, None, Nanos::ZERO),
            // A delay on a session's first request is kept but has no effect.
            step(1, None, Nanos::from_millis(3)),
            step(0, Some(0), Nanos(1_500_500_000)),
            None,
            step(1, Some(1), Nanos::ZERO),
            step(0, Some(2), Nanos::ZERO),
        ]
    );
    // Delays scale with the replay speed like timestamps.
    assert_eq!(
        Speed::new(2.0).unwrap().scale(Nanos(1_500_500_000)),
        Nanos(750_250_000)
    );
}

#[test]
fn speed_factor() {
    let trace = shipped();
    let real: Vec<Nanos> = trace.scaled(1.0).unwrap().map(|(t, _)| t).collect();
    let times: Vec<Nanos> = trace.records().iter().map(|r| r.timestamp()).collect();
    assert_eq!(real, times);
    let fast = trace.scaled(4.0).unwrap();
    assert_eq!(fast.len(), 12_031);
    let fast: Vec<(Nanos, usize)> = fast.map(|(t, r)| (t, r.index())).collect();
    assert_eq!(fast.last().unwrap().0, Nanos(3_536_999_000_000 / 4));
    assert!(fast.iter().enumerate().all(|(i, &(_, idx))| idx == i));
    assert!(fast.windows(2).all(|w| w[0].0 <= w[1].0));
    let slow = trace.scaled(0.5).unwrap().last().unwrap().0;
    assert_eq!(slow, Nanos::from_millis(2 * 3_536_999));
    for bad in [0.0, -1.0, f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
        let e = trace.scaled(bad).unwrap_err();
        assert!(matches!(e, TraceError::InvalidSpeed(f) if f.to_bits() == bad.to_bits()));
        assert!(e.to_string().contains("finite and greater than 0"), "{e}");
    }
    // A tiny factor saturates instead of wrapping.
    let tiny = Speed::new(f64::MIN_POSITIVE).unwrap();
    assert_eq!(tiny.scale(Nanos(1)), Nanos::MAX);
    assert_eq!(tiny.scale(Nanos::ZERO), Nanos::ZERO);
    assert_eq!(Speed::default(), Speed::REAL_TIME);
    assert_eq!(trace.scaled_by(Speed::REAL_TIME).count(), trace.len());
}

#[test]
fn the_first_requests_of_a_trace_replay_as_its_start() {
    let trace = shipped();
    assert!(trace.first(0).is_none());
    assert_eq!(trace.first(usize::MAX).as_ref(), Some(trace));
    let head = trace.first(300).unwrap();
    assert_eq!(head.records(), &trace.records()[..300]);
    assert_eq!(head.duration(), trace.records()[299].timestamp());
    // Sessions seen in the slice keep their names; later ones are gone.
    let text = [
        "{\"timestamp\": 0, \"input_length\": 9, \"output_length\": 1, \"hash_ids\": [], \"session_id\": \"a\"}",
        "{\"timestamp\": 1, \"input_length\": 9, \"output_length\": 1, \"hash_ids\": [], \"session_id\": \"a\", \"delay\": 5}",
        "{\"timestamp\": 2, \"input_length\": 9, \"output_length\": 1, \"hash_ids\": [], \"session_id\": \"b\"}",
    ]
    .join("\n");
    let sessions = Trace::parse(&text).unwrap();
    let two = sessions.first(2).unwrap();
    assert_eq!((two.len(), two.session_count()), (2, 1));
    assert_eq!(two.session_name(0), Some("a"));
    assert_eq!(sessions.first(3).unwrap().session_count(), 2);
}

#[test]
fn replies_are_the_output_length_and_unique_to_the_request() {
    let trace = shipped();
    let synth = PromptSynth::default();
    let (a, b) = (&trace.records()[0], &trace.records()[1]);
    let (ra, rb) = (synth.reply_tokens(a), synth.reply_tokens(b));
    assert_eq!((ra.len(), rb.len()), (500, 490));
    assert_ne!(ra[..32], rb[..32]);
    assert_eq!(ra, synth.reply_tokens(a));
}
