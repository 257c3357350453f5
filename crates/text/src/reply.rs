//! Replies of an exact token length whose tokens survive a decode/encode round trip.

use std::sync::Arc;

use rand::Rng;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rustc_hash::FxHashMap;

use crate::corpus::{KeyTerms, normalise_word};
use crate::{Corpus, TextError, Tokenizer};

/// Settings of [`ReplyGenerator`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplyConfig {
    /// Length of each passage's pre-generated token stream. Replies are slices of it, so the
    /// longest reply is half of this. Memory: 4 bytes + 1/8 byte per token per passage.
    pub stream_tokens: usize,
    /// Seed of the streams' text (fixed: the streams are part of the assets, not of a run).
    pub seed: u64,
}

impl Default for ReplyConfig {
    fn default() -> Self {
        ReplyConfig {
            stream_tokens: 32_768,
            seed: 0x006b_7672_6f75_7465,
        }
    }
}

/// A generated reply: its token ids and the passage term it mentions last, if any.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reply {
    pub ids: Arc<[u32]>,
    /// Index into [`KeyTerms::of`] for the reply's passage.
    pub topic: Option<usize>,
}

/// Readable replies from a word-level Markov chain (order 2) trained on each passage, of
/// exactly the requested number of tokens, deterministic from the caller's RNG.
///
/// **Round-trip invariant.** For every reply `ids` it returns,
/// `tokenizer.encode(&tokenizer.decode(&ids)?) == ids`, the text has no leading or trailing
/// whitespace, and `tokenizer.encode(&format!("\n\n{text}"))` is the tokens of `"\n\n"`
/// followed by `ids`. So a reply an engine "generates" is tokenized identically when the chat
/// template puts it back into the next turn's history (see [`crate::ChatTokens`]), and
/// prefix caching hits as it would with a real model.
///
/// How: each passage gets one long token stream, generated and tokenized once. A reply is a
/// slice of it that starts at a sentence or paragraph start (its first word re-encoded without
/// the preceding space) and ends just before a space that follows a non-space character.
/// Pre-tokenizer pieces never cross such a boundary, so the slice's pieces — and their BPE
/// tokens — are the same in the stream and in the reply on its own. Generating a reply is a
/// random start, a short scan for a start whose end at exactly `n` tokens is a boundary, and
/// one copy of `n` ids.
pub struct ReplyGenerator {
    streams: Vec<PassageStream>,
}

struct PassageStream {
    tokens: Vec<u32>,
    /// Bit `i` set: a reply may end right before token `i`.
    end_ok: Vec<u64>,
    starts: Vec<Start>,
    /// Head tokens of all starts, concatenated.
    heads: Vec<u32>,
    /// (token position, term index) of each key-term mention, by position.
    mentions: Vec<(u32, u16)>,
}

#[derive(Clone, Copy)]
struct Start {
    /// Offset of this start's head in `heads`.
    head_at: u32,
    head_len: u32,
    /// Stream position right after the first word's letters.
    next: u32,
}

impl std::fmt::Debug for ReplyGenerator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplyGenerator")
            .field("passages", &self.streams.len())
            .field("max_tokens", &self.max_tokens())
            .finish()
    }
}

const PARAGRAPH: u32 = 0;

impl ReplyGenerator {
    /// Trains one chain per passage and pre-generates its stream. Passages with fewer than 200
    /// words of prose train on the whole corpus instead.
    pub fn new(
        tokenizer: &Tokenizer,
        corpus: &Corpus,
        terms: &KeyTerms,
        config: &ReplyConfig,
    ) -> Result<Self, TextError> {
        if config.stream_tokens < 64 {
            return Err(TextError::Corpus(
                "reply streams need at least 64 tokens".into(),
            ));
        }
        let all_paragraphs: Vec<String> = corpus
            .passages()
            .iter()
            .flat_map(|p| p.prose_paragraphs())
            .collect();
        let mut streams = Vec::with_capacity(corpus.len());
        for (index, passage) in corpus.passages().iter().enumerate() {
            let own = passage.prose_paragraphs();
            let words: usize = own.iter().map(|p| p.split(' ').count()).sum();
            let training = if words >= 200 { &own } else { &all_paragraphs };
            let chain = Chain::train(training);
            if chain.is_empty() {
                return Err(TextError::Corpus(format!(
                    "passage {} has no prose to generate replies from",
                    index + 1
                )));
            }
            let mut rng = ChaCha8Rng::seed_from_u64(
                config.seed ^ (index as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15),
            );
            let stream = PassageStream::build(
                tokenizer,
                &chain,
                terms.of(index),
                config.stream_tokens,
                &mut rng,
            )?;
            streams.push(stream);
        }
        Ok(ReplyGenerator { streams })
    }

    /// The longest reply [`ReplyGenerator::generate`] accepts, in tokens.
    pub fn max_tokens(&self) -> usize {
        self.streams
            .iter()
            .map(|s| s.tokens.len() / 2)
            .min()
            .unwrap_or(0)
    }

    pub fn passages(&self) -> usize {
        self.streams.len()
    }

    /// A reply about passage `passage` of exactly `tokens` ids (0 gives an empty reply).
    pub fn generate(
        &self,
        passage: usize,
        tokens: usize,
        rng: &mut impl Rng,
    ) -> Result<Reply, TextError> {
        let stream = self.streams.get(passage).ok_or(TextError::UnknownPassage {
            index: passage,
            count: self.streams.len(),
        })?;
        if tokens == 0 {
            return Ok(Reply {
                ids: Arc::from(Vec::new()),
                topic: None,
            });
        }
        let max = self.max_tokens();
        if tokens > max {
            return Err(TextError::ReplyTooLong {
                requested: tokens,
                max,
            });
        }
        let first = rng.random_range(0..stream.starts.len());
        let count = stream.starts.len();
        for k in 0..count {
            let start = stream.starts[(first + k) % count];
            let head_len = start.head_len as usize;
            if head_len > tokens {
                continue;
            }
            let begin = start.next as usize;
            let end = begin + (tokens - head_len);
            if end > stream.tokens.len() || !stream.end_ok(end) {
                continue;
            }
            let head = &stream.heads[start.head_at as usize..start.head_at as usize + head_len];
            let ids: Arc<[u32]> = head
                .iter()
                .chain(&stream.tokens[begin..end])
                .copied()
                .collect();
            let topic = stream.topic_before(end as u32, begin as u32);
            return Ok(Reply { ids, topic });
        }
        Err(TextError::ReplyTooLong {
            requested: tokens,
            max,
        })
    }
}

impl PassageStream {
    fn build(
        tokenizer: &Tokenizer,
        chain: &Chain,
        terms: &[crate::Term],
        target_tokens: usize,
        rng: &mut ChaCha8Rng,
    ) -> Result<Self, TextError> {
        let term_index: FxHashMap<&str, u16> = terms
            .iter()
            .enumerate()
            .map(|(i, t)| (t.key.as_str(), i as u16))
            .collect();
        // Generate text, noting where sentences and paragraphs start and where terms appear.
        let mut text = String::with_capacity(target_tokens * 5);
        let mut sentence_starts: Vec<usize> = Vec::new();
        let mut mention_bytes: Vec<(usize, u16)> = Vec::new();
        // ~0.75 words per token in this kind of prose; overshoot, then trim to the target.
        let word_budget = target_tokens * 9 / 10 + 64;
        let mut words = 0;
        while words < word_budget {
            if !text.is_empty() {
                text.push_str("\n\n");
            }
            let mut previous_key: Option<String> = None;
            let mut sentence_start = true;
            for (i, word) in chain.paragraph(rng).into_iter().enumerate() {
                if i > 0 {
                    text.push(' ');
                }
                if sentence_start {
                    sentence_starts.push(text.len());
                }
                sentence_start = word.ends_with(['.', '?', '!']);
                if let Some((key, _, breaks)) = normalise_word(word) {
                    if let Some(&t) = term_index.get(key.as_str()) {
                        mention_bytes.push((text.len(), t));
                    }
                    if let Some(pk) = &previous_key {
                        if let Some(&t) = term_index.get(format!("{pk} {key}").as_str()) {
                            mention_bytes.push((text.len(), t));
                        }
                    }
                    previous_key = (!breaks).then_some(key);
                } else {
                    previous_key = None;
                }
                text.push_str(word);
                words += 1;
            }
        }
        let mut tokens = tokenizer.encode(&text);
        // Byte offset of each token boundary (one more entry than tokens).
        let mut offsets = Vec::with_capacity(tokens.len() + 1);
        let mut at = 0usize;
        offsets.push(0);
        for &id in &tokens {
            at += tokenizer.token_byte_len(id).ok_or_else(|| {
                TextError::Tokenizer(
                    "reply generation needs the built-in tokenizer (byte lengths per token)".into(),
                )
            })?;
            offsets.push(at);
        }
        if at != text.len() {
            return Err(TextError::Tokenizer(
                "token byte lengths do not add up to the text".into(),
            ));
        }
        let keep = tokens.len().min(target_tokens);
        tokens.truncate(keep);
        offsets.truncate(keep + 1);
        let bytes = text.as_bytes();
        let token_at = |byte: usize| offsets.binary_search(&byte).ok();

        let mut end_ok = vec![0u64; keep.div_ceil(64) + 1];
        for (i, &b) in offsets.iter().enumerate() {
            // A reply may end before a space that follows a non-space character: a piece
            // always ends there, and trimming cannot change the reply's text.
            if b > 0 && b < bytes.len() && bytes[b] == b' ' {
                let before = text[..b].chars().next_back();
                if before.is_some_and(|c| !c.is_whitespace()) {
                    end_ok[i / 64] |= 1 << (i % 64);
                }
            }
        }

        let mut starts = Vec::new();
        let mut heads = Vec::new();
        for &s in &sentence_starts {
            // The first word's leading ASCII letters form one piece when the next character is
            // not a letter; re-encoded alone they are the reply's first tokens.
            let letters = bytes[s..]
                .iter()
                .take_while(|b| b.is_ascii_alphabetic())
                .count();
            if letters == 0
                || text[s + letters..]
                    .chars()
                    .next()
                    .is_some_and(char::is_alphabetic)
            {
                continue;
            }
            let Some(next) = token_at(s + letters) else {
                continue;
            };
            if next >= keep {
                continue;
            }
            let head = tokenizer.encode_ordinary(&text[s..s + letters]);
            starts.push(Start {
                head_at: heads.len() as u32,
                head_len: head.len() as u32,
                next: next as u32,
            });
            heads.extend(head);
        }
        if starts.is_empty() {
            return Err(TextError::Corpus(
                "generated text has no sentence starting with a letter".into(),
            ));
        }
        let mut mentions: Vec<(u32, u16)> = mention_bytes
            .into_iter()
            .filter_map(|(b, t)| {
                let pos = offsets.partition_point(|&o| o <= b).saturating_sub(1);
                (pos < keep).then_some((pos as u32, t))
            })
            .collect();
        mentions.sort_unstable();
        Ok(PassageStream {
            tokens,
            end_ok,
            starts,
            heads,
            mentions,
        })
    }

    fn end_ok(&self, position: usize) -> bool {
        self.end_ok[position / 64] & (1 << (position % 64)) != 0
    }

    /// The last term mentioned in stream positions `[from, end)`.
    fn topic_before(&self, end: u32, from: u32) -> Option<usize> {
        let i = self.mentions.partition_point(|&(pos, _)| pos < end);
        let (pos, term) = *self.mentions[..i].last()?;
        (pos >= from).then_some(term as usize)
    }
}

/// An order-2 word Markov chain over paragraphs.
struct Chain {
    words: Vec<String>,
    /// (previous-but-one, previous) → possible next words, with repeats for frequency, in
    /// training order (deterministic).
    next: FxHashMap<(u32, u32), Vec<u32>>,
}

impl Chain {
    fn train(paragraphs: &[String]) -> Chain {
        let mut words = vec![String::new()]; // id 0 = PARAGRAPH boundary
        let mut ids: FxHashMap<&str, u32> = FxHashMap::default();
        let mut next: FxHashMap<(u32, u32), Vec<u32>> = FxHashMap::default();
        for paragraph in paragraphs {
            let mut state = (PARAGRAPH, PARAGRAPH);
            for word in paragraph.split(' ') {
                let id = *ids.entry(word).or_insert_with(|| {
                    words.push(word.to_owned());
                    (words.len() - 1) as u32
                });
                next.entry(state).or_default().push(id);
                state = (state.1, id);
            }
            next.entry(state).or_default().push(PARAGRAPH);
        }
        Chain { words, next }
    }

    fn is_empty(&self) -> bool {
        self.next.is_empty()
    }

    /// One paragraph's words. Long paragraphs end at the next sentence end after 120 words.
    fn paragraph(&self, rng: &mut ChaCha8Rng) -> Vec<&str> {
        let mut out = Vec::new();
        let mut state = (PARAGRAPH, PARAGRAPH);
        while let Some(choices) = self.next.get(&state) {
            let id = choices[rng.random_range(0..choices.len())];
            if id == PARAGRAPH {
                break;
            }
            let word = self.words[id as usize].as_str();
            out.push(word);
            if out.len() >= 120 && word.ends_with(['.', '?', '!']) {
                break;
            }
            state = (state.1, id);
        }
        out
    }
}
