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
//! write in flight is reported. So [`crate::prior_chain::PriorChain`] keeps, for each key a failed
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

use smallvec::SmallVec;

use super::entry::{EntryBytes, ENCODING_VERSION};
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
        let mut out = Vec::new();
        self.encode_into(&mut out);
        EntryBytes::from_slice(&out)
    }

    pub(crate) fn encode_into(&self, out: &mut Vec<u8>) {
        let priors = self
            .priors
            .iter()
            .map(|prior| (prior.seq, prior.value.as_deref().into()));
        write_envelope(out, self.seq, self.value.as_deref().into(), priors);
    }

    /// The backup sequence of a changelog record's value, without decoding
    /// the rest (0 for a tombstone or a record written before priors existed).
    pub fn seq_of(bytes: Option<&[u8]>) -> Result<u64, CoreError> {
        match bytes {
            Some([ENVELOPE_VERSION, rest @ ..]) => Reader(rest).varint(),
            _ => Ok(0),
        }
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

/// A value as the envelope holds it: `0` for no key, else the length of its
/// versioned bytes + 1 and those bytes.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Slot<'a> {
    Absent,
    /// Bytes that start with their encoding version.
    Versioned(&'a [u8]),
    /// A payload the current encoding version is put before.
    Payload(&'a [u8]),
}

impl<'a> From<Option<&'a [u8]>> for Slot<'a> {
    fn from(value: Option<&'a [u8]>) -> Self {
        value.map_or(Slot::Absent, Slot::Versioned)
    }
}

/// Writes the envelope of a record from its parts, so that the common record
/// (one certain prior) is encoded without building a [`LoggedValue`] first.
#[inline]
pub(crate) fn write_envelope<'a>(
    out: &mut Vec<u8>,
    seq: u64,
    value: Slot<'_>,
    priors: impl ExactSizeIterator<Item = (u64, Slot<'a>)>,
) {
    out.push(ENVELOPE_VERSION);
    put_varint(out, seq);
    put_slot(out, value);
    put_varint(out, priors.len() as u64);
    for (seq, value) in priors {
        put_varint(out, seq);
        put_slot(out, value);
    }
}

/// The start of every envelope of one backup: the version and the backup's
/// sequence, encoded once for all of the backup's records.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct EnvelopeHead {
    bytes: [u8; 11],
    len: u8,
}

impl EnvelopeHead {
    pub(crate) fn new(seq: u64) -> Self {
        let mut bytes = [0; 11];
        bytes[0] = ENVELOPE_VERSION;
        let mut len = 1;
        let mut rest = seq;
        while rest >= 0x80 {
            bytes[len] = (rest as u8) | 0x80;
            rest >>= 7;
            len += 1;
        }
        bytes[len] = rest as u8;
        EnvelopeHead {
            bytes,
            len: len as u8 + 1,
        }
    }

    /// Appends the head. A copy of a constant length compiles to a few
    /// moves, where one of the head's own length is a call to `memcpy`: the
    /// whole array goes, then what is past the head is cut.
    fn write(&self, out: &mut Vec<u8>) {
        let end = out.len() + usize::from(self.len);
        out.extend_from_slice(&self.bytes);
        out.truncate(end);
    }
}

/// The most numbers an `f64`s record holds (a value and the number it
/// carries).
const MOST_F64S: usize = 2;

/// Writes the envelope of the most common records, `N` `f64`s (a number, or
/// a number and the one it carries) with one certain prior: a backup of a
/// large key space writes one per changed key. The head is the backup's;
/// the rest is laid out in a buffer on the stack and appended at once, its
/// length a constant, so that it compiles to a few moves (appending piece
/// by piece checked the buffer's room for every piece). The numbers'
/// payload is theirs one after another, little-endian.
#[inline]
pub(crate) fn write_f64s_envelope<const N: usize>(
    out: &mut Vec<u8>,
    head: &EnvelopeHead,
    value: [f64; N],
    prior: Option<[f64; N]>,
) {
    const { assert!(N <= MOST_F64S) };
    // The value's slot, the priors' count and sequence, the prior's slot.
    let mut tail = [0; 2 * (2 + 8 * MOST_F64S) + 2];
    let mut end = put_f64s_slot(&mut tail, 0, value);
    tail[end] = 1;
    tail[end + 1] = CERTAIN as u8;
    end += 2;
    head.write(out);
    // Appended in each arm, where the length is a constant.
    match prior {
        Some(prior) => {
            let end = put_f64s_slot(&mut tail, end, prior);
            out.extend_from_slice(&tail[..end]);
        }
        None => {
            tail[end] = 0;
            out.extend_from_slice(&tail[..end + 1]);
        }
    }
}

/// Lays out a slot of `N` numbers at `start`; returns where it ends.
#[inline(always)]
fn put_f64s_slot<const N: usize>(out: &mut [u8], start: usize, numbers: [f64; N]) -> usize {
    // A slot's length is its bytes + 1: the version byte and the numbers.
    out[start] = (1 + 8 * N + 1) as u8;
    out[start + 1] = ENCODING_VERSION;
    let mut at = start + 2;
    for number in numbers {
        out[at..at + 8].copy_from_slice(&number.to_le_bytes());
        at += 8;
    }
    at
}

#[inline]
fn put_varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

#[inline]
fn put_slot(out: &mut Vec<u8>, value: Slot<'_>) {
    match value {
        Slot::Absent => out.push(0),
        Slot::Versioned(bytes) => {
            put_varint(out, bytes.len() as u64 + 1);
            out.extend_from_slice(bytes);
        }
        Slot::Payload(bytes) => {
            put_varint(out, bytes.len() as u64 + 2);
            out.push(ENCODING_VERSION);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::entry::encode_f64;

    fn bytes(v: f64) -> EntryBytes {
        encode_f64(v)
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
    fn an_f64_record_is_laid_out_as_the_general_envelope() {
        for seq in [0, 1, 127, 128, 300, 1 << 40, u64::MAX] {
            for prior in [None, Some(-2.5)] {
                let mut fast = Vec::new();
                write_f64s_envelope(&mut fast, &EnvelopeHead::new(seq), [1.25], prior.map(|p| [p]));
                let general = LoggedValue {
                    seq,
                    value: Some(bytes(1.25)),
                    priors: [Prior {
                        seq: CERTAIN,
                        value: prior.map(bytes),
                    }]
                    .into_iter()
                    .collect(),
                };
                assert_eq!(
                    fast.as_slice(),
                    general.encode().as_slice(),
                    "seq {seq}, prior {prior:?}"
                );
            }
        }
    }

    #[test]
    fn a_pair_record_is_laid_out_as_the_general_envelope() {
        use crate::entry::encode_f64_pair;
        let pair = encode_f64_pair;
        for seq in [1, 128, u64::MAX] {
            for prior in [None, Some([-2.5, 7.0])] {
                let mut fast = Vec::new();
                write_f64s_envelope(&mut fast, &EnvelopeHead::new(seq), [1.25, 3.5], prior);
                let general = LoggedValue {
                    seq,
                    value: Some(pair(1.25, 3.5)),
                    priors: [Prior {
                        seq: CERTAIN,
                        value: prior.map(|[a, b]| pair(a, b)),
                    }]
                    .into_iter()
                    .collect(),
                };
                assert_eq!(
                    fast.as_slice(),
                    general.encode().as_slice(),
                    "seq {seq}, prior {prior:?}"
                );
            }
        }
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
            let mut batch = crate::batch::BackupBatch::new(300);
            batch.push_encoded(b"k", value.as_deref(), prior.as_deref());
            let logged = batch.iter().next().unwrap();
            assert_eq!(logged.value, record.encode().as_slice());
        }
    }
}
