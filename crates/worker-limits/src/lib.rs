//! What a worker declares about its capacity and speed, as one type from the engine to the
//! router.
//!
//! The engine core derives a [`WorkerLimits`] from its settings and hardware profile; the
//! engine server serves it inside its `/info` card and NATS announcement
//! (`protocol::WorkerCard`, where these fields appear flat, under the names below); gateways
//! read it back and hand it to the router (`router::Router::add_worker`), and the simulator
//! hands the engine's straight to its router. A number a worker declares is therefore a field
//! here, filled in by the engine and read by a policy, and travels without further changes.
//!
//! Pure data: no I/O, no clock.

use serde::{Deserialize, Serialize};

/// Capacity and speed a worker declares when it joins; load-aware policies use them.
///
/// Every field is optional: a foreign backend (vLLM described by `--worker` flags, another
/// server's `/info`) may not know them.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct WorkerLimits {
    /// The engine's `max_num_seqs` (largest running batch), when known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_num_seqs: Option<u32>,
    /// The engine's KV cache capacity in blocks, when known (vLLM's `num_gpu_blocks`).
    #[serde(alias = "num_gpu_blocks", alias = "capacity_blocks")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_capacity_blocks: Option<u64>,
    /// How fast the worker prefills and decodes, when known (from its hardware profile). On
    /// the wire its two figures sit beside the others; a worker that gives only one of them
    /// declares no timing.
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub timing: Option<WorkerTiming>,
}

impl WorkerLimits {
    /// Each figure from `self` when known, otherwise from `fallback` (flags over `/info`).
    pub fn or(self, fallback: WorkerLimits) -> WorkerLimits {
        WorkerLimits {
            max_num_seqs: self.max_num_seqs.or(fallback.max_num_seqs),
            kv_capacity_blocks: self.kv_capacity_blocks.or(fallback.kv_capacity_blocks),
            timing: self.timing.or(fallback.timing),
        }
    }

    /// These limits without figures a policy cannot price with (a timing that is negative,
    /// infinite or NaN), so a bad declaration means "unknown", never a wrong price.
    pub fn usable(self) -> WorkerLimits {
        WorkerLimits {
            timing: self.timing.filter(WorkerTiming::is_usable),
            ..self
        }
    }
}

/// A worker's marginal costs, in seconds, as a load-aware policy prices them: what one more
/// prompt token costs to prefill, and what one more token of context costs each decode step
/// (attention reads every running sequence's KV once per step).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct WorkerTiming {
    /// Modelled seconds to prefill one more prompt token (not divided by any speedup).
    pub prefill_secs_per_token: f64,
    /// Modelled seconds one more token of context adds to each decode step.
    pub decode_secs_per_context_token: f64,
}

impl WorkerTiming {
    /// Seed 002's worker, calibrated (`engine`'s `h200-llama70b-fp8` profile; a router test
    /// checks these against the profile): about 7,100 prompt tokens/s of prefill, and 0.1 µs
    /// per step for each token of context.
    pub const H200_LLAMA70B_FP8: WorkerTiming = WorkerTiming {
        prefill_secs_per_token: 1.4074e-4,
        decode_secs_per_context_token: 9.8937e-8,
    };

    /// Both figures are finite and not negative.
    pub fn is_usable(&self) -> bool {
        let usable = |v: f64| v.is_finite() && v >= 0.0;
        usable(self.prefill_secs_per_token) && usable(self.decode_secs_per_context_token)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TIMING: WorkerTiming = WorkerTiming {
        prefill_secs_per_token: 1.5e-4,
        decode_secs_per_context_token: 1e-7,
    };

    #[test]
    fn wire_names_are_flat_and_unknown_figures_are_left_out() {
        let limits = WorkerLimits {
            max_num_seqs: Some(64),
            kv_capacity_blocks: Some(13_022),
            timing: Some(TIMING),
        };
        let json = serde_json::to_value(limits).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "max_num_seqs": 64,
                "kv_capacity_blocks": 13_022,
                "prefill_secs_per_token": 1.5e-4,
                "decode_secs_per_context_token": 1e-7,
            })
        );
        assert_eq!(
            serde_json::from_value::<WorkerLimits>(json).unwrap(),
            limits
        );
        assert_eq!(
            serde_json::to_value(WorkerLimits::default()).unwrap(),
            serde_json::json!({})
        );
    }

    #[test]
    fn foreign_names_parse_and_half_a_timing_is_none() {
        let limits: WorkerLimits = serde_json::from_str(
            r#"{"num_gpu_blocks": 1000, "prefill_secs_per_token": 1e-4, "other": true}"#,
        )
        .unwrap();
        assert_eq!(
            limits,
            WorkerLimits {
                max_num_seqs: None,
                kv_capacity_blocks: Some(1000),
                timing: None,
            }
        );
        let limits: WorkerLimits = serde_json::from_str(r#"{"capacity_blocks": 7}"#).unwrap();
        assert_eq!(limits.kv_capacity_blocks, Some(7));
    }

    #[test]
    fn flags_win_figure_by_figure_and_bad_timings_are_dropped() {
        let flags = WorkerLimits {
            max_num_seqs: Some(8),
            ..WorkerLimits::default()
        };
        let declared = WorkerLimits {
            max_num_seqs: Some(64),
            kv_capacity_blocks: Some(1000),
            timing: Some(TIMING),
        };
        assert_eq!(
            flags.or(declared),
            WorkerLimits {
                max_num_seqs: Some(8),
                ..declared
            }
        );
        assert!(TIMING.is_usable());
        for bad in [f64::NAN, f64::INFINITY, -1e-9] {
            let timing = WorkerTiming {
                decode_secs_per_context_token: bad,
                ..TIMING
            };
            let limits = WorkerLimits {
                timing: Some(timing),
                ..declared
            };
            assert_eq!(limits.usable().timing, None, "{bad}");
            assert_eq!(limits.usable().kv_capacity_blocks, Some(1000));
        }
    }
}
