//! Who may use the control API: the checks every request passes before its handler.
//!
//! A page on any origin can make the browser send requests to a loopback address, so being on
//! loopback is no protection by itself. Every request passes, in order:
//!
//! 1. **Host** (only when listening on loopback): a name other than `localhost` or an IP
//!    literal is refused (403 `forbidden_host`): a DNS-rebinding page reaches `127.0.0.1` under
//!    its own name, with a matching `Origin`.
//! 2. **Origin**: a request carrying an `Origin` other than the server's own
//!    (`http://HOST` or `https://HOST` of its `Host` header) is refused (403 `cross_origin`),
//!    the WebSocket upgrade included. Requests without `Origin` (curl, Prometheus) pass.
//! 3. **Token** (when one is set; required off loopback): `/api/*` and `/ws` need
//!    `Authorization: Bearer TOKEN`, or for `/ws`, whose browser API cannot set headers,
//!    `?token=TOKEN` (401 `invalid_api_key`). The page and `/metrics` stay open: the page
//!    reads the token from its own `?token=` and sends it.
//! 4. **Content type**: a POST with a body must say `application/json` (415
//!    `unsupported_media_type`): the content types a page may send cross-origin without a
//!    preflight (`text/plain`, forms) are never accepted.
//!
//! Errors that axum answers itself (a body over its 2 MiB limit, a query it cannot parse, a
//! request to `/ws` that is not an upgrade) come back as plain text; [`json_errors`] rewrites
//! them as OpenAI error JSON, as every other answer of the API.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use protocol::ApiError;
use protocol::error::kind;

/// How much of an error's plain-text body is kept as the JSON error's message.
const MAX_ERROR_TEXT: usize = 4096;

/// The access rules of one listener.
#[derive(Clone, Debug)]
pub struct Access {
    /// The bearer token of `/api/*` and `/ws`; `None`: open (loopback only).
    token: Option<Arc<str>>,
    /// Listening on a loopback address: the `Host` header must be `localhost` or an IP.
    loopback: bool,
    /// How long a client may take to send a whole request body (408 after it).
    body_timeout: Duration,
}

impl Access {
    pub fn new(token: Option<&str>, loopback: bool, body_timeout: Duration) -> Access {
        Access {
            token: token.map(Arc::from),
            loopback,
            body_timeout,
        }
    }
}

fn refuse(status: u16, kind: &str, code: &str, message: impl Into<String>) -> Response {
    ApiError::new(status, kind, message, None, Some(code)).into_response()
}

/// The middleware of [`Access`] (the module's checks 1–4).
pub async fn check(State(access): State<Arc<Access>>, request: Request, next: Next) -> Response {
    let headers = request.headers();
    let host = headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .unwrap_or("");
    if access.loopback && !is_local_host(host) {
        return refuse(
            403,
            kind::INVALID_REQUEST,
            "forbidden_host",
            format!(
                "this load generator listens on loopback and answers only to localhost or an IP \
                 address, not to the host name {host:?}"
            ),
        );
    }
    if let Some(origin) = headers.get(header::ORIGIN) {
        let same = origin.to_str().is_ok_and(|origin| {
            !host.is_empty()
                && (origin.strip_prefix("http://") == Some(host)
                    || origin.strip_prefix("https://") == Some(host))
        });
        if !same {
            return refuse(
                403,
                kind::INVALID_REQUEST,
                "cross_origin",
                format!(
                    "cross-origin requests are refused: Origin {origin:?} is not this server \
                     (http://{host})"
                ),
            );
        }
    }
    let path = request.uri().path();
    let is_ws = path == "/ws";
    if let Some(token) = &access.token {
        if (is_ws || path.starts_with("/api/")) && !has_token(&request, token, is_ws) {
            let mut response = refuse(
                401,
                kind::INVALID_REQUEST,
                "invalid_api_key",
                "this load generator needs its API token: send `Authorization: Bearer TOKEN` \
                 (the --api-token or KVROUTE_API_TOKEN it was started with), or open the \
                 dashboard as /?token=TOKEN",
            );
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            return response;
        }
    }
    if request.method() == Method::POST && !json_or_empty(request.headers()) {
        return refuse(
            415,
            kind::INVALID_REQUEST,
            "unsupported_media_type",
            "POST bodies must be JSON: send `Content-Type: application/json`",
        );
    }
    // The whole body within a deadline and a size cap, before any handler waits on it: a
    // client trickling bytes cannot hold its connection (and what it sent) for longer.
    let (parts, body) = request.into_parts();
    let read = protocol::http::read_body(&parts.headers, body, MAX_BODY_BYTES);
    let body = match tokio::time::timeout(access.body_timeout, read).await {
        Ok(Ok(bytes)) => axum::body::Body::from(bytes),
        Ok(Err(e)) => return e.into_response(),
        Err(_) => {
            return ApiError::request_timeout(access.body_timeout.as_secs_f64()).into_response();
        }
    };
    json_errors(next.run(Request::from_parts(parts, body)).await).await
}

/// Most bytes of a request body: the API's bodies are small JSON objects (413 past it).
pub const MAX_BODY_BYTES: usize = 2 << 20;

/// `localhost` (or a name under it) or an IP literal, with or without a port.
fn is_local_host(host: &str) -> bool {
    let name = match host.strip_prefix('[') {
        // [::1]:8080
        Some(rest) => {
            return rest
                .split(']')
                .next()
                .is_some_and(|ip| ip.parse::<std::net::Ipv6Addr>().is_ok());
        }
        None => host.rsplit_once(':').map_or(host, |(name, _port)| name),
    };
    let name = name.to_ascii_lowercase();
    name == "localhost"
        || name.ends_with(".localhost")
        || name.parse::<std::net::Ipv4Addr>().is_ok()
}

fn has_token(request: &Request, token: &str, query_allowed: bool) -> bool {
    let bearer = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    if bearer.is_some_and(|given| same_secret(given, token)) {
        return true;
    }
    query_allowed
        && request.uri().query().is_some_and(|query| {
            query.split('&').any(|pair| {
                pair.strip_prefix("token=")
                    .is_some_and(|given| same_secret(&percent_decode(given), token))
            })
        })
}

/// Compares without returning early on the first differing byte (no timing hint).
fn same_secret(given: &str, token: &str) -> bool {
    let (a, b) = (given.as_bytes(), token.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// `%XX` escapes and `+` of a query value (the page encodes the token with
/// `encodeURIComponent`); an invalid escape stays as it is (and will not match).
fn percent_decode(value: &str) -> String {
    let bytes = value.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                match std::str::from_utf8(&bytes[i + 1..i + 3])
                    .ok()
                    .and_then(|hex| u8::from_str_radix(hex, 16).ok())
                {
                    Some(byte) => {
                        out.push(byte);
                        i += 3;
                    }
                    None => {
                        out.push(b'%');
                        i += 1;
                    }
                }
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            byte => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `Content-Type: application/json` (any parameters), or no body at all.
fn json_or_empty(headers: &HeaderMap) -> bool {
    match headers.get(header::CONTENT_TYPE) {
        Some(value) => value.to_str().is_ok_and(|v| {
            v.split(';')
                .next()
                .is_some_and(|mime| mime.trim().eq_ignore_ascii_case("application/json"))
        }),
        None => {
            let chunked = headers.contains_key(header::TRANSFER_ENCODING);
            let length = headers
                .get(header::CONTENT_LENGTH)
                .and_then(|v| v.to_str().ok())
                .map_or(Some(0), |v| v.trim().parse::<u64>().ok());
            !chunked && length == Some(0)
        }
    }
}

/// Rewrites an error answered without a JSON body (axum's own rejections, an unknown asset)
/// as OpenAI error JSON with the same status, keeping its text as the message.
pub async fn json_errors(response: Response) -> Response {
    let status = response.status();
    let is_json = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return response;
    }
    let (parts, body) = response.into_parts();
    let text = axum::body::to_bytes(body, MAX_ERROR_TEXT)
        .await
        .map(|b| String::from_utf8_lossy(&b).trim().to_owned())
        .unwrap_or_default();
    let message = if text.is_empty() {
        status.canonical_reason().unwrap_or("error").to_owned()
    } else {
        text
    };
    let (error_kind, code) = match status {
        StatusCode::PAYLOAD_TOO_LARGE => (
            kind::INVALID_REQUEST,
            protocol::error::code::PAYLOAD_TOO_LARGE,
        ),
        StatusCode::METHOD_NOT_ALLOWED => (
            kind::INVALID_REQUEST,
            protocol::error::code::METHOD_NOT_ALLOWED,
        ),
        StatusCode::NOT_FOUND => (kind::NOT_FOUND, "not_found"),
        s if s.is_server_error() => (kind::SERVER, protocol::error::code::INTERNAL),
        _ => (kind::INVALID_REQUEST, "invalid_request"),
    };
    let mut answer =
        ApiError::new(status.as_u16(), error_kind, message, None, Some(code)).into_response();
    // Keep what the client needs from the original (`Allow` of a 405, `Sec-WebSocket-Version`
    // of a 426), not its length or type.
    for (name, value) in &parts.headers {
        if name != header::CONTENT_TYPE && name != header::CONTENT_LENGTH {
            answer.headers_mut().insert(name.clone(), value.clone());
        }
    }
    answer
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_hosts_are_localhost_or_ip_literals() {
        for host in [
            "localhost",
            "localhost:8080",
            "127.0.0.1:8080",
            "[::1]:80",
            "10.0.0.2",
            "app.localhost:1",
        ] {
            assert!(is_local_host(host), "{host}");
        }
        for host in [
            "evil.example",
            "evil.example:8080",
            "",
            "127.0.0.1.nip.io:80",
            "[evil]:80",
        ] {
            assert!(!is_local_host(host), "{host}");
        }
    }

    #[test]
    fn query_tokens_are_percent_decoded() {
        assert_eq!(percent_decode("a%2Bb%20c+d"), "a+b c d");
        assert_eq!(percent_decode("100%"), "100%");
        assert_eq!(percent_decode("%zz%4"), "%zz%4");
        assert!(same_secret("abc", "abc"));
        assert!(!same_secret("abd", "abc"));
        assert!(!same_secret("ab", "abc"));
    }
}
