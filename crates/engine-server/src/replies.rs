//! What the simulated model answers: readable text from `text::ReplyGenerator`, of a length
//! the request fixes (`ignore_eos`) or a natural one.
//!
//! A reply's ids are the canonical tokens of its text, so the gateway re-tokenizing the reply
//! inside the next turn's history gets the very ids this engine cached during decode.

use std::sync::{Arc, OnceLock};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use text::{ChatEnding, ChatTokens, Preprocessor, ReplyGenerator, Tokenizer};

use crate::config::ReplyLength;

/// The process's shared [`text::Assets`] (built once, tens of milliseconds) and the passages'
/// headings: the reply generator and what it writes with.
struct Builtin {
    shared: Arc<text::Assets>,
    /// `# Title` of each shipped passage, in the reply generator's order.
    headings: Vec<String>,
}

static BUILTIN: OnceLock<Result<Builtin, String>> = OnceLock::new();

fn builtin() -> Result<&'static Builtin, String> {
    BUILTIN
        .get_or_init(|| {
            let shared = text::Assets::builtin()
                .map_err(|e| format!("building the reply generator: {e}"))?;
            let headings = shared
                .corpus()
                .passages()
                .iter()
                .map(|p| format!("# {}", p.title()))
                .collect();
            Ok(Builtin { shared, headings })
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// What one server reads and writes text with: the serving tokenizer (the built-in one, or the
/// model's `--tokenizer`) and chat template, and the reply generator.
pub struct TextAssets {
    /// The serving tokenizer: prompts are encoded, replies emitted and decoded with it.
    pub tokenizer: Arc<Tokenizer>,
    /// A model's own tokenizer and template; `None` serves the built-in ones.
    custom: Option<Arc<Preprocessor>>,
    builtin: &'static Builtin,
}

impl TextAssets {
    /// The built-in tokenizer (cl100k with Llama-3's specials) and Llama-3 template.
    pub fn builtin() -> Result<TextAssets, String> {
        let builtin = builtin()?;
        Ok(TextAssets {
            tokenizer: builtin.shared.tokenizer().clone(),
            custom: None,
            builtin,
        })
    }

    /// A model's tokenizer and chat template; replies are the generator's text, re-encoded
    /// with this tokenizer.
    pub fn with_preprocessor(preprocessor: Arc<Preprocessor>) -> Result<TextAssets, String> {
        Ok(TextAssets {
            tokenizer: preprocessor.tokenizer().clone(),
            custom: Some(preprocessor),
            builtin: builtin()?,
        })
    }

    pub fn replies(&self) -> &ReplyGenerator {
        self.builtin.shared.replies()
    }

    fn headings(&self) -> &[String] {
        &self.builtin.headings
    }

    /// The prompt ids of a chat, as the template renders it and the tokenizer encodes it.
    #[cfg(test)]
    pub fn chat_prompt(&self, messages: &[text::ChatMessage]) -> Result<Vec<u32>, ChatPromptError> {
        self.chat_prompt_ending(messages, ChatEnding::GenerationPrompt)
    }

    /// The prompt ids of a chat ending as `ending` says (vLLM's `add_generation_prompt`,
    /// `continue_final_message`).
    pub fn chat_prompt_ending(
        &self,
        messages: &[text::ChatMessage],
        ending: ChatEnding,
    ) -> Result<Vec<u32>, ChatPromptError> {
        if let Some(custom) = &self.custom {
            return custom
                .chat_ending(messages, ending, false)
                .map(|prepared| prepared.tokens)
                .map_err(|e| {
                    if e.is_template_failure() {
                        ChatPromptError::Failed(e.to_string())
                    } else {
                        ChatPromptError::Refused(e)
                    }
                });
        }
        let mut chat = ChatTokens::new(self.tokenizer.clone())
            .map_err(|e| ChatPromptError::Failed(e.to_string()))?;
        for message in messages {
            chat.push(message);
        }
        let mut ids = match ending {
            ChatEnding::GenerationPrompt => {
                chat.push_generation_prompt();
                chat.into_ids()
            }
            ChatEnding::Closed | ChatEnding::ContinueFinal => chat.into_ids(),
        };
        if ending == ChatEnding::ContinueFinal && messages.last().is_some() {
            // Each message ends with `<|eot_id|>`: the last one is left open.
            ids.pop();
        }
        Ok(ids)
    }

    /// A plain prompt's ids.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        match &self.custom {
            Some(custom) => custom.text(text),
            None => self.tokenizer.encode(text),
        }
    }
}

/// A planned reply: its ids, its text, and where each token's text ends.
pub struct PlannedReply {
    pub ids: Arc<[u32]>,
    pub text: String,
    /// `text_end[i]`: byte length of the text of tokens `0..=i`, moved back to a character
    /// boundary (a token may end inside a multi-byte character).
    pub text_end: Vec<u32>,
    /// The reply was cut by `max_tokens` or the context (`length`), not ended by the model.
    pub truncated: bool,
}

impl PlannedReply {
    /// The text of tokens `0..count` (never past the end of `text`, which a stop string cuts
    /// short of its tokens' text: [`PlannedReply::stop_at`]).
    pub fn text_upto(&self, count: u32) -> &str {
        let end = (count as usize)
            .min(self.text_end.len())
            .checked_sub(1)
            .map_or(0, |last| self.text_end[last] as usize);
        &self.text[..end.min(self.text.len())]
    }

    /// Applies OpenAI's `stop`: where the reply's text first completes one of `stops`, the
    /// reply ends. Its tokens are cut after the one that completes the stop string (those the
    /// engine generates, and usage counts, as a real engine stops once it has decoded it),
    /// its text just before the stop string (not returned), and it ends with `stop`, not
    /// `length`. Among stop strings completed by the same token, the one that starts first
    /// wins. Nothing changes when no stop string occurs. Returns whether one did.
    pub fn stop_at(&mut self, stops: &[&str]) -> bool {
        // (tokens up to the one completing it, where the stop string starts)
        let mut first: Option<(usize, usize)> = None;
        for stop in stops.iter().filter(|s| !s.is_empty()) {
            let Some(start) = self.text.find(stop) else {
                continue;
            };
            let end = start + stop.len();
            // The first token whose text reaches the end of the match; all of them when
            // the token offsets fall short of the text (a lossy decode).
            let tokens = self
                .text_end
                .partition_point(|&e| (e as usize) < end)
                .saturating_add(1)
                .min(self.text_end.len());
            if first.is_none_or(|best| (tokens, start) < best) {
                first = Some((tokens, start));
            }
        }
        let Some((tokens, start)) = first else {
            return false;
        };
        self.ids = self.ids[..tokens].into();
        self.text_end.truncate(tokens);
        self.text.truncate(start);
        self.truncated = false;
        true
    }
}

/// What a stream may send of a reply's text while the reply goes on: all but its longest
/// ending that begins one of the stop strings (one the next tokens may complete, whose text
/// must then never have been sent). Scans each byte once, whatever the stop strings' length
/// (Knuth–Morris–Pratt, one matcher per stop string).
pub struct StopHold {
    matchers: Vec<Matcher>,
    /// Bytes of the text scanned so far.
    scanned: usize,
}

struct Matcher {
    pattern: Box<[u8]>,
    /// `fail[i]`: the longest proper prefix of `pattern[..=i]` that is also its suffix.
    fail: Vec<usize>,
    /// The longest prefix of `pattern` the text scanned so far ends with.
    matched: usize,
}

impl Matcher {
    fn new(pattern: &str) -> Matcher {
        let pattern: Box<[u8]> = pattern.as_bytes().into();
        let mut fail = vec![0; pattern.len()];
        let mut k = 0;
        for i in 1..pattern.len() {
            while k > 0 && pattern[i] != pattern[k] {
                k = fail[k - 1];
            }
            if pattern[i] == pattern[k] {
                k += 1;
            }
            fail[i] = k;
        }
        Matcher {
            pattern,
            fail,
            matched: 0,
        }
    }

    fn push(&mut self, byte: u8) {
        let mut k = self.matched;
        while k > 0 && self.pattern[k] != byte {
            k = self.fail[k - 1];
        }
        if self.pattern[k] == byte {
            k += 1;
        }
        if k == self.pattern.len() {
            // A whole stop string: the reply was cut before it (`PlannedReply::stop_at`), so
            // this is not reached; hold only what could begin another occurrence.
            k = self.fail[k - 1];
        }
        self.matched = k;
    }
}

impl StopHold {
    /// For `stops` (empty strings ignored).
    pub fn new(stops: &[&str]) -> StopHold {
        StopHold {
            matchers: stops
                .iter()
                .filter(|s| !s.is_empty())
                .map(|s| Matcher::new(s))
                .collect(),
            scanned: 0,
        }
    }

    /// How many bytes of `text` (the reply's text so far, each call's extending the last's)
    /// may be sent.
    pub fn sendable(&mut self, text: &str) -> usize {
        let bytes = text.as_bytes();
        for &byte in &bytes[self.scanned.min(bytes.len())..] {
            for matcher in &mut self.matchers {
                matcher.push(byte);
            }
        }
        self.scanned = self.scanned.max(bytes.len());
        let held = self.matchers.iter().map(|m| m.matched).max().unwrap_or(0);
        bytes.len().saturating_sub(held)
    }
}

/// How many tokens to generate.
pub struct LengthRequest {
    pub max_tokens: Option<u32>,
    pub ignore_eos: bool,
    /// The most the context leaves after the prompt.
    pub room: u32,
}

/// Plans a reply for `prompt`: deterministic in (seed, prompt, request seed).
pub fn plan_reply(
    assets: &TextAssets,
    prompt: &[u32],
    length: &LengthRequest,
    distribution: ReplyLength,
    seed: u64,
) -> Result<PlannedReply, String> {
    let prompt_hash = xxhash_rust::xxh3::xxh3_64_with_seed(
        &prompt
            .iter()
            .flat_map(|t| t.to_le_bytes())
            .collect::<Vec<u8>>(),
        seed,
    );
    let mut rng = ChaCha8Rng::seed_from_u64(prompt_hash);
    let cap = length.max_tokens.unwrap_or(u32::MAX).min(length.room);
    let (count, truncated) = if length.ignore_eos {
        (cap, true)
    } else {
        let natural = natural_length(distribution, &mut rng);
        (natural.min(cap), natural > cap)
    };
    let passage = passage_of(assets, prompt);
    let ids = match &assets.custom {
        None => generate(assets, passage, count as usize, &mut rng)?,
        Some(_) => generate_in(assets, passage, count as usize, &mut rng)?,
    };
    let text = assets.tokenizer.decode(&ids).map_err(|e| e.to_string())?;
    let mut text_end = Vec::with_capacity(ids.len());
    let mut end = 0usize;
    for &id in ids.iter() {
        end += assets.tokenizer.token_byte_len(id).unwrap_or(0);
        let mut boundary = end.min(text.len());
        while !text.is_char_boundary(boundary) {
            boundary -= 1;
        }
        text_end.push(boundary as u32);
    }
    Ok(PlannedReply {
        ids,
        text,
        text_end,
        truncated,
    })
}

/// The passage a reply talks about: the shipped passage whose `# Title` the prompt's opening
/// carries (a conversation about it, as the load generator's are), else one chosen by a hash
/// of the opening. Either way every turn of one conversation (same system prompt and first
/// question) talks about the same passage.
fn passage_of(assets: &TextAssets, prompt: &[u32]) -> usize {
    let head = &prompt[..prompt.len().min(256)];
    let text = assets.tokenizer.decode_lossy(head);
    if let Some(found) = assets
        .headings()
        .iter()
        .position(|heading| text.contains(heading.as_str()))
        .filter(|&i| i < assets.replies().passages())
    {
        return found;
    }
    let passages = assets.replies().passages().max(1);
    (xxhash_rust::xxh3::xxh3_64(
        &head
            .iter()
            .flat_map(|t| t.to_le_bytes())
            .collect::<Vec<u8>>(),
    ) % passages as u64) as usize
}

fn natural_length(distribution: ReplyLength, rng: &mut ChaCha8Rng) -> u32 {
    let mean = f64::from(distribution.mean.max(1));
    let spread = distribution.spread.clamp(0.0, 1.0);
    let low = mean * (1.0 - spread);
    let high = mean * (1.0 + spread);
    let sample = if high > low {
        rng.random_range(low..=high)
    } else {
        mean
    };
    (sample.round() as u32).max(1)
}

/// `count` ids from the generator; replies longer than it produces at once are concatenated
/// from several (their joins may then re-tokenize differently; beyond 16k tokens only).
fn generate(
    assets: &TextAssets,
    passage: usize,
    count: usize,
    rng: &mut ChaCha8Rng,
) -> Result<Arc<[u32]>, String> {
    let max = assets.replies().max_tokens().max(1);
    if count <= max {
        return assets
            .replies()
            .generate(passage, count, rng)
            .map(|reply| reply.ids)
            .map_err(|e| e.to_string());
    }
    let mut ids = Vec::with_capacity(count);
    while ids.len() < count {
        let piece = (count - ids.len()).min(max);
        let reply = assets
            .replies()
            .generate(passage, piece, rng)
            .map_err(|e| e.to_string())?;
        ids.extend_from_slice(&reply.ids);
    }
    Ok(ids.into())
}

/// `count` ids of the serving tokenizer: the generator's text (written with the built-in
/// tokenizer), re-encoded. A tokenizer with longer tokens needs more text; the generator is
/// asked again until there is enough (a bounded number of times: each piece adds at least a
/// token), and the excess is cut.
fn generate_in(
    assets: &TextAssets,
    passage: usize,
    count: usize,
    rng: &mut ChaCha8Rng,
) -> Result<Arc<[u32]>, String> {
    let builtin = assets.builtin.shared.tokenizer();
    let mut text = String::new();
    let mut ids = Vec::new();
    for _ in 0..64 {
        if ids.len() >= count {
            break;
        }
        let missing = count - ids.len();
        let piece = generate(assets, passage, missing.max(16), rng)?;
        if !text.is_empty() {
            text.push(' ');
        }
        text.push_str(&builtin.decode_lossy(&piece));
        ids = assets.tokenizer.encode_ordinary(&text);
    }
    ids.truncate(count);
    Ok(ids.into())
}

/// Why a chat could not become prompt ids.
#[derive(Debug, thiserror::Error)]
pub enum ChatPromptError {
    /// The chat template refused these messages (its `raise_exception`, a role it does not
    /// take): the client's to fix, answered 400 as the gateway answers it.
    #[error(transparent)]
    Refused(text::FormatError),
    /// The template (out of fuel, too deep, a bug of its own) or the tokenizer failed: the
    /// operator's, answered 500.
    #[error("{0}")]
    Failed(String),
}

#[cfg(test)]
mod tests {
    use super::*;
    use text::{ChatMessage, Corpus};

    /// vLLM's `continue_final_message`: the chat with a partial assistant message left open is
    /// the chat's prompt followed by that partial text, what a migrated request continues.
    #[test]
    fn a_final_message_continued_is_the_prompt_followed_by_its_text() {
        let assets = &TextAssets::builtin().unwrap();
        let question = ChatMessage::user("Tell me about caching.");
        let prompt = assets.chat_prompt(std::slice::from_ref(&question)).unwrap();
        let partial = "Prefix caching keeps";
        let continued = assets
            .chat_prompt_ending(
                &[question.clone(), ChatMessage::assistant(partial)],
                ChatEnding::ContinueFinal,
            )
            .unwrap();
        let mut expected = prompt.clone();
        expected.extend(assets.encode(partial));
        assert_eq!(continued, expected);
        // Closed: the question's turn ends, no assistant header.
        let closed = assets
            .chat_prompt_ending(std::slice::from_ref(&question), ChatEnding::Closed)
            .unwrap();
        assert!(prompt.starts_with(&closed) && prompt.len() > closed.len());
    }

    /// The longest ending of `text` that is a proper prefix of a stop string, the slow way.
    fn held_naively(text: &str, stops: &[&str]) -> usize {
        stops
            .iter()
            .flat_map(|stop| (1..stop.len()).map(move |n| &stop[..n]))
            .filter(|prefix| text.ends_with(prefix))
            .map(str::len)
            .max()
            .unwrap_or(0)
    }

    #[test]
    fn held_text_is_the_longest_ending_that_begins_a_stop_string() {
        let stops = ["abab", "aab", "ba", "xyz"];
        // Every text of a's and b's up to 9 letters, fed a letter at a time.
        for len in 1..=9u32 {
            for bits in 0..(1u32 << len) {
                let text: String = (0..len)
                    .map(|i| if bits >> i & 1 == 1 { 'b' } else { 'a' })
                    .collect();
                let mut hold = StopHold::new(&stops);
                for end in 1..=text.len() {
                    let sent = hold.sendable(&text[..end]);
                    assert_eq!(
                        end - sent,
                        held_naively(&text[..end], &stops),
                        "{:?}",
                        &text[..end]
                    );
                }
            }
        }
        // Fed several bytes at once, and a multi-byte stop string.
        let mut hold = StopHold::new(&["é€x"]);
        assert_eq!(hold.sendable("caf"), 3);
        assert_eq!(hold.sendable("café€"), "caf".len());
        assert_eq!(hold.sendable("café€y"), "café€y".len());
        // Without stop strings, everything.
        assert_eq!(StopHold::new(&[]).sendable("abc"), 3);
    }

    #[test]
    fn a_stop_string_cuts_the_text_before_it_and_the_tokens_after_the_one_completing_it() {
        let assets = &TextAssets::builtin().unwrap();
        let prompt = assets.encode("Tell me about caching.");
        let length = LengthRequest {
            max_tokens: Some(80),
            ignore_eos: true,
            room: 1_000,
        };
        let plan = || plan_reply(assets, &prompt, &length, ReplyLength::default(), 7).unwrap();
        let full = plan();
        // Six bytes of the second half that occur nowhere earlier, nor do their last three.
        let text = &full.text;
        let first = (text.len() / 2..text.len() - 6)
            .find(|&i| {
                text.get(i..i + 6).is_some_and(|s| text.find(s) == Some(i))
                    && text
                        .get(i + 3..i + 6)
                        .is_some_and(|s| text.find(s) == Some(i + 3))
            })
            .expect("a fresh stop string in the second half");
        let stop = &text[first..first + 6];
        let mut cut = plan();
        assert!(cut.stop_at(&["no such text", stop]));
        assert_eq!(cut.text, full.text[..first]);
        assert!(!cut.truncated);
        let tokens = cut.ids.len();
        assert_eq!(cut.ids[..], full.ids[..tokens]);
        assert!(full.text_upto(tokens as u32).len() >= first + stop.len());
        assert!(full.text_upto(tokens as u32 - 1).len() < first + stop.len());
        assert_eq!(cut.text_upto(tokens as u32), cut.text);
        // Two stop strings completed by the same token: the one starting first.
        let mut both = plan();
        assert!(both.stop_at(&[&stop[3..], stop]));
        assert_eq!(both.text, full.text[..first]);
        // None occurring: nothing changes.
        let mut same = plan();
        assert!(!same.stop_at(&["no such text"]));
        assert_eq!((same.text, same.ids.len()), (full.text.clone(), 80));
    }

    #[test]
    fn a_conversation_about_a_shipped_passage_gets_replies_about_it() {
        let assets = &TextAssets::builtin().unwrap();
        let corpus = Corpus::builtin();
        for (index, passage) in corpus.passages().iter().enumerate() {
            let prompt = assets
                .chat_prompt(&[
                    ChatMessage::system(format!("Read this.\n\n{}", passage.markdown())),
                    ChatMessage::user("What matters most here?"),
                ])
                .unwrap();
            assert_eq!(passage_of(assets, &prompt), index, "{}", passage.title());
        }
        // Anything else: a passage all the same, the same one for the same opening.
        let other = assets
            .chat_prompt(&[ChatMessage::user("Tell me about caching.")])
            .unwrap();
        let chosen = passage_of(assets, &other);
        assert!(chosen < assets.replies().passages());
        assert_eq!(passage_of(assets, &other), chosen);
    }
}
