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
//! delivery delay of their updates (in the simulator, `--replica-sync-ms`).

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
}

#[derive(Debug)]
struct Peer {
    epoch: u64,
    /// The next sequence number to apply.
    next_seq: u64,
    /// Updates that arrived early, by sequence number; at most `max_reorder`.
    early: BTreeMap<u64, PeerUpdate>,
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
            counters: ReplicaSyncCounters::default(),
        }
    }

    pub fn id(&self) -> ReplicaId {
        self.me
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
        self.update(request, PeerChange::Routed { worker, key })
    }

    /// The update saying `request` produced its first token.
    pub fn first_token(&mut self, request: RequestId) -> PeerUpdate {
        self.update(request, PeerChange::FirstToken)
    }

    /// The update saying `request` ended.
    pub fn finished(&mut self, request: RequestId) -> PeerUpdate {
        self.update(request, PeerChange::Finished)
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
            return;
        }
        if !self.peers.contains_key(&from) {
            if self.peers.len() >= self.config.max_peers {
                self.counters.refused += 1;
                return;
            }
            // Joining mid-stream: the first update seen starts the sequence.
            self.peers.insert(
                from,
                Peer {
                    epoch: update.epoch,
                    next_seq: update.seq,
                    early: BTreeMap::new(),
                },
            );
        }
        let Some(peer) = self.peers.get_mut(&from) else {
            return;
        };
        if update.epoch < peer.epoch {
            self.counters.stale += 1;
            return;
        }
        if update.epoch > peer.epoch {
            *peer = Peer {
                epoch: update.epoch,
                next_seq: update.seq,
                early: BTreeMap::new(),
            };
            self.counters.peer_restarts += 1;
            self.release_peer(from, frontend, now);
        }
        let Some(peer) = self.peers.get_mut(&from) else {
            return;
        };
        if update.seq < peer.next_seq || peer.early.contains_key(&update.seq) {
            self.counters.stale += 1;
            return;
        }
        if update.seq > peer.next_seq {
            self.counters.reordered += 1;
        }
        peer.early.insert(update.seq, update);
        if peer.early.len() > self.config.max_reorder {
            // Give up on the missing ones: resume at the earliest update held.
            if let Some((&first, _)) = peer.early.first_key_value() {
                self.counters.skipped += first - peer.next_seq;
                peer.next_seq = first;
            }
        }
        let mut ready = Vec::new();
        while let Some(next) = peer.early.remove(&peer.next_seq) {
            peer.next_seq += 1;
            ready.push(next);
        }
        for update in ready {
            self.apply_in_order(update, frontend, now);
        }
    }

    /// Releases every request of `peer` (it left, or restarted and lost them), and forgets it.
    pub fn forget_peer(&mut self, peer: ReplicaId, frontend: &mut Frontend, now: Nanos) {
        self.peers.remove(&peer);
        self.release_peer(peer, frontend, now);
    }

    fn release_peer(&mut self, peer: ReplicaId, frontend: &mut Frontend, now: Nanos) {
        let mut gone: Vec<((ReplicaId, u64), RequestId)> = self
            .requests
            .iter()
            .filter(|(k, _)| k.0 == peer)
            .map(|(k, v)| (*k, *v))
            .collect();
        // The map's order is not the run's: release in a fixed order so the queue is served
        // the same way every time.
        gone.sort_unstable_by_key(|(_, local)| *local);
        for (k, local) in gone {
            self.requests.remove(&k);
            frontend.on_finished(local, now);
        }
    }

    fn apply_in_order(&mut self, update: PeerUpdate, frontend: &mut Frontend, now: Nanos) {
        self.counters.applied += 1;
        let key = (update.replica, update.request);
        match update.change {
            PeerChange::Routed {
                worker,
                key: prompt,
            } => {
                if self.requests.len() >= self.config.max_peer_requests
                    || self.requests.contains_key(&key)
                {
                    self.counters.refused += 1;
                    return;
                }
                let local = RequestId(self.next_local);
                if frontend
                    .on_peer_routed(local, worker, &prompt, now)
                    .is_err()
                {
                    self.counters.refused += 1;
                    return;
                }
                self.next_local += 1;
                self.requests.insert(key, local);
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
}
