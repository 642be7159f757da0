//! The records of one backup, encoded once, as the changelog logs them.
//!
//! A backup is on the hot path: in approximate mode with a large key space
//! nearly every state change is written once, so what a backup costs per entry
//! is most of what fault tolerance costs. A structure therefore writes each
//! entry straight into its backup's one buffer, key and logged value (see
//! [`crate::logged`] for the envelope), with its baseline as the one certain
//! prior; no entry is built, moved or encoded a second time. The driver's
//! [`crate::prior_chain::PriorChain`] rewrites a record only when a failure left
//! its key's prior uncertain, which is rare.
//!
//! Layout: the records' bytes one after another in one `Vec<u8>` and, per
//! record, where its key and its value end (a record starts where the one
//! before it ends). Every record has a value: a deleted key is a value of
//! "no key" inside the envelope, never a tombstone.

use super::entry::{BackupEntry, EntryBytes};
use super::error::CoreError;
use super::logged::{write_envelope, write_f64s_envelope, EnvelopeHead, LoggedValue, Slot, CERTAIN};

/// One backup's changelog records.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackupBatch {
    seq: u64,
    /// How every record's envelope starts: `seq`, encoded.
    head: EnvelopeHead,
    bytes: Vec<u8>,
    /// Per record: the end of its key and the end of its value in `bytes`.
    ends: Vec<(usize, usize)>,
}

impl Default for BackupBatch {
    fn default() -> Self {
        BackupBatch::new(0)
    }
}

/// One record of a backup: its key and its logged value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Record<'a> {
    pub key: &'a [u8],
    pub value: &'a [u8],
}

impl Record<'_> {
    /// The record as an owned log entry, as a reader of the changelog sees it.
    pub fn to_entry(&self) -> BackupEntry {
        BackupEntry::new(
            EntryBytes::from_slice(self.key),
            Some(EntryBytes::from_slice(self.value)),
        )
    }
}

impl BackupBatch {
    /// An empty batch for backup `seq`.
    pub fn new(seq: u64) -> Self {
        BackupBatch {
            seq,
            head: EnvelopeHead::new(seq),
            bytes: Vec::new(),
            ends: Vec::new(),
        }
    }

    /// Empties the batch for backup `seq`, keeping its buffers.
    pub fn reset(&mut self, seq: u64) {
        self.seq = seq;
        self.head = EnvelopeHead::new(seq);
        self.bytes.clear();
        self.ends.clear();
    }

    pub fn seq(&self) -> u64 {
        self.seq
    }

    pub fn len(&self) -> usize {
        self.ends.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    /// Bytes the batch holds room for.
    pub fn capacity(&self) -> usize {
        self.bytes.capacity()
    }

    /// Bytes of keys and values together, for accounting.
    pub fn encoded_len(&self) -> usize {
        self.bytes.len()
    }

    /// Makes room for `records` more records the size of the last one
    /// pushed, and a quarter more: a backup's records differ little in size,
    /// and pushed one by one into a buffer too small they would grow it by
    /// doubling, copying what it holds each time (a backup of 15 000
    /// records did a dozen such copies).
    pub fn reserve_like_last(&mut self, records: usize) {
        let last = match self.ends.len() {
            0 => return,
            1 => self.ends[0].1,
            n => self.ends[n - 1].1 - self.ends[n - 2].1,
        };
        self.bytes.reserve(records.saturating_mul(last + last / 4));
        self.ends.reserve(records);
    }

    /// Appends an `f64` entry of the structure tagged `tag`: `key` writes the
    /// key's body, `prior` is what the last backup issued before held for the
    /// key (`None`: none held it).
    #[inline]
    pub fn push_f64(&mut self, tag: u8, key: impl FnOnce(&mut Vec<u8>), value: f64, prior: Option<f64>) {
        self.push_f64s(tag, key, [value], prior.map(|prior| [prior]));
    }

    /// Appends an entry of `N` `f64`s (a table's value and the number it
    /// carries: [`crate::entry::decode_f64_pair`] reads two), as
    /// [`BackupBatch::push_f64`] does one.
    #[inline]
    pub fn push_f64s<const N: usize>(
        &mut self,
        tag: u8,
        key: impl FnOnce(&mut Vec<u8>),
        value: [f64; N],
        prior: Option<[f64; N]>,
    ) {
        self.bytes.push(tag);
        key(&mut self.bytes);
        let key_end = self.bytes.len();
        write_f64s_envelope(&mut self.bytes, &self.head, value, prior);
        self.ends.push((key_end, self.bytes.len()));
    }

    /// Appends an entry of the structure tagged `tag`: `key` writes the key's
    /// body; `value` and `prior` are payloads (`None`: no key), which the
    /// current encoding version is put before.
    #[inline]
    pub fn push(&mut self, tag: u8, key: impl FnOnce(&mut Vec<u8>), value: Option<&[u8]>, prior: Option<&[u8]>) {
        self.bytes.push(tag);
        key(&mut self.bytes);
        let key_end = self.bytes.len();
        let priors = std::iter::once((CERTAIN, payload(prior)));
        write_envelope(&mut self.bytes, self.seq, payload(value), priors);
        self.ends.push((key_end, self.bytes.len()));
    }

    /// Appends an entry whose key and values are encoded already (`value`
    /// and `prior` versioned), such as a key a recovery rolled back.
    pub fn push_encoded(&mut self, key: &[u8], value: Option<&[u8]>, prior: Option<&[u8]>) {
        self.bytes.extend_from_slice(key);
        let key_end = self.bytes.len();
        let priors = std::iter::once((CERTAIN, prior.into()));
        write_envelope(&mut self.bytes, self.seq, value.into(), priors);
        self.ends.push((key_end, self.bytes.len()));
    }

    /// Appends a record with the logged value given.
    pub(crate) fn push_logged(&mut self, key: &[u8], logged: &LoggedValue) {
        self.bytes.extend_from_slice(key);
        let key_end = self.bytes.len();
        logged.encode_into(&mut self.bytes);
        self.ends.push((key_end, self.bytes.len()));
    }

    /// The records in the order they were written.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = Record<'_>> + '_ {
        let mut start = 0;
        self.ends.iter().map(move |&(key_end, value_end)| {
            let record = Record {
                key: &self.bytes[start..key_end],
                value: &self.bytes[key_end..value_end],
            };
            start = value_end;
            record
        })
    }

    /// The entries a restore applies once a marker covers this backup: each
    /// key with its value (`None`: the key is deleted).
    pub fn entries(&self) -> Result<Vec<BackupEntry>, CoreError> {
        self.iter()
            .map(|record| {
                let logged = LoggedValue::decode(Some(record.value))?;
                Ok(BackupEntry::new(EntryBytes::from_slice(record.key), logged.value))
            })
            .collect()
    }
}

impl crate::spares::Room for BackupBatch {
    fn room(&self) -> usize {
        self.capacity()
    }
}

fn payload(bytes: Option<&[u8]>) -> Slot<'_> {
    bytes.map_or(Slot::Absent, Slot::Payload)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::entry::ENCODING_VERSION;
    use crate::entry::{decode_f64, encode_f64};
    use crate::logged::Prior;

    #[test]
    fn records_read_back_with_their_keys_values_and_priors() {
        let mut batch = BackupBatch::new(7);
        batch.push_f64(3, |key| key.extend_from_slice(b"ab"), 1.5, Some(0.5));
        batch.push(4, |key| key.push(9), None, Some(&[]));
        batch.push_encoded(&[5, 1], Some(&encode_f64(2.0)), None);
        let records: Vec<Record<'_>> = batch.iter().collect();
        assert_eq!(records.len(), 3);
        assert_eq!(records[0].key, &[3, b'a', b'b']);
        assert_eq!(records[1].key, &[4, 9]);
        assert_eq!(records[2].key, &[5, 1]);
        let first = LoggedValue::decode(Some(records[0].value)).unwrap();
        assert_eq!(first.seq, 7);
        assert_eq!(decode_f64(first.value.as_deref().unwrap()).unwrap(), 1.5);
        assert_eq!(
            first.priors.as_slice(),
            &[Prior {
                seq: CERTAIN,
                value: Some(encode_f64(0.5))
            }]
        );
        let second = LoggedValue::decode(Some(records[1].value)).unwrap();
        assert_eq!(second.value, None);
        assert_eq!(second.priors[0].value.as_deref(), Some(&[ENCODING_VERSION][..]));
        let third = LoggedValue::decode(Some(records[2].value)).unwrap();
        assert_eq!(third.priors[0].value, None);
        let entries = batch.entries().unwrap();
        assert_eq!(entries[1], BackupEntry::new(EntryBytes::from_slice(&[4, 9]), None));
        assert_eq!(decode_f64(entries[2].value.as_deref().unwrap()).unwrap(), 2.0);
    }

    #[test]
    fn room_like_the_last_record_takes_as_many_more_without_growing() {
        let mut batch = BackupBatch::new(3);
        let key = |out: &mut Vec<u8>| out.extend_from_slice(&7u32.to_be_bytes());
        batch.push_f64(1, key, 1.0, Some(0.5));
        batch.reserve_like_last(1000);
        let room = batch.capacity();
        assert!(room >= 1001 * batch.encoded_len(), "room for 1000 more: {room}");
        for value in 0..1000 {
            batch.push_f64(1, key, f64::from(value), Some(0.5));
        }
        assert_eq!(batch.capacity(), room);
        BackupBatch::new(4).reserve_like_last(10);
    }

    #[test]
    fn a_reset_batch_holds_nothing_of_before() {
        let mut batch = BackupBatch::new(1);
        batch.push_f64(1, |_| {}, 1.0, None);
        batch.reset(2);
        assert!(batch.is_empty());
        assert_eq!(batch.encoded_len(), 0);
        batch.push_f64(1, |_| {}, 2.0, None);
        let logged = LoggedValue::decode(Some(batch.iter().next().unwrap().value)).unwrap();
        assert_eq!(logged.seq, 2);
    }
}
