//! The `afstream` command.

mod simulate;

use std::process::ExitCode;

use afstream::{eval, service};
use clap::{Parser, Subcommand, ValueEnum};

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
    Simulate(simulate::SimulateArgs),
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
    /// The thresholds that keep the error within a budget on a sample of the
    /// pipeline's input, with what each choice costs; --write puts them into
    /// the config file.
    Tune(TuneArgs),
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
struct TuneArgs {
    /// The pipeline's config file (TOML).
    #[arg(long)]
    config: std::path::PathBuf,
    /// E: the relative error accepted, as a share (0.005) or a percentage
    /// (0.5%), in the workload's own terms (see docs/tuning.md).
    #[arg(long, value_parser = parse_share)]
    error: f64,
    /// K: the failures the budget must survive (default: any number, through
    /// the halving policy).
    #[arg(long)]
    failures: Option<u32>,
    /// Records to sample: the budget holds as a share of a stream this long
    /// (and a smaller share of a longer one).
    #[arg(long, default_value_t = 20_000)]
    sample: usize,
    /// Sample this file (laid out as `produce --file` reads it) instead of
    /// the input topic.
    #[arg(long)]
    input: Option<std::path::PathBuf>,
    #[arg(long, value_enum)]
    file_format: Option<eval::produce::FileFormat>,
    /// With --input: the input topic's partitions (one task each).
    #[arg(long, default_value_t = 1)]
    partitions: usize,
    /// Write the recommended thresholds into the config file (comments kept).
    #[arg(long)]
    write: bool,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    /// The pipeline, in a file of several.
    #[arg(long)]
    pipeline: Option<String>,
    #[arg(long, default_value_t = 42)]
    seed: u64,
}

/// `0.005` or `0.5%`.
fn parse_share(text: &str) -> Result<f64, String> {
    let (number, scale) = match text.trim().strip_suffix('%') {
        Some(percent) => (percent, 0.01),
        None => (text.trim(), 1.0),
    };
    number
        .trim()
        .parse::<f64>()
        .ok()
        .map(|n| n * scale)
        .filter(|share| share.is_finite() && *share > 0.0)
        .ok_or_else(|| format!("{text:?} is not a positive share (0.005) or percentage (0.5%)"))
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
        Command::Simulate(args) => simulate::run_simulation(&args),
        Command::Run(args) => run_service(&args),
        Command::Check(args) => check(&args),
        Command::Produce(args) => produce(&args),
        Command::Exact(args) => exact(&args),
        Command::Experiment(args) => experiment(&args),
        Command::Tune(args) => tune(&args),
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
            let layout = args.file_format.unwrap_or_else(|| FileFormat::of(path));
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

fn tune(args: &TuneArgs) -> Result<(), Box<dyn std::error::Error>> {
    let config = service::config::load_named(&args.config, &env, args.pipeline.as_deref())?;
    let options = eval::tune::TuneOptions {
        error: args.error,
        failures: args.failures,
        sample: args.sample,
        input: args.input.clone(),
        file_format: args.file_format,
        partitions: args.partitions,
        seed: args.seed,
    };
    let report = eval::tune::tune(&config, &options)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", eval::tune::render(&report));
    }
    if args.write {
        let chosen = report
            .recommendation()
            .ok_or("no candidate meets the budget: nothing written")?;
        let fanout = report.fanout.as_ref();
        eval::tune::write_choice(&args.config, config.name.as_deref(), chosen, fanout)?;
        let raised = fanout
            .filter(|f| f.raised())
            .map(|f| format!(", {} = {}", f.key, f.chosen))
            .unwrap_or_default();
        eprintln!(
            "wrote theta = {}, max_uncovered = {}, max_unacked = {}{raised} into {}",
            chosen.theta,
            chosen.max_uncovered,
            chosen.max_unacked,
            args.config.display()
        );
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
