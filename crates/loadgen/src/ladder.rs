//! Seed 003's phase ladder switched live: baseline (round-robin) → KV routing → draft-model
//! speculative decoding → EAGLE-3, on a cluster the load generator is allowed to restart
//! (`kvroute demo`'s simulated one), from the dashboard or `POST /api/phase`.
//!
//! A switch runs under the control lock (no start, stop or config in between): the running
//! lanes stop (their requests in flight are cancelled, so none hangs on a worker that goes
//! away and none counts as an error), the [`PhaseLadder`] restarts the cluster at the new
//! phase (new workers with cold caches, the gateway's router), and the lanes start again on the
//! same target with fresh metrics windows, so the cards show only the new phase. The charts'
//! history is kept: the ladder's steps stay visible, with a marker per switch.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};

use futures::future::BoxFuture;
use serde::Serialize;

use crate::lane::unix_ms;

/// Switches kept for the status (chart markers), newest last.
pub const MAX_SWITCHES: usize = 20;

/// What a phase runs: the gateway's router and the workers' speculative decoding.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PhaseSetup {
    pub name: String,
    pub router: String,
    /// `off`, or the profile's configuration (`draft`, `eagle3`).
    pub spec_decode: String,
}

/// A cluster the load generator may restart at another phase of the ladder.
pub trait PhaseLadder: Send + Sync + 'static {
    /// The ladder's phases, in order.
    fn phases(&self) -> Vec<PhaseSetup>;

    /// The running workers' (name, metrics URL).
    fn workers(&self) -> Vec<(String, String)>;

    /// Restarts the cluster at `phase` (one of [`PhaseLadder::phases`]) on the same target
    /// URL. `Err`: no cluster runs any more.
    fn switch(&self, phase: &str) -> BoxFuture<'_, Result<Switched, String>>;
}

/// What runs after a switch.
#[derive(Clone, Debug, PartialEq)]
pub struct Switched {
    /// The phase running: the one asked for, or the previous one when that could not start.
    pub phase: String,
    /// The workers' (name, metrics URL), for the GPU view and the speculative counters.
    pub workers: Vec<(String, String)>,
    /// Why the phase asked for is not the one running.
    pub error: Option<String>,
}

/// The ladder and the phase it runs, given to the load generator (`LoadgenConfig::ladder`).
#[derive(Clone)]
pub struct LadderConfig {
    pub ladder: Arc<dyn PhaseLadder>,
    /// The phase the cluster was started at.
    pub initial: String,
}

impl std::fmt::Debug for LadderConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LadderConfig")
            .field("phases", &self.ladder.phases())
            .field("initial", &self.initial)
            .finish()
    }
}

/// A phase switch, for the charts' markers.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PhaseSwitch {
    pub at_ms: u64,
    pub phase: String,
}

/// A worker of the running phase.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct WorkerEndpoint {
    pub name: String,
    pub metrics_url: String,
}

/// `status.ladder`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LadderState {
    /// The phase the cluster runs (the last one started; the last one asked for when a failed
    /// switch left no cluster: `error` says so).
    pub phase: String,
    pub router: String,
    pub spec_decode: String,
    pub phases: Vec<PhaseSetup>,
    /// The phase being switched to, while a switch runs.
    pub switching: Option<String>,
    /// The running workers' Prometheus endpoints (they change with every switch).
    pub workers: Vec<WorkerEndpoint>,
    /// Completed switches, newest last (at most [`MAX_SWITCHES`]).
    pub switches: Vec<PhaseSwitch>,
    /// Why the last switch failed, until the next one succeeds.
    pub error: Option<String>,
}

struct Shared {
    phase: String,
    switching: Option<String>,
    switches: VecDeque<PhaseSwitch>,
    error: Option<String>,
}

/// The ladder as the App holds it.
pub struct LadderHandle {
    ladder: Arc<dyn PhaseLadder>,
    phases: Vec<PhaseSetup>,
    shared: Mutex<Shared>,
}

impl LadderHandle {
    /// Checks that the initial phase is one of the ladder's.
    pub fn new(config: LadderConfig) -> Result<LadderHandle, String> {
        let phases = config.ladder.phases();
        let handle = LadderHandle {
            ladder: config.ladder,
            phases,
            shared: Mutex::new(Shared {
                phase: config.initial.clone(),
                switching: None,
                switches: VecDeque::new(),
                error: None,
            }),
        };
        handle.check(&config.initial)?;
        Ok(handle)
    }

    fn lock(&self) -> MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The phase's setup, or an error listing the ladder's phases.
    pub fn check(&self, phase: &str) -> Result<&PhaseSetup, String> {
        self.phases.iter().find(|p| p.name == phase).ok_or_else(|| {
            format!(
                "phase: unknown phase {phase:?}; the ladder's phases are {}",
                self.names().join(", ")
            )
        })
    }

    pub fn names(&self) -> Vec<&str> {
        self.phases.iter().map(|p| p.name.as_str()).collect()
    }

    pub fn state(&self) -> LadderState {
        let shared = self.lock();
        let setup = self.phases.iter().find(|p| p.name == shared.phase);
        LadderState {
            phase: shared.phase.clone(),
            router: setup.map(|s| s.router.clone()).unwrap_or_default(),
            spec_decode: setup.map(|s| s.spec_decode.clone()).unwrap_or_default(),
            phases: self.phases.clone(),
            switching: shared.switching.clone(),
            workers: self
                .ladder
                .workers()
                .into_iter()
                .map(|(name, metrics_url)| WorkerEndpoint { name, metrics_url })
                .collect(),
            switches: shared.switches.iter().cloned().collect(),
            error: shared.error.clone(),
        }
    }

    /// Marks a switch to `phase` under way (the status shows it).
    pub(crate) fn begin(&self, phase: &str) {
        self.lock().switching = Some(phase.to_owned());
    }

    /// Restarts the cluster at `phase` and records the outcome: `Ok` with the workers when
    /// `phase` runs, `Err` with the reason otherwise (the workers of the phase that runs
    /// instead, if one does).
    pub(crate) async fn switch(
        &self,
        phase: &str,
    ) -> Result<Vec<(String, String)>, (String, Option<Vec<(String, String)>>)> {
        let result = self.ladder.switch(phase).await;
        let mut shared = self.lock();
        shared.switching = None;
        match result {
            Ok(switched) => {
                if switched.phase != shared.phase || switched.error.is_none() {
                    if shared.switches.len() == MAX_SWITCHES {
                        shared.switches.pop_front();
                    }
                    shared.switches.push_back(PhaseSwitch {
                        at_ms: unix_ms(),
                        phase: switched.phase.clone(),
                    });
                }
                shared.phase = switched.phase;
                shared.error = switched.error.map(|e| format!("switching to {phase}: {e}"));
                match &shared.error {
                    None => Ok(switched.workers),
                    Some(e) => Err((e.clone(), Some(switched.workers))),
                }
            }
            Err(e) => {
                let e = format!("switching to {phase}: {e}");
                shared.error = Some(e.clone());
                Err((e, None))
            }
        }
    }
}
