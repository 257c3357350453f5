//! The gateway's HTTP listener: hyper's HTTP/1 server with its own timers, so that no phase of
//! a client connection can hold resources forever.
//!
//! `axum::serve` offers no connection settings, so connections are served here by hyper's
//! `http1::Builder` (the same server underneath), with:
//!
//! - hyper's header read timeout, which also bounds how long an idle keep-alive connection
//!   waits for its next request (hyper starts the timer whenever it waits for a request head);
//! - request bodies read within a total deadline (`server.rs`: 408) and grown as they arrive
//!   up to the size cap (`protocol::http::read_body`: 413);
//! - request headers bounded by count and size, answered with OpenAI-style JSON (431) below
//!   hyper's own, body-less limits ([`MAX_HEADERS`], [`MAX_HEADER_BYTES`]).
//!
//! Shutdown stops accepting and lets open connections finish (hyper-util's graceful
//! shutdown); the caller bounds the wait.

use std::time::Duration;

use axum::Router;
use axum::extract::Request;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use protocol::ApiError;
use tokio_util::sync::CancellationToken;

/// Most request headers answered; more get a JSON 431.
pub const MAX_HEADERS: usize = 100;
/// Most bytes of request headers (names and values) answered; more get a JSON 431.
pub const MAX_HEADER_BYTES: usize = 64 << 10;
/// hyper's own header count limit, above ours so that ours answers with JSON; beyond it (or
/// beyond hyper's read buffer, about 400 KiB) hyper answers 431 with an empty body.
const HYPER_MAX_HEADERS: usize = 4 * MAX_HEADERS;

/// Answers 431 with OpenAI's error JSON for requests with too many or too large headers.
pub(crate) async fn limit_headers(request: Request, next: Next) -> Response {
    let headers = request.headers();
    let bytes: usize = headers
        .iter()
        .map(|(name, value)| name.as_str().len() + value.len())
        .sum();
    if headers.len() > MAX_HEADERS || bytes > MAX_HEADER_BYTES {
        return ApiError::headers_too_large(MAX_HEADER_BYTES, MAX_HEADERS).into_response();
    }
    next.run(request).await
}

/// Serves `app` on `listener` until `cancel`, then waits for open connections to finish.
pub(crate) async fn serve(
    listener: tokio::net::TcpListener,
    app: Router,
    header_timeout: Duration,
    cancel: CancellationToken,
) {
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(header_timeout)
        .max_headers(HYPER_MAX_HEADERS);
    let graceful = GracefulShutdown::new();
    loop {
        let accepted = tokio::select! {
            _ = cancel.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        let tcp = match accepted {
            Ok((tcp, _)) => tcp,
            Err(e) => {
                // Out of file descriptors and the like: wait for connections to close
                // rather than spin.
                tracing::warn!(error = %e, "cannot accept a connection");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = tcp.set_nodelay(true);
        let connection =
            http.serve_connection(TokioIo::new(tcp), TowerToHyperService::new(app.clone()));
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                // Timeouts, clients that went away, bad requests: the client's business.
                tracing::debug!(error = %e, "client connection ended with an error");
            }
        });
    }
    drop(listener);
    graceful.shutdown().await;
}
