//! Speculative decoding (seed 003): draft K tokens cheaply, verify them in one target pass.
//!
//! # Acceptance
//!
//! Each decode step of a sequence feeds the target model its last token plus K draft tokens.
//! Draft token `j` is accepted only if drafts `0..j` were, each with probability α (the
//! per-token acceptance probability of Leviathan et al.), and the target always contributes one
//! token of its own (the correction or the bonus token). The accepted count per sequence per
//! step is therefore truncated-geometric and
//!
//! ```text
//! E[tokens per step] = Σ_{j=0..K} α^j = (1 − α^(K+1)) / (1 − α)      (α < 1; K + 1 at α = 1)
//! ```
//!
//! α depends on what is being written: predictable, factual replies are accepted more often
//! than creative ones (seed 003). A configuration may give classes of content, each with its
//! share of requests and its α ([`ContentAcceptance`]); a request's class is drawn from a hash
//! of its prompt, so the same request gets the same class on any worker and in any run.
//! Requests no class covers get [`SpecDecodeConfig::acceptance_rate`].
//!
//! Acceptance is sampled per sequence per step from a counter-based generator keyed by (engine
//! seed, request, step of that request): no generator state is carried from step to step, so
//! a speed-mode stretch can draw a step's outcome when it plans it and step-by-step mode draws
//! the same outcome when it completes it.
//!
//! # Cost
//!
//! Priced by the hardware profile from the drafter's own size ([`Drafter`], see
//! `profile.rs`): K sequential draft passes per step (each one weight read of the drafter,
//! its KV reads, its all-reduces under tensor parallelism and a launch overhead), the
//! drafter's share of every prefill (it builds its own KV of the prompt), and the target's
//! verification pass over K + 1 tokens per sequence (weights read once; at large batches the
//! GEMMs turn compute bound, which is why speculation pays less under load). Memory: the
//! drafter's weights and its KV per token come out of the KV pool.
//!
//! A separate draft model (Llama-3.1-8B FP8 for a 70B target) is a full 32-layer model: its
//! passes are the main overhead. An EAGLE-3 head is one transformer layer reading the target's
//! hidden states plus a small LM head: cheap passes, little memory.

use serde::{Deserialize, Serialize};

/// Where draft tokens come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SpecMethod {
    /// A separate, smaller model of the same family (seed 003 phase 3a: Llama 3.1 8B).
    #[serde(alias = "draft")]
    DraftModel,
    /// EAGLE-3 prediction head on the target's hidden states (seed 003 phase 3b).
    Eagle3,
}

impl SpecMethod {
    /// The name `--spec-decode` takes and metrics show (`draft`, `eagle3`).
    pub fn name(self) -> &'static str {
        match self {
            SpecMethod::DraftModel => "draft",
            SpecMethod::Eagle3 => "eagle3",
        }
    }
}

/// The model that proposes draft tokens, as the timing and memory model needs it.
///
/// Sizes are the whole drafter's; with tensor parallelism it is split over the worker's GPUs
/// like the target.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Drafter {
    /// Parameters a draft pass multiplies (2 FLOPs each per token).
    pub params: f64,
    /// Resident weight bytes, streamed once per draft pass.
    pub weight_bytes: u64,
    /// The drafter's own KV cache per token (all its layers, K and V), held in the same pool
    /// as the target's.
    pub kv_bytes_per_token: u64,
    /// Transformer layers: under tensor parallelism, two all-reduces each per pass.
    pub layers: u32,
    /// Fixed cost of one draft pass (kernel launches, sampling the draft token), nanoseconds.
    pub pass_overhead_ns: u64,
}

impl Drafter {
    /// Llama-3.1-8B-Instruct in FP8 (seed 003 phase 3a): 8.03 B parameters at one byte, 32
    /// layers, FP8 KV of 32 layers × 8 KV heads × 128 dims × 2 = 65,536 B/token. A separate
    /// model runs its own forward passes, one per draft token: 0.15 ms of launch and sampling
    /// each (our estimate, uncertain: docs/SPECULATIVE.md).
    pub fn llama_8b_fp8() -> Drafter {
        Drafter {
            params: 8.03e9,
            weight_bytes: 8_030_000_000,
            kv_bytes_per_token: 32 * 8 * 128 * 2,
            layers: 32,
            pass_overhead_ns: 150_000,
        }
    }

    /// An EAGLE-3 head for Llama-3.3-70B (seed 003 phase 3b): one decoder layer (its QKV takes
    /// the token embedding and the fused hidden state, 2 × 8,192 wide) and a 32k-token draft LM
    /// head, about 1.2 B parameters in BF16 (2.4 GB); KV of one layer in BF16, 4,096 B/token.
    /// It runs inside the target's engine step (TensorRT-LLM's one-model mode): 20 µs per pass.
    pub fn eagle3_llama70b() -> Drafter {
        Drafter {
            params: 1.2e9,
            weight_bytes: 2_400_000_000,
            kv_bytes_per_token: 8 * 128 * 2 * 2,
            layers: 1,
            pass_overhead_ns: 20_000,
        }
    }
}

/// The acceptance probability of one class of content.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ContentAcceptance {
    /// For people (`factual`, `creative`).
    pub content: String,
    /// Share of requests in this class, 0..1 (the shares of all classes sum to at most 1).
    pub share: f64,
    /// Per-token acceptance probability α of this class.
    pub acceptance_rate: f64,
}

/// Speculative decoding settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SpecDecodeConfig {
    pub method: SpecMethod,
    /// Draft length K (tokens proposed per step); seed 003 starts at 5.
    pub draft_len: u32,
    /// Per-token acceptance probability α in [0, 1] of requests no content class covers.
    pub acceptance_rate: f64,
    /// Classes of content with their own α (optional).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub by_content: Vec<ContentAcceptance>,
    /// The drafter's size; `None` takes the method's default ([`SpecDecodeConfig::drafter`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drafter: Option<Drafter>,
    /// Instead of pricing the drafter from its size: each draft pass costs this fraction of a
    /// plain decode step. The Dynamo mocker timing, which has no hardware, always uses it
    /// (default 0.15 for a draft model, 0.04 for EAGLE-3).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub draft_cost_ratio: Option<f64>,
}

/// Most draft tokens per step.
pub const MAX_DRAFT_LEN: u32 = 16;

impl SpecDecodeConfig {
    /// A separate draft model (Llama-3.1-8B FP8 by default) with one α for all content.
    pub fn draft_model(draft_len: u32, acceptance_rate: f64) -> Self {
        SpecDecodeConfig {
            method: SpecMethod::DraftModel,
            draft_len,
            acceptance_rate,
            by_content: Vec::new(),
            drafter: None,
            draft_cost_ratio: None,
        }
    }

    /// EAGLE-3 heads with one α for all content.
    pub fn eagle3(draft_len: u32, acceptance_rate: f64) -> Self {
        SpecDecodeConfig {
            method: SpecMethod::Eagle3,
            ..Self::draft_model(draft_len, acceptance_rate)
        }
    }

    /// Seed 003 phase 3a: Llama-3.1-8B FP8 drafting K = 5 for Llama-3.1-70B, α 0.70 on the
    /// half of requests that are factual and 0.55 on the rest (the seed's "55–70% depending on
    /// the task"; sources in docs/SPECULATIVE.md).
    pub fn seed_003_draft() -> Self {
        SpecDecodeConfig {
            by_content: vec![ContentAcceptance {
                content: "factual".into(),
                share: 0.5,
                acceptance_rate: 0.70,
            }],
            drafter: Some(Drafter::llama_8b_fp8()),
            ..Self::draft_model(5, 0.55)
        }
    }

    /// Seed 003 phase 3b: EAGLE-3 heads on Llama-3.3-70B, K = 5, α 0.85 on factual requests
    /// and 0.70 on the rest (the seed's "70–85%").
    pub fn seed_003_eagle3() -> Self {
        SpecDecodeConfig {
            by_content: vec![ContentAcceptance {
                content: "factual".into(),
                share: 0.5,
                acceptance_rate: 0.85,
            }],
            drafter: Some(Drafter::eagle3_llama70b()),
            ..Self::eagle3(5, 0.70)
        }
    }

    /// The drafter priced: the configured one, else the method's default (sized for a
    /// Llama-70B target).
    pub fn drafter(&self) -> Drafter {
        self.drafter.unwrap_or(match self.method {
            SpecMethod::DraftModel => Drafter::llama_8b_fp8(),
            SpecMethod::Eagle3 => Drafter::eagle3_llama70b(),
        })
    }

    /// Cost of one draft pass relative to a plain decode step, for timing models that cannot
    /// price the drafter (the Dynamo mocker) or when set explicitly.
    pub fn cost_ratio(&self) -> f64 {
        self.draft_cost_ratio.unwrap_or(match self.method {
            // ≈ weight-read ratio 8 GB / 70.6 GB plus the draft's own launch overhead.
            SpecMethod::DraftModel => 0.15,
            // One transformer layer plus a projection out of 80 layers.
            SpecMethod::Eagle3 => 0.04,
        })
    }

    /// Bytes of GPU memory the drafter's weights take from the KV pool.
    pub fn weight_bytes(&self) -> u64 {
        self.drafter().weight_bytes
    }

    /// The α of a request with this prompt: its content class's, drawn from a hash of the
    /// prompt's last tokens (stable across workers and runs), else `acceptance_rate`.
    pub fn acceptance_for(&self, prompt: &[u32]) -> f64 {
        if self.by_content.is_empty() {
            return self.acceptance_rate;
        }
        let tail = &prompt[prompt.len().saturating_sub(16)..];
        let h = tail.iter().fold(0x5EC0_DE00_u64, |h, &t| {
            mix(h ^ u64::from(t).wrapping_mul(0x9E37_79B9_7F4A_7C15))
        });
        let u = unit(h);
        let mut cumulative = 0.0;
        for class in &self.by_content {
            cumulative += class.share;
            if u < cumulative {
                return class.acceptance_rate;
            }
        }
        self.acceptance_rate
    }

    /// The mean α over requests (the classes weighted by their shares).
    pub fn mean_acceptance_rate(&self) -> f64 {
        let covered: f64 = self.by_content.iter().map(|c| c.share).sum();
        let classes: f64 = self
            .by_content
            .iter()
            .map(|c| c.share * c.acceptance_rate)
            .sum();
        classes + (1.0 - covered).max(0.0) * self.acceptance_rate
    }

    /// Expected tokens per step per sequence at the default α: `(1 − α^(K+1)) / (1 − α)`.
    pub fn expected_tokens_per_step(&self) -> f64 {
        expected_tokens_per_step(self.acceptance_rate, self.draft_len)
    }

    /// Expected tokens per step over the content classes (the mean of the formula per class,
    /// which is not the formula at the mean α).
    pub fn mean_tokens_per_step(&self) -> f64 {
        let covered: f64 = self.by_content.iter().map(|c| c.share).sum();
        let classes: f64 = self
            .by_content
            .iter()
            .map(|c| c.share * expected_tokens_per_step(c.acceptance_rate, self.draft_len))
            .sum();
        classes
            + (1.0 - covered).max(0.0)
                * expected_tokens_per_step(self.acceptance_rate, self.draft_len)
    }

    /// What is wrong with these settings, if anything.
    pub fn problem(&self) -> Option<String> {
        let prob = |x: f64| x.is_finite() && (0.0..=1.0).contains(&x);
        if self.draft_len > MAX_DRAFT_LEN {
            return Some(format!(
                "draft_len must be at most {MAX_DRAFT_LEN}, got {}",
                self.draft_len
            ));
        }
        if !prob(self.acceptance_rate) {
            return Some(format!(
                "acceptance_rate must be in [0, 1], got {}",
                self.acceptance_rate
            ));
        }
        let mut shares = 0.0;
        for c in &self.by_content {
            if !prob(c.share) || !prob(c.acceptance_rate) {
                return Some(format!(
                    "content class {:?}: share and acceptance_rate must be in [0, 1]",
                    c.content
                ));
            }
            shares += c.share;
        }
        if shares > 1.0 + 1e-9 {
            return Some(format!(
                "the content classes' shares sum to {shares}, more than 1"
            ));
        }
        if self.by_content.len() > 64 {
            return Some("at most 64 content classes".into());
        }
        if let Some(r) = self.draft_cost_ratio {
            if !(r.is_finite() && r >= 0.0) {
                return Some(format!("draft_cost_ratio must be ≥ 0, got {r}"));
            }
        }
        let d = self.drafter();
        if !(d.params.is_finite() && d.params >= 0.0) {
            return Some("drafter.params must be a non-negative number".into());
        }
        None
    }

    pub(crate) fn is_valid(&self) -> bool {
        self.problem().is_none()
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

/// SplitMix64's finaliser: a bijective mix of 64 bits.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A uniform draw in [0, 1) from 64 random bits.
fn unit(bits: u64) -> f64 {
    (bits >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Accepted draft tokens of request `serial`'s `step`-th speculative step on an engine seeded
/// `seed`: the first rejection ends the run. A pure function of its arguments (see the module
/// docs for why).
pub(crate) fn accepted_drafts(
    seed: u64,
    serial: u64,
    step: u32,
    alpha: f64,
    draft_len: u32,
) -> u32 {
    let base =
        mix(mix(seed ^ 0xD1B5_4A32_D192_ED03) ^ mix(serial) ^ u64::from(step).rotate_left(32));
    let mut accepted = 0;
    while accepted < draft_len && unit(mix(base ^ u64::from(accepted))) < alpha {
        accepted += 1;
    }
    accepted
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expected_tokens_formula() {
        // α = 0.7, K = 5: (1 − 0.7^6) / 0.3 = (1 − 0.117649) / 0.3 = 2.94117.
        assert!((expected_tokens_per_step(0.7, 5) - 2.941_17).abs() < 1e-5);
        assert_eq!(expected_tokens_per_step(0.0, 5), 1.0);
        assert_eq!(expected_tokens_per_step(1.0, 5), 6.0);
        assert_eq!(expected_tokens_per_step(0.5, 0), 1.0);
    }

    #[test]
    fn sampled_mean_matches_formula() {
        let n = 200_000u64;
        let total: u64 = (0..n)
            .map(|i| u64::from(accepted_drafts(7, i / 50, (i % 50) as u32, 0.75, 4)) + 1)
            .sum();
        let mean = total as f64 / n as f64;
        let want = expected_tokens_per_step(0.75, 4);
        assert!((mean - want).abs() < 0.01, "{mean} vs {want}");
        // Pure: the same arguments, the same draw.
        assert_eq!(
            accepted_drafts(3, 17, 4, 0.6, 5),
            accepted_drafts(3, 17, 4, 0.6, 5)
        );
    }

    #[test]
    fn content_classes_split_requests_by_share() {
        let cfg = SpecDecodeConfig::seed_003_draft();
        let n = 20_000u32;
        let factual = (0..n)
            .filter(|&i| cfg.acceptance_for(&[1, 2, i, i.wrapping_mul(7)]) == 0.70)
            .count();
        let share = factual as f64 / f64::from(n);
        assert!((share - 0.5).abs() < 0.02, "{share}");
        assert!((cfg.mean_acceptance_rate() - 0.625).abs() < 1e-12);
        let want = 0.5 * expected_tokens_per_step(0.7, 5) + 0.5 * expected_tokens_per_step(0.55, 5);
        assert!((cfg.mean_tokens_per_step() - want).abs() < 1e-12);
        // Without classes, everyone gets the one α.
        let plain = SpecDecodeConfig::eagle3(3, 0.8);
        assert_eq!(plain.acceptance_for(&[5, 6, 7]), 0.8);
    }

    #[test]
    fn method_defaults_and_validation() {
        let d = SpecDecodeConfig::draft_model(5, 0.6);
        let e = SpecDecodeConfig::eagle3(5, 0.8);
        assert!(d.cost_ratio() > e.cost_ratio());
        assert!(d.weight_bytes() > e.weight_bytes());
        assert!(d.drafter().kv_bytes_per_token > e.drafter().kv_bytes_per_token);
        assert!(d.is_valid() && e.is_valid());
        assert!(!SpecDecodeConfig::eagle3(5, 1.5).is_valid());
        assert!(!SpecDecodeConfig::eagle3(MAX_DRAFT_LEN + 1, 0.5).is_valid());
        let mut over = SpecDecodeConfig::seed_003_eagle3();
        over.by_content[0].share = 1.5;
        assert!(over.problem().unwrap().contains("share"));
        assert_eq!(SpecMethod::Eagle3.name(), "eagle3");
    }
}
