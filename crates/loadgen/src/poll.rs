//! The per-lane scraper: every [`SCRAPE_INTERVAL`] it reads the gateway's and the workers'
//! `/metrics` into the lane's state.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::lane::{LaneSpec, LaneState, lock};
use crate::scrape::{self, GatewayPoint, WorkersView};

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
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = ticker.tick() => {}
        }
        let gateway = match &spec.gateway_metrics {
            Some(url) => Some(scrape::fetch_text(&http, url, SCRAPE_TIMEOUT).await),
            None => None,
        };
        let workers = scrape_workers(&spec, &http).await;
        let mut s = lock(&state);
        let now_s = s.now_s();
        match gateway {
            Some(Ok(text)) => match GatewayPoint::from_samples(now_s, &scrape::parse_text(&text)) {
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
        s.workers = workers;
    }
}

async fn scrape_workers(spec: &LaneSpec, http: &reqwest::Client) -> WorkersView {
    if spec.worker_metrics.is_empty() {
        return WorkersView {
            available: false,
            error: Some("no worker metrics endpoints configured (--worker-metrics)".into()),
            ..WorkersView::default()
        };
    }
    let fetches = spec
        .worker_metrics
        .iter()
        .map(|url| scrape::fetch_text(http, url, SCRAPE_TIMEOUT));
    let bodies = futures::future::join_all(fetches).await;
    let mut view = WorkersView {
        available: true,
        ..WorkersView::default()
    };
    let mut errors = Vec::new();
    for (i, body) in bodies.into_iter().enumerate() {
        match body {
            Ok(text) => {
                let (worker, gpu, model) =
                    scrape::worker_view(&format!("worker-{i}"), &scrape::parse_text(&text));
                view.gpu = view.gpu.or(gpu);
                view.model = view.model.or(model);
                view.list.push(worker);
            }
            Err(err) => errors.push(err),
        }
    }
    if !errors.is_empty() {
        view.available = !view.list.is_empty();
        view.error = Some(errors.join("; "));
    }
    view
}
