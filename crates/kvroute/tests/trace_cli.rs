//! Public trace replay as a user runs it: `kvroute sim --trace` on a slice of the shipped
//! Mooncake conversation trace (KV-aware routing beats round-robin, no run beats the trace's
//! oracle bound, same seed ⇒ same JSON), closed-loop sessions, and one clear error per bad
//! input; `kvroute loadgen --trace` against a gateway over real `kvroute engine` processes,
//! headless (`--json`) and under the dashboard (`/api/status`'s `trace`).

use std::io::BufRead;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

mod common;

use common::{Running, Server, assert_failures, engines, failure, http, stdout_of};

fn shipped() -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../traces/mooncake_conversation_trace.jsonl")
        .display()
        .to_string()
}

/// A file in the temp directory with `text`, for one test.
fn temp_file(name: &str, text: &str) -> String {
    let path = std::env::temp_dir().join(format!(
        "kvroute-trace-cli-{}-{name}.jsonl",
        std::process::id()
    ));
    std::fs::write(&path, text).unwrap();
    path.display().to_string()
}

/// `kvroute sim --trace` on the shipped trace's first 300 requests (102 s) on 8 workers.
fn replay(router: &str) -> serde_json::Value {
    replay_with(router, &[])
}

fn replay_with(router: &str, flags: &[&str]) -> serde_json::Value {
    let trace = shipped();
    let mut args = vec![
        "sim",
        "--trace",
        &trace,
        "--trace-limit",
        "300",
        "--workers",
        "8",
        "--router",
        router,
        "--seed",
        "3",
        "--json",
    ];
    args.extend_from_slice(flags);
    let out = stdout_of(&args);
    serde_json::from_str(&out).expect("--json prints JSON")
}

#[test]
fn kv_aware_routing_gets_closer_to_the_trace_bound_than_round_robin_and_never_past_it() {
    let rr = replay("round_robin");
    let kv_load = replay("kv_load");
    let kv = replay("kv");
    // The trace's own bound is a property of the slice, whatever the router.
    let bound = rr["trace"]["oracle_prefix_hit_rate"].as_f64().unwrap();
    assert!(bound > 0.05 && bound < 0.2, "{bound}");
    for (name, run) in [("round_robin", &rr), ("kv_load", &kv_load), ("kv", &kv)] {
        let t = &run["trace"];
        assert_eq!(t["oracle_prefix_hit_rate"].as_f64(), Some(bound), "{name}");
        assert_eq!(
            (t["requests"].as_u64(), t["issued"].as_u64()),
            (Some(300), Some(300))
        );
        assert_eq!(t["requests_in_file"], 12_031);
        assert_eq!(t["failed"], 0, "{name}");
        let hit = t["kv_hit_rate"].as_f64().unwrap();
        assert!(
            hit <= bound,
            "{name}: hit rate {hit} above the bound {bound}"
        );
        assert_eq!(
            run["summary"][0]["kv_hit_rate"].as_f64(),
            Some(hit),
            "{name}"
        );
    }
    // So is its ceiling: at most this many requests can meet seed 002's objectives.
    let within = rr["trace"]["within_objectives_alone"].as_u64().unwrap();
    assert!(within > 0 && within <= 300, "{within}");
    let load = rr["trace"]["least_prefill_load"].as_f64().unwrap();
    assert!(
        load > 0.0 && load < 1.0,
        "8 workers keep up with the slice: {load}"
    );
    for run in [&kv_load, &kv] {
        assert_eq!(
            run["trace"]["within_objectives_alone"].as_u64(),
            Some(within)
        );
        assert_eq!(run["trace"]["least_prefill_load"].as_f64(), Some(load));
    }
    let hit = |run: &serde_json::Value| run["trace"]["kv_hit_rate"].as_f64().unwrap();
    assert!(
        hit(&kv_load) > hit(&rr) && hit(&kv) > hit(&rr),
        "kv_load {} kv {} round_robin {}",
        hit(&kv_load),
        hit(&kv),
        hit(&rr)
    );
    // Same seed, same bytes.
    assert_eq!(replay("kv_load"), kv_load);
    // --no-ceiling skips the ceiling and changes nothing else.
    let mut without = replay_with("kv_load", &["--no-ceiling"]);
    let t = &mut without["trace"];
    assert_eq!(t["no_ceiling"], "not_asked", "{t}");
    for field in [
        "objectives",
        "within_objectives_alone",
        "least_prefill_load",
    ] {
        assert!(t[field].is_null(), "{field}: {t}");
        t[field] = kv_load["trace"][field].clone();
    }
    t.as_object_mut().map(|t| t.remove("no_ceiling"));
    assert_eq!(without, kv_load);
}

#[test]
fn sessions_follow_their_previous_request_and_every_request_finishes() {
    // Two sessions of three requests sharing a prefix, and one open-loop request.
    let mut lines = Vec::new();
    for (t, session, ids) in [
        (0, "a", "[1, 2]"),
        (0, "b", "[1, 3]"),
        (100, "a", "[1, 2, 4]"),
        (100, "b", "[1, 3, 5]"),
        (200, "a", "[1, 2, 4, 6]"),
        (200, "b", "[1, 3, 5, 7]"),
    ] {
        let n = ids.matches(',').count() + 1;
        let delay = if t == 0 { "" } else { ", \"delay\": 500" };
        lines.push(format!(
            "{{\"timestamp\": {t}, \"input_length\": {}, \"output_length\": 20, \
             \"hash_ids\": {ids}, \"session_id\": \"{session}\"{delay}}}",
            n * 512
        ));
    }
    lines.push(
        "{\"timestamp\": 300, \"input_length\": 100, \"output_length\": 5, \"hash_ids\": [9]}"
            .into(),
    );
    let file = temp_file("sessions", &lines.join("\n"));
    let out = stdout_of(&["sim", "--trace", &file, "--router", "kv_load", "--json"]);
    let run: serde_json::Value = serde_json::from_str(&out).unwrap();
    let t = &run["trace"];
    assert_eq!(
        (t["issued"].as_u64(), t["finished"].as_u64()),
        (Some(7), Some(7))
    );
    // Each session's later requests reuse its earlier prompt: the bound and the run agree
    // that most of it was reusable.
    let bound = t["oracle_prefix_hit_rate"].as_f64().unwrap();
    let hit = t["kv_hit_rate"].as_f64().unwrap();
    assert!(
        bound > 0.5 && hit > 0.5 && hit <= bound,
        "hit {hit} bound {bound}"
    );
    // Turns 2+ of the sessions are reported apart from first turns.
    assert!(
        run["summary"][0]["ttft_later_ms"]["p50"].is_number(),
        "{run}"
    );
    // No ceiling: a session's request goes out when its previous one ends, so the order of
    // requests depends on the run.
    assert!(t["within_objectives_alone"].is_null(), "{t}");
    assert_eq!(t["no_ceiling"], "sessions", "{t}");
    let text = stdout_of(&["sim", "--trace", &file, "--router", "kv_load"]);
    assert!(
        text.contains("no ceiling for a trace with sessions"),
        "{text}"
    );
}

#[test]
fn bad_traces_and_flags_get_one_clear_error() {
    let good = "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 2, \"hash_ids\": [1]}";
    let bad_line = temp_file(
        "bad-line",
        &format!("{good}\n{good}\n{{\"timestamp\": 5, \"input_length\": -3}}\n"),
    );
    let stderr = failure(&["sim", "--trace", &bad_line]);
    assert!(
        stderr.contains(&format!(
            "--trace {bad_line}: trace line 3: `input_length` is negative"
        )),
        "{stderr}"
    );
    assert_eq!(stderr.matches("line 3").count(), 1, "said once: {stderr}");
    assert_eq!(stderr.lines().count(), 1, "one line: {stderr}");
    // The dashboard's replay refuses it too, before it listens (nothing on stdout).
    let out = common::kvroute()
        .args(["loadgen", "--target", "http://127.0.0.1:9", "--port", "0"])
        .args(["--trace", &bad_line])
        .output()
        .expect("kvroute runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains(&format!(
            "--trace {bad_line}: trace line 3: `input_length` is negative"
        )),
        "{stderr}"
    );
    assert_eq!(stderr.lines().count(), 1, "one line: {stderr}");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "", "nothing started");
    let empty = temp_file("empty", "\n\n");
    let trace = shipped();
    assert_failures(&[
        (&["sim", "--trace", &empty], "the trace has no requests"),
        (
            &["sim", "--trace", "/nonexistent/trace.jsonl"],
            "--trace: cannot read /nonexistent/trace.jsonl",
        ),
        (
            &["sim", "--trace", &trace, "--trace-speed", "0"],
            "expected a speed factor greater than 0",
        ),
        (
            &["sim", "--trace", &trace, "--trace-speed", "fast"],
            "expected a speed factor greater than 0",
        ),
        (&["sim", "--trace-speed", "2"], "--trace <FILE>"),
        (
            &["sim", "--trace", &trace, "--trace-limit", "0"],
            "--trace-limit",
        ),
        (
            &["sim", "--trace", &trace, "--rate", "2"],
            "--trace brings its own requests",
        ),
        (
            &["sim", "--trace", &trace, "--scenario", "seed004"],
            "--trace and --scenario",
        ),
        (
            &[
                "loadgen",
                "--target",
                "http://127.0.0.1:9",
                "--trace",
                "/nonexistent/t.jsonl",
            ],
            "--trace: cannot read /nonexistent/t.jsonl",
        ),
        (
            &["loadgen", "--target", "http://127.0.0.1:9", "--headless"],
            "--trace <FILE>",
        ),
        (
            &[
                "loadgen",
                "--target",
                "http://127.0.0.1:9",
                "--trace",
                &trace,
                "--start",
                "--run-for",
                "10",
            ],
            "--run-for does not apply to a trace replay",
        ),
    ]);
}

#[test]
fn loadgen_replays_a_trace_against_real_engines_with_cache_hits_and_no_errors() {
    let engines = engines(2);
    let mut args = vec!["gateway", "--port", "0", "--health-interval", "0.2"];
    for e in &engines {
        args.extend(["--worker", e.url.as_str()]);
    }
    let gateway = Server::start(&args);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !http(gateway.addr(), "GET", "/health", "")
        .1
        .contains("\"routable_workers\":2")
    {
        assert!(
            std::time::Instant::now() < deadline,
            "workers never routable"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    // The trace's first 40 requests (12 s recorded) at 20×, as fast as the engines run.
    let trace = shipped();
    let out = stdout_of(&[
        "loadgen",
        "--target",
        &gateway.url,
        "--trace",
        &trace,
        "--trace-limit",
        "40",
        "--trace-speed",
        "20",
        "--json",
    ]);
    let status: serde_json::Value = serde_json::from_str(&out).expect("--json prints JSON");
    assert_eq!(status["requests"], 40, "{status}");
    assert_eq!(status["issued"], 40, "{status}");
    assert_eq!(status["finished"], 40, "{status}");
    assert_eq!(
        (&status["failed"], &status["dropped"]),
        (&0.into(), &0.into()),
        "{status}"
    );
    assert_eq!(status["errors"], serde_json::json!([]), "{status}");
    // Requests sharing leading hash ids reuse the engines' cached blocks: the server reports
    // cached prompt tokens, and every prompt had the record's length.
    assert!(status["cached_tokens"].as_u64().unwrap() > 0, "{status}");
    let records = std::fs::read_to_string(&trace).unwrap();
    let prompt_tokens: u64 = records
        .lines()
        .take(40)
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["input_length"]
                .as_u64()
                .unwrap()
        })
        .sum();
    assert_eq!(
        status["prompt_tokens"].as_u64(),
        Some(prompt_tokens),
        "{status}"
    );
    assert!(status["oracle_prefix_hit_rate"].as_f64().unwrap() > 0.0);
    assert_hit_within_its_bound(&status);
    // Every request finished with usage: the bound over them is the whole slice's.
    assert_eq!(status["usage_requests"], 40, "{status}");
    assert_eq!(
        status["oracle_hit_rate_finished"], status["oracle_prefix_hit_rate"],
        "{status}"
    );
    assert!(status["ttft_ms"]["p50"].is_number(), "{status}");
}

/// The server's prefix hits in a replay's status are within the oracle bound over the same
/// finished requests, whose prompts the server counted as the trace does.
fn assert_hit_within_its_bound(t: &serde_json::Value) {
    let n = |k: &str| {
        t[k].as_u64()
            .unwrap_or_else(|| panic!("no count `{k}` in {t}"))
    };
    assert!(n("usage_requests") <= n("finished"), "{t}");
    assert_eq!(n("prompt_tokens"), n("trace_input_tokens"), "{t}");
    assert!(
        n("cached_tokens") <= n("oracle_hit_tokens"),
        "the server reported more cached tokens than any cache could serve: {t}"
    );
    assert!(n("oracle_hit_tokens") <= n("trace_input_tokens"), "{t}");
    // A cold server is never reported as warm.
    assert_eq!(t["above_bound"], false, "{t}");
    if n("usage_requests") == 0 {
        assert!(t["kv_hit_rate"].is_null(), "{t}");
        assert!(t["oracle_hit_rate_finished"].is_null(), "{t}");
    } else {
        let hit = t["kv_hit_rate"].as_f64().expect("a hit rate");
        let bound = t["oracle_hit_rate_finished"].as_f64().expect("a bound");
        assert!(hit <= bound, "hit rate {hit} over its bound {bound}: {t}");
        assert_eq!(
            bound,
            n("oracle_hit_tokens") as f64 / n("trace_input_tokens") as f64,
            "{t}"
        );
    }
}

/// Two `kvroute engine`s behind a `kvroute gateway` whose workers are routable.
fn cluster() -> (Vec<Server>, Server) {
    let engines = engines(2);
    let mut args = vec!["gateway", "--port", "0", "--health-interval", "0.2"];
    for e in &engines {
        args.extend(["--worker", e.url.as_str()]);
    }
    let gateway = Server::start(&args);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !http(gateway.addr(), "GET", "/health", "")
        .1
        .contains("\"routable_workers\":2")
    {
        assert!(Instant::now() < deadline, "workers never routable");
        std::thread::sleep(Duration::from_millis(100));
    }
    (engines, gateway)
}

/// `GET /api/status` of the load generator at `addr`.
fn status(addr: &str) -> serde_json::Value {
    let (code, body) = http(addr, "GET", "/api/status", "");
    assert_eq!(code, 200, "{body}");
    serde_json::from_str(&body).expect("status JSON")
}

#[test]
fn loadgen_replays_a_trace_under_the_dashboard_and_reports_it_in_the_status() {
    let (_engines, gateway) = cluster();
    let trace = shipped();
    // The first 40 requests (12 s recorded) at 4×: about 3 s of schedule to watch.
    let mut loadgen = Running::spawn(
        &[
            "loadgen",
            "--target",
            &gateway.url,
            "--port",
            "0",
            "--trace",
            &trace,
            "--trace-limit",
            "40",
            "--trace-speed",
            "4",
            "--start",
        ],
        Stdio::inherit(),
    );
    let mut stdout = loadgen.take_stdout();
    let mut url = None;
    let mut said = String::new();
    for _ in 0..10 {
        let mut line = String::new();
        if stdout.read_line(&mut line).unwrap_or(0) == 0 {
            break;
        }
        if let Some(u) = line.trim().strip_prefix("kvroute loadgen: dashboard on ") {
            url = Some(u.to_owned());
        }
        said.push_str(&line);
        if line.contains("Ctrl-C stops") {
            break;
        }
    }
    let url = url.unwrap_or_else(|| panic!("no dashboard line in:\n{said}"));
    assert!(said.contains("oracle prefix-hit bound"), "{said}");
    assert!(said.contains("replaying now"), "{said}");
    let addr = url.trim_start_matches("http://").to_owned();

    // The bound is the slice's, as the workload crate computes it.
    let bytes = std::fs::read(&trace).unwrap();
    let bound = workload::Trace::parse_bytes(&bytes)
        .unwrap()
        .first(40)
        .unwrap()
        .oracle_prefix_hit_rate();

    // Progress while it runs: some sent, not all ended.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut saw_progress = false;
    let last = loop {
        let s = status(&addr);
        let t = &s["trace"];
        assert_eq!(t["requests"], 40, "{t}");
        assert_eq!(t["requests_in_file"], 12_031, "{t}");
        assert_eq!(t["oracle_prefix_hit_rate"].as_f64(), Some(bound), "{t}");
        assert_eq!(t["speed"].as_f64(), Some(4.0), "{t}");
        // Whenever it is read, mid-replay included.
        assert_hit_within_its_bound(t);
        if t["state"] == "running" {
            assert_eq!(s["running"], true, "{s}");
            let issued = t["issued"].as_u64().unwrap();
            let ended = ["finished", "failed", "dropped"]
                .iter()
                .map(|k| t[k].as_u64().unwrap())
                .sum::<u64>();
            assert_eq!(ended + t["in_flight"].as_u64().unwrap(), issued, "{t}");
            saw_progress |= issued > 0 && ended < 40;
        }
        if t["state"] == "finished" {
            break s;
        }
        assert!(Instant::now() < deadline, "the replay never finished: {t}");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(saw_progress, "no progress seen while running");
    // The terminal gets the summary too, as a headless replay prints it.
    let mut line = String::new();
    while !line.starts_with("trace ") {
        line.clear();
        assert!(stdout.read_line(&mut line).unwrap() > 0, "no summary line");
    }
    assert!(line.contains("40 of 40 requests sent"), "{line}");
    assert!(line.contains("40 finished, 0 failed, 0 dropped"), "{line}");
    line.clear();
    stdout.read_line(&mut line).unwrap();
    let whole = format!("the whole trace's oracle bound {:.1}%", bound * 100.0);
    assert!(
        line.contains(&format!(
            "of a possible {:.1}% on the 40 requests that reported it; {whole}",
            bound * 100.0
        )),
        "{line}"
    );
    let t = &last["trace"];
    // Every request of the slice sent, and each ended once.
    assert_eq!(t["issued"], 40, "{t}");
    let (finished, failed, dropped) = (
        t["finished"].as_u64().unwrap(),
        t["failed"].as_u64().unwrap(),
        t["dropped"].as_u64().unwrap(),
    );
    assert_eq!(finished + failed + dropped, 40, "{t}");
    assert_eq!((failed, dropped, finished), (0, 0, 40), "{t}");
    assert_eq!(
        (&t["in_flight"], &t["cancelled"]),
        (&0.into(), &0.into()),
        "{t}"
    );
    assert_eq!(t["trace_time_s"], t["trace_duration_s"], "{t}");
    assert!(t["eta_s"].is_null(), "{t}");
    assert!(t["lateness_ms"]["p95"].is_number(), "{t}");
    assert!(t["ttft_ms"]["p50"].is_number(), "{t}");
    // The server reported cached prompt tokens, never above what any cache could serve; with
    // every request finished, the bound over them is the whole slice's.
    let hit = t["kv_hit_rate"].as_f64().expect("a hit rate");
    assert!(
        hit > 0.0 && hit <= bound,
        "hit rate {hit}, bound {bound}: {t}"
    );
    assert_eq!(t["usage_requests"], 40, "{t}");
    assert_eq!(t["oracle_hit_rate_finished"].as_f64(), Some(bound), "{t}");
    assert_eq!(last["running"], false, "{last}");
    // The usual cards were fed from the same requests.
    assert_eq!(last["lanes"][0]["metrics"]["requests"], 40, "{last}");
    assert_eq!(last["lanes"][0]["metrics"]["errors"], 0, "{last}");
    // The chat workload's shape does not apply; Stop has nothing to stop.
    let (code, body) = http(&addr, "POST", "/api/workload/config", "{\"rate\": 2}");
    assert_eq!(code, 409, "{body}");
    assert!(body.contains("trace_replay"), "{body}");
    let (code, body) = http(&addr, "POST", "/api/workload/stop", "");
    assert_eq!(code, 409, "{body}");
    assert!(body.contains("not_running"), "{body}");
    let exit = loadgen.stop(libc::SIGINT, Duration::from_secs(20));
    assert!(exit.success(), "{exit}");
}

/// A replay that ends with requests still running says so beside its figures, which cover
/// only the finished ones; one where every request finished does not.
#[test]
fn a_replay_that_ends_with_requests_running_says_its_figures_cover_the_finished() {
    let trace = shipped();
    let overloaded = stdout_of(&[
        "sim",
        "--trace",
        &trace,
        "--trace-limit",
        "500",
        "--workers",
        "4",
    ]);
    let note = overloaded
        .lines()
        .find(|l| l.contains("still running when the run ended"))
        .unwrap_or_else(|| panic!("no note: {overloaded}"));
    assert!(note.contains("cover the"), "{note}");
    let served = stdout_of(&[
        "sim",
        "--trace",
        &trace,
        "--trace-limit",
        "50",
        "--workers",
        "8",
    ]);
    assert!(
        !served.contains("still running when the run ended") && served.contains("(50 finished"),
        "{served}"
    );
}
