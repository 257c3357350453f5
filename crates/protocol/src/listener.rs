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
//!   hyper's own, body-less limits ([`MAX_HEADERS`], [`MAX_HEADER_BYTES`]);
//! - a bound on open client connections ([`default_max_connections`]: half the process's
//!   open-file limit, so each client connection can have one connection of the server's own,
//!   a gateway's to its worker). Past it, up to [`MAX_REFUSING`] more connections are answered
//!   503 `too_many_connections` (JSON, `Retry-After: 1`, then closed); past those, the server
//!   stops accepting until a connection closes (clients wait in the kernel's backlog). Without
//!   the bound, a gateway out of descriptors could not reach its workers: every request failed
//!   with 503 `no_healthy_worker`, not only the extra clients' (docs/RELIABILITY.md).
//!   [`raise_open_file_limit`] lifts the soft limit to the hard one at start-up, and
//!   [`checked_max_connections`] checks an operator's lower bound (`--max-connections`).
//!
//! Connections may be upgraded (the load generator's WebSocket): an upgraded socket keeps its
//! slot until it closes, so WebSockets count against the bound like any connection.
//!
//! Shutdown stops accepting and lets open HTTP connections finish their requests (hyper's
//! graceful shutdown of each connection); the caller bounds the wait. Upgraded sockets belong
//! to their handlers and are not waited for.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{ConnectInfo, Request};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::pin::Pin;
use std::task::{Context, Poll};

use hyper::body::Incoming;
use hyper::server::conn::http1::UpgradeableConnection;
use hyper::service::HttpService;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio_util::task::TaskTracker;
use tower_service::Service;

use crate::ApiError;

/// Most request headers answered; more get a JSON 431.
pub const MAX_HEADERS: usize = 100;
/// Most bytes of request headers (names and values) answered; more get a JSON 431.
pub const MAX_HEADER_BYTES: usize = 64 << 10;
/// hyper's own header count limit, above ours so that ours answers with JSON; beyond it (or
/// beyond hyper's read buffer, about 400 KiB) hyper answers 431 with an empty body.
const HYPER_MAX_HEADERS: usize = 4 * MAX_HEADERS;

/// Connections answered 503 at once when the server is at its connection bound.
pub const MAX_REFUSING: usize = 64;
/// Descriptors kept for the server's own use (listeners, NATS, ZMQ, files) before halving.
const RESERVED_DESCRIPTORS: u64 = 128;
/// The bound where the open-file limit cannot be read (or is unlimited).
const FALLBACK_MAX_CONNECTIONS: usize = 10_000;

/// Client connections served at once by default: half of what the process's soft open-file
/// limit leaves after a reserve, so that every client connection can have one of the server's
/// own (a gateway's connection to the worker serving it). With the usual soft limit of 1,024
/// that is 448; raise the limit (`ulimit -n`, systemd's `LimitNOFILE`) to serve more.
pub fn default_max_connections() -> usize {
    let limit = match read_open_file_limit() {
        Ok(limit) if limit.rlim_cur != libc::RLIM_INFINITY => limit,
        _ => return FALLBACK_MAX_CONNECTIONS,
    };
    let half = limit.rlim_cur.saturating_sub(RESERVED_DESCRIPTORS) / 2;
    usize::try_from(half)
        .unwrap_or(FALLBACK_MAX_CONNECTIONS)
        .max(1)
}

/// The process's open-file limit (`RLIMIT_NOFILE`) after [`raise_open_file_limit`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpenFileLimit {
    /// The soft limit now in force (`None`: unlimited).
    pub soft: Option<u64>,
    /// The hard limit, the most the soft one may be raised to without privileges.
    pub hard: Option<u64>,
    /// The soft limit before, when it was raised.
    pub raised_from: Option<u64>,
}

impl std::fmt::Display for OpenFileLimit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let show = |limit: Option<u64>| limit.map_or("unlimited".to_string(), |l| l.to_string());
        write!(f, "open-file limit {}", show(self.soft))?;
        match self.raised_from {
            Some(before) => write!(f, " (raised from {before})"),
            None => write!(f, " (the hard limit is {})", show(self.hard)),
        }
    }
}

fn finite(limit: libc::rlim_t) -> Option<u64> {
    (limit != libc::RLIM_INFINITY).then_some(limit)
}

fn read_open_file_limit() -> std::io::Result<libc::rlimit> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit only writes the struct it is given.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(limit)
}

/// Raises the process's soft open-file limit to its hard limit, as Go's runtime does at
/// start-up: the soft limit (often 1,024) only protects old `select()` users, and the
/// connection bound follows it. Call it before [`checked_max_connections`]. Where the hard
/// limit is unlimited or the kernel refuses it (Linux caps at `fs.nr_open`), the soft limit
/// stays and the error says why.
pub fn raise_open_file_limit() -> std::io::Result<OpenFileLimit> {
    let limit = read_open_file_limit()?;
    let before = OpenFileLimit {
        soft: finite(limit.rlim_cur),
        hard: finite(limit.rlim_max),
        raised_from: None,
    };
    // An unlimited hard limit gives no number to raise to (Linux refuses one past
    // `fs.nr_open`): the soft limit stays.
    if limit.rlim_cur >= limit.rlim_max || limit.rlim_max == libc::RLIM_INFINITY {
        return Ok(before);
    }
    let raised = libc::rlimit {
        rlim_cur: limit.rlim_max,
        rlim_max: limit.rlim_max,
    };
    // SAFETY: setrlimit only reads the struct it is given.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(OpenFileLimit {
        soft: finite(limit.rlim_max),
        raised_from: Some(limit.rlim_cur),
        ..before
    })
}

/// The connection bound to serve with: `requested` (`--max-connections`), which must be at
/// least 1 and at most what the open-file limit allows ([`default_max_connections`]), or
/// that default. The error says what to do.
pub fn checked_max_connections(requested: Option<usize>) -> Result<usize, String> {
    let allowed = default_max_connections();
    match requested {
        None => Ok(allowed),
        Some(0) => Err("--max-connections must be at least 1".to_string()),
        Some(n) if n > allowed => {
            let soft = read_open_file_limit()
                .ok()
                .and_then(|l| finite(l.rlim_cur))
                .map_or("unknown".to_string(), |l| l.to_string());
            Err(format!(
                "--max-connections {n} is more than the open-file limit allows: a limit of \
                 {soft} descriptors serves at most {allowed} client connections (each needs \
                 its own descriptor and one for the server's connection on its behalf, and \
                 {RESERVED_DESCRIPTORS} are kept). Raise the hard limit (`ulimit -Hn` as \
                 root, systemd's `LimitNOFILE`, Docker's `--ulimit nofile=`) or ask for at \
                 most {allowed}"
            ))
        }
        Some(n) => Ok(n),
    }
}

/// What an accepted connection gets.
enum Slot {
    Serve(OwnedSemaphorePermit),
    Refuse(OwnedSemaphorePermit),
}

/// Waits for a serving slot, or a refusing one when all serving slots are taken.
async fn next_slot(serving: &Arc<Semaphore>, refusing: &Arc<Semaphore>) -> Slot {
    if let Ok(permit) = serving.clone().try_acquire_owned() {
        return Slot::Serve(permit);
    }
    if let Ok(permit) = refusing.clone().try_acquire_owned() {
        return Slot::Refuse(permit);
    }
    // Semaphores that are never closed: acquiring fails only when closed.
    tokio::select! {
        Ok(permit) = serving.clone().acquire_owned() => Slot::Serve(permit),
        Ok(permit) = refusing.clone().acquire_owned() => Slot::Refuse(permit),
    }
}

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
/// finish (the caller bounds that wait). Requests carry `ConnectInfo<SocketAddr>`. At most
/// [`default_max_connections`] client connections are served at once.
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: Router,
    header_timeout: Duration,
    shutdown: impl Future<Output = ()>,
) {
    serve_with_limit(
        listener,
        app,
        header_timeout,
        default_max_connections(),
        shutdown,
    )
    .await
}

/// [`serve`] with at most `max_connections` client connections served at once (see the
/// module docs for what happens past it).
pub async fn serve_with_limit(
    listener: tokio::net::TcpListener,
    app: Router,
    header_timeout: Duration,
    max_connections: usize,
    shutdown: impl Future<Output = ()>,
) {
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(header_timeout)
        .max_headers(HYPER_MAX_HEADERS);
    // Over the bound: one answer, then the connection closes.
    let mut refuse_http = http.clone();
    refuse_http.keep_alive(false);
    let serving = Arc::new(Semaphore::new(max_connections));
    let refusing = Arc::new(Semaphore::new(MAX_REFUSING));
    let connections = TaskTracker::new();
    let (stop, stopped) = watch::channel(false);
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let slot = tokio::select! {
            () = &mut shutdown => break,
            slot = next_slot(&serving, &refusing) => slot,
        };
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
        // A serving slot may have freed while this refusing one waited in accept: serve.
        let slot = match slot {
            Slot::Refuse(refusing) => match serving.clone().try_acquire_owned() {
                Ok(permit) => {
                    drop(refusing);
                    Slot::Serve(permit)
                }
                Err(_) => Slot::Refuse(refusing),
            },
            serve => serve,
        };
        let permit = match slot {
            Slot::Serve(permit) => permit,
            Slot::Refuse(permit) => {
                let refusal = hyper::service::service_fn(move |_: Request<Incoming>| {
                    let mut response =
                        ApiError::too_many_connections(max_connections).into_response();
                    response.headers_mut().insert(
                        axum::http::header::RETRY_AFTER,
                        axum::http::HeaderValue::from_static("1"),
                    );
                    std::future::ready(Ok::<_, std::convert::Infallible>(response))
                });
                let io = TokioIo::new(SlotSocket { tcp, _slot: permit });
                let connection = refuse_http.serve_connection(io, refusal).with_upgrades();
                connections.spawn(until_done_or_stopped(connection, stopped.clone()));
                continue;
            }
        };
        let app = app.clone();
        let service = hyper::service::service_fn(move |mut request: Request<Incoming>| {
            request.extensions_mut().insert(ConnectInfo(peer));
            app.clone().call(request.map(axum::body::Body::new))
        });
        let io = TokioIo::new(SlotSocket { tcp, _slot: permit });
        let connection = http.serve_connection(io, service).with_upgrades();
        let stopped = stopped.clone();
        connections.spawn(async move {
            if let Err(e) = until_done_or_stopped(connection, stopped).await {
                // Timeouts, clients that went away, bad requests: the client's business.
                tracing::debug!(error = %e, "client connection ended with an error");
            }
        });
    }
    drop(listener);
    let _ = stop.send(true);
    connections.close();
    connections.wait().await;
}

/// A client's socket holding its connection slot: the slot frees when the socket is dropped,
/// which for an upgraded connection (a WebSocket) is when its handler lets go of it, not when
/// hyper is done with the HTTP part.
struct SlotSocket {
    tcp: TcpStream,
    _slot: OwnedSemaphorePermit,
}

impl AsyncRead for SlotSocket {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_read(cx, buf)
    }
}

impl AsyncWrite for SlotSocket {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().tcp).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().tcp).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_shutdown(cx)
    }
}

/// Serves one connection to its end, or, once the server stops, lets its request in progress
/// finish and closes it (hyper's graceful shutdown of the connection).
async fn until_done_or_stopped<S, B>(
    connection: UpgradeableConnection<TokioIo<SlotSocket>, S>,
    mut stopped: watch::Receiver<bool>,
) -> hyper::Result<()>
where
    S: HttpService<Incoming, ResBody = B>,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    B: hyper::body::Body + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let mut connection = std::pin::pin!(connection);
    tokio::select! {
        result = connection.as_mut() => return result,
        // The sender is dropped only after it sent `true`.
        _ = stopped.wait_for(|stopped| *stopped) => {}
    }
    connection.as_mut().graceful_shutdown();
    connection.await
}
