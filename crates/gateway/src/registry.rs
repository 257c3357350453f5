//! Where workers come from and how they leave: static `--worker` URLs (described by their
//! `/info` or by flags), dynamic announcements over NATS with leases, health checks.
//!
//! - Static workers stay known for the gateway's life; a failed health check (or a failed
//!   request) takes one out of the routing set, a passing one brings it back.
//! - Dynamic workers announce themselves on `kvroute.<ns>.workers` with a lease and repeat the
//!   announcement as a heartbeat. A worker leaves when its lease runs out, when it says
//!   goodbye, or when it fails a health check or a request; a new `instance` (a restart) drops
//!   what the index held for it.
//!
//! Leaving the routing set drops the worker's blocks from the prefix index
//! ([`router::Router::remove_worker`]).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use kv_index::WorkerId;
use protocol::{Subjects, WorkerAnnounce, WorkerMessage};
use router::{WorkerLimits, WorkerTiming};
use serde::Deserialize;
use tokio_util::sync::CancellationToken;

use crate::config::WorkerSpec;
use crate::dispatch::{Dispatcher, Origin, RegistryError, WorkerInfo};
use crate::events::ZmqSubscriptions;
use crate::metrics::EventSource;

/// What a worker's `GET /info` may say about itself (field names of our engine server,
/// with common aliases).
#[derive(Debug, Default, Deserialize)]
pub struct InfoDoc {
    #[serde(default, alias = "worker_id", alias = "id")]
    pub worker: Option<u64>,
    #[serde(default, alias = "kv_block_size")]
    pub block_size: Option<u32>,
    #[serde(default, alias = "num_gpu_blocks", alias = "capacity_blocks")]
    pub kv_capacity_blocks: Option<u64>,
    #[serde(default)]
    pub max_num_seqs: Option<u32>,
    #[serde(default, alias = "zmq")]
    pub zmq_endpoint: Option<String>,
    /// Set when the worker publishes its KV events over NATS (our engine server).
    #[serde(default)]
    pub nats_kv_subject: Option<String>,
    /// The worker's marginal timing (our engine server), for `kv_load`.
    #[serde(default)]
    pub prefill_secs_per_token: Option<f64>,
    #[serde(default)]
    pub decode_secs_per_context_token: Option<f64>,
}

impl InfoDoc {
    /// Whether this is our engine server's `/info` (it returns token ids when asked).
    fn is_kvroute_engine(&self) -> bool {
        self.worker.is_some() && self.block_size.is_some() && self.kv_capacity_blocks.is_some()
    }
}

/// Builds a static worker's description from its flags and, when it has one, its `/info`.
/// Flags win. Without an id from either, the id is a hash of the URL.
pub fn describe(spec: &WorkerSpec, info: Option<&InfoDoc>, router_block_size: usize) -> WorkerInfo {
    let id = spec
        .id
        .or(info.and_then(|i| i.worker).map(WorkerId))
        .unwrap_or_else(|| WorkerSpec::default_id(&spec.url));
    let mut w = WorkerInfo::new(id, &spec.url);
    w.prompt = spec.prompt;
    w.block_size = spec
        .block_size
        .or(info.and_then(|i| i.block_size).map(|b| b as usize))
        .unwrap_or(router_block_size);
    w.limits = WorkerLimits {
        max_num_seqs: spec.max_num_seqs.or(info.and_then(|i| i.max_num_seqs)),
        kv_capacity_blocks: spec
            .kv_capacity_blocks
            .or(info.and_then(|i| i.kv_capacity_blocks)),
        timing: info
            .and_then(|i| worker_timing(i.prefill_secs_per_token, i.decode_secs_per_context_token)),
    };
    // vLLM-format ZMQ events only when asked for by flag, or when the worker offers them
    // and does not publish over NATS (which the gateway reads for every worker at once).
    w.zmq = spec.zmq.clone().or_else(|| {
        info.filter(|i| i.nats_kv_subject.is_none())
            .and_then(|i| i.zmq_endpoint.clone())
    });
    w.token_ids = info.is_some_and(InfoDoc::is_kvroute_engine);
    w
}

/// A worker's declared timing, when it declares both figures and they are usable.
fn worker_timing(prefill: Option<f64>, decode: Option<f64>) -> Option<WorkerTiming> {
    let usable = |v: f64| v.is_finite() && v >= 0.0;
    match (prefill, decode) {
        (Some(p), Some(d)) if usable(p) && usable(d) => Some(WorkerTiming {
            prefill_secs_per_token: p,
            decode_secs_per_context_token: d,
        }),
        _ => None,
    }
}

/// Outcome of probing a worker's `/info`.
#[derive(Debug)]
pub enum Probe {
    /// The worker answered with a description.
    Described(InfoDoc),
    /// The worker is up but has no (usable) `/info`: a foreign backend, described by flags.
    NoInfo,
    /// The worker did not answer.
    Down(String),
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
    match response.bytes().await {
        Ok(body) => match serde_json::from_slice::<InfoDoc>(&body) {
            Ok(doc) => Probe::Described(doc),
            Err(_) => Probe::NoInfo,
        },
        Err(e) => Probe::Down(e.to_string()),
    }
}

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
}

impl RegistryCtx {
    fn start_zmq(&self, info: &WorkerInfo) {
        if let Some(endpoint) = &info.zmq {
            let block_size = u32::try_from(info.block_size).unwrap_or(u32::MAX);
            self.zmq.ensure(
                info.id,
                endpoint,
                block_size,
                &self.dispatcher,
                &self.cancel,
            );
        }
    }

    /// Registers a static worker: routable if it answers, otherwise known and waiting for
    /// its health check. A block size that cannot work is an error.
    pub async fn add_static(&self, spec: &WorkerSpec) -> Result<WorkerInfo, RegistryError> {
        let block = self.dispatcher.block_size();
        let (info, up) = match probe_info(&self.http, &spec.url, self.probe_timeout).await {
            Probe::Described(doc) => (describe(spec, Some(&doc), block), true),
            Probe::NoInfo => (describe(spec, None, block), true),
            Probe::Down(why) => {
                tracing::warn!(url = %spec.url, %why, "worker not reachable yet; waiting for its health check");
                (describe(spec, None, block), false)
            }
        };
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
                        let block = ctx.dispatcher.block_size();
                        let fresh = match probe_info(&ctx.http, &spec.url, ctx.probe_timeout).await {
                            Probe::Described(doc) => describe(spec, Some(&doc), block),
                            Probe::NoInfo => describe(spec, None, block),
                            Probe::Down(_) => return,
                        };
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

fn announced(a: &WorkerAnnounce) -> WorkerInfo {
    let mut w = WorkerInfo::new(WorkerId(a.worker), &a.url);
    w.block_size = a.block_size as usize;
    w.limits = WorkerLimits {
        max_num_seqs: Some(a.max_num_seqs),
        kv_capacity_blocks: Some(a.kv_capacity_blocks),
        timing: worker_timing(a.prefill_secs_per_token, a.decode_secs_per_context_token),
    };
    if !a.nats_kv_events {
        w.zmq = a.zmq_endpoint.clone();
    }
    // Only kvroute engines announce themselves this way.
    w.token_ids = true;
    w
}

/// Longest lease honoured, so a bad announcement cannot pin a dead worker for long.
const MAX_LEASE: Duration = Duration::from_secs(300);

/// Consumes worker announcements, heartbeats and goodbyes until cancelled.
pub(crate) async fn run_discovery(
    ctx: RegistryCtx,
    client: async_nats::Client,
    subjects: Subjects,
    max_workers: usize,
) {
    let mut subscriber = match client.subscribe(subjects.workers()).await {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "cannot subscribe to worker announcements over NATS");
            return;
        }
    };
    // Each dynamic worker's current instance; bounded like the worker table.
    let mut instances: BTreeMap<WorkerId, u64> = BTreeMap::new();
    loop {
        let message = tokio::select! {
            _ = ctx.cancel.cancelled() => return,
            m = subscriber.next() => match m { Some(m) => m, None => return },
        };
        let message = match WorkerMessage::decode(&message.payload) {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(error = %e, "undecodable worker message; ignored");
                continue;
            }
        };
        match message {
            WorkerMessage::Announce(a) => {
                let id = WorkerId(a.worker);
                let lease = Duration::from_millis(a.lease_ms).min(MAX_LEASE);
                let deadline = Instant::now() + lease;
                let restarted = instances.get(&id).is_some_and(|i| *i != a.instance);
                if ctx.dispatcher.origin(id) == Some(Origin::Static) {
                    // Also a `--worker`: the flag's entry stays; a restart still drops
                    // what the index held for it.
                    if restarted {
                        ctx.dispatcher.resync_worker(EventSource::Nats, id);
                    }
                    instances.insert(id, a.instance);
                    continue;
                }
                if !restarted
                    && instances.contains_key(&id)
                    && ctx.dispatcher.renew_lease(id, deadline)
                {
                    continue;
                }
                if restarted {
                    tracing::info!(worker = %id, "worker restarted (new instance); its cached blocks are dropped");
                    ctx.dispatcher.remove_worker(id);
                    ctx.zmq.stop(id);
                }
                let info = announced(&a);
                match ctx.dispatcher.upsert_worker(
                    info.clone(),
                    Origin::Dynamic {
                        lease_deadline: deadline,
                    },
                    true,
                ) {
                    Ok(()) => {
                        if instances.len() >= max_workers && !instances.contains_key(&id) {
                            instances.clear();
                        }
                        instances.insert(id, a.instance);
                        ctx.start_zmq(&info);
                        tracing::info!(worker = %id, url = %a.url, "worker registered");
                    }
                    Err(e) => {
                        tracing::error!(worker = %id, url = %a.url, error = %e, "announced worker refused")
                    }
                }
            }
            WorkerMessage::Goodbye { worker, .. } => {
                let id = WorkerId(worker);
                instances.remove(&id);
                if ctx.dispatcher.remove_worker(id) {
                    tracing::info!(worker = %id, "worker said goodbye; removed");
                }
                ctx.zmq.stop(id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_win_over_info_and_ids_fall_back_to_the_url() {
        let spec: WorkerSpec = "http://w:1,block_size=16,max_num_seqs=8".parse().unwrap();
        let doc = InfoDoc {
            worker: Some(9),
            block_size: Some(32),
            kv_capacity_blocks: Some(1000),
            max_num_seqs: Some(64),
            zmq_endpoint: Some("tcp://w:5557".into()),
            nats_kv_subject: None,
            prefill_secs_per_token: Some(1.5e-4),
            decode_secs_per_context_token: Some(1e-7),
        };
        let w = describe(&spec, Some(&doc), 32);
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

        let bare = describe(&spec, None, 32);
        assert_eq!(bare.id, WorkerSpec::default_id("http://w:1"));
        assert_eq!(bare.limits.timing, None);
        assert_eq!(bare.zmq, None);

        assert!(w.token_ids);
        assert!(!bare.token_ids);
        let nats = InfoDoc {
            nats_kv_subject: Some("kvroute.ns.kv.9".into()),
            ..doc
        };
        assert_eq!(describe(&spec, Some(&nats), 32).zmq, None);
    }
}
