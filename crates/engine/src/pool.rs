//! The paged KV block pool with a prefix cache.
//!
//! Every block is in exactly one of four states:
//!
//! | state                      | `refs` | in `map` | where            |
//! |----------------------------|--------|----------|------------------|
//! | never used                 | —      | —        | beyond `slots`   |
//! | free, uncached             | 0      | no       | `free`           |
//! | cached, unreferenced       | 0      | yes      | LRU list         |
//! | in use (cached or private) | ≥ 1    | maybe    | owned by requests|
//!
//! Allocation prefers blocks that hold nothing (never used, then `free`), and only then evicts
//! the least recently released cached block (the head of the LRU list), reporting it so the
//! engine can emit a `Removed` event. A referenced block is never on the LRU list, so it can
//! never be evicted. Slots are created lazily up to `capacity`, so an idle worker in a
//! thousand-worker simulation costs little memory. All structures are bounded by `capacity`.

use kv_index::EngineBlockId;
use rustc_hash::FxHashMap;

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
struct Slot {
    /// Sequence hash, meaningful while `cached`.
    hash: u64,
    refs: u32,
    prev: u32,
    next: u32,
    cached: bool,
}

/// Fixed-capacity block pool with ref counts, a hash → block prefix cache and LRU eviction.
#[derive(Debug, Clone)]
pub struct BlockPool {
    capacity: u32,
    slots: Vec<Slot>,
    free: Vec<u32>,
    lru_head: u32,
    lru_tail: u32,
    lru_len: u32,
    map: FxHashMap<u64, u32>,
    in_use: u32,
}

impl BlockPool {
    /// A pool of `capacity` blocks (at most `u32::MAX - 1`).
    pub fn new(capacity: u32) -> Self {
        BlockPool {
            capacity: capacity.min(NIL - 1),
            slots: Vec::new(),
            free: Vec::new(),
            lru_head: NIL,
            lru_tail: NIL,
            lru_len: 0,
            map: FxHashMap::default(),
            in_use: 0,
        }
    }

    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// Blocks referenced by at least one request.
    pub fn in_use(&self) -> u32 {
        self.in_use
    }

    /// Blocks in the prefix cache (referenced or not).
    pub fn cached(&self) -> u32 {
        self.map.len() as u32
    }

    /// Cached blocks nobody references: the eviction candidates.
    pub fn evictable(&self) -> u32 {
        self.lru_len
    }

    /// Blocks an allocation can get right now (free ones plus evictable cached ones).
    pub fn available(&self) -> u32 {
        (self.capacity - self.slots.len() as u32) + self.free.len() as u32 + self.lru_len
    }

    /// The cached block holding this sequence hash, if any.
    pub fn lookup(&self, hash: u64) -> Option<u32> {
        self.map.get(&hash).copied()
    }

    /// Reference count of a block.
    pub fn refs(&self, block: u32) -> u32 {
        self.slots.get(block as usize).map_or(0, |s| s.refs)
    }

    /// True when `block` is cached and unreferenced (taking it shrinks `available`).
    pub fn is_evictable(&self, block: u32) -> bool {
        self.slots
            .get(block as usize)
            .is_some_and(|s| s.cached && s.refs == 0)
    }

    /// Takes a reference on a cached block found by [`BlockPool::lookup`].
    pub fn acquire(&mut self, block: u32) {
        let Some(slot) = self.slots.get(block as usize) else {
            return;
        };
        if slot.refs == 0 {
            self.unlink(block);
            self.in_use += 1;
        }
        self.slots[block as usize].refs += 1;
    }

    /// A fresh, uncached block with one reference. Evicts the least recently released cached
    /// block when nothing free is left, pushing its id to `evicted`. `None` when every block is
    /// referenced.
    pub fn allocate(&mut self, evicted: &mut Vec<EngineBlockId>) -> Option<u32> {
        let block = if let Some(b) = self.free.pop() {
            b
        } else if (self.slots.len() as u32) < self.capacity {
            self.slots.push(Slot {
                hash: 0,
                refs: 0,
                prev: NIL,
                next: NIL,
                cached: false,
            });
            self.slots.len() as u32 - 1
        } else if self.lru_head != NIL {
            let b = self.lru_head;
            self.unlink(b);
            let slot = &mut self.slots[b as usize];
            slot.cached = false;
            self.map.remove(&slot.hash);
            evicted.push(EngineBlockId(slot.hash));
            b
        } else {
            return None;
        };
        self.slots[block as usize].refs = 1;
        self.in_use += 1;
        Some(block)
    }

    /// Drops one reference. An unreferenced cached block joins the LRU tail (most recently
    /// used); an unreferenced private block becomes free.
    pub fn release(&mut self, block: u32) {
        let Some(slot) = self.slots.get_mut(block as usize) else {
            return;
        };
        if slot.refs == 0 {
            return;
        }
        slot.refs -= 1;
        if slot.refs > 0 {
            return;
        }
        self.in_use -= 1;
        if slot.cached {
            self.link_tail(block);
        } else {
            self.free.push(block);
        }
    }

    /// Enters a referenced block into the prefix cache under `hash`. Returns false (and leaves
    /// the block private) when another block already caches that hash.
    pub fn register(&mut self, block: u32, hash: u64) -> bool {
        let Some(slot) = self.slots.get(block as usize) else {
            return false;
        };
        if slot.cached || self.map.contains_key(&hash) {
            return false;
        }
        self.map.insert(hash, block);
        let slot = &mut self.slots[block as usize];
        slot.cached = true;
        slot.hash = hash;
        true
    }

    /// Forgets every cached hash (the `Cleared` event). Referenced blocks stay with their
    /// requests as private blocks; unreferenced cached blocks become free.
    pub fn clear_cache(&mut self) {
        self.map.clear();
        while self.lru_head != NIL {
            let b = self.lru_head;
            self.unlink(b);
            self.free.push(b);
        }
        for slot in &mut self.slots {
            slot.cached = false;
        }
    }

    fn unlink(&mut self, b: u32) {
        let Slot { prev, next, .. } = self.slots[b as usize];
        if prev == NIL {
            self.lru_head = next;
        } else {
            self.slots[prev as usize].next = next;
        }
        if next == NIL {
            self.lru_tail = prev;
        } else {
            self.slots[next as usize].prev = prev;
        }
        let s = &mut self.slots[b as usize];
        s.prev = NIL;
        s.next = NIL;
        self.lru_len -= 1;
    }

    fn link_tail(&mut self, b: u32) {
        let tail = self.lru_tail;
        {
            let s = &mut self.slots[b as usize];
            s.prev = tail;
            s.next = NIL;
        }
        if tail == NIL {
            self.lru_head = b;
        } else {
            self.slots[tail as usize].next = b;
        }
        self.lru_tail = b;
        self.lru_len += 1;
    }

    /// Test hook: checks the bookkeeping, panicking on a violation (a referenced block on the
    /// LRU list, counts that disagree).
    #[doc(hidden)]
    pub fn check_invariants(&self) {
        let mut lru = 0;
        let mut b = self.lru_head;
        while b != NIL {
            let s = self.slots[b as usize];
            assert!(
                s.cached && s.refs == 0,
                "LRU holds a referenced or uncached block"
            );
            lru += 1;
            b = s.next;
        }
        assert_eq!(lru, self.lru_len);
        let in_use = self.slots.iter().filter(|s| s.refs > 0).count() as u32;
        assert_eq!(in_use, self.in_use);
        for &f in &self.free {
            let s = self.slots[f as usize];
            assert!(!s.cached && s.refs == 0);
        }
        assert_eq!(
            self.slots.len() as u32,
            self.in_use + self.lru_len + self.free.len() as u32
        );
        for (&h, &b) in &self.map {
            assert!(self.slots[b as usize].cached && self.slots[b as usize].hash == h);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_least_recently_released_first() {
        let mut pool = BlockPool::new(3);
        let mut ev = Vec::new();
        let a = pool.allocate(&mut ev).unwrap();
        let b = pool.allocate(&mut ev).unwrap();
        let c = pool.allocate(&mut ev).unwrap();
        assert!(pool.allocate(&mut ev).is_none());
        for (blk, h) in [(a, 10), (b, 20), (c, 30)] {
            assert!(pool.register(blk, h));
        }
        pool.release(b);
        pool.release(a);
        pool.release(c);
        // A hit on b moves it to most recently used once released again.
        pool.acquire(b);
        pool.release(b);
        pool.check_invariants();
        let x = pool.allocate(&mut ev).unwrap();
        assert_eq!(x, a);
        assert_eq!(ev, vec![EngineBlockId(10)]);
        pool.allocate(&mut ev).unwrap();
        pool.allocate(&mut ev).unwrap();
        assert_eq!(
            ev,
            vec![EngineBlockId(10), EngineBlockId(30), EngineBlockId(20)]
        );
        assert_eq!(pool.lookup(20), None);
        pool.check_invariants();
    }

    #[test]
    fn referenced_blocks_are_never_evicted() {
        let mut pool = BlockPool::new(2);
        let mut ev = Vec::new();
        let a = pool.allocate(&mut ev).unwrap();
        pool.register(a, 1);
        let b = pool.allocate(&mut ev).unwrap();
        pool.register(b, 2);
        pool.release(b);
        // Only b is evictable; a is held.
        assert_eq!(pool.available(), 1);
        let c = pool.allocate(&mut ev).unwrap();
        assert_eq!(c, b);
        assert!(pool.allocate(&mut ev).is_none());
        assert_eq!(pool.lookup(1), Some(a));
        assert_eq!(ev, vec![EngineBlockId(2)]);
        pool.check_invariants();
    }

    #[test]
    fn duplicate_hash_stays_private_and_clear_frees() {
        let mut pool = BlockPool::new(4);
        let mut ev = Vec::new();
        let a = pool.allocate(&mut ev).unwrap();
        let b = pool.allocate(&mut ev).unwrap();
        assert!(pool.register(a, 7));
        assert!(!pool.register(b, 7));
        pool.release(b);
        assert_eq!(pool.cached(), 1);
        pool.release(a);
        assert_eq!(pool.evictable(), 1);
        pool.clear_cache();
        assert_eq!(pool.cached(), 0);
        assert_eq!(pool.available(), 4);
        pool.check_invariants();
    }
}
