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
use super::exact::{exact, producer_workload, Answer, Comparison};
use super::observed::{observed_divergences, RestoreCheck};
use super::produce::{produce_from, Encoder, InputRecord, ProduceOptions};
use crate::core::recovery::BackupMarker;
use crate::core::Norm;
use crate::service::config::KafkaConfig;
use crate::service::config::{self, Config, OperatorConfig, PolicyName};
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
    /// The sum of the recoveries' bounds on outputs lost.
    pub bound_lost_outputs: f64,
    /// What the output may be off by: the state bound, plus α for every output
    /// lost (a per-key output left stale moves that key by at most α) or
    /// repeated (an allowance: the latest output of a key is the replay's).
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
    /// Whether every bound the service logged is within the one computed
    /// here (a controller that does not halve logs larger ones); none where
    /// nothing is computed here.
    pub logged_bounds_as_computed: Option<bool>,
}

/// The state bounds of a partition's failures under the halving policy,
/// computed from the config's Θ and the number of tasks, not taken from the
/// service's log: a task gets Θ' = Θ/tasks under L1, Θ/√tasks under L2 (n
/// such distances combine to Θ) and Θ under a per-key maximum, starts at half
/// of it and halves after each recovery, so its k-th failure adds at most
/// Θ'/2^k.
#[derive(Clone, Copy, Debug)]
pub struct HalvingBounds {
    per_task: f64,
}

impl HalvingBounds {
    /// None for another policy or a chain's stage (their split is not this).
    pub fn of(config: &Config, partitions: usize) -> Result<Option<Self>, ServiceError> {
        let ft = &config.pipeline.fault_tolerance;
        if ft.policy != PolicyName::Halving || ft.recover_after_items.is_some() || config.stage.is_some() {
            return Ok(None);
        }
        let tasks = partitions as f64;
        let shares = match crate::service::check::plan(config, partitions)?.policy.norm {
            Norm::L1 | Norm::KeyCount => tasks,
            Norm::L2 => tasks.sqrt(),
            Norm::Max => 1.0,
        };
        Ok(Some(HalvingBounds {
            per_task: ft.theta / shares,
        }))
    }

    /// The bound of a partition's `k`-th failure.
    pub fn failure(self, k: u32) -> f64 {
        self.per_task / 2f64.powi(k.min(1023) as i32)
    }

    /// The bound of its first `k` failures together: Θ' · (1 − 2^−k).
    pub fn first(self, k: u32) -> f64 {
        self.per_task * (1.0 - 0.5f64.powi(k.min(1023) as i32))
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct RecoveryRecord {
    pub partition: i32,
    pub failures: u32,
    pub resume_offset: u64,
    pub bound_state: f64,
    pub bound_outputs: f64,
    pub bound_lost_outputs: f64,
    /// How long the restore took (store, last marker, changelog).
    pub restore_seconds: f64,
    /// The distance, in the operator's divergence, between the state the
    /// recovery restored from the changelog and the exact state at its resume
    /// offset (none for a restart on the local store, which is exact at its
    /// own offset).
    pub observed_state: Option<f64>,
    /// What the partition's failures so far may have left in that state: the
    /// sum of their state bounds, this one's included (computed here from Θ
    /// under the halving policy, see [`HalvingBounds`]; else as logged).
    pub bound_so_far: f64,
    /// This failure's state bound as computed here, where it can be.
    pub bound_computed: Option<f64>,
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
fn checked_recoveries(
    config: &Config,
    partitions: usize,
    logged: Vec<LoggedRecovery>,
) -> Result<Vec<RecoveryRecord>, ServiceError> {
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
    let computed = HalvingBounds::of(config, partitions)?;
    Ok(recovery_records(&logged, computed, |r| {
        r.changelog_end.and_then(|_| observed.next())
    }))
}

/// The logged recoveries as records, with the divergence `observed` gives for
/// each (in order).
pub fn recovery_records(
    logged: &[LoggedRecovery],
    computed: Option<HalvingBounds>,
    mut observed: impl FnMut(&LoggedRecovery) -> Option<f64>,
) -> Vec<RecoveryRecord> {
    // A partition's failure count rises by one at each recovery (a clean
    // restart keeps it), so the recoveries with a count up to this one's are
    // this one and those before it.
    let bound_so_far = |r: &LoggedRecovery| match computed {
        Some(bounds) => bounds.first(r.failures),
        None => logged
            .iter()
            .filter(|o| o.partition == r.partition && o.failures <= r.failures)
            .map(|o| o.bound_state)
            .sum::<f64>(),
    };
    logged
        .iter()
        .map(|r| RecoveryRecord {
            partition: r.partition,
            failures: r.failures,
            resume_offset: r.resume_offset,
            bound_state: r.bound_state,
            bound_outputs: r.bound_outputs,
            bound_lost_outputs: r.bound_lost_outputs,
            restore_seconds: r.restore_seconds,
            observed_state: observed(r),
            bound_so_far: bound_so_far(r),
            bound_computed: computed.map(|bounds| bounds.failure(r.failures)),
        })
        .collect()
}

/// Whether every bound the service logged is within the one computed here
/// (none computed: no answer).
fn logged_bounds_as_computed(recoveries: &[RecoveryRecord]) -> Option<bool> {
    let mut checked = recoveries
        .iter()
        .filter_map(|r| Some((r.bound_state, r.bound_computed?)))
        .peekable();
    checked.peek()?;
    Some(checked.all(|(logged, computed)| logged <= computed * (1.0 + 1e-9) + 1e-9))
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
    check_supported(&base, options)?;
    let text = std::fs::read_to_string(&options.config)
        .map_err(|e| ServiceError::Unsupported(format!("{}: {e}", options.config.display())))?;
    std::fs::create_dir_all(&options.dir)
        .map_err(|e| ServiceError::Unsupported(format!("{}: {e}", options.dir.display())))?;
    let workload = producer_workload(&base.pipeline.operator);
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default();
    let name = format!("{}-experiment-{stamp}", base.kafka.group_id);
    let experiment = Experiment {
        options,
        text,
        shared_input: format!("{name}-input"),
        name,
        alpha: crate::service::check::plan(&base, options.partitions)?.constants.alpha,
    };
    let encoder =
        Encoder::new(workload, base.pipeline.format, base.pipeline.avro.as_ref()).map_err(ServiceError::Unsupported)?;
    let records = encoder
        .synthetic(options.items, options.seed)
        .map_err(ServiceError::Unsupported)?;
    produce_from(
        &base.kafka,
        &experiment.shared_input,
        options.partitions,
        records.into_iter().map(Ok),
        &ProduceOptions::default(),
    )?;
    let ft = &base.pipeline.fault_tolerance;
    let mut runs = Vec::new();
    let mut answer = None;
    for (index, planned) in planned_runs(options, ft.theta, ft.max_uncovered)
        .into_iter()
        .enumerate()
    {
        let (outcome, exact_answer) = experiment.run(index, planned)?;
        answer.get_or_insert(exact_answer);
        runs.push(outcome);
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

/// What the experiment cannot run.
fn check_supported(base: &Config, options: &ExperimentOptions) -> Result<(), ServiceError> {
    if base.stage.is_some() {
        return Err(ServiceError::Unsupported(
            "experiment runs one pipeline; a chain's stages are not supported yet".into(),
        ));
    }
    validate_kills(options)?;
    if options.partitions > 1 && matches!(base.pipeline.operator, OperatorConfig::WordCount(_)) {
        return Err(ServiceError::Unsupported(
            "word_count counts per input partition and the synthetic lines are not keyed: run the experiment with \
             --partitions 1 (or run a two-stage WordCount)"
                .into(),
        ));
    }
    Ok(())
}

/// One run of the experiment: its label, the failures it makes, Θ and L.
struct PlannedRun {
    label: String,
    failures: usize,
    theta: f64,
    max_uncovered: u64,
}

/// Every Θ and L asked for (the config's if none), each failure-free and
/// with each number of failures.
fn planned_runs(options: &ExperimentOptions, theta: f64, max_uncovered: u64) -> Vec<PlannedRun> {
    let thetas = if options.thetas.is_empty() {
        vec![theta]
    } else {
        options.thetas.clone()
    };
    let ls = if options.max_uncovered.is_empty() {
        vec![max_uncovered]
    } else {
        options.max_uncovered.clone()
    };
    let sweep = thetas.len() > 1 || ls.len() > 1;
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
    let mut plan = Vec::new();
    for &theta in &thetas {
        for &l in &ls {
            let at = if sweep {
                format!(", Θ={theta}, L={l}")
            } else {
                String::new()
            };
            let run = |label: String, failures: usize| PlannedRun {
                label,
                failures,
                theta,
                max_uncovered: l,
            };
            plan.push(run(format!("failure-free{at}"), 0));
            for &failures in &options.failures {
                plan.push(run(format!("{failures} {kind}{point}{at}"), failures));
            }
        }
    }
    plan
}

/// What every run of one experiment shares.
struct Experiment<'a> {
    options: &'a ExperimentOptions,
    /// The config file's text, each run's config written from it.
    text: String,
    name: String,
    /// The topic the synthetic input is produced to once.
    shared_input: String,
    /// The operator's α: an output's error per unit of state error.
    alpha: f64,
}

impl Experiment<'_> {
    /// Runs the `index`th planned run in a group of its own, then compares
    /// its output with the exact answer.
    fn run(&self, index: usize, planned: PlannedRun) -> Result<(RunOutcome, Answer), ServiceError> {
        let options = self.options;
        let env = |key: &str| std::env::var(key).ok();
        let PlannedRun {
            label,
            failures,
            theta,
            max_uncovered: l,
        } = planned;
        let group = format!("{}-run{}", self.name, index + 1);
        let path = options.dir.join(format!("{group}.toml"));
        // A group of instances with kills reads its own copy of the input,
        // written while it runs (see `InputFeed`).
        let fed = options.instances > 1 && failures > 0;
        let input = if fed {
            format!("{group}-input")
        } else {
            self.shared_input.clone()
        };
        write_run_config(&self.text, &path, &group, &input, &options.dir.join(&group), (theta, l))?;
        let config = config::load(&path, &env)?;
        // Instance k > 1 has a config of its own: its own state directory.
        let mut instances = vec![(path.clone(), config.pipeline.state_dir.clone())];
        for k in 2..=options.instances {
            let path = options.dir.join(format!("{group}-instance{k}.toml"));
            let state = options.dir.join(format!("{group}-instance{k}"));
            write_run_config(&self.text, &path, &group, &input, &state, (theta, l))?;
            instances.push((path.clone(), config::load(&path, &env)?.pipeline.state_dir));
        }
        let started = Instant::now();
        let Kills { logs, made } = if instances.len() > 1 {
            let feed = if fed {
                Some(InputFeed::new(
                    &config.kafka,
                    &self.shared_input,
                    &input,
                    options.partitions,
                )?)
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
        let recoveries = checked_recoveries(&config, options.partitions, logged)?;
        let report = exact(&config, true)?;
        // `+ 0.0`: an empty sum is -0.0.
        let bound_state = recoveries.iter().map(|r| r.bound_state).sum::<f64>() + 0.0;
        let bound_outputs = recoveries.iter().map(|r| r.bound_outputs).sum::<f64>() + 0.0;
        let bound_lost_outputs = recoveries.iter().map(|r| r.bound_lost_outputs).sum::<f64>() + 0.0;
        let output_error_bound = bound_state + self.alpha * (bound_outputs + bound_lost_outputs);
        let comparison = report
            .comparison
            .ok_or_else(|| ServiceError::Unsupported("no comparison".into()))?;
        let within_bound = match &comparison {
            Comparison::PerKey { l1_error, .. } => Some(*l1_error <= output_error_bound + 1e-9),
            _ => None,
        };
        let stopped = stopped_totals(logs.last());
        let outcome = RunOutcome {
            label,
            theta,
            max_uncovered: l,
            backups: stopped("backups"),
            backup_entries: stopped("backup_entries"),
            markers: stopped("markers"),
            failures_injected: made,
            bound_state,
            bound_outputs,
            bound_lost_outputs,
            output_error_bound,
            seconds,
            items_per_second: options.items as f64 / seconds.max(1e-9),
            comparison,
            changelog: changelog_written(&config, &group, options.partitions)?,
            within_bound,
            recoveries_within_bound: recoveries_within_bound(&recoveries),
            logged_bounds_as_computed: logged_bounds_as_computed(&recoveries),
            recoveries,
        };
        Ok((outcome, report.answer))
    }
}

/// A field summed over the tasks that stopped cleanly in a run's last log.
fn stopped_totals(log: Option<&PathBuf>) -> impl Fn(&str) -> u64 {
    let text = log
        .and_then(|log| std::fs::read_to_string(log).ok())
        .unwrap_or_default();
    move |field: &str| -> u64 {
        text.lines()
            .filter(|line| line.contains("task stopped cleanly"))
            .filter_map(|line| log_field(line, field))
            .sum::<f64>() as u64
    }
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

mod kills;
mod report;

use kills::{run_with_kills, run_with_moves, validate_kills, InputFeed, Kills};
pub use report::markdown;

#[cfg(test)]
mod tests;
