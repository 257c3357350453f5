//! Workloads B and C's corpora: bucket lengths measured with the real tokenizer, no shared
//! leading block between documents, the prompt bank's shape, token form = rendered text.

use text::tasks::{DocumentCorpus, LengthBucket, ReasoningBank, SUMMARY_INSTRUCTION};
use text::{Assets, ChatMessage, ChatTemplate, Tokenizer};

const BLOCK: usize = 32;

#[test]
fn documents_fill_three_buckets_near_4k_10k_and_18k_tokens() {
    let tokenizer = Tokenizer::builtin();
    let corpus = DocumentCorpus::builtin(&tokenizer).unwrap();
    assert_eq!(corpus.len(), 3 * DocumentCorpus::PER_BUCKET);
    for bucket in LengthBucket::ALL {
        let lengths: Vec<usize> = corpus
            .documents()
            .iter()
            .filter(|d| d.bucket == bucket)
            .map(|d| tokenizer.encode_ordinary(&d.markdown).len())
            .collect();
        assert_eq!(lengths.len(), DocumentCorpus::PER_BUCKET);
        let mean = lengths.iter().sum::<usize>() as f64 / lengths.len() as f64;
        let target = bucket.target_tokens() as f64;
        eprintln!("{}: mean {mean:.0} tokens, {lengths:?}", bucket.name());
        assert!(
            (mean - target).abs() <= 0.05 * target,
            "{} bucket: mean {mean} tokens, target {target}",
            bucket.name()
        );
        for l in &lengths {
            assert!(
                (*l as f64 - target).abs() <= 0.12 * target,
                "{} bucket: {l} tokens",
                bucket.name()
            );
        }
    }
}

#[test]
fn no_two_documents_share_a_leading_block() {
    let tokenizer = Tokenizer::builtin();
    let corpus = DocumentCorpus::builtin(&tokenizer).unwrap();
    let ids: Vec<Vec<u32>> = corpus
        .documents()
        .iter()
        .map(|d| tokenizer.encode_ordinary(&d.markdown))
        .collect();
    for (i, a) in ids.iter().enumerate() {
        for b in &ids[i + 1..] {
            let common = a.iter().zip(b).take_while(|(x, y)| x == y).count();
            assert!(common < 8, "two documents share {common} leading tokens");
        }
    }
    // In whole prompts, only the template and the instruction are shared: the first block
    // that reaches into the document differs.
    let assets = Assets::builtin().unwrap();
    let tasks = assets.tasks().unwrap();
    let shared = tokenizer
        .encode(
            &ChatTemplate::llama3()
                .render(&[ChatMessage::system(SUMMARY_INSTRUCTION)], false)
                .unwrap(),
        )
        .len();
    let first_prompt = tasks.document_prompt(0).unwrap();
    for i in 1..corpus.len() {
        let other = tasks.document_prompt(i).unwrap();
        let common = first_prompt
            .iter()
            .zip(other.iter())
            .take_while(|(x, y)| x == y)
            .count();
        assert!(
            common / BLOCK <= shared.div_ceil(BLOCK),
            "documents 0 and {i} share {common} tokens"
        );
    }
}

#[test]
fn documents_are_the_same_every_time() {
    let tokenizer = Tokenizer::builtin();
    assert_eq!(
        DocumentCorpus::builtin(&tokenizer).unwrap(),
        DocumentCorpus::builtin(&tokenizer).unwrap()
    );
}

#[test]
fn the_reasoning_bank_has_50_to_100_prompts_with_long_expected_answers() {
    let bank = ReasoningBank::builtin().unwrap();
    assert!((50..=100).contains(&bank.len()), "{} prompts", bank.len());
    let tokenizer = Tokenizer::builtin();
    let mut categories = std::collections::BTreeSet::new();
    for p in bank.prompts() {
        assert!(
            (1_000..=4_000).contains(&p.expected_output_length),
            "{}",
            p.id
        );
        let n = tokenizer.encode_ordinary(&p.prompt).len();
        assert!((10..=80).contains(&n), "{}: {n} prompt tokens", p.id);
        categories.insert(p.category.clone());
    }
    assert!(categories.len() >= 5);
    assert!(ReasoningBank::from_jsonl("{\"id\":\"x\"}").is_err());
    assert!(
        ReasoningBank::from_jsonl(
            "{\"id\":\"x\",\"category\":\"c\",\"expected_output_length\":0,\"prompt\":\"p\"}"
        )
        .is_err()
    );
}

#[test]
fn task_prompts_in_tokens_are_the_rendered_text_tokenized() {
    let assets = Assets::builtin().unwrap();
    let tasks = assets.tasks().unwrap();
    let template = ChatTemplate::llama3();
    for i in [0, 15, 29] {
        let text = template
            .render(
                &[
                    ChatMessage::system(SUMMARY_INSTRUCTION),
                    ChatMessage::user(&**tasks.document_text(i).unwrap()),
                ],
                true,
            )
            .unwrap();
        assert_eq!(
            assets.tokenizer().encode(&text),
            tasks.document_prompt(i).unwrap().to_vec()
        );
    }
    // With a request line: each request's own prompt, still the rendered text tokenized.
    for (i, request) in [(0, 0), (7, 12_345), (29, u64::MAX)] {
        let user = format!(
            "{}{}",
            text::TaskAssets::request_line(request),
            tasks.document_text(i).unwrap()
        );
        let text = template
            .render(
                &[
                    ChatMessage::system(SUMMARY_INSTRUCTION),
                    ChatMessage::user(user),
                ],
                true,
            )
            .unwrap();
        assert_eq!(
            assets.tokenizer().encode(&text),
            tasks
                .document_prompt_for(i, request, assets.tokenizer())
                .unwrap()
                .to_vec()
        );
    }
    let text = template
        .render(
            &[
                ChatMessage::system(text::tasks::REASONING_INSTRUCTION),
                ChatMessage::user(&**tasks.reasoning_text(3).unwrap()),
            ],
            true,
        )
        .unwrap();
    assert_eq!(
        assets.tokenizer().encode(&text),
        tasks.reasoning_prompt(3).unwrap().to_vec()
    );
}
