//! Where workers come from and how they leave: static `--worker` URLs (described by their
//! `/info` card or by flags), dynamic announcements over NATS with leases, health checks.
//!
//! Both paths read the same [`WorkerCard`] and turn it into a [`WorkerInfo`] in one place,
//! [`describe`]: what the card declares, with `--worker` flags winning.
//!
//! - Static workers stay known for the gateway's life; a failed health check (or a failed
//!   request, or a goodbye over NATS) takes one out of the routing set, a passing one brings
//!   it back.
//! - Dynamic workers announce themselves on `kvroute.<ns>.workers` with a lease and repeat the
//!   announcement as a heartbeat. A worker leaves when its lease runs out, when it says
//!   goodbye, or when it fails a health check or a request; a new `instance` (a restart) drops
//!   what the index held for it.
//!
//! Leaving the routing set drops the worker's blocks from the prefix index
//! ([`router::Router::remove_worker`]).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use kv_index::WorkerId;
use protocol::{Subjects, WorkerAnnounce, WorkerCard, WorkerMessage, WorkerRole};
use router::WorkerLimits;
use tokio_util::sync::CancellationToken;

use crate::config::{PromptFormat, WorkerSpec};
use crate::dispatch::{Dispatcher, Origin, RegistryError};
use crate::events::{WarnBudget, ZmqSource, ZmqSubscriptions};
use crate::metrics::{EventSource, Metrics};

/// What the gateway knows about a worker: its [`WorkerCard`] resolved against the flags and
/// the router's settings, and how to reach it.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerInfo {
    pub id: WorkerId,
    /// Base URL, no trailing slash.
    pub url: String,
    /// `{url}/v1/completions`, built once.
    pub completions_url: String,
    pub prompt: PromptFormat,
    pub block_size: usize,
    pub limits: WorkerLimits,
    /// vLLM-format KV event endpoint to subscribe to, if any (SGLang's is the same format).
    pub zmq: Option<String>,
    /// That publisher's replay endpoint (ROUTER), asked to fill a sequence gap, if any.
    pub zmq_replay: Option<String>,
    /// That publisher's whole-cache answer over HTTP (a kvroute engine's `/kv_state`), asked
    /// when a subscription starts and when a replay cannot fill a gap.
    pub zmq_state: Option<String>,
    /// The worker returns generated token ids when asked (`return_token_ids`), so the relay
    /// counts tokens exactly even when one chunk carries several.
    pub token_ids: bool,
    /// Its part in disaggregated serving (its pool: `prefill`, or the decode pool).
    pub role: WorkerRole,
}

impl WorkerInfo {
    pub fn new(id: WorkerId, url: &str) -> WorkerInfo {
        let url = url.trim_end_matches('/').to_string();
        WorkerInfo {
            id,
            completions_url: format!("{url}/v1/completions"),
            url,
            prompt: PromptFormat::Tokens,
            block_size: kv_index::DEFAULT_BLOCK_SIZE,
            limits: WorkerLimits::default(),
            zmq: None,
            zmq_replay: None,
            zmq_state: None,
            token_ids: false,
            role: WorkerRole::Both,
        }
    }
}

/// Describes a worker from what its card declares (`WorkerCard::default()` when it has
/// none) and its `--worker` flags, which win. Without an id from either, the id is a hash of
/// the URL; without a block size, the router's.
pub fn describe(spec: &WorkerSpec, card: &WorkerCard, router_block_size: usize) -> WorkerInfo {
    let id = spec
        .id
        .or(card.worker)
        .unwrap_or_else(|| WorkerSpec::default_id(&spec.url));
    let mut w = WorkerInfo::new(id, &spec.url);
    w.prompt = spec.prompt;
    w.block_size = spec
        .block_size
        .or(card.block_size.map(|b| b as usize))
        .unwrap_or(router_block_size);
    w.limits = spec.limits.or(card.limits).usable();
    // vLLM-format ZMQ events only when asked for by flag, or when the worker offers them
    // and does not publish over NATS (which the gateway reads for every worker at once).
    // Its replay endpoint goes with the event endpoint it replays: the flag's with the flag's,
    // the card's with the card's.
    (w.zmq, w.zmq_replay) = match &spec.zmq {
        Some(endpoint) => (Some(endpoint.clone()), spec.zmq_replay.clone()),
        None => match card.zmq_endpoint.as_deref() {
            Some(endpoint) if card.nats_kv_subject.is_none() => (
                Some(reachable_endpoint(endpoint, &spec.url)),
                card.zmq_replay_endpoint
                    .as_deref()
                    .map(|replay| reachable_endpoint(replay, &spec.url)),
            ),
            _ => (None, None),
        },
    };
    // The snapshot describes the card's own stream, so only that stream is resumed from it.
    w.zmq_state = match (&spec.zmq, &w.zmq, &card.zmq_kv_state_path) {
        (None, Some(_), Some(path)) => Some(format!("{}{path}", w.url)),
        _ => None,
    };
    w.token_ids = card.returns_token_ids;
    w.role = spec.role.unwrap_or(card.role);
    w
}

/// A worker's announced ZMQ endpoint as this gateway can connect to it: a wildcard bind
/// address (`tcp://0.0.0.0:5557`, `tcp://*:5557`) is on the host the worker's URL names.
fn reachable_endpoint(endpoint: &str, worker_url: &str) -> String {
    let host = worker_url
        .split_once("://")
        .map_or(worker_url, |(_, rest)| rest)
        .split(['/', '?'])
        .next()
        .unwrap_or_default();
    // The URL's host without its port (an IPv6 host keeps its brackets).
    let host = match host.rsplit_once(':') {
        Some((name, port)) if port.chars().all(|c| c.is_ascii_digit()) => name,
        _ => host,
    };
    for wildcard in ["tcp://0.0.0.0:", "tcp://*:", "tcp://[::]:"] {
        if let Some(port) = endpoint.strip_prefix(wildcard) {
            if !host.is_empty() {
                return format!("tcp://{host}:{port}");
            }
        }
    }
    endpoint.to_string()
}

/// Outcome of probing a worker's `/info`.
#[derive(Debug)]
pub enum Probe {
    /// The worker answered with its card.
    Described(Box<WorkerCard>),
    /// The worker is up but has no (usable) `/info`: a foreign backend, described by flags.
    NoInfo,
    /// The worker did not answer.
    Down(String),
}

/// The block size the static workers agree on: each one's `block_size=` flag, else the one
/// its `/info` declared (`probes`, in the same order). `None` when none declares one; an
/// error, naming each worker's size, when they disagree.
pub fn agreed_block_size(specs: &[WorkerSpec], probes: &[Probe]) -> Result<Option<usize>, String> {
    let declared: Vec<(&str, usize)> = specs
        .iter()
        .zip(probes)
        .filter_map(|(spec, probe)| {
            let card = match probe {
                Probe::Described(card) => card.block_size.map(|b| b as usize),
                Probe::NoInfo | Probe::Down(_) => None,
            };
            spec.block_size
                .or(card)
                .map(|size| (spec.url.as_str(), size))
        })
        .collect();
    let Some(&(_, first)) = declared.first() else {
        return Ok(None);
    };
    if declared.iter().all(|&(_, size)| size == first) {
        return Ok(Some(first));
    }
    let sizes: Vec<String> = declared
        .iter()
        .map(|(url, size)| format!("{url}: {size} tokens"))
        .collect();
    Err(format!(
        "the workers use different KV block sizes ({}); one router needs one size: start the \
         engines with the same block size, or run one gateway per block size",
        sizes.join(", ")
    ))
}

pub async fn probe_info(http: &reqwest::Client, url: &str, timeout: Duration) -> Probe {
    let response = match http
        .get(format!("{url}/info"))
        .timeout(timeout)
        .send()
        .await
    {
        Ok(r) => r,
        Err(e) => return Probe::Down(e.to_string()),
    };
    if !response.status().is_success() {
        return Probe::NoInfo;
    }
    // Any URL may be announced: its answer is read within a cap, never whole.
    let mut body = Vec::new();
    let mut response = response;
    loop {
        match response.chunk().await {
            Ok(Some(chunk)) if body.len() + chunk.len() <= MAX_INFO_BYTES => {
                body.extend_from_slice(&chunk)
            }
            Ok(Some(_)) => return Probe::NoInfo,
            Ok(None) => break,
            Err(e) => return Probe::Down(e.to_string()),
        }
    }
    match serde_json::from_slice::<WorkerCard>(&body) {
        Ok(card) => Probe::Described(Box::new(card)),
        Err(_) => Probe::NoInfo,
    }
}

/// Largest `/info` answer read; a card is about 1 KiB.
const MAX_INFO_BYTES: usize = 1 << 20;

pub async fn check_health(http: &reqwest::Client, url: &str, timeout: Duration) -> bool {
    match http
        .get(format!("{url}/health"))
        .timeout(timeout)
        .send()
        .await
    {
        Ok(r) => r.status().is_success(),
        Err(_) => false,
    }
}

/// Shared pieces the registry's tasks need.
#[derive(Debug, Clone)]
pub(crate) struct RegistryCtx {
    pub dispatcher: Arc<Dispatcher>,
    /// Static workers by URL (flags and `Gateway::add_worker`), to describe them again when
    /// they come back.
    pub statics: Arc<std::sync::Mutex<BTreeMap<String, WorkerSpec>>>,
    pub http: reqwest::Client,
    pub zmq: Arc<ZmqSubscriptions>,
    pub cancel: CancellationToken,
    pub probe_timeout: Duration,
    pub metrics: Arc<Metrics>,
}

impl RegistryCtx {
    fn start_zmq(&self, info: &WorkerInfo) {
        if let Some(endpoint) = &info.zmq {
            let block_size = u32::try_from(info.block_size).unwrap_or(u32::MAX);
            let source = ZmqSource {
                endpoint: endpoint.clone(),
                replay: info.zmq_replay.clone(),
                state: info.zmq_state.clone(),
            };
            self.zmq.ensure(
                info.id,
                source,
                block_size,
                &self.http,
                &self.dispatcher,
                &self.cancel,
            );
        }
    }

    /// Registers a static worker: routable if it answers, otherwise known and waiting for
    /// its health check. A block size that cannot work is an error.
    pub async fn add_static(&self, spec: &WorkerSpec) -> Result<WorkerInfo, RegistryError> {
        let probe = probe_info(&self.http, &spec.url, self.probe_timeout).await;
        self.add_probed(spec, probe).await
    }

    /// [`add_static`](Self::add_static) with the worker's `/info` already probed.
    pub async fn add_probed(
        &self,
        spec: &WorkerSpec,
        probe: Probe,
    ) -> Result<WorkerInfo, RegistryError> {
        let (card, up) = match probe {
            Probe::Described(card) => (*card, true),
            Probe::NoInfo => (WorkerCard::default(), true),
            Probe::Down(why) => {
                tracing::warn!(url = %spec.url, %why, "worker not reachable yet; waiting for its health check");
                (WorkerCard::default(), false)
            }
        };
        let info = describe(spec, &card, self.dispatcher.block_size());
        self.dispatcher
            .upsert_worker(info.clone(), Origin::Static, up)?;
        self.statics
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(spec.url.clone(), spec.clone());
        self.start_zmq(&info);
        Ok(info)
    }
}

/// Checks every known worker's `/health` every `interval` until cancelled. A static worker
/// that comes back is described again from its `/info` (it may have restarted).
pub(crate) async fn run_health_checks(ctx: RegistryCtx, interval: Duration) {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = ctx.cancel.cancelled() => return,
            _ = ticker.tick() => {}
        }
        let workers = ctx.dispatcher.workers();
        let statics = ctx
            .statics
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let checks = workers.into_iter().map(|(info, origin, routable)| {
            let ctx = &ctx;
            let statics = &statics;
            async move {
                let healthy = check_health(&ctx.http, &info.url, ctx.probe_timeout).await;
                match (origin, routable, healthy) {
                    (Origin::Static, false, true) => {
                        let Some(spec) = statics.get(&info.url) else {
                            return;
                        };
                        let card = match probe_info(&ctx.http, &spec.url, ctx.probe_timeout).await {
                            Probe::Described(card) => *card,
                            Probe::NoInfo => WorkerCard::default(),
                            Probe::Down(_) => return,
                        };
                        let fresh = describe(spec, &card, ctx.dispatcher.block_size());
                        if fresh.id != info.id {
                            ctx.dispatcher.remove_worker(info.id);
                            ctx.zmq.stop(info.id);
                        }
                        match ctx.dispatcher.upsert_worker(fresh.clone(), Origin::Static, true) {
                            Ok(()) => ctx.start_zmq(&fresh),
                            Err(e) => tracing::error!(url = %spec.url, error = %e, "worker cannot be used"),
                        }
                    }
                    (Origin::Static, true, false) => ctx.dispatcher.set_routable(info.id, false),
                    // Back from an ejection (the dispatcher keeps it out until that is over).
                    (Origin::Dynamic { .. }, false, true) => {
                        ctx.dispatcher.set_routable(info.id, true)
                    }
                    (Origin::Dynamic { .. }, _, false) => {
                        ctx.dispatcher.worker_failed(info.id);
                        ctx.zmq.stop(info.id);
                    }
                    _ => {}
                }
            }
        });
        futures::future::join_all(checks).await;
    }
}

/// Drops dynamic workers whose lease ran out, checking every `every` until cancelled.
pub(crate) async fn run_lease_expiry(ctx: RegistryCtx, every: Duration) {
    let mut ticker = tokio::time::interval(every);
    loop {
        tokio::select! {
            _ = ctx.cancel.cancelled() => return,
            _ = ticker.tick() => {}
        }
        for worker in ctx.dispatcher.expire_leases(Instant::now()) {
            ctx.zmq.stop(worker);
        }
    }
}

/// Longest lease honoured, so a bad announcement cannot pin a dead worker for long.
const MAX_LEASE: Duration = Duration::from_secs(300);

/// Most announcements whose identity is checked at once; others wait for their next
/// heartbeat, so a flood of announcements costs a bounded number of probes.
const MAX_PENDING_CHECKS: usize = 32;

/// A dynamic (or also static) worker as its last accepted announcement described it.
#[derive(Debug, Clone)]
struct Registered {
    instance: u64,
    url: String,
}

/// What probing an announced worker found.
#[derive(Debug)]
enum Identity {
    /// Its URL answered `/info` with the announced worker id and instance.
    Confirmed,
    /// It did not; why (for the log).
    Refused(String),
}

/// Whether `url` answers `/info` as worker `id`, run `instance`.
async fn confirm_identity(ctx: &RegistryCtx, url: &str, id: WorkerId, instance: u64) -> Identity {
    match probe_info(&ctx.http, url, ctx.probe_timeout).await {
        Probe::Described(card) if card.worker == Some(id) && card.instance == instance => {
            Identity::Confirmed
        }
        Probe::Described(card) => Identity::Refused(format!(
            "{url}/info answers as worker {:?} instance {}, not {id} instance {instance}",
            card.worker.map(|w| w.0),
            card.instance
        )),
        Probe::NoInfo => Identity::Refused(format!("{url}/info has no worker card")),
        Probe::Down(why) => Identity::Refused(format!("{url} does not answer: {why}")),
    }
}

/// Checks an announcement that changes what the gateway knows (a new worker, a new URL, a
/// new instance) before it takes any traffic: the announced URL must answer `/info` with the
/// announced id and instance, and a worker id already served at another URL keeps it while
/// that URL still answers as that worker.
async fn check_announcement(
    ctx: RegistryCtx,
    id: WorkerId,
    instance: u64,
    url: String,
    registered_at: Option<String>,
) -> Identity {
    if let Identity::Refused(why) = confirm_identity(&ctx, &url, id, instance).await {
        return Identity::Refused(why);
    }
    if let Some(current) = registered_at.filter(|current| *current != url) {
        if let Probe::Described(card) = probe_info(&ctx.http, &current, ctx.probe_timeout).await {
            if card.worker == Some(id) {
                return Identity::Refused(format!(
                    "worker {id} is served at {current}, which still answers as it; {url} does \
                     not take its place"
                ));
            }
        }
    }
    Identity::Confirmed
}

/// The source named in the log's summary of refused worker messages.
const REGISTRATIONS: &str = "NATS worker registrations";

/// Consumes worker announcements, heartbeats and goodbyes until cancelled.
///
/// With a registration `token`, messages without it are ignored (counted, logged
/// sparingly). With or without one, an announcement that changes what the gateway knows
/// takes traffic only once [`check_announcement`] confirms it, and a goodbye removes a worker
/// only if it names the worker's current instance.
pub(crate) async fn run_discovery(
    ctx: RegistryCtx,
    client: async_nats::Client,
    subjects: Subjects,
    max_workers: usize,
    token: Option<String>,
) {
    let subscribed = client.subscribe(subjects.workers()).await.inspect_err(
        |e| tracing::error!(error = %e, "cannot subscribe to worker announcements over NATS"),
    );
    let Ok(mut subscriber) = subscribed else {
        return;
    };
    // Each accepted worker's instance and URL; bounded like the worker table.
    let mut registered: BTreeMap<WorkerId, Registered> = BTreeMap::new();
    // Announcements being checked, by worker; their outcomes come back on `checked`.
    let mut pending: BTreeSet<WorkerId> = BTreeSet::new();
    let (checked_tx, mut checked) =
        tokio::sync::mpsc::channel::<(WorkerAnnounce, Identity)>(MAX_PENDING_CHECKS);
    let mut warnings = WarnBudget::new();
    let refuse = |warnings: &mut WarnBudget, why: &str, worker: WorkerId| {
        ctx.metrics.registrations_refused.inc();
        if warnings.allow(REGISTRATIONS) {
            tracing::warn!(worker = %worker, "worker message ignored: {why}");
        }
    };
    loop {
        let message = tokio::select! {
            _ = ctx.cancel.cancelled() => return,
            Some((announce, identity)) = checked.recv() => {
                let id = announce.card.worker.unwrap_or_default();
                pending.remove(&id);
                match identity {
                    Identity::Confirmed => accept(&ctx, &mut registered, max_workers, &announce),
                    Identity::Refused(why) => refuse(&mut warnings, &why, id),
                }
                continue;
            }
            m = subscriber.next() => match m { Some(m) => m, None => return },
        };
        let message = match WorkerMessage::decode(&message.payload) {
            Ok(m) => m,
            Err(e) => {
                refuse(&mut warnings, &format!("undecodable: {e}"), WorkerId(0));
                continue;
            }
        };
        if !message.has_token(token.as_deref()) {
            refuse(
                &mut warnings,
                "wrong or missing registration token (--registration-token)",
                message.worker(),
            );
            continue;
        }
        match message {
            WorkerMessage::Announce(a) => {
                let id = message_worker(&a);
                let url = WorkerInfo::new(id, &a.card.url).url;
                let known = registered.get(&id).cloned();
                if let Some(known) = &known {
                    if known.instance == a.card.instance && known.url == url {
                        if ctx.dispatcher.origin(id) == Some(Origin::Static) {
                            continue;
                        }
                        let lease = Duration::from_millis(a.lease_ms).min(MAX_LEASE);
                        if ctx.dispatcher.renew_lease(id, Instant::now() + lease) {
                            continue;
                        }
                        // Gone from the table (failed, expired): checked again below.
                    }
                }
                if pending.contains(&id) || pending.len() >= MAX_PENDING_CHECKS {
                    continue;
                }
                pending.insert(id);
                let (ctx, done) = (ctx.clone(), checked_tx.clone());
                tokio::spawn(async move {
                    let identity =
                        check_announcement(ctx, id, a.card.instance, url, known.map(|k| k.url))
                            .await;
                    let _ = done.send((a, identity)).await;
                });
            }
            WorkerMessage::Goodbye {
                worker, instance, ..
            } => {
                let id = WorkerId(worker);
                if registered.get(&id).is_none_or(|r| r.instance != instance) {
                    refuse(
                        &mut warnings,
                        "a goodbye for another instance than the registered one",
                        id,
                    );
                    continue;
                }
                registered.remove(&id);
                if ctx.dispatcher.origin(id) == Some(Origin::Static) {
                    // A `--worker` stays known for the gateway's life: out of the routing set
                    // until its health check passes again, as after a failed one.
                    ctx.dispatcher.set_routable(id, false);
                    tracing::info!(worker = %id, "worker said goodbye; out of the routing set until healthy");
                } else {
                    if ctx.dispatcher.remove_worker(id) {
                        tracing::info!(worker = %id, "worker said goodbye; removed");
                    }
                    ctx.zmq.stop(id);
                }
            }
        }
        warnings.tick(REGISTRATIONS);
    }
}

/// The worker an announcement names ([`WorkerMessage::decode`] checked that it names one).
fn message_worker(announce: &WorkerAnnounce) -> WorkerId {
    announce.card.worker.unwrap_or_default()
}

/// Puts a confirmed announcement into the routing set (replacing what the gateway knew of
/// the worker: a restart, a new URL).
fn accept(
    ctx: &RegistryCtx,
    registered: &mut BTreeMap<WorkerId, Registered>,
    max_workers: usize,
    a: &WorkerAnnounce,
) {
    let info = describe(
        &WorkerSpec::new(a.card.url.as_str()),
        &a.card,
        ctx.dispatcher.block_size(),
    );
    let id = info.id;
    let known = registered.get(&id);
    let replaced = known.is_some_and(|k| k.instance != a.card.instance || k.url != info.url);
    let entry = Registered {
        instance: a.card.instance,
        url: info.url.clone(),
    };
    if ctx.dispatcher.origin(id) == Some(Origin::Static) {
        // Also a `--worker`: the flag's entry stays; a restart still drops what the index
        // held for it (through its event stream, so its first batch does not drop it again).
        match known {
            Some(k) if k.instance != a.card.instance => {
                ctx.dispatcher
                    .stream_restarted(EventSource::Nats, id, a.card.instance);
            }
            Some(_) if replaced => ctx.dispatcher.resync_worker(EventSource::Nats, id),
            _ => {}
        }
        registered.insert(id, entry);
        return;
    }
    if replaced {
        tracing::info!(worker = %id, url = %info.url, "worker restarted or moved; its cached blocks are dropped");
        ctx.dispatcher.remove_worker(id);
        ctx.zmq.stop(id);
    }
    let lease = Duration::from_millis(a.lease_ms).min(MAX_LEASE);
    match ctx.dispatcher.upsert_worker(
        info.clone(),
        Origin::Dynamic {
            lease_deadline: Instant::now() + lease,
        },
        true,
    ) {
        Ok(()) => {
            if registered.len() >= max_workers && !registered.contains_key(&id) {
                registered.clear();
            }
            registered.insert(id, entry);
            ctx.start_zmq(&info);
            tracing::info!(worker = %id, url = %info.url, "worker registered");
        }
        Err(e) => {
            tracing::error!(worker = %id, url = %info.url, error = %e, "announced worker refused")
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_wildcard_zmq_endpoint_is_reached_on_the_workers_host() {
        for (endpoint, url, expected) in [
            (
                "tcp://0.0.0.0:5557",
                "http://10.0.0.5:8000",
                "tcp://10.0.0.5:5557",
            ),
            (
                "tcp://*:5557",
                "http://engine-0.engine:8000/",
                "tcp://engine-0.engine:5557",
            ),
            (
                "tcp://[::]:5557",
                "http://[fd00::1]:8000",
                "tcp://[fd00::1]:5557",
            ),
            (
                "tcp://127.0.0.1:5557",
                "http://10.0.0.5:8000",
                "tcp://127.0.0.1:5557",
            ),
        ] {
            assert_eq!(
                super::reachable_endpoint(endpoint, url),
                expected,
                "{endpoint} at {url}"
            );
        }
    }

    use super::*;
    use router::WorkerTiming;

    #[test]
    fn flags_win_over_info_and_ids_fall_back_to_the_url() {
        let spec: WorkerSpec = "http://w:1,block_size=16,max_num_seqs=8".parse().unwrap();
        let card = WorkerCard {
            worker: Some(WorkerId(9)),
            block_size: Some(32),
            limits: WorkerLimits {
                max_num_seqs: Some(64),
                kv_capacity_blocks: Some(1000),
                timing: Some(WorkerTiming {
                    prefill_secs_per_token: 1.5e-4,
                    decode_secs_per_context_token: 1e-7,
                }),
            },
            zmq_endpoint: Some("tcp://w:5557".into()),
            returns_token_ids: true,
            ..WorkerCard::default()
        };
        let w = describe(&spec, &card, 32);
        assert_eq!(
            w.role,
            WorkerRole::Both,
            "a card without a role is aggregated"
        );
        let prefill = WorkerCard {
            role: WorkerRole::Prefill,
            ..card.clone()
        };
        assert_eq!(describe(&spec, &prefill, 32).role, WorkerRole::Prefill);
        let decode: WorkerSpec = "http://w:1,role=decode".parse().unwrap();
        assert_eq!(
            describe(&decode, &prefill, 32).role,
            WorkerRole::Decode,
            "the flag wins"
        );
        assert_eq!(
            w.limits.timing,
            Some(WorkerTiming {
                prefill_secs_per_token: 1.5e-4,
                decode_secs_per_context_token: 1e-7,
            }),
            "kv_load prices the worker with the timing it declares"
        );
        assert_eq!(w.id, WorkerId(9));
        assert_eq!(w.block_size, 16);
        assert_eq!(w.limits.max_num_seqs, Some(8));
        assert_eq!(w.limits.kv_capacity_blocks, Some(1000));
        assert_eq!(w.zmq.as_deref(), Some("tcp://w:5557"));
        assert_eq!(w.completions_url, "http://w:1/v1/completions");

        let bare = describe(&spec, &WorkerCard::default(), 32);
        assert_eq!(bare.id, WorkerSpec::default_id("http://w:1"));
        assert_eq!(bare.limits.timing, None);
        assert_eq!(bare.zmq, None);

        assert!(w.token_ids);
        assert!(!bare.token_ids);
        let nats = WorkerCard {
            nats_kv_subject: Some("kvroute.ns.kv.9".into()),
            ..card.clone()
        };
        assert_eq!(describe(&spec, &nats, 32).zmq, None);

        // A timing the router cannot price with is no timing.
        let mut broken = card;
        if let Some(timing) = &mut broken.limits.timing {
            timing.prefill_secs_per_token = f64::NAN;
        }
        assert_eq!(describe(&spec, &broken, 32).limits.timing, None);
    }

    /// A replay endpoint goes with the event endpoint it replays: the flag's with the flag's,
    /// the card's (wildcard resolved to the worker's host) with the card's.
    #[test]
    fn replay_endpoints_follow_their_event_endpoints() {
        let card = WorkerCard {
            zmq_endpoint: Some("tcp://0.0.0.0:5557".into()),
            zmq_replay_endpoint: Some("tcp://*:5558".into()),
            ..WorkerCard::default()
        };
        let announced = describe(&WorkerSpec::new("http://w:8000"), &card, 16);
        assert_eq!(announced.zmq.as_deref(), Some("tcp://w:5557"));
        assert_eq!(announced.zmq_replay.as_deref(), Some("tcp://w:5558"));
        // The flag names another publisher: the card's replay socket is not its own.
        let flagged: WorkerSpec = "http://w:8000,zmq=tcp://v:6000".parse().unwrap();
        let w = describe(&flagged, &card, 16);
        assert_eq!(w.zmq.as_deref(), Some("tcp://v:6000"));
        assert_eq!(w.zmq_replay, None);
        let both: WorkerSpec = "http://w:8000,zmq=tcp://v:6000,zmq_replay=tcp://v:6001"
            .parse()
            .unwrap();
        assert_eq!(
            describe(&both, &card, 16).zmq_replay.as_deref(),
            Some("tcp://v:6001")
        );
        // vLLM's and SGLang's own config name it `replay_endpoint`.
        let foreign: WorkerCard =
            serde_json::from_str(r#"{"zmq": "tcp://v:5557", "replay_endpoint": "tcp://v:5558"}"#)
                .unwrap();
        assert_eq!(foreign.zmq_replay_endpoint.as_deref(), Some("tcp://v:5558"));
    }

    /// Another server's `/info`, in its own names, describes a static worker as far as it
    /// goes; the router's block size fills in what neither it nor the flags say.
    #[test]
    fn foreign_info_documents_describe_what_they_name() {
        let card: WorkerCard = serde_json::from_str(
            r#"{"worker_id": 4, "num_gpu_blocks": 5000, "zmq": "tcp://v:5557", "version": "x"}"#,
        )
        .unwrap();
        let w = describe(&WorkerSpec::new("http://v:8000/"), &card, 64);
        assert_eq!(w.id, WorkerId(4));
        assert_eq!(w.url, "http://v:8000");
        assert_eq!(w.block_size, 64);
        assert_eq!(w.limits.kv_capacity_blocks, Some(5000));
        assert_eq!(w.limits.max_num_seqs, None);
        assert_eq!(w.zmq.as_deref(), Some("tcp://v:5557"));
        assert!(!w.token_ids);
    }

    /// An announcement is described exactly as the same card served by `/info` would be.
    #[test]
    fn announcements_and_info_cards_describe_a_worker_alike() {
        let card = WorkerCard {
            worker: Some(WorkerId(5)),
            instance: 11,
            url: "http://e:9000".into(),
            block_size: Some(32),
            limits: WorkerLimits {
                max_num_seqs: Some(64),
                kv_capacity_blocks: Some(13_022),
                timing: Some(WorkerTiming::H200_LLAMA70B_FP8),
            },
            nats_kv_subject: Some("kvroute.ns.kv.5".into()),
            zmq_endpoint: Some("tcp://e:5557".into()),
            returns_token_ids: true,
            ..WorkerCard::default()
        };
        let announced = describe(&WorkerSpec::new(card.url.as_str()), &card, 32);
        let probed = describe(&WorkerSpec::new("http://e:9000"), &card, 32);
        assert_eq!(announced, probed);
        assert_eq!(announced.id, WorkerId(5));
        assert_eq!(announced.limits, card.limits);
        assert_eq!(announced.zmq, None, "NATS events win over ZMQ");
        assert!(announced.token_ids);
    }
}
