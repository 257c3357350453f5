//! The robustness grid (`kvroute bench --suite robustness`): every router on workload families
//! × fleet sizes × hardware profiles, and per cell and level the verdict on the default
//! policy — no worse than round-robin on TTFT p50, TTFT p95 and TOPS (within a tolerance),
//! and better than `kv` on goodput.

use std::fmt::Write;

use serde::{Deserialize, Serialize};

use crate::disagg::goodput;
use crate::results::{BenchResults, Row, Slo, cell as n};

/// What a robustness grid ran: its families (in report order), the objectives of goodput and
/// the verdict's terms.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RobustnessMeta {
    pub families: Vec<FamilyMeta>,
    /// Cells in run order.
    pub cells: Vec<CellMeta>,
    pub slo: Slo,
    /// The policy judged (the router's default).
    pub default_router: String,
    /// The router it must be no worse than on TTFT and TOPS.
    pub baseline_router: String,
    /// The router it must beat on goodput.
    pub goodput_rival: String,
    /// "No worse" allows this fraction (0.05: TTFT up to 5% higher, TOPS up to 5% lower).
    pub tolerance: f64,
}

/// One workload family: one table of the report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FamilyMeta {
    pub name: String,
    /// For people: what the family's workloads are.
    pub description: String,
}

/// One cell of the grid: a workload of a family on a fleet of one profile.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CellMeta {
    /// `workload/workers/profile`, the rows' `cell`.
    pub name: String,
    pub family: String,
    pub workload: String,
    pub workers: u32,
    pub profile: String,
    /// Concurrency levels run, in order.
    pub levels: Vec<u32>,
    /// The goodput no router can exceed in this cell, where one is known (the trace's cells).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub goodput_ceiling: Option<GoodputCeiling>,
}

/// A cell's goodput ceiling: how many of its requests meet both objectives when each is
/// served alone on an idle worker holding every block of the requests before it (what no
/// router, fleet or load can improve on; `sim::trace::slo_ceiling`), over the cell's window.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct GoodputCeiling {
    pub requests: u64,
    pub within: u64,
    pub rps: f64,
    /// The least prefill time the requests need (each alone, cached as the oracle caches)
    /// over the fleet's GPU time while they arrive: above 1 the fleet cannot keep up with
    /// them whatever the routing.
    pub prefill_load: f64,
}

/// One cell's results, as `kvroute bench` aggregates one benchmark.
#[derive(Debug, Clone)]
pub struct CellPart {
    pub cell: CellMeta,
    pub results: BenchResults,
}

/// Every cell's rows in one file: rows tagged with `cell`, `workload` and `goodput_rps`; the
/// first part's meta with the grid's. `None` without parts.
pub fn merge(parts: Vec<CellPart>, mut meta: RobustnessMeta) -> Option<BenchResults> {
    let mut parts = parts.into_iter();
    let first = parts.next()?;
    let mut out = BenchResults {
        summary: Vec::new(),
        runs: Vec::new(),
        bench: first.results.bench.clone(),
    };
    meta.cells.clear();
    for part in std::iter::once(first).chain(parts) {
        let tag = |mut row: Row| {
            row.cell = Some(part.cell.name.clone());
            row.workload = Some(part.cell.workload.clone());
            row.goodput_rps = Some(goodput(&row));
            row
        };
        out.summary
            .extend(part.results.summary.into_iter().map(tag));
        out.runs.extend(part.results.runs.into_iter().map(tag));
        meta.cells.push(part.cell);
    }
    // The grid has no single level list, fleet or profile: each cell names its own.
    out.bench.levels = Vec::new();
    out.bench.workers = 0;
    out.bench.profile = "grid".to_string();
    out.bench.robustness = Some(meta);
    Some(out)
}

/// The summary row of `router` in `cell` at `level`.
pub fn row<'a>(results: &'a BenchResults, cell: &str, router: &str, level: u32) -> Option<&'a Row> {
    results
        .summary
        .iter()
        .find(|r| r.cell.as_deref() == Some(cell) && r.router == router && r.concurrency == level)
}

/// How the default policy fares in one cell at one level.
#[derive(Debug, Clone, PartialEq)]
pub struct Verdict {
    /// The criteria missed, for people (`TTFT p50 +12% vs round_robin`); empty: a win.
    pub misses: Vec<String>,
}

impl Verdict {
    pub fn wins(&self) -> bool {
        self.misses.is_empty()
    }
}

/// The verdict of `cell` at `level`, `None` when the default, the baseline or the goodput
/// rival was not run there.
pub fn verdict(results: &BenchResults, cell: &str, level: u32) -> Option<Verdict> {
    let meta = results.bench.robustness.as_ref()?;
    verdict_of(results, &meta.default_router, cell, level)
}

/// The default's verdict applied to `router` (the comparison of every router by one rule).
/// The goodput rival is not judged against itself: its goodput criterion is skipped.
pub fn verdict_of(results: &BenchResults, router: &str, cell: &str, level: u32) -> Option<Verdict> {
    let meta = results.bench.robustness.as_ref()?;
    let ours = row(results, cell, router, level)?;
    let base = row(results, cell, &meta.baseline_router, level)?;
    let rival = row(results, cell, &meta.goodput_rival, level)?;
    let tol = meta.tolerance;
    let mut misses = Vec::new();
    let percent = |ours: f64, theirs: f64| {
        if theirs > 0.0 {
            format!("{:+.0}%", (ours - theirs) / theirs * 100.0)
        } else {
            format!("{ours:.0} vs {theirs:.0}")
        }
    };
    let latencies = [
        (
            "TTFT p50",
            ours.metrics.ttft_ms.p50,
            base.metrics.ttft_ms.p50,
        ),
        (
            "TTFT p95",
            ours.metrics.ttft_ms.p95,
            base.metrics.ttft_ms.p95,
        ),
    ];
    for (what, o, b) in latencies {
        match (o, b) {
            (Some(o), Some(b)) if o > b * (1.0 + tol) => {
                misses.push(format!("{what} {} vs {}", percent(o, b), base.router));
            }
            (None, Some(_)) => misses.push(format!("{what}: no sample")),
            _ => {}
        }
    }
    let (o, b) = (
        ours.metrics.output_tokens_per_s,
        base.metrics.output_tokens_per_s,
    );
    if o < b * (1.0 - tol) {
        misses.push(format!("TOPS {} vs {}", percent(o, b), base.router));
    }
    let (o, r) = (goodput(ours), goodput(rival));
    let everything_met = ours
        .metrics
        .serving
        .as_ref()
        .and_then(|s| s.goodput_share)
        .is_some_and(|share| share >= 1.0);
    // A tie only counts when nothing was left to win: every request met both objectives.
    if router != meta.goodput_rival && (o < r || (o == r && !everything_met)) {
        misses.push(format!(
            "goodput {:.2} vs {} {:.2} req/s",
            o, rival.router, r
        ));
    }
    Some(Verdict { misses })
}

/// For every router run, how many cell-levels it wins by the default's verdict, in the
/// order of the bench's router list.
pub fn wins_by_router(results: &BenchResults) -> Vec<(&str, usize)> {
    let Some(meta) = &results.bench.robustness else {
        return Vec::new();
    };
    results
        .bench
        .routers
        .iter()
        .map(|router| {
            let won = meta
                .cells
                .iter()
                .flat_map(|c| c.levels.iter().map(move |&l| (c, l)))
                .filter_map(|(c, l)| verdict_of(results, router, &c.name, l))
                .filter(Verdict::wins)
                .count();
            (router.as_str(), won)
        })
        .collect()
}

/// Every (cell, level) of the grid with its verdict, in run order.
pub fn verdicts(results: &BenchResults) -> Vec<(&CellMeta, u32, Verdict)> {
    let Some(meta) = &results.bench.robustness else {
        return Vec::new();
    };
    meta.cells
        .iter()
        .flat_map(|c| c.levels.iter().map(move |&l| (c, l)))
        .filter_map(|(c, l)| verdict(results, &c.name, l).map(|v| (c, l, v)))
        .collect()
}

/// `report.md` of a robustness grid: the terms, a tally, then one table per family.
pub fn markdown(results: &BenchResults, _plots: &[String]) -> String {
    let b = &results.bench;
    let mut out = String::new();
    out.push_str("# kvroute bench --suite robustness\n\n");
    let Some(meta) = &b.robustness else {
        out.push_str("(no robustness metadata in these results)\n");
        return out;
    };
    let routers = &b.routers;
    let _ = writeln!(
        out,
        "Every router ({}) on every cell: a workload, a fleet of workers and a hardware \
         profile; concurrency scales with the fleet. Same conversations for every router \
         (seed {}, {} sweep(s) × ({} s warmup + {} s window read as {} snapshot(s) of the \
         last {} s)), simulated in virtual time; percentiles: {}. Goodput: finished \
         requests per second with TTFT ≤ {:.0} ms and mean ITL ≤ {:.0} ms.\n",
        routers
            .iter()
            .map(|r| format!("`{r}`"))
            .collect::<Vec<_>>()
            .join(", "),
        b.seed,
        b.sweeps,
        b.warmup_s,
        b.window_s,
        b.snapshots,
        b.snapshot_lookback_s,
        b.percentiles,
        meta.slo.ttft_ms,
        meta.slo.itl_ms,
    );
    let tol = meta.tolerance * 100.0;
    let _ = writeln!(
        out,
        "**Verdict** on `{0}` (the default policy) per cell and level: ✓ when its TTFT p50 \
         and p95 are at most {tol:.0}% above `{1}`'s, its TOPS at most {tol:.0}% below \
         `{1}`'s, and its goodput above `{2}`'s (a tie counts only when every request met \
         both objectives); otherwise the criteria it misses.\n",
        meta.default_router, meta.baseline_router, meta.goodput_rival
    );
    let all = verdicts(results);
    let won = all.iter().filter(|(_, _, v)| v.wins()).count();
    let _ = writeln!(
        out,
        "`{}` wins {won} of {} cell-levels.\n",
        meta.default_router,
        all.len()
    );
    let others: Vec<String> = wins_by_router(results)
        .into_iter()
        .filter(|(router, _)| *router != meta.default_router)
        .map(|(router, won)| format!("`{router}` {won}"))
        .collect();
    if !others.is_empty() {
        let _ = writeln!(
            out,
            "Every other router by the same verdict (`{}` without the goodput criterion, \
             which would judge it against itself): {}.\n",
            meta.goodput_rival,
            others.join(", ")
        );
    }
    for family in &meta.families {
        let _ = writeln!(out, "## {}\n\n{}\n", family.name, family.description);
        let cells: Vec<&CellMeta> = meta
            .cells
            .iter()
            .filter(|c| c.family == family.name)
            .collect();
        if cells.is_empty() {
            out.push_str("(not run)\n\n");
            continue;
        }
        out.push_str(
            "| cell | conc | router | TTFT p50 ms | TTFT p95 ms | TOPS | goodput req/s | hit % (oracle) | verdict |\n",
        );
        out.push_str("|:---|---:|:---|---:|---:|---:|---:|---:|:---|\n");
        for c in &cells {
            for &level in &c.levels {
                let verdict = verdict(results, &c.name, level);
                for router in routers {
                    let Some(r) = row(results, &c.name, router, level) else {
                        continue;
                    };
                    let m = &r.metrics;
                    let ours = *router == meta.default_router;
                    let verdict_cell = match (&verdict, ours) {
                        (Some(v), true) if v.wins() => "✓".to_string(),
                        (Some(v), true) => format!("✗ {}", v.misses.join("; ")),
                        _ => String::new(),
                    };
                    let name = if ours {
                        format!("**{router}**")
                    } else {
                        router.clone()
                    };
                    let _ = writeln!(
                        out,
                        "| {} | {} | {} | {} | {} | {:.0} | {:.2} | {} ({}) | {} |",
                        c.name,
                        level,
                        name,
                        n(m.ttft_ms.p50, 0),
                        n(m.ttft_ms.p95, 0),
                        m.output_tokens_per_s,
                        goodput(r),
                        n(m.kv_hit_rate.map(|h| h * 100.0), 1),
                        n(m.oracle_hit_rate.map(|h| h * 100.0), 1),
                        verdict_cell
                    );
                }
            }
        }
        out.push('\n');
        ceilings(&mut out, results, &cells);
    }
    out
}

/// The family's goodput ceilings, beside the best goodput any router reached.
fn ceilings(out: &mut String, results: &BenchResults, cells: &[&CellMeta]) {
    let bounded: Vec<(&CellMeta, GoodputCeiling)> = cells
        .iter()
        .filter_map(|c| c.goodput_ceiling.map(|g| (*c, g)))
        .collect();
    if bounded.is_empty() {
        return;
    }
    out.push_str(
        "Goodput ceilings: each request served alone, on an idle worker whose cache holds every \
         block of the requests before it, behind the same serving path, and counted within the \
         objectives with a slack on TTFT for how its prompt's prefill is cut into chunks \
         (`sim::trace::slo_ceiling`, `CHUNKING_SLACK`). No router, fleet size or load does \
         better. The least prefill load is the GPU time those requests need to prefill alone \
         over the fleet's while they arrive: above 1 the fleet cannot keep up with the trace \
         even caching as the oracle does, whatever the routing.\n\n",
    );
    out.push_str(
        "| cell | requests within both objectives alone | ceiling req/s | best goodput req/s (router) | least prefill load |\n",
    );
    out.push_str("|:---|---:|---:|:---|---:|\n");
    for (c, g) in bounded {
        let rows: Vec<&Row> = results
            .summary
            .iter()
            .filter(|r| r.cell.as_deref() == Some(c.name.as_str()))
            .collect();
        let top = rows.iter().map(|r| goodput(r)).fold(f64::NAN, f64::max);
        let leaders: Vec<&str> = rows
            .iter()
            .filter(|r| goodput(r) == top)
            .map(|r| r.router.as_str())
            .collect();
        let best = match leaders.as_slice() {
            [] => "—".to_string(),
            [_, _, ..] if leaders.len() == rows.len() => format!("{top:.2} (every router)"),
            _ => format!("{top:.2} (`{}`)", leaders.join("`, `")),
        };
        let _ = writeln!(
            out,
            "| {} | {} of {} | {:.2} | {best} | {:.2} |",
            c.name, g.within, g.requests, g.rps, g.prefill_load
        );
    }
    out.push('\n');
}
