use std::path::Path;

use super::*;
use crate::service::config::parse_all;

/// A keyed sum over `partitions` partitions with the given Θ, L and Γ.
fn keyed_sum(theta: f64, max_uncovered: u64, divergence: &str) -> Config {
    let text = format!(
        "[kafka]\nbootstrap_servers = \"127.0.0.1:1\"\ngroup_id = \"tune\"\n\
         [pipeline]\ninput_topic = \"amounts\"\noutput_topic = \"sums\"\nformat = \"json\"\n\
         [pipeline.operator]\nkind = \"keyed_aggregation\"\naggregate = \"sum\"\nmax_abs_value = 1000.0\n\
         divergence = \"{divergence}\"\n\
         [pipeline.fault_tolerance]\nmode = \"approximate\"\ntheta = {theta:?}\nmax_uncovered = {max_uncovered}\n\
         max_unacked = 20000\n"
    );
    parse_all(&text, &|_| None).unwrap().remove(0)
}

/// `records` keyed values (JSON lines) with a skewed key: their total is returned.
fn amounts(path: &Path, records: usize) -> f64 {
    let mut text = String::new();
    let mut total = 0.0;
    for i in 0..records {
        let key = (i * i) % 97 % (1 + i % 13);
        let value = (i % 50 + 1) as f64;
        total += value;
        text.push_str(&format!("{{\"key\": \"k{key}\", \"value\": {value}}}\n"));
    }
    std::fs::write(path, text).unwrap();
    total
}

fn options(error: f64, input: &Path, partitions: usize) -> TuneOptions {
    TuneOptions {
        error,
        failures: None,
        sample: 100_000,
        input: Some(input.to_path_buf()),
        file_format: None,
        partitions,
        seed: 7,
    }
}

fn plan(config: &Config, partitions: usize) -> TaskPlan {
    crate::service::check::plan(config, partitions).unwrap()
}

#[test]
fn the_bound_has_every_failure_take_every_task_down() {
    // Θ = 1000 on two tasks, L1: split 500 each, then halved per failure
    // (250, 125, 62.5, …).
    let l1 = plan(&keyed_sum(1000.0, 1000, "l1"), 2);
    assert_eq!(bound(&l1, None), 1000.0);
    assert_eq!(bound(&l1, Some(3)), 2.0 * (250.0 + 125.0 + 62.5));
    assert_eq!(bound(&l1, Some(0)), 0.0);
    // A per-key maximum is not split: one task's 500 + 250 + 125.
    let max = plan(&keyed_sum(1000.0, 1000, "max"), 2);
    assert_eq!(bound(&max, Some(3)), 875.0);
    assert_eq!(bound(&max, None), 1000.0);
    // L2 on four tasks: Θ/√4 = 500 each (250 at the start), and four such
    // distances combine to √4 · 500 = Θ.
    let l2 = plan(&keyed_sum(1000.0, 1000, "l2"), 4);
    assert_eq!(l2.policy.for_failures(0).theta, 250.0);
    assert_eq!(bound(&l2, None), 1000.0);
    assert_eq!(bound(&l2, Some(2)), 2.0 * (250.0 + 125.0));
}

#[test]
fn theta_is_rounded_down_to_two_significant_digits() {
    assert_eq!(round_down(10_056.76), 10_000.0);
    assert_eq!(round_down(271.6), 270.0);
    assert_eq!(round_down(0.001_234_5), 0.0012);
    assert_eq!(round_down(99.0), 99.0);
}

fn candidate(theta: f64, max_uncovered: u64, records: f64, meets_budget: bool) -> Candidate {
    Candidate {
        theta,
        max_uncovered,
        max_unacked: 1,
        bound: 0.0,
        changelog_records_per_item: records,
        replayed_per_failure: 0.0,
        measured: 0.0,
        violations: 0,
        meets_budget,
    }
}

#[test]
fn the_recommendation_is_the_cheapest_within_budget_then_the_shortest_replay() {
    let candidates = [
        candidate(100.0, 10, 0.30, true),
        candidate(100.0, 1000, 0.20, true),
        candidate(100.0, 100, 0.205, true),
        candidate(50.0, 100, 0.205, true),
        candidate(1000.0, 10, 0.01, false),
    ];
    assert_eq!(recommend(&candidates), Some(2));
    assert_eq!(recommend(&candidates[4..]), None);
}

#[test]
fn a_looser_budget_writes_fewer_changelog_records_and_each_recommendation_meets_its_own() {
    let dir = std::env::temp_dir().join(format!("afstream-tune-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let input = dir.join("amounts.jsonl");
    // The values are positive, so the sums' L1 size is the values' total.
    let total = amounts(&input, 20_000);
    let config = keyed_sum(1e6, 1000, "l1");
    let mut chosen = Vec::new();
    for error in [0.005, 0.05] {
        let report = tune(&config, &options(error, &input, 2)).unwrap();
        assert_eq!((report.records, report.refused, report.partitions), (20_000, 0, 2));
        assert!(
            (report.size - total).abs() < 1e-6 * total,
            "{} against {total}",
            report.size
        );
        let best = report.recommendation().unwrap().clone();
        // Halving, any number of failures: the L1 bound is Θ itself.
        assert!(best.theta <= error * total, "Θ {} over {}", best.theta, error * total);
        assert!(best.measured <= error && best.violations == 0, "{best:?}");
        assert!(report.candidates.iter().any(|c| c.theta > 0.9 * error * total));
        chosen.push(best);
    }
    assert!(
        chosen[1].changelog_records_per_item < chosen[0].changelog_records_per_item,
        "{chosen:?}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn an_operator_without_state_or_a_budget_of_nothing_is_refused_with_the_reason() {
    let grep = parse_all(
        "[kafka]\nbootstrap_servers = \"x:1\"\ngroup_id = \"g\"\n[pipeline]\ninput_topic = \"a\"\n\
         output_topic = \"b\"\nformat = \"text\"\n[pipeline.operator]\nkind = \"grep\"\npattern = \"x\"\n\
         [pipeline.fault_tolerance]\nmode = \"approximate\"\ntheta = 1.0\nmax_uncovered = 10\nmax_unacked = 10\n",
        &|_| None,
    )
    .unwrap()
    .remove(0);
    let nowhere = Path::new("/nonexistent");
    let refused = tune(&grep, &options(0.01, nowhere, 1)).unwrap_err().to_string();
    assert!(refused.contains("grep keeps no state"), "{refused}");
    let none = tune(&keyed_sum(1.0, 10, "l1"), &options(0.0, nowhere, 1)).unwrap_err();
    assert!(none.to_string().contains("--error 0"), "{none}");
}

fn word_count(max_words_per_line: u64) -> Config {
    let text = format!(
        "[kafka]\nbootstrap_servers = \"127.0.0.1:1\"\ngroup_id = \"tune\"\n\
         [pipeline]\ninput_topic = \"lines\"\noutput_topic = \"counts\"\nformat = \"text\"\n\
         [pipeline.operator]\nkind = \"word_count\"\nmax_words_per_line = {max_words_per_line}\n\
         [pipeline.fault_tolerance]\nmode = \"approximate\"\ntheta = 1000.0\nmax_uncovered = 100\n\
         max_unacked = 20000\n"
    );
    parse_all(&text, &|_| None).unwrap().remove(0)
}

#[test]
fn a_fanout_under_the_samples_longest_record_is_raised_so_that_no_record_is_refused() {
    let dir = std::env::temp_dir().join(format!("afstream-tune-beta-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let input = dir.join("lines.txt");
    // Lines of 1 to 9 words.
    let lines: Vec<String> = (0..500)
        .map(|i| {
            (0..1 + i % 9)
                .map(|w| format!("w{}", (i + w) % 40))
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect();
    std::fs::write(&input, lines.join("\n")).unwrap();
    let raised = tune(&word_count(4), &options(0.05, &input, 1)).unwrap();
    assert_eq!((raised.records, raised.refused), (500, 0));
    let expected = Fanout {
        key: "max_words_per_line",
        configured: 4,
        measured: 9,
        chosen: 16,
    };
    assert_eq!(raised.fanout, Some(expected));
    assert!(render(&raised).contains("raised to 16"), "{}", render(&raised));
    let kept = tune(&word_count(64), &options(0.05, &input, 1)).unwrap();
    assert_eq!(kept.fanout.map(|f| (f.measured, f.chosen)), Some((9, 64)));
    std::fs::remove_dir_all(&dir).unwrap();
}
