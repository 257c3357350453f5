//! KV cache events: what a worker tells the router about its prefix cache.
//!
//! A worker emits an event whenever blocks enter its prefix cache ([`KvEventKind::Stored`]),
//! leave it ([`KvEventKind::Removed`]) or the whole cache is dropped ([`KvEventKind::Cleared`]).
//! Every event carries a per-worker sequence number, starting at 0 and increasing by one per
//! event, so a consumer detects a lost or reordered event and can resynchronise instead of
//! keeping a silently wrong index.
//!
//! Blocks are named in events by the engine's own block id ([`EngineBlockId`]: vLLM's block
//! hash, SGLang's node id, or our engine simulator's sequence hash). The index never trusts the
//! engine's hash function: it recomputes [`SequenceHash`]es from the
//! blocks' tokens (or local hashes) and the parent chain, and keeps a per-worker map from engine
//! block id to sequence hash to resolve parents and removals.

use serde::{Deserialize, Serialize};

use crate::hash::{BlockHasher, LocalBlockHash, SequenceHash};

/// A `u64` id newtype, serialized as the bare number and displayed as `{prefix}-{n}`.
macro_rules! id_type {
    ($(#[$doc:meta])* $name:ident, $prefix:literal) => {
        $(#[$doc])*
        #[derive(
            Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize,
            Deserialize,
        )]
        #[serde(transparent)]
        pub struct $name(pub u64);

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, concat!($prefix, "-{}"), self.0)
            }
        }
    };
}

id_type!(
    /// Identifies a worker (one engine instance) across the whole system.
    WorkerId,
    "worker"
);

id_type!(
    /// Identifies a request among those in flight (the caller's id: the gateway's, the
    /// simulator's issue handle). One type for the engine and the router, so a driver passes
    /// the same id to both; it lives here because both already depend on this crate.
    RequestId,
    "request"
);

/// The engine's own name for a cached block, opaque to the index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct EngineBlockId(pub u64);

/// What an event says about a stored block's content.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum BlockContent {
    /// The block's token ids (vLLM and SGLang events carry them). The index hashes them.
    Tokens(Vec<u32>),
    /// The block's local hash, already computed with this crate's scheme (our own engines).
    LocalHash(LocalBlockHash),
}

impl BlockContent {
    /// The block's local hash under this crate's scheme.
    pub fn local_hash(&self) -> LocalBlockHash {
        match self {
            BlockContent::Tokens(tokens) => LocalBlockHash::of_tokens(tokens),
            BlockContent::LocalHash(hash) => *hash,
        }
    }
}

/// One block entering a worker's prefix cache.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredBlock {
    /// The engine's id for this block; later `Removed` events and child `Stored` events use it.
    pub id: EngineBlockId,
    /// The block's tokens or local hash.
    pub content: BlockContent,
}

impl StoredBlock {
    /// A block named as our own engines name it: id = its sequence hash, content = its local
    /// hash.
    pub fn from_hash(seq: SequenceHash, local: LocalBlockHash) -> StoredBlock {
        StoredBlock {
            id: EngineBlockId(seq.0),
            content: BlockContent::LocalHash(local),
        }
    }

    /// [`StoredBlock::from_hash`] for a run of blocks; `seqs` and `locals` are the same
    /// blocks' hashes, in order.
    pub fn from_hashes(seqs: &[SequenceHash], locals: &[LocalBlockHash]) -> Vec<StoredBlock> {
        seqs.iter()
            .zip(locals)
            .map(|(seq, local)| StoredBlock::from_hash(*seq, *local))
            .collect()
    }
}

/// What happened in a worker's prefix cache.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum KvEventKind {
    /// A run of consecutive blocks was cached. `blocks[0]`'s parent is `parent` (`None` when
    /// `blocks[0]` is the first block of a prompt); each later block's parent is the one
    /// before it.
    Stored {
        parent: Option<EngineBlockId>,
        blocks: Vec<StoredBlock>,
    },
    /// These blocks were evicted from the worker's cache.
    Removed { blocks: Vec<EngineBlockId> },
    /// The worker dropped its whole cache (restart, reset).
    Cleared,
}

impl KvEventKind {
    /// The `Stored` event for every full block of a prompt, from its first block, with
    /// blocks named by [`StoredBlock::from_hashes`]: what a worker announces after caching
    /// `tokens`.
    pub fn stored_prompt(hasher: &BlockHasher, tokens: &[u32]) -> KvEventKind {
        let locals = hasher.local_hashes(tokens);
        let seqs: Vec<SequenceHash> =
            crate::hash::chain_local_hashes(None, locals.iter().copied()).collect();
        KvEventKind::Stored {
            parent: None,
            blocks: StoredBlock::from_hashes(&seqs, &locals),
        }
    }
}

/// One event from one worker, with its position in that worker's event stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvEvent {
    /// Who emitted it.
    pub worker: WorkerId,
    /// Per-worker sequence number: 0 for a worker's first event, then +1 per event.
    pub seq: u64,
    /// What happened.
    pub kind: KvEventKind,
}
