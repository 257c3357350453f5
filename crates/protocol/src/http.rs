//! What both HTTP servers (the gateway, the engine server) do to a request before serving it,
//! written once: read the body within a size limit, parse it as JSON, check the model.
//!
//! [`parse_json`] and [`check_model`] are plain functions; `read_body`, `read_json` and
//! `json_response` need the `axum` feature.

use serde::de::DeserializeOwned;

use crate::error::ApiError;

/// Parses a request body: 400 with serde's message (which names the field and its position)
/// when it is not JSON or not the expected shape.
pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(bytes).map_err(|e| {
        if e.is_syntax() || e.is_eof() {
            ApiError::invalid_request(format!("The request body is not valid JSON: {e}"))
        } else {
            ApiError::invalid_request(format!("Invalid request: {e}"))
        }
    })
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
pub use with_axum::{json_response, read_body, read_json, read_json_within};

#[cfg(feature = "axum")]
mod with_axum {
    use axum::body::{Body, Bytes, HttpBody};
    use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
    use axum::response::{IntoResponse, Response};
    use bytes::BytesMut;
    use serde::Serialize;

    use crate::error::ApiError;

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
    fn only_the_served_model_passes() {
        assert!(check_model("m", "m").is_ok());
        let err = check_model("m", "other").unwrap_err();
        assert_eq!((err.status, err.code()), (404, Some("model_not_found")));
    }
}
