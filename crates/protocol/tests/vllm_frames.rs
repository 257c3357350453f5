//! vLLM ZMQ KV event frames built by hand with `rmpv`, byte for byte as `msgspec` writes them
//! (array-like structs with the tag first, or maps with a `"type"` tag), decoded and converted
//! into `kv-index` events that a real `KvIndex` accepts.

use kv_index::{
    BlockContent, BlockHasher, EngineBlockId, IndexConfig, KvEventKind, KvIndex, WorkerId,
};
use protocol::vllm::{
    Continuity, EventEncoding, ExternalBlockHash, VllmConvertError, VllmDecodeError, VllmEvent,
    VllmEventBatch, VllmEventStream, decode_multipart, encode_multipart,
};
use rmpv::Value;

const BS: u32 = 4;

fn bytes(value: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, value).unwrap();
    out
}

fn ints(values: impl IntoIterator<Item = i64>) -> Value {
    Value::Array(values.into_iter().map(Value::from).collect())
}

fn s(text: &str) -> Value {
    Value::from(text)
}

/// `BlockStored` as vLLM ≤ 0.10 sends it (array_like, `lora_id` and `medium` present).
fn stored_array(hashes: Value, parent: Value, tokens: Value) -> Value {
    stored_array_of(hashes, parent, tokens, BS, Value::Nil, "GPU")
}

/// The same with every field chosen: block size, LoRA id and storage tier.
fn stored_array_of(
    hashes: Value,
    parent: Value,
    tokens: Value,
    block_size: u32,
    lora: Value,
    medium: &str,
) -> Value {
    Value::Array(vec![
        s("BlockStored"),
        hashes,
        parent,
        tokens,
        Value::from(block_size),
        lora,
        s(medium),
    ])
}

/// The map form newer vLLM sends: every field without a default, named.
fn stored_map(hashes: Value, parent: Value, tokens: Value) -> Value {
    Value::Map(vec![
        (s("type"), s("BlockStored")),
        (s("block_hashes"), hashes),
        (s("parent_block_hash"), parent),
        (s("token_ids"), tokens),
        (s("block_size"), Value::from(BS)),
        (s("lora_id"), Value::Nil),
        (s("medium"), s("GPU")),
        (s("lora_name"), Value::Nil),
        (s("group_idx"), Value::from(0)),
        (s("kv_cache_spec_kind"), s("full_attention")),
    ])
}

fn frame(seq: u64, payload: Vec<u8>) -> Vec<Vec<u8>> {
    vec![b"kv-events".to_vec(), seq.to_be_bytes().to_vec(), payload]
}

fn array_batch(events: Vec<Value>) -> Vec<u8> {
    bytes(&Value::Array(vec![
        Value::F64(1_700_000_000.25),
        Value::Array(events),
        Value::from(0),
    ]))
}

#[test]
fn array_encoded_batch_decodes_with_sequence_number() {
    let payload = array_batch(vec![
        stored_array(ints([11, 12]), Value::Nil, ints(0..8)),
        Value::Array(vec![s("BlockRemoved"), ints([11]), s("GPU")]),
        Value::Array(vec![s("AllBlocksCleared")]),
    ]);
    let decoded = decode_multipart(&frame(0x0102_0304_0506_0708, payload)).unwrap();
    assert_eq!(decoded.topic, b"kv-events");
    assert_eq!(decoded.seq, 0x0102_0304_0506_0708);
    assert_eq!(decoded.batch.ts, 1_700_000_000.25);
    assert_eq!(decoded.batch.data_parallel_rank, Some(0));
    let [stored, removed, cleared] = &decoded.batch.events[..] else {
        panic!("{:?}", decoded.batch.events)
    };
    let VllmEvent::BlockStored(stored) = stored else {
        panic!("{stored:?}")
    };
    assert_eq!(
        stored.block_hashes,
        vec![ExternalBlockHash::Int(11), ExternalBlockHash::Int(12)]
    );
    assert_eq!(stored.parent_block_hash, None);
    assert_eq!(stored.token_ids, (0..8).collect::<Vec<u32>>());
    assert_eq!(stored.medium.as_deref(), Some("GPU"));
    assert!(
        matches!(removed, VllmEvent::BlockRemoved(r) if r.block_hashes == vec![ExternalBlockHash::Int(11)])
    );
    assert_eq!(cleared, &VllmEvent::AllBlocksCleared);
}

#[test]
fn oldest_array_form_without_medium_or_rank_decodes() {
    // vLLM 0.9: `[ts, events]`, BlockStored without `medium`, BlockRemoved with hashes only.
    let payload = bytes(&Value::Array(vec![
        Value::F64(1.0),
        Value::Array(vec![
            Value::Array(vec![
                s("BlockStored"),
                ints([5]),
                Value::Nil,
                ints(0..4),
                Value::from(BS),
                Value::Nil,
            ]),
            Value::Array(vec![s("BlockRemoved"), ints([5])]),
        ]),
    ]));
    let batch = VllmEventBatch::decode(&payload).unwrap();
    assert_eq!(batch.data_parallel_rank, None);
    assert_eq!(batch.events.len(), 2);
}

#[test]
fn map_encoded_batch_with_bytes_hashes_and_newer_fields_decodes() {
    let h1 = Value::Binary(vec![0xaa; 32]);
    let h2 = Value::Binary(vec![0xbb; 32]);
    let payload = bytes(&Value::Map(vec![
        (s("ts"), Value::F64(2.5)),
        (
            s("events"),
            Value::Array(vec![
                stored_map(
                    Value::Array(vec![h1.clone(), h2.clone()]),
                    Value::Nil,
                    ints(0..8),
                ),
                Value::Map(vec![
                    (s("type"), s("BlockRemoved")),
                    (s("block_hashes"), Value::Array(vec![h2])),
                    (s("medium"), s("GPU")),
                    (s("group_idx"), Value::from(0)),
                ]),
                Value::Map(vec![(s("type"), s("AllBlocksCleared"))]),
            ]),
        ),
        (s("data_parallel_rank"), Value::from(3)),
    ]));
    let decoded = decode_multipart(&frame(9, payload)).unwrap();
    assert_eq!(decoded.batch.data_parallel_rank, Some(3));
    let VllmEvent::BlockStored(stored) = &decoded.batch.events[0] else {
        panic!()
    };
    assert_eq!(
        stored.block_hashes[0],
        ExternalBlockHash::Bytes(vec![0xaa; 32])
    );
    assert_ne!(
        stored.block_hashes[0].engine_block_id(),
        stored.block_hashes[1].engine_block_id()
    );
    assert!(matches!(
        decoded.batch.events[1],
        VllmEvent::BlockRemoved(_)
    ));
    assert_eq!(decoded.batch.events[2], VllmEvent::AllBlocksCleared);
}

#[test]
fn blocks_whose_hash_covers_extra_keys_are_skipped() {
    // vLLM main (0181ea3): the whole batch a map, `extra_keys` one entry per block, `None`
    // when the tokens are all its hash covers. A multimodal or salted block names something
    // there; a request of the same tokens would not reuse it, so it is not indexed.
    let with_extra = |extra: Value| {
        let Value::Map(mut entries) = stored_map(ints([1]), Value::Nil, ints(0..4)) else {
            unreachable!()
        };
        entries.push((s("extra_keys"), extra));
        Value::Map(entries)
    };
    let payload = bytes(&Value::Map(vec![
        (s("ts"), Value::F64(1.0)),
        (
            s("events"),
            Value::Array(vec![
                with_extra(Value::Array(vec![Value::Nil])),
                with_extra(Value::Array(vec![Value::Array(vec![
                    s("mm-hash-0"),
                    Value::from(0),
                ])])),
                with_extra(Value::Nil),
            ]),
        ),
    ]));
    let decoded = decode_multipart(&frame(0, payload)).unwrap();
    let flags: Vec<bool> = decoded
        .batch
        .events
        .iter()
        .map(|e| matches!(e, VllmEvent::BlockStored(b) if b.has_extra_keys))
        .collect();
    assert_eq!(flags, [false, true, false]);
    let accepted = VllmEventStream::new(WorkerId(1), BS)
        .accept(&decoded)
        .unwrap();
    assert_eq!((accepted.events.len(), accepted.skipped), (2, 1));
}

#[test]
fn trailing_fields_of_newer_versions_are_ignored() {
    let mut stored = match stored_array(ints([1]), Value::Nil, ints(0..4)) {
        Value::Array(items) => items,
        _ => unreachable!(),
    };
    // lora_name, extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window.
    stored.extend([
        Value::Nil,
        Value::Array(vec![Value::Nil]),
        Value::from(1),
        s("sliding_window"),
        Value::from(4096),
    ]);
    let payload = bytes(&Value::Array(vec![
        Value::F64(0.0),
        Value::Array(vec![
            Value::Array(stored),
            Value::Array(vec![s("SomeFutureEvent"), Value::from(1)]),
        ]),
        Value::from(0),
        s("a field from the future"),
    ]));
    let batch = VllmEventBatch::decode(&payload).unwrap();
    assert!(matches!(batch.events[0], VllmEvent::BlockStored(_)));
    assert_eq!(
        batch.events[1],
        VllmEvent::Unknown("SomeFutureEvent".into())
    );
}

#[test]
fn negative_integer_hashes_are_accepted() {
    let payload = array_batch(vec![stored_array(ints([-5]), Value::from(-7), ints(0..4))]);
    let batch = VllmEventBatch::decode(&payload).unwrap();
    let VllmEvent::BlockStored(stored) = &batch.events[0] else {
        panic!()
    };
    assert_eq!(
        stored.block_hashes[0].engine_block_id(),
        EngineBlockId(-5i64 as u64)
    );
    assert_eq!(
        stored.parent_block_hash,
        Some(ExternalBlockHash::Int(-7i64 as u64))
    );
}

#[test]
fn garbage_and_truncated_frames_are_errors_not_panics() {
    let payload = array_batch(vec![
        stored_array(ints([11, 12]), Value::Nil, ints(0..8)),
        Value::Array(vec![s("BlockRemoved"), ints([11]), s("GPU")]),
    ]);
    for cut in 0..payload.len() {
        assert!(
            VllmEventBatch::decode(&payload[..cut]).is_err(),
            "truncated at {cut}"
        );
    }
    let mut trailing = payload.clone();
    trailing.push(0xc0);
    assert_eq!(
        VllmEventBatch::decode(&trailing),
        Err(VllmDecodeError::TrailingBytes(1))
    );
    // Two or four parts, a 7-byte sequence number.
    assert_eq!(
        decode_multipart(&[b"t".to_vec(), vec![0; 8]]),
        Err(VllmDecodeError::Parts(2))
    );
    assert_eq!(
        decode_multipart(&[b"t".to_vec(), vec![0; 7], payload.clone()]),
        Err(VllmDecodeError::SeqLength(7))
    );
    let bad_shapes = [
        bytes(&Value::from(3)),
        bytes(&Value::Array(vec![])),
        bytes(&Value::Array(vec![s("ts"), Value::Array(vec![])])),
        bytes(&Value::Array(vec![Value::F64(0.0), Value::from(1)])),
        array_batch(vec![Value::from(1)]),
        array_batch(vec![Value::Array(vec![])]),
        array_batch(vec![Value::Map(vec![(s("block_hashes"), ints([1]))])]),
        array_batch(vec![Value::Array(vec![s("BlockStored"), ints([1])])]),
        array_batch(vec![stored_array(s("x"), Value::Nil, ints(0..4))]),
        array_batch(vec![stored_array(
            ints([1]),
            Value::Nil,
            ints([-1, 0, 0, 0]),
        )]),
        array_batch(vec![stored_array(
            ints([1]),
            Value::Nil,
            ints([1 << 33, 0, 0, 0]),
        )]),
        array_batch(vec![stored_array(
            ints([1]),
            Value::Boolean(true),
            ints(0..4),
        )]),
    ];
    for (i, bad) in bad_shapes.iter().enumerate() {
        assert!(VllmEventBatch::decode(bad).is_err(), "shape {i}");
    }
    // Deep nesting is refused, not recursed into.
    let mut deep = Value::Nil;
    for _ in 0..10_000 {
        deep = Value::Array(vec![deep]);
    }
    assert!(VllmEventBatch::decode(&bytes(&deep)).is_err());
    // A huge claimed length with no data behind it.
    assert!(VllmEventBatch::decode(&[0xdd, 0xff, 0xff, 0xff, 0xff]).is_err());
    assert!(VllmEventBatch::decode(&[0xc1, 0x00]).is_err());
}

#[test]
fn stream_converts_to_index_events_and_hashes_from_tokens() {
    let hasher = BlockHasher::new(BS as usize).unwrap();
    let prompt: Vec<u32> = (100..112).collect(); // three blocks
    let tokens = |r: std::ops::Range<usize>| ints(prompt[r].iter().map(|&t| i64::from(t)));
    // Two batches: blocks 0-1 (array form), then block 2 as a child of block 1 (map form).
    let first = array_batch(vec![stored_array(
        ints([1001, 1002]),
        Value::Nil,
        tokens(0..8),
    )]);
    let second = bytes(&Value::Map(vec![
        (s("ts"), Value::F64(1.0)),
        (
            s("events"),
            Value::Array(vec![stored_map(
                ints([1003]),
                Value::from(1002),
                tokens(8..12),
            )]),
        ),
    ]));
    let mut stream = VllmEventStream::new(WorkerId(4), BS);
    let mut index = KvIndex::new(IndexConfig::default());
    for (seq, payload) in [(0u64, first), (1, second)] {
        let accepted = stream
            .accept(&decode_multipart(&frame(seq, payload)).unwrap())
            .unwrap();
        assert!(!accepted.continuity.needs_clear());
        for event in accepted.events {
            index.apply(&event).unwrap();
        }
    }
    let request = hasher.sequence_hashes(&prompt);
    let scores = index.find_matches(&request);
    assert_eq!(
        scores.get(WorkerId(4)),
        3,
        "all three blocks match by recomputed hash"
    );
}

#[test]
fn stream_numbers_events_and_reports_gaps_and_restarts() {
    let one_store = |id: i64| array_batch(vec![stored_array(ints([id]), Value::Nil, ints(0..4))]);
    let mut stream = VllmEventStream::new(WorkerId(1), BS);
    let mut accept = |seq: u64, payload: Vec<u8>| {
        stream
            .accept(&decode_multipart(&frame(seq, payload)).unwrap())
            .unwrap()
    };
    // Frames 10 and 11 in order, 12 and 13 lost, then the publisher restarts from 0.
    let seqs = [10, 11, 14, 0];
    let continuities = [
        Continuity::First,
        Continuity::InOrder,
        Continuity::Gap {
            expected: 12,
            got: 14,
        },
        Continuity::Restart {
            expected: 15,
            got: 0,
        },
    ];
    // After a gap or a restart the index misses blocks: the worker must be cleared.
    let clears = [false, false, true, true];
    for (n, ((seq, continuity), clear)) in (0..).zip(seqs.into_iter().zip(continuities).zip(clears))
    {
        let accepted = accept(seq, one_store(n + 1));
        assert_eq!(accepted.continuity, continuity, "frame {seq}");
        assert_eq!(accepted.continuity.needs_clear(), clear, "frame {seq}");
        // Events are numbered by the stream, consecutively, whatever the frames' numbers.
        assert_eq!(accepted.events[0].seq, n as u64, "frame {seq}");
    }
}

#[test]
fn other_tiers_lora_and_wrong_sizes_are_skipped_or_refused() {
    let cpu = stored_array_of(ints([1]), Value::Nil, ints(0..4), BS, Value::Nil, "CPU");
    let lora = stored_array_of(ints([2]), Value::Nil, ints(0..4), BS, Value::from(3), "GPU");
    let cpu_removed = Value::Array(vec![s("BlockRemoved"), ints([1]), s("CPU")]);
    let mut stream = VllmEventStream::new(WorkerId(1), BS);
    let accepted = stream
        .accept(&decode_multipart(&frame(0, array_batch(vec![cpu, lora, cpu_removed]))).unwrap())
        .unwrap();
    assert!(accepted.events.is_empty());
    assert_eq!(accepted.skipped, 3);

    let wrong_size = stored_array_of(ints([1]), Value::Nil, ints(0..16), 16, Value::Nil, "GPU");
    assert_eq!(
        stream.accept(&decode_multipart(&frame(1, array_batch(vec![wrong_size]))).unwrap()),
        Err(VllmConvertError::BlockSize {
            expected: BS,
            got: 16
        })
    );
    let short = stored_array(ints([1, 2]), Value::Nil, ints(0..6));
    assert!(matches!(
        stream.accept(&decode_multipart(&frame(2, array_batch(vec![short]))).unwrap()),
        Err(VllmConvertError::TokenCount {
            tokens: 6,
            blocks: 2,
            block_size: BS
        })
    ));
    // A million tokens in one event: refused whole, before any block is built.
    let tokens = 1i64 << 20;
    let huge = stored_array(ints(0..tokens / i64::from(BS)), Value::Nil, ints(0..tokens));
    let refused = stream.accept(&decode_multipart(&frame(3, array_batch(vec![huge]))).unwrap());
    assert!(
        matches!(&refused, Err(VllmConvertError::TooLarge(m)) if m.contains("over the limit")),
        "{refused:?}"
    );
}

#[test]
fn our_encoder_writes_what_vllm_writes_and_decodes_back() {
    let hasher = BlockHasher::new(BS as usize).unwrap();
    let tokens: Vec<u32> = (0..8).collect();
    let KvEventKind::Stored { parent, blocks } = KvEventKind::stored_prompt(&hasher, &tokens)
    else {
        unreachable!()
    };
    // Our engines name blocks by sequence hash and the server attaches tokens.
    let blocks: Vec<_> = blocks
        .into_iter()
        .zip(tokens.chunks(BS as usize))
        .map(|(mut b, t)| {
            b.content = BlockContent::Tokens(t.to_vec());
            b
        })
        .collect();
    let event = kv_index::KvEvent {
        worker: WorkerId(2),
        seq: 0,
        kind: KvEventKind::Stored {
            parent,
            blocks: blocks.clone(),
        },
    };
    let vllm_event = VllmEvent::from_kv_event(&event, BS).unwrap();
    let batch = VllmEventBatch {
        ts: 3.0,
        events: vec![vllm_event],
        data_parallel_rank: Some(0),
    };
    let parts = encode_multipart(b"", 7, &batch, EventEncoding::Array);
    // Exactly the hand-built array form.
    let expected = bytes(&Value::Array(vec![
        Value::F64(3.0),
        Value::Array(vec![Value::Array(vec![
            s("BlockStored"),
            Value::Array(blocks.iter().map(|b| Value::from(b.id.0)).collect()),
            Value::Nil,
            ints(0..8),
            Value::from(BS),
            Value::Nil,
            s("GPU"),
            Value::Nil,
        ])]),
        Value::from(0),
    ]));
    assert_eq!(parts[2], expected);
    assert_eq!(parts[1], 7u64.to_be_bytes());
    let decoded = decode_multipart(&parts).unwrap();
    assert_eq!(decoded.batch, batch);
    assert_eq!(VllmEventBatch::decode(&batch.encode_map()).unwrap(), batch);
    // The tagged-map form (current vLLM, what vllm-router reads): the batch stays an array,
    // each event becomes a map named by its `type`.
    let tagged = encode_multipart(b"", 7, &batch, EventEncoding::TaggedMap);
    let value = rmpv::decode::read_value(&mut tagged[2].as_slice()).unwrap();
    let first = &value.as_array().unwrap()[1].as_array().unwrap()[0];
    let field = |name: &str| {
        first
            .as_map()
            .unwrap()
            .iter()
            .find(|(k, _)| k.as_str() == Some(name))
            .map(|(_, v)| v.clone())
    };
    assert_eq!(field("type"), Some(s("BlockStored")));
    assert_eq!(field("token_ids"), Some(ints(0..8)));
    assert_eq!(field("block_size"), Some(Value::from(BS)));
    assert_eq!(decode_multipart(&tagged).unwrap().batch, batch);
    // Converted back, the blocks keep their ids and tokens.
    let mut stream = VllmEventStream::new(WorkerId(2), BS);
    let back = stream.accept(&decoded).unwrap();
    assert_eq!(back.events, vec![event]);
}
