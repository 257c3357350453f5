//! Speed mode (`coalesce_decode`) must give the same results as one step at a time.
mod common;

use common::{Action, Run, engine, req, run, text};
use engine::{EngineConfig, EngineEvent, HardwareProfile, RequestId, Role, SpecDecodeConfig};
use nanotime::Nanos;

fn scenario() -> Vec<(Nanos, Action)> {
    let mut a = Vec::new();
    for i in 0..24u64 {
        let mut prompt = text((i % 4) as u32, 1_500);
        prompt.extend(text(50 + i as u32, 100 + (i as u32 * 211) % 2_000));
        let out = 40 + (i as u32 * 97) % 700;
        a.push((
            Nanos::from_millis(i * 730),
            Action::Submit(req(i, prompt, out)),
        ));
    }
    // Cancels in the middle of decode stretches, and one of a request not yet admitted.
    a.push((Nanos::from_millis(4_321), Action::Cancel(RequestId(2))));
    a.push((Nanos::from_millis(9_876), Action::Cancel(RequestId(9))));
    a.push((Nanos::from_millis(16_000), Action::Cancel(RequestId(23))));
    a
}

fn both(
    cfg: EngineConfig,
    actions: impl Fn() -> Vec<(Nanos, Action)>,
) -> (Run, Run, [engine::EngineMetrics; 2]) {
    let mut slow = engine(cfg.clone());
    let mut fast_cfg = cfg;
    fast_cfg.coalesce_decode = true;
    let mut fast = engine(fast_cfg);
    let rs = run(&mut slow, actions(), true);
    let rf = run(&mut fast, actions(), true);
    (rs, rf, [slow.metrics(), fast.metrics()])
}

fn assert_equivalent(rs: &Run, rf: &Run, ms: &[engine::EngineMetrics; 2]) {
    let (fs, ff) = (rs.finished(), rf.finished());
    assert_eq!(fs.len(), ff.len());
    for (a, b) in fs.iter().zip(&ff) {
        assert_eq!((a.0, a.2, a.3), (b.0, b.2, b.3));
        // Same step durations, so the same instants (allow a microsecond of rounding).
        assert!(
            a.1.0.abs_diff(b.1.0) <= 1_000,
            "{:?}: {} vs {}",
            a.0,
            a.1,
            b.1
        );
    }
    assert_eq!(rs.token_counts(), rf.token_counts());
    assert_eq!(rs.stored(), rf.stored());
    assert_eq!(rs.removed(), rf.removed());
    assert!(rf.kv_seqs_are_dense());
    let [s, f] = ms;
    assert_eq!(s.tokens_generated, f.tokens_generated);
    assert_eq!(s.prefill_tokens_computed, f.prefill_tokens_computed);
    assert_eq!(s.prefix_hit_tokens, f.prefix_hit_tokens);
    assert_eq!(s.steps, f.steps);
    assert!(s.busy_time.0.abs_diff(f.busy_time.0) <= 1_000);
    assert_eq!(s.cancelled, f.cancelled);
    assert_eq!(s.decode_tokens_generated, f.decode_tokens_generated);
    assert_eq!(s.spec_drafts, f.spec_drafts);
    assert_eq!(s.spec_accepted_tokens, f.spec_accepted_tokens);
    assert_eq!(s.spec_accepted_per_pos, f.spec_accepted_per_pos);
    assert!(s.spec_draft_time.0.abs_diff(f.spec_draft_time.0) <= 1_000);
}

fn tokens_events(r: &Run) -> usize {
    r.events
        .iter()
        .filter(|e| matches!(e, EngineEvent::Tokens { .. }))
        .count()
}

#[test]
fn coalesced_decode_matches_step_by_step_h200() {
    let (rs, rf, ms) = both(EngineConfig::seed_002(), scenario);
    assert_equivalent(&rs, &rf, &ms);
    assert!(ms[0].cancelled >= 2);
    assert_far_fewer_token_events(&rs, &rf);
}

/// The point of the mode: far fewer token events (one per request per stretch) than
/// step-by-step.
fn assert_far_fewer_token_events(step_by_step: &Run, speed: &Run) {
    assert!(
        tokens_events(speed) * 3 < tokens_events(step_by_step),
        "{} vs {}",
        tokens_events(speed),
        tokens_events(step_by_step)
    );
}

/// A small pool: stretches end where blocks would run out, evictions and preemptions happen.
#[test]
fn coalesced_decode_matches_under_memory_pressure() {
    let mut cfg = EngineConfig::seed_002();
    cfg.num_gpu_blocks_override = Some(400);
    cfg.max_num_seqs = 8;
    let (rs, rf, ms) = both(cfg, scenario);
    assert!(ms[0].preemptions > 0 || !rs.removed().is_empty());
    assert_equivalent(&rs, &rf, &ms);
}

#[test]
fn coalesced_decode_matches_dynamo_mocker() {
    let cfg = EngineConfig::from_profile(HardwareProfile::dynamo_mocker());
    let (rs, rf, ms) = both(cfg, scenario);
    assert_equivalent(&rs, &rf, &ms);
}

/// Decode-only: KV arrivals cut stretches short.
#[test]
fn coalesced_decode_matches_with_kv_transfers() {
    let mut cfg = EngineConfig::seed_002();
    cfg.role = Role::DecodeOnly;
    let (rs, rf, ms) = both(cfg, scenario);
    assert_equivalent(&rs, &rf, &ms);
}

/// Speculative decoding in speed mode: each step's acceptance is drawn when the stretch is
/// planned, and is the same draw step-by-step mode makes at the step's end.
#[test]
fn coalesced_decode_matches_with_speculative_decoding() {
    for spec in [
        SpecDecodeConfig::seed_003_draft(),
        SpecDecodeConfig::seed_003_eagle3(),
    ] {
        for profile in [
            HardwareProfile::h200_llama70b_fp8(),
            HardwareProfile::h100_tp4_llama70b_fp8(),
        ] {
            let mut cfg = EngineConfig::from_profile(profile);
            cfg.spec_decode = Some(spec.clone());
            cfg.seed = 11;
            let (rs, rf, ms) = both(cfg, scenario);
            assert_equivalent(&rs, &rf, &ms);
            assert!(ms[0].spec_drafts > 1_000);
            assert_far_fewer_token_events(&rs, &rf);
        }
    }
}

/// Speculation under memory pressure: the lookahead blocks of every step run the pool dry,
/// so stretches end early and preemptions happen.
#[test]
fn coalesced_speculative_decode_matches_under_memory_pressure() {
    let mut cfg = EngineConfig::seed_002();
    cfg.num_gpu_blocks_override = Some(400);
    cfg.max_num_seqs = 8;
    cfg.spec_decode = Some(SpecDecodeConfig::seed_003_eagle3());
    cfg.seed = 5;
    let (rs, rf, ms) = both(cfg, scenario);
    assert!(ms[0].preemptions > 0 || !rs.removed().is_empty());
    assert_equivalent(&rs, &rf, &ms);
}
