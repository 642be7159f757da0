//! The approximate-fault-tolerance core: pure, with no Kafka and no RocksDB.
//!
//! * [`operator`]: the operator model (process, divergence, backup, restore);
//! * [`structures`]: fault-tolerant values, vectors, hash tables and sets;
//! * [`thresholds`]: from global Θ, L, Γ to a task's θ, l, γ, with the bounds;
//! * [`controller`]: when to back up, commit and stop taking input;
//! * [`recovery`]: backup markers and the decision a starting task makes;
//! * [`fence`]: incarnations, so a previous owner's late writes are left out;
//! * [`sources`]: source positions, so a chain's stage skips an upstream replay;
//! * [`entry`]: the versioned encoding of backup entries;
//! * [`batch`]: a backup's records, encoded once into one buffer;
//! * [`logged`]: what a changelog record says besides its value (sequence, priors);
//! * [`prior_chain`]: the priors a failure or an abandoned backup left uncertain;
//! * [`harness`]: an in-memory runtime with crash injection that checks the bounds;
//! * [`cluster`]: the same for a distributed learner's workers and averager.

pub mod batch;
pub mod cluster;
pub mod controller;
pub mod driver;
pub mod entry;
pub mod error;
pub mod fence;
pub mod harness;
pub mod logged;
pub mod mode;
pub mod operator;
pub mod operators;
pub mod prior_chain;
pub mod recovery;
pub mod sources;
mod spares;
pub mod structures;
pub mod thresholds;
pub mod workloads;

pub use batch::{BackupBatch, Record};
pub use controller::{
    Action, Blocked, ControllerConfig, ControllerFaults, Position, TaskController, DEFAULT_MAX_BACKUPS_IN_FLIGHT,
};
pub use driver::{Ack, DriverFaults, DriverStats, Item, TaskDriver, TaskIo};
pub use entry::{BackupEntry, EntryBytes};
pub use error::CoreError;
pub use fence::Fence;
pub use mode::{ExactInterval, Mode};
pub use operator::{AnalysisConstants, BackupScope, Operator, ProcessError, Rejected};
pub use prior_chain::CrashPriors;
pub use recovery::{
    compacted, last_marker_in_order, read_changelog, BackupMarker, ChangelogReader, ChangelogState, MarkedState,
    RecentFailures, RecoveryPlan, Restart, ResumeSource, StoreCheckpoint, StoreWrites,
};
pub use sources::{source_identity, SourcePosition, SourcePositions};
pub use structures::{
    KeyStore, MemoryKeyStore, Norm, StoredDrift, StoredSlot, Tracked, TrackedSet, TrackedTable, TrackedValue,
    TrackedVector,
};
pub use thresholds::{
    ErrorBound, FailurePolicy, GlobalThresholds, Placement, TaskThresholds, ThresholdPolicy, WindowPolicy,
    RECENT_FAILURES,
};
