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
}

/// Connects to `url` with `security`, failing within `timeout` if the server does not answer.
pub async fn connect(
    url: &str,
    security: &NatsSecurity,
    timeout: Duration,
) -> Result<async_nats::Client, NatsConnectError> {
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
    if let Some(creds) = &security.creds {
        readable("--nats-creds", creds)?;
        options =
            options
                .credentials_file(creds)
                .await
                .map_err(|reason| NatsConnectError::File {
                    flag: "--nats-creds",
                    path: creds.display().to_string(),
                    reason,
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
    match credentials {
        Some(UrlCredentials::UserPassword(user, password)) => {
            options = options.user_and_password(user, password);
        }
        Some(UrlCredentials::Token(token)) => options = options.token(token),
        None => {}
    }
    options
        .connect(servers.as_str())
        .await
        .map_err(|e| NatsConnectError::Connect {
            url: redact(url),
            message: e.to_string(),
        })
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
