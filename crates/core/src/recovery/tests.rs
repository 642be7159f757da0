//! Tests of `recovery`.

use super::*;
use crate::entry::versioned;
use crate::fence::next_incarnation;
use crate::sources::SourcePosition;

#[test]
fn a_local_restart_is_exact_and_counts_as_a_failure_unless_clean() {
    let at = |next_offset| StoreCheckpoint {
        next_offset,
        ..StoreCheckpoint::default()
    };
    let writes = StoreWrites {
        max_unwritten_items: 500,
        largest_gamma: 64,
    };
    let beta = AnalysisConstants { alpha: 1.0, beta: 3 };
    let local = |at: &StoreCheckpoint, marker: Option<&BackupMarker>| RecoveryPlan::local(at, marker, writes, beta);
    let crashed = local(&at(1500), Some(&marker(false)));
    assert_eq!(crashed.resume_offset, 1500);
    assert_eq!(crashed.failures, 3);
    assert!(crashed.counted_failure);
    assert_eq!(
        crashed.introduced,
        ErrorBound {
            state: 0.0,
            outputs: 1500.0,
            lost_outputs: 64.0,
        },
        "the unwritten items' outputs repeated (500 items, 3 each), γ lost"
    );
    assert_eq!(crashed.source, ResumeSource::LocalStore);
    assert_eq!(crashed.recent.as_slice(), &[1500]);
    let stopped = local(&at(1000), Some(&marker(true)));
    assert!(!stopped.counted_failure);
    assert_eq!(stopped.failures, 2);
    assert_eq!(stopped.introduced, ErrorBound::default());
    let moved_on = local(&at(1200), Some(&marker(true)));
    assert!(
        moved_on.counted_failure,
        "items after the clean stop were processed, then a crash"
    );
    assert_eq!(local(&at(0), None).failures, 1);
    let checkpoint = StoreCheckpoint {
        next_offset: 5,
        next_seq: 40,
        sources: marker(false).sources,
        priors: CrashPriors::default(),
    };
    let plan = local(&checkpoint, Some(&marker(false)));
    assert_eq!(
        plan.sources, checkpoint.sources,
        "a local restart resumes with the store's positions"
    );
    assert_eq!(
        plan.next_seq,
        next_incarnation(39),
        "a new incarnation, above every record the store let out"
    );
    assert_eq!(crashed.next_seq, next_incarnation(7), "above the marker's");
    assert_eq!(crashed.inherited(), u64::MAX, "the store holds every key the log wrote");
}

fn marker(clean: bool) -> BackupMarker {
    BackupMarker {
        seq: 7,
        input_offset: 1000,
        failures: 2,
        thresholds: TaskThresholds {
            theta: 12.5,
            max_uncovered: 100,
            max_unacked: 50,
        },
        clean,
        recent: RecentFailures::default(),
        writer: 0xfeed_beef,
        covers: 6,
        sources: {
            let mut sources = SourcePositions::default();
            sources.advance(SourcePosition {
                source: 11,
                offset: 400,
                index: 2,
            });
            sources.advance(SourcePosition {
                source: 3,
                offset: 90,
                index: 0,
            });
            sources
        },
        inherited: 4,
    }
}

#[test]
fn a_marker_carries_its_source_positions_to_the_plan() {
    let plan = RecoveryPlan::decide(Mode::Approximate, Some(&marker(false)), None, 0, C);
    assert_eq!(plan.sources, marker(false).sources);
    assert_eq!(plan.sources.as_slice().len(), 2);
    let clean = RecoveryPlan::decide(Mode::Approximate, Some(&marker(true)), None, 0, C);
    assert_eq!(clean.sources, marker(true).sources);
    let none = RecoveryPlan::decide(Mode::None, Some(&marker(false)), Some(5), 0, C);
    assert!(
        none.sources.is_empty(),
        "mode none resumes from the commit, with no table"
    );
}

#[test]
fn older_markers_read_without_a_writer_or_what_they_cover() {
    let mut entry = marker(false).to_entry();
    let value = entry.value.as_mut().unwrap();
    let without_inherited = value.len() - 8;
    value.truncate(without_inherited);
    assert_eq!(
        BackupMarker {
            inherited: u64::MAX,
            ..marker(false)
        },
        BackupMarker::from_entry(&entry).unwrap(),
        "written before incarnations: it inherited every earlier backup"
    );
    let value = entry.value.as_mut().unwrap();
    let without_positions = value.len() - 4 - 2 * 20;
    value.truncate(without_positions);
    let decoded = BackupMarker::from_entry(&entry).unwrap();
    assert_eq!(
        BackupMarker {
            sources: SourcePositions::default(),
            inherited: u64::MAX,
            ..marker(false)
        },
        decoded,
        "written before source positions: an empty table"
    );
    let value = entry.value.as_mut().unwrap();
    let shorter = value.len() - 8;
    value.truncate(shorter);
    let decoded = BackupMarker::from_entry(&entry).unwrap();
    assert_eq!(
        BackupMarker {
            covers: u64::MAX,
            sources: SourcePositions::default(),
            inherited: u64::MAX,
            ..marker(false)
        },
        decoded,
        "written before priors: it covers every entry"
    );
    let value = entry.value.as_mut().unwrap();
    let shorter = value.len() - 8;
    value.truncate(shorter);
    let decoded = BackupMarker::from_entry(&entry).unwrap();
    assert_eq!(decoded.writer, 0);
    assert_eq!(
        BackupMarker {
            writer: 0,
            covers: u64::MAX,
            sources: SourcePositions::default(),
            inherited: u64::MAX,
            ..marker(false)
        },
        decoded
    );
    assert_eq!(
        BackupMarker::from_entry(&marker(false).to_entry()).unwrap().writer,
        0xfeed_beef
    );
}

const C: AnalysisConstants = AnalysisConstants { alpha: 2.0, beta: 1 };

fn entry(key: &[u8], value: Option<&[u8]>) -> BackupEntry {
    BackupEntry::new(entry_key(1, key), value.map(versioned))
}

#[test]
fn recent_failures_keep_the_latest_and_forget_the_expired() {
    let mut recent = RecentFailures::default();
    for offset in 0..(RECENT_FAILURES as u64 + 3) {
        recent.push(offset * 10);
    }
    assert_eq!(recent.as_slice().len(), RECENT_FAILURES);
    assert_eq!(recent.as_slice()[0], 30, "the oldest went");
    recent.retain_counted(FailurePolicy::Recovering { window_items: 50 }, 170);
    assert_eq!(recent.as_slice(), &[130, 140, 150, 160, 170, 180]);
    recent.retain_counted(FailurePolicy::Halving, 10_000);
    assert_eq!(recent.as_slice().len(), 6, "only the recovering policy forgets");
}

#[test]
fn marker_round_trips_and_rejects_garbage() {
    let mut m = marker(true);
    m.recent.push(12);
    m.recent.push(99);
    assert_eq!(BackupMarker::from_entry(&m.to_entry()).unwrap(), m);
    for offset in 0..RECENT_FAILURES as u64 {
        m.recent.push(offset);
    }
    assert_eq!(
        BackupMarker::from_entry(&m.to_entry()).unwrap(),
        m,
        "a full list reads back"
    );
    let m = marker(true);
    assert_eq!(BackupMarker::from_entry(&m.to_entry()).unwrap(), m);
    let mut entry = m.to_entry();
    entry.value.as_mut().unwrap().pop();
    assert!(BackupMarker::from_entry(&entry).is_err());
    let mut entry = m.to_entry();
    entry.value.as_mut().unwrap()[0] = 2;
    assert!(matches!(
        BackupMarker::from_entry(&entry),
        Err(CoreError::UnknownEncodingVersion { found: 2, .. })
    ));
    let mut entry = m.to_entry();
    entry.value.as_mut().unwrap()[45] = 7;
    assert!(matches!(
        BackupMarker::from_entry(&entry),
        Err(CoreError::Undecodable { .. })
    ));
    let mut entry = m.to_entry();
    entry.value.as_mut().unwrap()[46] = 200;
    assert!(matches!(
        BackupMarker::from_entry(&entry),
        Err(CoreError::Undecodable { .. })
    ));
    assert!(BackupMarker::from_entry(&BackupEntry::new(BackupMarker::key(), None)).is_err());
}

#[test]
fn the_reader_keeps_the_latest_record_per_key_and_the_last_marker() {
    let first = BackupMarker {
        seq: 1,
        input_offset: 10,
        ..marker(false)
    };
    let second = BackupMarker {
        seq: 2,
        input_offset: 20,
        ..marker(false)
    };
    let log = vec![
        entry(b"a", Some(b"1")),
        entry(b"b", Some(b"1")),
        first.to_entry(),
        entry(b"a", Some(b"2")),
        entry(b"b", None),
        second.to_entry(),
        entry(b"c", Some(b"3")),
    ];
    let state = read_changelog(&log).unwrap();
    assert_eq!(state.marker, Some(second.clone()));
    assert_eq!(state.records, 7);
    assert_eq!(state.entries, vec![entry(b"a", Some(b"2")), entry(b"c", Some(b"3"))]);
    // What compaction leaves of the same log reads the same.
    let compacted = vec![entry(b"a", Some(b"2")), second.to_entry(), entry(b"c", Some(b"3"))];
    let again = read_changelog(&compacted).unwrap();
    assert_eq!((again.entries, again.marker), (state.entries, state.marker));
    let mut broken = log.clone();
    broken.push(BackupEntry::new(BackupMarker::key(), Some(versioned(b"short"))));
    assert!(
        read_changelog(&broken).is_err(),
        "an undecodable last marker is an error"
    );
}

/// A record as the driver logs it: value `value` in backup `seq`, the key
/// holding `prior` before.
fn logged(key: &[u8], seq: u64, value: f64, prior: Option<f64>) -> BackupEntry {
    let mut chain = crate::prior_chain::PriorChain::new();
    let mut batch = chain.batch(seq);
    batch.push_f64(1, |out| out.extend_from_slice(key), value, prior);
    let record = chain.log(batch).iter().next().unwrap().to_entry();
    record
}

/// Marker 3 at offset 10, behind backup 2.
fn marker_covering_backup_2() -> BackupMarker {
    BackupMarker {
        seq: 3,
        input_offset: 10,
        covers: 2,
        ..marker(false)
    }
}

#[test]
fn a_record_the_last_marker_does_not_cover_is_restored_as_its_prior_even_compacted() {
    let first = marker_covering_backup_2();
    let log = vec![
        logged(b"a", 2, 1.0, None),
        logged(b"b", 2, 5.0, None),
        first.to_entry(),
        // Backup 4's entries, its marker lost in the crash.
        logged(b"a", 4, 2.0, Some(1.0)),
        logged(b"c", 4, 7.0, None),
    ];
    let value = |state: &ChangelogState, key: &[u8]| {
        state
            .entries
            .iter()
            .find(|e| e.key_body() == key)
            .and_then(|e| e.value.as_deref().map(|v| crate::entry::decode_f64(v).unwrap()))
    };
    // Compaction may leave only the latest record of `a`.
    let compacted = vec![log[1].clone(), log[2].clone(), log[3].clone(), log[4].clone()];
    for log in [log, compacted] {
        let state = read_changelog(&log).unwrap();
        assert_eq!(
            value(&state, b"a"),
            Some(1.0),
            "a's value at the marker, not backup 4's"
        );
        assert_eq!(value(&state, b"b"), Some(5.0));
        assert_eq!(value(&state, b"c"), None, "c did not exist at the marker");
        let rolled: Vec<&[u8]> = state.restart.rolled_back.iter().map(|e| e.key_body()).collect();
        assert_eq!(
            rolled,
            vec![b"a".as_slice(), b"c".as_slice()],
            "written again before the start marker"
        );
        assert_eq!(
            state.restart.next_seq,
            next_incarnation(4),
            "a new incarnation, above every sequence in the log"
        );
    }
}

#[test]
fn record_by_record_resolution_gives_what_the_reader_gives() {
    let marker = marker_covering_backup_2();
    let log = vec![
        logged(b"a", 2, 1.0, None),
        marker.to_entry(),
        logged(b"a", 4, 2.0, Some(1.0)),
        logged(b"b", 4, 7.0, None),
    ];
    let plan = RecoveryPlan::decide(Mode::Approximate, Some(&marker), None, 0, C);
    let mut marked = MarkedState::for_plan(&plan);
    let mut resolved = Vec::new();
    marked.resolve(&log, &mut resolved).unwrap();
    let decoded: Vec<(&[u8], Option<f64>)> = resolved
        .iter()
        .map(|e| {
            (
                e.key_body(),
                e.value.as_deref().map(|v| crate::entry::decode_f64(v).unwrap()),
            )
        })
        .collect();
    assert_eq!(
        decoded,
        vec![
            (b"a".as_slice(), Some(1.0)),
            (b"a".as_slice(), Some(1.0)),
            (b"b".as_slice(), None)
        ],
        "markers skipped; uncovered records as their priors, in log order"
    );
    let restart = marked.finish();
    assert_eq!(restart, read_changelog(&log).unwrap().restart);
    let continued = plan.clone().continuing(&restart);
    assert_eq!(continued.next_seq, next_incarnation(4), "above backup 4");
    assert_eq!(plan.next_seq, next_incarnation(3), "above the marker's own sequence");
}

#[test]
fn a_clean_marker_continues_without_a_failure() {
    let plan = RecoveryPlan::decide(Mode::Approximate, Some(&marker(true)), Some(900), 0, C);
    assert!(!plan.counted_failure);
    assert_eq!(plan.failures, 2);
    assert_eq!(plan.resume_offset, 1000, "the marker, not the committed offset");
    assert_eq!(plan.introduced, ErrorBound::default());
    assert_eq!(plan.source, ResumeSource::Marker);
}

#[test]
fn a_crash_resumes_at_the_marker_counts_a_failure_and_reports_its_bound() {
    let plan = RecoveryPlan::decide(Mode::Approximate, Some(&marker(false)), Some(1200), 0, C);
    assert!(plan.counted_failure);
    assert_eq!(plan.failures, 3);
    assert_eq!(plan.resume_offset, 1000);
    assert_eq!(plan.introduced.state, 12.5, "θ alone, whatever α and l");
    assert_eq!(plan.introduced.outputs, 100.0, "l·β repeated");
    assert_eq!((plan.covers, plan.next_seq), (6, next_incarnation(7)));
    assert_eq!(
        plan.inherited(),
        6,
        "the new incarnation's state includes what the marker covers"
    );
}

#[test]
fn without_a_marker_the_committed_offset_or_the_start() {
    let plan = RecoveryPlan::decide(Mode::Approximate, None, None, 5, C);
    assert_eq!(
        (plan.resume_offset, plan.counted_failure, plan.source),
        (5, false, ResumeSource::Beginning)
    );
    let plan = RecoveryPlan::decide(Mode::Approximate, None, Some(40), 5, C);
    assert_eq!((plan.resume_offset, plan.source), (40, ResumeSource::Committed));
    // Mode none ignores markers a differently configured run left behind.
    let plan = RecoveryPlan::decide(Mode::None, Some(&marker(false)), Some(40), 5, C);
    assert_eq!((plan.resume_offset, plan.counted_failure), (40, false));
}

/// Incarnation `of`'s backup `n`.
fn seq(of: u64, n: u64) -> u64 {
    (of << crate::fence::COUNTER_BITS) | n
}

/// A marker of incarnation `of` at `input_offset`, covering backup `covers`,
/// its incarnation having inherited backups up to `inherited`.
fn marker_of(of: u64, n: u64, input_offset: u64, covers: u64, inherited: u64) -> BackupMarker {
    BackupMarker {
        seq: seq(of, n),
        input_offset,
        covers,
        inherited,
        ..marker(false)
    }
}

fn restored(state: &ChangelogState, key: &[u8]) -> Option<f64> {
    state
        .entries
        .iter()
        .find(|e| e.key_body() == key)
        .and_then(|e| e.value.as_deref().map(|v| crate::entry::decode_f64(v).unwrap()))
}

#[test]
fn a_zombie_writing_behind_the_next_owner_is_left_out_and_its_keys_written_again() {
    // Owner 1 logged a = 1 at its marker; owner 2 restored that, started,
    // and wrote b; then owner 1's queued backup and marker landed late.
    let owner_1 = marker_of(1, 3, 10, seq(1, 2), u64::MAX);
    let owner_2 = marker_of(2, 2, 10, seq(2, 1), seq(1, 2));
    let zombie = marker_of(1, 5, 50, seq(1, 4), u64::MAX);
    let log = vec![
        logged(b"a", seq(1, 2), 1.0, None),
        owner_1.to_entry(),
        logged(b"b", seq(2, 1), 4.0, None),
        owner_2.to_entry(),
        logged(b"a", seq(1, 4), 9.0, Some(1.0)),
        zombie.to_entry(),
    ];
    let state = read_changelog(&log).unwrap();
    assert_eq!(state.marker, Some(owner_2), "the zombie's marker is not the last");
    assert_eq!(restored(&state, b"a"), Some(1.0), "owner 2's a, not the zombie's");
    assert_eq!(restored(&state, b"b"), Some(4.0));
    assert_eq!(state.restart.fenced, 1);
    let rolled: Vec<&[u8]> = state.restart.rolled_back.iter().map(|e| e.key_body()).collect();
    assert_eq!(
        rolled,
        vec![b"a".as_slice()],
        "the zombie's record stops being a's latest"
    );
    assert_eq!(crate::fence::incarnation(state.restart.next_seq), 3);
    // Record by record, as the service streams it: the same state, and the
    // fenced key's value found by a second read.
    let plan = RecoveryPlan::decide(Mode::Approximate, state.marker.as_ref(), None, 0, C);
    let mut first = MarkedState::for_plan(&plan);
    let mut applied = Vec::new();
    first.resolve(&log, &mut applied).unwrap();
    let first = first.finish();
    assert_eq!(
        first.last_marker, state.marker,
        "the streamed read agrees on the marker"
    );
    assert!(first.rolled_back.is_empty());
    let unresolved = first.unresolved.clone();
    assert_eq!(unresolved.len(), 1);
    let mut second = MarkedState::for_plan(&plan).watching(&unresolved);
    second.resolve(&log, &mut Vec::new()).unwrap();
    assert_eq!(second.finish().rolled_back, state.restart.rolled_back);
}

#[test]
fn a_zombie_record_landing_before_the_next_owners_first_write_is_left_out_under_its_markers() {
    // Owner 2 read the log up to owner 1's marker; owner 1's late record of
    // a landed before owner 2's first write. Owner 2's later marker covers
    // sequences above it, yet its incarnation inherited only up to backup 2.
    let owner_1 = marker_of(1, 3, 10, seq(1, 2), u64::MAX);
    let owner_2_start = marker_of(2, 1, 10, seq(1, 2), seq(1, 2));
    let owner_2 = marker_of(2, 3, 30, seq(2, 2), seq(1, 2));
    let log = vec![
        logged(b"a", seq(1, 2), 1.0, None),
        owner_1.to_entry(),
        logged(b"a", seq(1, 4), 9.0, Some(1.0)),
        owner_2_start.to_entry(),
        logged(b"b", seq(2, 2), 4.0, None),
        owner_2.to_entry(),
    ];
    let state = read_changelog(&log).unwrap();
    assert_eq!(state.marker, Some(owner_2));
    assert_eq!(restored(&state, b"a"), Some(1.0), "above what owner 2 inherited");
    assert_eq!(state.restart.fenced, 1);
    assert_eq!(restored(&state, b"b"), Some(4.0));
}

#[test]
fn a_zombie_marker_behind_the_next_owners_first_record_is_not_the_last() {
    // Owner 2 wrote the key it rolled back, with no marker yet, when owner
    // 1's late marker landed: a record of incarnation 2 precedes it, so it is
    // not admitted, though no marker of incarnation 2 is in the log.
    let owner_1 = marker_of(1, 3, 10, seq(1, 2), u64::MAX);
    let zombie = marker_of(1, 5, 50, seq(1, 4), u64::MAX);
    let log = vec![
        logged(b"a", seq(1, 2), 1.0, None),
        owner_1.to_entry(),
        logged(b"a", seq(2, 1), 1.0, Some(1.0)),
        zombie.to_entry(),
    ];
    assert_eq!(last_marker_in_order(&log).unwrap(), Some(owner_1.clone()));
    assert_eq!(read_changelog(&log).unwrap().marker, Some(owner_1));
}

#[test]
fn a_later_start_without_a_marker_restores_as_its_priors_even_compacted() {
    // Owner 2 wrote the keys it rolled back and died before its start
    // marker; compaction removed owner 1's record they superseded.
    let owner_1 = marker_of(1, 3, 10, seq(1, 2), u64::MAX);
    let log = vec![owner_1.to_entry(), logged(b"a", seq(2, 1), 5.0, Some(5.0))];
    let state = read_changelog(&log).unwrap();
    assert_eq!(state.marker, Some(owner_1.clone()));
    assert_eq!(restored(&state, b"a"), Some(5.0));
    assert_eq!(state.restart.fenced, 0);
    // The next start is a new incarnation above owner 2's, not 2 again: its
    // records must not pass for owner 2's (nor theirs for its own).
    let plan = RecoveryPlan::decide(Mode::Approximate, Some(&owner_1), None, 0, C);
    assert_eq!(crate::fence::incarnation(plan.next_seq), 2, "above the marker's");
    let plan = plan.continuing(&state.restart);
    assert_eq!(crate::fence::incarnation(plan.next_seq), 3, "above every record read");
}

#[test]
fn full_compaction_keeps_each_keys_latest_record_in_log_order() {
    let entry = |key: &[u8], value: u8| BackupEntry {
        key: key.into(),
        value: Some([value][..].into()),
    };
    let log = vec![
        entry(b"a", 1),
        entry(b"m", 2),
        entry(b"b", 3),
        entry(b"a", 4),
        entry(b"m", 5),
    ];
    let values: Vec<u8> = compacted(log, false)
        .iter()
        .map(|e| e.value.as_ref().expect("a value")[0])
        .collect();
    assert_eq!(values, [3, 4, 5]);
}
