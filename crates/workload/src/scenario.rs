//! Seed 004's auto-mode scenario controller, sans-IO: a cycle of phases, each with a duration,
//! a workload mix, a request rate and a scaling action on the prefill and decode pools.
//!
//! ```text
//! IDLE → BALANCED 2 min (A:40 B:30 C:30, initial P:D) → KV_CACHE_DEMO 2 min (A:100)
//!      → PREFILL_STRESS 1.5 min (B:80 C:20) → PREFILL_RECOVERY 1.5 min (add prefill)
//!      → DECODE_STRESS 1.5 min (B:20 C:80) → DECODE_RECOVERY 1.5 min (add decode)
//!      → FULL_LOAD 2 min (A:30 B:35 C:35) → COOLDOWN 1 min (rate ramps to 0, initial P:D)
//!      → BALANCED …
//! ```
//!
//! [`ScenarioConfig`] is the cycle (a TOML file, [`ScenarioConfig::from_toml`]; the seed's is
//! [`ScenarioConfig::seed004`] and `scenarios/seed004.toml`). [`ScenarioController`] walks it:
//! the driver (the load generator in real time, the simulator in virtual time) calls
//! [`ScenarioController::start`], sleeps until [`ScenarioController::poll_timeout`], calls
//! [`ScenarioController::handle_timeout`] and applies the [`ScenarioAction`]s it gets: set the
//! mix, set the rate, scale a pool. [`ScenarioController::status`] is what the dashboard shows
//! (the phase, the time left, the pool sizes it asked for).
//!
//! **Architecture invariant:** no clock, no I/O; the file's text comes in as a string.
//!
//! ```
//! use nanotime::Nanos;
//! use workload::scenario::{ScenarioAction, ScenarioConfig, ScenarioController};
//!
//! let mut controller = ScenarioController::new(ScenarioConfig::seed004()).unwrap();
//! let actions = controller.start(Nanos::ZERO, None).unwrap();
//! assert!(matches!(&actions[0], ScenarioAction::EnterPhase { name, .. } if name == "BALANCED"));
//! // BALANCED lasts two minutes; then KV_CACHE_DEMO sends chat only.
//! assert_eq!(controller.poll_timeout(), Some(Nanos::from_secs(120)));
//! let actions = controller.handle_timeout(Nanos::from_secs(120));
//! assert!(actions.iter().any(|a| matches!(a, ScenarioAction::SetMix(m) if m.is_chat_only())));
//! ```

use std::fmt;
use std::str::FromStr;

use nanotime::Nanos;
use serde::{Deserialize, Serialize};

use crate::Mix;

/// The seed's cycle as a file, for users to copy and edit (`kvroute sim --scenario FILE`).
pub const SEED004_TOML: &str = include_str!("../scenarios/seed004.toml");

/// During a rate ramp, the rate is set again this often.
pub const RAMP_STEP: Nanos = Nanos::from_secs(5);

/// At most this many phases in a cycle.
pub const MAX_PHASES: usize = 64;
/// The phase the status names in manual mode; no phase of a cycle may take it.
pub const IDLE_PHASE: &str = "IDLE";

/// The longest phase: one day.
pub const MAX_PHASE_S: f64 = 86_400.0;

/// The highest rate a phase may ask for (requests per second), as the workload's own bound.
pub const MAX_SCENARIO_RATE: f64 = crate::MAX_RATE;

/// The largest pool a scenario may ask for.
pub const MAX_POOL_SIZE: u32 = 1_024;

/// Replica counts of the two pools.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolSizes {
    pub prefill: u32,
    pub decode: u32,
}

/// Which pool a [`ScenarioAction::Scale`] resizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PoolKind {
    Prefill,
    Decode,
}

impl PoolKind {
    pub const ALL: [PoolKind; 2] = [PoolKind::Prefill, PoolKind::Decode];

    pub fn as_str(self) -> &'static str {
        match self {
            PoolKind::Prefill => "prefill",
            PoolKind::Decode => "decode",
        }
    }
}

impl fmt::Display for PoolKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl PoolSizes {
    pub fn get(&self, pool: PoolKind) -> u32 {
        match pool {
            PoolKind::Prefill => self.prefill,
            PoolKind::Decode => self.decode,
        }
    }

    fn set(&mut self, pool: PoolKind, size: u32) {
        match pool {
            PoolKind::Prefill => self.prefill = size,
            PoolKind::Decode => self.decode = size,
        }
    }
}

/// What a phase does to a pool when it starts. Written `"keep"`, `"initial"`, `"+N"` (add N
/// workers, up to the cycle's `max`) or `"N"` (exactly N).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PoolChange {
    #[default]
    Keep,
    /// Back to the cycle's initial size.
    Initial,
    Add(u32),
    Set(u32),
}

impl fmt::Display for PoolChange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PoolChange::Keep => f.write_str("keep"),
            PoolChange::Initial => f.write_str("initial"),
            PoolChange::Add(n) => write!(f, "+{n}"),
            PoolChange::Set(n) => write!(f, "{n}"),
        }
    }
}

impl FromStr for PoolChange {
    type Err = String;

    fn from_str(s: &str) -> Result<PoolChange, String> {
        let s = s.trim();
        let count = |n: &str| {
            n.parse::<u32>()
                .map_err(|_| format!("expected keep, initial, +N or N, got `{s}`"))
        };
        match s {
            "keep" => Ok(PoolChange::Keep),
            "initial" => Ok(PoolChange::Initial),
            _ => match s.strip_prefix('+') {
                Some(n) => count(n).map(PoolChange::Add),
                None => count(s).map(PoolChange::Set),
            },
        }
    }
}

impl Serialize for PoolChange {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for PoolChange {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Text(String),
            Count(u32),
        }
        match Raw::deserialize(deserializer)? {
            Raw::Text(text) => text.parse().map_err(serde::de::Error::custom),
            Raw::Count(n) => Ok(PoolChange::Set(n)),
        }
    }
}

/// One phase of the cycle.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PhaseSpec {
    /// Upper-case by convention (`PREFILL_STRESS`); unique within the cycle.
    pub name: String,
    pub duration_s: f64,
    /// The mix from the phase's start (weights adding up to 100); `None` keeps the last one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mix: Option<Mix>,
    /// The total request rate from the phase's start; `None` keeps the last one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_rps: Option<f64>,
    /// Ramp the rate linearly to this over the phase (COOLDOWN's "ramp down to 0").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ramp_to_rps: Option<f64>,
    #[serde(default)]
    pub prefill: PoolChange,
    #[serde(default)]
    pub decode: PoolChange,
    /// What the phase shows, for the dashboard.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

impl PhaseSpec {
    pub fn duration(&self) -> Nanos {
        Nanos::from_secs_f64(self.duration_s)
    }

    fn change(&self, pool: PoolKind) -> PoolChange {
        match pool {
            PoolKind::Prefill => self.prefill,
            PoolKind::Decode => self.decode,
        }
    }
}

/// A whole cycle.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScenarioConfig {
    /// The total request rate when a phase does not set one.
    pub rate_rps: f64,
    /// The pools' sizes that `initial` restores (the seed's "initial P:D ratio").
    pub initial: PoolSizes,
    /// The largest sizes `+N` goes to (the autoscaler's `max_replicas`).
    pub max: PoolSizes,
    /// The phase the cycle returns to after the last one (default: the first).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loop_to: Option<String>,
    #[serde(rename = "phase")]
    pub phases: Vec<PhaseSpec>,
}

/// Why a cycle or a start was refused; each names the field at fault.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ScenarioError {
    #[error("scenario file: {0}")]
    Toml(String),
    #[error("phase: a scenario needs 1 to {MAX_PHASES} phases, got {0}")]
    PhaseCount(usize),
    #[error("phase.name: phase {index} has an empty name")]
    EmptyName { index: usize },
    #[error("phase.name: `{IDLE_PHASE}` names manual mode; call the phase something else")]
    ReservedName,
    #[error("phase.name: `{0}` is used by two phases")]
    DuplicateName(String),
    #[error(
        "phase.duration_s: phase {name} must last more than 0 and at most {MAX_PHASE_S} s, got {value}"
    )]
    Duration { name: String, value: f64 },
    #[error("phase.mix: the mix of phase {name} must add up to 100, got {total}")]
    MixTotal { name: String, total: u32 },
    #[error("{field}: must be between 0 and {MAX_SCENARIO_RATE} requests per second, got {value}")]
    Rate { field: String, value: f64 },
    #[error("{field}: must be at most {MAX_POOL_SIZE}, got {value}")]
    PoolSize { field: String, value: u32 },
    #[error("initial: the {pool} pool's initial size {initial} is over its max {max}")]
    InitialOverMax {
        pool: PoolKind,
        initial: u32,
        max: u32,
    },
    #[error("initial.decode: the decode pool needs at least one worker")]
    NoDecode,
    #[error("{field}: unknown phase `{name}` (phases: {known})")]
    UnknownPhase {
        field: String,
        name: String,
        known: String,
    },
}

impl ScenarioConfig {
    /// Seed 004's cycle (`scenarios/seed004.toml`).
    pub fn seed004() -> ScenarioConfig {
        ScenarioConfig::from_toml(SEED004_TOML).expect("the built-in scenario is valid")
    }

    /// Parses and validates a cycle written in TOML.
    pub fn from_toml(text: &str) -> Result<ScenarioConfig, ScenarioError> {
        let config: ScenarioConfig =
            toml::from_str(text).map_err(|e| ScenarioError::Toml(e.to_string()))?;
        config.validate()?;
        Ok(config)
    }

    pub fn validate(&self) -> Result<(), ScenarioError> {
        if self.phases.is_empty() || self.phases.len() > MAX_PHASES {
            return Err(ScenarioError::PhaseCount(self.phases.len()));
        }
        check_rate("rate_rps", self.rate_rps)?;
        for pool in PoolKind::ALL {
            for (field, sizes) in [("initial", self.initial), ("max", self.max)] {
                if sizes.get(pool) > MAX_POOL_SIZE {
                    return Err(ScenarioError::PoolSize {
                        field: format!("{field}.{pool}"),
                        value: sizes.get(pool),
                    });
                }
            }
            if self.initial.get(pool) > self.max.get(pool) {
                return Err(ScenarioError::InitialOverMax {
                    pool,
                    initial: self.initial.get(pool),
                    max: self.max.get(pool),
                });
            }
        }
        if self.initial.decode == 0 {
            return Err(ScenarioError::NoDecode);
        }
        for (index, phase) in self.phases.iter().enumerate() {
            if phase.name.trim().is_empty() {
                return Err(ScenarioError::EmptyName { index });
            }
            if phase.name == IDLE_PHASE {
                return Err(ScenarioError::ReservedName);
            }
            if self.phases[..index].iter().any(|p| p.name == phase.name) {
                return Err(ScenarioError::DuplicateName(phase.name.clone()));
            }
            if !(phase.duration_s > 0.0 && phase.duration_s <= MAX_PHASE_S) {
                return Err(ScenarioError::Duration {
                    name: phase.name.clone(),
                    value: phase.duration_s,
                });
            }
            if let Some(mix) = phase.mix
                && mix.total() != 100
            {
                return Err(ScenarioError::MixTotal {
                    name: phase.name.clone(),
                    total: mix.total(),
                });
            }
            if let Some(rate) = phase.rate_rps {
                check_rate(&format!("phase.rate_rps ({})", phase.name), rate)?;
            }
            if let Some(rate) = phase.ramp_to_rps {
                check_rate(&format!("phase.ramp_to_rps ({})", phase.name), rate)?;
            }
            for pool in PoolKind::ALL {
                if let PoolChange::Set(n) | PoolChange::Add(n) = phase.change(pool)
                    && n > MAX_POOL_SIZE
                {
                    return Err(ScenarioError::PoolSize {
                        field: format!("phase.{pool} ({})", phase.name),
                        value: n,
                    });
                }
            }
            if phase.change(PoolKind::Decode) == PoolChange::Set(0) {
                return Err(ScenarioError::NoDecode);
            }
        }
        if let Some(name) = &self.loop_to {
            self.phase_index("loop_to", name)?;
        }
        Ok(())
    }

    /// The index of the phase called `name` (`field` names where the name came from, for the
    /// error).
    pub fn phase_index(&self, field: &str, name: &str) -> Result<usize, ScenarioError> {
        self.phases
            .iter()
            .position(|p| p.name == name)
            .ok_or_else(|| ScenarioError::UnknownPhase {
                field: field.to_owned(),
                name: name.to_owned(),
                known: self
                    .phases
                    .iter()
                    .map(|p| p.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
            })
    }

    /// One pass through every phase, in seconds.
    pub fn cycle_s(&self) -> f64 {
        self.phases.iter().map(|p| p.duration_s).sum()
    }
}

fn check_rate(field: &str, value: f64) -> Result<(), ScenarioError> {
    if value.is_finite() && (0.0..=MAX_SCENARIO_RATE).contains(&value) {
        Ok(())
    } else {
        Err(ScenarioError::Rate {
            field: field.to_owned(),
            value,
        })
    }
}

/// What the driver must do, in order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "action", rename_all = "snake_case")]
pub enum ScenarioAction {
    /// A phase began (`cycle` counts from 0).
    EnterPhase {
        index: usize,
        name: String,
        cycle: u64,
    },
    SetMix(Mix),
    SetRate(f64),
    /// Resize `pool` to `to` workers.
    Scale {
        pool: PoolKind,
        to: u32,
    },
}

/// Where the controller is, for `/api/status`, the WebSocket and the simulator's report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScenarioStatus {
    /// The phase's name, or `IDLE` when not running.
    pub phase: String,
    pub index: Option<usize>,
    pub cycle: u64,
    /// Seconds left in the phase.
    pub time_left_s: f64,
    pub phase_duration_s: f64,
    pub mix: Option<Mix>,
    pub rate_rps: Option<f64>,
    /// The pool sizes the controller last asked for.
    pub pools: Option<PoolSizes>,
    pub note: Option<String>,
}

#[derive(Debug, Clone)]
struct Running {
    index: usize,
    cycle: u64,
    entered_at: Nanos,
    ends_at: Nanos,
    rate: f64,
    mix: Option<Mix>,
    /// The rate at the phase's start, while a ramp runs.
    ramp_from: Option<f64>,
    next_ramp_step: Option<Nanos>,
    pools: PoolSizes,
}

/// Walks a [`ScenarioConfig`].
#[derive(Debug, Clone)]
pub struct ScenarioController {
    config: ScenarioConfig,
    loop_to: usize,
    running: Option<Running>,
}

impl ScenarioController {
    pub fn new(config: ScenarioConfig) -> Result<ScenarioController, ScenarioError> {
        config.validate()?;
        let loop_to = match &config.loop_to {
            Some(name) => config.phase_index("loop_to", name)?,
            None => 0,
        };
        Ok(ScenarioController {
            config,
            loop_to,
            running: None,
        })
    }

    pub fn config(&self) -> &ScenarioConfig {
        &self.config
    }

    pub fn is_running(&self) -> bool {
        self.running.is_some()
    }

    /// Starts the cycle at `now`, at its first phase or at the phase called `from` (an
    /// unknown name is refused, naming `phase`). Restarting a running controller starts over.
    pub fn start(
        &mut self,
        now: Nanos,
        from: Option<&str>,
    ) -> Result<Vec<ScenarioAction>, ScenarioError> {
        let index = match from {
            Some(name) => self.config.phase_index("phase", name)?,
            None => 0,
        };
        let mut actions = Vec::new();
        self.running = Some(Running {
            index,
            cycle: 0,
            entered_at: now,
            ends_at: now,
            rate: self.config.rate_rps,
            mix: None,
            ramp_from: None,
            next_ramp_step: None,
            pools: self.config.initial,
        });
        // The first phase always sets the rate, the mix if it has one, and both pools, so the
        // fleet starts from what the cycle expects whatever it was before.
        self.enter(index, now, &mut actions);
        if self.config.phases[index].rate_rps.is_none() {
            actions.push(ScenarioAction::SetRate(self.config.rate_rps));
        }
        let pools = self.running.as_ref().map(|r| r.pools);
        if let Some(pools) = pools {
            for pool in PoolKind::ALL {
                if !actions
                    .iter()
                    .any(|a| matches!(a, ScenarioAction::Scale { pool: p, .. } if *p == pool))
                {
                    actions.push(ScenarioAction::Scale {
                        pool,
                        to: pools.get(pool),
                    });
                }
            }
        }
        Ok(actions)
    }

    /// Back to IDLE. The driver keeps the fleet and the workload as they are (the load
    /// generator stops its workload itself).
    pub fn stop(&mut self) {
        self.running = None;
    }

    /// When [`ScenarioController::handle_timeout`] has something to do: the phase's end or the
    /// next ramp step; `None` when idle.
    pub fn poll_timeout(&self) -> Option<Nanos> {
        let running = self.running.as_ref()?;
        Some(match running.next_ramp_step {
            Some(step) => step.min(running.ends_at),
            None => running.ends_at,
        })
    }

    /// Advances to `now`: ramp steps and phase changes that are due, in order.
    pub fn handle_timeout(&mut self, now: Nanos) -> Vec<ScenarioAction> {
        let mut actions = Vec::new();
        // Bounded: at most one pass through the cycle per call, whatever `now` is.
        for _ in 0..=self.config.phases.len() {
            let Some(running) = self.running.as_mut() else {
                break;
            };
            if now >= running.ends_at {
                // Finish the ramp exactly at its target.
                if running.ramp_from.is_some()
                    && let Some(target) = self.config.phases[running.index].ramp_to_rps
                {
                    running.rate = target;
                    actions.push(ScenarioAction::SetRate(target));
                }
                let ended_at = running.ends_at;
                let next = running.index + 1;
                let index = if next == self.config.phases.len() {
                    running.cycle += 1;
                    self.loop_to
                } else {
                    next
                };
                self.enter(index, ended_at, &mut actions);
                continue;
            }
            if let Some(step) = running.next_ramp_step
                && now >= step
            {
                let phase = &self.config.phases[running.index];
                if let (Some(from), Some(to)) = (running.ramp_from, phase.ramp_to_rps) {
                    let span = running.ends_at.saturating_sub(running.entered_at);
                    let done = now.saturating_sub(running.entered_at).as_secs_f64()
                        / span.as_secs_f64().max(f64::MIN_POSITIVE);
                    running.rate = from + (to - from) * done.clamp(0.0, 1.0);
                    actions.push(ScenarioAction::SetRate(running.rate));
                }
                running.next_ramp_step = Some(now.saturating_add(RAMP_STEP));
            }
            break;
        }
        actions
    }

    fn enter(&mut self, index: usize, now: Nanos, actions: &mut Vec<ScenarioAction>) {
        let phase = &self.config.phases[index];
        let Some(running) = self.running.as_mut() else {
            return;
        };
        running.index = index;
        running.entered_at = now;
        running.ends_at = now.saturating_add(phase.duration());
        actions.push(ScenarioAction::EnterPhase {
            index,
            name: phase.name.clone(),
            cycle: running.cycle,
        });
        if let Some(mix) = phase.mix {
            running.mix = Some(mix);
            actions.push(ScenarioAction::SetMix(mix));
        }
        if let Some(rate) = phase.rate_rps {
            running.rate = rate;
            actions.push(ScenarioAction::SetRate(rate));
        }
        running.ramp_from = phase.ramp_to_rps.map(|_| running.rate);
        running.next_ramp_step = phase
            .ramp_to_rps
            .map(|_| now.saturating_add(RAMP_STEP).min(running.ends_at));
        for pool in PoolKind::ALL {
            let current = running.pools.get(pool);
            let max = self.config.max.get(pool);
            let to = match phase.change(pool) {
                PoolChange::Keep => continue,
                PoolChange::Initial => self.config.initial.get(pool),
                PoolChange::Add(n) => current.saturating_add(n).min(max.max(current)),
                PoolChange::Set(n) => n,
            };
            running.pools.set(pool, to);
            actions.push(ScenarioAction::Scale { pool, to });
        }
    }

    /// The controller's state at `now`.
    pub fn status(&self, now: Nanos) -> ScenarioStatus {
        match &self.running {
            None => ScenarioStatus {
                phase: IDLE_PHASE.to_owned(),
                index: None,
                cycle: 0,
                time_left_s: 0.0,
                phase_duration_s: 0.0,
                mix: None,
                rate_rps: None,
                pools: None,
                note: None,
            },
            Some(running) => {
                let phase = &self.config.phases[running.index];
                ScenarioStatus {
                    phase: phase.name.clone(),
                    index: Some(running.index),
                    cycle: running.cycle,
                    time_left_s: running.ends_at.saturating_sub(now).as_secs_f64(),
                    phase_duration_s: phase.duration_s,
                    mix: running.mix,
                    rate_rps: Some(running.rate),
                    pools: Some(running.pools),
                    note: phase.note.clone(),
                }
            }
        }
    }
}
