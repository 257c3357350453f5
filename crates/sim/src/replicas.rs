//! Several gateway replicas in front of one aggregated fleet (`kvroute sim
//! --gateway-replicas N`): one [`Frontend`] per replica, each with its own router, and the
//! updates they send each other through `router::ReplicaSync` on their way, a fixed delay
//! late. The simulator drives this like the one frontend it replaces.

use std::collections::VecDeque;

use kv_index::{KvEvent, WorkerId};
use nanotime::Nanos;
use router::replica::{PEER_REQUEST_ID_BASE, ReplicaSyncCounters};
use router::{
    Frontend, FrontendConfig, FrontendEvent, PeerUpdate, ReplicaId, ReplicaSync, ReplicaSyncConfig,
    RequestId, RouteError, RouterConfig, RouterConfigError, RoutingKey, WorkerLimits,
};
use rustc_hash::FxHashMap;
use serde::Serialize;

use crate::config::ReplicaSetup;

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
    /// Turns between submission and end; bounded by the turns in flight.
    owners: FxHashMap<RequestId, Owner>,
    /// The replica the next turn goes to (round robin).
    next: usize,
    turns: Vec<u64>,
    /// Updates on their way, with their delivery time; one fixed delay, so in order.
    /// Bounded by three per turn routed within the last delay.
    outbox: VecDeque<(Nanos, PeerUpdate)>,
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
        for r in 0..setup.count {
            let config = RouterConfig {
                seed: seed_of(r),
                ..router.clone()
            };
            frontends.push(Frontend::new(config, frontend)?);
            // One incarnation per replica: the simulator restarts none.
            syncs.push(ReplicaSync::new(
                ReplicaId(r),
                0,
                ReplicaSyncConfig::default(),
            ));
        }
        Ok(Self {
            turns: vec![0; frontends.len()],
            frontends,
            syncs,
            sync: setup.sync,
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

    pub(crate) fn first_mut(&mut self) -> &mut Frontend {
        &mut self.frontends[0]
    }

    pub(crate) fn submit(&mut self, id: RequestId, key: RoutingKey, now: Nanos) {
        let replica = self.next;
        self.next = (self.next + 1) % self.frontends.len();
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
        if let Some(delay) = self.sync {
            self.outbox.push_back((now + delay, update));
        }
    }

    pub(crate) fn poll_timeout(&self) -> Option<Nanos> {
        let frontends = self.frontends.iter().filter_map(Frontend::poll_timeout);
        let outbox = self.outbox.front().map(|u| u.0);
        frontends.chain(outbox).min()
    }

    /// Delivers the updates due by `now` to every replica but their sender, then runs each
    /// replica's own timeouts.
    pub(crate) fn handle_timeout(&mut self, now: Nanos) {
        while self.outbox.front().is_some_and(|u| u.0 <= now) {
            let Some((_, update)) = self.outbox.pop_front() else {
                break;
            };
            for (sync, frontend) in self.syncs.iter_mut().zip(&mut self.frontends) {
                if sync.id() != update.replica {
                    sync.apply(update.clone(), frontend, now);
                }
            }
        }
        for f in &mut self.frontends {
            f.handle_timeout(now);
        }
    }

    pub(crate) fn queued(&self) -> usize {
        self.frontends.iter().map(Frontend::queued).sum()
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
