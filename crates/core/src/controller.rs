//! The decision logic of one task, driven by events and free of I/O.
//!
//! The controller decides when to back up, when a backup's marker may be
//! written, and when input must wait. The recovery point is the last marker in
//! the task's changelog partition, and the state a recovery restores is the one
//! logged *at* that marker (see [`crate::recovery`] and [`crate::logged`]); the
//! consumer group's committed offset follows acknowledged markers and is
//! bookkeeping. Its rules, and why they keep a failure's error within θ (state)
//! and the outputs of the items it replays (outputs):
//!
//! * **Backups.** After an item, a backup is issued when the divergence from the
//!   last backup *issued* exceeds θ (it writes the largest drifts, until θ/2
//!   is left), and at the end of a run of input (the items a poll gave) once
//!   ⌈l/2⌉ items have passed since the last backup was issued. A backup for l
//!   while the divergence is within θ writes only what failed writes owe
//!   (`BackupScope::Owed`): its marker moves the recovery point over a logged
//!   state that is within θ of the live one, which is all the bound needs, so
//!   l costs a marker, not the drift.
//!   **Several backups may be in flight** (up to `max_backups_in_flight`; a
//!   trigger beyond them waits for one to close, and the backup then covers
//!   more items, while input goes on). The
//!   adapter writes the changelog in order and without gaps, so a marker in the
//!   log has every backup issued before it there, and the state it logs is the
//!   one the divergence was measured from when it was issued: within θ of the
//!   live state at its offset. A backup is taken when issued, but its entries
//!   go out only once every output of the items it covers is acknowledged, and
//!   in the order the backups were taken.
//! * **Markers.** A backup's marker (input offset P, the backup's sequence, k,
//!   thresholds) goes out right behind the backup's entries, once every output
//!   of the items before P is acknowledged: a marker never covers a lost output.
//!   The recovery point moves only once both the marker and the entries before
//!   it are acknowledged; a marker behind entries that failed never counts (the
//!   backup is issued again and its marker covers the same items).
//! * **No window.** Input never waits for a marker's acknowledgement: entries
//!   after the last marker in the log are restored as their priors, so a replay
//!   from the marker is exact and the state bound does not depend on how many
//!   items are past the marker. L sets how often markers go out, so how many
//!   items a recovery replays (about l/2 past the last marker issued, plus those
//!   whose markers were in flight at the crash: at most what a round trip lets
//!   through) and how many outputs it repeats (β per replayed item).
//! * **Failed writes.** A backup whose write failed may still have reached the
//!   log, or not. Its entries are owed again (the structures re-send them
//!   whatever their drift), and so are those of every backup taken but not sent
//!   yet (abandoned: they were measured from the failed one). Once every write
//!   in flight is reported (the gapless log fails them all), a new backup is
//!   issued; its marker is the first to count after the failure. Nothing is
//!   sent meanwhile, so no marker can land over a log that lacks what the
//!   failed backups owe. A failed marker is not re-sent: it is handled like a
//!   failed backup, and the new backup's marker covers the same items.
//! * **Outputs.** Input waits while one more item could leave more than γ
//!   outputs unacknowledged (each item makes at most β).
//! * **Starts.** Every start writes a marker (the failure count k of a recovery,
//!   and a non-clean marker over a clean one) before it takes input, so a crash
//!   before the first backup is counted and k survives it. A recovery that
//!   restored priors first writes them again (`Action::SendRollback`, covered by
//!   the start marker), so the crashed run's uncovered entries stop being the
//!   latest of their keys. Sequences continue above every one the log holds.
//! * **Exact mode** takes a complete backup every interval; its marker waits for
//!   the outputs before it, so the state at a marker is exact and outputs are at
//!   least once.
//! * **Mode none** backs up nothing; its offset is committed at a clean stop.
//! * **Clean stop**: no more input; once every output is acknowledged, a complete
//!   backup and a clean marker, then a commit. A clean stop is no failure.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

use super::error::CoreError;
pub use super::mode::{ExactInterval, Mode};
use super::operator::{AnalysisConstants, BackupScope};
use super::recovery::{BackupMarker, RecentFailures, RecoveryPlan};
use super::sources::SourcePositions;
use super::structures::Norm;
use super::thresholds::{ErrorBound, FailurePolicy, GlobalThresholds, Placement, TaskThresholds, ThresholdPolicy};

mod acknowledgements;
mod backups;

/// A position in a task's input: the next offset to read, and how many items the
/// task has processed in this run to get there (offsets need not be contiguous).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Position {
    pub items: u64,
    pub offset: u64,
}

/// What the task must do next.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// Take backup `seq` of the operator with this scope now, and hold its
    /// entries until [`Action::SendBackup`].
    Backup { seq: u64, scope: BackupScope },
    /// Write backup `seq`'s entries to the changelog; report whether the write was
    /// acknowledged. Comes once every output of the items the backup covers is
    /// acknowledged, so the state a marker logs never holds the effect of an
    /// output that could still be lost (a heavy hitter marked reported whose
    /// report never reached the broker would never be reported).
    SendBackup { seq: u64 },
    /// Write the keys a recovery restored from priors, at the values restored,
    /// as backup `seq` (before the start marker, which covers it).
    SendRollback { seq: u64 },
    /// Backup `seq` was taken but will never go out (a write before it failed,
    /// and it was measured from that write): its entries are owed again
    /// ([`crate::Operator::fail_backup`]).
    AbandonBackup { seq: u64 },
    /// Write this marker to the changelog after every record written before it;
    /// report whether it was acknowledged.
    Marker(Box<BackupMarker>),
    /// Bookkeeping: commit this input offset to the consumer group so tools show
    /// lag. Nothing waits for it.
    Commit { offset: u64 },
    /// The thresholds changed (a failure stopped counting): give the operator
    /// the new θ ([`TaskController::operator_theta`]).
    Thresholds(TaskThresholds),
}

/// Why the task may not take its next item.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Blocked {
    /// γ outputs could be unacknowledged.
    Outputs,
    /// The start marker (the failure count of a recovery) is not acknowledged yet.
    StartMarker,
    /// The task is stopping or stopped.
    Stopping,
    /// The local store must be written first
    /// ([`crate::driver::TaskDriver::write_store_every`]).
    StoreWrite,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// The start marker is in flight.
    Starting,
    Running,
    /// No more input; the final backup and marker follow the outputs.
    Stopping,
    Stopped,
}

/// A backup issued whose entries are not acknowledged yet.
#[derive(Clone, Copy, Debug)]
struct OpenBackup {
    seq: u64,
    covers: Position,
    scope: BackupScope,
    /// Its entries and its marker went out (the outputs before it were
    /// acknowledged).
    sent: bool,
    clean: bool,
}

#[derive(Clone, Copy, Debug)]
struct MarkerInFlight {
    seq: u64,
    covers: Position,
    clean: bool,
    /// The backup whose entries went out right before it and are not
    /// acknowledged yet: the marker counts only once they are.
    entries_of: Option<u64>,
    /// Acknowledged while its entries were not.
    acknowledged: bool,
}

#[derive(Clone, Copy, Debug)]
struct ItemOutputs {
    /// The position just before the item: a marker may cover up to here.
    before: Position,
    remaining: u64,
}

/// Test-only faults that make the controller break its guarantees, so that the
/// property tests can show they catch a controller that does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ControllerFaults {
    /// Keep the thresholds of failure 0 after every recovery.
    pub never_halve: bool,
    /// Write markers without waiting for the outputs before them.
    pub marker_before_outputs: bool,
}

/// Configuration of one task's controller.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ControllerConfig {
    pub mode: Mode,
    pub policy: ThresholdPolicy,
    pub constants: AnalysisConstants,
    /// Stamped on every marker: the identity of the task's local store (0: none).
    pub writer: u64,
    /// Backups in flight at most (see [`DEFAULT_MAX_BACKUPS_IN_FLIGHT`]).
    pub max_backups_in_flight: usize,
    faults: ControllerFaults,
}

impl ControllerConfig {
    pub fn new(mode: Mode, policy: ThresholdPolicy, constants: AnalysisConstants) -> Self {
        ControllerConfig {
            mode,
            policy,
            constants,
            writer: 0,
            max_backups_in_flight: DEFAULT_MAX_BACKUPS_IN_FLIGHT,
            faults: ControllerFaults::default(),
        }
    }

    /// Markers will name `writer` (a local store's identity) as their author.
    pub fn with_writer(self, writer: u64) -> Self {
        ControllerConfig { writer, ..self }
    }

    /// At most this many backups in flight (0 counts as 1; one is how the
    /// controller worked before backups were pipelined, kept for comparison).
    pub fn with_max_backups_in_flight(self, backups: usize) -> Self {
        ControllerConfig {
            max_backups_in_flight: backups,
            ..self
        }
    }

    /// Turns on test-only faults.
    #[cfg(feature = "fault-injection")]
    pub fn with_faults(self, faults: ControllerFaults) -> Self {
        ControllerConfig { faults, ..self }
    }

    /// The configuration of a lone task (one partition, one stage) of an operator
    /// with these constants, under the halving policy.
    pub fn single_task(
        mode: Mode,
        global: GlobalThresholds,
        constants: AnalysisConstants,
        norm: Norm,
    ) -> Result<Self, CoreError> {
        let policy = ThresholdPolicy::new(global, FailurePolicy::Halving, Placement::default(), norm, constants)?;
        Ok(ControllerConfig::new(mode, policy, constants))
    }
}

/// The decision logic of one task.
#[derive(Clone, Debug)]
pub struct TaskController {
    mode: Mode,
    policy: ThresholdPolicy,
    constants: AnalysisConstants,
    writer: u64,
    faults: ControllerFaults,
    max_open: usize,
    failures: u32,
    /// Where the latest failures resumed; the recovering policy counts those
    /// within its window.
    recent: RecentFailures,
    /// The input offset at which the oldest counted failure stops counting.
    next_expiry: u64,
    thresholds: TaskThresholds,
    phase: Phase,
    processed: Position,
    /// The position of the last backup issued.
    last_issued: Position,
    /// Backups issued whose entries are not acknowledged yet, in issue order.
    open: VecDeque<OpenBackup>,
    /// What the oldest open backup not yet sent covers: every output
    /// acknowledged asks whether it can go, and this answers without a
    /// search of `open`.
    first_unsent: Option<Position>,
    /// A write failed: no backup is issued until every write in flight is
    /// reported, then one (the widest `deferred` scope) is.
    after_failure: bool,
    markers: VecDeque<MarkerInFlight>,
    /// The position the last acknowledged marker covers.
    marked: Position,
    next_seq: u64,
    /// What this incarnation's markers say it inherited ([`crate::fence`]).
    inherited: u64,
    outputs: VecDeque<ItemOutputs>,
    unacked_outputs: u64,
    /// Items between two backups issued for l.
    lead: u64,
    /// The last backup whose entries a marker sent covers.
    covers_backup: u64,
    /// The keys a recovery restored from priors are written before the start
    /// marker (until it is acknowledged).
    rollback: bool,
    /// A backup for l is due at the end of the run of input (or, after a
    /// failure, once the writes in flight are reported): the widest scope asked
    /// for meanwhile.
    deferred: Option<BackupScope>,
    interval_items: u64,
    interval_started_ms: u64,
    stalls: u64,
    stalls_for_outputs: u64,
}

/// Backups issued for l per l items: a crash replays up to l/2 items past the
/// last marker issued, plus those of markers in flight.
const BACKUPS_PER_L: u64 = 2;

/// Backups in flight at most, unless configured otherwise. A trigger beyond them
/// waits for one to close and the backup then covers more items (input goes
/// on): where θ or l is tiny (after many failures) the changelog is an
/// every-change changelog coalesced over a quarter of a round trip, never a
/// backup per item.
pub const DEFAULT_MAX_BACKUPS_IN_FLIGHT: usize = 4;

/// The scope that writes at least what either writes.
fn widest(a: BackupScope, b: BackupScope) -> BackupScope {
    use BackupScope::{Complete, Drifted, Owed};
    match (a, b) {
        (Complete, _) | (_, Complete) => Complete,
        (Drifted, _) | (_, Drifted) => Drifted,
        (Owed, Owed) => Owed,
    }
}

impl TaskController {
    /// Starts a task at the position a recovery plan gives. Every start except in
    /// mode none first writes a marker and takes no input until it is
    /// acknowledged: a recovery's failure count survives another crash, and a
    /// crash before the first backup of a run that started from a clean stop is
    /// still counted. With `rollback`, the keys the recovery restored from
    /// priors go out first ([`Action::SendRollback`]).
    pub fn start(
        config: ControllerConfig,
        plan: &RecoveryPlan,
        rollback: bool,
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
            writer: config.writer,
            faults: config.faults,
            max_open: config.max_backups_in_flight.max(1),
            failures: plan.failures,
            recent: plan.recent,
            next_expiry: u64::MAX,
            thresholds: TaskThresholds {
                theta: 0.0,
                max_uncovered: 1,
                max_unacked: 1,
            },
            phase: Phase::Running,
            processed: start,
            last_issued: start,
            open: VecDeque::new(),
            first_unsent: None,
            after_failure: false,
            markers: VecDeque::new(),
            marked: start,
            next_seq: plan.next_seq.max(1),
            outputs: VecDeque::new(),
            unacked_outputs: 0,
            lead: 1,
            covers_backup: plan.covers,
            inherited: plan.inherited(),
            rollback,
            deferred: None,
            interval_items: 0,
            interval_started_ms: now_ms,
            stalls: 0,
            stalls_for_outputs: 0,
        };
        controller.count_failures();
        if controller.mode != Mode::None {
            controller.phase = Phase::Starting;
            controller.send_start(actions);
        }
        Ok(controller)
    }

    /// The start marker, behind the keys a recovery rolled back if any.
    fn send_start(&mut self, actions: &mut Vec<Action>) {
        let start = self.processed;
        if !self.rollback {
            self.send_marker(start, false, None, actions);
            return;
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        self.open.push_back(OpenBackup {
            seq,
            covers: start,
            scope: BackupScope::Complete,
            sent: true,
            clean: false,
        });
        actions.push(Action::SendRollback { seq });
        self.send_marker(start, false, Some(seq), actions);
    }

    /// Forgets the failures that stopped counting (recovering policy) and derives
    /// the thresholds from those that count.
    fn count_failures(&mut self) {
        let policy = self.policy.failures;
        let now = self.processed.offset;
        self.recent.retain_counted(policy, now);
        let counted = policy.counted(self.recent.as_slice(), self.failures, now);
        self.next_expiry = match policy {
            FailurePolicy::Recovering { window_items } => self
                .recent
                .as_slice()
                .first()
                .map_or(u64::MAX, |&at| at.saturating_add(window_items)),
            _ => u64::MAX,
        };
        self.set_failures_counted(counted);
    }

    /// Derives θ, l, γ and the backup lead for a failure count.
    fn set_failures_counted(&mut self, failures: u32) {
        let counted = if self.faults.never_halve { 0 } else { failures };
        let halved = self.policy.for_failures(counted);
        self.thresholds = match self.mode {
            Mode::Exact(interval) => {
                // Exact backups are complete (θ = 0); l is two intervals of items
                // (what a replay may cover).
                // crash during a backup may apply twice.
                let max_uncovered = interval.items.map_or(u64::MAX, |n| n.saturating_mul(2));
                TaskThresholds {
                    theta: 0.0,
                    max_uncovered,
                    max_unacked: halved.max_unacked,
                }
            }
            _ => halved,
        };
        self.lead = self.thresholds.max_uncovered.div_ceil(BACKUPS_PER_L).max(1);
    }

    pub fn thresholds(&self) -> TaskThresholds {
        self.thresholds
    }

    /// The θ to give the operator: the task's θ, or infinity where no backup is
    /// ever partial (mode none backs up nothing, exact mode backs up completely)
    /// and flagging drifted entries would be waste.
    pub fn operator_theta(&self) -> f64 {
        match self.mode {
            Mode::Approximate => self.thresholds.theta,
            _ => f64::INFINITY,
        }
    }

    pub fn failures(&self) -> u32 {
        self.failures
    }

    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Re-derives the thresholds for a number of failures that a window still counts
    /// (see [`crate::thresholds::WindowPolicy`]). The caller passes the new θ to the
    /// operator.
    pub fn set_effective_failures(&mut self, failures: u32) -> TaskThresholds {
        self.set_failures_counted(failures);
        self.thresholds
    }

    /// Whether the next item may be taken, and if not why.
    #[inline]
    pub fn readiness(&self) -> Result<(), Blocked> {
        match self.phase {
            Phase::Starting => return Err(Blocked::StartMarker),
            Phase::Stopping | Phase::Stopped => return Err(Blocked::Stopping),
            Phase::Running => {}
        }
        if self.mode == Mode::None {
            return Ok(());
        }
        if self.unacked_outputs + self.constants.beta > self.thresholds.max_unacked {
            return Err(Blocked::Outputs);
        }
        Ok(())
    }

    /// The task had input but had to wait, for this reason: counted for the
    /// stall figures.
    pub fn count_stall(&mut self, reason: Blocked) {
        self.stalls += 1;
        if reason == Blocked::Outputs {
            self.stalls_for_outputs += 1;
        }
    }

    /// How often input waited because γ outputs could be unacknowledged.
    pub fn stalls_for_outputs(&self) -> u64 {
        self.stalls_for_outputs
    }

    /// How often input waited for an acknowledgement.
    pub fn stalls(&self) -> u64 {
        self.stalls
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
        if self.processed.offset >= self.next_expiry {
            self.count_failures();
            actions.push(Action::Thresholds(self.thresholds));
        }
        match self.mode {
            Mode::None => {}
            Mode::Approximate => {
                // The common case, kept to two comparisons: nothing due.
                if divergence > self.thresholds.theta {
                    // A drifted backup waiting already goes out as soon as
                    // there is room (see `advance`): nothing more to ask for.
                    if self.deferred != Some(BackupScope::Drifted) {
                        self.trigger(BackupScope::Drifted, actions);
                    }
                } else if self.deferred.is_none() && self.processed.items - self.last_issued.items >= self.lead {
                    // Within θ only the marker must move: the drift stays
                    // unwritten (see `BackupScope::Owed`). Issued when the run
                    // of input ends, so it covers the whole run (see
                    // `run_ended`). Any backup deferred already writes at
                    // least that much.
                    self.deferred = Some(BackupScope::Owed);
                }
            }
            Mode::Exact(interval) => {
                self.interval_items += 1;
                self.exact_interval_check(interval, now_ms, actions);
            }
        }
    }

    /// The state changed outside the input (a side input): a backup is due at once
    /// if the divergence passed θ. No item was read, so l and the outputs are
    /// untouched.
    pub fn state_changed(&mut self, divergence: f64, actions: &mut Vec<Action>) {
        if self.mode == Mode::Approximate && divergence > self.thresholds.theta {
            self.trigger(BackupScope::Drifted, actions);
        }
    }

    /// The task took the items it had (or input must wait): a backup due for l
    /// goes out now, covering every item of the run. Issued item by item, the
    /// first would cover a quarter of a run that fills the window, and the rest
    /// would wait for its round trips.
    pub fn run_ended(&mut self, actions: &mut Vec<Action>) {
        if self.phase != Phase::Running || self.after_failure || self.open.len() >= self.max_open {
            return;
        }
        // An owed-only scope is still enough: had the divergence passed θ since,
        // its trigger would have widened it.
        if let Some(scope) = self.deferred {
            self.issue_backup(scope, false, actions);
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
        let by_items = interval.items.is_some_and(|n| self.interval_items >= n);
        let by_time = interval
            .millis
            .is_some_and(|ms| now_ms.saturating_sub(self.interval_started_ms) >= ms);
        if by_items || by_time {
            self.interval_items = 0;
            self.interval_started_ms = now_ms;
            self.trigger(BackupScope::Complete, actions);
        }
    }

    /// Starts a clean stop (shutdown or partition revocation): no more input; once
    /// every output is acknowledged, a complete backup and a clean marker. A clean
    /// stop is no failure.
    pub fn begin_stop(&mut self, actions: &mut Vec<Action>) {
        if matches!(self.phase, Phase::Stopping | Phase::Stopped) {
            return;
        }
        self.phase = Phase::Stopping;
        self.deferred = None;
        self.advance_stop(actions);
    }

    fn advance_stop(&mut self, actions: &mut Vec<Action>) {
        if self.phase != Phase::Stopping || !self.open.is_empty() || self.unacked_outputs > 0 {
            return;
        }
        if self.mode == Mode::None {
            actions.push(Action::Commit {
                offset: self.processed.offset,
            });
            self.phase = Phase::Stopped;
            return;
        }
        if self.markers.iter().any(|m| m.clean) {
            return;
        }
        self.issue_backup(BackupScope::Complete, true, actions);
    }

    /// Whether a clean stop has finished: final backup and marker acknowledged.
    /// Whether the start marker is not acknowledged yet.
    pub fn is_starting(&self) -> bool {
        self.phase == Phase::Starting
    }

    pub fn is_stopped(&self) -> bool {
        self.phase == Phase::Stopped
    }

    /// The position after the last processed item.
    pub fn processed(&self) -> Position {
        self.processed
    }

    /// Above every backup and marker sequence handed out so far.
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// The position the last acknowledged marker covers: the recovery point.
    pub fn marked(&self) -> Position {
        self.marked
    }

    /// Items processed past the last acknowledged marker.
    pub fn items_past_marker(&self) -> u64 {
        self.processed.items - self.marked.items
    }

    pub fn unacknowledged_outputs(&self) -> u64 {
        self.unacked_outputs
    }

    /// Whether a backup's entries may be on their way to the log.
    pub fn backup_open(&self) -> bool {
        !self.open.is_empty()
    }

    /// The worst-case error a crash now could introduce, from the thresholds:
    /// θ for the state and l·β repeated outputs (see [`crate::thresholds`]; no
    /// bound in mode none).
    pub fn recovery_bound(&self) -> Option<ErrorBound> {
        match self.mode {
            Mode::None => None,
            _ => Some(self.thresholds.failure_bound(self.constants)),
        }
    }
}
