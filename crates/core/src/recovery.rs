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
use super::entry::{entry_key, payload, BackupEntry, EntryBytes, PayloadReader, ENCODING_VERSION, MARKER_TAG};
use super::error::CoreError;
use super::fence::{next_incarnation, Fence, LogOrder};
use super::logged::LoggedValue;
use super::mode::Mode;
use super::operator::AnalysisConstants;
use super::prior_chain::CrashPriors;
use super::sources::SourcePositions;
use rustc_hash::{FxHashMap, FxHashSet};

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
    /// The last backup of earlier incarnations the state its incarnation
    /// restored includes ([`crate::fence`]); `u64::MAX` (every one) in
    /// markers written before incarnations existed.
    pub inherited: u64,
}

impl BackupMarker {
    /// The key of the marker record; one key, so compaction keeps the last marker.
    pub fn key() -> EntryBytes {
        entry_key(MARKER_TAG, b"marker")
    }

    /// Which records belong to the state logged at this marker
    /// ([`crate::fence`]).
    pub fn fence(&self) -> Fence {
        Fence::new(self.seq, self.inherited)
    }

    pub fn is_marker(entry: &BackupEntry) -> bool {
        entry.key.first() == Some(&MARKER_TAG)
    }

    /// The marker record. Its value is laid out in place, version byte
    /// first: a marker goes out with every backup.
    pub fn to_entry(&self) -> BackupEntry {
        let recent = 8 * usize::from(self.recent.len);
        let mut body = EntryBytes::with_capacity(1 + 46 + recent + 16 + self.sources.encoded_len() + 8);
        body.push(ENCODING_VERSION);
        body.extend_from_slice(&self.seq.to_le_bytes());
        body.extend_from_slice(&self.input_offset.to_le_bytes());
        body.extend_from_slice(&self.failures.to_le_bytes());
        body.extend_from_slice(&self.thresholds.theta.to_le_bytes());
        body.extend_from_slice(&self.thresholds.max_uncovered.to_le_bytes());
        body.extend_from_slice(&self.thresholds.max_unacked.to_le_bytes());
        body.push(u8::from(self.clean));
        body.push(self.recent.len);
        for offset in self.recent.as_slice() {
            body.extend_from_slice(&offset.to_le_bytes());
        }
        body.extend_from_slice(&self.writer.to_le_bytes());
        body.extend_from_slice(&self.covers.to_le_bytes());
        self.sources.encode_into(&mut body);
        body.extend_from_slice(&self.inherited.to_le_bytes());
        BackupEntry::new(Self::key(), Some(body))
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
                max_uncovered: reader.u64()?,
                max_unacked: reader.u64()?,
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
            inherited: u64::MAX,
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
        // before priors existed after the writer, those written before source
        // positions existed after the last backup they cover, and those
        // written before incarnations existed after the positions.
        if !reader.is_empty() {
            marker.writer = reader.u64()?;
        }
        if !reader.is_empty() {
            marker.covers = reader.u64()?;
        }
        if !reader.is_empty() {
            marker.sources = SourcePositions::decode_from(&mut reader)?;
        }
        if !reader.is_empty() {
            marker.inherited = reader.u64()?;
        }
        reader.finish()?;
        Ok(marker)
    }
}

/// Turns a changelog's records, in log order, into the entries that rebuild
/// the state logged at its last marker, and gathers what the restarted task
/// must write before its start marker: the keys restored from a prior, and
/// those whose latest record was fenced ([`crate::fence`]), at the value
/// restored (so no uncovered or fenced record stays a key's latest), and the
/// sequence to continue from.
#[derive(Clone, Debug)]
pub struct MarkedState {
    covers: u64,
    fence: Fence,
    order: LogOrder,
    /// The last marker the log's order admits, in what was read.
    last_marker: Option<BackupMarker>,
    rolled_back: FxHashMap<EntryBytes, Option<EntryBytes>>,
    /// Keys whose latest record was fenced, their restored value not known
    /// (it came from a record already handed out).
    unresolved: FxHashSet<EntryBytes>,
    /// On a second read: the keys whose restored value it looks for.
    watched: Option<FxHashMap<EntryBytes, Option<EntryBytes>>>,
    fenced: u64,
    max_seq: u64,
    next_seq: u64,
}

/// What a restarted task writes and continues from, besides its state.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Restart {
    /// Keys restored from a prior, or whose latest record was fenced, at the
    /// value restored (`None`: no key), to write before the start marker.
    pub rolled_back: Vec<BackupEntry>,
    /// Keys whose latest record was fenced and whose restored value is not
    /// known yet: read the log again with [`MarkedState::watching`] them.
    pub unresolved: Vec<EntryBytes>,
    /// Records left out because a newer incarnation had started
    /// ([`crate::fence`]).
    pub fenced: u64,
    /// The last marker the log's order admits: the one a recovery of this
    /// log resumes from.
    pub last_marker: Option<BackupMarker>,
    /// The first sequence of a new incarnation, above every one the
    /// changelog holds.
    pub next_seq: u64,
}

impl MarkedState {
    /// For the changelog a recovery plan was decided from: the state logged
    /// at the marker it resumes from (with none, every record as it is).
    pub fn for_plan(plan: &RecoveryPlan) -> Self {
        let from_marker = matches!(plan.source, ResumeSource::Marker | ResumeSource::LocalStore);
        MarkedState::with(
            if from_marker { plan.covers } else { u64::MAX },
            plan.fence,
            plan.next_seq,
        )
    }

    /// For a changelog whose last marker is `marker` (none: every record as it is).
    pub fn new(marker: Option<&BackupMarker>) -> Self {
        MarkedState::with(
            marker.map_or(u64::MAX, |m| m.covers),
            marker.map_or(Fence::NONE, BackupMarker::fence),
            marker.map_or(0, |m| next_incarnation(m.seq)),
        )
    }

    /// `next_seq`: the least the restart may continue from.
    fn with(covers: u64, fence: Fence, next_seq: u64) -> Self {
        MarkedState {
            covers,
            fence,
            order: LogOrder::default(),
            last_marker: None,
            rolled_back: FxHashMap::default(),
            unresolved: FxHashSet::default(),
            watched: None,
            fenced: 0,
            max_seq: 0,
            next_seq,
        }
    }

    /// A second read that also finds the restored value of `keys` (a first
    /// read's [`Restart::unresolved`]), to write them back.
    pub fn watching(self, keys: &[EntryBytes]) -> Self {
        MarkedState {
            watched: Some(keys.iter().map(|key| (key.clone(), None)).collect()),
            ..self
        }
    }

    /// Appends to `out` the entry to restore for each record of `records`
    /// that belongs to the logged state (`value: None` deletes the key).
    pub fn resolve(&mut self, records: &[BackupEntry], out: &mut Vec<BackupEntry>) -> Result<(), CoreError> {
        for record in records {
            if BackupMarker::is_marker(record) {
                self.see_marker(record)?;
            } else if let Some(entry) = self.resolve_one(&record.key, record.value.as_deref())? {
                out.push(entry);
            }
        }
        Ok(())
    }

    fn see_marker(&mut self, record: &BackupEntry) -> Result<(), CoreError> {
        let marker = BackupMarker::from_entry(record)?;
        self.max_seq = self.max_seq.max(marker.seq);
        if self.order.admits(marker.seq) {
            self.last_marker = Some(marker);
        }
        Ok(())
    }

    fn resolve_one(&mut self, key: &EntryBytes, value: Option<&[u8]>) -> Result<Option<BackupEntry>, CoreError> {
        let logged = LoggedValue::decode(value)?;
        self.max_seq = self.max_seq.max(logged.seq);
        // A tombstone names no writer: compaction's, never fenced.
        let admitted = value.is_none() || (self.order.admits(logged.seq) && self.fence.admits(logged.seq));
        if !admitted {
            self.fenced += 1;
            if !self.rolled_back.contains_key(key) {
                self.unresolved.insert(key.clone());
            }
            return Ok(None);
        }
        self.unresolved.remove(key);
        let at_marker = logged.at_marker(self.covers)?.cloned();
        if let Some(value) = self.watched.as_mut().and_then(|watched| watched.get_mut(key)) {
            value.clone_from(&at_marker);
        }
        if logged.seq > self.covers && !logged.priors.is_empty() {
            self.rolled_back.insert(key.clone(), at_marker.clone());
        } else {
            self.rolled_back.remove(key);
        }
        Ok(Some(BackupEntry::new(key.clone(), at_marker)))
    }

    pub fn finish(self) -> Restart {
        let mut rolled_back: Vec<BackupEntry> = self
            .rolled_back
            .into_iter()
            .map(|(key, value)| BackupEntry::new(key, value))
            .collect();
        let mut unresolved = Vec::new();
        match self.watched {
            Some(watched) => rolled_back.extend(
                self.unresolved
                    .into_iter()
                    .map(|key| BackupEntry::new(key.clone(), watched.get(&key).cloned().flatten())),
            ),
            None => unresolved.extend(self.unresolved),
        }
        rolled_back.sort_unstable_by(|a, b| a.key.cmp(&b.key));
        unresolved.sort_unstable();
        Restart {
            rolled_back,
            unresolved,
            fenced: self.fenced,
            last_marker: self.last_marker,
            next_seq: next_incarnation(self.max_seq).max(self.next_seq),
        }
    }
}

/// Reads a changelog partition the way compaction leaves it or not: the
/// result is the same either way, which is what makes recovery safe under
/// compaction. Fencing ([`crate::fence`]) needs the log's order, so the
/// records are kept as read until [`ChangelogReader::finish`].
#[derive(Clone, Debug, Default)]
pub struct ChangelogReader {
    log: Vec<BackupEntry>,
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
        self.log.push(entry);
    }

    /// The state to restore: one pass finds the last marker the log's order
    /// admits, a second resolves the records against it. Fails when a marker
    /// or a record cannot be decoded: without them the task does not know
    /// where to resume, or from what.
    pub fn finish(self) -> Result<ChangelogState, CoreError> {
        let marker = last_marker_in_order(&self.log)?;
        let mut marked = MarkedState::new(marker.as_ref());
        let mut resolved = Vec::with_capacity(self.log.len());
        marked.resolve(&self.log, &mut resolved)?;
        let mut latest: FxHashMap<EntryBytes, Option<EntryBytes>> = FxHashMap::default();
        for entry in resolved {
            latest.insert(entry.key, entry.value);
        }
        let mut restart = marked.finish();
        for key in std::mem::take(&mut restart.unresolved) {
            let value = latest.get(&key).cloned().flatten();
            restart.rolled_back.push(BackupEntry::new(key, value));
        }
        restart.rolled_back.sort_unstable_by(|a, b| a.key.cmp(&b.key));
        let mut entries: Vec<BackupEntry> = latest
            .into_iter()
            .filter(|(_, value)| value.is_some())
            .map(|(key, value)| BackupEntry::new(key, value))
            .collect();
        // A deterministic order, so restores are repeatable.
        entries.sort_unstable_by(|a, b| a.key.cmp(&b.key));
        Ok(ChangelogState {
            entries,
            marker,
            records: self.log.len() as u64,
            restart,
        })
    }
}

/// The last marker of `log` that the log's order admits ([`crate::fence`]),
/// as if the log began with `log`: what a recovery resumes from.
pub fn last_marker_in_order(log: &[BackupEntry]) -> Result<Option<BackupMarker>, CoreError> {
    let mut order = LogOrder::default();
    let mut last = None;
    for record in log {
        if BackupMarker::is_marker(record) {
            let marker = BackupMarker::from_entry(record)?;
            if order.admits(marker.seq) {
                last = Some(marker);
            }
        } else if record.value.is_some() {
            order.admits(LoggedValue::seq_of(record.value.as_deref())?);
        }
    }
    Ok(last)
}

/// The log as compaction leaves it once the cleaner has gone over every
/// record: each key's latest record, in log order. Kafka keeps a deletion
/// for `delete.retention.ms` after that; `drop_deletions` is the log once
/// it has dropped them too. A recovery must hold on either (see
/// [`crate::logged`]: what it needs travels in each key's latest record).
pub fn compacted(log: Vec<BackupEntry>, drop_deletions: bool) -> Vec<BackupEntry> {
    let mut seen = FxHashSet::default();
    let mut kept: Vec<BackupEntry> = log
        .into_iter()
        .rev()
        .filter(|entry| seen.insert(entry.key.clone()) && !(drop_deletions && entry.value.is_none()))
        .collect();
    kept.reverse();
    kept
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
    /// Which records of the changelog belong to the state at the marker it
    /// resumes from ([`crate::fence`]).
    pub fence: Fence,
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
            next_seq: next_incarnation(0),
            sources: SourcePositions::default(),
            priors: CrashPriors::default(),
            fence: Fence::NONE,
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
                next_seq: next_incarnation(marker.seq),
                sources: marker.sources.clone(),
                priors: CrashPriors::default(),
                fence: marker.fence(),
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
                next_seq: next_incarnation(marker.seq),
                sources: marker.sources.clone(),
                priors: CrashPriors::default(),
                fence: marker.fence(),
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

/// What a task on a local store does between two writes of it, which bounds
/// what a restart on the store does to the outputs ([`RecoveryPlan::local`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoreWrites {
    /// The most items the task processes past its last store write: the
    /// service writes the store after every poll batch, and a task whose
    /// write is held takes no more input.
    pub max_unwritten_items: u64,
    /// γ at no failure, the largest any policy gives: the most outputs
    /// unacknowledged when the store was written.
    pub largest_gamma: u64,
}

impl RecoveryPlan {
    /// A restart on the task's own durable local store, which is exact at
    /// the checkpoint's offset and is known to hold every key any backup in
    /// the changelog wrote (the last marker is its own: `last_marker.writer`
    /// is the store's identity). The state error is zero. The store is
    /// written after the outputs of the items it includes are sent, not
    /// after they are acknowledged, so two things happen to the outputs:
    ///
    /// * the items processed past the store's last write are replayed and
    ///   their outputs, which may have landed, sent again: at most
    ///   `max_unwritten_items`·β repeated;
    /// * the outputs of items before the store's offset that were not
    ///   acknowledged at the crash may be lost: at most γ, and
    ///   `largest_gamma` bounds it.
    ///
    /// A restart after a clean stop at the store's offset is no failure.
    /// Sequences continue above the checkpoint's, so a record the crashed
    /// run left past the last marker is never taken for one of the new
    /// run's.
    pub fn local(
        checkpoint: &StoreCheckpoint,
        last_marker: Option<&BackupMarker>,
        writes: StoreWrites,
        constants: AnalysisConstants,
    ) -> Self {
        let store_offset = checkpoint.next_offset;
        let clean = last_marker.is_some_and(|m| m.clean && m.input_offset == store_offset);
        let (failures, recent) = match last_marker {
            Some(marker) => (marker.failures, marker.recent),
            None => (0, RecentFailures::default()),
        };
        let covers = last_marker.map_or(0, |m| m.covers);
        let next_seq = next_incarnation(
            last_marker
                .map_or(0, |m| m.seq)
                .max(checkpoint.next_seq.saturating_sub(1)),
        );
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
                fence: Fence::NONE,
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
                outputs: writes.max_unwritten_items.saturating_mul(constants.beta) as f64,
                lost_outputs: writes.largest_gamma as f64,
            },
            source: ResumeSource::LocalStore,
            recent,
            covers,
            next_seq,
            sources,
            priors,
            fence: Fence::NONE,
        }
    }

    /// What the markers of the incarnation this plan starts inherit: the
    /// last earlier backup its state includes ([`crate::fence`]). A restore
    /// from a marker includes what that marker covers; any other start
    /// (the log as it was, or a local store that holds every key the log
    /// wrote) includes every one.
    pub fn inherited(&self) -> u64 {
        match self.source {
            ResumeSource::Marker => self.covers,
            ResumeSource::Committed | ResumeSource::Beginning | ResumeSource::LocalStore => u64::MAX,
        }
    }
}

#[cfg(test)]
mod tests;
