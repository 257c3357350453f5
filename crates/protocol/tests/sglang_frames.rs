//! SGLang's ZMQ KV event frames, written byte by byte from its published schema
//! (`python/sglang/srt/disaggregation/kv_events.py`: msgspec structs with `array_like=True`,
//! at sgl-project/sglang 006d053 and at the later layout with `medium`, `attn_dp_rank` and
//! `BlockStoredWithMetadata`), decoded by the same codec as vLLM's and fed to a real
//! `KvIndex`. The bytes are spelled out rather than produced by an encoder, so these tests pin
//! the wire itself: msgspec writes the shortest integer forms, `ts` as a float64, structs as
//! fixarrays with the tag first.

use kv_index::{BlockHasher, IndexConfig, KvIndex, WorkerId};
use protocol::vllm::{
    ExternalBlockHash, VllmConvertError, VllmDecodeError, VllmEvent, VllmEventBatch,
    VllmEventStream, decode_multipart,
};

/// SGLang's page size in these frames (its `--page-size`, the router's block size).
const PAGE: u32 = 4;

/// msgpack fixstr.
fn fixstr(text: &str) -> Vec<u8> {
    assert!(text.len() < 32);
    let mut out = vec![0xa0 | text.len() as u8];
    out.extend_from_slice(text.as_bytes());
    out
}

/// msgpack int64 (`0xd3`), as msgspec writes a hash below -2^31.
fn int64(value: i64) -> Vec<u8> {
    let mut out = vec![0xd3];
    out.extend_from_slice(&value.to_be_bytes());
    out
}

/// `ts` = 1_700_000_000.5 as a msgpack float64.
fn ts() -> Vec<u8> {
    let mut out = vec![0xcb];
    out.extend_from_slice(&1_700_000_000.5f64.to_be_bytes());
    out
}

/// One page's `BlockStored` in the later layout: `[tag, [hash], parent, tokens, page_size,
/// lora_id, medium]`, tokens `first..first + PAGE` (positive fixints).
fn stored_page(hash: i64, parent: Option<i64>, first: u8, medium: &str) -> Vec<u8> {
    let mut out = vec![0x97];
    out.extend(fixstr("BlockStored"));
    out.push(0x91);
    out.extend(int64(hash));
    match parent {
        Some(p) => out.extend(int64(p)),
        None => out.push(0xc0),
    }
    out.push(0x90 | PAGE as u8);
    out.extend(first..first + PAGE as u8);
    out.push(PAGE as u8); // block_size
    out.push(0xc0); // lora_id: None
    out.extend(fixstr(medium));
    out
}

/// A later-layout batch: `[ts, [events…], attn_dp_rank]`.
fn batch(events: &[Vec<u8>], attn_dp_rank: u8) -> Vec<u8> {
    let mut out = vec![0x93];
    out.extend(ts());
    out.push(0x90 | events.len() as u8);
    for e in events {
        out.extend_from_slice(e);
    }
    out.push(attn_dp_rank);
    out
}

fn frame(seq: u64, payload: Vec<u8>) -> Vec<Vec<u8>> {
    // SGLang's default topic is "", like vLLM's.
    vec![Vec::new(), seq.to_be_bytes().to_vec(), payload]
}

/// Hashes as later SGLang sends them: the first 8 bytes of a SHA-256, as a signed int64
/// (`hash_str_to_int64`), so about half are negative.
const H1: i64 = -0x5a5a_5a5a_5a5a_5a5b;
const H2: i64 = 0x1234_5678_9abc_def0;
const H3: i64 = -0x7000_0000_0000_0001;

#[test]
fn later_sglang_pages_decode_and_feed_the_index() {
    // Three pages of one prompt, one BlockStored each, chained by the previous page's hash.
    let payload = batch(
        &[
            stored_page(H1, None, 0, "GPU"),
            stored_page(H2, Some(H1), 4, "GPU"),
            stored_page(H3, Some(H2), 8, "GPU"),
        ],
        0,
    );
    let decoded = decode_multipart(&frame(7, payload)).unwrap();
    assert_eq!(decoded.seq, 7);
    assert_eq!(decoded.batch.ts, 1_700_000_000.5);
    assert_eq!(decoded.batch.data_parallel_rank, Some(0), "attn_dp_rank");
    let VllmEvent::BlockStored(second) = &decoded.batch.events[1] else {
        panic!("{:?}", decoded.batch.events)
    };
    assert_eq!(second.block_hashes, vec![ExternalBlockHash::Int(H2 as u64)]);
    assert_eq!(
        second.parent_block_hash,
        Some(ExternalBlockHash::Int(H1 as u64))
    );
    assert_eq!(second.token_ids, vec![4, 5, 6, 7]);
    assert_eq!(second.medium.as_deref(), Some("GPU"));
    assert_eq!(second.cache_salt, None);

    let mut stream = VllmEventStream::new(WorkerId(2), PAGE);
    let accepted = stream.accept(&decoded).unwrap();
    assert_eq!(accepted.events.len(), 3);
    let mut index = KvIndex::new(IndexConfig::default());
    for event in &accepted.events {
        index.apply(event).unwrap();
    }
    // The index hashes the tokens itself: a prompt of 0..14 starts with all three pages.
    let request = BlockHasher::new(PAGE as usize)
        .unwrap()
        .sequence_hashes(&(0..14).collect::<Vec<u32>>());
    assert_eq!(index.find_matches(&request).get(WorkerId(2)), 3);

    // Removing the middle page (`["BlockRemoved", [hash], medium]`) cuts the prefix there.
    let mut removed = vec![0x93];
    removed.extend(fixstr("BlockRemoved"));
    removed.push(0x91);
    removed.extend(int64(H2));
    removed.extend(fixstr("GPU"));
    let accepted = stream
        .accept(&decode_multipart(&frame(8, batch(&[removed], 0))).unwrap())
        .unwrap();
    for event in &accepted.events {
        index.apply(event).unwrap();
    }
    assert_eq!(index.find_matches(&request).get(WorkerId(2)), 1);
}

#[test]
fn the_oldest_sglang_layout_decodes() {
    // sgl-project/sglang 006d053: `[ts, events]`, BlockStored ends at `lora_id`, BlockRemoved
    // carries only hashes, and hashes are Python's `hash` of the page (small ones here).
    let mut stored = vec![0x96];
    stored.extend(fixstr("BlockStored"));
    stored.extend([0x91, 0x05, 0xc0, 0x94, 1, 2, 3, 4, PAGE as u8, 0xc0]);
    let mut removed = vec![0x92];
    removed.extend(fixstr("BlockRemoved"));
    removed.extend([0x91, 0x05]);
    let mut cleared = vec![0x91];
    cleared.extend(fixstr("AllBlocksCleared"));
    let mut payload = vec![0x92];
    payload.extend(ts());
    payload.push(0x93);
    payload.extend(stored);
    payload.extend(removed);
    payload.extend(cleared);

    let batch = VllmEventBatch::decode(&payload).unwrap();
    assert_eq!(batch.data_parallel_rank, None);
    let [
        VllmEvent::BlockStored(s),
        VllmEvent::BlockRemoved(r),
        VllmEvent::AllBlocksCleared,
    ] = &batch.events[..]
    else {
        panic!("{:?}", batch.events)
    };
    assert_eq!(s.block_hashes, vec![ExternalBlockHash::Int(5)]);
    assert_eq!((s.medium.as_deref(), s.lora_id), (None, None));
    assert_eq!(r.block_hashes, vec![ExternalBlockHash::Int(5)]);
    assert_eq!(r.medium, None);
    let accepted = VllmEventStream::new(WorkerId(1), PAGE)
        .accept(&decode_multipart(&frame(0, payload)).unwrap())
        .unwrap();
    assert_eq!(accepted.events.len(), 3, "no medium means the GPU cache");
}

#[test]
fn salted_pages_and_lower_tiers_are_skipped_not_indexed() {
    // BlockStoredWithMetadata: the later layout plus `{"cache_salt": "tenant-a"}` in slot 8,
    // where vLLM has `lora_name`. A request without that salt cannot reuse the page.
    let mut salted = stored_page(H1, None, 0, "GPU");
    salted[0] = 0x98;
    salted.push(0x81);
    salted.extend(fixstr("cache_salt"));
    salted.extend(fixstr("tenant-a"));
    let host = stored_page(H2, None, 0, "CPU_PINNED");
    let disk = stored_page(H3, None, 0, "DISK");
    let decoded = decode_multipart(&frame(0, batch(&[salted, host, disk], 0))).unwrap();
    let VllmEvent::BlockStored(first) = &decoded.batch.events[0] else {
        panic!()
    };
    assert_eq!(first.cache_salt.as_deref(), Some("tenant-a"));
    assert_eq!(first.lora_name, None);
    let accepted = VllmEventStream::new(WorkerId(1), PAGE)
        .accept(&decoded)
        .unwrap();
    assert!(accepted.events.is_empty());
    assert_eq!(accepted.skipped, 3);
}

#[test]
fn sglangs_default_page_size_is_refused_with_what_to_do() {
    // SGLang's default `--page-size` is 1: one token per BlockStored.
    let mut one_token = vec![0x97];
    one_token.extend(fixstr("BlockStored"));
    one_token.extend([0x91, 0x09, 0xc0, 0x91, 42, 1, 0xc0]);
    one_token.extend(fixstr("GPU"));
    let refused = VllmEventStream::new(WorkerId(1), PAGE)
        .accept(&decode_multipart(&frame(0, batch(&[one_token], 0))).unwrap());
    assert_eq!(
        refused,
        Err(VllmConvertError::BlockSize {
            expected: PAGE,
            got: 1
        })
    );
    let message = refused.unwrap_err().to_string();
    assert!(message.contains("set the router's block size"), "{message}");
}

#[test]
fn malformed_sglang_frames_are_clear_errors() {
    // Metadata that is not a map.
    let mut bad_metadata = stored_page(H1, None, 0, "GPU");
    bad_metadata[0] = 0x98;
    bad_metadata.push(0x07);
    let error = VllmEventBatch::decode(&batch(&[bad_metadata], 0)).unwrap_err();
    assert!(
        matches!(&error, VllmDecodeError::Shape { path, .. } if path.contains("lora_name")),
        "{error}"
    );
    // A salt that is not a string.
    let mut bad_salt = stored_page(H1, None, 0, "GPU");
    bad_salt[0] = 0x98;
    bad_salt.push(0x81);
    bad_salt.extend(fixstr("cache_salt"));
    bad_salt.push(0x01);
    let error = VllmEventBatch::decode(&batch(&[bad_salt], 0)).unwrap_err();
    assert!(
        matches!(&error, VllmDecodeError::Shape { path, .. } if path.ends_with("metadata.cache_salt")),
        "{error}"
    );
    // A page whose token list is cut short mid-stream.
    let whole = batch(&[stored_page(H1, None, 0, "GPU")], 0);
    for cut in 1..whole.len() {
        assert!(
            VllmEventBatch::decode(&whole[..cut]).is_err(),
            "{cut} bytes"
        );
    }
    // A hash that is neither an integer nor bytes.
    let mut string_hash = vec![0x97];
    string_hash.extend(fixstr("BlockStored"));
    string_hash.push(0x91);
    string_hash.extend(fixstr("abc"));
    string_hash.extend([0xc0, 0x94, 0, 1, 2, 3, PAGE as u8, 0xc0]);
    string_hash.extend(fixstr("GPU"));
    let error = VllmEventBatch::decode(&batch(&[string_hash], 0)).unwrap_err();
    assert!(error.to_string().contains("block_hashes[0]"), "{error}");
}
