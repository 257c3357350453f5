//! `--max-connections`, shared by `engine` and `gateway`: the bound on client connections of
//! their listener (`protocol::listener`), checked against the open-file limit after raising
//! the soft limit to the hard one.

use anyhow::Result;

#[derive(Debug, Clone, clap::Args)]
pub struct ConnectionArgs {
    /// Most client connections served at once; past it, up to 64 more are answered 503
    /// `too_many_connections` and closed. Default: what the open-file limit allows (half of
    /// it less 128; the soft limit is raised to the hard one at start-up). More than that is
    /// refused: raise `ulimit -n` / systemd's `LimitNOFILE` instead.
    #[arg(long, value_name = "N")]
    max_connections: Option<usize>,
}

impl ConnectionArgs {
    /// Raises the soft open-file limit to the hard one and checks the flag against it: the
    /// bound to serve with, and a line saying what was done, for the caller to print once.
    pub fn bound(&self) -> Result<(usize, String)> {
        let limit = match protocol::listener::raise_open_file_limit() {
            Ok(limit) => limit.to_string(),
            Err(e) => format!("open-file limit not raised ({e})"),
        };
        let bound = protocol::listener::checked_max_connections(self.max_connections)
            .map_err(anyhow::Error::msg)?;
        Ok((
            bound,
            format!("at most {bound} client connections; {limit}"),
        ))
    }
}
