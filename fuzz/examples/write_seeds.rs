//! Writes the fuzz targets' seed corpora to `fuzz/seeds/<target>/`: the wire forms the
//! repository's tests use (`crates/protocol/tests/*frames*.rs`, `request_validation.rs`,
//! the SSE and trace examples), framed as each target reads its input. Run from `fuzz/`:
//! `cargo run --example write_seeds` (stable is enough). The seeds are committed; the corpora
//! that fuzzing grows from them (`fuzz/corpus/`) are not.

use std::fs;
use std::path::Path;

use kv_index::{BlockHasher, KvEvent, KvEventKind, WorkerId};
use protocol::KvEventBatch;
use protocol::replicas::{
    ReplicaBatch, SnapshotPart, SnapshotRequest, WireChange, WireSnapshotRequest, WireUpdate,
};
use protocol::vllm::{
    BlockRemoved, BlockStored, EventEncoding, ExternalBlockHash, VllmEvent, VllmEventBatch,
};
use protocol::worker::{WorkerAnnounce, WorkerCard, WorkerMessage};

fn write(target: &str, name: &str, bytes: &[u8]) {
    let dir = Path::new("seeds").join(target);
    fs::create_dir_all(&dir).expect("create the seed directory");
    fs::write(dir.join(name), bytes).expect("write a seed");
}

fn with_prefix(prefix: u8, bytes: &[u8]) -> Vec<u8> {
    let mut out = vec![prefix];
    out.extend_from_slice(bytes);
    out
}

fn request_seeds() {
    let bodies = [
        r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
        r#"{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":"What is prefix caching?"}],"max_tokens":64,"stream":true,"stream_options":{"include_usage":true},"temperature":0.7,"top_p":0.9,"seed":7,"stop":["\n\n"]}"#,
        r#"{"model":"m","messages":[{"role":"user","content":"hi"},{"role":"assistant","tool_calls":[]},{"role":"tool","content":"42","tool_call_id":"a"}]}"#,
        r#"{"model":"m","messages":[{"role":"developer","content":"be brief"},{"role":"user","content":[{"type":"text","text":"hi"}]}],"temperature":0,"top_p":1}"#,
        r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_completion_tokens":8,"ignore_eos":true,"return_token_ids":true,"n":1,"kv_transfer_params":{"do_remote_decode":true,"remote_block_ids":[1,2],"remote_port":5600}}"#,
        r#"{"model":"m","prompt":"Once upon a time","max_tokens":16}"#,
        r#"{"model":"m","prompt":[1,2,3,4],"stream":false}"#,
        r#"{"model":"m","prompt":[[1,2],[3]],"stop":"x"}"#,
        r#"{"model":"m","prompt":["a","b"]}"#,
        // Refusals, from request_validation.rs.
        r#"{"model":"m","messages":[]}"#,
        r#"{"model":"m","messages":[{"role":"robot","content":"hi"}]}"#,
        r#"{"model":"m","messages":[{"role":"system","content":"s"},{"role":"user"}]}"#,
        r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":-0.5}"#,
        r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"top_p":0}"#,
        r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":-4}"#,
        r#"{"model":"m","messages":[{"role":"user","content":"hi"}"#,
    ];
    for (i, body) in bodies.iter().enumerate() {
        write("request_parse", &format!("body-{i:02}"), body.as_bytes());
    }
}

fn sse_seeds() {
    let streams: [&[u8]; 5] = [
        b"data: {\"id\":\"x\",\"choices\":[{\"delta\":{\"content\":\"Hi\"}}]}\n\ndata: [DONE]\n\n",
        b"data: {\"id\":\"x\"}\r\n\r\ndata: [DONE]\r\n\r\n",
        b": keep-alive\n\nevent: message\ndata: a\ndata: b\nid: 1\nretry: 10\n\ndata:[DONE]\n\n",
        b"data: {\"error\":{\"message\":\"worker_failed\",\"type\":\"server_error\"}}\r\rdata: [DONE]\r\r",
        b"data: \xff\xfe\n\n",
    ];
    for (i, stream) in streams.iter().enumerate() {
        // Default limit with a cut in a `\r\n`; a 16-byte limit without cuts.
        let mut cut = vec![0, 1];
        cut.extend_from_slice(&(stream.len() as u16 / 2).to_be_bytes());
        cut.extend_from_slice(stream);
        write("sse_chunking", &format!("stream-{i}-cut"), &cut);
        let mut small = vec![15, 0];
        small.extend_from_slice(stream);
        write("sse_chunking", &format!("stream-{i}-small"), &small);
    }
}

fn vllm_batches() -> Vec<VllmEventBatch> {
    let stored = |hashes: Vec<ExternalBlockHash>, parent, first: u32, medium: &str| {
        let n = hashes.len() as u32;
        VllmEvent::BlockStored(BlockStored {
            block_hashes: hashes,
            parent_block_hash: parent,
            token_ids: (first..first + 4 * n).collect(),
            block_size: 4,
            lora_id: None,
            medium: Some(medium.to_owned()),
            lora_name: None,
            cache_salt: None,
            has_extra_keys: false,
        })
    };
    vec![
        VllmEventBatch {
            ts: 1_700_000_000.25,
            events: vec![
                stored(
                    vec![ExternalBlockHash::Int(11), ExternalBlockHash::Int(12)],
                    None,
                    0,
                    "GPU",
                ),
                stored(
                    vec![ExternalBlockHash::Int(13)],
                    Some(ExternalBlockHash::Int(12)),
                    8,
                    "GPU",
                ),
                VllmEvent::BlockRemoved(BlockRemoved {
                    block_hashes: vec![ExternalBlockHash::Int(13)],
                    medium: Some("GPU".to_owned()),
                }),
            ],
            data_parallel_rank: Some(0),
        },
        VllmEventBatch {
            ts: 1_700_000_001.0,
            events: vec![
                stored(
                    vec![ExternalBlockHash::Bytes(vec![0xab; 32])],
                    None,
                    100,
                    "GPU",
                ),
                stored(vec![ExternalBlockHash::Int(u64::MAX - 6)], None, 0, "CPU"),
                VllmEvent::AllBlocksCleared,
            ],
            data_parallel_rank: None,
        },
    ]
}

/// SGLang's later layout, byte for byte as `sglang_frames.rs` builds it.
fn sglang_payload() -> Vec<u8> {
    fn fixstr(text: &str) -> Vec<u8> {
        let mut out = vec![0xa0 | text.len() as u8];
        out.extend_from_slice(text.as_bytes());
        out
    }
    let mut page = vec![0x97];
    page.extend(fixstr("BlockStored"));
    page.push(0x91);
    page.push(0xd3);
    page.extend_from_slice(&(-0x5a5a_5a5a_5a5a_5a5b_i64).to_be_bytes());
    page.push(0xc0);
    page.push(0x94);
    page.extend([1, 2, 3, 4]);
    page.push(4);
    page.push(0xc0);
    page.extend(fixstr("GPU"));
    let mut out = vec![0x93, 0xcb];
    out.extend_from_slice(&1_700_000_000.5f64.to_be_bytes());
    out.push(0x91);
    out.extend(page);
    out.push(0);
    out
}

fn zmq_seeds() {
    // Mode byte 8: a raw payload, block size 4.
    for (i, batch) in vllm_batches().iter().enumerate() {
        write(
            "zmq_kv_events",
            &format!("vllm-{i}-tagged"),
            &with_prefix(8, &batch.encode(EventEncoding::TaggedMap)),
        );
        write(
            "zmq_kv_events",
            &format!("vllm-{i}-array"),
            &with_prefix(8, &batch.encode(EventEncoding::Array)),
        );
        write(
            "zmq_kv_events",
            &format!("vllm-{i}-map"),
            &with_prefix(8, &batch.encode_map()),
        );
    }
    write(
        "zmq_kv_events",
        "sglang",
        &with_prefix(8, &sglang_payload()),
    );
    write(
        "zmq_kv_events",
        "structured",
        &[1, 3, 2, 0, 4, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
    );
}

fn nats_seeds() {
    let hasher = BlockHasher::new(4).expect("block size 4");
    let tokens: Vec<u32> = (0..12).collect();
    let events = vec![
        KvEvent {
            worker: WorkerId(7),
            seq: 0,
            kind: KvEventKind::stored_prompt(&hasher, &tokens),
        },
        KvEvent {
            worker: WorkerId(7),
            seq: 1,
            kind: KvEventKind::Cleared,
        },
    ];
    let batch = KvEventBatch::from_events(WorkerId(7), 42, &events).expect("one worker");
    write(
        "nats_messages",
        "kv-batch",
        &with_prefix(0, &batch.encode()),
    );

    let card = WorkerCard {
        worker: Some(WorkerId(3)),
        instance: 99,
        url: "http://127.0.0.1:8001".to_owned(),
        model: "m".to_owned(),
        block_size: Some(32),
        max_model_len: Some(8192),
        zmq_endpoint: Some("tcp://127.0.0.1:5557".to_owned()),
        ..WorkerCard::default()
    };
    let announce = WorkerMessage::Announce(WorkerAnnounce {
        card,
        lease_ms: 3000,
        token: Some("t0ken".to_owned()),
    });
    let goodbye = WorkerMessage::Goodbye {
        worker: 3,
        instance: 99,
        token: None,
    };
    for (name, message) in [("announce", announce), ("goodbye", goodbye)] {
        let json = message.encode().expect("plain data");
        write("nats_messages", name, &with_prefix(1, &json));
    }

    let replica = ReplicaBatch {
        replica: 1,
        epoch: 5,
        next_seq: 3,
        sent_unix_ns: 1_700_000_000_000_000_000,
        goodbye: false,
        updates: vec![
            WireUpdate {
                seq: 0,
                request: 10,
                change: WireChange::Routed {
                    worker: 3,
                    num_tokens: 100,
                    local: vec![1, 2, 3],
                },
            },
            WireUpdate {
                seq: 1,
                request: 10,
                change: WireChange::FirstToken,
            },
            WireUpdate {
                seq: 2,
                request: 10,
                change: WireChange::Finished,
            },
        ],
    };
    write(
        "nats_messages",
        "replica-batch",
        &with_prefix(2, &replica.encode()),
    );
    let request = SnapshotRequest {
        replica: 2,
        epoch: 1,
    };
    write(
        "nats_messages",
        "snapshot-request",
        &with_prefix(2, &request.encode()),
    );
    let part = SnapshotPart {
        replica: 1,
        epoch: 5,
        next_seq: 3,
        part: 0,
        last: true,
        requests: vec![WireSnapshotRequest {
            request: 10,
            worker: 3,
            num_tokens: 100,
            local: vec![1, 2, 3],
            first_token: true,
        }],
    };
    write(
        "nats_messages",
        "snapshot-part",
        &with_prefix(2, &part.encode()),
    );
    write(
        "nats_messages",
        "built-batch",
        &[3, 2, 0, 4, 0, 0, 0, 0, 0, 0, 0, 9, 1, 2],
    );
}

fn trace_seeds() {
    let shipped = fs::read_to_string("../traces/mooncake_conversation_trace.jsonl")
        .expect("read the shipped trace");
    let head: String = shipped.lines().take(6).map(|l| format!("{l}\n")).collect();
    write("trace_parse", "mooncake-head", head.as_bytes());
    write(
        "trace_parse",
        "sessions",
        b"{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 20, \"hash_ids\": [7, 8], \"session_id\": \"a\"}\n\
          {\"timestamp\": 10.5, \"input_length\": 1100, \"output_length\": 9, \"hash_ids\": [7, 9, 4], \"session_id\": 2}\n\
          {\"timestamp\": 20, \"input_length\": 1200, \"output_length\": 9, \"hash_ids\": [7, 8, 5], \"session_id\": \"a\", \"delay\": 250}\r\n",
    );
    write(
        "trace_parse",
        "refused",
        b"{\"timestamp\": 5, \"input_length\": 600, \"output_length\": 20, \"hash_ids\": [7, 8]}\n{\"timestamp\": 1, \"input_length\": 0}\n",
    );
}

fn chat_seeds() {
    // Unstructured input: counts, role choices, then the strings.
    write(
        "chat_template",
        "two-messages",
        b"\x02\x00\x02user\x05hello\x00\x03\x05  hi there \n\x00",
    );
    write(
        "chat_template",
        "specials",
        b"\x03\x00\x02<|eot_id|>\x00\x03\x10<|start_header_id|>x",
    );
}

fn template_source_seeds() {
    // Chat templates as Hugging Face models ship them (their formats, written here), the
    // built-in one's shape, and the loops and recursion the fuel and limits stop.
    let templates: [(&str, &str); 7] = [
        (
            "llama3",
            "{{- bos_token -}}{%- for m in messages -%}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content | trim }}<|eot_id|>{%- endfor -%}{%- if add_generation_prompt -%}<|start_header_id|>assistant<|end_header_id|>{{ \"\\n\\n\" }}{%- endif -%}",
        ),
        (
            "chatml",
            "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
        ),
        (
            "alternating",
            "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'].strip() + ' [/INST]' }}{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}",
        ),
        (
            "system-first",
            "{% set ns = namespace(system='') %}{% if messages[0].role == 'system' %}{% set ns.system = messages[0].content %}{% endif %}{{ ns.system | upper }}{% for m in messages[1:] if m.role != 'system' %}<{{ m.role }}>{{ m.content.startswith(' ') }}{{ m.content | length }}{% endfor %}",
        ),
        (
            "nested-loops",
            "{% for i in range(1000) %}{% for j in range(1000) %}{{ i * j }}{% endfor %}{% endfor %}",
        ),
        (
            "recursion",
            "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(messages | length * 100) }}",
        ),
        (
            "repeat",
            "{{ 'ab' * 10000 }}{% for m in messages %}{{ m.content * 100 }}{% endfor %}",
        ),
    ];
    for (name, source) in templates {
        write("chat_template_source", name, source.as_bytes());
    }
}

fn tokenizer_seeds() {
    // The tokenizer of crates/text/tests/hf.rs, and a byte-level BPE as Llama-3's is built.
    write(
        "tokenizer_json",
        "word-level",
        br#"{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [{"id": 4, "content": "<|begin_of_text|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}, {"id": 5, "content": "<|eot_id|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}], "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null, "model": {"type": "WordLevel", "vocab": {"hello": 0, "world": 1, "[UNK]": 2, "eot": 3}, "unk_token": "[UNK]"}}"#,
    );
    write(
        "tokenizer_json",
        "byte-level-bpe",
        br#"{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [{"id": 7, "content": "<|eot_id|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}], "normalizer": null, "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}, "post_processor": null, "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}, "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "vocab": {"h": 0, "e": 1, "l": 2, "o": 3, "he": 4, "ll": 5, "hell": 6}, "merges": ["h e", "l l", "he ll"]}}"#,
    );
    // Found by the target: a vocabulary whose ids skip values (vocab_size was the count).
    write(
        "tokenizer_json",
        "regression-sparse-ids",
        br#"{"version": "1.0", "added_tokens": [], "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null, "model": {"type": "WordLevel", "vocab": {"hello": 6, "world": 1, "[UNK]": 2}, "unk_token": "[UNK]"}}"#,
    );
    // Found by the target: `tokenizers` panicked on a decoder object that is not JSON, or
    // holds a byte that is not UTF-8.
    write(
        "tokenizer_json",
        "regression-decoder-not-utf8",
        &[
            br#"{"version": "1.0", "added_tokens": [], "decoder": {"type": "ByteLevel", "a": ""#.as_slice(),
            b"\x80",
            br#""}, "model": {"type": "WordLevel", "vocab": {"hello": 0, "[UNK]": 1}, "unk_token": "[UNK]"}}"#,
        ]
        .concat(),
    );
    write(
        "tokenizer_json",
        "regression-broken-decoder",
        br#"{"version": "1.0", "added_tokens": [], "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": {"type": "ByteLevel", "add_prefix_space": false true}, "model": {"type": "WordLevel", "vocab": {"hello": 0, "[UNK]": 1}, "unk_token": "[UNK]"}}"#,
    );
}

fn main() {
    request_seeds();
    sse_seeds();
    zmq_seeds();
    nats_seeds();
    trace_seeds();
    chat_seeds();
    template_source_seeds();
    tokenizer_seeds();
    println!("seeds written under fuzz/seeds/");
}
