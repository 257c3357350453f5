//! OpenAI's error JSON, `{"error": {"message", "type", "param", "code"}}`, with its HTTP status.
//!
//! Both HTTP servers (engine server, gateway) answer every failure with an [`ApiError`] (with
//! the `axum` feature it is a response, see [`crate::http`]); in a stream it is an SSE event of
//! [`ApiError::body`]. A gateway relays a worker's error by parsing it back with
//! [`ApiError::from_body`].

use serde::{Deserialize, Serialize};

/// The body of an error response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

/// What went wrong, as OpenAI names it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorDetail {
    pub message: String,
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub param: Option<String>,
    #[serde(default)]
    pub code: Option<String>,
}

/// An API error: an HTTP status and OpenAI's error JSON.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{status} {}: {}", .detail.kind, .detail.message)]
pub struct ApiError {
    /// HTTP status code.
    pub status: u16,
    pub detail: ErrorDetail,
}

/// `type` values.
pub mod kind {
    pub const INVALID_REQUEST: &str = "invalid_request_error";
    pub const NOT_FOUND: &str = "not_found_error";
    pub const RATE_LIMIT: &str = "rate_limit_error";
    pub const SERVICE_UNAVAILABLE: &str = "service_unavailable_error";
    pub const SERVER: &str = "server_error";
}

/// `code` values.
pub mod code {
    pub const CONTEXT_LENGTH_EXCEEDED: &str = "context_length_exceeded";
    pub const MODEL_NOT_FOUND: &str = "model_not_found";
    pub const PAYLOAD_TOO_LARGE: &str = "payload_too_large";
    pub const REQUEST_TIMEOUT: &str = "request_timeout";
    pub const METHOD_NOT_ALLOWED: &str = "method_not_allowed";
    pub const HEADERS_TOO_LARGE: &str = "request_headers_too_large";
    pub const RATE_LIMIT_EXCEEDED: &str = "rate_limit_exceeded";
    pub const NO_HEALTHY_WORKER: &str = "no_healthy_worker";
    pub const TOO_MANY_CONNECTIONS: &str = "too_many_connections";
    pub const INTERNAL: &str = "internal_error";
}

impl ApiError {
    /// Any status, type, param and code.
    pub fn new(
        status: u16,
        kind: &str,
        message: impl Into<String>,
        param: Option<&str>,
        code: Option<&str>,
    ) -> ApiError {
        ApiError {
            status,
            detail: ErrorDetail {
                message: message.into(),
                kind: kind.to_string(),
                param: param.map(str::to_string),
                code: code.map(str::to_string),
            },
        }
    }

    /// 400: the request is malformed (bad JSON, a missing or wrong field).
    pub fn invalid_request(message: impl Into<String>) -> ApiError {
        Self::new(400, kind::INVALID_REQUEST, message, None, None)
    }

    /// 400 naming the offending field.
    pub fn invalid_param(param: &str, message: impl Into<String>) -> ApiError {
        Self::new(400, kind::INVALID_REQUEST, message, Some(param), None)
    }

    /// 400 `context_length_exceeded`: prompt (+ requested output) longer than the model's
    /// context. `param` is `messages` or `prompt`.
    pub fn context_length_exceeded(
        param: &str,
        prompt_tokens: u64,
        max_output_tokens: u64,
        context: u64,
    ) -> ApiError {
        let message = format!(
            "This model's maximum context length is {context} tokens. However, you requested {} tokens ({prompt_tokens} in the {param}, {max_output_tokens} in the completion). Please reduce the length of the {param} or completion.",
            prompt_tokens.saturating_add(max_output_tokens)
        );
        Self::new(
            400,
            kind::INVALID_REQUEST,
            message,
            Some(param),
            Some(code::CONTEXT_LENGTH_EXCEEDED),
        )
    }

    /// 404 `model_not_found`.
    pub fn model_not_found(model: &str) -> ApiError {
        Self::new(
            404,
            kind::INVALID_REQUEST,
            format!("The model `{model}` does not exist."),
            Some("model"),
            Some(code::MODEL_NOT_FOUND),
        )
    }

    /// 404 for an unknown path.
    pub fn not_found(what: impl Into<String>) -> ApiError {
        Self::new(404, kind::NOT_FOUND, what, None, None)
    }

    /// 413: the request body is larger than `limit_bytes`.
    pub fn payload_too_large(limit_bytes: usize) -> ApiError {
        Self::new(
            413,
            kind::INVALID_REQUEST,
            format!("The request body is larger than the limit of {limit_bytes} bytes."),
            None,
            Some(code::PAYLOAD_TOO_LARGE),
        )
    }

    /// 408: the request body did not arrive within `seconds`.
    pub fn request_timeout(seconds: f64) -> ApiError {
        Self::new(
            408,
            kind::INVALID_REQUEST,
            format!("The request body did not arrive within {seconds:.1} s."),
            None,
            Some(code::REQUEST_TIMEOUT),
        )
    }

    /// 405: `method` is not served on this path; `allowed` says what is.
    pub fn method_not_allowed(method: &str, path: &str, allowed: &str) -> ApiError {
        Self::new(
            405,
            kind::INVALID_REQUEST,
            format!("{method} is not allowed on {path}; use {allowed}."),
            None,
            Some(code::METHOD_NOT_ALLOWED),
        )
    }

    /// 431: the request's headers are over `limit_bytes` in all, or more than `max_count`.
    pub fn headers_too_large(limit_bytes: usize, max_count: usize) -> ApiError {
        Self::new(
            431,
            kind::INVALID_REQUEST,
            format!(
                "The request headers are too large: at most {max_count} headers of \
                 {limit_bytes} bytes in all."
            ),
            None,
            Some(code::HEADERS_TOO_LARGE),
        )
    }

    /// 429: overloaded (a queue is full); retry later.
    pub fn overloaded(message: impl Into<String>) -> ApiError {
        Self::new(
            429,
            kind::RATE_LIMIT,
            message,
            None,
            Some(code::RATE_LIMIT_EXCEEDED),
        )
    }

    /// 503: no worker can serve the request now.
    pub fn service_unavailable(message: impl Into<String>) -> ApiError {
        Self::new(
            503,
            kind::SERVICE_UNAVAILABLE,
            message,
            None,
            Some(code::NO_HEALTHY_WORKER),
        )
    }

    /// 503: the server holds as many client connections as it serves at once.
    pub fn too_many_connections(max: usize) -> ApiError {
        Self::new(
            503,
            kind::SERVICE_UNAVAILABLE,
            format!(
                "the server holds its maximum of {max} client connections; retry shortly, or \
                 reuse a connection"
            ),
            None,
            Some(code::TOO_MANY_CONNECTIONS),
        )
    }

    /// 500: a bug or an unexpected failure on our side.
    pub fn internal(message: impl Into<String>) -> ApiError {
        Self::new(500, kind::SERVER, message, None, Some(code::INTERNAL))
    }

    /// A chat the chat template could not render: a template that failed on its own (an
    /// operator's file: out of fuel, too deep, a bug of its own) is a 500; one that refused
    /// these messages (its `raise_exception`, a role it does not take) is the client's 400
    /// on `messages`. The gateway and the engine server answer alike.
    pub fn chat_template(template_failed: bool, message: impl Into<String>) -> ApiError {
        if template_failed {
            Self::internal(message)
        } else {
            Self::invalid_param("messages", message)
        }
    }

    pub fn message(&self) -> &str {
        &self.detail.message
    }

    pub fn code(&self) -> Option<&str> {
        self.detail.code.as_deref()
    }

    /// The JSON body.
    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            error: self.detail.clone(),
        }
    }

    /// The JSON body.
    pub fn to_json(&self) -> String {
        // A struct of strings always serializes; should that ever change, the client still
        // gets an error JSON rather than an empty body.
        serde_json::to_string(&self.body()).unwrap_or_else(|_| {
            r#"{"error":{"message":"the error could not be serialized","type":"server_error"}}"#
                .to_string()
        })
    }

    /// Parses an error response (e.g. from a worker). A body that is not OpenAI's error JSON
    /// becomes a `server_error` quoting (a bounded prefix of) the body.
    pub fn from_body(status: u16, body: &[u8]) -> ApiError {
        match serde_json::from_slice::<ErrorBody>(body) {
            Ok(parsed) => ApiError {
                status,
                detail: parsed.error,
            },
            Err(_) => {
                const QUOTED: usize = 512;
                let text = String::from_utf8_lossy(&body[..body.len().min(QUOTED)]);
                Self::new(
                    status,
                    kind::SERVER,
                    format!("upstream answered {status}: {text}"),
                    None,
                    None,
                )
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_refused_chat_is_the_clients_400_and_a_failing_template_our_500() {
        let refused = ApiError::chat_template(false, "no system messages");
        assert_eq!(
            (refused.status, refused.detail.param.as_deref()),
            (400, Some("messages"))
        );
        let failed = ApiError::chat_template(true, "out of fuel");
        assert_eq!((failed.status, failed.detail.param), (500, None));
    }

    #[test]
    fn error_json_shape() {
        let err = ApiError::model_not_found("gpt-x");
        assert_eq!(err.status, 404);
        let body: serde_json::Value = serde_json::from_str(&err.to_json()).unwrap();
        assert_eq!(
            body,
            json!({"error": {"message": "The model `gpt-x` does not exist.",
                             "type": "invalid_request_error", "param": "model",
                             "code": "model_not_found"}})
        );
    }

    #[test]
    fn statuses() {
        assert_eq!(ApiError::invalid_request("x").status, 400);
        let ctx = ApiError::context_length_exceeded("messages", 9000, 100, 8192);
        assert_eq!(
            (ctx.status, ctx.code()),
            (400, Some("context_length_exceeded"))
        );
        assert!(ctx.message().contains("9100 tokens"));
        assert_eq!(ApiError::payload_too_large(10).status, 413);
        assert_eq!(ApiError::overloaded("full").status, 429);
        assert_eq!(ApiError::service_unavailable("none").status, 503);
        assert_eq!(ApiError::internal("bug").status, 500);
    }

    #[test]
    fn from_body_parses_or_quotes() {
        let err = ApiError::overloaded("queue full");
        assert_eq!(ApiError::from_body(429, err.to_json().as_bytes()), err);
        let garbage = ApiError::from_body(502, b"<html>bad gateway</html>");
        assert_eq!(garbage.status, 502);
        assert!(garbage.message().contains("bad gateway"));
        let long = vec![b'x'; 10_000];
        assert!(ApiError::from_body(500, &long).message().len() < 600);
    }
}
