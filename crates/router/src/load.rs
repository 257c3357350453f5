//! The router's own view of each worker's load.
//!
//! The router does not wait for workers to report load: it predicts it from what it sent where,
//! as Dynamo's slot manager does. A request adds to its worker's in-flight count, to its pending
//! prefill tokens (until its first token arrives) and to its active blocks (until it finishes).
//! Active blocks are counted once per worker even when several in-flight requests share them
//! (a shared system prompt or passage is one set of blocks in the engine's cache).

use std::collections::hash_map::Entry;

use kv_index::{SequenceHash, WorkerId};
use rustc_hash::FxHashMap;

/// A worker's load as the router accounts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WorkerLoad {
    /// Requests routed to the worker and not yet finished.
    pub in_flight: u32,
    /// Prompt tokens the worker still has to prefill: uncached tokens of its requests that
    /// have not produced a first token yet.
    pub pending_prefill_tokens: u64,
    /// Requests routed to the worker that have not produced a first token yet (in
    /// `in_flight`).
    pub awaiting_first_token: u32,
    /// Distinct KV blocks of the worker's in-flight requests' prompts.
    pub active_blocks: u64,
    /// Σ prompt tokens of the worker's in-flight requests: shared prefixes counted once per
    /// request, as each decode step's attention reads every sequence's whole context.
    pub context_tokens: u64,
}

/// Per-worker accounting: the load. The worker's reference-counted set of active blocks lives
/// in the fleet's [`FleetActive`], one map for every worker (a block's entry holds each
/// worker's count), so accounting a request costs one map operation per prompt block.
#[derive(Debug, Default)]
pub(crate) struct WorkerAccount {
    pub(crate) load: WorkerLoad,
}

impl WorkerAccount {
    /// How many leading blocks of `hashes` are already active on `worker`.
    ///
    /// The active set is a union of whole prompt prefixes, and equal sequence hashes mean
    /// equal prefixes, so the request blocks found in it always form a leading run: a binary
    /// search finds its length. Routing reads it for every worker at once from
    /// [`FleetActive::prefix_lens`]; this is the reference the tests compare with.
    #[cfg(test)]
    pub(crate) fn active_prefix_len(
        worker: WorkerId,
        fleet: &FleetActive,
        hashes: &[SequenceHash],
    ) -> usize {
        hashes.partition_point(|h| fleet.holders(h).iter().any(|&(w, _)| w == worker))
    }

    /// Takes a reference on each of `hashes` for this account's `worker`; returns how many
    /// were not active before.
    pub(crate) fn acquire(
        &mut self,
        worker: WorkerId,
        hashes: &[SequenceHash],
        fleet: &mut FleetActive,
    ) -> u64 {
        let added = hashes.iter().filter(|h| fleet.add(**h, worker)).count() as u64;
        self.load.active_blocks += added;
        added
    }

    /// Drops a reference on each of `hashes`, forgetting blocks nobody holds any more.
    pub(crate) fn release(
        &mut self,
        worker: WorkerId,
        hashes: &[SequenceHash],
        fleet: &mut FleetActive,
    ) {
        let gone = hashes.iter().filter(|h| fleet.remove(**h, worker)).count() as u64;
        self.load.active_blocks = self.load.active_blocks.saturating_sub(gone);
    }

    /// The worker leaves: its active blocks leave the fleet's lists. (A sweep of the whole
    /// fleet's active blocks: workers leave far less often than requests come and go.)
    pub(crate) fn forget(&mut self, worker: WorkerId, fleet: &mut FleetActive) {
        fleet.holders.retain(|_, holders| !holders.forget(worker));
        self.load.active_blocks = 0;
    }
}

/// For each block active on some worker, the workers it is active on and how many of each
/// worker's in-flight requests hold it.
///
/// Every worker's active set is closed under prefixes, so the workers holding block `i` of a
/// request are among those holding block `i − 1`, and a worker's active prefix can only end
/// where that set shrinks. [`FleetActive::prefix_cuts`] finds those few places with a binary
/// search over the request's blocks, and [`FleetActive::prefix_lens`] reads every worker's
/// active prefix off the holder lists there: a decision over a thousand workers costs a few
/// lookups and a walk over sorted lists instead of hash lookups per worker. Bounded by the
/// router's bound on tracked requests times their prompt blocks (one list entry per active
/// (worker, block)).
#[derive(Debug, Default)]
pub(crate) struct FleetActive {
    holders: FxHashMap<SequenceHash, Holders>,
}

/// The workers a block is active on, ascending by id, each with its reference count. Most
/// blocks (a conversation's own history) are active on one worker, which needs no allocation;
/// the shared case is boxed so the map's buckets stay small (a thousand busy workers hold
/// millions of active blocks).
#[derive(Debug)]
enum Holders {
    One((WorkerId, u32)),
    #[allow(clippy::box_collection)]
    Many(Box<Vec<(WorkerId, u32)>>),
}

impl Holders {
    fn as_slice(&self) -> &[(WorkerId, u32)] {
        match self {
            Holders::One(h) => std::slice::from_ref(h),
            Holders::Many(v) => v,
        }
    }

    /// Drops every reference of `worker`; true when no holder is left.
    fn forget(&mut self, worker: WorkerId) -> bool {
        match self {
            Holders::One((w, _)) => *w == worker,
            Holders::Many(v) => {
                v.retain(|&(w, _)| w != worker);
                v.is_empty()
            }
        }
    }
}

impl FleetActive {
    /// Takes a reference on `h` for `worker`; true when the block was not active there.
    fn add(&mut self, h: SequenceHash, worker: WorkerId) -> bool {
        match self.holders.entry(h) {
            Entry::Vacant(e) => {
                e.insert(Holders::One((worker, 1)));
                true
            }
            Entry::Occupied(mut e) => {
                let holders = e.get_mut();
                if let Holders::One((w, count)) = holders {
                    if *w == worker {
                        *count += 1;
                        return false;
                    }
                    *holders = Holders::Many(Box::new(vec![(*w, *count)]));
                }
                let Holders::Many(v) = holders else {
                    return false;
                };
                match v.binary_search_by_key(&worker, |&(w, _)| w) {
                    Ok(i) => {
                        v[i].1 += 1;
                        false
                    }
                    Err(i) => {
                        v.insert(i, (worker, 1));
                        true
                    }
                }
            }
        }
    }

    /// Drops a reference on `h` for `worker`; true when the block is no longer active there.
    fn remove(&mut self, h: SequenceHash, worker: WorkerId) -> bool {
        let Entry::Occupied(mut e) = self.holders.entry(h) else {
            return false;
        };
        let holders = e.get_mut();
        let (gone, now_empty) = match holders {
            Holders::One((w, count)) => {
                if *w != worker {
                    return false;
                }
                *count -= 1;
                (*count == 0, *count == 0)
            }
            Holders::Many(v) => {
                let Ok(i) = v.binary_search_by_key(&worker, |&(w, _)| w) else {
                    return false;
                };
                v[i].1 -= 1;
                let gone = v[i].1 == 0;
                if gone {
                    v.remove(i);
                }
                if let [only] = v.as_slice() {
                    *holders = Holders::One(*only);
                }
                (gone, false)
            }
        };
        if now_empty {
            e.remove();
        }
        gone
    }

    fn holders(&self, h: &SequenceHash) -> &[(WorkerId, u32)] {
        self.holders.get(h).map_or(&[], Holders::as_slice)
    }

    fn count(&self, h: &SequenceHash) -> usize {
        self.holders(h).len()
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
        (lo, c_lo): (usize, usize),
        (hi, c_hi): (usize, usize),
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

    /// For each of `workers` (ascending by `id`), the number of leading blocks of `hashes`
    /// active on it, into `lens`; `cuts` are the request's [`prefix_cuts`](Self::prefix_cuts).
    pub(crate) fn prefix_lens<T>(
        &self,
        hashes: &[SequenceHash],
        cuts: &[usize],
        workers: &[T],
        id: impl Fn(&T) -> WorkerId,
        lens: &mut Vec<usize>,
    ) {
        lens.clear();
        lens.resize(workers.len(), 0);
        // Longest cut first: a worker holding block `s − 1` holds the whole prefix `0..s`,
        // and is also listed at every shorter cut, where it is already done. Both lists are
        // ascending by id, so one merge walk per cut.
        for &s in cuts.iter().rev().filter(|&&s| s > 0) {
            let mut i = 0;
            for (h, _) in self.holders(&hashes[s - 1]) {
                i = gallop(workers, i, |w| id(w) < *h);
                if i == workers.len() {
                    break;
                }
                if id(&workers[i]) == *h && lens[i] == 0 {
                    lens[i] = s;
                }
            }
        }
    }
}

/// The first index at or after `from` where `before` turns false (`before` must be true up to
/// some point and false after it, as `partition_point` needs). Exponential steps, then a
/// binary search: O(log distance), so a block active on one worker of a thousand costs a few
/// comparisons, and a walk over many holders stays linear.
fn gallop<T>(items: &[T], from: usize, before: impl Fn(&T) -> bool) -> usize {
    let mut lo = from;
    let mut step = 1;
    while lo < items.len() && before(&items[lo]) {
        // `items[lo]` is before: the answer is past it. Probe `step` further next.
        let next = lo + step;
        if next >= items.len() || !before(&items[next]) {
            let end = next.min(items.len());
            return lo + 1 + items[lo + 1..end].partition_point(&before);
        }
        lo = next;
        step *= 2;
    }
    lo
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gallop_finds_the_partition_point_from_any_start() {
        for n in 0..40usize {
            let items: Vec<usize> = (0..n).collect();
            for cut in 0..=n {
                for from in 0..=cut {
                    assert_eq!(gallop(&items, from, |&x| x < cut), cut, "n {n} from {from}");
                }
            }
        }
    }

    fn hashes(range: std::ops::Range<u64>) -> Vec<SequenceHash> {
        range.map(SequenceHash).collect()
    }

    #[test]
    fn shared_blocks_count_once_and_release_by_reference() {
        let mut fleet = FleetActive::default();
        let mut account = WorkerAccount::default();
        let w = WorkerId(3);
        assert_eq!(account.acquire(w, &hashes(0..10), &mut fleet), 10);
        // A second request sharing the first 6 blocks adds only its 4 own blocks.
        let second: Vec<SequenceHash> = hashes(0..6).into_iter().chain(hashes(100..104)).collect();
        assert_eq!(WorkerAccount::active_prefix_len(w, &fleet, &second), 6);
        assert_eq!(account.acquire(w, &second, &mut fleet), 4);
        assert_eq!(account.load.active_blocks, 14);
        account.release(w, &hashes(0..10), &mut fleet);
        assert_eq!(account.load.active_blocks, 10, "shared blocks stay held");
        account.release(w, &second, &mut fleet);
        assert_eq!(account.load.active_blocks, 0);
        assert_eq!(WorkerAccount::active_prefix_len(w, &fleet, &second), 0);
        assert!(fleet.holders.is_empty());
    }

    /// Every worker's active prefix read off the fleet's holder lists equals the plain binary
    /// search over its own set, whatever prefixes the workers hold.
    #[test]
    fn fleet_prefix_lens_equal_each_workers_active_prefix() {
        // Requests are prefixes of a few chains that share their first blocks.
        let chain = |branch: u64, len: u64| -> Vec<SequenceHash> {
            (0..len)
                .map(|i| SequenceHash(if i < 5 { i } else { branch * 1000 + i }))
                .collect()
        };
        let mut fleet = FleetActive::default();
        let ids: Vec<WorkerId> = [2, 3, 5, 8, 13, 21].map(WorkerId).to_vec();
        let mut accounts: Vec<WorkerAccount> =
            ids.iter().map(|_| WorkerAccount::default()).collect();
        let held = [
            vec![],
            vec![chain(1, 3)],
            vec![chain(1, 9), chain(2, 7)],
            vec![chain(2, 12)],
            vec![chain(3, 5), chain(1, 6)],
            vec![chain(2, 4)],
        ];
        for ((a, reqs), &w) in accounts.iter_mut().zip(&held).zip(&ids) {
            for r in reqs {
                a.acquire(w, r, &mut fleet);
            }
        }
        let (mut cuts, mut lens) = (Vec::new(), Vec::new());
        for branch in 1..=4 {
            for len in 0..14 {
                let request = chain(branch, len);
                fleet.prefix_cuts(&request, &mut cuts);
                fleet.prefix_lens(&request, &cuts, &ids, |w| *w, &mut lens);
                for (&w, &got) in ids.iter().zip(&lens) {
                    assert_eq!(
                        got,
                        WorkerAccount::active_prefix_len(w, &fleet, &request),
                        "branch {branch}, len {len}, cuts {cuts:?}"
                    );
                }
            }
        }
        // A subset of the workers (as if others had left the router) lines up by id.
        let some = [ids[1], ids[3], ids[4]];
        let request = chain(1, 10);
        fleet.prefix_cuts(&request, &mut cuts);
        fleet.prefix_lens(&request, &cuts, &some, |w| *w, &mut lens);
        assert_eq!(lens, vec![3, 5, 6]);
        for ((a, reqs), &w) in accounts.iter_mut().zip(&held).zip(&ids).skip(1) {
            a.release(w, &reqs[0], &mut fleet);
        }
        accounts[2].forget(ids[2], &mut fleet);
        accounts[4].forget(ids[4], &mut fleet);
        assert!(fleet.holders.is_empty(), "{:?}", fleet.holders);
    }
}
