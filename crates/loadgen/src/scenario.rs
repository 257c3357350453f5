//! Seed 004's booth controls, in real time: the scenario controller (auto mode) and the pools'
//! autoscalers (manual mode), driving a [`Fleet`] that the load generator is given.
//!
//! The decisions are the sans-IO cores': the cycle is `workload::scenario::ScenarioController`,
//! each pool's KEDA `ScaledObject` is a `router::autoscale::Autoscaler` fed by a
//! `HistogramWindow` (`histogram_quantile(0.95, rate(x_bucket[5m]))`). This module is their
//! driver: one task sleeps until the next phase change, ramp step or poll, applies the
//! actions (mix and rate through [`App::configure`], pool sizes through [`Fleet::scale`]) and
//! keeps what the status shows (the mode, the phase, the scalers' values, the scaling events
//! and the pools' sizes over time).
//!
//! **Time.** Everything runs on the lanes' clock: model time, `time_scale` model seconds per
//! wall second (a sped-up simulated cluster). A 2-minute phase at `--speedup 10` lasts 12 wall
//! seconds, the 15 s polling interval 1.5 s and the 5-minute rate window 30 s; the gateway's
//! histograms measure wall seconds, so their quantiles are multiplied by `time_scale` before
//! they meet the thresholds (which are model seconds, as the seed writes them).
//!
//! **Modes.** Manual (the default): the autoscalers decide, the workload is the presenter's.
//! Auto: the cycle drives the mix, the rate and the pools, and the autoscalers are paused
//! (KEDA's `autoscaling.keda.sh/paused`). Stop or manual: the cycle stops, the workload keeps
//! its last mix and rate, and the autoscalers resume with no memory of the pause.
//!
//! **Bounds.** The command channel holds 8, the events 50, the pools' history 500 points; at
//! most one scale per pool is in flight from here (the fleet serializes its own).

use std::collections::VecDeque;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use nanotime::Nanos;
use router::autoscale::{
    Autoscaler, FRONTEND_ITL_BUCKETS, FRONTEND_TTFT_BUCKETS, HistogramWindow, ScalerConfig,
};
use serde::Serialize;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use workload::scenario::{ScenarioAction, ScenarioConfig, ScenarioController};

pub use futures::future::BoxFuture;
pub use workload::scenario::{PoolKind, PoolSizes};

use crate::lane::unix_ms;
use crate::scrape::{self, Sample};
use crate::server::{App, WorkloadChange};

/// Scaling events kept for the status, newest last.
pub const MAX_EVENTS: usize = 50;
/// Points of the pools' sizes kept for the status.
pub const MAX_POOL_HISTORY: usize = 500;
/// The quantile the scalers' queries take (seed 004: p95).
pub const QUANTILE: f64 = 0.95;
/// The rate a scenario's 0 is sent as: the workload's open loop needs a positive rate, and one
/// session per 100 s is as good as none on the booth's screen.
pub const MIN_SCENARIO_RATE: f64 = 0.01;
/// The PromQL `rate()` window of seed 004's queries.
pub const RATE_WINDOW: Duration = Duration::from_secs(300);
const SCRAPE_TIMEOUT: Duration = Duration::from_secs(5);

/// The prefill and decode pools of a cluster the load generator may resize (`kvroute demo`'s
/// simulated workers). On Kubernetes there is none: KEDA or the operator scales the pools.
pub trait Fleet: Send + Sync + 'static {
    /// The pools' sizes now: workers registered and not draining.
    fn pools(&self) -> PoolSizes;

    /// Resizes `pool` to `to` workers: new ones start cold and register; the newest ones
    /// leave by draining (no new requests, then stopped once idle). Concurrent calls run one
    /// after the other. Returns the size reached.
    fn scale(&self, pool: PoolKind, to: u32) -> BoxFuture<'_, Result<u32, String>>;

    /// Each worker's name and metrics URL (`worker-N`, `http://…/metrics`), for the GPU view.
    fn worker_metrics(&self) -> Vec<(String, String)>;
}

/// The scenario, the scalers and the fleet they act on.
#[derive(Clone)]
pub struct ScalingConfig {
    /// The auto-mode cycle (default: seed 004's).
    pub scenario: ScenarioConfig,
    /// What scaling actions resize; `None`: they are reported as not applied.
    pub fleet: Option<Arc<dyn Fleet>>,
    /// Why there is no fleet, for the events and the log.
    pub no_fleet_reason: String,
    /// The prefill pool's scaler (on `pool="prefill"` TTFT p95) and the decode pool's (on
    /// `pool="decode"` ITL p95); intervals in model time.
    pub prefill: ScalerConfig,
    pub decode: ScalerConfig,
    /// The queries' `rate()` window, model time.
    pub window: Duration,
    /// Start in auto mode.
    pub auto: bool,
}

impl fmt::Debug for ScalingConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ScalingConfig")
            .field("scenario", &self.scenario)
            .field("fleet", &self.fleet.as_ref().map(|_| "demo"))
            .field("no_fleet_reason", &self.no_fleet_reason)
            .field("prefill", &self.prefill)
            .field("decode", &self.decode)
            .field("window", &self.window)
            .field("auto", &self.auto)
            .finish()
    }
}

impl Default for ScalingConfig {
    /// Seed 004's cycle and scalers, no fleet.
    fn default() -> ScalingConfig {
        ScalingConfig {
            scenario: ScenarioConfig::seed004(),
            fleet: None,
            no_fleet_reason: "the load generator drives an external target (on Kubernetes, \
                              KEDA or the operator scales the pools)"
                .to_owned(),
            prefill: ScalerConfig::seed004_prefill(),
            decode: ScalerConfig::seed004_decode(),
            window: RATE_WINDOW,
            auto: false,
        }
    }
}

impl ScalingConfig {
    pub fn validate(&self) -> Result<(), String> {
        self.scenario.validate().map_err(|e| e.to_string())?;
        for (pool, config) in [("prefill", &self.prefill), ("decode", &self.decode)] {
            config
                .validate()
                .map_err(|e| format!("the {pool} autoscaler: {e}"))?;
        }
        if self.window.is_zero() {
            return Err("the autoscalers' rate window must be positive".to_owned());
        }
        Ok(())
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    Manual,
    Auto,
}

/// Who resized a pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    Scenario,
    Autoscaler,
}

/// One scaling action, when it was carried out (or found impossible).
#[derive(Clone, Debug, Serialize)]
pub struct ScaleEvent {
    pub at_ms: u64,
    pub pool: PoolKind,
    pub from: u32,
    /// The size reached (the size asked for when not applied).
    pub to: u32,
    pub source: Source,
    /// The phase or the scaler's reason; `not applied: …` or `failed: …` when the pool did
    /// not change.
    pub reason: String,
    /// The scenario's phase at the time (`null` in manual mode).
    pub phase: Option<String>,
    pub applied: bool,
}

#[derive(Clone, Copy, Debug, Serialize)]
pub struct PoolPoint {
    pub at_ms: u64,
    pub prefill: u32,
    pub decode: u32,
}

/// One pool's scaler in the status.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct ScalerStatus {
    /// The query's last value (model seconds); `null` before a poll or without observations.
    pub value: Option<f64>,
    pub threshold: f64,
    pub paused: bool,
}

#[derive(Clone, Copy, Debug, Serialize)]
pub struct ScalersStatus {
    pub prefill: ScalerStatus,
    pub decode: ScalerStatus,
}

/// `status.scenario` (docs/LOADGEN-API.md).
#[derive(Clone, Debug, Serialize)]
pub struct ScenarioState {
    pub mode: Mode,
    /// The phase's name; `IDLE` in manual mode.
    pub phase: String,
    pub index: Option<usize>,
    pub cycle: u64,
    pub time_left_s: f64,
    pub phase_duration_s: f64,
    pub note: Option<String>,
    /// The mix the cycle set, as `A=40,B=30,C=30`.
    pub mix: Option<String>,
    pub rate_rps: Option<f64>,
    /// The pools' actual sizes; `null` without a fleet.
    pub pools: Option<PoolSizes>,
    /// `demo` when the load generator resizes the pools itself, `none` otherwise.
    pub fleet: &'static str,
    pub autoscaler: ScalersStatus,
    pub events: Vec<ScaleEvent>,
    pub pool_history: Vec<PoolPoint>,
}

/// What the driver task and the status share.
struct Shared {
    mode: Mode,
    controller: ScenarioController,
    /// Prefill, decode.
    scalers: [Autoscaler; 2],
    windows: [HistogramWindow; 2],
    values: [Option<f64>; 2],
    /// Without a fleet: the size the scalers believe each pool has (their last wish).
    nominal: PoolSizes,
    events: VecDeque<ScaleEvent>,
    pool_history: VecDeque<PoolPoint>,
}

fn slot(pool: PoolKind) -> usize {
    match pool {
        PoolKind::Prefill => 0,
        PoolKind::Decode => 1,
    }
}

/// A resize asked for.
struct Wish {
    to: u32,
    source: Source,
    reason: String,
    phase: Option<String>,
}

/// One pool's resizes: one runs at a time, and of those asked for meanwhile only the newest
/// is kept (phases shorter than a drain do not pile up).
#[derive(Default)]
struct Resizes {
    next: Mutex<Option<Wish>>,
    busy: AtomicBool,
}

impl Resizes {
    fn take(&self) -> Option<Wish> {
        self.next.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    fn has_next(&self) -> bool {
        self.next
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }
}

enum Command {
    Auto {
        phase: Option<String>,
        reply: oneshot::Sender<()>,
    },
    Manual {
        reply: oneshot::Sender<()>,
    },
}

/// The App's side of the scenario: commands to the driver task, and the shared state.
pub struct ScenarioHandle {
    config: ScalingConfig,
    shared: Arc<Mutex<Shared>>,
    /// Per pool: resizes asked for and not started, and whether one runs.
    resizes: Arc<[Resizes; 2]>,
    commands: mpsc::Sender<Command>,
    receiver: Mutex<Option<mpsc::Receiver<Command>>>,
    epoch: Instant,
    time_scale: f64,
}

fn lock(shared: &Mutex<Shared>) -> MutexGuard<'_, Shared> {
    shared.lock().unwrap_or_else(|e| e.into_inner())
}

impl ScenarioHandle {
    /// Validates the configuration; the driver starts with [`run`].
    pub fn new(config: ScalingConfig, time_scale: f64) -> Result<ScenarioHandle, String> {
        config.validate()?;
        let controller =
            ScenarioController::new(config.scenario.clone()).map_err(|e| e.to_string())?;
        let scalers = [
            Autoscaler::new(config.prefill.clone(), Nanos::ZERO).map_err(|e| e.to_string())?,
            Autoscaler::new(config.decode.clone(), Nanos::ZERO).map_err(|e| e.to_string())?,
        ];
        let window = Nanos::from_secs_f64(config.window.as_secs_f64());
        let (commands, receiver) = mpsc::channel(8);
        let mut shared = Shared {
            mode: Mode::Manual,
            controller,
            scalers,
            windows: [
                HistogramWindow::new(FRONTEND_TTFT_BUCKETS, window),
                HistogramWindow::new(FRONTEND_ITL_BUCKETS, window),
            ],
            values: [None, None],
            nominal: config.scenario.initial,
            events: VecDeque::new(),
            pool_history: VecDeque::new(),
        };
        if let Some(fleet) = &config.fleet {
            push_point(&mut shared, fleet.pools());
        }
        Ok(ScenarioHandle {
            shared: Arc::new(Mutex::new(shared)),
            resizes: Arc::new([Resizes::default(), Resizes::default()]),
            commands,
            receiver: Mutex::new(Some(receiver)),
            epoch: Instant::now(),
            time_scale,
            config,
        })
    }

    pub fn config(&self) -> &ScalingConfig {
        &self.config
    }

    pub fn fleet(&self) -> Option<&Arc<dyn Fleet>> {
        self.config.fleet.as_ref()
    }

    /// Model time since the load generator started.
    fn now(&self) -> Nanos {
        Nanos::from_secs_f64(self.epoch.elapsed().as_secs_f64() * self.time_scale)
    }

    /// The wall-clock instant of model time `at`.
    fn instant(&self, at: Nanos) -> Instant {
        let wall = Duration::from_secs_f64((at.as_secs_f64() / self.time_scale).min(1e9));
        self.epoch
            .checked_add(wall)
            .unwrap_or_else(|| Instant::now() + Duration::from_secs(86_400 * 365))
    }

    /// The cycle's phase names in order, for the `loadgen_scenario_phase` gauge.
    pub fn phase_names(&self) -> impl Iterator<Item = &str> {
        self.config.scenario.phases.iter().map(|p| p.name.as_str())
    }

    /// Checks a phase name against the cycle (`phase` is named in the error).
    pub fn check_phase(&self, name: &str) -> Result<(), String> {
        self.config
            .scenario
            .phase_index("phase", name)
            .map(|_| ())
            .map_err(|e| e.to_string())
    }

    /// Switches to auto mode (from `phase`, already checked); resolves once applied.
    pub async fn auto(&self, phase: Option<String>) {
        let (reply, done) = oneshot::channel();
        if self
            .commands
            .send(Command::Auto { phase, reply })
            .await
            .is_ok()
        {
            let _ = done.await;
        }
    }

    /// Switches to manual mode; resolves once applied.
    pub async fn manual(&self) {
        let (reply, done) = oneshot::channel();
        if self.commands.send(Command::Manual { reply }).await.is_ok() {
            let _ = done.await;
        }
    }

    pub fn mode(&self) -> Mode {
        lock(&self.shared).mode
    }

    /// `status.scenario`.
    pub fn state(&self) -> ScenarioState {
        let pools = self.config.fleet.as_ref().map(|f| f.pools());
        let now = self.now();
        let mut shared = lock(&self.shared);
        // A pool that changed outside an event (a drain that finished late) still shows.
        if let Some(pools) = pools {
            push_point(&mut shared, pools);
        }
        let status = shared.controller.status(now);
        let scaler = |i: usize| ScalerStatus {
            value: shared.values[i],
            threshold: shared.scalers[i].config().threshold,
            paused: shared.scalers[i].is_paused(),
        };
        ScenarioState {
            mode: shared.mode,
            phase: status.phase,
            index: status.index,
            cycle: status.cycle,
            time_left_s: status.time_left_s,
            phase_duration_s: status.phase_duration_s,
            note: status.note,
            mix: status.mix.map(|m| m.to_string()),
            rate_rps: status.rate_rps,
            pools,
            fleet: if self.config.fleet.is_some() {
                "demo"
            } else {
                "none"
            },
            autoscaler: ScalersStatus {
                prefill: scaler(0),
                decode: scaler(1),
            },
            events: shared.events.iter().cloned().collect(),
            pool_history: shared.pool_history.iter().copied().collect(),
        }
    }
}

/// Keeps a point when the sizes differ from the last one.
fn push_point(shared: &mut Shared, pools: PoolSizes) {
    if shared
        .pool_history
        .back()
        .is_some_and(|p| p.prefill == pools.prefill && p.decode == pools.decode)
    {
        return;
    }
    if shared.pool_history.len() == MAX_POOL_HISTORY {
        shared.pool_history.pop_front();
    }
    shared.pool_history.push_back(PoolPoint {
        at_ms: unix_ms(),
        prefill: pools.prefill,
        decode: pools.decode,
    });
}

fn push_event(shared: &mut Shared, event: ScaleEvent) {
    if event.applied {
        tracing::info!(
            pool = %event.pool, from = event.from, to = event.to, source = ?event.source,
            reason = %event.reason, "pool scaled"
        );
    } else {
        tracing::warn!(
            pool = %event.pool, from = event.from, to = event.to, source = ?event.source,
            reason = %event.reason, "pool not scaled"
        );
    }
    if shared.events.len() == MAX_EVENTS {
        shared.events.pop_front();
    }
    shared.events.push_back(event);
}

/// The driver task: phases, ramps and polls, until `shutdown`.
pub async fn run(
    app: Arc<App>,
    http: reqwest::Client,
    gateway_metrics: Option<String>,
    shutdown: CancellationToken,
) {
    let handle = &app.scenario;
    let Some(mut commands) = handle
        .receiver
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .take()
    else {
        return;
    };
    let poll_every = Nanos::from_secs_f64(
        handle
            .config
            .prefill
            .polling_interval
            .as_secs_f64()
            .min(handle.config.decode.polling_interval.as_secs_f64()),
    );
    let mut next_scrape = Nanos::ZERO;
    loop {
        let next_phase = lock(&handle.shared).controller.poll_timeout();
        let deadline = next_phase.map_or(next_scrape, |t| t.min(next_scrape));
        tokio::select! {
            () = shutdown.cancelled() => return,
            command = commands.recv() => match command {
                None => return,
                Some(Command::Auto { phase, reply }) => {
                    start_auto(&app, phase.as_deref()).await;
                    let _ = reply.send(());
                }
                Some(Command::Manual { reply }) => {
                    {
                        let now = handle.now();
                        let mut shared = lock(&handle.shared);
                        if shared.mode == Mode::Auto {
                            tracing::info!("scenario: manual mode; the autoscalers resume");
                        }
                        shared.mode = Mode::Manual;
                        shared.controller.stop();
                        for scaler in &mut shared.scalers {
                            scaler.resume(now);
                        }
                    }
                    app.publish(false);
                    let _ = reply.send(());
                }
            },
            () = tokio::time::sleep_until(handle.instant(deadline).into()) => {
                let now = handle.now();
                let actions = lock(&handle.shared).controller.handle_timeout(now);
                if !actions.is_empty() {
                    apply(&app, actions).await;
                }
                if now >= next_scrape {
                    next_scrape = now.saturating_add(poll_every);
                    poll_scalers(&app, &http, gateway_metrics.as_deref(), now).await;
                }
            }
        }
    }
}

async fn start_auto(app: &Arc<App>, phase: Option<&str>) {
    let handle = &app.scenario;
    let now = handle.now();
    let actions = {
        let mut shared = lock(&handle.shared);
        match shared.controller.start(now, phase) {
            Ok(actions) => {
                shared.mode = Mode::Auto;
                for scaler in &mut shared.scalers {
                    scaler.pause();
                }
                actions
            }
            Err(e) => {
                // Checked by the API before; a name that vanished is logged, not applied.
                tracing::warn!("scenario: {e}");
                return;
            }
        }
    };
    tracing::info!("scenario: auto mode; the autoscalers are paused");
    apply(app, actions).await;
}

/// Carries out the controller's actions: the mix and the rate on the lanes (starting the
/// workload when it is stopped), each pool's size on the fleet.
async fn apply(app: &Arc<App>, actions: Vec<ScenarioAction>) {
    let (mut mix, mut rate, mut phase) = (None, None, None);
    let mut scales = Vec::new();
    for action in actions {
        match action {
            ScenarioAction::EnterPhase { name, cycle, .. } => {
                tracing::info!(phase = %name, cycle, "scenario: phase");
                phase = Some(name);
            }
            ScenarioAction::SetMix(m) => mix = Some(m),
            ScenarioAction::SetRate(r) => rate = Some(r.max(MIN_SCENARIO_RATE)),
            ScenarioAction::Scale { pool, to } => {
                scales.retain(|(p, _)| *p != pool);
                scales.push((pool, to));
            }
        }
    }
    if mix.is_some() || rate.is_some() {
        let change = WorkloadChange {
            concurrency: None,
            mix,
            rate: rate.map(Some),
        };
        if let Err(e) = app.configure(change).await {
            tracing::warn!("scenario: setting the workload: {}", e.0.message());
        }
    }
    if !app.is_running() {
        if let Err(e) = app.start(None).await {
            tracing::warn!("scenario: starting the workload: {}", e.0.message());
        }
    }
    let phase = phase.or_else(|| current_phase(app));
    for (pool, to) in scales {
        let reason = match &phase {
            Some(name) => format!("phase {name}"),
            None => "scenario".to_owned(),
        };
        scale(app, pool, to, Source::Scenario, reason, phase.clone());
    }
    app.publish(false);
}

fn current_phase(app: &App) -> Option<String> {
    let shared = lock(&app.scenario.shared);
    (shared.mode == Mode::Auto).then(|| shared.controller.status(Nanos::ZERO).phase)
}

/// Resizes `pool` in a task of its own (a drain can take a while), recording the event when
/// it is done. Without a fleet the event says why nothing happened.
fn scale(
    app: &Arc<App>,
    pool: PoolKind,
    to: u32,
    source: Source,
    reason: String,
    phase: Option<String>,
) {
    let handle = &app.scenario;
    let Some(fleet) = handle.config.fleet.clone() else {
        let mut shared = lock(&handle.shared);
        let from = shared.nominal.get(pool);
        if from == to {
            return;
        }
        match pool {
            PoolKind::Prefill => shared.nominal.prefill = to,
            PoolKind::Decode => shared.nominal.decode = to,
        }
        let event = ScaleEvent {
            at_ms: unix_ms(),
            pool,
            from,
            to,
            source,
            reason: format!("not applied: {} ({reason})", handle.config.no_fleet_reason),
            phase,
            applied: false,
        };
        push_event(&mut shared, event);
        return;
    };
    let resizes = handle.resizes.clone();
    let i = slot(pool);
    *resizes[i].next.lock().unwrap_or_else(|e| e.into_inner()) = Some(Wish {
        to,
        source,
        reason,
        phase,
    });
    if resizes[i].busy.swap(true, Ordering::SeqCst) {
        // The running task takes the newest wish when it is done.
        return;
    }
    let app = app.clone();
    tokio::spawn(async move {
        loop {
            let Some(wish) = resizes[i].take() else {
                resizes[i].busy.store(false, Ordering::SeqCst);
                // A wish that came in between is ours unless another task took over.
                if resizes[i].has_next() && !resizes[i].busy.swap(true, Ordering::SeqCst) {
                    continue;
                }
                return;
            };
            let from = fleet.pools().get(pool);
            if from == wish.to {
                continue;
            }
            let result = fleet.scale(pool, wish.to).await;
            let pools = fleet.pools();
            {
                let mut shared = lock(&app.scenario.shared);
                let (to, reason, applied) = match result {
                    Ok(reached) => (reached, wish.reason, true),
                    Err(e) => (
                        pools.get(pool),
                        format!("failed: {e} ({})", wish.reason),
                        false,
                    ),
                };
                let event = ScaleEvent {
                    at_ms: unix_ms(),
                    pool,
                    from,
                    to,
                    source: wish.source,
                    reason,
                    phase: wish.phase,
                    applied,
                };
                push_event(&mut shared, event);
                push_point(&mut shared, pools);
            }
            app.set_worker_metrics(fleet.worker_metrics());
            app.publish(false);
        }
    });
}

/// One poll of both scalers: scrape the gateway, update the windows, and (in manual mode)
/// resize the pools the scalers decide on.
async fn poll_scalers(app: &Arc<App>, http: &reqwest::Client, url: Option<&str>, now: Nanos) {
    let handle = &app.scenario;
    let samples = match url {
        Some(url) => match scrape::fetch_text(http, url, SCRAPE_TIMEOUT).await {
            Ok(text) => Some(scrape::parse_text(&text)),
            Err(e) => {
                tracing::debug!("autoscaler: scraping {url}: {e}");
                None
            }
        },
        None => None,
    };
    let pools = handle.config.fleet.as_ref().map(|f| f.pools());
    let mut decisions = Vec::new();
    {
        let mut shared = lock(&handle.shared);
        let queries = [
            (
                "dynamo_frontend_time_to_first_token_seconds_bucket",
                "prefill",
                FRONTEND_TTFT_BUCKETS,
            ),
            (
                "dynamo_frontend_inter_token_latency_seconds_bucket",
                "decode",
                FRONTEND_ITL_BUCKETS,
            ),
        ];
        for (i, (series, label, bounds)) in queries.into_iter().enumerate() {
            if let Some(cumulative) = samples
                .as_deref()
                .and_then(|s| pool_buckets(s, series, label, bounds))
            {
                shared.windows[i].record(now, cumulative);
            }
            // Wall seconds from the gateway, model seconds for the thresholds.
            let value = shared.windows[i]
                .quantile(QUANTILE)
                .map(|v| v * handle.time_scale);
            shared.values[i] = value;
            let pool = PoolKind::ALL[i];
            let current = pools.map_or(shared.nominal.get(pool), |p| p.get(pool));
            if handle.resizes[i].busy.load(Ordering::SeqCst) {
                // A resize is under way: the scaler waits for it (as the HPA waits for
                // its replicas), its next poll decides.
                continue;
            }
            if let Some(decision) = shared.scalers[i].on_poll(now, value, current) {
                decisions.push((pool, decision));
            }
        }
    }
    for (pool, decision) in decisions {
        let reason = format!(
            "{} (p95 {:.3} s against {} s)",
            decision.reason,
            decision.value,
            match pool {
                PoolKind::Prefill => handle.config.prefill.threshold,
                PoolKind::Decode => handle.config.decode.threshold,
            }
        );
        scale(app, pool, decision.to, Source::Autoscaler, reason, None);
    }
    app.publish(false);
}

/// The cumulative counts of `series` with `pool="label"`, one per bound and `+Inf`, summed
/// over the other labels; `None` when a bucket is missing.
fn pool_buckets(samples: &[Sample], series: &str, label: &str, bounds: &[f64]) -> Option<Vec<u64>> {
    let mut counts = vec![0u64; bounds.len() + 1];
    let mut seen = vec![false; bounds.len() + 1];
    for sample in samples
        .iter()
        .filter(|s| s.name == series && s.label("pool") == Some(label))
    {
        let le = sample.label("le")?;
        let index = if le == "+Inf" {
            bounds.len()
        } else {
            let bound: f64 = le.parse().ok()?;
            bounds
                .iter()
                .position(|b| (b - bound).abs() <= 1e-12 * b.abs())?
        };
        counts[index] += sample.value.max(0.0) as u64;
        seen[index] = true;
    }
    seen.iter().all(|s| *s).then_some(counts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_read_per_pool_in_bound_order() {
        let text = "\
x_bucket{model=\"m\",le=\"0.1\",pool=\"prefill\"} 1
x_bucket{model=\"m\",le=\"0.5\",pool=\"prefill\"} 3
x_bucket{model=\"m\",le=\"+Inf\",pool=\"prefill\"} 4
x_bucket{model=\"m\",le=\"0.1\",pool=\"decode\"} 9
x_bucket{model=\"m\",le=\"0.5\",pool=\"decode\"} 9
x_bucket{model=\"m\",le=\"+Inf\",pool=\"decode\"} 9
";
        let samples = scrape::parse_text(text);
        assert_eq!(
            pool_buckets(&samples, "x_bucket", "prefill", &[0.1, 0.5]),
            Some(vec![1, 3, 4])
        );
        // A bound the gateway does not write: no answer rather than a wrong one.
        assert_eq!(
            pool_buckets(&samples, "x_bucket", "prefill", &[0.1, 0.25, 0.5]),
            None
        );
        assert_eq!(
            pool_buckets(&samples, "x_bucket", "aggregated", &[0.1, 0.5]),
            None
        );
    }
}
