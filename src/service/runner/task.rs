//! One task: an operator on one input partition, its driver, its input
//! batch and what it has in flight; started from a restore or a local store,
//! stepped by the loop, stopped cleanly.

use std::marker::PhantomData;
use std::time::Duration;

use rdkafka::consumer::base_consumer::PartitionQueue;
use rdkafka::error::KafkaError;
use rdkafka::producer::Producer;

use crate::core::{Ack, Blocked, ControllerConfig, DriverStats, Mode, ResumeSource, TaskDriver};
use crate::service::codec::{Codec, ServiceOperator};
use crate::service::delivery::{is_permanent, Delivery, DeliveryEvent, TaskIncarnation};
use crate::service::metrics::{TaskMetrics, TaskPosition};
use crate::service::store::{StoreMeta, TaskStore};
use crate::service::ServiceError;

use super::collector::{is_queue_full, resend, send_failure, send_to_changelog, InFlight, KafkaIo, OutputPositions};
#[cfg(feature = "fault-injection")]
use super::faults::FAULT_SKIP_BACKUPS;
use super::group::{own_queue, GroupContext};
use super::input::{InputBatch, RawRecords};
use super::manager::{ManagedTask, TaskView};
use super::restore::Restored;
use super::{TaskEnv, TaskReport, POLL_BATCH};

/// A task that backs up starts with a marker, and the group's offset follows
/// acknowledged markers: a committed offset with no marker in the changelog
/// means the changelog lost its records (deleted, a `delete` cleanup policy,
/// a `changelog_topic` renamed). The task goes on from that offset with an
/// empty state, so the state of the input before it is lost: an error and a
/// metric, not a clean start.
fn report_lost_state(shared: &TaskEnv<'_>, partition: i32, committed: u64) {
    tracing::error!(
        partition,
        committed,
        changelog = %shared.topics.changelog,
        "the changelog holds no marker, yet the group committed offset {committed}: the state of the input \
         before it is lost (records deleted, a cleanup.policy that deletes, or a changelog_topic renamed); \
         the task goes on from that offset with an empty state"
    );
    TaskMetrics::state_lost(&shared.group, partition);
}

/// A previous owner's records that landed after a newer owner started were
/// left out of the restore ([`crate::core::fence`]): the partition had two
/// writers for a while. What they overwrote may be lost if compaction ran
/// since, so it is an error and a metric.
fn report_fenced(shared: &TaskEnv<'_>, partition: i32, fenced: u64) {
    tracing::error!(
        partition,
        fenced,
        changelog = %shared.topics.changelog,
        "the changelog holds {fenced} records a previous owner wrote after a newer owner of the partition \
         had started (a member that stalled past its session, or a revoked task's late writes); they are \
         left out and their keys written again"
    );
    TaskMetrics::fenced(&shared.group, partition, fenced);
}

/// One operator on one input partition.
pub(super) struct Task<O: ServiceOperator> {
    pub(super) partition: i32,
    /// This run of the task: the delivery reports of its records name it.
    pub(super) incarnation: TaskIncarnation,
    pub(super) driver: TaskDriver<O>,
    pub(super) queue: PartitionQueue<GroupContext>,
    pub(super) batch: InputBatch<O>,
    pub(super) end: u64,
    pub(super) in_flight: InFlight,
    pub(super) key: Vec<u8>,
    pub(super) value: Vec<u8>,
    pub(super) metrics: TaskMetrics,
    /// The driver's figures when the clean stop began.
    pub(super) before_stop: Option<DriverStats>,
    /// When the task took its first item, on the run's clock.
    pub(super) first_input_ms: Option<u64>,
    /// The local store and the meta record each write carries.
    pub(super) store: Option<(TaskStore, StoreMeta)>,
}

impl<O: ServiceOperator> Task<O> {
    pub(super) fn io<'a>(
        shared: &'a TaskEnv<'a>,
        (partition, incarnation): (i32, TaskIncarnation),
        in_flight: &'a mut InFlight,
        key: &'a mut Vec<u8>,
        value: &'a mut Vec<u8>,
        records: RawRecords<'a>,
    ) -> KafkaIo<'a, O> {
        KafkaIo {
            shared,
            partition,
            incarnation,
            in_flight,
            key,
            value,
            records,
            operator: PhantomData,
        }
    }

    /// Starts the task's driver on its restored state.
    pub(super) fn start(
        shared: &TaskEnv<'_>,
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
            fenced,
        } = restored;
        let partition = assigned.partition;
        let restore_error = |source| ServiceError::Restore { partition, source };
        let controller = match &assigned.store {
            Some((_, meta)) => controller.with_writer(meta.store_id),
            None => controller,
        };
        let plan = assigned.plan;
        if controller.mode != Mode::None && plan.source == ResumeSource::Committed {
            report_lost_state(shared, partition, plan.resume_offset);
        }
        if fenced > 0 {
            report_fenced(shared, partition, fenced);
        }
        let mut in_flight = InFlight {
            positions: OutputPositions::new(&shared.group, &shared.topics.input, partition),
            ..InFlight::default()
        };
        let (mut key, mut value) = (Vec::new(), Vec::new());
        let incarnation = shared.next_incarnation();
        let mut io = Self::io(
            shared,
            (partition, incarnation),
            &mut in_flight,
            &mut key,
            &mut value,
            RawRecords::NONE,
        );
        let mut driver =
            TaskDriver::start(controller, operator, &plan, rolled_back, now_ms, &mut io).map_err(restore_error)?;
        if assigned.store.is_some() {
            // A store is written after every poll batch; while a write is
            // held, input waits, so a restart on it repeats one batch at most.
            driver.write_store_every(POLL_BATCH as u64);
        }
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
                bound_lost_outputs = plan.introduced.lost_outputs,
                theta = thresholds.theta,
                max_uncovered = thresholds.max_uncovered,
                max_unacked = thresholds.max_unacked,
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
                max_uncovered = thresholds.max_uncovered,
                max_unacked = thresholds.max_unacked,
                "task started",
            );
        }
        Ok(Task {
            partition: assigned.partition,
            incarnation,
            driver,
            queue,
            batch: InputBatch::new(plan.resume_offset),
            end: assigned.end,
            in_flight,
            key,
            value,
            metrics: TaskMetrics::new(&shared.group, assigned.partition),
            before_stop: None,
            first_input_ms: None,
            store: assigned.store,
        })
    }

    /// Sends the changelog records waiting, in order, without waiting on the
    /// producer: on a full queue the rest wait for the next round, in order.
    /// A record the producer refuses fails with every record behind it, as a
    /// gapless log fails every write behind a failed one: no marker may land
    /// over a backup record that did not.
    fn send_changelog(&mut self, shared: &TaskEnv<'_>) {
        let mut waiting = std::mem::take(&mut self.in_flight.changelog).into_iter();
        let mut refused: Option<KafkaError> = None;
        let mut after_entries = false;
        while let Some((entry, delivery)) = waiting.next() {
            if refused.is_none() {
                if after_entries && matches!(delivery, Delivery::Marker { .. }) {
                    shared.backup_entries_sent(self.partition);
                }
                after_entries = matches!(delivery, Delivery::BackupRecord { .. });
                match send_to_changelog(shared, self.partition, &entry, delivery) {
                    Ok(()) => {
                        if let Delivery::Marker { seq, .. } = delivery {
                            self.in_flight.markers.sent(seq);
                        }
                        continue;
                    }
                    Err(error) if is_queue_full(&error) => {
                        self.in_flight.changelog = std::iter::once((entry, delivery)).chain(waiting).collect();
                        return;
                    }
                    Err(error) => {
                        if let KafkaError::MessageProduction(code) = &error {
                            if is_permanent(*code) {
                                self.in_flight.fatal.get_or_insert(format!(
                                    "the changelog {} refused a record of partition {} ({} bytes): {error}",
                                    shared.topics.changelog,
                                    self.partition,
                                    entry.encoded_len()
                                ));
                            }
                        }
                        refused = Some(error);
                    }
                }
            }
            let error = refused.as_ref().map_or_else(String::new, ToString::to_string);
            match delivery {
                Delivery::Marker { seq, .. } => {
                    tracing::warn!(partition = self.partition, seq, %error, "marker not sent; it is retried");
                    self.in_flight.acks.push(Ack::MarkerFailed(seq));
                }
                Delivery::BackupRecord { seq, .. } => {
                    tracing::warn!(partition = self.partition, seq, %error, "backup record not sent; the backup is retried");
                    self.in_flight.backup_record_done(seq, true);
                }
                Delivery::Output { .. } | Delivery::DeadLetter { .. } => {}
            }
        }
    }

    /// Delivers the acknowledgements the I/O produced itself, until none is left.
    pub(super) fn apply_immediate_acks(&mut self, shared: &TaskEnv<'_>) -> bool {
        let mut worked = false;
        while !self.in_flight.acks.is_empty() {
            worked = true;
            let acks = std::mem::take(&mut self.in_flight.acks);
            for ack in acks {
                self.acknowledge(shared, ack);
            }
        }
        worked
    }

    pub(super) fn acknowledge(&mut self, shared: &TaskEnv<'_>, ack: Ack) {
        // A backup's outcome moves the state's baseline, which the store keeps.
        self.in_flight.unwritten |= matches!(ack, Ack::BackupWritten(_) | Ack::BackupFailed(_));
        let mut io = Self::io(
            shared,
            (self.partition, self.incarnation),
            &mut self.in_flight,
            &mut self.key,
            &mut self.value,
            RawRecords::NONE,
        );
        self.driver.acknowledge(ack, &mut io);
    }

    /// The task's figures at the end of the run, logged.
    pub(super) fn final_report(&mut self) -> TaskReport {
        self.publish();
        let stats = self.driver.stats();
        tracing::info!(
            partition = self.partition,
            items = stats.items,
            outputs = stats.outputs,
            backups = stats.backups,
            backup_entries = stats.backup_entries,
            markers = stats.markers,
            stalls = stats.stalls,
            marker_round_trip_ms = self.in_flight.markers.mean().map_or(0.0, |d| d.as_secs_f64() * 1e3),
            rejected = stats.rejected,
            undecodable = self.batch.undecodable,
            repeats_skipped = stats.repeats,
            "task stopped cleanly"
        );
        TaskReport {
            partition: self.partition,
            stats,
            before_stop: self.before_stop.unwrap_or(stats),
            first_input_ms: self.first_input_ms,
            markers: self.in_flight.markers.clone(),
            undecodable: self.batch.undecodable,
        }
    }

    /// Brings the task's metrics up to date.
    pub(super) fn publish(&mut self) {
        let controller = self.driver.controller();
        let position = TaskPosition {
            divergence: self.driver.operator().divergence(),
            thresholds: controller.thresholds(),
            items_past_marker: controller.items_past_marker(),
            unacknowledged_outputs: controller.unacknowledged_outputs(),
            failures: controller.failures(),
            marker_round_trips: (self.in_flight.markers.acknowledged, self.in_flight.markers.total),
        };
        self.metrics
            .publish(self.driver.stats(), self.batch.undecodable, &position);
    }

    /// Hands the operator a record of the feedback topic; one that does not
    /// decode is skipped with a warning (the next one supersedes it).
    pub(super) fn feedback(&mut self, shared: &TaskEnv<'_>, codec: &Codec, value: &[u8]) {
        let mut io = Self::io(
            shared,
            (self.partition, self.incarnation),
            &mut self.in_flight,
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
}

impl<O: ServiceOperator> TaskView for Task<O> {
    fn partition(&self) -> i32 {
        self.partition
    }

    fn incarnation(&self) -> TaskIncarnation {
        self.incarnation
    }

    fn is_stopped(&self) -> bool {
        self.driver.is_stopped()
    }

    fn at_end(&self) -> bool {
        self.batch.is_drained() && self.batch.next_offset >= self.end
    }

    /// Input is at hand but waits on an acknowledgement (the outputs, the
    /// start marker).
    fn awaits_acknowledgement(&self) -> bool {
        !self.batch.is_drained() && matches!(self.driver.readiness(), Err(Blocked::Outputs | Blocked::StartMarker))
    }

    fn unacknowledged_outputs(&self) -> u64 {
        self.driver.controller().unacknowledged_outputs()
    }

    fn next_offset(&self) -> u64 {
        self.driver.controller().processed().offset
    }

    /// A task on a local store restarts on it exactly anyway.
    fn parkable(&self) -> bool {
        self.store.is_none() && !self.driver.is_stopped()
    }

    fn changelog_incarnation(&self) -> u64 {
        crate::core::fence::incarnation(self.driver.controller().next_seq())
    }

    fn take_fatal(&mut self) -> Option<String> {
        self.in_flight.fatal.take()
    }
}

impl<O: ServiceOperator> ManagedTask<TaskEnv<'_>> for Task<O> {
    /// Takes input until the driver must wait; returns whether anything happened.
    fn step(&mut self, shared: &TaskEnv<'_>, now_ms: u64, stopping: bool) -> bool {
        let mut worked = self.apply_immediate_acks(shared);
        if stopping || self.driver.is_stopped() {
            return worked;
        }
        let batch = &mut self.batch;
        if batch.is_drained() {
            batch.clear();
            while batch.filled < POLL_BATCH {
                match self.queue.poll(Duration::ZERO) {
                    Some(Ok(message)) => {
                        batch.accept(shared.codec, &message);
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
            (self.partition, self.incarnation),
            &mut self.in_flight,
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
                match self.driver.process(batch.items(batch.taken, run_end), now_ms, &mut io) {
                    Ok(taken) => taken,
                    Err(error) => {
                        io.in_flight
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
            if taken > 0 {
                self.first_input_ms.get_or_insert(now_ms);
            }
            worked |= taken > 0;
            io.in_flight.unwritten |= taken > 0;
            if batch.taken < run_end || taken == 0 {
                tracing::trace!(partition = self.partition, blocked = ?self.driver.readiness(), "input waits");
                break;
            }
        }
        self.driver.tick(now_ms, &mut io);
        worked |= self.apply_immediate_acks(shared);
        if worked {
            self.publish();
        }
        worked
    }

    /// Writes the state changes to the local store (with the offset they are
    /// exact at), then sends the changelog records held for that write; sends
    /// failed outputs and dead letters again. Nothing goes out while a failed
    /// delivery's backoff lasts.
    fn flush(&mut self, shared: &TaskEnv<'_>, now_ms: u64) -> bool {
        if self.in_flight.retry.holds(now_ms) {
            return false;
        }
        let resent = !self.in_flight.resend.is_empty();
        for (delivery, failed) in std::mem::take(&mut self.in_flight.resend) {
            if self.in_flight.fatal.is_some() {
                break;
            }
            if let Err(error) = resend(shared.producer, delivery, &failed) {
                self.in_flight.fatal.get_or_insert(format!(
                    "sending a record to {} again: {}",
                    failed.topic,
                    send_failure(&error)
                ));
            }
        }
        if self.in_flight.changelog.is_empty() && !self.in_flight.unwritten {
            return resent;
        }
        if self.store.is_some() && self.in_flight.dead_letters_in_flight > 0 {
            // The store write (and the changelog records that wait for it)
            // waits for the dead letters' acknowledgements.
            return resent;
        }
        if let Some((store, meta)) = &mut self.store {
            self.driver.stage_state();
            self.driver.checkpoint(&mut meta.checkpoint);
            if let Err(error) = store.write(meta) {
                self.in_flight.fatal.get_or_insert(error.to_string());
                return true;
            }
            self.driver.state_durable();
        }
        self.in_flight.unwritten = false;
        self.send_changelog(shared);
        true
    }

    fn delivered(&mut self, shared: &TaskEnv<'_>, mut event: DeliveryEvent, now_ms: u64) {
        event.delivery = event.delivery.in_incarnation_of(self.driver.controller().next_seq());
        let changelog = matches!(event.delivery, Delivery::BackupRecord { .. } | Delivery::Marker { .. });
        if changelog && event.failure.is_some() {
            if let Some((code, reason)) = shared.changelog_producer.client().fatal_error() {
                // No record may land behind the failed one: the producer stopped.
                self.in_flight.fatal.get_or_insert(format!(
                    "the changelog's producer stopped ({code:?}: {reason}); a restart recovers from the last \
                     marker in {}",
                    shared.topics.changelog
                ));
                return;
            }
        }
        match &event.failure {
            None => self.in_flight.retry.succeeded(),
            Some(failed) if failed.code.is_some_and(is_permanent) => {
                self.in_flight.fatal.get_or_insert(format!(
                    "the broker refuses a record for {} for good (input partition {}): {}",
                    failed.topic, self.partition, failed.error
                ));
                return;
            }
            Some(_) => self.in_flight.retry.failed(now_ms),
        }
        match (event.delivery, event.failure) {
            (delivery @ (Delivery::Output { offset, .. } | Delivery::DeadLetter { offset, .. }), None) => {
                if matches!(delivery, Delivery::Output { .. }) {
                    self.metrics.outputs_acknowledged(1);
                } else {
                    self.metrics.dead_letters_acknowledged(1);
                    self.in_flight.dead_letters_in_flight = self.in_flight.dead_letters_in_flight.saturating_sub(1);
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
                self.in_flight.resend.push((delivery, failed));
            }
            (Delivery::BackupRecord { seq, .. }, failure) => {
                if let Some(failed) = &failure {
                    tracing::warn!(partition = self.partition, seq, error = %failed.error, "backup record not delivered; the backup is retried");
                }
                self.in_flight.backup_record_done(seq, failure.is_some());
            }
            (Delivery::Marker { seq, .. }, None) => {
                self.in_flight.markers.done(seq, true);
                self.acknowledge(shared, Ack::MarkerWritten(seq))
            }
            (Delivery::Marker { seq, .. }, Some(failed)) => {
                self.in_flight.markers.done(seq, false);
                tracing::warn!(partition = self.partition, seq, error = %failed.error, "marker not delivered; it is retried");
                self.acknowledge(shared, Ack::MarkerFailed(seq));
            }
        }
        self.apply_immediate_acks(shared);
    }

    fn begin_stop(&mut self, shared: &TaskEnv<'_>) {
        self.before_stop = Some(self.driver.stats());
        let mut io = Self::io(
            shared,
            (self.partition, self.incarnation),
            &mut self.in_flight,
            &mut self.key,
            &mut self.value,
            RawRecords::NONE,
        );
        self.driver.begin_stop(&mut io);
        self.apply_immediate_acks(shared);
    }
    fn resume(&mut self, shared: &TaskEnv<'_>, end: u64) -> Result<(), ServiceError> {
        let next_offset = self.next_offset();
        self.queue = own_queue(shared.consumer, &shared.topics.input, self.partition, next_offset)?;
        self.batch = InputBatch::new(next_offset);
        self.end = end;
        Ok(())
    }
}
