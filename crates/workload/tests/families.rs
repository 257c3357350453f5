//! The robustness grid's workload families: lock-step multi-turn (new tokens sized on the
//! history), shared system-prompt groups (exactly shared prefixes) and think times, driven by
//! a loop that serves every turn one second after it is issued.

use std::collections::BTreeMap;
use std::sync::Arc;

use nanotime::Nanos;
use workload::{
    Assets, ChatWorkload, Content, Distribution, LockStep, SystemGroups, TextContent, Turn,
    TurnKey, TurnRange, WorkloadConfig,
};

fn assets() -> Arc<Assets> {
    Assets::builtin().unwrap()
}

const SERVICE: Nanos = Nanos::from_secs(1);

/// Serves every turn `SERVICE` after it is issued until `end`; the turns in issue order, with
/// when each was issued and finished.
fn serve<C: Content>(
    workload: &mut ChatWorkload<C>,
    end: Nanos,
    key_of: impl Fn(&C::Turn) -> TurnKey,
) -> (Vec<C::Turn>, BTreeMap<TurnKey, Nanos>) {
    let mut now = Nanos::ZERO;
    let mut log = Vec::new();
    let mut finished = BTreeMap::new();
    let mut in_flight: Vec<(Nanos, TurnKey)> = Vec::new();
    while now <= end {
        while let Some(turn) = workload.poll_request() {
            in_flight.push((now + SERVICE, key_of(&turn)));
            log.push(turn);
        }
        in_flight.sort();
        let next_finish = in_flight.first().map(|f| f.0);
        let next = match (next_finish, workload.poll_timeout()) {
            (Some(a), Some(b)) => a.min(b),
            (a, b) => match a.or(b) {
                Some(t) => t,
                None => break,
            },
        };
        now = next.max(now);
        while in_flight.first().is_some_and(|f| f.0 <= now) {
            let (at, key) = in_flight.remove(0);
            workload.on_turn_finished(key, at);
            finished.insert(key, at);
        }
        workload.handle_timeout(now);
    }
    (log, finished)
}

fn lockstep(ratio: f64, answer: u32) -> WorkloadConfig {
    WorkloadConfig {
        concurrency: 6,
        ramp_s: 0.0,
        turns: TurnRange { min: 4, max: 4 },
        lockstep: Some(LockStep {
            new_tokens_ratio: ratio,
        }),
        output_tokens: Distribution::Constant {
            value: f64::from(answer),
        },
        ..WorkloadConfig::default()
    }
}

fn by_conversation(log: &[Turn]) -> BTreeMap<u64, Vec<&Turn>> {
    let mut out: BTreeMap<u64, Vec<&Turn>> = BTreeMap::new();
    for t in log {
        out.entry(t.key.conversation).or_default().push(t);
    }
    out
}

#[test]
fn lockstep_turns_add_new_tokens_in_proportion_to_the_history() {
    let assets = assets();
    let cap = LockStep::max_new_tokens(&assets);
    for (ratio, answer) in [(0.25, 150), (1.0, 800), (2.0, 150)] {
        let mut w =
            ChatWorkload::new(lockstep(ratio, answer), assets.clone(), 3, Nanos::ZERO).unwrap();
        let (log, _) = serve(&mut w, Nanos::from_secs(30), |t| t.key);
        let conversations = by_conversation(&log);
        let mut checked = 0;
        for turns in conversations.values() {
            for t in turns {
                assert_eq!(
                    t.output.len(),
                    answer as usize,
                    "answers are exactly {answer}"
                );
            }
            for pair in turns.windows(2) {
                let (prev, next) = (pair[0], pair[1]);
                let history = prev.prompt.len() + prev.output.len();
                // The history is resent verbatim, then <|eot_id|> and the new user message.
                assert_eq!(&next.prompt[..prev.prompt.len()], &prev.prompt[..]);
                assert_eq!(&next.prompt[prev.prompt.len()..history], &prev.output[..]);
                let added = next.prompt.len() - history;
                let wanted = ((ratio * history as f64).round() as usize).min(cap);
                // Template tokens around the material: <|eot_id|>, the user header, the
                // message's <|eot_id|> and the assistant header.
                assert!(
                    added >= wanted && added <= wanted + 16,
                    "ratio {ratio}: history {history}, added {added}, wanted {wanted}"
                );
                checked += 1;
            }
        }
        assert!(checked >= 6, "ratio {ratio}: only {checked} later turns");
    }
}

#[test]
fn lockstep_text_form_sizes_its_material_like_the_token_form() {
    let assets = assets();
    let config = lockstep(1.0, 150);
    let mut tokens = ChatWorkload::new(config.clone(), assets.clone(), 9, Nanos::ZERO).unwrap();
    let mut text =
        ChatWorkload::<TextContent>::with_content(config, assets.clone(), 9, Nanos::ZERO).unwrap();
    let (token_log, _) = serve(&mut tokens, Nanos::from_secs(20), |t| t.key);
    let (text_log, _) = serve(&mut text, Nanos::from_secs(20), |t| t.key);
    assert_eq!(token_log.len(), text_log.len());
    assert_eq!(
        tokens.stats().prompt_tokens_issued,
        text.stats().prompt_tokens_issued
    );
    // A later turn's question is the material itself: its tokens end the token prompt,
    // before <|eot_id|> and the assistant header.
    let tokenizer = assets.tokenizer();
    let later = text_log.iter().position(|t| t.key.turn == 1).unwrap();
    let ids = tokenizer.encode(&text_log[later].question);
    let prompt = &token_log[later].prompt;
    let tail = assets.format().generation_prompt().len() + 1;
    assert_eq!(
        &prompt[prompt.len() - tail - ids.len()..prompt.len() - tail],
        &ids[..]
    );
}

#[test]
fn conversations_of_a_group_share_its_system_prompt_exactly() {
    let assets = assets();
    let groups = SystemGroups {
        groups: 4,
        tokens: 6_000,
    };
    let config = WorkloadConfig {
        concurrency: 24,
        ramp_s: 0.0,
        system_groups: Some(groups),
        ..WorkloadConfig::default()
    };
    let prefixes: Vec<Arc<[u32]>> = (0..4)
        .map(|g| groups.prefix(&assets, &config, g).unwrap())
        .collect();
    for p in &prefixes {
        assert!(
            (6_000..6_200).contains(&p.len()),
            "a group prompt has {} tokens",
            p.len()
        );
    }
    let mut w = ChatWorkload::new(config.clone(), assets.clone(), 5, Nanos::ZERO).unwrap();
    let (log, _) = serve(&mut w, Nanos::from_secs(1), |t| t.key);
    let mut seen = [0; 4];
    for t in log.iter().filter(|t| t.key.turn == 0) {
        let g = prefixes
            .iter()
            .position(|p| t.prompt.starts_with(p))
            .expect("every first prompt starts with one group's system prompt");
        seen[g] += 1;
    }
    assert!(
        seen.iter().all(|&n| n > 0),
        "24 draws reach every group: {seen:?}"
    );
    // Groups share the instruction only, a few dozen tokens, not their text.
    let common = prefixes[0]
        .iter()
        .zip(prefixes[1].iter())
        .take_while(|(a, b)| a == b)
        .count();
    assert!(common < 100, "groups 0 and 1 share {common} tokens");
    // The text form's system message is the token form's, tokenized.
    let mut text =
        ChatWorkload::<TextContent>::with_content(config, assets.clone(), 5, Nanos::ZERO).unwrap();
    let first = text.poll_request().unwrap();
    let mut ids = vec![assets.format().bos()];
    assets.format().push_message(
        assets.tokenizer(),
        &text::ChatMessage::system(first.system.to_string()),
        &mut ids,
    );
    assert!(prefixes.iter().any(|p| p[..] == ids[..]));
}

#[test]
fn think_time_separates_an_answer_from_the_next_question() {
    for think in [5.0, 30.0] {
        let config = WorkloadConfig {
            concurrency: 4,
            ramp_s: 0.0,
            think_time_s: Distribution::Constant { value: think },
            ..WorkloadConfig::default()
        };
        let mut w = ChatWorkload::new(config, assets(), 2, Nanos::ZERO).unwrap();
        let (log, finished) = serve(&mut w, Nanos::from_secs(200), |t| t.key);
        let mut checked = 0;
        for t in log.iter().filter(|t| t.key.turn > 0) {
            let previous = TurnKey {
                conversation: t.key.conversation,
                turn: t.key.turn - 1,
            };
            let done = finished[&previous];
            assert_eq!(t.issued_at, done + Nanos::from_secs_f64(think));
            checked += 1;
        }
        assert!(checked > 4);
    }
}

#[test]
fn same_seed_same_requests_for_every_family() {
    let groups = WorkloadConfig {
        concurrency: 8,
        system_groups: Some(SystemGroups {
            groups: 150,
            tokens: 6_000,
        }),
        ..WorkloadConfig::default()
    };
    for config in [lockstep(2.0, 800), groups] {
        let run = |seed| {
            let mut w = ChatWorkload::new(config.clone(), assets(), seed, Nanos::ZERO).unwrap();
            let (log, _) = serve(&mut w, Nanos::from_secs(60), |t| t.key);
            log.iter()
                .map(|t| (t.key, t.issued_at, t.prompt.clone(), t.output.clone()))
                .collect::<Vec<_>>()
        };
        let a = run(11);
        assert!(!a.is_empty());
        assert_eq!(a, run(11));
        assert_ne!(a, run(12));
    }
}

#[test]
fn bad_family_settings_are_named() {
    let bad = |config: WorkloadConfig, needle: &str| {
        let err = ChatWorkload::new(config, assets(), 1, Nanos::ZERO)
            .unwrap_err()
            .to_string();
        assert!(err.contains(needle), "{err} should name {needle}");
    };
    bad(
        WorkloadConfig {
            lockstep: Some(LockStep {
                new_tokens_ratio: f64::NAN,
            }),
            ..WorkloadConfig::default()
        },
        "lockstep.new_tokens_ratio",
    );
    bad(
        WorkloadConfig {
            system_groups: Some(SystemGroups {
                groups: 0,
                tokens: 10,
            }),
            ..WorkloadConfig::default()
        },
        "system_groups.groups",
    );
    bad(
        WorkloadConfig {
            system_groups: Some(SystemGroups {
                groups: 2,
                tokens: 10_000_000,
            }),
            ..WorkloadConfig::default()
        },
        "system_groups.tokens",
    );
}
