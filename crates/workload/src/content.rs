//! How a conversation's [`TurnPlan`]s are written out for a driver: as token ids for the
//! simulator ([`TokenContent`]) or as text for the load generator ([`TextContent`]). Both
//! write the same plans (passage, questions, planned answers): the text form's system message
//! and questions, rendered with the chat template and tokenized with the planned replies as
//! answers, are exactly the token form's prompts (tested in `tests/content.rs`).
//!
//! Workloads B and C (one turn each) are written from [`text::TaskAssets`]: the token form's
//! prompt is the document's or reasoning prompt's pre-rendered prompt (template, instruction,
//! user message, assistant header: the same `Arc` for every request on it), the text form's
//! system message is the instruction and its question the document or prompt.

use std::fmt::Debug;
use std::sync::Arc;

use nanotime::Nanos;
use text::Assets;
use text::tasks::{REASONING_INSTRUCTION, SUMMARY_INSTRUCTION};

use crate::{Ask, Class, TurnPlan, WorkloadConfig};

/// A turn: its conversation (numbered from 0 in order of creation) and its index there (0 =
/// the first turn).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TurnKey {
    pub conversation: u64,
    pub turn: u32,
}

/// A rendering of conversations: what the schedule hands the driver for each turn.
pub trait Content {
    /// What the rendering keeps of one open conversation between its turns.
    type History: Debug + Send;
    /// One turn as the driver sends it.
    type Turn;
    /// The rendering of `config`'s conversations (system prompt, passages in use).
    fn new(assets: Arc<Assets>, config: &WorkloadConfig) -> Self
    where
        Self: Sized;
    /// The shared text assets the plans are drawn from.
    fn assets(&self) -> &Arc<Assets>;
    /// A new conversation about passage `passage`.
    fn open(&self, passage: usize) -> Self::History;
    /// Writes turn `key` out; `history` is then the conversation up to this turn.
    fn turn(
        &self,
        history: &mut Self::History,
        plan: TurnPlan,
        key: TurnKey,
        issued_at: Nanos,
    ) -> Self::Turn;
    /// Tokens of the latest prompt, where this rendering knows them (0 otherwise).
    fn prompt_tokens(history: &Self::History) -> usize;
    /// Tokens of the latest prompt plus its planned reply: what a lock-step turn's new
    /// material is sized on (both renderings know it when [`crate::LockStep`] is on).
    fn history_tokens(history: &Self::History) -> usize;
}

/// The system prompts conversations open with, as `build` makes each: one per group with
/// [`crate::SystemGroups`], else one per passage in use. A group prompt that cannot be built
/// (prevented by `ChatWorkload::with_content`'s checks) is `fallback`.
fn system_prompts<T: Clone>(
    assets: &Assets,
    config: &WorkloadConfig,
    per_passage: impl Fn(usize) -> T,
    per_group: impl Fn(&crate::SystemGroups, usize) -> Option<T>,
    fallback: T,
) -> Vec<T> {
    match &config.system_groups {
        Some(groups) => (0..groups.groups as usize)
            .map(|g| per_group(groups, g).unwrap_or_else(|| fallback.clone()))
            .collect(),
        None => (0..(config.passages as usize).min(assets.corpus().len()))
            .map(per_passage)
            .collect(),
    }
}

/// One request to serve, in token ids (the simulator's form).
#[derive(Clone, Debug)]
pub struct Turn {
    pub key: TurnKey,
    /// The templated history plus the new question and the assistant header: starts with the
    /// previous turn's `prompt` followed by its `output`.
    pub prompt: Arc<[u32]>,
    /// The planned reply: an engine generates exactly these tokens, so the next turn's prompt
    /// (which contains them) hits the blocks cached during decode.
    pub output: Arc<[u32]>,
    /// When the simulated user sent it (the start of TTFT and E2E).
    pub issued_at: Nanos,
}

/// Writes turns as token ids, building each prompt from the previous one: the previous prompt,
/// its reply, `<|eot_id|>`, the new user message and the assistant header, equal to
/// tokenizing the rendered conversation. Per turn: the question's pre-tokenized pieces and one
/// copy of the prompt; passages' tokens are shared by all conversations.
#[derive(Debug)]
pub struct TokenContent {
    assets: Arc<Assets>,
    /// Per passage in use: `<|begin_of_text|>` + system message.
    prefixes: Vec<Arc<[u32]>>,
}

/// A conversation in tokens: its last prompt and planned reply.
#[derive(Debug, Clone)]
pub struct TokenHistory {
    passage: usize,
    prompt: Option<Arc<[u32]>>,
    reply: Option<Arc<[u32]>>,
}

impl TokenHistory {
    /// The latest prompt (`None` before the first turn).
    pub fn prompt(&self) -> Option<&Arc<[u32]>> {
        self.prompt.as_ref()
    }

    /// The latest planned reply.
    pub fn reply(&self) -> Option<&Arc<[u32]>> {
        self.reply.as_ref()
    }
}

impl Content for TokenContent {
    type History = TokenHistory;
    type Turn = Turn;

    fn new(assets: Arc<Assets>, config: &WorkloadConfig) -> TokenContent {
        let prefixes = system_prompts(
            &assets,
            config,
            |p| assets.prefix(&config.system_prompt, p),
            |groups, g| groups.prefix(&assets, config, g).ok(),
            Arc::from(Vec::new()),
        );
        TokenContent { assets, prefixes }
    }

    fn assets(&self) -> &Arc<Assets> {
        &self.assets
    }

    fn open(&self, passage: usize) -> TokenHistory {
        TokenHistory {
            passage,
            prompt: None,
            reply: None,
        }
    }

    fn turn(
        &self,
        history: &mut TokenHistory,
        plan: TurnPlan,
        key: TurnKey,
        issued_at: Nanos,
    ) -> Turn {
        let mut user = Vec::with_capacity(96);
        match plan.ask {
            Ask::Chat(question) => self.assets.push_user_question(&question, &mut user),
            Ask::NewMaterial(ref material) => self.assets.push_user_ids(material, &mut user),
            Ask::Summarise {
                document: i,
                request: Some(request),
            } => {
                let prompt = self
                    .assets
                    .tasks()
                    .ok()
                    .and_then(|t| t.document_prompt_for(i, request, self.assets.tokenizer()))
                    .unwrap_or_else(|| Arc::from(Vec::new()));
                history.prompt = Some(prompt.clone());
                history.reply = Some(plan.reply.ids.clone());
                return Turn {
                    key,
                    prompt,
                    output: plan.reply.ids,
                    issued_at,
                };
            }
            Ask::Summarise {
                document: i,
                request: None,
            }
            | Ask::Reason(i) => {
                // Built when the workload was (`ChatWorkload::with_content` checks), so this
                // lookup cannot fail; an empty prompt would be refused by any server.
                let tasks = self.assets.tasks().ok();
                let prompt = tasks
                    .and_then(|t| match plan.ask {
                        Ask::Summarise { .. } => t.document_prompt(i),
                        _ => t.reasoning_prompt(i),
                    })
                    .cloned()
                    .unwrap_or_else(|| Arc::from(Vec::new()));
                history.prompt = Some(prompt.clone());
                history.reply = Some(plan.reply.ids.clone());
                return Turn {
                    key,
                    prompt,
                    output: plan.reply.ids,
                    issued_at,
                };
            }
        };
        let format = self.assets.format();
        let generation = format.generation_prompt();
        let eot = [format.eot()];
        // Slices are copied with memcpy into one buffer (an iterator chain of elements was
        // a third of the turn's cost), then once into the shared allocation.
        let parts: [&[u32]; 5] = match (&history.prompt, &history.reply) {
            (Some(prompt), Some(previous)) => [prompt, previous, &eot, &user, generation],
            _ => [
                self.prefixes
                    .get(history.passage)
                    .map_or(&[][..], |p| &p[..]),
                &user,
                generation,
                &[],
                &[],
            ],
        };
        let mut ids = Vec::with_capacity(parts.iter().map(|p| p.len()).sum());
        for part in parts {
            ids.extend_from_slice(part);
        }
        let prompt: Arc<[u32]> = ids.into();
        history.prompt = Some(prompt.clone());
        history.reply = Some(plan.reply.ids.clone());
        Turn {
            key,
            prompt,
            output: plan.reply.ids,
            issued_at,
        }
    }

    fn prompt_tokens(history: &TokenHistory) -> usize {
        history.prompt.as_ref().map_or(0, |p| p.len())
    }

    fn history_tokens(history: &TokenHistory) -> usize {
        Self::prompt_tokens(history) + history.reply.as_ref().map_or(0, |r| r.len())
    }
}

/// One request to send, in text (the load generator's form). The driver keeps the
/// conversation's earlier questions and the answers it actually received, and sends them as
/// the history before `question`.
#[derive(Clone, Debug)]
pub struct TextTurn {
    pub key: TurnKey,
    /// Which workload the turn belongs to (its conversation's class).
    pub class: Class,
    /// The system message: instruction + passage, shared by every conversation on it.
    pub system: Arc<str>,
    /// The user's question.
    pub question: Arc<str>,
    /// The planned reply's ids: ask for `planned_reply.len()` tokens. Its text
    /// (`tokenizer.decode`) is what the simulator's engine answers.
    pub planned_reply: Arc<[u32]>,
    /// When the simulated user sent it.
    pub issued_at: Nanos,
}

/// Writes turns as text: the system message and the questions whose tokenization the token
/// form assembles. With [`crate::LockStep`] it also keeps the token form's history, whose
/// length sizes the next turn's new material exactly as in the simulator.
#[derive(Debug)]
pub struct TextContent {
    assets: Arc<Assets>,
    /// Per passage in use (or per group): the system message's text.
    systems: Vec<Arc<str>>,
    /// The token rendering, kept only for lock-step conversations.
    tokens: Option<TokenContent>,
}

/// A conversation in text form: the driver keeps the text history (with real answers).
#[derive(Debug)]
pub struct TextHistory {
    /// The system prompt's index (passage or group).
    system: usize,
    /// The token form's history, with [`crate::LockStep`] only.
    tokens: Option<TokenHistory>,
}

impl Content for TextContent {
    type History = TextHistory;
    type Turn = TextTurn;

    fn new(assets: Arc<Assets>, config: &WorkloadConfig) -> TextContent {
        let systems = system_prompts(
            &assets,
            config,
            |p| {
                assets
                    .system_message(&config.system_prompt, p)
                    .content
                    .into()
            },
            |groups, g| {
                groups
                    .system_message(&assets, config, g)
                    .ok()
                    .map(|m| m.content.into())
            },
            "".into(),
        );
        let tokens = config
            .lockstep
            .is_some()
            .then(|| TokenContent::new(assets.clone(), config));
        TextContent {
            assets,
            systems,
            tokens,
        }
    }

    fn assets(&self) -> &Arc<Assets> {
        &self.assets
    }

    fn open(&self, system: usize) -> TextHistory {
        TextHistory {
            system,
            tokens: self.tokens.as_ref().map(|t| t.open(system)),
        }
    }

    fn turn(
        &self,
        history: &mut TextHistory,
        plan: TurnPlan,
        key: TurnKey,
        issued_at: Nanos,
    ) -> TextTurn {
        if let (Some(tokens), Some(h)) = (&self.tokens, &mut history.tokens) {
            tokens.turn(h, plan.clone(), key, issued_at);
        }
        let tasks = || self.assets.tasks().ok();
        let system_of_conversation = || {
            self.systems
                .get(history.system)
                .cloned()
                .unwrap_or_else(|| "".into())
        };
        let (class, system, question) = match plan.ask {
            Ask::Chat(question) => (
                Class::A,
                system_of_conversation(),
                self.assets.questions().text(&question).into(),
            ),
            Ask::NewMaterial(ref material) => (
                Class::A,
                system_of_conversation(),
                self.assets.tokenizer().decode_lossy(material).into(),
            ),
            Ask::Summarise {
                document: i,
                request,
            } => {
                let document = tasks()
                    .and_then(|t| t.document_text(i).cloned())
                    .unwrap_or_else(|| "".into());
                let question = match request {
                    Some(r) => format!("{}{document}", text::TaskAssets::request_line(r)).into(),
                    None => document,
                };
                (Class::B, SUMMARY_INSTRUCTION.into(), question)
            }
            Ask::Reason(i) => (
                Class::C,
                REASONING_INSTRUCTION.into(),
                tasks()
                    .and_then(|t| t.reasoning_text(i).cloned())
                    .unwrap_or_else(|| "".into()),
            ),
        };
        TextTurn {
            key,
            class,
            system,
            question,
            planned_reply: plan.reply.ids,
            issued_at,
        }
    }

    fn prompt_tokens(history: &TextHistory) -> usize {
        history
            .tokens
            .as_ref()
            .map_or(0, TokenContent::prompt_tokens)
    }

    fn history_tokens(history: &TextHistory) -> usize {
        history
            .tokens
            .as_ref()
            .map_or(0, TokenContent::history_tokens)
    }
}
