//! The serde types of the workloads' schemas (`schemas/`): one per schema,
//! read and written as JSON or Avro, borrowing from the record where it can.

use std::borrow::Cow;

use serde::{Deserialize, Serialize};

use crate::operators::GlobalModel;

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
    #[serde(default = "a_count_of_one")]
    pub value: f64,
}

/// A keyed value without one counts its key once.
fn a_count_of_one() -> f64 {
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

pub(super) fn weight_records(weights: &[(u32, f64)]) -> Vec<WeightRecord> {
    weights
        .iter()
        .map(|&(slot, weight)| WeightRecord {
            slot: slot as i32,
            weight,
        })
        .collect()
}

pub(super) fn weights_of(records: &[WeightRecord]) -> Result<Vec<(u32, f64)>, String> {
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
