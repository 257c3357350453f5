//! A simulated user's questions: readable, varied, about the passage and the last answer.

use rand::Rng;
use rand::seq::IndexedRandom;

use crate::{KeyTerms, Term};

/// Openers for the first question about a passage; `{a}` is a key term.
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

/// Optional openings and closings that vary the length and tone.
const PREFIXES: &[&str] = &[
    "",
    "",
    "Thanks, that helps. ",
    "Interesting. ",
    "OK, I have a follow-up question. ",
    "That makes sense so far. ",
    "Got it, thanks for the detailed answer. ",
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

/// Generic stand-ins when a passage has too few terms.
const FALLBACK_TERMS: &[&str] = &["this design", "the main bottleneck", "the system"];

/// Builds follow-up questions from templates and a passage's key terms (about 15–60 tokens
/// each). Deterministic from the caller's RNG.
#[derive(Clone, Debug)]
pub struct QuestionGenerator {
    terms: KeyTerms,
}

impl QuestionGenerator {
    pub fn new(terms: KeyTerms) -> Self {
        QuestionGenerator { terms }
    }

    pub fn terms(&self) -> &KeyTerms {
        &self.terms
    }

    /// The first question of a conversation about passage `passage`.
    pub fn first_question(&self, passage: usize, rng: &mut impl Rng) -> String {
        let (a, b) = self.two_terms(passage, None, rng);
        let template = FIRST.choose(rng).copied().unwrap_or(FIRST[0]);
        fill(template, a, b, a)
    }

    /// A follow-up about passage `passage`; `topic` is the index (into the passage's
    /// [`KeyTerms`]) of a term from the last answer, e.g. [`crate::Reply::topic`].
    pub fn follow_up(&self, passage: usize, topic: Option<usize>, rng: &mut impl Rng) -> String {
        let r = topic
            .and_then(|t| self.terms.of(passage).get(t))
            .map(|t| t.display.as_str());
        let (a, b) = self.two_terms(passage, r, rng);
        self.follow_up_with(a, b, r.unwrap_or(b), rng)
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

    fn follow_up_with(&self, a: &str, b: &str, r: &str, rng: &mut impl Rng) -> String {
        let prefix = PREFIXES.choose(rng).copied().unwrap_or("");
        let template = FOLLOW_UPS.choose(rng).copied().unwrap_or(FOLLOW_UPS[0]);
        let suffix = SUFFIXES.choose(rng).copied().unwrap_or("");
        let mut question = String::with_capacity(160);
        question.push_str(prefix);
        question.push_str(&fill(template, a, b, r));
        question.push_str(suffix);
        question
    }

    /// Two different terms, both unlike `exclude` where the passage has enough terms. The
    /// best-ranked terms are drawn more often.
    fn two_terms(&self, passage: usize, exclude: Option<&str>, rng: &mut impl Rng) -> (&str, &str) {
        let terms: &[Term] = self.terms.of(passage);
        if terms.len() < 4 {
            let first = terms
                .first()
                .map_or(FALLBACK_TERMS[0], |t| t.display.as_str());
            return (first, FALLBACK_TERMS[1]);
        }
        let excluded = |i: usize| exclude.is_some_and(|e| terms[i].display == e);
        // Skewed towards the top: the smaller of two uniform draws.
        let mut pick = |other: Option<usize>| {
            let mut choice = 0;
            for _ in 0..8 {
                let x = rng.random_range(0..terms.len());
                let y = rng.random_range(0..terms.len());
                choice = x.min(y);
                if !excluded(choice) && Some(choice) != other {
                    break;
                }
            }
            choice
        };
        let i = pick(None);
        let j = pick(Some(i));
        (terms[i].display.as_str(), terms[j].display.as_str())
    }
}

fn fill(template: &str, a: &str, b: &str, r: &str) -> String {
    template
        .replace("{a}", a)
        .replace("{b}", b)
        .replace("{r}", r)
}
