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
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

type Labels = Vec<(String, String)>;
type FloatGauge = Gauge<f64, AtomicU64>;

/// Every metric of one server.
pub struct ServerMetrics {
    registry: Registry,
    labels: Labels,
    gpu_labels: Labels,
    running: Family<Labels, Gauge>,
    waiting: Family<Labels, Gauge>,
    cache_usage: Family<Labels, FloatGauge>,
    prefix_queries: Family<Labels, Counter>,
    prefix_hits: Family<Labels, Counter>,
    prompt_tokens: Family<Labels, Counter>,
    generation_tokens: Family<Labels, Counter>,
    success: Family<Labels, Counter>,
    ttft: HistogramFamily,
    e2e: HistogramFamily,
    queue_time: HistogramFamily,
    gpu_util: Family<Labels, FloatGauge>,
    fb_used: Family<Labels, FloatGauge>,
    fb_free: Family<Labels, FloatGauge>,
    /// Speculative decoding's families, when it is on.
    spec: Option<SpecFamilies>,
    /// Requests the engine refused (queue full, too long…).
    pub rejected: Counter,
    /// KV event batches dropped because the publishers fell behind.
    pub kv_batches_dropped: Counter,
    /// (modelled time, busy time) at the last utilisation sample, and the value computed then.
    util_sample: Mutex<Option<(Nanos, Nanos, f64)>>,
    /// Counter values already added, to turn the engine's cumulative counts into increments.
    last: Mutex<EngineMetrics>,
}

type HistogramFamily = Family<Labels, Histogram, fn() -> Histogram>;

/// vLLM's and TensorRT-LLM's speculative-decoding series.
struct SpecFamilies {
    drafts: Family<Labels, Counter>,
    draft_tokens: Family<Labels, Counter>,
    accepted_tokens: Family<Labels, Counter>,
    accepted_per_pos: Family<Labels, Counter>,
    trt_draft_tokens: Family<Labels, Counter>,
    trt_accepted_tokens: Family<Labels, Counter>,
    acceptance_length: Family<Labels, FloatGauge>,
    draft_overhead: Family<Labels, FloatGauge>,
    acceptance_rate: Family<Labels, FloatGauge>,
    /// `labels` plus `position="j"`, one per draft position.
    position_labels: Vec<Labels>,
    /// The counters when the gauges were last set: (drafts, accepted, evaluated positions,
    /// busy time, draft time).
    gauge_mark: Mutex<(u64, u64, u64, Nanos, Nanos)>,
}

/// Drafts a gauge interval covers at least.
const GAUGE_DRAFTS: u64 = 64;

/// 1 ms to ~131 s, doubling.
fn latency_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 18))
}

fn histogram_family() -> HistogramFamily {
    Family::new_with_constructor(latency_histogram)
}

impl ServerMetrics {
    /// `draft_len`: speculative decoding's K when it is on (its series are registered then).
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
        let m = ServerMetrics {
            registry: Registry::default(),
            labels: labels.clone(),
            gpu_labels,
            running: Family::default(),
            waiting: Family::default(),
            cache_usage: Family::default(),
            prefix_queries: Family::default(),
            prefix_hits: Family::default(),
            prompt_tokens: Family::default(),
            generation_tokens: Family::default(),
            success: Family::default(),
            ttft: histogram_family(),
            e2e: histogram_family(),
            queue_time: histogram_family(),
            gpu_util: Family::default(),
            fb_used: Family::default(),
            fb_free: Family::default(),
            spec: draft_len.map(|k| SpecFamilies {
                drafts: Family::default(),
                draft_tokens: Family::default(),
                accepted_tokens: Family::default(),
                accepted_per_pos: Family::default(),
                trt_draft_tokens: Family::default(),
                trt_accepted_tokens: Family::default(),
                acceptance_length: Family::default(),
                draft_overhead: Family::default(),
                acceptance_rate: Family::default(),
                position_labels: (0..k)
                    .map(|j| {
                        let mut l = labels.clone();
                        l.push(("position".to_string(), j.to_string()));
                        l
                    })
                    .collect(),
                gauge_mark: Mutex::new((0, 0, 0, Nanos::ZERO, Nanos::ZERO)),
            }),
            rejected: Counter::default(),
            kv_batches_dropped: Counter::default(),
            util_sample: Mutex::new(None),
            last: Mutex::new(EngineMetrics::default()),
        };
        registry.register(
            "vllm:num_requests_running",
            "Requests in the running batch",
            m.running.clone(),
        );
        registry.register(
            "vllm:num_requests_waiting",
            "Requests waiting for admission",
            m.waiting.clone(),
        );
        registry.register(
            "vllm:gpu_cache_usage_perc",
            "Fraction of KV cache blocks in use (0-1)",
            m.cache_usage.clone(),
        );
        registry.register(
            "vllm:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            m.prefix_queries.clone(),
        );
        registry.register(
            "vllm:prefix_cache_hits",
            "Prompt tokens found in the prefix cache",
            m.prefix_hits.clone(),
        );
        registry.register(
            "vllm:prompt_tokens",
            "Prompt tokens of finished requests",
            m.prompt_tokens.clone(),
        );
        registry.register(
            "vllm:generation_tokens",
            "Output tokens generated",
            m.generation_tokens.clone(),
        );
        registry.register(
            "vllm:request_success",
            "Requests finished",
            m.success.clone(),
        );
        registry.register(
            "vllm:time_to_first_token_seconds",
            "Time to first token (modelled seconds)",
            m.ttft.clone(),
        );
        registry.register(
            "vllm:e2e_request_latency_seconds",
            "Request latency from submission to last token (modelled seconds)",
            m.e2e.clone(),
        );
        registry.register(
            "trtllm_request_queue_time_seconds",
            "Time from submission to first scheduling in the engine (modelled seconds)",
            m.queue_time.clone(),
        );
        registry.register(
            "DCGM_FI_DEV_GPU_UTIL",
            "Simulated GPU utilisation (percent)",
            m.gpu_util.clone(),
        );
        registry.register(
            "DCGM_FI_DEV_FB_USED",
            "Simulated GPU framebuffer memory used (MiB)",
            m.fb_used.clone(),
        );
        registry.register(
            "DCGM_FI_DEV_FB_FREE",
            "Simulated GPU framebuffer memory free (MiB)",
            m.fb_free.clone(),
        );
        registry.register(
            "kvroute_engine_rejected_requests",
            "Requests the engine refused",
            m.rejected.clone(),
        );
        registry.register(
            "kvroute_engine_kv_batches_dropped",
            "KV event batches dropped because publishers fell behind",
            m.kv_batches_dropped.clone(),
        );
        if let Some(f) = &m.spec {
            registry.register(
                "vllm:spec_decode_num_drafts",
                "Speculative drafts proposed (one per decoding sequence per step)",
                f.drafts.clone(),
            );
            registry.register(
                "vllm:spec_decode_num_draft_tokens",
                "Draft tokens proposed",
                f.draft_tokens.clone(),
            );
            registry.register(
                "vllm:spec_decode_num_accepted_tokens",
                "Draft tokens accepted",
                f.accepted_tokens.clone(),
            );
            registry.register(
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                "Drafts whose token at this position was accepted",
                f.accepted_per_pos.clone(),
            );
            registry.register(
                "trtllm_spec_decode_num_draft_tokens",
                "Draft tokens proposed",
                f.trt_draft_tokens.clone(),
            );
            registry.register(
                "trtllm_spec_decode_num_accepted_tokens",
                "Draft tokens accepted",
                f.trt_accepted_tokens.clone(),
            );
            registry.register(
                "trtllm_spec_decode_acceptance_length",
                "Tokens per speculative step, bonus token included (since the previous update)",
                f.acceptance_length.clone(),
            );
            registry.register(
                "trtllm_spec_decode_draft_overhead",
                "Share of step time spent in draft passes (since the previous update)",
                f.draft_overhead.clone(),
            );
            registry.register(
                "kvroute_engine_spec_acceptance_rate",
                "Per-token acceptance probability (accepted / evaluated draft positions, since the previous update)",
                f.acceptance_rate.clone(),
            );
            for family in [
                &f.drafts,
                &f.draft_tokens,
                &f.accepted_tokens,
                &f.trt_draft_tokens,
                &f.trt_accepted_tokens,
            ] {
                let _ = family.get_or_create(&m.labels);
            }
            for l in &f.position_labels {
                let _ = f.accepted_per_pos.get_or_create(l);
            }
            let _ = f.acceptance_length.get_or_create(&m.labels);
            let _ = f.draft_overhead.get_or_create(&m.labels);
            let _ = f.acceptance_rate.get_or_create(&m.labels);
        }
        // Every series exists from the start (at 0), as vLLM's do, so rates and absent-series
        // alerts behave.
        for family in [
            &m.prefix_queries,
            &m.prefix_hits,
            &m.prompt_tokens,
            &m.generation_tokens,
            &m.success,
        ] {
            let _ = family.get_or_create(&m.labels);
        }
        for family in [&m.ttft, &m.e2e, &m.queue_time] {
            let _ = family.get_or_create(&m.labels);
        }
        let _ = m.running.get_or_create(&m.labels);
        let _ = m.waiting.get_or_create(&m.labels);
        let _ = m.cache_usage.get_or_create(&m.labels);
        let _ = m.gpu_util.get_or_create(&m.gpu_labels);
        let _ = m.fb_used.get_or_create(&m.gpu_labels);
        let _ = m.fb_free.get_or_create(&m.gpu_labels);
        ServerMetrics { registry, ..m }
    }

    /// Refreshes gauges and counters from the engine's cumulative snapshot.
    pub fn update_engine(&self, metrics: &EngineMetrics) {
        self.running
            .get_or_create(&self.labels)
            .set(i64::from(metrics.running));
        self.waiting
            .get_or_create(&self.labels)
            .set(i64::from(metrics.waiting));
        self.cache_usage
            .get_or_create(&self.labels)
            .set(metrics.kv_usage);
        self.fb_used
            .get_or_create(&self.gpu_labels)
            .set(metrics.memory_used_bytes as f64 / (1u64 << 20) as f64);
        self.fb_free.get_or_create(&self.gpu_labels).set(
            metrics
                .gpu_memory_bytes
                .saturating_sub(metrics.memory_used_bytes) as f64
                / (1u64 << 20) as f64,
        );
        let Ok(mut last) = self.last.lock() else {
            return;
        };
        let add = |counter: &Family<Labels, Counter>, now: u64, before: u64| {
            counter
                .get_or_create(&self.labels)
                .inc_by(now.saturating_sub(before));
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
        if let Some(f) = &self.spec {
            self.update_spec(f, metrics, &last);
        }
        *last = metrics.clone();
    }

    /// Adds the speculative counters' increments since `last`; moves the gauges once the
    /// drafts since they were last set reach [`GAUGE_DRAFTS`].
    fn update_spec(&self, f: &SpecFamilies, now: &EngineMetrics, last: &EngineMetrics) {
        let delta = |a: u64, b: u64| a.saturating_sub(b);
        let drafted = delta(now.spec_draft_tokens, last.spec_draft_tokens);
        let accepted = delta(now.spec_accepted_tokens, last.spec_accepted_tokens);
        f.drafts
            .get_or_create(&self.labels)
            .inc_by(delta(now.spec_drafts, last.spec_drafts));
        f.draft_tokens.get_or_create(&self.labels).inc_by(drafted);
        f.accepted_tokens
            .get_or_create(&self.labels)
            .inc_by(accepted);
        f.trt_draft_tokens
            .get_or_create(&self.labels)
            .inc_by(drafted);
        f.trt_accepted_tokens
            .get_or_create(&self.labels)
            .inc_by(accepted);
        for (j, l) in f.position_labels.iter().enumerate() {
            let at = |m: &EngineMetrics| m.spec_accepted_per_pos.get(j).copied().unwrap_or(0);
            f.accepted_per_pos
                .get_or_create(l)
                .inc_by(delta(at(now), at(last)));
        }
        // Position j + 1 is evaluated when position j was accepted.
        let k = now.spec_accepted_per_pos.len();
        let evaluated = now.spec_drafts
            + now
                .spec_accepted_per_pos
                .iter()
                .take(k.saturating_sub(1))
                .sum::<u64>();
        let Ok(mut mark) = f.gauge_mark.lock() else {
            return;
        };
        let (drafts0, accepted0, evaluated0, busy0, draft0) = *mark;
        let drafts = delta(now.spec_drafts, drafts0);
        if drafts < GAUGE_DRAFTS {
            return;
        }
        let accepted = delta(now.spec_accepted_tokens, accepted0);
        f.acceptance_length
            .get_or_create(&self.labels)
            .set(1.0 + accepted as f64 / drafts as f64);
        f.acceptance_rate
            .get_or_create(&self.labels)
            .set(accepted as f64 / delta(evaluated, evaluated0).max(1) as f64);
        let busy = now.busy_time.saturating_sub(busy0).0;
        let draft = now.spec_draft_time.saturating_sub(draft0).0;
        if busy > 0 {
            f.draft_overhead
                .get_or_create(&self.labels)
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

    pub fn observe_ttft(&self, seconds: f64) {
        self.ttft.get_or_create(&self.labels).observe(seconds);
    }

    pub fn observe_queue_time(&self, seconds: f64) {
        self.queue_time.get_or_create(&self.labels).observe(seconds);
    }

    pub fn observe_finished(&self, prompt_tokens: u32, _output_tokens: u32, e2e_seconds: f64) {
        self.prompt_tokens
            .get_or_create(&self.labels)
            .inc_by(u64::from(prompt_tokens));
        self.success.get_or_create(&self.labels).inc();
        self.e2e.get_or_create(&self.labels).observe(e2e_seconds);
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
        self.gpu_util.get_or_create(&self.gpu_labels).set(util);
    }

    /// The Prometheus text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}
