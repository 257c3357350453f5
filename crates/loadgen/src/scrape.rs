//! What the load generator reads from the serving side: the gateway's Dynamo-named metrics
//! (KV cache hit rate, queued requests, the per-pool TTFT and ITL histograms) and the workers'
//! DCGM-style GPU metrics and role, scraped from their `/metrics` endpoints.

use std::collections::VecDeque;
use std::time::Duration;

use nanotime::Nanos;
use report::Percentiles;
use router::autoscale::HistogramWindow;
use serde::Serialize;

/// One sample of Prometheus text format: name, labels, value.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

impl Sample {
    pub fn label(&self, key: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

/// Parses Prometheus text exposition format (comments skipped, timestamps ignored). Lines
/// that do not parse are skipped: one odd series must not hide the others.
pub fn parse_text(text: &str) -> Vec<Sample> {
    text.lines().filter_map(parse_line).collect()
}

fn parse_line(line: &str) -> Option<Sample> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let name_end = line.find(|c: char| c == '{' || c.is_whitespace())?;
    let name = &line[..name_end];
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if rest.starts_with('{') {
        rest = &rest[1..];
        loop {
            rest = rest.trim_start_matches([' ', ',']);
            if let Some(after) = rest.strip_prefix('}') {
                rest = after;
                break;
            }
            let eq = rest.find('=')?;
            let key = rest[..eq].trim().to_owned();
            rest = rest[eq + 1..].strip_prefix('"')?;
            let mut value = String::new();
            let mut chars = rest.char_indices();
            let end = loop {
                let (i, c) = chars.next()?;
                match c {
                    '\\' => match chars.next()?.1 {
                        'n' => value.push('\n'),
                        other => value.push(other),
                    },
                    '"' => break i,
                    c => value.push(c),
                }
            };
            rest = &rest[end + 1..];
            labels.push((key, value));
        }
    }
    let value = rest.split_whitespace().next()?;
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().ok()?,
    };
    Some(Sample {
        name: name.to_owned(),
        labels,
        value,
    })
}

/// The sum of every series of `name` (`None` when there is none).
pub fn sum(samples: &[Sample], name: &str) -> Option<f64> {
    let mut found = false;
    let total = samples
        .iter()
        .filter(|s| s.name == name)
        .inspect(|_| found = true)
        .map(|s| s.value)
        .sum();
    found.then_some(total)
}

/// The sum of the series of `name` whose label `key` is `value` (`None` when there is none).
pub fn sum_where(samples: &[Sample], name: &str, (key, value): (&str, &str)) -> Option<f64> {
    let mut found = false;
    let total = samples
        .iter()
        .filter(|s| s.name == name && s.labels.iter().any(|(k, v)| k == key && v == value))
        .inspect(|_| found = true)
        .map(|s| s.value)
        .sum();
    found.then_some(total)
}

/// The gateway's counters at one moment.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GatewayPoint {
    pub at_s: f64,
    pub cached_tokens: f64,
    pub input_tokens: f64,
    pub queued: Option<f64>,
    /// kvroute's reuse attribution (`kvroute_gateway_reuse_tokens_total`), when the gateway
    /// exports it.
    pub reuse: Option<ReusePoint>,
}

/// Prompt tokens of requests whose worker reported its reuse: all of them, the prefix some
/// worker held, and what the worker reused.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ReusePoint {
    pub prompt: f64,
    pub available: f64,
    pub reused: f64,
}

impl GatewayPoint {
    pub fn from_samples(at_s: f64, samples: &[Sample]) -> Option<GatewayPoint> {
        let kind = |kind| {
            sum_where(
                samples,
                "kvroute_gateway_reuse_tokens_total",
                ("kind", kind),
            )
        };
        // Another router's gateway has no such counters: the point stands without them.
        let reuse = || {
            Some(ReusePoint {
                prompt: kind("prompt")?,
                available: kind("available")?,
                reused: kind("reused")?,
            })
        };
        Some(GatewayPoint {
            at_s,
            cached_tokens: sum(samples, "dynamo_frontend_cached_tokens_sum")?,
            input_tokens: sum(samples, "dynamo_frontend_input_sequence_tokens_sum")?,
            queued: sum(samples, "dynamo_frontend_queued_requests"),
            reuse: reuse(),
        })
    }
}

/// Cumulative counters scraped over the last window, kept so that rates are ratios of the
/// counters' increases between the oldest and newest point (as Grafana's `rate` ratios are).
/// Bounded to `max_points`; two points are always kept, so with a clock faster than the
/// scrapes (a sped-up cluster) the rate is over the last scrape interval.
#[derive(Debug)]
pub struct CounterWindow<P> {
    points: VecDeque<P>,
    max_points: usize,
    span_s: f64,
}

/// A scrape of cumulative counters.
pub trait CounterPoint {
    /// When it was scraped, in seconds.
    fn at_s(&self) -> f64;
    /// A counter went down since `earlier`: the process behind it restarted, and the older
    /// points are useless.
    fn restarted_since(&self, earlier: &Self) -> bool;
}

impl<P: CounterPoint> CounterWindow<P> {
    pub fn new(span: Duration, max_points: usize) -> CounterWindow<P> {
        CounterWindow {
            points: VecDeque::new(),
            max_points: max_points.max(2),
            span_s: span.as_secs_f64(),
        }
    }

    pub fn push(&mut self, point: P) {
        if self
            .points
            .back()
            .is_some_and(|last| point.restarted_since(last))
        {
            self.points.clear();
        }
        let at_s = point.at_s();
        self.points.push_back(point);
        while self.points.len() > self.max_points
            || (self.points.len() > 2
                && self
                    .points
                    .get(1)
                    .is_some_and(|p| p.at_s() <= at_s - self.span_s))
        {
            self.points.pop_front();
        }
    }

    pub fn clear(&mut self) {
        self.points.clear();
    }

    /// The window's span (seconds on the lane clock).
    pub fn span_s(&self) -> f64 {
        self.span_s
    }
}

impl CounterPoint for GatewayPoint {
    fn at_s(&self) -> f64 {
        self.at_s
    }

    fn restarted_since(&self, earlier: &Self) -> bool {
        self.input_tokens < earlier.input_tokens || self.cached_tokens < earlier.cached_tokens
    }
}

/// Gateway scrapes of the last window, for the hit rate as Grafana computes it (the rate of
/// cached tokens over the rate of input tokens).
pub type GatewayHistory = CounterWindow<GatewayPoint>;

impl GatewayHistory {
    /// Cached / input tokens between the oldest and newest point of the window; `None`
    /// without input in between.
    pub fn hit_rate(&self) -> Option<f64> {
        let (first, last) = (self.points.front()?, self.points.back()?);
        let input = last.input_tokens - first.input_tokens;
        (input > 0.0).then(|| ((last.cached_tokens - first.cached_tokens) / input).clamp(0.0, 1.0))
    }

    pub fn queued(&self) -> Option<f64> {
        self.points.back()?.queued
    }

    /// Over the window: the share of prompt tokens some worker held (reuse available), and
    /// the share of that the workers reused (reuse achieved / available). `None` without
    /// the gateway's reuse counters or without traffic in between.
    pub fn reuse(&self) -> Option<(f64, Option<f64>)> {
        let (first, last) = (self.points.front()?.reuse?, self.points.back()?.reuse?);
        let prompt = last.prompt - first.prompt;
        let available = last.available - first.available;
        let reused = last.reused - first.reused;
        (prompt > 0.0).then(|| {
            let achieved = (available > 0.0).then(|| (reused / available).clamp(0.0, 1.0));
            ((available / prompt).clamp(0.0, 1.0), achieved)
        })
    }
}

/// The workers' speculative-decoding counters at one moment, summed over the workers
/// (vLLM's `vllm:spec_decode_*` series, which `kvroute engine --spec-decode` exports too).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SpecPoint {
    pub at_s: f64,
    pub drafts: f64,
    pub accepted: f64,
    /// Draft positions the target evaluated: every draft's first, and position j + 1 of the
    /// drafts whose position j was accepted.
    pub evaluated: f64,
}

impl SpecPoint {
    /// `None` when no worker reports speculative decoding.
    pub fn from_samples(at_s: f64, samples: &[Sample]) -> Option<SpecPoint> {
        let drafts = sum(samples, "vllm:spec_decode_num_drafts_total")?;
        let accepted = sum(samples, "vllm:spec_decode_num_accepted_tokens_total")?;
        // Positions 0..K−1 with K the highest position reported: the last position's
        // acceptance evaluates nothing after it.
        let per_pos: Vec<(u32, f64)> = samples
            .iter()
            .filter(|s| s.name == "vllm:spec_decode_num_accepted_tokens_per_pos_total")
            .filter_map(|s| Some((s.label("position")?.parse().ok()?, s.value)))
            .collect();
        let last = per_pos.iter().map(|(p, _)| *p).max().unwrap_or(0);
        let evaluated = drafts
            + per_pos
                .iter()
                .filter(|(p, _)| *p < last)
                .map(|(_, v)| v)
                .sum::<f64>();
        Some(SpecPoint {
            at_s,
            drafts,
            accepted,
            evaluated,
        })
    }
}

/// Two workers' counters together (the left one's time).
impl std::ops::Add for SpecPoint {
    type Output = SpecPoint;

    fn add(self, other: SpecPoint) -> SpecPoint {
        SpecPoint {
            at_s: self.at_s,
            drafts: self.drafts + other.drafts,
            accepted: self.accepted + other.accepted,
            evaluated: self.evaluated + other.evaluated,
        }
    }
}

impl CounterPoint for SpecPoint {
    fn at_s(&self) -> f64 {
        self.at_s
    }

    fn restarted_since(&self, earlier: &Self) -> bool {
        self.drafts < earlier.drafts || self.accepted < earlier.accepted
    }
}

/// Workers' speculative counters over the last window: acceptance and tokens per step are
/// ratios of the increases.
pub type SpecHistory = CounterWindow<SpecPoint>;

impl SpecHistory {
    /// The counters' increase between the oldest and newest point of the window; `None`
    /// without a draft in between.
    fn delta(&self) -> Option<SpecPoint> {
        let (first, last) = (self.points.front()?, self.points.back()?);
        let delta = SpecPoint {
            at_s: last.at_s,
            drafts: last.drafts - first.drafts,
            accepted: last.accepted - first.accepted,
            evaluated: last.evaluated - first.evaluated,
        };
        (delta.drafts > 0.0).then_some(delta)
    }

    /// Per-token acceptance probability α over the window (see [`SpecPoint::acceptance_rate`]).
    pub fn acceptance_rate(&self) -> Option<f64> {
        self.delta()?.acceptance_rate()
    }

    /// Tokens per speculative step over the window (see [`SpecPoint::tokens_per_step`]).
    pub fn tokens_per_step(&self) -> Option<f64> {
        self.delta()?.tokens_per_step()
    }
}

impl SpecPoint {
    /// Read as increases (or rates) of the counters: the per-token acceptance probability α,
    /// accepted / evaluated positions.
    pub fn acceptance_rate(&self) -> Option<f64> {
        (self.drafts > 0.0 && self.evaluated > 0.0)
            .then(|| (self.accepted / self.evaluated).clamp(0.0, 1.0))
    }

    /// Read as increases (or rates): tokens per speculative step, bonus token included,
    /// 1 + accepted / drafts (the Grafana panel's formula).
    pub fn tokens_per_step(&self) -> Option<f64> {
        (self.drafts > 0.0).then(|| 1.0 + self.accepted / self.drafts)
    }
}

/// One GPU of a worker.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct GpuView {
    pub index: u32,
    pub util_pct: Option<f64>,
    pub memory_pct: Option<f64>,
}

/// One worker's card.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct WorkerView {
    pub name: String,
    /// Its role in disaggregated serving (`both`, `prefill`, `decode`) from
    /// `kvroute_engine_role`; `None` when the worker does not say (e.g. vLLM): aggregated.
    pub role: Option<String>,
    pub gpus: Vec<GpuView>,
}

/// The per-worker GPU view of one lane.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct WorkersView {
    pub available: bool,
    pub error: Option<String>,
    pub gpu: Option<String>,
    pub model: Option<String>,
    pub list: Vec<WorkerView>,
    /// The gateway's TTFT and ITL per pool over the dashboard's window (seed 004), for every
    /// pool the gateway exports; empty without gateway metrics.
    pub pools: Vec<PoolLatencyView>,
}

/// One pool's latency as the gateway measured it: `histogram_quantile` of
/// `dynamo_frontend_time_to_first_token_seconds` and `dynamo_frontend_inter_token_latency_seconds`
/// with its `pool` label, over the window (milliseconds; `None` without observations).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PoolLatencyView {
    /// `aggregated`, `prefill` or `decode`: the gateway's label.
    pub pool: String,
    pub ttft_ms: Option<Percentiles>,
    pub itl_ms: Option<Percentiles>,
}

/// The gateway's TTFT histogram, with a `pool` label.
pub const POOL_TTFT_HISTOGRAM: &str = "dynamo_frontend_time_to_first_token_seconds";
/// The gateway's ITL histogram, with a `pool` label.
pub const POOL_ITL_HISTOGRAM: &str = "dynamo_frontend_inter_token_latency_seconds";
/// Pools tracked at most (the gateway has three); a label beyond is ignored.
const MAX_POOLS: usize = 8;

/// One histogram's cumulative `_bucket` counts per pool, summed over its other labels
/// (`sum by (le, pool)`): the finite bounds ascending and the counts, the last `+Inf`.
pub fn pool_buckets(samples: &[Sample], histogram: &str) -> Vec<(String, Vec<f64>, Vec<u64>)> {
    let bucket = format!("{histogram}_bucket");
    let mut pools: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    for s in samples.iter().filter(|s| s.name == bucket) {
        let (Some(pool), Some(le)) = (s.label("pool"), s.label("le")) else {
            continue;
        };
        let le = match le {
            "+Inf" => f64::INFINITY,
            v => match v.parse::<f64>() {
                Ok(v) => v,
                Err(_) => continue,
            },
        };
        let index = match pools.iter().position(|(p, _)| p == pool) {
            Some(i) => i,
            None if pools.len() < MAX_POOLS => {
                pools.push((pool.to_owned(), Vec::new()));
                pools.len() - 1
            }
            None => continue,
        };
        let buckets = &mut pools[index].1;
        match buckets.iter_mut().find(|(bound, _)| *bound == le) {
            Some((_, count)) => *count += s.value,
            None => buckets.push((le, s.value)),
        }
    }
    pools
        .into_iter()
        .filter_map(|(pool, mut buckets)| {
            buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
            // Without its +Inf bucket a histogram has no total: not one to read.
            if buckets.last().is_none_or(|(le, _)| le.is_finite()) {
                return None;
            }
            let bounds = buckets[..buckets.len() - 1]
                .iter()
                .map(|(le, _)| *le)
                .collect();
            let counts = buckets.iter().map(|(_, c)| c.max(0.0) as u64).collect();
            Some((pool, bounds, counts))
        })
        .collect()
}

/// One pool histogram over the window: its bounds (to notice a change) and its snapshots.
#[derive(Debug)]
struct PoolWindow {
    pool: String,
    bounds: Vec<f64>,
    window: HistogramWindow,
    /// Snapshots recorded: one alone has no increase to read.
    snapshots: usize,
}

/// The gateway's per-pool TTFT and ITL histograms scraped over the dashboard's window, read
/// as PromQL's `histogram_quantile(q, sum by (le, pool) (rate(x_bucket[window])))` (the
/// autoscaler's own evaluation, `router::autoscale`).
#[derive(Debug)]
pub struct PoolLatency {
    span: Nanos,
    ttft: Vec<PoolWindow>,
    itl: Vec<PoolWindow>,
}

impl PoolLatency {
    pub fn new(span_s: f64) -> PoolLatency {
        PoolLatency {
            span: Nanos::from_secs_f64(span_s.max(0.0)),
            ttft: Vec::new(),
            itl: Vec::new(),
        }
    }

    pub fn clear(&mut self) {
        self.ttft.clear();
        self.itl.clear();
    }

    /// Records one scrape of the gateway taken at `at_s` on the lane clock.
    pub fn record(&mut self, at_s: f64, samples: &[Sample]) {
        let now = Nanos::from_secs_f64(at_s.max(0.0));
        for (windows, histogram) in [
            (&mut self.ttft, POOL_TTFT_HISTOGRAM),
            (&mut self.itl, POOL_ITL_HISTOGRAM),
        ] {
            for (pool, bounds, counts) in pool_buckets(samples, histogram) {
                let span = self.span;
                let fresh = || PoolWindow {
                    pool: pool.clone(),
                    bounds: bounds.clone(),
                    window: HistogramWindow::new(&bounds, span),
                    snapshots: 0,
                };
                let entry = match windows.iter().position(|w| w.pool == pool) {
                    // New buckets (a reconfigured gateway) cannot be compared with the old.
                    Some(i) if windows[i].bounds != bounds => {
                        windows[i] = fresh();
                        &mut windows[i]
                    }
                    Some(i) => &mut windows[i],
                    None if windows.len() < MAX_POOLS => {
                        windows.push(fresh());
                        windows.last_mut().expect("just pushed")
                    }
                    None => continue,
                };
                entry.window.record(now, counts);
                entry.snapshots = entry.snapshots.saturating_add(1);
            }
        }
    }

    /// Every pool seen, in the gateway's order: p50 and p95 over the window in milliseconds
    /// on the lane clock. The gateway measures wall seconds; against a simulator sped up
    /// `time_scale` times they are that many model seconds, as the client's figures are.
    pub fn view(&self, time_scale: f64) -> Vec<PoolLatencyView> {
        let to_ms = 1e3 * time_scale;
        let quantiles = |w: Option<&PoolWindow>| {
            let w = w.filter(|w| w.snapshots >= 2)?;
            let q = Percentiles {
                p50: w.window.quantile(0.5).map(|s| s * to_ms),
                p95: w.window.quantile(0.95).map(|s| s * to_ms),
            };
            (q.p50.is_some() || q.p95.is_some()).then_some(q)
        };
        let mut pools: Vec<&str> = self.ttft.iter().map(|w| w.pool.as_str()).collect();
        for w in &self.itl {
            if !pools.contains(&w.pool.as_str()) {
                pools.push(&w.pool);
            }
        }
        pools
            .into_iter()
            .map(|pool| PoolLatencyView {
                pool: pool.to_owned(),
                ttft_ms: quantiles(self.ttft.iter().find(|w| w.pool == pool)),
                itl_ms: quantiles(self.itl.iter().find(|w| w.pool == pool)),
            })
            .collect()
    }
}

/// Reads a worker's DCGM-style series (`DCGM_FI_DEV_GPU_UTIL`, `DCGM_FI_DEV_FB_USED`,
/// `DCGM_FI_DEV_FB_FREE`, labels `gpu`, `Hostname`, `modelName`), vLLM's `model_name` and
/// kvroute's `kvroute_engine_role`.
pub fn worker_view(
    fallback_name: &str,
    samples: &[Sample],
) -> (WorkerView, Option<String>, Option<String>) {
    let mut gpus: Vec<GpuView> = Vec::new();
    let mut name = None;
    let mut gpu_model = None;
    let mut used = Vec::new();
    let mut free = Vec::new();
    for s in samples {
        let index = s.label("gpu").and_then(|g| g.parse().ok()).unwrap_or(0);
        match s.name.as_str() {
            "DCGM_FI_DEV_GPU_UTIL" => {
                name = name.or_else(|| s.label("Hostname").map(str::to_owned));
                gpu_model = gpu_model.or_else(|| s.label("modelName").map(str::to_owned));
                gpu_entry(&mut gpus, index).util_pct = Some(s.value);
            }
            "DCGM_FI_DEV_FB_USED" => used.push((index, s.value)),
            "DCGM_FI_DEV_FB_FREE" => free.push((index, s.value)),
            _ => {}
        }
    }
    for (index, used) in used {
        let entry = gpu_entry(&mut gpus, index);
        if let Some((_, free)) = free.iter().find(|(i, _)| *i == index) {
            let total = used + free;
            if total > 0.0 {
                entry.memory_pct = Some(100.0 * used / total);
            }
        }
    }
    gpus.sort_by_key(|g| g.index);
    let model = samples
        .iter()
        .find_map(|s| s.label("model_name").map(str::to_owned));
    let role = samples
        .iter()
        .filter(|s| s.name == "kvroute_engine_role" && s.value > 0.0)
        .find_map(|s| s.label("role").map(str::to_owned));
    (
        WorkerView {
            name: name.unwrap_or_else(|| fallback_name.to_owned()),
            role,
            gpus,
        },
        gpu_model,
        model,
    )
}

fn gpu_entry(gpus: &mut Vec<GpuView>, index: u32) -> &mut GpuView {
    let position = match gpus.iter().position(|g| g.index == index) {
        Some(p) => p,
        None => {
            gpus.push(GpuView {
                index,
                util_pct: None,
                memory_pct: None,
            });
            gpus.len() - 1
        }
    };
    &mut gpus[position]
}

/// GETs `url` with a timeout; a transport failure becomes its chain of error messages.
pub async fn get(
    client: &reqwest::Client,
    url: impl reqwest::IntoUrl,
    timeout: Duration,
) -> Result<reqwest::Response, String> {
    let request = client.get(url).timeout(timeout);
    request
        .send()
        .await
        .map_err(|e| crate::client::error_chain(&e))
}

/// GETs `url` as text, with a timeout and a bound on the body.
pub async fn fetch_text(
    client: &reqwest::Client,
    url: &str,
    timeout: Duration,
) -> Result<String, String> {
    const MAX_BODY: usize = 8 << 20;
    let response = get(client, url, timeout).await?;
    if !response.status().is_success() {
        return Err(format!("{url}: HTTP {}", response.status()));
    }
    let body = response
        .bytes()
        .await
        .map_err(|e| crate::client::error_chain(&e))?;
    if body.len() > MAX_BODY {
        return Err(format!("{url}: body over {MAX_BODY} bytes"));
    }
    Ok(String::from_utf8_lossy(&body).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_labels_escapes_and_special_values() {
        let text = "# HELP x y\n\
                    dynamo_frontend_cached_tokens_sum{model=\"a \\\"b\\\"\",x=\"1,2\"} 64.0\n\
                    dynamo_frontend_cached_tokens_sum{model=\"c\"} 36\n\
                    plain 3 1700000000\n\
                    inf_metric +Inf\n\
                    broken{x=\"1\" 2\n";
        let samples = parse_text(text);
        assert_eq!(samples.len(), 4);
        assert_eq!(samples[0].label("model"), Some("a \"b\""));
        assert_eq!(samples[0].label("x"), Some("1,2"));
        assert_eq!(
            sum(&samples, "dynamo_frontend_cached_tokens_sum"),
            Some(100.0)
        );
        assert_eq!(sum(&samples, "plain"), Some(3.0));
        assert_eq!(sum(&samples, "absent"), None);
        assert!(samples[3].value.is_infinite());
    }

    fn point(at_s: f64, cached: f64, input: f64) -> GatewayPoint {
        GatewayPoint {
            at_s,
            cached_tokens: cached,
            input_tokens: input,
            queued: Some(2.0),
            reuse: None,
        }
    }

    #[test]
    fn reuse_available_and_achieved_come_from_the_gateways_attribution() {
        let scrape = |at_s, prompt, available, reused| {
            let text = format!(
                "dynamo_frontend_cached_tokens_sum{{model=\"m\"}} 0\n\
                 dynamo_frontend_input_sequence_tokens_sum{{model=\"m\"}} 0\n\
                 kvroute_gateway_reuse_tokens_total{{kind=\"prompt\"}} {prompt}\n\
                 kvroute_gateway_reuse_tokens_total{{kind=\"available\"}} {available}\n\
                 kvroute_gateway_reuse_tokens_total{{kind=\"predicted\"}} 0\n\
                 kvroute_gateway_reuse_tokens_total{{kind=\"reused\"}} {reused}\n"
            );
            GatewayPoint::from_samples(at_s, &parse_text(&text)).expect("a gateway point")
        };
        let mut h = GatewayHistory::new(Duration::from_secs(60), 100);
        h.push(scrape(0.0, 1_000.0, 500.0, 400.0));
        assert_eq!(h.reuse(), None, "one point: no window");
        h.push(scrape(10.0, 3_000.0, 2_100.0, 1_600.0));
        // 2,000 prompt tokens: 1,600 available, 1,200 of them reused.
        assert_eq!(h.reuse(), Some((0.8, Some(0.75))));

        // A gateway without kvroute's counters still gives its hit rate, and no reuse.
        let plain = GatewayPoint::from_samples(
            0.0,
            &parse_text(
                "dynamo_frontend_cached_tokens_sum 1\n\
                 dynamo_frontend_input_sequence_tokens_sum 2\n",
            ),
        )
        .expect("a gateway point");
        assert_eq!(plain.reuse, None);
    }

    #[test]
    fn hit_rate_is_the_ratio_of_increases_over_the_window() {
        let mut h = GatewayHistory::new(Duration::from_secs(60), 100);
        assert_eq!(h.hit_rate(), None);
        h.push(point(0.0, 0.0, 0.0));
        assert_eq!(h.hit_rate(), None);
        h.push(point(10.0, 900.0, 1_000.0));
        assert_eq!(h.hit_rate(), Some(0.9));
        // At 100 s the window starts at 40 s: its base is the last scrape at or before that
        // (10 s); the one at 0 s goes.
        h.push(point(70.0, 1_000.0, 2_000.0));
        h.push(point(100.0, 1_500.0, 2_500.0));
        assert_eq!(h.hit_rate(), Some(600.0 / 1_500.0));
        // Scrapes further apart than the window still give the rate between the last two.
        h.push(point(500.0, 1_600.0, 2_700.0));
        assert_eq!(h.hit_rate(), Some(0.5));
        assert_eq!(h.queued(), Some(2.0));
        // A restarted gateway (counters back to zero) starts over.
        h.push(point(101.0, 5.0, 10.0));
        assert_eq!(h.hit_rate(), None);
    }

    #[test]
    fn speculative_counters_give_acceptance_and_tokens_per_step() {
        let text = |drafts: u32, accepted: u32, pos: [u32; 3]| {
            format!(
                "vllm:spec_decode_num_drafts_total{{model_name=\"m\"}} {drafts}\n\
                 vllm:spec_decode_num_accepted_tokens_total{{model_name=\"m\"}} {accepted}\n\
                 vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name=\"m\",position=\"0\"}} {}\n\
                 vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name=\"m\",position=\"1\"}} {}\n\
                 vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name=\"m\",position=\"2\"}} {}\n",
                pos[0], pos[1], pos[2]
            )
        };
        assert_eq!(SpecPoint::from_samples(0.0, &parse_text("x 1\n")), None);
        let mut h = SpecHistory::new(Duration::from_secs(60), 100);
        h.push(SpecPoint::from_samples(0.0, &parse_text(&text(0, 0, [0, 0, 0]))).unwrap());
        assert_eq!(h.acceptance_rate(), None);
        // 100 drafts of K = 3: 80 accepted position 0, 60 position 1, 40 position 2.
        let p = SpecPoint::from_samples(10.0, &parse_text(&text(100, 180, [80, 60, 40]))).unwrap();
        assert_eq!(p.evaluated, 240.0);
        h.push(p);
        assert_eq!(h.acceptance_rate(), Some(0.75));
        assert_eq!(h.tokens_per_step(), Some(2.8));
        // Two workers add up.
        assert_eq!((p + p).drafts, 200.0);
    }

    /// A gateway scrape: TTFT buckets (0.1, 0.5, +Inf) per pool, two models each.
    fn gateway_text(prefill: [u64; 3], decode: [u64; 3]) -> String {
        let mut text = String::new();
        for model in ["m1", "m2"] {
            for (pool, counts) in [("prefill", prefill), ("decode", decode)] {
                for (le, count) in ["0.1", "0.5", "+Inf"].iter().zip(counts) {
                    text.push_str(&format!(
                        "dynamo_frontend_time_to_first_token_seconds_bucket{{model=\"{model}\",le=\"{le}\",pool=\"{pool}\"}} {count}\n"
                    ));
                }
            }
        }
        text
    }

    #[test]
    fn pool_buckets_sum_by_le_and_pool() {
        let samples = parse_text(&gateway_text([1, 2, 3], [0, 0, 5]));
        let pools = pool_buckets(&samples, POOL_TTFT_HISTOGRAM);
        assert_eq!(
            pools,
            vec![
                ("prefill".to_owned(), vec![0.1, 0.5], vec![2, 4, 6]),
                ("decode".to_owned(), vec![0.1, 0.5], vec![0, 0, 10]),
            ]
        );
        assert!(pool_buckets(&samples, POOL_ITL_HISTOGRAM).is_empty());
    }

    #[test]
    fn pool_latency_is_the_windowed_quantile_per_pool() {
        let mut pools = PoolLatency::new(60.0);
        pools.record(0.0, &parse_text(&gateway_text([0, 0, 0], [0, 0, 0])));
        // One snapshot has no increase yet.
        let view = pools.view(1.0);
        assert_eq!(view.len(), 2);
        assert!(
            view.iter()
                .all(|p| p.ttft_ms.is_none() && p.itl_ms.is_none())
        );
        // 10 s later: prefill saw 2 + 2 TTFTs under 0.1 s and 2 + 2 in (0.1, 0.5]; decode none.
        pools.record(10.0, &parse_text(&gateway_text([2, 4, 4], [0, 0, 0])));
        // A simulator 10 times faster than real time: wall seconds are 10 model seconds.
        let sped_up = pools.view(10.0)[0].ttft_ms.unwrap();
        assert!((sped_up.p50.unwrap() - 1_000.0).abs() < 1e-9, "{sped_up:?}");
        let view = pools.view(1.0);
        let prefill = &view[0];
        assert_eq!(prefill.pool, "prefill");
        let ttft = prefill.ttft_ms.unwrap();
        // Rank 4 of 8 is the top of the first bucket: 100 ms; rank 7.6 is 90% into the second.
        assert!((ttft.p50.unwrap() - 100.0).abs() < 1e-9, "{ttft:?}");
        assert!(
            (ttft.p95.unwrap() - (100.0 + 400.0 * 0.9)).abs() < 1e-9,
            "{ttft:?}"
        );
        assert_eq!(prefill.itl_ms, None);
        assert_eq!(view[1].ttft_ms, None, "no decode TTFT in the window");
        // The window moves on: what happened before 70 s - 60 s is out of it.
        pools.record(70.0, &parse_text(&gateway_text([2, 4, 4], [0, 0, 2])));
        let view = pools.view(1.0);
        assert_eq!(view[0].ttft_ms, None, "{view:?}");
        // In +Inf: the highest finite bound, as Prometheus answers.
        assert_eq!(view[1].ttft_ms.unwrap().p95, Some(500.0));
        pools.clear();
        assert!(pools.view(1.0).is_empty());
    }

    #[test]
    fn worker_view_reads_the_role() {
        let text = "DCGM_FI_DEV_GPU_UTIL{gpu=\"0\",Hostname=\"worker-0\"} 10\n\
                    kvroute_engine_role{role=\"prefill\",kv_role=\"kv_producer\"} 1\n";
        let (view, _, _) = worker_view("w0", &parse_text(text));
        assert_eq!(view.role.as_deref(), Some("prefill"));
        let (view, _, _) = worker_view("w0", &parse_text("DCGM_FI_DEV_GPU_UTIL{gpu=\"0\"} 1\n"));
        assert_eq!(view.role, None);
    }

    #[test]
    fn worker_view_reads_dcgm_series() {
        let text = "DCGM_FI_DEV_GPU_UTIL{gpu=\"0\",Hostname=\"worker-1\",modelName=\"NVIDIA H200\"} 63.5\n\
                    DCGM_FI_DEV_FB_USED{gpu=\"0\",Hostname=\"worker-1\",modelName=\"NVIDIA H200\"} 100000\n\
                    DCGM_FI_DEV_FB_FREE{gpu=\"0\",Hostname=\"worker-1\",modelName=\"NVIDIA H200\"} 43771\n\
                    vllm:num_requests_running{model_name=\"llama\"} 3\n";
        let (view, gpu, model) = worker_view("w0", &parse_text(text));
        assert_eq!(view.name, "worker-1");
        assert_eq!(gpu.as_deref(), Some("NVIDIA H200"));
        assert_eq!(model.as_deref(), Some("llama"));
        assert_eq!(view.gpus.len(), 1);
        assert_eq!(view.gpus[0].util_pct, Some(63.5));
        let mem = view.gpus[0].memory_pct.unwrap();
        assert!((mem - 100.0 * 100_000.0 / 143_771.0).abs() < 1e-9);
    }
}
