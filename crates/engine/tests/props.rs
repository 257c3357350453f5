//! Scheduler invariants under random submit/cancel sequences.
mod common;

use std::collections::{BTreeMap, BTreeSet};

use common::{Action, Run, engine, req, run, text};
use engine::{EngineConfig, EngineEvent, HardwareProfile, RequestId, Role, SpecDecodeConfig};
use kv_index::KvEventKind;
use nanotime::Nanos;
use proptest::prelude::*;
use proptest::strategy::ValueTree;

#[derive(Debug, Clone)]
struct Spec {
    block_size: u32,
    blocks: u32,
    max_seqs: u32,
    budget: u32,
    role: Role,
    spec: bool,
    mocker: bool,
    reqs: Vec<(u8, u32, u32, u64, Option<u64>)>,
}

fn spec() -> impl Strategy<Value = Spec> {
    (
        prop_oneof![Just(4u32), Just(16), Just(32)],
        // Pool of 400..6,000 tokens: from one request at a time to several, with eviction.
        400u32..6_000,
        1u32..10,
        8u32..2_000,
        prop_oneof![
            4 => Just(Role::Aggregated),
            1 => Just(Role::PrefillOnly),
            1 => Just(Role::DecodeOnly)
        ],
        any::<bool>(),
        any::<bool>(),
        prop::collection::vec(
            (
                0u8..4,
                1u32..400,
                1u32..150,
                0u64..4_000,
                prop::option::weighted(0.25, 0u64..6_000),
            ),
            1..25,
        ),
    )
        .prop_map(
            |(block_size, blocks, max_seqs, budget, role, spec, mocker, reqs)| Spec {
                block_size,
                blocks: blocks / block_size,
                max_seqs,
                budget,
                role,
                spec,
                mocker,
                reqs,
            },
        )
}

fn config(s: &Spec) -> EngineConfig {
    let profile = if s.mocker {
        HardwareProfile::dynamo_mocker()
    } else {
        HardwareProfile::h200_llama70b_fp8()
    };
    let mut c = EngineConfig::new(profile);
    c.block_size = s.block_size;
    c.num_gpu_blocks_override = Some(s.blocks);
    c.max_num_seqs = s.max_seqs;
    c.max_num_batched_tokens = s.budget;
    c.role = s.role;
    c.seed = 3;
    if s.spec {
        c.spec_decode = Some(SpecDecodeConfig::eagle3(3, 0.7));
    }
    c
}

fn actions(s: &Spec) -> Vec<(Nanos, Action)> {
    let mut a = Vec::new();
    for (i, &(group, unique, out, at, cancel)) in s.reqs.iter().enumerate() {
        // Requests of a group share a 96-token prefix (a conversation starter).
        let mut prompt = text(u32::from(group), 96);
        prompt.extend(text(1_000 + i as u32, unique));
        a.push((
            Nanos::from_millis(at),
            Action::Submit(req(i as u64, prompt, out)),
        ));
        if let Some(c) = cancel {
            a.push((Nanos::from_millis(c), Action::Cancel(RequestId(i as u64))));
        }
    }
    a
}

/// Every request ends exactly once; tokens are contiguous and complete; the KV event stream
/// is one a router can follow (dense sequence numbers, stores before removes, parents known).
fn check_outcomes(s: &Spec, r: &Run) {
    let mut ended: BTreeMap<u64, &'static str> = BTreeMap::new();
    let mut end = |id: RequestId, how: &'static str| {
        // A cancel that arrives before its submit is a no-op; a resubmitted id never happens.
        assert!(ended.insert(id.0, how).is_none(), "{id:?} ended twice");
    };
    for e in &r.events {
        match e {
            EngineEvent::Finished { id, .. } => end(*id, "finished"),
            EngineEvent::PrefillDone { id, .. } => end(*id, "prefill"),
            EngineEvent::Cancelled { id, .. } => end(*id, "cancelled"),
            EngineEvent::Rejected { id, .. } => end(*id, "rejected"),
            _ => {}
        }
    }
    assert_eq!(
        ended.len(),
        s.reqs.len(),
        "a request neither finished nor was cancelled"
    );
    let counts: BTreeMap<u64, u32> = r
        .token_counts()
        .into_iter()
        .map(|(i, n)| (i.0, n))
        .collect();
    for (id, how) in &ended {
        let want = match (*how, s.role) {
            ("finished", _) => s.reqs[*id as usize].2,
            ("prefill", _) => 1,
            _ => continue,
        };
        // `token_counts` gives the end of the produced range. A decode worker starts at index 1,
        // so a one-token request produces nothing there.
        let got = counts.get(id).copied().unwrap_or(0);
        if s.role == Role::DecodeOnly && want == 1 {
            assert_eq!(got, 0, "request {id}");
        } else {
            assert_eq!(got, want, "request {id}");
        }
    }
    assert!(r.kv_seqs_are_dense());
    let mut live: BTreeSet<u64> = BTreeSet::new();
    for e in &r.events {
        let EngineEvent::Kv(kv) = e else { continue };
        match &kv.kind {
            KvEventKind::Stored { parent, blocks } => {
                if let Some(p) = parent {
                    assert!(live.contains(&p.0), "parent not stored");
                }
                for b in blocks {
                    assert!(live.insert(b.id.0), "stored twice");
                }
            }
            KvEventKind::Removed { blocks } => {
                for b in blocks {
                    assert!(live.remove(&b.0), "removed a block never stored");
                }
            }
            KvEventKind::Cleared => live.clear(),
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn scheduler_invariants_hold(s in spec()) {
        let mut e = engine(config(&s));
        // `run` checks budget, sequences, blocks and pool bookkeeping after every call.
        let r = run(&mut e, actions(&s), true);
        check_outcomes(&s, &r);
        let m = e.metrics();
        prop_assert_eq!(m.finished + m.cancelled + m.rejected, s.reqs.len() as u64);
        prop_assert!(e.is_idle());
        prop_assert_eq!(e.metrics().kv_blocks_used, 0);
    }

    #[test]
    fn speed_mode_equals_step_by_step(s in spec()) {
        let mut slow = engine(config(&s));
        let mut cfg = config(&s);
        cfg.coalesce_decode = true;
        let mut fast = engine(cfg);
        let rs = run(&mut slow, actions(&s), false);
        let rf = run(&mut fast, actions(&s), true);
        prop_assert_eq!(rs.finished(), rf.finished());
        prop_assert_eq!(rs.token_counts(), rf.token_counts());
        prop_assert_eq!(rs.stored(), rf.stored());
        prop_assert_eq!(rs.removed(), rf.removed());
        let (ms, mf) = (slow.metrics(), fast.metrics());
        prop_assert_eq!(ms.steps, mf.steps);
        prop_assert_eq!(ms.busy_time, mf.busy_time);
        prop_assert_eq!(ms.preemptions, mf.preemptions);
        prop_assert_eq!(ms.spec_drafts, mf.spec_drafts);
        prop_assert_eq!(ms.spec_accepted_tokens, mf.spec_accepted_tokens);
        prop_assert_eq!(&ms.spec_accepted_per_pos, &mf.spec_accepted_per_pos);
        prop_assert_eq!(ms.spec_draft_time, mf.spec_draft_time);
    }
}

/// The generator must exercise the scheduler, not just the rejection path.
#[test]
fn generated_scenarios_mostly_run() {
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let (mut finished, mut rejected, mut preempted) = (0, 0, 0);
    for _ in 0..64 {
        let s = spec().new_tree(&mut runner).unwrap().current();
        let mut e = engine(config(&s));
        run(&mut e, actions(&s), false);
        let m = e.metrics();
        finished += m.finished;
        rejected += m.rejected;
        preempted += m.preemptions;
    }
    assert!(
        finished > 3 * rejected,
        "{finished} finished, {rejected} rejected"
    );
    assert!(preempted > 0);
}
