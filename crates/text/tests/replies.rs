//! The reply generator's round-trip property, exact lengths, determinism, and that a reply put
//! back into the history tokenizes to the ids the engine "generated".

use std::sync::OnceLock;

use proptest::prelude::*;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use text::{
    ChatMessage, ChatTemplate, ChatTokens, Corpus, KeyTerms, QuestionGenerator, ReplyConfig,
    ReplyGenerator, TextError, Tokenizer,
};

struct Fixture {
    corpus: Corpus,
    replies: ReplyGenerator,
    questions: QuestionGenerator,
}

fn fixture() -> &'static Fixture {
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        let tokenizer = Tokenizer::builtin();
        let corpus = Corpus::builtin();
        let terms = KeyTerms::extract(&corpus);
        let replies =
            ReplyGenerator::new(&tokenizer, &corpus, &terms, &ReplyConfig::default()).unwrap();
        Fixture {
            corpus,
            replies,
            questions: QuestionGenerator::new(terms, &tokenizer),
        }
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 600, ..ProptestConfig::default() })]

    #[test]
    fn replies_have_the_exact_length_and_round_trip(
        passage in 0usize..10,
        len in 1usize..2000,
        seed in any::<u64>(),
    ) {
        let tokenizer = Tokenizer::builtin();
        let f = fixture();
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let reply = f.replies.generate(passage, len, &mut rng).unwrap();
        prop_assert_eq!(reply.ids.len(), len);
        let text = tokenizer.decode(&reply.ids).unwrap();
        prop_assert_eq!(text.trim(), text.as_str(), "reply text must be trimmed");
        prop_assert_eq!(tokenizer.encode(&text), reply.ids.to_vec());
        // After the template's "\n\n" (the assistant header) the ids are unchanged too.
        let mut expected = tokenizer.encode("\n\n");
        expected.extend_from_slice(&reply.ids);
        prop_assert_eq!(tokenizer.encode(&format!("\n\n{text}")), expected);
    }
}

#[test]
fn reply_ids_in_history_equal_rendering_the_decoded_reply() {
    let tokenizer = Tokenizer::builtin();
    let template = ChatTemplate::llama3();
    let f = fixture();
    let mut rng = ChaCha8Rng::seed_from_u64(42);
    for passage in 0..f.corpus.len() {
        let mut chat = ChatTokens::new(tokenizer.clone()).unwrap();
        let mut messages = vec![
            ChatMessage::system(f.corpus.passages()[passage].markdown()),
            ChatMessage::user(f.questions.first_question(passage, &mut rng)),
        ];
        for m in &messages {
            chat.push(m);
        }
        for turn in 0..4 {
            chat.push_generation_prompt();
            let prompt = chat.ids().to_vec();
            let reply = f
                .replies
                .generate(passage, 500 + 97 * turn, &mut rng)
                .unwrap();
            chat.push_assistant_ids(&reply.ids);
            messages.push(ChatMessage::assistant(
                tokenizer.decode(&reply.ids).unwrap(),
            ));
            let full = tokenizer.encode(&template.render(&messages, false).unwrap());
            assert_eq!(chat.ids(), full.as_slice(), "passage {passage} turn {turn}");
            // The next prompt starts with this prompt followed by the reply.
            assert!(chat.ids().starts_with(&prompt));
            assert_eq!(
                &chat.ids()[prompt.len()..prompt.len() + reply.ids.len()],
                &*reply.ids
            );
            let question = f.questions.follow_up(passage, reply.topic, &mut rng);
            chat.push(&ChatMessage::user(question.clone()));
            messages.push(ChatMessage::user(question));
        }
    }
}

#[test]
fn replies_are_deterministic_and_varied() {
    let f = fixture();
    let draw = |seed: u64| {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        f.replies.generate(3, 800, &mut rng).unwrap()
    };
    assert_eq!(draw(9), draw(9));
    let distinct: std::collections::BTreeSet<Vec<u32>> =
        (0..50).map(|s| draw(s).ids.to_vec()).collect();
    assert!(
        distinct.len() >= 45,
        "only {} distinct replies",
        distinct.len()
    );
}

#[test]
fn reply_lengths_are_checked() {
    let f = fixture();
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    assert!(f.replies.max_tokens() >= 16_000);
    assert!(f.replies.generate(0, 0, &mut rng).unwrap().ids.is_empty());
    assert!(matches!(
        f.replies.generate(0, f.replies.max_tokens() + 1, &mut rng),
        Err(TextError::ReplyTooLong { .. })
    ));
    assert!(matches!(
        f.replies.generate(10, 5, &mut rng),
        Err(TextError::UnknownPassage {
            index: 10,
            count: 10
        })
    ));
    // The longest reply still has the exact length.
    let longest = f.replies.max_tokens();
    assert_eq!(
        f.replies.generate(0, longest, &mut rng).unwrap().ids.len(),
        longest
    );
}

#[test]
fn questions_are_readable_sized_and_mention_the_last_answer() {
    let tokenizer = Tokenizer::builtin();
    let f = fixture();
    let terms = f.questions.terms();
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let mut lengths = Vec::new();
    let mut distinct = std::collections::BTreeSet::new();
    for i in 0..2_000 {
        let passage = i % 10;
        let q = if i % 5 == 0 {
            f.questions.first_question(passage, &mut rng)
        } else {
            let topic = i % terms.of(passage).len();
            let q = f.questions.follow_up(passage, Some(topic), &mut rng);
            let term = &terms.of(passage)[topic].display;
            // Templates name the answer's term unless they are about two passage terms.
            if q.contains("You mentioned") {
                assert!(q.contains(term.as_str()), "{q} / {term}");
            }
            q
        };
        assert!(q.ends_with(['?', '.']), "{q}");
        assert!(!q.contains('{'), "unfilled template: {q}");
        lengths.push(tokenizer.encode(&q).len());
        distinct.insert(q);
    }
    let min = *lengths.iter().min().unwrap();
    let max = *lengths.iter().max().unwrap();
    let mean = lengths.iter().sum::<usize>() as f64 / lengths.len() as f64;
    assert!(min >= 15 && max <= 60, "question lengths {min}..{max}");
    assert!((22.0..=40.0).contains(&mean), "mean question length {mean}");
    assert!(
        distinct.len() > 1_500,
        "{} distinct questions",
        distinct.len()
    );
}

#[test]
fn follow_up_to_text_picks_a_term_the_answer_mentions() {
    let f = fixture();
    let terms = f.questions.terms().of(2);
    let answer = format!("Blah blah {} and more.", terms[5].display);
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let mentioned = (0..40)
        .map(|_| f.questions.follow_up_to_text(2, &answer, &mut rng))
        .filter(|q| q.contains(terms[5].display.as_str()))
        .count();
    assert!(
        mentioned >= 20,
        "{mentioned} of 40 questions name the answer's term"
    );
}

#[test]
fn pretokenized_questions_equal_encoding_their_text() {
    let tokenizer = Tokenizer::builtin();
    let f = fixture();
    let mut rng = ChaCha8Rng::seed_from_u64(17);
    for passage in 0..f.corpus.len() {
        let term_count = f.questions.terms().of(passage).len();
        for i in 0..3_000 {
            let plan = if i % 6 == 0 {
                f.questions.plan_first(passage, &mut rng)
            } else {
                // Every term of the passage as the answer's topic, and none.
                let topic = (i % (term_count + 1) < term_count).then_some(i % (term_count + 1));
                f.questions.plan_follow_up(passage, topic, &mut rng)
            };
            let text = f.questions.text(&plan);
            let mut ids = Vec::new();
            f.questions.push_tokens(&plan, &mut ids);
            assert_eq!(ids, tokenizer.encode(&text), "{text:?}");
            // After the user header's "\n\n" too (how the workload assembles a message).
            let mut in_message = tokenizer.encode("\n\n");
            in_message.extend_from_slice(&ids);
            assert_eq!(in_message, tokenizer.encode(&format!("\n\n{text}")));
        }
    }
}
