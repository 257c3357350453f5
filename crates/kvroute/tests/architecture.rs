//! The cores' architecture invariant, checked mechanically: the sans-IO crates never depend,
//! directly or through another crate, on an async runtime, a socket library or a server stack.
//! (Their `clippy.toml` forbids the clock, threads, files and sockets of `std`; CI runs clippy.)

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

use serde_json::Value;

/// The sans-IO cores (docs/ARCHITECTURE.md).
const CORES: [&str; 9] = [
    "nanotime",
    "worker-limits",
    "kv-index",
    "router",
    "engine",
    "text",
    "workload",
    "sim",
    "report",
];

/// Crates that mean I/O or a runtime: none may be a normal (non-dev) dependency of a core.
const FORBIDDEN: [&str; 14] = [
    "tokio",
    "mio",
    "socket2",
    "hyper",
    "axum",
    "reqwest",
    "async-nats",
    "zeromq",
    "tokio-util",
    "futures-executor",
    "async-std",
    "smol",
    "tracing",
    "prometheus-client",
];

/// Package id → (name, ids of its normal dependencies).
type Graph = BTreeMap<String, (String, Vec<String>)>;
/// Workspace member name → package id.
type Members = BTreeMap<String, String>;

/// `cargo metadata`'s resolve graph: package id → (name, normal dependencies' ids).
fn normal_graph() -> (Graph, Members) {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    // This machine's platform only: the resolve then needs no other platform's crates
    // (Windows-only ones are not downloaded here).
    let rustc = Command::new("rustc")
        .arg("-vV")
        .output()
        .expect("rustc -vV runs");
    let rustc = String::from_utf8_lossy(&rustc.stdout);
    let host = rustc
        .lines()
        .find_map(|l| l.strip_prefix("host: "))
        .expect("rustc -vV names the host");
    let out = Command::new(cargo)
        .args(["metadata", "--format-version", "1", "--offline"])
        .args(["--filter-platform", host])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo metadata runs");
    assert!(
        out.status.success(),
        "cargo metadata failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: Value = serde_json::from_slice(&out.stdout).expect("cargo metadata prints JSON");
    let names: BTreeMap<String, String> = meta["packages"]
        .as_array()
        .expect("packages")
        .iter()
        .map(|p| {
            (
                p["id"].as_str().unwrap_or_default().to_string(),
                p["name"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect();
    let mut graph = BTreeMap::new();
    let mut workspace = BTreeMap::new();
    for node in meta["resolve"]["nodes"].as_array().expect("resolve nodes") {
        let id = node["id"].as_str().unwrap_or_default().to_string();
        let deps = node["deps"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|d| {
                d["dep_kinds"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|k| k["kind"].is_null())
            })
            .filter_map(|d| d["pkg"].as_str().map(str::to_string))
            .collect();
        let name = names.get(&id).cloned().unwrap_or_default();
        graph.insert(id.clone(), (name, deps));
    }
    for member in meta["workspace_members"].as_array().expect("members") {
        let id = member.as_str().unwrap_or_default().to_string();
        if let Some(name) = names.get(&id) {
            workspace.insert(name.clone(), id);
        }
    }
    (graph, workspace)
}

#[test]
fn cores_depend_on_no_runtime_socket_or_server_crate() {
    let (graph, workspace) = normal_graph();
    let mut checked = 0;
    for core in CORES {
        let Some(root) = workspace.get(core) else {
            continue;
        };
        checked += 1;
        let mut seen = BTreeSet::new();
        let mut stack = vec![(root.clone(), vec![core.to_string()])];
        while let Some((id, path)) = stack.pop() {
            let Some((_, deps)) = graph.get(&id) else {
                continue;
            };
            for dep in deps {
                if !seen.insert(dep.clone()) {
                    continue;
                }
                let name = graph.get(dep).map(|n| n.0.clone()).unwrap_or_default();
                let mut through = path.clone();
                through.push(name.clone());
                assert!(
                    !FORBIDDEN.contains(&name.as_str()),
                    "the core `{core}` depends on `{name}` ({}): cores are sans-IO; move the \
                     I/O into a driver crate",
                    through.join(" → ")
                );
                stack.push((dep.clone(), through));
            }
        }
    }
    assert!(
        checked == CORES.len(),
        "the cores were not found in the workspace ({checked})"
    );
}

#[test]
fn every_core_has_the_sans_io_clippy_configuration() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    for core in CORES {
        let dir = root.join(core);
        if !dir.exists() {
            continue;
        }
        let config = std::fs::read_to_string(dir.join("clippy.toml"))
            .unwrap_or_else(|e| panic!("crates/{core}/clippy.toml: {e}"));
        for needle in [
            "std::time::Instant::now",
            "std::thread::spawn",
            "std::fs::File",
        ] {
            assert!(
                config.contains(needle),
                "crates/{core}/clippy.toml does not forbid {needle}"
            );
        }
    }
}
