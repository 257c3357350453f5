//! The engine task: one tokio task owns the [`Engine`] and runs it in real time.
//!
//! It sleeps until the running step's modelled end (divided by the speedup), completes it,
//! and reports each request's progress on the request's `watch` channel. When the task falls
//! behind (a busy runtime, a huge speedup), it completes every step that has already ended
//! without sleeping, yielding to the runtime every few steps; it never spins while idle.
//! Submissions and cancellations arrive on a bounded mpsc. A request whose every progress
//! receiver is gone (the HTTP client disconnected) is cancelled at its next step.
//!
//! Progress is a `watch` (a channel bounded to its latest value): the engine never waits for a
//! slow client, and a client that reads late sees every token produced so far at once.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use engine::{Engine, EngineEvent, EngineMetrics, EngineRequest, RejectReason, RequestId};
use kv_index::KvEvent;
use nanotime::Nanos;
use rustc_hash::FxHashMap;
use tokio::sync::{mpsc, watch};

use crate::metrics::ServerMetrics;

/// Maps wall time to the engine's modelled time: `model = elapsed × speedup`.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    epoch: Instant,
    speedup: f64,
}

impl Clock {
    pub fn new(speedup: f64) -> Clock {
        Clock {
            epoch: Instant::now(),
            speedup,
        }
    }

    /// Modelled time now.
    pub fn now(&self) -> Nanos {
        let elapsed = self.epoch.elapsed().as_nanos() as f64;
        Nanos((elapsed * self.speedup) as u64)
    }

    /// The wall instant at which modelled time reaches `at`.
    pub fn wall(&self, at: Nanos) -> Instant {
        let wall_ns = at.0 as f64 / self.speedup;
        // Far-future deadlines saturate rather than overflow `Instant`.
        let wall_ns = wall_ns.min(1e18) as u64;
        self.epoch + Duration::from_nanos(wall_ns)
    }

    /// A modelled duration in seconds.
    pub fn model_secs(d: Nanos) -> f64 {
        d.0 as f64 / 1e9
    }
}

/// Where a request stands.
#[derive(Debug, Clone, PartialEq)]
pub enum RequestState {
    /// Sent to the engine task, not yet seen by it.
    Submitted,
    /// In the engine (waiting or running).
    Accepted,
    Rejected(RejectReason),
    Finished(FinishInfo),
    /// Cancelled (client gone, or the server shut down).
    Cancelled,
}

/// Token counts of a finished request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FinishInfo {
    pub prompt_tokens: u32,
    pub cached_prompt_tokens: u32,
    pub output_tokens: u32,
}

/// A request's progress, the value of its `watch` channel.
#[derive(Debug, Clone, PartialEq)]
pub struct Progress {
    pub state: RequestState,
    /// Output tokens produced so far.
    pub produced: u32,
}

impl Progress {
    pub fn new() -> Progress {
        Progress {
            state: RequestState::Submitted,
            produced: 0,
        }
    }
}

impl Default for Progress {
    fn default() -> Self {
        Self::new()
    }
}

/// A request for the engine task.
pub struct Submission {
    pub request: EngineRequest,
    pub progress: watch::Sender<Progress>,
}

pub enum Command {
    Submit(Box<Submission>),
    Cancel(RequestId),
}

/// The latest engine state, for `/metrics` and `/health`.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    pub metrics: EngineMetrics,
    /// Modelled time of the snapshot.
    pub at: Nanos,
}

struct Active {
    progress: watch::Sender<Progress>,
    submitted_at: Nanos,
}

/// The engine task's connections to the rest of the server.
pub struct Links {
    /// Submissions and cancellations from the HTTP handlers.
    pub commands: mpsc::Receiver<Command>,
    pub shutdown: watch::Receiver<bool>,
    /// KV event batches for the publishers (dropped, and counted, when they fall behind).
    pub kv_out: mpsc::Sender<Vec<KvEvent>>,
    pub metrics: Arc<ServerMetrics>,
    /// The latest engine state, for `/metrics` and `/health`.
    pub snapshot: Arc<Mutex<Snapshot>>,
}

pub struct Driver {
    engine: Engine,
    clock: Clock,
    links: Links,
    active: FxHashMap<RequestId, Active>,
    /// Requests not yet admitted, in submission order (the engine admits first-come
    /// first-served, so the admitted ones are a prefix).
    unscheduled: std::collections::VecDeque<RequestId>,
    /// Requests that left the engine during the current drain; forgotten after it, once
    /// their queue time is recorded.
    leaving: Vec<RequestId>,
    kv_batch: Vec<KvEvent>,
    now: Nanos,
}

/// Steps completed back to back before yielding to the runtime when catching up.
const STEPS_PER_YIELD: u32 = 64;

impl Driver {
    pub fn new(engine: Engine, clock: Clock, links: Links) -> Driver {
        Driver {
            engine,
            clock,
            links,
            active: FxHashMap::default(),
            unscheduled: std::collections::VecDeque::new(),
            leaving: Vec::new(),
            kv_batch: Vec::new(),
            now: Nanos::ZERO,
        }
    }

    /// Runs until shutdown is signalled (or every command sender is gone), then cancels what
    /// is still in flight.
    pub async fn run(mut self) {
        self.publish_snapshot();
        loop {
            // Complete every step that has ended by now, without sleeping.
            let mut completed = 0;
            while let Some(end) = self.engine.poll_timeout() {
                let now = self.clock.now();
                if end > now {
                    break;
                }
                self.now = self.now.max(end);
                self.engine.handle_timeout(end);
                self.after_engine_call();
                completed += 1;
                if completed % STEPS_PER_YIELD == 0 {
                    tokio::task::yield_now().await;
                    self.drain_commands();
                }
            }
            let deadline = self.engine.poll_timeout().map(|t| self.clock.wall(t));
            tokio::select! {
                biased;
                changed = self.links.shutdown.changed() => {
                    if changed.is_err() || *self.links.shutdown.borrow() {
                        break;
                    }
                }
                command = self.links.commands.recv() => match command {
                    Some(command) => {
                        self.handle(command);
                        self.drain_commands();
                    }
                    None => break,
                },
                _ = sleep_until(deadline) => {}
            }
        }
        self.abort_all();
    }

    fn drain_commands(&mut self) {
        while let Ok(command) = self.links.commands.try_recv() {
            self.handle(command);
        }
    }

    fn engine_now(&mut self) -> Nanos {
        self.now = self.now.max(self.clock.now());
        self.now
    }

    fn handle(&mut self, command: Command) {
        match command {
            Command::Submit(submission) => {
                let Submission { request, progress } = *submission;
                let id = request.id;
                let now = self.engine_now();
                self.active.insert(
                    id,
                    Active {
                        progress,
                        submitted_at: now,
                    },
                );
                self.unscheduled.push_back(id);
                self.engine.submit(request, now);
                self.after_engine_call();
                // Still active: not rejected (a rejection was drained above).
                if let Some(active) = self.active.get(&id) {
                    active.progress.send_if_modified(|p| {
                        let first = p.state == RequestState::Submitted;
                        if first {
                            p.state = RequestState::Accepted;
                        }
                        first
                    });
                }
            }
            Command::Cancel(id) => {
                if self.active.contains_key(&id) {
                    let now = self.engine_now();
                    self.engine.cancel(id, now);
                    self.after_engine_call();
                }
            }
        }
    }

    /// Drains the engine's events, reports progress, publishes KV events, refreshes metrics.
    fn after_engine_call(&mut self) {
        let mut cancel = Vec::new();
        while let Some(event) = self.engine.poll_event() {
            match event {
                EngineEvent::FirstToken { id, at } => {
                    if let Some(active) = self.active.get(&id) {
                        self.links.metrics.observe_ttft(Clock::model_secs(
                            at.saturating_sub(active.submitted_at),
                        ));
                    }
                }
                EngineEvent::Tokens { id, end, .. } => {
                    if let Some(active) = self.active.get(&id) {
                        if active.progress.is_closed() {
                            cancel.push(id);
                        } else {
                            active
                                .progress
                                .send_modify(|p| p.produced = p.produced.max(end));
                        }
                    }
                }
                EngineEvent::Finished {
                    id,
                    at,
                    prompt_tokens,
                    cached_prompt_tokens,
                    output_tokens,
                    ..
                } => {
                    if let Some(active) = self.active.get(&id) {
                        self.links.metrics.observe_finished(
                            prompt_tokens,
                            output_tokens,
                            Clock::model_secs(at.saturating_sub(active.submitted_at)),
                        );
                    }
                    self.finish(
                        id,
                        RequestState::Finished(FinishInfo {
                            prompt_tokens,
                            cached_prompt_tokens,
                            output_tokens,
                        }),
                    );
                }
                EngineEvent::PrefillDone {
                    id,
                    prompt_tokens,
                    cached_prompt_tokens,
                    ..
                } => self.finish(
                    id,
                    RequestState::Finished(FinishInfo {
                        prompt_tokens,
                        cached_prompt_tokens,
                        output_tokens: 1,
                    }),
                ),
                EngineEvent::Cancelled { id, .. } => self.finish(id, RequestState::Cancelled),
                EngineEvent::Rejected { id, reason } => {
                    self.links.metrics.rejected.inc();
                    self.finish(id, RequestState::Rejected(reason));
                }
                EngineEvent::Kv(event) => self.kv_batch.push(event),
            }
        }
        self.note_admissions();
        if !self.kv_batch.is_empty() {
            let batch = std::mem::take(&mut self.kv_batch);
            if self.links.kv_out.try_send(batch).is_err() {
                self.links.metrics.kv_batches_dropped.inc();
            }
        }
        for id in std::mem::take(&mut self.leaving) {
            self.active.remove(&id);
        }
        self.publish_snapshot();
        for id in cancel {
            let now = self.engine_now();
            self.engine.cancel(id, now);
            // Recursion depth 1: a cancel only produces `Cancelled` and KV events.
            self.after_engine_call();
        }
    }

    fn finish(&mut self, id: RequestId, state: RequestState) {
        if let Some(active) = self.active.get(&id) {
            active.progress.send_modify(|p| p.state = state);
            self.leaving.push(id);
        }
    }

    /// Records queue time for requests the engine admitted since the last call.
    fn note_admissions(&mut self) {
        while let Some(&id) = self.unscheduled.front() {
            match self.engine.is_waiting(id) {
                Some(true) => break,
                Some(false) => {
                    if let Some(active) = self.active.get(&id) {
                        self.links.metrics.observe_queue_time(Clock::model_secs(
                            self.now.saturating_sub(active.submitted_at),
                        ));
                    }
                    self.unscheduled.pop_front();
                }
                // Left the engine (rejected, cancelled) before admission.
                None => {
                    self.unscheduled.pop_front();
                }
            }
        }
    }

    fn publish_snapshot(&mut self) {
        let metrics = self.engine.metrics();
        self.links.metrics.update_engine(&metrics);
        if let Ok(mut snapshot) = self.links.snapshot.lock() {
            snapshot.metrics = metrics;
            snapshot.at = self.now;
        }
    }

    fn abort_all(&mut self) {
        let ids: Vec<RequestId> = self.active.keys().copied().collect();
        let now = self.engine_now();
        for id in ids {
            self.engine.cancel(id, now);
        }
        self.after_engine_call();
        // Anything not yet reported (e.g. never reached the engine) is cancelled too.
        for active in self.active.values() {
            active
                .progress
                .send_modify(|p| p.state = RequestState::Cancelled);
        }
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline.into()).await,
        None => std::future::pending().await,
    }
}
