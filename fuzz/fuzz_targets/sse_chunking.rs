//! The SSE reader (`protocol::sse::SseDecoder`) the gateway runs on every worker stream.
//!
//! Properties: the same bytes give the same events and the same outcome whatever the chunking
//! (all at once, one byte at a time, or fuzzer-chosen splits, such as a `\r\n` cut between
//! two reads); what it holds for an unfinished line and event stays within its bounds.

#![no_main]

use libfuzzer_sys::fuzz_target;
use protocol::sse::{SseDecoder, SseError, SseEvent};

/// Events handed out, and how the stream ended.
type Outcome = (Vec<SseEvent<String>>, Result<(), SseError>);

fn decode<'a>(max_line: usize, chunks: impl Iterator<Item = &'a [u8]>) -> Outcome {
    let mut decoder = SseDecoder::new(max_line);
    let mut events = Vec::new();
    for chunk in chunks {
        if let Err(e) = decoder.push(chunk) {
            return (events, Err(e));
        }
        // An unfinished line and the current event's data, each within `max_line`.
        assert!(
            decoder.buffered() <= 2 * max_line + 1,
            "holds {} bytes with max_line {max_line}",
            decoder.buffered()
        );
        while let Some(event) = decoder.next_event() {
            events.push(event.into_owned());
        }
    }
    (events, Ok(()))
}

/// Input: a byte choosing `max_line` (0: the production default, else 1..=64, so the fuzzer
/// reaches the limits), a byte giving the number of cuts (at most 16), two bytes per cut,
/// then the stream.
struct Case<'a> {
    max_line: usize,
    cuts: Vec<u16>,
    bytes: &'a [u8],
}

fn case(data: &[u8]) -> Option<Case<'_>> {
    let (&limit, rest) = data.split_first()?;
    let (&n_cuts, rest) = rest.split_first()?;
    let n_cuts = usize::from(n_cuts % 17);
    if rest.len() < 2 * n_cuts {
        return None;
    }
    let (cut_bytes, bytes) = rest.split_at(2 * n_cuts);
    Some(Case {
        max_line: match limit {
            0 => protocol::sse::DEFAULT_MAX_LINE,
            n => usize::from(n % 64) + 1,
        },
        cuts: cut_bytes
            .chunks(2)
            .map(|c| u16::from_be_bytes([c[0], c[1]]))
            .collect(),
        bytes,
    })
}

fuzz_target!(|data: &[u8]| {
    let Some(Case {
        max_line,
        mut cuts,
        bytes,
    }) = case(data)
    else {
        return;
    };
    let whole = decode(max_line, std::iter::once(bytes));

    let bytewise = decode(max_line, bytes.chunks(1));
    compare(&whole, &bytewise, "one byte at a time");

    cuts.iter_mut()
        .for_each(|c| *c = (*c as usize % (bytes.len() + 1)) as u16);
    cuts.sort_unstable();
    let mut pieces = Vec::new();
    let mut start = 0;
    for &cut in &cuts {
        pieces.push(&bytes[start..cut as usize]);
        start = cut as usize;
    }
    pieces.push(&bytes[start..]);
    let split = decode(max_line, pieces.into_iter());
    compare(&whole, &split, "split at the fuzzer's cuts");
});

/// With an error, the chunked read may have handed out the events before it; the whole read
/// reports the error at its one push. Either way, the same error, and without one the same
/// events.
fn compare(whole: &Outcome, chunked: &Outcome, how: &str) {
    match (&whole.1, &chunked.1) {
        (Ok(()), Ok(())) => assert_eq!(whole.0, chunked.0, "{how}"),
        (Err(a), Err(b)) => {
            assert_eq!(a, b, "{how}");
            assert!(whole.0.is_empty());
        }
        (a, b) => panic!(
            "{how}: whole {a:?} ({:?}), chunked {b:?} ({:?})",
            whole.0, chunked.0
        ),
    }
}
