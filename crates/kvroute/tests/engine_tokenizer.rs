//! `kvroute engine --tokenizer` / `--chat-template`: the engine reads and writes the model's
//! token ids, so a router that tokenizes with the model's tokenizer (as vLLM's and SGLang's
//! routers do) sees the blocks the engine caches. A small word-level `tokenizer.json` stands
//! in for a model's.

use std::path::Path;

use serde_json::{Value, json};

mod common;

use common::{Server, assert_failures, post_json};

const WORDS: &[&str] = &[
    "[UNK]",
    "hello",
    "world",
    "user",
    "assistant",
    "the",
    "a",
    "of",
    "and",
    "to",
    "is",
    "cache",
];

fn tokenizer_json() -> String {
    let vocab: serde_json::Map<String, Value> = WORDS
        .iter()
        .enumerate()
        .map(|(id, word)| ((*word).to_string(), json!(id)))
        .collect();
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [
            {"id": WORDS.len(), "content": "<|eot_id|>", "single_word": false, "lstrip": false,
             "rstrip": false, "normalized": false, "special": true}
        ],
        "normalizer": {"type": "Lowercase"},
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": null,
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": true},
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
    })
    .to_string()
}

/// A model folder: tokenizer.json and a tokenizer_config.json whose template writes each
/// message as "ROLE CONTENT".
fn model_folder(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("kvroute-tokenizer-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    std::fs::write(dir.join("tokenizer.json"), tokenizer_json()).expect("tokenizer.json");
    let config = json!({
        "eos_token": "<|eot_id|>",
        "chat_template": "{% for m in messages %}{{ m.role }} {{ m.content }} {% endfor %}\
                          {% if add_generation_prompt %}assistant {% endif %}",
    });
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).expect("config");
    dir
}

fn start(extra: &[&str]) -> Server {
    let mut args = vec![
        "engine",
        "--port",
        "0",
        "--speedup",
        "1000",
        "--model",
        "tiny",
    ];
    args.extend(extra);
    Server::start(&args)
}

fn arg(path: &Path) -> &str {
    path.to_str().expect("a UTF-8 temp path")
}

#[test]
fn the_models_tokenizer_and_template_encode_prompts_and_replies() {
    let folder = model_folder("folder");
    let engine = start(&["--tokenizer", arg(&folder)]);
    let addr = engine.addr();

    let (status, tokens) = post_json(addr, "/tokenize", &json!({"prompt": "Hello world, mars"}));
    assert_eq!(status, 200, "{tokens}");
    assert_eq!(tokens["tokens"], json!([1, 2, 0, 0]), "hello world , [UNK]");

    // The folder's template: "user hello world assistant ".
    let chat = json!({"messages": [{"role": "user", "content": "hello world"}]});
    let (_, tokens) = post_json(addr, "/tokenize", &chat);
    assert_eq!(tokens["tokens"], json!([3, 1, 2, 4]));

    let request = json!({
        "model": "tiny", "max_tokens": 12, "ignore_eos": true, "return_token_ids": true,
        "messages": [{"role": "user", "content": "hello world"}],
    });
    let (status, reply) = post_json(addr, "/v1/chat/completions", &request);
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["usage"]["prompt_tokens"], 4, "{reply}");
    assert_eq!(reply["usage"]["completion_tokens"], 12, "{reply}");
    let ids = reply["choices"][0]["token_ids"]
        .as_array()
        .unwrap_or_else(|| panic!("no token ids: {reply}"));
    assert_eq!(ids.len(), 12, "{reply}");
    assert!(
        ids.iter()
            .all(|id| id.as_u64().is_some_and(|id| id <= WORDS.len() as u64)),
        "reply tokens outside the model's vocabulary: {reply}"
    );
}

#[test]
fn a_chat_template_file_overrides_the_tokenizers() {
    let folder = model_folder("template");
    let template = folder.join("plain.jinja");
    std::fs::write(
        &template,
        "{% for m in messages %}{{ m.content }} {% endfor %}",
    )
    .expect("template");
    let tokenizer = folder.join("tokenizer.json");
    let engine = start(&[
        "--tokenizer",
        arg(&tokenizer),
        "--chat-template",
        arg(&template),
    ]);
    let addr = engine.addr();
    let chat = json!({"messages": [{"role": "user", "content": "hello world"}]});
    let (status, tokens) = post_json(addr, "/tokenize", &chat);
    assert_eq!(status, 200, "{tokens}");
    assert_eq!(tokens["tokens"], json!([1, 2]));
}

#[test]
fn missing_tokenizer_files_are_named() {
    let empty = std::env::temp_dir().join(format!("kvroute-no-tokenizer-{}", std::process::id()));
    std::fs::create_dir_all(&empty).expect("temp dir");
    let empty = arg(&empty);
    assert_failures(&[
        (
            &[
                "engine",
                "--port",
                "0",
                "--tokenizer",
                "/nonexistent/tokenizer.json",
            ],
            "/nonexistent/tokenizer.json",
        ),
        (
            &["engine", "--port", "0", "--tokenizer", empty],
            "has no tokenizer.json",
        ),
        (
            &[
                "engine",
                "--port",
                "0",
                "--chat-template",
                "/nonexistent/t.jinja",
            ],
            "/nonexistent/t.jinja",
        ),
    ]);
}
