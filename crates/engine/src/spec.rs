//! Speculative decoding (seed 003): draft K tokens cheaply, verify them in one target pass.
//!
//! Each decode step of a sequence feeds the target model its last token plus K draft tokens.
//! Draft token `j` is accepted only if drafts `0..j` were, each with probability α, and the
//! target always contributes one token of its own (the correction or the bonus token). The
//! accepted count `a` per sequence per step is therefore truncated-geometric and
//!
//! ```text
//! E[tokens per step] = Σ_{j=0..K} α^j = (1 − α^(K+1)) / (1 − α)      (α < 1; K + 1 at α = 1)
//! ```
//!
//! The engine samples `a` per sequence per step from its seeded RNG, so runs are reproducible.
//!
//! Cost: the verification pass is a target step with K + 1 tokens per sequence (priced by the
//! timing model); the drafts cost `K × draft_cost_ratio × (a plain decode step)`. A separate
//! draft model (Llama-3.1-8B FP8 for a 70B target) costs ≈ 0.15 of a target step per draft
//! token and takes its weights out of the KV pool; an EAGLE-3 head reads the target's hidden
//! states, costs ≈ 0.04 of a step per draft token and weighs little.

use rand::Rng;
use serde::{Deserialize, Serialize};

/// Where draft tokens come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SpecMethod {
    /// A separate, smaller model of the same family (seed 003 phase 2: Llama 3.1 8B).
    DraftModel,
    /// EAGLE-3 prediction head on the target's hidden states (seed 003 phase 3).
    Eagle3,
}

/// Speculative decoding settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SpecDecodeConfig {
    pub method: SpecMethod,
    /// Draft length K (tokens proposed per step); seed 003 starts at 5.
    pub draft_len: u32,
    /// Per-token acceptance probability α in [0, 1].
    pub acceptance_rate: f64,
    /// Cost of one draft pass as a fraction of a plain target decode step; `None` takes the
    /// method's default ([`SpecDecodeConfig::cost_ratio`]).
    #[serde(default)]
    pub draft_cost_ratio: Option<f64>,
    /// GPU memory the drafter occupies; `None` takes the method's default.
    #[serde(default)]
    pub draft_weight_bytes: Option<u64>,
}

impl SpecDecodeConfig {
    /// Seed 003 phase 2: Llama-3.1-8B-Instruct FP8 drafting for the 70B target, K = 5.
    pub fn draft_model(draft_len: u32, acceptance_rate: f64) -> Self {
        SpecDecodeConfig {
            method: SpecMethod::DraftModel,
            draft_len,
            acceptance_rate,
            draft_cost_ratio: None,
            draft_weight_bytes: None,
        }
    }

    /// Seed 003 phase 3: EAGLE-3 heads.
    pub fn eagle3(draft_len: u32, acceptance_rate: f64) -> Self {
        SpecDecodeConfig {
            method: SpecMethod::Eagle3,
            ..Self::draft_model(draft_len, acceptance_rate)
        }
    }

    /// Cost of one draft pass relative to a plain decode step.
    pub fn cost_ratio(&self) -> f64 {
        self.draft_cost_ratio.unwrap_or(match self.method {
            // ≈ weight-read ratio 8 GB / 70.6 GB plus the draft's own launch overhead.
            SpecMethod::DraftModel => 0.15,
            // One transformer layer plus a projection out of 80 layers.
            SpecMethod::Eagle3 => 0.04,
        })
    }

    /// Bytes of GPU memory the drafter takes from the KV pool.
    pub fn weight_bytes(&self) -> u64 {
        self.draft_weight_bytes.unwrap_or(match self.method {
            SpecMethod::DraftModel => 8_030_000_000,
            SpecMethod::Eagle3 => 2_000_000_000,
        })
    }

    /// Expected tokens per step per sequence: `(1 − α^(K+1)) / (1 − α)`.
    pub fn expected_tokens_per_step(&self) -> f64 {
        expected_tokens_per_step(self.acceptance_rate, self.draft_len)
    }

    pub(crate) fn is_valid(&self) -> bool {
        (0.0..=1.0).contains(&self.acceptance_rate)
            && self.cost_ratio().is_finite()
            && self.cost_ratio() >= 0.0
            && self.draft_len <= 64
    }
}

/// `(1 − α^(K+1)) / (1 − α)` for α < 1, `K + 1` at α = 1.
pub fn expected_tokens_per_step(acceptance_rate: f64, draft_len: u32) -> f64 {
    let a = acceptance_rate.clamp(0.0, 1.0);
    let k1 = f64::from(draft_len) + 1.0;
    if a >= 1.0 {
        k1
    } else {
        (1.0 - a.powf(k1)) / (1.0 - a)
    }
}

/// Number of accepted draft tokens for one sequence in one step: the first rejection ends it.
pub(crate) fn sample_accepted<R: Rng>(rng: &mut R, acceptance_rate: f64, draft_len: u32) -> u32 {
    let mut accepted = 0;
    while accepted < draft_len && rng.random::<f64>() < acceptance_rate {
        accepted += 1;
    }
    accepted
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    #[test]
    fn expected_tokens_formula() {
        // α = 0.7, K = 5: (1 − 0.7^6) / 0.3 = (1 − 0.117649) / 0.3 = 2.94117.
        assert!((expected_tokens_per_step(0.7, 5) - 2.941_17).abs() < 1e-9);
        assert_eq!(expected_tokens_per_step(0.0, 5), 1.0);
        assert_eq!(expected_tokens_per_step(1.0, 5), 6.0);
        assert_eq!(expected_tokens_per_step(0.5, 0), 1.0);
    }

    #[test]
    fn sampled_mean_matches_formula() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let n = 200_000;
        let total: u64 = (0..n)
            .map(|_| u64::from(sample_accepted(&mut rng, 0.75, 4)) + 1)
            .sum();
        let mean = total as f64 / n as f64;
        let want = expected_tokens_per_step(0.75, 4);
        assert!((mean - want).abs() < 0.01, "{mean} vs {want}");
    }

    #[test]
    fn method_defaults() {
        let d = SpecDecodeConfig::draft_model(5, 0.6);
        let e = SpecDecodeConfig::eagle3(5, 0.8);
        assert!(d.cost_ratio() > e.cost_ratio());
        assert!(d.weight_bytes() > e.weight_bytes());
        assert!(d.is_valid() && e.is_valid());
        assert!(!SpecDecodeConfig::eagle3(5, 1.5).is_valid());
    }
}
