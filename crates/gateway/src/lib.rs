//! The OpenAI-compatible gateway: preprocessing, KV-aware routing, streaming relay, metrics.
