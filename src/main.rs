//! The `afstream` command.

use std::collections::{HashMap, HashSet};
use std::process::ExitCode;

use afstream::core::harness::{simulate, SimulationOptions, SimulationReport};
use afstream::core::{
    ControllerConfig, CoreError, ExactInterval, FailurePolicy, GlobalThresholds, Mode, Operator, Placement,
    ThresholdPolicy,
};
use afstream::operators::heavy_hitters::detection_accuracy;
use afstream::operators::online_join::{exact_join, relative_error};
use afstream::operators::*;
use afstream::workloads;
use afstream::{eval, service};
use clap::{Parser, Subcommand, ValueEnum};
use rand::{Rng, SeedableRng};

#[derive(Parser)]
#[command(
    name = "afstream",
    version,
    about = "Approximate fault tolerance for stream processing on Kafka"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a built-in workload in memory (no broker) with crashes at seeded random
    /// points, and report every recovery's observed error beside its proven bound
    /// and the final accuracy against the exact answer.
    Simulate(SimulateArgs),
    /// Run the pipeline of a config file against Kafka until SIGTERM or SIGINT
    /// (then stop cleanly: final backup, marker and commit).
    Run(RunArgs),
    /// Check a config file without connecting: print the per-task thresholds
    /// after each failure and the error bounds they guarantee.
    Check(CheckArgs),
    /// Produce a workload into a topic (created when missing): seeded synthetic
    /// data or a file, as text, JSON or Avro.
    Produce(ProduceArgs),
    /// The exact answer of a config's workload, from its input topic as it is
    /// now; with --compare, the output topic against it.
    Exact(ExactArgs),
    /// A config's pipeline on seeded input, failure-free and with K SIGKILLs
    /// (each followed by a restart), both against the exact answer: a JSON and
    /// a Markdown report.
    Experiment(ExperimentArgs),
    /// The whole story on a real broker: packets in, a heavy-hitter pipeline
    /// killed with SIGKILL and restarted, the answer against the exact one and
    /// each partition's error against its bound.
    Demo(DemoArgs),
}

#[derive(clap::Args)]
struct DemoArgs {
    #[arg(long, env = "AFSTREAM_BOOTSTRAP_SERVERS")]
    bootstrap_servers: String,
    #[arg(long, default_value_t = 150_000)]
    packets: usize,
    #[arg(long, default_value_t = 2)]
    partitions: usize,
    /// SIGKILLs, at seeded random points of the progress.
    #[arg(long, default_value_t = 2)]
    failures: usize,
    #[arg(long, default_value_t = 1e5)]
    theta: f64,
    /// L: items past the last backup marker.
    #[arg(long, default_value_t = 1000)]
    max_uncovered: u64,
    /// Γ: unacknowledged outputs.
    #[arg(long, default_value_t = 1000)]
    max_unacked: u64,
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Where the config and the runs' logs go.
    #[arg(long, default_value = "afstream-demo")]
    dir: std::path::PathBuf,
    /// librdkafka properties (KEY=VALUE), repeatable.
    #[arg(long = "property", value_parser = parse_property)]
    properties: Vec<(String, String)>,
}

#[derive(clap::Args)]
struct RunArgs {
    /// The pipeline's config file (TOML).
    #[arg(long)]
    config: std::path::PathBuf,
    /// Stop cleanly once every partition is processed up to the end it had when
    /// it was assigned.
    #[arg(long)]
    stop_at_end: bool,
    /// Run only this pipeline of a file of several (default: all of them).
    #[arg(long)]
    pipeline: Option<String>,
}

#[derive(clap::Args)]
struct CheckArgs {
    /// The pipeline's config file (TOML).
    #[arg(long)]
    config: std::path::PathBuf,
    /// Partitions of the input topic: the thresholds are split over one task each.
    #[arg(long, default_value_t = 1)]
    partitions: usize,
    /// Check only this pipeline of a file of several (default: all of them).
    #[arg(long)]
    pipeline: Option<String>,
}

#[derive(clap::Args)]
struct ExperimentArgs {
    /// The pipeline's config file (one pipeline); AFSTREAM_BOOTSTRAP_SERVERS
    /// overrides its brokers.
    #[arg(long)]
    config: std::path::PathBuf,
    /// Synthetic input records (of the operator's workload).
    #[arg(long, default_value_t = 20_000)]
    items: usize,
    #[arg(long, default_value_t = 2)]
    partitions: usize,
    /// SIGKILLs per run with failures, at seeded points of its progress: one
    /// run per count given (e.g. 1,3,10).
    #[arg(long, value_delimiter = ',', default_value = "3")]
    failures: Vec<usize>,
    /// Delete the run's local state directory at every kill (node loss): each
    /// restart restores from the changelog.
    #[arg(long)]
    node_loss: bool,
    /// Kill in the middle of a backup: each process SIGKILLs itself once a
    /// backup's entries are in the changelog and before its marker (at a
    /// seeded backup), so every recovery restores an incomplete backup.
    #[arg(long)]
    kill_mid_backup: bool,
    /// Instances of the service in the run's consumer group, each with its
    /// own state directory. With 2 or more, each kill hits the instance that
    /// joined last: its partitions move to the others, which restore them from
    /// the changelog, and its restart takes some back by a clean handoff.
    #[arg(long, default_value_t = 1)]
    instances: usize,
    /// Kill during a rebalance (needs --instances 2 or more): at each kill
    /// point an instance joins the group and is SIGKILLed a seeded moment
    /// (under 2 s) after the group assigned it partitions.
    #[arg(long)]
    kill_mid_rebalance: bool,
    /// Sweep Θ: the runs are repeated for each value (e.g. 1000,10000).
    #[arg(long, value_delimiter = ',')]
    theta: Vec<f64>,
    /// Sweep L: the runs are repeated for each value.
    #[arg(long, value_delimiter = ',')]
    max_uncovered: Vec<u64>,
    /// A distributed learner (sgd_worker and model_averager pipelines): the
    /// consistency models to run it under, each failure-free and with each
    /// failure count.
    #[arg(long, value_delimiter = ',', value_enum, default_value = "bsp,ssp,asp")]
    consistency: Vec<ConsistencyArg>,
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Where the runs' configs and logs and the reports go.
    #[arg(long, default_value = "afstream-experiment")]
    dir: std::path::PathBuf,
}

#[derive(clap::Args)]
struct ExactArgs {
    /// The pipeline's config file (TOML).
    #[arg(long)]
    config: std::path::PathBuf,
    /// Also read the output topic and report its error against the exact answer.
    #[arg(long)]
    compare: bool,
    /// Print the report as JSON (with every key's exact value).
    #[arg(long)]
    json: bool,
    /// The pipeline, in a file of several.
    #[arg(long)]
    pipeline: Option<String>,
}

#[derive(clap::Args)]
struct ProduceArgs {
    #[arg(long, env = "AFSTREAM_BOOTSTRAP_SERVERS")]
    bootstrap_servers: String,
    #[arg(long)]
    topic: String,
    /// Whose input the records are (their schema in schemas/).
    #[arg(long, value_enum)]
    workload: eval::produce::Workload,
    /// Read the records from this file instead of generating them.
    #[arg(long)]
    file: Option<std::path::PathBuf>,
    /// How the file is laid out (default: by its extension: .csv, .jsonl or
    /// .json, else text lines).
    #[arg(long, value_enum)]
    file_format: Option<eval::produce::FileFormat>,
    /// How values are written (default: text for the text workload, JSON otherwise).
    #[arg(long, value_enum)]
    format: Option<service::config::Format>,
    /// Avro: Confluent's wire format or the datum alone.
    #[arg(long, value_enum, default_value = "confluent")]
    framing: service::config::Framing,
    /// Avro with Confluent framing: the schema id written before each datum.
    #[arg(long, default_value_t = 1)]
    schema_id: u32,
    /// Avro: the schema to write with (default: the workload's, compiled in).
    #[arg(long)]
    schema: Option<std::path::PathBuf>,
    /// Synthetic records to generate.
    #[arg(long, default_value_t = 20_000)]
    items: usize,
    /// At most this many records a second.
    #[arg(long)]
    rate: Option<f64>,
    /// Partitions of the topic when it has to be created.
    #[arg(long, default_value_t = 1)]
    partitions: usize,
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// librdkafka properties (KEY=VALUE), repeatable.
    #[arg(long = "property", value_parser = parse_property)]
    properties: Vec<(String, String)>,
}

fn parse_property(text: &str) -> Result<(String, String), String> {
    text.split_once('=')
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .filter(|(k, _)| !k.is_empty())
        .ok_or_else(|| format!("{text:?} is not KEY=VALUE"))
}

#[derive(Clone, Copy, ValueEnum)]
enum Workload {
    HeavyHitters,
    Join,
    LogisticRegression,
    WordCount,
}

/// A distributed learner's consistency model.
#[derive(Clone, Copy, ValueEnum)]
enum ConsistencyArg {
    Asp,
    Bsp,
    Ssp,
}

impl From<ConsistencyArg> for afstream::operators::Consistency {
    fn from(arg: ConsistencyArg) -> Self {
        match arg {
            ConsistencyArg::Asp => afstream::operators::Consistency::Asp,
            ConsistencyArg::Bsp => afstream::operators::Consistency::Bsp,
            ConsistencyArg::Ssp => afstream::operators::Consistency::Ssp,
        }
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum ModeArg {
    None,
    Approximate,
    Exact,
}

#[derive(clap::Args)]
struct SimulateArgs {
    #[arg(long, value_enum, default_value = "heavy-hitters")]
    workload: Workload,
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

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let result = match cli.command {
        Command::Simulate(args) => run_simulation(&args),
        Command::Run(args) => run_service(&args),
        Command::Check(args) => check(&args),
        Command::Produce(args) => produce(&args),
        Command::Exact(args) => exact(&args),
        Command::Experiment(args) => experiment(&args),
        Command::Demo(args) => demo(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("afstream: {error}");
            ExitCode::FAILURE
        }
    }
}

fn run_service(args: &RunArgs) -> Result<(), Box<dyn std::error::Error>> {
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;

    let configs = match &args.pipeline {
        Some(name) => vec![service::config::load_named(&args.config, &env, Some(name))?],
        None => service::config::load_all(&args.config, &env)?,
    };
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        signal_hook::flag::register(signal, Arc::clone(&stop))
            .map_err(|e| format!("installing a signal handler: {e}"))?;
    }
    let options = service::RunOptions {
        stop_at_end: args.stop_at_end,
    };
    service::run_all(&configs, &stop, options)?;
    Ok(())
}

fn env(key: &str) -> Option<String> {
    std::env::var(key).ok()
}

fn check(args: &CheckArgs) -> Result<(), Box<dyn std::error::Error>> {
    let configs = match &args.pipeline {
        Some(name) => vec![service::config::load_named(&args.config, &env, Some(name))?],
        None => service::config::load_all(&args.config, &env)?,
    };
    let mut reports = String::new();
    for config in &configs {
        let report = service::check::report(config, args.partitions).map_err(|e| match &config.name {
            Some(name) => format!("config {}: pipeline {name}: {e}", args.config.display()),
            None => format!("config {}: {e}", args.config.display()),
        })?;
        if let Some(name) = &config.name {
            reports.push_str(&format!("\n[pipelines.{name}]\n"));
        }
        reports.push_str(&report);
    }
    reports.push_str(&service::check::chain_reports(&configs, args.partitions)?);
    println!("config {}: valid", args.config.display());
    print!("{reports}");
    Ok(())
}

fn produce(args: &ProduceArgs) -> Result<(), Box<dyn std::error::Error>> {
    use eval::produce::{Encoder, FileFormat, ProduceOptions, Workload};
    use service::config::{AvroConfig, Format, Framing};
    let kafka = service::config::KafkaConfig {
        properties: args.properties.iter().cloned().collect(),
        ..service::config::KafkaConfig::new(args.bootstrap_servers.clone())
    };
    if let Some(rate) = args.rate.filter(|r| !(r.is_finite() && *r > 0.0)) {
        return Err(format!("--rate {rate}: must be a positive number of records a second").into());
    }
    let format = args.format.unwrap_or(match args.workload {
        Workload::Text => Format::Text,
        _ => Format::Json,
    });
    let avro = AvroConfig {
        input_framing: args.framing,
        input_schema: args.schema.clone(),
        input_schema_id: (args.framing == Framing::Confluent).then_some(args.schema_id),
        output_schema_id: None,
    };
    let encoder = Encoder::new(args.workload, format, Some(&avro))?;
    let options = |total| ProduceOptions {
        rate: args.rate,
        progress: Some(total),
        partition: None,
    };
    let (summary, source) = match &args.file {
        Some(path) => {
            let layout = args
                .file_format
                .unwrap_or_else(|| match path.extension().and_then(|e| e.to_str()) {
                    Some("csv") => FileFormat::Csv,
                    Some("jsonl" | "json") => FileFormat::JsonLines,
                    _ => FileFormat::Lines,
                });
            let records = encoder.file(path, layout)?;
            let summary = eval::produce::produce_from(&kafka, &args.topic, args.partitions, records, &options(None))?;
            (summary, format!("{} ({layout:?})", path.display()))
        }
        None => {
            let records = encoder.synthetic(args.items, args.seed)?;
            let summary = eval::produce::produce_from(
                &kafka,
                &args.topic,
                args.partitions,
                records.into_iter().map(Ok),
                &options(Some(args.items as u64)),
            )?;
            (summary, format!("synthetic, seed {}", args.seed))
        }
    };
    let framing = match (format, args.framing) {
        (Format::Avro, Framing::Confluent) => format!(" (Confluent framing, schema id {})", args.schema_id),
        (Format::Avro, Framing::Plain) => " (plain)".to_string(),
        _ => String::new(),
    };
    let seconds = summary.elapsed.as_secs_f64();
    println!(
        "wrote {} {:?} records ({:.1} MB) as {format:?}{framing} to topic {} from {source} in {seconds:.1} s ({:.0} records/s)",
        summary.records,
        args.workload,
        summary.bytes as f64 / 1e6,
        args.topic,
        summary.records as f64 / seconds.max(1e-9),
    );
    Ok(())
}

fn experiment(args: &ExperimentArgs) -> Result<(), Box<dyn std::error::Error>> {
    if eval::convergence::is_learner(&args.config)? {
        let unsupported = [
            (!args.max_uncovered.is_empty(), "--max-uncovered"),
            (args.node_loss, "--node-loss"),
            (args.kill_mid_backup, "--kill-mid-backup"),
            (args.instances != 1, "--instances"),
            (args.kill_mid_rebalance, "--kill-mid-rebalance"),
        ];
        if let Some((_, flag)) = unsupported.iter().find(|(given, _)| *given) {
            return Err(format!(
                "{flag} is not supported on a distributed learner ({}): its runs sweep --theta, \
                 --consistency and --failures",
                args.config.display()
            )
            .into());
        }
        let report = eval::convergence::run_convergence(&eval::convergence::ConvergenceOptions {
            config: args.config.clone(),
            items: args.items,
            partitions: args.partitions,
            failures: args.failures.clone(),
            consistencies: args.consistency.iter().map(|&c| c.into()).collect(),
            thetas: args.theta.clone(),
            seed: args.seed,
            dir: args.dir.clone(),
        })?;
        eval::plots::write_convergence_plots(&report, &args.dir)?;
        print!("{}", eval::convergence::markdown(&report));
        println!(
            "\nreports: {} and {}",
            args.dir.join("report.json").display(),
            args.dir.join("report.md").display()
        );
        return Ok(());
    }
    let report = eval::experiment::run_experiment(&eval::experiment::ExperimentOptions {
        config: args.config.clone(),
        items: args.items,
        partitions: args.partitions,
        failures: args.failures.clone(),
        node_loss: args.node_loss,
        kill_mid_backup: args.kill_mid_backup,
        instances: args.instances,
        kill_mid_rebalance: args.kill_mid_rebalance,
        thetas: args.theta.clone(),
        max_uncovered: args.max_uncovered.clone(),
        seed: args.seed,
        dir: args.dir.clone(),
    })?;
    eval::plots::write_plots(&report, &args.dir)?;
    print!("{}", eval::experiment::markdown(&report));
    println!(
        "\nreports: {} and {}",
        args.dir.join("report.json").display(),
        args.dir.join("report.md").display()
    );
    Ok(())
}

fn exact(args: &ExactArgs) -> Result<(), Box<dyn std::error::Error>> {
    use eval::exact::{Answer, Comparison};
    let config = service::config::load_named(&args.config, &env, args.pipeline.as_deref())?;
    let report = eval::exact::exact(&config, args.compare)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    println!(
        "{}: {} input records in {} ({} refused)",
        report.kind, report.input_records, report.input_topic, report.refused_records
    );
    match &report.answer {
        Answer::PerKey { keys, total, .. } => println!("exact: {keys} keys, total {total}"),
        Answer::HeavyHitters {
            total_bytes,
            threshold_bytes,
            hitters,
        } => println!(
            "exact: {} heavy hitters (>= {threshold_bytes} of {total_bytes} bytes)",
            hitters.len()
        ),
        Answer::Matches { lines } => println!("exact: {lines} matching lines"),
        Answer::Predictions {
            items,
            accuracy,
            log_loss,
        } => println!("failure-free: {items} predictions, accuracy {accuracy:.4}, log-loss {log_loss:.4}"),
        Answer::Join { count, sum } => println!("exact: join COUNT {count}, SUM {sum:.2}"),
    }
    match &report.comparison {
        None => {}
        Some(Comparison::PerKey {
            output_records,
            output_keys,
            l1_error,
            max_error,
            worst_key,
            missing,
            missing_keys,
            unexpected,
            unexpected_keys,
        }) => {
            println!(
                "output: {output_records} records, {output_keys} keys; L1 error {l1_error}, largest error {max_error}{}",
                worst_key.as_ref().map(|k| format!(" ({k})")).unwrap_or_default()
            );
            if *missing > 0 || *unexpected > 0 {
                println!(
                    "{missing} keys missing (first: {missing_keys:?}); {unexpected} unexpected (first: {unexpected_keys:?})"
                );
            }
        }
        Some(Comparison::HeavyHitters {
            reported,
            precision,
            recall,
            f1,
            worst_relative_error,
        }) => println!(
            "output: {reported} flows reported; precision {precision:.3}, recall {recall:.3}, F1 {f1:.3}, \
             worst relative estimate error {worst_relative_error:.4}"
        ),
        Some(Comparison::Matches {
            output_lines,
            difference,
        }) => println!("output: {output_lines} lines ({difference:+} against the exact matches)"),
        Some(Comparison::Predictions {
            output_items,
            accuracy,
            log_loss,
            over_time,
        }) => {
            println!("output: {output_items} predictions, accuracy {accuracy:.4}, log-loss {log_loss:.4}");
            let windows: Vec<String> = over_time
                .iter()
                .map(|w| format!("{:.0}%: {:.4}", 100.0 * w.progress, w.accuracy))
                .collect();
            println!("accuracy over the run: {}", windows.join(", "));
        }
        Some(Comparison::Join {
            count_relative_error,
            sum_relative_error,
            output_records,
        }) => match (count_relative_error, sum_relative_error) {
            (Some(count), Some(sum)) => {
                println!("output: {output_records} estimates; latest COUNT relative error {count:.4}, SUM {sum:.4}")
            }
            _ => println!(
                "output: {output_records} estimates, one stream per input partition: the tasks' estimates \
                 are not combined"
            ),
        },
    }
    Ok(())
}

fn demo(args: &DemoArgs) -> Result<(), Box<dyn std::error::Error>> {
    let options = eval::demo::DemoOptions {
        kafka: service::config::KafkaConfig {
            group_id: "afstream-demo".into(),
            properties: args.properties.iter().cloned().collect(),
            ..service::config::KafkaConfig::new(args.bootstrap_servers.clone())
        },
        packets: args.packets,
        partitions: args.partitions,
        failures: args.failures,
        seed: args.seed,
        dir: args.dir.clone(),
        theta: args.theta,
        max_uncovered: args.max_uncovered,
        max_unacked: args.max_unacked,
    };
    Ok(eval::demo::run_demo(&options, &mut std::io::stdout())?)
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
    let policy = ThresholdPolicy::new(
        global,
        failures,
        Placement::default(),
        op.norm().is_additive(),
        op.constants(),
    )?;
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

fn run_simulation(args: &SimulateArgs) -> Result<(), Box<dyn std::error::Error>> {
    let mut accuracy: Vec<(String, f64)> = Vec::new();
    let (report, drift, bound_total) = match args.workload {
        Workload::HeavyHitters => {
            let config = HeavyHitterConfig {
                threshold: HitterThreshold::Bytes(2e6),
                ..HeavyHitterConfig::default()
            };
            let stream = workloads::zipf_flows(args.items, 10_000, 1.1, args.seed);
            let build = move || HeavyHitters::new(config).expect("validated config");
            HeavyHitters::new(config)?;
            let outcome = run_both(&build, args, args.theta.unwrap_or(1e5), &stream)?;
            let mut exact: HashMap<&[u8], f64> = HashMap::new();
            for p in &stream {
                *exact.entry(p.flow.as_slice()).or_default() += p.bytes as f64;
            }
            let truth: HashSet<&[u8]> = exact.iter().filter(|(_, &b)| b >= 2e6).map(|(f, _)| *f).collect();
            for (label, op) in [("failure-free", &outcome.clean), ("with failures", &outcome.failed)] {
                let detected: HashSet<&[u8]> = exact.keys().copied().filter(|f| op.is_heavy(f)).collect();
                let a = detection_accuracy(&detected, &truth);
                accuracy.push((format!("{label} precision"), a.precision));
                accuracy.push((format!("{label} recall"), a.recall));
            }
            let drift = outcome.failed.distance(&outcome.clean);
            (outcome.report, drift, outcome.bound_total)
        }
        Workload::Join => {
            let config = JoinConfig::default();
            let stream = workloads::join_streams(args.items, 1_000, args.seed);
            let build = move || OnlineJoin::new(config).expect("validated config");
            let outcome = run_both(&build, args, args.theta.unwrap_or(1e3), &stream)?;
            let (count, sum) = exact_join(&stream);
            for (label, op) in [("failure-free", &outcome.clean), ("with failures", &outcome.failed)] {
                let e = op.estimate();
                accuracy.push((format!("{label} COUNT relative error"), relative_error(e.count, count)));
                accuracy.push((format!("{label} SUM relative error"), relative_error(e.sum, sum)));
            }
            let drift = outcome.failed.distance(&outcome.clean);
            (outcome.report, drift, outcome.bound_total)
        }
        Workload::LogisticRegression => {
            let config = LogisticConfig::default();
            let (stream, _) = workloads::separable_vectors(args.items, 1 << 12, 10, args.seed);
            let (test, _) = workloads::separable_vectors(10_000, 1 << 12, 10, args.seed);
            let build = move || OnlineLogisticRegression::new(config).expect("validated config");
            let outcome = run_both(&build, args, args.theta.unwrap_or(10.0), &stream)?;
            for (label, op) in [("failure-free", &outcome.clean), ("with failures", &outcome.failed)] {
                let (acc, loss) = op.evaluate(&test);
                accuracy.push((format!("{label} held-out accuracy"), acc));
                accuracy.push((format!("{label} held-out log-loss"), loss));
            }
            let drift = outcome.failed.distance(&outcome.clean);
            (outcome.report, drift, f64::NAN)
        }
        Workload::WordCount => {
            let config = WordCountConfig::default();
            let stream = workloads::text_lines(args.items, 10, 20_000, args.seed);
            let build = move || WordCount::new(config).expect("validated config");
            let outcome = run_both(&build, args, args.theta.unwrap_or(1e4), &stream)?;
            let total: f64 = outcome.clean.iter().map(|(_, v)| v).sum();
            let drift = outcome.failed.distance(&outcome.clean);
            accuracy.push(("L1 error / total words".to_string(), drift / total.max(1.0)));
            (outcome.report, drift, outcome.bound_total)
        }
    };

    if args.json {
        let value = serde_json::json!({
            "report": report,
            "final_drift_from_failure_free": drift,
            "proven_bound": if bound_total.is_finite() { Some(bound_total) } else { None },
            "accuracy": accuracy.iter().map(|(k, v)| (k.clone(), *v)).collect::<HashMap<_, _>>(),
        });
        println!("{}", serde_json::to_string_pretty(&value)?);
        return Ok(());
    }
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
        println!("\nfinal state vs failure-free run: {drift:.4} (proven bound {bound_total:.4})");
    } else {
        println!("\nfinal weights vs failure-free run: {drift:.4} (SGD: the loss, not the weights, must come back)");
    }
    for (name, value) in &accuracy {
        println!("  {name}: {value:.4}");
    }
    if report.violations.is_empty() {
        println!("\nevery bound held");
        Ok(())
    } else {
        Err(format!("bounds broken: {:?}", report.violations).into())
    }
}
