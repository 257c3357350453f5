//! A server's preprocessing, once per request: chat template, then tokenization.
//!
//! The built-in pair (cl100k + Llama-3 specials, Llama-3 template) takes a fast path that
//! encodes each message on its own ([`crate::Llama3Format`]), which gives the same ids as
//! rendering and encoding the whole conversation. Any other template renders the text first
//! and encodes it as a whole. Loading a tokenizer or template from files is the caller's I/O;
//! this takes their contents.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use crate::{ChatMessage, ChatTemplate, Llama3Format, TemplateError, Tokenizer};

/// The messages cannot be formatted by the chat template (a template's own `raise_exception`,
/// or a role it does not accept).
#[derive(Debug, thiserror::Error)]
#[error("the chat template cannot format these messages: {0}")]
pub struct FormatError(TemplateError);

impl FormatError {
    /// Whether the template failed on its own (out of fuel, too deep, a bug of its own), not
    /// refused the messages: a server error, not the client's.
    pub fn is_template_failure(&self) -> bool {
        self.0.is_template_failure()
    }
}

/// A prompt ready for routing: its token ids, and its text when a worker needs text.
#[derive(Debug, Clone, PartialEq)]
pub struct Prepared {
    pub tokens: Vec<u32>,
    pub text: Option<String>,
}

/// Messages shorter than this are encoded every time (cheaper than hashing and locking).
const CACHE_MIN_BYTES: usize = 256;
/// Bound of the message cache, in cached tokens (about 4 bytes each).
const CACHE_MAX_TOKENS: usize = 8 << 20;

/// Token ids of recently seen messages under the built-in format. Multi-turn chats resend
/// their whole history every turn; with this, a turn encodes only its new messages.
/// Keyed by a 128-bit hash of role and content; bounded by [`CACHE_MAX_TOKENS`], oldest
/// first out.
#[derive(Debug, Default)]
struct MessageCache {
    map: HashMap<u128, Arc<[u32]>>,
    order: VecDeque<u128>,
    tokens: usize,
}

impl MessageCache {
    fn key(message: &ChatMessage) -> u128 {
        let mut bytes = Vec::with_capacity(message.role.len() + message.content.len() + 1);
        bytes.extend_from_slice(message.role.as_bytes());
        bytes.push(0);
        bytes.extend_from_slice(message.content.as_bytes());
        xxhash_rust::xxh3::xxh3_128(&bytes)
    }

    fn insert(&mut self, key: u128, tokens: Arc<[u32]>) {
        if tokens.len() > CACHE_MAX_TOKENS || self.map.contains_key(&key) {
            return;
        }
        while self.tokens + tokens.len() > CACHE_MAX_TOKENS {
            let Some(old) = self.order.pop_front() else {
                break;
            };
            if let Some(evicted) = self.map.remove(&old) {
                self.tokens -= evicted.len();
            }
        }
        self.tokens += tokens.len();
        self.order.push_back(key);
        self.map.insert(key, tokens);
    }
}

/// How a rendered chat ends (vLLM's `add_generation_prompt` and `continue_final_message`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ChatEnding {
    /// With the assistant header, for the model to write a reply (the default).
    #[default]
    GenerationPrompt,
    /// After the last message, closed.
    Closed,
    /// The last message left open (no end-of-turn), for the model to continue it.
    ContinueFinal,
}

/// Tokenizer + chat template.
#[derive(Debug)]
pub struct Preprocessor {
    tokenizer: Arc<Tokenizer>,
    template: ChatTemplate,
    fast: Option<Llama3Format>,
    cache: Mutex<MessageCache>,
}

impl Preprocessor {
    /// The built-in tokenizer and template.
    pub fn builtin() -> Preprocessor {
        Preprocessor::new(Tokenizer::builtin(), ChatTemplate::llama3())
    }

    /// `tokenizer` with `template` (the caller loads them, e.g. with
    /// [`Tokenizer::from_hf_json`] and [`ChatTemplate::from_tokenizer_config`]).
    pub fn new(tokenizer: Arc<Tokenizer>, template: ChatTemplate) -> Preprocessor {
        let fast = if template.is_builtin_llama3() {
            Llama3Format::new(&tokenizer).ok()
        } else {
            None
        };
        Preprocessor {
            tokenizer,
            template,
            fast,
            cache: Mutex::default(),
        }
    }

    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    /// A chat's prompt, ending with the assistant header. `with_text` also returns the
    /// rendered text (for workers that take text).
    pub fn chat(&self, messages: &[ChatMessage], with_text: bool) -> Result<Prepared, FormatError> {
        self.chat_ending(messages, ChatEnding::GenerationPrompt, with_text)
    }

    /// A chat's prompt, ending as `ending` says. Continuing the final message renders the
    /// chat closed and cuts it after the final message's content, as vLLM does.
    pub fn chat_ending(
        &self,
        messages: &[ChatMessage],
        ending: ChatEnding,
        with_text: bool,
    ) -> Result<Prepared, FormatError> {
        let rendered = |template: &ChatTemplate| match ending {
            ChatEnding::ContinueFinal if !messages.is_empty() => continue_final(template, messages),
            _ => template
                .render(messages, ending == ChatEnding::GenerationPrompt)
                .map_err(FormatError),
        };
        match &self.fast {
            Some(format) => {
                let mut tokens = vec![format.bos()];
                for message in messages {
                    self.push_message(format, message, &mut tokens);
                }
                match ending {
                    ChatEnding::GenerationPrompt => {
                        tokens.extend_from_slice(format.generation_prompt())
                    }
                    ChatEnding::Closed => {}
                    ChatEnding::ContinueFinal => {
                        // Every message ends with `<|eot_id|>`: the last one is left open.
                        if tokens.last() == Some(&format.eot()) {
                            tokens.pop();
                        }
                    }
                }
                let text = if with_text {
                    Some(rendered(&self.template)?)
                } else {
                    None
                };
                Ok(Prepared { tokens, text })
            }
            None => {
                let text = rendered(&self.template)?;
                let tokens = self.tokenizer.encode(&text);
                Ok(Prepared {
                    tokens,
                    text: with_text.then_some(text),
                })
            }
        }
    }

    /// Appends one message's tokens, from the cache when it was seen before.
    fn push_message(&self, format: &Llama3Format, message: &ChatMessage, out: &mut Vec<u32>) {
        if message.content.len() < CACHE_MIN_BYTES {
            format.push_message(&self.tokenizer, message, out);
            return;
        }
        let key = MessageCache::key(message);
        let cached = self
            .cache
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .map
            .get(&key)
            .cloned();
        if let Some(tokens) = cached {
            out.extend_from_slice(&tokens);
            return;
        }
        let start = out.len();
        format.push_message(&self.tokenizer, message, out);
        let tokens: Arc<[u32]> = out[start..].into();
        self.cache
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key, tokens);
    }

    /// A completion prompt given as text.
    pub fn text(&self, prompt: &str) -> Vec<u32> {
        self.tokenizer.encode(prompt)
    }
}

/// Ends the final message's content in [`continue_final`]'s rendering: private-use characters
/// no template trims or writes.
const CONTINUE_MARKER: &str = "\u{E000}kvroute-continue\u{E001}";

/// `messages` (at least one) rendered closed and cut right after the final message's trimmed
/// content, where the model continues it. The cut is found by rendering the content with
/// [`CONTINUE_MARKER`] after it: searching for the content itself (vLLM's way) cuts in the
/// wrong place when the content is empty or also occurs in the template's text after it (a
/// final message `|>` matched the `|>` of the closing `<|eot_id|>`). A template that alters
/// the marker falls back to that search.
fn continue_final(
    template: &ChatTemplate,
    messages: &[ChatMessage],
) -> Result<String, FormatError> {
    let mut marked = messages.to_vec();
    if let Some(last) = marked.last_mut() {
        last.content = format!("{}{CONTINUE_MARKER}", last.content.trim_end());
    }
    let text = template.render(&marked, false).map_err(FormatError)?;
    if let Some(at) = text.rfind(CONTINUE_MARKER) {
        return Ok(text[..at].to_string());
    }
    let text = template.render(messages, false).map_err(FormatError)?;
    let content = messages.last().map_or("", |m| m.content.trim());
    Ok(match text.rfind(content).filter(|_| !content.is_empty()) {
        Some(at) => text[..at + content.len()].to_string(),
        None => text,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fast Llama-3 path and the template agree for every ending; a continued final
    /// message is open (its text is the rendered chat's end).
    #[test]
    fn every_chat_ending_matches_the_rendered_template() {
        let p = Preprocessor::builtin();
        let messages = [
            ChatMessage::user("What is prefix caching?"),
            ChatMessage::assistant("Prefix caching keeps"),
        ];
        for ending in [
            ChatEnding::GenerationPrompt,
            ChatEnding::Closed,
            ChatEnding::ContinueFinal,
        ] {
            let prepared = p.chat_ending(&messages, ending, true).unwrap();
            let text = prepared.text.unwrap();
            assert_eq!(prepared.tokens, p.tokenizer().encode(&text), "{ending:?}");
            if ending == ChatEnding::ContinueFinal {
                assert!(text.ends_with("Prefix caching keeps"), "{text}");
            }
        }
    }

    /// Found by fuzzing (`fuzz/fuzz_targets/chat_template.rs`): a continued final message that
    /// is empty, or whose content also occurs in the closing `<|eot_id|>`, was cut in the
    /// wrong place, so the rendered text disagreed with the fast path's (open) tokens.
    #[test]
    fn a_continued_final_message_is_cut_after_its_content_whatever_it_holds() {
        let p = Preprocessor::builtin();
        for last in ["", "   ", "|>", "eot_id|>", "<|eot_id|>", "x  \n"] {
            let messages = [ChatMessage::user("hi"), ChatMessage::assistant(last)];
            let prepared = p
                .chat_ending(&messages, ChatEnding::ContinueFinal, true)
                .unwrap();
            let text = prepared.text.unwrap();
            assert_eq!(prepared.tokens, p.tokenizer().encode(&text), "{last:?}");
            let header = "<|start_header_id|>assistant<|end_header_id|>\n\n";
            assert!(
                text.ends_with(&format!("{header}{}", last.trim())),
                "{last:?}: {text:?}"
            );
        }
    }

    #[test]
    fn fast_path_equals_render_then_encode() {
        let pre = Preprocessor::builtin();
        let messages = vec![
            ChatMessage::system("You explain caches."),
            ChatMessage::user("  What is a prefix cache? "),
            ChatMessage::assistant("A cache of prompt prefixes."),
            ChatMessage::user("And a KV block?"),
        ];
        let prepared = pre.chat(&messages, true).unwrap();
        let text = prepared.text.unwrap();
        assert_eq!(prepared.tokens, pre.tokenizer().encode(&text));
        assert!(text.ends_with("<|start_header_id|>assistant<|end_header_id|>\n\n"));
    }

    #[test]
    fn cached_messages_give_the_same_tokens_and_the_cache_stays_bounded() {
        let pre = Preprocessor::builtin();
        let long = "A long passage about caches. ".repeat(40);
        let turn = |n: usize| {
            let mut messages = vec![ChatMessage::system(long.clone())];
            for i in 0..n {
                messages.push(ChatMessage::user(format!(
                    "question {i} {}",
                    "why? ".repeat(60)
                )));
                messages.push(ChatMessage::assistant(format!(
                    "answer {i} {}",
                    "because. ".repeat(60)
                )));
            }
            messages
        };
        for n in [0, 1, 2, 3, 2] {
            let messages = turn(n);
            let prepared = pre.chat(&messages, true).unwrap();
            assert_eq!(
                prepared.tokens,
                pre.tokenizer().encode(&prepared.text.unwrap()),
                "turn {n}"
            );
        }
        let cache = pre.cache.lock().unwrap();
        assert_eq!(cache.map.len(), 7, "system + 3 questions + 3 answers");
        assert_eq!(
            cache.tokens,
            cache.map.values().map(|t| t.len()).sum::<usize>()
        );
        drop(cache);
        let mut small = MessageCache::default();
        let big: Arc<[u32]> = vec![0; CACHE_MAX_TOKENS / 2 + 1].into();
        small.insert(1, big.clone());
        small.insert(2, big.clone());
        assert_eq!(small.map.len(), 1, "the oldest entry made room");
        assert!(small.map.contains_key(&2));
        assert!(small.tokens <= CACHE_MAX_TOKENS);
    }

    #[test]
    fn a_tokenizer_config_template_is_used() {
        let template = ChatTemplate::from_tokenizer_config(
            r#"{"bos_token": "<s>", "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"}"#,
        )
        .unwrap();
        let pre = Preprocessor::new(Tokenizer::builtin(), template);
        let prepared = pre.chat(&[ChatMessage::user("hi")], true).unwrap();
        assert_eq!(prepared.text.as_deref(), Some("<s>[user] hi\n[assistant] "));
        assert_eq!(
            prepared.tokens,
            pre.tokenizer().encode("<s>[user] hi\n[assistant] ")
        );
    }
}
