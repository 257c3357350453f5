//! The chat workload driven by a small event loop standing in for a cluster: every turn is
//! served after a latency that grows with its output, like a real engine's.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};
use std::sync::Arc;

use nanotime::Nanos;
use proptest::prelude::*;
use text::{ChatMessage, ChatTemplate};
use workload::{Assets, ChatWorkload, Distribution, Turn, TurnKey, TurnRange, WorkloadConfig};

fn assets() -> Arc<Assets> {
    Assets::builtin().unwrap()
}

/// Serves each turn after `base + per_token × output` and records everything.
struct Driver {
    workload: ChatWorkload,
    in_flight: BinaryHeap<Reverse<(Nanos, TurnKey)>>,
    now: Nanos,
    base: Nanos,
    per_token: Nanos,
    /// Every request, in issue order.
    log: Vec<Turn>,
    /// When each turn finished.
    finished_at: BTreeMap<TurnKey, Nanos>,
    /// Fail every n-th turn (0 = never).
    fail_every: u64,
    served: u64,
}

impl Driver {
    fn new(config: WorkloadConfig, seed: u64) -> Driver {
        Driver {
            workload: ChatWorkload::new(config, assets(), seed, Nanos::ZERO).unwrap(),
            in_flight: BinaryHeap::new(),
            now: Nanos::ZERO,
            base: Nanos::from_secs(2),
            per_token: Nanos::from_millis(30),
            log: Vec::new(),
            finished_at: BTreeMap::new(),
            fail_every: 0,
            served: 0,
        }
    }

    fn drain(&mut self) {
        while let Some(r) = self.workload.poll_request() {
            assert!(r.issued_at <= self.now, "issued in the future");
            let done = self.now + self.base + self.per_token.saturating_mul(r.output.len() as u64);
            self.in_flight.push(Reverse((done, r.key)));
            self.log.push(r);
        }
    }

    /// Runs until `end`; calls `each` after every event.
    fn run_until(&mut self, end: Nanos, mut each: impl FnMut(&Driver)) {
        self.drain();
        loop {
            let next_finish = self.in_flight.peek().map(|Reverse((t, _))| *t);
            let next_timer = self.workload.poll_timeout();
            let next = match (next_finish, next_timer) {
                (Some(a), Some(b)) => a.min(b),
                (Some(a), None) | (None, Some(a)) => a,
                (None, None) => break,
            };
            if next > end {
                break;
            }
            assert!(next >= self.now, "time went backwards");
            self.now = next;
            if next_finish == Some(next) {
                let Reverse((_, id)) = self.in_flight.pop().unwrap();
                self.served += 1;
                if self.fail_every > 0 && self.served % self.fail_every == 0 {
                    self.workload.on_turn_failed(id, self.now);
                } else {
                    self.finished_at.insert(id, self.now);
                    self.workload.on_turn_finished(id, self.now);
                }
            } else {
                self.workload.handle_timeout(self.now);
            }
            self.drain();
            each(self);
        }
        self.now = end;
    }
}

fn small_config(concurrency: u32) -> WorkloadConfig {
    WorkloadConfig {
        concurrency,
        ramp_s: 10.0,
        ..WorkloadConfig::default()
    }
}

#[test]
fn statistics_match_the_config() {
    // The calibrated default think time is 0 (seed 002); a uniform one checks the mechanism.
    let mut config = small_config(40);
    config.think_time_s = Distribution::Uniform { min: 0.5, max: 1.5 };
    let mut d = Driver::new(config.clone(), 1);
    d.run_until(Nanos::from_secs(4 * 3600), |_| {});
    // Group turns by conversation.
    let mut by_conversation: BTreeMap<u64, Vec<&Turn>> = BTreeMap::new();
    for r in &d.log {
        by_conversation
            .entry(r.key.conversation)
            .or_default()
            .push(r);
    }
    let stats = d.workload.stats();
    assert!(stats.conversations_completed > 1_500, "{stats:?}");
    // Turns per completed conversation: uniform 3..=5.
    let mut turn_counts = [0u64; 6];
    for turns in by_conversation.values() {
        let last = turns.last().unwrap().key;
        if d.finished_at.contains_key(&last) && turns.len() as u32 >= config.turns.min {
            // Complete iff it reached its last turn: the workload closed it.
            if !d
                .workload
                .conversations()
                .any(|c| c.id == last.conversation)
            {
                turn_counts[turns.len()] += 1;
            }
        }
    }
    let complete: u64 = turn_counts.iter().sum();
    assert_eq!(turn_counts[0] + turn_counts[1] + turn_counts[2], 0);
    for (t, &count) in turn_counts.iter().enumerate().skip(3) {
        let share = count as f64 / complete as f64;
        assert!((share - 1.0 / 3.0).abs() < 0.04, "{t} turns: {share}");
    }
    // Output tokens: mean 845 within 1.5%, every reply within the distribution's bounds.
    let outputs: Vec<usize> = d.log.iter().map(|r| r.output.len()).collect();
    let mean = outputs.iter().sum::<usize>() as f64 / outputs.len() as f64;
    assert!((mean - 845.0).abs() < 845.0 * 0.015, "mean output {mean}");
    assert!(outputs.iter().all(|&n| (300..=1_024).contains(&n)));
    let sd = (outputs
        .iter()
        .map(|&n| (n as f64 - mean).powi(2))
        .sum::<f64>()
        / outputs.len() as f64)
        .sqrt();
    assert!((142.0..174.0).contains(&sd), "output sd {sd}");
    // Think time: the gap between a reply's end and the next question, uniform 0.5–1.5 s.
    let mut gaps = Vec::new();
    for r in &d.log {
        if r.key.turn > 0 {
            let previous = TurnKey {
                conversation: r.key.conversation,
                turn: r.key.turn - 1,
            };
            gaps.push((r.issued_at - d.finished_at[&previous]).as_secs_f64());
        }
    }
    let mean_gap = gaps.iter().sum::<f64>() / gaps.len() as f64;
    assert!((mean_gap - 1.0).abs() < 0.02, "mean think time {mean_gap}");
    assert!(gaps.iter().all(|g| (0.5..=1.5).contains(g)));
    // Turn 1 prompts carry the passage: 3,500–4,000 tokens as in the seed.
    for r in d.log.iter().filter(|r| r.key.turn == 0) {
        assert!(
            (3_500..=4_000).contains(&r.prompt.len()),
            "{}",
            r.prompt.len()
        );
    }
    // Turn 5 prompts reach the seed's 7,000+ tokens.
    let late: Vec<usize> = d
        .log
        .iter()
        .filter(|r| r.key.turn == 4)
        .map(|r| r.prompt.len())
        .collect();
    let late_mean = late.iter().sum::<usize>() as f64 / late.len() as f64;
    assert!(
        (6_800.0..7_600.0).contains(&late_mean),
        "turn 5 mean {late_mean}"
    );
}

#[test]
fn concurrency_stays_constant_and_finished_conversations_are_replaced_at_once() {
    let mut d = Driver::new(small_config(60), 2);
    let ramp_end = Nanos::from_secs(10);
    d.run_until(Nanos::from_secs(1_800), |d| {
        assert_eq!(d.workload.active_conversations(), 60);
        if d.now > ramp_end {
            // Every open conversation is either in flight or thinking.
            let in_flight = d.workload.conversations().filter(|c| c.in_flight).count();
            assert_eq!(in_flight, d.in_flight.len());
        }
    });
    // A replacement's first turn is issued at the instant its predecessor's last turn ended.
    let stats = d.workload.stats();
    assert!(stats.conversations_completed > 200);
    assert_eq!(
        stats.conversations_started,
        60 + stats.conversations_completed
    );
    let last_turn_ends: Vec<Nanos> = d
        .finished_at
        .iter()
        .filter(|(id, _)| {
            !d.log
                .iter()
                .any(|r| r.key.conversation == id.conversation && r.key.turn == id.turn + 1)
        })
        .map(|(_, t)| *t)
        .collect();
    let first_turns: Vec<Nanos> = d
        .log
        .iter()
        .filter(|r| r.key.turn == 0 && r.issued_at > ramp_end)
        .map(|r| r.issued_at)
        .collect();
    for t in &first_turns {
        assert!(
            last_turn_ends.contains(t),
            "a new conversation at {t} replaced none"
        );
    }
}

#[test]
fn the_ramp_spreads_first_turns_evenly() {
    let d = {
        let mut d = Driver::new(small_config(50), 3);
        d.run_until(Nanos::from_secs(10), |_| {});
        d
    };
    let starts: Vec<Nanos> = d.log.iter().map(|r| r.issued_at).take(50).collect();
    for (i, t) in starts.iter().enumerate() {
        assert_eq!(*t, Nanos::from_millis(200 * i as u64));
    }
}

#[test]
fn same_seed_same_request_stream_and_scripts_do_not_depend_on_timing() {
    let run = |seed: u64, per_token_ms: u64| {
        let mut d = Driver::new(small_config(30), seed);
        d.per_token = Nanos::from_millis(per_token_ms);
        d.run_until(Nanos::from_secs(900), |_| {});
        d.log
    };
    let digest = |log: &[Turn]| -> Vec<(TurnKey, Vec<u32>, Vec<u32>, Nanos)> {
        log.iter()
            .map(|r| (r.key, r.prompt.to_vec(), r.output.to_vec(), r.issued_at))
            .collect()
    };
    let a = run(11, 30);
    assert_eq!(digest(&a), digest(&run(11, 30)));
    assert_ne!(digest(&a), digest(&run(12, 30)));
    // A slower cluster sees fewer turns, but each (conversation, turn) it sees is identical.
    let slow = run(11, 45);
    let by_id: BTreeMap<TurnKey, &Turn> = a.iter().map(|r| (r.key, r)).collect();
    let mut compared = 0;
    for r in &slow {
        if let Some(fast) = by_id.get(&r.key) {
            assert_eq!(r.prompt, fast.prompt);
            assert_eq!(r.output, fast.output);
            compared += 1;
        }
    }
    assert!(compared > 100);
}

#[test]
fn each_prompt_is_the_previous_prompt_reply_and_a_new_question_as_the_template_renders() {
    let assets = assets();
    let tokenizer = assets.tokenizer();
    let format = assets.format();
    let template = ChatTemplate::llama3();
    let mut d = Driver::new(small_config(8), 4);
    let mut checked = 0;
    d.run_until(Nanos::from_secs(600), |d| {
        // The latest request of each open conversation equals render + encode of its messages.
        for info in d.workload.conversations() {
            if !info.in_flight || checked > 60 {
                continue;
            }
            let r = d
                .log
                .iter()
                .rev()
                .find(|r| r.key.conversation == info.id)
                .unwrap();
            let messages = d.workload.messages(info.id).unwrap();
            let history = &messages[..messages.len() - 1]; // drop the planned reply
            let full = tokenizer.encode(&template.render(history, true).unwrap());
            assert_eq!(&*r.prompt, full.as_slice());
            assert_eq!(
                messages.last().unwrap().content,
                tokenizer.decode(&r.output).unwrap()
            );
            checked += 1;
        }
    });
    assert!(checked > 30);
    let by_id: BTreeMap<TurnKey, &Turn> = d.log.iter().map(|r| (r.key, r)).collect();
    let mut pairs = 0;
    for r in &d.log {
        if r.key.turn == 0 {
            continue;
        }
        let previous = by_id[&TurnKey {
            conversation: r.key.conversation,
            turn: r.key.turn - 1,
        }];
        let p = previous.prompt.len();
        let o = previous.output.len();
        assert_eq!(&r.prompt[..p], &*previous.prompt);
        assert_eq!(&r.prompt[p..p + o], &*previous.output);
        assert_eq!(r.prompt[p + o], format.eot());
        // Then exactly one user message and the assistant header.
        let rest = &r.prompt[p + o + 1..];
        let generation = format.generation_prompt();
        assert!(rest.ends_with(generation));
        let question = &rest[..rest.len() - generation.len()];
        let parsed = format.parse(tokenizer, question);
        assert_eq!(parsed.len(), 1);
        assert_eq!(parsed[0].role, "user");
        let mut expected = Vec::new();
        format.push_message(
            tokenizer,
            &ChatMessage::user(parsed[0].content.clone()),
            &mut expected,
        );
        assert_eq!(question, expected.as_slice());
        let question_tokens = question.len();
        assert!((20..=75).contains(&question_tokens), "{question_tokens}");
        pairs += 1;
    }
    assert!(pairs > 50);
}

#[test]
fn conversations_on_one_passage_share_its_whole_system_message() {
    let assets = assets();
    let mut d = Driver::new(small_config(40), 5);
    d.run_until(Nanos::from_secs(20), |_| {});
    let mut by_passage: BTreeMap<usize, Vec<Arc<[u32]>>> = BTreeMap::new();
    let infos: BTreeMap<u64, usize> = d
        .workload
        .conversations()
        .map(|c| (c.id, c.passage))
        .collect();
    for r in d.log.iter().filter(|r| r.key.turn == 0) {
        by_passage
            .entry(infos[&r.key.conversation])
            .or_default()
            .push(r.prompt.clone());
    }
    assert!(
        by_passage.len() >= 8,
        "40 conversations should use most of the 10 passages"
    );
    for (passage, prompts) in by_passage {
        let mut system = vec![assets.format().bos()];
        assets.format().push_message(
            assets.tokenizer(),
            &assets.system_message(workload::DEFAULT_SYSTEM_PROMPT, passage),
            &mut system,
        );
        for p in prompts {
            assert!(p.starts_with(&system));
        }
    }
}

#[test]
fn set_concurrency_grows_at_once_and_shrinks_as_conversations_finish() {
    let mut d = Driver::new(small_config(20), 6);
    d.run_until(Nanos::from_secs(120), |_| {});
    d.workload.set_concurrency(35, d.now);
    assert_eq!(d.workload.active_conversations(), 35);
    let before = d.log.len();
    d.drain();
    assert_eq!(d.log.len(), before + 15, "15 new first turns at once");
    d.workload.set_concurrency(10, d.now);
    // Every open conversation has started, so none closes early.
    assert_eq!(d.workload.active_conversations(), 35);
    let mut minimum = 35;
    d.run_until(Nanos::from_secs(2_000), |d| {
        let open = d.workload.active_conversations();
        assert!(open <= minimum, "grew back while shrinking");
        minimum = open;
    });
    assert_eq!(d.workload.active_conversations(), 10);

    // During the ramp, shrinking closes conversations that have not started yet at once.
    let mut d = Driver::new(small_config(50), 7);
    d.run_until(Nanos::from_secs(1), |_| {});
    d.workload.set_concurrency(20, d.now);
    assert_eq!(d.workload.active_conversations(), 20);
    d.run_until(Nanos::from_secs(60), |d| {
        assert_eq!(d.workload.active_conversations(), 20);
    });
    assert_eq!(
        d.workload.stats().conversations_started,
        50 + d.workload.stats().conversations_completed
    );
}

#[test]
fn failed_turns_abandon_the_conversation_and_replace_it() {
    let mut d = Driver::new(small_config(30), 8);
    d.fail_every = 7;
    d.run_until(Nanos::from_secs(1_200), |d| {
        assert_eq!(d.workload.active_conversations(), 30);
    });
    let stats = d.workload.stats();
    assert!(stats.conversations_failed > 50, "{stats:?}");
    assert_eq!(
        stats.conversations_started,
        30 + stats.conversations_completed + stats.conversations_failed
    );
    // Stale reports are ignored.
    let first = d.log[0].key;
    let open = d.workload.active_conversations();
    d.workload.on_turn_finished(first, d.now);
    d.workload.on_turn_failed(first, d.now);
    assert_eq!(d.workload.active_conversations(), open);
}

#[test]
fn bad_configs_are_rejected_with_the_setting_named() {
    let check = |config: WorkloadConfig, needle: &str| {
        let err = ChatWorkload::new(config, assets(), 0, Nanos::ZERO).unwrap_err();
        assert!(err.to_string().contains(needle), "{err}");
    };
    check(
        WorkloadConfig {
            passages: 11,
            ..WorkloadConfig::default()
        },
        "passages",
    );
    check(
        WorkloadConfig {
            output_tokens: Distribution::Constant { value: 1e7 },
            ..WorkloadConfig::default()
        },
        "output_tokens",
    );
    check(
        WorkloadConfig {
            turns: TurnRange { min: 0, max: 2 },
            ..WorkloadConfig::default()
        },
        "turns",
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Random slider moves and failures: growing reaches the target at once, shrinking never
    /// closes a started conversation early and never grows back, and every conversation
    /// started is accounted for.
    #[test]
    fn random_slider_moves_keep_the_accounting(
        moves in prop::collection::vec((0u32..80, 1u64..300), 1..6),
        fail_every in 0u64..9,
        seed in any::<u64>(),
    ) {
        let mut d = Driver::new(small_config(25), seed);
        d.fail_every = fail_every;
        for (target, seconds) in moves {
            let open_before = d.workload.active_conversations();
            d.workload.set_concurrency(target, d.now);
            let open = d.workload.active_conversations();
            if target >= open_before {
                prop_assert_eq!(open, target);
            } else {
                prop_assert!((target..=open_before).contains(&open));
            }
            let mut ceiling = open;
            let end = d.now + Nanos::from_secs(seconds);
            d.run_until(end, |d| {
                let now_open = d.workload.active_conversations();
                assert!(now_open <= ceiling, "grew past {ceiling}");
                assert!(now_open >= target, "fell below the target {target}");
                ceiling = now_open.max(target);
            });
            let s = d.workload.stats();
            prop_assert_eq!(
                s.conversations_started,
                s.conversations_completed
                    + s.conversations_failed
                    + s.conversations_closed
                    + s.issue_errors
                    + u64::from(d.workload.active_conversations())
            );
        }
    }
}

#[test]
fn workload_and_assets_can_move_between_threads() {
    fn send<T: Send>() {}
    fn send_sync<T: Send + Sync>() {}
    send::<ChatWorkload>();
    send_sync::<Assets>();
    send_sync::<Turn>();
}
