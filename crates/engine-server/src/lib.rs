//! The engine simulator served in real time: an OpenAI-compatible worker that behaves, on the
//! wire and in its timing, like one vLLM / TensorRT-LLM GPU worker.
//!
//! One tokio task owns the sans-IO [`engine::Engine`] and drives it step by step, sleeping
//! until each step's modelled end (divided by `speedup`); HTTP handlers submit requests to it
//! over a bounded channel and relay each request's tokens from a `watch` channel. Replies are
//! readable text from `text::ReplyGenerator` whose token ids are the ones the next turn's
//! prompt re-tokenizes to, so a conversation's replies are prefix-cache hits, as with a real
//! model. KV events go to NATS (our msgpack format, plus worker registration) and/or a ZMQ PUB
//! socket (vLLM's `KVEventBatch` format) as the engine emits them, blocks' tokens included.
//!
//! Endpoints: `POST /v1/completions` (text or token-id prompt), `POST /v1/chat/completions`
//! (Llama-3 template), both streaming (SSE, `stream_options.include_usage`) or not;
//! `GET /v1/models`, `GET /health`, `GET /info` (its [`protocol::WorkerCard`]),
//! `POST /tokenize`, `GET /metrics` (see [`metrics`]). Errors are OpenAI error JSON: bad
//! JSON 400, prompt over the context 400 `context_length_exceeded`, unknown model 404, a
//! method the path does not serve 405 `method_not_allowed` (with `Allow`), body over the
//! limit 413, engine queue full 429.
//!
//! OpenAI's `stop` (a string or up to four; an empty one, or more, is a 400 naming `stop`)
//! ends a reply just before the first stop string its text completes, whatever the prompt's
//! form (the reply's text is always known, token-id prompts included): `finish_reason` is
//! `stop`, and the engine generates, and usage and `token_ids` count, the tokens up to the one
//! completing it, no more. A stream holds back text that may begin a stop string until the
//! next tokens show whether it does, so no part of one is ever sent.
//!
//! # Invariants
//!
//! - The engine task never waits for a client: progress is a watch channel (bounded to its
//!   latest value). A client that disconnects cancels its engine request.
//! - Bounds: submissions (`command_queue`, full → 429), requests in the engine
//!   (`EngineConfig::max_waiting` + `max_num_seqs`, full → 429), KV event batches waiting to
//!   be published (`kv_event_queue`, full → dropped, counted, and visible to receivers as a
//!   sequence gap), and request bodies (`body_limit_bytes`, → 413).
//!
//! # Example
//!
//! ```no_run
//! # async fn demo() -> Result<(), engine_server::ServerError> {
//! use engine_server::{EngineServer, EngineServerConfig};
//!
//! let mut config = EngineServerConfig::new(); // seed 002's H200 worker on 127.0.0.1:0
//! config.speedup = 100.0;
//! let server = EngineServer::bind(config).await?;
//! println!("serving on {}", server.url());
//! // … POST {url}/v1/chat/completions …
//! server.shutdown().await;
//! # Ok(()) }
//! ```

mod compat;
mod config;
mod driver;
mod http;
pub mod metrics;
mod publish;
mod replies;

use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use engine::{Engine, EngineConfigError};
use protocol::{WorkerAnnounce, WorkerCard};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

pub use config::{EngineServerConfig, NatsConfig, ReplyLength};
pub use protocol::vllm::{EventEncoding, ReplayBuffer};
pub use publish::PublishError;

/// Why a server could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("engine configuration: {0}")]
    Engine(#[from] EngineConfigError),
    #[error("--speedup must be a positive number, got {0}")]
    Speedup(f64),
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error(transparent)]
    Publish(#[from] PublishError),
    #[error("text assets: {0}")]
    Text(String),
}

/// Starts engine servers.
pub struct EngineServer;

/// A running server. Dropping it signals shutdown without waiting; call
/// [`EngineServerHandle::shutdown`] to wait for a clean stop (NATS goodbye sent, events
/// flushed).
pub struct EngineServerHandle {
    local_addr: SocketAddr,
    card: WorkerCard,
    shutdown: watch::Sender<bool>,
    server: Option<JoinHandle<()>>,
    driver: Option<JoinHandle<()>>,
    publisher: Option<JoinHandle<()>>,
    registration: Option<JoinHandle<()>>,
}

fn instance_id() -> u64 {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let mut bytes = nanos.to_le_bytes().to_vec();
    bytes.extend_from_slice(&std::process::id().to_le_bytes());
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    bytes.extend_from_slice(
        &COUNTER
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            .to_le_bytes(),
    );
    xxhash_rust::xxh3::xxh3_64(&bytes)
}

impl EngineServer {
    /// Binds the HTTP listener (and the ZMQ socket, and connects to NATS, as configured) and
    /// starts serving. Fails fast: a bad config, a taken port or an unreachable NATS server
    /// is an error here, not later.
    pub async fn bind(config: EngineServerConfig) -> Result<EngineServerHandle, ServerError> {
        if !(config.speedup.is_finite() && config.speedup > 0.0) {
            return Err(ServerError::Speedup(config.speedup));
        }
        let mut engine_config = config.engine.clone();
        engine_config.coalesce_decode = false;
        engine_config.seed = config.seed;
        // The publishers forward the engine's events as they are, tokens included.
        engine_config.kv_event_tokens = true;
        let engine = Engine::new(engine_config, config.worker_id)?;
        let assets = Arc::new(
            match &config.text {
                None => replies::TextAssets::builtin(),
                Some(preprocessor) => replies::TextAssets::with_preprocessor(preprocessor.clone()),
            }
            .map_err(ServerError::Text)?,
        );
        let bind_error = |source| ServerError::Bind {
            addr: config.listen,
            source,
        };
        let listener = tokio::net::TcpListener::bind(config.listen)
            .await
            .map_err(bind_error)?;
        let local_addr = listener.local_addr().map_err(bind_error)?;
        let nats = match &config.nats {
            Some(nats) => {
                Some(publish::Nats::connect(&nats.url, &nats.security, &nats.namespace).await?)
            }
            None => None,
        };
        let zmq = match &config.zmq_pub {
            Some(endpoint) => Some(
                publish::Zmq::bind(
                    endpoint,
                    config.zmq_event_encoding,
                    config
                        .zmq_replay
                        .as_deref()
                        .map(|replay| (replay, config.zmq_replay_buffer)),
                )
                .await?,
            ),
            None => None,
        };
        let block_size = engine.config().block_size;
        let profile = engine.profile();
        let card = WorkerCard {
            worker: Some(config.worker_id),
            instance: instance_id(),
            url: config
                .advertise_url
                .clone()
                .unwrap_or_else(|| format!("http://{local_addr}")),
            model: config.model.clone(),
            profile: Some(profile.name.clone()),
            gpu: Some(profile.gpu.clone()),
            block_size: Some(block_size),
            max_model_len: Some(profile.max_context_tokens),
            limits: engine.limits(),
            speedup: Some(config.speedup),
            // Credentials in the URL stay in this process.
            nats_url: config
                .nats
                .as_ref()
                .map(|n| protocol::nats_client::redact(&n.url)),
            nats_kv_subject: nats
                .as_ref()
                .map(|n| n.subjects.kv_events(config.worker_id)),
            zmq_endpoint: zmq.as_ref().map(|z| z.endpoint.clone()),
            zmq_replay_endpoint: zmq.as_ref().and_then(publish::Zmq::replay_endpoint),
            zmq_kv_state_path: zmq.as_ref().map(|_| "/kv_state".to_string()),
            returns_token_ids: true,
            role: worker_role(config.engine.role),
            speculative: engine
                .config()
                .spec_decode
                .as_ref()
                .filter(|spec| spec.draft_len > 0)
                .map(|spec| protocol::SpeculativeInfo {
                    method: spec.method.name().to_owned(),
                    draft_len: spec.draft_len,
                    acceptance_rate: spec.mean_acceptance_rate(),
                    tokens_per_step: spec.mean_tokens_per_step(),
                }),
        };
        let registration = match (&nats, &config.nats) {
            (Some(client), Some(settings)) => Some((
                client.clone(),
                publish::Registration::new(WorkerAnnounce {
                    card: card.clone(),
                    lease_ms: settings.lease_ms,
                    token: settings.registration_token.clone(),
                })?,
            )),
            _ => None,
        };

        let metrics = Arc::new(metrics::ServerMetrics::new(
            &config.model,
            &profile.gpu,
            &config.hostname,
            config.engine.spec_decode.as_ref().map(|s| s.draft_len),
        ));
        metrics.set_role(card.role);
        let snapshot = Arc::new(Mutex::new(driver::Snapshot::default()));
        let clock = driver::Clock::new(config.speedup);
        let (shutdown_tx, shutdown_rx) = watch::channel(false);
        let (command_tx, command_rx) = mpsc::channel(config.command_queue.max(1));
        let (kv_tx, kv_rx) = mpsc::channel(config.kv_event_queue.max(1));

        let links = driver::Links {
            commands: command_rx,
            shutdown: shutdown_rx.clone(),
            kv_out: kv_tx,
            metrics: metrics.clone(),
            snapshot: snapshot.clone(),
        };
        let driver = driver::Driver::new(engine, clock, links);
        let driver = tokio::spawn(driver.run());
        let (zmq_state_tx, zmq_state_rx) = mpsc::channel(publish::ZMQ_STATE_QUEUE);
        let publisher = tokio::spawn(publish::run_kv_publisher(
            kv_rx,
            config.worker_id,
            card.instance,
            block_size,
            nats.clone(),
            zmq,
            zmq_state_rx,
        ));
        let registration = registration.map(|(client, registration)| {
            tokio::spawn(publish::run_registration(
                client,
                registration,
                shutdown_rx.clone(),
            ))
        });

        let state = Arc::new(http::AppState {
            info: card.clone(),
            commands: command_tx,
            next_id: AtomicU64::new(1),
            assets,
            reply_length: config.reply_length,
            seed: config.seed,
            body_limit: config.body_limit_bytes,
            body_timeout: config.body_timeout,
            metrics,
            snapshot,
            clock,
            started: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            nats: nats.as_ref().map(|n| n.status.clone()),
            zmq_state: card.zmq_kv_state_path.is_some().then_some(zmq_state_tx),
        });
        let app = http::router(state);
        let mut server_shutdown = shutdown_rx;
        // The gateway's listener (shared): header, idle and body deadlines, TCP_NODELAY.
        let server = tokio::spawn(protocol::listener::serve_with_limit(
            listener,
            app,
            config.header_timeout,
            config
                .max_connections
                .unwrap_or_else(protocol::listener::default_max_connections),
            async move {
                let _ = server_shutdown.wait_for(|stop| *stop).await;
            },
        ));
        tracing::info!(%local_addr, worker = config.worker_id.0, "engine server listening");
        Ok(EngineServerHandle {
            local_addr,
            card,
            shutdown: shutdown_tx,
            server: Some(server),
            driver: Some(driver),
            publisher: Some(publisher),
            registration,
        })
    }
}

impl EngineServerHandle {
    /// The address the HTTP server listens on (the real port when configured with 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// `http://<local_addr>`.
    pub fn url(&self) -> String {
        format!("http://{}", self.local_addr)
    }

    /// What `GET /info` answers and the NATS announcement carries.
    pub fn info(&self) -> &WorkerCard {
        &self.card
    }

    /// Stops cleanly: cancels requests in flight (streams end with an error event), stops
    /// accepting connections, says goodbye on NATS and publishes the last KV events. Waits at
    /// most a few seconds for each part.
    pub async fn shutdown(mut self) {
        let _ = self.shutdown.send(true);
        let limit = Duration::from_secs(5);
        for task in [
            self.driver.take(),
            self.server.take(),
            self.publisher.take(),
            self.registration.take(),
        ]
        .into_iter()
        .flatten()
        {
            if tokio::time::timeout(limit, task).await.is_err() {
                tracing::warn!("an engine server task did not stop within {limit:?}");
            }
        }
    }

    /// Serves until Ctrl-C or SIGTERM, then shuts down cleanly.
    pub async fn run_until_signal(self) {
        wait_for_signal().await;
        tracing::info!("shutting down");
        self.shutdown().await;
    }
}

impl Drop for EngineServerHandle {
    fn drop(&mut self) {
        let _ = self.shutdown.send(true);
    }
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(term) => term,
                Err(_) => {
                    let _ = tokio::signal::ctrl_c().await;
                    return;
                }
            };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

pub use protocol::{UnknownRole, WorkerRole};

/// The card's name of an engine role.
pub fn worker_role(role: engine::Role) -> protocol::WorkerRole {
    match role {
        engine::Role::Aggregated => protocol::WorkerRole::Both,
        engine::Role::PrefillOnly => protocol::WorkerRole::Prefill,
        engine::Role::DecodeOnly => protocol::WorkerRole::Decode,
    }
}

/// The engine role a card's role names.
pub fn engine_role(role: protocol::WorkerRole) -> engine::Role {
    match role {
        protocol::WorkerRole::Both => engine::Role::Aggregated,
        protocol::WorkerRole::Prefill => engine::Role::PrefillOnly,
        protocol::WorkerRole::Decode => engine::Role::DecodeOnly,
    }
}
