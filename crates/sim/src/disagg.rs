//! Disaggregated fleets by name, and `kvroute bench --disagg`'s comparison of layouts of
//! equal GPU count.
//!
//! Seed 004 names two layouts ([`layouts`]): its dev environment (one prefill and one decode
//! worker of Llama-3.1-8B, each on its own single-H100 node, so KV moves over the network)
//! and its production node (two prefill and three decode workers of Llama-3.1-70B, one H200
//! each — the seed quantizes the 70B to fit one GPU, TP=1 — inside one 8×H200 node, so KV
//! moves over NVLink).
//!
//! A comparison ([`equal_gpu_layouts`]) runs every way of cutting `gpus` one-GPU workers:
//! all aggregated, then 1 prefill + (gpus − 1) decode up to (gpus − 1) + 1. Each (layout,
//! workload) is one [`BenchSpec`] with the same seed, levels and sweeps (common random
//! numbers: every layout faces the same conversations); [`merge`] tags each one's rows with
//! its layout and workload and puts them into one results file.
//!
//! Besides the closed loop's concurrency levels, a comparison can run open-loop arrival
//! rates ([`DisaggPart::rate_rps`]): one cold run per rate, whose workload opens sessions
//! Poisson at that rate whatever the fleet serves, so a layout past saturation shows as a
//! growing queue (TTFT) and falling goodput instead of as a slower closed loop.

use engine::KvLink;
use report::{BenchResults, DisaggMeta, Layout, Slo};

use crate::bench::BenchSpec;
use crate::config::DisaggSetup;

/// A disaggregated deployment by name.
#[derive(Debug, Clone, PartialEq)]
pub struct NamedLayout {
    pub name: &'static str,
    pub description: &'static str,
    /// A built-in hardware profile (one worker's GPU and model).
    pub profile: &'static str,
    pub prefill_workers: u32,
    pub decode_workers: u32,
    pub kv_link: KvLink,
}

impl NamedLayout {
    /// The fleet, with the router's default conditional-disaggregation threshold.
    pub fn setup(&self) -> DisaggSetup {
        DisaggSetup {
            kv_link: self.kv_link,
            ..DisaggSetup::new(self.prefill_workers, self.decode_workers)
        }
    }
}

/// Seed 004's two layouts.
pub fn layouts() -> Vec<NamedLayout> {
    vec![
        NamedLayout {
            name: "seed004-dev",
            description: "seed 004 dev: 1P:1D Llama-3.1-8B, one H100 per node, KV over the network",
            profile: "h100-llama8b",
            prefill_workers: 1,
            decode_workers: 1,
            kv_link: KvLink::Network,
        },
        NamedLayout {
            name: "seed004-prod",
            description: "seed 004 prod: 2P:3D Llama-3.1-70B FP8 (TP=1), one 8×H200 node, KV over NVLink",
            profile: "h200-llama70b-fp8",
            prefill_workers: 2,
            decode_workers: 3,
            kv_link: KvLink::Nvlink,
        },
    ]
}

/// The layout named `name`.
pub fn layout(name: &str) -> Option<NamedLayout> {
    layouts().into_iter().find(|l| l.name == name)
}

/// Every cut of `gpus` one-GPU workers: `{gpus}agg`, then `1p{gpus-1}d` … `{gpus-1}p1d`.
pub fn equal_gpu_layouts(gpus: u32) -> Vec<Layout> {
    let mut out = vec![Layout {
        name: format!("{gpus}agg"),
        aggregated: gpus,
        prefill: 0,
        decode: 0,
        gpus,
    }];
    for p in 1..gpus {
        out.push(Layout {
            name: format!("{p}p{}d", gpus - p),
            aggregated: 0,
            prefill: p,
            decode: gpus - p,
            gpus,
        });
    }
    out
}

/// One benchmark of a comparison: a layout serving a workload.
#[derive(Debug, Clone)]
pub struct DisaggPart {
    pub layout: Layout,
    /// The workload's name (`chat`).
    pub workload: String,
    /// The open loop's arrival rate (sessions per second) this part ran at; `None` for the
    /// closed loop at `spec.levels`.
    pub rate_rps: Option<f64>,
    pub spec: BenchSpec,
    /// The aggregated results of `spec` ([`crate::bench::aggregate`]).
    pub results: BenchResults,
}

/// What every part of a comparison shares, for the results' metadata.
#[derive(Debug, Clone, PartialEq)]
pub struct DisaggBench {
    pub slo: Slo,
    pub local_prefill_max_tokens: u32,
    pub kv_link: KvLink,
    /// Concurrent transfers share each worker's link port ([`DisaggSetup::shared_links`]).
    pub shared_links: bool,
}

/// One `results.json` for a comparison: every part's rows tagged with its layout, workload
/// and (open loop) rate, in the parts' order; the metadata of the first closed-loop part (else
/// the first part, with no levels) plus the layouts, workloads and rates met. `None` without
/// parts.
pub fn merge(parts: Vec<DisaggPart>, bench: &DisaggBench) -> Option<BenchResults> {
    let meta_of = parts
        .iter()
        .find(|p| p.rate_rps.is_none())
        .or(parts.first())?;
    let mut meta = meta_of.results.bench.clone();
    if meta_of.rate_rps.is_some() {
        meta.levels.clear();
    }
    let mut out = BenchResults {
        summary: Vec::new(),
        runs: Vec::new(),
        bench: meta,
    };
    let mut layouts: Vec<Layout> = Vec::new();
    let mut workloads: Vec<String> = Vec::new();
    let mut rates: Vec<f64> = Vec::new();
    for part in parts {
        if !layouts.iter().any(|l| l.name == part.layout.name) {
            layouts.push(part.layout.clone());
        }
        if !workloads.contains(&part.workload) {
            workloads.push(part.workload.clone());
        }
        if let Some(rate) = part.rate_rps {
            if !rates.contains(&rate) {
                rates.push(rate);
            }
        }
        let tag = |mut row: report::Row| {
            row.layout = Some(part.layout.name.clone());
            row.workload = Some(part.workload.clone());
            if part.rate_rps.is_some() {
                // An open-loop run's concurrency is no setting of the run.
                row.rate_rps = part.rate_rps;
                row.concurrency = 0;
            }
            row
        };
        out.summary
            .extend(part.results.summary.into_iter().map(tag));
        out.runs.extend(part.results.runs.into_iter().map(tag));
    }
    out.bench.workers = layouts.first().map_or(0, |l| l.gpus);
    out.bench.disagg = Some(DisaggMeta {
        layouts,
        workloads,
        slo: bench.slo,
        local_prefill_max_tokens: bench.local_prefill_max_tokens,
        kv_link: link_name(bench.kv_link).to_string(),
        kv_link_sharing: Some(
            if bench.shared_links {
                "shared"
            } else {
                "exclusive"
            }
            .to_string(),
        ),
        rates: {
            rates.sort_by(f64::total_cmp);
            rates
        },
    });
    Some(out)
}

/// The link's name as the profile and the CLI spell it.
pub fn link_name(link: KvLink) -> &'static str {
    match link {
        KvLink::Nvlink => "nvlink",
        KvLink::Network => "network",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn four_gpus_cut_four_ways() {
        let names: Vec<String> = equal_gpu_layouts(4).into_iter().map(|l| l.name).collect();
        assert_eq!(names, ["4agg", "1p3d", "2p2d", "3p1d"]);
        assert!(
            equal_gpu_layouts(4)
                .iter()
                .all(|l| l.aggregated + l.prefill + l.decode == 4)
        );
        let prod = layout("seed004-prod").unwrap().setup();
        assert_eq!((prod.prefill_workers, prod.decode_workers), (2, 3));
        assert_eq!(layout("seed004-dev").unwrap().kv_link, KvLink::Network);
    }
}
