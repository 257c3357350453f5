//! Router replicas over NATS: the updates gateway replicas send each other so they route as
//! one (the `router::replica` core's `PeerUpdate`s and `PeerSnapshot`s), in msgpack maps with
//! field names, like the KV event batches.
//!
//! ```text
//! ReplicaBatch      on kvroute.<ns>.replicas
//! {"replica": u32, "epoch": u64, "next_seq": u64, "sent_unix_ns": u64, "goodbye": bool,
//!  "updates": [{"seq": u64, "request": u64,
//!               "change": {"Routed": {"worker": u64, "num_tokens": u64, "local": [u64…]}}
//!                         | "FirstToken" | "Finished"}…]}
//!
//! SnapshotRequest   on kvroute.<ns>.replicas.snapshot, with a reply subject
//! {"replica": u32, "epoch": u64}
//!
//! SnapshotPart      to the reply subject, one or more per answering replica
//! {"replica": u32, "epoch": u64, "next_seq": u64, "part": u32, "last": bool,
//!  "requests": [{"request": u64, "worker": u64, "num_tokens": u64, "local": [u64…],
//!                "first_token": bool}…]}
//! ```
//!
//! `next_seq` in a batch is the sequence number its sender produces next: with NATS keeping
//! each publisher's order, a receiver that has not seen every update below it knows they are
//! lost. A batch without updates is a heartbeat; `goodbye` says the sender is stopping. A
//! prompt travels as its blocks' local hashes only: the receiver chains the sequence hashes
//! itself, as it does for KV events. Every message is bounded: [`MAX_REPLICA_MESSAGE_BYTES`]
//! on the wire, [`MAX_KEY_BLOCKS`] per prompt, [`MAX_BATCH_UPDATES`] per batch; decoders
//! refuse more, and garbage, with an error, never a panic.

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Largest replica message accepted or produced (NATS' default max payload is 1 MiB).
pub const MAX_REPLICA_MESSAGE_BYTES: usize = 1 << 20;
/// Most prompt blocks per request (the router core's `MAX_PEER_KEY_BLOCKS`).
pub const MAX_KEY_BLOCKS: usize = 4096;
/// Most updates in one batch, and requests in one snapshot part.
pub const MAX_BATCH_UPDATES: usize = 1024;

/// A batch of one replica's updates, in its sequence order (or none: a heartbeat).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaBatch {
    pub replica: u32,
    pub epoch: u64,
    /// The sequence number the sender produces next.
    pub next_seq: u64,
    /// The sender's wall clock when it published, in ns since the Unix epoch (sync lag).
    #[serde(default)]
    pub sent_unix_ns: u64,
    /// The sender is stopping: forget it and its requests.
    #[serde(default)]
    pub goodbye: bool,
    pub updates: Vec<WireUpdate>,
}

/// One update.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireUpdate {
    pub seq: u64,
    /// The sender's id for the request.
    pub request: u64,
    pub change: WireChange,
}

/// What happened to the request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum WireChange {
    Routed {
        worker: u64,
        num_tokens: u64,
        /// Local hashes of its prompt's full blocks.
        local: Vec<u64>,
    },
    FirstToken,
    Finished,
}

/// A starting (or resyncing) replica asks its peers for their in-flight requests.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotRequest {
    pub replica: u32,
    pub epoch: u64,
}

/// Part of one replica's answer to a [`SnapshotRequest`]; the receiver applies the parts
/// together once the `last` one came.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotPart {
    pub replica: u32,
    pub epoch: u64,
    /// The snapshot is current up to (not including) this update.
    pub next_seq: u64,
    pub part: u32,
    pub last: bool,
    pub requests: Vec<WireSnapshotRequest>,
}

/// One in-flight request of a snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireSnapshotRequest {
    pub request: u64,
    pub worker: u64,
    pub num_tokens: u64,
    pub local: Vec<u64>,
    pub first_token: bool,
}

/// A replica message that cannot be used.
#[derive(Debug, Error)]
pub enum ReplicaWireError {
    #[error("replica message of {0} bytes is over the limit of {MAX_REPLICA_MESSAGE_BYTES}")]
    TooLarge(usize),
    #[error("replica message is not valid msgpack of kvroute's format: {0}")]
    Decode(#[from] rmp_serde::decode::Error),
    #[error("replica message holds {0} updates or requests, over the limit of {MAX_BATCH_UPDATES}")]
    TooManyUpdates(usize),
    #[error("replica message holds a prompt of {0} blocks, over the limit of {MAX_KEY_BLOCKS}")]
    KeyTooLong(usize),
}

fn decode_bounded<T: for<'de> Deserialize<'de>>(bytes: &[u8]) -> Result<T, ReplicaWireError> {
    if bytes.len() > MAX_REPLICA_MESSAGE_BYTES {
        return Err(ReplicaWireError::TooLarge(bytes.len()));
    }
    Ok(rmp_serde::from_slice(bytes)?)
}

fn check_key(local: &[u64]) -> Result<(), ReplicaWireError> {
    if local.len() > MAX_KEY_BLOCKS {
        return Err(ReplicaWireError::KeyTooLong(local.len()));
    }
    Ok(())
}

fn encode_named<T: Serialize>(value: &T) -> Vec<u8> {
    // Plain integers, booleans and arrays to a Vec: cannot fail.
    rmp_serde::to_vec_named(value).unwrap_or_default()
}

/// Bytes an encoded update or snapshot request with a prompt of `blocks` blocks takes at most
/// (a message's own fields take at most `encoded_size_bound(0)` more): a bound senders use to
/// keep each message under [`MAX_REPLICA_MESSAGE_BYTES`] without encoding twice.
pub fn encoded_size_bound(blocks: usize) -> usize {
    // Field names and up to five u64s (≤ 9 bytes each), then ≤ 9 bytes per hash.
    96 + 9 * blocks
}

impl ReplicaBatch {
    pub fn encode(&self) -> Vec<u8> {
        encode_named(self)
    }

    /// Parses and checks the bounds.
    pub fn decode(bytes: &[u8]) -> Result<ReplicaBatch, ReplicaWireError> {
        let batch: ReplicaBatch = decode_bounded(bytes)?;
        if batch.updates.len() > MAX_BATCH_UPDATES {
            return Err(ReplicaWireError::TooManyUpdates(batch.updates.len()));
        }
        for update in &batch.updates {
            if let WireChange::Routed { local, .. } = &update.change {
                check_key(local)?;
            }
        }
        Ok(batch)
    }
}

impl SnapshotRequest {
    pub fn encode(&self) -> Vec<u8> {
        encode_named(self)
    }

    pub fn decode(bytes: &[u8]) -> Result<SnapshotRequest, ReplicaWireError> {
        decode_bounded(bytes)
    }
}

impl SnapshotPart {
    pub fn encode(&self) -> Vec<u8> {
        encode_named(self)
    }

    /// Parses and checks the bounds.
    pub fn decode(bytes: &[u8]) -> Result<SnapshotPart, ReplicaWireError> {
        let part: SnapshotPart = decode_bounded(bytes)?;
        if part.requests.len() > MAX_BATCH_UPDATES {
            return Err(ReplicaWireError::TooManyUpdates(part.requests.len()));
        }
        for request in &part.requests {
            check_key(&request.local)?;
        }
        Ok(part)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(blocks: usize) -> ReplicaBatch {
        ReplicaBatch {
            replica: 3,
            epoch: 1_700_000_000_000_000_000,
            next_seq: 3,
            sent_unix_ns: 42,
            goodbye: false,
            updates: vec![
                WireUpdate {
                    seq: 0,
                    request: 9,
                    change: WireChange::Routed {
                        worker: 2,
                        num_tokens: 100,
                        local: (0..blocks as u64)
                            .map(|b| b.wrapping_mul(u64::MAX / 7))
                            .collect(),
                    },
                },
                WireUpdate {
                    seq: 1,
                    request: 9,
                    change: WireChange::FirstToken,
                },
                WireUpdate {
                    seq: 2,
                    request: 9,
                    change: WireChange::Finished,
                },
            ],
        }
    }

    #[test]
    fn messages_round_trip_within_their_size_bound() {
        let b = batch(MAX_KEY_BLOCKS);
        let bytes = b.encode();
        assert_eq!(ReplicaBatch::decode(&bytes).unwrap(), b);
        // The sender's estimate bounds the encoding (three updates, one with a long key).
        assert!(bytes.len() <= 3 * encoded_size_bound(0) + encoded_size_bound(MAX_KEY_BLOCKS));
        let part = SnapshotPart {
            replica: 1,
            epoch: 2,
            next_seq: 5,
            part: 0,
            last: true,
            requests: vec![WireSnapshotRequest {
                request: 1,
                worker: 2,
                num_tokens: 64,
                local: vec![u64::MAX; 4],
                first_token: true,
            }],
        };
        let bytes = part.encode();
        // A part's own fields take one more bound's worth.
        assert!(bytes.len() <= encoded_size_bound(0) + encoded_size_bound(4));
        assert_eq!(SnapshotPart::decode(&bytes).unwrap(), part);
        let request = SnapshotRequest {
            replica: 1,
            epoch: 2,
        };
        assert_eq!(SnapshotRequest::decode(&request.encode()).unwrap(), request);
    }

    #[test]
    fn oversize_and_malformed_messages_are_errors() {
        let long = batch(MAX_KEY_BLOCKS + 1).encode();
        assert!(matches!(
            ReplicaBatch::decode(&long),
            Err(ReplicaWireError::KeyTooLong(4097))
        ));
        let huge = vec![0u8; MAX_REPLICA_MESSAGE_BYTES + 1];
        assert!(matches!(
            ReplicaBatch::decode(&huge),
            Err(ReplicaWireError::TooLarge(_))
        ));
        let mut many = batch(1);
        many.updates = vec![many.updates[2].clone(); MAX_BATCH_UPDATES + 1];
        assert!(matches!(
            ReplicaBatch::decode(&many.encode()),
            Err(ReplicaWireError::TooManyUpdates(_))
        ));
        let bytes = batch(8).encode();
        for cut in [0, 1, bytes.len() / 2, bytes.len() - 1] {
            assert!(ReplicaBatch::decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        assert!(SnapshotPart::decode(b"\xc1garbage").is_err());
        assert!(SnapshotRequest::decode(&[]).is_err());
    }
}
