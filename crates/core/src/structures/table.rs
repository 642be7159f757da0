//! A hash table from keys to numbers.
//!
//! A table may carry a second number beside each key's value
//! ([`TrackedTable::with_carried`]): an operator's sum beside its count. It is
//! written in the same changelog record as the value and restored with it,
//! and the divergence does not count it. That holds only while it changes
//! together with the value: the value's drift decides when a key is written,
//! so a carried number that moved alone could stay unwritten past any bound.
//! Writing the two as one record halves a backup's records, and their key is
//! looked up once.

use std::borrow::Borrow;
use std::hash::Hash;

use rustc_hash::FxHashMap;

use super::prefetch::{fetch_ahead, prefetch, AHEAD};
use super::slots::DriftSlots;
use super::store::KeyStore;
use super::BackupScope;
use super::{check_tag, Norm, Tracked};
use crate::batch::BackupBatch;
use crate::entry::{decode_f64, decode_f64_pair, BackupEntry};
use crate::error::CoreError;

/// A key a [`TrackedTable`] can write into a backup entry and read back.
pub trait TableKey: Clone + Eq + Hash {
    fn write_key(&self, out: &mut Vec<u8>);
    fn read_key(bytes: &[u8]) -> Result<Self, CoreError>;
    /// Asks for the memory of the key's bytes where they live apart from
    /// the key (on the heap): a backup calls it a few keys ahead of writing
    /// them. By default nothing.
    fn prefetch_bytes(&self) {}
}

impl TableKey for Vec<u8> {
    fn write_key(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(self);
    }
    fn prefetch_bytes(&self) {
        prefetch(self, 0);
    }
    fn read_key(bytes: &[u8]) -> Result<Self, CoreError> {
        Ok(bytes.to_vec())
    }
}

impl TableKey for String {
    fn write_key(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(self.as_bytes());
    }
    fn prefetch_bytes(&self) {
        prefetch(self.as_bytes(), 0);
    }
    fn read_key(bytes: &[u8]) -> Result<Self, CoreError> {
        String::from_utf8(bytes.to_vec()).map_err(|e| CoreError::undecodable("table key", e.to_string()))
    }
}

impl TableKey for u64 {
    fn write_key(&self, out: &mut Vec<u8>) {
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
    fn write_key(&self, out: &mut Vec<u8>) {
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
///
/// Without a store every key stays in memory. With one
/// ([`TrackedTable::with_store`]) memory holds the keys that differ from the last
/// acknowledged backup, those in a backup in flight, those whose last change is
/// not durable in the store yet, and clean keys up to `resident_budget`; the rest
/// are read back from the store when touched.
pub struct TrackedTable<K: TableKey> {
    tag: u8,
    index: FxHashMap<K, u32>,
    /// The key of each slot; `None` for an evicted slot awaiting reuse.
    keys: Vec<Option<K>>,
    slots: DriftSlots,
    store: Option<StoreBacking>,
    /// Per slot, the carried number (see the module docs); `None` for a table
    /// of plain numbers.
    carried: Option<Vec<Carried>>,
}

/// A carried number: its live value, and what the last backup issued that
/// wrote its key held (the prior of its next record).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Carried {
    live: f64,
    backed: f64,
}

struct StoreBacking {
    store: Box<dyn KeyStore>,
    resident_budget: usize,
    key_bytes: Vec<u8>,
}

impl<K: TableKey> Clone for TrackedTable<K> {
    fn clone(&self) -> Self {
        TrackedTable {
            tag: self.tag,
            index: self.index.clone(),
            keys: self.keys.clone(),
            slots: self.slots.clone(),
            store: self.store.as_ref().map(|backing| StoreBacking {
                store: backing.store.boxed_clone(),
                resident_budget: backing.resident_budget,
                key_bytes: Vec::new(),
            }),
            carried: self.carried.clone(),
        }
    }
}

impl<K: TableKey + std::fmt::Debug> std::fmt::Debug for TrackedTable<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TrackedTable")
            .field("tag", &self.tag)
            .field("resident", &self.index.len())
            .field("store", &self.store.is_some())
            .finish()
    }
}

impl<K: TableKey> TrackedTable<K> {
    pub fn new(tag: u8, norm: Norm) -> Self {
        TrackedTable {
            tag,
            index: FxHashMap::default(),
            keys: Vec::new(),
            slots: DriftSlots::new(norm, 0),
            store: None,
            carried: None,
        }
    }

    /// A table whose every key carries a second number, written and restored
    /// with its value and not counted in the divergence; it must change only
    /// when the value does (see the module docs). Kept in memory: such a table
    /// has no store.
    pub fn with_carried(tag: u8, norm: Norm) -> Self {
        TrackedTable {
            carried: Some(Vec::new()),
            ..Self::new(tag, norm)
        }
    }

    /// A table whose keys live in `store`, with at most about `resident_budget`
    /// clean keys kept in memory besides those that must stay there.
    pub fn with_store(tag: u8, norm: Norm, store: Box<dyn KeyStore>, resident_budget: usize) -> Self {
        let mut table = Self::new(tag, norm);
        table.slots.track_changes();
        table.store = Some(StoreBacking {
            store,
            resident_budget,
            key_bytes: Vec::new(),
        });
        table
    }

    pub fn norm(&self) -> Norm {
        self.slots.norm()
    }

    /// Whether the table keeps its keys in a store.
    pub fn has_store(&self) -> bool {
        self.store.is_some()
    }

    /// Keys held in memory: every key without a store.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    fn slot_of<Q>(&mut self, key: &Q) -> Result<u32, CoreError>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        if let Some(&slot) = self.index.get(key) {
            return Ok(slot);
        }
        let owned = key.to_owned();
        let stored = match &mut self.store {
            Some(backing) => {
                backing.key_bytes.clear();
                owned.write_key(&mut backing.key_bytes);
                backing.store.load(self.tag, &backing.key_bytes)?
            }
            None => None,
        };
        let slot = self.slots.push();
        if let Some(stored) = stored {
            self.slots.load(slot, stored);
        }
        match self.keys.get_mut(slot as usize) {
            Some(reused) => *reused = Some(owned.clone()),
            None => self.keys.push(Some(owned.clone())),
        }
        if let Some(carried) = &mut self.carried {
            match carried.get_mut(slot as usize) {
                Some(reused) => *reused = Carried::default(),
                None => carried.push(Carried::default()),
            }
        }
        self.index.insert(owned, slot);
        Ok(slot)
    }

    /// Adds `delta` to the value of `key` (a new key starts at zero) and returns the
    /// new value. Fails only when the store cannot be read.
    #[inline]
    pub fn add<Q>(&mut self, key: &Q, delta: f64) -> Result<f64, CoreError>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        let slot = self.slot_of(key)?;
        self.slots.add(slot, delta);
        Ok(self.slots.get(slot))
    }

    /// A table with a carried number: adds `delta` to the value of `key` and
    /// `carried_delta` to its carried number, and returns both. A table
    /// without one adds to the value alone and returns 0 for the other.
    #[inline]
    pub fn add_pair<Q>(&mut self, key: &Q, delta: f64, carried_delta: f64) -> Result<(f64, f64), CoreError>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        let slot = self.slot_of(key)?;
        self.slots.add(slot, delta);
        let carried = match &mut self.carried {
            Some(carried) => {
                let number = &mut carried[slot as usize].live;
                *number += carried_delta;
                *number
            }
            None => 0.0,
        };
        Ok((self.slots.get(slot), carried))
    }

    /// The value of `key` and its carried number (0 in a table without
    /// one), if the key is in memory.
    pub fn get_pair<Q>(&self, key: &Q) -> Option<(f64, f64)>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.index
            .get(key)
            .map(|&slot| (self.slots.get(slot), self.carried_of(slot)))
    }

    fn carried_of(&self, slot: u32) -> f64 {
        self.carried.as_ref().map_or(0.0, |carried| carried[slot as usize].live)
    }

    /// The keys in memory with their values and carried numbers.
    pub fn iter_pairs(&self) -> impl Iterator<Item = (&K, f64, f64)> + '_ {
        self.keys
            .iter()
            .zip(self.slots.values())
            .enumerate()
            .filter_map(|(slot, (key, value))| key.as_ref().map(|key| (key, value, self.carried_of(slot as u32))))
    }

    /// Sets the value of `key` from a backup, its carried number unchanged:
    /// for reading a changelog written before the two shared a record.
    pub fn restore_value(&mut self, key: &K, value: f64) -> Result<(), CoreError> {
        let slot = self.slot_of(key)?;
        self.slots.restore(slot, value);
        Ok(())
    }

    /// Sets the carried number of `key` from a backup, its value unchanged;
    /// see [`TrackedTable::restore_value`]. A table without one ignores it.
    pub fn restore_carried(&mut self, key: &K, carried: f64) -> Result<(), CoreError> {
        let slot = self.slot_of(key)?;
        self.restore_carried_at(slot, carried);
        Ok(())
    }

    fn restore_carried_at(&mut self, slot: u32, carried: f64) {
        if let Some(all) = &mut self.carried {
            all[slot as usize] = Carried {
                live: carried,
                backed: carried,
            };
        }
    }

    pub fn set<Q>(&mut self, key: &Q, value: f64) -> Result<(), CoreError>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        let slot = self.slot_of(key)?;
        self.slots.set(slot, value);
        Ok(())
    }

    /// The value of `key` if it is in memory (every key of a table without a store).
    pub fn get<Q>(&self, key: &Q) -> Option<f64>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.index.get(key).map(|&slot| self.slots.get(slot))
    }

    /// The value of `key`, read from the store when it is not in memory.
    pub fn lookup(&self, key: &K) -> Result<Option<f64>, CoreError> {
        if let Some(value) = self.get(key) {
            return Ok(Some(value));
        }
        match &self.store {
            Some(backing) => {
                let mut bytes = Vec::new();
                key.write_key(&mut bytes);
                Ok(backing.store.load(self.tag, &bytes)?.map(|stored| stored.live))
            }
            None => Ok(None),
        }
    }

    /// The keys in memory with their values (every key of a table without a store).
    pub fn iter(&self) -> impl Iterator<Item = (&K, f64)> + '_ {
        self.keys
            .iter()
            .zip(self.slots.values())
            .filter_map(|(key, value)| key.as_ref().map(|key| (key, value)))
    }

    /// Every key with its value, the store's included.
    pub fn entries(&self) -> Result<FxHashMap<K, f64>, CoreError> {
        let mut all = FxHashMap::default();
        if let Some(backing) = &self.store {
            backing.store.for_each(self.tag, &mut |bytes, stored| {
                all.insert(K::read_key(bytes)?, stored.live);
                Ok(())
            })?;
        }
        all.extend(self.iter().map(|(key, value)| (key.clone(), value)));
        Ok(all)
    }

    /// The divergence function between two tables, in this table's norm; a key
    /// missing from one side counts as zero there. A store that cannot be read
    /// makes the distance infinite, so that it passes no bound.
    pub fn distance(&self, other: &TrackedTable<K>) -> f64 {
        let (Ok(mine), Ok(theirs)) = (self.entries(), other.entries()) else {
            return f64::INFINITY;
        };
        let common = mine
            .iter()
            .map(|(k, v)| (v - theirs.get(k).copied().unwrap_or(0.0)).abs());
        let theirs_only = theirs
            .iter()
            .filter(|(k, _)| !mine.contains_key(*k))
            .map(|(_, v)| v.abs());
        let diffs = common.chain(theirs_only);
        match self.norm() {
            Norm::L1 => diffs.sum(),
            Norm::L2 => diffs.map(|d| d * d).sum::<f64>().sqrt(),
            Norm::Max => diffs.fold(0.0, f64::max),
            Norm::KeyCount => {
                let only_mine = mine.keys().filter(|k| !theirs.contains_key(*k)).count();
                let only_theirs = theirs.keys().filter(|k| !mine.contains_key(*k)).count();
                (only_mine + only_theirs) as f64
            }
        }
    }

    /// Stages every change since the last call for the store. A table without a
    /// store does nothing.
    pub fn stage_changes(&mut self) {
        let Some(backing) = &mut self.store else { return };
        let (tag, keys) = (self.tag, &self.keys);
        self.slots.take_changed(|slot, record| {
            if let Some(key) = &keys[slot as usize] {
                backing.key_bytes.clear();
                key.write_key(&mut backing.key_bytes);
                backing.store.stage(tag, &backing.key_bytes, record);
            }
        });
    }

    /// Everything staged is durable in the store: clean keys over the budget may
    /// leave memory.
    pub fn changes_durable(&mut self) {
        let Some(backing) = &mut self.store else { return };
        let over = self.index.len() > backing.resident_budget;
        self.slots.set_pressure(over);
        if over {
            let (keys, index) = (&mut self.keys, &mut self.index);
            self.slots.evict(|slot| {
                if let Some(key) = keys[slot as usize].take() {
                    index.remove(&key);
                }
            });
            self.slots.set_pressure(self.index.len() > backing.resident_budget);
        }
    }

    /// After a restart on a durable store: brings back into memory every key that
    /// differs (or may differ) from the last acknowledged backup, so that drift
    /// tracking goes on exactly; the next backup writes each of them. Meant for a
    /// freshly built table.
    pub fn load_drifted(&mut self) -> Result<usize, CoreError> {
        let Some(backing) = self.store.take() else { return Ok(0) };
        let mut loaded = Vec::new();
        let result = backing.store.for_each_drifted(self.tag, &mut |bytes, stored| {
            loaded.push((K::read_key(bytes)?, stored));
            Ok(())
        });
        self.store = Some(backing);
        result?;
        for (key, stored) in &loaded {
            let slot = self.slots.push();
            self.slots.load(slot, *stored);
            self.keys.push(Some(key.clone()));
            self.index.insert(key.clone(), slot);
        }
        Ok(loaded.len())
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

    fn backup(&mut self, seq: u64, scope: BackupScope, out: &mut BackupBatch) {
        let keys = &self.keys;
        let all = self.slots.backup(seq, scope);
        // Two steps: the key `AHEAD` records on, and the bytes of the one
        // half as far on, whose key has landed by then.
        let fetch_record = |step: usize, carried: Option<&[Carried]>| {
            if let Some(written) = all.get(step) {
                prefetch(keys, written.index as usize);
                if let Some(carried) = carried {
                    prefetch(carried, written.index as usize);
                }
            }
        };
        let bytes_ahead = |position: usize| {
            let slot = all.get(position + AHEAD / 2)?.index as usize;
            keys[slot].as_ref()
        };
        for (position, written) in all.iter().enumerate() {
            fetch_ahead(position, |step| fetch_record(step, self.carried.as_deref()));
            if let Some(key) = bytes_ahead(position) {
                key.prefetch_bytes();
            }
            let key = |bytes: &mut Vec<u8>| write_key_of(keys, written.index, bytes);
            match &mut self.carried {
                None => out.push_f64(self.tag, key, written.value, written.prior),
                Some(carried) => {
                    let number = &mut carried[written.index as usize];
                    let prior = written.prior.map(|prior| [prior, number.backed]);
                    number.backed = number.live;
                    out.push_f64s(self.tag, key, [written.value, number.live], prior);
                }
            }
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
        let key = K::read_key(entry.key_body())?;
        let (value, carried) = match &entry.value {
            Some(bytes) if self.carried.is_some() => decode_f64_pair(bytes)?,
            Some(bytes) => (decode_f64(bytes)?, 0.0),
            // A deletion of a key this table never held leaves no key behind.
            None if !self.index.contains_key(&key) => return Ok(()),
            None => (0.0, 0.0),
        };
        let slot = self.slot_of(&key)?;
        self.slots.restore(slot, value);
        self.restore_carried_at(slot, carried);
        Ok(())
    }
}

/// Writes the key of `slot` (nothing for an evicted one, which no backup
/// writes).
fn write_key_of<K: TableKey>(keys: &[Option<K>], slot: u32, bytes: &mut Vec<u8>) {
    if let Some(key) = &keys[slot as usize] {
        key.write_key(bytes);
    }
}
