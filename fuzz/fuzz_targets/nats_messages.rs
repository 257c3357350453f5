//! The messages gateways read from NATS (`protocol`): KV event batches, worker announcements,
//! heartbeats and goodbyes, and replica batches, snapshot requests and snapshot parts.
//!
//! Properties: decoders never panic and refuse what is over their bounds; whatever decodes
//! re-encodes to bytes that decode to the same message; a KV batch's events convert to index
//! events or are refused, and those events keep a small `KvIndex` consistent; a replica
//! batch built within the bounds (what a sender publishes) fits the size bound senders rely on
//! (`encoded_size_bound`) and round-trips.

#![no_main]

use arbitrary::Unstructured;
use kv_index::{IndexConfig, KvIndex};
use libfuzzer_sys::fuzz_target;
use protocol::replicas::{
    MAX_BATCH_UPDATES, MAX_KEY_BLOCKS, MAX_REPLICA_MESSAGE_BYTES, ReplicaBatch, SnapshotPart,
    SnapshotRequest, WireChange, WireUpdate, encoded_size_bound,
};
use protocol::{KvEventBatch, WorkerMessage};

fn kv_batch(bytes: &[u8]) {
    let Ok(batch) = KvEventBatch::decode(bytes) else {
        return;
    };
    let back = KvEventBatch::decode(&batch.encode()).expect("our own KV batch decodes");
    assert_eq!(back, batch);
    if let Ok(events) = batch.to_kv_events() {
        let mut index = KvIndex::new(IndexConfig {
            max_blocks: 64,
            max_workers: 4,
        });
        for event in &events {
            let _ = index.apply_resyncing(event);
        }
        index.check_invariants();
        // Back to the wire and again to events: the same events.
        let worker = kv_index::WorkerId(batch.worker);
        let again = KvEventBatch::from_events(worker, batch.instance, &events)
            .expect("one worker's events")
            .to_kv_events()
            .expect("converted events convert again");
        assert_eq!(again, events);
    }
}

fn worker_message(bytes: &[u8]) {
    let Ok(message) = WorkerMessage::decode(bytes) else {
        return;
    };
    let json = message.encode().expect("a decoded message encodes");
    match WorkerMessage::decode(&json) {
        Ok(back) => assert_eq!(back, message, "{}", String::from_utf8_lossy(&json)),
        Err(e) => panic!(
            "a decoded message, encoded, is refused: {e}: {}",
            String::from_utf8_lossy(&json)
        ),
    }
    let _ = message.worker();
    let _ = message.has_token(Some("secret"));
}

fn replica_messages(bytes: &[u8]) {
    if let Ok(batch) = ReplicaBatch::decode(bytes) {
        assert!(batch.updates.len() <= MAX_BATCH_UPDATES);
        assert_eq!(ReplicaBatch::decode(&batch.encode()).ok(), Some(batch));
    }
    if let Ok(request) = SnapshotRequest::decode(bytes) {
        assert_eq!(
            SnapshotRequest::decode(&request.encode()).ok(),
            Some(request)
        );
    }
    if let Ok(part) = SnapshotPart::decode(bytes) {
        assert!(part.requests.len() <= MAX_BATCH_UPDATES);
        assert_eq!(SnapshotPart::decode(&part.encode()).ok(), Some(part));
    }
}

/// A batch as a sender builds it: any values, prompts of up to `MAX_KEY_BLOCKS` blocks.
fn built_replica_batch(u: &mut Unstructured) -> arbitrary::Result<()> {
    let mut updates = Vec::new();
    let mut bound = encoded_size_bound(0);
    for _ in 0..u.int_in_range(0..=8)? {
        let change = match u.int_in_range(0..=2)? {
            0 => {
                // Mostly short prompts; sometimes the longest allowed.
                let blocks = if u.ratio(1, 16)? {
                    MAX_KEY_BLOCKS
                } else {
                    u.int_in_range(0..=8)?
                };
                let fill: u64 = u.arbitrary()?;
                WireChange::Routed {
                    worker: u.arbitrary()?,
                    num_tokens: u.arbitrary()?,
                    local: (0..blocks as u64)
                        .map(|i| fill.wrapping_mul(i + 1))
                        .collect(),
                }
            }
            1 => WireChange::FirstToken,
            _ => WireChange::Finished,
        };
        bound += match &change {
            WireChange::Routed { local, .. } => encoded_size_bound(local.len()),
            _ => encoded_size_bound(0),
        };
        updates.push(WireUpdate {
            seq: u.arbitrary()?,
            request: u.arbitrary()?,
            change,
        });
    }
    let batch = ReplicaBatch {
        replica: u.arbitrary()?,
        epoch: u.arbitrary()?,
        next_seq: u.arbitrary()?,
        sent_unix_ns: u.arbitrary()?,
        goodbye: u.arbitrary()?,
        updates,
    };
    let bytes = batch.encode();
    assert!(
        bytes.len() <= bound,
        "{} bytes, over the senders' bound of {bound}",
        bytes.len()
    );
    if bytes.len() <= MAX_REPLICA_MESSAGE_BYTES {
        assert_eq!(ReplicaBatch::decode(&bytes).ok(), Some(batch));
    }
    Ok(())
}

// Input: one byte choosing the decoder, then the message (seeds: the test vectors, each
// behind its decoder's byte).
fuzz_target!(|data: &[u8]| {
    let Some((&which, bytes)) = data.split_first() else {
        return;
    };
    match which % 4 {
        0 => kv_batch(bytes),
        1 => worker_message(bytes),
        2 => replica_messages(bytes),
        _ => {
            let _ = built_replica_batch(&mut Unstructured::new(bytes));
        }
    }
});
