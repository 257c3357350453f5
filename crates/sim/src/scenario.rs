//! Seed 004's scenario cycle in virtual time (`kvroute sim --scenario`): pools that change
//! size, the KEDA autoscalers and the auto-mode controller driving one simulated fleet.
//!
//! The decisions are the cores' — [`ScenarioController`] walks the cycle (mixes, rates,
//! scaling actions), [`Autoscaler`] makes KEDA's and the HPA's decisions from
//! [`HistogramWindow`]'s PromQL quantile — and this module only carries them out on a
//! [`Simulation`], one instant at a time:
//!
//! - **Auto mode** ([`ScalingMode::Auto`]): the scenario's `Scale` actions resize the pools;
//!   the autoscalers are paused (KEDA's paused annotation).
//! - **Manual mode** ([`ScalingMode::Autoscale`]): the scenario's mixes and rates run but its
//!   `Scale` actions are ignored; every polling interval each pool's autoscaler reads the
//!   gateway's histogram of its pool (`pool="prefill"` TTFT p95, `pool="decode"` ITL p95 over
//!   five minutes) and its decision resizes the pool.
//!
//! Resizing is one path for both: a pool grows by new, cold workers (serving after
//! [`ScenarioSpec::startup_delay`]) and shrinks by draining its **newest** workers (highest
//! id; a worker still starting is cancelled first): a draining worker takes no new request,
//! finishes those it holds, then leaves and the router forgets it and its blocks.
//!
//! Every [`ScenarioSpec::sample_interval`] the fleet's sizes and the pools' p95s (over the
//! trailing [`ScenarioSpec::recovery_window`] and over KEDA's window) are sampled; after the
//! run each phase gets its p95s, goodput and pool sizes, and each scale-up its recovery time
//! (see [`report::scenario`]). Optional sizing runs ([`size_pool`]) answer "what pool size
//! would have held the threshold" for a phase that did not recover.
//!
//! Sans-IO like the rest of the crate: time is virtual, randomness comes from the seed.

use std::collections::VecDeque;
use std::sync::Arc;

use nanotime::Nanos;
use report::scenario::{
    Recovery, ScaleEvent, ScenarioMeta, ScenarioPhase, ScenarioResults, ScenarioSample,
    ScenarioTotals, Sizing,
};
use router::Pool;
use router::autoscale::{
    Autoscaler, FRONTEND_ITL_BUCKETS, FRONTEND_TTFT_BUCKETS, HistogramWindow, ScalerConfig,
    ScalerConfigError, histogram_quantile,
};
use workload::scenario::{
    PoolKind, PoolSizes, ScenarioAction, ScenarioConfig, ScenarioController, ScenarioError,
};
use workload::{Assets, Mix, WorkloadConfig, WorkloadError};

use crate::chat::Chat;
use crate::config::{ConfigError, Phase, SimConfig};
use crate::driver::{PoolMetrics, SimError, Simulation};
use crate::metrics::{Outcome, RequestRecord};
use crate::workload::ServingPath;

/// The most cycles one run may walk.
pub const MAX_CYCLES: u32 = 100;

/// The quantile every trigger reads.
const P95: f64 = 0.95;

/// Who resizes the pools.
#[derive(Debug, Clone, PartialEq)]
pub enum ScalingMode {
    /// The scenario's scaling actions; the autoscalers paused.
    Auto,
    /// The KEDA autoscalers; the scenario's scaling actions ignored.
    Autoscale {
        prefill: ScalerConfig,
        decode: ScalerConfig,
    },
}

impl ScalingMode {
    /// Manual mode with seed 004's two ScaledObjects.
    pub fn seed004_autoscale() -> ScalingMode {
        ScalingMode::Autoscale {
            prefill: ScalerConfig::seed004_prefill(),
            decode: ScalerConfig::seed004_decode(),
        }
    }
}

/// One scenario run.
#[derive(Debug, Clone)]
pub struct ScenarioSpec {
    /// A disaggregated fleet (its pools' sizes are replaced by the scenario's `initial`).
    pub base: SimConfig,
    /// The workload's settings besides mix and rate, which the scenario sets.
    pub workload: WorkloadConfig,
    pub scenario: ScenarioConfig,
    /// `seed004` or the file's name, for the report.
    pub scenario_name: String,
    pub layout_name: String,
    pub profile_name: String,
    pub cycles: u32,
    pub mode: ScalingMode,
    /// The thresholds recovery is judged against (the scalers' in manual mode).
    pub prefill_scaler: ScalerConfig,
    pub decode_scaler: ScalerConfig,
    pub sample_interval: Nanos,
    pub recovery_window: Nanos,
    /// KEDA's `rate()` window.
    pub keda_window: Nanos,
    /// How long a new worker takes before it serves (0: at once).
    pub startup_delay: Nanos,
    /// After the run, size the pool of every scale-up that did not recover within its phase
    /// ([`size_pool`]: up to this many workers more than it got; 0: no sizing).
    pub sizing_steps: u32,
}

impl ScenarioSpec {
    /// Seed 004's settings around `base`: auto mode, one cycle, samples every 5 s, recovery
    /// judged over 30 s, KEDA's 5 minutes, workers serving at once.
    pub fn new(base: SimConfig, workload: WorkloadConfig, scenario: ScenarioConfig) -> Self {
        Self {
            base,
            workload,
            scenario,
            scenario_name: "seed004".into(),
            layout_name: String::new(),
            profile_name: String::new(),
            cycles: 1,
            mode: ScalingMode::Auto,
            prefill_scaler: ScalerConfig::seed004_prefill(),
            decode_scaler: ScalerConfig::seed004_decode(),
            sample_interval: Nanos::from_secs(5),
            recovery_window: Nanos::from_secs(30),
            keda_window: Nanos::from_secs(300),
            startup_delay: Nanos::ZERO,
            sizing_steps: 4,
        }
    }
}

/// Why a scenario run could not go on.
#[derive(Debug, thiserror::Error)]
pub enum ScenarioRunError {
    #[error(transparent)]
    Scenario(#[from] ScenarioError),
    #[error("autoscaler: {0}")]
    Scaler(#[from] ScalerConfigError),
    #[error("workload: {0}")]
    Workload(#[from] WorkloadError),
    #[error(transparent)]
    Sim(#[from] SimError),
    #[error(
        "a scenario runs on a disaggregated fleet: give --layout or --prefill-workers/--decode-workers"
    )]
    NotDisaggregated,
    #[error("cycles must be 1 to {MAX_CYCLES}, got {0}")]
    Cycles(u32),
    #[error("the sample interval and the recovery and KEDA windows must be longer than zero")]
    ZeroInterval,
}

fn pool_of(kind: PoolKind) -> Pool {
    match kind {
        PoolKind::Prefill => Pool::Prefill,
        PoolKind::Decode => Pool::Decode,
    }
}

fn kind_of(pool: Pool) -> PoolKind {
    match pool {
        Pool::Prefill => PoolKind::Prefill,
        Pool::Decode => PoolKind::Decode,
    }
}

type Sim = Simulation<ServingPath<Chat>>;

/// The simulation and the pools' bookkeeping around it.
struct Fleet {
    sim: Sim,
    /// Workers still starting: (serves at, pool), in order of their start.
    starting: VecDeque<(Nanos, Pool)>,
    events: Vec<ScaleEvent>,
    added: u64,
    /// The phase running, for the events' rows.
    phase: String,
}

impl Fleet {
    /// Workers serving, and draining, in `pool`.
    fn counts(&self, pool: Pool) -> (u32, u32) {
        let (serving, draining) = self.sim.pool_workers(Some(pool));
        (serving.len() as u32, draining.len() as u32)
    }

    /// The pool's size as its scaler sees it: serving plus starting (Kubernetes' replicas).
    fn size(&self, pool: Pool) -> u32 {
        let starting = self.starting.iter().filter(|(_, p)| *p == pool).count() as u32;
        self.counts(pool).0 + starting
    }

    /// Resizes `pool` to `to`: adds cold workers (after the start-up delay), or cancels
    /// starting ones and drains the newest serving ones.
    fn resize(
        &mut self,
        pool: Pool,
        to: u32,
        delay: Nanos,
        cause: String,
        value: Option<f64>,
    ) -> Result<(), SimError> {
        let from = self.size(pool);
        if to == from {
            return Ok(());
        }
        let now = self.sim.now();
        self.events.push(ScaleEvent {
            t_s: now.as_secs_f64(),
            pool: pool.as_str().into(),
            from,
            to,
            cause,
            value,
            phase: self.phase.clone(),
        });
        if to > from {
            for _ in from..to {
                self.added += 1;
                if delay == Nanos::ZERO {
                    self.sim.add_worker(Some(pool))?;
                } else {
                    self.starting.push_back((now.saturating_add(delay), pool));
                }
            }
            return Ok(());
        }
        let mut surplus = from - to;
        // Starting workers go first, newest first.
        while surplus > 0 {
            let Some(i) = self.starting.iter().rposition(|(_, p)| *p == pool) else {
                break;
            };
            self.starting.remove(i);
            self.added -= 1;
            surplus -= 1;
        }
        let (serving, _) = self.sim.pool_workers(Some(pool));
        for worker in serving.iter().rev().take(surplus as usize) {
            self.sim.drain_worker(*worker);
        }
        Ok(())
    }

    /// Starts the workers whose start-up ended by now.
    fn start_due(&mut self, now: Nanos) -> Result<(), SimError> {
        while self.starting.front().is_some_and(|(at, _)| *at <= now) {
            if let Some((_, pool)) = self.starting.pop_front() {
                self.sim.add_worker(Some(pool))?;
            }
        }
        Ok(())
    }
}

/// Sets the workload's mix and rate; a rate of 0 stops new sessions (the open loop refuses
/// 0, so the closed loop with no session open stands in for it).
fn apply_workload(sim: &mut Sim, mix: Option<Mix>, rate: Option<f64>) -> Result<(), WorkloadError> {
    let mut result = Ok(());
    sim.update_workload(|w, now| {
        let chat = &mut w.inner_mut().0;
        if let Some(mix) = mix
            && let Err(e) = chat.set_mix(mix)
        {
            result = Err(e);
            return;
        }
        if let Some(rate) = rate {
            result = if rate > 0.0 {
                chat.set_rate(Some(rate), now)
            } else {
                chat.set_concurrency(0, now);
                chat.set_rate(None, now)
            };
        }
    });
    result
}

/// The histograms' cumulative counts at one instant.
#[derive(Debug, Clone)]
struct Counts {
    prefill_ttft: Vec<u64>,
    local_ttft: Vec<u64>,
    decode_itl: Vec<u64>,
}

impl Counts {
    /// The simulation's histograms now (empty before any observation).
    fn of(sim: &Sim) -> Counts {
        sim.pool_metrics()
            .map_or_else(|| Counts::read(&PoolMetrics::default()), Counts::read)
    }

    fn read(m: &PoolMetrics) -> Counts {
        Counts {
            prefill_ttft: m.ttft(Some(Pool::Prefill)).cumulative(),
            local_ttft: m.ttft(Some(Pool::Decode)).cumulative(),
            decode_itl: m.itl(Some(Pool::Decode)).cumulative(),
        }
    }
}

/// The p95 of what was observed between two cumulative snapshots.
fn p95_between(bounds: &[f64], from: &[u64], to: &[u64]) -> Option<f64> {
    let increase: Vec<f64> = to
        .iter()
        .zip(from)
        .map(|(b, a)| b.saturating_sub(*a) as f64)
        .collect();
    histogram_quantile(P95, bounds, &increase)
}

/// The pools' p95 windows: the trailing recovery window and KEDA's.
struct Windows {
    ttft_recent: HistogramWindow,
    itl_recent: HistogramWindow,
    ttft_keda: HistogramWindow,
    itl_keda: HistogramWindow,
    last: Option<Nanos>,
}

impl Windows {
    fn new(recent: Nanos, keda: Nanos) -> Self {
        Self {
            ttft_recent: HistogramWindow::new(FRONTEND_TTFT_BUCKETS, recent),
            itl_recent: HistogramWindow::new(FRONTEND_ITL_BUCKETS, recent),
            ttft_keda: HistogramWindow::new(FRONTEND_TTFT_BUCKETS, keda),
            itl_keda: HistogramWindow::new(FRONTEND_ITL_BUCKETS, keda),
            last: None,
        }
    }

    /// One scrape at `now` (once per instant).
    fn scrape(&mut self, now: Nanos, m: &PoolMetrics) {
        if self.last == Some(now) {
            return;
        }
        self.last = Some(now);
        let c = Counts::read(m);
        self.ttft_recent.record(now, c.prefill_ttft.clone());
        self.ttft_keda.record(now, c.prefill_ttft);
        self.itl_recent.record(now, c.decode_itl.clone());
        self.itl_keda.record(now, c.decode_itl);
    }
}

/// Runs the scenario: see the module docs.
pub fn run_scenario(
    spec: &ScenarioSpec,
    assets: Arc<Assets>,
) -> Result<ScenarioResults, ScenarioRunError> {
    if spec.cycles == 0 || spec.cycles > MAX_CYCLES {
        return Err(ScenarioRunError::Cycles(spec.cycles));
    }
    if [spec.sample_interval, spec.recovery_window, spec.keda_window].contains(&Nanos::ZERO) {
        return Err(ScenarioRunError::ZeroInterval);
    }
    spec.scenario.validate()?;
    spec.prefill_scaler.validate()?;
    spec.decode_scaler.validate()?;
    let scenario = &spec.scenario;
    let mut cfg = spec.base.clone();
    let mut setup = cfg.disagg.ok_or(ScenarioRunError::NotDisaggregated)?;
    setup.prefill_workers = scenario.initial.prefill;
    setup.decode_workers = scenario.initial.decode;
    cfg.disagg = Some(setup);
    cfg.workers = setup.workers();
    let slo = *cfg.slo.get_or_insert(report::Slo::SEED_004);
    cfg.keep_all_records = true;
    // The oracle's memory is unbounded by definition, and nothing here reads it.
    cfg.oracle = false;
    // Ids are never reused: every worker a run may add, bounded by the cycles' actions (at
    // most `max` of each pool per phase) or the autoscalers' polls.
    let per_cycle =
        (scenario.max.prefill + scenario.max.decode).saturating_mul(scenario.phases.len() as u32);
    let polls = (scenario.cycle_s() / spec.prefill_scaler.polling_interval.as_secs_f64().max(1.0))
        .ceil() as u32;
    cfg.max_workers = Some(
        cfg.workers
            .saturating_add(
                per_cycle
                    .max(polls.saturating_mul(4))
                    .saturating_mul(spec.cycles),
            )
            .min(1 << 16),
    );

    let end = Nanos::from_secs_f64(scenario.cycle_s() * f64::from(spec.cycles));
    let phase = Phase {
        concurrency: 0,
        warmup: Nanos::ZERO,
        window: end,
        snapshots: 1,
        lookback: None,
    };
    let mut workload_cfg = spec.workload.clone();
    workload_cfg.rate_rps = (scenario.rate_rps > 0.0).then_some(scenario.rate_rps);
    if let Some(mix) = scenario.phases.iter().find_map(|p| p.mix) {
        workload_cfg.mix = mix;
    }
    let chat = Chat::new(&workload_cfg, Arc::clone(&assets), cfg.seed, 0)?;
    let workload = ServingPath::new(chat, cfg.path_latency);
    let sim = Simulation::new(cfg.clone(), workload, vec![phase])?.with_pool_metrics();
    let mut fleet = Fleet {
        sim,
        starting: VecDeque::new(),
        events: Vec::new(),
        added: 0,
        phase: String::new(),
    };

    let mut controller = ScenarioController::new(scenario.clone())?;
    let mut scalers = [
        Autoscaler::new(spec.prefill_scaler.clone(), Nanos::ZERO)?,
        Autoscaler::new(spec.decode_scaler.clone(), Nanos::ZERO)?,
    ];
    let auto = match &spec.mode {
        ScalingMode::Auto => {
            scalers.iter_mut().for_each(Autoscaler::pause);
            true
        }
        ScalingMode::Autoscale { prefill, decode } => {
            scalers = [
                Autoscaler::new(prefill.clone(), Nanos::ZERO)?,
                Autoscaler::new(decode.clone(), Nanos::ZERO)?,
            ];
            false
        }
    };
    let mut windows = Windows::new(spec.recovery_window, spec.keda_window);
    let mut samples: Vec<ScenarioSample> = Vec::new();
    let mut next_sample = Nanos::ZERO;
    // Phase instances: (cycle, name, start, mix, rate, counts at start, sizes at start).
    let mut phase_marks: Vec<PhaseMark> = Vec::new();
    let mut mix = workload_cfg.mix;
    let mut rate = scenario.rate_rps;

    let actions = controller.start(Nanos::ZERO, None)?;
    apply_actions(
        &actions,
        &mut fleet,
        auto,
        spec,
        &mut phase_marks,
        &mut mix,
        &mut rate,
    )?;

    loop {
        let mut next = end.min(next_sample);
        if let Some(t) = controller.poll_timeout() {
            next = next.min(t);
        }
        for scaler in &scalers {
            if let Some(t) = scaler.poll_timeout() {
                next = next.min(t);
            }
        }
        if let Some((t, _)) = fleet.starting.front() {
            next = next.min(*t);
        }
        let next = next.max(fleet.sim.now());
        fleet.sim.run_until(next)?;
        let now = next;
        fleet.start_due(now)?;
        let polling = scalers
            .iter()
            .any(|s| s.poll_timeout().is_some_and(|t| t <= now));
        if now >= next_sample || polling || now >= end {
            if let Some(m) = fleet.sim.pool_metrics() {
                windows.scrape(now, m);
            }
        }
        if now >= next_sample {
            samples.push(sample(&fleet, &windows, now));
            next_sample = now.saturating_add(spec.sample_interval);
        }
        if now >= end {
            break;
        }
        if controller.poll_timeout().is_some_and(|t| t <= now) {
            let actions = controller.handle_timeout(now);
            apply_actions(
                &actions,
                &mut fleet,
                auto,
                spec,
                &mut phase_marks,
                &mut mix,
                &mut rate,
            )?;
        }
        for (scaler, pool) in scalers.iter_mut().zip([Pool::Prefill, Pool::Decode]) {
            if scaler.poll_timeout().is_none_or(|t| t > now) {
                continue;
            }
            let value = match pool {
                Pool::Prefill => windows.ttft_keda.quantile(P95),
                Pool::Decode => windows.itl_keda.quantile(P95),
            };
            let current = fleet.size(pool);
            if let Some(d) = scaler.on_poll(now, value, current) {
                let cause = format!("autoscaler ({})", d.reason);
                fleet.resize(pool, d.to, spec.startup_delay, cause, Some(d.value))?;
            }
        }
    }

    let final_counts = Counts::of(&fleet.sim);
    let sizes_end = (fleet.counts(Pool::Prefill).0, fleet.counts(Pool::Decode).0);
    let arrivals_dropped = fleet.sim.workload().inner().0.stats().arrivals_dropped;
    let workers_retired = fleet.sim.retired().len() as u64;
    let Fleet {
        sim, events, added, ..
    } = fleet;
    let out = sim.finish();
    let phases = phase_rows(
        &phase_marks,
        &final_counts,
        sizes_end,
        end,
        &out.records,
        &slo,
    );
    let mut recoveries = recoveries(&events, &phases, &samples, spec);
    if spec.sizing_steps > 0 {
        for r in &mut recoveries {
            if r.recovered_after_s.is_some_and(|a| a <= r.phase_left_s) {
                continue;
            }
            let Some(mark) = phase_marks
                .iter()
                .rev()
                .find(|m| m.start.as_secs_f64() <= r.t_s)
            else {
                continue;
            };
            let Some(event) = events.iter().find(|e| e.t_s == r.t_s && e.pool == r.pool) else {
                continue;
            };
            let (pool, other) = if r.pool == Pool::Prefill.as_str() {
                (Pool::Prefill, mark.decode)
            } else {
                (Pool::Decode, mark.prefill)
            };
            if mark.rate <= 0.0 {
                continue;
            }
            let from = event.to + 1;
            r.needed = Some(size_pool(
                spec,
                Arc::clone(&assets),
                pool,
                other,
                mark.mix,
                mark.rate,
                from..=event.to + spec.sizing_steps,
                Nanos::from_secs(120),
                Nanos::from_secs(120),
            )?);
        }
    }
    let link = spec.base.disagg.map(|d| d.kv_link).unwrap_or_default();
    Ok(ScenarioResults {
        meta: ScenarioMeta {
            scenario: spec.scenario_name.clone(),
            layout: spec.layout_name.clone(),
            profile: spec.profile_name.clone(),
            kv_link: crate::disagg::link_name(link).into(),
            mode: if auto { "auto" } else { "autoscale" }.into(),
            cycles: spec.cycles,
            cycle_s: scenario.cycle_s(),
            seed: spec.base.seed,
            initial_prefill: scenario.initial.prefill,
            initial_decode: scenario.initial.decode,
            max_prefill: scenario.max.prefill,
            max_decode: scenario.max.decode,
            slo,
            ttft_threshold_s: spec.prefill_scaler.threshold,
            itl_threshold_s: spec.decode_scaler.threshold,
            polling_interval_s: spec.prefill_scaler.polling_interval.as_secs_f64(),
            keda_window_s: spec.keda_window.as_secs_f64(),
            recovery_window_s: spec.recovery_window.as_secs_f64(),
            sample_interval_s: spec.sample_interval.as_secs_f64(),
            startup_delay_s: spec.startup_delay.as_secs_f64(),
            path_latency_ms: spec.base.path_latency.as_secs_f64() * 1e3,
        },
        phases,
        events,
        recoveries,
        samples,
        totals: ScenarioTotals {
            issued: out.totals.issued,
            finished: out.totals.finished,
            failed: out.totals.failed,
            in_flight_at_end: out.totals.in_flight_at_end,
            workers_added: added,
            workers_retired,
            arrivals_dropped,
        },
    })
}

/// A phase as it began.
struct PhaseMark {
    cycle: u64,
    name: String,
    start: Nanos,
    mix: Mix,
    rate: f64,
    counts: Counts,
    prefill: u32,
    decode: u32,
    /// The sizes when it ended (before the next phase's actions).
    end_sizes: (u32, u32),
}

fn apply_actions(
    actions: &[ScenarioAction],
    fleet: &mut Fleet,
    auto: bool,
    spec: &ScenarioSpec,
    marks: &mut Vec<PhaseMark>,
    mix: &mut Mix,
    rate: &mut f64,
) -> Result<(), ScenarioRunError> {
    let now = fleet.sim.now();
    if actions
        .iter()
        .any(|a| matches!(a, ScenarioAction::EnterPhase { .. }))
        && let Some(last) = marks.last_mut()
    {
        last.end_sizes = (fleet.size(Pool::Prefill), fleet.size(Pool::Decode));
    }
    for action in actions {
        match action {
            ScenarioAction::EnterPhase { name, .. } => {
                fleet.phase = name.clone();
            }
            ScenarioAction::SetMix(m) => {
                *mix = *m;
                apply_workload(&mut fleet.sim, Some(*m), None)?;
            }
            ScenarioAction::SetRate(r) => {
                *rate = *r;
                apply_workload(&mut fleet.sim, None, Some(*r))?;
            }
            ScenarioAction::Scale { pool, to } => {
                if auto {
                    let cause = "scenario".to_string();
                    fleet.resize(pool_of(*pool), *to, spec.startup_delay, cause, None)?;
                }
            }
        }
    }
    // A phase's row starts after its own actions (its mix, rate and sizes).
    for action in actions {
        if let ScenarioAction::EnterPhase { name, cycle, .. } = action {
            let counts = Counts::of(&fleet.sim);
            marks.push(PhaseMark {
                cycle: *cycle,
                name: name.clone(),
                start: now,
                mix: *mix,
                rate: *rate,
                counts,
                prefill: fleet.size(Pool::Prefill),
                decode: fleet.size(Pool::Decode),
                end_sizes: (0, 0),
            });
        }
    }
    Ok(())
}

fn sample(fleet: &Fleet, w: &Windows, now: Nanos) -> ScenarioSample {
    let (prefill, prefill_draining) = fleet.counts(Pool::Prefill);
    let (decode, decode_draining) = fleet.counts(Pool::Decode);
    ScenarioSample {
        t_s: now.as_secs_f64(),
        phase: fleet.phase.clone(),
        prefill,
        decode,
        prefill_draining,
        decode_draining,
        ttft_p95_s: w.ttft_recent.quantile(P95),
        itl_p95_s: w.itl_recent.quantile(P95),
        keda_ttft_p95_s: w.ttft_keda.quantile(P95),
        keda_itl_p95_s: w.itl_keda.quantile(P95),
        in_flight: fleet.sim.in_flight() as u64,
    }
}

fn phase_rows(
    marks: &[PhaseMark],
    final_counts: &Counts,
    sizes_end: (u32, u32),
    end: Nanos,
    records: &[RequestRecord],
    slo: &report::Slo,
) -> Vec<ScenarioPhase> {
    marks
        .iter()
        .enumerate()
        .filter_map(|(i, mark)| {
            let next = marks.get(i + 1);
            let (to_counts, to, p_end, d_end) = match next {
                Some(n) => (&n.counts, n.start, mark.end_sizes.0, mark.end_sizes.1),
                None => (final_counts, end, sizes_end.0, sizes_end.1),
            };
            // A phase entered at the run's very end (the next cycle's first) has no time.
            if to <= mark.start {
                return None;
            }
            let arrived: Vec<&RequestRecord> = records
                .iter()
                .filter(|r| r.issued_at >= mark.start && r.issued_at < to)
                .collect();
            let finished: Vec<&&RequestRecord> = arrived
                .iter()
                .filter(|r| r.outcome == Outcome::Finished)
                .collect();
            let good = finished.iter().filter(|r| r.meets(slo)).count();
            let span = to.saturating_sub(mark.start).as_secs_f64();
            Some(ScenarioPhase {
                cycle: mark.cycle,
                name: mark.name.clone(),
                start_s: mark.start.as_secs_f64(),
                end_s: to.as_secs_f64(),
                mix: mark.mix.to_string(),
                rate_rps: mark.rate,
                requests: arrived.len() as u64,
                finished: finished.len() as u64,
                failed: arrived
                    .iter()
                    .filter(|r| r.outcome != Outcome::Finished)
                    .count() as u64,
                ttft_p95_s: p95_between(
                    FRONTEND_TTFT_BUCKETS,
                    &mark.counts.prefill_ttft,
                    &to_counts.prefill_ttft,
                ),
                local_ttft_p95_s: p95_between(
                    FRONTEND_TTFT_BUCKETS,
                    &mark.counts.local_ttft,
                    &to_counts.local_ttft,
                ),
                itl_p95_s: p95_between(
                    FRONTEND_ITL_BUCKETS,
                    &mark.counts.decode_itl,
                    &to_counts.decode_itl,
                ),
                goodput_rps: good as f64 / span.max(f64::MIN_POSITIVE),
                goodput_share: (!finished.is_empty()).then(|| good as f64 / finished.len() as f64),
                prefill_start: mark.prefill,
                prefill_end: p_end,
                decode_start: mark.decode,
                decode_end: d_end,
            })
        })
        .collect()
}

/// The recovery after every scale-up: the pool's trailing p95 against its threshold.
fn recoveries(
    events: &[ScaleEvent],
    phases: &[ScenarioPhase],
    samples: &[ScenarioSample],
    spec: &ScenarioSpec,
) -> Vec<Recovery> {
    events
        .iter()
        .filter(|e| e.to > e.from)
        .map(|e| {
            let prefill = e.pool == Pool::Prefill.as_str();
            let (metric, threshold) = if prefill {
                ("TTFT p95 (pool=\"prefill\")", spec.prefill_scaler.threshold)
            } else {
                ("ITL p95 (pool=\"decode\")", spec.decode_scaler.threshold)
            };
            let value = |s: &ScenarioSample| {
                if prefill { s.ttft_p95_s } else { s.itl_p95_s }
            };
            let phase_end = phases
                .iter()
                .find(|p| p.start_s <= e.t_s && e.t_s < p.end_s)
                .map_or(e.t_s, |p| p.end_s);
            let value_at_action = samples
                .iter()
                .rev()
                .find(|s| s.t_s <= e.t_s)
                .and_then(value);
            // Back under, and staying under for a whole trailing window (or to the run's
            // end): one quiet window is not a recovery.
            let hold = spec.recovery_window.as_secs_f64();
            let after: Vec<&ScenarioSample> = samples.iter().filter(|s| s.t_s > e.t_s).collect();
            let under = |s: &ScenarioSample| value(s).is_none_or(|v| v <= threshold);
            let recovered_after_s = if value_at_action.is_some_and(|v| v <= threshold) {
                Some(0.0)
            } else {
                after
                    .iter()
                    .enumerate()
                    .find(|(i, s)| {
                        value(s).is_some_and(|v| v <= threshold)
                            && after[*i..]
                                .iter()
                                .take_while(|x| x.t_s <= s.t_s + hold)
                                .all(|x| under(x))
                    })
                    .map(|(_, s)| s.t_s - e.t_s)
            };
            let peak_after_s = samples
                .iter()
                .filter(|s| s.t_s > e.t_s && s.t_s <= phase_end)
                .filter_map(value)
                .fold(None, |m: Option<f64>, v| Some(m.map_or(v, |m| m.max(v))));
            Recovery {
                t_s: e.t_s,
                pool: e.pool.clone(),
                phase: e.phase.clone(),
                metric: format!("{metric} over {:.0} s", spec.recovery_window.as_secs_f64()),
                threshold_s: threshold,
                value_at_action_s: value_at_action,
                recovered_after_s,
                phase_left_s: phase_end - e.t_s,
                peak_after_s,
                needed: None,
            }
        })
        .collect()
}

/// What-if sizing: a steady-state run of one phase's mix and rate with `pool` at each size
/// in `sizes` (the other pool at `other`), its metric's p95 over the stretch after
/// `warmup`. The smallest size at or under the threshold is the answer.
#[allow(
    clippy::too_many_arguments,
    reason = "one call site, every argument a plain value"
)]
pub fn size_pool(
    spec: &ScenarioSpec,
    assets: Arc<Assets>,
    pool: Pool,
    other: u32,
    mix: Mix,
    rate: f64,
    sizes: std::ops::RangeInclusive<u32>,
    warmup: Nanos,
    measured: Nanos,
) -> Result<Sizing, ScenarioRunError> {
    let threshold = match pool {
        Pool::Prefill => spec.prefill_scaler.threshold,
        Pool::Decode => spec.decode_scaler.threshold,
    };
    let mut tried = Vec::new();
    let mut size = None;
    for n in sizes {
        let mut cfg = spec.base.clone();
        let mut setup = cfg.disagg.ok_or(ScenarioRunError::NotDisaggregated)?;
        let sizes = match kind_of(pool) {
            PoolKind::Prefill => PoolSizes {
                prefill: n,
                decode: other,
            },
            PoolKind::Decode => PoolSizes {
                prefill: other,
                decode: n,
            },
        };
        if sizes.decode == 0 {
            continue;
        }
        setup.prefill_workers = sizes.prefill;
        setup.decode_workers = sizes.decode;
        cfg.disagg = Some(setup);
        cfg.workers = setup.workers();
        cfg.oracle = false;
        let mut wc = spec.workload.clone();
        wc.mix = mix;
        wc.rate_rps = Some(rate);
        let chat = Chat::new(&wc, Arc::clone(&assets), cfg.seed, 0)?;
        let workload = ServingPath::new(chat, cfg.path_latency);
        let phase = Phase {
            concurrency: 0,
            warmup: Nanos::ZERO,
            window: warmup.saturating_add(measured),
            snapshots: 1,
            lookback: None,
        };
        let mut sim = Simulation::new(cfg, workload, vec![phase])
            .map_err(|e| match e {
                SimError::Config(ConfigError::NoDecodeWorkers) => {
                    ScenarioRunError::NotDisaggregated
                }
                e => e.into(),
            })?
            .with_pool_metrics();
        sim.run_until(warmup)?;
        let before = Counts::of(&sim);
        let stop = warmup.saturating_add(measured);
        sim.run_until(stop)?;
        let after = Counts::of(&sim);
        let p95 = match pool {
            Pool::Prefill => p95_between(
                FRONTEND_TTFT_BUCKETS,
                &before.prefill_ttft,
                &after.prefill_ttft,
            ),
            Pool::Decode => {
                p95_between(FRONTEND_ITL_BUCKETS, &before.decode_itl, &after.decode_itl)
            }
        };
        tried.push((n, p95));
        if p95.is_some_and(|v| v <= threshold) {
            size = Some(n);
            break;
        }
    }
    Ok(Sizing {
        tried,
        size,
        warmup_s: warmup.as_secs_f64(),
        measured_s: measured.as_secs_f64(),
    })
}
