//! Tests of `slots`.

use super::*;

#[test]
fn length_and_emptiness() {
    assert!(DriftSlots::new(Norm::L1, 0).is_empty());
    let mut slots = DriftSlots::new(Norm::L1, 2);
    assert!(!slots.is_empty());
    slots.push();
    assert_eq!(slots.len(), 3);
}

fn indices(values: &[Written]) -> Vec<u32> {
    let mut indices: Vec<u32> = values.iter().map(|w| w.index).collect();
    indices.sort_unstable();
    indices
}

fn pairs(values: &[Written]) -> Vec<(u32, f64)> {
    values.iter().map(|w| (w.index, w.value)).collect()
}

#[test]
fn a_backup_names_what_the_last_backup_held_as_each_slots_prior() {
    let mut slots = DriftSlots::new(Norm::L1, 2);
    slots.set(0, 3.0);
    let first = slots.backup(1, BackupScope::Drifted).to_vec();
    assert_eq!(
        first,
        vec![Written {
            index: 0,
            value: 3.0,
            prior: None
        }],
        "no backup held it"
    );
    slots.set(0, 5.0);
    slots.set(1, 1.0);
    let mut second = slots.backup(2, BackupScope::Drifted).to_vec();
    second.sort_by_key(|w| w.index);
    assert_eq!(
        second,
        vec![
            Written {
                index: 0,
                value: 5.0,
                prior: Some(3.0)
            },
            Written {
                index: 1,
                value: 1.0,
                prior: None
            }
        ]
    );
    slots.restore(1, 7.0);
    slots.set(1, 8.0);
    assert_eq!(
        slots.backup(3, BackupScope::Drifted)[0].prior,
        Some(7.0),
        "a restored slot is held"
    );
}

#[test]
fn a_failed_max_norm_write_is_owed_even_once_back_within_theta() {
    let mut slots = DriftSlots::new(Norm::Max, 3);
    slots.set_theta(5.0);
    slots.set(0, 10.0);
    assert_eq!(pairs(slots.backup(1, BackupScope::Drifted)), vec![(0, 10.0)]);
    slots.fail(1);
    // Back at the baseline: its drift is 0, but the store may hold 10.
    slots.set(0, 0.0);
    assert_eq!(pairs(slots.backup(2, BackupScope::Drifted)), vec![(0, 0.0)]);
    slots.fail(2);
    assert_eq!(
        pairs(slots.backup(3, BackupScope::Complete)),
        vec![(0, 0.0)],
        "a complete backup owes it too"
    );
    slots.acknowledge(3);
    assert!(
        slots.backup(4, BackupScope::Complete).is_empty(),
        "paid once acknowledged"
    );
}

#[test]
fn a_max_norm_backup_writes_every_slot_over_half_theta() {
    let mut slots = DriftSlots::new(Norm::Max, 4);
    slots.set_theta(10.0);
    slots.set(0, 6.0);
    slots.set(1, 4.0);
    slots.set(2, 11.0);
    assert_eq!(slots.divergence(), 11.0);
    assert_eq!(indices(slots.backup(1, BackupScope::Drifted)), vec![0, 2]);
    slots.acknowledge(1);
    assert!(slots.divergence() <= 5.0, "every drift left is at most θ/2");
    // Growing counters keep the maximum exact without a rescan.
    slots.add(1, 2.0);
    slots.add(3, 7.0);
    slots.add(3, 1.0);
    assert_eq!(slots.divergence(), 8.0);
    slots.add(3, -8.0);
    assert_eq!(slots.divergence(), 6.0, "the slot that held the maximum shrank");
    slots.add(3, 12.0);
    assert_eq!(slots.divergence(), 12.0);
    assert_eq!(indices(slots.backup(2, BackupScope::Drifted)), vec![1, 3]);
}

#[test]
fn a_drift_of_exactly_half_theta_is_not_written() {
    let mut slots = DriftSlots::new(Norm::Max, 2);
    slots.set_theta(10.0);
    slots.set(0, 5.0);
    slots.set(1, 5.5);
    assert_eq!(indices(slots.backup(1, BackupScope::Drifted)), vec![1], "over θ/2 only");
    slots.acknowledge(1);
    slots.set_theta(10.0);
    assert!(slots.backup(2, BackupScope::Drifted).is_empty(), "nor after a rescan");
    slots.set(0, 8.0);
    slots.set(0, 5.0);
    assert!(
        slots.backup(3, BackupScope::Drifted).is_empty(),
        "nor once a drift over θ/2 shrinks back to it"
    );
    slots.set(0, 8.0);
    assert_eq!(indices(slots.backup(4, BackupScope::Drifted)), vec![0]);
    slots.set(0, 13.0);
    slots.acknowledge(4);
    assert!(
        slots.backup(5, BackupScope::Drifted).is_empty(),
        "nor when an acknowledgement leaves it at θ/2"
    );
}

#[test]
fn a_rescan_measures_drift_from_the_acknowledged_value() {
    let mut slots = DriftSlots::new(Norm::Max, 1);
    slots.set_theta(100.0);
    slots.set(0, 10.0);
    assert_eq!(indices(slots.backup(1, BackupScope::Complete)), vec![0]);
    slots.acknowledge(1);
    slots.set(0, 11.0);
    slots.set_theta(4.0);
    assert!(
        slots.backup(2, BackupScope::Drifted).is_empty(),
        "a drift of 1 is under θ/2 = 2"
    );
}

#[test]
fn an_acknowledged_complete_backup_resets_the_max_norm_bound() {
    let mut slots = DriftSlots::new(Norm::Max, 2);
    slots.set_theta(10.0);
    slots.set(0, 3.0);
    assert_eq!(slots.divergence(), 3.0);
    assert_eq!(indices(slots.backup(1, BackupScope::Complete)), vec![0]);
    slots.acknowledge(1);
    assert_eq!(slots.divergence(), 0.0, "the state equals its backup");
}

#[test]
fn a_restore_takes_back_the_slots_own_drift() {
    for norm in [Norm::L1, Norm::L2] {
        let mut slots = DriftSlots::new(norm, 2);
        slots.set(0, 10.0);
        slots.backup(1, BackupScope::Drifted);
        slots.acknowledge(1);
        slots.set(0, 13.0);
        slots.set(1, 4.0);
        slots.restore(0, 3.0);
        assert_eq!(slots.divergence(), 4.0, "{norm:?}: only slot 1 drifts, by 4");
    }
}

#[test]
fn a_restored_max_norm_slot_is_no_longer_over_theta() {
    let mut slots = DriftSlots::new(Norm::Max, 3);
    slots.set_theta(10.0);
    slots.set(0, 8.0);
    slots.set(1, 9.0);
    slots.restore(0, 8.0);
    assert_eq!(
        indices(slots.backup(1, BackupScope::Drifted)),
        vec![1],
        "the restored slot equals its backup; the other is still over θ/2"
    );
}

#[test]
fn a_slot_restored_after_it_was_listed_is_not_written() {
    let mut slots = DriftSlots::new(Norm::KeyCount, 0);
    let index = slots.push();
    slots.restore(index, 5.0);
    assert_eq!(slots.divergence(), 0.0);
    assert!(slots.backup(1, BackupScope::Drifted).is_empty());
}

#[test]
fn a_new_theta_rescans_which_max_norm_slots_are_over_it() {
    let mut slots = DriftSlots::new(Norm::Max, 3);
    slots.set_theta(100.0);
    slots.set(1, 10.0);
    slots.set(2, -3.0);
    assert!(slots.backup(1, BackupScope::Drifted).is_empty());
    slots.acknowledge(1);
    slots.set_theta(5.0);
    assert_eq!(slots.divergence(), 10.0, "exact once over θ");
    assert_eq!(
        indices(slots.backup(2, BackupScope::Drifted)),
        vec![1, 2],
        "a drifted backup writes every slot over θ/2 (3 > 2.5), not only those over θ"
    );
    slots.fail(2);
    slots.set_theta(2.0);
    assert_eq!(indices(slots.backup(3, BackupScope::Drifted)), vec![1, 2]);
    slots.acknowledge(3);
    assert!(
        slots.divergence() <= 2.0,
        "below θ it is an upper bound that never exceeds θ"
    );
    slots.set_theta(50.0);
    slots.set(2, 7.0);
    assert!(slots.divergence() <= 50.0);
    assert!(slots.backup(4, BackupScope::Drifted).is_empty());
    assert_eq!(indices(slots.backup(5, BackupScope::Complete)), vec![2]);
}

#[test]
fn an_owed_only_backup_writes_what_a_failed_write_left_and_leaves_the_drift() {
    for norm in [Norm::L1, Norm::L2] {
        let mut slots = DriftSlots::new(norm, 3);
        slots.set(0, 100.0);
        assert_eq!(indices(slots.backup(1, BackupScope::Drifted)), vec![0]);
        slots.fail(1);
        // Back at the baseline: no drift, but the log may hold 100.
        slots.set(0, 0.0);
        slots.set(1, 5.0);
        assert_eq!(
            pairs(slots.backup(2, BackupScope::Owed)),
            vec![(0, 0.0)],
            "{norm:?}: the owed slot only, at its live value"
        );
        slots.acknowledge(2);
        assert!(slots.divergence() > 0.0, "{norm:?}: slot 1's drift is left");
        assert!(slots.backup(3, BackupScope::Owed).is_empty(), "{norm:?}: paid once");
        assert_eq!(
            indices(slots.backup(4, BackupScope::Drifted)),
            vec![1],
            "{norm:?}: a drifted backup writes the drift, not the paid slot again"
        );
        slots.acknowledge(4);
        assert_eq!(slots.divergence(), 0.0, "{norm:?}");
    }
}

#[test]
fn an_owed_only_backup_under_memory_pressure_writes_the_drift() {
    let mut slots = DriftSlots::new(Norm::L1, 2);
    slots.set(1, 5.0);
    slots.set_pressure(true);
    assert_eq!(indices(slots.backup(1, BackupScope::Owed)), vec![1]);
}

#[test]
fn a_max_norm_owed_only_backup_writes_the_slots_over_half_theta() {
    let mut slots = DriftSlots::new(Norm::Max, 3);
    slots.set_theta(10.0);
    slots.set(0, 6.0);
    slots.set(1, 2.0);
    assert_eq!(indices(slots.backup(1, BackupScope::Owed)), vec![0]);
}

#[test]
fn a_value_that_is_not_a_number_makes_the_divergence_infinite_not_zero() {
    for norm in [Norm::L1, Norm::L2] {
        let mut slots = DriftSlots::new(norm, 2);
        slots.set(0, 1.0);
        assert!(slots.divergence() > 0.0 && slots.divergence().is_finite());
        slots.set(1, f64::NAN);
        assert_eq!(slots.divergence(), f64::INFINITY, "{norm:?}");
    }
}

#[test]
fn a_drifted_l1_backup_writes_the_largest_drifts_until_half_of_theta_is_left() {
    let mut slots = DriftSlots::new(Norm::L1, 5);
    slots.set_theta(10.0);
    for (index, drift) in [(0, 1.0), (1, 6.0), (2, 2.0), (3, -4.0), (4, 1.0)] {
        slots.set(index, drift);
    }
    // 14 of drift; writing 6 and then 4 leaves 4, within θ/2 = 5.
    assert_eq!(indices(slots.backup(1, BackupScope::Drifted)), vec![1, 3]);
    assert_eq!(slots.divergence(), 4.0);
    // The slots left behind stay dirty: a complete backup writes them.
    assert_eq!(indices(slots.backup(2, BackupScope::Complete)), vec![0, 2, 4]);
    assert_eq!(slots.divergence(), 0.0);
}

#[test]
fn a_drifted_l2_backup_leaves_at_most_half_of_theta_and_owed_slots_go_first() {
    let mut slots = DriftSlots::new(Norm::L2, 4);
    slots.set_theta(4.0);
    slots.set(0, 1.0);
    assert_eq!(indices(slots.backup(1, BackupScope::Complete)), vec![0]);
    slots.fail(1);
    for (index, drift) in [(1, 3.0), (2, 1.0), (3, 1.5)] {
        slots.set(index, drift);
    }
    // √(9 + 1 + 2.25) = 3.5: writing 3 leaves √3.25 ≈ 1.8, within θ/2 = 2; the
    // slot a failed write owes goes out whatever its drift.
    assert_eq!(indices(slots.backup(2, BackupScope::Drifted)), vec![0, 1]);
    assert!((slots.divergence() - 3.25f64.sqrt()).abs() < 1e-12);
}

#[test]
fn without_theta_or_under_memory_pressure_a_drifted_l1_backup_writes_every_drift() {
    let mut slots = DriftSlots::new(Norm::L1, 3);
    for index in 0..3 {
        slots.set(index, 1.0 + f64::from(index));
    }
    assert_eq!(indices(slots.backup(1, BackupScope::Drifted)), vec![0, 1, 2], "θ unset");
    slots.set_theta(100.0);
    slots.set_pressure(true);
    for index in 0..3 {
        slots.add(index, 1.0);
    }
    assert_eq!(
        indices(slots.backup(2, BackupScope::Drifted)),
        vec![0, 1, 2],
        "pressure"
    );
}

#[test]
fn a_drifted_l1_backup_takes_whole_classes_then_part_of_the_last_in_list_order() {
    let mut slots = DriftSlots::new(Norm::L1, 5);
    slots.set_theta(10.0);
    for (index, drift) in [(0, 16.0), (1, 4.0), (2, 4.0), (3, 4.0), (4, 1.0)] {
        slots.set(index, drift);
    }
    // 29 of drift: 16 goes whole, then fours until 5 = θ/2 is left exactly.
    assert_eq!(indices(slots.backup(1, BackupScope::Drifted)), vec![0, 1, 2]);
    assert_eq!(slots.divergence(), 5.0);
}

#[test]
fn a_drift_a_thousand_times_larger_goes_first_whatever_the_list_order() {
    let mut slots = DriftSlots::new(Norm::L1, 2);
    slots.set_theta(4_000.0);
    slots.set(0, 1_024.0);
    slots.set(1, 1_048_576.0);
    assert_eq!(indices(slots.backup(1, BackupScope::Drifted)), vec![1]);
    // Drifts past the largest class (2^63) share it.
    let mut slots = DriftSlots::new(Norm::L1, 2);
    slots.set_theta(1e30);
    slots.set(0, 1.0);
    slots.set(1, 3e30);
    assert_eq!(indices(slots.backup(1, BackupScope::Drifted)), vec![1]);
}

#[test]
fn an_owed_slots_drift_counts_as_written_when_choosing_the_rest() {
    let mut slots = DriftSlots::new(Norm::L1, 3);
    slots.set_theta(10.0);
    slots.set(0, 8.0);
    assert_eq!(indices(slots.backup(1, BackupScope::Complete)), vec![0]);
    slots.fail(1);
    for (index, value) in [(0, 14.0), (1, 3.0), (2, 2.0)] {
        slots.set(index, value);
    }
    // 11 of drift; the owed slot takes 6 of it, which leaves 5 = θ/2.
    assert_eq!(indices(slots.backup(2, BackupScope::Drifted)), vec![0]);
}

#[test]
fn a_slot_listed_twice_is_ranked_and_written_once() {
    let mut slots = DriftSlots::new(Norm::L1, 3);
    slots.set_theta(10.0);
    slots.set(0, 1.0);
    assert_eq!(indices(slots.backup(1, BackupScope::Complete)), vec![0]);
    slots.fail(1);
    // The owed-only backup cleans slot 0 but leaves it listed; changed again,
    // it is listed a second time.
    assert_eq!(indices(slots.backup(2, BackupScope::Owed)), vec![0]);
    for (index, value) in [(0, 5.0), (1, 3.0), (2, 3.0)] {
        slots.set(index, value);
    }
    // 10 of drift: writing 4 and one of the threes leaves 3, within θ/2 = 5.
    // Counting slot 0's 4 twice would stop after it, with 6 left.
    let written = pairs(slots.backup(3, BackupScope::Drifted));
    assert_eq!(written, vec![(0, 5.0), (1, 3.0)]);
    assert_eq!(slots.divergence(), 3.0);
    assert_eq!(pairs(slots.backup(4, BackupScope::Complete)), vec![(2, 3.0)]);
}

#[test]
fn a_class_both_cold_and_changed_since_is_ranked_at_any_scale() {
    // Drifts under 1 fall in the lower half of the classes: a binary scale
    // keeps every class's order and every sum exact.
    for scale in [1.0, 0.5f64.powi(20)] {
        let mut slots = DriftSlots::new(Norm::L1, 3);
        slots.set_theta(10.0 * scale);
        for (index, drift) in [(0, 4.0), (1, 8.0), (2, 1.0)] {
            slots.set(index, drift * scale);
        }
        // 13 of drift: writing 8 leaves 5 = θ/2; 0 and 2 stay cold.
        assert_eq!(indices(slots.backup(1, BackupScope::Drifted)), vec![1], "scale {scale}");
        // Slot 1 drifts 4 again, in the class slot 0 is cold in: 9 of
        // drift, 8 of it in that class; writing the cold 4 leaves 5.
        slots.set(1, 12.0 * scale);
        assert_eq!(indices(slots.backup(2, BackupScope::Drifted)), vec![0], "scale {scale}");
        assert_eq!(slots.divergence(), 5.0 * scale);
    }
}

#[test]
fn a_class_cut_in_part_keeps_the_sum_of_the_cold_slots_it_leaves() {
    let mut slots = DriftSlots::new(Norm::L1, 9);
    slots.set_theta(10.0);
    slots.set(0, 8.0);
    for index in 1..=5 {
        slots.set(index, 1.0);
    }
    // 13 of drift: writing 8 leaves 5 = θ/2; five slots of 1 stay cold.
    assert_eq!(indices(slots.backup(1, BackupScope::Drifted)), vec![0]);
    // Slot 0 drifts 1: 6 in the class of 1, which is cut in part: the slot
    // cold longest goes, and the class holds 5 again, slot 0 cooled in it.
    slots.set(0, 9.0);
    assert_eq!(indices(slots.backup(2, BackupScope::Drifted)), vec![1]);
    // With θ/2 = 1 and three drifts of 0.5 besides, 6.5 of drift: the class
    // of 1 goes whole (its sum, 5, leaves 1.5), then one of 0.5.
    slots.set_theta(2.0);
    for index in 6..=8 {
        slots.set(index, 0.5);
    }
    assert_eq!(indices(slots.backup(3, BackupScope::Drifted)), vec![0, 2, 3, 4, 5, 6]);
    assert_eq!(slots.divergence(), 1.0);
}

#[test]
fn the_slots_a_drifted_backup_leaves_are_ranked_again_only_once_changed() {
    let mut slots = DriftSlots::new(Norm::L1, 5);
    slots.set_theta(10.0);
    for (index, drift) in [(0, 1.0), (1, 6.0), (2, 2.0), (3, -4.0), (4, 1.0)] {
        slots.set(index, drift);
    }
    assert_eq!(indices(slots.backup(1, BackupScope::Drifted)), vec![1, 3]);
    // 0, 2 and 4 stay dirty but cold: the next backup does not rank them.
    assert!(slots.dirty.is_empty(), "listed again: {:?}", slots.dirty);
    slots.set(2, 3.0);
    assert_eq!(slots.dirty, vec![2], "a change makes a cold slot hot again");
    // 1 + 3 + 1 = 5 of drift, within θ = 10: nothing is due, but a drifted
    // backup writes the largest until θ/2 = 5 is left, which it already is.
    assert!(slots.backup(2, BackupScope::Drifted).is_empty());
    // Drift from both lists: 12 (slot 1) + 5 of the cold and hot ones.
    slots.set(1, 18.0);
    assert_eq!(indices(slots.backup(3, BackupScope::Drifted)), vec![1]);
    assert_eq!(slots.divergence(), 5.0);
    slots.set(4, 9.0);
    // 1 (slot 0) + 3 (slot 2) + 9 (slot 4) = 13: writing 9 leaves 4.
    assert_eq!(indices(slots.backup(4, BackupScope::Drifted)), vec![4]);
    assert_eq!(indices(slots.backup(5, BackupScope::Complete)), vec![0, 2]);
    assert_eq!(slots.divergence(), 0.0);
}

mod ranking {
    //! Drifted, complete and owed-only backups over random changes, failures,
    //! acknowledgements and restores, against a model of each slot's live
    //! value and baseline kept from what the backups wrote.

    use super::*;
    use proptest::prelude::*;

    #[derive(Clone, Debug)]
    enum Op {
        Add(u32, f64),
        Backup(BackupScope),
        Ack,
        Fail,
        Restore(u32, f64),
    }

    const SLOTS: u32 = 48;

    fn ops() -> impl Strategy<Value = Vec<Op>> {
        let scope = prop_oneof![
            6 => Just(BackupScope::Drifted),
            1 => Just(BackupScope::Complete),
            1 => Just(BackupScope::Owed),
        ];
        prop::collection::vec(
            prop_oneof![
                12 => (0..SLOTS, -20.0..20.0f64).prop_map(|(i, d)| Op::Add(i, d.round())),
                3 => scope.prop_map(Op::Backup),
                1 => Just(Op::Ack),
                1 => Just(Op::Fail),
                1 => (0..SLOTS, -5.0..5.0f64).prop_map(|(i, v)| Op::Restore(i, v.round())),
            ],
            1..400,
        )
    }

    fn distance(norm: Norm, live: &[f64], baseline: &[f64]) -> f64 {
        let drifts = live.iter().zip(baseline).map(|(l, b)| (l - b).abs());
        match norm {
            Norm::L2 => drifts.map(|d| d * d).sum::<f64>().sqrt(),
            _ => drifts.sum(),
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, .. ProptestConfig::default() })]

        #[test]
        fn backups_leave_what_their_scope_allows(norm in prop_oneof![Just(Norm::L1), Just(Norm::L2)], theta in 5.0..200.0f64, ops in ops()) {
            let mut slots = DriftSlots::new(norm, SLOTS as usize);
            slots.set_theta(theta);
            let mut live = vec![0.0; SLOTS as usize];
            let mut baseline = vec![0.0; SLOTS as usize];
            let mut in_flight: VecDeque<(u64, Vec<u32>)> = VecDeque::new();
            let mut owed: Vec<u32> = Vec::new();
            let mut seq = 0;
            for op in &ops {
                match *op {
                    Op::Add(i, d) => {
                        slots.add(i, d);
                        live[i as usize] += d;
                    }
                    Op::Restore(i, v) => {
                        slots.restore(i, v);
                        live[i as usize] = v;
                        baseline[i as usize] = v;
                        owed.retain(|&o| o != i);
                    }
                    Op::Backup(scope) => {
                        seq += 1;
                        let before = distance(norm, &live, &baseline);
                        let written = indices(slots.backup(seq, scope));
                        let mut unique = written.clone();
                        unique.dedup();
                        prop_assert_eq!(&unique, &written, "a slot written twice");
                        for &o in &owed {
                            prop_assert!(written.contains(&o), "owed slot {} not written", o);
                        }
                        owed.clear();
                        for &i in &written {
                            baseline[i as usize] = live[i as usize];
                        }
                        let left = distance(norm, &live, &baseline);
                        match scope {
                            BackupScope::Complete => prop_assert_eq!(left, 0.0),
                            BackupScope::Drifted => prop_assert!(
                                left <= theta / 2.0 + 1e-9 * (1.0 + before),
                                "{:?} left {} of {} against θ/2 = {}", norm, left, before, theta / 2.0
                            ),
                            BackupScope::Owed => {}
                        }
                        in_flight.push_back((seq, written));
                    }
                    Op::Ack => {
                        if let Some((s, _)) = in_flight.pop_front() {
                            slots.acknowledge(s);
                        }
                    }
                    Op::Fail => {
                        // The gapless changelog fails every write in flight.
                        for (s, written) in in_flight.drain(..) {
                            slots.fail(s);
                            owed.extend(written);
                        }
                        owed.sort_unstable();
                        owed.dedup();
                    }
                }
                let truth = distance(norm, &live, &baseline);
                prop_assert!((slots.divergence() - truth).abs() <= 1e-6 * (1.0 + truth), "{} vs {}", slots.divergence(), truth);
            }
        }
    }
}

#[test]
fn of_the_class_cut_in_part_the_slots_cold_longest_go_first() {
    let mut slots = DriftSlots::new(Norm::L1, 5);
    slots.set_theta(4.0);
    for (index, drift) in [(0, 1.0), (1, 1.0), (2, 1.0), (3, 3.0)] {
        slots.set(index, drift);
    }
    // 6 of drift, θ/2 = 2: the 3, then one of the 1s; two 1s stay cold.
    assert_eq!(indices(slots.backup(1, BackupScope::Drifted)), vec![0, 3]);
    slots.set(4, 1.0);
    // 3 of drift in one class: a slot cold since the last backup goes
    // before the one changed since (the likelier to change again).
    assert_eq!(indices(slots.backup(2, BackupScope::Drifted)), vec![1]);
}
