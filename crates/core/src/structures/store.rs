//! Where a store-backed [`TrackedTable`](super::TrackedTable) keeps the keys it
//! does not hold in memory.
//!
//! The table keeps in memory only the keys that differ from the last
//! acknowledged backup (or may: owed, in flight), the keys whose last change is
//! not durable yet, and up to a budget of clean ones; every other key lives in
//! the store. The table stages its changes (`stage`); the adapter writes them
//! atomically with the input offset they are consistent at, and tells the table
//! when they are durable, after which clean keys may be evicted. The
//! Kafka service's store is RocksDB; [`MemoryKeyStore`] is the in-memory one of
//! the tests and the harness.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

pub use super::slots::{StoredDrift, StoredSlot};
use crate::error::CoreError;

/// What a scan of the store calls with each key and its record; an error stops
/// the scan.
pub type RecordVisitor<'a> = dyn FnMut(&[u8], StoredSlot) -> Result<(), CoreError> + 'a;

/// A key's record in a store, with the tag of the structure it belongs to.
pub trait KeyStore: Send {
    /// The record of a key, as of the last durable write.
    fn load(&self, tag: u8, key: &[u8]) -> Result<Option<StoredSlot>, CoreError>;
    /// Stages a key's record for the next write.
    fn stage(&mut self, tag: u8, key: &[u8], record: StoredSlot);
    /// Calls `each` with every durable record of the structure whose record has a
    /// drift (differs, or may differ, from the last acknowledged backup); a
    /// restart makes them resident again.
    fn for_each_drifted(&self, tag: u8, each: &mut RecordVisitor<'_>) -> Result<(), CoreError>;
    /// Calls `each` with every durable record of the structure.
    fn for_each(&self, tag: u8, each: &mut RecordVisitor<'_>) -> Result<(), CoreError>;
    /// For `Clone` of a table: an independent copy of the durable and staged
    /// records where the store can make one cheaply (the in-memory store), a
    /// second handle to the same store otherwise.
    fn boxed_clone(&self) -> Box<dyn KeyStore>;
}

type Records = BTreeMap<(u8, Vec<u8>), StoredSlot>;

#[derive(Debug, Default)]
struct MemoryInner {
    durable: Records,
    staged: Vec<(u8, Vec<u8>, StoredSlot)>,
    writes: u64,
    /// Staged records are durable at once.
    write_through: bool,
}

/// An in-memory [`KeyStore`] whose staged records become durable on
/// [`MemoryKeyStore::write`]. Clones share the same records, so a test can keep
/// a handle while a table owns another, and "crash" by dropping the table: the
/// staged but unwritten records are lost, as a process crash loses them.
#[derive(Clone, Debug, Default)]
pub struct MemoryKeyStore {
    inner: Arc<Mutex<MemoryInner>>,
}

impl MemoryKeyStore {
    pub fn new() -> Self {
        Self::default()
    }

    /// A store whose staged records are durable at once, for adapters that
    /// never crash between staging and writing (the in-memory harness).
    pub fn write_through() -> Self {
        let store = Self::default();
        store.lock().write_through = true;
        store
    }

    fn lock(&self) -> MutexGuard<'_, MemoryInner> {
        // A panic while the lock was held cannot leave the maps half-updated in a
        // way that matters to a test store.
        self.inner.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Makes everything staged so far durable, as one atomic write.
    pub fn write(&self) {
        let mut inner = self.lock();
        let staged = std::mem::take(&mut inner.staged);
        for (tag, key, record) in staged {
            inner.durable.insert((tag, key), record);
        }
        inner.writes += 1;
    }

    /// Forgets what was staged and not written (a crash).
    pub fn drop_staged(&self) {
        self.lock().staged.clear();
    }

    /// Durable records.
    pub fn len(&self) -> usize {
        self.lock().durable.len()
    }

    pub fn is_empty(&self) -> bool {
        self.lock().durable.is_empty()
    }
}

impl KeyStore for MemoryKeyStore {
    fn boxed_clone(&self) -> Box<dyn KeyStore> {
        let inner = self.lock();
        Box::new(MemoryKeyStore {
            inner: Arc::new(Mutex::new(MemoryInner {
                durable: inner.durable.clone(),
                staged: inner.staged.clone(),
                writes: inner.writes,
                write_through: inner.write_through,
            })),
        })
    }

    fn load(&self, tag: u8, key: &[u8]) -> Result<Option<StoredSlot>, CoreError> {
        Ok(self.lock().durable.get(&(tag, key.to_vec())).copied())
    }

    fn stage(&mut self, tag: u8, key: &[u8], record: StoredSlot) {
        let mut inner = self.lock();
        if inner.write_through {
            inner.durable.insert((tag, key.to_vec()), record);
        } else {
            inner.staged.push((tag, key.to_vec(), record));
        }
    }

    fn for_each_drifted(&self, tag: u8, each: &mut RecordVisitor<'_>) -> Result<(), CoreError> {
        let records: Vec<_> = self
            .records(tag)
            .into_iter()
            .filter(|(_, r)| r.drift.is_some())
            .collect();
        records.iter().try_for_each(|(key, record)| each(key, *record))
    }

    fn for_each(&self, tag: u8, each: &mut RecordVisitor<'_>) -> Result<(), CoreError> {
        self.records(tag)
            .iter()
            .try_for_each(|(key, record)| each(key, *record))
    }
}

impl MemoryKeyStore {
    /// A copy, so that `each` may call back into the store.
    fn records(&self, tag: u8) -> Vec<(Vec<u8>, StoredSlot)> {
        self.lock()
            .durable
            .range((tag, Vec::new())..)
            .take_while(|((t, _), _)| *t == tag)
            .map(|((_, key), record)| (key.clone(), *record))
            .collect()
    }
}
