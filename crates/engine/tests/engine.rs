mod common;

use common::{Action, burst, engine, req, req_tokens, run, text};
use engine::{
    EngineConfig, EngineEvent, EngineRequest, HardwareProfile, KvLink, Leg, RejectReason,
    RequestId, Role, SpecDecodeConfig, StepShape,
};
use kv_index::{BlockContent, BlockHasher, KvEventKind};
use nanotime::Nanos;

fn h200() -> EngineConfig {
    EngineConfig::seed_002()
}

#[test]
fn single_request_prefill_then_decode_times_match_the_profile() {
    let cfg = h200();
    let profile = cfg.profile.clone();
    let mut e = engine(cfg);
    let r = run(
        &mut e,
        vec![(Nanos::ZERO, Action::Submit(req(1, text(1, 3_500), 4)))],
        true,
    );
    // Step 1: the whole 3,500-token prompt (fits the 16,384 budget), first token at its end.
    let pf = StepShape {
        prefill_tokens: 3_500,
        prefill_attention_pairs: 3_500 * 3_501 / 2,
        kv_pool_blocks: u64::from(e.kv_capacity_blocks()),
        ..StepShape::default()
    };
    let t1 = profile.step_time(&pf);
    assert_eq!(r.first_token(RequestId(1)), Some(t1));
    // Then 3 decode steps, each reading 3,501.. tokens of context.
    let mut t = t1;
    for k in 0..3u64 {
        let d = StepShape {
            decode_seqs: 1,
            decode_tokens: 1,
            decode_context_tokens: 3_501 + k,
            decode_kv_blocks: (3_501 + k).div_ceil(32),
            kv_pool_blocks: u64::from(e.kv_capacity_blocks()),
            ..StepShape::default()
        };
        t += profile.step_time(&d);
    }
    assert_eq!(r.finished(), vec![(RequestId(1), t, 4, 0)]);
    assert_eq!(r.token_counts(), vec![(RequestId(1), 4)]);
    // One Tokens event per step in step-by-step mode.
    let tokens_events = r
        .events
        .iter()
        .filter(|e| matches!(e, EngineEvent::Tokens { .. }))
        .count();
    assert_eq!(tokens_events, 4);
    assert!(r.kv_seqs_are_dense());
    let m = e.metrics();
    assert_eq!(m.prefill_tokens_computed, 3_500);
    assert_eq!(m.tokens_generated, 4);
    assert_eq!(m.busy_time, t);
    assert_eq!(m.kv_blocks_used, 0);
    // 3,503 computed tokens → 109 full blocks stay cached.
    assert_eq!(m.kv_blocks_cached, 109);
    assert!(e.is_idle() && e.poll_timeout().is_none());
}

/// Turn 2 of a conversation hits the blocks turn 1 cached, including those filled during
/// decode, and the KV events name exactly the router's sequence hashes.
#[test]
fn prefix_reuse_across_turns_of_a_conversation() {
    let mut e = engine(h200());
    let p1 = text(1, 3_500);
    let a1 = text(2, 830);
    let r1 = run(
        &mut e,
        vec![(Nanos::ZERO, Action::Submit(req_tokens(1, &p1, &a1)))],
        true,
    );
    let mut p2 = p1.clone();
    p2.extend(&a1);
    p2.extend(text(3, 100));
    let hasher = BlockHasher::default();
    let want: Vec<u64> = hasher
        .sequence_hashes(&p2[..3_500 + 830 - 1])
        .iter()
        .map(|h| h.0)
        .collect();
    // Every full block of prompt + answer (less the never-fed last token) was announced.
    assert_eq!(r1.stored(), want.iter().copied().collect());
    let t0 = Nanos::from_secs(100);
    let r2 = run(
        &mut e,
        vec![(t0, Action::Submit(req_tokens(2, &p2, &text(4, 10))))],
        true,
    );
    let (_, _, _, cached) = r2.finished()[0];
    // floor(4,329 / 32) = 135 blocks = 4,320 tokens.
    assert_eq!(cached, 4_320);
    let m = e.metrics();
    assert_eq!(m.prompt_tokens, 3_500 + 4_430);
    assert_eq!(m.prefix_hit_tokens, 4_320);
    assert_eq!(m.prefill_tokens_computed, 3_500 + (4_430 - 4_320));
    // Turn 2's Stored events chain from turn 1's last block.
    let first_stored = r2.events.iter().find_map(|e| match e {
        EngineEvent::Kv(kv) => match &kv.kind {
            KvEventKind::Stored { parent, .. } => Some(*parent),
            _ => None,
        },
        _ => None,
    });
    assert_eq!(first_stored.unwrap().map(|p| p.0), Some(want[134]));
}

/// A router's prompt hashes spare the engine hashing the prompt and change nothing it does;
/// hashes of another block size are ignored (the engine hashes the prompt itself).
#[test]
fn prompt_hashes_from_the_router_give_the_same_run() {
    let p1 = text(1, 3_500);
    let a1 = text(2, 830);
    let mut p2 = p1.clone();
    p2.extend(&a1);
    p2.extend(text(3, 100));
    let a2 = text(4, 40);
    let turns = |hashed: Option<usize>| {
        let submit = |id: u64, prompt: &[u32], output: &[u32]| match hashed {
            None => Action::Submit(req_tokens(id, prompt, output)),
            Some(block_size) => {
                let hasher = BlockHasher::new(block_size).expect("block size");
                let local = hasher.local_hashes(prompt);
                let seq = hasher.sequence_hashes(prompt);
                Action::SubmitHashed(req_tokens(id, prompt, output), local, seq)
            }
        };
        let mut e = engine(h200());
        run(
            &mut e,
            vec![
                (Nanos::ZERO, submit(1, &p1, &a1)),
                (Nanos::from_secs(100), submit(2, &p2, &a2)),
            ],
            true,
        )
        .events
    };
    let plain = turns(None);
    assert!(plain.len() > 10, "the run produced events");
    let block_size = h200().block_size as usize;
    assert_eq!(turns(Some(block_size)), plain);
    assert_eq!(turns(Some(block_size * 2)), plain);
}

/// Hashes of the engine's block size are taken as given (checked against the prompt in debug
/// builds): these are another prompt's.
#[cfg(debug_assertions)]
#[test]
#[should_panic(expected = "do not match the prompt")]
fn prompt_hashes_of_the_engines_block_size_are_used() {
    let hasher = BlockHasher::new(h200().block_size as usize).expect("block size");
    let other = text(9, 3_500);
    let mut e = engine(h200());
    let action = Action::SubmitHashed(
        req_tokens(1, &text(1, 3_500), &text(2, 10)),
        hasher.local_hashes(&other),
        hasher.sequence_hashes(&other),
    );
    run(&mut e, vec![(Nanos::ZERO, action)], true);
}

/// With a pool too small for two conversations, the least recently released blocks go first
/// and blocks in use are never evicted.
#[test]
fn eviction_is_lru_and_spares_referenced_blocks() {
    let mut cfg = EngineConfig::new(HardwareProfile::h100_llama8b());
    cfg.num_gpu_blocks_override = Some(10);
    cfg.block_size = 4;
    let mut e = engine(cfg);
    // A: 12 prompt tokens + 1 output → 3 cached blocks. Then B the same. Then C needs 6 blocks.
    let a = text(1, 12);
    let b = text(2, 12);
    let hasher = BlockHasher::new(4).unwrap();
    let ha: Vec<u64> = hasher.sequence_hashes(&a).iter().map(|h| h.0).collect();
    let hb: Vec<u64> = hasher.sequence_hashes(&b).iter().map(|h| h.0).collect();
    let ra = run(
        &mut e,
        vec![(Nanos::ZERO, Action::Submit(req(1, a.clone(), 1)))],
        true,
    );
    assert_eq!(ra.stored().len(), 3);
    let rb = run(
        &mut e,
        vec![(Nanos::from_secs(1), Action::Submit(req(2, b, 1)))],
        true,
    );
    assert_eq!(rb.stored().len(), 3);
    // 6 cached blocks, 4 never used. C with 28 prompt tokens needs 7 blocks: 4 free + 3
    // evicted, and they must be A's (released first), deepest first.
    let rc = run(
        &mut e,
        vec![(Nanos::from_secs(2), Action::Submit(req(3, text(3, 28), 1)))],
        true,
    );
    let removed: Vec<u64> = rc
        .events
        .iter()
        .filter_map(|e| match e {
            EngineEvent::Kv(kv) => match &kv.kind {
                KvEventKind::Removed { blocks } => {
                    Some(blocks.iter().map(|b| b.0).collect::<Vec<_>>())
                }
                _ => None,
            },
            _ => None,
        })
        .flatten()
        .collect();
    assert_eq!(removed, vec![ha[2], ha[1], ha[0]]);
    assert!(rc.removed().is_disjoint(&hb.iter().copied().collect()));
    // A request that reuses B's prefix while C-sized pressure continues keeps B's blocks.
    let mut b2 = text(2, 12);
    b2.extend(text(9, 4));
    let rd = run(
        &mut e,
        vec![(Nanos::from_secs(3), Action::Submit(req(4, b2, 1)))],
        true,
    );
    assert_eq!(rd.finished()[0].3, 12);
}

#[test]
fn same_inputs_same_outputs() {
    let scenario = || {
        let mut actions = Vec::new();
        for i in 0..40u64 {
            let prompt = {
                let mut p = text((i % 5) as u32, 2_000);
                p.extend(text(100 + i as u32, 300 + (i as u32 * 37) % 900));
                p
            };
            actions.push((
                Nanos::from_millis(i * 150),
                Action::Submit(req(i, prompt, 50 + (i as u32 * 13) % 200)),
            ));
        }
        actions.push((Nanos::from_millis(2_000), Action::Cancel(RequestId(3))));
        actions
    };
    let mut cfg = h200();
    cfg.spec_decode = Some(SpecDecodeConfig::eagle3(4, 0.7));
    cfg.seed = 42;
    let mut a = engine(cfg.clone());
    let mut b = engine(cfg);
    let ra = run(&mut a, scenario(), true);
    let rb = run(&mut b, scenario(), true);
    assert_eq!(ra.events, rb.events);
    assert_eq!(a.metrics(), b.metrics());
}

#[test]
fn bad_requests_are_rejected_not_panicked() {
    let mut cfg = h200();
    cfg.num_gpu_blocks_override = Some(100);
    let mut e = engine(cfg);
    let t = Nanos::ZERO;
    e.submit(req(1, [], 5), t);
    e.submit(req(2, text(1, 10), 0), t);
    e.submit(req(3, text(1, 131_000), 100), t);
    e.submit(req(4, text(1, 3_300), 10), t); // 104 blocks > 100
    e.submit(req(5, text(1, 10), 5), t);
    e.submit(req(5, text(1, 10), 5), t);
    let reasons: Vec<_> = std::iter::from_fn(|| e.poll_event())
        .filter_map(|ev| match ev {
            EngineEvent::Rejected { id, reason } => Some((id.0, reason)),
            _ => None,
        })
        .collect();
    assert_eq!(reasons.len(), 5, "{reasons:?}");
    assert_eq!(reasons[0], (1, RejectReason::EmptyPrompt));
    assert_eq!(reasons[1], (2, RejectReason::NoOutput));
    assert!(matches!(reasons[2].1, RejectReason::ContextTooLong { .. }));
    assert!(matches!(reasons[3].1, RejectReason::TooLargeForPool { .. }));
    assert_eq!(reasons[4], (5, RejectReason::DuplicateId));
    assert_eq!(e.metrics().rejected, 5);
    // Unknown cancels are ignored.
    e.cancel(RequestId(99), Nanos(1));
    assert!(e.poll_event().is_none());
}

/// Seed 002's concurrency on one worker: 64 sequences fit, the rest wait; the budget splits
/// long prompts into chunks.
#[test]
fn batch_limits_and_chunked_prefill() {
    let mut cfg = h200();
    cfg.max_num_seqs = 4;
    cfg.max_num_batched_tokens = 1_000;
    let mut e = engine(cfg);
    for i in 0..6 {
        e.submit(req(i, text(i as u32, 2_500), 3), Nanos::ZERO);
        e.check_invariants();
    }
    let m = e.metrics();
    // First step: request 0's first 1,000-token chunk only.
    assert_eq!((m.running, m.waiting), (1, 5));
    let r = run(&mut e, vec![], true);
    assert_eq!(r.finished().len(), 6);
    assert_eq!(e.metrics().prefill_tokens_computed, 6 * 2_500);
    // 15,000 prompt tokens at 1,000 per step: at least 15 steps, plus the decodes.
    assert!(e.metrics().steps >= 15 + 2);
    // Chunking: request 0's first token comes after three steps (1,000 + 1,000 + 500 tokens).
    let steps_to_first: Vec<_> = r
        .events
        .iter()
        .filter_map(|ev| match ev {
            EngineEvent::FirstToken { id, .. } => Some(id.0),
            _ => None,
        })
        .collect();
    assert_eq!(steps_to_first[0], 0);
}

#[test]
fn preemption_recomputes_and_still_finishes() {
    let mut cfg = h200();
    cfg.num_gpu_blocks_override = Some(40);
    let mut e = engine(cfg);
    // Three requests of 10 blocks of prompt each, each growing by 300 tokens (~10 blocks):
    // they cannot all stay; the newest is preempted and recomputed.
    let actions = burst(3, 320, 300);
    let r = run(&mut e, actions, true);
    let f = r.finished();
    assert_eq!(f.len(), 3);
    assert!(f.iter().all(|x| x.2 == 300));
    assert!(e.metrics().preemptions > 0);
    let preempted: u32 = r
        .events
        .iter()
        .map(|e| match e {
            EngineEvent::Finished { preemptions, .. } => *preemptions,
            _ => 0,
        })
        .sum();
    assert_eq!(u64::from(preempted), e.metrics().preemptions);
    assert_eq!(r.token_counts().iter().map(|x| x.1).sum::<u32>(), 900);
}

#[test]
fn speculative_decoding_tokens_per_step_match_the_formula() {
    let mut cfg = h200();
    cfg.spec_decode = Some(SpecDecodeConfig::draft_model(5, 0.6));
    cfg.seed = 9;
    let mut e = engine(cfg.clone());
    // Eight sequences: small enough a batch that verifying 6 tokens each stays bound by the
    // weight read, as at seed 003's per-replica load.
    let actions = burst(8, 200, 4_000);
    let r = run(&mut e, actions, true);
    assert_eq!(r.finished().len(), 8);
    let m = e.metrics();
    let want = SpecDecodeConfig::draft_model(5, 0.6).expected_tokens_per_step();
    assert!((want - 2.38336).abs() < 1e-5);
    // Capping at the end of each request biases slightly low.
    assert!(
        (m.tokens_per_step() - want).abs() < 0.05,
        "{}",
        m.tokens_per_step()
    );
    // The per-token α is recovered; vLLM's accepted / drafted is lower (a rejection also
    // wastes the drafts behind it): Σ_{j=1..5} 0.6^j / 5.
    assert!(
        (m.acceptance_rate() - 0.6).abs() < 0.02,
        "{}",
        m.acceptance_rate()
    );
    assert!((m.draft_acceptance_rate() - 0.6 * (1.0 - 0.6f64.powi(5)) / (5.0 * 0.4)).abs() < 0.03);
    assert!((m.acceptance_length() - want).abs() < 0.05);
    assert_eq!(m.spec_accepted_per_pos.len(), 5);
    assert_eq!(
        m.spec_accepted_per_pos.iter().sum::<u64>(),
        m.spec_accepted_tokens
    );
    assert!(m.spec_accepted_per_pos.windows(2).all(|w| w[0] >= w[1]));
    assert_eq!(m.spec_draft_tokens, 5 * m.spec_drafts);
    assert!(
        m.draft_overhead() > 0.1 && m.draft_overhead() < 0.6,
        "{}",
        m.draft_overhead()
    );
    // Fewer, longer steps than without speculation, and faster overall.
    let mut plain = cfg;
    plain.spec_decode = None;
    let mut p = engine(plain);
    let actions = burst(8, 200, 4_000);
    let rp = run(&mut p, actions, true);
    let last = |r: &common::Run| r.finished().iter().map(|x| x.1).max().unwrap();
    assert!(last(&r) < last(&rp));
    assert_eq!(p.metrics().tokens_per_step(), 1.0);
}

/// Prefill worker → KV transfer → decode worker: the decode worker starts at output index 1,
/// no earlier than the transfer of the prompt's KV allows.
#[test]
fn disaggregated_prefill_to_decode_handoff() {
    let mut pcfg = h200();
    pcfg.role = Role::PrefillOnly;
    let mut dcfg = h200();
    dcfg.role = Role::DecodeOnly;
    dcfg.kv_link = KvLink::Network;
    let profile = dcfg.profile.clone();
    let mut pw = engine(pcfg);
    let mut dw = engine(dcfg);
    let prompt = text(1, 4_000);
    let request = req(1, prompt, 20);
    let rp = run(
        &mut pw,
        vec![(Nanos::ZERO, Action::Submit(request.clone()))],
        true,
    );
    let done_at = rp
        .events
        .iter()
        .find_map(|e| match e {
            EngineEvent::PrefillDone {
                at, prompt_tokens, ..
            } => {
                assert_eq!(*prompt_tokens, 4_000);
                Some(*at)
            }
            _ => None,
        })
        .expect("prefill done");
    assert_eq!(rp.first_token(RequestId(1)), Some(done_at));
    assert_eq!(rp.token_counts(), vec![(RequestId(1), 1)]);
    assert_eq!(pw.metrics().kv_blocks_cached, 125);
    let rd = run(&mut dw, vec![(done_at, Action::Submit(request))], true);
    let transfer = profile.kv_transfer_time(4_000, KvLink::Network);
    let first_decode = rd
        .events
        .iter()
        .find_map(|e| match e {
            EngineEvent::Tokens { start, at, .. } => {
                assert_eq!(*start, 1);
                Some(*at)
            }
            _ => None,
        })
        .unwrap();
    assert!(first_decode > done_at + transfer);
    let f = rd.finished();
    assert_eq!(f[0].2, 20);
    assert_eq!(rd.token_counts(), vec![(RequestId(1), 20)]);
    assert_eq!(dw.metrics().prefill_tokens_computed, 0);
    // The decode worker announces the prompt blocks it received.
    assert!(rd.stored().len() >= 125);
    // NVLink is much faster than the network for the same KV.
    assert!(profile.kv_transfer_time(4_000, KvLink::Nvlink) < transfer);
}

/// With external transfers a decode worker announces the KV it must receive and waits for
/// the driver's word, however long that takes: the driver's shared links time the transfer,
/// not the engine's profile.
#[test]
fn a_decode_worker_with_external_transfers_waits_for_its_kv_to_land() {
    let mut dcfg = h200();
    dcfg.role = Role::DecodeOnly;
    dcfg.external_kv_transfers = true;
    let bytes_per_token = dcfg.profile.kv_bytes_per_token;
    let mut dw = engine(dcfg);
    dw.submit(req(1, text(1, 4_000), 20), Nanos::ZERO);
    let start = dw.poll_transfer_start().expect("the transfer is announced");
    assert_eq!(
        (start.id, start.tokens, start.bytes, start.at),
        (RequestId(1), 4_000, 4_000 * bytes_per_token, Nanos::ZERO)
    );
    assert_eq!(dw.poll_transfer_start(), None);
    // Nothing to do until the KV lands: no timer, no tokens.
    assert_eq!(dw.poll_timeout(), None);
    while let Some(ev) = dw.poll_event() {
        assert!(!matches!(ev, EngineEvent::Tokens { .. }), "{ev:?}");
    }
    assert!(
        !dw.kv_arrived(RequestId(9), Nanos::from_millis(5)),
        "unknown id"
    );
    let landed = Nanos::from_secs(3);
    assert!(dw.kv_arrived(RequestId(1), landed));
    assert!(!dw.kv_arrived(RequestId(1), landed), "landed once");
    let mut events = Vec::new();
    while let Some(t) = dw.poll_timeout() {
        dw.handle_timeout(t);
        while let Some(ev) = dw.poll_event() {
            events.push(ev);
        }
    }
    let first_decode = events
        .iter()
        .find_map(|e| match e {
            EngineEvent::Tokens { start, at, .. } => Some((*start, *at)),
            _ => None,
        })
        .expect("decode tokens");
    assert_eq!(first_decode.0, 1, "output index 0 was the prefill worker's");
    assert!(first_decode.1 > landed, "{first_decode:?}");
    assert!(
        events.iter().any(|e| matches!(
            e,
            EngineEvent::Finished {
                output_tokens: 20,
                ..
            }
        )),
        "{events:?}"
    );
    assert_eq!(dw.metrics().prefill_tokens_computed, 0);
}

/// Per-request legs: a decode worker serves a whole request itself (conditional
/// disaggregation: its prefill is computed locally, no transfer), an aggregated worker serves
/// either leg (vLLM's `kv_both`), and a prefill worker refuses anything but a prefill.
#[test]
fn legs_choose_what_a_worker_does_with_each_request() {
    let mut dcfg = h200();
    dcfg.role = Role::DecodeOnly;
    let mut decode = engine(dcfg);
    let whole = EngineRequest {
        leg: Leg::Whole,
        ..req(1, text(1, 2_000), 10)
    };
    let r = run(
        &mut decode,
        vec![(Nanos::ZERO, Action::Submit(whole))],
        true,
    );
    assert_eq!(r.token_counts(), vec![(RequestId(1), 10)]);
    assert_eq!(decode.metrics().prefill_tokens_computed, 2_000);

    let mut both = engine(h200());
    let prefill = EngineRequest {
        leg: Leg::Prefill,
        ..req(2, text(2, 2_000), 10)
    };
    let r = run(
        &mut both,
        vec![(Nanos::ZERO, Action::Submit(prefill))],
        true,
    );
    assert_eq!(r.token_counts(), vec![(RequestId(2), 1)]);
    assert!(r.events.iter().any(|e| matches!(
        e,
        EngineEvent::PrefillDone {
            id: RequestId(2),
            ..
        }
    )));
    let decode_leg = EngineRequest {
        leg: Leg::Decode,
        ..req(3, text(3, 2_000), 10)
    };
    let r = run(
        &mut both,
        vec![(Nanos::ZERO, Action::Submit(decode_leg))],
        true,
    );
    assert_eq!(r.token_counts(), vec![(RequestId(3), 10)]);
    assert_eq!(
        both.metrics().prefill_tokens_computed,
        2_000,
        "no prefill for the decode leg"
    );

    let mut pcfg = h200();
    pcfg.role = Role::PrefillOnly;
    let mut prefill_worker = engine(pcfg);
    for (id, leg) in [(4, Leg::Whole), (5, Leg::Decode)] {
        let request = EngineRequest {
            leg,
            ..req(id, text(id as u32, 100), 10)
        };
        let r = run(
            &mut prefill_worker,
            vec![(Nanos::ZERO, Action::Submit(request))],
            true,
        );
        assert!(r.events.iter().any(|e| matches!(
            e,
            EngineEvent::Rejected {
                reason: RejectReason::LegNotServed { role: Role::PrefillOnly, leg: l },
                ..
            } if *l == leg
        )));
    }
    let mut dcfg = h200();
    dcfg.role = Role::DecodeOnly;
    let mut decode = engine(dcfg);
    let prefill = EngineRequest {
        leg: Leg::Prefill,
        ..req(6, text(6, 100), 10)
    };
    let r = run(
        &mut decode,
        vec![(Nanos::ZERO, Action::Submit(prefill))],
        true,
    );
    assert!(matches!(
        r.events[..],
        [EngineEvent::Rejected {
            reason: RejectReason::LegNotServed { .. },
            ..
        }]
    ));
}

#[test]
fn dynamo_mocker_profile_applies_its_defaults() {
    let cfg = EngineConfig::from_profile(HardwareProfile::dynamo_mocker());
    assert_eq!(
        (cfg.block_size, cfg.max_num_seqs, cfg.max_num_batched_tokens),
        (64, 256, 8_192)
    );
    let mut e = engine(cfg);
    assert_eq!(e.kv_capacity_blocks(), 16_384);
    let r = run(
        &mut e,
        vec![(Nanos::ZERO, Action::Submit(req(1, text(1, 1_000), 2)))],
        true,
    );
    // Prefill 1,000 tokens: 32.1058589 ms, then one decode at p = 16/16,384.
    let p = 16.0 / 16_384.0;
    let dec = -25.74 * p * p + 54.01 * p + 5.74;
    let want = Nanos::from_secs_f64(32.105_858_9e-3) + Nanos::from_secs_f64(dec * 1e-3);
    let got = r.finished()[0].1;
    assert!(got.0.abs_diff(want.0) <= 2, "{got} vs {want}");
}

#[test]
fn metrics_report_memory_and_utilisation() {
    let mut e = engine(h200());
    let m0 = e.metrics();
    assert_eq!(m0.weight_bytes, 70_600_000_000);
    assert_eq!(m0.kv_blocks_total, 13_022);
    e.submit(req(1, text(1, 1_000), 100), Nanos::ZERO);
    let m = e.metrics();
    assert_eq!(m.kv_blocks_used, 32);
    assert_eq!(m.memory_used_bytes, 70_600_000_000 + 32 * 163_840 * 32);
    let r = run(&mut e, vec![], false);
    let end = r.finished()[0].1;
    let m1 = e.metrics();
    assert!((m1.utilisation_since(&m0, end) - 1.0).abs() < 1e-9);
    assert!((m1.utilisation_since(&m0, end.saturating_mul(2)) - 0.5).abs() < 1e-9);
}

#[test]
fn example_profile_file_is_the_builtin() {
    let text = include_str!("../profiles/h200-llama70b-fp8.toml");
    assert_eq!(
        HardwareProfile::from_toml_str(text).unwrap(),
        HardwareProfile::h200_llama70b_fp8()
    );
}

#[test]
fn engine_config_loads_from_toml_with_seed_defaults() {
    let profile = HardwareProfile::h100_llama8b().to_toml_string().unwrap();
    let toml = format!(
        "role = \"decode_only\"\nkv_link = \"network\"\ncoalesce_decode = true\n\
         [spec_decode]\nmethod = \"eagle3\"\ndraft_len = 3\nacceptance_rate = 0.8\n\
         [profile]\n{}",
        profile
            .replace("[kv_transfer]", "[profile.kv_transfer]")
            .replace("[timing]", "[profile.timing]")
            .replace("[engine_defaults]", "[profile.engine_defaults]")
    );
    let cfg: EngineConfig = toml::from_str(&toml).unwrap();
    assert_eq!(cfg.role, Role::DecodeOnly);
    assert_eq!(cfg.kv_link, KvLink::Network);
    assert_eq!(
        (cfg.block_size, cfg.max_num_seqs, cfg.max_num_batched_tokens),
        (32, 64, 16_384)
    );
    assert_eq!(cfg.free_gpu_memory_fraction, 0.9);
    assert!(cfg.enable_prefix_caching && cfg.coalesce_decode);
    let e = engine(cfg);
    // (85,520,809,984 − 16,060,000,000 − 2 GiB − 2.4 GB EAGLE head) × 0.9 /
    // ((131,072 + 4,096 of the head's KV) × 32).
    let left = 85_520_809_984u64 - 16_060_000_000 - 2_147_483_648 - 2_400_000_000;
    assert_eq!(
        u64::from(e.kv_capacity_blocks()),
        (left as f64 * 0.9).floor() as u64 / ((131_072 + 4_096) * 32)
    );
}

#[test]
fn bad_configs_are_errors() {
    let mut cfg = h200();
    cfg.block_size = 0;
    assert!(engine::Engine::new(cfg, kv_index::WorkerId(1)).is_err());
    let mut cfg = h200();
    cfg.free_gpu_memory_fraction = 0.0;
    assert!(engine::Engine::new(cfg, kv_index::WorkerId(1)).is_err());
    let cfg = EngineConfig::new(HardwareProfile::dynamo_mocker());
    let err = engine::Engine::new(cfg, kv_index::WorkerId(1))
        .unwrap_err()
        .to_string();
    assert!(err.contains("num_gpu_blocks_override"), "{err}");
    let mut cfg = h200();
    cfg.spec_decode = Some(SpecDecodeConfig::eagle3(5, 1.2));
    assert!(engine::Engine::new(cfg, kv_index::WorkerId(1)).is_err());
}

/// With `kv_event_tokens`, `Stored` events carry each block's tokens (prompt and generated
/// output alike) under the same block ids and parents as without: what a publisher of vLLM's
/// `BlockStored` needs, with no second hashing or token table of its own.
#[test]
fn stored_events_carry_tokens_when_asked() {
    let prompt = text(1, 100);
    let answer = text(2, 40);
    let stored = |with_tokens: bool| {
        let mut cfg = h200();
        cfg.kv_event_tokens = with_tokens;
        let mut e = engine(cfg);
        let r = run(
            &mut e,
            vec![(Nanos::ZERO, Action::Submit(req_tokens(1, &prompt, &answer)))],
            true,
        );
        r.events
            .into_iter()
            .filter_map(|e| match e {
                EngineEvent::Kv(kv) => match kv.kind {
                    KvEventKind::Stored { parent, blocks } => Some((parent, blocks)),
                    _ => None,
                },
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    let hashed = stored(false);
    let with_tokens = stored(true);
    assert_eq!(hashed.len(), with_tokens.len());
    let sequence: Vec<u32> = prompt.iter().chain(&answer).copied().collect();
    let mut block = 0;
    for ((parent_h, blocks_h), (parent_t, blocks_t)) in hashed.iter().zip(&with_tokens) {
        assert_eq!(parent_h, parent_t);
        for (h, t) in blocks_h.iter().zip(blocks_t) {
            assert_eq!(h.id, t.id, "same block ids either way");
            let tokens = &sequence[block * 32..(block + 1) * 32];
            assert_eq!(t.content, BlockContent::Tokens(tokens.to_vec()));
            assert_eq!(t.content.local_hash(), h.content.local_hash());
            block += 1;
        }
    }
    // 139 tokens fed (the last output token never is): 4 full blocks, the last one part
    // prompt and part answer.
    assert_eq!(block, 4);
}

/// What an engine declares to routers is its own settings and the profile's timing.
#[test]
fn an_engine_declares_its_limits() {
    let cfg = h200();
    let e = engine(cfg.clone());
    let limits = e.limits();
    assert_eq!(limits.max_num_seqs, Some(cfg.max_num_seqs));
    assert_eq!(
        limits.kv_capacity_blocks,
        Some(u64::from(e.kv_capacity_blocks()))
    );
    assert_eq!(
        limits.timing,
        Some(
            cfg.profile
                .marginal_timing(cfg.block_size, u64::from(e.kv_capacity_blocks()))
        )
    );
}
