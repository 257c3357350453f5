//! The control API, the WebSocket, `/metrics` and the embedded web UI (docs/LOADGEN-API.md).

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{Path, Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use report::Percentiles;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::baseline::{Baseline, BaselineRow};
use crate::ladder::{LadderHandle, LadderState};
use crate::lane::{Lane, Totals, lock, unix_ms};
use crate::reference::{PhaseReference, ReferenceStatus};
use crate::scenario::{ScenarioHandle, ScenarioState};
use crate::store::{ConversationRecord, ConversationStatus, TurnRecord};
use crate::trace_run::{TraceHandle, TraceStatus};
use crate::{MAX_CONCURRENCY, Slider, Slo};
use workload::{MAX_RATE, Mix};

mod assets {
    include!(concat!(env!("OUT_DIR"), "/assets.rs"));
}

/// How often the status is recomputed and pushed, and how often a chart point is kept.
pub const STATUS_INTERVAL: Duration = Duration::from_secs(1);
pub const HISTORY_INTERVAL_S: f64 = 2.0;
/// Chart points kept per lane: 15 minutes at one point per 2 s.
const HISTORY_POINTS: usize = 450;

pub struct App {
    pub lanes: Vec<Lane>,
    pub baseline: Option<Baseline>,
    /// Seed 003's phase ladder, for the charts' reference lines.
    pub references: Option<PhaseReference>,
    pub slider: Slider,
    pub slo: Slo,
    pub window_s: f64,
    pub initial_concurrency: u32,
    /// Per passage: the start of its system message, for the transcript's header.
    pub system_excerpts: Vec<String>,
    pub status: watch::Sender<Arc<str>>,
    /// Seed 004's scenario controller and autoscalers (`scenario.rs`).
    pub scenario: ScenarioHandle,
    /// Seed 003's phase ladder, when the cluster can be restarted at another phase
    /// (`ladder.rs`).
    pub ladder: Option<LadderHandle>,
    /// A trace replayed instead of the chat workload (`trace_run.rs`): Start and Stop act on
    /// it, and the workload's shape does not apply.
    pub trace: Option<TraceHandle>,
    history: Mutex<Vec<VecDeque<HistoryPoint>>>,
    /// Serializes start / stop / config so that every lane sees them in the same order.
    control: tokio::sync::Mutex<()>,
}

impl App {
    // One call site (`Loadgen::bind`), each argument a part of the App.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        lanes: Vec<Lane>,
        baseline: Option<Baseline>,
        slider: Slider,
        slo: Slo,
        window_s: f64,
        initial_concurrency: u32,
        system_excerpts: Vec<String>,
        scenario: ScenarioHandle,
    ) -> App {
        let history = Mutex::new(lanes.iter().map(|_| VecDeque::new()).collect());
        let (status, _) = watch::channel(Arc::from("{}"));
        App {
            lanes,
            baseline,
            references: None,
            slider,
            slo,
            window_s,
            initial_concurrency,
            system_excerpts,
            scenario,
            ladder: None,
            trace: None,
            status,
            history,
            control: tokio::sync::Mutex::new(()),
        }
    }

    pub fn status(&self) -> Status {
        let lanes: Vec<LaneStatus> = self.lanes.iter().map(lane_status).collect();
        let first = self.lanes.first().map(|l| lock(&l.state));
        let (running, concurrency, started_at_ms, mix, rate) = match &first {
            Some(s) => (
                s.running,
                s.concurrency,
                s.started.map(|(_, ms)| ms),
                s.mix,
                s.rate,
            ),
            None => (false, self.initial_concurrency, None, Mix::default(), None),
        };
        drop(first);
        Status {
            running,
            concurrency,
            mix: mix.to_string(),
            rate,
            slider: self.slider,
            slo: self.slo,
            window_s: self.window_s,
            time_ms: unix_ms(),
            started_at_ms: started_at_ms.filter(|_| running),
            baseline: self
                .baseline
                .as_ref()
                .and_then(|b| b.row_near(concurrency))
                .cloned(),
            references: self.references.as_ref().and_then(|r| r.status(concurrency)),
            lanes,
            scenario: self.scenario.state(),
            ladder: self.ladder.as_ref().map(LadderHandle::state),
            trace: self.trace.as_ref().map(TraceHandle::status),
        }
    }

    /// Whether any lane runs.
    pub fn is_running(&self) -> bool {
        self.lanes.iter().any(|l| lock(&l.state).running)
    }

    /// Up to `limit` distinct messages of the failed turns the conversations kept show,
    /// newest conversation first: why the lanes' `errors` failed (a headless run names one).
    pub fn recent_errors(&self, limit: usize) -> Vec<String> {
        let mut errors: Vec<String> = Vec::new();
        for lane in &self.lanes {
            let state = lock(&lane.state);
            let failed = state
                .store
                .newest(usize::MAX)
                .filter(|c| c.status == ConversationStatus::Error)
                .flat_map(|c| c.turns.iter().filter_map(|t| t.error.as_deref()));
            for error in failed {
                if errors.len() >= limit {
                    return errors;
                }
                if !errors.iter().any(|e| e == error) {
                    errors.push(error.to_owned());
                }
            }
        }
        errors
    }

    /// The workers' metrics endpoints after the fleet changed (the GPU view follows it).
    pub fn set_worker_metrics(&self, workers: Vec<(String, String)>) {
        for lane in &self.lanes {
            lock(&lane.state).worker_metrics = Some(workers.clone());
        }
    }

    /// Recomputes the status, pushes it to WebSocket clients, and keeps a chart point when
    /// `keep_point`.
    pub fn publish(&self, keep_point: bool) -> Status {
        let status = self.status();
        if keep_point {
            let mut history = self.history.lock().unwrap_or_else(|e| e.into_inner());
            for (points, lane) in history.iter_mut().zip(&status.lanes) {
                if points.len() == HISTORY_POINTS {
                    points.pop_front();
                }
                let m = &lane.metrics;
                points.push_back(HistoryPoint {
                    time_ms: status.time_ms,
                    ttft_p50_ms: m.ttft_ms.and_then(|q| q.p50),
                    ttft_p95_ms: m.ttft_ms.and_then(|q| q.p95),
                    tpot_p95_ms: m.tpot_ms.and_then(|q| q.p95),
                    tops: m.tops,
                    kv_hit_rate: m.kv_hit_rate,
                    in_flight: m.in_flight,
                    itl_p50_ms: m.itl_ms.and_then(|q| q.p50),
                    itl_p95_ms: m.itl_ms.and_then(|q| q.p95),
                    ttft_turn1_p50_ms: m.ttft_turn1_ms.and_then(|q| q.p50),
                    ttft_later_p50_ms: m.ttft_later_ms.and_then(|q| q.p50),
                });
            }
        }
        let json = serde_json::to_string(&WsMessage {
            kind: "status",
            data: &status,
        })
        .unwrap_or_default();
        self.status.send_replace(json.into());
        status
    }

    pub async fn start(&self, concurrency: Option<u32>) -> Result<Status, ApiError> {
        let _serial = self.control.lock().await;
        if let Some(trace) = &self.trace {
            // The trace sets the load; a concurrency (the dashboard's Start sends the
            // slider's) does not apply.
            let lane = self
                .lanes
                .first()
                .ok_or_else(|| ApiError::internal("no lane to replay the trace on".to_owned()))?;
            trace
                .start(lane.state.clone())
                .map_err(|e| ApiError::conflict("already_running", &e))?;
            self.clear_history();
            return Ok(self.publish(false));
        }
        let concurrency = concurrency.unwrap_or_else(|| {
            self.lanes
                .first()
                .map_or(self.initial_concurrency, |l| lock(&l.state).concurrency)
        });
        check_concurrency(concurrency)?;
        if self.lanes.iter().any(|l| lock(&l.state).running) {
            return Err(ApiError::conflict(
                "already_running",
                "the workload is already running",
            ));
        }
        for lane in &self.lanes {
            lane.start(concurrency).await.map_err(ApiError::internal)?;
        }
        self.clear_history();
        Ok(self.publish(false))
    }

    fn clear_history(&self) {
        *self.history.lock().unwrap_or_else(|e| e.into_inner()) =
            self.lanes.iter().map(|_| VecDeque::new()).collect();
    }

    pub async fn stop(&self) -> Result<Status, ApiError> {
        let _serial = self.control.lock().await;
        if let Some(trace) = &self.trace {
            if !trace.stop().await.map_err(ApiError::internal)? {
                return Err(ApiError::conflict(
                    "not_running",
                    "the trace replay is not running",
                ));
            }
            return Ok(self.publish(false));
        }
        if !self.lanes.iter().any(|l| lock(&l.state).running) {
            return Err(ApiError::conflict(
                "not_running",
                "the workload is not running",
            ));
        }
        for lane in &self.lanes {
            // A lane that is already stopped says so; the others still stop.
            let _ = lane.stop().await;
        }
        Ok(self.publish(false))
    }

    pub async fn set_concurrency(&self, concurrency: u32) -> Result<Status, ApiError> {
        self.configure(WorkloadChange {
            concurrency: Some(concurrency),
            ..WorkloadChange::default()
        })
        .await
    }

    /// Applies a validated change of concurrency, mix and rate to every lane, in that order.
    pub async fn configure(&self, change: WorkloadChange) -> Result<Status, ApiError> {
        let _serial = self.control.lock().await;
        self.refuse_in_trace_mode()?;
        if let Some(concurrency) = change.concurrency {
            check_concurrency(concurrency)?;
            for lane in &self.lanes {
                lane.set_concurrency(concurrency)
                    .await
                    .map_err(ApiError::internal)?;
            }
        }
        if change.mix.is_some() || change.rate.is_some() {
            for lane in &self.lanes {
                lane.set_shape(change.mix, change.rate)
                    .await
                    .map_err(ApiError::internal)?;
            }
        }
        Ok(self.publish(false))
    }
}

impl App {
    /// Restarts the cluster at seed 003's `phase` (`ladder.rs`): running lanes stop (their
    /// requests in flight are cancelled), the ladder restarts the workers and the gateway's
    /// router, and the lanes start again with fresh windows; the charts' history is kept.
    pub async fn switch_phase(&self, phase: &str) -> Result<Status, ApiError> {
        let Some(ladder) = &self.ladder else {
            return Err(ApiError::conflict(
                "no_ladder",
                "this load generator cannot switch phases: only `kvroute demo` with one \
                 aggregated simulated cluster restarts its workers",
            ));
        };
        ladder.check(phase).map_err(|e| bad_field("phase", e))?;
        let _serial = self.control.lock().await;
        ladder.begin(phase);
        // Stopped lanes first, so that no request waits on a worker that goes away.
        let mut restart = Vec::new();
        for (i, lane) in self.lanes.iter().enumerate() {
            let (running, concurrency) = {
                let s = lock(&lane.state);
                (s.running, s.concurrency)
            };
            if running {
                // Under the control lock a running lane can only fail to stop if its task has
                // ended (the load generator is shutting down): then there is nothing to cancel.
                if let Err(e) = lane.stop().await {
                    tracing::warn!("phase switch: stopping lane {}: {e}", lane.spec.name);
                }
                restart.push((i, concurrency));
            }
        }
        self.publish(false);
        let switched = ladder.switch(phase).await;
        let workers = match &switched {
            Ok(workers) => Some(workers),
            Err((_, workers)) => workers.as_ref(),
        };
        if let Some(workers) = workers {
            let state = ladder.state();
            for lane in &self.lanes {
                let mut s = lock(&lane.state);
                s.worker_metrics = Some(workers.clone());
                s.router = Some(state.router.clone());
            }
        }
        // Started again unless no cluster runs: a failed switch that restored the previous
        // phase keeps the workload going there.
        let mut start_error = None;
        if workers.is_some() {
            for (i, concurrency) in restart {
                if let Err(e) = self.lanes[i].start(concurrency).await {
                    start_error = Some(e);
                }
            }
        }
        let result = match (switched, start_error) {
            (Err((e, _)), _) => Err(ApiError::internal(e)),
            (Ok(_), Some(e)) => Err(ApiError::internal(format!(
                "switched to {phase}, but restarting the workload failed: {e}"
            ))),
            (Ok(_), None) => Ok(()),
        };
        let status = self.publish(false);
        result.map(|()| status)
    }
}

impl App {
    /// 409 `trace_replay` when a trace sets the load: the chat workload's shape (concurrency,
    /// mix, rate) and seed 004's cycle do not apply.
    pub fn refuse_in_trace_mode(&self) -> Result<(), ApiError> {
        match &self.trace {
            Some(_) => Err(ApiError::conflict(
                "trace_replay",
                "this load generator replays a trace (--trace), which sets the load: \
                 concurrency, mix, rate and the scenario do not apply",
            )),
            None => Ok(()),
        }
    }
}

fn check_concurrency(concurrency: u32) -> Result<(), ApiError> {
    if (1..=MAX_CONCURRENCY).contains(&concurrency) {
        Ok(())
    } else {
        Err(ApiError::bad_request(
            "invalid_concurrency",
            format!("concurrency must be between 1 and {MAX_CONCURRENCY}, got {concurrency}"),
        ))
    }
}

/// A change of the workload's shape (`POST /api/workload/config`): each field left `None`
/// stays as it is; `rate: Some(None)` switches back to the closed loop.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct WorkloadChange {
    pub concurrency: Option<u32>,
    pub mix: Option<Mix>,
    pub rate: Option<Option<f64>>,
}

/// `GET /api/status`.
#[derive(Clone, Debug, Serialize)]
pub struct Status {
    pub running: bool,
    pub concurrency: u32,
    /// Seed 004's workload mix, e.g. `A=40,B=30,C=30`.
    pub mix: String,
    /// Sessions per second of the open loop; `null` in the closed loop (at `concurrency`).
    pub rate: Option<f64>,
    pub slider: Slider,
    pub slo: Slo,
    pub window_s: f64,
    pub time_ms: u64,
    pub started_at_ms: Option<u64>,
    pub lanes: Vec<LaneStatus>,
    pub baseline: Option<BaselineRow>,
    /// Seed 003's phases at the level nearest the concurrency: the charts' reference lines.
    pub references: Option<ReferenceStatus>,
    /// Seed 004's scenario controller, autoscalers and pools.
    pub scenario: ScenarioState,
    /// Seed 003's phase ladder (`null` when the load generator cannot restart its target).
    pub ladder: Option<LadderState>,
    /// The trace replay (`kvroute loadgen --trace`); `null` when the chat workload runs.
    pub trace: Option<TraceStatus>,
}

#[derive(Clone, Debug, Serialize)]
pub struct LaneStatus {
    pub name: String,
    pub router: Option<String>,
    pub target: String,
    pub metrics: LaneMetrics,
    pub workers: crate::scrape::WorkersView,
    /// Seed 004's sessions started since the start, per workload (A, B, C), and open-loop
    /// arrivals refused because `max_open` sessions were open.
    pub sessions_by_class: [u64; 3],
    pub arrivals_dropped: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct LaneMetrics {
    pub ttft_ms: Option<Percentiles>,
    /// TTFT of conversations' first turns, and of turns 2+.
    pub ttft_turn1_ms: Option<Percentiles>,
    pub ttft_later_ms: Option<Percentiles>,
    pub tpot_ms: Option<Percentiles>,
    pub itl_ms: Option<Percentiles>,
    pub e2e_s: Option<Percentiles>,
    /// Speculative decoding, when the workers report it (vLLM's counters over the window):
    /// the per-token acceptance probability and tokens per step (bonus token included).
    pub acceptance_rate: Option<f64>,
    pub tokens_per_step: Option<f64>,
    pub rps: Option<f64>,
    pub tops: Option<f64>,
    pub requests: u64,
    pub errors: u64,
    pub kv_hit_rate: Option<f64>,
    /// Reuse attribution over the window (a kvroute gateway's counters): the share of prompt
    /// tokens some worker held, and the share of that the workers reused.
    pub reuse_available: Option<f64>,
    pub reuse_achieved: Option<f64>,
    pub queued: Option<f64>,
    pub in_flight: u64,
    pub active_conversations: u32,
    pub window_samples: usize,
    /// Why the KV hit rate or queue is missing, when they are.
    pub gateway_error: Option<String>,
    /// Follow-up questions the user model failed to write (a built-in one was sent).
    pub user_model_errors: u64,
}

fn ms(q: Option<Percentiles>) -> Option<Percentiles> {
    q.map(|q| q.map(|v| v * 1e3))
}

fn lane_status(lane: &Lane) -> LaneStatus {
    let mut s = lock(&lane.state);
    let now_s = s.now_s();
    let w = s.window.stats(now_s);
    let running = s.running;
    LaneStatus {
        sessions_by_class: s.sessions_by_class,
        arrivals_dropped: s.arrivals_dropped,
        name: lane.spec.name.clone(),
        router: s.router.clone(),
        target: lane.spec.target.clone(),
        metrics: LaneMetrics {
            ttft_ms: ms(w.ttft_s),
            ttft_turn1_ms: ms(w.ttft_turn1_s),
            ttft_later_ms: ms(w.ttft_later_s),
            tpot_ms: ms(w.tpot_s),
            itl_ms: ms(w.itl_s),
            e2e_s: w.e2e_s,
            acceptance_rate: match (running, s.prometheus_figures) {
                (false, _) => None,
                (true, Some(p)) => p.acceptance_rate,
                (true, None) => s.spec.acceptance_rate(),
            },
            tokens_per_step: match (running, s.prometheus_figures) {
                (false, _) => None,
                (true, Some(p)) => p.tokens_per_step,
                (true, None) => s.spec.tokens_per_step(),
            },
            rps: w.rps,
            tops: w.tops,
            requests: s.totals.requests,
            errors: s.totals.errors,
            kv_hit_rate: match (running, s.prometheus_figures) {
                (false, _) => None,
                (true, Some(p)) => p.hit_rate,
                (true, None) => s.gateway.hit_rate(),
            },
            reuse_available: running.then(|| s.gateway.reuse().map(|r| r.0)).flatten(),
            reuse_achieved: running
                .then(|| s.gateway.reuse().and_then(|r| r.1))
                .flatten(),
            queued: match (running, s.prometheus_figures) {
                (false, _) => None,
                (true, Some(p)) => p.queued,
                (true, None) => s.gateway.queued(),
            },
            in_flight: s.in_flight,
            active_conversations: s.active_conversations,
            window_samples: w.samples,
            gateway_error: s.gateway_error.clone(),
            user_model_errors: s.totals.user_model_errors,
        },
        workers: s.workers.clone(),
    }
}

#[derive(Serialize)]
struct WsMessage<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    data: &'a Status,
}

#[derive(Clone, Copy, Debug, Serialize)]
struct HistoryPoint {
    time_ms: u64,
    ttft_p50_ms: Option<f64>,
    ttft_p95_ms: Option<f64>,
    tpot_p95_ms: Option<f64>,
    tops: Option<f64>,
    kv_hit_rate: Option<f64>,
    in_flight: u64,
    itl_p50_ms: Option<f64>,
    itl_p95_ms: Option<f64>,
    ttft_turn1_p50_ms: Option<f64>,
    ttft_later_p50_ms: Option<f64>,
}

/// An API error: `protocol::ApiError` (OpenAI's error JSON with its status), answered by axum.
#[derive(Debug)]
pub struct ApiError(pub protocol::ApiError);

impl ApiError {
    fn with(status: u16, kind: &str, code: &str, message: impl Into<String>) -> ApiError {
        ApiError(protocol::ApiError::new(
            status,
            kind,
            message,
            None,
            Some(code),
        ))
    }

    fn bad_request(code: &str, message: impl Into<String>) -> ApiError {
        ApiError::with(400, protocol::error::kind::INVALID_REQUEST, code, message)
    }

    fn conflict(code: &str, message: &str) -> ApiError {
        ApiError::with(409, protocol::error::kind::INVALID_REQUEST, code, message)
    }

    fn not_found(code: &str, message: impl Into<String>) -> ApiError {
        ApiError::with(404, protocol::error::kind::NOT_FOUND, code, message)
    }

    fn internal(message: String) -> ApiError {
        ApiError(protocol::ApiError::internal(message))
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        self.0.into_response()
    }
}

/// The router of every endpoint, behind the access checks of `access` (`access.rs`).
pub fn router(app: Arc<App>, access: crate::access::Access) -> Router {
    Router::new()
        .route("/api/status", get(get_status))
        .route("/api/workload/start", post(post_start))
        .route("/api/workload/stop", post(post_stop))
        .route("/api/workload/config", post(post_config))
        .route("/api/scenario/auto", post(post_scenario_auto))
        .route("/api/scenario/stop", post(post_scenario_manual))
        .route("/api/scenario/manual", post(post_scenario_manual))
        .route("/api/phase", post(post_phase))
        .route("/api/baseline", get(get_baseline))
        .route("/api/history", get(get_history))
        .route("/api/conversations", get(get_conversations))
        .route("/api/conversations/{id}", get(get_conversation))
        .route("/ws", get(ws))
        .route("/metrics", get(metrics))
        .route("/api/{*rest}", get(api_not_found).post(api_not_found))
        .fallback(get(asset))
        .with_state(app)
        .layer(axum::middleware::from_fn_with_state(
            Arc::new(access),
            crate::access::check,
        ))
}

async fn api_not_found(Path(rest): Path<String>) -> ApiError {
    ApiError::not_found("not_found", format!("no such endpoint: /api/{rest}"))
}

async fn get_status(State(app): State<Arc<App>>) -> axum::Json<Status> {
    axum::Json(app.status())
}

const BODY_EXAMPLE: &str = "{\"concurrency\": 120}, {\"mix\": \"A=40,B=30,C=30\"} or {\"rate\": 5}";

/// A 400 naming the field (`param` in the error JSON, and in the message).
fn bad_field(field: &str, message: impl Into<String>) -> ApiError {
    ApiError(protocol::ApiError::new(
        400,
        protocol::error::kind::INVALID_REQUEST,
        message,
        Some(field),
        Some(&format!("invalid_{field}")),
    ))
}

/// The body of `/api/workload/start` and `/api/workload/config`: any of `concurrency` (1 …
/// MAX_CONCURRENCY), `mix` (`"A=40,B=30,C=30"` or `{"A": 40, "B": 30, "C": 30}`) and `rate`
/// (sessions per second, > 0; `null` for the closed loop). Unknown fields are refused.
fn parse_change(body: &Bytes) -> Result<Option<WorkloadChange>, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(None);
    }
    let value: serde_json::Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::bad_request(
            "invalid_json",
            format!("expected a JSON body like {BODY_EXAMPLE}: {e}"),
        )
    })?;
    let serde_json::Value::Object(fields) = value else {
        return Err(ApiError::bad_request(
            "invalid_json",
            format!("expected a JSON object like {BODY_EXAMPLE}"),
        ));
    };
    let mut change = WorkloadChange::default();
    for (key, value) in fields {
        match key.as_str() {
            "concurrency" => {
                let n = value.as_i64().and_then(|n| u32::try_from(n).ok());
                change.concurrency = Some(n.filter(|n| (1..=MAX_CONCURRENCY).contains(n)).ok_or_else(|| {
                    bad_field(
                        "concurrency",
                        format!("concurrency must be between 1 and {MAX_CONCURRENCY}, got {value}"),
                    )
                })?);
            }
            "mix" => {
                let mix = match &value {
                    serde_json::Value::String(s) => s.parse::<Mix>().map_err(|e| e.to_string()),
                    serde_json::Value::Object(_) => {
                        serde_json::from_value::<Mix>(value.clone()).map_err(|e| e.to_string())
                    }
                    _ => Err(
                        "expected \"A=40,B=30,C=30\" or {\"A\": 40, \"B\": 30, \"C\": 30}"
                            .to_owned(),
                    ),
                };
                let mix = mix.and_then(|m| match m.total() {
                    100 => Ok(m),
                    total => Err(format!("the weights must add up to 100, got {total}")),
                });
                change.mix = Some(mix.map_err(|e| bad_field("mix", format!("mix: {e}")))?);
            }
            "rate" => {
                let rate = match &value {
                    serde_json::Value::Null => None,
                    v => Some(
                        v.as_f64()
                            .filter(|r| r.is_finite() && *r > 0.0 && *r <= MAX_RATE)
                            .ok_or_else(|| {
                                bad_field(
                                    "rate",
                                    format!(
                                        "rate must be a number of sessions per second in (0, {MAX_RATE}], or null for the closed loop; got {v}"
                                    ),
                                )
                            })?,
                    ),
                };
                change.rate = Some(rate);
            }
            other => {
                return Err(ApiError::bad_request(
                    "invalid_json",
                    format!("unknown field `{other}`: expected concurrency, mix or rate"),
                ));
            }
        }
    }
    Ok(Some(change))
}

async fn post_start(
    State(app): State<Arc<App>>,
    body: Bytes,
) -> Result<axum::Json<Status>, ApiError> {
    let change = parse_change(&body)?.unwrap_or_default();
    if change.mix.is_some() || change.rate.is_some() {
        // Applied to the stopped lanes first: the run starts with them.
        app.configure(WorkloadChange {
            concurrency: None,
            ..change
        })
        .await?;
    }
    app.start(change.concurrency).await.map(axum::Json)
}

async fn post_stop(State(app): State<Arc<App>>) -> Result<axum::Json<Status>, ApiError> {
    // The cycle needs a running workload: stopping it ends auto mode.
    if app.scenario.mode() == crate::scenario::Mode::Auto {
        app.scenario.manual().await;
    }
    app.stop().await.map(axum::Json)
}

/// `POST /api/scenario/auto`, optionally `{"phase": "NAME"}`: starts the cycle (and the
/// workload), pausing the autoscalers.
async fn post_scenario_auto(
    State(app): State<Arc<App>>,
    body: Bytes,
) -> Result<axum::Json<Status>, ApiError> {
    app.refuse_in_trace_mode()?;
    let phase = if body.iter().all(u8::is_ascii_whitespace) {
        None
    } else {
        let value: serde_json::Value = serde_json::from_slice(&body).map_err(|e| {
            ApiError::bad_request(
                "invalid_json",
                format!("expected no body or a JSON object like {{\"phase\": \"BALANCED\"}}: {e}"),
            )
        })?;
        let serde_json::Value::Object(fields) = value else {
            return Err(ApiError::bad_request(
                "invalid_json",
                "expected a JSON object like {\"phase\": \"BALANCED\"}",
            ));
        };
        let mut phase = None;
        for (key, value) in fields {
            match (key.as_str(), value) {
                ("phase", serde_json::Value::Null) => {}
                ("phase", serde_json::Value::String(name)) => {
                    app.scenario
                        .check_phase(&name)
                        .map_err(|e| bad_field("phase", e))?;
                    phase = Some(name);
                }
                ("phase", other) => {
                    let names: Vec<&str> = app
                        .scenario
                        .config()
                        .scenario
                        .phases
                        .iter()
                        .map(|p| p.name.as_str())
                        .collect();
                    return Err(bad_field(
                        "phase",
                        format!(
                            "phase: expected the name of a phase ({}), got {other}",
                            names.join(", ")
                        ),
                    ));
                }
                (other, _) => {
                    return Err(ApiError::bad_request(
                        "invalid_json",
                        format!("unknown field `{other}`: expected phase"),
                    ));
                }
            }
        }
        phase
    };
    app.scenario.auto(phase).await;
    Ok(axum::Json(app.publish(false)))
}

/// `POST /api/phase {"phase": "eagle3"}`: seed 003's ladder (`App::switch_phase`).
async fn post_phase(
    State(app): State<Arc<App>>,
    body: Bytes,
) -> Result<axum::Json<Status>, ApiError> {
    let names = || {
        app.ladder
            .as_ref()
            .map_or("baseline, kv, draft, eagle3".to_owned(), |l| {
                l.names().join(", ")
            })
    };
    let value: serde_json::Value = serde_json::from_slice(&body).map_err(|e| {
        ApiError::bad_request(
            "invalid_json",
            format!("expected a JSON object like {{\"phase\": \"eagle3\"}}: {e}"),
        )
    })?;
    let serde_json::Value::Object(fields) = value else {
        return Err(ApiError::bad_request(
            "invalid_json",
            "expected a JSON object like {\"phase\": \"eagle3\"}",
        ));
    };
    let mut phase = None;
    for (key, value) in fields {
        match (key.as_str(), value) {
            ("phase", serde_json::Value::String(name)) => phase = Some(name),
            ("phase", other) => {
                return Err(bad_field(
                    "phase",
                    format!("phase: expected a phase's name ({}), got {other}", names()),
                ));
            }
            (other, _) => {
                return Err(ApiError::bad_request(
                    "invalid_json",
                    format!("unknown field `{other}`: expected phase"),
                ));
            }
        }
    }
    let Some(phase) = phase else {
        return Err(ApiError::bad_request(
            "missing_field",
            format!(
                "the body names no phase: expected {{\"phase\": NAME}} with NAME one of {}",
                names()
            ),
        ));
    };
    app.switch_phase(&phase).await.map(axum::Json)
}

/// `POST /api/scenario/stop` and `/api/scenario/manual`: the cycle stops (the workload keeps
/// its mix and rate), the autoscalers resume.
async fn post_scenario_manual(State(app): State<Arc<App>>) -> axum::Json<Status> {
    app.scenario.manual().await;
    axum::Json(app.publish(false))
}

async fn post_config(
    State(app): State<Arc<App>>,
    body: Bytes,
) -> Result<axum::Json<Status>, ApiError> {
    let change = match parse_change(&body)? {
        None => {
            return Err(ApiError::bad_request(
                "missing_body",
                format!("expected a JSON body like {BODY_EXAMPLE}"),
            ));
        }
        Some(c) if c == WorkloadChange::default() => {
            return Err(ApiError::bad_request(
                "missing_field",
                "the body sets none of concurrency, mix and rate",
            ));
        }
        Some(c) => c,
    };
    app.configure(change).await.map(axum::Json)
}

async fn get_baseline(State(app): State<Arc<App>>) -> Result<Response, ApiError> {
    let baseline = app
        .baseline
        .as_ref()
        .ok_or_else(|| ApiError::not_found("no_baseline", "no baseline results are loaded"))?;
    #[derive(Serialize)]
    struct Body<'a> {
        #[serde(flatten)]
        baseline: &'a Baseline,
        slo: Slo,
    }
    Ok(axum::Json(Body {
        baseline,
        slo: app.slo,
    })
    .into_response())
}

async fn get_history(State(app): State<Arc<App>>) -> Response {
    #[derive(Serialize)]
    struct LaneHistory<'a> {
        name: &'a str,
        points: &'a VecDeque<HistoryPoint>,
    }
    #[derive(Serialize)]
    struct Body<'a> {
        interval_s: f64,
        lanes: Vec<LaneHistory<'a>>,
    }
    let history = app.history.lock().unwrap_or_else(|e| e.into_inner());
    let body = Body {
        interval_s: HISTORY_INTERVAL_S,
        lanes: app
            .lanes
            .iter()
            .zip(history.iter())
            .map(|(lane, points)| LaneHistory {
                name: &lane.spec.name,
                points,
            })
            .collect(),
    };
    axum::Json(body).into_response()
}

#[derive(Serialize)]
struct ConversationSummary {
    id: String,
    lane: String,
    status: ConversationStatus,
    topic: Arc<str>,
    turns_done: u32,
    turns_planned: u32,
    duration_s: f64,
    started_at_ms: u64,
}

fn summary(
    lane_index: usize,
    lane: &str,
    record: &ConversationRecord,
    now_s: f64,
) -> ConversationSummary {
    ConversationSummary {
        id: format!("{lane_index}-{}", record.number),
        lane: lane.to_owned(),
        status: record.status,
        topic: record.topic.clone(),
        turns_done: record.turns_done(),
        turns_planned: record.turns_planned,
        duration_s: record.duration_s(now_s),
        started_at_ms: record.started_at_ms,
    }
}

#[derive(Deserialize)]
struct ListQuery {
    lane: Option<String>,
    limit: Option<usize>,
}

async fn get_conversations(
    State(app): State<Arc<App>>,
    Query(query): Query<ListQuery>,
) -> Result<Response, ApiError> {
    let limit = query.limit.unwrap_or(200).min(5_000);
    if let Some(name) = &query.lane {
        if !app.lanes.iter().any(|l| &l.spec.name == name) {
            return Err(ApiError::not_found(
                "unknown_lane",
                format!("no lane named {name:?}"),
            ));
        }
    }
    let mut list = Vec::new();
    let (mut kept, mut total) = (0usize, 0u64);
    for (i, lane) in app.lanes.iter().enumerate() {
        if query.lane.as_ref().is_some_and(|n| n != &lane.spec.name) {
            continue;
        }
        let s = lock(&lane.state);
        let now_s = s.now_s();
        kept += s.store.len();
        total += s.store.total();
        list.extend(
            s.store
                .newest(limit)
                .map(|r| summary(i, &lane.spec.name, r, now_s)),
        );
    }
    // Newest first across lanes; the same conversation number of two lanes side by side.
    list.sort_by(|a, b| {
        b.started_at_ms
            .cmp(&a.started_at_ms)
            .then_with(|| a.id.cmp(&b.id))
    });
    list.truncate(limit);
    Ok(axum::Json(serde_json::json!({
        "conversations": list,
        "kept": kept,
        "total": total,
    }))
    .into_response())
}

async fn get_conversation(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let not_found = || {
        ApiError::not_found(
            "not_found",
            format!("no conversation {id:?} (kept ones only)"),
        )
    };
    let (lane_index, number) = id
        .split_once('-')
        .and_then(|(l, n)| Some((l.parse::<usize>().ok()?, n.parse::<u64>().ok()?)))
        .ok_or_else(not_found)?;
    let lane = app.lanes.get(lane_index).ok_or_else(not_found)?;
    let s = lock(&lane.state);
    let record = s.store.get(number).ok_or_else(not_found)?;
    #[derive(Serialize)]
    struct Detail<'a> {
        #[serde(flatten)]
        summary: ConversationSummary,
        system: String,
        turns: &'a [TurnRecord],
    }
    let system = app
        .system_excerpts
        .get(record.passage)
        .cloned()
        .unwrap_or_default();
    let body = serde_json::to_value(Detail {
        summary: summary(lane_index, &lane.spec.name, record, s.now_s()),
        system,
        turns: &record.turns,
    })
    .unwrap_or_default();
    Ok(axum::Json(body).into_response())
}

async fn ws(State(app): State<Arc<App>>, upgrade: WebSocketUpgrade) -> Response {
    upgrade.on_upgrade(move |socket| ws_session(app, socket))
}

async fn ws_session(app: Arc<App>, mut socket: WebSocket) {
    let mut updates = app.status.subscribe();
    // The first message at once: the UI enables its buttons on it.
    let first = updates.borrow_and_update().clone();
    if socket
        .send(Message::Text(first.as_ref().into()))
        .await
        .is_err()
    {
        return;
    }
    loop {
        tokio::select! {
            changed = updates.changed() => {
                if changed.is_err() {
                    return;
                }
                let json = updates.borrow_and_update().clone();
                if socket.send(Message::Text(json.as_ref().into())).await.is_err() {
                    return;
                }
            }
            incoming = socket.recv() => match incoming {
                Some(Ok(Message::Close(_))) | None | Some(Err(_)) => return,
                Some(Ok(_)) => {}
            }
        }
    }
}

/// A Prometheus summary family: one series per lane, quantiles over the window.
struct SummaryFamily {
    name: &'static str,
    help: &'static str,
    /// The window's quantiles (in the unit of `scale`) and the total (sum, count).
    read: fn(&LaneMetrics, &Totals) -> (Option<Percentiles>, f64, u64),
    /// To seconds.
    scale: f64,
}

const SUMMARIES: [SummaryFamily; 4] = [
    SummaryFamily {
        name: "loadgen_ttft_all_seconds",
        help: "Time to first token, client side (60 s window)",
        read: |m, t| (m.ttft_ms, t.ttft_sum_s, t.requests),
        scale: 1e-3,
    },
    SummaryFamily {
        name: "loadgen_tpot_all_seconds",
        help: "Time per output token, (E2E - TTFT) / (tokens - 1) (60 s window)",
        read: |m, t| (m.tpot_ms, t.tpot_sum_s, t.tpot_count),
        scale: 1e-3,
    },
    SummaryFamily {
        name: "loadgen_itl_all_seconds",
        help: "Inter-token latency as the client sees it, (last - first chunk) / (tokens - 1) per turn (60 s window)",
        read: |m, t| (m.itl_ms, t.itl_sum_s, t.itl_count),
        scale: 1e-3,
    },
    SummaryFamily {
        name: "loadgen_e2e_all_seconds",
        help: "Request latency, send to the last token (60 s window)",
        read: |m, t| (m.e2e_s, t.e2e_sum_s, t.requests),
        scale: 1.0,
    },
];

async fn metrics(State(app): State<Arc<App>>) -> Response {
    let status = app.status();
    let lanes: Vec<(String, &LaneMetrics, Totals)> = app
        .lanes
        .iter()
        .zip(&status.lanes)
        .map(|(lane, ls)| {
            (
                escape_label(&lane.spec.name),
                &ls.metrics,
                lock(&lane.state).totals,
            )
        })
        .collect();
    let mut out = String::new();
    for family in &SUMMARIES {
        let name = family.name;
        let _ = writeln!(out, "# HELP {name} {}.\n# TYPE {name} summary", family.help);
        for (lane, metrics, totals) in &lanes {
            let (window, sum, count) = (family.read)(metrics, totals);
            for (quantile, value) in [
                ("0.5", window.and_then(|q| q.p50).map(|v| v * family.scale)),
                ("0.95", window.and_then(|q| q.p95).map(|v| v * family.scale)),
            ] {
                // No observation in the window: NaN, as Prometheus client libraries write it.
                let value = value.map_or("NaN".to_owned(), |v| v.to_string());
                let _ = writeln!(
                    out,
                    "{name}{{lane=\"{lane}\",quantile=\"{quantile}\"}} {value}"
                );
            }
            let _ = writeln!(out, "{name}_sum{{lane=\"{lane}\"}} {sum}");
            let _ = writeln!(out, "{name}_count{{lane=\"{lane}\"}} {count}");
        }
    }
    let mut family =
        |name: &str, kind: &str, help: &str, value: &dyn Fn(&LaneMetrics, &Totals) -> f64| {
            let _ = writeln!(out, "# HELP {name} {help}.\n# TYPE {name} {kind}");
            for (lane, metrics, totals) in &lanes {
                let _ = writeln!(out, "{name}{{lane=\"{lane}\"}} {}", value(metrics, totals));
            }
        };
    family(
        "loadgen_requests_total",
        "counter",
        "Turns completed",
        &|_, t| t.requests as f64,
    );
    family(
        "loadgen_errors_total",
        "counter",
        "Turns failed",
        &|_, t| t.errors as f64,
    );
    family(
        "loadgen_output_tokens_total",
        "counter",
        "Output tokens received",
        &|_, t| t.output_tokens as f64,
    );
    family(
        "loadgen_in_flight_requests",
        "gauge",
        "Requests in flight",
        &|m, _| m.in_flight as f64,
    );
    family(
        "loadgen_active_conversations",
        "gauge",
        "Open conversations",
        &|m, _| f64::from(m.active_conversations),
    );
    let target = f64::from(status.concurrency);
    family(
        "loadgen_target_concurrency",
        "gauge",
        "Target open conversations",
        &|_, _| target,
    );
    // One series per phase of the cycle and one for manual mode, 1 on the current one: a
    // phase's series never goes stale, so `max by (phase)` reads the phase at any time.
    let name = "loadgen_scenario_phase";
    let _ = writeln!(
        out,
        "# HELP {name} Seed 004's auto-mode phase (1: the current one; IDLE: manual mode).\n\
         # TYPE {name} gauge"
    );
    let phases = app
        .scenario
        .phase_names()
        .chain([workload::scenario::IDLE_PHASE]);
    for phase in phases {
        let current = u8::from(phase == status.scenario.phase);
        let _ = writeln!(out, "{name}{{phase=\"{}\"}} {current}", escape_label(phase));
    }
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        out,
    )
        .into_response()
}

fn escape_label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

async fn asset(uri: axum::http::Uri) -> Response {
    let path = match uri.path() {
        "/" => "/index.html",
        p => p,
    };
    match assets::ASSETS.iter().find(|(p, _)| *p == path) {
        Some((p, bytes)) => {
            let kind = match p.rsplit('.').next() {
                Some("html") => "text/html; charset=utf-8",
                Some("css") => "text/css; charset=utf-8",
                Some("js") => "text/javascript; charset=utf-8",
                Some("svg") => "image/svg+xml",
                Some("png") => "image/png",
                Some("json") => "application/json",
                _ => "application/octet-stream",
            };
            (
                [
                    (header::CONTENT_TYPE, kind),
                    (header::CACHE_CONTROL, "no-cache"),
                ],
                *bytes,
            )
                .into_response()
        }
        None => (StatusCode::NOT_FOUND, "not found").into_response(),
    }
}

/// Recomputes and pushes the status every [`STATUS_INTERVAL`], keeping a chart point every
/// [`HISTORY_INTERVAL_S`].
pub async fn status_loop(app: Arc<App>, shutdown: CancellationToken) {
    let mut ticker = tokio::time::interval(STATUS_INTERVAL);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut tick: u64 = 0;
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = ticker.tick() => {}
        }
        tick += 1;
        let running = app.is_running();
        app.publish(running && tick % 2 == 0);
    }
}
