//! The sample `tune` measures on: the first records of the pipeline's input,
//! decoded by its own codec and split into one stream per input partition, as
//! its tasks would see them.
//!
//! From the input topic, the first ⌈N/P⌉ records of each of its P partitions.
//! From a file (laid out as `afstream produce --file` reads it), records are
//! encoded in the pipeline's format and decoded again, so a record the
//! pipeline would refuse is refused here too; a keyed record goes to the
//! partition its key hashes to, an unkeyed one to the next partition in turn.
//! Records the codec or the operator refuse are counted, not sampled; so is
//! the most outputs one record made (its fan-out, β).

use std::path::Path;

use crate::eval::exact::producer_workload;
use crate::eval::produce::{Encoder, FileFormat, InputRecord};
use crate::service::codec::{Codec, ServiceOperator};
use crate::service::config::Config;
use crate::service::kafka::{KafkaSetupError, TopicReader};
use crate::service::ServiceError;

/// Decoded input records, one stream per input partition.
pub struct Sample<I> {
    pub partitions: Vec<Vec<I>>,
    /// Records read, refused ones included.
    pub records: u64,
    /// Records the codec or the operator refused.
    pub refused: u64,
    /// The most outputs one sampled record made.
    pub max_outputs: u64,
    /// Where the records came from, for the report.
    pub source: String,
}

/// Collects decoded records, checking each against a probe of the operator.
struct Collector<O: ServiceOperator> {
    codec: Codec,
    probe: O,
    outputs: Vec<O::Output>,
    sample: Sample<O::Input>,
}

impl<O: ServiceOperator> Collector<O>
where
    O::Input: Clone,
{
    fn new(config: &Config, probe: O, partitions: usize, source: String) -> Result<Self, ServiceError> {
        let codec = Codec::new::<O>(&config.pipeline).map_err(ServiceError::Unsupported)?;
        Ok(Collector {
            codec,
            probe,
            outputs: Vec::new(),
            sample: Sample {
                partitions: (0..partitions).map(|_| Vec::new()).collect(),
                records: 0,
                refused: 0,
                max_outputs: 0,
                source,
            },
        })
    }

    fn take(&mut self, partition: usize, key: Option<&[u8]>, value: &[u8]) {
        self.sample.records += 1;
        let mut input = O::empty_input();
        let accepted = self.codec.decode::<O>(key, value, &mut input).is_ok() && {
            self.outputs.clear();
            self.probe.process(&input, &mut self.outputs).is_ok()
        };
        if accepted {
            self.sample.max_outputs = self.sample.max_outputs.max(self.outputs.len() as u64);
            self.sample.partitions[partition].push(input);
        } else {
            self.sample.refused += 1;
        }
    }
}

/// The first `records` records of the config's input topic.
pub fn from_topic<O: ServiceOperator>(
    config: &Config,
    probe: O,
    records: usize,
) -> Result<Sample<O::Input>, ServiceError>
where
    O::Input: Clone,
{
    let topic = &config.pipeline.input_topic;
    let reader = TopicReader::new(&config.kafka, "tune")?;
    let partitions = reader
        .partitions(topic)?
        .ok_or_else(|| KafkaSetupError::MissingTopic(topic.clone()))?;
    let share = records.div_ceil(partitions.max(1)) as i64;
    let source = format!("the first {share} records of each of the {partitions} partitions of topic {topic}");
    let mut collector = Collector::new(config, probe, partitions, source)?;
    for partition in 0..partitions {
        let index = partition as i32;
        let (low, high) = reader
            .watermarks(topic, index)
            .map_err(|e| ServiceError::Unsupported(format!("reading {topic} partition {partition}: {e}")))?;
        reader
            .read(topic, index, low, high.min(low + share), |message| {
                let key = rdkafka::Message::key(message);
                let value = rdkafka::Message::payload(message).unwrap_or_default();
                collector.take(partition, key, value);
            })
            .map_err(|e| ServiceError::Unsupported(format!("reading {topic} partition {partition}: {e}")))?;
    }
    Ok(collector.sample)
}

/// The first `records` records of a file, split over `partitions` streams.
pub fn from_file<O: ServiceOperator>(
    config: &Config,
    probe: O,
    path: &Path,
    layout: Option<FileFormat>,
    records: usize,
    partitions: usize,
) -> Result<Sample<O::Input>, ServiceError>
where
    O::Input: Clone,
{
    let layout = layout.unwrap_or_else(|| FileFormat::of(path));
    let workload = producer_workload(&config.pipeline.operator);
    let encoder = Encoder::new(workload, config.pipeline.format, config.pipeline.avro.as_ref())
        .map_err(ServiceError::Unsupported)?;
    let source = format!("the first {records} records of {} ({layout:?})", path.display());
    let mut collector = Collector::new(config, probe, partitions, source)?;
    for (index, record) in encoder
        .file(path, layout)
        .map_err(ServiceError::Unsupported)?
        .take(records)
        .enumerate()
    {
        let record = record.map_err(ServiceError::Unsupported)?;
        let partition = partition_of(&record, index, partitions);
        collector.take(partition, record.key.as_deref(), &record.value);
    }
    Ok(collector.sample)
}

/// A keyed record's partition follows its key; unkeyed records go round.
fn partition_of(record: &InputRecord, index: usize, partitions: usize) -> usize {
    let partitions = partitions.max(1);
    match &record.key {
        Some(key) => (xxhash_rust::xxh3::xxh3_64(key) % partitions as u64) as usize,
        None => index % partitions,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_always_goes_to_one_partition_and_unkeyed_records_go_round() {
        let keyed = |k: &str| InputRecord {
            key: Some(k.as_bytes().to_vec()),
            value: Vec::new(),
        };
        let unkeyed = InputRecord {
            key: None,
            value: Vec::new(),
        };
        assert_eq!(partition_of(&keyed("a"), 0, 4), partition_of(&keyed("a"), 7, 4));
        let spread: std::collections::HashSet<usize> =
            (0..40).map(|i| partition_of(&keyed(&format!("k{i}")), i, 4)).collect();
        assert_eq!(spread.len(), 4);
        let turns: Vec<usize> = (0..5).map(|i| partition_of(&unkeyed, i, 3)).collect();
        assert_eq!(turns, vec![0, 1, 2, 0, 1]);
    }
}
