//! Incremental tokenization of a Llama-3 chat: append a message, never re-tokenize the history.

use std::sync::Arc;

use crate::tokenizer::{BEGIN_OF_TEXT, END_HEADER_ID, EOT_ID, START_HEADER_ID};
use crate::{ChatMessage, TextError, Tokenizer};

/// The token-level pieces of the built-in Llama-3 format (see [`crate::ChatTemplate::llama3`])
/// for one tokenizer.
///
/// Why appending works: the tokenizer first splits text at special tokens and encodes the
/// pieces between them on their own, and every rendered message ends with `<|eot_id|>`. So the
/// tokens of a rendered conversation are the concatenation of each message's tokens. The one
/// place where ordinary text continues across an append is the generation prompt's `\n\n`
/// followed by an assistant reply; that is safe because the template trims the reply, so it
/// starts with a non-space character and the pre-tokenizer always ends a piece after `\n\n`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Llama3Format {
    bos: u32,
    start_header: u32,
    end_header: u32,
    eot: u32,
    /// `<|start_header_id|>assistant<|end_header_id|>\n\n`.
    generation_prompt: Vec<u32>,
}

impl Llama3Format {
    /// Fails if the tokenizer lacks the Llama-3 specials (`<|begin_of_text|>`,
    /// `<|start_header_id|>`, `<|end_header_id|>`, `<|eot_id|>`).
    pub fn new(tokenizer: &Tokenizer) -> Result<Self, TextError> {
        let special = |t: &'static str| tokenizer.token_id(t).ok_or(TextError::MissingSpecial(t));
        let bos = special(BEGIN_OF_TEXT)?;
        let start_header = special(START_HEADER_ID)?;
        let end_header = special(END_HEADER_ID)?;
        let eot = special(EOT_ID)?;
        let generation_prompt =
            tokenizer.encode(&format!("{START_HEADER_ID}assistant{END_HEADER_ID}\n\n"));
        Ok(Llama3Format {
            bos,
            start_header,
            end_header,
            eot,
            generation_prompt,
        })
    }

    /// `<|begin_of_text|>`, the first token of every conversation.
    pub fn bos(&self) -> u32 {
        self.bos
    }

    /// `<|start_header_id|>`, the first token of every message.
    pub fn start_header(&self) -> u32 {
        self.start_header
    }

    /// `<|end_header_id|>`, after a message's role.
    pub fn end_header(&self) -> u32 {
        self.end_header
    }

    /// The messages of a conversation's token ids in this format (the inverse of
    /// [`Llama3Format::push_conversation`], up to the trimming of content). An open generation
    /// prompt at the end becomes an assistant message with the text generated so far.
    pub fn parse(&self, tokenizer: &Tokenizer, ids: &[u32]) -> Vec<ChatMessage> {
        let mut messages = Vec::new();
        let mut rest = ids;
        while let Some(start) = rest.iter().position(|&t| t == self.start_header) {
            rest = &rest[start + 1..];
            let Some(role_end) = rest.iter().position(|&t| t == self.end_header) else {
                break;
            };
            let role = tokenizer.decode_lossy(&rest[..role_end]);
            rest = &rest[role_end + 1..];
            let content_end = rest
                .iter()
                .position(|&t| t == self.eot)
                .unwrap_or(rest.len());
            let content = tokenizer.decode_lossy(&rest[..content_end]);
            let content = content.strip_prefix("\n\n").unwrap_or(&content).to_owned();
            messages.push(ChatMessage { role, content });
            rest = rest.get(content_end + 1..).unwrap_or(&[]);
        }
        messages
    }

    /// `<|eot_id|>`, the last token of every message.
    pub fn eot(&self) -> u32 {
        self.eot
    }

    /// The tokens of the assistant header that ends a prompt (`add_generation_prompt`).
    pub fn generation_prompt(&self) -> &[u32] {
        &self.generation_prompt
    }

    /// Appends one rendered message: header, trimmed content, `<|eot_id|>`. Cost: one encode of
    /// this message only.
    pub fn push_message(&self, tokenizer: &Tokenizer, message: &ChatMessage, out: &mut Vec<u32>) {
        let text = format!(
            "{START_HEADER_ID}{}{END_HEADER_ID}\n\n{}{EOT_ID}",
            message.role,
            message.content.trim()
        );
        out.extend(tokenizer.encode(&text));
    }

    /// Appends the tokens of a whole conversation rendered by the built-in template.
    pub fn push_conversation(
        &self,
        tokenizer: &Tokenizer,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        out: &mut Vec<u32>,
    ) {
        out.push(self.bos);
        for m in messages {
            self.push_message(tokenizer, m, out);
        }
        if add_generation_prompt {
            out.extend_from_slice(&self.generation_prompt);
        }
    }
}

/// A conversation's token ids under the built-in Llama-3 template, grown one message at a time.
///
/// Invariant: [`ChatTokens::ids`] always equals
/// `tokenizer.encode(ChatTemplate::llama3().render(messages, generation_prompt_open))` for the
/// messages pushed so far, where `generation_prompt_open` is whether the last call was
/// [`ChatTokens::push_generation_prompt`]. Normalisation: like the template, message content is
/// trimmed of leading and trailing whitespace (Rust's `str::trim`, Unicode White_Space).
///
/// ```
/// use text::{ChatMessage, ChatTemplate, ChatTokens, Tokenizer};
/// let tokenizer = Tokenizer::builtin();
/// let mut chat = ChatTokens::new(tokenizer.clone()).unwrap();
/// chat.push(&ChatMessage::user("What is prefix caching?"));
/// chat.push_generation_prompt();
/// let full = ChatTemplate::llama3()
///     .render(&[ChatMessage::user("What is prefix caching?")], true)
///     .unwrap();
/// assert_eq!(chat.ids(), tokenizer.encode(&full).as_slice());
/// ```
#[derive(Clone, Debug)]
pub struct ChatTokens {
    tokenizer: Arc<Tokenizer>,
    format: Llama3Format,
    ids: Vec<u32>,
    /// Where the open generation prompt starts, if the ids end with one.
    generation_prompt_at: Option<usize>,
}

impl ChatTokens {
    /// An empty conversation: just `<|begin_of_text|>`.
    pub fn new(tokenizer: Arc<Tokenizer>) -> Result<Self, TextError> {
        let format = Llama3Format::new(&tokenizer)?;
        let ids = vec![format.bos()];
        Ok(ChatTokens {
            tokenizer,
            format,
            ids,
            generation_prompt_at: None,
        })
    }

    /// Appends a message. An open generation prompt is removed first (the template only writes
    /// it at the end); for an assistant message it is rewritten identically as its header.
    pub fn push(&mut self, message: &ChatMessage) {
        // The open header is a prefix of an assistant message's own tokens (specials separate
        // it from the content), so dropping and re-encoding it is exact for every role.
        if let Some(at) = self.generation_prompt_at.take() {
            self.ids.truncate(at);
        }
        self.format
            .push_message(&self.tokenizer, message, &mut self.ids);
    }

    /// Ends the ids with the assistant header (`add_generation_prompt = true`). Idempotent.
    pub fn push_generation_prompt(&mut self) {
        if self.generation_prompt_at.is_none() {
            self.generation_prompt_at = Some(self.ids.len());
            self.ids.extend_from_slice(&self.format.generation_prompt);
        }
    }

    /// Appends an assistant message given as its content's token ids (a generated reply),
    /// opening the generation prompt first if needed, then `<|eot_id|>`.
    ///
    /// Equals [`ChatTokens::push`] of the decoded text when the ids are the canonical
    /// encoding of a trimmed text (`encode(decode(ids)) == ids`, first and last character not
    /// whitespace), which [`crate::ReplyGenerator`] guarantees. Other ids are appended as
    /// given, as a real engine's output would be.
    pub fn push_assistant_ids(&mut self, ids: &[u32]) {
        self.push_generation_prompt();
        self.generation_prompt_at = None;
        self.ids.extend_from_slice(ids);
        self.ids.push(self.format.eot());
    }

    /// The conversation's token ids so far.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Never true: a conversation always holds `<|begin_of_text|>`.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    pub fn into_ids(self) -> Vec<u32> {
        self.ids
    }

    /// The format's token pieces, for callers that assemble prompts themselves.
    pub fn format(&self) -> &Llama3Format {
        &self.format
    }
}
