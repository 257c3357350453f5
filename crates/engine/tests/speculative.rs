//! Speculative decoding end to end in the engine: ITL follows the acceptance formula, the
//! drafter's cost and memory come from its size, tensor parallelism is priced per layer.
mod common;

use common::{Action, Run, engine, req, run, text};
use engine::{
    EngineConfig, EngineEvent, HardwareProfile, SpecDecodeConfig, StepShape,
    expected_tokens_per_step,
};
use nanotime::Nanos;

const SEQS: u64 = 4;
const PROMPT: u32 = 3_000;
const OUTPUT: u32 = 2_000;

/// Mean inter-token latency of `SEQS` sequences decoding together, seconds: from the moment
/// the last of them has its first token (before it, the first one decodes beside the others'
/// prefill), to each one's last token.
fn mean_itl(cfg: EngineConfig) -> f64 {
    let mut e = engine(cfg);
    let actions = (0..SEQS)
        .map(|i| {
            (
                Nanos::ZERO,
                Action::Submit(req(i, text(i as u32, PROMPT), OUTPUT)),
            )
        })
        .collect();
    let r: Run = run(&mut e, actions, false);
    let t0 = (0..SEQS)
        .map(|i| r.first_token(engine::RequestId(i)).unwrap())
        .max()
        .unwrap();
    let itls: Vec<f64> = (0..SEQS)
        .map(|i| {
            let spans: Vec<(u32, Nanos)> = r
                .events
                .iter()
                .filter_map(|ev| match ev {
                    EngineEvent::Tokens { id, end, at, .. } if id.0 == i => Some((*end, *at)),
                    _ => None,
                })
                .collect();
            let (from_tokens, from) = spans.iter().copied().find(|s| s.1 >= t0).unwrap();
            let (to_tokens, to) = *spans.last().unwrap();
            assert_eq!(to_tokens, OUTPUT);
            (to - from).as_secs_f64() / f64::from(to_tokens - from_tokens)
        })
        .collect();
    itls.iter().sum::<f64>() / itls.len() as f64
}

/// Seed 003's claim, checked on its hardware: ITL falls with the acceptance probability α as
/// E = (1 − α^(K+1)) / (1 − α) predicts, once the drafter's overhead is paid. A speculative
/// step costs the plain step plus the verification of K more tokens plus K draft passes; it
/// yields E tokens; so ITL(α) = T_spec / E(α) and the speed-up over plain decoding is
/// E(α) · T_plain / T_spec.
#[test]
fn itl_falls_with_acceptance_as_the_formula_predicts() {
    let profile = HardwareProfile::h100_tp4_llama70b_fp8();
    let plain_cfg = EngineConfig::from_profile(profile.clone());
    let plain = mean_itl(plain_cfg.clone());
    // The two step shapes at the mean context of the decode (prompt + half the output).
    let context = u64::from(PROMPT + OUTPUT / 2);
    let t_plain = profile.step_secs(&StepShape::decode(SEQS, context, 32, 1 << 20));
    for (method, k) in [("draft", 5u32), ("eagle3", 5), ("eagle3", 3)] {
        let mut last_itl = f64::INFINITY;
        for alpha in [0.0, 0.3, 0.55, 0.7, 0.85, 0.95] {
            let mut spec = profile.speculative_config(method).unwrap();
            spec.draft_len = k;
            spec.acceptance_rate = alpha;
            spec.by_content.clear();
            let mut cfg = plain_cfg.clone();
            cfg.spec_decode = Some(spec.clone());
            cfg.seed = 7;
            let itl = mean_itl(cfg);
            let mut shape = StepShape::decode(SEQS, context, 32, 1 << 20);
            shape.decode_tokens = SEQS * u64::from(1 + k);
            shape.decode_context_tokens = SEQS * (context + u64::from(k));
            shape.draft_passes = k;
            shape.drafter = Some(spec.drafter());
            let t_spec = profile.step_secs(&shape);
            let e = expected_tokens_per_step(alpha, k);
            let predicted = t_spec / e;
            // Sampling noise (a few thousand steps) and the last steps' capping: 3%.
            assert!(
                (itl / predicted - 1.0).abs() < 0.03,
                "{method} K={k} α={alpha}: ITL {:.3} ms, predicted {:.3} ms",
                itl * 1e3,
                predicted * 1e3
            );
            let speedup = plain / itl;
            let overhead = t_spec / t_plain;
            assert!(
                (speedup / (e / overhead) - 1.0).abs() < 0.03,
                "{method} K={k} α={alpha}: speed-up {speedup:.3} vs E/overhead {:.3}",
                e / overhead
            );
            assert!(itl < last_itl, "ITL must fall as α rises");
            last_itl = itl;
            // At α = 0 speculation only costs: the drafter's overhead, nothing gained.
            if alpha == 0.0 {
                assert!(itl > plain);
            }
        }
    }
    // EAGLE-3's drafts are cheaper than an 8B model's: at the same α and K it is faster.
    let at = |method: &str| {
        let mut spec = profile.speculative_config(method).unwrap();
        spec.acceptance_rate = 0.7;
        spec.by_content.clear();
        let mut cfg = plain_cfg.clone();
        cfg.spec_decode = Some(spec);
        mean_itl(cfg)
    };
    assert!(at("eagle3") < at("draft"));
}

/// The drafter's weights and its own KV per token come out of the KV pool: an 8B draft model
/// takes much more than an EAGLE-3 head.
#[test]
fn drafter_memory_comes_out_of_the_kv_pool() {
    for profile in [
        HardwareProfile::h200_llama70b_fp8(),
        HardwareProfile::h100_tp4_llama70b_fp8(),
    ] {
        let capacity = |spec: Option<&str>| {
            let mut cfg = EngineConfig::from_profile(profile.clone());
            cfg.spec_decode = spec.map(|s| profile.speculative_config(s).unwrap());
            engine(cfg).kv_capacity_blocks()
        };
        let (off, draft, eagle) = (
            capacity(None),
            capacity(Some("draft")),
            capacity(Some("eagle3")),
        );
        assert!(draft < eagle && eagle < off, "{draft} < {eagle} < {off}");
        // The 8B draft's KV is 40% of the 70B's per token, and its weights ~8 GB.
        assert!(f64::from(draft) < 0.75 * f64::from(off), "{draft} vs {off}");
        assert!(f64::from(eagle) > 0.9 * f64::from(off), "{eagle} vs {off}");
    }
    // Hand computation for the TP=4 node: 4 × 81,559 MiB − 70.6 GB − 4 × 4 GiB, × 0.9, over
    // 163,840 B × 32 per block.
    let p = HardwareProfile::h100_tp4_llama70b_fp8();
    let left = 4 * 81_559u64 * (1 << 20) - 70_600_000_000 - 4 * 4 * (1u64 << 30);
    assert_eq!(
        p.kv_capacity_blocks(32, 0.9, 0),
        (left as f64 * 0.9).floor() as u64 / (163_840 * 32)
    );
}

/// Tensor parallelism by hand: a decode step of 8 sequences × 4,000 tokens on 4 H100s.
#[test]
fn tensor_parallel_step_by_hand() {
    let p = HardwareProfile::h100_tp4_llama70b_fp8();
    let shape = StepShape::decode(8, 4_000, 32, 100_000);
    let weights = 70.6e9 / (4.0 * 3.35e12 * 0.94);
    let kv = 163_840.0 * 32_000.0 / (4.0 * 3.35e12 * 0.345);
    // 160 all-reduces of 8 × 8,192 × 2 bytes: 8 µs + 1.5 × 131,072 / 360e9 each.
    let allreduce = 160.0 * (8e-6 + 1.5 * 131_072.0 / 360e9);
    let want = 0.3e-3 + weights + kv + allreduce;
    let got = p.step_secs(&shape);
    assert!((got - want).abs() < 1e-12, "{got} vs {want}");
    // About 2.3× faster than one H200 at the same batch: four GPUs' bandwidth (each 70% of
    // an H200's), minus the all-reduces.
    let h200 = HardwareProfile::h200_llama70b_fp8().step_secs(&shape);
    assert!(h200 / got > 2.0 && h200 / got < 3.0, "{h200} / {got}");
    // Prefill: compute over 4 GPUs plus the all-reduce of every token's activations.
    let pf = p.step_secs(&StepShape::prefill(4_096, 0));
    let single = HardwareProfile::h200_llama70b_fp8().step_secs(&StepShape::prefill(4_096, 0));
    assert!(pf < single / 2.5, "{pf} vs {single}");
}

/// A bad speculative configuration is refused with what is wrong, not run.
#[test]
fn bad_speculative_configs_say_what_is_wrong() {
    let mut cfg = EngineConfig::seed_002();
    let mut spec = SpecDecodeConfig::seed_003_draft();
    spec.by_content[0].share = 2.0;
    cfg.spec_decode = Some(spec);
    let err = engine::Engine::new(cfg, kv_index::WorkerId(0))
        .unwrap_err()
        .to_string();
    assert!(err.contains("share"), "{err}");
    let err = HardwareProfile::h100_llama8b()
        .speculative_config("draft")
        .unwrap_err();
    assert!(
        err.contains("no speculative-decoding configurations"),
        "{err}"
    );
    let err = HardwareProfile::h200_llama70b_fp8()
        .speculative_config("medusa")
        .unwrap_err();
    assert!(err.contains("draft, eagle3"), "{err}");
}

/// What a speculative worker declares to load-aware routers (`/info`'s timing, which
/// `kv_load` prices requests with) follows from its settings: a token of context costs its
/// verification step's marginal time divided by the tokens that step yields on average, and a
/// prompt token also pays the drafter's share of the prefill.
#[test]
fn declared_timing_prices_speculation() {
    let profile = HardwareProfile::h100_tp4_llama70b_fp8();
    let plain_cfg = EngineConfig::from_profile(profile.clone());
    let plain = engine(plain_cfg.clone()).limits().timing.unwrap();
    let declared = |method: &str, alpha: f64| {
        let mut spec = profile.speculative_config(method).unwrap();
        spec.acceptance_rate = alpha;
        spec.by_content.clear();
        let e = expected_tokens_per_step(alpha, spec.draft_len);
        let mut cfg = plain_cfg.clone();
        cfg.spec_decode = Some(spec);
        (engine(cfg).limits().timing.unwrap(), e)
    };
    for method in ["draft", "eagle3"] {
        let (low, e_low) = declared(method, 0.3);
        let (high, e_high) = declared(method, 0.85);
        // More acceptance, fewer steps per token: cheaper context, by the ratio of E.
        let ratio = low.decode_secs_per_context_token / high.decode_secs_per_context_token;
        assert!(
            (ratio / (e_high / e_low) - 1.0).abs() < 1e-9,
            "{method}: {ratio}"
        );
        // A prompt token never gets cheaper with a drafter beside the target.
        assert!(high.prefill_secs_per_token >= plain.prefill_secs_per_token);
    }
    // EAGLE-3 at a typical α reads each context token for far fewer steps than plain decoding.
    let (eagle, _) = declared("eagle3", 0.8);
    assert!(eagle.decode_secs_per_context_token < 0.6 * plain.decode_secs_per_context_token);
    // An 8B draft model also prefills every prompt: a prompt token costs more than plain.
    let (draft, _) = declared("draft", 0.8);
    assert!(draft.prefill_secs_per_token > 1.05 * plain.prefill_secs_per_token);
}
