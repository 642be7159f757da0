//! The group listener: the consumer's context, which records rebalance
//! events (assigned, revoked, lost) and where each partition resumes, and
//! routes each assigned partition to a queue of its own.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use rdkafka::consumer::base_consumer::PartitionQueue;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext, RebalanceProtocol};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{BaseProducer, Producer};
use rdkafka::statistics::Statistics;
use rdkafka::types::RDKafkaRespErr;
use rdkafka::{ClientContext, Offset, TopicPartitionList};

use crate::core::fence::incarnation;
use crate::core::BackupMarker;
use crate::service::config::Config;
use crate::service::delivery::DeliveryReports;
use crate::service::kafka::{ChangelogLoader, REQUEST_TIMEOUT};
use crate::service::metrics::TaskMetrics;
use crate::service::ServiceError;

use super::manager::Parked;
use super::resume::{Assignment, ResumePlanner};
use super::REVOKE_FLUSH_TIMEOUT;

/// The consumer's context: a rebalance records each new partition for the
/// loop, which decides where it resumes and restores it off the poll
/// ([`super::resume`], [`super::restore`]); a partition given back to its
/// kept task is assigned where that task goes on.
pub(super) struct GroupContext {
    pub(super) group: String,
    pub(super) input_topic: String,
    pub(super) loader: ChangelogLoader,
    /// Partitions assigned, for the loop to restore (regained ones apart).
    pub(super) assigned: Mutex<Vec<Assignment>>,
    /// Where an assigned partition is fetched from until its restore decides.
    pub(super) planner: ResumePlanner,
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
        planner: ResumePlanner,
        producers: [Arc<BaseProducer<DeliveryReports>>; 2],
    ) -> Self {
        GroupContext {
            group: config.kafka.group_id.clone(),
            input_topic: config.pipeline.input_topic.clone(),
            loader,
            assigned: Mutex::new(Vec::new()),
            planner,
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

    /// Records the partitions a rebalance assigned and assigns them: a
    /// parked task's partition at the offset its task goes on from, any
    /// other at the offset it would resume from with no marker (its restore
    /// decides the real one and moves the fetch, [`super::resume`]). Only
    /// quick requests here: the callback runs inside the consumer's poll.
    pub(super) fn prepare(&self, consumer: &BaseConsumer<Self>, tpl: &mut TopicPartitionList) -> Result<(), String> {
        let committed = consumer
            .committed_offsets(tpl.clone(), REQUEST_TIMEOUT)
            .map_err(|e| format!("reading the group's committed offsets: {e}"))?;
        let partitions: Vec<i32> = tpl
            .elements_for_topic(&self.input_topic)
            .iter()
            .map(|e| e.partition())
            .collect();
        let mut assignments = Vec::with_capacity(partitions.len());
        for partition in partitions {
            let at = Instant::now();
            let (_, end) = consumer
                .fetch_watermarks(&self.input_topic, partition, REQUEST_TIMEOUT)
                .map_err(|e| format!("input partition {partition}: {e}"))?;
            let end = end.max(0) as u64;
            if let Some(resume) = self.regain(partition)? {
                tpl.set_partition_offset(&self.input_topic, partition, Offset::Offset(resume as i64))
                    .map_err(|e| format!("input partition {partition}: {e}"))?;
                if let Ok(mut regained) = self.regained.lock() {
                    regained.push((partition, end));
                }
                continue;
            }
            let committed = match committed
                .find_partition(&self.input_topic, partition)
                .map(|e| e.offset())
            {
                Some(Offset::Offset(offset)) if offset >= 0 => Some(offset as u64),
                _ => None,
            };
            let fetch_from = self.planner.provisional_offset(committed);
            tpl.set_partition_offset(&self.input_topic, partition, Offset::Offset(fetch_from as i64))
                .map_err(|e| format!("input partition {partition}: {e}"))?;
            assignments.push(Assignment {
                partition,
                end,
                committed,
                fetch_from,
                at,
            });
        }
        let assign = match consumer.rebalance_protocol() {
            RebalanceProtocol::Cooperative => consumer.incremental_assign(tpl),
            _ => consumer.assign(tpl),
        };
        assign.map_err(|e| format!("assigning partitions: {e}"))?;
        if let Ok(mut queue) = self.assigned.lock() {
            queue.extend(assignments);
        }
        Ok(())
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
