//! `afstream experiment` on a real broker: the same seeded input failure-free
//! and with SIGKILLs, both against the exact answer, in a JSON report.

mod common;

use std::process::Command;

use common::{test_dir, unique, Broker};

/// Writes a JSON pipeline's config: its operator and fault tolerance tables
/// in `tables`, on `broker`, in a group of its own.
fn write_pipeline_config(config: &std::path::Path, broker: &Broker, name: &str, tables: &str) {
    std::fs::write(
        config,
        format!(
            r#"
[kafka]
bootstrap_servers = "{address}"
group_id = "{group}"
properties = {{ "consumer.fetch.wait.max.ms" = "10" }}

[pipeline]
input_topic = "unused"
output_topic = "unused-out"
format = "json"
{tables}"#,
            address = broker.address,
            group = unique(name)
        ),
    )
    .expect("write the config");
}

/// Keyed sums counted, with small thresholds.
fn write_config(config: &std::path::Path, broker: &Broker) {
    write_pipeline_config(
        config,
        broker,
        "experiment",
        r#"
[pipeline.operator]
kind = "keyed_aggregation"
aggregate = "count"

[pipeline.fault_tolerance]
mode = "approximate"
theta = 400.0
max_uncovered = 200
max_unacked = 2000
"#,
    );
}

/// Runs `afstream experiment` with three kills (unless `extra` gives
/// `--failures`); `env` is added to its environment, `extra` to its arguments.
fn experiment(
    config: &std::path::Path,
    out_dir: &std::path::Path,
    env: &[(&str, &str)],
    extra: &[&str],
) -> std::process::Output {
    Command::new("timeout")
        .args(["600", env!("CARGO_BIN_EXE_afstream"), "experiment", "--config"])
        .arg(config)
        .args(["--seed", "7", "--dir"])
        .arg(out_dir)
        .args(if extra.contains(&"--failures") {
            &[][..]
        } else {
            &["--failures", "3"][..]
        })
        .args(if extra.contains(&"--items") {
            &[][..]
        } else {
            &["--items", "12000"][..]
        })
        .args(extra)
        .env_remove("AFSTREAM_BOOTSTRAP_SERVERS")
        .envs(env.iter().copied())
        .output()
        .expect("afstream experiment")
}

fn report(out_dir: &std::path::Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(out_dir.join("report.json")).expect("report.json")).expect("JSON")
}

#[test]
fn an_experiment_with_three_kills_reports_each_recovery_and_stays_within_its_bound() {
    let dir = test_dir("experiment");
    let broker = Broker::start(&dir);
    let config = dir.join("sums.toml");
    write_config(&config, &broker);
    let out_dir = dir.join("report");
    let output = experiment(&config, &out_dir, &[], &[]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "experiment failed: {}\n{stdout}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.contains("| 3 failures | 3 |"), "{stdout}");
    let report = report(&out_dir);
    assert_eq!(report["thresholds"]["theta"], 400.0);
    assert_eq!(report["exact"]["type"], "per_key");
    let runs = report["runs"].as_array().expect("runs");
    assert_eq!(runs.len(), 2);
    let (clean, failed) = (&runs[0], &runs[1]);
    assert_eq!(
        clean["comparison"]["l1_error"], 0.0,
        "a failure-free run is exact: {clean}"
    );
    assert!(clean["recoveries"].as_array().is_some_and(Vec::is_empty));
    let recoveries = failed["recoveries"].as_array().expect("recoveries");
    assert!(!recoveries.is_empty(), "the kills were recovered from: {failed}");
    assert!(
        recoveries
            .iter()
            .all(|r| r["bound_state"].as_f64().is_some_and(|b| b > 0.0)),
        "each recovery logged its bound: {failed}"
    );
    assert!(
        recoveries
            .iter()
            .all(|r| r["restore_seconds"].as_f64().is_some_and(|s| s > 0.0)),
        "each recovery logged how long its restore took: {failed}"
    );
    assert_eq!(failed["within_bound"], true, "{failed}");
    assert_eq!(
        failed["comparison"]["missing"], 0,
        "no acknowledged output lost: every key has its output: {failed}"
    );
    // Without a state directory every recovery restores from the changelog:
    // the state each restored is held against the exact state at its resume
    // offset.
    for recovery in recoveries {
        let observed = recovery["observed_state"].as_f64().expect("an observed divergence");
        let bound = recovery["bound_so_far"].as_f64().expect("the bound so far");
        assert!(
            bound >= recovery["bound_state"].as_f64().unwrap_or(f64::INFINITY) && observed <= bound,
            "restored state {observed} from the exact one, over the bound {bound}: {recovery}"
        );
    }
    assert_eq!(failed["recoveries_within_bound"], true, "{failed}");
    assert_eq!(clean["recoveries_within_bound"], serde_json::Value::Null, "{clean}");
    assert_eq!(
        failed["logged_bounds_as_computed"], true,
        "each logged bound within Θ/tasks/2^k, computed by the experiment: {failed}"
    );
    // The changelog is read back after each run: the killed processes'
    // backups count too.
    for run in [clean, failed] {
        let written = &run["changelog"];
        let (records, markers) = (written["records"].as_u64(), written["markers"].as_u64());
        assert!(
            markers.is_some_and(|m| m > 0) && records > markers && written["bytes"].as_u64() > records,
            "backups' entries and markers in the changelog: {written}"
        );
    }
    let plot = std::fs::read_to_string(out_dir.join("accuracy-vs-failures.svg")).expect("the error plot");
    assert!(
        plot.starts_with("<svg") && plot.contains("failures injected"),
        "an SVG plot of the error against failures"
    );
    let png = std::fs::read(out_dir.join("accuracy-vs-failures.png")).expect("the error plot as PNG");
    assert!(
        png.starts_with(b"\x89PNG\r\n\x1a\n") && png.len() > 10_000,
        "a PNG of the plot ({} bytes)",
        png.len()
    );
    let markdown = std::fs::read_to_string(out_dir.join("report.md")).expect("report.md");
    assert!(markdown.contains("| failure-free | 0 | 0 |"), "{markdown}");
}

/// The experiment on the sums config in a build whose fault switch `fault`
/// is set; its run with kills, from the report.
#[cfg(feature = "fault-injection")]
fn run_with_kills_under(name: &str, fault: &str, extra: &[&str]) -> serde_json::Value {
    let dir = test_dir(name);
    let broker = Broker::start(&dir);
    let config = dir.join("sums.toml");
    write_config(&config, &broker);
    let out_dir = dir.join("report");
    let output = experiment(&config, &out_dir, &[(fault, "1")], extra);
    assert!(
        output.status.success(),
        "experiment failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    report(&out_dir)["runs"][1].clone()
}

/// The same experiment with backups that write nothing (while the bounds are
/// still claimed and logged): the output is far off and the report says so.
#[cfg(feature = "fault-injection")]
#[test]
fn an_experiment_whose_backups_write_nothing_is_reported_outside_its_bound() {
    let failed = &run_with_kills_under("experiment-broken", afstream::service::runner::FAULT_SKIP_BACKUPS, &[]);
    assert!(
        failed["recoveries"].as_array().is_some_and(|r| !r.is_empty()),
        "the kills were recovered from: {failed}"
    );
    assert_eq!(failed["within_bound"], false, "a broken bound must be caught: {failed}");
    assert_eq!(
        failed["recoveries_within_bound"], false,
        "a restored state without its backups is caught at the recovery: {failed}"
    );
}

/// The same experiment with a controller that never halves: its logged
/// bounds stay at the first failure's, and the experiment, which computes
/// each failure's bound from Θ itself, says so.
#[cfg(feature = "fault-injection")]
#[test]
fn an_experiment_whose_thresholds_never_halve_is_caught_by_its_own_bounds() {
    let failed = &run_with_kills_under(
        "experiment-never-halve",
        afstream::service::runner::FAULT_NEVER_HALVE,
        &["--items", "40000"],
    );
    let recoveries = failed["recoveries"].as_array().expect("recoveries");
    assert!(
        recoveries.iter().any(|r| r["failures"].as_u64() >= Some(2)),
        "a partition failed twice: {failed}"
    );
    assert_eq!(
        failed["logged_bounds_as_computed"], false,
        "bounds that never halve must be caught: {failed}"
    );
}

#[test]
fn kills_in_the_middle_of_a_backup_are_recovered_from_within_the_bound() {
    let dir = test_dir("experiment-mid-backup");
    let broker = Broker::start(&dir);
    let config = dir.join("sums.toml");
    write_config(&config, &broker);
    let out_dir = dir.join("report");
    let output = experiment(&config, &out_dir, &[], &["--kill-mid-backup"]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "experiment failed: {}\n{stdout}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.contains("| 3 failures mid-backup | 3 |"), "{stdout}");
    // Each killed process logged the crash between a backup's entries (in
    // the log) and its marker (never sent).
    let crashes: Vec<String> = std::fs::read_dir(&out_dir)
        .expect("the experiment's directory")
        .filter_map(|entry| std::fs::read_to_string(entry.ok()?.path()).ok())
        .flat_map(|log| {
            log.lines()
                .filter(|line| line.contains("SIGKILL between a backup's entries and its marker"))
                .map(str::to_string)
                .collect::<Vec<_>>()
        })
        .collect();
    assert_eq!(
        crashes.len(),
        3,
        "three processes killed themselves mid-backup: {crashes:?}"
    );
    assert!(
        crashes.iter().all(|line| line.contains("entries_flushed=true")),
        "the entries reached the changelog before each kill: {crashes:?}"
    );
    let report = report(&out_dir);
    let failed = &report["runs"][1];
    let recoveries = failed["recoveries"].as_array().expect("recoveries");
    assert!(
        recoveries.len() >= 3,
        "each kill was recovered from (every task of the killed process): {failed}"
    );
    assert_eq!(failed["within_bound"], true, "{failed}");
    // Each kill left an incomplete backup past the last marker: the restore
    // takes its entries' priors, so θ alone covers what it restored.
    assert_eq!(failed["recoveries_within_bound"], true, "{failed}");
}

/// The logs of one run of an experiment whose file names contain `part`, in name order.
fn run_logs(out_dir: &std::path::Path, run: &str, part: &str) -> Vec<String> {
    let mut paths: Vec<std::path::PathBuf> = std::fs::read_dir(out_dir)
        .expect("the experiment's directory")
        .filter_map(|entry| Some(entry.ok()?.path()))
        .filter(|path| {
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            name.contains(run) && name.contains(part) && name.ends_with(".log")
        })
        .collect();
    paths.sort();
    paths
        .iter()
        .map(|path| std::fs::read_to_string(path).expect("a log"))
        .collect()
}

/// `partitions=[..]` of a log's lines containing `needle`.
fn partition_lists(log: &str, needle: &str) -> Vec<i32> {
    log.lines()
        .filter(|line| line.contains(needle))
        .filter_map(|line| line.split("partitions=[").nth(1)?.split(']').next())
        .flat_map(|list| {
            list.split(',')
                .filter_map(|p| p.trim().parse().ok())
                .collect::<Vec<i32>>()
        })
        .collect()
}

/// How often `partition`'s task started in a log (after a failure or not).
fn starts_of(log: &str, partition: i32) -> usize {
    log.lines()
        .filter(|line| line.contains("task started") || line.contains("recovered from a failure"))
        .filter(|line| line.contains(&format!(" partition={partition} ")))
        .count()
}

/// Two instances in one group, two kills: each hits the one that joined last,
/// its partitions move to the first, which starts them again, and the next
/// instance joining takes some back. Returns the report's failed run and the
/// logs of the first instance and of the joined ones.
///
/// Two kills, not three: on Tansu 0.6.0 a group sometimes wedges when a
/// member dies (measured here: once in about 80 such kills the survivor lost
/// its own partitions and got none back for 120 s), and every kill here is a
/// chance of that.
fn two_instance_experiment(name: &str, extra: &[&str], label: &str) -> (serde_json::Value, String, Vec<String>) {
    let dir = test_dir(name);
    let broker = Broker::start(&dir);
    let config = dir.join("sums.toml");
    write_config(&config, &broker);
    let out_dir = dir.join("report");
    let mut args = vec!["--instances", "2", "--failures", "2"];
    args.extend_from_slice(extra);
    let output = experiment(&config, &out_dir, &[], &args);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "experiment failed: {}\n{stdout}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.contains(&format!("| {label} | 2 |")), "{stdout}");
    let report = report(&out_dir);
    let failed = report["runs"][1].clone();
    let first = run_logs(&out_dir, "run2", "instance1").concat();
    let joined = run_logs(&out_dir, "run2", "joined");
    assert_eq!(joined.len(), 2, "an instance joined for each kill");
    for (i, log) in joined.iter().enumerate() {
        let moved = partition_lists(log, "partitions assigned");
        assert!(
            !moved.is_empty(),
            "joined instance {} was given partitions:\n{log}",
            i + 1
        );
        assert!(
            !log.contains("stopping cleanly"),
            "joined instance {} was killed, not stopped:\n{log}",
            i + 1
        );
        // Started once at the beginning, and again after each kill that took it.
        for partition in moved {
            assert!(
                starts_of(&first, partition) >= 2,
                "partition {partition} of the killed instance {} started again on the first:\n{first}",
                i + 1
            );
        }
    }
    assert_eq!(failed["within_bound"], true, "{failed}");
    assert_ne!(
        failed["recoveries_within_bound"], false,
        "every state restored from the changelog within the bound so far: {failed}"
    );
    (failed, first, joined)
}

#[test]
fn kills_of_an_instance_move_its_partitions_to_the_other_which_recovers_them_within_the_bound() {
    let (failed, first, joined) =
        two_instance_experiment("experiment-move", &["--node-loss"], "2 node losses on another instance");
    // The killed instance had started its tasks (each wrote its start marker):
    // the first instance recovers them as failures, from their last markers.
    assert!(
        joined.iter().all(|log| log.contains("task started")),
        "each joined instance started its tasks before the kill"
    );
    assert!(
        first.contains("recovered from a failure"),
        "the first instance recovered the killed one's partitions:\n{first}"
    );
    let recoveries = failed["recoveries"].as_array().expect("recoveries");
    assert!(!recoveries.is_empty(), "{failed}");
}

#[test]
fn kills_during_a_rebalance_leave_every_partition_running_and_the_answer_within_the_bound() {
    let (failed, _, _) = two_instance_experiment(
        "experiment-rebalance",
        &["--kill-mid-rebalance"],
        "2 failures mid-rebalance",
    );
    assert_eq!(failed["failures_injected"], 2, "{failed}");
}

#[test]
fn a_logistic_regression_experiment_reports_accuracy_and_log_loss_over_the_run() {
    let dir = test_dir("experiment-lr");
    let broker = Broker::start(&dir);
    let config = dir.join("lr.toml");
    write_pipeline_config(
        &config,
        &broker,
        "experiment-lr",
        r#"
[pipeline.operator]
kind = "logistic_regression"
feature_bits = 18
learning_rate = 0.5
max_feature_norm = 10.0

[pipeline.fault_tolerance]
mode = "approximate"
theta = 1.0
max_uncovered = 1000
max_unacked = 5000
"#,
    );
    let out_dir = dir.join("report");
    // A kill comes once the task's markers cover its point. One output an
    // item, each acknowledged a broker round trip later, holds the markers
    // back; on 12 000 items the run sometimes ended before the first kill
    // point was covered (one of eight runs on 6 December 2026 made no kill).
    let output = experiment(&config, &out_dir, &[], &["--items", "30000"]);
    assert!(
        output.status.success(),
        "experiment failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let report = report(&out_dir);
    let runs = report["runs"].as_array().expect("runs");
    let score = |run: &serde_json::Value| {
        let comparison = &run["comparison"];
        assert_eq!(comparison["type"], "predictions", "{comparison}");
        let over_time = comparison["over_time"].as_array().expect("over_time").clone();
        assert_eq!(over_time.len(), 10, "tenths of the run: {comparison}");
        assert!(
            over_time.iter().all(|w| w["log_loss"].as_f64().is_some_and(|l| l > 0.0)
                && w["accuracy"].as_f64().is_some_and(|a| (0.0..=1.0).contains(&a))),
            "{comparison}"
        );
        let accuracy = comparison["accuracy"].as_f64().expect("accuracy");
        let window = |i: usize| over_time[i]["accuracy"].as_f64().expect("accuracy");
        (accuracy, window(0), window(9))
    };
    let (clean, clean_first, clean_last) = score(&runs[0]);
    let (failed, _, failed_last) = score(&runs[1]);
    assert!(
        runs[1]["recoveries"].as_array().is_some_and(|r| !r.is_empty()),
        "the kills were recovered from: {}",
        runs[1]
    );
    assert!(
        clean_last > clean_first + 0.1,
        "the model learns over the run: {clean_first} in the first tenth, {clean_last} in the last"
    );
    // At Θ = 1 (a Euclidean distance of the weights; 0.25 per task at first)
    // a recovered model is close to the lost one. At Θ = 10 it is not: two
    // failures cost 15 points (measured; see docs/experiments.md). The last
    // tenth alone is noisier: a kill that lands in it leaves the recovered
    // model little input to settle on (5.9 points apart in one run of
    // 12 000 items on 6 December 2026, over the 5 allowed before).
    assert!(
        (clean - failed).abs() < 0.03 && (clean_last - failed_last).abs() < 0.08,
        "three failures keep the accuracy within 3 points: {clean} against {failed}, \
         {clean_last} against {failed_last} at the end"
    );
    let png = std::fs::read(out_dir.join("accuracy-over-time.png")).expect("the accuracy plot");
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"), "a PNG");
}

#[test]
fn a_distributed_learner_converges_through_kills_under_bsp_and_asp_in_the_report() {
    let dir = test_dir("convergence");
    let broker = Broker::start(&dir);
    let config = dir.join("sgd.toml");
    let operator = "feature_bits = 12, learning_rate = 5.0, max_feature_norm = 4.0, workers = 3, publish_every = 200";
    // The experiment gives each run its own group and topics.
    common::write_learner_config(&config, &broker.address, &unique("convergence"), "unused", operator);
    let out_dir = dir.join("out");
    let output = experiment(
        &config,
        &out_dir,
        &[],
        // Twice the default items: a failure-free ASP run of 12 000 took
        // 3 s, short enough on a loaded machine for the learner to finish
        // between two looks at its progress, before the first kill point.
        &[
            "--partitions",
            "3",
            "--consistency",
            "bsp,asp",
            "--failures",
            "2",
            "--items",
            "24000",
        ],
    );
    assert!(
        output.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    let report = report(&out_dir);
    let runs = report["runs"].as_array().expect("runs");
    assert_eq!(runs.len(), 4, "{report}");
    for pair in runs.chunks(2) {
        let (free, killed) = (&pair[0], &pair[1]);
        let label = killed["label"].as_str().unwrap_or_default();
        assert_eq!(free["failures_injected"], 0);
        // Two kills asked; since input never waits for a marker a restarted
        // learner can publish its last model before the second kill point,
        // and the report counts the kills made.
        let made = killed["failures_injected"].as_u64().expect("kills made");
        assert!((1..=2).contains(&made), "{label}: {made} kills made");
        assert!(free["recoveries"].as_array().is_some_and(Vec::is_empty), "{free}");
        let recoveries = killed["recoveries"].as_array().expect("recoveries");
        assert!(recoveries.len() >= 2, "{label}: {recoveries:?}");
        for recovery in recoveries {
            assert!(
                recovery["bound_state"].as_f64().is_some_and(f64::is_finite),
                "{recovery}"
            );
        }
        let outages = killed["outages"].as_array().expect("outages");
        assert_eq!(outages.len() as u64, made, "{label}: an outage a kill: {outages:?}");
        assert!(
            outages
                .iter()
                .all(|o| o["running_at"].as_f64() > o["killed_at"].as_f64()),
            "{label}: {outages:?}"
        );
        let curve = killed["curve"].as_array().expect("a curve");
        let loss = |p: &serde_json::Value| p["loss"].as_f64().expect("a loss");
        assert!(curve.len() >= 10, "{label}: {} global models", curve.len());
        assert!(loss(&curve[curve.len() - 1]) < loss(&curve[0]), "{label}: {curve:?}");
        let held_out = |run: &serde_json::Value| run["held_out_log_loss"].as_f64().expect("held-out loss");
        assert!(
            held_out(killed) <= held_out(free) + 0.05,
            "{label}: held-out log-loss {} against {} failure-free",
            held_out(killed),
            held_out(free)
        );
    }
    let markdown = std::fs::read_to_string(out_dir.join("report.md")).expect("report.md");
    assert!(markdown.contains("bsp, 2 failures"), "{markdown}");
    assert!(out_dir.join("loss-over-items.svg").exists());
    assert!(out_dir.join("loss-over-time.svg").exists());
}

/// `afstream tune` on the experiment's own input (the same seeded records,
/// produced to the config's input topic first): the thresholds it writes meet
/// the error budget in an experiment with three kills, by the bound computed
/// here from Θ and by the error measured against the exact answer.
#[test]
fn thresholds_tuned_to_an_error_budget_meet_it_through_three_kills() {
    const ITEMS: usize = 12_000;
    const BUDGET: f64 = 0.02;
    let dir = test_dir("experiment-tuned");
    let broker = Broker::start(&dir);
    let input = unique("tune-input");
    let config = dir.join("counts.toml");
    write_config(&config, &broker);
    let text = std::fs::read_to_string(&config).expect("the config");
    let untuned = text
        .replace("input_topic = \"unused\"", &format!("input_topic = \"{input}\""))
        .replace("theta = 400.0", "theta = 1000000.0 # far over the budget");
    std::fs::write(&config, untuned).expect("write the config");
    let run = |args: &[&str]| {
        let output = Command::new("timeout")
            .arg("300")
            .arg(env!("CARGO_BIN_EXE_afstream"))
            .args(args)
            .env_remove("AFSTREAM_BOOTSTRAP_SERVERS")
            .output()
            .expect("afstream");
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        assert!(
            output.status.success(),
            "afstream {args:?}: {}\n{stdout}",
            String::from_utf8_lossy(&output.stderr)
        );
        stdout
    };
    let items = ITEMS.to_string();
    run(&[
        "produce",
        "--bootstrap-servers",
        &broker.address,
        "--topic",
        &input,
        "--workload",
        "keyed",
        "--items",
        &items,
        "--seed",
        "7",
        "--partitions",
        "2",
    ]);
    let path = config.to_string_lossy().into_owned();
    let tuned = run(&[
        "tune",
        "--config",
        &path,
        "--error",
        "2%",
        "--failures",
        "3",
        "--sample",
        &items,
        "--write",
        "--json",
    ]);
    let tuned: serde_json::Value = serde_json::from_str(&tuned).expect("tune's JSON");
    let written = std::fs::read_to_string(&config).expect("the tuned config");
    assert!(written.contains("# far over the budget"), "comments kept:\n{written}");
    let theta: f64 = written
        .lines()
        .find_map(|line| line.strip_prefix("theta = ")?.split_whitespace().next()?.parse().ok())
        .expect("a theta in the tuned config");
    assert_eq!(
        Some(theta),
        tuned["candidates"][tuned["recommended"].as_u64().expect("one") as usize]["theta"].as_f64()
    );
    // Counts: the exact state's L1 size is the number of records. Two tasks
    // of Θ/2 each, every kill failing both: 3 failures halve θ to Θ/4, Θ/8,
    // Θ/16 per task.
    let budget = BUDGET * ITEMS as f64;
    let bound = 2.0 * theta / 2.0 * (0.5 + 0.25 + 0.125);
    assert!(bound <= budget, "Θ {theta}: bound {bound} over the budget {budget}");
    assert!(bound > budget / 2.0, "Θ {theta} far under what the budget allows");
    let out_dir = dir.join("report");
    let output = experiment(&config, &out_dir, &[], &["--items", &items]);
    assert!(
        output.status.success(),
        "experiment failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let failed = report(&out_dir)["runs"][1].clone();
    let kills = failed["recoveries"].as_array().map_or(0, Vec::len);
    assert!(kills >= 2, "the kills were recovered from: {failed}");
    let error = failed["comparison"]["l1_error"].as_f64().expect("the L1 error");
    assert!(error <= budget, "L1 error {error} over the budget {budget}: {failed}");
    eprintln!("tuned Θ {theta}: bound {bound}, L1 error {error}, budget {budget}, {kills} recoveries");
}
