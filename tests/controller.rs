//! The task controller's rules, event by event.

use afstream::core::{
    Action, AnalysisConstants, BackupScope, Blocked, ControllerConfig, ExactInterval, FailurePolicy, GlobalThresholds,
    Mode, Placement, RecoveryPlan, TaskController, ThresholdPolicy,
};

const CONSTANTS: AnalysisConstants = AnalysisConstants { alpha: 1.0, beta: 1 };

fn config(mode: Mode, theta: f64, items: u64, outputs: u64) -> ControllerConfig {
    let global = GlobalThresholds::new(theta, items, outputs).unwrap();
    ControllerConfig {
        mode,
        policy: ThresholdPolicy::new(global, FailurePolicy::Halving, Placement::default(), true, CONSTANTS).unwrap(),
        constants: CONSTANTS,
    }
}

fn start(config: ControllerConfig) -> TaskController {
    let mut actions = Vec::new();
    let controller = TaskController::start(config, &RecoveryPlan::fresh(0), 0, &mut actions).unwrap();
    assert!(actions.is_empty(), "a fresh start has nothing to do");
    controller
}

fn commits(actions: &[Action]) -> Vec<u64> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Commit { offset } => Some(*offset),
            _ => None,
        })
        .collect()
}

fn backups(actions: &[Action]) -> Vec<(u64, BackupScope, bool)> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Backup { seq, scope, marker } => Some((*seq, *scope, marker.clean)),
            _ => None,
        })
        .collect()
}

#[test]
fn backs_up_when_divergence_crosses_theta_and_not_before() {
    // Θ = 20 → θ = 10.
    let mut c = start(config(Mode::Approximate, 20.0, 1000, 100));
    let mut actions = Vec::new();
    for offset in 0..10 {
        c.item_processed(offset, 0, (offset + 1) as f64, 0, &mut actions);
    }
    assert!(backups(&actions).is_empty(), "divergence 10 is not over θ = 10");
    c.item_processed(10, 0, 11.0, 0, &mut actions);
    assert_eq!(backups(&actions), vec![(0, BackupScope::Drifted, false)]);
    actions.clear();
    c.item_processed(11, 0, 12.0, 0, &mut actions);
    assert!(backups(&actions).is_empty(), "one backup in flight at a time");
    c.backup_acknowledged(0, 1.0, &mut actions);
    assert_eq!(commits(&actions), vec![12], "every backup is followed by a commit");
    assert_eq!(c.last_backup().map(|p| p.offset), Some(11));
}

#[test]
fn acknowledged_backup_still_over_theta_backs_up_again_and_commits_only_its_position() {
    let mut c = start(config(Mode::Approximate, 20.0, 1000, 100));
    let mut actions = Vec::new();
    c.item_processed(0, 0, 11.0, 0, &mut actions);
    for offset in 1..5 {
        c.item_processed(offset, 0, 11.0 + offset as f64, 0, &mut actions);
    }
    actions.clear();
    // The state drifted 14 past the snapshot while the backup was in flight.
    c.backup_acknowledged(0, 14.0, &mut actions);
    assert_eq!(commits(&actions), vec![1], "only the backup's own position is safe");
    assert_eq!(backups(&actions), vec![(1, BackupScope::Drifted, false)]);
}

#[test]
fn stops_taking_input_at_l_uncommitted_items() {
    // L = 8 → l = 4; commits go out at ⌈l/2⌉ = 2.
    let mut c = start(config(Mode::Approximate, 1e9, 8, 100));
    let mut actions = Vec::new();
    for offset in 0..4 {
        assert_eq!(c.readiness(), Ok(()));
        c.item_processed(offset, 0, 0.0, 0, &mut actions);
    }
    assert_eq!(commits(&actions), vec![2, 4]);
    assert_eq!(c.readiness(), Err(Blocked::Commit));
    c.commit_acknowledged(2, &mut actions);
    assert_eq!(c.readiness(), Ok(()));
    assert_eq!(c.uncommitted_items(), 2);
}

#[test]
fn never_commits_past_an_item_with_unacknowledged_outputs() {
    let mut c = start(config(Mode::Approximate, 1e9, 8, 100));
    let mut actions = Vec::new();
    c.item_processed(0, 0, 0.0, 0, &mut actions);
    c.item_processed(1, 2, 0.0, 0, &mut actions); // two outputs in flight
    c.item_processed(2, 0, 0.0, 0, &mut actions);
    c.item_processed(3, 0, 0.0, 0, &mut actions);
    assert_eq!(commits(&actions), vec![1], "the commit stops before item 1");
    actions.clear();
    c.outputs_acknowledged(1, 1, &mut actions);
    assert!(commits(&actions).is_empty(), "one output of item 1 is still in flight");
    c.outputs_acknowledged(1, 1, &mut actions);
    assert_eq!(commits(&actions), vec![4]);
}

#[test]
fn stops_taking_input_at_gamma_unacknowledged_outputs() {
    // Γ = 6 → γ = 3.
    let mut c = start(config(Mode::Approximate, 1e9, 1000, 6));
    let mut actions = Vec::new();
    for offset in 0..3 {
        assert_eq!(c.readiness(), Ok(()));
        c.item_processed(offset, 1, 0.0, 0, &mut actions);
    }
    assert_eq!(c.readiness(), Err(Blocked::Outputs));
    c.outputs_acknowledged(0, 1, &mut actions);
    assert_eq!(c.readiness(), Ok(()));
}

#[test]
fn exact_mode_backs_up_completely_every_interval_and_commits_the_backup() {
    let interval = ExactInterval {
        items: Some(3),
        millis: Some(100),
    };
    let mut c = start(config(Mode::Exact(interval), 1.0, 1, 1));
    let mut actions = Vec::new();
    c.item_processed(0, 0, 50.0, 0, &mut actions);
    c.item_processed(1, 0, 50.0, 0, &mut actions);
    assert!(actions.is_empty(), "exact mode ignores θ");
    c.item_processed(2, 0, 50.0, 0, &mut actions);
    assert_eq!(backups(&actions), vec![(0, BackupScope::Complete, false)]);
    actions.clear();
    c.item_processed(3, 0, 1.0, 10, &mut actions);
    c.backup_acknowledged(0, 1.0, &mut actions);
    assert_eq!(commits(&actions), vec![3], "exactly the backup's position");
    actions.clear();
    c.tick(150, &mut actions);
    assert_eq!(
        backups(&actions),
        vec![(1, BackupScope::Complete, false)],
        "time interval"
    );
}

#[test]
fn mode_none_does_nothing_until_a_clean_stop() {
    let mut c = start(config(Mode::None, 1.0, 1, 1));
    let mut actions = Vec::new();
    for offset in 0..100 {
        assert_eq!(c.readiness(), Ok(()));
        c.item_processed(offset, 1, 1e9, 0, &mut actions);
    }
    assert!(actions.is_empty());
    c.begin_stop(&mut actions);
    assert!(actions.is_empty(), "waits for outputs first");
    for offset in 0..100 {
        c.outputs_acknowledged(offset, 1, &mut actions);
    }
    assert_eq!(commits(&actions), vec![100]);
    c.commit_acknowledged(100, &mut actions);
    assert!(c.is_stopped());
}

#[test]
fn clean_stop_takes_a_final_complete_backup_then_commits() {
    let mut c = start(config(Mode::Approximate, 100.0, 1000, 100));
    let mut actions = Vec::new();
    for offset in 0..5 {
        c.item_processed(offset, 0, 1.0, 0, &mut actions);
    }
    actions.clear();
    c.begin_stop(&mut actions);
    assert_eq!(c.readiness(), Err(Blocked::Stopping));
    assert_eq!(backups(&actions), vec![(0, BackupScope::Complete, true)]);
    actions.clear();
    c.backup_acknowledged(0, 0.0, &mut actions);
    assert_eq!(commits(&actions), vec![5]);
    assert!(!c.is_stopped());
    c.commit_acknowledged(5, &mut actions);
    assert!(c.is_stopped());
}

#[test]
fn recovery_persists_its_failure_count_before_taking_input() {
    let config = config(Mode::Approximate, 100.0, 1000, 100);
    let plan = RecoveryPlan {
        resume_offset: 40,
        failures: 3,
        counted_failure: true,
        introduced: Default::default(),
    };
    let mut actions = Vec::new();
    let mut c = TaskController::start(config, &plan, 0, &mut actions).unwrap();
    assert_eq!(c.readiness(), Err(Blocked::RecoveryMarker));
    let Some(Action::Backup { seq, marker, .. }) = actions.first().cloned() else {
        panic!("expected a marker backup, got {actions:?}")
    };
    assert_eq!(marker.failures, 3);
    assert_eq!(marker.input_offset, 40);
    assert_eq!(c.thresholds().theta, 100.0 / 16.0, "Θ/2^(k+1) with k = 3");
    actions.clear();
    c.backup_failed(seq, 0.0, &mut actions);
    let Some(Action::Backup { seq, .. }) = actions.first().cloned() else {
        panic!("a failed marker is issued again")
    };
    c.backup_acknowledged(seq, 0.0, &mut actions);
    assert_eq!(c.readiness(), Ok(()));
    assert_eq!(c.processed().offset, 40);
}

#[test]
fn failed_backup_is_issued_again_while_still_over_theta() {
    let mut c = start(config(Mode::Approximate, 20.0, 1000, 100));
    let mut actions = Vec::new();
    c.item_processed(0, 0, 11.0, 0, &mut actions);
    actions.clear();
    c.backup_failed(0, 11.0, &mut actions);
    assert_eq!(backups(&actions), vec![(1, BackupScope::Drifted, false)]);
    assert!(c.last_backup().is_none());
}

#[test]
fn invalid_exact_interval_is_an_error() {
    let bad = Mode::Exact(ExactInterval {
        items: None,
        millis: None,
    });
    let mut actions = Vec::new();
    let err = TaskController::start(config(bad, 1.0, 1, 1), &RecoveryPlan::fresh(0), 0, &mut actions).unwrap_err();
    assert!(err.to_string().contains("exact interval"), "{err}");
}
