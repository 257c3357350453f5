//! Prometheus metrics with Dynamo's names and labels, so seed 001's Grafana queries work as
//! written (`sum(rate(dynamo_frontend_requests_total[1m]))`,
//! `rate(dynamo_frontend_cached_tokens_sum[1m]) / rate(dynamo_frontend_input_sequence_tokens_sum[1m])`,
//! `dynamo_component_inflight_requests`, …).
//!
//! Every frontend metric carries a `model` label, as Dynamo's do; the Kubernetes `namespace`
//! label the seed's queries filter on is added by the Prometheus scrape, not by us.
//! Histograms are lock-free ([`AtomicHistogram`]) because the relay observes inter-token
//! latency once per streamed chunk from many connections at once.
//! Router and worker state (decisions, index size, per-worker load, KV event counts) is read
//! at scrape time from a [`RouterSnapshot`], so it can never drift from the router's own
//! accounting.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{
    DescriptorEncoder, EncodeLabelSet, EncodeMetric, MetricEncoder, NoLabelSet,
};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::{MetricType, TypedMetric};
use prometheus_client::registry::Registry;

/// Which API a request used (Dynamo's `endpoint` label values).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Endpoint {
    ChatCompletions,
    Completions,
}

impl Endpoint {
    pub fn label(self) -> &'static str {
        match self {
            Endpoint::ChatCompletions => "chat_completions",
            Endpoint::Completions => "completions",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct RequestLabels {
    endpoint: &'static str,
    request_type: &'static str,
    status: &'static str,
}

/// A histogram with fixed buckets, updated with atomics only. Clones share the counts.
#[derive(Debug, Clone)]
pub struct AtomicHistogram {
    inner: Arc<HistogramInner>,
}

#[derive(Debug)]
struct HistogramInner {
    bounds: &'static [f64],
    /// Per-bucket counts (not cumulative), one extra for +Inf.
    counts: Box<[AtomicU64]>,
    /// Sum of observations, as `f64` bits.
    sum: AtomicU64,
}

impl AtomicHistogram {
    pub fn new(bounds: &'static [f64]) -> AtomicHistogram {
        AtomicHistogram {
            inner: Arc::new(HistogramInner {
                bounds,
                counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
                sum: AtomicU64::new(0f64.to_bits()),
            }),
        }
    }

    pub fn observe(&self, value: f64) {
        self.observe_n(value, 1);
    }

    /// Records `n` observations of `value` (e.g. a chunk of `n` tokens after one gap).
    pub fn observe_n(&self, value: f64, n: u64) {
        if n == 0 || !value.is_finite() {
            return;
        }
        let h = &*self.inner;
        let bucket = h.bounds.partition_point(|b| *b < value);
        h.counts[bucket].fetch_add(n, Ordering::Relaxed);
        let add = value * n as f64;
        let _ = h
            .sum
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                Some((f64::from_bits(bits) + add).to_bits())
            });
    }

    /// (sum, count, per-bucket counts): each bucket's own count, not cumulative; the last
    /// bucket is +Inf. The exposition encoder accumulates them.
    pub fn snapshot(&self) -> (f64, u64, Vec<(f64, u64)>) {
        let h = &*self.inner;
        let mut total = 0;
        let mut buckets = Vec::with_capacity(h.counts.len());
        for (i, count) in h.counts.iter().enumerate() {
            let count = count.load(Ordering::Relaxed);
            total += count;
            let bound = h.bounds.get(i).copied().unwrap_or(f64::INFINITY);
            buckets.push((bound, count));
        }
        (
            f64::from_bits(h.sum.load(Ordering::Relaxed)),
            total,
            buckets,
        )
    }
}

impl TypedMetric for AtomicHistogram {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for AtomicHistogram {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        let (sum, count, buckets) = self.snapshot();
        encoder.encode_histogram::<NoLabelSet>(sum, count, &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

/// The `pool` label of the frontend's TTFT and ITL histograms: the pool whose workers did
/// that part of the request. TTFT: `prefill` for a split route (the prefill worker computed
/// the prompt), the serving worker's pool for a local one; ITL: the decoding worker's pool.
/// `aggregated` is a worker of role `both`. Seed 004 scales the prefill pool on
/// `pool="prefill"` TTFT and the decode pool on `pool="decode"` ITL.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum PoolLabel {
    #[default]
    Aggregated,
    Prefill,
    Decode,
}

impl PoolLabel {
    const ALL: [PoolLabel; 3] = [PoolLabel::Aggregated, PoolLabel::Prefill, PoolLabel::Decode];

    pub fn as_str(self) -> &'static str {
        match self {
            PoolLabel::Aggregated => "aggregated",
            PoolLabel::Prefill => "prefill",
            PoolLabel::Decode => "decode",
        }
    }

    /// The pool of a worker of `role`.
    pub fn of_role(role: protocol::WorkerRole) -> PoolLabel {
        match role {
            protocol::WorkerRole::Both => PoolLabel::Aggregated,
            protocol::WorkerRole::Prefill => PoolLabel::Prefill,
            protocol::WorkerRole::Decode => PoolLabel::Decode,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct PoolLabels {
    pool: &'static str,
}

type HistogramFamily<L> = Family<L, AtomicHistogram, fn() -> AtomicHistogram>;

/// One histogram per [`PoolLabel`], all three exposed from the start.
#[derive(Debug, Clone)]
pub struct PoolHistograms {
    family: HistogramFamily<PoolLabels>,
    by_pool: [AtomicHistogram; 3],
}

impl PoolHistograms {
    fn new(constructor: fn() -> AtomicHistogram) -> PoolHistograms {
        let family = HistogramFamily::new_with_constructor(constructor);
        let by_pool = PoolLabel::ALL.map(|pool| {
            family
                .get_or_create(&PoolLabels {
                    pool: pool.as_str(),
                })
                .clone()
        });
        PoolHistograms { family, by_pool }
    }

    pub fn get(&self, pool: PoolLabel) -> &AtomicHistogram {
        &self.by_pool[pool as usize]
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ReuseLabels {
    kind: &'static str,
}

/// A finished request's prefix reuse, in prompt tokens: what the router's index said any
/// worker held (`available`), what it predicted on the worker it chose (`predicted`), and what
/// that worker reported it reused (`reused`, its `cached_tokens`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Reuse {
    pub prompt: u64,
    pub available: u64,
    pub predicted: u64,
    pub reused: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct MigrationLabels {
    reason: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct RouteLabels {
    route: &'static str,
    reason: &'static str,
}

fn ttft_histogram() -> AtomicHistogram {
    AtomicHistogram::new(LATENCY_BUCKETS)
}

fn itl_histogram() -> AtomicHistogram {
    AtomicHistogram::new(ITL_BUCKETS)
}

// The frontend's TTFT and ITL buckets are the autoscaler core's, so a quantile the simulator
// computes interpolates in the same buckets as Prometheus does over these histograms.
const LATENCY_BUCKETS: &[f64] = router::autoscale::FRONTEND_TTFT_BUCKETS;
const ITL_BUCKETS: &[f64] = router::autoscale::FRONTEND_ITL_BUCKETS;
const DURATION_BUCKETS: &[f64] = &[
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0, 180.0, 300.0,
    600.0,
];
const OVERHEAD_BUCKETS: &[f64] = &[
    0.000025, 0.00005, 0.0001, 0.0002, 0.0003, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005,
    0.01, 0.025, 0.05,
];
const TOKEN_BUCKETS: &[f64] = &[
    0.0, 16.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0, 32768.0,
    65536.0, 131072.0,
];

/// What the router and the worker table look like at scrape time.
#[derive(Debug, Clone, Default)]
pub struct RouterSnapshot {
    pub policy: &'static str,
    pub counters: router::RouterCounters,
    pub index: kv_index::IndexCounters,
    /// (worker, block) entries in the index.
    pub index_entries: usize,
    pub index_distinct_blocks: usize,
    pub workers: Vec<WorkerSnapshot>,
    /// KV events by source, and the resyncs their gaps caused.
    pub events: EventCounters,
    /// Replica sync with peer gateways, when on.
    pub replica: Option<ReplicaMetrics>,
}

/// The replica sync at scrape time.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReplicaMetrics {
    pub status: crate::dispatch::ReplicaStatus,
    pub outbox_full: u64,
    pub messages_sent: u64,
    pub messages_received: u64,
    pub messages_refused: u64,
    pub snapshots_served: u64,
}

/// One known worker at scrape time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerSnapshot {
    pub id: u64,
    /// `both`, `prefill` or `decode`.
    pub role: &'static str,
    pub url: String,
    pub routable: bool,
    pub in_flight: u32,
    pub pending_prefill_tokens: u64,
    /// In-flight requests still waiting for their first token.
    pub awaiting_first_token: u32,
    pub active_blocks: u64,
    pub cached_blocks: usize,
    /// Where the router's view of its cache comes from (`None` while out of the router).
    pub cache_view: Option<router::CacheView>,
    /// Time since its last KV event was applied (`None`: none yet).
    pub event_age: Option<std::time::Duration>,
    /// Event gaps that cleared its blocks.
    pub resyncs: u64,
    /// Event gaps its publisher's replay filled (nothing cleared).
    pub replays: u64,
}

/// Counts of KV event ingestion, by source.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EventCounters {
    /// Events received, by source: [in-process, NATS, ZMQ].
    pub received: [u64; 3],
    /// Messages that could not be decoded, by source.
    pub decode_errors: [u64; 3],
    /// Gaps that cleared a worker's blocks in the index (resyncs), by source.
    pub resyncs: [u64; 3],
    /// Gaps filled by the publisher's replay instead, by source.
    pub replays: [u64; 3],
    /// Events dropped because the bounded event queue was full, by source.
    pub dropped: [u64; 3],
}

/// Where a KV event came from (an index into [`EventCounters`]' arrays).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventSource {
    InProcess = 0,
    Nats = 1,
    Zmq = 2,
}

impl EventSource {
    pub const ALL: [EventSource; 3] = [EventSource::InProcess, EventSource::Nats, EventSource::Zmq];

    pub fn label(self) -> &'static str {
        match self {
            EventSource::InProcess => "in_process",
            EventSource::Nats => "nats",
            EventSource::Zmq => "zmq",
        }
    }
}

type SnapshotFn = dyn Fn() -> RouterSnapshot + Send + Sync;

/// A per-worker gauge: name, help, value.
type PerWorkerGauge = (&'static str, &'static str, fn(&WorkerSnapshot) -> i64);

/// Emits the router, worker and event metrics from a fresh snapshot at every scrape.
struct RouterCollector {
    snapshot: Arc<SnapshotFn>,
}

impl std::fmt::Debug for RouterCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RouterCollector")
    }
}

fn sat(v: impl TryInto<i64>) -> i64 {
    v.try_into().unwrap_or(i64::MAX)
}

impl Collector for RouterCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let s = (self.snapshot)();
        {
            let metric = ConstCounter::new(s.counters.routed);
            let mut family = encoder.encode_descriptor(
                "kvroute_router_decisions",
                "Requests routed, by policy",
                None,
                metric.metric_type(),
            )?;
            metric.encode(family.encode_family(&[("policy", s.policy)])?)?;
        }
        for (name, help, value) in [
            (
                "kvroute_router_refused",
                "Routing attempts refused (no worker, limits)",
                s.counters.refused,
            ),
            (
                "kvroute_router_overlap_blocks",
                "Sum over routed requests of the chosen worker's cached prefix, in blocks",
                s.counters.overlap_blocks,
            ),
            (
                "kvroute_router_available_blocks",
                "Sum over routed requests of the longest cached prefix on any worker the policy \
                 could pick, in blocks (overlap_blocks below it: reuse traded for balance)",
                s.counters.available_blocks,
            ),
            (
                "kvroute_router_prompt_blocks",
                "Sum over routed requests of their full prompt blocks",
                s.counters.prompt_blocks,
            ),
            (
                "kvroute_router_orphaned_requests",
                "In-flight requests dropped from accounting because their worker left",
                s.counters.orphaned,
            ),
            (
                "kvroute_router_kv_events_applied",
                "KV events applied to the index in sequence",
                s.index.events_applied,
            ),
            (
                "kvroute_router_kv_event_gaps",
                "KV events refused because their sequence number skipped ahead (lost events)",
                s.index.gaps,
            ),
            (
                "kvroute_router_kv_events_stale",
                "KV events ignored as duplicates or late",
                s.index.stale_events,
            ),
            (
                "kvroute_router_index_evicted_blocks",
                "Index entries evicted by its memory bound",
                s.index.blocks_evicted,
            ),
        ] {
            let metric = ConstCounter::new(value);
            metric.encode(encoder.encode_descriptor(name, help, None, metric.metric_type())?)?;
        }
        for (name, help, value) in [
            (
                "kvroute_router_index_blocks",
                "(worker, block) entries in the prefix index",
                sat(s.index_entries),
            ),
            (
                "kvroute_router_index_distinct_blocks",
                "Distinct blocks in the prefix index",
                sat(s.index_distinct_blocks),
            ),
        ] {
            let metric = ConstGauge::new(value);
            metric.encode(encoder.encode_descriptor(name, help, None, metric.metric_type())?)?;
        }
        for (name, help, values) in [
            (
                "kvroute_router_kv_events_received",
                "KV events received, by source",
                s.events.received,
            ),
            (
                "kvroute_router_kv_event_decode_errors",
                "KV event messages that could not be decoded, by source",
                s.events.decode_errors,
            ),
            (
                "kvroute_router_kv_resyncs",
                "Event gaps that cleared a worker's blocks from the index, by source",
                s.events.resyncs,
            ),
            (
                "kvroute_router_kv_replays",
                "Event gaps filled by the publisher: a ZMQ replay of the missed batches, or a kvroute engine's whole-cache snapshot (over NATS, or /kv_state beside ZMQ) for a gateway that subscribed late or lost more than the replay holds (no blocks cleared), by source",
                s.events.replays,
            ),
            (
                "kvroute_router_kv_events_dropped",
                "KV events dropped because the event queue was full, by source",
                s.events.dropped,
            ),
        ] {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for source in EventSource::ALL {
                let metric = ConstCounter::new(values[source as usize]);
                metric.encode(family.encode_family(&[("source", source.label())])?)?;
            }
        }
        if let Some(r) = &s.replica {
            encode_replica(&mut encoder, r)?;
        }
        let per_worker: [PerWorkerGauge; 6] = [
            (
                "dynamo_component_inflight_requests",
                "Requests in flight on each worker, as the gateway routed them",
                |w| i64::from(w.in_flight),
            ),
            (
                "kvroute_worker_pending_prefill_tokens",
                "Prompt tokens each worker still has to prefill, as the router accounts them",
                |w| sat(w.pending_prefill_tokens),
            ),
            (
                "kvroute_worker_awaiting_first_token",
                "Requests on each worker still waiting for their first token, as the router accounts them",
                |w| i64::from(w.awaiting_first_token),
            ),
            (
                "kvroute_worker_active_blocks",
                "Distinct KV blocks of each worker's in-flight requests",
                |w| sat(w.active_blocks),
            ),
            (
                "kvroute_worker_cached_blocks",
                "Blocks the prefix index holds for each worker",
                |w| sat(w.cached_blocks),
            ),
            (
                "kvroute_worker_routable",
                "1 while the worker is in the routing set (healthy, registered)",
                |w| i64::from(w.routable),
            ),
        ];
        {
            let mut family = encoder.encode_descriptor(
                "kvroute_worker_role",
                "1 on each worker's role (both, prefill, decode): its pool in disaggregated \
                 serving",
                None,
                MetricType::Gauge,
            )?;
            for w in &s.workers {
                let labels = [
                    ("worker_id", w.id.to_string()),
                    ("worker", w.url.clone()),
                    ("role", w.role.to_string()),
                ];
                ConstGauge::new(1).encode(family.encode_family(&labels)?)?;
            }
        }
        {
            let mut family = encoder.encode_descriptor(
                "kvroute_worker_cache_view",
                "1 on where the router's view of each routable worker's cache comes from: its KV \
                 events, or the router's own predictions (a worker that announced no event \
                 source, until its first event)",
                None,
                MetricType::Gauge,
            )?;
            for w in &s.workers {
                let Some(view) = w.cache_view else { continue };
                let labels = [
                    ("worker_id", w.id.to_string()),
                    ("worker", w.url.clone()),
                    ("view", view.label().to_string()),
                ];
                ConstGauge::new(1).encode(family.encode_family(&labels)?)?;
            }
        }
        {
            let mut family = encoder.encode_descriptor(
                "kvroute_worker_kv_event_age_seconds",
                "Seconds since each worker's last KV event was applied (absent before its first): \
                 a growing age under load means its cache view is going stale",
                None,
                MetricType::Gauge,
            )?;
            for w in &s.workers {
                let Some(age) = w.event_age else { continue };
                let labels = [("worker_id", w.id.to_string()), ("worker", w.url.clone())];
                ConstGauge::new(age.as_secs_f64()).encode(family.encode_family(&labels)?)?;
            }
        }
        for (name, help, count) in [
            (
                "kvroute_worker_kv_resyncs",
                "Event gaps that cleared each worker's blocks from the index",
                (|w: &WorkerSnapshot| w.resyncs) as fn(&WorkerSnapshot) -> u64,
            ),
            (
                "kvroute_worker_kv_replays",
                "Event gaps each worker's publisher filled (ZMQ replay, or a kvroute engine's cache snapshot over NATS or /kv_state), so nothing was cleared",
                |w: &WorkerSnapshot| w.replays,
            ),
        ] {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for w in &s.workers {
                let labels = [("worker_id", w.id.to_string()), ("worker", w.url.clone())];
                ConstCounter::new(count(w)).encode(family.encode_family(&labels)?)?;
            }
        }
        for (name, help, value) in per_worker {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for w in &s.workers {
                let labels = [
                    ("worker_id", w.id.to_string()),
                    ("worker", w.url.clone()),
                    ("dynamo_component", "backend".to_string()),
                    ("dynamo_endpoint", "generate".to_string()),
                ];
                ConstGauge::new(value(w)).encode(family.encode_family(&labels)?)?;
            }
        }
        Ok(())
    }
}

fn encode_replica(
    encoder: &mut DescriptorEncoder,
    r: &ReplicaMetrics,
) -> Result<(), std::fmt::Error> {
    let c = r.status.counters;
    for (name, help, value) in [
        (
            "kvroute_replica_peers",
            "Peer gateway replicas this replica hears from",
            sat(r.status.peers),
        ),
        (
            "kvroute_replica_peer_requests",
            "Peers' in-flight requests counted in this replica's load accounting",
            sat(r.status.peer_requests),
        ),
        (
            "kvroute_replica_id",
            "This gateway's replica id (--replica-id, or derived at start)",
            i64::from(r.status.id),
        ),
    ] {
        let metric = ConstGauge::new(value);
        metric.encode(encoder.encode_descriptor(name, help, None, metric.metric_type())?)?;
    }
    {
        let mut family = encoder.encode_descriptor(
            "kvroute_replica_updates",
            "Replica sync updates: sent (this replica's own), applied (peers', in order), stale \
             (duplicates, older epochs, behind a snapshot), reordered (held for an earlier one), \
             skipped (lost: a gap), refused (bounds, unknown worker)",
            None,
            MetricType::Counter,
        )?;
        for (outcome, value) in [
            ("sent", c.sent),
            ("applied", c.applied),
            ("stale", c.stale),
            ("reordered", c.reordered),
            ("skipped", c.skipped),
            ("refused", c.refused),
            ("outbox_full", r.outbox_full),
        ] {
            ConstCounter::new(value).encode(family.encode_family(&[("outcome", outcome)])?)?;
        }
    }
    for (name, help, value) in [
        (
            "kvroute_replica_snapshots_applied",
            "Peers' snapshots of their in-flight requests applied (start-up, after lost updates)",
            c.snapshots_applied,
        ),
        (
            "kvroute_replica_snapshots_served",
            "Snapshot requests of peers this replica answered",
            r.snapshots_served,
        ),
        (
            "kvroute_replica_peer_restarts",
            "Peers seen to restart (a new epoch): their old requests released",
            c.peer_restarts,
        ),
        (
            "kvroute_replica_peers_expired",
            "Peers forgotten after a lease of silence (gone without a goodbye)",
            c.peers_expired,
        ),
        (
            "kvroute_replica_same_id",
            "Messages carrying this replica's id from another process: two replicas share an id",
            c.same_id,
        ),
        (
            "kvroute_replica_messages_sent",
            "Replica messages (update batches, heartbeats) published",
            r.messages_sent,
        ),
        (
            "kvroute_replica_messages_received",
            "Replica messages received (this replica's own included)",
            r.messages_received,
        ),
        (
            "kvroute_replica_messages_refused",
            "Replica messages refused: undecodable, oversize, or out-of-order snapshot parts",
            r.messages_refused,
        ),
    ] {
        let metric = ConstCounter::new(value);
        metric.encode(encoder.encode_descriptor(name, help, None, metric.metric_type())?)?;
    }
    Ok(())
}

/// The gateway's metrics registry.
pub struct Metrics {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    pub inflight: Gauge,
    pub queued: Gauge,
    /// By the pool that prefilled ([`PoolLabel`]).
    pub ttft: PoolHistograms,
    /// By the pool that decoded.
    pub itl: PoolHistograms,
    /// Disaggregated fleets: requests by route (`local`, `split`) and reason.
    routes: Family<RouteLabels, Counter>,
    /// Prompt tokens of finished requests by reuse kind ([`Reuse`]), plus `prompt`.
    reuse: Family<ReuseLabels, Counter>,
    /// Prefill legs that failed (worker unreachable, an error, no KV parameters, timeout)
    /// and were served by a local prefill on the decode worker instead.
    pub prefill_failures: Counter,
    pub duration: AtomicHistogram,
    pub input_tokens: AtomicHistogram,
    pub output_tokens: AtomicHistogram,
    pub cached_tokens: AtomicHistogram,
    pub output_tokens_total: Counter,
    /// Worker connections that failed (connect errors, broken streams).
    pub worker_failures: Counter,
    /// Worker calls that missed a deadline (no first byte in time, a stream that stalled);
    /// each ejected its worker until its next passing health check.
    pub worker_timeouts: Counter,
    /// Requests resent to another worker mid-stream, by why their worker failed
    /// (`worker_failed`, `worker_timeout`).
    migrations: Family<MigrationLabels, Counter>,
    /// NATS worker messages ignored: a wrong or missing registration token, or an
    /// announcement whose URL did not answer `/info` with the announced identity.
    pub registrations_refused: Counter,
    /// Time the gateway itself spends on a request before forwarding it (parse, template,
    /// tokenize, hash, route, build the worker request), queue waits excluded.
    pub overhead: AtomicHistogram,
    /// What the gateway adds to a streamed request's time to first token: its time before
    /// forwarding plus the time from reading the worker's first token to handing the client's
    /// first token frame to the connection.
    pub added_ttft: AtomicHistogram,
    /// Gateway replicas: time from a peer publishing a batch of updates to this replica
    /// receiving it (both wall clocks).
    pub replica_sync_lag: AtomicHistogram,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Metrics {
    /// A registry for `model`, reading router state from `snapshot` at each scrape.
    pub fn new(
        model: &str,
        snapshot: impl Fn() -> RouterSnapshot + Send + Sync + 'static,
    ) -> Metrics {
        let mut registry = Registry::default();
        let m = Metrics {
            registry: Registry::default(),
            requests: Family::default(),
            inflight: Gauge::default(),
            queued: Gauge::default(),
            ttft: PoolHistograms::new(ttft_histogram),
            itl: PoolHistograms::new(itl_histogram),
            routes: Family::default(),
            reuse: Family::default(),
            prefill_failures: Counter::default(),
            duration: AtomicHistogram::new(DURATION_BUCKETS),
            input_tokens: AtomicHistogram::new(TOKEN_BUCKETS),
            output_tokens: AtomicHistogram::new(TOKEN_BUCKETS),
            cached_tokens: AtomicHistogram::new(TOKEN_BUCKETS),
            output_tokens_total: Counter::default(),
            worker_failures: Counter::default(),
            worker_timeouts: Counter::default(),
            migrations: Family::default(),
            registrations_refused: Counter::default(),
            overhead: AtomicHistogram::new(OVERHEAD_BUCKETS),
            added_ttft: AtomicHistogram::new(OVERHEAD_BUCKETS),
            replica_sync_lag: AtomicHistogram::new(OVERHEAD_BUCKETS),
        };
        {
            let frontend =
                registry.sub_registry_with_label(("model".into(), model.to_string().into()));
            frontend.register(
                "dynamo_frontend_requests",
                "Requests handled, by endpoint, request type (stream/unary) and status",
                m.requests.clone(),
            );
            frontend.register(
                "dynamo_frontend_inflight_requests",
                "Requests being processed by the frontend (queued or streaming)",
                m.inflight.clone(),
            );
            frontend.register(
                "dynamo_frontend_queued_requests",
                "Requests waiting in the frontend queue for a free worker slot",
                m.queued.clone(),
            );
            frontend.register(
                "dynamo_frontend_time_to_first_token_seconds",
                "Time from request arrival to the first token sent to the client, by the pool \
                 that prefilled",
                m.ttft.family.clone(),
            );
            frontend.register(
                "dynamo_frontend_inter_token_latency_seconds",
                "Time between consecutive output tokens, by the pool that decoded",
                m.itl.family.clone(),
            );
            frontend.register(
                "dynamo_frontend_request_duration_seconds",
                "Time from request arrival to its last byte",
                m.duration.clone(),
            );
            frontend.register(
                "dynamo_frontend_input_sequence_tokens",
                "Prompt length in tokens",
                m.input_tokens.clone(),
            );
            frontend.register(
                "dynamo_frontend_output_sequence_tokens",
                "Output length in tokens",
                m.output_tokens.clone(),
            );
            frontend.register(
                "dynamo_frontend_cached_tokens",
                "Prompt tokens served from the worker's prefix cache",
                m.cached_tokens.clone(),
            );
            frontend.register(
                "dynamo_frontend_output_tokens",
                "Output tokens generated",
                m.output_tokens_total.clone(),
            );
        }
        registry.register(
            "kvroute_gateway_worker_failures",
            "Worker connections that failed (connect errors, broken streams)",
            m.worker_failures.clone(),
        );
        registry.register(
            "kvroute_gateway_worker_registrations_refused",
            "NATS worker messages ignored: a wrong or missing registration token, or an \
             announced URL that did not answer /info with the announced worker id and instance",
            m.registrations_refused.clone(),
        );
        registry.register(
            "kvroute_gateway_worker_timeouts",
            "Worker calls that missed a deadline (no first byte in time, a stalled stream); \
             each ejected its worker until its next passing health check",
            m.worker_timeouts.clone(),
        );
        registry.register(
            "kvroute_gateway_migrations",
            "Requests resent mid-stream, with their output so far, to another worker, by why \
             their worker failed (worker_failed: broken stream; worker_timeout: stalled)",
            m.migrations.clone(),
        );
        for reason in ["worker_failed", "worker_timeout"] {
            // Present from the start, so a rate over them is defined.
            let _ = m.migrations.get_or_create(&MigrationLabels { reason });
        }
        registry.register(
            "kvroute_gateway_overhead_seconds",
            "Time the gateway spends on a request before forwarding it (parse, template, \
             tokenize, hash, route), queue waits excluded",
            m.overhead.clone(),
        );
        registry.register(
            "kvroute_gateway_added_ttft_seconds",
            "What the gateway adds to a streamed request's TTFT: time before forwarding plus \
             time from reading the worker's first token to handing it to the client connection",
            m.added_ttft.clone(),
        );
        registry.register(
            "kvroute_gateway_routes",
            "Requests of a disaggregated fleet by route: split (prefill worker, KV transfer, \
             decode worker) or local (prefilled on the decode worker), with the reason",
            m.routes.clone(),
        );
        registry.register(
            "kvroute_gateway_reuse_tokens",
            "Prompt tokens of successful requests whose worker reported its cached tokens, and \
             of them: the longest prefix any worker \
             held as the router's index knew it (available), the prefix the router predicted on \
             the worker it chose (predicted), and what that worker reused (reused, from its \
             cached_tokens). reused/available is reuse achieved of what was there; predicted \
             below available is routing trading reuse for balance; reused below predicted is a \
             stale index",
            m.reuse.clone(),
        );
        for kind in ["prompt", "available", "predicted", "reused"] {
            let _ = m.reuse.get_or_create(&ReuseLabels { kind });
        }
        registry.register(
            "kvroute_gateway_prefill_failures",
            "Prefill legs that failed and were served by a local prefill on the decode worker",
            m.prefill_failures.clone(),
        );
        registry.register(
            "kvroute_replica_sync_lag_seconds",
            "Gateway replicas: time from a peer publishing a batch of routing updates to its \
             arrival here (the staleness of this replica's view of its peers' load)",
            m.replica_sync_lag.clone(),
        );
        registry.register_collector(Box::new(RouterCollector {
            snapshot: Arc::new(snapshot),
        }));
        Metrics { registry, ..m }
    }

    /// Counts a finished request.
    pub fn count_request(&self, endpoint: Endpoint, stream: bool, success: bool) {
        self.requests
            .get_or_create(&RequestLabels {
                endpoint: endpoint.label(),
                request_type: if stream { "stream" } else { "unary" },
                status: if success { "success" } else { "error" },
            })
            .inc();
    }

    /// Counts a disaggregated fleet's route: (`local`|`split`, reason).
    /// A request was resent to another worker because its worker failed for `reason`.
    pub fn count_migration(&self, reason: &'static str) {
        self.migrations
            .get_or_create(&MigrationLabels { reason })
            .inc();
    }

    /// Counts a successful request's reuse.
    pub fn count_reuse(&self, reuse: Reuse) {
        for (kind, tokens) in [
            ("prompt", reuse.prompt),
            ("available", reuse.available),
            ("predicted", reuse.predicted),
            ("reused", reuse.reused),
        ] {
            self.reuse
                .get_or_create(&ReuseLabels { kind })
                .inc_by(tokens);
        }
    }

    pub fn count_route(&self, (route, reason): (&'static str, &'static str)) {
        self.routes
            .get_or_create(&RouteLabels { route, reason })
            .inc();
    }

    /// The OpenMetrics text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::with_capacity(16 << 10);
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// The content type of [`Metrics::encode`]'s output.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[cfg(test)]
mod tests {
    use super::*;

    /// Every one of `lines` appears in the exposition `text`.
    fn assert_exposes(text: &str, lines: &[&str]) {
        for line in lines {
            assert!(text.contains(line), "missing {line} in\n{text}");
        }
    }

    #[test]
    fn histogram_counts_by_bucket_and_exposes_cumulative_buckets() {
        const BOUNDS: &[f64] = &[1.0, 2.0];
        let h = AtomicHistogram::new(BOUNDS);
        h.observe(0.5);
        h.observe(1.0);
        h.observe_n(1.5, 3);
        h.observe(7.0);
        h.observe(f64::NAN);
        let (sum, count, buckets) = h.snapshot();
        assert_eq!(count, 6);
        assert!((sum - (0.5 + 1.0 + 4.5 + 7.0)).abs() < 1e-9);
        assert_eq!(buckets, vec![(1.0, 2), (2.0, 3), (f64::INFINITY, 1)]);
        let mut registry = Registry::default();
        registry.register("h", "test", h.clone());
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert_exposes(
            &text,
            &[
                "h_bucket{le=\"1.0\"} 2",
                "h_bucket{le=\"2.0\"} 5",
                "h_bucket{le=\"+Inf\"} 6",
                "h_count 6",
            ],
        );
    }

    #[test]
    fn exposition_has_dynamo_names_and_labels() {
        let m = Metrics::new("llama", || RouterSnapshot {
            policy: "kv",
            workers: vec![WorkerSnapshot {
                id: 3,
                role: "decode",
                url: "http://w:1".into(),
                routable: true,
                in_flight: 2,
                pending_prefill_tokens: 0,
                awaiting_first_token: 1,
                active_blocks: 0,
                cached_blocks: 5,
                cache_view: Some(router::CacheView::Predicted),
                event_age: Some(std::time::Duration::from_millis(1500)),
                resyncs: 2,
                replays: 4,
            }],
            ..RouterSnapshot::default()
        });
        m.count_request(Endpoint::ChatCompletions, true, true);
        m.cached_tokens.observe(64.0);
        m.output_tokens_total.inc_by(10);
        m.count_reuse(Reuse {
            prompt: 1000,
            available: 800,
            predicted: 600,
            reused: 500,
        });
        let text = m.encode();
        assert_exposes(
            &text,
            &[
                "dynamo_frontend_requests_total{model=\"llama\",endpoint=\"chat_completions\",request_type=\"stream\",status=\"success\"} 1",
                "dynamo_frontend_cached_tokens_sum{model=\"llama\"} 64.0",
                "dynamo_frontend_input_sequence_tokens_sum{model=\"llama\"} 0.0",
                "dynamo_frontend_output_tokens_total{model=\"llama\"} 10",
                "dynamo_frontend_queued_requests{model=\"llama\"} 0",
                "dynamo_frontend_inflight_requests{model=\"llama\"} 0",
                "dynamo_frontend_time_to_first_token_seconds_bucket{model=\"llama\",le=\"0.001\",pool=\"aggregated\"} 0",
                "dynamo_frontend_time_to_first_token_seconds_count{model=\"llama\",pool=\"prefill\"} 0",
                "dynamo_frontend_request_duration_seconds_count{model=\"llama\"} 0",
                "dynamo_frontend_inter_token_latency_seconds_count{model=\"llama\",pool=\"decode\"} 0",
                "kvroute_worker_role{worker_id=\"3\",worker=\"http://w:1\",role=\"decode\"} 1",
                "dynamo_frontend_output_sequence_tokens_count{model=\"llama\"} 0",
                "dynamo_component_inflight_requests{worker_id=\"3\",worker=\"http://w:1\",dynamo_component=\"backend\",dynamo_endpoint=\"generate\"} 2",
                "kvroute_router_decisions_total{policy=\"kv\"} 0",
                "kvroute_router_kv_resyncs_total{source=\"zmq\"} 0",
                "kvroute_worker_awaiting_first_token{worker_id=\"3\",worker=\"http://w:1\",dynamo_component=\"backend\",dynamo_endpoint=\"generate\"} 1",
                "kvroute_worker_cache_view{worker_id=\"3\",worker=\"http://w:1\",view=\"predicted\"} 1",
                "kvroute_worker_kv_event_age_seconds{worker_id=\"3\",worker=\"http://w:1\"} 1.5",
                "kvroute_worker_kv_resyncs_total{worker_id=\"3\",worker=\"http://w:1\"} 2",
                "kvroute_worker_kv_replays_total{worker_id=\"3\",worker=\"http://w:1\"} 4",
                "kvroute_router_kv_replays_total{source=\"zmq\"} 0",
                "kvroute_gateway_reuse_tokens_total{kind=\"available\"} 800",
                "kvroute_gateway_reuse_tokens_total{kind=\"predicted\"} 600",
                "kvroute_gateway_reuse_tokens_total{kind=\"reused\"} 500",
                "kvroute_gateway_reuse_tokens_total{kind=\"prompt\"} 1000",
                "kvroute_router_available_blocks_total 0",
            ],
        );
    }
}
