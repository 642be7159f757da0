//! A task's local RocksDB store: its keyed state, written a poll batch at a time
//! with the input offset the state is exact at.
//!
//! Layout (one database per input partition, under
//! `<state_dir>/<group>/<input topic>-<partition>`):
//!
//! | key | value |
//! | --- | --- |
//! | `\0meta` | version, store identity, next input offset, boot id |
//! | `\0checkpoint` | version, the next backup sequence, the newest source positions the state includes, and what a crash now leaves uncertain in the changelog (`crate::core::StoreCheckpoint`) |
//! | `r` tag key | version, live value, and while it drifts its backed value and presence |
//! | `d` tag key | empty: the index of drifted keys a restart reloads |
//!
//! Every write is one `WriteBatch` with the WAL on and no fsync: it survives
//! the process being killed, not the machine losing power. So the meta record
//! keeps the machine's boot id, and a store last written before a reboot is
//! not trusted (the changelog is); see [`StoreMeta::trusted_after_crash`].

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use rocksdb::{BlockBasedIndexType, BlockBasedOptions, Cache, Direction, IteratorMode, Options, WriteBatch, DB};

use super::ServiceError;
use crate::core::entry::PayloadReader;
use crate::core::structures::RecordVisitor;
use crate::core::{CoreError, CrashPriors, KeyStore, SourcePositions, StoreCheckpoint, StoredDrift, StoredSlot};

/// The layout version this build writes and reads.
const STORE_VERSION: u8 = 1;
const META_KEY: &[u8] = b"\0meta";
const CHECKPOINT_KEY: &[u8] = b"\0checkpoint";
const RECORD: u8 = b'r';
const DRIFTED: u8 = b'd';

/// What the store says about itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreMeta {
    /// Stamped on the task's changelog markers: a restart trusts this store only
    /// if the changelog's last marker is its own.
    pub store_id: u64,
    /// The machine's boot id at the last write (empty where unknown).
    pub boot_id: String,
    /// Where the state is exact (every input item before
    /// `checkpoint.next_offset`), and what the changelog may hold then.
    pub checkpoint: StoreCheckpoint,
}

impl StoreMeta {
    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(18 + self.boot_id.len());
        out.push(STORE_VERSION);
        out.extend_from_slice(&self.store_id.to_le_bytes());
        out.extend_from_slice(&self.checkpoint.next_offset.to_le_bytes());
        out.extend_from_slice(self.boot_id.as_bytes());
        out
    }

    fn decode(bytes: &[u8]) -> Result<Self, String> {
        let (&version, body) = bytes.split_first().ok_or("an empty meta record")?;
        if version != STORE_VERSION {
            return Err(format!(
                "written with store layout version {version}; this build reads version {STORE_VERSION}"
            ));
        }
        let mut reader = PayloadReader::new(body, "store meta record");
        let store_id = reader.u64().map_err(|e| e.to_string())?;
        let next_offset = reader.u64().map_err(|e| e.to_string())?;
        let boot_id = String::from_utf8(body[16..].to_vec()).map_err(|e| format!("boot id: {e}"))?;
        Ok(StoreMeta {
            store_id,
            boot_id,
            checkpoint: StoreCheckpoint {
                next_offset,
                ..StoreCheckpoint::default()
            },
        })
    }

    /// The checkpoint besides its offset (which the meta record holds).
    fn encode_checkpoint(&self) -> Vec<u8> {
        let mut out = vec![STORE_VERSION];
        out.extend_from_slice(&self.checkpoint.next_seq.to_le_bytes());
        self.checkpoint.sources.encode_into(&mut out);
        self.checkpoint.priors.encode_into(&mut out);
        out
    }

    /// Reads the rest of the checkpoint back. A store written before it
    /// existed has none: no source positions, and nothing it knew uncertain.
    fn decode_checkpoint(&mut self, bytes: &[u8]) -> Result<(), String> {
        let (&version, body) = bytes.split_first().ok_or("an empty checkpoint record")?;
        if version != STORE_VERSION {
            return Err(format!(
                "a checkpoint written with store layout version {version}; this build reads version {STORE_VERSION}"
            ));
        }
        let mut reader = PayloadReader::new(body, "store checkpoint");
        let read = |reader: &mut PayloadReader<'_>| -> Result<(u64, SourcePositions, CrashPriors), CoreError> {
            Ok((
                reader.u64()?,
                SourcePositions::decode_from(reader)?,
                CrashPriors::decode_from(reader)?,
            ))
        };
        let (next_seq, sources, priors) = read(&mut reader).map_err(|e| e.to_string())?;
        reader.finish().map_err(|e| e.to_string())?;
        self.checkpoint.next_seq = next_seq;
        self.checkpoint.sources = sources;
        self.checkpoint.priors = priors;
        Ok(())
    }

    /// Whether writes acknowledged before a crash are all still here: the machine
    /// has not restarted since the last write (an unknown boot id on both sides
    /// counts as the same boot).
    pub fn trusted_after_crash(&self) -> bool {
        self.boot_id == boot_id()
    }
}

/// The id of this boot of the machine, where the OS tells it (Linux).
fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|id| id.trim().to_string())
        .unwrap_or_default()
}

/// How much memory a task's store may use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoreBudget {
    /// RocksDB's block cache plus its write buffers.
    pub cache_bytes: usize,
    /// Clean keys kept in memory besides those that must be there.
    pub resident_keys: usize,
}

struct Inner {
    db: DB,
    batch: WriteBatch,
    path: PathBuf,
    /// Whether the store may hold a drifted-key record: not while it is new
    /// (every write carries the meta record, so a store without one is empty)
    /// and nothing drifted was staged. A clean key then has no record to delete,
    /// which halves a restore's writes.
    drifted_may_exist: bool,
}

/// One task's store. Clones share it: the task writes, its operator's tables
/// read and stage through [`TaskStore::key_store`].
#[derive(Clone)]
pub struct TaskStore {
    inner: Arc<Mutex<Inner>>,
    path: PathBuf,
}

fn store_error(path: &Path, reason: impl std::fmt::Display) -> ServiceError {
    ServiceError::State {
        path: path.to_path_buf(),
        reason: reason.to_string(),
    }
}

fn options(budget: StoreBudget) -> Options {
    let mut options = Options::default();
    options.create_if_missing(true);
    // A quarter of the budget for write buffers (two of them), the rest caches
    // blocks; bloom filters keep reads of absent keys (new words) off the disk.
    let buffer = (budget.cache_bytes / 8).max(1 << 20);
    options.set_write_buffer_size(buffer);
    options.set_max_write_buffer_number(2);
    let mut table = BlockBasedOptions::default();
    table.set_block_cache(&Cache::new_lru_cache(
        budget.cache_bytes.saturating_sub(2 * buffer).max(1 << 20),
    ));
    table.set_bloom_filter(10.0, false);
    // Index and filter blocks count against the cache, so the budget holds
    // however many keys the store has. Partitioned, so that each is a small
    // block: a whole-file filter of millions of keys is larger than a cache
    // shard, would never stay cached, and would be read from the file on every
    // lookup of a new key.
    table.set_index_type(BlockBasedIndexType::TwoLevelIndexSearch);
    table.set_partition_filters(true);
    table.set_metadata_block_size(4096);
    table.set_cache_index_and_filter_blocks(true);
    table.set_pin_top_level_index_and_filter(true);
    table.set_pin_l0_filter_and_index_blocks_in_cache(true);
    options.set_block_based_table_factory(&table);
    options.set_compression_type(rocksdb::DBCompressionType::Lz4);
    options
}

impl TaskStore {
    /// Opens (creating when missing) the store at `path`; returns what it says
    /// about itself, `None` for a new one.
    pub fn open(path: &Path, budget: StoreBudget) -> Result<(Self, Option<StoreMeta>), ServiceError> {
        std::fs::create_dir_all(path).map_err(|e| store_error(path, format!("cannot create it: {e}")))?;
        let db = DB::open(&options(budget), path).map_err(|e| store_error(path, format!("cannot open it: {e}")))?;
        let mut meta = db
            .get_pinned(META_KEY)
            .map_err(|e| store_error(path, format!("reading its meta record: {e}")))?
            .map(|bytes| StoreMeta::decode(&bytes))
            .transpose()
            .map_err(|reason| store_error(path, reason))?;
        if let Some(meta) = &mut meta {
            let checkpoint = db
                .get_pinned(CHECKPOINT_KEY)
                .map_err(|e| store_error(path, format!("reading its checkpoint: {e}")))?;
            if let Some(bytes) = checkpoint {
                meta.decode_checkpoint(&bytes)
                    .map_err(|reason| store_error(path, reason))?;
            }
        }
        let store = TaskStore {
            inner: Arc::new(Mutex::new(Inner {
                db,
                batch: WriteBatch::default(),
                path: path.to_path_buf(),
                drifted_may_exist: meta.is_some(),
            })),
            path: path.to_path_buf(),
        };
        Ok((store, meta))
    }

    /// Deletes the store at `path` and opens a new, empty one: for a task that
    /// recovers from the changelog instead.
    pub fn recreate(path: &Path, budget: StoreBudget) -> Result<Self, ServiceError> {
        if path.exists() {
            DB::destroy(&Options::default(), path)
                .map_err(|e| store_error(path, format!("cannot delete the stale store: {e}")))?;
        }
        Ok(Self::open(path, budget)?.0)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Deletes every record, meta record included: a restore that must start
    /// over from another marker leaves nothing of its first read behind.
    pub fn clear(&self) -> Result<(), ServiceError> {
        let mut inner = self.lock();
        inner.batch = WriteBatch::default();
        let mut batch = WriteBatch::default();
        for item in inner.db.iterator(IteratorMode::Start) {
            let (key, _) = item.map_err(|e| store_error(&inner.path, format!("reading it to clear it: {e}")))?;
            batch.delete(key);
        }
        inner.drifted_may_exist = false;
        inner
            .db
            .write(batch)
            .map_err(|e| store_error(&inner.path, format!("clearing it: {e}")))
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        lock(&self.inner)
    }

    /// A handle for the operator's tables.
    pub fn key_store(&self) -> Box<dyn KeyStore> {
        Box::new(RocksKeyStore {
            inner: Arc::clone(&self.inner),
        })
    }

    /// Writes everything staged, with `meta`, as one atomic write.
    pub fn write(&self, meta: &StoreMeta) -> Result<(), ServiceError> {
        let mut inner = self.lock();
        let mut batch = std::mem::take(&mut inner.batch);
        batch.put(META_KEY, meta.encode());
        batch.put(CHECKPOINT_KEY, meta.encode_checkpoint());
        inner
            .db
            .write(batch)
            .map_err(|e| store_error(&inner.path, format!("writing a batch: {e}")))
    }

    /// A new store's meta record at `next_offset`, with a fresh identity.
    pub fn new_meta(next_offset: u64) -> StoreMeta {
        StoreMeta {
            store_id: rand::random::<u64>() | 1,
            boot_id: boot_id(),
            checkpoint: StoreCheckpoint {
                next_offset,
                ..StoreCheckpoint::default()
            },
        }
    }
}

fn lock(inner: &Mutex<Inner>) -> MutexGuard<'_, Inner> {
    // One thread uses a store; a panic elsewhere while it was held leaves
    // nothing half-written that RocksDB would not roll back.
    inner.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn record_key(space: u8, tag: u8, key: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(2 + key.len());
    out.push(space);
    out.push(tag);
    out.extend_from_slice(key);
    out
}

fn encode_record(record: &StoredSlot) -> Vec<u8> {
    let mut out = Vec::with_capacity(19);
    out.push(STORE_VERSION);
    out.extend_from_slice(&record.live.to_le_bytes());
    if let Some(drift) = record.drift {
        out.extend_from_slice(&drift.backed.to_le_bytes());
        out.push(u8::from(drift.present));
    }
    out
}

fn decode_record(bytes: &[u8]) -> Result<StoredSlot, CoreError> {
    let (&version, body) = bytes.split_first().ok_or_else(|| CoreError::Undecodable {
        what: "state store record",
        reason: "empty".into(),
    })?;
    if version != STORE_VERSION {
        return Err(CoreError::UnknownEncodingVersion {
            found: version,
            supported: STORE_VERSION,
        });
    }
    let mut reader = PayloadReader::new(body, "state store record");
    let live = reader.f64()?;
    let drift = if reader.is_empty() {
        None
    } else {
        let backed = reader.f64()?;
        let present = reader.u8()? != 0;
        Some(StoredDrift { backed, present })
    };
    reader.finish()?;
    Ok(StoredSlot { live, drift })
}

fn read_error(path: &Path, error: rocksdb::Error) -> CoreError {
    CoreError::Undecodable {
        what: "state store",
        reason: format!("{}: {error}", path.display()),
    }
}

/// The tables' view of a [`TaskStore`].
struct RocksKeyStore {
    inner: Arc<Mutex<Inner>>,
}

impl RocksKeyStore {
    fn scan(&self, space: u8, tag: u8, each: &mut RecordVisitor<'_>) -> Result<(), CoreError> {
        let inner = lock(&self.inner);
        let prefix = [space, tag];
        for item in inner.db.iterator(IteratorMode::From(&prefix, Direction::Forward)) {
            let (key, value) = item.map_err(|e| read_error(&inner.path, e))?;
            if !key.starts_with(&prefix) {
                break;
            }
            let record = if space == RECORD {
                decode_record(&value)?
            } else {
                let stored = inner
                    .db
                    .get_pinned(record_key(RECORD, tag, &key[2..]))
                    .map_err(|e| read_error(&inner.path, e))?
                    .ok_or_else(|| CoreError::Undecodable {
                        what: "state store",
                        reason: format!("{}: a drifted key without its record", inner.path.display()),
                    })?;
                decode_record(&stored)?
            };
            each(&key[2..], record)?;
        }
        Ok(())
    }
}

impl KeyStore for RocksKeyStore {
    fn load(&self, tag: u8, key: &[u8]) -> Result<Option<StoredSlot>, CoreError> {
        let inner = lock(&self.inner);
        let value = inner
            .db
            .get_pinned(record_key(RECORD, tag, key))
            .map_err(|e| read_error(&inner.path, e))?;
        value.map(|bytes| decode_record(&bytes)).transpose()
    }

    fn stage(&mut self, tag: u8, key: &[u8], record: StoredSlot) {
        let mut inner = lock(&self.inner);
        inner.batch.put(record_key(RECORD, tag, key), encode_record(&record));
        let drifted = record_key(DRIFTED, tag, key);
        if record.drift.is_some() {
            inner.batch.put(drifted, []);
            inner.drifted_may_exist = true;
        } else if inner.drifted_may_exist {
            inner.batch.delete(drifted);
        }
    }

    fn for_each_drifted(&self, tag: u8, each: &mut RecordVisitor<'_>) -> Result<(), CoreError> {
        self.scan(DRIFTED, tag, each)
    }

    fn for_each(&self, tag: u8, each: &mut RecordVisitor<'_>) -> Result<(), CoreError> {
        self.scan(RECORD, tag, each)
    }

    /// RocksDB cannot be copied cheaply: a clone is a second handle.
    fn boxed_clone(&self) -> Box<dyn KeyStore> {
        Box::new(RocksKeyStore {
            inner: Arc::clone(&self.inner),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::structures::{Norm, Tracked, TrackedTable};
    use crate::core::{BackupBatch, BackupScope};

    const BUDGET: StoreBudget = StoreBudget {
        cache_bytes: 8 << 20,
        resident_keys: 4,
    };

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("afstream-store-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn a_table_on_rocksdb_survives_a_reopen_with_its_drift_and_checkpoint() {
        let dir = temp_dir("reopen");
        let (store, meta) = TaskStore::open(&dir, BUDGET).unwrap();
        assert!(meta.is_none(), "a new store");
        let mut table: TrackedTable<u64> = TrackedTable::with_store(1, Norm::L1, store.key_store(), 4);
        for key in 0..100u64 {
            table.add(&key, key as f64).unwrap();
        }
        table.backup(0, BackupScope::Drifted, &mut BackupBatch::new(0));
        table.acknowledge(0);
        table.add(&7, 3.0).unwrap();
        table.stage_changes();
        let mut sources = SourcePositions::default();
        sources.advance(crate::core::SourcePosition {
            source: 5,
            offset: 40,
            index: 3,
        });
        let meta = StoreMeta {
            checkpoint: StoreCheckpoint {
                next_offset: 100,
                next_seq: 17,
                sources,
                priors: CrashPriors::default(),
            },
            ..TaskStore::new_meta(0)
        };
        store.write(&meta).unwrap();
        table.changes_durable();
        assert!(table.len() <= 5, "clean keys left memory: {} resident", table.len());
        drop(table);
        drop(store);

        let (store, reopened) = TaskStore::open(&dir, BUDGET).unwrap();
        assert_eq!(reopened.as_ref(), Some(&meta));
        assert!(reopened.unwrap().trusted_after_crash(), "same boot");
        let mut table: TrackedTable<u64> = TrackedTable::with_store(1, Norm::L1, store.key_store(), 4);
        assert_eq!(table.load_drifted().unwrap(), 1, "only key 7 drifted");
        assert_eq!(table.divergence(), 3.0);
        assert_eq!(table.lookup(&7).unwrap(), Some(10.0));
        assert_eq!(table.lookup(&99).unwrap(), Some(99.0));
        assert_eq!(table.entries().unwrap().len(), 100);
        drop(table);
        drop(store);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A new store writes no drifted-key deletions for clean keys (it has no
    /// such record); once a key drifted, in this session or an earlier one, its
    /// record is deleted when the key is clean again.
    #[test]
    fn a_key_clean_again_loses_its_drifted_record_in_the_same_session_and_after_a_reopen() {
        let dir = temp_dir("drifted-records");
        let drifted_after_reopen = |dir: &Path| {
            let (store, _) = TaskStore::open(dir, BUDGET).unwrap();
            let mut table: TrackedTable<u64> = TrackedTable::with_store(1, Norm::L1, store.key_store(), 4);
            table.load_drifted().unwrap()
        };
        let write = |store: &TaskStore, table: &mut TrackedTable<u64>| {
            table.stage_changes();
            store.write(&TaskStore::new_meta(1)).unwrap();
            table.changes_durable();
        };
        let backed_up = |table: &mut TrackedTable<u64>, seq: u64| {
            table.backup(seq, BackupScope::Drifted, &mut BackupBatch::new(seq));
            table.acknowledge(seq);
        };
        // One session: drifted, then clean.
        let (store, meta) = TaskStore::open(&dir, BUDGET).unwrap();
        assert!(meta.is_none());
        let mut table: TrackedTable<u64> = TrackedTable::with_store(1, Norm::L1, store.key_store(), 4);
        table.add(&1, 5.0).unwrap();
        write(&store, &mut table);
        backed_up(&mut table, 0);
        write(&store, &mut table);
        // Drifted in this session, clean in the next.
        table.add(&2, 5.0).unwrap();
        write(&store, &mut table);
        drop((table, store));
        assert_eq!(drifted_after_reopen(&dir), 1, "key 2 is drifted");
        let (store, _) = TaskStore::open(&dir, BUDGET).unwrap();
        let mut table: TrackedTable<u64> = TrackedTable::with_store(1, Norm::L1, store.key_store(), 4);
        assert_eq!(table.load_drifted().unwrap(), 1);
        backed_up(&mut table, 1);
        write(&store, &mut table);
        drop((table, store));
        assert_eq!(drifted_after_reopen(&dir), 0, "no drifted record is left behind");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_store_in_use_or_of_an_unknown_version_is_refused_with_its_path() {
        let dir = temp_dir("refused");
        let (store, _) = TaskStore::open(&dir, BUDGET).unwrap();
        let Err(error) = TaskStore::open(&dir, BUDGET) else {
            panic!("a second open of a store in use must fail");
        };
        let message = error.to_string();
        assert!(
            message.contains(&dir.display().to_string()) && message.contains("lock"),
            "{message}"
        );
        {
            let inner = store.lock();
            inner.db.put(META_KEY, [9u8, 0, 0]).unwrap();
        }
        drop(store);
        let Err(error) = TaskStore::open(&dir, BUDGET) else {
            panic!("an unknown layout version must fail");
        };
        assert!(error.to_string().contains("layout version 9"), "{error}");
        let fresh = TaskStore::recreate(&dir, BUDGET).unwrap();
        assert!(fresh.path().exists());
        drop(fresh);
        assert!(TaskStore::open(&dir, BUDGET).unwrap().1.is_none(), "recreated empty");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn records_round_trip_and_bad_ones_are_typed_errors() {
        for record in [
            StoredSlot { live: 4.5, drift: None },
            StoredSlot {
                live: -1.0,
                drift: Some(StoredDrift {
                    backed: 2.0,
                    present: false,
                }),
            },
        ] {
            assert_eq!(decode_record(&encode_record(&record)).unwrap(), record);
        }
        assert!(matches!(
            decode_record(&[7, 0, 0]),
            Err(CoreError::UnknownEncodingVersion { found: 7, .. })
        ));
        assert!(decode_record(&[STORE_VERSION, 1, 2]).is_err());
        assert!(decode_record(&[]).is_err());
    }
}
