//! NATS with TLS (server verified against the cluster's CA, the client by its certificate)
//! and a user and password, as a production NATS runs: `kvroute engine` and `kvroute
//! gateway` connect with `--nats-tls-ca`, `--nats-tls-cert` / `--nats-tls-key` and the
//! credentials in the URL, register and route over it, and never print or announce the
//! password. Each missing piece (no CA, a wrong password, a plain-text server) is refused at
//! start with a message that says so. Certificates are made by `openssl` at test time.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{Server, failure, get_json, kvroute};
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
    let reply = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", gateway.url))
        .json(&serde_json::json!({
            "model": "llama-3.1-70b-instruct",
            "messages": [{"role": "user", "content": "Where does a KV cache live?"}],
            "max_tokens": 6,
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(reply.status(), 200);
    let reply: serde_json::Value = reply.json().await.unwrap();
    assert_eq!(reply["usage"]["completion_tokens"], 6, "{reply}");

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
            "authorization",
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
            "authorization",
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
    }
}
