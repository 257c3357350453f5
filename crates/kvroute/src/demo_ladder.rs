//! `kvroute demo`'s live phase switch (seed 003's ladder): the [`loadgen::ladder::PhaseLadder`]
//! that restarts the demo's one aggregated cluster at another phase.
//!
//! The gateway cannot change its routing policy at run time, so a switch restarts the whole
//! cluster: the old gateway and engines stop (the load generator has already cancelled its
//! requests in flight, so nothing waits on them), new engines start with the phase's
//! speculative decoding (same ids and hostnames `worker-N`, cold caches), and a new gateway
//! with the phase's router binds the old one's port, so the load generator's target URL does
//! not change. If the new phase cannot start, the previous one is started again.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Result, bail};
use loadgen::ladder::{PhaseLadder, PhaseSetup, Switched};
use loadgen::scenario::BoxFuture;
use router::PolicyKind;

use crate::demo_cmd::{Cluster, start_cluster};
use crate::demo_fleet::EngineTemplate;
use crate::demo_prometheus::{EngineTarget, EngineTargetsFile};

/// Attempts at binding the gateway's port again (a port just closed can take a moment).
const BIND_ATTEMPTS: u32 = 5;
const BIND_RETRY: Duration = Duration::from_millis(200);

struct Running {
    phase: String,
    cluster: Cluster,
}

/// The demo's cluster, restartable at any phase of the ladder its profile supports.
pub struct DemoLadder {
    /// The engines' template; its `spec` is replaced by each phase's.
    template: EngineTemplate,
    worker_count: usize,
    phases: Vec<PhaseSetup>,
    /// The gateway's port, kept across restarts (the load generator's target).
    gateway_port: u16,
    running: tokio::sync::Mutex<Option<Running>>,
    /// `--prometheus`'s engine targets, rewritten with every restart.
    scrape_targets: Mutex<Option<EngineTargetsFile>>,
    /// The running workers' (name, metrics URL), readable while a switch holds `running`.
    workers: Mutex<Vec<(String, String)>>,
}

/// Each engine's (`worker-N`, metrics URL).
fn endpoints(cluster: &Cluster) -> Vec<(String, String)> {
    (0..)
        .zip(&cluster.engines)
        .map(|(w, e): (u32, _)| (format!("worker-{w}"), format!("{}/metrics", e.url())))
        .collect()
}

/// The ladder's phases with `kv_router` as the KV router, keeping those whose speculative
/// configuration `profile` has (e.g. none of the speculative phases on a profile without).
pub fn phases(kv_router: PolicyKind, profile: &engine::HardwareProfile) -> Vec<PhaseSetup> {
    sim::ladder::ladder(kv_router)
        .into_iter()
        .filter(|p| {
            p.spec_decode
                .is_none_or(|s| profile.speculative.contains_key(s))
        })
        .map(|p| PhaseSetup {
            name: p.name.to_owned(),
            router: p.router.name().to_string(),
            spec_decode: p.spec_decode.unwrap_or("off").to_owned(),
        })
        .collect()
}

/// The first phase that runs `router` with `spec` (`off` or a configuration's name).
pub fn phase_of<'a>(phases: &'a [PhaseSetup], router: &str, spec: &str) -> Option<&'a str> {
    phases
        .iter()
        .find(|p| p.router == router && p.spec_decode == spec)
        .map(|p| p.name.as_str())
}

impl DemoLadder {
    /// Takes over `cluster`, started at `phase` (one of `phases`) from `template`.
    pub fn new(
        template: EngineTemplate,
        phases: Vec<PhaseSetup>,
        phase: &str,
        cluster: Cluster,
    ) -> DemoLadder {
        DemoLadder {
            workers: Mutex::new(endpoints(&cluster)),
            template,
            worker_count: cluster.engines.len(),
            phases,
            gateway_port: cluster.gateway.local_addr().port(),
            running: tokio::sync::Mutex::new(Some(Running {
                phase: phase.to_owned(),
                cluster,
            })),
            scrape_targets: Mutex::new(None),
        }
    }

    /// Has Prometheus scrape the workers of every phase (the file is rewritten per restart).
    pub fn scrape_into(&self, targets: EngineTargetsFile) {
        *self
            .scrape_targets
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(targets);
    }

    /// Stops the cluster.
    pub async fn shutdown(&self) {
        if let Some(running) = self.running.lock().await.take() {
            stop(running.cluster).await;
        }
    }

    async fn start(&self, phase: &str) -> Result<Cluster> {
        let Some(setup) = self.phases.iter().find(|p| p.name == phase) else {
            bail!("unknown phase {phase:?}");
        };
        let template = EngineTemplate {
            spec: setup.spec_decode.clone(),
            ..self.template.clone()
        };
        let roles = vec!["both"; self.worker_count];
        let mut attempt = 1;
        loop {
            match start_cluster(&template, &roles, &setup.router, self.gateway_port).await {
                Ok(cluster) => return Ok(cluster),
                Err(e) if attempt < BIND_ATTEMPTS => {
                    eprintln!(
                        "kvroute demo: starting phase {phase} (attempt {attempt}): {}",
                        crate::error_chain(&e)
                    );
                    attempt += 1;
                    tokio::time::sleep(BIND_RETRY).await;
                }
                Err(e) => return Err(e),
            }
        }
    }

    async fn restart(&self, phase: &str) -> Result<Switched, String> {
        let mut running = self.running.lock().await;
        let Some(old) = running.take() else {
            return Err("the demo is shutting down".to_owned());
        };
        if old.phase == phase {
            // Still a restart: cold caches and fresh counters, as the presenter asked.
            println!("kvroute demo: restarting phase {phase}");
        }
        let previous = old.phase.clone();
        stop(old.cluster).await;
        self.workers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
        let (phase, cluster, error) = match self.start(phase).await {
            Ok(cluster) => (phase.to_owned(), cluster, None),
            Err(e) => match self.start(&previous).await {
                Ok(cluster) => (
                    previous.clone(),
                    cluster,
                    Some(format!(
                        "{}; phase {previous} runs again",
                        crate::error_chain(&e)
                    )),
                ),
                Err(again) => {
                    return Err(format!(
                        "{}; restarting phase {previous} failed too ({}): the demo has no \
                         cluster, restart it",
                        crate::error_chain(&e),
                        crate::error_chain(&again)
                    ));
                }
            },
        };
        let workers = endpoints(&cluster);
        *self.workers.lock().unwrap_or_else(|e| e.into_inner()) = workers.clone();
        self.write_scrape_targets(&cluster);
        let setup = self.phases.iter().find(|p| p.name == phase);
        println!(
            "kvroute demo: phase {phase}: {} workers (speculative decoding: {}) behind the {} \
             gateway on {}",
            cluster.engines.len(),
            setup.map_or("off", |s| s.spec_decode.as_str()),
            cluster.router,
            cluster.gateway.url()
        );
        *running = Some(Running {
            phase: phase.clone(),
            cluster,
        });
        Ok(Switched {
            phase,
            workers,
            error,
        })
    }

    fn write_scrape_targets(&self, cluster: &Cluster) {
        let file = self
            .scrape_targets
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let Some(file) = file else { return };
        let engines: Vec<EngineTarget> = (0..)
            .zip(&cluster.engines)
            .map(|(w, e)| EngineTarget {
                pod: format!("worker-{w}"),
                addr: e.local_addr(),
                pool: EngineTarget::pool_of_role("both"),
            })
            .collect();
        if let Err(e) = file.write(&engines) {
            eprintln!(
                "kvroute demo: Prometheus will not see the new phase's workers: {}",
                crate::error_chain(&e)
            );
        }
    }
}

async fn stop(cluster: Cluster) {
    cluster.gateway.shutdown().await;
    for engine in cluster.engines {
        engine.shutdown().await;
    }
}

impl PhaseLadder for DemoLadder {
    fn phases(&self) -> Vec<PhaseSetup> {
        self.phases.clone()
    }

    fn workers(&self) -> Vec<(String, String)> {
        self.workers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn switch(&self, phase: &str) -> BoxFuture<'_, Result<Switched, String>> {
        let phase = phase.to_owned();
        Box::pin(async move { self.restart(&phase).await })
    }
}

/// The ladder as the load generator takes it.
pub fn as_phase_ladder(ladder: &Arc<DemoLadder>) -> Arc<dyn PhaseLadder> {
    ladder.clone()
}
