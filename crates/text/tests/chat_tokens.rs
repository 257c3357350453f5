//! `ChatTokens` (incremental) equals tokenizing the whole rendered conversation.

use proptest::prelude::*;
use text::{ChatMessage, ChatTemplate, ChatTokens, Tokenizer};

/// Text made of pieces that stress the pre-tokenizer at message boundaries: whitespace of all
/// kinds at either end, newlines, unicode, digits, contractions, and special-token text.
fn content() -> impl Strategy<Value = String> {
    let fragment = prop_oneof![
        Just(String::new()),
        Just(" ".to_owned()),
        Just("  ".to_owned()),
        Just("\n".to_owned()),
        Just("\n\n".to_owned()),
        Just("\r\n".to_owned()),
        Just("\t".to_owned()),
        Just("\u{a0}".to_owned()),
        Just("\u{3000}".to_owned()),
        Just("hello".to_owned()),
        Just("KV-cache".to_owned()),
        Just("'s".to_owned()),
        Just("12345".to_owned()),
        Just("...".to_owned()),
        Just("ünïcödé".to_owned()),
        Just("日本語".to_owned()),
        Just("🚀".to_owned()),
        Just("<|eot_id|>".to_owned()),
        Just("<|start_header_id|>".to_owned()),
        Just("<|begin_of_text|>".to_owned()),
        Just("<|eot_id".to_owned()),
        "[ -~]{0,12}",
        "\\PC{0,6}",
    ];
    prop::collection::vec(fragment, 0..10).prop_map(|parts| parts.concat())
}

fn message() -> impl Strategy<Value = ChatMessage> {
    let role = prop_oneof![
        Just("system".to_owned()),
        Just("user".to_owned()),
        Just("assistant".to_owned()),
        Just("tool".to_owned()),
    ];
    (role, content()).prop_map(|(role, content)| ChatMessage { role, content })
}

#[derive(Clone, Debug)]
enum Step {
    Push(ChatMessage),
    GenerationPrompt,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => message().prop_map(Step::Push),
        1 => Just(Step::GenerationPrompt),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn incremental_equals_render_then_encode(steps in prop::collection::vec(step(), 0..8)) {
        let tokenizer = Tokenizer::builtin();
        let template = ChatTemplate::llama3();
        let mut chat = ChatTokens::new(tokenizer.clone()).unwrap();
        let mut messages = Vec::new();
        for step in steps {
            let open = match step {
                Step::Push(m) => {
                    chat.push(&m);
                    messages.push(m);
                    false
                }
                Step::GenerationPrompt => {
                    chat.push_generation_prompt();
                    true
                }
            };
            let full = tokenizer.encode(&template.render(&messages, open).unwrap());
            prop_assert_eq!(chat.ids(), full.as_slice());
        }
    }
}

#[test]
fn generation_prompt_is_idempotent_and_replaced_by_the_next_message() {
    let tokenizer = Tokenizer::builtin();
    let template = ChatTemplate::llama3();
    let mut chat = ChatTokens::new(tokenizer.clone()).unwrap();
    let user = ChatMessage::user("hi");
    chat.push(&user);
    chat.push_generation_prompt();
    chat.push_generation_prompt();
    assert_eq!(
        chat.ids(),
        tokenizer
            .encode(&template.render(std::slice::from_ref(&user), true).unwrap())
            .as_slice()
    );
    let prompt = chat.ids().to_vec();
    let answer = ChatMessage::assistant("hello there");
    chat.push(&answer);
    // An assistant message keeps the open header as its own: the prompt is a prefix.
    assert!(chat.ids().starts_with(&prompt));
    assert_eq!(
        chat.ids(),
        tokenizer
            .encode(&template.render(&[user, answer], false).unwrap())
            .as_slice()
    );
}
