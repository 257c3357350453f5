//! Router replicas that route as one: each replica tells its peers what it routed and when
//! those requests ended, and counts its peers' requests in its own load accounting.
//!
//! Every replica consumes every worker's KV events, so their prefix indexes agree; what a
//! replica cannot see is the load its peers put on the workers. Without it, replicas that
//! agree on the best worker all pick it (herding), and each one's view of a worker lags the
//! others' traffic. A [`ReplicaSync`] closes that gap, sans-IO like the rest of the router:
//!
//! - the replica's driver turns its own lifecycle calls into [`PeerUpdate`]s
//!   ([`ReplicaSync::routed`], [`ReplicaSync::first_token`], [`ReplicaSync::finished`]) and
//!   sends them to the peers by whatever carries them (NATS in the gateway, a delay queue in
//!   the simulator);
//! - it hands each update received from a peer to [`ReplicaSync::apply`], which enters the
//!   peer's request into the [`Frontend`]'s accounting ([`Frontend::on_peer_routed`]) and
//!   releases it when the peer says it ended (which serves the frontend's queue as a local
//!   release would).
//!
//! Updates carry the sender's epoch (a new one each time it starts) and a sequence number per
//! epoch. Duplicates and stale updates are dropped; updates that arrive early wait (at most
//! [`ReplicaSyncConfig::max_reorder`] per peer) until the ones before them arrive, and a gap
//! that outlasts that window is skipped and counted. A peer's new epoch means it restarted:
//! the requests it had in flight are released. Peer requests tracked are bounded by
//! [`ReplicaSyncConfig::max_peer_requests`]; beyond it, a peer's new request is not counted.
//!
//! The staleness bound is the transport's: a replica's view of its peers' load lags by the
//! delivery delay of their updates (in the simulator, `--replica-sync-ms`; in the gateway, its
//! flush interval plus NATS delivery).
//!
//! Over a lossy transport that keeps each sender's order (NATS core), three more inputs keep
//! the view right:
//!
//! - [`ReplicaSync::heard_from`]: a sender's message header says which sequence number it
//!   sends next. Every update below it has been delivered or lost, so the missing ones are
//!   skipped and counted at once, and the replica asks for a snapshot
//!   ([`ReplicaSync::take_resync_wanted`]). Headers alone are heartbeats.
//! - [`ReplicaSync::snapshot`] / [`ReplicaSync::apply_snapshot`]: a replica's own in-flight
//!   requests and the sequence number they are current to. A replica that starts (or lost
//!   updates) calls [`ReplicaSync::await_snapshots`], holds its peers' updates until their
//!   snapshots arrive (or [`ReplicaSync::end_snapshot_wait`]), and so rebuilds their load at
//!   once rather than as their old requests end.
//! - [`ReplicaSync::expire_peers`]: a peer not heard from for a lease (it died without a
//!   goodbye) is forgotten and its requests released; [`ReplicaSync::forget_peer`] is the
//!   goodbye.

use std::collections::BTreeMap;

use kv_index::WorkerId;
use nanotime::Nanos;
use rustc_hash::FxHashMap;

use crate::frontend::Frontend;
use crate::router::{RequestId, RoutingKey};

/// A router replica's name among its peers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ReplicaId(pub u32);

/// Request ids a replica gives its peers' requests start here; its own requests' ids must stay
/// below (the gateway's and the simulator's counters do, by 2^63).
pub const PEER_REQUEST_ID_BASE: u64 = 1 << 63;

/// Most prompt blocks a [`PeerChange::Routed`] carries: a longer prompt is described by its
/// first blocks (a prefix is still a valid key), so one update stays under ~64 KiB of hashes.
pub const MAX_PEER_KEY_BLOCKS: usize = 4096;

/// One change a replica made to its requests, as its peers receive it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerUpdate {
    pub replica: ReplicaId,
    /// The sender's incarnation: a restarted replica sends a larger one.
    pub epoch: u64,
    /// Consecutive within an epoch, from 0.
    pub seq: u64,
    /// The sender's id for the request.
    pub request: u64,
    pub change: PeerChange,
}

/// What happened to the request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerChange {
    /// Sent to `worker`; `key` is its prompt (at most [`MAX_PEER_KEY_BLOCKS`] blocks).
    Routed { worker: WorkerId, key: RoutingKey },
    /// Its first token came: its prefill is done.
    FirstToken,
    /// It ended (finished, failed or cancelled).
    Finished,
}

/// The replicas' timing, as `kvroute gateway` runs it and the simulator models it: one home
/// for the defaults both drivers use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplicaTiming {
    /// Longest an update waits to be batched with others: with NATS delivery, the bound on
    /// how stale a peer's view of this replica's load is.
    pub flush_interval: Nanos,
    /// A header-only message at least this often, so peers know this replica lives.
    pub heartbeat: Nanos,
    /// A peer not heard from for this long died without a goodbye: its requests are released
    /// ([`ReplicaSync::expire_peers`]).
    pub peer_lease: Nanos,
    /// How long a starting replica waits for its peers' snapshots before it serves anyway.
    pub snapshot_timeout: Nanos,
}

impl Default for ReplicaTiming {
    fn default() -> Self {
        ReplicaTiming {
            flush_interval: Nanos::from_millis(2),
            heartbeat: Nanos::from_millis(500),
            peer_lease: Nanos::from_secs(3),
            snapshot_timeout: Nanos::from_millis(500),
        }
    }
}

/// Bounds of a [`ReplicaSync`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplicaSyncConfig {
    /// Most peers tracked at once; updates from further replicas are refused.
    pub max_peers: usize,
    /// Most early updates held per peer while an earlier one is missing.
    pub max_reorder: usize,
    /// Most peer requests counted at once.
    pub max_peer_requests: usize,
}

impl Default for ReplicaSyncConfig {
    fn default() -> Self {
        Self {
            max_peers: 64,
            max_reorder: 1024,
            max_peer_requests: 1 << 16,
        }
    }
}

/// What a [`ReplicaSync`] did with its peers' updates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ReplicaSyncCounters {
    /// Updates this replica produced.
    pub sent: u64,
    /// Peer updates applied in order.
    pub applied: u64,
    /// Updates dropped: already applied, or from an older epoch of their sender.
    pub stale: u64,
    /// Updates that arrived before an earlier one and waited for it.
    pub reordered: u64,
    /// Missing updates skipped because the wait window filled (their changes are lost).
    pub skipped: u64,
    /// Peers seen to restart (a new epoch): their in-flight requests were released.
    pub peer_restarts: u64,
    /// Updates refused: too many peers or peer requests, or a worker this replica does not
    /// know (yet).
    pub refused: u64,
    /// Peers' snapshots applied.
    pub snapshots_applied: u64,
    /// Peers forgotten because they fell silent for a lease.
    pub peers_expired: u64,
    /// Messages that carried this replica's id from another incarnation: two replicas share
    /// an id.
    pub same_id: u64,
}

/// One in-flight request of a replica, as its snapshot lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotRequest {
    pub request: u64,
    pub worker: WorkerId,
    /// Its prompt (at most [`MAX_PEER_KEY_BLOCKS`] blocks).
    pub key: RoutingKey,
    /// Its first token came.
    pub first_token: bool,
}

/// A replica's in-flight requests, current up to (not including) update `next_seq` of
/// `epoch`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerSnapshot {
    pub replica: ReplicaId,
    pub epoch: u64,
    pub next_seq: u64,
    pub requests: Vec<SnapshotRequest>,
}

#[derive(Debug)]
struct OwnRequest {
    worker: WorkerId,
    key: RoutingKey,
    first_token: bool,
}

#[derive(Debug)]
struct Peer {
    epoch: u64,
    /// The next sequence number to apply; `None` while it is unknown (waiting for the peer's
    /// snapshot, every update is held).
    next_seq: Option<u64>,
    /// Updates that arrived early, by sequence number; at most `max_reorder`.
    early: BTreeMap<u64, PeerUpdate>,
    /// Waiting for this peer's snapshot: its updates are held, not applied.
    awaiting_snapshot: bool,
    /// When it was last heard from (an update, a header or a snapshot).
    last_heard: Nanos,
}

impl Peer {
    fn new(epoch: u64, next_seq: Option<u64>, awaiting_snapshot: bool, now: Nanos) -> Peer {
        Peer {
            epoch,
            next_seq,
            early: BTreeMap::new(),
            awaiting_snapshot,
            last_heard: now,
        }
    }
}

/// One replica's side of the replica sync: see the module docs.
#[derive(Debug)]
pub struct ReplicaSync {
    me: ReplicaId,
    epoch: u64,
    next_seq: u64,
    config: ReplicaSyncConfig,
    peers: FxHashMap<ReplicaId, Peer>,
    /// (peer, its request id) → the id this replica's router tracks it under.
    requests: FxHashMap<(ReplicaId, u64), RequestId>,
    next_local: u64,
    /// This replica's own in-flight requests, for its snapshots. Bounded by
    /// `max_peer_requests` (beyond, a request is left out of snapshots); the driver's own
    /// in-flight bound keeps it far below.
    own: FxHashMap<u64, OwnRequest>,
    /// New peers start out waiting for their snapshot (between [`ReplicaSync::await_snapshots`]
    /// and [`ReplicaSync::end_snapshot_wait`]).
    awaiting_snapshots: bool,
    /// Updates were lost since the driver last asked: it should fetch snapshots.
    resync_wanted: bool,
    counters: ReplicaSyncCounters,
}

impl ReplicaSync {
    /// Replica `me` in its incarnation `epoch` (larger than any before it, e.g. its start
    /// time).
    pub fn new(me: ReplicaId, epoch: u64, config: ReplicaSyncConfig) -> Self {
        Self {
            me,
            epoch,
            next_seq: 0,
            config,
            peers: FxHashMap::default(),
            requests: FxHashMap::default(),
            next_local: PEER_REQUEST_ID_BASE,
            own: FxHashMap::default(),
            awaiting_snapshots: false,
            resync_wanted: false,
            counters: ReplicaSyncCounters::default(),
        }
    }

    pub fn id(&self) -> ReplicaId {
        self.me
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The sequence number of the next update this replica produces.
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// Peers tracked now.
    pub fn peers(&self) -> usize {
        self.peers.len()
    }

    /// Whether `request` is one of this replica's own in-flight requests (its peers were told
    /// it was routed).
    pub fn is_own(&self, request: RequestId) -> bool {
        self.own.contains_key(&request.0)
    }

    pub fn counters(&self) -> ReplicaSyncCounters {
        self.counters
    }

    /// Peer requests counted now.
    pub fn peer_requests(&self) -> usize {
        self.requests.len()
    }

    /// The update saying this replica sent `request` to `worker`.
    pub fn routed(&mut self, request: RequestId, worker: WorkerId, key: &RoutingKey) -> PeerUpdate {
        let blocks = key.seq.len().min(MAX_PEER_KEY_BLOCKS);
        let key = RoutingKey {
            local: key.local[..blocks.min(key.local.len())].to_vec(),
            seq: key.seq[..blocks].to_vec(),
            num_tokens: key.num_tokens,
        };
        if self.own.len() < self.config.max_peer_requests {
            self.own.insert(
                request.0,
                OwnRequest {
                    worker,
                    key: key.clone(),
                    first_token: false,
                },
            );
        }
        self.update(request, PeerChange::Routed { worker, key })
    }

    /// The update saying `request` produced its first token.
    pub fn first_token(&mut self, request: RequestId) -> PeerUpdate {
        if let Some(own) = self.own.get_mut(&request.0) {
            own.first_token = true;
        }
        self.update(request, PeerChange::FirstToken)
    }

    /// The update saying `request` ended.
    pub fn finished(&mut self, request: RequestId) -> PeerUpdate {
        self.own.remove(&request.0);
        self.update(request, PeerChange::Finished)
    }

    /// This replica's in-flight requests, current up to its next update, for a peer that
    /// asks (in request order, so a snapshot is a function of the state).
    pub fn snapshot(&self) -> PeerSnapshot {
        let mut requests: Vec<SnapshotRequest> = self
            .own
            .iter()
            .map(|(id, own)| SnapshotRequest {
                request: *id,
                worker: own.worker,
                key: own.key.clone(),
                first_token: own.first_token,
            })
            .collect();
        requests.sort_unstable_by_key(|r| r.request);
        PeerSnapshot {
            replica: self.me,
            epoch: self.epoch,
            next_seq: self.next_seq,
            requests,
        }
    }

    /// Starts waiting for every peer's snapshot: updates from known and new peers are held
    /// (at most `max_reorder` per peer) until [`apply_snapshot`](Self::apply_snapshot) or
    /// [`end_snapshot_wait`](Self::end_snapshot_wait).
    pub fn await_snapshots(&mut self) {
        self.awaiting_snapshots = true;
        for peer in self.peers.values_mut() {
            peer.awaiting_snapshot = true;
        }
    }

    /// Whether updates were lost since the last call (skipped by a gap): the driver should
    /// fetch its peers' snapshots.
    pub fn take_resync_wanted(&mut self) -> bool {
        std::mem::take(&mut self.resync_wanted)
    }

    /// Applies a peer's snapshot: its requests replace what this replica counted for it, and
    /// its held updates from the snapshot's point on are applied. A snapshot older than what
    /// was already applied (and not awaited) is stale.
    pub fn apply_snapshot(&mut self, snapshot: PeerSnapshot, frontend: &mut Frontend, now: Nanos) {
        let from = snapshot.replica;
        if from == self.me {
            return;
        }
        if !self.admit_peer(from, snapshot.epoch, None, frontend, now) {
            return;
        }
        let Some(peer) = self.peers.get_mut(&from) else {
            return;
        };
        peer.last_heard = now;
        let ahead = peer.next_seq.is_some_and(|n| n > snapshot.next_seq);
        if !peer.awaiting_snapshot && ahead {
            self.counters.stale += 1;
            return;
        }
        peer.next_seq = Some(snapshot.next_seq);
        peer.awaiting_snapshot = false;
        let held = peer.early.len();
        peer.early = peer.early.split_off(&snapshot.next_seq);
        self.counters.stale += (held - peer.early.len()) as u64;
        // Replace: release what the snapshot no longer lists, count what it adds.
        let listed: rustc_hash::FxHashSet<u64> =
            snapshot.requests.iter().map(|r| r.request).collect();
        self.release_where(frontend, now, |&(peer, request)| {
            peer == from && !listed.contains(&request)
        });
        for r in snapshot.requests {
            let key = (from, r.request);
            if !self.requests.contains_key(&key) {
                self.track_peer_request(key, r.worker, &r.key, frontend, now);
            }
            if r.first_token
                && let Some(local) = self.requests.get(&key)
            {
                frontend.on_first_token(*local, now);
            }
        }
        self.counters.snapshots_applied += 1;
        self.drain(from, frontend, now);
    }

    /// Stops waiting for snapshots (the driver's timeout): a peer whose snapshot did not come
    /// resumes at the earliest update held from it, as a peer joined mid-stream would.
    pub fn end_snapshot_wait(&mut self, frontend: &mut Frontend, now: Nanos) {
        self.awaiting_snapshots = false;
        let mut waiting: Vec<ReplicaId> = self
            .peers
            .iter()
            .filter(|(_, p)| p.awaiting_snapshot)
            .map(|(id, _)| *id)
            .collect();
        waiting.sort_unstable();
        for id in waiting {
            if let Some(peer) = self.peers.get_mut(&id) {
                peer.awaiting_snapshot = false;
                if peer.next_seq.is_none() {
                    peer.next_seq = peer.early.first_key_value().map(|(seq, _)| *seq);
                }
            }
            self.drain(id, frontend, now);
        }
    }

    /// A message header from `replica`: it sends update `next_seq` next. With a transport that
    /// keeps each sender's order, every earlier update has arrived or is lost: the lost ones
    /// are skipped (and a resync wanted). Also a heartbeat for [`expire_peers`](Self::expire_peers).
    pub fn heard_from(
        &mut self,
        replica: ReplicaId,
        epoch: u64,
        next_seq: u64,
        frontend: &mut Frontend,
        now: Nanos,
    ) {
        if replica == self.me {
            if epoch != self.epoch {
                self.counters.same_id += 1;
            }
            return;
        }
        if !self.admit_peer(replica, epoch, Some(next_seq), frontend, now) {
            return;
        }
        let Some(peer) = self.peers.get_mut(&replica) else {
            return;
        };
        peer.last_heard = now;
        if peer.awaiting_snapshot {
            return;
        }
        let Some(expected) = peer.next_seq else {
            peer.next_seq = Some(next_seq);
            return;
        };
        if expected >= next_seq {
            return;
        }
        let held_below = peer.early.range(..next_seq).count() as u64;
        let lost = next_seq - expected - held_below;
        if lost > 0 {
            self.counters.skipped += lost;
            self.resync_wanted = true;
        }
        let rest = peer.early.split_off(&next_seq);
        let below = std::mem::replace(&mut peer.early, rest);
        peer.next_seq = Some(next_seq);
        for (_, update) in below {
            self.apply_in_order(update, frontend, now);
        }
        self.drain(replica, frontend, now);
    }

    /// Forgets every peer not heard from since `now - lease` (it died without a goodbye) and
    /// releases its requests; returns them.
    pub fn expire_peers(
        &mut self,
        now: Nanos,
        lease: Nanos,
        frontend: &mut Frontend,
    ) -> Vec<ReplicaId> {
        let mut silent: Vec<ReplicaId> = self
            .peers
            .iter()
            .filter(|(_, p)| now.saturating_sub(p.last_heard) > lease)
            .map(|(id, _)| *id)
            .collect();
        silent.sort_unstable();
        for id in &silent {
            self.counters.peers_expired += 1;
            self.forget_peer(*id, frontend, now);
        }
        silent
    }

    /// Finds or creates `from`'s entry for a message of `epoch`; a newer epoch releases the
    /// old incarnation's requests. `false`: the message is refused (too many peers) or stale.
    /// `first_seq`: where a peer first heard of starts, when not waiting for its snapshot.
    fn admit_peer(
        &mut self,
        from: ReplicaId,
        epoch: u64,
        first_seq: Option<u64>,
        frontend: &mut Frontend,
        now: Nanos,
    ) -> bool {
        let awaiting = self.awaiting_snapshots;
        let Some(peer) = self.peers.get_mut(&from) else {
            if self.peers.len() >= self.config.max_peers {
                self.counters.refused += 1;
                return false;
            }
            let start = if awaiting { None } else { first_seq };
            if let Some(missed) = start.filter(|&seq| seq > 0) {
                // Its stream is joined part-way: it was forgotten (silent past the lease, as
                // behind a partition) or its first messages were lost. Its requests in flight
                // are unknown here until its snapshot.
                self.counters.skipped += missed;
                self.resync_wanted = true;
            }
            self.peers
                .insert(from, Peer::new(epoch, start, awaiting, now));
            return true;
        };
        if epoch < peer.epoch {
            self.counters.stale += 1;
            return false;
        }
        if epoch > peer.epoch {
            // It restarted: its new incarnation numbers its updates from 0.
            *peer = Peer::new(epoch, Some(0), false, now);
            self.counters.peer_restarts += 1;
            self.release_peer(from, frontend, now);
        }
        true
    }

    /// Applies `peer`'s held updates that are next in its order.
    fn drain(&mut self, from: ReplicaId, frontend: &mut Frontend, now: Nanos) {
        let Some(peer) = self.peers.get_mut(&from) else {
            return;
        };
        let Some(mut next) = peer.next_seq else {
            return;
        };
        if peer.awaiting_snapshot {
            return;
        }
        let mut ready = Vec::new();
        while let Some(update) = peer.early.remove(&next) {
            next += 1;
            ready.push(update);
        }
        peer.next_seq = Some(next);
        for update in ready {
            self.apply_in_order(update, frontend, now);
        }
    }

    fn update(&mut self, request: RequestId, change: PeerChange) -> PeerUpdate {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.counters.sent += 1;
        PeerUpdate {
            replica: self.me,
            epoch: self.epoch,
            seq,
            request: request.0,
            change,
        }
    }

    /// Applies a peer's update to `frontend`'s accounting, in the sender's order. The
    /// replica's own updates (a transport may echo them) are ignored.
    pub fn apply(&mut self, update: PeerUpdate, frontend: &mut Frontend, now: Nanos) {
        let from = update.replica;
        if from == self.me {
            if update.epoch != self.epoch {
                self.counters.same_id += 1;
            }
            return;
        }
        // Joining mid-stream: the first update seen starts the sequence.
        if !self.admit_peer(from, update.epoch, Some(update.seq), frontend, now) {
            return;
        }
        let Some(peer) = self.peers.get_mut(&from) else {
            return;
        };
        peer.last_heard = now;
        if peer.next_seq.is_none() && !peer.awaiting_snapshot {
            // Its snapshot never came and nothing was held: start here, as mid-stream.
            peer.next_seq = Some(update.seq);
        }
        if peer.next_seq.is_some_and(|n| update.seq < n) || peer.early.contains_key(&update.seq) {
            self.counters.stale += 1;
            return;
        }
        if peer.next_seq.is_some_and(|n| update.seq > n) {
            self.counters.reordered += 1;
        }
        peer.early.insert(update.seq, update);
        if peer.early.len() > self.config.max_reorder {
            // Give up on the missing ones (or on the awaited snapshot): resume at the
            // earliest update held.
            if let Some((&first, _)) = peer.early.first_key_value() {
                if let Some(next) = peer.next_seq {
                    self.counters.skipped += first.saturating_sub(next);
                    self.resync_wanted = true;
                }
                peer.next_seq = Some(first);
                peer.awaiting_snapshot = false;
            }
        }
        self.drain(from, frontend, now);
    }

    /// Releases every request of `peer` (it left, or restarted and lost them), and forgets it.
    pub fn forget_peer(&mut self, peer: ReplicaId, frontend: &mut Frontend, now: Nanos) {
        self.peers.remove(&peer);
        self.release_peer(peer, frontend, now);
    }

    fn release_peer(&mut self, peer: ReplicaId, frontend: &mut Frontend, now: Nanos) {
        self.release_where(frontend, now, |&(p, _)| p == peer);
    }

    /// Releases the peer requests whose (peer, request) key `gone` selects from the frontend.
    fn release_where(
        &mut self,
        frontend: &mut Frontend,
        now: Nanos,
        gone: impl Fn(&(ReplicaId, u64)) -> bool,
    ) {
        let mut released: Vec<((ReplicaId, u64), RequestId)> = self
            .requests
            .iter()
            .filter(|(k, _)| gone(k))
            .map(|(k, v)| (*k, *v))
            .collect();
        // The map's order is not the run's: release in a fixed order so the queue is served
        // the same way every time.
        released.sort_unstable_by_key(|(_, local)| *local);
        for (k, local) in released {
            self.requests.remove(&k);
            frontend.on_finished(local, now);
        }
    }

    /// Counts a peer's request in `frontend`, under a fresh local id (refused and counted
    /// past `max_peer_requests` or for a worker this replica does not know).
    fn track_peer_request(
        &mut self,
        key: (ReplicaId, u64),
        worker: WorkerId,
        prompt: &RoutingKey,
        frontend: &mut Frontend,
        now: Nanos,
    ) {
        if self.requests.len() >= self.config.max_peer_requests {
            self.counters.refused += 1;
            return;
        }
        let local = RequestId(self.next_local);
        if frontend.on_peer_routed(local, worker, prompt, now).is_err() {
            self.counters.refused += 1;
            return;
        }
        self.next_local += 1;
        self.requests.insert(key, local);
    }

    fn apply_in_order(&mut self, update: PeerUpdate, frontend: &mut Frontend, now: Nanos) {
        self.counters.applied += 1;
        let key = (update.replica, update.request);
        match update.change {
            PeerChange::Routed {
                worker,
                key: prompt,
            } => {
                if self.requests.contains_key(&key) {
                    self.counters.refused += 1;
                    return;
                }
                self.track_peer_request(key, worker, &prompt, frontend, now);
            }
            PeerChange::FirstToken => {
                if let Some(local) = self.requests.get(&key) {
                    frontend.on_first_token(*local, now);
                }
            }
            PeerChange::Finished => {
                if let Some(local) = self.requests.remove(&key) {
                    frontend.on_finished(local, now);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{FrontendConfig, RouterConfig, WorkerLimits};

    fn frontend() -> Frontend {
        let mut f = Frontend::new(RouterConfig::default(), FrontendConfig::default()).unwrap();
        f.add_worker(WorkerId(1), WorkerLimits::default(), Nanos::ZERO)
            .unwrap();
        f.add_worker(WorkerId(2), WorkerLimits::default(), Nanos::ZERO)
            .unwrap();
        f
    }

    /// Replica 0 (the sender) and replica 1 with its frontend, both in epoch 1, and the key
    /// of a prompt of `tokens` tokens.
    fn pair(
        config: ReplicaSyncConfig,
        tokens: u32,
    ) -> (ReplicaSync, ReplicaSync, Frontend, RoutingKey) {
        let fb = frontend();
        let key = fb.router().key(&(0..tokens).collect::<Vec<u32>>());
        (
            ReplicaSync::new(ReplicaId(0), 1, config),
            ReplicaSync::new(ReplicaId(1), 1, config),
            fb,
            key,
        )
    }

    fn in_flight(f: &Frontend, w: u64) -> u32 {
        f.router().load(WorkerId(w)).unwrap().in_flight
    }

    #[test]
    fn a_peers_request_counts_until_it_finishes() {
        let (mut a, mut b, mut fb, key) = pair(ReplicaSyncConfig::default(), 4096);
        let routed = a.routed(RequestId(7), WorkerId(2), &key);
        b.apply(routed.clone(), &mut fb, Nanos::ZERO);
        assert_eq!(in_flight(&fb, 2), 1);
        // A duplicate changes nothing.
        b.apply(routed, &mut fb, Nanos::ZERO);
        assert_eq!(in_flight(&fb, 2), 1);
        assert_eq!(b.counters().stale, 1);
        b.apply(a.first_token(RequestId(7)), &mut fb, Nanos::ZERO);
        assert_eq!(
            fb.router()
                .load(WorkerId(2))
                .unwrap()
                .pending_prefill_tokens,
            0
        );
        b.apply(a.finished(RequestId(7)), &mut fb, Nanos::ZERO);
        assert_eq!(in_flight(&fb, 2), 0);
        assert_eq!(b.peer_requests(), 0);
    }

    #[test]
    fn out_of_order_updates_wait_for_the_missing_one() {
        let (mut a, mut b, mut fb, key) = pair(ReplicaSyncConfig::default(), 64);
        let first = a.routed(RequestId(1), WorkerId(1), &key);
        let routed = a.routed(RequestId(2), WorkerId(1), &key);
        let finished = a.finished(RequestId(2));
        b.apply(first, &mut fb, Nanos::ZERO);
        // The end arrives before the start: held, then both apply in order.
        b.apply(finished, &mut fb, Nanos::ZERO);
        assert_eq!(in_flight(&fb, 1), 1);
        b.apply(routed, &mut fb, Nanos::ZERO);
        assert_eq!(in_flight(&fb, 1), 1);
        assert_eq!(b.counters().reordered, 1);
        assert_eq!(b.peer_requests(), 1);
    }

    #[test]
    fn a_gap_longer_than_the_window_is_skipped() {
        let config = ReplicaSyncConfig {
            max_reorder: 2,
            ..ReplicaSyncConfig::default()
        };
        let (mut a, mut b, mut fb, key) = pair(config, 64);
        b.apply(
            a.routed(RequestId(1), WorkerId(1), &key),
            &mut fb,
            Nanos::ZERO,
        );
        let _lost = a.finished(RequestId(1));
        for r in 2..5 {
            b.apply(
                a.routed(RequestId(r), WorkerId(2), &key),
                &mut fb,
                Nanos::ZERO,
            );
        }
        assert_eq!(b.counters().skipped, 1);
        assert_eq!(in_flight(&fb, 2), 3);
        // The lost end leaves request 1 counted until its sender restarts.
        assert_eq!(in_flight(&fb, 1), 1);
        let mut a2 = ReplicaSync::new(ReplicaId(0), 2, config);
        b.apply(
            a2.routed(RequestId(1), WorkerId(2), &key),
            &mut fb,
            Nanos::ZERO,
        );
        assert_eq!(in_flight(&fb, 1), 0);
        assert_eq!(in_flight(&fb, 2), 1);
        assert_eq!(b.counters().peer_restarts, 1);
        // The old incarnation's late updates are stale.
        b.apply(a.finished(RequestId(4)), &mut fb, Nanos::ZERO);
        assert_eq!(in_flight(&fb, 2), 1);
    }

    #[test]
    fn peer_requests_are_bounded_and_own_updates_ignored() {
        let config = ReplicaSyncConfig {
            max_peer_requests: 1,
            ..ReplicaSyncConfig::default()
        };
        let (mut a, mut b, mut fb, key) = pair(config, 64);
        b.apply(
            a.routed(RequestId(1), WorkerId(1), &key),
            &mut fb,
            Nanos::ZERO,
        );
        b.apply(
            a.routed(RequestId(2), WorkerId(1), &key),
            &mut fb,
            Nanos::ZERO,
        );
        assert_eq!(in_flight(&fb, 1), 1);
        assert_eq!(b.counters().refused, 1);
        let own = b.routed(RequestId(3), WorkerId(2), &key);
        b.apply(own, &mut fb, Nanos::ZERO);
        assert_eq!(in_flight(&fb, 2), 0);
        // A worker this replica does not know is refused, not tracked.
        b.apply(
            a.routed(RequestId(4), WorkerId(9), &key),
            &mut fb,
            Nanos::ZERO,
        );
        assert_eq!(b.peer_requests(), 1);
    }

    #[test]
    fn a_starting_replica_rebuilds_its_peers_load_from_their_snapshots() {
        let (mut a, _, mut fb, key) = pair(ReplicaSyncConfig::default(), 64);
        // Replica 0 has two requests in flight (one past its first token) and one ended.
        a.routed(RequestId(1), WorkerId(1), &key);
        a.routed(RequestId(2), WorkerId(2), &key);
        a.first_token(RequestId(2));
        a.routed(RequestId(3), WorkerId(2), &key);
        a.finished(RequestId(3));
        // Replica 1 starts: it waits for snapshots, and an update sent after the snapshot
        // arrives before it and is held.
        let mut b = ReplicaSync::new(ReplicaId(1), 1, ReplicaSyncConfig::default());
        b.await_snapshots();
        let snapshot = a.snapshot();
        assert_eq!(snapshot.next_seq, 5);
        assert_eq!(snapshot.requests.len(), 2);
        b.apply(a.finished(RequestId(1)), &mut fb, Nanos::ZERO);
        assert_eq!(in_flight(&fb, 1), 0, "held until the snapshot");
        b.apply_snapshot(snapshot, &mut fb, Nanos::ZERO);
        // Request 1 came in with the snapshot and left with the held update.
        assert_eq!(in_flight(&fb, 1), 0);
        assert_eq!(in_flight(&fb, 2), 1);
        assert_eq!(b.peer_requests(), 1);
        assert_eq!(b.counters().snapshots_applied, 1);
        assert_eq!(
            fb.router()
                .load(WorkerId(2))
                .unwrap()
                .pending_prefill_tokens,
            0,
            "its first token came"
        );
        // A snapshot behind what was applied is stale and changes nothing.
        let mut old = a.snapshot();
        old.next_seq = 2;
        b.apply_snapshot(old, &mut fb, Nanos::ZERO);
        assert_eq!(b.counters().snapshots_applied, 1);
        assert_eq!(in_flight(&fb, 2), 1);
    }

    #[test]
    fn without_a_snapshot_the_wait_ends_at_the_earliest_held_update() {
        let (mut a, _, mut fb, key) = pair(ReplicaSyncConfig::default(), 64);
        a.routed(RequestId(1), WorkerId(1), &key);
        let mut b = ReplicaSync::new(ReplicaId(1), 1, ReplicaSyncConfig::default());
        b.await_snapshots();
        b.apply(
            a.routed(RequestId(2), WorkerId(2), &key),
            &mut fb,
            Nanos::ZERO,
        );
        assert_eq!(in_flight(&fb, 2), 0);
        // A peer only heard from by its header during the wait starts at its next update.
        let mut c = ReplicaSync::new(ReplicaId(2), 1, ReplicaSyncConfig::default());
        c.routed(RequestId(1), WorkerId(1), &key);
        b.heard_from(ReplicaId(2), 1, c.next_seq(), &mut fb, Nanos::ZERO);
        b.end_snapshot_wait(&mut fb, Nanos::ZERO);
        assert_eq!(in_flight(&fb, 2), 1);
        assert_eq!(b.counters().skipped, 0);
        b.apply(
            c.routed(RequestId(2), WorkerId(1), &key),
            &mut fb,
            Nanos::ZERO,
        );
        assert_eq!(in_flight(&fb, 1), 1, "applied, not held");
    }

    #[test]
    fn a_header_reveals_lost_updates_and_a_silent_peer_expires() {
        let (mut a, mut b, mut fb, key) = pair(ReplicaSyncConfig::default(), 64);
        b.apply(
            a.routed(RequestId(1), WorkerId(1), &key),
            &mut fb,
            Nanos::ZERO,
        );
        let _lost = a.routed(RequestId(2), WorkerId(1), &key);
        let held = a.routed(RequestId(3), WorkerId(2), &key);
        b.apply(held, &mut fb, Nanos::ZERO);
        assert_eq!(in_flight(&fb, 2), 0, "held behind the missing update");
        // The header says update 3 is next: update 1 is lost, not late.
        b.heard_from(ReplicaId(0), 1, a.next_seq(), &mut fb, Nanos::ZERO);
        assert_eq!(in_flight(&fb, 2), 1);
        assert_eq!(b.counters().skipped, 1);
        assert!(b.take_resync_wanted());
        assert!(!b.take_resync_wanted());
        // A header from the replica's own id in another incarnation: a shared id.
        b.heard_from(ReplicaId(1), 7, 0, &mut fb, Nanos::ZERO);
        assert_eq!(b.counters().same_id, 1);
        // Heard from within the lease: kept; silent past it: forgotten, its requests released.
        let lease = Nanos::from_millis(3_000);
        assert!(
            b.expire_peers(Nanos::from_millis(2_000), lease, &mut fb)
                .is_empty()
        );
        assert_eq!(
            b.expire_peers(Nanos::from_millis(3_001), lease, &mut fb),
            vec![ReplicaId(0)]
        );
        assert_eq!(in_flight(&fb, 1) + in_flight(&fb, 2), 0);
        assert_eq!(b.peer_requests(), 0);
        assert_eq!(b.counters().peers_expired, 1);
    }

    #[test]
    fn a_peer_heard_again_after_it_expired_is_resynced_from_its_snapshot() {
        // A partition longer than the lease: b forgets a, whose requests go on meanwhile.
        let (mut a, mut b, mut fb, key) = pair(ReplicaSyncConfig::default(), 64);
        b.apply(
            a.routed(RequestId(1), WorkerId(1), &key),
            &mut fb,
            Nanos::ZERO,
        );
        let lease = Nanos::from_millis(3_000);
        b.expire_peers(Nanos::from_millis(3_001), lease, &mut fb);
        assert_eq!(in_flight(&fb, 1), 0);
        let _lost = a.routed(RequestId(2), WorkerId(2), &key);
        // The partition heals: a's next header (or update) is all b hears of it.
        b.heard_from(
            ReplicaId(0),
            1,
            a.next_seq(),
            &mut fb,
            Nanos::from_millis(4_000),
        );
        assert!(
            b.take_resync_wanted(),
            "a stream joined part-way asks for the snapshot"
        );
        b.apply_snapshot(a.snapshot(), &mut fb, Nanos::from_millis(4_001));
        assert_eq!(
            (in_flight(&fb, 1), in_flight(&fb, 2)),
            (1, 1),
            "both of a's requests counted again"
        );
        // A replica that starts after b sends from 0: nothing was missed.
        let mut c = ReplicaSync::new(ReplicaId(2), 1, ReplicaSyncConfig::default());
        b.apply(
            c.routed(RequestId(9), WorkerId(1), &key),
            &mut fb,
            Nanos::from_millis(4_002),
        );
        assert!(!b.take_resync_wanted());
    }
}
