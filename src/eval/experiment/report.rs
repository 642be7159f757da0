//! An experiment's report as Markdown.

use super::*;

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
