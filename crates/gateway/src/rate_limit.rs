//! Per-client rate limit (`--rate-limit RPS`, `--rate-limit-burst N`): a token bucket per
//! client address, refilled at `rps`, holding at most `burst`; a request finding its bucket
//! empty is answered 429 with `Retry-After` (the seconds until a token is back).
//!
//! The table of clients is bounded ([`MAX_CLIENTS`]): a bucket that has refilled to `burst`
//! is the same as no bucket and is dropped when the table is full; if none has, clients beyond
//! the table share one overflow bucket, so a flood of new addresses cannot grow memory or
//! starve known clients. IPv6 clients are keyed by their /64 (one host's usual allocation).
//!
//! The buckets take the time as an argument (no clock here): the middleware passes
//! `Instant::now()`.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{ConnectInfo, Request, State};
use axum::http::{HeaderValue, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use protocol::ApiError;

/// Most clients with their own bucket.
pub const MAX_CLIENTS: usize = 65_536;
/// How often a full table is swept for refilled buckets, at most.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// The limit: `rps` requests per second per client, bursts of up to `burst`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RateLimit {
    pub rps: f64,
    pub burst: u32,
}

impl RateLimit {
    /// An error naming the flag for a rate or burst that cannot work.
    pub fn new(rps: f64, burst: Option<u32>) -> Result<RateLimit, String> {
        if !(rps.is_finite() && rps > 0.0) {
            return Err(format!(
                "--rate-limit must be a positive number of requests per second, got {rps}"
            ));
        }
        // Default burst: one second's worth, at least one request.
        let burst = burst.unwrap_or_else(|| rps.ceil().min(f64::from(u32::MAX)) as u32);
        if burst == 0 {
            return Err("--rate-limit-burst must be at least 1".to_owned());
        }
        Ok(RateLimit { rps, burst })
    }
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    updated: Instant,
}

impl Bucket {
    fn refill(&mut self, limit: RateLimit, now: Instant) {
        let elapsed = now.saturating_duration_since(self.updated).as_secs_f64();
        self.tokens = (self.tokens + elapsed * limit.rps).min(f64::from(limit.burst));
        self.updated = now;
    }

    /// Takes a token, or says how long until one is back.
    fn take(&mut self, limit: RateLimit, now: Instant) -> Result<(), Duration> {
        self.refill(limit, now);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            Ok(())
        } else {
            Err(Duration::from_secs_f64((1.0 - self.tokens) / limit.rps))
        }
    }

    fn is_full(&self, limit: RateLimit, now: Instant) -> bool {
        let mut probe = *self;
        probe.refill(limit, now);
        probe.tokens >= f64::from(limit.burst)
    }
}

/// The buckets of every client (see the module).
#[derive(Debug)]
pub struct ClientBuckets {
    limit: RateLimit,
    max_clients: usize,
    buckets: HashMap<IpAddr, Bucket>,
    overflow: Bucket,
    last_sweep: Option<Instant>,
}

impl ClientBuckets {
    pub fn new(limit: RateLimit, max_clients: usize) -> ClientBuckets {
        ClientBuckets {
            limit,
            max_clients,
            buckets: HashMap::new(),
            overflow: Bucket {
                tokens: f64::from(limit.burst),
                updated: Instant::now(),
            },
            last_sweep: None,
        }
    }

    /// One request of `client` at `now`: allowed, or refused with the wait until its next
    /// token.
    pub fn check(&mut self, client: IpAddr, now: Instant) -> Result<(), Duration> {
        let key = client_key(client);
        let limit = self.limit;
        if !self.buckets.contains_key(&key) && self.buckets.len() >= self.max_clients {
            self.sweep(now);
        }
        if let Some(bucket) = self.buckets.get_mut(&key) {
            return bucket.take(limit, now);
        }
        if self.buckets.len() >= self.max_clients {
            return self.overflow.take(limit, now);
        }
        let mut bucket = Bucket {
            tokens: f64::from(limit.burst),
            updated: now,
        };
        let taken = bucket.take(limit, now);
        self.buckets.insert(key, bucket);
        taken
    }

    /// Drops the buckets that have refilled (no more often than [`SWEEP_EVERY`]).
    fn sweep(&mut self, now: Instant) {
        if self
            .last_sweep
            .is_some_and(|last| now.saturating_duration_since(last) < SWEEP_EVERY)
        {
            return;
        }
        self.last_sweep = Some(now);
        let limit = self.limit;
        self.buckets.retain(|_, bucket| !bucket.is_full(limit, now));
    }

    pub fn clients(&self) -> usize {
        self.buckets.len()
    }
}

/// IPv4 addresses as they are (IPv4-mapped IPv6 included); IPv6 by its /64.
fn client_key(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(v4) => IpAddr::V4(v4),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let s = v6.segments();
                IpAddr::V6(Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
            }
        },
    }
}

/// The middleware: `/v1/*` requests pass through their client's bucket; `/health` and
/// `/metrics` (probes, Prometheus) are not limited.
pub(crate) async fn limit(
    State(buckets): State<Arc<Mutex<ClientBuckets>>>,
    request: Request,
    next: Next,
) -> Response {
    let client = request
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|info| info.0.ip());
    if let (Some(client), true) = (client, request.uri().path().starts_with("/v1/")) {
        let verdict = buckets
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .check(client, Instant::now());
        if let Err(wait) = verdict {
            // Whole seconds, rounded up: a client that waits that long finds a token.
            let seconds = wait.as_secs_f64().ceil().max(1.0) as u64;
            let mut response = ApiError::new(
                429,
                protocol::error::kind::RATE_LIMIT,
                format!(
                    "Rate limit reached for this client address: retry after {seconds} s \
                     (the gateway's --rate-limit)"
                ),
                None,
                Some(protocol::error::code::RATE_LIMIT_EXCEEDED),
            )
            .into_response();
            if let Ok(value) = HeaderValue::from_str(&seconds.to_string()) {
                response.headers_mut().insert(header::RETRY_AFTER, value);
            }
            return response;
        }
    }
    next.run(request).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn a_client_gets_its_burst_then_the_rate() {
        let limit = RateLimit::new(2.0, Some(3)).unwrap();
        let mut buckets = ClientBuckets::new(limit, 10);
        let t0 = Instant::now();
        for _ in 0..3 {
            assert!(buckets.check(ip("10.0.0.1"), t0).is_ok());
        }
        let wait = buckets.check(ip("10.0.0.1"), t0).unwrap_err();
        assert_eq!(wait, Duration::from_millis(500));
        // Another client has its own bucket.
        assert!(buckets.check(ip("10.0.0.2"), t0).is_ok());
        // Half a second later one token is back, and only one.
        let t1 = t0 + Duration::from_millis(500);
        assert!(buckets.check(ip("10.0.0.1"), t1).is_ok());
        assert!(buckets.check(ip("10.0.0.1"), t1).is_err());
    }

    #[test]
    fn the_table_is_bounded_and_refilled_buckets_make_room() {
        let limit = RateLimit::new(1.0, Some(1)).unwrap();
        let mut buckets = ClientBuckets::new(limit, 4);
        let t0 = Instant::now();
        for i in 0..4 {
            assert!(buckets.check(ip(&format!("10.0.0.{i}")), t0).is_ok());
        }
        // Beyond the table, new clients share the overflow bucket.
        assert!(buckets.check(ip("10.0.1.1"), t0).is_ok());
        assert!(buckets.check(ip("10.0.1.2"), t0).is_err());
        assert_eq!(buckets.clients(), 4);
        // Once the known clients' buckets have refilled, they make room.
        let t1 = t0 + Duration::from_secs(2);
        assert!(buckets.check(ip("10.0.1.3"), t1).is_ok());
        assert_eq!(buckets.clients(), 1);
    }

    #[test]
    fn ipv6_clients_are_keyed_by_their_64_and_mapped_ipv4_as_ipv4() {
        assert_eq!(
            client_key(ip("2001:db8:1:2:aaaa::1")),
            client_key(ip("2001:db8:1:2:bbbb::2"))
        );
        assert_ne!(
            client_key(ip("2001:db8:1:2::1")),
            client_key(ip("2001:db8:1:3::1"))
        );
        assert_eq!(client_key(ip("::ffff:10.0.0.1")), ip("10.0.0.1"));
        assert!(RateLimit::new(0.0, None).is_err());
        assert!(RateLimit::new(5.0, Some(0)).is_err());
        assert_eq!(RateLimit::new(2.5, None).unwrap().burst, 3);
    }
}
