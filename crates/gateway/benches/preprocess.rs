//! Per-request CPU of preprocessing: chat template + tokenization + block hashing, for a
//! short prompt and for a seed-sized (~3,500-token) conversation.

use criterion::{Criterion, criterion_group, criterion_main};
use gateway::preprocess::Preprocessor;
use text::ChatMessage;

/// `n` words of the shipped corpus, a different excerpt per `salt`.
fn words(n: usize, salt: usize) -> String {
    text::Corpus::builtin().excerpt(salt * 997, n)
}

fn bench(c: &mut Criterion) {
    let pre = Preprocessor::builtin();
    let hasher = kv_index::BlockHasher::new(32).unwrap();
    let short = vec![ChatMessage::user(words(300, 1))];
    let long = vec![
        ChatMessage::system(words(2800, 2)),
        ChatMessage::user(words(40, 3)),
        ChatMessage::assistant(words(600, 4)),
        ChatMessage::user(words(30, 5)),
    ];
    for (name, messages) in [("chat_300_words", &short), ("chat_3500_words", &long)] {
        let tokens = pre.chat(messages, false).unwrap().tokens;
        eprintln!("{name}: {} tokens", tokens.len());
        // Every message new (a first turn): all of it is tokenized.
        let mut n = 0u64;
        c.bench_function(&format!("preprocess/{name}/new"), |b| {
            b.iter(|| {
                n += 1;
                let fresh: Vec<ChatMessage> = messages
                    .iter()
                    .map(|m| ChatMessage::new(m.role.clone(), format!("{n} {}", m.content)))
                    .collect();
                let tokens = pre.chat(&fresh, false).unwrap().tokens;
                router::RoutingKey::new(&hasher, &tokens)
            })
        });
        // The same history again (a later turn resends it): messages come from the cache.
        c.bench_function(&format!("preprocess/{name}/history"), |b| {
            b.iter(|| {
                let tokens = pre.chat(messages, false).unwrap().tokens;
                router::RoutingKey::new(&hasher, &tokens)
            })
        });
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
