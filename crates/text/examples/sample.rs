//! Prints each passage's token count and key terms, and a sample reply and questions:
//! `cargo run -p text --release --example sample`.

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use text::{
    ChatMessage, ChatTokens, Corpus, KeyTerms, QuestionGenerator, ReplyConfig, ReplyGenerator,
    Tokenizer,
};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let tokenizer = Tokenizer::builtin();
    let corpus = Corpus::builtin();
    let terms = KeyTerms::extract(&corpus);
    let replies = ReplyGenerator::new(&tokenizer, &corpus, &terms, &ReplyConfig::default())?;
    let questions = QuestionGenerator::new(terms.clone(), &tokenizer);
    println!("passage  tokens  title / key terms");
    for (i, p) in corpus.passages().iter().enumerate() {
        let tokens = tokenizer.encode(p.markdown()).len();
        let list: Vec<&str> = terms.of(i).iter().map(|t| t.display.as_str()).collect();
        println!(
            "{:>7}  {tokens:>6}  {}\n                 {}",
            i + 1,
            p.title(),
            list.join(", ")
        );
    }
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let passage = 2;
    let mut chat = ChatTokens::new(tokenizer.clone())?;
    chat.push(&ChatMessage::system(corpus.passages()[passage].markdown()));
    let first = questions.first_question(passage, &mut rng);
    println!("\nuser: {first}");
    chat.push(&ChatMessage::user(first));
    for _ in 0..2 {
        chat.push_generation_prompt();
        println!("  (prompt: {} tokens)", chat.len());
        let reply = replies.generate(passage, 120, &mut rng)?;
        println!("\nassistant: {}", tokenizer.decode(&reply.ids)?);
        chat.push_assistant_ids(&reply.ids);
        let q = questions.follow_up(passage, reply.topic, &mut rng);
        println!("\nuser: {q}");
        chat.push(&ChatMessage::user(q));
    }
    Ok(())
}
