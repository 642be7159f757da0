//! `afstream produce`: seeded synthetic workloads into an input topic.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{BaseProducer, BaseRecord, DeliveryResult, Producer, ProducerContext};
use rdkafka::ClientContext;

use super::config::KafkaConfig;
use super::kafka::{client_config, ensure_topics, ClientRole, TopicSpec, REQUEST_TIMEOUT};
use super::ServiceError;
use crate::workloads;

/// One input record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InputRecord {
    pub key: Option<Vec<u8>>,
    pub value: Vec<u8>,
}

/// Text lines of Zipf-distributed words (WordCount's input), unkeyed.
pub fn text_records(lines: usize, seed: u64) -> Vec<InputRecord> {
    workloads::text_lines(lines, 8, 2_000, seed)
        .into_iter()
        .map(|line| InputRecord {
            key: None,
            value: line.into_bytes(),
        })
        .collect()
}

/// Packets of Zipf-distributed flows as JSON (heavy hitters' input), keyed by
/// flow so that a flow's packets share a partition (and a task).
pub fn packet_records(packets: usize, seed: u64) -> Vec<InputRecord> {
    workloads::zipf_flows(packets, 10_000, 1.1, seed)
        .into_iter()
        .map(|packet| {
            let flow = String::from_utf8_lossy(&packet.flow).into_owned();
            InputRecord {
                value: serde_json::json!({ "flow": flow, "bytes": packet.bytes })
                    .to_string()
                    .into_bytes(),
                key: Some(packet.flow),
            }
        })
        .collect()
}

/// Counts failed deliveries, keeping the first error.
#[derive(Default)]
struct Failures {
    count: AtomicU64,
    first: Mutex<Option<String>>,
}

impl ClientContext for Failures {}

impl ProducerContext for Failures {
    type DeliveryOpaque = ();

    fn delivery(&self, result: &DeliveryResult<'_>, _: ()) {
        if let Err((error, _)) = result {
            self.count.fetch_add(1, Ordering::Relaxed);
            if let Ok(mut first) = self.first.lock() {
                first.get_or_insert_with(|| error.to_string());
            }
        }
    }
}

/// Produces records to `topic` (created with `partitions` when missing) and
/// waits until every one is acknowledged.
pub fn produce(
    kafka: &KafkaConfig,
    topic: &str,
    partitions: usize,
    records: &[InputRecord],
) -> Result<(), ServiceError> {
    ensure_topics(
        kafka,
        &[TopicSpec {
            name: topic,
            partitions,
            compacted: false,
        }],
    )?;
    let producer: BaseProducer<Failures> = client_config(
        kafka,
        ClientRole::Producer,
        &[("enable.idempotence", "true"), ("linger.ms", "20")],
    )
    .create_with_context(Failures::default())?;
    for record in records {
        let mut base: BaseRecord<'_, [u8], [u8], ()> = BaseRecord::to(topic).payload(record.value.as_slice());
        if let Some(key) = &record.key {
            base = base.key(key.as_slice());
        }
        loop {
            match producer.send(base) {
                Ok(()) => break,
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                    producer.poll(Duration::from_millis(10));
                    base = back;
                }
                Err((error, _)) => return Err(error.into()),
            }
        }
        producer.poll(Duration::ZERO);
    }
    producer.flush(REQUEST_TIMEOUT * 6)?;
    let failed = producer.context().count.load(Ordering::Relaxed);
    if failed > 0 {
        let first = producer
            .context()
            .first
            .lock()
            .ok()
            .and_then(|f| f.clone())
            .unwrap_or_default();
        return Err(ServiceError::Produce(format!(
            "{failed} of {} records to {topic} were not delivered; first error: {first}",
            records.len()
        )));
    }
    Ok(())
}
