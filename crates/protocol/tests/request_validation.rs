//! Requests OpenAI refuses are refused here too, with a 400 that names what is wrong: both
//! servers (gateway and engine) parse requests through `protocol::http::parse_json`.

use protocol::ChatCompletionRequest;
use protocol::http::parse_json;

fn refusal(body: &str) -> String {
    match parse_json::<ChatCompletionRequest>(body.as_bytes()) {
        Ok(r) => panic!("accepted {body}: {r:?}"),
        Err(e) => {
            assert_eq!(e.status, 400, "{body}");
            e.detail.message
        }
    }
}

#[test]
fn bad_chat_requests_get_a_400_naming_the_problem() {
    let cases = [
        (r#"{"model":"m","messages":[]}"#, "at least one message"),
        (
            r#"{"model":"m","messages":[{"role":"robot","content":"hi"}]}"#,
            "messages[0].role `robot` is not one of",
        ),
        (
            r#"{"model":"m","messages":[{"role":"system","content":"s"},{"role":"user"}]}"#,
            "messages[1] (user message) has no content",
        ),
        (
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":-0.5}"#,
            "`temperature` is -0.5; it must be between 0 and 2",
        ),
        (
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":2.5}"#,
            "between 0 and 2",
        ),
        (
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"top_p":0}"#,
            "`top_p` is 0; it must be above 0 and at most 1",
        ),
        (
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":-4}"#,
            "invalid value: integer `-4`",
        ),
        (
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}"#,
            "not valid JSON",
        ),
    ];
    for (body, expected) in cases {
        let message = refusal(body);
        assert!(message.contains(expected), "{body}: {message}");
    }
}

#[test]
fn what_openai_accepts_still_parses() {
    for body in [
        // An assistant message that only calls tools has no content.
        r#"{"model":"m","messages":[{"role":"user","content":"hi"},{"role":"assistant","tool_calls":[]},{"role":"tool","content":"42","tool_call_id":"a"}]}"#,
        r#"{"model":"m","messages":[{"role":"developer","content":"be brief"},{"role":"user","content":[{"type":"text","text":"hi"}]}],"temperature":0,"top_p":1}"#,
        r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":2,"top_p":0.1}"#,
    ] {
        assert!(
            parse_json::<ChatCompletionRequest>(body.as_bytes()).is_ok(),
            "{body}"
        );
    }
}
