//! Gateway replicas that route as one, over NATS: the transport around the router core's
//! [`ReplicaSync`] (which decides what a peer's update, header or snapshot does to the load
//! accounting; see `router::replica`).
//!
//! - **Updates.** Every routed request, first token and end becomes a `PeerUpdate` in a
//!   bounded outbox; one publisher task batches them ([`ReplicaSettings::flush_interval`], at
//!   most [`MAX_BATCH_UPDATES`] or ~512 KiB a message) onto `kvroute.<ns>.replicas`, and
//!   sends a header-only batch every [`ReplicaSettings::heartbeat`]. Staleness bound: a
//!   peer's view of this replica's load lags by the flush interval plus NATS delivery
//!   (loopback: well under a millisecond).
//! - **Peers.** One subscriber applies every other replica's batches in its order; a header
//!   that shows updates lost (a slow consumer), or a worker joining this replica's routing
//!   set (peers' requests on it were refused before), makes the replica fetch snapshots
//!   again, at most once a second.
//! - **Start and restart.** Before it serves, a replica asks its peers
//!   (`kvroute.<ns>.replicas.snapshot`, reply inbox) for their in-flight requests and waits up
//!   to [`ReplicaSettings::snapshot_timeout`] for the answers, holding their live updates
//!   meanwhile; its prefix index rebuilds from the workers' KV events as for any gateway.
//! - **Peers that vanish.** A goodbye on shutdown releases a replica's requests at once; a
//!   replica killed without one is forgotten after [`ReplicaSettings::peer_lease`] of
//!   silence.
//! - **Ids.** `--replica-id`, or one derived from host, process and start time; the epoch is
//!   the start time in ns. A message with this replica's id from another epoch means two
//!   replicas share an id: warned once and counted (`kvroute_replica_same_id_total`).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::StreamExt;
use kv_index::{LocalBlockHash, WorkerId};
use protocol::replicas::{MAX_BATCH_UPDATES, encoded_size_bound};
use protocol::{
    ReplicaBatch, SnapshotPart, SnapshotRequest, Subjects, WireChange, WireSnapshotRequest,
    WireUpdate,
};
use router::replica::{MAX_PEER_KEY_BLOCKS, SnapshotRequest as CoreSnapshotRequest};
use router::{
    PeerChange, PeerSnapshot, PeerUpdate, ReplicaId, ReplicaSync, ReplicaSyncConfig, RoutingKey,
};
use tokio::sync::{Notify, mpsc};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::GatewayError;
use crate::config::ReplicaSettings;
use crate::dispatch::{Dispatcher, PeerBatch};
use crate::metrics::Metrics;

/// Updates waiting for the publisher; beyond, dropped and counted (peers resync).
const OUTBOX_CAPACITY: usize = 65_536;
/// Bytes a batch or snapshot part is filled to, under NATS' 1 MiB default payload limit.
const MESSAGE_FILL_BYTES: usize = 512 << 10;
/// Least time between two snapshot fetches after lost updates.
const RESYNC_INTERVAL: Duration = Duration::from_secs(1);
/// How often silent peers are looked for.
const EXPIRY_TICK: Duration = Duration::from_millis(250);

/// A running replica: its identity, and what to say when it stops.
#[derive(Debug)]
pub struct ReplicaLink {
    pub id: ReplicaId,
    pub epoch: u64,
    /// Whether it shares its decisions (false: `--no-replica-sync`, it routes alone).
    pub sync: bool,
    /// Peers whose snapshot was applied at start-up.
    pub peers_at_start: usize,
    client: async_nats::Client,
    subject: String,
}

impl ReplicaLink {
    /// Tells the peers this replica stops, so they release its requests at once.
    pub async fn goodbye(&self) {
        if !self.sync {
            return;
        }
        let batch = ReplicaBatch {
            replica: self.id.0,
            epoch: self.epoch,
            next_seq: 0,
            sent_unix_ns: unix_ns(),
            goodbye: true,
            updates: Vec::new(),
        };
        let _ = self
            .client
            .publish(self.subject.clone(), batch.encode().into())
            .await;
        let _ = self.client.flush().await;
    }
}

fn unix_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// An id for a replica started without `--replica-id`: distinct across hosts, processes and
/// starts with overwhelming odds (a clash is detected and warned about).
fn derived_id(epoch: u64) -> ReplicaId {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let seed = format!("{}|{}|{epoch}", host.trim(), std::process::id());
    ReplicaId((xxhash_rust::xxh3::xxh3_64(seed.as_bytes()) >> 33) as u32)
}

/// Joins the replicas of `subjects`' namespace: with sync on, fetches the peers' snapshots
/// (up to the timeout) and starts the tasks; with it off, only takes an id.
pub(crate) async fn join(
    client: async_nats::Client,
    subjects: &Subjects,
    dispatcher: Arc<Dispatcher>,
    metrics: Arc<Metrics>,
    settings: ReplicaSettings,
    cancel: CancellationToken,
    tasks: &mut Vec<JoinHandle<()>>,
) -> Result<ReplicaLink, GatewayError> {
    let epoch = unix_ns();
    let id = settings.id.map_or_else(|| derived_id(epoch), ReplicaId);
    let mut link = ReplicaLink {
        id,
        epoch,
        sync: settings.sync,
        peers_at_start: 0,
        client: client.clone(),
        subject: subjects.replicas(),
    };
    if !settings.sync {
        return Ok(link);
    }
    let nats_error = |e: &dyn std::fmt::Display| GatewayError::NatsSubscribe(e.to_string());
    let (outbox, rx) = mpsc::channel(OUTBOX_CAPACITY);
    let resync = Arc::new(Notify::new());
    dispatcher.enable_replica_sync(
        ReplicaSync::new(id, epoch, ReplicaSyncConfig::default()),
        outbox,
        resync.clone(),
    );
    // Subscribed (and the server told) before asking for snapshots, so no update falls
    // between a snapshot and the live stream.
    let updates = client
        .subscribe(subjects.replicas())
        .await
        .map_err(|e| nats_error(&e))?;
    let requests = client
        .subscribe(subjects.replica_snapshots())
        .await
        .map_err(|e| nats_error(&e))?;
    client.flush().await.map_err(|e| nats_error(&e))?;

    tasks.push(tokio::spawn(publish(
        client.clone(),
        subjects.replicas(),
        dispatcher.clone(),
        rx,
        (id, epoch),
        settings,
    )));
    tasks.push(tokio::spawn(receive(
        updates,
        dispatcher.clone(),
        metrics,
        (id, epoch),
        cancel.clone(),
    )));
    tasks.push(tokio::spawn(answer_snapshots(
        client.clone(),
        requests,
        dispatcher.clone(),
        (id, epoch),
        cancel.clone(),
    )));
    tasks.push(tokio::spawn(expire_peers(
        dispatcher.clone(),
        settings.peer_lease,
        cancel.clone(),
    )));
    link.peers_at_start = fetch_snapshots(
        &client,
        subjects,
        &dispatcher,
        (id, epoch),
        settings.snapshot_timeout,
    )
    .await;
    tasks.push(tokio::spawn(resync_on_loss(
        client,
        subjects.clone(),
        dispatcher,
        (id, epoch),
        settings.snapshot_timeout,
        resync,
        cancel,
    )));
    Ok(link)
}

fn wire_update(update: &PeerUpdate) -> WireUpdate {
    WireUpdate {
        seq: update.seq,
        request: update.request,
        change: match &update.change {
            PeerChange::Routed { worker, key } => WireChange::Routed {
                worker: worker.0,
                num_tokens: key.num_tokens,
                local: key.local.iter().map(|h| h.0).collect(),
            },
            PeerChange::FirstToken => WireChange::FirstToken,
            PeerChange::Finished => WireChange::Finished,
        },
    }
}

/// A prompt's key from its local hashes: the sequence hashes are chained here, never taken
/// from the sender.
fn key_of(local: &[u64], num_tokens: u64) -> RoutingKey {
    let local: Vec<LocalBlockHash> = local
        .iter()
        .take(MAX_PEER_KEY_BLOCKS)
        .map(|h| LocalBlockHash(*h))
        .collect();
    let seq = kv_index::hash::chain_local_hashes(None, local.iter().copied()).collect();
    RoutingKey {
        local,
        seq,
        num_tokens,
    }
}

fn peer_update(replica: ReplicaId, epoch: u64, update: WireUpdate) -> PeerUpdate {
    PeerUpdate {
        replica,
        epoch,
        seq: update.seq,
        request: update.request,
        change: match update.change {
            WireChange::Routed {
                worker,
                num_tokens,
                local,
            } => PeerChange::Routed {
                worker: WorkerId(worker),
                key: key_of(&local, num_tokens),
            },
            WireChange::FirstToken => PeerChange::FirstToken,
            WireChange::Finished => PeerChange::Finished,
        },
    }
}

fn update_size(update: &PeerUpdate) -> usize {
    match &update.change {
        PeerChange::Routed { key, .. } => encoded_size_bound(key.local.len()),
        _ => encoded_size_bound(0),
    }
}

/// Batches the outbox onto the replicas subject; a header-only batch every heartbeat.
async fn publish(
    client: async_nats::Client,
    subject: String,
    dispatcher: Arc<Dispatcher>,
    mut outbox: mpsc::Receiver<PeerUpdate>,
    (id, epoch): (ReplicaId, u64),
    settings: ReplicaSettings,
) {
    let mut heartbeat = tokio::time::interval(settings.heartbeat);
    heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut next_seq = 0u64;
    let mut held: Option<PeerUpdate> = None;
    loop {
        let mut batch: Vec<PeerUpdate> = held.take().into_iter().collect();
        if batch.is_empty() {
            tokio::select! {
                update = outbox.recv() => match update {
                    Some(update) => batch.push(update),
                    None => return,
                },
                _ = heartbeat.tick() => {}
            }
        }
        if !batch.is_empty() {
            // Let the updates of the next few milliseconds join this message.
            tokio::time::sleep(settings.flush_interval).await;
            let mut bytes: usize = batch.iter().map(update_size).sum();
            while batch.len() < MAX_BATCH_UPDATES {
                let Ok(update) = outbox.try_recv() else { break };
                let size = update_size(&update);
                if bytes + size > MESSAGE_FILL_BYTES {
                    held = Some(update);
                    break;
                }
                bytes += size;
                batch.push(update);
            }
        }
        if let Some(last) = batch.last() {
            next_seq = next_seq.max(last.seq + 1);
        }
        let message = ReplicaBatch {
            replica: id.0,
            epoch,
            next_seq,
            sent_unix_ns: unix_ns(),
            goodbye: false,
            updates: batch.iter().map(wire_update).collect(),
        };
        match client
            .publish(subject.clone(), message.encode().into())
            .await
        {
            Ok(()) => {
                dispatcher
                    .replica_stats
                    .messages_sent
                    .fetch_add(1, Ordering::Relaxed);
            }
            // The connection reconnects by itself; peers see the gap and resync.
            Err(e) => tracing::warn!(error = %e, "cannot publish replica updates"),
        }
    }
}

/// Applies the peers' batches.
async fn receive(
    mut updates: async_nats::Subscriber,
    dispatcher: Arc<Dispatcher>,
    metrics: Arc<Metrics>,
    (me, my_epoch): (ReplicaId, u64),
    cancel: CancellationToken,
) {
    let mut warned_bad = false;
    let mut warned_same_id = false;
    loop {
        let message = tokio::select! {
            _ = cancel.cancelled() => return,
            m = updates.next() => match m { Some(m) => m, None => return },
        };
        let stats = &dispatcher.replica_stats;
        stats.messages_received.fetch_add(1, Ordering::Relaxed);
        let batch = match ReplicaBatch::decode(&message.payload) {
            Ok(batch) => batch,
            Err(e) => {
                stats.messages_refused.fetch_add(1, Ordering::Relaxed);
                if !std::mem::replace(&mut warned_bad, true) {
                    tracing::warn!(error = %e, "replica message refused (counted in kvroute_replica_messages_refused_total; further ones not logged)");
                }
                continue;
            }
        };
        let from = ReplicaId(batch.replica);
        if from == me && batch.epoch != my_epoch && !std::mem::replace(&mut warned_same_id, true) {
            tracing::warn!(
                replica = me.0,
                "another gateway replica uses this replica's id: give each one its own \
                 --replica-id (or leave it out to derive one)"
            );
        }
        if from != me && !batch.updates.is_empty() {
            let lag = unix_ns().saturating_sub(batch.sent_unix_ns);
            metrics.replica_sync_lag.observe(lag as f64 / 1e9);
        }
        let peer = PeerBatch {
            replica: from,
            epoch: batch.epoch,
            next_seq: batch.next_seq,
            goodbye: batch.goodbye,
            updates: batch
                .updates
                .into_iter()
                .map(|u| peer_update(from, batch.epoch, u))
                .collect(),
        };
        dispatcher.apply_peer_batch(peer);
    }
}

/// Answers peers' snapshot requests with this replica's in-flight requests, in parts.
async fn answer_snapshots(
    client: async_nats::Client,
    mut requests: async_nats::Subscriber,
    dispatcher: Arc<Dispatcher>,
    (id, epoch): (ReplicaId, u64),
    cancel: CancellationToken,
) {
    loop {
        let message = tokio::select! {
            _ = cancel.cancelled() => return,
            m = requests.next() => match m { Some(m) => m, None => return },
        };
        let Some(reply) = message.reply else {
            continue;
        };
        match SnapshotRequest::decode(&message.payload) {
            Ok(r) if r.replica == id.0 && r.epoch == epoch => continue,
            Ok(_) => {}
            Err(_) => {
                dispatcher
                    .replica_stats
                    .messages_refused
                    .fetch_add(1, Ordering::Relaxed);
                continue;
            }
        }
        let Some(snapshot) = dispatcher.replica_snapshot() else {
            continue;
        };
        for part in snapshot_parts(snapshot) {
            if let Err(e) = client.publish(reply.clone(), part.encode().into()).await {
                tracing::warn!(error = %e, "cannot answer a replica's snapshot request");
                break;
            }
        }
        dispatcher
            .replica_stats
            .snapshots_served
            .fetch_add(1, Ordering::Relaxed);
    }
}

/// A snapshot in parts of at most [`MAX_BATCH_UPDATES`] requests and ~512 KiB each.
fn snapshot_parts(snapshot: PeerSnapshot) -> Vec<SnapshotPart> {
    let mut parts = Vec::new();
    let mut requests = Vec::new();
    let mut bytes = 0;
    let new_part = |requests: Vec<WireSnapshotRequest>, part: usize, last: bool| SnapshotPart {
        replica: snapshot.replica.0,
        epoch: snapshot.epoch,
        next_seq: snapshot.next_seq,
        part: u32::try_from(part).unwrap_or(u32::MAX),
        last,
        requests,
    };
    for r in &snapshot.requests {
        let size = encoded_size_bound(r.key.local.len());
        if !requests.is_empty()
            && (bytes + size > MESSAGE_FILL_BYTES || requests.len() >= MAX_BATCH_UPDATES)
        {
            parts.push(new_part(std::mem::take(&mut requests), parts.len(), false));
            bytes = 0;
        }
        bytes += size;
        requests.push(WireSnapshotRequest {
            request: r.request,
            worker: r.worker.0,
            num_tokens: r.key.num_tokens,
            local: r.key.local.iter().map(|h| h.0).collect(),
            first_token: r.first_token,
        });
    }
    parts.push(new_part(requests, parts.len(), true));
    parts
}

/// Asks the peers for their snapshots and applies each one whole, holding their live updates
/// meanwhile; after `timeout`, stops waiting. Returns the snapshots applied.
async fn fetch_snapshots(
    client: &async_nats::Client,
    subjects: &Subjects,
    dispatcher: &Dispatcher,
    (id, epoch): (ReplicaId, u64),
    timeout: Duration,
) -> usize {
    let limits = ReplicaSyncConfig::default();
    dispatcher.await_peer_snapshots();
    let inbox = client.new_inbox();
    let mut applied = 0;
    let asked = async {
        let mut answers = client.subscribe(inbox.clone()).await.ok()?;
        let request = SnapshotRequest {
            replica: id.0,
            epoch,
        };
        client
            .publish_with_reply(
                subjects.replica_snapshots(),
                inbox.clone(),
                request.encode().into(),
            )
            .await
            .ok()?;
        answers_until(&mut answers, timeout, limits, dispatcher, &mut applied).await;
        Some(())
    };
    if asked.await.is_none() {
        tracing::warn!(
            "cannot ask peer replicas for their snapshots; their load is learnt as they route"
        );
    }
    dispatcher.end_snapshot_wait();
    applied
}

/// Gathers snapshot parts (per peer, in order, bounded) until `timeout`, applying each
/// peer's snapshot once its last part came.
async fn answers_until(
    answers: &mut async_nats::Subscriber,
    timeout: Duration,
    limits: ReplicaSyncConfig,
    dispatcher: &Dispatcher,
    applied: &mut usize,
) {
    let deadline = tokio::time::Instant::now() + timeout;
    let mut partial: HashMap<(u32, u64), PeerSnapshot> = HashMap::new();
    loop {
        let message = tokio::select! {
            _ = tokio::time::sleep_until(deadline) => break,
            m = answers.next() => match m { Some(m) => m, None => break },
        };
        let refused = || {
            dispatcher
                .replica_stats
                .messages_refused
                .fetch_add(1, Ordering::Relaxed)
        };
        let Ok(part) = SnapshotPart::decode(&message.payload) else {
            refused();
            continue;
        };
        let peer = (part.replica, part.epoch);
        let expected = partial.get(&peer).map_or(0, |s| s.requests.len());
        let so_far = partial.get(&peer).map_or(0, |_| 1);
        if part.part != 0 && so_far == 0 {
            refused();
            continue;
        }
        if !partial.contains_key(&peer) && partial.len() >= limits.max_peers {
            refused();
            continue;
        }
        let snapshot = partial.entry(peer).or_insert_with(|| PeerSnapshot {
            replica: ReplicaId(part.replica),
            epoch: part.epoch,
            next_seq: part.next_seq,
            requests: Vec::new(),
        });
        if snapshot.next_seq != part.next_seq
            || expected + part.requests.len() > limits.max_peer_requests
        {
            partial.remove(&peer);
            refused();
            continue;
        }
        snapshot
            .requests
            .extend(part.requests.into_iter().map(|r| CoreSnapshotRequest {
                request: r.request,
                worker: WorkerId(r.worker),
                key: key_of(&r.local, r.num_tokens),
                first_token: r.first_token,
            }));
        if part.last
            && let Some(snapshot) = partial.remove(&peer)
        {
            tracing::info!(
                replica = snapshot.replica.0,
                requests = snapshot.requests.len(),
                "peer replica's snapshot applied"
            );
            dispatcher.apply_peer_snapshot(snapshot);
            *applied += 1;
        }
    }
}

/// Fetches the peers' snapshots again when updates were lost or a worker joined (a peer's
/// requests on it were refused until now), at most once a [`RESYNC_INTERVAL`].
async fn resync_on_loss(
    client: async_nats::Client,
    subjects: Subjects,
    dispatcher: Arc<Dispatcher>,
    me: (ReplicaId, u64),
    timeout: Duration,
    resync: Arc<Notify>,
    cancel: CancellationToken,
) {
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            () = resync.notified() => {}
        }
        tracing::debug!("fetching the peers' snapshots (updates lost, or a worker joined)");
        fetch_snapshots(&client, &subjects, &dispatcher, me, timeout).await;
        tokio::select! {
            _ = cancel.cancelled() => return,
            () = tokio::time::sleep(RESYNC_INTERVAL) => {}
        }
    }
}

/// Forgets peers that fell silent for a lease (killed without a goodbye).
async fn expire_peers(dispatcher: Arc<Dispatcher>, lease: Duration, cancel: CancellationToken) {
    let mut tick = tokio::time::interval(EXPIRY_TICK);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tick.tick() => {}
        }
        for peer in dispatcher.expire_peers(lease) {
            tracing::warn!(
                replica = peer.0,
                "peer replica silent for its lease; its requests are no longer counted"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshots_split_into_bounded_parts_and_keys_rebuild() {
        let hasher = kv_index::BlockHasher::new(16).unwrap();
        let key = RoutingKey::new(&hasher, &(0..16 * 3000).collect::<Vec<u32>>());
        let requests = (0..200)
            .map(|r| CoreSnapshotRequest {
                request: r,
                worker: WorkerId(1),
                key: key.clone(),
                first_token: r % 2 == 0,
            })
            .collect();
        let parts = snapshot_parts(PeerSnapshot {
            replica: ReplicaId(4),
            epoch: 9,
            next_seq: 77,
            requests,
        });
        assert!(parts.len() > 1);
        assert_eq!(parts.iter().map(|p| p.requests.len()).sum::<usize>(), 200);
        for (i, part) in parts.iter().enumerate() {
            assert_eq!(part.part as usize, i);
            assert_eq!(part.last, i + 1 == parts.len());
            let bytes = part.encode();
            assert!(bytes.len() <= protocol::replicas::MAX_REPLICA_MESSAGE_BYTES);
            SnapshotPart::decode(&bytes).unwrap();
        }
        // The receiver chains the sequence hashes itself, and gets the sender's key.
        let wire = &parts[0].requests[0];
        assert_eq!(key_of(&wire.local, wire.num_tokens), key);
    }
}
