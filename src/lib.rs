//! afstream: approximate fault tolerance (AF-Stream) for stream processing on Kafka.
//!
//! The approximate-fault-tolerance core, the operators and the seeded workloads
//! live in the pure `afstream-core` crate (`crates/core`), re-exported here; this
//! crate adds the service around it. See `ARCHITECTURE.md` for the map from the
//! paper's concepts to modules.

pub use afstream_core as core;
pub use afstream_core::{operators, workloads};
pub mod eval;
pub mod service;
