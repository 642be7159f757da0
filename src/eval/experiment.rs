//! `afstream experiment`: a config's pipeline on the same seeded input twice,
//! failure-free and with K SIGKILLs at seeded points of its progress (each
//! followed by a restart), both measured against the exact answer; every
//! recovery's logged bound beside the error observed. The report is JSON (one
//! object per run, with the thresholds) and Markdown.
//!
//! Each run has a consumer group, output, changelog and dead-letter topic of
//! its own; both read one input topic written for the experiment.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use super::child::{log_field, logged_recoveries, LoggedRecovery, Run};
use super::exact::{exact, Answer, Comparison};
use super::observed::{observed_divergences, RestoreCheck};
use super::produce::{produce_from, Encoder, InputRecord, ProduceOptions, Workload};
use crate::core::recovery::BackupMarker;
use crate::service::config::KafkaConfig;
use crate::service::config::{self, Config};
use crate::service::kafka::{ensure_topics, ChangelogLoader, TopicReader, TopicSpec};
use crate::service::ServiceError;

/// The longest one run may take to reach a kill point.
const KILL_DEADLINE: Duration = Duration::from_secs(300);

#[derive(Clone, Debug)]
pub struct ExperimentOptions {
    /// The pipeline's config file (one pipeline).
    pub config: PathBuf,
    pub items: usize,
    pub partitions: usize,
    /// One run with failures per count given (besides the failure-free run).
    pub failures: Vec<usize>,
    /// Node loss: the run's local state directory is deleted at every kill,
    /// so each restart restores from the changelog.
    pub node_loss: bool,
    /// Each kill comes in the middle of a backup (the process kills itself
    /// between a backup's entries and its marker, see
    /// [`crate::service::runner::CRASH_IN_BACKUP`]), at a seeded backup of the run.
    pub kill_mid_backup: bool,
    /// Instances of the service in the run's consumer group, each with a
    /// state directory of its own. With more than one, the kills hit the
    /// instance that joined last: its partitions move to the others (which
    /// restore them from the changelog), and its restart takes some back.
    pub instances: usize,
    /// Each kill comes during a rebalance: a new instance joins at the kill
    /// point and is SIGKILLed a seeded moment after the group assigned it
    /// partitions (while they are handed off, restored or starting). Needs
    /// two instances or more.
    pub kill_mid_rebalance: bool,
    /// Sweeps: the runs are repeated for each Θ and each L given (the
    /// config's own when none is).
    pub thetas: Vec<f64>,
    pub max_uncovered: Vec<u64>,
    pub seed: u64,
    /// Configs, logs and the reports go here.
    pub dir: PathBuf,
}

/// The thresholds a run used.
#[derive(Clone, Debug, Serialize)]
pub struct Thresholds {
    pub mode: String,
    pub theta: f64,
    pub max_uncovered: u64,
    pub max_unacked: u64,
}

/// One run of the pipeline over the experiment's input.
#[derive(Clone, Debug, Serialize)]
pub struct RunOutcome {
    pub label: String,
    /// The Θ and L this run used.
    pub theta: f64,
    pub max_uncovered: u64,
    /// The kills made: fewer than the label asks for when the input ended
    /// before a kill point (or, mid-backup, before the backup drawn).
    pub failures_injected: usize,
    /// Every recovery its logs record, with the bound it logged.
    pub recoveries: Vec<RecoveryRecord>,
    /// The sum of the recoveries' state bounds.
    pub bound_state: f64,
    /// The sum of the recoveries' bounds on outputs repeated.
    pub bound_outputs: f64,
    /// What the output may be off by: the state bound, plus α for every output
    /// lost (a per-key output left stale moves that key by at most α).
    pub output_error_bound: f64,
    /// From the first start to the clean stop of the last run, restarts included.
    pub seconds: f64,
    pub items_per_second: f64,
    pub comparison: Comparison,
    /// Backups, their entries and markers, by the clean stop of the run's last
    /// process (a killed process reports none).
    pub backups: u64,
    pub backup_entries: u64,
    pub markers: u64,
    /// What every process of the run wrote to its changelog, killed ones
    /// included, read back from the topic after the run.
    pub changelog: ChangelogWritten,
    /// For per-key outputs: whether the L1 error is within `output_error_bound`.
    pub within_bound: Option<bool>,
    /// Whether the state each recovery restored from the changelog was within
    /// the bound of the partition's failures so far (none restored from it: no
    /// answer).
    pub recoveries_within_bound: Option<bool>,
}

#[derive(Clone, Debug, Serialize)]
pub struct RecoveryRecord {
    pub partition: i32,
    pub failures: u32,
    pub resume_offset: u64,
    pub bound_state: f64,
    pub bound_outputs: f64,
    /// How long the restore took (store, last marker, changelog).
    pub restore_seconds: f64,
    /// The distance, in the operator's divergence, between the state the
    /// recovery restored from the changelog and the exact state at its resume
    /// offset (none for a restart on the local store, which is exact at its
    /// own offset).
    pub observed_state: Option<f64>,
    /// What the partition's failures so far may have left in that state: the
    /// sum of their state bounds, this one's included.
    pub bound_so_far: f64,
}

/// A run's changelog, read back: backups' entries and markers (each backup
/// ends with one, and so does every task's start and clean stop).
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct ChangelogWritten {
    pub records: u64,
    pub markers: u64,
    /// Keys and values.
    pub bytes: u64,
}

/// Reads a run's changelog back (on a compacted topic: what compaction left).
fn changelog_written(config: &Config, group: &str, partitions: usize) -> Result<ChangelogWritten, ServiceError> {
    let loader = ChangelogLoader::new(&config.kafka, &config.pipeline.changelog_topic(group))?;
    let mut written = ChangelogWritten::default();
    for partition in 0..partitions as i32 {
        loader.stream(partition, None, 10_000, |entries| {
            for entry in entries {
                written.records += 1;
                written.markers += u64::from(BackupMarker::is_marker(entry));
                written.bytes += (entry.key.len() + entry.value.as_ref().map_or(0, |v| v.len())) as u64;
            }
            Ok(())
        })?;
    }
    Ok(written)
}

/// The run's recoveries, each with the divergence observed in the state it
/// restored (see [`super::observed`]) and the bound that covers it.
fn checked_recoveries(config: &Config, logged: Vec<LoggedRecovery>) -> Result<Vec<RecoveryRecord>, ServiceError> {
    let checks: Vec<RestoreCheck> = logged
        .iter()
        .filter_map(|r| {
            Some(RestoreCheck {
                partition: r.partition,
                resume_offset: r.resume_offset,
                changelog_end: r.changelog_end?,
            })
        })
        .collect();
    let mut observed = observed_divergences(config, &checks)?.into_iter();
    Ok(recovery_records(&logged, |r| {
        r.changelog_end.and_then(|_| observed.next())
    }))
}

/// The logged recoveries as records, with the divergence `observed` gives for
/// each (in order).
pub fn recovery_records(
    logged: &[LoggedRecovery],
    mut observed: impl FnMut(&LoggedRecovery) -> Option<f64>,
) -> Vec<RecoveryRecord> {
    // A partition's failure count rises by one at each recovery (a clean
    // restart keeps it), so the recoveries with a count up to this one's are
    // this one and those before it.
    let bound_so_far = |r: &LoggedRecovery| {
        logged
            .iter()
            .filter(|o| o.partition == r.partition && o.failures <= r.failures)
            .map(|o| o.bound_state)
            .sum::<f64>()
    };
    logged
        .iter()
        .map(|r| RecoveryRecord {
            partition: r.partition,
            failures: r.failures,
            resume_offset: r.resume_offset,
            bound_state: r.bound_state,
            bound_outputs: r.bound_outputs,
            restore_seconds: r.restore_seconds,
            observed_state: observed(r),
            bound_so_far: bound_so_far(r),
        })
        .collect()
}

/// Whether every observed divergence is within its bound (none observed: no
/// answer).
fn recoveries_within_bound(recoveries: &[RecoveryRecord]) -> Option<bool> {
    let mut checked = recoveries
        .iter()
        .filter_map(|r| Some((r.observed_state?, r.bound_so_far)))
        .peekable();
    checked.peek()?;
    Some(checked.all(|(observed, bound)| observed <= bound * (1.0 + 1e-9) + 1e-9))
}

#[derive(Clone, Debug, Serialize)]
pub struct ExperimentReport {
    pub kind: &'static str,
    pub workload: String,
    pub items: usize,
    pub partitions: usize,
    pub seed: u64,
    pub thresholds: Thresholds,
    /// The exact answer, without per-key values.
    pub exact: Answer,
    pub runs: Vec<RunOutcome>,
}

/// Runs the experiment; writes `report.json` and `report.md` into the
/// options' directory and returns the report.
pub fn run_experiment(options: &ExperimentOptions) -> Result<ExperimentReport, ServiceError> {
    let env = |key: &str| std::env::var(key).ok();
    let base = config::load(&options.config, &env)?;
    if base.stage.is_some() {
        return Err(ServiceError::Unsupported(
            "experiment runs one pipeline; a chain's stages are not supported yet".into(),
        ));
    }
    validate_kills(options)?;
    let text = std::fs::read_to_string(&options.config)
        .map_err(|e| ServiceError::Unsupported(format!("{}: {e}", options.config.display())))?;
    std::fs::create_dir_all(&options.dir)
        .map_err(|e| ServiceError::Unsupported(format!("{}: {e}", options.dir.display())))?;
    let workload = Workload::for_operator(&base.pipeline.operator);
    if options.partitions > 1
        && matches!(
            base.pipeline.operator,
            crate::service::config::OperatorConfig::WordCount(_)
        )
    {
        return Err(ServiceError::Unsupported(
            "word_count counts per input partition and the synthetic lines are not keyed: run the experiment with \
             --partitions 1 (or run a two-stage WordCount)"
                .into(),
        ));
    }
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default();
    let name = format!("{}-experiment-{stamp}", base.kafka.group_id);
    let shared_input = format!("{name}-input");

    let encoder =
        Encoder::new(workload, base.pipeline.format, base.pipeline.avro.as_ref()).map_err(ServiceError::Unsupported)?;
    let records = encoder
        .synthetic(options.items, options.seed)
        .map_err(ServiceError::Unsupported)?;
    produce_from(
        &base.kafka,
        &shared_input,
        options.partitions,
        records.into_iter().map(Ok),
        &ProduceOptions::default(),
    )?;

    let alpha = crate::service::check::plan(&base, options.partitions)?.constants.alpha;
    let mut runs = Vec::new();
    let mut answer = None;
    let ft = &base.pipeline.fault_tolerance;
    let thetas = if options.thetas.is_empty() {
        vec![ft.theta]
    } else {
        options.thetas.clone()
    };
    let ls = if options.max_uncovered.is_empty() {
        vec![ft.max_uncovered]
    } else {
        options.max_uncovered.clone()
    };
    let sweep = thetas.len() > 1 || ls.len() > 1;
    let mut plan = Vec::new();
    for &theta in &thetas {
        for &l in &ls {
            let at = if sweep {
                format!(", Θ={theta}, L={l}")
            } else {
                String::new()
            };
            plan.push((format!("failure-free{at}"), 0, theta, l));
            for &failures in &options.failures {
                let kind = if options.node_loss { "node losses" } else { "failures" };
                let point = if options.kill_mid_backup {
                    " mid-backup"
                } else if options.kill_mid_rebalance {
                    " mid-rebalance"
                } else if options.instances > 1 {
                    " on another instance"
                } else {
                    ""
                };
                plan.push((format!("{failures} {kind}{point}{at}"), failures, theta, l));
            }
        }
    }
    for (index, (label, failures, theta, l)) in plan.into_iter().enumerate() {
        let group = format!("{name}-run{}", index + 1);
        let path = options.dir.join(format!("{group}.toml"));
        // A group of instances with kills reads its own copy of the input,
        // written while it runs (see `InputFeed`).
        let fed = options.instances > 1 && failures > 0;
        let run_input = if fed {
            format!("{group}-input")
        } else {
            shared_input.clone()
        };
        let input = &run_input;
        write_run_config(&text, &path, &group, input, &options.dir.join(&group), (theta, l))?;
        let config = config::load(&path, &env)?;
        // Instance k > 1 has a config of its own: its own state directory.
        let mut instances = vec![(path.clone(), config.pipeline.state_dir.clone())];
        for k in 2..=options.instances {
            let path = options.dir.join(format!("{group}-instance{k}.toml"));
            let state = options.dir.join(format!("{group}-instance{k}"));
            write_run_config(&text, &path, &group, input, &state, (theta, l))?;
            instances.push((path.clone(), config::load(&path, &env)?.pipeline.state_dir));
        }
        let started = Instant::now();
        let Kills { logs, made } = if instances.len() > 1 {
            let feed = if fed {
                Some(InputFeed::new(&config.kafka, &shared_input, input, options.partitions)?)
            } else {
                None
            };
            run_with_moves(&config, &instances, options, failures, &group, feed)?
        } else {
            let state = config.pipeline.state_dir.clone();
            run_with_kills(&config, &path, options, failures, &group, state.as_deref())?
        };
        let seconds = started.elapsed().as_secs_f64();
        let logged: Vec<LoggedRecovery> = logs
            .iter()
            .filter_map(|log| std::fs::read_to_string(log).ok())
            .flat_map(|text| logged_recoveries(&text))
            .collect();
        let recoveries = checked_recoveries(&config, logged)?;
        let report = exact(&config, true)?;
        // `+ 0.0`: an empty sum is -0.0.
        let bound_state = recoveries.iter().map(|r| r.bound_state).sum::<f64>() + 0.0;
        let bound_outputs = recoveries.iter().map(|r| r.bound_outputs).sum::<f64>() + 0.0;
        let output_error_bound = bound_state + alpha * bound_outputs;
        let comparison = report
            .comparison
            .ok_or_else(|| ServiceError::Unsupported("no comparison".into()))?;
        let within_bound = match &comparison {
            Comparison::PerKey { l1_error, .. } => Some(*l1_error <= output_error_bound + 1e-9),
            _ => None,
        };
        answer.get_or_insert(report.answer);
        let last_log = logs
            .last()
            .and_then(|log| std::fs::read_to_string(log).ok())
            .unwrap_or_default();
        let stopped = |field: &str| -> u64 {
            last_log
                .lines()
                .filter(|line| line.contains("task stopped cleanly"))
                .filter_map(|line| log_field(line, field))
                .sum::<f64>() as u64
        };
        runs.push(RunOutcome {
            label,
            theta,
            max_uncovered: l,
            backups: stopped("backups"),
            backup_entries: stopped("backup_entries"),
            markers: stopped("markers"),
            failures_injected: made,
            bound_state,
            bound_outputs,
            output_error_bound,
            seconds,
            items_per_second: options.items as f64 / seconds.max(1e-9),
            comparison,
            changelog: changelog_written(&config, &group, options.partitions)?,
            within_bound,
            recoveries_within_bound: recoveries_within_bound(&recoveries),
            recoveries,
        });
    }
    let report = ExperimentReport {
        kind: base.pipeline.operator.kind(),
        workload: format!("{workload:?}"),
        items: options.items,
        partitions: options.partitions,
        seed: options.seed,
        thresholds: Thresholds {
            mode: format!("{:?}", ft.mode),
            theta: ft.theta,
            max_uncovered: ft.max_uncovered,
            max_unacked: ft.max_unacked,
        },
        exact: summary(answer.unwrap_or(Answer::Matches { lines: 0 })),
        runs,
    };
    let json = serde_json::to_string_pretty(&report).map_err(|e| ServiceError::Unsupported(e.to_string()))?;
    write(&options.dir.join("report.json"), &json)?;
    write(&options.dir.join("report.md"), &markdown(&report))?;
    Ok(report)
}

fn write(path: &Path, text: &str) -> Result<(), ServiceError> {
    std::fs::write(path, text).map_err(|e| ServiceError::Unsupported(format!("{}: {e}", path.display())))
}

/// The answer without its per-key values (the JSON stays small).
fn summary(answer: Answer) -> Answer {
    match answer {
        Answer::PerKey { keys, total, .. } => Answer::PerKey {
            keys,
            total,
            values: Default::default(),
        },
        other => other,
    }
}

/// The config of one run: the user's, with its own group, the experiment's
/// input, its own output, changelog and dead-letter topics and state directory.
fn write_run_config(
    text: &str,
    path: &Path,
    group: &str,
    input: &str,
    state: &Path,
    (theta, max_uncovered): (f64, u64),
) -> Result<(), ServiceError> {
    let bad = |e: String| ServiceError::Unsupported(format!("rewriting the config for {group}: {e}"));
    let mut table: toml::Table = text.parse().map_err(|e: toml::de::Error| bad(e.to_string()))?;
    let section = |table: &mut toml::Table, name: &str| -> Result<toml::Table, ServiceError> {
        match table.remove(name) {
            Some(toml::Value::Table(t)) => Ok(t),
            _ => Err(bad(format!("no [{name}] table"))),
        }
    };
    let mut kafka = section(&mut table, "kafka")?;
    kafka.insert("group_id".into(), group.into());
    table.insert("kafka".into(), toml::Value::Table(kafka));
    let mut pipeline = section(&mut table, "pipeline")?;
    pipeline.insert("input_topic".into(), input.into());
    pipeline.insert("output_topic".into(), format!("{group}-output").into());
    pipeline.remove("changelog_topic");
    pipeline.remove("dead_letter_topic");
    if pipeline.contains_key("state_dir") {
        pipeline.insert("state_dir".into(), state.display().to_string().into());
    }
    if let Some(toml::Value::Table(ft)) = pipeline.get_mut("fault_tolerance") {
        ft.insert("theta".into(), theta.into());
        ft.insert("max_uncovered".into(), (max_uncovered as i64).into());
    }
    table.insert("pipeline".into(), toml::Value::Table(pipeline));
    // One process runs at a time: no exporter port to share.
    table.remove("metrics");
    write(path, &toml::to_string(&table).map_err(|e| bad(e.to_string()))?)
}

/// Runs the pipeline to the end of its input with `failures` SIGKILLs at
/// seeded points of its progress (the input offsets its markers cover),
/// each followed by a restart; returns the runs' logs.
fn run_with_kills(
    config: &Config,
    path: &Path,
    options: &ExperimentOptions,
    failures: usize,
    group: &str,
    state_dir: Option<&Path>,
) -> Result<Kills, ServiceError> {
    let mut progress = Progress::new(config, group, options.partitions);
    let (points, mut rng) = kill_points(options, failures);
    let mut logs = Vec::new();
    for (i, &target) in points.iter().enumerate() {
        let log = options.dir.join(format!("{group}-{}.log", i + 1));
        if options.kill_mid_backup {
            // The process kills itself in its N-th backup with entries.
            let backup = rng.gen_range(MID_BACKUP_KILLS).to_string();
            let mut run = Run::start_with(
                path,
                log.clone(),
                true,
                &[(crate::service::runner::CRASH_IN_BACKUP, &backup)],
            )?;
            logs.push(log);
            if !run.killed()? {
                // The input ended before that backup: no more kills.
                return Ok(Kills { logs, made: i });
            }
            lose_node(state_dir, options)?;
            continue;
        }
        let mut run = Run::start(path, log.clone(), true)?;
        logs.push(log);
        let deadline = Instant::now() + KILL_DEADLINE;
        loop {
            if run.exited() {
                // The input ended before this kill point: no more kills.
                run.wait()?;
                return Ok(Kills { logs, made: i });
            }
            if run.started_tasks() >= options.partitions && progress.covered()? >= target {
                run.kill();
                lose_node(state_dir, options)?;
                break;
            }
            if Instant::now() > deadline {
                return Err(ServiceError::Child(format!(
                    "{group}: {target} items not covered within {KILL_DEADLINE:?}; see {}",
                    run.log().display()
                )));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    let log = options.dir.join(format!("{group}-final.log"));
    Run::start(path, log.clone(), true)?.wait()?;
    logs.push(log);
    Ok(Kills {
        logs,
        made: points.len(),
    })
}

/// The kill points of a run: input offsets its markers must cover (summed
/// over the partitions), seeded, in order; and the generator for what else
/// the kills draw.
fn kill_points(options: &ExperimentOptions, failures: usize) -> (Vec<u64>, StdRng) {
    let mut rng = StdRng::seed_from_u64(options.seed ^ 0xfa11);
    let mut points: Vec<f64> = (0..failures).map(|_| rng.gen_range(0.05..0.9)).collect();
    points.sort_by(f64::total_cmp);
    let items = options.items as f64;
    (points.into_iter().map(|f| (f * items) as u64).collect(), rng)
}

/// How much of the input a run's markers cover: the sum over the partitions
/// of the input offset of each one's last marker.
struct Progress<'a> {
    config: &'a Config,
    topic: String,
    partitions: i32,
    /// Made at the first look, once a task has started (and so created the
    /// changelog): a client made before the topic exists would not see it.
    changelog: Option<ChangelogLoader>,
}

impl<'a> Progress<'a> {
    fn new(config: &'a Config, group: &str, partitions: usize) -> Self {
        Progress {
            config,
            topic: config.pipeline.changelog_topic(group),
            partitions: partitions as i32,
            changelog: None,
        }
    }

    /// Call only once the run's tasks have started.
    fn covered(&mut self) -> Result<u64, ServiceError> {
        let changelog = match &mut self.changelog {
            Some(changelog) => changelog,
            none => none.insert(ChangelogLoader::new(&self.config.kafka, &self.topic)?),
        };
        Ok((0..self.partitions)
            .filter_map(|p| changelog.last_marker(p).ok().flatten())
            .map(|marker| marker.input_offset)
            .sum())
    }
}

/// After a kill during a rebalance: a seeded delay, in milliseconds, from the
/// joining instance's assignment to its SIGKILL (its tasks restore, write their
/// start markers and take their first items in this time, so some kills come
/// before a task starts and some after).
const REBALANCE_KILL_DELAY_MS: std::ops::Range<u64> = 0..2_000;

/// The longest the other instances may take to start a killed instance's
/// partitions again: the group notices the death after `session.timeout.ms`.
const MOVE_DEADLINE: Duration = Duration::from_secs(120);

/// A run with several instances in one group (see
/// [`ExperimentOptions::instances`]): the first ones run throughout; the last
/// one joins, is killed (at a kill point, or during the rebalance its joining
/// starts), its partitions move to the others, and it joins again for the next
/// kill. At the end the others stop cleanly and one instance runs the rest of
/// the input. Returns the runs' logs, the final run's last.
///
/// The instance killed is the one that joined last, never the group's first
/// member (its leader, as a rule): Tansu 0.6.0, the project's test broker,
/// keeps a dead leader's id in the group and gives the survivors no partitions
/// again (measured: none for over 90 s, eager or cooperative).
fn run_with_moves(
    config: &Config,
    instances: &[(PathBuf, Option<PathBuf>)],
    options: &ExperimentOptions,
    failures: usize,
    group: &str,
    mut feed: Option<InputFeed<'_>>,
) -> Result<Kills, ServiceError> {
    let mut progress = Progress::new(config, group, options.partitions);
    let (points, mut rng) = kill_points(options, failures);
    let Some(((joiner, joiner_state), stayers)) = instances.split_last() else {
        return Ok(Kills {
            logs: Vec::new(),
            made: 0,
        });
    };
    let share = |items: u64| items as f64 / options.items.max(1) as f64;
    if let Some(feed) = feed.as_mut() {
        feed.to(points.first().map_or(1.0, |&p| share(p)))?;
    }
    let mut logs = Vec::new();
    let mut runs = Vec::new();
    for (k, (path, _)) in stayers.iter().enumerate() {
        let log = options.dir.join(format!("{group}-instance{}.log", k + 1));
        runs.push(Run::start(path, log.clone(), false)?);
        logs.push(log);
    }
    let partitions = options.partitions;
    wait_until(group, "the first instances' tasks", &mut runs, |runs| {
        Ok(runs.iter().map(Run::started_tasks).sum::<usize>() >= partitions)
    })?;
    let last = stayers.len();
    for (i, &point) in points.iter().enumerate() {
        let log = options.dir.join(format!("{group}-joined-{}.log", i + 1));
        let next = points.get(i + 1).map_or(1.0, |&p| share(p));
        if options.kill_mid_rebalance {
            if feed.is_none() {
                let covered = format!("{point} items covered by markers");
                wait_until(group, &covered, &mut runs, |_| Ok(progress.covered()? >= point))?;
            }
            runs.push(Run::start(joiner, log.clone(), false)?);
            if let Some(feed) = feed.as_mut() {
                // The rebalance happens while new input arrives.
                feed.to(next)?;
            }
            wait_until(
                group,
                "partitions assigned to the joining instance",
                &mut runs,
                |runs| Ok(!runs[last].assigned().is_empty()),
            )?;
            std::thread::sleep(Duration::from_millis(rng.gen_range(REBALANCE_KILL_DELAY_MS)));
        } else {
            runs.push(Run::start(joiner, log.clone(), false)?);
            wait_until(group, "tasks started by the joining instance", &mut runs, |runs| {
                Ok(runs[last].started_tasks() > 0)
            })?;
            let target = match feed.as_mut() {
                // Half of the part written now: the kill comes while the
                // group reads it.
                Some(feed) => {
                    let before = progress.covered()?;
                    let written = feed.to(next)?;
                    before + written / 2
                }
                None => point,
            };
            wait_for_coverage(group, &mut runs, &mut progress, target)?;
        }
        logs.push(log);
        let Some(mut killed) = runs.pop() else { break };
        let starts_before = starts(&runs);
        killed.kill();
        let moved = killed.assigned();
        lose_node(joiner_state.as_deref(), options)?;
        let what = format!("the killed instance's partitions {moved:?} started again by the others");
        wait_until_within(MOVE_DEADLINE, group, &what, &mut runs, |runs| {
            let now = starts(runs);
            Ok(moved.iter().all(|p| now.get(p) > starts_before.get(p)))
        })?;
    }
    if let Some(feed) = feed.as_mut() {
        feed.to(1.0)?;
    }
    for run in &mut runs {
        run.stop()?;
    }
    let log = options.dir.join(format!("{group}-final.log"));
    Run::start(&instances[0].0, log.clone(), true)?.wait()?;
    logs.push(log);
    Ok(Kills {
        logs,
        made: points.len(),
    })
}

/// How long coverage may stand still before a kill comes anyway: the input
/// written so far is read, and what markers leave uncovered at its end (less
/// than a backup's lead of items a task) waits for input that is not coming.
const COVERAGE_STILL: Duration = Duration::from_secs(2);

/// Waits until the run's markers cover `target` items, or cover all they will
/// of the input written so far (coverage still for `COVERAGE_STILL`).
fn wait_for_coverage(
    group: &str,
    runs: &mut [Run],
    progress: &mut Progress<'_>,
    target: u64,
) -> Result<(), ServiceError> {
    let mut last = (progress.covered()?, Instant::now());
    wait_until(group, &format!("{target} items covered by markers"), runs, |_| {
        let covered = progress.covered()?;
        if covered != last.0 {
            last = (covered, Instant::now());
        }
        Ok(covered >= target || last.1.elapsed() > COVERAGE_STILL)
    })
}

/// A run's own copy of the experiment's input, written in parts while the run
/// goes on, partition by partition and in order, so that it is laid out as
/// the input is: an instance that joins has new input to read, and the kill
/// that follows comes mid-stream rather than after the group has read it all.
struct InputFeed<'a> {
    kafka: &'a KafkaConfig,
    reader: TopicReader,
    source: String,
    target: String,
    /// Each source partition's records, and how many of them are copied.
    ends: Vec<i64>,
    copied: Vec<i64>,
}

impl<'a> InputFeed<'a> {
    fn new(kafka: &'a KafkaConfig, source: &str, target: &str, partitions: usize) -> Result<Self, ServiceError> {
        ensure_topics(
            kafka,
            &[TopicSpec {
                name: target,
                partitions,
                compacted: false,
            }],
        )?;
        let reader = TopicReader::new(kafka, "feed")?;
        let ends = (0..partitions as i32)
            .map(|p| reader.watermarks(source, p).map(|(_, high)| high))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| ServiceError::Unsupported(format!("reading {source}: {e}")))?;
        Ok(InputFeed {
            kafka,
            reader,
            source: source.to_string(),
            target: target.to_string(),
            copied: vec![0; ends.len()],
            ends,
        })
    }

    /// Copies every partition up to `share` of its records; returns how many
    /// records it copied now.
    fn to(&mut self, share: f64) -> Result<u64, ServiceError> {
        let mut written = 0;
        for (partition, (&end, copied)) in self.ends.iter().zip(self.copied.iter_mut()).enumerate() {
            let upto = ((end as f64) * share.clamp(0.0, 1.0)).round() as i64;
            if upto <= *copied {
                continue;
            }
            let mut records = Vec::new();
            self.reader
                .read(&self.source, partition as i32, *copied, upto, |message| {
                    records.push(InputRecord {
                        key: rdkafka::Message::key(message).map(<[u8]>::to_vec),
                        value: rdkafka::Message::payload(message).unwrap_or_default().to_vec(),
                    });
                })
                .map_err(|e| ServiceError::Unsupported(format!("reading {}: {e}", self.source)))?;
            let options = ProduceOptions {
                partition: Some(partition as i32),
                ..ProduceOptions::default()
            };
            written += produce_from(
                self.kafka,
                &self.target,
                self.ends.len(),
                records.into_iter().map(Ok),
                &options,
            )?
            .records;
            *copied = upto;
        }
        Ok(written)
    }
}

/// Each partition's task starts over these runs.
fn starts(runs: &[Run]) -> std::collections::HashMap<i32, usize> {
    let mut all = std::collections::HashMap::new();
    for run in runs {
        for (partition, times) in run.starts() {
            *all.entry(partition).or_insert(0) += times;
        }
    }
    all
}

fn logs_named(runs: &[Run]) -> String {
    runs.iter()
        .map(|run| run.log().display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Fails if one of the runs has exited: they run until stopped.
fn check_alive(group: &str, runs: &mut [Run]) -> Result<(), ServiceError> {
    for run in runs.iter_mut() {
        run.check_alive()
            .map_err(|e| ServiceError::Child(format!("{group}: {e}")))?;
    }
    Ok(())
}

/// Waits (at most `KILL_DEADLINE`) until `done`, while every run keeps running.
fn wait_until(
    group: &str,
    what: &str,
    runs: &mut [Run],
    done: impl FnMut(&[Run]) -> Result<bool, ServiceError>,
) -> Result<(), ServiceError> {
    wait_until_within(KILL_DEADLINE, group, what, runs, done)
}

/// Waits (at most `patience`) until `done`, while every run keeps running.
fn wait_until_within(
    patience: Duration,
    group: &str,
    what: &str,
    runs: &mut [Run],
    mut done: impl FnMut(&[Run]) -> Result<bool, ServiceError>,
) -> Result<(), ServiceError> {
    let deadline = Instant::now() + patience;
    loop {
        check_alive(group, runs)?;
        if done(runs)? {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(ServiceError::Child(format!(
                "{group}: {what}: not within {patience:?}; see {}",
                logs_named(runs)
            )));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The kinds of kill that go together, and the instances they need.
fn validate_kills(options: &ExperimentOptions) -> Result<(), ServiceError> {
    let refuse = |why: String| Err(ServiceError::Unsupported(why));
    if options.instances == 0 {
        return refuse("--instances must be 1 or more".into());
    }
    if options.kill_mid_rebalance && options.instances < 2 {
        return refuse("--kill-mid-rebalance needs --instances 2 or more: a rebalance needs a member to join".into());
    }
    if options.kill_mid_backup && options.instances > 1 {
        return refuse("--kill-mid-backup runs one instance; it does not combine with --instances".into());
    }
    if options.instances > options.partitions {
        return refuse(format!(
            "--instances {} needs as many partitions (--partitions {}): an instance without one has nothing to lose",
            options.instances, options.partitions
        ));
    }
    Ok(())
}

/// What a run with kills left: its processes' logs (the last one's last) and
/// how many kills it made (fewer than asked when the input ended first).
struct Kills {
    logs: Vec<PathBuf>,
    made: usize,
}

/// Which backup (with entries) of a process a mid-backup kill comes in: early
/// enough that every process of a short run reaches it, late enough that each
/// makes progress.
const MID_BACKUP_KILLS: std::ops::RangeInclusive<u64> = 2..=8;

/// With node loss, the machine is gone with its disk: the restart restores
/// from the changelog.
fn lose_node(state_dir: Option<&Path>, options: &ExperimentOptions) -> Result<(), ServiceError> {
    let Some(dir) = state_dir.filter(|_| options.node_loss) else {
        return Ok(());
    };
    match std::fs::remove_dir_all(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(ServiceError::Child(format!("deleting {}: {e}", dir.display())))
        }
        _ => Ok(()),
    }
}

/// The report as a Markdown table.
pub fn markdown(report: &ExperimentReport) -> String {
    let t = &report.thresholds;
    let mut out = format!(
        "# afstream experiment: {} ({} workload)\n\n{} items on {} partitions, seed {}; mode {}, Θ = {}, L = {}, Γ = {}.\n\n",
        report.kind, report.workload, report.items, report.partitions, report.seed, t.mode, t.theta, t.max_uncovered,
        t.max_unacked
    );
    out.push_str("| run | failures injected | recoveries logged | restored states against the exact ones (within the bound so far) | output against the exact answer | bound (state + α·outputs, logged) | within | items/s (restarts included) | changelog written: records / markers / MB | slowest restore (s) |\n");
    out.push_str("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
    let yes_no = |within: Option<bool>| within.map_or("-", |w| if w { "yes" } else { "**no**" });
    for run in &report.runs {
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {:.1} | {} | {:.0} | {} / {} / {:.2} | {:.3} |\n",
            run.label,
            run.failures_injected,
            run.recoveries.len(),
            describe_recoveries(run),
            describe(&run.comparison),
            run.output_error_bound,
            yes_no(run.within_bound),
            run.items_per_second,
            run.changelog.records,
            run.changelog.markers,
            run.changelog.bytes as f64 / 1e6,
            run.recoveries.iter().map(|r| r.restore_seconds).fold(0.0, f64::max)
        ));
    }
    out
}

/// How the restored states compare with their bounds: `yes, at most 12% of
/// it` (every one within; the largest observed divergence was 12% of its
/// bound).
fn describe_recoveries(run: &RunOutcome) -> String {
    let Some(within) = run.recoveries_within_bound else {
        return "-".into();
    };
    let largest = run
        .recoveries
        .iter()
        .filter_map(|r| Some(r.observed_state? / r.bound_so_far.max(f64::MIN_POSITIVE)))
        .fold(0.0, f64::max);
    let percent = largest * 100.0;
    let share = if percent < 1.0 {
        format!("{percent:.3}%")
    } else {
        format!("{percent:.1}%")
    };
    format!("{}, at most {share} of it", if within { "yes" } else { "**no**" })
}

fn describe(comparison: &Comparison) -> String {
    match comparison {
        Comparison::PerKey {
            l1_error,
            max_error,
            missing,
            ..
        } => format!("L1 error {l1_error:.4}, largest {max_error:.4}, {missing} keys without output"),
        Comparison::HeavyHitters {
            precision,
            recall,
            f1,
            worst_relative_error,
            ..
        } => format!(
            "precision {precision:.3}, recall {recall:.3}, F1 {f1:.3}, worst estimate error {worst_relative_error:.4}"
        ),
        Comparison::Matches {
            output_lines,
            difference,
        } => format!("{output_lines} lines ({difference:+})"),
        Comparison::Predictions {
            output_items,
            accuracy,
            log_loss,
            ..
        } => format!("{output_items} predictions, accuracy {accuracy:.4}, log-loss {log_loss:.4}"),
        Comparison::Join {
            count_relative_error,
            sum_relative_error,
            ..
        } => match (count_relative_error, sum_relative_error) {
            (Some(c), Some(s)) => format!("COUNT relative error {c:.4}, SUM {s:.4}"),
            _ => "per-partition estimates".into(),
        },
    }
}

#[cfg(test)]
mod tests {
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
}
