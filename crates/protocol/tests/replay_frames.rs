//! The replay socket of vLLM's and SGLang's `ZmqEventPublisher` (`replay_endpoint`, a ROUTER):
//! a subscriber sends the first sequence number it misses, 8 bytes big-endian behind an empty
//! delimiter, and receives every buffered `(seq, payload)` from there on, then the end marker
//! `(-1, b"")`. These tests pin the messages byte for byte and the stream's use of a replay:
//! a gap filled in order, a replay that no longer reaches back, a late subscriber.

use kv_index::{KvEventKind, WorkerId};
use protocol::vllm::{
    Continuity, EventEncoding, ReplayBuffer, ReplayGap, ReplayReply, VllmDecodeError, VllmEvent,
    VllmEventBatch, VllmEventStream, VllmFrame, decode_replay_reply, decode_replay_request,
    encode_replay_end, encode_replay_frame, encode_replay_request,
};

const BS: u32 = 4;

/// A batch storing one block of tokens `first..first + BS`, named `id`.
fn store(id: u64, first: u32) -> VllmEventBatch {
    VllmEventBatch {
        ts: 1.0,
        events: vec![VllmEvent::BlockStored(protocol::vllm::BlockStored {
            block_hashes: vec![protocol::vllm::ExternalBlockHash::Int(id)],
            parent_block_hash: None,
            token_ids: (first..first + BS).collect(),
            block_size: BS,
            lora_id: None,
            medium: Some("GPU".into()),
            lora_name: None,
            cache_salt: None,
            has_extra_keys: false,
        })],
        data_parallel_rank: Some(0),
    }
}

fn frame(seq: u64) -> VllmFrame {
    VllmFrame {
        topic: Vec::new(),
        seq,
        batch: store(seq + 100, seq as u32 * BS),
    }
}

#[test]
fn replay_messages_are_framed_as_the_publishers_router_expects() {
    // The DEALER's request: empty delimiter, then 0x…2a big-endian.
    let request = encode_replay_request(42);
    assert_eq!(request, [vec![], vec![0, 0, 0, 0, 0, 0, 0, 42]]);
    // What the ROUTER reads: the peer's identity in front.
    let at_router = [b"peer-1".to_vec(), request[0].clone(), request[1].clone()];
    assert_eq!(
        decode_replay_request(&at_router).unwrap(),
        (b"peer-1".to_vec(), 42)
    );
    // A REQ-style request without the delimiter, or a short number, is refused.
    assert_eq!(
        decode_replay_request(&[b"peer-1".to_vec(), 42u64.to_be_bytes().to_vec()]),
        Err(VllmDecodeError::Parts(2))
    );
    assert_eq!(
        decode_replay_request(&[b"p".to_vec(), vec![], vec![0, 42]]),
        Err(VllmDecodeError::SeqLength(2))
    );

    // Its answer for one batch and the end marker, identity first; the DEALER sees the rest.
    let payload = store(7, 0).encode(EventEncoding::TaggedMap);
    let reply = encode_replay_frame(b"peer-1", 43, &payload);
    assert_eq!(reply[0], b"peer-1");
    assert_eq!(reply[1], b"");
    assert_eq!(reply[2], 43u64.to_be_bytes());
    let ReplayReply::Frame(got) = decode_replay_reply(&reply[1..]).unwrap() else {
        panic!("not a frame")
    };
    assert_eq!((got.seq, got.batch), (43, store(7, 0)));
    let end = encode_replay_end(b"peer-1");
    // `(-1).to_bytes(8, "big", signed=True)` and an empty payload.
    assert_eq!(end[2], [0xff; 8]);
    assert!(end[3].is_empty());
    assert_eq!(decode_replay_reply(&end[1..]).unwrap(), ReplayReply::End);

    // Malformed replies are errors, never panics.
    assert_eq!(
        decode_replay_reply(&[vec![0u8; 8], payload.clone()]),
        Err(VllmDecodeError::Parts(2))
    );
    assert!(matches!(
        decode_replay_reply(&[b"x".to_vec(), vec![0u8; 8], payload.clone()]),
        Err(VllmDecodeError::Shape { .. })
    ));
    assert!(matches!(
        decode_replay_reply(&[vec![], vec![0u8; 8], vec![0x93]]),
        Err(VllmDecodeError::Msgpack(_))
    ));
}

#[test]
fn the_replay_buffer_keeps_the_last_batches_in_order() {
    let mut buffer = ReplayBuffer::new(3);
    for seq in 0..5 {
        buffer.push(seq, vec![seq as u8]);
    }
    assert_eq!(buffer.len(), 3);
    let since = |start| buffer.since(start).map(|(s, _)| s).collect::<Vec<_>>();
    assert_eq!(since(0), [2, 3, 4], "the oldest two were forgotten");
    assert_eq!(since(3), [3, 4]);
    assert_eq!(since(9), [] as [u64; 0]);
    assert_eq!(buffer.since(4).next().unwrap().1, [4]);
    let mut off = ReplayBuffer::new(0);
    off.push(0, vec![1]);
    assert!(off.is_empty());
}

#[test]
fn a_replay_fills_a_gap_in_order_and_the_live_frame_continues_it() {
    let mut stream = VllmEventStream::new(WorkerId(1), BS);
    stream.accept(&frame(0)).unwrap();
    stream.accept(&frame(1)).unwrap();
    // Frames 2 and 3 were lost; 4 arrives live. The caller asks before applying it.
    assert_eq!(
        stream.continuity(4),
        Continuity::Gap {
            expected: 2,
            got: 4
        }
    );
    // The publisher replays from 2: its whole buffer from there, 4 and 5 included.
    let mut applied = Vec::new();
    for seq in [2, 3, 4, 5] {
        if let Some(accepted) = stream.accept_replayed(&frame(seq), 4).unwrap() {
            applied.push((seq, accepted.continuity, accepted.events[0].seq));
        }
    }
    // Only the missing ones, numbered on from the stream's events.
    assert_eq!(
        applied,
        [(2, Continuity::InOrder, 2), (3, Continuity::InOrder, 3)]
    );
    assert_eq!(stream.next_frame_seq(), Some(4), "the gap is filled");
    // The live frame then continues the stream: no clear.
    let live = stream.accept(&frame(4)).unwrap();
    assert_eq!(live.continuity, Continuity::InOrder);
    assert_eq!(live.events[0].seq, 4);
    // Frames already applied, replayed again, are ignored.
    assert_eq!(stream.accept_replayed(&frame(3), 9), Ok(None));
}

#[test]
fn a_replay_that_no_longer_reaches_back_leaves_the_gap_for_a_resync() {
    let mut stream = VllmEventStream::new(WorkerId(1), BS);
    stream.accept(&frame(0)).unwrap();
    // The publisher's buffer now starts at 5: frames 1..5 are gone for good.
    assert_eq!(
        stream.accept_replayed(&frame(5), 8),
        Err(ReplayGap::Missing {
            expected: 1,
            got: 5
        })
    );
    assert_eq!(stream.next_frame_seq(), Some(1), "nothing applied");
    let live = stream.accept(&frame(8)).unwrap();
    assert!(live.continuity.needs_clear(), "{:?}", live.continuity);

    // A replayed batch that cannot be converted fails the replay too.
    let mut stream = VllmEventStream::new(WorkerId(1), BS);
    stream.accept(&frame(0)).unwrap();
    let mut wrong = frame(1);
    if let VllmEvent::BlockStored(s) = &mut wrong.batch.events[0] {
        s.block_size = 16;
    }
    assert!(matches!(
        stream.accept_replayed(&wrong, 3),
        Err(ReplayGap::Convert(_))
    ));
}

#[test]
fn a_late_subscriber_starts_from_the_oldest_buffered_batch() {
    // The first live frame is 9; the publisher still holds 6..=9.
    let mut stream = VllmEventStream::new(WorkerId(1), BS);
    assert_eq!(stream.continuity(9), Continuity::First);
    let mut stored = 0;
    for seq in 6..=9 {
        if let Some(accepted) = stream.accept_replayed(&frame(seq), 9).unwrap() {
            assert!(matches!(
                accepted.events[0].kind,
                KvEventKind::Stored { .. }
            ));
            stored += 1;
        }
    }
    assert_eq!(stored, 3, "6, 7 and 8; the live stream brings 9");
    assert_eq!(stream.continuity(9), Continuity::InOrder);
}
