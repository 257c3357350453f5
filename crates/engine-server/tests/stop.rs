//! OpenAI's `stop` over real loopback HTTP: the reply ends just before the first stop string
//! (not returned), `finish_reason` is `stop`, usage and `token_ids` count only the tokens
//! generated up to it, and the engine stops generating there; streamed replies hold back text
//! that may begin a stop string, across chunk boundaries, and release it when it does not;
//! both endpoints, a token-id prompt included; bad `stop` values are 400s naming the field.

mod common;

use std::time::Duration;

use common::{MODEL, config, metric, post, post_json, post_ok, read_sse, start, wait_for_metric};
use serde_json::{Value, json};

/// A prompt of token ids: the gateway's form, where the engine never sees the prompt's text.
fn token_prompt() -> Value {
    json!([
        1734, 374, 264, 2875, 922, 85748, 6956, 13, 6075, 433, 757, 304, 7872
    ])
}

/// A word of the reply's second half, at least 5 bytes long, with where it first appears:
/// a stop string the reply reaches well after its start.
fn word_in(text: &str) -> (String, usize) {
    text.split_whitespace()
        .map(|w| w.trim_matches(|c: char| !c.is_alphanumeric()))
        .filter(|w| w.len() >= 5)
        .find_map(|w| {
            let at = text.find(w)?;
            (at > text.len() / 2).then(|| (w.to_owned(), at))
        })
        .unwrap_or_else(|| panic!("no word of 5+ bytes first appearing in the second half: {text}"))
}

async fn detokenize(base: &str, ids: &[u64]) -> String {
    let body = post_json(base, "/detokenize", &json!({"tokens": ids})).await;
    body["prompt"]
        .as_str()
        .expect("detokenized text")
        .to_owned()
}

fn ids_of(choice: &Value) -> Vec<u64> {
    choice["token_ids"]
        .as_array()
        .expect("token_ids")
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect()
}

/// The text, token ids, finish reason and usage of a streamed completion; with `stop`, checks
/// that no chunk but the last left the text sent ending with the start of a stop string (it
/// is held back until the reply shows it is not one).
async fn stream_completion(base: &str, request: &Value) -> (String, Vec<u64>, String, Value) {
    let mut streamed = request.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let events = read_sse(post_ok(base, "/v1/completions", &streamed).await).await;
    let (usage, chunks) = events.split_last().expect("chunks and a usage chunk");
    let text = chunks
        .iter()
        .map(|c| c["choices"][0]["text"].as_str().unwrap())
        .collect();
    let ids = chunks
        .iter()
        .flat_map(|c| ids_of(&c["choices"][0]))
        .collect();
    let stops: Vec<&str> = match &request["stop"] {
        Value::String(one) => vec![one.as_str()],
        Value::Array(many) => many.iter().filter_map(Value::as_str).collect(),
        _ => Vec::new(),
    };
    let mut sent = String::new();
    for chunk in &chunks[..chunks.len() - 1] {
        sent.push_str(chunk["choices"][0]["text"].as_str().unwrap());
        for stop in &stops {
            for n in (1..stop.len()).filter(|&n| stop.is_char_boundary(n)) {
                assert!(
                    !sent.ends_with(&stop[..n]),
                    "a chunk sent {:?}, the start of stop string {stop:?}, before the reply \
                     showed whether it is one: {sent:?}",
                    &stop[..n]
                );
            }
        }
    }
    let last = chunks.last().expect("a chunk");
    assert!(
        chunks[..chunks.len() - 1]
            .iter()
            .all(|c| c["choices"][0]["finish_reason"].is_null()),
        "only the last chunk ends the reply"
    );
    (
        text,
        ids,
        last["choices"][0]["finish_reason"]
            .as_str()
            .expect("a finish reason")
            .to_owned(),
        usage["usage"].clone(),
    )
}

#[tokio::test]
async fn a_stop_string_ends_the_reply_before_it_and_the_engine_generates_no_further() {
    let (_server, base) = start(config(1_000.0)).await;
    let request = json!({"model": MODEL, "prompt": token_prompt(), "max_tokens": 200,
                         "ignore_eos": true, "return_token_ids": true});
    let full = post_json(&base, "/v1/completions", &request).await;
    let text = full["choices"][0]["text"].as_str().unwrap().to_owned();
    let full_ids = ids_of(&full["choices"][0]);
    assert_eq!(full_ids.len(), 200);
    let (stop, at) = word_in(&text);

    // A list holding one string that occurs, and one that never does.
    let mut stopped = request.clone();
    stopped["stop"] = json!(["never-in-this-reply-\u{1F600}", stop]);
    let body = post_json(&base, "/v1/completions", &stopped).await;
    let choice = &body["choices"][0];
    assert_eq!(choice["text"].as_str(), Some(&text[..at]), "{body}");
    assert_eq!(choice["finish_reason"], "stop", "{body}");
    // The tokens generated: the reply's own, up to the one that completes the stop string.
    let ids = ids_of(choice);
    let k = ids.len();
    assert_eq!(ids, full_ids[..k], "{body}");
    assert_eq!(body["usage"]["completion_tokens"], k, "{body}");
    assert!(k < 200, "{body}");
    assert!(detokenize(&base, &ids).await.contains(stop.as_str()));
    assert!(
        !detokenize(&base, &ids[..k - 1])
            .await
            .contains(stop.as_str())
    );
    // The engine finished the request there: it generated 200 tokens for the first request
    // and k for the second, nothing more.
    wait_for_metric(
        &base,
        "vllm:generation_tokens_total",
        (200 + k) as f64,
        Duration::from_secs(5),
    )
    .await;
    assert_eq!(metric(&base, "vllm:num_requests_running").await, Some(0.0));
    assert_eq!(metric(&base, "vllm:request_success_total").await, Some(2.0));

    // Streamed: the same text, tokens, reason and usage.
    let (streamed_text, streamed_ids, reason, usage) = stream_completion(&base, &stopped).await;
    assert_eq!(streamed_text, &text[..at]);
    assert_eq!(streamed_ids, ids);
    assert_eq!(reason, "stop");
    assert_eq!(usage["completion_tokens"], k, "{usage}");
}

/// A stop string across two tokens' text is held back from the first token on, and never
/// sent; one that starts like the reply but never completes is held, then sent whole.
#[tokio::test]
async fn streams_hold_back_a_possible_stop_string_across_chunks() {
    // Slow enough (about 3 ms a token) for tokens to arrive in chunks of their own.
    let (_server, base) = start(config(10.0)).await;
    let request = json!({"model": MODEL, "prompt": token_prompt(), "max_tokens": 120,
                         "ignore_eos": true, "return_token_ids": true});
    let full = post_json(&base, "/v1/completions", &request).await;
    let text = full["choices"][0]["text"].as_str().unwrap().to_owned();
    let full_ids = ids_of(&full["choices"][0]);
    // A token boundary in the reply's second half where the four bytes on each side occur
    // nowhere earlier.
    let mut straddling = None;
    for i in 60..110 {
        let boundary = detokenize(&base, &full_ids[..i]).await.len();
        let Some(candidate) = text.get(boundary.saturating_sub(4)..boundary + 4) else {
            continue;
        };
        if boundary >= 4 && text.find(candidate) == Some(boundary - 4) {
            straddling = Some((candidate.to_owned(), boundary - 4));
            break;
        }
    }
    let (stop, at) = straddling.expect("a stop string across a token boundary");

    let mut stopped = request.clone();
    stopped["stop"] = json!(stop);
    let (streamed, ids, reason, usage) = stream_completion(&base, &stopped).await;
    assert_eq!(streamed, &text[..at], "stop {stop:?}");
    assert_eq!(reason, "stop");
    assert_eq!(ids, full_ids[..ids.len()]);
    assert_eq!(usage["completion_tokens"], ids.len(), "{usage}");
    assert!(ids.len() < 120);

    // The reply's own text then a character it never has: held at the boundary, released.
    let mut unmatched = request.clone();
    unmatched["stop"] = json!([format!("{}\u{7}", &text[at..at + 4])]);
    let (streamed, ids, reason, usage) = stream_completion(&base, &unmatched).await;
    assert_eq!(streamed, text);
    assert_eq!(ids, full_ids);
    assert_eq!(reason, "length");
    assert_eq!(usage["completion_tokens"], 120, "{usage}");
}

#[tokio::test]
async fn chat_replies_stop_too_streamed_or_not() {
    let (_server, base) = start(config(1_000.0)).await;
    let request = json!({"model": MODEL, "max_tokens": 150, "ignore_eos": true,
        "messages": [{"role": "user", "content": "How does a KV-aware router pick a worker?"}]});
    let full = post_json(&base, "/v1/chat/completions", &request).await;
    let text = full["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    let (stop, at) = word_in(&text);

    let mut stopped = request.clone();
    stopped["stop"] = json!(stop);
    let body = post_json(&base, "/v1/chat/completions", &stopped).await;
    assert_eq!(
        body["choices"][0]["message"]["content"].as_str(),
        Some(&text[..at]),
        "{body}"
    );
    assert_eq!(body["choices"][0]["finish_reason"], "stop", "{body}");
    let tokens = body["usage"]["completion_tokens"].as_u64().unwrap();
    assert!(tokens < 150, "{body}");

    stopped["stream"] = json!(true);
    stopped["stream_options"] = json!({"include_usage": true});
    let events = read_sse(post_ok(&base, "/v1/chat/completions", &stopped).await).await;
    let (usage, chunks) = events.split_last().unwrap();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let streamed: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(streamed, &text[..at]);
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "stop"
    );
    assert_eq!(usage["usage"]["completion_tokens"], tokens);
}

#[tokio::test]
async fn bad_stop_values_are_400s_naming_the_field() {
    let (_server, base) = start(config(1_000.0)).await;
    let prompt = "Explain prefix caching.";
    for (stop, says) in [
        (json!(["a", "b", "c", "d", "e"]), "at most 4"),
        (json!(""), "must not be empty"),
        (json!(["x", ""]), "must not be empty"),
        (json!(5), "stop"),
        (json!([1, 2]), "stop"),
        (json!({"text": "x"}), "stop"),
    ] {
        for path in ["/v1/completions", "/v1/chat/completions"] {
            let body = match path {
                "/v1/completions" => json!({"model": MODEL, "prompt": prompt, "stop": stop}),
                _ => json!({"model": MODEL, "stop": stop,
                            "messages": [{"role": "user", "content": prompt}]}),
            };
            let response = post(&base, path, &body).await;
            assert_eq!(response.status(), 400, "{path} {stop}");
            let error: Value = response.json().await.unwrap();
            assert_eq!(
                error["error"]["type"], "invalid_request_error",
                "{path} {stop}: {error}"
            );
            // A value of another type fails as the body is read, with `Stop`'s own message.
            let message = error["error"]["message"].as_str().unwrap().to_lowercase();
            assert!(message.contains(says), "{path} {stop}: {error}");
            if stop.is_array() && stop.as_array().unwrap().iter().all(Value::is_string)
                || stop.is_string()
            {
                assert_eq!(error["error"]["param"], "stop", "{path} {stop}: {error}");
            }
        }
    }
    // No stop, an empty list, or null: the usual reply.
    for stop in [json!(null), json!([])] {
        let body = post_json(
            &base,
            "/v1/completions",
            &json!({"model": MODEL, "prompt": prompt, "max_tokens": 20, "ignore_eos": true,
                    "stop": stop}),
        )
        .await;
        assert_eq!(body["choices"][0]["finish_reason"], "length", "{body}");
        assert_eq!(body["usage"]["completion_tokens"], 20, "{body}");
    }
}
