//! From the user's global thresholds Θ, L, Γ to one task's θ, l, γ.
//!
//! What one failure costs under θ, l, γ (β from [`AnalysisConstants`]): the
//! recovered state is the one logged at the last marker, within θ of the live
//! state when that marker was issued, and the input is replayed from the
//! marker exactly (see [`crate::recovery`]), so the **state** gains at most θ.
//! No output is lost (a marker waits for the outputs before it); the replay
//! **repeats** the outputs of the items it replays, at most β each. Markers go
//! out at least every l items without waiting for acknowledgements, so a replay
//! is about l items (more only by the items whose markers were still in flight
//! at the crash): [`TaskThresholds::failure_bound`] reports l·β repeated
//! outputs. γ bounds the outputs unacknowledged at any moment.
//!
//! * **Halving** (default): a task starts at Θ/2, L/2, Γ/2 and halves after every
//!   recovery, so failure k (counting from 0) runs with θ_k = Θ/2^(k+1). Over any
//!   number of failures the state errors sum to less than Θ. Once l or γ reach
//!   their floors (1 item, β outputs) they stop halving:
//!   [`ThresholdPolicy::bound_after`] sums the real values.
//! * **Fixed**: θ = Θ, l = L, γ = Γ forever, for unbounded streams where failures
//!   never stop; after k failures the bound is k·Θ.
//! * **Recovering** (window W items): halving, but a failure stops counting once
//!   W input items have passed since the offset its recovery resumed at, so the
//!   thresholds (and throughput) come back. The failures that count at any moment
//!   all lie within the last W items, so the failures of any stretch of W items add
//!   at most Θ between them; over a stream of N items the total is at most
//!   ⌈N/W⌉·Θ. The failure offsets that still count travel in the markers (the
//!   latest [`RECENT_FAILURES`] of them).
//! * **Parallel tasks**: the n tasks of an operator hold disjoint parts of its
//!   state, so the distance of the whole is their distances combined by the
//!   operator's norm. Under L1 (and key count) they add up: each task uses Θ/n
//!   before halving (Θ/(2n) at the start). Under L2 their squares add up: each
//!   task uses Θ/√n, as n·(Θ/√n)² = Θ², and a failure of every task moves the
//!   whole by at most √n·θ = Θ/2 at the start, the same as under L1; a split by
//!   n would make a task back up n times as often for a random-walk drift, for
//!   no tighter bound. A per-key maximum needs no split: every key lives in one
//!   partition. L and Γ count items and outputs, which add up: each task uses
//!   L/n and Γ/n (whole under a per-key maximum).
//! * **Pipelines**: with m chained operators, where one input makes at most β_p
//!   outputs, operator i (1-based) uses Θ/β_p^(m−i) before halving, so an error
//!   multiplied by β_p at each later stage still sums to the bound.
//! * **Windows**: a hopping window counts failures from the window's start, so the
//!   thresholds return to Θ/2 when it closes; a sliding window forgets a failure once
//!   it is older than the window; a decaying window keeps every failure (thresholds
//!   as without windows).

use serde::{Deserialize, Serialize};

use super::error::CoreError;
use super::operator::AnalysisConstants;
use super::structures::Norm;

/// The user's thresholds, global to a pipeline operator.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct GlobalThresholds {
    /// Θ: the most the state may diverge from its last backup.
    pub theta: f64,
    /// L: the most input items not covered by a backup and commit.
    pub max_uncovered: u64,
    /// Γ: the most outputs sent and not acknowledged.
    pub max_unacked: u64,
}

impl GlobalThresholds {
    pub fn new(theta: f64, max_uncovered: u64, max_unacked: u64) -> Result<Self, CoreError> {
        if theta.is_nan() {
            return Err(invalid("theta", theta, "NaN bounds nothing"));
        }
        if theta.is_infinite() {
            return Err(invalid(
                "theta",
                theta,
                "must be finite; use mode `none` for no backups",
            ));
        }
        if theta < 0.0 {
            return Err(invalid("theta", theta, "a divergence is never negative"));
        }
        if max_uncovered == 0 {
            return Err(invalid(
                "max_uncovered (L)",
                max_uncovered,
                "must be at least 1: the item being processed is never covered",
            ));
        }
        if max_unacked == 0 {
            return Err(invalid(
                "max_unacked (Γ)",
                max_unacked,
                "must be at least 1 or no output can be sent",
            ));
        }
        Ok(GlobalThresholds {
            theta,
            max_uncovered,
            max_unacked,
        })
    }
}

fn invalid(name: &'static str, value: impl ToString, reason: &'static str) -> CoreError {
    CoreError::InvalidThreshold {
        name,
        value: value.to_string(),
        reason,
    }
}

/// One task's thresholds at a moment.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct TaskThresholds {
    /// θ.
    pub theta: f64,
    /// l.
    pub max_uncovered: u64,
    /// γ.
    pub max_unacked: u64,
}

impl TaskThresholds {
    /// What one failure under these thresholds can introduce: θ of state
    /// divergence, and the outputs a replay of l items repeats (see the module
    /// docs).
    pub fn failure_bound(&self, constants: AnalysisConstants) -> ErrorBound {
        ErrorBound {
            state: self.theta,
            outputs: self.max_uncovered.saturating_mul(constants.beta) as f64,
            lost_outputs: 0.0,
        }
    }
}

/// A worst-case error: divergence of the state, repeated outputs, and lost
/// outputs (only a restart on a local store loses any:
/// [`crate::recovery::RecoveryPlan::local`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ErrorBound {
    pub state: f64,
    pub outputs: f64,
    #[serde(default)]
    pub lost_outputs: f64,
}

impl std::ops::Add for ErrorBound {
    type Output = ErrorBound;
    fn add(self, other: ErrorBound) -> ErrorBound {
        ErrorBound {
            state: self.state + other.state,
            outputs: self.outputs + other.outputs,
            lost_outputs: self.lost_outputs + other.lost_outputs,
        }
    }
}

/// How many failure offsets a marker carries for the recovering policy.
pub const RECENT_FAILURES: usize = 16;

/// How thresholds react to failures.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailurePolicy {
    #[default]
    Halving,
    Fixed,
    /// Halving, where a failure stops counting `window_items` input items after
    /// the offset its recovery resumed at.
    Recovering {
        window_items: u64,
    },
}

impl FailurePolicy {
    pub fn validate(&self) -> Result<(), CoreError> {
        match self {
            FailurePolicy::Recovering { window_items: 0 } => Err(CoreError::parameter(
                "recovering window",
                0,
                "a failure must count for at least one item",
            )),
            _ => Ok(()),
        }
    }

    /// The failures that still count at input offset `now`, of those that resumed
    /// at `resumed_at` (every failure counts unless the policy is recovering).
    pub fn counted(&self, resumed_at: &[u64], total: u32, now: u64) -> u32 {
        match *self {
            FailurePolicy::Recovering { window_items } => resumed_at
                .iter()
                .filter(|&&at| at.saturating_add(window_items) > now)
                .count() as u32,
            _ => total,
        }
    }
}

/// Where the task sits: parallel copies and pipeline position.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Placement {
    /// n: tasks of this operator (input partitions).
    pub parallelism: u32,
    /// i: this operator's position in the pipeline, 1-based.
    pub stage: u32,
    /// m: operators in the pipeline.
    pub stages: u32,
    /// β_p: the most outputs one input of a stage makes downstream.
    pub stage_fanout: f64,
}

impl Default for Placement {
    fn default() -> Self {
        Placement {
            parallelism: 1,
            stage: 1,
            stages: 1,
            stage_fanout: 1.0,
        }
    }
}

impl Placement {
    pub fn validate(&self) -> Result<(), CoreError> {
        if self.parallelism == 0 {
            return Err(CoreError::parameter(
                "parallelism",
                0,
                "an operator has at least one task",
            ));
        }
        if self.stages == 0 || self.stage == 0 || self.stage > self.stages {
            return Err(CoreError::parameter(
                "stage",
                format!("{}/{}", self.stage, self.stages),
                "the stage must be between 1 and the number of stages",
            ));
        }
        if !(self.stage_fanout.is_finite() && self.stage_fanout >= 1.0) {
            return Err(CoreError::parameter(
                "stage_fanout",
                self.stage_fanout,
                "an input makes at least one output downstream (β ≥ 1) and β is finite",
            ));
        }
        Ok(())
    }
}

/// Derives a task's thresholds from the global ones.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ThresholdPolicy {
    pub global: GlobalThresholds,
    pub failures: FailurePolicy,
    pub placement: Placement,
    /// The operator's divergence: how its tasks' distances combine
    /// ([`Norm::task_shares`]).
    pub norm: Norm,
    /// β of this operator: γ never falls below it, or no item could be taken.
    pub min_outputs: u64,
}

impl ThresholdPolicy {
    pub fn new(
        global: GlobalThresholds,
        failures: FailurePolicy,
        placement: Placement,
        norm: Norm,
        constants: AnalysisConstants,
    ) -> Result<Self, CoreError> {
        placement.validate()?;
        failures.validate()?;
        let policy = ThresholdPolicy {
            global,
            failures,
            placement,
            norm,
            min_outputs: constants.beta.max(1),
        };
        if policy.split_outputs() < constants.beta as f64 {
            return Err(invalid(
                "max_unacked (Γ)",
                global.max_unacked,
                "per task it must allow at least β outputs of one item in flight",
            ));
        }
        Ok(policy)
    }

    /// Tasks that split L and Γ between them.
    fn count_shares(&self) -> f64 {
        if self.norm.splits_counts() {
            f64::from(self.placement.parallelism)
        } else {
            1.0
        }
    }

    fn split_theta(&self) -> f64 {
        let later_stages = (self.placement.stages - self.placement.stage) as i32;
        let shares = self.norm.task_shares(self.placement.parallelism);
        self.global.theta / shares / self.placement.stage_fanout.powi(later_stages)
    }

    fn split_items(&self) -> f64 {
        self.global.max_uncovered as f64 / self.count_shares()
    }

    fn split_outputs(&self) -> f64 {
        self.global.max_unacked as f64 / self.count_shares()
    }

    /// The thresholds of a task that has recovered from `failures` failures.
    pub fn for_failures(&self, failures: u32) -> TaskThresholds {
        let divisor = match self.failures {
            FailurePolicy::Fixed => 1.0,
            FailurePolicy::Halving | FailurePolicy::Recovering { .. } => {
                2f64.powi(failures.saturating_add(1).min(1023) as i32)
            }
        };
        TaskThresholds {
            theta: self.split_theta() / divisor,
            max_uncovered: ((self.split_items() / divisor).floor() as u64).max(1),
            max_unacked: ((self.split_outputs() / divisor).floor() as u64).max(self.min_outputs),
        }
    }

    /// The worst-case total error after `failures` failures: the sum of each
    /// failure's bound under the thresholds in force when it happened.
    pub fn bound_after(&self, failures: u32, constants: AnalysisConstants) -> ErrorBound {
        (0..failures)
            .map(|k| self.for_failures(k).failure_bound(constants))
            .fold(ErrorBound::default(), |a, b| a + b)
    }

    /// The bound that halving guarantees for any number of failures, while l
    /// stays above its floor: Θ of state and L·β repeated outputs (split for
    /// this task).
    pub fn limit(&self, constants: AnalysisConstants) -> ErrorBound {
        ErrorBound {
            state: self.split_theta(),
            outputs: self.split_items() * constants.beta as f64,
            lost_outputs: 0.0,
        }
    }
}

/// How windows of the input forget failures.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum WindowPolicy {
    /// No windows: every failure counts for good.
    #[default]
    Unbounded,
    /// Fixed windows of `length` items: failures count from the window's start.
    Hopping { length: u64 },
    /// A window of the last `length` items: a failure stops counting once it is
    /// older than the window.
    Sliding { length: u64 },
    /// A decaying window: every failure counts (the weights decay, the thresholds
    /// stay).
    Decaying,
}

impl WindowPolicy {
    /// The failure count that sets the thresholds at input position `now`, given the
    /// positions at which failures happened.
    pub fn effective_failures(&self, failure_positions: &[u64], now: u64) -> u32 {
        let counted = |from: u64| failure_positions.iter().filter(|&&p| p >= from).count() as u32;
        match *self {
            WindowPolicy::Unbounded | WindowPolicy::Decaying => failure_positions.len() as u32,
            WindowPolicy::Hopping { length } => counted(now - now % length.max(1)),
            WindowPolicy::Sliding { length } => counted(now.saturating_sub(length)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ONE: AnalysisConstants = AnalysisConstants { alpha: 1.0, beta: 1 };

    fn policy(theta: f64, items: u64, outputs: u64) -> ThresholdPolicy {
        ThresholdPolicy::new(
            GlobalThresholds::new(theta, items, outputs).unwrap(),
            FailurePolicy::Halving,
            Placement::default(),
            Norm::L1,
            ONE,
        )
        .unwrap()
    }

    #[test]
    fn invalid_thresholds_are_typed_errors() {
        for (theta, items, outputs) in [
            (f64::NAN, 1, 1),
            (-1.0, 1, 1),
            (f64::INFINITY, 1, 1),
            (1.0, 0, 1),
            (1.0, 1, 0),
        ] {
            let err = GlobalThresholds::new(theta, items, outputs).unwrap_err();
            assert!(matches!(err, CoreError::InvalidThreshold { .. }), "{err}");
            assert!(!err.to_string().is_empty());
        }
        assert!(GlobalThresholds::new(0.0, 1, 1).is_ok());
    }

    #[test]
    fn halving_starts_at_half_and_halves() {
        let p = policy(1024.0, 1024, 1024);
        assert_eq!(p.for_failures(0).theta, 512.0);
        assert_eq!(p.for_failures(1).theta, 256.0);
        assert_eq!(p.for_failures(3).max_uncovered, 64);
        assert_eq!(p.for_failures(20).max_uncovered, 1, "l floors at one item");
        assert_eq!(p.for_failures(20).max_unacked, 1, "γ floors at β");
    }

    #[test]
    fn halving_bound_does_not_grow_with_failures() {
        let p = policy(1e5, 1 << 20, 1 << 20);
        let limit = p.limit(ONE);
        for k in [1, 5, 10, 19] {
            let bound = p.bound_after(k, ONE);
            assert!(bound.state < limit.state, "k={k}: {bound:?} vs {limit:?}");
            assert!(bound.outputs < limit.outputs);
        }
    }

    #[test]
    fn the_halving_limit_is_theta_and_l_beta_whatever_alpha() {
        let p = policy(1000.0, 100, 50);
        let c = AnalysisConstants { alpha: 2.0, beta: 3 };
        let limit = p.limit(c);
        assert_eq!((limit.state, limit.outputs), (1000.0, 100.0 * 3.0));
    }

    #[test]
    fn fixed_bound_grows_linearly() {
        let mut p = policy(100.0, 10, 10);
        p.failures = FailurePolicy::Fixed;
        assert_eq!(p.for_failures(7).theta, 100.0);
        assert_eq!(p.bound_after(3, ONE).state, 3.0 * 100.0);
        assert_eq!(p.bound_after(3, ONE).outputs, 3.0 * 10.0);
        let wide = AnalysisConstants { alpha: 2.0, beta: 3 };
        let one = p.for_failures(0).failure_bound(wide);
        assert_eq!((one.state, one.outputs), (100.0, 10.0 * 3.0));
    }

    #[test]
    fn recovering_failures_stop_counting_after_their_window() {
        let recovering = FailurePolicy::Recovering { window_items: 100 };
        assert_eq!(recovering.counted(&[10, 150, 260], 3, 240), 2);
        assert_eq!(
            recovering.counted(&[10, 150, 260], 3, 250),
            1,
            "150 stops counting at 250"
        );
        assert_eq!(recovering.counted(&[10, 150, 260], 3, 360), 0);
        assert_eq!(FailurePolicy::Halving.counted(&[10], 7, 1_000_000), 7);
        let mut p = policy(1024.0, 1024, 1024);
        p.failures = recovering;
        assert_eq!(
            p.for_failures(1).theta,
            256.0,
            "halves like the default while it counts"
        );
        let global = GlobalThresholds::new(1.0, 1, 1).unwrap();
        let zero = FailurePolicy::Recovering { window_items: 0 };
        assert!(ThresholdPolicy::new(global, zero, Placement::default(), Norm::L1, ONE).is_err());
    }

    #[test]
    fn splits_for_parallel_tasks_and_pipelines() {
        let global = GlobalThresholds::new(800.0, 800, 800).unwrap();
        let placement = Placement {
            parallelism: 4,
            stage: 1,
            stages: 2,
            stage_fanout: 2.0,
        };
        let additive = ThresholdPolicy::new(global, FailurePolicy::Halving, placement, Norm::L1, ONE).unwrap();
        assert_eq!(additive.for_failures(0).theta, 800.0 / 4.0 / 2.0 / 2.0);
        assert_eq!(additive.for_failures(0).max_uncovered, 100);
        let euclidean = ThresholdPolicy::new(global, FailurePolicy::Halving, placement, Norm::L2, ONE).unwrap();
        assert_eq!(
            euclidean.for_failures(0).theta,
            800.0 / 2.0 / 2.0 / 2.0,
            "Θ/√4 under L2"
        );
        assert_eq!(
            euclidean.for_failures(0).max_uncovered,
            100,
            "L/n under L2 all the same"
        );
        assert_eq!(euclidean.for_failures(0).max_unacked, 100, "Γ/n under L2 all the same");
        let per_key = ThresholdPolicy::new(global, FailurePolicy::Halving, placement, Norm::Max, ONE).unwrap();
        assert_eq!(per_key.for_failures(0).theta, 800.0 / 2.0 / 2.0);
        let last_stage = Placement { stage: 2, ..placement };
        let last = ThresholdPolicy::new(global, FailurePolicy::Halving, last_stage, Norm::Max, ONE).unwrap();
        assert_eq!(last.for_failures(0).theta, 400.0);
        let bad = Placement { stage: 3, ..placement };
        assert!(ThresholdPolicy::new(global, FailurePolicy::Halving, bad, Norm::Max, ONE).is_err());
        assert_eq!(additive.for_failures(0).max_unacked, 100, "Γ/n before halving");
        for bad in [
            Placement { stage: 0, ..placement },
            Placement { stages: 0, ..placement },
            Placement {
                parallelism: 0,
                ..placement
            },
            Placement {
                stage_fanout: f64::INFINITY,
                ..placement
            },
            Placement {
                stage_fanout: f64::NAN,
                ..placement
            },
            Placement {
                stage_fanout: 0.5,
                ..placement
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
        assert!(placement.validate().is_ok());
    }

    #[test]
    fn the_tasks_shares_of_theta_combine_to_theta() {
        let theta = 1000.0;
        for n in 1..=9u32 {
            // The distance of n disjoint parts at d each, by the norm's own definition.
            let expected = |norm: Norm, d: f64| match norm {
                Norm::L1 | Norm::KeyCount => f64::from(n) * d,
                Norm::L2 => (f64::from(n) * d * d).sqrt(),
                Norm::Max => d,
            };
            for norm in [Norm::L1, Norm::L2, Norm::Max, Norm::KeyCount] {
                let share = theta / norm.task_shares(n);
                let whole = (1..n).fold(share, |acc, _| norm.combine(acc, share));
                assert!((whole - theta).abs() < 1e-9, "{norm:?}, {n} tasks: {whole}");
                assert!((expected(norm, share) - theta).abs() < 1e-9, "{norm:?}, {n} tasks");
            }
        }
        assert_eq!(Norm::L2.combine(3.0, 4.0), 5.0);
        assert_eq!(Norm::L1.combine(3.0, 4.0), 7.0);
        assert_eq!(Norm::Max.combine(3.0, 4.0), 4.0);
        assert!(Norm::L2.splits_counts() && Norm::L1.splits_counts() && !Norm::Max.splits_counts());
    }

    #[test]
    fn gamma_must_fit_one_item() {
        let global = GlobalThresholds::new(1.0, 10, 3).unwrap();
        let wide = AnalysisConstants { alpha: 1.0, beta: 8 };
        assert!(ThresholdPolicy::new(global, FailurePolicy::Halving, Placement::default(), Norm::L1, wide).is_err());
    }

    #[test]
    fn windows_forget_failures() {
        let failures = [10, 150, 260];
        assert_eq!(WindowPolicy::Unbounded.effective_failures(&failures, 300), 3);
        assert_eq!(WindowPolicy::Decaying.effective_failures(&failures, 300), 3);
        assert_eq!(
            WindowPolicy::Hopping { length: 100 }.effective_failures(&failures, 270),
            1
        );
        assert_eq!(
            WindowPolicy::Hopping { length: 100 }.effective_failures(&failures, 300),
            0
        );
        assert_eq!(
            WindowPolicy::Sliding { length: 200 }.effective_failures(&failures, 300),
            2
        );
    }
}
