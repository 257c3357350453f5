//! The shipped corpus: every passage is a real document of the seed's size.

use text::{Corpus, KeyTerms, Tokenizer};

#[test]
fn each_passage_is_about_3500_to_4000_tokens_with_key_terms() {
    let tokenizer = Tokenizer::builtin();
    let corpus = Corpus::builtin();
    let terms = KeyTerms::extract(&corpus);
    for (i, p) in corpus.passages().iter().enumerate() {
        let tokens = tokenizer.encode(p.markdown()).len();
        println!("passage-{:02}: {tokens} tokens, {:?}", i + 1, p.title());
        // The seed's starters are ~3,500–4,000 tokens; allow a little slack for edits.
        assert!(
            (3_300..=4_200).contains(&tokens),
            "passage-{:02} has {tokens} tokens",
            i + 1
        );
        assert!(terms.of(i).len() >= 10, "passage-{:02} terms", i + 1);
    }
}
