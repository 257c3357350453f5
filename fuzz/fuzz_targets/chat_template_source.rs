//! Chat templates from files (`text::ChatTemplate::from_source`): an operator's Jinja source,
//! which minijinja compiles and runs with the fuel, recursion limit and smoke render that
//! `text::template` sets.
//!
//! Properties: loading and rendering never panic and finish within the fuel (libFuzzer's
//! `-timeout` catches a hang); a template that loads renders a small chat or returns a clean
//! error, which is the template's own failure or its refusal, never anything else; rendering
//! is pure (the same chat renders the same text twice); the rendered text stays within what
//! the fuel can pay for (64 bytes per unit); the gateway's `Preprocessor` over it gives the
//! rendered text's ids for every chat ending, or the same clean error.

#![no_main]

use libfuzzer_sys::fuzz_target;
use text::{ChatEnding, ChatMessage, ChatTemplate, Preprocessor, Tokenizer};

fuzz_target!(|bytes: &[u8]| {
    let source = String::from_utf8_lossy(bytes);
    let Ok(template) = ChatTemplate::from_source(source.as_ref(), "<s>", "</s>") else {
        return;
    };
    let chats = [
        vec![ChatMessage::user("Hello.")],
        vec![
            ChatMessage::system("Be brief."),
            ChatMessage::user("What is a KV cache?"),
            ChatMessage::assistant("Stored keys and values."),
            ChatMessage::user("  and prefix caching?\n"),
        ],
    ];
    for messages in &chats {
        for generation_prompt in [true, false] {
            let first = template.render(messages, generation_prompt);
            let again = template.render(messages, generation_prompt);
            match (&first, &again) {
                (Ok(a), Ok(b)) => {
                    assert_eq!(a, b, "rendering is pure");
                    let fuel = text::fuel_for(messages);
                    assert!(
                        (a.len() as u64) <= fuel * 64,
                        "{} bytes out of {fuel} fuel",
                        a.len()
                    );
                }
                (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string()),
                _ => panic!("one render failed, the other not: {first:?} {again:?}"),
            }
        }
    }
    let preprocessor = Preprocessor::new(Tokenizer::builtin(), template);
    for ending in [
        ChatEnding::GenerationPrompt,
        ChatEnding::Closed,
        ChatEnding::ContinueFinal,
    ] {
        if let Ok(prepared) = preprocessor.chat_ending(&chats[1], ending, true) {
            let text = prepared.text.expect("asked for the text");
            assert_eq!(prepared.tokens, preprocessor.text(&text));
        }
    }
});
