//! `afstream produce`: workloads into an input topic, seeded synthetic data or
//! a file (text lines, CSV rows, JSON lines), in text, JSON or Avro, at a rate
//! limit if asked, with a progress bar on a terminal.

use std::io::BufRead;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{BaseRecord, DeliveryResult, Producer, ProducerContext};
use rdkafka::ClientContext;

use crate::operators::{HeavyHitters, KeyedAggregation, OnlineJoin, OnlineLogisticRegression, Side, WordCount};
use crate::service::clients::idempotent_producer;
use crate::service::codec::{
    Codec, FeatureRecord, FlowPacketRecord, JoinTupleRecord, KeyedValueRecord, LabeledVectorRecord, ServiceOperator,
    TextLineRecord,
};
use crate::service::config::{AvroConfig, Format, KafkaConfig};
use crate::service::kafka::{ensure_topics, TopicSpec, REQUEST_TIMEOUT};
use crate::service::ServiceError;
use crate::workloads;

/// One input record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InputRecord {
    pub key: Option<Vec<u8>>,
    pub value: Vec<u8>,
}

/// What a workload's records are: each is the input of one operator, with
/// that operator's schema.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Workload {
    /// Text lines (`afstream.TextLine`), for word_count and grep; synthetic:
    /// Zipf-distributed words.
    Text,
    /// Network packets (`afstream.FlowPacket`), keyed by flow, for
    /// heavy_hitters; synthetic: Zipf-distributed flows with realistic sizes.
    Packets,
    /// Keyed numbers (`afstream.KeyedValue`), keyed by key, for
    /// keyed_aggregation; synthetic: Zipf-distributed keys.
    Keyed,
    /// Labelled sparse vectors (`afstream.LabeledVector`), for
    /// logistic_regression; synthetic: linearly separable by known weights.
    Vectors,
    /// Tuples of two streams (`afstream.JoinTuple`), keyed by join key, for
    /// online_join; synthetic: Zipf-distributed keys.
    Join,
}

/// Runs `$body` with `$operator` the operator whose input a workload is.
macro_rules! with_workload {
    ($workload:expr, |$operator:ident| $body:expr) => {
        match $workload {
            Workload::Text => {
                type $operator = WordCount;
                $body
            }
            Workload::Packets => {
                type $operator = HeavyHitters;
                $body
            }
            Workload::Keyed => {
                type $operator = KeyedAggregation;
                $body
            }
            Workload::Vectors => {
                type $operator = OnlineLogisticRegression;
                $body
            }
            Workload::Join => {
                type $operator = OnlineJoin;
                $body
            }
        }
    };
}

/// How a file's records are laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum FileFormat {
    /// One text line per record (the text workload).
    Lines,
    /// A header row naming the schema's fields, then one row per record.
    Csv,
    /// One JSON object per line with the schema's fields.
    JsonLines,
}

impl FileFormat {
    /// The layout a file's extension names: `.csv`, `.jsonl` or `.json`, else text lines.
    pub fn of(path: &Path) -> FileFormat {
        match path.extension().and_then(|e| e.to_str()) {
            Some("csv") => FileFormat::Csv,
            Some("jsonl" | "json") => FileFormat::JsonLines,
            _ => FileFormat::Lines,
        }
    }
}

/// Encodes a workload's records as a pipeline reading them expects.
pub struct Encoder {
    workload: Workload,
    codec: Codec,
}

impl Encoder {
    pub fn new(workload: Workload, format: Format, avro: Option<&AvroConfig>) -> Result<Self, String> {
        if format == Format::Text && !matches!(workload, Workload::Text | Workload::Keyed) {
            return Err(format!(
                "{workload:?} records have fields: produce them as json or avro, not text"
            ));
        }
        let codec = with_workload!(workload, |O| Codec::for_format::<O>(format, avro))?;
        Ok(Encoder { workload, codec })
    }

    fn encode<O: ServiceOperator>(&self, record: &O::Record<'_>) -> Result<InputRecord, String> {
        let value = match &self.codec {
            Codec::Text => O::input_text(record).ok_or("this workload has no text form")?,
            codec => {
                let mut value = Vec::new();
                codec.encode_input::<O>(record, &mut value)?;
                value
            }
        };
        Ok(InputRecord {
            key: O::input_key(record),
            value,
        })
    }

    /// `items` seeded synthetic records.
    pub fn synthetic(&self, items: usize, seed: u64) -> Result<Vec<InputRecord>, String> {
        match self.workload {
            Workload::Text => workloads::text_lines(items, 8, 2_000, seed)
                .iter()
                .map(|line| self.encode::<WordCount>(&TextLineRecord { line: line.into() }))
                .collect(),
            Workload::Packets => workloads::zipf_flows(items, 10_000, 1.1, seed)
                .iter()
                .map(|packet| {
                    self.encode::<HeavyHitters>(&FlowPacketRecord {
                        flow: String::from_utf8_lossy(&packet.flow),
                        bytes: i64::try_from(packet.bytes).unwrap_or(i64::MAX),
                    })
                })
                .collect(),
            Workload::Keyed => workloads::keyed_values(items, 10_000, seed)
                .iter()
                .map(|keyed| {
                    self.encode::<KeyedAggregation>(&KeyedValueRecord {
                        key: String::from_utf8_lossy(&keyed.key),
                        value: keyed.value,
                    })
                })
                .collect(),
            Workload::Vectors => workloads::separable_vectors(items, VECTOR_FEATURES, 10, seed)
                .0
                .iter()
                .map(|vector| {
                    self.encode::<OnlineLogisticRegression>(&LabeledVectorRecord {
                        label: vector.label,
                        features: vector
                            .features
                            .iter()
                            .map(|&(index, value)| FeatureRecord {
                                index: index as i64,
                                value,
                            })
                            .collect(),
                    })
                })
                .collect(),
            Workload::Join => workloads::join_streams(items, 1_000, seed)
                .iter()
                .map(|tuple| {
                    self.encode::<OnlineJoin>(&JoinTupleRecord {
                        side: match tuple.side {
                            Side::Left => "left".into(),
                            Side::Right => "right".into(),
                        },
                        id: tuple.id as i64,
                        key: tuple.key as i64,
                        value: tuple.value,
                    })
                })
                .collect(),
        }
    }

    /// A record from one JSON object with the workload's fields.
    pub fn from_json(&self, text: &str) -> Result<InputRecord, String> {
        with_workload!(self.workload, |O| {
            let record: <O as ServiceOperator>::Record<'_> = serde_json::from_str(text).map_err(|e| e.to_string())?;
            self.encode::<O>(&record)
        })
    }

    /// A record from one CSV row whose header names the workload's fields.
    pub fn from_csv(&self, headers: &csv::StringRecord, row: &csv::StringRecord) -> Result<InputRecord, String> {
        if self.workload == Workload::Vectors {
            return Err(
                "labelled vectors hold a list of features, which CSV cannot: use --file-format json-lines".into(),
            );
        }
        with_workload!(self.workload, |O| {
            let record: <O as ServiceOperator>::Record<'_> =
                row.deserialize(Some(headers)).map_err(|e| e.to_string())?;
            self.encode::<O>(&record)
        })
    }

    /// A record from one text line (the text workload).
    pub fn from_line(&self, line: &str) -> Result<InputRecord, String> {
        match self.workload {
            Workload::Text => self.encode::<WordCount>(&TextLineRecord { line: line.into() }),
            other => Err(format!(
                "{other:?} records have fields: read them with --file-format csv or json-lines"
            )),
        }
    }

    /// The records of a file, read as they are produced; an error names the
    /// line it is on.
    pub fn file(
        &self,
        path: &Path,
        layout: FileFormat,
    ) -> Result<Box<dyn Iterator<Item = Result<InputRecord, String>> + '_>, String> {
        let file = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let name = path.display().to_string();
        match layout {
            FileFormat::Lines | FileFormat::JsonLines => {
                let lines = std::io::BufReader::new(file).lines().enumerate();
                Ok(Box::new(lines.filter_map(move |(n, line)| {
                    let line = match line {
                        Ok(line) => line,
                        Err(e) => return Some(Err(format!("{name} line {}: {e}", n + 1))),
                    };
                    let record = match layout {
                        FileFormat::JsonLines if line.trim().is_empty() => return None,
                        FileFormat::JsonLines => self.from_json(&line),
                        _ => self.from_line(&line),
                    };
                    Some(record.map_err(|e| format!("{name} line {}: {e}", n + 1)))
                })))
            }
            FileFormat::Csv => {
                let mut reader = csv::Reader::from_reader(file);
                let headers = reader.headers().map_err(|e| format!("{name}: {e}"))?.clone();
                Ok(Box::new(reader.into_records().map(move |row| {
                    let row = row.map_err(|e| format!("{name}: {e}"))?;
                    let line = row.position().map_or(0, |p| p.line());
                    self.from_csv(&headers, &row)
                        .map_err(|e| format!("{name} line {line}: {e}"))
                })))
            }
        }
    }
}

/// Features of the synthetic labelled vectors (10 set per item).
pub const VECTOR_FEATURES: u64 = 1_000;

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
pub fn packet_records(packets: usize, seed: u64) -> Result<Vec<InputRecord>, String> {
    Encoder::new(Workload::Packets, Format::Json, None)?.synthetic(packets, seed)
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

/// How `produce_from` paces and shows its work.
#[derive(Clone, Debug, Default)]
pub struct ProduceOptions {
    /// At most this many records a second.
    pub rate: Option<f64>,
    /// Show a progress bar on stderr when it is a terminal, of this many
    /// records when known.
    pub progress: Option<Option<u64>>,
    /// Every record to this partition (else by key, as the client's
    /// partitioner places it).
    pub partition: Option<i32>,
}

/// What was produced.
#[derive(Clone, Debug, PartialEq)]
pub struct ProduceSummary {
    pub records: u64,
    /// Keys and values.
    pub bytes: u64,
    pub elapsed: Duration,
}

/// Produces records to `topic` (created with `partitions` when missing) and
/// waits until every one is acknowledged.
pub fn produce(
    kafka: &KafkaConfig,
    topic: &str,
    partitions: usize,
    records: &[InputRecord],
) -> Result<ProduceSummary, ServiceError> {
    produce_from(
        kafka,
        topic,
        partitions,
        records.iter().map(|r| Ok(r.clone())),
        &ProduceOptions::default(),
    )
}

/// Produces records as they come; a bad one stops it (after the ones before
/// it are delivered) with its reason.
pub fn produce_from(
    kafka: &KafkaConfig,
    topic: &str,
    partitions: usize,
    records: impl IntoIterator<Item = Result<InputRecord, String>>,
    options: &ProduceOptions,
) -> Result<ProduceSummary, ServiceError> {
    ensure_topics(
        kafka,
        &[TopicSpec {
            name: topic,
            partitions,
            compacted: false,
        }],
    )?;
    let producer = idempotent_producer(kafka, "20", &[], Failures::default())?;
    let progress = match options.progress {
        Some(Some(total)) => ProgressBar::new(total),
        Some(None) => ProgressBar::new_spinner(),
        None => ProgressBar::hidden(),
    };
    if let Ok(style) =
        ProgressStyle::with_template("{spinner} {bar:40} {human_pos}/{human_len} records, {per_sec}, eta {eta}")
    {
        progress.set_style(style);
    }
    let started = Instant::now();
    let mut summary = ProduceSummary {
        records: 0,
        bytes: 0,
        elapsed: Duration::ZERO,
    };
    let mut bad_record = None;
    for record in records {
        let record = match record {
            Ok(record) => record,
            Err(reason) => {
                bad_record = Some(reason);
                break;
            }
        };
        if let Some(rate) = options.rate {
            let due = started + Duration::from_secs_f64(summary.records as f64 / rate);
            while Instant::now() < due {
                producer.poll(
                    due.saturating_duration_since(Instant::now())
                        .min(Duration::from_millis(50)),
                );
            }
        }
        let mut base: BaseRecord<'_, [u8], [u8], ()> = BaseRecord::to(topic).payload(record.value.as_slice());
        if let Some(key) = &record.key {
            base = base.key(key.as_slice());
        }
        if let Some(partition) = options.partition {
            base = base.partition(partition);
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
        summary.records += 1;
        summary.bytes += (record.value.len() + record.key.as_ref().map_or(0, Vec::len)) as u64;
        progress.inc(1);
    }
    producer.flush(REQUEST_TIMEOUT * 6)?;
    progress.finish_and_clear();
    summary.elapsed = started.elapsed();
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
            summary.records
        )));
    }
    if let Some(reason) = bad_record {
        return Err(ServiceError::Produce(format!(
            "{reason}; the {} records before it were written to {topic}",
            summary.records
        )));
    }
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::service::config::Framing;

    #[test]
    fn every_workload_is_produced_as_its_pipeline_reads_it() {
        let avro = AvroConfig {
            input_framing: Framing::Confluent,
            input_schema_id: Some(5),
            ..AvroConfig::default()
        };
        for workload in [
            Workload::Text,
            Workload::Packets,
            Workload::Keyed,
            Workload::Vectors,
            Workload::Join,
        ] {
            for (format, avro) in [(Format::Json, None), (Format::Avro, Some(&avro))] {
                let encoder = Encoder::new(workload, format, avro).expect("encoder");
                let records = encoder.synthetic(50, 3).expect("records");
                assert_eq!(records.len(), 50);
                assert_eq!(records, encoder.synthetic(50, 3).expect("again"), "seeded");
                with_workload!(workload, |O| {
                    let codec = Codec::for_format::<O>(format, avro).expect("codec");
                    let mut input = O::empty_input();
                    for record in &records {
                        codec
                            .decode::<O>(record.key.as_deref(), &record.value, &mut input)
                            .unwrap_or_else(|e| panic!("{workload:?} as {format:?}: {e}"));
                    }
                });
            }
        }
        assert!(Encoder::new(Workload::Packets, Format::Text, None).is_err());
    }

    #[test]
    fn files_are_read_row_by_row_and_a_bad_row_names_its_line() {
        let dir = std::env::temp_dir().join(format!("afstream-produce-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let csv = dir.join("packets.csv");
        std::fs::write(&csv, "flow,bytes\na,1500\nb,40\nc,lots\n").expect("csv");
        let encoder = Encoder::new(Workload::Packets, Format::Json, None).expect("encoder");
        let rows: Vec<_> = encoder.file(&csv, FileFormat::Csv).expect("opens").collect();
        assert_eq!(rows.len(), 3);
        let first = rows[0].as_ref().expect("a good row");
        assert_eq!(first.key.as_deref(), Some(&b"a"[..]));
        assert_eq!(first.value, br#"{"flow":"a","bytes":1500}"#);
        let error = rows[2].as_ref().unwrap_err();
        assert!(error.contains("line 4") && error.contains("packets.csv"), "{error}");

        let json = dir.join("keyed.jsonl");
        std::fs::write(&json, "{\"key\":\"eu\",\"value\":2}\n\n{\"value\":1}\n").expect("json");
        let encoder = Encoder::new(Workload::Keyed, Format::Text, None).expect("encoder");
        let rows: Vec<_> = encoder.file(&json, FileFormat::JsonLines).expect("opens").collect();
        assert_eq!(rows.len(), 2, "the blank line is skipped");
        let first = rows[0].as_ref().expect("a good row");
        assert_eq!(
            (first.key.as_deref(), first.value.as_slice()),
            (Some(&b"eu"[..]), &b"2"[..])
        );
        assert!(rows[1].as_ref().unwrap_err().contains("line 3"));

        let lines = dir.join("lines.txt");
        std::fs::write(&lines, "to be\nor not\n").expect("lines");
        let encoder = Encoder::new(Workload::Text, Format::Text, None).expect("encoder");
        let rows: Result<Vec<_>, _> = encoder.file(&lines, FileFormat::Lines).expect("opens").collect();
        assert_eq!(rows.expect("lines")[1].value, b"or not");
        let encoder = Encoder::new(Workload::Packets, Format::Json, None).expect("encoder");
        assert!(encoder.file(&dir.join("missing.csv"), FileFormat::Csv).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
