//! A simulated user's questions: readable, varied, about the passage and the last answer —
//! as text, and as token ids assembled from pre-tokenized pieces without running the
//! tokenizer per question.

use rand::Rng;

use crate::{KeyTerms, Tokenizer};

/// Openers for the first question about a passage; `{a}`/`{b}` are key terms.
const FIRST: &[&str] = &[
    "Please read the reference text above and explain its key ideas, starting with {a}.",
    "I'm new to this topic. Can you walk me through the text above and explain what {a} means in practice?",
    "Summarise the main points of the text above, then explain in detail how {a} works.",
    "Explain the text above to an engineer who has to operate such a system. Focus on {a} and {b}.",
    "What are the most important ideas in the text above? Please go deep on {a}.",
];

/// Follow-ups; `{a}`/`{b}` are passage terms, `{r}` a term from the last answer.
const FOLLOW_UPS: &[&str] = &[
    "Could you explain {r} in more detail, and how it relates to {a} in a real deployment?",
    "You mentioned {r}. Why does that matter so much for {a}, and what happens if we ignore it?",
    "What are the main trade-offs between {a} and {b}, and when would you choose one over the other?",
    "Can you give a concrete example of {a} in a production system, with rough numbers for each step?",
    "How would the picture change for {r} if the load doubled? Walk me through it step by step.",
    "I'm still unclear about {r}. Can you explain it again in simpler terms, maybe with an analogy?",
    "What usually goes wrong with {a} at scale, and how do operators detect it before users notice?",
    "How does {b} interact with {r} in practice, and which of the two is usually the bottleneck?",
    "If I had to tune {a} on a new cluster, which measurements should I look at first, and why?",
    "Is there a common misconception about {r}? How would you correct it for a new team member?",
    "How do {a} and {b} show up in the latency that a user actually sees in a chat application?",
    "Which of the points about {r} would you prioritise for a small team with a limited GPU budget?",
];

/// Optional openings (followed by a space) and closings (starting with one).
const PREFIXES: &[&str] = &[
    "",
    "",
    "Thanks, that helps.",
    "Interesting.",
    "OK, I have a follow-up question.",
    "That makes sense so far.",
    "Got it, thanks for the detailed answer.",
];
const SUFFIXES: &[&str] = &[
    "",
    "",
    " Please be specific.",
    " Keep it practical and concrete.",
    " A short list of steps would help.",
    " Assume I know the basics of GPUs and Kubernetes, but not the details of inference serving.",
    " If there are numbers in the text above, please use them in your answer.",
];

/// Stand-ins added to a passage's terms when it has fewer than four.
const FALLBACK_TERMS: &[&str] = &["this design", "the main bottleneck", "the system", "cost"];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Slot {
    A,
    B,
    R,
}

/// A template cut at its slots; each slot stands for `" " + term`.
#[derive(Clone, Debug)]
struct Template {
    /// Literal text before each slot, then the text after the last one.
    literals: Vec<String>,
    slots: Vec<Slot>,
    /// Token ids of each literal; the first literal also after a prefix (with a space).
    literal_ids: Vec<Vec<u32>>,
    first_after_prefix_ids: Vec<u32>,
}

impl Template {
    fn parse(source: &str, tokenizer: &Tokenizer) -> Template {
        let mut literals = Vec::new();
        let mut slots = Vec::new();
        let mut rest = source;
        while let Some(open) = rest.find('{') {
            let slot = match &rest[open..open + 3] {
                "{a}" => Slot::A,
                "{b}" => Slot::B,
                _ => Slot::R,
            };
            // The slot owns the space before it, so that every join between pieces is a
            // space after a non-space character or punctuation after a term: places where the
            // pre-tokenizer always starts a new piece (checked by this crate's tests).
            let before = &rest[..open];
            literals.push(before.strip_suffix(' ').unwrap_or(before).to_owned());
            slots.push(slot);
            rest = &rest[open + 3..];
        }
        literals.push(rest.to_owned());
        let literal_ids = literals
            .iter()
            .map(|l| tokenizer.encode_ordinary(l))
            .collect();
        let first_after_prefix_ids = tokenizer.encode_ordinary(&format!(" {}", literals[0]));
        Template {
            literals,
            slots,
            literal_ids,
            first_after_prefix_ids,
        }
    }
}

/// One question, drawn but not yet written: which template, opening, closing and terms.
/// [`QuestionGenerator::text`] and [`QuestionGenerator::push_tokens`] write it; the tokens
/// equal `tokenizer.encode_ordinary(text)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuestionPlan {
    passage: usize,
    first: bool,
    template: u8,
    prefix: u8,
    suffix: u8,
    a: u16,
    b: u16,
    r: u16,
}

/// Builds questions from templates and a passage's key terms (about 15–60 tokens each).
/// Deterministic from the caller's RNG.
#[derive(Clone, Debug)]
pub struct QuestionGenerator {
    terms: KeyTerms,
    /// Per passage: term texts (the passage's key terms, then fallbacks if it has few).
    vocabulary: Vec<Vec<String>>,
    /// Per passage: token ids of `" " + term`.
    vocabulary_ids: Vec<Vec<Vec<u32>>>,
    first: Vec<Template>,
    follow_ups: Vec<Template>,
    prefix_ids: Vec<Vec<u32>>,
    suffix_ids: Vec<Vec<u32>>,
}

impl QuestionGenerator {
    /// Pre-tokenizes the templates and terms with `tokenizer`.
    pub fn new(terms: KeyTerms, tokenizer: &Tokenizer) -> Self {
        let vocabulary: Vec<Vec<String>> = (0..terms.len())
            .map(|p| {
                let mut v: Vec<String> = terms.of(p).iter().map(|t| t.display.clone()).collect();
                if v.len() < 4 {
                    v.extend(FALLBACK_TERMS.iter().map(|t| (*t).to_owned()));
                }
                v
            })
            .collect();
        let vocabulary_ids = vocabulary
            .iter()
            .map(|v| {
                v.iter()
                    .map(|t| tokenizer.encode_ordinary(&format!(" {t}")))
                    .collect()
            })
            .collect();
        QuestionGenerator {
            terms,
            vocabulary,
            vocabulary_ids,
            first: FIRST
                .iter()
                .map(|t| Template::parse(t, tokenizer))
                .collect(),
            follow_ups: FOLLOW_UPS
                .iter()
                .map(|t| Template::parse(t, tokenizer))
                .collect(),
            prefix_ids: PREFIXES
                .iter()
                .map(|p| tokenizer.encode_ordinary(p))
                .collect(),
            suffix_ids: SUFFIXES
                .iter()
                .map(|s| tokenizer.encode_ordinary(s))
                .collect(),
        }
    }

    pub fn terms(&self) -> &KeyTerms {
        &self.terms
    }

    /// Draws the first question of a conversation about passage `passage`.
    pub fn plan_first(&self, passage: usize, rng: &mut impl Rng) -> QuestionPlan {
        let template = rng.random_range(0..self.first.len()) as u8;
        let (a, b) = self.two_terms(passage, None, rng);
        QuestionPlan {
            passage,
            first: true,
            template,
            prefix: 0,
            suffix: 0,
            a,
            b,
            r: a,
        }
    }

    /// Draws a follow-up about passage `passage`; `topic` is the index (into the passage's
    /// [`KeyTerms`]) of a term from the last answer, e.g. [`crate::Reply::topic`].
    pub fn plan_follow_up(
        &self,
        passage: usize,
        topic: Option<usize>,
        rng: &mut impl Rng,
    ) -> QuestionPlan {
        let vocabulary_len = self.vocabulary(passage).len();
        let r = topic.filter(|&t| t < vocabulary_len).map(|t| t as u16);
        let prefix = rng.random_range(0..PREFIXES.len()) as u8;
        let template = rng.random_range(0..self.follow_ups.len()) as u8;
        let suffix = rng.random_range(0..SUFFIXES.len()) as u8;
        let (a, b) = self.two_terms(passage, r, rng);
        QuestionPlan {
            passage,
            first: false,
            template,
            prefix,
            suffix,
            a,
            b,
            r: r.unwrap_or(b),
        }
    }

    /// The first question, as text.
    pub fn first_question(&self, passage: usize, rng: &mut impl Rng) -> String {
        self.text(&self.plan_first(passage, rng))
    }

    /// A follow-up, as text (see [`QuestionGenerator::plan_follow_up`]).
    pub fn follow_up(&self, passage: usize, topic: Option<usize>, rng: &mut impl Rng) -> String {
        self.text(&self.plan_follow_up(passage, topic, rng))
    }

    /// A follow-up to an answer given as text (real-time mode): `{r}` is the passage term that
    /// the answer mentions last.
    pub fn follow_up_to_text(&self, passage: usize, answer: &str, rng: &mut impl Rng) -> String {
        let lowered = answer.to_lowercase();
        let topic = self
            .terms
            .of(passage)
            .iter()
            .enumerate()
            .filter_map(|(i, t)| lowered.rfind(&t.key).map(|at| (at, i)))
            .max()
            .map(|(_, i)| i);
        self.follow_up(passage, topic, rng)
    }

    /// The question's text.
    pub fn text(&self, plan: &QuestionPlan) -> String {
        let vocabulary = self.vocabulary(plan.passage);
        let template = self.template(plan);
        let mut text = String::with_capacity(200);
        let prefix = if plan.first {
            ""
        } else {
            PREFIXES[plan.prefix as usize]
        };
        text.push_str(prefix);
        if !prefix.is_empty() {
            text.push(' ');
        }
        for (i, literal) in template.literals.iter().enumerate() {
            text.push_str(literal);
            if let Some(&slot) = template.slots.get(i) {
                text.push(' ');
                text.push_str(&vocabulary[plan.term(slot)]);
            }
        }
        if !plan.first {
            text.push_str(SUFFIXES[plan.suffix as usize]);
        }
        text
    }

    /// Appends the question's token ids (equal to `tokenizer.encode_ordinary(&text)`) without
    /// running the tokenizer.
    pub fn push_tokens(&self, plan: &QuestionPlan, out: &mut Vec<u32>) {
        let vocabulary_ids = &self.vocabulary_ids[plan.passage.min(self.vocabulary_ids.len() - 1)];
        let template = self.template(plan);
        let has_prefix = !plan.first && !PREFIXES[plan.prefix as usize].is_empty();
        if has_prefix {
            out.extend_from_slice(&self.prefix_ids[plan.prefix as usize]);
        }
        for (i, ids) in template.literal_ids.iter().enumerate() {
            if i == 0 && has_prefix {
                out.extend_from_slice(&template.first_after_prefix_ids);
            } else {
                out.extend_from_slice(ids);
            }
            if let Some(&slot) = template.slots.get(i) {
                out.extend_from_slice(&vocabulary_ids[plan.term(slot)]);
            }
        }
        if !plan.first {
            out.extend_from_slice(&self.suffix_ids[plan.suffix as usize]);
        }
    }

    fn template(&self, plan: &QuestionPlan) -> &Template {
        if plan.first {
            &self.first[plan.template as usize]
        } else {
            &self.follow_ups[plan.template as usize]
        }
    }

    fn vocabulary(&self, passage: usize) -> &[String] {
        self.vocabulary
            .get(passage)
            .or(self.vocabulary.last())
            .map_or(&[], Vec::as_slice)
    }

    /// Two different terms, both unlike `exclude` where possible. The best-ranked terms are
    /// drawn more often.
    fn two_terms(&self, passage: usize, exclude: Option<u16>, rng: &mut impl Rng) -> (u16, u16) {
        let n = self.vocabulary(passage).len().max(1);
        // Skewed towards the top: the smaller of two uniform draws.
        let mut pick = |other: Option<u16>| {
            let mut choice = 0;
            for _ in 0..8 {
                let x = rng.random_range(0..n);
                let y = rng.random_range(0..n);
                choice = x.min(y) as u16;
                if Some(choice) != exclude && Some(choice) != other {
                    break;
                }
            }
            choice
        };
        let a = pick(None);
        let b = pick(Some(a));
        (a, b)
    }
}

impl QuestionPlan {
    fn term(&self, slot: Slot) -> usize {
        match slot {
            Slot::A => self.a as usize,
            Slot::B => self.b as usize,
            Slot::R => self.r as usize,
        }
    }

    pub fn passage(&self) -> usize {
        self.passage
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_slot_follows_a_space_after_a_non_space_and_every_template_starts_with_a_letter() {
        for t in FIRST.iter().chain(FOLLOW_UPS) {
            assert!(t.starts_with(|c: char| c.is_ascii_alphabetic()), "{t}");
            for (at, _) in t.match_indices('{') {
                assert_eq!(&t[at - 1..at], " ", "{t}");
                assert!(!t[..at - 1].ends_with(char::is_whitespace), "{t}");
                let slot = &t[at..at + 3];
                assert!(["{a}", "{b}", "{r}"].contains(&slot), "{t}");
            }
        }
        for p in PREFIXES {
            assert!(p.is_empty() || p.ends_with(['.', '?', '!']), "{p}");
        }
        for s in SUFFIXES {
            assert!(s.is_empty() || s.starts_with(' '), "{s}");
        }
    }
}
