//! `afstream run`: one consumer in the group, one task per assigned partition,
//! each a [`TaskDriver`] whose I/O produces outputs, backups and markers and
//! stores offsets. Every decision is the core's; this module moves records and
//! acknowledgements between Kafka and the drivers, split the way Kafka
//! Streams splits its runtime:
//!
//! * `group`: the rebalance listener (the consumer's context), which records
//!   assignments, revocations and losses and where each partition resumes;
//! * `restore`: changelogs read into fresh operators, several side by side;
//! * `task`: one operator on one partition, started, stepped and stopped;
//! * `input`: a task's batch of polled records, decoded;
//! * `collector`: the record collector, the Kafka `TaskIo` of a task and the
//!   only code that sends records, with what is in flight;
//! * `feedback`: a distributed learner's global models;
//! * `clients`: the producers' settings;
//! * `faults`: the fault switches tests set;
//! * this module: the setup and the loop (`run_pipeline`).

mod clients;
mod collector;
mod faults;
mod feedback;
mod group;
mod input;
mod restore;
mod task;

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::Message;
use rdkafka::producer::{BaseProducer, Producer};

use super::check::TaskPlan;
use super::codec::{Codec, ServiceOperator};
use super::config::Config;
use super::kafka::{
    client_config, ensure_topics, partition_count, patiently, ChangelogLoader, ClientRole, DeliveryEvent,
    DeliveryReports, KafkaSetupError, ReaderPool, TaskIncarnation, TopicSpec, REQUEST_TIMEOUT,
};
use super::state::lock_state_dir;
use super::store::{StoreBudget, StoreMeta, TaskStore};
use super::ServiceError;
use crate::core::{DriverStats, Mode, RecoveryPlan};

use clients::{
    idempotent_producer, CHANGELOG_LINGER_MS, GAPLESS_CHANGELOG, OUTPUT_LINGER_MS, OUTPUT_LINGER_MS_MARKERS_WAIT,
};
use collector::{deliver_reports, MarkerRoundTrips};
pub use faults::*;
use feedback::FeedbackReader;
use group::{own_queue, ClosingGuard, GroupContext, Revocation};
use input::InputBatch;
use restore::{restore_all, RESTORE_PARALLELISM};
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
/// The shortest and longest sleep of an idle loop round.
const IDLE_WAIT_MIN: Duration = Duration::from_micros(100);
const IDLE_WAIT_MAX: Duration = Duration::from_millis(5);
/// The longest sleep while a task's input waits on an acknowledgement (γ
/// outputs unacknowledged, or its start marker): those are a few
/// milliseconds of input, so a late wake-up is a stall of its own.
const AWAIT_WAIT_MAX: Duration = Duration::from_micros(200);
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
    /// The incarnation the last task start got.
    incarnation: std::cell::Cell<TaskIncarnation>,
    /// Outputs carry their source positions (`Config::source_positions`).
    source_positions: bool,
}

impl Shared<'_> {
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

fn take<T: Default>(list: &Mutex<T>) -> T {
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
        incarnation: std::cell::Cell::new(TaskIncarnation::default()),
        source_positions: config.source_positions(),
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
            worked |= deliver_reports(&shared, &mut tasks, &mut parked_tasks, &mut events, now_ms);
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
            worked |= deliver_reports(&shared, &mut tasks, &mut parked_tasks, &mut events, now_ms);
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
            for event in std::mem::take(&mut task.parked_reports) {
                task.delivered(&shared, event, now_ms);
            }
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
                    task.batch.accept(shared.codec, &message);
                }
                worked = true;
            }
            Some(Err(error)) => tracing::warn!(%error, "consumer"),
            None => {}
        }
        for task in tasks.values_mut() {
            worked |= task.step(&shared, now_ms, stopping.is_some());
        }
        worked |= deliver_reports(&shared, &mut tasks, &mut parked_tasks, &mut events, now_ms);
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
                deliver_reports(&shared, &mut tasks, &mut parked_tasks, &mut events, now_ms);
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
            repeats_skipped = stats.repeats,
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
