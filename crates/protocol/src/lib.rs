//! Wire formats: OpenAI API types and errors, SSE, KV events over NATS and vLLM's ZMQ msgpack.
