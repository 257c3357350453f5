//! `/metrics`: what vLLM, TensorRT-LLM and DCGM exporters would show for this worker, in
//! Prometheus text format.
//!
//! - vLLM: `vllm:num_requests_running`, `vllm:num_requests_waiting`,
//!   `vllm:gpu_cache_usage_perc` (a 0–1 fraction, as vLLM reports it),
//!   `vllm:prefix_cache_queries_total` / `vllm:prefix_cache_hits_total` (prompt tokens),
//!   `vllm:prompt_tokens_total`, `vllm:generation_tokens_total`,
//!   `vllm:time_to_first_token_seconds`, `vllm:e2e_request_latency_seconds`,
//!   `vllm:request_success_total`; label `model_name`.
//! - TensorRT-LLM as seed 001's dashboard queries it: `trtllm_request_queue_time_seconds`
//!   (histogram: submission to first scheduling).
//! - Speculative decoding, when on (as vLLM registers them only then): vLLM's
//!   `vllm:spec_decode_num_drafts_total` (one per decoding sequence per step),
//!   `vllm:spec_decode_num_draft_tokens_total`, `vllm:spec_decode_num_accepted_tokens_total`
//!   and `vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0".."K-1"}`, from which
//!   the acceptance rate (accepted / drafted) and the mean acceptance length
//!   (1 + accepted / drafts) follow; TensorRT-LLM's `trtllm_spec_decode_num_draft_tokens_total`,
//!   `trtllm_spec_decode_num_accepted_tokens_total`, and the gauges
//!   `trtllm_spec_decode_acceptance_length` (tokens per speculative step, bonus included) and
//!   `trtllm_spec_decode_draft_overhead` (share of step time spent drafting), both over the
//!   latest stretch of at least 64 drafts (a per-step figure would jump around); and
//!   `kvroute_engine_spec_acceptance_rate`, the per-token acceptance probability α estimated
//!   from the per-position counts (the figure seed 003 quotes).
//! - DCGM: `DCGM_FI_DEV_GPU_UTIL` (percent busy over the time since the previous scrape at
//!   least a second ago), `DCGM_FI_DEV_FB_USED` (MiB: weights + KV blocks in use) and
//!   `DCGM_FI_DEV_FB_FREE` (MiB: the rest of the GPU's memory), labels
//!   `gpu`, `Hostname`, `modelName`.
//!
//! Durations are modelled seconds (what the simulated GPU took), not wall seconds: at
//! `--speedup 10` a 1 s modelled prefill shows as 1 s though it took 0.1 s.

use std::sync::Mutex;
use std::sync::atomic::AtomicU64;

use engine::EngineMetrics;
use nanotime::Nanos;
use prometheus_client::encoding::EncodeMetric;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::TypedMetric;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

type Labels = Vec<(String, String)>;
type FloatGauge = Gauge<f64, AtomicU64>;

/// Every metric of one server. Each family has one series (the server's labels never change),
/// so the server keeps that series' handle and updates it without a label lookup.
pub struct ServerMetrics {
    registry: Registry,
    running: Gauge,
    waiting: Gauge,
    cache_usage: FloatGauge,
    prefix_queries: Counter,
    prefix_hits: Counter,
    prompt_tokens: Counter,
    generation_tokens: Counter,
    success: Counter,
    ttft: Histogram,
    e2e: Histogram,
    queue_time: Histogram,
    gpu_util: FloatGauge,
    fb_used: FloatGauge,
    fb_free: FloatGauge,
    /// Speculative decoding's series, when it is on.
    spec: Option<SpecSeries>,
    /// `kvroute_engine_role{role="both|prefill|decode",kv_role="kv_…"} 1`: the worker's part
    /// in disaggregated serving, to join on.
    role: Family<Labels, Gauge>,
    /// Requests the engine refused (queue full, too long…).
    pub rejected: Counter,
    /// KV event batches dropped because the publishers fell behind.
    pub kv_batches_dropped: Counter,
    /// (modelled time, busy time) at the last utilisation sample, and the value computed then.
    util_sample: Mutex<Option<(Nanos, Nanos, f64)>>,
    /// Counter values already added, to turn the engine's cumulative counts into increments.
    last: Mutex<EngineMetrics>,
}

/// vLLM's and TensorRT-LLM's speculative-decoding series.
struct SpecSeries {
    drafts: Counter,
    draft_tokens: Counter,
    accepted_tokens: Counter,
    /// One per draft position (`position="0".."K-1"`).
    accepted_per_pos: Vec<Counter>,
    trt_draft_tokens: Counter,
    trt_accepted_tokens: Counter,
    acceptance_length: FloatGauge,
    draft_overhead: FloatGauge,
    acceptance_rate: FloatGauge,
    /// The counters when the gauges were last set: (drafts, accepted, evaluated positions,
    /// busy time, draft time).
    gauge_mark: Mutex<(u64, u64, u64, Nanos, Nanos)>,
}

/// Drafts a gauge interval covers at least.
const GAUGE_DRAFTS: u64 = 64;

impl SpecSeries {
    fn register(r: &mut Registry, labels: &Labels, draft_len: u32) -> SpecSeries {
        let per_pos: Family<Labels, Counter> = Family::default();
        let accepted_per_pos = (0..draft_len)
            .map(|j| {
                let mut l = labels.clone();
                l.push(("position".to_string(), j.to_string()));
                per_pos.get_or_create(&l).clone()
            })
            .collect();
        r.register(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Drafts whose token at this position was accepted",
            per_pos,
        );
        SpecSeries {
            drafts: series(
                r,
                labels,
                "vllm:spec_decode_num_drafts",
                "Speculative drafts proposed (one per decoding sequence per step)",
            ),
            draft_tokens: series(
                r,
                labels,
                "vllm:spec_decode_num_draft_tokens",
                "Draft tokens proposed",
            ),
            accepted_tokens: series(
                r,
                labels,
                "vllm:spec_decode_num_accepted_tokens",
                "Draft tokens accepted",
            ),
            accepted_per_pos,
            trt_draft_tokens: series(
                r,
                labels,
                "trtllm_spec_decode_num_draft_tokens",
                "Draft tokens proposed",
            ),
            trt_accepted_tokens: series(
                r,
                labels,
                "trtllm_spec_decode_num_accepted_tokens",
                "Draft tokens accepted",
            ),
            acceptance_length: series(
                r,
                labels,
                "trtllm_spec_decode_acceptance_length",
                "Tokens per speculative step, bonus token included (since the previous update)",
            ),
            draft_overhead: series(
                r,
                labels,
                "trtllm_spec_decode_draft_overhead",
                "Share of step time spent in draft passes (since the previous update)",
            ),
            acceptance_rate: series(
                r,
                labels,
                "kvroute_engine_spec_acceptance_rate",
                "Per-token acceptance probability (accepted / evaluated draft positions, since the previous update)",
            ),
            gauge_mark: Mutex::new((0, 0, 0, Nanos::ZERO, Nanos::ZERO)),
        }
    }

    /// Adds the speculative counters' increments since `last`; moves the gauges once the
    /// drafts since they were last set reach [`GAUGE_DRAFTS`].
    fn update(&self, now: &EngineMetrics, last: &EngineMetrics) {
        let delta = |a: u64, b: u64| a.saturating_sub(b);
        let drafted = delta(now.spec_draft_tokens, last.spec_draft_tokens);
        let accepted = delta(now.spec_accepted_tokens, last.spec_accepted_tokens);
        self.drafts.inc_by(delta(now.spec_drafts, last.spec_drafts));
        self.draft_tokens.inc_by(drafted);
        self.accepted_tokens.inc_by(accepted);
        self.trt_draft_tokens.inc_by(drafted);
        self.trt_accepted_tokens.inc_by(accepted);
        for (j, counter) in self.accepted_per_pos.iter().enumerate() {
            let at = |m: &EngineMetrics| m.spec_accepted_per_pos.get(j).copied().unwrap_or(0);
            counter.inc_by(delta(at(now), at(last)));
        }
        // Position j + 1 is evaluated when position j was accepted.
        let k = now.spec_accepted_per_pos.len();
        let evaluated = now.spec_drafts
            + now
                .spec_accepted_per_pos
                .iter()
                .take(k.saturating_sub(1))
                .sum::<u64>();
        let Ok(mut mark) = self.gauge_mark.lock() else {
            return;
        };
        let (drafts0, accepted0, evaluated0, busy0, draft0) = *mark;
        let drafts = delta(now.spec_drafts, drafts0);
        if drafts < GAUGE_DRAFTS {
            return;
        }
        let accepted = delta(now.spec_accepted_tokens, accepted0);
        self.acceptance_length
            .set(1.0 + accepted as f64 / drafts as f64);
        self.acceptance_rate
            .set(accepted as f64 / delta(evaluated, evaluated0).max(1) as f64);
        let busy = now.busy_time.saturating_sub(busy0).0;
        let draft = now.spec_draft_time.saturating_sub(draft0).0;
        if busy > 0 {
            self.draft_overhead
                .set((draft as f64 / busy as f64).min(1.0));
        }
        *mark = (
            now.spec_drafts,
            now.spec_accepted_tokens,
            evaluated,
            now.busy_time,
            now.spec_draft_time,
        );
    }
}

/// 1 ms to ~131 s, doubling.
fn latency_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 18))
}

/// Registers `family` as `name` with the one series `labels`, and returns that series. The
/// series exists from the start (at 0), as vLLM's do, so rates and absent-series alerts behave.
fn register_series<M>(
    registry: &mut Registry,
    labels: &Labels,
    name: &str,
    help: &str,
    family: Family<Labels, M>,
) -> M
where
    M: EncodeMetric + TypedMetric + Clone + Send + Sync + std::fmt::Debug + 'static,
{
    // A clone shares the series' value: updates through it show in the family.
    let series = family.get_or_create(labels).clone();
    registry.register(name, help, family);
    series
}

/// [`register_series`] of a gauge or counter.
fn series<M>(registry: &mut Registry, labels: &Labels, name: &str, help: &str) -> M
where
    M: EncodeMetric + TypedMetric + Clone + Default + Send + Sync + std::fmt::Debug + 'static,
{
    register_series(registry, labels, name, help, Family::default())
}

/// [`register_series`] of a latency histogram.
fn latency_series(registry: &mut Registry, labels: &Labels, name: &str, help: &str) -> Histogram {
    let family = Family::new_with_constructor(latency_histogram as fn() -> Histogram);
    register_series(registry, labels, name, help, family)
}

/// Registers an unlabelled counter and returns it.
fn counter(registry: &mut Registry, name: &str, help: &str) -> Counter {
    let counter = Counter::default();
    registry.register(name, help, counter.clone());
    counter
}

impl ServerMetrics {
    /// `draft_len`: speculative decoding's K when it is on (its series are registered then,
    /// as vLLM registers them only then).
    pub fn new(
        model: &str,
        gpu_model: &str,
        hostname: &str,
        draft_len: Option<u32>,
    ) -> ServerMetrics {
        let mut registry = Registry::default();
        let labels = vec![("model_name".to_string(), model.to_string())];
        let gpu_labels = vec![
            ("gpu".to_string(), "0".to_string()),
            ("Hostname".to_string(), hostname.to_string()),
            ("modelName".to_string(), gpu_model.to_string()),
        ];
        let r = &mut registry;
        ServerMetrics {
            running: series(
                r,
                &labels,
                "vllm:num_requests_running",
                "Requests in the running batch",
            ),
            waiting: series(
                r,
                &labels,
                "vllm:num_requests_waiting",
                "Requests waiting for admission",
            ),
            cache_usage: series(
                r,
                &labels,
                "vllm:gpu_cache_usage_perc",
                "Fraction of KV cache blocks in use (0-1)",
            ),
            prefix_queries: series(
                r,
                &labels,
                "vllm:prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache",
            ),
            prefix_hits: series(
                r,
                &labels,
                "vllm:prefix_cache_hits",
                "Prompt tokens found in the prefix cache",
            ),
            prompt_tokens: series(
                r,
                &labels,
                "vllm:prompt_tokens",
                "Prompt tokens of finished requests",
            ),
            generation_tokens: series(
                r,
                &labels,
                "vllm:generation_tokens",
                "Output tokens generated",
            ),
            success: series(r, &labels, "vllm:request_success", "Requests finished"),
            ttft: latency_series(
                r,
                &labels,
                "vllm:time_to_first_token_seconds",
                "Time to first token (modelled seconds)",
            ),
            e2e: latency_series(
                r,
                &labels,
                "vllm:e2e_request_latency_seconds",
                "Request latency from submission to last token (modelled seconds)",
            ),
            queue_time: latency_series(
                r,
                &labels,
                "trtllm_request_queue_time_seconds",
                "Time from submission to first scheduling in the engine (modelled seconds)",
            ),
            gpu_util: series(
                r,
                &gpu_labels,
                "DCGM_FI_DEV_GPU_UTIL",
                "Simulated GPU utilisation (percent)",
            ),
            fb_used: series(
                r,
                &gpu_labels,
                "DCGM_FI_DEV_FB_USED",
                "Simulated GPU framebuffer memory used (MiB)",
            ),
            fb_free: series(
                r,
                &gpu_labels,
                "DCGM_FI_DEV_FB_FREE",
                "Simulated GPU framebuffer memory free (MiB)",
            ),
            rejected: counter(
                r,
                "kvroute_engine_rejected_requests",
                "Requests the engine refused",
            ),
            kv_batches_dropped: counter(
                r,
                "kvroute_engine_kv_batches_dropped",
                "KV event batches dropped because publishers fell behind",
            ),
            spec: draft_len.map(|k| SpecSeries::register(r, &labels, k)),
            role: {
                let family = Family::<Labels, Gauge>::default();
                r.register(
                    "kvroute_engine_role",
                    "The worker's role in disaggregated serving (1 on its series)",
                    family.clone(),
                );
                family
            },
            // Last: the fields above register their metrics in it.
            registry,
            util_sample: Mutex::new(None),
            last: Mutex::new(EngineMetrics::default()),
        }
    }

    /// Declares the worker's role (`kvroute_engine_role`).
    pub fn set_role(&self, role: protocol::WorkerRole) {
        let labels = vec![
            ("role".to_string(), role.as_str().to_string()),
            ("kv_role".to_string(), role.vllm_kv_role().to_string()),
        ];
        self.role.get_or_create(&labels).set(1);
    }

    /// Refreshes gauges and counters from the engine's cumulative snapshot.
    pub fn update_engine(&self, metrics: &EngineMetrics) {
        self.running.set(i64::from(metrics.running));
        self.waiting.set(i64::from(metrics.waiting));
        self.cache_usage.set(metrics.kv_usage);
        self.fb_used
            .set(metrics.memory_used_bytes as f64 / (1u64 << 20) as f64);
        self.fb_free.set(
            metrics
                .gpu_memory_bytes
                .saturating_sub(metrics.memory_used_bytes) as f64
                / (1u64 << 20) as f64,
        );
        let Ok(mut last) = self.last.lock() else {
            return;
        };
        let add = |counter: &Counter, now: u64, before: u64| {
            counter.inc_by(now.saturating_sub(before));
        };
        add(
            &self.prefix_queries,
            metrics.prompt_tokens,
            last.prompt_tokens,
        );
        add(
            &self.prefix_hits,
            metrics.prefix_hit_tokens,
            last.prefix_hit_tokens,
        );
        add(
            &self.generation_tokens,
            metrics.tokens_generated,
            last.tokens_generated,
        );
        if let Some(spec) = &self.spec {
            spec.update(metrics, &last);
        }
        *last = metrics.clone();
    }

    pub fn observe_ttft(&self, seconds: f64) {
        self.ttft.observe(seconds);
    }

    pub fn observe_queue_time(&self, seconds: f64) {
        self.queue_time.observe(seconds);
    }

    pub fn observe_finished(&self, prompt_tokens: u32, _output_tokens: u32, e2e_seconds: f64) {
        self.prompt_tokens.inc_by(u64::from(prompt_tokens));
        self.success.inc();
        self.e2e.observe(e2e_seconds);
    }

    /// Updates the simulated GPU utilisation from the busy time between the previous sample
    /// (at least a second of modelled time ago; the server's start for the first) and now.
    /// Steps count as busy when they complete, so a value is clamped to 100.
    pub fn sample_utilisation(&self, now: Nanos, busy: Nanos) {
        let Ok(mut sample) = self.util_sample.lock() else {
            return;
        };
        let (then, busy_then, previous) = sample.unwrap_or((Nanos::ZERO, Nanos::ZERO, 0.0));
        let window = now.saturating_sub(then);
        let util = if sample.is_some() && window < Nanos::from_millis(1_000) {
            previous
        } else {
            let util = if window.0 == 0 {
                0.0
            } else {
                (busy.saturating_sub(busy_then).0 as f64 / window.0 as f64).clamp(0.0, 1.0) * 100.0
            };
            *sample = Some((now, busy, util));
            util
        };
        self.gpu_util.set(util);
    }

    /// The Prometheus text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}
