//! The oracle upper bound on the KV hit rate (issue 4, item 6).
//!
//! An oracle router sends every turn to the worker holding the longest prefix of its prompt,
//! and its workers never evict. Its hit for a prompt is then the longest prefix, in full
//! blocks, that appeared in any earlier prompt or generated output — whichever worker saw it,
//! the oracle would have routed there. As in the engine, the last prompt token is always
//! recomputed (sampling needs its logits), so at most `(prompt_len − 1) / block_size` blocks
//! hit.
//!
//! "Earlier" is defined by what any real policy could have reused: a prompt's blocks enter the
//! oracle when the turn is issued (a concurrent turn with the same starter may hit them), a
//! turn's output blocks when it finishes (the engine caches `prompt + output` minus the last
//! token, whose KV is never computed). No policy on real engines can do better, so
//! `oracle_hit_rate ≥ kv_hit_rate` for every policy.
//!
//! Memory: one 8-byte hash per distinct block seen, in an FxHashSet (~10–20 bytes an entry
//! at the table's load factor). Never forgetting, a run of `R` requests adding ~`B` new
//! blocks each holds about `16·R·B` bytes: fine for the seed's benchmark (a quarter of a
//! million blocks), gigabytes for an hour of a thousand-worker fleet. With a `horizon` the
//! oracle keeps two generations and forgets blocks not seen for longer than the horizon
//! (a block seen within the last half-horizon is always kept). A conversation's history is
//! re-seen every turn and the shared passages constantly, so a horizon of minutes changes no
//! answer on the seed's workload while bounding memory by the blocks of that window.

use kv_index::{BlockHasher, SequenceHash};
use nanotime::Nanos;
use rustc_hash::FxHashSet;

#[derive(Debug)]
pub struct Oracle {
    hasher: BlockHasher,
    /// Forget blocks unseen for longer than this (`None`: never).
    horizon: Option<Nanos>,
    current: FxHashSet<u64>,
    /// The generation before `current` (empty without a horizon).
    previous: FxHashSet<u64>,
    rotated_at: Nanos,
    scratch: Vec<u32>,
    hashes: Vec<SequenceHash>,
}

impl Oracle {
    pub fn new(hasher: BlockHasher, horizon: Option<Nanos>) -> Self {
        Self {
            hasher,
            horizon,
            current: FxHashSet::default(),
            previous: FxHashSet::default(),
            rotated_at: Nanos::ZERO,
            scratch: Vec::new(),
            hashes: Vec::new(),
        }
    }

    fn rotate(&mut self, now: Nanos) {
        if let Some(h) = self.horizon {
            if now >= self.rotated_at + Nanos(h.0 / 2) {
                self.previous = std::mem::take(&mut self.current);
                self.rotated_at = now;
            }
        }
    }

    fn contains(&self, h: &SequenceHash) -> bool {
        self.current.contains(&h.0) || self.previous.contains(&h.0)
    }

    /// A turn is issued at `now`: returns the prompt tokens the oracle would find cached,
    /// then remembers the prompt's blocks. `seq` are the prompt's full-block sequence hashes.
    pub fn issue(&mut self, now: Nanos, prompt_len: usize, seq: &[SequenceHash]) -> u32 {
        self.rotate(now);
        let bs = self.hasher.block_size();
        let max_blocks = prompt_len.saturating_sub(1) / bs;
        let hit = seq[..max_blocks.min(seq.len())]
            .iter()
            .take_while(|h| self.contains(h))
            .count();
        self.current.extend(seq.iter().map(|h| h.0));
        u32::try_from(hit * bs).unwrap_or(u32::MAX)
    }

    /// A turn finished at `now`: remembers the full blocks of `prompt + output` minus the
    /// last output token. `prompt_seq` is the prompt's last full-block hash.
    pub fn finish(
        &mut self,
        now: Nanos,
        prompt: &[u32],
        prompt_seq: Option<SequenceHash>,
        output: &[u32],
    ) {
        self.rotate(now);
        let bs = self.hasher.block_size();
        let full = prompt.len() / bs;
        self.scratch.clear();
        self.scratch.extend_from_slice(&prompt[full * bs..]);
        self.scratch
            .extend_from_slice(&output[..output.len().saturating_sub(1)]);
        self.hashes.clear();
        self.hasher
            .extend_sequence_hashes(prompt_seq, &self.scratch, &mut self.hashes);
        self.current.extend(self.hashes.iter().map(|h| h.0));
    }

    /// Blocks remembered (a block in both generations counts twice).
    pub fn len(&self) -> usize {
        self.current.len() + self.previous.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hits_earlier_prompts_and_outputs_and_recomputes_the_last_token() {
        let hasher = BlockHasher::new(4).unwrap();
        let mut oracle = Oracle::new(hasher, None);
        let t = Nanos::ZERO;
        let a: Vec<u32> = (0..10).collect(); // 2 full blocks + 2 tail tokens
        let seq_a = hasher.sequence_hashes(&a);
        assert_eq!(oracle.issue(t, a.len(), &seq_a), 0, "nothing seen yet");
        // Same prompt again: both full blocks hit (the last token is in the tail anyway).
        assert_eq!(oracle.issue(t, a.len(), &seq_a), 8);
        // A prompt of exactly 8 tokens: its last token is recomputed, so only 1 block hits.
        let b: Vec<u32> = (0..8).collect();
        assert_eq!(oracle.issue(t, b.len(), &hasher.sequence_hashes(&b)), 4);
        // The answer to `a` (6 tokens) makes a + answer[..5] = 15 tokens → 3 full blocks.
        let answer: Vec<u32> = (100..106).collect();
        oracle.finish(t, &a, seq_a.last().copied(), &answer);
        let next: Vec<u32> = a.iter().chain(&answer).copied().chain(200..210).collect();
        let seq_next = hasher.sequence_hashes(&next);
        assert_eq!(oracle.issue(t, next.len(), &seq_next), 12);
        // Without a horizon, nothing is ever forgotten.
        assert_eq!(oracle.issue(Nanos::from_secs(1 << 20), a.len(), &seq_a), 8);
    }

    #[test]
    fn a_horizon_forgets_only_blocks_unseen_for_longer_than_it() {
        let hasher = BlockHasher::new(4).unwrap();
        let mut oracle = Oracle::new(hasher, Some(Nanos::from_secs(100)));
        let seq = |range: std::ops::Range<u32>| hasher.sequence_hashes(&range.collect::<Vec<_>>());
        let (a, b) = (seq(0..9), seq(50..59));
        oracle.issue(Nanos::from_secs(0), 9, &a);
        oracle.issue(Nanos::from_secs(40), 9, &b);
        // `a` seen 90 s ago: kept (and refreshed by this very lookup).
        assert_eq!(oracle.issue(Nanos::from_secs(90), 9, &a), 8);
        // `b` last seen at 40 s, now 160 s: gone; `a` refreshed at 90 s: still there.
        assert_eq!(oracle.issue(Nanos::from_secs(160), 9, &b), 0);
        assert_eq!(oracle.issue(Nanos::from_secs(170), 9, &a), 8);
        assert!(oracle.len() <= 2 * 2 * 2, "{}", oracle.len());
    }
}
