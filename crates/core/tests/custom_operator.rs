//! A user's own operator, built from the core's structures without touching the
//! core: distinct visitors per page, with a set per page and member-count
//! divergence. It gets backups, recovery and the bound checks for free.

use afstream_core::harness::{simulate, SimulationOptions};
use afstream_core::operator::{acknowledge_all, backup_all, fail_all, restore_all};
use afstream_core::{
    AnalysisConstants, BackupBatch, BackupEntry, BackupScope, ControllerConfig, CoreError, FailurePolicy,
    GlobalThresholds, Mode, Norm, Operator, Placement, ProcessError, ThresholdPolicy, Tracked, TrackedSet,
};

#[derive(Clone)]
struct DistinctVisitors {
    visitors: TrackedSet<u64>,
}

impl Operator for DistinctVisitors {
    type Input = u64;
    type Output = u64;

    fn process(&mut self, visitor: &u64, outputs: &mut Vec<u64>) -> Result<(), ProcessError> {
        if self.visitors.insert(*visitor) {
            outputs.push(*visitor);
        }
        Ok(())
    }
    fn divergence(&self) -> f64 {
        self.visitors.divergence()
    }
    fn norm(&self) -> Norm {
        Norm::KeyCount
    }
    fn set_theta(&mut self, _theta: f64) {}
    fn backup(&mut self, seq: u64, scope: BackupScope, out: &mut BackupBatch) {
        backup_all(&mut [&mut self.visitors], seq, scope, out);
    }
    fn acknowledge_backup(&mut self, seq: u64) {
        acknowledge_all(&mut [&mut self.visitors], seq);
    }
    fn fail_backup(&mut self, seq: u64) {
        fail_all(&mut [&mut self.visitors], seq);
    }
    fn restore(&mut self, entries: &[BackupEntry]) -> Result<(), CoreError> {
        restore_all(&mut [&mut self.visitors], entries)
    }
    fn constants(&self) -> AnalysisConstants {
        AnalysisConstants { alpha: 1.0, beta: 1 }
    }
    fn distance(&self, other: &Self) -> f64 {
        self.visitors.distance(&other.visitors)
    }
}

fn visitors() -> DistinctVisitors {
    DistinctVisitors {
        visitors: TrackedSet::new(1),
    }
}

/// 5 000 visits of 1 500 visitors.
fn visits() -> Vec<u64> {
    (0..5_000u64).map(|i| (i * 7919) % 1_500).collect()
}

/// Approximate mode at Θ, L and Γ, on one task under the halving policy.
fn approximate(theta: f64, max_uncovered: u64, max_unacked: u64) -> ControllerConfig {
    let constants = visitors().constants();
    let policy = ThresholdPolicy::new(
        GlobalThresholds::new(theta, max_uncovered, max_unacked).unwrap(),
        FailurePolicy::Halving,
        Placement::default(),
        Norm::L1,
        constants,
    )
    .unwrap();
    ControllerConfig::new(Mode::Approximate, policy, constants)
}

#[test]
fn a_custom_operator_recovers_within_its_bound() {
    let (config, stream) = (approximate(40.0, 16, 8), visits());
    let options = SimulationOptions {
        seed: 9,
        crash_after: vec![500, 501, 1_800, 3_200, 4_100],
        write_failure_rate: 0.1,
        ..SimulationOptions::default()
    };
    let (failed, report) = simulate(config, &visitors, &stream, options).unwrap();
    assert!(report.violations.is_empty(), "{:?}", report.violations);
    assert_eq!(report.recoveries.len(), 5);
    let (clean, _) = simulate(config, &visitors, &stream, SimulationOptions::default()).unwrap();
    // Θ/2 + Θ/4 + … + Θ/32: five failures, θ halving after each.
    let bound = 40.0 * (1.0 - 0.5f64.powi(5));
    assert!(failed.distance(&clean) <= bound);
    assert!(report.totals.backups > 0);
}

/// Under thresholds nothing crosses, a run writes its start marker and
/// nothing else until its clean stop, whose complete backup writes every
/// visitor: the report counts the records before the stop apart.
#[test]
fn the_records_a_run_writes_before_its_clean_stop_are_counted_apart() {
    let config = approximate(1e9, 1 << 40, 1 << 20);
    let (_, report) = simulate(config, &visitors, &visits(), SimulationOptions::default()).unwrap();
    assert_eq!(report.changelog_records_before_stop, 1, "the start marker: {report:?}");
    assert!(report.changelog_records > 1_500, "{report:?}");
}

#[test]
fn undecodable_and_foreign_entries_are_typed_errors() {
    let mut op = DistinctVisitors {
        visitors: TrackedSet::new(1),
    };
    let foreign = BackupEntry {
        key: [9, 1, 2].as_slice().into(),
        value: Some([1].as_slice().into()),
    };
    let err = op.restore(&[foreign]).unwrap_err();
    assert!(err.to_string().contains("tag 9"), "{err}");
    let short_key = BackupEntry {
        key: [1, 2].as_slice().into(),
        value: Some([1].as_slice().into()),
    };
    assert!(matches!(op.restore(&[short_key]), Err(CoreError::Undecodable { .. })));
    let future = BackupEntry {
        key: [vec![1], 5u64.to_be_bytes().to_vec()].concat().as_slice().into(),
        value: Some([7].as_slice().into()),
    };
    assert!(matches!(
        op.restore(&[future]),
        Err(CoreError::UnknownEncodingVersion { found: 7, .. })
    ));
}
