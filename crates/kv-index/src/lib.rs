//! The KV index: which worker holds which prefix of which prompt.
//!
//! This crate is a sans-IO core: it never reads a clock, spawns, sleeps or does I/O. Everything
//! it knows arrives as arguments, so the same code runs in the real-time gateway and in the
//! virtual-time simulator.
//!
//! - [`hash`]: the block hashing scheme, a wire contract between gateway, router and workers.
//! - [`event`]: KV cache events (stored / removed / cleared) with per-worker sequence numbers.
//! - [`index`]: [`KvIndex`], the global prefix index fed by those events.
//! - [`overlap`]: per-worker counts of a request's leading blocks found in cache.
//! - [`mirror`]: a publisher's copy of its own cache, for consumers that join late.
//! - [`sync`]: [`StreamSync`], when a consumer asks a worker for that copy and what it holds
//!   meanwhile: the gap-and-snapshot decision every driver shares.
//!
//! # Block hashing (wire contract, version 1)
//!
//! Tokens are cut into blocks of `B` tokens (default 32); a partial last block is never hashed.
//! Block `i` has a local hash `L(i)` = XXH3-64 of its token ids as little-endian `u32` bytes,
//! seed [`LOCAL_HASH_SEED`], and a sequence hash `S(0) = L(0)`,
//! `S(i) = XXH3-64(S(i-1) LE ‖ L(i) LE)` with seed [`SEQUENCE_HASH_SEED`]. Equal sequence
//! hash ⇔ equal prefix (up to 64-bit collisions). Details and pinned test vectors: [`hash`].
//!
//! # The index
//!
//! [`KvIndex`] keeps, for every sequence hash, the set of workers holding that block; and, per
//! worker, a map from the engine's block id to the sequence hash the index computed for it.
//! [`KvIndex::find_matches`] answers, for a request's sequence hashes, how many *leading*
//! blocks each worker holds: worker `w` scores `k` iff it holds blocks `0..k` and not block `k`.
//! Because a sequence hash names a whole prefix, this is one hash-map lookup per block, walked
//! in order and stopped as soon as no worker is still matching.
//!
//! # Event semantics
//!
//! - `Stored { parent, blocks }`: the index recomputes each block's sequence hash from the
//!   parent's (looked up by engine id in *that worker's* map) and the block's tokens or local
//!   hash; it never trusts the engine's own hash. If `parent` is `Some` but unknown to that
//!   worker (e.g. vLLM stored a child after evicting its parent, or the parent was evicted by
//!   our bound), the whole event's blocks are **skipped** and counted as `unknown_parent`:
//!   their sequence hashes cannot be computed, and they could never be part of a leading
//!   prefix for that worker anyway until the parent is stored again. Any content the worker
//!   held under those ids before is dropped, since the event says the ids name new content.
//! - Storing an id the worker already holds with the same content is idempotent (it only
//!   refreshes recency). Storing it with different content replaces the old content.
//! - `Removed { blocks }`: drops those ids; ids the worker does not hold are counted as
//!   `unknown_removals` and ignored. Removing a block in the middle of a chain is allowed:
//!   the worker then simply stops matching at that block.
//! - `Cleared`: drops all of the worker's blocks.
//! - One worker may name the same content under several engine ids (e.g. LoRA variants that
//!   our hash does not see): it holds the block until the last of those ids is removed.
//!
//! # Sequence numbers and the gap policy
//!
//! Each worker's events carry `seq` = 0, 1, 2, … The first event seen from a worker sets the
//! baseline (any `seq`), then each event must carry the previous `seq + 1`:
//!
//! - `seq` lower than expected: a duplicate or late event, [`EventError::Stale`], ignored.
//! - `seq` higher than expected: events were lost or reordered, [`EventError::Gap`]. The event
//!   is **not applied** and the expected `seq` does not move, so every later event also fails
//!   with `Gap` (unless the missing one turns up, which repairs a reorder). The index cannot
//!   know what it missed, so the caller decides: call [`KvIndex::clear_worker`] (drops the
//!   worker's blocks, the next event sets a new baseline) and resync, e.g. by asking the worker
//!   to re-emit its cache state. Until then the worker's entries are left as they were.
//!
//! # Memory bound and eviction rule
//!
//! [`IndexConfig::max_blocks`] bounds the number of (worker, engine block) entries, and with
//! it every per-block map in the index (≈ 150 bytes per entry; default 4 Mi entries ≈ 600 MiB).
//! [`IndexConfig::max_workers`] bounds the known workers: an event from one more new worker is
//! refused with [`EventError::TooManyWorkers`]. When a store would exceed `max_blocks`, the
//! index evicts **the least
//! recently stored leaf**: an entry of which the same worker holds no child entry, ordered by
//! when it was stored or last re-stored. When a leaf's last child leaves (evicted or removed)
//! the parent becomes a leaf at the *cold* end, since it is at least as old as that child. So
//! chains are evicted from their tip backwards, least recently extended chain first, and a
//! worker's prefix is never holed by eviction. (A hole could only make a worker score *less*:
//! `find_matches` requires every earlier block, so the index never over-reports.)
//! An evicted entry behaves as if the worker had removed it: a later `Removed` for it counts
//! as an unknown removal and a later child of it as an unknown parent.
//!
//! # Cost
//!
//! `find_matches` is one FxHash lookup per request block plus a merge of sorted worker-slot
//! lists where the set of matching workers changes; it stops at the first block no remaining
//! worker holds. Whether the set changes is decided in O(1) by comparing the sets' sizes and
//! 64-bit fingerprints (a sum of mixed slot ids kept with each holder set), so a prefix cached
//! on a thousand workers costs no more per block than one cached on one; like sequence
//! hashes, this trusts 64-bit hashes not to collide. `find_matches_for_tokens` hashes lazily, so unmatched tails are never
//! hashed. Storing or removing a block is O(1) (a few hash-map operations); clearing or
//! removing a worker is O(its entries). `cargo bench -p kv-index` measures all of these.

pub mod event;
pub mod hash;
pub mod index;
pub mod mirror;
pub mod overlap;
pub mod sync;

pub use event::{
    BlockContent, EngineBlockId, KvEvent, KvEventKind, RequestId, StoredBlock, WorkerId,
};
pub use hash::{
    BlockHasher, DEFAULT_BLOCK_SIZE, LOCAL_HASH_SEED, LocalBlockHash, SEQUENCE_HASH_SEED,
    SequenceHash,
};
pub use index::{
    ApplyOutcome, DEFAULT_MAX_BLOCKS, DEFAULT_MAX_WORKERS, EventError, IndexConfig, IndexCounters,
    KvIndex,
};
pub use mirror::{CacheMirror, MAX_MIRROR_BLOCKS};
pub use overlap::OverlapScores;
pub use sync::{EventSink, FirstWord, Snapshot, StreamSync, SyncStep};
