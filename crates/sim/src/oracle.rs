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
//! Memory: one 8-byte hash per distinct block ever seen, in an FxHashSet (~16 bytes an entry
//! at the table's load factor). It is unbounded by design (an oracle never evicts); a run of
//! `R` requests adding ~`B` new blocks each holds about `16·R·B` bytes. Turn it off
//! ([`crate::SimConfig::oracle`]) for very long fleet-scale runs if memory matters.

use kv_index::{BlockHasher, SequenceHash};
use rustc_hash::FxHashSet;

#[derive(Debug)]
pub struct Oracle {
    hasher: BlockHasher,
    seen: FxHashSet<u64>,
    scratch: Vec<u32>,
    hashes: Vec<SequenceHash>,
}

impl Oracle {
    pub fn new(hasher: BlockHasher) -> Self {
        Self {
            hasher,
            seen: FxHashSet::default(),
            scratch: Vec::new(),
            hashes: Vec::new(),
        }
    }

    /// A turn is issued: returns the prompt tokens the oracle would find cached, then
    /// remembers the prompt's blocks. `seq` are the prompt's full-block sequence hashes.
    pub fn issue(&mut self, prompt_len: usize, seq: &[SequenceHash]) -> u32 {
        let bs = self.hasher.block_size();
        let max_blocks = prompt_len.saturating_sub(1) / bs;
        let hit = seq[..max_blocks.min(seq.len())]
            .iter()
            .take_while(|h| self.seen.contains(&h.0))
            .count();
        self.seen.extend(seq.iter().map(|h| h.0));
        u32::try_from(hit * bs).unwrap_or(u32::MAX)
    }

    /// A turn finished: remembers the full blocks of `prompt + output` minus the last output
    /// token. `prompt_seq` are the prompt's full-block hashes (from [`Oracle::issue`]).
    pub fn finish(&mut self, prompt: &[u32], prompt_seq: Option<SequenceHash>, output: &[u32]) {
        let bs = self.hasher.block_size();
        let full = prompt.len() / bs;
        self.scratch.clear();
        self.scratch.extend_from_slice(&prompt[full * bs..]);
        self.scratch
            .extend_from_slice(&output[..output.len().saturating_sub(1)]);
        self.hashes.clear();
        self.hasher
            .extend_sequence_hashes(prompt_seq, &self.scratch, &mut self.hashes);
        self.seen.extend(self.hashes.iter().map(|h| h.0));
    }

    /// Distinct blocks remembered.
    pub fn len(&self) -> usize {
        self.seen.len()
    }

    pub fn is_empty(&self) -> bool {
        self.seen.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hits_earlier_prompts_and_outputs_and_recomputes_the_last_token() {
        let hasher = BlockHasher::new(4).unwrap();
        let mut oracle = Oracle::new(hasher);
        let a: Vec<u32> = (0..10).collect(); // 2 full blocks + 2 tail tokens
        let seq_a = hasher.sequence_hashes(&a);
        assert_eq!(oracle.issue(a.len(), &seq_a), 0, "nothing seen yet");
        // Same prompt again: both full blocks hit (the last token is in the tail anyway).
        assert_eq!(oracle.issue(a.len(), &seq_a), 8);
        // A prompt of exactly 8 tokens: its last token is recomputed, so only 1 block hits.
        let b: Vec<u32> = (0..8).collect();
        assert_eq!(oracle.issue(b.len(), &hasher.sequence_hashes(&b)), 4);
        // The answer to `a` (6 tokens) makes a + answer[..5] = 15 tokens → 3 full blocks.
        let answer: Vec<u32> = (100..106).collect();
        oracle.finish(&a, seq_a.last().copied(), &answer);
        let next: Vec<u32> = a.iter().chain(&answer).copied().chain(200..210).collect();
        let seq_next = hasher.sequence_hashes(&next);
        assert_eq!(oracle.issue(next.len(), &seq_next), 12);
    }
}
