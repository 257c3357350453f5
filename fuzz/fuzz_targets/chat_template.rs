//! Chat-template rendering and tokenization (`text`): the gateway's `Preprocessor` with the
//! built-in Llama-3 template, on any messages a client can send.
//!
//! Properties: rendering never panics; for every chat ending the fast path's token ids (each
//! message encoded on its own, cached when long) equal encoding the rendered text as a whole,
//! and the incremental `ChatTokens` agree; a message seen twice (from the cache) gives the
//! same ids as the first time; the rendered text starts with `<|begin_of_text|>` and holds
//! every message's trimmed content.

#![no_main]

use std::sync::OnceLock;

use arbitrary::Unstructured;
use libfuzzer_sys::fuzz_target;
use text::{BEGIN_OF_TEXT, ChatEnding, ChatMessage, ChatTokens, Preprocessor};

/// One preprocessor for the whole run, as in the gateway: its message cache carries over.
fn preprocessor() -> &'static Preprocessor {
    static P: OnceLock<Preprocessor> = OnceLock::new();
    P.get_or_init(Preprocessor::builtin)
}

const ROLES: [&str; 6] = [
    "system",
    "developer",
    "user",
    "assistant",
    "tool",
    "function",
];

fn messages(u: &mut Unstructured) -> arbitrary::Result<Vec<ChatMessage>> {
    let mut out = Vec::new();
    for _ in 0..u.int_in_range(0..=5)? {
        let role = if u.ratio(7, 8)? {
            (*u.choose(&ROLES)?).to_owned()
        } else {
            u.arbitrary()?
        };
        let mut content: String = u.arbitrary()?;
        // Long messages go through the cache (256 bytes and up).
        if u.ratio(1, 8)? {
            content = content.repeat(1 + 300 / (content.len() + 1));
        }
        out.push(ChatMessage { role, content });
    }
    Ok(out)
}

fn run(u: &mut Unstructured) -> arbitrary::Result<()> {
    let messages = messages(u)?;
    let p = preprocessor();
    let tokenizer = p.tokenizer();
    for ending in [
        ChatEnding::GenerationPrompt,
        ChatEnding::Closed,
        ChatEnding::ContinueFinal,
    ] {
        let prepared = match p.chat_ending(&messages, ending, true) {
            Ok(prepared) => prepared,
            // The built-in template formats any role and content.
            Err(e) => panic!("{ending:?}: {e} for {messages:?}"),
        };
        let text = prepared.text.as_deref().expect("text was asked for");
        assert!(text.starts_with(BEGIN_OF_TEXT), "{text:?}");
        assert_eq!(
            prepared.tokens,
            tokenizer.encode(text),
            "{ending:?}: the fast path and the rendered text differ for {messages:?}: {text:?}"
        );
        if ending != ChatEnding::ContinueFinal {
            for m in &messages {
                assert!(
                    text.contains(m.content.trim()),
                    "{text:?} lacks {:?}",
                    m.content
                );
            }
        }
        // Again: long messages now come from the cache.
        let again = p
            .chat_ending(&messages, ending, false)
            .expect("it formatted the first time");
        assert_eq!(again.tokens, prepared.tokens, "{ending:?}: from the cache");
    }
    let mut chat =
        ChatTokens::new(tokenizer.clone()).expect("the built-in tokenizer has the specials");
    for m in &messages {
        chat.push(m);
    }
    chat.push_generation_prompt();
    let with_prompt = p.chat(&messages, false).expect("formatted above");
    assert_eq!(
        chat.ids(),
        with_prompt.tokens.as_slice(),
        "ChatTokens for {messages:?}"
    );
    Ok(())
}

fuzz_target!(|data: &[u8]| {
    let _ = run(&mut Unstructured::new(data));
});
