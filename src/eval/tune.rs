//! `afstream tune`: from the error a user accepts to the thresholds that
//! meet it on their own data, with what each choice costs.
//!
//! **The error E** is relative, in the workload's own terms (each kind's
//! [`Measured::error_measure`]): the distance between the state after the
//! failures and the failure-free state, in the operator's divergence (the
//! norm Θ is in), as a share of the exact state's size in that norm at the end
//! of the sample (heavy hitters: of the heavy-hitter threshold in bytes).
//! Counts and sums only grow, so a bound that holds as a share of the sample
//! holds as a smaller share of any longer stream: choose the sample as long as
//! the shortest stretch of input the budget must hold over.
//!
//! **The bound** is the one the service logs and `check` prints, from the
//! thresholds each task runs with after k failures
//! ([`crate::core::ThresholdPolicy`]). A failure is taken to hit every task
//! at once (a process or a machine lost with all of its partitions), the
//! worst place it can be: after K failures every task has failed K times, or,
//! without K, any number of times (the limit halving guarantees). The
//! tasks' bounds add up when the divergence does, else the pipeline's is one
//! task's. The bound is linear in Θ, so the largest Θ within budget is
//! Θ · E·size / bound(Θ).
//!
//! **The choice.** Candidates: that Θ and fractions of it, each with L at a
//! tenth of the config's up to a hundred times it. Each is measured on the
//! sample ([`measure`]): changelog records per item failure-free, and the
//! error and items replayed after K crashes (3 without K). The recommended
//! candidate meets E by its bound and by its measurement, and writes the
//! fewest changelog records per item; among those within 5 % of the fewest,
//! it replays the fewest items (the smallest L). Γ is the config's, raised to
//! eight outputs of one item per task when under it (`check`'s warning).
//!
//! **β from the data.** Where the user sets β (WordCount's
//! `max_words_per_line`: longer lines are refused whole), the sample is read
//! with no cap and the most outputs one record made is measured; a β under
//! it would refuse records of the sample, so tune raises it to the next power
//! of two, runs the candidates with it, and `--write` writes it too.

mod measure;
mod sample;
mod write;

use std::path::PathBuf;

use serde::Serialize;

use crate::core::{Norm, Operator};
use crate::eval::produce::FileFormat;
use crate::operators::{
    Grep, HeavyHitters, HitterThreshold, KeyedAggregation, ModelAverager, OnlineJoin, OnlineLogisticRegression,
    SgdWorker, Tokenize, WordCount,
};
use crate::service::check::TaskPlan;
use crate::service::codec::ServiceOperator;
use crate::service::config::{Config, ModeName, PolicyName};
use crate::service::ServiceError;
use sample::Sample;

pub use write::write_choice;

/// Crashes each candidate is measured with when no failure count is given.
const SIMULATED_FAILURES: u32 = 3;
/// Candidates within this share of the fewest changelog records per item
/// count as equally cheap; the one replaying the fewest items wins.
const CHEAP_ENOUGH: f64 = 1.05;
/// Θ candidates, as fractions of the largest Θ within budget.
const THETA_FRACTIONS: [f64; 4] = [1.0, 0.5, 0.25, 0.1];
/// L candidates, as multiples of the config's L.
const L_MULTIPLES: [f64; 4] = [0.1, 1.0, 10.0, 100.0];
/// Γ per task is at least this many outputs of one item.
const OUTPUTS_OF_ITEMS: u64 = 8;
/// β while the sample is read, so that no record is refused for its fan-out.
const UNCAPPED_FANOUT: u64 = 1 << 32;

#[derive(Clone, Debug)]
pub struct TuneOptions {
    /// E: the relative error accepted (0.005 = 0.5 %).
    pub error: f64,
    /// K: the failures to survive; `None`: any number (halving).
    pub failures: Option<u32>,
    /// Records to sample.
    pub sample: usize,
    /// Sample this file instead of the input topic.
    pub input: Option<PathBuf>,
    pub file_format: Option<FileFormat>,
    /// Input partitions, with a file (a topic has its own).
    pub partitions: usize,
    pub seed: u64,
}

/// One candidate's thresholds and what they cost and guarantee.
#[derive(Clone, Debug, Serialize)]
pub struct Candidate {
    pub theta: f64,
    pub max_uncovered: u64,
    pub max_unacked: u64,
    /// The bound after the failures, as a share of the exact state's size.
    pub bound: f64,
    pub changelog_records_per_item: f64,
    /// Items a recovery replayed, on average over the simulated crashes.
    pub replayed_per_failure: f64,
    /// The error measured after the simulated crashes, as a share.
    pub measured: f64,
    /// Guarantees the harness found broken (a bug if not 0).
    pub violations: u64,
    pub meets_budget: bool,
}

/// β measured on the sample, for an operator whose config sets it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Fanout {
    /// The operator's config key that sets β.
    pub key: &'static str,
    pub configured: u64,
    /// The most outputs one sampled record made.
    pub measured: u64,
    /// What the candidates run with: the configured β, or the next power of
    /// two over the measured one if the configured one would refuse records.
    pub chosen: u64,
}

impl Fanout {
    fn of(key: &'static str, configured: u64, measured: u64) -> Self {
        let chosen = if measured > configured {
            measured.next_power_of_two()
        } else {
            configured
        };
        Fanout {
            key,
            configured,
            measured,
            chosen,
        }
    }

    /// Whether the config must change.
    pub fn raised(&self) -> bool {
        self.chosen != self.configured
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct TuneReport {
    pub kind: &'static str,
    pub source: String,
    pub records: u64,
    pub refused: u64,
    pub partitions: usize,
    /// What E measures, in words.
    pub error_measure: String,
    /// E.
    pub budget: f64,
    /// The exact state's size E is a share of.
    pub size: f64,
    /// K, or `None` for any number.
    pub failures: Option<u32>,
    /// Crashes each candidate was measured with.
    pub simulated_failures: u32,
    /// β measured, where the config sets it.
    pub fanout: Option<Fanout>,
    /// The largest Θ whose bound meets E.
    pub largest_theta: f64,
    pub current: Candidate,
    pub candidates: Vec<Candidate>,
    /// Index into `candidates`.
    pub recommended: Option<usize>,
}

impl TuneReport {
    pub fn recommendation(&self) -> Option<&Candidate> {
        self.recommended.map(|i| &self.candidates[i])
    }
}

/// Tunes the config's pipeline (one, in a file of several: its name given).
pub fn tune(config: &Config, options: &TuneOptions) -> Result<TuneReport, ServiceError> {
    if !(options.error.is_finite() && options.error > 0.0) {
        return Err(unsupported(format!(
            "--error {}: must be a positive share (0.005 or 0.5%)",
            options.error
        )));
    }
    check_tunable(config, options)?;
    crate::with_operator!(&config.pipeline.operator, |O, c| <O as Tunable>::tune(
        config, c, options
    ))
}

fn unsupported(message: String) -> ServiceError {
    ServiceError::Unsupported(message)
}

fn check_tunable(config: &Config, options: &TuneOptions) -> Result<(), ServiceError> {
    let ft = &config.pipeline.fault_tolerance;
    if ft.mode != ModeName::Approximate {
        return Err(unsupported(format!(
            "the pipeline runs in {:?} mode: tune chooses approximate mode's thresholds (set mode = \"approximate\")",
            ft.mode
        )));
    }
    if ft.policy == PolicyName::Fixed && options.failures.is_none() {
        return Err(unsupported(
            "under the fixed policy every failure adds a full Θ: give --failures".into(),
        ));
    }
    match &config.stage {
        Some(stage) if stage.index < stage.stages => Err(unsupported(format!(
            "pipeline {} is stage {} of the chain {}: tune its last stage, which declares the chain's thresholds",
            config.name.as_deref().unwrap_or("-"),
            stage.index,
            stage.chain.join(" -> ")
        ))),
        _ => Ok(()),
    }
}

/// How an operator kind is tuned, or why it is not.
pub trait Tunable: ServiceOperator {
    fn tune(config: &Config, operator: &Self::Config, options: &TuneOptions) -> Result<TuneReport, ServiceError>;
}

/// An operator whose state error tune measures.
pub trait Measured: ServiceOperator + Clone {
    /// E, in words.
    fn error_measure(&self) -> String;
    /// The size E is a share of, for one task's exact state: by default its
    /// distance from an empty state, in the operator's divergence.
    fn size(exact: &Self, empty: &Self) -> f64 {
        exact.distance(empty)
    }
    /// The operator config's key that sets β, where the user sets it.
    const FANOUT_KEY: Option<&'static str> = None;
    /// The config with β set to `beta`.
    fn with_fanout(config: &Self::Config, beta: u64) -> Self::Config {
        let _ = beta;
        config.clone()
    }
}

macro_rules! tuned {
    ($($operator:ty),*) => {$(
        impl Tunable for $operator {
            fn tune(config: &Config, operator: &Self::Config, options: &TuneOptions) -> Result<TuneReport, ServiceError> {
                tune_operator::<Self>(config, operator, options)
            }
        }
    )*};
}

macro_rules! not_tuned {
    ($($operator:ty => $why:expr),*) => {$(
        impl Tunable for $operator {
            fn tune(_: &Config, _: &Self::Config, _: &TuneOptions) -> Result<TuneReport, ServiceError> {
                Err(unsupported($why.into()))
            }
        }
    )*};
}

tuned!(
    WordCount,
    KeyedAggregation,
    HeavyHitters,
    OnlineJoin,
    OnlineLogisticRegression
);
not_tuned!(
    Grep => "grep keeps no state: Θ bounds nothing, and L and Γ only bound replays and unacknowledged outputs",
    Tokenize => "tokenize keeps no state: tune the stage that counts its words",
    SgdWorker => "a distributed learner's error is its loss: sweep Θ with `afstream experiment --theta`",
    ModelAverager => "a distributed learner's error is its loss: sweep Θ with `afstream experiment --theta`"
);

impl Measured for WordCount {
    fn error_measure(&self) -> String {
        "relative L1 error of the counts: Σ|count − exact count| over the words / Σ exact counts".into()
    }
    const FANOUT_KEY: Option<&'static str> = Some("max_words_per_line");
    fn with_fanout(config: &Self::Config, beta: u64) -> Self::Config {
        crate::operators::WordCountConfig {
            max_words_per_line: beta,
            ..*config
        }
    }
}

impl Measured for KeyedAggregation {
    fn error_measure(&self) -> String {
        format!(
            "the aggregates' error in their divergence ({:?}) relative to the exact aggregates' size in it \
             (L1: Σ|aggregate − exact| / Σ|exact|)",
            self.norm()
        )
    }
}

impl Measured for HeavyHitters {
    fn error_measure(&self) -> String {
        "the largest error of a flow's estimated bytes, as a share of the heavy-hitter threshold in bytes".into()
    }

    fn size(exact: &Self, _: &Self) -> f64 {
        match exact.config().threshold {
            HitterThreshold::Bytes(bytes) => bytes,
            HitterThreshold::Fraction(share) => share * exact.total_bytes(),
        }
    }
}

impl Measured for OnlineJoin {
    fn error_measure(&self) -> String {
        "relative L1 error of the per-key COUNT and SUM tables the join's estimates come from".into()
    }
}

impl Measured for OnlineLogisticRegression {
    fn error_measure(&self) -> String {
        "‖w − w_exact‖₂ / ‖w_exact‖₂ of the weights, every task's model together".into()
    }
}

fn tune_operator<O>(config: &Config, operator: &O::Config, options: &TuneOptions) -> Result<TuneReport, ServiceError>
where
    O: Measured + Tunable,
    O::Input: Clone,
    O::Output: Clone,
{
    let Sampled {
        sample,
        fanout,
        operator,
    } = sampled::<O>(config, operator, options)?;
    let operator = &operator;
    let empty = O::build(operator, None)?;
    let partitions = sample.partitions.len();
    let plan = TaskPlan::new::<O>(config, operator, partitions)?;
    let size = exact_size(&empty, &sample.partitions, plan.policy.norm);
    if !(size.is_finite() && size > 0.0) {
        return Err(unsupported(format!(
            "the exact state of {} is empty ({} records, {} refused): nothing for E to be a share of",
            sample.source, sample.records, sample.refused
        )));
    }
    let simulated_failures = options.failures.unwrap_or(SIMULATED_FAILURES);
    let streams: Vec<usize> = sample.partitions.iter().map(Vec::len).collect();
    let crashes = measure::crash_points(&streams, simulated_failures, options.seed);
    let ft = &config.pipeline.fault_tolerance;
    let largest_theta = ft.theta * options.error * size / bound(&plan, options.failures);
    let gamma = ft
        .max_unacked
        .max(OUTPUTS_OF_ITEMS * plan.constants.beta * partitions as u64);
    let trial = Trial {
        config,
        operator,
        empty: &empty,
        streams: &sample.partitions,
        crashes: &crashes,
        norm: plan.policy.norm,
        size,
        options,
    };
    let current = trial.candidate(ft.theta, ft.max_uncovered, ft.max_unacked)?;
    let mut candidates = Vec::new();
    for (theta, max_uncovered) in grid(largest_theta, ft.max_uncovered, partitions) {
        candidates.push(trial.candidate(theta, max_uncovered, gamma)?);
    }
    Ok(TuneReport {
        kind: config.pipeline.operator.kind(),
        source: sample.source.clone(),
        records: sample.records,
        refused: sample.refused,
        partitions,
        error_measure: empty.error_measure(),
        budget: options.error,
        size,
        failures: options.failures,
        simulated_failures,
        fanout,
        largest_theta,
        current,
        recommended: recommend(&candidates),
        candidates,
    })
}

/// The sample, read with β uncapped where the config sets it; β as
/// measured on it; and the operator's config with the β the candidates run
/// with.
struct Sampled<O: ServiceOperator> {
    sample: Sample<O::Input>,
    fanout: Option<Fanout>,
    operator: O::Config,
}

fn sampled<O>(config: &Config, operator: &O::Config, options: &TuneOptions) -> Result<Sampled<O>, ServiceError>
where
    O: Measured,
    O::Input: Clone,
{
    let uncapped = O::FANOUT_KEY.map(|_| O::with_fanout(operator, UNCAPPED_FANOUT));
    let probe = O::build(uncapped.as_ref().unwrap_or(operator), None)?;
    let sample = match &options.input {
        Some(path) => sample::from_file::<O>(
            config,
            probe,
            path,
            options.file_format,
            options.sample,
            options.partitions,
        )?,
        None => sample::from_topic::<O>(config, probe, options.sample)?,
    };
    let configured = O::build(operator, None)?.constants().beta;
    let fanout = O::FANOUT_KEY.map(|key| Fanout::of(key, configured, sample.max_outputs));
    let operator = match &fanout {
        Some(fanout) => O::with_fanout(operator, fanout.chosen),
        None => operator.clone(),
    };
    Ok(Sampled {
        sample,
        fanout,
        operator,
    })
}

/// The exact state's size: each task's exact state over its stream, combined
/// as the norm combines disjoint parts (summed under L1, root of the summed
/// squares under L2), or the smallest under a per-key maximum (E holds for
/// every task).
fn exact_size<O: Measured>(empty: &O, streams: &[Vec<O::Input>], norm: Norm) -> f64 {
    let mut sizes = Vec::new();
    let mut outputs = Vec::new();
    for stream in streams.iter().filter(|s| !s.is_empty()) {
        let mut exact = empty.clone();
        for item in stream {
            outputs.clear();
            // The sample holds only records the operator accepts.
            let _ = exact.process(item, &mut outputs);
        }
        sizes.push(O::size(&exact, empty));
    }
    match norm {
        Norm::Max => sizes.into_iter().fold(f64::INFINITY, f64::min),
        _ => sizes.into_iter().fold(0.0, |whole, size| norm.combine(whole, size)),
    }
}

/// The state bound of a pipeline planned with `plan` (on its tasks, one per
/// partition), each failure taking every task down (a process or machine lost with all
/// its tasks): K failures of each task, or any number; the tasks' bounds
/// combine as their distances do (n of them: n·b under L1, √n·b under L2).
fn bound(plan: &TaskPlan, failures: Option<u32>) -> f64 {
    let (policy, constants) = (plan.policy, plan.constants);
    let per_task = match failures {
        None => policy.limit(constants).state,
        Some(k) => policy.bound_after(k, constants).state,
    };
    plan.policy.norm.task_shares(plan.policy.placement.parallelism) * per_task
}

/// Θ rounded down to two significant digits.
fn round_down(theta: f64) -> f64 {
    if !(theta.is_finite() && theta > 0.0) {
        return theta;
    }
    let unit = 10f64.powi(theta.log10().floor() as i32 - 1);
    let rounded = (theta / unit).floor() * unit;
    // Through its decimal text, so that 0.0012 is not 0.0012000000000000001.
    format!("{rounded:.1e}").parse().unwrap_or(rounded)
}

/// Every (Θ, L) candidate.
fn grid(largest_theta: f64, max_uncovered: u64, partitions: usize) -> Vec<(f64, u64)> {
    let mut ls: Vec<u64> = L_MULTIPLES
        .iter()
        .map(|m| ((max_uncovered as f64 * m) as u64).max(partitions as u64))
        .collect();
    ls.dedup();
    THETA_FRACTIONS
        .iter()
        .flat_map(|f| ls.iter().map(move |&l| (round_down(largest_theta * f), l)))
        .collect()
}

/// The cheapest candidate that meets the budget (see the module docs).
fn recommend(candidates: &[Candidate]) -> Option<usize> {
    let meeting = || candidates.iter().enumerate().filter(|(_, c)| c.meets_budget);
    let fewest = meeting()
        .map(|(_, c)| c.changelog_records_per_item)
        .fold(f64::INFINITY, f64::min);
    meeting()
        .filter(|(_, c)| c.changelog_records_per_item <= fewest * CHEAP_ENOUGH)
        .min_by(|(_, a), (_, b)| a.max_uncovered.cmp(&b.max_uncovered).then(b.theta.total_cmp(&a.theta)))
        .map(|(i, _)| i)
}

/// What every candidate of one tuning shares.
struct Trial<'a, O: ServiceOperator> {
    config: &'a Config,
    operator: &'a <O as ServiceOperator>::Config,
    empty: &'a O,
    streams: &'a [Vec<O::Input>],
    crashes: &'a [Vec<u64>],
    norm: Norm,
    size: f64,
    options: &'a TuneOptions,
}

impl<O> Trial<'_, O>
where
    O: Measured,
    O::Input: Clone,
    O::Output: Clone,
{
    fn candidate(&self, theta: f64, max_uncovered: u64, max_unacked: u64) -> Result<Candidate, ServiceError> {
        let mut config = self.config.clone();
        let ft = &mut config.pipeline.fault_tolerance;
        (ft.theta, ft.max_uncovered, ft.max_unacked) = (theta, max_uncovered, max_unacked);
        let plan = TaskPlan::new::<O>(&config, self.operator, self.streams.len())?;
        let build = || self.empty.clone();
        let measured = measure::measure(
            plan.controller,
            &build,
            self.streams,
            self.crashes,
            self.norm,
            self.options.seed,
        )?;
        let bound = bound(&plan, self.options.failures) / self.size;
        let error = measured.error / self.size;
        Ok(Candidate {
            theta,
            max_uncovered,
            max_unacked,
            bound,
            changelog_records_per_item: measured.changelog_records as f64 / measured.items.max(1) as f64,
            replayed_per_failure: measured.replayed as f64 / measured.recoveries.max(1) as f64,
            measured: error,
            violations: measured.violations,
            meets_budget: bound <= self.options.error && error <= self.options.error && measured.violations == 0,
        })
    }
}

/// The report as a reader sees it.
pub fn render(report: &TuneReport) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let percent = |share: f64| format!("{:.3}%", 100.0 * share);
    let failures = match report.failures {
        Some(k) => format!("after {k} failures"),
        None => "after any number of failures (halving)".to_string(),
    };
    let _ = writeln!(
        out,
        "{}: {} ({} records, {} refused, {} task(s))",
        report.kind, report.source, report.records, report.refused, report.partitions
    );
    let _ = writeln!(out, "error: {}", report.error_measure);
    let _ = writeln!(
        out,
        "budget: E = {} of {} = {:.6} {failures}: Θ ≤ {:.6}",
        percent(report.budget),
        trim(report.size),
        report.budget * report.size,
        report.largest_theta
    );
    if let Some(fanout) = &report.fanout {
        let _ = writeln!(out, "{}", fanout_line(fanout));
    }
    let _ = writeln!(
        out,
        "measured: changelog records per item failure-free; error and replay after {} simulated crash(es)\n",
        report.simulated_failures
    );
    let _ = writeln!(
        out,
        "  {:<14} {:>10} {:>10} {:>10} {:>16} {:>18} {:>10}",
        "Θ", "L", "Γ", "bound", "records/item", "replayed/failure", "measured"
    );
    let mut line = |mark: &str, c: &Candidate| {
        let _ = writeln!(
            out,
            "{mark} {:<14} {:>10} {:>10} {:>10} {:>16.5} {:>18.1} {:>10}{}",
            trim(c.theta),
            c.max_uncovered,
            c.max_unacked,
            percent(c.bound),
            c.changelog_records_per_item,
            c.replayed_per_failure,
            percent(c.measured),
            if c.meets_budget { "" } else { "  over E" }
        );
    };
    for (i, c) in report.candidates.iter().enumerate() {
        line(if Some(i) == report.recommended { "*" } else { " " }, c);
    }
    line("=", &report.current);
    let _ = writeln!(out, "\n* recommended; = the config's thresholds now");
    if report.recommended.is_none() {
        let _ = writeln!(out, "no candidate meets E: take a longer sample or a larger E");
    }
    out
}

fn fanout_line(fanout: &Fanout) -> String {
    let Fanout {
        key,
        configured,
        measured,
        chosen,
    } = fanout;
    if fanout.raised() {
        format!(
            "β: the sample's largest record makes {measured} outputs, over {key} = {configured} (it would be \
             refused): raised to {chosen}"
        )
    } else {
        format!("β: the sample's largest record makes {measured} outputs ({key} = {configured})")
    }
}

fn trim(number: f64) -> String {
    crate::service::check::trim(&format!("{number:.6}"))
}

#[cfg(test)]
mod tests;
