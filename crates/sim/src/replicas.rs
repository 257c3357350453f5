//! Several gateway replicas in front of one aggregated fleet (`kvroute sim
//! --gateway-replicas N`): one [`Frontend`] per replica, each with its own router, and the
//! updates they send each other through `router::ReplicaSync` on their way, a fixed delay
//! late. The simulator drives this like the one frontend it replaces.
//!
//! Fault runs (`crate::faults`) also restart a replica and cut one off NATS: the messages
//! between replicas are then what the gateway sends (updates, headers that say which update
//! comes next, snapshot requests and answers), and a replica that is down or partitioned
//! neither sends nor receives them, nor the workers' KV events.

use std::collections::VecDeque;

use kv_index::{
    CacheMirror, EventSink, FirstWord, KvEvent, Snapshot, StreamSync, SyncStep, WorkerId,
};
use nanotime::Nanos;
use router::replica::{PEER_REQUEST_ID_BASE, ReplicaSyncCounters};
use router::{
    Frontend, FrontendConfig, FrontendEvent, PeerSnapshot, PeerUpdate, ReplicaId, ReplicaSync,
    ReplicaSyncConfig, RequestId, RouteError, RouterConfig, RouterConfigError, RoutingKey,
    WorkerLimits,
};
use rustc_hash::FxHashMap;
use serde::Serialize;

use crate::config::{ConfigError, ReplicaSetup};

/// The replicas' side of a run, for the report.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct ReplicaTotals {
    pub replicas: u32,
    /// Delivery delay of the replicas' updates to each other, in nanoseconds; `None`: no
    /// sync.
    pub sync_delay: Option<Nanos>,
    /// Turns each replica received.
    pub turns: Vec<u64>,
    /// Summed over the replicas.
    pub updates_sent: u64,
    pub updates_applied: u64,
    pub updates_stale: u64,
    pub updates_reordered: u64,
    pub updates_skipped: u64,
    pub updates_refused: u64,
}

/// What one replica sends its peers (NATS in the gateway).
#[derive(Debug, Clone)]
enum Message {
    Update(PeerUpdate),
    /// A batch with no update: the sender's epoch and the sequence number it sends next (the
    /// gateway's heartbeat, and what a replica says when NATS comes back).
    Header {
        epoch: u64,
        next_seq: u64,
    },
    /// A starting replica, or one that lost updates, asks for its peers' snapshots.
    SnapshotAsk,
    /// A peer's snapshot, for the replica `to` that asked.
    Snapshot {
        to: usize,
        snapshot: PeerSnapshot,
    },
}

/// Whether a replica's process runs and serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Life {
    Serving,
    /// Killed: no turn reaches it, it hears nothing.
    Down,
    /// Started again, waiting for its peers' snapshots before it serves.
    Starting,
}

/// What replica faults did (fault runs).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct ReplicaFaultCounters {
    /// Peer updates that did not reach a receiver because one side was cut off or down
    /// (each receiver counted).
    pub(crate) updates_lost: u64,
    /// KV events a partitioned replica did not receive.
    pub(crate) kv_events_missed: u64,
    /// Peers' snapshots applied.
    pub(crate) snapshots_applied: u64,
}

/// What one KV event did to the replicas' indexes (each replica counted).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct EventTally {
    /// Gaps after which a worker's blocks were cleared and re-baselined.
    pub(crate) resynced: u32,
    /// Refused as stale (a duplicate, an overtaken event).
    pub(crate) stale: u32,
    /// Refused otherwise.
    pub(crate) errors: u32,
    /// Resyncs filled from the worker's cache snapshot.
    pub(crate) filled: u32,
}

/// Every simulated worker's run: a restarted worker joins under a new id.
const SIM_INSTANCE: u64 = 0;

/// Batches a consumer holds per worker while its snapshot comes (the gateway's bound; the
/// simulator answers at once, so it holds one event at most).
const MAX_HELD_BATCHES: usize = 1_024;

/// One gateway's view of the workers' event streams, as the real gateway keeps it: it saw
/// the fleet start, so first events are baselines.
pub(crate) fn kv_streams(max_workers: usize) -> StreamSync {
    StreamSync::new(max_workers, MAX_HELD_BATCHES, FirstWord::Baseline)
}

impl EventTally {
    /// One event through a consumer's gap-and-snapshot decision (`kv_index::StreamSync`,
    /// the gateway's): when it asks for the worker's snapshot, the worker answers at once
    /// from its mirror (`fill`; none: the worker has no snapshot to give).
    pub(crate) fn deliver(
        streams: &mut StreamSync,
        sink: &mut impl EventSink,
        ev: &KvEvent,
        fill: Option<&CacheMirror>,
    ) -> Self {
        let step = streams.on_events(sink, ev.worker, SIM_INSTANCE, std::slice::from_ref(ev));
        let mut t = EventTally::default();
        t.answer(streams, sink, ev.worker, fill, step);
        t
    }

    /// A consumer that joins late (a restarted replica) asks `worker` for its snapshot.
    pub(crate) fn ask(
        streams: &mut StreamSync,
        sink: &mut impl EventSink,
        worker: WorkerId,
        fill: Option<&CacheMirror>,
    ) -> Self {
        let step = streams.heard(worker);
        let mut t = EventTally::default();
        t.answer(streams, sink, worker, fill, step);
        t
    }

    /// Counts `step`, and answers its ask from the mirror. The mirror is at or past every
    /// event delivered, so its snapshot covers what was held and one answer ends the wait;
    /// a second ask (never expected) gets no snapshot rather than a wait nobody ends.
    fn answer(
        &mut self,
        streams: &mut StreamSync,
        sink: &mut impl EventSink,
        worker: WorkerId,
        fill: Option<&CacheMirror>,
        step: SyncStep,
    ) {
        self.count(&step);
        if !step.ask {
            return;
        }
        let stored = fill.and_then(CacheMirror::snapshot);
        let snapshot = stored.as_deref().map(|stored| Snapshot {
            instance: SIM_INSTANCE,
            next_seq: fill.and_then(CacheMirror::next_seq),
            stored,
        });
        let answered = streams.on_snapshot(sink, worker, snapshot);
        self.count(&answered);
        if answered.ask {
            self.count(&streams.on_snapshot(sink, worker, None));
        }
    }

    fn count(&mut self, step: &SyncStep) {
        self.resynced += step.resynced;
        self.stale += step.stale;
        self.errors += step.errors;
        self.filled += u32::from(step.restored.is_some());
    }

    fn merge(&mut self, other: EventTally) {
        self.resynced += other.resynced;
        self.stale += other.stale;
        self.errors += other.errors;
        self.filled += other.filled;
    }
}

/// A turn's replica, and its prompt's key until it is assigned (the update that says where
/// it went carries it).
#[derive(Debug)]
struct Owner {
    replica: usize,
    key: Option<RoutingKey>,
}

#[derive(Debug)]
pub(crate) struct Replicas {
    frontends: Vec<Frontend>,
    syncs: Vec<ReplicaSync>,
    sync: Option<Nanos>,
    /// Each replica's router configuration and the frontend's, to start it again.
    router_configs: Vec<RouterConfig>,
    frontend_config: FrontendConfig,
    life: Vec<Life>,
    /// Cut off NATS (a `partition` fault): serves its clients, hears and tells nothing.
    partitioned: Vec<bool>,
    /// Each replica's incarnation (its `ReplicaSync` epoch).
    epochs: Vec<u64>,
    /// A replica waiting for its peers' snapshots: until when, and how many answers are
    /// still to come.
    snapshot_wait: Vec<Option<(Nanos, usize)>>,
    snapshot_timeout: Nanos,
    fault_counters: ReplicaFaultCounters,
    /// Each replica's view of the workers' KV event streams (when to ask a worker for its
    /// snapshot: the gateway's decision).
    kv_streams: Vec<StreamSync>,
    /// Turns between submission and end; bounded by the turns in flight.
    owners: FxHashMap<RequestId, Owner>,
    /// The replica the next turn goes to (round robin).
    next: usize,
    turns: Vec<u64>,
    /// Messages on their way, with their delivery time and sender; one fixed delay, so in
    /// order. Bounded by three updates per turn routed within the last delay, plus a
    /// header and a snapshot exchange per replica fault.
    outbox: VecDeque<(Nanos, usize, Message)>,
    /// How many replicas have seen each draining worker go idle; it leaves when all have.
    drained_by: FxHashMap<WorkerId, usize>,
    drained: VecDeque<WorkerId>,
}

impl Replicas {
    /// `setup.count` replicas; replica `r`'s router draws from `seed_of(r)`.
    pub(crate) fn new(
        router: RouterConfig,
        frontend: FrontendConfig,
        setup: ReplicaSetup,
        seed_of: impl Fn(u32) -> u64,
    ) -> Result<Self, RouterConfigError> {
        let mut frontends = Vec::with_capacity(setup.count as usize);
        let mut syncs = Vec::with_capacity(setup.count as usize);
        let mut router_configs = Vec::with_capacity(setup.count as usize);
        for r in 0..setup.count {
            let config = RouterConfig {
                seed: seed_of(r),
                ..router.clone()
            };
            router_configs.push(config.clone());
            frontends.push(Frontend::new(config, frontend)?);
            // Epoch 0; a `replica-restart` fault starts the next incarnation.
            syncs.push(ReplicaSync::new(
                ReplicaId(r),
                0,
                ReplicaSyncConfig::default(),
            ));
        }
        let n = frontends.len();
        let max_workers = router.index.max_workers;
        Ok(Self {
            kv_streams: (0..n).map(|_| kv_streams(max_workers)).collect(),
            turns: vec![0; n],
            frontends,
            syncs,
            sync: setup.sync,
            router_configs,
            frontend_config: frontend,
            life: vec![Life::Serving; n],
            partitioned: vec![false; n],
            epochs: vec![0; n],
            snapshot_wait: vec![None; n],
            snapshot_timeout: router::ReplicaTiming::default().snapshot_timeout,
            fault_counters: ReplicaFaultCounters::default(),
            owners: FxHashMap::default(),
            next: 0,
            outbox: VecDeque::new(),
            drained_by: FxHashMap::default(),
            drained: VecDeque::new(),
        })
    }

    /// Replica 0, whose view the simulator samples (every replica indexes the same events).
    pub(crate) fn first(&self) -> &Frontend {
        &self.frontends[0]
    }

    /// Replica `r`'s frontend (`r` < the replica count).
    pub(crate) fn frontend(&self, r: usize) -> Option<&Frontend> {
        self.frontends.get(r)
    }

    pub(crate) fn count(&self) -> usize {
        self.frontends.len()
    }

    /// The turn goes to the next serving replica (round robin, as a load balancer that
    /// skips a replica whose process is down or still starting).
    pub(crate) fn submit(&mut self, id: RequestId, key: RoutingKey, now: Nanos) {
        let n = self.frontends.len();
        let mut replica = self.next;
        for _ in 0..n {
            if self.life[replica] == Life::Serving {
                break;
            }
            replica = (replica + 1) % n;
        }
        self.next = (replica + 1) % n;
        self.turns[replica] += 1;
        self.owners.insert(
            id,
            Owner {
                replica,
                key: Some(key.clone()),
            },
        );
        self.frontends[replica].submit(id, key, now);
    }

    pub(crate) fn poll_event(&mut self, now: Nanos) -> Option<FrontendEvent> {
        for r in 0..self.frontends.len() {
            let Some(event) = self.frontends[r].poll_event() else {
                continue;
            };
            match &event {
                FrontendEvent::Assigned { id, decision, .. } => {
                    let key = self.owners.get_mut(id).and_then(|o| o.key.take());
                    if let Some(key) = key {
                        let update = self.syncs[r].routed(*id, decision.worker, &key);
                        self.send(update, now);
                    }
                }
                FrontendEvent::Refused { id, .. } => {
                    self.owners.remove(id);
                }
            }
            return Some(event);
        }
        None
    }

    pub(crate) fn on_first_token(&mut self, id: RequestId, now: Nanos) {
        let Some(r) = self.owners.get(&id).map(|o| o.replica) else {
            return;
        };
        self.frontends[r].on_first_token(id, now);
        let update = self.syncs[r].first_token(id);
        self.send(update, now);
    }

    /// A completed request's reply length: the replica that routed it learns it.
    pub(crate) fn on_reply(&mut self, id: RequestId, output_tokens: u32) {
        if let Some(r) = self.owners.get(&id).map(|o| o.replica) {
            self.frontends[r].on_reply(output_tokens);
        }
    }

    pub(crate) fn on_finished(&mut self, id: RequestId, now: Nanos) {
        let Some(owner) = self.owners.remove(&id) else {
            return;
        };
        let r = owner.replica;
        self.frontends[r].on_finished(id, now);
        // Only an assigned turn (its key went out with the update) is known to the peers.
        if owner.key.is_none() {
            let update = self.syncs[r].finished(id);
            self.send(update, now);
        }
    }

    fn send(&mut self, update: PeerUpdate, now: Nanos) {
        let from = update.replica.0 as usize;
        self.post(from, Message::Update(update), now);
    }

    /// Puts `message` from replica `from` on its way; a replica cut off or down sends
    /// nothing (its updates are lost for every peer).
    fn post(&mut self, from: usize, message: Message, now: Nanos) {
        let Some(delay) = self.sync else {
            return;
        };
        if !self.reachable(from) {
            if matches!(message, Message::Update(_)) {
                self.fault_counters.updates_lost += self.frontends.len() as u64 - 1;
            }
            return;
        }
        self.outbox.push_back((now + delay, from, message));
    }

    /// Whether replica `r` is on NATS: its process runs and no partition cuts it off.
    fn reachable(&self, r: usize) -> bool {
        self.life[r] != Life::Down && !self.partitioned[r]
    }

    pub(crate) fn poll_timeout(&self) -> Option<Nanos> {
        let frontends = self.frontends.iter().filter_map(Frontend::poll_timeout);
        let outbox = self.outbox.front().map(|u| u.0);
        let waits = self.snapshot_wait.iter().flatten().map(|w| w.0);
        frontends.chain(outbox).chain(waits).min()
    }

    /// Delivers the messages due by `now` to every replica but their sender, ends the
    /// snapshot waits that timed out, then runs each replica's own timeouts.
    pub(crate) fn handle_timeout(&mut self, now: Nanos) {
        while self.outbox.front().is_some_and(|u| u.0 <= now) {
            let Some((_, from, message)) = self.outbox.pop_front() else {
                break;
            };
            self.deliver(from, message, now);
        }
        for r in 0..self.frontends.len() {
            if self.snapshot_wait[r].is_some_and(|w| w.0 <= now) {
                self.end_snapshot_wait(r, now);
            }
        }
        for f in &mut self.frontends {
            f.handle_timeout(now);
        }
    }

    fn deliver(&mut self, from: usize, message: Message, now: Nanos) {
        let sender = ReplicaId(from as u32);
        match message {
            Message::Update(update) => {
                for r in 0..self.frontends.len() {
                    if r == from {
                        continue;
                    }
                    if !self.reachable(r) {
                        self.fault_counters.updates_lost += 1;
                        continue;
                    }
                    self.syncs[r].apply(update.clone(), &mut self.frontends[r], now);
                    self.resync_if_wanted(r, now);
                }
            }
            Message::Header { epoch, next_seq } => {
                for r in 0..self.frontends.len() {
                    if r != from && self.reachable(r) {
                        self.syncs[r].heard_from(
                            sender,
                            epoch,
                            next_seq,
                            &mut self.frontends[r],
                            now,
                        );
                        self.resync_if_wanted(r, now);
                    }
                }
            }
            Message::SnapshotAsk => {
                for r in 0..self.frontends.len() {
                    if r != from && self.reachable(r) {
                        let snapshot = self.syncs[r].snapshot();
                        self.post(r, Message::Snapshot { to: from, snapshot }, now);
                    }
                }
            }
            Message::Snapshot { to, snapshot } => {
                let waiting = self.snapshot_wait.get(to).copied().flatten();
                if !self.reachable(to) || waiting.is_none() {
                    return;
                }
                self.syncs[to].apply_snapshot(snapshot, &mut self.frontends[to], now);
                self.fault_counters.snapshots_applied += 1;
                if let Some((until, left)) = waiting {
                    if left <= 1 {
                        self.end_snapshot_wait(to, now);
                    } else {
                        self.snapshot_wait[to] = Some((until, left - 1));
                    }
                }
            }
        }
    }

    /// Replica `r` lost updates (its core says so): it fetches its peers' snapshots, as the
    /// gateway does.
    fn resync_if_wanted(&mut self, r: usize, now: Nanos) {
        if self.syncs[r].take_resync_wanted() {
            self.fetch_snapshots(r, now);
        }
    }

    /// Replica `r` asks its reachable peers for their snapshots and holds their updates
    /// until the answers are in, or the snapshot timeout.
    fn fetch_snapshots(&mut self, r: usize, now: Nanos) {
        if self.snapshot_wait[r].is_some() {
            return;
        }
        let peers = (0..self.frontends.len())
            .filter(|&p| p != r && self.reachable(p))
            .count();
        self.syncs[r].await_snapshots();
        if peers == 0 || self.sync.is_none() {
            self.end_snapshot_wait(r, now);
            return;
        }
        self.snapshot_wait[r] = Some((now + self.snapshot_timeout, peers));
        self.post(r, Message::SnapshotAsk, now);
    }

    fn end_snapshot_wait(&mut self, r: usize, now: Nanos) {
        self.snapshot_wait[r] = None;
        self.syncs[r].end_snapshot_wait(&mut self.frontends[r], now);
        if self.life[r] == Life::Starting {
            self.life[r] = Life::Serving;
        }
    }

    /// Replica `r`'s process dies: the turns it held are lost with their clients'
    /// connections (returned, ascending), its state is gone. It stays down until
    /// [`Replicas::restart`]; `workers` is the routing set it will start with (kept current
    /// by the usual worker calls meanwhile).
    pub(crate) fn kill(
        &mut self,
        r: usize,
        workers: &[(WorkerId, WorkerLimits)],
        now: Nanos,
    ) -> Result<Vec<RequestId>, ConfigError> {
        let mut lost: Vec<RequestId> = self
            .owners
            .iter()
            .filter(|(_, o)| o.replica == r)
            .map(|(id, _)| *id)
            .collect();
        lost.sort_unstable();
        for id in &lost {
            self.owners.remove(id);
        }
        let mut fresh = Frontend::new(self.router_configs[r].clone(), self.frontend_config)?;
        for (worker, limits) in workers {
            fresh.add_worker(*worker, *limits, now)?;
        }
        self.frontends[r] = fresh;
        self.life[r] = Life::Down;
        self.snapshot_wait[r] = None;
        Ok(lost)
    }

    /// Replica `r` starts again, a new incarnation with an empty index and no view of its
    /// peers: its first message (a new epoch) makes them release its old requests, and it
    /// serves once its peers' snapshots are in (or the snapshot timeout passed).
    pub(crate) fn restart(&mut self, r: usize, now: Nanos) {
        if self.life[r] != Life::Down {
            return;
        }
        self.epochs[r] += 1;
        self.kv_streams[r] = kv_streams(self.router_configs[r].index.max_workers);
        self.syncs[r] = ReplicaSync::new(
            ReplicaId(r as u32),
            self.epochs[r],
            ReplicaSyncConfig::default(),
        );
        self.life[r] = Life::Starting;
        let header = Message::Header {
            epoch: self.epochs[r],
            next_seq: 0,
        };
        self.post(r, header, now);
        self.fetch_snapshots(r, now);
    }

    /// Replica `r` loses NATS.
    pub(crate) fn cut_off(&mut self, r: usize) {
        self.partitioned[r] = true;
        self.snapshot_wait[r] = None;
    }

    /// NATS is back for replica `r`: it and every peer say where their updates stand, so
    /// each side sees what it lost and fetches snapshots.
    pub(crate) fn reconnect(&mut self, r: usize, now: Nanos) {
        if !self.partitioned[r] {
            return;
        }
        self.partitioned[r] = false;
        for p in 0..self.frontends.len() {
            if self.reachable(p) {
                let header = Message::Header {
                    epoch: self.syncs[p].epoch(),
                    next_seq: self.syncs[p].next_seq(),
                };
                self.post(p, header, now);
            }
        }
    }

    /// Replica `r`'s lease ran out while it was silent (down or cut off): its peers forget
    /// it and release its requests; a cut-off replica, hearing no one, forgets them too.
    /// Returns whether anything was forgotten.
    pub(crate) fn lease_expired(&mut self, r: usize, now: Nanos) -> bool {
        if self.reachable(r) {
            return false;
        }
        let silent = ReplicaId(r as u32);
        for p in 0..self.frontends.len() {
            if p == r || !self.reachable(p) {
                continue;
            }
            self.syncs[p].forget_peer(silent, &mut self.frontends[p], now);
            if self.partitioned[r] {
                let peer = ReplicaId(p as u32);
                self.syncs[r].forget_peer(peer, &mut self.frontends[r], now);
            }
        }
        true
    }

    pub(crate) fn fault_counters(&self) -> ReplicaFaultCounters {
        self.fault_counters
    }

    pub(crate) fn queued(&self) -> usize {
        self.frontends.iter().map(Frontend::queued).sum()
    }

    /// The gateway's gap policy (`KvIndex::apply_resyncing`) in every replica on NATS; a
    /// replica cut off or down misses the event (and sees the gap when it is back). A replica
    /// whose index a gap cleared restores the worker from `fill`, the worker's cache as its
    /// own stream says (the gateway asks a kvroute engine for it over NATS).
    pub(crate) fn apply_event_resyncing(
        &mut self,
        ev: &KvEvent,
        fill: Option<&CacheMirror>,
    ) -> EventTally {
        let mut tally = EventTally::default();
        for r in 0..self.frontends.len() {
            if !self.reachable(r) {
                if self.partitioned[r] {
                    self.fault_counters.kv_events_missed += 1;
                }
                continue;
            }
            tally.merge(EventTally::deliver(
                &mut self.kv_streams[r],
                self.frontends[r].router_mut(),
                ev,
                fill,
            ));
        }
        tally
    }

    /// Replica `r`, started again, asks `worker` for its snapshot (`mirror`, answered at
    /// once). Returns whether it restored one.
    pub(crate) fn restore_worker(
        &mut self,
        r: usize,
        worker: WorkerId,
        mirror: &CacheMirror,
    ) -> bool {
        let (Some(f), Some(streams)) = (self.frontends.get_mut(r), self.kv_streams.get_mut(r))
        else {
            return false;
        };
        EventTally::ask(streams, f.router_mut(), worker, Some(mirror)).filled > 0
    }

    /// Every replica forgets a worker that is gone.
    pub(crate) fn forget_kv_stream(&mut self, worker: WorkerId) {
        for streams in &mut self.kv_streams {
            streams.forget(worker);
        }
    }

    /// Every replica consumes every worker's events; replica 0's outcome stands for all
    /// (their indexes see the same stream).
    pub(crate) fn apply_event(&mut self, ev: &KvEvent) -> bool {
        let mut ok = true;
        for (r, f) in self.frontends.iter_mut().enumerate() {
            let applied = f.router_mut().apply_event(ev).is_ok();
            if r == 0 {
                ok = applied;
            }
        }
        ok
    }

    pub(crate) fn add_worker(
        &mut self,
        worker: WorkerId,
        limits: WorkerLimits,
        now: Nanos,
    ) -> Result<(), RouteError> {
        for f in &mut self.frontends {
            f.add_worker(worker, limits, now)?;
        }
        Ok(())
    }

    /// The turns lost with `worker`, on whichever replica routed them.
    pub(crate) fn remove_worker(&mut self, worker: WorkerId, now: Nanos) -> Vec<RequestId> {
        self.drained_by.remove(&worker);
        self.drained.retain(|w| *w != worker);
        let mut orphans = Vec::new();
        for f in &mut self.frontends {
            let lost = f.remove_worker(worker, now);
            orphans.extend(lost.into_iter().filter(|id| id.0 < PEER_REQUEST_ID_BASE));
        }
        orphans.sort_unstable();
        orphans
    }

    pub(crate) fn drain_worker(&mut self, worker: WorkerId, now: Nanos) -> bool {
        let mut known = true;
        for f in &mut self.frontends {
            known &= f.drain_worker(worker, now);
        }
        known
    }

    /// A draining worker every replica has seen go idle.
    pub(crate) fn take_drained(&mut self) -> Option<WorkerId> {
        let n = self.frontends.len();
        for f in &mut self.frontends {
            while let Some(w) = f.take_drained() {
                let seen = self.drained_by.entry(w).or_insert(0);
                *seen += 1;
                if *seen == n {
                    self.drained_by.remove(&w);
                    self.drained.push_back(w);
                }
            }
        }
        self.drained.pop_front()
    }

    pub(crate) fn totals(&self) -> ReplicaTotals {
        let mut sum = ReplicaSyncCounters::default();
        for s in &self.syncs {
            let c = s.counters();
            sum.sent += c.sent;
            sum.applied += c.applied;
            sum.stale += c.stale;
            sum.reordered += c.reordered;
            sum.skipped += c.skipped;
            sum.refused += c.refused;
        }
        ReplicaTotals {
            replicas: self.frontends.len() as u32,
            sync_delay: self.sync,
            turns: self.turns.clone(),
            updates_sent: sum.sent,
            updates_applied: sum.applied,
            updates_stale: sum.stale,
            updates_reordered: sum.reordered,
            updates_skipped: sum.skipped,
            updates_refused: sum.refused,
        }
    }
}
