//! The engine: a vLLM-V1-style scheduler over the block pool, timed by a hardware profile.

use std::collections::VecDeque;
use std::sync::Arc;

use kv_index::{
    BlockContent, EngineBlockId, KvEvent, KvEventKind, LocalBlockHash, SequenceHash, StoredBlock,
    WorkerId,
};
use nanotime::Nanos;
use rustc_hash::FxHashMap;
use worker_limits::WorkerLimits;

use crate::pool::BlockPool;
use crate::profile::{HardwareProfile, Speculation, StepShape};
use crate::spec::{Drafter, SpecDecodeConfig, accepted_drafts};
use crate::types::{
    EngineConfig, EngineConfigError, EngineEvent, EngineMetrics, EngineRequest, Leg, OutputSpec,
    RejectReason, RequestId, TransferStart, pseudo_token,
};

/// Longest stretch of coalesced decode steps. A stretch that reaches it simply ends and the
/// next one is planned from the same state, so results do not depend on it; it bounds the
/// boundary buffer and the planning work an early interruption throws away.
const MAX_STRETCH_STEPS: usize = 512;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Waiting,
    Transferring,
    Running,
}

#[derive(Debug)]
struct Req {
    id: RequestId,
    /// Unique per submission: tells a step's item from a later request reusing the slot.
    serial: u64,
    prompt: Arc<[u32]>,
    output: OutputSpec,
    prompt_len: u32,
    /// Output tokens this worker produces before the request is done (1 when prefill-only).
    output_len: u32,
    /// Tokens whose KV is computed (prompt first, then outputs fed back).
    computed: u32,
    /// Output tokens produced so far.
    generated: u32,
    /// Pool blocks holding this request's KV, in order.
    blocks: Vec<u32>,
    /// Sequence and local hashes of the request's full blocks, computed lazily.
    hashes: Vec<SequenceHash>,
    locals: Vec<LocalBlockHash>,
    /// Leading blocks already in the prefix cache (hit, or registered after compute).
    registered: u32,
    cached_prompt_tokens: Option<u32>,
    preemptions: u32,
    state: State,
    /// The part of the request served here (never `Leg::ByRole`).
    leg: Leg,
    /// Decode leg: the prompt's KV still has to come from a prefill worker.
    remote: bool,
    ready_at: Nanos,
    /// Speculative decoding: this request's per-token acceptance probability (its content
    /// class's) and the speculative steps it has taken (the acceptance draw's counter).
    alpha: f64,
    spec_steps: u32,
}

impl Req {
    fn token(&self, i: usize) -> u32 {
        let p = self.prompt_len as usize;
        if i < p {
            self.prompt[i]
        } else {
            let j = (i - p) as u32;
            match &self.output {
                OutputSpec::Tokens(t) => t.get(j as usize).copied().unwrap_or(0),
                OutputSpec::Count(_) => pseudo_token(self.id, j),
            }
        }
    }

    /// Tokens known so far: the prompt and every output produced.
    fn known(&self) -> u32 {
        self.prompt_len + self.generated
    }

    /// Hashes the first `n` full blocks (callers keep `n × block_size ≤ known()`).
    fn ensure_hashes(&mut self, n: usize, block_size: usize, scratch: &mut Vec<u32>) {
        if self.hashes.len() >= n {
            return;
        }
        // Room for every block the request can fill, once: a turn hashes a few hundred.
        let all = (self.prompt_len + self.output_len) as usize / block_size;
        let more = all.max(n) - self.hashes.len();
        self.hashes.reserve(more);
        self.locals.reserve(more);
        let p = self.prompt_len as usize;
        while self.hashes.len() < n {
            let j = self.hashes.len();
            let (start, end) = (j * block_size, (j + 1) * block_size);
            let local = if end <= p {
                LocalBlockHash::of_tokens(&self.prompt[start..end])
            } else {
                // A block that reaches into the output: whole slices, not a token at a time
                // (a turn's reply fills dozens of blocks).
                scratch.clear();
                scratch.extend_from_slice(&self.prompt[start.min(p)..p]);
                let (from, to) = (start.max(p) - p, end - p);
                match &self.output {
                    OutputSpec::Tokens(t) => {
                        let have = t.len().min(to);
                        scratch.extend_from_slice(&t[from.min(have)..have]);
                        // Past the given tokens the request reads zeros (`Req::token`).
                        scratch.resize(end - start, 0);
                    }
                    OutputSpec::Count(_) => {
                        scratch.extend((from..to).map(|k| pseudo_token(self.id, k as u32)));
                    }
                }
                LocalBlockHash::of_tokens(scratch)
            };
            let parent = self.hashes.last().copied();
            self.hashes.push(SequenceHash::chain(parent, local));
            self.locals.push(local);
        }
    }
}

/// One request's share of a step.
#[derive(Debug, Clone, Copy)]
struct Item {
    slot: u32,
    serial: u64,
    /// Tokens fed to the model: a prefill chunk, or 1 + draft tokens when decoding.
    tokens: u32,
    decode: bool,
    draft: u32,
}

/// The request a planned step item was for, if it is still that request and still running
/// (it may have been cancelled, preempted or finished, and its slot reused, since planning).
fn running_req<'a>(reqs: &'a mut [Option<Req>], it: &Item) -> Option<&'a mut Req> {
    reqs.get_mut(it.slot as usize)?
        .as_mut()
        .filter(|r| r.serial == it.serial && r.state == State::Running)
}

#[derive(Debug, Clone, Copy)]
struct Step {
    start: Nanos,
    end: Nanos,
    /// Of the step, the time spent in speculative draft passes.
    draft: Nanos,
}

/// Speed mode: a run of identical decode-only steps over the batch in `items`.
#[derive(Debug, Default)]
struct Stretch {
    /// `bounds[i]` is when step `i` of the stretch ends (step 0 started at `Step::start`).
    bounds: Vec<Nanos>,
    /// Steps already applied to the requests.
    done: usize,
    /// Speculative decoding: per step, the tokens each item produced (`items.len()` entries
    /// per step, drawn when the stretch was planned), and each step's draft time.
    produced: Vec<u8>,
    draft: Vec<Nanos>,
}

#[derive(Debug, Default)]
struct Counters {
    prompt_tokens: u64,
    prefix_hit_tokens: u64,
    prefill_tokens: u64,
    tokens_generated: u64,
    steps: u64,
    busy: Nanos,
    decode_seq_steps: u64,
    decode_tokens: u64,
    spec_drafts: u64,
    spec_draft: u64,
    spec_accepted: u64,
    spec_accepted_per_pos: Vec<u64>,
    spec_draft_time: Nanos,
    preemptions: u64,
    finished: u64,
    cancelled: u64,
    rejected: u64,
}

/// A simulated inference worker. See the crate docs for the model and the driving protocol.
#[derive(Debug)]
pub struct Engine {
    cfg: EngineConfig,
    worker: WorkerId,
    block_size: u32,
    capacity: u32,
    weight_bytes: u64,
    /// Speculative decoding, when on with at least one draft token.
    spec: Option<Spec>,
    pool: BlockPool,
    reqs: Vec<Option<Req>>,
    free_slots: Vec<u32>,
    by_id: FxHashMap<RequestId, u32>,
    next_serial: u64,
    waiting: VecDeque<u32>,
    running: Vec<u32>,
    transferring: Vec<u32>,
    /// External KV transfers admitted and not yet announced (at most one per transferring
    /// request).
    transfer_starts: VecDeque<TransferStart>,
    items: Vec<Item>,
    step: Option<Step>,
    stretch: Option<Stretch>,
    spare_bounds: Vec<Nanos>,
    hist: Vec<u32>,
    events: VecDeque<EngineEvent>,
    kv_seq: u64,
    c: Counters,
    now: Nanos,
    scratch: Vec<u32>,
    /// The cached blocks `admit` found for the request it is admitting.
    hit_blocks: Vec<u32>,
    evicted: Vec<EngineBlockId>,
    /// Speed mode with speculation: per-item state while a stretch is planned, and the
    /// buffers of the last stretch for reuse.
    lanes: Vec<Lane>,
    spec_totals: Vec<u32>,
    spare_produced: Vec<u8>,
    spare_draft: Vec<Nanos>,
}

/// The engine's speculative-decoding settings, resolved.
#[derive(Debug, Clone)]
struct Spec {
    config: SpecDecodeConfig,
    k: u32,
    /// Priced from its size, unless a cost ratio is configured or the timing model cannot.
    drafter: Option<Drafter>,
    ratio: f64,
}

impl Spec {
    /// What the worker's declared timing prices (its mean acceptance over content classes).
    fn speculation(&self) -> Speculation {
        Speculation {
            draft_passes: self.k,
            drafter: self.drafter,
            draft_cost_ratio: self.ratio,
            tokens_per_step: self.config.mean_tokens_per_step(),
        }
    }
}

/// One running sequence while a speculative stretch is planned.
#[derive(Debug, Clone, Copy)]
struct Lane {
    computed: u32,
    blocks: u32,
    left: u32,
    serial: u64,
    alpha: f64,
    steps: u32,
    draft: u32,
}

fn blocks_for(tokens: u32, block_size: u32) -> usize {
    tokens.div_ceil(block_size) as usize
}

/// Counts `steps` speculative steps of one sequence that proposed `draft` tokens and produced
/// `produced` (1 + accepted) each, under vLLM's and TensorRT-LLM's definitions: a draft is
/// one sequence's proposal in one step; position `j` is accepted when `j + 1` drafts were.
fn count_spec(c: &mut Counters, draft: u32, produced: u32, steps: u64) {
    if draft == 0 {
        return;
    }
    let accepted = produced.saturating_sub(1);
    c.spec_drafts += steps;
    c.spec_draft += steps * u64::from(draft);
    c.spec_accepted += steps * u64::from(accepted);
    for slot in c.spec_accepted_per_pos.iter_mut().take(accepted as usize) {
        *slot += steps;
    }
}

impl Engine {
    /// A worker with `config`, publishing KV events as `worker`.
    pub fn new(config: EngineConfig, worker: WorkerId) -> Result<Engine, EngineConfigError> {
        if config.block_size == 0 {
            return Err(EngineConfigError::ZeroBlockSize);
        }
        if config.max_num_seqs == 0 {
            return Err(EngineConfigError::ZeroMaxNumSeqs);
        }
        if config.max_num_batched_tokens == 0 {
            return Err(EngineConfigError::ZeroBatchedTokens);
        }
        let f = config.free_gpu_memory_fraction;
        if !(f.is_finite() && f > 0.0 && f <= 1.0) {
            return Err(EngineConfigError::BadMemoryFraction(f));
        }
        if !(config.slowdown.is_finite() && config.slowdown >= 1.0) {
            return Err(EngineConfigError::BadSlowdown(config.slowdown));
        }
        config.profile.validate()?;
        if let Some(s) = &config.spec_decode {
            if let Some(problem) = s.problem() {
                return Err(EngineConfigError::BadSpecDecode(problem));
            }
        }
        let drafter = config.spec_decode.as_ref().map(SpecDecodeConfig::drafter);
        let draft_bytes = drafter.map_or(0, |d| d.weight_bytes);
        let draft_kv = drafter.map_or(0, |d| d.kv_bytes_per_token);
        let capacity = match config.num_gpu_blocks_override {
            Some(n) => u64::from(n),
            None => {
                config
                    .profile
                    .kv_capacity_blocks_with(config.block_size, f, draft_bytes, draft_kv)
            }
        };
        let capacity = u32::try_from(capacity)
            .unwrap_or(u32::MAX - 1)
            .min(u32::MAX - 1);
        if capacity == 0 {
            return Err(EngineConfigError::NoKvCapacity {
                profile: config.profile.name.clone(),
            });
        }
        let roofline = matches!(
            config.profile.timing,
            crate::profile::TimingModel::Roofline(_)
        );
        let spec = config
            .spec_decode
            .as_ref()
            .filter(|s| s.draft_len > 0)
            .map(|s| Spec {
                config: s.clone(),
                k: s.draft_len,
                drafter: (roofline && s.draft_cost_ratio.is_none()).then(|| s.drafter()),
                ratio: s.cost_ratio(),
            });
        let per_pos = spec.as_ref().map_or(0, |s| s.k as usize);
        Ok(Engine {
            block_size: config.block_size,
            capacity,
            weight_bytes: config.profile.weight_bytes + draft_bytes,
            spec,
            pool: BlockPool::new(capacity),
            reqs: Vec::new(),
            free_slots: Vec::new(),
            by_id: FxHashMap::default(),
            next_serial: 0,
            waiting: VecDeque::new(),
            running: Vec::new(),
            transferring: Vec::new(),
            transfer_starts: VecDeque::new(),
            items: Vec::new(),
            step: None,
            stretch: None,
            spare_bounds: Vec::new(),
            hist: vec![0; config.block_size as usize],
            events: VecDeque::new(),
            kv_seq: 0,
            c: Counters {
                spec_accepted_per_pos: vec![0; per_pos],
                ..Counters::default()
            },
            now: Nanos::ZERO,
            scratch: Vec::with_capacity(config.block_size as usize),
            hit_blocks: Vec::new(),
            evicted: Vec::new(),
            lanes: Vec::new(),
            spec_totals: Vec::new(),
            spare_produced: Vec::new(),
            spare_draft: Vec::new(),
            worker,
            cfg: config,
        })
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    pub fn profile(&self) -> &HardwareProfile {
        &self.cfg.profile
    }

    pub fn worker(&self) -> WorkerId {
        self.worker
    }

    /// Size of the KV pool in blocks.
    pub fn kv_capacity_blocks(&self) -> u32 {
        self.capacity
    }

    /// What this worker declares to routers: its batch limit, KV capacity and marginal
    /// timing. The engine server serves it in its `/info` card and announcements; the
    /// simulator hands it to its router.
    pub fn limits(&self) -> WorkerLimits {
        let capacity = u64::from(self.capacity);
        WorkerLimits {
            max_num_seqs: Some(self.cfg.max_num_seqs),
            kv_capacity_blocks: Some(capacity),
            timing: Some(self.cfg.profile.marginal_timing_with(
                self.cfg.block_size,
                capacity,
                self.spec.as_ref().map(Spec::speculation).as_ref(),
            )),
        }
    }

    /// True when no request is in the engine.
    pub fn is_idle(&self) -> bool {
        self.by_id.is_empty()
    }

    /// Requests in the engine (waiting, transferring or running).
    pub fn num_requests(&self) -> usize {
        self.by_id.len()
    }

    /// Whether request `id` waits for admission (`Some(false)`: it is running or receiving
    /// its KV; `None`: not in the engine). Lets a real-time driver measure queue time.
    pub fn is_waiting(&self, id: RequestId) -> Option<bool> {
        let slot = *self.by_id.get(&id)?;
        Some(matches!(self.req(slot).state, State::Waiting))
    }

    /// Submits a request at `now`. A bad request produces a `Rejected` event, never a panic.
    pub fn submit(&mut self, req: EngineRequest, now: Nanos) {
        self.submit_hashed(req, Vec::new(), Vec::new(), now);
    }

    /// [`Engine::submit`] with the block hashes already computed by the caller (a router
    /// hashes every prompt to route it, and a simulator knows the reply it asks for while it
    /// is still in cache; at a thousand workers hashing both again here is a measurable share
    /// of a run). `local` and `seq` are the local and sequence hashes, at this engine's block
    /// size, of the first full blocks of the prompt followed by the output: at least the
    /// prompt's full blocks, at most those of prompt and output. Any other length is ignored
    /// and the engine hashes the tokens itself.
    pub fn submit_hashed(
        &mut self,
        req: EngineRequest,
        local: Vec<LocalBlockHash>,
        seq: Vec<SequenceHash>,
        now: Nanos,
    ) {
        let now = self.enter(now);
        let leg = match self.check(&req) {
            Ok(leg) => leg,
            Err(reason) => {
                self.c.rejected += 1;
                self.events
                    .push_back(EngineEvent::Rejected { id: req.id, reason });
                return;
            }
        };
        let prompt_len = req.prompt.len() as u32;
        let alpha = self
            .spec
            .as_ref()
            .map_or(0.0, |s| s.config.acceptance_for(&req.prompt));
        let output_len = match leg {
            Leg::Prefill => 1,
            _ => req.output.len(),
        };
        let mut r = Req {
            id: req.id,
            serial: self.next_serial,
            prompt: req.prompt,
            output: req.output,
            prompt_len,
            output_len,
            computed: 0,
            generated: 0,
            blocks: Vec::new(),
            hashes: Vec::new(),
            locals: Vec::new(),
            registered: 0,
            cached_prompt_tokens: None,
            preemptions: 0,
            state: State::Waiting,
            leg,
            remote: leg == Leg::Decode,
            ready_at: Nanos::ZERO,
            alpha,
            spec_steps: 0,
        };
        let bs = self.block_size;
        let prompt_blocks = (prompt_len / bs) as usize;
        let all_blocks = ((prompt_len + output_len) / bs) as usize;
        if local.len() == seq.len() && (prompt_blocks.max(1)..=all_blocks).contains(&local.len()) {
            r.locals = local;
            r.hashes = seq;
            debug_assert!(
                {
                    let (local, seq) =
                        (std::mem::take(&mut r.locals), std::mem::take(&mut r.hashes));
                    r.ensure_hashes(local.len(), bs as usize, &mut self.scratch);
                    let same = r.locals == local && r.hashes == seq;
                    (r.locals, r.hashes) = (local, seq);
                    same
                },
                "submit_hashed: the caller's hashes do not match the prompt and output"
            );
        }
        self.next_serial += 1;
        let slot = match self.free_slots.pop() {
            Some(s) => {
                self.reqs[s as usize] = Some(r);
                s
            }
            None => {
                self.reqs.push(Some(r));
                self.reqs.len() as u32 - 1
            }
        };
        self.by_id.insert(req.id, slot);
        self.waiting.push_back(slot);
        if self.step.is_none() {
            self.start_step(now);
        }
    }

    /// Checks a submission; returns the leg it runs as here.
    fn check(&self, req: &EngineRequest) -> Result<Leg, RejectReason> {
        let role = self.cfg.role;
        let leg = req
            .leg
            .on(role)
            .ok_or(RejectReason::LegNotServed { role, leg: req.leg })?;
        if self.by_id.contains_key(&req.id) {
            return Err(RejectReason::DuplicateId);
        }
        if req.prompt.is_empty() {
            return Err(RejectReason::EmptyPrompt);
        }
        if req.output.is_empty() {
            return Err(RejectReason::NoOutput);
        }
        let p = req.prompt.len() as u64;
        let o = u64::from(req.output.len());
        let max = self.cfg.profile.max_context_tokens;
        if p + o > u64::from(max) {
            return Err(RejectReason::ContextTooLong { tokens: p + o, max });
        }
        // Worst case this worker holds at once: every token plus the speculative lookahead.
        let tokens = match leg {
            Leg::Prefill => p,
            _ => p + o + u64::from(self.spec.as_ref().map_or(0, |s| s.k)),
        };
        let blocks = tokens.div_ceil(u64::from(self.block_size));
        if blocks > u64::from(self.capacity) {
            return Err(RejectReason::TooLargeForPool {
                blocks,
                capacity: self.capacity,
            });
        }
        if self.waiting.len() >= self.cfg.max_waiting as usize {
            return Err(RejectReason::QueueFull {
                max: self.cfg.max_waiting,
            });
        }
        Ok(leg)
    }

    /// Cancels a request wherever it is. Unknown ids (finished, never submitted) are ignored.
    pub fn cancel(&mut self, id: RequestId, now: Nanos) {
        let now = self.enter(now);
        let Some(&slot) = self.by_id.get(&id) else {
            return;
        };
        let state = self.req(slot).state;
        match state {
            State::Waiting => self.waiting.retain(|&s| s != slot),
            State::Transferring => self.transferring.retain(|&s| s != slot),
            State::Running => self.running.retain(|&s| s != slot),
        }
        self.remove(slot);
        self.c.cancelled += 1;
        self.events
            .push_back(EngineEvent::Cancelled { id, at: now });
        if self.step.is_none() {
            self.start_step(now);
        }
    }

    /// With [`EngineConfig::external_kv_transfers`]: the next decode leg admitted since the
    /// last call, whose KV the driver now moves. Drivers drain this after every call, as
    /// they drain [`Engine::poll_event`].
    pub fn poll_transfer_start(&mut self) -> Option<TransferStart> {
        self.transfer_starts.pop_front()
    }

    /// With [`EngineConfig::external_kv_transfers`]: the KV of decode leg `id` has landed at
    /// `now`; it joins the running batch at the next step boundary. False (and nothing done)
    /// when `id` is not waiting for its KV here (cancelled meanwhile, or never announced).
    pub fn kv_arrived(&mut self, id: RequestId, now: Nanos) -> bool {
        let now = self.enter(now);
        let Some(&slot) = self.by_id.get(&id) else {
            return false;
        };
        let r = self.req_mut(slot);
        if r.state != State::Transferring || r.ready_at != Nanos::MAX {
            return false;
        }
        r.ready_at = now;
        self.advance(now);
        true
    }

    /// Brings the outputs up to `now`: a speed-mode stretch is cut at `now`, so the tokens of
    /// every step ended by then are emitted (as `cancel` and `submit` do). For a driver that
    /// stops driving the engine at `now` (the simulator's stopped worker).
    pub fn sync(&mut self, now: Nanos) {
        self.enter(now);
    }

    /// Completes every step (and KV transfer) that ended at or before `now`, starting the next
    /// step whenever there is work.
    pub fn handle_timeout(&mut self, now: Nanos) {
        let now = now.max(self.now);
        self.advance(now);
        self.now = now;
        if self.step.is_none() && !self.waiting.is_empty() {
            self.start_step(now);
        }
    }

    /// When the engine next needs [`Engine::handle_timeout`]: the end of the running step (or
    /// stretch), or the arrival of a KV transfer. `None` when there is nothing in flight.
    pub fn poll_timeout(&self) -> Option<Nanos> {
        let step = self.step_end();
        let xfer = self.next_transfer();
        match (step, xfer) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// The next output, in order.
    pub fn poll_event(&mut self) -> Option<EngineEvent> {
        self.events.pop_front()
    }

    /// Outputs not yet drained. The queue holds at most what the calls since the last drain
    /// produced; drivers drain after every call.
    pub fn pending_events(&self) -> usize {
        self.events.len()
    }

    /// Drops the whole prefix cache (a `Cleared` event). Blocks in use stay with their
    /// requests but are no longer shared.
    pub fn reset_prefix_cache(&mut self, now: Nanos) {
        self.enter(now);
        self.pool.clear_cache();
        self.emit_kv(KvEventKind::Cleared);
    }

    /// A snapshot of state and cumulative counters. In speed mode it reflects the last step
    /// boundary the engine has applied.
    pub fn metrics(&self) -> EngineMetrics {
        let used = self.pool.in_use();
        let kv_used_bytes =
            u64::from(used).saturating_mul(self.cfg.profile.block_bytes(self.block_size));
        EngineMetrics {
            running: self.running.len() as u32,
            waiting: self.waiting.len() as u32,
            transferring: self.transferring.len() as u32,
            kv_blocks_total: self.capacity,
            kv_blocks_used: used,
            kv_blocks_cached: self.pool.cached(),
            kv_usage: f64::from(used) / f64::from(self.capacity),
            prompt_tokens: self.c.prompt_tokens,
            prefix_hit_tokens: self.c.prefix_hit_tokens,
            prefill_tokens_computed: self.c.prefill_tokens,
            tokens_generated: self.c.tokens_generated,
            steps: self.c.steps,
            busy_time: self.c.busy,
            decode_seq_steps: self.c.decode_seq_steps,
            decode_tokens_generated: self.c.decode_tokens,
            spec_method: self.spec.as_ref().map(|s| s.config.method),
            spec_drafts: self.c.spec_drafts,
            spec_draft_tokens: self.c.spec_draft,
            spec_accepted_tokens: self.c.spec_accepted,
            spec_accepted_per_pos: self.c.spec_accepted_per_pos.clone(),
            spec_draft_time: self.c.spec_draft_time,
            preemptions: self.c.preemptions,
            finished: self.c.finished,
            cancelled: self.c.cancelled,
            rejected: self.c.rejected,
            weight_bytes: self.weight_bytes,
            kv_used_bytes,
            memory_used_bytes: self.weight_bytes.saturating_add(kv_used_bytes),
            gpu_memory_bytes: self.cfg.profile.gpu_memory_bytes,
        }
    }

    // ---- time -------------------------------------------------------------------------------

    /// Brings the engine to `now` before an input: steps ending at or before `now` complete, and
    /// a speed-mode stretch is cut back to the step in progress so the input is seen at the next
    /// step boundary, exactly as in one-step-at-a-time mode.
    fn enter(&mut self, now: Nanos) -> Nanos {
        let now = now.max(self.now);
        self.advance(now);
        self.truncate_stretch(now);
        self.now = now;
        now
    }

    fn advance(&mut self, now: Nanos) {
        loop {
            let step = self.step_end();
            let xfer = self.next_transfer();
            if let Some(te) = step {
                if te <= now && xfer.is_none_or(|tx| te <= tx) {
                    self.complete_current(te);
                    self.start_step(te);
                    continue;
                }
            }
            if let Some(tx) = xfer {
                if tx <= now {
                    self.truncate_stretch(tx);
                    self.complete_transfers(tx);
                    if self.step.is_none() {
                        self.start_step(tx);
                    }
                    continue;
                }
            }
            break;
        }
    }

    fn step_end(&self) -> Option<Nanos> {
        match (&self.step, &self.stretch) {
            (Some(_), Some(st)) => st.bounds.last().copied(),
            (Some(s), None) => Some(s.end),
            _ => None,
        }
    }

    /// The earliest KV arrival the engine knows the time of (an external transfer still on
    /// its links has none: `Nanos::MAX`).
    fn next_transfer(&self) -> Option<Nanos> {
        self.transferring
            .iter()
            .filter_map(|&s| self.reqs[s as usize].as_ref().map(|r| r.ready_at))
            .filter(|&t| t != Nanos::MAX)
            .min()
    }

    // ---- helpers ------------------------------------------------------------------------------

    fn req(&self, slot: u32) -> &Req {
        // Slots in the queues always hold a request: `remove` takes a slot out of every queue
        // before freeing it.
        self.reqs[slot as usize]
            .as_ref()
            .unwrap_or_else(|| unreachable!("queued slot {slot} is empty"))
    }

    fn req_mut(&mut self, slot: u32) -> &mut Req {
        self.reqs[slot as usize]
            .as_mut()
            .unwrap_or_else(|| unreachable!("queued slot {slot} is empty"))
    }

    fn emit_kv(&mut self, kind: KvEventKind) {
        let ev = KvEvent {
            worker: self.worker,
            seq: self.kv_seq,
            kind,
        };
        self.kv_seq += 1;
        self.events.push_back(EngineEvent::Kv(ev));
    }

    fn flush_evicted(&mut self) {
        if !self.evicted.is_empty() {
            let blocks = std::mem::take(&mut self.evicted);
            self.emit_kv(KvEventKind::Removed { blocks });
        }
    }

    /// Releases a request's blocks (deepest first, so its tail is evicted before its shared
    /// prefix) and forgets it. The caller has taken it out of its queue.
    fn remove(&mut self, slot: u32) {
        if let Some(r) = self.reqs[slot as usize].take() {
            for &b in r.blocks.iter().rev() {
                self.pool.release(b);
            }
            self.by_id.remove(&r.id);
            self.free_slots.push(slot);
        }
    }

    fn preempt(&mut self, slot: u32) {
        let Some(r) = self.reqs[slot as usize].as_mut() else {
            return;
        };
        for &b in r.blocks.iter().rev() {
            self.pool.release(b);
        }
        r.blocks.clear();
        r.computed = 0;
        r.registered = 0;
        r.preemptions += 1;
        r.state = State::Waiting;
        self.c.preemptions += 1;
        self.waiting.push_front(slot);
    }

    /// Allocates blocks until `slot` holds `n` of them. The caller checked availability.
    fn grow_blocks(&mut self, slot: u32, n: usize) {
        let Some(r) = self.reqs[slot as usize].as_mut() else {
            return;
        };
        while r.blocks.len() < n {
            match self.pool.allocate(&mut self.evicted) {
                Some(b) => r.blocks.push(b),
                None => break,
            }
        }
    }

    /// Enters the request's newly full computed blocks into the prefix cache and announces
    /// them: one `Stored` event per run of consecutive newly cached blocks.
    fn register_full_blocks(&mut self, slot: u32) {
        if !self.cfg.enable_prefix_caching {
            return;
        }
        let bs = self.block_size as usize;
        let with_tokens = self.cfg.kv_event_tokens;
        let Some(r) = self.reqs[slot as usize].as_mut() else {
            return;
        };
        let full = (r.computed as usize / bs).min(r.blocks.len());
        let from = r.registered as usize;
        if full <= from {
            return;
        }
        r.ensure_hashes(full, bs, &mut self.scratch);
        r.registered = full as u32;
        let mut run: Vec<StoredBlock> = Vec::new();
        let mut parent = None;
        let mut out: Vec<KvEventKind> = Vec::new();
        let stored = |r: &Req, j: usize| {
            if with_tokens {
                StoredBlock {
                    id: EngineBlockId(r.hashes[j].0),
                    content: BlockContent::Tokens(
                        (j * bs..(j + 1) * bs).map(|i| r.token(i)).collect(),
                    ),
                }
            } else {
                StoredBlock::from_hash(r.hashes[j], r.locals[j])
            }
        };
        for j in from..full {
            let h = r.hashes[j];
            if self.pool.register(r.blocks[j], h.0) {
                if run.is_empty() {
                    // A run's parent must be in the cache, or the stream announces a child of
                    // a block it already said was removed. The parent can be a private
                    // duplicate whose cached twin was evicted since: enter it (and any such
                    // ancestors) now, at the head of this run.
                    let mut start = j;
                    while start > 0
                        && self.pool.lookup(r.hashes[start - 1].0).is_none()
                        && self
                            .pool
                            .register(r.blocks[start - 1], r.hashes[start - 1].0)
                    {
                        start -= 1;
                    }
                    parent = (start > 0).then(|| EngineBlockId(r.hashes[start - 1].0));
                    run.extend((start..j).map(|k| stored(r, k)));
                }
                run.push(stored(r, j));
            } else if !run.is_empty() {
                out.push(KvEventKind::Stored {
                    parent,
                    blocks: std::mem::take(&mut run),
                });
            }
        }
        if !run.is_empty() {
            out.push(KvEventKind::Stored {
                parent,
                blocks: run,
            });
        }
        for kind in out {
            self.emit_kv(kind);
        }
    }

    // ---- scheduling ---------------------------------------------------------------------------

    /// Plans and starts the next step at `t`, as vLLM's V1 scheduler does: running requests
    /// first (decodes and unfinished prefill chunks, in admission order, within the token
    /// budget; when blocks run out the newest running request is preempted and recomputed
    /// later), then — only if nothing was preempted — waiting requests in FCFS order while
    /// sequences, budget and blocks allow.
    fn start_step(&mut self, t: Nanos) {
        if self.step.is_some() {
            return;
        }
        self.items.clear();
        let bs = self.block_size;
        let mut budget = self.cfg.max_num_batched_tokens;
        let mut preempted = false;
        let k = self.spec.as_ref().map_or(0, |s| s.k);
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let slot = self.running[i];
            let r = self.req(slot);
            let remaining = r.known() - r.computed;
            let decode = r.generated > 0 && remaining == 1;
            let (n, draft) = if decode {
                let d = k.min(budget - 1);
                (1 + d, d)
            } else {
                (remaining.min(budget), 0)
            };
            let serial = r.serial;
            let need = blocks_for(r.computed + n, bs).saturating_sub(r.blocks.len());
            let mut scheduled = true;
            while need > self.pool.available() as usize {
                let Some(victim) = self.running.pop() else {
                    scheduled = false;
                    break;
                };
                self.preempt(victim);
                preempted = true;
                if victim == slot {
                    scheduled = false;
                    break;
                }
            }
            if !scheduled {
                break;
            }
            let have = self.req(slot).blocks.len();
            self.grow_blocks(slot, have + need);
            self.items.push(Item {
                slot,
                serial,
                tokens: n,
                decode,
                draft,
            });
            budget -= n;
            i += 1;
        }
        let mut admitted = false;
        if !preempted {
            while let Some(&slot) = self.waiting.front() {
                let seqs = self.running.len() + self.transferring.len();
                if seqs >= self.cfg.max_num_seqs as usize {
                    break;
                }
                if !self.req(slot).remote && budget == 0 {
                    break;
                }
                if !self.admit(slot, t, &mut budget) {
                    break;
                }
                self.waiting.pop_front();
                admitted = true;
            }
        }
        self.flush_evicted();
        if self.items.is_empty() {
            return;
        }
        let shape = self.shape();
        let dur = self.step_time(&shape).max(Nanos(1));
        let draft = self.draft_time(&shape);
        let end = t + dur;
        self.step = Some(Step {
            start: t,
            end,
            draft,
        });
        if self.cfg.coalesce_decode && !preempted && !admitted {
            self.plan_stretch(end, &shape);
        }
    }

    /// Admits the head of the waiting queue: reuses its cached leading blocks, allocates the
    /// rest of its first chunk (or, for a remote prefill, of its prompt). False, with nothing
    /// changed, when the blocks are not there.
    fn admit(&mut self, slot: u32, t: Nanos, budget: &mut u32) -> bool {
        let bs = self.block_size;
        let caching = self.cfg.enable_prefix_caching;
        let Some(r) = self.reqs[slot as usize].as_mut() else {
            return false;
        };
        // Sampling needs the logits of the last known token, so it is always recomputed (as
        // vLLM does); a remote prefill needs no logits here.
        let max_hit_tokens = if r.remote {
            r.prompt_len
        } else {
            r.known() - 1
        };
        let max_hit_blocks = if caching {
            (max_hit_tokens / bs) as usize
        } else {
            0
        };
        r.ensure_hashes(max_hit_blocks, bs as usize, &mut self.scratch);
        self.hit_blocks.clear();
        let mut evictable_hits = 0usize;
        while self.hit_blocks.len() < max_hit_blocks {
            match self.pool.lookup(r.hashes[self.hit_blocks.len()].0) {
                Some(b) => {
                    evictable_hits += usize::from(self.pool.is_evictable(b));
                    self.hit_blocks.push(b);
                }
                None => break,
            }
        }
        let hits = self.hit_blocks.len();
        let hit_tokens = hits as u32 * bs;
        let n = if r.remote {
            0
        } else {
            (r.known() - hit_tokens).min(*budget)
        };
        let target_tokens = if r.remote {
            r.prompt_len
        } else {
            hit_tokens + n
        };
        let need = blocks_for(target_tokens, bs).saturating_sub(hits);
        if need > (self.pool.available() as usize).saturating_sub(evictable_hits) {
            return false;
        }
        for &b in &self.hit_blocks {
            self.pool.acquire(b);
            r.blocks.push(b);
        }
        r.registered = hits as u32;
        r.computed = hit_tokens;
        if r.cached_prompt_tokens.is_none() {
            let cached = hit_tokens.min(r.prompt_len);
            r.cached_prompt_tokens = Some(cached);
            self.c.prompt_tokens += u64::from(r.prompt_len);
            self.c.prefix_hit_tokens += u64::from(cached);
        }
        let serial = r.serial;
        if r.remote {
            let tokens = u64::from(r.prompt_len - hit_tokens);
            if self.cfg.external_kv_transfers {
                // The driver times it; it lands with `kv_arrived`.
                r.ready_at = Nanos::MAX;
                self.transfer_starts.push_back(TransferStart {
                    id: r.id,
                    tokens,
                    bytes: tokens.saturating_mul(self.cfg.profile.kv_bytes_per_token),
                    at: t,
                });
            } else {
                r.ready_at = t + self.cfg.profile.kv_transfer_time(tokens, self.cfg.kv_link);
            }
            r.state = State::Transferring;
            self.transferring.push(slot);
        } else {
            r.state = State::Running;
            self.running.push(slot);
            self.items.push(Item {
                slot,
                serial,
                tokens: n,
                decode: false,
                draft: 0,
            });
            *budget -= n;
        }
        self.grow_blocks(slot, hits + need);
        true
    }

    /// The shape of the planned step, for the timing model.
    fn shape(&self) -> StepShape {
        let mut s = StepShape {
            kv_pool_blocks: u64::from(self.capacity),
            ..StepShape::default()
        };
        for it in &self.items {
            let r = self.req(it.slot);
            let n = u64::from(it.tokens);
            let c = u64::from(r.computed);
            if it.decode {
                s.decode_seqs += 1;
                s.decode_tokens += n;
                s.decode_context_tokens += c + n;
                s.decode_kv_blocks += r.blocks.len() as u64;
                s.draft_passes = s.draft_passes.max(it.draft);
            } else {
                s.prefill_tokens += n;
                s.prefill_attention_pairs += n * c + n * (n + 1) / 2;
            }
        }
        if let Some(spec) = &self.spec {
            s.drafter = spec.drafter;
            s.draft_cost_ratio = spec.ratio;
        }
        s
    }

    /// Of a step of this shape, the time its speculative draft passes take.
    fn draft_time(&self, shape: &StepShape) -> Nanos {
        if self.spec.is_none() {
            return Nanos::ZERO;
        }
        Nanos::from_secs_f64(self.cfg.profile.draft_secs(shape) * self.cfg.slowdown)
    }

    /// A step's duration on this GPU: the profile's, times the configured slowdown (exactly
    /// the profile's at 1).
    fn step_time(&self, shape: &StepShape) -> Nanos {
        let t = self.cfg.profile.step_time(shape);
        if self.cfg.slowdown == 1.0 {
            t
        } else {
            Nanos::from_secs_f64(t.as_secs_f64() * self.cfg.slowdown)
        }
    }

    /// Speed mode: the step just planned is decode-only, every running request is in it and
    /// nothing waiting can get in until the batch changes. Plans the following identical
    /// steps up to the first finish (or the step that would run out of blocks) with O(1) work
    /// per step: context grows by one token per sequence per step, and a sequence needs a new
    /// block every `block_size` steps (tracked by a histogram of spare slots).
    fn plan_stretch(&mut self, end0: Nanos, shape0: &StepShape) {
        if self.items.len() != self.running.len() || self.items.iter().any(|it| !it.decode) {
            return;
        }
        if self.spec.is_some() {
            self.plan_spec_stretch(end0, shape0);
            return;
        }
        let bs = self.block_size as usize;
        let mut steps_left = u32::MAX;
        self.hist.iter_mut().for_each(|h| *h = 0);
        for it in &self.items {
            let Some(r) = self.reqs[it.slot as usize].as_ref() else {
                return;
            };
            steps_left = steps_left.min(r.output_len - r.generated);
            let spare = (r.blocks.len() * bs).saturating_sub(r.computed as usize + 1);
            if spare >= bs {
                return;
            }
            self.hist[spare] += 1;
        }
        let n_max = (steps_left as usize).min(MAX_STRETCH_STEPS);
        if n_max < 2 {
            return;
        }
        let m = self.items.len() as u64;
        let avail = u64::from(self.pool.available());
        let mut bounds = std::mem::take(&mut self.spare_bounds);
        bounds.clear();
        bounds.push(end0);
        let mut shape = *shape0;
        let mut needed = 0u64;
        let mut t = end0;
        for k in 1..n_max {
            let new = u64::from(self.hist[(k - 1) % bs]);
            if needed + new > avail {
                break;
            }
            needed += new;
            shape.decode_kv_blocks += new;
            shape.decode_context_tokens += m;
            t += self.step_time(&shape).max(Nanos(1));
            bounds.push(t);
        }
        if bounds.len() >= 2 {
            self.stretch = Some(Stretch {
                bounds,
                done: 0,
                produced: Vec::new(),
                draft: Vec::new(),
            });
        } else {
            self.spare_bounds = bounds;
        }
    }

    /// Speed mode under speculative decoding: as [`Engine::plan_stretch`], but each step's
    /// outcome differs per sequence (1 + accepted drafts), so planning is O(batch) per step:
    /// every sequence's acceptance is drawn now (the counter-based draw step-by-step mode
    /// makes at the step's end), its context and lookahead blocks advanced, and the step
    /// priced. Ends at the first step where a sequence finishes, before a step whose blocks
    /// would not fit, or at the length bound.
    fn plan_spec_stretch(&mut self, end0: Nanos, shape0: &StepShape) {
        let bs = self.block_size;
        let seed = self.cfg.seed;
        let mut lanes = std::mem::take(&mut self.lanes);
        lanes.clear();
        for it in &self.items {
            let Some(r) = self.reqs[it.slot as usize].as_ref() else {
                self.lanes = lanes;
                return;
            };
            lanes.push(Lane {
                computed: r.computed,
                blocks: r.blocks.len() as u32,
                left: r.output_len - r.generated,
                serial: r.serial,
                alpha: r.alpha,
                steps: r.spec_steps,
                draft: it.draft,
            });
        }
        let avail = u64::from(self.pool.available());
        let mut bounds = std::mem::take(&mut self.spare_bounds);
        let mut produced = std::mem::take(&mut self.spare_produced);
        let mut drafts = std::mem::take(&mut self.spare_draft);
        bounds.clear();
        produced.clear();
        drafts.clear();
        bounds.push(end0);
        drafts.push(self.draft_time(shape0));
        let mut shape = *shape0;
        let mut needed = 0u64;
        let mut t = end0;
        loop {
            // The outcome of the last planned step.
            let mut finishes = false;
            for l in lanes.iter_mut() {
                let accepted = accepted_drafts(seed, l.serial, l.steps, l.alpha, l.draft);
                let p = (1 + accepted).min(l.left);
                produced.push(p as u8);
                l.computed += p;
                l.left -= p;
                l.steps += 1;
                finishes |= l.left == 0;
            }
            if finishes || bounds.len() >= MAX_STRETCH_STEPS {
                break;
            }
            // The next step: every sequence feeds 1 + its drafts and holds their blocks.
            let (mut new, mut context, mut held) = (0u64, 0u64, 0u64);
            for l in lanes.iter_mut() {
                let want = blocks_for(l.computed + 1 + l.draft, bs) as u32;
                let grow = want.saturating_sub(l.blocks);
                new += u64::from(grow);
                l.blocks += grow;
                context += u64::from(l.computed + 1 + l.draft);
                held += u64::from(l.blocks);
            }
            if needed + new > avail {
                break;
            }
            needed += new;
            shape.decode_context_tokens = context;
            shape.decode_kv_blocks = held;
            t += self.step_time(&shape).max(Nanos(1));
            bounds.push(t);
            drafts.push(self.draft_time(&shape));
        }
        self.lanes = lanes;
        // `produced` holds one entry per lane for every planned step.
        produced.truncate(bounds.len() * self.items.len());
        if bounds.len() >= 2 {
            self.stretch = Some(Stretch {
                bounds,
                done: 0,
                produced,
                draft: drafts,
            });
        } else {
            self.spare_bounds = bounds;
            self.spare_produced = produced;
            self.spare_draft = drafts;
        }
    }

    /// Returns a finished or cut stretch's buffers for the next one.
    fn recycle(&mut self, st: Stretch) {
        self.spare_bounds = st.bounds;
        self.spare_produced = st.produced;
        self.spare_draft = st.draft;
    }

    /// Completes the step (or whole stretch) ending at `te`.
    fn complete_current(&mut self, te: Nanos) {
        if let Some(st) = self.stretch.as_ref() {
            let n = st.bounds.len();
            self.materialize(n, false);
            if let Some(st) = self.stretch.take() {
                self.recycle(st);
            }
            self.step = None;
            return;
        }
        let Some(step) = self.step.take() else {
            return;
        };
        self.c.steps += 1;
        self.c.busy += step.end - step.start;
        self.c.spec_draft_time += step.draft;
        let seed = self.cfg.seed;
        for idx in 0..self.items.len() {
            let it = self.items[idx];
            let Some(r) = running_req(&mut self.reqs, &it) else {
                continue;
            };
            let produced = if it.decode {
                let accepted = if it.draft > 0 {
                    accepted_drafts(seed, r.serial, r.spec_steps, r.alpha, it.draft)
                } else {
                    0
                };
                r.spec_steps += 1;
                let produce = (1 + accepted).min(r.output_len - r.generated);
                r.computed += produce;
                self.c.decode_seq_steps += 1;
                self.c.decode_tokens += u64::from(produce);
                count_spec(&mut self.c, it.draft, produce, 1);
                produce
            } else {
                r.computed += it.tokens;
                self.c.prefill_tokens += u64::from(it.tokens);
                u32::from(r.computed == r.known())
            };
            self.register_full_blocks(it.slot);
            if produced > 0 {
                self.produce(it.slot, produced, te);
            }
        }
        self.sweep_running();
    }

    /// Records `count` new output tokens of `slot` at `at`; finishes the request when done.
    fn produce(&mut self, slot: u32, count: u32, at: Nanos) {
        let Some(r) = self.reqs[slot as usize].as_mut() else {
            return;
        };
        let start = r.generated;
        r.generated += count;
        let end = r.generated;
        let id = r.id;
        self.c.tokens_generated += u64::from(count);
        if start == 0 {
            self.events.push_back(EngineEvent::FirstToken { id, at });
        }
        self.events
            .push_back(EngineEvent::Tokens { id, start, end, at });
        if end < r.output_len {
            return;
        }
        let ev = if r.leg == Leg::Prefill {
            EngineEvent::PrefillDone {
                id,
                at,
                prompt_tokens: r.prompt_len,
                cached_prompt_tokens: r.cached_prompt_tokens.unwrap_or(0),
            }
        } else {
            EngineEvent::Finished {
                id,
                at,
                prompt_tokens: r.prompt_len,
                cached_prompt_tokens: r.cached_prompt_tokens.unwrap_or(0),
                output_tokens: end,
                preemptions: r.preemptions,
            }
        };
        self.events.push_back(ev);
        self.c.finished += 1;
        // Taken out of `running` by `sweep_running`, which skips emptied slots.
        self.remove(slot);
    }

    fn sweep_running(&mut self) {
        let reqs = &self.reqs;
        self.running.retain(|&s| {
            reqs[s as usize]
                .as_ref()
                .is_some_and(|r| r.state == State::Running)
        });
    }

    /// Applies steps `done..upto` of the stretch to its requests (tokens, filled blocks,
    /// finishes), and, when a step is still in progress after them, allocates its blocks.
    fn materialize(&mut self, upto: usize, in_progress: bool) {
        let Some(st) = self.stretch.as_mut() else {
            return;
        };
        let upto = upto.min(st.bounds.len());
        let done = st.done;
        if upto <= done {
            return;
        }
        let at = st.bounds[upto - 1];
        let from = if done == 0 {
            self.step.map_or(at, |s| s.start)
        } else {
            st.bounds[done - 1]
        };
        st.done = upto;
        let s = (upto - done) as u32;
        self.c.steps += u64::from(s);
        self.c.busy += at - from;
        if self.spec.is_some() {
            self.materialize_spec(done, upto, in_progress, at);
            return;
        }
        // All allocations first, as the steps' plans made them before any request finished:
        // a block released by a finishing request must not feed a neighbour's earlier step.
        let bs = self.block_size;
        for idx in 0..self.items.len() {
            let it = self.items[idx];
            let Some(r) = running_req(&mut self.reqs, &it) else {
                continue;
            };
            r.computed += s;
            let want = blocks_for(r.computed + u32::from(in_progress), bs);
            self.grow_blocks(it.slot, want);
        }
        for idx in 0..self.items.len() {
            let it = self.items[idx];
            if running_req(&mut self.reqs, &it).is_none() {
                continue;
            }
            self.c.decode_seq_steps += u64::from(s);
            self.c.decode_tokens += u64::from(s);
            self.register_full_blocks(it.slot);
            self.produce(it.slot, s, at);
        }
        self.flush_evicted();
        self.sweep_running();
    }

    /// [`Engine::materialize`] under speculative decoding: each item produced the tokens its
    /// planned draws gave. Blocks are what step-by-step mode holds after those steps: the
    /// lookahead of the last applied step (each step allocates `computed + 1 + drafts`), or of
    /// the step in progress.
    fn materialize_spec(&mut self, done: usize, upto: usize, in_progress: bool, at: Nanos) {
        let Some(st) = self.stretch.as_ref() else {
            return;
        };
        let n = self.items.len();
        let draft_time = st.draft[done..upto].iter().fold(Nanos::ZERO, |a, &d| a + d);
        self.c.spec_draft_time += draft_time;
        let bs = self.block_size;
        let steps = (upto - done) as u32;
        let mut totals = std::mem::take(&mut self.spec_totals);
        totals.clear();
        for idx in 0..n {
            let it = self.items[idx];
            let Some(st) = self.stretch.as_ref() else {
                break;
            };
            let per_step = |j: usize| u32::from(st.produced.get(j * n + idx).copied().unwrap_or(1));
            let total: u32 = (done..upto).map(per_step).sum();
            let last = per_step(upto - 1);
            totals.push(total);
            let Some(r) = running_req(&mut self.reqs, &it) else {
                continue;
            };
            let before_last = r.computed + total - last;
            r.computed += total;
            r.spec_steps += steps;
            let lookahead = if in_progress { r.computed } else { before_last };
            let want = blocks_for(lookahead + 1 + it.draft, bs);
            self.grow_blocks(it.slot, want);
        }
        for idx in 0..n {
            let it = self.items[idx];
            if running_req(&mut self.reqs, &it).is_none() {
                continue;
            }
            let total = totals.get(idx).copied().unwrap_or(0);
            self.c.decode_seq_steps += u64::from(steps);
            self.c.decode_tokens += u64::from(total);
            if let Some(st) = self.stretch.as_ref() {
                for j in done..upto {
                    let p = u32::from(st.produced.get(j * n + idx).copied().unwrap_or(1));
                    count_spec(&mut self.c, it.draft, p, 1);
                }
            }
            self.register_full_blocks(it.slot);
            self.produce(it.slot, total, at);
        }
        self.spec_totals = totals;
        self.flush_evicted();
        self.sweep_running();
    }

    /// Cuts a stretch back so that the step in progress at `t` is the last one: steps ending
    /// at or before `t` are applied, the one in progress becomes an ordinary step.
    fn truncate_stretch(&mut self, t: Nanos) {
        let Some(st) = self.stretch.as_ref() else {
            return;
        };
        let k = st.bounds.partition_point(|&b| b <= t);
        if k >= st.bounds.len() {
            // Whole stretch over: `advance` completes it as a normal step end.
            return;
        }
        let start = if k == 0 {
            self.step.map_or(t, |s| s.start)
        } else {
            st.bounds[k - 1]
        };
        let end = st.bounds[k];
        let draft = st.draft.get(k).copied().unwrap_or(Nanos::ZERO);
        self.materialize(k, true);
        if let Some(st) = self.stretch.take() {
            self.recycle(st);
        }
        if !self.items.is_empty() {
            self.step = Some(Step { start, end, draft });
        }
    }

    /// KV transfers that arrived by `tx` join the running batch (decode-only role).
    fn complete_transfers(&mut self, tx: Nanos) {
        let mut i = 0;
        while i < self.transferring.len() {
            let slot = self.transferring[i];
            if self.req(slot).ready_at > tx {
                i += 1;
                continue;
            }
            self.transferring.remove(i);
            let r = self.req_mut(slot);
            r.computed = r.prompt_len;
            r.remote = false;
            r.state = State::Running;
            // Output index 0 came from the prefill worker.
            r.generated = 1;
            let done = r.generated >= r.output_len;
            self.register_full_blocks(slot);
            if done {
                let r = self.req(slot);
                let ev = EngineEvent::Finished {
                    id: r.id,
                    at: tx,
                    prompt_tokens: r.prompt_len,
                    cached_prompt_tokens: r.cached_prompt_tokens.unwrap_or(0),
                    output_tokens: r.output_len,
                    preemptions: r.preemptions,
                };
                self.events.push_back(ev);
                self.c.finished += 1;
                self.remove(slot);
            } else {
                self.running.push(slot);
            }
        }
    }

    /// Test hook: checks the engine's invariants, panicking on a violation.
    #[doc(hidden)]
    pub fn check_invariants(&self) {
        let bs = self.block_size as usize;
        assert!(self.running.len() + self.transferring.len() <= self.cfg.max_num_seqs as usize);
        assert!(self.pool.in_use() <= self.capacity);
        let mut held = 0usize;
        for (slot, r) in self.reqs.iter().enumerate() {
            let Some(r) = r else { continue };
            let slot = slot as u32;
            assert_eq!(self.by_id.get(&r.id), Some(&slot));
            let in_queue = match r.state {
                State::Waiting => self.waiting.contains(&slot),
                State::Running => self.running.contains(&slot),
                State::Transferring => self.transferring.contains(&slot),
            };
            assert!(in_queue, "request {:?} not in its queue", r.id);
            assert!(r.computed <= r.known());
            assert!(r.generated <= r.output_len);
            if r.state == State::Running && !r.remote {
                assert!(r.blocks.len() >= r.computed.div_ceil(self.block_size) as usize);
            }
            for &b in &r.blocks {
                assert!(self.pool.refs(b) >= 1, "held block with no reference");
            }
            assert!(r.registered as usize <= r.blocks.len().max(r.computed as usize / bs));
            held += r.blocks.len();
        }
        // Every reference belongs to a request (blocks may be shared, so ≤).
        assert!(self.pool.in_use() as usize <= held);
        self.pool.check_invariants();
        if self.step.is_some() {
            let tokens: u64 = self.items.iter().map(|it| u64::from(it.tokens)).sum();
            assert!(
                tokens <= u64::from(self.cfg.max_num_batched_tokens),
                "token budget exceeded"
            );
            assert!(self.items.len() <= self.cfg.max_num_seqs as usize);
        }
        let total = self.waiting.len() + self.running.len() + self.transferring.len();
        assert_eq!(total, self.by_id.len());
        if let Some(st) = &self.stretch {
            assert!(st.done < st.bounds.len());
        }
    }
}
