//! Fault-tolerant structures: state containers that know their divergence from the
//! last backup issued and write only what a backup needs (a failed backup's
//! entries are owed to the next one).
//!
//! | structure | divergences | backup unit |
//! | --- | --- | --- |
//! | [`TrackedValue`] | absolute difference | the value |
//! | [`TrackedVector`] | L1, L2, max difference at one index | (index, value) |
//! | [`TrackedTable`] | L1, L2, max difference of one key, key count | (key, value) |
//! | [`TrackedSet`] | member-count difference | members |
//!
//! Operators are built from these; so can a user's own operator be.

mod prefetch;
mod set;
mod slots;
mod store;
mod table;
mod value;
mod vector;

use serde::{Deserialize, Serialize};

pub use set::TrackedSet;
pub use store::{KeyStore, MemoryKeyStore, RecordVisitor, StoredDrift, StoredSlot};
pub use table::{TableKey, TrackedTable};
pub use value::TrackedValue;
pub use vector::TrackedVector;

/// Which entries a backup writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BackupScope {
    /// What the divergence counts: for a max-difference state only the entries over
    /// θ/2, for L1 and L2 with θ set the largest drifts until the divergence left
    /// is within θ/2, otherwise every entry changed since it was last backed up.
    /// This is the approximate mode's backup.
    Drifted,
    /// Every entry that differs from the backup, so that the backup equals the state
    /// once acknowledged: exact mode, clean stops and rebalances.
    Complete,
    /// Only the entries a failed write owes (it may have reached the log): the
    /// approximate mode's backup when l items have passed while the divergence is
    /// still within θ. Its marker moves the recovery point over a state within θ
    /// of the live one without writing the drift; a max-difference state writes
    /// its slots over θ/2 as for `Drifted`, and a store-backed structure over its
    /// memory budget writes as for `Drifted` so that its keys turn clean. Values
    /// and sets, which no operator's divergence counts, write their changes as
    /// for `Drifted`.
    Owed,
}

impl BackupScope {
    /// The scope for a part of a state that the operator's divergence does not
    /// count: an owed-only backup writes its changes all the same, since nothing
    /// bounds how far they drift.
    pub fn for_uncounted(self) -> BackupScope {
        match self {
            BackupScope::Owed => BackupScope::Drifted,
            scope => scope,
        }
    }
}

/// How the distance between the live state and its backup is measured.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Norm {
    /// Manhattan distance: Σ |live − backed|. Adds up across keys and tasks.
    L1,
    /// Euclidean distance: √Σ (live − backed)².
    L2,
    /// The largest |live − backed| of one index or key. A per-key maximum: it needs
    /// no split across parallel tasks, and only the keys over θ are backed up.
    Max,
    /// Hash tables only: the number of keys the backup does not hold yet.
    KeyCount,
}

impl Norm {
    /// Into how many shares Θ is cut for `tasks` parallel tasks, whose states
    /// are disjoint parts of the operator's state (every key, every model,
    /// lives in one task): the distance of the whole is the tasks' distances
    /// combined ([`Norm::combine`]), so n shares of Θ/shares combine to Θ.
    /// Distances add up under L1 and key count (n shares); under L2 their
    /// squares do (√n shares: n · (Θ/√n)² = Θ²); a per-key maximum is one
    /// task's (one share).
    pub fn task_shares(self, tasks: u32) -> f64 {
        let n = f64::from(tasks.max(1));
        match self {
            Norm::L1 | Norm::KeyCount => n,
            Norm::L2 => n.sqrt(),
            Norm::Max => 1.0,
        }
    }

    /// The distance of a state made of two disjoint parts at distances `a`
    /// and `b`.
    pub fn combine(self, a: f64, b: f64) -> f64 {
        match self {
            Norm::L1 | Norm::KeyCount => a + b,
            Norm::L2 => a.hypot(b),
            Norm::Max => a.max(b),
        }
    }

    /// Whether the items a task leaves uncovered and the outputs it leaves
    /// unacknowledged are split across tasks (L and Γ): they add up, except
    /// under a per-key maximum, whose bound is one key's and every key lives
    /// in one task.
    pub fn splits_counts(self) -> bool {
        !matches!(self, Norm::Max)
    }
}

use crate::batch::BackupBatch;
use crate::entry::BackupEntry;
use crate::error::CoreError;

/// What every fault-tolerant structure offers its operator: the three hooks of the
/// operator model, per structure. An operator with several structures gives each a
/// distinct tag, which prefixes the keys of its entries.
pub trait Tracked {
    /// The tag that prefixes this structure's entry keys.
    fn tag(&self) -> u8;
    /// Divergence from the last backup issued.
    fn divergence(&self) -> f64;
    /// The task's current θ (only max-difference structures use it).
    fn set_theta(&mut self, theta: f64);
    /// Appends this structure's entries of backup `seq` to `out`.
    fn backup(&mut self, seq: u64, scope: BackupScope, out: &mut BackupBatch);
    /// Backup `seq` (and every earlier one) reached the store.
    fn acknowledge(&mut self, seq: u64);
    /// Backup `seq` did not reach the store.
    fn fail(&mut self, seq: u64);
    /// Applies one entry with this structure's tag.
    fn restore(&mut self, entry: &BackupEntry) -> Result<(), CoreError>;
}

/// Checks that an entry belongs to the structure it is given to.
pub(crate) fn check_tag(entry: &BackupEntry, expected: u8) -> Result<(), CoreError> {
    let tag = entry.tag()?;
    if tag == expected {
        Ok(())
    } else {
        Err(CoreError::undecodable(
            "entry key",
            format!("structure tag {tag} given to the structure tagged {expected}"),
        ))
    }
}
