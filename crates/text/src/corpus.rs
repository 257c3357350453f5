//! The shipped corpus: ten technical passages that start conversations, and their key terms.

use std::collections::BTreeMap;

use crate::TextError;

/// One passage: a markdown document whose first line is `# Title`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Passage {
    title: String,
    markdown: String,
}

impl Passage {
    /// Parses a passage; the first non-empty line must be a `# Title` heading.
    pub fn from_markdown(markdown: impl Into<String>) -> Result<Self, TextError> {
        let markdown = markdown.into();
        let first = markdown
            .lines()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("");
        let title = first
            .strip_prefix("# ")
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .ok_or_else(|| {
                TextError::Corpus(format!(
                    "a passage must start with a `# Title` line, found {first:?}"
                ))
            })?
            .to_owned();
        Ok(Passage { title, markdown })
    }

    pub fn title(&self) -> &str {
        &self.title
    }

    /// The whole document, title line included: what a prompt carries.
    pub fn markdown(&self) -> &str {
        &self.markdown
    }

    /// The prose paragraphs with markdown removed: headings, code blocks, tables and rules
    /// dropped; list markers, emphasis and inline-code backticks stripped. Each paragraph is
    /// one string of words separated by single spaces.
    pub fn prose_paragraphs(&self) -> Vec<String> {
        let mut paragraphs = Vec::new();
        let mut current: Vec<&str> = Vec::new();
        let mut in_code = false;
        let flush = |current: &mut Vec<&str>, paragraphs: &mut Vec<String>| {
            if !current.is_empty() {
                let words: Vec<String> = current
                    .iter()
                    .flat_map(|line| line.split_whitespace())
                    .map(clean_markup)
                    .filter(|w| !w.is_empty())
                    .collect();
                if !words.is_empty() {
                    paragraphs.push(words.join(" "));
                }
                current.clear();
            }
        };
        for line in self.markdown.lines() {
            let trimmed = line.trim();
            if trimmed.starts_with("```") {
                in_code = !in_code;
                flush(&mut current, &mut paragraphs);
                continue;
            }
            if in_code
                || trimmed.starts_with('#')
                || trimmed.starts_with('|')
                || trimmed.starts_with("---")
                || trimmed.starts_with('>')
            {
                flush(&mut current, &mut paragraphs);
                continue;
            }
            if trimmed.is_empty() {
                flush(&mut current, &mut paragraphs);
                continue;
            }
            let item = strip_list_marker(trimmed);
            if item.len() != trimmed.len() {
                // Each list item is its own paragraph.
                flush(&mut current, &mut paragraphs);
            }
            current.push(item);
        }
        flush(&mut current, &mut paragraphs);
        paragraphs
    }
}

/// `- item`, `* item`, `+ item`, `12. item` → `item`.
fn strip_list_marker(line: &str) -> &str {
    for marker in ["- ", "* ", "+ "] {
        if let Some(rest) = line.strip_prefix(marker) {
            return rest.trim_start();
        }
    }
    let digits = line.bytes().take_while(u8::is_ascii_digit).count();
    if digits > 0 && line[digits..].starts_with(". ") {
        return line[digits + 2..].trim_start();
    }
    line
}

/// Removes emphasis and inline-code markers from a word; drops special-token-like text so
/// generated replies never contain a chat special token.
fn clean_markup(word: &str) -> String {
    if word.contains("<|") || word.contains("|>") {
        return String::new();
    }
    word.chars().filter(|c| !matches!(c, '*' | '`')).collect()
}

/// An ordered set of passages.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Corpus {
    passages: Vec<Passage>,
}

macro_rules! embedded_passages {
    ($($n:literal),*) => {
        [$(include_str!(concat!("../corpus/passage-", $n, ".md"))),*]
    };
}

impl Corpus {
    /// The ten passages shipped in `crates/text/corpus/passage-01.md` … `passage-10.md`,
    /// embedded at compile time.
    pub fn builtin() -> Corpus {
        let texts = embedded_passages!("01", "02", "03", "04", "05", "06", "07", "08", "09", "10");
        let passages = texts
            .iter()
            .map(|t| Passage::from_markdown(*t))
            .collect::<Result<Vec<_>, _>>()
            // Checked by this crate's tests for the files it embeds.
            .expect("every embedded passage starts with a `# Title` line");
        Corpus { passages }
    }

    /// A corpus from markdown documents (e.g. files a user points the load generator at).
    pub fn from_markdown<I, S>(documents: I) -> Result<Corpus, TextError>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let passages = documents
            .into_iter()
            .map(Passage::from_markdown)
            .collect::<Result<Vec<_>, _>>()?;
        if passages.is_empty() {
            return Err(TextError::Corpus(
                "a corpus needs at least one passage".into(),
            ));
        }
        Ok(Corpus { passages })
    }

    pub fn passages(&self) -> &[Passage] {
        &self.passages
    }

    pub fn get(&self, index: usize) -> Result<&Passage, TextError> {
        self.passages.get(index).ok_or(TextError::UnknownPassage {
            index,
            count: self.passages.len(),
        })
    }

    pub fn len(&self) -> usize {
        self.passages.len()
    }

    /// Never true for a built corpus.
    pub fn is_empty(&self) -> bool {
        self.passages.is_empty()
    }

    /// `words` words of the corpus's prose (every passage's paragraphs in order, wrapping
    /// around), starting at word `start` (also wrapping). Readable text of a chosen length,
    /// different for different starts: prompts for tests and benchmarks.
    pub fn excerpt(&self, start: usize, words: usize) -> String {
        let prose: Vec<String> = self
            .passages
            .iter()
            .flat_map(Passage::prose_paragraphs)
            .collect();
        let all: Vec<&str> = prose.iter().flat_map(|p| p.split(' ')).collect();
        if all.is_empty() {
            return String::new();
        }
        (0..words)
            .map(|i| all[(start + i) % all.len()])
            .collect::<Vec<_>>()
            .join(" ")
    }
}

/// A passage's key term: `display` as written most often (`"KV cache"`), `key` lowercased.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Term {
    pub display: String,
    pub key: String,
}

/// The distinctive terms of each passage (single words and two-word phrases that are frequent in
/// the passage and rare in the others), best first. Deterministic.
#[derive(Clone, Debug)]
pub struct KeyTerms {
    per_passage: Vec<Vec<Term>>,
}

/// How many single words and two-word phrases [`KeyTerms`] keeps per passage.
const TERMS_PER_KIND: usize = 12;

impl KeyTerms {
    pub fn extract(corpus: &Corpus) -> KeyTerms {
        let n = corpus.len();
        let mut unigrams: Vec<Counts> = vec![BTreeMap::new(); n];
        let mut bigrams: Vec<Counts> = vec![BTreeMap::new(); n];
        let add = |map: &mut Counts, key: String, display: String| {
            let entry = map.entry(key).or_default();
            entry.0 += 1;
            *entry.1.entry(display).or_default() += 1;
        };
        for (p, passage) in corpus.passages().iter().enumerate() {
            for paragraph in passage.prose_paragraphs() {
                let mut previous: Option<(String, String)> = None;
                for raw in paragraph.split(' ') {
                    let Some((key, display, breaks_after)) = normalise_word(raw) else {
                        previous = None;
                        continue;
                    };
                    if is_stopword(&key) || !is_term_word(&key, &display) {
                        previous = None;
                        continue;
                    }
                    if key.chars().count() >= 4 {
                        add(&mut unigrams[p], key.clone(), display.clone());
                    }
                    if let Some((pk, pd)) = previous.take() {
                        add(
                            &mut bigrams[p],
                            format!("{pk} {key}"),
                            format!("{pd} {display}"),
                        );
                    }
                    previous = (!breaks_after).then_some((key, display));
                }
            }
        }
        let uni_df = document_frequency(&unigrams);
        let bi_df = document_frequency(&bigrams);
        let best = |map: &Counts, df: &BTreeMap<&str, u32>, min_count: u32| -> Vec<Term> {
            let mut scored: Vec<(f64, &String, &BTreeMap<String, u32>)> = map
                .iter()
                .filter(|(_, (count, _))| *count >= min_count)
                .map(|(key, (count, forms))| {
                    let idf = ((n as f64 + 1.0) / (df[key.as_str()] as f64)).ln();
                    (*count as f64 * idf, key, forms)
                })
                .collect();
            scored.sort_by(|a, b| b.0.total_cmp(&a.0).then_with(|| a.1.cmp(b.1)));
            scored
                .into_iter()
                .take(TERMS_PER_KIND)
                .map(|(_, key, forms)| Term {
                    key: key.clone(),
                    display: most_common(forms),
                })
                .collect()
        };
        let per_passage = (0..n)
            .map(|p| {
                let mut terms = best(&bigrams[p], &bi_df, 3);
                terms.extend(best(&unigrams[p], &uni_df, 3));
                terms
            })
            .collect();
        KeyTerms { per_passage }
    }

    /// The terms of passage `index`, best first (may be empty for a tiny passage).
    pub fn of(&self, index: usize) -> &[Term] {
        self.per_passage.get(index).map_or(&[], Vec::as_slice)
    }

    pub fn len(&self) -> usize {
        self.per_passage.len()
    }

    pub fn is_empty(&self) -> bool {
        self.per_passage.is_empty()
    }
}

/// Per passage: term key → (count, display form → count). BTreeMaps keep every step
/// deterministic.
type Counts = BTreeMap<String, (u32, BTreeMap<String, u32>)>;

/// In how many passages each term occurs.
fn document_frequency(maps: &[Counts]) -> BTreeMap<&str, u32> {
    let mut df: BTreeMap<&str, u32> = BTreeMap::new();
    for map in maps {
        for key in map.keys() {
            *df.entry(key.as_str()).or_default() += 1;
        }
    }
    df
}

fn most_common(forms: &BTreeMap<String, u32>) -> String {
    // Ties go to the lexicographically first form (uppercase sorts first: "KV" over "kv").
    let mut best: Option<(&String, u32)> = None;
    for (form, &count) in forms {
        if best.is_none_or(|(_, c)| count > c) {
            best = Some((form, count));
        }
    }
    best.map(|(f, _)| f.clone()).unwrap_or_default()
}

/// A word's term key (lowercase), its display form, and whether punctuation after it ends a
/// phrase. `None` for words with no letters.
pub(crate) fn normalise_word(raw: &str) -> Option<(String, String, bool)> {
    let is_term_char = |c: char| c.is_alphanumeric() || c == '-';
    let core = raw.trim_matches(|c: char| !is_term_char(c));
    let breaks_after = !raw.ends_with(core);
    let core = core.strip_suffix("'s").unwrap_or(core);
    if !core.chars().any(char::is_alphabetic) || !core.chars().all(is_term_char) {
        return None;
    }
    Some((core.to_lowercase(), core.to_owned(), breaks_after))
}

/// Whether a word can be part of a key term: at least three characters (or an acronym such as
/// `KV`), and not an adverb or past participle (`-ly`, `-ed`), which make clumsy terms.
fn is_term_word(key: &str, display: &str) -> bool {
    let acronym = display.len() >= 2
        && display
            .chars()
            .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit());
    (key.chars().count() >= 3 || acronym) && !key.ends_with("ly") && !key.ends_with("ed")
}

/// Common English words that never make a key term on their own. Sorted (binary search).
const STOPWORDS: &[&str] = &[
    "a", "about", "above", "across", "after", "again", "against", "all", "also", "although",
    "always", "among", "an", "and", "another", "any", "are", "around", "as", "at", "back", "be",
    "because", "been", "before", "being", "below", "between", "both", "but", "by", "can", "cannot",
    "could", "did", "do", "does", "doing", "done", "down", "during", "each", "either", "enough",
    "equal", "even", "every", "few", "first", "for", "from", "further", "get", "gets", "given",
    "gives", "go", "goes", "good", "had", "has", "have", "having", "he", "her", "here", "high",
    "him", "his", "how", "however", "if", "in", "instead", "into", "is", "it", "its", "itself",
    "just", "less", "like", "likely", "long", "made", "make", "makes", "many", "may", "means",
    "might", "more", "most", "much", "must", "need", "needs", "never", "new", "no", "nor", "not",
    "now", "of", "off", "often", "on", "once", "one", "only", "or", "other", "others", "our",
    "out", "over", "own", "part", "per", "performs", "plus", "rather", "same", "second", "see",
    "several", "she", "should", "since", "so", "some", "such", "take", "takes", "than", "that",
    "the", "their", "them", "then", "there", "these", "they", "this", "those", "though", "three",
    "through", "thus", "to", "too", "two", "under", "until", "up", "upon", "us", "use", "used",
    "uses", "using", "usually", "varies", "vary", "very", "was", "way", "we", "well", "were",
    "what", "when", "where", "whether", "which", "while", "who", "whose", "why", "will", "with",
    "within", "without", "would", "yet", "you", "your",
];

pub(crate) fn is_stopword(word: &str) -> bool {
    STOPWORDS.binary_search(&word).is_ok()
}

#[cfg(test)]
mod tests {

    #[test]
    fn excerpts_have_the_asked_length_differ_by_start_and_wrap_around() {
        let corpus = Corpus::builtin();
        let a = corpus.excerpt(0, 300);
        assert_eq!(a.split(' ').count(), 300);
        assert_ne!(a, corpus.excerpt(997, 300));
        assert_eq!(a, corpus.excerpt(0, 300), "deterministic");
        let total: usize = corpus
            .passages()
            .iter()
            .flat_map(Passage::prose_paragraphs)
            .map(|p| p.split(' ').count())
            .sum();
        // Longer than the whole corpus: it wraps instead of stopping short.
        let long = corpus.excerpt(total - 5, total + 10);
        assert_eq!(long.split(' ').count(), total + 10);
        let seam = format!("{} {}", corpus.excerpt(total - 5, 5), corpus.excerpt(0, 5));
        assert_eq!(corpus.excerpt(total - 5, 10), seam);
    }

    use super::*;

    #[test]
    fn builtin_corpus_has_ten_titled_passages() {
        let corpus = Corpus::builtin();
        assert_eq!(corpus.len(), 10);
        for p in corpus.passages() {
            assert!(!p.title().is_empty());
            assert!(p.markdown().starts_with("# "));
        }
        assert!(corpus.get(10).is_err());
    }

    #[test]
    fn stopwords_are_sorted_for_binary_search() {
        assert!(STOPWORDS.windows(2).all(|w| w[0] < w[1]));
        assert!(is_stopword("the") && is_stopword("your") && is_stopword("a"));
        assert!(!is_stopword("cache"));
    }

    #[test]
    fn prose_drops_markup() {
        let p = Passage::from_markdown(
            "# T\n\nSome **bold** and `code` text\nwrapped.\n\n## Heading\n\n- item one\n- item two\n\n```\nfn x() {}\n```\n| a | b |\n\n1. numbered <|eot_id|> item",
        )
        .unwrap();
        assert_eq!(
            p.prose_paragraphs(),
            vec![
                "Some bold and code text wrapped.",
                "item one",
                "item two",
                "numbered item"
            ]
        );
        assert!(Passage::from_markdown("no title").is_err());
        assert!(Corpus::from_markdown(Vec::<String>::new()).is_err());
    }

    #[test]
    fn key_terms_are_distinctive_and_deterministic() {
        let corpus = Corpus::from_markdown([
            "# A\n\nThe prefix cache holds blocks. A prefix cache hit skips prefill. Prefix cache eviction frees blocks. Blocks blocks blocks.",
            "# B\n\nThe router picks workers. The router weighs load. Workers report load to the router. Workers and blocks.",
        ])
        .unwrap();
        let terms = KeyTerms::extract(&corpus);
        let a: Vec<&str> = terms.of(0).iter().map(|t| t.display.as_str()).collect();
        assert_eq!(a[0], "prefix cache");
        assert!(a.contains(&"prefix") && a.contains(&"cache"));
        let b: Vec<&str> = terms.of(1).iter().map(|t| t.key.as_str()).collect();
        assert!(b.contains(&"router") && b.contains(&"workers"));
        assert!(!b.contains(&"blocks"), "blocks is rare in B: {b:?}");
        let again = KeyTerms::extract(&corpus);
        assert_eq!(terms.of(1), again.of(1));
    }
}
