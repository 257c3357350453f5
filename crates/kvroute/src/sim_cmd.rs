//! `kvroute sim`: one simulated run; and the cluster options `kvroute bench` shares.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use engine::{EngineConfig, HardwareProfile};
use indicatif::{ProgressBar, ProgressStyle};
use nanotime::Nanos;
use report::{BenchResults, Percentiles, Row};
use router::{KvSource, PolicyKind};
use serde::Serialize;
use serde::de::DeserializeOwned;
use sim::ServingPath;
use sim::bench::{BenchSpec, JobResult};
use sim::chat::Chat;
use sim::trace::{ReplayStats, TraceWorkload};
use sim::{DisaggSetup, FrontendConfig, SimConfig, Simulation, Timeline, TimelineConfig};
use workload::{Assets, MAX_RATE, Mix, PromptSynth, WorkloadConfig};

use crate::trace_args::LoadedTrace;

/// The router names the router crate knows, for help texts.
pub fn router_names() -> String {
    PolicyKind::ALL
        .iter()
        .map(|k| k.name())
        .collect::<Vec<_>>()
        .join(", ")
}

pub fn parse_router(s: &str) -> Result<PolicyKind, String> {
    s.parse::<PolicyKind>().map_err(|e| e.to_string())
}

/// Fleet, hardware, router and workload options shared by `sim` and `bench`.
#[derive(Debug, Clone, clap::Args)]
pub struct ClusterArgs {
    /// Number of workers (one GPU each).
    #[arg(long, default_value_t = 3)]
    pub workers: u32,
    /// Built-in hardware profile (see `kvroute profiles`).
    #[arg(long, default_value = "h200-llama70b-fp8")]
    pub profile: String,
    /// A hardware profile file (.toml or .json, as `kvroute profiles check` reads) instead of
    /// --profile.
    #[arg(long, value_name = "PATH")]
    pub profile_file: Option<PathBuf>,
    /// Override a profile field, e.g. `timing.kv_read_efficiency=0.45` (repeatable; dotted
    /// path into the profile as `kvroute profiles show NAME --json` prints it).
    #[arg(long, value_name = "KEY=VALUE")]
    pub profile_set: Vec<String>,
    /// Override an engine setting, e.g. `max_num_seqs=64`, `max_num_batched_tokens=8192`,
    /// `num_gpu_blocks_override=12000` (repeatable).
    #[arg(long, value_name = "KEY=VALUE")]
    pub engine_set: Vec<String>,
    /// A workload configuration file (.toml or .json); fields left out keep the seed's
    /// defaults.
    #[arg(long, value_name = "PATH")]
    pub workload_file: Option<PathBuf>,
    /// Override a workload setting (repeatable; dotted path into the workload config).
    #[arg(long, value_name = "KEY=VALUE")]
    pub workload_set: Vec<String>,
    /// KV policy: weight of prefill blocks against decode blocks (Dynamo's
    /// kv_overlap_score_weight).
    #[arg(long, default_value_t = 1.0)]
    pub overlap_weight: f64,
    /// KV policy: softmax temperature over costs (0 = lowest cost wins).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// Override a `kv_load` policy parameter, e.g. `stall_weight=0.5` (repeatable; fields as
    /// `docs/ROUTING.md` lists them).
    #[arg(long, value_name = "KEY=VALUE")]
    pub kv_load_set: Vec<String>,
    /// Approximate mode: no KV events; routed prompts are assumed cached for this many
    /// seconds (Dynamo's --no-kv-events, TTL 120 s).
    #[arg(long, value_name = "SECONDS")]
    pub approximate_ttl: Option<f64>,
    /// Delay between an engine's KV event and the router applying it (models NATS).
    #[arg(long, default_value_t = 0.0, value_name = "MS")]
    pub kv_event_delay_ms: f64,
    /// Requests in flight per worker before new ones wait at the frontend (0: no cap); the
    /// gateway's --max-inflight-per-worker, with its default.
    #[arg(long, value_name = "N", default_value_t = router::FrontendConfig::DEFAULT_MAX_IN_FLIGHT_PER_WORKER.get())]
    pub frontend_cap: u32,
    /// Most requests waiting at the frontend; more fail (the gateway's --queue-capacity).
    #[arg(long, default_value_t = router::FrontendConfig::DEFAULT_QUEUE_CAPACITY)]
    pub frontend_queue: usize,
    /// Round trip of the serving path outside the GPUs (client, load balancer, frontend,
    /// network), added to every TTFT and E2E. The default is fitted to seed 002's deployment
    /// (docs/CALIBRATION.md).
    #[arg(long, default_value_t = sim::SEED_002_PATH_LATENCY_MS, value_name = "MS")]
    pub path_latency_ms: f64,
    /// Decode step by step instead of advancing identical decode steps together (slower;
    /// for checking speed mode).
    #[arg(long)]
    pub step_by_step: bool,
    /// Skip the oracle upper bound.
    #[arg(long)]
    pub no_oracle: bool,
    /// Let the oracle forget blocks unseen for this many seconds (default: never). Bounds its
    /// memory on hour-long fleet-scale runs; minutes change no answer on the seed workload.
    #[arg(long, value_name = "SECONDS")]
    pub oracle_horizon: Option<f64>,
    /// Seed of the run (sweep seeds derive from it).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    #[command(flatten)]
    pub spec: crate::spec_args::SpecArgs,
}

/// Sets `KEY=VALUE` pairs in a serializable value through its JSON form: `KEY` is a dotted
/// path, `VALUE` is JSON (a bare word is taken as a string). A section that is absent because
/// it is optional and off (`lockstep`, `speculative`, …) is created; a path that names no field
/// is an error naming it, whether or not the type refuses unknown fields.
pub fn patch<T: Serialize + DeserializeOwned>(value: T, sets: &[String], what: &str) -> Result<T> {
    if sets.is_empty() {
        return Ok(value);
    }
    let mut json = serde_json::to_value(&value)?;
    // Keys this patch added: (the whole path, the key, the fields beside it).
    let mut created: Vec<(&str, &str, String)> = Vec::new();
    for set in sets {
        let Some((path, raw)) = set.split_once('=') else {
            bail!("--{what}-set expects KEY=VALUE, got `{set}`");
        };
        let path = path.trim();
        let new = serde_json::from_str(raw.trim())
            .unwrap_or_else(|_| serde_json::Value::String(raw.trim().to_string()));
        let mut slot = &mut json;
        for key in path.split('.') {
            let Some(map) = slot.as_object_mut() else {
                bail!("{what} has no field `{path}` (`{key}` would be inside a value)");
            };
            if !map.contains_key(key) {
                let fields = map.keys().cloned().collect::<Vec<_>>().join(", ");
                created.push((path, key, fields));
            }
            slot = map
                .entry(key.to_string())
                .or_insert_with(|| serde_json::Value::Object(Default::default()));
        }
        *slot = new;
    }
    let no_field = |path: &str, key: &str, fields: &str| {
        anyhow::anyhow!("{what} has no field `{path}` (at `{key}`; fields here: {fields})")
    };
    let patched: T = match serde_json::from_value(json) {
        Ok(patched) => patched,
        Err(e) => {
            let message = e.to_string();
            if message.starts_with("unknown field")
                && let Some((path, key, fields)) = created
                    .iter()
                    .find(|(_, key, _)| message.contains(&format!("`{key}`")))
            {
                // A section this patch created has no fields to list: serde's message names
                // the ones it expects.
                return Err(if fields.is_empty() {
                    anyhow::anyhow!("{what} has no field `{path}` ({message})")
                } else {
                    no_field(path, key, fields)
                });
            }
            return Err(e).with_context(|| format!("{what} settings {sets:?} do not fit"));
        }
    };
    // A type that ignores unknown fields drops a misspelt key silently: look for each one.
    let back = serde_json::to_value(&patched)?;
    for (path, key, fields) in &created {
        if path.split('.').try_fold(&back, |at, k| at.get(k)).is_none() {
            return Err(no_field(path, key, fields));
        }
    }
    Ok(patched)
}

fn read_config<T: DeserializeOwned>(path: &Path, what: &str) -> Result<T> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read {what} file {}", path.display()))?;
    let is_json = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("json"));
    if is_json {
        serde_json::from_str(&text)
            .with_context(|| format!("{} is not a valid {what} (JSON)", path.display()))
    } else {
        toml::from_str(&text)
            .with_context(|| format!("{} is not a valid {what} (TOML)", path.display()))
    }
}

fn seconds(s: f64, flag: &str) -> Result<Nanos> {
    if !(s.is_finite() && s >= 0.0) {
        bail!("{flag} must be a number of seconds ≥ 0, got {s}");
    }
    Ok(Nanos::from_secs_f64(s))
}

/// Everything a run needs besides its phases.
#[derive(Clone)]
pub struct Cluster {
    pub base: SimConfig,
    pub workload: WorkloadConfig,
    pub assets: Arc<Assets>,
    pub profile_name: String,
    /// Replay this trace at this speed instead of running `workload` (a benchmark's trace
    /// cells).
    pub replay: Option<(Arc<workload::Trace>, workload::Speed)>,
}

impl ClusterArgs {
    pub fn build(&self) -> Result<Cluster> {
        if self.workers == 0 {
            bail!("--workers must be at least 1");
        }
        let profile = match &self.profile_file {
            Some(path) => crate::profiles::load(path)?,
            None => HardwareProfile::builtin(&self.profile)?,
        };
        let profile: HardwareProfile = patch(profile, &self.profile_set, "profile")?;
        profile
            .validate()
            .context("the profile after --profile-set is not usable")?;
        let profile_name = profile.name.clone();
        let mut engine = EngineConfig::from_profile(profile);
        engine.coalesce_decode = !self.step_by_step;
        let mut engine: EngineConfig = patch(engine, &self.engine_set, "engine")?;
        // `--spec-decode off` leaves a configuration set through --engine-set alone.
        if let Some(spec) = self.spec.resolve(&engine)? {
            engine.spec_decode = Some(spec);
        }
        let mut base = SimConfig::new(self.workers, engine.profile.clone(), PolicyKind::Kv);
        base.engine = engine;
        let params = &mut base.router.params;
        params.kv.overlap_weight = self.overlap_weight;
        params.kv.temperature = self.temperature;
        params.kv_load = patch(params.kv_load, &self.kv_load_set, "kv-load")?;
        if let Some(ttl) = self.approximate_ttl {
            base.router.kv_source = KvSource::Approximate {
                ttl: seconds(ttl, "--approximate-ttl")?,
            };
        }
        base.router.kv_event_delay = seconds(self.kv_event_delay_ms / 1e3, "--kv-event-delay-ms")?;
        base.frontend = FrontendConfig {
            max_in_flight_per_worker: std::num::NonZeroU32::new(self.frontend_cap),
            queue_capacity: self.frontend_queue,
            ..FrontendConfig::default()
        };
        base.path_latency = seconds(self.path_latency_ms / 1e3, "--path-latency-ms")?;
        base.oracle = !self.no_oracle;
        base.oracle_horizon = self
            .oracle_horizon
            .map(|h| seconds(h, "--oracle-horizon"))
            .transpose()?;
        let workload = match &self.workload_file {
            Some(path) => read_config(path, "workload config")?,
            None => WorkloadConfig::default(),
        };
        let workload = patch(workload, &self.workload_set, "workload")?;
        let assets = Assets::builtin().context("loading the workload's corpus")?;
        Ok(Cluster {
            base,
            workload,
            assets,
            profile_name,
            replay: None,
        })
    }
}

#[derive(Debug, clap::Args)]
pub struct SimArgs {
    /// Routing policy.
    #[arg(long, default_value_t = PolicyKind::DEFAULT, value_parser = parse_router, help = format!("Routing policy: {}", router_names()))]
    pub router: PolicyKind,
    /// Concurrent conversations (the closed loop; ignored with --rate and --trace).
    #[arg(long, default_value_t = 60)]
    pub concurrency: u32,
    /// Seed 004's workload mix: weights of A (multi-turn chat), B (summarisation of a 4k–18k
    /// token document) and C (reasoning, long answers), e.g. `A=40,B=30,C=30`. Each new
    /// session draws its workload; the summary adds a row per workload. Default: chat only.
    #[arg(long, value_name = "A=N,B=N,C=N", value_parser = parse_mix)]
    pub mix: Option<Mix>,
    /// Open loop: new sessions (an A conversation, with all its turns, or one B/C request)
    /// arrive at this many per second, Poisson, instead of --concurrency being open at all
    /// times. At most the workload's max_open (10,000) are open; further arrivals are refused
    /// and counted.
    #[arg(long, value_name = "RPS", value_parser = parse_rate)]
    pub rate: Option<f64>,
    /// Simulated seconds in all, warmup included [default: 360; with --trace, the trace's
    /// span divided by --trace-speed, plus 60 s for the last requests to finish].
    #[arg(long, value_name = "SECONDS")]
    pub duration: Option<f64>,
    /// Simulated seconds before measuring [default: 60; with --trace, 0].
    #[arg(long, value_name = "SECONDS")]
    pub warmup: Option<f64>,
    /// Snapshots the measurement window is read as (averaged).
    #[arg(long, default_value_t = 1)]
    pub snapshots: u32,
    /// Seconds each snapshot looks back (default: its own share of the window).
    #[arg(long, value_name = "SECONDS")]
    pub lookback: Option<f64>,
    /// Print JSON (results.json's shape plus run totals) instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Write every request's record to this file as JSON lines.
    #[arg(long, value_name = "PATH")]
    pub records: Option<PathBuf>,
    /// Sample every worker's in-flight, running and waiting requests and its largest TTFT of
    /// each interval over the whole run (at most a million rows, samples × workers); write
    /// DIR/timeline.csv and DIR/timeline.svg.
    #[arg(long, value_name = "DIR")]
    pub timeline: Option<PathBuf>,
    #[command(flatten)]
    pub trace: crate::trace_args::TraceArgs,
    /// With --trace: skip the goodput ceiling (how many requests any routing could serve
    /// within the objectives, and the least prefill load), a second simulation of every
    /// request alone that adds about a third to a replay's time.
    #[arg(long, requires = "trace")]
    pub no_ceiling: bool,
    #[command(flatten)]
    pub disagg: DisaggArgs,
    #[command(flatten)]
    pub scenario: ScenarioArgs,
    /// Simulated seconds between timeline samples.
    #[arg(long, default_value_t = 1.0, value_name = "SECONDS")]
    pub timeline_interval: f64,
    /// Draw only this stretch of the timeline in timeline.svg, in simulated seconds, e.g.
    /// `120:180` (the CSV keeps every sample).
    #[arg(long, value_name = "FROM:TO", value_parser = parse_window)]
    pub timeline_window: Option<(f64, f64)>,
    /// Inject seeded faults and check the invariants at every step (docs/RELIABILITY.md):
    /// comma-separated scenarios, each with an optional parameter, e.g.
    /// `worker-crash,event-loss=0.05`. Scenarios: worker-crash[=SECONDS] (restart delay, 30),
    /// worker-hang[=SECONDS] (90), slow-worker[=FACTOR] (2), event-loss[=P] (0.02),
    /// event-delay[=MS] (500), event-duplicate[=P] (0.02), event-reorder[=P] (0.02),
    /// replica-restart[=SECONDS] (down time, 10) and partition[=SECONDS] (10), the last two
    /// with --gateway-replicas 2 or more; `none` checks the invariants of a fault-free run.
    /// Aggregated fleets only.
    #[arg(long, value_name = "SPEC", value_parser = parse_faults)]
    pub faults: Option<sim::faults::FaultSpec>,
    /// With --faults: times the simulated gateway resends a request whose worker crashed or
    /// stalled mid-stream to another worker, with its output so far (as `kvroute gateway
    /// --migration-limit`). 0: the request ends with the error (`worker_failed`,
    /// `worker_timeout`).
    #[arg(long, value_name = "N", requires = "faults",
          default_value_t = sim::FailoverConfig::default().migration_limit)]
    pub migration_limit: u32,
    /// With --faults: seconds a worker that failed a request stays out of the routing set
    /// even if its health check passes, growing with failures in a row up to ten times it
    /// (as `kvroute gateway --ejection-time`). 0: back at its first passing health check.
    #[arg(long, value_name = "SECONDS", requires = "faults",
          default_value_t = sim::FailoverConfig::default().ejection.base.as_secs_f64())]
    pub ejection_time: f64,
    /// Gateway replicas behind one address: each turn goes to the next replica (round
    /// robin, as a client spreading requests would); every replica applies every worker's KV
    /// events and learns its peers' routing decisions and completions --replica-sync-ms late
    /// (or never, with --no-replica-sync). Aggregated fleets only (docs/ROUTING.md, "Gateway
    /// replicas").
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub gateway_replicas: u32,
    /// Delay before a replica's routing decisions and completions reach its peers: the
    /// staleness bound of each replica's view of the others' load (NATS in the gateway).
    #[arg(long, default_value_t = 5.0, value_name = "MS")]
    pub replica_sync_ms: f64,
    /// Replicas share nothing: each sees only the requests it routed itself.
    #[arg(long, conflicts_with = "replica_sync_ms")]
    pub no_replica_sync: bool,
    #[command(flatten)]
    pub cluster: ClusterArgs,
}

fn parse_faults(s: &str) -> Result<sim::faults::FaultSpec, String> {
    s.parse()
        .map_err(|e: sim::faults::FaultSpecError| e.to_string())
}

/// `kvroute sim --scenario`: seed 004's cycle on a disaggregated fleet.
#[derive(Debug, Clone, clap::Args)]
pub struct ScenarioArgs {
    /// Run a scenario cycle (`seed004`, or a TOML file like crates/workload/scenarios/
    /// seed004.toml) on a disaggregated fleet (--layout, default seed004-dev; or
    /// --prefill-workers/--decode-workers, which replace the scenario's initial sizes), open
    /// loop at its rates and mixes. Auto mode: its scaling actions drive the pools.
    #[arg(long, value_name = "seed004|FILE")]
    pub scenario: Option<String>,
    /// Cycles to run.
    #[arg(long, default_value_t = 1, requires = "scenario",
          value_parser = clap::value_parser!(u32).range(1..=i64::from(sim::scenario::MAX_CYCLES)))]
    pub cycles: u32,
    /// Manual mode: ignore the scenario's scaling actions; KEDA autoscalers with seed 004's
    /// settings (TTFT p95 0.5 s, ITL p95 0.05 s over 5 minutes, polled every 15 s) scale
    /// the pools.
    #[arg(long, requires = "scenario")]
    pub autoscale: bool,
    /// The prefill scaler's TTFT p95 threshold, in seconds (also what recovery is judged on).
    #[arg(long, value_name = "SECONDS", requires = "scenario")]
    pub ttft_threshold: Option<f64>,
    /// The decode scaler's ITL p95 threshold, in seconds (also what recovery is judged on).
    #[arg(long, value_name = "SECONDS", requires = "scenario")]
    pub itl_threshold: Option<f64>,
    /// The autoscalers' polling interval, in seconds.
    #[arg(long, value_name = "SECONDS", requires = "scenario")]
    pub polling_interval: Option<f64>,
    /// Seconds a new worker takes before it serves (0: at once, the default).
    #[arg(
        long,
        value_name = "SECONDS",
        default_value_t = 0.0,
        requires = "scenario"
    )]
    pub startup_delay: f64,
    /// After the run, size each pool that did not recover in its phase with steady-state
    /// runs of up to this many more workers (0: skip).
    #[arg(long, value_name = "N", default_value_t = 4, requires = "scenario")]
    pub sizing_steps: u32,
    /// Write DIR/report.md, DIR/results.json and DIR/timeline.svg.
    #[arg(long, value_name = "DIR", requires = "scenario")]
    pub out: Option<PathBuf>,
}

/// `--mix`: `A=40,B=30,C=30`.
pub fn parse_mix(s: &str) -> Result<Mix, String> {
    s.parse::<Mix>().map_err(|e| e.to_string())
}

/// `--rate`: sessions per second, a finite number in (0, MAX_RATE].
pub fn parse_rate(s: &str) -> Result<f64, String> {
    let rate: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("expected a number of sessions per second, got `{s}`"))?;
    if !(rate.is_finite() && rate > 0.0 && rate <= MAX_RATE) {
        return Err(format!(
            "must be a number of sessions per second in (0, {MAX_RATE}], got {s}"
        ));
    }
    Ok(rate)
}

/// A KV link by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LinkArg {
    /// GPU to GPU inside a node.
    Nvlink,
    /// Between nodes.
    Network,
}

impl From<LinkArg> for engine::KvLink {
    fn from(l: LinkArg) -> Self {
        match l {
            LinkArg::Nvlink => engine::KvLink::Nvlink,
            LinkArg::Network => engine::KvLink::Network,
        }
    }
}

/// How concurrent KV transfers use the links.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LinkSharingArg {
    /// Transfers out of one prefill worker, or into one decode worker, share its port's
    /// bandwidth fairly (a burst of long prompts queues).
    Shared,
    /// Every transfer has the whole link to itself (size / bandwidth, no contention).
    Exclusive,
}

impl LinkSharingArg {
    pub fn shared(self) -> bool {
        self == LinkSharingArg::Shared
    }
}

/// `kvroute sim`'s disaggregated fleet: prefill and decode pools instead of --workers.
#[derive(Debug, Clone, clap::Args)]
pub struct DisaggArgs {
    /// Disaggregated serving: this many prefill-only workers (0 allowed: decode workers then
    /// prefill everything), with --decode-workers, instead of --workers.
    #[arg(long, value_name = "N", requires = "decode_workers", conflicts_with_all = ["workers", "layout"])]
    pub prefill_workers: Option<u32>,
    /// Disaggregated serving: this many decode-only workers (at least 1), with
    /// --prefill-workers.
    #[arg(long, value_name = "M", requires = "prefill_workers",
          value_parser = clap::value_parser!(u32).range(1..))]
    pub decode_workers: Option<u32>,
    /// A named disaggregated layout (seed004-dev: 1P:1D Llama-8B on H100 nodes, KV over the
    /// network; seed004-prod: 2P:3D Llama-70B FP8 on one 8×H200 node, KV over NVLink); sets
    /// the profile and both pools.
    #[arg(long, value_name = "NAME", conflicts_with_all = ["workers", "profile", "profile_file"])]
    pub layout: Option<String>,
    /// Conditional disaggregation: a decode worker prefills a request itself when at most
    /// this many of its prompt tokens are uncached there (default: the router's, 512).
    #[arg(long, value_name = "TOKENS")]
    pub local_prefill_max_tokens: Option<u32>,
    /// How KV moves from prefill to decode workers (default nvlink, or the layout's).
    #[arg(long, value_enum)]
    pub kv_link: Option<LinkArg>,
    /// Whether concurrent KV transfers share each worker's link port (default shared).
    #[arg(long, value_enum, value_name = "MODE")]
    pub kv_link_sharing: Option<LinkSharingArg>,
}

impl DisaggArgs {
    /// The fleet the flags ask for (`None`: aggregated), and the profile a layout names.
    pub fn setup(&self) -> Result<Option<(DisaggSetup, Option<&'static str>)>> {
        let (mut setup, profile) = match (&self.layout, self.prefill_workers, self.decode_workers) {
            (Some(name), ..) => {
                let layout = sim::disagg::layout(name.trim()).with_context(|| {
                    let known: Vec<&str> = sim::disagg::layouts().iter().map(|l| l.name).collect();
                    format!(
                        "--layout: unknown layout {name:?}; known: {}",
                        known.join(", ")
                    )
                })?;
                (layout.setup(), Some(layout.profile))
            }
            (None, Some(p), Some(d)) => (DisaggSetup::new(p, d), None),
            _ => {
                if self.local_prefill_max_tokens.is_some()
                    || self.kv_link.is_some()
                    || self.kv_link_sharing.is_some()
                {
                    bail!(
                        "--local-prefill-max-tokens, --kv-link and --kv-link-sharing apply to a \
                         disaggregated fleet: add --prefill-workers N --decode-workers M, or \
                         --layout"
                    );
                }
                return Ok(None);
            }
        };
        if let Some(t) = self.local_prefill_max_tokens {
            setup.local_prefill_max_tokens = t;
        }
        if let Some(link) = self.kv_link {
            setup.kv_link = link.into();
        }
        if let Some(sharing) = self.kv_link_sharing {
            setup.shared_links = sharing.shared();
        }
        Ok(Some((setup, profile)))
    }
}

pub fn run(args: SimArgs) -> Result<()> {
    if args.gateway_replicas == 0 {
        bail!("--gateway-replicas must be at least 1");
    }
    if let Some(scenario) = args.scenario.scenario.clone() {
        if args.faults.is_some() {
            bail!("--faults does not run with --scenario yet; drop one of them");
        }
        if args.gateway_replicas > 1 {
            bail!("--gateway-replicas does not run with --scenario yet; drop one of them");
        }
        if args.trace.trace.is_some() {
            bail!("--trace and --scenario each bring their own traffic; drop one of them");
        }
        return run_scenario(&args, &scenario);
    }
    let started = Instant::now();
    let trace = args.trace.load()?;
    if trace.is_some()
        && (args.mix.is_some()
            || args.rate.is_some()
            || args.cluster.workload_file.is_some()
            || !args.cluster.workload_set.is_empty())
    {
        bail!(
            "--trace brings its own requests: drop --mix, --rate, --workload-file and --workload-set"
        );
    }
    let disagg = args.disagg.setup()?;
    let mut cluster_args = args.cluster.clone();
    if let Some((setup, profile)) = &disagg {
        cluster_args.workers = setup.workers().max(1);
        if let Some(profile) = profile {
            cluster_args.profile = profile.to_string();
        }
    }
    let mut cluster = cluster_args.build()?;
    if let Some(mix) = args.mix {
        cluster.workload.mix = mix;
    }
    if let Some(rate) = args.rate {
        cluster.workload.rate_rps = Some(rate);
    }
    // A mix or an open loop reports per workload, from every request's record.
    let mixed = trace.is_none()
        && (!cluster.workload.mix.is_chat_only() || cluster.workload.rate_rps.is_some());
    if let Some((setup, _)) = disagg {
        cluster.base.workers = setup.workers();
        cluster.base.disagg = Some(setup);
        cluster.base.slo = Some(report::Slo::SEED_004);
    }
    cluster.base.failover.migration_limit = args.migration_limit;
    let ejection = args.ejection_time;
    if !(ejection.is_finite() && (0.0..=86_400.0).contains(&ejection)) {
        bail!("--ejection-time must be a number of seconds between 0 and 86400, got {ejection}");
    }
    cluster.base.failover.ejection =
        router::EjectionConfig::with_base(Nanos::from_secs_f64(ejection));
    cluster.base.replicas = sim::ReplicaSetup {
        count: args.gateway_replicas,
        sync: if args.no_replica_sync {
            None
        } else {
            let ms = args.replica_sync_ms;
            if !(ms.is_finite() && ms >= 0.0) {
                bail!("--replica-sync-ms must be a number of milliseconds ≥ 0, got {ms}");
            }
            Some(Nanos::from_secs_f64(ms / 1e3))
        },
    };
    // A replay runs its whole span (plus a drain) and measures all of it by default.
    let (default_duration, default_warmup) = match &trace {
        Some(t) => (sim::trace::replay_span(&t.trace, t.speed), Nanos::ZERO),
        None => (Nanos::from_secs(360), Nanos::from_secs(60)),
    };
    let duration = match args.duration {
        Some(d) => seconds(d, "--duration")?,
        None => default_duration,
    };
    let warmup = match args.warmup {
        Some(w) => seconds(w, "--warmup")?,
        None => default_warmup,
    };
    if warmup >= duration {
        bail!(
            "--warmup ({} s) must be shorter than --duration ({} s)",
            warmup.as_secs_f64(),
            duration.as_secs_f64()
        );
    }
    cluster.base.keep_all_records = args.records.is_some() || mixed;
    // A single run reports TTFT by turn and decode tokens per step too (a benchmark keeps
    // seed 002's fields unless --phases).
    cluster.base.extended_metrics = true;
    cluster.base.reuse_attribution = true;
    let spec = BenchSpec {
        routers: vec![args.router],
        // A trace sets its own load: its level is 0 (no conversations held open).
        levels: vec![if trace.is_some() { 0 } else { args.concurrency }],
        sweeps: 1,
        warmup,
        window: duration - warmup,
        snapshots: args.snapshots,
        lookback: args
            .lookback
            .map(|l| seconds(l, "--lookback"))
            .transpose()?,
        seed: args.cluster.seed,
        continuous: true,
        base: cluster.base.clone(),
    };
    let job = spec.jobs().remove(0);
    let latency = spec.base.path_latency;
    let (out, traffic) = match &trace {
        None => {
            let workload = Chat::new(
                &cluster.workload,
                Arc::clone(&cluster.assets),
                job.seed,
                args.concurrency,
            )?;
            let workload = ServingPath::new(workload, latency);
            let simulation = Simulation::new(spec.config(&job), workload, spec.phases(&job))?;
            let simulation = drive(simulation, &args, started)?;
            let chat = &simulation.workload().inner().0;
            let traffic = Traffic::Chat {
                mix: chat.mix(),
                seed: chat.seed(),
                stats: chat.stats(),
            };
            (simulation.finish(), traffic)
        }
        Some(loaded) => {
            let workload = TraceWorkload::new(
                Arc::clone(&loaded.trace),
                loaded.speed,
                PromptSynth::default(),
            );
            let workload = ServingPath::new(workload, latency);
            let simulation = Simulation::new(spec.config(&job), workload, spec.phases(&job))?;
            let simulation = drive(simulation, &args, started)?;
            let stats = simulation.workload().inner().stats();
            (simulation.finish(), Traffic::Trace { loaded, stats })
        }
    };
    if let Some(path) = &args.records {
        write_records(path, &out.records)?;
    }
    if let (Some(dir), Some(timeline)) = (&args.timeline, &out.timeline) {
        let load = match &traffic {
            Traffic::Chat { .. } => format!("{} conversations", args.concurrency),
            Traffic::Trace { loaded, .. } => format!("trace at {}×", loaded.speed.factor()),
        };
        let title = format!("{}, {} workers, {load}", args.router, cluster.base.workers);
        write_timeline(dir, timeline, &title, args.timeline_window)?;
    }
    let totals = out.totals.clone();
    let faults = out.faults.clone();
    let snapshots = out.phases[0].snapshots.clone();
    let result = JobResult {
        job,
        phases: out.phases,
        totals: out.totals,
    };
    let mut results = sim::bench::aggregate(&spec, vec![result], &cluster.profile_name);
    if let (true, Traffic::Chat { mix, seed, .. }) = (mixed, &traffic) {
        let per_class =
            sim::mix::per_class(&out.records, warmup, duration, spec.base.oracle, |c| {
                mix.class_of(*seed, c)
            });
        for row in results.runs.iter_mut().chain(results.summary.iter_mut()) {
            row.per_class = per_class.clone();
        }
    }
    let replay = match &traffic {
        Traffic::Trace { loaded, stats } => {
            // Sessions make the order of requests depend on the run: no ceiling then.
            let ceiling = match (args.no_ceiling, loaded.trace.session_count()) {
                (true, _) => Err(NoCeiling::NotAsked),
                (false, 0) => Ok(sim::trace::slo_ceiling(
                    &spec.base,
                    Arc::clone(&loaded.trace),
                    TRACE_OBJECTIVES,
                )
                .context("the trace's ceiling")?),
                (false, _) => Err(NoCeiling::Sessions),
            };
            let workers = spec.base.workers;
            Some(TraceReport::new(
                loaded,
                *stats,
                &results,
                (ceiling, workers),
            ))
        }
        Traffic::Chat { .. } => None,
    };
    let wall = started.elapsed().as_secs_f64();
    if args.json {
        let doc = serde_json::json!({
            "summary": results.summary,
            "runs": results.runs,
            "bench": results.bench,
            "snapshots": snapshots,
            "totals": totals,
        });
        let mut doc = doc;
        if let (true, Traffic::Chat { mix, stats, .. }) = (mixed, &traffic) {
            doc["workload"] = serde_json::json!({
                "mix": mix.to_string(),
                "rate_rps": cluster.workload.rate_rps,
                "sessions_by_class": stats.sessions_by_class,
                "arrivals_dropped": stats.arrivals_dropped,
            });
        }
        if let Some(replay) = &replay {
            doc["trace"] = serde_json::to_value(replay)?;
        }
        if let Some(faults) = &faults {
            doc["faults"] = serde_json::to_value(faults)?;
        }
        if let (Some(replicas), Some(row)) = (&totals.replicas, results.runs.first()) {
            let mut value = serde_json::to_value(replicas)?;
            value["busiest_peak_in_flight"] = busiest_peak(row).into();
            doc["gateway_replicas"] = value;
        }
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        let load = match &traffic {
            Traffic::Chat { .. } => None,
            Traffic::Trace { loaded, .. } => Some(format!("trace {}", loaded.describe())),
        };
        print_run(&results, &totals, load.as_deref());
        if let (true, Traffic::Chat { stats, .. }) = (mixed, &traffic) {
            print_mix(&results, &cluster.workload, stats);
        }
        if let Some(replay) = &replay {
            replay.print();
        }
        if let Some(faults) = &faults {
            print_faults(faults, args.cluster.seed);
        }
    }
    let end = duration;
    eprintln!(
        "sim: {:.0} simulated s in {wall:.1} s wall ({:.0}× real time)",
        end.as_secs_f64(),
        end.as_secs_f64() / wall.max(1e-9)
    );
    Ok(())
}

/// The traffic a run replayed, and what it reports beside the fleet's metrics.
enum Traffic<'a> {
    Chat {
        mix: workload::Mix,
        seed: u64,
        stats: workload::WorkloadStats,
    },
    Trace {
        loaded: &'a LoadedTrace,
        stats: ReplayStats,
    },
}

/// A trace replay's summary: how close routing came to the trace's oracle bound.
#[derive(Debug, Serialize)]
struct TraceReport {
    file: String,
    /// Requests replayed (after --trace-limit) and in the file.
    requests: usize,
    requests_in_file: usize,
    speed: f64,
    /// The last arrival at this speed, in seconds.
    span_s: f64,
    issued: u64,
    finished: u64,
    failed: u64,
    /// The engines' prefix-hit rate over the requests finished in the measurement window.
    kv_hit_rate: Option<f64>,
    /// The trace's bound: an infinite cache shared by all workers, in 512-token blocks.
    oracle_prefix_hit_rate: f64,
    /// `kv_hit_rate / oracle_prefix_hit_rate`.
    share_of_bound: Option<f64>,
    /// What no routing can beat ([`sim::trace::slo_ceiling`]): at most this many requests meet
    /// seed 002's objectives (each served alone with the oracle's cache).
    /// `None` for a trace with sessions, whose order of requests depends on the run, and with
    /// `--no-ceiling` (`no_ceiling` says which).
    objectives: Option<report::Slo>,
    within_objectives_alone: Option<u64>,
    /// The GPU time the requests need to prefill alone over the fleet's while they arrive:
    /// above 1 no routing keeps up.
    least_prefill_load: Option<f64>,
    /// Why the three fields above are `None`.
    #[serde(skip_serializing_if = "Option::is_none")]
    no_ceiling: Option<NoCeiling>,
}

/// Why a trace replay reports no goodput ceiling.
#[derive(Debug, Clone, Copy, Serialize)]
#[serde(rename_all = "snake_case")]
enum NoCeiling {
    /// The trace has sessions: the order of its requests depends on the run.
    Sessions,
    /// `--no-ceiling`.
    NotAsked,
}

/// The objectives a trace replay's ceiling is counted against: seed 002's, the dashboard's.
const TRACE_OBJECTIVES: report::Slo = report::Slo::SEED_002;

impl TraceReport {
    fn new(
        loaded: &LoadedTrace,
        stats: ReplayStats,
        results: &BenchResults,
        (ceiling, workers): (Result<sim::trace::SloCeiling, NoCeiling>, u32),
    ) -> TraceReport {
        let (no_ceiling, ceiling) = match ceiling {
            Ok(c) => (None, Some(c)),
            Err(why) => (Some(why), None),
        };
        let kv_hit_rate = results.summary.first().and_then(|r| r.metrics.kv_hit_rate);
        let bound = report::percentiles::round(loaded.trace.oracle_prefix_hit_rate(), 4);
        TraceReport {
            file: loaded.path.display().to_string(),
            requests: loaded.trace.len(),
            requests_in_file: loaded.requests_in_file,
            speed: loaded.speed.factor(),
            span_s: report::percentiles::round(
                loaded.speed.scale(loaded.trace.duration()).as_secs_f64(),
                3,
            ),
            issued: stats.issued,
            finished: stats.finished,
            failed: stats.failed,
            kv_hit_rate,
            oracle_prefix_hit_rate: bound,
            share_of_bound: kv_hit_rate
                .filter(|_| bound > 0.0)
                .map(|h| report::percentiles::round(h / bound, 4)),
            objectives: ceiling.map(|_| TRACE_OBJECTIVES),
            within_objectives_alone: ceiling.map(|c| c.within),
            least_prefill_load: ceiling.map(|c| {
                report::percentiles::round(
                    c.prefill_load(workers, loaded.speed.scale(loaded.trace.duration())),
                    3,
                )
            }),
            no_ceiling,
        }
    }

    fn print(&self) {
        println!(
            "\ntrace: {} of {} requests issued ({} finished, {} failed) over {:.0} s at {}× speed",
            self.issued, self.requests, self.finished, self.failed, self.span_s, self.speed
        );
        let unfinished = self.issued.saturating_sub(self.finished + self.failed);
        if unfinished > 0 {
            // The figures above cover finished requests only: say how many did not.
            println!(
                "  note: {unfinished} of them were still running when the run ended, so the \
                 latencies, rates and hit rates above cover the {} that finished (the summary's \
                 oracle too, in engine blocks); --duration longer than the trace's {:.0} s lets \
                 more finish",
                self.finished, self.span_s
            );
        }
        println!(
            "  prefix-hit rate {} of prompt tokens; the trace's oracle bound {:.1}% (infinite \
             cache, any worker): {} of the bound",
            opt(self.kv_hit_rate.map(|h| h * 100.0), 1) + "%",
            self.oracle_prefix_hit_rate * 100.0,
            opt(self.share_of_bound.map(|s| s * 100.0), 0) + "%"
        );
        let (Some(within), Some(slo), Some(load)) = (
            self.within_objectives_alone,
            self.objectives,
            self.least_prefill_load,
        ) else {
            match self.no_ceiling {
                Some(NoCeiling::NotAsked) => {}
                _ => println!(
                    "  (no ceiling for a trace with sessions: the order of its requests depends \
                     on the run)"
                ),
            }
            return;
        };
        println!(
            "  under any routing at most {within} of {} requests meet TTFT ≤ {:.0} ms and mean \
             ITL ≤ {:.0} ms (each alone, with that cache); least prefill load {load:.2}{}",
            self.requests,
            slo.ttft_ms,
            slo.itl_ms,
            if load > 1.0 {
                " (above 1: this fleet cannot keep up with the trace, whatever the routing)"
            } else {
                ""
            }
        );
    }
}

/// Runs `simulation` to its end, with a progress bar on a terminal (or a line every tenth of
/// a long run without one).
fn drive<W: sim::Workload>(
    mut simulation: Simulation<W>,
    args: &SimArgs,
    started: Instant,
) -> Result<Simulation<W>> {
    if let Some((from, _)) = args.timeline_window {
        let end = simulation.end().as_secs_f64();
        if args.timeline.is_none() || from >= end {
            bail!("--timeline-window needs --timeline and must start before --duration ends");
        }
    }
    if let Some(dir) = &args.timeline {
        // Before the run, so that a bad path fails at once.
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        let interval = seconds(args.timeline_interval, "--timeline-interval")?;
        simulation = simulation.with_timeline(TimelineConfig {
            interval,
            ..TimelineConfig::default()
        })?;
    }
    if let Some(faults) = &args.faults {
        simulation = simulation.with_faults(faults)?;
    }
    let end = simulation.end();
    let bar = progress_bar(end.0 / 1_000_000_000, "simulated s");
    let step = Nanos::from_secs(5);
    // Without a terminal, long runs (over ten simulated minutes) report every tenth instead.
    let tenth = Nanos(end.0 / 10);
    let mut next_report = if bar.is_none() && end > Nanos::from_secs(600) {
        tenth
    } else {
        Nanos::MAX
    };
    let mut t = Nanos::ZERO;
    let reproduce = |e: sim::SimError| match (&e, &args.faults) {
        (sim::SimError::Invariant { .. }, Some(faults)) => anyhow::anyhow!(
            "{e}\nreproduce: kvroute sim --seed {} --faults {faults} (with the same other flags)",
            args.cluster.seed
        ),
        _ => e.into(),
    };
    while t < end {
        t = (t + step).min(end);
        simulation.run_until(t).map_err(reproduce)?;
        if let Some(bar) = &bar {
            bar.set_position(t.0 / 1_000_000_000);
        }
        if t >= next_report {
            eprintln!(
                "sim: {:.0} of {:.0} simulated s after {:.0} s wall",
                t.as_secs_f64(),
                end.as_secs_f64(),
                started.elapsed().as_secs_f64()
            );
            next_report += tenth;
        }
    }
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    Ok(simulation)
}

/// What the injected faults did, after the run's table.
fn print_faults(f: &sim::faults::FaultReport, seed: u64) {
    println!();
    println!(
        "faults `{}` (--seed {seed}): every invariant held over {} steps",
        f.spec, f.checked_steps
    );
    for (at, what) in &f.timeline {
        println!("  {at:>9.2} s  {what}");
    }
    println!(
        "  requests: {} failed with their crashed worker, {} timed out, {} routed again",
        f.worker_failed_requests, f.timed_out_requests, f.retried_requests
    );
    println!(
        "  migrations: {} after a crash (worker_failed), {} after a stall (worker_timeout)",
        f.migrations.worker_failed, f.migrations.worker_timeout
    );
    if f.plan
        .as_ref()
        .is_some_and(|p| p.replica_restart.is_some() || p.partition.is_some())
    {
        println!(
            "  gateway replicas: {} requests lost with a dead replica's connections, {} peer \
             updates lost, {} KV events missed while cut off, {} snapshots applied",
            f.gateway_failed_requests, f.peer_updates_lost, f.kv_events_missed, f.snapshots_applied
        );
    }
    println!(
        "  KV events: {} lost, {} delayed, {} duplicated, {} reordered; {} resyncs, {} stale refused",
        f.kv_events_lost,
        f.kv_events_delayed,
        f.kv_events_duplicated,
        f.kv_events_reordered,
        f.kv_resyncs,
        f.kv_stale_events
    );
    println!(
        "  index: {} stale block claims, the longest {:.3} s",
        f.stale_claims, f.max_stale_claim_s
    );
}

fn write_records(path: &Path, records: &[sim::RequestRecord]) -> Result<()> {
    let file =
        std::fs::File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    let mut w = std::io::BufWriter::new(file);
    for r in records {
        serde_json::to_writer(&mut w, r)?;
        w.write_all(b"\n")?;
    }
    w.flush()
        .with_context(|| format!("writing {}", path.display()))
}

fn parse_window(s: &str) -> Result<(f64, f64), String> {
    let bad = || format!("expected FROM:TO in simulated seconds with FROM < TO, got `{s}`");
    let (from, to) = s.split_once(':').ok_or_else(bad)?;
    let from: f64 = from.trim().parse().map_err(|_| bad())?;
    let to: f64 = to.trim().parse().map_err(|_| bad())?;
    if !(from.is_finite() && to.is_finite() && from >= 0.0 && from < to) {
        return Err(bad());
    }
    Ok((from, to))
}

/// DIR/timeline.csv and DIR/timeline.svg (in flight, waiting and TTFT per worker, one chart
/// above the other).
fn write_timeline(
    dir: &Path,
    timeline: &Timeline,
    title: &str,
    window: Option<(f64, f64)>,
) -> Result<()> {
    let csv = dir.join("timeline.csv");
    std::fs::write(&csv, timeline.to_csv())
        .with_context(|| format!("cannot write {}", csv.display()))?;
    let svg = dir.join("timeline.svg");
    std::fs::write(&svg, report::svg::stack(&timeline.charts(title, window)))
        .with_context(|| format!("cannot write {}", svg.display()))
}

/// A progress bar on stderr when it is a terminal; `None` otherwise (quiet in CI and pipes).
pub fn progress_bar(len: u64, unit: &str) -> Option<ProgressBar> {
    if !std::io::stderr().is_terminal() {
        return None;
    }
    let bar = ProgressBar::new(len);
    let template = format!("{{elapsed_precise}} [{{bar:40}}] {{pos}}/{{len}} {unit} (eta {{eta}})");
    if let Ok(style) = ProgressStyle::with_template(&template) {
        bar.set_style(style.progress_chars("=> "));
    }
    Some(bar)
}

fn opt(v: Option<f64>, decimals: usize) -> String {
    v.map_or("–".to_string(), |x| format!("{x:.decimals$}"))
}

/// The run's tables; `load` names the traffic when it is not the chat's conversations.
fn print_run(results: &BenchResults, totals: &sim::RunTotals, load: Option<&str>) {
    let b = &results.bench;
    let Some(r) = results.runs.first() else {
        return;
    };
    let load = load.map_or_else(
        || format!("{} conversations", r.concurrency),
        str::to_string,
    );
    println!(
        "{} router, {} × {}, {load}: {} s measured after {} s warmup, seed {}",
        r.router, b.workers, b.profile, b.window_s, b.warmup_s, b.seed
    );
    print_latencies(r);
    println!("\nper worker (measurement window):");
    println!(
        "  {:>6}{}  {:>7}  {:>9}  {:>9}  {:>8}  {:>14}  {:>11}",
        "worker",
        if b.disagg.is_some() || r.per_worker.iter().any(|w| w.pool.is_some()) {
            format!("  {:<7}", "pool")
        } else {
            String::new()
        },
        "routed",
        "peak",
        "mean",
        "GPU util",
        "prefill tokens",
        "preemptions"
    );
    for w in &r.per_worker {
        println!(
            "  {:>6}{}  {:>7}  {:>9}  {:>9.1}  {:>7.1}%  {:>14}  {:>11}",
            w.worker,
            w.pool
                .as_ref()
                .map_or(String::new(), |p| format!("  {p:<7}")),
            w.routed,
            w.peak_in_flight,
            w.mean_in_flight,
            w.utilisation * 100.0,
            w.prefill_tokens,
            w.preemptions
        );
    }
    if let Some(d) = &totals.disagg {
        println!(
            "routes (whole run): {} split, {} local (short prompt), {} local (prefill pool \
             unavailable), {} retried locally after a prefill failure; {} KV transfers, {:.1} GB",
            d.split,
            d.local_short,
            d.local_unavailable,
            d.local_retry,
            d.kv_transfers,
            d.kv_transfer_bytes as f64 / 1e9
        );
    }
    if let Some(replicas) = &totals.replicas {
        print_replicas(replicas, r);
    }
    println!(
        "\nturns: {} issued, {} finished, {} failed, {} in flight at the end; {} engine steps, {} KV events",
        totals.issued,
        totals.finished,
        totals.failed,
        totals.in_flight_at_end,
        totals.engine_steps,
        totals.kv_events
    );
}

/// The largest peak in-flight count of any worker over the measurement window.
fn busiest_peak(r: &Row) -> u32 {
    r.per_worker
        .iter()
        .map(|w| w.peak_in_flight)
        .max()
        .unwrap_or(0)
}

/// The replicas' line: their sync, the busiest worker's peak and what the updates did.
fn print_replicas(replicas: &sim::ReplicaTotals, r: &Row) {
    let sync = match replicas.sync_delay {
        Some(d) => format!("sync {} ms", d.as_secs_f64() * 1e3),
        None => "no sync".to_string(),
    };
    println!(
        "gateway replicas: {} ({sync}); busiest worker's peak in flight {}; turns per replica {:?}; \
         updates {} sent, {} applied, {} stale, {} reordered, {} skipped, {} refused",
        replicas.replicas,
        busiest_peak(r),
        replicas.turns,
        replicas.updates_sent,
        replicas.updates_applied,
        replicas.updates_stale,
        replicas.updates_reordered,
        replicas.updates_skipped,
        replicas.updates_refused
    );
}

fn print_mix(results: &BenchResults, config: &WorkloadConfig, stats: &workload::WorkloadStats) {
    let Some(r) = results.runs.first() else {
        return;
    };
    let arrivals = match config.rate_rps {
        Some(rate) => format!(
            "open loop, {rate} sessions/s Poisson; {} arrivals refused (over {} open)",
            stats.arrivals_dropped, config.max_open
        ),
        None => format!("closed loop, {} sessions open", r.concurrency),
    };
    let [a, b, c] = stats.sessions_by_class;
    println!(
        "\nmix {} ({arrivals}); sessions started: A {a}, B {b}, C {c}",
        config.mix
    );
    println!(
        "  {:<18} {:>8} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8} {:>8} {:>7}",
        "workload",
        "requests",
        "TTFT p50",
        "TTFT p95",
        "ITL p50",
        "ITL p95",
        "E2E p95",
        "prompt",
        "output",
        "KV hit"
    );
    for k in &r.per_class {
        let m = &k.metrics;
        println!(
            "  {:<18} {:>8} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8} {:>8} {:>7}",
            format!("{} {}", k.class, k.name),
            m.requests,
            opt(m.ttft_ms.p50, 1),
            opt(m.ttft_ms.p95, 1),
            opt(m.itl_ms.p50, 1),
            opt(m.itl_ms.p95, 1),
            opt(m.e2e_s.p95, 2),
            opt(m.mean_prompt_tokens, 0),
            opt(m.mean_output_tokens, 0),
            opt(m.kv_hit_rate.map(|h| h * 100.0), 1) + "%"
        );
    }
    println!("  (TTFT, ITL in ms; E2E in s; prompt and output: mean tokens per request)");
}

pub fn print_latencies(r: &Row) {
    let m = &r.metrics;
    let line = |name: &str, unit: &str, p: &Percentiles, decimals: usize| {
        println!(
            "  {name:<4}  p50 {:>9} {unit:<2}   p95 {:>9} {unit}",
            opt(p.p50, decimals),
            opt(p.p95, decimals)
        );
    };
    line("TTFT", "ms", &m.ttft_ms, 1);
    line("TPOT", "ms", &m.tpot_ms, 1);
    // Seed 003's main observation: KV routing lowers TTFT on turns 2+, not on turn 1.
    for (name, split) in [("turn 1", m.ttft_turn1_ms), ("turns 2+", m.ttft_later_ms)] {
        if let Some(p) = split {
            println!(
                "    {name:<8} p50 {:>9} ms   p95 {:>9} ms",
                opt(p.p50, 1),
                opt(p.p95, 1)
            );
        }
    }
    line("ITL", "ms", &m.itl_ms, 1);
    line("E2E", "s", &m.e2e_s, 2);
    println!(
        "  output tokens/s {:.1}   requests/s {:.2}   KV hit rate {}   oracle {}   errors {}",
        m.output_tokens_per_s,
        m.requests_per_s,
        opt(m.kv_hit_rate.map(|h| h * 100.0), 1) + "%",
        opt(m.oracle_hit_rate.map(|h| h * 100.0), 1) + "%",
        m.errors
    );
    if let Some(reuse) = &m.reuse {
        // Where a low hit rate comes from: the workload (little available), the routing
        // (predicted below available) or a stale index (reused below predicted).
        println!(
            "  reuse of prompt tokens: available on some worker {}   predicted on the chosen \
             worker {}   reused by the engine {}",
            opt(Some(reuse.available * 100.0), 1) + "%",
            opt(Some(reuse.predicted * 100.0), 1) + "%",
            opt(m.kv_hit_rate.map(|h| h * 100.0), 1) + "%",
        );
    }
    if let Some(s) = &m.serving {
        println!(
            "  goodput {:.2} req/s ({} of finished requests met TTFT and ITL SLOs)",
            s.goodput_rps,
            opt(s.goodput_share.map(|g| g * 100.0), 1) + "%"
        );
        if s.routed() > 0.0 {
            println!(
                "  routes: {:.0} split, {:.0} local short, {:.0} local (prefill unavailable), \
                 {:.0} local retry   TTFT p50 split {} ms / local {} ms",
                s.split,
                s.local_short,
                s.local_unavailable,
                s.local_retry,
                opt(s.ttft_split_ms.p50, 1),
                opt(s.ttft_local_ms.p50, 1)
            );
            println!(
                "  KV transfer p50 {} ms p95 {} ms, {} MB each, {:.0} MB/s   GPU util prefill {} decode {}",
                opt(s.kv_transfer_ms.p50, 1),
                opt(s.kv_transfer_ms.p95, 1),
                opt(s.kv_transfer_mb, 0),
                s.kv_transfer_mb_per_s,
                opt(s.prefill_utilisation.map(|u| u * 100.0), 1) + "%",
                opt(s.decode_utilisation.map(|u| u * 100.0), 1) + "%"
            );
        }
    }
    if let Some(a) = m.acceptance_rate {
        println!(
            "  speculative decoding: acceptance {:.1}%   tokens per step {}",
            a * 100.0,
            opt(m.tokens_per_step, 2)
        );
    }
}

fn positive_seconds(s: f64, flag: &str) -> Result<f64> {
    if !(s.is_finite() && s > 0.0) {
        bail!("{flag} must be a number of seconds > 0, got {s}");
    }
    Ok(s)
}

/// `kvroute sim --scenario`: the cycle in virtual time, its report on stdout (and in --out).
fn run_scenario(args: &SimArgs, scenario: &str) -> Result<()> {
    use sim::scenario::{ScalingMode, ScenarioSpec};
    use workload::scenario::{PoolSizes, ScenarioConfig};

    let started = Instant::now();
    let s = &args.scenario;
    if args.timeline.is_some() || args.records.is_some() {
        bail!("--timeline and --records apply to a plain run, not to --scenario (see --out)");
    }
    if args.rate.is_some() || args.mix.is_some() {
        bail!(
            "--scenario sets the mix and the rate itself: drop --mix and --rate (edit the scenario file instead)"
        );
    }
    let (mut config, name) = if scenario.trim() == "seed004" {
        (ScenarioConfig::seed004(), "seed004".to_string())
    } else {
        let path = Path::new(scenario);
        let text = std::fs::read_to_string(path).with_context(|| {
            format!(
                "--scenario: cannot read {} (give seed004 or a TOML file)",
                path.display()
            )
        })?;
        let config = ScenarioConfig::from_toml(&text)
            .with_context(|| format!("--scenario {}", path.display()))?;
        let name = path.file_stem().map_or_else(
            || scenario.to_string(),
            |n| n.to_string_lossy().into_owned(),
        );
        (config, name)
    };
    // The fleet: a named layout (seed004-dev by default), or explicit pools.
    let mut disagg_args = args.disagg.clone();
    if disagg_args.layout.is_none() && disagg_args.prefill_workers.is_none() {
        disagg_args.layout = Some("seed004-dev".into());
    }
    let layout_name = disagg_args
        .layout
        .clone()
        .unwrap_or_else(|| "custom".into());
    let Some((setup, profile)) = disagg_args.setup()? else {
        bail!(
            "--scenario runs on a disaggregated fleet: give --layout or --prefill-workers/--decode-workers"
        );
    };
    if let (Some(p), Some(d)) = (args.disagg.prefill_workers, args.disagg.decode_workers) {
        config.initial = PoolSizes {
            prefill: p,
            decode: d,
        };
        config.max.prefill = config.max.prefill.max(p);
        config.max.decode = config.max.decode.max(d);
        config
            .validate()
            .context("--prefill-workers/--decode-workers")?;
    }
    let mut cluster_args = args.cluster.clone();
    cluster_args.workers = setup.workers().max(1);
    if let Some(profile) = profile {
        cluster_args.profile = profile.to_string();
    }
    let cluster = cluster_args.build()?;
    let mut base = cluster.base.clone();
    base.router.policy = args.router;
    base.disagg = Some(setup);
    base.workers = setup.workers();
    base.slo = Some(report::Slo::SEED_004);
    base.seed = args.cluster.seed;

    let mut spec = ScenarioSpec::new(base, cluster.workload.clone(), config);
    spec.scenario_name = name;
    spec.layout_name = layout_name;
    spec.profile_name = cluster.profile_name.clone();
    spec.cycles = s.cycles;
    spec.sizing_steps = s.sizing_steps;
    spec.startup_delay = seconds(s.startup_delay, "--startup-delay")?;
    for scaler in [&mut spec.prefill_scaler, &mut spec.decode_scaler] {
        if let Some(p) = s.polling_interval {
            scaler.polling_interval =
                Nanos::from_secs_f64(positive_seconds(p, "--polling-interval")?);
        }
    }
    if let Some(t) = s.ttft_threshold {
        spec.prefill_scaler.threshold = positive_seconds(t, "--ttft-threshold")?;
    }
    if let Some(t) = s.itl_threshold {
        spec.decode_scaler.threshold = positive_seconds(t, "--itl-threshold")?;
    }
    if s.autoscale {
        spec.mode = ScalingMode::Autoscale {
            prefill: spec.prefill_scaler.clone(),
            decode: spec.decode_scaler.clone(),
        };
    }
    if let Some(dir) = &s.out {
        // Before the run, so that a bad path fails at once.
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    let results = sim::scenario::run_scenario(&spec, Arc::clone(&cluster.assets))?;
    let files = report::scenario::files(&results);
    if let Some(dir) = &s.out {
        let json = serde_json::to_string_pretty(&results)? + "\n";
        let path = dir.join("results.json");
        std::fs::write(&path, json).with_context(|| format!("cannot write {}", path.display()))?;
        for (name, body) in &files {
            let path = dir.join(name);
            std::fs::write(&path, body)
                .with_context(|| format!("cannot write {}", path.display()))?;
        }
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&results)?);
    } else if let Some((_, report)) = files.first() {
        print!("{report}");
    }
    let simulated = results.meta.cycle_s * f64::from(results.meta.cycles);
    let wall = started.elapsed().as_secs_f64();
    eprintln!(
        "sim: scenario {} ({} cycle(s), {simulated:.0} simulated s) in {wall:.1} s wall",
        results.meta.scenario, results.meta.cycles
    );
    Ok(())
}
