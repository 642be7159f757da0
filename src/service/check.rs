//! `afstream check`: what a config makes each task run with, without connecting.
//!
//! The same [`TaskPlan`] starts the tasks of `afstream run`, so what `check`
//! prints is what runs: the per-task θ, l and γ after k failures and the error
//! bound they guarantee.

use std::fmt::Write as _;

use super::codec::ServiceOperator;
use super::config::{Config, PolicyName, Stage};
use super::ServiceError;
use crate::core::{
    AnalysisConstants, ControllerConfig, ErrorBound, Mode, Norm, Operator, Placement, TaskThresholds, ThresholdPolicy,
};

/// Failures `check` lists the thresholds and bounds of.
const FAILURES_SHOWN: u32 = 5;

/// What every task of a pipeline runs with, for a number of input partitions.
#[derive(Clone, Copy, Debug)]
pub struct TaskPlan {
    pub constants: AnalysisConstants,
    /// The split over the tasks, and the operator's divergence (`policy.norm`).
    pub policy: ThresholdPolicy,
    pub controller: ControllerConfig,
    /// The operator keeps its keyed state in a local store when given a state directory.
    pub store_backed: bool,
}

/// β of a chain: the most outputs one input of any of its stages makes.
pub fn fanout(stage: &Stage) -> Result<f64, ServiceError> {
    let mut beta: u32 = 1;
    for operator in &stage.operators {
        let stage_beta = crate::with_operator!(operator, |O, c| O::build(c, None).map(|o| o.constants().beta))?;
        let stage_beta = u32::try_from(stage_beta).unwrap_or(u32::MAX);
        beta = beta.max(stage_beta);
    }
    Ok(f64::from(beta))
}

impl TaskPlan {
    /// Builds a probe of the operator and splits the global thresholds over
    /// `partitions` tasks.
    pub fn new<O: ServiceOperator>(
        config: &Config,
        operator_config: &O::Config,
        partitions: usize,
    ) -> Result<Self, ServiceError> {
        let probe = O::build(operator_config, None)?;
        // The format's schemas are read and checked here too, so `check` finds what `run` would.
        super::codec::Codec::new::<O>(&config.pipeline).map_err(ServiceError::Unsupported)?;
        let ft = &config.pipeline.fault_tolerance;
        let parallelism = u32::try_from(partitions)
            .ok()
            .filter(|&n| n >= 1)
            .ok_or_else(|| ServiceError::Unsupported(format!("{partitions} input partitions")))?;
        let placement = match &config.stage {
            Some(stage) => Placement {
                parallelism,
                stage: stage.index,
                stages: stage.stages,
                stage_fanout: fanout(stage)?,
            },
            None => Placement {
                parallelism,
                ..Placement::default()
            },
        };
        let constants = probe.constants();
        let policy = ThresholdPolicy::new(ft.global()?, ft.failure_policy(), placement, probe.norm(), constants)?;
        Ok(TaskPlan {
            constants,
            policy,
            controller: ControllerConfig::new(ft.mode(), policy, constants),
            store_backed: O::STORE_BACKED,
        })
    }

    /// Why input would wait after nearly every item, if it would.
    pub fn warning(&self) -> Option<String> {
        let gamma = self.policy.for_failures(0).max_unacked;
        let beta = self.constants.beta;
        (gamma < 8 * beta).then(|| {
            format!(
                "γ per task ({gamma}) is under 8 outputs of one item (β = {beta}): input will wait for \
                 acknowledgements after nearly every item; raise max_unacked or lower the operator's per-item \
                 output limit"
            )
        })
    }
}

/// The plan of the configured operator.
pub fn plan(config: &Config, partitions: usize) -> Result<TaskPlan, ServiceError> {
    crate::with_operator!(&config.pipeline.operator, |O, c| TaskPlan::new::<O>(
        config, c, partitions
    ))
}

fn row(out: &mut String, k: &str, t: TaskThresholds, bound: Option<ErrorBound>) {
    let (state, outputs) = bound.map_or(("-".to_string(), "-".to_string()), |b| {
        (format!("{:.6}", b.state), format!("{:.0}", b.outputs))
    });
    let _ = writeln!(
        out,
        "  {k:<10} {:>14} {:>10} {:>10} {:>18} {:>18}",
        trim(&format!("{:.6}", t.theta)),
        t.max_uncovered,
        t.max_unacked,
        trim(&state),
        trim(&outputs)
    );
}

/// `1.500000` → `1.5`, `2.000000` → `2`.
pub(crate) fn trim(number: &str) -> String {
    if number.contains('.') {
        number.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        number.to_string()
    }
}

/// A readable account of what the config runs with on `partitions` input
/// partitions.
pub fn report(config: &Config, partitions: usize) -> Result<String, ServiceError> {
    let plan = plan(config, partitions)?;
    let pipeline = &config.pipeline;
    let group = &config.kafka.group_id;
    let ft = &pipeline.fault_tolerance;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "pipeline: {} -> {} (group {group}; changelog {}; dead letters {})",
        pipeline.input_topic,
        pipeline.output_topic,
        pipeline.changelog_topic(group),
        pipeline.dead_letter_topic(group)
    );
    let _ = writeln!(
        out,
        "operator: {} (alpha = {}, beta = {}, divergence {:?})",
        pipeline.operator.kind(),
        trim(&format!("{:.6}", plan.constants.alpha)),
        plan.constants.beta,
        plan.policy.norm
    );
    let _ = writeln!(
        out,
        "state: {}",
        match &pipeline.state_dir {
            Some(dir) if plan.store_backed => format!("local RocksDB stores under {}", dir.join(group).display()),
            _ => "in memory (recovers from the changelog)".to_string(),
        }
    );
    let _ = writeln!(
        out,
        "thresholds: Theta = {}, L = {}, Gamma = {}, for {partitions} task(s), one per input partition",
        ft.theta, ft.max_uncovered, ft.max_unacked
    );
    let _ = writeln!(out, "{}", split_line(plan.policy.norm, partitions));
    if let Some(stage) = &config.stage {
        let beta = fanout(stage).unwrap_or(1.0);
        let share = beta.powi((stage.stages - stage.index) as i32);
        let _ = writeln!(
            out,
            "stage {} of {} of the chain {} (fan-out beta = {}): this stage's share of Theta is Theta/{} = {}, \
             before the split over tasks and the halving",
            stage.index,
            stage.stages,
            stage.chain.join(" -> "),
            beta,
            share,
            trim(&format!("{:.6}", ft.theta / share))
        );
    }
    write_mode(&mut out, config, &plan);
    if let Some(warning) = plan.warning() {
        let _ = writeln!(out, "warning: {warning}");
    }
    Ok(out)
}

/// What a failure costs in the config's mode, and per failure count.
fn write_mode(out: &mut String, config: &Config, plan: &TaskPlan) {
    let ft = &config.pipeline.fault_tolerance;
    match ft.mode() {
        Mode::None => {
            let _ = writeln!(
                out,
                "mode none: no backups; a failure restarts a task from the group's committed offset with empty state"
            );
        }
        Mode::Exact(interval) => {
            let _ = writeln!(
                out,
                "mode exact: a complete backup every {} items / {} ms; a failure loses nothing",
                interval.items.map_or("-".into(), |n| n.to_string()),
                interval.millis.map_or("-".into(), |n| n.to_string())
            );
        }
        Mode::Approximate => {
            let _ = writeln!(
                out,
                "mode approximate: a failure restores the state logged at the task's last marker and replays the \
                 input from there; it adds at most theta to the state, loses no output and repeats the outputs of \
                 the items it replays (markers go out every l/2 items: about l items, at most beta outputs each), \
                 which a downstream afstream stage skips by their source positions"
            );
            let _ = writeln!(out, "policy {:?}; per task:", ft.failure_policy());
            let _ = writeln!(
                out,
                "  {:<10} {:>14} {:>10} {:>10} {:>18} {:>18}",
                "failures", "theta", "l", "gamma", "state error <=", "outputs repeated"
            );
            for k in 0..=FAILURES_SHOWN {
                let bound = plan.policy.bound_after(k, plan.constants);
                row(out, &k.to_string(), plan.policy.for_failures(k), Some(bound));
            }
            match ft.policy {
                PolicyName::Halving => {
                    let limit = plan.policy.limit(plan.constants);
                    let _ = writeln!(
                        out,
                        "  any number of failures: state error <= {}, outputs repeated about {} per task (halving)",
                        trim(&format!("{:.6}", limit.state)),
                        trim(&format!("{:.0}", limit.outputs))
                    );
                }
                PolicyName::Fixed => {
                    let step = plan.policy.for_failures(0).failure_bound(plan.constants);
                    let _ = writeln!(
                        out,
                        "  each further failure adds state error <= {}, outputs repeated about {} per task (fixed)",
                        trim(&format!("{:.6}", step.state)),
                        trim(&format!("{:.0}", step.outputs))
                    );
                }
            }
        }
    }
}

/// The end-to-end bound of a chain on `partitions` partitions per stage, after
/// any number of failures under halving: the last stage's state bound, and for
/// each earlier stage its state bound amplified by β per later stage. An
/// upstream replay adds nothing: its outputs carry their source positions and
/// the next stage skips those it applied (`crate::core::sources`). Only an
/// upstream stage that restarts from a local store may lose outputs (at most
/// γ a failure, Σγ = Γ per task under halving), each moving the last stage's
/// state by at most its α. A stage's tasks combine as its norm combines their
/// distances (n·b under L1, √n·b under L2, b under a per-key maximum); lost
/// outputs add up over the tasks that split Γ.
pub fn chain_bound(stages: &[&Config], partitions: usize) -> Result<f64, ServiceError> {
    let plans = stages
        .iter()
        .map(|config| plan(config, partitions))
        .collect::<Result<Vec<_>, _>>()?;
    let Some(last) = plans.last() else { return Ok(0.0) };
    let tasks = |p: &TaskPlan| p.policy.norm.task_shares(p.policy.placement.parallelism);
    let counted = |p: &TaskPlan| {
        if p.policy.norm.splits_counts() {
            partitions as f64
        } else {
            1.0
        }
    };
    let beta = match stages.first().and_then(|c| c.stage.as_ref()) {
        Some(stage) => fanout(stage)?,
        None => 1.0,
    };
    let m = plans.len();
    let mut bound = tasks(last) * last.policy.limit(last.constants).state;
    for (i, (p, config)) in plans[..m - 1].iter().zip(stages).enumerate() {
        let later = (m - 1 - i) as i32;
        bound += tasks(p) * p.policy.limit(p.constants).state * beta.powi(later);
        if p.store_backed && config.pipeline.state_dir.is_some() {
            let lost = 2.0 * p.policy.for_failures(0).max_unacked as f64;
            bound += counted(p) * last.constants.alpha * lost * beta.powi(later - 1);
        }
    }
    Ok(bound)
}

/// How `check` says the thresholds split over `partitions` tasks.
fn split_line(norm: Norm, partitions: usize) -> String {
    match norm {
        Norm::L1 | Norm::KeyCount => format!(
            "split: the divergence ({norm:?}) adds up across tasks, so each task gets 1/{partitions} of Theta, L \
             and Gamma; the pipeline's bound is the sum of its tasks'"
        ),
        Norm::L2 => format!(
            "split: the squares of the divergence (L2) add up across tasks, so each task gets Theta/sqrt({partitions}) \
             and 1/{partitions} of L and Gamma; the pipeline's bound is the root of the sum of its tasks' squared \
             bounds"
        ),
        Norm::Max => "split: none; the divergence is a per-key maximum, so every task keeps Theta, L and Gamma and \
                      the pipeline's bound is that of one task"
            .to_string(),
    }
}

/// `chain_bound`, as `check` prints it after the stages' reports.
pub fn chain_reports(configs: &[Config], partitions: usize) -> Result<String, ServiceError> {
    let mut out = String::new();
    for last in configs
        .iter()
        .filter(|c| c.stage.as_ref().is_some_and(|s| s.index == s.stages))
    {
        let Some(stage) = &last.stage else { continue };
        let stages: Vec<&Config> = stage
            .chain
            .iter()
            .filter_map(|name| configs.iter().find(|c| c.name.as_deref() == Some(name)))
            .collect();
        if stages.len() != stage.chain.len() {
            continue; // Only some stages were picked (--pipeline).
        }
        let bound = chain_bound(&stages, partitions)?;
        let ft = &last.pipeline.fault_tolerance;
        let _ = writeln!(
            out,
            "\nchain {}: {} -> {}, Theta = {}, L = {}, Gamma = {} for the chain, on {partitions} partition(s) per \
             stage: after any number of failures, the last stage's state is off by at most {} (halving)",
            stage.chain.join(" -> "),
            stages.first().map_or("", |c| c.pipeline.input_topic.as_str()),
            last.pipeline.output_topic,
            ft.theta,
            ft.max_uncovered,
            ft.max_unacked,
            trim(&format!("{bound:.6}"))
        );
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONFIG: &str = r#"
[kafka]
bootstrap_servers = "127.0.0.1:9092"
group_id = "wc"

[pipeline]
input_topic = "lines"
output_topic = "counts"
format = "text"

[pipeline.operator]
kind = "word_count"
max_words_per_line = 10

[pipeline.fault_tolerance]
mode = "approximate"
theta = 1000.0
max_uncovered = 400
max_unacked = 800
"#;

    fn parse(text: &str) -> Config {
        super::super::config::parse(text, &|_| None).expect("a valid config")
    }

    #[test]
    fn the_report_shows_each_tasks_halved_thresholds_and_the_bounds_they_prove() {
        let config = parse(CONFIG);
        let text = report(&config, 2).expect("a report");
        assert!(text.contains("lines -> counts"), "{text}");
        assert!(
            text.contains("wc-changelog") && text.contains("wc-dead-letters"),
            "{text}"
        );
        assert!(text.contains("alpha = 10, beta = 10"), "{text}");
        // Two tasks: Θ/2, L/2 and Γ/2 each, halved again before any failure.
        let plan = plan(&config, 2).expect("a plan");
        let first = plan.policy.for_failures(0);
        assert_eq!((first.theta, first.max_uncovered, first.max_unacked), (250.0, 100, 200));
        let zero = text
            .lines()
            .find(|l| l.trim_start().starts_with("0 "))
            .expect("the row of k = 0");
        let fields: Vec<&str> = zero.split_whitespace().collect();
        assert_eq!(fields, ["0", "250", "100", "200", "0", "0"], "{text}");
        let one = text
            .lines()
            .find(|l| l.trim_start().starts_with("1 "))
            .expect("the row of k = 1");
        let bound = first.failure_bound(plan.constants);
        let fields: Vec<&str> = one.split_whitespace().collect();
        assert_eq!(fields[4], trim(&format!("{:.6}", bound.state)), "{text}");
        assert!(text.contains("any number of failures"), "{text}");
        assert!(text.contains("1/2 of Theta"), "{text}");
        let max = parse(&CONFIG.replace(
            "max_words_per_line = 10",
            "max_words_per_line = 10\ndivergence = \"max\"",
        ));
        let text = report(&max, 2).expect("a report");
        assert!(text.contains("split: none"), "{text}");
        let first = super::plan(&max, 2).expect("a plan").policy.for_failures(0);
        assert_eq!(first.theta, 500.0, "a maximum is not split over the tasks");
        let l2 = parse(&CONFIG.replace(
            "max_words_per_line = 10",
            "max_words_per_line = 10\ndivergence = \"l2\"",
        ));
        let text = report(&l2, 4).expect("a report");
        assert!(text.contains("Theta/sqrt(4)"), "{text}");
        let first = super::plan(&l2, 4).expect("a plan").policy.for_failures(0);
        assert_eq!(first.theta, 1000.0 / 2.0 / 2.0, "L2: Θ/√n, halved at the start");
        assert_eq!(
            first.max_uncovered,
            super::plan(&max, 4)
                .expect("a plan")
                .policy
                .for_failures(0)
                .max_uncovered
                / 4
        );
    }

    #[test]
    fn the_fixed_policy_and_the_other_modes_say_what_a_failure_costs() {
        let fixed = parse(&CONFIG.replace("max_unacked = 800", "max_unacked = 800\npolicy = \"fixed\""));
        assert!(report(&fixed, 1)
            .expect("a report")
            .contains("each further failure adds"));
        let none = parse(&CONFIG.replace("\"approximate\"", "\"none\""));
        assert!(report(&none, 1).expect("a report").contains("mode none"));
        let exact = parse(&CONFIG.replace("\"approximate\"", "\"exact\"\nexact_interval_items = 500"));
        assert!(report(&exact, 1)
            .expect("a report")
            .contains("a complete backup every 500 items"));
    }

    #[test]
    fn a_gamma_too_small_for_one_item_is_warned_about() {
        let tight = parse(&CONFIG.replace("max_unacked = 800", "max_unacked = 60"));
        let text = report(&tight, 1).expect("a report");
        assert!(text.contains("warning: γ per task"), "{text}");
        assert!(report(&parse(CONFIG), 1)
            .expect("a report")
            .lines()
            .all(|l| !l.starts_with("warning")));
    }
}
