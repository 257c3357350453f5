//! A trace replayed under the dashboard (`kvroute loadgen --trace`), in headless Chromium (as
//! `tests/ui.rs`): the Trace panel shows the file, the progress while it runs, the server's hit
//! rate against the oracle bound over the same finished requests (never above it, whenever the
//! panel is read) beside the whole trace's, and the final summary; Stop cancels a replay
//! without counting its requests in flight as failures; the chat workload's controls are
//! hidden.

use std::sync::Arc;
use std::time::Duration;

use loadgen::Loadgen;
use loadgen::trace::TraceReplayConfig;
use loadgen::trace_run::TraceSetup;
use serde_json::Value;
use workload::{Speed, Trace};

mod common;

use common::browser::{ChromeDriver, click, not_hidden, text};
use common::{Cluster, MODEL, get, loadgen_config, wait_until};

const SPEEDUP: f64 = 50.0;
const REQUESTS: usize = 40;

/// `web/js/format.js`'s `kvHit`.
fn percent(v: &Value) -> String {
    v.as_f64()
        .map_or("—".to_owned(), |v| format!("{:.1}%", v * 100.0))
}

/// A percentage as the panel shows it ("7.6%"), as a number; `None` for "—".
fn shown_percent(text: &str) -> Option<f64> {
    text.strip_suffix('%').and_then(|n| n.parse().ok())
}

/// The server's hit rate and the bound over the same requests as the panel shows them, read
/// in one script so that both come from the same status.
async fn hit_and_bound(browser: &fantoccini::Client) -> (String, String) {
    let both = browser
        .execute(
            "return ['trace-hit', 'trace-bound-finished']\
               .map((id) => document.getElementById(id).textContent);",
            vec![],
        )
        .await
        .unwrap();
    let text = |i: usize| both[i].as_str().unwrap_or_default().to_owned();
    (text(0), text(1))
}

/// The number of requests sent, from the panel's "SENT / TOTAL".
fn sent(text: &str) -> u64 {
    text.split('/')
        .next()
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_trace_panel_shows_the_replay_its_bound_and_its_end() {
    let cluster = Cluster::start(0..2, SPEEDUP, "worker-").await;
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../traces/mooncake_conversation_trace.jsonl"
    );
    let whole = Trace::parse_bytes(&std::fs::read(path).unwrap()).unwrap();
    let slice = Arc::new(whole.first(REQUESTS).unwrap());
    let bound = slice.oracle_prefix_hit_rate();
    let mut config = loadgen_config(vec![cluster.lane("live", None)], 60, SPEEDUP);
    // The slice's 12 recorded seconds at 2×: about 6 s to watch.
    config.trace = Some(TraceSetup {
        replay: TraceReplayConfig::new(
            &cluster.gateway.url(),
            MODEL,
            slice,
            Speed::new(2.0).unwrap(),
        ),
        file: "traces/mooncake_conversation_trace.jsonl".to_owned(),
        requests_in_file: whole.len(),
    });
    let loadgen = Loadgen::bind(config).await.unwrap();
    let url = loadgen.url();
    let status_url = format!("{url}/api/status");

    let driver = ChromeDriver::start();
    let browser = driver.browser().await;
    browser.goto(&url).await.unwrap();
    wait_until("the WebSocket", Duration::from_secs(10), async || {
        text(&browser, "ws-state").await == "connected"
    })
    .await;

    // Before Start: the panel, the file, the bound; the chat workload's controls hidden.
    wait_until("the trace panel", Duration::from_secs(10), async || {
        not_hidden(&browser, "trace-panel").await
    })
    .await;
    assert!(
        !not_hidden(&browser, "booth-panel").await,
        "no mix/rate controls"
    );
    assert_eq!(text(&browser, "trace-state").await, "waiting for Start");
    assert_eq!(
        text(&browser, "trace-file").await,
        format!(
            "traces/mooncake_conversation_trace.jsonl (first 40 of {} requests)",
            whole.len()
        )
    );
    assert_eq!(text(&browser, "trace-speed").await, "2×");
    assert_eq!(text(&browser, "trace-sent").await, "0 / 40");
    assert_eq!(text(&browser, "trace-bound").await, percent(&bound.into()));
    assert_eq!(text(&browser, "trace-bound-finished").await, "—");
    assert_eq!(
        text(&browser, "trace-hit-over").await,
        "no request finished yet"
    );
    let idle = get(&status_url).await.1;
    assert_eq!(
        idle["trace"]["oracle_prefix_hit_rate"].as_f64(),
        Some(bound)
    );
    assert!(
        idle["trace"]["oracle_hit_rate_finished"].is_null(),
        "{idle}"
    );

    // Start from the page: progress shows while it runs.
    click(&browser, "start").await;
    wait_until(
        "progress on the panel",
        Duration::from_secs(20),
        async || {
            // Whenever the panel is read, the server's rate is within its bound.
            let (hit, possible) = hit_and_bound(&browser).await;
            if let (Some(hit), Some(possible)) = (shown_percent(&hit), shown_percent(&possible)) {
                assert!(hit <= possible, "{hit}% of a possible {possible}%");
            }
            text(&browser, "trace-state").await == "replaying"
                && (1..REQUESTS as u64).contains(&sent(&text(&browser, "trace-sent").await))
        },
    )
    .await;
    let fill = browser
        .execute(
            "return document.getElementById('trace-bar-fill').style.width;",
            vec![],
        )
        .await
        .unwrap();
    let fill: f64 = fill
        .as_str()
        .and_then(|w| w.trim_end_matches('%').parse().ok())
        .unwrap_or(0.0);
    assert!(fill > 0.0 && fill < 100.0, "progress bar at {fill}%");
    assert_ne!(text(&browser, "trace-eta").await, "—");

    // The end: the final summary, in the API's numbers.
    wait_until("the replay's end", Duration::from_secs(90), async || {
        text(&browser, "trace-state").await == "finished"
    })
    .await;
    let status = get(&status_url).await.1;
    let t = &status["trace"];
    assert_eq!(t["state"], "finished", "{t}");
    assert_eq!(
        (&t["issued"], &t["finished"]),
        (&40.into(), &40.into()),
        "{t}"
    );
    assert_eq!(text(&browser, "trace-sent").await, "40 / 40");
    assert_eq!(text(&browser, "trace-finished").await, "40");
    assert_eq!(text(&browser, "trace-failed").await, "0");
    assert_eq!(text(&browser, "trace-dropped").await, "0");
    assert_eq!(
        text(&browser, "trace-hit").await,
        percent(&t["kv_hit_rate"])
    );
    assert!(text(&browser, "trace-hit").await.ends_with('%'));
    // Every request finished: the bound over them is the whole slice's, and the server's rate
    // is within it.
    assert_eq!(t["oracle_hit_rate_finished"].as_f64(), Some(bound), "{t}");
    assert!(t["kv_hit_rate"].as_f64().unwrap() <= bound, "{t}");
    assert_eq!(
        text(&browser, "trace-bound-finished").await,
        percent(&bound.into())
    );
    assert_eq!(
        text(&browser, "trace-hit-over").await,
        "on the 40 finished requests"
    );
    let summary = text(&browser, "trace-summary").await;
    assert!(
        summary.starts_with("Replay finished: 40 of 40 requests sent in"),
        "{summary}"
    );
    let bound_shown = percent(&bound.into());
    assert!(
        summary.contains(&format!(
            "of a possible {bound_shown} on the 40 finished requests (the whole trace's bound: \
             {bound_shown})"
        )),
        "{summary}"
    );
    // The cards follow the same requests.
    wait_until("the cards", Duration::from_secs(5), async || {
        text(&browser, "kpi-requests").await == "40"
    })
    .await;

    // Again, stopped half-way: the requests in flight are cancelled, not failed.
    click(&browser, "start").await;
    wait_until("a second replay", Duration::from_secs(20), async || {
        text(&browser, "trace-state").await == "replaying"
            && sent(&text(&browser, "trace-sent").await) >= 1
    })
    .await;
    click(&browser, "stop").await;
    wait_until("stopped", Duration::from_secs(20), async || {
        text(&browser, "trace-state").await == "stopped"
    })
    .await;
    let status = get(&status_url).await.1;
    let t = &status["trace"];
    assert_eq!(status["running"], false, "{status}");
    assert_eq!(t["failed"], 0, "{t}");
    let count = |k: &str| t[k].as_u64().unwrap();
    assert_eq!(
        count("finished") + count("dropped") + count("cancelled"),
        count("issued"),
        "{t}"
    );
    assert!(count("issued") < 40, "stopped before the end: {t}");
    assert_eq!(status["lanes"][0]["metrics"]["errors"], 0, "{status}");
    let summary = text(&browser, "trace-summary").await;
    assert!(summary.starts_with("Replay stopped:"), "{summary}");
    // The engines kept the first replay's blocks, which the bound (a cache empty at the start)
    // does not count: where the server's rate is above it, the panel says why.
    let above = match (
        t["kv_hit_rate"].as_f64(),
        t["oracle_hit_rate_finished"].as_f64(),
    ) {
        (Some(hit), Some(possible)) => hit > possible + 1e-9,
        _ => false,
    };
    assert_eq!(t["above_bound"].as_bool(), Some(above), "{t}");
    let over = text(&browser, "trace-hit-over").await;
    assert_eq!(
        over.contains("the server\u{2019}s cache was not empty at the start"),
        above,
        "{over}: {t}"
    );

    browser.close().await.unwrap();
    loadgen.shutdown().await;
}
