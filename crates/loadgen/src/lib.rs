//! The load generator and its live web dashboard (real time).
//!
//! It drives seed 002's multi-turn chat workload (the sans-IO [`workload::ChatWorkload`], the
//! same conversations `kvroute sim` runs) against any OpenAI-compatible endpoint: each turn
//! is a streamed `/v1/chat/completions` request carrying the whole conversation so far, and
//! the client measures TTFT, TPOT, ITL, end-to-end latency and output tokens. It holds a
//! target number of open conversations, changeable live; keeps 60-second sliding windows
//! (p50/p95, RPS, TOPS); reads the KV cache hit rate and queue from the gateway's
//! Dynamo-named metrics and the GPU view from the workers' DCGM-style metrics; keeps recent
//! conversations with their transcripts; and serves the control API (seed 004's names:
//! `docs/LOADGEN-API.md`), a WebSocket of status updates, Prometheus summaries
//! (`loadgen_ttft_all_seconds`, `loadgen_tpot_all_seconds`, … as seed 001's Grafana reads
//! them) and the web UI of seed 001, embedded from `web/` at build time.
//!
//! Seed 004's mix and rate: the workload can also mix in single-turn summarisation (B) and
//! reasoning (C) sessions and run open-loop (sessions arriving Poisson at a rate) instead of
//! at a constant concurrency; `--mix`, `--rate` and `POST /api/workload/config` set them, the
//! status shows them and the sessions started per workload.
//!
//! Several **lanes** (targets) can be driven at once with the same seed, so they receive the
//! same conversations: `kvroute demo --compare round_robin,kv` uses two.
//!
//! The simulated user is built in (the workload's own questions, in its text form
//! [`workload::TextContent`]: the text whose tokens `kvroute sim` sends) or an
//! OpenAI-compatible "user model" ([`UserSimulator::Model`]) that writes the follow-ups.
//!
//! # Invariants and bounds
//!
//! - One task per lane owns the workload; per-turn request tasks never block it (their ends
//!   come back over a bounded channel, one outcome per open conversation at most).
//! - Open conversations are bounded by the concurrency (≤ [`MAX_CONCURRENCY`]), or in the open
//!   loop by the workload's `max_open` (arrivals beyond it are refused and counted); ended ones kept
//!   for the UI by `conversations_kept`; a reply's text by `max_reply_text`; the window by
//!   time and by a sample cap; chart points by 15 minutes; scraped bodies by 8 MiB.
//! - Stop cancels every request in flight; their conversations are marked `stopped`.
//!
//! # Example
//!
//! ```no_run
//! # async fn demo() -> Result<(), loadgen::LoadgenError> {
//! use loadgen::{LaneSpec, Loadgen, LoadgenConfig};
//!
//! let lane = LaneSpec::for_gateway("live", None, "http://127.0.0.1:8000", "llama");
//! let config = LoadgenConfig::new(vec![lane]);
//! let loadgen = Loadgen::bind(config).await?;
//! println!("dashboard: {}", loadgen.url());
//! loadgen.app().start(Some(120)).await.ok();
//! # Ok(()) }
//! ```

mod access;
mod baseline;
mod client;
pub mod ladder;
mod lane;
mod poll;
mod reference;
pub mod scenario;
mod scrape;
mod server;
mod store;
pub mod trace;
pub mod trace_run;
mod window;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use workload::Assets;

pub use baseline::{Baseline, BaselineError, BaselineLevel, BaselineRow};
pub use client::{TurnError, TurnResult};
pub use lane::{DriveConfig, LaneSpec, UserSimulator};
pub use reference::{
    PhaseLevel, PhaseLine, PhaseReference, ReferenceError, ReferenceStatus, SHIPPED_PHASES,
};
pub use scenario::{Fleet, ScalingConfig};
pub use scrape::{Sample, SpecPoint, parse_text};
pub use server::{ApiError, App, LaneMetrics, LaneStatus, Status};

/// The largest concurrency the API accepts per lane.
pub const MAX_CONCURRENCY: u32 = 20_000;

/// The dashboard's concurrency slider (seed 001: 60–180 in steps of 20).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Slider {
    pub min: u32,
    pub max: u32,
    pub step: u32,
}

impl Default for Slider {
    fn default() -> Self {
        Slider {
            min: 60,
            max: 180,
            step: 20,
        }
    }
}

/// The service-level objectives the dashboard colours against (seed 001).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Slo {
    pub ttft_p95_ms: f64,
    pub tpot_p95_ms: f64,
}

impl Default for Slo {
    fn default() -> Self {
        Slo {
            ttft_p95_ms: 600.0,
            tpot_p95_ms: 60.0,
        }
    }
}

impl LaneSpec {
    /// A lane sending to a kvroute (or Dynamo) gateway at `target`, reading its `/metrics`.
    pub fn for_gateway(name: &str, router: Option<&str>, target: &str, model: &str) -> LaneSpec {
        let target = target.trim_end_matches('/').to_owned();
        LaneSpec {
            name: name.to_owned(),
            router: router.map(str::to_owned),
            gateway_metrics: Some(format!("{target}/metrics")),
            target,
            model: model.to_owned(),
            api_key: None,
            worker_metrics: Vec::new(),
            prometheus: None,
        }
    }
}

/// Everything the load generator needs.
#[derive(Clone, Debug)]
pub struct LoadgenConfig {
    /// Where the UI and the API listen (port 0 picks one).
    pub listen: SocketAddr,
    pub lanes: Vec<LaneSpec>,
    pub drive: DriveConfig,
    /// The RR columns and static table; `None` hides them.
    pub baseline: Option<Baseline>,
    /// Reference lines of seed 003's phase ladder on the ITL and TTFT charts (`None`: none).
    pub phase_reference: Option<PhaseReference>,
    pub slider: Slider,
    pub slo: Slo,
    /// Start the workload at once instead of waiting for Start.
    pub autostart: bool,
    /// Seed 004's scenario (auto mode), the pools' autoscalers (manual mode) and the fleet
    /// they resize.
    pub scaling: ScalingConfig,
    /// The bearer token of the control API and the WebSocket (`access.rs`); required when
    /// `listen` is not a loopback address.
    pub api_token: Option<String>,
    /// Seed 003's phase ladder on a cluster the load generator may restart (`kvroute demo`);
    /// `None`: `POST /api/phase` answers 409.
    pub ladder: Option<ladder::LadderConfig>,
    /// A trace to replay instead of the chat workload (`kvroute loadgen --trace`): Start and
    /// Stop act on it, `status.trace` shows it, the first lane's cards and charts follow it.
    pub trace: Option<trace_run::TraceSetup>,
    /// Most client connections (the WebSocket's included) the UI and API serve at once; past
    /// it, 503 `too_many_connections` (`protocol::listener`). `None`: what the open-file limit
    /// allows.
    pub max_connections: Option<usize>,
    /// How long a client may take to send a request's headers, or the next request on an idle
    /// keep-alive connection, before the UI and API server closes it (default 30 s).
    pub header_timeout: Duration,
    /// How long a client may take to send a whole request body: 408 after it (default 30 s).
    pub body_timeout: Duration,
}

impl LoadgenConfig {
    /// Defaults: 127.0.0.1:8080, concurrency 60, the shipped baseline, not started.
    pub fn new(lanes: Vec<LaneSpec>) -> LoadgenConfig {
        LoadgenConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            lanes,
            drive: DriveConfig::default(),
            baseline: Baseline::shipped().ok(),
            phase_reference: None,
            slider: Slider::default(),
            slo: Slo::default(),
            autostart: false,
            scaling: ScalingConfig::default(),
            api_token: None,
            ladder: None,
            trace: None,
            max_connections: None,
            header_timeout: Duration::from_secs(30),
            body_timeout: Duration::from_secs(30),
        }
    }
}

/// Why the load generator could not start.
#[derive(Debug, thiserror::Error)]
pub enum LoadgenError {
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("workload: {0}")]
    Workload(#[from] workload::WorkloadError),
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("HTTP client: {0}")]
    Http(String),
    #[error("starting the workload: {0}")]
    Start(String),
}

/// A running load generator: lanes, scrapers, the status publisher and the HTTP server.
pub struct Loadgen {
    local_addr: SocketAddr,
    app: Arc<App>,
    shutdown: CancellationToken,
    server: JoinHandle<()>,
}

impl Loadgen {
    pub async fn bind(config: LoadgenConfig) -> Result<Loadgen, LoadgenError> {
        if config.lanes.is_empty() {
            return Err(LoadgenError::Config("at least one target is needed".into()));
        }
        let mut names: Vec<&str> = config.lanes.iter().map(|l| l.name.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        if names.len() != config.lanes.len() {
            return Err(LoadgenError::Config("lane names must differ".into()));
        }
        let concurrency = config.drive.workload.concurrency;
        if !(1..=MAX_CONCURRENCY).contains(&concurrency) {
            return Err(LoadgenError::Config(format!(
                "concurrency must be between 1 and {MAX_CONCURRENCY}, got {concurrency}"
            )));
        }
        config.drive.workload.validate()?;
        if !(config.drive.time_scale.is_finite() && config.drive.time_scale > 0.0) {
            return Err(LoadgenError::Config(format!(
                "the time scale (speedup) must be a positive number, got {}",
                config.drive.time_scale
            )));
        }
        if config.drive.request_timeout.is_zero() {
            return Err(LoadgenError::Config(
                "the request timeout must be positive".into(),
            ));
        }
        if let Some(trace) = &config.trace {
            if config.scaling.auto {
                return Err(LoadgenError::Config(
                    "a trace replay sets its own load: seed 004's auto mode does not apply".into(),
                ));
            }
            if trace.replay.max_open == 0 {
                return Err(LoadgenError::Config(
                    "the trace replay needs at least one request in flight (max_open)".into(),
                ));
            }
        }
        let loopback = config.listen.ip().is_loopback();
        match config.api_token.as_deref() {
            Some(token) if token.trim().is_empty() || token.chars().any(char::is_whitespace) => {
                return Err(LoadgenError::Config(
                    "the API token must be non-empty and contain no spaces".into(),
                ));
            }
            None if !loopback => {
                return Err(LoadgenError::Config(format!(
                    "{} is not a loopback address: anyone who reaches it could start and stop \
                     the workload. Set a token with --api-token TOKEN or KVROUTE_API_TOKEN=TOKEN \
                     (then open the dashboard as http://HOST:PORT/?token=TOKEN), or listen on \
                     127.0.0.1",
                    config.listen.ip()
                )));
            }
            _ => {}
        }
        let scenario =
            scenario::ScenarioHandle::new(config.scaling.clone(), config.drive.time_scale)
                .map_err(LoadgenError::Config)?;
        let assets = Assets::builtin().map_err(workload::WorkloadError::from)?;
        let http = reqwest::Client::builder()
            // One connection per request in flight: a turn is one long stream.
            .pool_max_idle_per_host(MAX_CONCURRENCY as usize)
            .tcp_nodelay(true)
            .build()
            .map_err(|e| LoadgenError::Http(e.to_string()))?;
        let listener = tokio::net::TcpListener::bind(config.listen)
            .await
            .map_err(|source| LoadgenError::Bind {
                addr: config.listen,
                source,
            })?;
        let local_addr = listener.local_addr().map_err(|source| LoadgenError::Bind {
            addr: config.listen,
            source,
        })?;
        let shutdown = CancellationToken::new();
        let drive = Arc::new(config.drive.clone());
        let lanes = config
            .lanes
            .iter()
            .map(|spec| {
                lane::Lane::spawn(
                    spec.clone(),
                    drive.clone(),
                    assets.clone(),
                    http.clone(),
                    shutdown.clone(),
                )
            })
            .collect();
        let system_excerpts = (0..assets.corpus().len())
            .map(|p| {
                let text = assets
                    .system_message(&config.drive.workload.system_prompt, p)
                    .content;
                let mut excerpt: String = text.chars().take(400).collect();
                if excerpt.len() < text.len() {
                    excerpt.push('…');
                }
                excerpt
            })
            .collect();
        let mut app = App::new(
            lanes,
            config.baseline.clone(),
            config.slider,
            config.slo,
            config.drive.window.as_secs_f64(),
            concurrency,
            system_excerpts,
            scenario,
        );
        app.references = config.phase_reference.clone();
        app.ladder = match config.ladder.clone() {
            Some(ladder) => Some(ladder::LadderHandle::new(ladder).map_err(LoadgenError::Config)?),
            None => None,
        };
        app.trace = config.trace.clone().map(trace_run::TraceHandle::new);
        let app = Arc::new(app);
        app.publish(false);
        tokio::spawn(server::status_loop(app.clone(), shutdown.clone()));
        tokio::spawn(scenario::run(
            app.clone(),
            http.clone(),
            config.lanes[0].gateway_metrics.clone(),
            shutdown.clone(),
        ));
        let router = server::router(
            app.clone(),
            access::Access::new(config.api_token.as_deref(), loopback, config.body_timeout),
        );
        let stop = shutdown.clone();
        let max_connections = config
            .max_connections
            .unwrap_or_else(protocol::listener::default_max_connections);
        // The gateway's and engine's listener: header and idle deadlines, the connection
        // bound (the WebSocket counts until it closes), JSON for every refusal.
        let server = tokio::spawn(protocol::listener::serve_with_limit(
            listener,
            router,
            config.header_timeout,
            max_connections,
            async move { stop.cancelled().await },
        ));
        if config.autostart {
            app.start(Some(concurrency))
                .await
                .map_err(|e| LoadgenError::Start(e.0.message().to_owned()))?;
        }
        if config.scaling.auto {
            app.scenario.auto(None).await;
        }
        Ok(Loadgen {
            local_addr,
            app,
            shutdown,
            server,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// `http://ADDR` of the UI and API.
    pub fn url(&self) -> String {
        format!("http://{}", self.local_addr)
    }

    /// The lanes and the control operations (start, stop, concurrency), as the API uses them.
    pub fn app(&self) -> &Arc<App> {
        &self.app
    }

    /// Stops the workload (cancelling requests in flight) and the server.
    pub async fn shutdown(self) {
        let _ = self.app.stop().await;
        self.shutdown.cancel();
        let _ = self.server.await;
    }
}
