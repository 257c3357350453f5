//! Workload settings. `Default` is the seed's workload (seeds 000 and 002).

use rand::Rng;
use serde::{Deserialize, Serialize};

use crate::{LockStep, Mix, SystemGroups, WorkloadError};
pub use text::DEFAULT_SYSTEM_PROMPT;

/// Upper bound on [`WorkloadConfig::concurrency`] (and on `set_concurrency`): bounds the
/// conversation table.
pub const MAX_CONCURRENCY: u32 = 1_000_000;
/// Upper bound on turns per conversation.
pub const MAX_TURNS: u32 = 1_000;
/// Upper bound on a think time or the ramp, in seconds (one day).
pub const MAX_SECONDS: f64 = 86_400.0;
/// Upper bound on [`WorkloadConfig::rate_rps`], sessions per second.
pub const MAX_RATE: f64 = 1_000_000.0;
/// Default of [`WorkloadConfig::max_open`].
pub const DEFAULT_MAX_OPEN: u32 = 10_000;

/// The multi-turn chat workload of the seeds.
///
/// Each conversation takes one of the first `passages` passages of the corpus (uniformly),
/// sends it as the system message after `system_prompt` (~3,500–3,800 tokens), then a first
/// question; each of its `turns` turns resends the whole history with the chat template and
/// a new question; each reply has `output_tokens` tokens; the simulated user thinks
/// `think_time_s` between a reply and the next question. `concurrency` conversations are open
/// at all times: a finished one is replaced at once.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WorkloadConfig {
    /// Conversations open at once (the seed's concurrency, 60–180 in its sweeps).
    pub concurrency: u32,
    /// Turns per conversation, uniform over `min..=max` (seed: 3–5).
    pub turns: TurnRange,
    /// Output tokens per turn. Seed 002: ~830 on average; its sample conversation has 555,
    /// 818, 1,008, 875 and 888 (median 875, mean 829: most answers run close to a limit, a
    /// few stop early). Default: a 1,024-token limit minus an exponential shortfall of mean
    /// 198, redrawn below 300 — mean 845, median 891, standard deviation 158
    /// (docs/CALIBRATION.md).
    pub output_tokens: Distribution,
    /// Seconds the simulated user takes between a reply and the next question. Default 0:
    /// seed 002's own numbers say its next question arrived at once (by Little's law,
    /// concurrency ≈ requests/s × mean E2E at every level; docs/CALIBRATION.md).
    pub think_time_s: Distribution,
    /// The first `concurrency` conversations start evenly spread over this many seconds, so
    /// that time zero is not one burst of first turns. Growth by `set_concurrency` is
    /// immediate.
    pub ramp_s: f64,
    /// How many passages of the corpus conversations draw from (seed: a pool of 10).
    pub passages: u32,
    /// Instruction placed before the passage in the system message.
    pub system_prompt: String,
    /// Seed 004's workload mix: the weights of A (this chat), B (summarisation) and C
    /// (reasoning). Each new session draws its class. Default: chat only.
    pub mix: Mix,
    /// Open loop: new sessions arrive at this many per second, Poisson (exponential gaps from
    /// the workload's seed), instead of `concurrency` sessions open at all times. A session is
    /// a whole conversation for A (its later turns follow its replies and think times) and one
    /// request for B and C. `None` (the default): the closed loop.
    pub rate_rps: Option<f64>,
    /// Open loop: most sessions open at once. An arrival beyond it is refused and counted
    /// ([`crate::WorkloadStats::arrivals_dropped`]), so an arrival rate above what the system
    /// serves cannot grow memory without bound.
    pub max_open: u32,
    /// B: send the documents as they are, so a document drawn again is a prefix-cache hit
    /// (seed 004's pool of documents drawn at random). Default false: each B request's user
    /// message starts with its own request line, so B requests share nothing beyond the chat
    /// template and the instruction, as a summarisation service that rarely sees a document
    /// twice; B stays prefill-heavy however many requests are sent.
    pub repeat_documents: bool,
    /// B's answer length in tokens (default uniform 100–300).
    pub summary_tokens: Distribution,
    /// C's answer length as a multiple of the prompt's expected output length (default
    /// uniform 0.8–1.2).
    pub reasoning_scale: Distribution,
    /// Lock-step multi-turn ([`LockStep`]): every turn after the first adds new material
    /// sized on the history. `None` (the default): the seed's questions.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lockstep: Option<LockStep>,
    /// Conversations drawn into groups sharing one long system prompt ([`SystemGroups`])
    /// instead of one per passage. `None` (the default): the seed's passages.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub system_groups: Option<SystemGroups>,
}

const DEFAULT_SUMMARY_TOKENS: Distribution = Distribution::Uniform {
    min: 100.0,
    max: 300.0,
};
const DEFAULT_REASONING_SCALE: Distribution = Distribution::Uniform { min: 0.8, max: 1.2 };

impl Default for WorkloadConfig {
    fn default() -> Self {
        WorkloadConfig {
            concurrency: 100,
            turns: TurnRange { min: 3, max: 5 },
            output_tokens: Distribution::BelowCap {
                cap: 1_024.0,
                mean_shortfall: 198.0,
                min: 300.0,
            },
            think_time_s: Distribution::Constant { value: 0.0 },
            ramp_s: 30.0,
            passages: 10,
            system_prompt: DEFAULT_SYSTEM_PROMPT.to_owned(),
            mix: Mix::default(),
            rate_rps: None,
            max_open: DEFAULT_MAX_OPEN,
            repeat_documents: false,
            summary_tokens: DEFAULT_SUMMARY_TOKENS,
            reasoning_scale: DEFAULT_REASONING_SCALE,
            lockstep: None,
            system_groups: None,
        }
    }
}

/// An inclusive range of turn counts, drawn uniformly.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TurnRange {
    pub min: u32,
    pub max: u32,
}

impl TurnRange {
    pub fn sample(&self, rng: &mut impl Rng) -> u32 {
        rng.random_range(self.min..=self.max)
    }

    pub fn mean(&self) -> f64 {
        (self.min as f64 + self.max as f64) / 2.0
    }
}

/// A distribution of non-negative numbers (tokens or seconds).
///
/// Serialised with a `kind` tag, e.g. `{"kind": "uniform", "min": 0.5, "max": 1.5}`, or in
/// TOML `think_time_s = { kind = "constant", value = 2.0 }`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Distribution {
    /// Always `value`.
    Constant { value: f64 },
    /// Uniform over `[min, max]`.
    Uniform { min: f64, max: f64 },
    /// Normal, truncated to `[min, max]` (drawn again when outside, so there is no spike at the
    /// bounds).
    Normal {
        mean: f64,
        std_dev: f64,
        min: f64,
        max: f64,
    },
    /// Exponential with mean `mean`, truncated at `max`.
    Exponential { mean: f64, max: f64 },
    /// `cap` minus an exponential shortfall with mean `mean_shortfall`, drawn again below
    /// `min`: most draws land near the cap and a tail runs short. Answers that run until close
    /// to a length limit look like this (seed 002's sample: median 875, mean 829, max 1,008).
    BelowCap {
        cap: f64,
        mean_shortfall: f64,
        min: f64,
    },
}

impl Distribution {
    /// One draw. Always within the distribution's bounds.
    pub fn sample(&self, rng: &mut impl Rng) -> f64 {
        match *self {
            Distribution::Constant { value } => value,
            Distribution::Uniform { min, max } => {
                if max > min {
                    rng.random_range(min..=max)
                } else {
                    min
                }
            }
            Distribution::Normal {
                mean,
                std_dev,
                min,
                max,
            } => {
                // Rejection keeps the truncated shape; after 64 misses (bounds far in a tail)
                // fall back to clamping rather than loop.
                for _ in 0..64 {
                    let x = mean + std_dev * standard_normal(rng);
                    if (min..=max).contains(&x) {
                        return x;
                    }
                }
                mean.clamp(min, max)
            }
            Distribution::Exponential { mean, max } => {
                // Inverse CDF; 1 - u is in (0, 1] so the logarithm is finite.
                let u: f64 = rng.random();
                (-mean * (1.0 - u).ln()).min(max)
            }
            Distribution::BelowCap {
                cap,
                mean_shortfall,
                min,
            } => {
                // Rejection keeps the truncated shape, as for the normal.
                for _ in 0..64 {
                    let u: f64 = rng.random();
                    let x = cap + mean_shortfall * (1.0 - u).ln();
                    if x >= min {
                        return x;
                    }
                }
                cap
            }
        }
    }

    /// The smallest and largest values a draw can take.
    pub fn bounds(&self) -> (f64, f64) {
        match *self {
            Distribution::Constant { value } => (value, value),
            Distribution::Uniform { min, max } => (min, max),
            Distribution::Normal { min, max, .. } => (min, max),
            Distribution::Exponential { max, .. } => (0.0, max),
            Distribution::BelowCap { cap, min, .. } => (min, cap),
        }
    }

    /// Checks that every parameter is finite, non-negative and ordered; `what` names the
    /// setting in the error.
    pub fn validate(&self, what: &str) -> Result<(), WorkloadError> {
        let bad = |why: &str| Err(WorkloadError::InvalidConfig(format!("{what}: {why}")));
        let params: &[f64] = match self {
            Distribution::Constant { value } => &[*value],
            Distribution::Uniform { min, max } => &[*min, *max],
            Distribution::Normal {
                mean,
                std_dev,
                min,
                max,
            } => &[*mean, *std_dev, *min, *max],
            Distribution::Exponential { mean, max } => &[*mean, *max],
            Distribution::BelowCap {
                cap,
                mean_shortfall,
                min,
            } => &[*cap, *mean_shortfall, *min],
        };
        if params.iter().any(|p| !p.is_finite() || *p < 0.0) {
            return bad("every parameter must be a finite number ≥ 0");
        }
        let (min, max) = self.bounds();
        if min > max {
            return bad("min must not exceed max");
        }
        if let Distribution::Normal { mean, .. } = self {
            if !(min..=max).contains(mean) {
                return bad("the mean must lie within [min, max]");
            }
        }
        Ok(())
    }
}

/// A standard normal draw (Box–Muller; one of the pair is discarded to keep draws independent
/// of call order).
fn standard_normal(rng: &mut impl Rng) -> f64 {
    let u1: f64 = 1.0 - rng.random::<f64>(); // (0, 1]
    let u2: f64 = rng.random();
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

impl WorkloadConfig {
    /// Checks every setting; the error names the setting and what is expected.
    pub fn validate(&self) -> Result<(), WorkloadError> {
        let bad = |msg: String| Err(WorkloadError::InvalidConfig(msg));
        if self.concurrency > MAX_CONCURRENCY {
            return bad(format!("concurrency must be at most {MAX_CONCURRENCY}"));
        }
        if self.turns.min == 0 || self.turns.min > self.turns.max || self.turns.max > MAX_TURNS {
            return bad(format!(
                "turns: need 1 ≤ min ≤ max ≤ {MAX_TURNS}, got {}..={}",
                self.turns.min, self.turns.max
            ));
        }
        self.output_tokens.validate("output_tokens")?;
        if self.output_tokens.bounds().0 < 1.0 {
            return bad("output_tokens: every reply needs at least 1 token (min ≥ 1)".into());
        }
        self.think_time_s.validate("think_time_s")?;
        if self.think_time_s.bounds().1 > MAX_SECONDS {
            return bad(format!("think_time_s: at most {MAX_SECONDS} s"));
        }
        if !self.ramp_s.is_finite() || !(0.0..=MAX_SECONDS).contains(&self.ramp_s) {
            return bad(format!(
                "ramp_s must be between 0 and {MAX_SECONDS} seconds"
            ));
        }
        if self.passages == 0 {
            return bad("passages must be at least 1".into());
        }
        if let Err(e) = self.mix.validate() {
            return bad(format!("mix: {e}"));
        }
        if let Some(rate) = self.rate_rps {
            if !(rate.is_finite() && rate > 0.0 && rate <= MAX_RATE) {
                return bad(format!(
                    "rate_rps must be a number of sessions per second in (0, {MAX_RATE}], got {rate}"
                ));
            }
        }
        if self.max_open == 0 || self.max_open > MAX_CONCURRENCY {
            return bad(format!("max_open must be 1..={MAX_CONCURRENCY}"));
        }
        self.summary_tokens.validate("summary_tokens")?;
        if self.summary_tokens.bounds().0 < 1.0 {
            return bad("summary_tokens: every answer needs at least 1 token (min ≥ 1)".into());
        }
        self.reasoning_scale.validate("reasoning_scale")?;
        if self.reasoning_scale.bounds().0 <= 0.0 || self.reasoning_scale.bounds().1 > 4.0 {
            return bad("reasoning_scale: draws must lie in (0, 4]".into());
        }
        crate::families::validate(self, None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    #[test]
    fn draws_stay_within_bounds_and_match_the_mean() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let dists = [
            (Distribution::Constant { value: 2.0 }, 2.0),
            (Distribution::Uniform { min: 0.5, max: 1.5 }, 1.0),
            (WorkloadConfig::default().output_tokens, 845.0),
            (
                Distribution::Exponential {
                    mean: 3.0,
                    max: 1e9,
                },
                3.0,
            ),
        ];
        for (d, expected_mean) in dists {
            let (lo, hi) = d.bounds();
            let n = 100_000;
            let mut sum = 0.0;
            for _ in 0..n {
                let x = d.sample(&mut rng);
                assert!((lo..=hi).contains(&x), "{d:?} drew {x}");
                sum += x;
            }
            let mean = sum / n as f64;
            assert!(
                (mean - expected_mean).abs() <= 0.01 * expected_mean,
                "{d:?}: mean {mean}"
            );
        }
    }

    #[test]
    fn config_round_trips_through_json_and_toml_with_defaults_for_missing_fields() {
        let config = WorkloadConfig::default();
        let json = serde_json::to_string(&config).unwrap();
        assert_eq!(
            serde_json::from_str::<WorkloadConfig>(&json).unwrap(),
            config
        );
        let partial: WorkloadConfig = toml::from_str(
            "concurrency = 160\nthink_time_s = { kind = \"constant\", value = 2.0 }\n",
        )
        .unwrap();
        assert_eq!(partial.concurrency, 160);
        assert_eq!(partial.think_time_s, Distribution::Constant { value: 2.0 });
        assert_eq!(partial.turns, config.turns);
        assert!(toml::from_str::<WorkloadConfig>("concurency = 1").is_err());
    }

    #[test]
    fn invalid_settings_are_named() {
        let check = |f: fn(&mut WorkloadConfig), needle: &str| {
            let mut c = WorkloadConfig::default();
            f(&mut c);
            let err = c.validate().unwrap_err().to_string();
            assert!(err.contains(needle), "{err} should mention {needle}");
        };
        check(|c| c.turns = TurnRange { min: 4, max: 3 }, "turns");
        check(|c| c.turns.min = 0, "turns");
        check(|c| c.concurrency = MAX_CONCURRENCY + 1, "concurrency");
        check(
            |c| c.output_tokens = Distribution::Uniform { min: 0.0, max: 5.0 },
            "output_tokens",
        );
        check(
            |c| c.think_time_s = Distribution::Constant { value: f64::NAN },
            "think_time_s",
        );
        check(
            |c| {
                c.output_tokens = Distribution::Normal {
                    mean: 10.0,
                    std_dev: 1.0,
                    min: 20.0,
                    max: 30.0,
                }
            },
            "mean",
        );
        check(|c| c.ramp_s = -1.0, "ramp_s");
        check(|c| c.passages = 0, "passages");
        check(|c| c.rate_rps = Some(0.0), "rate_rps");
        check(|c| c.rate_rps = Some(f64::INFINITY), "rate_rps");
        check(|c| c.max_open = 0, "max_open");
        check(
            |c| c.summary_tokens = Distribution::Constant { value: 0.0 },
            "summary_tokens",
        );
        assert!(WorkloadConfig::default().validate().is_ok());
    }
}
