//! The global prefix index: which worker holds which blocks, and how many leading blocks of a
//! request each worker holds.
//!
//! See the crate documentation for the semantics (events, gap policy, eviction rule). This
//! module is about how it is laid out:
//!
//! - `blocks`: `SequenceHash → Holders`, a flat FxHash map. Equal sequence hash ⇔ equal prefix,
//!   so matching a request is one lookup per block, no tree walk. `Holders` is the sorted set of
//!   dense worker slots holding that block (inline for the common single holder), each with a
//!   reference count because one worker may name the same content with several engine ids.
//! - `workers[slot]`: per worker, the sequence-number cursor and `EngineBlockId → entry`, used
//!   to resolve parents and removals.
//! - `entries`: a slab with one record per (worker, engine block id). Each records its parent
//!   entry (same worker) and how many child entries it has, and the leaves (entries with no
//!   children) are threaded on one global intrusive list in eviction order.

use std::sync::atomic::{AtomicU64, Ordering};

use rustc_hash::FxHashMap;

use crate::event::{EngineBlockId, KvEvent, KvEventKind, StoredBlock, WorkerId};
use crate::hash::{BlockHasher, LocalBlockHash, SequenceHash};
use crate::overlap::OverlapScores;

/// Null index for the slab links.
const NIL: u32 = u32::MAX;

/// Records and worker slots are `u32` indices: larger configured bounds are clamped to this.
const MAX_INDEX: usize = (u32::MAX - 1) as usize;

/// Default bound on (worker, block) entries: 4 Mi entries, about 600 MiB (see [`IndexConfig`]).
pub const DEFAULT_MAX_BLOCKS: usize = 4 << 20;

/// How the index is sized.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexConfig {
    /// Bound on (worker, engine block) entries, i.e. on [`KvIndex::len`]. When a store would
    /// exceed it, the index evicts entries by the rule in the crate docs. An entry costs about
    /// 150 bytes when its block is held by no other worker (measured: a 48-byte record, a
    /// per-worker id-map slot and a block-map slot, at hash-table load factors), less when
    /// blocks are shared; the default of 4 Mi entries is ≈ 600 MiB. Size it above the fleet's
    /// total KV capacity in blocks (e.g. 64 workers × 20k blocks = 1.3M) so that eviction
    /// stays a safety net. Values above `u32::MAX - 1` act as `u32::MAX - 1`.
    pub max_blocks: usize,
    /// Bound on known workers (each costs a few hundred bytes even with no blocks). An event
    /// from a new worker beyond it is refused with [`EventError::TooManyWorkers`], so a
    /// misbehaving event source cannot grow the index without limit. Default 65,536; values
    /// above `u32::MAX - 1` act as `u32::MAX - 1`.
    pub max_workers: usize,
}

/// Default bound on known workers.
pub const DEFAULT_MAX_WORKERS: usize = 1 << 16;

impl Default for IndexConfig {
    fn default() -> Self {
        Self {
            max_blocks: DEFAULT_MAX_BLOCKS,
            max_workers: DEFAULT_MAX_WORKERS,
        }
    }
}

/// What one applied event did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ApplyOutcome {
    /// New (worker, block) entries.
    pub stored: usize,
    /// Blocks the worker already had under the same id and content (recency refreshed).
    pub refreshed: usize,
    /// Entries removed by a `Removed` or `Cleared` event, or replaced because an id was stored
    /// again with different content.
    pub removed: usize,
    /// Entries evicted by the memory bound while applying this event (any worker's).
    pub evicted: usize,
    /// Blocks of a `Stored` event skipped because its parent is unknown to that worker.
    pub unknown_parent_blocks: usize,
    /// Ids in a `Removed` event that the worker did not hold in the index.
    pub unknown_removals: usize,
    /// This event set the worker's sequence baseline (its first event, or the first after
    /// [`KvIndex::clear_worker`]).
    pub baseline: bool,
    /// [`KvIndex::apply_resyncing`] found a sequence gap before this event: it dropped the
    /// worker's blocks and applied the event as a new baseline.
    pub resynced: bool,
}

/// Running totals of what the index did, for metrics. Monotonic except on a fresh index.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IndexCounters {
    /// Events accepted in sequence and applied.
    pub events_applied: u64,
    /// New (worker, block) entries created by `Stored` events.
    pub blocks_stored: u64,
    /// Stored blocks the worker already had (idempotent re-store).
    pub blocks_refreshed: u64,
    /// Entries removed by `Removed` events (and ids re-stored with different content).
    pub blocks_removed: u64,
    /// Entries dropped by `Cleared` events, [`KvIndex::clear_worker`] and
    /// [`KvIndex::remove_worker`].
    pub blocks_cleared: u64,
    /// Entries evicted by the memory bound.
    pub blocks_evicted: u64,
    /// Events rejected because their sequence number skipped ahead (lost events).
    pub gaps: u64,
    /// Events ignored because their sequence number was already seen (duplicate or late).
    pub stale_events: u64,
    /// `Stored` events whose parent the worker did not hold in the index.
    pub unknown_parent_events: u64,
    /// Blocks skipped because of an unknown parent.
    pub unknown_parent_blocks: u64,
    /// Ids in `Removed` events that the worker did not hold in the index.
    pub unknown_removals: u64,
    /// Workers dropped by [`KvIndex::remove_worker`].
    pub workers_removed: u64,
    /// Events refused because [`IndexConfig::max_workers`] workers are already known.
    pub refused_workers: u64,
    /// Calls to `find_matches` / `find_matches_for_tokens`.
    pub lookups: u64,
}

/// Why an event was not applied. Neither error changes the index.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EventError {
    /// Events from `worker` were lost or reordered: the index would silently diverge from the
    /// worker's cache, so the event is not applied and later ones keep failing until the
    /// caller resynchronises.
    #[error(
        "{worker}: KV event gap: expected seq {expected}, got {got}; event not applied. \
         Events were lost or reordered: call clear_worker({worker}) and resync its cache \
         (the next event then sets a new baseline)"
    )]
    Gap {
        worker: WorkerId,
        expected: u64,
        got: u64,
    },
    /// A duplicate or late event: already covered, ignored.
    #[error(
        "{worker}: stale KV event: seq {got} is before the expected {expected} \
         (duplicate or late delivery); ignored, nothing to do"
    )]
    Stale {
        worker: WorkerId,
        expected: u64,
        got: u64,
    },
    /// A new worker would exceed [`IndexConfig::max_workers`]: the event is refused.
    #[error(
        "{worker}: refused, the index already tracks its maximum of {max} workers; \
         remove_worker() the ones that are gone or raise IndexConfig::max_workers"
    )]
    TooManyWorkers { worker: WorkerId, max: usize },
}

/// One holder of a block: a dense worker slot and how many of that worker's engine ids name
/// this content (almost always 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Holder {
    slot: u32,
    count: u32,
}

/// A set fingerprint of one slot: a bijective mix, so distinct slots give distinct values and
/// sums of them spread over all 64 bits.
fn slot_fingerprint(slot: u32) -> u64 {
    // splitmix64's finaliser.
    let mut z = u64::from(slot).wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The workers holding one block, sorted by slot. Inline for the common single holder so most
/// blocks cost no extra allocation; the shared case is boxed so the block map's buckets stay
/// 24 bytes (a thousand-worker fleet's map holds tens of millions of them).
#[derive(Debug, Clone)]
enum Holders {
    One(Holder),
    Many(Box<ManyHolders>),
}

/// Two or more holders, sorted by slot, with the wrapping sum of their slots'
/// [`slot_fingerprint`]s: deep in a prefix the whole fleet shares, matching compares the set
/// of still-matching workers with each block's holders in O(1) instead of O(workers).
#[derive(Debug, Clone)]
struct ManyHolders {
    holders: Vec<Holder>,
    fingerprint: u64,
}

impl Holders {
    fn new(slot: u32) -> Self {
        Holders::One(Holder { slot, count: 1 })
    }

    fn as_slice(&self) -> &[Holder] {
        match self {
            Holders::One(h) => std::slice::from_ref(h),
            Holders::Many(m) => &m.holders,
        }
    }

    /// Sum of the holders' slot fingerprints (set semantics: counts do not matter).
    fn fingerprint(&self) -> u64 {
        match self {
            Holders::One(h) => slot_fingerprint(h.slot),
            Holders::Many(m) => m.fingerprint,
        }
    }

    fn add(&mut self, slot: u32) {
        match self {
            Holders::One(h) if h.slot == slot => h.count += 1,
            Holders::One(h) => {
                let new = Holder { slot, count: 1 };
                let pair = if h.slot < slot { [*h, new] } else { [new, *h] };
                *self = Holders::Many(Box::new(ManyHolders {
                    fingerprint: slot_fingerprint(h.slot).wrapping_add(slot_fingerprint(slot)),
                    holders: pair.to_vec(),
                }));
            }
            Holders::Many(m) => match m.holders.binary_search_by_key(&slot, |h| h.slot) {
                Ok(i) => m.holders[i].count += 1,
                Err(i) => {
                    m.holders.insert(i, Holder { slot, count: 1 });
                    m.fingerprint = m.fingerprint.wrapping_add(slot_fingerprint(slot));
                }
            },
        }
    }

    /// Drops one reference of `slot`; returns true when no holder is left.
    fn remove(&mut self, slot: u32) -> bool {
        match self {
            Holders::One(h) => {
                if h.slot == slot {
                    h.count -= 1;
                }
                h.count == 0
            }
            Holders::Many(m) => {
                if let Ok(i) = m.holders.binary_search_by_key(&slot, |h| h.slot) {
                    m.holders[i].count -= 1;
                    if m.holders[i].count == 0 {
                        m.holders.remove(i);
                        m.fingerprint = m.fingerprint.wrapping_sub(slot_fingerprint(slot));
                    }
                }
                match m.holders.as_slice() {
                    [] => true,
                    [only] => {
                        *self = Holders::One(*only);
                        false
                    }
                    _ => false,
                }
            }
        }
    }
}

/// One (worker, engine block id) entry. Free entries have `slot == NIL` and sit on the free
/// list through `next`.
#[derive(Debug, Clone)]
struct Entry {
    seq: SequenceHash,
    id: EngineBlockId,
    slot: u32,
    /// Bumped when the entry is freed, so stale parent references are detected.
    generation: u32,
    parent: u32,
    parent_generation: u32,
    /// Live entries naming this one as parent. Zero ⇔ the entry is on the leaf list.
    children: u32,
    prev: u32,
    next: u32,
}

#[derive(Debug, Clone)]
struct WorkerState {
    id: WorkerId,
    /// Next expected sequence number; `None` until the first event sets the baseline.
    next_seq: Option<u64>,
    blocks: FxHashMap<EngineBlockId, u32>,
}

/// A reference to an entry that stays safe after the entry is freed and its slot reused.
#[derive(Debug, Clone, Copy)]
struct EntryRef {
    index: u32,
    generation: u32,
}

const NO_ENTRY: EntryRef = EntryRef {
    index: NIL,
    generation: 0,
};

/// The global prefix index. See the crate docs.
pub struct KvIndex {
    config: IndexConfig,
    blocks: FxHashMap<SequenceHash, Holders>,
    workers: Vec<Option<WorkerState>>,
    slots: FxHashMap<WorkerId, u32>,
    /// Live slots in ascending `WorkerId` order, so answers come out sorted without a sort.
    by_id: Vec<u32>,
    free_slots: Vec<u32>,
    entries: Vec<Entry>,
    free_entry: u32,
    len: usize,
    /// Coldest leaf: evicted first.
    leaf_head: u32,
    /// Hottest leaf.
    leaf_tail: u32,
    counters: IndexCounters,
    /// Lookups happen through `&self`; a relaxed atomic keeps the index `Sync`.
    lookups: AtomicU64,
}

impl Clone for KvIndex {
    fn clone(&self) -> Self {
        Self {
            config: self.config.clone(),
            blocks: self.blocks.clone(),
            workers: self.workers.clone(),
            slots: self.slots.clone(),
            by_id: self.by_id.clone(),
            free_slots: self.free_slots.clone(),
            entries: self.entries.clone(),
            free_entry: self.free_entry,
            len: self.len,
            leaf_head: self.leaf_head,
            leaf_tail: self.leaf_tail,
            counters: self.counters,
            lookups: AtomicU64::new(self.lookups.load(Ordering::Relaxed)),
        }
    }
}

impl std::fmt::Debug for KvIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The maps can hold millions of entries: show the shape, not the contents.
        f.debug_struct("KvIndex")
            .field("config", &self.config)
            .field("len", &self.len)
            .field("distinct_blocks", &self.blocks.len())
            .field("workers", &self.slots.len())
            .field("counters", &self.counters())
            .finish()
    }
}

impl Default for KvIndex {
    fn default() -> Self {
        Self::new(IndexConfig::default())
    }
}

impl KvIndex {
    pub fn new(config: IndexConfig) -> Self {
        Self {
            config,
            blocks: FxHashMap::default(),
            workers: Vec::new(),
            slots: FxHashMap::default(),
            by_id: Vec::new(),
            free_slots: Vec::new(),
            entries: Vec::new(),
            free_entry: NIL,
            len: 0,
            leaf_head: NIL,
            leaf_tail: NIL,
            counters: IndexCounters::default(),
            lookups: AtomicU64::new(0),
        }
    }

    pub fn config(&self) -> &IndexConfig {
        &self.config
    }

    /// Applies one event from one worker.
    ///
    /// Sequence numbers: the first event seen from a worker (or the first after
    /// [`clear_worker`](Self::clear_worker)) sets the baseline, whatever its `seq`; after that
    /// `seq` must be the previous one plus one. A higher `seq` is a [`EventError::Gap`] and a
    /// lower one is [`EventError::Stale`]; in both cases nothing changes.
    pub fn apply(&mut self, event: &KvEvent) -> Result<ApplyOutcome, EventError> {
        let Some(slot) = self.slot_or_insert(event.worker) else {
            self.counters.refused_workers += 1;
            return Err(EventError::TooManyWorkers {
                worker: event.worker,
                max: self.config.max_workers,
            });
        };
        let mut out = ApplyOutcome::default();
        {
            let Some(state) = self.worker_mut(slot) else {
                // Unreachable: slot_or_insert just made it live.
                return Ok(out);
            };
            match state.next_seq {
                None => out.baseline = true,
                Some(expected) if event.seq == expected => {}
                Some(expected) => {
                    let (worker, got) = (event.worker, event.seq);
                    return Err(if got > expected {
                        self.counters.gaps += 1;
                        EventError::Gap {
                            worker,
                            expected,
                            got,
                        }
                    } else {
                        self.counters.stale_events += 1;
                        EventError::Stale {
                            worker,
                            expected,
                            got,
                        }
                    });
                }
            }
            // Wraps after u64::MAX, which no real stream reaches; it cannot panic.
            state.next_seq = Some(event.seq.wrapping_add(1));
        }
        self.counters.events_applied += 1;
        match &event.kind {
            KvEventKind::Stored { parent, blocks } => self.store(slot, *parent, blocks, &mut out),
            KvEventKind::Removed { blocks } => {
                for id in blocks {
                    match self.worker(slot).and_then(|w| w.blocks.get(id)).copied() {
                        Some(e) => {
                            self.remove_entry(e);
                            out.removed += 1;
                        }
                        None => out.unknown_removals += 1,
                    }
                }
                self.counters.blocks_removed += out.removed as u64;
                self.counters.unknown_removals += out.unknown_removals as u64;
            }
            KvEventKind::Cleared => out.removed = self.drop_entries_of(slot),
        }
        Ok(out)
    }

    /// [`apply`](Self::apply), with the gap policy every driver uses (the gateway's event
    /// path and the simulator's): a sequence gap means events were lost or reordered, so the
    /// index can no longer vouch for what it holds of that worker. It drops the worker's
    /// blocks ([`clear_worker`](Self::clear_worker)) and applies the event as a new baseline
    /// (`resynced` in the outcome). A stale event (a duplicate, or one overtaken by a later
    /// one) is still refused with [`EventError::Stale`] and changes nothing.
    pub fn apply_resyncing(&mut self, event: &KvEvent) -> Result<ApplyOutcome, EventError> {
        match self.apply(event) {
            Err(EventError::Gap { worker, .. }) => {
                self.clear_worker(worker);
                let mut out = self.apply(event)?;
                out.resynced = true;
                Ok(out)
            }
            other => other,
        }
    }

    /// Replaces what the index holds of `worker` with `stored` and expects `next_seq` next
    /// (`None`: the next event sets the baseline). For a worker's snapshot of its own cache
    /// (a gateway that subscribed after the worker cached blocks): `stored` lists `Stored`
    /// events, parents before children; other kinds are ignored. A block whose parent is not
    /// among those before it is skipped, as in [`apply`](Self::apply).
    pub fn restore_worker(
        &mut self,
        worker: WorkerId,
        next_seq: Option<u64>,
        stored: &[KvEventKind],
    ) -> Result<ApplyOutcome, EventError> {
        let Some(slot) = self.slot_or_insert(worker) else {
            self.counters.refused_workers += 1;
            return Err(EventError::TooManyWorkers {
                worker,
                max: self.config.max_workers,
            });
        };
        let mut out = ApplyOutcome {
            removed: self.drop_entries_of(slot),
            baseline: next_seq.is_none(),
            ..ApplyOutcome::default()
        };
        for kind in stored {
            if let KvEventKind::Stored { parent, blocks } = kind {
                let mut one = ApplyOutcome::default();
                self.store(slot, *parent, blocks, &mut one);
                out.stored += one.stored;
                out.refreshed += one.refreshed;
                out.evicted += one.evicted;
                out.unknown_parent_blocks += one.unknown_parent_blocks;
            }
        }
        if let Some(state) = self.worker_mut(slot) {
            state.next_seq = next_seq;
        }
        Ok(out)
    }

    /// Whether the index holds engine block `block` for `worker`.
    pub fn holds(&self, worker: WorkerId, block: EngineBlockId) -> bool {
        self.slots
            .get(&worker)
            .and_then(|&s| self.worker(s))
            .is_some_and(|w| w.blocks.contains_key(&block))
    }

    /// The sequence number the index expects next from `worker` (`None`: unknown worker, or
    /// no baseline since its last clear). Every event of a lower number has been applied or
    /// superseded by a resync.
    pub fn next_seq(&self, worker: WorkerId) -> Option<u64> {
        self.slots
            .get(&worker)
            .and_then(|&s| self.worker(s))
            .and_then(|w| w.next_seq)
    }

    /// For each worker, how many leading blocks of the request (given by its sequence hashes)
    /// it holds: worker `w` scores `k` iff it holds `hashes[0..k]` and not `hashes[k]`.
    pub fn find_matches(&self, hashes: &[SequenceHash]) -> OverlapScores {
        self.match_hashes(hashes.iter().copied())
    }

    /// [`find_matches`](Self::find_matches) on a token sequence, hashing it with `hasher`.
    /// Blocks are hashed lazily: hashing stops as soon as no worker matches any more.
    pub fn find_matches_for_tokens(&self, hasher: &BlockHasher, tokens: &[u32]) -> OverlapScores {
        let mut parent = None;
        self.match_hashes(tokens.chunks_exact(hasher.block_size()).map(|block| {
            let seq = SequenceHash::chain(parent, LocalBlockHash::of_tokens(block));
            parent = Some(seq);
            seq
        }))
    }

    /// Forgets a worker: its blocks and its sequence cursor. Events from it afterwards start a
    /// new baseline. Unknown workers are ignored.
    pub fn remove_worker(&mut self, worker: WorkerId) {
        let Some(slot) = self.slots.remove(&worker) else {
            return;
        };
        self.drop_entries_of(slot);
        if let Some(w) = self.workers.get_mut(slot as usize) {
            *w = None;
        }
        self.by_id.retain(|&s| s != slot);
        self.free_slots.push(slot);
        self.counters.workers_removed += 1;
    }

    /// Drops a worker's blocks and resets its sequence baseline (the next event is accepted
    /// whatever its `seq`), keeping the worker known. Use it to resynchronise after a gap.
    /// Unknown workers are ignored.
    pub fn clear_worker(&mut self, worker: WorkerId) {
        let Some(&slot) = self.slots.get(&worker) else {
            return;
        };
        self.drop_entries_of(slot);
        if let Some(state) = self.worker_mut(slot) {
            state.next_seq = None;
        }
    }

    pub fn counters(&self) -> IndexCounters {
        IndexCounters {
            lookups: self.lookups.load(Ordering::Relaxed),
            ..self.counters
        }
    }

    /// Number of (worker, engine block) entries; bounded by [`IndexConfig::max_blocks`].
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Number of distinct blocks (sequence hashes) held by at least one worker.
    pub fn distinct_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Known workers (those that sent an event and were not removed), in slot order.
    pub fn workers(&self) -> impl Iterator<Item = WorkerId> + '_ {
        self.workers.iter().flatten().map(|w| w.id)
    }

    /// Entries held by `worker` (0 for an unknown worker).
    pub fn blocks_of(&self, worker: WorkerId) -> usize {
        self.slots
            .get(&worker)
            .and_then(|&s| self.worker(s))
            .map_or(0, |w| w.blocks.len())
    }

    // ---- matching -------------------------------------------------------------------------

    fn match_hashes(&self, hashes: impl IntoIterator<Item = SequenceHash>) -> OverlapScores {
        self.lookups.fetch_add(1, Ordering::Relaxed);
        let mut hashes = hashes.into_iter();
        let Some(first) = hashes.next().and_then(|h| self.blocks.get(&h)) else {
            return OverlapScores::new();
        };
        // Slots still matching every block so far, sorted, with their fingerprint sum;
        // `depth` blocks matched.
        let mut active: Vec<u32> = first.as_slice().iter().map(|h| h.slot).collect();
        let mut active_fingerprint = first.fingerprint();
        let mut next: Vec<u32> = Vec::with_capacity(active.len());
        let mut scores: Vec<(u32, u32)> = Vec::new();
        let mut depth: u32 = 1;
        for seq in hashes {
            let Some(block) = self.blocks.get(&seq) else {
                break;
            };
            let holders = block.as_slice();
            // Deep in a shared prefix the holder set usually equals the active set. Equal size
            // and equal 64-bit fingerprint sum is taken as equal, the same trust in 64-bit
            // hashes that sequence hashes already rely on; it keeps a prefix held by a
            // thousand workers O(1) per block.
            let same = holders.len() == active.len() && block.fingerprint() == active_fingerprint;
            if !same {
                next.clear();
                active_fingerprint = 0;
                let mut j = 0;
                for &a in &active {
                    while j < holders.len() && holders[j].slot < a {
                        j += 1;
                    }
                    if j < holders.len() && holders[j].slot == a {
                        next.push(a);
                        active_fingerprint = active_fingerprint.wrapping_add(slot_fingerprint(a));
                    } else {
                        scores.push((a, depth));
                    }
                }
                std::mem::swap(&mut active, &mut next);
                if active.is_empty() {
                    break;
                }
            }
            depth = depth.saturating_add(1);
        }
        scores.extend(active.iter().map(|&a| (a, depth)));
        self.to_scores(scores)
    }

    /// Turns (slot, score) pairs, each slot at most once, into scores sorted by worker.
    fn to_scores(&self, scores: Vec<(u32, u32)>) -> OverlapScores {
        if scores.len() <= 32 {
            // Few matches (the common case): a small sort is cheapest.
            return OverlapScores::from_pairs(
                scores
                    .into_iter()
                    .filter_map(|(slot, k)| Some((self.worker(slot)?.id, k))),
            );
        }
        // Many matches (a prefix shared by the whole fleet): scatter by slot and gather in
        // worker order, linear instead of a sort.
        let mut by_slot = vec![0u32; self.workers.len()];
        for &(slot, k) in &scores {
            if let Some(x) = by_slot.get_mut(slot as usize) {
                *x = k;
            }
        }
        OverlapScores::from_sorted(
            self.by_id
                .iter()
                .filter_map(|&slot| {
                    let k = *by_slot.get(slot as usize)?;
                    Some((self.worker(slot)?.id, k)).filter(|_| k > 0)
                })
                .collect(),
        )
    }

    // ---- workers --------------------------------------------------------------------------

    fn worker(&self, slot: u32) -> Option<&WorkerState> {
        self.workers.get(slot as usize)?.as_ref()
    }

    fn worker_mut(&mut self, slot: u32) -> Option<&mut WorkerState> {
        self.workers.get_mut(slot as usize)?.as_mut()
    }

    fn slot_or_insert(&mut self, worker: WorkerId) -> Option<u32> {
        if let Some(&slot) = self.slots.get(&worker) {
            return Some(slot);
        }
        if self.slots.len() >= self.config.max_workers.min(MAX_INDEX) {
            return None;
        }
        let state = WorkerState {
            id: worker,
            next_seq: None,
            blocks: FxHashMap::default(),
        };
        // Reuse freed slots so `workers` stays bounded by the peak number of live workers.
        let slot = match self.free_slots.pop() {
            Some(slot) => {
                self.workers[slot as usize] = Some(state);
                slot
            }
            None => {
                self.workers.push(Some(state));
                (self.workers.len() - 1) as u32
            }
        };
        self.slots.insert(worker, slot);
        // O(workers), once per new worker.
        let at = self
            .by_id
            .partition_point(|&s| self.worker(s).is_some_and(|w| w.id < worker));
        self.by_id.insert(at, slot);
        Some(slot)
    }

    /// Drops every entry of the worker in `slot`; returns how many.
    fn drop_entries_of(&mut self, slot: u32) -> usize {
        let Some(state) = self.worker_mut(slot) else {
            return 0;
        };
        // Replace rather than clear the map so its memory goes back too.
        let map = std::mem::take(&mut state.blocks);
        let n = map.len();
        for (_, e) in map {
            self.free_entry_record(e);
        }
        self.counters.blocks_cleared += n as u64;
        n
    }

    // ---- storing --------------------------------------------------------------------------

    fn store(
        &mut self,
        slot: u32,
        parent: Option<EngineBlockId>,
        blocks: &[StoredBlock],
        out: &mut ApplyOutcome,
    ) {
        let (mut parent_seq, mut parent_ref) = match parent {
            None => (None, NO_ENTRY),
            Some(pid) => match self.worker(slot).and_then(|w| w.blocks.get(&pid)).copied() {
                Some(e) => (Some(self.entries[e as usize].seq), self.entry_ref(e)),
                None => {
                    // The child's sequence hash depends on the parent's, which we do not know:
                    // indexing it under a guess could only produce false matches. Whatever
                    // the worker held under these ids before is superseded, so drop it too.
                    out.unknown_parent_blocks = blocks.len();
                    self.counters.unknown_parent_events += 1;
                    self.counters.unknown_parent_blocks += blocks.len() as u64;
                    for block in blocks {
                        if let Some(e) = self.worker(slot).and_then(|w| w.blocks.get(&block.id)) {
                            self.remove_entry(*e);
                            out.removed += 1;
                        }
                    }
                    self.counters.blocks_removed += out.removed as u64;
                    return;
                }
            },
        };
        for block in blocks {
            let seq = SequenceHash::chain(parent_seq, block.content.local_hash());
            parent_ref = self.insert(slot, block.id, seq, parent_ref, out);
            parent_seq = Some(seq);
        }
        self.counters.blocks_stored += out.stored as u64;
        self.counters.blocks_refreshed += out.refreshed as u64;
        self.counters.blocks_removed += out.removed as u64;
    }

    fn insert(
        &mut self,
        slot: u32,
        id: EngineBlockId,
        seq: SequenceHash,
        parent: EntryRef,
        out: &mut ApplyOutcome,
    ) -> EntryRef {
        // One id-map probe on the hot path: claim the map slot now for the record that
        // `alloc_entry` is about to hand out.
        let Some(worker) = self.workers.get_mut(slot as usize).and_then(Option::as_mut) else {
            return NO_ENTRY;
        };
        let mut next_record = if self.free_entry != NIL {
            self.free_entry
        } else {
            self.entries.len() as u32
        };
        match worker.blocks.entry(id) {
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(next_record);
            }
            std::collections::hash_map::Entry::Occupied(o) => {
                let e = *o.get();
                if self.entries[e as usize].seq == seq {
                    // Idempotent re-store: only the recency of a leaf changes.
                    if self.entries[e as usize].children == 0 {
                        self.unlink_leaf(e);
                        self.push_leaf_back(e);
                    }
                    out.refreshed += 1;
                    return self.entry_ref(e);
                }
                // The engine reused an id for other content: the old content is gone. (Rare:
                // takes the slow path, the freed record changes which one is handed out next.)
                self.remove_entry(e);
                out.removed += 1;
                next_record = if self.free_entry != NIL {
                    self.free_entry
                } else {
                    self.entries.len() as u32
                };
                if let Some(w) = self.worker_mut(slot) {
                    w.blocks.insert(id, next_record);
                }
            }
        }
        let e = self.alloc_entry(Entry {
            seq,
            id,
            slot,
            generation: 0,
            parent: NIL,
            parent_generation: 0,
            children: 0,
            prev: NIL,
            next: NIL,
        });
        // Checked after allocation: if the parent was just freed and its record reused by this
        // very entry, the generation differs and the link is not made.
        if self.is_live(parent, slot) {
            let p = parent.index as usize;
            if self.entries[p].children == 0 {
                self.unlink_leaf(parent.index);
            }
            self.entries[p].children += 1;
            let entry = &mut self.entries[e as usize];
            entry.parent = parent.index;
            entry.parent_generation = parent.generation;
        }
        debug_assert_eq!(e, next_record);
        self.push_leaf_back(e);
        self.blocks
            .entry(seq)
            .and_modify(|h| h.add(slot))
            .or_insert_with(|| Holders::new(slot));
        self.len += 1;
        out.stored += 1;
        let created = self.entry_ref(e);
        while self.len > self.config.max_blocks.min(MAX_INDEX) {
            if !self.evict_one() {
                break;
            }
            out.evicted += 1;
        }
        created
    }

    /// Evicts the coldest leaf. Returns false when there is nothing to evict.
    fn evict_one(&mut self) -> bool {
        let e = self.leaf_head;
        if e == NIL {
            return false;
        }
        self.remove_entry(e);
        self.counters.blocks_evicted += 1;
        true
    }

    // ---- entry records --------------------------------------------------------------------

    fn entry_ref(&self, e: u32) -> EntryRef {
        EntryRef {
            index: e,
            generation: self.entries[e as usize].generation,
        }
    }

    fn is_live(&self, r: EntryRef, slot: u32) -> bool {
        self.entries
            .get(r.index as usize)
            .is_some_and(|p| p.generation == r.generation && p.slot == slot)
    }

    fn alloc_entry(&mut self, mut entry: Entry) -> u32 {
        if self.free_entry != NIL {
            let e = self.free_entry;
            let slot = &mut self.entries[e as usize];
            self.free_entry = slot.next;
            entry.generation = slot.generation;
            *slot = entry;
            e
        } else {
            self.entries.push(entry);
            (self.entries.len() - 1) as u32
        }
    }

    /// Removes one entry, including from its worker's id map.
    fn remove_entry(&mut self, e: u32) {
        let (slot, id) = {
            let entry = &self.entries[e as usize];
            (entry.slot, entry.id)
        };
        if let Some(w) = self.worker_mut(slot) {
            w.blocks.remove(&id);
        }
        self.free_entry_record(e);
    }

    /// Frees an entry's record and its share of the block map; the caller has already taken it
    /// out of (or is discarding) its worker's id map.
    fn free_entry_record(&mut self, e: u32) {
        let entry = self.entries[e as usize].clone();
        let parent = EntryRef {
            index: entry.parent,
            generation: entry.parent_generation,
        };
        if self.is_live(parent, entry.slot) {
            let p = &mut self.entries[parent.index as usize];
            p.children -= 1;
            if p.children == 0 {
                // The parent is at least as old as the child that just left: it goes to the
                // cold end, so a worker's chain is evicted from its tip backwards.
                self.push_leaf_front(parent.index);
            }
        }
        if entry.children == 0 {
            self.unlink_leaf(e);
        }
        // Children keep a stale parent reference; the generation bump makes it inert. One
        // probe of the block map for both the holder update and the removal.
        if let std::collections::hash_map::Entry::Occupied(mut holders) =
            self.blocks.entry(entry.seq)
            && holders.get_mut().remove(entry.slot)
        {
            holders.remove();
        }
        let record = &mut self.entries[e as usize];
        record.slot = NIL;
        record.generation = record.generation.wrapping_add(1);
        record.next = self.free_entry;
        self.free_entry = e;
        self.len -= 1;
    }

    // ---- leaf list ------------------------------------------------------------------------

    fn push_leaf_back(&mut self, e: u32) {
        let tail = self.leaf_tail;
        {
            let entry = &mut self.entries[e as usize];
            entry.prev = tail;
            entry.next = NIL;
        }
        if tail == NIL {
            self.leaf_head = e;
        } else {
            self.entries[tail as usize].next = e;
        }
        self.leaf_tail = e;
    }

    fn push_leaf_front(&mut self, e: u32) {
        let head = self.leaf_head;
        {
            let entry = &mut self.entries[e as usize];
            entry.prev = NIL;
            entry.next = head;
        }
        if head == NIL {
            self.leaf_tail = e;
        } else {
            self.entries[head as usize].prev = e;
        }
        self.leaf_head = e;
    }

    fn unlink_leaf(&mut self, e: u32) {
        let (prev, next) = {
            let entry = &self.entries[e as usize];
            (entry.prev, entry.next)
        };
        if prev == NIL {
            self.leaf_head = next;
        } else {
            self.entries[prev as usize].next = next;
        }
        if next == NIL {
            self.leaf_tail = prev;
        } else {
            self.entries[next as usize].prev = prev;
        }
        let entry = &mut self.entries[e as usize];
        entry.prev = NIL;
        entry.next = NIL;
    }

    /// Checks every internal invariant; panics with a description on the first broken one.
    /// For tests (and fuzzing) only: O(len).
    #[doc(hidden)]
    pub fn check_invariants(&self) {
        let mut live = 0usize;
        let mut holder_refs: FxHashMap<(SequenceHash, u32), u32> = FxHashMap::default();
        for (slot, w) in self.workers.iter().enumerate() {
            let Some(w) = w else { continue };
            assert_eq!(self.slots.get(&w.id), Some(&(slot as u32)), "slot map");
            for (id, &e) in &w.blocks {
                let entry = &self.entries[e as usize];
                assert_eq!(entry.slot, slot as u32, "entry slot");
                assert_eq!(entry.id, *id, "entry id");
                *holder_refs.entry((entry.seq, entry.slot)).or_default() += 1;
                live += 1;
            }
        }
        assert_eq!(live, self.len, "len");
        let ids: Vec<WorkerId> = self
            .by_id
            .iter()
            .filter_map(|&s| self.worker(s))
            .map(|w| w.id)
            .collect();
        assert_eq!(ids.len(), self.slots.len(), "by_id covers every worker");
        assert!(ids.windows(2).all(|w| w[0] < w[1]), "by_id sorted");
        assert!(self.len <= self.config.max_blocks, "bound");
        let mut blocks_refs = 0usize;
        for (seq, holders) in &self.blocks {
            let hs = holders.as_slice();
            assert!(!hs.is_empty(), "empty holder set");
            assert!(
                hs.windows(2).all(|w| w[0].slot < w[1].slot),
                "holders sorted"
            );
            assert_eq!(
                holders.fingerprint(),
                hs.iter()
                    .fold(0u64, |acc, h| acc.wrapping_add(slot_fingerprint(h.slot))),
                "holder fingerprint"
            );
            for h in hs {
                assert_eq!(
                    holder_refs.get(&(*seq, h.slot)),
                    Some(&h.count),
                    "holder count"
                );
                blocks_refs += 1;
            }
        }
        assert_eq!(blocks_refs, holder_refs.len(), "holder entries");
        // Children counts and the leaf list.
        let mut children: FxHashMap<u32, u32> = FxHashMap::default();
        for w in self.workers.iter().flatten() {
            for &e in w.blocks.values() {
                let entry = &self.entries[e as usize];
                let parent = EntryRef {
                    index: entry.parent,
                    generation: entry.parent_generation,
                };
                if self.is_live(parent, entry.slot) {
                    *children.entry(parent.index).or_default() += 1;
                }
            }
        }
        let mut leaves = 0usize;
        let mut prev = NIL;
        let mut e = self.leaf_head;
        while e != NIL {
            let entry = &self.entries[e as usize];
            assert_ne!(entry.slot, NIL, "free entry on leaf list");
            assert_eq!(entry.children, 0, "non-leaf on leaf list");
            assert_eq!(entry.prev, prev, "leaf list back link");
            leaves += 1;
            assert!(leaves <= self.len, "leaf list cycle");
            prev = e;
            e = entry.next;
        }
        assert_eq!(prev, self.leaf_tail, "leaf tail");
        for w in self.workers.iter().flatten() {
            for &e in w.blocks.values() {
                let entry = &self.entries[e as usize];
                assert_eq!(
                    entry.children,
                    children.get(&e).copied().unwrap_or(0),
                    "children count"
                );
            }
        }
        let expected_leaves = self
            .workers
            .iter()
            .flatten()
            .flat_map(|w| w.blocks.values())
            .filter(|&&e| self.entries[e as usize].children == 0)
            .count();
        assert_eq!(leaves, expected_leaves, "every leaf is on the list");
    }
}

#[cfg(test)]
mod tests;
