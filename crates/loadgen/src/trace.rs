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
//! The server's prefix-hit rate (`cached_tokens / prompt_tokens` over the requests that
//! finished with usage) is reported beside the bound over the same requests ([`PrefixOracle`],
//! told of each request as it is sent and as it finishes) and the whole trace's: mid-replay
//! the finished requests are not a sample of the trace, so only the first is comparable. The
//! prompts are token ids, so `prompt_tokens` counts the records' `input_length`s, the tokens
//! the bound is over.
//!
//! The same replay runs headless (`--headless`: progress lines and a summary) and under the
//! dashboard (`trace_run.rs`: the Trace panel, and the lane's cards and charts fed from the
//! same requests); a [`ReplayObserver`] is how each watches it.
//!
//! Bounds: at most `max_open` requests in flight; a request due while that many are open is
//! dropped and counted, never queued. The samples behind the percentiles (TTFT, E2E, lateness)
//! are exact up to [`MAX_SAMPLES`] requests and a uniform reservoir of that many beyond; error
//! messages kept are capped at [`MAX_ERRORS_KEPT`].

use std::sync::Arc;
use std::time::{Duration, Instant};

use nanotime::Nanos;
use report::Percentiles;
use serde::Serialize;
use tokio::sync::mpsc;
pub use tokio_util::sync::CancellationToken;
use workload::replay::{ReplayStats, TraceReplay};
use workload::{PrefixOracle, PromptSynth, Speed, Trace, TraceRecord};

use crate::client::{TurnError, TurnResult, stream_turn};

/// Distinct error messages kept for the summary.
pub const MAX_ERRORS_KEPT: usize = 8;
/// Samples kept per percentile figure (a reservoir beyond: an hour of the shipped trace is
/// 12,031 requests, far below).
pub const MAX_SAMPLES: usize = 100_000;

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

/// Where a replay is.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ReplayState {
    /// Not started (the dashboard waits for Start).
    #[default]
    Idle,
    Running,
    /// Every request sent or dropped, and every one sent ended.
    Finished,
    /// Stopped before the end; the requests in flight were cancelled.
    Stopped,
}

/// Where a replay stands (for progress lines and the dashboard) and, at the end, its summary.
#[derive(Debug, Clone, Default, Serialize)]
pub struct TraceReplayStatus {
    pub state: ReplayState,
    /// `requests` in the trace (after `--trace-limit`), `issued` (sent or dropped),
    /// `finished`, `failed`, `dropped` (due while `max_open` were open).
    #[serde(flatten)]
    pub stats: ReplayStats,
    /// Requests sent and not yet ended.
    pub in_flight: u64,
    /// Requests in flight when the replay was stopped: cancelled, counted apart from failures.
    pub cancelled: u64,
    /// The replay's speed factor (2: twice as fast as recorded).
    pub speed: f64,
    /// The trace's length (its last request's timestamp), recorded seconds.
    pub trace_duration_s: f64,
    /// How far the replay's clock has got, in the trace's recorded seconds (its length once
    /// every request is due).
    pub trace_time_s: f64,
    /// Wall seconds until the last request is due; `null` once the replay ended.
    pub eta_s: Option<f64>,
    /// How late each request was sent (or dropped) against its schedule, wall milliseconds:
    /// a sender that cannot keep up shows here first.
    pub lateness_ms: Percentiles,
    /// Finished requests whose `usage` reported prompt and cached tokens: the requests
    /// `kv_hit_rate` and `oracle_hit_rate_finished` are over.
    pub usage_requests: u64,
    /// Prompt and cached prompt tokens of those requests, as the server's `usage` reported
    /// them (`prompt_tokens_details.cached_tokens`).
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    /// `cached_tokens / prompt_tokens`; `None` before a finished request reported usage.
    pub kv_hit_rate: Option<f64>,
    /// The same requests' `input_length`s: the prompts were sent as that many token ids, so
    /// a server that counts what it was sent reports it as `prompt_tokens`.
    pub trace_input_tokens: u64,
    /// The most of those input tokens a cache could have served ([`PrefixOracle`]: an infinite
    /// cache shared by all workers, empty at the start, in the trace's 512-token blocks,
    /// whatever order the server saw the requests in).
    pub oracle_hit_tokens: u64,
    /// `oracle_hit_tokens / trace_input_tokens`: the bound `kv_hit_rate` is under; `None`
    /// before a finished request reported usage.
    pub oracle_hit_rate_finished: Option<f64>,
    /// `kv_hit_rate` is above `oracle_hit_rate_finished`: the server's cache held the trace's
    /// blocks before the replay (an earlier replay, another client), which the bound assumes
    /// not. Decided here once for the dashboard and the terminal.
    pub above_bound: bool,
    /// The same bound over every request of the trace (after `--trace-limit`): what the
    /// finished requests' figure becomes once every request finished.
    pub oracle_prefix_hit_rate: f64,
    /// Wall-clock TTFT and end-to-end latency of finished requests.
    pub ttft_ms: Percentiles,
    pub e2e_s: Percentiles,
    pub output_tokens: u64,
    /// Wall seconds since the replay started.
    pub elapsed_s: f64,
    /// The first distinct error messages.
    pub errors: Vec<String>,
}

impl TraceReplayStatus {
    /// The status of `config`'s replay before it starts.
    pub fn idle(config: &TraceReplayConfig) -> TraceReplayStatus {
        TraceReplayStatus {
            stats: ReplayStats {
                requests: config.trace.len() as u64,
                ..ReplayStats::default()
            },
            speed: config.speed.factor(),
            trace_duration_s: config.trace.duration().as_secs_f64(),
            oracle_prefix_hit_rate: config.trace.oracle_prefix_hit_rate(),
            ..TraceReplayStatus::default()
        }
    }
}

/// How a driver watches a replay besides its final status.
pub trait ReplayObserver {
    /// About every `every` of [`replay_trace`], with the status so far.
    fn progress(&mut self, status: &TraceReplayStatus);
    /// A request was sent (dropped ones are not).
    fn sent(&mut self) {}
    /// A request sent ended: its place in its session (0: a first request, or none) and how.
    fn ended(&mut self, _turn: u32, _result: &Result<TurnResult, TurnError>) {}
    /// The replay stopped with `in_flight` requests cancelled.
    fn cancelled(&mut self, _in_flight: u64) {}
}

/// Samples for percentiles, bounded: every one up to `MAX_SAMPLES`, then a uniform reservoir
/// (Vitter's algorithm R, a fixed-seed xorshift so a run is reproducible).
#[derive(Default)]
struct Samples {
    values: Vec<f64>,
    seen: u64,
    rng: u64,
}

impl Samples {
    fn push(&mut self, value: f64) {
        self.seen += 1;
        if self.values.len() < MAX_SAMPLES {
            self.values.push(value);
            return;
        }
        if self.rng == 0 {
            self.rng = 0x9E37_79B9_7F4A_7C15;
        }
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        let slot = self.rng % self.seen;
        if let Some(v) = self.values.get_mut(slot as usize) {
            *v = value;
        }
    }

    fn percentiles(&self) -> Percentiles {
        Percentiles::of(&mut self.values.clone())
    }
}

struct Tally {
    status: TraceReplayStatus,
    /// The bound over the requests that finished with usage, fed as they are sent and end.
    oracle: PrefixOracle,
    ttft_ms: Samples,
    e2e_s: Samples,
    lateness_ms: Samples,
}

impl Tally {
    fn finished(&mut self, record: &TraceRecord, r: &TurnResult) {
        self.ttft_ms.push(r.ttft.as_secs_f64() * 1e3);
        self.e2e_s.push(r.e2e.as_secs_f64());
        self.status.output_tokens += r.output_tokens;
        if let (Some(p), Some(c)) = (r.prompt_tokens, r.cached_tokens) {
            self.status.usage_requests += 1;
            self.status.prompt_tokens += p;
            self.status.cached_tokens += c;
            self.oracle.finished(record);
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
        s.in_flight = stats.open();
        s.kv_hit_rate =
            (s.prompt_tokens > 0).then(|| s.cached_tokens as f64 / s.prompt_tokens as f64);
        s.trace_input_tokens = self.oracle.finished_input_tokens();
        s.oracle_hit_tokens = self.oracle.hit_tokens();
        s.oracle_hit_rate_finished = self.oracle.hit_rate();
        s.above_bound = matches!((s.kv_hit_rate, s.oracle_hit_rate_finished),
            (Some(hit), Some(possible)) if hit > possible + 1e-9);
        s.ttft_ms = self.ttft_ms.percentiles();
        s.e2e_s = self.e2e_s.percentiles();
        s.lateness_ms = self.lateness_ms.percentiles();
        s.elapsed_s = started.elapsed().as_secs_f64();
        s.trace_time_s = if stats.issued == stats.requests {
            s.trace_duration_s
        } else {
            (s.elapsed_s * s.speed).min(s.trace_duration_s)
        };
        s.eta_s = match s.state {
            ReplayState::Running | ReplayState::Idle => {
                Some(((s.trace_duration_s - s.trace_time_s) / s.speed).max(0.0))
            }
            ReplayState::Finished | ReplayState::Stopped => None,
        };
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

/// One request's end, from its task to the replay loop.
type Ended = (usize, u32, Result<TurnResult, TurnError>);

/// Replays the trace to its end (every request sent or dropped, and every one sent ended) or
/// until `cancel` (the requests in flight are then cancelled, and counted as `cancelled`);
/// tells `observer` about every request and, about every `every`, the status so far, and
/// returns the final status.
pub async fn replay_trace(
    config: TraceReplayConfig,
    cancel: CancellationToken,
    every: Duration,
    observer: &mut impl ReplayObserver,
) -> TraceReplayStatus {
    let config = Arc::new(config);
    let client = reqwest::Client::new();
    let url = format!("{}/v1/completions", config.target);
    let mut replay = TraceReplay::new(Arc::clone(&config.trace), config.speed);
    let mut tally = Tally {
        status: TraceReplayStatus {
            state: ReplayState::Running,
            ..TraceReplayStatus::idle(&config)
        },
        oracle: PrefixOracle::default(),
        ttft_ms: Samples::default(),
        e2e_s: Samples::default(),
        lateness_ms: Samples::default(),
    };
    // Requests in flight end with the replay, whichever way it ends.
    let requests = cancel.child_token();
    let _cancel_requests = requests.clone().drop_guard();
    // Every request in flight sends one end, so this never holds more than `max_open`.
    let (tx, mut rx) = mpsc::channel::<Ended>(config.max_open.max(1));
    let mut open = 0usize;
    let started = Instant::now();
    let clock = |at: Instant| Nanos(at.duration_since(started).as_nanos() as u64);
    let mut next_progress = started + every;
    let mut stopped = false;
    while !replay.is_done() {
        let now = clock(Instant::now());
        replay.handle_timeout(now);
        while let Some(due) = replay.poll_request() {
            let late = now.as_nanos().saturating_sub(due.at.as_nanos());
            tally.lateness_ms.push(late as f64 / 1e6);
            if open >= config.max_open {
                replay.on_dropped(due.record, now);
                continue;
            }
            open += 1;
            tally.oracle.sent(&config.trace.records()[due.record]);
            observer.sent();
            let (config, client, url, tx, cancel) = (
                Arc::clone(&config),
                client.clone(),
                url.clone(),
                tx.clone(),
                requests.clone(),
            );
            tokio::spawn(async move {
                let body = body(&config, due.record);
                let request = stream_turn(
                    &client,
                    &url,
                    config.api_key.as_deref(),
                    body,
                    config.request_timeout,
                    0,
                );
                tokio::select! {
                    () = cancel.cancelled() => {}
                    result = request => {
                        let _ = tx.send((due.record, due.turn, result)).await;
                    }
                }
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
            _ = cancel.cancelled() => {
                stopped = true;
                break;
            }
            ended = rx.recv() => {
                let Some((record, turn, result)) = ended else { break };
                open -= 1;
                let now = clock(Instant::now());
                match &result {
                    Ok(r) => {
                        tally.finished(&config.trace.records()[record], r);
                        replay.on_finished(record, now);
                    }
                    Err(e) => {
                        tally.failed(e);
                        replay.on_failed(record, now);
                    }
                }
                observer.ended(turn, &result);
            }
            _ = tokio::time::sleep_until(wake.into()) => {}
        }
        if Instant::now() >= next_progress {
            observer.progress(&tally.snapshot(replay.stats(), started));
            next_progress = Instant::now() + every;
        }
    }
    requests.cancel();
    if stopped {
        tally.status.state = ReplayState::Stopped;
        tally.status.cancelled = replay.stats().open();
        observer.cancelled(tally.status.cancelled);
    } else {
        tally.status.state = ReplayState::Finished;
    }
    let status = tally.snapshot(replay.stats(), started);
    observer.progress(&status);
    status
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_keep_every_value_up_to_the_bound_then_a_reservoir_of_that_many() {
        let mut s = Samples::default();
        for i in 0..MAX_SAMPLES {
            s.push(i as f64);
        }
        assert_eq!(s.values.len(), MAX_SAMPLES);
        let exact = s.percentiles();
        assert_eq!(exact.p50, Some((MAX_SAMPLES / 2 - 1) as f64));
        // Twice as many again, all larger: the reservoir stays at the bound and the median
        // moves into the new values' range, as it would over all of them.
        for i in MAX_SAMPLES..3 * MAX_SAMPLES {
            s.push(i as f64);
        }
        assert_eq!(s.values.len(), MAX_SAMPLES);
        let p50 = s.percentiles().p50.unwrap();
        let whole = 1.5 * MAX_SAMPLES as f64;
        assert!((p50 - whole).abs() < 0.05 * whole, "{p50} vs {whole}");
    }
}
