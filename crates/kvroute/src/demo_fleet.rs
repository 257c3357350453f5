//! `kvroute demo`'s pools that change size at run time: the [`loadgen::Fleet`] the scenario
//! controller and the autoscalers resize.
//!
//! A new worker is a simulated engine started exactly as `kvroute engine --role R` would be
//! (cold cache, a unique id and hostname `worker-N`), registered with the gateway like a
//! `--worker` flag. A worker leaves by draining: the gateway routes nothing new to it
//! ([`Gateway::drain_worker`]); once its requests have finished ([`Gateway::take_drained`]), or
//! after [`DRAIN_TIMEOUT`], it is removed (the router forgets its blocks) and its engine
//! stops. The newest workers of a pool leave first; the decode pool keeps at least one.
//! Resizes run one at a time (the state's lock is held across one).

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Parser;
use engine_server::{EngineServer, EngineServerHandle};
use gateway::{Gateway, WorkerSpec};
use kv_index::WorkerId;
use loadgen::scenario::{BoxFuture, PoolKind, PoolSizes};

use crate::demo_prometheus::{EngineTarget, EngineTargetsFile};
use crate::engine_cmd;

/// The longest a leaving worker may take to finish its requests (wall time); after it, the
/// worker is removed anyway and what it still serves fails.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(120);
/// The most workers a pool may have (as `--prefill-workers` / `--decode-workers`).
pub const MAX_POOL: u32 = 32;
const DRAIN_POLL: Duration = Duration::from_millis(50);

/// How the demo starts a simulated engine: `kvroute engine`'s flags.
#[derive(Clone, Debug)]
pub struct EngineTemplate {
    pub profile: String,
    pub speedup: f64,
    pub spec: String,
}

#[derive(Debug, Parser)]
struct EngineFlags {
    #[command(flatten)]
    args: engine_cmd::EngineArgs,
}

impl EngineTemplate {
    /// Starts worker `id` (`worker-{id}`, seed `id`) with `role` (`both`, `prefill`, `decode`).
    pub async fn start(&self, id: u32, role: &str) -> Result<EngineServerHandle> {
        let flags = EngineFlags::try_parse_from([
            "engine".to_owned(),
            "--port=0".to_owned(),
            format!("--profile={}", self.profile),
            format!("--speedup={}", self.speedup),
            format!("--worker-id={id}"),
            // The same seeds in both clusters of --compare: identical engines.
            format!("--seed={id}"),
            "--zmq-pub=tcp://127.0.0.1:0".to_owned(),
            format!("--hostname=worker-{id}"),
            format!("--spec-decode={}", self.spec),
            format!("--role={role}"),
        ])
        .map_err(|e| anyhow::anyhow!("{e}"))?;
        let config = engine_cmd::config(&flags.args)?;
        EngineServer::bind(config)
            .await
            .with_context(|| format!("starting simulated worker {id}"))
    }
}

struct Worker {
    id: u32,
    pool: PoolKind,
    engine: EngineServerHandle,
}

struct State {
    /// Shared only with a resize under way (which holds the state's lock): shutdown gets it
    /// back.
    gateway: Option<Arc<Gateway>>,
    workers: Vec<Worker>,
    next_id: u32,
}

/// What the status reads without waiting for a resize.
#[derive(Default)]
struct View {
    pools: Option<PoolSizes>,
    metrics: Vec<(String, String)>,
}

/// The disaggregated demo's cluster: its gateway and its engines, by pool.
pub struct DemoFleet {
    template: EngineTemplate,
    state: tokio::sync::Mutex<State>,
    view: Mutex<View>,
    /// Set by shutdown: a drain under way stops waiting, a growth stops adding.
    closing: AtomicBool,
    /// `--prometheus`'s engine targets, rewritten with the pools.
    scrape_targets: Mutex<Option<EngineTargetsFile>>,
}

fn role(pool: PoolKind) -> &'static str {
    match pool {
        PoolKind::Prefill => "prefill",
        PoolKind::Decode => "decode",
    }
}

impl DemoFleet {
    /// Takes over a started cluster: `engines` are `(id, pool, engine)`, registered with
    /// `gateway`; new workers are numbered after the highest id.
    pub fn new(
        template: EngineTemplate,
        gateway: Gateway,
        engines: Vec<(u32, PoolKind, EngineServerHandle)>,
    ) -> DemoFleet {
        let next_id = engines.iter().map(|(id, ..)| id + 1).max().unwrap_or(0);
        let workers = engines
            .into_iter()
            .map(|(id, pool, engine)| Worker { id, pool, engine })
            .collect();
        let fleet = DemoFleet {
            template,
            state: tokio::sync::Mutex::new(State {
                gateway: Some(Arc::new(gateway)),
                workers,
                next_id,
            }),
            view: Mutex::new(View::default()),
            closing: AtomicBool::new(false),
            scrape_targets: Mutex::new(None),
        };
        if let Ok(state) = fleet.state.try_lock() {
            fleet.update_view(&state, &BTreeSet::new());
        }
        fleet
    }

    /// Has Prometheus scrape the pools' workers as they change (the file is written now and
    /// after every change).
    pub fn scrape_into(&self, targets: EngineTargetsFile) {
        *self
            .scrape_targets
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(targets);
        if let Ok(state) = self.state.try_lock() {
            self.update_view(&state, &BTreeSet::new());
        }
    }

    /// Records the sizes and endpoints, not counting the workers in `leaving` (a draining
    /// worker is still scraped: its requests are still running).
    fn update_view(&self, state: &State, leaving: &BTreeSet<u32>) {
        let scrape = self
            .scrape_targets
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        if let Some(file) = scrape {
            let engines: Vec<EngineTarget> = state
                .workers
                .iter()
                .map(|w| EngineTarget {
                    pod: format!("worker-{}", w.id),
                    addr: w.engine.local_addr(),
                    pool: EngineTarget::pool_of_role(role(w.pool)),
                })
                .collect();
            if let Err(e) = file.write(&engines) {
                eprintln!(
                    "kvroute demo: Prometheus will not see the pools' new size: {}",
                    crate::error_chain(&e)
                );
            }
        }
        let staying = || state.workers.iter().filter(|w| !leaving.contains(&w.id));
        let count = |pool| staying().filter(|w| w.pool == pool).count() as u32;
        let view = View {
            pools: Some(PoolSizes {
                prefill: count(PoolKind::Prefill),
                decode: count(PoolKind::Decode),
            }),
            metrics: staying()
                .map(|w| {
                    (
                        format!("worker-{}", w.id),
                        format!("{}/metrics", w.engine.url()),
                    )
                })
                .collect(),
        };
        *self.view.lock().unwrap_or_else(|e| e.into_inner()) = view;
    }

    async fn resize(&self, pool: PoolKind, to: u32) -> Result<u32, String> {
        let floor = match pool {
            PoolKind::Prefill => 0,
            PoolKind::Decode => 1,
        };
        let to = to.clamp(floor, MAX_POOL);
        let mut state = self.state.lock().await;
        let Some(gateway) = state.gateway.clone() else {
            return Err("the demo is shutting down".to_owned());
        };
        let from = state.workers.iter().filter(|w| w.pool == pool).count() as u32;
        if to > from {
            for _ in from..to {
                if self.closing.load(Ordering::SeqCst) {
                    return Err("the demo is shutting down".to_owned());
                }
                let id = state.next_id;
                state.next_id += 1;
                let engine = self
                    .template
                    .start(id, role(pool))
                    .await
                    .map_err(|e| crate::error_chain(&e))?;
                if let Err(e) = gateway.add_worker(&WorkerSpec::new(engine.url())).await {
                    engine.shutdown().await;
                    return Err(format!("registering worker-{id}: {e}"));
                }
                state.workers.push(Worker { id, pool, engine });
                self.update_view(&state, &BTreeSet::new());
                println!("kvroute demo: worker-{id} joined the {pool} pool");
            }
            return Ok(to);
        }
        // The newest leave first.
        let mut ids: Vec<u32> = state
            .workers
            .iter()
            .filter(|w| w.pool == pool)
            .map(|w| w.id)
            .collect();
        ids.sort_unstable();
        let leaving: BTreeSet<u32> = ids[to as usize..].iter().copied().collect();
        let mut waiting: BTreeSet<u32> = BTreeSet::new();
        for id in &leaving {
            if gateway.drain_worker(WorkerId(u64::from(*id))) {
                waiting.insert(*id);
            }
        }
        self.update_view(&state, &leaving);
        let started = Instant::now();
        while !waiting.is_empty() {
            for id in gateway.take_drained() {
                if let Ok(id) = u32::try_from(id.0) {
                    waiting.remove(&id);
                }
            }
            if waiting.is_empty() || self.closing.load(Ordering::SeqCst) {
                break;
            }
            if started.elapsed() > DRAIN_TIMEOUT {
                eprintln!(
                    "kvroute demo: workers {waiting:?} still busy after {DRAIN_TIMEOUT:?}; \
                     removing them anyway"
                );
                break;
            }
            tokio::time::sleep(DRAIN_POLL).await;
        }
        for id in &leaving {
            gateway.remove_worker(WorkerId(u64::from(*id)));
        }
        let (gone, kept): (Vec<Worker>, Vec<Worker>) = std::mem::take(&mut state.workers)
            .into_iter()
            .partition(|w| leaving.contains(&w.id));
        state.workers = kept;
        self.update_view(&state, &BTreeSet::new());
        for worker in gone {
            worker.engine.shutdown().await;
            println!(
                "kvroute demo: worker-{} left the {pool} pool (drained)",
                worker.id
            );
        }
        Ok(to)
    }

    /// Stops the gateway (letting its streams finish) and every engine; waits for a resize
    /// under way.
    pub async fn shutdown(&self) {
        self.closing.store(true, Ordering::SeqCst);
        let mut state = self.state.lock().await;
        if let Some(gateway) = state.gateway.take() {
            // Under the lock no resize holds a clone; should one leak, dropping it still
            // stops the gateway's tasks.
            if let Ok(gateway) = Arc::try_unwrap(gateway) {
                gateway.shutdown().await;
            }
        }
        for worker in std::mem::take(&mut state.workers) {
            worker.engine.shutdown().await;
        }
        self.update_view(&state, &BTreeSet::new());
    }
}

impl loadgen::Fleet for DemoFleet {
    fn pools(&self) -> PoolSizes {
        self.view
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pools
            .unwrap_or(PoolSizes {
                prefill: 0,
                decode: 0,
            })
    }

    fn scale(&self, pool: PoolKind, to: u32) -> BoxFuture<'_, Result<u32, String>> {
        Box::pin(self.resize(pool, to))
    }

    fn worker_metrics(&self) -> Vec<(String, String)> {
        self.view
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .metrics
            .clone()
    }
}
