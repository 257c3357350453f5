//! What the gateway costs, measured against talking to the engines directly in the same run.
//!
//! 1. **TTFT overhead, paired.** `--streams` closed-loop clients stream chat requests through
//!    the gateway while as many twin clients stream the same requests straight to the engines,
//!    at the same time, against the same `--engines` engine servers (seed 002's H200 worker at
//!    `--speedup`, prefix caching off so routing cannot change an engine's work). A gateway
//!    client sends the chat text; the gateway applies the template, tokenizes, routes and
//!    relays. Its twin sends what the gateway would send: `/v1/completions` with the token
//!    ids. Both groups meet the same engine steps and bursts, so the difference of their TTFT
//!    distributions (request sent → first body bytes, measured by the client) is what the
//!    gateway adds. Client lengths differ (`max_tokens` + 0..15) and each client thinks for a
//!    random 0..2×`--think-ms` between requests, so arrivals fall at random points of the
//!    engines' step cycle (a closed loop without think time sends each request right after
//!    the step that ended the last reply, which turns a small delay into a whole step).
//!    The gateway also times each streamed request itself (`kvroute_gateway_added_ttft_seconds`:
//!    its time before forwarding plus the time from reading the worker's first token to
//!    handing the client's first frame over), which is not quantised by engine steps; the
//!    bench prints its quantiles over the measured window.
//! 2. **Relay throughput.** `--tp-streams` long streams against engines at `--tp-speedup`
//!    (tokens as fast as the CPU allows), straight to the engines, then through the gateway;
//!    tokens/s is the sum of `usage.completion_tokens` over the wall time.
//!
//! Everything runs in this one process; the gateway has its own tokio runtime
//! (`--gateway-threads`, threads named `gw`) so its CPU time is reported apart: CPU per
//! request and per relayed token do not depend on what else the machine is doing, while
//! latencies do.
//!
//! `cargo bench -p gateway --bench overhead -- [--streams 500] [--engines 32] [--speedup 1]
//! [--max-tokens 64] [--prompt-words 300] [--seconds 60] [--warmup 10] [--tp-streams 64]
//! [--tp-engines 4] [--tp-speedup 1000] [--tp-max-tokens 4000] [--tp-seconds 8]
//! [--think-ms 50] [--mode round_robin] [--gateway-threads 1] [--harness-nice 0]`
//!
//! `--harness-nice N` lowers the priority of the harness's own threads (engines and both
//! groups' clients) by N, as if the gateway had cores of its own.
//!
//! The default router mode is `round_robin`: load-blind like the twins' fixed spread, so the
//! TTFT difference is the gateway's cost and not a routing gain (`--mode kv` routes around
//! busy engines and usually *lowers* TTFT against the twins).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use engine_server::{EngineServer, EngineServerConfig, EngineServerHandle};
use futures::StreamExt;
use gateway::preprocess::Preprocessor;
use gateway::{Gateway, GatewayConfig, WorkerSpec};
use kv_index::WorkerId;
use serde_json::json;

#[path = "common/thread_cpu.rs"]
mod thread_cpu;
use thread_cpu::thread_cpu_seconds;

const MODEL: &str = "llama-3.1-70b-instruct";

#[derive(Debug, Clone)]
struct Args {
    streams: usize,
    engines: usize,
    speedup: f64,
    max_tokens: u32,
    prompt_words: usize,
    seconds: f64,
    warmup: f64,
    tp_streams: usize,
    tp_engines: usize,
    tp_speedup: f64,
    tp_max_tokens: u32,
    tp_seconds: f64,
    mode: String,
    gateway_threads: usize,
    think_ms: f64,
    harness_nice: i32,
}

fn parse_args() -> Args {
    let mut a = Args {
        streams: 500,
        engines: 32,
        speedup: 1.0,
        max_tokens: 64,
        prompt_words: 300,
        seconds: 60.0,
        warmup: 10.0,
        tp_streams: 64,
        tp_engines: 4,
        tp_speedup: 1000.0,
        tp_max_tokens: 4000,
        tp_seconds: 8.0,
        mode: "round_robin".into(),
        gateway_threads: 1,
        think_ms: 50.0,
        harness_nice: 0,
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < args.len() {
        let flag = args[i].as_str();
        let value = args.get(i + 1).cloned().unwrap_or_default();
        let num = || -> f64 {
            value
                .parse()
                .unwrap_or_else(|_| panic!("{flag} needs a number, got {value:?}"))
        };
        match flag {
            "--streams" => a.streams = num() as usize,
            "--engines" => a.engines = num() as usize,
            "--speedup" => a.speedup = num(),
            "--max-tokens" => a.max_tokens = num() as u32,
            "--prompt-words" => a.prompt_words = num() as usize,
            "--seconds" => a.seconds = num(),
            "--warmup" => a.warmup = num(),
            "--tp-streams" => a.tp_streams = num() as usize,
            "--tp-engines" => a.tp_engines = num() as usize,
            "--tp-speedup" => a.tp_speedup = num(),
            "--tp-max-tokens" => a.tp_max_tokens = num() as u32,
            "--tp-seconds" => a.tp_seconds = num(),
            "--mode" => a.mode = value.clone(),
            "--gateway-threads" => a.gateway_threads = num() as usize,
            "--think-ms" => a.think_ms = num(),
            "--harness-nice" => a.harness_nice = num() as i32,
            // `cargo bench` passes `--bench`; skip flags we do not know.
            _ => {
                i += 1;
                continue;
            }
        }
        i += 2;
    }
    a
}

async fn engines(n: usize, speedup: f64) -> Vec<EngineServerHandle> {
    let mut out = Vec::new();
    for id in 0..n {
        let mut config = EngineServerConfig::new();
        config.worker_id = WorkerId(id as u64 + 1);
        config.speedup = speedup;
        config.seed = id as u64;
        config.model = MODEL.into();
        config.engine.enable_prefix_caching = false;
        out.push(EngineServer::bind(config).await.expect("engine starts"));
    }
    out
}

/// The gateway runs on its own runtime (threads named `gw`), so its CPU time can be read
/// apart from the engines' and clients'.
struct GatewayRuntime {
    runtime: Option<tokio::runtime::Runtime>,
    gateway: Option<Gateway>,
}

impl GatewayRuntime {
    async fn start(engines: &[EngineServerHandle], mode: &str, threads: usize) -> GatewayRuntime {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_name("gw")
            .enable_all()
            .build()
            .expect("gateway runtime");
        let workers: Vec<WorkerSpec> = engines.iter().map(|e| WorkerSpec::new(e.url())).collect();
        let mode = mode.to_string();
        let gateway = runtime
            .spawn(async move { gateway(workers, &mode).await })
            .await
            .expect("gateway task");
        GatewayRuntime {
            runtime: Some(runtime),
            gateway: Some(gateway),
        }
    }

    fn url(&self) -> String {
        self.gateway.as_ref().map(Gateway::url).unwrap_or_default()
    }

    /// Cumulative buckets `(le, count)` of one of the gateway's histograms.
    fn buckets(&self, name: &str) -> Vec<(f64, f64)> {
        let text = self
            .gateway
            .as_ref()
            .map(Gateway::metrics_text)
            .unwrap_or_default();
        let prefix = format!("{name}_bucket{{");
        text.lines()
            .filter(|l| l.starts_with(&prefix))
            .filter_map(|l| {
                let le = l.split("le=\"").nth(1)?.split('"').next()?;
                let le = if le == "+Inf" {
                    f64::INFINITY
                } else {
                    le.parse().ok()?
                };
                let count = l.rsplit(' ').next()?.parse().ok()?;
                Some((le, count))
            })
            .collect()
    }

    async fn stop(mut self) {
        if let (Some(runtime), Some(gateway)) = (&self.runtime, self.gateway.take()) {
            let _ = runtime.spawn(gateway.shutdown()).await;
        }
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

async fn gateway(workers: Vec<WorkerSpec>, mode: &str) -> Gateway {
    Gateway::bind(GatewayConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        model: MODEL.into(),
        workers,
        router: router::RouterConfig {
            policy: mode.parse().expect("a router mode"),
            ..Default::default()
        },
        frontend: gateway::FrontendConfig {
            max_in_flight_per_worker: None,
            ..Default::default()
        },
        ..GatewayConfig::default()
    })
    .await
    .expect("gateway starts")
}

/// One finished request.
#[derive(Debug, Clone, Copy)]
struct Sample {
    started: Instant,
    ttft: Duration,
    tokens: u64,
}

/// `words` words of the shipped corpus, a different excerpt per client.
fn prompt(client: usize, words: usize) -> String {
    static CORPUS: std::sync::OnceLock<text::Corpus> = std::sync::OnceLock::new();
    let corpus = CORPUS.get_or_init(text::Corpus::builtin);
    format!(
        "Client {client} asks. {}",
        corpus.excerpt(client * 997, words)
    )
}

/// Finds `"completion_tokens":N` in the tail of a stream.
fn completion_tokens(tail: &[u8]) -> Option<u64> {
    let needle = b"\"completion_tokens\":";
    let at = tail.windows(needle.len()).rposition(|w| w == needle)? + needle.len();
    let digits: String = tail[at..]
        .iter()
        .take_while(|b| b.is_ascii_digit())
        .map(|&b| b as char)
        .collect();
    digits.parse().ok()
}

/// A client's endpoints (taken in turn from a counter shared by its group, so the direct
/// group spreads its requests round robin over the engines as the gateway does) and its
/// request body.
#[derive(Debug, Clone)]
struct Client {
    urls: Arc<Vec<String>>,
    turn: Arc<AtomicUsize>,
    body: String,
}

impl Client {
    fn next_url(&self) -> &str {
        let i = self.turn.fetch_add(1, Ordering::Relaxed);
        &self.urls[i % self.urls.len()]
    }
}

/// Endpoints of one group of clients.
#[derive(Debug, Clone)]
struct Group {
    urls: Arc<Vec<String>>,
    turn: Arc<AtomicUsize>,
}

impl Group {
    fn new(urls: Vec<String>) -> Group {
        Group {
            urls: Arc::new(urls),
            turn: Arc::new(AtomicUsize::new(0)),
        }
    }

    fn client(&self, body: String) -> Client {
        Client {
            urls: self.urls.clone(),
            turn: self.turn.clone(),
            body,
        }
    }
}

/// What a gateway client sends (chat text) and what its twin sends straight to an engine
/// (the gateway's own worker request: completions with the token ids).
fn client_pair(
    pre: &Preprocessor,
    client: usize,
    words: usize,
    max_tokens: u32,
    gateway: &Group,
    engines: &Group,
) -> (Client, Client) {
    let text = prompt(client, words);
    let tokens = pre
        .chat(&[text::ChatMessage::user(text.clone())], false)
        .expect("template renders")
        .tokens;
    let through = gateway.client(
        json!({
            "model": MODEL,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens,
            "ignore_eos": true,
            "stream": true,
            "stream_options": {"include_usage": true},
        })
        .to_string(),
    );
    let direct = engines.client(
        json!({
            "model": MODEL,
            "prompt": tokens,
            "max_tokens": max_tokens,
            "ignore_eos": true,
            "stream": true,
            "stream_options": {"include_usage": true},
        })
        .to_string(),
    );
    (direct, through)
}

/// A closed-loop client: sends its request, reads the stream to the end, sends the next,
/// until `until`.
async fn run_client(
    http: reqwest::Client,
    client: Client,
    delay: Duration,
    think_ms: f64,
    seed: u64,
    until: Instant,
) -> Vec<Sample> {
    let mut samples = Vec::new();
    tokio::time::sleep(delay).await;
    let mut rng = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    while Instant::now() < until {
        let started = Instant::now();
        let url = client.next_url();
        let response = match http
            .post(url)
            .header("content-type", "application/json")
            .body(client.body.clone())
            .send()
            .await
        {
            Ok(r) if r.status().is_success() => r,
            Ok(r) => panic!("HTTP {} from {url}", r.status()),
            Err(e) => panic!("request to {url} failed: {e}"),
        };
        let mut stream = response.bytes_stream();
        let mut ttft = None;
        let mut tail: Vec<u8> = Vec::with_capacity(4096);
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.expect("stream reads");
            if ttft.is_none() {
                ttft = Some(started.elapsed());
            }
            tail.extend_from_slice(&chunk);
            if tail.len() > 4096 {
                tail.drain(..tail.len() - 1024);
            }
        }
        let tokens = completion_tokens(&tail).expect("a usage chunk");
        samples.push(Sample {
            started,
            ttft: ttft.unwrap_or_default(),
            tokens,
        });
        // Think time, uniform in [0, 2 × mean): arrivals then fall at random points of the
        // engines' step cycle instead of right after the step that ended the last reply,
        // so the two groups' TTFTs differ only by the path.
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let fraction = (rng >> 11) as f64 / (1u64 << 53) as f64;
        tokio::time::sleep(Duration::from_secs_f64(2.0 * think_ms * fraction / 1e3)).await;
    }
    samples
}

/// Quantile `q` of the observations between two snapshots of cumulative buckets, linear
/// within a bucket.
fn bucket_quantile(before: &[(f64, f64)], after: &[(f64, f64)], q: f64) -> f64 {
    let counts: Vec<(f64, f64)> = after
        .iter()
        .zip(before.iter().map(|b| b.1).chain(std::iter::repeat(0.0)))
        .map(|(&(le, a), b)| (le, a - b))
        .collect();
    let total = counts.last().map_or(0.0, |c| c.1);
    if total == 0.0 {
        return f64::NAN;
    }
    let target = q * total;
    let mut lower = (0.0, 0.0);
    for &(le, count) in &counts {
        if count >= target {
            if le.is_infinite() {
                return lower.0;
            }
            let span = count - lower.1;
            let frac = if span > 0.0 {
                (target - lower.1) / span
            } else {
                1.0
            };
            return lower.0 + frac * (le - lower.0);
        }
        lower = (le, count);
    }
    lower.0
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = (p / 100.0 * (sorted.len() - 1) as f64).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

/// TTFT percentiles (ms) and mean of the samples started after `from`, and their tokens.
fn summarize(samples: &[Sample], from: Instant) -> (usize, [f64; 4], f64, u64) {
    let mut ttft: Vec<f64> = samples
        .iter()
        .filter(|s| s.started >= from)
        .map(|s| s.ttft.as_secs_f64() * 1e3)
        .collect();
    ttft.sort_by(f64::total_cmp);
    let tokens = samples
        .iter()
        .filter(|s| s.started >= from)
        .map(|s| s.tokens)
        .sum();
    let mean = ttft.iter().sum::<f64>() / ttft.len().max(1) as f64;
    (
        ttft.len(),
        [50.0, 90.0, 99.0, 100.0].map(|q| percentile(&ttft, q)),
        mean,
        tokens,
    )
}

/// The direct group's engine URLs and the gateway group's URL.
fn groups(engines: &[EngineServerHandle], gw: &GatewayRuntime) -> (Group, Group) {
    (
        Group::new(
            engines
                .iter()
                .map(|e| format!("{}/v1/completions", e.url()))
                .collect(),
        ),
        Group::new(vec![format!("{}/v1/chat/completions", gw.url())]),
    )
}

fn http_client(connections: usize) -> reqwest::Client {
    reqwest::Client::builder()
        .pool_max_idle_per_host(connections)
        .tcp_nodelay(true)
        .build()
        .expect("HTTP client")
}

async fn ttft_benchmark(args: &Args, pre: &Preprocessor) {
    let engines = engines(args.engines, args.speedup).await;
    let gw = GatewayRuntime::start(&engines, &args.mode, args.gateway_threads).await;
    let http = http_client(args.streams * 2);
    let start = Instant::now();
    let until = start + Duration::from_secs_f64(args.seconds);
    let mut direct = Vec::new();
    let mut through = Vec::new();
    let (engine_group, gateway_group) = groups(&engines, &gw);
    for c in 0..args.streams {
        let max_tokens = args.max_tokens + (c % 16) as u32;
        let (d, g) = client_pair(
            pre,
            c,
            args.prompt_words,
            max_tokens,
            &gateway_group,
            &engine_group,
        );
        // Stagger arrivals over the first second.
        let delay = Duration::from_micros((c as u64 * 7_919) % 1_000_000);
        let seed = c as u64;
        direct.push(tokio::spawn(run_client(
            http.clone(),
            d,
            delay,
            args.think_ms,
            seed,
            until,
        )));
        through.push(tokio::spawn(run_client(
            http.clone(),
            g,
            delay,
            args.think_ms,
            seed + (1 << 32),
            until,
        )));
    }
    let collect = |tasks: Vec<tokio::task::JoinHandle<Vec<Sample>>>| async move {
        let mut all = Vec::new();
        for t in tasks {
            all.extend(t.await.expect("client task"));
        }
        all
    };
    // The gateway's CPU over the measured part of the run.
    tokio::time::sleep(Duration::from_secs_f64(args.warmup)).await;
    let cpu_from = thread_cpu_seconds(|name| name == "gw");
    let overhead_from = gw.buckets("kvroute_gateway_overhead_seconds");
    let added_from = gw.buckets("kvroute_gateway_added_ttft_seconds");
    let direct = collect(direct).await;
    let through = collect(through).await;
    let cpu = thread_cpu_seconds(|name| name == "gw") - cpu_from;
    let overhead_to = gw.buckets("kvroute_gateway_overhead_seconds");
    let added_to = gw.buckets("kvroute_gateway_added_ttft_seconds");
    let wall = start.elapsed().as_secs_f64();
    let measured = wall - args.warmup;
    let from = start + Duration::from_secs_f64(args.warmup);
    println!(
        "TTFT, {} streams through the gateway + {} twin streams straight to the engines, at once: \
         {} engines (h200-llama70b-fp8, speedup {}, prefix caching off), prompt {} words, \
         max_tokens {}..{}, think time 0..{} ms, {:.0} s ({} s warm-up excluded)",
        args.streams,
        args.streams,
        args.engines,
        args.speedup,
        args.prompt_words,
        args.max_tokens,
        args.max_tokens + 15,
        2.0 * args.think_ms,
        wall,
        args.warmup
    );
    println!(
        "{:<10} {:>9} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11}",
        "path", "requests", "TTFT mean", "TTFT p50", "TTFT p90", "TTFT p99", "TTFT max", "tokens/s"
    );
    let d = summarize(&direct, from);
    let g = summarize(&through, from);
    for (name, (n, p, mean, tokens)) in [("direct", d), ("gateway", g)] {
        println!(
            "{:<10} {:>9} {:>8.2} ms {:>8.2} ms {:>8.2} ms {:>8.2} ms {:>8.2} ms {:>11.0}",
            name,
            n,
            mean,
            p[0],
            p[1],
            p[2],
            p[3],
            tokens as f64 / measured
        );
    }
    println!(
        "{:<10} {:>9} {:>+8.2} ms {:>+8.2} ms {:>+8.2} ms {:>+8.2} ms",
        "added",
        "",
        g.2 - d.2,
        g.1[0] - d.1[0],
        g.1[1] - d.1[1],
        g.1[2] - d.1[2]
    );
    println!(
        "gateway's own time before forwarding (parse, template, tokenize, route; \
         kvroute_gateway_overhead_seconds): p50 {:.3} ms, p90 {:.3} ms, p99 {:.3} ms",
        1e3 * bucket_quantile(&overhead_from, &overhead_to, 0.50),
        1e3 * bucket_quantile(&overhead_from, &overhead_to, 0.90),
        1e3 * bucket_quantile(&overhead_from, &overhead_to, 0.99),
    );
    println!(
        "gateway's added TTFT per request (time before forwarding + worker's first token read → \
         client frame handed over; kvroute_gateway_added_ttft_seconds): p50 {:.3} ms, p90 {:.3} \
         ms, p99 {:.3} ms",
        1e3 * bucket_quantile(&added_from, &added_to, 0.50),
        1e3 * bucket_quantile(&added_from, &added_to, 0.90),
        1e3 * bucket_quantile(&added_from, &added_to, 0.99),
    );
    println!(
        "gateway CPU: {:.2} s over {:.0} s = {:.0}% of one core; {:.0} µs per request, {:.2} µs per relayed token",
        cpu,
        measured,
        100.0 * cpu / measured,
        1e6 * cpu / g.0.max(1) as f64,
        1e6 * cpu / g.3.max(1) as f64
    );
    gw.stop().await;
    for e in engines {
        e.shutdown().await;
    }
}

async fn throughput_benchmark(args: &Args, pre: &Preprocessor) {
    let engines = engines(args.tp_engines, args.tp_speedup).await;
    let gw = GatewayRuntime::start(&engines, &args.mode, args.gateway_threads).await;
    let http = http_client(args.tp_streams * 2);
    println!(
        "relay throughput: {} streams, {} engines at speedup {}, max_tokens {}..{}, {} s per side",
        args.tp_streams,
        args.tp_engines,
        args.tp_speedup,
        args.tp_max_tokens,
        args.tp_max_tokens + 15,
        args.tp_seconds
    );
    println!(
        "{:<10} {:>9} {:>14} {:>8}",
        "path", "requests", "tokens/s", "ratio"
    );
    let mut direct_rate = None;
    let (engine_group, gateway_group) = groups(&engines, &gw);
    for side in ["direct", "gateway"] {
        let start = Instant::now();
        let until = start + Duration::from_secs_f64(args.tp_seconds);
        let tasks: Vec<_> = (0..args.tp_streams)
            .map(|c| {
                let max_tokens = args.tp_max_tokens + (c % 16) as u32;
                let (d, g) = client_pair(pre, c, 50, max_tokens, &gateway_group, &engine_group);
                let client = if side == "direct" { d } else { g };
                tokio::spawn(run_client(
                    http.clone(),
                    client,
                    Duration::ZERO,
                    0.0,
                    c as u64,
                    until,
                ))
            })
            .collect();
        let mut samples = Vec::new();
        for t in tasks {
            samples.extend(t.await.expect("client task"));
        }
        let wall = start.elapsed().as_secs_f64();
        let tokens = samples.iter().map(|s| s.tokens).sum::<u64>();
        let rate = tokens as f64 / wall;
        let base = *direct_rate.get_or_insert(rate);
        println!(
            "{:<10} {:>9} {:>14.0} {:>8.2}",
            side,
            samples.len(),
            rate,
            rate / base
        );
        if side == "gateway" {
            let cpu = thread_cpu_seconds(|name| name == "gw");
            println!(
                "gateway CPU: {:.2} s in total, {:.3} µs per relayed token",
                cpu,
                1e6 * cpu / tokens.max(1) as f64
            );
        }
    }
    gw.stop().await;
    for e in engines {
        e.shutdown().await;
    }
}

/// Lowers the calling thread's scheduling priority by `nice` (Linux: nice is per thread).
/// The harness (engines and clients of both paths) runs on the same two cores as the gateway;
/// in a deployment the gateway has its own cores, so `--harness-nice` lets the gateway's
/// thread run when it is ready instead of waiting behind the harness's threads, which both
/// paths share alike.
fn lower_this_thread_priority(nice: i32) {
    if nice == 0 {
        return;
    }
    // SAFETY: gettid and setpriority take no pointers; a failure only leaves the priority.
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        libc::setpriority(libc::PRIO_PROCESS, tid, nice);
    }
}

fn main() {
    let args = parse_args();
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let harness_nice = args.harness_nice;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .on_thread_start(move || lower_this_thread_priority(harness_nice))
        .build()
        .expect("tokio runtime");
    let pre = Preprocessor::builtin();
    runtime.block_on(async {
        println!(
            "gateway overhead ({threads} CPU threads, router mode {})",
            args.mode
        );
        println!();
        if args.streams > 0 {
            ttft_benchmark(&args, &pre).await;
            println!();
        }
        if args.tp_streams > 0 {
            throughput_benchmark(&args, &pre).await;
        }
    });
}
