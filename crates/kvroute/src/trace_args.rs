//! `--trace FILE [--trace-speed X] [--trace-limit N]`: a public trace to replay, shared by
//! `kvroute sim` (virtual time) and `kvroute loadgen` (real time).

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use workload::{Speed, Trace};

#[derive(Debug, Clone, clap::Args)]
pub struct TraceArgs {
    /// Replay a request trace in Mooncake's FAST'25 format (JSON lines of `timestamp` ms,
    /// `input_length`, `output_length`, `hash_ids` of 512-token blocks; optional
    /// `session_id`/`delay`), open loop at its recorded times, e.g.
    /// traces/mooncake_conversation_trace.jsonl (traces/README.md).
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// Replay the trace this many times faster (2 halves every gap; 0.5 doubles them).
    #[arg(long, value_name = "X", default_value_t = 1.0, value_parser = parse_speed, requires = "trace")]
    pub trace_speed: f64,
    /// Replay only the trace's first N requests.
    #[arg(long, value_name = "N", requires = "trace",
          value_parser = clap::value_parser!(u64).range(1..))]
    pub trace_limit: Option<u64>,
}

/// A trace read, parsed and cut to its limit, and its speed factor.
#[derive(Debug, Clone)]
pub struct LoadedTrace {
    pub path: PathBuf,
    pub trace: Arc<Trace>,
    /// Requests in the file, before `--trace-limit`.
    pub requests_in_file: usize,
    pub speed: Speed,
}

fn parse_speed(s: &str) -> Result<f64, String> {
    let bad = || format!("expected a speed factor greater than 0 (e.g. 1, 2, 0.5), got `{s}`");
    let x: f64 = s.trim().parse().map_err(|_| bad())?;
    Speed::new(x).map_err(|_| bad())?;
    Ok(x)
}

impl TraceArgs {
    /// The trace the flags name, `None` without `--trace`. A bad file is one error naming it
    /// and the offending line.
    pub fn load(&self) -> Result<Option<LoadedTrace>> {
        let Some(path) = &self.trace else {
            return Ok(None);
        };
        let bytes = std::fs::read(path)
            .with_context(|| format!("--trace: cannot read {}", path.display()))?;
        let trace =
            Trace::parse_bytes(&bytes).with_context(|| format!("--trace {}", path.display()))?;
        let requests_in_file = trace.len();
        let trace = match self.trace_limit {
            Some(n) => trace
                .first(usize::try_from(n).unwrap_or(usize::MAX))
                .context("--trace-limit must be at least 1")?,
            None => trace,
        };
        let speed = Speed::new(self.trace_speed).context("--trace-speed")?;
        Ok(Some(LoadedTrace {
            path: path.clone(),
            trace: Arc::new(trace),
            requests_in_file,
            speed,
        }))
    }
}

impl LoadedTrace {
    /// `FILE (N of M requests) at X× speed`, for headers.
    pub fn describe(&self) -> String {
        let n = self.trace.len();
        let count = if n == self.requests_in_file {
            format!("{n} requests")
        } else {
            format!("first {n} of {} requests", self.requests_in_file)
        };
        format!(
            "{} ({count}) at {}× speed",
            self.path.display(),
            self.speed.factor()
        )
    }
}
