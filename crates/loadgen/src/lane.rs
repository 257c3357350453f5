//! A lane: one target endpoint driven by the seed's chat workload in real time.
//!
//! One task owns the sans-IO [`workload::ChatWorkload`] in its text form and a clock; it turns
//! the workload's turns into streamed chat requests (one task each) and feeds their ends back.
//! The system message, the questions and the planned answer lengths are the workload's, so
//! conversation *k* of a seed is the one `kvroute sim` simulates; the history sent is the
//! answers the target actually gave. Everything the API shows (window, counters,
//! conversations) lives in [`LaneState`] behind a mutex that the lane task and the HTTP
//! handlers share; it is held for bookkeeping only, never across I/O.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use nanotime::Nanos;
use serde::Serialize;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use workload::{Assets, ChatWorkload, Class, Mix, TextContent, TextTurn, TurnKey, WorkloadConfig};

use crate::client::{self, TurnError, TurnResult};
use crate::scrape::{GatewayHistory, SpecHistory, WorkersView};
use crate::store::{ConversationRecord, ConversationStatus, Store, TurnRecord, TurnState};
use crate::window::{TurnSample, Window};

/// Where a lane sends its conversations and where it reads the serving side's metrics.
#[derive(Clone, Debug, PartialEq)]
pub struct LaneSpec {
    /// The lane's label (the router's name in the demo).
    pub name: String,
    /// The router behind the target, when known.
    pub router: Option<String>,
    /// Base URL of an OpenAI-compatible endpoint (`http://127.0.0.1:8000`, no `/v1`).
    pub target: String,
    pub model: String,
    pub api_key: Option<String>,
    /// The gateway's Prometheus endpoint (KV hit rate, queued), e.g. `{target}/metrics`.
    pub gateway_metrics: Option<String>,
    /// Workers' Prometheus endpoints with DCGM-style GPU series, for the per-worker view.
    pub worker_metrics: Vec<String>,
    /// A Prometheus server (`http://host:9090`) that scrapes the gateway and the workers: when
    /// set, the KV hit rate, the queue and the GPU view come from its query API (seed 001's
    /// queries) instead of the endpoints above.
    pub prometheus: Option<String>,
}

/// Who writes the users' follow-up questions.
#[derive(Clone, Debug, PartialEq)]
pub enum UserSimulator {
    /// Built in: the workload's own questions (`workload::Script`), the ones `kvroute sim`
    /// tokenizes.
    Builtin,
    /// An OpenAI-compatible "user model" (seed 000's 8B model plays the user).
    Model {
        /// The chat completions URL (`…/v1/chat/completions`).
        url: String,
        model: String,
        api_key: Option<String>,
    },
}

/// Settings every lane shares.
#[derive(Clone, Debug)]
pub struct DriveConfig {
    pub workload: WorkloadConfig,
    pub seed: u64,
    pub user: UserSimulator,
    /// Ask for exactly the planned reply length (`max_tokens` + `ignore_eos`, as benchmark
    /// clients do), so every target serves the same token counts; off for natural replies.
    pub fixed_output_length: bool,
    pub request_timeout: Duration,
    pub window: Duration,
    /// Ended conversations kept for the UI.
    pub conversations_kept: usize,
    /// Reply text kept per turn (bytes).
    pub max_reply_text: usize,
    /// Model seconds per wall second: the engines' `--speedup`. The workload's clock runs this
    /// much faster (think times, ramp) and every measured duration is multiplied by it, so
    /// the figures are in the engines' modelled time and compare with `kvroute sim`.
    pub time_scale: f64,
}

impl Default for DriveConfig {
    fn default() -> Self {
        DriveConfig {
            workload: WorkloadConfig {
                concurrency: 60,
                ramp_s: 10.0,
                ..WorkloadConfig::default()
            },
            seed: 1,
            user: UserSimulator::Builtin,
            fixed_output_length: true,
            request_timeout: Duration::from_secs(600),
            window: Duration::from_secs(60),
            conversations_kept: 500,
            max_reply_text: 64 << 10,
            time_scale: 1.0,
        }
    }
}

/// Totals since start, with the sums behind the Prometheus summaries.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Totals {
    pub requests: u64,
    pub errors: u64,
    pub output_tokens: u64,
    pub ttft_sum_s: f64,
    pub tpot_sum_s: f64,
    pub tpot_count: u64,
    pub itl_sum_s: f64,
    pub itl_count: u64,
    pub e2e_sum_s: f64,
    pub user_model_errors: u64,
}

/// The figures a lane reads from a Prometheus server's query API instead of scraping
/// (`--prometheus-url`); `None` where a query failed or had no data.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PrometheusFigures {
    pub hit_rate: Option<f64>,
    pub queued: Option<f64>,
    /// Speculative decoding over the queries' window (`None` while the workers report none).
    pub acceptance_rate: Option<f64>,
    pub tokens_per_step: Option<f64>,
}

/// What the API reads of a lane.
#[derive(Debug)]
pub struct LaneState {
    pub running: bool,
    pub concurrency: u32,
    /// Seed 004's workload mix new sessions draw from.
    pub mix: Mix,
    /// The open loop's sessions per second (`None`: the closed loop at `concurrency`).
    pub rate: Option<f64>,
    /// Sessions started per workload (A, B, C) and open-loop arrivals refused (over
    /// `max_open`), since the start.
    pub sessions_by_class: [u64; 3],
    pub arrivals_dropped: u64,
    /// Lane clock at start (for durations) and the wall-clock start.
    pub started: Option<(Instant, u64)>,
    pub window: Window,
    pub totals: Totals,
    pub in_flight: u64,
    pub active_conversations: u32,
    pub store: Store,
    pub gateway: GatewayHistory,
    pub gateway_error: Option<String>,
    pub workers: WorkersView,
    /// From Prometheus, when the lane reads it.
    pub prometheus_figures: Option<PrometheusFigures>,
    /// The workers' speculative-decoding counters over the window (none when they report
    /// none).
    pub spec: SpecHistory,
    pub time_scale: f64,
    /// The workers' (name, metrics URL) when a fleet resized the cluster; `None`: the spec's.
    pub worker_metrics: Option<Vec<(String, String)>>,
    /// The target's router as the status shows it: the spec's, until a phase switch
    /// (`ladder.rs`) changes it.
    pub router: Option<String>,
}

impl LaneState {
    /// Seconds on the lane clock (model time) since the start (0 before any).
    pub fn now_s(&self) -> f64 {
        self.started
            .map_or(0.0, |(at, _)| at.elapsed().as_secs_f64() * self.time_scale)
    }

    /// A run starts at `epoch`: fresh window, counters and serving-side histories. The chat
    /// workload's start and a trace replay's (`trace_run.rs`) both begin here.
    pub fn begin_run(&mut self, epoch: Instant) {
        self.running = true;
        self.started = Some((epoch, unix_ms()));
        self.window.reset(0.0);
        self.totals = Totals::default();
        self.in_flight = 0;
        self.active_conversations = 0;
        self.sessions_by_class = [0; 3];
        self.arrivals_dropped = 0;
        self.gateway.clear();
        self.spec.clear();
    }

    /// A request that finished at `at_s` (lane clock) into the window and the totals;
    /// `first_turn` as [`TurnSample`]'s. Durations are multiplied by the lane's time scale
    /// (model time).
    pub fn record_finished(
        &mut self,
        result: &TurnResult,
        first_turn: bool,
        at_s: f64,
    ) -> TurnSample {
        let scale = self.time_scale;
        let sample = TurnSample {
            at_s,
            ttft_s: result.ttft.as_secs_f64() * scale,
            tpot_s: result.tpot().map(|d| d.as_secs_f64() * scale),
            itl_s: result.itl.map(|d| d.as_secs_f64() * scale),
            e2e_s: result.e2e.as_secs_f64() * scale,
            output_tokens: result.output_tokens,
            first_turn,
        };
        self.window.push(sample);
        let t = &mut self.totals;
        t.requests += 1;
        t.output_tokens += result.output_tokens;
        t.ttft_sum_s += sample.ttft_s;
        t.e2e_sum_s += sample.e2e_s;
        if let Some(tpot) = sample.tpot_s {
            t.tpot_sum_s += tpot;
            t.tpot_count += 1;
        }
        if let Some(itl) = sample.itl_s {
            t.itl_sum_s += itl;
            t.itl_count += 1;
        }
        sample
    }
}

enum Command {
    Start {
        concurrency: u32,
        reply: oneshot::Sender<Result<(), String>>,
    },
    Stop {
        reply: oneshot::Sender<Result<(), String>>,
    },
    Concurrency {
        concurrency: u32,
        reply: oneshot::Sender<()>,
    },
    /// Seed 004's mix and rate (`rate: Some(None)` switches to the closed loop).
    Shape {
        mix: Option<Mix>,
        rate: Option<Option<f64>>,
        reply: oneshot::Sender<Result<(), String>>,
    },
}

/// A running lane: its spec, its shared state and its command channel.
pub struct Lane {
    pub spec: Arc<LaneSpec>,
    pub state: Arc<Mutex<LaneState>>,
    commands: mpsc::Sender<Command>,
}

/// Poisoning only means a panic elsewhere; the state is still the best there is.
pub fn lock(state: &Mutex<LaneState>) -> MutexGuard<'_, LaneState> {
    state.lock().unwrap_or_else(|e| e.into_inner())
}

impl Lane {
    /// Spawns the lane task (stopped) and its metrics scraper.
    pub fn spawn(
        spec: LaneSpec,
        config: Arc<DriveConfig>,
        assets: Arc<Assets>,
        http: reqwest::Client,
        shutdown: CancellationToken,
    ) -> Lane {
        let spec = Arc::new(spec);
        let state = Arc::new(Mutex::new(LaneState {
            running: false,
            concurrency: config.workload.concurrency,
            mix: config.workload.mix,
            rate: config.workload.rate_rps,
            sessions_by_class: [0; 3],
            arrivals_dropped: 0,
            started: None,
            window: Window::new(config.window, 1 << 20),
            totals: Totals::default(),
            in_flight: 0,
            active_conversations: 0,
            store: Store::new(config.conversations_kept),
            gateway: GatewayHistory::new(config.window, 1_024),
            gateway_error: None,
            workers: WorkersView::default(),
            prometheus_figures: None,
            spec: SpecHistory::new(config.window, 1_024),
            time_scale: config.time_scale,
            worker_metrics: None,
            router: spec.router.clone(),
        }));
        let (commands, receiver) = mpsc::channel(64);
        let driver = Driver {
            spec: spec.clone(),
            config,
            assets,
            http: http.clone(),
            state: state.clone(),
            next_number: 0,
            base: 0,
            conversations: std::collections::HashMap::new(),
            failures_in_a_row: Arc::new(AtomicU32::new(0)),
        };
        tokio::spawn(driver.run(receiver, shutdown.clone()));
        tokio::spawn(crate::poll::scrape_loop(
            spec.clone(),
            state.clone(),
            http,
            shutdown,
        ));
        Lane {
            spec,
            state,
            commands,
        }
    }

    pub async fn start(&self, concurrency: u32) -> Result<(), String> {
        let (reply, answer) = oneshot::channel();
        self.send(Command::Start { concurrency, reply }).await?;
        answer
            .await
            .map_err(|_| "the lane has shut down".to_owned())?
    }

    pub async fn stop(&self) -> Result<(), String> {
        let (reply, answer) = oneshot::channel();
        self.send(Command::Stop { reply }).await?;
        answer
            .await
            .map_err(|_| "the lane has shut down".to_owned())?
    }

    pub async fn set_concurrency(&self, concurrency: u32) -> Result<(), String> {
        let (reply, answer) = oneshot::channel();
        self.send(Command::Concurrency { concurrency, reply })
            .await?;
        answer
            .await
            .map_err(|_| "the lane has shut down".to_owned())
    }

    /// Sets the mix and/or the rate (`Some(None)`: back to the closed loop), at once when
    /// running and for the next start otherwise.
    pub async fn set_shape(
        &self,
        mix: Option<Mix>,
        rate: Option<Option<f64>>,
    ) -> Result<(), String> {
        let (reply, answer) = oneshot::channel();
        self.send(Command::Shape { mix, rate, reply }).await?;
        answer
            .await
            .map_err(|_| "the lane has shut down".to_owned())?
    }

    async fn send(&self, command: Command) -> Result<(), String> {
        self.commands
            .send(command)
            .await
            .map_err(|_| "the lane has shut down".to_owned())
    }
}

/// The text side of an open conversation: what the next request sends.
struct Conversation {
    number: u64,
    /// The passage's title: the transcript's topic, and what the user model is told.
    topic: Arc<str>,
    /// (question, answer) of each finished turn.
    history: Vec<(Arc<str>, Arc<str>)>,
}

/// A turn's end, reported by its request task.
struct Outcome {
    run: u64,
    id: TurnKey,
    question: Arc<str>,
    result: Result<TurnResult, TurnError>,
    user_model_failed: bool,
}

struct Driver {
    spec: Arc<LaneSpec>,
    config: Arc<DriveConfig>,
    assets: Arc<Assets>,
    http: reqwest::Client,
    state: Arc<Mutex<LaneState>>,
    /// Conversation numbers continue across restarts, so ids stay unique in the store.
    next_number: u64,
    base: u64,
    conversations: std::collections::HashMap<u64, Conversation>,
    /// Failed turns since the last success: a failure is reported after a backoff that grows
    /// with it, so a dead target is not hammered by replacement conversations.
    failures_in_a_row: Arc<AtomicU32>,
}

/// The backoff before a failed turn ends its conversation: 100 ms doubling per failure in a
/// row, at most 5 s (wall time).
fn failure_backoff(failures_in_a_row: u32) -> Duration {
    Duration::from_millis(100u64 << failures_in_a_row.min(6)).min(Duration::from_secs(5))
}

/// Most turn outcomes waiting for the lane task: one per open conversation at most.
const OUTCOME_QUEUE: usize = 1 << 16;

impl Driver {
    async fn run(mut self, mut commands: mpsc::Receiver<Command>, shutdown: CancellationToken) {
        let (done_tx, mut done_rx) = mpsc::channel::<Outcome>(OUTCOME_QUEUE);
        let mut workload: Option<ChatWorkload<TextContent>> = None;
        let mut epoch = Instant::now();
        let mut run: u64 = 0;
        let mut requests = CancellationToken::new();
        let scale = self.config.time_scale;
        loop {
            let wake = workload
                .as_ref()
                .and_then(ChatWorkload::poll_timeout)
                .map(|at| epoch + Duration::from_secs_f64(at.as_secs_f64() / scale));
            tokio::select! {
                () = shutdown.cancelled() => break,
                command = commands.recv() => {
                    let Some(command) = command else { break };
                    match command {
                        Command::Start { concurrency, reply } => {
                            if workload.is_some() {
                                let _ = reply.send(Err("the workload is already running".into()));
                                continue;
                            }
                            let (mix, rate) = {
                                let s = lock(&self.state);
                                (s.mix, s.rate)
                            };
                            let config = WorkloadConfig {
                                concurrency,
                                mix,
                                rate_rps: rate,
                                ..self.config.workload.clone()
                            };
                            let seed = self.config.seed;
                            let assets = self.assets.clone();
                            match ChatWorkload::<TextContent>::with_content(config, assets, seed, Nanos::ZERO) {
                                Ok(w) => {
                                    epoch = Instant::now();
                                    run += 1;
                                    requests = CancellationToken::new();
                                    self.base = self.next_number;
                                    self.conversations.clear();
                                    let mut s = lock(&self.state);
                                    s.begin_run(epoch);
                                    s.concurrency = concurrency;
                                    s.active_conversations = w.active_conversations();
                                    drop(s);
                                    workload = Some(w);
                                    let _ = reply.send(Ok(()));
                                }
                                Err(e) => {
                                    let _ = reply.send(Err(e.to_string()));
                                }
                            }
                        }
                        Command::Stop { reply } => {
                            if workload.take().is_none() {
                                let _ = reply.send(Err("the workload is not running".into()));
                                continue;
                            }
                            requests.cancel();
                            self.conversations.clear();
                            let mut s = lock(&self.state);
                            let now_s = s.now_s();
                            s.running = false;
                            s.in_flight = 0;
                            s.active_conversations = 0;
                            s.store.stop_all(now_s);
                            drop(s);
                            let _ = reply.send(Ok(()));
                        }
                        Command::Concurrency { concurrency, reply } => {
                            let now = clock(epoch, scale);
                            if let Some(w) = workload.as_mut() {
                                w.set_concurrency(concurrency, now);
                            }
                            let mut s = lock(&self.state);
                            s.concurrency = concurrency;
                            if let Some(w) = &workload {
                                s.active_conversations = w.active_conversations();
                            }
                            drop(s);
                            let _ = reply.send(());
                        }
                        Command::Shape { mix, rate, reply } => {
                            let now = clock(epoch, scale);
                            let result = match workload.as_mut() {
                                Some(w) => mix
                                    .map_or(Ok(()), |m| w.set_mix(m))
                                    .and_then(|()| rate.map_or(Ok(()), |r| w.set_rate(r, now)))
                                    .map_err(|e| e.to_string()),
                                None => Ok(()),
                            };
                            if result.is_ok() {
                                let mut s = lock(&self.state);
                                if let Some(m) = mix {
                                    s.mix = m;
                                }
                                if let Some(r) = rate {
                                    s.rate = r;
                                }
                            }
                            let _ = reply.send(result);
                        }
                    }
                }
                Some(outcome) = done_rx.recv() => {
                    if outcome.run == run {
                        if let Some(w) = workload.as_mut() {
                            self.finish(w, outcome, clock(epoch, scale));
                        }
                    }
                }
                () = sleep_until(wake) => {
                    if let Some(w) = workload.as_mut() {
                        w.handle_timeout(clock(epoch, scale));
                    }
                }
            }
            if let Some(w) = workload.as_mut() {
                while let Some(request) = w.poll_request() {
                    self.issue(w, request, run, &requests, &done_tx);
                }
                let stats = w.stats();
                let mut s = lock(&self.state);
                s.active_conversations = w.active_conversations();
                s.sessions_by_class = stats.sessions_by_class;
                s.arrivals_dropped = stats.arrivals_dropped;
            }
        }
        requests.cancel();
    }

    /// Sends one turn: builds the messages, records the turn as streaming, and spawns its
    /// request task.
    fn issue(
        &mut self,
        workload: &ChatWorkload<TextContent>,
        request: TextTurn,
        run: u64,
        cancel: &CancellationToken,
        done: &mpsc::Sender<Outcome>,
    ) {
        let id = request.key;
        if !self.conversations.contains_key(&id.conversation) {
            let Some(info) = workload.conversation(id.conversation) else {
                return;
            };
            let number = self.base + id.conversation;
            self.next_number = self.next_number.max(number + 1);
            let tasks = || self.assets.tasks().ok();
            let topic: Arc<str> = match info.class {
                Class::A => self
                    .assets
                    .corpus()
                    .get(info.passage)
                    .map_or("a technical passage", |p| p.title())
                    .into(),
                Class::B => tasks()
                    .and_then(|t| t.documents().documents().get(info.passage))
                    .map_or_else(
                        || "summarisation".into(),
                        |d| format!("summarise: {}", d.title).into(),
                    ),
                Class::C => tasks()
                    .and_then(|t| t.bank().prompts().get(info.passage))
                    .map_or_else(
                        || "reasoning".into(),
                        |p| format!("reasoning: {}", p.category).into(),
                    ),
            };
            let now_s;
            {
                let mut s = lock(&self.state);
                now_s = s.now_s();
                s.store.insert(ConversationRecord {
                    number,
                    status: ConversationStatus::Active,
                    passage: info.passage,
                    topic: topic.clone(),
                    turns_planned: info.turns,
                    turns: Vec::new(),
                    started_at_ms: unix_ms(),
                    started_s: now_s,
                    ended_s: None,
                });
            }
            self.conversations.insert(
                id.conversation,
                Conversation {
                    number,
                    topic,
                    history: Vec::new(),
                },
            );
        }
        let Some(conversation) = self.conversations.get_mut(&id.conversation) else {
            return;
        };
        // The workload's question (also the fallback when a user model fails).
        let builtin = request.question;
        let ask_model = match (&self.config.user, conversation.history.last()) {
            (
                UserSimulator::Model {
                    url,
                    model,
                    api_key,
                },
                Some((_, answer)),
            ) => Some((url.clone(), model.clone(), api_key.clone(), answer.clone())),
            _ => None,
        };
        let system = request.system;
        let history = conversation.history.clone();
        let number = conversation.number;
        {
            let mut s = lock(&self.state);
            s.in_flight += 1;
            if let Some(record) = s.store.get_mut(number) {
                let user = if ask_model.is_some() {
                    "(the user model is writing the question)".into()
                } else {
                    builtin.clone()
                };
                record.turns.push(TurnRecord::streaming(id.turn, user));
            }
        }
        let output_tokens = request.planned_reply.len();
        let topic = conversation.topic.clone();
        let http = self.http.clone();
        let spec = self.spec.clone();
        let config = self.config.clone();
        let cancel = cancel.clone();
        let done = done.clone();
        let failures = self.failures_in_a_row.clone();
        tokio::spawn(async move {
            let work = async {
                let mut user_model_failed = false;
                let question = match ask_model {
                    Some((url, model, key, answer)) => match client::ask_user_model(
                        &http,
                        &url,
                        &model,
                        key.as_deref(),
                        &topic,
                        &answer,
                        Duration::from_secs(60),
                    )
                    .await
                    {
                        Ok(q) => q.into(),
                        Err(err) => {
                            tracing::warn!("user model failed, using a built-in question: {err}");
                            user_model_failed = true;
                            builtin
                        }
                    },
                    None => builtin,
                };
                let body = request_body(
                    &spec.model,
                    &system,
                    &history,
                    &question,
                    output_tokens,
                    config.fixed_output_length,
                );
                let url = format!("{}/v1/chat/completions", spec.target);
                let result = client::stream_turn(
                    &http,
                    &url,
                    spec.api_key.as_deref(),
                    body,
                    config.request_timeout,
                    config.max_reply_text,
                )
                .await;
                if result.is_ok() {
                    failures.store(0, Ordering::Relaxed);
                } else {
                    let n = failures.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(failure_backoff(n)).await;
                }
                Outcome {
                    run,
                    id,
                    question,
                    result,
                    user_model_failed,
                }
            };
            tokio::select! {
                () = cancel.cancelled() => {}
                outcome = work => {
                    let _ = done.send(outcome).await;
                }
            }
        });
    }

    /// A turn ended: measurements into the window, text into the transcript, and the workload
    /// told (the user thinks, or the conversation ends and is replaced).
    fn finish(&mut self, workload: &mut ChatWorkload<TextContent>, outcome: Outcome, now: Nanos) {
        let id = outcome.id;
        let Some(conversation) = self.conversations.get_mut(&id.conversation) else {
            return;
        };
        let number = conversation.number;
        let last_turn = workload
            .conversation(id.conversation)
            .is_some_and(|c| id.turn + 1 >= c.turns);
        let mut s = lock(&self.state);
        let now_s = now.as_secs_f64();
        s.in_flight = s.in_flight.saturating_sub(1);
        if outcome.user_model_failed {
            s.totals.user_model_errors += 1;
        }
        match outcome.result {
            Ok(result) => {
                let sample = s.record_finished(&result, id.turn == 0, now_s);
                let answer: Arc<str> = result.text.into();
                conversation
                    .history
                    .push((outcome.question.clone(), answer.clone()));
                if let Some(record) = s.store.get_mut(number) {
                    if let Some(turn) = record.turns.iter_mut().find(|t| t.index == id.turn) {
                        turn.user = outcome.question;
                        turn.assistant = answer;
                        turn.ttft_ms = Some(sample.ttft_s * 1e3);
                        turn.itl_ms = sample.itl_s.map(|x| x * 1e3);
                        turn.tpot_ms = sample.tpot_s.map(|x| x * 1e3);
                        turn.tokens = result.output_tokens;
                        turn.latency_s = Some(sample.e2e_s);
                        turn.worker = result.worker;
                        turn.state = TurnState::Done;
                    }
                }
                if last_turn {
                    s.store.end(number, ConversationStatus::Completed, now_s);
                }
                drop(s);
                if last_turn {
                    self.conversations.remove(&id.conversation);
                }
                workload.on_turn_finished(id, now);
            }
            Err(err) => {
                s.totals.errors += 1;
                if let Some(record) = s.store.get_mut(number) {
                    if let Some(turn) = record.turns.iter_mut().find(|t| t.index == id.turn) {
                        turn.user = outcome.question;
                        turn.error = Some(err.to_string());
                        turn.state = TurnState::Failed;
                    }
                }
                s.store.end(number, ConversationStatus::Error, now_s);
                drop(s);
                self.conversations.remove(&id.conversation);
                workload.on_turn_failed(id, now);
            }
        }
    }
}

/// The chat request of one turn: the system message, the finished turns, the new question.
fn request_body(
    model: &str,
    system: &str,
    history: &[(Arc<str>, Arc<str>)],
    question: &str,
    max_tokens: usize,
    fixed_length: bool,
) -> Vec<u8> {
    #[derive(Serialize)]
    struct Message<'a> {
        role: &'static str,
        content: &'a str,
    }
    #[derive(Serialize)]
    struct StreamOptions {
        include_usage: bool,
    }
    #[derive(Serialize)]
    struct Body<'a> {
        model: &'a str,
        messages: Vec<Message<'a>>,
        stream: bool,
        stream_options: StreamOptions,
        max_tokens: usize,
        #[serde(skip_serializing_if = "Option::is_none")]
        ignore_eos: Option<bool>,
    }
    let mut messages = Vec::with_capacity(2 + 2 * history.len());
    messages.push(Message {
        role: "system",
        content: system,
    });
    for (q, a) in history {
        messages.push(Message {
            role: "user",
            content: q,
        });
        messages.push(Message {
            role: "assistant",
            content: a,
        });
    }
    messages.push(Message {
        role: "user",
        content: question,
    });
    let body = Body {
        model,
        messages,
        stream: true,
        stream_options: StreamOptions {
            include_usage: true,
        },
        max_tokens,
        ignore_eos: fixed_length.then_some(true),
    };
    // Serializing borrowed strings into a Vec cannot fail.
    serde_json::to_vec(&body).unwrap_or_default()
}

/// The workload's clock: model time since `epoch`.
fn clock(epoch: Instant, scale: f64) -> Nanos {
    Nanos::from_secs_f64(epoch.elapsed().as_secs_f64() * scale)
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

pub fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_back_off_exponentially_up_to_five_seconds() {
        assert_eq!(failure_backoff(0), Duration::from_millis(100));
        assert_eq!(failure_backoff(3), Duration::from_millis(800));
        assert_eq!(failure_backoff(6), Duration::from_secs(5));
        assert_eq!(failure_backoff(u32::MAX), Duration::from_secs(5));
    }

    #[test]
    fn the_request_carries_the_whole_history_and_the_planned_length() {
        let history = vec![("q1".into(), "a1".into())];
        let body = request_body("m", "sys", &history, "q2", 812, true);
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        let roles: Vec<&str> = v["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["role"].as_str().unwrap())
            .collect();
        assert_eq!(roles, ["system", "user", "assistant", "user"]);
        assert_eq!(v["messages"][3]["content"], "q2");
        assert_eq!(v["max_tokens"], 812);
        assert_eq!(v["ignore_eos"], true);
        assert_eq!(v["stream"], true);
        assert_eq!(v["stream_options"]["include_usage"], true);
        let natural = request_body("m", "sys", &[], "q", 10, false);
        let v: serde_json::Value = serde_json::from_slice(&natural).unwrap();
        assert!(v.get("ignore_eos").is_none());
    }
}
