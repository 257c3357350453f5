//! Routing policies and per-worker load accounting. Sans-IO: no clock, no I/O, no tokio.
