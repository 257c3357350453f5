//! Text for kvroute: tokenizer, chat template, the shipped corpus, and generators of replies
//! and questions for simulated conversations.
//!
//! - [`Tokenizer`]: the built-in tokenizer is OpenAI's cl100k_base BPE (embedded, never
//!   downloaded) extended with the Llama-3 chat specials; a Hugging Face `tokenizer.json` is
//!   supported with the `hf` feature.
//! - [`ChatTemplate`]: Jinja chat templates (minijinja): the built-in Llama-3 instruct format or
//!   a `tokenizer_config.json`'s `chat_template`.
//! - [`ChatTokens`]: a conversation's prompt tokens grown one message at a time, equal to
//!   tokenizing the whole rendered conversation, without re-tokenizing its history.
//! - [`Corpus`]: ten technical passages (`corpus/passage-NN.md`) that start conversations;
//!   [`KeyTerms`] their distinctive terms.
//! - [`ReplyGenerator`]: replies of an exact token length whose tokens survive decode +
//!   re-encode, so a simulated engine's output is a prefix-cache hit in the next turn, as a
//!   real model's is. [`QuestionGenerator`]: a simulated user's follow-up questions.
//! - [`Assets`]: all of the above built once per process ([`Assets::builtin`]) and shared by
//!   the workload (both its token and its text form), the simulator and the engine simulator.
//! - [`tasks`]: the corpora of seed 004's workloads B (summarisation documents in three
//!   length buckets, composed from original sections) and C (a reasoning prompt bank);
//!   [`TaskAssets`] their prompts in text and tokens, built on first use.
//! - [`Preprocessor`]: a server's per-request chat template + tokenization, with a bounded
//!   cache of recently seen messages (the gateway's preprocessing).
//!
//! **Architecture invariant:** no I/O, no clock, no threads. Data is embedded at compile time
//! (`include_str!`); randomness comes from the caller's seeded RNG, so output is a pure function
//! of the inputs.
//!
//! The built-in template renders `<|begin_of_text|>`, then per message
//! `<|start_header_id|>ROLE<|end_header_id|>\n\nCONTENT<|eot_id|>` with CONTENT trimmed, then
//! `<|start_header_id|>assistant<|end_header_id|>\n\n` when a generation prompt is asked for.
//!
//! ```
//! use rand::SeedableRng;
//! use text::{ChatMessage, ChatTokens, Corpus, KeyTerms, ReplyConfig, ReplyGenerator, Tokenizer};
//!
//! let tokenizer = Tokenizer::builtin();
//! let corpus = Corpus::builtin();
//! let terms = KeyTerms::extract(&corpus);
//! let replies = ReplyGenerator::new(&tokenizer, &corpus, &terms, &ReplyConfig::default()).unwrap();
//!
//! let mut chat = ChatTokens::new(tokenizer.clone()).unwrap();
//! chat.push(&ChatMessage::system(corpus.passages()[0].markdown()));
//! chat.push(&ChatMessage::user("Explain the key ideas."));
//! chat.push_generation_prompt();
//! let prompt = chat.ids().to_vec();
//!
//! let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
//! let reply = replies.generate(0, 100, &mut rng).unwrap();
//! assert_eq!(reply.ids.len(), 100);
//! let text = tokenizer.decode(&reply.ids).unwrap();
//! assert_eq!(tokenizer.encode(&text), reply.ids.to_vec());
//!
//! // The reply becomes history; the next prompt starts with this turn's prompt + reply.
//! chat.push_assistant_ids(&reply.ids);
//! assert!(chat.ids().starts_with(&prompt));
//! ```

mod assets;
mod chat_tokens;
mod corpus;
mod preprocess;
mod question;
mod reply;
pub mod tasks;
mod template;
mod tokenizer;

pub use assets::{Assets, DEFAULT_SYSTEM_PROMPT, TaskAssets};
pub use chat_tokens::{ChatTokens, Llama3Format};
pub use corpus::{Corpus, KeyTerms, Passage, Term};
pub use preprocess::{ChatEnding, FormatError, Prepared, Preprocessor};
pub use question::{QuestionGenerator, QuestionPlan};
pub use reply::{Reply, ReplyConfig, ReplyGenerator};
pub use template::{ChatMessage, ChatTemplate, TemplateError, fuel_for};
pub use tokenizer::{BEGIN_OF_TEXT, END_HEADER_ID, EOT_ID, START_HEADER_ID, Tokenizer};

/// Errors of this crate. Messages say what was wrong with the input.
#[derive(Debug, thiserror::Error)]
pub enum TextError {
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("token id {0} is not in the vocabulary")]
    UnknownToken(u32),
    #[error("the token ids cut a UTF-8 character in two")]
    InvalidUtf8,
    #[error("the tokenizer has no {0} token, which the Llama-3 chat format needs")]
    MissingSpecial(&'static str),
    #[error("corpus: {0}")]
    Corpus(String),
    #[error("passage {index} does not exist (the corpus has {count})")]
    UnknownPassage { index: usize, count: usize },
    #[error(
        "a reply of {requested} tokens is longer than the generator's maximum of {max} (raise ReplyConfig::stream_tokens)"
    )]
    ReplyTooLong { requested: usize, max: usize },
    #[error(transparent)]
    Template(#[from] TemplateError),
}
