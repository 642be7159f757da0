//! `afstream simulate`: a built-in workload in memory (no broker) through the
//! core's harness, with crashes at seeded points, every recovery's observed
//! error beside its proven bound, and the final accuracy against the exact
//! answer.

use std::collections::{HashMap, HashSet};

use afstream::core::harness::{simulate, SimulationOptions, SimulationReport};
use afstream::core::{
    ControllerConfig, CoreError, ExactInterval, FailurePolicy, GlobalThresholds, Mode, Operator, Placement,
    ThresholdPolicy,
};
use afstream::operators::heavy_hitters::detection_accuracy;
use afstream::operators::online_join::{exact_join, relative_error};
use afstream::operators::*;
use afstream::workloads;
use clap::ValueEnum;
use rand::{Rng, SeedableRng};

/// The built-in workloads `simulate` runs.
#[derive(Clone, Copy, ValueEnum)]
pub enum SimulatedWorkload {
    HeavyHitters,
    Join,
    LogisticRegression,
    WordCount,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum ModeArg {
    None,
    Approximate,
    Exact,
}

#[derive(clap::Args)]
pub struct SimulateArgs {
    #[arg(long, value_enum, default_value = "heavy-hitters")]
    workload: SimulatedWorkload,
    /// Input items.
    #[arg(long, default_value_t = 200_000)]
    items: usize,
    /// Crashes to inject.
    #[arg(long, default_value_t = 10)]
    failures: usize,
    #[arg(long, value_enum, default_value = "approximate")]
    mode: ModeArg,
    /// Θ (default: the workload's paper setting).
    #[arg(long)]
    theta: Option<f64>,
    /// L: items past the last backup marker.
    #[arg(long, default_value_t = 1000)]
    max_uncovered: u64,
    /// The recovering threshold policy: a failure stops counting (and the
    /// thresholds come back) this many items after its recovery resumed.
    /// Default: the paper's halving, where every failure counts for good.
    #[arg(long)]
    recover_after: Option<u64>,
    /// Γ: unacknowledged outputs.
    #[arg(long, default_value_t = 1000)]
    max_unacked: u64,
    /// Exact mode: back up every this many items.
    #[arg(long, default_value_t = 10_000)]
    exact_interval: u64,
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

fn controller_config(op: &impl Operator, args: &SimulateArgs, theta: f64) -> Result<ControllerConfig, CoreError> {
    let global = GlobalThresholds::new(theta, args.max_uncovered, args.max_unacked)?;
    let mode = match args.mode {
        ModeArg::None => Mode::None,
        ModeArg::Approximate => Mode::Approximate,
        ModeArg::Exact => Mode::Exact(ExactInterval {
            items: Some(args.exact_interval),
            millis: None,
        }),
    };
    let failures = match args.recover_after {
        Some(window_items) => FailurePolicy::Recovering { window_items },
        None => FailurePolicy::Halving,
    };
    let policy = ThresholdPolicy::new(global, failures, Placement::default(), op.norm(), op.constants())?;
    Ok(ControllerConfig::new(mode, policy, op.constants()))
}

struct Outcome<O> {
    failed: O,
    clean: O,
    report: SimulationReport,
    bound_total: f64,
}

fn run_both<O>(
    build: &dyn Fn() -> O,
    args: &SimulateArgs,
    theta: f64,
    stream: &[O::Input],
) -> Result<Outcome<O>, CoreError>
where
    O: Operator + Clone + 'static,
    O::Output: Clone,
{
    let config = controller_config(&build(), args, theta)?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(args.seed);
    let mut crash_after: Vec<u64> = (0..args.failures)
        .map(|_| rng.gen_range(1..stream.len().max(2) as u64))
        .collect();
    crash_after.sort_unstable();
    let options = SimulationOptions {
        seed: args.seed,
        crash_after,
        ..SimulationOptions::default()
    };
    let (failed, report) = simulate(config, build, stream, options)?;
    let quiet = SimulationOptions {
        seed: args.seed,
        ..SimulationOptions::default()
    };
    let (clean, _) = simulate(config, build, stream, quiet)?;
    // Each recovery's bound was computed by the harness from Θ, L and k.
    let bound_total = report.recoveries.iter().map(|r| r.bound).sum();
    Ok(Outcome {
        failed,
        clean,
        report,
        bound_total,
    })
}

/// What a simulated workload ends with.
struct Simulated {
    report: SimulationReport,
    /// The final state's distance from a failure-free run's.
    final_error: f64,
    /// The sum of the recoveries' proven bounds (NaN where the state need
    /// not come back: SGD's weights).
    bound_total: f64,
    accuracy: Vec<(String, f64)>,
}

impl Simulated {
    fn of<O: Operator>(outcome: Outcome<O>, bound_total: f64, accuracy: Vec<(String, f64)>) -> Self {
        Simulated {
            final_error: outcome.failed.distance(&outcome.clean),
            report: outcome.report,
            bound_total,
            accuracy,
        }
    }
}

pub fn run_simulation(args: &SimulateArgs) -> Result<(), Box<dyn std::error::Error>> {
    let simulated = match args.workload {
        SimulatedWorkload::HeavyHitters => heavy_hitters(args)?,
        SimulatedWorkload::Join => join(args)?,
        SimulatedWorkload::LogisticRegression => logistic_regression(args)?,
        SimulatedWorkload::WordCount => word_count(args)?,
    };
    if args.json {
        let value = serde_json::json!({
            "report": simulated.report,
            "final_error_from_failure_free": simulated.final_error,
            "proven_bound": simulated.bound_total.is_finite().then_some(simulated.bound_total),
            "accuracy": simulated.accuracy.iter().map(|(k, v)| (k.clone(), *v)).collect::<HashMap<_, _>>(),
        });
        println!("{}", serde_json::to_string_pretty(&value)?);
        return Ok(());
    }
    print_simulation(&simulated);
    if simulated.report.violations.is_empty() {
        println!("\nevery bound held");
        Ok(())
    } else {
        Err(format!("bounds broken: {:?}", simulated.report.violations).into())
    }
}

fn heavy_hitters(args: &SimulateArgs) -> Result<Simulated, CoreError> {
    let config = HeavyHitterConfig {
        threshold: HitterThreshold::Bytes(2e6),
        ..HeavyHitterConfig::default()
    };
    let stream = workloads::zipf_flows(args.items, 10_000, 1.1, args.seed);
    HeavyHitters::new(config)?;
    let build = move || HeavyHitters::new(config).expect("validated config");
    let outcome = run_both(&build, args, args.theta.unwrap_or(1e5), &stream)?;
    let mut exact: HashMap<&[u8], f64> = HashMap::new();
    for p in &stream {
        *exact.entry(p.flow.as_slice()).or_default() += p.bytes as f64;
    }
    let truth: HashSet<&[u8]> = exact.iter().filter(|(_, &b)| b >= 2e6).map(|(f, _)| *f).collect();
    let mut accuracy = Vec::new();
    for (label, op) in [("failure-free", &outcome.clean), ("with failures", &outcome.failed)] {
        let detected: HashSet<&[u8]> = exact.keys().copied().filter(|f| op.is_heavy(f)).collect();
        let a = detection_accuracy(&detected, &truth);
        accuracy.push((format!("{label} precision"), a.precision));
        accuracy.push((format!("{label} recall"), a.recall));
    }
    let bound_total = outcome.bound_total;
    Ok(Simulated::of(outcome, bound_total, accuracy))
}

fn join(args: &SimulateArgs) -> Result<Simulated, CoreError> {
    let config = JoinConfig::default();
    let stream = workloads::join_streams(args.items, 1_000, args.seed);
    let build = move || OnlineJoin::new(config).expect("validated config");
    let outcome = run_both(&build, args, args.theta.unwrap_or(1e3), &stream)?;
    let (count, sum) = exact_join(&stream);
    let mut accuracy = Vec::new();
    for (label, op) in [("failure-free", &outcome.clean), ("with failures", &outcome.failed)] {
        let e = op.estimate();
        accuracy.push((format!("{label} COUNT relative error"), relative_error(e.count, count)));
        accuracy.push((format!("{label} SUM relative error"), relative_error(e.sum, sum)));
    }
    let bound_total = outcome.bound_total;
    Ok(Simulated::of(outcome, bound_total, accuracy))
}

fn logistic_regression(args: &SimulateArgs) -> Result<Simulated, CoreError> {
    let config = LogisticConfig::default();
    let (stream, _) = workloads::separable_vectors(args.items, 1 << 12, 10, args.seed);
    let (test, _) = workloads::separable_vectors(10_000, 1 << 12, 10, args.seed);
    let build = move || OnlineLogisticRegression::new(config).expect("validated config");
    let outcome = run_both(&build, args, args.theta.unwrap_or(10.0), &stream)?;
    let mut accuracy = Vec::new();
    for (label, op) in [("failure-free", &outcome.clean), ("with failures", &outcome.failed)] {
        let (acc, loss) = op.evaluate(&test);
        accuracy.push((format!("{label} held-out accuracy"), acc));
        accuracy.push((format!("{label} held-out log-loss"), loss));
    }
    // SGD: the loss, not the weights, must come back.
    Ok(Simulated::of(outcome, f64::NAN, accuracy))
}

fn word_count(args: &SimulateArgs) -> Result<Simulated, CoreError> {
    let config = WordCountConfig::default();
    let stream = workloads::text_lines(args.items, 10, 20_000, args.seed);
    let build = move || WordCount::new(config).expect("validated config");
    let outcome = run_both(&build, args, args.theta.unwrap_or(1e4), &stream)?;
    let total: f64 = outcome.clean.iter().map(|(_, v)| v).sum();
    let final_error = outcome.failed.distance(&outcome.clean);
    let accuracy = vec![("L1 error / total words".to_string(), final_error / total.max(1.0))];
    let bound_total = outcome.bound_total;
    Ok(Simulated::of(outcome, bound_total, accuracy))
}

fn print_simulation(simulated: &Simulated) {
    let Simulated {
        report,
        final_error,
        bound_total,
        accuracy,
    } = simulated;
    let t = &report.totals;
    println!(
        "{} items, {} crashes: {} backups ({} entries, {} bytes), {} markers, {} commits, {} rejected",
        t.items,
        report.recoveries.len(),
        t.backups,
        t.backup_entries,
        t.backup_bytes,
        t.markers,
        t.commits,
        t.rejected
    );
    let per_item = |n: u64| n as f64 / t.items.max(1) as f64;
    println!(
        "changelog records per item: {:.4}; input waited for an acknowledgement {} times ({:.2}% of items)",
        per_item(report.changelog_records),
        t.stalls,
        100.0 * per_item(t.stalls)
    );
    println!("\n recovery  crash@  resume@  k   observed error   proven bound");
    for (i, r) in report.recoveries.iter().enumerate() {
        let observed = r.observed.map_or("(crashed again)".to_string(), |o| format!("{o:.4}"));
        println!(
            " {:>8}  {:>6}  {:>7}  {:<2}  {:>15}  {:>13.4}",
            i + 1,
            r.crash_item_offset,
            r.resume_offset,
            r.failures,
            observed,
            r.bound
        );
    }
    if bound_total.is_finite() {
        println!("\nfinal state vs failure-free run: {final_error:.4} (proven bound {bound_total:.4})");
    } else {
        println!(
            "\nfinal weights vs failure-free run: {final_error:.4} (SGD: the loss, not the weights, must come back)"
        );
    }
    for (name, value) in accuracy {
        println!("  {name}: {value:.4}");
    }
}
