//! The engine simulator served in real time: OpenAI-compatible HTTP, metrics, KV event publishing.
