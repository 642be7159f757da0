//! The task controller's rules, event by event.

use afstream_core::{
    Action, AnalysisConstants, BackupMarker, BackupScope, Blocked, ControllerConfig, ExactInterval, FailurePolicy,
    GlobalThresholds, Mode, Norm, Placement, RecoveryPlan, ResumeSource, TaskController, ThresholdPolicy,
    DEFAULT_MAX_BACKUPS_IN_FLIGHT,
};

const CONSTANTS: AnalysisConstants = AnalysisConstants { alpha: 1.0, beta: 1 };

fn config(mode: Mode, theta: f64, items: u64, outputs: u64) -> ControllerConfig {
    let global = GlobalThresholds::new(theta, items, outputs).unwrap();
    let policy = ThresholdPolicy::new(
        global,
        FailurePolicy::Halving,
        Placement::default(),
        Norm::L1,
        CONSTANTS,
    )
    .unwrap();
    ControllerConfig::new(mode, policy, CONSTANTS)
}

/// Exact mode backing up every `items` items.
fn exact_every_items(items: u64) -> Mode {
    Mode::Exact(ExactInterval {
        items: Some(items),
        millis: None,
    })
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

fn backups(actions: &[Action]) -> Vec<(u64, BackupScope)> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Backup { seq, scope } => Some((*seq, *scope)),
            _ => None,
        })
        .collect()
}

fn markers(actions: &[Action]) -> Vec<BackupMarker> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Marker(marker) => Some(marker.as_ref().clone()),
            _ => None,
        })
        .collect()
}

/// One item processed as a run of its own (a backup due for l goes out at the
/// end of a run).
fn one_item(
    c: &mut TaskController,
    offset: u64,
    outputs: u64,
    divergence: f64,
    now_ms: u64,
    actions: &mut Vec<Action>,
) {
    c.item_processed(offset, outputs, divergence, now_ms, actions);
    c.run_ended(actions);
}

/// A started task whose start marker is acknowledged.
fn running(config: ControllerConfig) -> TaskController {
    let mut actions = Vec::new();
    let mut c = TaskController::start(config, &first_start(), false, 0, &mut actions).unwrap();
    if config.mode != Mode::None {
        let start = markers(&actions);
        assert_eq!(start.len(), 1, "every start writes a marker first: {actions:?}");
        assert_eq!(c.readiness(), Err(Blocked::StartMarker));
        c.marker_written(start[0].seq, &mut actions);
    }
    assert_eq!(c.readiness(), Ok(()));
    c
}

/// Acknowledges a backup's entries and then the marker that went out right
/// behind them (the next sequence number).
fn complete_backup(c: &mut TaskController, seq: u64) -> Vec<Action> {
    let mut actions = Vec::new();
    c.backup_written(seq, &mut actions);
    c.marker_written(seq + 1, &mut actions);
    actions
}

#[test]
fn backs_up_when_divergence_crosses_theta_and_not_before() {
    // Θ = 20 → θ = 10; L large so only θ triggers.
    let mut c = running(config(Mode::Approximate, 20.0, 1000, 100));
    let mut actions = Vec::new();
    for offset in 0..10 {
        one_item(&mut c, offset, 0, (offset + 1) as f64, 0, &mut actions);
    }
    assert!(backups(&actions).is_empty(), "divergence 10 is not over θ = 10");
    one_item(&mut c, 10, 0, 11.0, 0, &mut actions);
    assert_eq!(
        backups(&actions),
        vec![(2, BackupScope::Drifted)],
        "sequences start at 1: the start marker's"
    );
    assert_eq!(
        markers(&actions)[0].input_offset,
        11,
        "the marker goes right behind the entries"
    );
    // Backups do not wait for each other: the divergence counts from the last
    // one issued, acknowledged or not.
    actions.clear();
    one_item(&mut c, 11, 0, 12.0, 0, &mut actions);
    assert_eq!(backups(&actions), vec![(4, BackupScope::Drifted)]);
    assert_eq!(markers(&actions)[0].input_offset, 12);
    // At most four are in flight: a fifth trigger waits for one to close, and
    // its backup then covers every item since.
    actions.clear();
    for offset in 12..16 {
        one_item(&mut c, offset, 0, 12.0, 0, &mut actions);
    }
    assert_eq!(
        backups(&actions),
        vec![(6, BackupScope::Drifted), (8, BackupScope::Drifted)]
    );
    actions.clear();
    c.backup_written(2, &mut actions);
    assert_eq!(backups(&actions), vec![(10, BackupScope::Drifted)]);
    assert_eq!(markers(&actions)[0].input_offset, 16);
}

#[test]
fn backs_up_every_half_l_items() {
    // L = 40 → l = 20, a backup every 10 items.
    let mut c = running(config(Mode::Approximate, 1e9, 40, 100));
    let mut actions = Vec::new();
    for offset in 0..9 {
        one_item(&mut c, offset, 0, 0.0, 0, &mut actions);
    }
    assert!(backups(&actions).is_empty());
    one_item(&mut c, 9, 0, 0.0, 0, &mut actions);
    let [(seq, _)] = backups(&actions)[..] else {
        panic!("{actions:?}")
    };
    complete_backup(&mut c, seq);
    // The next one comes ⌈l/2⌉ items after this one, not sooner.
    actions.clear();
    for offset in 10..19 {
        one_item(&mut c, offset, 0, 0.0, 0, &mut actions);
    }
    assert!(backups(&actions).is_empty(), "{actions:?}");
    one_item(&mut c, 19, 0, 0.0, 0, &mut actions);
    assert_eq!(backups(&actions).len(), 1);
}

#[test]
fn a_backup_for_l_goes_out_when_the_run_ends_and_covers_all_of_it() {
    // L = 40 → l = 20, a backup every 10 items; one run of 35 items.
    let mut c = running(config(Mode::Approximate, 1e9, 40, 100));
    let mut actions = Vec::new();
    for offset in 0..35 {
        c.item_processed(offset, 0, 0.0, 0, &mut actions);
    }
    assert!(backups(&actions).is_empty(), "nothing mid-run: {actions:?}");
    c.run_ended(&mut actions);
    let [(seq, BackupScope::Owed)] = backups(&actions)[..] else {
        panic!("one owed-only backup for the run: {actions:?}")
    };
    complete_backup(&mut c, seq);
    assert_eq!(c.marked().offset, 35, "its marker covers the whole run");
    // A run shorter than ⌈l/2⌉ owes no backup.
    actions.clear();
    for offset in 35..44 {
        c.item_processed(offset, 0, 0.0, 0, &mut actions);
    }
    c.run_ended(&mut actions);
    assert!(backups(&actions).is_empty(), "{actions:?}");
    // A θ trigger does not wait for the end of the run.
    c.item_processed(44, 0, 2e9, 0, &mut actions);
    assert_eq!(backups(&actions)[..], [(seq + 2, BackupScope::Drifted)], "{actions:?}");
}

#[test]
fn a_backup_for_l_within_theta_writes_only_what_is_owed_and_a_later_theta_trigger_widens_it() {
    // Θ = 20 → θ = 10; L = 40 → l = 20, a backup every 10 items.
    let mut c = running(config(Mode::Approximate, 20.0, 40, 100));
    let mut actions = Vec::new();
    for offset in 0..10 {
        one_item(&mut c, offset, 0, 5.0, 0, &mut actions);
    }
    let [(seq, BackupScope::Owed)] = backups(&actions)[..] else {
        panic!("l with the divergence (5) within θ (10) moves only the marker: {actions:?}")
    };
    complete_backup(&mut c, seq);
    actions.clear();
    for offset in 10..20 {
        one_item(&mut c, offset, 0, 5.0, 0, &mut actions);
    }
    let [(open, BackupScope::Owed)] = backups(&actions)[..] else {
        panic!("{actions:?}")
    };
    // Backups for l do not wait for the one in flight.
    actions.clear();
    for offset in 20..40 {
        one_item(&mut c, offset, 0, 5.0, 0, &mut actions);
    }
    assert_eq!(
        backups(&actions)[..],
        [(open + 2, BackupScope::Owed), (open + 4, BackupScope::Owed)],
        "{actions:?}"
    );
    // With four in flight, l comes due within θ, θ is crossed, then l again:
    // the backup that waited for one to close writes the drift.
    one_item(&mut c, 40, 0, 11.0, 0, &mut actions);
    actions.clear();
    for offset in 41..51 {
        one_item(&mut c, offset, 0, 5.0, 0, &mut actions);
    }
    one_item(&mut c, 51, 0, 11.0, 0, &mut actions);
    for offset in 52..62 {
        one_item(&mut c, offset, 0, 5.0, 0, &mut actions);
    }
    assert!(backups(&actions).is_empty(), "four in flight: {actions:?}");
    c.backup_written(open, &mut actions);
    assert_eq!(backups(&actions)[..], [(open + 8, BackupScope::Drifted)], "{actions:?}");
}

#[test]
fn a_marker_waits_for_its_entries_and_the_outputs_before_it_then_commits() {
    let mut c = running(config(Mode::Approximate, 20.0, 1000, 100));
    let mut actions = Vec::new();
    one_item(&mut c, 0, 2, 1.0, 0, &mut actions);
    one_item(&mut c, 1, 0, 11.0, 0, &mut actions);
    let [(seq, _)] = backups(&actions)[..] else {
        panic!("{actions:?}")
    };
    one_item(&mut c, 2, 1, 11.0, 0, &mut actions);
    assert!(markers(&actions).is_empty(), "item 0's outputs are not acknowledged");
    actions.clear();
    c.outputs_acknowledged(0, 1, &mut actions);
    assert!(markers(&actions).is_empty(), "one of its two outputs is still out");
    c.outputs_acknowledged(0, 1, &mut actions);
    let written = markers(&actions);
    assert_eq!(
        written.len(),
        1,
        "item 2's output is after the marker and does not hold it"
    );
    assert_eq!(written[0].input_offset, 2);
    assert!(!written[0].clean);
    // Acknowledged before its entries, the marker does not count yet.
    c.marker_written(written[0].seq, &mut actions);
    assert!(
        commits(&actions).is_empty(),
        "the commit follows the acknowledged marker and entries"
    );
    assert_eq!(c.marked().offset, 0);
    c.backup_written(seq, &mut actions);
    assert_eq!(commits(&actions), vec![2]);
    assert_eq!(c.marked().offset, 2);
}

#[test]
fn input_never_waits_for_a_marker() {
    let mut c = running(config(Mode::Approximate, 1e9, 16, 100));
    // l = 8: a backup for l every 4 items; nothing is ever acknowledged.
    let mut actions = Vec::new();
    for offset in 0..200 {
        assert_eq!(c.readiness(), Ok(()), "item {offset}: input never waits for a marker");
        one_item(&mut c, offset, 0, 0.0, 0, &mut actions);
        c.run_ended(&mut actions);
    }
    assert_eq!(c.items_past_marker(), 200);
    // The backups in flight are capped; each marker covers its own backup.
    let issued = markers(&actions);
    assert_eq!(issued.len(), DEFAULT_MAX_BACKUPS_IN_FLIGHT, "{issued:?}");
    let offsets: Vec<u64> = issued.iter().map(|m| m.input_offset).collect();
    assert_eq!(offsets, vec![4, 8, 12, 16]);
    let covers: Vec<u64> = issued.iter().map(|m| m.covers).collect();
    assert!(covers.windows(2).all(|w| w[0] < w[1]), "{covers:?}");
    // One closes: the next covers every item since.
    let actions = complete_backup(&mut c, backups(&actions)[0].0);
    assert_eq!(
        markers(&actions).iter().map(|m| m.input_offset).collect::<Vec<_>>(),
        vec![200]
    );
}

#[test]
fn input_waits_at_gamma_unacknowledged_outputs() {
    // Γ = 8 → γ = 4, β = 1.
    let mut c = running(config(Mode::Approximate, 1e9, 1000, 8));
    let mut actions = Vec::new();
    for offset in 0..4 {
        assert_eq!(c.readiness(), Ok(()));
        one_item(&mut c, offset, 1, 0.0, 0, &mut actions);
    }
    assert_eq!(c.readiness(), Err(Blocked::Outputs));
    c.count_stall(Blocked::Outputs);
    c.count_stall(Blocked::Outputs);
    assert_eq!(
        (c.stalls(), c.stalls_for_outputs()),
        (2, 2),
        "stalls for γ count as such"
    );
    c.outputs_acknowledged(2, 1, &mut actions);
    assert_eq!(c.readiness(), Ok(()));
}

#[test]
fn a_failed_backup_is_issued_again_at_once() {
    let mut c = running(config(Mode::Approximate, 20.0, 1000, 100));
    let mut actions = Vec::new();
    one_item(&mut c, 0, 0, 11.0, 0, &mut actions);
    let [(seq, _)] = backups(&actions)[..] else {
        panic!("{actions:?}")
    };
    let failed_marker = markers(&actions)[0].clone();
    // A second backup in flight behind it, and a third taken but held back by
    // an output.
    one_item(&mut c, 1, 0, 12.0, 0, &mut actions);
    let (behind, _) = backups(&actions)[1];
    let behind_marker = markers(&actions)[1].clone();
    one_item(&mut c, 2, 1, 0.0, 0, &mut actions);
    one_item(&mut c, 3, 0, 12.0, 0, &mut actions);
    let (held, _) = backups(&actions)[2];
    assert!(!actions.contains(&Action::SendBackup { seq: held }), "{actions:?}");
    actions.clear();
    c.backup_failed(seq, &mut actions);
    assert_eq!(
        actions,
        vec![Action::AbandonBackup { seq: held }],
        "the held backup was measured from the failed one: abandoned, and nothing goes out while a write is in flight"
    );
    actions.clear();
    one_item(&mut c, 4, 0, 20.0, 0, &mut actions);
    assert!(backups(&actions).is_empty(), "{actions:?}");
    // The gapless log fails the write behind it too; then a new backup goes out.
    c.backup_failed(behind, &mut actions);
    let again = backups(&actions);
    assert_eq!(again.len(), 1, "{actions:?}");
    c.outputs_acknowledged(2, 1, &mut actions);
    assert_eq!(
        markers(&actions)[0].input_offset,
        5,
        "the new backup covers what it sees now"
    );
    // The marker behind the failed entries never counts, even if acknowledged.
    actions.clear();
    c.marker_written(failed_marker.seq, &mut actions);
    assert!(actions.is_empty(), "{actions:?}");
    assert_eq!(c.marked().offset, 0);
    // Nor does its failure: the new backup already covers its items.
    c.marker_failed(failed_marker.seq, &mut actions);
    assert!(actions.is_empty(), "{actions:?}");
    // A late acknowledgement of the failed backup changes nothing.
    c.backup_written(seq, &mut actions);
    assert!(actions.is_empty());
    let after = complete_backup(&mut c, again[0].0);
    assert!(backups(&after).is_empty(), "nothing is owed any more: {after:?}");
    assert_eq!(c.marked().offset, 5);
    // The gapless log fails the marker behind the second failed backup too:
    // forgotten with its backup.
    let mut actions = Vec::new();
    c.marker_failed(behind_marker.seq, &mut actions);
    assert!(actions.is_empty(), "{actions:?}");
}

#[test]
fn a_failed_backup_leaves_the_older_one_in_flight_and_its_marker_to_count() {
    let mut c = running(config(Mode::Approximate, 20.0, 1000, 100));
    let mut actions = Vec::new();
    one_item(&mut c, 0, 0, 11.0, 0, &mut actions);
    one_item(&mut c, 1, 0, 12.0, 0, &mut actions);
    let [(older, _), (newer, _)] = backups(&actions)[..] else {
        panic!("two backups in flight: {actions:?}")
    };
    let covered = markers(&actions)[0].input_offset;
    actions.clear();
    c.backup_failed(newer, &mut actions);
    let after = complete_backup(&mut c, older);
    assert_eq!(
        commits(&after),
        [covered],
        "the older backup and its marker landed: the recovery point moves to it ({after:?})"
    );
    assert_eq!(c.marked().offset, covered);
}

#[test]
fn a_failed_marker_is_covered_by_a_new_backup() {
    let mut c = running(config(Mode::Approximate, 20.0, 1000, 100));
    let mut actions = Vec::new();
    one_item(&mut c, 0, 0, 11.0, 0, &mut actions);
    let seq = backups(&actions)[0].0;
    let marker = markers(&actions)[0].clone();
    actions.clear();
    c.backup_written(seq, &mut actions);
    assert!(backups(&actions).is_empty(), "{actions:?}");
    c.marker_failed(marker.seq, &mut actions);
    assert_eq!(backups(&actions).len(), 1, "{actions:?}");
    assert_eq!(c.marked().offset, 0, "the recovery point did not move");
}

#[test]
fn a_marker_that_fails_while_a_backup_is_open_waits_for_it() {
    let mut c = running(config(Mode::Approximate, 20.0, 1000, 100));
    let mut actions = Vec::new();
    one_item(&mut c, 0, 0, 11.0, 0, &mut actions);
    let first = backups(&actions)[0].0;
    let marker = markers(&actions)[0].clone();
    actions.clear();
    c.backup_written(first, &mut actions);
    one_item(&mut c, 1, 0, 11.0, 0, &mut actions);
    let second = backups(&actions)[0].0;
    assert_eq!(markers(&actions)[0].input_offset, 2);
    actions.clear();
    c.marker_failed(marker.seq, &mut actions);
    assert!(backups(&actions).is_empty(), "one backup open at a time: {actions:?}");
    c.backup_written(second, &mut actions);
    assert_eq!(
        backups(&actions).len(),
        1,
        "the new backup follows the open one's entries"
    );
}

#[test]
fn exact_mode_backs_up_completely_every_interval() {
    let mode = exact_every_items(3);
    let mut c = running(config(mode, 1.0, 1, 100));
    assert_eq!(c.operator_theta(), f64::INFINITY, "exact backups are never partial");
    let mut actions = Vec::new();
    one_item(&mut c, 0, 1, 0.0, 0, &mut actions);
    one_item(&mut c, 1, 0, 0.0, 0, &mut actions);
    assert!(backups(&actions).is_empty());
    one_item(&mut c, 2, 0, 0.0, 0, &mut actions);
    let [(seq, BackupScope::Complete)] = backups(&actions)[..] else {
        panic!("{actions:?}")
    };
    assert!(
        markers(&actions).is_empty() && !actions.contains(&Action::SendBackup { seq }),
        "item 0's output first: {actions:?}"
    );
    actions.clear();
    one_item(&mut c, 3, 0, 0.0, 0, &mut actions);
    one_item(&mut c, 4, 0, 0.0, 0, &mut actions);
    one_item(&mut c, 5, 0, 0.0, 0, &mut actions);
    let [(next, BackupScope::Complete)] = backups(&actions)[..] else {
        panic!("the next interval's backup is complete too, taken now: {actions:?}")
    };
    assert!(markers(&actions).is_empty(), "both wait for item 0's output");
    c.outputs_acknowledged(0, 1, &mut actions);
    let sent: Vec<&Action> = actions
        .iter()
        .filter(|a| matches!(a, Action::SendBackup { .. }))
        .collect();
    assert_eq!(
        sent,
        [&Action::SendBackup { seq }, &Action::SendBackup { seq: next }],
        "in the order taken"
    );
    let covered: Vec<u64> = markers(&actions).iter().map(|m| m.input_offset).collect();
    assert_eq!(covered, [3, 6], "each right behind its entries");
    assert_eq!(c.thresholds().max_uncovered, 6, "the window is two intervals");
}

#[test]
fn exact_mode_backs_up_on_time_too() {
    let mode = Mode::Exact(ExactInterval {
        items: None,
        millis: Some(100),
    });
    let mut c = running(config(mode, 1.0, 1, 100));
    let mut actions = Vec::new();
    c.tick(150, &mut actions);
    assert!(backups(&actions).is_empty(), "no items, nothing to back up");
    one_item(&mut c, 0, 0, 0.0, 160, &mut actions);
    assert_eq!(backups(&actions).len(), 1, "the interval had passed");
    let seq = backups(&actions)[0].0;
    complete_backup(&mut c, seq);
    actions.clear();
    one_item(&mut c, 1, 0, 0.0, 170, &mut actions);
    c.tick(200, &mut actions);
    assert!(backups(&actions).is_empty(), "40 ms since the last interval began");
    c.tick(260, &mut actions);
    assert_eq!(backups(&actions).len(), 1);
}

#[test]
fn mode_none_writes_nothing_and_commits_at_a_clean_stop() {
    let mut c = running(config(Mode::None, 1.0, 1, 1));
    let mut actions = Vec::new();
    for offset in 0..100 {
        assert_eq!(c.readiness(), Ok(()));
        one_item(&mut c, offset, 1, 1e9, 0, &mut actions);
    }
    assert!(actions.is_empty());
    c.begin_stop(&mut actions);
    assert!(actions.is_empty(), "waits for outputs first");
    for offset in 0..100 {
        c.outputs_acknowledged(offset, 1, &mut actions);
    }
    assert_eq!(commits(&actions), vec![100]);
    assert!(c.is_stopped());
}

#[test]
fn a_clean_stop_takes_a_complete_backup_and_a_clean_marker() {
    let mut c = running(config(Mode::Approximate, 100.0, 1000, 100));
    let mut actions = Vec::new();
    for offset in 0..5 {
        one_item(&mut c, offset, 0, 1.0, 0, &mut actions);
    }
    actions.clear();
    c.begin_stop(&mut actions);
    assert_eq!(c.readiness(), Err(Blocked::Stopping));
    let [(seq, BackupScope::Complete)] = backups(&actions)[..] else {
        panic!("{actions:?}")
    };
    let marker = markers(&actions)[0].clone();
    assert!(marker.clean);
    assert_eq!(marker.input_offset, 5);
    actions.clear();
    c.backup_written(seq, &mut actions);
    assert!(!c.is_stopped());
    // A failed final marker is taken again.
    actions.clear();
    c.marker_failed(marker.seq, &mut actions);
    let [(seq, BackupScope::Complete)] = backups(&actions)[..] else {
        panic!("{actions:?}")
    };
    let actions = complete_backup(&mut c, seq);
    assert_eq!(commits(&actions), vec![5]);
    assert!(c.is_stopped());
}

#[test]
fn a_clean_stop_waits_for_the_backup_in_flight_before_its_own() {
    let mut c = running(config(Mode::Approximate, 2.0, 1000, 100));
    let mut actions = Vec::new();
    one_item(&mut c, 0, 0, 5.0, 0, &mut actions);
    let [(open, BackupScope::Drifted)] = backups(&actions)[..] else {
        panic!("over θ: a backup {actions:?}")
    };
    actions.clear();
    c.begin_stop(&mut actions);
    assert!(
        backups(&actions).is_empty(),
        "backup {open} is in flight: the final one waits for it ({actions:?})"
    );
    let actions = complete_backup(&mut c, open);
    assert!(
        !c.is_stopped(),
        "the marker of the backup before the final one is not clean"
    );
    let [(last, BackupScope::Complete)] = backups(&actions)[..] else {
        panic!("then the final complete backup: {actions:?}")
    };
    complete_backup(&mut c, last);
    assert!(c.is_stopped(), "its clean marker stops the task");
}

#[test]
fn a_failure_reported_for_a_backup_never_sent_changes_nothing() {
    // Two backups in flight (θ = 1 after halving), a third held back by an output.
    let mut c = running(config(Mode::Approximate, 2.0, 1000, 100));
    let mut actions = Vec::new();
    one_item(&mut c, 0, 0, 5.0, 0, &mut actions);
    one_item(&mut c, 1, 1, 5.0, 0, &mut actions);
    one_item(&mut c, 2, 0, 5.0, 0, &mut actions);
    let issued = backups(&actions);
    let held = issued.last().expect("a held backup").0;
    assert!(!actions.contains(&Action::SendBackup { seq: held }), "{actions:?}");
    actions.clear();
    c.backup_failed(held, &mut actions);
    assert!(actions.is_empty(), "not sent, so not failed: {actions:?}");
    // The first backup completes as if nothing happened.
    complete_backup(&mut c, issued[0].0);
    assert_eq!(c.marked().offset, 1);
}

#[test]
fn a_recovery_writes_its_failure_count_before_taking_input() {
    let config = config(Mode::Approximate, 100.0, 1000, 100);
    let plan = RecoveryPlan {
        resume_offset: 40,
        failures: 3,
        counted_failure: true,
        introduced: Default::default(),
        source: ResumeSource::Marker,
        recent: Default::default(),
        covers: 9,
        next_seq: 12,
        sources: Default::default(),
        priors: Default::default(),
        fence: afstream_core::Fence::NONE,
    };
    let mut actions = Vec::new();
    let mut c = TaskController::start(config, &plan, false, 0, &mut actions).unwrap();
    assert_eq!(c.readiness(), Err(Blocked::StartMarker));
    let [marker] = &markers(&actions)[..] else {
        panic!("expected the start marker, got {actions:?}")
    };
    assert_eq!(marker.failures, 3);
    assert_eq!(marker.input_offset, 40);
    assert_eq!(
        (marker.seq, marker.covers, marker.inherited),
        (12, 9, 9),
        "sequences continue; the marker covers what the last did, and its incarnation inherited that"
    );
    assert!(!marker.clean, "a run's first marker is never clean");
    assert_eq!(c.thresholds().theta, 100.0 / 16.0, "Θ/2^(k+1) with k = 3");
    actions.clear();
    c.marker_failed(marker.seq, &mut actions);
    let [again] = &markers(&actions)[..] else {
        panic!("a failed start marker is sent again: {actions:?}")
    };
    c.marker_written(again.seq, &mut actions);
    assert_eq!(c.readiness(), Ok(()));
    assert_eq!(c.processed().offset, 40);
}

#[test]
fn under_the_recovering_policy_thresholds_come_back_after_the_window() {
    let global = GlobalThresholds::new(64.0, 64, 64).unwrap();
    let policy = ThresholdPolicy::new(
        global,
        FailurePolicy::Recovering { window_items: 100 },
        Placement::default(),
        Norm::L1,
        CONSTANTS,
    )
    .unwrap();
    let config = ControllerConfig::new(Mode::Approximate, policy, CONSTANTS);
    // Two failures, resumed at offsets 10 and 50; this start is the second.
    let marker = BackupMarker {
        seq: 4,
        input_offset: 50,
        failures: 1,
        thresholds: policy.for_failures(1),
        clean: false,
        recent: {
            let mut recent = afstream_core::RecentFailures::default();
            recent.push(10);
            recent
        },
        writer: 0,
        covers: 3,
        sources: Default::default(),
        inherited: u64::MAX,
    };
    let plan = RecoveryPlan::decide(Mode::Approximate, Some(&marker), None, 0, CONSTANTS);
    assert_eq!(plan.recent.as_slice(), &[10, 50]);
    let mut actions = Vec::new();
    let mut c = TaskController::start(config, &plan, false, 0, &mut actions).unwrap();
    assert_eq!(c.thresholds().theta, 64.0 / 8.0, "two failures count");
    assert_eq!(
        markers(&actions)[0].recent.as_slice(),
        &[10, 50],
        "the start marker carries them"
    );
    let start = markers(&actions)[0].seq;
    c.marker_written(start, &mut actions);
    actions.clear();
    for offset in 50..109 {
        one_item(&mut c, offset, 0, 0.0, 0, &mut actions);
        let seqs: Vec<u64> = backups(&actions).iter().map(|b| b.0).collect();
        for seq in seqs {
            complete_backup(&mut c, seq);
        }
        actions.clear();
    }
    assert_eq!(c.thresholds().theta, 64.0 / 8.0);
    one_item(&mut c, 109, 0, 0.0, 0, &mut actions);
    assert_eq!(
        c.thresholds().theta,
        64.0 / 4.0,
        "the failure at 10 stopped counting at 110"
    );
    assert!(
        actions.iter().any(|a| matches!(a, Action::Thresholds(_))),
        "{actions:?}"
    );
    assert_eq!(c.failures(), 2, "the total still counts both");
}

#[test]
fn invalid_exact_interval_is_an_error() {
    let bad = Mode::Exact(ExactInterval {
        items: None,
        millis: None,
    });
    let mut actions = Vec::new();
    let err =
        TaskController::start(config(bad, 1.0, 1, 1), &RecoveryPlan::fresh(0), false, 0, &mut actions).unwrap_err();
    assert!(err.to_string().contains("exact interval"), "{err}");
}

#[test]
fn the_state_a_task_reports() {
    // Θ = 20, L = 40, Γ = 100 → θ = 10, l = 20, γ = 50; α = 1, β = 1.
    let mut c = running(config(Mode::Approximate, 20.0, 40, 100));
    let mut actions = Vec::new();
    assert!(!c.backup_open());
    one_item(&mut c, 0, 2, 11.0, 0, &mut actions);
    assert_eq!(c.unacknowledged_outputs(), 2);
    assert!(c.backup_open(), "θ crossed: a backup's entries are on their way");
    let seq = backups(&actions)[0].0;
    c.outputs_acknowledged(0, 2, &mut actions);
    assert_eq!(c.unacknowledged_outputs(), 0);
    complete_backup(&mut c, seq);
    assert!(!c.backup_open());
    let bound = c.recovery_bound().expect("approximate mode has a bound");
    assert_eq!(bound.state, 10.0, "θ alone: a replay from the marker is exact");
    assert_eq!(bound.outputs, 20.0 * 1.0, "the outputs of l replayed items, l·β");
    assert_eq!(c.operator_theta(), 10.0);
    let none = running(config(Mode::None, 20.0, 40, 100));
    assert_eq!(none.recovery_bound(), None, "mode none claims no bound");
    assert_eq!(none.operator_theta(), f64::INFINITY);
}

#[test]
fn a_backups_entries_go_out_only_after_the_outputs_it_covers_are_acknowledged() {
    // Θ = 20 → θ = 10; each item makes one output.
    let mut c = running(config(Mode::Approximate, 20.0, 1000, 100));
    let mut actions = Vec::new();
    one_item(&mut c, 0, 1, 5.0, 0, &mut actions);
    one_item(&mut c, 1, 1, 11.0, 0, &mut actions);
    let issued = backups(&actions);
    assert_eq!(issued.len(), 1, "θ crossed: {actions:?}");
    let seq = issued[0].0;
    let sent = |actions: &[Action]| actions.contains(&Action::SendBackup { seq });
    assert!(
        !sent(&actions),
        "the outputs of items 0 and 1 are in flight: {actions:?}"
    );
    actions.clear();
    c.outputs_acknowledged(0, 1, &mut actions);
    assert!(!sent(&actions), "item 1's output is still in flight: {actions:?}");
    // An item after the backup does not hold it back.
    one_item(&mut c, 2, 1, 12.0, 0, &mut actions);
    c.outputs_acknowledged(1, 1, &mut actions);
    assert!(
        sent(&actions),
        "every output the backup covers is acknowledged: {actions:?}"
    );
    assert_eq!(
        markers(&actions).len(),
        1,
        "the marker goes right behind the entries: {actions:?}"
    );
    let marker = markers(&actions)[0].seq;
    actions.clear();
    c.backup_written(seq, &mut actions);
    c.marker_written(marker, &mut actions);
    assert_eq!(commits(&actions), vec![2], "the marker covers items 0 and 1");
}

#[test]
fn an_acknowledgement_of_a_marker_never_written_changes_nothing() {
    // A report meant for an earlier task on the same partition (its marker 35)
    // reaches the new task, whose start marker is still in flight.
    let config = config(Mode::Approximate, 100.0, 1000, 100);
    let mut actions = Vec::new();
    let mut c = TaskController::start(config, &first_start(), false, 0, &mut actions).unwrap();
    let [start] = &markers(&actions)[..] else {
        panic!("expected the start marker, got {actions:?}")
    };
    actions.clear();
    c.marker_written(start.seq + 35, &mut actions);
    assert!(actions.is_empty(), "{actions:?}");
    assert_eq!(c.readiness(), Err(Blocked::StartMarker));
    c.marker_written(start.seq, &mut actions);
    assert_eq!(
        c.readiness(),
        Ok(()),
        "the start marker's own acknowledgement still counts"
    );
}

#[test]
fn one_backup_in_flight_when_so_configured_makes_a_trigger_wait_for_it() {
    let config = config(Mode::Approximate, 20.0, 1000, 100).with_max_backups_in_flight(1);
    let mut c = running(config);
    let mut actions = Vec::new();
    one_item(&mut c, 0, 0, 11.0, 0, &mut actions);
    let [(seq, BackupScope::Drifted)] = backups(&actions)[..] else {
        panic!("{actions:?}")
    };
    actions.clear();
    one_item(&mut c, 1, 0, 12.0, 0, &mut actions);
    assert!(backups(&actions).is_empty(), "one in flight: {actions:?}");
    c.backup_written(seq, &mut actions);
    assert_eq!(backups(&actions), vec![(seq + 2, BackupScope::Drifted)]);
    assert_eq!(markers(&actions)[0].input_offset, 2, "it covers the item that waited");
}

#[test]
fn a_state_change_outside_the_input_past_theta_backs_up_at_once_and_one_within_it_waits() {
    let mut c = running(config(Mode::Approximate, 10.0, 1000, 100));
    let theta = c.thresholds().theta;
    let mut actions = Vec::new();
    c.state_changed(theta, &mut actions);
    assert!(
        backups(&actions).is_empty(),
        "at θ the divergence is within the bound: {actions:?}"
    );
    c.state_changed(theta * 1.01, &mut actions);
    let scopes: Vec<BackupScope> = backups(&actions).into_iter().map(|(_, scope)| scope).collect();
    assert_eq!(scopes, [BackupScope::Drifted], "past θ: the drifted entries, at once");
    assert_eq!(c.items_past_marker(), 0, "no item was read");

    // Exact mode backs up on its interval, whatever the divergence.
    let mode = exact_every_items(3);
    let mut exact = running(config(mode, 10.0, 1000, 100));
    let mut actions = Vec::new();
    exact.state_changed(1e9, &mut actions);
    assert!(backups(&actions).is_empty(), "{actions:?}");
}

#[test]
fn a_failed_exact_backup_is_written_again_complete_at_once() {
    let mode = exact_every_items(3);
    let mut c = running(config(mode, 1.0, 1000, 100));
    let mut actions = Vec::new();
    for offset in 0..3 {
        one_item(&mut c, offset, 0, 0.0, 0, &mut actions);
    }
    let [(seq, BackupScope::Complete)] = backups(&actions)[..] else {
        panic!("one complete backup after the interval's 3 items: {actions:?}")
    };
    actions.clear();
    c.backup_failed(seq, &mut actions);
    let again: Vec<BackupScope> = backups(&actions).into_iter().map(|(_, scope)| scope).collect();
    assert_eq!(
        again,
        [BackupScope::Complete],
        "without waiting for another item, and complete as exact mode's backups are"
    );
    // Its entries land but its marker does not: a new complete backup again.
    let (seq, _) = backups(&actions)[0];
    let marker = markers(&actions)[0].clone();
    actions.clear();
    c.backup_written(seq, &mut actions);
    c.marker_failed(marker.seq, &mut actions);
    let again: Vec<BackupScope> = backups(&actions).into_iter().map(|(_, scope)| scope).collect();
    assert_eq!(again, [BackupScope::Complete], "{actions:?}");
}

/// A first start whose sequences count from 1 (incarnation 0), so that the
/// tests read them plainly; a real first start is incarnation 1.
fn first_start() -> RecoveryPlan {
    RecoveryPlan {
        next_seq: 1,
        ..RecoveryPlan::fresh(0)
    }
}
