//! Mooncake's JSONL trace format as `kvroute sim --trace` and the load generator read it
//! (`workload::Trace::parse_bytes`).
//!
//! Properties: parsing never panics; a refusal names a line of the input; a parsed trace has
//! requests with timestamps in order, an oracle hit rate in [0, 1], prompts of the declared
//! length, and replays in order at any speed; `\r\n` line ends or a trailing blank line change
//! nothing; the lines up to a request's parse to `Trace::first` of that many requests (so a
//! truncated trace replays as the start of the whole one, sessions included).

#![no_main]

use libfuzzer_sys::fuzz_target;
use workload::{PromptSynth, Trace};

fuzz_target!(|bytes: &[u8]| {
    let lines = bytes.split(|&b| b == b'\n').count();
    let trace = match Trace::parse_bytes(bytes) {
        Ok(trace) => trace,
        Err(e) => {
            if let Some(line) = e.line() {
                assert!(
                    line >= 1 && line <= lines,
                    "{e}: the input has {lines} lines"
                );
            }
            return;
        }
    };
    let records = trace.records();
    assert!(!records.is_empty());
    assert!(
        records
            .windows(2)
            .all(|w| w[0].timestamp() <= w[1].timestamp())
    );
    let rate = trace.oracle_prefix_hit_rate();
    assert!((0.0..=1.0).contains(&rate), "oracle hit rate {rate}");
    for speed in [0.5, 1.0, 3.0] {
        let times: Vec<_> = trace
            .scaled(speed)
            .expect("a valid speed")
            .map(|(at, _)| at)
            .collect();
        assert_eq!(times.len(), records.len());
        assert!(
            times.windows(2).all(|w| w[0] <= w[1]),
            "speed {speed}: {times:?}"
        );
    }
    let synth = PromptSynth::default();
    for record in records.iter().take(4) {
        if record.input_length() <= 1 << 14 {
            assert_eq!(
                record.prompt_tokens(&synth).len(),
                record.input_length() as usize
            );
        }
    }

    // Line ends and a trailing blank line.
    let mut crlf = Vec::with_capacity(bytes.len() * 2);
    for (i, line) in bytes.split(|&b| b == b'\n').enumerate() {
        if i > 0 {
            crlf.extend_from_slice(b"\r\n");
        }
        crlf.extend_from_slice(line.strip_suffix(b"\r").unwrap_or(line));
    }
    assert_eq!(
        Trace::parse_bytes(&crlf).as_ref(),
        Ok(&trace),
        "with \\r\\n line ends"
    );
    let mut blank = bytes.to_vec();
    blank.extend_from_slice(b"\n\n");
    assert_eq!(
        Trace::parse_bytes(&blank).as_ref(),
        Ok(&trace),
        "with blank lines after"
    );

    // A prefix of the file is the start of the trace.
    for k in [1, records.len() / 2, records.len()] {
        let Some(k) = std::num::NonZeroUsize::new(k) else {
            continue;
        };
        let last_line = records[k.get() - 1].line();
        let end = bytes
            .split(|&b| b == b'\n')
            .take(last_line)
            .map(|l| l.len() + 1)
            .sum::<usize>()
            .min(bytes.len());
        let prefix = Trace::parse_bytes(&bytes[..end]).expect("a prefix of a valid trace parses");
        assert_eq!(Some(prefix), trace.first(k.get()), "the first {k} requests");
    }
});
