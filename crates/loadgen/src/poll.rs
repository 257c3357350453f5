//! The per-lane scraper: every [`SCRAPE_INTERVAL`] it reads the gateway's and the workers'
//! `/metrics` into the lane's state.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use report::Percentiles;
use tokio_util::sync::CancellationToken;

use crate::lane::{LaneSpec, LaneState, PrometheusFigures, lock};
use crate::scrape::{self, GatewayPoint, PoolLatency, SpecPoint, WorkersView};

pub const SCRAPE_INTERVAL: Duration = Duration::from_secs(2);
const SCRAPE_TIMEOUT: Duration = Duration::from_secs(2);

pub async fn scrape_loop(
    spec: Arc<LaneSpec>,
    state: Arc<Mutex<LaneState>>,
    http: reqwest::Client,
    shutdown: CancellationToken,
) {
    let mut ticker = tokio::time::interval(SCRAPE_INTERVAL);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The pools' latency over the same window as the hit rate; started again with every run
    // (the lane clock restarts), kept after Stop like the window's percentiles.
    let mut pools = PoolLatency::new(lock(&state).gateway.span_s());
    let mut run_started_ms = None;
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = ticker.tick() => {}
        }
        if let Some(prometheus) = &spec.prometheus {
            let time_scale = lock(&state).time_scale;
            let (figures, workers, error) = query_prometheus(&http, prometheus, time_scale).await;
            let mut s = lock(&state);
            s.prometheus_figures = Some(figures);
            s.gateway_error = error;
            s.workers = workers;
            continue;
        }
        let gateway = match &spec.gateway_metrics {
            Some(url) => Some(scrape::fetch_text(&http, url, SCRAPE_TIMEOUT).await),
            None => None,
        };
        let endpoints = lock(&state).worker_metrics.clone().unwrap_or_else(|| {
            spec.worker_metrics
                .iter()
                .enumerate()
                .map(|(i, url)| (format!("worker-{i}"), url.clone()))
                .collect()
        });
        let (workers, spec_counters) = scrape_workers(&endpoints, &http).await;
        let mut s = lock(&state);
        let now_s = s.now_s();
        if let (true, Some(mut point)) = (s.running, spec_counters) {
            point.at_s = now_s;
            s.spec.push(point);
        }
        let started_ms = s.started.map(|(_, ms)| ms);
        if started_ms != run_started_ms {
            run_started_ms = started_ms;
            pools.clear();
        }
        let gateway_samples = match &gateway {
            Some(Ok(text)) => scrape::parse_text(text),
            _ => Vec::new(),
        };
        if s.running {
            pools.record(now_s, &gateway_samples);
        }
        match gateway {
            Some(Ok(_)) => match GatewayPoint::from_samples(now_s, &gateway_samples) {
                Some(point) if s.running => {
                    s.gateway.push(point);
                    s.gateway_error = None;
                }
                Some(_) => s.gateway_error = None,
                None => {
                    s.gateway_error =
                        Some("the gateway's metrics have no dynamo_frontend_cached_tokens".into())
                }
            },
            Some(Err(err)) => s.gateway_error = Some(err),
            None => s.gateway_error = Some("no gateway metrics URL configured".into()),
        }
        s.workers = WorkersView {
            pools: pools.view(s.time_scale),
            ..workers
        };
    }
}

/// The workers' GPU view, and their speculative-decoding counters summed (when every worker
/// answered and reports them: a partial sum would look like a counter reset).
async fn scrape_workers(
    endpoints: &[(String, String)],
    http: &reqwest::Client,
) -> (WorkersView, Option<SpecPoint>) {
    if endpoints.is_empty() {
        let view = WorkersView {
            available: false,
            error: Some("no worker metrics endpoints configured (--worker-metrics)".into()),
            ..WorkersView::default()
        };
        return (view, None);
    }
    let fetches = endpoints
        .iter()
        .map(|(_, url)| scrape::fetch_text(http, url, SCRAPE_TIMEOUT));
    let bodies = futures::future::join_all(fetches).await;
    let mut view = WorkersView {
        available: true,
        ..WorkersView::default()
    };
    let mut errors = Vec::new();
    let mut counters: Option<Option<SpecPoint>> = None;
    for (i, body) in bodies.into_iter().enumerate() {
        match body {
            Ok(text) => {
                let samples = scrape::parse_text(&text);
                let (worker, gpu, model) = scrape::worker_view(&endpoints[i].0, &samples);
                view.gpu = view.gpu.or(gpu);
                view.model = view.model.or(model);
                view.list.push(worker);
                let point = SpecPoint::from_samples(0.0, &samples);
                counters = Some(match counters {
                    None => point,
                    Some(sum) => sum.zip(point).map(|(a, b)| a + b),
                });
            }
            Err(err) => errors.push(err),
        }
    }
    if !errors.is_empty() {
        view.available = !view.list.is_empty();
        view.error = Some(errors.join("; "));
        counters = None;
    }
    (view, counters.flatten())
}

/// Seed 001's queries: the KV hit rate as its Grafana panel computes it, the frontend queue.
pub const HIT_RATE_QUERY: &str = "sum(rate(dynamo_frontend_cached_tokens_sum[1m])) / \
     sum(rate(dynamo_frontend_input_sequence_tokens_sum[1m]))";
pub const QUEUED_QUERY: &str = "sum(dynamo_frontend_queued_requests)";
/// Speculative decoding from the workers' vLLM counters over the same 1-minute window, summed
/// over the workers as deploy/grafana/kvroute-demo.json's panels do: tokens per step is the
/// panel's `1 + accepted / drafts`; the acceptance α is accepted / evaluated positions, as in
/// scrape mode (`SpecPoint`), which needs the per-position counts.
pub const SPEC_ACCEPTED_QUERY: &str = "sum(rate(vllm:spec_decode_num_accepted_tokens_total[1m]))";
pub const SPEC_DRAFTS_QUERY: &str = "sum(rate(vllm:spec_decode_num_drafts_total[1m]))";
pub const SPEC_PER_POSITION_QUERY: &str =
    "sum by (position) (rate(vllm:spec_decode_num_accepted_tokens_per_pos_total[1m]))";
const GPU_SERIES: [&str; 3] = [
    "DCGM_FI_DEV_GPU_UTIL",
    "DCGM_FI_DEV_FB_USED",
    "DCGM_FI_DEV_FB_FREE",
];
/// The engines' role (disaggregated serving), matched to their GPU series by `instance`.
const ROLE_SERIES: &str = "kvroute_engine_role";

/// Seed 004's per-pool latency query: quantile `q` of the gateway's `histogram` by pool, over
/// the same 1-minute rate window as the hit rate.
pub fn pool_quantile_query(q: f64, histogram: &str) -> String {
    format!("histogram_quantile({q}, sum by (le, pool) (rate({histogram}_bucket[1m])))")
}

/// Each pool's TTFT and ITL p50 and p95 from Prometheus, in milliseconds on the lane clock
/// (the gateway measures wall seconds: × `time_scale`, as `PoolLatency::view`). A failed
/// query leaves its figures out.
async fn query_pools(
    http: &reqwest::Client,
    base: &str,
    time_scale: f64,
) -> Vec<scrape::PoolLatencyView> {
    let mut pools: Vec<scrape::PoolLatencyView> = Vec::new();
    for histogram in [scrape::POOL_TTFT_HISTOGRAM, scrape::POOL_ITL_HISTOGRAM] {
        for q in [0.5, 0.95] {
            let Ok(samples) = instant_query(http, base, &pool_quantile_query(q, histogram)).await
            else {
                continue;
            };
            for sample in samples {
                let Some(name) = sample.label("pool") else {
                    continue;
                };
                let value = Some(sample.value * 1e3 * time_scale).filter(|v| v.is_finite());
                let index = match pools.iter().position(|p| p.pool == name) {
                    Some(i) => i,
                    None => {
                        pools.push(scrape::PoolLatencyView {
                            pool: name.to_owned(),
                            ttft_ms: None,
                            itl_ms: None,
                        });
                        pools.len() - 1
                    }
                };
                let pool = &mut pools[index];
                let figures = if histogram == scrape::POOL_TTFT_HISTOGRAM {
                    &mut pool.ttft_ms
                } else {
                    &mut pool.itl_ms
                };
                let figures = figures.get_or_insert(Percentiles {
                    p50: None,
                    p95: None,
                });
                if q == 0.5 {
                    figures.p50 = value;
                } else {
                    figures.p95 = value;
                }
            }
        }
    }
    // No observation in the window is NaN in PromQL: no figures rather than empty ones.
    for pool in &mut pools {
        for figures in [&mut pool.ttft_ms, &mut pool.itl_ms] {
            if figures.is_some_and(|f| f.p50.is_none() && f.p95.is_none()) {
                *figures = None;
            }
        }
    }
    pools.sort_by(|a, b| a.pool.cmp(&b.pool));
    pools
}

/// One instant query: the result vector as samples (`__name__` becomes the name).
async fn instant_query(
    http: &reqwest::Client,
    base: &str,
    query: &str,
) -> Result<Vec<scrape::Sample>, String> {
    let url = format!("{}/api/v1/query", base.trim_end_matches('/'));
    let with_query = reqwest::Url::parse_with_params(&url, &[("query", query)])
        .map_err(|e| format!("{url}: {e}"))?;
    let response = scrape::get(http, with_query, SCRAPE_TIMEOUT).await?;
    let status = response.status();
    let body: serde_json::Value = response
        .json()
        .await
        .map_err(|e| format!("{url}: not a Prometheus answer: {e}"))?;
    if !status.is_success() || body["status"] != "success" {
        return Err(format!(
            "{url}: {}",
            body["error"].as_str().unwrap_or(status.as_str())
        ));
    }
    let result = body["data"]["result"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    Ok(result
        .iter()
        .filter_map(|series| {
            let labels: Vec<(String, String)> = series["metric"]
                .as_object()?
                .iter()
                .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_owned())))
                .collect();
            let value: f64 = series["value"].get(1)?.as_str()?.parse().ok()?;
            let name = labels
                .iter()
                .find(|(k, _)| k == "__name__")
                .map(|(_, v)| v.clone())
                .unwrap_or_default();
            Some(scrape::Sample {
                name,
                labels,
                value,
            })
        })
        .collect())
}

/// Acceptance and tokens per step from Prometheus's rates of the workers' counters: the rates
/// are fed to [`SpecPoint`] as if they were counter increases (its ratios are the same). No
/// speculative series (decoding is plain) or no draft in the window: `None`.
async fn query_spec(http: &reqwest::Client, base: &str) -> Result<Option<SpecPoint>, String> {
    let accepted = instant_query(http, base, SPEC_ACCEPTED_QUERY).await?;
    let drafts = instant_query(http, base, SPEC_DRAFTS_QUERY).await?;
    let per_position = instant_query(http, base, SPEC_PER_POSITION_QUERY).await?;
    let (Some(accepted), Some(drafts)) = (accepted.first(), drafts.first()) else {
        return Ok(None);
    };
    let named = |name: &str, sample: &scrape::Sample| scrape::Sample {
        name: name.to_owned(),
        ..sample.clone()
    };
    let mut samples = vec![
        named("vllm:spec_decode_num_accepted_tokens_total", accepted),
        named("vllm:spec_decode_num_drafts_total", drafts),
    ];
    samples.extend(
        per_position
            .iter()
            .map(|s| named("vllm:spec_decode_num_accepted_tokens_per_pos_total", s)),
    );
    // A NaN rate (no sample in the window) reads as no figure.
    Ok(SpecPoint::from_samples(0.0, &samples)
        .filter(|p| p.drafts.is_finite() && p.accepted.is_finite() && p.evaluated.is_finite()))
}

/// The hit rate, the queue and the GPU view from a Prometheus server; any failure makes the
/// GPU view "unavailable" with the reason, as the seed's dashboard shows it.
async fn query_prometheus(
    http: &reqwest::Client,
    base: &str,
    time_scale: f64,
) -> (PrometheusFigures, WorkersView, Option<String>) {
    let scalar = |samples: Result<Vec<scrape::Sample>, String>| {
        samples.map(|s| s.first().map(|s| s.value).filter(|v| v.is_finite()))
    };
    let hit_rate = scalar(instant_query(http, base, HIT_RATE_QUERY).await);
    let queued = scalar(instant_query(http, base, QUEUED_QUERY).await);
    let spec = query_spec(http, base).await;
    let mut gpu_samples = Vec::new();
    let mut error = None;
    for series in GPU_SERIES {
        match instant_query(http, base, series).await {
            Ok(samples) => gpu_samples.extend(samples),
            Err(err) => error = Some(err),
        }
    }
    let roles = instant_query(http, base, ROLE_SERIES).await;
    if let Err(err) = &roles {
        error = Some(err.clone());
    }
    let figure_error = [&hit_rate, &queued]
        .iter()
        .find_map(|r| r.as_ref().err().cloned())
        .or_else(|| spec.as_ref().err().cloned());
    let spec = spec.ok().flatten();
    let figures = PrometheusFigures {
        hit_rate: hit_rate.ok().flatten().map(|h| h.clamp(0.0, 1.0)),
        queued: queued.ok().flatten(),
        acceptance_rate: spec.and_then(|p| p.acceptance_rate()),
        tokens_per_step: spec.and_then(|p| p.tokens_per_step()),
    };
    if let Some(err) = error.or(figure_error.clone()) {
        let view = WorkersView {
            available: false,
            error: Some(format!("Prometheus unavailable: {err}")),
            ..WorkersView::default()
        };
        return (
            figures,
            view,
            figure_error.map(|e| format!("Prometheus: {e}")),
        );
    }
    // One card per worker: series grouped by the DCGM exporter's host (else the target).
    let mut hosts: Vec<String> = gpu_samples
        .iter()
        .map(|s| {
            s.label("Hostname")
                .or(s.label("instance"))
                .unwrap_or("worker")
                .to_owned()
        })
        .collect();
    hosts.sort();
    hosts.dedup();
    let mut view = WorkersView {
        available: true,
        pools: query_pools(http, base, time_scale).await,
        ..WorkersView::default()
    };
    // A role series names no host: its scrape target (`instance`) is the GPU series' one.
    let role_samples: Vec<scrape::Sample> = roles
        .unwrap_or_default()
        .into_iter()
        .filter_map(|role| {
            let instance = role.label("instance")?;
            let host = gpu_samples
                .iter()
                .find(|s| s.label("instance") == Some(instance))?
                .label("Hostname")
                .unwrap_or(instance)
                .to_owned();
            Some(scrape::Sample {
                labels: vec![
                    ("Hostname".to_owned(), host),
                    ("role".to_owned(), role.label("role")?.to_owned()),
                ],
                ..role
            })
        })
        .collect();
    for host in hosts {
        let samples: Vec<scrape::Sample> = gpu_samples
            .iter()
            .chain(&role_samples)
            .filter(|s| {
                s.label("Hostname")
                    .or(s.label("instance"))
                    .unwrap_or("worker")
                    == host
            })
            .cloned()
            .collect();
        let (worker, gpu, model) = scrape::worker_view(&host, &samples);
        view.gpu = view.gpu.or(gpu);
        view.model = view.model.or(model);
        view.list.push(worker);
    }
    (figures, view, None)
}
