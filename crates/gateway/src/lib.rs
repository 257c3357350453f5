//! The OpenAI-compatible gateway: preprocessing, KV-aware routing, streaming relay, metrics.
//!
//! This is the real-time driver of the `router` core (seed 002's frontend + router):
//!
//! 1. A client calls `POST /v1/chat/completions` or `POST /v1/completions` (streaming SSE or
//!    not). The gateway applies the chat template and tokenizes **once**
//!    ([`preprocess::Preprocessor`]), hashes the prompt into KV blocks and asks the router for
//!    a worker ([`dispatch::Dispatcher`]). When every worker is at its in-flight cap, the
//!    request waits in a bounded FIFO queue (429 when full, 503 after a timeout).
//! 2. The request goes to the worker's `/v1/completions` as token ids (or as text, per
//!    worker), always streamed with usage; the [`relay`] turns the worker's stream into chat
//!    chunks or completion chunks (or one aggregated response) and tells the router about the
//!    first token and the end. A client that disconnects drops the upstream response, which
//!    cancels the worker's request.
//! 3. Workers' KV events arrive in-process ([`Gateway::kv_event_sink`]), over NATS (our
//!    format) or over ZMQ (vLLM's format) and update the router's prefix index; a sequence gap
//!    clears that worker's blocks and is counted as a resync ([`events`]).
//! 4. Workers are static (`--worker URL`, described by their `/info` or by flags) or announce
//!    themselves over NATS with a lease ([`registry`]). Health checks and failed requests move
//!    workers out of the routing set, which drops their blocks from the index.
//! 5. `GET /metrics` exports Dynamo's metric names and labels ([`metrics`]).
//! 6. With NATS, the gateway is one of several replicas behind one address ([`replicas`]):
//!    replicas share their routing decisions and completions, so each one counts the load
//!    its peers put on the workers (`--no-replica-sync` turns it off).
//!
//! **Invariants.** Every queue and map is bounded: the frontend queue by
//! `frontend.queue_capacity`, the worker table by `max_workers`, request bodies by `max_body_bytes`,
//! SSE lines by the decoder's 1 MiB, NATS subscriptions by async-nats' buffer (overflow shows
//! up as a sequence gap, then a resync), the index by the router's `IndexConfig`. Every error
//! a client sees is OpenAI's error JSON with a meaningful status. The router lock is held only
//! for short, non-blocking sections; no `.await` happens under it.
//!
//! ```no_run
//! # async fn demo() -> Result<(), gateway::GatewayError> {
//! use gateway::{Gateway, GatewayConfig, WorkerSpec};
//!
//! let config = GatewayConfig {
//!     listen: "127.0.0.1:0".parse().unwrap(),
//!     model: "llama".into(),
//!     workers: vec![WorkerSpec::new("http://127.0.0.1:9001")],
//!     ..GatewayConfig::default()
//! };
//! let gateway = Gateway::bind(config).await?;
//! println!("serving on {}", gateway.url());
//! gateway.shutdown().await;
//! # Ok(())
//! # }
//! ```

pub mod config;
pub mod dispatch;
pub mod events;
pub mod metrics;
pub mod preprocess;
pub mod rate_limit;
pub mod registry;
pub mod relay;
pub mod replicas;
mod server;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use config::{GatewayConfig, PromptFormat, ReplicaSettings, Timeouts, WorkerSpec};
pub use dispatch::Dispatcher;
pub use events::KvEventSink;
pub use metrics::Metrics;
pub use registry::WorkerInfo;
/// Admission settings ([`GatewayConfig::frontend`]), the router crate's.
pub use router::FrontendConfig;

use crate::events::ZmqSubscriptions;
use crate::registry::RegistryCtx;

/// Why the gateway could not start.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    #[error("invalid configuration: {0}")]
    Config(String),
    // The cause is in the message, not a `source` too, so an error chain prints it once.
    #[error("router: {0}")]
    Router(router::RouterConfigError),
    #[error("tokenizer or chat template: {0}")]
    Preprocess(#[from] preprocess::PreprocessError),
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error(transparent)]
    Nats(protocol::nats_client::NatsConnectError),
    #[error("NATS, once connected, refused a subscription or request: {0}")]
    NatsSubscribe(String),
    #[error("worker {url}: {source}")]
    Worker {
        url: String,
        source: dispatch::RegistryError,
    },
    #[error("HTTP client: {0}")]
    Http(#[from] reqwest::Error),
}

impl From<router::RouterConfigError> for GatewayError {
    fn from(e: router::RouterConfigError) -> Self {
        GatewayError::Router(e)
    }
}

/// A running gateway. Dropping it stops its background tasks; [`Gateway::shutdown`] also
/// lets in-flight requests finish (for a few seconds).
#[derive(Debug)]
pub struct Gateway {
    local_addr: SocketAddr,
    dispatcher: Arc<Dispatcher>,
    metrics: Arc<Metrics>,
    cancel: CancellationToken,
    server: Option<JoinHandle<()>>,
    tasks: Vec<JoinHandle<()>>,
    zmq: Arc<ZmqSubscriptions>,
    registry: RegistryCtx,
    block_size_source: BlockSizeSource,
    replica: Option<replicas::ReplicaLink>,
}

/// Where the router's KV block size came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockSizeSource {
    /// The configuration (`--kv-block-size`).
    Flag,
    /// The static workers, which agreed.
    Workers,
    /// No worker declared one: the default.
    Default,
}

/// How long [`Gateway::shutdown`] waits for in-flight requests.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

impl Gateway {
    /// Starts a gateway: loads the tokenizer and template, registers the static workers,
    /// connects to NATS when configured, and listens on `config.listen` (port 0 picks one).
    pub async fn bind(config: GatewayConfig) -> Result<Gateway, GatewayError> {
        if config.context_length == 0 {
            return Err(GatewayError::Config(
                "--context-length must be at least 1".into(),
            ));
        }
        if config.model.is_empty() {
            return Err(GatewayError::Config("--model must not be empty".into()));
        }
        let subjects = match &config.nats_url {
            Some(_) => Some(
                protocol::Subjects::new(&config.namespace)
                    .map_err(|e| GatewayError::Config(e.to_string()))?,
            ),
            None => None,
        };
        let (tokenizer, template) = (config.tokenizer.clone(), config.tokenizer_config.clone());
        let preprocessor = tokio::task::spawn_blocking(move || {
            preprocess::load(tokenizer.as_deref(), template.as_deref())
        })
        .await
        .map_err(|e| GatewayError::Config(format!("loading the tokenizer panicked: {e}")))??;

        let http = reqwest::Client::builder()
            .connect_timeout(config.timeouts.connect)
            .pool_max_idle_per_host(4096)
            .tcp_nodelay(true)
            .build()?;
        // Every static worker is probed once, before the router exists: its block size may
        // be the router's.
        let probe_all = || {
            futures::future::join_all(
                config
                    .workers
                    .iter()
                    .map(|spec| registry::probe_info(&http, &spec.url, config.probe_timeout)),
            )
        };
        let mut probes = probe_all().await;
        // Workers started with the gateway may not listen yet: rather than pick a default
        // block size a worker then contradicts, give them a while to answer.
        let deadline = tokio::time::Instant::now() + config.block_size_wait;
        let none_up = |probes: &[registry::Probe]| {
            !probes.is_empty() && probes.iter().all(|p| matches!(p, registry::Probe::Down(_)))
        };
        if config.block_size_from_workers && none_up(&probes) {
            // Said at once and once: the gateway does not listen while it waits.
            let why = probes.iter().find_map(|p| match p {
                registry::Probe::Down(why) => Some(why.as_str()),
                _ => None,
            });
            tracing::warn!(
                wait_s = config.block_size_wait.as_secs_f64(),
                first = ?config.workers.first().map(|w| &w.url),
                why = why.unwrap_or_default(),
                "no worker answers /info yet; waiting for one to learn the KV block size \
                 before listening (--kv-block-size N starts at once)"
            );
        }
        while config.block_size_from_workers
            && none_up(&probes)
            && tokio::time::Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(500)).await;
            probes = probe_all().await;
        }
        let mut config = config;
        let block_size_source = if config.block_size_from_workers {
            match registry::agreed_block_size(&config.workers, &probes)
                .map_err(GatewayError::Config)?
            {
                Some(size) => {
                    config.router.block_size = size;
                    BlockSizeSource::Workers
                }
                None => BlockSizeSource::Default,
            }
        } else {
            BlockSizeSource::Flag
        };
        let dispatcher = Dispatcher::new(&config)?;
        let weak = Arc::downgrade(&dispatcher);
        let metrics = Arc::new(Metrics::new(&config.model, move || {
            weak.upgrade().map(|d| d.snapshot()).unwrap_or_default()
        }));
        dispatcher.set_metrics(metrics.clone());

        let listener = tokio::net::TcpListener::bind(config.listen)
            .await
            .map_err(|source| GatewayError::Bind {
                addr: config.listen,
                source,
            })?;
        let local_addr = listener.local_addr().map_err(|source| GatewayError::Bind {
            addr: config.listen,
            source,
        })?;

        let cancel = CancellationToken::new();
        let zmq = Arc::new(ZmqSubscriptions::default());
        let registry = RegistryCtx {
            dispatcher: dispatcher.clone(),
            statics: Arc::default(),
            http: http.clone(),
            zmq: zmq.clone(),
            cancel: cancel.clone(),
            probe_timeout: config.probe_timeout,
            metrics: metrics.clone(),
        };
        let mut gateway = Gateway {
            local_addr,
            dispatcher: dispatcher.clone(),
            metrics: metrics.clone(),
            cancel: cancel.clone(),
            server: None,
            tasks: Vec::new(),
            zmq,
            registry: registry.clone(),
            block_size_source,
            replica: None,
        };

        let added = futures::future::join_all(
            config
                .workers
                .iter()
                .zip(probes)
                .map(|(spec, probe)| registry.add_probed(spec, probe)),
        )
        .await;
        for (spec, result) in config.workers.iter().zip(added) {
            result.map_err(|source| GatewayError::Worker {
                url: spec.url.clone(),
                source,
            })?;
        }

        let mut nats_status = None;
        if let (Some(url), Some(subjects)) = (&config.nats_url, subjects) {
            let (client, status) = protocol::nats_client::connect_with_status(
                url,
                &config.nats_security,
                Duration::from_secs(5),
            )
            .await
            .map_err(GatewayError::Nats)?;
            nats_status = Some(status);
            gateway.tasks.push(tokio::spawn(events::run_nats_events(
                client.clone(),
                subjects.clone(),
                dispatcher.clone(),
                cancel.clone(),
            )));
            gateway.tasks.push(tokio::spawn(registry::run_discovery(
                registry.clone(),
                client.clone(),
                subjects.clone(),
                config.max_workers,
                config.registration_token.clone(),
            )));
            // After discovery starts, so workers announced meanwhile are known when the
            // peers' snapshots (which name them) are applied; a worker that joins later makes
            // the replica fetch them again.
            gateway.replica = Some(
                replicas::join(
                    client,
                    &subjects,
                    dispatcher.clone(),
                    metrics.clone(),
                    config.replica,
                    cancel.clone(),
                    &mut gateway.tasks,
                )
                .await?,
            );
            gateway.tasks.push(tokio::spawn(registry::run_lease_expiry(
                registry.clone(),
                Duration::from_millis(100),
            )));
        }
        gateway.tasks.push(tokio::spawn(registry::run_health_checks(
            registry.clone(),
            config.health_interval,
        )));
        gateway
            .tasks
            .push(tokio::spawn(dispatcher.clone().run_timers(cancel.clone())));

        let state = Arc::new(server::AppState {
            dispatcher,
            metrics,
            preprocessor: Arc::new(preprocessor),
            http,
            model: config.model.as_str().into(),
            context_length: config.context_length,
            max_body_bytes: config.max_body_bytes,
            max_response_bytes: config.max_response_bytes,
            timeouts: config.timeouts,
            health_interval: config.health_interval,
            migration_limit: config.migration_limit,
            started: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            next_id: AtomicU64::new(0),
            nats: nats_status,
        });
        let mut app = server::routes(state);
        if let Some(limit) = config.rate_limit {
            let buckets = rate_limit::ClientBuckets::new(limit, rate_limit::MAX_CLIENTS);
            app = app.layer(axum::middleware::from_fn_with_state(
                Arc::new(std::sync::Mutex::new(buckets)),
                rate_limit::limit,
            ));
        }
        gateway.server = Some(tokio::spawn(protocol::listener::serve_with_limit(
            listener,
            app,
            config.timeouts.header,
            config
                .max_connections
                .unwrap_or_else(protocol::listener::default_max_connections),
            cancel.clone().cancelled_owned(),
        )));
        tracing::info!(addr = %local_addr, "gateway listening");
        Ok(gateway)
    }

    /// Its identity among its peer replicas (with NATS).
    pub fn replica(&self) -> Option<&replicas::ReplicaLink> {
        self.replica.as_ref()
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The router's KV block size, and where it came from.
    pub fn block_size(&self) -> (usize, BlockSizeSource) {
        (self.dispatcher.block_size(), self.block_size_source)
    }

    /// `http://ADDR`.
    pub fn url(&self) -> String {
        format!("http://{}", self.local_addr)
    }

    /// Feeds KV events from inside the process (the demo's engines).
    pub fn kv_event_sink(&self) -> KvEventSink {
        KvEventSink::new(self.dispatcher.clone())
    }

    /// The shared routing state (workers, index), e.g. for tests and dashboards.
    pub fn dispatcher(&self) -> &Arc<Dispatcher> {
        &self.dispatcher
    }

    /// The metrics exposition `GET /metrics` serves.
    pub fn metrics_text(&self) -> String {
        self.metrics.encode()
    }

    /// Adds a static worker at run time (as a `--worker` flag would at start).
    pub async fn add_worker(&self, spec: &WorkerSpec) -> Result<WorkerInfo, GatewayError> {
        self.registry
            .add_static(spec)
            .await
            .map_err(|source| GatewayError::Worker {
                url: spec.url.clone(),
                source,
            })
    }

    /// Removes a worker; its blocks leave the index.
    pub fn remove_worker(&self, worker: kv_index::WorkerId) -> bool {
        self.zmq.stop(worker);
        self.dispatcher.remove_worker(worker)
    }

    /// Starts draining a worker (scaling its pool down): no new request goes to it; once
    /// its requests have finished, [`Gateway::take_drained`] names it and the caller removes
    /// it ([`Gateway::remove_worker`]). `false` for a worker not in the routing set.
    pub fn drain_worker(&self, worker: kv_index::WorkerId) -> bool {
        self.dispatcher.drain_worker(worker)
    }

    /// Draining workers that have become idle since the last call.
    pub fn take_drained(&self) -> Vec<kv_index::WorkerId> {
        self.dispatcher.take_drained()
    }

    /// Resolves when the HTTP server stops (it stops on [`Gateway::shutdown`]).
    pub async fn stopped(&mut self) {
        if let Some(server) = &mut self.server {
            let _ = server.await;
            self.server = None;
        }
    }

    /// Stops accepting requests, fails queued ones, lets streaming ones finish for up to
    /// five seconds, then stops everything.
    pub async fn shutdown(mut self) {
        self.dispatcher.shut_down();
        self.cancel.cancel();
        self.zmq.stop_all();
        if let Some(server) = self.server.take() {
            let abort = server.abort_handle();
            if tokio::time::timeout(SHUTDOWN_GRACE, server).await.is_err() {
                abort.abort();
            }
        }
        if let Some(replica) = &self.replica {
            replica.goodbye().await;
        }
        for task in self.tasks.drain(..) {
            task.abort();
        }
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        self.cancel.cancel();
        self.zmq.stop_all();
        for task in &self.tasks {
            task.abort();
        }
        if let Some(server) = &self.server {
            server.abort();
        }
    }
}
