//! The answer to "how many leading blocks of this request does each worker hold?".

use crate::event::WorkerId;

/// Per-worker count of leading blocks of a request found in that worker's cache.
///
/// Only workers with at least one matching block are listed; every other worker matches zero.
/// Entries are kept in ascending worker order so iteration is deterministic.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OverlapScores {
    entries: Vec<(WorkerId, u32)>,
}

impl OverlapScores {
    pub fn new() -> Self {
        Self::default()
    }

    /// Builds scores from `(worker, matched leading blocks)` pairs; zero counts are dropped and
    /// a worker listed twice keeps its larger count.
    pub fn from_pairs(pairs: impl IntoIterator<Item = (WorkerId, u32)>) -> Self {
        let mut entries: Vec<(WorkerId, u32)> = pairs.into_iter().filter(|p| p.1 > 0).collect();
        entries.sort_unstable_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
        entries.dedup_by_key(|e| e.0);
        Self { entries }
    }

    /// Builds scores from pairs already sorted by worker, unique, with non-zero counts (the
    /// index produces them that way; skips `from_pairs`' sort).
    pub(crate) fn from_sorted(entries: Vec<(WorkerId, u32)>) -> Self {
        debug_assert!(entries.windows(2).all(|w| w[0].0 < w[1].0));
        debug_assert!(entries.iter().all(|e| e.1 > 0));
        Self { entries }
    }

    /// Leading blocks of the request cached on `worker` (0 when none).
    pub fn get(&self, worker: WorkerId) -> u32 {
        self.entries
            .binary_search_by_key(&worker, |e| e.0)
            .map_or(0, |i| self.entries[i].1)
    }

    /// Workers with at least one matching block, ascending by worker id.
    pub fn iter(&self) -> impl Iterator<Item = (WorkerId, u32)> + '_ {
        self.entries.iter().copied()
    }

    /// The largest overlap of any worker (0 when none).
    pub fn max(&self) -> u32 {
        self.entries.iter().map(|e| e.1).max().unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Number of workers with a non-zero overlap.
    pub fn len(&self) -> usize {
        self.entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn from_pairs_sorts_drops_zero_and_keeps_max() {
        let s = OverlapScores::from_pairs([
            (WorkerId(3), 2),
            (WorkerId(1), 0),
            (WorkerId(2), 5),
            (WorkerId(3), 7),
        ]);
        assert_eq!(
            s.iter().collect::<Vec<_>>(),
            vec![(WorkerId(2), 5), (WorkerId(3), 7)]
        );
        assert_eq!(s.get(WorkerId(1)), 0);
        assert_eq!(s.get(WorkerId(3)), 7);
        assert_eq!(s.max(), 7);
    }
}
