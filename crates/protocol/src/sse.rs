//! Server-sent events as OpenAI streams them: `data: <json>\n\n` per chunk, then
//! `data: [DONE]\n\n`.
//!
//! [`SseDecoder`] is the one SSE reader of the project (the gateway's relay, the load
//! generator, the tests). It turns a byte stream, cut anywhere (inside a line, between `\r` and
//! `\n`, inside a UTF-8 character), into the events' `data` payloads. It follows the SSE rules
//! that matter here: lines end in `\n`, `\r\n` or `\r`; a blank line ends an event; several
//! `data:` lines of one event are joined with `\n`; `:` starts a comment; other fields
//! (`event:`, `id:`, `retry:`) are ignored.
//!
//! Zero-copy: the stream is kept in one buffer and each event's data is handed out as a `&str`
//! borrowed from it, valid until the next [`SseDecoder::push`]. The relay reads one event per
//! token, so no allocation per event matters. A second `data:` line of an event is joined in
//! place (moved down next to the first), so even then nothing is allocated.
//!
//! Bounded: a line, or one event's joined data, longer than the bound is an error, so a peer
//! cannot make the decoder buffer without limit.
//!
//! The writers, [`write_event`], [`write_error_and_done`] and [`write_done`], append to a [`BytesMut`] so a server can
//! collect several events into one body frame.

use std::collections::VecDeque;
use std::ops::Range;

use bytes::{BufMut, BytesMut};
use serde::Serialize;
use thiserror::Error;

use crate::error::ApiError;

/// The payload that ends an OpenAI stream.
pub const DONE: &str = "[DONE]";

/// The event that ends an OpenAI stream: `data: [DONE]\n\n`.
pub const DONE_EVENT: &str = "data: [DONE]\n\n";

/// One SSE event carrying `payload` as its data (`payload` must not contain a line break; JSON
/// from `serde_json::to_string` never does).
pub fn event(payload: &str) -> String {
    let mut out = String::with_capacity(payload.len() + 8);
    out.push_str("data: ");
    out.push_str(payload);
    out.push_str("\n\n");
    out
}

/// `data: [DONE]\n\n`.
pub fn done_event() -> &'static str {
    DONE_EVENT
}

/// Appends `data: <payload as JSON>\n\n`. On a serialization error nothing is appended.
pub fn write_event(out: &mut BytesMut, payload: &impl Serialize) -> Result<(), serde_json::Error> {
    let start = out.len();
    out.put_slice(b"data: ");
    match serde_json::to_writer((&mut *out).writer(), payload) {
        Ok(()) => {
            out.put_slice(b"\n\n");
            Ok(())
        }
        Err(e) => {
            out.truncate(start);
            Err(e)
        }
    }
}

/// Appends `data: [DONE]\n\n`.
pub fn write_done(out: &mut BytesMut) {
    out.put_slice(DONE_EVENT.as_bytes());
}

/// Appends an error event (OpenAI's error JSON, as a stream that failed midway carries it)
/// and `data: [DONE]`.
pub fn write_error_and_done(out: &mut BytesMut, error: &ApiError) {
    out.put_slice(event(&error.to_json()).as_bytes());
    write_done(out);
}

/// What one event carried: `D` is `&str` as the decoder hands it out, `String` once owned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SseEvent<D> {
    /// A `data` payload (JSON, for OpenAI streams).
    Data(D),
    /// `data: [DONE]`: the stream is complete.
    Done,
}

impl SseEvent<&str> {
    /// The event with its data copied out of the decoder.
    pub fn into_owned(self) -> SseEvent<String> {
        match self {
            SseEvent::Data(data) => SseEvent::Data(data.to_owned()),
            SseEvent::Done => SseEvent::Done,
        }
    }
}

/// Why a stream could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum SseError {
    #[error("an SSE line is longer than {max} bytes")]
    LineTooLong { max: usize },
    #[error("an SSE event's data is longer than {max} bytes")]
    EventTooLong { max: usize },
    #[error("an SSE data line is not valid UTF-8")]
    InvalidUtf8,
}

/// Default bound on one line and on one event's data: 1 MiB.
pub const DEFAULT_MAX_LINE: usize = 1 << 20;

/// Incremental, zero-copy SSE decoder with bounded buffers (`max_line` bytes for the line being
/// read, the same for one event's joined data). See the module docs.
#[derive(Debug)]
pub struct SseDecoder {
    max_line: usize,
    /// Unread stream bytes: the data of complete events not yet handed out, the current event's
    /// data so far, the line being read.
    buf: Vec<u8>,
    /// Data of complete events, as ranges of `buf`, oldest first.
    ready: VecDeque<Range<usize>>,
    /// Start of the line being read.
    line_start: usize,
    /// Bytes of the line being read already searched for a line end.
    scanned: usize,
    /// The current event's data so far (`buf[data]`), once it has a `data:` line.
    data: Option<Range<usize>>,
    /// The previous line ended with `\r`: a `\n` right after it ends nothing.
    after_cr: bool,
}

impl Default for SseDecoder {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_LINE)
    }
}

impl SseDecoder {
    pub fn new(max_line: usize) -> SseDecoder {
        SseDecoder {
            max_line,
            buf: Vec::new(),
            ready: VecDeque::new(),
            line_start: 0,
            scanned: 0,
            data: None,
            after_cr: false,
        }
    }

    /// Feeds bytes; completed events are then returned by [`SseDecoder::next_event`]. After
    /// an error the decoder's state is unspecified: drop the stream.
    pub fn push(&mut self, bytes: &[u8]) -> Result<(), SseError> {
        self.compact();
        let mut rest = bytes;
        if self.after_cr && !rest.is_empty() {
            self.after_cr = false;
            if rest[0] == b'\n' {
                rest = &rest[1..];
            }
        }
        self.buf.extend_from_slice(rest);
        while let Some(offset) = self.buf[self.scanned..]
            .iter()
            .position(|&b| b == b'\n' || b == b'\r')
        {
            let end = self.scanned + offset;
            self.check_line(end - self.line_start)?;
            let mut next = end + 1;
            if self.buf[end] == b'\r' {
                match self.buf.get(next) {
                    Some(b'\n') => next += 1,
                    Some(_) => {}
                    // The `\n` of a `\r\n` may come with the next push.
                    None => self.after_cr = true,
                }
            }
            self.finish_line(end)?;
            self.line_start = next;
            self.scanned = next;
        }
        self.scanned = self.buf.len();
        self.check_line(self.buf.len() - self.line_start)
    }

    /// The next complete event, in order; its data borrows the decoder until the next push.
    pub fn next_event(&mut self) -> Option<SseEvent<&str>> {
        // Popping the range leaves the bytes in place: they go at the next push.
        let range = self.ready.pop_front()?;
        // Each data line was checked when it was read; a join adds only `\n`.
        let data = std::str::from_utf8(&self.buf[range]).ok()?;
        Some(if data == DONE {
            SseEvent::Done
        } else {
            SseEvent::Data(data)
        })
    }

    /// Bytes held for an unfinished line and event.
    pub fn buffered(&self) -> usize {
        self.buf.len() - self.line_start + self.data.as_ref().map_or(0, Range::len)
    }

    fn check_line(&self, len: usize) -> Result<(), SseError> {
        if len > self.max_line {
            Err(SseError::LineTooLong { max: self.max_line })
        } else {
            Ok(())
        }
    }

    /// Drops what is no longer needed: handed-out events and the lines already read of the
    /// current event, keeping its data and the line being read.
    fn compact(&mut self) {
        let keep_from = match (self.ready.front(), &self.data) {
            (Some(first), _) => first.start,
            (None, Some(data)) => data.start,
            (None, None) => self.line_start,
        };
        if keep_from > 0 {
            self.buf.drain(..keep_from);
            for range in &mut self.ready {
                *range = range.start - keep_from..range.end - keep_from;
            }
            if let Some(data) = &mut self.data {
                *data = data.start - keep_from..data.end - keep_from;
            }
            self.line_start -= keep_from;
            self.scanned -= keep_from;
        }
        // Lines read after the current event's data (comments, other fields) are not kept.
        if let Some(data) = &self.data {
            if self.line_start > data.end {
                let gap = self.line_start - data.end;
                self.buf.drain(data.end..self.line_start);
                self.line_start -= gap;
                self.scanned -= gap;
            }
        }
    }

    /// Handles the complete line `buf[line_start..end]`.
    fn finish_line(&mut self, end: usize) -> Result<(), SseError> {
        let start = self.line_start;
        if start == end {
            if let Some(data) = self.data.take() {
                self.ready.push_back(data);
            }
            return Ok(());
        }
        let line = &self.buf[start..end];
        let value_start = match line {
            [b':', ..] => return Ok(()),
            [b'd', b'a', b't', b'a'] => end,
            [b'd', b'a', b't', b'a', b':', b' ', ..] => start + 6,
            [b'd', b'a', b't', b'a', b':', ..] => start + 5,
            // Another field (`event:`, `id:`, `dataX:`…).
            _ => return Ok(()),
        };
        std::str::from_utf8(&self.buf[value_start..end]).map_err(|_| SseError::InvalidUtf8)?;
        let joined = match self.data.clone() {
            None => value_start..end,
            Some(data) => {
                let joined_len = data.len() + 1 + (end - value_start);
                if joined_len > self.max_line {
                    return Err(SseError::EventTooLong { max: self.max_line });
                }
                // Join in place: the value moves down right after the data so far, over
                // lines already read.
                self.buf[data.end] = b'\n';
                self.buf.copy_within(value_start..end, data.end + 1);
                data.start..data.start + joined_len
            }
        };
        self.data = Some(joined);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode_all(decoder: &mut SseDecoder, bytes: &[u8]) -> Vec<SseEvent<String>> {
        decoder.push(bytes).unwrap();
        std::iter::from_fn(|| decoder.next_event().map(SseEvent::into_owned)).collect()
    }

    #[test]
    fn decodes_events_comments_and_done() {
        let stream = format!(
            ": keep-alive\n\n{}event: x\nid: 3\n{}{}",
            event("{\"a\":1}"),
            event("{\"b\":2}"),
            done_event()
        );
        let mut decoder = SseDecoder::default();
        assert_eq!(
            decode_all(&mut decoder, stream.as_bytes()),
            vec![
                SseEvent::Data("{\"a\":1}".into()),
                SseEvent::Data("{\"b\":2}".into()),
                SseEvent::Done
            ]
        );
        assert_eq!(decoder.buffered(), 0);
    }

    #[test]
    fn any_split_and_any_line_ending_gives_the_same_events() {
        let bodies = [
            "data: {\"x\":\"é\"}\n\ndata:two\ndata: lines\n\ndata: [DONE]\n\n",
            "data: {\"x\":\"é\"}\r\n\r\ndata:two\r\ndata: lines\r\n\r\ndata: [DONE]\r\n\r\n",
            "data: {\"x\":\"é\"}\r\rdata:two\rdata: lines\r\rdata: [DONE]\r\r",
        ];
        let expected = vec![
            SseEvent::Data("{\"x\":\"é\"}".into()),
            SseEvent::Data("two\nlines".into()),
            SseEvent::Done,
        ];
        for body in bodies {
            let bytes = body.as_bytes();
            for split in 0..=bytes.len() {
                let mut decoder = SseDecoder::default();
                let mut got = decode_all(&mut decoder, &bytes[..split]);
                got.extend(decode_all(&mut decoder, &bytes[split..]));
                assert_eq!(got, expected, "split at {split} of {body:?}");
            }
            // One byte at a time.
            let mut decoder = SseDecoder::default();
            let got: Vec<_> = bytes
                .iter()
                .flat_map(|b| decode_all(&mut decoder, std::slice::from_ref(b)))
                .collect();
            assert_eq!(got, expected);
        }
    }

    /// The relay's stream shapes (moved here with the gateway's former zero-copy reader).
    #[test]
    fn events_cut_anywhere_come_out_whole() {
        let stream = b": keep-alive\n\ndata: {\"a\":1}\n\nevent: x\r\nid: 3\r\ndata:{\"b\":2}\r\n\r\ndata: one\ndata: two\n\ndata: [DONE]\n\n";
        let expected: Vec<SseEvent<String>> = vec![
            SseEvent::Data("{\"a\":1}".into()),
            SseEvent::Data("{\"b\":2}".into()),
            SseEvent::Data("one\ntwo".into()),
            SseEvent::Done,
        ];
        for cut in 0..stream.len() {
            let mut decoder = SseDecoder::new(1 << 10);
            let mut got = decode_all(&mut decoder, &stream[..cut]);
            got.extend(decode_all(&mut decoder, &stream[cut..]));
            assert_eq!(got, expected, "cut at {cut}");
        }
    }

    #[test]
    fn events_are_handed_out_without_copying() {
        let mut decoder = SseDecoder::default();
        decoder.push(b"data: {\"a\":1}\n\ndata: x\n").unwrap();
        let data = match decoder.next_event() {
            Some(SseEvent::Data(data)) => data.as_ptr(),
            other => panic!("an event is ready, got {other:?}"),
        };
        let held = decoder.buf.as_ptr_range();
        assert!(held.contains(&data), "the data is a slice of the buffer");
        assert_eq!(decoder.next_event(), None);
        // Comment lines between an event's data lines are not kept.
        for _ in 0..100 {
            decoder.push(b": keep-alive comment\n").unwrap();
        }
        assert!(decoder.buf.len() < 32, "{} bytes held", decoder.buf.len());
        decoder.push(b"\n").unwrap();
        assert_eq!(decoder.next_event(), Some(SseEvent::Data("x")));
    }

    #[test]
    fn unterminated_event_is_held_not_emitted() {
        let mut decoder = SseDecoder::default();
        assert!(decode_all(&mut decoder, b"data: {\"a\":1}\n").is_empty());
        assert_eq!(
            decode_all(&mut decoder, b"\n"),
            vec![SseEvent::Data("{\"a\":1}".into())]
        );
    }

    #[test]
    fn bounds_are_enforced() {
        let push = |max: usize, bytes: &[u8]| SseDecoder::new(max).push(bytes);
        assert_eq!(
            push(16, &[b'a'; 17]),
            Err(SseError::LineTooLong { max: 16 })
        );
        assert_eq!(
            push(16, b"data: 0123456789\ndata: 0123456789\n"),
            Err(SseError::EventTooLong { max: 16 })
        );
        assert_eq!(push(16, b"data: \xff\n"), Err(SseError::InvalidUtf8));
        // Moved from the gateway's former reader: an endless event is an error, not
        // unbounded memory.
        assert_eq!(
            push(64, &[b'x'; 65]),
            Err(SseError::LineTooLong { max: 64 })
        );
    }

    #[test]
    fn writers_append_events() {
        let mut out = BytesMut::new();
        write_event(&mut out, &serde_json::json!({"a": 1})).unwrap();
        write_done(&mut out);
        assert_eq!(
            &out[..],
            format!("{}{}", event("{\"a\":1}"), DONE_EVENT).as_bytes()
        );
    }
}
