//! vLLM's KV events over ZMQ: `KVEventBatch` in msgpack, as `msgspec` encodes it.
//!
//! vLLM's publisher sends multipart messages `(topic, seq, payload)`: `seq` is the batch's
//! sequence number as 8 bytes big-endian, `payload` a msgpack `KVEventBatch`. Depending on the
//! vLLM version, `msgspec` encodes the structs as arrays (`array_like=True`, the tag first) or
//! as maps with a `"type"` tag, and newer versions append fields. This module decodes all of
//! them:
//!
//! ```text
//! batch   [ts, [event…], data_parallel_rank?, …]  |  {"ts", "events", "data_parallel_rank"?}
//! stored  ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
//!          lora_id?, medium?, lora_name?, …]
//!         | {"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids",
//!            "block_size", "lora_id"?, "medium"?, "lora_name"?, …}
//! removed ["BlockRemoved", block_hashes, medium?, …] | {"type": "BlockRemoved", …}
//! cleared ["AllBlocksCleared"] | {"type": "AllBlocksCleared"}
//! ```
//!
//! Block hashes are integers (older vLLM: Python `hash`, possibly negative) or bytes (newer:
//! SHA-256). They only *name* blocks, for parent links and removals
//! ([`ExternalBlockHash::engine_block_id`]); the receiver recomputes its own hashes from the
//! token ids, so vLLM's hash function never matters.
//!
//! [`VllmEventBatch::encode`] writes either form for our engine server ([`EventEncoding`]):
//! tagged maps inside the batch array, as current vLLM sends and vllm-router reads, or
//! arrays throughout, as earlier vLLM sent.
//! [`VllmEventStream`] turns one worker's frames into [`kv_index::KvEvent`]s and watches the
//! batch sequence numbers for gaps and restarts.
//!
//! Newer vLLM (main since the `extra_keys`/`group_idx` fields, e.g. vllm-project/vllm at
//! 0181ea3) drops `array_like` from the batch too, so the whole batch arrives as a map; both
//! are read. A `BlockStored` whose `extra_keys` name anything (multimodal inputs, a LoRA, a
//! `cache_salt`) is skipped: its engine hash covers more than the tokens we hash.
//!
//! # SGLang
//!
//! SGLang's publisher (`python/sglang/srt/disaggregation/kv_events.py`, `--kv-events-config
//! '{"publisher": "zmq", "endpoint": …, "replay_endpoint": …, "topic": …}'`) is a port of
//! vLLM's: the same multipart `(topic, seq, payload)` frames, the same replay socket, and the
//! same msgspec structs with `array_like=True`. Its frames are wire-compatible with vLLM's
//! array form, so this one decoder reads both, telling them apart by the layout where they
//! differ (see `tests/sglang_frames.rs`):
//!
//! ```text
//! batch   [ts, [event…]]                        (sgl-project/sglang at 006d053)
//!         [ts, [event…], attn_dp_rank]          (later, e.g. main as forked in
//!                                                 amdpilot-org/sglang at a029c21: the
//!                                                 same slot as vLLM's rank)
//! stored  ["BlockStored", [hash], parent, token_ids, block_size, lora_id]
//!         ["BlockStored", [hash], parent, token_ids, block_size, lora_id, medium]
//!         ["BlockStored", …, medium, {"cache_salt": s}]   (BlockStoredWithMetadata)
//! removed ["BlockRemoved", [hash]] | ["BlockRemoved", [hash], medium]
//! ```
//!
//! Where SGLang differs: one `BlockStored` per page (`block_size` is `--page-size`, 1 by
//! default: start SGLang with the router's block size as its page size); hashes are signed
//! 64-bit integers (older versions Python's `hash` of the page's tokens alone, so two prefixes
//! sharing a page share an id; later ones the first 8 bytes of a SHA-256 chained from the
//! parent page: `compute_node_hash_values` and `hash_str_to_int64`); `medium` is `GPU`,
//! `CPU_PINNED`, `DISK` or `EXTERNAL` (only `GPU` is used); no `lora_name`, and the 8th slot
//! of a salted block is a metadata map whose `cache_salt` makes the block skipped here (a
//! request without that salt cannot reuse it).

use std::fmt;

use kv_index::{BlockContent, EngineBlockId, KvEvent, KvEventKind, StoredBlock, WorkerId};
use rmpv::Value;
use thiserror::Error;

/// Deepest msgpack nesting accepted (a batch is 4 deep; extra fields may add a few levels).
const MAX_DEPTH: usize = 32;

/// A block hash as vLLM sends it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ExternalBlockHash {
    /// An integer hash; negative values (Python's `hash`) are kept as their two's complement.
    Int(u64),
    /// A byte-string hash (SHA-256 in recent vLLM).
    Bytes(Vec<u8>),
}

impl ExternalBlockHash {
    /// The id the index uses for this block: the integer itself, or XXH3-64 of the bytes.
    pub fn engine_block_id(&self) -> EngineBlockId {
        match self {
            ExternalBlockHash::Int(id) => EngineBlockId(*id),
            ExternalBlockHash::Bytes(bytes) => {
                EngineBlockId(xxhash_rust::xxh3::xxh3_64(bytes.as_slice()))
            }
        }
    }

    fn to_value(&self) -> Value {
        match self {
            ExternalBlockHash::Int(id) => Value::from(*id),
            ExternalBlockHash::Bytes(bytes) => Value::Binary(bytes.clone()),
        }
    }
}

/// `BlockStored`: a run of consecutive full blocks entered the cache.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockStored {
    pub block_hashes: Vec<ExternalBlockHash>,
    /// The first block's parent (`None`: the first block of a prompt).
    pub parent_block_hash: Option<ExternalBlockHash>,
    /// The blocks' tokens, `block_size` per block, concatenated.
    pub token_ids: Vec<u32>,
    pub block_size: u32,
    pub lora_id: Option<i64>,
    /// `"GPU"` or `None` for the GPU cache; other tiers (`"CPU"`, disk) are offload copies.
    pub medium: Option<String>,
    pub lora_name: Option<String>,
    /// SGLang's `metadata.cache_salt`: the block is reused only by requests with this salt.
    pub cache_salt: Option<String>,
    /// vLLM's `extra_keys` name something for some block (multimodal input, LoRA, salt).
    pub has_extra_keys: bool,
}

/// `BlockRemoved`: these blocks left the cache.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockRemoved {
    pub block_hashes: Vec<ExternalBlockHash>,
    pub medium: Option<String>,
}

/// One event of a batch.
#[derive(Debug, Clone, PartialEq)]
pub enum VllmEvent {
    BlockStored(BlockStored),
    BlockRemoved(BlockRemoved),
    AllBlocksCleared,
    /// An event type this decoder does not know (a newer vLLM); kept by name, ignored by
    /// [`VllmEventStream`].
    Unknown(String),
}

/// `KVEventBatch`.
#[derive(Debug, Clone, PartialEq)]
pub struct VllmEventBatch {
    /// Seconds since the Unix epoch when the batch was made.
    pub ts: f64,
    pub events: Vec<VllmEvent>,
    pub data_parallel_rank: Option<i64>,
}

/// One multipart ZMQ message.
#[derive(Debug, Clone, PartialEq)]
pub struct VllmFrame {
    pub topic: Vec<u8>,
    /// The batch's sequence number (per publisher, from 0).
    pub seq: u64,
    pub batch: VllmEventBatch,
}

/// A frame or payload that is not a vLLM KV event batch.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum VllmDecodeError {
    #[error("expected a 3-part ZMQ message (topic, seq, payload), got {0} parts")]
    Parts(usize),
    #[error("the sequence part must be 8 bytes (big-endian), got {0}")]
    SeqLength(usize),
    #[error("payload is not msgpack: {0}")]
    Msgpack(String),
    #[error("payload has {0} bytes after the batch")]
    TrailingBytes(usize),
    #[error("{path}: {problem}")]
    Shape { path: String, problem: String },
}

fn shape(path: impl fmt::Display, problem: impl fmt::Display) -> VllmDecodeError {
    VllmDecodeError::Shape {
        path: path.to_string(),
        problem: problem.to_string(),
    }
}

/// Reads an 8-byte big-endian sequence number.
pub fn decode_seq(bytes: &[u8]) -> Result<u64, VllmDecodeError> {
    let array: [u8; 8] = bytes
        .try_into()
        .map_err(|_| VllmDecodeError::SeqLength(bytes.len()))?;
    Ok(u64::from_be_bytes(array))
}

/// Decodes one multipart message `(topic, seq, payload)`.
pub fn decode_multipart<B: AsRef<[u8]>>(parts: &[B]) -> Result<VllmFrame, VllmDecodeError> {
    let [topic, seq, payload] = parts else {
        return Err(VllmDecodeError::Parts(parts.len()));
    };
    Ok(VllmFrame {
        topic: topic.as_ref().to_vec(),
        seq: decode_seq(seq.as_ref())?,
        batch: VllmEventBatch::decode(payload.as_ref())?,
    })
}

/// How a publisher writes each event inside the batch (the batch itself is always the
/// positional array `[ts, events, data_parallel_rank]`, as every vLLM version sends it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EventEncoding {
    /// `{"type": "BlockStored", "block_hashes": …}`: current vLLM; the only form vllm-router's
    /// `kv_aware` policy decodes.
    #[default]
    TaggedMap,
    /// `["BlockStored", block_hashes, …]`: earlier vLLM (`array_like=True` events).
    Array,
}

/// The three parts vLLM's publisher sends for `batch`.
pub fn encode_multipart(
    topic: &[u8],
    seq: u64,
    batch: &VllmEventBatch,
    encoding: EventEncoding,
) -> [Vec<u8>; 3] {
    [
        topic.to_vec(),
        seq.to_be_bytes().to_vec(),
        batch.encode(encoding),
    ]
}

/// A msgspec struct, seen either as an array (fields by position) or a map (by name).
enum Fields<'a> {
    Array(&'a [Value]),
    Map(&'a [(Value, Value)]),
}

impl<'a> Fields<'a> {
    /// Field `name`, at `position` in the array form; `None` when absent (or trailing-omitted).
    fn get(&self, position: usize, name: &str) -> Option<&'a Value> {
        match self {
            Fields::Array(items) => items.get(position),
            Fields::Map(entries) => entries
                .iter()
                .find(|(key, _)| key.as_str() == Some(name))
                .map(|(_, value)| value),
        }
    }

    fn required(
        &self,
        position: usize,
        name: &str,
        path: &str,
    ) -> Result<&'a Value, VllmDecodeError> {
        self.get(position, name)
            .ok_or_else(|| shape(format!("{path}.{name}"), "missing"))
    }
}

fn as_u32(value: &Value, path: &str) -> Result<u32, VllmDecodeError> {
    value
        .as_u64()
        .and_then(|v| u32::try_from(v).ok())
        .ok_or_else(|| shape(path, format!("expected an integer in 0..2^32, got {value}")))
}

fn opt_i64(value: Option<&Value>, path: &str) -> Result<Option<i64>, VllmDecodeError> {
    match value {
        None | Some(Value::Nil) => Ok(None),
        Some(v) => v
            .as_i64()
            .map(Some)
            .ok_or_else(|| shape(path, format!("expected an integer or nil, got {v}"))),
    }
}

fn opt_string(value: Option<&Value>, path: &str) -> Result<Option<String>, VllmDecodeError> {
    match value {
        None | Some(Value::Nil) => Ok(None),
        Some(v) => v
            .as_str()
            .map(|s| Some(s.to_string()))
            .ok_or_else(|| shape(path, format!("expected a string or nil, got {v}"))),
    }
}

fn block_hash(value: &Value, path: &str) -> Result<ExternalBlockHash, VllmDecodeError> {
    match value {
        Value::Integer(int) => int
            .as_u64()
            .or_else(|| int.as_i64().map(|signed| signed as u64))
            .map(ExternalBlockHash::Int)
            .ok_or_else(|| shape(path, "integer out of range")),
        Value::Binary(bytes) => Ok(ExternalBlockHash::Bytes(bytes.clone())),
        other => Err(shape(
            path,
            format!("expected an integer or bytes, got {other}"),
        )),
    }
}

fn block_hashes(value: &Value, path: &str) -> Result<Vec<ExternalBlockHash>, VllmDecodeError> {
    let items = value
        .as_array()
        .ok_or_else(|| shape(path, format!("expected an array, got {value}")))?;
    items
        .iter()
        .enumerate()
        .map(|(i, item)| block_hash(item, &format!("{path}[{i}]")))
        .collect()
}

/// SGLang's `metadata` map (`{"cache_salt": s}`): its salt, if any.
fn metadata_salt(value: Option<&Value>, path: &str) -> Result<Option<String>, VllmDecodeError> {
    match value {
        None | Some(Value::Nil) => Ok(None),
        Some(Value::Map(entries)) => opt_string(
            entries
                .iter()
                .find(|(key, _)| key.as_str() == Some("cache_salt"))
                .map(|(_, v)| v),
            &format!("{path}.metadata.cache_salt"),
        ),
        Some(other) => Err(shape(
            format!("{path}.metadata"),
            format!("expected a map or nil, got {other}"),
        )),
    }
}

/// Whether vLLM's `extra_keys` (one entry per block, `None` when the tokens are all) names
/// anything. Its entries are opaque tuples; any non-nil one counts.
fn extra_keys_named(value: Option<&Value>) -> bool {
    match value {
        Some(Value::Array(entries)) => entries.iter().any(|e| !e.is_nil()),
        None | Some(Value::Nil) => false,
        // An unexpected shape: be safe and treat the block as not token-only.
        Some(_) => true,
    }
}

fn decode_event(value: &Value, path: &str) -> Result<VllmEvent, VllmDecodeError> {
    // Array form: the tag, then the fields (positions below count from after the tag).
    let (tag, fields) = match value {
        Value::Array(items) => {
            let tag = items
                .first()
                .and_then(Value::as_str)
                .ok_or_else(|| shape(path, "array event without a string tag first"))?;
            (tag, Fields::Array(&items[1..]))
        }
        Value::Map(entries) => {
            let tag = entries
                .iter()
                .find(|(key, _)| key.as_str() == Some("type"))
                .and_then(|(_, v)| v.as_str())
                .ok_or_else(|| shape(path, "map event without a string \"type\""))?;
            (tag, Fields::Map(entries))
        }
        other => {
            return Err(shape(
                path,
                format!("expected an array or a map, got {other}"),
            ));
        }
    };
    let path = format!("{path}({tag})");
    match tag {
        "BlockStored" => {
            let hashes = block_hashes(
                fields.required(0, "block_hashes", &path)?,
                &format!("{path}.block_hashes"),
            )?;
            let parent = match fields.required(1, "parent_block_hash", &path)? {
                Value::Nil => None,
                v => Some(block_hash(v, &format!("{path}.parent_block_hash"))?),
            };
            let token_path = format!("{path}.token_ids");
            let token_ids = fields
                .required(2, "token_ids", &path)?
                .as_array()
                .ok_or_else(|| shape(&token_path, "expected an array"))?
                .iter()
                .map(|t| as_u32(t, &token_path))
                .collect::<Result<Vec<_>, _>>()?;
            let block_size = as_u32(
                fields.required(3, "block_size", &path)?,
                &format!("{path}.block_size"),
            )?;
            // Slot 6 is vLLM's `lora_name` (a string) or SGLang's `metadata` (a map).
            let (lora_name, cache_salt) = match &fields {
                Fields::Array(items) => match items.get(6) {
                    Some(Value::Map(_)) => (None, metadata_salt(items.get(6), &path)?),
                    other => (opt_string(other, &format!("{path}.lora_name"))?, None),
                },
                Fields::Map(_) => (
                    opt_string(fields.get(6, "lora_name"), &format!("{path}.lora_name"))?,
                    metadata_salt(fields.get(6, "metadata"), &path)?,
                ),
            };
            let has_extra_keys = match &fields {
                // SGLang has no slot 7; vLLM's is `extra_keys`.
                Fields::Array(items) => extra_keys_named(items.get(7)),
                Fields::Map(_) => extra_keys_named(fields.get(7, "extra_keys")),
            };
            Ok(VllmEvent::BlockStored(BlockStored {
                block_hashes: hashes,
                parent_block_hash: parent,
                token_ids,
                block_size,
                lora_id: opt_i64(fields.get(4, "lora_id"), &format!("{path}.lora_id"))?,
                medium: opt_string(fields.get(5, "medium"), &format!("{path}.medium"))?,
                lora_name,
                cache_salt,
                has_extra_keys,
            }))
        }
        "BlockRemoved" => Ok(VllmEvent::BlockRemoved(BlockRemoved {
            block_hashes: block_hashes(
                fields.required(0, "block_hashes", &path)?,
                &format!("{path}.block_hashes"),
            )?,
            medium: opt_string(fields.get(1, "medium"), &format!("{path}.medium"))?,
        })),
        "AllBlocksCleared" => Ok(VllmEvent::AllBlocksCleared),
        other => Ok(VllmEvent::Unknown(other.to_string())),
    }
}

impl VllmEventBatch {
    /// Decodes a msgpack `KVEventBatch`, array- or map-encoded. Never panics on bad input.
    pub fn decode(payload: &[u8]) -> Result<VllmEventBatch, VllmDecodeError> {
        let mut reader = payload;
        let value = rmpv::decode::read_value_with_max_depth(&mut reader, MAX_DEPTH)
            .map_err(|e| VllmDecodeError::Msgpack(e.to_string()))?;
        if !reader.is_empty() {
            return Err(VllmDecodeError::TrailingBytes(reader.len()));
        }
        let fields = match &value {
            Value::Array(items) => Fields::Array(items),
            Value::Map(entries) => Fields::Map(entries),
            other => {
                return Err(shape(
                    "batch",
                    format!("expected an array or a map, got {other}"),
                ));
            }
        };
        let ts_value = fields.required(0, "ts", "batch")?;
        let ts = ts_value
            .as_f64()
            .or_else(|| ts_value.as_i64().map(|t| t as f64))
            .ok_or_else(|| shape("batch.ts", format!("expected a number, got {ts_value}")))?;
        let events = fields
            .required(1, "events", "batch")?
            .as_array()
            .ok_or_else(|| shape("batch.events", "expected an array"))?
            .iter()
            .enumerate()
            .map(|(i, event)| decode_event(event, &format!("batch.events[{i}]")))
            .collect::<Result<_, _>>()?;
        let data_parallel_rank = opt_i64(
            fields.get(2, "data_parallel_rank"),
            "batch.data_parallel_rank",
        )?;
        Ok(VllmEventBatch {
            ts,
            events,
            data_parallel_rank,
        })
    }

    /// msgpack as a publisher sends it: the batch as an array, its events as `encoding` says.
    pub fn encode(&self, encoding: EventEncoding) -> Vec<u8> {
        let events = match encoding {
            EventEncoding::Array => self.events.iter().filter_map(event_to_array).collect(),
            EventEncoding::TaggedMap => self.events.iter().filter_map(event_to_map).collect(),
        };
        let mut batch = vec![Value::F64(self.ts), Value::Array(events)];
        if let Some(rank) = self.data_parallel_rank {
            batch.push(Value::from(rank));
        }
        write(&Value::Array(batch))
    }

    /// msgpack with the batch itself a map too (`{"ts", "events", …}`), as vLLM sends it
    /// since its `EventBatch` dropped `array_like`.
    pub fn encode_map(&self) -> Vec<u8> {
        let events = self.events.iter().filter_map(event_to_map).collect();
        let mut batch = vec![
            (Value::from("ts"), Value::F64(self.ts)),
            (Value::from("events"), Value::Array(events)),
        ];
        if let Some(rank) = self.data_parallel_rank {
            batch.push((Value::from("data_parallel_rank"), Value::from(rank)));
        }
        write(&Value::Map(batch))
    }
}

fn write(value: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    // Writing to a Vec cannot fail.
    let _ = rmpv::encode::write_value(&mut out, value);
    out
}

fn opt_value<T: Into<Value> + Clone>(value: &Option<T>) -> Value {
    value.clone().map_or(Value::Nil, Into::into)
}

fn hashes_value(hashes: &[ExternalBlockHash]) -> Value {
    Value::Array(hashes.iter().map(ExternalBlockHash::to_value).collect())
}

fn stored_fields(stored: &BlockStored) -> [(&'static str, Value); 7] {
    [
        ("block_hashes", hashes_value(&stored.block_hashes)),
        (
            "parent_block_hash",
            stored
                .parent_block_hash
                .as_ref()
                .map_or(Value::Nil, ExternalBlockHash::to_value),
        ),
        (
            "token_ids",
            Value::Array(stored.token_ids.iter().map(|&t| Value::from(t)).collect()),
        ),
        ("block_size", Value::from(stored.block_size)),
        ("lora_id", opt_value(&stored.lora_id)),
        ("medium", opt_value(&stored.medium)),
        ("lora_name", opt_value(&stored.lora_name)),
    ]
}

fn event_fields(event: &VllmEvent) -> Option<(&'static str, Vec<(&'static str, Value)>)> {
    match event {
        VllmEvent::BlockStored(stored) => Some(("BlockStored", stored_fields(stored).to_vec())),
        VllmEvent::BlockRemoved(removed) => Some((
            "BlockRemoved",
            vec![
                ("block_hashes", hashes_value(&removed.block_hashes)),
                ("medium", opt_value(&removed.medium)),
            ],
        )),
        VllmEvent::AllBlocksCleared => Some(("AllBlocksCleared", Vec::new())),
        VllmEvent::Unknown(_) => None,
    }
}

fn event_to_array(event: &VllmEvent) -> Option<Value> {
    let (tag, fields) = event_fields(event)?;
    let mut items = vec![Value::from(tag)];
    items.extend(fields.into_iter().map(|(_, value)| value));
    Some(Value::Array(items))
}

fn event_to_map(event: &VllmEvent) -> Option<Value> {
    let (tag, fields) = event_fields(event)?;
    let mut entries = vec![(Value::from("type"), Value::from(tag))];
    entries.extend(
        fields
            .into_iter()
            .map(|(name, value)| (Value::from(name), value)),
    );
    Some(Value::Map(entries))
}

/// A `kv-index` event that has no vLLM form.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum VllmEncodeError {
    #[error("block {0:#x} carries a local hash; vLLM events need its token ids")]
    NoTokens(u64),
    #[error("block {id:#x} has {len} tokens; vLLM events need exactly block_size = {block_size}")]
    BlockLength {
        id: u64,
        len: usize,
        block_size: u32,
    },
}

impl VllmEvent {
    /// The vLLM event for a `kv-index` event whose stored blocks carry their tokens
    /// ([`BlockContent::Tokens`]), each exactly `block_size` long.
    pub fn from_kv_event(event: &KvEvent, block_size: u32) -> Result<VllmEvent, VllmEncodeError> {
        Ok(match &event.kind {
            KvEventKind::Stored { parent, blocks } => {
                let mut token_ids = Vec::with_capacity(blocks.len() * block_size as usize);
                for block in blocks {
                    let BlockContent::Tokens(tokens) = &block.content else {
                        return Err(VllmEncodeError::NoTokens(block.id.0));
                    };
                    if tokens.len() != block_size as usize {
                        return Err(VllmEncodeError::BlockLength {
                            id: block.id.0,
                            len: tokens.len(),
                            block_size,
                        });
                    }
                    token_ids.extend_from_slice(tokens);
                }
                VllmEvent::BlockStored(BlockStored {
                    block_hashes: blocks
                        .iter()
                        .map(|b| ExternalBlockHash::Int(b.id.0))
                        .collect(),
                    parent_block_hash: parent.map(|p| ExternalBlockHash::Int(p.0)),
                    token_ids,
                    block_size,
                    lora_id: None,
                    medium: Some("GPU".to_string()),
                    lora_name: None,
                    cache_salt: None,
                    has_extra_keys: false,
                })
            }
            KvEventKind::Removed { blocks } => VllmEvent::BlockRemoved(BlockRemoved {
                block_hashes: blocks.iter().map(|b| ExternalBlockHash::Int(b.0)).collect(),
                medium: Some("GPU".to_string()),
            }),
            KvEventKind::Cleared => VllmEvent::AllBlocksCleared,
        })
    }
}

/// The replay socket's end-of-replay sequence number: `-1` as a signed 8-byte big-endian
/// integer, sent with an empty payload.
pub const REPLAY_END_SEQ: u64 = u64::MAX;

/// A replay request as a DEALER sends it to the publisher's ROUTER (`replay_endpoint`):
/// the empty delimiter a REQ socket would add, then the first wanted sequence number, 8 bytes
/// big-endian. (vLLM's and SGLang's `ZmqEventPublisher._service_replay` expect exactly
/// `[identity, b"", start_seq]` at the ROUTER.)
pub fn encode_replay_request(start_seq: u64) -> [Vec<u8>; 2] {
    [Vec::new(), start_seq.to_be_bytes().to_vec()]
}

/// One message of a replay, as the requesting DEALER receives it.
#[derive(Debug, Clone, PartialEq)]
pub enum ReplayReply {
    /// A buffered batch, `seq` and all, in the publisher's order.
    Frame(VllmFrame),
    /// The end marker: every buffered batch from the requested number on has been sent.
    End,
}

/// Decodes `[b"", seq, payload]` (the ROUTER's reply with the identity stripped) or the end
/// marker `[b"", -1, b""]`.
pub fn decode_replay_reply<B: AsRef<[u8]>>(parts: &[B]) -> Result<ReplayReply, VllmDecodeError> {
    let [delimiter, seq, payload] = parts else {
        return Err(VllmDecodeError::Parts(parts.len()));
    };
    if !delimiter.as_ref().is_empty() {
        return Err(shape(
            "replay",
            "the first part must be the empty delimiter",
        ));
    }
    let seq = decode_seq(seq.as_ref())?;
    if seq == REPLAY_END_SEQ && payload.as_ref().is_empty() {
        return Ok(ReplayReply::End);
    }
    Ok(ReplayReply::Frame(VllmFrame {
        topic: Vec::new(),
        seq,
        batch: VllmEventBatch::decode(payload.as_ref())?,
    }))
}

/// A replay request as the publisher's ROUTER receives it: `[identity, b"", start_seq]`.
/// Returns the identity to answer and the first wanted sequence number.
pub fn decode_replay_request<B: AsRef<[u8]>>(
    parts: &[B],
) -> Result<(Vec<u8>, u64), VllmDecodeError> {
    let [identity, delimiter, start] = parts else {
        return Err(VllmDecodeError::Parts(parts.len()));
    };
    if !delimiter.as_ref().is_empty() {
        return Err(shape(
            "replay request",
            "the second part must be the empty delimiter",
        ));
    }
    Ok((identity.as_ref().to_vec(), decode_seq(start.as_ref())?))
}

/// The ROUTER's answer for one buffered batch: `[identity, b"", seq, payload]`.
pub fn encode_replay_frame(identity: &[u8], seq: u64, payload: &[u8]) -> [Vec<u8>; 4] {
    [
        identity.to_vec(),
        Vec::new(),
        seq.to_be_bytes().to_vec(),
        payload.to_vec(),
    ]
}

/// The ROUTER's end marker: `[identity, b"", -1, b""]`.
pub fn encode_replay_end(identity: &[u8]) -> [Vec<u8>; 4] {
    encode_replay_frame(identity, REPLAY_END_SEQ, &[])
}

/// A publisher's last `capacity` batches (sequence number and encoded payload), for replay:
/// vLLM's `buffer_steps`. Pushing past the capacity forgets the oldest.
#[derive(Debug, Clone)]
pub struct ReplayBuffer {
    frames: std::collections::VecDeque<(u64, Vec<u8>)>,
    capacity: usize,
}

impl ReplayBuffer {
    /// vLLM's and SGLang's default `buffer_steps`.
    pub const DEFAULT_CAPACITY: usize = 10_000;

    pub fn new(capacity: usize) -> ReplayBuffer {
        ReplayBuffer {
            frames: std::collections::VecDeque::with_capacity(capacity.min(1024)),
            capacity,
        }
    }

    pub fn push(&mut self, seq: u64, payload: Vec<u8>) {
        if self.capacity == 0 {
            return;
        }
        if self.frames.len() == self.capacity {
            self.frames.pop_front();
        }
        self.frames.push_back((seq, payload));
    }

    /// The buffered batches numbered `start` or later, oldest first.
    pub fn since(&self, start: u64) -> impl Iterator<Item = (u64, &[u8])> {
        self.frames
            .iter()
            .filter(move |(seq, _)| *seq >= start)
            .map(|(seq, payload)| (*seq, payload.as_slice()))
    }

    pub fn len(&self) -> usize {
        self.frames.len()
    }

    pub fn is_empty(&self) -> bool {
        self.frames.is_empty()
    }
}

/// How a frame's sequence number relates to the previous one of the same publisher.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Continuity {
    /// The first frame seen: it sets the baseline.
    First,
    /// The frame that was expected next.
    InOrder,
    /// Frames `expected..got` were lost: the index missed events and must drop this worker's
    /// blocks ([`kv_index::KvIndex::clear_worker`]) before applying this frame's events.
    Gap { expected: u64, got: u64 },
    /// The sequence went backwards: the publisher restarted (its cache is new). Clear the
    /// worker's blocks, as for a gap.
    Restart { expected: u64, got: u64 },
}

impl Continuity {
    /// Whether the receiver must clear the worker's blocks before applying the events.
    pub fn needs_clear(&self) -> bool {
        matches!(self, Continuity::Gap { .. } | Continuity::Restart { .. })
    }
}

/// What [`VllmEventStream::accept`] made of one frame.
#[derive(Debug, Clone, PartialEq)]
pub struct Accepted {
    pub continuity: Continuity,
    /// The frame's events for the index, with consecutive `seq`s continuing this stream's.
    pub events: Vec<KvEvent>,
    /// Events left out: other cache tiers (`medium` not GPU), LoRA, salted or multimodal
    /// blocks (our hash sees only tokens) and unknown event types.
    pub skipped: u32,
}

/// A frame whose events cannot be converted.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum VllmConvertError {
    #[error("BlockStored has {tokens} token ids for {blocks} blocks of {block_size}")]
    TokenCount {
        tokens: usize,
        blocks: usize,
        block_size: u32,
    },
    #[error(
        "the worker's KV blocks hold {got} tokens but this router hashes blocks of {expected}: set the router's block size to the engine's"
    )]
    BlockSize { expected: u32, got: u32 },
    /// Over [`crate::kv_events::MAX_STORED_BLOCKS`] or `MAX_STORED_TOKENS`.
    #[error("{0}")]
    TooLarge(String),
}

/// Why a replay could not fill a gap.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ReplayGap {
    #[error(
        "the replay went from batch {expected} to {got}: the publisher no longer holds the batches between"
    )]
    Missing { expected: u64, got: u64 },
    #[error("a replayed batch is not usable: {0}")]
    Convert(VllmConvertError),
}

/// One vLLM publisher's frames turned into a worker's `kv-index` events.
///
/// Assigns the events consecutive sequence numbers (vLLM numbers batches, the index numbers
/// events) and classifies each frame's batch number ([`Continuity`]). On a gap or restart,
/// clear the worker in the index before applying the returned events. Holds O(1) state.
#[derive(Debug, Clone)]
pub struct VllmEventStream {
    worker: WorkerId,
    block_size: u32,
    next_frame_seq: Option<u64>,
    next_event_seq: u64,
}

impl VllmEventStream {
    /// A stream for `worker`, whose blocks must hold `block_size` tokens (the router's).
    pub fn new(worker: WorkerId, block_size: u32) -> VllmEventStream {
        VllmEventStream {
            worker,
            block_size,
            next_frame_seq: None,
            next_event_seq: 0,
        }
    }

    pub fn worker(&self) -> WorkerId {
        self.worker
    }

    /// Converts one frame. On error, the frame's sequence number still counts as seen (a
    /// frame we cannot use is not a gap), and no event of it is returned: the caller should
    /// clear the worker, since the index now misses what the frame said.
    pub fn accept(&mut self, frame: &VllmFrame) -> Result<Accepted, VllmConvertError> {
        let continuity = self.continuity(frame.seq);
        self.next_frame_seq = Some(frame.seq.wrapping_add(1));
        let mut kinds = Vec::with_capacity(frame.batch.events.len());
        let mut skipped = 0;
        for event in &frame.batch.events {
            match self.convert(event)? {
                Some(kind) => kinds.push(kind),
                None => skipped += 1,
            }
        }
        let events = kinds
            .into_iter()
            .map(|kind| {
                let seq = self.next_event_seq;
                self.next_event_seq += 1;
                KvEvent {
                    worker: self.worker,
                    seq,
                    kind,
                }
            })
            .collect();
        Ok(Accepted {
            continuity,
            events,
            skipped,
        })
    }

    /// How a frame numbered `seq` would continue this stream (nothing changes): a caller with
    /// a replay socket asks before [`accept`](Self::accept), to fill a gap first.
    pub fn continuity(&self, seq: u64) -> Continuity {
        match self.next_frame_seq {
            None => Continuity::First,
            Some(expected) if seq == expected => Continuity::InOrder,
            Some(expected) if seq > expected => Continuity::Gap { expected, got: seq },
            Some(expected) => Continuity::Restart { expected, got: seq },
        }
    }

    /// The batch number this stream expects next (`None` before the first frame).
    pub fn next_frame_seq(&self) -> Option<u64> {
        self.next_frame_seq
    }

    /// The sequence number the next converted event gets: what the index expects of this
    /// worker after a snapshot replaced its view.
    pub fn next_event_seq(&self) -> u64 {
        self.next_event_seq
    }

    /// Goes on from batch `next_batch`: a snapshot of the publisher's whole cache covered every
    /// batch before it ([`crate::ZmqKvState`]).
    pub fn resume_at(&mut self, next_batch: u64) {
        self.next_frame_seq = Some(next_batch);
    }

    /// Applies one batch of a replay that should fill the frames before `until` (the live
    /// frame that revealed the gap, or the first live frame of a late subscriber).
    ///
    /// Returns the batch's events when it is the next one expected (any batch before
    /// `until` when the stream has no baseline yet: a late subscriber starts from the oldest
    /// batch the publisher still holds, a suffix of its history, which only ever
    /// under-reports), `None` for a batch already applied or at/after `until` (the live
    /// stream delivers those), and [`ReplayGap`] when the replay skipped a batch: the
    /// publisher no longer holds it, and the caller must fall back to a resync. Once
    /// [`next_frame_seq`](Self::next_frame_seq) is `until`, the gap is filled.
    pub fn accept_replayed(
        &mut self,
        frame: &VllmFrame,
        until: u64,
    ) -> Result<Option<Accepted>, ReplayGap> {
        if frame.seq >= until {
            return Ok(None);
        }
        match self.next_frame_seq {
            Some(expected) if frame.seq < expected => return Ok(None),
            Some(expected) if frame.seq > expected => {
                return Err(ReplayGap::Missing {
                    expected,
                    got: frame.seq,
                });
            }
            _ => {}
        }
        self.accept(frame).map(Some).map_err(ReplayGap::Convert)
    }

    fn convert(&self, event: &VllmEvent) -> Result<Option<KvEventKind>, VllmConvertError> {
        let gpu = |medium: &Option<String>| {
            medium
                .as_deref()
                .is_none_or(|m| m.eq_ignore_ascii_case("gpu"))
        };
        Ok(match event {
            VllmEvent::BlockStored(stored) => {
                if !gpu(&stored.medium)
                    || stored.lora_id.is_some_and(|id| id != 0)
                    || stored.lora_name.is_some()
                    || stored.cache_salt.is_some()
                    || stored.has_extra_keys
                {
                    return Ok(None);
                }
                if stored.block_size != self.block_size {
                    return Err(VllmConvertError::BlockSize {
                        expected: self.block_size,
                        got: stored.block_size,
                    });
                }
                crate::kv_events::check_stored_size(
                    stored.block_hashes.len(),
                    stored.token_ids.len(),
                )
                .map_err(|e| VllmConvertError::TooLarge(e.to_string()))?;
                let size = stored.block_size as usize;
                if stored.token_ids.len() != stored.block_hashes.len() * size {
                    return Err(VllmConvertError::TokenCount {
                        tokens: stored.token_ids.len(),
                        blocks: stored.block_hashes.len(),
                        block_size: stored.block_size,
                    });
                }
                let blocks = stored
                    .block_hashes
                    .iter()
                    .zip(stored.token_ids.chunks_exact(size))
                    .map(|(hash, tokens)| StoredBlock {
                        id: hash.engine_block_id(),
                        content: BlockContent::Tokens(tokens.to_vec()),
                    })
                    .collect();
                Some(KvEventKind::Stored {
                    parent: stored
                        .parent_block_hash
                        .as_ref()
                        .map(ExternalBlockHash::engine_block_id),
                    blocks,
                })
            }
            VllmEvent::BlockRemoved(removed) => {
                if !gpu(&removed.medium) {
                    return Ok(None);
                }
                Some(KvEventKind::Removed {
                    blocks: removed
                        .block_hashes
                        .iter()
                        .map(ExternalBlockHash::engine_block_id)
                        .collect(),
                })
            }
            VllmEvent::AllBlocksCleared => Some(KvEventKind::Cleared),
            VllmEvent::Unknown(_) => None,
        })
    }
}
