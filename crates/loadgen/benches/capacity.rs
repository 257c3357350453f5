//! How many open conversations the load generator holds, and at what CPU cost.
//!
//! `cargo bench -p loadgen --bench capacity` starts a fast simulated cluster (engines `SPEEDUP`
//! times faster than an H200, large batches) and its gateway on one tokio runtime, and the load
//! generator on another whose threads are named `loadgen`; it then reads those threads' CPU
//! time from `/proc/self/task` over a steady minute, so the figure is the load generator's own,
//! whatever the cluster beside it costs.
//!
//! Settings (environment): `CONVERSATIONS` (5000), `WORKERS` (8), `SPEEDUP` (5), `THINK_S`
//! (mean think time in modelled seconds, 30), `MAX_NUM_SEQS` (256), `WARMUP_S` and
//! `MEASURE_S` (wall seconds, 60 and 60).

use std::time::{Duration, Instant};

use engine_server::{EngineServer, EngineServerConfig};
use gateway::{Gateway, GatewayConfig, WorkerSpec};
use kv_index::WorkerId;
use loadgen::{LaneSpec, Loadgen, LoadgenConfig};
use workload::Distribution;

// The gateway bench's reader of per-thread CPU time, shared rather than copied.
#[path = "../../gateway/benches/common/thread_cpu.rs"]
mod thread_cpu;
use thread_cpu::thread_cpu_seconds;

const MODEL: &str = "llama-3.1-70b-instruct";

fn setting(name: &str, default: f64) -> f64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    let conversations = setting("CONVERSATIONS", 5_000.0) as u32;
    let workers = setting("WORKERS", 8.0) as u64;
    let speedup = setting("SPEEDUP", 5.0);
    let think_s = setting("THINK_S", 30.0);
    let max_num_seqs = setting("MAX_NUM_SEQS", 256.0) as u32;
    let warmup = Duration::from_secs_f64(setting("WARMUP_S", 60.0));
    let measure = Duration::from_secs_f64(setting("MEASURE_S", 60.0));

    let cluster_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("cluster")
        .enable_all()
        .build()
        .expect("cluster runtime");
    let (engines, gateway) = cluster_rt.block_on(async {
        let mut engines = Vec::new();
        for id in 0..workers {
            let mut config = EngineServerConfig::new();
            config.worker_id = WorkerId(id);
            config.speedup = speedup;
            config.seed = id;
            config.model = MODEL.to_owned();
            config.engine.max_num_seqs = max_num_seqs;
            config.hostname = format!("worker-{id}");
            engines.push(EngineServer::bind(config).await.expect("engine starts"));
        }
        let gateway = Gateway::bind(GatewayConfig {
            listen: "127.0.0.1:0".parse().expect("address"),
            model: MODEL.to_owned(),
            workers: engines.iter().map(|e| WorkerSpec::new(e.url())).collect(),
            frontend: gateway::FrontendConfig {
                max_in_flight_per_worker: std::num::NonZeroU32::new(4_096),
                queue_capacity: 16_384,
                queue_timeout: Some(Duration::from_secs(600).into()),
            },
            ..GatewayConfig::default()
        })
        .await
        .expect("gateway starts");
        (engines, gateway)
    });

    let loadgen_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("loadgen")
        .enable_all()
        .build()
        .expect("load generator runtime");
    let target = gateway.url();
    let (loadgen, before, after) = loadgen_rt.block_on(async {
        let mut config = LoadgenConfig::new(vec![LaneSpec::for_gateway(
            "live",
            Some("kv_load"),
            &target,
            MODEL,
        )]);
        config.listen = "127.0.0.1:0".parse().expect("address");
        config.drive.workload.concurrency = conversations;
        config.drive.workload.ramp_s = warmup.as_secs_f64() * speedup / 2.0;
        config.drive.workload.think_time_s = Distribution::Exponential {
            mean: think_s,
            max: 10.0 * think_s,
        };
        config.drive.time_scale = speedup;
        config.drive.window = Duration::from_secs_f64(measure.as_secs_f64() * speedup);
        config.autostart = true;
        let loadgen = Loadgen::bind(config).await.expect("load generator starts");
        tokio::time::sleep(warmup).await;
        let before = (
            Instant::now(),
            thread_cpu_seconds(|name| name.starts_with("loadgen")),
            loadgen.app().status(),
        );
        tokio::time::sleep(measure).await;
        let after = (
            Instant::now(),
            thread_cpu_seconds(|name| name.starts_with("loadgen")),
            loadgen.app().status(),
        );
        (loadgen, before, after)
    });
    let wall = (after.0 - before.0).as_secs_f64();
    let cpu = after.1 - before.1;
    let (m0, m1) = (&before.2.lanes[0].metrics, &after.2.lanes[0].metrics);
    let turns = m1.requests - m0.requests;
    println!(
        "load generator: {conversations} conversations against {workers} engines ({speedup}× an \
         H200, batches of {max_num_seqs}), think time {think_s} s (modelled)"
    );
    println!(
        "  open conversations {} · requests in flight {} · {turns} turns in {wall:.0} s · errors {}",
        m1.active_conversations,
        m1.in_flight,
        m1.errors - m0.errors
    );
    println!(
        "  output tokens received {:.0}/s (wall) · load generator CPU {:.1}% of one core",
        m1.tops.unwrap_or(0.0) * speedup,
        100.0 * cpu / wall
    );
    loadgen_rt.block_on(loadgen.shutdown());
    cluster_rt.block_on(async {
        gateway.shutdown().await;
        for engine in engines {
            engine.shutdown().await;
        }
    });
}
