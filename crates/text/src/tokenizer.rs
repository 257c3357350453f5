//! Text ⇄ token ids: the built-in cl100k BPE with Llama-3 chat specials, or a Hugging Face
//! `tokenizer.json` (feature `hf`).

use std::collections::HashSet;
use std::sync::{Arc, OnceLock};

use rustc_hash::FxHashMap;
use tiktoken_rs::CoreBPE;

use crate::TextError;

/// `<|begin_of_text|>`: the Llama-3 beginning-of-sequence token.
pub const BEGIN_OF_TEXT: &str = "<|begin_of_text|>";
/// `<|start_header_id|>`: opens a message header (the role).
pub const START_HEADER_ID: &str = "<|start_header_id|>";
/// `<|end_header_id|>`: closes a message header.
pub const END_HEADER_ID: &str = "<|end_header_id|>";
/// `<|eot_id|>`: ends a message (the end-of-turn token a chat model stops on).
pub const EOT_ID: &str = "<|eot_id|>";

/// Pre-tokenizer pattern of OpenAI's cl100k_base encoding (what its `.tiktoken` ranks were
/// trained with; the ranks file alone does not carry it).
const CL100K_PATTERN: &str = concat!(
    r"'(?i:[sdmt]|ll|ve|re)",
    r"|[^\r\n\p{L}\p{N}]?+\p{L}++",
    r"|\p{N}{1,3}+",
    r"| ?[^\s\p{L}\p{N}]++[\r\n]*+",
    r"|\s++$",
    r"|\s*[\r\n]",
    r"|\s+(?!\S)",
    r"|\s",
);

/// cl100k_base's own special tokens, with their ids.
const CL100K_SPECIALS: [(&str, u32); 5] = [
    ("<|endoftext|>", 100_257),
    ("<|fim_prefix|>", 100_258),
    ("<|fim_middle|>", 100_259),
    ("<|fim_suffix|>", 100_260),
    ("<|endofprompt|>", 100_276),
];

/// The Llama-3 chat specials we add, placed right after cl100k's highest id (100,276).
const LLAMA3_SPECIALS: [(&str, u32); 4] = [
    (BEGIN_OF_TEXT, 100_277),
    (START_HEADER_ID, 100_278),
    (END_HEADER_ID, 100_279),
    (EOT_ID, 100_280),
];

/// The number of ordinary (non-special) ranks in cl100k_base: ids `0..100_256`.
const CL100K_ORDINARY: u32 = 100_256;

/// A tokenizer: text to token ids and back.
///
/// Immutable once built, `Send + Sync`: build it once and share it through an [`Arc`].
/// [`Tokenizer::builtin`] is cached for the process, so calling it again is cheap.
pub struct Tokenizer {
    name: String,
    backend: Backend,
    vocab_size: u32,
    bos: Option<u32>,
    eos: Option<u32>,
    eot: Option<u32>,
}

enum Backend {
    Bpe(Box<BuiltinBpe>),
    #[cfg(feature = "hf")]
    Hf(Box<HfTokenizer>),
}

struct BuiltinBpe {
    bpe: CoreBPE,
    /// Every special token's text, all allowed in [`Tokenizer::encode`].
    specials: Vec<&'static str>,
    /// The same as a set, as tiktoken's `encode` wants it (built once, not per call).
    allowed: HashSet<&'static str>,
    /// No special allowed: ordinary encoding.
    none_allowed: HashSet<&'static str>,
    /// Token id → bytes, dense over the whole vocabulary (specials included) so that decoding
    /// is an index, not a hash lookup. Empty entries are ids that do not exist.
    bytes_of: Vec<Box<[u8]>>,
}

#[cfg(feature = "hf")]
struct HfTokenizer {
    /// Recognises added/special tokens written in the text.
    with_specials: tokenizers::Tokenizer,
    /// The same tokenizer set to encode special-token text as ordinary text.
    ordinary: tokenizers::Tokenizer,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("name", &self.name)
            .field("vocab_size", &self.vocab_size)
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("eot", &self.eot)
            .finish()
    }
}

impl Tokenizer {
    /// The built-in tokenizer: OpenAI's cl100k_base BPE (the ranks embedded in the
    /// `tiktoken-rs` crate, nothing is downloaded) plus the Llama-3 chat special tokens
    /// `<|begin_of_text|>` = 100277, `<|start_header_id|>` = 100278, `<|end_header_id|>` =
    /// 100279 and `<|eot_id|>` = 100280.
    ///
    /// Built once per process (about 0.1–0.3 s) and shared afterwards.
    pub fn builtin() -> Arc<Tokenizer> {
        static BUILTIN: OnceLock<Arc<Tokenizer>> = OnceLock::new();
        BUILTIN
            .get_or_init(|| {
                // The embedded data and pattern are fixed: a failure here is a bug in this
                // crate or in tiktoken-rs, caught by every test, never an input error.
                Arc::new(Self::build_builtin().expect("the embedded cl100k_base ranks must load"))
            })
            .clone()
    }

    fn build_builtin() -> Result<Tokenizer, TextError> {
        let base = tiktoken_rs::cl100k_base().map_err(|e| TextError::Tokenizer(e.to_string()))?;
        // tiktoken-rs keeps its rank table private; recover it through single-token decodes.
        let mut encoder: FxHashMap<Vec<u8>, u32> = FxHashMap::default();
        encoder.reserve(CL100K_ORDINARY as usize);
        for rank in 0..CL100K_ORDINARY {
            if let Ok(bytes) = base.decode_bytes(&[rank]) {
                encoder.insert(bytes, rank);
            }
        }
        let mut special_encoder: FxHashMap<String, u32> = FxHashMap::default();
        for (text, id) in CL100K_SPECIALS.iter().chain(LLAMA3_SPECIALS.iter()) {
            special_encoder.insert((*text).to_owned(), *id);
        }
        let vocab_size = LLAMA3_SPECIALS[LLAMA3_SPECIALS.len() - 1].1 + 1;
        let mut bytes_of: Vec<Box<[u8]>> = vec![Box::default(); vocab_size as usize];
        for (bytes, &rank) in &encoder {
            bytes_of[rank as usize] = bytes.clone().into_boxed_slice();
        }
        for (text, id) in CL100K_SPECIALS.iter().chain(LLAMA3_SPECIALS.iter()) {
            bytes_of[*id as usize] = text.as_bytes().into();
        }
        let bpe = CoreBPE::new(encoder, special_encoder, CL100K_PATTERN)
            .map_err(|e| TextError::Tokenizer(e.to_string()))?;
        let specials: Vec<&'static str> = CL100K_SPECIALS
            .iter()
            .chain(LLAMA3_SPECIALS.iter())
            .map(|(text, _)| *text)
            .collect();
        let allowed = specials.iter().copied().collect();
        Ok(Tokenizer {
            name: "cl100k_base+llama3-chat".to_owned(),
            backend: Backend::Bpe(Box::new(BuiltinBpe {
                bpe,
                specials,
                allowed,
                none_allowed: HashSet::new(),
                bytes_of,
            })),
            vocab_size,
            bos: Some(LLAMA3_SPECIALS[0].1),
            eos: Some(LLAMA3_SPECIALS[3].1),
            eot: Some(LLAMA3_SPECIALS[3].1),
        })
    }

    /// A Hugging Face `tokenizer.json` (the file's bytes). The end-of-sequence token is the
    /// first of `<|eot_id|>`, `<|end_of_text|>`, `<|im_end|>`, `<|endoftext|>`, `</s>`,
    /// `<eos>` that the vocabulary has; `<|begin_of_text|>`, `<s>` or `<bos>` is the BOS.
    #[cfg(feature = "hf")]
    pub fn from_hf_json(bytes: &[u8]) -> Result<Tokenizer, TextError> {
        // `tokenizers` panics (`expect("Helper")` in its decoder's deserializer) on a file
        // that is not JSON inside the `decoder` object (a syntax error, bytes that are not
        // UTF-8), found by the `tokenizer_json` fuzz target: check both first, which gives a
        // clean error with its line and column.
        let not_json = |e: &dyn std::fmt::Display| {
            TextError::Tokenizer(format!("not a usable tokenizer.json: not JSON: {e}"))
        };
        let text = std::str::from_utf8(bytes).map_err(|e| not_json(&e))?;
        serde_json::from_str::<serde::de::IgnoredAny>(text).map_err(|e| not_json(&e))?;
        let with_specials = tokenizers::Tokenizer::from_bytes(bytes)
            .map_err(|e| TextError::Tokenizer(format!("not a usable tokenizer.json: {e}")))?;
        let mut ordinary = with_specials.clone();
        ordinary.set_encode_special_tokens(true);
        let find =
            |candidates: &[&str]| candidates.iter().find_map(|t| with_specials.token_to_id(t));
        let eot = find(&["<|eot_id|>", "<|im_end|>", "<|end|>"]);
        let eos = find(&[
            "<|eot_id|>",
            "<|end_of_text|>",
            "<|im_end|>",
            "<|endoftext|>",
            "</s>",
            "<eos>",
        ]);
        let bos = find(&["<|begin_of_text|>", "<s>", "<bos>"]);
        // Ids need not be dense (a vocabulary may skip some): `vocab_size` bounds every id, so
        // it is past the largest one, not the count (found by the `tokenizer_json` fuzz
        // target: `{"hello": 6, …}` with six tokens encoded "hello" as 6 ≥ 6).
        let largest_id = with_specials.get_vocab(true).into_values().max();
        let vocab_size = largest_id
            .map_or(Some(0), |id| id.checked_add(1))
            .and_then(|past| {
                u32::try_from(with_specials.get_vocab_size(true))
                    .ok()
                    .map(|count| count.max(past))
            })
            .ok_or_else(|| TextError::Tokenizer("vocabulary larger than u32".to_owned()))?;
        Ok(Tokenizer {
            name: "huggingface".to_owned(),
            backend: Backend::Hf(Box::new(HfTokenizer {
                with_specials,
                ordinary,
            })),
            vocab_size,
            bos,
            eos: eos.or(eot),
            eot: eot.or(eos),
        })
    }

    /// The same tokenizer under another name (e.g. the model it belongs to).
    pub fn with_name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// A short name for logs and `/v1/models`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Number of token ids, special tokens included: every valid id is below this.
    pub fn vocab_size(&self) -> u32 {
        self.vocab_size
    }

    /// The beginning-of-sequence token, if the vocabulary has one.
    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos
    }

    /// The end-of-sequence token a generation stops on.
    pub fn eos_token_id(&self) -> Option<u32> {
        self.eos
    }

    /// The end-of-turn token that closes a chat message (`<|eot_id|>` for Llama-3).
    pub fn eot_token_id(&self) -> Option<u32> {
        self.eot
    }

    /// The id of a special (or any single-token) string, e.g. `"<|eot_id|>"`.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        match &self.backend {
            Backend::Bpe(b) => {
                if b.specials.contains(&token) {
                    b.bpe.encode_with_special_tokens(token).first().copied()
                } else {
                    let ids = b.bpe.encode_ordinary(token);
                    (ids.len() == 1).then(|| ids[0])
                }
            }
            #[cfg(feature = "hf")]
            Backend::Hf(h) => h.with_specials.token_to_id(token),
        }
    }

    /// Token ids of `text`; special tokens written in the text (`<|eot_id|>`, …) become their
    /// special ids. Adds nothing (no BOS): the chat template writes `<|begin_of_text|>`.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        match &self.backend {
            Backend::Bpe(b) => b.encode(text, &b.allowed),
            #[cfg(feature = "hf")]
            Backend::Hf(h) => hf_encode(&h.with_specials, text),
        }
    }

    /// Token ids of `text` with special-token text encoded as ordinary text: what a user
    /// message must go through so that it cannot inject `<|eot_id|>`.
    pub fn encode_ordinary(&self, text: &str) -> Vec<u32> {
        match &self.backend {
            Backend::Bpe(b) => b.encode(text, &b.none_allowed),
            #[cfg(feature = "hf")]
            Backend::Hf(h) => hf_encode(&h.ordinary, text),
        }
    }

    /// The text of `ids`. Errors on an id outside the vocabulary, or (built-in tokenizer)
    /// when the ids cut a UTF-8 character in two.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TextError> {
        match &self.backend {
            Backend::Bpe(b) => {
                let bytes = b.decode_bytes(ids)?;
                String::from_utf8(bytes).map_err(|_| TextError::InvalidUtf8)
            }
            #[cfg(feature = "hf")]
            Backend::Hf(h) => {
                if let Some(&bad) = ids.iter().find(|&&id| id >= self.vocab_size) {
                    return Err(TextError::UnknownToken(bad));
                }
                h.with_specials
                    .decode(ids, false)
                    .map_err(|e| TextError::Tokenizer(e.to_string()))
            }
        }
    }

    /// Like [`Tokenizer::decode`], but a cut character becomes U+FFFD and unknown ids are
    /// skipped: for display and streaming, never for round trips.
    pub fn decode_lossy(&self, ids: &[u32]) -> String {
        match &self.backend {
            Backend::Bpe(b) => {
                let mut bytes = Vec::with_capacity(ids.len() * 4);
                for &id in ids {
                    if let Some(piece) = b.bytes_of.get(id as usize) {
                        bytes.extend_from_slice(piece);
                    }
                }
                String::from_utf8_lossy(&bytes).into_owned()
            }
            #[cfg(feature = "hf")]
            Backend::Hf(h) => {
                let known: Vec<u32> = ids
                    .iter()
                    .copied()
                    .filter(|&id| id < self.vocab_size)
                    .collect();
                h.with_specials.decode(&known, false).unwrap_or_default()
            }
        }
    }

    /// The raw bytes of `ids` (built-in tokenizer: exact, possibly cutting a UTF-8 character,
    /// which is what a streaming decoder needs). For a Hugging Face tokenizer, the UTF-8 of
    /// its decoded text.
    pub fn decode_bytes(&self, ids: &[u32]) -> Result<Vec<u8>, TextError> {
        match &self.backend {
            Backend::Bpe(b) => b.decode_bytes(ids),
            #[cfg(feature = "hf")]
            Backend::Hf(_) => self.decode(ids).map(String::into_bytes),
        }
    }

    /// Byte length of each token's text (built-in tokenizer), e.g. to map token positions to
    /// text offsets. `None` for an unknown id or a Hugging Face tokenizer.
    pub fn token_byte_len(&self, id: u32) -> Option<usize> {
        match &self.backend {
            Backend::Bpe(b) => b
                .bytes_of
                .get(id as usize)
                .filter(|p| !p.is_empty())
                .map(|p| p.len()),
            #[cfg(feature = "hf")]
            Backend::Hf(_) => None,
        }
    }
}

impl BuiltinBpe {
    fn encode(&self, text: &str, allowed: &HashSet<&str>) -> Vec<u32> {
        match self.bpe.encode(text, allowed) {
            Ok((ids, _)) => ids,
            // The only failure is fancy-regex's backtrack limit, which cl100k's possessive
            // pattern does not reach; fall back to one piece per character rather than lose text.
            Err(_) => {
                let mut ids = Vec::new();
                let mut buf = [0u8; 4];
                for ch in text.chars() {
                    ids.extend(self.bpe.encode_ordinary(ch.encode_utf8(&mut buf)));
                }
                ids
            }
        }
    }

    fn decode_bytes(&self, ids: &[u32]) -> Result<Vec<u8>, TextError> {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            match self.bytes_of.get(id as usize) {
                Some(piece) if !piece.is_empty() => bytes.extend_from_slice(piece),
                _ => return Err(TextError::UnknownToken(id)),
            }
        }
        Ok(bytes)
    }
}

#[cfg(feature = "hf")]
fn hf_encode(tokenizer: &tokenizers::Tokenizer, text: &str) -> Vec<u32> {
    match tokenizer.encode_fast(text, false) {
        Ok(encoding) => encoding.get_ids().to_vec(),
        // Encoding fails only on a broken tokenizer (e.g. a missing unk token for an unknown
        // character); an empty result would silently drop text, so try again piecewise.
        Err(_) => text
            .chars()
            .flat_map(|ch| {
                tokenizer
                    .encode_fast(ch.to_string(), false)
                    .map(|e| e.get_ids().to_vec())
                    .unwrap_or_default()
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_matches_cl100k_on_ordinary_text() {
        let tok = Tokenizer::builtin();
        let reference = tiktoken_rs::cl100k_base().unwrap();
        for text in [
            "hello world",
            "KV-cache-aware routing sends each turn back to the GPU that holds its prefix.",
            "  leading spaces\n\n\ttabs and\r\nCRLF 12345 ünïcödé 日本語 🚀",
            "",
        ] {
            assert_eq!(tok.encode(text), reference.encode_with_special_tokens(text));
            assert_eq!(tok.decode(&tok.encode(text)).unwrap(), text);
        }
        // "hello world" in cl100k_base is [15339, 1917] (pinned: the wire format of prompts).
        assert_eq!(tok.encode("hello world"), vec![15339, 1917]);
    }

    #[test]
    fn chat_specials_are_recognised_in_encode_but_not_in_encode_ordinary() {
        let tok = Tokenizer::builtin();
        let ids = tok.encode("<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>");
        assert_eq!(ids[0], 100_278);
        assert_eq!(ids[2], 100_279);
        assert_eq!(*ids.last().unwrap(), 100_280);
        assert!(
            tok.encode_ordinary("<|eot_id|>")
                .iter()
                .all(|&id| id < CL100K_ORDINARY)
        );
        assert_eq!(tok.token_id(EOT_ID), Some(100_280));
        assert_eq!(tok.token_id(BEGIN_OF_TEXT), Some(100_277));
        assert_eq!(tok.eot_token_id(), Some(100_280));
        assert_eq!(tok.bos_token_id(), Some(100_277));
        assert_eq!(tok.vocab_size(), 100_281);
    }

    #[test]
    fn decode_reports_bad_input() {
        let tok = Tokenizer::builtin();
        assert!(matches!(
            tok.decode(&[100_256]),
            Err(TextError::UnknownToken(100_256))
        ));
        assert!(matches!(
            tok.decode(&[u32::MAX]),
            Err(TextError::UnknownToken(_))
        ));
        // "🚀" is several byte tokens; its first token alone is a cut character.
        let rocket = tok.encode("🚀");
        assert!(rocket.len() > 1);
        assert!(matches!(
            tok.decode(&rocket[..1]),
            Err(TextError::InvalidUtf8)
        ));
        assert_eq!(tok.decode_lossy(&rocket[..1]), "\u{FFFD}");
        assert_eq!(tok.decode_lossy(&[u32::MAX, 15339]), "hello");
    }

    #[test]
    fn tokenizer_is_send_and_sync() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<Tokenizer>();
    }
}
