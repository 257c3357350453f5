//! `Tokenizer::from_hf_json` with a small hand-written `tokenizer.json` (feature `hf`).
#![cfg(feature = "hf")]

use text::{TextError, Tokenizer};

const TOKENIZER_JSON: &str = r#"{
  "version": "1.0",
  "truncation": null,
  "padding": null,
  "added_tokens": [
    {"id": 4, "content": "<|begin_of_text|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
    {"id": 5, "content": "<|eot_id|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}
  ],
  "normalizer": null,
  "pre_tokenizer": {"type": "Whitespace"},
  "post_processor": null,
  "decoder": null,
  "model": {"type": "WordLevel", "vocab": {"hello": 0, "world": 1, "[UNK]": 2, "eot": 3}, "unk_token": "[UNK]"}
}"#;

#[test]
fn loads_encodes_and_decodes_a_tokenizer_json() {
    let tok = Tokenizer::from_hf_json(TOKENIZER_JSON.as_bytes())
        .unwrap()
        .with_name("tiny");
    assert_eq!(tok.name(), "tiny");
    assert_eq!(tok.vocab_size(), 6);
    assert_eq!(tok.eos_token_id(), Some(5));
    assert_eq!(tok.eot_token_id(), Some(5));
    assert_eq!(tok.bos_token_id(), Some(4));
    assert_eq!(tok.encode("hello world<|eot_id|>"), vec![0, 1, 5]);
    // Ordinary encoding does not produce the special id from text.
    assert!(!tok.encode_ordinary("hello <|eot_id|>").contains(&5));
    assert_eq!(tok.encode("hello mars"), vec![0, 2]);
    assert_eq!(tok.decode(&[0, 1]).unwrap(), "hello world");
    assert!(matches!(
        tok.decode(&[0, 99]),
        Err(TextError::UnknownToken(99))
    ));
    assert_eq!(tok.decode_lossy(&[0, 99, 1]), "hello world");
}

#[test]
fn rejects_a_broken_file() {
    let err = Tokenizer::from_hf_json(b"{\"model\": 3}").unwrap_err();
    assert!(err.to_string().contains("tokenizer.json"), "{err}");
}

/// Found by the `tokenizer_json` fuzz target: a file whose `decoder` object is not JSON made
/// `tokenizers` panic (`expect("Helper")`); it is now a clean error.
#[test]
fn a_file_broken_inside_its_decoder_is_an_error_not_a_panic() {
    let broken = TOKENIZER_JSON.replace(
        r#""decoder": null"#,
        r#""decoder": {"type": "ByteLevel", "add_prefix_space": false true}"#,
    );
    assert_ne!(broken, TOKENIZER_JSON);
    let err = Tokenizer::from_hf_json(broken.as_bytes()).unwrap_err();
    assert!(
        err.to_string().contains("tokenizer.json: not JSON"),
        "{err}"
    );
    // The same with a byte that is not UTF-8 inside the decoder's object.
    let mut bytes = TOKENIZER_JSON
        .replace(
            r#""decoder": null"#,
            r#""decoder": {"type": "ByteLevel", "a": "x"}"#,
        )
        .into_bytes();
    let marker = br#""a": "x""#;
    let at = bytes
        .windows(marker.len())
        .position(|w| w == marker)
        .unwrap();
    bytes[at + marker.len() - 2] = 0x80;
    let err = Tokenizer::from_hf_json(&bytes).unwrap_err();
    assert!(
        err.to_string().contains("tokenizer.json: not JSON"),
        "{err}"
    );
}

/// Found by the `tokenizer_json` fuzz target: ids need not be dense, and `vocab_size` bounds
/// every id the tokenizer gives, not only the count of tokens.
#[test]
fn vocab_size_is_past_the_largest_id_of_a_sparse_vocabulary() {
    let sparse = TOKENIZER_JSON.replace(r#""hello": 0"#, r#""hello": 9"#);
    let tok = Tokenizer::from_hf_json(sparse.as_bytes()).unwrap();
    assert_eq!(tok.encode("hello"), vec![9]);
    assert_eq!(tok.vocab_size(), 10);
}
