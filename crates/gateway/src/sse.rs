//! A zero-copy SSE reader for the relay's hot path.
//!
//! `protocol::SseDecoder` hands out owned `String`s (several allocations per event); the relay
//! reads one event per token, so this reader keeps the stream in one growing buffer and hands
//! out each event's `data` as a slice of it: no allocation per event in the common case of one
//! `data:` line. Events end at a blank line (`\n\n` or `\r\n\r\n`); several `data:` lines are
//! joined with `\n` (then, and only then, the data is copied); comments and other fields are
//! skipped. A lone `\r` as a line ending is not supported (OpenAI-compatible servers use `\n`).
//! The buffer is bounded: an event longer than `max_event` bytes is an error.

use bytes::{Buf, Bytes, BytesMut};

/// The event data that ends an OpenAI stream.
pub const DONE: &[u8] = b"[DONE]";

/// Why a stream could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SseError {
    #[error("an SSE event is longer than {max} bytes")]
    EventTooLong { max: usize },
}

/// One event's data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventData {
    /// A slice of the stream (one `data:` line).
    Shared(Bytes),
    /// Several `data:` lines, joined.
    Joined(Vec<u8>),
}

impl EventData {
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            EventData::Shared(b) => b,
            EventData::Joined(v) => v,
        }
    }
}

/// Splits a byte stream into SSE events. See the module docs.
#[derive(Debug)]
pub struct SseReader {
    buf: BytesMut,
    /// Bytes of `buf` already searched for an event end.
    scanned: usize,
    /// Start of the line being scanned.
    line_start: usize,
    max_event: usize,
}

impl SseReader {
    pub fn new(max_event: usize) -> SseReader {
        SseReader {
            buf: BytesMut::new(),
            scanned: 0,
            line_start: 0,
            max_event,
        }
    }

    /// Appends bytes read from the stream.
    pub fn push(&mut self, bytes: &[u8]) -> Result<(), SseError> {
        self.buf.extend_from_slice(bytes);
        Ok(())
    }

    /// The next complete event's data (`None` until one is complete). Events without data
    /// (comments, keep-alives) are skipped.
    pub fn next_event(&mut self) -> Result<Option<EventData>, SseError> {
        loop {
            let Some(end) = self.find_event_end() else {
                if self.buf.len() > self.max_event {
                    return Err(SseError::EventTooLong {
                        max: self.max_event,
                    });
                }
                return Ok(None);
            };
            let event = self.buf.split_to(end).freeze();
            self.scanned = 0;
            self.line_start = 0;
            if let Some(data) = data_of(event) {
                return Ok(Some(data));
            }
        }
    }

    /// Length up to and including the blank line that ends the first event, if complete.
    fn find_event_end(&mut self) -> Option<usize> {
        while let Some(offset) = self.buf[self.scanned..].iter().position(|&b| b == b'\n') {
            let newline = self.scanned + offset;
            let line = &self.buf[self.line_start..newline];
            let blank = line.is_empty() || line == b"\r";
            self.scanned = newline + 1;
            self.line_start = newline + 1;
            if blank {
                return Some(newline + 1);
            }
        }
        self.scanned = self.buf.len();
        None
    }
}

/// The `data` of one event (its lines up to the blank one).
fn data_of(mut event: Bytes) -> Option<EventData> {
    let mut first: Option<Bytes> = None;
    let mut joined: Option<Vec<u8>> = None;
    while !event.is_empty() {
        let end = event
            .iter()
            .position(|&b| b == b'\n')
            .unwrap_or(event.len());
        let mut line = event.split_to(end);
        if event.has_remaining() {
            event.advance(1);
        }
        if line.last() == Some(&b'\r') {
            line.truncate(line.len() - 1);
        }
        let Some(value) = line.strip_prefix(b"data") else {
            continue;
        };
        let value = match value {
            [] => &[][..],
            [b':', b' ', rest @ ..] => rest,
            [b':', rest @ ..] => rest,
            // `dataX:` is another field.
            _ => continue,
        };
        let start = value.as_ptr() as usize - line.as_ptr() as usize;
        let value = line.slice(start..);
        match (&mut first, &mut joined) {
            (None, _) => first = Some(value),
            (Some(f), None) => {
                let mut v = f.to_vec();
                v.push(b'\n');
                v.extend_from_slice(&value);
                joined = Some(v);
            }
            (Some(_), Some(v)) => {
                v.push(b'\n');
                v.extend_from_slice(&value);
            }
        }
    }
    match (joined, first) {
        (Some(v), _) => Some(EventData::Joined(v)),
        (None, Some(f)) => Some(EventData::Shared(f)),
        (None, None) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(reader: &mut SseReader) -> Vec<Vec<u8>> {
        std::iter::from_fn(|| reader.next_event().unwrap())
            .map(|d| d.as_bytes().to_vec())
            .collect()
    }

    #[test]
    fn events_cut_anywhere_come_out_whole() {
        let stream = b": keep-alive\n\ndata: {\"a\":1}\n\nevent: x\r\nid: 3\r\ndata:{\"b\":2}\r\n\r\ndata: one\ndata: two\n\ndata: [DONE]\n\n";
        let expected: Vec<Vec<u8>> = vec![
            b"{\"a\":1}".to_vec(),
            b"{\"b\":2}".to_vec(),
            b"one\ntwo".to_vec(),
            DONE.to_vec(),
        ];
        for cut in 0..stream.len() {
            let mut reader = SseReader::new(1 << 10);
            reader.push(&stream[..cut]).unwrap();
            let mut got = all(&mut reader);
            reader.push(&stream[cut..]).unwrap();
            got.extend(all(&mut reader));
            assert_eq!(got, expected, "cut at {cut}");
        }
        // Byte by byte.
        let mut reader = SseReader::new(1 << 10);
        let mut got = Vec::new();
        for b in stream {
            reader.push(&[*b]).unwrap();
            got.extend(all(&mut reader));
        }
        assert_eq!(got, expected);
    }

    #[test]
    fn an_endless_event_is_an_error_not_unbounded_memory() {
        let mut reader = SseReader::new(64);
        reader.push(&[b'x'; 65]).unwrap();
        assert_eq!(reader.next_event(), Err(SseError::EventTooLong { max: 64 }));
    }
}
