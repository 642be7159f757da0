//! How a backup entry is written to the changelog, so that a recovery can
//! rebuild the state logged *at the last marker* from what compaction keeps.
//!
//! A crash can leave entries of a backup after the last marker in the log: the
//! changelog is gapless and each marker follows its backup's entries, so a
//! crash between a backup's entries and its marker leaves part of that backup
//! behind the last marker. Restoring those entries as they are and replaying
//! the input from the marker would apply the items between the marker and that
//! backup twice to the keys it wrote. So every logged entry carries:
//!
//! * the sequence number of its backup (sequences grow across runs: a run
//!   starts above every sequence its changelog holds), and every marker the
//!   sequence of the last backup it covers: an entry is *covered* when its
//!   backup's sequence is at most the last marker's;
//! * its **priors**: what the key held in the log before this entry, for every
//!   marker that could end the log while this entry is the key's latest record.
//!   Recovery restores an uncovered entry's prior instead of its value.
//!
//! Why one prior is almost always enough: backups go out in order, each with
//! its marker right behind its entries, over a gapless log, so if an entry of
//! backup b is in the log, every backup and marker sent before b is too. The
//! last marker then covers at least the key's previous write, and the prior is
//! the value of that write (the structures keep it: it is the baseline the
//! divergence is measured from). It is marked *certain* (sequence 0: backup
//! sequences start at 1), meaning "the value at any marker that can precede
//! this entry". A write reported failed breaks that chain: it may have landed
//! or not, and its marker too, and the backups after it are sent once every
//! write in flight is reported. So [`PriorChain`] keeps, for each key a failed
//! write (or a backup whose marker failed) touched, every value it may hold at
//! the possible last markers, newest first with their sequences, down to a
//! certain one; the next entry of that key carries that chain. A backup taken
//! but never sent (abandoned) moved the structure's baseline without writing:
//! the chain remembers the key's prior from before it.
//!
//! A recovery that restored priors writes them again, under a new sequence,
//! before its start marker ([`crate::recovery::ChangelogState::rolled_back`]),
//! so the uncovered entries of the crashed run are superseded and the start
//! marker covers a log whose latest records are exactly the restored state.
//!
//! Layout of a logged value (`ENVELOPE_VERSION`), every integer an unsigned
//! LEB128 varint: `[2][backup seq][value][n][n × (seq, value)]` where a value
//! is `0` for no key, or its length + 1 followed by its bytes. An f64 entry
//! with one prior takes about 26 bytes, so it stays inline in [`EntryBytes`].
//! Values of version 1 (written before priors existed) are read as covered by
//! any marker.

use std::collections::VecDeque;

use rustc_hash::FxHashMap;
use smallvec::SmallVec;

use super::entry::{BackupEntry, EntryBytes, ENCODING_VERSION};
use super::error::CoreError;

/// The version byte of a logged value with its backup sequence and priors.
pub const ENVELOPE_VERSION: u8 = 2;

/// The sequence of a certain prior: the value at any marker that can precede
/// the entry. Backup sequences start at 1.
pub const CERTAIN: u64 = 0;

/// One possible earlier value of a key: the sequence of the backup that wrote
/// it ([`CERTAIN`] for the certain one) and the value (`None`: no key).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Prior {
    pub seq: u64,
    pub value: Option<EntryBytes>,
}

/// A key's possible earlier values, newest first, ending with a certain one.
pub type Priors = SmallVec<[Prior; 1]>;

/// A changelog record of a backup entry, decoded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoggedValue {
    /// The backup it belongs to (0 for records written before priors existed).
    pub seq: u64,
    /// The key's value (`None`: the key is deleted).
    pub value: Option<EntryBytes>,
    /// Empty for records written before priors existed.
    pub priors: Priors,
}

impl LoggedValue {
    /// The value of the key in the state logged at a marker covering backups up
    /// to `covers`: the record's own if covered, else its newest prior that
    /// is. `None` inside: no key.
    pub fn at_marker(&self, covers: u64) -> Result<Option<&EntryBytes>, CoreError> {
        if self.seq <= covers || self.priors.is_empty() {
            return Ok(self.value.as_ref());
        }
        self.priors
            .iter()
            .find(|prior| prior.seq <= covers)
            .map(|prior| prior.value.as_ref())
            .ok_or_else(|| {
                CoreError::undecodable(
                    "logged entry",
                    format!(
                        "backup {} has no prior the last marker covers (it covers backups up to {covers}; priors of backups {:?})",
                        self.seq,
                        self.priors.iter().map(|p| p.seq).collect::<Vec<_>>()
                    ),
                )
            })
    }

    pub fn encode(&self) -> EntryBytes {
        let priors = self.priors.iter().map(|prior| (prior.seq, prior.value.as_deref()));
        encode_parts(self.seq, self.value.as_deref(), priors)
    }

    /// Decodes a changelog record's value (`None`: a tombstone).
    pub fn decode(bytes: Option<&[u8]>) -> Result<Self, CoreError> {
        let Some(bytes) = bytes else {
            return Ok(LoggedValue {
                seq: 0,
                value: None,
                priors: Priors::new(),
            });
        };
        match bytes.first() {
            Some(&ENCODING_VERSION) => Ok(LoggedValue {
                seq: 0,
                value: Some(EntryBytes::from_slice(bytes)),
                priors: Priors::new(),
            }),
            Some(&ENVELOPE_VERSION) => decode_envelope(&bytes[1..]),
            Some(&found) => Err(CoreError::UnknownEncodingVersion {
                found,
                supported: ENVELOPE_VERSION,
            }),
            None => Err(CoreError::undecodable("logged entry", "empty value")),
        }
    }
}

/// The envelope of a record from its parts, so that the common record (one
/// certain prior) is encoded without building a [`LoggedValue`] first.
fn encode_parts<'a>(
    seq: u64,
    value: Option<&[u8]>,
    priors: impl ExactSizeIterator<Item = (u64, Option<&'a [u8]>)>,
) -> EntryBytes {
    let mut out = EntryBytes::new();
    out.push(ENVELOPE_VERSION);
    push_varint(&mut out, seq);
    push_value(&mut out, value);
    push_varint(&mut out, priors.len() as u64);
    for (seq, value) in priors {
        push_varint(&mut out, seq);
        push_value(&mut out, value);
    }
    out
}

/// The envelope of a record whose one prior is certain.
fn encode_with_certain_prior(seq: u64, value: Option<&[u8]>, prior: Option<&[u8]>) -> EntryBytes {
    encode_parts(seq, value, std::iter::once((CERTAIN, prior)))
}

fn push_varint(out: &mut EntryBytes, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

fn push_value(out: &mut EntryBytes, value: Option<&[u8]>) {
    match value {
        None => out.push(0),
        Some(bytes) => {
            push_varint(out, bytes.len() as u64 + 1);
            out.extend_from_slice(bytes);
        }
    }
}

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], CoreError> {
        if self.0.len() < n {
            return Err(CoreError::undecodable(
                "logged entry",
                format!("truncated: needed {n} more bytes, {} left", self.0.len()),
            ));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn varint(&mut self) -> Result<u64, CoreError> {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let byte = self.take(1)?[0];
            value |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                return Ok(value);
            }
        }
        Err(CoreError::undecodable("logged entry", "a varint longer than 64 bits"))
    }

    fn value(&mut self) -> Result<Option<EntryBytes>, CoreError> {
        match self.varint()? {
            0 => Ok(None),
            len => {
                let len = usize::try_from(len - 1)
                    .map_err(|_| CoreError::undecodable("logged entry", "a value longer than memory"))?;
                Ok(Some(EntryBytes::from_slice(self.take(len)?)))
            }
        }
    }
}

fn decode_envelope(bytes: &[u8]) -> Result<LoggedValue, CoreError> {
    let mut reader = Reader(bytes);
    let seq = reader.varint()?;
    let value = reader.value()?;
    let count = reader.varint()?;
    let mut priors = Priors::new();
    for _ in 0..count {
        let seq = reader.varint()?;
        priors.push(Prior {
            seq,
            value: reader.value()?,
        });
    }
    if !reader.0.is_empty() {
        return Err(CoreError::undecodable(
            "logged entry",
            format!("{} unexpected trailing bytes", reader.0.len()),
        ));
    }
    Ok(LoggedValue { seq, value, priors })
}

/// The priors of the keys whose latest writes may or may not be in the log
/// (see the module docs): the driver asks it for each entry it sends and tells
/// it what became of each backup.
#[derive(Clone, Debug, Default)]
pub struct PriorChain {
    /// Keys a failed write (or a backup whose marker failed) touched: their
    /// possible values, newest first, down to a certain one.
    uncertain: FxHashMap<EntryBytes, Priors>,
    /// Keys an abandoned backup moved the structure's baseline of: the oldest
    /// such backup and the prior from before it (certain unless `uncertain`
    /// knows better).
    abandoned: FxHashMap<EntryBytes, (u64, Option<EntryBytes>)>,
    /// The records of the backups sent whose marker is not acknowledged yet,
    /// oldest first: a failure reads its keys' values and priors back.
    sent: VecDeque<(u64, Vec<BackupEntry>)>,
    /// Buffers of covered backups, for reuse.
    spare: Vec<Vec<BackupEntry>>,
}

impl PriorChain {
    pub fn new() -> Self {
        PriorChain::default()
    }

    /// The changelog records of backup `seq`'s entries, each with its
    /// sequence and priors; an entry's `prior` is the structure's baseline,
    /// used unless a failure made it uncertain. Kept until a marker covering
    /// them is acknowledged.
    pub fn log(&mut self, seq: u64, entries: &[BackupEntry]) -> &[BackupEntry] {
        let mut records = self.spare.pop().unwrap_or_default();
        records.clear();
        for entry in entries {
            let value = if self.is_settled() {
                // The common case: the structure's baseline is the one prior.
                encode_with_certain_prior(seq, entry.value.as_deref(), entry.prior.as_deref())
            } else {
                let priors = self.priors_of(entry);
                LoggedValue {
                    seq,
                    value: entry.value.clone(),
                    priors,
                }
                .encode()
            };
            records.push(BackupEntry::new(entry.key.clone(), Some(value)));
        }
        self.sent.push_back((seq, records));
        self.sent.back().map_or(&[], |(_, records)| records.as_slice())
    }

    fn priors_of(&mut self, entry: &BackupEntry) -> Priors {
        if !self.uncertain.is_empty() {
            if let Some(priors) = self.uncertain.remove(&entry.key) {
                self.abandoned.remove(&entry.key);
                return priors;
            }
        }
        let value = if self.abandoned.is_empty() {
            entry.prior.clone()
        } else {
            self.abandoned
                .remove(&entry.key)
                .map_or_else(|| entry.prior.clone(), |(_, prior)| prior)
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
        let Some(index) = self.sent.iter().position(|(s, _)| *s == seq) else {
            return;
        };
        let Some((_, records)) = self.sent.remove(index) else {
            return;
        };
        for record in records {
            // Written by `log` just before: it decodes.
            let Ok(logged) = LoggedValue::decode(record.value.as_deref()) else {
                continue;
            };
            let older = self.uncertain.remove(&record.key).unwrap_or(logged.priors);
            let mut priors = Priors::with_capacity(older.len() + 1);
            priors.push(Prior {
                seq,
                value: logged.value,
            });
            priors.extend(older);
            self.uncertain.insert(record.key, priors);
        }
    }

    /// The entries of backup `seq`, taken but never sent: the structure moved
    /// its baseline to them, so the keys' next entries need the prior from
    /// before the oldest such backup (abandoned backups come newest first).
    pub fn abandoned(&mut self, seq: u64, entries: &[BackupEntry]) {
        for entry in entries {
            let prior = (seq, entry.prior.clone());
            self.abandoned
                .entry(entry.key.clone())
                .and_modify(|known| {
                    if seq < known.0 {
                        *known = prior.clone();
                    }
                })
                .or_insert(prior);
        }
    }

    /// A marker covering the backups up to `covers` is acknowledged: their
    /// entries are in the log behind it, so nothing about them is uncertain.
    pub fn covered(&mut self, covers: u64) {
        while self.sent.front().is_some_and(|(seq, _)| *seq <= covers) {
            if let Some((_, records)) = self.sent.pop_front() {
                self.spare.push(records);
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
    use crate::entry::{encode_f64, entry_key};

    fn bytes(v: f64) -> EntryBytes {
        encode_f64(v)
    }

    fn entry(key: &[u8], value: f64, prior: Option<f64>) -> BackupEntry {
        BackupEntry {
            key: entry_key(1, key),
            value: Some(bytes(value)),
            prior: prior.map(bytes),
        }
    }

    fn decoded(record: &BackupEntry) -> LoggedValue {
        LoggedValue::decode(record.value.as_deref()).unwrap()
    }

    #[test]
    fn an_envelope_round_trips_and_refuses_garbage() {
        let value = LoggedValue {
            seq: 42,
            value: Some(bytes(3.5)),
            priors: [
                Prior { seq: 40, value: None },
                Prior {
                    seq: CERTAIN,
                    value: Some(bytes(1.0)),
                },
            ]
            .into_iter()
            .collect(),
        };
        let encoded = value.encode();
        assert_eq!(LoggedValue::decode(Some(&encoded)).unwrap(), value);
        assert!(LoggedValue::decode(Some(&encoded[..encoded.len() - 1])).is_err());
        let mut longer = encoded.clone();
        longer.push(0);
        assert!(LoggedValue::decode(Some(&longer)).is_err());
        let mut long = encoded.clone();
        long[2] = 60;
        assert!(
            LoggedValue::decode(Some(&long)).is_err(),
            "a value longer than the record"
        );
        assert!(
            encoded.len() <= 32 && !encoded.spilled(),
            "{} bytes stay inline",
            encoded.len()
        );
        assert!(matches!(
            LoggedValue::decode(Some(&[9, 0])),
            Err(CoreError::UnknownEncodingVersion { found: 9, .. })
        ));
    }

    #[test]
    fn an_uncovered_record_gives_its_newest_covered_prior() {
        let value = LoggedValue {
            seq: 9,
            value: Some(bytes(9.0)),
            priors: [
                Prior {
                    seq: 7,
                    value: Some(bytes(7.0)),
                },
                Prior {
                    seq: CERTAIN,
                    value: None,
                },
            ]
            .into_iter()
            .collect(),
        };
        assert_eq!(value.at_marker(9).unwrap(), Some(&bytes(9.0)), "covered");
        assert_eq!(value.at_marker(8).unwrap(), Some(&bytes(7.0)));
        assert_eq!(value.at_marker(6).unwrap(), None, "the key did not exist");
        let old = LoggedValue::decode(Some(&bytes(5.0))).unwrap();
        assert_eq!(old.at_marker(0).unwrap(), Some(&bytes(5.0)), "version 1 is covered");
    }

    #[test]
    fn a_sent_entry_carries_its_structures_baseline_until_a_failure() {
        let mut chain = PriorChain::new();
        let first = chain.log(1, &[entry(b"k", 5.0, Some(2.0))])[0].clone();
        assert_eq!(
            decoded(&first).priors.as_slice(),
            &[Prior {
                seq: CERTAIN,
                value: Some(bytes(2.0))
            }]
        );
        chain.failed(1);
        // The structure's baseline moved to 5 when backup 1 was taken.
        let again = decoded(&chain.log(3, &[entry(b"k", 6.0, Some(5.0))])[0]);
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
        let later = decoded(&chain.log(4, &[entry(b"k", 7.0, Some(6.0))])[0]);
        assert_eq!(later.priors.len(), 1, "a covered write is certain again");
    }

    #[test]
    fn the_common_case_encodes_as_a_record_with_one_certain_prior() {
        for (value, prior) in [
            (Some(bytes(2.0)), Some(bytes(1.0))),
            (None, Some(bytes(1.0))),
            (Some(bytes(2.0)), None),
        ] {
            let record = LoggedValue {
                seq: 300,
                value: value.clone(),
                priors: [Prior {
                    seq: CERTAIN,
                    value: prior.clone(),
                }]
                .into_iter()
                .collect(),
            };
            assert_eq!(
                encode_with_certain_prior(300, value.as_deref(), prior.as_deref()),
                record.encode()
            );
        }
    }

    #[test]
    fn an_acknowledged_marker_settles_what_it_covers_and_frees_its_records() {
        let mut chain = PriorChain::new();
        chain.log(1, &[entry(b"k", 5.0, Some(2.0))]);
        chain.log(3, &[entry(b"j", 1.0, None)]);
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
        let next = decoded(&chain.log(5, &[entry(b"j", 2.0, Some(1.0))])[0]);
        assert_eq!(next.at_marker(2).unwrap(), None, "j did not exist before backup 3");
        chain.covered(5);
        chain.failed(3);
        assert!(chain.is_settled(), "covering 5 let backup 3 go too");
        // A marker short of a failed backup settles nothing of it; one that
        // covers it exactly does.
        chain.log(7, &[entry(b"m", 1.0, None)]);
        chain.failed(7);
        chain.covered(6);
        assert!(!chain.is_settled(), "backup 7 may or may not be in the log");
        chain.covered(7);
        assert!(chain.is_settled(), "a marker over backup 7 is in the log");
    }

    #[test]
    fn failures_in_a_row_keep_every_possible_value() {
        let mut chain = PriorChain::new();
        chain.log(1, &[entry(b"k", 1.0, Some(0.0))]);
        chain.log(2, &[entry(b"k", 2.0, Some(1.0))]);
        chain.failed(1);
        chain.failed(2);
        let next = decoded(&chain.log(3, &[entry(b"k", 3.0, Some(2.0))])[0]);
        let seqs: Vec<u64> = next.priors.iter().map(|p| p.seq).collect();
        assert_eq!(seqs, vec![2, 1, CERTAIN]);
        assert_eq!(next.at_marker(0).unwrap(), Some(&bytes(0.0)));
        assert_eq!(next.at_marker(1).unwrap(), Some(&bytes(1.0)));
        assert_eq!(next.at_marker(2).unwrap(), Some(&bytes(2.0)));
    }

    #[test]
    fn an_abandoned_backup_leaves_the_prior_from_before_it() {
        let mut chain = PriorChain::new();
        chain.abandoned(3, &[entry(b"k", 4.0, Some(2.0))]);
        chain.abandoned(2, &[entry(b"k", 2.0, Some(1.0))]);
        chain.abandoned(4, &[entry(b"k", 5.0, Some(4.0))]);
        assert!(!chain.is_settled());
        let next = decoded(&chain.log(5, &[entry(b"k", 4.5, Some(4.0))])[0]);
        assert_eq!(next.at_marker(0).unwrap(), Some(&bytes(1.0)));
        assert!(chain.is_settled());
    }
}
