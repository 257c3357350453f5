//! Public trace replay: Mooncake's FAST'25 trace format (JSON Lines), sans-IO.
//!
//! Each line is one request: `timestamp` (milliseconds from the start of the trace),
//! `input_length` and `output_length` (tokens) and `hash_ids`, one id per 512-token block of
//! the prompt ([`TRACE_BLOCK_TOKENS`]; the last block may be partial). Equal ids at the same
//! position under the same earlier ids are the same tokens, so equal leading ids are a reusable
//! prefix. Two optional fields extend the format for closed-loop sessions: `session_id` (a
//! string or an integer) and `delay` (milliseconds): a request that is not its session's first
//! is sent `delay` after the previous request of the same session finishes, instead of at its
//! timestamp.
//!
//! [`Trace::parse`] validates the whole file up front (every error names its 1-based line),
//! [`Trace::scaled`] replays the arrival times faster or slower, [`PromptSynth`] turns a
//! record into prompt tokens whose prefix structure is the trace's (equal ids ⇒ equal
//! 512-token blocks, which engine blocks of 32 or 64 tokens tile exactly), and
//! [`Trace::oracle_prefix_hit_rate`] is the bound no cache can beat ([`PrefixOracle`]: the
//! same bound over the requests of a replay that finished so far).
//!
//! **Architecture invariant:** no I/O, no clock: the caller passes the file's text or bytes.
//!
//! ```
//! use nanotime::Nanos;
//! use workload::{PromptSynth, Trace};
//!
//! let trace = Trace::parse(
//!     "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 20, \"hash_ids\": [7, 8]}\n\
//!      {\"timestamp\": 250, \"input_length\": 1100, \"output_length\": 9, \"hash_ids\": [7, 9, 4]}\n",
//! )
//! .unwrap();
//! assert_eq!(trace.len(), 2);
//! // The second request reuses the first's first block: 512 of 1,700 input tokens.
//! assert!((trace.oracle_prefix_hit_rate() - 512.0 / 1700.0).abs() < 1e-12);
//!
//! let synth = PromptSynth::default();
//! let (a, b) = (trace.records()[0].prompt_tokens(&synth), trace.records()[1].prompt_tokens(&synth));
//! assert_eq!((a.len(), b.len()), (600, 1100));
//! assert_eq!(a[..512], b[..512]);
//! assert_ne!(a[512..544], b[512..544]);
//!
//! // Twice as fast: the second request arrives at 125 ms.
//! let times: Vec<Nanos> = trace.scaled(2.0).unwrap().map(|(at, _)| at).collect();
//! assert_eq!(times, [Nanos::ZERO, Nanos::from_millis(125)]);
//! ```

use std::ops::Range;

use nanotime::Nanos;
use rustc_hash::FxHashMap;
use serde::Deserialize;
use serde_json::{Number, Value};

/// Tokens per trace block: each of a record's `hash_ids` names 512 prompt tokens.
pub const TRACE_BLOCK_TOKENS: usize = 512;
/// The most requests a trace may hold.
pub const MAX_TRACE_REQUESTS: usize = 10_000_000;
/// The longest line a trace may hold, in bytes (the shipped trace's longest is about 2 KB).
pub const MAX_TRACE_LINE_BYTES: usize = 1 << 20;
/// The most input or output tokens one request may have (4 Mi).
pub const MAX_TRACE_TOKENS: u64 = 1 << 22;
/// The largest `timestamp` or `delay`, in milliseconds (about 31.7 years).
pub const MAX_TRACE_MILLIS: u64 = 1_000_000_000_000;

/// Why a trace, a speed factor or a prompt synthesizer was rejected.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TraceError {
    #[error("trace line {line}: {kind}")]
    Line { line: usize, kind: LineError },
    #[error("the trace has no requests")]
    Empty,
    #[error("invalid speed factor {0}: it must be finite and greater than 0")]
    InvalidSpeed(f64),
    #[error("invalid prompt vocabulary {start}..{end}: it needs at least {min} token ids")]
    InvalidVocab { start: u32, end: u32, min: u32 },
}

impl TraceError {
    /// The 1-based line the error is on, if it is about a line.
    pub fn line(&self) -> Option<usize> {
        match self {
            TraceError::Line { line, .. } => Some(*line),
            _ => None,
        }
    }
}

/// What is wrong with one line of a trace.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LineError {
    #[error("the line is {len} bytes, more than the limit of {max}")]
    TooLong { len: usize, max: usize },
    #[error("the line is not UTF-8")]
    NotUtf8,
    #[error("more than {max} requests")]
    TooManyRequests { max: usize },
    #[error("not a JSON object")]
    NotAnObject,
    #[error("not valid JSON: {message} at column {column}")]
    NotJson { message: String, column: usize },
    #[error("missing field `{0}`")]
    MissingField(&'static str),
    #[error("`{field}` is negative ({value})")]
    Negative { field: &'static str, value: String },
    #[error("`{field}` is not a whole number ({value})")]
    NotAnInteger { field: &'static str, value: String },
    #[error("`{field}` is {value}, more than the limit of {max}")]
    TooLarge {
        field: &'static str,
        value: String,
        max: u64,
    },
    #[error("`{0}` is 0; it must be at least 1")]
    Zero(&'static str),
    #[error("`hash_ids[{index}]` is {value}: not a non-negative integer below 2^64")]
    BadHashId { index: usize, value: String },
    #[error(
        "`hash_ids` has {hash_ids} ids but an input of {input_length} tokens has at most {max} \
         blocks of 512"
    )]
    TooManyHashIds {
        hash_ids: usize,
        input_length: u32,
        max: usize,
    },
    #[error("`timestamp` {timestamp_ms} ms is before the previous request's {previous_ms} ms")]
    TimestampBackwards {
        timestamp_ms: String,
        previous_ms: String,
    },
    #[error("`session_id` must be a string or an integer, not {0}")]
    BadSessionId(String),
    #[error("`delay` without `session_id`: a delay follows the previous request of a session")]
    DelayWithoutSession,
}

/// One request's place in a closed-loop session (the `session_id` / `delay` extension).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SessionStep {
    /// The session, numbered from 0 in order of first appearance; [`Trace::session_name`] gives
    /// the name the file used.
    pub session: usize,
    /// The index ([`TraceRecord::index`]) of the previous request of the same session; `None`
    /// for the session's first request, which is sent at its timestamp.
    pub previous: Option<usize>,
    /// How long after `previous` finishes this request is sent (`delay`; zero when absent). It
    /// has no effect on a session's first request. A replay at a speed factor scales it with
    /// [`Speed::scale`], like the timestamps.
    pub delay: Nanos,
}

/// One request of a trace (one line of the file).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceRecord {
    index: usize,
    line: usize,
    timestamp: Nanos,
    input_length: u32,
    output_length: u32,
    hash_ids: Vec<u64>,
    session: Option<SessionStep>,
}

impl TraceRecord {
    /// The request's position among the trace's requests, from 0.
    pub fn index(&self) -> usize {
        self.index
    }

    /// The 1-based line of the file the request is on.
    pub fn line(&self) -> usize {
        self.line
    }

    /// When the request arrived, from the start of the trace (recorded in milliseconds).
    pub fn timestamp(&self) -> Nanos {
        self.timestamp
    }

    /// Prompt length in tokens (at least 1).
    pub fn input_length(&self) -> u32 {
        self.input_length
    }

    /// Reply length in tokens (at least 1).
    pub fn output_length(&self) -> u32 {
        self.output_length
    }

    /// One id per 512-token block of the prompt; at most ⌈input_length / 512⌉ of them.
    pub fn hash_ids(&self) -> &[u64] {
        &self.hash_ids
    }

    /// The request's closed-loop session, if the line had a `session_id`.
    pub fn session(&self) -> Option<SessionStep> {
        self.session
    }

    /// The request's prompt tokens: see [`PromptSynth::prompt_tokens`].
    pub fn prompt_tokens(&self, synth: &PromptSynth) -> Vec<u32> {
        synth.prompt_tokens(self)
    }
}

/// A parsed, validated trace: at least one request, timestamps in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Trace {
    records: Vec<TraceRecord>,
    session_names: Vec<String>,
}

/// The fields of one line, before validation. `Option`s so that a missing field is reported
/// by name; `Number`s so that a negative or fractional value is reported as such.
#[derive(Deserialize)]
struct RawRecord {
    timestamp: Option<Number>,
    input_length: Option<Number>,
    output_length: Option<Number>,
    hash_ids: Option<Vec<Number>>,
    session_id: Option<Value>,
    delay: Option<Number>,
}

/// A non-negative whole number, or why `n` is not one.
fn whole(field: &'static str, n: &Number) -> Result<u64, LineError> {
    if let Some(v) = n.as_u64() {
        return Ok(v);
    }
    let value = n.to_string();
    let f = n.as_f64().unwrap_or(f64::NAN);
    if n.is_i64() || f < 0.0 {
        Err(LineError::Negative { field, value })
    } else if f.fract() != 0.0 || !f.is_finite() {
        Err(LineError::NotAnInteger { field, value })
    } else if f < 18_446_744_073_709_551_616.0 {
        // A whole number written as a float (`600.0`, `-0.0`).
        Ok(f as u64)
    } else {
        // A whole number too large for u64 (serde_json reads it as a float).
        Err(LineError::TooLarge {
            field,
            value,
            max: u64::MAX,
        })
    }
}

/// A token count in 1..=MAX_TRACE_TOKENS.
fn tokens(field: &'static str, n: &Number) -> Result<u32, LineError> {
    let v = whole(field, n)?;
    if v == 0 {
        return Err(LineError::Zero(field));
    }
    if v > MAX_TRACE_TOKENS {
        return Err(LineError::TooLarge {
            field,
            value: n.to_string(),
            max: MAX_TRACE_TOKENS,
        });
    }
    Ok(v as u32)
}

/// Milliseconds (a whole or fractional number in 0..=MAX_TRACE_MILLIS) as `Nanos`.
fn millis(field: &'static str, n: &Number) -> Result<Nanos, LineError> {
    let too_large = || LineError::TooLarge {
        field,
        value: n.to_string(),
        max: MAX_TRACE_MILLIS,
    };
    if let Some(ms) = n.as_u64() {
        return if ms > MAX_TRACE_MILLIS {
            Err(too_large())
        } else {
            Ok(Nanos::from_millis(ms))
        };
    }
    let ms = n.as_f64().unwrap_or(f64::NAN);
    if n.is_i64() || ms < 0.0 {
        Err(LineError::Negative {
            field,
            value: n.to_string(),
        })
    } else if !ms.is_finite() || ms > MAX_TRACE_MILLIS as f64 {
        Err(too_large())
    } else {
        Ok(Nanos((ms * 1e6).round() as u64))
    }
}

fn ms_string(t: Nanos) -> String {
    let ns = t.as_nanos();
    if ns % 1_000_000 == 0 {
        (ns / 1_000_000).to_string()
    } else {
        format!("{}", t.as_millis_f64())
    }
}

/// Per-session state while parsing: the session's number and its latest request.
struct OpenSession {
    session: usize,
    last: usize,
}

impl Trace {
    /// Parses a trace in Mooncake's JSONL format (see the module docs). Blank lines are
    /// skipped; `\r\n` line ends are accepted; unknown fields are ignored. Every error names
    /// the 1-based line it is on.
    pub fn parse(text: &str) -> Result<Trace, TraceError> {
        Self::parse_bytes(text.as_bytes())
    }

    /// [`Trace::parse`] on raw bytes, as read from a file: a line that is not UTF-8 is an error
    /// naming that line.
    pub fn parse_bytes(bytes: &[u8]) -> Result<Trace, TraceError> {
        Self::parse_limited(bytes, MAX_TRACE_REQUESTS)
    }

    fn parse_limited(bytes: &[u8], max_requests: usize) -> Result<Trace, TraceError> {
        let mut records: Vec<TraceRecord> = Vec::new();
        let mut session_names: Vec<String> = Vec::new();
        let mut sessions: FxHashMap<String, OpenSession> = FxHashMap::default();
        for (i, raw) in bytes.split(|&b| b == b'\n').enumerate() {
            let line = i + 1;
            let at = |kind| TraceError::Line { line, kind };
            if raw.len() > MAX_TRACE_LINE_BYTES {
                return Err(at(LineError::TooLong {
                    len: raw.len(),
                    max: MAX_TRACE_LINE_BYTES,
                }));
            }
            let text = std::str::from_utf8(raw).map_err(|_| at(LineError::NotUtf8))?;
            let text = text.trim();
            if text.is_empty() {
                continue;
            }
            if records.len() == max_requests {
                return Err(at(LineError::TooManyRequests { max: max_requests }));
            }
            let record = Self::parse_line(
                text,
                line,
                records.len(),
                records.last(),
                &mut sessions,
                &mut session_names,
            )
            .map_err(at)?;
            records.push(record);
        }
        if records.is_empty() {
            return Err(TraceError::Empty);
        }
        Ok(Trace {
            records,
            session_names,
        })
    }

    fn parse_line(
        text: &str,
        line: usize,
        index: usize,
        previous: Option<&TraceRecord>,
        sessions: &mut FxHashMap<String, OpenSession>,
        session_names: &mut Vec<String>,
    ) -> Result<TraceRecord, LineError> {
        // serde would also read a JSON array positionally into the struct.
        if !text.starts_with('{') {
            return Err(LineError::NotAnObject);
        }
        let raw: RawRecord = serde_json::from_str(text).map_err(|e| {
            let full = e.to_string();
            let suffix = format!(" at line {} column {}", e.line(), e.column());
            let message = full.strip_suffix(&suffix).unwrap_or(&full).to_string();
            LineError::NotJson {
                message,
                column: e.column(),
            }
        })?;
        let get = |field: &'static str, v: Option<Number>| v.ok_or(LineError::MissingField(field));

        let timestamp = millis("timestamp", &get("timestamp", raw.timestamp)?)?;
        let input_length = tokens("input_length", &get("input_length", raw.input_length)?)?;
        let output_length = tokens("output_length", &get("output_length", raw.output_length)?)?;
        let ids = raw.hash_ids.ok_or(LineError::MissingField("hash_ids"))?;
        let max = (input_length as usize).div_ceil(TRACE_BLOCK_TOKENS);
        if ids.len() > max {
            return Err(LineError::TooManyHashIds {
                hash_ids: ids.len(),
                input_length,
                max,
            });
        }
        let hash_ids = ids
            .iter()
            .enumerate()
            .map(|(index, n)| {
                n.as_u64().ok_or_else(|| LineError::BadHashId {
                    index,
                    value: n.to_string(),
                })
            })
            .collect::<Result<Vec<u64>, _>>()?;
        if let Some(prev) = previous.filter(|prev| timestamp < prev.timestamp) {
            return Err(LineError::TimestampBackwards {
                timestamp_ms: ms_string(timestamp),
                previous_ms: ms_string(prev.timestamp),
            });
        }

        let delay = raw.delay.map(|d| millis("delay", &d)).transpose()?;
        let session = match raw.session_id {
            None | Some(Value::Null) => {
                if delay.is_some() {
                    return Err(LineError::DelayWithoutSession);
                }
                None
            }
            Some(id) => {
                let name = match id {
                    Value::String(s) => s,
                    Value::Number(n) if n.is_u64() || n.is_i64() => n.to_string(),
                    other => return Err(LineError::BadSessionId(other.to_string())),
                };
                let step = match sessions.get_mut(&name) {
                    Some(open) => {
                        let previous = Some(open.last);
                        open.last = index;
                        SessionStep {
                            session: open.session,
                            previous,
                            delay: Nanos::ZERO,
                        }
                    }
                    None => {
                        let session = session_names.len();
                        session_names.push(name.clone());
                        sessions.insert(
                            name,
                            OpenSession {
                                session,
                                last: index,
                            },
                        );
                        SessionStep {
                            session,
                            previous: None,
                            delay: Nanos::ZERO,
                        }
                    }
                };
                Some(SessionStep {
                    delay: delay.unwrap_or(Nanos::ZERO),
                    ..step
                })
            }
        };

        Ok(TraceRecord {
            index,
            line,
            timestamp,
            input_length,
            output_length,
            hash_ids,
            session,
        })
    }

    /// The requests, in file order (which is timestamp order).
    pub fn records(&self) -> &[TraceRecord] {
        &self.records
    }

    /// How many requests the trace has (at least 1).
    pub fn len(&self) -> usize {
        self.records.len()
    }

    /// Always false: a parsed trace has at least one request.
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// The last request's timestamp.
    pub fn duration(&self) -> Nanos {
        self.records.last().map_or(Nanos::ZERO, |r| r.timestamp)
    }

    /// The sum of the requests' input lengths.
    pub fn total_input_tokens(&self) -> u64 {
        self.records.iter().map(|r| u64::from(r.input_length)).sum()
    }

    /// The sum of the requests' output lengths.
    pub fn total_output_tokens(&self) -> u64 {
        self.records
            .iter()
            .map(|r| u64::from(r.output_length))
            .sum()
    }

    /// How many distinct `session_id`s the trace has (0 for a pure open-loop trace).
    pub fn session_count(&self) -> usize {
        self.session_names.len()
    }

    /// The `session_id` that session number `session` ([`SessionStep::session`]) had in the
    /// file (an integer id as its decimal digits).
    pub fn session_name(&self, session: usize) -> Option<&str> {
        self.session_names.get(session).map(String::as_str)
    }

    /// Input tokens that an infinite cache shared by all workers, starting empty, could serve,
    /// in the trace's own 512-token blocks: [`PrefixOracle`] with every request finished. Each
    /// token of a block (a node of the trace's block chains: the same ids at the same
    /// positions) is computed once, by its first visitor, and served to every later one; the
    /// tokens a block's visits cover minus the most one visit covers (only a partial last
    /// block covers fewer than 512). That does not depend on the order a server saw the
    /// requests in, and where a block's visits cover it alike (the shipped trace's all do) it
    /// is the file-order count: for each request, the longest prefix of its `hash_ids` an
    /// earlier request had, times 512, capped at its input length.
    pub fn oracle_prefix_hit_tokens(&self) -> u64 {
        let mut oracle = PrefixOracle::default();
        for r in &self.records {
            oracle.sent(r);
            oracle.finished(r);
        }
        oracle.hit_tokens()
    }

    /// [`Trace::oracle_prefix_hit_tokens`] over the total input tokens: the prefix-hit rate no
    /// router or cache can beat on this trace (about 37% on the shipped conversation trace).
    pub fn oracle_prefix_hit_rate(&self) -> f64 {
        let total = self.total_input_tokens();
        if total == 0 {
            0.0
        } else {
            self.oracle_prefix_hit_tokens() as f64 / total as f64
        }
    }

    /// The trace's first `n` requests (all of them when `n` is at least [`Trace::len`]); `None`
    /// when `n` is 0, since a trace has at least one request. A session keeps the requests
    /// that fall inside, so the slice replays as the start of the whole trace.
    pub fn first(&self, n: usize) -> Option<Trace> {
        if n == 0 {
            return None;
        }
        let records = self.records[..n.min(self.records.len())].to_vec();
        // Sessions are numbered in order of first appearance, so those seen in the slice are
        // a prefix of the names.
        let sessions = records
            .iter()
            .filter_map(|r| r.session.map(|s| s.session + 1))
            .max()
            .unwrap_or(0);
        Some(Trace {
            records,
            session_names: self.session_names[..sessions].to_vec(),
        })
    }

    /// The requests with their arrival times divided by `speed` (2.0 replays twice as fast).
    /// `speed` must be finite and greater than 0.
    pub fn scaled(&self, speed: f64) -> Result<Scaled<'_>, TraceError> {
        Ok(self.scaled_by(Speed::new(speed)?))
    }

    /// [`Trace::scaled`] with an already validated [`Speed`].
    pub fn scaled_by(&self, speed: Speed) -> Scaled<'_> {
        Scaled {
            records: self.records.iter(),
            speed,
        }
    }
}

/// The oracle's prefix-hit bound over the requests of a replay that finished so far, whatever
/// order the server saw them in ([`Trace::oracle_prefix_hit_tokens`] is its whole-trace case).
///
/// An infinite cache shared by all workers, starting empty, serves every visit of a block's
/// tokens but the first (a block: a node of the trace's block chains, the same ids at the same
/// positions). Mid-replay, the first visit of a block that a finished request has may be a
/// request's still in flight, or one's that failed; and requests sent at the same instant
/// reach the server in any order. So a finished request's visit of a block counts whole as a
/// possible hit, less, per block, the tokens known to have been computed by a finished
/// visitor: once every visitor sent finished, the most one visit covers (only a partial last
/// block covers fewer than 512); before, those of the first visitor to finish, if every
/// visitor sent before it finished has finished too (one sent later cannot have been first).
/// Once every request sent finished, that is exactly [`Trace::oracle_prefix_hit_tokens`] over
/// them; at any time it is at least what any order of serving them could give, so a server
/// whose cache started empty cannot report more.
///
/// The driver reports each request it sends ([`PrefixOracle::sent`], once), and each that
/// finished with its usage reported ([`PrefixOracle::finished`]); a request that failed, was
/// cancelled or reported no usage stays sent. Bounded: one node per distinct block chain of
/// the requests sent and one entry per request sent and not finished, both at most the
/// trace's.
#[derive(Debug, Clone, Default)]
pub struct PrefixOracle {
    /// A trie of block chains: (parent node, id) → node; node 0 is the empty prefix, node `n`
    /// is `blocks[n - 1]`.
    children: FxHashMap<(u64, u64), u64>,
    blocks: Vec<BlockVisits>,
    /// Each request sent and not finished ([`TraceRecord::index`]): when it was sent.
    in_flight: FxHashMap<usize, u64>,
    /// Calls so far: the order of sends and finishes.
    events: u64,
    /// Σ, over the finished requests' visits, of the tokens each covers.
    finished_block_tokens: u64,
    /// Σ [`BlockVisits::computed_by_finished`]: tokens no cache served a finished request.
    computed_by_finished: u64,
    finished_requests: u64,
    finished_input_tokens: u64,
}

/// Who visited one block of the trie.
#[derive(Debug, Clone, Copy, Default)]
struct BlockVisits {
    sent: u32,
    finished: u32,
    /// The most tokens a finished visit covered.
    most_tokens: u32,
    first_finish: Option<FirstFinish>,
}

/// The first visitor of a block to finish.
#[derive(Debug, Clone, Copy)]
struct FirstFinish {
    at: u64,
    /// The tokens its visit covered.
    tokens: u32,
    /// Visitors sent before it finished that have not finished: one of them may have been
    /// first at the block.
    sent_before_in_flight: u32,
}

impl BlockVisits {
    /// Tokens of the block that a finished visitor must have computed (and was not served).
    fn computed_by_finished(&self) -> u32 {
        match self.first_finish {
            _ if self.finished > 0 && self.finished == self.sent => self.most_tokens,
            Some(first) if first.sent_before_in_flight == 0 => first.tokens,
            _ => 0,
        }
    }
}

impl PrefixOracle {
    /// The tokens of `record`'s block at `depth` (512, or fewer for a partial last block).
    fn block_tokens(record: &TraceRecord, depth: usize) -> u32 {
        let before = depth.saturating_mul(TRACE_BLOCK_TOKENS);
        (record.input_length as usize)
            .saturating_sub(before)
            .min(TRACE_BLOCK_TOKENS) as u32
    }

    /// Applies `update` to a block, keeping [`PrefixOracle::computed_by_finished`] its sum.
    fn update(&mut self, node: u64, update: impl FnOnce(&mut BlockVisits)) {
        let block = &mut self.blocks[(node - 1) as usize];
        self.computed_by_finished -= u64::from(block.computed_by_finished());
        update(block);
        self.computed_by_finished += u64::from(block.computed_by_finished());
    }

    /// `record` was sent: its blocks have one more visitor that may be the first there.
    pub fn sent(&mut self, record: &TraceRecord) {
        self.events += 1;
        self.in_flight.insert(record.index, self.events);
        let mut node = 0u64;
        for &id in &record.hash_ids {
            let next = self.blocks.len() as u64 + 1;
            node = *self.children.entry((node, id)).or_insert(next);
            if node == next {
                self.blocks.push(BlockVisits::default());
            }
            self.update(node, |block| block.sent = block.sent.saturating_add(1));
        }
    }

    /// `record`, sent before, finished and its usage was reported: it joins the requests the
    /// bound is over. A request never sent, or reported twice, is ignored.
    pub fn finished(&mut self, record: &TraceRecord) {
        // A driver's mistake (finished twice, or never sent) changes nothing.
        let Some(sent_at) = self.in_flight.remove(&record.index) else {
            return;
        };
        self.events += 1;
        let now = self.events;
        self.finished_requests += 1;
        self.finished_input_tokens += u64::from(record.input_length);
        let mut node = 0u64;
        for (depth, &id) in record.hash_ids.iter().enumerate() {
            // Every block of a request sent is in the trie.
            let Some(&child) = self.children.get(&(node, id)) else {
                return;
            };
            node = child;
            let tokens = Self::block_tokens(record, depth);
            self.finished_block_tokens += u64::from(tokens);
            self.update(node, |block| {
                block.finished += 1;
                block.most_tokens = block.most_tokens.max(tokens);
                match &mut block.first_finish {
                    None => {
                        block.first_finish = Some(FirstFinish {
                            at: now,
                            tokens,
                            sent_before_in_flight: block.sent.saturating_sub(block.finished),
                        })
                    }
                    Some(first) if sent_at < first.at => {
                        first.sent_before_in_flight = first.sent_before_in_flight.saturating_sub(1)
                    }
                    Some(_) => {}
                }
            });
        }
    }

    /// The most prompt tokens of the finished requests a cache could have served.
    pub fn hit_tokens(&self) -> u64 {
        self.finished_block_tokens - self.computed_by_finished
    }

    /// How many requests finished.
    pub fn finished_requests(&self) -> u64 {
        self.finished_requests
    }

    /// The finished requests' input tokens (their records' `input_length`s).
    pub fn finished_input_tokens(&self) -> u64 {
        self.finished_input_tokens
    }

    /// [`PrefixOracle::hit_tokens`] over [`PrefixOracle::finished_input_tokens`]; `None`
    /// before a request finished.
    pub fn hit_rate(&self) -> Option<f64> {
        (self.finished_input_tokens > 0)
            .then(|| self.hit_tokens() as f64 / self.finished_input_tokens as f64)
    }
}

/// A replay speed factor: finite and greater than 0; times are divided by it.
#[derive(Debug, Clone, Copy, PartialEq, PartialOrd)]
pub struct Speed(f64);

impl Speed {
    /// The recorded times, unchanged.
    pub const REAL_TIME: Speed = Speed(1.0);

    pub fn new(factor: f64) -> Result<Speed, TraceError> {
        if factor.is_finite() && factor > 0.0 {
            Ok(Speed(factor))
        } else {
            Err(TraceError::InvalidSpeed(factor))
        }
    }

    pub fn factor(self) -> f64 {
        self.0
    }

    /// `t` divided by the factor, rounded to the nanosecond (saturating at `Nanos::MAX`).
    pub fn scale(self, t: Nanos) -> Nanos {
        if self.0 == 1.0 {
            t
        } else {
            // `as` saturates: a tiny factor gives Nanos::MAX, not a wrap.
            Nanos((t.as_nanos() as f64 / self.0).round() as u64)
        }
    }
}

impl Default for Speed {
    fn default() -> Self {
        Speed::REAL_TIME
    }
}

/// The iterator [`Trace::scaled`] returns: `(arrival time at the speed factor, request)`.
#[derive(Debug, Clone)]
pub struct Scaled<'a> {
    records: std::slice::Iter<'a, TraceRecord>,
    speed: Speed,
}

impl<'a> Iterator for Scaled<'a> {
    type Item = (Nanos, &'a TraceRecord);

    fn next(&mut self) -> Option<Self::Item> {
        self.records
            .next()
            .map(|r| (self.speed.scale(r.timestamp), r))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.records.size_hint()
    }
}

impl ExactSizeIterator for Scaled<'_> {}

/// Turns trace records into prompt tokens whose prefix structure is the trace's.
///
/// Block `i` of a prompt (tokens `512·i .. 512·(i+1)`, cut at the input length) is the start
/// of a pseudo-random stream keyed by `hash_ids[i]` alone (and the seed), so equal ids give
/// equal blocks, a shorter last block is a prefix of a longer one, and distinct ids give
/// distinct blocks: the stream's first 64-bit draw is a bijection of the id, so two ids'
/// first tokens collide only by the reduction to the vocabulary, and a 32-token engine block
/// collides with probability about `vocab^-32`. Tokens beyond the hashed blocks (when a record
/// has fewer than ⌈input_length / 512⌉ ids) come from a stream keyed by the request's index,
/// in a separate domain, so they are never a false hit. Engine blocks of 32 or 64 tokens tile
/// the 512-token blocks exactly, so an engine sees the trace's reusable prefixes.
///
/// Nothing is cached: a block is 512 SplitMix64 draws, cheaper to regenerate than to look up.
/// The token ids come from `vocab` (by default 1,000..128,000, clear of the low ids and the
/// special tokens at the top of Llama-3's vocabulary).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptSynth {
    seed: u64,
    vocab: Range<u32>,
}

/// Domain tags that keep block streams and tail streams apart.
const BLOCK_DOMAIN: u64 = 0x6b76_726f_7574_6531; // "kvroute1"
const TAIL_DOMAIN: u64 = 0x7461_696c_7374_726d; // "tailstrm"
const REPLY_DOMAIN: u64 = 0x7265_706c_7973_746d; // "replystm"
const GOLDEN_GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// SplitMix64's finalizer: a bijection on u64 with good avalanche.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl PromptSynth {
    /// The default vocabulary range.
    pub const DEFAULT_VOCAB: Range<u32> = 1_000..128_000;
    /// The fewest token ids a vocabulary may have.
    pub const MIN_VOCAB: u32 = 256;

    /// A synthesizer drawing token ids from `vocab` (at least [`PromptSynth::MIN_VOCAB`] ids);
    /// different seeds give different tokens with the same prefix structure.
    pub fn new(seed: u64, vocab: Range<u32>) -> Result<PromptSynth, TraceError> {
        if vocab.end < vocab.start || vocab.end - vocab.start < Self::MIN_VOCAB {
            return Err(TraceError::InvalidVocab {
                start: vocab.start,
                end: vocab.end,
                min: Self::MIN_VOCAB,
            });
        }
        Ok(PromptSynth { seed, vocab })
    }

    pub fn seed(&self) -> u64 {
        self.seed
    }

    pub fn vocab(&self) -> Range<u32> {
        self.vocab.clone()
    }

    /// Appends the first `n` tokens of the stream keyed by (`domain`, `key`).
    fn stream(&self, domain: u64, key: u64, n: usize, out: &mut Vec<u32>) {
        let span = u64::from(self.vocab.end - self.vocab.start);
        let mut state = mix64(mix64(self.seed ^ domain) ^ key);
        out.extend((0..n).map(|_| {
            state = state.wrapping_add(GOLDEN_GAMMA);
            let x = mix64(state);
            // Lemire's multiply-shift: the top bits of x pick the token, with negligible bias.
            self.vocab.start + ((u128::from(x) * u128::from(span)) >> 64) as u32
        }));
    }

    /// Appends the first `n` tokens (at most 512) of the block for trace hash id `hash_id`.
    pub fn block_into(&self, hash_id: u64, n: usize, out: &mut Vec<u32>) {
        self.stream(BLOCK_DOMAIN, hash_id, n.min(TRACE_BLOCK_TOKENS), out);
    }

    /// The 512 tokens of the block for trace hash id `hash_id`.
    pub fn block(&self, hash_id: u64) -> Vec<u32> {
        let mut out = Vec::with_capacity(TRACE_BLOCK_TOKENS);
        self.block_into(hash_id, TRACE_BLOCK_TOKENS, &mut out);
        out
    }

    /// `record`'s prompt: `input_length` tokens, block `i` from `hash_ids[i]`, the rest unique
    /// to the request (keyed by [`TraceRecord::index`]).
    pub fn prompt_tokens(&self, record: &TraceRecord) -> Vec<u32> {
        let mut out = Vec::with_capacity(record.input_length as usize);
        self.prompt_tokens_into(record, &mut out);
        out
    }

    /// `record`'s reply: `output_length` tokens unique to the request (keyed by
    /// [`TraceRecord::index`], in a domain of their own), for a simulated engine to generate.
    pub fn reply_tokens(&self, record: &TraceRecord) -> Vec<u32> {
        let mut out = Vec::with_capacity(record.output_length as usize);
        self.stream(
            REPLY_DOMAIN,
            record.index as u64,
            record.output_length as usize,
            &mut out,
        );
        out
    }

    /// [`PromptSynth::prompt_tokens`] appended to `out` (to reuse a buffer).
    pub fn prompt_tokens_into(&self, record: &TraceRecord, out: &mut Vec<u32>) {
        let len = record.input_length as usize;
        let mut left = len;
        for &id in &record.hash_ids {
            if left == 0 {
                break;
            }
            let n = left.min(TRACE_BLOCK_TOKENS);
            self.block_into(id, n, out);
            left -= n;
        }
        self.stream(TAIL_DOMAIN, record.index as u64, left, out);
    }
}

impl Default for PromptSynth {
    /// Seed 0, [`PromptSynth::DEFAULT_VOCAB`].
    fn default() -> Self {
        PromptSynth {
            seed: 0,
            vocab: Self::DEFAULT_VOCAB,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_request_count_is_bounded() {
        let line =
            "{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": []}";
        let text = format!("{line}\n\n{line}\n{line}\n\n");
        assert_eq!(Trace::parse_limited(text.as_bytes(), 3).unwrap().len(), 3);
        let text = format!("{text}{line}\n");
        assert_eq!(
            Trace::parse_limited(text.as_bytes(), 3).unwrap_err(),
            TraceError::Line {
                line: 6,
                kind: LineError::TooManyRequests { max: 3 }
            }
        );
    }
}
