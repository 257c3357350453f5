//! `kvroute engine --tokenizer` / `--chat-template`: the engine reads and writes the model's
//! token ids, so a router that tokenizes with the model's tokenizer (as vLLM's and SGLang's
//! routers do) sees the blocks the engine caches. A small word-level `tokenizer.json` stands
//! in for a model's.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use serde_json::{Value, json};

mod common;

use common::{Running, kvroute};

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

fn post(addr: &str, path: &str, body: &Value) -> (u16, Value) {
    let body = body.to_string();
    let mut stream = TcpStream::connect(addr).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    write!(
        stream,
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .expect("send");
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("read");
    let status = response
        .get(9..12)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let json = response
        .split_once("\r\n\r\n")
        .and_then(|(_, b)| serde_json::from_str(b).ok())
        .unwrap_or(Value::Null);
    (status, json)
}

fn start(extra: &[&str]) -> (Running, String) {
    let child = kvroute()
        .args([
            "engine",
            "--port",
            "0",
            "--speedup",
            "1000",
            "--model",
            "tiny",
        ])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn kvroute engine");
    let mut running = Running(child);
    let mut line = String::new();
    BufReader::new(running.0.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("listening line");
    let addr = line
        .rsplit("http://")
        .next()
        .unwrap_or_else(|| panic!("no address in {line:?}"))
        .trim()
        .to_string();
    (running, addr)
}

fn arg(path: &Path) -> &str {
    path.to_str().expect("a UTF-8 temp path")
}

#[test]
fn the_models_tokenizer_and_template_encode_prompts_and_replies() {
    let folder = model_folder("folder");
    let (_engine, addr) = start(&["--tokenizer", arg(&folder)]);

    let (status, tokens) = post(&addr, "/tokenize", &json!({"prompt": "Hello world, mars"}));
    assert_eq!(status, 200, "{tokens}");
    assert_eq!(tokens["tokens"], json!([1, 2, 0, 0]), "hello world , [UNK]");

    // The folder's template: "user hello world assistant ".
    let chat = json!({"messages": [{"role": "user", "content": "hello world"}]});
    let (_, tokens) = post(&addr, "/tokenize", &chat);
    assert_eq!(tokens["tokens"], json!([3, 1, 2, 4]));

    let request = json!({
        "model": "tiny", "max_tokens": 12, "ignore_eos": true, "return_token_ids": true,
        "messages": [{"role": "user", "content": "hello world"}],
    });
    let (status, reply) = post(&addr, "/v1/chat/completions", &request);
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
    let (_engine, addr) = start(&[
        "--tokenizer",
        arg(&tokenizer),
        "--chat-template",
        arg(&template),
    ]);
    let chat = json!({"messages": [{"role": "user", "content": "hello world"}]});
    let (status, tokens) = post(&addr, "/tokenize", &chat);
    assert_eq!(status, 200, "{tokens}");
    assert_eq!(tokens["tokens"], json!([1, 2]));
}

#[test]
fn missing_tokenizer_files_are_named() {
    let empty = std::env::temp_dir().join(format!("kvroute-no-tokenizer-{}", std::process::id()));
    std::fs::create_dir_all(&empty).expect("temp dir");
    for (args, expected) in [
        (
            vec!["--tokenizer", "/nonexistent/tokenizer.json"],
            "/nonexistent/tokenizer.json",
        ),
        (vec!["--tokenizer", arg(&empty)], "has no tokenizer.json"),
        (
            vec!["--chat-template", "/nonexistent/t.jinja"],
            "/nonexistent/t.jinja",
        ),
    ] {
        let out = kvroute()
            .args(["engine", "--port", "0"])
            .args(&args)
            .output()
            .expect("run kvroute engine");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} started");
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
    }
}
