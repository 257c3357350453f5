//! Running the `kvroute` binary from the CLI tests: one-shot commands, and servers started in
//! the background, read from their stdout and stopped by a signal.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, ChildStdout, Command, ExitStatus, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

pub fn kvroute() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvroute"))
}

/// Checks that a finished `kvroute` succeeded, showing its stderr if not.
pub fn ok(out: Output) -> Output {
    assert!(
        out.status.success(),
        "status {}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Runs `kvroute ARGS` to a success and returns its stdout.
pub fn stdout_of(args: &[&str]) -> String {
    let out = ok(kvroute().args(args).output().expect("kvroute runs"));
    String::from_utf8(out.stdout).expect("UTF-8 stdout")
}

/// Runs `kvroute ARGS`, which must fail, and returns its stderr for the test to check that it
/// says what went wrong.
pub fn failure(args: &[&str]) -> String {
    let out = kvroute().args(args).output().expect("kvroute runs");
    assert!(!out.status.success(), "{args:?} should fail");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Each `(ARGS, message)`: `kvroute ARGS` fails, and its stderr says `message`.
pub fn assert_failures(cases: &[(&[&str], &str)]) {
    for (args, message) in cases {
        let stderr = failure(args);
        assert!(stderr.contains(message), "{args:?}: {stderr}");
    }
}

/// One HTTP/1.1 request to `addr` (`HOST:PORT`) with `Connection: close`, from a plain
/// thread: (status, body). The body is read to the end, so a streamed reply comes whole.
pub fn http(addr: &str, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut stream = TcpStream::connect(addr).unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .expect("read timeout");
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .expect("request sent");
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("response read");
    let status = response
        .get(9..12)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP response: {response:?}"));
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

/// POSTs JSON to `addr` and reads a JSON answer: (status, body).
pub fn post_json(addr: &str, path: &str, body: &serde_json::Value) -> (u16, serde_json::Value) {
    let (status, text) = http(addr, "POST", path, &body.to_string());
    let json = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}: {text}"));
    (status, json)
}

/// GETs `url` and reads the body as text.
pub async fn get_text(url: &str) -> String {
    let response = reqwest::get(url).await.expect("request sent");
    response.text().await.expect("body read")
}

/// GETs `url` and reads the body as JSON.
pub async fn get_json(url: &str) -> serde_json::Value {
    let response = reqwest::get(url).await.expect("request sent");
    response.json().await.expect("JSON body")
}

/// A `kvroute` process, killed on drop if the test ends before it stops it.
pub struct Running(pub Child);

impl Running {
    /// Starts `kvroute ARGS` with stdout piped for the test to read and stderr to `stderr`.
    pub fn spawn(args: &[&str], stderr: Stdio) -> Running {
        Running::spawn_command(kvroute(), args, stderr)
    }

    /// The same from a prepared `kvroute()` command (its environment set, say).
    pub fn spawn_command(mut command: Command, args: &[&str], stderr: Stdio) -> Running {
        let child = command
            .args(args)
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .expect("kvroute runs");
        Running(child)
    }

    pub fn take_stdout(&mut self) -> BufReader<ChildStdout> {
        BufReader::new(self.0.stdout.take().expect("stdout is piped"))
    }

    /// Its stdout and stderr lines, merged as they come (spawned with `Stdio::piped()`
    /// stderr), read to their ends by two threads so a chatty process never blocks.
    pub fn merged_lines(&mut self) -> mpsc::Receiver<String> {
        let stdout = self.take_stdout();
        let stderr = BufReader::new(self.0.stderr.take().expect("stderr is piped"));
        let (tx, lines) = mpsc::channel();
        for reader in [
            Box::new(stdout) as Box<dyn BufRead + Send>,
            Box::new(stderr) as Box<dyn BufRead + Send>,
        ] {
            let tx = tx.clone();
            std::thread::spawn(move || {
                for line in reader.lines().map_while(Result::ok) {
                    let _ = tx.send(line);
                }
            });
        }
        lines
    }

    pub fn kill(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }

    /// Sends `signal` (`libc::SIGINT`, `libc::SIGTERM`…) and waits up to `timeout` for the exit.
    pub fn stop(&mut self, signal: libc::c_int, timeout: Duration) -> ExitStatus {
        // SAFETY: kill(2) on our own child's pid.
        let rc = unsafe { libc::kill(self.0.id() as libc::pid_t, signal) };
        assert_eq!(rc, 0, "kill({signal})");
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.0.try_wait().expect("the child's status") {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "no exit within {timeout:?} of signal {signal}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A `kvroute engine` or `kvroute gateway` that has printed its "… listening on URL" line.
pub struct Server {
    pub running: Running,
    pub url: String,
    /// The whole line, for what else the server says about itself.
    pub line: String,
    /// What it prints after that line, as it comes.
    pub lines: mpsc::Receiver<String>,
}

/// Starts `kvroute engine` workers 1..=n on free ports at 20× speed.
pub fn engines(n: u32) -> Vec<Server> {
    (1..=n)
        .map(|id| {
            Server::start(&[
                "engine",
                "--port",
                "0",
                "--worker-id",
                &id.to_string(),
                "--speedup",
                "20",
            ])
        })
        .collect()
}

/// `kvroute engine` worker `id` publishing KV events and registering over NATS at `nats` in
/// `namespace`, at `speedup`× real time, with a 1 s lease and no ZMQ publisher; then `extra`.
pub fn nats_engine(nats: &str, namespace: &str, id: u32, speedup: u32, extra: &[&str]) -> Server {
    let (id, speedup) = (id.to_string(), speedup.to_string());
    let mut args = vec![
        "engine",
        "--port",
        "0",
        "--worker-id",
        &id,
        "--speedup",
        &speedup,
        "--nats",
        nats,
        "--namespace",
        namespace,
        "--lease-ms",
        "1000",
        "--zmq-pub",
        "off",
    ];
    args.extend_from_slice(extra);
    Server::start(&args)
}

/// `kvroute gateway` on a free port, following NATS at `nats` in `namespace`; then `extra`.
pub fn nats_gateway(nats: &str, namespace: &str, extra: &[&str]) -> Server {
    let mut args = vec![
        "gateway",
        "--port",
        "0",
        "--nats",
        nats,
        "--namespace",
        namespace,
    ];
    args.extend_from_slice(extra);
    Server::start(&args)
}

/// Polls a gateway's `/health` until it counts `routable` routable workers, for up to `within`.
pub async fn wait_routable(url: &str, routable: u64, within: Duration) {
    let deadline = Instant::now() + within;
    loop {
        let health = get_json(&format!("{url}/health")).await;
        if health["routable_workers"] == routable {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "never {routable} routable workers: {health}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

impl Server {
    /// Sends `signal` to the server's process (SIGSTOP, SIGCONT, SIGKILL: a fault to survive).
    pub fn signal(&self, signal: libc::c_int) {
        // SAFETY: kill(2) on our own child's pid.
        let rc = unsafe { libc::kill(self.running.0.id() as libc::pid_t, signal) };
        assert_eq!(rc, 0, "kill({signal})");
    }

    /// Starts `kvroute ARGS` and waits up to 120 s (a debug build's engine builds its text
    /// assets first, slower still on a busy machine) for its "listening on" line. Its stderr
    /// goes to the test's, so a server that fails to start says why.
    pub fn start(args: &[&str]) -> Server {
        Server::start_command(kvroute(), args)
    }

    /// The same from a prepared `kvroute()` command (its environment set, say).
    pub fn start_command(command: Command, args: &[&str]) -> Server {
        let mut running = Running::spawn_command(command, args, Stdio::inherit());
        let stdout = running.take_stdout();
        let (tx, rx) = mpsc::channel();
        // Reads stdout to its end, so a chatty server never blocks on a full pipe.
        std::thread::spawn(move || {
            for line in stdout.lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let deadline = Instant::now() + Duration::from_secs(120);
        let line = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(line) if line.contains("listening on ") => break line,
                Ok(_) => {}
                Err(_) => panic!("kvroute {args:?} did not start listening"),
            }
        };
        let url = line
            .rsplit("listening on ")
            .next()
            .unwrap_or_default()
            .trim()
            .to_string();
        Server {
            running,
            url,
            line,
            lines: rx,
        }
    }

    /// Waits up to 10 s for a line it prints after listening that contains `needle`.
    pub fn line_with(&self, needle: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) if line.contains(needle) => return line,
                Ok(_) => {}
                Err(_) => panic!("{} printed no line with {needle:?}", self.url),
            }
        }
    }

    /// `HOST:PORT` of its URL.
    pub fn addr(&self) -> &str {
        self.url.trim_start_matches("http://")
    }
}
