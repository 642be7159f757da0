//! Source positions: how a stage of a chain drops what an upstream recovery
//! sends again.
//!
//! A recovery replays its input from its marker, so it sends again the outputs
//! of the items it replays. A downstream stage that applied them once would
//! apply them twice: in a chain, an upstream replay would become downstream
//! state error, up to l·β·α a failure. To prevent it, every output names its
//! [`SourcePosition`]: the upstream task that made it, the input offset of the
//! item it came from, and its index among that item's outputs. An upstream
//! task sends its outputs in position order, and Kafka keeps one producer's
//! records to a partition in order, so the positions a downstream task reads
//! from one upstream task only grow, except where a replay starts over. A
//! downstream task keeps the newest position it has applied from each upstream
//! task ([`SourcePositions`]) and skips an item whose position is not newer:
//! the replayed output of an item its state already includes.
//!
//! The table is part of the state it describes. A marker carries the table as
//! it was when its backup was taken, at the same input offset as the state the
//! marker covers, and a recovery restores both together (a local store keeps
//! the table beside its offset). So after any recovery an item is skipped
//! exactly when the restored state includes it, and a chain's end-to-end error
//! is the sum of its stages' state errors: replays add none.
//!
//! The rule assumes an upstream task numbers a replayed item's outputs as it
//! did the first time (the same operator over the same item), and that an
//! upstream task's identity changes when its input is started over (a new
//! consumer group or topic): positions it had sent before would otherwise
//! hide the new ones.

use super::entry::PayloadReader;
use super::error::CoreError;

/// Where an output came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SourcePosition {
    /// The upstream task that made it (an identity the adapter chooses, stable
    /// across restarts of that task).
    pub source: u64,
    /// The input offset of the upstream item.
    pub offset: u64,
    /// Its index among that item's outputs.
    pub index: u32,
}

/// The longest text of a position: `1:` and three numbers.
pub const SOURCE_POSITION_MAX_LEN: usize = 2 + 16 + 1 + 20 + 1 + 10;
const POSITION_VERSION: &str = "1";

impl SourcePosition {
    fn order(&self) -> (u64, u32) {
        (self.offset, self.index)
    }

    /// The text an output carries (a record header, say): a version, then
    /// source (hex), offset and index, separated by colons. Text, so any tool
    /// shows it, and so brokers that mishandle binary header values keep it.
    pub fn encode(&self) -> PositionText {
        use std::io::Write;
        let mut text = PositionText {
            bytes: [0; SOURCE_POSITION_MAX_LEN],
            len: 0,
        };
        let mut out = &mut text.bytes[..];
        // The buffer holds the longest position, so the write cannot fail.
        let _ = write!(
            out,
            "{POSITION_VERSION}:{:x}:{}:{}",
            self.source, self.offset, self.index
        );
        text.len = SOURCE_POSITION_MAX_LEN - out.len();
        text
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, CoreError> {
        let bad = |why: String| CoreError::undecodable("source position", why);
        let text = std::str::from_utf8(bytes).map_err(|e| bad(e.to_string()))?;
        let mut parts = text.split(':');
        let version = parts.next().unwrap_or_default();
        if version != POSITION_VERSION {
            return Err(bad(format!(
                "version {version:?}; this build reads version {POSITION_VERSION}"
            )));
        }
        let mut field = |name: &str| parts.next().ok_or_else(|| bad(format!("no {name} in {text:?}")));
        let source = u64::from_str_radix(field("source")?, 16).map_err(|e| bad(format!("source: {e}")))?;
        let offset = field("offset")?.parse().map_err(|e| bad(format!("offset: {e}")))?;
        let index = field("index")?.parse().map_err(|e| bad(format!("index: {e}")))?;
        if parts.next().is_some() {
            return Err(bad(format!("more than a position in {text:?}")));
        }
        Ok(SourcePosition { source, offset, index })
    }
}

/// A position's text, without allocating.
#[derive(Clone, Copy)]
pub struct PositionText {
    bytes: [u8; SOURCE_POSITION_MAX_LEN],
    len: usize,
}

impl PositionText {
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
}

/// A stable 64-bit identity for a name (FNV-1a): the same name gives the same
/// identity in every build and on every machine.
pub fn source_identity(name: &[u8]) -> u64 {
    const OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    name.iter()
        .fold(OFFSET_BASIS, |hash, byte| (hash ^ u64::from(*byte)).wrapping_mul(PRIME))
}

/// The newest position applied from each upstream task, sorted by source (a
/// task reads from a handful of upstream tasks: one per upstream partition).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SourcePositions {
    newest: Vec<SourcePosition>,
}

impl SourcePositions {
    /// Whether an item from `position` is new; if so, it becomes the newest
    /// of its source. An item that is not new was applied already.
    #[inline]
    pub fn advance(&mut self, position: SourcePosition) -> bool {
        match self.newest.binary_search_by_key(&position.source, |p| p.source) {
            Ok(slot) => {
                let newest = &mut self.newest[slot];
                if position.order() <= newest.order() {
                    return false;
                }
                *newest = position;
                true
            }
            Err(slot) => {
                self.newest.insert(slot, position);
                true
            }
        }
    }

    pub fn is_empty(&self) -> bool {
        self.newest.is_empty()
    }

    pub fn as_slice(&self) -> &[SourcePosition] {
        &self.newest
    }

    /// Appends the table: a count, then each position's source, offset and index.
    pub fn encode_into(&self, out: &mut impl Extend<u8>) {
        out.extend((self.newest.len() as u32).to_le_bytes());
        for position in &self.newest {
            out.extend(position.source.to_le_bytes());
            out.extend(position.offset.to_le_bytes());
            out.extend(position.index.to_le_bytes());
        }
    }

    /// How many bytes [`Self::encode_into`] writes.
    pub fn encoded_len(&self) -> usize {
        4 + 20 * self.newest.len()
    }

    /// Reads a table [`Self::encode_into`] wrote.
    pub fn decode_from(reader: &mut PayloadReader<'_>) -> Result<Self, CoreError> {
        let count = reader.u32()?;
        let mut table = SourcePositions::default();
        for _ in 0..count {
            let position = SourcePosition {
                source: reader.u64()?,
                offset: reader.u64()?,
                index: reader.u32()?,
            };
            if table.newest.last().is_some_and(|last| last.source >= position.source) {
                return Err(CoreError::undecodable(
                    "source positions",
                    "sources out of order or repeated",
                ));
            }
            table.newest.push(position);
        }
        Ok(table)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(source: u64, offset: u64, index: u32) -> SourcePosition {
        SourcePosition { source, offset, index }
    }

    #[test]
    fn only_newer_positions_of_a_source_advance_it() {
        let mut table = SourcePositions::default();
        assert!(table.advance(at(7, 10, 0)));
        assert!(table.advance(at(7, 10, 1)));
        assert!(!table.advance(at(7, 10, 1)), "the same position again");
        assert!(!table.advance(at(7, 10, 0)), "an earlier index of the same item");
        assert!(!table.advance(at(7, 9, 5)), "an earlier item");
        assert!(table.advance(at(3, 0, 0)), "another source is independent");
        assert!(table.advance(at(7, 11, 0)));
        assert_eq!(table.as_slice(), &[at(3, 0, 0), at(7, 11, 0)]);
    }

    #[test]
    fn a_table_and_a_position_read_back_as_written() {
        let mut table = SourcePositions::default();
        for position in [at(9, 4, 2), at(1, u64::MAX, u32::MAX), at(5, 0, 0)] {
            table.advance(position);
        }
        let mut bytes = Vec::new();
        table.encode_into(&mut bytes);
        assert_eq!(bytes.len(), table.encoded_len());
        let mut reader = PayloadReader::new(&bytes, "test");
        assert_eq!(SourcePositions::decode_from(&mut reader).unwrap(), table);
        assert!(reader.is_empty());
        for position in [at(u64::MAX, u64::MAX, u32::MAX), at(0, 0, 0), at(0xab, 3, 1)] {
            assert_eq!(SourcePosition::decode(position.encode().as_bytes()).unwrap(), position);
        }
        assert_eq!(at(0xab, 3, 1).encode().as_bytes(), b"1:ab:3:1");
    }

    #[test]
    fn an_unreadable_position_or_table_is_an_error() {
        for bad in [
            &b"9:1:2:3"[..],
            b"1:1:2",
            b"1:1:2:3:4",
            b"1:x:2:3",
            b"1:1:-2:3",
            b"",
            b"\xff",
        ] {
            assert!(SourcePosition::decode(bad).is_err(), "{bad:?}");
        }
        let mut table = Vec::new();
        table.extend_from_slice(&2u32.to_le_bytes());
        for source in [5u64, 5] {
            table.extend_from_slice(&source.to_le_bytes());
            table.extend_from_slice(&0u64.to_le_bytes());
            table.extend_from_slice(&0u32.to_le_bytes());
        }
        assert!(SourcePositions::decode_from(&mut PayloadReader::new(&table, "test")).is_err());
    }

    #[test]
    fn identities_are_fnv_1a() {
        // The published FNV-1a 64 test values: a stable identity across builds.
        assert_eq!(source_identity(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(source_identity(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_ne!(source_identity(b"g/t/0"), source_identity(b"g/t/1"));
    }
}
