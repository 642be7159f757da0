//! Backup markers and the recovery decision.
//!
//! Every backup is followed, in the same changelog partition, by a marker record
//! that says what the backup covers: the input offset P to resume from, and the
//! sequence of the last backup whose entries it covers. A starting task reads
//! its changelog partition to the end and restores the state logged *at the
//! last marker*: each key's latest record if the marker covers it, else the
//! record's prior, its value at that marker (see [`crate::logged`], which also
//! says why compaction cannot remove what this needs). Replaying the input from
//! P is then exact: no item is applied twice, so a failure adds at most the
//! divergence between the live state and the logged one when the marker was
//! issued, which the backups keep within θ. A marker written by a clean stop
//! covers a complete backup: the task continues exactly and counts no failure;
//! any other counts one, and the thresholds halve.
use super::entry::{entry_key, payload, versioned, BackupEntry, EntryBytes, PayloadReader, MARKER_TAG};
use super::error::CoreError;
use super::logged::LoggedValue;
use super::mode::Mode;
use super::operator::AnalysisConstants;
use super::prior_chain::CrashPriors;
use super::sources::SourcePositions;
use rustc_hash::FxHashMap;

use super::thresholds::{ErrorBound, FailurePolicy, TaskThresholds, RECENT_FAILURES};

/// The offsets at which the latest failures' recoveries resumed, oldest first:
/// what the recovering threshold policy needs to know which failures still count.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RecentFailures {
    offsets: [u64; RECENT_FAILURES],
    len: u8,
}

impl RecentFailures {
    pub fn as_slice(&self) -> &[u64] {
        &self.offsets[..usize::from(self.len)]
    }

    /// Records a failure that resumed at `offset`; the oldest goes when full.
    pub fn push(&mut self, offset: u64) {
        let len = usize::from(self.len);
        if len == RECENT_FAILURES {
            self.offsets.copy_within(1.., 0);
            self.offsets[RECENT_FAILURES - 1] = offset;
        } else {
            self.offsets[len] = offset;
            self.len += 1;
        }
    }

    /// Forgets the failures that no longer count at offset `now`.
    pub fn retain_counted(&mut self, policy: FailurePolicy, now: u64) {
        let FailurePolicy::Recovering { window_items } = policy else {
            return;
        };
        let mut kept = 0;
        for index in 0..usize::from(self.len) {
            let at = self.offsets[index];
            if at.saturating_add(window_items) > now {
                self.offsets[kept] = at;
                kept += 1;
            }
        }
        self.len = kept as u8;
    }
}

/// What a backup covers. Written after the backup's entries.
#[derive(Clone, Debug, PartialEq)]
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
    /// Where the latest failures resumed (the recovering policy counts them).
    pub recent: RecentFailures,
    /// Who wrote it: the identity of the task's local store (0: none). A
    /// restart trusts its local store only if the last marker is its own.
    pub writer: u64,
    /// The sequence of the last backup whose entries it covers: entries of
    /// later backups are restored as their priors ([`crate::logged`]).
    /// Markers written before priors existed cover every entry (`u64::MAX`).
    pub covers: u64,
    /// The newest source position the covered state includes from each
    /// upstream task ([`crate::sources`]); none before positions existed.
    pub sources: SourcePositions,
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
        body.push(self.recent.len);
        for offset in self.recent.as_slice() {
            body.extend_from_slice(&offset.to_le_bytes());
        }
        body.extend_from_slice(&self.writer.to_le_bytes());
        body.extend_from_slice(&self.covers.to_le_bytes());
        self.sources.encode_into(&mut body);
        BackupEntry::new(Self::key(), Some(versioned(&body)))
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
            recent: RecentFailures::default(),
            writer: 0,
            covers: u64::MAX,
            sources: SourcePositions::default(),
        };
        let count = usize::from(reader.u8()?);
        if count > RECENT_FAILURES {
            return Err(CoreError::undecodable(
                "backup marker",
                format!("{count} recent failures, at most {RECENT_FAILURES}"),
            ));
        }
        let mut marker = marker;
        for _ in 0..count {
            marker.recent.push(reader.u64()?);
        }
        // Markers written before local stores existed end here, those written
        // before priors existed after the writer, and those written before
        // source positions existed after the last backup they cover.
        if !reader.is_empty() {
            marker.writer = reader.u64()?;
        }
        if !reader.is_empty() {
            marker.covers = reader.u64()?;
        }
        if !reader.is_empty() {
            marker.sources = SourcePositions::decode_from(&mut reader)?;
        }
        reader.finish()?;
        Ok(marker)
    }
}

/// Turns a changelog's records, in log order, into the entries that rebuild
/// the state logged at its last marker, and gathers what the restarted task
/// must write before its start marker: the keys restored from a prior, at the
/// value restored (so no uncovered record of the crashed run stays a key's
/// latest), and the sequence to continue from.
#[derive(Clone, Debug)]
pub struct MarkedState {
    covers: u64,
    rolled_back: FxHashMap<EntryBytes, Option<EntryBytes>>,
    max_seq: u64,
}

/// What a restarted task writes and continues from, besides its state.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Restart {
    /// Keys restored from a prior, at the value restored (`None`: no key), to
    /// write before the start marker.
    pub rolled_back: Vec<BackupEntry>,
    /// Above every sequence the changelog holds.
    pub next_seq: u64,
}

impl MarkedState {
    /// For the changelog a recovery plan was decided from: the state logged
    /// at the marker it resumes from (with none, every record as it is).
    pub fn for_plan(plan: &RecoveryPlan) -> Self {
        let from_marker = matches!(plan.source, ResumeSource::Marker | ResumeSource::LocalStore);
        MarkedState {
            covers: if from_marker { plan.covers } else { u64::MAX },
            rolled_back: FxHashMap::default(),
            max_seq: plan.next_seq.saturating_sub(1),
        }
    }

    /// For a changelog whose last marker is `marker` (none: every record as it is).
    pub fn new(marker: Option<&BackupMarker>) -> Self {
        MarkedState {
            covers: marker.map_or(u64::MAX, |m| m.covers),
            rolled_back: FxHashMap::default(),
            max_seq: marker.map_or(0, |m| m.seq),
        }
    }

    /// Appends to `out` the entry to restore for each record of `records`
    /// (markers skipped; `value: None` deletes the key).
    pub fn resolve(&mut self, records: &[BackupEntry], out: &mut Vec<BackupEntry>) -> Result<(), CoreError> {
        for record in records {
            if BackupMarker::is_marker(record) {
                continue;
            }
            out.push(self.resolve_one(&record.key, record.value.as_deref())?);
        }
        Ok(())
    }

    fn resolve_one(&mut self, key: &EntryBytes, value: Option<&[u8]>) -> Result<BackupEntry, CoreError> {
        let logged = LoggedValue::decode(value)?;
        self.max_seq = self.max_seq.max(logged.seq);
        let at_marker = logged.at_marker(self.covers)?.cloned();
        if logged.seq > self.covers && !logged.priors.is_empty() {
            self.rolled_back.insert(key.clone(), at_marker.clone());
        } else {
            self.rolled_back.remove(key);
        }
        Ok(BackupEntry::new(key.clone(), at_marker))
    }

    pub fn finish(self) -> Restart {
        let mut rolled_back: Vec<BackupEntry> = self
            .rolled_back
            .into_iter()
            .map(|(key, value)| BackupEntry::new(key, value))
            .collect();
        rolled_back.sort_unstable_by(|a, b| a.key.cmp(&b.key));
        Restart {
            rolled_back,
            next_seq: self.max_seq.saturating_add(1).max(1),
        }
    }
}

/// Reads a changelog partition the way compaction leaves it: the latest record
/// per key, and the last marker. Feed it the records in log order, compacted or
/// not; the result is the same either way, which is what makes recovery safe
/// under compaction.
#[derive(Clone, Debug, Default)]
pub struct ChangelogReader {
    latest: FxHashMap<EntryBytes, Option<EntryBytes>>,
    marker: Option<BackupEntry>,
    records: u64,
}

/// What a starting task restores: the state logged at the last marker, the
/// marker, and what the restart writes before its start marker.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ChangelogState {
    pub entries: Vec<BackupEntry>,
    pub marker: Option<BackupMarker>,
    /// Records read, markers included.
    pub records: u64,
    pub restart: Restart,
}

impl ChangelogReader {
    pub fn new() -> Self {
        ChangelogReader::default()
    }

    /// Takes the next record of the log.
    pub fn push(&mut self, entry: BackupEntry) {
        self.records += 1;
        if BackupMarker::is_marker(&entry) {
            self.marker = Some(entry);
            return;
        }
        self.latest.insert(entry.key, entry.value);
    }

    /// The state to restore. Fails when the last marker or a record cannot be
    /// decoded: without them the task does not know where to resume, or from what.
    pub fn finish(self) -> Result<ChangelogState, CoreError> {
        let marker = self.marker.as_ref().map(BackupMarker::from_entry).transpose()?;
        let mut marked = MarkedState::new(marker.as_ref());
        let mut entries = Vec::with_capacity(self.latest.len());
        for (key, value) in &self.latest {
            let entry = marked.resolve_one(key, value.as_deref())?;
            if entry.value.is_some() {
                entries.push(entry);
            }
        }
        // A deterministic order, so restores are repeatable.
        entries.sort_unstable_by(|a, b| a.key.cmp(&b.key));
        Ok(ChangelogState {
            entries,
            marker,
            records: self.records,
            restart: marked.finish(),
        })
    }
}

/// Reads a whole changelog held in memory.
pub fn read_changelog<'a>(log: impl IntoIterator<Item = &'a BackupEntry>) -> Result<ChangelogState, CoreError> {
    let mut reader = ChangelogReader::new();
    for entry in log {
        reader.push(entry.clone());
    }
    reader.finish()
}

/// How a task starts.
#[derive(Clone, Debug, PartialEq)]
pub struct RecoveryPlan {
    /// The input offset to resume from.
    pub resume_offset: u64,
    /// Failures counted so far, including this one if it is one.
    pub failures: u32,
    /// Whether this start recovers from a failure.
    pub counted_failure: bool,
    /// The worst-case error this recovery may have introduced.
    pub introduced: ErrorBound,
    /// Which record the start position came from.
    pub source: ResumeSource,
    /// Where the latest failures resumed, this one included.
    pub recent: RecentFailures,
    /// The last backup whose entries the resumed marker covers.
    pub covers: u64,
    /// The sequence the task's backups and markers continue from: above every
    /// one its changelog holds ([`Restart::next_seq`]).
    pub next_seq: u64,
    /// The newest source positions the resumed state includes
    /// ([`crate::sources`]).
    pub sources: SourcePositions,
    /// A restart on a local store: what its crash left uncertain in the
    /// changelog (empty for any other start).
    pub priors: CrashPriors,
}

/// Where a start position came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ResumeSource {
    /// The last marker in the changelog (the recovery point).
    Marker,
    /// The consumer group's committed offset: no changelog yet (or mode none).
    Committed,
    /// The partition's start: nothing at all yet.
    Beginning,
    /// The task's own local store, exact at its offset.
    LocalStore,
}

impl RecoveryPlan {
    /// A task that never ran: nothing to restore.
    pub fn fresh(start_offset: u64) -> Self {
        RecoveryPlan {
            resume_offset: start_offset,
            failures: 0,
            counted_failure: false,
            introduced: ErrorBound::default(),
            source: ResumeSource::Beginning,
            recent: RecentFailures::default(),
            covers: 0,
            next_seq: 1,
            sources: SourcePositions::default(),
            priors: CrashPriors::default(),
        }
    }

    /// Continues the sequences above those of a changelog that held `restart`.
    pub fn continuing(self, restart: &Restart) -> Self {
        RecoveryPlan {
            next_seq: self.next_seq.max(restart.next_seq),
            ..self
        }
    }

    /// Decides from the last marker in the changelog. The recovery point is the
    /// marker's offset and the restored state the one logged at the marker
    /// ([`MarkedState`]), so replaying from the marker is exact and the failure
    /// adds at most the θ in force when the marker was written. A marker written
    /// by a clean stop means an exact state and no failure. The committed offset
    /// is used only where there is no marker (a task that never wrote one, or
    /// mode none, which writes none).
    pub fn decide(
        mode: Mode,
        last_marker: Option<&BackupMarker>,
        committed: Option<u64>,
        start_offset: u64,
        constants: AnalysisConstants,
    ) -> Self {
        match (mode, last_marker) {
            (Mode::None, _) | (_, None) => match committed {
                Some(offset) => RecoveryPlan {
                    source: ResumeSource::Committed,
                    ..RecoveryPlan::fresh(offset)
                },
                None => RecoveryPlan::fresh(start_offset),
            },
            (_, Some(marker)) if marker.clean => RecoveryPlan {
                resume_offset: marker.input_offset,
                failures: marker.failures,
                counted_failure: false,
                introduced: ErrorBound::default(),
                source: ResumeSource::Marker,
                recent: marker.recent,
                covers: marker.covers,
                next_seq: marker.seq.saturating_add(1),
                sources: marker.sources.clone(),
                priors: CrashPriors::default(),
            },
            (_, Some(marker)) => RecoveryPlan {
                resume_offset: marker.input_offset,
                failures: marker.failures.saturating_add(1),
                counted_failure: true,
                introduced: marker.thresholds.failure_bound(constants),
                source: ResumeSource::Marker,
                recent: {
                    let mut recent = marker.recent;
                    recent.push(marker.input_offset);
                    recent
                },
                covers: marker.covers,
                next_seq: marker.seq.saturating_add(1),
                sources: marker.sources.clone(),
                priors: CrashPriors::default(),
            },
        }
    }
}

/// What a task's local store says with every write: where its state is exact,
/// and what the changelog can hold. The adapter writes it with the state and
/// sends the changelog records handed out before the write only after it, so
/// every record in the log has a sequence below `next_seq`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StoreCheckpoint {
    /// The state includes every input item before this offset.
    pub next_offset: u64,
    /// Above every sequence handed out so far ([`TaskController::next_seq`]).
    ///
    /// [`TaskController::next_seq`]: crate::controller::TaskController::next_seq
    pub next_seq: u64,
    /// The newest source positions the state includes.
    pub sources: SourcePositions,
    /// What a crash at this write leaves uncertain in the changelog
    /// ([`crate::prior_chain`]): a restart on the store writes on with it.
    pub priors: CrashPriors,
}

impl RecoveryPlan {
    /// A restart on the task's own durable local store, which is exact at
    /// the checkpoint's offset and is known to hold every key any backup in
    /// the changelog wrote (the last marker is its own: `last_marker.writer`
    /// is the store's identity). The state error is zero. Outputs of items
    /// before that offset that were not acknowledged at the crash may be
    /// lost: at most γ, and `largest_gamma` (γ at no failure, the largest any
    /// policy gives) bounds it. A restart after a clean stop at the store's
    /// offset is no failure. Sequences continue above the checkpoint's, so a
    /// record the crashed run left past the last marker is never taken for
    /// one of the new run's.
    pub fn local(checkpoint: &StoreCheckpoint, last_marker: Option<&BackupMarker>, largest_gamma: u64) -> Self {
        let store_offset = checkpoint.next_offset;
        let clean = last_marker.is_some_and(|m| m.clean && m.input_offset == store_offset);
        let (failures, recent) = match last_marker {
            Some(marker) => (marker.failures, marker.recent),
            None => (0, RecentFailures::default()),
        };
        let covers = last_marker.map_or(0, |m| m.covers);
        let next_seq = last_marker
            .map_or(1, |m| m.seq.saturating_add(1))
            .max(checkpoint.next_seq);
        let sources = checkpoint.sources.clone();
        let priors = checkpoint.priors.clone();
        if clean {
            return RecoveryPlan {
                resume_offset: store_offset,
                failures,
                counted_failure: false,
                introduced: ErrorBound::default(),
                source: ResumeSource::LocalStore,
                recent,
                covers,
                next_seq,
                sources,
                priors,
            };
        }
        let mut recent = recent;
        recent.push(store_offset);
        RecoveryPlan {
            resume_offset: store_offset,
            failures: failures.saturating_add(1),
            counted_failure: true,
            introduced: ErrorBound {
                state: 0.0,
                outputs: largest_gamma as f64,
            },
            source: ResumeSource::LocalStore,
            recent,
            covers,
            next_seq,
            sources,
            priors,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sources::SourcePosition;

    #[test]
    fn a_local_restart_is_exact_and_counts_as_a_failure_unless_clean() {
        let at = |next_offset| StoreCheckpoint {
            next_offset,
            ..StoreCheckpoint::default()
        };
        let crashed = RecoveryPlan::local(&at(1500), Some(&marker(false)), 64);
        assert_eq!(crashed.resume_offset, 1500);
        assert_eq!(crashed.failures, 3);
        assert!(crashed.counted_failure);
        assert_eq!(
            crashed.introduced,
            ErrorBound {
                state: 0.0,
                outputs: 64.0
            }
        );
        assert_eq!(crashed.source, ResumeSource::LocalStore);
        assert_eq!(crashed.recent.as_slice(), &[1500]);
        let stopped = RecoveryPlan::local(&at(1000), Some(&marker(true)), 64);
        assert!(!stopped.counted_failure);
        assert_eq!(stopped.failures, 2);
        assert_eq!(stopped.introduced, ErrorBound::default());
        let moved_on = RecoveryPlan::local(&at(1200), Some(&marker(true)), 64);
        assert!(
            moved_on.counted_failure,
            "items after the clean stop were processed, then a crash"
        );
        assert_eq!(RecoveryPlan::local(&at(0), None, 64).failures, 1);
        let checkpoint = StoreCheckpoint {
            next_offset: 5,
            next_seq: 40,
            sources: marker(false).sources,
            priors: CrashPriors::default(),
        };
        let plan = RecoveryPlan::local(&checkpoint, Some(&marker(false)), 64);
        assert_eq!(
            plan.sources, checkpoint.sources,
            "a local restart resumes with the store's positions"
        );
        assert_eq!(plan.next_seq, 40, "above every record the store let out");
        assert_eq!(crashed.next_seq, 8, "above the marker's");
    }

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
            recent: RecentFailures::default(),
            writer: 0xfeed_beef,
            covers: 6,
            sources: {
                let mut sources = SourcePositions::default();
                sources.advance(SourcePosition {
                    source: 11,
                    offset: 400,
                    index: 2,
                });
                sources.advance(SourcePosition {
                    source: 3,
                    offset: 90,
                    index: 0,
                });
                sources
            },
        }
    }

    #[test]
    fn a_marker_carries_its_source_positions_to_the_plan() {
        let plan = RecoveryPlan::decide(Mode::Approximate, Some(&marker(false)), None, 0, C);
        assert_eq!(plan.sources, marker(false).sources);
        assert_eq!(plan.sources.as_slice().len(), 2);
        let clean = RecoveryPlan::decide(Mode::Approximate, Some(&marker(true)), None, 0, C);
        assert_eq!(clean.sources, marker(true).sources);
        let none = RecoveryPlan::decide(Mode::None, Some(&marker(false)), Some(5), 0, C);
        assert!(
            none.sources.is_empty(),
            "mode none resumes from the commit, with no table"
        );
    }

    #[test]
    fn older_markers_read_without_a_writer_or_what_they_cover() {
        let mut entry = marker(false).to_entry();
        let value = entry.value.as_mut().unwrap();
        let without_positions = value.len() - 4 - 2 * 20;
        value.truncate(without_positions);
        let decoded = BackupMarker::from_entry(&entry).unwrap();
        assert_eq!(
            BackupMarker {
                sources: SourcePositions::default(),
                ..marker(false)
            },
            decoded,
            "written before source positions: an empty table"
        );
        let value = entry.value.as_mut().unwrap();
        let shorter = value.len() - 8;
        value.truncate(shorter);
        let decoded = BackupMarker::from_entry(&entry).unwrap();
        assert_eq!(
            BackupMarker {
                covers: u64::MAX,
                sources: SourcePositions::default(),
                ..marker(false)
            },
            decoded,
            "written before priors: it covers every entry"
        );
        let value = entry.value.as_mut().unwrap();
        let shorter = value.len() - 8;
        value.truncate(shorter);
        let decoded = BackupMarker::from_entry(&entry).unwrap();
        assert_eq!(decoded.writer, 0);
        assert_eq!(
            BackupMarker {
                writer: 0,
                covers: u64::MAX,
                sources: SourcePositions::default(),
                ..marker(false)
            },
            decoded
        );
        assert_eq!(
            BackupMarker::from_entry(&marker(false).to_entry()).unwrap().writer,
            0xfeed_beef
        );
    }

    const C: AnalysisConstants = AnalysisConstants { alpha: 2.0, beta: 1 };

    fn entry(key: &[u8], value: Option<&[u8]>) -> BackupEntry {
        BackupEntry::new(entry_key(1, key), value.map(versioned))
    }

    #[test]
    fn recent_failures_keep_the_latest_and_forget_the_expired() {
        let mut recent = RecentFailures::default();
        for offset in 0..(RECENT_FAILURES as u64 + 3) {
            recent.push(offset * 10);
        }
        assert_eq!(recent.as_slice().len(), RECENT_FAILURES);
        assert_eq!(recent.as_slice()[0], 30, "the oldest went");
        recent.retain_counted(FailurePolicy::Recovering { window_items: 50 }, 170);
        assert_eq!(recent.as_slice(), &[130, 140, 150, 160, 170, 180]);
        recent.retain_counted(FailurePolicy::Halving, 10_000);
        assert_eq!(recent.as_slice().len(), 6, "only the recovering policy forgets");
    }

    #[test]
    fn marker_round_trips_and_rejects_garbage() {
        let mut m = marker(true);
        m.recent.push(12);
        m.recent.push(99);
        assert_eq!(BackupMarker::from_entry(&m.to_entry()).unwrap(), m);
        for offset in 0..RECENT_FAILURES as u64 {
            m.recent.push(offset);
        }
        assert_eq!(
            BackupMarker::from_entry(&m.to_entry()).unwrap(),
            m,
            "a full list reads back"
        );
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
        let mut entry = m.to_entry();
        entry.value.as_mut().unwrap()[45] = 7;
        assert!(matches!(
            BackupMarker::from_entry(&entry),
            Err(CoreError::Undecodable { .. })
        ));
        let mut entry = m.to_entry();
        entry.value.as_mut().unwrap()[46] = 200;
        assert!(matches!(
            BackupMarker::from_entry(&entry),
            Err(CoreError::Undecodable { .. })
        ));
        assert!(BackupMarker::from_entry(&BackupEntry::new(BackupMarker::key(), None)).is_err());
    }

    #[test]
    fn the_reader_keeps_the_latest_record_per_key_and_the_last_marker() {
        let first = BackupMarker {
            seq: 1,
            input_offset: 10,
            ..marker(false)
        };
        let second = BackupMarker {
            seq: 2,
            input_offset: 20,
            ..marker(false)
        };
        let log = vec![
            entry(b"a", Some(b"1")),
            entry(b"b", Some(b"1")),
            first.to_entry(),
            entry(b"a", Some(b"2")),
            entry(b"b", None),
            second.to_entry(),
            entry(b"c", Some(b"3")),
        ];
        let state = read_changelog(&log).unwrap();
        assert_eq!(state.marker, Some(second.clone()));
        assert_eq!(state.records, 7);
        assert_eq!(state.entries, vec![entry(b"a", Some(b"2")), entry(b"c", Some(b"3"))]);
        // What compaction leaves of the same log reads the same.
        let compacted = vec![entry(b"a", Some(b"2")), second.to_entry(), entry(b"c", Some(b"3"))];
        let again = read_changelog(&compacted).unwrap();
        assert_eq!((again.entries, again.marker), (state.entries, state.marker));
        let mut broken = log.clone();
        broken.push(BackupEntry::new(BackupMarker::key(), Some(versioned(b"short"))));
        assert!(
            read_changelog(&broken).is_err(),
            "an undecodable last marker is an error"
        );
    }

    /// A record as the driver logs it: value `value` in backup `seq`, the key
    /// holding `prior` before.
    fn logged(key: &[u8], seq: u64, value: f64, prior: Option<f64>) -> BackupEntry {
        let mut chain = crate::prior_chain::PriorChain::new();
        let mut batch = chain.batch(seq);
        batch.push_f64(1, |out| out.extend_from_slice(key), value, prior);
        let record = chain.log(batch).iter().next().unwrap().to_entry();
        record
    }

    /// Marker 3 at offset 10, behind backup 2.
    fn marker_covering_backup_2() -> BackupMarker {
        BackupMarker {
            seq: 3,
            input_offset: 10,
            covers: 2,
            ..marker(false)
        }
    }

    #[test]
    fn a_record_the_last_marker_does_not_cover_is_restored_as_its_prior_even_compacted() {
        let first = marker_covering_backup_2();
        let log = vec![
            logged(b"a", 2, 1.0, None),
            logged(b"b", 2, 5.0, None),
            first.to_entry(),
            // Backup 4's entries, its marker lost in the crash.
            logged(b"a", 4, 2.0, Some(1.0)),
            logged(b"c", 4, 7.0, None),
        ];
        let value = |state: &ChangelogState, key: &[u8]| {
            state
                .entries
                .iter()
                .find(|e| e.key_body() == key)
                .and_then(|e| e.value.as_deref().map(|v| crate::entry::decode_f64(v).unwrap()))
        };
        // Compaction may leave only the latest record of `a`.
        let compacted = vec![log[1].clone(), log[2].clone(), log[3].clone(), log[4].clone()];
        for log in [log, compacted] {
            let state = read_changelog(&log).unwrap();
            assert_eq!(
                value(&state, b"a"),
                Some(1.0),
                "a's value at the marker, not backup 4's"
            );
            assert_eq!(value(&state, b"b"), Some(5.0));
            assert_eq!(value(&state, b"c"), None, "c did not exist at the marker");
            let rolled: Vec<&[u8]> = state.restart.rolled_back.iter().map(|e| e.key_body()).collect();
            assert_eq!(
                rolled,
                vec![b"a".as_slice(), b"c".as_slice()],
                "written again before the start marker"
            );
            assert_eq!(state.restart.next_seq, 5, "above every sequence in the log");
        }
    }

    #[test]
    fn record_by_record_resolution_gives_what_the_reader_gives() {
        let marker = marker_covering_backup_2();
        let log = vec![
            logged(b"a", 2, 1.0, None),
            marker.to_entry(),
            logged(b"a", 4, 2.0, Some(1.0)),
            logged(b"b", 4, 7.0, None),
        ];
        let plan = RecoveryPlan::decide(Mode::Approximate, Some(&marker), None, 0, C);
        let mut marked = MarkedState::for_plan(&plan);
        let mut resolved = Vec::new();
        marked.resolve(&log, &mut resolved).unwrap();
        let decoded: Vec<(&[u8], Option<f64>)> = resolved
            .iter()
            .map(|e| {
                (
                    e.key_body(),
                    e.value.as_deref().map(|v| crate::entry::decode_f64(v).unwrap()),
                )
            })
            .collect();
        assert_eq!(
            decoded,
            vec![
                (b"a".as_slice(), Some(1.0)),
                (b"a".as_slice(), Some(1.0)),
                (b"b".as_slice(), None)
            ],
            "markers skipped; uncovered records as their priors, in log order"
        );
        let restart = marked.finish();
        assert_eq!(restart, read_changelog(&log).unwrap().restart);
        let continued = plan.clone().continuing(&restart);
        assert_eq!(continued.next_seq, 5, "above backup 4");
        assert_eq!(plan.next_seq, 4, "the marker's own sequence + 1");
    }

    #[test]
    fn a_clean_marker_continues_without_a_failure() {
        let plan = RecoveryPlan::decide(Mode::Approximate, Some(&marker(true)), Some(900), 0, C);
        assert!(!plan.counted_failure);
        assert_eq!(plan.failures, 2);
        assert_eq!(plan.resume_offset, 1000, "the marker, not the committed offset");
        assert_eq!(plan.introduced, ErrorBound::default());
        assert_eq!(plan.source, ResumeSource::Marker);
    }

    #[test]
    fn a_crash_resumes_at_the_marker_counts_a_failure_and_reports_its_bound() {
        let plan = RecoveryPlan::decide(Mode::Approximate, Some(&marker(false)), Some(1200), 0, C);
        assert!(plan.counted_failure);
        assert_eq!(plan.failures, 3);
        assert_eq!(plan.resume_offset, 1000);
        assert_eq!(plan.introduced.state, 12.5, "θ alone, whatever α and l");
        assert_eq!(plan.introduced.outputs, 100.0, "l·β repeated");
        assert_eq!((plan.covers, plan.next_seq), (6, 8));
    }

    #[test]
    fn without_a_marker_the_committed_offset_or_the_start() {
        let plan = RecoveryPlan::decide(Mode::Approximate, None, None, 5, C);
        assert_eq!(
            (plan.resume_offset, plan.counted_failure, plan.source),
            (5, false, ResumeSource::Beginning)
        );
        let plan = RecoveryPlan::decide(Mode::Approximate, None, Some(40), 5, C);
        assert_eq!((plan.resume_offset, plan.source), (40, ResumeSource::Committed));
        // Mode none ignores markers a differently configured run left behind.
        let plan = RecoveryPlan::decide(Mode::None, Some(&marker(false)), Some(40), 5, C);
        assert_eq!((plan.resume_offset, plan.counted_failure), (40, false));
    }
}
