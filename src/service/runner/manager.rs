//! The task manager: the set of one member's tasks and how it changes with
//! rebalances, delivery reports and the stop. The loop (`run_pipeline`)
//! polls, hands the manager what the group listener recorded, and runs a
//! round; the manager decides which task gets what.
//!
//! Rules, and why they hold:
//!
//! * **A task is in one place.** Active (stepped, flushed, given reports),
//!   parked (its partition lost; kept in case the group gives it back and
//!   nothing else wrote its changelog) or gone. A task handing its partition
//!   off is active and stopping until its final backup is acknowledged or
//!   the deadline passes; then it is gone and the partition is released.
//! * **A report reaches the incarnation that sent its record.** Reports are
//!   routed by [`TaskIncarnation`], never by partition: a revoked task's late
//!   report cannot acknowledge the marker of the same partition's next task,
//!   whose sequence numbers start again. A parked task's reports wait beside
//!   it and are delivered, in order, when it is regained, so that it does not
//!   wait forever on a marker acknowledged while it was parked.
//! * **A task that cannot go on exactly is not parked.** One on a local store
//!   restarts on it exactly anyway; a stopped one has nothing left to do.
//!   A partition assigned again (another member wrote its changelog in the
//!   meantime) drops its parked task: the new one restores.
//! * **Once stopping, every task stops.** One assigned or regained after the
//!   stop began begins its own stop at once (a final backup and a clean
//!   marker where it started).
//! * **Every wait has a deadline.** A handoff is released at `stop_deadline`
//!   even if some of its tasks did not stop (their next owner recovers from
//!   the last marker and counts a failure); a stop past it fails naming the
//!   partitions that did not finish.
//!
//! Time is the run's clock in milliseconds, passed in, so that the manager is
//! tested with scripted rebalances and reports and no broker (see the tests).

use std::collections::BTreeMap;
use std::time::Duration;

use super::super::delivery::{DeliveryEvent, TaskIncarnation};
use super::super::ServiceError;

/// What the manager reads of a task.
pub(super) trait TaskView {
    fn partition(&self) -> i32;
    /// This run of the task: the reports of its records name it.
    fn incarnation(&self) -> TaskIncarnation;
    /// The clean stop is acknowledged (or the task never started).
    fn is_stopped(&self) -> bool;
    /// Every input record up to the partition's end at assignment is taken.
    fn at_end(&self) -> bool;
    /// Input is at hand but waits on an acknowledgement.
    fn awaits_acknowledgement(&self) -> bool;
    fn unacknowledged_outputs(&self) -> u64;
    /// The next input offset the task has not processed.
    fn next_offset(&self) -> u64;
    /// The task can be kept while its partition is lost (see the rules).
    fn parkable(&self) -> bool;
    /// The incarnation its changelog records name ([`crate::core::fence`]).
    fn changelog_incarnation(&self) -> u64;
    /// An error that ends the run, taken once.
    fn take_fatal(&mut self) -> Option<String>;
}

/// What the manager has a task do; `E` is what every task shares (the
/// clients, the topics).
pub(super) trait ManagedTask<E: ?Sized>: TaskView {
    /// Takes input until the task must wait; whether anything happened.
    fn step(&mut self, env: &E, now_ms: u64, stopping: bool) -> bool;
    /// Sends what the last step left to send; whether anything happened.
    fn flush(&mut self, env: &E, now_ms: u64) -> bool;
    fn delivered(&mut self, env: &E, event: DeliveryEvent, now_ms: u64);
    /// Begins the clean stop: a final backup and a clean marker.
    fn begin_stop(&mut self, env: &E);
    /// Resumes a parked task on its partition, given back with `end` as its end.
    fn resume(&mut self, env: &E, end: u64) -> Result<(), ServiceError>;
}

/// What the tasks' records are sent with.
pub(super) trait Producers {
    /// The delivery reports that arrived since the last call.
    fn reports(&self, into: &mut Vec<DeliveryEvent>);
    /// Waits, within its own deadline, for the reports of every record sent.
    fn flush(&self);
}

/// Where a parked task stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Parked {
    /// The next input offset it has not processed.
    pub(super) next_offset: u64,
    /// The changelog partition's end when it was parked: if another member
    /// wrote the changelog since, the task's state is stale.
    pub(super) changelog_end: i64,
    /// Its changelog incarnation: a stalled member notices the loss only
    /// when it wakes up, after the next owner wrote, so the changelog must
    /// also still end with a marker of this incarnation.
    pub(super) incarnation: u64,
}

/// A parked task and the reports that arrived for it.
struct ParkedTask<T> {
    task: T,
    reports: Vec<DeliveryEvent>,
}

/// Partitions being handed off, and since when.
struct Handoff {
    partitions: Vec<i32>,
    since_ms: u64,
}

/// How the clean stop goes.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum StopProgress {
    Running,
    Stopping,
    /// Every task's clean stop is acknowledged.
    Stopped,
    /// These partitions did not stop within the deadline.
    Overdue(Vec<i32>),
}

/// One member's tasks.
pub(super) struct TaskManager<T> {
    active: BTreeMap<i32, T>,
    parked: BTreeMap<i32, ParkedTask<T>>,
    handoff: Option<Handoff>,
    stop_deadline: Duration,
    stopping_since_ms: Option<u64>,
    /// How long after the stop began every output was acknowledged.
    drained_ms: Option<u64>,
    first_start_ms: Option<u64>,
    reports: Vec<DeliveryEvent>,
}

impl<T> TaskManager<T> {
    pub(super) fn new(stop_deadline: Duration) -> Self {
        TaskManager {
            active: BTreeMap::new(),
            parked: BTreeMap::new(),
            handoff: None,
            stop_deadline,
            stopping_since_ms: None,
            drained_ms: None,
            first_start_ms: None,
            reports: Vec::new(),
        }
    }

    #[cfg(test)]
    pub(super) fn active(&self) -> impl Iterator<Item = &T> {
        self.active.values()
    }

    pub(super) fn active_mut(&mut self) -> impl Iterator<Item = &mut T> {
        self.active.values_mut()
    }

    pub(super) fn task_mut(&mut self, partition: i32) -> Option<&mut T> {
        self.active.get_mut(&partition)
    }

    #[cfg(test)]
    pub(super) fn is_parked(&self, partition: i32) -> bool {
        self.parked.contains_key(&partition)
    }

    pub(super) fn is_stopping(&self) -> bool {
        self.stopping_since_ms.is_some()
    }

    /// When the stop began, on the run's clock.
    pub(super) fn stopping_since_ms(&self) -> Option<u64> {
        self.stopping_since_ms
    }

    /// How long after the stop began every output was acknowledged.
    pub(super) fn drained_ms(&self) -> Option<u64> {
        self.drained_ms
    }

    /// When the first partition's task started (its restore done).
    pub(super) fn first_start_ms(&self) -> Option<u64> {
        self.first_start_ms
    }

    /// Partitions are being handed off.
    #[cfg(test)]
    pub(super) fn is_handing_off(&self) -> bool {
        self.handoff.is_some()
    }

    fn overdue(&self, since_ms: u64, now_ms: u64) -> bool {
        u128::from(now_ms.saturating_sub(since_ms)) > self.stop_deadline.as_millis()
    }
}

impl<T> TaskManager<T> {
    /// Routes the reports that arrived to the incarnations that sent their
    /// records; whether any arrived.
    pub(super) fn deliver<E: Producers + ?Sized>(&mut self, env: &E, now_ms: u64) -> bool
    where
        T: ManagedTask<E>,
    {
        // The buffer is kept between rounds (taken out while the tasks are borrowed).
        let mut reports = std::mem::take(&mut self.reports);
        env.reports(&mut reports);
        let any = !reports.is_empty();
        for event in reports.drain(..) {
            let sender = event.delivery.task();
            if let Some(task) = self.active.values_mut().find(|t| t.incarnation() == sender) {
                task.delivered(env, event, now_ms);
            } else if let Some(parked) = self.parked.values_mut().find(|p| p.task.incarnation() == sender) {
                parked.reports.push(event);
            }
            // Otherwise its task is gone: nothing waits on it.
        }
        self.reports = reports;
        any
    }

    /// The group took these partitions back; their reports were delivered.
    pub(super) fn revoked(&mut self, partitions: &[i32])
    where
        T: TaskView,
    {
        for partition in partitions {
            if self.active.remove(partition).is_some() {
                tracing::info!(
                    partition,
                    "partition revoked; its next owner restores it from the changelog"
                );
            }
        }
    }

    /// The partition is lost (another member may own it already); its
    /// reports were delivered. A task that can be kept is parked, with where
    /// it stopped for the group listener; `changelog_end` reads the
    /// changelog partition's end, and a task is not kept without it.
    pub(super) fn lost(&mut self, partition: i32, changelog_end: impl FnOnce() -> Option<i64>) -> Option<Parked>
    where
        T: TaskView,
    {
        let task = self.active.remove(&partition)?;
        let end = if task.parkable() { changelog_end() } else { None };
        let Some(changelog_end) = end else {
            tracing::info!(partition, "partition lost; its next owner restores it");
            return None;
        };
        let next_offset = task.next_offset();
        let incarnation = task.changelog_incarnation();
        tracing::info!(
            partition,
            next_offset,
            "partition lost; its task is kept: if the partition comes back and nothing else wrote its changelog, it \
             goes on where it stopped"
        );
        self.parked.insert(
            partition,
            ParkedTask {
                task,
                reports: Vec::new(),
            },
        );
        Some(Parked {
            next_offset,
            changelog_end,
            incarnation,
        })
    }

    /// The group gave a lost partition back and nothing else wrote its
    /// changelog: its parked task goes on, with the reports it missed.
    pub(super) fn regained<E: ?Sized>(
        &mut self,
        env: &E,
        partition: i32,
        end: u64,
        now_ms: u64,
    ) -> Result<(), ServiceError>
    where
        T: ManagedTask<E>,
    {
        let Some(ParkedTask { mut task, reports }) = self.parked.remove(&partition) else {
            return Ok(());
        };
        task.resume(env, end)?;
        tracing::info!(
            partition,
            next_offset = task.next_offset(),
            "partition given back: its kept task goes on where it stopped (nothing else wrote its changelog); no \
             failure"
        );
        for event in reports {
            task.delivered(env, event, now_ms);
        }
        self.activate(env, task);
        Ok(())
    }

    /// A partition was assigned, restored and its task started. A task kept
    /// for it is dropped: another member wrote its changelog since.
    pub(super) fn assigned<E: ?Sized>(&mut self, env: &E, task: T, now_ms: u64)
    where
        T: ManagedTask<E>,
    {
        self.first_start_ms.get_or_insert(now_ms);
        self.parked.remove(&task.partition());
        self.activate(env, task);
    }

    fn activate<E: ?Sized>(&mut self, env: &E, mut task: T)
    where
        T: ManagedTask<E>,
    {
        if self.is_stopping() {
            task.begin_stop(env);
        }
        self.active.insert(task.partition(), task);
    }

    /// The group is taking these partitions back cooperatively: their tasks
    /// stop cleanly before the partitions are released
    /// ([`TaskManager::handoff_due`], [`TaskManager::finish_handoff`]).
    pub(super) fn hand_off<E: ?Sized>(&mut self, env: &E, partitions: &[i32], now_ms: u64)
    where
        T: ManagedTask<E>,
    {
        for partition in partitions {
            if let Some(task) = self.active.get_mut(partition) {
                tracing::info!(
                    partition,
                    "partition revoked; handing it off: final backup, clean marker"
                );
                task.begin_stop(env);
            }
        }
        match &mut self.handoff {
            Some(pending) => pending.partitions.extend_from_slice(partitions),
            None => {
                self.handoff = Some(Handoff {
                    partitions: partitions.to_vec(),
                    since_ms: now_ms,
                })
            }
        }
    }

    /// The partitions handed off can be released: their tasks stopped, or
    /// the deadline passed.
    pub(super) fn handoff_due(&self, now_ms: u64) -> bool
    where
        T: TaskView,
    {
        let Some(handoff) = &self.handoff else {
            return false;
        };
        let stopped = handoff
            .partitions
            .iter()
            .all(|p| self.active.get(p).is_none_or(|t| t.is_stopped()));
        stopped || self.overdue(handoff.since_ms, now_ms)
    }

    /// Ends the handoff: the last reports delivered, its tasks gone. The
    /// caller then commits and releases the partitions. The partitions whose
    /// tasks had not stopped cleanly (their next owner counts a failure).
    pub(super) fn finish_handoff<E: Producers + ?Sized>(&mut self, env: &E, now_ms: u64) -> Vec<i32>
    where
        T: ManagedTask<E>,
    {
        let Some(handoff) = self.handoff.take() else {
            return Vec::new();
        };
        env.flush();
        self.deliver(env, now_ms);
        let mut unfinished = Vec::new();
        for partition in handoff.partitions {
            match self.active.remove(&partition) {
                Some(task) if task.is_stopped() => tracing::info!(
                    partition,
                    "partition handed off: its final backup and clean marker are in the changelog"
                ),
                Some(_) => {
                    tracing::warn!(
                        partition,
                        "partition handed off before its final backup was acknowledged (within {:?}): its next \
                         owner recovers from the last marker and counts a failure",
                        self.stop_deadline
                    );
                    unfinished.push(partition);
                }
                None => {}
            }
        }
        unfinished
    }

    /// One round of work: every task steps, the reports are delivered, what
    /// they freed is sent. Whether anything happened.
    pub(super) fn round<E: Producers + ?Sized>(&mut self, env: &E, now_ms: u64) -> bool
    where
        T: ManagedTask<E>,
    {
        let stopping = self.is_stopping();
        let mut worked = false;
        for task in self.active.values_mut() {
            worked |= task.step(env, now_ms, stopping);
        }
        worked |= self.deliver(env, now_ms);
        for task in self.active.values_mut() {
            worked |= task.flush(env, now_ms);
        }
        worked
    }

    /// Input waits on an acknowledgement in some task.
    pub(super) fn awaiting(&self) -> bool
    where
        T: TaskView,
    {
        self.active.values().any(|t| t.awaits_acknowledgement())
    }

    /// The first fatal error of a task, with its partition.
    pub(super) fn fatal(&mut self) -> Option<(i32, String)>
    where
        T: TaskView,
    {
        self.active
            .iter_mut()
            .find_map(|(partition, task)| task.take_fatal().map(|f| (*partition, f)))
    }

    /// All `partitions` of the input are active here and taken to their end.
    pub(super) fn all_at_end(&self, partitions: usize) -> bool
    where
        T: TaskView,
    {
        self.active.len() == partitions && self.active.values().all(|t| t.at_end())
    }

    /// Begins the clean stop of every task (once).
    pub(super) fn stop<E: ?Sized>(&mut self, env: &E, now_ms: u64)
    where
        T: ManagedTask<E>,
    {
        if self.is_stopping() {
            return;
        }
        tracing::info!(
            tasks = self.active.len(),
            "stopping cleanly: final backups, markers and commits"
        );
        for task in self.active.values_mut() {
            task.begin_stop(env);
        }
        self.stopping_since_ms = Some(now_ms);
    }

    /// Where the stop is.
    pub(super) fn stop_progress(&mut self, now_ms: u64) -> StopProgress
    where
        T: TaskView,
    {
        let Some(since_ms) = self.stopping_since_ms else {
            return StopProgress::Running;
        };
        if self.drained_ms.is_none() && self.active.values().all(|t| t.unacknowledged_outputs() == 0) {
            self.drained_ms = Some(now_ms.saturating_sub(since_ms));
        }
        if self.active.values().all(|t| t.is_stopped()) {
            return StopProgress::Stopped;
        }
        if self.overdue(since_ms, now_ms) {
            let waiting = self
                .active
                .values()
                .filter(|t| !t.is_stopped())
                .map(|t| t.partition())
                .collect();
            return StopProgress::Overdue(waiting);
        }
        StopProgress::Stopping
    }
}

#[cfg(test)]
mod tests;
