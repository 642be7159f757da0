//! `afstream experiment` on a distributed learner (a file whose pipelines are
//! an `sgd_worker` and its `model_averager`): the learner on one seeded input,
//! for each consistency model, failure-free and with K SIGKILLs of its process
//! at seeded points (each followed by a restart). It reads back the global
//! models the averager published, with their timestamps: the workers' loss and
//! the L1 norm of the weights over time and over items, how long each run took
//! to reach the failure-free run's final loss, the final model's loss and
//! accuracy on held-out items, and every recovery's logged bound. The report is
//! JSON, Markdown and plots.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rdkafka::Message;
use serde::Serialize;

use super::child::{logged_recoveries, Run};
use super::experiment::{recovery_records, RecoveryRecord};
use super::produce::{produce_from, Encoder, ProduceOptions, Workload, VECTOR_FEATURES};
use crate::operators::{Consistency, DistributedSgdConfig, GlobalModel, LabeledVector, SgdWorker};
use crate::service::codec::GlobalModelRecord;
use crate::service::config::{self, Config, OperatorConfig};
use crate::service::kafka::TopicReader;
use crate::service::ServiceError;

/// The longest one run may take to reach a kill point or its last iteration.
const RUN_DEADLINE: Duration = Duration::from_secs(300);

/// How often a run's topics are read while waiting on it: each reading is a
/// client of its own, and the broker is busy with the run.
const POLL_EVERY: Duration = Duration::from_millis(250);

#[derive(Clone, Debug)]
pub struct ConvergenceOptions {
    /// A file with the learner's two pipelines.
    pub config: PathBuf,
    pub items: usize,
    /// Input partitions: workers.
    pub partitions: usize,
    /// One run with failures per count given (besides the failure-free run).
    pub failures: Vec<usize>,
    pub consistencies: Vec<Consistency>,
    /// Θ of the chain, one sweep of runs each (empty: the config's).
    pub thetas: Vec<f64>,
    pub seed: u64,
    pub dir: PathBuf,
}

/// One global model as the feedback topic has it.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct CurvePoint {
    /// Since the run's first process started.
    pub seconds: f64,
    /// Items the workers had trained on.
    pub items: u64,
    pub clock: u64,
    /// Mean of the workers' latest iteration losses.
    pub loss: f64,
    pub weights_l1: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct ConvergenceRun {
    pub label: String,
    pub consistency: Consistency,
    /// The chain's Θ the run had.
    pub theta: f64,
    /// SIGKILLs made: the count planned, fewer if the run published its last
    /// iteration before the rest were due.
    pub failures_injected: usize,
    pub recoveries: Vec<RecoveryRecord>,
    /// From the first start to the last iteration's global model.
    pub seconds: f64,
    pub curve: Vec<CurvePoint>,
    /// The mean loss of the last global models (a tenth of them, at least one).
    pub final_loss: f64,
    /// When the loss (the same mean, over the models before) first reached the
    /// failure-free run's final loss; None if it never did.
    pub seconds_to_reference: Option<f64>,
    /// Each kill's outage: from the SIGKILL until the restarted process had
    /// started every task again (the group noticing the death, then the
    /// restores), in seconds since the run's start.
    pub outages: Vec<Outage>,
    /// `seconds_to_reference` less the outages before it: the time the tasks
    /// ran, which is what approximate recovery (lost progress, replay) costs
    /// beside the failure-free run; the outages are mostly the group's
    /// session timeout.
    pub running_seconds_to_reference: Option<f64>,
    pub items_to_reference: Option<u64>,
    /// The final global model on items it never trained on.
    pub held_out_accuracy: f64,
    pub held_out_log_loss: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct ConvergenceReport {
    pub kind: &'static str,
    pub items: usize,
    pub partitions: usize,
    pub publish_every: u64,
    pub seed: u64,
    pub runs: Vec<ConvergenceRun>,
}

/// The learner's pipelines in a file: (worker's name, averager's name, the
/// worker's parameters).
fn learner(configs: &[Config]) -> Option<(String, String, DistributedSgdConfig)> {
    let name = |c: &Config| c.name.clone().unwrap_or_default();
    let (worker, sgd) = configs.iter().find_map(|c| match &c.pipeline.operator {
        OperatorConfig::SgdWorker(sgd) => Some((name(c), *sgd)),
        _ => None,
    })?;
    let averager = configs
        .iter()
        .find(|c| matches!(c.pipeline.operator, OperatorConfig::ModelAverager(_)))
        .map(name)?;
    Some((worker, averager, sgd))
}

/// Whether a config file holds a distributed learner.
pub fn is_learner(path: &Path) -> Result<bool, ServiceError> {
    let env = |key: &str| std::env::var(key).ok();
    Ok(learner(&config::load_all(path, &env)?).is_some())
}

pub fn run_convergence(options: &ConvergenceOptions) -> Result<ConvergenceReport, ServiceError> {
    let env = |key: &str| std::env::var(key).ok();
    let configs = config::load_all(&options.config, &env)?;
    let (worker, averager, sgd) = learner(&configs).ok_or_else(|| {
        ServiceError::Unsupported(format!(
            "{}: no sgd_worker pipeline with its model_averager",
            options.config.display()
        ))
    })?;
    let base = &configs[0];
    let text = std::fs::read_to_string(&options.config)
        .map_err(|e| ServiceError::Unsupported(format!("{}: {e}", options.config.display())))?;
    std::fs::create_dir_all(&options.dir)
        .map_err(|e| ServiceError::Unsupported(format!("{}: {e}", options.dir.display())))?;
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default();
    let name = format!("{}-convergence-{stamp}", base.kafka.group_id);
    let input = format!("{name}-input");
    produce_vectors(base, options, &input)?;
    let reader = TopicReader::new(&base.kafka, "convergence")?;
    let last = publications(&reader, &input, options.partitions, sgd.publish_every)?;
    let (held_out, _) = crate::workloads::separable_vectors(options.items + 2_000, VECTOR_FEATURES, 10, options.seed);
    let convergence = Convergence {
        options,
        text,
        name,
        input,
        names: (worker, averager),
        sgd,
        reader,
        last,
        held_out: &held_out[options.items..],
    };
    let configured = base.pipeline.fault_tolerance.theta;
    let thetas = if options.thetas.is_empty() {
        vec![configured]
    } else {
        options.thetas.clone()
    };
    let mut runs: Vec<ConvergenceRun> = Vec::new();
    for &theta in &thetas {
        for &consistency in &options.consistencies {
            for failures in std::iter::once(0).chain(options.failures.iter().copied()) {
                let mut label = format!("{consistency:?}, {failures} failures").to_lowercase();
                if thetas.len() > 1 {
                    label.push_str(&format!(", Θ={theta}"));
                }
                let run = convergence.run(label, (theta, consistency, failures), &runs)?;
                runs.push(run);
                let report = report_of(options, sgd.publish_every, runs);
                write_report(&report, &options.dir)?;
                runs = report.runs;
            }
        }
    }
    Ok(report_of(options, sgd.publish_every, runs))
}

/// The synthetic vectors, keyed by their number so that the partitions hold
/// about as many each: under BSP every worker goes only as far as the
/// smallest partition allows.
fn produce_vectors(base: &Config, options: &ConvergenceOptions, input: &str) -> Result<(), ServiceError> {
    let encoder = Encoder::new(Workload::Vectors, base.pipeline.format, base.pipeline.avro.as_ref())
        .map_err(ServiceError::Unsupported)?;
    let records = encoder
        .synthetic(options.items, options.seed)
        .map_err(ServiceError::Unsupported)?
        .into_iter()
        .enumerate()
        .map(|(i, mut record)| {
            record.key = Some(i.to_string().into_bytes());
            Ok(record)
        });
    produce_from(
        &base.kafka,
        input,
        options.partitions,
        records,
        &ProduceOptions::default(),
    )?;
    Ok(())
}

/// How many models every worker publishes: the smallest partition's items
/// over `publish_every`.
fn publications(reader: &TopicReader, input: &str, partitions: usize, publish_every: u64) -> Result<u64, ServiceError> {
    let mut counts = vec![0u64; partitions];
    for (partition, count) in counts.iter_mut().enumerate() {
        reader
            .read_all(input, partition as i32, |_| *count += 1)
            .map_err(|e| ServiceError::Unsupported(format!("{input}: {e}")))?;
    }
    let last = counts.iter().min().copied().unwrap_or(0) / publish_every;
    if last == 0 {
        return Err(ServiceError::Unsupported(format!(
            "a partition holds fewer than publish_every = {publish_every} items: produce more"
        )));
    }
    Ok(last)
}

/// What every run of one convergence experiment shares.
struct Convergence<'a> {
    options: &'a ConvergenceOptions,
    /// The config file's text, each run's config written from it.
    text: String,
    name: String,
    input: String,
    /// The worker's and the averager's pipeline names.
    names: (String, String),
    sgd: DistributedSgdConfig,
    reader: TopicReader,
    /// How many models every worker publishes.
    last: u64,
    held_out: &'a [LabeledVector],
}

impl Convergence<'_> {
    /// One run at Θ, under a consistency model, with its failures; `earlier`
    /// holds the failure-free run it is compared with, if it came first.
    fn run(
        &self,
        label: String,
        (theta, consistency, failures): (f64, Consistency, usize),
        earlier: &[ConvergenceRun],
    ) -> Result<ConvergenceRun, ServiceError> {
        let options = self.options;
        let group = format!("{}-run{}", self.name, earlier.len() + 1);
        let path = options.dir.join(format!("{group}.toml"));
        let names = (self.names.0.as_str(), self.names.1.as_str());
        let run_settings = RunSettings {
            consistency,
            workers: options.partitions,
            theta,
        };
        write_run_config(&self.text, &path, &group, &self.input, names, run_settings)?;
        let run = LearnerRun {
            path: &path,
            group: &group,
            dir: &options.dir,
            workers: options.partitions as u64,
            reader: &self.reader,
        };
        let started = std::time::SystemTime::now();
        let Ran {
            logs,
            kills,
            seconds,
            outages,
        } = run.run(failures, self.last, options.seed ^ earlier.len() as u64)?;
        let models = run.global_models()?;
        let start_ms = started
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as i64)
            .unwrap_or_default();
        let curve: Vec<CurvePoint> = first_of_each_version(&models)
            .map(|(at, g)| CurvePoint {
                seconds: (at - start_ms) as f64 / 1000.0,
                items: g.items,
                clock: g.clock,
                loss: g.loss,
                weights_l1: g.weights_l1,
            })
            .collect();
        let final_loss = tail_mean(&curve);
        // The failure-free run of the same consistency model and Θ (the first
        // of its runs).
        let reference = earlier
            .iter()
            .find(|r| r.consistency == consistency && r.theta == theta && r.failures_injected == 0)
            .map_or(final_loss, |r| r.final_loss);
        let reached = first_reaching(&curve, reference);
        let mut model = SgdWorker::new(sgd_with(self.sgd, consistency, options.partitions), 0)
            .map_err(|e| ServiceError::Unsupported(e.to_string()))?;
        if let Some((_, last_model)) = models.iter().max_by_key(|(_, g)| (g.clock, g.version)) {
            model.take_in(last_model);
        }
        let (held_out_accuracy, held_out_log_loss) = model.model().evaluate(self.held_out);
        let logged: Vec<_> = logs
            .iter()
            .filter_map(|log| std::fs::read_to_string(log).ok())
            .flat_map(|text| logged_recoveries(&text))
            .collect();
        // A worker's state also follows the global models it takes in,
        // which its input alone does not give: no exact state to hold a
        // restored one against.
        let recoveries = recovery_records(&logged, None, |_| None);
        Ok(ConvergenceRun {
            label,
            consistency,
            theta,
            failures_injected: kills,
            recoveries,
            seconds,
            final_loss,
            seconds_to_reference: reached.map(|p| p.seconds),
            running_seconds_to_reference: reached.map(|p| p.seconds - down_before(&outages, p.seconds)),
            outages,
            items_to_reference: reached.map(|p| p.items),
            curve,
            held_out_accuracy,
            held_out_log_loss,
        })
    }
}

/// The report of the runs so far, written (JSON and Markdown) after each
/// run: a long experiment that fails later keeps what it measured.
fn report_of(options: &ConvergenceOptions, publish_every: u64, runs: Vec<ConvergenceRun>) -> ConvergenceReport {
    ConvergenceReport {
        kind: "distributed_sgd",
        items: options.items,
        partitions: options.partitions,
        publish_every,
        seed: options.seed,
        runs,
    }
}

fn write_report(report: &ConvergenceReport, dir: &Path) -> Result<(), ServiceError> {
    let json = serde_json::to_string_pretty(report).map_err(|e| ServiceError::Unsupported(e.to_string()))?;
    write(&dir.join("report.json"), &json)?;
    write(&dir.join("report.md"), &markdown(report))?;
    Ok(())
}

fn sgd_with(sgd: DistributedSgdConfig, consistency: Consistency, workers: usize) -> DistributedSgdConfig {
    DistributedSgdConfig {
        consistency,
        workers: workers as u32,
        ..sgd
    }
}

/// The global models in the order published, each version once: a recovered
/// averager replays its input from its marker and sends again the global
/// models it sent after it (the same versions: a version counts the worker
/// models averaged, and the replay averages the same ones). Those are outputs
/// delivered twice, not the learner's progress: counted, they put early,
/// worse models late in the curve and late into every window of the loss.
fn first_of_each_version(models: &[(i64, GlobalModel)]) -> impl Iterator<Item = &(i64, GlobalModel)> {
    let mut seen = std::collections::HashSet::new();
    models.iter().filter(move |(_, g)| seen.insert(g.version))
}

/// How many of the last points the final loss averages: a tenth, at least one
/// (one global model is one worker's iteration, a noisy figure).
fn tail(points: usize) -> usize {
    (points / 10).max(1)
}

fn tail_mean(curve: &[CurvePoint]) -> f64 {
    let n = tail(curve.len()).min(curve.len());
    if n == 0 {
        return f64::NAN;
    }
    curve[curve.len() - n..].iter().map(|p| p.loss).sum::<f64>() / n as f64
}

/// The first point at which the mean loss of the points up to it (over the
/// same window as the final loss) is at or below `reference`.
fn first_reaching(curve: &[CurvePoint], reference: f64) -> Option<CurvePoint> {
    let window = tail(curve.len());
    (window..=curve.len())
        .find(|&end| curve[end - window..end].iter().map(|p| p.loss).sum::<f64>() / window as f64 <= reference)
        .map(|end| curve[end - 1])
}

struct LearnerRun<'a> {
    path: &'a Path,
    group: &'a str,
    dir: &'a Path,
    workers: u64,
    /// One client for every check: a new one per check took long enough on a
    /// busy broker for a short run to finish between two checks.
    reader: &'a TopicReader,
}

impl LearnerRun<'_> {
    fn models_topic(&self) -> String {
        format!("{}-models", self.group)
    }

    fn feedback_topic(&self) -> String {
        format!("{}-feedback", self.group)
    }

    /// Records in the model topic (one partition).
    fn models(&self) -> Result<u64, ServiceError> {
        let (low, high) = self.reader.watermarks(&self.models_topic(), 0)?;
        Ok((high - low).max(0) as u64)
    }

    /// The global models published, with their timestamps (ms since the epoch).
    fn global_models(&self) -> Result<Vec<(i64, GlobalModel)>, ServiceError> {
        let topic = self.feedback_topic();
        if self.reader.partitions(&topic)?.is_none() {
            return Ok(Vec::new());
        }
        let mut models = Vec::new();
        let mut bad = None;
        let read = self.reader.read_all(&topic, 0, |message| {
            let decoded = serde_json::from_slice::<GlobalModelRecord>(message.payload().unwrap_or_default())
                .map_err(|e| e.to_string())
                .and_then(|record| record.to_model());
            match decoded {
                Ok(model) => models.push((message.timestamp().to_millis().unwrap_or_default(), model)),
                Err(error) => {
                    bad.get_or_insert(error);
                }
            }
        });
        read.map_err(|e| ServiceError::Unsupported(format!("{topic}: {e}")))?;
        match bad {
            Some(error) => Err(ServiceError::Unsupported(format!("{topic}: a global model: {error}"))),
            None => Ok(models),
        }
    }

    fn reached(&self, last: u64) -> Result<bool, ServiceError> {
        Ok(self.global_models()?.iter().any(|(_, g)| g.clock >= last))
    }

    /// Runs the learner until the averager publishes iteration `last`, with
    /// up to `failures` SIGKILLs of its process at seeded shares of the
    /// models, each followed by a restart; stops it cleanly. Each kill waits
    /// until the process before it has started its tasks (so it kills running
    /// tasks, not a starting process), and none comes once iteration `last`
    /// is published. Returns its logs, the kills made and how long it took
    /// to reach `last`.
    fn run(&self, failures: usize, last: u64, seed: u64) -> Result<Ran, ServiceError> {
        let mut rng = StdRng::seed_from_u64(seed ^ 0xfa11);
        let mut points: Vec<f64> = (0..failures).map(|_| rng.gen_range(0.05..0.9)).collect();
        points.sort_by(f64::total_cmp);
        let expected = last * self.workers;
        // The workers' tasks and the averager's.
        let tasks = self.workers as usize + 1;
        let started = Instant::now();
        let mut logs = Vec::new();
        let start = |logs: &mut Vec<PathBuf>| -> Result<Run, ServiceError> {
            let log = self.dir.join(format!("{}-{}.log", self.group, logs.len() + 1));
            logs.push(log.clone());
            Run::start(self.path, log, false)
        };
        let mut run = start(&mut logs)?;
        let mut kills = 0;
        let mut outages = Vec::new();
        for fraction in points {
            let target = (fraction * expected as f64) as u64;
            self.wait(&mut run, &format!("{target} models"), |run| {
                Ok(run.started_tasks() >= tasks && (self.models()? >= target || self.reached(last)?))
            })?;
            if self.reached(last)? {
                break;
            }
            run.kill();
            let killed_at = started.elapsed().as_secs_f64();
            kills += 1;
            run = start(&mut logs)?;
            self.wait(&mut run, "the restarted process's tasks", |run| {
                Ok(run.started_tasks() >= tasks)
            })?;
            outages.push(Outage {
                killed_at,
                running_at: started.elapsed().as_secs_f64(),
            });
        }
        self.wait(&mut run, &format!("the global model of iteration {last}"), |_| {
            self.reached(last)
        })?;
        let seconds = started.elapsed().as_secs_f64();
        run.stop()?;
        Ok(Ran {
            logs,
            kills,
            seconds,
            outages,
        })
    }

    fn wait(
        &self,
        run: &mut Run,
        what: &str,
        mut done: impl FnMut(&Run) -> Result<bool, ServiceError>,
    ) -> Result<(), ServiceError> {
        let deadline = Instant::now() + RUN_DEADLINE;
        loop {
            match done(run) {
                Ok(true) => break,
                Ok(false) => {}
                // A broker busy with the run may answer late: asked again
                // until the deadline.
                Err(error) => tracing::warn!(%error, "{}: checking for {what}", self.group),
            }
            run.check_alive()?;
            if Instant::now() > deadline {
                return Err(ServiceError::Child(format!(
                    "{}: {what} not within {RUN_DEADLINE:?}; see {}",
                    self.group,
                    run.log().display()
                )));
            }
            std::thread::sleep(POLL_EVERY);
        }
        Ok(())
    }
}

/// What one run of the learner varies.
struct RunSettings {
    consistency: Consistency,
    workers: usize,
    /// The chain's Θ (set where the file sets it: on the stage with thresholds).
    theta: f64,
}

/// The config of one run: the user's two pipelines with their own group and
/// topics, the experiment's input, one worker per partition, and the
/// consistency model and Θ of the run.
fn write_run_config(
    text: &str,
    path: &Path,
    group: &str,
    input: &str,
    (worker, averager): (&str, &str),
    settings: RunSettings,
) -> Result<(), ServiceError> {
    let bad = |e: String| ServiceError::Unsupported(format!("rewriting the config for {group}: {e}"));
    let mut table: toml::Table = text.parse().map_err(|e: toml::de::Error| bad(e.to_string()))?;
    let models = format!("{group}-models");
    let feedback = format!("{group}-feedback");
    let consistency = match settings.consistency {
        Consistency::Asp => "asp",
        Consistency::Bsp => "bsp",
        Consistency::Ssp => "ssp",
    };
    if let Some(toml::Value::Table(kafka)) = table.get_mut("kafka") {
        kafka.insert("group_id".into(), group.into());
    }
    let Some(toml::Value::Table(pipelines)) = table.get_mut("pipelines") else {
        return Err(bad("no [pipelines.NAME] tables".into()));
    };
    for (name, topics) in [
        (
            worker,
            [
                ("input_topic", input),
                ("output_topic", &models),
                ("feedback_topic", &feedback),
            ],
        ),
        (
            averager,
            [("input_topic", &models), ("output_topic", &feedback), ("", "")],
        ),
    ] {
        let Some(toml::Value::Table(pipeline)) = pipelines.get_mut(name) else {
            return Err(bad(format!("no [pipelines.{name}] table")));
        };
        for (key, topic) in topics.into_iter().filter(|(key, _)| !key.is_empty()) {
            pipeline.insert(key.into(), topic.into());
        }
        pipeline.remove("changelog_topic");
        pipeline.remove("dead_letter_topic");
        if let Some(toml::Value::Table(operator)) = pipeline.get_mut("operator") {
            operator.insert("consistency".into(), consistency.into());
            operator.insert("workers".into(), (settings.workers as i64).into());
        }
        if let Some(toml::Value::Table(ft)) = pipeline.get_mut("fault_tolerance") {
            ft.insert("theta".into(), settings.theta.into());
        }
    }
    // One process runs at a time: no exporter port to share.
    table.remove("metrics");
    write(path, &toml::to_string(&table).map_err(|e| bad(e.to_string()))?)
}

fn write(path: &Path, text: &str) -> Result<(), ServiceError> {
    std::fs::write(path, text).map_err(|e| ServiceError::Unsupported(format!("{}: {e}", path.display())))
}

fn optional(value: Option<f64>) -> String {
    value.map_or("never".to_string(), |v| format!("{v:.1}"))
}

/// What [`LearnerRun::run`] did.
struct Ran {
    logs: Vec<PathBuf>,
    kills: usize,
    /// To the last iteration's global model.
    seconds: f64,
    outages: Vec<Outage>,
}

/// A kill's outage, in seconds since the run's start.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Outage {
    pub killed_at: f64,
    /// Every task of the restarted process had started.
    pub running_at: f64,
}

/// How long the outages kept the tasks down before `at`.
fn down_before(outages: &[Outage], at: f64) -> f64 {
    outages
        .iter()
        .map(|o| (o.running_at.min(at) - o.killed_at).max(0.0))
        .sum()
}

/// The report as a Markdown table, a row per run.
pub fn markdown(report: &ConvergenceReport) -> String {
    let mut out = format!(
        "# Distributed SGD: convergence through failures\n\n{} items on {} partitions (a worker each), a model \
         every {} items, seed {}.\n\n",
        report.items, report.partitions, report.publish_every, report.seed
    );
    out.push_str(
        "| run | kills | recoveries | seconds | final loss | seconds to the failure-free final loss | of them with \
         the tasks running (outages left out) | items to it | held-out accuracy | held-out log-loss |\n| --- | --- \
         | --- | --- | --- | --- | --- | --- | --- | --- |\n",
    );
    for run in &report.runs {
        out.push_str(&format!(
            "| {} | {} | {} | {:.1} | {:.4} | {} | {} | {} | {:.4} | {:.4} |\n",
            run.label,
            run.failures_injected,
            run.recoveries.len(),
            run.seconds,
            run.final_loss,
            optional(run.seconds_to_reference),
            optional(run.running_seconds_to_reference),
            run.items_to_reference.map_or("never".to_string(), |n| n.to_string()),
            run.held_out_accuracy,
            run.held_out_log_loss,
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outages_count_only_up_to_the_moment_asked_about() {
        let outages = [
            Outage {
                killed_at: 1.0,
                running_at: 8.0,
            },
            Outage {
                killed_at: 10.0,
                running_at: 17.0,
            },
        ];
        assert_eq!(down_before(&outages, 0.5), 0.0, "before the first kill");
        assert_eq!(down_before(&outages, 5.0), 4.0, "inside the first outage");
        assert_eq!(down_before(&outages, 9.0), 7.0, "between the two");
        assert_eq!(down_before(&outages, 20.0), 14.0, "after both");
        assert_eq!(down_before(&[], 20.0), 0.0);
    }

    fn point(items: u64, loss: f64) -> CurvePoint {
        CurvePoint {
            seconds: items as f64 / 100.0,
            items,
            clock: items / 10,
            loss,
            weights_l1: 1.0,
        }
    }

    #[test]
    fn a_run_config_takes_the_runs_theta_consistency_workers_and_topics() {
        let dir = std::env::temp_dir().join(format!("afstream-convergence-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a temporary directory");
        let path = dir.join("run.toml");
        let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/configs/distributed-sgd.toml"))
            .expect("the shipped learner config");
        let settings = RunSettings {
            consistency: Consistency::Ssp,
            workers: 3,
            theta: 7.5,
        };
        write_run_config(&text, &path, "g", "in", ("workers", "average"), settings).expect("rewritten");
        let env = |_: &str| None;
        let configs = config::load_all(&path, &env).expect("the rewritten config loads");
        std::fs::remove_dir_all(&dir).ok();
        let (_, _, sgd) = learner(&configs).expect("still a learner");
        assert_eq!(sgd.consistency, Consistency::Ssp);
        assert_eq!(sgd.workers, 3);
        for config in &configs {
            // The chain's Θ reaches both stages.
            assert_eq!(config.pipeline.fault_tolerance.theta, 7.5, "{:?}", config.name);
        }
        assert_eq!(configs[0].pipeline.input_topic, "in");
        assert_eq!(configs[0].pipeline.output_topic, "g-models");
        assert_eq!(configs[1].pipeline.output_topic, "g-feedback");
    }

    #[test]
    fn global_models_sent_again_by_a_recovered_averager_count_once() {
        let model = |version: u64, loss: f64| GlobalModel {
            clock: version,
            version,
            workers: 1,
            items: version * 10,
            loss,
            accuracy: 0.5,
            weights_l1: 1.0,
            weights: Vec::new(),
            iterations: vec![version],
        };
        // Versions 1-3, a crash, the replay of 2 and 3 (sent again), then 4.
        let models = [
            (1, model(1, 0.9)),
            (2, model(2, 0.8)),
            (3, model(3, 0.7)),
            (10, model(2, 0.8)),
            (10, model(3, 0.7)),
            (11, model(4, 0.6)),
        ];
        let kept: Vec<(i64, u64)> = first_of_each_version(&models).map(|(at, g)| (*at, g.version)).collect();
        assert_eq!(kept, [(1, 1), (2, 2), (3, 3), (11, 4)]);
    }

    #[test]
    fn the_reference_is_reached_where_the_windowed_loss_first_gets_down_to_it() {
        let curve: Vec<CurvePoint> = (0..20).map(|i| point(i * 10, 1.0 - i as f64 * 0.04)).collect();
        // A tenth of 20 points: windows of 2.
        assert!((tail_mean(&curve) - (0.28 + 0.24) / 2.0).abs() < 1e-12);
        let reached = first_reaching(&curve, 0.501).expect("reached");
        // Points 12 and 13 (0.52, 0.48) are the first two to average 0.5.
        assert_eq!(reached.items, 130);
        assert!(first_reaching(&curve, 0.1).is_none());
        assert!(tail_mean(&[]).is_nan());
    }
}
