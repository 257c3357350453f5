//! Connecting to NATS the same way from every process (gateway replicas, engine servers):
//! TLS with the cluster's CA (and a client certificate where the server asks for one), a
//! `.creds` file (NATS's JWT + NKey seed), or a user and password / token carried in the URL
//! (as NATS's other clients read it; async-nats does not, so it is taken out here), which is
//! then never printed or announced with it ([`redact`]).

use std::path::{Path, PathBuf};
use std::time::Duration;

/// How to authenticate to the NATS server and check its identity, beyond its URL.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NatsSecurity {
    /// A NATS credentials file (user JWT and NKey seed), as `nsc` writes it.
    pub creds: Option<PathBuf>,
    /// PEM CA certificate(s) to verify the server with; TLS is then required.
    pub tls_ca: Option<PathBuf>,
    /// PEM client certificate and key, for servers that verify clients (mutual TLS).
    pub tls_client: Option<(PathBuf, PathBuf)>,
}

/// Why a NATS connection could not be made; the URL is redacted.
#[derive(Debug, thiserror::Error)]
pub enum NatsConnectError {
    // `reason`, not `source`: the message carries it, so a printed chain does not repeat it.
    #[error("{flag} {path}: {reason}")]
    File {
        flag: &'static str,
        path: String,
        reason: std::io::Error,
    },
    #[error(
        "cannot connect to NATS at {url}: {message} (is nats-server running there? --nats URL)"
    )]
    Connect { url: String, message: String },
    /// The server answered and refused to let this client in (no `.creds` file given).
    #[error("NATS at {url} refused this client: {message} ({hint})")]
    Refused {
        url: String,
        message: String,
        hint: &'static str,
    },
    /// The `.creds` file cannot sign in anyone: no JWT or seed, or a seed of another user.
    #[error("--nats-creds {path}: {reason}")]
    Creds { path: String, reason: String },
    /// The server refused the `.creds` file's user.
    #[error(
        "NATS at {url} refused the user {user} of account {account} in --nats-creds {path}: \
         {message} (in operator mode the server must trust that account: is its JWT in the \
         server's resolver, signed by the server's operator?)"
    )]
    CredsRefused {
        url: String,
        path: String,
        user: String,
        account: String,
        message: String,
    },
}

/// Who a `.creds` file signs in as, from its user JWT.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CredsUser {
    /// The user's public NKey (the JWT's `sub`, `U…`).
    pub user: String,
    /// The account that issued it (`nats.issuer_account` when a signing key issued it, else
    /// the JWT's `iss`, `A…`).
    pub account: String,
}

/// Reads a `.creds` file (`-----BEGIN NATS USER JWT-----` … `-----BEGIN USER NKEY SEED-----`
/// …, as `nsc generate creds` writes it) and checks that its seed is the user JWT's key: a
/// file that mixes two users' parts would be refused by the server with no hint why.
pub fn check_creds(contents: &str) -> Result<CredsUser, String> {
    use base64::Engine as _;
    // The first non-empty line after the line that opens a block.
    let block = |opening: &str| {
        let mut lines = contents.lines().map(str::trim);
        lines.find(|l| l.contains(opening))?;
        lines.find(|l| !l.is_empty()).map(str::to_owned)
    };
    let jwt = block("BEGIN NATS USER JWT").ok_or("no user JWT (-----BEGIN NATS USER JWT-----)")?;
    let seed =
        block("BEGIN USER NKEY SEED").ok_or("no NKey seed (-----BEGIN USER NKEY SEED-----)")?;
    let claims = jwt
        .split('.')
        .nth(1)
        .and_then(|payload| {
            base64::engine::general_purpose::URL_SAFE_NO_PAD
                .decode(payload.trim_end_matches('='))
                .ok()
        })
        .and_then(|json| serde_json::from_slice::<serde_json::Value>(&json).ok())
        .ok_or("the user JWT is not a JWT (header.claims.signature, base64url JSON claims)")?;
    let text = |value: &serde_json::Value| value.as_str().map(str::to_owned);
    let user = text(&claims["sub"]).ok_or("the user JWT has no subject (`sub`)")?;
    let account = text(&claims["nats"]["issuer_account"])
        .or_else(|| text(&claims["iss"]))
        .ok_or("the user JWT has no issuer (`iss`)")?;
    let key = nkeys::KeyPair::from_seed(&seed)
        .map_err(|e| format!("the NKey seed is not a seed ({e})"))?;
    if key.public_key() != user {
        return Err(format!(
            "its NKey seed belongs to {}, not to the user JWT's {user}: the seed and the JWT \
             come from two users; write the file again (`nsc generate creds`)",
            key.public_key()
        ));
    }
    Ok(CredsUser { user, account })
}

/// Connects to `url` with `security`, failing within `timeout` if the server does not answer.
pub async fn connect(
    url: &str,
    security: &NatsSecurity,
    timeout: Duration,
) -> Result<async_nats::Client, NatsConnectError> {
    connect_with_status(url, security, timeout)
        .await
        .map(|(client, _)| client)
}

/// [`connect`], and a handle on the connection's state since: for a `/health` that says when
/// the process is up but NATS is not doing its part (lost, or refusing its publishes).
pub async fn connect_with_status(
    url: &str,
    security: &NatsSecurity,
    timeout: Duration,
) -> Result<(async_nats::Client, NatsStatus), NatsConnectError> {
    // Unreadable files get an error naming their flag, not a TLS or parse error later.
    let readable = |flag: &'static str, path: &Path| {
        std::fs::metadata(path)
            .map(|_| ())
            .map_err(|reason| NatsConnectError::File {
                flag,
                path: path.display().to_string(),
                reason,
            })
    };
    let mut options = async_nats::ConnectOptions::new().connection_timeout(timeout);
    let mut creds_user = None;
    if let Some(creds) = &security.creds {
        let path = creds.display().to_string();
        let contents = std::fs::read_to_string(creds).map_err(|reason| NatsConnectError::File {
            flag: "--nats-creds",
            path: path.clone(),
            reason,
        })?;
        let user = check_creds(&contents).map_err(|reason| NatsConnectError::Creds {
            path: path.clone(),
            reason,
        })?;
        creds_user = Some((path.clone(), user));
        options = options
            .credentials(&contents)
            .map_err(|reason| NatsConnectError::Creds {
                path,
                reason: reason.to_string(),
            })?;
    }
    if let Some(ca) = &security.tls_ca {
        readable("--nats-tls-ca", ca)?;
        options = options.add_root_certificates(ca.clone()).require_tls(true);
    }
    if let Some((cert, key)) = &security.tls_client {
        readable("--nats-tls-cert", cert)?;
        readable("--nats-tls-key", key)?;
        options = options
            .add_client_certificate(cert.clone(), key.clone())
            .require_tls(true);
    }
    // async-nats does not read credentials from the URL: they become its options, and the
    // servers are given without them.
    let (servers, credentials) = split_credentials(url);
    let has_url_credentials = credentials.is_some();
    match credentials {
        Some(UrlCredentials::UserPassword(user, password)) => {
            options = options.user_and_password(user, password);
        }
        Some(UrlCredentials::Token(token)) => options = options.token(token),
        None => {}
    }
    // Trouble after the first connection is logged here, in kvroute's words (an outage in
    // three lines, repeated server errors throttled); async-nats's own lines for it are off by
    // default (`QUIET_NATS_LOGS`), since at start-up they would repeat the error below.
    let redacted = redact(url);
    let log = std::sync::Arc::new(ConnectionLog::default());
    let status = NatsStatus(log.clone());
    options = options.event_callback(move |event| {
        let (url, log) = (redacted.clone(), log.clone());
        async move { log_connection_event(&url, &log, event) }
    });
    let client = options.connect(servers.as_str()).await.map_err(|e| {
        let refused = e.kind() == async_nats::ConnectErrorKind::AuthorizationViolation;
        let message = if refused {
            "authorization violation".to_string()
        } else {
            e.to_string()
        };
        match creds_user {
            // The server answered and refused the user: say whom, and why it may.
            Some((path, user)) if refused => NatsConnectError::CredsRefused {
                url: redact(url),
                path,
                user: user.user,
                account: user.account,
                message,
            },
            None if refused => NatsConnectError::Refused {
                url: redact(url),
                message,
                hint: if has_url_credentials {
                    "check the user and password, or the token, in --nats URL"
                } else {
                    "it requires credentials: nats://USER:PASSWORD@HOST:PORT or \
                     nats://TOKEN@HOST:PORT in --nats URL, or --nats-creds FILE"
                },
            },
            _ => NatsConnectError::Connect {
                url: redact(url),
                message,
            },
        }
    })?;
    Ok((client, status))
}

/// A NATS connection's state, as its events told it (see [`connect_with_status`]).
#[derive(Clone, Default)]
pub struct NatsStatus(std::sync::Arc<ConnectionLog>);

/// What [`NatsStatus::health`] reports (`/health`'s `nats` field).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct NatsHealth {
    /// False while the connection is lost (async-nats reconnects by itself).
    pub connected: bool,
    /// Errors the server sent since start-up: each refused publish or subscription (a
    /// permissions violation) is one.
    pub server_errors: u64,
    /// The latest of them, as the server worded it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_server_error: Option<String>,
}

impl std::fmt::Debug for NatsStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("NatsStatus").field(&self.health()).finish()
    }
}

impl NatsStatus {
    pub fn health(&self) -> NatsHealth {
        use std::sync::atomic::Ordering;
        let log = &self.0;
        NatsHealth {
            connected: !log.lost.load(Ordering::Relaxed),
            server_errors: log.server_error_count.load(Ordering::Relaxed),
            last_server_error: log
                .last_server_error
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
        }
    }
}

/// The `RUST_LOG`-style directive that turns off async-nats's connection lines, which
/// [`connect`]'s error and `log_connection_event` say in kvroute's words (default logging).
pub const QUIET_NATS_LOGS: &str = "async_nats::connector=off";

/// What [`log_connection_event`] remembers: whether the connection is lost, how many
/// reconnection attempts failed since (only the first is logged), and its throttles.
#[derive(Default)]
struct ConnectionLog {
    lost: std::sync::atomic::AtomicBool,
    failed_attempts: std::sync::atomic::AtomicU64,
    /// A server that refuses every publish (a permissions violation) or a subscription read
    /// too slowly sends one event per message: at most a line per [`Throttle::EVERY`] each.
    server_errors: Throttle,
    slow_consumer: Throttle,
    /// For [`NatsStatus::health`].
    server_error_count: std::sync::atomic::AtomicU64,
    last_server_error: std::sync::Mutex<Option<String>>,
}

/// At most one log line per [`Throttle::EVERY`], counting the events left out in between.
#[derive(Default)]
struct Throttle {
    /// When the last line was allowed, and the events left out since.
    state: std::sync::Mutex<(Option<std::time::Instant>, u64)>,
}

impl Throttle {
    const EVERY: std::time::Duration = std::time::Duration::from_secs(10);

    /// `Some(events left out since the last line)` when one may be logged at `now`.
    fn allow(&self, now: std::time::Instant) -> Option<u64> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let (last, left_out) = &mut *state;
        if last.is_some_and(|at| now.duration_since(at) < Self::EVERY) {
            *left_out += 1;
            return None;
        }
        *last = Some(now);
        Some(std::mem::take(left_out))
    }
}

/// One log line for a NATS connection event after the first connection: lost, back (with the
/// attempts it took), the first failed reconnection of an outage, a slow consumer, the server
/// going away.
fn log_connection_event(url: &str, log: &ConnectionLog, event: async_nats::Event) {
    use async_nats::Event;
    use std::sync::atomic::Ordering;
    match event {
        Event::Disconnected => {
            log.lost.store(true, Ordering::Relaxed);
            log.failed_attempts.store(0, Ordering::Relaxed);
            tracing::warn!(%url, "NATS connection lost; reconnecting");
        }
        // Also sent for the first connection: only a return after a loss is news.
        Event::Connected => {
            if log.lost.swap(false, Ordering::Relaxed) {
                let failed_attempts = log.failed_attempts.swap(0, Ordering::Relaxed);
                tracing::warn!(%url, failed_attempts, "NATS connection restored");
            }
        }
        // async-nats retries with a growing delay: one line per outage, not per attempt.
        Event::ClientError(e) => {
            if log.failed_attempts.fetch_add(1, Ordering::Relaxed) == 0 {
                tracing::warn!(%url, error = %e, "NATS reconnection failed; retrying (further failures are counted, not logged)");
            }
        }
        Event::ServerError(e) => {
            log.server_error_count.fetch_add(1, Ordering::Relaxed);
            *log.last_server_error
                .lock()
                .unwrap_or_else(|p| p.into_inner()) = Some(e.to_string());
            if let Some(left_out) = log.server_errors.allow(std::time::Instant::now()) {
                tracing::warn!(%url, error = %e, left_out, "NATS server error (at most one line per 10 s; left_out: those since the last)");
            }
        }
        Event::SlowConsumer(subscription) => {
            if let Some(left_out) = log.slow_consumer.allow(std::time::Instant::now()) {
                tracing::warn!(%url, subscription, left_out, "NATS dropped messages: this process reads a subscription too slowly (at most one line per 10 s)");
            }
        }
        Event::LameDuckMode => {
            tracing::warn!(%url, "the NATS server is shutting down (lame duck mode)")
        }
        Event::Draining | Event::Closed => tracing::info!(%url, "NATS connection {event}"),
    }
}

/// A user and password (`user:pass@`) or a token (`token@`) in a NATS URL.
#[derive(Debug, PartialEq, Eq)]
enum UrlCredentials {
    UserPassword(String, String),
    Token(String),
}

/// The servers of `url` without credentials, and the first server's credentials
/// (percent-decoded, as URLs carry them).
fn split_credentials(url: &str) -> (String, Option<UrlCredentials>) {
    let decode = |s: &str| {
        percent_encoding::percent_decode_str(s)
            .decode_utf8_lossy()
            .into_owned()
    };
    let mut credentials = None;
    let servers = url
        .split(',')
        .map(|server| {
            let (scheme, rest) = match server.split_once("://") {
                Some((scheme, rest)) => (format!("{scheme}://"), rest),
                None => (String::new(), server),
            };
            match rest.rsplit_once('@') {
                Some((userinfo, host)) => {
                    if credentials.is_none() {
                        credentials = Some(match userinfo.split_once(':') {
                            Some((user, password)) => {
                                UrlCredentials::UserPassword(decode(user), decode(password))
                            }
                            None => UrlCredentials::Token(decode(userinfo)),
                        });
                    }
                    format!("{scheme}{host}")
                }
                None => server.to_string(),
            }
        })
        .collect::<Vec<_>>()
        .join(",");
    (servers, credentials)
}

/// `url` without the user, password or token it may carry (`nats://user:pass@host:4222` →
/// `nats://***@host:4222`), for logs, errors and `/info`. A list of servers
/// (`nats://a:4222,nats://b:4222`) is redacted server by server.
pub fn redact(url: &str) -> String {
    url.split(',')
        .map(|server| {
            let (scheme, rest) = match server.split_once("://") {
                Some((scheme, rest)) => (Some(scheme), rest),
                None => (None, server),
            };
            let rest = match rest.rsplit_once('@') {
                Some((_, host)) => format!("***@{host}"),
                None => rest.to_string(),
            };
            match scheme {
                Some(scheme) => format!("{scheme}://{rest}"),
                None => rest,
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_throttle_allows_one_line_per_period_and_counts_the_rest() {
        let throttle = Throttle::default();
        let start = std::time::Instant::now();
        let at = |secs: u64| start + std::time::Duration::from_secs(secs);
        assert_eq!(throttle.allow(at(0)), Some(0));
        assert_eq!(throttle.allow(at(1)), None);
        assert_eq!(throttle.allow(at(9)), None);
        assert_eq!(
            throttle.allow(at(10)),
            Some(2),
            "the two left out are counted"
        );
        assert_eq!(throttle.allow(at(15)), None);
        assert_eq!(throttle.allow(at(40)), Some(1));
    }

    #[test]
    fn redaction_hides_every_kind_of_secret_and_keeps_the_rest() {
        for (url, shown) in [
            ("nats://127.0.0.1:4222", "nats://127.0.0.1:4222"),
            ("nats://kv:s3cret@nats:4222", "nats://***@nats:4222"),
            (
                "tls://t0ken@nats.example:4222",
                "tls://***@nats.example:4222",
            ),
            ("user:p@ss@nats:4222", "***@nats:4222"),
            (
                "nats://a:b@n1:4222,nats://a:b@n2:4222",
                "nats://***@n1:4222,nats://***@n2:4222",
            ),
            ("localhost", "localhost"),
        ] {
            assert_eq!(redact(url), shown, "{url}");
            assert!(!redact(url).contains("s3cret") && !redact(url).contains("t0ken"));
        }
    }

    #[test]
    fn credentials_come_out_of_the_url_decoded() {
        assert_eq!(
            split_credentials("nats://kv:p%40ss@n1:4222,nats://kv:p%40ss@n2:4222"),
            (
                "nats://n1:4222,nats://n2:4222".to_string(),
                Some(UrlCredentials::UserPassword("kv".into(), "p@ss".into()))
            )
        );
        assert_eq!(
            split_credentials("tls://t0ken@nats:4222"),
            (
                "tls://nats:4222".to_string(),
                Some(UrlCredentials::Token("t0ken".into()))
            )
        );
        assert_eq!(
            split_credentials("nats://127.0.0.1:4222"),
            ("nats://127.0.0.1:4222".to_string(), None)
        );
    }

    #[tokio::test]
    async fn missing_files_are_named_by_their_flag() {
        for (security, flag) in [
            (
                NatsSecurity {
                    creds: Some("/nonexistent/user.creds".into()),
                    ..NatsSecurity::default()
                },
                "--nats-creds /nonexistent/user.creds",
            ),
            (
                NatsSecurity {
                    tls_ca: Some("/nonexistent/ca.pem".into()),
                    ..NatsSecurity::default()
                },
                "--nats-tls-ca /nonexistent/ca.pem",
            ),
            (
                NatsSecurity {
                    tls_client: Some(("/nonexistent/c.pem".into(), "/nonexistent/k.pem".into())),
                    ..NatsSecurity::default()
                },
                "--nats-tls-cert /nonexistent/c.pem",
            ),
        ] {
            let e = connect("nats://127.0.0.1:1", &security, Duration::from_millis(200))
                .await
                .expect_err("a missing file fails");
            assert!(e.to_string().starts_with(flag), "{e}");
        }
    }
}
