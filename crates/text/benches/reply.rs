//! Reply generation speed (the simulator draws millions of replies), and the encode cost the
//! workload pays per question. `cargo bench -p text --bench reply`.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::hint::black_box;
use text::{
    Assets, ChatMessage, ChatTokens, Corpus, KeyTerms, QuestionGenerator, ReplyConfig,
    ReplyGenerator, Tokenizer,
};

fn bench(c: &mut Criterion) {
    let tokenizer = Tokenizer::builtin();
    let corpus = Corpus::builtin();
    let terms = KeyTerms::extract(&corpus);
    let replies = ReplyGenerator::new(&tokenizer, &corpus, &terms, &ReplyConfig::default())
        .expect("reply generator");
    let questions = QuestionGenerator::new(terms.clone(), &tokenizer);

    let mut group = c.benchmark_group("reply");
    for len in [64usize, 830, 4_096] {
        group.throughput(Throughput::Elements(len as u64));
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let mut passage = 0;
        group.bench_function(format!("generate_{len}_tokens"), |b| {
            b.iter(|| {
                passage = (passage + 1) % 10;
                black_box(replies.generate(passage, len, &mut rng).expect("reply"))
            })
        });
    }
    group.finish();

    let mut group = c.benchmark_group("text");
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    let format = ChatTokens::new(tokenizer.clone())
        .expect("format")
        .format()
        .clone();
    group.bench_function("follow_up_text_then_encode", |b| {
        b.iter(|| {
            let q = questions.follow_up(3, Some(2), &mut rng);
            let mut ids = Vec::with_capacity(64);
            format.push_message(&tokenizer, &ChatMessage::user(q), &mut ids);
            black_box(ids)
        })
    });
    group.bench_function("follow_up_pretokenized", |b| {
        b.iter(|| {
            let plan = questions.plan_follow_up(3, Some(2), &mut rng);
            let mut ids = Vec::with_capacity(64);
            questions.push_tokens(&plan, &mut ids);
            black_box(ids)
        })
    });
    let passage = corpus.passages()[0].markdown().to_owned();
    group.throughput(Throughput::Bytes(passage.len() as u64));
    group.bench_function("encode_passage", |b| {
        b.iter(|| black_box(tokenizer.encode(&passage)))
    });
    group.finish();

    // Everything a process builds once: the reply and question generators, the key terms and
    // the passages' system-message tokens.
    c.bench_function("assets_build", |b| {
        b.iter(|| {
            black_box(
                Assets::new(tokenizer.clone(), corpus.clone(), &ReplyConfig::default())
                    .expect("assets"),
            )
        })
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20);
    targets = bench
}
criterion_main!(benches);
