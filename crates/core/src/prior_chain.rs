//! What the driver knows of the priors of the keys it writes (see
//! [`crate::logged`] for why each record carries them).
//!
//! In the common case every record's one certain prior is its structure's
//! baseline, which the structure wrote into the record already. That stops
//! being true in two ways, and [`PriorChain`] tracks both until a marker in
//! the log settles them:
//!
//! * a write reported failed may have landed or not, and its marker too: each
//!   key it wrote may hold its value or what it held before at the markers
//!   that may end the log. The chain keeps those values, newest first, with
//!   their backups' sequences, down to a certain one, and the key's next
//!   record carries them all;
//! * a backup taken but never sent (abandoned) moved the structure's baseline
//!   without writing: the key's next record needs the prior from before the
//!   oldest such backup.
//!
//! The chain also holds the records of every backup sent until a marker that
//! covers it is acknowledged: a failure reads the keys' values and priors back
//! from them.
//!
//! A restart on a local store goes on writing the same changelog without
//! reading it, so it must know what a crash made uncertain: every write in
//! flight may have landed or not, like a failed one, and every backup taken
//! but not sent is abandoned. [`PriorChain::crash_view`] is that knowledge as
//! of a store write ([`CrashPriors`], kept with the state), and
//! [`PriorChain::resumed`] the chain a restart on the store continues with.

use std::collections::VecDeque;

use rustc_hash::FxHashMap;

use super::batch::BackupBatch;
use super::entry::{EntryBytes, PayloadReader};
use super::error::CoreError;
use super::logged::{LoggedValue, Prior, Priors, CERTAIN};
use super::spares::Spares;

/// Backup buffers kept for reuse (see [`crate::spares`]): up to 2 MiB of
/// records a task.
const SPARE_BATCHES: usize = 32;
const SPARE_BYTES: usize = 2 << 20;

/// The priors of the keys whose latest writes may or may not be in the log
/// (see the module docs): the driver hands it each backup it sends and tells
/// it what became of each.
#[derive(Clone, Debug, Default)]
pub struct PriorChain {
    /// Keys a failed write (or a backup whose marker failed) touched: their
    /// possible values, newest first, down to a certain one.
    uncertain: FxHashMap<EntryBytes, Priors>,
    /// Keys an abandoned backup moved the structure's baseline of: the oldest
    /// such backup and the prior from before it (certain unless `uncertain`
    /// knows better).
    abandoned: FxHashMap<EntryBytes, (u64, Option<EntryBytes>)>,
    /// The backups sent whose marker is not acknowledged yet, oldest first: a
    /// failure reads its keys' values and priors back.
    sent: VecDeque<BackupBatch>,
    /// Buffers of covered or abandoned backups, for reuse.
    spare: Spares<BackupBatch, SPARE_BATCHES, SPARE_BYTES>,
}

/// What a crash at a store write would leave uncertain (see the module
/// docs): the keys' possible values at the markers that may end the log, and
/// the priors of the keys whose baselines moved without a write.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CrashPriors {
    uncertain: FxHashMap<EntryBytes, Priors>,
    abandoned: FxHashMap<EntryBytes, (u64, Option<EntryBytes>)>,
}

const UNCERTAIN: u8 = 1;
const ABANDONED: u8 = 2;

impl CrashPriors {
    /// Appends the keys, each as `[kind][key length: u32][key][logged length:
    /// u32][logged value]`, behind their count; a logged value holds an
    /// uncertain key's priors, or an abandoned key's backup and prior.
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&((self.uncertain.len() + self.abandoned.len()) as u32).to_le_bytes());
        let uncertain = self.uncertain.iter().map(|(key, priors)| {
            let logged = LoggedValue {
                seq: 0,
                value: None,
                priors: priors.clone(),
            };
            (UNCERTAIN, key, logged)
        });
        let abandoned = self.abandoned.iter().map(|(key, (seq, prior))| {
            let logged = LoggedValue {
                seq: *seq,
                value: prior.clone(),
                priors: Priors::new(),
            };
            (ABANDONED, key, logged)
        });
        let mut logged_bytes = Vec::new();
        for (kind, key, logged) in uncertain.chain(abandoned) {
            logged_bytes.clear();
            logged.encode_into(&mut logged_bytes);
            out.push(kind);
            out.extend_from_slice(&(key.len() as u32).to_le_bytes());
            out.extend_from_slice(key);
            out.extend_from_slice(&(logged_bytes.len() as u32).to_le_bytes());
            out.extend_from_slice(&logged_bytes);
        }
    }

    /// Reads what [`Self::encode_into`] wrote.
    pub fn decode_from(reader: &mut PayloadReader<'_>) -> Result<Self, CoreError> {
        let mut out = CrashPriors::default();
        for _ in 0..reader.u32()? {
            let kind = reader.u8()?;
            let key_len = reader.u32()? as usize;
            let key = EntryBytes::from_slice(reader.bytes(key_len)?);
            let logged_len = reader.u32()? as usize;
            let logged = LoggedValue::decode(Some(reader.bytes(logged_len)?))?;
            match kind {
                UNCERTAIN => {
                    out.uncertain.insert(key, logged.priors);
                }
                ABANDONED => {
                    out.abandoned.insert(key, (logged.seq, logged.value));
                }
                other => {
                    return Err(CoreError::undecodable("crash priors", format!("kind {other}")));
                }
            }
        }
        Ok(out)
    }
}

impl PriorChain {
    pub fn new() -> Self {
        PriorChain::default()
    }

    /// The chain a restart on a local store continues with: what the crash
    /// left uncertain, as of the store's last write.
    pub fn resumed(crash: CrashPriors) -> Self {
        PriorChain {
            uncertain: crash.uncertain,
            abandoned: crash.abandoned,
            ..PriorChain::default()
        }
    }

    /// What a crash now would leave uncertain: every backup sent and not yet
    /// covered by an acknowledged marker as if its write failed (oldest
    /// first, as failures are reported), then every backup taken and not
    /// sent (`held`, oldest first) as abandoned.
    pub fn crash_view<'a>(&self, held: impl DoubleEndedIterator<Item = &'a BackupBatch>) -> CrashPriors {
        let mut view = PriorChain {
            uncertain: self.uncertain.clone(),
            abandoned: self.abandoned.clone(),
            ..PriorChain::default()
        };
        for batch in &self.sent {
            view.fail_records(batch);
        }
        // Abandoned backups come newest first.
        for batch in held.rev() {
            view.abandon_records(batch);
        }
        CrashPriors {
            uncertain: view.uncertain,
            abandoned: view.abandoned,
        }
    }

    /// An empty batch for backup `seq`, on the buffers of one done with.
    pub fn batch(&mut self, seq: u64) -> BackupBatch {
        let mut batch = self.spare.take();
        batch.reset(seq);
        batch
    }

    /// The changelog records of a backup about to be sent. Each record
    /// carries its structure's baseline as its one certain prior, which
    /// stands unless a failure made the key's prior uncertain: such records
    /// are written again with the chain. Kept until a marker covering them is
    /// acknowledged.
    pub fn log(&mut self, batch: BackupBatch) -> &BackupBatch {
        let batch = if self.is_settled() { batch } else { self.rewrite(batch) };
        self.sent.push_back(batch);
        &self.sent[self.sent.len() - 1]
    }

    fn rewrite(&mut self, batch: BackupBatch) -> BackupBatch {
        let mut out = self.batch(batch.seq());
        for record in batch.iter() {
            // Written by `BackupBatch::push`: it decodes.
            let Ok(mut logged) = LoggedValue::decode(Some(record.value)) else {
                continue;
            };
            let baseline = logged.priors.first().and_then(|prior| prior.value.clone());
            logged.priors = self.priors_of(record.key, baseline);
            out.push_logged(record.key, &logged);
        }
        self.recycle(batch);
        out
    }

    fn priors_of(&mut self, key: &[u8], baseline: Option<EntryBytes>) -> Priors {
        if let Some(priors) = self.uncertain.remove(key) {
            self.abandoned.remove(key);
            return priors;
        }
        let value = match self.abandoned.remove(key) {
            Some((_, prior)) => prior,
            None => baseline,
        };
        let mut priors = Priors::new();
        priors.push(Prior { seq: CERTAIN, value });
        priors
    }

    /// Backup `seq` failed, or its marker did: each key it wrote may hold its
    /// value or what it held before. Failures are reported in the order the
    /// writes went out, so a chain a key has already (from an earlier failed
    /// write) is older history than this backup's certain prior.
    pub fn failed(&mut self, seq: u64) {
        let Some(index) = self.sent.iter().position(|batch| batch.seq() == seq) else {
            return;
        };
        let Some(batch) = self.sent.remove(index) else {
            return;
        };
        self.fail_records(&batch);
        self.recycle(batch);
    }

    fn fail_records(&mut self, batch: &BackupBatch) {
        let seq = batch.seq();
        for record in batch.iter() {
            let Ok(logged) = LoggedValue::decode(Some(record.value)) else {
                continue;
            };
            let key = EntryBytes::from_slice(record.key);
            let older = self.uncertain.remove(&key).unwrap_or(logged.priors);
            let mut priors = Priors::with_capacity(older.len() + 1);
            priors.push(Prior {
                seq,
                value: logged.value,
            });
            priors.extend(older);
            self.uncertain.insert(key, priors);
        }
    }

    /// A backup taken but never sent: the structure moved its baseline to it,
    /// so the keys' next entries need the prior from before the oldest such
    /// backup (abandoned backups come newest first).
    pub fn abandoned(&mut self, batch: BackupBatch) {
        self.abandon_records(&batch);
        self.recycle(batch);
    }

    fn abandon_records(&mut self, batch: &BackupBatch) {
        let seq = batch.seq();
        for record in batch.iter() {
            let Ok(logged) = LoggedValue::decode(Some(record.value)) else {
                continue;
            };
            let prior = (seq, logged.priors.into_iter().next().and_then(|prior| prior.value));
            self.abandoned
                .entry(EntryBytes::from_slice(record.key))
                .and_modify(|known| {
                    if seq < known.0 {
                        *known = prior.clone();
                    }
                })
                .or_insert(prior);
        }
    }

    /// Keeps a few buffers for the next backups, not every one a burst of
    /// failures or a large final backup left.
    fn recycle(&mut self, batch: BackupBatch) {
        self.spare.give(batch);
    }

    /// A marker covering the backups up to `covers` is acknowledged: their
    /// entries are in the log behind it, so nothing about them is uncertain.
    pub fn covered(&mut self, covers: u64) {
        while self.sent.front().is_some_and(|batch| batch.seq() <= covers) {
            if let Some(batch) = self.sent.pop_front() {
                self.recycle(batch);
            }
        }
        if !self.uncertain.is_empty() {
            self.uncertain
                .retain(|_, priors| priors.first().is_some_and(|newest| newest.seq > covers));
        }
    }

    /// Whether any key's prior differs from its structure's baseline.
    pub fn is_settled(&self) -> bool {
        self.uncertain.is_empty() && self.abandoned.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::entry::encode_f64;

    fn bytes(v: f64) -> EntryBytes {
        encode_f64(v)
    }
    /// Backup `seq` of one entry, as its structure writes it.
    fn backup(chain: &mut PriorChain, seq: u64, key: &[u8], value: f64, prior: Option<f64>) -> BackupBatch {
        let mut batch = chain.batch(seq);
        batch.push_f64(1, |out| out.extend_from_slice(key), value, prior);
        batch
    }

    /// Sends backup `seq` of one entry and decodes its record as logged.
    fn log(chain: &mut PriorChain, seq: u64, key: &[u8], value: f64, prior: Option<f64>) -> LoggedValue {
        let batch = backup(chain, seq, key, value, prior);
        let logged = chain.log(batch);
        LoggedValue::decode(logged.iter().next().map(|record| record.value)).unwrap()
    }

    /// A done batch with room for about `bytes`.
    fn done_batch(bytes: usize) -> BackupBatch {
        let mut batch = BackupBatch::new(1);
        batch.push_f64(1, |out| out.extend_from_slice(b"k"), 1.0, None);
        let record = batch.encoded_len();
        batch.reserve_like_last(bytes / record);
        batch
    }

    #[test]
    fn a_backup_takes_the_roomiest_spare_and_spares_stay_within_their_budget() {
        let mut chain = PriorChain::new();
        chain.recycle(done_batch(100));
        chain.recycle(done_batch(SPARE_BYTES / 2));
        chain.recycle(done_batch(200));
        assert!(chain.batch(2).capacity() >= SPARE_BYTES / 2);
        assert!(chain.batch(3).capacity() < SPARE_BYTES / 2);
        // Within the budget a large one is kept; past it, let go.
        chain.recycle(done_batch(SPARE_BYTES / 2));
        chain.recycle(done_batch(SPARE_BYTES / 2 + 1024));
        assert_eq!(chain.spare.len(), 2);
        assert!(chain.spare.iter().map(BackupBatch::capacity).sum::<usize>() <= SPARE_BYTES);
    }

    #[test]
    fn a_restart_on_a_store_continues_with_what_its_crash_left_uncertain() {
        let mut chain = PriorChain::new();
        log(&mut chain, 1, b"k", 5.0, Some(2.0));
        // Backup 2 was taken and never sent: its baseline move is undone.
        let held = backup(&mut chain, 2, b"j", 1.0, None);
        let view = chain.crash_view(std::iter::once(&held));
        let mut encoded = Vec::new();
        view.encode_into(&mut encoded);
        let read = CrashPriors::decode_from(&mut PayloadReader::new(&encoded, "test")).unwrap();
        assert_eq!(read, view, "reads back as written");
        assert!(chain.crash_view(std::iter::empty()) != view, "the held backup counts");

        let mut resumed = PriorChain::resumed(read);
        let k = log(&mut resumed, 3, b"k", 6.0, Some(5.0));
        assert_eq!(
            k.at_marker(0).unwrap(),
            Some(&bytes(2.0)),
            "backup 1 may not have landed"
        );
        assert_eq!(
            k.at_marker(1).unwrap(),
            Some(&bytes(5.0)),
            "or it may have, with its marker"
        );
        let j = log(&mut resumed, 3, b"j", 4.0, Some(1.0));
        assert_eq!(j.at_marker(0).unwrap(), None, "j was never written");
        assert!(PriorChain::resumed(CrashPriors::default()).is_settled());
    }

    #[test]
    fn a_sent_entry_carries_its_structures_baseline_until_a_failure() {
        let mut chain = PriorChain::new();
        let first = log(&mut chain, 1, b"k", 5.0, Some(2.0));
        assert_eq!(
            first.priors.as_slice(),
            &[Prior {
                seq: CERTAIN,
                value: Some(bytes(2.0))
            }]
        );
        chain.failed(1);
        // The structure's baseline moved to 5 when backup 1 was taken.
        let again = log(&mut chain, 3, b"k", 6.0, Some(5.0));
        assert_eq!(
            again.priors.as_slice(),
            &[
                Prior {
                    seq: 1,
                    value: Some(bytes(5.0))
                },
                Prior {
                    seq: CERTAIN,
                    value: Some(bytes(2.0))
                }
            ]
        );
        assert_eq!(again.at_marker(0).unwrap(), Some(&bytes(2.0)));
        assert_eq!(again.at_marker(1).unwrap(), Some(&bytes(5.0)));
        chain.covered(3);
        assert!(chain.is_settled());
        let later = log(&mut chain, 4, b"k", 7.0, Some(6.0));
        assert_eq!(later.priors.len(), 1, "a covered write is certain again");
    }

    #[test]
    fn an_acknowledged_marker_settles_what_it_covers_and_frees_its_records() {
        let mut chain = PriorChain::new();
        log(&mut chain, 1, b"k", 5.0, Some(2.0));
        log(&mut chain, 3, b"j", 1.0, None);
        // Backup 1's marker failed: its entries may stand uncovered.
        chain.failed(1);
        assert!(!chain.is_settled());
        chain.covered(2);
        assert!(chain.is_settled(), "a marker over backup 1 is in the log");
        chain.failed(1);
        assert!(chain.is_settled(), "backup 1's records were let go");
        // Backup 3 is not covered yet: its failure still counts.
        chain.failed(3);
        assert!(!chain.is_settled());
        let next = log(&mut chain, 5, b"j", 2.0, Some(1.0));
        assert_eq!(next.at_marker(2).unwrap(), None, "j did not exist before backup 3");
        chain.covered(5);
        chain.failed(3);
        assert!(chain.is_settled(), "covering 5 let backup 3 go too");
        // A marker short of a failed backup settles nothing of it; one that
        // covers it exactly does.
        log(&mut chain, 7, b"m", 1.0, None);
        chain.failed(7);
        chain.covered(6);
        assert!(!chain.is_settled(), "backup 7 may or may not be in the log");
        chain.covered(7);
        assert!(chain.is_settled(), "a marker over backup 7 is in the log");
    }

    #[test]
    fn failures_in_a_row_keep_every_possible_value() {
        let mut chain = PriorChain::new();
        log(&mut chain, 1, b"k", 1.0, Some(0.0));
        log(&mut chain, 2, b"k", 2.0, Some(1.0));
        chain.failed(1);
        chain.failed(2);
        let next = log(&mut chain, 3, b"k", 3.0, Some(2.0));
        let seqs: Vec<u64> = next.priors.iter().map(|p| p.seq).collect();
        assert_eq!(seqs, vec![2, 1, CERTAIN]);
        assert_eq!(next.at_marker(0).unwrap(), Some(&bytes(0.0)));
        assert_eq!(next.at_marker(1).unwrap(), Some(&bytes(1.0)));
        assert_eq!(next.at_marker(2).unwrap(), Some(&bytes(2.0)));
    }

    #[test]
    fn a_crash_view_keeps_what_earlier_failures_and_abandons_left() {
        let mut chain = PriorChain::new();
        log(&mut chain, 1, b"k", 1.0, Some(0.0));
        chain.failed(1);
        let abandoned = backup(&mut chain, 2, b"j", 3.0, Some(2.0));
        chain.abandoned(abandoned);
        // Nothing in flight or held: the view is what the chain knows.
        let mut resumed = PriorChain::resumed(chain.crash_view(std::iter::empty()));
        let k = log(&mut resumed, 3, b"k", 1.5, Some(1.0));
        let seqs: Vec<u64> = k.priors.iter().map(|p| p.seq).collect();
        assert_eq!(
            seqs,
            vec![1, CERTAIN],
            "backup 1 failed: it may or may not be in the log"
        );
        assert_eq!(k.at_marker(0).unwrap(), Some(&bytes(0.0)));
        let j = log(&mut resumed, 3, b"j", 3.5, Some(3.0));
        assert_eq!(j.at_marker(0).unwrap(), Some(&bytes(2.0)), "backup 2 was never sent");
    }

    #[test]
    fn an_abandoned_backup_leaves_the_prior_from_before_it() {
        let mut chain = PriorChain::new();
        let abandoned = backup(&mut chain, 3, b"k", 4.0, Some(2.0));
        chain.abandoned(abandoned);
        let abandoned = backup(&mut chain, 2, b"k", 2.0, Some(1.0));
        chain.abandoned(abandoned);
        let abandoned = backup(&mut chain, 4, b"k", 5.0, Some(4.0));
        chain.abandoned(abandoned);
        assert!(!chain.is_settled());
        let next = log(&mut chain, 5, b"k", 4.5, Some(4.0));
        assert_eq!(next.at_marker(0).unwrap(), Some(&bytes(1.0)));
        assert!(chain.is_settled());
    }
}
