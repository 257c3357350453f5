//! The workload alone at the simulator's scale target: N open conversations (default 60,000)
//! for one simulated hour, each turn served after 2 s + 30 ms per output token (~27 s, so
//! almost every conversation has a turn in flight, its prompt held). Prints turns generated,
//! wall time and peak memory (Linux).
//!
//! `cargo run --release -p workload --example scale -- [CONVERSATIONS] [SIMULATED_SECONDS]`

// An example is a driver: it reads the clock and files around the core (clippy.toml).
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Instant;

use nanotime::Nanos;
use workload::{Assets, ChatWorkload, Turn, TurnKey, WorkloadConfig};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let conversations: u32 = args.next().map_or(Ok(60_000), |a| a.parse())?;
    let seconds: u64 = args.next().map_or(Ok(3_600), |a| a.parse())?;
    let started = Instant::now();
    let assets = Assets::builtin()?;
    let assets_time = started.elapsed();
    let config = WorkloadConfig {
        concurrency: conversations,
        ramp_s: 60.0,
        ..WorkloadConfig::default()
    };
    let mut workload = ChatWorkload::new(config, assets, 1, Nanos::ZERO)?;
    // In flight: finish time, id, and the request (its prompt and output stay alive, as in an
    // engine's queue).
    let mut in_flight: BinaryHeap<Reverse<(Nanos, TurnKey)>> = BinaryHeap::new();
    let mut held: std::collections::HashMap<TurnKey, Turn> = Default::default();
    let end = Nanos::from_secs(seconds);
    let mut now = Nanos::ZERO;
    let mut prompt_tokens = 0u64;
    let run = Instant::now();
    loop {
        while let Some(r) = workload.poll_request() {
            let done = now
                + Nanos::from_secs(2)
                + Nanos::from_millis(30).saturating_mul(r.output.len() as u64);
            prompt_tokens += r.prompt.len() as u64;
            in_flight.push(Reverse((done, r.key)));
            held.insert(r.key, r);
        }
        let next_finish = in_flight.peek().map(|Reverse((t, _))| *t);
        let next = match (next_finish, workload.poll_timeout()) {
            (Some(a), Some(b)) => a.min(b),
            (Some(a), None) | (None, Some(a)) => a,
            (None, None) => break,
        };
        if next > end {
            break;
        }
        now = next;
        if next_finish == Some(next) {
            let Reverse((_, id)) = in_flight.pop().expect("peeked");
            held.remove(&id);
            workload.on_turn_finished(id, now);
        } else {
            workload.handle_timeout(now);
        }
    }
    let wall = run.elapsed();
    let stats = workload.stats();
    let peak = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM"))
                .map(str::to_owned)
        })
        .unwrap_or_else(|| "VmHWM: unknown".into());
    println!("assets built in {:.2} s", assets_time.as_secs_f64());
    println!(
        "{conversations} conversations, {seconds} simulated s: {} turns, {} conversations completed, \
         mean prompt {:.0} tokens",
        stats.turns_issued,
        stats.conversations_completed,
        prompt_tokens as f64 / stats.turns_issued.max(1) as f64
    );
    println!(
        "wall {:.2} s = {:.2} µs per turn ({:.0} turns/s); peak memory {}",
        wall.as_secs_f64(),
        wall.as_secs_f64() * 1e6 / stats.turns_issued.max(1) as f64,
        stats.turns_issued as f64 / wall.as_secs_f64(),
        peak.trim_start_matches("VmHWM:").trim()
    );
    Ok(())
}
