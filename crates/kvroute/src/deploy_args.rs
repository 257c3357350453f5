//! Every `kvroute` command line in the rendered Kubernetes manifests (`deploy/k8s`, base and
//! overlays) goes through this binary's own parser, `Cli::try_parse_from`, and the engine's
//! and gateway's settings checks, so that a renamed or removed flag breaks `cargo test`, not
//! a cluster. Lives in the binary because `Cli` is private to it. Without `kubectl` (with
//! kustomize built in) the tests print why and pass.

use std::path::{Path, PathBuf};
use std::process::Command as Process;

use clap::Parser;
use serde::Deserialize;
use serde_json::Value;

use crate::{Cli, Command, engine_cmd, gateway_cmd};

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The rendered objects of the base and every overlay, or None when kubectl is missing.
fn rendered() -> Option<Vec<(String, Vec<Value>)>> {
    let k8s = repo_root().join("deploy/k8s");
    let mut dirs = vec![k8s.join("base")];
    let mut overlays: Vec<PathBuf> = std::fs::read_dir(k8s.join("overlays"))
        .expect("deploy/k8s/overlays")
        .map(|e| e.expect("a directory entry").path())
        .collect();
    overlays.sort();
    dirs.extend(overlays);
    let mut out = Vec::new();
    for dir in dirs {
        let output = match Process::new("kubectl").arg("kustomize").arg(&dir).output() {
            Ok(output) => output,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                println!("SKIPPED: kubectl is not installed, so deploy/k8s cannot be rendered");
                return None;
            }
            Err(e) => panic!("running kubectl: {e}"),
        };
        assert!(
            output.status.success(),
            "kubectl kustomize {}: {}",
            dir.display(),
            String::from_utf8_lossy(&output.stderr)
        );
        let yaml = String::from_utf8(output.stdout).expect("UTF-8");
        let objects = serde_yaml_ng::Deserializer::from_str(&yaml)
            .map(|doc| Value::deserialize(doc).expect("rendered YAML parses"))
            .filter(|v| !v.is_null())
            .collect();
        out.push((dir.display().to_string(), objects));
    }
    Some(out)
}

/// What the kubelet puts in `$(VAR)` for the downward API fields the manifests use.
fn field_sample(path: &str) -> &'static str {
    match path {
        "metadata.name" => "engine-0",
        "metadata.namespace" => "kvroute",
        "status.podIP" => "10.244.0.17",
        "metadata.labels['apps.kubernetes.io/pod-index']" => "0",
        other => panic!("add a sample value for the downward API field {other}"),
    }
}

/// A container's argv as the kubelet runs it: command + args with `$(VAR)` expanded from its
/// env.
fn argv(container: &Value) -> Vec<String> {
    let mut vars = Vec::new();
    for env in container["env"].as_array().into_iter().flatten() {
        let name = env["name"].as_str().expect("env name").to_owned();
        let from = &env["valueFrom"];
        let value = if let Some(v) = env["value"].as_str() {
            v.to_owned()
        } else if let Some(secret) = from["secretKeyRef"]["name"].as_str() {
            // A Secret's value is not in the manifests; what a flag gets is a stand-in.
            format!("secret-{secret}")
        } else {
            field_sample(from["fieldRef"]["fieldPath"].as_str().unwrap_or_else(|| {
                panic!("env {name}: only value, fieldRef and secretKeyRef are used")
            }))
            .to_owned()
        };
        vars.push((name, value));
    }
    let words = |key: &str| -> Vec<String> {
        container[key]
            .as_array()
            .into_iter()
            .flatten()
            .map(|w| w.as_str().expect("a string").to_owned())
            .collect()
    };
    let mut argv = words("command");
    argv.extend(words("args"));
    for word in &mut argv {
        for (name, value) in &vars {
            *word = word.replace(&format!("$({name})"), value);
        }
    }
    argv
}

/// The names of a container's environment variables.
fn env_names(container: &Value) -> Vec<String> {
    container["env"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|env| env["name"].as_str().map(str::to_owned))
        .collect()
}

/// A container running the kvroute image: where it is, its argv, its environment's names.
type KvrouteContainer = (String, Vec<String>, Vec<String>);

/// Every container running the kvroute image.
fn kvroute_containers() -> Option<Vec<KvrouteContainer>> {
    let mut out = Vec::new();
    for (dir, objects) in rendered()? {
        for object in &objects {
            let spec = &object["spec"]["template"]["spec"];
            for container in spec["containers"].as_array().into_iter().flatten() {
                let image = container["image"].as_str().expect("an image");
                let name = image.rsplit('/').next().unwrap_or(image);
                if name.split(':').next() == Some("kvroute") {
                    let place = format!(
                        "{dir}: {} {}",
                        object["kind"].as_str().unwrap_or("?"),
                        object["metadata"]["name"].as_str().unwrap_or("?")
                    );
                    out.push((place, argv(container), env_names(container)));
                }
            }
        }
    }
    Some(out)
}

#[test]
fn deploy_every_kvroute_command_line_parses_and_configures() {
    let Some(containers) = kvroute_containers() else {
        return;
    };
    // base: engine, gateway, loadgen; disagg: two engine pools, gateway, loadgen; vllm and
    // doks: gateway, loadgen.
    assert!(containers.len() >= 11, "{containers:?}");
    let mut seen = std::collections::BTreeSet::new();
    for (place, argv, env) in &containers {
        assert_eq!(argv.first().map(String::as_str), Some("kvroute"), "{place}");
        let cli = Cli::try_parse_from(argv)
            .unwrap_or_else(|e| panic!("{place}: `{}` does not parse:\n{e}", argv.join(" ")));
        // Beyond flags: the values must make a working configuration.
        match cli.command {
            Command::Engine(args) => {
                engine_cmd::config(&args).unwrap_or_else(|e| panic!("{place}: {e:#}"));
                seen.insert("engine");
            }
            Command::Gateway(args) => {
                gateway_cmd::config(&args).unwrap_or_else(|e| panic!("{place}: {e:#}"));
                seen.insert("gateway");
            }
            Command::Loadgen(_) => {
                // Off loopback the load generator refuses to start without an API token: the
                // manifest must give it one.
                let off_loopback = argv
                    .iter()
                    .any(|w| w.starts_with("--host=") && w != "--host=127.0.0.1");
                let token = argv.iter().any(|w| w.starts_with("--api-token"))
                    || env.iter().any(|name| name == "KVROUTE_API_TOKEN");
                assert!(
                    !off_loopback || token,
                    "{place}: the load generator binds off loopback without an API token"
                );
                seen.insert("loadgen");
            }
            other => panic!("{place}: unexpected subcommand {other:?}"),
        }
    }
    assert_eq!(
        seen.into_iter().collect::<Vec<_>>(),
        ["engine", "gateway", "loadgen"]
    );
}

#[test]
fn deploy_a_renamed_flag_fails_the_check() {
    let Some(containers) = kvroute_containers() else {
        return;
    };
    let (place, argv, _) = containers
        .iter()
        .find(|(_, argv, _)| argv.get(1).is_some_and(|s| s == "gateway"))
        .expect("a gateway container");
    let renamed: Vec<String> = argv
        .iter()
        .map(|w| w.replace("--router-mode=", "--routing-mode="))
        .collect();
    assert_ne!(&renamed, argv, "{place} sets --router-mode");
    assert!(Cli::try_parse_from(&renamed).is_err());
}
