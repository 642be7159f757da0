//! A two-stage pipeline on a real broker: tokenize → count, the words
//! repartitioned by key through an intermediate topic, with a SIGKILL in each
//! stage. Tokenize's recovery sends again the words of the lines it replays;
//! count skips them by their source positions. With count's local store kept
//! its final state is exact; with it wiped, within the chain's bound.

mod common;

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use afstream::core::operators::{KeyedAggregation, KeyedAggregationConfig};
use afstream::core::{read_changelog, BackupEntry, EntryBytes, Operator};
use afstream::eval::produce::{produce, text_records};
use afstream::operators::{WordCount, WordCountConfig};
use common::{latest_by_key, log_lines, test_dir, unique, Broker, Record, Service};

const RUN_DEADLINE: Duration = Duration::from_secs(180);
const PARTITIONS: usize = 2;
const MAX_WORDS: u64 = 10;
const THETA: f64 = 1000.0;
const L: f64 = 200.0;
const GAMMA: f64 = 2000.0;

/// The chain's bound computed from Θ alone (not by the code under test):
/// after any number of failures under halving, a task's state is off by at
/// most its share of its stage's Θ, counted β times per later stage. Stage 2
/// (count) keeps Θ, stage 1 (tokenize, β = 10) gets Θ/β. A tokenize
/// recovery's repeated words add nothing: count skips them.
fn chain_bound() -> f64 {
    let n = PARTITIONS as f64;
    let beta = MAX_WORDS as f64;
    let count_task = THETA / n;
    let tokenize_task = (THETA / beta / n) * beta;
    n * (count_task + tokenize_task)
}

fn write_config(path: &Path, broker: &Broker, group: &str, input: &str, state_dir: &Path) {
    let config = format!(
        r#"
[kafka]
bootstrap_servers = "{address}"
group_id = "{group}"
properties = {{ "consumer.fetch.wait.max.ms" = "10", "consumer.session.timeout.ms" = "6000" }}

[pipelines.tokenize]
input_topic = "{input}"
output_topic = "{group}-words"
format = "text"
operator = {{ kind = "tokenize", max_words_per_line = {MAX_WORDS} }}

[pipelines.count]
input_topic = "{group}-words"
output_topic = "{group}-counts"
format = "text"
state_dir = "{state_dir}"
operator = {{ kind = "keyed_aggregation", aggregate = "count" }}
fault_tolerance = {{ mode = "approximate", theta = {THETA:?}, max_uncovered = {L}, max_unacked = {GAMMA} }}
"#,
        address = broker.address,
        state_dir = state_dir.display()
    );
    std::fs::write(path, config).expect("write the config");
}

/// Starts a run to the end and SIGKILLs it once `topic` holds `at` records.
/// Runs both stages until `topic` holds `at` records, then SIGKILLs them, and
/// waits out the killed members' session (6 s here) before the next run
/// joins. Worked around for the project's broker: Tansu 0.6.0's coordinator
/// gives a member that joins while a killed leader is still registered no
/// partitions and never rebalances once the dead member expires (a count
/// stage killed two seconds after it joined left the next run's count
/// stage with `partitions assigned partitions=[]` for the whole deadline).
fn kill_when(broker: &Broker, config: &Path, log: &Path, topic: &str, at: i64) {
    let mut service = Service::start(config, log, true);
    service.wait_until(RUN_DEADLINE, &format!("{at} records in {topic}"), || {
        broker.record_count(topic) >= at
    });
    service.kill();
    std::thread::sleep(Duration::from_secs(7));
}

/// The count stage's final state, from its changelog: the last run stopped
/// cleanly, so each partition's log ends with a complete backup.
fn final_counts(broker: &Broker, changelog: &str) -> HashMap<String, f64> {
    let records = broker.read_topic(changelog);
    let mut counts = HashMap::new();
    for partition in 0..PARTITIONS as i32 {
        let entries: Vec<BackupEntry> = records
            .iter()
            .filter(|record| record.partition == partition)
            .map(|Record { key, value, .. }| {
                let key = EntryBytes::from_slice(key.as_deref().expect("a changelog record has a key"));
                BackupEntry::new(key, (!value.is_empty()).then(|| EntryBytes::from_slice(value)))
            })
            .collect();
        let state = read_changelog(&entries).expect("the changelog reads");
        assert!(
            state.marker.as_ref().is_some_and(|m| m.clean),
            "partition {partition}'s changelog ends with a clean marker"
        );
        let mut count = KeyedAggregation::new(KeyedAggregationConfig::default()).expect("a keyed count");
        count.restore(&state.entries).expect("the state restores");
        for (word, value) in count.iter() {
            counts.insert(String::from_utf8_lossy(word).into_owned(), value);
        }
    }
    counts
}

/// L1 distance between two word counts.
fn l1(exact: &HashMap<String, f64>, counts: &HashMap<String, f64>) -> f64 {
    let off: f64 = exact
        .iter()
        .map(|(word, count)| (counts.get(word).copied().unwrap_or(0.0) - count).abs())
        .sum();
    let extra: f64 = counts
        .iter()
        .filter(|(word, _)| !exact.contains_key(*word))
        .map(|(_, count)| count.abs())
        .sum();
    off + extra
}

/// What a chain run with a SIGKILL in each stage ended with.
struct ChainRun {
    words: i64,
    exact: HashMap<String, f64>,
    /// The counts topic, latest per word.
    outputs: HashMap<String, f64>,
    /// The count stage's final state.
    state: HashMap<String, f64>,
    /// The words count skipped as repeats in the last run.
    repeats_skipped: u64,
    /// How the count stage's recovery in the last run restored its state.
    count_recovery: String,
}

/// Tokenize is killed a third of the way through the words; then count (the
/// stages run one after the other to the end), a sixth of the way through
/// them, before the words tokenize's recovery sent again. With `wipe`, the
/// count stage's local store is deleted before the last run.
fn run_chain(name: &str, wipe: bool) -> ChainRun {
    let dir = test_dir(name);
    let broker = Broker::start(&dir);
    let group = unique("wc2");
    let input = format!("{group}-lines");
    let lines = text_records(6_000, 31);
    produce(&broker.kafka(), &input, PARTITIONS, &lines).expect("produce the lines");
    // Unkeyed lines on two partitions: only the repartitioning makes global counts.
    let mut exact = WordCount::new(WordCountConfig {
        max_words_per_line: MAX_WORDS,
        ..WordCountConfig::default()
    })
    .expect("word count");
    let mut outputs = Vec::new();
    for line in &lines {
        exact
            .process(&String::from_utf8_lossy(&line.value).into_owned(), &mut outputs)
            .expect("a line");
    }
    let words = outputs.len() as i64;
    let exact: HashMap<String, f64> = exact.iter().map(|(w, c)| (w.clone(), c)).collect();

    let config = dir.join("wc2.toml");
    let state_dir = dir.join("state");
    write_config(&config, &broker, &group, &input, &state_dir);
    let check = std::process::Command::new("timeout")
        .args(["60", env!("CARGO_BIN_EXE_afstream"), "check", "--config"])
        .arg(&config)
        .args(["--partitions", "2"])
        .output()
        .expect("afstream check");
    let said = String::from_utf8_lossy(&check.stdout);
    let stated = format!("the last stage's state is off by at most {}", chain_bound());
    assert!(
        said.contains(&stated),
        "check states the chain's bound ({stated}):\n{said}"
    );

    kill_when(
        &broker,
        &config,
        &dir.join("run1.log"),
        &format!("{group}-words"),
        words / 3,
    );
    kill_when(
        &broker,
        &config,
        &dir.join("run2.log"),
        &format!("{group}-counts"),
        words / 6,
    );
    if wipe {
        std::fs::remove_dir_all(&state_dir).expect("delete the count stage's local store");
    }
    let mut last = Service::start(&config, &dir.join("run3.log"), true);
    let status = last.wait(RUN_DEADLINE, "both stages processing their input to the end");
    assert!(
        status.success(),
        "the last run failed; log:\n{}",
        common::tail(&last.log)
    );

    let in_group = |log: &str, needle: &str, group: &str| -> Vec<String> {
        log_lines(&dir.join(log), needle)
            .into_iter()
            .filter(|line| line.contains(group))
            .collect()
    };
    let tokenize = format!("{group}-tokenize");
    let count = format!("{group}-count");
    assert!(
        !in_group("run2.log", "recovered from a failure", &tokenize).is_empty(),
        "the tokenize stage recovered after its kill:\n{}",
        common::tail(&dir.join("run2.log"))
    );
    let count_recoveries = in_group("run3.log", "recovered from a failure", &count);
    assert!(
        !count_recoveries.is_empty(),
        "the count stage recovered after its kill:\n{}",
        common::tail(&dir.join("run3.log"))
    );
    let repeats_skipped = in_group("run3.log", "task stopped cleanly", &count)
        .iter()
        .filter_map(|line| line.split("repeats_skipped=").nth(1))
        .filter_map(|rest| rest.split_whitespace().next()?.parse::<u64>().ok())
        .sum();
    let outputs = latest_by_key(&broker.read_topic(&format!("{group}-counts")))
        .into_iter()
        .map(|(word, count)| (word, count.parse().expect("a count")))
        .collect();
    ChainRun {
        words,
        exact,
        outputs,
        state: final_counts(&broker, &format!("{count}-changelog")),
        repeats_skipped,
        count_recovery: count_recoveries.join("\n"),
    }
}

#[test]
fn a_two_stage_word_count_killed_in_each_stage_on_local_stores_ends_exact() {
    let run = run_chain("two-stage-kept", false);
    assert!(
        run.count_recovery.contains("source=LocalStore"),
        "the count stage restarted on its local store:\n{}",
        run.count_recovery
    );
    let state_error = l1(&run.exact, &run.state);
    eprintln!(
        "two-stage WordCount, local stores: {} words, final state L1 {state_error}, counts topic L1 {}, {} repeats \
         skipped",
        run.words,
        l1(&run.exact, &run.outputs),
        run.repeats_skipped
    );
    assert_eq!(state_error, 0.0, "the chain on local stores restarts exactly");
    assert!(
        run.repeats_skipped > 0,
        "the count stage skipped the words tokenize's recovery sent again"
    );
    // A restart on a local store may lose the outputs unacknowledged at the
    // kill (at most γ = Γ/2 per task, split over the tasks): the counts topic
    // keeps an older count for a word only if its last output was among them.
    let lost = GAMMA / 2.0;
    assert!(
        l1(&run.exact, &run.outputs) <= lost,
        "the counts topic is off by more than the outputs a restart may lose ({lost})"
    );
}

#[test]
fn a_two_stage_word_count_killed_in_each_stage_with_its_state_wiped_ends_within_the_chain_bound() {
    let run = run_chain("two-stage-wiped", true);
    assert!(
        run.count_recovery.contains("source=Marker"),
        "the count stage restored its changelog:\n{}",
        run.count_recovery
    );
    assert!(
        run.repeats_skipped > 0,
        "the count stage skipped the words tokenize's recovery sent again"
    );
    let bound = chain_bound();
    let state_error = l1(&run.exact, &run.state);
    let output_error = l1(&run.exact, &run.outputs);
    eprintln!(
        "two-stage WordCount, state wiped: {} words, final state L1 {state_error}, counts topic L1 {output_error}, \
         {} repeats skipped; bound {bound}",
        run.words, run.repeats_skipped
    );
    assert!(
        state_error <= bound,
        "L1 error {state_error} over the chain's bound {bound}"
    );
    assert!(
        output_error <= bound,
        "counts topic L1 {output_error} over the chain's bound {bound}"
    );
    assert!(
        run.exact.keys().all(|word| run.outputs.contains_key(word)),
        "every word has a count"
    );
}
