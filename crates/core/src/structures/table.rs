//! A hash table from keys to numbers.

use std::borrow::Borrow;
use std::hash::Hash;

use rustc_hash::FxHashMap;

use super::slots::DriftSlots;
use super::BackupScope;
use super::{check_tag, Norm, Tracked};
use crate::entry::{decode_f64, encode_f64, entry_key, BackupEntry, EntryBytes};
use crate::error::CoreError;

/// A key a [`TrackedTable`] can write into a backup entry and read back.
pub trait TableKey: Clone + Eq + Hash {
    fn write_key(&self, out: &mut EntryBytes);
    fn read_key(bytes: &[u8]) -> Result<Self, CoreError>;
}

impl TableKey for Vec<u8> {
    fn write_key(&self, out: &mut EntryBytes) {
        out.extend_from_slice(self);
    }
    fn read_key(bytes: &[u8]) -> Result<Self, CoreError> {
        Ok(bytes.to_vec())
    }
}

impl TableKey for String {
    fn write_key(&self, out: &mut EntryBytes) {
        out.extend_from_slice(self.as_bytes());
    }
    fn read_key(bytes: &[u8]) -> Result<Self, CoreError> {
        String::from_utf8(bytes.to_vec()).map_err(|e| CoreError::undecodable("table key", e.to_string()))
    }
}

impl TableKey for u64 {
    fn write_key(&self, out: &mut EntryBytes) {
        out.extend_from_slice(&self.to_be_bytes());
    }
    fn read_key(bytes: &[u8]) -> Result<Self, CoreError> {
        let bytes: [u8; 8] = bytes
            .try_into()
            .map_err(|_| CoreError::undecodable("table key", "a u64 key is 8 bytes"))?;
        Ok(u64::from_be_bytes(bytes))
    }
}

impl TableKey for (u64, u8) {
    fn write_key(&self, out: &mut EntryBytes) {
        out.extend_from_slice(&self.0.to_be_bytes());
        out.push(self.1);
    }
    fn read_key(bytes: &[u8]) -> Result<Self, CoreError> {
        let bytes: [u8; 9] = bytes
            .try_into()
            .map_err(|_| CoreError::undecodable("table key", "a (u64, u8) key is 9 bytes"))?;
        let mut key = [0u8; 8];
        key.copy_from_slice(&bytes[..8]);
        Ok((u64::from_be_bytes(key), bytes[8]))
    }
}

/// A hash table with L1, L2, max-difference or key-count divergence.
#[derive(Clone, Debug)]
pub struct TrackedTable<K: TableKey> {
    tag: u8,
    index: FxHashMap<K, u32>,
    keys: Vec<K>,
    slots: DriftSlots,
}

impl<K: TableKey> TrackedTable<K> {
    pub fn new(tag: u8, norm: Norm) -> Self {
        TrackedTable {
            tag,
            index: FxHashMap::default(),
            keys: Vec::new(),
            slots: DriftSlots::new(norm, 0),
        }
    }

    pub fn norm(&self) -> Norm {
        self.slots.norm()
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    fn slot_of<Q>(&mut self, key: &Q) -> u32
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        if let Some(&slot) = self.index.get(key) {
            return slot;
        }
        let slot = self.slots.push();
        let owned = key.to_owned();
        self.keys.push(owned.clone());
        self.index.insert(owned, slot);
        slot
    }

    /// Adds `delta` to the value of `key` (a new key starts at zero) and returns the
    /// new value.
    #[inline]
    pub fn add<Q>(&mut self, key: &Q, delta: f64) -> f64
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        let slot = self.slot_of(key);
        self.slots.add(slot, delta);
        self.slots.get(slot)
    }

    pub fn set<Q>(&mut self, key: &Q, value: f64)
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        let slot = self.slot_of(key);
        self.slots.set(slot, value);
    }

    pub fn get<Q>(&self, key: &Q) -> Option<f64>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.index.get(key).map(|&slot| self.slots.get(slot))
    }

    pub fn iter(&self) -> impl Iterator<Item = (&K, f64)> + '_ {
        self.keys.iter().zip(self.slots.values())
    }

    /// The divergence function between two tables, in this table's norm; a key
    /// missing from one side counts as zero there.
    pub fn distance(&self, other: &TrackedTable<K>) -> f64 {
        let mine = self.iter().map(|(k, v)| (v - other.get(k).unwrap_or(0.0)).abs());
        let theirs_only = other
            .iter()
            .filter(|(k, _)| !self.index.contains_key(*k))
            .map(|(_, v)| v.abs());
        let diffs = mine.chain(theirs_only);
        match self.norm() {
            Norm::L1 => diffs.sum(),
            Norm::L2 => diffs.map(|d| d * d).sum::<f64>().sqrt(),
            Norm::Max => diffs.fold(0.0, f64::max),
            Norm::KeyCount => {
                let only_mine = self.keys.iter().filter(|k| !other.index.contains_key(*k)).count();
                let only_theirs = other.keys.iter().filter(|k| !self.index.contains_key(*k)).count();
                (only_mine + only_theirs) as f64
            }
        }
    }
}

impl<K: TableKey> Tracked for TrackedTable<K> {
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

    fn backup(&mut self, seq: u64, scope: BackupScope, out: &mut Vec<BackupEntry>) {
        let tag = self.tag;
        let keys = &self.keys;
        out.extend(self.slots.backup(seq, scope).iter().map(|&(slot, value)| {
            let mut key = entry_key(tag, &[]);
            keys[slot as usize].write_key(&mut key);
            BackupEntry {
                key,
                value: Some(encode_f64(value)),
            }
        }));
    }

    fn acknowledge(&mut self, seq: u64) {
        self.slots.acknowledge(seq);
    }

    fn fail(&mut self, seq: u64) {
        self.slots.fail(seq);
    }

    fn restore(&mut self, entry: &BackupEntry) -> Result<(), CoreError> {
        check_tag(entry, self.tag)?;
        let key = K::read_key(entry.key_body())?;
        let value = match &entry.value {
            Some(bytes) => decode_f64(bytes)?,
            // A deletion of a key this table never held leaves no key behind.
            None if !self.index.contains_key(&key) => return Ok(()),
            None => 0.0,
        };
        let slot = self.slot_of(&key);
        self.slots.restore(slot, value);
        Ok(())
    }
}
