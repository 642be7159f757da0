//! Online logistic regression trained by SGD on hashed sparse features.
//!
//! Every labelled input is first predicted (a progressive, test-then-train
//! evaluation: accuracy and log-loss accumulate over the stream), then the weights
//! take one step with η_t = η0/√t. Feature ids are hashed into 2^bits weights (the
//! hashing trick); a bias weight comes last.
//!
//! Divergence: the Euclidean distance of the weights from their backup. A step is
//! clipped to at most η0·R (R = `max_feature_norm`: the input is scaled down to norm R
//! when it is longer), so one item moves the weights by at most η0·R. The norm is
//! that of the step itself: features that share a weight (a feature repeated in
//! the list, or two that collide in the hash) are added up before it is taken,
//! since n copies of a feature move their weight n times. Replaying an
//! item on a slightly different model gives a different step, so two runs can move
//! apart by both steps: α = 2·η0·R. β = 1 (one prediction per input).
//!
//! An item is refused when a value, the sum of the values sharing a weight,
//! or its margin (the weights' dot product with it) is not a finite number:
//! a step on it would make a weight NaN or infinite for good.

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64;

use crate::batch::BackupBatch;
use crate::entry::BackupEntry;
use crate::error::CoreError;
use crate::operator::{
    acknowledge_all, backup_all, fail_all, restore_all, set_theta_all, AnalysisConstants, BackupScope, Operator,
    ProcessError, Rejected,
};
use crate::structures::{Norm, Tracked, TrackedValue, TrackedVector};

const WEIGHTS: u8 = 1;
const STEPS: u8 = 2;
const CORRECT: u8 = 3;
const LOSS: u8 = 4;

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogisticConfig {
    /// log2 of the number of hashed weights.
    pub feature_bits: u32,
    /// η0 of η_t = η0/√t.
    pub learning_rate: f64,
    /// R: inputs longer than this are scaled down to it.
    pub max_feature_norm: f64,
}

impl Default for LogisticConfig {
    fn default() -> Self {
        LogisticConfig {
            feature_bits: 18,
            learning_rate: 0.5,
            max_feature_norm: 10.0,
        }
    }
}

/// A labelled sparse feature vector.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LabeledVector {
    pub label: bool,
    /// (feature id, value) pairs.
    pub features: Vec<(u64, f64)>,
}

/// The prediction made for one input before training on it.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Prediction {
    pub probability: f64,
    pub label: bool,
    pub correct: bool,
}

#[derive(Clone, Debug)]
pub struct OnlineLogisticRegression {
    config: LogisticConfig,
    mask: u64,
    weights: TrackedVector,
    steps: TrackedValue,
    correct: TrackedValue,
    loss: TrackedValue,
    slots: Vec<(u32, f64)>,
}

fn sigmoid(z: f64) -> f64 {
    1.0 / (1.0 + (-z).exp())
}

impl OnlineLogisticRegression {
    pub fn new(config: LogisticConfig) -> Result<Self, CoreError> {
        if !(1..=30).contains(&config.feature_bits) {
            return Err(CoreError::parameter(
                "feature_bits",
                config.feature_bits,
                "between 1 and 30",
            ));
        }
        if !(config.learning_rate.is_finite() && config.learning_rate > 0.0) {
            return Err(CoreError::parameter(
                "learning_rate",
                config.learning_rate,
                "a positive number",
            ));
        }
        if !(config.max_feature_norm.is_finite() && config.max_feature_norm > 0.0) {
            return Err(CoreError::parameter(
                "max_feature_norm",
                config.max_feature_norm,
                "a positive number",
            ));
        }
        let dims = 1usize << config.feature_bits;
        Ok(OnlineLogisticRegression {
            config,
            mask: (dims - 1) as u64,
            weights: TrackedVector::new(WEIGHTS, Norm::L2, dims + 1)?,
            steps: TrackedValue::new(STEPS),
            correct: TrackedValue::new(CORRECT),
            loss: TrackedValue::new(LOSS),
            slots: Vec::new(),
        })
    }

    fn bias_slot(&self) -> u32 {
        (self.mask + 1) as u32
    }

    fn slot(&self, feature: u64) -> u32 {
        (xxh3_64(&feature.to_le_bytes()) & self.mask) as u32
    }

    /// The item's features in their weights' slots, the values of those that
    /// share a slot added up; returns the squared norm of that step's input
    /// with the bias's. Refused when a value or a slot's sum is not finite.
    fn hashed(&self, item: &LabeledVector, slots: &mut Vec<(u32, f64)>) -> Result<f64, Rejected> {
        slots.clear();
        for &(feature, x) in &item.features {
            if !x.is_finite() {
                return Err(Rejected(format!(
                    "feature {feature} has value {x}, not a finite number"
                )));
            }
            slots.push((self.slot(feature), x));
        }
        slots.sort_unstable_by_key(|&(slot, _)| slot);
        slots.dedup_by(|next, kept| {
            let same = next.0 == kept.0;
            if same {
                kept.1 += next.1;
            }
            same
        });
        let mut norm2 = 1.0; // the bias input
        for &(slot, x) in slots.iter() {
            if !x.is_finite() {
                return Err(Rejected(format!("the features of weight {slot} add up to {x}")));
            }
            norm2 += x * x;
        }
        Ok(norm2)
    }

    fn margin(&self, slots: &[(u32, f64)]) -> f64 {
        slots.iter().map(|&(slot, x)| self.weights.get(slot) * x).sum::<f64>() + self.weights.get(self.bias_slot())
    }

    /// P(label = true | features) under the current model.
    pub fn predict(&self, features: &[(u64, f64)]) -> f64 {
        let slots: Vec<_> = features.iter().map(|&(f, x)| (self.slot(f), x)).collect();
        sigmoid(self.margin(&slots))
    }

    /// Inputs trained on.
    pub fn steps(&self) -> u64 {
        self.steps.get() as u64
    }

    /// Progressive accuracy: the fraction of inputs predicted right before training.
    pub fn accuracy(&self) -> f64 {
        if self.steps.get() == 0.0 {
            0.0
        } else {
            self.correct.get() / self.steps.get()
        }
    }

    /// Progressive mean log-loss.
    pub fn log_loss(&self) -> f64 {
        if self.steps.get() == 0.0 {
            0.0
        } else {
            self.loss.get() / self.steps.get()
        }
    }

    /// The L1 norm of the weights (a convergence signal).
    pub fn weights_l1(&self) -> f64 {
        self.weights.values().map(f64::abs).sum()
    }

    /// How many weights the model has: the hashed features and the bias.
    pub fn weight_count(&self) -> usize {
        self.weights.len()
    }

    /// The weight in `slot` (a hashed feature, or the bias in the last slot).
    pub fn weight(&self, slot: u32) -> f64 {
        self.weights.get(slot)
    }

    /// The weights that are not zero, as (slot, weight): what a model message
    /// carries.
    pub fn nonzero_weights(&self) -> Vec<(u32, f64)> {
        self.weights
            .values()
            .enumerate()
            .filter(|&(_, w)| w != 0.0)
            .map(|(slot, w)| (slot as u32, w))
            .collect()
    }

    /// Moves one weight by `delta` outside training (a distributed worker taking
    /// in the global model). The divergence counts the move like any other.
    pub(crate) fn shift_weight(&mut self, slot: u32, delta: f64) {
        self.weights.add(slot, delta);
    }

    /// The progress totals: inputs trained on, inputs predicted right, summed
    /// log-loss.
    pub fn totals(&self) -> (f64, f64, f64) {
        (self.steps.get(), self.correct.get(), self.loss.get())
    }

    /// The tracked structures, for an operator that adds its own beside them.
    pub(crate) fn parts(&mut self) -> [&mut dyn Tracked; 4] {
        [&mut self.weights, &mut self.steps, &mut self.correct, &mut self.loss]
    }

    /// Accuracy and mean log-loss on a held-out set, without training.
    pub fn evaluate(&self, data: &[LabeledVector]) -> (f64, f64) {
        if data.is_empty() {
            return (0.0, 0.0);
        }
        let (mut correct, mut loss) = (0usize, 0.0);
        for item in data {
            let p = self.predict(&item.features);
            correct += usize::from((p >= 0.5) == item.label);
            loss += log_loss(p, item.label);
        }
        (correct as f64 / data.len() as f64, loss / data.len() as f64)
    }
}

/// The log-loss of predicting probability `p` for an item whose label is
/// `label` (p clamped away from 0 and 1).
pub fn log_loss(p: f64, label: bool) -> f64 {
    let p = p.clamp(1e-15, 1.0 - 1e-15);
    if label {
        -p.ln()
    } else {
        -(1.0 - p).ln()
    }
}

impl Operator for OnlineLogisticRegression {
    type Input = LabeledVector;
    type Output = Prediction;

    fn process(&mut self, item: &LabeledVector, outputs: &mut Vec<Prediction>) -> Result<(), ProcessError> {
        let mut slots = std::mem::take(&mut self.slots);
        let checked = self.hashed(item, &mut slots).and_then(|norm2| {
            let margin = self.margin(&slots);
            if margin.is_finite() {
                Ok((norm2, margin))
            } else {
                Err(Rejected(format!(
                    "the model's margin on it is {margin}, not a finite number"
                )))
            }
        });
        let (norm2, margin) = match checked {
            Ok(checked) => checked,
            Err(reason) => {
                self.slots = slots;
                return Err(reason.into());
            }
        };
        let probability = sigmoid(margin);
        let correct = (probability >= 0.5) == item.label;
        self.correct.add(if correct { 1.0 } else { 0.0 });
        self.loss.add(log_loss(probability, item.label));
        self.steps.add(1.0);
        let eta = self.config.learning_rate / self.steps.get().sqrt();
        let scale = (self.config.max_feature_norm / norm2.sqrt()).min(1.0);
        let gradient = (f64::from(u8::from(item.label)) - probability) * eta * scale;
        for &(slot, x) in &slots {
            self.weights.add(slot, gradient * x);
        }
        self.weights.add(self.bias_slot(), gradient);
        self.slots = slots;
        outputs.push(Prediction {
            probability,
            label: item.label,
            correct,
        });
        Ok(())
    }

    #[inline]
    fn divergence(&self) -> f64 {
        self.weights.divergence()
    }

    fn norm(&self) -> Norm {
        Norm::L2
    }

    fn set_theta(&mut self, theta: f64) {
        set_theta_all(&mut [&mut self.weights], theta);
    }

    fn backup(&mut self, seq: u64, scope: BackupScope, out: &mut BackupBatch) {
        backup_all(&mut self.parts(), seq, scope, out);
    }

    fn acknowledge_backup(&mut self, seq: u64) {
        acknowledge_all(&mut self.parts(), seq);
    }

    fn fail_backup(&mut self, seq: u64) {
        fail_all(&mut self.parts(), seq);
    }

    fn restore(&mut self, entries: &[BackupEntry]) -> Result<(), CoreError> {
        restore_all(&mut self.parts(), entries)
    }

    fn constants(&self) -> AnalysisConstants {
        AnalysisConstants {
            alpha: 2.0 * self.config.learning_rate * self.config.max_feature_norm,
            beta: 1,
        }
    }

    fn distance(&self, other: &Self) -> f64 {
        self.weights.distance(&other.weights)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn separable(n: usize, seed: u64) -> Vec<LabeledVector> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let truth = [1.5, -2.0, 0.7, 1.0];
        (0..n)
            .map(|_| {
                let features: Vec<(u64, f64)> = (0..4).map(|i| (i as u64, rng.gen_range(-1.0..1.0))).collect();
                let margin: f64 = features.iter().zip(truth).map(|((_, x), w)| x * w).sum();
                LabeledVector {
                    label: margin > 0.0,
                    features,
                }
            })
            .collect()
    }

    /// The weights' Euclidean move on one item, from a fresh model.
    fn first_step(config: LogisticConfig, features: Vec<(u64, f64)>) -> f64 {
        let fresh = OnlineLogisticRegression::new(config).unwrap();
        let mut lr = fresh.clone();
        let item = LabeledVector { label: true, features };
        lr.process(&item, &mut Vec::new()).unwrap();
        lr.weights.distance(&fresh.weights)
    }

    #[test]
    fn features_sharing_a_weight_move_it_no_more_than_one_clipped_step() {
        let config = LogisticConfig {
            feature_bits: 8,
            learning_rate: 0.5,
            max_feature_norm: 2.0,
        };
        // η0·R: the most one item may move the weights.
        let step = 0.5 * 2.0;
        let repeated = first_step(config, vec![(7, 1.0); 16]);
        assert!(
            repeated <= step * (1.0 + 1e-12),
            "16 copies of a feature moved {repeated}"
        );
        let colliding = LogisticConfig {
            feature_bits: 1,
            ..config
        };
        let moved = first_step(colliding, (0..16).map(|f| (f, 1.0)).collect());
        assert!(moved <= step * (1.0 + 1e-12), "16 features on 2 weights moved {moved}");
        // One feature of norm under R is not clipped: the step is η0·|y − p|·‖x‖.
        let single = first_step(config, vec![(7, 1.0)]);
        assert!((single - 0.5 * 0.5 * 2f64.sqrt()).abs() < 1e-12, "{single}");
    }

    #[test]
    fn a_first_step_is_the_learning_rate_times_the_error_times_the_input_clipped_to_r() {
        let config = LogisticConfig {
            feature_bits: 8,
            learning_rate: 3.0,
            max_feature_norm: 2.0,
        };
        // p = 0.5 on a fresh model, so |y − p| = 0.5; the bias input is 1.
        let unclipped = first_step(config, vec![(7, 1.0)]);
        assert!((unclipped - 3.0 * 0.5 * 2f64.sqrt()).abs() < 1e-12, "{unclipped}");
        // ‖(3, 1)‖ > R: the input is scaled down to norm R.
        let clipped = first_step(config, vec![(7, 3.0)]);
        assert!((clipped - 3.0 * 0.5 * 2.0).abs() < 1e-12, "{clipped}");
        // Two copies of a feature are one feature of twice the value.
        let twice = first_step(config, vec![(7, 0.5), (7, 0.5)]);
        assert!((twice - unclipped).abs() < 1e-12, "{twice} against {unclipped}");
    }

    #[test]
    fn an_item_that_would_make_a_weight_infinite_is_refused_and_the_model_kept() {
        let mut lr = OnlineLogisticRegression::new(LogisticConfig::default()).unwrap();
        let slot = lr.slot(1);
        lr.shift_weight(slot, 10.0);
        let before = lr.clone();
        let refused = [
            vec![(1, f64::MAX), (1, f64::MAX)],
            vec![(1, 1e308)],
            vec![(2, f64::NAN)],
        ];
        for features in refused {
            let item = LabeledVector { label: true, features };
            let result = lr.process(&item, &mut Vec::new());
            assert!(matches!(result, Err(ProcessError::Rejected(_))), "{item:?}: {result:?}");
        }
        assert_eq!(lr.distance(&before), 0.0);
        assert_eq!(lr.steps(), 0);
        assert!(lr.weights.values().all(f64::is_finite));
    }

    #[test]
    fn learns_a_separable_problem() {
        let config = LogisticConfig {
            feature_bits: 8,
            ..LogisticConfig::default()
        };
        let mut lr = OnlineLogisticRegression::new(config).unwrap();
        let mut out = Vec::new();
        for item in separable(5000, 1) {
            lr.process(&item, &mut out).unwrap();
        }
        let (accuracy, loss) = lr.evaluate(&separable(1000, 2));
        assert!(accuracy > 0.93, "accuracy {accuracy}");
        assert!(loss < 0.3, "loss {loss}");
        assert!(lr.accuracy() > 0.85);
        assert_eq!(out.len(), 5000);
    }

    #[test]
    fn one_step_moves_the_weights_by_at_most_half_alpha() {
        let config = LogisticConfig {
            feature_bits: 6,
            learning_rate: 1.0,
            max_feature_norm: 2.0,
        };
        let mut lr = OnlineLogisticRegression::new(config).unwrap();
        let before = lr.clone();
        let huge = LabeledVector {
            label: true,
            features: vec![(1, 1e6), (2, -1e6)],
        };
        lr.process(&huge, &mut Vec::new()).unwrap();
        assert!(lr.distance(&before) <= lr.constants().alpha / 2.0 + 1e-9);
        let nan = LabeledVector {
            label: true,
            features: vec![(1, f64::NAN)],
        };
        assert!(lr.process(&nan, &mut Vec::new()).is_err());
    }
}
