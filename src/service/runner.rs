//! `afstream run`: one consumer in the group, one task per assigned partition,
//! each a [`TaskDriver`] whose I/O ([`KafkaIo`]) produces outputs, backups and
//! markers and stores offsets. The loop here only moves records and
//! acknowledgements between Kafka and the drivers; every decision is the core's.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::marker::PhantomData;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::consumer::base_consumer::PartitionQueue;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, RebalanceProtocol};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, Message, OwnedHeaders};
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
use rdkafka::statistics::Statistics;
use rdkafka::types::RDKafkaRespErr;
use rdkafka::{ClientContext, Offset, TopicPartitionList};

use super::check::TaskPlan;
use super::codec::{Codec, ServiceOperator};
use super::config::Config;
use super::kafka::{
    client_config, ensure_topics, is_permanent, partition_count, patiently, ChangelogLoader, ClientRole, Delivery,
    DeliveryEvent, DeliveryReports, FailedRecord, KafkaSetupError, ReaderPool, TopicSpec, REQUEST_TIMEOUT,
};
use super::metrics::{TaskMetrics, TaskPosition};
use super::state::lock_state_dir;
use super::store::{StoreBudget, StoreMeta, TaskStore};
use super::ServiceError;
use crate::core::{
    Ack, BackupBatch, BackupEntry, BackupMarker, Blocked, ControllerConfig, DriverStats, MarkedState, Mode,
    RecoveryPlan, Rejected, TaskDriver, TaskIo,
};

/// Where a partition with no marker and no committed offset starts (the
/// consumer's `auto.offset.reset = earliest` moves it past a deleted head).
const START_OFFSET: u64 = 0;
/// Changelog records a restore applies (and writes to the local store) at a time.
const RESTORE_CHUNK: usize = 10_000;
/// Reads of a changelog a restore makes before it gives up, the first retry
/// after `RESTORE_RETRY_WAIT`, each later one after twice the wait before.
const RESTORE_ATTEMPTS: u32 = 4;
const RESTORE_RETRY_WAIT: Duration = Duration::from_millis(500);
/// Records a task takes from its partition queue at a time.
const POLL_BATCH: usize = 500;
/// The shortest and longest sleep of an idle loop round.
const IDLE_WAIT_MIN: Duration = Duration::from_micros(100);
const IDLE_WAIT_MAX: Duration = Duration::from_millis(5);
/// The longest sleep while a task's input waits on an acknowledgement: the
/// window (l items past the last marker) is a few milliseconds of input, so a
/// late wake-up is a stall of its own.
const AWAIT_WAIT_MAX: Duration = Duration::from_micros(200);
/// The headers of a dead letter: where its record came from and why it was refused.
pub const DEAD_LETTER_TOPIC_HEADER: &str = "afstream.source.topic";
pub const DEAD_LETTER_PARTITION_HEADER: &str = "afstream.source.partition";
pub const DEAD_LETTER_OFFSET_HEADER: &str = "afstream.source.offset";
pub const DEAD_LETTER_REASON_HEADER: &str = "afstream.reason";
/// How long a revocation waits for the records in flight to be delivered.
const REVOKE_FLUSH_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a clean stop may take before the process gives up on it.
const STOP_DEADLINE: Duration = Duration::from_secs(30);

#[derive(Clone, Copy, Debug, Default)]
pub struct RunOptions {
    /// Stop cleanly once every partition is processed up to the end it had when
    /// it was assigned (for batch jobs, demos and benchmarks).
    pub stop_at_end: bool,
}

/// What a run did, per task, and how long its tasks ran.
#[derive(Clone, Debug, Default)]
pub struct RunReport {
    pub tasks: Vec<TaskReport>,
    /// From the first partition's assignment (fetching starts then, while its
    /// task restores) to the start of the clean stop: the processing time,
    /// without joining the group.
    pub processing: Duration,
    /// The clean stop: final complete backups, markers, commits.
    pub stop: Duration,
    /// The first part of the clean stop: until every output of every item read
    /// was acknowledged (before the final backups, a one-off per stop).
    pub drained: Duration,
}

#[derive(Clone, Debug)]
pub struct TaskReport {
    pub partition: i32,
    /// At the end of the run.
    pub stats: DriverStats,
    /// When the clean stop began (without its final complete backup).
    pub before_stop: DriverStats,
    /// Markers' round trips over the run.
    pub markers: MarkerRoundTrips,
    pub undecodable: u64,
}

/// The topics of the pipeline.
struct Topics {
    input: String,
    output: String,
    changelog: String,
    dead_letters: String,
}

/// A partition handed over by a rebalance, with what its task restores.
struct Assigned {
    partition: i32,
    /// The input partition's end when it was assigned.
    end: u64,
    /// How long opening the store and reading the last marker took (the
    /// changelog itself is streamed when the task starts).
    restore_seconds: f64,
    /// Where the task resumes and why.
    plan: RecoveryPlan,
    /// The task's local store, and its meta record to write with every batch.
    store: Option<(TaskStore, StoreMeta)>,
    /// The task resumes on its local store (no changelog restore).
    local: bool,
}

/// A task's operator with its state restored, before its driver starts.
struct Restored<O> {
    operator: O,
    assigned: Assigned,
    restored_records: u64,
    /// The changelog offset a restore from the changelog read to (the state is
    /// its records before it), for the experiment's check of a recovery.
    changelog_end: Option<u64>,
    restore_seconds: f64,
    /// The keys restored from priors, written before the start marker.
    rolled_back: Vec<BackupEntry>,
}

/// At most this many tasks restore at once (each with a changelog reader of
/// its own): a rebalance that hands over many partitions neither opens a
/// client per partition nor restores them one after another.
const RESTORE_PARALLELISM: usize = 4;

/// Restores the tasks assigned together side by side, in the order given.
/// A single one restores through `loader` (the one the rebalance read the
/// markers with, connected); several share a few workers, the first with
/// `loader`, the others with readers from `pool`.
fn restore_all<O: ServiceOperator>(
    loader: &ChangelogLoader,
    pool: &ReaderPool,
    operator_config: &O::Config,
    batch: Vec<Assigned>,
    resident_keys: usize,
) -> Result<Vec<Restored<O>>, ServiceError> {
    if batch.len() <= 1 {
        return batch
            .into_iter()
            .map(|assigned| Task::<O>::restore(loader, operator_config, assigned, resident_keys))
            .collect();
    }
    let count = batch.len();
    let work = Mutex::new(batch.into_iter().enumerate().collect::<VecDeque<_>>());
    // (its place in the batch, its restore)
    type Outcome<O> = (usize, Result<Restored<O>, ServiceError>);
    let done: Mutex<Vec<Outcome<O>>> = Mutex::new(Vec::with_capacity(count));
    let restore_with = |reader: &ChangelogLoader| {
        while let Some((index, assigned)) = work.lock().ok().and_then(|mut w| w.pop_front()) {
            let result = Task::<O>::restore(reader, operator_config, assigned, resident_keys);
            if let Ok(mut done) = done.lock() {
                done.push((index, result));
            }
        }
    };
    // Their log lines name the pipeline as the loop's do.
    let span = tracing::Span::current();
    // A worker that panics makes the scope panic: every item is done after it.
    std::thread::scope(|scope| {
        for _ in 1..count.min(RESTORE_PARALLELISM) {
            scope.spawn(|| {
                let _span = span.enter();
                match pool.take() {
                    Ok(reader) => {
                        restore_with(&reader);
                        pool.give_back(reader);
                    }
                    // The other workers restore its share.
                    Err(error) => tracing::warn!(%error, "no second changelog reader; restoring with fewer"),
                }
            });
        }
        restore_with(loader);
    });
    let mut done = done.into_inner().unwrap_or_else(std::sync::PoisonError::into_inner);
    done.sort_by_key(|(index, _)| *index);
    done.into_iter().map(|(_, result)| result).collect()
}

/// Where a parked task (its partition lost) stopped.
#[derive(Clone, Copy, Debug)]
struct Parked {
    /// The next input offset it has not processed.
    next_offset: u64,
    /// The changelog partition's end when it was parked: if another member
    /// wrote the changelog since, the task's state is stale.
    changelog_end: i64,
}

/// Where the local stores of the pipeline's tasks live, and their budget.
struct Stores {
    root: PathBuf,
    budget: StoreBudget,
}

/// Set in the environment of a build with the `fault-injection` feature to N,
/// the first N reads of a changelog for a restore fail as a broker that times
/// out does.
#[cfg(feature = "fault-injection")]
pub const FAULT_RESTORE_FAILURES: &str = "AFSTREAM_FAULT_RESTORE_FAILURES";

/// A changelog read that the fault-injection switch fails, if it does.
fn injected_restore_failure() -> Option<KafkaSetupError> {
    #[cfg(feature = "fault-injection")]
    {
        static INJECTED: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let failures: u32 = std::env::var(FAULT_RESTORE_FAILURES)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        if INJECTED.fetch_add(1, Ordering::Relaxed) < failures {
            return Some(KafkaSetupError::Kafka(KafkaError::MetadataFetch(
                RDKafkaErrorCode::OperationTimedOut,
            )));
        }
    }
    None
}

/// Set in the environment of a build with the `fault-injection` feature, it
/// makes every task's backups write nothing (for tests that must fail).
#[cfg(feature = "fault-injection")]
pub const FAULT_SKIP_BACKUPS: &str = "AFSTREAM_FAULT_SKIP_BACKUPS";

/// Set in the environment of a build with the `fault-injection` feature to N,
/// every task takes N ms more to start, as a long restore does.
#[cfg(feature = "fault-injection")]
pub const FAULT_SLOW_TASK_START_MS: &str = "AFSTREAM_FAULT_SLOW_TASK_START_MS";

/// A crash at the worst point of a backup, for failure experiments (`afstream
/// experiment --kill-mid-backup`): set to N, the process SIGKILLs itself once
/// the entries of its N-th backup that writes any are acknowledged and before
/// its marker goes out, so the changelog ends with an incomplete backup after
/// the last marker. Counted over the process's tasks; a marker-only backup
/// does not count.
pub const CRASH_IN_BACKUP: &str = "AFSTREAM_CRASH_IN_BACKUP";

/// The longest a newly assigned partition waits for its previous owner to
/// stop writing its changelog (see `ChangelogLoader::settled_marker`).
const HANDOFF_PATIENCE: Duration = Duration::from_secs(20);

/// The consumer's context: a rebalance decides each new partition's recovery
/// point (its local store, or the changelog's last marker) and sets it before
/// the partition is assigned, so no record is fetched from anywhere else; the
/// task streams the changelog into its state when it starts.
struct GroupContext {
    group: String,
    input_topic: String,
    loader: ChangelogLoader,
    controller: ControllerConfig,
    stores: Option<Stores>,
    assigned: Mutex<Vec<Assigned>>,
    /// Partitions revoked while the loop is over: dropped at once.
    revoked: Mutex<Vec<i32>>,
    /// Partitions lost (the group went on without this member): their tasks
    /// are kept (parked) in case the partitions come back.
    lost: Mutex<Vec<i32>>,
    /// Where each parked task stopped, for a rebalance that gives its partition back.
    parked: Mutex<HashMap<i32, Parked>>,
    /// Partitions given back whose parked task goes on (nothing else wrote
    /// their changelog meanwhile), with the input's end at the time.
    regained: Mutex<Vec<(i32, u64)>>,
    /// Partitions revoked in a rebalance: handed off once their final backup is
    /// acknowledged, then released (`Revocation::release`).
    revoking: Mutex<Option<Revocation>>,
    /// Set when the loop is over: a revocation then (leaving the group) is
    /// released at once, since no loop is left to hand the partitions off.
    closing: AtomicBool,
    failure: Mutex<Option<String>>,
    /// Flushed when partitions are revoked (see `rebalance`).
    producers: [Arc<BaseProducer<DeliveryReports>>; 2],
    /// How long a changelog partition must stay unchanged before a task
    /// resumes from a marker that is not clean (`pipeline.handoff_quiet_ms`).
    handoff_quiet: Duration,
}

impl ClientContext for GroupContext {
    /// librdkafka's statistics (with `statistics.interval.ms`): the lag of each
    /// assigned partition behind its committed offset, which follows the markers.
    fn stats(&self, statistics: Statistics) {
        // Bootstrap entries (node id -1) are addresses, not brokers.
        let up = statistics
            .brokers
            .values()
            .filter(|broker| broker.nodeid >= 0 && broker.state == "UP")
            .count();
        super::metrics::brokers_up(&self.group, up);
        let Some(topic) = statistics.topics.get(&self.input_topic) else {
            return;
        };
        for (partition, stats) in &topic.partitions {
            if *partition >= 0 && stats.consumer_lag >= 0 {
                TaskMetrics::consumer_lag(&self.group, *partition, stats.consumer_lag as f64);
            }
        }
    }

    fn error(&self, error: KafkaError, reason: &str) {
        super::metrics::broker_error("consumer", &error, reason);
    }
}

impl GroupContext {
    fn flush_producers(&self) {
        for producer in &self.producers {
            if let Err(error) = producer.flush(REVOKE_FLUSH_TIMEOUT) {
                tracing::warn!(
                    %error, in_flight = producer.in_flight_count(),
                    "records still in flight when partitions were revoked; the next owner may read the changelog before they land"
                );
            }
        }
    }

    fn fail(&self, message: String) {
        tracing::error!("{message}");
        if let Ok(mut failure) = self.failure.lock() {
            failure.get_or_insert(message);
        }
    }

    /// Where a parked task of `partition` goes on, if it may: nothing was
    /// written to its changelog since it was parked.
    fn regain(&self, partition: i32) -> Result<Option<u64>, String> {
        let Some(parked) = self.parked.lock().ok().and_then(|mut p| p.remove(&partition)) else {
            return Ok(None);
        };
        let end = self.loader.end_offset(partition).map_err(|e| e.to_string())?;
        if end == parked.changelog_end {
            return Ok(Some(parked.next_offset));
        }
        tracing::info!(
            partition,
            "partition given back, but another member wrote its changelog meanwhile: its kept task is dropped"
        );
        Ok(None)
    }

    /// The changelogs' last markers, once no previous owner writes the
    /// partitions (waiting for all of them together).
    fn settled_markers(&self, partitions: &[i32]) -> Result<Vec<Option<BackupMarker>>, String> {
        self.loader
            .settled_markers(partitions, self.handoff_quiet, HANDOFF_PATIENCE)
            .map_err(|e| e.to_string())
    }

    fn prepare(&self, consumer: &BaseConsumer<Self>, tpl: &mut TopicPartitionList) -> Result<(), String> {
        let committed = consumer
            .committed_offsets(tpl.clone(), REQUEST_TIMEOUT)
            .map_err(|e| format!("reading the group's committed offsets: {e}"))?;
        let partitions: Vec<i32> = tpl
            .elements_for_topic(&self.input_topic)
            .iter()
            .map(|e| e.partition())
            .collect();
        let mut assigned = Vec::with_capacity(partitions.len());
        let mut starting = Vec::with_capacity(partitions.len());
        for partition in partitions {
            if let Some(resume) = self.regain(partition)? {
                let (_, end) = consumer
                    .fetch_watermarks(&self.input_topic, partition, REQUEST_TIMEOUT)
                    .map_err(|e| format!("input partition {partition}: {e}"))?;
                tpl.set_partition_offset(&self.input_topic, partition, Offset::Offset(resume as i64))
                    .map_err(|e| format!("input partition {partition}: {e}"))?;
                if let Ok(mut regained) = self.regained.lock() {
                    regained.push((partition, end.max(0) as u64));
                }
            } else {
                starting.push(partition);
            }
        }
        // Only the last markers are read here, to decide where to resume; a
        // task restoring from the changelog streams it when it starts.
        let settling = Instant::now();
        let markers = self.settled_markers(&starting)?;
        let settle_seconds = settling.elapsed().as_secs_f64();
        for (partition, marker) in starting.into_iter().zip(markers) {
            let opening = Instant::now();
            let local = match &self.stores {
                Some(stores) => Some(self.open_store(stores, partition, marker.as_ref())?),
                None => None,
            };
            let (marker, store, local) = match local {
                Some(LocalStore::Usable { store, meta }) => (
                    marker.filter(|_| self.controller.mode != Mode::None),
                    Some((store, meta)),
                    true,
                ),
                Some(LocalStore::Fresh(store)) => (marker, Some((store, TaskStore::new_meta(0))), false),
                None => (marker, None, false),
            };
            let restore_seconds = settle_seconds + opening.elapsed().as_secs_f64();
            let committed = match committed
                .find_partition(&self.input_topic, partition)
                .map(|e| e.offset())
            {
                Some(Offset::Offset(offset)) if offset >= 0 => Some(offset as u64),
                _ => None,
            };
            let (_, end) = consumer
                .fetch_watermarks(&self.input_topic, partition, REQUEST_TIMEOUT)
                .map_err(|e| format!("input partition {partition}: {e}"))?;
            let plan = match &store {
                Some((_, meta)) if local => RecoveryPlan::local(
                    meta.next_offset,
                    marker.as_ref(),
                    self.controller.policy.for_failures(0).outputs,
                ),
                _ => RecoveryPlan::decide(
                    self.controller.mode,
                    marker.as_ref(),
                    committed,
                    START_OFFSET,
                    self.controller.constants,
                ),
            };
            tpl.set_partition_offset(&self.input_topic, partition, Offset::Offset(plan.resume_offset as i64))
                .map_err(|e| format!("input partition {partition}: {e}"))?;
            assigned.push(Assigned {
                partition,
                end: end.max(0) as u64,
                restore_seconds,
                plan,
                store,
                local,
            });
        }
        let assign = match consumer.rebalance_protocol() {
            RebalanceProtocol::Cooperative => consumer.incremental_assign(tpl),
            _ => consumer.assign(tpl),
        };
        assign.map_err(|e| format!("assigning partitions: {e}"))?;
        if let Ok(mut queue) = self.assigned.lock() {
            queue.extend(assigned);
        }
        Ok(())
    }
}

impl GroupContext {
    /// Opens a partition's local store and decides whether the task can resume
    /// on it: only if it survived the crash (same boot) and `marker`, the
    /// changelog's last, is its own, so that it knows every key any backup
    /// wrote (in mode none there is no changelog: the store is all there is).
    /// Otherwise the store is recreated empty and the task restores from the
    /// changelog.
    fn open_store(&self, stores: &Stores, partition: i32, marker: Option<&BackupMarker>) -> Result<LocalStore, String> {
        let path = stores.root.join(format!("{}-{partition}", self.input_topic));
        let (store, meta) = TaskStore::open(&path, stores.budget).map_err(|e| e.to_string())?;
        let Some(meta) = meta else {
            return Ok(LocalStore::Fresh(store));
        };
        let refused = if !meta.trusted_after_crash() {
            "the machine restarted since its last write"
        } else if self.controller.mode == Mode::None || marker.map(|m| m.writer) == Some(meta.store_id) {
            return Ok(LocalStore::Usable { store, meta });
        } else {
            "the changelog's last marker is not this store's (the partition moved, or the store is older)"
        };
        tracing::info!(partition, path = %path.display(), reason = refused, "local store not used; restoring from the changelog");
        drop(store);
        let store = TaskStore::recreate(&path, stores.budget).map_err(|e| e.to_string())?;
        Ok(LocalStore::Fresh(store))
    }
}

/// Marks the group context closing when dropped.
struct ClosingGuard<'a>(&'a AtomicBool);

impl Drop for ClosingGuard<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Partitions revoked by a rebalance, waiting for their tasks' clean stop.
struct Revocation {
    partitions: Vec<i32>,
    tpl: TopicPartitionList,
    cooperative: bool,
    since: Instant,
}

impl Revocation {
    fn new(partitions: Vec<i32>, tpl: TopicPartitionList, cooperative: bool) -> Self {
        Revocation {
            partitions,
            tpl,
            cooperative,
            since: Instant::now(),
        }
    }

    fn add(&mut self, partitions: Vec<i32>, tpl: &TopicPartitionList) {
        self.partitions.extend(partitions);
        for element in tpl.elements() {
            let _ = self
                .tpl
                .add_partition_offset(element.topic(), element.partition(), element.offset());
        }
    }

    /// Gives the partitions back to the group.
    fn release(&self, consumer: &BaseConsumer<GroupContext>) -> Result<(), KafkaError> {
        if self.cooperative {
            consumer.incremental_unassign(&self.tpl)
        } else {
            consumer.unassign()
        }
    }
}

/// What a partition's local store offers a starting task.
enum LocalStore {
    /// Exact at its offset; the changelog's last marker is its own (in mode
    /// none, with no changelog, the store is all there is).
    Usable { store: TaskStore, meta: StoreMeta },
    /// Empty: the task restores from the changelog into it.
    Fresh(TaskStore),
}

impl ConsumerContext for GroupContext {
    fn rebalance(&self, consumer: &BaseConsumer<Self>, err: RDKafkaRespErr, tpl: &mut TopicPartitionList) {
        match err {
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS => {
                tracing::info!(partitions = ?partition_list(tpl), "partitions assigned");
                if let Err(message) = self.prepare(consumer, tpl) {
                    self.fail(format!("restoring newly assigned partitions: {message}"));
                }
            }
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__REVOKE_PARTITIONS
                if !consumer.assignment_lost() && !self.closing.load(Ordering::Relaxed) =>
            {
                tracing::info!(partitions = ?partition_list(tpl), "partitions revoked");
                // The group waits for the release: the loop stops the revoked
                // tasks cleanly (final complete backup, clean marker), so the next
                // owner resumes exactly and counts no failure, then releases them.
                if let Ok(mut revoking) = self.revoking.lock() {
                    let partitions = tpl.elements().iter().map(|e| e.partition()).collect();
                    let cooperative = matches!(consumer.rebalance_protocol(), RebalanceProtocol::Cooperative);
                    match revoking.as_mut() {
                        Some(pending) => pending.add(partitions, tpl),
                        None => *revoking = Some(Revocation::new(partitions, tpl.clone(), cooperative)),
                    }
                }
            }
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__REVOKE_PARTITIONS => {
                // Lost (another member may own them already, so no final
                // backup), or the loop is over (its tasks stopped cleanly).
                // Every record a revoked task sent reaches the log (or fails)
                // before the partition is released: the next owner, in this
                // process or another, reads a changelog no late record of the
                // old task will change, and the old task's delivery reports
                // reach it, not its successor (the loop hands them out before
                // it drops the task).
                if consumer.assignment_lost() {
                    tracing::warn!(
                        partitions = ?partition_list(tpl),
                        "partitions lost (the group went on without this member): dropped without a final backup"
                    );
                }
                self.flush_producers();
                let list = if consumer.assignment_lost() && !self.closing.load(Ordering::Relaxed) {
                    &self.lost
                } else {
                    &self.revoked
                };
                if let Ok(mut list) = list.lock() {
                    list.extend(tpl.elements().iter().map(|e| e.partition()));
                }
                let result = match consumer.rebalance_protocol() {
                    RebalanceProtocol::Cooperative => consumer.incremental_unassign(tpl),
                    _ => consumer.unassign(),
                };
                if let Err(e) = result {
                    self.fail(format!("releasing revoked partitions: {e}"));
                }
            }
            other => {
                let code: RDKafkaErrorCode = other.into();
                tracing::warn!(error = %code, "rebalance failed; releasing the assignment");
                if let Err(e) = consumer.unassign() {
                    self.fail(format!("releasing the assignment after a failed rebalance: {e}"));
                }
            }
        }
    }
}

/// The partition's own queue, from which its task reads it from `offset` on.
/// The consumer has been fetching the partition since it was assigned, into
/// its own queue; and librdkafka may forward a split queue to the consumer's
/// again when it (re)starts the partition's fetch. The seek restarts the fetch
/// into the split queue, and its version barrier discards whatever was fetched
/// before, wherever it waits: every record from `offset` on comes through this
/// queue, in order.
fn own_queue(
    consumer: &Arc<BaseConsumer<GroupContext>>,
    topic: &str,
    partition: i32,
    offset: u64,
) -> Result<PartitionQueue<GroupContext>, ServiceError> {
    let queue = consumer
        .split_partition_queue(topic, partition)
        .ok_or_else(|| ServiceError::Unsupported(format!("no queue for input partition {partition}")))?;
    consumer
        .seek(topic, partition, Offset::Offset(offset as i64), REQUEST_TIMEOUT)
        .map_err(|e| ServiceError::Task {
            partition,
            message: format!("restarting the fetch at offset {offset}: {e}"),
        })?;
    Ok(queue)
}

/// The partition numbers of a rebalance's list, for the log.
fn partition_list(tpl: &TopicPartitionList) -> Vec<i32> {
    tpl.elements().iter().map(|e| e.partition()).collect()
}

/// Deliveries still owed for a backup in flight.
#[derive(Clone, Copy, Debug)]
struct OpenBackup {
    seq: u64,
    remaining: usize,
    failed: bool,
}

/// What a task's I/O left for the loop: acknowledgements known at once, the
/// backups in flight, and an error the task cannot go on with.
#[derive(Default)]
struct Flight {
    /// Backups in flight, in the order they were written: each is reported
    /// once all its records are, and in this order (an acknowledgement covers
    /// every backup before it, see `Operator::acknowledge_backup`).
    backups: VecDeque<OpenBackup>,
    acks: Vec<Ack>,
    fatal: Option<String>,
    /// Changelog records (backup entries, markers) waiting for the task's next
    /// store write: a restart must know every key a backup in the changelog
    /// wrote, so nothing reaches the changelog before the state it covers is in
    /// the store.
    changelog: Vec<(BackupEntry, Delivery)>,
    /// Something changed that the next store write must hold.
    unwritten: bool,
    /// Outputs and dead letters whose delivery failed, to send again once the
    /// backoff has passed.
    resend: Vec<(Delivery, FailedRecord)>,
    /// Dead letters sent and not yet acknowledged. While any is, the task's
    /// local store is not written: a restart on the store resumes at its
    /// offset, and must not pass a dead letter the broker may not have (an
    /// output may be lost there, within γ; a dead letter never).
    dead_letters_in_flight: usize,
    retry: RetryBackoff,
    markers: MarkerRoundTrips,
}

/// How long markers take from the producer to their acknowledgement: a
/// recovery replays the items of the markers in flight at the crash besides
/// the l/2 past the last one issued, so this round trip sizes a replay.
#[derive(Clone, Debug, Default)]
pub struct MarkerRoundTrips {
    /// Markers sent and not yet acknowledged, with when they were sent.
    in_flight: VecDeque<(u64, Instant)>,
    pub acknowledged: u64,
    pub total: Duration,
}

impl MarkerRoundTrips {
    fn sent(&mut self, seq: u64) {
        self.in_flight.push_back((seq, Instant::now()));
    }

    /// Marker `seq` was acknowledged (or failed: `acknowledged` false).
    fn done(&mut self, seq: u64, acknowledged: bool) {
        let Some(index) = self.in_flight.iter().position(|&(s, _)| s == seq) else {
            return;
        };
        let Some((_, sent)) = self.in_flight.remove(index) else {
            return;
        };
        if acknowledged {
            self.acknowledged += 1;
            self.total += sent.elapsed();
        }
    }

    /// The mean round trip, if any marker was acknowledged.
    pub fn mean(&self) -> Option<Duration> {
        (self.acknowledged > 0).then(|| self.total.div_f64(self.acknowledged as f64))
    }
}

/// After a failed delivery, nothing of the task goes out for a while, doubling
/// from `RETRY_BACKOFF_MIN_MS` to `RETRY_BACKOFF_MAX_MS` while failures go on:
/// a broker that answers with errors is not flooded with retries (the
/// controller re-issues a failed backup or marker at once).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct RetryBackoff {
    failures: u32,
    until_ms: u64,
}

const RETRY_BACKOFF_MIN_MS: u64 = 100;
const RETRY_BACKOFF_MAX_MS: u64 = 5_000;

impl RetryBackoff {
    fn failed(&mut self, now_ms: u64) {
        let delay = RETRY_BACKOFF_MIN_MS
            .saturating_mul(1 << self.failures.min(16))
            .min(RETRY_BACKOFF_MAX_MS);
        self.until_ms = self.until_ms.max(now_ms + delay);
        self.failures = self.failures.saturating_add(1);
    }

    fn succeeded(&mut self) {
        self.failures = 0;
    }

    fn holds(&self, now_ms: u64) -> bool {
        now_ms < self.until_ms
    }
}

impl Flight {
    fn backup_record_done(&mut self, seq: u64, failed: bool) {
        let Some(open) = self.backups.iter_mut().find(|b| b.seq == seq) else {
            return;
        };
        open.remaining = open.remaining.saturating_sub(1);
        open.failed |= failed;
        self.report_backups();
    }

    /// Reports the backups whose records are all delivered, oldest first, up to
    /// the first that still waits for one.
    fn report_backups(&mut self) {
        while let Some(open) = self.backups.front().filter(|b| b.remaining == 0).copied() {
            self.backups.pop_front();
            self.acks.push(if open.failed {
                Ack::BackupFailed(open.seq)
            } else {
                Ack::BackupWritten(open.seq)
            });
        }
    }
}

/// Sends a record, waiting on the producer's queue when it is full.
fn send(
    producer: &BaseProducer<DeliveryReports>,
    mut record: BaseRecord<'_, [u8], [u8], usize>,
) -> Result<(), KafkaError> {
    loop {
        match producer.send(record) {
            Ok(()) => return Ok(()),
            Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                producer.poll(Duration::from_millis(5));
                record = back;
            }
            Err((error, _)) => return Err(error),
        }
    }
}

/// The Kafka side of one task, handed to its driver for one call.
struct KafkaIo<'a, O> {
    shared: &'a Shared<'a>,
    partition: i32,
    flight: &'a mut Flight,
    key: &'a mut Vec<u8>,
    value: &'a mut Vec<u8>,
    /// The records being processed, as they came (for dead letters).
    records: RawRecords<'a>,
    operator: PhantomData<O>,
}

/// Sends one record to a task's changelog partition (a tombstone when the
/// entry has no value).
fn send_to_changelog(
    shared: &Shared<'_>,
    partition: i32,
    entry: &BackupEntry,
    delivery: Delivery,
) -> Result<(), KafkaError> {
    let mut record = BaseRecord::with_opaque_to(&shared.topics.changelog, delivery.pack())
        .partition(partition)
        .key(&entry.key[..]);
    if let Some(value) = &entry.value {
        record = record.payload(&value[..]);
    }
    send(shared.changelog_producer, record)
}

impl<O: ServiceOperator> TaskIo<O::Output> for KafkaIo<'_, O> {
    fn send_output(&mut self, item_offset: u64, output: O::Output) {
        let keyed = match self.shared.codec.encode::<O>(&output, self.key, self.value) {
            Ok(keyed) => keyed,
            Err(error) => {
                self.flight.fatal.get_or_insert(format!(
                    "encoding an output (input partition {}, offset {item_offset}): {error}",
                    self.partition
                ));
                return;
            }
        };
        let delivery = Delivery::Output {
            partition: self.partition,
            offset: item_offset,
        };
        let mut record =
            BaseRecord::with_opaque_to(&self.shared.topics.output, delivery.pack()).payload(self.value.as_slice());
        if keyed {
            record = record.key(self.key.as_slice());
        }
        if let Err(error) = send(self.shared.producer, record) {
            self.flight.fatal.get_or_insert(format!(
                "producing an output to {} (input partition {}, offset {item_offset}): {error}",
                self.shared.topics.output, self.partition
            ));
        }
    }

    fn write_backup(&mut self, seq: u64, records: &BackupBatch) {
        self.flight.backups.push_back(OpenBackup {
            seq,
            remaining: records.len(),
            failed: false,
        });
        if records.is_empty() {
            // Nothing to deliver: written once the backups before it are.
            self.flight.report_backups();
            return;
        }
        let delivery = Delivery::BackupRecord {
            partition: self.partition,
            seq,
        };
        self.flight
            .changelog
            .extend(records.iter().map(|record| (record.to_entry(), delivery)));
    }

    fn write_marker(&mut self, marker: &BackupMarker) {
        let delivery = Delivery::Marker {
            partition: self.partition,
            seq: marker.seq,
        };
        self.flight.changelog.push((marker.to_entry(), delivery));
    }

    fn commit(&mut self, offset: u64) {
        let mut tpl = TopicPartitionList::new();
        let stored = tpl
            .add_partition_offset(&self.shared.topics.input, self.partition, Offset::Offset(offset as i64))
            .and_then(|()| self.shared.consumer.store_offsets(&tpl));
        if let Err(error) = stored {
            tracing::warn!(partition = self.partition, offset, %error, "storing the group's offset");
        }
    }

    fn rejected(&mut self, offset: u64, reason: &Rejected) -> u64 {
        let topics = self.shared.topics;
        tracing::warn!(
            partition = self.partition, offset, %reason,
            "input record refused; it goes to the dead-letter topic {}", topics.dead_letters
        );
        let (key, value) = self.records.get(offset).unwrap_or_else(|| {
            tracing::error!(
                partition = self.partition,
                offset,
                "the refused record is not in its batch; its dead letter is empty"
            );
            (None, None)
        });
        let partition = self.partition.to_string();
        let offset_text = offset.to_string();
        let reason_text = reason.to_string();
        let headers = OwnedHeaders::new_with_capacity(4)
            .insert(Header {
                key: DEAD_LETTER_TOPIC_HEADER,
                value: Some(topics.input.as_str()),
            })
            .insert(Header {
                key: DEAD_LETTER_PARTITION_HEADER,
                value: Some(partition.as_str()),
            })
            .insert(Header {
                key: DEAD_LETTER_OFFSET_HEADER,
                value: Some(offset_text.as_str()),
            })
            .insert(Header {
                key: DEAD_LETTER_REASON_HEADER,
                value: Some(reason_text.as_str()),
            });
        let delivery = Delivery::DeadLetter {
            partition: self.partition,
            offset,
        };
        let mut record = BaseRecord::with_opaque_to(&topics.dead_letters, delivery.pack()).headers(headers);
        if let Some(key) = key {
            record = record.key(key);
        }
        if let Some(value) = value {
            record = record.payload(value);
        }
        if let Err(error) = send(self.shared.producer, record) {
            self.flight.fatal.get_or_insert(format!(
                "producing a dead letter to {} (input partition {}, offset {offset}): {error}",
                topics.dead_letters, self.partition
            ));
        }
        self.flight.dead_letters_in_flight += 1;
        1
    }
}

/// What every task shares: the clients and the topics.
struct Shared<'a> {
    group: String,
    producer: &'a BaseProducer<DeliveryReports>,
    changelog_producer: &'a BaseProducer<DeliveryReports>,
    consumer: &'a BaseConsumer<GroupContext>,
    topics: &'a Topics,
    /// How records are read and written.
    codec: &'a Codec,
    /// [`CRASH_IN_BACKUP`], and the backups with entries sent so far.
    crash_in_backup: Option<u64>,
    backups_sent: std::cell::Cell<u64>,
}

impl Shared<'_> {
    /// A backup's entries went out and its marker is next: the crash
    /// [`CRASH_IN_BACKUP`] asks for happens here.
    fn backup_entries_sent(&self, partition: i32) {
        let Some(at) = self.crash_in_backup else { return };
        let sent = self.backups_sent.get() + 1;
        self.backups_sent.set(sent);
        if sent == at {
            // The entries reach the log; their marker never does.
            let flushed = self.changelog_producer.flush(REQUEST_TIMEOUT);
            tracing::warn!(
                partition,
                backup = sent,
                entries_flushed = flushed.is_ok(),
                "{CRASH_IN_BACKUP}: SIGKILL between a backup's entries and its marker"
            );
            let _ = signal_hook::low_level::raise(signal_hook::consts::SIGKILL);
        }
    }
}

/// Where one record of a batch lies in its byte buffer.
#[derive(Clone, Copy, Debug)]
struct RawSpan {
    key: Option<(usize, usize)>,
    value: Option<(usize, usize)>,
}

/// A record's key and value as they came.
type RawRecord<'a> = (Option<&'a [u8]>, Option<&'a [u8]>);

/// The records of a batch as they came (keys and values back to back), so a
/// refused one goes to the dead-letter topic unchanged.
#[derive(Clone, Copy)]
struct RawRecords<'a> {
    offsets: &'a [u64],
    spans: &'a [RawSpan],
    bytes: &'a [u8],
}

impl<'a> RawRecords<'a> {
    const NONE: RawRecords<'static> = RawRecords {
        offsets: &[],
        spans: &[],
        bytes: &[],
    };

    /// The key and value of the record at `offset`, if it is in the batch.
    fn get(&self, offset: u64) -> Option<RawRecord<'a>> {
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
struct InputBatch<O: ServiceOperator> {
    inputs: Vec<O::Input>,
    offsets: Vec<u64>,
    spans: Vec<RawSpan>,
    bytes: Vec<u8>,
    /// The slots whose record did not decode, in order, with the reason;
    /// `next_undecoded` indexes the first not yet taken.
    undecoded: Vec<(usize, Rejected)>,
    next_undecoded: usize,
    filled: usize,
    taken: usize,
    /// The next offset to read.
    next_offset: u64,
    undecodable: u64,
}

impl<O: ServiceOperator> InputBatch<O> {
    fn new(next_offset: u64) -> Self {
        InputBatch {
            inputs: Vec::new(),
            offsets: Vec::new(),
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

    fn clear(&mut self) {
        self.filled = 0;
        self.taken = 0;
        self.spans.clear();
        self.bytes.clear();
        self.undecoded.clear();
        self.next_undecoded = 0;
    }

    /// Adds a record to the batch; one that does not decode keeps its slot, to
    /// be refused in its turn.
    fn accept(&mut self, codec: &Codec, offset: u64, key: Option<&[u8]>, value: Option<&[u8]>) {
        if offset < self.next_offset {
            return; // Already taken (a record fetched before the queue was split).
        }
        self.next_offset = offset + 1;
        if self.filled == self.inputs.len() {
            self.inputs.push(O::empty_input());
            self.offsets.push(0);
        }
        self.offsets[self.filled] = offset;
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

    fn is_drained(&self) -> bool {
        self.taken == self.filled
    }
}

/// One operator on one input partition.
struct Task<O: ServiceOperator> {
    partition: i32,
    driver: TaskDriver<O>,
    queue: PartitionQueue<GroupContext>,
    batch: InputBatch<O>,
    end: u64,
    flight: Flight,
    key: Vec<u8>,
    value: Vec<u8>,
    metrics: TaskMetrics,
    /// The driver's figures when the clean stop began.
    before_stop: Option<DriverStats>,
    /// The local store and the meta record each write carries.
    store: Option<(TaskStore, StoreMeta)>,
}

impl<O: ServiceOperator> Task<O> {
    fn io<'a>(
        shared: &'a Shared<'a>,
        partition: i32,
        flight: &'a mut Flight,
        key: &'a mut Vec<u8>,
        value: &'a mut Vec<u8>,
        records: RawRecords<'a>,
    ) -> KafkaIo<'a, O> {
        KafkaIo {
            shared,
            partition,
            flight,
            key,
            value,
            records,
            operator: PhantomData,
        }
    }

    /// Builds the task's operator and restores its state: from its local
    /// store, or by streaming its changelog partition through `loader`. Needs
    /// nothing of the running loop, so tasks assigned together restore side by
    /// side ([`restore_all`]).
    fn restore(
        loader: &ChangelogLoader,
        operator_config: &O::Config,
        assigned: Assigned,
        resident_keys: usize,
    ) -> Result<Restored<O>, ServiceError> {
        let partition = assigned.partition;
        #[cfg(feature = "fault-injection")]
        if let Some(ms) = std::env::var(FAULT_SLOW_TASK_START_MS)
            .ok()
            .and_then(|v| v.parse().ok())
        {
            // Test builds only: a slow restore, while the consumer fetches the
            // partitions assigned with this one.
            std::thread::sleep(Duration::from_millis(ms));
        }
        let restore_error = |source| ServiceError::Restore { partition, source };
        // A fresh state, on the task's local store if it has one.
        let new_operator = || {
            O::for_partition(
                operator_config,
                partition as u32,
                assigned
                    .store
                    .as_ref()
                    .map(|(store, _)| (store.key_store(), resident_keys)),
            )
        };
        let mut operator = new_operator()?;
        let mut plan = assigned.plan;
        let mut restored_records = 0;
        let mut changelog_end = None;
        let mut restore_seconds = assigned.restore_seconds;
        let mut rolled_back = Vec::new();
        if assigned.local {
            let drifted = operator.load_local_state().map_err(restore_error)?;
            tracing::info!(
                partition,
                drifted,
                "local store reopened; its drifted keys are owed to the next backup"
            );
        } else {
            let started = Instant::now();
            let mut attempt = 1;
            let streamed = loop {
                // The state logged at the marker the plan resumes from.
                let mut marked = MarkedState::for_plan(&plan);
                let mut resolved = Vec::with_capacity(RESTORE_CHUNK);
                let mut apply = |records: &[BackupEntry]| -> Result<(), String> {
                    resolved.clear();
                    marked.resolve(records, &mut resolved).map_err(|e| e.to_string())?;
                    operator.restore(&resolved).map_err(|e| e.to_string())?;
                    if let Some((store, meta)) = &assigned.store {
                        // Written as it is read, so memory holds one chunk; the
                        // offset is the one the task resumes at.
                        operator.stage_state();
                        let meta = StoreMeta {
                            next_offset: plan.resume_offset,
                            ..meta.clone()
                        };
                        store.write(&meta).map_err(|e| e.to_string())?;
                        operator.state_durable();
                    }
                    Ok(())
                };
                // Set when the state refused what was read: reading again
                // would not help.
                let mut refused = false;
                let streamed = match injected_restore_failure() {
                    Some(error) => Err(error),
                    None => loader.stream(partition, None, RESTORE_CHUNK, |entries| {
                        apply(entries).inspect_err(|_| refused = true)
                    }),
                };
                match streamed {
                    Ok(streamed) => {
                        let restart = marked.finish();
                        plan = plan.continuing(&restart);
                        rolled_back = restart.rolled_back;
                        break streamed;
                    }
                    Err(error) if !refused && attempt < RESTORE_ATTEMPTS => {
                        // A broker that times out or goes away for a moment: read
                        // the changelog again from its start into a fresh state
                        // (later records for a key win, so what a partial read
                        // applied, or wrote to the store, is rewritten).
                        let wait = RESTORE_RETRY_WAIT.saturating_mul(1 << (attempt - 1));
                        tracing::warn!(
                            partition,
                            attempt,
                            of = RESTORE_ATTEMPTS,
                            %error,
                            retry_in_ms = wait.as_millis() as u64,
                            "restoring from the changelog failed; reading it again"
                        );
                        std::thread::sleep(wait);
                        attempt += 1;
                        operator = new_operator()?;
                    }
                    Err(error) => {
                        return Err(ServiceError::Task {
                            partition,
                            message: format!("restoring from the changelog (attempt {attempt}): {error}"),
                        })
                    }
                }
            };
            restored_records = streamed.records;
            changelog_end = Some(streamed.end_offset);
            restore_seconds += started.elapsed().as_secs_f64();
        }
        Ok(Restored {
            operator,
            assigned: Assigned { plan, ..assigned },
            restored_records,
            changelog_end,
            restore_seconds,
            rolled_back,
        })
    }

    /// Starts the task's driver on its restored state.
    fn start(
        shared: &Shared<'_>,
        controller: ControllerConfig,
        restored: Restored<O>,
        queue: PartitionQueue<GroupContext>,
        now_ms: u64,
    ) -> Result<Self, ServiceError> {
        let Restored {
            operator,
            assigned,
            restored_records,
            changelog_end,
            restore_seconds,
            rolled_back,
        } = restored;
        let partition = assigned.partition;
        let restore_error = |source| ServiceError::Restore { partition, source };
        let controller = match &assigned.store {
            Some((_, meta)) => controller.with_writer(meta.store_id),
            None => controller,
        };
        let plan = assigned.plan;
        let mut flight = Flight::default();
        let (mut key, mut value) = (Vec::new(), Vec::new());
        let mut io = Self::io(shared, partition, &mut flight, &mut key, &mut value, RawRecords::NONE);
        #[allow(unused_mut)]
        let mut driver =
            TaskDriver::start(controller, operator, &plan, rolled_back, now_ms, &mut io).map_err(restore_error)?;
        #[cfg(feature = "fault-injection")]
        if std::env::var_os(FAULT_SKIP_BACKUPS).is_some() {
            // Test builds only: backups write nothing while the bounds are still
            // claimed, so the tests can show that a broken bound is caught.
            tracing::warn!(
                partition = assigned.partition,
                "{FAULT_SKIP_BACKUPS} is set: backups write nothing"
            );
            driver.inject_faults(crate::core::driver::DriverFaults { skip_backups: true });
        }
        let thresholds = driver.controller().thresholds();
        TaskMetrics::started(
            &shared.group,
            assigned.partition,
            &plan,
            restored_records,
            restore_seconds,
        );
        if plan.counted_failure {
            tracing::warn!(
                partition = assigned.partition,
                source = ?plan.source,
                resume_offset = plan.resume_offset,
                failures = plan.failures,
                restored_records = restored_records,
                changelog_end,
                restore_seconds,
                bound_state = plan.introduced.state,
                bound_outputs = plan.introduced.outputs,
                theta = thresholds.theta,
                l = thresholds.items,
                gamma = thresholds.outputs,
                "recovered from a failure",
            );
        } else {
            tracing::info!(
                partition = assigned.partition,
                source = ?plan.source,
                resume_offset = plan.resume_offset,
                failures = plan.failures,
                restored_records = restored_records,
                changelog_end,
                theta = thresholds.theta,
                l = thresholds.items,
                gamma = thresholds.outputs,
                "task started",
            );
        }
        Ok(Task {
            partition: assigned.partition,
            driver,
            queue,
            batch: InputBatch::new(plan.resume_offset),
            end: assigned.end,
            flight,
            key,
            value,
            metrics: TaskMetrics::new(&shared.group, assigned.partition),
            before_stop: None,
            store: assigned.store,
        })
    }

    /// Writes the state changes to the local store (with the offset they are
    /// exact at), then sends the changelog records held for that write; sends
    /// failed outputs and dead letters again. Nothing goes out while a failed
    /// delivery's backoff lasts.
    fn flush(&mut self, shared: &Shared<'_>, now_ms: u64) -> bool {
        if self.flight.retry.holds(now_ms) {
            return false;
        }
        let resent = !self.flight.resend.is_empty();
        for (delivery, failed) in std::mem::take(&mut self.flight.resend) {
            let mut record = BaseRecord::with_opaque_to(&failed.topic, delivery.pack());
            if let Some(key) = &failed.key {
                record = record.key(key.as_slice());
            }
            if let Some(value) = &failed.value {
                record = record.payload(value.as_slice());
            }
            if let Some(headers) = failed.headers {
                record = record.headers(headers);
            }
            if let Err(error) = send(shared.producer, record) {
                self.flight
                    .fatal
                    .get_or_insert(format!("sending a record to {} again: {error}", failed.topic));
            }
        }
        if self.flight.changelog.is_empty() && !self.flight.unwritten {
            return resent;
        }
        if self.store.is_some() && self.flight.dead_letters_in_flight > 0 {
            // The store write (and the changelog records that wait for it)
            // waits for the dead letters' acknowledgements.
            return resent;
        }
        if let Some((store, meta)) = &mut self.store {
            self.driver.stage_state();
            meta.next_offset = self.driver.controller().processed().offset;
            if let Err(error) = store.write(meta) {
                self.flight.fatal.get_or_insert(error.to_string());
                return true;
            }
            self.driver.state_durable();
        }
        self.flight.unwritten = false;
        let mut after_entries = false;
        for (entry, delivery) in std::mem::take(&mut self.flight.changelog) {
            if after_entries && matches!(delivery, Delivery::Marker { .. }) {
                shared.backup_entries_sent(self.partition);
            }
            after_entries = matches!(delivery, Delivery::BackupRecord { .. });
            let sent = send_to_changelog(shared, self.partition, &entry, delivery);
            if let (Delivery::Marker { seq, .. }, Ok(())) = (delivery, &sent) {
                self.flight.markers.sent(seq);
            }
            if let Err(error) = sent {
                match delivery {
                    Delivery::Marker { seq, .. } => {
                        tracing::warn!(partition = self.partition, seq, %error, "marker not sent; it is retried");
                        self.flight.acks.push(Ack::MarkerFailed(seq));
                    }
                    Delivery::BackupRecord { seq, .. } => {
                        tracing::warn!(partition = self.partition, seq, %error, "backup record not sent; the backup is retried");
                        self.flight.backup_record_done(seq, true);
                    }
                    Delivery::Output { .. } | Delivery::DeadLetter { .. } => {}
                }
            }
        }
        true
    }

    /// Delivers the acknowledgements the I/O produced itself, until none is left.
    fn settle(&mut self, shared: &Shared<'_>) -> bool {
        let mut worked = false;
        while !self.flight.acks.is_empty() {
            worked = true;
            let acks = std::mem::take(&mut self.flight.acks);
            for ack in acks {
                self.acknowledge(shared, ack);
            }
        }
        worked
    }

    fn acknowledge(&mut self, shared: &Shared<'_>, ack: Ack) {
        // A backup's outcome moves the state's baseline, which the store keeps.
        self.flight.unwritten |= matches!(ack, Ack::BackupWritten(_) | Ack::BackupFailed(_));
        let mut io = Self::io(
            shared,
            self.partition,
            &mut self.flight,
            &mut self.key,
            &mut self.value,
            RawRecords::NONE,
        );
        self.driver.acknowledge(ack, &mut io);
    }

    fn delivered(&mut self, shared: &Shared<'_>, event: DeliveryEvent, now_ms: u64) {
        let changelog = matches!(event.delivery, Delivery::BackupRecord { .. } | Delivery::Marker { .. });
        if changelog && event.failure.is_some() {
            if let Some((code, reason)) = shared.changelog_producer.client().fatal_error() {
                // No record may land behind the failed one: the producer stopped.
                self.flight.fatal.get_or_insert(format!(
                    "the changelog's producer stopped ({code:?}: {reason}); a restart recovers from the last \
                     marker in {}",
                    shared.topics.changelog
                ));
                return;
            }
        }
        match &event.failure {
            None => self.flight.retry.succeeded(),
            Some(failed) if failed.code.is_some_and(is_permanent) => {
                self.flight.fatal.get_or_insert(format!(
                    "the broker refuses a record for {} for good (input partition {}): {}",
                    failed.topic, self.partition, failed.error
                ));
                return;
            }
            Some(_) => self.flight.retry.failed(now_ms),
        }
        match (event.delivery, event.failure) {
            (delivery @ (Delivery::Output { offset, .. } | Delivery::DeadLetter { offset, .. }), None) => {
                if matches!(delivery, Delivery::Output { .. }) {
                    self.metrics.outputs_acknowledged(1);
                } else {
                    self.metrics.dead_letters_acknowledged(1);
                    self.flight.dead_letters_in_flight = self.flight.dead_letters_in_flight.saturating_sub(1);
                }
                // A dead letter is held like an output of its record.
                self.acknowledge(
                    shared,
                    Ack::Output {
                        item_offset: offset,
                        count: 1,
                    },
                )
            }
            (delivery @ (Delivery::Output { offset, .. } | Delivery::DeadLetter { offset, .. }), Some(failed)) => {
                // Neither is ever given up: it is sent again, in order of
                // failure, once the backoff has passed.
                tracing::warn!(
                    partition = self.partition, offset, error = %failed.error, topic = %failed.topic,
                    "record not delivered; sending it again"
                );
                self.flight.resend.push((delivery, failed));
            }
            (Delivery::BackupRecord { seq, .. }, failure) => {
                if let Some(failed) = &failure {
                    tracing::warn!(partition = self.partition, seq, error = %failed.error, "backup record not delivered; the backup is retried");
                }
                self.flight.backup_record_done(seq, failure.is_some());
            }
            (Delivery::Marker { seq, .. }, None) => {
                self.flight.markers.done(seq, true);
                self.acknowledge(shared, Ack::MarkerWritten(seq))
            }
            (Delivery::Marker { seq, .. }, Some(failed)) => {
                self.flight.markers.done(seq, false);
                tracing::warn!(partition = self.partition, seq, error = %failed.error, "marker not delivered; it is retried");
                self.acknowledge(shared, Ack::MarkerFailed(seq));
            }
        }
        self.settle(shared);
    }

    /// Takes input until the driver must wait; returns whether anything happened.
    fn step(&mut self, shared: &Shared<'_>, now_ms: u64, stopping: bool) -> bool {
        let mut worked = self.settle(shared);
        if stopping || self.driver.is_stopped() {
            return worked;
        }
        let batch = &mut self.batch;
        if batch.is_drained() {
            batch.clear();
            while batch.filled < POLL_BATCH {
                match self.queue.poll(Duration::ZERO) {
                    Some(Ok(message)) => {
                        let offset = message.offset().max(0) as u64;
                        batch.accept(shared.codec, offset, message.key(), message.payload());
                        worked = true;
                    }
                    Some(Err(error)) => {
                        tracing::warn!(partition = self.partition, %error, "fetching input");
                        break;
                    }
                    None => break,
                }
            }
        }
        // Field by field, so the batch's position can move while the driver
        // reads its inputs and records.
        let records = RawRecords {
            offsets: &batch.offsets[..batch.filled],
            spans: &batch.spans,
            bytes: &batch.bytes,
        };
        let mut io = Self::io(
            shared,
            self.partition,
            &mut self.flight,
            &mut self.key,
            &mut self.value,
            records,
        );
        // Runs of decoded items go to the driver together; a record that did
        // not decode is refused in its turn.
        while !batch.is_drained() {
            let refused = batch.undecoded.get(batch.next_undecoded);
            let run_end = refused.map_or(batch.filled, |(slot, _)| *slot);
            let taken = if batch.taken < run_end {
                let items = batch.offsets[batch.taken..run_end]
                    .iter()
                    .copied()
                    .zip(&batch.inputs[batch.taken..run_end]);
                match self.driver.process(items, now_ms, &mut io) {
                    Ok(taken) => taken,
                    Err(error) => {
                        io.flight
                            .fatal
                            .get_or_insert(format!("reading the task's state: {error}"));
                        return true;
                    }
                }
            } else if let Some((slot, reason)) = refused {
                let taken = self.driver.refuse(batch.offsets[*slot], reason, now_ms, &mut io);
                batch.next_undecoded += usize::from(taken);
                usize::from(taken)
            } else {
                0
            };
            batch.taken += taken;
            worked |= taken > 0;
            io.flight.unwritten |= taken > 0;
            if batch.taken < run_end || taken == 0 {
                tracing::trace!(partition = self.partition, blocked = ?self.driver.readiness(), "input waits");
                break;
            }
        }
        self.driver.tick(now_ms, &mut io);
        worked |= self.settle(shared);
        if worked {
            self.publish();
        }
        worked
    }

    /// Brings the task's metrics up to date.
    fn publish(&mut self) {
        let controller = self.driver.controller();
        let position = TaskPosition {
            divergence: self.driver.operator().divergence(),
            thresholds: controller.thresholds(),
            items_past_marker: controller.items_past_marker(),
            unacknowledged_outputs: controller.unacknowledged_outputs(),
            failures: controller.failures(),
            marker_round_trips: (self.flight.markers.acknowledged, self.flight.markers.total),
        };
        self.metrics
            .publish(self.driver.stats(), self.batch.undecodable, &position);
    }

    fn at_end(&self) -> bool {
        self.batch.is_drained() && self.batch.next_offset >= self.end
    }

    /// Input is at hand but waits on an acknowledgement (the outputs, the
    /// start marker).
    fn awaits_acknowledgement(&self) -> bool {
        !self.batch.is_drained() && matches!(self.driver.readiness(), Err(Blocked::Outputs | Blocked::StartMarker))
    }

    /// Hands the operator a record of the feedback topic; one that does not
    /// decode is skipped with a warning (the next one supersedes it).
    fn feedback(&mut self, shared: &Shared<'_>, codec: &Codec, value: &[u8]) {
        let mut io = Self::io(
            shared,
            self.partition,
            &mut self.flight,
            &mut self.key,
            &mut self.value,
            RawRecords::NONE,
        );
        match self
            .driver
            .side_input(|operator| operator.feedback(codec, value), &mut io)
        {
            Ok(moved) => tracing::debug!(partition = self.partition, moved, "feedback taken in"),
            Err(error) => tracing::warn!(partition = self.partition, %error, "a feedback record was skipped"),
        }
    }

    fn begin_stop(&mut self, shared: &Shared<'_>) {
        self.before_stop = Some(self.driver.stats());
        let mut io = Self::io(
            shared,
            self.partition,
            &mut self.flight,
            &mut self.key,
            &mut self.value,
            RawRecords::NONE,
        );
        self.driver.begin_stop(&mut io);
        self.settle(shared);
    }
}

/// Empties a list the rebalance callback fills (empty when its lock is poisoned).
/// The pipeline's feedback topic: every record to every task, from the last
/// one there when the pipeline starts. Not a group member: nothing to commit,
/// and every process reads all of it.
struct FeedbackReader {
    consumer: BaseConsumer,
    codec: Codec,
    /// The latest record, for the tasks that start later.
    latest: Option<Vec<u8>>,
}

impl FeedbackReader {
    fn open<O: ServiceOperator>(config: &Config, stop: &AtomicBool) -> Result<Option<Self>, ServiceError> {
        let pipeline = &config.pipeline;
        let codec = O::feedback_codec(pipeline).map_err(ServiceError::Unsupported)?;
        let (topic, codec) = match (&pipeline.feedback_topic, codec) {
            (None, None) => return Ok(None),
            (Some(topic), Some(codec)) => (topic, codec),
            (None, Some(_)) => {
                return Err(ServiceError::Unsupported(format!(
                    "operator {} reads a feedback topic: set `feedback_topic` (the averager's output topic)",
                    pipeline.operator.kind()
                )))
            }
            (Some(topic), None) => {
                return Err(ServiceError::Unsupported(format!(
                    "`feedback_topic` = {topic:?}, but operator {} reads no feedback",
                    pipeline.operator.kind()
                )))
            }
        };
        let kafka = &config.kafka;
        let spec = [TopicSpec {
            name: topic,
            partitions: 1,
            compacted: false,
        }];
        patiently(kafka, stop, "creating the feedback topic", || {
            ensure_topics(kafka, &spec)
        })?;
        let partitions = patiently(kafka, stop, "reading the feedback topic's metadata", || {
            partition_count(kafka, topic)
        })?
        .ok_or_else(|| KafkaSetupError::MissingTopic(topic.clone()))?;
        let consumer: BaseConsumer = client_config(
            kafka,
            ClientRole::Consumer,
            &[
                ("group.id", &format!("{}-feedback", kafka.group_id)),
                ("enable.auto.commit", "false"),
                ("enable.auto.offset.store", "false"),
            ],
        )
        .create()?;
        let mut assignment = TopicPartitionList::new();
        for partition in 0..partitions as i32 {
            assignment.add_partition_offset(topic, partition, Offset::OffsetTail(1))?;
        }
        consumer.assign(&assignment)?;
        tracing::info!(feedback = %topic, partitions, "reading the feedback topic from its last record");
        Ok(Some(FeedbackReader {
            consumer,
            codec,
            latest: None,
        }))
    }

    /// The records that arrived since the last call.
    fn poll(&mut self) -> Vec<Vec<u8>> {
        let mut records = Vec::new();
        while let Some(result) = self.consumer.poll(Duration::ZERO) {
            match result {
                Ok(message) => records.push(message.payload().unwrap_or_default().to_vec()),
                Err(error) => {
                    tracing::warn!(%error, "fetching feedback");
                    break;
                }
            }
        }
        records
    }
}

fn take<T: Default>(list: &Mutex<T>) -> T {
    list.lock().map(|mut l| std::mem::take(&mut *l)).unwrap_or_default()
}

/// Hands the producers' delivery reports to their tasks; returns whether there were any.
fn deliver_reports<O: ServiceOperator>(
    shared: &Shared<'_>,
    tasks: &mut BTreeMap<i32, Task<O>>,
    events: &mut Vec<DeliveryEvent>,
    now_ms: u64,
) -> bool {
    for producer in [shared.producer, shared.changelog_producer] {
        producer.poll(Duration::ZERO);
        producer.context().drain_into(events);
    }
    let any = !events.is_empty();
    for event in events.drain(..) {
        if let Some(task) = tasks.get_mut(&event.delivery.partition()) {
            task.delivered(shared, event, now_ms);
        }
    }
    any
}

/// How long the changelog's records wait to be batched (see `run_pipeline`).
const CHANGELOG_LINGER_MS: &str = "1";
/// How long outputs wait to be batched in mode none, and where markers wait
/// for them (see `run_pipeline`).
const OUTPUT_LINGER_MS: &str = "5";
const OUTPUT_LINGER_MS_MARKERS_WAIT: &str = "1";

/// The changelog's producer is gapless: a record lands only if every record
/// before it in the partition landed. A marker goes out right behind its
/// backup's entries and recovery trusts that a marker in the log has them all
/// before it. librdkafka's gapless guarantee turns any failure that could
/// leave a gap into a fatal error; a record that times out is the one gap it
/// allows, so records never time out (during an outage input waits on the
/// window instead). Set after the user's properties: recovery depends on them.
const GAPLESS_CHANGELOG: &[(&str, &str)] = &[("enable.gapless.guarantee", "true"), ("message.timeout.ms", "0")];

/// An idempotent producer whose delivery reports carry a packed [`Delivery`],
/// with `fixed` properties over the user's.
fn idempotent_producer(
    kafka: &super::config::KafkaConfig,
    linger_ms: &str,
    fixed: &[(&str, &str)],
) -> Result<BaseProducer<DeliveryReports>, KafkaError> {
    let mut config = client_config(
        kafka,
        ClientRole::Producer,
        &[
            ("enable.idempotence", "true"),
            ("linger.ms", linger_ms),
            ("compression.type", "lz4"),
        ],
    );
    for (key, value) in fixed {
        config.set(*key, *value);
    }
    config.create_with_context(DeliveryReports::default())
}

/// Runs the pipeline until `stop` is set (then stops cleanly) or, with
/// `stop_at_end`, until every partition is processed to its end.
pub fn run_pipeline<O: ServiceOperator>(
    config: &Config,
    operator_config: &O::Config,
    stop: &AtomicBool,
    options: RunOptions,
) -> Result<RunReport, ServiceError> {
    let kafka = &config.kafka;
    let pipeline = &config.pipeline;
    let topics = Topics {
        input: pipeline.input_topic.clone(),
        output: pipeline.output_topic.clone(),
        changelog: pipeline.changelog_topic(&kafka.group_id),
        dead_letters: pipeline.dead_letter_topic(&kafka.group_id),
    };
    let codec = Codec::new::<O>(pipeline).map_err(ServiceError::Unsupported)?;
    let crash_in_backup = match std::env::var(CRASH_IN_BACKUP) {
        Ok(value) => Some(value.trim().parse::<u64>().map_err(|e| {
            ServiceError::Unsupported(format!(
                "{CRASH_IN_BACKUP}={value:?}: a backup number is expected ({e})"
            ))
        })?),
        Err(_) => None,
    };
    if let Some(at) = crash_in_backup {
        tracing::warn!("{CRASH_IN_BACKUP} is set: this process SIGKILLs itself in the middle of backup {at}");
    }
    let _state_lock = match &pipeline.state_dir {
        Some(dir) => Some(lock_state_dir(dir, &kafka.group_id)?),
        None => None,
    };
    let partitions = patiently(kafka, stop, "reading the input topic's metadata", || {
        partition_count(kafka, &topics.input)
    })?
    .ok_or_else(|| KafkaSetupError::MissingTopic(topics.input.clone()))?;
    if partitions > 1 << 16 {
        return Err(ServiceError::Unsupported(format!(
            "input topic {} has {partitions} partitions; afstream handles up to 65536",
            topics.input
        )));
    }
    let specs = [
        TopicSpec {
            name: &topics.changelog,
            partitions,
            compacted: true,
        },
        TopicSpec {
            name: &topics.output,
            partitions: O::output_partitions(operator_config).unwrap_or(partitions),
            compacted: false,
        },
        TopicSpec {
            name: &topics.dead_letters,
            partitions,
            compacted: false,
        },
    ];
    patiently(kafka, stop, "creating the pipeline's topics", || {
        ensure_topics(kafka, &specs)
    })?;
    O::check_partitions(operator_config, partitions).map_err(ServiceError::Unsupported)?;
    let mut feedback = FeedbackReader::open::<O>(config, stop)?;
    let ft = &pipeline.fault_tolerance;
    let plan = TaskPlan::new::<O>(config, operator_config, partitions)?;
    let controller = plan.controller;
    if let Some(warning) = plan.warning() {
        tracing::warn!("{warning}");
    }

    // Backups and markers go out almost at once, since a recovery replays
    // the items of the markers in flight. Not at once: with
    // `linger.ms` 0, librdkafka's broker thread spins (poll with no timeout)
    // whenever records wait behind the five requests an idempotent producer
    // keeps in flight, which several backups in flight make common; measured
    // here, up to 4 s of CPU in a 5 s run of heavy hitters, taken from the
    // broker on the same machine, against under 1 s with 1 ms. Outputs linger
    // to batch, briefly where a marker waits for them (every mode but none):
    // their linger adds to every window of a task with an output per item
    // (`cargo bench --bench latency`: logistic regression at a 0.5 ms round
    // trip, 441 k items/s with outputs acknowledged at once, 81 k with 5 ms of
    // linger; on this project's broker 1 ms against 5 took 100 000 items in
    // 5.9-6.2 s against 6.7-7.0 s). A user's `producer.linger.ms` sets both.
    // Separate producers keep each order: the changelog's within its partition
    // (gapless), outputs' per key.
    let output_linger_ms = if controller.mode == Mode::None {
        OUTPUT_LINGER_MS
    } else {
        OUTPUT_LINGER_MS_MARKERS_WAIT
    };
    let producer = Arc::new(idempotent_producer(kafka, output_linger_ms, &[])?);
    let changelog_producer = Arc::new(idempotent_producer(kafka, CHANGELOG_LINGER_MS, GAPLESS_CHANGELOG)?);
    // Connected before the group assigns anything: a restarted process
    // restores its partitions side by side, one of them with the context's
    // reader and the others with these.
    let restore_readers = ReaderPool::new(kafka, &topics.changelog);
    restore_readers.fill_in_background(partitions.clamp(1, RESTORE_PARALLELISM) - 1);
    let context = GroupContext {
        group: kafka.group_id.clone(),
        input_topic: topics.input.clone(),
        loader: ChangelogLoader::new(kafka, &topics.changelog)?,
        handoff_quiet: Duration::from_millis(pipeline.handoff_quiet_ms),
        controller,
        stores: match &pipeline.state_dir {
            Some(dir) if O::STORE_BACKED => Some(Stores {
                root: dir.join(&kafka.group_id),
                budget: StoreBudget {
                    cache_bytes: pipeline.store.cache_mib << 20,
                    resident_keys: pipeline.store.resident_keys,
                },
            }),
            _ => None,
        },
        assigned: Mutex::new(Vec::new()),
        revoked: Mutex::new(Vec::new()),
        lost: Mutex::new(Vec::new()),
        parked: Mutex::new(HashMap::new()),
        regained: Mutex::new(Vec::new()),
        revoking: Mutex::new(None),
        closing: AtomicBool::new(false),
        failure: Mutex::new(None),
        producers: [Arc::clone(&producer), Arc::clone(&changelog_producer)],
    };
    // The group's offset follows acknowledged markers: offsets are stored by the
    // tasks and committed in the background (nothing waits on a commit).
    let consumer: Arc<BaseConsumer<GroupContext>> = Arc::new(
        client_config(
            kafka,
            ClientRole::Consumer,
            &[
                ("group.id", kafka.group_id.as_str()),
                ("enable.auto.commit", "true"),
                ("enable.auto.offset.store", "false"),
                ("auto.offset.reset", "earliest"),
                // Incremental rebalances: only the partitions that move stop
                // (and are handed off); the others run on.
                ("partition.assignment.strategy", "cooperative-sticky"),
                ("session.timeout.ms", "6000"),
                ("heartbeat.interval.ms", "1500"),
                // Consumer lag for the metrics; parsed only when they are served.
                (
                    "statistics.interval.ms",
                    if config.metrics.is_some() { "5000" } else { "0" },
                ),
            ],
        )
        .create_with_context(context)?,
    );
    // However run_pipeline ends, the consumer is closed after this is dropped.
    let _closing = ClosingGuard(&consumer.context().closing);
    consumer.subscribe(&[topics.input.as_str()])?;
    tracing::info!(
        input = %topics.input, output = %topics.output, changelog = %topics.changelog,
        partitions, mode = ?ft.mode(), "joined group {}", kafka.group_id
    );

    let shared = Shared {
        group: kafka.group_id.clone(),
        producer: &producer,
        changelog_producer: &changelog_producer,
        consumer: &consumer,
        topics: &topics,
        codec: &codec,
        crash_in_backup,
        backups_sent: std::cell::Cell::new(0),
    };
    let started = Instant::now();
    let mut tasks: BTreeMap<i32, Task<O>> = BTreeMap::new();
    let mut events: Vec<DeliveryEvent> = Vec::new();
    let mut stopping: Option<Instant> = None;
    let mut drained: Option<Duration> = None;
    let mut first_task: Option<Instant> = None;
    let mut worked = true;
    let mut idle_rounds: u32 = 0;
    let mut awaiting = false;
    let mut handoff: Option<Revocation> = None;
    // Tasks of lost partitions, kept in case the group gives them back.
    let mut parked_tasks: BTreeMap<i32, Task<O>> = BTreeMap::new();
    loop {
        // Nothing happened last round: back off from 100 µs to 5 ms, or to 200 µs
        // while input waits on an acknowledgement, so that it resumes within a
        // fraction of a millisecond of it (the producers' and the partitions'
        // queues cannot be waited on together); an idle service wakes 200 times
        // a second.
        if worked {
            idle_rounds = 0;
        } else {
            idle_rounds = idle_rounds.saturating_add(1);
            let longest = if awaiting { AWAIT_WAIT_MAX } else { IDLE_WAIT_MAX };
            std::thread::sleep(IDLE_WAIT_MIN.saturating_mul(1 << idle_rounds.min(6)).min(longest));
        }
        let now_ms = started.elapsed().as_millis() as u64;
        worked = false;
        let message = consumer.poll(Duration::ZERO);
        let context = consumer.context();
        if let Some(failure) = context.failure.lock().ok().and_then(|mut f| f.take()) {
            return Err(ServiceError::Rebalance(failure));
        }
        let revoked = take(&context.revoked);
        if !revoked.is_empty() {
            // The revocation flushed the producers: the revoked tasks get their
            // delivery reports before they go.
            worked |= deliver_reports(&shared, &mut tasks, &mut events, now_ms);
        }
        for partition in revoked {
            if tasks.remove(&partition).is_some() {
                tracing::info!(
                    partition,
                    "partition revoked; its next owner restores it from the changelog"
                );
            }
        }
        let lost = take(&context.lost);
        if !lost.is_empty() {
            // The loss flushed the producers: the tasks get their delivery
            // reports before they are parked, and the changelog's end is final.
            worked |= deliver_reports(&shared, &mut tasks, &mut events, now_ms);
        }
        for partition in lost {
            let Some(task) = tasks.remove(&partition) else { continue };
            match context.loader.end_offset(partition) {
                Ok(changelog_end) if task.store.is_none() && !task.driver.is_stopped() => {
                    let next_offset = task.driver.controller().processed().offset;
                    tracing::info!(
                        partition,
                        next_offset,
                        "partition lost; its task is kept: if the partition comes back and nothing else wrote its \
                         changelog, it goes on where it stopped"
                    );
                    if let Ok(mut parked) = context.parked.lock() {
                        parked.insert(
                            partition,
                            Parked {
                                next_offset,
                                changelog_end,
                            },
                        );
                    }
                    parked_tasks.insert(partition, task);
                }
                // A task on a local store restarts on it exactly anyway.
                _ => tracing::info!(partition, "partition lost; its next owner restores it"),
            }
        }
        for (partition, end) in take(&context.regained) {
            let Some(mut task) = parked_tasks.remove(&partition) else {
                continue;
            };
            let next_offset = task.driver.controller().processed().offset;
            let queue = own_queue(&consumer, &topics.input, partition, next_offset)?;
            task.queue = queue;
            task.batch = InputBatch::new(next_offset);
            task.end = end;
            tracing::info!(
                partition,
                next_offset,
                "partition given back: its kept task goes on where it stopped (nothing else wrote its changelog); no \
                 failure"
            );
            if stopping.is_some() {
                task.begin_stop(&shared);
            }
            tasks.insert(partition, task);
        }
        let batch = take(&context.assigned);
        let mut queues = Vec::with_capacity(batch.len());
        for assigned in &batch {
            // Processing time counts from the first assignment: the consumer
            // fetches from then on, while the task restores.
            first_task.get_or_insert_with(Instant::now);
            // A kept task whose partition came back after another member wrote its changelog.
            parked_tasks.remove(&assigned.partition);
            queues.push(own_queue(
                &consumer,
                &topics.input,
                assigned.partition,
                assigned.plan.resume_offset,
            )?);
        }
        let restored = restore_all::<O>(
            &context.loader,
            &restore_readers,
            operator_config,
            batch,
            pipeline.store.resident_keys,
        )?;
        for (restored, queue) in restored.into_iter().zip(queues) {
            let partition = restored.assigned.partition;
            let now_ms = started.elapsed().as_millis() as u64;
            let mut task = Task::start(&shared, controller, restored, queue, now_ms)?;
            if let Some(reader) = &feedback {
                // The latest global model, as a restarted worker must take it in again.
                if let Some(latest) = &reader.latest {
                    task.feedback(&shared, &reader.codec, latest);
                }
            }
            if stopping.is_some() {
                // Assigned while the loop is stopping: it stops at once, cleanly
                // (a final backup and a clean marker where it started).
                task.begin_stop(&shared);
            }
            tasks.insert(partition, task);
        }
        // After the assignments: a partition assigned and then revoked within
        // one poll is started, then handed off.
        if let Some(revocation) = context.revoking.lock().ok().and_then(|mut r| r.take()) {
            for partition in &revocation.partitions {
                if let Some(task) = tasks.get_mut(partition) {
                    tracing::info!(
                        partition,
                        "partition revoked; handing it off: final backup, clean marker"
                    );
                    task.begin_stop(&shared);
                }
            }
            match handoff.as_mut() {
                Some(pending) => pending.add(revocation.partitions, &revocation.tpl),
                None => handoff = Some(revocation),
            }
            worked = true;
        }
        if let Some(reader) = &mut feedback {
            for value in reader.poll() {
                for task in tasks.values_mut() {
                    task.feedback(&shared, &reader.codec, &value);
                }
                reader.latest = Some(value);
                worked = true;
            }
        }
        match message {
            // A record fetched before its partition's queue was split (its
            // task's seek made librdkafka drop those; any left is taken if new).
            Some(Ok(message)) => {
                if let Some(task) = tasks.get_mut(&message.partition()) {
                    task.batch.accept(
                        shared.codec,
                        message.offset().max(0) as u64,
                        message.key(),
                        message.payload(),
                    );
                }
                worked = true;
            }
            Some(Err(error)) => tracing::warn!(%error, "consumer"),
            None => {}
        }
        for task in tasks.values_mut() {
            worked |= task.step(&shared, now_ms, stopping.is_some());
        }
        worked |= deliver_reports(&shared, &mut tasks, &mut events, now_ms);
        for task in tasks.values_mut() {
            worked |= task.flush(&shared, now_ms);
        }
        awaiting = tasks.values().any(Task::awaits_acknowledgement);
        if let Some(revocation) = &handoff {
            let stopped = revocation
                .partitions
                .iter()
                .all(|p| tasks.get(p).is_none_or(|t| t.driver.is_stopped()));
            if stopped || revocation.since.elapsed() > STOP_DEADLINE {
                context.flush_producers();
                deliver_reports(&shared, &mut tasks, &mut events, now_ms);
                for partition in &revocation.partitions {
                    match tasks.remove(partition) {
                        Some(task) if task.driver.is_stopped() => {
                            tracing::info!(
                                partition,
                                "partition handed off: its final backup and clean marker are in the changelog"
                            );
                        }
                        Some(_) => tracing::warn!(
                            partition,
                            "partition handed off before its final backup was acknowledged (within {STOP_DEADLINE:?}): \
                             its next owner recovers from the last marker and counts a failure"
                        ),
                        None => {}
                    }
                }
                // The clean markers' offsets are stored: commit them before the
                // release (the next owner resumes at the marker either way).
                match consumer.commit_consumer_state(CommitMode::Sync) {
                    Ok(()) | Err(KafkaError::ConsumerCommit(RDKafkaErrorCode::NoOffset)) => {}
                    Err(error) => tracing::warn!(%error, "committing offsets before a handoff"),
                }
                revocation.release(&consumer)?;
                handoff = None;
                worked = true;
            }
        }
        if let Some((partition, fatal)) = tasks
            .iter_mut()
            .find_map(|(p, t)| t.flight.fatal.take().map(|f| (*p, f)))
        {
            return Err(ServiceError::Task {
                partition,
                message: fatal,
            });
        }

        let at_end = options.stop_at_end && tasks.len() == partitions && tasks.values().all(Task::at_end);
        if stopping.is_none() && (stop.load(Ordering::Relaxed) || at_end) {
            tracing::info!(
                tasks = tasks.len(),
                "stopping cleanly: final backups, markers and commits"
            );
            for task in tasks.values_mut() {
                task.begin_stop(&shared);
            }
            stopping = Some(Instant::now());
        }
        if let Some(since) = stopping {
            if drained.is_none()
                && tasks
                    .values()
                    .all(|t| t.driver.controller().unacknowledged_outputs() == 0)
            {
                drained = Some(since.elapsed());
            }
            if tasks.values().all(|t| t.driver.is_stopped()) {
                break;
            }
            if since.elapsed() > STOP_DEADLINE {
                let waiting: Vec<i32> = tasks
                    .values()
                    .filter(|t| !t.driver.is_stopped())
                    .map(|t| t.partition)
                    .collect();
                return Err(ServiceError::Stop(format!(
                    "partitions {waiting:?} did not finish their final backup within {STOP_DEADLINE:?}"
                )));
            }
        }
    }
    if let Some(revocation) = handoff.take() {
        // Its tasks stopped with the rest.
        revocation.release(&consumer)?;
    }
    let stop_began = stopping.unwrap_or_else(Instant::now);
    let mut report = RunReport {
        tasks: Vec::new(),
        processing: first_task
            .map(|t| stop_began.saturating_duration_since(t))
            .unwrap_or_default(),
        stop: stop_began.elapsed(),
        drained: drained.unwrap_or_default(),
    };
    for task in tasks.values_mut() {
        task.publish();
        let stats = task.driver.stats();
        report.tasks.push(TaskReport {
            partition: task.partition,
            stats,
            before_stop: task.before_stop.unwrap_or(stats),
            markers: task.flight.markers.clone(),
            undecodable: task.batch.undecodable,
        });
        tracing::info!(
            partition = task.partition,
            items = stats.items,
            outputs = stats.outputs,
            backups = stats.backups,
            backup_entries = stats.backup_entries,
            markers = stats.markers,
            stalls = stats.stalls,
            marker_round_trip_ms = task.flight.markers.mean().map_or(0.0, |d| d.as_secs_f64() * 1e3),
            rejected = stats.rejected,
            undecodable = task.batch.undecodable,
            "task stopped cleanly"
        );
    }
    match consumer.commit_consumer_state(CommitMode::Sync) {
        // Nothing stored since the last automatic commit.
        Ok(()) | Err(KafkaError::ConsumerCommit(RDKafkaErrorCode::NoOffset)) => {}
        Err(e) => return Err(ServiceError::Stop(format!("committing the group's offsets: {e}"))),
    }
    for producer in [&producer, &changelog_producer] {
        producer
            .flush(REQUEST_TIMEOUT)
            .map_err(|e| ServiceError::Stop(format!("flushing a producer: {e}")))?;
    }
    consumer.context().closing.store(true, Ordering::Relaxed);
    consumer.unsubscribe();
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backups_in_flight_are_reported_in_the_order_written() {
        let mut flight = Flight::default();
        for (seq, remaining) in [(1, 2), (3, 0), (5, 1)] {
            flight.backups.push_back(OpenBackup {
                seq,
                remaining,
                failed: false,
            });
        }
        flight.report_backups();
        assert!(
            flight.acks.is_empty(),
            "an empty backup waits for the one before it: an acknowledgement covers every backup before it"
        );
        flight.backup_record_done(5, true);
        assert!(flight.acks.is_empty(), "{:?}", flight.acks);
        flight.backup_record_done(1, false);
        flight.backup_record_done(1, false);
        assert_eq!(
            flight.acks,
            [Ack::BackupWritten(1), Ack::BackupWritten(3), Ack::BackupFailed(5)]
        );
        assert!(flight.backups.is_empty());
    }

    #[test]
    fn a_failing_broker_is_retried_with_a_doubling_backoff_that_resets_on_success() {
        let mut backoff = RetryBackoff::default();
        assert!(!backoff.holds(0));
        let mut now = 1_000;
        let mut waits = Vec::new();
        for _ in 0..8 {
            backoff.failed(now);
            assert!(backoff.holds(now));
            waits.push(backoff.until_ms - now);
            now = backoff.until_ms;
            assert!(!backoff.holds(now));
        }
        assert_eq!(waits, [100, 200, 400, 800, 1_600, 3_200, 5_000, 5_000]);
        backoff.succeeded();
        backoff.failed(now);
        assert_eq!(backoff.until_ms - now, 100, "a success starts the backoff over");
        // Failures reported together do not shorten a wait already running.
        let until = backoff.until_ms;
        backoff.failed(now - 50);
        assert!(backoff.until_ms >= until);
    }

    #[test]
    fn only_refusals_for_good_stop_the_service() {
        for code in [
            RDKafkaErrorCode::MessageSizeTooLarge,
            RDKafkaErrorCode::TopicAuthorizationFailed,
            RDKafkaErrorCode::UnknownTopic,
        ] {
            assert!(is_permanent(code), "{code:?}");
        }
        for code in [
            RDKafkaErrorCode::MessageTimedOut,
            RDKafkaErrorCode::AllBrokersDown,
            RDKafkaErrorCode::NotLeaderForPartition,
            RDKafkaErrorCode::Unknown,
        ] {
            assert!(!is_permanent(code), "{code:?}");
        }
    }
}
