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
    #[cfg(test)]
    pub(crate) fn active_prefix_len(&self, hashes: &[SequenceHash]) -> usize {
        if self.active.is_empty() {
            return 0;
        }
        hashes.partition_point(|h| self.active.contains_key(h))
    }

    /// [`active_prefix_len`](Self::active_prefix_len), knowing it is one of `cuts` (from
    /// [`FleetActive::prefix_cuts`] for the same `hashes`): a binary search over the few cuts
    /// instead of over every block, so a decision over a large fleet costs a couple of
    /// lookups per worker.
    pub(crate) fn active_prefix_len_at_cuts(
        &self,
        hashes: &[SequenceHash],
        cuts: &[usize],
    ) -> usize {
        if self.active.is_empty() || cuts.len() <= 1 {
            return 0;
        }
        // Largest cut `s` with blocks `0..s` active, i.e. block `s − 1` active (cut 0 always).
        let i = cuts[1..].partition_point(|&s| self.active.contains_key(&hashes[s - 1]));
        cuts[i]
    }

    /// Takes a reference on each of `hashes`; returns how many were not active before.
    pub(crate) fn acquire(&mut self, hashes: &[SequenceHash], fleet: &mut FleetActive) -> u64 {
        let mut added = 0;
        for h in hashes {
            let count = self.active.entry(*h).or_insert(0);
            if *count == 0 {
                added += 1;
                fleet.add(*h);
            }
            *count += 1;
        }
        self.load.active_blocks += added;
        added
    }

    /// Drops a reference on each of `hashes`, forgetting blocks nobody holds any more.
    pub(crate) fn release(&mut self, hashes: &[SequenceHash], fleet: &mut FleetActive) {
        for h in hashes {
            if let Some(count) = self.active.get_mut(h) {
                *count -= 1;
                if *count == 0 {
                    self.active.remove(h);
                    fleet.remove(*h);
                    self.load.active_blocks = self.load.active_blocks.saturating_sub(1);
                }
            }
        }
    }

    /// The worker leaves: its active blocks leave the fleet's counts.
    pub(crate) fn forget(&mut self, fleet: &mut FleetActive) {
        for h in self.active.keys() {
            fleet.remove(*h);
        }
        self.active.clear();
    }
}

/// For each block active on some worker, on how many workers it is active.
///
/// Every worker's active set is closed under prefixes, so the number of workers holding block
/// `i` of a request never grows with `i`, and a worker's active prefix can only end where that
/// number drops. [`FleetActive::prefix_cuts`] finds those few places with a binary search over
/// the request's blocks; each worker then needs a lookup or two instead of a binary search
/// over all blocks. Bounded like the per-worker sets it counts.
#[derive(Debug, Default)]
pub(crate) struct FleetActive {
    workers: FxHashMap<SequenceHash, u32>,
}

impl FleetActive {
    fn add(&mut self, h: SequenceHash) {
        *self.workers.entry(h).or_insert(0) += 1;
    }

    fn remove(&mut self, h: SequenceHash) {
        if let Some(n) = self.workers.get_mut(&h) {
            *n -= 1;
            if *n == 0 {
                self.workers.remove(&h);
            }
        }
    }

    fn count(&self, h: &SequenceHash) -> u32 {
        self.workers.get(h).copied().unwrap_or(0)
    }

    /// Every length a worker's active prefix of `hashes` can have, ascending: 0, each `i`
    /// where fewer workers hold block `i` than block `i − 1`, and `hashes.len()` if some
    /// worker holds them all.
    pub(crate) fn prefix_cuts(&self, hashes: &[SequenceHash], cuts: &mut Vec<usize>) {
        cuts.clear();
        cuts.push(0);
        let Some(last) = hashes.len().checked_sub(1) else {
            return;
        };
        let first = self.count(&hashes[0]);
        if first == 0 {
            return;
        }
        let end = self.count(&hashes[last]);
        self.drops(hashes, (0, first), (last, end), cuts);
        if end > 0 {
            cuts.push(hashes.len());
        }
    }

    /// Pushes, ascending, every `i` in `(lo, hi]` where the count drops; `lo` and `hi` come
    /// with their counts.
    fn drops(
        &self,
        hashes: &[SequenceHash],
        (lo, c_lo): (usize, u32),
        (hi, c_hi): (usize, u32),
        cuts: &mut Vec<usize>,
    ) {
        if c_lo == c_hi || hi <= lo {
            return;
        }
        if hi == lo + 1 {
            cuts.push(hi);
            return;
        }
        let mid = lo + (hi - lo) / 2;
        let c_mid = self.count(&hashes[mid]);
        self.drops(hashes, (lo, c_lo), (mid, c_mid), cuts);
        self.drops(hashes, (mid, c_mid), (hi, c_hi), cuts);
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
        let mut fleet = FleetActive::default();
        let mut account = WorkerAccount::default();
        assert_eq!(account.acquire(&hashes(0..10), &mut fleet), 10);
        // A second request sharing the first 6 blocks adds only its 4 own blocks.
        let second: Vec<SequenceHash> = hashes(0..6).into_iter().chain(hashes(100..104)).collect();
        assert_eq!(account.active_prefix_len(&second), 6);
        assert_eq!(account.acquire(&second, &mut fleet), 4);
        assert_eq!(account.load.active_blocks, 14);
        account.release(&hashes(0..10), &mut fleet);
        assert_eq!(account.load.active_blocks, 10, "shared blocks stay held");
        account.release(&second, &mut fleet);
        assert_eq!(account.load.active_blocks, 0);
        assert_eq!(account.active_prefix_len(&second), 0);
        assert!(fleet.workers.is_empty());
    }

    /// The cut-based prefix length equals the plain binary search on every worker, whatever
    /// prefixes the workers hold.
    #[test]
    fn prefix_cuts_give_every_workers_active_prefix() {
        // Requests are prefixes of a few chains that share their first blocks.
        let chain = |branch: u64, len: u64| -> Vec<SequenceHash> {
            (0..len)
                .map(|i| SequenceHash(if i < 5 { i } else { branch * 1000 + i }))
                .collect()
        };
        let mut fleet = FleetActive::default();
        let mut accounts: Vec<WorkerAccount> = (0..6).map(|_| WorkerAccount::default()).collect();
        let held = [
            vec![],
            vec![chain(1, 3)],
            vec![chain(1, 9), chain(2, 7)],
            vec![chain(2, 12)],
            vec![chain(3, 5), chain(1, 6)],
            vec![chain(2, 4)],
        ];
        for (a, reqs) in accounts.iter_mut().zip(&held) {
            for r in reqs {
                a.acquire(r, &mut fleet);
            }
        }
        let mut cuts = Vec::new();
        for branch in 1..=4 {
            for len in 0..14 {
                let request = chain(branch, len);
                fleet.prefix_cuts(&request, &mut cuts);
                for a in &accounts {
                    assert_eq!(
                        a.active_prefix_len_at_cuts(&request, &cuts),
                        a.active_prefix_len(&request),
                        "branch {branch}, len {len}, cuts {cuts:?}"
                    );
                }
            }
        }
        for (a, reqs) in accounts.iter_mut().zip(&held).skip(1) {
            a.release(&reqs[0], &mut fleet);
        }
        accounts[2].forget(&mut fleet);
        accounts[4].forget(&mut fleet);
        assert!(fleet.workers.is_empty(), "{:?}", fleet.workers);
    }
}
