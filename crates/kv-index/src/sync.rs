//! When a consumer of KV events asks a worker for its whole cache, and what it does with the
//! events that arrive meanwhile: the one decision every driver makes (the gateway's NATS and
//! ZMQ consumers, the simulator's gateways), written once.
//!
//! A consumer's index knows a worker's cache only through that worker's events. It cannot
//! vouch for it when
//! - it first hears of the worker (the worker may have cached blocks long before);
//! - a sequence gap shows events were lost (the index drops the worker's blocks,
//!   [`KvIndex::apply_resyncing`](crate::KvIndex::apply_resyncing));
//! - the transport lost or mangled messages the sequence numbers cannot show
//!   ([`StreamSync::on_lost`]).
//!
//! Each time, [`StreamSync`] says "ask" (the driver fetches the worker's
//! [snapshot](crate::CacheMirror::snapshot): an RPC, an HTTP GET, or in the simulator the
//! mirror itself) and holds the worker's events until the answer comes
//! ([`StreamSync::on_snapshot`]): the snapshot replaces the index's view of the worker, and the
//! held events it does not cover are applied after it. If the answer fails, or more than
//! `max_held` batches pile up, the held events are applied as they are and the index goes on
//! from the events alone. A new `instance` (the worker restarted with an empty cache) clears
//! the worker without asking: there is nothing to learn.
//!
//! Sans-IO: the driver does the asking, the timing out and the counting of what it reports.

use rustc_hash::FxHashMap;

use crate::event::{KvEvent, KvEventKind, WorkerId};
use crate::index::{ApplyOutcome, EventError, KvIndex};

/// What a consumer's events change: an index, or a router (or pair of pools) holding one.
pub trait EventSink {
    /// Applies one event with the index's gap policy ([`KvIndex::apply_resyncing`]).
    fn apply_resyncing(&mut self, event: &KvEvent) -> Result<ApplyOutcome, EventError>;
    /// Drops the worker's blocks and its sequence baseline ([`KvIndex::clear_worker`]).
    fn clear_worker(&mut self, worker: WorkerId);
    /// Replaces the worker's blocks with its snapshot ([`KvIndex::restore_worker`]).
    fn restore_worker(
        &mut self,
        worker: WorkerId,
        next_seq: Option<u64>,
        stored: &[KvEventKind],
    ) -> Result<ApplyOutcome, EventError>;
}

impl EventSink for KvIndex {
    fn apply_resyncing(&mut self, event: &KvEvent) -> Result<ApplyOutcome, EventError> {
        KvIndex::apply_resyncing(self, event)
    }

    fn clear_worker(&mut self, worker: WorkerId) {
        KvIndex::clear_worker(self, worker);
    }

    fn restore_worker(
        &mut self,
        worker: WorkerId,
        next_seq: Option<u64>,
        stored: &[KvEventKind],
    ) -> Result<ApplyOutcome, EventError> {
        KvIndex::restore_worker(self, worker, next_seq, stored)
    }
}

/// A worker's whole cache as it answered: the `Stored` events of
/// [`CacheMirror::snapshot`](crate::CacheMirror::snapshot), the sequence number of its next
/// event (`None`: it has sent none), and the run (`instance`) they belong to.
#[derive(Debug, Clone, Copy)]
pub struct Snapshot<'a> {
    pub instance: u64,
    pub next_seq: Option<u64>,
    pub stored: &'a [KvEventKind],
}

/// What one call did, for the driver's metrics and logs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SyncStep {
    /// Ask the worker for its snapshot now, and answer with [`StreamSync::on_snapshot`].
    pub ask: bool,
    /// Events applied to the sink (without error).
    pub applied: u32,
    /// Gaps after which the index dropped the worker's blocks.
    pub resynced: u32,
    /// Events refused as stale (a duplicate, or overtaken by a later one).
    pub stale: u32,
    /// Events refused otherwise.
    pub errors: u32,
    /// The worker restarted (a new instance): its blocks were dropped.
    pub restarted: bool,
    /// A snapshot replaced the worker's blocks: how many it indexed.
    pub restored: Option<usize>,
    /// Held events the snapshot already covered, dropped.
    pub covered: u32,
    /// The wait for a snapshot ended without one (too many held batches).
    pub gave_up: bool,
}

impl SyncStep {
    fn count(&mut self, outcome: Result<ApplyOutcome, EventError>) {
        match outcome {
            Ok(o) => {
                self.applied += 1;
                self.resynced += u32::from(o.resynced);
            }
            Err(EventError::Stale { .. }) => self.stale += 1,
            Err(_) => self.errors += 1,
        }
    }
}

/// One held batch: the instance it came from and its events.
type Held = (u64, Vec<KvEvent>);

#[derive(Debug, Default)]
struct Stream {
    /// The run the worker's applied events came from (`None`: none applied yet).
    instance: Option<u64>,
    /// `Some` while its snapshot is asked for: the batches that came since.
    waiting: Option<Vec<Held>>,
}

/// What a worker's first event means to a consumer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FirstWord {
    /// The worker may have cached blocks before the consumer heard of it (a gateway that
    /// starts after its engines): ask for its snapshot.
    Ask,
    /// The consumer saw every worker start with an empty cache (a simulated fleet): the
    /// first event is the baseline. Workers it joins late it asks for with
    /// [`StreamSync::heard`].
    Baseline,
}

/// One consumer's view of every worker's event stream. See the module docs.
#[derive(Debug)]
pub struct StreamSync {
    streams: FxHashMap<WorkerId, Stream>,
    max_workers: usize,
    max_held: usize,
    first_word: FirstWord,
}

impl StreamSync {
    /// Tracks up to `max_workers` workers (past that the map is cleared, and workers are asked
    /// for their snapshot again), holding up to `max_held` batches per worker.
    pub fn new(max_workers: usize, max_held: usize, first_word: FirstWord) -> Self {
        Self {
            streams: FxHashMap::default(),
            max_workers: max_workers.max(1),
            max_held,
            first_word,
        }
    }

    /// Workers tracked.
    pub fn len(&self) -> usize {
        self.streams.len()
    }

    pub fn is_empty(&self) -> bool {
        self.streams.is_empty()
    }

    /// Whether `worker`'s events are held for its snapshot.
    pub fn is_waiting(&self, worker: WorkerId) -> bool {
        self.streams
            .get(&worker)
            .is_some_and(|s| s.waiting.is_some())
    }

    fn stream(&mut self, worker: WorkerId) -> (&mut Stream, bool) {
        if self.streams.len() >= self.max_workers && !self.streams.contains_key(&worker) {
            self.streams.clear();
        }
        let mut new = false;
        let stream = self.streams.entry(worker).or_insert_with(|| {
            new = true;
            Stream::default()
        });
        (stream, new)
    }

    /// The consumer heard of `worker` (an announcement) before any event: ask for its cache
    /// now rather than at its first event. Nothing to do for a worker already tracked.
    pub fn heard(&mut self, worker: WorkerId) -> SyncStep {
        let (stream, new) = self.stream(worker);
        if !new {
            return SyncStep::default();
        }
        stream.waiting = Some(Vec::new());
        SyncStep {
            ask: true,
            ..SyncStep::default()
        }
    }

    /// The consumer learnt out of band (an announcement) that `worker` now runs `instance`.
    /// A new run starts with an empty cache, so its blocks are dropped now, not at the run's
    /// first batch, and that batch does not drop them (or count the restart) a second time.
    /// Held batches of earlier runs go with them; an ask in flight stays in flight. Nothing to
    /// do when the stream is already on `instance`.
    pub fn restarted(
        &mut self,
        sink: &mut impl EventSink,
        worker: WorkerId,
        instance: u64,
    ) -> SyncStep {
        let (stream, _) = self.stream(worker);
        if stream.instance == Some(instance) {
            return SyncStep::default();
        }
        sink.clear_worker(worker);
        stream.instance = Some(instance);
        if let Some(held) = &mut stream.waiting {
            held.retain(|(from, _)| *from == instance);
        }
        SyncStep {
            restarted: true,
            ..SyncStep::default()
        }
    }

    /// `worker` left (a goodbye, a crash): forget it; if it comes back it is asked again.
    pub fn forget(&mut self, worker: WorkerId) {
        self.streams.remove(&worker);
    }

    /// A batch of `worker`'s events from run `instance`, in sequence order.
    pub fn on_events(
        &mut self,
        sink: &mut impl EventSink,
        worker: WorkerId,
        instance: u64,
        events: &[KvEvent],
    ) -> SyncStep {
        let (max_held, first_word) = (self.max_held, self.first_word);
        let (stream, new) = self.stream(worker);
        let mut step = SyncStep::default();
        if new && first_word == FirstWord::Ask {
            // The first word: whatever it cached before is unknown here.
            stream.waiting = Some(vec![(instance, events.to_vec())]);
            step.ask = true;
            return step;
        }
        match &mut stream.waiting {
            Some(held) if held.len() < max_held => {
                held.push((instance, events.to_vec()));
            }
            Some(_) => {
                // The snapshot is too slow for this stream: go on without it.
                step.gave_up = true;
                for (from, held) in stream.waiting.take().unwrap_or_default() {
                    apply_live(sink, stream, worker, from, &held, &mut step);
                }
                apply_live(sink, stream, worker, instance, events, &mut step);
            }
            None => {
                apply_live(sink, stream, worker, instance, events, &mut step);
                if step.resynced > 0 {
                    // A gap dropped the worker's blocks: its snapshot gives them back.
                    stream.waiting = Some(Vec::new());
                    step.ask = true;
                }
            }
        }
        step
    }

    /// `worker`'s stream lost messages its sequence numbers cannot show (an undecodable
    /// batch, a transport-level gap): drop its blocks and ask for its cache, unless already
    /// asked.
    pub fn on_lost(&mut self, sink: &mut impl EventSink, worker: WorkerId) -> SyncStep {
        sink.clear_worker(worker);
        let (stream, _) = self.stream(worker);
        let mut step = SyncStep {
            resynced: 1,
            ..SyncStep::default()
        };
        if stream.waiting.is_none() {
            stream.waiting = Some(Vec::new());
            step.ask = true;
        }
        step
    }

    /// The answer to an ask: the worker's snapshot, or `None` when there is none to be had
    /// (a timeout, an engine that does not keep one). A snapshot replaces the worker's blocks;
    /// then the held events it does not cover are applied. If they show a gap again, the
    /// step asks again. An answer nobody waits for any more (given up, forgotten) is ignored.
    pub fn on_snapshot(
        &mut self,
        sink: &mut impl EventSink,
        worker: WorkerId,
        snapshot: Option<Snapshot<'_>>,
    ) -> SyncStep {
        let mut step = SyncStep::default();
        let Some(stream) = self.streams.get_mut(&worker) else {
            return step;
        };
        let Some(held) = stream.waiting.take() else {
            return step;
        };
        let mut covered = None;
        if let Some(s) = snapshot {
            let restored = sink
                .restore_worker(worker, s.next_seq, s.stored)
                .map_or(0, |o| o.stored);
            step.restored = Some(restored);
            stream.instance = Some(s.instance);
            covered = s.next_seq.map(|next| (s.instance, next));
        }
        for (from, mut events) in held {
            if let Some((instance, next)) = covered
                && from == instance
            {
                let before = events.len();
                events.retain(|e| e.seq >= next);
                step.covered += (before - events.len()) as u32;
            }
            apply_live(sink, stream, worker, from, &events, &mut step);
        }
        if step.resynced > 0 && covered.is_some() {
            // Events were lost after the snapshot too: ask again.
            stream.waiting = Some(Vec::new());
            step.ask = true;
        }
        step
    }
}

/// Applies a batch to a stream that is not waiting: a new instance clears the worker first.
fn apply_live(
    sink: &mut impl EventSink,
    stream: &mut Stream,
    worker: WorkerId,
    instance: u64,
    events: &[KvEvent],
    step: &mut SyncStep,
) {
    if stream.instance.is_some_and(|i| i != instance) {
        sink.clear_worker(worker);
        step.restarted = true;
    }
    stream.instance = Some(instance);
    for event in events {
        step.count(sink.apply_resyncing(event));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{BlockHasher, CacheMirror, IndexConfig};

    const B: usize = 4;
    const W: WorkerId = WorkerId(7);

    /// A worker's stream: each event stores one more block of one long prompt.
    fn stream_of(n: usize) -> Vec<KvEvent> {
        let hasher = BlockHasher::new(B).unwrap();
        let tokens: Vec<u32> = (0..(n * B) as u32).collect();
        let ids = hasher.sequence_hashes(&tokens);
        let locals = hasher.local_hashes(&tokens);
        (0..n)
            .map(|i| KvEvent {
                worker: W,
                seq: i as u64,
                kind: KvEventKind::Stored {
                    parent: (i > 0).then(|| crate::EngineBlockId(ids[i - 1].0)),
                    blocks: vec![crate::StoredBlock::from_hash(ids[i], locals[i])],
                },
            })
            .collect()
    }

    fn index() -> KvIndex {
        KvIndex::new(IndexConfig::default())
    }

    /// Answers the ask with the snapshot of a worker that published `events` (instance 1).
    fn answer_from(sync: &mut StreamSync, idx: &mut KvIndex, events: &[KvEvent]) -> SyncStep {
        let mut mirror = CacheMirror::default();
        mirror.apply(events);
        let stored = mirror.snapshot().unwrap();
        let snapshot = Snapshot {
            instance: 1,
            next_seq: mirror.next_seq(),
            stored: &stored,
        };
        sync.on_snapshot(idx, W, Some(snapshot))
    }

    #[test]
    fn a_late_consumer_asks_holds_and_then_restores_without_double_applying() {
        let events = stream_of(10);
        let mut idx = index();
        let mut sync = StreamSync::new(8, 16, FirstWord::Ask);
        // Joins at event 6: the worker cached 0..6 before.
        let first = sync.on_events(&mut idx, W, 1, &events[6..7]);
        assert!(first.ask && sync.is_waiting(W) && first.applied == 0);
        assert!(!sync.on_events(&mut idx, W, 1, &events[7..8]).ask);
        assert_eq!(idx.blocks_of(W), 0, "nothing applied while waiting");
        // The snapshot was taken after event 6: it covers 0..=6.
        let step = answer_from(&mut sync, &mut idx, &events[..7]);
        assert_eq!(step.restored, Some(7));
        assert_eq!((step.covered, step.applied, step.ask), (1, 1, false));
        assert_eq!(idx.blocks_of(W), 8);
        assert_eq!(idx.next_seq(W), Some(8));
        let live = sync.on_events(&mut idx, W, 1, &events[8..]);
        assert_eq!(
            (live.applied, live.ask, sync.is_waiting(W)),
            (2, false, false)
        );
        idx.check_invariants();
    }

    #[test]
    fn a_gap_drops_the_blocks_and_the_snapshot_gives_them_back() {
        let events = stream_of(10);
        let mut idx = index();
        let mut sync = StreamSync::new(8, 16, FirstWord::Baseline);
        assert_eq!(sync.on_events(&mut idx, W, 1, &events[..4]).applied, 4);
        // Events 4 and 5 are lost.
        let gap = sync.on_events(&mut idx, W, 1, &events[6..7]);
        assert_eq!((gap.resynced, gap.ask, sync.is_waiting(W)), (1, true, true));
        assert_eq!(
            idx.blocks_of(W),
            0,
            "the child of an unknown parent is skipped"
        );
        sync.on_events(&mut idx, W, 1, &events[7..8]);
        let step = answer_from(&mut sync, &mut idx, &events[..7]);
        assert_eq!((step.applied, step.ask), (1, false));
        assert_eq!(idx.blocks_of(W), 8);
    }

    #[test]
    fn a_gap_after_the_snapshot_asks_again_and_a_failed_answer_goes_on_without() {
        let events = stream_of(10);
        let mut idx = index();
        let mut sync = StreamSync::new(8, 16, FirstWord::Ask);
        sync.on_events(&mut idx, W, 1, &events[..1]);
        // Held: 1 and 3 (2 is lost after the snapshot's point).
        sync.on_events(&mut idx, W, 1, &events[1..2]);
        sync.on_events(&mut idx, W, 1, &events[3..4]);
        let step = answer_from(&mut sync, &mut idx, &events[..1]);
        assert_eq!((step.resynced, step.ask), (1, true));
        assert!(sync.is_waiting(W));
        let none = sync.on_snapshot(&mut idx, W, None);
        assert!(!none.ask && none.restored.is_none());
        assert!(!sync.is_waiting(W));
        // An answer nobody waits for is ignored.
        assert_eq!(
            sync.on_snapshot(&mut idx, W, None),
            SyncStep::default(),
            "late answer"
        );
    }

    #[test]
    fn too_many_held_batches_end_the_wait_and_apply_them_in_order() {
        let events = stream_of(6);
        let mut idx = index();
        let mut sync = StreamSync::new(8, 2, FirstWord::Ask);
        sync.on_events(&mut idx, W, 1, &events[..1]);
        sync.on_events(&mut idx, W, 1, &events[1..2]);
        let full = sync.on_events(&mut idx, W, 1, &events[2..3]);
        assert!(full.gave_up && !full.ask);
        assert_eq!(full.applied, 3);
        assert_eq!(idx.blocks_of(W), 3);
        assert!(!sync.is_waiting(W));
    }

    #[test]
    fn a_restart_clears_without_asking_and_a_lost_batch_asks_once() {
        let events = stream_of(4);
        let mut idx = index();
        let mut sync = StreamSync::new(8, 16, FirstWord::Baseline);
        sync.on_events(&mut idx, W, 1, &events[..3]);
        let restart = sync.on_events(&mut idx, W, 2, &events[..1]);
        assert!(restart.restarted && !restart.ask);
        assert_eq!(idx.blocks_of(W), 1);
        let lost = sync.on_lost(&mut idx, W);
        assert!(lost.ask);
        assert_eq!(idx.blocks_of(W), 0);
        assert!(!sync.on_lost(&mut idx, W).ask, "already asked");
    }

    #[test]
    fn a_restart_heard_of_first_clears_once_whichever_word_comes_first() {
        let events = stream_of(4);
        let mut idx = index();
        let mut sync = StreamSync::new(8, 16, FirstWord::Baseline);
        sync.on_events(&mut idx, W, 1, &events[..3]);
        // The announcement of run 2 comes before its first batch.
        let heard = sync.restarted(&mut idx, W, 2);
        assert!(heard.restarted && !heard.ask);
        assert_eq!(idx.blocks_of(W), 0, "the old run's blocks are gone at once");
        let first = sync.on_events(&mut idx, W, 2, &events[..1]);
        assert!(!first.restarted, "the clear is not repeated");
        assert_eq!((first.applied, idx.blocks_of(W)), (1, 1));
        // Run 3's batch comes before its announcement: the announcement changes nothing.
        assert!(sync.on_events(&mut idx, W, 3, &events[..2]).restarted);
        assert_eq!(sync.restarted(&mut idx, W, 3), SyncStep::default());
        assert_eq!(idx.blocks_of(W), 2);
        // A restart while the snapshot is asked for drops the old run's held batches.
        assert!(sync.on_lost(&mut idx, W).ask);
        sync.on_events(&mut idx, W, 3, &events[2..3]);
        sync.restarted(&mut idx, W, 4);
        sync.on_events(&mut idx, W, 4, &events[..1]);
        let answer = sync.on_snapshot(&mut idx, W, None);
        assert_eq!((answer.applied, answer.restarted), (1, false));
        assert_eq!(idx.blocks_of(W), 1);
        idx.check_invariants();
    }

    #[test]
    fn a_consumer_that_saw_the_fleet_start_takes_first_events_as_baselines() {
        let events = stream_of(4);
        let mut idx = index();
        let mut sync = StreamSync::new(8, 16, FirstWord::Baseline);
        let first = sync.on_events(&mut idx, W, 1, &events[..2]);
        assert_eq!((first.ask, first.applied), (false, 2));
        // One it joins late (a restarted replica) it asks for.
        assert!(sync.heard(WorkerId(9)).ask);
        assert!(sync.is_waiting(WorkerId(9)));
    }

    #[test]
    fn an_announcement_asks_once_and_the_map_stays_bounded() {
        let mut sync = StreamSync::new(2, 4, FirstWord::Ask);
        assert!(sync.heard(WorkerId(1)).ask);
        assert!(!sync.heard(WorkerId(1)).ask);
        assert!(sync.heard(WorkerId(2)).ask);
        assert!(sync.heard(WorkerId(3)).ask);
        assert!(sync.len() <= 2);
        sync.forget(WorkerId(3));
        assert!(sync.is_empty() || !sync.is_waiting(WorkerId(3)));
    }
}
