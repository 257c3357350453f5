//! The web UI in headless Chromium (Debian's `chromium` + `chromium-driver`, which `.ci/run`
//! installs), driven over WebDriver: every page loads, Start/Stop follow the rules, the slider
//! changes the live concurrency, and the tables, cards, colours and transcripts show the API's
//! numbers with the formats of `web/js/format.js`.

use std::sync::Arc;
use std::time::Duration;

use fantoccini::{Client, Locator};
use loadgen::ladder::{LadderConfig, PhaseLadder, PhaseSetup, Switched};
use loadgen::scenario::{BoxFuture, PoolKind, PoolSizes};
use loadgen::{Fleet, LaneSpec, Loadgen, LoadgenConfig, PhaseReference};
use serde_json::{Value, json};
use workload::scenario::ScenarioConfig;

mod common;

use common::browser::{ChromeDriver, click, disabled, id, text};
use common::{Cluster, MODEL, get, loadgen_config, wait_until};
const SPEEDUP: f64 = 50.0;

async fn api(url: &str) -> Value {
    get(url).await.1
}

async fn classes(browser: &Client, testid: &str) -> String {
    browser
        .find(id(testid))
        .await
        .unwrap_or_else(|e| panic!("element {testid}: {e}"))
        .attr("class")
        .await
        .unwrap()
        .unwrap_or_default()
}

/// `web/js/format.js`'s rules.
fn ms(v: &Value) -> String {
    v.as_f64()
        .map_or("—".to_owned(), |v| format!("{}", v.round()))
}

fn seconds(v: &Value) -> String {
    v.as_f64().map_or("—".to_owned(), |v| format!("{v:.2}"))
}

fn slo_class(v: f64, slo: f64) -> &'static str {
    if v > slo {
        "slo-red"
    } else if v >= 0.9 * slo {
        "slo-yellow"
    } else {
        "slo-ok"
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_shows_the_api_numbers_in_headless_chromium() {
    let cluster = Cluster::start(0..2, SPEEDUP, "worker-").await;
    let lane = cluster.lane("kv_load", Some("kv_load"));
    let mut config = loadgen_config(vec![lane], 60, SPEEDUP);
    // A window of a modelled hour: after Stop the percentiles stay put while they are compared.
    config.drive.window = Duration::from_secs(3_600);
    let loadgen = Loadgen::bind(config).await.unwrap();
    let url = loadgen.url();

    let driver = ChromeDriver::start();
    let browser = driver.browser().await;
    browser.goto(&url).await.unwrap();

    // Header; connected and stopped: Start enabled, Stop disabled.
    assert_eq!(
        text(&browser, "title").await,
        "Serve More Users on the Same GPUs with KV-Aware Routing"
    );
    wait_until("the WebSocket", Duration::from_secs(10), async || {
        text(&browser, "ws-state").await == "connected"
    })
    .await;
    assert!(!disabled(&browser, "start").await);
    assert!(disabled(&browser, "stop").await);
    for card in ["rps", "tops", "kv-hit", "queued"] {
        assert_eq!(
            text(&browser, &format!("kpi-{card}")).await,
            "—",
            "{card} before start"
        );
    }

    // The static table: every level of the baseline, coloured against the SLOs.
    let baseline = api(&format!("{url}/api/baseline")).await;
    for level in baseline["levels"].as_array().unwrap() {
        let c = level["concurrency"].as_u64().unwrap();
        for (metric, key, slo) in [("ttft", "ttft_ms", 600.0), ("tpot", "tpot_ms", 60.0)] {
            let rr = &level["baseline"][key]["p95"];
            let kv = &level["kv"][key]["p95"];
            for (column, value) in [("rr", rr), ("kv", kv)] {
                let cell = format!("static-{c}-{metric}-{column}");
                assert_eq!(text(&browser, &cell).await, ms(value), "{cell}");
                let expected = slo_class(value.as_f64().unwrap(), slo);
                assert!(
                    classes(&browser, &cell).await.contains(expected),
                    "{cell}: {expected}"
                );
            }
            let (rr, kv) = (rr.as_f64().unwrap(), kv.as_f64().unwrap());
            let improvement = (rr - kv) / rr * 100.0;
            let expected = if improvement > 0.0 {
                format!("+{improvement:.1}%")
            } else {
                format!("{improvement:.1}%")
            };
            assert_eq!(
                text(&browser, &format!("static-{c}-{metric}-imp")).await,
                expected
            );
        }
    }

    // Start from the page.
    click(&browser, "start").await;
    wait_until("running", Duration::from_secs(10), async || {
        disabled(&browser, "start").await && !disabled(&browser, "stop").await
    })
    .await;
    assert_eq!(api(&format!("{url}/api/status")).await["running"], true);
    wait_until(
        "live numbers on the cards",
        Duration::from_secs(90),
        async || {
            text(&browser, "kpi-requests")
                .await
                .parse::<u64>()
                .unwrap_or(0)
                >= 20
                && text(&browser, "kpi-tops").await != "—"
                && text(&browser, "kpi-kv-hit").await.ends_with('%')
        },
    )
    .await;
    assert_eq!(text(&browser, "kpi-errors").await, "0");
    assert!(!classes(&browser, "kpi-errors").await.contains("error"));
    assert_eq!(
        browser.find_all(id("worker-card")).await.unwrap().len(),
        2,
        "one card per worker"
    );
    assert!(text(&browser, "gpu-util").await.ends_with('%'));
    // The gateway attributes reuse: its cards appear, in the API's numbers.
    wait_until("reuse cards", Duration::from_secs(30), async || {
        text(&browser, "kpi-reuse-achieved").await.ends_with('%')
            && text(&browser, "kpi-reuse-available").await.ends_with('%')
    })
    .await;
    let available = text(&browser, "kpi-reuse-available").await;
    let available: f64 = available.trim_end_matches('%').parse().unwrap();
    assert!((0.0..=100.0).contains(&available), "{available}");
    let series = browser
        .find_all(Locator::Css("[data-testid=chart-tops] path.series"))
        .await
        .unwrap();
    assert!(!series.is_empty(), "the TOPS chart draws its series");

    // The slider moves the live concurrency (debounced) and the RR columns follow it.
    browser
        .execute(
            "const s = document.querySelector('[data-testid=concurrency-slider]');
             s.value = '120';
             s.dispatchEvent(new Event('input', {bubbles: true}));
             s.dispatchEvent(new Event('change', {bubbles: true}));",
            vec![],
        )
        .await
        .unwrap();
    assert_eq!(text(&browser, "concurrency-value").await, "120");
    wait_until(
        "concurrency 120 applied",
        Duration::from_secs(5),
        async || api(&format!("{url}/api/status")).await["concurrency"] == 120,
    )
    .await;
    let status = api(&format!("{url}/api/status")).await;
    assert_eq!(status["running"], true, "applied without stopping");
    assert_eq!(status["baseline"]["concurrency"], 120);
    wait_until("RR p95 of level 120", Duration::from_secs(5), async || {
        text(&browser, "cell-ttft-rr-p95").await == ms(&status["baseline"]["ttft_ms"]["p95"])
    })
    .await;

    // Stop from the page; then the live table equals the API's window, with its colours.
    click(&browser, "stop").await;
    wait_until("stopped", Duration::from_secs(10), async || {
        !disabled(&browser, "start").await && disabled(&browser, "stop").await
    })
    .await;
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let status = api(&format!("{url}/api/status")).await;
    assert_eq!(status["running"], false);
    let m = &status["lanes"][0]["metrics"];
    let b = &status["baseline"];
    for (row, key, slo) in [
        ("ttft", "ttft_ms", Some(600.0)),
        ("tpot", "tpot_ms", Some(60.0)),
        ("itl", "itl_ms", None),
        ("latency", "e2e_s", None),
    ] {
        let format = if row == "latency" { seconds } else { ms };
        for q in ["p50", "p95"] {
            let cell = format!("cell-{row}-live-{q}");
            assert_eq!(text(&browser, &cell).await, format(&m[key][q]), "{cell}");
            if let Some(slo) = slo {
                let expected = slo_class(m[key][q].as_f64().unwrap(), slo);
                assert!(
                    classes(&browser, &cell).await.contains(expected),
                    "{cell}: {expected}"
                );
            }
            let cell = format!("cell-{row}-rr-{q}");
            assert_eq!(text(&browser, &cell).await, format(&b[key][q]), "{cell}");
            assert!(
                classes(&browser, &cell).await.contains("muted"),
                "{cell} is muted"
            );
        }
    }
    assert_eq!(
        text(&browser, "kpi-requests").await,
        m["requests"].to_string()
    );

    // Conversations: the list, then one conversation's transcript and per-turn numbers.
    browser
        .goto(&format!("{url}/#/conversations"))
        .await
        .unwrap();
    text(&browser, "conversations-table").await;
    let list = api(&format!("{url}/api/conversations")).await;
    let conversations = list["conversations"].as_array().unwrap();
    wait_until("the list", Duration::from_secs(10), async || {
        browser
            .find_all(id("conversation-row"))
            .await
            .unwrap()
            .len()
            == conversations.len()
    })
    .await;
    let chosen = conversations
        .iter()
        .find(|c| c["turns_done"].as_u64().unwrap() >= 2)
        .expect("a conversation with two turns");
    let chosen_id = chosen["id"].as_str().unwrap();
    browser
        .find(Locator::Css(&format!(
            "[data-testid=conversation-row][data-id='{chosen_id}']"
        )))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    text(&browser, "conversation-detail").await;
    let detail = api(&format!("{url}/api/conversations/{chosen_id}")).await;
    let turns = detail["turns"].as_array().unwrap();
    let shown = browser.find_all(id("turn")).await.unwrap();
    assert_eq!(shown.len(), turns.len());
    for (element, turn) in shown.iter().zip(turns) {
        if turn["state"] != "done" {
            continue;
        }
        let field = async |testid: &str| {
            let inside = format!(".//*[@data-testid='{testid}']");
            element
                .find(Locator::XPath(&inside))
                .await
                .unwrap()
                .text()
                .await
                .unwrap()
        };
        assert_eq!(field("turn-ttft").await, ms(&turn["ttft_ms"]), "{turn}");
        assert_eq!(field("turn-itl").await, ms(&turn["itl_ms"]), "{turn}");
        let tokens = field("turn-tokens").await;
        assert_eq!(tokens, turn["tokens"].to_string(), "{turn}");
        assert_eq!(
            field("turn-latency").await,
            seconds(&turn["latency_s"]),
            "{turn}"
        );
        let words = |s: &str| s.split_whitespace().collect::<Vec<_>>().join(" ");
        assert_eq!(
            words(&field("bubble-user").await),
            words(turn["user"].as_str().unwrap())
        );
        assert_eq!(
            words(&field("bubble-assistant").await),
            words(turn["assistant"].as_str().unwrap())
        );
    }

    // The diagram pages load their pictures.
    for page in ["architecture", "kv-routing", "features"] {
        browser.goto(&format!("{url}/#/{page}")).await.unwrap();
        let width = async || {
            browser
                .execute(
                    "const d = document.querySelector('[data-testid=diagram]');
                     return d && d.complete ? d.naturalWidth : 0;",
                    vec![],
                )
                .await
                .unwrap()
                .as_u64()
                .unwrap_or(0)
        };
        wait_until(page, Duration::from_secs(10), async || width().await > 0).await;
    }

    // The server goes away: the page says so and disables both buttons.
    browser.goto(&url).await.unwrap();
    wait_until("connected again", Duration::from_secs(10), async || {
        text(&browser, "ws-state").await == "connected"
    })
    .await;
    loadgen.shutdown().await;
    wait_until("disconnected", Duration::from_secs(20), async || {
        text(&browser, "ws-state").await == "disconnected"
    })
    .await;
    assert!(disabled(&browser, "start").await && disabled(&browser, "stop").await);

    browser.close().await.unwrap();
    cluster.gateway.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compare_mode_shows_both_lanes_live() {
    let a = Cluster::start(0..1, SPEEDUP, "a-worker-").await;
    let b = Cluster::start(1..2, SPEEDUP, "b-worker-").await;
    let lanes = vec![
        a.lane("kv_load", Some("kv_load")),
        b.lane("round_robin", Some("round_robin")),
    ];
    let mut config = loadgen_config(lanes, 3, SPEEDUP);
    config.autostart = true;
    let loadgen = Loadgen::bind(config).await.unwrap();
    let url = loadgen.url();

    let driver = ChromeDriver::start();
    let browser = driver.browser().await;
    browser.goto(&url).await.unwrap();
    // Both columns are live, named after their lanes; the second lane's cards carry "-1".
    wait_until("both lanes' figures", Duration::from_secs(60), async || {
        text(&browser, "kpi-requests")
            .await
            .parse::<u64>()
            .unwrap_or(0)
            >= 2
            && text(&browser, "kpi-requests-1")
                .await
                .parse::<u64>()
                .unwrap_or(0)
                >= 2
            && text(&browser, "cell-ttft-rr-p50").await != "—"
    })
    .await;
    let headers = browser
        .find(Locator::Id("live-head"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        headers.contains("kv_load p50") && headers.contains("round_robin p95"),
        "{headers}"
    );
    // One worker card per lane, and one chart series per lane.
    assert_eq!(browser.find_all(id("worker-card")).await.unwrap().len(), 2);
    wait_until("two TOPS series", Duration::from_secs(10), async || {
        browser
            .find_all(Locator::Css("[data-testid=chart-tops] path.series"))
            .await
            .unwrap()
            .len()
            == 2
    })
    .await;
    browser.close().await.unwrap();
    loadgen.shutdown().await;
}

/// `attr` of every element matching `selector`, read in one script: the charts redraw every
/// status message, so elements found one call earlier may be gone.
async fn attrs(browser: &Client, selector: &str, attr: &str) -> Vec<String> {
    let value = browser
        .execute(
            "return Array.from(document.querySelectorAll(arguments[0])).map((e) => e.getAttribute(arguments[1]) || '');",
            vec![json!(selector), json!(attr)],
        )
        .await
        .unwrap();
    value
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// Seed 003's booth dashboard: with EAGLE-3 workers, the acceptance and tokens-per-step cards
/// appear (only once the workers report them), the ITL chart draws p50 and p95, the TTFT
/// chart splits turn 1 from turns 2+, and both carry the recorded phases' reference lines
/// from a `bench --phases` results.json (the shipped one, 3 × H200).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_booth_dashboard_shows_speculation_and_the_phases_reference_lines() {
    let engines = [
        common::engine_with_spec(0, SPEEDUP, "worker-0", Some("eagle3")).await,
        common::engine_with_spec(1, SPEEDUP, "worker-1", Some("eagle3")).await,
    ];
    let gateway = common::gateway(&engines).await;
    let mut lane = LaneSpec::for_gateway("kv_load", Some("kv_load"), &gateway.url(), MODEL);
    lane.worker_metrics = engines
        .iter()
        .map(|e| format!("{}/metrics", e.url()))
        .collect();
    let mut config = LoadgenConfig::new(vec![lane]);
    config.listen = "127.0.0.1:0".parse().unwrap();
    config.drive.workload.concurrency = 20;
    config.drive.workload.ramp_s = 0.0;
    config.drive.time_scale = SPEEDUP;
    config.phase_reference = PhaseReference::shipped_for("h200-llama70b-fp8", 3);
    assert!(config.phase_reference.is_some());
    let loadgen = Loadgen::bind(config).await.unwrap();
    let url = loadgen.url();

    let driver = ChromeDriver::start();
    let browser = driver.browser().await;
    browser.goto(&url).await.unwrap();
    wait_until("the WebSocket", Duration::from_secs(10), async || {
        text(&browser, "ws-state").await == "connected"
    })
    .await;
    // Stopped: the workers have reported nothing yet, so there are no speculation cards.
    assert!(browser.find(id("kpi-acceptance")).await.is_err());
    // The reference lines are there from the start: the recorded phases at concurrency 20.
    let status = api(&format!("{url}/api/status")).await;
    assert_eq!(status["references"]["setup"], "h200x3");
    assert_eq!(status["references"]["concurrency"], 20);
    let names = attrs(
        &browser,
        "[data-testid=chart-itl] line.ref-line",
        "data-ref",
    )
    .await;
    assert_eq!(names.len(), 4, "{names:?}");
    for phase in ["baseline", "kv", "draft", "eagle3"] {
        assert!(names.iter().any(|n| n == phase), "{phase} in {names:?}");
    }
    assert_eq!(
        attrs(
            &browser,
            "[data-testid=chart-ttft-turns] line.ref-line",
            "data-ref"
        )
        .await
        .len(),
        4
    );
    assert!(text(&browser, "reference-note").await.contains("h200x3"));

    browser
        .find(id("start"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    wait_until(
        "the speculation cards",
        Duration::from_secs(90),
        async || {
            let acceptance = text(&browser, "kpi-acceptance").await;
            let per_step = text(&browser, "kpi-tokens-per-step").await;
            acceptance.ends_with('%') && per_step.parse::<f64>().is_ok()
        },
    )
    .await;
    let acceptance: f64 = text(&browser, "kpi-acceptance")
        .await
        .trim_end_matches('%')
        .parse()
        .unwrap();
    let per_step: f64 = text(&browser, "kpi-tokens-per-step").await.parse().unwrap();
    // EAGLE-3's classes: α 0.85 and 0.70; K = 5.
    assert!((60.0..95.0).contains(&acceptance), "{acceptance}");
    assert!((2.0..6.0).contains(&per_step), "{per_step}");
    let lane = &api(&format!("{url}/api/status")).await["lanes"][0]["metrics"];
    assert!(lane["acceptance_rate"].as_f64().is_some(), "{lane}");
    // ITL p50 and p95, TTFT of turn 1 and of turns 2+: a solid and a dashed line each, drawn
    // once turns 2+ have finished.
    wait_until(
        "turns 2+ on the chart",
        Duration::from_secs(90),
        async || {
            api(&format!("{url}/api/status")).await["lanes"][0]["metrics"]["ttft_later_ms"]["p50"]
                .is_number()
        },
    )
    .await;
    for chart in ["chart-itl", "chart-ttft-turns"] {
        let classes = attrs(
            &browser,
            &format!("[data-testid={chart}] path.series"),
            "class",
        )
        .await;
        assert_eq!(classes.len(), 2, "{chart}: {classes:?}");
        assert!(classes[1].contains("dashed"), "{chart}: {classes:?}");
    }
    wait_until("a drawn ITL line", Duration::from_secs(30), async || {
        attrs(&browser, "[data-testid=chart-itl] path.series", "d")
            .await
            .first()
            .is_some_and(|d| d.contains('L'))
    })
    .await;
    browser
        .find(id("stop"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    browser.close().await.unwrap();
    loadgen.shutdown().await;
}

/// Whether the element is shown (not `hidden`, nor inside something hidden).
async fn shown(browser: &Client, testid: &str) -> bool {
    browser
        .find(id(testid))
        .await
        .unwrap_or_else(|e| panic!("element {testid}: {e}"))
        .is_displayed()
        .await
        .unwrap()
}

/// The worker cards' names inside the element `testid`.
async fn cards_in(browser: &Client, testid: &str) -> Vec<String> {
    let value = browser
        .execute(
            "const box = document.querySelector(`[data-testid='${arguments[0]}']`);
             return box ? Array.from(box.querySelectorAll('[data-testid=worker-card] .worker-name'))
                 .map((e) => e.textContent) : null;",
            vec![json!(testid)],
        )
        .await
        .unwrap();
    serde_json::from_value(value).unwrap_or_default()
}

/// Auto mode's widgets follow the backend: shown when `/api/status` has a `scenario`, hidden
/// (and nothing broken) when it has none.
async fn assert_auto_mode_follows_the_backend(browser: &Client, url: &str) {
    // No phase ladder on these targets: its panel stays hidden.
    assert!(!shown(browser, "ladder-panel").await);
    let has_scenario = api(&format!("{url}/api/status"))
        .await
        .get("scenario")
        .is_some();
    wait_until("auto mode's widgets", Duration::from_secs(10), async || {
        shown(browser, "scenario-box").await == has_scenario
    })
    .await;
    if !has_scenario {
        assert!(!shown(browser, "chart-pools-card").await);
        let markers = attrs(
            browser,
            "[data-testid=chart-ttft] line.event-marker",
            "data-event",
        )
        .await;
        assert!(
            markers.is_empty(),
            "no scaling events without a scenario: {markers:?}"
        );
    }
}

/// Seed 004's pools (issue 16): with one prefill and two decode workers, the GPU view groups
/// the cards under "Prefill pool" and "Decode pool" with each pool's size, and each pool's TTFT
/// and ITL are the gateway's per-pool histograms over the window, as `/api/status` reports them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gpu_view_groups_a_disaggregated_fleet_by_pool_with_its_latency() {
    let cluster = Cluster::disaggregated(1, 2, SPEEDUP).await;
    let mut config = loadgen_config(vec![cluster.lane("kv_load", Some("kv_load"))], 6, SPEEDUP);
    // A window of a modelled hour: after Stop the pools' figures stay put while compared.
    config.drive.window = Duration::from_secs(3_600);
    let loadgen = Loadgen::bind(config).await.unwrap();
    let url = loadgen.url();

    let driver = ChromeDriver::start();
    let browser = driver.browser().await;
    browser.goto(&url).await.unwrap();
    wait_until("the pool groups", Duration::from_secs(20), async || {
        cards_in(&browser, "pool-prefill").await == ["worker-0"]
            && cards_in(&browser, "pool-decode").await == ["worker-1", "worker-2"]
    })
    .await;
    assert_eq!(text(&browser, "pool-prefill-count").await, "1 worker");
    assert_eq!(text(&browser, "pool-decode-count").await, "2 workers");
    assert!(
        browser.find(id("pool-aggregated")).await.is_err(),
        "no aggregated group without aggregated workers"
    );
    let status = api(&format!("{url}/api/status")).await;
    let roles: Vec<&str> = common::strings(&status["lanes"][0]["workers"]["list"], "role");
    assert_eq!(roles, ["prefill", "decode", "decode"]);
    assert_eq!(
        text(&browser, "pool-prefill-ttft-p95").await,
        "—",
        "no data before the start"
    );
    assert_auto_mode_follows_the_backend(&browser, &url).await;

    click(&browser, "start").await;
    // The prefill pool computes the prompts of split routes (TTFT); the decode pool decodes
    // (ITL).
    let pool = |status: &Value, name: &str| -> Value {
        status["lanes"][0]["workers"]["pools"]
            .as_array()
            .and_then(|pools| pools.iter().find(|p| p["pool"] == name).cloned())
            .unwrap_or(Value::Null)
    };
    wait_until(
        "both pools' latency",
        Duration::from_secs(120),
        async || {
            let status = api(&format!("{url}/api/status")).await;
            pool(&status, "prefill")["ttft_ms"]["p95"].is_number()
                && pool(&status, "decode")["itl_ms"]["p95"].is_number()
        },
    )
    .await;
    click(&browser, "stop").await;
    wait_until("stopped", Duration::from_secs(10), async || {
        !disabled(&browser, "start").await
    })
    .await;
    // Two scrapes after Stop: the figures no longer move.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let status = api(&format!("{url}/api/status")).await;
    assert_eq!(status["running"], false);
    for name in ["prefill", "decode"] {
        let figures = pool(&status, name);
        for (metric, key) in [("ttft", "ttft_ms"), ("itl", "itl_ms")] {
            for q in ["p50", "p95"] {
                let cell = format!("pool-{name}-{metric}-{q}");
                let expected = ms(&figures[key][q]);
                wait_until(&cell, Duration::from_secs(5), async || {
                    text(&browser, &cell).await == expected
                })
                .await;
            }
        }
    }
    let (prefill, decode) = (pool(&status, "prefill"), pool(&status, "decode"));
    assert!(
        prefill["ttft_ms"]["p50"].as_f64().unwrap() > 0.0,
        "{prefill}"
    );
    // On the lane clock, as the client's figures: the gateway's wall-clock ITL of a simulator
    // sped up 50 times is 50 times shorter (its buckets make it approximate).
    let pool_itl = decode["itl_ms"]["p50"].as_f64().unwrap();
    let client_itl = status["lanes"][0]["metrics"]["itl_ms"]["p50"]
        .as_f64()
        .unwrap();
    assert!(
        (client_itl / 3.0..client_itl * 3.0).contains(&pool_itl),
        "decode pool ITL p50 {pool_itl} ms vs the client's {client_itl} ms"
    );
    // The GPU boxes still show every worker's utilisation.
    assert_eq!(browser.find_all(id("gpu-util")).await.unwrap().len(), 3);

    browser.close().await.unwrap();
    loadgen.shutdown().await;
    cluster.gateway.shutdown().await;
}

/// The `value` of the range input `testid`, set as a hand would (input events).
async fn slide(browser: &Client, testid: &str, value: &str) {
    browser
        .execute(
            "const s = document.querySelector(`[data-testid='${arguments[0]}']`);
             s.value = arguments[1];
             s.dispatchEvent(new Event('input', {bubbles: true}));
             s.dispatchEvent(new Event('change', {bubbles: true}));",
            vec![json!(testid), json!(value)],
        )
        .await
        .unwrap();
}

/// Types `value` into the number input `testid` and leaves it (a change event).
async fn type_into(browser: &Client, testid: &str, value: &str) {
    browser
        .execute(
            "const s = document.querySelector(`[data-testid='${arguments[0]}']`);
             s.focus();
             s.value = arguments[1];
             s.dispatchEvent(new Event('change', {bubbles: true}));
             s.blur();",
            vec![json!(testid), json!(value)],
        )
        .await
        .unwrap();
}

/// Seed 004's Display 1 (issue 17): the presets, the mix sliders (kept at 100 %) and the rate
/// set the load generator's shape through `POST /api/workload/config`; an API error is shown;
/// Start/Stop/Reset drive the workload and Reset goes back to Balanced at the default rate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_booth_controls_set_the_mix_and_rate_and_reset() {
    let cluster = Cluster::start(0..1, SPEEDUP, "worker-").await;
    let config = loadgen_config(vec![cluster.lane("kv_load", Some("kv_load"))], 4, SPEEDUP);
    let loadgen = Loadgen::bind(config).await.unwrap();
    let url = loadgen.url();
    let status = async || api(&format!("{url}/api/status")).await;

    let driver = ChromeDriver::start();
    let browser = driver.browser().await;
    browser.goto(&url).await.unwrap();
    wait_until("the WebSocket", Duration::from_secs(10), async || {
        text(&browser, "ws-state").await == "connected"
    })
    .await;
    assert_auto_mode_follows_the_backend(&browser, &url).await;
    // No pools: the cards as before, no pool headings.
    assert!(browser.find(id("pool-prefill")).await.is_err());

    // Presets.
    for (preset, mix, b) in [
        ("preset-prefill", "A=0,B=80,C=20", "80%"),
        ("preset-decode", "A=0,B=20,C=80", "20%"),
    ] {
        click(&browser, preset).await;
        wait_until(preset, Duration::from_secs(5), async || {
            status().await["mix"] == mix
        })
        .await;
        wait_until("the preset shown", Duration::from_secs(5), async || {
            text(&browser, "mix-b-value").await == b
                && classes(&browser, preset).await.contains("active")
        })
        .await;
    }
    // A slider: A to 60 %, B and C share the other 40 % as they were (20:80).
    slide(&browser, "mix-a", "60").await;
    wait_until("the slid mix", Duration::from_secs(5), async || {
        status().await["mix"] == "A=60,B=8,C=32"
    })
    .await;
    let shown_mix: Vec<String> = futures::future::join_all(
        ["mix-a-value", "mix-b-value", "mix-c-value"].map(|t| text(&browser, t)),
    )
    .await;
    assert_eq!(shown_mix, ["60%", "8%", "32%"]);
    assert!(!classes(&browser, "preset-decode").await.contains("active"));

    // The rate (the open loop), then a bad one: the API's 400 is shown and nothing changes.
    type_into(&browser, "rate-input", "0.5").await;
    wait_until("rate 0.5", Duration::from_secs(5), async || {
        status().await["rate"] == 0.5
    })
    .await;
    assert!(!shown(&browser, "booth-error").await);
    type_into(&browser, "rate-input", "-1").await;
    wait_until("the error", Duration::from_secs(5), async || {
        shown(&browser, "booth-error").await
    })
    .await;
    let error = text(&browser, "booth-error").await;
    assert!(error.contains("rate must be"), "{error}");
    assert_eq!(status().await["rate"], 0.5);

    // Start: the live counts; Stop; Start again and Reset.
    click(&browser, "start").await;
    wait_until("live RPS", Duration::from_secs(60), async || {
        text(&browser, "booth-rps").await.parse::<f64>().is_ok()
            && text(&browser, "booth-conversations")
                .await
                .parse::<u64>()
                .is_ok()
    })
    .await;
    assert!(
        !shown(&browser, "booth-error").await,
        "a success clears the error"
    );
    assert_eq!(status().await["running"], true);
    click(&browser, "stop").await;
    wait_until("stopped", Duration::from_secs(10), async || {
        status().await["running"] == false && !disabled(&browser, "start").await
    })
    .await;
    assert_eq!(text(&browser, "booth-rps").await, "—");
    wait_until(
        "the counts after Stop",
        Duration::from_secs(10),
        async || {
            let s = status().await;
            let lane = &s["lanes"][0]["metrics"];
            let (in_flight, conversations) = (
                lane["in_flight"].to_string(),
                lane["active_conversations"].to_string(),
            );
            text(&browser, "booth-in-flight").await == in_flight
                && text(&browser, "booth-conversations").await == conversations
        },
    )
    .await;
    click(&browser, "start").await;
    wait_until("running again", Duration::from_secs(10), async || {
        status().await["running"] == true && !disabled(&browser, "reset").await
    })
    .await;
    click(&browser, "reset").await;
    wait_until("reset", Duration::from_secs(10), async || {
        let s = status().await;
        s["running"] == false && s["mix"] == "A=40,B=30,C=30" && s["rate"] == 2.0
    })
    .await;
    wait_until("Balanced shown", Duration::from_secs(5), async || {
        text(&browser, "mix-a-value").await == "40%"
            && classes(&browser, "preset-balanced")
                .await
                .contains("active")
            && browser
                .find(id("rate-input"))
                .await
                .unwrap()
                .prop("value")
                .await
                .unwrap()
                .as_deref()
                == Some("2")
    })
    .await;

    browser.close().await.unwrap();
    loadgen.shutdown().await;
    cluster.gateway.shutdown().await;
}

/// A fleet that resizes its pools on request and reports the sizes (the load generator's side
/// of `kvroute demo`'s simulated fleet, whose workers the test does not need).
struct SizedFleet(std::sync::Mutex<PoolSizes>);

impl Fleet for SizedFleet {
    fn pools(&self) -> PoolSizes {
        *self.0.lock().unwrap()
    }

    fn scale(&self, pool: PoolKind, to: u32) -> BoxFuture<'_, Result<u32, String>> {
        let mut sizes = self.0.lock().unwrap();
        match pool {
            PoolKind::Prefill => sizes.prefill = to,
            PoolKind::Decode => sizes.decode = to,
        }
        Box::pin(async move { Ok(to) })
    }

    fn worker_metrics(&self) -> Vec<(String, String)> {
        Vec::new()
    }
}

/// Seed 004's auto mode against the real scenario controller: the toggle switches it on and
/// off, the page shows the phase, its note and a countdown that follows the scenario's clock,
/// the pools' sizes over time, and the scaling event as a marker on the charts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_mode_shows_the_phase_countdown_pools_and_scaling_events() {
    let cluster = Cluster::start(0..1, SPEEDUP, "worker-").await;
    let mut config = loadgen_config(vec![cluster.lane("kv_load", Some("kv_load"))], 4, SPEEDUP);
    // A short first phase (1.2 s at 50×), then one long enough to read its countdown, which
    // adds a prefill worker.
    config.scaling.scenario = ScenarioConfig::from_toml(
        "rate_rps = 0.1\n\
         initial = { prefill = 1, decode = 1 }\n\
         max = { prefill = 4, decode = 5 }\n\
         [[phase]]\nname = \"BALANCED\"\nduration_s = 60\nmix = { A = 40, B = 30, C = 30 }\n\
         prefill = \"initial\"\ndecode = \"initial\"\nnote = \"All three workloads\"\n\
         [[phase]]\nname = \"PREFILL_RECOVERY\"\nduration_s = 3000\nmix = { B = 80, C = 20 }\n\
         prefill = \"+1\"\nnote = \"Add a prefill worker, show recovery\"\n",
    )
    .unwrap();
    config.scaling.fleet = Some(Arc::new(SizedFleet(std::sync::Mutex::new(PoolSizes {
        prefill: 1,
        decode: 1,
    }))));
    let loadgen = Loadgen::bind(config).await.unwrap();
    let url = loadgen.url();
    let status = async || api(&format!("{url}/api/status")).await;

    let driver = ChromeDriver::start();
    let browser = driver.browser().await;
    browser.goto(&url).await.unwrap();
    wait_until("the scenario box", Duration::from_secs(10), async || {
        shown(&browser, "scenario-box").await
    })
    .await;
    assert_eq!(text(&browser, "auto-state").await, "Manual");
    assert_eq!(text(&browser, "scenario-phase").await, "IDLE");
    assert!(!disabled(&browser, "mix-a").await);

    click(&browser, "auto-toggle").await;
    wait_until("the second phase", Duration::from_secs(20), async || {
        let s = status().await;
        s["scenario"]["mode"] == "auto" && s["scenario"]["phase"] == "PREFILL_RECOVERY"
    })
    .await;
    wait_until("the phase shown", Duration::from_secs(10), async || {
        text(&browser, "auto-state").await == "Auto"
            && text(&browser, "scenario-phase").await == "PREFILL_RECOVERY"
            && text(&browser, "scenario-pools").await == "Prefill 2 · Decode 1"
    })
    .await;
    assert_eq!(
        text(&browser, "scenario-note").await,
        "Add a prefill worker, show recovery"
    );
    // The cycle drives the workload: the presenter's controls are off.
    assert!(disabled(&browser, "mix-a").await && disabled(&browser, "preset-balanced").await);
    assert!(shown(&browser, "booth-auto-note").await);

    // The countdown (m:ss of scenario time) is the API's time left, and runs at the
    // scenario's pace: 50 scenario seconds per wall second here.
    let seconds = |t: &str| -> f64 {
        let (m, s) = t
            .split_once(':')
            .unwrap_or_else(|| panic!("m:ss, got {t:?}"));
        m.parse::<f64>().unwrap() * 60.0 + s.parse::<f64>().unwrap()
    };
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let before = seconds(&text(&browser, "scenario-countdown").await);
    let api_left = status().await["scenario"]["time_left_s"].as_f64().unwrap();
    assert!(
        (before - api_left).abs() <= 75.0,
        "page {before} s, API {api_left} s"
    );
    tokio::time::sleep(Duration::from_millis(2_000)).await;
    let after = seconds(&text(&browser, "scenario-countdown").await);
    assert!(
        (40.0..=160.0).contains(&(before - after)),
        "2 wall seconds are about 100 scenario seconds: {before} → {after}"
    );

    // The pools over time, and the scaling event marked on the time-series charts.
    wait_until("the event marker", Duration::from_secs(20), async || {
        attrs(
            &browser,
            "[data-testid=chart-ttft] line.event-marker",
            "data-event",
        )
        .await
        .iter()
        .any(|e| e == "prefill 1\u{2192}2")
    })
    .await;
    assert!(shown(&browser, "chart-pools-card").await);
    let lines = attrs(
        &browser,
        "[data-testid=chart-pools] path.series",
        "data-lane",
    )
    .await;
    assert_eq!(lines, ["prefill", "decode"]);

    // Manual again: the cycle stops, the controls come back.
    click(&browser, "auto-toggle").await;
    wait_until("manual mode", Duration::from_secs(10), async || {
        status().await["scenario"]["mode"] == "manual"
            && text(&browser, "auto-state").await == "Manual"
            && !disabled(&browser, "mix-a").await
    })
    .await;

    browser.close().await.unwrap();
    loadgen.shutdown().await;
    cluster.gateway.shutdown().await;
}

/// The load generator's side of `kvroute demo`'s phase switch on a real gateway and real
/// engines: a switch replaces the gateway's engines with new ones started with the phase's
/// speculative decoding (the demo restarts the gateway too, for its router; this test's phases
/// share one router).
struct SwappingLadder {
    gateway: gateway::Gateway,
    /// (worker id, engine) of the running phase.
    engines: tokio::sync::Mutex<Vec<(u64, engine_server::EngineServerHandle)>>,
    endpoints: std::sync::Mutex<Vec<(String, String)>>,
    next_id: std::sync::atomic::AtomicU64,
}

fn endpoints(engines: &[(u64, engine_server::EngineServerHandle)]) -> Vec<(String, String)> {
    engines
        .iter()
        .map(|(id, e)| (format!("worker-{id}"), format!("{}/metrics", e.url())))
        .collect()
}

impl PhaseLadder for SwappingLadder {
    fn phases(&self) -> Vec<PhaseSetup> {
        // `draft` cannot start here (its engines are refused): the previous phase stays.
        ["off", "draft", "eagle3"]
            .into_iter()
            .zip(["kv", "draft", "eagle3"])
            .map(|(spec, name)| PhaseSetup {
                name: name.to_owned(),
                router: "kv_load".to_owned(),
                spec_decode: spec.to_owned(),
            })
            .collect()
    }

    fn workers(&self) -> Vec<(String, String)> {
        self.endpoints.lock().unwrap().clone()
    }

    fn switch(&self, phase: &str) -> BoxFuture<'_, Result<Switched, String>> {
        let phase = phase.to_owned();
        Box::pin(async move {
            if phase == "draft" {
                let workers = self.endpoints.lock().unwrap().clone();
                let running = if workers.iter().any(|(n, _)| n == "worker-0") {
                    "kv"
                } else {
                    "eagle3"
                };
                return Ok(Switched {
                    phase: running.to_owned(),
                    workers,
                    error: Some(format!(
                        "no draft model on this GPU; phase {running} runs again"
                    )),
                });
            }
            let spec = (phase == "eagle3").then_some("eagle3");
            let mut engines = self.engines.lock().await;
            for (id, engine) in engines.drain(..) {
                self.gateway.remove_worker(kv_index::WorkerId(id));
                engine.shutdown().await;
            }
            let id = self
                .next_id
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let engine = common::engine_with_spec(id, SPEEDUP, &format!("worker-{id}"), spec).await;
            self.gateway
                .add_worker(&gateway::WorkerSpec::new(engine.url()))
                .await
                .map_err(|e| e.to_string())?;
            engines.push((id, engine));
            let workers = endpoints(&engines);
            *self.endpoints.lock().unwrap() = workers.clone();
            Ok(Switched {
                phase,
                workers,
                error: None,
            })
        })
    }
}

/// Seed 003's ladder stepped from the dashboard: the Phase panel shows the running phase and
/// its setup, a click on eagle3 switches it (the panel says so while it runs), the workers'
/// speculation cards appear, the charts mark the switch, and the status agrees.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_phase_buttons_switch_the_ladder_live() {
    let engine = common::engine(0, SPEEDUP, "worker-0").await;
    let gateway = common::gateway(std::slice::from_ref(&engine)).await;
    let mut lane = LaneSpec::for_gateway("kv_load", Some("kv_load"), &gateway.url(), MODEL);
    lane.worker_metrics = vec![format!("{}/metrics", engine.url())];
    let engines = vec![(0, engine)];
    let ladder = Arc::new(SwappingLadder {
        gateway,
        endpoints: std::sync::Mutex::new(endpoints(&engines)),
        engines: tokio::sync::Mutex::new(engines),
        next_id: std::sync::atomic::AtomicU64::new(1),
    });
    let mut config = loadgen_config(vec![lane], 4, SPEEDUP);
    config.autostart = true;
    config.ladder = Some(LadderConfig {
        ladder: ladder.clone(),
        initial: "kv".to_owned(),
    });
    let loadgen = Loadgen::bind(config).await.unwrap();
    let url = loadgen.url();

    let driver = ChromeDriver::start();
    let browser = driver.browser().await;
    browser.goto(&url).await.unwrap();
    wait_until("the phase panel", Duration::from_secs(10), async || {
        shown(&browser, "ladder-panel").await && text(&browser, "ladder-phase").await == "kv"
    })
    .await;
    assert!(classes(&browser, "phase-kv").await.contains("active"));
    assert!(!classes(&browser, "phase-eagle3").await.contains("active"));
    assert_eq!(
        text(&browser, "ladder-setup").await,
        "router kv_load · speculative decoding off"
    );
    // Plain decoding: no speculation cards.
    wait_until("turns at phase kv", Duration::from_secs(60), async || {
        api(&format!("{url}/api/status")).await["lanes"][0]["metrics"]["requests"]
            .as_u64()
            .unwrap_or(0)
            > 0
    })
    .await;
    assert!(browser.find(id("kpi-acceptance")).await.is_err());

    // A phase that cannot start: the panel says why, the previous phase is still shown.
    click(&browser, "phase-draft").await;
    wait_until("the switch's error", Duration::from_secs(30), async || {
        shown(&browser, "ladder-error").await
            && text(&browser, "ladder-error")
                .await
                .contains("no draft model")
    })
    .await;
    assert_eq!(text(&browser, "ladder-phase").await, "kv");
    let status = api(&format!("{url}/api/status")).await;
    assert_eq!(status["ladder"]["phase"], "kv", "{status}");
    assert!(
        status["ladder"]["error"]
            .as_str()
            .is_some_and(|e| e.starts_with("switching to draft: no draft model")),
        "{status}"
    );
    assert_eq!(status["running"], true, "the workload goes on at phase kv");

    click(&browser, "phase-eagle3").await;
    wait_until("phase eagle3 shown", Duration::from_secs(30), async || {
        text(&browser, "ladder-phase").await == "eagle3"
            && classes(&browser, "phase-eagle3").await.contains("active")
    })
    .await;
    assert!(!classes(&browser, "phase-kv").await.contains("active"));
    // A successful switch clears the error.
    wait_until("the error cleared", Duration::from_secs(10), async || {
        !shown(&browser, "ladder-error").await
    })
    .await;
    let status = api(&format!("{url}/api/status")).await;
    assert_eq!(status["ladder"]["phase"], "eagle3", "{status}");
    assert_eq!(status["running"], true);
    assert_eq!(status["ladder"]["workers"][0]["name"], "worker-1");
    wait_until(
        "the speculation cards",
        Duration::from_secs(90),
        async || text(&browser, "kpi-acceptance").await.ends_with('%'),
    )
    .await;
    // The switch is a marker on the charts once a point after it is drawn.
    wait_until("the switch's marker", Duration::from_secs(30), async || {
        attrs(
            &browser,
            "[data-testid=chart-itl] line.event-marker",
            "data-event",
        )
        .await
        .iter()
        .any(|e| e == "\u{2192} eagle3")
    })
    .await;
    browser.close().await.unwrap();
    loadgen.shutdown().await;
    let ladder = Arc::into_inner(ladder);
    if let Some(ladder) = ladder {
        ladder.gateway.shutdown().await;
    }
}
