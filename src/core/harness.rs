//! An in-memory task runtime with crash injection: the operator, its controller, a
//! changelog, a committed offset and an output sink, with acknowledgements that
//! arrive after random delays, exactly as the Kafka mapping prescribes but with no
//! broker. Property tests, the benchmarks and `afstream simulate` use it to prove
//! the bounds: at every crash it checks that no output of a committed item was
//! lost and that at most l·β outputs will repeat; after every recovery it checks,
//! once the task has caught up to the crash position, that the recovered state is
//! within the proven bound of the state lost in the crash.

use std::collections::VecDeque;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use super::controller::{Action, ControllerConfig, Mode, TaskController};
use super::entry::BackupEntry;
use super::error::CoreError;
use super::operator::Operator;
use super::recovery::{restorable, RecoveryPlan};

/// How a simulated run goes wrong.
#[derive(Clone, Debug)]
pub struct SimulationOptions {
    pub seed: u64,
    /// Crash after this many items processed in all (replays included), sorted.
    pub crash_after: Vec<u64>,
    /// Move each crash to the next moment a backup is in flight.
    pub crash_during_backup: bool,
    /// The longest delay of an acknowledgement, in steps (one step per item).
    pub max_ack_delay: u64,
    /// Probability that a backup fails (after persisting a random prefix).
    pub backup_failure_rate: f64,
    /// A deliberately broken store: backups are acknowledged but never stored.
    pub drop_backups: bool,
    /// Float slack for the bound checks, relative to the bound.
    pub tolerance: f64,
}

impl Default for SimulationOptions {
    fn default() -> Self {
        SimulationOptions {
            seed: 0,
            crash_after: Vec::new(),
            crash_during_backup: false,
            max_ack_delay: 8,
            backup_failure_rate: 0.0,
            drop_backups: false,
            tolerance: 1e-9,
        }
    }
}

/// A broken guarantee.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub enum Violation {
    /// After catching up to a crash position, the state was farther from the lost
    /// state than the bound allows.
    StateBound { crash: usize, observed: f64, bound: f64 },
    /// An output of an item below the committed offset never reached the sink.
    LostOutput { crash: usize, item_offset: u64 },
    /// More outputs will be repeated than l·β.
    RepeatedOutputs { crash: usize, repeated: u64, bound: u64 },
    /// The task stopped taking input with nothing in flight that could unblock it.
    Stalled { next_offset: u64, reason: String },
}

/// One recovery as observed.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RecoveryRecord {
    pub crash_item_offset: u64,
    pub resume_offset: u64,
    pub failures: u32,
    /// The distance from the lost state once caught up (None if a later crash came
    /// first).
    pub observed: Option<f64>,
    pub bound: f64,
}

/// What a simulated run did.
#[derive(Clone, Debug, Default, Serialize)]
pub struct SimulationReport {
    pub items_processed: u64,
    pub backups: u64,
    pub backup_entries: u64,
    pub backup_bytes: u64,
    pub commits: u64,
    pub outputs_delivered: u64,
    pub rejected: u64,
    pub recoveries: Vec<RecoveryRecord>,
    pub violations: Vec<Violation>,
}

struct Due<T> {
    at: u64,
    what: T,
}

struct InFlightBackup {
    seq: u64,
    records: Vec<BackupEntry>,
    fails: bool,
}

struct PendingCheck<O> {
    crash: usize,
    offset: u64,
    lost: O,
}

/// The simulated task: operator, controller and the broker's side of things.
pub struct SimulatedTask<'a, O: Operator> {
    config: ControllerConfig,
    build: &'a dyn Fn() -> O,
    options: SimulationOptions,
    rng: StdRng,
    operator: O,
    controller: TaskController,
    step: u64,
    next_offset: u64,
    changelog: Vec<BackupEntry>,
    committed: Option<u64>,
    backups: VecDeque<Due<InFlightBackup>>,
    commits: VecDeque<Due<u64>>,
    outputs: Vec<Due<(u64, O::Output)>>,
    /// Delivered outputs with the offset of their item.
    pub sink: Vec<(u64, O::Output)>,
    report: SimulationReport,
    checks: Vec<PendingCheck<O>>,
    failure_bounds: Vec<f64>,
    /// Entries the next backup writes first, undoing a crashed backup's tail.
    repair: Vec<BackupEntry>,
}

impl<'a, O> SimulatedTask<'a, O>
where
    O: Operator + Clone,
    O::Output: Clone,
{
    pub fn new(
        config: ControllerConfig,
        build: &'a dyn Fn() -> O,
        options: SimulationOptions,
    ) -> Result<Self, CoreError> {
        let mut actions = Vec::new();
        let controller = TaskController::start(config, &RecoveryPlan::fresh(0), 0, &mut actions)?;
        let mut operator = build();
        operator.set_theta(controller.operator_theta());
        let rng = StdRng::seed_from_u64(options.seed);
        let mut task = SimulatedTask {
            config,
            build,
            options,
            rng,
            operator,
            controller,
            step: 0,
            next_offset: 0,
            changelog: Vec::new(),
            committed: None,
            backups: VecDeque::new(),
            commits: VecDeque::new(),
            outputs: Vec::new(),
            sink: Vec::new(),
            report: SimulationReport::default(),
            checks: Vec::new(),
            failure_bounds: Vec::new(),
            repair: Vec::new(),
        };
        task.execute(actions);
        Ok(task)
    }

    pub fn operator(&self) -> &O {
        &self.operator
    }

    pub fn controller(&self) -> &TaskController {
        &self.controller
    }

    /// The sum of the bounds of every failure so far.
    pub fn total_bound(&self) -> f64 {
        self.failure_bounds.iter().sum()
    }

    fn delay(&mut self) -> u64 {
        self.step + self.rng.gen_range(0..=self.options.max_ack_delay)
    }

    fn execute(&mut self, actions: Vec<Action>) {
        for action in actions {
            match action {
                Action::Backup { seq, scope, marker } => {
                    // The repair entries go with every backup until one of them is
                    // acknowledged: a failed one may have written only part of them.
                    let mut records = self.repair.clone();
                    self.operator.backup(seq, scope, &mut records);
                    self.report.backups += 1;
                    self.report.backup_entries += records.len() as u64;
                    self.report.backup_bytes += records.iter().map(|e| e.encoded_len() as u64).sum::<u64>();
                    records.push(marker.to_entry());
                    let fails = self.rng.gen_bool(self.options.backup_failure_rate.clamp(0.0, 1.0));
                    let at = self.delay();
                    self.backups.push_back(Due {
                        at,
                        what: InFlightBackup { seq, records, fails },
                    });
                }
                Action::Commit { offset } => {
                    self.report.commits += 1;
                    let at = self.delay();
                    self.commits.push_back(Due { at, what: offset });
                }
            }
        }
    }

    /// The broker keeps the highest committed offset.
    fn record_commit(&mut self, offset: u64) {
        self.committed = Some(self.committed.map_or(offset, |c| c.max(offset)));
    }

    fn persist_prefix(&mut self, records: &[BackupEntry]) {
        if self.options.drop_backups {
            return;
        }
        let keep = self.rng.gen_range(0..=records.len());
        self.changelog.extend_from_slice(&records[..keep]);
    }

    /// Delivers every acknowledgement due by now; with `force`, the earliest one
    /// even if it is not due (time jumps ahead while the task waits).
    fn deliver(&mut self, force: bool) -> bool {
        let mut delivered = false;
        let mut actions = Vec::new();
        let now = self.step;
        while self
            .backups
            .front()
            .is_some_and(|b| b.at <= now || (force && !delivered))
        {
            let Some(Due { what: backup, .. }) = self.backups.pop_front() else {
                break;
            };
            delivered = true;
            if backup.fails {
                self.persist_prefix(&backup.records);
                self.operator.fail_backup(backup.seq);
                self.controller
                    .backup_failed(backup.seq, self.operator.divergence(), &mut actions);
            } else {
                if !self.options.drop_backups {
                    self.changelog.extend_from_slice(&backup.records);
                }
                self.repair.clear();
                self.operator.acknowledge_backup(backup.seq);
                self.controller
                    .backup_acknowledged(backup.seq, self.operator.divergence(), &mut actions);
            }
        }
        while self
            .commits
            .front()
            .is_some_and(|c| c.at <= now || (force && !delivered))
        {
            let Some(Due { what: offset, .. }) = self.commits.pop_front() else {
                break;
            };
            delivered = true;
            self.record_commit(offset);
            self.controller.commit_acknowledged(offset, &mut actions);
        }
        let mut index = 0;
        while index < self.outputs.len() {
            if self.outputs[index].at <= now || (force && !delivered) {
                let Due {
                    what: (offset, output), ..
                } = self.outputs.swap_remove(index);
                delivered = true;
                self.sink.push((offset, output));
                self.report.outputs_delivered += 1;
                self.controller.outputs_acknowledged(offset, 1, &mut actions);
            } else {
                index += 1;
            }
        }
        self.execute(actions);
        delivered
    }

    fn crash(&mut self) -> Result<(), CoreError> {
        let crash = self.report.recoveries.len();
        let processed = self.controller.processed();
        let thresholds = self.controller.thresholds();
        let bound = self.controller.recovery_bound();
        // The broker's view at the crash: part of the backup in flight may have
        // been written, and part of the commits; outputs in flight may or may not
        // have arrived.
        let in_flight: Vec<_> = self.backups.drain(..).collect();
        for backup in in_flight {
            self.persist_prefix(&backup.what.records);
        }
        let keep = self.rng.gen_range(0..=self.commits.len());
        let persisted: Vec<u64> = self.commits.drain(..).take(keep).map(|c| c.what).collect();
        for offset in persisted {
            self.record_commit(offset);
        }
        let committed = self.committed.unwrap_or(0);
        let outputs: Vec<_> = self.outputs.drain(..).collect();
        for Due {
            what: (offset, output), ..
        } in outputs
        {
            if self.rng.gen_bool(0.5) {
                self.sink.push((offset, output));
            } else if offset < committed {
                self.report.violations.push(Violation::LostOutput {
                    crash,
                    item_offset: offset,
                });
            }
        }
        if self.config.mode == Mode::Approximate {
            let repeated = self
                .sink
                .iter()
                .filter(|(offset, _)| *offset >= committed && *offset < processed.offset)
                .count() as u64;
            let allowed = thresholds.items * self.operator.constants().beta;
            if repeated > allowed {
                self.report.violations.push(Violation::RepeatedOutputs {
                    crash,
                    repeated,
                    bound: allowed,
                });
            }
        }
        // Outputs of items that will be replayed are made again: forget them.
        self.sink.retain(|(offset, _)| *offset < committed);

        let lost = self.operator.clone();
        let bound = bound.map_or(f64::INFINITY, |b| b.state);
        self.failure_bounds.push(bound);
        self.checks.push(PendingCheck {
            crash,
            offset: processed.offset,
            lost,
        });

        // Recovery: a fresh operator restored from the changelog, resuming at the
        // committed offset.
        let mut operator = (self.build)();
        let restorable = restorable(&self.changelog)?;
        operator.restore(restorable.entries)?;
        let marker = restorable.marker;
        self.repair = restorable.repair;
        let plan = RecoveryPlan::decide(
            self.config.mode,
            marker.as_ref(),
            self.committed,
            0,
            &self.config.policy,
            self.config.constants,
        );
        let mut actions = Vec::new();
        self.controller = TaskController::start(self.config, &plan, self.step, &mut actions)?;
        operator.set_theta(self.controller.operator_theta());
        self.operator = operator;
        self.next_offset = plan.resume_offset;
        self.report.recoveries.push(RecoveryRecord {
            crash_item_offset: processed.offset,
            resume_offset: plan.resume_offset,
            failures: plan.failures,
            observed: None,
            bound,
        });
        self.execute(actions);
        Ok(())
    }

    fn check_caught_up(&mut self) {
        let offset = self.next_offset;
        let tolerance = self.options.tolerance;
        let mut index = 0;
        while index < self.checks.len() {
            if self.checks[index].offset != offset {
                index += 1;
                continue;
            }
            let check = self.checks.remove(index);
            // Every failure since this crash adds its own bound.
            let bound: f64 = self.failure_bounds[check.crash..].iter().sum();
            let observed = self.operator.distance(&check.lost);
            if let Some(record) = self.report.recoveries.get_mut(check.crash) {
                record.observed = Some(observed);
            }
            if observed > bound * (1.0 + tolerance) + tolerance {
                self.report.violations.push(Violation::StateBound {
                    crash: check.crash,
                    observed,
                    bound,
                });
            }
        }
    }

    /// Runs the whole stream, crashing where the options say, and stops cleanly at
    /// the end.
    pub fn run(mut self, stream: &[O::Input]) -> Result<(O, SimulationReport), CoreError> {
        let mut crashes: VecDeque<u64> = self.options.crash_after.iter().copied().collect();
        let mut outputs = Vec::new();
        let mut stopping = false;
        loop {
            self.step += 1;
            self.deliver(false);
            let crash_due = crashes.front().is_some_and(|&at| self.report.items_processed >= at)
                && (!self.options.crash_during_backup || self.controller.backup_in_flight());
            if crash_due {
                crashes.pop_front();
                self.crash()?;
                self.check_caught_up();
                continue;
            }
            if (self.next_offset as usize) >= stream.len() && crashes.is_empty() {
                if !stopping {
                    stopping = true;
                    let mut actions = Vec::new();
                    self.controller.begin_stop(&mut actions);
                    self.execute(actions);
                }
                if self.controller.is_stopped() {
                    break;
                }
                if !self.deliver(true) {
                    self.report.violations.push(Violation::Stalled {
                        next_offset: self.next_offset,
                        reason: "the clean stop never finished".to_string(),
                    });
                    break;
                }
                continue;
            }
            if (self.next_offset as usize) >= stream.len() || self.controller.readiness().is_err() {
                // Waiting (blocked, or for a crash still to come at the end).
                if !self.deliver(true) {
                    if (self.next_offset as usize) >= stream.len() {
                        // Nothing in flight and nothing to read: the remaining crash
                        // points lie past the end of the stream.
                        crashes.clear();
                    } else {
                        self.report.violations.push(Violation::Stalled {
                            next_offset: self.next_offset,
                            reason: format!("{:?}", self.controller.readiness()),
                        });
                        break;
                    }
                }
                continue;
            }
            let offset = self.next_offset;
            let item = &stream[offset as usize];
            outputs.clear();
            let made = match self.operator.process(item, &mut outputs) {
                Ok(()) => outputs.len() as u64,
                Err(_) => {
                    self.report.rejected += 1;
                    0
                }
            };
            self.report.items_processed += 1;
            for output in outputs.drain(..) {
                let at = self.delay();
                self.outputs.push(Due {
                    at,
                    what: (offset, output),
                });
            }
            self.next_offset += 1;
            let mut actions = Vec::new();
            self.controller
                .item_processed(offset, made, self.operator.divergence(), self.step, &mut actions);
            self.execute(actions);
            self.check_caught_up();
        }
        Ok((self.operator, self.report))
    }
}

/// Runs `stream` once with the options' crashes, and returns the final operator and
/// the report.
pub fn simulate<O>(
    config: ControllerConfig,
    build: &dyn Fn() -> O,
    stream: &[O::Input],
    options: SimulationOptions,
) -> Result<(O, SimulationReport), CoreError>
where
    O: Operator + Clone,
    O::Output: Clone,
{
    SimulatedTask::new(config, build, options)?.run(stream)
}
