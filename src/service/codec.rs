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

use super::config::{AvroConfig, Format, Framing, PipelineConfig};
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
pub trait ServiceOperator: Operator + Send + Sized + 'static {
    type Config: Clone + Send + Sync + 'static;

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

mod operators;
mod records;

pub use records::*;

fn utf8(bytes: &[u8]) -> Result<&str, String> {
    std::str::from_utf8(bytes).map_err(|e| format!("not UTF-8 text: {e}"))
}

#[cfg(test)]
mod tests;
