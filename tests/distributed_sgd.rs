//! Distributed SGD on a real broker: three workers (one per input partition)
//! and one averager, linked by a model topic and a feedback topic, run as two
//! processes under BSP and ASP. Each consistency model runs failure-free and
//! with a SIGKILL of the workers' process and one of the averager's; the
//! final global model must score within a stated margin of the failure-free
//! one on held-out data, every worker iteration must reach the model topic
//! (no acknowledged model lost), and each recovery must log the bound the
//! thresholds give.

mod common;

use std::path::Path;
use std::time::Duration;

use afstream::eval::produce::{produce, Encoder, Workload};
use afstream::operators::{Consistency, DistributedSgdConfig, GlobalModel, SgdWorker};
use afstream::service::codec::GlobalModelRecord;
use afstream::service::config::Format;
use afstream::workloads;
use common::{log_lines, test_dir, unique, write_learner_config, Broker, Service};

const RUN_DEADLINE: Duration = Duration::from_secs(240);
const WORKERS: usize = 3;
const ITEMS: usize = 9_000;
const PUBLISH_EVERY: u64 = 200;
const SEED: u64 = 17;
/// How much worse the final global model's held-out log-loss may be after the
/// kills than failure-free.
const LOSS_MARGIN: f64 = 0.05;

fn sgd(consistency: Consistency) -> DistributedSgdConfig {
    DistributedSgdConfig {
        feature_bits: 12,
        learning_rate: 5.0,
        max_feature_norm: 4.0,
        workers: WORKERS as u32,
        publish_every: PUBLISH_EVERY,
        consistency,
        staleness: 2,
    }
}

fn consistency_name(consistency: Consistency) -> &'static str {
    match consistency {
        Consistency::Asp => "asp",
        Consistency::Bsp => "bsp",
        Consistency::Ssp => "ssp",
    }
}

fn write_config(path: &Path, broker: &Broker, group: &str, input: &str, consistency: Consistency) {
    let operator = format!(
        "feature_bits = 12, learning_rate = 5.0, max_feature_norm = 4.0, workers = {WORKERS}, publish_every = \
         {PUBLISH_EVERY}, consistency = \"{}\", staleness = 2",
        consistency_name(consistency)
    );
    write_learner_config(path, &broker.address, group, input, &operator);
}

/// The global models in the feedback topic, in order.
fn global_models(broker: &Broker, group: &str) -> Vec<GlobalModel> {
    let topic = format!("{group}-feedback");
    if broker.record_count(&topic) == 0 {
        // Not created yet, or empty.
        return Vec::new();
    }
    broker
        .read_topic(&topic)
        .iter()
        .map(|r| {
            let record: GlobalModelRecord = serde_json::from_slice(&r.value).expect("a global model record");
            record.to_model().expect("a valid global model")
        })
        .collect()
}

/// The iteration every worker can finish: the smallest partition's items over
/// `publish_every`.
fn last_iteration(broker: &Broker, input: &str) -> u64 {
    let records = broker.read_topic(input);
    (0..WORKERS as i32)
        .map(|p| records.iter().filter(|r| r.partition == p).count() as u64 / PUBLISH_EVERY)
        .min()
        .unwrap_or(0)
}

fn done(broker: &Broker, group: &str, last: u64) -> bool {
    global_models(broker, group).iter().any(|g| g.clock >= last)
}

/// Held-out (accuracy, log-loss) of the last global model of the final clock.
fn held_out(consistency: Consistency, models: &[GlobalModel]) -> (f64, f64) {
    let last = models
        .iter()
        .max_by_key(|g| (g.clock, g.version))
        .expect("a global model");
    let mut worker = SgdWorker::new(sgd(consistency), 0).expect("a worker");
    worker.take_in(last);
    // The workload's items after those produced: same truth, never trained on.
    let (all, _) = workloads::separable_vectors(ITEMS + 2_000, 1_000, 10, SEED);
    worker.model().evaluate(&all[ITEMS..])
}

/// Every worker's iterations 1..=last are in the model topic.
fn assert_no_model_lost(broker: &Broker, group: &str, last: u64, label: &str) {
    let records = broker.read_topic(&format!("{group}-models"));
    for worker in 0..WORKERS as i64 {
        for iteration in 1..=last as i64 {
            let found = records.iter().any(|r| {
                let v: serde_json::Value = serde_json::from_slice(&r.value).expect("a model record");
                v["worker"] == worker && v["iteration"] == iteration
            });
            assert!(
                found,
                "{label}: worker {worker}'s model of iteration {iteration} is missing"
            );
        }
    }
}

struct Run {
    models: Vec<GlobalModel>,
    recoveries: Vec<String>,
}

fn run(broker: &Broker, input: &str, consistency: Consistency, kills: bool) -> Run {
    let dir = test_dir(&format!("sgd-{}-{kills}", consistency_name(consistency)));
    let group = unique(&format!("sgd-{}", consistency_name(consistency)));
    let config = dir.join("sgd.toml");
    write_config(&config, broker, &group, input, consistency);
    let last = last_iteration(broker, input);
    assert!(last >= 10, "each partition holds {last} iterations of items");
    let (workers_log, average_log) = (dir.join("workers.log"), dir.join("average.log"));
    let label = format!("{consistency:?}");
    let models = format!("{group}-models");
    // The workers create the model topic the averager reads.
    let mut workers = Service::start_pipeline(&config, &workers_log, "workers");
    workers.wait_until(RUN_DEADLINE, &format!("{label}: a first model"), || {
        broker.record_count(&models) > 0
    });
    if kills {
        // At once: under ASP the workers take the whole input in about a
        // second, and a kill that comes after it leaves the restarted process
        // nothing to recover (the group hands it the partitions only once
        // the killed member's session expires).
        workers.kill();
        workers = Service::start_pipeline(&config, &workers_log, "workers");
    }
    let mut average = Service::start_pipeline(&config, &average_log, "average");
    if kills {
        workers.wait_until(RUN_DEADLINE, &format!("{label}: two thirds of the models"), || {
            broker.record_count(&models) >= (WORKERS as u64 * last * 2 / 3) as i64
        });
        // The averager must have taken input (so its start marker is in its
        // changelog) before the kill, or its restart is a fresh start and
        // recovers nothing: the workers may get this far before it has its
        // partition.
        average.wait_until(RUN_DEADLINE, &format!("{label}: a first global model"), || {
            !global_models(broker, &group).is_empty()
        });
        average.kill();
        average = Service::start_pipeline(&config, &average_log, "average");
    }
    workers.wait_until(
        RUN_DEADLINE,
        &format!("{label}: a global model of iteration {last}"),
        || done(broker, &group, last),
    );
    if kills {
        // Under ASP the killed workers may have published every model before
        // the kill; their partitions still come back to the restarted process
        // once the killed member's session expires, and it recovers them.
        workers.wait_until(RUN_DEADLINE, &format!("{label}: the workers' recoveries"), || {
            log_lines(&workers_log, "recovered from a failure").len() >= WORKERS
        });
        // Likewise the averager, which may have published the last global
        // model before its kill.
        average.wait_until(RUN_DEADLINE, &format!("{label}: the averager's recovery"), || {
            !log_lines(&average_log, "recovered from a failure").is_empty()
        });
    }
    assert!(
        workers.terminate(RUN_DEADLINE).success(),
        "{label}: workers stop cleanly"
    );
    assert!(
        average.terminate(RUN_DEADLINE).success(),
        "{label}: averager stops cleanly"
    );
    assert_no_model_lost(broker, &group, last, &label);
    let mut recoveries = log_lines(&workers_log, "recovered from a failure");
    recoveries.extend(log_lines(&average_log, "recovered from a failure"));
    if kills {
        // Each process recovered its tasks (three workers, one averager), each
        // logging the bound its thresholds give. Checked here, so that a
        // failing run keeps its logs.
        assert!(
            recoveries.len() > WORKERS,
            "{label}: {recoveries:?} (logs in {})",
            dir.display()
        );
        for line in &recoveries {
            assert!(line.contains("bound_state="), "{label}: {line}");
        }
    }
    let models = global_models(broker, &group);
    // Passed: its logs go (a failing run keeps them).
    let _ = std::fs::remove_dir_all(&dir);
    Run { models, recoveries }
}

#[test]
fn three_workers_and_an_averager_converge_through_kills_of_either_under_bsp_and_asp() {
    let dir = test_dir("distributed-sgd");
    let broker = Broker::start(&dir);
    let input = unique("vectors");
    // Keyed by their number, so the partitions get about a third each.
    let records: Vec<_> = Encoder::new(Workload::Vectors, Format::Json, None)
        .expect("an encoder")
        .synthetic(ITEMS, SEED)
        .expect("vectors")
        .into_iter()
        .enumerate()
        .map(|(i, mut r)| {
            r.key = Some(i.to_string().into_bytes());
            r
        })
        .collect();
    produce(&broker.kafka(), &input, WORKERS, &records).expect("produce the vectors");
    for consistency in [Consistency::Bsp, Consistency::Asp] {
        let free = run(&broker, &input, consistency, false);
        assert!(free.recoveries.is_empty(), "{consistency:?}: {:?}", free.recoveries);
        let killed = run(&broker, &input, consistency, true);
        let label = format!("{consistency:?}");
        let (first, last) = (&free.models[0], free.models.last().expect("a model"));
        assert!(
            last.loss < first.loss - 0.03,
            "{label}: the workers' loss went {} -> {}",
            first.loss,
            last.loss
        );
        let (free_accuracy, free_loss) = held_out(consistency, &free.models);
        let (accuracy, loss) = held_out(consistency, &killed.models);
        eprintln!(
            "{label}: workers' loss {:.3} -> {:.3}; held-out accuracy {free_accuracy:.4} / log-loss {free_loss:.4} \
             failure-free, {accuracy:.4} / {loss:.4} after the kills ({} recoveries, {} and {} global models)",
            first.loss,
            last.loss,
            killed.recoveries.len(),
            free.models.len(),
            killed.models.len()
        );
        assert!(
            free_accuracy > 0.6,
            "{label}: failure-free held-out accuracy {free_accuracy}"
        );
        assert!(
            loss <= free_loss + LOSS_MARGIN,
            "{label}: held-out log-loss {loss} after the kills against {free_loss} failure-free (accuracy {accuracy} \
             against {free_accuracy})"
        );
    }
}
