//! `--nats-creds` and `--nats-tls-*`, shared by `engine` and `gateway`: how they authenticate
//! to NATS and check the server. A user and password or a token go in the `--nats` URL
//! (`nats://user:pass@host:4222`; better through the `NATS_URL` environment variable than
//! on the command line) and are redacted wherever the URL is printed or announced.

use std::path::PathBuf;

use protocol::nats_client::NatsSecurity;

#[derive(Debug, Clone, clap::Args)]
pub struct NatsSecurityArgs {
    /// With --nats: a NATS credentials file (user JWT and NKey seed, as `nsc` writes it).
    #[arg(long, value_name = "FILE", requires = "nats")]
    nats_creds: Option<PathBuf>,
    /// With --nats: verify the server's certificate against these PEM CA certificates; TLS
    /// is then required (a server without TLS is refused).
    #[arg(long, value_name = "FILE", requires = "nats")]
    nats_tls_ca: Option<PathBuf>,
    /// With --nats: a PEM client certificate, for servers that verify clients (mutual TLS).
    #[arg(long, value_name = "FILE", requires_all = ["nats", "nats_tls_key"])]
    nats_tls_cert: Option<PathBuf>,
    /// The PEM private key of --nats-tls-cert.
    #[arg(long, value_name = "FILE", requires = "nats_tls_cert")]
    nats_tls_key: Option<PathBuf>,
}

impl NatsSecurityArgs {
    pub fn security(&self) -> NatsSecurity {
        NatsSecurity {
            creds: self.nats_creds.clone(),
            tls_ca: self.nats_tls_ca.clone(),
            tls_client: self.nats_tls_cert.clone().zip(self.nats_tls_key.clone()),
        }
    }
}
