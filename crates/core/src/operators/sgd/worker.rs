//! The local side of distributed SGD: one worker per input partition.
//!
//! State: the logistic-regression model (weights and progress totals, as in
//! the single-task operator). An iteration ends every `publish_every` items
//! trained on in all, so a replay ends its iterations at the same items as the
//! lost run did. The global model's clock and the weights last published are
//! not backed up: a recovered worker takes in the global model again from the
//! feedback topic, which keeps it (so a BSP worker recovered at a barrier waits
//! for it, as it should).
//!
//! Divergence: the Euclidean distance of the weights from their backup, as for
//! the single-task operator, counting the moves that taking in a global model
//! makes as well as training steps. α = 2·η0·R per item; β = 1 (at most one
//! model message per item).
//!
//! Taking in the global model g keeps the worker's progress since it last
//! published: w ← g + (w − w_published). Under BSP the worker has made none
//! (it waits right after publishing), so this is plain model averaging; under
//! ASP and SSP the items trained on while the global model was on its way are
//! not thrown away. That holds only for a g that averages the worker's latest
//! published model: one still on its way when the worker published again
//! holds an older model of it, and w ← g + (w − w_published) would drop the
//! worker's progress between the two (at a fast learner's pace, most globals
//! under ASP were such). So a worker takes in only a g whose iteration for it
//! (`GlobalModel::iterations`) is its own latest; an older one moves the clock.

use crate::batch::BackupBatch;
use crate::entry::BackupEntry;
use crate::error::CoreError;
use crate::operator::{
    acknowledge_all, backup_all, fail_all, restore_all, AnalysisConstants, BackupScope, Operator, ProcessError,
};
use crate::operators::{LabeledVector, OnlineLogisticRegression, Prediction};
use crate::structures::Norm;

use super::{Consistency, DistributedSgdConfig, GlobalModel, LocalModel};

#[derive(Clone, Debug)]
pub struct SgdWorker {
    config: DistributedSgdConfig,
    worker: u32,
    model: OnlineLogisticRegression,
    /// The iteration every worker has reached, as the latest global model said.
    clock: u64,
    /// The weights as last published (or as taken in since): what the
    /// worker's own progress is measured from.
    published: Vec<f64>,
    /// The model's progress totals when the iteration began.
    iteration_start: (f64, f64, f64),
    /// Started or restored and not yet published since: any global model is
    /// taken in (a recovered worker starts again from the latest one; the
    /// one it holds of this worker may be newer than the restored state).
    starting: bool,
    /// Global models taken in.
    adopted: u64,
    scratch: Vec<Prediction>,
}

impl SgdWorker {
    /// The worker of input partition `worker`.
    pub fn new(config: DistributedSgdConfig, worker: u32) -> Result<Self, CoreError> {
        config.validate()?;
        if worker >= config.workers {
            return Err(CoreError::parameter(
                "worker",
                worker,
                format!("below the {} workers configured", config.workers),
            ));
        }
        let model = OnlineLogisticRegression::new(config.model())?;
        let published = vec![0.0; model.weight_count()];
        Ok(SgdWorker {
            config,
            worker,
            model,
            clock: 0,
            published,
            iteration_start: (0.0, 0.0, 0.0),
            starting: true,
            adopted: 0,
            scratch: Vec::new(),
        })
    }

    pub fn worker(&self) -> u32 {
        self.worker
    }

    /// Iterations finished (models published).
    pub fn iteration(&self) -> u64 {
        self.model.steps() / self.config.publish_every
    }

    /// The iteration every worker has reached, as far as this one knows.
    pub fn clock(&self) -> u64 {
        self.clock
    }

    /// Global models taken in since this worker started.
    pub fn adopted(&self) -> u64 {
        self.adopted
    }

    pub fn model(&self) -> &OnlineLogisticRegression {
        &self.model
    }

    /// Whether the consistency model lets the worker train on: it is at most the
    /// allowed number of iterations ahead of the global clock.
    pub fn may_proceed(&self) -> bool {
        self.iteration().saturating_sub(self.clock) <= self.config.allowed_lead()
    }

    /// Takes in a global model and returns how far it moved the weights
    /// (Euclidean). Under BSP a global model older than the worker's iteration
    /// only moves the clock: it averages models of an iteration the worker has
    /// left.
    pub fn adopt(&mut self, global: &GlobalModel) -> f64 {
        self.clock = self.clock.max(global.clock);
        if self.config.consistency == Consistency::Bsp && global.clock < self.iteration() {
            return 0.0;
        }
        let Some(&holds) = global.iterations.get(self.worker as usize) else {
            return self.take_in(global);
        };
        // Not the worker's latest model in it: taking it in would drop the
        // worker's own progress since the model it holds. A starting worker
        // takes in one holding a newer model of its own (published after the
        // marker it restored), never an older one: a recovered averager
        // replaying its input sends again the global models it sent before,
        // and a recovered worker reads them after the latest.
        let stale = holds < self.iteration() || (!self.starting && holds != self.iteration());
        if stale {
            return 0.0;
        }
        self.take_in(global)
    }

    /// Sets the weights to `global`'s plus the progress since publishing,
    /// whichever models it averages (e.g. to evaluate a final global model on
    /// a fresh worker). Returns how far the weights moved.
    pub fn take_in(&mut self, global: &GlobalModel) -> f64 {
        let slots = self.published.len() as u32;
        let mut target = vec![0.0; self.published.len()];
        for &(slot, weight) in &global.weights {
            if slot < slots && weight.is_finite() {
                target[slot as usize] = weight;
            }
        }
        let mut moved = 0.0;
        for (slot, (published, target)) in self.published.iter_mut().zip(target).enumerate() {
            let delta = target - *published;
            if delta != 0.0 {
                self.model.shift_weight(slot as u32, delta);
                moved += delta * delta;
            }
            *published = target;
        }
        self.adopted += 1;
        moved.sqrt()
    }

    fn publish(&mut self) -> LocalModel {
        self.starting = false;
        let iteration = self.iteration();
        let (steps, correct, loss) = self.model.totals();
        let (start_steps, start_correct, start_loss) = self.iteration_start;
        let trained = (steps - start_steps).max(1.0);
        self.iteration_start = (steps, correct, loss);
        let weights = self.model.nonzero_weights();
        for (slot, published) in self.published.iter_mut().enumerate() {
            *published = self.model.weight(slot as u32);
        }
        LocalModel {
            worker: self.worker,
            iteration,
            items: steps as u64,
            loss: (loss - start_loss) / trained,
            accuracy: (correct - start_correct) / trained,
            weights,
        }
    }
}

impl Operator for SgdWorker {
    type Input = LabeledVector;
    type Output = LocalModel;

    fn process(&mut self, item: &LabeledVector, outputs: &mut Vec<LocalModel>) -> Result<(), ProcessError> {
        self.scratch.clear();
        self.model.process(item, &mut self.scratch)?;
        if self.model.steps().is_multiple_of(self.config.publish_every) {
            let published = self.publish();
            outputs.push(published);
        }
        Ok(())
    }

    fn ready(&self) -> bool {
        self.may_proceed()
    }

    fn divergence(&self) -> f64 {
        self.model.divergence()
    }

    fn norm(&self) -> Norm {
        Norm::L2
    }

    fn set_theta(&mut self, theta: f64) {
        self.model.set_theta(theta);
    }

    fn backup(&mut self, seq: u64, scope: BackupScope, out: &mut BackupBatch) {
        backup_all(&mut self.model.parts(), seq, scope, out);
    }

    fn acknowledge_backup(&mut self, seq: u64) {
        acknowledge_all(&mut self.model.parts(), seq);
    }

    fn fail_backup(&mut self, seq: u64) {
        fail_all(&mut self.model.parts(), seq);
    }

    fn restore(&mut self, entries: &[BackupEntry]) -> Result<(), CoreError> {
        restore_all(&mut self.model.parts(), entries)?;
        // Progress is measured from the restored weights until the global model
        // comes in again.
        for (slot, published) in self.published.iter_mut().enumerate() {
            *published = self.model.weight(slot as u32);
        }
        self.iteration_start = self.model.totals();
        self.starting = true;
        Ok(())
    }

    fn constants(&self) -> AnalysisConstants {
        self.model.constants()
    }

    fn distance(&self, other: &Self) -> f64 {
        self.model.distance(&other.model)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workloads::separable_vectors;

    fn config(consistency: Consistency) -> DistributedSgdConfig {
        DistributedSgdConfig {
            feature_bits: 8,
            workers: 2,
            publish_every: 10,
            consistency,
            staleness: 2,
            ..DistributedSgdConfig::default()
        }
    }

    fn global(clock: u64, weights: Vec<(u32, f64)>) -> GlobalModel {
        GlobalModel {
            clock,
            version: clock,
            workers: 2,
            items: 0,
            loss: 0.0,
            accuracy: 0.0,
            weights_l1: weights.iter().map(|(_, w)| w.abs()).sum(),
            weights,
            iterations: Vec::new(),
        }
    }

    #[test]
    fn a_global_model_without_the_workers_latest_model_only_moves_the_clock() {
        let (items, _) = separable_vectors(25, 40, 4, 5);
        let mut worker = SgdWorker::new(config(Consistency::Asp), 1).unwrap();
        train(&mut worker, &items[..20]);
        assert_eq!(worker.iteration(), 2);
        train(&mut worker, &items[20..]);
        let weights = |w: &SgdWorker| -> Vec<f64> {
            (0..w.model().weight_count() as u32)
                .map(|s| w.model().weight(s))
                .collect()
        };
        let before = weights(&worker);
        // Averaged before the worker's iteration 2 reached the averager.
        let stale = GlobalModel {
            iterations: vec![2, 1],
            ..global(1, vec![(3, 2.0)])
        };
        assert_eq!(worker.adopt(&stale), 0.0);
        assert_eq!(weights(&worker), before, "its progress since iteration 1 is kept");
        assert_eq!(worker.clock(), 1, "the clock still moves");
        assert_eq!(worker.adopted(), 0);
        let current = GlobalModel {
            iterations: vec![2, 2],
            ..global(2, vec![(3, 2.0)])
        };
        assert!(worker.adopt(&current) > 0.0, "one with its latest model is taken in");
        assert_eq!(worker.adopted(), 1);
        assert_eq!(worker.clock(), 2);

        // Restored at iteration 2, while the averager holds its iteration 3
        // (published before the crash, after the marker): taken in all the same.
        let mut entries = BackupBatch::new(1);
        worker.backup(1, BackupScope::Complete, &mut entries);
        let mut restored = SgdWorker::new(config(Consistency::Asp), 1).unwrap();
        restored.restore(&entries.entries().unwrap()).unwrap();
        let newer = GlobalModel {
            iterations: vec![3, 3],
            ..global(3, vec![(3, 2.0)])
        };
        assert!(
            restored.adopt(&newer) > 0.0,
            "a recovered worker starts from the latest global model"
        );

        // A recovered averager sends its global models again after the latest:
        // the recovered worker (at iteration 2) keeps what it took in.
        let mut recovered = SgdWorker::new(config(Consistency::Asp), 1).unwrap();
        recovered.restore(&entries.entries().unwrap()).unwrap();
        assert!(recovered.adopt(&newer) > 0.0);
        let taken = weights(&recovered);
        let resent = GlobalModel {
            iterations: vec![1, 1],
            ..global(1, vec![(3, -5.0)])
        };
        assert_eq!(recovered.adopt(&resent), 0.0, "a re-sent older global model is stale");
        assert_eq!(weights(&recovered), taken);
        assert_eq!(recovered.adopted(), 1);
    }

    #[test]
    fn a_published_model_reports_its_own_iterations_loss_and_accuracy() {
        let (items, _) = separable_vectors(20, 40, 4, 2);
        let mut worker = SgdWorker::new(config(Consistency::Asp), 0).unwrap();
        let first = train(&mut worker, &items[..10]);
        let (steps, correct, loss) = worker.model().totals();
        assert_eq!(steps, 10.0);
        let second = train(&mut worker, &items[10..]);
        let (_, correct_after, loss_after) = worker.model().totals();
        let (first, second) = (&first[0], &second[0]);
        assert_eq!((first.iteration, second.iteration), (1, 2));
        assert_eq!((first.items, second.items), (10, 20));
        assert!((first.loss - loss / 10.0).abs() < 1e-12, "{first:?}");
        assert!((first.accuracy - correct / 10.0).abs() < 1e-12, "{first:?}");
        assert!((second.loss - (loss_after - loss) / 10.0).abs() < 1e-12, "{second:?}");
        assert!(
            (second.accuracy - (correct_after - correct) / 10.0).abs() < 1e-12,
            "{second:?}"
        );
    }

    #[test]
    fn a_global_model_with_weights_it_cannot_hold_leaves_those_slots_alone() {
        let (items, _) = separable_vectors(10, 40, 4, 3);
        let mut worker = SgdWorker::new(config(Consistency::Asp), 0).unwrap();
        train(&mut worker, &items);
        let slots = worker.model().weight_count() as u32;
        let odd = global(1, vec![(0, f64::NAN), (1, 0.5), (slots, 1.0), (slots + 7, 1.0)]);
        worker.take_in(&odd);
        assert!(
            (0..slots).all(|s| worker.model().weight(s).is_finite()),
            "no NaN taken in"
        );
        assert_eq!(worker.model().weight(0), 0.0, "a NaN weight counts as none");
    }

    #[test]
    fn backups_acknowledged_are_settled_and_failed_ones_owed_again() {
        let (items, _) = separable_vectors(10, 40, 4, 4);
        let mut worker = SgdWorker::new(config(Consistency::Asp), 0).unwrap();
        worker.set_theta(0.0);
        train(&mut worker, &items);
        let mut twin = worker.clone();
        assert_eq!(worker.distance(&twin), 0.0);
        let mut entries = BackupBatch::new(1);
        worker.backup(1, BackupScope::Drifted, &mut entries);
        assert!(!entries.is_empty(), "trained weights past θ = 0 are backed up");
        twin.backup(1, BackupScope::Drifted, &mut BackupBatch::new(1));
        worker.acknowledge_backup(1);
        // A failure reported after the acknowledgement finds nothing left to owe.
        worker.fail_backup(1);
        twin.fail_backup(1);
        let owed = |w: &mut SgdWorker| {
            let mut out = BackupBatch::new(2);
            w.backup(2, BackupScope::Owed, &mut out);
            out.len()
        };
        assert_eq!(owed(&mut worker), 0, "an acknowledged backup owes nothing");
        assert_eq!(owed(&mut twin), entries.len(), "a failed one owes all it wrote");
        train(&mut twin, &items[..3]);
        assert!(worker.distance(&twin) > 0.0, "trained apart, they differ");
    }

    fn train(worker: &mut SgdWorker, items: &[LabeledVector]) -> Vec<LocalModel> {
        let mut out = Vec::new();
        for item in items {
            worker.process(item, &mut out).unwrap();
        }
        out
    }

    #[test]
    fn publishes_every_n_items_and_bsp_waits_for_the_global_model_of_its_iteration() {
        let (items, _) = separable_vectors(25, 40, 4, 1);
        let mut worker = SgdWorker::new(config(Consistency::Bsp), 1).unwrap();
        assert!(worker.ready());
        let models = train(&mut worker, &items[..10]);
        assert_eq!(models.len(), 1);
        assert_eq!((models[0].worker, models[0].iteration, models[0].items), (1, 1, 10));
        assert!(models[0].loss > 0.0 && (0.0..=1.0).contains(&models[0].accuracy));
        assert!(!worker.ready(), "BSP waits after publishing iteration 1");
        assert_eq!(
            worker.adopt(&global(0, vec![(0, 1.0)])),
            0.0,
            "an older average is not taken in"
        );
        assert!(!worker.ready());
        assert!(worker.adopt(&global(1, vec![(0, 1.0)])) > 0.0);
        assert!(worker.ready());
        assert_eq!(
            worker.model().weight(0),
            1.0,
            "no progress since publishing: the average itself"
        );
    }

    #[test]
    fn ssp_runs_at_most_staleness_iterations_ahead_and_asp_never_waits() {
        let (items, _) = separable_vectors(60, 40, 4, 2);
        let mut ssp = SgdWorker::new(config(Consistency::Ssp), 0).unwrap();
        train(&mut ssp, &items[..20]);
        assert!(ssp.ready(), "two ahead of clock 0");
        train(&mut ssp, &items[20..30]);
        assert!(!ssp.ready(), "three ahead of clock 0");
        ssp.adopt(&global(1, Vec::new()));
        assert!(ssp.ready());
        let mut asp = SgdWorker::new(config(Consistency::Asp), 0).unwrap();
        train(&mut asp, &items);
        assert!(asp.ready());
        assert_eq!(asp.iteration(), 6);
    }

    #[test]
    fn taking_in_the_global_model_keeps_the_progress_since_publishing() {
        let (items, _) = separable_vectors(15, 40, 4, 3);
        let mut worker = SgdWorker::new(config(Consistency::Asp), 0).unwrap();
        train(&mut worker, &items[..10]);
        let published: Vec<f64> = (0..worker.model().weight_count() as u32)
            .map(|s| worker.model().weight(s))
            .collect();
        train(&mut worker, &items[10..]);
        let progress: Vec<f64> = (0..published.len() as u32)
            .map(|s| worker.model().weight(s) - published[s as usize])
            .collect();
        let divergence_before = worker.divergence();
        let moved = worker.adopt(&global(1, vec![(3, 2.0), (7, -1.0)]));
        let expected_move = published
            .iter()
            .enumerate()
            .map(|(slot, p)| {
                let target = [(3, 2.0), (7, -1.0)]
                    .iter()
                    .find(|(s, _)| *s == slot)
                    .map_or(0.0, |(_, w)| *w);
                (target - p).powi(2)
            })
            .sum::<f64>()
            .sqrt();
        assert!(
            (moved - expected_move).abs() < 1e-12,
            "moved {moved}, expected {expected_move}"
        );
        for slot in 0..published.len() as u32 {
            let expected = match slot {
                3 => 2.0,
                7 => -1.0,
                _ => 0.0,
            } + progress[slot as usize];
            assert!((worker.model().weight(slot) - expected).abs() < 1e-12, "slot {slot}");
        }
        assert!(worker.divergence() != divergence_before, "the move counts toward θ");
        // A second global model of the same round replaces the first one's share.
        worker.adopt(&global(1, vec![(3, 1.0)]));
        assert!((worker.model().weight(3) - (1.0 + progress[3])).abs() < 1e-12);
        assert!((worker.model().weight(7) - progress[7]).abs() < 1e-12);
    }

    #[test]
    fn a_restored_worker_keeps_its_iteration_and_waits_for_the_global_model_again() {
        let (items, _) = separable_vectors(10, 40, 4, 4);
        let mut worker = SgdWorker::new(config(Consistency::Bsp), 0).unwrap();
        train(&mut worker, &items);
        let mut entries = BackupBatch::new(1);
        worker.backup(1, BackupScope::Complete, &mut entries);
        let mut restored = SgdWorker::new(config(Consistency::Bsp), 0).unwrap();
        restored.restore(&entries.entries().unwrap()).unwrap();
        assert_eq!(restored.iteration(), 1);
        assert_eq!(restored.distance(&worker), 0.0);
        assert!(
            !restored.ready(),
            "the clock is not restored: the feedback topic has it"
        );
        // Behind the clock after a recovery: it trains on to catch up.
        restored.adopt(&global(4, Vec::new()));
        assert_eq!(restored.iteration(), 1);
        assert!(restored.ready());
        let models = train(&mut restored, &separable_vectors(10, 40, 4, 5).0);
        assert_eq!(models[0].iteration, 2, "iterations end at the same items as before");
        assert!(SgdWorker::new(config(Consistency::Bsp), 2).is_err(), "worker 2 of 2");
    }
}
