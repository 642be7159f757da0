//! A store-backed table behaves as the in-memory table it replaces: the same
//! values, the same divergence, the same backups, while it keeps only a few
//! keys in memory; and after a crash it comes back from the store as an
//! in-memory table at the last store write would, every backup then in flight
//! counted as failed (it may or may not have reached the changelog).

mod common;

use afstream_core::entry::decode_f64;
use afstream_core::{BackupBatch, BackupEntry, BackupScope, MemoryKeyStore, Norm, Tracked, TrackedTable};
use proptest::prelude::*;
use rustc_hash::FxHashMap;

const TAG: u8 = 2;
const KEYS: u64 = 40;

#[derive(Clone, Debug)]
enum Op {
    Add(u64, f64),
    Backup(bool),
    Ack,
    Fail,
    /// Stage, write and report durable: a processed poll batch.
    Write,
    /// The process dies; the table is rebuilt from the store.
    Crash,
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(
        prop_oneof![
            8 => (0..KEYS, -20.0..20.0f64).prop_map(|(k, d)| Op::Add(k, d.round())),
            1 => any::<bool>().prop_map(Op::Backup),
            1 => Just(Op::Ack),
            1 => Just(Op::Fail),
            2 => Just(Op::Write),
            1 => Just(Op::Crash),
        ],
        1..400,
    )
}

/// A backup's records (keys, values and priors as logged), in key order.
fn sorted(batch: &BackupBatch) -> Vec<BackupEntry> {
    let mut entries: Vec<BackupEntry> = batch.iter().map(|record| record.to_entry()).collect();
    entries.sort_by(|a, b| a.key.cmp(&b.key));
    entries
}

struct Pair {
    norm: Norm,
    theta: f64,
    budget: usize,
    store: MemoryKeyStore,
    subject: TrackedTable<u64>,
    reference: TrackedTable<u64>,
    /// The reference as of the last store write, with its backups then in flight.
    at_write: (TrackedTable<u64>, Vec<u64>),
    in_flight: Vec<u64>,
    /// Backups go to the changelog only after the store write that follows them
    /// (the service sends them after the poll batch's write): those numbered
    /// below this were sent.
    sent_before: u64,
    seq: u64,
    /// What the changelog holds: the latest value per key of the subject's
    /// backups that landed (acknowledged, or failed with an odd sequence number:
    /// a timed-out write may land all the same).
    image: FxHashMap<u64, f64>,
    /// The subject's backups not yet landed or lost, with whether the backup was
    /// complete and taken with no change after the last one.
    written: Vec<(u64, bool, Vec<BackupEntry>)>,
    changed_since_backup: bool,
}

impl Pair {
    fn new(norm: Norm, theta: f64, budget: usize) -> Self {
        let store = MemoryKeyStore::new();
        let mut subject = TrackedTable::with_store(TAG, norm, Box::new(store.clone()), budget);
        let mut reference = TrackedTable::new(TAG, norm);
        subject.set_theta(theta);
        reference.set_theta(theta);
        Pair {
            norm,
            theta,
            budget,
            at_write: (reference.clone(), Vec::new()),
            store,
            subject,
            reference,
            in_flight: Vec::new(),
            sent_before: 0,
            seq: 0,
            image: FxHashMap::default(),
            written: Vec::new(),
            changed_since_backup: true,
        }
    }

    /// Backup `seq` is settled: acknowledged, or failed (it lands when `seq` is
    /// odd). A complete backup taken right after another backup with no change
    /// in between, once acknowledged with nothing else in flight, must leave the
    /// changelog equal to the state: every key that differed was written.
    fn land(&mut self, seq: u64, acknowledged: bool) {
        let Some(position) = self.written.iter().position(|(s, _, _)| *s == seq) else {
            return;
        };
        let (_, settles, entries) = self.written.remove(position);
        if acknowledged || seq % 2 == 1 {
            for entry in &entries {
                let key = u64::from_be_bytes(entry.key_body().try_into().unwrap());
                let value = decode_f64(entry.value.as_ref().unwrap()).unwrap();
                self.image.insert(key, value);
            }
        }
        if acknowledged && settles && !self.changed_since_backup && self.in_flight.is_empty() {
            let values = self.subject.entries().unwrap();
            for key in 0..KEYS {
                assert_eq!(
                    self.image.get(&key).copied().unwrap_or(0.0),
                    values.get(&key).copied().unwrap_or(0.0),
                    "key {key}: the changelog after a complete backup"
                );
            }
        }
    }

    fn apply(&mut self, op: &Op) {
        match op {
            Op::Add(key, delta) => {
                self.changed_since_backup = true;
                let subject = self.subject.add(key, *delta).unwrap();
                let reference = self.reference.add(key, *delta).unwrap();
                assert_eq!(subject, reference, "value of key {key}");
            }
            Op::Backup(complete) => {
                let scope = if *complete {
                    BackupScope::Complete
                } else {
                    BackupScope::Drifted
                };
                let (mut mine, mut theirs) = (BackupBatch::new(self.seq), BackupBatch::new(self.seq));
                self.subject.backup(self.seq, scope, &mut mine);
                self.reference.backup(self.seq, scope, &mut theirs);
                // Under memory pressure (or after a restart, owing every drift) a
                // drifted backup of a max-difference, L1 or L2 table may write
                // more than the reference: it is checked against the changelog
                // image instead, and an L1 or L2 one must leave at most θ/2
                // unwritten.
                if self.norm == Norm::KeyCount {
                    assert_eq!(sorted(&mine), sorted(&theirs), "backup {}", self.seq);
                } else if !*complete && self.norm != Norm::Max {
                    let divergence = self.subject.divergence();
                    assert!(
                        divergence <= self.theta / 2.0 + 1e-9,
                        "backup {} left a divergence of {divergence}, over θ/2 = {}",
                        self.seq,
                        self.theta / 2.0
                    );
                }
                // Only a complete backup taken with none in flight settles the
                // changelog: one in flight may still fail and owe its keys.
                self.written.push((
                    self.seq,
                    *complete && self.in_flight.is_empty(),
                    mine.entries().unwrap(),
                ));
                self.changed_since_backup = false;
                self.in_flight.push(self.seq);
                self.seq += 1;
            }
            Op::Ack => {
                if self.in_flight.first().is_some_and(|&seq| seq < self.sent_before) {
                    let seq = self.in_flight.remove(0);
                    self.subject.acknowledge(seq);
                    self.reference.acknowledge(seq);
                    self.land(seq, true);
                }
            }
            Op::Fail => {
                if self.in_flight.first().is_some_and(|&seq| seq < self.sent_before) {
                    let seq = self.in_flight.remove(0);
                    self.subject.fail(seq);
                    self.reference.fail(seq);
                    self.land(seq, false);
                }
            }
            Op::Write => {
                self.subject.stage_changes();
                self.store.write();
                self.subject.changes_durable();
                self.at_write = (self.reference.clone(), self.in_flight.clone());
                self.sent_before = self.seq;
            }
            Op::Crash => {
                for seq in self.in_flight.clone() {
                    if seq < self.sent_before {
                        self.land(seq, false);
                    }
                }
                self.written.clear();
                self.store.drop_staged();
                let mut subject = TrackedTable::with_store(TAG, self.norm, Box::new(self.store.clone()), self.budget);
                subject.load_drifted().unwrap();
                subject.set_theta(self.theta);
                self.subject = subject;
                let (mut reference, in_flight) = self.at_write.clone();
                for seq in in_flight {
                    reference.fail(seq);
                }
                self.reference = reference;
                self.in_flight.clear();
            }
        }
    }

    fn check(&self) {
        let mine = self.subject.entries().unwrap();
        let theirs: FxHashMap<u64, f64> = self.reference.entries().unwrap();
        for key in 0..KEYS {
            assert_eq!(
                mine.get(&key).copied().unwrap_or(0.0),
                theirs.get(&key).copied().unwrap_or(0.0),
                "value of key {key}"
            );
        }
        // Over its budget a store-backed table writes what a drifted backup of
        // the in-memory one leaves behind: only key counts drift alike.
        if self.norm == Norm::KeyCount {
            let (d1, d2) = (self.subject.divergence(), self.reference.divergence());
            assert!((d1 - d2).abs() <= 1e-9 * (1.0 + d2), "divergence {d1} vs {d2}");
        }
    }
}

proptest! {
    #![proptest_config(common::proptest_config(256))]

    #[test]
    fn a_store_backed_table_matches_the_in_memory_one_through_crashes(
        norm in prop_oneof![Just(Norm::L1), Just(Norm::L2), Just(Norm::KeyCount), Just(Norm::Max)],
        theta in 1.0..60.0f64,
        budget in 0usize..12,
        ops in ops(),
    ) {
        let mut pair = Pair::new(norm, theta, budget);
        for op in &ops {
            pair.apply(op);
            pair.check();
        }
    }
}

#[test]
fn only_drifted_keys_and_the_budget_stay_in_memory() {
    let store = MemoryKeyStore::new();
    let mut table: TrackedTable<u64> = TrackedTable::with_store(TAG, Norm::L1, Box::new(store.clone()), 10);
    for key in 0..1000 {
        table.add(&key, 1.0).unwrap();
    }
    assert_eq!(table.len(), 1000, "nothing is durable yet");
    let mut entries = BackupBatch::new(0);
    table.backup(0, BackupScope::Drifted, &mut entries);
    assert_eq!(entries.len(), 1000);
    table.stage_changes();
    store.write();
    table.changes_durable();
    assert_eq!(table.len(), 1000, "a backup in flight holds its keys");
    table.acknowledge(0);
    table.stage_changes();
    store.write();
    table.changes_durable();
    assert_eq!(table.len(), 0, "clean and durable: evicted");
    assert_eq!(store.len(), 1000);
    assert_eq!(table.add(&7, 2.0).unwrap(), 3.0, "read back from the store");
    assert_eq!(table.divergence(), 2.0);
    assert_eq!(table.lookup(&8).unwrap(), Some(1.0));
    assert_eq!(table.entries().unwrap().len(), 1000);
}

#[test]
fn a_restart_owes_every_key_a_backup_in_flight_wrote() {
    for norm in [Norm::L1, Norm::Max] {
        let store = MemoryKeyStore::new();
        let mut table: TrackedTable<u64> = TrackedTable::with_store(TAG, norm, Box::new(store.clone()), 0);
        table.set_theta(4.0);
        table.add(&1, 5.0).unwrap();
        let mut entries = BackupBatch::new(0);
        table.backup(0, BackupScope::Complete, &mut entries);
        table.acknowledge(0);
        table.add(&1, 5.0).unwrap();
        entries.reset(1);
        table.backup(1, BackupScope::Drifted, &mut entries);
        assert_eq!(entries.len(), 1, "{norm:?}");
        // Back to the acknowledged value while backup 1 (value 10) is in flight:
        // the divergence counts from backup 1.
        table.add(&1, -5.0).unwrap();
        assert_eq!(table.divergence(), 5.0, "{norm:?}");
        table.stage_changes();
        store.write();
        table.changes_durable();
        drop(table);

        let mut restarted: TrackedTable<u64> = TrackedTable::with_store(TAG, norm, Box::new(store.clone()), 0);
        restarted.set_theta(4.0);
        assert_eq!(restarted.load_drifted().unwrap(), 1, "{norm:?}");
        entries.reset(2);
        // Even a backup for l alone, which leaves drifts within θ unwritten.
        restarted.backup(2, BackupScope::Owed, &mut entries);
        assert_eq!(
            entries.len(),
            1,
            "{norm:?}: backup 1 may have reached the changelog with 10: write 5 again"
        );
        assert_eq!(restarted.lookup(&1).unwrap(), Some(5.0));
    }
}

#[test]
fn a_restart_measures_a_large_max_norm_drift_exactly() {
    let store = MemoryKeyStore::new();
    let mut table: TrackedTable<u64> = TrackedTable::with_store(TAG, Norm::Max, Box::new(store.clone()), 0);
    table.set_theta(10.0);
    table.add(&1, 30.0).unwrap();
    table.stage_changes();
    store.write();
    table.changes_durable();
    drop(table);
    let mut restarted: TrackedTable<u64> = TrackedTable::with_store(TAG, Norm::Max, Box::new(store.clone()), 0);
    restarted.set_theta(10.0);
    restarted.load_drifted().unwrap();
    assert_eq!(
        restarted.divergence(),
        30.0,
        "over θ: exact, so that it triggers a backup"
    );
}

#[test]
fn a_max_norm_table_over_its_budget_writes_its_small_drifts_so_they_can_leave_memory() {
    let store = MemoryKeyStore::new();
    let mut table: TrackedTable<u64> = TrackedTable::with_store(TAG, Norm::Max, Box::new(store.clone()), 2);
    table.set_theta(100.0);
    for key in 0..10 {
        table.add(&key, 1.0).unwrap();
    }
    table.stage_changes();
    store.write();
    table.changes_durable();
    assert_eq!(table.len(), 10, "drifts of 1 (under θ/2) are not clean");
    let mut entries = BackupBatch::new(0);
    table.backup(0, BackupScope::Drifted, &mut entries);
    assert_eq!(
        entries.len(),
        10,
        "over the budget: the backup writes the small drifts too"
    );
    table.acknowledge(0);
    table.stage_changes();
    store.write();
    table.changes_durable();
    assert_eq!(table.len(), 0, "then they are clean and leave memory");
    assert_eq!(table.lookup(&3).unwrap(), Some(1.0));
}
