//! From Kafka records to operator inputs and from operator outputs to records,
//! in text, JSON or Avro.
//!
//! Every operator's input and output is one record type with the fields of its
//! Avro schema in `schemas/` (compiled in); JSON records have the same fields,
//! so one serde type per schema reads and writes both. Decoding borrows from
//! the record's bytes where it can and writes into an input the task reuses.

use std::borrow::Cow;
use std::io::Write as _;
use std::path::Path;

use apache_avro::schema_compatibility::SchemaCompatibility;
use apache_avro::types::Value;
use apache_avro::Schema;
use serde::{Deserialize, Serialize};

use super::config::{AvroConfig, Format, Framing, GrepConfig, PipelineConfig};
use crate::core::{CoreError, KeyStore, Operator};
use crate::operators::heavy_hitters::{FlowPacket, HeavyHitter, HeavyHitterConfig, HeavyHitters};
use crate::operators::keyed_aggregation::{KeyUpdate, KeyedAggregation, KeyedAggregationConfig, KeyedValue};
use crate::operators::logistic_regression::{LabeledVector, LogisticConfig, OnlineLogisticRegression, Prediction};
use crate::operators::online_join::{JoinConfig, JoinEstimate, JoinTuple, OnlineJoin, Side};
use crate::operators::word_count::{WordCount, WordCountConfig};
use crate::operators::{
    DistributedSgdConfig, GlobalModel, Grep, LocalModel, ModelAverager, SgdWorker, Tokenize, TokenizeConfig,
};

/// The workloads' schemas, as shipped in `schemas/`.
pub mod schemas {
    pub const TEXT_LINE: &str = include_str!("../../schemas/text_line.avsc");
    pub const FLOW_PACKET: &str = include_str!("../../schemas/flow_packet.avsc");
    pub const HEAVY_HITTER: &str = include_str!("../../schemas/heavy_hitter.avsc");
    pub const KEYED_VALUE: &str = include_str!("../../schemas/keyed_value.avsc");
    pub const LABELED_VECTOR: &str = include_str!("../../schemas/labeled_vector.avsc");
    pub const PREDICTION: &str = include_str!("../../schemas/prediction.avsc");
    pub const JOIN_TUPLE: &str = include_str!("../../schemas/join_tuple.avsc");
    pub const JOIN_ESTIMATE: &str = include_str!("../../schemas/join_estimate.avsc");
    pub const LOCAL_MODEL: &str = include_str!("../../schemas/local_model.avsc");
    pub const GLOBAL_MODEL: &str = include_str!("../../schemas/global_model.avsc");
}

/// An operator the service can run: how it is built, how a record becomes its
/// input and how its output becomes a record.
pub trait ServiceOperator: Operator + Send + Sized {
    type Config: Clone + Sync;

    /// Whether the operator keeps its keyed state in a local store when the
    /// pipeline has a state directory (small states stay in memory and recover
    /// from the changelog).
    const STORE_BACKED: bool;

    /// The Avro schema of its input records.
    const INPUT_SCHEMA: &'static str;
    /// The Avro schema of its output records.
    const OUTPUT_SCHEMA: &'static str;

    /// An input record: the fields of [`Self::INPUT_SCHEMA`].
    type Record<'a>: Deserialize<'a> + Serialize;
    /// An output record: the fields of [`Self::OUTPUT_SCHEMA`].
    type OutputRecord<'a>: Serialize;

    /// Builds the operator, its keyed state in `store` (with about
    /// `resident_keys` clean keys in memory) when one is given.
    fn build(config: &Self::Config, store: Option<(Box<dyn KeyStore>, usize)>) -> Result<Self, CoreError>;

    /// Builds the task of input partition `partition` (operators whose tasks
    /// differ by partition, such as a distributed worker, override this).
    fn for_partition(
        config: &Self::Config,
        partition: u32,
        store: Option<(Box<dyn KeyStore>, usize)>,
    ) -> Result<Self, CoreError> {
        let _ = partition;
        Self::build(config, store)
    }

    /// Takes in a record of the pipeline's feedback topic (`feedback_topic`: a
    /// topic every task reads besides its input, such as a distributed
    /// learner's global model), decoded by `codec`. Returns how far it moved
    /// the state (the operator's divergence function).
    fn feedback(&mut self, codec: &Codec, value: &[u8]) -> Result<f64, String> {
        let _ = (codec, value);
        Err("this operator reads no feedback topic".into())
    }

    /// The codec of the pipeline's feedback topic, for an operator that reads
    /// one (it must: a pipeline without `feedback_topic` is refused), or None.
    fn feedback_codec(pipeline: &PipelineConfig) -> Result<Option<Codec>, String> {
        let _ = pipeline;
        Ok(None)
    }

    /// Checks that the input's partition count suits the operator.
    fn check_partitions(config: &Self::Config, partitions: usize) -> Result<(), String> {
        let _ = (config, partitions);
        Ok(())
    }

    /// How many partitions its output topic needs when this pipeline creates it
    /// (None: as many as the input has). A distributed worker's models go to
    /// one averaging task, so one.
    fn output_partitions(config: &Self::Config) -> Option<usize> {
        let _ = config;
        None
    }

    /// An input to decode into.
    fn empty_input() -> Self::Input;

    /// Reads a decoded record into `input`; the error says why it is not a
    /// valid input.
    fn from_record(record: Self::Record<'_>, input: &mut Self::Input) -> Result<(), String>;

    /// Reads a text record (`format = "text"`, for operators that allow it).
    fn from_text(key: Option<&[u8]>, value: &[u8], input: &mut Self::Input) -> Result<(), String> {
        let _ = (key, value, input);
        Err("this operator does not read text".into())
    }

    /// The Kafka key a producer gives an input record, so that the records a
    /// task must see together share a partition.
    fn input_key(record: &Self::Record<'_>) -> Option<Vec<u8>> {
        let _ = record;
        None
    }

    /// The input record in text format, for operators that read text.
    fn input_text(record: &Self::Record<'_>) -> Option<Vec<u8>> {
        let _ = record;
        None
    }

    /// The output as a record.
    fn to_record(output: &Self::Output) -> Self::OutputRecord<'_>;

    /// The output record's Kafka key, if it has one.
    fn output_key(output: &Self::Output) -> Option<&[u8]> {
        let _ = output;
        None
    }

    /// The output as text (`format = "text"`); by default its record in JSON.
    fn to_text(output: &Self::Output, value: &mut Vec<u8>) {
        let _ = serde_json::to_writer(value, &Self::to_record(output));
    }
}

/// How a pipeline reads and writes record values.
pub enum Codec {
    Text,
    Json,
    Avro(Box<AvroCodec>),
}

impl Codec {
    /// The codec of a pipeline running operator `O`; reads the configured
    /// writer schema, if any.
    pub fn new<O: ServiceOperator>(pipeline: &PipelineConfig) -> Result<Self, String> {
        Self::for_format::<O>(pipeline.format, pipeline.avro.as_ref())
    }

    pub fn for_format<O: ServiceOperator>(format: Format, avro: Option<&AvroConfig>) -> Result<Self, String> {
        Ok(match format {
            Format::Text => Codec::Text,
            Format::Json => Codec::Json,
            Format::Avro => Codec::Avro(Box::new(AvroCodec::new::<O>(&avro.cloned().unwrap_or_default())?)),
        })
    }

    /// Decodes a record into `input`; the error says why it does not decode.
    pub fn decode<O: ServiceOperator>(
        &self,
        key: Option<&[u8]>,
        value: &[u8],
        input: &mut O::Input,
    ) -> Result<(), String> {
        match self {
            Codec::Text => O::from_text(key, value, input),
            Codec::Json => {
                let record: O::Record<'_> = serde_json::from_slice(value).map_err(|e| format!("JSON: {e}"))?;
                O::from_record(record, input)
            }
            Codec::Avro(avro) => {
                let datum = avro.read(value)?;
                let record: O::Record<'_> = apache_avro::from_value(&datum).map_err(|e| format!("Avro: {e}"))?;
                O::from_record(record, input)
            }
        }
    }

    /// Encodes an output's key and value (both cleared first); returns whether
    /// it has a key.
    pub fn encode<O: ServiceOperator>(
        &self,
        output: &O::Output,
        key: &mut Vec<u8>,
        value: &mut Vec<u8>,
    ) -> Result<bool, String> {
        key.clear();
        value.clear();
        let keyed = O::output_key(output).map(|k| key.extend_from_slice(k)).is_some();
        match self {
            Codec::Text => O::to_text(output, value),
            Codec::Json => serde_json::to_writer(&mut *value, &O::to_record(output)).map_err(|e| e.to_string())?,
            Codec::Avro(avro) => avro.write(&O::to_record(output), value)?,
        }
        Ok(keyed)
    }

    /// An output record's fields as JSON (for comparing outputs with the
    /// exact answer). Text outputs have their `key`, their text as `line` and,
    /// when it is a number, as `value`.
    pub fn output_fields<O: ServiceOperator>(
        &self,
        key: Option<&str>,
        value: &[u8],
    ) -> Result<serde_json::Value, String> {
        match self {
            Codec::Text => {
                let text = utf8(value)?;
                Ok(serde_json::json!({ "key": key, "line": text, "value": text.trim().parse::<f64>().ok() }))
            }
            Codec::Json => serde_json::from_slice(value).map_err(|e| format!("JSON: {e}")),
            Codec::Avro(avro) => serde_json::Value::try_from(avro.read_output(value)?).map_err(|e| e.to_string()),
        }
    }

    /// Encodes an input record (what `afstream produce` writes); text takes the
    /// record's text form.
    pub fn encode_input<O: ServiceOperator>(&self, record: &O::Record<'_>, value: &mut Vec<u8>) -> Result<(), String> {
        value.clear();
        match self {
            Codec::Text => return Err("text records are written as they are".into()),
            Codec::Json => serde_json::to_writer(&mut *value, record).map_err(|e| e.to_string())?,
            Codec::Avro(avro) => avro.write_input(record, value)?,
        }
        Ok(())
    }
}

/// Avro datums of one workload, plain or in Confluent's wire format.
pub struct AvroCodec {
    /// The schema inputs were written with.
    writer: Schema,
    /// The workload's input schema, when it differs from the writer's (the
    /// datum is resolved against it: fields added with defaults, removed,
    /// promoted).
    reader: Option<Schema>,
    output: Schema,
    input_framing: Framing,
    input_schema_id: Option<u32>,
    output_schema_id: Option<u32>,
}

/// Confluent's wire format: this byte, then the schema id in 4 bytes, big-endian.
pub const CONFLUENT_MAGIC: u8 = 0;

impl AvroCodec {
    pub fn new<O: ServiceOperator>(config: &AvroConfig) -> Result<Self, String> {
        let input = parse_schema(O::INPUT_SCHEMA, "built-in input")?;
        let output = parse_schema(O::OUTPUT_SCHEMA, "built-in output")?;
        let writer = match &config.input_schema {
            Some(path) => read_schema(path)?,
            None => input.clone(),
        };
        let reader = if writer.canonical_form() == input.canonical_form() {
            None
        } else {
            SchemaCompatibility::can_read(&writer, &input).map_err(|e| {
                format!(
                    "`pipeline.avro.input_schema`: records written with it cannot be read as {}: {e}",
                    schema_name(&input)
                )
            })?;
            Some(input)
        };
        Ok(AvroCodec {
            writer,
            reader,
            output,
            input_framing: config.input_framing,
            input_schema_id: config.input_schema_id,
            output_schema_id: config.output_schema_id,
        })
    }

    /// Reads one input datum.
    pub fn read(&self, bytes: &[u8]) -> Result<Value, String> {
        let mut body = match self.input_framing {
            Framing::Plain => bytes,
            Framing::Confluent => {
                let (id, body) = confluent_header(bytes)?;
                if let Some(expected) = self.input_schema_id.filter(|&expected| expected != id) {
                    return Err(format!(
                        "written with schema id {id}; this pipeline reads schema id {expected} \
                         (pipeline.avro.input_schema_id)"
                    ));
                }
                body
            }
        };
        let value = apache_avro::from_avro_datum(&self.writer, &mut body, self.reader.as_ref())
            .map_err(|e| format!("not an Avro {}: {e}", schema_name(&self.writer)))?;
        if !body.is_empty() {
            return Err(format!(
                "{} bytes left after an Avro {}",
                body.len(),
                schema_name(&self.writer)
            ));
        }
        Ok(value)
    }

    /// Reads one output datum as written by [`AvroCodec::write`].
    pub fn read_output(&self, bytes: &[u8]) -> Result<Value, String> {
        let mut body = match self.output_schema_id {
            None => bytes,
            Some(expected) => match confluent_header(bytes)? {
                (id, body) if id == expected => body,
                (id, _) => return Err(format!("output written with schema id {id}, not {expected}")),
            },
        };
        let value = apache_avro::from_avro_datum(&self.output, &mut body, None)
            .map_err(|e| format!("not an Avro {}: {e}", schema_name(&self.output)))?;
        match body.len() {
            0 => Ok(value),
            left => Err(format!("{left} bytes left after an Avro {}", schema_name(&self.output))),
        }
    }

    /// Writes one output datum (after Confluent's header when configured).
    pub fn write<T: Serialize>(&self, record: &T, out: &mut Vec<u8>) -> Result<(), String> {
        write_datum(&self.output, self.output_schema_id, record, out)
    }

    /// Writes one input datum as this pipeline reads them (for producers).
    pub fn write_input<T: Serialize>(&self, record: &T, out: &mut Vec<u8>) -> Result<(), String> {
        let id = match self.input_framing {
            Framing::Plain => None,
            Framing::Confluent => Some(self.input_schema_id.unwrap_or(0)),
        };
        write_datum(&self.writer, id, record, out)
    }
}

/// The schema id and the datum of a record in Confluent's wire format.
pub fn confluent_header(bytes: &[u8]) -> Result<(u32, &[u8]), String> {
    match bytes {
        [CONFLUENT_MAGIC, a, b, c, d, body @ ..] => Ok((u32::from_be_bytes([*a, *b, *c, *d]), body)),
        [magic, ..] if *magic != CONFLUENT_MAGIC => Err(format!(
            "not in Confluent's wire format: magic byte {magic:#04x}, expected 0x00 (plain Avro needs \
             pipeline.avro.input_framing = \"plain\")"
        )),
        _ => Err(format!(
            "{} bytes: too short for Confluent's wire format (magic byte and schema id)",
            bytes.len()
        )),
    }
}

fn write_datum<T: Serialize>(
    schema: &Schema,
    schema_id: Option<u32>,
    record: &T,
    out: &mut Vec<u8>,
) -> Result<(), String> {
    if let Some(id) = schema_id {
        out.push(CONFLUENT_MAGIC);
        out.extend_from_slice(&id.to_be_bytes());
    }
    apache_avro::write_avro_datum_ref(schema, record, out)
        .map(drop)
        .map_err(|e| format!("writing an Avro {}: {e}", schema_name(schema)))
}

fn schema_name(schema: &Schema) -> String {
    schema
        .name()
        .map_or_else(|| "datum".to_string(), |name| name.fullname(None))
}

fn parse_schema(text: &str, what: &str) -> Result<Schema, String> {
    Schema::parse_str(text).map_err(|e| format!("the {what} Avro schema: {e}"))
}

fn read_schema(path: &Path) -> Result<Schema, String> {
    let text =
        std::fs::read_to_string(path).map_err(|e| format!("`pipeline.avro.input_schema` = {}: {e}", path.display()))?;
    Schema::parse_str(&text).map_err(|e| format!("`pipeline.avro.input_schema` = {}: {e}", path.display()))
}

/// `afstream.TextLine`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TextLineRecord<'a> {
    #[serde(borrow)]
    pub line: Cow<'a, str>,
}

/// `afstream.FlowPacket`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FlowPacketRecord<'a> {
    #[serde(borrow)]
    pub flow: Cow<'a, str>,
    pub bytes: i64,
}

/// `afstream.HeavyHitter`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HeavyHitterRecord<'a> {
    #[serde(borrow)]
    pub flow: Cow<'a, str>,
    pub estimate: f64,
}

/// `afstream.KeyedValue`. In JSON the value may be left out when counting.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KeyedValueRecord<'a> {
    #[serde(borrow)]
    pub key: Cow<'a, str>,
    #[serde(default = "one")]
    pub value: f64,
}

fn one() -> f64 {
    1.0
}

/// `afstream.LabeledVector`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LabeledVectorRecord {
    pub label: bool,
    pub features: Vec<FeatureRecord>,
}

/// `afstream.Feature`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct FeatureRecord {
    pub index: i64,
    pub value: f64,
}

/// `afstream.Prediction`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct PredictionRecord {
    pub probability: f64,
    pub label: bool,
    pub correct: bool,
}

/// `afstream.Weight`: one weight of a model.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct WeightRecord {
    pub slot: i32,
    pub weight: f64,
}

fn weight_records(weights: &[(u32, f64)]) -> Vec<WeightRecord> {
    weights
        .iter()
        .map(|&(slot, weight)| WeightRecord {
            slot: slot as i32,
            weight,
        })
        .collect()
}

fn weights_of(records: &[WeightRecord]) -> Result<Vec<(u32, f64)>, String> {
    records
        .iter()
        .map(|w| match u32::try_from(w.slot) {
            Ok(slot) if w.weight.is_finite() => Ok((slot, w.weight)),
            _ => Err(format!("weight {} in slot {}", w.weight, w.slot)),
        })
        .collect()
}

/// `afstream.LocalModel`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LocalModelRecord {
    pub worker: i32,
    pub iteration: i64,
    pub items: i64,
    pub loss: f64,
    pub accuracy: f64,
    pub weights: Vec<WeightRecord>,
}

/// `afstream.GlobalModel`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GlobalModelRecord {
    pub clock: i64,
    pub version: i64,
    pub workers: i32,
    pub items: i64,
    pub loss: f64,
    pub accuracy: f64,
    pub weights_l1: f64,
    pub weights: Vec<WeightRecord>,
    /// Each worker's iteration in the average (absent in records written
    /// before it: empty).
    #[serde(default)]
    pub iterations: Vec<i64>,
}

impl GlobalModelRecord {
    pub fn to_model(&self) -> Result<GlobalModel, String> {
        let count = |name: &str, n: i64| u64::try_from(n).map_err(|_| format!("`{name}` = {n} is negative"));
        Ok(GlobalModel {
            clock: count("clock", self.clock)?,
            version: count("version", self.version)?,
            workers: u32::try_from(self.workers).map_err(|_| format!("`workers` = {} is negative", self.workers))?,
            items: count("items", self.items)?,
            loss: self.loss,
            accuracy: self.accuracy,
            weights_l1: self.weights_l1,
            weights: weights_of(&self.weights)?,
            iterations: self
                .iterations
                .iter()
                .map(|&i| count("iterations", i))
                .collect::<Result<_, _>>()?,
        })
    }
}

/// `afstream.JoinTuple`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct JoinTupleRecord<'a> {
    #[serde(borrow)]
    pub side: Cow<'a, str>,
    pub id: i64,
    pub key: i64,
    pub value: f64,
}

/// `afstream.JoinEstimate`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct JoinEstimateRecord {
    pub count: f64,
    pub count_ci95: f64,
    pub sum: f64,
    pub sum_ci95: f64,
    pub sampled: i64,
}

fn utf8(bytes: &[u8]) -> Result<&str, String> {
    std::str::from_utf8(bytes).map_err(|e| format!("not UTF-8 text: {e}"))
}

fn non_negative(field: &str, value: i64) -> Result<u64, String> {
    u64::try_from(value).map_err(|_| format!("`{field}` = {value}: must not be negative"))
}

impl ServiceOperator for WordCount {
    type Config = WordCountConfig;
    const STORE_BACKED: bool = true;
    const INPUT_SCHEMA: &'static str = schemas::TEXT_LINE;
    const OUTPUT_SCHEMA: &'static str = schemas::KEYED_VALUE;
    type Record<'a> = TextLineRecord<'a>;
    type OutputRecord<'a> = KeyedValueRecord<'a>;

    fn build(config: &WordCountConfig, store: Option<(Box<dyn KeyStore>, usize)>) -> Result<Self, CoreError> {
        match store {
            Some((store, resident_keys)) => WordCount::with_store(*config, store, resident_keys),
            None => WordCount::new(*config),
        }
    }

    fn empty_input() -> String {
        String::new()
    }

    fn from_record(record: TextLineRecord<'_>, line: &mut String) -> Result<(), String> {
        line.clear();
        line.push_str(&record.line);
        Ok(())
    }

    fn from_text(_key: Option<&[u8]>, value: &[u8], line: &mut String) -> Result<(), String> {
        line.clear();
        line.push_str(utf8(value)?);
        Ok(())
    }

    fn input_text(record: &TextLineRecord<'_>) -> Option<Vec<u8>> {
        Some(record.line.as_bytes().to_vec())
    }

    fn to_record(update: &KeyUpdate) -> KeyedValueRecord<'_> {
        key_update_record(update)
    }

    /// Kafka Streams' convention: the word is the key, its new count the value.
    fn output_key(update: &KeyUpdate) -> Option<&[u8]> {
        Some(&update.key)
    }

    fn to_text(update: &KeyUpdate, value: &mut Vec<u8>) {
        let _ = write!(value, "{}", update.value);
    }
}

fn key_update_record(update: &KeyUpdate) -> KeyedValueRecord<'_> {
    KeyedValueRecord {
        key: String::from_utf8_lossy(&update.key),
        value: update.value,
    }
}

impl ServiceOperator for KeyedAggregation {
    type Config = KeyedAggregationConfig;
    const STORE_BACKED: bool = true;
    const INPUT_SCHEMA: &'static str = schemas::KEYED_VALUE;
    const OUTPUT_SCHEMA: &'static str = schemas::KEYED_VALUE;
    type Record<'a> = KeyedValueRecord<'a>;
    type OutputRecord<'a> = KeyedValueRecord<'a>;

    fn build(config: &KeyedAggregationConfig, store: Option<(Box<dyn KeyStore>, usize)>) -> Result<Self, CoreError> {
        match store {
            Some((store, resident_keys)) => KeyedAggregation::with_store(*config, store, resident_keys),
            None => KeyedAggregation::new(*config),
        }
    }

    fn empty_input() -> KeyedValue {
        KeyedValue {
            key: Vec::new(),
            value: 0.0,
        }
    }

    fn from_record(record: KeyedValueRecord<'_>, input: &mut KeyedValue) -> Result<(), String> {
        input.key.clear();
        input.key.extend_from_slice(record.key.as_bytes());
        input.value = record.value;
        Ok(())
    }

    /// The record's key is the key and its value a decimal number (any value,
    /// even none, when counting: only the key matters then).
    fn from_text(key: Option<&[u8]>, value: &[u8], input: &mut KeyedValue) -> Result<(), String> {
        let key = key.ok_or("the record has no key to aggregate by")?;
        input.value = match utf8(value)?.trim() {
            "" => 1.0,
            number => number
                .parse()
                .map_err(|e| format!("value {number:?} is not a number: {e}"))?,
        };
        input.key.clear();
        input.key.extend_from_slice(key);
        Ok(())
    }

    fn input_key(record: &KeyedValueRecord<'_>) -> Option<Vec<u8>> {
        Some(record.key.as_bytes().to_vec())
    }

    fn input_text(record: &KeyedValueRecord<'_>) -> Option<Vec<u8>> {
        Some(record.value.to_string().into_bytes())
    }

    fn to_record(update: &KeyUpdate) -> KeyedValueRecord<'_> {
        key_update_record(update)
    }

    fn output_key(update: &KeyUpdate) -> Option<&[u8]> {
        Some(&update.key)
    }

    fn to_text(update: &KeyUpdate, value: &mut Vec<u8>) {
        let _ = write!(value, "{}", update.value);
    }
}

impl ServiceOperator for HeavyHitters {
    type Config = HeavyHitterConfig;
    /// A Count-Min sketch and a few hundred candidates: small, in memory.
    const STORE_BACKED: bool = false;
    const INPUT_SCHEMA: &'static str = schemas::FLOW_PACKET;
    const OUTPUT_SCHEMA: &'static str = schemas::HEAVY_HITTER;
    type Record<'a> = FlowPacketRecord<'a>;
    type OutputRecord<'a> = HeavyHitterRecord<'a>;

    fn build(config: &HeavyHitterConfig, _store: Option<(Box<dyn KeyStore>, usize)>) -> Result<Self, CoreError> {
        HeavyHitters::new(*config)
    }

    fn empty_input() -> FlowPacket {
        FlowPacket {
            flow: Vec::new(),
            bytes: 0,
        }
    }

    fn from_record(record: FlowPacketRecord<'_>, packet: &mut FlowPacket) -> Result<(), String> {
        packet.bytes = non_negative("bytes", record.bytes)?;
        packet.flow.clear();
        packet.flow.extend_from_slice(record.flow.as_bytes());
        Ok(())
    }

    /// A flow's packets share a partition, so one task sees all its bytes.
    fn input_key(record: &FlowPacketRecord<'_>) -> Option<Vec<u8>> {
        Some(record.flow.as_bytes().to_vec())
    }

    fn to_record(hitter: &HeavyHitter) -> HeavyHitterRecord<'_> {
        HeavyHitterRecord {
            flow: String::from_utf8_lossy(&hitter.flow),
            estimate: hitter.estimate,
        }
    }

    /// Keyed by flow.
    fn output_key(hitter: &HeavyHitter) -> Option<&[u8]> {
        Some(&hitter.flow)
    }
}

impl ServiceOperator for Grep {
    type Config = GrepConfig;
    const STORE_BACKED: bool = false;
    const INPUT_SCHEMA: &'static str = schemas::TEXT_LINE;
    const OUTPUT_SCHEMA: &'static str = schemas::TEXT_LINE;
    type Record<'a> = TextLineRecord<'a>;
    type OutputRecord<'a> = TextLineRecord<'a>;

    fn build(config: &GrepConfig, _store: Option<(Box<dyn KeyStore>, usize)>) -> Result<Self, CoreError> {
        Grep::new(&config.pattern)
    }

    fn empty_input() -> String {
        String::new()
    }

    fn from_record(record: TextLineRecord<'_>, line: &mut String) -> Result<(), String> {
        line.clear();
        line.push_str(&record.line);
        Ok(())
    }

    fn from_text(_key: Option<&[u8]>, value: &[u8], line: &mut String) -> Result<(), String> {
        line.clear();
        line.push_str(utf8(value)?);
        Ok(())
    }

    fn input_text(record: &TextLineRecord<'_>) -> Option<Vec<u8>> {
        Some(record.line.as_bytes().to_vec())
    }

    fn to_record(line: &String) -> TextLineRecord<'_> {
        TextLineRecord {
            line: Cow::Borrowed(line),
        }
    }

    fn to_text(line: &String, value: &mut Vec<u8>) {
        value.extend_from_slice(line.as_bytes());
    }
}

impl ServiceOperator for OnlineLogisticRegression {
    type Config = LogisticConfig;
    /// 2^feature_bits weights: a dense vector, in memory.
    const STORE_BACKED: bool = false;
    const INPUT_SCHEMA: &'static str = schemas::LABELED_VECTOR;
    const OUTPUT_SCHEMA: &'static str = schemas::PREDICTION;
    type Record<'a> = LabeledVectorRecord;
    type OutputRecord<'a> = PredictionRecord;

    fn build(config: &LogisticConfig, _store: Option<(Box<dyn KeyStore>, usize)>) -> Result<Self, CoreError> {
        OnlineLogisticRegression::new(*config)
    }

    fn empty_input() -> LabeledVector {
        LabeledVector {
            label: false,
            features: Vec::new(),
        }
    }

    /// Feature indices are hashed, so a negative one is as good as any (its
    /// two's complement).
    fn from_record(record: LabeledVectorRecord, input: &mut LabeledVector) -> Result<(), String> {
        input.features.clear();
        for feature in &record.features {
            if !feature.value.is_finite() {
                return Err(format!("feature {} has value {}", feature.index, feature.value));
            }
            input.features.push((feature.index as u64, feature.value));
        }
        input.label = record.label;
        Ok(())
    }

    fn to_record(prediction: &Prediction) -> PredictionRecord {
        PredictionRecord {
            probability: prediction.probability,
            label: prediction.label,
            correct: prediction.correct,
        }
    }
}

impl ServiceOperator for SgdWorker {
    type Config = DistributedSgdConfig;
    /// 2^feature_bits weights: a dense vector, in memory.
    const STORE_BACKED: bool = false;
    const INPUT_SCHEMA: &'static str = schemas::LABELED_VECTOR;
    const OUTPUT_SCHEMA: &'static str = schemas::LOCAL_MODEL;
    type Record<'a> = LabeledVectorRecord;
    type OutputRecord<'a> = LocalModelRecord;

    /// The worker of partition 0 (what `check` and `exact` look at).
    fn build(config: &DistributedSgdConfig, store: Option<(Box<dyn KeyStore>, usize)>) -> Result<Self, CoreError> {
        Self::for_partition(config, 0, store)
    }

    fn for_partition(
        config: &DistributedSgdConfig,
        partition: u32,
        _store: Option<(Box<dyn KeyStore>, usize)>,
    ) -> Result<Self, CoreError> {
        SgdWorker::new(*config, partition)
    }

    /// The feedback topic holds the averager's global models.
    fn feedback(&mut self, codec: &Codec, value: &[u8]) -> Result<f64, String> {
        let fields = codec.output_fields::<ModelAverager>(None, value)?;
        let record: GlobalModelRecord =
            serde_json::from_value(fields).map_err(|e| format!("not a global model: {e}"))?;
        Ok(self.adopt(&record.to_model()?))
    }

    fn output_partitions(_config: &DistributedSgdConfig) -> Option<usize> {
        Some(1)
    }

    /// The averager's outputs, in the pipeline's format (Avro: plain datums).
    fn feedback_codec(pipeline: &PipelineConfig) -> Result<Option<Codec>, String> {
        Codec::for_format::<ModelAverager>(pipeline.format, None).map(Some)
    }

    fn check_partitions(config: &DistributedSgdConfig, partitions: usize) -> Result<(), String> {
        if config.workers as usize == partitions {
            Ok(())
        } else {
            Err(format!(
                "`workers` = {} but the input topic has {partitions} partitions: one worker per partition, and the \
                 averager waits for `workers` of them",
                config.workers
            ))
        }
    }

    fn empty_input() -> LabeledVector {
        <OnlineLogisticRegression as ServiceOperator>::empty_input()
    }

    fn from_record(record: LabeledVectorRecord, input: &mut LabeledVector) -> Result<(), String> {
        <OnlineLogisticRegression as ServiceOperator>::from_record(record, input)
    }

    fn to_record(model: &LocalModel) -> LocalModelRecord {
        LocalModelRecord {
            worker: model.worker as i32,
            iteration: model.iteration as i64,
            items: model.items as i64,
            loss: model.loss,
            accuracy: model.accuracy,
            weights: weight_records(&model.weights),
        }
    }
}

impl ServiceOperator for ModelAverager {
    type Config = DistributedSgdConfig;
    /// One slice of weights per worker, in memory.
    const STORE_BACKED: bool = false;
    const INPUT_SCHEMA: &'static str = schemas::LOCAL_MODEL;
    const OUTPUT_SCHEMA: &'static str = schemas::GLOBAL_MODEL;
    type Record<'a> = LocalModelRecord;
    type OutputRecord<'a> = GlobalModelRecord;

    fn build(config: &DistributedSgdConfig, _store: Option<(Box<dyn KeyStore>, usize)>) -> Result<Self, CoreError> {
        ModelAverager::new(*config)
    }

    fn empty_input() -> LocalModel {
        LocalModel {
            worker: 0,
            iteration: 0,
            items: 0,
            loss: 0.0,
            accuracy: 0.0,
            weights: Vec::new(),
        }
    }

    fn from_record(record: LocalModelRecord, model: &mut LocalModel) -> Result<(), String> {
        let count = |name: &str, n: i64| u64::try_from(n).map_err(|_| format!("`{name}` = {n} is negative"));
        model.worker = u32::try_from(record.worker).map_err(|_| format!("`worker` = {} is negative", record.worker))?;
        model.iteration = count("iteration", record.iteration)?;
        model.items = count("items", record.items)?;
        model.loss = record.loss;
        model.accuracy = record.accuracy;
        model.weights = weights_of(&record.weights)?;
        Ok(())
    }

    fn to_record(global: &GlobalModel) -> GlobalModelRecord {
        GlobalModelRecord {
            clock: global.clock as i64,
            version: global.version as i64,
            workers: global.workers as i32,
            items: global.items as i64,
            loss: global.loss,
            accuracy: global.accuracy,
            weights_l1: global.weights_l1,
            weights: weight_records(&global.weights),
            iterations: global.iterations.iter().map(|&i| i as i64).collect(),
        }
    }
}

impl ServiceOperator for OnlineJoin {
    type Config = JoinConfig;
    /// A sample of p of each stream, in memory.
    const STORE_BACKED: bool = false;
    const INPUT_SCHEMA: &'static str = schemas::JOIN_TUPLE;
    const OUTPUT_SCHEMA: &'static str = schemas::JOIN_ESTIMATE;
    type Record<'a> = JoinTupleRecord<'a>;
    type OutputRecord<'a> = JoinEstimateRecord;

    fn build(config: &JoinConfig, _store: Option<(Box<dyn KeyStore>, usize)>) -> Result<Self, CoreError> {
        OnlineJoin::new(*config)
    }

    fn empty_input() -> JoinTuple {
        JoinTuple {
            side: Side::Left,
            id: 0,
            key: 0,
            value: 0.0,
        }
    }

    fn from_record(record: JoinTupleRecord<'_>, tuple: &mut JoinTuple) -> Result<(), String> {
        tuple.side = match &*record.side {
            "left" => Side::Left,
            "right" => Side::Right,
            other => return Err(format!("`side` = {other:?}: must be \"left\" or \"right\"")),
        };
        // Two's complement keeps equality, all a key and a sampling id need.
        tuple.id = record.id as u64;
        tuple.key = record.key as u64;
        tuple.value = record.value;
        Ok(())
    }

    /// Both sides of a key share a partition, so the tasks' joins are
    /// disjoint and their estimates add up.
    fn input_key(record: &JoinTupleRecord<'_>) -> Option<Vec<u8>> {
        Some(record.key.to_string().into_bytes())
    }

    fn to_record(estimate: &JoinEstimate) -> JoinEstimateRecord {
        JoinEstimateRecord {
            count: estimate.count,
            count_ci95: estimate.count_ci95,
            sum: estimate.sum,
            sum_ci95: estimate.sum_ci95,
            sampled: i64::try_from(estimate.sampled).unwrap_or(i64::MAX),
        }
    }
}

impl ServiceOperator for Tokenize {
    type Config = TokenizeConfig;
    const STORE_BACKED: bool = false;
    const INPUT_SCHEMA: &'static str = schemas::TEXT_LINE;
    const OUTPUT_SCHEMA: &'static str = schemas::KEYED_VALUE;
    type Record<'a> = TextLineRecord<'a>;
    type OutputRecord<'a> = KeyedValueRecord<'a>;

    fn build(config: &TokenizeConfig, _store: Option<(Box<dyn KeyStore>, usize)>) -> Result<Self, CoreError> {
        Tokenize::new(*config)
    }

    fn empty_input() -> String {
        String::new()
    }

    fn from_record(record: TextLineRecord<'_>, line: &mut String) -> Result<(), String> {
        line.clear();
        line.push_str(&record.line);
        Ok(())
    }

    fn from_text(_key: Option<&[u8]>, value: &[u8], line: &mut String) -> Result<(), String> {
        line.clear();
        line.push_str(utf8(value)?);
        Ok(())
    }

    fn input_text(record: &TextLineRecord<'_>) -> Option<Vec<u8>> {
        Some(record.line.as_bytes().to_vec())
    }

    fn to_record(word: &KeyUpdate) -> KeyedValueRecord<'_> {
        key_update_record(word)
    }

    /// Keyed by the word: the next stage's partition for it.
    fn output_key(word: &KeyUpdate) -> Option<&[u8]> {
        Some(&word.key)
    }

    fn to_text(word: &KeyUpdate, value: &mut Vec<u8>) {
        let _ = write!(value, "{}", word.value);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fmt::Debug;

    fn avro(framing: Framing, input_schema_id: Option<u32>, output_schema_id: Option<u32>) -> AvroConfig {
        AvroConfig {
            input_framing: framing,
            input_schema: None,
            input_schema_id,
            output_schema_id,
        }
    }

    /// Reads an output datum back with the operator's output schema.
    fn read_output<O: ServiceOperator>(bytes: &[u8], schema_id: Option<u32>) -> Value {
        let mut body = match schema_id {
            Some(id) => {
                let (written, body) = confluent_header(bytes).expect("Confluent-framed");
                assert_eq!(written, id);
                body
            }
            None => bytes,
        };
        let schema = Schema::parse_str(O::OUTPUT_SCHEMA).expect("schema");
        let value = apache_avro::from_avro_datum(&schema, &mut body, None).expect("an output datum");
        assert!(body.is_empty(), "{} bytes left", body.len());
        value
    }

    /// An input record written as a producer would and read back as the
    /// pipeline does; an output written and read back with its schema; each
    /// plain and Confluent-framed, in Avro and in JSON.
    fn round_trip<O>(record: O::Record<'static>, input: O::Input, output: O::Output)
    where
        O: ServiceOperator,
        O::Input: PartialEq + Debug,
        for<'a> O::OutputRecord<'a>: Deserialize<'a>,
    {
        let codecs = [
            (Codec::Json, None),
            (
                Codec::for_format::<O>(Format::Avro, Some(&avro(Framing::Plain, None, None))).expect("plain"),
                None,
            ),
            (
                Codec::for_format::<O>(Format::Avro, Some(&avro(Framing::Confluent, Some(7), Some(9))))
                    .expect("confluent"),
                Some(9),
            ),
        ];
        for (codec, output_id) in &codecs {
            let mut bytes = Vec::new();
            codec.encode_input::<O>(&record, &mut bytes).expect("encodes");
            if let Codec::Avro(a) = codec {
                if a.input_framing == Framing::Confluent {
                    assert_eq!(&bytes[..5], &[0, 0, 0, 0, 7], "magic byte and schema id");
                }
            }
            let mut decoded = O::empty_input();
            codec.decode::<O>(None, &bytes, &mut decoded).expect("decodes");
            assert_eq!(decoded, input);

            let (mut key, mut value) = (Vec::new(), Vec::new());
            codec.encode::<O>(&output, &mut key, &mut value).expect("encodes");
            // Records compare by their fields (the borrowed ones live shorter).
            let fields = |record: &O::OutputRecord<'_>| serde_json::to_value(record).expect("fields");
            let expected = fields(&O::to_record(&output));
            match codec {
                Codec::Avro(_) => {
                    let datum = read_output::<O>(&value, *output_id);
                    let back: O::OutputRecord<'_> = apache_avro::from_value(&datum).expect("an output record");
                    assert_eq!(fields(&back), expected);
                }
                _ => {
                    let back: O::OutputRecord<'_> = serde_json::from_slice(&value).expect("JSON output");
                    assert_eq!(fields(&back), expected);
                }
            }
        }
    }

    fn update(key: &str, value: f64) -> KeyUpdate {
        KeyUpdate {
            key: key.as_bytes().to_vec(),
            value,
        }
    }

    #[test]
    fn every_schema_round_trips_plain_and_confluent_framed() {
        round_trip::<WordCount>(
            TextLineRecord {
                line: "to be or not".into(),
            },
            "to be or not".to_string(),
            update("be", 3.0),
        );
        round_trip::<KeyedAggregation>(
            KeyedValueRecord {
                key: "eu".into(),
                value: -2.5,
            },
            KeyedValue {
                key: b"eu".to_vec(),
                value: -2.5,
            },
            update("eu", 7.5),
        );
        round_trip::<HeavyHitters>(
            FlowPacketRecord {
                flow: "10.0.0.1:80".into(),
                bytes: 1500,
            },
            FlowPacket {
                flow: b"10.0.0.1:80".to_vec(),
                bytes: 1500,
            },
            HeavyHitter {
                flow: b"10.0.0.1:80".to_vec(),
                estimate: 12e6,
            },
        );
        round_trip::<Grep>(
            TextLineRecord {
                line: "an error here".into(),
            },
            "an error here".to_string(),
            "an error here".to_string(),
        );
        round_trip::<Tokenize>(
            TextLineRecord { line: "to be".into() },
            "to be".to_string(),
            update("be", 1.0),
        );
        round_trip::<OnlineLogisticRegression>(
            LabeledVectorRecord {
                label: true,
                features: vec![
                    FeatureRecord { index: 3, value: 0.5 },
                    FeatureRecord { index: -1, value: 2.0 },
                ],
            },
            LabeledVector {
                label: true,
                features: vec![(3, 0.5), (u64::MAX, 2.0)],
            },
            Prediction {
                probability: 0.25,
                label: true,
                correct: false,
            },
        );
        let model = LocalModel {
            worker: 2,
            iteration: 7,
            items: 7_000,
            loss: 0.5,
            accuracy: 0.75,
            weights: vec![(0, 1.5), (4096, -0.25)],
        };
        round_trip::<SgdWorker>(
            LabeledVectorRecord {
                label: false,
                features: vec![FeatureRecord { index: 1, value: 1.0 }],
            },
            LabeledVector {
                label: false,
                features: vec![(1, 1.0)],
            },
            model.clone(),
        );
        round_trip::<ModelAverager>(
            SgdWorker::to_record(&model),
            model,
            GlobalModel {
                clock: 7,
                version: 21,
                workers: 3,
                items: 21_000,
                loss: 0.5,
                accuracy: 0.75,
                weights_l1: 1.75,
                weights: vec![(0, 1.5), (4096, -0.25)],
                iterations: vec![7, 8, 7],
            },
        );
        round_trip::<OnlineJoin>(
            JoinTupleRecord {
                side: "right".into(),
                id: 11,
                key: 4,
                value: 1.5,
            },
            JoinTuple {
                side: Side::Right,
                id: 11,
                key: 4,
                value: 1.5,
            },
            JoinEstimate {
                count: 100.0,
                count_ci95: 3.5,
                sum: 250.0,
                sum_ci95: 9.0,
                sampled: 42,
            },
        );
    }

    #[test]
    fn every_shipped_schema_is_an_operators_input_or_output() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("schemas");
        let compiled = [
            schemas::TEXT_LINE,
            schemas::FLOW_PACKET,
            schemas::HEAVY_HITTER,
            schemas::KEYED_VALUE,
            schemas::LABELED_VECTOR,
            schemas::PREDICTION,
            schemas::JOIN_TUPLE,
            schemas::JOIN_ESTIMATE,
            schemas::LOCAL_MODEL,
            schemas::GLOBAL_MODEL,
        ];
        let mut files = 0;
        for entry in std::fs::read_dir(&dir).expect("schemas/") {
            let text = std::fs::read_to_string(entry.expect("entry").path()).expect("a schema");
            assert!(compiled.contains(&text.as_str()), "a schema no operator uses:\n{text}");
            files += 1;
        }
        assert_eq!(files, compiled.len());
    }

    #[test]
    fn text_lines_decode_and_counts_encode_as_kafka_streams_does() {
        let mut line = WordCount::empty_input();
        Codec::Text
            .decode::<WordCount>(None, b"to be or not", &mut line)
            .expect("text");
        assert_eq!(line, "to be or not");
        let error = Codec::Text
            .decode::<WordCount>(None, &[0xff, 0xfe], &mut line)
            .unwrap_err();
        assert!(error.contains("UTF-8"), "{error}");
        let (mut key, mut value) = (Vec::new(), Vec::new());
        let keyed = Codec::Text
            .encode::<WordCount>(&update("be", 3.0), &mut key, &mut value)
            .expect("text");
        assert!(keyed);
        assert_eq!((key.as_slice(), value.as_slice()), (&b"be"[..], &b"3"[..]));
        let keyed = Codec::Text
            .encode::<Grep>(&"an error".to_string(), &mut key, &mut value)
            .expect("text");
        assert!(!keyed, "grep's lines have no key");
        assert_eq!(value, b"an error");
    }

    #[test]
    fn keyed_numbers_decode_from_a_keyed_text_record_or_from_json() {
        let mut input = KeyedAggregation::empty_input();
        let text = |key: Option<&[u8]>, value: &[u8], input: &mut KeyedValue| {
            Codec::Text.decode::<KeyedAggregation>(key, value, input)
        };
        text(Some(b"eu"), b" 2.5 ", &mut input).expect("text");
        assert_eq!((input.key.as_slice(), input.value), (&b"eu"[..], 2.5));
        text(Some(b"us"), b"", &mut input).expect("a bare key counts one");
        assert_eq!((input.key.as_slice(), input.value), (&b"us"[..], 1.0));
        let error = text(None, b"1", &mut input).unwrap_err();
        assert!(error.contains("no key"), "{error}");
        let error = text(Some(b"k"), b"ten", &mut input).unwrap_err();
        assert!(error.contains("not a number"), "{error}");
        let json = |value: &[u8], input: &mut KeyedValue| Codec::Json.decode::<KeyedAggregation>(None, value, input);
        json(br#"{"key":"eu","value":-4}"#, &mut input).expect("json");
        assert_eq!((input.key.as_slice(), input.value), (&b"eu"[..], -4.0));
        json(br#"{"key":"us"}"#, &mut input).expect("counting needs no value");
        assert_eq!((input.key.as_slice(), input.value), (&b"us"[..], 1.0));
        let error = json(br#"{"value":1}"#, &mut input).unwrap_err();
        assert!(error.contains("key"), "{error}");
    }

    #[test]
    fn bad_records_say_why() {
        let mut packet = HeavyHitters::empty_input();
        Codec::Json
            .decode::<HeavyHitters>(None, br#"{"flow":"a\"b","bytes":1500}"#, &mut packet)
            .expect("packet");
        assert_eq!((packet.flow.as_slice(), packet.bytes), (&b"a\"b"[..], 1500));
        let json = |value: &[u8], packet: &mut FlowPacket| Codec::Json.decode::<HeavyHitters>(None, value, packet);
        assert!(json(br#"{"flow":"a"}"#, &mut packet).unwrap_err().contains("bytes"));
        assert!(json(br#"{"flow":"a","bytes":-1}"#, &mut packet)
            .unwrap_err()
            .contains("negative"));
        let mut tuple = OnlineJoin::empty_input();
        let error = Codec::Json
            .decode::<OnlineJoin>(None, br#"{"side":"up","id":1,"key":2,"value":3}"#, &mut tuple)
            .unwrap_err();
        assert!(error.contains("side"), "{error}");
        assert!(Codec::Text
            .decode::<HeavyHitters>(None, b"a 1500", &mut packet)
            .unwrap_err()
            .contains("does not read text"));

        let confluent = Codec::for_format::<HeavyHitters>(Format::Avro, Some(&avro(Framing::Confluent, Some(7), None)))
            .expect("codec");
        let mut good = Vec::new();
        confluent
            .encode_input::<HeavyHitters>(
                &FlowPacketRecord {
                    flow: "f".into(),
                    bytes: 1,
                },
                &mut good,
            )
            .expect("encodes");
        let mut decode = |bytes: &[u8]| confluent.decode::<HeavyHitters>(None, bytes, &mut packet).unwrap_err();
        assert!(
            decode(&good[5..]).contains("magic byte"),
            "plain where framed was expected"
        );
        assert!(decode(&[0, 0, 1]).contains("too short"));
        let mut other_id = good.clone();
        other_id[4] = 8;
        assert!(decode(&other_id).contains("schema id 8"));
        let mut longer = good.clone();
        longer.push(0);
        assert!(decode(&longer).contains("1 bytes left"));
        assert!(decode(&good[..good.len() - 1]).contains("not an Avro afstream.FlowPacket"));
    }

    #[test]
    fn inputs_written_with_an_older_or_newer_schema_are_resolved_against_the_workloads() {
        let dir = std::env::temp_dir().join(format!("afstream-codec-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        // A producer's newer schema: an extra field, and bytes as an int (promoted to long).
        let newer = dir.join("flow_packet_v2.avsc");
        std::fs::write(
            &newer,
            r#"{"type": "record", "name": "FlowPacket", "namespace": "afstream", "fields": [
                {"name": "protocol", "type": "string"},
                {"name": "flow", "type": "string"},
                {"name": "bytes", "type": "int"}]}"#,
        )
        .expect("schema");
        let config = AvroConfig {
            input_schema: Some(newer),
            ..avro(Framing::Plain, None, None)
        };
        let codec = Codec::for_format::<HeavyHitters>(Format::Avro, Some(&config)).expect("compatible");
        #[derive(Serialize)]
        struct PacketV2<'a> {
            protocol: &'a str,
            flow: &'a str,
            bytes: i32,
        }
        let writer = Schema::parse_str(&std::fs::read_to_string(dir.join("flow_packet_v2.avsc")).expect("read"))
            .expect("schema");
        let mut bytes = Vec::new();
        apache_avro::write_avro_datum_ref(
            &writer,
            &PacketV2 {
                protocol: "tcp",
                flow: "f",
                bytes: 60,
            },
            &mut bytes,
        )
        .expect("writes");
        let mut packet = HeavyHitters::empty_input();
        codec
            .decode::<HeavyHitters>(None, &bytes, &mut packet)
            .expect("resolved");
        assert_eq!((packet.flow.as_slice(), packet.bytes), (&b"f"[..], 60));

        let incompatible = dir.join("flow_as_long.avsc");
        std::fs::write(
            &incompatible,
            r#"{"type": "record", "name": "FlowPacket", "namespace": "afstream", "fields": [
                {"name": "flow", "type": "long"}, {"name": "bytes", "type": "long"}]}"#,
        )
        .expect("schema");
        let config = AvroConfig {
            input_schema: Some(incompatible),
            ..avro(Framing::Plain, None, None)
        };
        let error = Codec::for_format::<HeavyHitters>(Format::Avro, Some(&config))
            .err()
            .expect("incompatible");
        assert!(error.contains("pipeline.avro.input_schema"), "{error}");
        let config = AvroConfig {
            input_schema: Some(dir.join("missing.avsc")),
            ..avro(Framing::Plain, None, None)
        };
        let error = Codec::for_format::<HeavyHitters>(Format::Avro, Some(&config))
            .err()
            .expect("missing");
        assert!(error.contains("missing.avsc"), "{error}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
