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

/// A listener that could not bind `addr`: the system's reason, once, and what to do about it,
/// naming the flags that chose the address (`port_flag`; `host_flag`, `None` where the
/// address is not the user's choice).
pub fn cannot_listen(
    addr: std::net::SocketAddr,
    source: &std::io::Error,
    port_flag: &str,
    host_flag: Option<&str>,
) -> anyhow::Error {
    use std::io::ErrorKind;
    let advice = match (source.kind(), host_flag) {
        (ErrorKind::AddrInUse, _) => format!(
            "another process is listening there: stop it, or pick another port with {port_flag}"
        ),
        (ErrorKind::PermissionDenied, _) if addr.port() < 1024 => format!(
            "ports below 1024 need extra privileges: pick one from 1024 up with {port_flag}"
        ),
        (ErrorKind::AddrNotAvailable, Some(host_flag)) => format!(
            "{} is not an address of this machine: give one of its own with {host_flag} \
             (0.0.0.0 listens on all of them)",
            addr.ip()
        ),
        (_, Some(host_flag)) => format!("check {host_flag} and {port_flag}"),
        (_, None) => format!("check {port_flag}"),
    };
    anyhow::anyhow!("cannot listen on {addr}: {source}; {advice}")
}
