//! Seed 004's workloads B and C, the mix and the open loop: class shares over many sessions,
//! B's and C's prompts and answer lengths, the same requests in tokens and in text, Poisson
//! arrivals at the asked rate, determinism, and the bound on open sessions.

use std::collections::BTreeMap;

use nanotime::Nanos;
use text::{ChatMessage, ChatTemplate};
use workload::{Arrivals, ChatWorkload, Class, Mix, TextContent, Turn, TurnKey, WorkloadConfig};
use workload::{Assets, Distribution};

fn mixed(concurrency: u32, mix: &str) -> WorkloadConfig {
    WorkloadConfig {
        concurrency,
        ramp_s: 0.0,
        mix: mix.parse().unwrap(),
        ..WorkloadConfig::default()
    }
}

/// Closed loop: issues and finishes every turn 1 s later until `sessions` sessions started;
/// returns every turn with its session's class.
fn closed_loop(config: WorkloadConfig, seed: u64, sessions: u64) -> Vec<(Class, Turn)> {
    let assets = Assets::builtin().unwrap();
    let mut w = ChatWorkload::new(config, assets, seed, Nanos::ZERO).unwrap();
    let mut out = Vec::new();
    let mut now = Nanos::ZERO;
    while w.stats().conversations_started < sessions {
        w.handle_timeout(now);
        let mut batch = Vec::new();
        while let Some(turn) = w.poll_request() {
            let class = w.conversation(turn.key.conversation).unwrap().class;
            batch.push(turn.key);
            out.push((class, turn));
        }
        now += Nanos::from_secs(1);
        for k in batch {
            w.on_turn_finished(k, now);
        }
    }
    out
}

#[test]
fn sessions_follow_the_mix_and_b_and_c_are_single_turn() {
    let turns = closed_loop(mixed(50, "A=40,B=30,C=30"), 3, 4_000);
    let mut sessions: BTreeMap<u64, (Class, u32)> = BTreeMap::new();
    for (class, t) in &turns {
        let e = sessions.entry(t.key.conversation).or_insert((*class, 0));
        e.1 += 1;
    }
    let n = sessions.len() as f64;
    for (class, want) in [(Class::A, 0.4), (Class::B, 0.3), (Class::C, 0.3)] {
        let share = sessions.values().filter(|(c, _)| *c == class).count() as f64 / n;
        assert!(
            (share - want).abs() < 0.03,
            "{class}: {share} of {n} sessions"
        );
    }
    // B and C: one turn each; A: the seed's 3–5.
    for (class, count) in sessions.values() {
        match class {
            Class::A => assert!(*count <= 5),
            _ => assert_eq!(*count, 1),
        }
    }
}

#[test]
fn b_sends_a_whole_document_for_a_short_answer_and_c_a_short_prompt_for_a_long_one() {
    let assets = Assets::builtin().unwrap();
    let tasks = assets.tasks().unwrap();
    let turns = closed_loop(mixed(20, "B=1,C=1"), 5, 400);
    let (mut b, mut c) = (0, 0);
    for (class, t) in &turns {
        match class {
            Class::B => {
                b += 1;
                assert!(
                    (3_500..=19_000).contains(&t.prompt.len()),
                    "{}",
                    t.prompt.len()
                );
                assert!((100..=300).contains(&t.output.len()), "{}", t.output.len());
                // The document, after this request's own first line.
                let request = t.key.conversation;
                assert!((0..tasks.documents().len()).any(|i| {
                    tasks
                        .document_prompt_for(i, request, assets.tokenizer())
                        .unwrap()[..]
                        == t.prompt[..]
                }));
            }
            Class::C => {
                c += 1;
                assert!(t.prompt.len() < 150, "{}", t.prompt.len());
                let i = (0..tasks.bank().len())
                    .find(|&i| tasks.reasoning_prompt(i).unwrap()[..] == t.prompt[..])
                    .expect("a bank prompt");
                let expected = f64::from(tasks.bank().prompts()[i].expected_output_length);
                let n = t.output.len() as f64;
                assert!((0.8 * expected - 1.0..=1.2 * expected + 1.0).contains(&n));
            }
            Class::A => panic!("no chat in this mix"),
        }
    }
    assert!(b > 150 && c > 150, "{b} B, {c} C");
}

#[test]
fn b_and_c_in_text_are_their_tokens_rendered() {
    let assets = Assets::builtin().unwrap();
    let config = mixed(30, "A=20,B=40,C=40");
    let mut tokens = ChatWorkload::new(config.clone(), assets.clone(), 9, Nanos::ZERO).unwrap();
    let mut text =
        ChatWorkload::<TextContent>::with_content(config, assets.clone(), 9, Nanos::ZERO).unwrap();
    let template = ChatTemplate::llama3();
    let mut seen = [0; 3];
    while let Some(t) = tokens.poll_request() {
        let x = text.poll_request().expect("same sessions");
        assert_eq!(x.key, t.key);
        assert_eq!(x.planned_reply, t.output);
        seen[x.class as usize] += 1;
        if x.class == Class::A {
            continue;
        }
        let rendered = template
            .render(
                &[
                    ChatMessage::system(&*x.system),
                    ChatMessage::user(&*x.question),
                ],
                true,
            )
            .unwrap();
        assert_eq!(assets.tokenizer().encode(&rendered), t.prompt.to_vec());
    }
    assert!(seen.iter().all(|n| *n > 0), "{seen:?}");
}

/// Open loop with turns that never end: the arrival instants of the first `n` sessions.
fn arrivals(config: WorkloadConfig, seed: u64, until: Nanos) -> (Vec<Nanos>, ChatWorkload) {
    let assets = Assets::builtin().unwrap();
    let mut w = ChatWorkload::new(config, assets, seed, Nanos::ZERO).unwrap();
    let mut at = Vec::new();
    while let Some(t) = w.poll_timeout().filter(|t| *t <= until) {
        w.handle_timeout(t);
        while let Some(turn) = w.poll_request() {
            at.push(turn.issued_at);
        }
    }
    (at, w)
}

#[test]
fn the_open_loop_arrives_poisson_at_the_rate() {
    let config = WorkloadConfig {
        rate_rps: Some(5.0),
        max_open: 100_000,
        ..mixed(0, "A=40,B=30,C=30")
    };
    let (at, w) = arrivals(config, 11, Nanos::from_secs(2_000));
    assert_eq!(w.arrivals(), Arrivals::Open { rate_rps: 5.0 });
    let gaps: Vec<f64> = at.windows(2).map(|p| (p[1] - p[0]).as_secs_f64()).collect();
    let n = gaps.len() as f64;
    let mean = gaps.iter().sum::<f64>() / n;
    let var = gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / n;
    // Exponential gaps: mean 1/rate, standard deviation = mean.
    assert!((9_000.0..11_000.0).contains(&n), "{n} arrivals in 2,000 s");
    assert!((mean - 0.2).abs() < 0.01, "mean gap {mean}");
    assert!(
        (var.sqrt() / mean - 1.0).abs() < 0.05,
        "cv {}",
        var.sqrt() / mean
    );
    // Nothing finished, nothing was refused: every arrival is open.
    assert_eq!(w.active_conversations() as usize, at.len());
    assert_eq!(w.stats().arrivals_dropped, 0);
}

#[test]
fn the_open_loop_is_deterministic_and_seeded() {
    let config = WorkloadConfig {
        rate_rps: Some(3.0),
        ..mixed(0, "A=40,B=30,C=30")
    };
    let (a, _) = arrivals(config.clone(), 4, Nanos::from_secs(100));
    let (b, _) = arrivals(config.clone(), 4, Nanos::from_secs(100));
    let (c, _) = arrivals(config, 5, Nanos::from_secs(100));
    assert_eq!(a, b);
    assert_ne!(a, c);
}

#[test]
fn an_arrival_rate_beyond_what_is_served_is_bounded_and_counted() {
    let config = WorkloadConfig {
        rate_rps: Some(50.0),
        max_open: 100,
        ..mixed(0, "A=40,B=30,C=30")
    };
    // No turn ever finishes: after 100 s about 5,000 arrived, 100 are open.
    let (at, w) = arrivals(config, 1, Nanos::from_secs(100));
    assert_eq!(at.len(), 100);
    assert_eq!(w.active_conversations(), 100);
    let dropped = w.stats().arrivals_dropped;
    assert!((4_500..5_500).contains(&dropped), "{dropped} dropped");
}

#[test]
fn open_loop_chat_conversations_keep_their_later_turns() {
    let assets = Assets::builtin().unwrap();
    let config = WorkloadConfig {
        rate_rps: Some(1.0),
        think_time_s: Distribution::Constant { value: 2.0 },
        ..mixed(0, "A=100")
    };
    let mut w = ChatWorkload::new(config, assets, 2, Nanos::ZERO).unwrap();
    let first = w.poll_timeout().unwrap();
    w.handle_timeout(first);
    let turn = w.poll_request().unwrap();
    assert_eq!(turn.key.turn, 0);
    assert_eq!(turn.issued_at, first);
    // The reply ends; the next turn comes after the think time, not with an arrival.
    let done = first + Nanos::from_millis(10);
    w.on_turn_finished(turn.key, done);
    let mut next = None;
    while next.is_none() {
        let t = w.poll_timeout().unwrap();
        w.handle_timeout(t);
        while let Some(x) = w.poll_request() {
            if x.key.conversation == turn.key.conversation {
                next = Some(x);
            }
        }
    }
    let next = next.unwrap();
    assert_eq!(
        next.key,
        TurnKey {
            conversation: turn.key.conversation,
            turn: 1
        }
    );
    assert_eq!(next.issued_at, done + Nanos::from_secs(2));
    assert!(next.prompt.starts_with(&turn.prompt));
}

#[test]
fn switching_between_the_loops() {
    let assets = Assets::builtin().unwrap();
    let mut w = ChatWorkload::new(mixed(4, "A=100"), assets, 1, Nanos::ZERO).unwrap();
    assert_eq!(w.arrivals(), Arrivals::ClosedLoop { concurrency: 4 });
    w.set_rate(Some(2.0), Nanos::ZERO).unwrap();
    // The concurrency slider in the open loop only remembers the target.
    w.set_concurrency(10, Nanos::ZERO);
    assert_eq!(w.active_conversations(), 4);
    assert!(w.set_rate(Some(-1.0), Nanos::ZERO).is_err());
    assert!(w.set_rate(Some(f64::NAN), Nanos::ZERO).is_err());
    w.set_rate(None, Nanos::ZERO).unwrap();
    assert_eq!(w.arrivals(), Arrivals::ClosedLoop { concurrency: 10 });
    assert_eq!(w.active_conversations(), 10);
    w.set_mix(Mix::new(0, 1, 0).unwrap()).unwrap();
    assert_eq!(w.mix(), Mix::new(0, 1, 0).unwrap());
}

#[test]
fn a_chat_only_mix_changes_nothing() {
    let default = closed_loop(
        WorkloadConfig {
            concurrency: 10,
            ramp_s: 0.0,
            ..WorkloadConfig::default()
        },
        8,
        60,
    );
    let chat = closed_loop(mixed(10, "A=7"), 8, 60);
    assert_eq!(default.len(), chat.len());
    for ((_, a), (_, b)) in default.iter().zip(&chat) {
        assert_eq!(
            (a.key, &a.prompt, &a.output, a.issued_at),
            (b.key, &b.prompt, &b.output, b.issued_at)
        );
    }
}

/// Longest common prefix of any two prompts, in tokens.
fn most_shared(prompts: &[&[u32]]) -> usize {
    let mut most = 0;
    for (i, a) in prompts.iter().enumerate() {
        for b in &prompts[i + 1..] {
            most = most.max(a.iter().zip(b.iter()).take_while(|(x, y)| x == y).count());
        }
    }
    most
}

#[test]
fn b_requests_share_only_the_template_and_instruction_unless_documents_repeat() {
    let fresh = closed_loop(mixed(10, "B=1"), 6, 120);
    let prompts: Vec<&[u32]> = fresh.iter().map(|(_, t)| &t.prompt[..]).collect();
    // 120 requests on 30 documents: documents repeat, prompts do not share a 32-token block
    // past the template and the ~60-token instruction.
    assert!(prompts.len() >= 100, "{}", prompts.len());
    let shared = most_shared(&prompts);
    assert!(shared < 96, "{shared} tokens shared");
    // Seed 004's pool as is: a repeated document is a whole-prompt hit.
    let repeated = closed_loop(
        WorkloadConfig {
            repeat_documents: true,
            ..mixed(10, "B=1")
        },
        6,
        120,
    );
    let prompts: Vec<&[u32]> = repeated.iter().map(|(_, t)| &t.prompt[..]).collect();
    assert!(most_shared(&prompts) > 3_000);
}
