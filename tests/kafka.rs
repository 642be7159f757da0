//! `afstream run` on a real Kafka-protocol broker: the project's own (Tansu,
//! started by `scripts/broker`) or the cluster named by `AFSTREAM_TEST_BOOTSTRAP`.
//! Each test uses its own topics and group; failures are real SIGKILLs and
//! SIGTERMs of a child process.

mod common;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use afstream::core::Operator;
use afstream::eval::demo::logged_recoveries;
use afstream::eval::produce::{produce, text_records, InputRecord};
use afstream::operators::{HeavyHitterConfig, HeavyHitters, HitterThreshold, WordCount, WordCountConfig};
use common::{latest_by_key, log_lines, test_dir, unique, Broker, Service};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

const RUN_DEADLINE: Duration = Duration::from_secs(180);
const MAX_WORDS: u64 = 16;

struct Pipeline {
    dir: PathBuf,
    group: String,
    input: String,
    output: String,
    config: PathBuf,
}

/// Writes a config for one pipeline; `operator` is the `[pipeline.operator]` body.
fn pipeline(
    dir: &Path,
    broker: &Broker,
    name: &str,
    format: &str,
    operator: &str,
    thresholds: (f64, u64, u64),
) -> Pipeline {
    let group = unique(name);
    let input = format!("{group}-in");
    let output = format!("{group}-out");
    let (theta, items, outputs) = thresholds;
    let text = format!(
        r#"
[kafka]
bootstrap_servers = "{address}"
group_id = "{group}"
properties = {{ "consumer.fetch.wait.max.ms" = "10" }}

[pipeline]
input_topic = "{input}"
output_topic = "{output}"
format = "{format}"

[pipeline.operator]
{operator}

[pipeline.fault_tolerance]
mode = "approximate"
theta = {theta:?}
max_uncovered = {items}
max_unacked = {outputs}
"#,
        address = broker.address
    );
    let config = dir.join(format!("{name}.toml"));
    std::fs::write(&config, text).expect("write the config");
    Pipeline {
        dir: dir.to_path_buf(),
        group,
        input,
        output,
        config,
    }
}

fn word_count_operator() -> String {
    format!("kind = \"word_count\"\nmax_words_per_line = {MAX_WORDS}")
}

/// What the core library computes from the same lines.
fn exact_word_counts(lines: &[InputRecord]) -> HashMap<String, f64> {
    let mut op = WordCount::new(WordCountConfig {
        max_words_per_line: MAX_WORDS,
        ..WordCountConfig::default()
    })
    .expect("word count");
    let mut outputs = Vec::new();
    for line in lines {
        let text = String::from_utf8(line.value.clone()).expect("text");
        op.process(&text, &mut outputs).expect("line");
    }
    op.iter().map(|(word, count)| (word.clone(), count)).collect()
}

fn output_counts(broker: &Broker, topic: &str) -> HashMap<String, f64> {
    latest_by_key(&broker.read_topic(topic))
        .into_iter()
        .map(|(word, count)| {
            let count = count
                .parse()
                .unwrap_or_else(|_| panic!("count of {word:?} is {count:?}"));
            (word, count)
        })
        .collect()
}

fn run_to_end(pipeline: &Pipeline, log: &str) -> Service {
    let mut service = Service::start(&pipeline.config, &pipeline.dir.join(log), true);
    let status = service.wait(RUN_DEADLINE, "processing the input to its end");
    assert!(
        status.success(),
        "afstream run failed ({status}); log:\n{}",
        common::tail(&service.log)
    );
    service
}

#[test]
fn word_count_without_failures_matches_the_core_library() {
    let dir = test_dir("wc-clean");
    let broker = Broker::start(&dir);
    let p = pipeline(
        &dir,
        &broker,
        "wc-clean",
        "text",
        &word_count_operator(),
        (1000.0, 1000, 1000),
    );
    let lines = text_records(4000, 7);
    produce(&broker.kafka(), &p.input, 1, &lines).expect("produce the lines");

    let service = run_to_end(&p, "run.log");

    let counts = output_counts(&broker, &p.output);
    let exact = exact_word_counts(&lines);
    assert_eq!(counts.len(), exact.len(), "every word has an output");
    for (word, count) in &exact {
        assert_eq!(counts.get(word), Some(count), "final count of {word:?}");
    }
    assert!(log_lines(&service.log, "recovered from a failure").is_empty());
}

/// Partitions assigned together start one after another, and the consumer
/// fetches all of them from the assignment on: while one task restores
/// (slowed here), the others' records wait in the consumer's own queue, and
/// records produced meanwhile arrive too. A task must still read its partition
/// in order from its resume offset: a record read past would be skipped for
/// good (librdkafka's forwarding of a split queue made tasks read records of
/// other partitions, and newer records before older ones), and this run
/// without failures would never give the exact answer.
#[cfg(feature = "fault-injection")]
#[test]
fn records_fetched_while_other_tasks_start_are_all_processed() {
    use afstream::eval::produce::{produce_from, ProduceOptions};
    use std::time::Instant;
    let dir = test_dir("slow-start");
    let broker = Broker::start(&dir);
    let p = pipeline(
        &dir,
        &broker,
        "slow-start",
        "text",
        &word_count_operator(),
        (1000.0, 1000, 1000),
    );
    let lines = keyed_word_lines(6_000, 21);
    let (before, during) = lines.split_at(3_000);
    produce(&broker.kafka(), &p.input, 3, before).expect("produce the first lines");
    let slow_start = afstream::service::runner::FAULT_SLOW_TASK_START_MS;
    let service = Service::start_with_env(&p.config, &dir.join("run.log"), false, &[(slow_start, "700")]);
    // The rest at 1 000 a second, while the three tasks start (2.1 s).
    let records = during.to_vec();
    let kafka = broker.kafka();
    let input = p.input.clone();
    let producer = std::thread::spawn(move || {
        let options = ProduceOptions {
            rate: Some(1_000.0),
            ..ProduceOptions::default()
        };
        produce_from(&kafka, &input, 3, records.into_iter().map(Ok), &options)
    });
    producer
        .join()
        .expect("the producer thread")
        .expect("produce the other lines");
    let exact = exact_word_counts(&lines);
    // Processing 6 000 lines takes seconds; a skipped record is never made up.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let counts = output_counts(&broker, &p.output);
        let wrong: Vec<_> = exact
            .iter()
            .filter(|(word, count)| counts.get(*word) != Some(count))
            .map(|(word, count)| (word, count, counts.get(word)))
            .collect();
        if wrong.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{} of {} words still miscounted after 60 s (word, exact, output), e.g. {:?}; log:\n{}",
            wrong.len(),
            exact.len(),
            &wrong[..wrong.len().min(5)],
            common::tail(&service.log)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    service.terminate(RUN_DEADLINE);
}

/// Kills the service with SIGKILL once the output holds `at` more records.
fn kill_after_outputs(broker: &Broker, p: &Pipeline, log: &str, at: i64) {
    let mut service = Service::start(&p.config, &p.dir.join(log), false);
    service.wait_until(RUN_DEADLINE, &format!("{at} records in {}", p.output), || {
        broker.record_count(&p.output) >= at
    });
    service.kill();
}

/// The state bound of `failures` failures of one task under the halving
/// policy, from the config's Θ alone: a task of an additive divergence gets
/// Θ/`tasks` (with another divergence each gets the whole Θ), starts at half
/// of it and halves after every recovery, and a failure adds the θ its last
/// marker was written under: Θ/tasks · (1/2 + 1/4 + … + 1/2^failures).
fn halving_bound(theta: f64, tasks: u32, failures: u32) -> f64 {
    theta / f64::from(tasks) * (1.0 - 0.5f64.powi(failures as i32))
}

/// Σ |count − exact count| over every word.
fn l1_error(counts: &HashMap<String, f64>, exact: &HashMap<String, f64>) -> f64 {
    exact
        .iter()
        .map(|(word, count)| (counts.get(word).copied().unwrap_or(0.0) - count).abs())
        .sum()
}

/// The bound of `kills` failures of the tests' WordCount (L1, additive) on
/// one partition.
fn word_count_bound(thresholds: (f64, u64, u64), kills: u32) -> f64 {
    halving_bound(thresholds.0, 1, kills)
}

#[test]
fn word_count_survives_three_sigkills_within_the_bound() {
    let dir = test_dir("wc-kill");
    let broker = Broker::start(&dir);
    let thresholds = (400.0, 400, 1000);
    let p = pipeline(&dir, &broker, "wc-kill", "text", &word_count_operator(), thresholds);
    let lines = text_records(20_000, 11);
    produce(&broker.kafka(), &p.input, 1, &lines).expect("produce the lines");
    let exact = exact_word_counts(&lines);
    let total_outputs: f64 = exact.values().sum();

    let mut rng = StdRng::seed_from_u64(3);
    let mut points: Vec<i64> = (0..3)
        .map(|_| (total_outputs * rng.gen_range(0.1..0.8)) as i64)
        .collect();
    points.sort_unstable();
    for (i, at) in points.iter().enumerate() {
        kill_after_outputs(&broker, &p, &format!("run{i}.log"), *at);
    }
    let service = run_to_end(&p, "final.log");

    let counts = output_counts(&broker, &p.output);
    let error = l1_error(&counts, &exact);
    let bound = word_count_bound(thresholds, 3);
    assert!(error <= bound, "L1 error {error} over the bound {bound} of 3 failures");

    let mut recoveries = Vec::new();
    for log in ["run1.log", "run2.log", "final.log"] {
        let lines = log_lines(&dir.join(log), "recovered from a failure");
        let parsed = logged_recoveries(&lines.join("\n"));
        assert_eq!(
            parsed.len(),
            lines.len(),
            "a recovery logged without its bound: {lines:?}"
        );
        recoveries.extend(parsed);
    }
    assert!(!recoveries.is_empty(), "no restart recovered from a failure");
    let logged: f64 = recoveries.iter().map(|r| r.bound_state).sum();
    assert!(
        error <= logged + 1e-9,
        "L1 error {error} over the logged bounds {logged}"
    );
    assert!(log_lines(&service.log, "task stopped cleanly").len() == 1);
}

/// A broker that fails the changelog reads of a restore (the injected
/// failures time out as a metadata request does) delays the task; the restore
/// reads the changelog again into a fresh state and the answer stays within
/// the bound of the one failure.
#[cfg(feature = "fault-injection")]
#[test]
fn a_restore_whose_changelog_reads_fail_reads_it_again_and_stays_within_the_bound() {
    let dir = test_dir("restore-retry");
    let broker = Broker::start(&dir);
    let thresholds = (400.0, 400, 1000);
    let p = pipeline(
        &dir,
        &broker,
        "restore-retry",
        "text",
        &word_count_operator(),
        thresholds,
    );
    let lines = text_records(10_000, 12);
    produce(&broker.kafka(), &p.input, 1, &lines).expect("produce the lines");
    let exact = exact_word_counts(&lines);
    let total_outputs: f64 = exact.values().sum();
    kill_after_outputs(&broker, &p, "killed.log", (total_outputs * 0.4) as i64);

    let failures = afstream::service::runner::FAULT_RESTORE_FAILURES;
    let mut service = Service::start_with_env(&p.config, &dir.join("final.log"), true, &[(failures, "2")]);
    let status = service.wait(
        RUN_DEADLINE,
        "processing the input to its end after a restore read three times",
    );
    assert!(
        status.success(),
        "afstream run failed ({status}); log:\n{}",
        common::tail(&service.log)
    );
    let retries = log_lines(&service.log, "restoring from the changelog failed; reading it again");
    assert_eq!(retries.len(), 2, "{retries:?}\n{}", common::tail(&service.log));
    assert_eq!(log_lines(&service.log, "recovered from a failure").len(), 1);

    let counts = output_counts(&broker, &p.output);
    let error = l1_error(&counts, &exact);
    let bound = word_count_bound(thresholds, 1);
    assert!(
        error <= bound,
        "L1 error {error} over the bound {bound} of the one failure"
    );
}

#[test]
fn heavy_hitters_survive_two_sigkills_with_perfect_precision_and_recall() {
    let dir = test_dir("hh-kill");
    let broker = Broker::start(&dir);
    let threshold = 1e6;
    let operator = format!("kind = \"heavy_hitters\"\nmax_weight = 1500\nthreshold = {{ bytes = {threshold:?} }}");
    let thresholds = (1e5, 100, 1000);
    let p = pipeline(&dir, &broker, "hh-kill", "json", &operator, thresholds);
    // 20 heavy flows of 2.1 MB and 100 light ones of 150 kB, shuffled: a clear gap
    // around the 1 MB threshold, wider than the bound of two failures.
    let mut packets = Vec::new();
    for flow in 0..120u32 {
        let count = if flow < 20 { 1400 } else { 100 };
        for _ in 0..count {
            packets.push(format!("flow-{flow}"));
        }
    }
    packets.shuffle(&mut StdRng::seed_from_u64(5));
    let records: Vec<InputRecord> = packets
        .iter()
        .map(|flow| InputRecord {
            key: Some(flow.clone().into_bytes()),
            value: format!(r#"{{"flow":"{flow}","bytes":1500}}"#).into_bytes(),
        })
        .collect();
    produce(&broker.kafka(), &p.input, 2, &records).expect("produce the packets");
    let op = HeavyHitters::new(HeavyHitterConfig {
        max_weight: 1500,
        threshold: HitterThreshold::Bytes(threshold),
        ..HeavyHitterConfig::default()
    })
    .expect("heavy hitters");
    // The sketch's divergence does not add up over tasks: each gets all of Θ.
    assert_eq!(op.norm(), afstream::core::Norm::Max);
    let bound = halving_bound(thresholds.0, 1, 2);
    assert!(bound < 8.5e5, "the test's gap must exceed the bound ({bound})");

    for (i, at) in [5, 12].iter().enumerate() {
        kill_after_outputs(&broker, &p, &format!("run{i}.log"), *at);
    }
    run_to_end(&p, "final.log");

    let detected: HashSet<String> = broker
        .read_topic(&p.output)
        .iter()
        .filter_map(|r| Some(String::from_utf8_lossy(r.key.as_deref()?).into_owned()))
        .collect();
    let truth: HashSet<String> = (0..20).map(|f| format!("flow-{f}")).collect();
    let false_positives: Vec<_> = detected.difference(&truth).collect();
    let missed: Vec<_> = truth.difference(&detected).collect();
    assert!(false_positives.is_empty(), "precision below 1: {false_positives:?}");
    assert!(missed.is_empty(), "recall below 1: {missed:?}");
}

#[test]
fn sigterm_then_restart_gives_the_output_of_an_uninterrupted_run() {
    let dir = test_dir("wc-term");
    let broker = Broker::start(&dir);
    let lines = text_records(10_000, 13);
    let thresholds = (1000.0, 1000, 1000);
    let straight = pipeline(&dir, &broker, "wc-straight", "text", &word_count_operator(), thresholds);
    produce(&broker.kafka(), &straight.input, 1, &lines).expect("produce the lines");
    run_to_end(&straight, "straight.log");
    let expected = broker.read_topic(&straight.output);

    let stopped = pipeline(&dir, &broker, "wc-stopped", "text", &word_count_operator(), thresholds);
    produce(&broker.kafka(), &stopped.input, 1, &lines).expect("produce the lines");
    let mut service = Service::start(&stopped.config, &dir.join("first.log"), false);
    let at = expected.len() as i64 / 3;
    service.wait_until(RUN_DEADLINE, &format!("{at} outputs before SIGTERM"), || {
        broker.record_count(&stopped.output) >= at
    });
    let status = service.terminate(Duration::from_secs(60));
    assert!(status.success(), "clean stop failed ({status})");
    assert!(
        broker.record_count(&stopped.output) < expected.len() as i64,
        "the stop came after the whole input: nothing left to resume"
    );
    let restarted = run_to_end(&stopped, "second.log");

    let got = broker.read_topic(&stopped.output);
    let pairs = |records: &[common::Record]| -> Vec<(Option<Vec<u8>>, Vec<u8>)> {
        records.iter().map(|r| (r.key.clone(), r.value.clone())).collect()
    };
    assert_eq!(
        pairs(&got),
        pairs(&expected),
        "output differs from an uninterrupted run"
    );
    for log in [dir.join("first.log"), restarted.log.clone()] {
        assert!(
            log_lines(&log, "recovered from a failure").is_empty(),
            "a clean stop counted as a failure"
        );
    }
}

#[test]
fn a_restart_inside_a_produced_batch_gets_every_record_after_it() {
    let dir = test_dir("wc-mid-batch");
    let broker = Broker::start(&dir);
    let p = pipeline(
        &dir,
        &broker,
        "wc-mid-batch",
        "text",
        &word_count_operator(),
        (1000.0, 1000, 1000),
    );
    // Few, large batches: any resume offset falls inside one.
    let mut kafka = broker.kafka();
    kafka.properties.insert("linger.ms".into(), "500".into());
    kafka.properties.insert("batch.num.messages".into(), "100000".into());
    kafka.properties.insert("batch.size".into(), "10000000".into());
    let lines = text_records(5000, 17);
    produce(&kafka, &p.input, 1, &lines).expect("produce the lines");
    // An earlier run of the group got to offset 1234 (no changelog yet).
    broker.commit(&p.group, &p.input, 0, 1234);

    run_to_end(&p, "run.log");

    let counts = output_counts(&broker, &p.output);
    let exact = exact_word_counts(&lines[1234..]);
    assert_eq!(counts.len(), exact.len(), "every word after offset 1234 has an output");
    for (word, count) in &exact {
        assert_eq!(counts.get(word), Some(count), "count of {word:?} from offset 1234");
    }
}

/// A WordCount pipeline (Θ, L, Γ = 1000) serving its metrics on a free port,
/// with 3 000 lines in its input: the pipeline, the port and the lines.
fn word_count_serving_metrics(dir: &Path, broker: &Broker, name: &str, seed: u64) -> (Pipeline, u16, Vec<InputRecord>) {
    let p = pipeline(dir, broker, name, "text", &word_count_operator(), (1000.0, 1000, 1000));
    let port = common::free_port();
    let mut config = std::fs::read_to_string(&p.config).expect("the config");
    config.push_str(&format!("\n[metrics]\naddress = \"127.0.0.1:{port}\"\n"));
    std::fs::write(&p.config, config).expect("write the config");
    let lines = text_records(3000, seed);
    produce(&broker.kafka(), &p.input, 1, &lines).expect("produce the lines");
    (p, port, lines)
}

#[test]
fn metrics_show_progress_thresholds_and_starts() {
    let dir = test_dir("metrics");
    let broker = Broker::start(&dir);
    let (p, port, lines) = word_count_serving_metrics(&dir, &broker, "metrics", 19);

    let mut service = Service::start(&p.config, &dir.join("run.log"), false);
    let processed = |text: &str| common::metric(text, "afstream_items_processed_total", &[]);
    service.wait_until(
        RUN_DEADLINE,
        "afstream_items_processed_total at 3000 on /metrics",
        || common::scrape(port).and_then(|t| processed(&t)) == Some(3000.0),
    );
    let text = common::scrape(port).expect("scrape /metrics");
    let value = |name: &str, labels: &[&str]| {
        common::metric(&text, name, labels).unwrap_or_else(|| panic!("{name} {labels:?} missing from:\n{text}"))
    };
    // One partition: θ = Θ/2, l = L/2, γ = Γ/2 before any failure.
    assert_eq!(value("afstream_theta", &["partition=\"0\""]), 500.0);
    assert_eq!(value("afstream_max_uncovered", &[]), 500.0);
    assert_eq!(value("afstream_max_unacked", &[]), 500.0);
    assert_eq!(value("afstream_failures", &[]), 0.0);
    assert_eq!(
        value(
            "afstream_recoveries_total",
            &["source=\"beginning\"", "failure=\"false\""]
        ),
        1.0
    );
    let exact_outputs: f64 = exact_word_counts(&lines).values().sum();
    assert_eq!(value("afstream_outputs_produced_total", &[]), exact_outputs);
    assert!(value("afstream_backups_total", &[]) > 0.0);
    assert!(value("afstream_markers_total", &[]) > 0.0);
    assert!(value("afstream_items_past_marker", &[]) <= 500.0);
    let round_trip = value("afstream_marker_round_trip_seconds", &[]);
    assert!(
        round_trip > 0.0 && round_trip < 30.0,
        "a marker round trip of {round_trip} s"
    );
    // The divergence may pass θ while a backup is in flight; it is there and finite.
    assert!(value("afstream_divergence", &[]).is_finite());
    // librdkafka's statistics come every 5 s: the lag behind the committed
    // offset, which trails the last marker by less than the window.
    let mut lag = None;
    service.wait_until(RUN_DEADLINE, "afstream_consumer_lag on /metrics", || {
        lag = common::scrape(port).and_then(|t| common::metric(&t, "afstream_consumer_lag", &[]));
        lag.is_some()
    });
    assert!(
        lag.is_some_and(|lag| (0.0..=500.0).contains(&lag)),
        "consumer lag {lag:?}"
    );
    let status = service.terminate(Duration::from_secs(60));
    assert!(status.success(), "clean stop failed ({status})");
}

/// A real Prometheus, with the shipped scrape config and alert rules, finds
/// every per-task series the dashboard and the alerts read, and after a
/// SIGKILL and a restart every panel's query answers and the recoveries
/// panel shows the recovery.
#[test]
fn prometheus_with_the_shipped_config_scrapes_every_per_task_series() {
    let dir = test_dir("prometheus");
    let broker = Broker::start(&dir);
    let (p, port, _) = word_count_serving_metrics(&dir, &broker, "prometheus", 23);
    let service = Service::start(&p.config, &dir.join("run.log"), false);
    let mut prometheus = common::Prometheus::start(&dir, port);
    prometheus.wait_until(RUN_DEADLINE, "every item counted in Prometheus", |prom| {
        prom.query("afstream_items_processed_total")
            .iter()
            .map(|(_, v)| v)
            .sum::<f64>()
            == 3000.0
    });
    // librdkafka's statistics come every 5 s; the others with the first scrape.
    prometheus.wait_until(RUN_DEADLINE, "afstream_consumer_lag in Prometheus", |prom| {
        !prom.query("afstream_consumer_lag").is_empty()
    });
    for name in [
        "afstream_divergence",
        "afstream_theta",
        "afstream_max_uncovered",
        "afstream_max_unacked",
        "afstream_items_past_marker",
        "afstream_backups_total",
        "afstream_recoveries_total",
        "afstream_recovery_error_bound",
        "afstream_failures",
        "afstream_consumer_lag",
    ] {
        let series = prometheus.query(name);
        assert!(
            series.iter().any(|(labels, _)| {
                labels.get("partition").map(String::as_str) == Some("0") && labels.get("group") == Some(&p.group)
            }),
            "{name}: no series of partition 0 of group {}: {series:?}",
            p.group
        );
    }
    assert_eq!(prometheus.query("afstream_theta")[0].1, 500.0, "θ = Θ/2 on one task");
    let rules = prometheus.get("/api/v1/rules").expect("the rules");
    for alert in [
        "AfstreamTaskStalled",
        "AfstreamRecoveryBoundNearBudget",
        "AfstreamDeadLetters",
    ] {
        assert!(rules.to_string().contains(alert), "{alert} not loaded: {rules}");
    }
    // A SIGKILL and a restart: the restarted task recovers from its last
    // marker, which every panel must be able to show.
    service.kill();
    let service = Service::start(&p.config, &dir.join("restarted.log"), false);
    prometheus.wait_until(RUN_DEADLINE, "the recovery in Prometheus", |prom| {
        prom.query("afstream_failures").iter().any(|(_, k)| *k == 1.0)
    });
    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/monitoring/grafana/dashboards/afstream.json"),
        )
        .expect("the dashboard"),
    )
    .expect("the dashboard is JSON");
    let panels = dashboard["panels"].as_array().expect("panels");
    for panel in panels {
        let title = panel["title"].as_str().unwrap_or("?");
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str().expect("a query").replace("$group", &p.group);
            // Broker errors appear with the first error of each kind.
            if expr.contains("afstream_broker_errors_total") {
                continue;
            }
            prometheus.wait_until(RUN_DEADLINE, &format!("panel {title:?}: {expr}"), |prom| {
                !prom.query(&expr).is_empty()
            });
        }
    }
    // The recoveries panel moves with the recovery (a query of the counter's
    // increase did not: each series is born at its first start).
    let recoveries = panels
        .iter()
        .find(|panel| panel["title"] == "Recoveries")
        .and_then(|panel| panel["targets"][0]["expr"].as_str())
        .expect("the Recoveries panel")
        .replace("$group", &p.group);
    let shown = prometheus.query(&recoveries);
    assert!(
        shown
            .iter()
            .any(|(labels, n)| labels.get("failure").map(String::as_str) == Some("true") && *n >= 1.0),
        "the Recoveries panel does not show the recovery: {shown:?}"
    );
    let status = service.terminate(Duration::from_secs(60));
    assert!(status.success(), "clean stop failed ({status})");
}

/// Gives the pipeline a state directory, so WordCount keeps its counts in a
/// RocksDB store per partition with at most `resident_keys` clean words in memory.
fn with_local_state(p: &Pipeline, resident_keys: usize) -> PathBuf {
    let state = p.dir.join("state");
    let text = std::fs::read_to_string(&p.config).expect("read the config");
    let text = text.replacen(
        "format = \"text\"\n",
        &format!(
            "format = \"text\"\nstate_dir = \"{}\"\nstore = {{ resident_keys = {resident_keys}, cache_mib = 16 }}\n",
            state.display()
        ),
        1,
    );
    std::fs::write(&p.config, text).expect("write the config");
    state
}

/// `lines` lines of ten words each seen once (`lines * 10` distinct words)
/// and two common ones.
fn distinct_word_lines(lines: usize) -> Vec<InputRecord> {
    (0..lines)
        .map(|line| {
            let words: Vec<String> = (0..10).map(|i| format!("w{}", line * 10 + i)).collect();
            InputRecord {
                key: None,
                value: format!("the {} and", words.join(" ")).into_bytes(),
            }
        })
        .collect()
}

/// The counts the changelog holds at each partition's last marker.
fn changelog_counts(broker: &Broker, p: &Pipeline) -> HashMap<String, f64> {
    let mut readers: HashMap<i32, afstream::core::ChangelogReader> = HashMap::new();
    for record in broker.read_topic(&format!("{}-changelog", p.group)) {
        let Some(key) = record.key else { continue };
        readers
            .entry(record.partition)
            .or_default()
            .push(afstream::core::BackupEntry::new(
                key.as_slice().into(),
                Some(record.value.as_slice().into()),
            ));
    }
    let mut counts = HashMap::new();
    let entries = readers
        .into_values()
        .flat_map(|reader| reader.finish().expect("a readable changelog").entries);
    for entry in entries {
        let word = String::from_utf8(entry.key_body().to_vec()).expect("a word");
        let value = entry.value.expect("restored entries have values");
        let count = afstream::core::entry::decode_f64(&value).expect("a count");
        counts.insert(word, count);
    }
    counts
}

#[test]
fn word_count_on_its_local_store_is_exact_after_two_sigkills() {
    let dir = test_dir("wc-local");
    let broker = Broker::start(&dir);
    // Each local restart still counts a failure and halves l and γ (outputs may
    // be lost): start wide, so the last run is not one round trip per few lines.
    let thresholds = (4000.0, 2000, 8000);
    let p = pipeline(&dir, &broker, "wc-local", "text", &word_count_operator(), thresholds);
    with_local_state(&p, 1000);
    let lines = distinct_word_lines(20_000);
    produce(&broker.kafka(), &p.input, 1, &lines).expect("produce the lines");
    let exact = exact_word_counts(&lines);
    assert!(exact.len() >= 200_000, "{} distinct words", exact.len());

    for (i, at) in [60_000, 150_000].into_iter().enumerate() {
        kill_after_outputs(&broker, &p, &format!("run{i}.log"), at);
    }
    let service = run_to_end(&p, "final.log");

    for log in ["run1.log", "final.log"] {
        let path = dir.join(log);
        assert_eq!(
            log_lines(&path, "local store reopened").len(),
            1,
            "{log}: the restart did not resume on its local store:\n{}",
            common::tail(&path)
        );
        let recoveries = logged_recoveries(&log_lines(&path, "recovered from a failure").join("\n"));
        assert_eq!(recoveries.len(), 1, "{log}");
        assert_eq!(
            recoveries[0].bound_state, 0.0,
            "{log}: a local recovery adds no state error"
        );
    }
    let counts = changelog_counts(&broker, &p);
    let wrong: Vec<_> = exact
        .iter()
        .filter(|(word, count)| counts.get(*word) != Some(*count))
        .take(5)
        .collect();
    assert!(
        wrong.is_empty(),
        "after the clean stop the changelog must hold the exact counts; e.g. {wrong:?} (changelog: {:?})",
        wrong.iter().map(|(w, _)| counts.get(*w)).collect::<Vec<_>>()
    );
    assert_eq!(counts.len(), exact.len());
    assert!(log_lines(&service.log, "task stopped cleanly").len() == 1);
}

#[test]
fn word_count_without_its_local_store_recovers_from_the_changelog_within_the_bound() {
    let dir = test_dir("wc-wiped");
    let broker = Broker::start(&dir);
    let thresholds = (400.0, 400, 1000);
    let p = pipeline(&dir, &broker, "wc-wiped", "text", &word_count_operator(), thresholds);
    let state = with_local_state(&p, 1000);
    let lines = distinct_word_lines(6_000);
    produce(&broker.kafka(), &p.input, 1, &lines).expect("produce the lines");
    let exact = exact_word_counts(&lines);

    kill_after_outputs(&broker, &p, "run0.log", 40_000);
    std::fs::remove_dir_all(&state).expect("wipe the state directory (a lost node)");
    let service = run_to_end(&p, "final.log");

    assert!(log_lines(&service.log, "local store reopened").is_empty());
    let recoveries = logged_recoveries(&log_lines(&service.log, "recovered from a failure").join("\n"));
    assert_eq!(recoveries.len(), 1, "the restart recovered from the changelog");
    let counts = changelog_counts(&broker, &p);
    let error = l1_error(&counts, &exact);
    let bound = word_count_bound(thresholds, 1);
    assert!(error <= bound, "L1 error {error} over the bound {bound} of one failure");
    assert!(error <= recoveries[0].bound_state + 1e-9);
}

#[test]
fn a_second_process_on_the_same_state_directory_is_refused_while_the_first_runs() {
    let dir = test_dir("wc-locked");
    let broker = Broker::start(&dir);
    let p = pipeline(
        &dir,
        &broker,
        "wc-locked",
        "text",
        &word_count_operator(),
        (400.0, 400, 1000),
    );
    let state = with_local_state(&p, 1000);
    let lines = text_records(2_000, 5);
    produce(&broker.kafka(), &p.input, 1, &lines).expect("produce the lines");

    let mut first = Service::start(&p.config, &dir.join("first.log"), false);
    first.wait_until(RUN_DEADLINE, "the first process's outputs", || {
        broker.record_count(&p.output) > 0
    });
    let mut second = Service::start(&p.config, &dir.join("second.log"), true);
    let status = second.wait(RUN_DEADLINE, "the second process to give up");
    assert!(!status.success(), "the second process must fail");
    let log = std::fs::read_to_string(dir.join("second.log")).expect("the second log");
    assert!(
        log.contains("locked by another afstream process") && log.contains(&state.display().to_string()),
        "the refusal names the directory and the reason:\n{log}"
    );
    let status = first.terminate(RUN_DEADLINE);
    assert!(
        status.success(),
        "the first process ran on and stopped cleanly ({status})"
    );
}

#[test]
fn refused_records_go_to_the_dead_letter_topic_and_the_output_is_otherwise_unchanged() {
    use afstream::service::runner::{
        DEAD_LETTER_OFFSET_HEADER, DEAD_LETTER_PARTITION_HEADER, DEAD_LETTER_REASON_HEADER, DEAD_LETTER_TOPIC_HEADER,
    };
    let dir = test_dir("wc-dead-letters");
    let broker = Broker::start(&dir);
    let p = pipeline(
        &dir,
        &broker,
        "wc-dead-letters",
        "text",
        &word_count_operator(),
        (400.0, 400, 1000),
    );
    let good = text_records(3_000, 6);
    let too_long = (0..MAX_WORDS + 4)
        .map(|i| format!("w{i}"))
        .collect::<Vec<_>>()
        .join(" ");
    let bad = [
        (b"not-utf8".to_vec(), vec![0xff, 0xfe, b'a']),
        (b"too-long".to_vec(), too_long.into_bytes()),
        (b"cut-utf8".to_vec(), vec![b'o', b'k', 0xe2, 0x82]),
    ];
    // The bad records between the good ones, at known offsets of one partition.
    let mut records = good.clone();
    let mut bad_offsets = Vec::new();
    for (i, (key, value)) in bad.iter().enumerate() {
        let at = 700 * (i + 1) + i;
        records.insert(
            at,
            InputRecord {
                key: Some(key.clone()),
                value: value.clone(),
            },
        );
        bad_offsets.push(at as i64);
    }
    produce(&broker.kafka(), &p.input, 1, &records).expect("produce the lines");

    let service = run_to_end(&p, "run.log");

    assert_eq!(
        output_counts(&broker, &p.output),
        exact_word_counts(&good),
        "the output is that of the good lines alone"
    );
    let dead = broker.read_topic(&format!("{}-dead-letters", p.group));
    assert_eq!(dead.len(), bad.len(), "one dead letter per refused record: {dead:?}");
    let mut dead: Vec<_> = dead.into_iter().collect();
    dead.sort_by_key(|r| r.header(DEAD_LETTER_OFFSET_HEADER).and_then(|o| o.parse::<i64>().ok()));
    for ((record, (key, value)), offset) in dead.iter().zip(&bad).zip(&bad_offsets) {
        assert_eq!(record.key.as_ref(), Some(key), "the dead letter keeps the key");
        assert_eq!(&record.value, value, "the dead letter keeps the value as it came");
        assert_eq!(record.header(DEAD_LETTER_TOPIC_HEADER), Some(p.input.as_str()));
        assert_eq!(record.header(DEAD_LETTER_PARTITION_HEADER), Some("0"));
        assert_eq!(
            record.header(DEAD_LETTER_OFFSET_HEADER),
            Some(offset.to_string().as_str())
        );
        let reason = record.header(DEAD_LETTER_REASON_HEADER).unwrap_or_default();
        let expected = if key == b"too-long" {
            "max_words_per_line"
        } else {
            "not UTF-8"
        };
        assert!(reason.contains(expected), "reason of {key:?}: {reason:?}");
    }
    assert_eq!(
        log_lines(&service.log, "input record refused").len(),
        bad.len(),
        "each refused record is logged once"
    );
}

#[test]
fn a_store_write_that_fails_stops_the_service_with_its_path_and_a_restart_loses_nothing() {
    let dir = test_dir("wc-full-disk");
    let broker = Broker::start(&dir);
    let thresholds = (4000.0, 2000, 8000);
    let p = pipeline(
        &dir,
        &broker,
        "wc-full-disk",
        "text",
        &word_count_operator(),
        thresholds,
    );
    let state = with_local_state(&p, 1000);
    let lines = distinct_word_lines(6_000);
    produce(&broker.kafka(), &p.input, 1, &lines).expect("produce the lines");
    let exact = exact_word_counts(&lines);

    // 60 000 distinct words write about 1.5 MB of write-ahead log (RocksDB
    // starts a new one at each memtable flush, about 600 KB here): a file may
    // not pass 256 KiB.
    let mut limited = Service::start_with_file_size_limit(&p.config, &dir.join("full.log"), 256);
    let status = limited.wait(RUN_DEADLINE, "the service to stop on the failed write");
    assert!(!status.success(), "a failed store write must stop the service");
    let log = std::fs::read_to_string(dir.join("full.log")).expect("the log");
    let store = state.join(&p.group).join(format!("{}-0", p.input));
    assert!(
        log.contains(&store.display().to_string()) && log.to_lowercase().contains("file too large"),
        "the error names the store and the reason:\n{}",
        common::tail(&dir.join("full.log"))
    );

    let service = run_to_end(&p, "final.log");
    let counts = changelog_counts(&broker, &p);
    assert_eq!(counts.len(), exact.len());
    let error = l1_error(&counts, &exact);
    let recoveries = logged_recoveries(&log_lines(&service.log, "recovered from a failure").join("\n"));
    assert_eq!(recoveries.len(), 1, "the restart recovered once");
    assert!(
        error <= recoveries[0].bound_state + 1e-9,
        "L1 error {error} over the logged bound {}",
        recoveries[0].bound_state
    );
    assert!(error <= word_count_bound(thresholds, 1));
}

#[test]
fn a_service_started_while_the_broker_is_down_waits_for_it_up_to_its_startup_timeout() {
    let dir = test_dir("wc-late-broker");
    let broker = Broker::start(&dir);
    if !broker.is_own() {
        eprintln!("skipped: the test stops the project's own broker");
        return;
    }
    let thresholds = (400.0, 400, 1000);
    let p = pipeline(
        &dir,
        &broker,
        "wc-late-broker",
        "text",
        &word_count_operator(),
        thresholds,
    );
    let lines = keyed_word_lines(3_000, 6);
    produce(&broker.kafka(), &p.input, 2, &lines).expect("produce the lines");
    let exact = exact_word_counts(&lines);
    broker.go_down();

    // Out of patience: a clear error naming the brokers, not a hang.
    let impatient = dir.join("impatient.toml");
    let text = std::fs::read_to_string(&p.config).expect("read the config");
    std::fs::write(
        &impatient,
        text.replace("[kafka]\n", "[kafka]\nstartup_timeout_ms = 1500\n"),
    )
    .expect("write the config");
    let mut service = Service::start(&impatient, &dir.join("impatient.log"), true);
    let status = service.wait(Duration::from_secs(60), "giving up on the unreachable broker");
    assert!(!status.success(), "the service cannot run without a broker ({status})");
    let log = common::tail(&service.log);
    assert!(
        log.contains("could not be reached") && log.contains(&broker.address),
        "the error names the brokers:\n{log}"
    );

    // Patient (the default 60 s): it waits, then runs once the broker is back.
    let run_log = dir.join("run.log");
    let mut service = Service::start(&p.config, &run_log, true);
    service.wait_until(RUN_DEADLINE, "a logged retry while the broker is down", || {
        !log_lines(&run_log, "cannot be reached").is_empty()
    });
    broker.come_back();
    let status = service.wait(RUN_DEADLINE, "the run to finish once the broker is back");
    assert!(
        status.success(),
        "the service must wait for the broker ({status}):\n{}",
        common::tail(&service.log)
    );
    let counts = output_counts(&broker, &p.output);
    assert_eq!(l1_error(&counts, &exact), 0.0, "no failure: the counts are exact");
}

#[test]
fn a_broker_outage_mid_run_stalls_the_pipeline_and_the_answer_stays_within_the_bound() {
    let dir = test_dir("wc-outage");
    let broker = Broker::start(&dir);
    if !broker.is_own() {
        eprintln!("skipped: an outage needs the project's own broker, which the test can stop");
        return;
    }
    let thresholds = (400.0, 400, 1000);
    let p = pipeline(&dir, &broker, "wc-outage", "text", &word_count_operator(), thresholds);
    let lines = text_records(10_000, 6);
    produce(&broker.kafka(), &p.input, 1, &lines).expect("produce the lines");
    let exact = exact_word_counts(&lines);

    let mut service = Service::start(&p.config, &dir.join("run.log"), true);
    service.wait_until(RUN_DEADLINE, "outputs before the outage", || {
        broker.record_count(&p.output) > 5_000
    });
    broker.outage(Duration::from_secs(8));
    let status = service.wait(RUN_DEADLINE, "the run to finish after the outage");
    assert!(
        status.success(),
        "the service must ride out the outage ({status}):\n{}",
        common::tail(&service.log)
    );
    assert!(
        !log_lines(&service.log, "all brokers are down").is_empty()
            || !log_lines(&service.log, "broker connection trouble").is_empty(),
        "the outage is reported:\n{}",
        common::tail(&service.log)
    );
    let recoveries = logged_recoveries(&log_lines(&service.log, "recovered from a failure").join("\n"));
    let counts = output_counts(&broker, &p.output);
    let error = l1_error(&counts, &exact);
    let bound = word_count_bound(thresholds, recoveries.len() as u32);
    assert!(
        error <= bound,
        "L1 error {error} over the bound {bound} of {} recoveries",
        recoveries.len()
    );
    let kept = log_lines(&service.log, "partition given back: its kept task goes on");
    eprintln!(
        "outage: L1 error {error}, {} recoveries counted, {} partitions given back to their kept tasks",
        recoveries.len(),
        kept.len()
    );
    // A partition lost with the session and given back with nothing written
    // to its changelog meanwhile goes on in its kept task: no failure.
    if !kept.is_empty() {
        assert!(
            recoveries.is_empty(),
            "a kept task counted a failure:\n{}",
            common::tail(&service.log)
        );
        assert_eq!(error, 0.0, "a kept task goes on exactly");
    }
}

/// A stop asked for while the broker is down and the producers' queues are
/// full ends: an output waits on a full queue at most its patience and the
/// changelog's records wait in the task (in order) instead of in a send that
/// spins for as long as the outage lasts, so SIGTERM is answered within the
/// stop deadline. A restart once the broker is back recovers within the bound.
#[test]
fn a_stop_while_the_broker_is_down_with_full_producer_queues_ends_and_a_restart_recovers() {
    let dir = test_dir("wc-full-queue");
    let broker = Broker::start(&dir);
    if !broker.is_own() {
        eprintln!("skipped: an outage needs the project's own broker, which the test can stop");
        return;
    }
    let thresholds = (400.0, 400, 1000);
    let p = pipeline(
        &dir,
        &broker,
        "wc-full-queue",
        "text",
        &word_count_operator(),
        thresholds,
    );
    // Queues of eight records: a backup of more keys than that fills the
    // changelog producer's queue at once.
    let config = std::fs::read_to_string(&p.config).expect("read the config");
    let config = config.replace(
        r#"properties = { "consumer.fetch.wait.max.ms" = "10" }"#,
        r#"properties = { "consumer.fetch.wait.max.ms" = "10", "producer.queue.buffering.max.messages" = "8" }"#,
    );
    assert!(config.contains("queue.buffering.max.messages"), "{config}");
    std::fs::write(&p.config, config).expect("write the config");
    let lines = text_records(20_000, 8);
    produce(&broker.kafka(), &p.input, 1, &lines).expect("produce the lines");
    let exact = exact_word_counts(&lines);

    let mut service = Service::start(&p.config, &dir.join("run.log"), false);
    service.wait_until(RUN_DEADLINE, "outputs before the outage", || {
        broker.record_count(&p.output) > 2_000
    });
    broker.go_down();
    std::thread::sleep(Duration::from_secs(2));
    // The stop deadline (30 s) and an output's patience on a full queue (10 s)
    // with room to spare; a send spinning on the full queue never returns.
    let log = service.log.clone();
    let status = service.terminate(Duration::from_secs(90));
    eprintln!("stopped while the broker was down: {status}");
    broker.come_back();

    let restarted = run_to_end(&p, "restart.log");
    let recoveries = logged_recoveries(&log_lines(&restarted.log, "recovered from a failure").join("\n"));
    let counts = output_counts(&broker, &p.output);
    let error = l1_error(&counts, &exact);
    let bound = word_count_bound(thresholds, recoveries.len() as u32);
    assert!(
        error <= bound,
        "L1 error {error} over the bound {bound} of {} recoveries; first run:\n{}",
        recoveries.len(),
        common::tail(&log)
    );
}

/// A changelog created with `cleanup.policy=delete` loses the records a
/// recovery needs as they age: the service refuses it at start, naming the
/// topic and the policy, instead of running on it.
#[test]
fn a_changelog_that_is_not_compacted_is_refused_at_start() {
    let dir = test_dir("wc-delete-changelog");
    let broker = Broker::start(&dir);
    let p = pipeline(
        &dir,
        &broker,
        "wc-delete",
        "text",
        &word_count_operator(),
        (1000.0, 1000, 1000),
    );
    produce(&broker.kafka(), &p.input, 1, &text_records(100, 3)).expect("produce the lines");
    let changelog = format!("{}-changelog", p.group);
    afstream::service::kafka::ensure_topics(
        &broker.kafka(),
        &[afstream::service::kafka::TopicSpec {
            name: &changelog,
            partitions: 1,
            compacted: false,
        }],
    )
    .expect("create the changelog with the broker's default policy (delete)");
    let mut service = Service::start(&p.config, &dir.join("run.log"), true);
    let status = service.wait(RUN_DEADLINE, "the service to end");
    if !log_lines(&service.log, "not checked").is_empty() {
        eprintln!(
            "skipped: this broker does not describe the topic's cleanup.policy, so it cannot be checked: {:?}",
            log_lines(&service.log, "not checked")
        );
        return;
    }
    assert!(!status.success(), "a delete-policy changelog must be refused");
    let refused = log_lines(&service.log, "must be compacted");
    assert!(
        refused
            .iter()
            .any(|line| line.contains(&changelog) && line.contains("delete")),
        "the error names the topic and its policy:\n{}",
        common::tail(&service.log)
    );
}

/// A committed offset with no marker in the changelog is a loss, not a
/// clean start: every start writes a marker and the group's offset follows
/// acknowledged markers, so the changelog lost its records (here: the
/// pipeline pointed at a new, empty changelog). The task goes on from the
/// committed offset and says, as an error, that the state before it is lost.
#[test]
fn a_committed_offset_without_a_marker_is_reported_as_lost_state() {
    let dir = test_dir("wc-lost-changelog");
    let broker = Broker::start(&dir);
    let p = pipeline(
        &dir,
        &broker,
        "wc-lost",
        "text",
        &word_count_operator(),
        (1000.0, 1000, 1000),
    );
    produce(&broker.kafka(), &p.input, 1, &text_records(500, 4)).expect("produce the lines");
    let first = run_to_end(&p, "first.log");
    assert!(log_lines(&first.log, "the changelog holds no marker").is_empty());

    let config = std::fs::read_to_string(&p.config).expect("read the config");
    let renamed = config.replacen(
        "format = \"text\"",
        &format!("format = \"text\"\nchangelog_topic = \"{}-changelog-renamed\"", p.group),
        1,
    );
    assert_ne!(config, renamed, "the config names another changelog");
    std::fs::write(&p.config, renamed).expect("write the config");
    produce(&broker.kafka(), &p.input, 1, &text_records(100, 5)).expect("produce more lines");
    let second = run_to_end(&p, "second.log");
    let lost = log_lines(
        &second.log,
        "the changelog holds no marker, yet the group committed offset 500",
    );
    assert_eq!(
        lost.len(),
        1,
        "the loss is reported once, with the committed offset:\n{}",
        common::tail(&second.log)
    );
    assert!(lost[0].contains("ERROR"), "{}", lost[0]);
}

/// An output larger than the producer's `message.max.bytes` goes to the
/// dead-letter topic, cut short, with its reason and its input record, and
/// the run goes on: it used to stop the process, and every restart replayed
/// the same record into the same error.
#[test]
fn an_output_or_a_refused_input_over_the_record_limit_is_dead_lettered_cut_and_the_run_goes_on() {
    use afstream::service::runner::{DEAD_LETTER_OFFSET_HEADER, DEAD_LETTER_REASON_HEADER};
    let dir = test_dir("grep-oversized");
    let broker = Broker::start(&dir);
    let p = pipeline(
        &dir,
        &broker,
        "grep-big",
        "text",
        "kind = \"grep\"\npattern = \"match\"",
        (1.0, 1000, 1000),
    );
    let config = std::fs::read_to_string(&p.config).expect("read the config");
    let config = config.replace(
        r#"properties = { "consumer.fetch.wait.max.ms" = "10" }"#,
        r#"properties = { "consumer.fetch.wait.max.ms" = "10", "producer.message.max.bytes" = "4000" }"#,
    );
    std::fs::write(&p.config, config).expect("write the config");
    let line = |text: String| InputRecord {
        key: None,
        value: text.into_bytes(),
    };
    let mut records: Vec<InputRecord> = (0..300).map(|i| line(format!("line {i} match"))).collect();
    let oversized_at = 150;
    records[oversized_at] = line(format!("match {}", "x".repeat(10_000)));
    // An input record as large, refused (not UTF-8): its dead letter is cut too.
    let refused_at = 200;
    records[refused_at] = InputRecord {
        key: None,
        value: vec![0xff; 10_000],
    };
    produce(&broker.kafka(), &p.input, 1, &records).expect("produce the lines");

    let service = run_to_end(&p, "run.log");

    let outputs = broker.read_topic(&p.output);
    assert_eq!(outputs.len(), 298, "every other matching line is an output");
    let dead = broker.read_topic(&format!("{}-dead-letters", p.group));
    assert_eq!(
        dead.len(),
        2,
        "two dead letters, the oversized output and input: {dead:?}"
    );
    for (letter, at) in dead.iter().zip([oversized_at, refused_at]) {
        assert_eq!(letter.header(DEAD_LETTER_OFFSET_HEADER), Some(at.to_string().as_str()));
        let reason = letter.header(DEAD_LETTER_REASON_HEADER).unwrap_or_default();
        assert!(reason.contains("message.max.bytes"), "{reason}");
        assert_eq!(letter.value.len(), 1024, "cut to its first bytes");
    }
    assert!(
        dead[1]
            .header(DEAD_LETTER_REASON_HEADER)
            .is_some_and(|reason| reason.contains("does not decode")),
        "the refused record's own reason comes first"
    );
    assert!(log_lines(&service.log, "recovered from a failure").is_empty());
}

/// Keyed lines of five words whose words belong to their key: every word
/// stays in one partition, so the partitions' counts together are the global ones.
fn keyed_word_lines(lines: usize, seed: u64) -> Vec<InputRecord> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..lines)
        .map(|_| {
            let key = rng.gen_range(0..8);
            let words: Vec<String> = (0..5).map(|_| format!("k{key}w{}", rng.gen_range(0..300))).collect();
            InputRecord {
                key: Some(format!("k{key}").into_bytes()),
                value: words.join(" ").into_bytes(),
            }
        })
        .collect()
}

/// A WordCount pipeline over `keyed_word_lines` produced to two partitions.
fn keyed_pipeline_on_two_partitions(
    dir: &Path,
    broker: &Broker,
    name: &str,
    thresholds: (f64, u64, u64),
    seed: u64,
) -> (Pipeline, Vec<InputRecord>) {
    let p = pipeline(dir, broker, name, "text", &word_count_operator(), thresholds);
    let lines = keyed_word_lines(6_000, seed);
    produce(&broker.kafka(), &p.input, 2, &lines).expect("produce the lines");
    (p, lines)
}

/// Starts one instance, waits for its first outputs, then starts a second in
/// the same group and waits until the group has given it a partition.
fn two_instances(dir: &Path, broker: &Broker, p: &Pipeline) -> (Service, Service) {
    let mut first = Service::start(&p.config, &dir.join("first.log"), false);
    first.wait_until(RUN_DEADLINE, "outputs of the first instance", || {
        broker.record_count(&p.output) > 3_000
    });
    let mut second = Service::start(&p.config, &dir.join("second.log"), false);
    let second_log = second.log.clone();
    second.wait_until(RUN_DEADLINE, "a partition handed to the second instance", || {
        !log_lines(&second_log, "task started").is_empty()
    });
    (first, second)
}

#[test]
fn a_second_instance_takes_over_partitions_by_clean_handoff_without_a_failure() {
    let dir = test_dir("wc-scale-out");
    let broker = Broker::start(&dir);
    let thresholds = (400.0, 400, 2000);
    let (p, lines) = keyed_pipeline_on_two_partitions(&dir, &broker, "wc-scale-out", thresholds, 17);
    let exact = exact_word_counts(&lines);
    let words: usize = lines.len() * 5;

    let (mut first, second) = two_instances(&dir, &broker, &p);
    first.wait_until(RUN_DEADLINE, "every output, from both instances", || {
        broker.record_count(&p.output) >= words as i64
    });
    for service in [first, second] {
        let log = service.log.clone();
        let status = service.terminate(RUN_DEADLINE);
        assert!(
            status.success(),
            "clean stop failed ({status}):\n{}",
            common::tail(&log)
        );
        assert!(
            log_lines(&log, "recovered from a failure").is_empty(),
            "a handoff counted a failure:\n{}",
            common::tail(&log)
        );
    }
    // Cooperative-sticky (the default): only the partition that moves is revoked.
    let handed_off = log_lines(&dir.join("first.log"), "partition handed off: its final backup");
    assert_eq!(
        handed_off.len(),
        1,
        "the first instance hands exactly one partition off, cleanly:\n{}",
        common::tail(&dir.join("first.log"))
    );
    assert_eq!(
        broker.record_count(&p.output),
        words as i64,
        "one output per word: nothing replayed, nothing lost"
    );
    assert_eq!(
        changelog_counts(&broker, &p),
        exact,
        "the counts of an uninterrupted run"
    );
}

#[test]
fn the_partitions_of_a_killed_instance_move_to_the_other_within_the_bound() {
    let dir = test_dir("wc-kill-instance");
    let broker = Broker::start(&dir);
    let thresholds = (400.0, 400, 2000);
    let (p, lines) = keyed_pipeline_on_two_partitions(&dir, &broker, "wc-kill-instance", thresholds, 29);
    let exact = exact_word_counts(&lines);

    let (mut first, mut second) = two_instances(&dir, &broker, &p);
    second.wait_until(RUN_DEADLINE, "more outputs", || broker.record_count(&p.output) > 12_000);
    second.kill();
    // After the session timeout the group moves the partition to the first
    // instance, which recovers it from its last marker.
    let first_log = first.log.clone();
    first.wait_until(
        RUN_DEADLINE,
        "the first instance to recover the killed one's partition",
        || !log_lines(&first_log, "recovered from a failure").is_empty(),
    );
    let status = first.terminate(RUN_DEADLINE);
    assert!(status.success(), "clean stop failed ({status})");
    let last = run_to_end(&p, "last.log");

    let recoveries = logged_recoveries(&log_lines(&first_log, "recovered from a failure").join("\n"));
    assert_eq!(recoveries.len(), 1, "one partition moved after the kill");
    assert!(log_lines(&last.log, "recovered from a failure").is_empty());
    let counts = changelog_counts(&broker, &p);
    let error = l1_error(&counts, &exact);
    let bound = word_count_bound(thresholds, 1);
    assert!(error <= bound, "L1 error {error} over the bound {bound} of one failure");
    assert!(error <= recoveries[0].bound_state + 1e-9);
}

/// Produces `lines` more lines to the pipeline's two partitions, and adds
/// them to `all`.
fn produce_more(broker: &Broker, p: &Pipeline, all: &mut Vec<InputRecord>, lines: usize, seed: u64) {
    let more = keyed_word_lines(lines, seed);
    produce(&broker.kafka(), &p.input, 2, &more).expect("produce the lines");
    all.extend(more);
}

#[test]
fn a_zombie_owners_late_changelog_writes_are_left_out_and_the_state_stays_within_the_bound() {
    let dir = test_dir("wc-zombie");
    let broker = Broker::start(&dir);
    let thresholds = (400.0, 400, 2000);
    let (p, mut lines) = keyed_pipeline_on_two_partitions(&dir, &broker, "wc-zombie", thresholds, 43);
    let hold = dir.join("hold-changelog");
    let hold_path = hold.to_str().expect("a UTF-8 path").to_string();
    let fault = [("AFSTREAM_FAULT_HOLD_CHANGELOG", hold_path.as_str())];
    let words = |lines: &[InputRecord]| lines.len() as i64 * 5;

    let mut first = Service::start(&p.config, &dir.join("first.log"), false);
    first.wait_until(RUN_DEADLINE, "outputs of the first instance", || {
        broker.record_count(&p.output) > 3_000
    });
    let mut second = Service::start_with_env(&p.config, &dir.join("second.log"), false, &fault);
    let second_log = second.log.clone();
    second.wait_until(RUN_DEADLINE, "a partition handed to the second instance", || {
        !log_lines(&second_log, "task started").is_empty()
    });
    second.wait_until(RUN_DEADLINE, "every output so far", || {
        broker.record_count(&p.output) >= words(&lines)
    });
    // From here the second instance's changelog writes stay in the process,
    // as a stalled owner's queued writes do, while it takes more input.
    std::fs::write(&hold, b"").expect("create the hold file");
    produce_more(&broker, &p, &mut lines, 4_000, 44);
    second.wait_until(RUN_DEADLINE, "outputs of the new input", || {
        broker.record_count(&p.output) >= words(&lines) - 2_000
    });
    // Stalled past its session: the group gives its partition to the first.
    second.signal("STOP");
    let first_log = first.log.clone();
    first.wait_until(
        RUN_DEADLINE,
        "the first instance to take the stalled one's partition",
        || !log_lines(&first_log, "recovered from a failure").is_empty(),
    );
    produce_more(&broker, &p, &mut lines, 4_000, 45);
    first.wait_until(RUN_DEADLINE, "the first instance to process the new input", || {
        broker.record_count(&p.output) >= words(&lines)
    });
    // The stalled owner wakes up: its held writes land behind the new owner's.
    std::fs::remove_file(&hold).expect("remove the hold file");
    second.signal("CONT");
    second.wait_until(RUN_DEADLINE, "the held changelog records to go out", || {
        !log_lines(&second_log, "releasing the changelog records held back").is_empty()
    });
    // The first instance stops cleanly; the second restores both partitions
    // from changelogs that hold its own late writes.
    let status = first.terminate(RUN_DEADLINE);
    assert!(status.success(), "clean stop failed ({status})");
    // Every word again, counted on the restored states.
    produce_more(&broker, &p, &mut lines, 8_000, 46);
    second.wait_until(RUN_DEADLINE, "every output", || {
        broker.record_count(&p.output) >= words(&lines)
    });
    let status = second.terminate(RUN_DEADLINE);
    assert!(status.success(), "clean stop failed ({status})");
    // Replays repeat outputs, so the count above may be reached early.
    let last = run_to_end(&p, "last.log");
    assert!(log_lines(&last.log, "recovered from a failure").is_empty());

    let exact = exact_word_counts(&lines);
    let failures: usize = [&first_log, &second_log]
        .iter()
        .map(|log| log_lines(log, "recovered from a failure").len())
        .sum();
    assert!(failures >= 1, "the stalled instance's partition was recovered");
    // L1 adds up over the two partitions' tasks: a failure adds at most what
    // a task's first one does (Θ/2 halved at the start), less after it.
    let bound = failures as f64 * halving_bound(thresholds.0, 2, 1);
    for (what, counts) in [
        ("changelog", changelog_counts(&broker, &p)),
        ("output", output_counts(&broker, &p.output)),
    ] {
        let error = l1_error(&counts, &exact);
        assert!(
            error <= bound,
            "{what} counts: L1 error {error} over {bound} ({failures} failures); second instance:\n{}",
            common::tail(&second_log)
        );
    }
    assert!(
        !log_lines(&second_log, "left out and their keys written again").is_empty(),
        "the late writes were left out of a restore:\n{}",
        common::tail(&second_log)
    );
}

#[test]
fn a_restore_longer_than_the_poll_interval_keeps_the_member_in_the_group() {
    let dir = test_dir("wc-slow-restore");
    let broker = Broker::start(&dir);
    let thresholds = (400.0, 400, 2000);
    let (p, lines) = keyed_pipeline_on_two_partitions(&dir, &broker, "wc-slow-restore", thresholds, 47);
    // The consumer must poll every 7 s (at least its 6 s session); each
    // task takes 12 s to restore.
    let config = std::fs::read_to_string(&p.config).expect("read the config");
    let config = config.replace(
        r#""consumer.fetch.wait.max.ms" = "10""#,
        r#""consumer.fetch.wait.max.ms" = "10", "consumer.max.poll.interval.ms" = "7000""#,
    );
    assert!(config.contains("max.poll.interval.ms"), "the property is set");
    std::fs::write(&p.config, config).expect("write the config");
    let slow = [("AFSTREAM_FAULT_SLOW_TASK_START_MS", "12000")];
    let mut service = Service::start_with_env(&p.config, &dir.join("slow.log"), true, &slow);
    let status = service.wait(RUN_DEADLINE, "processing the input to its end");
    let log = service.log.clone();
    assert!(
        status.success(),
        "afstream run failed ({status}):\n{}",
        common::tail(&log)
    );
    assert!(
        log_lines(&log, "maximum poll interval").is_empty(),
        "the member left the group while its tasks restored:\n{}",
        common::tail(&log)
    );
    assert_eq!(
        log_lines(&log, "task started").len(),
        2,
        "each partition restored once:\n{}",
        common::tail(&log)
    );
    assert_eq!(changelog_counts(&broker, &p), exact_word_counts(&lines));
}

/// After a SIGKILL the changelogs' last markers are not clean, so the next
/// start first waits for them to stay unchanged `handoff_quiet_ms` (15 s
/// here). That wait runs beside the restore, off the poll loop: a SIGTERM
/// during it stops the process at once (were it inside the rebalance
/// callback, the loop would see the signal only after it), and the next start
/// recovers within the bound.
#[test]
fn a_stop_while_waiting_for_a_quiet_changelog_is_prompt() {
    let dir = test_dir("wc-quiet-wait");
    let broker = Broker::start(&dir);
    let thresholds = (400.0, 400, 2000);
    let (p, lines) = keyed_pipeline_on_two_partitions(&dir, &broker, "wc-quiet-wait", thresholds, 53);
    kill_after_outputs(&broker, &p, "killed.log", 2_000);
    let original = std::fs::read_to_string(&p.config).expect("read the config");
    let waiting = original.replace("[pipeline]\n", "[pipeline]\nhandoff_quiet_ms = 15000\n");
    assert!(waiting.contains("handoff_quiet_ms"), "the quiet wait is set");
    std::fs::write(&p.config, waiting).expect("write the config");
    let mut service = Service::start(&p.config, &dir.join("waiting.log"), false);
    let log = service.log.clone();
    service.wait_until(RUN_DEADLINE, "the partitions assigned", || {
        !log_lines(&log, "partitions assigned").is_empty()
    });
    let asked = std::time::Instant::now();
    let status = service.terminate(RUN_DEADLINE);
    let took = asked.elapsed();
    assert!(
        status.success(),
        "afstream run failed ({status}):\n{}",
        common::tail(&log)
    );
    assert!(
        took < Duration::from_secs(8),
        "the stop took {took:?}, waiting for the quiet changelog:\n{}",
        common::tail(&log)
    );
    assert!(
        log_lines(&log, "recovered from a failure").is_empty(),
        "stopped before the wait was over:\n{}",
        common::tail(&log)
    );
    std::fs::write(&p.config, original).expect("write the config back");
    run_to_end(&p, "final.log");
    // One failure of each of the two tasks: the stopped start began none.
    let error = l1_error(&changelog_counts(&broker, &p), &exact_word_counts(&lines));
    let bound = 2.0 * halving_bound(thresholds.0, 2, 1);
    assert!(
        error <= bound,
        "L1 error {error} over the bound {bound} of one failure of each task"
    );
}

#[test]
fn keyed_sums_on_local_stores_are_exact_after_a_sigkill_and_refused_records_are_dead_lettered() {
    let dir = test_dir("keyed-sum");
    let broker = Broker::start(&dir);
    let thresholds = (4000.0, 1000, 8000);
    let operator = "kind = \"keyed_aggregation\"\naggregate = \"sum\"\nmax_abs_value = 100.0";
    let p = pipeline(&dir, &broker, "keyed-sum", "text", operator, thresholds);
    with_local_state(&p, 100);
    let mut rng = StdRng::seed_from_u64(5);
    let mut records: Vec<InputRecord> = (0..20_000)
        .map(|_| InputRecord {
            key: Some(format!("key{}", rng.gen_range(0..2_000)).into_bytes()),
            value: rng.gen_range(-50..=50).to_string().into_bytes(),
        })
        .collect();
    let mut exact: HashMap<String, f64> = HashMap::new();
    for record in &records {
        let key = String::from_utf8(record.key.clone().expect("a key")).expect("a text key");
        let value: f64 = std::str::from_utf8(&record.value)
            .expect("text")
            .parse()
            .expect("a number");
        *exact.entry(key).or_default() += value;
    }
    // Refused: a value over max_abs_value, one that is no number, one with no key.
    for (at, key, value) in [
        (3_000, Some("key1"), "1000"),
        (9_000, Some("key2"), "ten"),
        (15_000, None, "5"),
    ] {
        records.insert(
            at,
            InputRecord {
                key: key.map(|k| k.as_bytes().to_vec()),
                value: value.as_bytes().to_vec(),
            },
        );
    }
    produce(&broker.kafka(), &p.input, 2, &records).expect("produce the records");

    kill_after_outputs(&broker, &p, "run0.log", 8_000);
    let service = run_to_end(&p, "final.log");

    assert_eq!(
        log_lines(&service.log, "local store reopened").len(),
        log_lines(&service.log, "task started").len() + log_lines(&service.log, "recovered from a failure").len(),
        "every task resumed on its local store:\n{}",
        common::tail(&service.log)
    );
    let sums = changelog_counts(&broker, &p);
    let wrong: Vec<_> = exact.iter().filter(|(k, v)| sums.get(*k) != Some(*v)).take(5).collect();
    assert!(wrong.is_empty(), "sums differ from the exact ones, e.g. {wrong:?}");
    assert_eq!(sums.len(), exact.len());
    let dead = broker.read_topic(&format!("{}-dead-letters", p.group));
    let reasons: HashSet<&str> = dead
        .iter()
        .filter_map(|r| r.header(afstream::service::runner::DEAD_LETTER_REASON_HEADER))
        .collect();
    assert!(
        dead.len() >= 3 && reasons.len() == 3,
        "the three refused records, each at least once: {reasons:?}"
    );
    assert!(reasons.iter().any(|r| r.contains("no key")), "{reasons:?}");
    assert!(reasons.iter().any(|r| r.contains("not a number")), "{reasons:?}");
}

/// How often each partition appears in a log's lines containing `needle`.
fn times_logged(log: &Path, needle: &str) -> HashMap<i32, usize> {
    let mut times = HashMap::new();
    for partition in partitions_logged(log, needle) {
        *times.entry(partition).or_insert(0) += 1;
    }
    times
}

/// The partitions in a log's lines containing `needle` (`partition=N`).
fn partitions_logged(log: &Path, needle: &str) -> Vec<i32> {
    log_lines(log, needle)
        .iter()
        .filter_map(|line| {
            let rest = line.split(" partition=").nth(1)?;
            rest.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok()
        })
        .collect()
}

/// Each partition's failures counted in the recoveries a log records.
fn failures_logged(log: &Path) -> HashMap<i32, usize> {
    times_logged(log, "recovered from a failure")
}

/// The partitions a log says its instance lost (`partitions lost … partitions=[0, 4]`).
fn lost_logged(log: &Path) -> HashSet<i32> {
    log_lines(log, "partitions lost")
        .iter()
        .filter_map(|line| line.split("partitions=[").nth(1)?.split(']').next().map(str::to_string))
        .flat_map(|list| {
            list.split(',')
                .filter_map(|p| p.trim().parse().ok())
                .collect::<Vec<i32>>()
        })
        .collect()
}

/// How often each partition's task started in a log, after a failure or not.
fn starts_logged(log: &Path) -> HashMap<i32, usize> {
    let mut starts = times_logged(log, "task started");
    for (partition, times) in failures_logged(log) {
        *starts.entry(partition).or_insert(0) += times;
    }
    starts
}

#[test]
fn three_instances_on_six_partitions_survive_a_clean_stop_and_a_kill_with_every_move_accounted_for() {
    let dir = test_dir("wc-three");
    let broker = Broker::start(&dir);
    let thresholds = (1200.0, 1200, 6000);
    let p = pipeline(&dir, &broker, "wc-three", "text", &word_count_operator(), thresholds);
    // Lines keyed by one of 60 keys, each key's words its own: every word stays in one partition.
    let mut rng = StdRng::seed_from_u64(41);
    let lines: Vec<InputRecord> = (0..30_000)
        .map(|_| {
            let key = rng.gen_range(0..60);
            let words: Vec<String> = (0..5).map(|_| format!("k{key}w{}", rng.gen_range(0..200))).collect();
            InputRecord {
                key: Some(format!("k{key}").into_bytes()),
                value: words.join(" ").into_bytes(),
            }
        })
        .collect();
    // Half now, half once B has stopped: C is killed mid-stream.
    let (first_half, second_half) = lines.split_at(lines.len() / 2);
    produce(&broker.kafka(), &p.input, 6, first_half).expect("produce the first half");
    let exact = exact_word_counts(&lines);
    let (a_log, b_log, c_log) = (dir.join("a.log"), dir.join("b.log"), dir.join("c.log"));

    let mut a = Service::start(&p.config, &a_log, false);
    a.wait_until(RUN_DEADLINE, "outputs of the first instance", || {
        broker.record_count(&p.output) > 5_000
    });
    let mut b = Service::start(&p.config, &b_log, false);
    let mut c = Service::start(&p.config, &c_log, false);
    for service in [&mut b, &mut c] {
        let log = service.log.clone();
        service.wait_until(RUN_DEADLINE, "partitions handed to a new instance", || {
            !log_lines(&log, "task started").is_empty()
        });
    }

    // A clean stop: every task of B stops cleanly (final backup, clean marker)
    // and its partitions start again on A or C.
    let starts = || {
        let mut starts = starts_logged(&a_log);
        for (partition, times) in starts_logged(&c_log) {
            *starts.entry(partition).or_insert(0) += times;
        }
        starts
    };
    let starts_before = starts();
    let status = b.terminate(RUN_DEADLINE);
    assert!(status.success(), "B's clean stop failed:\n{}", common::tail(&b_log));
    let b_partitions: HashSet<i32> = starts_logged(&b_log).into_keys().collect();
    let stopped: HashSet<i32> = partitions_logged(&b_log, "task stopped cleanly").into_iter().collect();
    assert_eq!(stopped, b_partitions, "every task of B stopped cleanly");
    a.wait_until(RUN_DEADLINE, "B's partitions started again by A or C", || {
        let now = starts();
        b_partitions
            .iter()
            .all(|p| now.get(p).copied().unwrap_or(0) > starts_before.get(p).copied().unwrap_or(0))
    });
    if !broker.is_own() {
        // A coordinator that waits for a partition's owner to release it before
        // giving it to another (Apache Kafka) makes a clean stop cost nothing.
        // Tansu 0.6.0 does not, with three members (measured: it assigns a
        // partition to A while C still owns it and never tells C), so on the
        // project's own broker a move may be counted as a failure; the bound
        // below then accounts for it.
        for log in [&a_log, &c_log] {
            assert!(
                log_lines(log, "recovered from a failure").is_empty(),
                "a clean stop counted a failure:\n{}",
                common::tail(log)
            );
        }
    }

    // A kill: C's partitions move to A after the session timeout and start
    // again there, recovering from their last markers.
    let outputs_before = broker.record_count(&p.output);
    produce(&broker.kafka(), &p.input, 6, second_half).expect("produce the second half");
    a.wait_until(RUN_DEADLINE, "outputs of the second half", || {
        broker.record_count(&p.output) >= outputs_before + (second_half.len() * 5 / 10) as i64
    });
    let c_handed = times_logged(&c_log, "partition handed off");
    let c_partitions: HashSet<i32> = starts_logged(&c_log)
        .into_iter()
        .filter(|(p, started)| *started > c_handed.get(p).copied().unwrap_or(0))
        .map(|(p, _)| p)
        .collect();
    assert!(!c_partitions.is_empty(), "C held partitions when it was killed");
    let a_starts = starts_logged(&a_log);
    c.kill();
    // After the session timeout the group gives C's partitions to A. Tansu
    // 0.6.0 sometimes leaves them unassigned for minutes after a member dies
    // (measured: A lost its own partitions and was then assigned none), so
    // only a real cluster must do it in time; otherwise the last run below
    // takes them over.
    let moved_to_a = || {
        let now = starts_logged(&a_log);
        c_partitions
            .iter()
            .all(|p| now.get(p).copied().unwrap_or(0) > a_starts.get(p).copied().unwrap_or(0))
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(if broker.is_own() { 60 } else { 180 });
    while !moved_to_a() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        moved_to_a() || broker.is_own(),
        "A did not start C's partitions {c_partitions:?}:\n{}",
        common::tail(&a_log)
    );
    let status = a.terminate(RUN_DEADLINE);
    assert!(status.success(), "A's clean stop failed:\n{}", common::tail(&a_log));

    // Every partition processed to the end.
    let last = run_to_end(&p, "last.log");
    let last_log = last.log.clone();
    let started: HashSet<i32> = starts_logged(&last_log).into_keys().collect();
    assert_eq!(
        started,
        (0..6).collect::<HashSet<i32>>(),
        "all six partitions ran to the end"
    );

    // Every failure counted was a partition that moved, and the answer is
    // within the bound of the failures counted.
    let mut failures: HashMap<i32, usize> = HashMap::new();
    for log in [&a_log, &b_log, &c_log, &last_log] {
        for (partition, times) in failures_logged(log) {
            *failures.entry(partition).or_insert(0) += times;
        }
    }
    // Moved: B's and C's partitions, and any an instance lost (its session
    // ended: on Tansu 0.6.0, measured, A sometimes loses its own when C dies).
    let mut moved: HashSet<i32> = b_partitions.union(&c_partitions).copied().collect();
    for log in [&a_log, &b_log, &c_log] {
        moved.extend(lost_logged(log));
    }
    assert!(
        failures.keys().all(|p| moved.contains(p)),
        "failures {failures:?} only on partitions that moved ({moved:?})"
    );
    assert!(
        c_partitions.iter().all(|p| failures.contains_key(p)),
        "every partition of the killed instance recovered: {failures:?} vs {c_partitions:?}"
    );
    // L1 adds up over the six partitions' tasks: each gets Θ/6.
    let bound: f64 = failures
        .values()
        .map(|&k| halving_bound(thresholds.0, 6, k as u32))
        .sum();
    let counts = changelog_counts(&broker, &p);
    let error = l1_error(&counts, &exact);
    eprintln!(
        "three instances: B (partitions {b_partitions:?}) stopped cleanly, C ({c_partitions:?}) killed; failures \
         counted {failures:?}; L1 error {error}, bound {bound}"
    );
    assert!(
        error <= bound,
        "L1 error {error} over the bound {bound} of the failures counted"
    );
    assert!(exact.keys().all(|word| counts.contains_key(word)), "every word counted");
}

#[test]
fn changelog_readers_opened_ahead_are_connected_and_kept_between_restores() {
    use afstream::service::kafka::ReaderPool;
    let dir = test_dir("reader-pool");
    let broker = Broker::start(&dir);
    let topic = unique("reader-pool");
    produce(&broker.kafka(), &topic, 2, &text_records(100, 3)).expect("produce the lines");
    let pool = ReaderPool::new(&broker.kafka(), &topic);
    pool.fill_in_background(2);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while pool.idle() < 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "the two changelog readers opened ahead were not in the pool after 60 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let (first, second) = (pool.take().expect("a reader"), pool.take().expect("a reader"));
    assert_eq!(pool.idle(), 0, "a reader taken is out of the pool");
    let ends = [first.end_offset(0), second.end_offset(1)].map(|end| end.expect("the end of a partition"));
    assert_eq!(
        ends.iter().sum::<i64>(),
        100,
        "both partitions' ends, read through the readers"
    );
    // With none idle, a restore opens a reader of its own and leaves it there.
    let third = pool.take().expect("a new reader");
    assert_eq!(third.end_offset(0).expect("the end of partition 0"), ends[0]);
    for reader in [first, second, third] {
        pool.give_back(reader);
    }
    assert_eq!(pool.idle(), 3, "every reader is kept for the next restore");
}
