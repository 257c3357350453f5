//! Seed 004's three workloads and their mix.
//!
//! - **A**, chat: the seed's multi-turn conversations about a passage (as before);
//! - **B**, summarisation: one request, an instruction and a long document (≈ 4k, 10k or 18k
//!   tokens), a short answer (100–300 tokens): prefill-heavy;
//! - **C**, reasoning: one request, a short prompt, a long answer (the prompt's expected length,
//!   1,000–4,000 tokens): decode-heavy.
//!
//! A [`Mix`] weighs them (`A=40,B=30,C=30`); each new session (a conversation for A, a single
//! request for B and C) draws its class from the mix, from its own RNG stream, so session *k*
//! of a seed has the same class whatever the timing ([`Mix::class_of`]).

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

/// One of seed 004's workloads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Class {
    /// Multi-turn chat.
    A,
    /// Summarisation.
    B,
    /// Reasoning.
    C,
}

impl Class {
    pub const ALL: [Class; 3] = [Class::A, Class::B, Class::C];

    /// `A`, `B` or `C`.
    pub fn letter(self) -> &'static str {
        match self {
            Class::A => "A",
            Class::B => "B",
            Class::C => "C",
        }
    }

    /// `chat`, `summarisation` or `reasoning`.
    pub fn name(self) -> &'static str {
        match self {
            Class::A => "chat",
            Class::B => "summarisation",
            Class::C => "reasoning",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for Class {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.letter())
    }
}

/// Why a mix was refused. Messages name the part that was wrong.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum MixError {
    #[error("unknown workload `{0}` (expected A, B or C)")]
    UnknownClass(String),
    #[error("expected LETTER=WEIGHT, got `{0}`")]
    Syntax(String),
    #[error("the weight of {class} must be a non-negative integer, got `{value}`")]
    BadWeight { class: Class, value: String },
    #[error("{0} is given twice")]
    Repeated(Class),
    #[error("every weight is zero: at least one workload needs a positive weight")]
    AllZero,
    #[error("the weights add up to more than {max}")]
    TooLarge { max: u32 },
}

/// Weights of workloads A, B and C (non-negative integers, not all zero; percentages by
/// convention). `Default` is chat only (`A=100`), the seeds' workload.
///
/// Written `A=40,B=30,C=30` on the command line (letters in any order and case; a letter left
/// out weighs 0) and `{"A": 40, "B": 30, "C": 30}` in JSON/TOML.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "BTreeMap<String, u32>", into = "BTreeMap<String, u32>")]
pub struct Mix {
    weights: [u32; 3],
}

/// The largest sum of weights a mix may have.
pub const MAX_MIX_TOTAL: u32 = 1_000_000;

/// Salt of the class draws' RNG, so they are independent of the conversations' own streams.
const CLASS_SALT: u64 = 0x6d69_785f_636c_6173;

impl Default for Mix {
    fn default() -> Self {
        Mix {
            weights: [100, 0, 0],
        }
    }
}

impl Mix {
    /// A mix of these weights for A, B and C.
    pub fn new(a: u32, b: u32, c: u32) -> Result<Mix, MixError> {
        let mix = Mix { weights: [a, b, c] };
        mix.validate()?;
        Ok(mix)
    }

    /// Only chat (B and C weigh 0): sessions draw no class at all, so a chat-only run is the
    /// seeds' workload exactly.
    pub fn is_chat_only(&self) -> bool {
        self.weights[1] == 0 && self.weights[2] == 0
    }

    pub fn weight(&self, class: Class) -> u32 {
        self.weights[class.index()]
    }

    /// Sum of the weights.
    pub fn total(&self) -> u32 {
        self.weights.iter().sum()
    }

    /// The share of `class`, in [0, 1].
    pub fn share(&self, class: Class) -> f64 {
        f64::from(self.weight(class)) / f64::from(self.total().max(1))
    }

    pub fn validate(&self) -> Result<(), MixError> {
        let total: u64 = self.weights.iter().map(|w| u64::from(*w)).sum();
        if total == 0 {
            return Err(MixError::AllZero);
        }
        if total > u64::from(MAX_MIX_TOTAL) {
            return Err(MixError::TooLarge { max: MAX_MIX_TOTAL });
        }
        Ok(())
    }

    /// One draw, with probabilities proportional to the weights.
    pub fn draw(&self, rng: &mut impl Rng) -> Class {
        let total = self.total();
        if total == 0 {
            return Class::A;
        }
        let mut u = rng.random_range(0..total);
        for class in Class::ALL {
            let w = self.weight(class);
            if u < w {
                return class;
            }
            u -= w;
        }
        Class::C
    }

    /// The class of session `session` of the workload seeded `seed` under this mix: a pure
    /// function, so a driver can tell a request's class from its key (valid while the mix is
    /// the one the session was opened under). Chat-only mixes draw nothing.
    pub fn class_of(&self, seed: u64, session: u64) -> Class {
        if self.is_chat_only() {
            return Class::A;
        }
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ CLASS_SALT);
        rng.set_stream(session);
        self.draw(&mut rng)
    }
}

impl fmt::Display for Mix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let [a, b, c] = self.weights;
        write!(f, "A={a},B={b},C={c}")
    }
}

fn parse_class(s: &str) -> Result<Class, MixError> {
    match s.trim() {
        "A" | "a" => Ok(Class::A),
        "B" | "b" => Ok(Class::B),
        "C" | "c" => Ok(Class::C),
        other => Err(MixError::UnknownClass(other.to_owned())),
    }
}

impl FromStr for Mix {
    type Err = MixError;

    fn from_str(s: &str) -> Result<Mix, MixError> {
        let mut weights = [None; 3];
        for part in s.split(',') {
            let Some((letter, value)) = part.split_once('=') else {
                return Err(MixError::Syntax(part.trim().to_owned()));
            };
            let class = parse_class(letter)?;
            let weight: u32 = value.trim().parse().map_err(|_| MixError::BadWeight {
                class,
                value: value.trim().to_owned(),
            })?;
            let slot = &mut weights[class.index()];
            if slot.is_some() {
                return Err(MixError::Repeated(class));
            }
            *slot = Some(weight);
        }
        let [a, b, c] = weights.map(|w| w.unwrap_or(0));
        Mix::new(a, b, c)
    }
}

impl TryFrom<BTreeMap<String, u32>> for Mix {
    type Error = MixError;

    fn try_from(map: BTreeMap<String, u32>) -> Result<Mix, MixError> {
        let mut weights = [None; 3];
        for (letter, weight) in map {
            let class = parse_class(&letter)?;
            if weights[class.index()].replace(weight).is_some() {
                return Err(MixError::Repeated(class));
            }
        }
        let [a, b, c] = weights.map(|w| w.unwrap_or(0));
        Mix::new(a, b, c)
    }
}

impl From<Mix> for BTreeMap<String, u32> {
    fn from(mix: Mix) -> Self {
        Class::ALL
            .into_iter()
            .map(|c| (c.letter().to_owned(), mix.weight(c)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints_the_flag_form() {
        let mix: Mix = "A=40,B=30,C=30".parse().unwrap();
        assert_eq!(mix, Mix::new(40, 30, 30).unwrap());
        assert_eq!(mix.to_string(), "A=40,B=30,C=30");
        assert_eq!(
            "c=1, a=3".parse::<Mix>().unwrap(),
            Mix::new(3, 0, 1).unwrap()
        );
        assert!("A=100".parse::<Mix>().unwrap().is_chat_only());
    }

    #[test]
    fn refuses_bad_mixes_with_the_reason() {
        let err = |s: &str| s.parse::<Mix>().unwrap_err();
        assert_eq!(err("D=10"), MixError::UnknownClass("D".into()));
        assert_eq!(err("A=0,B=0"), MixError::AllZero);
        assert!(matches!(
            err("A=-1"),
            MixError::BadWeight {
                class: Class::A,
                ..
            }
        ));
        assert!(matches!(err("A=1.5"), MixError::BadWeight { .. }));
        assert_eq!(err("A=1,A=2"), MixError::Repeated(Class::A));
        assert!(matches!(err("A"), MixError::Syntax(_)));
        assert!(matches!(err(""), MixError::Syntax(_)));
        assert!(matches!(err("A=5000000000"), MixError::BadWeight { .. }));
        assert!(matches!(
            err("A=900000,B=900000"),
            MixError::TooLarge { .. }
        ));
    }

    #[test]
    fn round_trips_through_json_as_an_object() {
        let mix = Mix::new(40, 30, 30).unwrap();
        let json = serde_json::to_string(&mix).unwrap();
        assert_eq!(json, r#"{"A":40,"B":30,"C":30}"#);
        assert_eq!(serde_json::from_str::<Mix>(&json).unwrap(), mix);
        assert!(serde_json::from_str::<Mix>(r#"{"A":0}"#).is_err());
        assert!(serde_json::from_str::<Mix>(r#"{"X":1}"#).is_err());
    }

    #[test]
    fn draws_follow_the_weights() {
        let mix = Mix::new(40, 30, 30).unwrap();
        let n = 100_000u64;
        let mut counts = [0u64; 3];
        for k in 0..n {
            counts[mix.class_of(7, k).index()] += 1;
        }
        for class in Class::ALL {
            let share = counts[class.index()] as f64 / n as f64;
            assert!(
                (share - mix.share(class)).abs() < 0.01,
                "{class}: {share} of draws, weight {}",
                mix.share(class)
            );
        }
        // Deterministic per seed and session; another seed gives other draws.
        assert_eq!(mix.class_of(7, 12_345), mix.class_of(7, 12_345));
        assert!((0..64).any(|k| mix.class_of(7, k) != mix.class_of(8, k)));
        assert_eq!(Mix::default().class_of(7, 3), Class::A);
    }
}
