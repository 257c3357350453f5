//! The corpora of seed 004's single-turn workloads: **B** (summarisation: a long document and
//! a short answer, prefill-heavy) and **C** (reasoning: a short prompt and a long answer,
//! decode-heavy). Original text, embedded at compile time like the chat passages.
//!
//! **Documents (B).** Writing thirty documents of up to 18,000 tokens by hand is not
//! feasible, so `corpus/summarisation/sections-*.md` holds twenty original sections (business
//! reporting, ecology, history, narrative, engineering, science; 230–300 words, about 300–400
//! tokens each), and [`DocumentCorpus::builtin`] composes [`DocumentCorpus::PER_BUCKET`]
//! documents per [`LengthBucket`] (short ≈ 4k, medium ≈ 10k, long ≈ 18k tokens, seed 004's
//! `/short/`, `/medium/`, `/long/`) deterministically:
//! - document `d` (0–29, bucket-major) opens with its own heading, `# Briefing DD: TITLE`, and
//!   a reference line naming its bucket and number, so any two documents differ within their
//!   first few tokens: after the shared chat template and instruction, no two B prompts share
//!   a 32-token block, as in a real summarisation workload (tested);
//! - then sections in an order shuffled by ChaCha8 seeded with `d` (reshuffled each time the
//!   twenty are used up: the long documents use each section two or three times, each time
//!   under a new number), each `## N. Heading` + its paragraphs, while the document is short of
//!   its bucket's target by more than half the next section.
//!
//! A B request may put its own first line before the document
//! ([`crate::TaskAssets::request_line`], the workload's default) so that two requests on one
//! document share nothing past the template and the instruction.
//!
//! Section lengths are measured once with the tokenizer; the composed documents' lengths are
//! measured with the real tokenizer in `tests/tasks.rs` (bucket means within 5% of the target).
//!
//! **Reasoning prompts (C).** `corpus/reasoning/prompts.jsonl`: 64 original prompts, one JSON
//! object a line, `{id, category, expected_output_length, prompt}` (seed 004's fields; the
//! prompt token count is computed, not stored). Categories: explain, implement, compare, math,
//! plan, analysis; expected answers 1,200–4,000 tokens.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::{TextError, Tokenizer};

/// The instruction (system message) of every summarisation request.
pub const SUMMARY_INSTRUCTION: &str = "You are an analyst who writes concise summaries. The user sends one document. Summarise it in one to three short paragraphs: its subject, its main findings or events, and any figures that matter. Do not add information that the document does not contain.";

/// The instruction (system message) of every reasoning request.
pub const REASONING_INSTRUCTION: &str = "You are a careful assistant. Think through the problem step by step, show your work, and finish with a clear answer or a complete implementation.";

/// Seed 004's three document lengths.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LengthBucket {
    Short,
    Medium,
    Long,
}

impl LengthBucket {
    pub const ALL: [LengthBucket; 3] = [
        LengthBucket::Short,
        LengthBucket::Medium,
        LengthBucket::Long,
    ];

    /// The document length this bucket aims at, in tokens of the built-in tokenizer.
    pub fn target_tokens(self) -> usize {
        match self {
            LengthBucket::Short => 4_000,
            LengthBucket::Medium => 10_000,
            LengthBucket::Long => 18_000,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            LengthBucket::Short => "short",
            LengthBucket::Medium => "medium",
            LengthBucket::Long => "long",
        }
    }
}

/// One document to summarise.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Document {
    /// `short-01` … `long-10`.
    pub id: String,
    pub bucket: LengthBucket,
    pub title: String,
    /// The whole document, heading included: what the user message carries.
    pub markdown: String,
}

/// One original section: a heading and its paragraphs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Section {
    pub heading: String,
    pub body: String,
}

const SECTION_FILES: [&str; 5] = [
    include_str!("../corpus/summarisation/sections-1.md"),
    include_str!("../corpus/summarisation/sections-2.md"),
    include_str!("../corpus/summarisation/sections-3.md"),
    include_str!("../corpus/summarisation/sections-4.md"),
    include_str!("../corpus/summarisation/sections-5.md"),
];

const PROMPTS_JSONL: &str = include_str!("../corpus/reasoning/prompts.jsonl");

/// Titles of the composed documents (one per document, in order).
const TITLES: [&str; 30] = [
    "Notes from a regional review",
    "A field report on coasts and commerce",
    "Findings of the annual survey",
    "Observations for the planning committee",
    "A digest for the board",
    "Readings on infrastructure and nature",
    "Papers from the spring meeting",
    "An overview for new staff",
    "Collected case studies",
    "Material for the autumn seminar",
    "The long-range assessment",
    "A compendium of working papers",
    "Background for the policy council",
    "Reports gathered over a decade",
    "Evidence submitted to the inquiry",
    "Studies in change and continuity",
    "A reader for the summer school",
    "The consolidated briefing book",
    "Dossier for the visiting committee",
    "Proceedings of the open forum",
    "The full archive of the working group",
    "A history in many parts",
    "Source book for the review panel",
    "The extended record of the commission",
    "An anthology of field and office notes",
    "Annual volume of the research trust",
    "The unabridged assessment",
    "Complete minutes and supporting papers",
    "The omnibus report",
    "A library of observations",
];

/// Parses `## Heading` sections; text before the first heading is ignored.
pub fn parse_sections(markdown: &str) -> Result<Vec<Section>, TextError> {
    let mut sections = Vec::new();
    let mut current: Option<(String, Vec<&str>)> = None;
    let mut finish = |current: Option<(String, Vec<&str>)>| -> Result<(), TextError> {
        if let Some((heading, lines)) = current {
            let body = lines.join("\n").trim().to_owned();
            if body.is_empty() {
                return Err(TextError::Corpus(format!(
                    "section `{heading}` has no text"
                )));
            }
            sections.push(Section { heading, body });
        }
        Ok(())
    };
    for line in markdown.lines() {
        if let Some(heading) = line.strip_prefix("## ") {
            finish(current.take())?;
            current = Some((heading.trim().to_owned(), Vec::new()));
        } else if let Some((_, lines)) = current.as_mut() {
            lines.push(line);
        }
    }
    finish(current)?;
    Ok(sections)
}

/// The summarisation documents: [`DocumentCorpus::PER_BUCKET`] per bucket, short first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DocumentCorpus {
    documents: Vec<Document>,
}

impl DocumentCorpus {
    /// Documents per length bucket.
    pub const PER_BUCKET: usize = 10;

    /// The built-in sections.
    pub fn sections() -> Result<Vec<Section>, TextError> {
        let mut all = Vec::new();
        for file in SECTION_FILES {
            all.extend(parse_sections(file)?);
        }
        Ok(all)
    }

    /// Composes the built-in documents (see the module docs); `tokenizer` measures the
    /// sections.
    pub fn builtin(tokenizer: &Tokenizer) -> Result<DocumentCorpus, TextError> {
        DocumentCorpus::compose(&DocumentCorpus::sections()?, tokenizer)
    }

    /// Composes documents from `sections`.
    pub fn compose(
        sections: &[Section],
        tokenizer: &Tokenizer,
    ) -> Result<DocumentCorpus, TextError> {
        if sections.is_empty() {
            return Err(TextError::Corpus(
                "no sections to compose documents from".into(),
            ));
        }
        // "## N. " costs about three tokens more than the heading alone; the blank lines
        // between sections are one token each.
        let lengths: Vec<usize> = sections
            .iter()
            .map(|s| {
                tokenizer
                    .encode_ordinary(&format!("## {}\n\n{}\n\n", s.heading, s.body))
                    .len()
                    + 3
            })
            .collect();
        let mut documents = Vec::with_capacity(3 * Self::PER_BUCKET);
        for (b, bucket) in LengthBucket::ALL.into_iter().enumerate() {
            for n in 0..Self::PER_BUCKET {
                let d = b * Self::PER_BUCKET + n;
                let title = TITLES[d % TITLES.len()];
                let id = format!("{}-{:02}", bucket.name(), n + 1);
                let mut markdown = format!(
                    "# Briefing {:02}: {title}\n\nReference {id} ({} bucket). The sections below were gathered for this briefing from several sources; they are numbered in the order in which they should be read.\n\n",
                    d + 1,
                    bucket.name()
                );
                let mut tokens = tokenizer.encode_ordinary(&markdown).len();
                let target = bucket.target_tokens();
                let mut rng = ChaCha8Rng::seed_from_u64(0x0b5e_c710_0000 + d as u64);
                let mut order: Vec<usize> = Vec::new();
                let mut number = 0;
                loop {
                    if order.is_empty() {
                        order = (0..sections.len()).collect();
                        // Fisher–Yates, from the document's own RNG.
                        for i in (1..order.len()).rev() {
                            order.swap(i, rng.random_range(0..=i));
                        }
                    }
                    let Some(&next) = order.last() else { break };
                    if tokens + lengths[next] / 2 > target {
                        break;
                    }
                    order.pop();
                    number += 1;
                    let s = &sections[next];
                    markdown.push_str(&format!("## {number}. {}\n\n{}\n\n", s.heading, s.body));
                    tokens += lengths[next];
                }
                documents.push(Document {
                    id,
                    bucket,
                    title: title.to_owned(),
                    markdown: markdown.trim_end().to_owned(),
                });
            }
        }
        Ok(DocumentCorpus { documents })
    }

    pub fn documents(&self) -> &[Document] {
        &self.documents
    }

    pub fn len(&self) -> usize {
        self.documents.len()
    }

    /// Never true for a built corpus.
    pub fn is_empty(&self) -> bool {
        self.documents.is_empty()
    }
}

/// One reasoning prompt (seed 004's `prompts.jsonl` fields).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReasoningPrompt {
    pub id: String,
    pub category: String,
    /// Tokens a good answer takes, about: the planned reply's length is drawn around it.
    pub expected_output_length: u32,
    pub prompt: String,
}

/// The reasoning prompt bank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReasoningBank {
    prompts: Vec<ReasoningPrompt>,
}

impl ReasoningBank {
    /// Longest expected answer a prompt may declare.
    pub const MAX_EXPECTED_OUTPUT: u32 = 8_192;

    /// The built-in bank (`corpus/reasoning/prompts.jsonl`).
    pub fn builtin() -> Result<ReasoningBank, TextError> {
        ReasoningBank::from_jsonl(PROMPTS_JSONL)
    }

    /// A bank from JSON lines; blank lines are skipped. Checks that ids are unique, prompts
    /// non-empty and expected lengths within 1..=[`Self::MAX_EXPECTED_OUTPUT`].
    pub fn from_jsonl(jsonl: &str) -> Result<ReasoningBank, TextError> {
        let mut prompts: Vec<ReasoningPrompt> = Vec::new();
        for (i, line) in jsonl.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let p: ReasoningPrompt = serde_json::from_str(line).map_err(|e| {
                TextError::Corpus(format!("reasoning prompts, line {}: {e}", i + 1))
            })?;
            if p.prompt.trim().is_empty() {
                return Err(TextError::Corpus(format!(
                    "reasoning prompt {} is empty",
                    p.id
                )));
            }
            if !(1..=Self::MAX_EXPECTED_OUTPUT).contains(&p.expected_output_length) {
                return Err(TextError::Corpus(format!(
                    "reasoning prompt {}: expected_output_length must be 1..={}",
                    p.id,
                    Self::MAX_EXPECTED_OUTPUT
                )));
            }
            if prompts.iter().any(|q| q.id == p.id) {
                return Err(TextError::Corpus(format!(
                    "reasoning prompt id {} repeats",
                    p.id
                )));
            }
            prompts.push(p);
        }
        if prompts.is_empty() {
            return Err(TextError::Corpus("the reasoning bank is empty".into()));
        }
        Ok(ReasoningBank { prompts })
    }

    pub fn prompts(&self) -> &[ReasoningPrompt] {
        &self.prompts
    }

    pub fn len(&self) -> usize {
        self.prompts.len()
    }

    /// Never true for a built bank.
    pub fn is_empty(&self) -> bool {
        self.prompts.is_empty()
    }
}
