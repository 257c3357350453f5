//! What both HTTP servers (the gateway, the engine server) do to a request before serving it,
//! written once: read the body within a size limit, parse it as JSON, check the model.
//!
//! [`parse_json`] and [`check_model`] are plain functions; `read_body`, `read_json` and
//! `json_response` need the `axum` feature.

use serde::de::DeserializeOwned;

use crate::error::ApiError;

/// Parses a request body: 400 when it is not JSON (with serde's position of the error) or
/// not the expected shape (naming the field, as OpenAI's `param`, e.g. `messages[0].content`).
pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let not_json = |e: serde_json::Error| {
        ApiError::invalid_request(format!("The request body is not valid JSON: {e}"))
    };
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let e = e.into_inner();
        if e.is_syntax() || e.is_eof() {
            return not_json(e);
        }
        let message = shape_message(&e);
        if path.is_empty() || path == "." {
            ApiError::invalid_request(format!("Invalid request: {message}"))
        } else {
            ApiError::invalid_param(&path, format!("Invalid request: `{path}`: {message}"))
        }
    })?;
    // Anything after the value (serde_json's `from_slice` refuses it too).
    de.end().map_err(not_json)?;
    Ok(value)
}

/// serde's message for a body of the wrong shape, without its position (the field is named
/// instead). Untagged enums of the request say what they accept (`#[serde(expecting)]`), so
/// no Rust type name shows.
fn shape_message(e: &serde_json::Error) -> String {
    let text = e.to_string();
    let suffix = format!(" at line {} column {}", e.line(), e.column());
    text.strip_suffix(&suffix).unwrap_or(&text).to_string()
}

/// 404 `model_not_found` unless `requested` is the model this server serves.
pub fn check_model(served: &str, requested: &str) -> Result<(), ApiError> {
    if requested == served {
        Ok(())
    } else {
        Err(ApiError::model_not_found(requested))
    }
}

#[cfg(feature = "axum")]
pub use with_axum::{
    json_response, method_not_allowed_json, read_body, read_json, read_json_within,
};

#[cfg(feature = "axum")]
mod with_axum {
    use axum::body::{Body, Bytes, HttpBody};
    use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
    use axum::response::{IntoResponse, Response};
    use bytes::BytesMut;
    use serde::Serialize;

    use crate::error::ApiError;

    /// axum answers a method a path does not serve (`PUT /v1/chat/completions`, `POST
    /// /v1/models`) with 405, its `Allow` header and an empty body: this gives it OpenAI error
    /// JSON, keeping `Allow`. A response mapper (`axum::middleware::map_response`) for the
    /// outside of the whole router, where axum has set `Allow`.
    pub async fn method_not_allowed_json(
        method: axum::http::Method,
        uri: axum::http::Uri,
        response: Response,
    ) -> Response {
        if response.status() != StatusCode::METHOD_NOT_ALLOWED {
            return response;
        }
        let allow = response.headers().get(header::ALLOW).cloned();
        let allowed: Vec<&str> = allow
            .as_ref()
            .and_then(|v| v.to_str().ok())
            .map(|v| {
                v.split(',')
                    .map(str::trim)
                    // GET implies HEAD: not worth a word.
                    .filter(|m| !m.is_empty() && *m != "HEAD")
                    .collect()
            })
            .unwrap_or_default();
        let allowed = if allowed.is_empty() {
            "another method".to_owned()
        } else {
            allowed.join(" or ")
        };
        let mut answer =
            ApiError::method_not_allowed(method.as_str(), uri.path(), &allowed).into_response();
        if let Some(allow) = allow {
            answer.headers_mut().insert(header::ALLOW, allow);
        }
        answer
    }

    /// Reads a request body of at most `limit` bytes: 413 beyond it (by `Content-Length`
    /// before reading, or by counting), 400 when the body cannot be read.
    ///
    /// The buffer grows with what arrives, never from the declared `Content-Length`: a
    /// client declaring the limit and sending one byte holds one byte, not `limit`.
    pub async fn read_body(
        headers: &HeaderMap,
        mut body: Body,
        limit: usize,
    ) -> Result<Bytes, ApiError> {
        let declared = headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|n| n > limit as u64) {
            return Err(ApiError::payload_too_large(limit));
        }
        let mut buf = BytesMut::new();
        while let Some(frame) =
            std::future::poll_fn(|cx| std::pin::Pin::new(&mut body).poll_frame(cx)).await
        {
            let frame = frame.map_err(|e| {
                ApiError::invalid_request(format!("could not read the request body: {e}"))
            })?;
            // Trailers carry no body bytes.
            let Ok(chunk) = frame.into_data() else {
                continue;
            };
            if buf.len() + chunk.len() > limit {
                return Err(ApiError::payload_too_large(limit));
            }
            buf.extend_from_slice(&chunk);
        }
        Ok(buf.freeze())
    }

    /// [`read_body`], then [`parse_json`](super::parse_json).
    pub async fn read_json<T: serde::de::DeserializeOwned>(
        headers: &HeaderMap,
        body: Body,
        limit: usize,
    ) -> Result<T, ApiError> {
        super::parse_json(&read_body(headers, body, limit).await?)
    }

    /// [`read_json`] with one deadline for the whole body (408 after it): a client trickling
    /// bytes cannot hold the connection, and what it sent, for longer.
    pub async fn read_json_within<T: serde::de::DeserializeOwned>(
        headers: &HeaderMap,
        body: Body,
        limit: usize,
        deadline: std::time::Duration,
    ) -> Result<T, ApiError> {
        tokio::time::timeout(deadline, read_json(headers, body, limit))
            .await
            .map_err(|_| ApiError::request_timeout(deadline.as_secs_f64()))?
    }

    /// A JSON response. A value that cannot be serialized (a bug) becomes a 500 that says so,
    /// not an empty body.
    pub fn json_response(status: u16, value: &impl Serialize) -> Response {
        match serde_json::to_vec(value) {
            Ok(body) => json_bytes(status, body),
            Err(e) => {
                let error = ApiError::internal(format!("could not serialize the response: {e}"));
                json_bytes(error.status, error.to_json().into_bytes())
            }
        }
    }

    /// A response whose body is already JSON.
    pub(crate) fn json_bytes(status: u16, body: Vec<u8>) -> Response {
        let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut response = (status, body).into_response();
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        response
    }

    impl IntoResponse for ApiError {
        fn into_response(self) -> Response {
            json_bytes(self.status, self.to_json().into_bytes())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_errors_are_400_with_serde_s_message() {
        let err = parse_json::<crate::CompletionRequest>(b"{\"model\": ").unwrap_err();
        assert_eq!(err.status, 400);
        assert!(err.message().contains("not valid JSON"), "{err}");
        let err = parse_json::<crate::CompletionRequest>(br#"{"model": "m", "prompt": [1, -2]}"#)
            .unwrap_err();
        assert_eq!(err.status, 400);
        assert!(err.message().contains("prompt token ids"), "{err}");
    }

    #[test]
    fn a_body_of_the_wrong_shape_names_the_field_without_positions_or_rust_types() {
        let error = |body: &str| {
            let e = parse_json::<crate::ChatCompletionRequest>(body.as_bytes()).unwrap_err();
            assert_eq!(e.status, 400, "{e}");
            let message = e.message().to_string();
            assert!(
                !message.contains(" at line ") && !message.contains("untagged enum"),
                "{message}"
            );
            (e.detail.param.clone(), message)
        };
        let (param, message) =
            error(r#"{"model": "m", "messages": [{"role": "user", "content": 5}]}"#);
        assert_eq!(param.as_deref(), Some("messages[0].content"), "{message}");
        assert!(message.contains("`messages[0].content`"), "{message}");
        let (_, message) = error(
            r#"{"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 5}"#,
        );
        assert!(message.contains("between 0 and 2"), "{message}");
        let (param, message) = error(r#"{"model": "m", "messages": "hi"}"#);
        assert_eq!(param.as_deref(), Some("messages"), "{message}");
        // Something after the body is not JSON either.
        let e = parse_json::<crate::CompletionRequest>(br#"{"model": "m", "prompt": "hi"} x"#)
            .unwrap_err();
        assert!(e.message().contains("not valid JSON"), "{e}");
    }

    #[test]
    fn only_the_served_model_passes() {
        assert!(check_model("m", "m").is_ok());
        let err = check_model("m", "other").unwrap_err();
        assert_eq!((err.status, err.code()), (404, Some("model_not_found")));
    }
}
