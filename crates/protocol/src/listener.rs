//! The HTTP listener of both servers (the gateway, the engine server): hyper's HTTP/1 server
//! with its own timers, so that no phase of a client connection can hold resources forever.
//!
//! `axum::serve` offers no connection settings, so connections are served here by hyper's
//! `http1::Builder` (the same server underneath), with:
//!
//! - hyper's header read timeout, which also bounds how long an idle keep-alive connection
//!   waits for its next request (hyper starts the timer whenever it waits for a request head);
//! - request bodies read within a total deadline and grown as they arrive up to the size cap
//!   ([`crate::http::read_json_within`]: 408 and 413);
//! - the client's address in each request's extensions (axum's `ConnectInfo<SocketAddr>`),
//!   for per-client limits;
//! - request headers bounded by count and size, answered with OpenAI-style JSON (431) below
//!   hyper's own, body-less limits ([`MAX_HEADERS`], [`MAX_HEADER_BYTES`]).
//!
//! Shutdown stops accepting and lets open connections finish (hyper-util's graceful
//! shutdown); the caller bounds the wait.

use std::future::Future;
use std::time::Duration;

use axum::Router;
use axum::extract::{ConnectInfo, Request};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tower_service::Service;

use crate::ApiError;

/// Most request headers answered; more get a JSON 431.
pub const MAX_HEADERS: usize = 100;
/// Most bytes of request headers (names and values) answered; more get a JSON 431.
pub const MAX_HEADER_BYTES: usize = 64 << 10;
/// hyper's own header count limit, above ours so that ours answers with JSON; beyond it (or
/// beyond hyper's read buffer, about 400 KiB) hyper answers 431 with an empty body.
const HYPER_MAX_HEADERS: usize = 4 * MAX_HEADERS;

/// Answers 431 with OpenAI's error JSON for requests with too many or too large headers.
pub async fn limit_headers(request: Request, next: Next) -> Response {
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

/// Serves `app` on `listener` until `shutdown` completes, then waits for open connections to
/// finish (the caller bounds that wait). Requests carry `ConnectInfo<SocketAddr>`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: Router,
    header_timeout: Duration,
    shutdown: impl Future<Output = ()>,
) {
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(header_timeout)
        .max_headers(HYPER_MAX_HEADERS);
    let graceful = GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => accepted,
        };
        let (tcp, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of file descriptors and the like: wait for connections to close
                // rather than spin.
                tracing::warn!(error = %e, "cannot accept a connection");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        // Streams are many small writes: without TCP_NODELAY, Nagle holds a token chunk back
        // until the previous one is acknowledged.
        let _ = tcp.set_nodelay(true);
        let app = app.clone();
        let service =
            hyper::service::service_fn(move |mut request: Request<hyper::body::Incoming>| {
                request.extensions_mut().insert(ConnectInfo(peer));
                app.clone().call(request.map(axum::body::Body::new))
            });
        let connection = http.serve_connection(TokioIo::new(tcp), service);
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
