//! The router's own view of each worker's load.
//!
//! The router does not wait for workers to report load: it predicts it from what it sent where,
//! as Dynamo's slot manager does. A request adds to its worker's in-flight count, to its pending
//! prefill tokens (until its first token arrives) and to its active blocks (until it finishes).
//! Active blocks are counted once per worker even when several in-flight requests share them
//! (a shared system prompt or passage is one set of blocks in the engine's cache).

use kv_index::SequenceHash;
use rustc_hash::FxHashMap;

/// A worker's load as the router accounts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WorkerLoad {
    /// Requests routed to the worker and not yet finished.
    pub in_flight: u32,
    /// Prompt tokens the worker still has to prefill: uncached tokens of its requests that
    /// have not produced a first token yet.
    pub pending_prefill_tokens: u64,
    /// Distinct KV blocks of the worker's in-flight requests' prompts.
    pub active_blocks: u64,
}

/// Per-worker accounting: the load plus the reference-counted set of active blocks.
#[derive(Debug, Default)]
pub(crate) struct WorkerAccount {
    pub(crate) load: WorkerLoad,
    /// Active block → number of in-flight requests on this worker that hold it. Bounded by the
    /// router's bound on tracked requests times their prompt blocks.
    active: FxHashMap<SequenceHash, u32>,
}

impl WorkerAccount {
    /// How many leading blocks of `hashes` are already active on this worker.
    ///
    /// The active set is a union of whole prompt prefixes, and equal sequence hashes mean
    /// equal prefixes, so the request blocks found in it always form a leading run: a binary
    /// search finds its length in O(log n) lookups instead of one lookup per block.
    pub(crate) fn active_prefix_len(&self, hashes: &[SequenceHash]) -> usize {
        if self.active.is_empty() {
            return 0;
        }
        hashes.partition_point(|h| self.active.contains_key(h))
    }

    /// Takes a reference on each of `hashes`; returns how many were not active before.
    pub(crate) fn acquire(&mut self, hashes: &[SequenceHash]) -> u64 {
        let mut added = 0;
        for h in hashes {
            let count = self.active.entry(*h).or_insert(0);
            if *count == 0 {
                added += 1;
            }
            *count += 1;
        }
        self.load.active_blocks += added;
        added
    }

    /// Drops a reference on each of `hashes`, forgetting blocks nobody holds any more.
    pub(crate) fn release(&mut self, hashes: &[SequenceHash]) {
        for h in hashes {
            if let Some(count) = self.active.get_mut(h) {
                *count -= 1;
                if *count == 0 {
                    self.active.remove(h);
                    self.load.active_blocks = self.load.active_blocks.saturating_sub(1);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hashes(range: std::ops::Range<u64>) -> Vec<SequenceHash> {
        range.map(SequenceHash).collect()
    }

    #[test]
    fn shared_blocks_count_once_and_release_by_reference() {
        let mut account = WorkerAccount::default();
        assert_eq!(account.acquire(&hashes(0..10)), 10);
        // A second request sharing the first 6 blocks adds only its 4 own blocks.
        let second: Vec<SequenceHash> = hashes(0..6).into_iter().chain(hashes(100..104)).collect();
        assert_eq!(account.active_prefix_len(&second), 6);
        assert_eq!(account.acquire(&second), 4);
        assert_eq!(account.load.active_blocks, 14);
        account.release(&hashes(0..10));
        assert_eq!(account.load.active_blocks, 10, "shared blocks stay held");
        account.release(&second);
        assert_eq!(account.load.active_blocks, 0);
        assert_eq!(account.active_prefix_len(&second), 0);
    }
}
