//! A task's input batch: records polled from its partition queue, decoded
//! into the operator's items with their source positions, with the records
//! that did not decode kept for the dead-letter topic.

use rdkafka::message::{Headers, Message};

use crate::core::{Item, Rejected, SourcePosition};
use crate::service::codec::{Codec, ServiceOperator};

use super::SOURCE_POSITION_HEADER;

/// The source position an upstream task put on a record, if any. A header
/// that does not read is ignored: the record applies as one without a
/// position would.
fn source_position(message: &impl Message) -> Option<SourcePosition> {
    let headers = message.headers()?;
    let header = headers.iter().find(|header| header.key == SOURCE_POSITION_HEADER)?;
    match SourcePosition::decode(header.value?) {
        Ok(position) => Some(position),
        Err(error) => {
            tracing::debug!(offset = message.offset(), %error, "an unreadable source position is ignored");
            None
        }
    }
}

/// Where one record of a batch lies in its byte buffer.
#[derive(Clone, Copy, Debug)]
pub(super) struct RawSpan {
    pub(super) key: Option<(usize, usize)>,
    pub(super) value: Option<(usize, usize)>,
}

/// A record's key and value as they came.
pub(super) type RawRecord<'a> = (Option<&'a [u8]>, Option<&'a [u8]>);

/// The records of a batch as they came (keys and values back to back), so a
/// refused one goes to the dead-letter topic unchanged.
#[derive(Clone, Copy)]
pub(super) struct RawRecords<'a> {
    pub(super) offsets: &'a [u64],
    pub(super) spans: &'a [RawSpan],
    pub(super) bytes: &'a [u8],
}

impl<'a> RawRecords<'a> {
    pub(super) const NONE: RawRecords<'static> = RawRecords {
        offsets: &[],
        spans: &[],
        bytes: &[],
    };

    /// The key and value of the record at `offset`, if it is in the batch.
    pub(super) fn get(&self, offset: u64) -> Option<RawRecord<'a>> {
        let slot = self.offsets.binary_search(&offset).ok()?;
        let span = self.spans.get(slot)?;
        let bytes = self.bytes;
        let part = |range: Option<(usize, usize)>| range.and_then(|(start, end)| bytes.get(start..end));
        Some((part(span.key), part(span.value)))
    }
}

/// The current poll batch: decoded inputs, their offsets and raw records;
/// `taken` of the `filled` are processed. Reused from batch to batch, so it
/// allocates only while its buffers grow.
pub(super) struct InputBatch<O: ServiceOperator> {
    pub(super) inputs: Vec<O::Input>,
    pub(super) offsets: Vec<u64>,
    pub(super) sources: Vec<Option<SourcePosition>>,
    pub(super) spans: Vec<RawSpan>,
    pub(super) bytes: Vec<u8>,
    /// The slots whose record did not decode, in order, with the reason;
    /// `next_undecoded` indexes the first not yet taken.
    pub(super) undecoded: Vec<(usize, Rejected)>,
    pub(super) next_undecoded: usize,
    pub(super) filled: usize,
    pub(super) taken: usize,
    /// The next offset to read.
    pub(super) next_offset: u64,
    pub(super) undecodable: u64,
}

impl<O: ServiceOperator> InputBatch<O> {
    pub(super) fn new(next_offset: u64) -> Self {
        InputBatch {
            inputs: Vec::new(),
            offsets: Vec::new(),
            sources: Vec::new(),
            spans: Vec::new(),
            bytes: Vec::new(),
            undecoded: Vec::new(),
            next_undecoded: 0,
            filled: 0,
            taken: 0,
            next_offset,
            undecodable: 0,
        }
    }

    pub(super) fn clear(&mut self) {
        self.filled = 0;
        self.taken = 0;
        self.spans.clear();
        self.bytes.clear();
        self.undecoded.clear();
        self.next_undecoded = 0;
    }

    /// Adds a record to the batch; one that does not decode keeps its slot, to
    /// be refused in its turn.
    pub(super) fn accept(&mut self, codec: &Codec, message: &impl Message) {
        let offset = message.offset().max(0) as u64;
        let (key, value) = (message.key(), message.payload());
        if offset < self.next_offset {
            return; // Already taken (a record fetched before the queue was split).
        }
        self.next_offset = offset + 1;
        if self.filled == self.inputs.len() {
            self.inputs.push(O::empty_input());
            self.offsets.push(0);
            self.sources.push(None);
        }
        self.offsets[self.filled] = offset;
        self.sources[self.filled] = source_position(message);
        let mut keep = |part: Option<&[u8]>| {
            part.map(|part| {
                let start = self.bytes.len();
                self.bytes.extend_from_slice(part);
                (start, self.bytes.len())
            })
        };
        let span = RawSpan {
            key: keep(key),
            value: keep(value),
        };
        self.spans.push(span);
        if let Err(reason) = codec.decode::<O>(key, value.unwrap_or_default(), &mut self.inputs[self.filled]) {
            self.undecodable += 1;
            self.undecoded
                .push((self.filled, Rejected(format!("does not decode: {reason}"))));
        }
        self.filled += 1;
    }

    /// The decoded items of slots `from..to`, as the driver takes them.
    pub(super) fn items(&self, from: usize, to: usize) -> impl Iterator<Item = Item<'_, O::Input>> {
        (from..to).map(|slot| Item {
            offset: self.offsets[slot],
            source: self.sources[slot],
            input: &self.inputs[slot],
        })
    }

    pub(super) fn is_drained(&self) -> bool {
        self.taken == self.filled
    }
}
