//! KV-transfer links shared by concurrent transfers, in virtual time (sans-IO).
//!
//! A disaggregated request's KV moves from its prefill worker to its decode worker. On its
//! own a transfer takes `latency + bytes / bandwidth` (the profile's
//! `engine::HardwareProfile::kv_transfer_time`), but real links are shared: every transfer
//! out of one prefill worker leaves through the same NIC or NVLink port, every transfer into
//! one decode worker arrives through its own. [`LinkShare`] models that with per-endpoint fair
//! sharing: a transfer moving data gets `bandwidth / n` bytes per second, where `n` is the
//! number of transfers moving data through the busier of its two ports (its prefill worker's
//! way out, its decode worker's way in). Shares are recomputed whenever a transfer starts,
//! finishes or is cancelled, so a burst of long-prompt hand-offs out of one prefill worker
//! queues behind itself while transfers on disjoint ports do not slow each other. The fixed
//! latency (handshake, descriptor exchange) follows the data and uses no bandwidth.
//!
//! The caller passes the time in ([`LinkShare::start`], [`LinkShare::handle_timeout`] at
//! [`LinkShare::poll_timeout`]); nothing here reads a clock. Transfers are kept in a
//! `BTreeMap` by id and every share is a pure function of the active set, so the same calls
//! give the same arrivals.

use std::collections::BTreeMap;

use nanotime::Nanos;

/// Bytes a transfer may have left and still count as moved: float rounding of
/// `rate × elapsed` must not leave a transfer a fraction of a byte short forever.
const DONE_EPSILON_BYTES: f64 = 1e-3;

/// Why a transfer could not start.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LinkError {
    #[error("KV transfer {0} is already on the links")]
    Duplicate(u64),
    #[error("{0} KV transfers are already on the links (the bound)")]
    Full(usize),
}

/// A transfer whose KV has landed on its decode worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Arrived {
    pub id: u64,
    /// The decode worker.
    pub to: u32,
    pub started: Nanos,
    pub at: Nanos,
}

impl Arrived {
    /// How long the transfer took, contention included.
    pub fn took(&self) -> Nanos {
        self.at.saturating_sub(self.started)
    }
}

#[derive(Debug, Clone, Copy)]
enum State {
    /// Moving data: `remaining` bytes at `rate` bytes per second (as of [`LinkShare::now`]).
    Moving { remaining: f64, rate: f64 },
    /// Data moved; the latency runs out at `at`.
    Landing { at: Nanos },
}

#[derive(Debug, Clone, Copy)]
struct Transfer {
    from: u32,
    to: u32,
    started: Nanos,
    state: State,
}

/// The KV links of a fleet: every transfer in flight and its share of the bandwidth.
#[derive(Debug, Clone)]
pub struct LinkShare {
    bytes_per_sec: f64,
    latency: Nanos,
    max_transfers: usize,
    transfers: BTreeMap<u64, Transfer>,
    /// Moving transfers per prefill worker's way out, and per decode worker's way in.
    out_ports: BTreeMap<u32, u32>,
    in_ports: BTreeMap<u32, u32>,
    /// The time the moving transfers' `remaining` is accurate for.
    now: Nanos,
}

impl LinkShare {
    /// Links of `bytes_per_sec` per port (≤ 0: data moves instantly) and a fixed `latency`
    /// per transfer; at most `max_transfers` transfers at once (a request's decode leg
    /// holds at most one, so the fleet's sequence limit bounds it).
    pub fn new(bytes_per_sec: f64, latency: Nanos, max_transfers: usize) -> Self {
        LinkShare {
            bytes_per_sec,
            latency,
            max_transfers,
            transfers: BTreeMap::new(),
            out_ports: BTreeMap::new(),
            in_ports: BTreeMap::new(),
            now: Nanos::ZERO,
        }
    }

    /// Transfers on the links (moving or landing).
    pub fn in_flight(&self) -> usize {
        self.transfers.len()
    }

    /// Starts transfer `id` of `bytes` from prefill worker `from` to decode worker `to` at
    /// `now`; the shares of the transfers it meets on either port shrink from `now` on.
    pub fn start(
        &mut self,
        id: u64,
        from: u32,
        to: u32,
        bytes: u64,
        now: Nanos,
    ) -> Result<(), LinkError> {
        if self.transfers.contains_key(&id) {
            return Err(LinkError::Duplicate(id));
        }
        if self.transfers.len() >= self.max_transfers {
            return Err(LinkError::Full(self.max_transfers));
        }
        // A transfer cannot start before the links' present.
        let now = now.max(self.now);
        self.advance(now);
        let state = if bytes == 0 || self.bytes_per_sec <= 0.0 {
            State::Landing {
                at: now.saturating_add(self.latency),
            }
        } else {
            *self.out_ports.entry(from).or_default() += 1;
            *self.in_ports.entry(to).or_default() += 1;
            State::Moving {
                remaining: bytes as f64,
                rate: 0.0,
            }
        };
        self.transfers.insert(
            id,
            Transfer {
                from,
                to,
                started: now,
                state,
            },
        );
        self.reshare();
        Ok(())
    }

    /// Drops transfer `id` (its request went away) at `now`, freeing its share; false if it
    /// was not on the links.
    pub fn cancel(&mut self, id: u64, now: Nanos) -> bool {
        if !self.transfers.contains_key(&id) {
            return false;
        }
        self.advance(now);
        if let Some(t) = self.transfers.remove(&id) {
            if matches!(t.state, State::Moving { .. }) {
                self.leave_ports(t.from, t.to);
            }
        }
        self.reshare();
        true
    }

    /// When [`LinkShare::handle_timeout`] is next needed: the earliest end of a transfer's
    /// data at its current share, or of a latency. `None` with nothing on the links.
    pub fn poll_timeout(&self) -> Option<Nanos> {
        self.transfers
            .values()
            .map(|t| match t.state {
                State::Moving { remaining, rate } => self
                    .now
                    .saturating_add(secs_ceil((remaining - DONE_EPSILON_BYTES).max(0.0) / rate)),
                State::Landing { at } => at,
            })
            .min()
    }

    /// Brings the links to `now` and returns the transfers that landed by then, in order of
    /// arrival (ties by id).
    pub fn handle_timeout(&mut self, now: Nanos) -> Vec<Arrived> {
        self.advance(now);
        let mut out: Vec<Arrived> = self
            .transfers
            .iter()
            .filter_map(|(&id, t)| match t.state {
                State::Landing { at } if at <= self.now => Some(Arrived {
                    id,
                    to: t.to,
                    started: t.started,
                    at,
                }),
                _ => None,
            })
            .collect();
        for a in &out {
            self.transfers.remove(&a.id);
        }
        out.sort_by_key(|a| (a.at, a.id));
        out
    }

    /// Moves every transfer's data on to `now` at its share; a transfer whose data is
    /// through starts its latency when it ran out (not at `now`), and the others' shares grow.
    fn advance(&mut self, now: Nanos) {
        // Within one interval the shares are fixed, so the transfers whose data runs out
        // first are found, finished at that instant, and the rest move on at the new shares.
        while now > self.now {
            let next_done = self
                .transfers
                .values()
                .filter_map(|t| match t.state {
                    State::Moving { remaining, rate } => Some(self.now.saturating_add(secs_ceil(
                        (remaining - DONE_EPSILON_BYTES).max(0.0) / rate,
                    ))),
                    State::Landing { .. } => None,
                })
                .min();
            let until = next_done.map_or(now, |d| d.min(now));
            let dt = (until.saturating_sub(self.now)).as_secs_f64();
            let mut finished = Vec::new();
            for (&id, t) in self.transfers.iter_mut() {
                if let State::Moving { remaining, rate } = &mut t.state {
                    *remaining -= *rate * dt;
                    if *remaining <= DONE_EPSILON_BYTES {
                        finished.push((id, t.from, t.to));
                        t.state = State::Landing {
                            at: until.saturating_add(self.latency),
                        };
                    }
                }
            }
            self.now = until;
            for &(_, from, to) in &finished {
                self.leave_ports(from, to);
            }
            if !finished.is_empty() {
                self.reshare();
            }
        }
    }

    fn leave_ports(&mut self, from: u32, to: u32) {
        for (ports, port) in [(&mut self.out_ports, from), (&mut self.in_ports, to)] {
            if let Some(n) = ports.get_mut(&port) {
                *n -= 1;
                if *n == 0 {
                    ports.remove(&port);
                }
            }
        }
    }

    /// Every moving transfer's share: the bandwidth over the transfers on its busier port.
    fn reshare(&mut self) {
        let (outs, ins, bw) = (&self.out_ports, &self.in_ports, self.bytes_per_sec);
        for t in self.transfers.values_mut() {
            if let State::Moving { rate, .. } = &mut t.state {
                let n = outs
                    .get(&t.from)
                    .copied()
                    .unwrap_or(1)
                    .max(ins.get(&t.to).copied().unwrap_or(1))
                    .max(1);
                *rate = bw / f64::from(n);
            }
        }
    }
}

/// `secs` as nanoseconds, rounded up (at least 1 ns, so time always moves).
fn secs_ceil(secs: f64) -> Nanos {
    let ns = (secs * 1e9).ceil();
    if ns.is_finite() && ns < u64::MAX as f64 {
        Nanos((ns as u64).max(1))
    } else {
        Nanos::MAX
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GB: f64 = 1e9;

    /// Runs the links until empty; every arrival.
    fn drain(links: &mut LinkShare) -> Vec<Arrived> {
        let mut out = Vec::new();
        while let Some(t) = links.poll_timeout() {
            out.extend(links.handle_timeout(t));
        }
        out
    }

    fn took_ms(arrivals: &[Arrived], id: u64) -> f64 {
        arrivals
            .iter()
            .find(|a| a.id == id)
            .map(|a| a.took().as_millis_f64())
            .unwrap_or_else(|| panic!("transfer {id} never arrived: {arrivals:?}"))
    }

    #[test]
    fn one_transfer_takes_size_over_bandwidth_plus_latency() {
        let mut links = LinkShare::new(GB, Nanos::from_millis(2), 16);
        links.start(1, 0, 5, 100_000_000, Nanos::ZERO).unwrap();
        let a = drain(&mut links);
        // 100 MB at 1 GB/s is 100 ms, then the 2 ms latency.
        assert!((took_ms(&a, 1) - 102.0).abs() < 1e-3, "{a:?}");
        assert_eq!(a[0].to, 5);
        assert_eq!(links.in_flight(), 0);
    }

    #[test]
    fn two_transfers_out_of_one_prefill_worker_take_twice_as_long() {
        let mut links = LinkShare::new(GB, Nanos::ZERO, 16);
        // Same prefill worker 0, different decode workers: its way out is the bottleneck.
        links.start(1, 0, 5, 100_000_000, Nanos::ZERO).unwrap();
        links.start(2, 0, 6, 100_000_000, Nanos::ZERO).unwrap();
        let a = drain(&mut links);
        assert!((took_ms(&a, 1) - 200.0).abs() < 1e-3, "{a:?}");
        assert!((took_ms(&a, 2) - 200.0).abs() < 1e-3, "{a:?}");

        // Into one decode worker from two prefill workers: its way in is shared the same way.
        links.start(3, 0, 5, 100_000_000, Nanos::ZERO).unwrap();
        links.start(4, 1, 5, 100_000_000, Nanos::ZERO).unwrap();
        let a = drain(&mut links);
        assert!((took_ms(&a, 3) - 200.0).abs() < 1e-3, "{a:?}");
    }

    #[test]
    fn transfers_on_disjoint_ports_do_not_slow_each_other() {
        let mut links = LinkShare::new(GB, Nanos::from_millis(1), 16);
        links.start(1, 0, 5, 50_000_000, Nanos::ZERO).unwrap();
        links.start(2, 1, 6, 50_000_000, Nanos::ZERO).unwrap();
        let a = drain(&mut links);
        assert!((took_ms(&a, 1) - 51.0).abs() < 1e-3, "{a:?}");
        assert!((took_ms(&a, 2) - 51.0).abs() < 1e-3, "{a:?}");
    }

    #[test]
    fn a_share_grows_back_when_the_other_transfer_ends() {
        let mut links = LinkShare::new(GB, Nanos::ZERO, 16);
        links.start(1, 0, 5, 100_000_000, Nanos::ZERO).unwrap();
        links.start(2, 0, 6, 20_000_000, Nanos::ZERO).unwrap();
        let a = drain(&mut links);
        // Both at 0.5 GB/s until 2's 20 MB are through (40 ms, 1 has 80 MB left), then 1
        // alone at 1 GB/s: 80 ms more.
        assert!((took_ms(&a, 2) - 40.0).abs() < 1e-3, "{a:?}");
        assert!((took_ms(&a, 1) - 120.0).abs() < 1e-3, "{a:?}");

        // A transfer joining halfway slows the first from then on only.
        links.start(3, 0, 5, 100_000_000, Nanos::ZERO).unwrap();
        let early = links.handle_timeout(Nanos::from_millis(50));
        assert!(early.is_empty());
        links
            .start(4, 0, 6, 25_000_000, Nanos::from_millis(50))
            .unwrap();
        let a = drain(&mut links);
        // 3: 50 MB alone, 25 MB shared (50 ms) while 4 moves, 25 MB alone: 125 ms.
        assert!((took_ms(&a, 3) - 125.0).abs() < 1e-3, "{a:?}");
        assert!((took_ms(&a, 4) - 50.0).abs() < 1e-3, "{a:?}");
    }

    #[test]
    fn cancelling_frees_the_share_and_bounds_hold() {
        let mut links = LinkShare::new(GB, Nanos::ZERO, 2);
        links.start(1, 0, 5, 100_000_000, Nanos::ZERO).unwrap();
        links.start(2, 0, 6, 100_000_000, Nanos::ZERO).unwrap();
        assert_eq!(
            links.start(3, 0, 7, 1, Nanos::ZERO),
            Err(LinkError::Full(2))
        );
        assert_eq!(
            links.start(2, 0, 7, 1, Nanos::ZERO),
            Err(LinkError::Duplicate(2))
        );
        // 2 goes away after 50 ms (25 MB each moved); 1 has 75 MB left at full rate.
        assert!(links.cancel(2, Nanos::from_millis(50)));
        assert!(!links.cancel(2, Nanos::from_millis(50)));
        let a = drain(&mut links);
        assert_eq!(a.len(), 1);
        assert!((took_ms(&a, 1) - 125.0).abs() < 1e-3, "{a:?}");
    }

    #[test]
    fn the_same_calls_give_the_same_arrivals() {
        let run = || {
            let mut links = LinkShare::new(3.3 * GB, Nanos::from_micros(7), 64);
            let mut arrivals = Vec::new();
            for i in 0..40u64 {
                let now = Nanos::from_micros(i * 137);
                arrivals.extend(links.handle_timeout(now));
                links
                    .start(
                        i,
                        (i % 3) as u32,
                        3 + (i % 4) as u32,
                        1_000_003 * (i + 1),
                        now,
                    )
                    .unwrap();
            }
            arrivals.extend(drain(&mut links));
            arrivals
        };
        let (a, b) = (run(), run());
        assert_eq!(a.len(), 40);
        assert_eq!(a, b);
        assert!(a.windows(2).all(|w| w[0].at <= w[1].at));
    }
}
