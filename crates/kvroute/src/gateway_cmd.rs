//! `kvroute gateway`: the OpenAI-compatible frontend with KV-aware routing, as a process.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use anyhow::{Result, bail};
use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};
use gateway::{
    BlockSizeSource, Gateway, GatewayConfig, GatewayError, ReplicaSettings, Timeouts, WorkerSpec,
};
use nanotime::Nanos;
use router::{KvCostParams, KvSource, PolicyKind, PolicyParams, RouterConfig};

/// `--router-mode` values: every built-in policy by name (and Dynamo's hyphenated spelling),
/// so a new policy in the router appears here without a change.
fn router_mode() -> impl TypedValueParser<Value = PolicyKind> {
    // clap wants 'static aliases: the hyphenated names are made once per process.
    static DASHED: OnceLock<Vec<&'static str>> = OnceLock::new();
    let dashed = DASHED.get_or_init(|| {
        PolicyKind::ALL
            .iter()
            .map(|kind| &*Box::leak(kind.name().replace('_', "-").into_boxed_str()))
            .collect()
    });
    let values = PolicyKind::ALL.iter().zip(dashed).map(|(kind, dashed)| {
        let value = PossibleValue::new(kind.name());
        if *dashed != kind.name() {
            value.alias(*dashed)
        } else {
            value
        }
    });
    PossibleValuesParser::new(values).try_map(|name| name.parse::<PolicyKind>())
}

#[derive(Debug, clap::Args)]
pub struct GatewayArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// Port to listen on (0: any free port; the address is printed on start-up).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// A worker: URL[,id=N][,block_size=N][,capacity=BLOCKS][,max_num_seqs=N]
    /// [,zmq=tcp://HOST:PORT[,zmq_replay=tcp://HOST:PORT]][,prompt=tokens|text]
    /// [,role=both|prefill|decode]. Repeat for each worker. The gateway reads id, block size,
    /// capacity, role and event endpoints from the worker's /info (kvroute engines); give them
    /// here for other backends (vLLM or SGLang: zmq= for its KV events, zmq_replay= for its
    /// replay_endpoint, which fills event gaps instead of clearing the worker's blocks; role=
    /// for a disaggregated worker). With prefill and decode workers the gateway
    /// serves disaggregated: prefill on a prefill worker, decode on a decode worker.
    #[arg(long = "worker", value_name = "URL[,KEY=VALUE...]")]
    workers: Vec<WorkerSpec>,
    /// The model name clients ask for.
    #[arg(long, default_value = "llama-3.1-70b-instruct")]
    model: String,
    /// The model's context length in tokens; longer prompts get `context_length_exceeded`.
    #[arg(long, default_value_t = 131_072)]
    context_length: u32,
    /// Routing policy: kvroute's load-aware `kv_load` (docs/ROUTING.md), Dynamo's `kv`,
    /// `round_robin` or `random`.
    #[arg(long, env = "DYN_ROUTER_MODE", default_value_t = PolicyKind::DEFAULT, value_parser = router_mode())]
    router_mode: PolicyKind,
    /// Tokens per KV block; must match the workers'. Default: the block size the workers
    /// declare (their `,block_size=` or their `/info`), else 16.
    #[arg(long, env = "DYN_KV_CACHE_BLOCK_SIZE")]
    kv_block_size: Option<usize>,
    /// Weight of prefill blocks against decode blocks in the kv policy's cost (0 ignores the
    /// cache).
    #[arg(long, default_value_t = 1.0)]
    kv_overlap_score_weight: f64,
    /// Softmax temperature of the kv policy (0: always the lowest cost).
    #[arg(long, default_value_t = 0.0)]
    router_temperature: f64,
    /// Override a `kv_load` parameter, e.g. `expected_output_tokens=1024` (repeatable;
    /// docs/ROUTING.md lists them).
    #[arg(long, value_name = "KEY=VALUE")]
    kv_load_set: Vec<String>,
    /// Do not use workers' KV events: predict caches from routing decisions (approximate
    /// mode).
    #[arg(long)]
    no_kv_events: bool,
    /// Seconds a routed prompt is assumed to stay cached where the router predicts caches
    /// (approximate mode, and workers that announce no KV events).
    #[arg(long, default_value_t = 120.0)]
    router_ttl: f64,
    /// Seed of the router's random choices (random policy, tie breaks).
    #[arg(long, default_value_t = 0)]
    router_seed: u64,
    /// NATS server for KV events (kvroute's format) and worker registration.
    #[arg(long, env = "NATS_URL", hide_env_values = true)]
    nats: Option<String>,
    #[command(flatten)]
    nats_security: crate::nats_args::NatsSecurityArgs,
    #[command(flatten)]
    connections: crate::listener_args::ConnectionArgs,
    /// NATS subject namespace (`kvroute.<namespace>.…`), as the workers use.
    #[arg(long, default_value = "default")]
    namespace: String,
    /// A shared secret that NATS worker messages must carry (the engines'
    /// --registration-token); others are ignored and counted
    /// (kvroute_gateway_worker_registrations_refused_total). Without one, announced workers
    /// are still routed to only once their /info answers with the announced identity.
    #[arg(long, env = "KVROUTE_REGISTRATION_TOKEN", hide_env_values = true)]
    registration_token: Option<String>,
    /// With --nats this gateway is one replica of several behind one address: its id among
    /// them. Default: derived from the host, process and start time (printed at start).
    #[arg(long, value_name = "N", requires = "nats")]
    replica_id: Option<u32>,
    /// With --nats: do not share routing decisions with the other gateway replicas (each
    /// then sees only its own load on the workers).
    #[arg(long, requires = "nats")]
    no_replica_sync: bool,
    /// Milliseconds a routing update may wait to be batched before it goes to the other
    /// replicas: with NATS delivery, how stale their view of this replica's load may be.
    #[arg(long, value_name = "MS", default_value_t = ReplicaSettings::default().flush_interval.as_secs_f64() * 1e3)]
    replica_flush_ms: f64,
    /// Per-client rate limit of /v1/* requests, per second per client address (IPv6: per
    /// /64); beyond it: 429 with Retry-After. Default: no limit.
    #[arg(long, value_name = "RPS")]
    rate_limit: Option<f64>,
    /// Requests a client may send at once before --rate-limit applies (default: one
    /// second's worth).
    #[arg(long, value_name = "N", requires = "rate_limit")]
    rate_limit_burst: Option<u32>,
    /// Largest request body accepted, in bytes (more: 413). Read as it arrives, never
    /// reserved from a declared Content-Length.
    #[arg(long, alias = "max-body-bytes", default_value_t = 16 << 20)]
    max_request_bytes: usize,
    /// Largest non-streamed reply gathered from a worker, in bytes of text (more: 502).
    #[arg(long, default_value_t = 16 << 20)]
    max_response_bytes: usize,
    /// Seconds to open a connection to a worker.
    #[arg(long, default_value_t = Timeouts::default().connect.as_secs_f64())]
    connect_timeout: f64,
    /// Seconds from sending a request to a worker to its first bytes (headers and first
    /// event: queueing and prefill). Missed by a worker that sent nothing on any of its
    /// requests for that long (or fails its health check), the worker is ejected until its
    /// health check passes and the request is retried once on another worker; a worker still
    /// streaming other requests is busy, and the request waits.
    #[arg(long, default_value_t = Timeouts::default().first_byte.as_secs_f64())]
    first_byte_timeout: f64,
    /// Seconds a worker's stream may stay silent between two chunks (while the worker is
    /// silent on every request: a busy one is waited for); then the worker is
    /// ejected and the request migrated to another worker (or, past --migration-limit, the
    /// stream ends with an error event).
    #[arg(long, default_value_t = Timeouts::default().stall.as_secs_f64())]
    stall_timeout: f64,
    /// Times one request may be resent, with its output so far, to another worker when its
    /// worker dies or stalls mid-stream; the client's stream goes on unbroken. 0: the stream
    /// ends with an error event (`worker_failed`, `worker_timeout`).
    #[arg(long, default_value_t = GatewayConfig::default().migration_limit)]
    migration_limit: u32,
    /// Seconds a worker that failed a request (broken stream, timeout) stays out of the
    /// routing set even if its health check passes; each failure in a row adds as much
    /// again, up to ten times it. A request it serves to the end resets the count.
    #[arg(long, default_value_t = router::EjectionConfig::default().base.as_secs_f64())]
    ejection_time: f64,
    /// Seconds a client has to send its request headers; also how long an idle keep-alive
    /// connection stays open.
    #[arg(long, default_value_t = Timeouts::default().header.as_secs_f64())]
    header_timeout: f64,
    /// Seconds a client has to send its whole request body (then 408).
    #[arg(long, default_value_t = Timeouts::default().body.as_secs_f64())]
    body_timeout: f64,
    /// Requests in flight per worker before new ones wait in the frontend queue (0: no cap).
    #[arg(long, default_value_t = router::FrontendConfig::DEFAULT_MAX_IN_FLIGHT_PER_WORKER.get())]
    max_inflight_per_worker: u32,
    /// Requests that may wait for a worker slot (more: 429).
    #[arg(long, default_value_t = router::FrontendConfig::DEFAULT_QUEUE_CAPACITY)]
    queue_capacity: usize,
    /// Seconds a request may wait in the queue (then 503).
    #[arg(long, default_value_t = router::FrontendConfig::DEFAULT_QUEUE_TIMEOUT.as_secs_f64())]
    queue_timeout: f64,
    /// Seconds between health checks of each worker.
    #[arg(long, default_value_t = router::FailoverConfig::default().health_interval.as_secs_f64())]
    health_interval: f64,
    /// A Hugging Face tokenizer.json (default: the built-in cl100k + Llama-3 specials).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// A Hugging Face tokenizer_config.json whose chat_template to use (default: Llama-3).
    #[arg(long)]
    tokenizer_config: Option<PathBuf>,
    /// Most workers known at once (static and registered).
    #[arg(long, default_value_t = 1024)]
    max_workers: usize,
    /// Disaggregated fleets: a request with at most this many prompt tokens uncached on its
    /// decode worker is prefilled there, with no KV transfer (conditional disaggregation;
    /// 0 splits every request).
    #[arg(long, default_value_t = router::DisaggConfig::default().local_prefill_max_tokens)]
    local_prefill_max_tokens: u32,
    /// Disaggregated fleets: seconds a prefill worker may take to answer before the request
    /// is prefilled on its decode worker instead.
    #[arg(long, default_value_t = 60.0)]
    prefill_timeout: f64,
}

pub(crate) fn seconds(flag: &str, value: f64) -> Result<Duration> {
    if !(value.is_finite() && value > 0.0) {
        bail!("--{flag} must be a positive number of seconds, got {value}");
    }
    Ok(Duration::from_secs_f64(value))
}

/// The router core's settings from the routing flags (Dynamo's names); the router checks
/// the values when the gateway starts.
fn router_config(args: &GatewayArgs) -> Result<RouterConfig> {
    if args.kv_block_size == Some(0) {
        bail!("--kv-block-size must be at least 1");
    }
    let ttl = seconds("router-ttl", args.router_ttl)?;
    Ok(RouterConfig {
        policy: args.router_mode,
        params: PolicyParams {
            kv: KvCostParams {
                overlap_weight: args.kv_overlap_score_weight,
                temperature: args.router_temperature,
            },
            kv_load: crate::sim_cmd::patch(
                router::KvLoadParams::default(),
                &args.kv_load_set,
                "kv-load",
            )?,
            ..PolicyParams::default()
        },
        block_size: args.kv_block_size.unwrap_or(kv_index::DEFAULT_BLOCK_SIZE),
        seed: args.router_seed,
        kv_source: if args.no_kv_events {
            KvSource::Approximate {
                ttl: Nanos(u64::try_from(ttl.as_nanos()).unwrap_or(u64::MAX)),
            }
        } else {
            KvSource::Events
        },
        // Also for workers without an event source, predicted under KV events.
        predicted_ttl: Nanos(u64::try_from(ttl.as_nanos()).unwrap_or(u64::MAX)),
        ..RouterConfig::default()
    })
}

pub fn config(args: &GatewayArgs) -> Result<GatewayConfig> {
    Ok(GatewayConfig {
        listen: SocketAddr::new(args.host, args.port),
        model: args.model.clone(),
        context_length: args.context_length,
        workers: args.workers.clone(),
        router: router_config(args)?,
        block_size_from_workers: args.kv_block_size.is_none(),
        nats_url: args.nats.clone(),
        nats_security: args.nats_security.security(),
        namespace: args.namespace.clone(),
        registration_token: args.registration_token.clone(),
        rate_limit: args
            .rate_limit
            .map(|rps| gateway::rate_limit::RateLimit::new(rps, args.rate_limit_burst))
            .transpose()
            .map_err(anyhow::Error::msg)?,
        max_body_bytes: args.max_request_bytes,
        max_response_bytes: args.max_response_bytes,
        timeouts: Timeouts {
            connect: seconds("connect-timeout", args.connect_timeout)?,
            first_byte: seconds("first-byte-timeout", args.first_byte_timeout)?,
            stall: seconds("stall-timeout", args.stall_timeout)?,
            header: seconds("header-timeout", args.header_timeout)?,
            body: seconds("body-timeout", args.body_timeout)?,
        },
        frontend: gateway::FrontendConfig {
            max_in_flight_per_worker: std::num::NonZeroU32::new(args.max_inflight_per_worker),
            queue_capacity: args.queue_capacity,
            queue_timeout: Some(seconds("queue-timeout", args.queue_timeout)?.into()),
        },
        health_interval: seconds("health-interval", args.health_interval)?,
        tokenizer: args.tokenizer.clone(),
        tokenizer_config: args.tokenizer_config.clone(),
        max_workers: args.max_workers,
        local_prefill_max_tokens: args.local_prefill_max_tokens,
        prefill_timeout: seconds("prefill-timeout", args.prefill_timeout)?,
        migration_limit: args.migration_limit,
        replica: ReplicaSettings {
            id: args.replica_id,
            sync: !args.no_replica_sync,
            flush_interval: {
                let ms = args.replica_flush_ms;
                if !(ms.is_finite() && (0.0..=1000.0).contains(&ms)) {
                    bail!("--replica-flush-ms must be between 0 and 1000 milliseconds, got {ms}");
                }
                Duration::from_secs_f64(ms / 1e3)
            },
            ..ReplicaSettings::default()
        },
        ejection: {
            // 0 turns the minimum off: health checks alone decide.
            let base = if args.ejection_time == 0.0 {
                Duration::ZERO
            } else {
                seconds("ejection-time", args.ejection_time)?
            };
            router::EjectionConfig::with_base(base.into())
        },
        ..GatewayConfig::default()
    })
}

pub fn run(args: GatewayArgs) -> Result<()> {
    let mut config = config(&args)?;
    let (max_connections, connections) = args.connections.bound()?;
    config.max_connections = Some(max_connections);
    let runtime = crate::server_runtime()?;
    runtime.block_on(async {
        let mode = config.router.policy;
        // Printed below: without the credentials the URL may carry.
        let nats = config
            .nats_url
            .as_deref()
            .map(protocol::nats_client::redact);
        let approximate = matches!(config.router.kv_source, KvSource::Approximate { .. });
        let mut gateway = Gateway::bind(config).await.map_err(|e| match e {
            GatewayError::Bind { addr, source } => {
                crate::listener_args::cannot_listen(addr, &source, "--port", Some("--host"))
            }
            other => other.into(),
        })?;
        let workers = gateway.dispatcher().workers();
        let routable = workers.iter().filter(|w| w.2).count();
        println!(
            "kvroute gateway: {} routing over {} workers ({} reachable) listening on {}",
            mode,
            workers.len(),
            routable,
            gateway.url()
        );
        println!("kvroute gateway: {connections}");
        // Engines on NATS are learned from their next heartbeat, not at once: say why the
        // first requests get 503 rather than leave the user guessing.
        if let (true, Some(nats)) = (workers.is_empty(), &nats) {
            println!(
                "kvroute gateway: waiting for workers to register over NATS ({nats}); each \
                 engine announces itself every third of its --lease-ms (RUST_LOG=info logs \
                 each registration)"
            );
        }
        // Where each worker's cache view comes from: a KV-aware policy without events for a
        // worker routes as if its cache were empty, so say so rather than route blind quietly.
        for (info, _, reachable) in &workers {
            if !reachable {
                println!(
                    "kvroute gateway: worker {} ({}): not reachable yet; routed once its health \
                     check passes, with the cache view its /info announces then",
                    info.id.0, info.url
                );
                continue;
            }
            let view = match (&info.zmq, &nats) {
                _ if approximate => "the router's own predictions (--no-kv-events)".to_string(),
                (Some(endpoint), _) => match &info.zmq_replay {
                    Some(replay) => {
                        format!("KV events over ZMQ from {endpoint} (gaps replayed from {replay})")
                    }
                    None => format!("KV events over ZMQ from {endpoint}"),
                },
                (None, Some(nats)) => format!("KV events over NATS ({nats})"),
                (None, None) => {
                    eprintln!(
                        "kvroute gateway: warning: worker {} ({}) announces no KV events, so \
                         the router predicts its cache from its own routing decisions \
                         (entries expire after --router-ttl); for an exact view start kvroute \
                         engines with --zmq-pub auto (the default), give a vLLM worker \
                         `,zmq=tcp://HOST:PORT`, or use --nats",
                        info.id.0, info.url
                    );
                    continue;
                }
            };
            println!(
                "kvroute gateway: worker {} ({}): cache view from {view}",
                info.id.0, info.url
            );
        }
        if let Some(replica) = gateway.replica() {
            if replica.sync {
                println!(
                    "kvroute gateway: replica {} (epoch {}): sharing routing decisions with \
                     peer replicas over NATS; {} peer snapshot(s) applied at start",
                    replica.id.0, replica.epoch, replica.peers_at_start
                );
            } else {
                println!(
                    "kvroute gateway: replica {}: replica sync off (--no-replica-sync)",
                    replica.id.0
                );
            }
        }
        let (block_size, source) = gateway.block_size();
        let source = match source {
            BlockSizeSource::Flag => "--kv-block-size",
            BlockSizeSource::Workers => "the workers",
            BlockSizeSource::Default => "the default: no worker declared one",
        };
        println!("kvroute gateway: KV blocks of {block_size} tokens (from {source})");
        tokio::select! {
            _ = shutdown_signal() => {}
            _ = gateway.stopped() => {}
        }
        eprintln!("kvroute gateway: shutting down");
        gateway.shutdown().await;
        Ok(())
    })
}

/// Ctrl-C or SIGTERM (Kubernetes stops pods with SIGTERM).
pub async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
