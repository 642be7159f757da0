//! How each operator kind meets the service: its config section, its input
//! and output records and their text form, its feedback, its partitions.

use super::records::{weight_records, weights_of};
use super::*;
use crate::service::config::GrepConfig;

fn non_negative(field: &str, value: i64) -> Result<u64, String> {
    u64::try_from(value).map_err(|_| format!("`{field}` = {value}: must not be negative"))
}

/// A text line into the input the task reuses (the operators that read lines).
fn read_line(text: &str, line: &mut String) -> Result<(), String> {
    line.clear();
    line.push_str(text);
    Ok(())
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
        read_line(&record.line, line)
    }

    fn from_text(_key: Option<&[u8]>, value: &[u8], line: &mut String) -> Result<(), String> {
        read_line(utf8(value)?, line)
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
        read_line(&record.line, line)
    }

    fn from_text(_key: Option<&[u8]>, value: &[u8], line: &mut String) -> Result<(), String> {
        read_line(utf8(value)?, line)
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
        read_line(&record.line, line)
    }

    fn from_text(_key: Option<&[u8]>, value: &[u8], line: &mut String) -> Result<(), String> {
        read_line(utf8(value)?, line)
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
