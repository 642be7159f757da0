//! The decision logic of one task, driven by events and free of I/O.
//!
//! The controller decides when to back up, which offset to commit and when to stop
//! taking input. Its rules, and why they keep a failure's error within
//! θ + l·α (state) and γ + l·β (outputs):
//!
//! * **Backups.** After an item, if the divergence from the last *acknowledged*
//!   backup exceeds θ and no backup is in flight, a backup is issued. Only one
//!   backup is in flight at a time; the divergence keeps counting against the old
//!   baseline until the acknowledgement.
//! * **The safe point.** Commits never pass the *safe point*: the last position
//!   where the divergence from the backup that will be restored is at most θ (plus
//!   the one item that crossed it). Without a backup in flight that is the current
//!   position; a backup issued because an item crossed θ keeps that item's
//!   position; when a backup is acknowledged while the state has already drifted
//!   over θ again, the safe point is the acknowledged backup's own position.
//!   Recovering from a backup B and replaying from a commit C ≤ safe point S
//!   differs from the lost state by at most div(S) + |S − C|·α.
//! * **Commits.** A commit goes out once ⌈l/2⌉ items are uncommitted (so it is
//!   normally acknowledged before l are), and on every backup acknowledgement.
//!   Input stops while l items are not covered by an acknowledged commit, so a crash
//!   replays or loses at most l items. A commit never passes an item whose outputs
//!   are not acknowledged, so no output of a committed item is ever lost.
//! * **Outputs.** Input stops while taking one more item could leave more than γ
//!   outputs unacknowledged (each item makes at most β).
//! * **Exact mode** backs up completely every interval (items or time) and commits
//!   exactly the backup's position once it is acknowledged: exact state, replayed
//!   outputs (at-least-once), as Kafka Streams does.
//! * **Mode none** backs up nothing and commits only at a clean stop.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

use super::error::CoreError;
use super::operator::{AnalysisConstants, BackupScope};
use super::recovery::{BackupMarker, RecoveryPlan};
use super::thresholds::{ErrorBound, FailurePolicy, GlobalThresholds, Placement, TaskThresholds, ThresholdPolicy};

/// A position in a task's input: the next offset to read, and how many items the
/// task has processed to get there (offsets need not be contiguous).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Position {
    pub items: u64,
    pub offset: u64,
}

/// When exact mode backs up.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExactInterval {
    /// Back up after this many items.
    pub items: Option<u64>,
    /// Back up after this many milliseconds.
    pub millis: Option<u64>,
}

/// The fault-tolerance mode of a pipeline.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Mode {
    /// No backups and no commits until a clean stop: the no-fault-tolerance baseline.
    None,
    /// Backups when the divergence crosses θ, commits every l items.
    Approximate,
    /// A complete backup and a commit at every interval.
    Exact(ExactInterval),
}

impl Mode {
    pub fn validate(&self) -> Result<(), CoreError> {
        if let Mode::Exact(interval) = self {
            let zero = interval.items == Some(0) || interval.millis == Some(0);
            if zero || (interval.items.is_none() && interval.millis.is_none()) {
                return Err(CoreError::parameter(
                    "exact interval",
                    format!("{interval:?}"),
                    "set a positive number of items, of milliseconds, or both",
                ));
            }
        }
        Ok(())
    }
}

/// What the task must do next.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// Take backup `seq` of the operator with this scope, write its entries and then
    /// `marker`, and report the acknowledgement (or failure).
    Backup {
        seq: u64,
        scope: BackupScope,
        marker: BackupMarker,
    },
    /// Commit this input offset (the next offset to consume).
    Commit { offset: u64 },
}

/// Why the task may not take its next item.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Blocked {
    /// γ outputs could be unacknowledged.
    Outputs,
    /// l items are not covered by an acknowledged commit.
    Commit,
    /// The failure count of a recovery is not persisted yet.
    RecoveryMarker,
    /// Exact mode: an interval's backup waits for every output to be acknowledged.
    Barrier,
    /// The task is stopping or stopped.
    Stopping,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// A recovery's marker is in flight.
    Recovering,
    Running,
    /// Waiting for outputs, then the final backup, then the final commit.
    Stopping,
    Stopped,
}

#[derive(Clone, Copy, Debug)]
struct InFlight {
    seq: u64,
    covers: Position,
    clean: bool,
}

#[derive(Clone, Copy, Debug)]
struct ItemOutputs {
    /// The position just before the item: a commit may go up to here.
    before: Position,
    remaining: u64,
}

/// Configuration of one task's controller.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ControllerConfig {
    pub mode: Mode,
    pub policy: ThresholdPolicy,
    pub constants: AnalysisConstants,
}

impl ControllerConfig {
    /// The configuration of a lone task (one partition, one stage) of an operator
    /// with these constants, under the halving policy.
    pub fn single_task(
        mode: Mode,
        global: GlobalThresholds,
        constants: AnalysisConstants,
        additive: bool,
    ) -> Result<Self, CoreError> {
        let policy = ThresholdPolicy::new(
            global,
            FailurePolicy::Halving,
            Placement::default(),
            additive,
            constants,
        )?;
        Ok(ControllerConfig {
            mode,
            policy,
            constants,
        })
    }
}

/// The decision logic of one task.
#[derive(Clone, Debug)]
pub struct TaskController {
    mode: Mode,
    policy: ThresholdPolicy,
    constants: AnalysisConstants,
    failures: u32,
    thresholds: TaskThresholds,
    phase: Phase,
    processed: Position,
    safe: Position,
    in_flight: Option<InFlight>,
    next_seq: u64,
    last_backup: Option<Position>,
    commits: VecDeque<Position>,
    committed: Position,
    outputs: VecDeque<ItemOutputs>,
    unacked_outputs: u64,
    interval_items: u64,
    interval_started_ms: u64,
    /// Approximate mode: the item count at which the next regular commit is due
    /// (⌈l/2⌉ past the highest commit issued).
    next_commit_due: u64,
    /// Exact mode: an interval ended; input waits until every output is
    /// acknowledged and no backup is in flight, then the backup is taken.
    barrier: bool,
}

impl TaskController {
    /// Starts a task at the position a recovery plan gives. A recovery from a failure
    /// first persists its failure count (a marker-only backup) and takes no input
    /// until that is acknowledged, so the halving survives another crash.
    pub fn start(
        config: ControllerConfig,
        plan: &RecoveryPlan,
        now_ms: u64,
        actions: &mut Vec<Action>,
    ) -> Result<Self, CoreError> {
        config.mode.validate()?;
        let start = Position {
            items: 0,
            offset: plan.resume_offset,
        };
        let mut controller = TaskController {
            mode: config.mode,
            policy: config.policy,
            constants: config.constants,
            failures: plan.failures,
            thresholds: config.policy.for_failures(plan.failures),
            phase: Phase::Running,
            processed: start,
            safe: start,
            in_flight: None,
            next_seq: 0,
            last_backup: None,
            commits: VecDeque::new(),
            committed: start,
            outputs: VecDeque::new(),
            unacked_outputs: 0,
            interval_items: 0,
            interval_started_ms: now_ms,
            barrier: false,
            next_commit_due: 0,
        };
        controller.schedule_next_commit();
        if plan.counted_failure && controller.mode != Mode::None {
            controller.phase = Phase::Recovering;
            controller.issue_backup(BackupScope::Complete, false, actions);
        }
        Ok(controller)
    }

    pub fn thresholds(&self) -> TaskThresholds {
        self.thresholds
    }

    /// The θ to give the operator: the task's θ, or infinity in mode none, where no
    /// backup ever moves the baseline and flagging drifted entries would be waste.
    pub fn operator_theta(&self) -> f64 {
        match self.mode {
            Mode::None => f64::INFINITY,
            _ => self.thresholds.theta,
        }
    }

    pub fn failures(&self) -> u32 {
        self.failures
    }

    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Re-derives the thresholds for a number of failures that a window still counts
    /// (see [`crate::core::thresholds::WindowPolicy`]). The caller passes the new θ
    /// to the operator.
    pub fn set_effective_failures(&mut self, failures: u32) -> TaskThresholds {
        self.thresholds = self.policy.for_failures(failures);
        self.schedule_next_commit();
        self.thresholds
    }

    /// Whether the next item may be taken, and if not why.
    pub fn readiness(&self) -> Result<(), Blocked> {
        match self.phase {
            Phase::Recovering => return Err(Blocked::RecoveryMarker),
            Phase::Stopping | Phase::Stopped => return Err(Blocked::Stopping),
            Phase::Running => {}
        }
        if self.barrier {
            return Err(Blocked::Barrier);
        }
        if self.mode == Mode::Approximate {
            if self.unacked_outputs + self.constants.beta > self.thresholds.outputs {
                return Err(Blocked::Outputs);
            }
            if self.processed.items - self.committed.items >= self.thresholds.items {
                return Err(Blocked::Commit);
            }
        }
        Ok(())
    }

    /// An item at `offset` was processed and made `outputs` outputs (now in flight);
    /// `divergence` is the operator's divergence after it.
    #[inline]
    pub fn item_processed(
        &mut self,
        offset: u64,
        outputs: u64,
        divergence: f64,
        now_ms: u64,
        actions: &mut Vec<Action>,
    ) {
        let before = Position {
            items: self.processed.items,
            offset,
        };
        self.processed = Position {
            items: before.items + 1,
            offset: offset + 1,
        };
        if outputs > 0 {
            self.outputs.push_back(ItemOutputs {
                before,
                remaining: outputs,
            });
            self.unacked_outputs += outputs;
        }
        match self.mode {
            Mode::None => {}
            Mode::Approximate => {
                if self.in_flight.is_none() {
                    // Either within θ, or the item that crossed θ, which its own
                    // backup covers: both are safe.
                    self.safe = self.processed;
                    if divergence > self.thresholds.theta {
                        self.issue_backup(BackupScope::Drifted, false, actions);
                    }
                }
                // The common case, kept to one comparison: no commit due yet.
                if self.processed.items >= self.next_commit_due {
                    self.maybe_commit(false, actions);
                }
            }
            Mode::Exact(interval) => {
                self.interval_items += 1;
                self.exact_interval_check(interval, now_ms, actions);
            }
        }
    }

    /// Time passes without items: exact mode may be due for its interval backup.
    pub fn tick(&mut self, now_ms: u64, actions: &mut Vec<Action>) {
        if let Mode::Exact(interval) = self.mode {
            if self.interval_items > 0 {
                self.exact_interval_check(interval, now_ms, actions);
            }
        }
    }

    fn exact_interval_check(&mut self, interval: ExactInterval, now_ms: u64, actions: &mut Vec<Action>) {
        if self.phase != Phase::Running || self.barrier {
            return;
        }
        let by_items = interval.items.is_some_and(|n| self.interval_items >= n);
        let by_time = interval
            .millis
            .is_some_and(|ms| now_ms.saturating_sub(self.interval_started_ms) >= ms);
        if by_items || by_time {
            self.interval_items = 0;
            self.interval_started_ms = now_ms;
            self.barrier = true;
            self.pass_barrier(actions);
        }
    }

    /// Exact mode backs up only where every earlier output is acknowledged (as
    /// Kafka Streams flushes its producer before it commits), so that a recovery can
    /// resume exactly where the backup ends.
    fn pass_barrier(&mut self, actions: &mut Vec<Action>) {
        if self.barrier && self.unacked_outputs == 0 && self.in_flight.is_none() {
            self.barrier = false;
            self.issue_backup(BackupScope::Complete, false, actions);
        }
    }

    fn issue_backup(&mut self, scope: BackupScope, clean: bool, actions: &mut Vec<Action>) {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.in_flight = Some(InFlight {
            seq,
            covers: self.processed,
            clean,
        });
        actions.push(Action::Backup {
            seq,
            scope,
            marker: BackupMarker {
                seq,
                input_offset: self.processed.offset,
                failures: self.failures,
                thresholds: self.thresholds,
                clean,
            },
        });
    }

    /// The first position a commit may not pass because of unacknowledged outputs.
    fn output_frontier(&self) -> Position {
        self.outputs.front().map_or(self.processed, |o| o.before)
    }

    fn highest_commit(&self) -> Position {
        self.commits.back().copied().unwrap_or(self.committed)
    }

    fn issue_commit(&mut self, limit: Position, actions: &mut Vec<Action>) {
        let target = limit.min(self.output_frontier());
        if target.items > self.highest_commit().items {
            self.commits.push_back(target);
            actions.push(Action::Commit { offset: target.offset });
        }
    }

    fn commit_lead(&self) -> u64 {
        self.thresholds.items.div_ceil(2).max(1)
    }

    fn schedule_next_commit(&mut self) {
        self.next_commit_due = self.highest_commit().items + self.commit_lead();
    }

    fn maybe_commit(&mut self, force: bool, actions: &mut Vec<Action>) {
        if self.mode != Mode::Approximate || self.phase != Phase::Running {
            return;
        }
        if force || self.processed.items >= self.next_commit_due {
            self.issue_commit(self.safe, actions);
        }
        self.schedule_next_commit();
    }

    /// Backup `seq` was acknowledged; `divergence` is the operator's divergence after
    /// it moved its baseline.
    pub fn backup_acknowledged(&mut self, seq: u64, divergence: f64, actions: &mut Vec<Action>) {
        let Some(done) = self.in_flight.filter(|f| f.seq == seq) else {
            return;
        };
        self.in_flight = None;
        self.last_backup = Some(done.covers);
        match self.phase {
            Phase::Recovering => {
                self.phase = Phase::Running;
                return;
            }
            Phase::Stopping if done.clean => {
                self.issue_commit(done.covers, actions);
                self.advance_stop(actions);
                return;
            }
            _ => {}
        }
        match self.mode {
            Mode::None => {}
            Mode::Exact(_) => {
                self.issue_commit(done.covers, actions);
                self.pass_barrier(actions);
            }
            Mode::Approximate => {
                if divergence > self.thresholds.theta {
                    // Drifted over θ again while the backup was in flight: only the
                    // backup's own position is known to be within θ.
                    self.safe = done.covers;
                    self.maybe_commit(true, actions);
                    self.issue_backup(BackupScope::Drifted, false, actions);
                } else {
                    self.safe = self.processed;
                    self.maybe_commit(true, actions);
                }
            }
        }
        self.advance_stop(actions);
    }

    /// Backup `seq` did not reach the store. It is issued again at once (the caller
    /// decides how long to back off before carrying it out).
    pub fn backup_failed(&mut self, seq: u64, divergence: f64, actions: &mut Vec<Action>) {
        let Some(failed) = self.in_flight.filter(|f| f.seq == seq) else {
            return;
        };
        self.in_flight = None;
        let again = match (self.phase, self.mode) {
            (Phase::Recovering, _) => Some(BackupScope::Complete),
            (Phase::Stopping, _) if failed.clean => Some(BackupScope::Complete),
            (_, Mode::Exact(_)) => {
                // Back to the barrier: outputs made since must be acknowledged too.
                self.barrier = true;
                None
            }
            (_, Mode::Approximate) if divergence > self.thresholds.theta => Some(BackupScope::Drifted),
            _ => None,
        };
        if let Some(scope) = again {
            self.issue_backup(scope, failed.clean, actions);
        } else if self.mode == Mode::Approximate && self.phase == Phase::Running {
            // The state drifted back within θ while the backup was in flight: the
            // current position is safe again, and nothing else would move it.
            self.safe = self.processed;
            self.maybe_commit(true, actions);
        }
        self.pass_barrier(actions);
        self.advance_stop(actions);
    }

    /// The outputs of the item at `offset` were acknowledged (`count` of them).
    pub fn outputs_acknowledged(&mut self, offset: u64, count: u64, actions: &mut Vec<Action>) {
        let index = self.outputs.partition_point(|o| o.before.offset < offset);
        let Some(item) = self.outputs.get_mut(index).filter(|o| o.before.offset == offset) else {
            return;
        };
        let count = count.min(item.remaining);
        item.remaining -= count;
        self.unacked_outputs -= count;
        while self.outputs.front().is_some_and(|o| o.remaining == 0) {
            self.outputs.pop_front();
        }
        self.pass_barrier(actions);
        self.maybe_commit(false, actions);
        self.advance_stop(actions);
    }

    /// The commit of `offset` was acknowledged.
    pub fn commit_acknowledged(&mut self, offset: u64, actions: &mut Vec<Action>) {
        while let Some(&front) = self.commits.front() {
            if front.offset > offset {
                break;
            }
            self.commits.pop_front();
            if front.items > self.committed.items {
                self.committed = front;
            }
        }
        if self.phase == Phase::Stopping && self.in_flight.is_none() && self.committed == self.processed {
            self.phase = Phase::Stopped;
        }
        self.maybe_commit(false, actions);
    }

    /// The commit of `offset` failed; a later one will cover it.
    pub fn commit_failed(&mut self, offset: u64, actions: &mut Vec<Action>) {
        self.commits.retain(|c| c.offset != offset);
        self.maybe_commit(false, actions);
        self.advance_stop(actions);
    }

    /// Starts a clean stop (shutdown or partition revocation): no more input; once
    /// every output is acknowledged, a complete backup and then a commit of the
    /// position it covers. A clean stop is no failure.
    pub fn begin_stop(&mut self, actions: &mut Vec<Action>) {
        if matches!(self.phase, Phase::Stopping | Phase::Stopped) {
            return;
        }
        self.phase = Phase::Stopping;
        self.advance_stop(actions);
    }

    fn advance_stop(&mut self, actions: &mut Vec<Action>) {
        if self.phase != Phase::Stopping || self.unacked_outputs > 0 || self.in_flight.is_some() {
            return;
        }
        let final_backup_done = self.last_backup == Some(self.processed) && self.committed_or_pending(self.processed);
        if self.mode == Mode::None || final_backup_done {
            self.issue_commit(self.processed, actions);
            if self.committed == self.processed {
                self.phase = Phase::Stopped;
            }
            return;
        }
        self.issue_backup(BackupScope::Complete, true, actions);
    }

    fn committed_or_pending(&self, position: Position) -> bool {
        self.committed == position || self.commits.contains(&position)
    }

    /// Whether a clean stop has finished: final backup and commit acknowledged.
    pub fn is_stopped(&self) -> bool {
        self.phase == Phase::Stopped
    }

    /// The position after the last processed item.
    pub fn processed(&self) -> Position {
        self.processed
    }

    /// The position the last acknowledged backup covers.
    pub fn last_backup(&self) -> Option<Position> {
        self.last_backup
    }

    /// The last acknowledged commit.
    pub fn committed(&self) -> Position {
        self.committed
    }

    /// Items processed and not covered by an acknowledged commit.
    pub fn uncommitted_items(&self) -> u64 {
        self.processed.items - self.committed.items
    }

    pub fn unacknowledged_outputs(&self) -> u64 {
        self.unacked_outputs
    }

    pub fn backup_in_flight(&self) -> bool {
        self.in_flight.is_some()
    }

    /// The worst-case error a crash now could introduce, from the thresholds:
    /// θ + l·α for the state and γ + l·β for the outputs (zero state error in exact
    /// mode, no bound at all in mode none).
    pub fn recovery_bound(&self) -> Option<ErrorBound> {
        match self.mode {
            Mode::None => None,
            Mode::Approximate => Some(self.thresholds.failure_bound(self.constants)),
            Mode::Exact(_) => Some(ErrorBound {
                state: 0.0,
                outputs: f64::INFINITY,
            }),
        }
    }

    /// A tighter figure for a crash right now: the divergence plus α for every
    /// item a replay would repeat or lose.
    pub fn exposure(&self, divergence: f64) -> f64 {
        divergence + self.uncommitted_items() as f64 * self.constants.alpha
    }
}
