//! The dashboard of a load generator that requires its API token (`--api-token`), in headless
//! Chromium (as `tests/ui.rs`): opened as `/?token=TOKEN` it sends the token with its API
//! calls and its WebSocket, so its live data flows and Start/Stop work; opened without the
//! token, or with a wrong one, it says what is wrong and how to open it.

use std::time::Duration;

use loadgen::Loadgen;
use serde_json::Value;

mod common;

use common::browser::{ChromeDriver, click, disabled, not_hidden, text};
use common::{Cluster, loadgen_config, wait_until};

const SPEEDUP: f64 = 50.0;
/// Characters a query string must encode, so the page's decoding is exercised.
const TOKEN: &str = "s3cret+/=&x";
const TOKEN_IN_QUERY: &str = "s3cret%2B%2F%3D%26x";

/// `/api/status` with the token.
async fn status(url: &str) -> Value {
    reqwest::Client::new()
        .get(format!("{url}/api/status"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .expect("GET /api/status")
        .json()
        .await
        .expect("JSON")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_opened_with_its_token_runs_and_without_it_says_what_to_do() {
    let cluster = Cluster::start(0..2, SPEEDUP, "worker-").await;
    let lane = cluster.lane("kv_load", Some("kv_load"));
    let mut config = loadgen_config(vec![lane], 20, SPEEDUP);
    config.api_token = Some(TOKEN.to_owned());
    let loadgen = Loadgen::bind(config).await.unwrap();
    let url = loadgen.url();
    let driver = ChromeDriver::start();
    let browser = driver.browser().await;

    // Without the token: a clear message, nothing connected, no control enabled.
    browser.goto(&format!("{url}/")).await.unwrap();
    wait_until("the token message", Duration::from_secs(10), async || {
        not_hidden(&browser, "auth-banner").await
    })
    .await;
    let message = text(&browser, "auth-banner").await;
    assert!(
        message.contains("needs its API token") && message.contains("?token=TOKEN"),
        "{message}"
    );
    assert!(message.contains("--api-token"), "{message}");
    assert_eq!(text(&browser, "ws-state").await, "disconnected");
    assert!(disabled(&browser, "start").await && disabled(&browser, "stop").await);

    // A wrong token: the message says the token was refused.
    browser.goto(&format!("{url}/?token=wrong")).await.unwrap();
    wait_until(
        "the refused-token message",
        Duration::from_secs(10),
        async || {
            not_hidden(&browser, "auth-banner").await
                && text(&browser, "auth-banner")
                    .await
                    .contains("refused the token")
        },
    )
    .await;
    assert!(disabled(&browser, "start").await);

    // With the token: the WebSocket connects, no message, Start works and data flows.
    browser
        .goto(&format!("{url}/?token={TOKEN_IN_QUERY}"))
        .await
        .unwrap();
    wait_until("the WebSocket", Duration::from_secs(10), async || {
        text(&browser, "ws-state").await == "connected"
    })
    .await;
    assert!(!not_hidden(&browser, "auth-banner").await);
    assert!(!disabled(&browser, "start").await);
    assert!(disabled(&browser, "stop").await);
    click(&browser, "start").await;
    wait_until("running", Duration::from_secs(10), async || {
        disabled(&browser, "start").await && !disabled(&browser, "stop").await
    })
    .await;
    assert_eq!(status(&url).await["running"], true);
    wait_until(
        "live numbers over the WebSocket",
        Duration::from_secs(90),
        async || {
            text(&browser, "kpi-requests")
                .await
                .parse::<u64>()
                .unwrap_or(0)
                >= 10
                && text(&browser, "kpi-tops").await != "—"
        },
    )
    .await;
    assert_eq!(text(&browser, "kpi-errors").await, "0");

    click(&browser, "stop").await;
    wait_until("stopped", Duration::from_secs(10), async || {
        !disabled(&browser, "start").await && disabled(&browser, "stop").await
    })
    .await;
    assert_eq!(status(&url).await["running"], false);
    browser.close().await.unwrap();
}
