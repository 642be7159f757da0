//! One candidate's measurement: the pipeline's tasks run over the sample in
//! the core's harness (the driver the service runs, on a simulated broker),
//! once failure-free and once with crashes at seeded points; the crashed
//! run's final state against the failure-free one's, in the operator's own
//! divergence, is the error measured.
//!
//! Every task crashes K times, as the bound assumes (each failure takes every
//! task down).

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::core::harness::{simulate, SimulationOptions};
use crate::core::{ControllerConfig, CoreError, Norm, Operator};

/// What one candidate's runs measured, summed over the tasks.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Measurement {
    /// Changelog records (entries and markers) of the failure-free runs,
    /// before their clean stop (whose complete backup is no running cost).
    pub changelog_records: u64,
    /// Items of the failure-free runs.
    pub items: u64,
    /// The crashed runs' final states against the failure-free ones, combined
    /// over tasks as the norm combines disjoint parts (summed under L1, root
    /// of the summed squares under L2, the largest under a per-key maximum).
    pub error: f64,
    /// Items processed again after a crash, summed over recoveries.
    pub replayed: u64,
    pub recoveries: u64,
    /// Guarantees the harness found broken (none, unless the engine is wrong).
    pub violations: u64,
}

/// The crash points of each task's stream: `failures` crashes each, seeded
/// (a task of one item or none cannot crash after an item and before its end).
pub fn crash_points(streams: &[usize], failures: u32, seed: u64) -> Vec<Vec<u64>> {
    let mut rng = StdRng::seed_from_u64(seed);
    streams
        .iter()
        .map(|&len| {
            let mut points: Vec<u64> = if len > 1 {
                (0..failures).map(|_| rng.gen_range(1..len as u64)).collect()
            } else {
                Vec::new()
            };
            points.sort_unstable();
            points
        })
        .collect()
}

/// Runs every task's stream failure-free and with its crashes.
pub fn measure<O>(
    controller: ControllerConfig,
    build: &dyn Fn() -> O,
    streams: &[Vec<O::Input>],
    crashes: &[Vec<u64>],
    norm: Norm,
    seed: u64,
) -> Result<Measurement, CoreError>
where
    O: Operator + Clone,
    O::Output: Clone,
{
    let mut total = Measurement::default();
    for (stream, crash_after) in streams.iter().zip(crashes) {
        let quiet = SimulationOptions {
            seed,
            ..SimulationOptions::default()
        };
        let (clean, report) = simulate(controller, build, stream, quiet)?;
        total.changelog_records += report.changelog_records_before_stop;
        total.items += stream.len() as u64;
        if crash_after.is_empty() {
            continue;
        }
        let crashing = SimulationOptions {
            seed,
            crash_after: crash_after.clone(),
            ..SimulationOptions::default()
        };
        let (failed, report) = simulate(controller, build, stream, crashing)?;
        let error = failed.distance(&clean);
        total.error = norm.combine(total.error, error);
        total.replayed += report
            .recoveries
            .iter()
            .map(|r| r.crash_item_offset.saturating_sub(r.resume_offset))
            .sum::<u64>();
        total.recoveries += report.recoveries.len() as u64;
        total.violations += report.violations.len() as u64;
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_crashes_k_times_between_its_first_item_and_its_end() {
        let points = crash_points(&[100, 0, 1, 80], 3, 1);
        assert_eq!(points.iter().map(Vec::len).collect::<Vec<_>>(), vec![3, 0, 0, 3]);
        for (points, len) in points.iter().zip([100u64, 0, 1, 80]) {
            assert!(points.windows(2).all(|w| w[0] <= w[1]));
            assert!(points.iter().all(|&p| p >= 1 && p < len));
        }
        assert_eq!(crash_points(&[100], 3, 9), crash_points(&[100], 3, 9));
    }
}
