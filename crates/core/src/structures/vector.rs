//! A dense vector of numbers (or a matrix laid out row by row).

use super::slots::DriftSlots;
use super::BackupScope;
use super::{check_tag, Norm, Tracked};
use crate::batch::BackupBatch;
use crate::entry::{decode_f64, BackupEntry};
use crate::error::CoreError;

/// A fixed-length vector with L1, L2 or max-difference divergence.
#[derive(Clone, Debug)]
pub struct TrackedVector {
    tag: u8,
    slots: DriftSlots,
}

impl TrackedVector {
    pub fn new(tag: u8, norm: Norm, len: usize) -> Result<Self, CoreError> {
        if norm == Norm::KeyCount {
            return Err(CoreError::parameter(
                "norm",
                "key_count",
                "a vector has a fixed set of indices; key count applies to hash tables",
            ));
        }
        if len > u32::MAX as usize {
            return Err(CoreError::parameter(
                "len",
                len,
                "vectors hold at most 2^32 - 1 entries",
            ));
        }
        Ok(TrackedVector {
            tag,
            slots: DriftSlots::new(norm, len),
        })
    }

    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    pub fn norm(&self) -> Norm {
        self.slots.norm()
    }

    #[inline]
    pub fn get(&self, index: u32) -> f64 {
        self.slots.get(index)
    }

    #[inline]
    pub fn add(&mut self, index: u32, delta: f64) {
        self.slots.add(index, delta);
    }

    #[inline]
    pub fn set(&mut self, index: u32, value: f64) {
        self.slots.set(index, value);
    }

    pub fn values(&self) -> impl Iterator<Item = f64> + '_ {
        self.slots.values()
    }

    /// The divergence function between two vectors, in this vector's norm.
    pub fn distance(&self, other: &TrackedVector) -> f64 {
        self.slots.distance(&other.slots)
    }
}

impl Tracked for TrackedVector {
    fn tag(&self) -> u8 {
        self.tag
    }

    #[inline]
    fn divergence(&self) -> f64 {
        self.slots.divergence()
    }

    fn set_theta(&mut self, theta: f64) {
        self.slots.set_theta(theta);
    }

    fn backup(&mut self, seq: u64, scope: BackupScope, out: &mut BackupBatch) {
        let all = self.slots.backup(seq, scope);
        for (position, written) in all.iter().enumerate() {
            let key = |bytes: &mut Vec<u8>| bytes.extend_from_slice(&written.index.to_be_bytes());
            out.push_f64(self.tag, key, written.value, written.prior);
            if position == 0 {
                out.reserve_like_last(all.len() - 1);
            }
        }
    }

    fn acknowledge(&mut self, seq: u64) {
        self.slots.acknowledge(seq);
    }

    fn fail(&mut self, seq: u64) {
        self.slots.fail(seq);
    }

    fn restore(&mut self, entry: &BackupEntry) -> Result<(), CoreError> {
        check_tag(entry, self.tag)?;
        let body: [u8; 4] = entry
            .key_body()
            .try_into()
            .map_err(|_| CoreError::undecodable("vector index", "key body is not 4 bytes"))?;
        let index = u32::from_be_bytes(body);
        if index as usize >= self.slots.len() {
            return Err(CoreError::undecodable(
                "vector index",
                format!(
                    "index {index} outside a vector of {} entries: was the operator resized since the backup?",
                    self.slots.len()
                ),
            ));
        }
        let value = match &entry.value {
            Some(bytes) => decode_f64(bytes)?,
            None => 0.0,
        };
        self.slots.restore(index, value);
        Ok(())
    }
}
