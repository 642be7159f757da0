//! Proof by test: random streams, random crash points (also during backups and right
//! after recoveries), random poll batches, acknowledgements that arrive late and
//! in batches, changelog writes reported failed that reached the log all the same,
//! and a changelog compacted at random, recovered by the task driver the service
//! runs. The harness checks at every crash that no output before the recovery
//! point is lost, that only the outputs of replayed items repeat, that the
//! restored state is the one logged at the last marker (found by position in
//! the uncompacted log), and after every recovery that the caught-up state is
//! within θ of the lost one, with θ computed from Θ and k on its own. Here we also check that operators end
//! within the summed bound of a failure-free run, and that a store which drops
//! backups, a driver that skips them and a controller that never halves are
//! caught.

mod common;

use afstream_core::harness::{simulate, SimulatedTask, SimulationOptions, SimulationReport, Violation};
use afstream_core::operators::*;
use afstream_core::recovery::ResumeSource;
use afstream_core::workloads;
use afstream_core::{
    ControllerConfig, ControllerFaults, DriverFaults, ExactInterval, FailurePolicy, GlobalThresholds, KeyStore,
    MemoryKeyStore, Mode, Operator, Placement, ThresholdPolicy,
};
use proptest::prelude::*;

fn controller(op: &impl Operator, mode: Mode, theta: f64, items: u64, outputs: u64) -> ControllerConfig {
    let global = GlobalThresholds::new(theta, items, outputs).unwrap();
    ControllerConfig::single_task(mode, global, op.constants(), op.norm()).unwrap()
}

#[derive(Clone, Debug)]
struct Failures {
    seed: u64,
    crash_after: Vec<u64>,
    during_backup: bool,
    max_ack_delay: u64,
    max_batch: usize,
    write_failure_rate: f64,
    /// Crashed owners' writes land late, behind the next run's (zombies).
    zombie_writes: bool,
}

impl Failures {
    fn options(&self) -> SimulationOptions {
        SimulationOptions {
            seed: self.seed,
            crash_after: self.crash_after.clone(),
            crash_during_backup: self.during_backup,
            max_ack_delay: self.max_ack_delay,
            max_batch: self.max_batch,
            write_failure_rate: self.write_failure_rate,
            zombie_writes: self.zombie_writes,
            ..SimulationOptions::default()
        }
    }
}

/// 1 to 6 crash points over `len` items; some come in pairs a few items apart, so a
/// task also crashes right after a recovery.
fn failures(len: u64) -> impl Strategy<Value = Failures> {
    (
        any::<u64>(),
        prop::collection::vec((1..len, 0u64..4, any::<bool>()), 1..6),
        any::<bool>(),
        1u64..16,
        1usize..200,
        prop_oneof![Just(0.0), Just(0.2)],
        any::<bool>(),
    )
        .prop_map(
            |(seed, points, during_backup, max_ack_delay, max_batch, write_failure_rate, zombie_writes)| {
                let mut crash_after = Vec::new();
                for (at, gap, twice) in points {
                    crash_after.push(at);
                    if twice {
                        crash_after.push(at + gap);
                    }
                }
                crash_after.sort_unstable();
                Failures {
                    seed,
                    crash_after,
                    during_backup,
                    max_ack_delay,
                    max_batch,
                    write_failure_rate,
                    zombie_writes,
                }
            },
        )
}

fn config() -> ProptestConfig {
    common::proptest_config(24)
}

fn assert_no_violations(report: &SimulationReport) {
    assert!(report.violations.is_empty(), "violations: {:?}", report.violations);
    assert!(!report.recoveries.is_empty() || report.items_processed() > 0);
}

/// Runs with the failures and without, checks the harness's per-crash properties,
/// and returns (with failures, without, the total bound of all failures).
fn run_both<O>(build: &dyn Fn() -> O, config: ControllerConfig, stream: &[O::Input], failures: &Failures) -> (O, O, f64)
where
    O: Operator + Clone + 'static,
    O::Output: Clone,
{
    let (failed, report) = simulate(config, build, stream, failures.options()).unwrap();
    assert_no_violations(&report);
    let quiet = SimulationOptions {
        seed: failures.seed,
        ..SimulationOptions::default()
    };
    let (clean, clean_report) = simulate(config, build, stream, quiet).unwrap();
    assert!(clean_report.violations.is_empty());
    // The harness computed each failure's bound from Θ, L and k on its own.
    let bound = report.recoveries.iter().map(|r| r.bound).sum();
    (failed, clean, bound)
}

fn within(observed: f64, bound: f64) -> bool {
    observed <= bound * (1.0 + 1e-9) + 1e-9
}

/// Runs the stream with and without the failures: the final states differ by
/// at most the summed bound of the failures.
fn final_error_within_bound<O>(
    build: &dyn Fn() -> O,
    config: ControllerConfig,
    stream: &[O::Input],
    failures: &Failures,
) -> Result<(), TestCaseError>
where
    O: Operator + Clone + 'static,
    O::Output: Clone,
{
    let (failed, clean, bound) = run_both(build, config, stream, failures);
    let observed = failed.distance(&clean);
    prop_assert!(within(observed, bound), "final drift {observed} over bound {bound}");
    Ok(())
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn heavy_hitters_stay_within_the_bound(
        seed in any::<u64>(),
        theta in 1_000.0..60_000.0f64,
        items in 1u64..64,
        outputs in 2u64..32,
        failures in failures(2_000),
    ) {
        let stream = workloads::zipf_flows(2_000, 300, 1.1, seed);
        let config = HeavyHitterConfig { max_weight: 1500, threshold: HitterThreshold::Bytes(50_000.0), ..Default::default() };
        let build = move || HeavyHitters::new(config).unwrap();
        let cfg = controller(&build(), Mode::Approximate, theta, items, outputs);
        final_error_within_bound(&build, cfg, &stream, &failures)?;
    }

    #[test]
    fn join_stays_within_the_bound(
        seed in any::<u64>(),
        theta in 1.0..200.0f64,
        items in 1u64..64,
        failures in failures(3_000),
    ) {
        let stream = workloads::join_streams(3_000, 50, seed);
        let config = JoinConfig { sampling_rate: 0.3, emit_every: 50 };
        let build = move || OnlineJoin::new(config).unwrap();
        let cfg = controller(&build(), Mode::Approximate, theta, items, 16);
        final_error_within_bound(&build, cfg, &stream, &failures)?;
    }

    #[test]
    fn keyed_counts_stay_within_the_bound(
        seed in any::<u64>(),
        theta in 1.0..300.0f64,
        items in 1u64..64,
        outputs in 1u64..32,
        max_norm in any::<bool>(),
        failures in failures(2_000),
    ) {
        let stream = workloads::keyed_values(2_000, 100, seed);
        let divergence = if max_norm { afstream_core::Norm::Max } else { afstream_core::Norm::L1 };
        let config = KeyedAggregationConfig { aggregate: Aggregate::Count, divergence, max_abs_value: 10.0 };
        let build = move || KeyedAggregation::new(config).unwrap();
        let cfg = controller(&build(), Mode::Approximate, theta, items, outputs);
        final_error_within_bound(&build, cfg, &stream, &failures)?;
    }

    #[test]
    fn keyed_counts_under_the_recovering_policy_stay_within_the_bound(
        seed in any::<u64>(),
        theta in 1.0..300.0f64,
        items in 1u64..64,
        window in 50u64..800,
        failures in failures(2_000),
    ) {
        let stream = workloads::keyed_values(2_000, 100, seed);
        let config = KeyedAggregationConfig { aggregate: Aggregate::Count, divergence: afstream_core::Norm::Max, max_abs_value: 10.0 };
        let build = move || KeyedAggregation::new(config).unwrap();
        let op = build();
        let global = GlobalThresholds::new(theta, items, 16).unwrap();
        let policy = ThresholdPolicy::new(
            global,
            FailurePolicy::Recovering { window_items: window },
            Placement::default(),
            op.norm(),
            op.constants(),
        )
        .unwrap();
        let cfg = ControllerConfig::new(Mode::Approximate, policy, op.constants());
        final_error_within_bound(&build, cfg, &stream, &failures)?;
    }

    #[test]
    fn keyed_sums_stay_within_the_bound(
        seed in any::<u64>(),
        theta in 1.0..500.0f64,
        items in 1u64..32,
        failures in failures(1_500),
    ) {
        let stream = workloads::keyed_values(1_500, 50, seed);
        let config = KeyedAggregationConfig { aggregate: Aggregate::Sum, divergence: afstream_core::Norm::L1, max_abs_value: 10.0 };
        let build = move || KeyedAggregation::new(config).unwrap();
        let cfg = controller(&build(), Mode::Approximate, theta, items, 8);
        final_error_within_bound(&build, cfg, &stream, &failures)?;
    }

    #[test]
    fn word_count_stays_within_the_bound(
        seed in any::<u64>(),
        theta in 1.0..400.0f64,
        items in 1u64..32,
        failures in failures(1_000),
    ) {
        let stream = workloads::text_lines(1_000, 8, 200, seed);
        let config = WordCountConfig { divergence: afstream_core::Norm::L1, max_words_per_line: 8 };
        let build = move || WordCount::new(config).unwrap();
        let cfg = controller(&build(), Mode::Approximate, theta, items, 32);
        final_error_within_bound(&build, cfg, &stream, &failures)?;
    }

    #[test]
    fn word_count_on_a_store_with_a_tiny_memory_budget_stays_within_the_bound(
        seed in any::<u64>(),
        theta in 1.0..400.0f64,
        items in 1u64..32,
        resident in 0usize..16,
        max_norm in any::<bool>(),
        failures in failures(1_000),
    ) {
        let stream = workloads::text_lines(1_000, 8, 200, seed);
        let divergence = if max_norm { afstream_core::Norm::Max } else { afstream_core::Norm::L1 };
        let config = WordCountConfig { divergence, max_words_per_line: 8 };
        // Each recovery starts on an empty store (a lost node) and restores
        // from the changelog; most words live only in the store between batches.
        let build = move || WordCount::with_store(config, Box::new(MemoryKeyStore::write_through()), resident).unwrap();
        let cfg = controller(&build(), Mode::Approximate, theta, items, 32);
        final_error_within_bound(&build, cfg, &stream, &failures)?;
    }

    #[test]
    fn word_count_restarting_on_its_local_store_stays_within_the_bound(
        seed in any::<u64>(),
        theta in 1.0..400.0f64,
        items in 1u64..32,
        max_norm in any::<bool>(),
        keep in prop_oneof![Just(0.5), Just(1.0)],
        failures in failures(1_000),
    ) {
        let stream = workloads::text_lines(1_000, 8, 200, seed);
        let divergence = if max_norm { afstream_core::Norm::Max } else { afstream_core::Norm::L1 };
        let config = WordCountConfig { divergence, max_words_per_line: 8 };
        let build_on = move |store: Box<dyn KeyStore>| WordCount::with_store(config, store, 1 << 20).unwrap();
        let build = move || WordCount::new(config).unwrap();
        let cfg = controller(&build(), Mode::Approximate, theta, items, 32);
        // A restart on the store is a process that died (a stalled one keeps
        // its store locked): its writes do not land late.
        let options = SimulationOptions { local_restarts: keep, zombie_writes: false, ..failures.options() };
        let (failed, report) = SimulatedTask::on_local_store(cfg, &build_on, options).unwrap().run(&stream).unwrap();
        assert_no_violations(&report);
        let (clean, _) = simulate(cfg, &build, &stream, SimulationOptions { seed, ..SimulationOptions::default() }).unwrap();
        let bound: f64 = report.recoveries.iter().map(|r| r.bound).sum();
        let observed = failed.distance(&clean);
        prop_assert!(within(observed, bound), "final drift {observed} over bound {bound}");
        if keep == 1.0 {
            prop_assert_eq!(observed, 0.0, "a task that always restarts on its store is exact");
        }
    }

    #[test]
    fn logistic_regression_recovers_within_the_bound_and_its_loss_comes_back(
        seed in any::<u64>(),
        theta in 0.05..2.0f64,
        items in 1u64..32,
        failures in failures(3_000),
    ) {
        let (stream, _) = workloads::separable_vectors(3_000, 32, 6, seed);
        let (test, _) = workloads::separable_vectors(500, 32, 6, seed);
        let config = LogisticConfig { feature_bits: 8, learning_rate: 0.5, max_feature_norm: 3.0 };
        let build = move || OnlineLogisticRegression::new(config).unwrap();
        let cfg = controller(&build(), Mode::Approximate, theta, items, 8);
        // Per recovery, the harness checks θ; the final weights of an SGD run
        // need not stay near a failure-free run's, but its loss must come back.
        let (failed, clean, _) = run_both(&build, cfg, &stream, &failures);
        let (_, loss_failed) = failed.evaluate(&test);
        let (_, loss_clean) = clean.evaluate(&test);
        prop_assert!(loss_failed <= loss_clean * 1.15 + 0.02, "loss {loss_failed} vs failure-free {loss_clean}");
    }

    #[test]
    fn exact_mode_stays_within_its_interval(
        seed in any::<u64>(),
        interval in 1u64..50,
        failures in failures(1_500),
    ) {
        let stream = workloads::keyed_values(1_500, 80, seed);
        let build = || KeyedAggregation::new(KeyedAggregationConfig::default()).unwrap();
        let mode = Mode::Exact(ExactInterval { items: Some(interval), millis: None });
        let cfg = controller(&build(), mode, 1.0, 1, 1);
        // Exact at its markers; a crash during a backup applies at most two
        // intervals twice to the keys that backup wrote.
        final_error_within_bound(&build, cfg, &stream, &failures)?;
    }

    #[test]
    fn exact_mode_is_exact_when_no_backup_is_interrupted(
        seed in any::<u64>(),
        interval in 1u64..50,
        failures in failures(1_500),
    ) {
        let stream = workloads::keyed_values(1_500, 80, seed);
        let build = || KeyedAggregation::new(KeyedAggregationConfig::default()).unwrap();
        let mode = Mode::Exact(ExactInterval { items: Some(interval), millis: None });
        let cfg = controller(&build(), mode, 1.0, 1, 1);
        let options = SimulationOptions {
            crash_during_backup: false,
            crash_when_changelog_idle: true,
            write_failure_rate: 0.0,
            ..failures.options()
        };
        let (failed, report) = simulate(cfg, &build, &stream, options).unwrap();
        assert_no_violations(&report);
        let (clean, _) = simulate(cfg, &build, &stream, SimulationOptions::default()).unwrap();
        // The log ends with a marker over every entry: restored exactly, replayed
        // from exactly there.
        prop_assert_eq!(failed.distance(&clean), 0.0);
        for recovery in &report.recoveries {
            prop_assert_eq!(recovery.observed.unwrap_or(0.0), 0.0);
        }
    }

    #[test]
    fn grep_loses_no_committed_output(
        seed in any::<u64>(),
        items in 1u64..16,
        failures in failures(1_000),
    ) {
        let stream = workloads::text_lines(1_000, 4, 50, seed);
        let build = || Grep::new("w1\\b").unwrap();
        let cfg = controller(&build(), Mode::Approximate, 0.0, items, 4);
        // The harness's LostOutput and RepeatedOutputs checks are what matter here.
        let _ = run_both(&build, cfg, &stream, &failures);
    }
}

#[test]
fn failure_free_run_equals_processing_the_stream_directly() {
    let stream = workloads::zipf_flows(5_000, 200, 1.1, 7);
    let config = HeavyHitterConfig {
        max_weight: 1500,
        threshold: HitterThreshold::Bytes(100_000.0),
        ..Default::default()
    };
    let build = move || HeavyHitters::new(config).unwrap();
    let cfg = controller(&build(), Mode::Approximate, 5_000.0, 16, 8);
    let (simulated, report) = simulate(cfg, &build, &stream, SimulationOptions::default()).unwrap();
    let mut direct = build();
    let mut outputs = Vec::new();
    for packet in &stream {
        direct.process(packet, &mut outputs).unwrap();
    }
    assert_eq!(simulated.distance(&direct), 0.0);
    assert!(report.totals.backups > 0 && report.totals.markers > report.totals.backups);
    assert!(report.totals.commits > 0);
    assert_eq!(report.outputs_delivered, outputs.len() as u64);
}

/// A crash that keeps the local store, and right after the restart one that
/// loses it (the machine): the changelog must hold what the store's state
/// owed it before the restart's start marker, or the next owner resumes at
/// the store's offset over an older state.
#[test]
fn a_restart_on_the_local_store_then_a_lost_store_stays_within_the_bound() {
    let stream = workloads::keyed_values(3_000, 40, 5);
    let build_on = |store: Box<dyn KeyStore>| {
        KeyedAggregation::with_store(KeyedAggregationConfig::default(), store, 1 << 20).unwrap()
    };
    let build = || KeyedAggregation::new(KeyedAggregationConfig::default()).unwrap();
    let cfg = controller(&build(), Mode::Approximate, 200.0, 400, 64);
    let mut local_restarts_then_lost = 0;
    for seed in 0..60 {
        let options = SimulationOptions {
            seed,
            crash_after: vec![1_000 + seed * 13, 1_000 + seed * 13 + seed % 4, 2_200, 2_201],
            local_restarts: 0.5,
            max_batch: 16,
            ..SimulationOptions::default()
        };
        let (_, report) = SimulatedTask::on_local_store(cfg, &build_on, options)
            .unwrap()
            .run(&stream)
            .unwrap();
        assert!(report.violations.is_empty(), "seed {seed}: {:?}", report.violations);
        local_restarts_then_lost += report
            .recoveries
            .windows(2)
            .filter(|pair| pair[0].source == ResumeSource::LocalStore && pair[1].source == ResumeSource::Marker)
            .count();
    }
    assert!(
        local_restarts_then_lost > 5,
        "only {local_restarts_then_lost} local restarts were followed by a loss"
    );
}

/// A crash between a poll batch and the store write after it, with store
/// writes held back for a few rounds at random (as a delivery's backoff holds
/// them in the service): the batches' outputs went out, their state never
/// reached the store, so a restart on the store replays them and repeats
/// their outputs. The driver takes at most one batch past the last write, so
/// at most one batch of outputs (β each) repeats, and the recovery's own
/// bound must say so: the harness reports a restart whose bound claims fewer
/// repeats than it made.
#[test]
fn a_crash_before_the_store_write_repeats_at_most_one_poll_batch_of_outputs() {
    let stream = workloads::keyed_values(4_000, 40, 9);
    let build_on = |store: Box<dyn KeyStore>| {
        KeyedAggregation::with_store(KeyedAggregationConfig::default(), store, 1 << 20).unwrap()
    };
    let build = || KeyedAggregation::new(KeyedAggregationConfig::default()).unwrap();
    let beta = build().constants().beta;
    let max_batch = 64u64;
    let mut repeated_total = 0;
    // Γ = 4 (γ = 2 outputs, far fewer than a batch makes: repeats beyond γ
    // are the restart's own to claim) and Γ = 2 000 (full batches, several
    // taken while writes are held unless the driver waits for one).
    for (seed, gamma) in (0..40).map(|seed| (seed, if seed % 2 == 0 { 4 } else { 2_000 })) {
        let cfg = controller(&build(), Mode::Approximate, 200.0, 400, gamma);
        let crash_after: Vec<u64> = (1..=8).map(|n| n * 400 + seed * 7).collect();
        let crashes = crash_after.len() as u64;
        let options = SimulationOptions {
            seed,
            crash_after,
            local_restarts: 1.0,
            held_store_writes: 0.3,
            max_batch: max_batch as usize,
            ..SimulationOptions::default()
        };
        let (_, report, delivered) = SimulatedTask::on_local_store(cfg, &build_on, options)
            .unwrap()
            .run_with_outputs(&stream)
            .unwrap();
        assert!(report.violations.is_empty(), "seed {seed}: {:?}", report.violations);
        assert!(report.recoveries.iter().all(|r| r.source == ResumeSource::LocalStore));
        let mut per_item = std::collections::HashMap::new();
        for (offset, _) in &delivered {
            *per_item.entry(*offset).or_insert(0u64) += 1;
        }
        let repeated: u64 = per_item.values().map(|n| n.saturating_sub(beta)).sum();
        assert!(
            repeated <= crashes * max_batch * beta,
            "seed {seed}: {repeated} outputs repeated by {crashes} restarts"
        );
        repeated_total += repeated;
    }
    assert!(repeated_total > 0, "no crash came between a batch and its store write");
}

/// A store that acknowledges backups without keeping them: the controller believes
/// it is covered, and the bound checks must catch it.
#[test]
fn a_store_that_drops_backups_is_caught() {
    let stream = workloads::keyed_values(3_000, 20, 3);
    let build = || KeyedAggregation::new(KeyedAggregationConfig::default()).unwrap();
    let cfg = controller(&build(), Mode::Approximate, 50.0, 8, 4);
    let options = SimulationOptions {
        seed: 1,
        crash_after: vec![2_000],
        drop_backups: true,
        ..SimulationOptions::default()
    };
    let (_, report) = simulate(cfg, &build, &stream, options).unwrap();
    assert!(
        report
            .violations
            .iter()
            .any(|v| matches!(v, Violation::StateBound { .. })),
        "expected a state-bound violation, got {:?}",
        report.violations
    );
}

/// A driver that takes backups but writes none of their entries (and reports them
/// written) must be caught by the harness's own bound check.
#[test]
fn a_driver_that_skips_backups_is_caught() {
    let stream = workloads::keyed_values(3_000, 20, 3);
    let build = || KeyedAggregation::new(KeyedAggregationConfig::default()).unwrap();
    let cfg = controller(&build(), Mode::Approximate, 50.0, 8, 4);
    let options = SimulationOptions {
        seed: 2,
        crash_after: vec![2_500],
        driver_faults: DriverFaults { skip_backups: true },
        ..SimulationOptions::default()
    };
    let (_, report) = simulate(cfg, &build, &stream, options.clone()).unwrap();
    assert!(
        report
            .violations
            .iter()
            .any(|v| matches!(v, Violation::StateBound { .. })),
        "expected a state-bound violation, got {:?}",
        report.violations
    );
    // The same crash with an honest driver stays inside the bound.
    let honest = SimulationOptions {
        driver_faults: DriverFaults::default(),
        ..options
    };
    let (_, report) = simulate(cfg, &build, &stream, honest).unwrap();
    assert!(report.violations.is_empty(), "{:?}", report.violations);
}

/// A controller that keeps the thresholds of failure 0 after every recovery. The
/// harness computes each failure's bound from Θ, L and k itself, so ten failures
/// with the drift of an unhalved θ must break it. Per-key maxima leave every key
/// below θ unbacked, which is where an unhalved θ shows.
#[test]
fn a_controller_that_never_halves_is_caught() {
    // Two keys, so the counts drift past θ between crashes.
    let stream = workloads::keyed_values(6_000, 2, 4);
    let build = || {
        KeyedAggregation::new(KeyedAggregationConfig {
            aggregate: Aggregate::Count,
            divergence: afstream_core::Norm::Max,
            max_abs_value: 1.0,
        })
        .unwrap()
    };
    let honest = controller(&build(), Mode::Approximate, 400.0, 4_000, 64);
    let broken = honest.with_faults(ControllerFaults {
        never_halve: true,
        ..ControllerFaults::default()
    });
    let options = SimulationOptions {
        seed: 5,
        crash_after: (1..=10).map(|i| i * 500 + 37).collect(),
        ..SimulationOptions::default()
    };
    let (_, report) = simulate(broken, &build, &stream, options.clone()).unwrap();
    // An unhalved θ leaves more drift behind than the bound of failure k
    // allows.
    assert!(
        report
            .violations
            .iter()
            .any(|v| matches!(v, Violation::StateBound { .. } | Violation::RepeatedOutputs { .. })),
        "expected a bound violation, got {:?}",
        report.violations
    );
    let (_, report) = simulate(honest, &build, &stream, options).unwrap();
    assert!(report.violations.is_empty(), "{:?}", report.violations);
    assert_eq!(report.recoveries.len(), 10);
}

/// A controller that writes markers before the outputs they cover are
/// acknowledged loses outputs in a crash, and the harness catches it.
#[test]
fn a_marker_that_covers_unacknowledged_outputs_is_caught() {
    let stream = workloads::text_lines(2_000, 4, 50, 9);
    let build = || Grep::new("w1\\b").unwrap();
    let honest = controller(&build(), Mode::Approximate, 0.0, 16, 64);
    let broken = honest.with_faults(ControllerFaults {
        marker_before_outputs: true,
        ..ControllerFaults::default()
    });
    let options = SimulationOptions {
        seed: 11,
        crash_after: (1..=8).map(|i| i * 200 + 3).collect(),
        max_ack_delay: 12,
        ..SimulationOptions::default()
    };
    let (_, report) = simulate(broken, &build, &stream, options.clone()).unwrap();
    assert!(
        report
            .violations
            .iter()
            .any(|v| matches!(v, Violation::LostOutput { .. })),
        "expected a lost output, got {:?}",
        report.violations
    );
    let (_, report) = simulate(honest, &build, &stream, options).unwrap();
    assert!(report.violations.is_empty(), "{:?}", report.violations);
}

/// Input that has to wait for a marker is counted as a stall; input that never
/// has to wait is not.
#[test]
fn input_never_waits_for_a_marker_even_at_l_one() {
    let stream = workloads::keyed_values(2_000, 50, 8);
    let build = || KeyedAggregation::new(KeyedAggregationConfig::default()).unwrap();
    let options = SimulationOptions {
        seed: 3,
        max_ack_delay: 8,
        ..SimulationOptions::default()
    };
    // L = 2: l = 1, a backup for l after every item; acknowledgements take up
    // to 8 polls.
    let tight = controller(&build(), Mode::Approximate, 1e9, 2, 1_000);
    let (_, report) = simulate(tight, &build, &stream, options.clone()).unwrap();
    assert!(report.violations.is_empty(), "{:?}", report.violations);
    assert_eq!(report.totals.stalls, 1, "only the wait for the start marker");
    // The backups in flight are capped, so markers coalesce the items a round
    // trip lets through instead of going out one per item.
    assert!(
        report.totals.markers * 4 < report.totals.items,
        "{} markers for {} items",
        report.totals.markers,
        report.totals.items
    );
    let loose = controller(&build(), Mode::Approximate, 1e9, 1_000_000, 1_000_000);
    let (_, report) = simulate(loose, &build, &stream, options).unwrap();
    assert_eq!(report.totals.stalls, 1, "only the wait for the start marker");
}

/// Flows the final heavy-hitter state holds as reported but whose report never
/// reached the sink, over several seeded runs with crashes.
fn reported_but_never_delivered(config: ControllerConfig, seeds: std::ops::Range<u64>) -> Vec<(u64, Vec<u8>)> {
    let hitters = HeavyHitterConfig {
        max_weight: 1500,
        // Low enough that most flows are reported at some point of the run.
        threshold: HitterThreshold::Bytes(3_000.0),
        ..Default::default()
    };
    let build = move || HeavyHitters::new(hitters).unwrap();
    let mut missing = Vec::new();
    for seed in seeds {
        let stream = workloads::zipf_flows(3_000, 300, 1.1, seed);
        let options = SimulationOptions {
            seed,
            crash_after: (1..=20).map(|i| i * 140 + seed % 50).collect(),
            crash_during_backup: seed % 2 == 0,
            max_ack_delay: 60,
            ..SimulationOptions::default()
        };
        let (operator, _, sink) = SimulatedTask::new(config, &build, options)
            .unwrap()
            .run_with_outputs(&stream)
            .unwrap();
        let delivered: std::collections::HashSet<&[u8]> = sink.iter().map(|(_, h)| h.flow.as_slice()).collect();
        for packet in &stream {
            if operator.was_reported(&packet.flow) && !delivered.contains(packet.flow.as_slice()) {
                missing.push((seed, packet.flow.clone()));
            }
        }
    }
    missing.sort();
    missing.dedup();
    missing
}

/// A restored state never holds the effect of an output that may be lost: a
/// backup's entries go out only after the outputs of the items they cover are
/// acknowledged, so every flow the state marks reported was delivered.
#[test]
fn a_flow_marked_reported_was_delivered_through_crashes() {
    let build = || HeavyHitters::new(HeavyHitterConfig::default()).unwrap();
    let honest = controller(&build(), Mode::Approximate, 5_000.0, 64, 64);
    let missing = reported_but_never_delivered(honest, 0..16);
    assert!(
        missing.is_empty(),
        "reported in the state, never delivered: {missing:?}"
    );
}

/// The check above catches a controller that writes before the outputs are
/// acknowledged.
#[test]
fn writing_before_outputs_are_acknowledged_loses_reports() {
    let build = || HeavyHitters::new(HeavyHitterConfig::default()).unwrap();
    let broken = controller(&build(), Mode::Approximate, 5_000.0, 64, 64).with_faults(ControllerFaults {
        marker_before_outputs: true,
        ..ControllerFaults::default()
    });
    assert!(
        !reported_but_never_delivered(broken, 0..16).is_empty(),
        "writing before the outputs are acknowledged should lose a report"
    );
}
