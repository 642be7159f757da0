//! The feedback reader: a distributed learner's global models, read from
//! the feedback topic by every process (not a group member).

use std::sync::atomic::AtomicBool;
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Message;
use rdkafka::{Offset, TopicPartitionList};

use crate::service::clients::assigned_reader;
use crate::service::codec::{Codec, ServiceOperator};
use crate::service::config::Config;
use crate::service::kafka::{ensure_topics, partition_count, patiently, KafkaSetupError, TopicSpec};
use crate::service::ServiceError;

use super::task::Task;
use super::TaskEnv;

/// Empties a list the rebalance callback fills (empty when its lock is poisoned).
/// The pipeline's feedback topic: every record to every task, from the last
/// one there when the pipeline starts. Not a group member: nothing to commit,
/// and every process reads all of it.
pub(super) struct FeedbackReader {
    pub(super) consumer: BaseConsumer,
    pub(super) codec: Codec,
    /// The latest record, for the tasks that start later.
    pub(super) latest: Option<Vec<u8>>,
}

impl FeedbackReader {
    pub(super) fn open<O: ServiceOperator>(config: &Config, stop: &AtomicBool) -> Result<Option<Self>, ServiceError> {
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
        let consumer = assigned_reader(kafka, &format!("{}-feedback", kafka.group_id), false)?;
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

    /// Hands every record that arrived since the last call to every task,
    /// and keeps the last for the tasks that start later. Whether any arrived.
    pub(super) fn hand_to<'t, O: ServiceOperator + 't>(
        &mut self,
        shared: &TaskEnv<'_>,
        tasks: impl Iterator<Item = &'t mut Task<O>>,
    ) -> bool {
        let values = self.poll();
        let Some(last) = values.last().cloned() else {
            return false;
        };
        for task in tasks {
            for value in &values {
                task.feedback(shared, &self.codec, value);
            }
        }
        self.latest = Some(last);
        true
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
