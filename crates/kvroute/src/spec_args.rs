//! `--spec-decode` and its overrides, shared by `engine`, `sim`, `bench` and `demo`.

use anyhow::{Result, bail};
use engine::{EngineConfig, MAX_DRAFT_LEN, SpecDecodeConfig};

/// Speculative decoding options.
#[derive(Debug, Clone, clap::Args)]
pub struct SpecArgs {
    /// Speculative decoding: `off`, or a configuration the profile names (`draft`: Llama-3.1-8B
    /// FP8 drafting for the 70B; `eagle3`: EAGLE-3 heads; `kvroute profiles show NAME` lists
    /// them with their draft length, acceptance and drafter size).
    #[arg(long, default_value = "off", value_name = "off|draft|eagle3")]
    pub spec_decode: String,
    /// Draft tokens per step (K), instead of the configuration's.
    #[arg(long, value_name = "K")]
    pub draft_len: Option<u32>,
    /// One per-token acceptance probability for every request (0–1), instead of the
    /// configuration's (which may differ by content).
    #[arg(long, value_name = "ALPHA")]
    pub acceptance_rate: Option<f64>,
}

impl SpecArgs {
    /// The configuration these flags select on `engine`'s profile (`None`: off).
    pub fn resolve(&self, engine: &EngineConfig) -> Result<Option<SpecDecodeConfig>> {
        let name = self.spec_decode.trim();
        if name == "off" || name == "none" {
            if self.draft_len.is_some() || self.acceptance_rate.is_some() {
                bail!("--draft-len and --acceptance-rate need --spec-decode draft|eagle3");
            }
            return Ok(None);
        }
        let mut spec = engine
            .profile
            .speculative_config(name)
            .map_err(|e| anyhow::anyhow!("--spec-decode {name}: {e} (or off)"))?;
        if let Some(k) = self.draft_len {
            if !(1..=MAX_DRAFT_LEN).contains(&k) {
                bail!("--draft-len must be between 1 and {MAX_DRAFT_LEN}, got {k}");
            }
            spec.draft_len = k;
        }
        if let Some(a) = self.acceptance_rate {
            if !(a.is_finite() && (0.0..=1.0).contains(&a)) {
                bail!("--acceptance-rate must be a probability in [0, 1], got {a}");
            }
            spec.acceptance_rate = a;
            spec.by_content.clear();
        }
        if let Some(problem) = spec.problem() {
            bail!("--spec-decode {name}: {problem}");
        }
        Ok(Some(spec))
    }

    /// Applies the selection to `engine`.
    pub fn apply(&self, engine: &mut EngineConfig) -> Result<()> {
        engine.spec_decode = self.resolve(engine)?;
        Ok(())
    }
}
