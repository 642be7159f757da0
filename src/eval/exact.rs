//! `afstream exact`: the exact answer of a pipeline's workload, computed from
//! its input topic as it is now, and how far the pipeline's output topic is
//! from it.
//!
//! The input is read with the pipeline's own codec and operator, so records
//! the pipeline refuses (dead letters) are left out here too. Per-key outputs
//! (WordCount, keyed aggregation) compare the latest output of each key with
//! its exact value: exact when every key's records share one input partition
//! (keyed input, as `afstream produce` writes it), since each task counts its
//! own partition.

use std::collections::{BTreeMap, HashSet};

use serde::Serialize;
use serde_json::Value as Json;

use super::produce::Workload;
use crate::core::Operator;
use crate::operators::heavy_hitters::detection_accuracy;
use crate::operators::online_join::{exact_join, relative_error};
use crate::operators::{
    GlobalModel, Grep, HeavyHitters, HitterThreshold, KeyedAggregation, LabeledVector, LocalModel, ModelAverager,
    OnlineJoin, OnlineLogisticRegression, SgdWorker, Tokenize, WordCount,
};
use crate::service::codec::{Codec, ServiceOperator};
use crate::service::config::{Config, OperatorConfig};
use crate::service::kafka::{partition_count, KafkaSetupError, TopicReader};
use crate::service::ServiceError;

/// Keys listed by name when some are missing or unexpected.
const KEYS_LISTED: usize = 10;

/// The exact answer, and the pipeline's output against it when asked.
#[derive(Clone, Debug, Serialize)]
pub struct ExactReport {
    pub kind: &'static str,
    pub input_topic: String,
    pub input_records: u64,
    /// Records that do not decode, or that the operator refuses: not counted.
    pub refused_records: u64,
    pub answer: Answer,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub comparison: Option<Comparison>,
}

#[derive(Clone, Debug, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Answer {
    /// WordCount's counts, keyed aggregation's aggregates.
    PerKey {
        keys: usize,
        total: f64,
        values: BTreeMap<String, f64>,
    },
    /// Every flow's exact bytes; the heavy hitters are those at or over the threshold.
    HeavyHitters {
        total_bytes: f64,
        threshold_bytes: f64,
        hitters: BTreeMap<String, f64>,
    },
    /// The lines grep passes.
    Matches { lines: u64 },
    /// A failure-free run, one model per input partition as the tasks train.
    Predictions { items: u64, accuracy: f64, log_loss: f64 },
    /// The join's exact COUNT and SUM.
    Join { count: f64, sum: f64 },
}

#[derive(Clone, Debug, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Comparison {
    PerKey {
        output_records: u64,
        output_keys: usize,
        /// Σ |latest output − exact| over every key of either side.
        l1_error: f64,
        max_error: f64,
        worst_key: Option<String>,
        /// Exact keys with no output, and how many (the list holds the first ones).
        missing: usize,
        missing_keys: Vec<String>,
        /// Output keys the exact answer does not have.
        unexpected: usize,
        unexpected_keys: Vec<String>,
    },
    HeavyHitters {
        reported: usize,
        precision: f64,
        recall: f64,
        f1: f64,
        /// The largest |estimate − exact bytes| / exact bytes of a reported flow.
        worst_relative_error: f64,
    },
    Matches {
        output_lines: u64,
        /// Output lines minus exact matches (positive: duplicates from replays).
        difference: i64,
    },
    Predictions {
        output_items: u64,
        accuracy: f64,
        log_loss: f64,
        /// Accuracy and log-loss over the run: the outputs of each partition cut
        /// into tenths, the i-th tenths of all partitions scored together.
        over_time: Vec<PredictionWindow>,
    },
    Join {
        /// The latest estimate, with one input partition (each task estimates its own).
        count_relative_error: Option<f64>,
        sum_relative_error: Option<f64>,
        output_records: u64,
    },
}

/// The predictions of one stretch of a run.
#[derive(Clone, Debug, Serialize)]
pub struct PredictionWindow {
    /// How far into the run it ends (0.1 … 1.0).
    pub progress: f64,
    pub predictions: u64,
    pub accuracy: f64,
    pub log_loss: f64,
}

/// Windows of a run's predictions: tenths of each partition's outputs.
const PREDICTION_WINDOWS: usize = 10;

/// Scores predictions (probability, label, correct) over the run and per window.
fn score_predictions(outputs: &[OutputFields]) -> (f64, f64, Vec<PredictionWindow>) {
    let score = |o: &OutputFields| {
        let probability = number(&o.fields, "probability");
        let label = o.fields.get("label").and_then(Json::as_bool).unwrap_or(false);
        let correct = o.fields.get("correct").and_then(Json::as_bool) == Some(true);
        (
            correct,
            crate::operators::logistic_regression::log_loss(probability, label),
        )
    };
    let mut windows = vec![(0u64, 0u64, 0.0f64); PREDICTION_WINDOWS];
    let mut start = 0;
    while start < outputs.len() {
        let partition = outputs[start].partition;
        let end = start + outputs[start..].iter().take_while(|o| o.partition == partition).count();
        let count = end - start;
        for (index, output) in outputs[start..end].iter().enumerate() {
            let window = index * PREDICTION_WINDOWS / count;
            let (correct, loss) = score(output);
            let w = &mut windows[window];
            w.0 += 1;
            w.1 += u64::from(correct);
            w.2 += loss;
        }
        start = end;
    }
    let (total, correct, loss) = windows
        .iter()
        .fold((0, 0, 0.0), |(n, c, l), w| (n + w.0, c + w.1, l + w.2));
    let over_time = windows
        .iter()
        .enumerate()
        .filter(|(_, w)| w.0 > 0)
        .map(|(i, w)| PredictionWindow {
            progress: (i + 1) as f64 / PREDICTION_WINDOWS as f64,
            predictions: w.0,
            accuracy: w.1 as f64 / w.0 as f64,
            log_loss: w.2 / w.0 as f64,
        })
        .collect();
    let n = total.max(1) as f64;
    (correct as f64 / n, loss / n, over_time)
}

/// Reads the pipeline's input topic (and with `compare`, its output topic).
pub fn exact(config: &Config, compare: bool) -> Result<ExactReport, ServiceError> {
    crate::with_operator!(&config.pipeline.operator, |O, c| {
        let built = O::build(c, None)?;
        answer::<O>(config, built, compare)
    })
}

fn answer<O: ServiceOperator + Answering>(
    config: &Config,
    operator: O,
    compare: bool,
) -> Result<ExactReport, ServiceError> {
    let pipeline = &config.pipeline;
    let codec = Codec::new::<O>(pipeline).map_err(ServiceError::Unsupported)?;
    let reader = TopicReader::new(&config.kafka, "exact")?;
    let partitions = partition_count(&config.kafka, &pipeline.input_topic)?
        .ok_or_else(|| KafkaSetupError::MissingTopic(pipeline.input_topic.clone()))?;
    let mut state = O::start(operator, partitions);
    let mut input = O::empty_input();
    let mut outputs = Vec::new();
    let (mut records, mut refused) = (0u64, 0u64);
    for partition in 0..partitions as i32 {
        reader
            .read_all(&pipeline.input_topic, partition, |message| {
                records += 1;
                let value = rdkafka::Message::payload(message).unwrap_or_default();
                if codec
                    .decode::<O>(rdkafka::Message::key(message), value, &mut input)
                    .is_err()
                {
                    refused += 1;
                    return;
                }
                outputs.clear();
                if !state.take(partition, &input, &mut outputs) {
                    refused += 1;
                }
            })
            .map_err(|e| ServiceError::Unsupported(format!("reading {}: {e}", pipeline.input_topic)))?;
    }
    let answer = state.answer(config);
    let comparison = if compare {
        let outputs = read_outputs::<O>(config, &codec, &reader)?;
        Some(O::compare(&answer, &outputs, partitions))
    } else {
        None
    };
    Ok(ExactReport {
        kind: pipeline.operator.kind(),
        input_topic: pipeline.input_topic.clone(),
        input_records: records,
        refused_records: refused,
        answer,
        comparison,
    })
}

/// An output record: its key, and its fields as JSON.
pub struct OutputFields {
    /// The output partition it was read from (outputs are read partition by
    /// partition, each in its order).
    pub partition: i32,
    pub key: Option<String>,
    pub fields: Json,
}

fn read_outputs<O: ServiceOperator>(
    config: &Config,
    codec: &Codec,
    reader: &TopicReader,
) -> Result<Vec<OutputFields>, ServiceError> {
    let topic = &config.pipeline.output_topic;
    let partitions =
        partition_count(&config.kafka, topic)?.ok_or_else(|| KafkaSetupError::MissingTopic(topic.clone()))?;
    let mut outputs = Vec::new();
    let mut bad = None;
    for partition in 0..partitions as i32 {
        reader
            .read_all(topic, partition, |message| {
                let key = rdkafka::Message::key(message).map(|k| String::from_utf8_lossy(k).into_owned());
                let value = rdkafka::Message::payload(message).unwrap_or_default();
                match codec.output_fields::<O>(key.as_deref(), value) {
                    Ok(fields) => outputs.push(OutputFields { partition, key, fields }),
                    Err(e) => {
                        bad.get_or_insert_with(|| format!("{topic} partition {partition}: {e}"));
                    }
                }
            })
            .map_err(|e| ServiceError::Unsupported(format!("reading {topic}: {e}")))?;
    }
    match bad {
        Some(reason) => Err(ServiceError::Unsupported(format!(
            "an output record does not decode: {reason}"
        ))),
        None => Ok(outputs),
    }
}

fn number(fields: &Json, name: &str) -> f64 {
    fields.get(name).and_then(Json::as_f64).unwrap_or(f64::NAN)
}

/// The workload a producer writes for a pipeline running `operator` (each
/// kind's [`Answering::WORKLOAD`]).
pub fn producer_workload(operator: &OperatorConfig) -> Workload {
    crate::with_operator!(operator, |O, _config| <O as Answering>::WORKLOAD)
}

/// How an operator's exact answer is computed and compared.
pub trait Answering: Operator + Sized {
    /// The records `afstream produce` writes for a pipeline running it (for
    /// a pipeline that reads another's output, those of the first one).
    const WORKLOAD: Workload;
    type State: ExactState<Self>;
    fn start(operator: Self, partitions: usize) -> Self::State;
    fn compare(answer: &Answer, outputs: &[OutputFields], partitions: usize) -> Comparison;
}

pub trait ExactState<O: Operator> {
    /// Takes one input of `partition`; false if the operator refuses it.
    fn take(&mut self, partition: i32, input: &O::Input, outputs: &mut Vec<O::Output>) -> bool;
    fn answer(self, config: &Config) -> Answer;
}

/// One operator over all the input (per-key state is the same however the
/// keys are split into tasks).
pub struct OverAllInput<O>(O);

impl<O: Operator> OverAllInput<O> {
    fn take(&mut self, input: &O::Input, outputs: &mut Vec<O::Output>) -> bool {
        self.0.process(input, outputs).is_ok()
    }
}

fn per_key(values: BTreeMap<String, f64>) -> Answer {
    Answer::PerKey {
        keys: values.len(),
        total: values.values().sum(),
        values,
    }
}

/// Each key's latest output value against its exact value.
fn compare_per_key(answer: &Answer, outputs: &[OutputFields]) -> Comparison {
    let mut latest: BTreeMap<&str, f64> = BTreeMap::new();
    for output in outputs {
        if let Some(key) = &output.key {
            latest.insert(key, number(&output.fields, "value"));
        }
    }
    compare_values(answer, &latest, outputs.len() as u64)
}

/// Each key's value in the output (`output_records` records) against its exact value.
fn compare_values(answer: &Answer, latest: &BTreeMap<&str, f64>, output_records: u64) -> Comparison {
    let empty = BTreeMap::new();
    let exact = match answer {
        Answer::PerKey { values, .. } => values,
        _ => &empty,
    };
    let (mut l1, mut max_error, mut worst_key) = (0.0, 0.0, None);
    let (mut missing, mut missing_count) = (Vec::new(), 0);
    for (key, &value) in exact {
        let error = (latest.get(key.as_str()).copied().unwrap_or(0.0) - value).abs();
        if !latest.contains_key(key.as_str()) {
            missing_count += 1;
            if missing.len() < KEYS_LISTED {
                missing.push(key.clone());
            }
        }
        l1 += error;
        if error > max_error {
            (max_error, worst_key) = (error, Some(key.clone()));
        }
    }
    let (mut unexpected, mut unexpected_count) = (Vec::new(), 0);
    for (key, value) in latest {
        if !exact.contains_key(*key) {
            l1 += value.abs();
            unexpected_count += 1;
            if unexpected.len() < KEYS_LISTED {
                unexpected.push((*key).to_string());
            }
        }
    }
    Comparison::PerKey {
        output_records,
        output_keys: latest.len(),
        l1_error: l1,
        max_error,
        worst_key,
        missing: missing_count,
        missing_keys: missing,
        unexpected: unexpected_count,
        unexpected_keys: unexpected,
    }
}

impl ExactState<WordCount> for OverAllInput<WordCount> {
    fn take(&mut self, _: i32, input: &String, outputs: &mut Vec<<WordCount as Operator>::Output>) -> bool {
        OverAllInput::take(self, input, outputs)
    }

    fn answer(self, _: &Config) -> Answer {
        per_key(self.0.iter().map(|(word, count)| (word.clone(), count)).collect())
    }
}

impl Answering for WordCount {
    const WORKLOAD: Workload = Workload::Text;
    type State = OverAllInput<WordCount>;
    fn start(operator: Self, _: usize) -> Self::State {
        OverAllInput(operator)
    }
    fn compare(answer: &Answer, outputs: &[OutputFields], _: usize) -> Comparison {
        compare_per_key(answer, outputs)
    }
}

/// The words a tokenizer emits, counted: compared with how often each word
/// appears in the output.
pub struct Occurrences(Tokenize, BTreeMap<String, f64>);

impl ExactState<Tokenize> for Occurrences {
    fn take(&mut self, _: i32, line: &String, outputs: &mut Vec<<Tokenize as Operator>::Output>) -> bool {
        if self.0.process(line, outputs).is_err() {
            return false;
        }
        for word in outputs.iter() {
            *self
                .1
                .entry(String::from_utf8_lossy(&word.key).into_owned())
                .or_default() += 1.0;
        }
        true
    }

    fn answer(self, _: &Config) -> Answer {
        per_key(self.1)
    }
}

impl Answering for Tokenize {
    const WORKLOAD: Workload = Workload::Text;
    type State = Occurrences;
    fn start(operator: Self, _: usize) -> Self::State {
        Occurrences(operator, BTreeMap::new())
    }
    /// Each output is one occurrence: counted per key, not the latest value.
    fn compare(answer: &Answer, outputs: &[OutputFields], _: usize) -> Comparison {
        let mut counted: BTreeMap<&str, f64> = BTreeMap::new();
        for output in outputs {
            if let Some(key) = &output.key {
                *counted.entry(key).or_default() += 1.0;
            }
        }
        compare_values(answer, &counted, outputs.len() as u64)
    }
}

impl ExactState<KeyedAggregation> for OverAllInput<KeyedAggregation> {
    fn take(
        &mut self,
        _: i32,
        input: &<KeyedAggregation as Operator>::Input,
        outputs: &mut Vec<<KeyedAggregation as Operator>::Output>,
    ) -> bool {
        OverAllInput::take(self, input, outputs)
    }

    fn answer(self, _: &Config) -> Answer {
        per_key(
            self.0
                .iter()
                .map(|(key, value)| (String::from_utf8_lossy(key).into_owned(), value))
                .collect(),
        )
    }
}

impl Answering for KeyedAggregation {
    const WORKLOAD: Workload = Workload::Keyed;
    type State = OverAllInput<KeyedAggregation>;
    fn start(operator: Self, _: usize) -> Self::State {
        OverAllInput(operator)
    }
    fn compare(answer: &Answer, outputs: &[OutputFields], _: usize) -> Comparison {
        compare_per_key(answer, outputs)
    }
}

/// Exact bytes per flow; the sketch only decides which packets it refuses.
pub struct FlowBytes {
    sketch: HeavyHitters,
    flows: BTreeMap<String, f64>,
}

impl ExactState<HeavyHitters> for FlowBytes {
    fn take(
        &mut self,
        _: i32,
        packet: &<HeavyHitters as Operator>::Input,
        outputs: &mut Vec<<HeavyHitters as Operator>::Output>,
    ) -> bool {
        if self.sketch.process(packet, outputs).is_err() {
            return false;
        }
        *self
            .flows
            .entry(String::from_utf8_lossy(&packet.flow).into_owned())
            .or_default() += packet.bytes as f64;
        true
    }

    fn answer(self, _: &Config) -> Answer {
        let total_bytes: f64 = self.flows.values().sum();
        let threshold_bytes = match self.sketch.config().threshold {
            HitterThreshold::Bytes(bytes) => bytes,
            HitterThreshold::Fraction(fraction) => fraction * total_bytes,
        };
        Answer::HeavyHitters {
            total_bytes,
            threshold_bytes,
            hitters: self
                .flows
                .into_iter()
                .filter(|(_, bytes)| *bytes >= threshold_bytes)
                .collect(),
        }
    }
}

impl Answering for HeavyHitters {
    const WORKLOAD: Workload = Workload::Packets;
    type State = FlowBytes;
    fn start(sketch: Self, _: usize) -> FlowBytes {
        FlowBytes {
            sketch,
            flows: BTreeMap::new(),
        }
    }

    fn compare(answer: &Answer, outputs: &[OutputFields], _: usize) -> Comparison {
        let empty = BTreeMap::new();
        let truth = match answer {
            Answer::HeavyHitters { hitters, .. } => hitters,
            _ => &empty,
        };
        let mut worst: f64 = 0.0;
        let mut reported = HashSet::new();
        for output in outputs {
            let Some(flow) = &output.key else { continue };
            reported.insert(flow.clone());
            if let Some(exact) = truth.get(flow) {
                worst = worst.max((number(&output.fields, "estimate") - exact).abs() / exact);
            }
        }
        let truth: HashSet<String> = truth.keys().cloned().collect();
        let accuracy = detection_accuracy(&reported, &truth);
        Comparison::HeavyHitters {
            reported: reported.len(),
            precision: accuracy.precision,
            recall: accuracy.recall,
            f1: accuracy.f1,
            worst_relative_error: worst,
        }
    }
}

pub struct Matches(Grep, u64);

impl ExactState<Grep> for Matches {
    fn take(&mut self, _: i32, line: &String, outputs: &mut Vec<String>) -> bool {
        let ok = self.0.process(line, outputs).is_ok();
        self.1 += outputs.len() as u64;
        ok
    }

    fn answer(self, _: &Config) -> Answer {
        Answer::Matches { lines: self.1 }
    }
}

impl Answering for Grep {
    const WORKLOAD: Workload = Workload::Text;
    type State = Matches;
    fn start(grep: Self, _: usize) -> Matches {
        Matches(grep, 0)
    }
    fn compare(answer: &Answer, outputs: &[OutputFields], _: usize) -> Comparison {
        let lines = match answer {
            Answer::Matches { lines } => *lines,
            _ => 0,
        };
        Comparison::Matches {
            output_lines: outputs.len() as u64,
            difference: outputs.len() as i64 - lines as i64,
        }
    }
}

/// One model per partition, as the tasks train.
pub struct Models(Vec<OnlineLogisticRegression>);

impl ExactState<OnlineLogisticRegression> for Models {
    fn take(
        &mut self,
        partition: i32,
        input: &<OnlineLogisticRegression as Operator>::Input,
        outputs: &mut Vec<<OnlineLogisticRegression as Operator>::Output>,
    ) -> bool {
        self.0
            .get_mut(partition as usize)
            .is_some_and(|model| model.process(input, outputs).is_ok())
    }

    fn answer(self, _: &Config) -> Answer {
        let items: u64 = self.0.iter().map(OnlineLogisticRegression::steps).sum();
        let weighted = |f: fn(&OnlineLogisticRegression) -> f64| {
            self.0.iter().map(|m| f(m) * m.steps() as f64).sum::<f64>() / (items.max(1) as f64)
        };
        Answer::Predictions {
            items,
            accuracy: weighted(OnlineLogisticRegression::accuracy),
            log_loss: weighted(OnlineLogisticRegression::log_loss),
        }
    }
}

impl Answering for OnlineLogisticRegression {
    const WORKLOAD: Workload = Workload::Vectors;
    type State = Models;
    fn start(model: Self, partitions: usize) -> Models {
        Models(vec![model; partitions])
    }
    fn compare(_: &Answer, outputs: &[OutputFields], _: usize) -> Comparison {
        let (accuracy, log_loss, over_time) = score_predictions(outputs);
        Comparison::Predictions {
            output_items: outputs.len() as u64,
            accuracy,
            log_loss,
            over_time,
        }
    }
}

/// A distributed learner's reference: one learner trained on all the input,
/// in partition order (no averaging, no waiting).
pub struct SingleLearner(OnlineLogisticRegression);

impl ExactState<SgdWorker> for SingleLearner {
    fn take(&mut self, _: i32, input: &LabeledVector, _: &mut Vec<LocalModel>) -> bool {
        self.0.process(input, &mut Vec::new()).is_ok()
    }

    fn answer(self, _: &Config) -> Answer {
        Answer::Predictions {
            items: self.0.steps(),
            accuracy: self.0.accuracy(),
            log_loss: self.0.log_loss(),
        }
    }
}

/// The progressive scores in model records (`accuracy`, `loss`): their mean.
fn score_models(outputs: &[OutputFields]) -> Comparison {
    let n = outputs.len().max(1) as f64;
    Comparison::Predictions {
        output_items: outputs.len() as u64,
        accuracy: outputs.iter().map(|o| number(&o.fields, "accuracy")).sum::<f64>() / n,
        log_loss: outputs.iter().map(|o| number(&o.fields, "loss")).sum::<f64>() / n,
        over_time: Vec::new(),
    }
}

impl Answering for SgdWorker {
    const WORKLOAD: Workload = Workload::Vectors;
    type State = SingleLearner;
    fn start(worker: Self, _: usize) -> SingleLearner {
        SingleLearner(worker.model().clone())
    }
    /// The workers' iterations, scored as they trained.
    fn compare(_: &Answer, outputs: &[OutputFields], _: usize) -> Comparison {
        score_models(outputs)
    }
}

/// The averager's input is the workers' models: their latest scores.
pub struct LatestModels(BTreeMap<u32, LocalModel>);

impl ExactState<ModelAverager> for LatestModels {
    fn take(&mut self, _: i32, model: &LocalModel, _: &mut Vec<GlobalModel>) -> bool {
        let newer = self.0.get(&model.worker).is_none_or(|m| m.items <= model.items);
        if newer {
            self.0.insert(model.worker, model.clone());
        }
        true
    }

    fn answer(self, _: &Config) -> Answer {
        let n = self.0.len().max(1) as f64;
        Answer::Predictions {
            items: self.0.values().map(|m| m.items).sum(),
            accuracy: self.0.values().map(|m| m.accuracy).sum::<f64>() / n,
            log_loss: self.0.values().map(|m| m.loss).sum::<f64>() / n,
        }
    }
}

impl Answering for ModelAverager {
    const WORKLOAD: Workload = Workload::Vectors;
    type State = LatestModels;
    fn start(_: Self, _: usize) -> LatestModels {
        LatestModels(BTreeMap::new())
    }
    /// The global models' scores (the mean of the workers' latest).
    fn compare(_: &Answer, outputs: &[OutputFields], _: usize) -> Comparison {
        score_models(outputs.last().map(std::slice::from_ref).unwrap_or_default())
    }
}

pub struct Tuples(Vec<<OnlineJoin as Operator>::Input>);

impl ExactState<OnlineJoin> for Tuples {
    fn take(
        &mut self,
        _: i32,
        tuple: &<OnlineJoin as Operator>::Input,
        _: &mut Vec<<OnlineJoin as Operator>::Output>,
    ) -> bool {
        self.0.push(tuple.clone());
        true
    }

    fn answer(self, _: &Config) -> Answer {
        let (count, sum) = exact_join(&self.0);
        Answer::Join { count, sum }
    }
}

impl Answering for OnlineJoin {
    const WORKLOAD: Workload = Workload::Join;
    type State = Tuples;
    fn start(_: Self, _: usize) -> Tuples {
        Tuples(Vec::new())
    }
    fn compare(answer: &Answer, outputs: &[OutputFields], partitions: usize) -> Comparison {
        let (count, sum) = match answer {
            Answer::Join { count, sum } => (*count, *sum),
            _ => (f64::NAN, f64::NAN),
        };
        let latest = outputs.last().filter(|_| partitions == 1);
        Comparison::Join {
            count_relative_error: latest.map(|o| relative_error(number(&o.fields, "count"), count)),
            sum_relative_error: latest.map(|o| relative_error(number(&o.fields, "sum"), sum)),
            output_records: outputs.len() as u64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prediction(partition: i32, probability: f64, label: bool) -> OutputFields {
        OutputFields {
            partition,
            key: None,
            fields: serde_json::json!({
                "probability": probability,
                "label": label,
                "correct": (probability >= 0.5) == label,
            }),
        }
    }

    #[test]
    fn predictions_are_scored_over_the_run_in_tenths_of_each_partition() {
        // Partition 0: 20 predictions, wrong in its first half; partition 1: 10,
        // all right.
        let mut outputs: Vec<OutputFields> = (0..20).map(|i| prediction(0, 0.9, i >= 10)).collect();
        outputs.extend((0..10).map(|_| prediction(1, 0.2, false)));
        let (accuracy, log_loss, over_time) = score_predictions(&outputs);
        assert!((accuracy - 20.0 / 30.0).abs() < 1e-12, "{accuracy}");
        let expected_loss = (10.0 * -(0.1f64).ln() + 10.0 * -(0.9f64).ln() + 10.0 * -(0.8f64).ln()) / 30.0;
        assert!((log_loss - expected_loss).abs() < 1e-12, "{log_loss}");
        assert_eq!(over_time.len(), 10);
        assert!(over_time.iter().all(|w| w.predictions == 3), "{over_time:?}");
        // The first half of the run: partition 0 wrong, partition 1 right.
        assert!((over_time[0].accuracy - 1.0 / 3.0).abs() < 1e-12);
        assert!((over_time[9].accuracy - 1.0).abs() < 1e-12);
        assert!((over_time[9].progress - 1.0).abs() < 1e-12);
    }
}
