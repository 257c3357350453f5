//! The seed's chat workload (`workload::ChatWorkload`) as the simulator's [`Workload`].

use std::sync::Arc;

use nanotime::Nanos;
use workload::{Assets, ChatWorkload, Class, WorkloadConfig, WorkloadError};

use crate::bench::{BenchJob, BenchSpec, JobResult, run_job};
use crate::driver::{SimError, derive_seed, streams};
use crate::workload::{ServingPath, Turn, TurnKey, Workload};

/// [`ChatWorkload`] driven by the simulator.
#[derive(Debug)]
pub struct Chat(pub ChatWorkload);

impl Chat {
    /// The chat workload of a run seeded `run_seed`, starting `concurrency` conversations
    /// at time zero.
    pub fn new(
        config: &WorkloadConfig,
        assets: Arc<Assets>,
        run_seed: u64,
        concurrency: u32,
    ) -> Result<Self, WorkloadError> {
        let mut config = config.clone();
        config.concurrency = concurrency;
        let seed = derive_seed(run_seed, streams::WORKLOAD);
        ChatWorkload::new(config, assets, seed, Nanos::ZERO).map(Chat)
    }
}

impl Chat {
    /// The workload (A, B or C) of conversation `conversation` (a request record's): drawn
    /// from the run's mix, which does not change during a run.
    pub fn class_of(&self, conversation: u64) -> Class {
        self.0.class_of(conversation)
    }
}

impl Workload for Chat {
    fn poll_timeout(&self) -> Option<Nanos> {
        self.0.poll_timeout()
    }

    fn handle_timeout(&mut self, now: Nanos) {
        self.0.handle_timeout(now);
    }

    fn poll_request(&mut self) -> Option<Turn> {
        self.0.poll_request()
    }

    fn on_turn_finished(&mut self, key: TurnKey, now: Nanos) {
        self.0.on_turn_finished(key, now);
    }

    fn on_turn_failed(&mut self, key: TurnKey, now: Nanos) {
        self.0.on_turn_failed(key, now);
    }

    fn set_concurrency(&mut self, n: u32, now: Nanos) {
        self.0.set_concurrency(n, now);
    }

    fn active_conversations(&self) -> u32 {
        self.0.active_conversations()
    }
}

/// Why a chat benchmark job failed.
#[derive(Debug, thiserror::Error)]
pub enum ChatJobError {
    #[error("workload: {0}")]
    Workload(#[from] WorkloadError),
    #[error(transparent)]
    Sim(#[from] SimError),
}

/// Runs one benchmark job on the seed's chat workload.
pub fn run_chat_job(
    spec: &BenchSpec,
    job: &BenchJob,
    config: &WorkloadConfig,
    assets: Arc<Assets>,
    progress: impl FnMut(usize),
) -> Result<JobResult, ChatJobError> {
    let first = job.levels.first().copied().unwrap_or(0);
    let workload = Chat::new(config, assets, job.seed, first)?;
    let workload = ServingPath::new(workload, spec.base.path_latency);
    Ok(run_job(spec, job, workload, progress)?)
}
