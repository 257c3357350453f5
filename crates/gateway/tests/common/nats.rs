//! A real `nats-server` for tests: spawned on a free loopback port, killed on drop. Shared by
//! the engine server's, the gateway's and the `kvroute` binary's tests (`#[path]`), each of
//! which uses part of it.
#![allow(dead_code)]

use std::net::{Ipv4Addr, SocketAddrV4, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct NatsServer {
    child: Child,
    port: u16,
    /// Its arguments besides the address and port, to start it again the same way.
    extra: Vec<String>,
}

/// `$NATS_SERVER_BIN`, else `nats-server` on the `PATH` or where Debian installs it.
fn nats_binary() -> PathBuf {
    if let Some(path) = std::env::var_os("NATS_SERVER_BIN") {
        return PathBuf::from(path);
    }
    let in_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join("nats-server"))
            .find(|candidate| candidate.is_file())
    });
    in_path
        .or_else(|| {
            ["/usr/sbin/nats-server", "/usr/local/bin/nats-server"]
                .into_iter()
                .map(PathBuf::from)
                .find(|p| p.is_file())
        })
        .unwrap_or_else(|| {
            panic!("nats-server not found: install nats-server (apt-get install nats-server)")
        })
}

impl NatsServer {
    /// Starts `nats-server` and waits until it accepts connections.
    pub fn start() -> NatsServer {
        NatsServer::start_with(&[])
    }

    /// Starts `nats-server` with a configuration file (TLS, authorization…); the address
    /// and port given on its command line take precedence over the file's.
    pub fn start_with_config(config: &std::path::Path) -> NatsServer {
        NatsServer::start_with(&["-c", config.to_str().expect("a UTF-8 path")])
    }

    fn start_with(extra: &[&str]) -> NatsServer {
        let port = {
            let probe = TcpListener::bind(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0))
                .expect("a free loopback port");
            probe.local_addr().unwrap().port()
        };
        let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        let child = spawn_on(port, &extra);
        NatsServer { child, port, extra }
    }

    /// Kills the server (an outage, no goodbye), waits `down`, and starts it again on the
    /// same port with the same arguments.
    pub fn restart_after(&mut self, down: Duration) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        std::thread::sleep(down);
        self.child = spawn_on(self.port, &self.extra);
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }
}

/// Runs `nats-server` on loopback `port` and waits until it accepts connections.
fn spawn_on(port: u16, extra: &[String]) -> Child {
    let binary = nats_binary();
    let child = Command::new(&binary)
        .args(extra)
        .args(["-a", "127.0.0.1", "-p", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run {} ({e}): install nats-server (apt-get install nats-server)",
                binary.display()
            )
        });
    let deadline = Instant::now() + Duration::from_secs(10);
    while TcpStream::connect((Ipv4Addr::LOCALHOST, port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "nats-server did not accept connections on port {port} within 10 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
