//! Errors at start-up, as a new user meets them: each reason printed once (not once by the
//! error and again by its source), naming the flag to change, and bad flags refused before
//! anything starts or prints.

use std::net::TcpListener;

mod common;

use common::{Server, failure, kvroute};

/// `text` occurs exactly once in `stderr`.
fn once(stderr: &str, text: &str) {
    assert_eq!(
        stderr.matches(text).count(),
        1,
        "{text:?} should be printed exactly once:\n{stderr}"
    );
}

/// `kvroute ARGS` fails without printing anything on stdout (nothing started), and its
/// stderr, returned, says `message` once.
fn refused_up_front(args: &[&str], message: &str) -> String {
    let out = kvroute().args(args).output().expect("kvroute runs");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{args:?} should fail: {stderr}");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "",
        "{args:?} started something before refusing: {stderr}"
    );
    once(&stderr, message);
    stderr
}

#[test]
fn a_port_in_use_is_reported_once_with_the_flag_that_moves_it() {
    let taken = TcpListener::bind("127.0.0.1:0").expect("a free port");
    let addr = taken.local_addr().expect("its address");
    let port = addr.port().to_string();
    // What the system says about binding a port in use, in its own words.
    let reason = TcpListener::bind(addr)
        .expect_err("the port is taken")
        .to_string();
    let cases: [(&[&str], &str); 4] = [
        (&["engine", "--port", &port], "with --port"),
        (&["gateway", "--port", &port], "with --port"),
        (
            &[
                "demo",
                "--gateway-port",
                &port,
                "--port",
                "0",
                "--no-baseline",
                "--no-phase-reference",
            ],
            "with --gateway-port",
        ),
        (
            &[
                "demo",
                "--port",
                &port,
                "--gateway-port",
                "0",
                "--no-baseline",
                "--no-phase-reference",
            ],
            "with --port",
        ),
    ];
    for (args, flag) in cases {
        let stderr = failure(args);
        once(&stderr, &reason);
        once(&stderr, &format!("cannot listen on {addr}"));
        assert!(
            stderr.contains("another process is listening there") && stderr.contains(flag),
            "{args:?} should say to pick another port {flag}: {stderr}"
        );
    }
}

#[test]
fn an_unknown_profile_is_named_once_with_the_known_ones() {
    let stderr = failure(&["engine", "--profile", "nope"]);
    once(&stderr, "\"nope\"");
    once(&stderr, "h200-llama70b-fp8");
    assert!(
        stderr.contains("--profile-file") && stderr.contains("kvroute profiles"),
        "{stderr}"
    );
}

#[test]
fn zero_sizes_are_refused_in_the_flags_name_once() {
    for (flag, what) in [
        ("--block-size", "tokens per KV block"),
        ("--max-num-seqs", "sequences in a batch"),
        ("--num-gpu-blocks", "blocks in the KV pool"),
        // Accepted before, then every request was refused with 429.
        ("--max-waiting", "requests waiting for admission"),
    ] {
        let stderr = failure(&["engine", flag, "0", "--port", "0"]);
        once(&stderr, &format!("{flag} must be at least 1"));
        once(&stderr, "must be at least 1");
        assert!(stderr.contains(what), "{flag}: {stderr}");
        // The engine's own field names are not what the user typed.
        assert!(!stderr.contains("num_gpu_blocks_override"), "{stderr}");
    }
}

#[test]
fn a_profile_file_with_a_toml_error_shows_the_error_once() {
    let dir = std::env::temp_dir().join(format!("kvroute-startup-errors-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let file = dir.join("bad.toml");
    std::fs::write(&file, "name = \"mine\"\n[[[broken\n").expect("profile written");
    let path = file.to_str().expect("UTF-8 path");
    for args in [
        &["profiles", "check", path][..],
        &["engine", "--profile-file", path, "--port", "0"][..],
    ] {
        let stderr = failure(args);
        once(&stderr, "TOML parse error at line 2");
        once(&stderr, "[[[broken");
        once(&stderr, path);
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn workers_the_gateway_refuses_are_explained_once() {
    let engines: Vec<Server> = (0..2)
        .map(|_| Server::start(&["engine", "--port", "0", "--worker-id", "1"]))
        .collect();
    let stderr = failure(&[
        "gateway",
        "--port",
        "0",
        "--worker",
        &engines[0].url,
        "--worker",
        &engines[1].url,
    ]);
    once(&stderr, "is already registered at");
    once(&stderr, "Give each worker its own id");
    let stderr = failure(&[
        "gateway",
        "--port",
        "0",
        "--worker",
        &engines[0].url,
        "--kv-block-size",
        "16",
    ]);
    once(&stderr, "uses KV blocks of 32 tokens");
    once(&stderr, "set --kv-block-size to match the workers");
}

#[test]
fn negative_values_written_with_a_space_reach_the_flags_own_check() {
    for (args, message) in [
        (
            &["demo", "--speedup", "-1"][..],
            "--speedup must be a positive number",
        ),
        (
            &["engine", "--speedup", "-1"][..],
            "--speedup must be a positive number",
        ),
        (
            &[
                "sim",
                "--trace",
                "/nonexistent.jsonl",
                "--trace-speed",
                "-1",
            ][..],
            "expected a speed factor greater than 0",
        ),
        (&["demo", "--think-time", "-1"][..], "--think-time must be"),
    ] {
        let stderr = failure(args);
        assert!(
            !stderr.contains("unexpected argument"),
            "{args:?}: {stderr}"
        );
        once(&stderr, message);
    }
}

#[test]
fn demo_refuses_bad_flags_before_starting_anything() {
    refused_up_front(
        &["demo", "--concurrency", "0"],
        "--concurrency must be between 1 and",
    );
    // Before the 2 s simulated baseline, which would print its line first.
    refused_up_front(
        &["demo", "--speedup", "0"],
        "--speedup must be a positive number",
    );
    let stderr = refused_up_front(
        &["demo", "--port", "8080", "--gateway-port", "8080"],
        "port 8080 is given twice",
    );
    assert!(
        stderr.contains("--port") && stderr.contains("--gateway-port"),
        "{stderr}"
    );
    // --compare's second gateway takes the next port.
    let stderr = refused_up_front(
        &[
            "demo",
            "--compare",
            "round_robin,kv",
            "--gateway-port",
            "8000",
            "--port",
            "8001",
        ],
        "port 8001 is given twice",
    );
    assert!(stderr.contains("--compare"), "{stderr}");
}
