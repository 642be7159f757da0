//! afstream: approximate fault tolerance (AF-Stream) for stream processing on Kafka.
//!
//! State is backed up only when it diverges from its last backup by more than θ,
//! offsets are committed so that at most l input items are not covered, and at most
//! γ outputs are ever unacknowledged; the error any number of failures can cause is
//! bounded by the global thresholds. See `ARCHITECTURE.md` for the map from the
//! paper's concepts to these modules.

pub mod core;
pub mod operators;
pub mod workloads;
