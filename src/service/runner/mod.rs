//! `afstream run`: one consumer in the group, one task per assigned partition,
//! each a [`TaskDriver`] whose I/O produces outputs, backups and markers and
//! stores offsets. Every decision is the core's; this module moves records and
//! acknowledgements between Kafka and the drivers, split the way Kafka
//! Streams splits its runtime:
//!
//! * `group`: the rebalance listener (the consumer's context), which records
//!   assignments, revocations and losses and where each partition resumes;
//! * `restore`: changelogs read into fresh operators, several side by side;
//! * `manager`: the task manager, the set of tasks (active, parked, handing
//!   off, stopping) and what rebalances, reports and the stop do to it;
//! * `task`: one operator on one partition, started, stepped and stopped;
//! * `input`: a task's batch of polled records, decoded;
//! * `collector`: the record collector, the Kafka `TaskIo` of a task and the
//!   only code that sends records, with what is in flight;
//! * `feedback`: a distributed learner's global models;
//! * `faults`: the fault switches tests set;
//! * this module: the setup (`run_pipeline`) and the loop (`run_rounds`);
//!   every client is made in `crate::service::clients`.

mod collector;
mod faults;
mod feedback;
mod group;
mod idle;
mod input;
mod manager;
mod restore;
mod resume;
mod task;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::consumer::base_consumer::PartitionQueue;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::Message;
use rdkafka::producer::{BaseProducer, Producer};

use super::check::TaskPlan;
use super::clients::{group_consumer, TaskProducers};
use super::codec::{Codec, ServiceOperator};
use super::config::{Config, KafkaConfig};
use super::delivery::{DeliveryEvent, DeliveryReports, TaskIncarnation};
use super::kafka::{
    ensure_topics, partition_count, patiently, ChangelogLoader, KafkaSetupError, ReaderPool, TopicSpec, REQUEST_TIMEOUT,
};
use super::state::lock_state_dir;
use super::store::{StoreMeta, TaskStore};
use super::ServiceError;
use crate::core::{ControllerConfig, DriverStats, Mode, RecoveryPlan};

use collector::MarkerRoundTrips;
use faults::crash_in_backup;
pub use faults::*;
use feedback::FeedbackReader;
use group::{flush_producers, own_queue, seek, ClosingGuard, GroupContext, Revocation};
use idle::IdleBackoff;
use manager::{Producers, StopProgress, TaskManager};
use restore::{PlanInputs, Restores, RESTORE_PARALLELISM};
use resume::{LocalStores, ResumePlanner};
use task::Task;

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
/// The headers of a dead letter: where its record came from and why it was refused.
pub const DEAD_LETTER_TOPIC_HEADER: &str = "afstream.source.topic";
pub const DEAD_LETTER_PARTITION_HEADER: &str = "afstream.source.partition";
pub const DEAD_LETTER_OFFSET_HEADER: &str = "afstream.source.offset";
pub const DEAD_LETTER_REASON_HEADER: &str = "afstream.reason";
/// The header of an output that names its source position, so a downstream
/// stage skips what an upstream replay sends again (`crate::core::sources`).
pub const SOURCE_POSITION_HEADER: &str = "afstream.position";
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
    /// From the first item a task took to the start of the clean stop: the
    /// processing time, without joining the group, restoring or starting.
    pub processing: Duration,
    /// From the first task's start (its restore done) to the first item a
    /// task took: a one-off per start, the start marker's round trip where
    /// there is one (a task takes no input before it is acknowledged) or the
    /// first fetch.
    pub starting: Duration,
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
    /// When the task took its first item, on the run's clock.
    pub first_input_ms: Option<u64>,
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
    /// What a plan to restore from the changelog was decided from.
    inputs: Option<PlanInputs>,
}

impl Topics {
    fn of(config: &Config) -> Self {
        let pipeline = &config.pipeline;
        let group = &config.kafka.group_id;
        Topics {
            input: pipeline.input_topic.clone(),
            output: pipeline.output_topic.clone(),
            changelog: pipeline.changelog_topic(group),
            dead_letters: pipeline.dead_letter_topic(group),
        }
    }
}

/// Checks the input topic and creates the others where missing; the
/// input's partition count.
fn prepare_topics<O: ServiceOperator>(
    kafka: &KafkaConfig,
    topics: &Topics,
    operator_config: &O::Config,
    stop: &AtomicBool,
) -> Result<usize, ServiceError> {
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
    Ok(partitions)
}

/// Starts the tasks of newly assigned partitions: their changelogs restored
/// side by side, then each started on its own partition queue.
struct TaskStarter<'a, O: ServiceOperator> {
    operator_config: &'a O::Config,
    controller: ControllerConfig,
    readers: Arc<ReaderPool>,
    /// Decides where each assigned partition resumes, on the restore thread.
    planner: ResumePlanner,
    resident_keys: usize,
    restores: Restores<O>,
    /// The queue split off for each partition that restores, and the
    /// offset its fetch started at (the consumer fetches while it restores).
    queues: HashMap<i32, (PartitionQueue<GroupContext>, u64)>,
}

impl<O: ServiceOperator> TaskStarter<'_, O> {
    /// Starts restoring the partitions assigned since the last round, off
    /// the loop, and starts the tasks whose restore is done.
    fn start(
        &mut self,
        shared: &TaskEnv<'_>,
        manager: &mut TaskManager<Task<O>>,
        feedback: Option<&FeedbackReader>,
        started: Instant,
        now_ms: u64,
    ) -> Result<bool, ServiceError> {
        let context = shared.consumer.context();
        let batch = take_recorded(&context.assigned);
        let assigned = !batch.is_empty();
        if assigned {
            for assignment in &batch {
                let partition = assignment.partition;
                // Where it resumes is decided beside its restore: the fetch
                // starts where it would with no marker, and moves if not.
                let offset = assignment.fetch_from;
                // A partition assigned again while it restored: the new queue.
                self.queues.remove(&partition);
                let queue = own_queue(shared.consumer, &shared.topics.input, partition, offset)?;
                self.queues.insert(partition, (queue, offset));
            }
            self.restores.spawn(
                &self.readers,
                &self.planner,
                self.operator_config,
                batch,
                self.resident_keys,
            )?;
        }
        let restored = self.restores.finished()?;
        let worked = assigned || !restored.is_empty();
        for restored in restored {
            let partition = restored.assigned.partition;
            let Some((queue, fetching_from)) = self.queues.remove(&partition) else {
                continue;
            };
            let resume = restored.assigned.plan.resume_offset;
            if resume != fetching_from {
                // A marker, a local store, or a marker the full read decided again from.
                seek(shared.consumer, &shared.topics.input, partition, resume)?;
            }
            let started_ms = started.elapsed().as_millis() as u64;
            let mut task = Task::start(shared, self.controller, restored, queue, started_ms)?;
            if let Some((reader, latest)) = feedback.and_then(|r| r.latest.as_ref().map(|l| (r, l))) {
                // The latest global model, as a restarted worker must take it in again.
                task.feedback(shared, &reader.codec, latest);
            }
            // Processing time counts from the round of the first assignment:
            // the consumer fetches from then on, while the task restores.
            manager.assigned(shared, task, now_ms);
        }
        Ok(worked)
    }

    /// Partitions revoked or lost: a restore of theirs still running is
    /// dropped when it is done.
    fn cancel(&mut self, partitions: &[i32]) {
        self.restores.cancel(partitions);
        for partition in partitions {
            self.queues.remove(partition);
        }
    }
}

/// What every task shares: the clients and the topics.
struct TaskEnv<'a> {
    group: String,
    producer: &'a BaseProducer<DeliveryReports>,
    changelog_producer: &'a BaseProducer<DeliveryReports>,
    consumer: &'a Arc<BaseConsumer<GroupContext>>,
    topics: &'a Topics,
    /// How records are read and written.
    codec: &'a Codec,
    /// [`CRASH_IN_BACKUP`], and the backups with entries sent so far.
    crash_in_backup: Option<u64>,
    backups_sent: std::cell::Cell<u64>,
    /// The incarnation the last task start got.
    incarnation: std::cell::Cell<TaskIncarnation>,
    /// Outputs carry their source positions (`Config::source_positions`).
    source_positions: bool,
}

impl TaskEnv<'_> {
    /// A new task incarnation, for a task starting now.
    fn next_incarnation(&self) -> TaskIncarnation {
        let next = self.incarnation.get().next();
        self.incarnation.set(next);
        next
    }

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

impl Producers for TaskEnv<'_> {
    fn reports(&self, into: &mut Vec<DeliveryEvent>) {
        for producer in [self.producer, self.changelog_producer] {
            producer.poll(Duration::ZERO);
            producer.context().drain_into(into);
        }
    }

    fn flush(&self) {
        flush_producers([self.producer, self.changelog_producer]);
    }
}

/// Takes what the group listener recorded in `list`.
fn take_recorded<T: Default>(list: &Mutex<T>) -> T {
    list.lock().map(|mut l| std::mem::take(&mut *l)).unwrap_or_default()
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
    let topics = Topics::of(config);
    let codec = Codec::new::<O>(pipeline).map_err(ServiceError::Unsupported)?;
    let crash_in_backup = crash_in_backup()?;
    let _state_lock = match &pipeline.state_dir {
        Some(dir) => Some(lock_state_dir(dir, &kafka.group_id)?),
        None => None,
    };
    let partitions = prepare_topics::<O>(kafka, &topics, operator_config, stop)?;
    let mut feedback = FeedbackReader::open::<O>(config, stop)?;
    let plan = TaskPlan::new::<O>(config, operator_config, partitions)?;
    let controller = faults::with_controller_faults(plan.controller);
    if let Some(warning) = plan.warning() {
        tracing::warn!("{warning}");
    }
    let producers = TaskProducers::new(kafka, controller.mode != Mode::None)?;
    let producer = Arc::new(producers.outputs);
    let changelog_producer = Arc::new(producers.changelog);
    // Connected before the group assigns anything: a restarted process
    // restores its partitions side by side, one of them with the context's
    // reader and the others with these.
    let restore_readers = ReaderPool::new(kafka, &topics.changelog);
    restore_readers.fill_in_background(partitions.clamp(1, RESTORE_PARALLELISM) - 1);
    let planner = ResumePlanner::new(config, controller, LocalStores::of::<O>(config));
    let context = GroupContext::new(
        config,
        ChangelogLoader::new(kafka, &topics.changelog)?,
        planner.clone(),
        [Arc::clone(&producer), Arc::clone(&changelog_producer)],
    );
    let consumer = Arc::new(group_consumer(kafka, config.metrics.is_some(), context)?);
    // However run_pipeline ends, the consumer is closed after this is dropped.
    let _closing = ClosingGuard(&consumer.context().closing);
    consumer.subscribe(&[topics.input.as_str()])?;
    tracing::info!(
        input = %topics.input, output = %topics.output, changelog = %topics.changelog,
        partitions, mode = ?pipeline.fault_tolerance.mode(), "joined group {}", kafka.group_id
    );

    let shared = TaskEnv {
        group: kafka.group_id.clone(),
        producer: &producer,
        changelog_producer: &changelog_producer,
        consumer: &consumer,
        topics: &topics,
        codec: &codec,
        crash_in_backup,
        backups_sent: std::cell::Cell::new(0),
        incarnation: std::cell::Cell::new(TaskIncarnation::default()),
        source_positions: config.source_positions(),
    };
    let mut starter = TaskStarter::<O> {
        operator_config,
        controller,
        readers: restore_readers,
        planner,
        resident_keys: pipeline.store.resident_keys,
        restores: Restores::new(),
        queues: HashMap::new(),
    };
    let started = Instant::now();
    let stop_at_end = options.stop_at_end.then_some(partitions);
    let (mut manager, handoff) = run_rounds(&shared, &mut starter, &mut feedback, stop, stop_at_end, started)?;
    if let Some(revocation) = handoff {
        // Its tasks stopped with the rest.
        revocation.release(&consumer)?;
    }
    let report = manager.report(started);
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

/// The loop: poll, hand the manager what the group listener recorded, start
/// the tasks of new partitions, run a round, release what was handed off,
/// until every task stopped cleanly. The manager and any handoff left to
/// release when it ends.
fn run_rounds<O: ServiceOperator>(
    shared: &TaskEnv<'_>,
    starter: &mut TaskStarter<'_, O>,
    feedback: &mut Option<FeedbackReader>,
    stop: &AtomicBool,
    stop_at_end: Option<usize>,
    started: Instant,
) -> Result<(TaskManager<Task<O>>, Option<Revocation>), ServiceError> {
    let consumer = shared.consumer;
    let context = consumer.context();
    let mut manager: TaskManager<Task<O>> = TaskManager::new(STOP_DEADLINE);
    // The partitions being handed off, to release when the manager is done.
    let mut handoff: Option<Revocation> = None;
    let mut worked = true;
    let mut idle = IdleBackoff::default();
    loop {
        idle.after_round(worked, manager.awaiting());
        let now_ms = started.elapsed().as_millis() as u64;
        let message = consumer.poll(Duration::ZERO);
        if let Some(failure) = context.failure.lock().ok().and_then(|mut f| f.take()) {
            return Err(ServiceError::Rebalance(failure));
        }
        worked = rebalanced(shared, &mut manager, starter, now_ms)?;
        worked |= starter.start(shared, &mut manager, feedback.as_ref(), started, now_ms)?;
        // After the assignments: a partition assigned and then revoked within
        // one poll is started, then handed off.
        worked |= revoking(shared, &mut manager, starter, &mut handoff, now_ms);
        if let Some(reader) = feedback {
            worked |= reader.hand_to(shared, manager.active_mut());
        }
        match message {
            // A record fetched before its partition's queue was split (its
            // task's seek made librdkafka drop those; any left is taken if new).
            Some(Ok(message)) => {
                if let Some(task) = manager.task_mut(message.partition()) {
                    task.batch.accept(shared.codec, &message);
                }
                worked = true;
            }
            Some(Err(error)) => tracing::warn!(%error, "consumer"),
            None => {}
        }
        worked |= manager.round(shared, now_ms);
        #[cfg(feature = "fault-injection")]
        collector::release_held_changelog_records(shared);
        if manager.handoff_due(now_ms) {
            manager.finish_handoff(shared, now_ms);
            release(consumer, handoff.take())?;
            worked = true;
        }
        if let Some((partition, message)) = manager.fatal() {
            return Err(ServiceError::Task { partition, message });
        }
        if !manager.is_stopping()
            && (stop.load(Ordering::Relaxed) || stop_at_end.is_some_and(|partitions| manager.all_at_end(partitions)))
        {
            manager.stop(shared, now_ms);
        }
        match manager.stop_progress(now_ms) {
            StopProgress::Running | StopProgress::Stopping => {}
            StopProgress::Stopped => return Ok((manager, handoff)),
            StopProgress::Overdue(waiting) => {
                return Err(ServiceError::Stop(format!(
                    "partitions {waiting:?} did not finish their final backup within {STOP_DEADLINE:?}"
                )))
            }
        }
    }
}

/// Hands the manager what the group listener recorded since the last round:
/// revocations, losses, partitions given back. Whether anything happened.
fn rebalanced<O: ServiceOperator>(
    shared: &TaskEnv<'_>,
    manager: &mut TaskManager<Task<O>>,
    starter: &mut TaskStarter<'_, O>,
    now_ms: u64,
) -> Result<bool, ServiceError> {
    let context = shared.consumer.context();
    let mut worked = false;
    let revoked = take_recorded(&context.revoked);
    starter.cancel(&revoked);
    if !revoked.is_empty() {
        // The revocation flushed the producers: the revoked tasks get their
        // delivery reports before they go.
        worked |= manager.deliver(shared, now_ms);
        manager.revoked(&revoked);
    }
    let lost = take_recorded(&context.lost);
    starter.cancel(&lost);
    if !lost.is_empty() {
        // The loss flushed the producers: the tasks get their delivery
        // reports before they are parked, and the changelog's end is final.
        worked |= manager.deliver(shared, now_ms);
    }
    for partition in lost {
        let parked = manager.lost(partition, || context.loader.end_offset(partition).ok());
        if let (Some(parked), Ok(mut kept)) = (parked, context.parked.lock()) {
            kept.insert(partition, parked);
        }
    }
    for (partition, end) in take_recorded(&context.regained) {
        manager.regained(shared, partition, end, now_ms)?;
        worked = true;
    }
    Ok(worked)
}

/// Partitions the group takes back cooperatively: their tasks begin their
/// clean stop, a restore of theirs still running is dropped (its task would
/// start on a partition no longer assigned), and the partitions join the
/// handoff. Whether there were any.
fn revoking<O: ServiceOperator>(
    shared: &TaskEnv<'_>,
    manager: &mut TaskManager<Task<O>>,
    starter: &mut TaskStarter<'_, O>,
    handoff: &mut Option<Revocation>,
    now_ms: u64,
) -> bool {
    let context = shared.consumer.context();
    let Some(revocation) = context.revoking.lock().ok().and_then(|mut r| r.take()) else {
        return false;
    };
    let partitions = revocation.partitions();
    starter.cancel(&partitions);
    manager.hand_off(shared, &partitions, now_ms);
    match handoff.as_mut() {
        Some(pending) => pending.add(&revocation.tpl),
        None => *handoff = Some(revocation),
    }
    true
}

/// Gives handed-off partitions back to the group once their tasks are gone.
/// The clean markers' offsets are stored: they are committed first (the next
/// owner resumes at the marker either way).
fn release(consumer: &BaseConsumer<GroupContext>, handoff: Option<Revocation>) -> Result<(), ServiceError> {
    match consumer.commit_consumer_state(CommitMode::Sync) {
        Ok(()) | Err(KafkaError::ConsumerCommit(RDKafkaErrorCode::NoOffset)) => {}
        Err(error) => tracing::warn!(%error, "committing offsets before a handoff"),
    }
    if let Some(revocation) = handoff {
        revocation.release(consumer)?;
    }
    Ok(())
}

impl<O: ServiceOperator> TaskManager<Task<O>> {
    /// What the run did, its tasks' figures logged; `started` is the run's clock.
    fn report(&mut self, started: Instant) -> RunReport {
        let run_ms = started.elapsed().as_millis() as u64;
        let stop_began_ms = self.stopping_since_ms().unwrap_or(run_ms);
        let tasks: Vec<TaskReport> = self.active_mut().map(Task::final_report).collect();
        let first_start_ms = self.first_start_ms().unwrap_or(stop_began_ms).min(stop_began_ms);
        let first_input_ms = tasks
            .iter()
            .filter_map(|task| task.first_input_ms)
            .min()
            .unwrap_or(stop_began_ms)
            .clamp(first_start_ms, stop_began_ms);
        RunReport {
            processing: Duration::from_millis(stop_began_ms - first_input_ms),
            starting: Duration::from_millis(first_input_ms - first_start_ms),
            stop: Duration::from_millis(run_ms.saturating_sub(stop_began_ms)),
            drained: Duration::from_millis(self.drained_ms().unwrap_or_default()),
            tasks,
        }
    }
}
