//! Seed 002's published numbers and SLOs: the calibration target and the plots' reference
//! lines.

/// Seed 002's TTFT SLO (p95).
pub const SLO_TTFT_P95_MS: f64 = 600.0;
/// Seed 002's TPOT SLO (p95).
pub const SLO_TPOT_P95_MS: f64 = 60.0;

/// One router's published numbers at one concurrency level.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SeedSide {
    pub ttft_p50_ms: f64,
    pub ttft_p95_ms: f64,
    pub hit_rate: f64,
    pub tops: f64,
    pub rps: f64,
    pub itl_p50_ms: f64,
    pub itl_p95_ms: f64,
    pub e2e_p50_s: f64,
    pub e2e_p95_s: f64,
}

/// One row of seed 002's result tables.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SeedRow {
    pub concurrency: u32,
    pub round_robin: SeedSide,
    pub kv: SeedSide,
}

const fn side(
    ttft: (f64, f64),
    hit_pct: f64,
    tops: f64,
    rps: f64,
    itl: (f64, f64),
    e2e: (f64, f64),
) -> SeedSide {
    SeedSide {
        ttft_p50_ms: ttft.0,
        ttft_p95_ms: ttft.1,
        hit_rate: hit_pct / 100.0,
        tops,
        rps,
        itl_p50_ms: itl.0,
        itl_p95_ms: itl.1,
        e2e_p50_s: e2e.0,
        e2e_p95_s: e2e.1,
    }
}

/// Seed 002 ("Results": the TTFT, Throughput and Actual RPS, ITL and End-to-End Latency
/// tables): 3 × H200, Llama-3.1-70B-Instruct FP8 on TensorRT-LLM, Dynamo 0.9.0,
/// `DYN_ROUTER_MODE=round_robin` vs `kv`, 6 sweeps × (60 s warmup + 3 × 100 s snapshots).
/// The calibration target: our round-robin columns should match within ±10%.
pub const SEED_002: [SeedRow; 7] = [
    SeedRow {
        concurrency: 60,
        round_robin: side(
            (274.0, 655.0),
            90.9,
            2146.9,
            2.60,
            (28.0, 30.0),
            (24.6, 30.1),
        ),
        kv: side(
            (249.0, 446.0),
            91.6,
            2262.8,
            2.57,
            (26.0, 27.0),
            (24.3, 27.7),
        ),
    },
    SeedRow {
        concurrency: 80,
        round_robin: side(
            (306.0, 637.0),
            85.3,
            2543.2,
            2.93,
            (31.0, 33.0),
            (29.3, 33.4),
        ),
        kv: side(
            (267.0, 508.0),
            95.7,
            2742.3,
            3.17,
            (28.0, 33.0),
            (26.6, 32.5),
        ),
    },
    SeedRow {
        concurrency: 100,
        round_robin: side(
            (342.0, 652.0),
            88.5,
            2547.5,
            2.96,
            (38.0, 48.0),
            (32.1, 49.0),
        ),
        kv: side(
            (329.0, 547.0),
            96.1,
            2780.1,
            3.19,
            (36.0, 43.0),
            (31.8, 43.6),
        ),
    },
    SeedRow {
        concurrency: 120,
        round_robin: side(
            (375.0, 643.0),
            87.2,
            2642.6,
            3.05,
            (45.0, 50.0),
            (41.2, 50.4),
        ),
        kv: side(
            (382.0, 530.0),
            95.9,
            2805.7,
            3.53,
            (43.0, 46.0),
            (38.1, 47.2),
        ),
    },
    SeedRow {
        concurrency: 140,
        round_robin: side(
            (398.0, 643.0),
            83.9,
            2816.8,
            3.29,
            (49.0, 52.0),
            (45.7, 53.0),
        ),
        kv: side(
            (415.0, 650.0),
            91.2,
            3167.8,
            3.68,
            (44.0, 46.0),
            (38.7, 46.7),
        ),
    },
    SeedRow {
        concurrency: 160,
        round_robin: side(
            (422.0, 722.0),
            90.1,
            3126.8,
            3.66,
            (51.0, 54.0),
            (45.2, 55.4),
        ),
        kv: side(
            (424.0, 704.0),
            95.3,
            3471.8,
            4.06,
            (46.0, 48.0),
            (40.8, 48.1),
        ),
    },
    SeedRow {
        concurrency: 180,
        round_robin: side(
            (413.0, 732.0),
            88.9,
            3434.0,
            4.10,
            (52.0, 54.0),
            (46.1, 54.6),
        ),
        kv: side(
            (472.0, 3143.0),
            94.0,
            3907.7,
            4.61,
            (45.0, 48.0),
            (41.4, 48.7),
        ),
    },
];

/// Seed 002's numbers for `router` (`round_robin` or `kv`) at `concurrency`.
pub fn seed_002(router: &str, concurrency: u32) -> Option<SeedSide> {
    let row = SEED_002.iter().find(|r| r.concurrency == concurrency)?;
    match router {
        "round_robin" => Some(row.round_robin),
        "kv" => Some(row.kv),
        _ => None,
    }
}

/// A router's short label in tables (the seed's "RR" and "KV").
pub fn label(router: &str) -> String {
    match router {
        "round_robin" => "RR".to_string(),
        "kv" => "KV".to_string(),
        other => other.to_string(),
    }
}
