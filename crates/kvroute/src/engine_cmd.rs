//! `kvroute engine`: one simulated GPU worker served over HTTP (see the `engine-server` crate).

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result, anyhow, bail};
use engine::{EngineConfig, EngineConfigError, HardwareProfile, ProfileError};
use engine_server::{
    EngineServer, EngineServerConfig, EventEncoding, NatsConfig, ReplyLength, ServerError,
};
use kv_index::WorkerId;
use text::{ChatTemplate, Preprocessor, TemplateError, Tokenizer};

/// `--zmq-event-encoding`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum ZmqEventEncoding {
    Map,
    Array,
}

#[derive(Debug, clap::Args)]
pub struct EngineArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// Port to listen on (0: any free port; the address is printed on start-up).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Built-in hardware profile (see `kvroute profiles`).
    #[arg(long, default_value = "h200-llama70b-fp8")]
    profile: String,
    /// A profile file (.toml or .json, see `kvroute profiles show`), instead of --profile.
    #[arg(long, conflicts_with = "profile")]
    profile_file: Option<PathBuf>,
    /// Run the simulated GPU this many times faster than real time (tests, demos).
    #[arg(long, default_value_t = 1.0)]
    speedup: f64,
    /// This worker's id in KV events and registrations (unique per fleet). Default: derived
    /// from the host name, address and port (and the process, with --port 0), so engines
    /// started alike on one machine, or as pods of one set, differ without a flag.
    #[arg(long)]
    worker_id: Option<u64>,
    /// The model name to serve (requests must name it).
    #[arg(long, default_value = "llama-3.1-70b-instruct")]
    model: String,
    /// Publish KV events (kvroute's format) and register this worker on this NATS server.
    #[arg(long, env = "NATS_URL", hide_env_values = true)]
    nats: Option<String>,
    #[command(flatten)]
    nats_security: crate::nats_args::NatsSecurityArgs,
    #[command(flatten)]
    connections: crate::listener_args::ConnectionArgs,
    /// NATS subject namespace (`kvroute.<namespace>.…`).
    #[arg(long, default_value = "default")]
    namespace: String,
    /// Registration lease in milliseconds; heartbeats go out every third of it.
    #[arg(long, default_value_t = 10_000)]
    lease_ms: u64,
    /// A shared secret carried in this worker's NATS announcements, heartbeats and goodbyes;
    /// gateways started with the same --registration-token ignore workers without it.
    #[arg(long, env = "KVROUTE_REGISTRATION_TOKEN", hide_env_values = true)]
    registration_token: Option<String>,
    /// Publish KV events in vLLM's ZMQ format on this endpoint, e.g. tcp://127.0.0.1:5557.
    /// `auto` (the default) binds a free port on --host and announces it in /info, where
    /// gateways subscribe by themselves; `off` publishes none.
    #[arg(long, default_value = "auto")]
    zmq_pub: String,
    /// How events are written on --zmq-pub: `map` (current vLLM; what vllm-router's kv_aware
    /// policy reads) or `array` (earlier vLLM). kvroute's gateway reads both.
    #[arg(long, value_enum, default_value_t = ZmqEventEncoding::Map)]
    zmq_event_encoding: ZmqEventEncoding,
    /// Answer KV event replay requests on this ROUTER endpoint, as vLLM's `replay_endpoint`
    /// does: a subscriber that missed batches asks for them instead of dropping its view of
    /// this cache. `auto` (the default, with --zmq-pub on) binds a free port on --host and
    /// announces it in /info; `off` offers none.
    #[arg(long, default_value = "auto")]
    zmq_replay: String,
    /// Batches kept for --zmq-replay (vLLM's `buffer_steps`).
    #[arg(long, default_value_t = engine_server::ReplayBuffer::DEFAULT_CAPACITY)]
    zmq_replay_buffer: usize,
    /// The model's tokenizer, as vLLM takes it: a Hugging Face `tokenizer.json`, or a model
    /// folder holding one (its `tokenizer_config.json`, when present, gives the chat
    /// template). Prompts sent as text are encoded with it and replies are its tokens, so a
    /// router that tokenizes with the model's tokenizer sees the engine's blocks. Default: the
    /// built-in cl100k tokenizer with Llama-3's template.
    #[arg(long, value_name = "PATH")]
    tokenizer: Option<PathBuf>,
    /// A Jinja chat template file, instead of the tokenizer's (or the built-in Llama-3 one).
    #[arg(long, value_name = "PATH")]
    chat_template: Option<PathBuf>,
    /// The URL gateways should use to reach this worker (announced over NATS); default
    /// http://HOST:PORT.
    #[arg(long)]
    advertise_url: Option<String>,
    /// Seed of the generated replies.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Tokens per KV block (default: the profile's, else 32).
    #[arg(long, env = "DYN_KV_CACHE_BLOCK_SIZE")]
    block_size: Option<u32>,
    /// Most sequences in a batch (default: the profile's, else 64).
    #[arg(long)]
    max_num_seqs: Option<u32>,
    /// KV pool size in blocks, instead of the profile's memory arithmetic.
    #[arg(long)]
    num_gpu_blocks: Option<u32>,
    /// Most requests waiting for admission (at least 1); more are refused with 429.
    #[arg(long, default_value_t = 65_536)]
    max_waiting: u32,
    /// Mean length of replies when the request does not force one (tokens).
    #[arg(long, default_value_t = 830)]
    reply_mean: u32,
    /// Spread of reply lengths: uniform in mean × (1 ± spread).
    #[arg(long, default_value_t = 0.25)]
    reply_spread: f64,
    /// Largest request body accepted, in bytes (more: 413).
    #[arg(long, default_value_t = 32 << 20)]
    body_limit: usize,
    /// Seconds a client has to send its request headers; also how long an idle keep-alive
    /// connection stays open.
    #[arg(long, default_value_t = 30.0)]
    header_timeout: f64,
    /// Seconds a client has to send its whole request body (then 408).
    #[arg(long, default_value_t = 30.0)]
    body_timeout: f64,
    /// The `Hostname` label of the simulated DCGM metrics (default: $HOSTNAME).
    #[arg(long)]
    hostname: Option<String>,
    /// This worker's part in disaggregated serving, as vLLM's `--kv-transfer-config`
    /// `kv_role` sets it: `both` (kv_both: prefills and decodes), `prefill` (kv_producer:
    /// serves only requests with `kv_transfer_params.do_remote_decode`, answering with the
    /// parameters a decode worker needs) or `decode` (kv_consumer: pulls the KV of requests
    /// with `do_remote_prefill`, serves other requests whole). Declared in /info.
    #[arg(long, default_value = "both", value_parser = parse_role)]
    role: engine_server::WorkerRole,
    /// The link a decode worker receives KV over, priced by the profile: `nvlink` (same
    /// node) or `network` (across nodes).
    #[arg(long, value_enum, default_value_t = KvLinkArg::Nvlink)]
    kv_link: KvLinkArg,
    #[command(flatten)]
    spec: crate::spec_args::SpecArgs,
}

/// `--kv-link`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum KvLinkArg {
    Nvlink,
    Network,
}

fn parse_role(value: &str) -> Result<engine_server::WorkerRole, String> {
    value
        .parse()
        .map_err(|e: engine_server::UnknownRole| e.to_string())
}

fn load_profile(args: &EngineArgs) -> Result<HardwareProfile> {
    let Some(path) = &args.profile_file else {
        return HardwareProfile::builtin(&args.profile).map_err(|e| match e {
            ProfileError::UnknownBuiltin { name, known } => anyhow!(
                "unknown profile {name:?} (--profile); the built-in profiles are {known} \
                 (`kvroute profiles` lists them), or give your own file with --profile-file"
            ),
            other => other.into(),
        });
    };
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading profile file {}", path.display()))?;
    let profile = if path.extension().is_some_and(|e| e == "json") {
        HardwareProfile::from_json_str(&text)
    } else {
        HardwareProfile::from_toml_str(&text)
    };
    profile.with_context(|| format!("profile file {}", path.display()))
}

pub fn config(args: &EngineArgs) -> Result<EngineServerConfig> {
    if !(args.speedup.is_finite() && args.speedup > 0.0) {
        bail!("--speedup must be a positive number, got {}", args.speedup);
    }
    // Zero is no size: refused here in the flag's name, before the engine would refuse it in
    // its own field's (or, for --max-waiting, accept it and answer every request 429).
    for (flag, value, what) in [
        ("--block-size", args.block_size, "tokens per KV block"),
        ("--max-num-seqs", args.max_num_seqs, "sequences in a batch"),
        (
            "--num-gpu-blocks",
            args.num_gpu_blocks,
            "blocks in the KV pool; leave the flag out to size the pool from the profile's memory",
        ),
        (
            "--max-waiting",
            Some(args.max_waiting),
            "requests waiting for admission; with 0 every request would be refused with 429",
        ),
    ] {
        if value == Some(0) {
            bail!("{flag} must be at least 1 ({what})");
        }
    }
    let profile = load_profile(args)?;
    let mut engine = EngineConfig::from_profile(profile);
    if let Some(block_size) = args.block_size {
        engine.block_size = block_size;
    }
    if let Some(max_num_seqs) = args.max_num_seqs {
        engine.max_num_seqs = max_num_seqs;
    }
    if let Some(blocks) = args.num_gpu_blocks {
        engine.num_gpu_blocks_override = Some(blocks);
    }
    engine.max_waiting = args.max_waiting;
    engine.role = engine_server::engine_role(args.role);
    engine.kv_link = match args.kv_link {
        KvLinkArg::Nvlink => engine::KvLink::Nvlink,
        KvLinkArg::Network => engine::KvLink::Network,
    };
    args.spec.apply(&mut engine)?;
    let mut config = EngineServerConfig::new();
    config.listen = SocketAddr::new(args.host, args.port);
    config.advertise_url = args.advertise_url.clone();
    config.engine = engine;
    config.worker_id = WorkerId(args.worker_id.unwrap_or_else(|| derived_worker_id(args)));
    config.model = args.model.clone();
    config.speedup = args.speedup;
    config.seed = args.seed;
    config.reply_length = ReplyLength {
        mean: args.reply_mean,
        spread: args.reply_spread,
    };
    config.body_limit_bytes = args.body_limit;
    config.header_timeout = crate::gateway_cmd::seconds("header-timeout", args.header_timeout)?;
    config.body_timeout = crate::gateway_cmd::seconds("body-timeout", args.body_timeout)?;
    config.nats = args.nats.as_ref().map(|url| NatsConfig {
        url: url.clone(),
        namespace: args.namespace.clone(),
        lease_ms: args.lease_ms,
        registration_token: args.registration_token.clone(),
        security: args.nats_security.security(),
    });
    config.zmq_pub = match args.zmq_pub.as_str() {
        "off" => None,
        "auto" => Some(format!("tcp://{}:0", zmq_host(args.host))),
        endpoint if endpoint.starts_with("tcp://") || endpoint.starts_with("ipc://") => {
            Some(endpoint.to_string())
        }
        other => {
            bail!("--zmq-pub must be auto, off or a ZMQ endpoint (tcp://HOST:PORT), got `{other}`")
        }
    };
    config.zmq_replay = match (args.zmq_replay.as_str(), &config.zmq_pub) {
        ("off", _) => None,
        ("auto", None) => None,
        (_, None) => bail!("--zmq-replay replays --zmq-pub's events; it needs --zmq-pub on"),
        ("auto", Some(_)) => Some(format!("tcp://{}:0", zmq_host(args.host))),
        (endpoint, Some(_)) if endpoint.starts_with("tcp://") || endpoint.starts_with("ipc://") => {
            Some(endpoint.to_string())
        }
        (other, Some(_)) => bail!(
            "--zmq-replay must be auto, off or a ZMQ endpoint (tcp://HOST:PORT), got `{other}`"
        ),
    };
    if config.zmq_replay.is_some() && args.zmq_replay_buffer == 0 {
        // A replay socket that keeps nothing would announce replay and never fill a gap.
        bail!("--zmq-replay-buffer must be at least 1 batch (--zmq-replay off offers no replay)");
    }
    config.zmq_replay_buffer = args.zmq_replay_buffer;
    config.zmq_event_encoding = match args.zmq_event_encoding {
        ZmqEventEncoding::Map => EventEncoding::TaggedMap,
        ZmqEventEncoding::Array => EventEncoding::Array,
    };
    if let Some(hostname) = &args.hostname {
        config.hostname = hostname.clone();
    }
    config.text = serving_text(args.tokenizer.as_deref(), args.chat_template.as_deref())?;
    Ok(config)
}

/// An id for an engine started without `--worker-id`: stable for one host name, address and
/// port (a restarted pod keeps it), distinct between engines on one machine, 31 bits so logs
/// stay readable.
fn derived_worker_id(args: &EngineArgs) -> u64 {
    let hostname = args
        .hostname
        .clone()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_default();
    // Port 0 is any free port: the process tells such engines apart.
    let process = if args.port == 0 {
        std::process::id()
    } else {
        0
    };
    let key = format!("{hostname}|{}|{}|{process}", args.host, args.port);
    xxhash_rust::xxh3::xxh3_64(key.as_bytes()) >> 33
}

/// ZMQ's spelling of the listen address (IPv6 in brackets).
fn zmq_host(host: IpAddr) -> String {
    match host {
        IpAddr::V4(v4) => v4.to_string(),
        IpAddr::V6(v6) => format!("[{v6}]"),
    }
}

/// `--tokenizer` and `--chat-template`, loaded; `None` when neither is given.
fn serving_text(
    tokenizer: Option<&std::path::Path>,
    chat_template: Option<&std::path::Path>,
) -> Result<Option<Arc<Preprocessor>>> {
    if tokenizer.is_none() && chat_template.is_none() {
        return Ok(None);
    }
    let (json, tokenizer_config) = match tokenizer {
        Some(folder) if folder.is_dir() => {
            let json = folder.join("tokenizer.json");
            if !json.is_file() {
                bail!(
                    "--tokenizer {}: the folder has no tokenizer.json",
                    folder.display()
                );
            }
            let config = folder.join("tokenizer_config.json");
            (Some(json), config.is_file().then_some(config))
        }
        Some(file) => (Some(file.to_path_buf()), None),
        None => (None, None),
    };
    let read = |path: &std::path::Path| {
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
    };
    let tokenizer = match &json {
        Some(path) => Arc::new(
            Tokenizer::from_hf_json(read(path)?.as_bytes())
                .with_context(|| format!("--tokenizer {}", path.display()))?,
        ),
        None => Tokenizer::builtin(),
    };
    let config = tokenizer_config.as_deref().map(read).transpose()?;
    // --chat-template wins; else the folder's tokenizer_config.json, whose BOS/EOS strings a
    // --chat-template may use too; a config without a template leaves the built-in one.
    let template = match (chat_template, config.as_deref()) {
        (Some(path), config) => read(path)
            .and_then(|source| Ok(ChatTemplate::from_source_and_config(source, config)?))
            .with_context(|| format!("--chat-template {}", path.display()))?
            .named(format!("the chat template {}", path.display())),
        (None, Some(config)) => match ChatTemplate::from_tokenizer_config(config) {
            Err(TemplateError::MissingTemplate) => ChatTemplate::llama3(),
            other => other
                .context("the --tokenizer folder's tokenizer_config.json")?
                .named("the chat template of the --tokenizer folder's tokenizer_config.json"),
        },
        (None, None) => ChatTemplate::llama3(),
    };
    Ok(Some(Arc::new(Preprocessor::new(tokenizer, template))))
}

pub fn run(args: EngineArgs) -> Result<()> {
    let mut config = config(&args)?;
    let (max_connections, connections) = args.connections.bound()?;
    config.max_connections = Some(max_connections);
    let spec = config.engine.spec_decode.as_ref().map(|s| {
        format!(
            "kvroute engine: speculative decoding {} (K = {}, mean acceptance {:.0}%, {:.2} tokens per step expected)",
            s.method.name(),
            s.draft_len,
            s.mean_acceptance_rate() * 100.0,
            s.mean_tokens_per_step()
        )
    });
    let runtime = crate::server_runtime()?;
    runtime.block_on(async {
        let server = EngineServer::bind(config).await.map_err(|e| match e {
            ServerError::Bind { addr, source } => {
                crate::listener_args::cannot_listen(addr, &source, "--port", Some("--host"))
            }
            // The engine's advice names its configuration field; here the flag sets it.
            ServerError::Engine(EngineConfigError::NoKvCapacity { profile }) => anyhow!(
                "the KV pool has no blocks: profile {profile:?} leaves no GPU memory for the \
                 cache; give the pool a size with --num-gpu-blocks N (or the profile file's \
                 engine_defaults.num_gpu_blocks), or fix the profile's memory fields"
            ),
            other => other.into(),
        })?;
        let info = server.info();
        println!(
            "kvroute engine: worker {} ({} on {}, {} KV blocks of {} tokens) listening on {}",
            info.worker.unwrap_or_default().0,
            info.model,
            info.profile.as_deref().unwrap_or_default(),
            info.limits.kv_capacity_blocks.unwrap_or_default(),
            info.block_size.unwrap_or_default(),
            server.url()
        );
        println!("kvroute engine: {connections}");
        if info.role != engine_server::WorkerRole::Both {
            println!(
                "kvroute engine: role {} (vLLM kv_role {}), KV link {:?}",
                info.role,
                info.role.vllm_kv_role(),
                args.kv_link
            );
        }
        if let Some(line) = &spec {
            println!("{line}");
        }
        if let Some(endpoint) = &info.zmq_endpoint {
            println!("kvroute engine: vLLM-format KV events on {endpoint}");
        }
        if let Some(endpoint) = &info.zmq_replay_endpoint {
            println!("kvroute engine: KV event replay on {endpoint}");
        }
        if let Some(subject) = &info.nats_kv_subject {
            println!("kvroute engine: KV events on NATS subject {subject}");
        }
        server.run_until_signal().await;
        Ok(())
    })
}
