//! Public trace replay in real time against any OpenAI-compatible endpoint
//! (`kvroute loadgen --trace`).
//!
//! The schedule is the workload crate's [`TraceReplay`] (the one `kvroute sim --trace` runs in
//! virtual time), driven by the wall clock. Each request is a streamed `/v1/completions` call
//! whose `prompt` is a token-id array from [`PromptSynth`]: equal hash ids are equal 512-token
//! blocks whatever the server's tokenizer, so the trace's prefix structure reaches the engines'
//! caches exactly (text would be re-tokenized, and a block boundary could merge tokens across
//! it). `max_tokens` is the record's `output_length` with `ignore_eos`, so replies have the
//! recorded length where the server honours it (vLLM, SGLang and `kvroute engine` do).
//!
//! Bounds: at most `max_open` requests in flight; a request due while that many are open is
//! dropped and counted, never queued. Samples kept for the summary are one TTFT per finished
//! request, bounded by the trace; error messages kept are capped at [`MAX_ERRORS_KEPT`].

use std::sync::Arc;
use std::time::{Duration, Instant};

use nanotime::Nanos;
use report::Percentiles;
use serde::Serialize;
use tokio::sync::mpsc;
pub use tokio_util::sync::CancellationToken;
use workload::replay::{ReplayStats, TraceReplay};
use workload::{PromptSynth, Speed, Trace};

use crate::client::{TurnError, TurnResult, stream_turn};

/// Distinct error messages kept for the summary.
pub const MAX_ERRORS_KEPT: usize = 8;

/// What to replay, where.
#[derive(Debug, Clone)]
pub struct TraceReplayConfig {
    /// Base URL of the endpoint, without `/v1`.
    pub target: String,
    pub model: String,
    pub api_key: Option<String>,
    pub trace: Arc<Trace>,
    pub speed: Speed,
    pub synth: PromptSynth,
    /// Requests in flight at most; more due at once are dropped.
    pub max_open: usize,
    /// Longest a request may take, stream included.
    pub request_timeout: Duration,
}

impl TraceReplayConfig {
    /// Defaults: seed-0 prompts, 1,024 open at most, 10-minute request timeout.
    pub fn new(target: &str, model: &str, trace: Arc<Trace>, speed: Speed) -> Self {
        TraceReplayConfig {
            target: target.trim_end_matches('/').to_string(),
            model: model.to_string(),
            api_key: None,
            trace,
            speed,
            synth: PromptSynth::default(),
            max_open: 1024,
            request_timeout: Duration::from_secs(600),
        }
    }
}

/// Where a replay stands (for progress lines) and, at the end, its summary.
#[derive(Debug, Clone, Default, Serialize)]
pub struct TraceReplayStatus {
    #[serde(flatten)]
    pub stats: ReplayStats,
    /// Prompt and cached prompt tokens of finished requests, as the server's `usage` reported
    /// them (`prompt_tokens_details.cached_tokens`).
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    /// `cached_tokens / prompt_tokens`; `None` before a finished request reported usage.
    pub kv_hit_rate: Option<f64>,
    /// The trace's bound (an infinite cache shared by all workers, in 512-token blocks).
    pub oracle_prefix_hit_rate: f64,
    pub ttft_ms: Percentiles,
    pub e2e_s: Percentiles,
    pub output_tokens: u64,
    /// Wall seconds since the replay started.
    pub elapsed_s: f64,
    /// The first distinct error messages.
    pub errors: Vec<String>,
}

struct Tally {
    status: TraceReplayStatus,
    ttft_ms: Vec<f64>,
    e2e_s: Vec<f64>,
}

impl Tally {
    fn finished(&mut self, r: &TurnResult) {
        self.ttft_ms.push(r.ttft.as_secs_f64() * 1e3);
        self.e2e_s.push(r.e2e.as_secs_f64());
        self.status.output_tokens += r.output_tokens;
        if let (Some(p), Some(c)) = (r.prompt_tokens, r.cached_tokens) {
            self.status.prompt_tokens += p;
            self.status.cached_tokens += c;
        }
    }

    fn failed(&mut self, e: &TurnError) {
        let message = e.to_string();
        let errors = &mut self.status.errors;
        if errors.len() < MAX_ERRORS_KEPT && !errors.contains(&message) {
            errors.push(message);
        }
    }

    fn snapshot(&mut self, stats: ReplayStats, started: Instant) -> TraceReplayStatus {
        let s = &mut self.status;
        s.stats = stats;
        s.kv_hit_rate =
            (s.prompt_tokens > 0).then(|| s.cached_tokens as f64 / s.prompt_tokens as f64);
        s.ttft_ms = Percentiles::of(&mut self.ttft_ms.clone());
        s.e2e_s = Percentiles::of(&mut self.e2e_s.clone());
        s.elapsed_s = started.elapsed().as_secs_f64();
        s.clone()
    }
}

/// The JSON body of record `index`'s request.
fn body(config: &TraceReplayConfig, index: usize) -> Vec<u8> {
    let record = &config.trace.records()[index];
    let prompt = config.synth.prompt_tokens(record);
    let body = serde_json::json!({
        "model": config.model,
        "prompt": prompt,
        "max_tokens": record.output_length(),
        "ignore_eos": true,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    body.to_string().into_bytes()
}

/// Replays the trace to its end (every request sent or dropped, and every one sent ended) or
/// until `cancel`; calls `progress` about every `every` with the status so far, and returns
/// the final status.
pub async fn replay_trace(
    config: TraceReplayConfig,
    cancel: CancellationToken,
    every: Duration,
    mut progress: impl FnMut(&TraceReplayStatus),
) -> TraceReplayStatus {
    let config = Arc::new(config);
    let client = reqwest::Client::new();
    let url = format!("{}/v1/completions", config.target);
    let mut replay = TraceReplay::new(Arc::clone(&config.trace), config.speed);
    let mut tally = Tally {
        status: TraceReplayStatus {
            oracle_prefix_hit_rate: config.trace.oracle_prefix_hit_rate(),
            ..TraceReplayStatus::default()
        },
        ttft_ms: Vec::new(),
        e2e_s: Vec::new(),
    };
    // Every request in flight sends one end, so this never holds more than `max_open`.
    let (tx, mut rx) =
        mpsc::channel::<(usize, Result<TurnResult, TurnError>)>(config.max_open.max(1));
    let mut open = 0usize;
    let started = Instant::now();
    let clock = |at: Instant| Nanos(at.duration_since(started).as_nanos() as u64);
    let mut next_progress = started + every;
    while !replay.is_done() {
        replay.handle_timeout(clock(Instant::now()));
        while let Some(due) = replay.poll_request() {
            if open >= config.max_open {
                replay.on_dropped(due.record, clock(Instant::now()));
                continue;
            }
            open += 1;
            let (config, client, url, tx) =
                (Arc::clone(&config), client.clone(), url.clone(), tx.clone());
            tokio::spawn(async move {
                let body = body(&config, due.record);
                let result = stream_turn(
                    &client,
                    &url,
                    config.api_key.as_deref(),
                    body,
                    config.request_timeout,
                    0,
                )
                .await;
                let _ = tx.send((due.record, result)).await;
            });
        }
        if replay.is_done() {
            break;
        }
        let wake = replay
            .poll_timeout()
            .map(|t| started + Duration::from_nanos(t.as_nanos()))
            .unwrap_or(next_progress)
            .min(next_progress);
        tokio::select! {
            _ = cancel.cancelled() => break,
            ended = rx.recv() => {
                let Some((record, result)) = ended else { break };
                open -= 1;
                let now = clock(Instant::now());
                match &result {
                    Ok(r) => {
                        tally.finished(r);
                        replay.on_finished(record, now);
                    }
                    Err(e) => {
                        tally.failed(e);
                        replay.on_failed(record, now);
                    }
                }
            }
            _ = tokio::time::sleep_until(wake.into()) => {}
        }
        if Instant::now() >= next_progress {
            progress(&tally.snapshot(replay.stats(), started));
            next_progress = Instant::now() + every;
        }
    }
    tally.snapshot(replay.stats(), started)
}
