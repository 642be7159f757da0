//! The global side of distributed SGD: one task that averages the workers'
//! models and publishes the average as feedback.
//!
//! State: every worker's latest model (one slice of weights per worker), its
//! iteration, items trained and latest iteration loss. The global model is
//! their average, kept as a running sum outside the state and rebuilt on
//! restore.
//!
//! Divergence: the Euclidean distance of all the workers' slices from their
//! backup. The average of n slices moves by at most that distance over √n, so
//! θ bounds the global model's error too. The iterations, item counts and
//! losses are written with every backup (they are small, and the clock that
//! BSP and SSP workers wait on must not go back).
//!
//! α = 0: a model message replaces its worker's slice, so replaying the
//! messages after the recovery point sets every slice they touch to exactly
//! the value it had before the crash. Only slices no message touched since
//! the marker differ from the lost state, by what the last backup left
//! unwritten: at most θ. β = 1 (at most one global model per message).

use crate::batch::BackupBatch;
use crate::entry::BackupEntry;
use crate::error::CoreError;
use crate::operator::{
    acknowledge_all, backup_all, fail_all, restore_all, set_theta_all, AnalysisConstants, BackupScope, Operator,
    ProcessError, Rejected,
};
use crate::structures::{Norm, Tracked, TrackedValue, TrackedVector};

use super::{Consistency, DistributedSgdConfig, GlobalModel, LocalModel};

const SLICES: u8 = 1;
const ITERATIONS: u8 = 2;
const ITEMS: u8 = 3;
const LOSSES: u8 = 4;
const VERSION: u8 = 5;
const ACCURACIES: u8 = 6;

#[derive(Clone, Debug)]
pub struct ModelAverager {
    config: DistributedSgdConfig,
    /// Weights per worker: worker k's slice starts at k·dims.
    dims: usize,
    slices: TrackedVector,
    iterations: TrackedVector,
    items: TrackedVector,
    losses: TrackedVector,
    accuracies: TrackedVector,
    /// Models taken in, in all.
    version: TrackedValue,
    /// The sum of the slices, slot by slot (derived).
    sum: Vec<f64>,
    /// The clock of the last global model published under BSP (derived).
    published_clock: u64,
}

impl ModelAverager {
    pub fn new(config: DistributedSgdConfig) -> Result<Self, CoreError> {
        config.validate()?;
        // The workers' weight count: the hashed features and the bias.
        let dims = (1usize << config.model().feature_bits.min(30)) + 1;
        // The workers' model must be one they can build.
        crate::operators::OnlineLogisticRegression::new(config.model())?;
        let workers = config.workers as usize;
        Ok(ModelAverager {
            config,
            dims,
            slices: TrackedVector::new(SLICES, Norm::L2, workers * dims)?,
            iterations: TrackedVector::new(ITERATIONS, Norm::L1, workers)?,
            items: TrackedVector::new(ITEMS, Norm::L1, workers)?,
            losses: TrackedVector::new(LOSSES, Norm::L1, workers)?,
            accuracies: TrackedVector::new(ACCURACIES, Norm::L1, workers)?,
            version: TrackedValue::new(VERSION),
            sum: vec![0.0; dims],
            published_clock: 0,
        })
    }

    /// The iteration every worker has reached.
    pub fn clock(&self) -> u64 {
        self.iterations.values().fold(u64::MAX, |min, i| min.min(i as u64))
    }

    /// Workers that have published a model.
    pub fn reporting(&self) -> u32 {
        self.items.values().filter(|&n| n > 0.0).count() as u32
    }

    /// The current global model: the average of the reporting workers' latest
    /// models.
    pub fn global(&self) -> GlobalModel {
        let reporting = self.reporting();
        let scale = 1.0 / f64::from(reporting.max(1));
        let weights: Vec<(u32, f64)> = self
            .sum
            .iter()
            .enumerate()
            .filter(|&(_, &w)| w != 0.0)
            .map(|(slot, &w)| (slot as u32, w * scale))
            .collect();
        let reported = || {
            self.items
                .values()
                .zip(self.losses.values().zip(self.accuracies.values()))
                .filter(|&(n, _)| n > 0.0)
        };
        GlobalModel {
            clock: self.clock(),
            version: self.version.get() as u64,
            workers: reporting,
            items: reported().map(|(n, _)| n as u64).sum(),
            loss: reported().map(|(_, (loss, _))| loss).sum::<f64>() * scale,
            accuracy: reported().map(|(_, (_, accuracy))| accuracy).sum::<f64>() * scale,
            weights_l1: weights.iter().map(|(_, w)| w.abs()).sum(),
            weights,
            iterations: self.iterations.values().map(|i| i as u64).collect(),
        }
    }

    /// The tracked structures: the slices (which the divergence counts) first.
    fn parts(&mut self) -> [&mut dyn Tracked; 6] {
        [
            &mut self.slices,
            &mut self.iterations,
            &mut self.items,
            &mut self.losses,
            &mut self.accuracies,
            &mut self.version,
        ]
    }

    fn rebuild_sum(&mut self) {
        self.sum.iter_mut().for_each(|s| *s = 0.0);
        for (index, weight) in self.slices.values().enumerate() {
            self.sum[index % self.dims] += weight;
        }
    }

    fn check(&self, model: &LocalModel) -> Result<(), Rejected> {
        if model.worker >= self.config.workers {
            return Err(Rejected(format!(
                "model of worker {} but {} workers are configured",
                model.worker, self.config.workers
            )));
        }
        if !(model.loss.is_finite() && model.accuracy.is_finite()) {
            return Err(Rejected(format!(
                "model of worker {} has loss {} and accuracy {}",
                model.worker, model.loss, model.accuracy
            )));
        }
        for &(slot, weight) in &model.weights {
            if slot as usize >= self.dims || !weight.is_finite() {
                return Err(Rejected(format!(
                    "model of worker {} has weight {weight} in slot {slot} (of {}): was feature_bits changed?",
                    model.worker, self.dims
                )));
            }
        }
        Ok(())
    }
}

impl Operator for ModelAverager {
    type Input = LocalModel;
    type Output = GlobalModel;

    fn process(&mut self, model: &LocalModel, outputs: &mut Vec<GlobalModel>) -> Result<(), ProcessError> {
        self.check(model)?;
        let worker = model.worker as usize;
        let base = worker * self.dims;
        let mut next = vec![0.0; self.dims];
        for &(slot, weight) in &model.weights {
            next[slot as usize] = weight;
        }
        for (slot, weight) in next.into_iter().enumerate() {
            let index = (base + slot) as u32;
            let delta = weight - self.slices.get(index);
            if delta != 0.0 {
                self.slices.set(index, weight);
                self.sum[slot] += delta;
            }
        }
        let worker = worker as u32;
        // A worker recovered from an older backup may publish an iteration again:
        // the clock never goes back.
        self.iterations
            .set(worker, self.iterations.get(worker).max(model.iteration as f64));
        self.items.set(worker, model.items.max(1) as f64);
        self.losses.set(worker, model.loss);
        self.accuracies.set(worker, model.accuracy);
        self.version.add(1.0);
        let clock = self.clock();
        let due = match self.config.consistency {
            Consistency::Bsp => clock > self.published_clock,
            Consistency::Asp | Consistency::Ssp => true,
        };
        if due {
            self.published_clock = clock;
            outputs.push(self.global());
        }
        Ok(())
    }

    fn divergence(&self) -> f64 {
        self.slices.divergence()
    }

    fn norm(&self) -> Norm {
        Norm::L2
    }

    fn set_theta(&mut self, theta: f64) {
        set_theta_all(&mut [&mut self.slices], theta);
    }

    fn backup(&mut self, seq: u64, scope: BackupScope, out: &mut BackupBatch) {
        let [slices, mut uncounted @ ..] = self.parts();
        backup_all(&mut [slices], seq, scope, out);
        backup_all(&mut uncounted, seq, scope.for_uncounted(), out);
    }

    fn acknowledge_backup(&mut self, seq: u64) {
        acknowledge_all(&mut self.parts(), seq);
    }

    fn fail_backup(&mut self, seq: u64) {
        fail_all(&mut self.parts(), seq);
    }

    fn restore(&mut self, entries: &[BackupEntry]) -> Result<(), CoreError> {
        restore_all(&mut self.parts(), entries)?;
        self.rebuild_sum();
        // Under BSP the global model of the restored clock may not have gone out
        // before the crash: publish it with the next model.
        self.published_clock = self.clock().saturating_sub(1);
        Ok(())
    }

    fn constants(&self) -> AnalysisConstants {
        AnalysisConstants { alpha: 0.0, beta: 1 }
    }

    fn distance(&self, other: &Self) -> f64 {
        self.slices.distance(&other.slices)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(consistency: Consistency) -> DistributedSgdConfig {
        DistributedSgdConfig {
            feature_bits: 4,
            workers: 2,
            consistency,
            ..DistributedSgdConfig::default()
        }
    }

    fn model(worker: u32, iteration: u64, weights: Vec<(u32, f64)>) -> LocalModel {
        LocalModel {
            worker,
            iteration,
            items: iteration * 10,
            loss: 0.5,
            accuracy: 0.8,
            weights,
        }
    }

    fn take(averager: &mut ModelAverager, m: LocalModel) -> Vec<GlobalModel> {
        let mut out = Vec::new();
        averager.process(&m, &mut out).unwrap();
        out
    }

    #[test]
    fn bsp_publishes_the_average_once_every_worker_finished_the_iteration() {
        let mut averager = ModelAverager::new(config(Consistency::Bsp)).unwrap();
        assert!(take(&mut averager, model(0, 1, vec![(1, 2.0)])).is_empty());
        let out = take(&mut averager, model(1, 1, vec![(1, 4.0), (2, -2.0)]));
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].clock, 1);
        assert_eq!(out[0].workers, 2);
        assert_eq!(out[0].weights, vec![(1, 3.0), (2, -1.0)]);
        assert_eq!(out[0].weights_l1, 4.0);
        assert!(take(&mut averager, model(0, 2, vec![(1, 1.0)])).is_empty());
    }

    #[test]
    fn asp_publishes_after_every_model_and_a_model_replaces_its_worker_s() {
        let mut averager = ModelAverager::new(config(Consistency::Asp)).unwrap();
        let out = take(&mut averager, model(0, 1, vec![(1, 2.0)]));
        assert_eq!((out[0].clock, out[0].workers), (0, 1));
        assert_eq!(out[0].weights, vec![(1, 2.0)], "the average of the reporting workers");
        take(&mut averager, model(1, 1, vec![(1, 4.0)]));
        let out = take(&mut averager, model(0, 2, vec![(3, 6.0)]));
        assert_eq!(out[0].weights, vec![(1, 2.0), (3, 3.0)]);
        assert_eq!(out[0].clock, 1);
        // A replayed, older iteration replaces the weights but not the clock.
        let out = take(&mut averager, model(0, 1, vec![(1, 2.0)]));
        assert_eq!(out[0].clock, 1);
        assert_eq!(out[0].weights, vec![(1, 3.0)]);
    }

    #[test]
    fn refuses_models_that_do_not_fit() {
        let mut averager = ModelAverager::new(config(Consistency::Asp)).unwrap();
        let mut out = Vec::new();
        for bad in [
            model(2, 1, Vec::new()),
            model(0, 1, vec![(17, 1.0)]),
            model(0, 1, vec![(1, f64::NAN)]),
        ] {
            assert!(matches!(
                averager.process(&bad, &mut out),
                Err(ProcessError::Rejected(_))
            ));
        }
        assert!(out.is_empty());
        assert_eq!(averager.reporting(), 0);
    }

    #[test]
    fn a_restored_averager_has_the_same_average_and_clock() {
        let mut averager = ModelAverager::new(config(Consistency::Bsp)).unwrap();
        take(&mut averager, model(0, 1, vec![(1, 2.0)]));
        take(&mut averager, model(1, 1, vec![(1, 4.0), (16, 1.0)]));
        take(&mut averager, model(0, 2, vec![(1, 1.0)]));
        let mut entries = BackupBatch::new(1);
        averager.backup(1, BackupScope::Complete, &mut entries);
        let mut restored = ModelAverager::new(config(Consistency::Bsp)).unwrap();
        restored.restore(&entries.entries().unwrap()).unwrap();
        assert_eq!(restored.global(), averager.global());
        assert_eq!(restored.distance(&averager), 0.0);
        // The global model of the restored clock goes out again with the next model.
        let out = take(&mut restored, model(0, 2, vec![(1, 1.0)]));
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].clock, 1);
    }
}
