//! Virtual-time cluster simulator: engines, router, frontend queue and workload in one deterministic loop.
