//! The Kafka side: topic checks and creation, and reading a changelog
//! partition.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, ResourceSpecifier, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{BorrowedMessage, Message};
use rdkafka::metadata::MetadataTopic;
use rdkafka::{Offset, TopicPartitionList};

use super::clients::{admin_client, assigned_reader, metadata_client};
use super::config::KafkaConfig;
use crate::core::{last_marker_in_order, BackupEntry, BackupMarker, ChangelogReader, ChangelogState, EntryBytes};

mod retry;

use retry::asked_again;
pub use retry::{is_unreachable, patiently};

/// How long one broker request may take before it is reported.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum KafkaSetupError {
    #[error("Kafka: {0}")]
    Kafka(#[from] KafkaError),
    #[error("input topic {0:?} does not exist (create it with the partitions you want tasks)")]
    MissingTopic(String),
    #[error("topic {topic:?}: {reason}")]
    Topic { topic: String, reason: String },
    #[error(
        "{what}: the brokers ({servers}) could not be reached in {waited_ms} ms \
         (kafka.startup_timeout_ms {patience_ms}): {source}"
    )]
    Unreachable {
        what: String,
        servers: String,
        waited_ms: u128,
        patience_ms: u64,
        source: Box<KafkaSetupError>,
    },
    #[error("reading changelog {topic:?} partition {partition}: {reason}")]
    Changelog {
        topic: String,
        partition: i32,
        reason: String,
    },
}

/// The number of partitions of `topic`, or `None` if it does not exist.
pub fn partition_count(kafka: &KafkaConfig, topic: &str) -> Result<Option<usize>, KafkaSetupError> {
    let client = metadata_client(kafka)?;
    partitions_of(&client, topic)
}

/// What `read` finds in `topic`'s metadata, or `None` if the topic does not exist.
fn described<T>(
    client: &BaseConsumer,
    topic: &str,
    read: impl FnOnce(&MetadataTopic) -> Option<T>,
) -> Result<Option<T>, KafkaSetupError> {
    let metadata = client.fetch_metadata(Some(topic), REQUEST_TIMEOUT)?;
    Ok(metadata
        .topics()
        .iter()
        .find(|t| t.name() == topic)
        .filter(|t| t.error().is_none() && !t.partitions().is_empty())
        .and_then(read))
}

/// [`partition_count`] through a client already open.
fn partitions_of(client: &BaseConsumer, topic: &str) -> Result<Option<usize>, KafkaSetupError> {
    described(client, topic, |t| Some(t.partitions().len()))
}

/// How many replicas a topic's first partition has.
fn replicas_of(client: &BaseConsumer, topic: &str) -> Result<Option<usize>, KafkaSetupError> {
    described(client, topic, |t| t.partitions().first().map(|p| p.replicas().len()))
}

/// A topic afstream creates when it is missing.
pub struct TopicSpec<'a> {
    pub name: &'a str,
    pub partitions: usize,
    pub compacted: bool,
}

/// Creates the topics that are missing and checks that the others have at least
/// the partitions asked for.
pub fn ensure_topics(kafka: &KafkaConfig, topics: &[TopicSpec<'_>]) -> Result<(), KafkaSetupError> {
    let client = metadata_client(kafka)?;
    let mut missing = Vec::new();
    let mut compacted = Vec::new();
    for topic in topics {
        match partitions_of(&client, topic.name)? {
            Some(found) if found < topic.partitions => {
                return Err(KafkaSetupError::Topic {
                    topic: topic.name.to_string(),
                    reason: format!("has {found} partitions, needs at least {}", topic.partitions),
                })
            }
            Some(_) if topic.compacted => compacted.push((topic.name, replicas_of(&client, topic.name)?)),
            Some(_) => {}
            None => missing.push(topic),
        }
    }
    if missing.is_empty() && compacted.is_empty() {
        return Ok(());
    }
    let admin = admin_client(kafka)?;
    check_compacted(&admin, &compacted)?;
    if missing.is_empty() {
        return Ok(());
    }
    let new_topics: Vec<NewTopic<'_>> = missing
        .iter()
        .map(|t| {
            let topic = NewTopic::new(
                t.name,
                i32::try_from(t.partitions).unwrap_or(i32::MAX),
                TopicReplication::Fixed(kafka.replication_factor),
            );
            match (t.compacted, kafka.replication_factor) {
                // Kafka's advice for durable topics: three replicas, two of them
                // in sync for a write to count.
                (true, replicas) if replicas >= 3 => {
                    topic.set("cleanup.policy", "compact").set("min.insync.replicas", "2")
                }
                (true, _) => topic.set("cleanup.policy", "compact"),
                (false, _) => topic,
            }
        })
        .collect();
    let options = AdminOptions::new().operation_timeout(Some(REQUEST_TIMEOUT));
    let results = futures_executor::block_on(admin.create_topics(new_topics.iter(), &options))?;
    for result in results {
        match result {
            Ok(name) => tracing::info!(topic = %name, "created topic"),
            Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((name, code)) => {
                return Err(KafkaSetupError::Topic {
                    topic: name,
                    reason: format!("cannot create it: {code}"),
                })
            }
        }
    }
    // Metadata propagates asynchronously: wait until every new topic is visible.
    let deadline = Instant::now() + REQUEST_TIMEOUT;
    for topic in missing {
        while partitions_of(&client, topic.name)?.is_none() {
            if Instant::now() > deadline {
                return Err(KafkaSetupError::Topic {
                    topic: topic.name.to_string(),
                    reason: "created, but not in the metadata after 10 s".into(),
                });
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    Ok(())
}

/// Refuses a topic that must be compacted (a changelog) but is not: with
/// `cleanup.policy=delete` the broker drops old records by age or size, and
/// with them keys the last marker's state holds, so a recovery would restore
/// a state with keys missing and no error to show for it. Checks its
/// replication too ([`changelog_durability`]). A broker that does not
/// describe topic configs cannot be checked: that is logged, not refused.
fn check_compacted(
    admin: &AdminClient<DefaultClientContext>,
    topics: &[(&str, Option<usize>)],
) -> Result<(), KafkaSetupError> {
    if topics.is_empty() {
        return Ok(());
    }
    let specifiers: Vec<ResourceSpecifier<'_>> = topics.iter().map(|(t, _)| ResourceSpecifier::Topic(t)).collect();
    let options = AdminOptions::new().request_timeout(Some(REQUEST_TIMEOUT));
    let results = match futures_executor::block_on(admin.describe_configs(specifiers.iter(), &options)) {
        Ok(results) => results,
        Err(error) => {
            tracing::warn!(topics = ?topics, %error, "cannot read the changelog's cleanup.policy; not checked");
            return Ok(());
        }
    };
    for (&(topic, replicas), result) in topics.iter().zip(results) {
        let resource = match result {
            Ok(resource) => resource,
            Err(code) => {
                tracing::warn!(topic, %code, "cannot read the changelog's cleanup.policy; not checked");
                continue;
            }
        };
        let refuse = |reason: String| KafkaSetupError::Topic {
            topic: topic.to_string(),
            reason,
        };
        match resource.get("cleanup.policy").and_then(|entry| entry.value.clone()) {
            Some(policy) if !is_compacted(&policy) => {
                return Err(refuse(format!(
                    "its cleanup.policy is {policy:?}: a changelog must be compacted (cleanup.policy=compact), \
                     or the broker deletes records a recovery needs; change the topic's policy or name another \
                     changelog_topic"
                )));
            }
            Some(_) => {}
            None => tracing::warn!(
                topic,
                "the broker reports no cleanup.policy for the changelog; not checked"
            ),
        }
        let min_insync = resource
            .get("min.insync.replicas")
            .and_then(|entry| entry.value.as_deref())
            .and_then(|value| value.parse().ok());
        match (replicas, min_insync) {
            (Some(replicas), Some(min_insync)) => {
                if let Some(warning) = changelog_durability(replicas, min_insync).map_err(refuse)? {
                    tracing::warn!(topic, replicas, min_insync, "{warning}");
                }
            }
            _ => tracing::debug!(topic, "the changelog's replication is not reported; not checked"),
        }
    }
    Ok(())
}

/// What a changelog's replication means for the backups it acknowledges:
/// an error when no write can ever be acknowledged (more replicas must be
/// in sync than there are), a warning when one replica's loss can lose an
/// acknowledged backup although the topic has others.
fn changelog_durability(replicas: usize, min_insync: usize) -> Result<Option<String>, String> {
    if min_insync > replicas {
        return Err(format!(
            "its min.insync.replicas is {min_insync} but it has {replicas} replica(s): the broker would refuse \
             every write (NotEnoughReplicas); lower min.insync.replicas or add replicas"
        ));
    }
    Ok((replicas >= 2 && min_insync < 2).then(|| {
        format!(
            "the changelog has {replicas} replicas but min.insync.replicas = {min_insync}: a backup the leader \
             alone acknowledged is lost with it; set min.insync.replicas = 2"
        )
    }))
}

/// Whether a `cleanup.policy` value compacts: `compact`, or `compact,delete`
/// (compaction with a retention limit, which Kafka Streams also accepts for
/// windowed stores).
fn is_compacted(policy: &str) -> bool {
    policy.split(',').any(|p| p.trim() == "compact")
}

/// Reads partitions by assignment, from an offset to an end, with a deadline on
/// progress. It never subscribes, so it never joins a group, and commits nothing.
pub struct TopicReader {
    consumer: BaseConsumer,
    /// How long a request without an answer is asked again
    /// (`kafka.startup_timeout_ms`).
    patience: Duration,
}

impl TopicReader {
    pub fn new(kafka: &KafkaConfig, purpose: &str) -> Result<Self, KafkaSetupError> {
        // librdkafka assigns only with a group id; this one is never joined.
        let group = format!("{}-{purpose}", kafka.group_id);
        let consumer = assigned_reader(kafka, &group, true)?;
        Ok(TopicReader {
            consumer,
            patience: Duration::from_millis(kafka.startup_timeout_ms),
        })
    }

    /// The number of partitions of `topic`, or `None` if it does not exist.
    pub fn partitions(&self, topic: &str) -> Result<Option<usize>, KafkaSetupError> {
        partitions_of(&self.consumer, topic)
    }

    /// (low, high) watermarks, asked again while the brokers do not answer.
    pub fn watermarks(&self, topic: &str, partition: i32) -> Result<(i64, i64), KafkaError> {
        asked_again("reading a partition's offsets", self.patience, || {
            self.consumer.fetch_watermarks(topic, partition, REQUEST_TIMEOUT)
        })
    }

    /// Hands every record in `[from, high)` to `take`, in order; fails after 30 s
    /// without a record before the end.
    pub fn read(
        &self,
        topic: &str,
        partition: i32,
        from: i64,
        high: i64,
        mut take: impl FnMut(&BorrowedMessage<'_>),
    ) -> Result<(), String> {
        if from >= high {
            return Ok(());
        }
        let mut assignment = TopicPartitionList::new();
        assignment
            .add_partition_offset(topic, partition, Offset::Offset(from))
            .map_err(|e| e.to_string())?;
        self.consumer.assign(&assignment).map_err(|e| e.to_string())?;
        let mut last_progress = Instant::now();
        loop {
            match self.consumer.poll(Duration::from_millis(100)) {
                Some(Ok(message)) => {
                    last_progress = Instant::now();
                    take(&message);
                    if message.offset() >= high - 1 {
                        break;
                    }
                }
                Some(Err(KafkaError::PartitionEOF(_))) => break,
                Some(Err(e)) => tracing::warn!(topic, partition, error = %e, "reading; retrying"),
                None => {}
            }
            if last_progress.elapsed() > REQUEST_TIMEOUT * 3 {
                return Err(format!("no record for 30 s before offset {high}"));
            }
        }
        self.consumer.unassign().map_err(|e| e.to_string())
    }

    /// Every record the partition holds now.
    pub fn read_all(&self, topic: &str, partition: i32, take: impl FnMut(&BorrowedMessage<'_>)) -> Result<(), String> {
        let (low, high) = self.watermarks(topic, partition).map_err(|e| e.to_string())?;
        self.read(topic, partition, low, high, take)
    }
}

fn entry_of(message: &BorrowedMessage<'_>) -> BackupEntry {
    BackupEntry::new(
        EntryBytes::from_slice(message.key().unwrap_or_default()),
        message.payload().map(EntryBytes::from_slice),
    )
}

/// What [`ChangelogLoader::stream`] read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Streamed {
    pub records: u64,
    /// The offset it read to: the records before it make the state.
    pub end_offset: u64,
}

/// Changelog readers kept connected from one restore to the next. A new
/// reader's first request opens its connections and reads the cluster's
/// metadata, which can take longer than reading a small changelog (measured
/// in `docs/running.md`, restores). The pool is filled in the
/// background when a pipeline starts, so a restarted process's restores find
/// their readers connected; a restore that finds none opens one and leaves it
/// here afterwards.
pub struct ReaderPool {
    kafka: KafkaConfig,
    topic: String,
    idle: Mutex<Vec<ChangelogLoader>>,
}

impl ReaderPool {
    pub fn new(kafka: &KafkaConfig, topic: &str) -> Arc<Self> {
        Arc::new(ReaderPool {
            kafka: kafka.clone(),
            topic: topic.to_string(),
            idle: Mutex::new(Vec::new()),
        })
    }

    /// Opens `count` readers in a thread of its own and connects each (a
    /// request for the end of partition 0), then adds them to the pool. A
    /// reader that cannot connect yet is added all the same: it connects when
    /// a restore uses it, as a new one would.
    pub fn fill_in_background(self: &Arc<Self>, count: usize) {
        let pool = Arc::clone(self);
        let spawned = std::thread::Builder::new()
            .name("changelog-readers".into())
            .spawn(move || {
                for _ in 0..count {
                    let reader = match ChangelogLoader::new(&pool.kafka, &pool.topic) {
                        Ok(reader) => reader,
                        Err(error) => {
                            tracing::debug!(%error, "opening a changelog reader ahead of a restore");
                            return;
                        }
                    };
                    if let Err(error) = reader.end_offset(0) {
                        tracing::debug!(%error, "connecting a changelog reader ahead of a restore");
                    }
                    pool.give_back(reader);
                }
            });
        if let Err(error) = spawned {
            // The restores open their readers themselves.
            tracing::debug!(%error, "no thread to open changelog readers ahead");
        }
    }

    /// A connected reader if one is idle, else a new one.
    pub fn take(&self) -> Result<ChangelogLoader, KafkaSetupError> {
        match self.idle.lock().ok().and_then(|mut idle| idle.pop()) {
            Some(reader) => Ok(reader),
            None => ChangelogLoader::new(&self.kafka, &self.topic),
        }
    }

    pub fn give_back(&self, reader: ChangelogLoader) {
        if let Ok(mut idle) = self.idle.lock() {
            idle.push(reader);
        }
    }

    /// Readers idle in the pool.
    pub fn idle(&self) -> usize {
        self.idle.lock().map_or(0, |idle| idle.len())
    }
}

/// Reads a changelog topic's partitions.
pub struct ChangelogLoader {
    reader: TopicReader,
    topic: String,
}

impl ChangelogLoader {
    pub fn new(kafka: &KafkaConfig, topic: &str) -> Result<Self, KafkaSetupError> {
        Ok(ChangelogLoader {
            reader: TopicReader::new(kafka, "changelog-reader")?,
            topic: topic.to_string(),
        })
    }

    fn error(&self, partition: i32, reason: impl ToString) -> KafkaSetupError {
        KafkaSetupError::Changelog {
            topic: self.topic.clone(),
            partition,
            reason: reason.to_string(),
        }
    }

    /// The partition's offsets to read: from its start to `end`, or to its
    /// end now when `end` is `None` or past it.
    fn range(&self, partition: i32, end: Option<i64>) -> Result<(i64, i64), KafkaSetupError> {
        let (low, high) = self
            .reader
            .watermarks(&self.topic, partition)
            .map_err(|e| self.error(partition, e))?;
        Ok((low, end.map_or(high, |end| end.min(high))))
    }

    /// The state logged at a partition's last marker, and the marker.
    pub fn load(&self, partition: i32) -> Result<ChangelogState, KafkaSetupError> {
        self.load_until(partition, None)
    }

    /// The state logged at the last marker before `end` (the partition's end
    /// when `None`), and that marker: what a restore that read to `end` got.
    pub fn load_until(&self, partition: i32, end: Option<i64>) -> Result<ChangelogState, KafkaSetupError> {
        let (low, end) = self.range(partition, end)?;
        let mut reader = ChangelogReader::new();
        self.reader
            .read(&self.topic, partition, low, end, |message| {
                reader.push(entry_of(message))
            })
            .map_err(|e| self.error(partition, e))?;
        reader.finish().map_err(|e| self.error(partition, e))
    }

    /// Hands the partition's records to `apply` in log order, `chunk` at a time,
    /// so that a restore into a local store never holds the whole changelog;
    /// reads to the partition's end now, or to `end` when given (the state a
    /// restore that read to that offset got). Applying every record in order
    /// gives what the latest record per key gives (later records for a key win).
    pub fn stream(
        &self,
        partition: i32,
        end: Option<i64>,
        chunk: usize,
        mut apply: impl FnMut(&[BackupEntry]) -> Result<(), String>,
    ) -> Result<Streamed, KafkaSetupError> {
        let (low, end) = self.range(partition, end)?;
        let mut batch = Vec::with_capacity(chunk);
        let mut records = 0u64;
        let mut failed: Option<String> = None;
        self.reader
            .read(&self.topic, partition, low, end, |message| {
                if failed.is_some() {
                    return;
                }
                records += 1;
                batch.push(entry_of(message));
                if batch.len() >= chunk {
                    failed = apply(&batch).err();
                    batch.clear();
                }
            })
            .map_err(|e| self.error(partition, e))?;
        if failed.is_none() && !batch.is_empty() {
            failed = apply(&batch).err();
        }
        match failed {
            Some(reason) => Err(self.error(partition, reason)),
            None => Ok(Streamed {
                records,
                end_offset: end.max(0) as u64,
            }),
        }
    }

    /// The offset the partition's next record will get.
    pub fn end_offset(&self, partition: i32) -> Result<i64, KafkaSetupError> {
        self.reader
            .watermarks(&self.topic, partition)
            .map(|(_, high)| high)
            .map_err(|e| self.error(partition, e))
    }

    /// Each partition's last marker once nobody writes the partition any more:
    /// at once when it is clean (its task stopped and handed it off);
    /// otherwise after the changelog stayed unchanged for `quiet`, waiting at
    /// most `patience`. A previous owner still writing is one a broker handed
    /// the partition over from before it let go of it, or a revoked task's
    /// records still landing: resuming under it would interleave two writers.
    /// (One still alive but idle cannot be told from a dead one.) The
    /// partitions wait together: a rebalance after a crash waits `quiet` once,
    /// not once per partition.
    pub fn settled_markers(
        &self,
        partitions: &[i32],
        quiet: Duration,
        patience: Duration,
    ) -> Result<Vec<Option<BackupMarker>>, KafkaSetupError> {
        let deadline = Instant::now() + patience;
        let mut settled: Vec<Option<BackupMarker>> = vec![None; partitions.len()];
        let mut pending: Vec<usize> = (0..partitions.len()).collect();
        let mut said = vec![false; partitions.len()];
        while !pending.is_empty() {
            // (index, end offset, last marker) of the partitions not yet settled.
            let mut unsettled = Vec::new();
            for index in pending.drain(..) {
                let partition = partitions[index];
                let before = self.end_offset(partition)?;
                if before <= 0 {
                    // Nothing written yet: a first start has nobody to wait for.
                    continue;
                }
                let marker = self.last_marker(partition)?;
                if marker.as_ref().is_some_and(|m| m.clean) || quiet.is_zero() {
                    settled[index] = marker;
                } else {
                    unsettled.push((index, before, marker));
                }
            }
            if unsettled.is_empty() {
                break;
            }
            std::thread::sleep(quiet);
            for (index, before, marker) in unsettled {
                let partition = partitions[index];
                if self.end_offset(partition)? == before {
                    settled[index] = marker;
                } else if Instant::now() >= deadline {
                    tracing::warn!(
                        partition,
                        waited = ?patience,
                        "the changelog is still being written by another member; resuming from its last marker"
                    );
                    settled[index] = self.last_marker(partition)?;
                } else {
                    if !said[index] {
                        tracing::info!(
                            partition,
                            "the changelog is still being written by the previous owner; waiting for its clean marker"
                        );
                        said[index] = true;
                    }
                    pending.push(index);
                }
            }
        }
        Ok(settled)
    }

    /// The partition's last marker (how far its task got), read from the end
    /// backwards in growing windows.
    pub fn last_marker(&self, partition: i32) -> Result<Option<BackupMarker>, KafkaSetupError> {
        let (low, high) = self
            .reader
            .watermarks(&self.topic, partition)
            .map_err(|e| self.error(partition, e))?;
        let mut window: i64 = 64;
        loop {
            let from = high.saturating_sub(window).max(low);
            let mut records = Vec::new();
            self.reader
                .read(&self.topic, partition, from, high, |message| {
                    records.push(entry_of(message))
                })
                .map_err(|e| self.error(partition, e))?;
            // A previous owner's marker behind a newer owner's records is not
            // the last ([`crate::core::fence`]); the restore's full read checks
            // what a window this size cannot see.
            let last = last_marker_in_order(&records).map_err(|e| self.error(partition, e))?;
            if last.is_some() {
                return Ok(last);
            }
            if from <= low {
                return Ok(None);
            }
            window = window.saturating_mul(4);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_changelog_that_can_take_no_write_is_refused_and_one_that_can_lose_one_is_warned_of() {
        assert!(changelog_durability(1, 2).is_err(), "more in sync than replicas");
        assert!(changelog_durability(3, 4).unwrap_err().contains("NotEnoughReplicas"));
        assert!(changelog_durability(3, 1).unwrap().is_some(), "the leader alone");
        assert!(changelog_durability(2, 1).unwrap().is_some());
        assert_eq!(changelog_durability(3, 2), Ok(None));
        assert_eq!(changelog_durability(1, 1), Ok(None), "one broker: nothing to ask for");
    }

    #[test]
    fn only_a_policy_that_compacts_is_a_changelog_policy() {
        for policy in ["compact", "compact,delete", "delete, compact"] {
            assert!(is_compacted(policy), "{policy}");
        }
        for policy in ["delete", "", "compaction"] {
            assert!(!is_compacted(policy), "{policy}");
        }
    }
}
