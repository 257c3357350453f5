//! Hugging Face `tokenizer.json` files (`text::Tokenizer::from_hf_json`), which `kvroute
//! gateway --tokenizer` and `kvroute engine --tokenizer` load from an operator's disk.
//!
//! Properties: loading never panics, and refuses with an error that names `tokenizer.json`;
//! a loaded tokenizer encodes a short text the same way twice, with every id below its
//! `vocab_size` (what the servers rely on to check prompt ids), decodes those ids without
//! panicking, and the decoded text encodes to valid ids again; a tokenizer that gives the
//! text back gives its ids back (a round trip through the text a worker is sent); its special
//! ids (BOS, EOS, EOT) are below `vocab_size` too.

#![no_main]

use libfuzzer_sys::fuzz_target;
use text::Tokenizer;

const SAMPLES: [&str; 3] = ["hello world", "Hello, world! 12 3", "<|eot_id|>é 日本"];

fuzz_target!(|bytes: &[u8]| {
    let tokenizer = match Tokenizer::from_hf_json(bytes) {
        Ok(tokenizer) => tokenizer,
        Err(e) => {
            assert!(e.to_string().contains("tokenizer.json"), "{e}");
            return;
        }
    };
    let vocab = tokenizer.vocab_size();
    for special in [
        tokenizer.bos_token_id(),
        tokenizer.eos_token_id(),
        tokenizer.eot_token_id(),
    ]
    .into_iter()
    .flatten()
    {
        assert!(special < vocab, "special id {special} of {vocab}");
    }
    for sample in SAMPLES {
        let ids = tokenizer.encode(sample);
        assert_eq!(ids, tokenizer.encode(sample), "encoding is deterministic");
        assert!(
            ids.iter().all(|&id| id < vocab),
            "{sample:?} → {ids:?}, vocabulary {vocab}"
        );
        let _ = tokenizer.encode_ordinary(sample);
        let _ = tokenizer.decode_lossy(&ids);
        // A strict round trip is no property of every tokenizer (an unknown token decodes to
        // `[UNK]`, which a word-level model splits into three unknowns; a normalizer may
        // lower-case): the decoded text must encode to valid ids that decode again, and a
        // tokenizer that gives the sample back gives its ids back.
        if let Ok(text) = tokenizer.decode(&ids) {
            let again = tokenizer.encode(&text);
            assert!(
                again.iter().all(|&id| id < vocab),
                "{text:?} → {again:?}, vocabulary {vocab}"
            );
            let _ = tokenizer.decode_lossy(&again);
            if text == sample {
                assert_eq!(again, ids, "{sample:?} round-trips to other ids");
            }
        }
    }
});
