//! The group listener: the consumer's context, which records rebalance
//! events (assigned, revoked, lost) and where each partition resumes, and
//! routes each assigned partition to a queue of its own.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::consumer::base_consumer::PartitionQueue;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext, RebalanceProtocol};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{BaseProducer, Producer};
use rdkafka::statistics::Statistics;
use rdkafka::types::RDKafkaRespErr;
use rdkafka::{ClientContext, Offset, TopicPartitionList};

use crate::core::fence::incarnation;
use crate::core::{BackupMarker, ControllerConfig, Mode, RecoveryPlan};
use crate::service::config::Config;
use crate::service::delivery::DeliveryReports;
use crate::service::kafka::{ChangelogLoader, REQUEST_TIMEOUT};
use crate::service::metrics::TaskMetrics;
use crate::service::store::{StoreMeta, TaskStore};
use crate::service::ServiceError;

use super::manager::Parked;
use super::restore::PlanInputs;
use super::{Assigned, LocalStores, REVOKE_FLUSH_TIMEOUT};

/// The longest a newly assigned partition waits for its previous owner to
/// stop writing its changelog (see `ChangelogLoader::settled_marker`).
pub(super) const HANDOFF_PATIENCE: Duration = Duration::from_secs(20);

/// The consumer's context: a rebalance decides each new partition's recovery
/// point (its local store, or the changelog's last marker) and sets it before
/// the partition is assigned, so no record is fetched from anywhere else; the
/// task streams the changelog into its state when it starts.
pub(super) struct GroupContext {
    pub(super) group: String,
    pub(super) input_topic: String,
    pub(super) loader: ChangelogLoader,
    pub(super) controller: ControllerConfig,
    pub(super) stores: Option<LocalStores>,
    pub(super) assigned: Mutex<Vec<Assigned>>,
    /// Partitions revoked while the loop is over: dropped at once.
    pub(super) revoked: Mutex<Vec<i32>>,
    /// Partitions lost (the group went on without this member): their tasks
    /// are kept (parked) in case the partitions come back.
    pub(super) lost: Mutex<Vec<i32>>,
    /// Where each parked task stopped, for a rebalance that gives its partition back.
    pub(super) parked: Mutex<HashMap<i32, Parked>>,
    /// Partitions given back whose parked task goes on (nothing else wrote
    /// their changelog meanwhile), with the input's end at the time.
    pub(super) regained: Mutex<Vec<(i32, u64)>>,
    /// Partitions revoked in a rebalance: handed off once their final backup is
    /// acknowledged, then released (`Revocation::release`).
    pub(super) revoking: Mutex<Option<Revocation>>,
    /// Set when the loop is over: a revocation then (leaving the group) is
    /// released at once, since no loop is left to hand the partitions off.
    pub(super) closing: AtomicBool,
    pub(super) failure: Mutex<Option<String>>,
    /// Flushed when partitions are revoked (see `rebalance`).
    pub(super) producers: [Arc<BaseProducer<DeliveryReports>>; 2],
    /// How long a changelog partition must stay unchanged before a task
    /// resumes from a marker that is not clean (`pipeline.handoff_quiet_ms`).
    pub(super) handoff_quiet: Duration,
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
        crate::service::metrics::brokers_up(&self.group, up);
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
        crate::service::metrics::broker_error("consumer", &error, reason);
    }
}

impl GroupContext {
    pub(super) fn new(
        config: &Config,
        loader: ChangelogLoader,
        controller: ControllerConfig,
        stores: Option<LocalStores>,
        producers: [Arc<BaseProducer<DeliveryReports>>; 2],
    ) -> Self {
        GroupContext {
            group: config.kafka.group_id.clone(),
            input_topic: config.pipeline.input_topic.clone(),
            loader,
            handoff_quiet: Duration::from_millis(config.pipeline.handoff_quiet_ms),
            controller,
            stores,
            assigned: Mutex::new(Vec::new()),
            revoked: Mutex::new(Vec::new()),
            lost: Mutex::new(Vec::new()),
            parked: Mutex::new(HashMap::new()),
            regained: Mutex::new(Vec::new()),
            revoking: Mutex::new(None),
            closing: AtomicBool::new(false),
            failure: Mutex::new(None),
            producers,
        }
    }

    pub(super) fn flush_producers(&self) {
        flush_producers(self.producers.iter().map(|p| &**p));
    }

    pub(super) fn fail(&self, message: String) {
        tracing::error!("{message}");
        if let Ok(mut failure) = self.failure.lock() {
            failure.get_or_insert(message);
        }
    }

    /// Where a parked task of `partition` goes on, if it may: nothing was
    /// written to its changelog since it was parked, and its last marker
    /// is of the task's incarnation (a member that stalled parks its task
    /// only once it wakes up, after the next owner wrote).
    pub(super) fn regain(&self, partition: i32) -> Result<Option<u64>, String> {
        let Some(parked) = self.parked.lock().ok().and_then(|mut p| p.remove(&partition)) else {
            return Ok(None);
        };
        let end = self.loader.end_offset(partition).map_err(|e| e.to_string())?;
        let own = |marker: Option<BackupMarker>| marker.is_none_or(|m| incarnation(m.seq) == parked.incarnation);
        if end == parked.changelog_end && own(self.loader.last_marker(partition).map_err(|e| e.to_string())?) {
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
    pub(super) fn settled_markers(&self, partitions: &[i32]) -> Result<Vec<Option<BackupMarker>>, String> {
        self.loader
            .settled_markers(partitions, self.handoff_quiet, HANDOFF_PATIENCE)
            .map_err(|e| e.to_string())
    }

    pub(super) fn prepare(&self, consumer: &BaseConsumer<Self>, tpl: &mut TopicPartitionList) -> Result<(), String> {
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
                Some(OpenedStore::Usable { store, meta }) => (
                    marker.filter(|_| self.controller.mode != Mode::None),
                    Some((store, meta)),
                    true,
                ),
                Some(OpenedStore::Fresh(store)) => (marker, Some((store, TaskStore::new_meta(0))), false),
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
            let (plan, inputs) = match &store {
                Some((_, meta)) if local => (
                    RecoveryPlan::local(
                        &meta.checkpoint,
                        marker.as_ref(),
                        self.controller.policy.for_failures(0).max_unacked,
                    ),
                    None,
                ),
                _ => {
                    let inputs = PlanInputs {
                        mode: self.controller.mode,
                        committed,
                        constants: self.controller.constants,
                        marker,
                    };
                    (inputs.decide(), Some(inputs))
                }
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
                inputs,
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
    pub(super) fn open_store(
        &self,
        stores: &LocalStores,
        partition: i32,
        marker: Option<&BackupMarker>,
    ) -> Result<OpenedStore, String> {
        let path = stores.root.join(format!("{}-{partition}", self.input_topic));
        let (store, meta) = TaskStore::open(&path, stores.budget).map_err(|e| e.to_string())?;
        let Some(meta) = meta else {
            return Ok(OpenedStore::Fresh(store));
        };
        let refused = if !meta.trusted_after_crash() {
            "the machine restarted since its last write"
        } else if self.controller.mode == Mode::None || marker.map(|m| m.writer) == Some(meta.store_id) {
            return Ok(OpenedStore::Usable { store, meta });
        } else {
            "the changelog's last marker is not this store's (the partition moved, or the store is older)"
        };
        tracing::info!(partition, path = %path.display(), reason = refused, "local store not used; restoring from the changelog");
        drop(store);
        let store = TaskStore::recreate(&path, stores.budget).map_err(|e| e.to_string())?;
        Ok(OpenedStore::Fresh(store))
    }
}

/// Marks the group context closing when dropped.
pub(super) struct ClosingGuard<'a>(pub(super) &'a AtomicBool);

impl Drop for ClosingGuard<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Partitions revoked by a rebalance, waiting for their tasks' clean stop.
pub(super) struct Revocation {
    pub(super) tpl: TopicPartitionList,
    pub(super) cooperative: bool,
}

impl Revocation {
    pub(super) fn partitions(&self) -> Vec<i32> {
        partition_list(&self.tpl)
    }

    /// Joins a later revocation's partitions to this one.
    pub(super) fn add(&mut self, tpl: &TopicPartitionList) {
        for element in tpl.elements() {
            let _ = self
                .tpl
                .add_partition_offset(element.topic(), element.partition(), element.offset());
        }
    }

    /// Gives the partitions back to the group.
    pub(super) fn release(&self, consumer: &BaseConsumer<GroupContext>) -> Result<(), KafkaError> {
        if self.cooperative {
            consumer.incremental_unassign(&self.tpl)
        } else {
            consumer.unassign()
        }
    }
}

/// What a partition's local store offers a starting task.
pub(super) enum OpenedStore {
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
                    let cooperative = matches!(consumer.rebalance_protocol(), RebalanceProtocol::Cooperative);
                    match revoking.as_mut() {
                        Some(pending) => pending.add(tpl),
                        None => {
                            *revoking = Some(Revocation {
                                tpl: tpl.clone(),
                                cooperative,
                            })
                        }
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
pub(super) fn own_queue(
    consumer: &Arc<BaseConsumer<GroupContext>>,
    topic: &str,
    partition: i32,
    offset: u64,
) -> Result<PartitionQueue<GroupContext>, ServiceError> {
    let queue = consumer
        .split_partition_queue(topic, partition)
        .ok_or_else(|| ServiceError::Unsupported(format!("no queue for input partition {partition}")))?;
    seek(consumer, topic, partition, offset)?;
    Ok(queue)
}

/// Restarts the partition's fetch at `offset`; what was fetched before is
/// dropped (the seek's version barrier).
pub(super) fn seek(
    consumer: &Arc<BaseConsumer<GroupContext>>,
    topic: &str,
    partition: i32,
    offset: u64,
) -> Result<(), ServiceError> {
    consumer
        .seek(topic, partition, Offset::Offset(offset as i64), REQUEST_TIMEOUT)
        .map_err(|e| ServiceError::Task {
            partition,
            message: format!("restarting the fetch at offset {offset}: {e}"),
        })
}

/// Waits, up to [`REVOKE_FLUSH_TIMEOUT`] each, for the producers' records in
/// flight before partitions change hands.
pub(super) fn flush_producers<'a>(producers: impl IntoIterator<Item = &'a BaseProducer<DeliveryReports>>) {
    for producer in producers {
        if let Err(error) = producer.flush(REVOKE_FLUSH_TIMEOUT) {
            tracing::warn!(
                %error, in_flight = producer.in_flight_count(),
                "records still in flight when partitions were revoked; the next owner may read the changelog before they land"
            );
        }
    }
}

/// The partition numbers of a rebalance's list, for the log.
pub(super) fn partition_list(tpl: &TopicPartitionList) -> Vec<i32> {
    tpl.elements().iter().map(|e| e.partition()).collect()
}
