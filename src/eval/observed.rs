//! What a recovery restored, against the exact state at the offset it resumed
//! from: the divergence its bound must cover. A recovery's logged bound is
//! what that one failure may add (θ: it restores the state logged at its
//! marker and replays from there); the state it restored also carries
//! what the partition's earlier failures left, so the divergence observed at a
//! recovery is held against the sum of the partition's bounds so far.
//!
//! Measured after a run, from what Kafka still holds: the changelog partition
//! read to the offset the restore read it to (the service logs it as
//! `changelog_end`), and the input partition processed by a fresh operator up
//! to the resume offset. Both states are built by the pipeline's own operator
//! and compared by its divergence function (`Operator::distance`).
//!
//! The changelog prefix is restored twice: as read, and as compaction may
//! leave it at the most (each key's latest record only, markers included, so
//! only the last marker stays; Kafka's cleaner never goes that far, since it
//! spares the active segment). A recovery may come before or after the
//! cleaner ran, and must be within its bound either way: a restore that
//! read a key's older records instead of the prior its latest record
//! carries would be right on the log as read and wrong once they are gone.
//! The larger of the two distances is the one observed.

use crate::core::{compacted, BackupEntry};
use crate::service::codec::{Codec, ServiceOperator};
use crate::service::config::Config;
use crate::service::kafka::{ChangelogLoader, TopicReader};
use crate::service::ServiceError;

/// One recovery from the changelog, as the service logged it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RestoreCheck {
    pub partition: i32,
    /// The input offset the task resumed at (its last marker's).
    pub resume_offset: u64,
    /// The changelog offset its restore read to.
    pub changelog_end: u64,
}

/// For each check, the distance between the state the recovery restored and
/// the exact state at its resume offset, in the operator's divergence.
pub fn observed_divergences(config: &Config, checks: &[RestoreCheck]) -> Result<Vec<f64>, ServiceError> {
    if checks.is_empty() {
        return Ok(Vec::new());
    }
    crate::with_operator!(&config.pipeline.operator, |O, c| observe::<O>(config, c, checks))
}

fn observe<O: ServiceOperator>(
    config: &Config,
    operator_config: &O::Config,
    checks: &[RestoreCheck],
) -> Result<Vec<f64>, ServiceError> {
    let pipeline = &config.pipeline;
    let codec = Codec::new::<O>(pipeline).map_err(ServiceError::Unsupported)?;
    let reader = TopicReader::new(&config.kafka, "observed")?;
    let changelog = ChangelogLoader::new(&config.kafka, &pipeline.changelog_topic(&config.kafka.group_id))?;
    let mut input = O::empty_input();
    let mut outputs = Vec::new();
    let mut observed = Vec::with_capacity(checks.len());
    for check in checks {
        let partition = check.partition;
        let logged = changelog.load_until(partition, Some(check.changelog_end as i64))?;
        let restore = |entries: &[BackupEntry]| -> Result<O, ServiceError> {
            let mut restored = O::for_partition(operator_config, partition as u32, None)?;
            restored
                .restore(entries)
                .map_err(|e| ServiceError::Restore { partition, source: e })?;
            Ok(restored)
        };
        let restored = [
            restore(&logged.entries)?,
            restore(&compacted(logged.entries.clone(), false))?,
        ];
        let mut exact = O::for_partition(operator_config, partition as u32, None)?;
        let topic = &pipeline.input_topic;
        let unreadable = |e: String| ServiceError::Unsupported(format!("reading {topic} partition {partition}: {e}"));
        let (low, _) = reader
            .watermarks(topic, partition)
            .map_err(|e| unreadable(e.to_string()))?;
        reader
            .read(topic, partition, low, check.resume_offset as i64, |message| {
                let value = rdkafka::Message::payload(message).unwrap_or_default();
                // What the pipeline refuses (dead letters) changes no state.
                if codec
                    .decode::<O>(rdkafka::Message::key(message), value, &mut input)
                    .is_ok()
                {
                    outputs.clear();
                    let _ = exact.process(&input, &mut outputs);
                }
            })
            .map_err(unreadable)?;
        let distances = restored.iter().map(|state| state.distance(&exact));
        observed.push(distances.fold(0.0, f64::max));
    }
    Ok(observed)
}
