//! `kvroute demo --prometheus`: a real Prometheus server (the `prometheus` binary) on the
//! shipped scrape configuration, `deploy/prometheus/demo.yml`, scraping the demo's gateway,
//! workers and load generator, so that the Grafana dashboards in `deploy/grafana/` work
//! against a laptop exactly as against a cluster.

use std::io::ErrorKind;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// The shipped configuration, embedded so that an installed binary needs no checkout.
pub const DEMO_CONFIG: &str = include_str!("../../../deploy/prometheus/demo.yml");

/// How long Prometheus may take to answer `/-/ready`.
const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// A Prometheus child process with its run directory (configuration, targets, data, log);
/// killed and the directory removed on drop.
pub struct DemoPrometheus {
    child: Child,
    dir: PathBuf,
    url: String,
}

/// What the demo bound: each is one scrape target, `pod` names what the dashboards' legends
/// show.
pub struct Targets {
    pub gateway: SocketAddr,
    pub engines: Vec<EngineTarget>,
    pub loadgen: SocketAddr,
}

/// One simulated worker as Prometheus scrapes it.
#[derive(Clone, Debug)]
pub struct EngineTarget {
    /// `worker-N`, the legends' name.
    pub pod: String,
    pub addr: SocketAddr,
    /// `prefill` or `decode` in a disaggregated demo, the `pool` label that
    /// `deploy/prometheus/kubernetes.yml` takes from a pod's `kvroute.dev/pool`; none for an
    /// aggregated worker (whose pods carry no pool label either).
    pub pool: Option<&'static str>,
}

impl EngineTarget {
    /// The `pool` label of a worker started with `--role role`.
    pub fn pool_of_role(role: &str) -> Option<&'static str> {
        match role {
            "prefill" => Some("prefill"),
            "decode" => Some("decode"),
            _ => None,
        }
    }
}

/// The engines' target file, rewritten when the demo's pools change size: Prometheus's
/// file-based discovery notices the change and scrapes the new workers (and stops scraping the
/// ones gone).
#[derive(Clone, Debug)]
pub struct EngineTargetsFile {
    path: PathBuf,
}

impl EngineTargetsFile {
    /// Replaces the file whole (written beside it, then renamed), so that Prometheus never
    /// reads half of it.
    pub fn write(&self, engines: &[EngineTarget]) -> Result<()> {
        let groups: Vec<serde_json::Value> = engines.iter().map(engine_group).collect();
        let partial = self.path.with_extension("json.partial");
        std::fs::write(&partial, serde_json::to_string_pretty(&groups)?)
            .with_context(|| format!("writing {}", partial.display()))?;
        std::fs::rename(&partial, &self.path)
            .with_context(|| format!("replacing {}", self.path.display()))
    }
}

fn engine_group(engine: &EngineTarget) -> serde_json::Value {
    let mut group = target_group(engine.addr, &engine.pod);
    if let Some(pool) = engine.pool {
        group["labels"]["pool"] = pool.into();
    }
    group
}

/// A port for Prometheus: `port`, or any free one for 0 (taken from the OS and released, as
/// Prometheus cannot report the port it bound).
pub fn choose_port(port: u16) -> Result<u16> {
    if port != 0 {
        return Ok(port);
    }
    let listener =
        std::net::TcpListener::bind("127.0.0.1:0").context("finding a free port for Prometheus")?;
    Ok(listener.local_addr()?.port())
}

fn target_group(addr: SocketAddr, pod: &str) -> serde_json::Value {
    serde_json::json!({"targets": [addr.to_string()], "labels": {"pod": pod}})
}

impl DemoPrometheus {
    /// Writes the configuration and targets into a fresh run directory and starts `bin` on
    /// 127.0.0.1:`port`.
    pub fn start(bin: &Path, port: u16, targets: &Targets) -> Result<DemoPrometheus> {
        let dir = std::env::temp_dir().join(format!(
            "kvroute-demo-prometheus-{}-{port}",
            std::process::id()
        ));
        // A leftover of an earlier run with the same pid would mix old samples in.
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("targets"))
            .with_context(|| format!("creating {}", dir.display()))?;
        let config = dir.join("prometheus.yml");
        std::fs::write(&config, DEMO_CONFIG)
            .with_context(|| format!("writing {}", config.display()))?;
        let groups = [
            (
                "gateway.json",
                vec![target_group(targets.gateway, "gateway")],
            ),
            (
                "engines.json",
                targets.engines.iter().map(engine_group).collect(),
            ),
            (
                "loadgen.json",
                vec![target_group(targets.loadgen, "loadgen")],
            ),
        ];
        for (file, groups) in groups {
            let path = dir.join("targets").join(file);
            std::fs::write(&path, serde_json::to_string_pretty(&groups)?)
                .with_context(|| format!("writing {}", path.display()))?;
        }
        let log_path = dir.join("prometheus.log");
        let log = std::fs::File::create(&log_path)
            .with_context(|| format!("creating {}", log_path.display()))?;
        let child = Command::new(bin)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn();
        let child = match child {
            Ok(child) => child,
            Err(err) => {
                let _ = std::fs::remove_dir_all(&dir);
                if err.kind() == ErrorKind::NotFound {
                    bail!(
                        "--prometheus needs a Prometheus server, and `{}` was not found: install \
                         one (Debian/Ubuntu: apt-get install prometheus; others: \
                         prometheus.io/download) or name its binary with --prometheus-bin PATH",
                        bin.display()
                    );
                }
                return Err(err).with_context(|| format!("starting {}", bin.display()));
            }
        };
        Ok(DemoPrometheus {
            child,
            dir,
            url: format!("http://127.0.0.1:{port}"),
        })
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    /// The engines' target file, for a demo whose pools change size.
    pub fn engine_targets(&self) -> EngineTargetsFile {
        EngineTargetsFile {
            path: self.dir.join("targets").join("engines.json"),
        }
    }

    pub fn config_path(&self) -> PathBuf {
        self.dir.join("prometheus.yml")
    }

    /// Waits until Prometheus answers `/-/ready`; fails with its log's tail if it exits
    /// first (a port in use, a bad flag) or takes too long.
    pub async fn wait_ready(&mut self) -> Result<()> {
        let http = reqwest::Client::new();
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(status) = self.child.try_wait()? {
                bail!(
                    "Prometheus exited ({status}) before it was ready:\n{}",
                    self.log_tail()
                );
            }
            let ready = http
                .get(format!("{}/-/ready", self.url))
                .timeout(Duration::from_secs(1))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success());
            if ready {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "Prometheus was not ready on {} within {READY_TIMEOUT:?}:\n{}",
                    self.url,
                    self.log_tail()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.dir.join("prometheus.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(10)..].join("\n")
    }
}

impl Drop for DemoPrometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
