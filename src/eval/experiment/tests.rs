//! Tests of `experiment`.

use super::kills::kill_points;
use super::*;

fn options(instances: usize, partitions: usize) -> ExperimentOptions {
    ExperimentOptions {
        config: PathBuf::from("unused.toml"),
        items: 1_000,
        partitions,
        failures: vec![1],
        node_loss: false,
        kill_mid_backup: false,
        instances,
        kill_mid_rebalance: false,
        thetas: Vec::new(),
        max_uncovered: Vec::new(),
        seed: 1,
        dir: PathBuf::from("unused"),
    }
}

fn refusal(options: &ExperimentOptions) -> String {
    match validate_kills(options) {
        Err(error) => error.to_string(),
        Ok(()) => String::new(),
    }
}

#[test]
fn kinds_of_kill_that_cannot_be_made_are_refused_naming_the_flags() {
    assert!(validate_kills(&options(1, 2)).is_ok());
    assert!(validate_kills(&options(2, 2)).is_ok());
    assert!(refusal(&options(0, 2)).contains("--instances must be 1 or more"));
    assert!(refusal(&options(3, 2)).contains("--instances 3 needs as many partitions (--partitions 2)"));
    let mid_rebalance_alone = ExperimentOptions {
        kill_mid_rebalance: true,
        ..options(1, 2)
    };
    assert!(refusal(&mid_rebalance_alone).contains("--kill-mid-rebalance needs --instances 2"));
    let with_two = ExperimentOptions {
        kill_mid_rebalance: true,
        ..options(2, 2)
    };
    assert!(validate_kills(&with_two).is_ok());
    let mid_backup_on_two = ExperimentOptions {
        kill_mid_backup: true,
        ..options(2, 2)
    };
    assert!(refusal(&mid_backup_on_two).contains("--kill-mid-backup runs one instance"));
}

#[test]
fn kill_points_are_seeded_ordered_and_inside_the_input() {
    let options = options(1, 2);
    let (points, _) = kill_points(&options, 10);
    let (again, _) = kill_points(&options, 10);
    assert_eq!(points, again, "the same seed, the same points");
    assert_eq!(points.len(), 10);
    assert!(points.windows(2).all(|w| w[0] <= w[1]), "{points:?}");
    assert!(points.iter().all(|&p| (50..900).contains(&p)), "{points:?}");
}
