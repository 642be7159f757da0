//! Backup entries: the keyed byte records a backup consists of.
//!
//! Any store that keeps the latest value per key (a compacted changelog topic, a
//! RocksDB column family) can hold them, and replaying them in order rebuilds the
//! backed-up state. The layout is:
//!
//! * key   = `[structure tag: u8][structure-specific key bytes]`
//! * value = `[encoding version: u8][payload]`, or no value at all for a deletion
//!   (a tombstone, which a compacted topic drops for good).
//!
//! The version byte lets a newer build refuse, with a clear error, entries it cannot
//! read instead of misreading them.

use smallvec::SmallVec;

use super::error::CoreError;

/// The bytes of an entry's key or value as read back from a log. Most keys and
/// values are short (a tag and an index, a version and an f64; logged, with
/// its sequence and prior, about 26 bytes), so they stay inline: a restore
/// reads millions of them. Backups write into one buffer instead
/// ([`crate::batch::BackupBatch`]).
pub type EntryBytes = SmallVec<[u8; 32]>;

/// The encoding version this build writes and reads.
pub const ENCODING_VERSION: u8 = 1;

/// The tag reserved for the backup marker record (see [`crate::recovery`]).
pub const MARKER_TAG: u8 = 0;

/// One keyed record of a backup.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct BackupEntry {
    pub key: EntryBytes,
    /// `None` deletes the key.
    pub value: Option<EntryBytes>,
}

impl BackupEntry {
    pub fn new(key: EntryBytes, value: Option<EntryBytes>) -> Self {
        BackupEntry { key, value }
    }

    /// The structure tag the key starts with.
    pub fn tag(&self) -> Result<u8, CoreError> {
        self.key
            .first()
            .copied()
            .ok_or_else(|| CoreError::undecodable("entry key", "empty key"))
    }

    /// The key without its structure tag.
    pub fn key_body(&self) -> &[u8] {
        self.key.get(1..).unwrap_or(&[])
    }

    /// Approximate size on the wire, for accounting.
    pub fn encoded_len(&self) -> usize {
        self.key.len() + self.value.as_ref().map_or(0, |v| v.len())
    }
}

/// Builds an entry key from a structure tag and a key body.
pub fn entry_key(tag: u8, body: &[u8]) -> EntryBytes {
    let mut key = EntryBytes::with_capacity(1 + body.len());
    key.push(tag);
    key.extend_from_slice(body);
    key
}

/// Encodes a versioned payload.
pub fn versioned(payload: &[u8]) -> EntryBytes {
    let mut value = EntryBytes::with_capacity(1 + payload.len());
    value.push(ENCODING_VERSION);
    value.extend_from_slice(payload);
    value
}

/// Checks the version byte and returns the payload.
pub fn payload(value: &[u8]) -> Result<&[u8], CoreError> {
    match value.split_first() {
        None => Err(CoreError::undecodable("entry value", "empty value")),
        Some((&ENCODING_VERSION, rest)) => Ok(rest),
        Some((&found, _)) => Err(CoreError::UnknownEncodingVersion {
            found,
            supported: ENCODING_VERSION,
        }),
    }
}

/// A versioned `f64` value, the unit of every numeric structure.
pub fn encode_f64(value: f64) -> EntryBytes {
    versioned(&value.to_le_bytes())
}

/// Decodes a value written by [`encode_f64`].
pub fn decode_f64(value: &[u8]) -> Result<f64, CoreError> {
    let body = payload(value)?;
    let bytes: [u8; 8] = body
        .try_into()
        .map_err(|_| CoreError::undecodable("f64 value", format!("{} bytes, expected 8", body.len())))?;
    Ok(f64::from_le_bytes(bytes))
}

/// A versioned pair of `f64`s in one entry (a table's value and the number
/// it carries, see [`crate::structures::TrackedTable::with_carried`]): the
/// first then the second, little-endian, 16 bytes.
pub fn encode_f64_pair(first: f64, second: f64) -> EntryBytes {
    let mut payload = [0u8; 16];
    payload[..8].copy_from_slice(&first.to_le_bytes());
    payload[8..].copy_from_slice(&second.to_le_bytes());
    versioned(&payload)
}

/// Decodes a value written by [`encode_f64_pair`].
pub fn decode_f64_pair(value: &[u8]) -> Result<(f64, f64), CoreError> {
    let mut reader = PayloadReader::new(payload(value)?, "f64 pair value");
    let pair = (reader.f64()?, reader.f64()?);
    reader.finish()?;
    Ok(pair)
}

/// A little-endian reader over a payload, with errors instead of panics.
pub struct PayloadReader<'a> {
    bytes: &'a [u8],
    what: &'static str,
}

impl<'a> PayloadReader<'a> {
    pub fn new(bytes: &'a [u8], what: &'static str) -> Self {
        PayloadReader { bytes, what }
    }

    fn take<const N: usize>(&mut self) -> Result<[u8; N], CoreError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.bytes(N)?);
        Ok(out)
    }

    /// Whether every byte was read.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    pub fn u8(&mut self) -> Result<u8, CoreError> {
        Ok(self.take::<1>()?[0])
    }

    /// The next `len` bytes.
    pub fn bytes(&mut self, len: usize) -> Result<&'a [u8], CoreError> {
        if self.bytes.len() < len {
            return Err(CoreError::undecodable(
                self.what,
                format!("truncated: needed {len} more bytes, {} left", self.bytes.len()),
            ));
        }
        let (head, rest) = self.bytes.split_at(len);
        self.bytes = rest;
        Ok(head)
    }

    pub fn u32(&mut self) -> Result<u32, CoreError> {
        Ok(u32::from_le_bytes(self.take()?))
    }

    pub fn u64(&mut self) -> Result<u64, CoreError> {
        Ok(u64::from_le_bytes(self.take()?))
    }

    pub fn f64(&mut self) -> Result<f64, CoreError> {
        Ok(f64::from_le_bytes(self.take()?))
    }

    /// Fails when bytes are left over: a longer payload is a different format.
    pub fn finish(self) -> Result<(), CoreError> {
        if self.bytes.is_empty() {
            Ok(())
        } else {
            Err(CoreError::undecodable(
                self.what,
                format!("{} unexpected trailing bytes", self.bytes.len()),
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f64_round_trips() {
        for v in [0.0, -1.5, 1e300, f64::MIN_POSITIVE] {
            assert_eq!(decode_f64(&encode_f64(v)).unwrap(), v);
        }
    }

    #[test]
    fn unknown_version_is_a_typed_error() {
        let mut bytes = encode_f64(1.0);
        bytes[0] = 9;
        assert_eq!(
            decode_f64(&bytes),
            Err(CoreError::UnknownEncodingVersion {
                found: 9,
                supported: ENCODING_VERSION
            })
        );
    }

    #[test]
    fn truncated_values_are_errors_not_panics() {
        assert!(matches!(decode_f64(&[]), Err(CoreError::Undecodable { .. })));
        assert!(matches!(
            decode_f64(&[ENCODING_VERSION, 1, 2]),
            Err(CoreError::Undecodable { .. })
        ));
        let mut reader = PayloadReader::new(&[1, 2], "test");
        assert!(reader.u32().is_err());
    }
}
