//! vLLM's and SGLang's ZMQ/msgpack KV event frames (`protocol::vllm`), as the gateway's
//! subscriber reads them, on into the prefix index.
//!
//! Properties: decoding never panics; a batch that decodes re-encodes (tagged maps, arrays,
//! and the batch as a map, the three forms publishers send) to bytes that decode to the same
//! batch (less what our encoder never writes: unknown event types, SGLang's salt, vLLM's
//! `extra_keys` flag); the stream's events, applied to a small `KvIndex`, keep its internal
//! invariants.

#![no_main]

use arbitrary::Unstructured;
use kv_index::{IndexConfig, KvIndex, WorkerId};
use libfuzzer_sys::fuzz_target;
use protocol::vllm::{
    EventEncoding, VllmEvent, VllmEventBatch, VllmEventStream, VllmFrame, decode_multipart,
    encode_multipart,
};

/// What survives our encoder: no unknown events, no salt, no `extra_keys` flag.
fn encodable(batch: &VllmEventBatch) -> VllmEventBatch {
    let mut batch = batch.clone();
    batch.events.retain(|e| !matches!(e, VllmEvent::Unknown(_)));
    for event in &mut batch.events {
        if let VllmEvent::BlockStored(stored) = event {
            stored.cache_salt = None;
            stored.has_extra_keys = false;
        }
    }
    batch
}

/// `a == b`, with `ts` compared by bits (NaN round-trips as NaN).
fn same(a: &VllmEventBatch, b: &VllmEventBatch) -> bool {
    a.ts.to_bits() == b.ts.to_bits()
        && a.events == b.events
        && a.data_parallel_rank == b.data_parallel_rank
}

fn check_round_trip(batch: &VllmEventBatch) {
    let expected = encodable(batch);
    for (form, bytes) in [
        ("tagged maps", batch.encode(EventEncoding::TaggedMap)),
        ("arrays", batch.encode(EventEncoding::Array)),
        ("batch as a map", batch.encode_map()),
    ] {
        match VllmEventBatch::decode(&bytes) {
            Ok(back) => assert!(
                same(&back, &expected),
                "{form}: {expected:?} came back as {back:?}"
            ),
            Err(e) => panic!("{form}: our own encoding of {batch:?} does not decode: {e}"),
        }
    }
    let parts = encode_multipart(b"kv@fuzz", 7, batch, EventEncoding::TaggedMap);
    let frame = decode_multipart(&parts).expect("our own multipart frame decodes");
    assert_eq!(frame.seq, 7);
    assert!(same(&frame.batch, &expected));
}

/// The stream and index the subscriber feeds: conversions may fail (wrong block size, too
/// large), never panic, and the index stays consistent.
fn feed(frames: &[VllmFrame], block_size: u32) {
    let worker = WorkerId(1);
    let mut stream = VllmEventStream::new(worker, block_size);
    let mut index = KvIndex::new(IndexConfig {
        max_blocks: 64,
        max_workers: 4,
    });
    for frame in frames {
        match stream.accept(frame) {
            Ok(accepted) => {
                if accepted.continuity.needs_clear() {
                    index.clear_worker(worker);
                }
                for event in &accepted.events {
                    let _ = index.apply_resyncing(event);
                }
            }
            Err(_) => index.clear_worker(worker),
        }
    }
    index.check_invariants();
}

/// A batch built from the fuzzer's choices (block hashes of both kinds, tokens that may or
/// may not fill the blocks), so the round trip sees every field.
fn arbitrary_batch(u: &mut Unstructured) -> arbitrary::Result<VllmEventBatch> {
    use protocol::vllm::{BlockRemoved, BlockStored, ExternalBlockHash};
    let hash = |u: &mut Unstructured| -> arbitrary::Result<ExternalBlockHash> {
        Ok(if u.arbitrary()? {
            ExternalBlockHash::Int(u.int_in_range(0..=7)?)
        } else {
            ExternalBlockHash::Bytes(u.arbitrary()?)
        })
    };
    let mut events = Vec::new();
    for _ in 0..u.int_in_range(0..=6)? {
        events.push(match u.int_in_range(0..=2)? {
            0 => {
                let n = u.int_in_range(0..=4)?;
                let block_hashes = (0..n).map(|_| hash(u)).collect::<arbitrary::Result<_>>()?;
                let parent_block_hash = if u.arbitrary()? { Some(hash(u)?) } else { None };
                let block_size: u32 = u.int_in_range(1..=4)?;
                let token_ids = (0..n * block_size as usize)
                    .map(|_| u.int_in_range(0..=3))
                    .collect::<arbitrary::Result<_>>()?;
                VllmEvent::BlockStored(BlockStored {
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    block_size,
                    lora_id: u.arbitrary()?,
                    medium: u.arbitrary()?,
                    lora_name: u.arbitrary()?,
                    cache_salt: None,
                    has_extra_keys: false,
                })
            }
            1 => VllmEvent::BlockRemoved(BlockRemoved {
                block_hashes: (0..u.int_in_range(0..=4)?)
                    .map(|_| hash(u))
                    .collect::<arbitrary::Result<_>>()?,
                medium: u.arbitrary()?,
            }),
            _ => VllmEvent::AllBlocksCleared,
        });
    }
    Ok(VllmEventBatch {
        ts: u.arbitrary()?,
        events,
        data_parallel_rank: u.arbitrary()?,
    })
}

/// Frames built from the fuzzer's choices, and multipart messages of any shape.
fn structured(u: &mut Unstructured) -> arbitrary::Result<()> {
    let block_size = u.int_in_range(1..=4)?;
    // Wrong part counts, short sequence parts.
    let parts: Vec<&[u8]> = (0..u.int_in_range(0..=4)?)
        .map(|_| {
            let len = u.int_in_range(0..=16)?;
            u.bytes(len)
        })
        .collect::<arbitrary::Result<_>>()?;
    let _ = decode_multipart(&parts);
    let mut frames = Vec::new();
    for _ in 0..u.int_in_range(1..=4)? {
        let seq = u.int_in_range(0..=5)?;
        let batch = arbitrary_batch(u)?;
        check_round_trip(&batch);
        frames.push(VllmFrame {
            topic: Vec::new(),
            seq,
            batch,
        });
    }
    feed(&frames, block_size);
    Ok(())
}

// Input: one mode byte, then either a raw msgpack payload (the wire; seeds are the test
// vectors' payloads) or the fuzzer's choices for `structured`.
fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    if mode & 1 == 0 {
        if let Ok(batch) = VllmEventBatch::decode(rest) {
            check_round_trip(&batch);
            let block_size = u32::from(mode >> 1).clamp(1, 64);
            // In order, then the same frame again (a restarted publisher).
            let frame = VllmFrame {
                topic: Vec::new(),
                seq: 0,
                batch,
            };
            let mut next = frame.clone();
            next.seq = 1;
            feed(&[frame.clone(), next, frame], block_size);
        }
    } else {
        let _ = structured(&mut Unstructured::new(rest));
    }
});
