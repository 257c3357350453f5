//! The seed's multi-turn chat workload: conversations, turns, think time, constant concurrency (sans-IO).
