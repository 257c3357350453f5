//! NATS subject names.
//!
//! - `kvroute.<namespace>.kv.<worker>`: a worker's KV event batches
//!   ([`KvEventBatch`](crate::KvEventBatch), msgpack).
//! - `kvroute.<namespace>.kv_state.<worker>`: requests for a worker's whole cache
//!   ([`KvStateRequest`](crate::KvStateRequest)); it answers on the reply subject.
//! - `kvroute.<namespace>.workers`: [`WorkerMessage`](crate::WorkerMessage)s (JSON):
//!   announcements, repeated as heartbeats within each lease, and goodbyes.
//! - `kvroute.<namespace>.replicas`: gateway replicas' [`ReplicaBatch`](crate::ReplicaBatch)es
//!   (msgpack): their routing updates, heartbeats and goodbyes; each replica ignores its own.
//! - `kvroute.<namespace>.replicas.snapshot`: a starting replica's
//!   [`SnapshotRequest`](crate::SnapshotRequest); peers answer on its reply subject.
//!
//! A namespace is one NATS subject token: non-empty, at most 128 bytes, no `.`, `*`, `>` or
//! whitespace (so several clusters share one NATS server without seeing each other).

use kv_index::WorkerId;
use thiserror::Error;

const PREFIX: &str = "kvroute";
/// Longest namespace accepted.
pub const MAX_NAMESPACE_LEN: usize = 128;

/// A namespace that cannot be a NATS subject token.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error(
    "namespace {0:?} is not a NATS subject token: use 1-128 characters without '.', '*', '>' or whitespace"
)]
pub struct BadNamespace(pub String);

/// The subjects of one namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subjects {
    namespace: String,
}

impl Subjects {
    pub fn new(namespace: &str) -> Result<Subjects, BadNamespace> {
        let valid = !namespace.is_empty()
            && namespace.len() <= MAX_NAMESPACE_LEN
            && !namespace
                .chars()
                .any(|c| c == '.' || c == '*' || c == '>' || c.is_whitespace());
        if valid {
            Ok(Subjects {
                namespace: namespace.to_string(),
            })
        } else {
            Err(BadNamespace(namespace.to_string()))
        }
    }

    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// Where `worker` publishes its KV events.
    pub fn kv_events(&self, worker: WorkerId) -> String {
        format!("{PREFIX}.{}.kv.{}", self.namespace, worker.0)
    }

    /// Subscribe here to receive every worker's KV events.
    pub fn kv_events_all(&self) -> String {
        format!("{PREFIX}.{}.kv.*", self.namespace)
    }

    /// The worker a KV event subject belongs to (`None` for another subject or namespace).
    pub fn parse_kv_events(&self, subject: &str) -> Option<WorkerId> {
        let rest = subject
            .strip_prefix(PREFIX)?
            .strip_prefix('.')?
            .strip_prefix(self.namespace.as_str())?
            .strip_prefix(".kv.")?;
        // Canonical decimal only, so one worker has one subject.
        if rest.is_empty() || (rest.len() > 1 && rest.starts_with('0')) {
            return None;
        }
        if !rest.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        rest.parse().ok().map(WorkerId)
    }

    /// Where `worker` answers requests for its whole cache ([`KvStateRequest`](crate::KvStateRequest)).
    pub fn kv_state(&self, worker: WorkerId) -> String {
        format!("{PREFIX}.{}.kv_state.{}", self.namespace, worker.0)
    }

    /// Worker announcements, heartbeats and goodbyes.
    pub fn workers(&self) -> String {
        format!("{PREFIX}.{}.workers", self.namespace)
    }

    /// Gateway replicas' routing updates (one subject for all replicas).
    pub fn replicas(&self) -> String {
        format!("{PREFIX}.{}.replicas", self.namespace)
    }

    /// Requests for replicas' snapshots of their in-flight requests.
    pub fn replica_snapshots(&self) -> String {
        format!("{PREFIX}.{}.replicas.snapshot", self.namespace)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects_build_and_parse() {
        let s = Subjects::new("demo").unwrap();
        assert_eq!(s.kv_events(WorkerId(12)), "kvroute.demo.kv.12");
        assert_eq!(s.kv_events_all(), "kvroute.demo.kv.*");
        // Not under the events wildcard.
        assert_eq!(s.kv_state(WorkerId(3)), "kvroute.demo.kv_state.3");
        assert_eq!(s.parse_kv_events(&s.kv_state(WorkerId(3))), None);
        assert_eq!(s.workers(), "kvroute.demo.workers");
        assert_eq!(s.replicas(), "kvroute.demo.replicas");
        assert_eq!(s.replica_snapshots(), "kvroute.demo.replicas.snapshot");
        assert_eq!(s.parse_kv_events("kvroute.demo.kv.12"), Some(WorkerId(12)));
        for other in [
            "kvroute.other.kv.12",
            "kvroute.demo.kv.",
            "kvroute.demo.kv.012",
            "kvroute.demo.kv.1x",
            "kvroute.demo.kv.-1",
            "kvroute.demo.workers",
            "kvroute.demox.kv.1",
            "kvroute.demo.kv.99999999999999999999999",
        ] {
            assert_eq!(s.parse_kv_events(other), None, "{other}");
        }
    }

    #[test]
    fn bad_namespaces() {
        for bad in ["", "a.b", "a*", "a>", "a b", &"x".repeat(129)] {
            assert!(Subjects::new(bad).is_err(), "{bad}");
        }
        assert!(Subjects::new("team-a_1").is_ok());
    }
}
