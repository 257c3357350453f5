//! Block hashing: the wire contract between gateway, router and workers.
//!
//! # The scheme (version 1)
//!
//! A prompt is a sequence of token ids (`u32`). It is cut into blocks of `block_size` tokens
//! (default [`DEFAULT_BLOCK_SIZE`] = 32). The last block, if partial, is **not** hashed: engines
//! only cache full blocks, so a partial block can never be matched.
//!
//! For block `i` with tokens `t[i*B .. (i+1)*B]`:
//!
//! - **local hash** `L(i)` = XXH3-64 over the block's token ids written as little-endian `u32`
//!   bytes (4·B bytes), with seed [`LOCAL_HASH_SEED`]. It depends on the block's tokens only.
//! - **sequence hash** `S(i)`:
//!   - `S(0) = L(0)`;
//!   - `S(i) = XXH3-64(S(i-1) as 8 LE bytes ‖ L(i) as 8 LE bytes)` with seed
//!     [`SEQUENCE_HASH_SEED`], for `i > 0`.
//!
//! Two blocks have equal sequence hashes exactly when (up to 64-bit collisions) the whole prefix
//! up to and including them is equal. The index is keyed by sequence hash, so a flat map answers
//! prefix questions without a tree.
//!
//! Test vectors (block size 32, tokens `0, 1, 2, …, 63`): `S(0) = 0x7949379a13dba8d2`,
//! `S(1) = 0xa6316d8655c998ff`. They are pinned in this module's tests: changing them is a
//! breaking wire change.

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::{Xxh3, xxh3_64_with_seed};

/// Default number of tokens per KV block (seed 002: `DYN_KV_CACHE_BLOCK_SIZE=32`).
pub const DEFAULT_BLOCK_SIZE: usize = 32;

/// Seed of the XXH3-64 hash over one block's token bytes ("kvroute" in ASCII, plus version 1).
pub const LOCAL_HASH_SEED: u64 = 0x6b76_726f_7574_6501;

/// Seed of the XXH3-64 hash that chains a parent's sequence hash with a child's local hash.
pub const SEQUENCE_HASH_SEED: u64 = 0x6b76_726f_7574_6502;

/// Hash of one block's tokens, independent of what precedes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct LocalBlockHash(pub u64);

/// Hash of a block together with its entire prefix: equal sequence hash ⇔ equal prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct SequenceHash(pub u64);

impl LocalBlockHash {
    /// Local hash of one block of token ids (any length; callers pass full blocks).
    pub fn of_tokens(tokens: &[u32]) -> Self {
        // Token ids are hashed as little-endian bytes so the hash is the same on every platform;
        // on little-endian targets the in-memory bytes already are that encoding.
        #[cfg(target_endian = "little")]
        {
            LocalBlockHash(xxh3_64_with_seed(as_le_bytes(tokens), LOCAL_HASH_SEED))
        }
        #[cfg(not(target_endian = "little"))]
        {
            local_hash_portable(tokens)
        }
    }
}

#[cfg(target_endian = "little")]
fn as_le_bytes(tokens: &[u32]) -> &[u8] {
    let len = std::mem::size_of_val(tokens);
    // SAFETY: pointer and length come from a live slice; u8 has alignment 1 and no invalid
    // values, and the returned slice borrows `tokens`, so it cannot outlive it.
    unsafe { std::slice::from_raw_parts(tokens.as_ptr().cast::<u8>(), len) }
}

impl SequenceHash {
    /// Sequence hash of a block whose parent has sequence hash `parent` (`None` for the first
    /// block of a prompt).
    pub fn chain(parent: Option<SequenceHash>, local: LocalBlockHash) -> Self {
        match parent {
            None => SequenceHash(local.0),
            Some(parent) => {
                let mut bytes = [0u8; 16];
                bytes[..8].copy_from_slice(&parent.0.to_le_bytes());
                bytes[8..].copy_from_slice(&local.0.to_le_bytes());
                SequenceHash(xxh3_64_with_seed(&bytes, SEQUENCE_HASH_SEED))
            }
        }
    }
}

/// Cuts token sequences into blocks and hashes them with the scheme above.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockHasher {
    block_size: usize,
}

impl Default for BlockHasher {
    fn default() -> Self {
        Self {
            block_size: DEFAULT_BLOCK_SIZE,
        }
    }
}

impl BlockHasher {
    /// A hasher for blocks of `block_size` tokens. Returns `None` for a block size of zero.
    pub fn new(block_size: usize) -> Option<Self> {
        (block_size > 0).then_some(Self { block_size })
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Number of full blocks in a prompt of `num_tokens` tokens.
    pub fn full_blocks(&self, num_tokens: usize) -> usize {
        num_tokens / self.block_size
    }

    /// Local hashes of every full block of `tokens`, in order.
    pub fn local_hashes(&self, tokens: &[u32]) -> Vec<LocalBlockHash> {
        tokens
            .chunks_exact(self.block_size)
            .map(LocalBlockHash::of_tokens)
            .collect()
    }

    /// Sequence hashes of every full block of `tokens`, in order.
    pub fn sequence_hashes(&self, tokens: &[u32]) -> Vec<SequenceHash> {
        let mut out = Vec::with_capacity(self.full_blocks(tokens.len()));
        self.extend_sequence_hashes(None, tokens, &mut out);
        out
    }

    /// Appends to `out` the sequence hashes of the full blocks of `tokens`, chained from
    /// `parent` (the sequence hash of the block just before `tokens`, if any). Lets a caller
    /// hash a growing sequence incrementally, block by block, without rehashing its prefix.
    pub fn extend_sequence_hashes(
        &self,
        parent: Option<SequenceHash>,
        tokens: &[u32],
        out: &mut Vec<SequenceHash>,
    ) {
        let mut parent = parent;
        for block in tokens.chunks_exact(self.block_size) {
            let seq = SequenceHash::chain(parent, LocalBlockHash::of_tokens(block));
            out.push(seq);
            parent = Some(seq);
        }
    }
}

/// Sequence hashes of a chain of local hashes starting after `parent`.
pub fn chain_local_hashes(
    parent: Option<SequenceHash>,
    locals: impl IntoIterator<Item = LocalBlockHash>,
) -> impl Iterator<Item = SequenceHash> {
    let mut parent = parent;
    locals.into_iter().map(move |local| {
        let seq = SequenceHash::chain(parent, local);
        parent = Some(seq);
        seq
    })
}

/// The encoding spelled out byte by byte: used on big-endian targets, and checked against the
/// fast path in tests so the two cannot drift apart.
#[cfg_attr(target_endian = "little", allow(dead_code))]
fn local_hash_portable(tokens: &[u32]) -> LocalBlockHash {
    let mut hasher = Xxh3::with_seed(LOCAL_HASH_SEED);
    for t in tokens {
        hasher.update(&t.to_le_bytes());
    }
    LocalBlockHash(hasher.digest())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_last_block_is_not_hashed() {
        let hasher = BlockHasher::new(4).unwrap();
        assert_eq!(hasher.sequence_hashes(&[1, 2, 3]).len(), 0);
        assert_eq!(hasher.sequence_hashes(&[1, 2, 3, 4, 5, 6, 7]).len(), 1);
        assert_eq!(hasher.sequence_hashes(&[1, 2, 3, 4, 5, 6, 7, 8]).len(), 2);
    }

    #[test]
    fn zero_block_size_is_rejected() {
        assert!(BlockHasher::new(0).is_none());
    }

    #[test]
    fn equal_sequence_hash_iff_equal_prefix() {
        let hasher = BlockHasher::new(2).unwrap();
        let a = hasher.sequence_hashes(&[1, 2, 3, 4, 5, 6]);
        let b = hasher.sequence_hashes(&[1, 2, 3, 4, 9, 9]);
        let c = hasher.sequence_hashes(&[7, 7, 3, 4, 5, 6]);
        assert_eq!(a[..2], b[..2]);
        assert_ne!(a[2], b[2]);
        // Same block content after a different prefix is a different sequence.
        assert_ne!(a[1], c[1]);
        assert_ne!(a[2], c[2]);
        // ...but the same local hash.
        assert_eq!(
            LocalBlockHash::of_tokens(&[3, 4]),
            hasher.local_hashes(&[7, 7, 3, 4])[1]
        );
    }

    #[test]
    fn incremental_hashing_matches_one_shot() {
        let hasher = BlockHasher::new(3).unwrap();
        let tokens: Vec<u32> = (0..30).collect();
        let whole = hasher.sequence_hashes(&tokens);
        let mut parts = hasher.sequence_hashes(&tokens[..9]);
        let parent = parts.last().copied();
        hasher.extend_sequence_hashes(parent, &tokens[9..], &mut parts);
        assert_eq!(whole, parts);
        let chained: Vec<_> = chain_local_hashes(None, hasher.local_hashes(&tokens)).collect();
        assert_eq!(whole, chained);
    }

    #[test]
    fn fast_path_matches_portable_encoding() {
        let tokens: Vec<u32> = (0..32).map(|i| i * 0x0101_0101 + 7).collect();
        assert_eq!(
            LocalBlockHash::of_tokens(&tokens),
            local_hash_portable(&tokens)
        );
    }

    /// Pinned test vectors: the scheme is a wire contract. If this test fails, you changed the
    /// hashing scheme; bump the seeds' version byte and tell every event producer.
    #[test]
    fn pinned_test_vectors() {
        let tokens: Vec<u32> = (0..64).collect();
        let hasher = BlockHasher::default();
        let seq = hasher.sequence_hashes(&tokens);
        let local = hasher.local_hashes(&tokens);
        assert_eq!(
            local[0].0,
            xxh3_64_with_seed(
                &(0u32..32).flat_map(u32::to_le_bytes).collect::<Vec<u8>>(),
                LOCAL_HASH_SEED
            )
        );
        assert_eq!(seq[0].0, local[0].0);
        let mut chained = [0u8; 16];
        chained[..8].copy_from_slice(&seq[0].0.to_le_bytes());
        chained[8..].copy_from_slice(&local[1].0.to_le_bytes());
        assert_eq!(seq[1].0, xxh3_64_with_seed(&chained, SEQUENCE_HASH_SEED));
        assert_eq!(
            (seq[0].0, seq[1].0),
            (PINNED_SEQ_0, PINNED_SEQ_1),
            "hash scheme changed: got {:#018x}, {:#018x}",
            seq[0].0,
            seq[1].0
        );
    }

    const PINNED_SEQ_0: u64 = 0x7949_379a_13db_a8d2;
    const PINNED_SEQ_1: u64 = 0xa631_6d86_55c9_98ff;
}
