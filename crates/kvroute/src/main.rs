//! `kvroute`: one binary, one subcommand per tool.

// The argument structs' doc comments are clap's `--help` text, written for a terminal: their
// brackets and URLs are meant literally, not as rustdoc links.
#![allow(rustdoc::broken_intra_doc_links, rustdoc::bare_urls)]

use std::io::Read;
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use kv_index::BlockHasher;

/// mimalloc instead of glibc malloc: same results, about a quarter less CPU on the
/// simulator's fleet-scale runs, whose heaps grow to gigabytes of small, churning objects.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// `mi_option_purge_delay`: its index in mimalloc's `mi_option_t`, which mimalloc keeps stable
/// (the same in its v2 and v3 headers); `libmimalloc-sys` names only some options.
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// For the virtual-time batch commands (`sim`, `bench`), whose heap peaks near the end of a
/// run: mimalloc keeps freed memory instead of returning it to the OS after a second, only to
/// fault it back in, zeroed, as small pages where it had transparent huge pages: 10% less CPU
/// for 12% more peak memory at 1,000 workers (docs/BENCHMARKS.md, "Simulator at fleet
/// scale"). The services keep mimalloc's default, so their memory falls back after a burst.
/// `MIMALLOC_PURGE_DELAY` in the environment still wins.
fn keep_freed_memory() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        // SAFETY: sets one of mimalloc's options, which it reads atomically whenever it purges.
        unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1) }
    }
}

mod bench_cmd;
mod demo_cmd;
mod demo_fleet;
mod demo_ladder;
mod demo_prometheus;
#[cfg(test)]
mod deploy_args;
mod engine_cmd;
mod gateway_cmd;
mod listener_args;
mod nats_args;
mod profiles;
mod robustness;
mod sim_cmd;
mod spec_args;
mod trace_args;

/// KV-cache-aware routing for LLM fleets.
#[derive(Debug, Parser)]
#[command(name = "kvroute", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Print the block hashes of a token sequence, as workers and the router compute them.
    ///
    /// Tokens are integers separated by spaces, commas or newlines, given as arguments or on
    /// standard input. Use it to check that an engine's KV events hash like kvroute does.
    Hash(HashArgs),
    /// List the engine simulator's hardware profiles, show one as an editable file, or check
    /// your own.
    Profiles(profiles::ProfilesArgs),
    /// Serve one simulated GPU worker: an OpenAI-compatible HTTP API with vLLM-style metrics,
    /// publishing its KV events over NATS and/or ZMQ (vLLM's format).
    Engine(Box<engine_cmd::EngineArgs>),
    /// Serve the OpenAI-compatible gateway: tokenizes once, routes each request to the worker
    /// holding its prompt's KV cache (or by round robin / random), relays the stream, and
    /// exports Dynamo-named Prometheus metrics.
    Gateway(Box<gateway_cmd::GatewayArgs>),
    /// Simulate one cluster in virtual time: N workers, a router, the seed's chat workload.
    Sim(Box<sim_cmd::SimArgs>),
    /// Seed 002's benchmark in virtual time: routers × concurrency levels × sweeps, with its
    /// tables (report.md), plots (SVG) and results.json.
    Bench(Box<bench_cmd::BenchArgs>),
    /// The booth demo on one machine: simulated GPU workers (3 × H200 by default), the gateway,
    /// the load generator and the live dashboard; prints the URL, stops cleanly on Ctrl-C.
    Demo(Box<demo_cmd::DemoArgs>),
    /// The load generator and live dashboard against any OpenAI-compatible endpoint: seed
    /// 002's multi-turn chats, client-side TTFT/TPOT/ITL/latency, the control API and UI.
    Loadgen(Box<demo_cmd::LoadgenArgs>),
}

#[derive(Debug, clap::Args)]
struct HashArgs {
    /// Tokens per KV block (must match the engines').
    #[arg(long, default_value_t = kv_index::DEFAULT_BLOCK_SIZE, env = "DYN_KV_CACHE_BLOCK_SIZE")]
    block_size: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Token ids; read from standard input when none are given.
    tokens: Vec<String>,
}

/// The command line as clap reads it, where every option's value may start with a minus
/// sign: `--speedup -1` reaches the flag's own check ("--speedup must be a positive number")
/// instead of clap's "unexpected argument '-1' found".
fn command() -> clap::Command {
    fn negative_values(command: clap::Command) -> clap::Command {
        command
            .mut_args(|arg| {
                if arg.get_action().takes_values() {
                    arg.allow_negative_numbers(true)
                } else {
                    arg
                }
            })
            .mut_subcommands(negative_values)
    }
    negative_values(Cli::command())
}

fn parse_cli() -> Cli {
    let mut command = command();
    let matches = command.get_matches_mut();
    Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.format(&mut command).exit())
}

/// An error and its causes, as `{:#}` prints them (`outer: inner: root`), less each cause whose
/// text is already in what comes before it: an error whose message quotes its source (a
/// thiserror `#[error("…: {0}")]` on a `#[from]` field, a `source` field named in the
/// message, a context built with `format!("…: {e}")`) would otherwise print its reason twice.
pub(crate) fn error_chain(err: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in err.chain() {
        let text = cause.to_string();
        let text = text.trim_end();
        if text.is_empty() || out.contains(text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(text);
    }
    out
}

fn main() -> ExitCode {
    let cli = parse_cli();
    let result = match cli.command {
        Command::Hash(args) => hash(args),
        Command::Profiles(args) => profiles::run(args),
        Command::Engine(args) => engine_cmd::run(*args),
        Command::Gateway(args) => gateway_cmd::run(*args),
        Command::Sim(args) => {
            keep_freed_memory();
            sim_cmd::run(*args)
        }
        Command::Bench(args) => {
            keep_freed_memory();
            bench_cmd::run(*args)
        }
        Command::Demo(args) => demo_cmd::run_demo(*args),
        Command::Loadgen(args) => demo_cmd::run_loadgen(*args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {}", error_chain(&err));
            ExitCode::FAILURE
        }
    }
}

fn parse_tokens(words: &[String]) -> Result<Vec<u32>> {
    words
        .iter()
        .flat_map(|w| w.split(|c: char| c == ',' || c.is_whitespace()))
        .filter(|w| !w.is_empty())
        .map(|w| {
            w.parse::<u32>()
                .with_context(|| format!("`{w}` is not a token id (expected an integer 0..2^32)"))
        })
        .collect()
}

fn hash(args: HashArgs) -> Result<()> {
    let Some(hasher) = BlockHasher::new(args.block_size) else {
        bail!("--block-size must be at least 1");
    };
    let words = if args.tokens.is_empty() {
        let mut input = String::new();
        std::io::stdin()
            .read_to_string(&mut input)
            .context("reading tokens from standard input")?;
        vec![input]
    } else {
        args.tokens
    };
    let tokens = parse_tokens(&words)?;
    let local = hasher.local_hashes(&tokens);
    let seq = hasher.sequence_hashes(&tokens);
    let tail = tokens.len() % hasher.block_size();
    if args.json {
        let blocks: Vec<_> = local
            .iter()
            .zip(&seq)
            .enumerate()
            .map(|(i, (l, s))| {
                serde_json::json!({
                    "block": i,
                    "local_hash": format!("{:#018x}", l.0),
                    "sequence_hash": format!("{:#018x}", s.0),
                })
            })
            .collect();
        let out = serde_json::json!({
            "block_size": hasher.block_size(),
            "tokens": tokens.len(),
            "uncached_tail_tokens": tail,
            "blocks": blocks,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!(
            "{:>6}  {:<18}  {:<18}",
            "block", "local hash", "sequence hash"
        );
        for (i, (l, s)) in local.iter().zip(&seq).enumerate() {
            println!("{i:>6}  {:#018x}  {:#018x}", l.0, s.0);
        }
        println!(
            "{} tokens, {} full blocks of {}, {} tail tokens not cacheable",
            tokens.len(),
            seq.len(),
            hasher.block_size(),
            tail
        );
    }
    Ok(())
}

/// Logging and the async runtime of a server subcommand (`engine`, `gateway`): warnings
/// (NATS or ZMQ trouble, dropped KV batches, failed workers) to stderr, `RUST_LOG` overrides.
fn server_runtime() -> Result<tokio::runtime::Runtime> {
    use std::io::IsTerminal as _;
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        // Colour codes only on a terminal: in a file, a pipe or `kubectl logs` they are noise.
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
                tracing_subscriber::EnvFilter::new(format!(
                    "warn,{}",
                    protocol::nats_client::QUIET_NATS_LOGS
                ))
            }),
        )
        .try_init();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cause whose text its error already quotes is left out; others are kept, in order.
    #[test]
    fn an_error_chain_says_each_reason_once() {
        let io = || std::io::Error::new(std::io::ErrorKind::AddrInUse, "address in use\n");
        let quoting = anyhow::Error::new(io()).context(format!("cannot listen on x: {}", io()));
        assert_eq!(error_chain(&quoting), "cannot listen on x: address in use");
        let plain = anyhow::Error::new(io()).context("cannot listen on x");
        assert_eq!(error_chain(&plain), "cannot listen on x: address in use");
        let nested = quoting.context("starting the gateway");
        assert_eq!(
            error_chain(&nested),
            "starting the gateway: cannot listen on x: address in use"
        );
    }

    /// Every option takes a value with a leading minus, for its own check to judge.
    #[test]
    fn negative_numbers_are_values() {
        command().debug_assert();
        let cli = command()
            .try_get_matches_from(["kvroute", "demo", "--speedup", "-1"])
            .expect("-1 is --speedup's value");
        let demo = cli.subcommand_matches("demo").expect("demo");
        assert_eq!(demo.get_one::<f64>("speedup"), Some(&-1.0));
    }

    /// The option index is mimalloc's enum position, not a name: a mimalloc that moved it would
    /// silently set another option. Its own default and a neighbour's pin it (run the test
    /// without `MIMALLOC_PURGE_DELAY` and `MIMALLOC_OS_TAG` set, which would change them).
    #[test]
    fn the_purge_delay_index_is_mimallocs() {
        // SAFETY: reads two options.
        let (purge_delay, os_tag) = unsafe {
            (
                libmimalloc_sys::mi_option_get(MI_OPTION_PURGE_DELAY),
                libmimalloc_sys::mi_option_get(MI_OPTION_PURGE_DELAY + 3),
            )
        };
        assert_eq!(
            (purge_delay, os_tag),
            (1_000, 100),
            "mimalloc's purge_delay (=1,000 ms) and os_tag (=100) at their defaults: \
             has the option moved, or is MIMALLOC_PURGE_DELAY or MIMALLOC_OS_TAG set?"
        );
    }
}
