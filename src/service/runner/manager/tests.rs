//! The task manager's rules, checked with scripted rebalances, fake tasks
//! and fake producers: no broker.

use super::*;
use crate::service::delivery::Delivery;
use std::cell::RefCell;

/// The shared side: reports the test scripts, and flushes counted.
#[derive(Default)]
struct FakeProducers {
    pending: RefCell<Vec<DeliveryEvent>>,
    flushes: RefCell<u32>,
}

impl FakeProducers {
    fn report(&self, delivery: Delivery) {
        self.pending.borrow_mut().push(DeliveryEvent {
            delivery,
            failure: None,
        });
    }
}

impl Producers for FakeProducers {
    fn reports(&self, into: &mut Vec<DeliveryEvent>) {
        into.append(&mut self.pending.borrow_mut());
    }
    fn flush(&self) {
        *self.flushes.borrow_mut() += 1;
    }
}

/// A task that records what it is given and stops when told to and
/// its stop marker is acknowledged (any report after `begin_stop`).
#[derive(Debug, Default)]
struct FakeTask {
    partition: i32,
    incarnation: TaskIncarnation,
    received: Vec<Delivery>,
    stop_begun: bool,
    stopped: bool,
    steps: u32,
    outputs_in_flight: u64,
    on_store: bool,
    resumed_to: Option<u64>,
    fatal: Option<String>,
    at_end: bool,
}

fn task(partition: i32, incarnation: u16) -> FakeTask {
    FakeTask {
        partition,
        incarnation: TaskIncarnation(incarnation),
        ..FakeTask::default()
    }
}

impl TaskView for FakeTask {
    fn partition(&self) -> i32 {
        self.partition
    }
    fn incarnation(&self) -> TaskIncarnation {
        self.incarnation
    }
    fn is_stopped(&self) -> bool {
        self.stopped
    }
    fn at_end(&self) -> bool {
        self.at_end
    }
    fn awaits_acknowledgement(&self) -> bool {
        self.outputs_in_flight > 0
    }
    fn unacknowledged_outputs(&self) -> u64 {
        self.outputs_in_flight
    }
    fn next_offset(&self) -> u64 {
        100 + self.partition as u64
    }
    fn parkable(&self) -> bool {
        !self.on_store && !self.stopped
    }
    fn changelog_incarnation(&self) -> u64 {
        7
    }
    fn take_fatal(&mut self) -> Option<String> {
        self.fatal.take()
    }
}

impl ManagedTask<FakeProducers> for FakeTask {
    fn step(&mut self, _: &FakeProducers, _: u64, stopping: bool) -> bool {
        self.steps += u32::from(!stopping);
        !stopping
    }
    fn flush(&mut self, _: &FakeProducers, _: u64) -> bool {
        false
    }
    fn delivered(&mut self, _: &FakeProducers, event: DeliveryEvent, _: u64) {
        self.received.push(event.delivery);
        self.outputs_in_flight = self.outputs_in_flight.saturating_sub(1);
        self.stopped |= self.stop_begun;
    }
    fn begin_stop(&mut self, _: &FakeProducers) {
        self.stop_begun = true;
    }
    fn resume(&mut self, _: &FakeProducers, end: u64) -> Result<(), ServiceError> {
        self.resumed_to = Some(end);
        Ok(())
    }
}

const DEADLINE: Duration = Duration::from_millis(1_000);
/// When `manager_with` assigns its tasks.
const FIRST_START_MS: u64 = 3;

fn marker(incarnation: u16, seq: u64) -> Delivery {
    Delivery::Marker {
        task: TaskIncarnation(incarnation),
        seq,
    }
}

fn manager_with(env: &FakeProducers, tasks: impl IntoIterator<Item = FakeTask>) -> TaskManager<FakeTask> {
    let mut manager = TaskManager::new(DEADLINE);
    for task in tasks {
        manager.assigned(env, task, FIRST_START_MS);
    }
    manager
}

fn received(manager: &mut TaskManager<FakeTask>, partition: i32) -> Vec<Delivery> {
    manager
        .task_mut(partition)
        .map(|t| t.received.clone())
        .unwrap_or_default()
}

#[test]
fn a_late_report_of_a_revoked_task_does_not_reach_its_partitions_next_task() {
    let env = FakeProducers::default();
    let mut manager = manager_with(&env, [task(4, 1), task(5, 3)]);
    manager.revoked(&[4]);
    assert!(manager.task_mut(4).is_none(), "a revoked task is gone");
    assert_eq!(manager.active_mut().map(|t| t.partition).collect::<Vec<_>>(), vec![5]);
    manager.assigned(&env, task(4, 2), 10);
    // The old run's marker 1 reports after the new run sent its own marker 1.
    env.report(marker(1, 1));
    env.report(marker(2, 1));
    assert!(manager.deliver(&env, 20));
    assert_eq!(received(&mut manager, 4), vec![marker(2, 1)]);
}

#[test]
fn a_lost_task_is_parked_keeps_its_reports_and_gets_them_when_regained() {
    let env = FakeProducers::default();
    let mut manager = manager_with(&env, [task(0, 1), task(1, 2)]);
    let parked = manager.lost(0, || Some(77));
    assert_eq!(
        parked,
        Some(Parked {
            next_offset: 100,
            changelog_end: 77,
            incarnation: 7,
        })
    );
    assert!(manager.is_parked(0));
    assert!(manager.task_mut(0).is_none(), "a parked task is not stepped");
    env.report(marker(1, 3));
    env.report(marker(2, 5));
    manager.round(&env, 30);
    assert_eq!(received(&mut manager, 1), vec![marker(2, 5)]);
    manager.regained(&env, 0, 500, 40).expect("resumes");
    assert!(!manager.is_parked(0));
    let regained = manager.task_mut(0).expect("active again");
    assert_eq!(regained.received, vec![marker(1, 3)], "the report it missed");
    assert_eq!(regained.resumed_to, Some(500));
}

#[test]
fn a_lost_task_on_a_local_store_or_without_the_changelogs_end_is_dropped() {
    let env = FakeProducers::default();
    let on_store = FakeTask {
        on_store: true,
        ..task(0, 1)
    };
    let mut manager = manager_with(&env, [on_store, task(1, 2)]);
    let mut asked = false;
    assert_eq!(
        manager.lost(0, || {
            asked = true;
            Some(1)
        }),
        None
    );
    assert!(!asked, "a store-backed task is never kept");
    assert_eq!(manager.lost(1, || None), None);
    assert!(!manager.is_parked(0) && !manager.is_parked(1));
    // A report for a task that is gone is dropped, not misrouted.
    env.report(marker(2, 1));
    manager.regained(&env, 1, 10, 5).expect("nothing to resume");
    assert!(manager.task_mut(1).is_none());
}

#[test]
fn a_partition_assigned_anew_replaces_its_parked_task() {
    let env = FakeProducers::default();
    let mut manager = manager_with(&env, [task(3, 1)]);
    manager.lost(3, || Some(9));
    manager.assigned(&env, task(3, 2), 50);
    assert!(!manager.is_parked(3));
    env.report(marker(1, 1));
    manager.deliver(&env, 60);
    assert!(received(&mut manager, 3).is_empty(), "the old task's report is dropped");
    assert_eq!(manager.task_mut(3).map(|t| t.incarnation), Some(TaskIncarnation(2)));
}

#[test]
fn a_handoff_waits_for_its_tasks_final_backups_then_ends_only_them() {
    let env = FakeProducers::default();
    let mut manager = manager_with(&env, [task(0, 1), task(1, 2), task(2, 3)]);
    manager.hand_off(&env, &[0, 1], 100);
    assert!(manager.task_mut(0).is_some_and(|t| t.stop_begun));
    assert!(manager.task_mut(2).is_some_and(|t| !t.stop_begun));
    assert!(!manager.handoff_due(200));
    env.report(marker(1, 9));
    manager.round(&env, 300);
    assert!(!manager.handoff_due(300), "partition 1 has not stopped");
    env.report(marker(2, 9));
    manager.round(&env, 400);
    assert!(manager.handoff_due(400));
    assert_eq!(
        manager.finish_handoff(&env, 400),
        Vec::<i32>::new(),
        "both stopped cleanly"
    );
    assert_eq!(*env.flushes.borrow(), 1, "flushed before the release");
    assert!(!manager.is_handing_off());
    assert_eq!(manager.active().map(|t| t.partition).collect::<Vec<_>>(), vec![2]);
}

#[test]
fn a_handoff_is_released_at_its_deadline_with_a_task_that_did_not_stop() {
    let env = FakeProducers::default();
    let mut manager = manager_with(&env, [task(0, 1)]);
    manager.hand_off(&env, &[0], 100);
    // A second revocation joins the pending handoff and keeps its start.
    manager.hand_off(&env, &[7], 900);
    let deadline = 100 + DEADLINE.as_millis() as u64;
    assert!(!manager.handoff_due(deadline));
    assert!(manager.handoff_due(deadline + 1));
    assert_eq!(
        manager.finish_handoff(&env, deadline + 1),
        vec![0],
        "partition 7 had no task here"
    );
    assert!(manager.task_mut(0).is_none());
}

#[test]
fn tasks_assigned_or_regained_while_stopping_stop_at_once() {
    let env = FakeProducers::default();
    let mut manager = manager_with(&env, [task(0, 1), task(1, 2)]);
    manager.lost(1, || Some(0));
    manager.stop(&env, 1_000);
    assert!(manager.task_mut(0).is_some_and(|t| t.stop_begun));
    manager.assigned(&env, task(2, 3), 1_100);
    manager.regained(&env, 1, 10, 1_200).expect("resumes");
    for partition in [1, 2] {
        assert!(
            manager.task_mut(partition).is_some_and(|t| t.stop_begun),
            "partition {partition}"
        );
    }
    // Stopping tasks take no input.
    manager.round(&env, 1_300);
    assert!(manager.active().all(|t| t.steps == 0));
}

#[test]
fn the_stop_ends_when_every_task_stopped_and_past_its_deadline_names_the_late_ones() {
    let env = FakeProducers::default();
    let outputs = FakeTask {
        outputs_in_flight: 1,
        ..task(0, 1)
    };
    let mut manager = manager_with(&env, [outputs, task(1, 2), task(2, 3)]);
    assert_eq!(manager.stop_progress(10), StopProgress::Running);
    manager.stop(&env, 100);
    assert_eq!(manager.stop_progress(150), StopProgress::Stopping);
    assert_eq!(manager.drained_ms(), None, "partition 0 has an output in flight");
    env.report(marker(1, 2));
    env.report(marker(2, 2));
    manager.round(&env, 200);
    assert_eq!(manager.stop_progress(250), StopProgress::Stopping);
    assert_eq!(manager.drained_ms(), Some(150));
    let overdue = 100 + DEADLINE.as_millis() as u64 + 1;
    assert_eq!(manager.stop_progress(overdue), StopProgress::Overdue(vec![2]));
    env.report(marker(3, 2));
    manager.round(&env, overdue);
    assert_eq!(manager.stop_progress(overdue), StopProgress::Stopped);
    assert_eq!(manager.stopping_since_ms(), Some(100));
}

#[test]
fn a_fatal_error_is_named_by_its_partition_and_taken_once() {
    let env = FakeProducers::default();
    let failing = FakeTask {
        fatal: Some("reading the task's state: disk".into()),
        ..task(5, 1)
    };
    let mut manager = manager_with(&env, [task(0, 2), failing]);
    assert_eq!(manager.fatal(), Some((5, "reading the task's state: disk".into())));
    assert_eq!(manager.fatal(), None);
}

#[test]
fn the_run_is_at_its_end_only_with_every_partition_here_and_taken() {
    let env = FakeProducers::default();
    let done = |p, i| FakeTask {
        at_end: true,
        ..task(p, i)
    };
    let mut manager = manager_with(&env, [done(0, 1), done(1, 2)]);
    assert!(manager.all_at_end(2));
    assert!(!manager.all_at_end(3), "a partition is elsewhere");
    manager.assigned(&env, task(2, 3), 5);
    assert!(!manager.all_at_end(3));
    assert_eq!(
        manager.first_start_ms(),
        Some(FIRST_START_MS),
        "the first, not the last"
    );
}

#[test]
fn input_awaits_while_a_task_waits_on_an_acknowledgement() {
    let env = FakeProducers::default();
    let waiting = FakeTask {
        outputs_in_flight: 1,
        ..task(1, 2)
    };
    let mut manager = manager_with(&env, [task(0, 1), waiting]);
    assert!(manager.awaiting());
    env.report(Delivery::Output {
        task: TaskIncarnation(2),
        offset: 4,
    });
    manager.round(&env, 1);
    assert!(!manager.awaiting());
}

#[test]
fn a_round_says_whether_anything_happened() {
    let env = FakeProducers::default();
    let mut manager = manager_with(&env, [task(0, 1)]);
    assert!(manager.round(&env, 1), "a running task steps");
    manager.stop(&env, 2);
    assert!(
        !manager.round(&env, 3),
        "a stopping task with nothing reported does nothing"
    );
    env.report(marker(1, 1));
    assert!(manager.round(&env, 4), "a report arrived");
}
