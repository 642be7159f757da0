//! The task loop, written once: an operator, its controller, and an I/O boundary
//! that carries out what they decide.
//!
//! The in-memory harness, the benchmarks and the Kafka service are adapters of
//! this driver: each implements [`TaskIo`] (send an output, write a backup,
//! write a marker, commit) and reports acknowledgements back as [`Ack`]s. The
//! driver works a poll batch at a time: it takes items until the controller says
//! input must wait, then the adapter delivers whatever acknowledgements arrived
//! and calls it again. So the property tests prove the code the service runs.

use std::collections::VecDeque;

use serde::Serialize;

use super::batch::BackupBatch;
use super::controller::{Action, Blocked, ControllerConfig, TaskController};
use super::entry::BackupEntry;
use super::error::CoreError;
use super::operator::{BackupScope, Operator, ProcessError, Rejected};
use super::prior_chain::PriorChain;
use super::recovery::{BackupMarker, ChangelogState, RecoveryPlan, ResumeSource, StoreCheckpoint};
use super::sources::{SourcePosition, SourcePositions};

/// What the driver needs from its surroundings. Every write is asynchronous: its
/// outcome comes back later through [`TaskDriver::acknowledge`].
pub trait TaskIo<Output> {
    /// Sends one output of the item at `item_offset`; report [`Ack::Output`].
    fn send_output(&mut self, item_offset: u64, output: Output);
    /// Writes backup `seq`'s records (its entries as the changelog logs them,
    /// [`crate::logged`]) to the changelog partition, in order, after every
    /// record written before; report [`Ack::BackupWritten`] or
    /// [`Ack::BackupFailed`] once all of them are acknowledged or one failed.
    fn write_backup(&mut self, seq: u64, records: &BackupBatch);
    /// Writes a marker after every changelog record written before it; report
    /// [`Ack::MarkerWritten`] or [`Ack::MarkerFailed`]. The changelog must be
    /// gapless: a record lands only if every record written before it landed
    /// (a marker comes right behind its backup's entries, without waiting for
    /// their acknowledgement, and recovery trusts the last marker in the log).
    fn write_marker(&mut self, marker: &BackupMarker);
    /// Bookkeeping: the consumer group's offset may move to `offset`. Nothing
    /// waits for it.
    fn commit(&mut self, offset: u64);
    /// The record at `offset` was refused: it did not decode, or the operator
    /// rejected it. It still counts as read. Returns how many records the adapter
    /// sent for it (a dead letter, say); they are acknowledged like outputs
    /// ([`Ack::Output`] of `offset`), so no marker passes the refused record
    /// before they are durable, and a replay sends them again.
    fn rejected(&mut self, offset: u64, reason: &Rejected) -> u64 {
        let _ = (offset, reason);
        0
    }
}

/// An acknowledgement an adapter reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ack {
    /// `count` outputs of the item at `item_offset` were acknowledged.
    Output {
        item_offset: u64,
        count: u64,
    },
    BackupWritten(u64),
    /// Some of the backup's entries may be in the log all the same.
    BackupFailed(u64),
    MarkerWritten(u64),
    /// The marker may be in the log all the same.
    MarkerFailed(u64),
}

/// What a driver did, for reports and metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct DriverStats {
    pub items: u64,
    /// Records refused: undecodable, or rejected by the operator.
    pub rejected: u64,
    pub outputs: u64,
    /// Records the adapter sent for refused ones (held like outputs).
    pub dead_letters: u64,
    pub backups: u64,
    pub backup_entries: u64,
    pub backup_bytes: u64,
    pub backups_failed: u64,
    pub markers: u64,
    pub markers_failed: u64,
    pub commits: u64,
    /// Batches in which input had to wait for an acknowledgement.
    pub stalls: u64,
    /// Of those, the batches in which it waited for outputs (γ).
    pub stalls_for_outputs: u64,
    /// Batches in which the operator was not ready for input (it waited for a
    /// side input).
    pub operator_waits: u64,
    /// Items skipped because their source position was applied already: an
    /// upstream replay's outputs ([`crate::sources`]).
    pub repeats: u64,
}

/// One input item as the driver takes it: its offset, where it came from if an
/// upstream task said so ([`crate::sources`]), and the item.
#[derive(Debug)]
pub struct Item<'a, T> {
    pub offset: u64,
    pub source: Option<SourcePosition>,
    pub input: &'a T,
}

impl<'a, T> From<(u64, &'a T)> for Item<'a, T> {
    fn from((offset, input): (u64, &'a T)) -> Self {
        Item {
            offset,
            source: None,
            input,
        }
    }
}

/// Marker `seq` is reported: the last backup it covers.
fn marker_done(markers: &mut VecDeque<(u64, u64)>, seq: u64) -> Option<u64> {
    let index = markers.iter().position(|(s, _)| *s == seq)?;
    markers.remove(index).map(|(_, covers)| covers)
}

/// Test-only faults: a driver that breaks its guarantees, so that the property
/// tests can show they catch one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DriverFaults {
    /// Take backups but write none of their entries, and report them written.
    pub skip_backups: bool,
}

/// One task: an operator, its controller and the scratch buffers of the loop.
pub struct TaskDriver<O: Operator> {
    operator: O,
    controller: TaskController,
    actions: Vec<Action>,
    /// The records of each backup taken and not sent yet, oldest first, held
    /// from its snapshot until they may go out.
    held: VecDeque<BackupBatch>,
    /// The priors of keys whose last writes may be missing from the log; it
    /// keeps the backups sent until a marker covers them.
    priors: PriorChain,
    /// The keys a recovery restored from priors, written before the start
    /// marker (kept until it is acknowledged, in case they must go again).
    rollback: Vec<BackupEntry>,
    /// Restarted on a local store: the keys it reloaded drifted are owed to
    /// the changelog before the start marker (until it is acknowledged).
    owes_store_drift: bool,
    /// Markers in flight and the last backup each covers.
    markers: VecDeque<(u64, u64)>,
    /// Whether the backups taken, sent or settled changed since the last
    /// [`Self::checkpoint`] (its crash view is then out of date).
    priors_changed: bool,
    /// The newest source positions applied ([`crate::sources`]).
    sources: SourcePositions,
    /// The table as each backup not yet behind a marker was taken, by
    /// backup sequence: its marker carries it.
    sources_at_backup: VecDeque<(u64, SourcePositions)>,
    outputs: Vec<O::Output>,
    /// With a local store: the most items taken past its last write
    /// ([`Self::write_store_every`]), and how many are now.
    max_unwritten_items: Option<u64>,
    unwritten_items: u64,
    stats: DriverStats,
    faults: DriverFaults,
}

impl<O: Operator> TaskDriver<O> {
    /// Starts a task: restores the operator (freshly built) from what its
    /// changelog holds, decides where to resume and starts the controller, whose
    /// first actions (the start marker) go out through `io`.
    pub fn recover(
        config: ControllerConfig,
        mut operator: O,
        changelog: &ChangelogState,
        committed: Option<u64>,
        start_offset: u64,
        now_ms: u64,
        io: &mut impl TaskIo<O::Output>,
    ) -> Result<(Self, RecoveryPlan), CoreError> {
        operator.restore(&changelog.entries)?;
        let plan = RecoveryPlan::decide(
            config.mode,
            changelog.marker.as_ref(),
            committed,
            start_offset,
            config.constants,
        )
        .continuing(&changelog.restart);
        let rollback = changelog.restart.rolled_back.clone();
        let driver = Self::start(config, operator, &plan, rollback, now_ms, io)?;
        Ok((driver, plan))
    }

    /// Starts a task whose operator already holds its state (restored from the
    /// changelog, or reopened on its local store), at the position `plan` gives;
    /// `rollback` holds the keys the restore took from priors
    /// ([`crate::recovery::Restart::rolled_back`]), written before the start
    /// marker.
    pub fn start(
        config: ControllerConfig,
        mut operator: O,
        plan: &RecoveryPlan,
        rollback: Vec<BackupEntry>,
        now_ms: u64,
        io: &mut impl TaskIo<O::Output>,
    ) -> Result<Self, CoreError> {
        let mut actions = Vec::new();
        let backs_up = config.mode != crate::mode::Mode::None;
        let rollback = if backs_up { rollback } else { Vec::new() };
        // The start marker moves the recovery point to the store's offset, so
        // the changelog must first hold the state there within θ: the keys the
        // store says drifted (those a crashed backup may not have written
        // included) go out ahead of it. Otherwise a loss of the store before
        // the next backup restores an older state at the store's offset.
        let owes_store_drift = backs_up && plan.source == ResumeSource::LocalStore;
        let write_first = !rollback.is_empty() || owes_store_drift;
        let controller = TaskController::start(config, plan, write_first, now_ms, &mut actions)?;
        operator.set_theta(controller.operator_theta());
        let mut driver = TaskDriver {
            operator,
            controller,
            actions,
            held: VecDeque::new(),
            // A restart on a local store writes on the changelog its crashed
            // run wrote: with what that crash left uncertain.
            priors: if plan.source == ResumeSource::LocalStore {
                PriorChain::resumed(plan.priors.clone())
            } else {
                PriorChain::new()
            },
            priors_changed: true,
            rollback,
            owes_store_drift,
            markers: VecDeque::new(),
            sources: plan.sources.clone(),
            sources_at_backup: VecDeque::new(),
            outputs: Vec::new(),
            max_unwritten_items: None,
            unwritten_items: 0,
            stats: DriverStats::default(),
            faults: DriverFaults::default(),
        };
        driver.execute(io);
        Ok(driver)
    }

    /// Turns on test-only faults.
    #[cfg(feature = "fault-injection")]
    pub fn inject_faults(&mut self, faults: DriverFaults) {
        self.faults = faults;
    }

    pub fn operator(&self) -> &O {
        &self.operator
    }

    pub fn controller(&self) -> &TaskController {
        &self.controller
    }

    /// The newest source positions the state includes, at
    /// `controller().processed()`.
    pub fn sources(&self) -> &SourcePositions {
        &self.sources
    }

    /// What a local store keeps with the state it writes now
    /// ([`StoreCheckpoint`]): call after [`Self::stage_state`], before the
    /// changelog records handed out so far are sent.
    pub fn checkpoint(&mut self, checkpoint: &mut StoreCheckpoint) {
        self.unwritten_items = 0;
        checkpoint.next_offset = self.controller.processed().offset;
        checkpoint.next_seq = self.controller.next_seq();
        if checkpoint.sources != self.sources {
            checkpoint.sources.clone_from(&self.sources);
        }
        if self.priors_changed {
            checkpoint.priors = self.priors.crash_view(self.held.iter());
            self.priors_changed = false;
        }
    }

    /// A task on a local store takes at most `max_unwritten_items` items past
    /// the store's last write ([`Self::checkpoint`]), then waits for the next
    /// write ([`Blocked::StoreWrite`]). A restart on the store replays those
    /// items and may repeat their outputs, so this is what bounds the repeats
    /// ([`crate::recovery::StoreWrites`]), even while the adapter holds its
    /// writes back (a delivery's backoff, say).
    pub fn write_store_every(&mut self, max_unwritten_items: u64) {
        self.max_unwritten_items = Some(max_unwritten_items.max(1));
    }

    /// Stages the operator's state changes for its local store; the adapter
    /// writes them, with the offset `controller().processed()` gives, before it
    /// sends any changelog record the driver handed it so far.
    pub fn stage_state(&mut self) {
        self.operator.stage_state();
    }

    /// The adapter's store write succeeded.
    pub fn state_durable(&mut self) {
        self.operator.state_durable();
    }

    pub fn into_operator(self) -> O {
        self.operator
    }

    pub fn stats(&self) -> DriverStats {
        DriverStats {
            stalls: self.controller.stalls(),
            stalls_for_outputs: self.controller.stalls_for_outputs(),
            ..self.stats
        }
    }

    /// A record at `offset` that never became an item (it does not decode): it
    /// is read like one and goes where rejected items go ([`TaskIo::rejected`]).
    /// Returns false, taking nothing, when input must wait.
    pub fn refuse(&mut self, offset: u64, reason: &Rejected, now_ms: u64, io: &mut impl TaskIo<O::Output>) -> bool {
        if let Err(reason) = self.readiness() {
            self.controller.count_stall(reason);
            return false;
        }
        self.unwritten_items += 1;
        let sent = self.reject(offset, reason, io);
        self.item_done(offset, sent, now_ms, io);
        self.end_run(io);
        true
    }

    fn reject(&mut self, offset: u64, reason: &Rejected, io: &mut impl TaskIo<O::Output>) -> u64 {
        self.stats.rejected += 1;
        let sent = io.rejected(offset, reason);
        self.stats.dead_letters += sent;
        sent
    }

    /// Whether the next item may be taken.
    pub fn readiness(&self) -> Result<(), Blocked> {
        if self.max_unwritten_items.is_some_and(|max| self.unwritten_items >= max) {
            return Err(Blocked::StoreWrite);
        }
        self.controller.readiness()
    }

    /// Processes items from a poll batch, in offset order, until input must wait.
    /// Returns how many it took; the rest are for the next call, after the
    /// adapter has delivered acknowledgements.
    ///
    /// An error means the operator's state could not be read: the task must stop.
    /// Nothing of the failed item went out, and the adapter must not make
    /// anything of it durable (no store write, no commit).
    pub fn process<'a, I>(&mut self, items: I, now_ms: u64, io: &mut impl TaskIo<O::Output>) -> Result<usize, CoreError>
    where
        I: IntoIterator,
        I::Item: Into<Item<'a, O::Input>>,
        O::Input: 'a,
    {
        let mut items = items.into_iter().peekable();
        let mut taken = 0;
        while items.peek().is_some() {
            if let Err(reason) = self.readiness() {
                self.controller.count_stall(reason);
                break;
            }
            if !self.operator.ready() {
                self.stats.operator_waits += 1;
                break;
            }
            let Some(item) = items.next() else { break };
            let Item { offset, source, input } = item.into();
            if source.is_some_and(|position| !self.sources.advance(position)) {
                self.stats.repeats += 1;
                self.item_done(offset, 0, now_ms, io);
            } else {
                self.process_one(offset, input, now_ms, io)?;
            }
            self.unwritten_items += 1;
            taken += 1;
        }
        self.end_run(io);
        Ok(taken)
    }

    #[inline]
    fn process_one(
        &mut self,
        offset: u64,
        item: &O::Input,
        now_ms: u64,
        io: &mut impl TaskIo<O::Output>,
    ) -> Result<(), CoreError> {
        self.outputs.clear();
        let made = match self.operator.process(item, &mut self.outputs) {
            Ok(()) => {
                let made = self.outputs.len() as u64;
                self.stats.outputs += made;
                for output in self.outputs.drain(..) {
                    io.send_output(offset, output);
                }
                made
            }
            Err(ProcessError::Rejected(reason)) => {
                self.outputs.clear();
                self.reject(offset, &reason, io)
            }
            Err(ProcessError::State(error)) => {
                self.outputs.clear();
                return Err(error);
            }
        };
        self.item_done(offset, made, now_ms, io);
        Ok(())
    }

    /// The record at `offset` is read and `made` records went out for it.
    #[inline]
    fn item_done(&mut self, offset: u64, made: u64, now_ms: u64, io: &mut impl TaskIo<O::Output>) {
        self.stats.items += 1;
        self.controller
            .item_processed(offset, made, self.operator.divergence(), now_ms, &mut self.actions);
        if !self.actions.is_empty() {
            self.execute(io);
        }
    }

    /// The run of input ends: a backup due for l goes out, covering all of it.
    fn end_run(&mut self, io: &mut impl TaskIo<O::Output>) {
        self.controller.run_ended(&mut self.actions);
        if !self.actions.is_empty() {
            self.execute(io);
        }
    }

    /// Hands the operator something besides its input (a distributed worker's
    /// global model): `update` changes the state, and a backup goes out at once
    /// if the divergence passed θ. Such a change is not replayed from the input
    /// after a failure: the adapter hands the operator its side input again
    /// when the task starts.
    pub fn side_input<R>(&mut self, update: impl FnOnce(&mut O) -> R, io: &mut impl TaskIo<O::Output>) -> R {
        let result = update(&mut self.operator);
        self.controller
            .state_changed(self.operator.divergence(), &mut self.actions);
        if !self.actions.is_empty() {
            self.execute(io);
        }
        result
    }

    /// Whether the operator is ready for input (see [`Operator::ready`]).
    pub fn operator_ready(&self) -> bool {
        self.operator.ready()
    }

    /// Delivers one acknowledgement.
    pub fn acknowledge(&mut self, ack: Ack, io: &mut impl TaskIo<O::Output>) {
        self.priors_changed |= !matches!(ack, Ack::Output { .. });
        let actions = &mut self.actions;
        match ack {
            Ack::Output { item_offset, count } => self.controller.outputs_acknowledged(item_offset, count, actions),
            Ack::BackupWritten(seq) => {
                self.operator.acknowledge_backup(seq);
                self.controller.backup_written(seq, actions);
            }
            Ack::BackupFailed(seq) => {
                self.stats.backups_failed += 1;
                self.priors.failed(seq);
                self.operator.fail_backup(seq);
                self.controller.backup_failed(seq, actions);
            }
            Ack::MarkerWritten(seq) => {
                if let Some(covers) = marker_done(&mut self.markers, seq) {
                    self.priors.covered(covers);
                }
                self.controller.marker_written(seq, actions);
                if !self.controller.is_starting() {
                    self.rollback = Vec::new();
                    self.owes_store_drift = false;
                }
            }
            Ack::MarkerFailed(seq) => {
                self.stats.markers_failed += 1;
                // Its backup's entries may be in the log uncovered.
                if let Some(covers) = marker_done(&mut self.markers, seq) {
                    self.priors.failed(covers);
                }
                self.controller.marker_failed(seq, actions);
            }
        }
        if !self.actions.is_empty() {
            self.execute(io);
        }
    }

    /// Time passes without items (exact mode's time interval).
    pub fn tick(&mut self, now_ms: u64, io: &mut impl TaskIo<O::Output>) {
        self.controller.tick(now_ms, &mut self.actions);
        self.execute(io);
    }

    /// Starts a clean stop: final complete backup and clean marker, then a commit.
    pub fn begin_stop(&mut self, io: &mut impl TaskIo<O::Output>) {
        self.controller.begin_stop(&mut self.actions);
        self.execute(io);
    }

    pub fn is_stopped(&self) -> bool {
        self.controller.is_stopped()
    }

    fn execute(&mut self, io: &mut impl TaskIo<O::Output>) {
        // An action may not add actions of its own here, so a plain drain works.
        let mut actions = std::mem::take(&mut self.actions);
        self.priors_changed |= !actions.is_empty();
        for action in actions.drain(..) {
            match action {
                Action::Backup { seq, scope } => {
                    self.sources_at_backup.push_back((seq, self.sources.clone()));
                    let mut records = self.priors.batch(seq);
                    self.operator.backup(seq, scope, &mut records);
                    if self.faults.skip_backups {
                        records.reset(seq);
                    }
                    self.stats.backups += 1;
                    self.stats.backup_entries += records.len() as u64;
                    self.stats.backup_bytes += records.encoded_len() as u64;
                    self.held.push_back(records);
                }
                Action::SendBackup { seq } => {
                    if let Some(records) = self.take_held(seq) {
                        io.write_backup(seq, self.priors.log(records));
                    }
                }
                Action::SendRollback { seq } => {
                    // Each key at the value restored, which is also what the
                    // log held at the marker: its certain prior.
                    let mut records = self.priors.batch(seq);
                    if self.owes_store_drift {
                        self.operator.backup(seq, BackupScope::Owed, &mut records);
                    }
                    for entry in &self.rollback {
                        records.push_encoded(&entry.key, entry.value.as_deref(), entry.value.as_deref());
                    }
                    io.write_backup(seq, self.priors.log(records));
                }
                Action::AbandonBackup { seq } => {
                    if let Some(records) = self.take_held(seq) {
                        self.priors.abandoned(records);
                    }
                    self.operator.fail_backup(seq);
                }
                Action::Marker(mut marker) => {
                    marker.sources = self.sources_covered_by(marker.covers);
                    self.stats.markers += 1;
                    self.markers.push_back((marker.seq, marker.covers));
                    io.write_marker(&marker);
                }
                Action::Commit { offset } => {
                    self.stats.commits += 1;
                    io.commit(offset);
                }
                Action::Thresholds(_) => self.operator.set_theta(self.controller.operator_theta()),
            }
        }
        self.actions = actions;
    }

    /// The source positions of the state a marker covering backup `covers`
    /// logs: the table as that backup was taken; with no backup of this run
    /// (a start marker), the table restored, which no item has moved yet.
    fn sources_covered_by(&mut self, covers: u64) -> SourcePositions {
        while self.sources_at_backup.front().is_some_and(|(seq, _)| *seq < covers) {
            self.sources_at_backup.pop_front();
        }
        match self.sources_at_backup.front() {
            Some((seq, sources)) if *seq == covers => sources.clone(),
            _ => self.sources.clone(),
        }
    }

    /// The held records of backup `seq` (the oldest, as backups go out in order).
    fn take_held(&mut self, seq: u64) -> Option<BackupBatch> {
        let index = self.held.iter().position(|records| records.seq() == seq)?;
        self.held.remove(index)
    }
}
