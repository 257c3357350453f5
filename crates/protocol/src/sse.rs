//! Server-sent events as OpenAI streams them: `data: <json>\n\n` per chunk, then
//! `data: [DONE]\n\n`.
//!
//! [`SseDecoder`] turns a byte stream, cut anywhere (inside a line, between `\r` and `\n`,
//! inside a UTF-8 character), into the events' `data` payloads. It follows the SSE rules that
//! matter here: lines end in `\n`, `\r\n` or `\r`; a blank line ends an event; several `data:`
//! lines of one event are joined with `\n`; `:` starts a comment; other fields (`event:`,
//! `id:`, `retry:`) are ignored. A line longer than the bound is an error, so a peer cannot make
//! the decoder buffer without limit.

use thiserror::Error;

/// The payload that ends an OpenAI stream.
pub const DONE: &str = "[DONE]";

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
    "data: [DONE]\n\n"
}

/// What one event carried.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SseMessage {
    /// A `data` payload (JSON, for OpenAI streams).
    Data(String),
    /// `data: [DONE]`: the stream is complete.
    Done,
}

/// Why a stream could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum SseError {
    #[error("an SSE line is longer than {max} bytes")]
    LineTooLong { max: usize },
    #[error("an SSE event's data is longer than {max} bytes")]
    EventTooLong { max: usize },
    #[error("an SSE line is not valid UTF-8")]
    InvalidUtf8,
}

/// Incremental SSE decoder with bounded buffers (`max_line` bytes for the line being read,
/// the same for one event's joined data).
#[derive(Debug)]
pub struct SseDecoder {
    max_line: usize,
    line: Vec<u8>,
    data: Option<String>,
    /// The previous byte was `\r`: a `\n` right after it ends the same line.
    after_cr: bool,
    ready: std::collections::VecDeque<SseMessage>,
}

/// Default bound on one line and on one event's data: 1 MiB.
pub const DEFAULT_MAX_LINE: usize = 1 << 20;

impl Default for SseDecoder {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_LINE)
    }
}

impl SseDecoder {
    pub fn new(max_line: usize) -> SseDecoder {
        SseDecoder {
            max_line,
            line: Vec::new(),
            data: None,
            after_cr: false,
            ready: std::collections::VecDeque::new(),
        }
    }

    /// Feeds bytes; completed events are then returned by [`SseDecoder::next_message`]. After
    /// an error the decoder's state is unspecified: drop the stream.
    pub fn push(&mut self, bytes: &[u8]) -> Result<(), SseError> {
        let mut rest = bytes;
        while !rest.is_empty() {
            if self.after_cr {
                self.after_cr = false;
                if rest[0] == b'\n' {
                    rest = &rest[1..];
                    continue;
                }
            }
            match rest.iter().position(|&b| b == b'\n' || b == b'\r') {
                Some(end) => {
                    self.append(&rest[..end])?;
                    self.after_cr = rest[end] == b'\r';
                    rest = &rest[end + 1..];
                    self.finish_line()?;
                }
                None => {
                    self.append(rest)?;
                    rest = &[];
                }
            }
        }
        Ok(())
    }

    /// The next complete event, in order.
    pub fn next_message(&mut self) -> Option<SseMessage> {
        self.ready.pop_front()
    }

    /// Bytes held for an unfinished line.
    pub fn buffered(&self) -> usize {
        self.line.len() + self.data.as_ref().map_or(0, String::len)
    }

    fn append(&mut self, bytes: &[u8]) -> Result<(), SseError> {
        if self.line.len() + bytes.len() > self.max_line {
            return Err(SseError::LineTooLong { max: self.max_line });
        }
        self.line.extend_from_slice(bytes);
        Ok(())
    }

    fn finish_line(&mut self) -> Result<(), SseError> {
        let line = std::mem::take(&mut self.line);
        if line.is_empty() {
            if let Some(data) = self.data.take() {
                self.ready.push_back(if data == DONE {
                    SseMessage::Done
                } else {
                    SseMessage::Data(data)
                });
            }
            return Ok(());
        }
        if line[0] == b':' {
            return Ok(());
        }
        let line = String::from_utf8(line).map_err(|_| SseError::InvalidUtf8)?;
        let (field, value) = match line.split_once(':') {
            Some((field, value)) => (field, value.strip_prefix(' ').unwrap_or(value)),
            None => (line.as_str(), ""),
        };
        if field == "data" {
            let data = self.data.get_or_insert_with(String::new);
            let joined_len = data.len() + usize::from(!data.is_empty()) + value.len();
            if joined_len > self.max_line {
                return Err(SseError::EventTooLong { max: self.max_line });
            }
            if !data.is_empty() {
                data.push('\n');
            }
            data.push_str(value);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode_all(decoder: &mut SseDecoder, bytes: &[u8]) -> Vec<SseMessage> {
        decoder.push(bytes).unwrap();
        std::iter::from_fn(|| decoder.next_message()).collect()
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
                SseMessage::Data("{\"a\":1}".into()),
                SseMessage::Data("{\"b\":2}".into()),
                SseMessage::Done
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
            SseMessage::Data("{\"x\":\"é\"}".into()),
            SseMessage::Data("two\nlines".into()),
            SseMessage::Done,
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

    #[test]
    fn unterminated_event_is_held_not_emitted() {
        let mut decoder = SseDecoder::default();
        assert!(decode_all(&mut decoder, b"data: {\"a\":1}\n").is_empty());
        assert_eq!(
            decode_all(&mut decoder, b"\n"),
            vec![SseMessage::Data("{\"a\":1}".into())]
        );
    }

    #[test]
    fn bounds_are_enforced() {
        let mut decoder = SseDecoder::new(16);
        assert_eq!(
            decoder.push(&[b'a'; 17]),
            Err(SseError::LineTooLong { max: 16 })
        );
        let mut decoder = SseDecoder::new(16);
        assert_eq!(
            decoder.push(b"data: 0123456789\ndata: 0123456789\n"),
            Err(SseError::EventTooLong { max: 16 })
        );
        let mut decoder = SseDecoder::new(16);
        assert_eq!(decoder.push(b"data: \xff\n"), Err(SseError::InvalidUtf8));
    }
}
