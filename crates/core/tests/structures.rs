//! The incremental divergence of every structure agrees with a recomputation from
//! scratch against the acknowledged backups, through random updates, backups,
//! acknowledgements and failures.

use afstream_core::{BackupEntry, BackupScope, Norm, Tracked, TrackedSet, TrackedTable, TrackedValue, TrackedVector};
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

/// Drives a structure and a shadow built only from acknowledged entries.
fn drive<T: Tracked>(
    live: &mut T,
    shadow: &mut T,
    ops: &[Op],
    apply: impl Fn(&mut T, u32, f64),
    check: impl Fn(&T, &T),
) {
    let mut seq = 0u64;
    let mut in_flight: Vec<(u64, Vec<BackupEntry>)> = Vec::new();
    for op in ops {
        match op {
            Op::Add(i, d) => apply(live, *i, *d),
            Op::Backup(complete) => {
                let scope = if *complete {
                    BackupScope::Complete
                } else {
                    BackupScope::Drifted
                };
                let mut entries = Vec::new();
                live.backup(seq, scope, &mut entries);
                in_flight.push((seq, entries));
                seq += 1;
            }
            Op::Ack => {
                if !in_flight.is_empty() {
                    let (s, entries) = in_flight.remove(0);
                    for e in &entries {
                        shadow.restore(e).unwrap();
                    }
                    live.acknowledge(s);
                }
            }
            Op::Fail => {
                if !in_flight.is_empty() {
                    let (s, _) = in_flight.remove(0);
                    live.fail(s);
                }
            }
        }
        check(live, shadow);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, failure_persistence: None, .. ProptestConfig::default() })]

    #[test]
    fn vector_divergence_matches_recomputation(norm in prop_oneof![Just(Norm::L1), Just(Norm::L2), Just(Norm::Max)], theta in 1.0..100.0f64, ops in ops()) {
        let mut live = TrackedVector::new(1, norm, 32).unwrap();
        let mut shadow = TrackedVector::new(1, norm, 32).unwrap();
        live.set_theta(theta);
        drive(&mut live, &mut shadow, &ops, |v, i, d| v.add(i, d), |live, shadow| {
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
        let mut shadow: TrackedTable<u64> = TrackedTable::new(2, norm);
        drive(&mut live, &mut shadow, &ops, |t, i, d| { t.add(&u64::from(i), d).unwrap(); }, |live, shadow| {
            let truth = live.distance(shadow);
            let reported = live.divergence();
            assert!((reported - truth).abs() <= 1e-6 * (1.0 + truth), "{norm:?}: {reported} vs {truth}");
        });
    }

    #[test]
    fn set_and_value_divergence_match_recomputation(ops in ops()) {
        let mut live: TrackedSet<u64> = TrackedSet::new(3);
        let mut shadow: TrackedSet<u64> = TrackedSet::new(3);
        drive(&mut live, &mut shadow, &ops, |s, i, d| { if d >= 0.0 { s.insert(u64::from(i)); } else { s.remove(&u64::from(i)); } }, |live, shadow| {
            assert_eq!(live.divergence(), live.distance(shadow));
        });
        let mut live = TrackedValue::new(4);
        let mut shadow = TrackedValue::new(4);
        drive(&mut live, &mut shadow, &ops, |v, _, d| v.add(d), |live, shadow| {
            assert!((live.divergence() - live.distance(shadow)).abs() < 1e-9);
        });
    }
}
