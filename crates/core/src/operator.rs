//! The operator model: one state, three hooks beside the processing.

use thiserror::Error;

use super::batch::BackupBatch;
use super::entry::{BackupEntry, MARKER_TAG};
use super::error::CoreError;
pub use super::structures::BackupScope;
use super::structures::{Norm, Tracked};

/// An input item the operator refuses, with the reason. A refused item leaves the
/// state untouched.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[error("{0}")]
pub struct Rejected(pub String);

/// Why an item was not processed.
#[derive(Clone, Debug, PartialEq, Error)]
pub enum ProcessError {
    /// The operator refused the item; the task goes on.
    #[error(transparent)]
    Rejected(#[from] Rejected),
    /// The state could not be read (a local store failed); the task must stop
    /// before anything of this item leaves it.
    #[error("state store: {0}")]
    State(#[from] CoreError),
}

/// The analysis constants of an operator, which turn thresholds into error bounds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AnalysisConstants {
    /// α: the most one input item can change the divergence.
    pub alpha: f64,
    /// β: the most output items one input item can produce.
    pub beta: u64,
}

/// A fault-tolerant operator. The core drives it through these hooks and never looks
/// inside its state; the Kafka service, the in-memory harness and the benchmarks all
/// use the same hooks.
pub trait Operator {
    type Input;
    type Output;

    /// Processes one item, appending its outputs (at most β of them).
    fn process(&mut self, input: &Self::Input, outputs: &mut Vec<Self::Output>) -> Result<(), ProcessError>;

    /// Whether the operator can take its next item. One that waits for something
    /// besides its input (a distributed worker at a barrier, waiting for the
    /// global model) says no; the driver then takes no input until the adapter
    /// hands it what it waits for ([`crate::TaskDriver::side_input`]).
    fn ready(&self) -> bool {
        true
    }

    /// The divergence of the live state from the last backup issued, kept up to
    /// date incrementally. Backups may be in flight: the changelog is gapless, so
    /// a marker that reached the log has every backup issued before it there.
    fn divergence(&self) -> f64;

    /// How the divergence is measured; decides whether thresholds are split across
    /// parallel tasks.
    fn norm(&self) -> Norm;

    /// The task's current θ (partial backups of max-difference states use it).
    fn set_theta(&mut self, theta: f64);

    /// Appends the entries of backup `seq` to `out`; the divergence counts from
    /// this backup from now on. Should it fail ([`Operator::fail_backup`]), its
    /// entries are owed to the next backup.
    fn backup(&mut self, seq: u64, scope: BackupScope, out: &mut BackupBatch);

    /// Backup `seq` and all earlier ones reached the store.
    fn acknowledge_backup(&mut self, seq: u64);

    /// Backup `seq` did not reach the store; its entries are owed again.
    fn fail_backup(&mut self, seq: u64);

    /// Rebuilds the state of a freshly built operator from backed-up entries, in the
    /// order they were written (later entries for a key win). May be called several
    /// times, a batch at a time. Marker records are skipped.
    fn restore(&mut self, entries: &[BackupEntry]) -> Result<(), CoreError>;

    /// Whether all of the state lives in local stores that [`Operator::stage_state`]
    /// writes to, so that a restart on a durable store can resume from the store's
    /// own offset with no state error. In-memory operators return false and
    /// always recover from the changelog.
    fn has_local_state(&self) -> bool {
        false
    }

    /// Stages every state change since the last call for the local store. The
    /// adapter writes what was staged, with the input offset it is consistent
    /// at, as one atomic write, before any backup taken so far goes out (a
    /// restart must know every key such a backup may have written).
    fn stage_state(&mut self) {}

    /// Everything staged is durable: state that is clean may leave memory.
    fn state_durable(&mut self) {}

    /// After a restart on a durable local store: brings back the drift tracking
    /// against the changelog. Returns how many keys it loaded.
    fn load_local_state(&mut self) -> Result<usize, CoreError> {
        Ok(0)
    }

    /// α and β of this operator as configured.
    fn constants(&self) -> AnalysisConstants;

    /// The divergence function applied to two states: how far `self` is from `other`.
    fn distance(&self, other: &Self) -> f64
    where
        Self: Sized;
}

/// Backs up several structures into one backup.
pub fn backup_all(parts: &mut [&mut dyn Tracked], seq: u64, scope: BackupScope, out: &mut BackupBatch) {
    for part in parts.iter_mut() {
        part.backup(seq, scope, out);
    }
}

pub fn acknowledge_all(parts: &mut [&mut dyn Tracked], seq: u64) {
    for part in parts.iter_mut() {
        part.acknowledge(seq);
    }
}

pub fn fail_all(parts: &mut [&mut dyn Tracked], seq: u64) {
    for part in parts.iter_mut() {
        part.fail(seq);
    }
}

pub fn set_theta_all(parts: &mut [&mut dyn Tracked], theta: f64) {
    for part in parts.iter_mut() {
        part.set_theta(theta);
    }
}

/// Hands each entry to the structure its tag names; an unknown tag is an error.
pub fn restore_all(parts: &mut [&mut dyn Tracked], entries: &[BackupEntry]) -> Result<(), CoreError> {
    for entry in entries {
        let tag = entry.tag()?;
        if tag == MARKER_TAG {
            continue;
        }
        let part = parts.iter_mut().find(|p| p.tag() == tag).ok_or_else(|| {
            CoreError::undecodable(
                "entry key",
                format!("structure tag {tag} belongs to no structure of this operator"),
            )
        })?;
        part.restore(entry)?;
    }
    Ok(())
}
