//! Tokenizer, chat template, the shipped corpus and a reply generator whose tokens round-trip (sans-IO).
