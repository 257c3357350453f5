//! Token relay throughput of one engine server: 64 concurrent streams (one full batch) of
//! 1,000 tokens each, over loopback HTTP, read as SSE by reqwest clients in the same process.
//! Throughput is in output tokens delivered to the clients per second.
//!
//! - `speedup_1e6`: the simulated GPU is never the bottleneck; this is the server's own
//!   ceiling (tokens produced between two reads of a stream go out in one chunk).
//! - `speedup_100`: steps last ~0.2 ms of wall time; the server must deliver the modelled
//!   rate, step by step. Compare with the modelled time of the same batch
//!   (`kvroute profiles`): the difference is the relay's overhead.
//!
//! `cargo bench -p engine-server --bench relay`

use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use engine_server::{EngineServer, EngineServerConfig};
use futures::StreamExt;
use serde_json::json;

const STREAMS: usize = 64;
const TOKENS: usize = 1_000;

async fn one_stream(client: reqwest::Client, url: String, prompt: u32) -> usize {
    let response = client
        .post(&url)
        .json(&json!({
            "model": "llama-3.1-70b-instruct",
            // Distinct prompts, so every request prefills and decodes.
            "prompt": (0..256).map(|t| t * 7 + prompt * 100_000).collect::<Vec<u32>>(),
            "max_tokens": TOKENS, "ignore_eos": true, "stream": true,
        }))
        .send()
        .await
        .expect("request");
    assert_eq!(response.status(), 200);
    let mut bytes = 0;
    let mut body = response.bytes_stream();
    while let Some(chunk) = body.next().await {
        bytes += chunk.expect("body").len();
    }
    bytes
}

fn relay(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut group = c.benchmark_group("engine_server_relay");
    group.throughput(Throughput::Elements((STREAMS * TOKENS) as u64));
    group.sample_size(10);
    group.measurement_time(Duration::from_secs(20));
    let mut round = 0u32;
    for (name, speedup) in [("speedup_1e6", 1e6), ("speedup_100", 100.0)] {
        let server = runtime.block_on(async {
            let mut config = EngineServerConfig::new();
            config.speedup = speedup;
            EngineServer::bind(config).await.unwrap()
        });
        let url = format!("{}/v1/completions", server.url());
        let client = reqwest::Client::new();
        group.bench_function(format!("64_streams_x_1000_tokens/{name}"), |b| {
            b.to_async(&runtime).iter(|| {
                round += 1;
                let tasks: Vec<_> = (0..STREAMS as u32)
                    .map(|i| {
                        tokio::spawn(one_stream(
                            client.clone(),
                            url.clone(),
                            round * STREAMS as u32 + i,
                        ))
                    })
                    .collect();
                async move {
                    for task in tasks {
                        assert!(task.await.unwrap() > 0);
                    }
                }
            })
        });
        runtime.block_on(server.shutdown());
    }
    group.finish();
}

criterion_group!(benches, relay);
criterion_main!(benches);
