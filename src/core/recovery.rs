//! Backup markers and the recovery decision.
//!
//! Every backup is followed, in the same changelog partition, by a marker record
//! that says what the backup covers. On start a task reads the last marker and the
//! consumer group's committed offset and decides whether it continues exactly
//! (the last stop was clean) or recovers from a failure, which it counts so the
//! thresholds halve.

use super::controller::Mode;
use super::entry::{entry_key, payload, versioned, BackupEntry, EntryBytes, PayloadReader, MARKER_TAG};
use super::error::CoreError;
use super::operator::AnalysisConstants;
use super::thresholds::{ErrorBound, TaskThresholds, ThresholdPolicy};

/// What a backup covers. Written after the backup's entries.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BackupMarker {
    /// The backup's sequence number in this task's run.
    pub seq: u64,
    /// The next input offset: the state includes every item before it.
    pub input_offset: u64,
    /// Failures the task had recovered from when it wrote the marker.
    pub failures: u32,
    /// The thresholds in force.
    pub thresholds: TaskThresholds,
    /// Written by a clean stop: the state is exact at `input_offset`.
    pub clean: bool,
}

impl BackupMarker {
    /// The key of the marker record; one key, so compaction keeps the last marker.
    pub fn key() -> EntryBytes {
        entry_key(MARKER_TAG, b"marker")
    }

    pub fn is_marker(entry: &BackupEntry) -> bool {
        entry.key.first() == Some(&MARKER_TAG)
    }

    pub fn to_entry(&self) -> BackupEntry {
        let mut body = Vec::with_capacity(45);
        body.extend_from_slice(&self.seq.to_le_bytes());
        body.extend_from_slice(&self.input_offset.to_le_bytes());
        body.extend_from_slice(&self.failures.to_le_bytes());
        body.extend_from_slice(&self.thresholds.theta.to_le_bytes());
        body.extend_from_slice(&self.thresholds.items.to_le_bytes());
        body.extend_from_slice(&self.thresholds.outputs.to_le_bytes());
        body.push(u8::from(self.clean));
        BackupEntry {
            key: Self::key(),
            value: Some(versioned(&body)),
        }
    }

    pub fn from_entry(entry: &BackupEntry) -> Result<Self, CoreError> {
        if !Self::is_marker(entry) {
            return Err(CoreError::undecodable("backup marker", "the key is not the marker key"));
        }
        let value = entry
            .value
            .as_deref()
            .ok_or_else(|| CoreError::undecodable("backup marker", "the marker has no value"))?;
        let mut reader = PayloadReader::new(payload(value)?, "backup marker");
        let marker = BackupMarker {
            seq: reader.u64()?,
            input_offset: reader.u64()?,
            failures: reader.u32()?,
            thresholds: TaskThresholds {
                theta: reader.f64()?,
                items: reader.u64()?,
                outputs: reader.u64()?,
            },
            clean: match reader.u8()? {
                0 => false,
                1 => true,
                other => return Err(CoreError::undecodable("backup marker", format!("clean flag {other}"))),
            },
        };
        reader.finish()?;
        Ok(marker)
    }
}

/// What a changelog holds for a starting task.
#[derive(Clone, Debug, PartialEq)]
pub struct Restorable<'a> {
    /// Every entry up to and including the last marker: what to restore.
    pub entries: &'a [BackupEntry],
    /// The last marker.
    pub marker: Option<BackupMarker>,
    /// Entries that undo the tail: for every key written after the last marker (by
    /// a backup in flight at the crash, possibly only partly written), its value as
    /// of the marker, or a deletion. The first backup of the new run writes them,
    /// so the tail can never mix into a later restore.
    pub repair: Vec<BackupEntry>,
}

/// Splits a changelog, in write order, into what a task restores and what it must
/// repair. Leaving the tail out keeps exact mode exact and approximate mode within
/// its bound.
pub fn restorable(log: &[BackupEntry]) -> Result<Restorable<'_>, CoreError> {
    let (entries, marker) = match log.iter().rposition(BackupMarker::is_marker) {
        None => (&log[..0], None),
        Some(last) => (&log[..=last], Some(BackupMarker::from_entry(&log[last])?)),
    };
    let mut repair: Vec<BackupEntry> = Vec::new();
    for entry in &log[entries.len()..] {
        if BackupMarker::is_marker(entry) || repair.iter().any(|r| r.key == entry.key) {
            continue;
        }
        let before = entries.iter().rev().find(|e| e.key == entry.key);
        repair.push(before.cloned().unwrap_or(BackupEntry {
            key: entry.key.clone(),
            value: None,
        }));
    }
    Ok(Restorable {
        entries,
        marker,
        repair,
    })
}

/// How a task starts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RecoveryPlan {
    /// The input offset to resume from.
    pub resume_offset: u64,
    /// Failures counted so far, including this one if it is one.
    pub failures: u32,
    /// Whether this start recovers from a failure.
    pub counted_failure: bool,
    /// The worst-case error this recovery may have introduced.
    pub introduced: ErrorBound,
}

impl RecoveryPlan {
    /// A task that never ran: nothing to restore.
    pub fn fresh(start_offset: u64) -> Self {
        RecoveryPlan {
            resume_offset: start_offset,
            failures: 0,
            counted_failure: false,
            introduced: ErrorBound::default(),
        }
    }

    /// Decides from the last marker and the committed offset. `start_offset` is where
    /// a task with no commit starts (the partition's beginning).
    ///
    /// Approximate mode resumes at the committed offset, as the bound assumes. Exact
    /// mode resumes where its last backup ends: its backups are taken at barriers
    /// where every earlier output is acknowledged, so nothing before the marker needs
    /// replaying, and a commit lost in the crash cannot make the replay count items
    /// twice.
    pub fn decide(
        mode: Mode,
        last_marker: Option<&BackupMarker>,
        committed: Option<u64>,
        start_offset: u64,
        policy: &ThresholdPolicy,
        constants: AnalysisConstants,
    ) -> Self {
        if let (Mode::Exact(_), Some(marker)) = (mode, last_marker) {
            let clean = marker.clean && committed == Some(marker.input_offset);
            return RecoveryPlan {
                resume_offset: marker.input_offset,
                failures: marker.failures.saturating_add(u32::from(!clean)),
                counted_failure: !clean,
                introduced: ErrorBound::default(),
            };
        }
        let resume_offset = committed.unwrap_or(start_offset);
        match last_marker {
            None if committed.is_none() => RecoveryPlan::fresh(start_offset),
            None => RecoveryPlan {
                // Offsets were committed but no backup was ever acknowledged: a failure
                // of a first run, which ran with the thresholds of failure 0.
                resume_offset,
                failures: 1,
                counted_failure: true,
                introduced: policy.for_failures(0).failure_bound(constants),
            },
            Some(marker) if marker.clean && committed == Some(marker.input_offset) => RecoveryPlan {
                resume_offset,
                failures: marker.failures,
                counted_failure: false,
                introduced: ErrorBound::default(),
            },
            Some(marker) => RecoveryPlan {
                resume_offset,
                failures: marker.failures.saturating_add(1),
                counted_failure: true,
                introduced: marker.thresholds.failure_bound(constants),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::thresholds::{FailurePolicy, GlobalThresholds, Placement};

    fn marker(clean: bool) -> BackupMarker {
        BackupMarker {
            seq: 7,
            input_offset: 1000,
            failures: 2,
            thresholds: TaskThresholds {
                theta: 12.5,
                items: 100,
                outputs: 50,
            },
            clean,
        }
    }

    fn policy() -> ThresholdPolicy {
        let c = AnalysisConstants { alpha: 2.0, beta: 1 };
        ThresholdPolicy::new(
            GlobalThresholds::new(100.0, 1000, 100).unwrap(),
            FailurePolicy::Halving,
            Placement::default(),
            true,
            c,
        )
        .unwrap()
    }

    #[test]
    fn marker_round_trips_and_rejects_garbage() {
        let m = marker(true);
        assert_eq!(BackupMarker::from_entry(&m.to_entry()).unwrap(), m);
        let mut entry = m.to_entry();
        entry.value.as_mut().unwrap().pop();
        assert!(BackupMarker::from_entry(&entry).is_err());
        let mut entry = m.to_entry();
        entry.value.as_mut().unwrap()[0] = 2;
        assert!(matches!(
            BackupMarker::from_entry(&entry),
            Err(CoreError::UnknownEncodingVersion { found: 2, .. })
        ));
    }

    #[test]
    fn clean_stop_continues_without_a_failure() {
        let c = AnalysisConstants { alpha: 2.0, beta: 1 };
        let plan = RecoveryPlan::decide(Mode::Approximate, Some(&marker(true)), Some(1000), 0, &policy(), c);
        assert!(!plan.counted_failure);
        assert_eq!(plan.failures, 2);
        assert_eq!(plan.resume_offset, 1000);
    }

    #[test]
    fn crash_counts_a_failure_and_reports_its_bound() {
        let c = AnalysisConstants { alpha: 2.0, beta: 1 };
        let plan = RecoveryPlan::decide(Mode::Approximate, Some(&marker(false)), Some(900), 0, &policy(), c);
        assert!(plan.counted_failure);
        assert_eq!(plan.failures, 3);
        assert_eq!(plan.resume_offset, 900);
        assert_eq!(plan.introduced.state, 12.5 + 100.0 * 2.0);
        // A clean marker whose offsets moved on (the commit is elsewhere) is no
        // clean continuation either.
        assert!(
            RecoveryPlan::decide(Mode::Approximate, Some(&marker(true)), Some(1200), 0, &policy(), c).counted_failure
        );
        assert!(!RecoveryPlan::decide(Mode::Approximate, None, None, 5, &policy(), c).counted_failure);
        assert!(RecoveryPlan::decide(Mode::Approximate, None, Some(5), 0, &policy(), c).counted_failure);
    }
}
