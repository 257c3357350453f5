//! Running the `kvroute` binary from the CLI tests.

#![allow(dead_code)]

use std::process::{Child, Command};

pub fn kvroute() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvroute"))
}

/// Kills the child if the test fails before it stops it.
pub struct Running(pub Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
