//! What `deploy/Dockerfile` promises of its image, checked without a container engine (none
//! runs on CI's machine): the `kvroute` binary links only the libraries of its base image
//! (`gcr.io/distroless/cc-debian12`: glibc, libm, libgcc_s), and it serves from a root that
//! holds nothing else (no shell, no /etc, no /usr/share) as the image's non-root uid 65532.
//! The second test builds such a root from the binary and the libraries it links, and runs
//! `kvroute engine` in it under `chroot` (with /proc mounted, as a container has): it must
//! answer a chat completion from the embedded profile, tokenizer and corpus.
//!
//! The bare-root test needs root (for chroot and the mount namespace) and util-linux's `unshare`;
//! without them it prints SKIPPED and passes.

mod common;

use std::collections::BTreeSet;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use common::{Running, post_json};

/// The shared objects of distroless/cc-debian12, by soname (plus the kernel's vDSO).
const DISTROLESS_CC: [&str; 5] = [
    "linux-vdso.so.1",
    "ld-linux-x86-64.so.2",
    "libc.so.6",
    "libm.so.6",
    "libgcc_s.so.1",
];

/// (soname, resolved path) of each library `ldd` lists for `binary`, or None when `ldd` is
/// missing.
fn linked_libraries(binary: &Path) -> Option<Vec<(String, Option<PathBuf>)>> {
    let output = match Command::new("ldd").arg(binary).output() {
        Ok(output) => output,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            println!("SKIPPED: ldd is not installed");
            return None;
        }
        Err(e) => panic!("running ldd: {e}"),
    };
    assert!(output.status.success(), "ldd {}", binary.display());
    let libraries = String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| {
            // "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x…)" or "/lib64/ld-linux… (0x…)"
            let line = line.trim();
            let (name, rest) = match line.split_once(" => ") {
                Some((name, rest)) => (name.to_string(), Some(rest)),
                None => (line.split_whitespace().next()?.to_string(), None),
            };
            let path = match rest {
                Some(rest) => rest.split_whitespace().next().map(PathBuf::from),
                None if name.starts_with('/') => Some(PathBuf::from(&name)),
                None => None,
            };
            let soname = Path::new(&name)
                .file_name()
                .map(|f| f.to_string_lossy().into_owned())
                .unwrap_or(name);
            Some((soname, path))
        })
        .collect();
    Some(libraries)
}

#[test]
fn the_binary_links_only_what_the_distroless_base_image_has() {
    let binary = Path::new(env!("CARGO_BIN_EXE_kvroute"));
    let Some(libraries) = linked_libraries(binary) else {
        return;
    };
    let names: BTreeSet<&str> = libraries.iter().map(|(n, _)| n.as_str()).collect();
    assert!(names.contains("libc.so.6"), "{names:?}");
    let foreign: Vec<&&str> = names
        .iter()
        .filter(|n| !DISTROLESS_CC.contains(n))
        .collect();
    assert!(
        foreign.is_empty(),
        "kvroute now links {foreign:?}, which gcr.io/distroless/cc-debian12 lacks: the image \
         would not start. Use a pure-Rust crate or change deploy/Dockerfile's base."
    );
}

/// Whether this process may chroot and make a mount namespace.
fn can_chroot() -> bool {
    // SAFETY: geteuid(2) has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let tools = ["unshare", "chroot", "mount"].iter().all(|tool| {
        Command::new(tool)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok()
    });
    root && tools
}

/// A temporary directory for the bare root, removed when the test ends.
struct BareRoot(PathBuf);

impl BareRoot {
    fn new() -> BareRoot {
        let dir = std::env::temp_dir().join(format!("kvroute-bare-root-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("a temporary root");
        BareRoot(dir)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for BareRoot {
    fn drop(&mut self) {
        // /proc was mounted in the engine's own mount namespace, so nothing is mounted here.
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn the_binary_serves_from_a_bare_root_as_the_images_non_root_user() {
    if !can_chroot() {
        println!("SKIPPED: needs root with unshare, chroot and mount to build a bare root");
        return;
    }
    let binary = Path::new(env!("CARGO_BIN_EXE_kvroute"));
    let Some(libraries) = linked_libraries(binary) else {
        return;
    };
    let root = BareRoot::new();
    let place = |path: &Path, from: &Path| {
        let to = root.path().join(path.strip_prefix("/").unwrap_or(path));
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(from, &to).unwrap_or_else(|e| panic!("copy {}: {e}", from.display()));
    };
    place(Path::new("/usr/local/bin/kvroute"), binary);
    for (_, path) in &libraries {
        if let Some(path) = path {
            place(path, &std::fs::canonicalize(path).unwrap());
        }
    }
    for dir in ["proc", "tmp"] {
        std::fs::create_dir_all(root.path().join(dir)).unwrap();
    }
    assert!(
        !root.path().join("bin/sh").exists(),
        "the root has no shell"
    );

    // A mount namespace of its own so /proc (which a container has) is mounted only for it;
    // --kill-child takes the engine down with unshare when the test stops it.
    let root_dir = root.path().display().to_string();
    let script = format!(
        "mount -t proc proc '{root_dir}/proc' && exec chroot --userspec=65532:65532 '{root_dir}' \
         /usr/local/bin/kvroute engine --port 0 --speedup 20"
    );
    let child = Command::new("unshare")
        .args(["--mount", "--fork", "--kill-child", "sh", "-c", &script])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("unshare runs");
    let mut engine = Engine(Running(child));
    let stderr = engine.0.0.stderr.take().unwrap();
    let (lines_tx, lines) = mpsc::channel();
    for stream in [
        Box::new(engine.0.take_stdout()) as Box<dyn BufRead + Send>,
        Box::new(std::io::BufReader::new(stderr)),
    ] {
        let lines_tx = lines_tx.clone();
        std::thread::spawn(move || {
            for line in stream.lines().map_while(Result::ok) {
                if lines_tx.send(line).is_err() {
                    break;
                }
            }
        });
    }
    let mut said = Vec::new();
    let url = loop {
        match lines.recv_timeout(Duration::from_secs(30)) {
            Ok(line) => {
                if let Some(url) = line.split("listening on ").nth(1) {
                    break url.trim().to_string();
                }
                said.push(line);
            }
            Err(_) => panic!("the engine did not start in the bare root: {said:#?}"),
        }
    };
    let addr = url.trim_start_matches("http://").to_string();
    let (status, info) = common::http(&addr, "GET", "/info", "");
    assert_eq!(status, 200, "{info}");
    let model = serde_json::from_str::<serde_json::Value>(&info).unwrap()["model"]
        .as_str()
        .expect("/info names the model")
        .to_string();
    let (status, reply) = post_json(
        &addr,
        "/v1/chat/completions",
        &serde_json::json!({
            "model": model,
            "messages": [{"role": "user", "content": "What does a KV cache hold?"}],
            "max_tokens": 8,
        }),
    );
    assert_eq!(status, 200, "{reply}");
    let content = reply["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(!content.is_empty(), "{reply}");
    assert_eq!(reply["usage"]["completion_tokens"], 8, "{reply}");
}

/// Stops the chrooted engine, then `unshare`: --kill-child cannot, because the engine's
/// change of user (chroot --userspec) clears the parent-death signal it relies on.
struct Engine(Running);

impl Drop for Engine {
    fn drop(&mut self) {
        let unshare = self.0.0.id();
        let children = std::fs::read_to_string(format!("/proc/{unshare}/task/{unshare}/children"))
            .unwrap_or_default();
        for pid in children
            .split_whitespace()
            .filter_map(|p| p.parse::<i32>().ok())
        {
            // SAFETY: kill(2) on the engine this test started (unshare's only child).
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        self.0.kill();
    }
}
