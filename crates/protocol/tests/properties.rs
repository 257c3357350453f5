//! Properties of the decoders: the SSE decoder's output does not depend on how the byte
//! stream is cut, and no input makes the msgpack decoders panic.

use kv_index::{BlockContent, EngineBlockId, KvEvent, KvEventKind, StoredBlock, WorkerId};
use proptest::prelude::*;
use protocol::KvEventBatch;
use protocol::sse::{SseDecoder, SseEvent, done_event, event};
use protocol::vllm::{VllmEventBatch, decode_multipart};

fn decode_in_pieces(bytes: &[u8], cuts: &[usize]) -> Vec<SseEvent<String>> {
    let mut decoder = SseDecoder::default();
    let mut out = Vec::new();
    let mut at = 0;
    let mut cuts: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
    cuts.sort_unstable();
    for cut in cuts.into_iter().chain([bytes.len()]) {
        decoder.push(&bytes[at..cut.max(at)]).unwrap();
        at = cut.max(at);
        out.extend(std::iter::from_fn(|| {
            decoder.next_event().map(SseEvent::into_owned)
        }));
    }
    out
}

proptest! {
    #[test]
    fn sse_events_survive_any_cutting(
        payloads in prop::collection::vec("[^\r\n]{0,40}", 0..8),
        crlf in any::<bool>(),
        cuts in prop::collection::vec(any::<usize>(), 0..12),
    ) {
        let mut stream: String = payloads.iter().map(|p| event(p)).collect();
        stream.push_str(done_event());
        if crlf {
            stream = stream.replace('\n', "\r\n");
        }
        let mut expected: Vec<SseEvent<String>> =
            payloads.iter().map(|p| SseEvent::Data(p.clone())).collect();
        expected.push(SseEvent::Done);
        prop_assert_eq!(decode_in_pieces(stream.as_bytes(), &cuts), expected);
    }

    #[test]
    fn msgpack_decoders_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let _ = VllmEventBatch::decode(&bytes);
        let _ = KvEventBatch::decode(&bytes);
        let _ = decode_multipart(&[b"".to_vec(), vec![0; 8], bytes]);
    }

    #[test]
    fn our_kv_format_round_trips(
        ids in prop::collection::vec(any::<u64>(), 1..6),
        tokens in prop::collection::vec(any::<u32>(), 1..8),
        parent in any::<Option<u64>>(),
        seq in any::<u64>(),
    ) {
        let events = vec![
            KvEvent {
                worker: WorkerId(9),
                seq,
                kind: KvEventKind::Stored {
                    parent: parent.map(EngineBlockId),
                    blocks: ids
                        .iter()
                        .map(|&id| StoredBlock {
                            id: EngineBlockId(id),
                            content: BlockContent::Tokens(tokens.clone()),
                        })
                        .collect(),
                },
            },
            KvEvent {
                worker: WorkerId(9),
                seq: seq.wrapping_add(1),
                kind: KvEventKind::Removed { blocks: ids.iter().copied().map(EngineBlockId).collect() },
            },
        ];
        let bytes = KvEventBatch::from_events(WorkerId(9), 1, &events).unwrap().encode();
        prop_assert_eq!(KvEventBatch::decode(&bytes).unwrap().to_kv_events().unwrap(), events);
    }
}
