//! The Kubernetes manifests in `deploy/k8s/`, offline: `kubectl kustomize` renders the base
//! and every overlay, and every rendered object validates against the Kubernetes schemas
//! (PyPI `kubernetes-validate`, strict) and the CRD schemas vendored in
//! `deploy/k8s/schemas/` (KEDA, Gateway API), through `deploy/k8s/validate.py`, and the KEDA
//! and Gateway API objects against the upstream schemas (npm's kubernetes-models, through
//! `deploy/k8s/crd-check/validate.mjs`). The
//! containers' `kvroute` command lines are checked by the binary's own parser, in
//! `src/deploy_args.rs`.
//!
//! Without `kubectl` (with kustomize built in) the tests print why and pass; CI's machine has
//! it. `kubernetes-validate` is installed by `.ci/run`.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde::Deserialize;
use serde_json::Value;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The base and every overlay, as paths under deploy/k8s.
fn kustomizations() -> Vec<PathBuf> {
    let k8s = repo_root().join("deploy/k8s");
    let mut dirs = vec![k8s.join("base")];
    let mut overlays: Vec<PathBuf> = std::fs::read_dir(k8s.join("overlays"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("kustomization.yaml").exists())
        .collect();
    overlays.sort();
    let names: Vec<String> = overlays
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        names,
        ["disagg", "doks", "vllm"],
        "the overlays the docs describe"
    );
    dirs.extend(overlays);
    dirs
}

/// `kubectl kustomize DIR`, or None (with the reason printed) when kubectl is missing.
fn render(dir: &Path) -> Option<String> {
    let output = match Command::new("kubectl").arg("kustomize").arg(dir).output() {
        Ok(output) => output,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            println!("SKIPPED: kubectl is not installed, so deploy/k8s cannot be rendered here");
            return None;
        }
        Err(e) => panic!("running kubectl: {e}"),
    };
    assert!(
        output.status.success(),
        "kubectl kustomize {} failed:\n{}",
        dir.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    Some(String::from_utf8(output.stdout).unwrap())
}

fn objects(yaml: &str) -> Vec<Value> {
    serde_yaml_ng::Deserializer::from_str(yaml)
        .map(|doc| Value::deserialize(doc).expect("rendered YAML parses"))
        .filter(|v| !v.is_null())
        .collect()
}

fn find<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

const CLUSTER_SCOPED: [&str; 3] = ["Namespace", "PersistentVolume", "RuntimeClass"];

#[test]
fn every_overlay_renders_into_one_namespace_with_pinned_images() {
    for dir in kustomizations() {
        let Some(yaml) = render(&dir) else { return };
        let objects = objects(&yaml);
        let name = dir.display();
        assert!(objects.len() >= 15, "{name}: {} objects", objects.len());
        for o in &objects {
            let kind = o["kind"].as_str().unwrap();
            let ns = &o["metadata"]["namespace"];
            if CLUSTER_SCOPED.contains(&kind) {
                assert!(ns.is_null(), "{name}: {kind} is cluster-scoped");
            } else {
                assert_eq!(ns, "kvroute", "{name}: {kind} {}", o["metadata"]["name"]);
            }
            let spec = &o["spec"]["template"]["spec"];
            for c in spec["containers"].as_array().into_iter().flatten() {
                // Every image comes through a kustomize image entry, with a tag.
                let image = c["image"].as_str().unwrap();
                let tag = image.rsplit('/').next().unwrap().split_once(':');
                assert!(
                    tag.is_some_and(|(_, t)| t != "latest"),
                    "{name}: image {image} needs a pinned tag from a kustomize image entry"
                );
            }
        }
        for (kind, object) in [
            ("Deployment", "gateway"),
            ("Deployment", "loadgen"),
            ("Deployment", "nats"),
            ("Deployment", "prometheus"),
            ("Service", "gateway"),
        ] {
            find(&objects, kind, object);
        }
        // The dashboards and the Prometheus configuration ship as the files in deploy/.
        for file in ["kvroute-demo.json", "kvroute-scaling.json"] {
            let stem = file.trim_end_matches(".json");
            let cm = find(&objects, "ConfigMap", &format!("grafana-dashboard-{stem}"));
            assert_eq!(cm["metadata"]["labels"]["grafana_dashboard"], "1");
            let shipped =
                std::fs::read_to_string(repo_root().join("deploy/grafana").join(file)).unwrap();
            assert_eq!(cm["data"][file], shipped.as_str());
        }
        let prometheus = objects
            .iter()
            .find(|o| {
                o["kind"] == "ConfigMap"
                    && o["metadata"]["name"]
                        .as_str()
                        .unwrap()
                        .starts_with("prometheus-config")
            })
            .expect("the Prometheus ConfigMap");
        let shipped =
            std::fs::read_to_string(repo_root().join("deploy/prometheus/kubernetes.yml")).unwrap();
        assert_eq!(prometheus["data"]["prometheus.yml"], shipped.as_str());
    }
}

#[test]
fn the_overlays_carry_what_they_promise() {
    let k8s = repo_root().join("deploy/k8s/overlays");
    let Some(vllm) = render(&k8s.join("vllm")) else {
        return;
    };
    let vllm = objects(&vllm);
    assert!(
        !vllm
            .iter()
            .any(|o| o["metadata"]["name"] == "engine" && o["kind"] == "StatefulSet"),
        "vllm replaces the simulated workers"
    );
    let worker = &find(&vllm, "StatefulSet", "vllm")["spec"]["template"]["spec"]["containers"][0];
    let args = worker["args"].to_string();
    assert!(args.contains("--enable-prefix-caching"), "{args}");
    assert!(args.contains("enable_kv_cache_events"), "{args}");
    let gateway = find(&vllm, "Deployment", "gateway")["spec"]["template"]["spec"]["containers"][0]
        ["args"]
        .to_string();
    assert!(gateway.contains("zmq=tcp://vllm-0.vllm:5557"), "{gateway}");

    let Some(doks) = render(&k8s.join("doks")) else {
        return;
    };
    let doks = objects(&doks);
    assert_eq!(find(&doks, "RuntimeClass", "nvidia")["handler"], "nvidia");
    for pool in ["prefill", "decode"] {
        let sts = find(&doks, "StatefulSet", &format!("vllm-{pool}"));
        let pod = &sts["spec"]["template"]["spec"];
        assert_eq!(pod["runtimeClassName"], "nvidia", "{pool}");
        assert_eq!(pod["tolerations"][0]["key"], "nvidia.com/gpu", "{pool}");
        let container = &pod["containers"][0];
        assert_eq!(container["resources"]["limits"]["nvidia.com/gpu"], "1");
        assert_eq!(container["volumeMounts"][0]["mountPath"], "/models");
        let args = container["args"].to_string();
        assert!(args.contains("NixlConnector"), "{pool}: {args}");
        assert!(args.contains("enable_kv_cache_events"), "{pool}: {args}");
    }
    assert!(
        !doks
            .iter()
            .any(|o| o["metadata"]["name"] == "vllm" && o["kind"] == "StatefulSet"),
        "doks replaces the aggregated pool by the two pools"
    );
    let gateway = find(&doks, "Deployment", "gateway")["spec"]["template"]["spec"]["containers"][0]
        ["args"]
        .to_string();
    assert!(
        gateway.contains("vllm-prefill-3.vllm-prefill:8000,id=3,role=prefill"),
        "{gateway}"
    );
    assert!(
        gateway.contains("vllm-decode-4.vllm-decode:8000,id=104,role=decode"),
        "{gateway}"
    );
    let claim = find(&doks, "PersistentVolumeClaim", "model-nfs-pvc");
    assert_eq!(claim["spec"]["volumeName"], "model-nfs-pv");
    assert!(find(&doks, "PersistentVolume", "model-nfs-pv")["spec"]["nfs"].is_object());
    find(&doks, "Gateway", "kvroute");
    find(&doks, "HTTPRoute", "kvroute");
    // One ScaledObject per pool, each on its own pool's signal, with seed 004's bounds.
    for (name, target, metric, max) in [
        ("prefill", "vllm-prefill", "time_to_first_token", 4),
        ("decode", "vllm-decode", "inter_token_latency", 5),
    ] {
        let scaler = find(&doks, "ScaledObject", name);
        assert_eq!(
            scaler["metadata"]["annotations"]["autoscaling.keda.sh/paused"],
            "false"
        );
        assert_eq!(scaler["spec"]["scaleTargetRef"]["name"], target);
        assert_eq!(scaler["spec"]["maxReplicaCount"], max);
        let triggers = scaler["spec"]["triggers"].as_array().unwrap();
        assert_eq!(triggers.len(), 1, "{name}");
        let query = triggers[0]["metadata"]["query"].as_str().unwrap();
        assert!(
            query.contains(&format!("dynamo_frontend_{metric}_seconds_bucket"))
                && query.contains(&format!("pool=\"{name}\"")),
            "{name}: {query}"
        );
    }

    let Some(disagg) = render(&k8s.join("disagg")) else {
        return;
    };
    let disagg = objects(&disagg);
    for (pool, replicas) in [("prefill", 1), ("decode", 2)] {
        let sts = find(&disagg, "StatefulSet", &format!("engine-{pool}"));
        assert_eq!(sts["spec"]["replicas"], replicas);
        let args = sts["spec"]["template"]["spec"]["containers"][0]["args"].to_string();
        assert!(args.contains(&format!("--role={pool}")), "{args}");
        assert!(
            !args.contains("--worker-id"),
            "ids must not collide: {args}"
        );
    }
    assert!(
        !disagg
            .iter()
            .any(|o| o["metadata"]["name"] == "engine" && o["kind"] == "StatefulSet"),
        "the pools replace the aggregated workers"
    );
}

/// The fields of vLLM's `KVEventsConfig` and `KVTransferConfig` (vllm/config/kv_events.py and
/// kv_transfer.py, read in vLLM 0.33.0): vLLM's parser rejects a JSON key outside them, so a
/// typo would stop every worker at start-up, on the cluster.
const VLLM_KV_EVENTS_FIELDS: [&str; 8] = [
    "enable_kv_cache_events",
    "publisher",
    "endpoint",
    "replay_endpoint",
    "buffer_steps",
    "hwm",
    "max_queue_size",
    "topic",
];
const VLLM_KV_TRANSFER_ROLES: [&str; 3] = ["kv_producer", "kv_consumer", "kv_both"];

/// The port of a ZMQ endpoint such as `tcp://*:5557`.
fn zmq_port(endpoint: &str) -> u64 {
    let port = endpoint.rsplit(':').next().unwrap();
    port.parse()
        .unwrap_or_else(|_| panic!("no port in {endpoint}"))
}

/// The JSON value of `--flag={...}` in `args`.
fn json_flag(args: &[Value], flag: &str) -> Option<Value> {
    args.iter().filter_map(Value::as_str).find_map(|a| {
        let json = a.strip_prefix(flag)?.strip_prefix('=')?;
        Some(serde_json::from_str(json).unwrap_or_else(|e| panic!("{flag}: {e}: {json}")))
    })
}

#[test]
fn vllm_workers_publish_their_kv_events_where_the_gateway_listens() {
    let k8s = repo_root().join("deploy/k8s/overlays");
    for overlay in ["vllm", "doks"] {
        let Some(yaml) = render(&k8s.join(overlay)) else {
            return;
        };
        let objects = objects(&yaml);
        let gateway = find(&objects, "Deployment", "gateway")["spec"]["template"]["spec"]
            ["containers"][0]["args"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(Value::as_str)
            .map(str::to_string)
            .collect::<Vec<_>>();
        let gateway_block_size = gateway
            .iter()
            .find_map(|a| a.strip_prefix("--kv-block-size="))
            .expect("the gateway names its block size");
        let workers: Vec<&String> = gateway
            .iter()
            .filter(|a| a.starts_with("--worker="))
            .collect();
        let vllm_sets: Vec<&Value> = objects
            .iter()
            .filter(|o| {
                o["kind"] == "StatefulSet"
                    && o["spec"]["template"]["spec"]["containers"][0]["command"][0] == "vllm"
            })
            .collect();
        assert!(!vllm_sets.is_empty(), "{overlay}: no vLLM workers");
        for set in vllm_sets {
            let name = set["metadata"]["name"].as_str().unwrap();
            let service = set["spec"]["serviceName"].as_str().unwrap();
            let container = &set["spec"]["template"]["spec"]["containers"][0];
            let args = container["args"].as_array().unwrap();
            assert!(
                args.iter()
                    .any(|a| a.as_str() == Some(&format!("--block-size={gateway_block_size}"))),
                "{overlay}/{name}: --block-size must equal the gateway's {gateway_block_size}"
            );
            let events = json_flag(args, "--kv-events-config")
                .unwrap_or_else(|| panic!("{overlay}/{name}: no --kv-events-config"));
            for key in events.as_object().unwrap().keys() {
                assert!(
                    VLLM_KV_EVENTS_FIELDS.contains(&key.as_str()),
                    "{overlay}/{name}: vLLM has no kv-events field {key:?}"
                );
            }
            assert_eq!(events["enable_kv_cache_events"], true, "{overlay}/{name}");
            assert_eq!(events["publisher"], "zmq", "{overlay}/{name}");
            if let Some(transfer) = json_flag(args, "--kv-transfer-config") {
                let role = transfer["kv_role"].as_str().unwrap_or_default();
                assert!(
                    VLLM_KV_TRANSFER_ROLES.contains(&role),
                    "{overlay}/{name}: kv_role {role:?}"
                );
            }
            let service_ports = find(&objects, "Service", service)["spec"]["ports"]
                .as_array()
                .unwrap()
                .clone();
            for (field, port_name, worker_key) in [
                ("endpoint", "kv-events", "zmq"),
                ("replay_endpoint", "kv-replay", "zmq_replay"),
            ] {
                let port = zmq_port(events[field].as_str().unwrap_or_else(|| {
                    panic!("{overlay}/{name}: no {field} in --kv-events-config")
                }));
                let declared = container["ports"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .find(|p| p["name"] == port_name)
                    .unwrap_or_else(|| panic!("{overlay}/{name}: no container port {port_name}"));
                assert_eq!(
                    declared["containerPort"], port,
                    "{overlay}/{name}: {port_name}"
                );
                assert!(
                    service_ports
                        .iter()
                        .any(|p| p["port"] == port && p["targetPort"] == port_name),
                    "{overlay}/{name}: Service {service} does not expose {port_name}"
                );
                // Every gateway --worker on this StatefulSet subscribes to that port.
                let on_this_set: Vec<&&String> = workers
                    .iter()
                    .filter(|w| w.contains(&format!(".{service}:")))
                    .collect();
                assert!(
                    !on_this_set.is_empty(),
                    "{overlay}: no --worker on {service}"
                );
                for worker in on_this_set {
                    let endpoint = worker
                        .split(',')
                        .find_map(|kv| kv.strip_prefix(&format!("{worker_key}=")))
                        .unwrap_or_else(|| panic!("{overlay}: {worker} has no {worker_key}="));
                    assert_eq!(zmq_port(endpoint), port, "{overlay}: {worker}");
                    assert!(
                        endpoint.contains(&format!(".{service}:")),
                        "{overlay}: {worker} subscribes elsewhere"
                    );
                }
            }
        }
    }
}

/// Runs deploy/k8s/validate.py on `yaml`; its output and success.
fn validate(yaml: &str) -> (String, bool) {
    let script = repo_root().join("deploy/k8s/validate.py");
    let mut child = Command::new("python3")
        .arg(&script)
        .arg("-")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3 runs deploy/k8s/validate.py");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(yaml.as_bytes())
        .unwrap();
    let output = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !stderr.contains("No module named"),
        "deploy/k8s/validate.py needs PyPI's kubernetes-validate: pip install \
         kubernetes-validate==1.37.0 (.ci/run does)\n{stderr}"
    );
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    (format!("{stdout}{stderr}"), output.status.success())
}

#[test]
fn every_rendered_object_validates_against_kubernetes_and_crd_schemas() {
    for dir in kustomizations() {
        let Some(yaml) = render(&dir) else { return };
        let (report, ok) = validate(&yaml);
        println!("{}: {}", dir.display(), report.trim());
        assert!(ok, "{}:\n{report}", dir.display());
    }
}

/// Runs deploy/k8s/crd-check/validate.mjs (KEDA and Gateway API objects against the upstream
/// schemas from npm's kubernetes-models) on `objects`: its output and success, or None (with
/// the reason printed) when Node.js is missing.
fn validate_upstream_crds(objects: &[Value]) -> Option<(String, bool)> {
    let dir = repo_root().join("deploy/k8s/crd-check");
    assert!(
        dir.join("node_modules/@kubernetes-models/keda").exists(),
        "deploy/k8s/crd-check needs its npm packages: npm ci --prefix deploy/k8s/crd-check \
         (.ci/run does)"
    );
    let mut child = match Command::new("node")
        .arg(dir.join("validate.mjs"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
    {
        Ok(child) => child,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            println!(
                "SKIPPED: Node.js is not installed, so the upstream CRD schemas are not checked"
            );
            return None;
        }
        Err(e) => panic!("running node: {e}"),
    };
    let json = serde_json::to_vec(objects).unwrap();
    child.stdin.take().unwrap().write_all(&json).unwrap();
    let output = child.wait_with_output().unwrap();
    Some((
        format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ),
        output.status.success(),
    ))
}

#[test]
fn keda_and_gateway_api_objects_validate_against_the_upstream_schemas() {
    let mut checked = 0;
    for dir in kustomizations() {
        let Some(yaml) = render(&dir) else { return };
        let Some((report, ok)) = validate_upstream_crds(&objects(&yaml)) else {
            return;
        };
        println!("{}:\n{}", dir.display(), report.trim());
        assert!(ok, "{}:\n{report}", dir.display());
        checked += report.lines().filter(|l| l.starts_with("ok")).count();
    }
    // doks: a Gateway, an HTTPRoute and one ScaledObject per pool.
    assert!(
        checked >= 4,
        "only {checked} KEDA / Gateway API objects were checked"
    );

    // Guards the guard: a wrong type in each kind fails.
    let bad: Vec<Value> = serde_json::from_str(
        r#"[
        {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": {"name": "o"},
         "spec": {"scaleTargetRef": {"name": "x"}, "maxReplicaCount": "five",
                  "triggers": [{"type": "cpu", "metadata": {}}]}},
        {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute", "metadata": {"name": "r"},
         "spec": {"rules": [{"backendRefs": [{"name": "gateway", "port": "http"}]}]}}
    ]"#,
    )
    .unwrap();
    let Some((report, ok)) = validate_upstream_crds(&bad) else {
        return;
    };
    assert!(!ok, "{report}");
    assert!(
        report.contains("maxReplicaCount must be integer"),
        "{report}"
    );
    assert!(report.contains("port must be integer"), "{report}");
}

#[test]
fn the_validator_rejects_unknown_fields_and_kinds() {
    // Guards the guard: a typo in a built-in kind, in a CRD and an unknown kind all fail.
    let bad = "\
apiVersion: v1
kind: Service
metadata: {name: s}
spec: {ports: [{port: 80, targetPort: 80, protocl: TCP}]}
---
apiVersion: keda.sh/v1alpha1
kind: ScaledObject
metadata: {name: o}
spec: {scaleTargetRef: {name: x}, triggers: [{type: cpu, metadata: {}}], maxReplicas: 3}
---
apiVersion: example.com/v1
kind: Unknown
metadata: {name: u}
";
    let (report, ok) = validate(bad);
    assert!(!ok, "{report}");
    for expected in [
        "'protocl' was unexpected",
        "'maxReplicas' was unexpected",
        "no schema",
    ] {
        assert!(report.contains(expected), "{expected}: {report}");
    }
}
