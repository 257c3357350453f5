//! `kvroute loadgen` (the load generator and dashboard against any OpenAI-compatible endpoint)
//! and `kvroute demo` (a whole simulated cluster, its gateway, the load generator and the
//! dashboard on one machine).

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Parser;
use engine_server::EngineServerHandle;
use gateway::Gateway;
use loadgen::ladder::{LadderConfig, PhaseSetup};
use loadgen::scenario::PoolKind;
use loadgen::{
    Baseline, DriveConfig, LaneSpec, Loadgen, LoadgenConfig, PhaseReference, ScalingConfig,
    UserSimulator,
};
use nanotime::Nanos;
use router::PolicyKind;
use workload::scenario::ScenarioConfig;
use workload::{Distribution, Mix, WorkloadConfig};

use crate::demo_fleet::{DemoFleet, EngineTemplate};
use crate::demo_ladder::{self, DemoLadder};
use crate::demo_prometheus::{self, DemoPrometheus, EngineTarget};
use crate::trace_args::LoadedTrace;
use crate::{bench_cmd, gateway_cmd};

/// Workload, user and dashboard settings shared by `loadgen` and `demo`.
#[derive(Debug, clap::Args)]
pub struct DriveArgs {
    /// Conversations kept open at once (the dashboard's slider moves it live: 60–180).
    #[arg(long, default_value_t = 60)]
    concurrency: u32,
    /// Seed 004's workload mix: weights of A (multi-turn chat), B (summarisation of a 4k–18k
    /// token document) and C (reasoning, long answers), e.g. `A=40,B=30,C=30`. Default: chat
    /// only. Changed live with `POST /api/workload/config {"mix": …}`.
    #[arg(long, value_name = "A=N,B=N,C=N", value_parser = crate::sim_cmd::parse_mix)]
    mix: Option<Mix>,
    /// Open loop: new sessions (an A conversation with all its turns, or one B/C request)
    /// arrive at this many per second (Poisson, seeded) instead of --concurrency being open
    /// at all times. Changed live with `POST /api/workload/config {"rate": …}` (`null`: back
    /// to the closed loop).
    #[arg(long, value_name = "RPS", value_parser = crate::sim_cmd::parse_rate)]
    rate: Option<f64>,
    /// Start the workload at once instead of waiting for Start in the dashboard or the API.
    #[arg(long)]
    start: bool,
    /// The dashboard's and API's connection bound (its WebSockets included).
    #[command(flatten)]
    connections: crate::listener_args::ConnectionArgs,
    /// Workload seed: the same seed gives the same conversations (passages, turns, lengths).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Mean think time of the simulated user between a reply and the next question, seconds
    /// (exponential; 0, the seed's calibration, sends the next question at once).
    #[arg(long, default_value_t = 0.0)]
    think_time: f64,
    /// The first conversations start spread over this many seconds.
    #[arg(long, default_value_t = 10.0)]
    ramp: f64,
    /// Let the model end its replies (no `ignore_eos`): lengths then differ between targets.
    #[arg(long)]
    natural_replies: bool,
    /// An OpenAI-compatible chat completions URL of a "user model" that writes the follow-up
    /// questions (seed 000's 8B model), e.g. https://inference.example/v1/chat/completions.
    #[arg(long, requires = "user_model")]
    user_model_url: Option<String>,
    /// The user model's name.
    #[arg(long, requires = "user_model_url")]
    user_model: Option<String>,
    /// Environment variable holding the user model's API key.
    #[arg(long, default_value = "USER_MODEL_API_KEY")]
    user_model_api_key_env: String,
    /// The recorded baseline for the RR columns and the static table: a results.json written
    /// by `kvroute bench`. Default: `demo` simulates its own cluster at start-up; `loadgen`
    /// shows the shipped simulation of seed 002's deployment (docs/results/).
    #[arg(long, conflicts_with = "no_baseline")]
    baseline: Option<PathBuf>,
    /// Hide the RR columns and the static table.
    #[arg(long)]
    no_baseline: bool,
    /// Reference lines for the ITL and TTFT charts: a results.json written by `kvroute bench
    /// --phases` (seed 003's ladder). Default: `demo` uses the shipped ladder
    /// (docs/phases/) when its setup matches the demo's workers and profile; `loadgen` none.
    #[arg(
        long,
        value_name = "RESULTS_JSON",
        conflicts_with = "no_phase_reference"
    )]
    phase_reference: Option<PathBuf>,
    /// With --phase-reference: the setup to draw (default: the file's first).
    #[arg(long, value_name = "SETUP", requires = "phase_reference")]
    phase_setup: Option<String>,
    /// No reference lines.
    #[arg(long)]
    no_phase_reference: bool,
    /// Seconds before a turn that has not finished counts as an error.
    #[arg(long, default_value_t = 600.0)]
    request_timeout: f64,
    /// Ended conversations kept for the Conversations page.
    #[arg(long, default_value_t = 500)]
    conversations_kept: usize,
    /// The sliding window of the live figures, seconds.
    #[arg(long, default_value_t = 60.0)]
    window: f64,
    /// Run this many (modelled) seconds after the start, write --report, and exit: a
    /// measurement instead of a demo. The exit status is 1 if any request failed.
    #[arg(long, requires = "start")]
    run_for: Option<f64>,
    /// With --run-for: where to write the final status (the API's JSON).
    #[arg(long, requires = "run_for")]
    report: Option<PathBuf>,
    /// Seed 004's auto-mode cycle: a TOML file of phases (mix, rate, pool sizes, duration;
    /// see crates/workload/scenarios/seed004.toml). Default: the built-in seed 004 cycle.
    /// `POST /api/scenario/auto` starts it.
    #[arg(long, value_name = "FILE")]
    scenario: Option<PathBuf>,
    /// Start in auto mode: the scenario drives the mix, the rate and the pools (and starts the
    /// workload); the autoscalers are paused.
    #[arg(long)]
    auto: bool,
    /// The autoscalers' polling interval, modelled seconds (seed 004's KEDA: 15).
    #[arg(long, value_name = "SECONDS", default_value_t = 15.0)]
    autoscale_interval: f64,
    /// The prefill pool's scaler: TTFT p95 target per replica, modelled seconds (seed 004: 0.5).
    #[arg(long, value_name = "SECONDS", default_value_t = 0.5)]
    ttft_threshold: f64,
    /// The decode pool's scaler: ITL p95 target per replica, modelled seconds (seed 004: 0.05).
    #[arg(long, value_name = "SECONDS", default_value_t = 0.05)]
    itl_threshold: f64,
}

impl DriveArgs {
    /// The workload and dashboard settings, checked; `time_scale` is --speedup.
    fn drive(&self, time_scale: f64) -> Result<DriveConfig> {
        if !(1..=loadgen::MAX_CONCURRENCY).contains(&self.concurrency) {
            bail!(
                "--concurrency must be between 1 and {} conversations, got {}",
                loadgen::MAX_CONCURRENCY,
                self.concurrency
            );
        }
        if !(time_scale.is_finite() && time_scale > 0.0) {
            bail!(
                "--speedup must be a positive number (model seconds per wall second), got \
                 {time_scale}"
            );
        }
        if !(self.think_time.is_finite() && self.think_time >= 0.0) {
            bail!(
                "--think-time must be a number of seconds ≥ 0, got {}",
                self.think_time
            );
        }
        if !(self.ramp.is_finite() && self.ramp >= 0.0) {
            bail!("--ramp must be a number of seconds ≥ 0, got {}", self.ramp);
        }
        if !(self.window.is_finite() && self.window >= 1.0) {
            bail!("--window must be at least 1 second, got {}", self.window);
        }
        if let Some(run_for) = self.run_for {
            if !(run_for.is_finite() && run_for > 0.0) {
                bail!("--run-for must be a positive number of seconds, got {run_for}");
            }
        }
        if !(self.request_timeout.is_finite() && self.request_timeout > 0.0) {
            bail!("--request-timeout must be a positive number of seconds");
        }
        let think_time_s = if self.think_time == 0.0 {
            Distribution::Constant { value: 0.0 }
        } else {
            Distribution::Exponential {
                mean: self.think_time,
                // The tail is cut at ten means so that one user cannot stall a measurement.
                max: 10.0 * self.think_time,
            }
        };
        let user = match (&self.user_model_url, &self.user_model) {
            (Some(url), Some(model)) => UserSimulator::Model {
                url: url.clone(),
                model: model.clone(),
                api_key: std::env::var(&self.user_model_api_key_env).ok(),
            },
            _ => UserSimulator::Builtin,
        };
        Ok(DriveConfig {
            workload: WorkloadConfig {
                concurrency: self.concurrency,
                think_time_s,
                ramp_s: self.ramp,
                mix: self.mix.unwrap_or_default(),
                rate_rps: self.rate,
                ..WorkloadConfig::default()
            },
            seed: self.seed,
            user,
            fixed_output_length: !self.natural_replies,
            request_timeout: Duration::from_secs_f64(self.request_timeout),
            conversations_kept: self.conversations_kept,
            window: Duration::from_secs_f64(self.window),
            time_scale,
            ..DriveConfig::default()
        })
    }

    /// The scenario (--scenario or seed 004's) and the autoscalers (seed 004's, with the
    /// interval and thresholds of the flags), no fleet yet.
    fn scaling(&self) -> Result<ScalingConfig> {
        let scenario = match &self.scenario {
            None => ScenarioConfig::seed004(),
            Some(path) => read_scenario(path)?,
        };
        let mut scaling = ScalingConfig {
            scenario,
            auto: self.auto,
            ..ScalingConfig::default()
        };
        if !(self.autoscale_interval.is_finite() && self.autoscale_interval > 0.0) {
            bail!(
                "--autoscale-interval must be a positive number of seconds, got {}",
                self.autoscale_interval
            );
        }
        for (flag, value) in [
            ("--ttft-threshold", self.ttft_threshold),
            ("--itl-threshold", self.itl_threshold),
        ] {
            if !(value.is_finite() && value > 0.0) {
                bail!("{flag} must be a positive number of seconds, got {value}");
            }
        }
        let interval = Nanos::from_secs_f64(self.autoscale_interval);
        scaling.prefill.polling_interval = interval;
        scaling.decode.polling_interval = interval;
        // The activation thresholds keep the seed's ratio to the threshold (0.1 / 0.5 and
        // 0.01 / 0.05).
        scaling.prefill.threshold = self.ttft_threshold;
        scaling.prefill.activation_threshold = self.ttft_threshold / 5.0;
        scaling.decode.threshold = self.itl_threshold;
        scaling.decode.activation_threshold = self.itl_threshold / 5.0;
        scaling.validate().map_err(|e| anyhow::anyhow!(e))?;
        Ok(scaling)
    }

    /// The reference lines from --phase-reference, else `default`.
    fn phase_reference(
        &self,
        default: impl FnOnce() -> Option<PhaseReference>,
    ) -> Result<Option<PhaseReference>> {
        if self.no_phase_reference {
            return Ok(None);
        }
        let Some(path) = &self.phase_reference else {
            return Ok(default());
        };
        let json =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let source = path.display().to_string();
        PhaseReference::from_results_json(&json, &source, self.phase_setup.as_deref())
            .map(Some)
            .with_context(|| format!("--phase-reference {source}"))
    }

    fn baseline(&self) -> Result<Option<Baseline>> {
        if self.no_baseline {
            return Ok(None);
        }
        match &self.baseline {
            None => Ok(Some(Baseline::shipped()?)),
            Some(path) => {
                let json = std::fs::read_to_string(path)
                    .with_context(|| format!("reading {}", path.display()))?;
                let source = path.display().to_string();
                Ok(Some(
                    Baseline::from_results_json(&json, &source, "round_robin")
                        .with_context(|| format!("baseline {source}"))?,
                ))
            }
        }
    }
}

/// Reads and checks a --scenario file; every error names the file.
fn read_scenario(path: &Path) -> Result<ScenarioConfig> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("--scenario: reading {}", path.display()))?;
    ScenarioConfig::from_toml(&text)
        .map_err(|e| anyhow::anyhow!("--scenario {}: {e}", path.display()))
}

#[derive(Debug, clap::Args)]
pub struct LoadgenArgs {
    /// Address of the dashboard and control API.
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Bearer token of the dashboard's control API and WebSocket; required when --host is
    /// not a loopback address. Open the dashboard as http://HOST:PORT/?token=TOKEN.
    #[arg(long, env = "KVROUTE_API_TOKEN", hide_env_values = true)]
    api_token: Option<String>,
    /// Base URL of the OpenAI-compatible endpoint to load (a gateway, vLLM, …), without /v1
    /// (a final /v1, as in OpenAI SDKs' base URLs, is dropped).
    #[arg(long)]
    target: String,
    /// The model name sent in requests.
    #[arg(long, default_value = "llama-3.1-70b-instruct")]
    model: String,
    /// Environment variable holding the target's API key (sent as a bearer token).
    #[arg(long, default_value = "OPENAI_API_KEY")]
    api_key_env: String,
    /// The dashboard's label for this target.
    #[arg(long, default_value = "live")]
    name: String,
    /// Prometheus endpoint with the gateway's dynamo_frontend_* metrics (KV hit rate, queued);
    /// default: TARGET/metrics.
    #[arg(long)]
    gateway_metrics: Option<String>,
    /// Do not read gateway metrics (the KV hit and Queued cards show "—").
    #[arg(long, conflicts_with = "gateway_metrics")]
    no_gateway_metrics: bool,
    /// A worker's Prometheus endpoint with DCGM-style GPU metrics (repeat per worker).
    #[arg(long = "worker-metrics", value_name = "URL")]
    worker_metrics: Vec<String>,
    /// A Prometheus server scraping the gateway and the workers (http://HOST:9090): the KV hit
    /// rate, queue and GPU view then come from its query API, with seed 001's queries.
    #[arg(long, value_name = "URL")]
    prometheus_url: Option<String>,
    /// Model seconds per wall second of the target (a simulated cluster's --speedup): the
    /// dashboard then shows modelled time.
    #[arg(long, default_value_t = 1.0)]
    speedup: f64,
    #[command(flatten)]
    drive: DriveArgs,
    /// With --trace: this many requests in flight at most (more due at once are dropped and
    /// counted).
    #[arg(long, value_name = "N", default_value_t = 1024, requires = "trace",
          value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    trace_max_open: u64,
    /// With --trace: replay it without the dashboard, printing progress to stderr every 5 s and
    /// the summary to stdout, and exit when the replay ends (status 1 if any request failed).
    #[arg(long, requires = "trace")]
    headless: bool,
    /// With --trace: replay it headless and print the summary as JSON (implies --headless).
    #[arg(long, requires = "trace")]
    json: bool,
    #[command(flatten)]
    trace: crate::trace_args::TraceArgs,
}

#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    /// Address of the dashboard (0.0.0.0 to show it to other machines, e.g. a booth screen).
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// Dashboard port.
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Bearer token of the dashboard's control API and WebSocket; required when --host is
    /// not a loopback address. Open the dashboard as http://HOST:PORT/?token=TOKEN.
    #[arg(long, env = "KVROUTE_API_TOKEN", hide_env_values = true)]
    api_token: Option<String>,
    /// The gateway's port (with --compare, the second gateway takes the next one).
    #[arg(long, default_value_t = 8000)]
    gateway_port: u16,
    /// Simulated GPU workers per cluster.
    #[arg(long, default_value_t = 3)]
    workers: u32,
    /// Disaggregated serving: this many prefill workers (`kvroute engine --role prefill`) per
    /// cluster, beside --decode-workers, instead of --workers aggregated ones.
    #[arg(
        long,
        default_value_t = 0,
        conflicts_with = "workers",
        requires = "decode_workers"
    )]
    prefill_workers: u32,
    /// Disaggregated serving: this many decode workers (`--role decode`) per cluster.
    #[arg(
        long,
        default_value_t = 0,
        conflicts_with = "workers",
        requires = "prefill_workers"
    )]
    decode_workers: u32,
    /// Hardware profile of the workers (see `kvroute profiles`).
    #[arg(long, default_value = "h200-llama70b-fp8")]
    profile: String,
    /// Run the simulated GPUs this many times faster than real time; the dashboard shows
    /// modelled time.
    #[arg(long, default_value_t = 1.0)]
    speedup: f64,
    /// The gateway's routing policy.
    #[arg(long, default_value = "kv_load")]
    router: String,
    /// Two routers, comma-separated (e.g. round_robin,kv): two identical clusters fed the same
    /// conversations, compared live side by side.
    #[arg(long, value_name = "A,B", conflicts_with = "router")]
    compare: Option<String>,
    /// Drive an external gateway at this URL instead of starting a simulated cluster.
    #[arg(long, conflicts_with = "compare")]
    target: Option<String>,
    /// Also start a Prometheus server (its `prometheus` binary must be installed) on
    /// deploy/prometheus/demo.yml, scraping the gateway, the workers and the load generator;
    /// the dashboard then reads the KV hit rate, queue and GPUs from it, and Grafana can show
    /// deploy/grafana/'s dashboards. One simulated cluster only (its series carry
    /// namespace="kvroute").
    #[arg(long, conflicts_with_all = ["compare", "target"])]
    prometheus: bool,
    /// The Prometheus binary to run with --prometheus.
    #[arg(
        long,
        default_value = "prometheus",
        value_name = "PATH",
        requires = "prometheus"
    )]
    prometheus_bin: PathBuf,
    /// Prometheus's port with --prometheus (0: any free port).
    #[arg(long, default_value_t = 9090, requires = "prometheus")]
    prometheus_port: u16,
    /// Speculative decoding on the simulated workers: off, or a configuration the profile
    /// names (draft: Llama-3.1-8B draft model; eagle3: EAGLE-3 heads).
    #[arg(long, default_value = "off", value_name = "off|draft|eagle3")]
    spec_decode: String,
    /// Start at a step of seed 003's ladder: baseline (round-robin), kv (--router), draft or
    /// eagle3 (--router + speculative decoding). Sets --router and --spec-decode.
    #[arg(
        long,
        value_name = "baseline|kv|draft|eagle3",
        conflicts_with = "compare"
    )]
    phase: Option<String>,
    #[command(flatten)]
    drive: DriveArgs,
}

impl DemoArgs {
    /// Whether the clusters serve disaggregated (prefill and decode pools).
    fn disaggregated(&self) -> bool {
        self.prefill_workers > 0 || self.decode_workers > 0
    }

    /// Workers per cluster, every pool together.
    fn worker_count(&self) -> u32 {
        if self.disaggregated() {
            self.prefill_workers + self.decode_workers
        } else {
            self.workers
        }
    }

    /// Worker `w`'s role: the first --prefill-workers prefill, the rest decode; aggregated
    /// (`both`) without the pools.
    fn role_of(&self, w: u32) -> &'static str {
        match (self.disaggregated(), w < self.prefill_workers) {
            (false, _) => "both",
            (true, true) => "prefill",
            (true, false) => "decode",
        }
    }

    /// The gateway's router and the workers' speculative decoding, after --phase.
    fn router_and_spec(&self) -> Result<(String, String)> {
        let Some(phase) = &self.phase else {
            return Ok((self.router.clone(), self.spec_decode.clone()));
        };
        let kv_router = self
            .router
            .parse::<PolicyKind>()
            .map_err(|e| anyhow::anyhow!("router {:?}: {e}", self.router))?;
        let step = sim::ladder::ladder(kv_router)
            .into_iter()
            .find(|p| p.name == phase)
            .with_context(|| {
                format!(
                    "--phase: unknown phase {phase:?}; the ladder's phases are {}",
                    sim::ladder::PHASES.join(", ")
                )
            })?;
        Ok((
            step.router.name().to_string(),
            step.spec_decode.unwrap_or("off").to_string(),
        ))
    }
}

#[derive(Debug, Parser)]
struct GatewayFlags {
    #[command(flatten)]
    args: gateway_cmd::GatewayArgs,
}

/// --target as the base URL the load generator puts `/v1/…` under: without a trailing `/`,
/// and without a final `/v1` path segment, which OpenAI SDKs' base URLs end in and users paste
/// (requests would go to `/v1/v1/…` and all fail with 404); a note on stderr says so once.
fn base_url(command: &str, target: &str) -> String {
    let trimmed = target.trim_end_matches('/');
    // The URL's last path segment, not a host or query that happens to end so.
    let ends_in_v1 = reqwest::Url::parse(trimmed).is_ok_and(|url| {
        url.query().is_none() && url.path_segments().and_then(|mut s| s.next_back()) == Some("v1")
    });
    match trimmed.strip_suffix("/v1") {
        Some(base) if ends_in_v1 => {
            eprintln!(
                "kvroute {command}: note: --target {target} ends in /v1; using {base} (the load \
                 generator adds /v1/… to it)"
            );
            base.to_owned()
        }
        _ => trimmed.to_owned(),
    }
}

pub fn run_loadgen(args: LoadgenArgs) -> Result<()> {
    if !(args.target.starts_with("http://") || args.target.starts_with("https://")) {
        bail!(
            "--target must be an http:// or https:// URL, got {:?}",
            args.target.trim_end_matches('/')
        );
    }
    let target = base_url("loadgen", &args.target);
    // A missing or garbled trace is refused here, before anything listens.
    let trace = args.trace.load()?;
    if let Some(loaded) = &trace {
        if args.headless || args.json {
            return replay_trace(&args, &target, loaded);
        }
        if args.drive.run_for.is_some() {
            bail!(
                "--run-for does not apply to a trace replay, which ends with the trace: watch it \
                 on the dashboard, or add --headless (--json) for a summary on stdout"
            );
        }
        if args.drive.auto {
            bail!("--auto does not apply to a trace replay: the trace sets the load");
        }
    }
    let mut lane = LaneSpec::for_gateway(&args.name, None, &target, &args.model);
    lane.api_key = std::env::var(&args.api_key_env).ok();
    if args.no_gateway_metrics {
        lane.gateway_metrics = None;
    } else if let Some(url) = &args.gateway_metrics {
        lane.gateway_metrics = Some(url.clone());
    }
    lane.worker_metrics = args.worker_metrics.clone();
    lane.prometheus = args.prometheus_url.clone();
    let scaling = args.drive.scaling()?;
    let config = LoadgenConfig {
        listen: SocketAddr::new(args.host, args.port),
        drive: args.drive.drive(args.speedup)?,
        baseline: args.drive.baseline()?,
        phase_reference: args.drive.phase_reference(|| None)?,
        autostart: args.drive.start,
        scaling,
        api_token: args.api_token.clone(),
        max_connections: Some(args.drive.connections.bound()?.0),
        trace: trace
            .as_ref()
            .map(|loaded| trace_setup(&args, &target, loaded)),
        ..LoadgenConfig::new(vec![lane])
    };
    let runtime = crate::server_runtime()?;
    runtime.block_on(async {
        let loadgen = Loadgen::bind(config).await.map_err(dashboard_bind_error)?;
        println!("kvroute loadgen: dashboard on {}", loadgen.url());
        if args.api_token.is_some() {
            println!(
                "kvroute loadgen: the API needs its token: open {}/?token=TOKEN",
                loadgen.url()
            );
        }
        match &trace {
            Some(loaded) => println!(
                "kvroute loadgen: trace {} against {target}/v1/completions (oracle prefix-hit \
                 bound {:.1}%); {}; Ctrl-C stops",
                loaded.describe(),
                loaded.trace.oracle_prefix_hit_rate() * 100.0,
                if args.drive.start {
                    "replaying now"
                } else {
                    "press Start on the dashboard (or pass --start)"
                }
            ),
            None => println!("kvroute loadgen: driving {target}; Ctrl-C stops"),
        }
        let summaries = trace.as_ref().map(|loaded| {
            tokio::spawn(print_replay_ends(
                loadgen.app().clone(),
                loaded.describe(),
                args.trace_max_open,
            ))
        });
        let failures = run_or_wait(&loadgen, &args.drive, args.speedup).await?;
        if let Some(task) = summaries {
            task.abort();
        }
        let app = loadgen.app().clone();
        let stopping_replay = app.trace.as_ref().is_some_and(|t| t.is_running());
        println!("kvroute loadgen: shutting down");
        loadgen.shutdown().await;
        // The replay Ctrl-C stopped: its summary, as a headless replay prints it.
        if let (true, Some(loaded), Some(handle)) = (stopping_replay, &trace, &app.trace) {
            print_trace_summary(
                &loaded.describe(),
                args.trace_max_open,
                &handle.status().replay,
            );
        }
        failures.check()
    })
}

/// The replay --trace and its flags ask for, against `target`.
fn trace_replay_config(
    args: &LoadgenArgs,
    target: &str,
    loaded: &LoadedTrace,
) -> loadgen::trace::TraceReplayConfig {
    let mut config = loadgen::trace::TraceReplayConfig::new(
        target,
        &args.model,
        Arc::clone(&loaded.trace),
        loaded.speed,
    );
    config.api_key = std::env::var(&args.api_key_env).ok();
    config.max_open = usize::try_from(args.trace_max_open).unwrap_or(usize::MAX);
    config
}

/// The dashboard's trace replay (`kvroute loadgen --trace` without --headless).
fn trace_setup(
    args: &LoadgenArgs,
    target: &str,
    loaded: &LoadedTrace,
) -> loadgen::trace_run::TraceSetup {
    loadgen::trace_run::TraceSetup {
        replay: trace_replay_config(args, target, loaded),
        file: loaded.path.display().to_string(),
        requests_in_file: loaded.requests_in_file,
    }
}

/// Prints a headless replay's progress to stderr.
struct ProgressLines {
    bound: f64,
}

impl loadgen::trace::ReplayObserver for ProgressLines {
    fn progress(&mut self, s: &loadgen::trace::TraceReplayStatus) {
        if s.state != loadgen::trace::ReplayState::Running {
            // The summary follows on stdout.
            return;
        }
        eprintln!(
            "kvroute loadgen: {:.0} s: {} of {} sent, {} finished, {} failed, {} dropped; \
             prefix-hit {} of a possible {} on those finished (whole trace {:.1}%)",
            s.elapsed_s,
            s.stats.issued,
            s.stats.requests,
            s.stats.finished,
            s.stats.failed,
            s.stats.dropped,
            hit_rate(s),
            bound_finished(s),
            self.bound * 100.0
        );
    }
}

fn hit_rate(s: &loadgen::trace::TraceReplayStatus) -> String {
    percent(s.kv_hit_rate)
}

/// The oracle bound over the requests `hit_rate` is over, and why the server's rate is above
/// it when it is (the bound assumes a cache empty at the start).
fn bound_finished(s: &loadgen::trace::TraceReplayStatus) -> String {
    let bound = percent(s.oracle_hit_rate_finished);
    if s.above_bound {
        format!("{bound} (above it: the server's cache was not empty at the start)")
    } else {
        bound
    }
}

fn percent(rate: Option<f64>) -> String {
    rate.map_or("–".to_string(), |h| format!("{:.1}%", h * 100.0))
}

/// `kvroute loadgen --trace --headless`: the trace in real time against --target, no dashboard.
fn replay_trace(args: &LoadgenArgs, target: &str, loaded: &LoadedTrace) -> Result<()> {
    use loadgen::trace::replay_trace;

    let config = trace_replay_config(args, target, loaded);
    let bound = loaded.trace.oracle_prefix_hit_rate();
    eprintln!(
        "kvroute loadgen: replaying trace {} against {target}/v1/completions; the trace's \
         oracle prefix-hit bound is {:.1}%; Ctrl-C stops",
        loaded.describe(),
        bound * 100.0
    );
    let runtime = crate::server_runtime()?;
    let status = runtime.block_on(async {
        let cancel = loadgen::trace::CancellationToken::new();
        let on_signal = cancel.clone();
        tokio::spawn(async move {
            if tokio::signal::ctrl_c().await.is_ok() {
                on_signal.cancel();
            }
        });
        replay_trace(
            config,
            cancel,
            Duration::from_secs(5),
            &mut ProgressLines { bound },
        )
        .await
    });
    if args.json {
        println!("{}", serde_json::to_string_pretty(&status)?);
    } else {
        print_trace_summary(&loaded.describe(), args.trace_max_open, &status);
    }
    let s = &status.stats;
    Failures {
        failed: s.failed,
        of: s.finished + s.failed,
        example: None,
        see: if args.json {
            " (why: `errors` in the JSON above)"
        } else {
            " (why: the errors above)"
        },
    }
    .check()
}

/// A replay's summary on stdout: counts, TTFT, the server's hit rate beside the bound, errors.
fn print_trace_summary(describe: &str, max_open: u64, status: &loadgen::trace::TraceReplayStatus) {
    let s = &status.stats;
    {
        println!(
            "trace {}: {} of {} requests sent in {:.0} s; {} finished, {} failed, {} dropped \
             (over {} open){}",
            describe,
            s.issued,
            s.requests,
            status.elapsed_s,
            s.finished,
            s.failed,
            s.dropped,
            max_open,
            if status.cancelled > 0 {
                format!("; stopped, {} in flight cancelled", status.cancelled)
            } else {
                String::new()
            }
        );
        let ms = |v: Option<f64>| v.map_or("–".to_string(), |x| format!("{x:.1}"));
        println!(
            "  TTFT p50 {} ms p95 {} ms; prefix-hit rate {} of prompt tokens (the server's \
             cached_tokens) of a possible {} on the {} requests that reported it; the whole \
             trace's oracle bound {:.1}%",
            ms(status.ttft_ms.p50),
            ms(status.ttft_ms.p95),
            hit_rate(status),
            bound_finished(status),
            status.usage_requests,
            status.oracle_prefix_hit_rate * 100.0
        );
        for e in &status.errors {
            println!("  error: {e}");
        }
    }
}

/// Prints the summary of each dashboard replay that ends (the panel shows it too), until the
/// load generator shuts down.
async fn print_replay_ends(app: Arc<loadgen::App>, describe: String, max_open: u64) {
    use loadgen::trace::ReplayState;

    let Some(trace) = &app.trace else { return };
    let mut was_running = false;
    let mut ticker = tokio::time::interval(Duration::from_millis(500));
    loop {
        ticker.tick().await;
        let status = trace.status().replay;
        let running = status.state == ReplayState::Running;
        if was_running && !running {
            print_trace_summary(&describe, max_open, &status);
        }
        was_running = running;
    }
}

/// Round-robin and the demo's routers on the demo's cluster, simulated by `kvroute bench` at
/// the slider's levels with the seed's workload, the KV column being the demo's router.
fn simulated_baseline(args: &DemoArgs, routers: &[String], spec: &str) -> Result<Baseline> {
    let started = std::time::Instant::now();
    let mut list = vec!["round_robin".to_owned()];
    list.extend(routers.iter().filter(|r| *r != "round_robin").cloned());
    if list.len() == 1 {
        list.push("kv_load".to_owned());
    }
    let flags = BenchFlags::try_parse_from([
        "bench".to_owned(),
        format!("--routers={}", list.join(",")),
        "--sweeps=2".to_owned(),
        format!("--workers={}", args.workers),
        format!("--profile={}", args.profile),
        "--path-latency-ms=0".to_owned(),
        "--no-oracle".to_owned(),
        // The same engines as the live cluster's, speculative decoding included.
        format!("--spec-decode={spec}"),
    ])
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    let (results, _, _) = bench_cmd::simulate(&flags.args, false)?;
    let json = serde_json::to_string(&results)?;
    let source = format!(
        "simulated at start-up: kvroute bench --routers {} --workers {} --profile {} \
         --spec-decode {spec} --path-latency-ms 0 --sweeps 2 (seed 002's workload)",
        list.join(","),
        args.workers,
        args.profile
    );
    let preferred: Vec<&str> = list[1..].iter().map(String::as_str).collect();
    let baseline =
        Baseline::from_results_json_preferring(&json, &source, "round_robin", &preferred)?;
    println!(
        "kvroute demo: simulated the recorded comparison ({}) in {:.1} s",
        list.join(" vs "),
        started.elapsed().as_secs_f64()
    );
    Ok(baseline)
}

#[derive(Debug, Parser)]
struct BenchFlags {
    #[command(flatten)]
    args: bench_cmd::BenchArgs,
}

/// How the demo starts its engines: `kvroute engine` with the demo's profile, speed and
/// speculative decoding.
fn engine_template(args: &DemoArgs, spec: &str) -> EngineTemplate {
    EngineTemplate {
        profile: args.profile.clone(),
        speedup: args.speedup,
        spec: spec.to_owned(),
    }
}

/// One simulated cluster: engines and their gateway.
pub(crate) struct Cluster {
    pub router: String,
    pub engines: Vec<EngineServerHandle>,
    pub gateway: Gateway,
}

/// Starts one engine per entry of `roles` (`both`, `prefill`, `decode`) from `template`, and
/// their gateway with `router` on `gateway_port` (0: any free port).
pub(crate) async fn start_cluster(
    template: &EngineTemplate,
    roles: &[&str],
    router: &str,
    gateway_port: u16,
) -> Result<Cluster> {
    let mut engines = Vec::new();
    for (w, role) in (0..).zip(roles) {
        // Each cluster has its own gateway, so both number their workers from 0: the
        // transcripts' worker ids then match the GPU cards' names (worker-N) on either side.
        match template.start(w, role).await {
            Ok(engine) => engines.push(engine),
            Err(e) => {
                for engine in engines {
                    engine.shutdown().await;
                }
                return Err(e);
            }
        }
    }
    let mut gateway_flags = vec![
        "gateway".to_owned(),
        format!("--port={gateway_port}"),
        format!("--router-mode={router}"),
    ];
    gateway_flags.extend(engines.iter().map(|e| format!("--worker={}", e.url())));
    let gateway = match GatewayFlags::try_parse_from(gateway_flags)
        .map_err(|e| anyhow::anyhow!("{e}"))
        .and_then(|flags| gateway_cmd::config(&flags.args))
    {
        Ok(config) => Gateway::bind(config)
            .await
            .map_err(|e| match e {
                gateway::GatewayError::Bind { addr, source } => {
                    crate::listener_args::cannot_listen(addr, &source, "--gateway-port", None)
                }
                other => other.into(),
            })
            .with_context(|| format!("starting the {router} gateway")),
        Err(e) => Err(e),
    };
    match gateway {
        Ok(gateway) => Ok(Cluster {
            router: router.to_owned(),
            engines,
            gateway,
        }),
        // A cluster that cannot start leaves no engine behind.
        Err(e) => {
            for engine in engines {
                engine.shutdown().await;
            }
            Err(e)
        }
    }
}

/// The dashboard's listener error, with what to do when it is its address that failed.
fn dashboard_bind_error(e: loadgen::LoadgenError) -> anyhow::Error {
    match e {
        loadgen::LoadgenError::Bind { addr, source } => {
            crate::listener_args::cannot_listen(addr, &source, "--port", Some("--host"))
        }
        other => other.into(),
    }
}

impl DemoArgs {
    /// Refuses two listeners of the demo on one port (0, any free port, never clashes): the
    /// dashboard (--port), the gateways (--gateway-port, and the next port with --compare) and
    /// Prometheus (--prometheus-port).
    fn check_ports(&self) -> Result<()> {
        let mut ports: Vec<(u16, String)> = Vec::new();
        if self.target.is_none() && self.gateway_port != 0 {
            ports.push((self.gateway_port, "--gateway-port (the gateway)".to_owned()));
            if self.compare.is_some() {
                let Some(second) = self.gateway_port.checked_add(1) else {
                    bail!(
                        "--gateway-port {} is too high for two gateways: --compare puts the \
                         second on the next port",
                        self.gateway_port
                    );
                };
                ports.push((
                    second,
                    format!("the second gateway of --compare (--gateway-port + 1 = {second})"),
                ));
            }
        }
        if self.port != 0 {
            ports.push((self.port, "--port (the dashboard)".to_owned()));
        }
        if self.prometheus && self.prometheus_port != 0 {
            ports.push((
                self.prometheus_port,
                "--prometheus-port (Prometheus)".to_owned(),
            ));
        }
        for (i, (port, first)) in ports.iter().enumerate() {
            if let Some((_, second)) = ports[i + 1..].iter().find(|(p, _)| p == port) {
                bail!(
                    "port {port} is given twice: to {first} and to {second}; each needs a port \
                     of its own, so change one of them"
                );
            }
        }
        Ok(())
    }
}

pub fn run_demo(args: DemoArgs) -> Result<()> {
    if args.workers == 0 || args.workers > 64 {
        bail!("--workers must be between 1 and 64, got {}", args.workers);
    }
    args.check_ports()?;
    // Bad workload, dashboard or --speedup flags fail here, before anything starts or prints.
    let drive = args.drive.drive(args.speedup)?;
    if args.disaggregated() {
        for (flag, n) in [
            ("--prefill-workers", args.prefill_workers),
            ("--decode-workers", args.decode_workers),
        ] {
            if n == 0 || n > 32 {
                bail!(
                    "{flag} must be between 1 and 32 (a disaggregated demo has both pools), \
                     got {n}"
                );
            }
        }
    }
    // A bad --scenario (or autoscaler flag) fails here, before anything starts.
    let mut scaling = args.drive.scaling()?;
    let (router, spec) = args.router_and_spec()?;
    let routers: Vec<String> = match &args.compare {
        Some(list) => {
            let routers: Vec<String> = list.split(',').map(|r| r.trim().to_owned()).collect();
            if routers.len() != 2 || routers[0] == routers[1] {
                bail!("--compare takes two different routers, e.g. round_robin,kv; got {list:?}");
            }
            routers
        }
        None => vec![router],
    };
    // A bad --spec-decode fails here, before anything starts.
    {
        let profile = engine::HardwareProfile::builtin(&args.profile)?;
        let flags = crate::spec_args::SpecArgs {
            spec_decode: spec.clone(),
            draft_len: None,
            acceptance_rate: None,
        };
        flags.resolve(&engine::EngineConfig::from_profile(profile))?;
    }
    for router in &routers {
        router
            .parse::<PolicyKind>()
            .map_err(|e| anyhow::anyhow!("router {router:?}: {e}"))?;
    }
    // The recorded comparison should be of this very cluster: unless one is given, simulate it
    // now (about a second), on localhost (no serving path outside the GPUs).
    let baseline =
        // The recorded comparison simulates aggregated clusters only (so far).
        if args.drive.baseline.is_some()
            || args.drive.no_baseline
            || args.target.is_some()
            || args.disaggregated()
        {
            args.drive.baseline()?
        } else {
            Some(simulated_baseline(&args, &routers, &spec)?)
        };
    // Chosen before the load generator starts, which must know Prometheus's URL.
    let prometheus_port = match args.prometheus {
        true => Some(demo_prometheus::choose_port(args.prometheus_port)?),
        false => None,
    };
    let phase_reference = args
        .drive
        .phase_reference(|| PhaseReference::shipped_for(&args.profile, args.worker_count()))?;
    // Seed 003's ladder switched live: the one aggregated simulated cluster, when it runs one
    // of the ladder's phases.
    let ladder_start: Option<(Vec<PhaseSetup>, String)> =
        if args.target.is_none() && !args.disaggregated() && routers.len() == 1 {
            let kv_router = args
                .router
                .parse::<PolicyKind>()
                .map_err(|e| anyhow::anyhow!("router {:?}: {e}", args.router))?;
            let running_router = routers[0]
                .parse::<PolicyKind>()
                .map_err(|e| anyhow::anyhow!("router {:?}: {e}", routers[0]))?;
            let profile = engine::HardwareProfile::builtin(&args.profile)?;
            let phases = demo_ladder::phases(kv_router, &profile);
            match demo_ladder::phase_of(&phases, running_router.name(), &spec) {
                Some(phase) => {
                    let phase = phase.to_owned();
                    Some((phases, phase))
                }
                None => {
                    println!(
                        "kvroute demo: no live phase switch: router {} with speculative \
                         decoding {spec} is not a phase of seed 003's ladder",
                        running_router.name()
                    );
                    None
                }
            }
        } else {
            None
        };
    let runtime = crate::server_runtime()?;
    runtime.block_on(async {
        let mut clusters = Vec::new();
        // The cluster restarted at another phase by `POST /api/phase` (and the dashboard).
        let mut ladder: Option<Arc<DemoLadder>> = None;
        let mut lanes = Vec::new();
        // The disaggregated demo of one cluster resizes its pools itself.
        let mut fleet: Option<Arc<DemoFleet>> = None;
        // What --prometheus scrapes: the first cluster's gateway and engines.
        let mut scraped: Option<(SocketAddr, Vec<EngineTarget>)> = None;
        if args.target.is_none() && !args.disaggregated() {
            scaling.no_fleet_reason = "the demo is aggregated (start it with \
                                       --prefill-workers/--decode-workers)"
                .to_owned();
        } else if args.compare.is_some() {
            scaling.no_fleet_reason =
                "--compare runs two clusters; the demo resizes the pools of one only".to_owned();
        }
        if let Some(target) = &args.target {
            lanes.push(LaneSpec::for_gateway(
                "live",
                None,
                &base_url("demo", target),
                "llama-3.1-70b-instruct",
            ));
        } else {
            for (i, router) in routers.iter().enumerate() {
                // Port 0 lets every gateway pick a free port.
                let port = match args.gateway_port {
                    0 => 0,
                    first => first
                        .checked_add(i as u16)
                        .context("--gateway-port is too high for two gateways")?,
                };
                let roles: Vec<&str> = (0..args.worker_count()).map(|w| args.role_of(w)).collect();
                let cluster =
                    start_cluster(&engine_template(&args, &spec), &roles, router, port).await?;
                let mut lane = LaneSpec::for_gateway(
                    router,
                    Some(router),
                    &cluster.gateway.url(),
                    "llama-3.1-70b-instruct",
                );
                lane.worker_metrics = cluster
                    .engines
                    .iter()
                    .map(|e| format!("{}/metrics", e.url()))
                    .collect();
                lane.prometheus = prometheus_port.map(|port| format!("http://127.0.0.1:{port}"));
                let pools = if args.disaggregated() {
                    format!(
                        " ({} prefill, {} decode)",
                        args.prefill_workers, args.decode_workers
                    )
                } else {
                    String::new()
                };
                println!(
                    "kvroute demo: {} simulated {} workers{pools}{} behind the {} gateway on {}",
                    cluster.engines.len(),
                    args.profile,
                    if spec == "off" {
                        String::new()
                    } else {
                        format!(" (speculative decoding: {spec})")
                    },
                    cluster.router,
                    cluster.gateway.url()
                );
                lanes.push(lane);
                if scraped.is_none() {
                    scraped = Some((
                        cluster.gateway.local_addr(),
                        cluster
                            .engines
                            .iter()
                            .zip(0..)
                            .map(|(e, w)| EngineTarget {
                                pod: format!("worker-{w}"),
                                addr: e.local_addr(),
                                pool: EngineTarget::pool_of_role(args.role_of(w)),
                            })
                            .collect(),
                    ));
                }
                if args.disaggregated() && routers.len() == 1 {
                    let engines = cluster
                        .engines
                        .into_iter()
                        .zip(0..)
                        .map(|(engine, w)| {
                            let pool = match w < args.prefill_workers {
                                true => PoolKind::Prefill,
                                false => PoolKind::Decode,
                            };
                            (w, pool, engine)
                        })
                        .collect();
                    let demo_fleet = Arc::new(DemoFleet::new(
                        engine_template(&args, &spec),
                        cluster.gateway,
                        engines,
                    ));
                    scaling.fleet = Some(demo_fleet.clone());
                    fleet = Some(demo_fleet);
                } else if let Some((phases, phase)) = &ladder_start {
                    ladder = Some(Arc::new(DemoLadder::new(
                        engine_template(&args, &spec),
                        phases.clone(),
                        phase,
                        cluster,
                    )));
                } else {
                    clusters.push(cluster);
                }
            }
        }
        let config = LoadgenConfig {
            listen: SocketAddr::new(args.host, args.port),
            drive,
            baseline,
            phase_reference,
            autostart: args.drive.start,
            scaling,
            api_token: args.api_token.clone(),
            max_connections: Some(args.drive.connections.bound()?.0),
            ladder: ladder
                .as_ref()
                .zip(ladder_start.as_ref())
                .map(|(ladder, (_, phase))| LadderConfig {
                    ladder: demo_ladder::as_phase_ladder(ladder),
                    initial: phase.clone(),
                }),
            ..LoadgenConfig::new(lanes)
        };
        let loadgen = Loadgen::bind(config).await.map_err(dashboard_bind_error)?;
        // Started last, when every address it scrapes is bound; kept until the end (drop
        // stops it).
        let _prometheus = match (prometheus_port, scraped) {
            (Some(port), Some((gateway, engines))) => {
                let targets = demo_prometheus::Targets {
                    gateway,
                    engines,
                    loadgen: loadgen.local_addr(),
                };
                let mut prometheus = DemoPrometheus::start(&args.prometheus_bin, port, &targets)?;
                prometheus.wait_ready().await?;
                if let Some(fleet) = &fleet {
                    // Workers the pools gain or lose from now on are scraped or dropped.
                    fleet.scrape_into(prometheus.engine_targets());
                }
                if let Some(ladder) = &ladder {
                    // Each phase's new workers are scraped in place of the old ones.
                    ladder.scrape_into(prometheus.engine_targets());
                }
                println!(
                    "kvroute demo: Prometheus on {} (configuration {}; Grafana dashboards in \
                     deploy/grafana/)",
                    prometheus.url(),
                    prometheus.config_path().display()
                );
                Some(prometheus)
            }
            _ => None,
        };
        println!("kvroute demo: open {} (Ctrl-C stops)", loadgen.url());
        if let Some((phases, phase)) = &ladder_start {
            let names: Vec<&str> = phases.iter().map(|p| p.name.as_str()).collect();
            println!(
                "kvroute demo: phase {phase}; switch live on the dashboard or with POST \
                 /api/phase {{\"phase\": NAME}} ({})",
                names.join(", ")
            );
        }
        if args.api_token.is_some() {
            println!(
                "kvroute demo: the API needs its token: open {}/?token=TOKEN",
                loadgen.url()
            );
        }
        let failures = run_or_wait(&loadgen, &args.drive, args.speedup).await?;
        println!("kvroute demo: shutting down");
        loadgen.shutdown().await;
        if let Some(fleet) = fleet {
            fleet.shutdown().await;
        }
        if let Some(ladder) = ladder {
            ladder.shutdown().await;
        }
        for cluster in clusters {
            cluster.gateway.shutdown().await;
            for engine in cluster.engines {
                engine.shutdown().await;
            }
        }
        println!("kvroute demo: stopped");
        failures.check()
    })
}

/// The requests of a measurement that failed, to be told last (after the figures, the report
/// and the shutdown) and to make the exit status non-zero: a script or CI job must tell a
/// failed run from a good one.
#[derive(Default)]
struct Failures {
    failed: u64,
    of: u64,
    /// Why, if the figures printed before did not say it.
    example: Option<String>,
    /// Where the reasons are.
    see: &'static str,
}

impl Failures {
    /// An error, the process's last line on stderr, when any request failed.
    fn check(self) -> Result<()> {
        if self.failed == 0 {
            return Ok(());
        }
        let why = match self.example {
            Some(example) => format!("; the latest: {example}"),
            None => String::new(),
        };
        bail!(
            "{} of {} requests failed{why}{}",
            self.failed,
            self.of,
            self.see
        )
    }
}

/// Waits for Ctrl-C (the dashboard: whatever failed, the exit status is 0), or with
/// --run-for measures for that long (modelled seconds, `speedup` times faster in wall time),
/// prints the figures, writes --report and returns the requests that failed.
async fn run_or_wait(loadgen: &Loadgen, drive: &DriveArgs, speedup: f64) -> Result<Failures> {
    let Some(run_for) = drive.run_for else {
        gateway_cmd::shutdown_signal().await;
        return Ok(Failures::default());
    };
    let wall = Duration::from_secs_f64(run_for / speedup);
    tokio::select! {
        () = tokio::time::sleep(wall) => {}
        () = gateway_cmd::shutdown_signal() => bail!("interrupted before --run-for elapsed"),
    }
    let status = loadgen.app().status();
    for lane in &status.lanes {
        let m = &lane.metrics;
        let p50 = |q: Option<report::Percentiles>| {
            q.and_then(|q| q.p50)
                .map_or("-".to_owned(), |p| format!("{p:.1}"))
        };
        println!(
            "{}: TOPS {} · TTFT p50 {} ms · ITL p50 {} ms · TPOT p50 {} ms · E2E p50 {} s · \
             KV hit {} · {} turns in the last {} s, {} errors",
            lane.name,
            m.tops.map_or("-".to_owned(), |t| format!("{t:.0}")),
            p50(m.ttft_ms),
            p50(m.itl_ms),
            p50(m.tpot_ms),
            p50(m.e2e_s),
            m.kv_hit_rate
                .map_or("-".to_owned(), |h| format!("{:.1}%", h * 100.0)),
            m.window_samples,
            status.window_s,
            m.errors,
        );
    }
    if let Some(path) = &drive.report {
        let json = serde_json::to_string_pretty(&status)?;
        std::fs::write(path, json).with_context(|| format!("writing {}", path.display()))?;
        println!("report: {}", path.display());
    }
    let failed: u64 = status.lanes.iter().map(|l| l.metrics.errors).sum();
    let finished: u64 = status.lanes.iter().map(|l| l.metrics.requests).sum();
    Ok(Failures {
        failed,
        of: failed + finished,
        example: loadgen.app().recent_errors(1).pop(),
        see: "",
    })
}
