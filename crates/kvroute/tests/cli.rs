//! The `kvroute` binary as a user runs it.

use std::io::Write;
use std::process::Stdio;

mod common;

use common::{failure, kvroute, stdout_of};

#[test]
fn hash_prints_the_pinned_test_vectors() {
    let tokens: Vec<String> = (0..70).map(|t| t.to_string()).collect();
    let tokens: Vec<&str> = tokens.iter().map(String::as_str).collect();
    let stdout = stdout_of(&[&["hash"], &tokens[..]].concat());
    // The crate docs' test vectors for tokens 0..63, block size 32.
    assert!(stdout.contains("0x7949379a13dba8d2"), "{stdout}");
    assert!(stdout.contains("0xa6316d8655c998ff"), "{stdout}");
    assert!(
        stdout.contains("70 tokens, 2 full blocks of 32, 6 tail tokens"),
        "{stdout}"
    );
}

#[test]
fn hash_reads_stdin_and_writes_json() {
    let mut child = kvroute()
        .args(["hash", "--json", "--block-size", "2"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"1, 2,3\n4 5")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["tokens"], 5);
    assert_eq!(json["blocks"].as_array().unwrap().len(), 2);
    assert_eq!(json["uncached_tail_tokens"], 1);
}

#[test]
fn hash_rejects_bad_input_with_a_clear_error() {
    let stderr = failure(&["hash", "12", "x7"]);
    assert!(stderr.contains("`x7` is not a token id"), "{stderr}");
    let stderr = failure(&["hash", "--block-size", "0", "1"]);
    assert!(stderr.contains("--block-size"), "{stderr}");
}

#[test]
fn profiles_lists_every_builtin_with_its_capacity() {
    let stdout = stdout_of(&["profiles"]);
    for name in ["h200-llama70b-fp8", "h100-llama8b", "dynamo-mocker"] {
        assert!(stdout.contains(name), "{name} missing:\n{stdout}");
    }
    // Seed 002's worker: (141 GB − weights − reserve) × 0.90 / (163,840 B × 32) blocks.
    assert!(stdout.contains("13022 blocks × 32 tokens"), "{stdout}");
    // Dynamo's mocker pool: 16,384 blocks of 64 tokens.
    assert!(stdout.contains("16384 blocks × 64 tokens"), "{stdout}");
    // Seed 004's disaggregated layouts, by the names `kvroute sim --layout` takes.
    assert!(
        stdout.contains("seed004-dev   1P:1D of h100-llama8b, KV over network"),
        "{stdout}"
    );
    assert!(
        stdout.contains("seed004-prod  2P:3D of h200-llama70b-fp8, KV over nvlink"),
        "{stdout}"
    );
}

#[test]
fn a_shown_profile_edited_into_a_file_checks_out() {
    let toml = stdout_of(&["profiles", "show", "h100-llama8b"])
        .replace("name = \"h100-llama8b\"", "name = \"my-gpu\"");
    let dir = std::env::temp_dir().join(format!("kvroute-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("my-gpu.toml");
    std::fs::write(&path, toml).unwrap();
    let path_arg = path.to_str().expect("a UTF-8 temporary path");
    assert!(stdout_of(&["profiles", "check", path_arg]).contains("my-gpu"));

    std::fs::write(&path, "name = \"broken\"\ngpu_memory_bytes = \"lots\"\n").unwrap();
    let stderr = failure(&["profiles", "check", path_arg]);
    assert!(
        stderr.contains("is not a valid hardware profile"),
        "{stderr}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn an_unknown_profile_lists_the_known_ones() {
    let stderr = failure(&["profiles", "show", "b300"]);
    assert!(stderr.contains("h200-llama70b-fp8"), "{stderr}");
}
