//! A simulated LLM inference worker. Sans-IO: no clock, no I/O, no tokio.
