//! An in-memory adapter of the task driver with crash injection: a simulated
//! broker with a changelog partition that is compacted at random, an output
//! topic and a committed offset, whose acknowledgements arrive late and in
//! batches, and whose failed writes may have reached the log all the same (a
//! prefix of them: the changelog is gapless, so the writes behind a failed one
//! fail too and none of them lands).
//! Property tests, the benchmarks and `afstream simulate` use it to prove the
//! bounds on the very driver the service runs: at every crash it checks that no
//! output before the recovery point was lost and that only outputs of replayed
//! items repeat, at most β each; after every recovery, once the task has caught
//! up to the crash position, that the recovered state is within the bound of
//! the state lost in the crash: θ of each failure since, whatever l. The bound
//! it checks is computed here, from Θ and the failure count, not taken from
//! the controller.
//!
//! With `zombie_writes`, a crashed owner is stalled rather than dead: the
//! writes it had in flight land later, behind the next run's first records
//! ([`crate::fence`]); the expected state leaves them out.
//!
//! A task may also keep its state in a local store ([`SimulatedTask::on_local_store`]):
//! written after every poll batch and every round of acknowledgements, before
//! the changelog records handed out since go to the broker (as the service
//! does). A crash may come between a poll batch and the store write after it,
//! once the batch's outputs went out. It then restarts the task on its store
//! where the service would (the changelog's last marker is the store's own),
//! or loses the store with the machine and recovers from the changelog. A
//! restart on the store must catch up to exactly the lost state, lose at most
//! γ outputs, repeat at most those of one poll batch (β each), claim no less
//! than that in its own bound, and leave the changelog such that a later loss
//! of the store stays within θ.

use std::collections::VecDeque;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use super::batch::BackupBatch;
use super::controller::ControllerConfig;
use super::driver::{Ack, DriverFaults, DriverStats, TaskDriver, TaskIo};
use super::entry::BackupEntry;
use super::error::CoreError;
use super::mode::Mode;
use super::operator::Operator;
use super::recovery::{
    read_changelog, BackupMarker, ChangelogState, RecoveryPlan, ResumeSource, StoreCheckpoint, StoreWrites,
};
use super::structures::{KeyStore, MemoryKeyStore, Norm};
use super::thresholds::{ErrorBound, FailurePolicy};

mod broker;

pub use broker::Delivered;
pub(crate) use broker::SimBroker;

/// How a simulated run goes wrong.
#[derive(Clone, Debug)]
pub struct SimulationOptions {
    pub seed: u64,
    /// Crash after this many items processed in all (replays included), sorted.
    pub crash_after: Vec<u64>,
    /// Move each crash to the next moment a backup's entries may be in flight.
    pub crash_during_backup: bool,
    /// Move each crash to the next moment no changelog write is in flight and no
    /// backup waits for its marker (the log then ends with a marker that covers
    /// every entry).
    pub crash_when_changelog_idle: bool,
    /// The longest delay of an acknowledgement, in poll batches.
    pub max_ack_delay: u64,
    /// The most items one poll returns.
    pub max_batch: usize,
    /// Probability that a changelog write fails (after a random part of it, or
    /// all of it, reached the log).
    pub write_failure_rate: f64,
    /// A deliberately broken store: backups are acknowledged but never stored.
    pub drop_backups: bool,
    /// Test-only faults of the driver.
    pub driver_faults: DriverFaults,
    /// Float slack for the bound checks, relative to the bound.
    pub tolerance: f64,
    /// With a local store: the probability that a crash keeps it (the process
    /// died, the machine did not).
    pub local_restarts: f64,
    /// With a local store: the probability that a store write is held back
    /// (the service holds one during a failed delivery's backoff, or while
    /// dead letters are unacknowledged).
    pub held_store_writes: f64,
    /// A crash leaves its owner stalled, not dead: the changelog writes it had
    /// in flight land later, after the next run has written the changelog (a
    /// zombie owner, [`crate::fence`]). Compaction then spares the records
    /// written since the last recovery whose run got its start marker into
    /// the log (a run that crashed before rewrote nothing a late write
    /// superseded), as a `min.compaction.lag.ms` longer than the time to the
    /// next such recovery does.
    pub zombie_writes: bool,
}

impl Default for SimulationOptions {
    fn default() -> Self {
        SimulationOptions {
            seed: 0,
            crash_after: Vec::new(),
            crash_during_backup: false,
            crash_when_changelog_idle: false,
            max_ack_delay: 4,
            max_batch: 64,
            write_failure_rate: 0.0,
            drop_backups: false,
            driver_faults: DriverFaults::default(),
            tolerance: 1e-9,
            local_restarts: 0.0,
            held_store_writes: 0.0,
            zombie_writes: false,
        }
    }
}

/// A broken guarantee.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub enum Violation {
    /// After catching up to a crash position, the state was farther from the lost
    /// state than the bound allows.
    StateBound { crash: usize, observed: f64, bound: f64 },
    /// An output of an item before the recovery point never reached the sink.
    LostOutput { crash: usize, item_offset: u64 },
    /// A restart on the local store lost more outputs than γ.
    LostOutputs { crash: usize, lost: u64, bound: u64 },
    /// More outputs will be repeated than β per replayed item, or, on a
    /// restart on the local store, than β per item of one poll batch.
    RepeatedOutputs { crash: usize, repeated: u64, bound: u64 },
    /// A recovery's own bound (what the service logs) claims fewer repeated
    /// or lost outputs than the crash made.
    OutputsUnderReported {
        crash: usize,
        repeated: u64,
        lost: u64,
        claimed: ErrorBound,
    },
    /// A recovery restored something else than the state logged at the last
    /// marker (each key's latest record before it).
    NotTheMarkedState { crash: usize, key: Vec<u8> },
    /// The task stopped taking input with nothing in flight that could unblock it.
    Stalled { next_offset: u64, reason: String },
}

/// One recovery as observed.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RecoveryRecord {
    pub crash_item_offset: u64,
    pub resume_offset: u64,
    pub failures: u32,
    pub source: ResumeSource,
    /// Changelog records read to restore.
    pub records_read: u64,
    /// The distance from the lost state once caught up (None if a later crash came
    /// first).
    pub observed: Option<f64>,
    /// The state bound of this failure, computed from Θ and k.
    pub bound: f64,
    /// Whether the run after this recovery took input. One that crashed before
    /// (its start marker maybe never written) is done again by the next recovery
    /// with the same k, so it does not count towards k here.
    pub progressed: bool,
}

/// What a simulated run did.
#[derive(Clone, Debug, Default, Serialize)]
pub struct SimulationReport {
    /// Totals over every run of the task (one per crash, plus the first).
    pub totals: DriverStats,
    /// Records the changelog received (entries and markers, failed writes too).
    pub changelog_records: u64,
    /// Of those, the ones sent before the clean stop at the end began: what
    /// running costs, without the stop's complete backup.
    pub changelog_records_before_stop: u64,
    pub outputs_delivered: u64,
    pub recoveries: Vec<RecoveryRecord>,
    pub violations: Vec<Violation>,
}

impl SimulationReport {
    pub fn items_processed(&self) -> u64 {
        self.totals.items
    }
}

struct PendingCheck<O> {
    crash: usize,
    offset: u64,
    lost: O,
}

/// The state bound and l of a failure with `k` failures counted before it,
/// computed from the configuration alone: θ_k = Θ'/2^(k+1) and
/// l_k = max(1, ⌊L'/2^(k+1)⌋) under halving (and recovering), Θ' and L' under the
/// fixed policy (Θ', L' the split thresholds); in exact mode θ is 0. The state
/// bound is θ_k alone: a recovery restores the state logged at its marker and
/// replays from it exactly.
pub fn independent_bound(config: &ControllerConfig, k: u32) -> (f64, u64) {
    let global = config.policy.global;
    // n tasks' distances combine to Θ: n·θ under L1, √(n·θ²) under L2, θ under a maximum.
    let tasks = f64::from(config.policy.placement.parallelism);
    let (theta_divisor, items_divisor) = match config.policy.norm {
        Norm::L1 | Norm::KeyCount => (tasks, tasks),
        Norm::L2 => (tasks.sqrt(), tasks),
        Norm::Max => (1.0, 1.0),
    };
    let later = config.policy.placement.stages - config.policy.placement.stage;
    let theta_split = global.theta / theta_divisor / config.policy.placement.stage_fanout.powi(later as i32);
    let items_split = global.max_uncovered as f64 / items_divisor;
    let halving = match config.policy.failures {
        FailurePolicy::Fixed => 1.0,
        FailurePolicy::Halving | FailurePolicy::Recovering { .. } => 2f64.powi(k as i32 + 1),
    };
    let (theta, items) = match config.mode {
        Mode::Exact(interval) => (0.0, interval.items.map_or(u64::MAX, |n| 2 * n)),
        _ => (theta_split / halving, ((items_split / halving).floor() as u64).max(1)),
    };
    (theta, items)
}

/// The simulated task: the driver over the simulated broker.
/// How the harness builds a task's operator.
enum Build<'a, O> {
    InMemory(&'a dyn Fn() -> O),
    OnStore(&'a dyn Fn(Box<dyn KeyStore>) -> O),
}

// Not derived: a derive would ask `O: Copy`, and only references are copied.
impl<O> Clone for Build<'_, O> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<O> Copy for Build<'_, O> {}

/// A task's local store, and what its last write said.
struct LocalStore {
    store: MemoryKeyStore,
    /// Stamped on the markers the task writes while it runs on this store.
    id: u64,
    /// What its last write said.
    checkpoint: StoreCheckpoint,
}

pub struct SimulatedTask<'a, O: Operator> {
    config: ControllerConfig,
    build: Build<'a, O>,
    local: Option<LocalStore>,
    options: SimulationOptions,
    driver: TaskDriver<O>,
    broker: SimBroker<O::Output>,
    next_offset: u64,
    report: SimulationReport,
    checks: Vec<PendingCheck<O>>,
    failure_bounds: Vec<f64>,
    /// The loop round until which store writes are held back.
    store_held_until: u64,
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
        Self::start(config, Build::InMemory(build), options)
    }

    /// A task whose operator keeps its state in a local store, built by
    /// `build_on` on it; a crash keeps the store with probability
    /// [`SimulationOptions::local_restarts`].
    pub fn on_local_store(
        config: ControllerConfig,
        build_on: &'a dyn Fn(Box<dyn KeyStore>) -> O,
        options: SimulationOptions,
    ) -> Result<Self, CoreError> {
        Self::start(config, Build::OnStore(build_on), options)
    }

    fn start(config: ControllerConfig, build: Build<'a, O>, options: SimulationOptions) -> Result<Self, CoreError> {
        let mut broker = SimBroker::new(&options);
        broker.holding = matches!(build, Build::OnStore(_));
        let empty = read_changelog(&[])?;
        let local = matches!(build, Build::OnStore(_)).then(|| LocalStore::fresh(1));
        let (operator, config) = build_operator(build, local.as_ref(), config);
        let (mut driver, _) = TaskDriver::recover(config, operator, &empty, None, 0, 0, &mut broker)?;
        prepare_driver(&mut driver, &options, local.is_some());
        Ok(SimulatedTask {
            config,
            build,
            local,
            options,
            driver,
            broker,
            next_offset: 0,
            report: SimulationReport::default(),
            checks: Vec::new(),
            failure_bounds: Vec::new(),
            store_held_until: 0,
        })
    }

    pub fn operator(&self) -> &O {
        self.driver.operator()
    }

    /// Delivered outputs with the offset of their item.
    pub fn sink(&self) -> &[(u64, O::Output)] {
        &self.broker.sink
    }

    /// The sum of the bounds of every failure so far.
    pub fn total_bound(&self) -> f64 {
        self.failure_bounds.iter().sum()
    }

    fn deliver(&mut self, force: bool) -> bool {
        // What the driver handed out since (a start marker, say) goes first.
        self.persist();
        let delivered = self.broker.deliver(force);
        self.broker.report_to(&mut self.driver);
        self.persist();
        delivered
    }

    /// What the service does after a poll batch or a round of reports: writes
    /// the state's changes to the local store (with the offset they are exact
    /// at), then sends the changelog records handed out since.
    fn persist(&mut self) {
        if self.local.is_some() {
            if self.store_write_held() {
                return;
            }
            if self.broker.rng.gen_bool(self.options.held_store_writes.clamp(0.0, 1.0)) {
                // Held back for a few rounds, as the service holds its writes
                // while a failed delivery's backoff lasts: the changelog
                // records wait with them.
                self.store_held_until = self.broker.step + self.broker.rng.gen_range(1..=4);
                return;
            }
        }
        self.driver.stage_state();
        if let Some(local) = &mut self.local {
            local.store.write();
            self.driver.checkpoint(&mut local.checkpoint);
        }
        self.driver.state_durable();
        self.broker.release();
    }

    fn store_write_held(&self) -> bool {
        self.broker.step < self.store_held_until
    }

    fn add_totals(&mut self) {
        let s = self.driver.stats();
        let t = &mut self.report.totals;
        t.items += s.items;
        t.rejected += s.rejected;
        t.outputs += s.outputs;
        t.backups += s.backups;
        t.backup_entries += s.backup_entries;
        t.backup_bytes += s.backup_bytes;
        t.backups_failed += s.backups_failed;
        t.markers += s.markers;
        t.markers_failed += s.markers_failed;
        t.commits += s.commits;
        t.stalls += s.stalls;
        t.stalls_for_outputs += s.stalls_for_outputs;
        t.operator_waits += s.operator_waits;
    }

    fn crash(&mut self) -> Result<(), CoreError> {
        let crash = self.report.recoveries.len();
        let processed = self.driver.controller().processed();
        self.add_totals();
        let started = !self.driver.controller().is_starting();
        let lost_outputs = self.broker.crash();
        if let Some(local) = &self.local {
            // What the process staged and never wrote dies with it.
            local.store.drop_staged();
        }
        if started {
            self.broker.compactable = self.broker.compactable_once_started;
        }
        if self.broker.rng.gen_bool(0.5) {
            self.broker.compact();
        }
        self.broker.compactable_once_started = self.broker.log.len();
        let lost = self.driver.operator().clone();
        if self.driver.stats().items == 0 {
            if let Some(last) = self.report.recoveries.last_mut() {
                last.progressed = false;
            }
        }
        // The failures in force, counted from this harness's own record: every
        // earlier recovery after which the task took input, or under the
        // recovering policy those that resumed within the window before the crash.
        let counted = self.report.recoveries.iter().filter(|r| r.progressed);
        let k = match self.config.policy.failures {
            FailurePolicy::Recovering { window_items } => counted
                .filter(|r| r.resume_offset.saturating_add(window_items) > processed.offset)
                .count() as u32,
            _ => counted.count() as u32,
        };
        let (bound, _) = independent_bound(&self.config, k);

        let changelog = read_changelog(&self.broker.log)?;
        let plan = if self.restarts_on_store(changelog.marker.as_ref()) {
            self.restart_on_store(changelog.marker.as_ref())?
        } else {
            self.recover_from_changelog(crash, &changelog)?
        };
        prepare_driver(&mut self.driver, &self.options, self.local.is_some());

        self.check_outputs(crash, &plan, processed.offset, lost_outputs);
        // Outputs of items that will be replayed are made again: set them aside,
        // so the sink compares with a failure-free run (they stay delivered).
        let (kept, replayed): (Vec<_>, Vec<_>) = std::mem::take(&mut self.broker.sink)
            .into_iter()
            .partition(|(offset, _)| *offset < plan.resume_offset);
        self.broker.sink = kept;
        self.broker.replayed.extend(replayed);

        let bound = match (self.config.mode, plan.source) {
            (Mode::None, _) => f64::INFINITY,
            // Exact at the store's offset, and the replay from it is exact.
            (_, ResumeSource::LocalStore) => 0.0,
            _ => bound,
        };
        self.failure_bounds.push(bound);
        self.checks.push(PendingCheck {
            crash,
            offset: processed.offset,
            lost,
        });
        self.next_offset = plan.resume_offset;
        self.report.recoveries.push(RecoveryRecord {
            crash_item_offset: processed.offset,
            resume_offset: plan.resume_offset,
            failures: plan.failures,
            source: plan.source,
            records_read: if plan.source == ResumeSource::LocalStore {
                0
            } else {
                changelog.records
            },
            observed: None,
            bound,
            progressed: true,
        });
        Ok(())
    }

    /// What the crash did to the outputs: none lost before the recovery point
    /// (at most γ on a restart on the local store), repeats within
    /// [`Self::check_repeats`], and, on a restart on the store, no more of
    /// either than the recovery's own bound claims.
    fn check_outputs(&mut self, crash: usize, plan: &RecoveryPlan, crash_offset: u64, lost_outputs: Vec<u64>) {
        let lost_before: Vec<u64> = lost_outputs
            .into_iter()
            .filter(|offset| *offset < plan.resume_offset)
            .collect();
        let lost_count = lost_before.len() as u64;
        if plan.source == ResumeSource::LocalStore {
            // The store is exact at its offset, written whatever outputs were
            // unacknowledged: at most γ, and γ never exceeds Γ/2.
            let bound = self.config.policy.global.max_unacked.div_ceil(2);
            if lost_count > bound {
                self.report.violations.push(Violation::LostOutputs {
                    crash,
                    lost: lost_count,
                    bound,
                });
            }
        } else {
            for item_offset in lost_before {
                self.report
                    .violations
                    .push(Violation::LostOutput { crash, item_offset });
            }
        }
        let repeated = self
            .broker
            .sink
            .iter()
            .filter(|(offset, _)| *offset >= plan.resume_offset && *offset < crash_offset)
            .count() as u64;
        if self.config.mode == Mode::Approximate {
            self.check_repeats(crash, plan, crash_offset, repeated);
        }
        if plan.source == ResumeSource::LocalStore
            && (repeated as f64 > plan.introduced.outputs || lost_count as f64 > plan.introduced.lost_outputs)
        {
            self.report.violations.push(Violation::OutputsUnderReported {
                crash,
                repeated,
                lost: lost_count,
                claimed: plan.introduced,
            });
        }
    }

    /// At most β outputs of each replayed item repeat; on a restart on the
    /// local store, which the harness writes after every poll batch, the
    /// replayed items are at most one batch.
    fn check_repeats(&mut self, crash: usize, plan: &RecoveryPlan, crash_offset: u64, repeated: u64) {
        let beta = self.config.constants.beta;
        let replayed_items = crash_offset.saturating_sub(plan.resume_offset);
        let mut allowed = replayed_items.saturating_mul(beta);
        if plan.source == ResumeSource::LocalStore {
            allowed = allowed.min((self.options.max_batch as u64).saturating_mul(beta));
        }
        if repeated > allowed {
            self.report.violations.push(Violation::RepeatedOutputs {
                crash,
                repeated,
                bound: allowed,
            });
        }
    }

    /// Whether the task restarts on its local store: it has one, the crash
    /// kept it, and the changelog's last marker is its own (as the service
    /// decides: otherwise the store may not know every key the log holds).
    fn restarts_on_store(&mut self, last_marker: Option<&BackupMarker>) -> bool {
        let Some(local) = &self.local else { return false };
        if !self.broker.zombie.is_empty() {
            // Its owner is stalled, not dead: the partition moved to another
            // member, which has no store of it.
            return false;
        }
        let kept = self.broker.rng.gen_bool(self.options.local_restarts.clamp(0.0, 1.0));
        kept && self.config.mode != Mode::None && last_marker.is_some_and(|m| m.writer == local.id)
    }

    /// The process died, its store did not: the task reopens it and resumes at
    /// its offset, with its source positions.
    fn restart_on_store(&mut self, last_marker: Option<&BackupMarker>) -> Result<RecoveryPlan, CoreError> {
        let Some(local) = &self.local else {
            return Err(CoreError::undecodable("local store", "none to restart on"));
        };
        let (mut operator, config) = build_operator(self.build, Some(local), self.config);
        operator.load_local_state()?;
        let writes = StoreWrites {
            max_unwritten_items: self.options.max_batch as u64,
            largest_gamma: self.config.policy.for_failures(0).max_unacked,
        };
        let plan = RecoveryPlan::local(&local.checkpoint, last_marker, writes, self.config.constants);
        let now = self.broker.step;
        self.driver = TaskDriver::start(config, operator, &plan, Vec::new(), now, &mut self.broker)?;
        Ok(plan)
    }

    /// A fresh operator (on a new, empty store if the task keeps one) restored
    /// from the changelog, resuming at the last marker.
    fn recover_from_changelog(&mut self, crash: usize, changelog: &ChangelogState) -> Result<RecoveryPlan, CoreError> {
        if !self.options.drop_backups && self.config.mode != Mode::None {
            let expected = self.broker.state_at_last_marker();
            if let Some(key) = first_difference(&expected, &changelog.entries) {
                self.report.violations.push(Violation::NotTheMarkedState { crash, key });
            }
        }
        if let Some(local) = &mut self.local {
            *local = LocalStore::fresh(local.id + 1);
        }
        let (operator, config) = build_operator(self.build, self.local.as_ref(), self.config);
        let committed = self.broker.committed;
        let now = self.broker.step;
        let (driver, plan) = TaskDriver::recover(config, operator, changelog, committed, 0, now, &mut self.broker)?;
        self.driver = driver;
        Ok(plan)
    }

    fn check_caught_up(&mut self) {
        let offset = self.next_offset;
        let tolerance = self.options.tolerance;
        let mut index = 0;
        while index < self.checks.len() {
            if self.checks[index].offset > offset {
                index += 1;
                continue;
            }
            let check = self.checks.remove(index);
            if check.offset < offset {
                // A later crash came first and the replay passed this point in a
                // later batch; checked at the exact position only.
                continue;
            }
            // Every failure since this crash adds its own bound.
            let bound: f64 = self.failure_bounds[check.crash..].iter().sum();
            let observed = self.driver.operator().distance(&check.lost);
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

    /// The next crash's item count is reached.
    fn crash_reached(&self, crashes: &VecDeque<u64>) -> bool {
        crashes
            .front()
            .is_some_and(|&at| self.report.totals.items + self.driver.stats().items >= at)
    }

    /// The next crash is reached and the moment is one the options ask for.
    fn crash_due(&self, crashes: &VecDeque<u64>) -> bool {
        self.crash_reached(crashes)
            && (!self.options.crash_during_backup || self.driver.controller().backup_open())
            && (!self.options.crash_when_changelog_idle
                || (self.broker.writes.is_empty() && !self.driver.controller().backup_open()))
    }

    /// Runs the whole stream, crashing where the options say, and stops cleanly at
    /// the end.
    pub fn run(self, stream: &[O::Input]) -> Result<(O, SimulationReport), CoreError> {
        self.run_with_outputs(stream)
            .map(|(operator, report, _)| (operator, report))
    }

    /// Like [`SimulatedTask::run`], also returning every output ever delivered
    /// with the offset of its item (those of replayed items included).
    pub fn run_with_outputs(
        mut self,
        stream: &[O::Input],
    ) -> Result<(O, SimulationReport, Delivered<O::Output>), CoreError> {
        let mut crashes: VecDeque<u64> = self.options.crash_after.iter().copied().collect();
        let mut stopping = false;
        let end = stream.len() as u64;
        loop {
            self.broker.step += 1;
            self.deliver(false);
            if self.crash_due(&crashes) {
                crashes.pop_front();
                self.crash()?;
                self.check_caught_up();
                continue;
            }
            if self.next_offset >= end && crashes.is_empty() {
                if !stopping {
                    stopping = true;
                    self.report.changelog_records_before_stop = self.broker.changelog_records;
                    self.driver.begin_stop(&mut self.broker);
                }
                if self.driver.is_stopped() {
                    break;
                }
                if !self.deliver(true) && !self.store_write_held() {
                    self.report.violations.push(Violation::Stalled {
                        next_offset: self.next_offset,
                        reason: "the clean stop never finished".to_string(),
                    });
                    break;
                }
                continue;
            }
            if self.next_offset >= end {
                // Waiting for a crash still to come at the end.
                if !self.deliver(true) && !self.store_write_held() {
                    crashes.clear();
                }
                continue;
            }
            // One poll: up to max_batch items, each checked at its own position.
            let batch = self.broker.rng.gen_range(1..=self.options.max_batch.max(1)) as u64;
            let until = (self.next_offset + batch).min(end);
            let mut taken_total = 0;
            while self.next_offset < until {
                let offset = self.next_offset;
                let one = std::iter::once((offset, &stream[offset as usize]));
                let taken = self.driver.process(one, self.broker.step, &mut self.broker)?;
                if taken == 0 {
                    break;
                }
                taken_total += 1;
                self.next_offset += 1;
                self.check_caught_up();
                if self.crash_reached(&crashes) {
                    break;
                }
            }
            if self.crash_due(&crashes) {
                // Between the poll batch and the store write that follows it:
                // its outputs went out, its state is not in the store.
                crashes.pop_front();
                self.crash()?;
                self.check_caught_up();
                continue;
            }
            // The service writes a store-backed state after every poll batch.
            self.persist();
            if taken_total == 0
                && self.driver.readiness().is_err()
                && !self.deliver(true)
                && !self.store_write_held()
                && self.driver.readiness().is_err()
            {
                self.report.violations.push(Violation::Stalled {
                    next_offset: self.next_offset,
                    reason: format!("{:?}", self.driver.readiness()),
                });
                break;
            }
        }
        self.add_totals();
        self.report.changelog_records = self.broker.changelog_records;
        self.report.outputs_delivered = self.broker.sink.len() as u64;
        let mut delivered = std::mem::take(&mut self.broker.sink);
        delivered.append(&mut self.broker.replayed);
        Ok((self.driver.into_operator(), self.report, delivered))
    }
}

impl LocalStore {
    fn fresh(id: u64) -> Self {
        LocalStore {
            store: MemoryKeyStore::new(),
            id,
            checkpoint: StoreCheckpoint::default(),
        }
    }
}

/// A new operator (on the task's store, if it keeps one), and the controller
/// config that stamps the store's identity on its markers.
fn build_operator<O>(
    build: Build<'_, O>,
    local: Option<&LocalStore>,
    config: ControllerConfig,
) -> (O, ControllerConfig) {
    match (build, local) {
        (Build::OnStore(build_on), Some(local)) => {
            (build_on(Box::new(local.store.clone())), config.with_writer(local.id))
        }
        (Build::OnStore(build_on), None) => (build_on(Box::new(MemoryKeyStore::new())), config),
        (Build::InMemory(build), _) => (build(), config),
    }
}

/// The first key two sorted sets of entries disagree on.
fn first_difference(expected: &[BackupEntry], restored: &[BackupEntry]) -> Option<Vec<u8>> {
    let mut restored = restored.iter().peekable();
    for entry in expected {
        match restored.next() {
            Some(r) if r.key == entry.key && r.value == entry.value => {}
            Some(r) if r.key < entry.key => return Some(r.key.to_vec()),
            _ => return Some(entry.key.to_vec()),
        }
    }
    restored.next().map(|r| r.key.to_vec())
}

/// A new run's driver: the options' faults, and with a local store the
/// service's write after every poll batch.
fn prepare_driver<O: Operator>(driver: &mut TaskDriver<O>, options: &SimulationOptions, keeps_store: bool) {
    set_driver_faults(driver, options.driver_faults);
    if keeps_store {
        driver.write_store_every(options.max_batch as u64);
    }
}

#[cfg(feature = "fault-injection")]
pub(crate) fn set_driver_faults<O: Operator>(driver: &mut TaskDriver<O>, faults: DriverFaults) {
    driver.inject_faults(faults);
}

#[cfg(not(feature = "fault-injection"))]
pub(crate) fn set_driver_faults<O: Operator>(_driver: &mut TaskDriver<O>, _faults: DriverFaults) {}

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
