//! An in-memory cluster of a distributed learner: one [`SgdWorker`] task per
//! input partition and one [`ModelAverager`] task, each a [`TaskDriver`] over
//! its own simulated broker (late, batched acknowledgements; crashes in which
//! part of what is in flight lands), linked by a model topic and a feedback
//! topic. Tasks crash where the options say and recover from their changelogs
//! as the service's tasks do; a recovered worker takes in the latest global
//! model from the feedback topic again.
//!
//! At every recovery it checks that no output before the recovery point was
//! lost, and, once the task has replayed up to where it crashed, how far its
//! state is from the state the crash lost:
//!
//! * the averager's input (the model topic) replays exactly, so it must be
//!   within its bound θ_k + l_k·α (with α = 0: θ_k);
//! * a worker's replay takes in whatever global models the feedback topic has
//!   by then, not those the lost run took in, so its bound adds how far the
//!   global models moved each run since the recovery point (measured):
//!   θ_k + l_k·α + Σ moves lost + Σ moves replayed. A missing backup breaks it.
//!
//! The global models delivered to the feedback topic trace the convergence.

use std::collections::VecDeque;

use rand::{Rng, SeedableRng};
use serde::Serialize;

use super::controller::ControllerConfig;
use super::driver::{DriverStats, TaskDriver};
use super::error::CoreError;
use super::harness::{independent_bound, SimBroker, SimulationOptions};
use super::operator::Operator;
use super::operators::{DistributedSgdConfig, GlobalModel, LabeledVector, LocalModel, ModelAverager, SgdWorker};
use super::recovery::read_changelog;

/// A task of the cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ClusterTask {
    Worker(u32),
    Averager,
}

/// Tasks that crash together, once the workers have processed this many items
/// in all (replays included).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterCrash {
    pub after_items: u64,
    pub tasks: Vec<ClusterTask>,
}

#[derive(Clone, Debug)]
pub struct ClusterOptions {
    pub seed: u64,
    /// In the order they happen.
    pub crashes: Vec<ClusterCrash>,
    /// The longest delay of an acknowledgement, in steps.
    pub max_ack_delay: u64,
    /// The most items a task takes per step.
    pub max_batch: usize,
    /// A deliberately broken store: backups are acknowledged, never stored.
    pub drop_backups: bool,
    /// Float slack for the bound checks, relative to the bound.
    pub tolerance: f64,
}

impl Default for ClusterOptions {
    fn default() -> Self {
        ClusterOptions {
            seed: 0,
            crashes: Vec::new(),
            max_ack_delay: 4,
            max_batch: 50,
            drop_backups: false,
            tolerance: 1e-9,
        }
    }
}

/// One global model as it reached the feedback topic.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct ConvergencePoint {
    /// Simulated time: steps of the cluster.
    pub step: u64,
    /// Items the workers had trained on (as the global model says).
    pub items: u64,
    pub clock: u64,
    /// Mean of the workers' latest iteration losses.
    pub loss: f64,
    pub weights_l1: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ClusterRecovery {
    pub task: ClusterTask,
    /// The input offset the crash happened at, and where the task resumed.
    pub crash_offset: u64,
    pub resume_offset: u64,
    /// Failures of this task before this one.
    pub earlier_failures: u32,
    /// How far the state was from the lost one once replayed up to the crash
    /// (None: a later crash came first).
    pub observed: Option<f64>,
    /// Its bound (see the module docs).
    pub bound: f64,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct ClusterReport {
    pub convergence: Vec<ConvergencePoint>,
    pub recoveries: Vec<ClusterRecovery>,
    /// Broken guarantees, each said in words.
    pub violations: Vec<String>,
    pub worker_stats: DriverStats,
    pub averager_stats: DriverStats,
    /// Steps the cluster ran.
    pub steps: u64,
    /// The averager's global model at the end.
    pub final_model: Option<GlobalModel>,
}

struct Check<O> {
    recovery: usize,
    offset: u64,
    lost: O,
    bound: f64,
    replay_moves: f64,
}

/// One task: its driver over its own simulated broker.
struct Node<O: Operator> {
    task: ClusterTask,
    config: ControllerConfig,
    driver: TaskDriver<O>,
    broker: SimBroker<O::Output>,
    next_offset: u64,
    failures: u32,
    stats: DriverStats,
    check: Option<Check<O>>,
    /// Global models taken in: (input offset reached, how far it moved the weights).
    moves: Vec<(u64, f64)>,
    /// The next feedback record to take in.
    feedback: usize,
    tolerance: f64,
}

fn add_stats(total: &mut DriverStats, s: DriverStats) {
    total.items += s.items;
    total.rejected += s.rejected;
    total.outputs += s.outputs;
    total.backups += s.backups;
    total.backup_entries += s.backup_entries;
    total.backup_bytes += s.backup_bytes;
    total.backups_failed += s.backups_failed;
    total.markers += s.markers;
    total.markers_failed += s.markers_failed;
    total.commits += s.commits;
    total.stalls += s.stalls;
    total.stalls_for_outputs += s.stalls_for_outputs;
    total.operator_waits += s.operator_waits;
}

impl<O> Node<O>
where
    O: Operator + Clone,
{
    fn start(
        task: ClusterTask,
        config: ControllerConfig,
        operator: O,
        options: &ClusterOptions,
        seed: u64,
    ) -> Result<Self, CoreError> {
        let mut broker = SimBroker::new(&SimulationOptions {
            seed,
            max_ack_delay: options.max_ack_delay,
            drop_backups: options.drop_backups,
            ..SimulationOptions::default()
        });
        let empty = read_changelog(&[])?;
        let (driver, _) = TaskDriver::recover(config, operator, &empty, None, 0, 0, &mut broker)?;
        Ok(Node {
            task,
            config,
            driver,
            broker,
            next_offset: 0,
            failures: 0,
            stats: DriverStats::default(),
            check: None,
            moves: Vec::new(),
            feedback: 0,
            tolerance: options.tolerance,
        })
    }

    /// Delivers the acknowledgements due; returns whether anything arrived.
    fn deliver(&mut self, step: u64, force: bool) -> bool {
        self.broker.step = step;
        let delivered = self.broker.deliver(force);
        self.broker.report_to(&mut self.driver);
        delivered
    }

    fn stats(&self) -> DriverStats {
        let mut total = self.stats;
        add_stats(&mut total, self.driver.stats());
        total
    }

    /// SIGKILL and restart from the changelog.
    fn crash(&mut self, operator: O, report: &mut ClusterReport) -> Result<(), CoreError> {
        let crash_offset = self.driver.controller().processed().offset;
        add_stats(&mut self.stats, self.driver.stats());
        let lost_outputs = self.broker.crash();
        if self.broker.rng.gen_bool(0.5) {
            self.broker.compact();
        }
        let lost = self.driver.operator().clone();
        let changelog = read_changelog(&self.broker.log)?;
        let committed = self.broker.committed;
        let (driver, plan) = TaskDriver::recover(
            self.config,
            operator,
            &changelog,
            committed,
            0,
            self.broker.step,
            &mut self.broker,
        )?;
        self.driver = driver;
        for offset in lost_outputs {
            if offset < plan.resume_offset {
                report.violations.push(format!(
                    "{:?}: an output of item {offset} was lost, before the recovery point {}",
                    self.task, plan.resume_offset
                ));
            }
        }
        let (bound, _) = independent_bound(&self.config, self.failures);
        let moves_lost: f64 = self
            .moves
            .iter()
            .filter(|(offset, _)| *offset >= plan.resume_offset)
            .map(|(_, moved)| moved)
            .sum();
        self.moves.clear();
        report.recoveries.push(ClusterRecovery {
            task: self.task,
            crash_offset,
            resume_offset: plan.resume_offset,
            earlier_failures: self.failures,
            observed: None,
            bound: bound + moves_lost,
        });
        self.failures += 1;
        self.next_offset = plan.resume_offset;
        self.check = Some(Check {
            recovery: report.recoveries.len() - 1,
            offset: crash_offset,
            lost,
            bound: bound + moves_lost,
            replay_moves: 0.0,
        });
        self.check_caught_up(report);
        Ok(())
    }

    /// Once the replay reaches the crash position: the state against the lost one.
    fn check_caught_up(&mut self, report: &mut ClusterReport) {
        let tolerance = self.tolerance;
        let Some(check) = &self.check else { return };
        if check.offset > self.next_offset {
            return;
        }
        if let Some(check) = self.check.take() {
            if check.offset < self.next_offset {
                return;
            }
            let bound = check.bound + check.replay_moves;
            let observed = self.driver.operator().distance(&check.lost);
            if let Some(record) = report.recoveries.get_mut(check.recovery) {
                record.observed = Some(observed);
                record.bound = bound;
            }
            if observed > bound * (1.0 + tolerance) + tolerance {
                report.violations.push(format!(
                    "{:?}: state {observed} from the lost one once replayed to offset {}, over its bound {bound}",
                    self.task, check.offset
                ));
            }
        }
    }

    /// Takes up to `batch` items of `input`, one at a time. Returns how many.
    fn take(&mut self, input: &[O::Input], batch: usize, report: &mut ClusterReport) -> Result<usize, CoreError> {
        let mut taken = 0;
        while taken < batch && (self.next_offset as usize) < input.len() {
            let offset = self.next_offset;
            let one = std::iter::once((offset, &input[offset as usize]));
            if self.driver.process(one, self.broker.step, &mut self.broker)? == 0 {
                break;
            }
            taken += 1;
            self.next_offset += 1;
            self.check_caught_up(report);
        }
        Ok(taken)
    }
}

/// Runs the cluster over `partitions` (one per worker) until every item is
/// trained on and every model averaged, crashing where the options say, then
/// stops every task cleanly.
pub fn simulate_cluster(
    sgd: DistributedSgdConfig,
    worker_config: ControllerConfig,
    averager_config: ControllerConfig,
    partitions: &[Vec<LabeledVector>],
    options: &ClusterOptions,
) -> Result<ClusterReport, CoreError> {
    let mut cluster = Cluster::start(sgd, (worker_config, averager_config), partitions, options)?;
    let mut idle_steps = 0;
    loop {
        cluster.step += 1;
        let mut progress = cluster.deliver();
        if cluster.crash_due()? {
            continue;
        }
        progress |= cluster.take_input()?;
        if cluster.drained() && cluster.crashes.is_empty() {
            break;
        }
        if progress {
            idle_steps = 0;
            continue;
        }
        // Time jumps ahead while every task waits.
        if !cluster.deliver_waiting() {
            idle_steps += 1;
            if idle_steps > 2 {
                if let Some(crash) = cluster.crashes.front_mut() {
                    // Crashes still to come after the last item: they happen now.
                    crash.after_items = 0;
                    continue;
                }
                cluster.report_stall();
                break;
            }
        }
    }
    cluster.stop();
    Ok(cluster.finish())
}

/// The cluster's tasks and topics as a run goes.
struct Cluster<'a> {
    sgd: DistributedSgdConfig,
    partitions: &'a [Vec<LabeledVector>],
    options: &'a ClusterOptions,
    rng: rand::rngs::StdRng,
    workers: Vec<Node<SgdWorker>>,
    averager: Node<ModelAverager>,
    /// The model topic: the workers' local models, the averager's input.
    models: Vec<LocalModel>,
    /// The feedback topic: the averager's global models.
    feedback: Vec<GlobalModel>,
    crashes: VecDeque<ClusterCrash>,
    report: ClusterReport,
    step: u64,
}

impl<'a> Cluster<'a> {
    fn start(
        sgd: DistributedSgdConfig,
        (worker_config, averager_config): (ControllerConfig, ControllerConfig),
        partitions: &'a [Vec<LabeledVector>],
        options: &'a ClusterOptions,
    ) -> Result<Self, CoreError> {
        if partitions.len() != sgd.workers as usize {
            return Err(CoreError::parameter(
                "partitions",
                partitions.len(),
                format!("one per worker ({} configured)", sgd.workers),
            ));
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(options.seed);
        let mut workers = Vec::new();
        for worker in 0..sgd.workers {
            workers.push(Node::start(
                ClusterTask::Worker(worker),
                worker_config,
                SgdWorker::new(sgd, worker)?,
                options,
                rng.gen(),
            )?);
        }
        let averager = Node::start(
            ClusterTask::Averager,
            averager_config,
            ModelAverager::new(sgd)?,
            options,
            rng.gen(),
        )?;
        Ok(Cluster {
            sgd,
            partitions,
            options,
            rng,
            workers,
            averager,
            models: Vec::new(),
            feedback: Vec::new(),
            crashes: options.crashes.iter().cloned().collect(),
            report: ClusterReport::default(),
            step: 0,
        })
    }

    /// Acknowledgements due this step; what the tasks sent goes to its topic.
    fn deliver(&mut self) -> bool {
        let step = self.step;
        let mut progress = false;
        for worker in &mut self.workers {
            progress |= worker.deliver(step, false);
            self.models.extend(worker.broker.sink.drain(..).map(|(_, model)| model));
        }
        progress |= self.averager.deliver(step, false);
        for (_, global) in self.averager.broker.sink.drain(..) {
            self.report.convergence.push(ConvergencePoint {
                step,
                items: global.items,
                clock: global.clock,
                loss: global.loss,
                weights_l1: global.weights_l1,
            });
            self.feedback.push(global);
        }
        progress
    }

    /// Every acknowledgement in flight, at once: time jumps ahead.
    fn deliver_waiting(&mut self) -> bool {
        let mut forced = false;
        for worker in &mut self.workers {
            forced |= worker.deliver(self.step, true);
        }
        forced | self.averager.deliver(self.step, true)
    }

    /// Makes the next crash if the workers have trained on enough items.
    fn crash_due(&mut self) -> Result<bool, CoreError> {
        let items: u64 = self.workers.iter().map(|w| w.stats().items).sum();
        if self.crashes.front().is_none_or(|c| items < c.after_items) {
            return Ok(false);
        }
        let Some(crash) = self.crashes.pop_front() else {
            return Ok(false);
        };
        let sgd = self.sgd;
        for task in crash.tasks {
            match task {
                ClusterTask::Worker(k) => {
                    let node = self
                        .workers
                        .get_mut(k as usize)
                        .ok_or_else(|| CoreError::parameter("crash", k, format!("a worker below {}", sgd.workers)))?;
                    node.crash(SgdWorker::new(sgd, k)?, &mut self.report)?;
                    self.models.extend(node.broker.sink.drain(..).map(|(_, model)| model));
                    // The restarted worker reads the feedback topic's latest record.
                    node.feedback = self.feedback.len().saturating_sub(1);
                }
                ClusterTask::Averager => {
                    self.averager.crash(ModelAverager::new(sgd)?, &mut self.report)?;
                    self.feedback
                        .extend(self.averager.broker.sink.drain(..).map(|(_, g)| g));
                }
            }
        }
        Ok(true)
    }

    /// Each worker takes in the global models it has not seen, then a batch
    /// of its partition; the averager a batch of the model topic.
    fn take_input(&mut self) -> Result<bool, CoreError> {
        let mut progress = false;
        let max_batch = self.options.max_batch.max(1);
        for worker in &mut self.workers {
            while let Some(global) = self.feedback.get(worker.feedback) {
                worker.feedback += 1;
                let moved = worker.driver.side_input(|w| w.adopt(global), &mut worker.broker);
                let offset = worker.driver.controller().processed().offset;
                worker.moves.push((offset, moved));
                if let Some(check) = &mut worker.check {
                    check.replay_moves += moved;
                }
                progress = true;
            }
            let batch = self.rng.gen_range(1..=max_batch);
            let partition = &self.partitions[worker.worker_index()];
            progress |= worker.take(partition, batch, &mut self.report)? > 0;
        }
        let batch = self.rng.gen_range(1..=max_batch);
        progress |= self.averager.take(&self.models, batch, &mut self.report)? > 0;
        Ok(progress)
    }

    /// Every item trained on, every model averaged and fed back, nothing in flight.
    fn drained(&self) -> bool {
        self.workers
            .iter()
            .all(|w| w.next_offset as usize >= self.partitions[w.worker_index()].len() && w.broker.idle())
            && self.averager.next_offset as usize >= self.models.len()
            && self.averager.broker.idle()
            && self.workers.iter().all(|w| w.feedback >= self.feedback.len())
    }

    fn report_stall(&mut self) {
        let waiting: Vec<String> = self
            .workers
            .iter()
            .filter(|w| (w.next_offset as usize) < self.partitions[w.worker_index()].len())
            .map(|w| {
                format!(
                    "worker {} at offset {} (iteration {}, clock {})",
                    w.worker_index(),
                    w.next_offset,
                    w.driver.operator().iteration(),
                    w.driver.operator().clock()
                )
            })
            .collect();
        self.report
            .violations
            .push(format!("the cluster stalled: {}", waiting.join("; ")));
    }

    /// A clean stop of every task.
    fn stop(&mut self) {
        for worker in &mut self.workers {
            worker.driver.begin_stop(&mut worker.broker);
        }
        self.averager.driver.begin_stop(&mut self.averager.broker);
        let stopped = |c: &Self| c.workers.iter().all(|w| w.driver.is_stopped()) && c.averager.driver.is_stopped();
        for _ in 0..10_000 {
            if stopped(self) {
                break;
            }
            self.step += 1;
            self.deliver_waiting();
        }
        if !stopped(self) {
            self.report.violations.push("the clean stop never finished".to_string());
        }
    }

    fn finish(mut self) -> ClusterReport {
        for worker in &self.workers {
            add_stats(&mut self.report.worker_stats, worker.stats());
        }
        self.report.averager_stats = self.averager.stats();
        self.report.steps = self.step;
        self.report.final_model = Some(self.averager.driver.operator().global());
        self.report
    }
}

impl Node<SgdWorker> {
    fn worker_index(&self) -> usize {
        self.driver.operator().worker() as usize
    }
}
