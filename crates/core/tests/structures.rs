//! The incremental divergence of every structure agrees with a recomputation from
//! scratch against the backups issued, through random updates, backups,
//! acknowledgements and failures.

use afstream_core::{
    BackupBatch, BackupEntry, BackupScope, Norm, Tracked, TrackedSet, TrackedTable, TrackedValue, TrackedVector,
};
use std::collections::VecDeque;

use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Op {
    Add(u32, f64),
    Backup(bool),
    Ack,
    Fail,
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(
        prop_oneof![
            6 => (0u32..32, -50.0..50.0f64).prop_map(|(i, d)| Op::Add(i, d.round())),
            1 => any::<bool>().prop_map(Op::Backup),
            1 => Just(Op::Ack),
            1 => Just(Op::Fail),
        ],
        1..300,
    )
}

/// Drives a structure and checks its divergence against a shadow rebuilt from
/// the entries of every backup issued and not failed: what the changelog holds
/// once the backups in flight land (the divergence counts from the last backup
/// issued). A failure fails every backup in flight, as the gapless changelog
/// does; until the next backup rewrites what they owe, the log may hold their
/// values or the older ones, so the check waits for it.
fn drive<T: Tracked>(
    live: &mut T,
    new_shadow: impl Fn() -> T,
    ops: &[Op],
    apply: impl Fn(&mut T, u32, f64),
    check: impl Fn(&T, &T),
) {
    let mut seq = 0u64;
    let mut issued: Vec<(u64, Vec<BackupEntry>)> = Vec::new();
    let mut in_flight: VecDeque<u64> = VecDeque::new();
    let mut owed = false;
    for op in ops {
        match op {
            Op::Add(i, d) => apply(live, *i, *d),
            Op::Backup(complete) => {
                let scope = if *complete {
                    BackupScope::Complete
                } else {
                    BackupScope::Drifted
                };
                let mut records = BackupBatch::new(seq);
                live.backup(seq, scope, &mut records);
                issued.push((seq, records.entries().unwrap()));
                in_flight.push_back(seq);
                seq += 1;
                owed = false;
            }
            Op::Ack => {
                if let Some(s) = in_flight.pop_front() {
                    live.acknowledge(s);
                }
            }
            Op::Fail => {
                for s in in_flight.drain(..) {
                    live.fail(s);
                    issued.retain(|(issued_seq, _)| *issued_seq != s);
                    owed = true;
                }
            }
        }
        if !owed {
            let mut shadow = new_shadow();
            for entry in issued.iter().flat_map(|(_, entries)| entries) {
                shadow.restore(entry).unwrap();
            }
            check(live, &shadow);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, failure_persistence: None, .. ProptestConfig::default() })]

    #[test]
    fn vector_divergence_matches_recomputation(norm in prop_oneof![Just(Norm::L1), Just(Norm::L2), Just(Norm::Max)], theta in 1.0..100.0f64, ops in ops()) {
        let mut live = TrackedVector::new(1, norm, 32).unwrap();
        live.set_theta(theta);
        drive(&mut live, || TrackedVector::new(1, norm, 32).unwrap(), &ops, |v, i, d| v.add(i, d), |live, shadow| {
            let truth = live.distance(shadow);
            let reported = live.divergence();
            match norm {
                Norm::Max => {
                    // Exact above θ, an upper bound otherwise.
                    if truth > theta { assert_eq!(reported, truth) } else { assert!(reported <= theta && reported >= truth - 1e-9, "{reported} vs {truth}") }
                }
                _ => assert!((reported - truth).abs() <= 1e-6 * (1.0 + truth), "{norm:?}: {reported} vs {truth}"),
            }
        });
    }

    #[test]
    fn table_divergence_matches_recomputation(norm in prop_oneof![Just(Norm::L1), Just(Norm::L2), Just(Norm::KeyCount)], ops in ops()) {
        let mut live: TrackedTable<u64> = TrackedTable::new(2, norm);
        drive(&mut live, || TrackedTable::new(2, norm), &ops, |t, i, d| { t.add(&u64::from(i), d).unwrap(); }, |live, shadow| {
            let truth = live.distance(shadow);
            let reported = live.divergence();
            assert!((reported - truth).abs() <= 1e-6 * (1.0 + truth), "{norm:?}: {reported} vs {truth}");
        });
    }

    #[test]
    fn a_carried_number_is_logged_with_its_value(norm in prop_oneof![Just(Norm::L1), Just(Norm::L2)], ops in ops()) {
        // Every change moves the carried number by three times the value's,
        // so wherever the log holds a key, the live pair and the logged pair
        // differ in that ratio: a record that logged a stale carried number
        // breaks it.
        let mut live: TrackedTable<u64> = TrackedTable::with_carried(2, norm);
        drive(&mut live, || TrackedTable::with_carried(2, norm), &ops, |t, i, d| { t.add_pair(&u64::from(i), d, 3.0 * d).unwrap(); }, |live, shadow| {
            let truth = live.distance(shadow);
            assert!((live.divergence() - truth).abs() <= 1e-6 * (1.0 + truth), "{norm:?}: {} vs {truth}", live.divergence());
            for (key, logged, logged_carried) in shadow.iter_pairs() {
                let (value, carried) = live.get_pair(key).unwrap();
                assert_eq!(carried - logged_carried, 3.0 * (value - logged), "key {key}");
            }
        });
    }

    #[test]
    fn set_and_value_divergence_match_recomputation(ops in ops()) {
        let mut live: TrackedSet<u64> = TrackedSet::new(3);
        drive(&mut live, || TrackedSet::new(3), &ops, |s, i, d| { if d >= 0.0 { s.insert(u64::from(i)); } else { s.remove(&u64::from(i)); } }, |live, shadow| {
            assert_eq!(live.divergence(), live.distance(shadow));
        });
        let mut live = TrackedValue::new(4);
        drive(&mut live, || TrackedValue::new(4), &ops, |v, _, d| v.add(d), |live, shadow| {
            assert!((live.divergence() - live.distance(shadow)).abs() < 1e-9);
        });
    }
}

#[test]
fn a_carried_numbers_record_holds_both_numbers_and_both_priors() {
    use afstream_core::entry::decode_f64_pair;
    use afstream_core::logged::LoggedValue;
    let mut table: TrackedTable<u64> = TrackedTable::with_carried(5, Norm::L1);
    table.add_pair(&7, 1.0, 10.0).unwrap();
    let mut first = BackupBatch::new(1);
    table.backup(1, BackupScope::Drifted, &mut first);
    table.add_pair(&7, 1.0, 15.0).unwrap();
    let mut second = BackupBatch::new(2);
    table.backup(2, BackupScope::Drifted, &mut second);
    assert_eq!(second.len(), 1, "one record for the value and its carried number");
    let record = second.iter().next().unwrap();
    let logged = LoggedValue::decode(Some(record.value)).unwrap();
    assert_eq!(decode_f64_pair(logged.value.as_deref().unwrap()).unwrap(), (2.0, 25.0));
    let prior = logged.priors[0].value.as_deref().unwrap();
    assert_eq!(
        decode_f64_pair(prior).unwrap(),
        (1.0, 10.0),
        "what the first backup wrote"
    );
    let mut restored: TrackedTable<u64> = TrackedTable::with_carried(5, Norm::L1);
    for entry in first.entries().unwrap().iter().chain(&second.entries().unwrap()) {
        restored.restore(entry).unwrap();
    }
    assert_eq!(restored.get_pair(&7), Some((2.0, 25.0)));
    assert_eq!(restored.divergence(), 0.0);
}
