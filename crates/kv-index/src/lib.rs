//! The KV index: which worker holds which prefix of which prompt.
//!
//! This crate is a sans-IO core: it never reads a clock, spawns, sleeps or does I/O. Everything
//! it knows arrives as arguments, so the same code runs in the real-time gateway and in the
//! virtual-time simulator.
//!
//! - [`hash`]: the block hashing scheme, a wire contract between gateway, router and workers.
//! - [`event`]: KV cache events (stored / removed / cleared) with per-worker sequence numbers.
//! - [`overlap`]: per-worker counts of a request's leading blocks found in cache.

pub mod event;
pub mod hash;
pub mod overlap;

pub use event::{BlockContent, EngineBlockId, KvEvent, KvEventKind, StoredBlock, WorkerId};
pub use hash::{
    BlockHasher, DEFAULT_BLOCK_SIZE, LOCAL_HASH_SEED, LocalBlockHash, SEQUENCE_HASH_SEED,
    SequenceHash,
};
pub use overlap::OverlapScores;
