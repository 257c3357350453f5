//! NATS with TLS (server verified against the cluster's CA, the client by its certificate)
//! and a user and password, as a production NATS runs: `kvroute engine` and `kvroute
//! gateway` connect with `--nats-tls-ca`, `--nats-tls-cert` / `--nats-tls-key` and the
//! credentials in the URL, register and route over it, and never print or announce the
//! password. Each missing piece (no CA, a wrong password, a plain-text server) is refused at
//! start with a message that says so. Certificates are made by `openssl` at test time.
//! The same with a server in operator (JWT) mode and `--nats-creds`: the operator, account
//! and user JWTs are made and signed here (`operator` below), as `nsc` would.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{Running, Server, failure, get_json, kvroute};
mod common;
#[path = "../../gateway/tests/common/nats.rs"]
mod nats;
use nats::NatsServer;

const PASSWORD: &str = "s3cret-nats-pw";

/// A temporary directory with a CA, a server certificate for 127.0.0.1 and a client
/// certificate, all signed by the CA; removed on drop.
struct Pki(PathBuf);

impl Pki {
    /// `name`: the test's own, so tests running at once do not share a directory.
    fn new(name: &str) -> Pki {
        let dir =
            std::env::temp_dir().join(format!("kvroute-nats-pki-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let openssl = |args: &[&str]| {
            let out = Command::new("openssl")
                .args(args)
                .current_dir(&dir)
                .output()
                .expect("openssl runs (apt-get install openssl)");
            assert!(
                out.status.success(),
                "openssl {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        openssl(&[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=kvroute test CA",
            "-keyout",
            "ca-key.pem",
            "-out",
            "ca.pem",
        ]);
        for (name, extension) in [
            (
                "server",
                "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
            ),
            ("client", "extendedKeyUsage=clientAuth\n"),
        ] {
            std::fs::write(dir.join(format!("{name}.ext")), extension).unwrap();
            openssl(&[
                "req",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-subj",
                &format!("/CN=kvroute {name}"),
                "-keyout",
                &format!("{name}-key.pem"),
                "-out",
                &format!("{name}.csr"),
            ]);
            openssl(&[
                "x509",
                "-req",
                "-in",
                &format!("{name}.csr"),
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca-key.pem",
                "-CAcreateserial",
                "-days",
                "2",
                "-extfile",
                &format!("{name}.ext"),
                "-out",
                &format!("{name}.pem"),
            ]);
        }
        Pki(dir)
    }

    fn path(&self, file: &str) -> String {
        self.0.join(file).display().to_string()
    }

    /// A nats-server configuration: TLS verifying clients (`mutual`) or not, and a user.
    fn server_config(&self, tls: bool, mutual: bool) -> PathBuf {
        let mut config = format!("authorization {{ user: kv, password: \"{PASSWORD}\" }}\n");
        if tls {
            config += &format!(
                "tls {{ cert_file: \"{}\", key_file: \"{}\", ca_file: \"{}\", verify: {mutual} }}\n",
                self.path("server.pem"),
                self.path("server-key.pem"),
                self.path("ca.pem"),
            );
        }
        let file = self.0.join(format!("nats-{tls}-{mutual}.conf"));
        std::fs::write(&file, config).unwrap();
        file
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `nats://kv:PASSWORD@127.0.0.1:PORT` (or another password) for `server`.
/// One chat through the gateway at `url`: answered 200 with exactly `max_tokens` tokens, so
/// a worker it learnt over NATS served it.
async fn assert_chat_served(url: &str, max_tokens: u64) {
    let reply = reqwest::Client::new()
        .post(format!("{url}/v1/chat/completions"))
        .json(&serde_json::json!({
            "model": "llama-3.1-70b-instruct",
            "messages": [{"role": "user", "content": "Where does a KV cache live?"}],
            "max_tokens": max_tokens,
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(reply.status(), 200);
    let reply: serde_json::Value = reply.json().await.unwrap();
    assert_eq!(reply["usage"]["completion_tokens"], max_tokens, "{reply}");
}

fn url_with_password(server: &NatsServer, password: &str) -> String {
    server
        .url()
        .replacen("nats://", &format!("nats://kv:{password}@"), 1)
}

fn tls_flags(pki: &Pki) -> Vec<String> {
    vec![
        "--nats-tls-ca".into(),
        pki.path("ca.pem"),
        "--nats-tls-cert".into(),
        pki.path("client.pem"),
        "--nats-tls-key".into(),
        pki.path("client-key.pem"),
    ]
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_and_gateway_register_and_route_over_mutual_tls_with_a_password() {
    let pki = Pki::new("mutual");
    let nats = NatsServer::start_with_config(&pki.server_config(true, true));
    let url = url_with_password(&nats, PASSWORD);
    let tls = tls_flags(&pki);

    // The engine takes the URL (and its password) from NATS_URL, off its command line.
    let mut engine_cmd = vec![
        "engine",
        "--port",
        "0",
        "--speedup",
        "50",
        "--lease-ms",
        "1000",
    ];
    engine_cmd.extend(strs(&tls));
    let mut command = kvroute();
    command.env("NATS_URL", &url);
    let engine = Server::start_command(command, &engine_cmd);
    let mut gateway_cmd = vec!["gateway", "--port", "0", "--nats", url.as_str()];
    gateway_cmd.extend(strs(&tls));
    let gateway = Server::start(&gateway_cmd);

    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let health = get_json(&format!("{}/health", gateway.url)).await;
        if health["routable_workers"] == 1 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the engine never registered over TLS: {health}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_chat_served(&gateway.url, 6).await;

    // The password stays in the processes: not in /info, /metrics or what they print.
    let info = get_json(&format!("{}/info", engine.url)).await.to_string();
    assert!(info.contains("***@127.0.0.1"), "{info}");
    for text in [
        info,
        common::get_text(&format!("{}/metrics", engine.url)).await,
        common::get_text(&format!("{}/metrics", gateway.url)).await,
        engine.line.clone(),
        gateway.line.clone(),
    ] {
        assert!(!text.contains(PASSWORD), "the NATS password leaked: {text}");
    }
    let printed: Vec<String> = gateway
        .lines
        .try_iter()
        .chain(engine.lines.try_iter())
        .collect();
    assert!(
        printed.iter().all(|l| !l.contains(PASSWORD)),
        "the NATS password leaked: {printed:#?}"
    );
}

#[test]
fn a_missing_ca_a_wrong_password_or_a_plain_server_is_refused_at_start() {
    let pki = Pki::new("refused");
    let tls_server = NatsServer::start_with_config(&pki.server_config(true, false));
    let plain_server = NatsServer::start_with_config(&pki.server_config(false, false));
    let ca = pki.path("ca.pem");
    let right = url_with_password(&tls_server, PASSWORD);
    let wrong = url_with_password(&tls_server, "not-the-password");
    let plain = url_with_password(&plain_server, PASSWORD);
    let anonymous = tls_server.url();
    for (args, expected) in [
        // TLS server, no CA: its certificate is not trusted.
        (
            vec!["gateway", "--port", "0", "--nats", right.as_str()],
            "cannot connect to NATS at nats://***@127.0.0.1",
        ),
        (
            vec![
                "gateway",
                "--port",
                "0",
                "--nats",
                wrong.as_str(),
                "--nats-tls-ca",
                &ca,
            ],
            "refused this client: authorization violation (check the user and password",
        ),
        (
            vec![
                "engine",
                "--port",
                "0",
                "--nats",
                wrong.as_str(),
                "--nats-tls-ca",
                &ca,
            ],
            "refused this client: authorization violation (check the user and password",
        ),
        // No credentials at all: the refusal says where they go.
        (
            vec![
                "gateway",
                "--port",
                "0",
                "--nats",
                anonymous.as_str(),
                "--nats-tls-ca",
                &ca,
            ],
            "it requires credentials: nats://USER:PASSWORD@HOST:PORT",
        ),
        // A CA asks for TLS: a plain-text server is refused rather than used in the clear.
        (
            vec![
                "engine",
                "--port",
                "0",
                "--nats",
                plain.as_str(),
                "--nats-tls-ca",
                &ca,
            ],
            "cannot connect to NATS at nats://***@127.0.0.1",
        ),
        (
            vec![
                "engine",
                "--port",
                "0",
                "--nats",
                right.as_str(),
                "--nats-tls-ca",
                "/nonexistent/ca.pem",
            ],
            "--nats-tls-ca /nonexistent/ca.pem",
        ),
        (
            vec!["gateway", "--nats", right.as_str(), "--nats-tls-cert", &ca],
            "--nats-tls-key",
        ),
        (vec!["gateway", "--nats-tls-ca", ca.as_str()], "--nats"),
    ] {
        let stderr = failure(&args);
        assert!(
            stderr.to_lowercase().contains(&expected.to_lowercase()),
            "{args:?}: {stderr}"
        );
        assert!(
            !stderr.contains(PASSWORD) && !stderr.contains("not-the-password"),
            "{stderr}"
        );
        // One message, not async-nats's own line before it.
        assert!(
            stderr.matches("authorization violation").count() <= 1
                && !stderr.contains("async_nats"),
            "printed once: {stderr}"
        );
    }
}

/// A NATS outage while a gateway runs is reported in three lines, whatever its length: the
/// loss, the first failed reconnection (later ones are counted), and the return with the
/// count; async-nats's own per-attempt lines stay off.
#[test]
fn a_nats_outage_is_reported_once_lost_once_failing_and_once_restored() {
    let mut nats = NatsServer::start();
    let url = nats.url();
    let mut gateway = Running::spawn(&["gateway", "--port", "0", "--nats", &url], Stdio::piped());
    let lines = gateway.merged_lines();
    let mut seen = Vec::new();
    let wait_for = |needle: &str, seen: &mut Vec<String>| {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !seen.iter().any(|l: &String| l.contains(needle)) {
            let left = deadline.saturating_duration_since(Instant::now());
            match lines.recv_timeout(left) {
                Ok(line) => seen.push(line),
                Err(_) => panic!("no line with {needle:?}: {seen:#?}"),
            }
        }
    };
    wait_for("listening on", &mut seen);
    // Down long enough for several reconnection attempts (async-nats backs off from 0 ms).
    nats.restart_after(Duration::from_secs(2));
    wait_for("NATS connection restored", &mut seen);
    gateway.kill();
    let count = |needle: &str| seen.iter().filter(|l| l.contains(needle)).count();
    assert_eq!(count("NATS connection lost"), 1, "{seen:#?}");
    assert_eq!(count("NATS reconnection failed"), 1, "{seen:#?}");
    assert_eq!(count("async_nats"), 0, "{seen:#?}");
    // Not a terminal: no colour codes in the log.
    assert_eq!(count("\u{1b}["), 0, "{seen:#?}");
    let restored = seen
        .iter()
        .find(|l| l.contains("NATS connection restored"))
        .expect("seen above");
    let attempts: u64 = restored
        .rsplit("failed_attempts=")
        .next()
        .and_then(|rest| {
            rest.chars()
                .take_while(char::is_ascii_digit)
                .collect::<String>()
                .parse()
                .ok()
        })
        .unwrap_or_else(|| panic!("no attempt count: {restored}"));
    assert!(attempts >= 2, "{restored}");
}

/// An engine whose NATS user may not publish on kvroute's subjects keeps serving (its
/// `/health` stays 200, so gateways keep routing to it over HTTP) but says what NATS refuses:
/// its KV events and announcements reach no gateway.
#[tokio::test]
async fn an_engine_refused_publishing_says_so_in_its_health() {
    let dir = std::env::temp_dir().join(format!("kvroute-nats-deny-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("deny.conf");
    std::fs::write(
        &config,
        format!(
            "authorization {{ users = [ {{ user: kv, password: \"{PASSWORD}\", \
             permissions: {{ publish: {{ deny: [\"kvroute.>\"] }} }} }} ] }}\n"
        ),
    )
    .unwrap();
    let nats = NatsServer::start_with_config(&config);
    let url = url_with_password(&nats, PASSWORD);
    let engine = Server::start(&[
        "engine",
        "--port",
        "0",
        "--worker-id",
        "4",
        "--nats",
        &url,
        "--zmq-pub",
        "off",
    ]);
    let deadline = Instant::now() + Duration::from_secs(15);
    let health = loop {
        let health = get_json(&format!("{}/health", engine.url)).await;
        if health["nats"]["server_errors"].as_u64().unwrap_or(0) > 0 {
            break health;
        }
        assert!(Instant::now() < deadline, "no NATS error in {health}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(health["status"], "ok", "{health}");
    assert_eq!(health["nats"]["connected"], true, "{health}");
    let error = health["nats"]["last_server_error"]
        .as_str()
        .unwrap_or_default();
    assert!(
        error.to_lowercase().contains("permissions violation") && error.contains("kvroute."),
        "{health}"
    );
    assert_chat_served(&engine.url, 4).await;
    // A gateway refused the same way (its replica updates, its requests for engines' caches)
    // says so too, while it serves.
    let gateway = Server::start(&["gateway", "--port", "0", "--nats", &url]);
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let health = get_json(&format!("{}/health", gateway.url)).await;
        if health["nats"]["server_errors"].as_u64().unwrap_or(0) > 0 {
            assert_eq!(health["nats"]["connected"], true, "{health}");
            break;
        }
        assert!(Instant::now() < deadline, "no NATS error in {health}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// NATS in operator (decentralized JWT) mode, with the keys and JWTs made here as `nsc` makes
/// them (JWT v2: an `ed25519-nkey` header, base64url without padding, signed by the issuer's
/// NKey): an operator, accounts it signs, users the accounts sign, `.creds` files.
mod operator {
    use std::path::{Path, PathBuf};
    use std::sync::atomic::{AtomicU64, Ordering};

    use base64::Engine as _;
    use nkeys::KeyPair;

    fn base64url(bytes: &[u8]) -> String {
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
    }

    /// A JWT with `nats` claims about `subject`, issued and signed by `issuer`.
    pub fn jwt(issuer: &KeyPair, subject: &str, name: &str, nats: serde_json::Value) -> String {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let iat = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs();
        let claims = serde_json::json!({
            // A unique id per JWT; nsc uses a hash of the claims, the server only reads it.
            "jti": format!("KVROUTETEST{}X{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed)),
            "iat": iat,
            "iss": issuer.public_key(),
            "sub": subject,
            "name": name,
            "nats": nats,
        });
        let signed = format!(
            "{}.{}",
            base64url(br#"{"typ":"JWT","alg":"ed25519-nkey"}"#),
            base64url(claims.to_string().as_bytes())
        );
        let signature = issuer.sign(signed.as_bytes()).expect("signing");
        format!("{signed}.{}", base64url(&signature))
    }

    pub fn operator_jwt(operator: &KeyPair) -> String {
        jwt(
            operator,
            &operator.public_key(),
            "kvroute-test-operator",
            serde_json::json!({"type": "operator", "version": 2}),
        )
    }

    pub fn account_jwt(operator: &KeyPair, account: &KeyPair) -> String {
        jwt(
            operator,
            &account.public_key(),
            "kvroute",
            serde_json::json!({
                "limits": {
                    "subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1,
                    "wildcards": true, "conn": -1, "leaf": -1,
                },
                "default_permissions": {"pub": {}, "sub": {}},
                "type": "account",
                "version": 2,
            }),
        )
    }

    pub fn user_jwt(account: &KeyPair, user: &KeyPair) -> String {
        jwt(
            account,
            &user.public_key(),
            "kvroute-worker",
            serde_json::json!({
                "pub": {}, "sub": {}, "subs": -1, "data": -1, "payload": -1,
                "type": "user", "version": 2,
            }),
        )
    }

    /// A `.creds` file: the user JWT and an NKey seed, in `nsc generate creds`'s layout.
    pub fn write_creds(path: &Path, user_jwt: &str, seed: &str) {
        let text = format!(
            "-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n\
             ************************* IMPORTANT *************************\n\
             NKEY Seed printed below can be used to sign and prove identity.\n\
             NKEYs are sensitive and should be treated as secrets.\n\n\
             -----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n\n\
             *************************************************************\n"
        );
        std::fs::write(path, text).unwrap();
    }

    /// A directory with the server's configuration (the operator JWT, `resolver: MEMORY` with
    /// `account`'s JWT preloaded) and `.creds` files; removed on drop.
    pub struct Setup {
        pub dir: PathBuf,
        pub account: KeyPair,
    }

    impl Setup {
        pub fn new(name: &str) -> Setup {
            let dir = std::env::temp_dir()
                .join(format!("kvroute-nats-jwt-{}-{name}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            let operator = KeyPair::new_operator();
            let account = KeyPair::new_account();
            std::fs::write(dir.join("operator.jwt"), operator_jwt(&operator)).unwrap();
            let config = format!(
                "operator: \"{}\"\nresolver: MEMORY\nresolver_preload: {{\n  {}: \"{}\"\n}}\n",
                dir.join("operator.jwt").display(),
                account.public_key(),
                account_jwt(&operator, &account),
            );
            std::fs::write(dir.join("nats.conf"), config).unwrap();
            Setup { dir, account }
        }

        pub fn config(&self) -> PathBuf {
            self.dir.join("nats.conf")
        }

        /// A `.creds` file of a new user of `account`, with `seed` of that user or another.
        pub fn creds(&self, file: &str, account: &KeyPair, seed_of_another: bool) -> String {
            let user = KeyPair::new_user();
            let seed = if seed_of_another {
                KeyPair::new_user().seed().unwrap()
            } else {
                user.seed().unwrap()
            };
            let path = self.dir.join(file);
            write_creds(&path, &user_jwt(account, &user), &seed);
            path.display().to_string()
        }
    }

    impl Drop for Setup {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_and_gateway_sign_in_with_creds_to_an_operator_mode_server_and_route() {
    let setup = operator::Setup::new("route");
    let nats = NatsServer::start_with_config(&setup.config());
    let url = nats.url();
    let engine_creds = setup.creds("engine.creds", &setup.account, false);
    let gateway_creds = setup.creds("gateway.creds", &setup.account, false);

    let engine = Server::start(&[
        "engine",
        "--port",
        "0",
        "--speedup",
        "50",
        "--lease-ms",
        "1000",
        "--nats",
        &url,
        "--nats-creds",
        &engine_creds,
    ]);
    let gateway = Server::start(&[
        "gateway",
        "--port",
        "0",
        "--nats",
        &url,
        "--nats-creds",
        &gateway_creds,
    ]);
    common::wait_routable(&gateway.url, 1, Duration::from_secs(15)).await;
    assert_chat_served(&gateway.url, 5).await;
    // The engine's answer came through the registration it made over NATS.
    let info = get_json(&format!("{}/info", engine.url)).await;
    assert!(info["nats_kv_subject"].is_string(), "{info}");
}

#[test]
fn a_user_of_an_unknown_account_or_a_mismatched_seed_is_refused_at_start_saying_which() {
    let setup = operator::Setup::new("refused");
    let nats = NatsServer::start_with_config(&setup.config());
    let url = nats.url();
    // Signed by an account the operator never signed (not in the server's resolver).
    let stranger = nkeys::KeyPair::new_account();
    let foreign = setup.creds("foreign.creds", &stranger, false);
    let mismatched = setup.creds("mismatched.creds", &setup.account, true);
    for command in ["engine", "gateway"] {
        let stderr = failure(&[
            command,
            "--port",
            "0",
            "--nats",
            &url,
            "--nats-creds",
            &foreign,
        ]);
        assert!(
            stderr.contains(&format!("of account {}", stranger.public_key()))
                && stderr.contains("refused the user")
                && stderr.contains("resolver")
                && stderr.contains(&foreign),
            "{command}: {stderr}"
        );
        assert_eq!(
            stderr.matches("authorization violation").count(),
            1,
            "printed once: {stderr}"
        );
        let stderr = failure(&[
            command,
            "--port",
            "0",
            "--nats",
            &url,
            "--nats-creds",
            &mismatched,
        ]);
        assert!(
            stderr.contains(&format!("--nats-creds {mismatched}"))
                && stderr.contains("its NKey seed belongs to")
                && stderr.contains("two users"),
            "{command}: {stderr}"
        );
        assert_eq!(
            stderr.matches("NKey seed").count(),
            1,
            "printed once: {stderr}"
        );
    }
}
