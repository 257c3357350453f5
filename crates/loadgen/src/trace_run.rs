//! A trace replayed under the dashboard (`kvroute loadgen --trace FILE` without `--headless`).
//!
//! Start and Stop (the header's buttons, `POST /api/workload/start|stop`) start and stop the
//! replay of `trace.rs` instead of the chat workload; `status.trace` is its progress (the Trace
//! panel). The requests also feed the first lane's window and totals, so the usual cards and
//! charts (TTFT, TPOT, ITL, TOPS, RPS, in flight, and the gateway's KV hit rate) show the
//! replay as they show the chat workload. A replay that ended keeps its final status until the
//! next Start replays the trace again from its beginning.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use serde::Serialize;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::client::{TurnError, TurnResult};
use crate::lane::{LaneState, lock, unix_ms};
use crate::server::STATUS_INTERVAL;
use crate::trace::{
    ReplayObserver, ReplayState, TraceReplayConfig, TraceReplayStatus, replay_trace,
};

/// The trace the dashboard replays.
#[derive(Debug, Clone)]
pub struct TraceSetup {
    pub replay: TraceReplayConfig,
    /// The file as the user named it.
    pub file: String,
    /// Requests in the file, before `--trace-limit`.
    pub requests_in_file: usize,
}

/// `status.trace` (docs/LOADGEN-API.md).
#[derive(Clone, Debug, Serialize)]
pub struct TraceStatus {
    pub file: String,
    pub requests_in_file: usize,
    pub max_open: usize,
    /// When the replay (last) started, Unix epoch milliseconds; `null` before any.
    pub started_at_ms: Option<u64>,
    #[serde(flatten)]
    pub replay: TraceReplayStatus,
}

struct Shared {
    status: TraceReplayStatus,
    started_at_ms: Option<u64>,
}

/// The replay task of the last Start: its stop signal and its end.
struct Run {
    cancel: CancellationToken,
    task: JoinHandle<()>,
}

/// Starts, stops and reports the dashboard's trace replay.
pub struct TraceHandle {
    setup: Arc<TraceSetup>,
    shared: Arc<Mutex<Shared>>,
    run: Mutex<Option<Run>>,
}

fn guard<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Poisoning only means a panic elsewhere; the state is still the best there is.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl TraceHandle {
    pub fn new(setup: TraceSetup) -> TraceHandle {
        let status = TraceReplayStatus::idle(&setup.replay);
        TraceHandle {
            setup: Arc::new(setup),
            shared: Arc::new(Mutex::new(Shared {
                status,
                started_at_ms: None,
            })),
            run: Mutex::new(None),
        }
    }

    pub fn status(&self) -> TraceStatus {
        let shared = guard(&self.shared);
        TraceStatus {
            file: self.setup.file.clone(),
            requests_in_file: self.setup.requests_in_file,
            max_open: self.setup.replay.max_open,
            started_at_ms: shared.started_at_ms,
            replay: shared.status.clone(),
        }
    }

    pub fn is_running(&self) -> bool {
        guard(&self.shared).status.state == ReplayState::Running
    }

    /// Replays the trace from its beginning, feeding `lane`'s window and totals; refused while
    /// a replay runs.
    pub fn start(&self, lane: Arc<Mutex<LaneState>>) -> Result<(), String> {
        let mut run = guard(&self.run);
        if self.is_running() {
            return Err("the trace replay is already running".to_owned());
        }
        let epoch = Instant::now();
        lock(&lane).begin_run(epoch);
        {
            let mut shared = guard(&self.shared);
            shared.status = TraceReplayStatus {
                state: ReplayState::Running,
                ..TraceReplayStatus::idle(&self.setup.replay)
            };
            shared.started_at_ms = Some(unix_ms());
        }
        let cancel = CancellationToken::new();
        let mut feed = Feed {
            shared: self.shared.clone(),
            lane,
        };
        let config = self.setup.replay.clone();
        let stop = cancel.clone();
        let task = tokio::spawn(async move {
            // The last progress call carries the final status (`Feed::progress`).
            replay_trace(config, stop, STATUS_INTERVAL, &mut feed).await;
        });
        *run = Some(Run { cancel, task });
        Ok(())
    }

    /// Stops the running replay (its requests in flight are cancelled, not counted as
    /// failures) and returns once its final status is in: `false` when none was running.
    pub async fn stop(&self) -> Result<bool, String> {
        if !self.is_running() {
            return Ok(false);
        }
        let run = guard(&self.run).take();
        if let Some(run) = run {
            run.cancel.cancel();
            if let Err(e) = run.task.await {
                return Err(format!("the trace replay ended abnormally: {e}"));
            }
        }
        Ok(true)
    }
}

/// What the replay tells the dashboard: the panel's status and the lane's figures.
struct Feed {
    shared: Arc<Mutex<Shared>>,
    lane: Arc<Mutex<LaneState>>,
}

impl ReplayObserver for Feed {
    fn progress(&mut self, status: &TraceReplayStatus) {
        if status.state != ReplayState::Running {
            // The lane stops first, so no status shows it running past the replay's end.
            let mut s = lock(&self.lane);
            s.running = false;
            s.in_flight = 0;
        }
        guard(&self.shared).status = status.clone();
    }

    fn sent(&mut self) {
        lock(&self.lane).in_flight += 1;
    }

    fn ended(&mut self, turn: u32, result: &Result<TurnResult, TurnError>) {
        let mut s = lock(&self.lane);
        s.in_flight = s.in_flight.saturating_sub(1);
        match result {
            Ok(r) => {
                let at_s = s.now_s();
                s.record_finished(r, turn == 0, at_s);
            }
            Err(_) => s.totals.errors += 1,
        }
    }
}
