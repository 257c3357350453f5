//! One content source, two renderings: conversation *k* of a seed has the same passage,
//! questions and planned answer lengths in token form (the simulator) and in text form (the
//! load generator), and the text form rendered with the chat template and tokenized, with the
//! planned replies as the answers, is exactly the token form's prompt.

use std::collections::BTreeMap;

use nanotime::Nanos;
use text::ChatMessage;
use workload::{Assets, ChatWorkload, Content, TextContent, TurnKey, WorkloadConfig};

fn config() -> WorkloadConfig {
    WorkloadConfig {
        concurrency: 12,
        ramp_s: 0.0,
        ..WorkloadConfig::default()
    }
}

/// Runs a workload until `turns` turns were issued, finishing every turn 10 s after it was
/// issued; returns each turn and the passage of its conversation.
fn run<C: Content>(
    mut workload: ChatWorkload<C>,
    turns: usize,
    key: impl Fn(&C::Turn) -> TurnKey,
) -> BTreeMap<TurnKey, (usize, C::Turn)> {
    let mut issued = BTreeMap::new();
    let mut now = Nanos::ZERO;
    while issued.len() < turns {
        let mut batch = Vec::new();
        while let Some(turn) = workload.poll_request() {
            let k = key(&turn);
            let passage = workload.conversation(k.conversation).unwrap().passage;
            batch.push(k);
            issued.insert(k, (passage, turn));
        }
        now += Nanos::from_secs(10);
        for k in batch {
            workload.on_turn_finished(k, now);
        }
        workload.handle_timeout(now);
    }
    issued
}

#[test]
fn conversation_k_is_the_same_in_tokens_and_in_text() {
    let assets = Assets::builtin().unwrap();
    let seed = 2;
    let tokens = run(
        ChatWorkload::new(config(), assets.clone(), seed, Nanos::ZERO).unwrap(),
        120,
        |t| t.key,
    );
    let text = run(
        ChatWorkload::<TextContent>::with_content(config(), assets.clone(), seed, Nanos::ZERO)
            .unwrap(),
        120,
        |t| t.key,
    );
    let tokenizer = assets.tokenizer();
    let template = assets.template();
    let mut compared = 0;
    for (key, (passage, token_turn)) in &tokens {
        let Some((text_passage, text_turn)) = text.get(key) else {
            continue;
        };
        assert_eq!(passage, text_passage, "{key:?}: same passage");
        assert_eq!(
            text_turn.planned_reply, token_turn.output,
            "{key:?}: same planned answer (and so the same length)"
        );
        // The text the load generator sends: the system message, the earlier questions with
        // the answers (here the planned ones, as the simulated engine gives), the question.
        let mut messages = vec![ChatMessage::system(&*text_turn.system)];
        for turn in 0..key.turn {
            let earlier = &text[&TurnKey {
                conversation: key.conversation,
                turn,
            }]
                .1;
            messages.push(ChatMessage::user(&*earlier.question));
            messages.push(ChatMessage::assistant(
                tokenizer.decode(&earlier.planned_reply).unwrap(),
            ));
        }
        messages.push(ChatMessage::user(&*text_turn.question));
        let rendered = template.render(&messages, true).unwrap();
        assert_eq!(
            tokenizer.encode(&rendered),
            token_turn.prompt.to_vec(),
            "{key:?}: the text form tokenized is the token form"
        );
        compared += 1;
    }
    assert!(compared >= 100, "{compared}");
    assert!(
        tokens.keys().any(|k| k.turn >= 3),
        "later turns (history with several answers) are compared"
    );
}

#[test]
fn the_text_form_keeps_the_schedule_of_the_token_form() {
    let assets = Assets::builtin().unwrap();
    let mut tokens = ChatWorkload::new(config(), assets.clone(), 9, Nanos::ZERO).unwrap();
    let mut text =
        ChatWorkload::<TextContent>::with_content(config(), assets, 9, Nanos::ZERO).unwrap();
    let a: Vec<(TurnKey, Nanos)> = std::iter::from_fn(|| tokens.poll_request())
        .map(|t| (t.key, t.issued_at))
        .collect();
    let b: Vec<(TurnKey, Nanos)> = std::iter::from_fn(|| text.poll_request())
        .map(|t| (t.key, t.issued_at))
        .collect();
    assert_eq!(a.len(), 12);
    assert_eq!(a, b);
    let info = |w: &dyn Fn(u64) -> Option<workload::ConversationInfo>| {
        (0..12u64)
            .map(|k| w(k).map(|c| (c.passage, c.turns)))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        info(&|k| tokens.conversation(k)),
        info(&|k| text.conversation(k))
    );
}
