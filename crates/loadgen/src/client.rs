//! One streamed chat turn against an OpenAI-compatible endpoint, measured as the client sees
//! it, and the user model's question.

use std::time::{Duration, Instant};

use futures::StreamExt;
use protocol::sse::{SseDecoder, SseEvent};
use protocol::{ResponseView, Usage};

/// What a successful turn measured and returned.
#[derive(Clone, Debug, PartialEq)]
pub struct TurnResult {
    /// Send to the first chunk with content.
    pub ttft: Duration,
    /// Send to the end of the stream.
    pub e2e: Duration,
    /// Mean time per token between the first and the last content chunk, as the client saw
    /// them: (last − first) / (tokens − 1); `None` with fewer than two chunks.
    pub itl: Option<Duration>,
    /// Output tokens: the usage chunk's count, else the number of content chunks.
    pub output_tokens: u64,
    /// The reply's text, cut at the text bound (`text_truncated`).
    pub text: String,
    pub text_truncated: bool,
    /// The gateway's `x-kvroute-worker` header.
    pub worker: Option<String>,
    /// `usage.prompt_tokens_details.cached_tokens` when the server reports it.
    pub cached_tokens: Option<u64>,
    pub prompt_tokens: Option<u64>,
}

impl TurnResult {
    /// (E2E − TTFT) / (tokens − 1), the seed's definition; `None` for one token.
    pub fn tpot(&self) -> Option<Duration> {
        (self.output_tokens > 1)
            .then(|| self.e2e.saturating_sub(self.ttft) / (self.output_tokens - 1) as u32)
    }
}

/// Why a turn failed.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum TurnError {
    #[error("HTTP {status}: {message}")]
    Status { status: u16, message: String },
    #[error("connection: {0}")]
    Transport(String),
    #[error("stream: {0}")]
    Stream(String),
    #[error("no reply within {0:?}")]
    Timeout(Duration),
    #[error("the stream ended without content")]
    Empty,
}

/// What stands in for an API key found in text that came back from upstream.
pub const REDACTED: &str = "[redacted]";

/// `text` with every occurrence of `key` replaced by [`REDACTED`]. An upstream may echo the
/// key it was sent (an error such as "Incorrect API key provided: …"); what it says reaches
/// the logs, `/api/status`, the WebSocket and the page, the key must not.
pub fn redact(text: &str, key: Option<&str>) -> String {
    match key {
        Some(key) if !key.is_empty() && text.contains(key) => text.replace(key, REDACTED),
        _ => text.to_owned(),
    }
}

/// `err` with the key redacted from every message it carries.
fn redact_error(err: TurnError, key: Option<&str>) -> TurnError {
    match err {
        TurnError::Status { status, message } => TurnError::Status {
            status,
            message: redact(&message, key),
        },
        TurnError::Transport(m) => TurnError::Transport(redact(&m, key)),
        TurnError::Stream(m) => TurnError::Stream(redact(&m, key)),
        other @ (TurnError::Timeout(_) | TurnError::Empty) => other,
    }
}

/// Longest error body read from a failed response.
const MAX_ERROR_BODY: usize = 8 << 10;

/// The message of an OpenAI error body, else the body itself (cut).
fn error_message(body: &[u8]) -> String {
    if let Ok(value) = serde_json::from_slice::<serde_json::Value>(body) {
        if let Some(message) = value
            .pointer("/error/message")
            .or_else(|| value.pointer("/message"))
            .and_then(|m| m.as_str())
        {
            return message.to_owned();
        }
    }
    let text = String::from_utf8_lossy(&body[..body.len().min(300)]);
    if text.trim().is_empty() {
        "(empty body)".to_owned()
    } else {
        text.into_owned()
    }
}

/// What a 404 says besides the server's message: the URL asked, and the two usual causes (a
/// target with a path, `/v1` above all, and a model the server does not serve).
fn not_found_hint(url: &str) -> String {
    format!(
        " (POST {url}: is the target the server's base URL, without /v1 or another path, and \
         the model one it serves?)"
    )
}

/// Posts `body` (a chat request with `"stream": true`) to `url` and reads the stream to its
/// end, measuring TTFT, ITL and E2E from the moment the request is sent. `max_text` bounds
/// the reply text kept (bytes); tokens are still counted past it.
pub async fn stream_turn(
    client: &reqwest::Client,
    url: &str,
    api_key: Option<&str>,
    body: Vec<u8>,
    timeout: Duration,
    max_text: usize,
) -> Result<TurnResult, TurnError> {
    match tokio::time::timeout(timeout, stream_inner(client, url, api_key, body, max_text)).await {
        Ok(result) => result.map_err(|e| redact_error(e, api_key)),
        Err(_) => Err(TurnError::Timeout(timeout)),
    }
}

async fn stream_inner(
    client: &reqwest::Client,
    url: &str,
    api_key: Option<&str>,
    body: Vec<u8>,
    max_text: usize,
) -> Result<TurnResult, TurnError> {
    let mut request = client
        .post(url)
        .header(reqwest::header::CONTENT_TYPE, "application/json")
        .header(reqwest::header::ACCEPT, "text/event-stream")
        .body(body);
    if let Some(key) = api_key {
        request = request.bearer_auth(key);
    }
    let sent = Instant::now();
    let response = request
        .send()
        .await
        .map_err(|e| TurnError::Transport(error_chain(&e)))?;
    let status = response.status();
    if !status.is_success() {
        let mut body = Vec::new();
        let mut stream = response.bytes_stream();
        while let Some(Ok(chunk)) = stream.next().await {
            body.extend_from_slice(&chunk[..chunk.len().min(MAX_ERROR_BODY - body.len())]);
            if body.len() >= MAX_ERROR_BODY {
                break;
            }
        }
        let mut message = error_message(&body);
        if status == reqwest::StatusCode::NOT_FOUND {
            message.push_str(&not_found_hint(url));
        }
        return Err(TurnError::Status {
            status: status.as_u16(),
            message,
        });
    }
    let worker = response
        .headers()
        .get("x-kvroute-worker")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let mut decoder = SseDecoder::default();
    let mut stream = response.bytes_stream();
    let mut first: Option<Instant> = None;
    let mut last = sent;
    let mut content_chunks: u64 = 0;
    let mut text = String::new();
    let mut text_truncated = false;
    let mut usage: Option<Usage> = None;
    let mut done = false;
    while let Some(bytes) = stream.next().await {
        let bytes = bytes.map_err(|e| TurnError::Transport(error_chain(&e)))?;
        let now = Instant::now();
        decoder
            .push(&bytes)
            .map_err(|e| TurnError::Stream(e.to_string()))?;
        while let Some(event) = decoder.next_event() {
            let payload = match event {
                SseEvent::Done => {
                    done = true;
                    continue;
                }
                SseEvent::Data(payload) => payload,
            };
            let chunk: ResponseView<'_> = serde_json::from_str(payload)
                .map_err(|e| TurnError::Stream(format!("a chunk is not JSON: {e}")))?;
            if let Some(error) = chunk.error {
                return Err(TurnError::Stream(error.message));
            }
            for choice in &chunk.choices {
                let content = choice.content();
                if content.is_empty() {
                    continue;
                }
                content_chunks += 1;
                first.get_or_insert(now);
                last = now;
                push_bounded(&mut text, content, max_text, &mut text_truncated);
            }
            if chunk.usage.is_some() {
                usage = chunk.usage;
            }
        }
    }
    let end = Instant::now();
    let Some(first) = first else {
        return Err(if done {
            TurnError::Empty
        } else {
            TurnError::Stream("the stream ended early".into())
        });
    };
    if !done {
        return Err(TurnError::Stream(
            "the stream ended before [DONE]".to_owned(),
        ));
    }
    let output_tokens = usage
        .map_or(content_chunks, |u| u64::from(u.completion_tokens))
        .max(1);
    Ok(TurnResult {
        ttft: first - sent,
        e2e: end - sent,
        // Per token, not per chunk: a server may pack several tokens in one chunk (speculative
        // decoding, a relay catching up), which would inflate a per-chunk gap.
        itl: (content_chunks > 1 && output_tokens > 1)
            .then(|| (last - first) / (output_tokens - 1) as u32),
        output_tokens,
        text,
        text_truncated,
        worker,
        cached_tokens: usage
            .and_then(|u| u.prompt_tokens_details)
            .map(|d| u64::from(d.cached_tokens)),
        prompt_tokens: usage.map(|u| u64::from(u.prompt_tokens)),
    })
}

fn push_bounded(text: &mut String, content: &str, max: usize, truncated: &mut bool) {
    if text.len() + content.len() <= max {
        text.push_str(content);
        return;
    }
    let mut cut = max.saturating_sub(text.len());
    while cut > 0 && !content.is_char_boundary(cut) {
        cut -= 1;
    }
    text.push_str(&content[..cut]);
    *truncated = true;
}

/// An error and its causes on one line (reqwest hides the useful part in `source`).
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut out = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = cause.source();
    }
    out
}

/// Asks a user model (any OpenAI-compatible chat endpoint, not streamed) for the next
/// question of a conversation about `topic`, given the assistant's last answer.
pub async fn ask_user_model(
    client: &reqwest::Client,
    url: &str,
    model: &str,
    api_key: Option<&str>,
    topic: &str,
    answer: &str,
    timeout: Duration,
) -> Result<String, TurnError> {
    let excerpt: String = answer.chars().take(4_000).collect();
    let body = serde_json::json!({
        "model": model,
        "messages": [
            {"role": "system", "content": format!(
                "You are a curious engineer reading a technical document about {topic} and \
                 chatting with an assistant about it. Reply with exactly one short follow-up \
                 question (one or two sentences) about something specific in the assistant's \
                 last answer. Output only the question.")},
            {"role": "user", "content": format!("The assistant's last answer:\n\n{excerpt}")}
        ],
        "max_tokens": 96,
        "temperature": 0.8,
        "stream": false
    });
    let mut request = client.post(url).json(&body);
    if let Some(key) = api_key {
        request = request.bearer_auth(key);
    }
    let call = async {
        let response = request
            .send()
            .await
            .map_err(|e| TurnError::Transport(error_chain(&e)))?;
        let status = response.status();
        let bytes = response
            .bytes()
            .await
            .map_err(|e| TurnError::Transport(error_chain(&e)))?;
        if !status.is_success() {
            return Err(TurnError::Status {
                status: status.as_u16(),
                message: error_message(&bytes),
            });
        }
        let answer: ResponseView<'_> = serde_json::from_slice(&bytes)
            .map_err(|e| TurnError::Stream(format!("the user model's answer: {e}")))?;
        let question = answer
            .choices
            .first()
            .map_or("", |choice| choice.content().trim());
        if question.is_empty() {
            return Err(TurnError::Empty);
        }
        Ok(question.to_owned())
    };
    match tokio::time::timeout(timeout, call).await {
        // The question is shown and sent on: it must not carry the key either.
        Ok(result) => result
            .map(|question| redact(&question, api_key))
            .map_err(|e| redact_error(e, api_key)),
        Err(_) => Err(TurnError::Timeout(timeout)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_echoed_key_is_redacted_from_errors_and_questions() {
        let key = Some("sk-test-0123456789");
        let echoed = TurnError::Status {
            status: 401,
            message: "Incorrect API key provided: sk-test-0123456789.".into(),
        };
        let shown = redact_error(echoed, key).to_string();
        assert_eq!(shown, "HTTP 401: Incorrect API key provided: [redacted].");
        assert_eq!(redact("no key here", key), "no key here");
        // No key, or an empty one, changes nothing.
        assert_eq!(redact("abc", None), "abc");
        assert_eq!(redact("abc", Some("")), "abc");
    }

    #[test]
    fn error_bodies_give_their_message() {
        let body = br#"{"error":{"message":"too many requests","type":"rate_limit"}}"#;
        assert_eq!(error_message(body), "too many requests");
        assert_eq!(error_message(b"plain text"), "plain text");
        assert_eq!(error_message(b""), "(empty body)");
    }

    #[test]
    fn text_is_cut_at_a_character_boundary() {
        let mut text = String::new();
        let mut truncated = false;
        push_bounded(&mut text, "ab", 4, &mut truncated);
        push_bounded(&mut text, "é€", 4, &mut truncated);
        assert_eq!(text, "abé");
        assert!(truncated);
    }

    #[test]
    fn tpot_follows_the_seed_definition() {
        let result = TurnResult {
            ttft: Duration::from_millis(400),
            e2e: Duration::from_millis(400 + 99 * 30),
            itl: None,
            output_tokens: 100,
            text: String::new(),
            text_truncated: false,
            worker: None,
            cached_tokens: None,
            prompt_tokens: None,
        };
        assert_eq!(result.tpot(), Some(Duration::from_millis(30)));
    }
}
