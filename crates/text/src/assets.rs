//! Everything that turns a conversation's plan into text or tokens and does not change between
//! runs: built once per process and shared by the simulator, the load generator and the
//! engine simulator.

use std::sync::{Arc, OnceLock};

use crate::tasks::{DocumentCorpus, REASONING_INSTRUCTION, ReasoningBank, SUMMARY_INSTRUCTION};
use crate::{
    ChatMessage, ChatTemplate, Corpus, END_HEADER_ID, KeyTerms, Llama3Format, QuestionGenerator,
    QuestionPlan, ReplyConfig, ReplyGenerator, START_HEADER_ID, TextError, Tokenizer,
};

/// The instruction put before each passage in a chat conversation's system message (the
/// passage follows after a blank line).
pub const DEFAULT_SYSTEM_PROMPT: &str = "You are a knowledgeable assistant for engineers who run large language model inference in production. The user is studying the reference text below and will ask you questions about it. Answer in detail, with concrete numbers and examples where the text gives them.";

/// Tokenizer, chat template, corpus, the passages' system-message tokens, and the reply and
/// question generators. Immutable and `Send + Sync`: build once (about a second), share through
/// an [`Arc`] across runs and threads.
pub struct Assets {
    tokenizer: Arc<Tokenizer>,
    template: ChatTemplate,
    format: Llama3Format,
    corpus: Corpus,
    replies: ReplyGenerator,
    questions: QuestionGenerator,
    /// Per passage: `<|begin_of_text|>` + the system message (default system prompt +
    /// passage), shared by every conversation that uses it.
    default_prefixes: Vec<Arc<[u32]>>,
    /// `<|start_header_id|>user<|end_header_id|>\n\n`: a user message's tokens are these, the
    /// question's, then `<|eot_id|>`.
    user_header: Vec<u32>,
    /// Workloads B and C's corpora and prompts, built on first use.
    tasks: OnceLock<Arc<TaskAssets>>,
}

/// Workloads B and C's corpora and their prompts, in text and in tokens: built once on first
/// use ([`Assets::tasks`]; tokenizing the documents takes a moment), shared by the simulator and
/// the load generator.
pub struct TaskAssets {
    documents: DocumentCorpus,
    bank: ReasoningBank,
    /// Per document: `<|begin_of_text|>` + system ([`SUMMARY_INSTRUCTION`]) + user (the
    /// document) + the assistant header.
    document_prompts: Vec<Arc<[u32]>>,
    /// Per reasoning prompt: the same with [`REASONING_INSTRUCTION`].
    reasoning_prompts: Vec<Arc<[u32]>>,
    document_texts: Vec<Arc<str>>,
    reasoning_texts: Vec<Arc<str>>,
    /// Where the document starts in every document prompt: after `<|begin_of_text|>`, the
    /// system message and the user header (whose `\n\n` stays a token of its own).
    document_start: usize,
}

impl std::fmt::Debug for TaskAssets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TaskAssets")
            .field("documents", &self.documents.len())
            .field("reasoning_prompts", &self.bank.len())
            .finish()
    }
}

impl TaskAssets {
    fn build(assets: &Assets) -> Result<TaskAssets, TextError> {
        let documents = DocumentCorpus::builtin(&assets.tokenizer)?;
        let mut head = vec![assets.format.bos()];
        assets.format.push_message(
            &assets.tokenizer,
            &ChatMessage::system(SUMMARY_INSTRUCTION),
            &mut head,
        );
        let document_start = head.len() + assets.user_header.len();
        let bank = ReasoningBank::builtin()?;
        let render = |system: &str, user: &str| -> Arc<[u32]> {
            let mut ids = vec![assets.format.bos()];
            let format = &assets.format;
            format.push_message(&assets.tokenizer, &ChatMessage::system(system), &mut ids);
            format.push_message(&assets.tokenizer, &ChatMessage::user(user), &mut ids);
            ids.extend_from_slice(format.generation_prompt());
            ids.into()
        };
        Ok(TaskAssets {
            document_prompts: documents
                .documents()
                .iter()
                .map(|d| render(SUMMARY_INSTRUCTION, &d.markdown))
                .collect(),
            reasoning_prompts: bank
                .prompts()
                .iter()
                .map(|p| render(REASONING_INSTRUCTION, &p.prompt))
                .collect(),
            document_texts: documents
                .documents()
                .iter()
                .map(|d| Arc::from(d.markdown.as_str()))
                .collect(),
            reasoning_texts: bank
                .prompts()
                .iter()
                .map(|p| Arc::from(p.prompt.as_str()))
                .collect(),
            documents,
            bank,
            document_start,
        })
    }

    /// The first line [`Self::document_prompt_for`] puts before document text for request
    /// `request`.
    pub fn request_line(request: u64) -> String {
        format!("Request {request}: please summarise the briefing below.\n\n")
    }

    /// Document `i`'s prompt for request `request`: the user message starts with
    /// [`Self::request_line`], so that no two requests share a block beyond the template and
    /// the instruction, even on the same document (a summarisation service rarely sees one
    /// document twice). Equal to rendering `request_line(request) + document_text(i)` after
    /// [`SUMMARY_INSTRUCTION`] and tokenizing it (tested); costs one copy of the prompt.
    pub fn document_prompt_for(
        &self,
        i: usize,
        request: u64,
        tokenizer: &Tokenizer,
    ) -> Option<Arc<[u32]>> {
        let prompt = self.document_prompts.get(i)?;
        let (head, tail) = prompt.split_at(self.document_start.min(prompt.len()));
        let line = tokenizer.encode_ordinary(&Self::request_line(request));
        let mut ids = Vec::with_capacity(prompt.len() + line.len());
        ids.extend_from_slice(head);
        ids.extend_from_slice(&line);
        ids.extend_from_slice(tail);
        Some(ids.into())
    }

    pub fn documents(&self) -> &DocumentCorpus {
        &self.documents
    }

    pub fn bank(&self) -> &ReasoningBank {
        &self.bank
    }

    /// Document `i`'s whole prompt in token ids (template, instruction, document, assistant
    /// header): equal to rendering [`Self::document_text`] after [`SUMMARY_INSTRUCTION`] with
    /// the chat template and tokenizing it.
    pub fn document_prompt(&self, i: usize) -> Option<&Arc<[u32]>> {
        self.document_prompts.get(i)
    }

    /// Document `i` as the user message's text.
    pub fn document_text(&self, i: usize) -> Option<&Arc<str>> {
        self.document_texts.get(i)
    }

    /// Reasoning prompt `i`'s whole prompt in token ids (see [`Self::document_prompt`]).
    pub fn reasoning_prompt(&self, i: usize) -> Option<&Arc<[u32]>> {
        self.reasoning_prompts.get(i)
    }

    /// Reasoning prompt `i` as the user message's text.
    pub fn reasoning_text(&self, i: usize) -> Option<&Arc<str>> {
        self.reasoning_texts.get(i)
    }
}

impl std::fmt::Debug for Assets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Assets")
            .field("tokenizer", &self.tokenizer.name())
            .field("passages", &self.corpus.len())
            .field("replies", &self.replies)
            .finish()
    }
}

impl Assets {
    /// The built-in assets: cl100k+Llama-3 tokenizer, Llama-3 template, the shipped corpus.
    /// Built on first use and kept for the process.
    pub fn builtin() -> Result<Arc<Assets>, TextError> {
        static BUILTIN: OnceLock<Arc<Assets>> = OnceLock::new();
        if let Some(assets) = BUILTIN.get() {
            return Ok(assets.clone());
        }
        // Two threads may both build on first use; the first stored wins, both are equal.
        let built = Assets::new(
            Tokenizer::builtin(),
            Corpus::builtin(),
            &ReplyConfig::default(),
        )?;
        Ok(BUILTIN.get_or_init(|| Arc::new(built)).clone())
    }

    /// Assets for another corpus (the tokenizer must have the Llama-3 chat specials).
    pub fn new(
        tokenizer: Arc<Tokenizer>,
        corpus: Corpus,
        reply_config: &ReplyConfig,
    ) -> Result<Assets, TextError> {
        let format = Llama3Format::new(&tokenizer)?;
        let terms = KeyTerms::extract(&corpus);
        let replies = ReplyGenerator::new(&tokenizer, &corpus, &terms, reply_config)?;
        let mut me = Assets {
            template: ChatTemplate::llama3(),
            format,
            replies,
            questions: QuestionGenerator::new(terms, &tokenizer),
            user_header: tokenizer.encode(&format!("{START_HEADER_ID}user{END_HEADER_ID}\n\n")),
            default_prefixes: Vec::new(),
            tasks: OnceLock::new(),
            tokenizer,
            corpus,
        };
        me.default_prefixes = (0..me.corpus.len())
            .map(|p| me.encode_prefix(DEFAULT_SYSTEM_PROMPT, p))
            .collect();
        Ok(me)
    }

    /// `<|begin_of_text|>` + the system message of passage `passage` after `system_prompt`:
    /// the part of every prompt that conversations on this passage share.
    pub fn prefix(&self, system_prompt: &str, passage: usize) -> Arc<[u32]> {
        if system_prompt == DEFAULT_SYSTEM_PROMPT {
            if let Some(p) = self.default_prefixes.get(passage) {
                return p.clone();
            }
        }
        self.encode_prefix(system_prompt, passage)
    }

    fn encode_prefix(&self, system_prompt: &str, passage: usize) -> Arc<[u32]> {
        let mut ids = vec![self.format.bos()];
        self.format.push_message(
            &self.tokenizer,
            &self.system_message(system_prompt, passage),
            &mut ids,
        );
        ids.into()
    }

    /// The system message that carries passage `passage`.
    pub fn system_message(&self, system_prompt: &str, passage: usize) -> ChatMessage {
        let markdown = self
            .corpus
            .passages()
            .get(passage)
            .map_or("", |p| p.markdown());
        ChatMessage::system(format!("{system_prompt}\n\n{markdown}"))
    }

    /// Appends the tokens of a user message asking `question`: the same as encoding the
    /// rendered message (the question starts with a letter, so the header's `\n\n` stays a
    /// piece of its own), assembled from pre-tokenized parts.
    pub fn push_user_question(&self, question: &QuestionPlan, out: &mut Vec<u32>) {
        out.extend_from_slice(&self.user_header);
        self.questions.push_tokens(question, out);
        out.push(self.format.eot());
    }

    /// Appends the tokens of a user message whose content is `ids`: text that tokenizes back
    /// to itself and starts with a letter (the reply generator's), so the message encodes to
    /// exactly these tokens, as [`Assets::push_user_question`]'s.
    pub fn push_user_ids(&self, ids: &[u32], out: &mut Vec<u32>) {
        out.extend_from_slice(&self.user_header);
        out.extend_from_slice(ids);
        out.push(self.format.eot());
    }

    /// Workloads B and C's documents and prompts, built on first use (two threads may both
    /// build; the first stored wins, both are equal).
    pub fn tasks(&self) -> Result<&Arc<TaskAssets>, TextError> {
        if let Some(tasks) = self.tasks.get() {
            return Ok(tasks);
        }
        let built = Arc::new(TaskAssets::build(self)?);
        Ok(self.tasks.get_or_init(|| built))
    }

    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    pub fn template(&self) -> &ChatTemplate {
        &self.template
    }

    pub fn format(&self) -> &Llama3Format {
        &self.format
    }

    pub fn corpus(&self) -> &Corpus {
        &self.corpus
    }

    pub fn replies(&self) -> &ReplyGenerator {
        &self.replies
    }

    pub fn questions(&self) -> &QuestionGenerator {
        &self.questions
    }
}
