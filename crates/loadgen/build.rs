//! Embeds the web UI (`web/` at the workspace root) in the binary: a table of (URL path,
//! bytes) generated at build time, so `cargo build` alone ships every asset.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

fn collect(dir: &Path, root: &Path, out: &mut Vec<(String, PathBuf)>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut entries: Vec<_> = entries.flatten().map(|e| e.path()).collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            println!("cargo:rerun-if-changed={}", path.display());
            collect(&path, root, out);
        } else if let Ok(relative) = path.strip_prefix(root) {
            let url = format!("/{}", relative.to_string_lossy().replace('\\', "/"));
            out.push((url, path));
        }
    }
}

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let web = manifest.join("../../web");
    println!("cargo:rerun-if-changed={}", web.display());
    let mut files = Vec::new();
    collect(&web, &web, &mut files);
    let mut code = String::from(
        "/// Embedded web assets: (URL path, bytes).\npub static ASSETS: &[(&str, &[u8])] = &[\n",
    );
    for (url, path) in &files {
        println!("cargo:rerun-if-changed={}", path.display());
        let _ = writeln!(
            code,
            "    ({url:?}, include_bytes!({:?})),",
            path.display().to_string()
        );
    }
    code.push_str("];\n");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets it")).join("assets.rs");
    std::fs::write(out, code).expect("writing assets.rs");
}
