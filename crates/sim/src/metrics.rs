//! Per-request records and the seed's metrics over measurement windows.
//!
//! Definitions (seeds 001 and 002), all client-side, i.e. from the turn's `issued_at`:
//!
//! - **TTFT** = first token − issued (includes any wait at the frontend and in the engine).
//! - **TPOT** = (E2E − TTFT) / (output tokens − 1); requests with one output token have none.
//! - **ITL** = the mean gap between consecutive tokens of a request, from the times the
//!   engine emitted them (token spans). Mean gaps telescope to (last − first) / (n − 1), so
//!   with no network between engine and client ITL equals TPOT here; the seed calls them
//!   "synonymous in this context" and reports them within a millisecond of each other.
//! - **E2E** = finish − issued.
//! - **Output tokens per second** = output tokens *emitted* inside the window / its length
//!   (a token counts when it is produced, not when its request finishes).
//! - **Requests per second** = requests finished inside the window / its length.
//! - **KV hit rate** = cached prompt tokens / prompt tokens, both as the engines saw them
//!   (`Finished` events) for requests finished inside the window. The oracle's rate is over
//!   the same requests.
//! - **Errors** = turns that failed inside the window (engine rejection, full frontend).
//! - With extended metrics ([`crate::SimConfig::extended_metrics`]): **TTFT of turn 1**
//!   and **of turns 2+**, the same TTFT split by the turn's place in its conversation (seed
//!   003: KV-aware routing can only help turns whose history exists).
//!
//! - With SLOs ([`crate::SimConfig::slo`]): **goodput** = finished requests whose TTFT and
//!   mean ITL both met their objective, per second (and as a share of the finished ones);
//!   with prefill/decode pools also the requests by route, the TTFT of split and of local
//!   requests, and the KV transfers of split requests ([`report::ServingMetrics`]).
//!
//! Which requests a window `(from, to]` covers: TTFT — requests whose first token arrived in
//! it; TPOT, ITL, E2E, RPS, hit rates — requests that finished in it (when the client
//! observes them, as the seed's load generator does). Percentiles are exact: the
//! nearest-rank value (the ⌈q·n⌉-th smallest) of all samples in the window, no histogram
//! ([`Percentiles`], shared with the results file and the load generator).

use nanotime::Nanos;
pub use report::Metrics;
use report::{Percentiles, ServingMetrics, Slo};
use serde::Serialize;

/// How a turn ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// Its last token arrived.
    Finished,
    /// The engine refused it (too long for the context or the pool, queue full).
    Rejected,
    /// The frontend queue was full, or the router could not place it.
    Dropped,
    /// Its worker crashed under it: the gateway's `worker_failed` error (fault runs).
    WorkerFailed,
    /// Its worker stopped answering: a stall timeout's `worker_timeout` error event, or a
    /// 504 after a second first-byte timeout (fault runs).
    WorkerTimeout,
    /// The gateway replica holding its client's connection died: the connection broke
    /// (`replica-restart` fault runs).
    GatewayFailed,
}

/// Where a request of a disaggregated fleet ran (`router::Route`, as a record keeps it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RouteTag {
    /// Prefill on a prefill worker, KV transferred, decode on a decode worker.
    Split,
    /// Prefill on the decode worker: its uncached prompt was short.
    LocalShort,
    /// Prefill on the decode worker: the prefill pool could not take it.
    LocalUnavailable,
    /// Prefill on the decode worker after its prefill worker failed (a retry).
    LocalRetry,
}

impl RouteTag {
    pub fn of(reason: &router::LocalReason) -> RouteTag {
        match reason {
            router::LocalReason::ShortPrefill => RouteTag::LocalShort,
            router::LocalReason::PrefillUnavailable(_) => RouteTag::LocalUnavailable,
            router::LocalReason::PrefillFailed => RouteTag::LocalRetry,
        }
    }
}

/// A split request's KV transfer from its prefill worker to its decode worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct KvTransfer {
    /// Prompt tokens moved (the prompt minus what the decode worker had cached).
    pub tokens: u32,
    pub bytes: u64,
    /// The link's modelled time for them (`HardwareProfile::kv_transfer_time`).
    pub time: Nanos,
}

/// Everything the simulator recorded about one turn.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RequestRecord {
    pub id: u64,
    pub conversation: u64,
    pub turn: u32,
    /// The worker it was routed to.
    pub worker: Option<u32>,
    pub issued_at: Nanos,
    pub routed_at: Option<Nanos>,
    pub first_token_at: Option<Nanos>,
    pub last_token_at: Option<Nanos>,
    /// When it finished or failed.
    pub ended_at: Nanos,
    pub prompt_tokens: u32,
    /// Prompt tokens the engine found in its prefix cache.
    pub cached_prompt_tokens: u32,
    /// Prompt tokens an oracle router over never-evicting workers would have found.
    pub oracle_cached_tokens: u32,
    /// Leading prompt blocks the router believed cached on the chosen worker.
    pub router_overlap_blocks: u32,
    /// The longest cached prefix, in blocks, the router knew of on any worker it could pick.
    pub router_available_blocks: u32,
    pub output_tokens: u32,
    /// Token events received (one per step, or per coalesced stretch in speed mode).
    pub token_spans: u32,
    pub preemptions: u32,
    pub outcome: Outcome,
    /// Disaggregated fleets: the route it ended on, its prefill worker (split requests) and
    /// its KV transfer (split requests that reached their decode worker). `worker` is the
    /// decode worker.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub route: Option<RouteTag>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefill_worker: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_transfer: Option<KvTransfer>,
}

impl RequestRecord {
    pub fn ttft(&self) -> Option<Nanos> {
        self.first_token_at
            .map(|t| t.saturating_sub(self.issued_at))
    }

    pub fn e2e(&self) -> Option<Nanos> {
        (self.outcome == Outcome::Finished).then(|| self.ended_at.saturating_sub(self.issued_at))
    }

    /// (E2E − TTFT) / (output tokens − 1), in seconds.
    pub fn tpot_secs(&self) -> Option<f64> {
        let (e2e, ttft) = (self.e2e()?, self.ttft()?);
        (self.output_tokens >= 2)
            .then(|| (e2e - ttft).as_secs_f64() / f64::from(self.output_tokens - 1))
    }

    /// Mean gap between consecutive tokens, in seconds.
    pub fn itl_secs(&self) -> Option<f64> {
        let (first, last) = (self.first_token_at?, self.last_token_at?);
        (self.outcome == Outcome::Finished && self.output_tokens >= 2)
            .then(|| (last - first).as_secs_f64() / f64::from(self.output_tokens - 1))
    }

    /// Whether it finished within both objectives (a one-token answer has no ITL to miss).
    pub fn meets(&self, slo: &Slo) -> bool {
        self.outcome == Outcome::Finished
            && self
                .ttft()
                .is_some_and(|t| t.as_millis_f64() <= slo.ttft_ms)
            && self.itl_secs().is_none_or(|s| s * 1e3 <= slo.itl_ms)
    }
}

/// What a window has seen of goodput, routes and transfers (with SLOs only).
#[derive(Debug, Clone, Default)]
struct ServingAcc {
    good: u64,
    routes: [u64; 4],
    ttft_split_ms: Vec<f64>,
    ttft_local_ms: Vec<f64>,
    transfer_ms: Vec<f64>,
    transfer_bytes: u64,
}

/// What one window `(from, to]` has seen so far: the samples its percentiles need and the
/// sums behind its rates. Requests are added as they end (and at their first token), so a
/// run keeps 4 numbers per request per window instead of every request's record.
#[derive(Debug, Clone, Default)]
pub struct WindowAcc {
    pub from: Nanos,
    pub to: Nanos,
    /// Keep TTFT split by turn too.
    pub split_turns: bool,
    ttft_ms: Vec<f64>,
    ttft_turn1_ms: Vec<f64>,
    ttft_later_ms: Vec<f64>,
    tpot_ms: Vec<f64>,
    itl_ms: Vec<f64>,
    e2e_s: Vec<f64>,
    prompt: u64,
    cached: u64,
    oracle_cached: u64,
    output: u64,
    finished: u64,
    errors: u64,
    /// Output tokens emitted inside the window.
    pub tokens: u64,
    /// Goodput against these objectives (and routes, per-route TTFT, transfers).
    pub slo: Option<Slo>,
    serving: ServingAcc,
    /// Reuse attribution in tokens of this block size (`None`: not kept).
    pub reuse_block_size: Option<u32>,
    available: u64,
    predicted: u64,
}

impl WindowAcc {
    pub fn new(from: Nanos, to: Nanos) -> Self {
        Self {
            from,
            to,
            ..Self::default()
        }
    }

    fn inside(&self, t: Nanos) -> bool {
        self.from < t && t <= self.to
    }

    /// Counts a request that ended (finished or failed), under the rules in the module docs.
    pub fn add(&mut self, r: &RequestRecord) {
        if let Some(t) = r.first_token_at.filter(|&t| self.inside(t)) {
            let ms = (t - r.issued_at).as_millis_f64();
            self.ttft_ms.push(ms);
            if self.slo.is_some() {
                match r.route {
                    Some(RouteTag::Split) => self.serving.ttft_split_ms.push(ms),
                    Some(_) => self.serving.ttft_local_ms.push(ms),
                    None => {}
                }
            }
            if self.split_turns {
                if r.turn == 0 {
                    self.ttft_turn1_ms.push(ms);
                } else {
                    self.ttft_later_ms.push(ms);
                }
            }
        }
        if !self.inside(r.ended_at) {
            return;
        }
        if r.outcome != Outcome::Finished {
            self.errors += 1;
            return;
        }
        self.finished += 1;
        self.prompt += u64::from(r.prompt_tokens);
        self.cached += u64::from(r.cached_prompt_tokens);
        self.oracle_cached += u64::from(r.oracle_cached_tokens);
        if let Some(block) = self.reuse_block_size {
            let tokens = |blocks: u32| {
                (u64::from(blocks) * u64::from(block)).min(u64::from(r.prompt_tokens))
            };
            self.available += tokens(r.router_available_blocks);
            self.predicted += tokens(r.router_overlap_blocks);
        }
        self.output += u64::from(r.output_tokens);
        if let Some(e) = r.e2e() {
            self.e2e_s.push(e.as_secs_f64());
        }
        if let Some(t) = r.tpot_secs() {
            self.tpot_ms.push(t * 1e3);
        }
        if let Some(t) = r.itl_secs() {
            self.itl_ms.push(t * 1e3);
        }
        if let Some(slo) = &self.slo {
            let s = &mut self.serving;
            s.good += u64::from(r.meets(slo));
            if let Some(route) = r.route {
                s.routes[route as usize] += 1;
            }
            if let Some(x) = &r.kv_transfer {
                s.transfer_ms.push(x.time.as_millis_f64());
                s.transfer_bytes += x.bytes;
            }
        }
    }

    /// Whether a request ending now could count in this window.
    pub fn touches(&self, r: &RequestRecord) -> bool {
        self.inside(r.ended_at) || r.first_token_at.is_some_and(|t| self.inside(t))
    }

    /// The window's metrics (`oracle`: whether the oracle ran).
    pub fn metrics(mut self, oracle: bool) -> Metrics {
        let secs = (self.to - self.from).as_secs_f64();
        let ratio = |a: u64, b: u64| (b > 0).then(|| a as f64 / b as f64);
        Metrics {
            ttft_ms: Percentiles::of(&mut self.ttft_ms),
            tpot_ms: Percentiles::of(&mut self.tpot_ms),
            itl_ms: Percentiles::of(&mut self.itl_ms),
            e2e_s: Percentiles::of(&mut self.e2e_s),
            output_tokens_per_s: self.tokens as f64 / secs,
            requests_per_s: self.finished as f64 / secs,
            kv_hit_rate: ratio(self.cached, self.prompt),
            oracle_hit_rate: if oracle {
                ratio(self.oracle_cached, self.prompt)
            } else {
                None
            },
            errors: self.errors as f64,
            requests: self.finished as f64,
            mean_prompt_tokens: ratio(self.prompt, self.finished),
            mean_output_tokens: ratio(self.output, self.finished),
            ttft_turn1_ms: self
                .split_turns
                .then(|| Percentiles::of(&mut self.ttft_turn1_ms)),
            ttft_later_ms: self
                .split_turns
                .then(|| Percentiles::of(&mut self.ttft_later_ms)),
            // Engine counters, filled per phase by the driver.
            acceptance_rate: None,
            tokens_per_step: None,
            serving: self.slo.is_some().then(|| {
                let s = &mut self.serving;
                let transfers = s.transfer_ms.len() as u64;
                ServingMetrics {
                    goodput_rps: s.good as f64 / secs,
                    goodput_share: ratio(s.good, self.finished),
                    split: s.routes[RouteTag::Split as usize] as f64,
                    local_short: s.routes[RouteTag::LocalShort as usize] as f64,
                    local_unavailable: s.routes[RouteTag::LocalUnavailable as usize] as f64,
                    local_retry: s.routes[RouteTag::LocalRetry as usize] as f64,
                    ttft_split_ms: Percentiles::of(&mut s.ttft_split_ms),
                    ttft_local_ms: Percentiles::of(&mut s.ttft_local_ms),
                    kv_transfer_ms: Percentiles::of(&mut s.transfer_ms),
                    kv_transfer_mb: ratio(s.transfer_bytes, transfers).map(|b| b / 1e6),
                    kv_transfer_mb_per_s: s.transfer_bytes as f64 / 1e6 / secs,
                    // Engine counters, filled per phase by the driver.
                    prefill_utilisation: None,
                    decode_utilisation: None,
                }
            }),
            reuse: self.reuse_block_size.map(|_| report::ReuseRates {
                available: ratio(self.available, self.prompt).unwrap_or(0.0),
                predicted: ratio(self.predicted, self.prompt).unwrap_or(0.0),
            }),
        }
    }
}

/// The metrics of window `(from, to]` over `records`, with `tokens` emitted in it.
pub fn of_window(
    records: &[RequestRecord],
    from: Nanos,
    to: Nanos,
    tokens: u64,
    oracle: bool,
) -> Metrics {
    let mut acc = WindowAcc::new(from, to);
    acc.tokens = tokens;
    for r in records {
        acc.add(r);
    }
    acc.metrics(oracle)
}

/// Tokens `start..end` of a span whose last token was emitted at `at` and whose previous
/// token was emitted at `prev`: the span's tokens are spread evenly over `(prev, at]` (one
/// token per step; in speed mode the engine reports a stretch of equal-length steps as one
/// span, and step lengths within it differ by well under a percent). Returns how many fall in
/// `(from, to]`. Exact when the span has one token.
pub fn tokens_in_window(prev: Nanos, at: Nanos, count: u32, from: Nanos, to: Nanos) -> u64 {
    tokens_at_or_before(prev, at, count, to) - tokens_at_or_before(prev, at, count, from)
}

/// How many of the span's tokens (token `m` = 1..=count at `prev + ⌊m·d/count⌋`) are at or
/// before `x`.
fn tokens_at_or_before(prev: Nanos, at: Nanos, count: u32, x: Nanos) -> u64 {
    let count = u64::from(count);
    if x >= at {
        return count;
    }
    if x < prev {
        return 0;
    }
    let d = u128::from((at - prev).0);
    // ⌊m·d/count⌋ ≤ x − prev  ⇔  m·d < (x − prev + 1)·count
    let rhs = u128::from((x - prev).0 + 1) * u128::from(count);
    // Largest m with m·d < rhs (d > 0 here since prev ≤ x < at).
    let m = (rhs - 1) / d;
    (m as u64).min(count)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn span_tokens_split_across_a_window_edge() {
        // 10 tokens over (1000, 2000]: token m at 1000 + 100·m.
        let (prev, at) = (Nanos(1000), Nanos(2000));
        assert_eq!(tokens_in_window(prev, at, 10, Nanos(0), Nanos(5000)), 10);
        assert_eq!(tokens_in_window(prev, at, 10, Nanos(1000), Nanos(1500)), 5);
        assert_eq!(tokens_in_window(prev, at, 10, Nanos(1499), Nanos(1500)), 1);
        assert_eq!(tokens_in_window(prev, at, 10, Nanos(1500), Nanos(1599)), 0);
        assert_eq!(tokens_in_window(prev, at, 10, Nanos(1950), Nanos(2000)), 1);
        assert_eq!(tokens_in_window(prev, at, 10, Nanos(2000), Nanos(3000)), 0);
        // Every split point partitions the span exactly.
        for cut in 900..2100 {
            let a = tokens_in_window(prev, at, 10, Nanos(0), Nanos(cut));
            let b = tokens_in_window(prev, at, 10, Nanos(cut), Nanos(9999));
            assert_eq!(a + b, 10, "cut {cut}");
        }
        // A one-token span counts exactly at its time.
        assert_eq!(
            tokens_in_window(Nanos(5), Nanos(7), 1, Nanos(6), Nanos(7)),
            1
        );
        assert_eq!(
            tokens_in_window(Nanos(5), Nanos(7), 1, Nanos(7), Nanos(9)),
            0
        );
    }
}
