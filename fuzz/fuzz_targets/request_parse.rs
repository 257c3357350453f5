//! The OpenAI request parser as both HTTP servers run it (`protocol::http::parse_json`, then
//! the gateway's chat preparation).
//!
//! Properties: it never panics; every refusal is an OpenAI error with a 4xx status whose body
//! reads back as the same error; an accepted request, serialized (as the gateway forwards
//! fields it does not interpret), parses back to the same request; an accepted chat renders
//! through the built-in template or is refused with an error (never a panic).

#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use protocol::http::parse_json;
use protocol::{ApiError, ChatCompletionRequest, CompletionRequest};
use serde::Serialize;
use serde::de::DeserializeOwned;

fn preprocessor() -> &'static text::Preprocessor {
    static P: OnceLock<text::Preprocessor> = OnceLock::new();
    P.get_or_init(text::Preprocessor::builtin)
}

fn check_refusal(error: &ApiError, input: &[u8]) {
    assert!(
        (400..500).contains(&error.status),
        "refused with status {} (not 4xx): {error} for {:?}",
        error.status,
        String::from_utf8_lossy(input)
    );
    assert!(
        !error.detail.message.is_empty(),
        "an error without a message"
    );
    let json = error.to_json();
    let back = ApiError::from_body(error.status, json.as_bytes());
    assert_eq!(&back, error, "the error JSON does not read back: {json}");
}

/// Parses `input` as `T`; a refusal must be a clean 4xx. An accepted request must survive
/// serialize → parse unchanged.
fn parse<T>(input: &[u8]) -> Option<T>
where
    T: DeserializeOwned + Serialize + PartialEq + std::fmt::Debug,
{
    match parse_json::<T>(input) {
        Ok(request) => {
            let json = serde_json::to_vec(&request).expect("a parsed request serializes");
            match parse_json::<T>(&json) {
                Ok(again) => assert_eq!(
                    again,
                    request,
                    "re-serialized as {}",
                    String::from_utf8_lossy(&json)
                ),
                Err(e) => panic!(
                    "a parsed request, serialized, is refused: {e}: {}",
                    String::from_utf8_lossy(&json)
                ),
            }
            Some(request)
        }
        Err(error) => {
            check_refusal(&error, input);
            None
        }
    }
}

fuzz_target!(|input: &[u8]| {
    if let Some(chat) = parse::<ChatCompletionRequest>(input) {
        // What the gateway's `prepare` does with it.
        let messages: Vec<text::ChatMessage> = chat
            .messages
            .iter()
            .map(|m| text::ChatMessage::new(m.role.clone(), m.text()))
            .collect();
        let _ = preprocessor().chat(&messages, true);
        let _ = chat.params.max_output_tokens();
    }
    if let Some(completion) = parse::<CompletionRequest>(input) {
        let _ = completion.prompt.len();
    }
});
