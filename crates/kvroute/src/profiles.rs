//! `kvroute profiles`: the engine simulator's hardware profiles, as a user sizes a fleet.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use engine::{Engine, EngineConfig, HardwareProfile, StepShape};
use kv_index::WorkerId;

#[derive(Debug, clap::Args)]
pub struct ProfilesArgs {
    #[command(subcommand)]
    action: Option<Action>,
}

#[derive(Debug, clap::Subcommand)]
enum Action {
    /// Print the built-in profiles with their KV capacity and step times (the default).
    List,
    /// Print one built-in profile as a TOML (or JSON) file you can edit into your own GPU.
    Show {
        /// A built-in profile name (see `kvroute profiles`).
        name: String,
        /// Print JSON instead of TOML.
        #[arg(long)]
        json: bool,
    },
    /// Load a profile file (.toml or .json), validate it and print what it implies.
    Check {
        /// Path of the profile file.
        file: PathBuf,
    },
}

pub fn run(args: ProfilesArgs) -> Result<()> {
    match args.action.unwrap_or(Action::List) {
        Action::List => {
            let profiles = HardwareProfile::builtin_names()
                .iter()
                .map(|name| HardwareProfile::builtin(name))
                .collect::<Result<Vec<_>, _>>()?;
            print_table(&profiles)?;
            // Seed 004's disaggregated deployments, for `kvroute sim --layout NAME`.
            println!("\nlayouts (kvroute sim --layout NAME):");
            for l in sim::disagg::layouts() {
                println!(
                    "  {:<13} {}P:{}D of {}, KV over {}: {}",
                    l.name,
                    l.prefill_workers,
                    l.decode_workers,
                    l.profile,
                    sim::disagg::link_name(l.kv_link),
                    l.description
                );
            }
            Ok(())
        }
        Action::Show { name, json } => {
            let profile = HardwareProfile::builtin(&name)?;
            if json {
                println!("{}", profile.to_json_string()?);
            } else {
                print!("{}", profile.to_toml_string()?);
            }
            Ok(())
        }
        Action::Check { file } => {
            let profile = load(&file)?;
            print_table(std::slice::from_ref(&profile))
        }
    }
}

pub(crate) fn load(path: &Path) -> Result<HardwareProfile> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read profile file {}", path.display()))?;
    let is_json = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("json"));
    let profile = if is_json {
        HardwareProfile::from_json_str(&text)
    } else {
        HardwareProfile::from_toml_str(&text)
    }
    .with_context(|| format!("{} is not a valid hardware profile", path.display()))?;
    profile
        .validate()
        .with_context(|| format!("{} is not a usable hardware profile", path.display()))?;
    Ok(profile)
}

/// What a profile implies with its default engine settings.
struct Summary {
    capacity_blocks: u64,
    block_size: u32,
    full_batch: u64,
    decode_1_ms: f64,
    decode_full_ms: f64,
    prefill_ms: f64,
}

/// Context per sequence for the decode figures: a mid-conversation turn of the seed workload.
const DECODE_CONTEXT: u64 = 5_000;
/// Prompt for the prefill figure: a seed 002 first turn (one ~3,500-token passage).
const PREFILL_TOKENS: u64 = 3_500;

fn summarize(profile: &HardwareProfile) -> Result<Summary> {
    let config = EngineConfig::from_profile(profile.clone());
    let (block_size, max_num_seqs) = (config.block_size, config.max_num_seqs);
    let engine = Engine::new(config, WorkerId(0))
        .with_context(|| format!("profile {} cannot run an engine", profile.name))?;
    let capacity_blocks = u64::from(engine.kv_capacity_blocks());
    // The largest batch of such sequences that fits both the batch limit and the pool.
    let blocks_per_seq = DECODE_CONTEXT.div_ceil(u64::from(block_size.max(1)));
    let full_batch = u64::from(max_num_seqs)
        .min(capacity_blocks / blocks_per_seq)
        .max(1);
    let decode = |seqs| {
        let shape = StepShape::decode(seqs, DECODE_CONTEXT, block_size, capacity_blocks);
        profile.step_time(&shape).as_millis_f64()
    };
    Ok(Summary {
        capacity_blocks,
        block_size,
        full_batch,
        decode_1_ms: decode(1),
        decode_full_ms: decode(full_batch),
        prefill_ms: profile
            .step_time(&StepShape::prefill(PREFILL_TOKENS, 0))
            .as_millis_f64(),
    })
}

fn print_table(profiles: &[HardwareProfile]) -> Result<()> {
    for profile in profiles {
        let s = summarize(profile)?;
        println!("{}", profile.name);
        println!("    hardware     {} · {}", profile.gpu, profile.model);
        println!(
            "    KV cache     {} blocks × {} tokens = {} tokens",
            s.capacity_blocks,
            s.block_size,
            s.capacity_blocks * u64::from(s.block_size)
        );
        println!(
            "    decode step  {:.1} ms at batch 1, {:.1} ms at batch {} ({DECODE_CONTEXT}-token contexts)",
            s.decode_1_ms, s.decode_full_ms, s.full_batch
        );
        println!(
            "    prefill      {:.1} ms for {PREFILL_TOKENS} uncached prompt tokens",
            s.prefill_ms
        );
    }
    println!(
        "\nWith each profile's engine defaults (free_gpu_memory_fraction 0.90). \
         `kvroute profiles show NAME` prints one as a file to edit; \
         `kvroute profiles check FILE` checks yours."
    );
    Ok(())
}
