//! End to end on a real broker, in one run: raw consumption of a topic with
//! rdkafka (no processing: the limit here) beside `afstream run` over the same
//! topic, for WordCount and heavy hitters, in modes `none` and `approximate`
//! (the shipped configs' thresholds). Cases alternate over several rounds and
//! the medians are reported with their ratios, since the machine is shared.
//!
//! `cargo bench --bench kafka`; AFSTREAM_BENCH_ITEMS (default 50 000) and
//! AFSTREAM_BENCH_ROUNDS (default 3) size it; AFSTREAM_TEST_BOOTSTRAP points it
//! at a cluster instead of the project's own broker.

#[path = "../tests/common/mod.rs"]
mod common;

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use afstream::service::config::{self, Config, ModeName};
use afstream::service::kafka::{partition_count, TopicReader};
use afstream::service::produce::{packet_records, produce, text_records, InputRecord};
use afstream::service::{run, RunOptions};
use rdkafka::Message;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn env_number(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn load_config(name: &str, address: &str, own_broker: bool) -> Config {
    let path = repo().join("configs").join(name);
    let mut config = config::load(&path, &|_| None).unwrap_or_else(|e| panic!("{e}"));
    config.kafka.bootstrap_servers = address.to_string();
    if own_broker {
        config
            .kafka
            .properties
            .insert("consumer.fetch.wait.max.ms".into(), "10".into());
    }
    config
}

/// Reads every record of the topic with no processing at all; items/s from the
/// first record to the last.
fn raw_consumption(config: &Config, topic: &str, run: usize) -> f64 {
    let mut kafka = config.kafka.clone();
    kafka.group_id = format!("bench-raw-{run}");
    let partitions = partition_count(&kafka, topic).expect("metadata").expect("topic");
    let reader = TopicReader::new(&kafka, "raw").expect("reader");
    let mut items = 0u64;
    let mut bytes = 0u64;
    let started = Instant::now();
    for partition in 0..partitions as i32 {
        reader
            .read_all(topic, partition, |m| {
                items += 1;
                bytes += m.payload().map_or(0, <[u8]>::len) as u64;
            })
            .expect("read the topic");
    }
    std::hint::black_box(bytes);
    items as f64 / started.elapsed().as_secs_f64()
}

struct PipelineRun {
    items_per_s: f64,
    stop_seconds: f64,
    changelog_per_item: f64,
    stall_share: f64,
}

fn pipeline(config: &Config, topic: &str, mode: ModeName, state_dir: Option<&Path>, run_id: usize) -> PipelineRun {
    let mut config = config.clone();
    config.pipeline.state_dir = state_dir.map(Path::to_path_buf);
    config.kafka.group_id = format!("bench-{run_id}-{}", std::process::id());
    config.pipeline.input_topic = topic.to_string();
    config.pipeline.output_topic = format!("{}-out", config.kafka.group_id);
    config.pipeline.changelog_topic = None;
    config.pipeline.fault_tolerance.mode = mode;
    let stop = AtomicBool::new(false);
    let report = run(&config, &stop, RunOptions { stop_at_end: true }).unwrap_or_else(|e| panic!("afstream run: {e}"));
    // Changelog records up to the clean stop, whose final complete backup (every
    // key once) is a one-off that a short run would otherwise count per item.
    let items: u64 = report.tasks.iter().map(|t| t.before_stop.items).sum();
    let records: u64 = report
        .tasks
        .iter()
        .map(|t| t.before_stop.backup_entries + t.before_stop.markers)
        .sum();
    let stalls: u64 = report.tasks.iter().map(|t| t.before_stop.stalls).sum();
    PipelineRun {
        // End to end: until every output is acknowledged and the state is durable.
        items_per_s: items as f64 / (report.processing + report.stop).as_secs_f64().max(1e-9),
        stop_seconds: report.stop.as_secs_f64(),
        changelog_per_item: records as f64 / items.max(1) as f64,
        stall_share: stalls as f64 / items.max(1) as f64,
    }
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

struct Workload {
    name: &'static str,
    config: Config,
    topic: String,
    /// Keeps its state in local RocksDB stores (with a state directory).
    store_backed: bool,
}

fn main() {
    // `cargo bench` passes `--bench`; `cargo test --benches` passes nothing else
    // useful either: this bench always runs in full.
    let items = env_number("AFSTREAM_BENCH_ITEMS", 50_000);
    let rounds = env_number("AFSTREAM_BENCH_ROUNDS", 3).max(1);
    let dir = std::env::temp_dir().join(format!("afstream-bench-{}", std::process::id()));
    let broker = common::Broker::start(&dir);
    let (address, own_broker) = (broker.address.clone(), broker.is_own());
    let stamp = std::process::id();
    let workloads: Vec<(Workload, Vec<InputRecord>, usize)> = vec![
        (
            Workload {
                name: "WordCount (lines of 1-8 words)",
                config: load_config("word-count.toml", &address, own_broker),
                topic: format!("bench-lines-{stamp}"),
                store_backed: true,
            },
            text_records(items, 1),
            1,
        ),
        (
            Workload {
                name: "heavy hitters (JSON packets)",
                config: load_config("heavy-hitters.toml", &address, own_broker),
                topic: format!("bench-packets-{stamp}"),
                store_backed: false,
            },
            packet_records(items, 2).expect("packets"),
            2,
        ),
    ];
    for (workload, records, partitions) in &workloads {
        produce(&workload.config.kafka, &workload.topic, *partitions, records).expect("produce the dataset");
    }
    eprintln!("broker {address}: {items} items per workload, {rounds} rounds");
    println!("| workload | case | items/s (median of {rounds}) | / raw | / none | changelog records per item | input waited (share of items) | clean stop (s) |");
    println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
    let mut run_id = 0;
    let state = dir.join("state");
    for (workload, _, _) in &workloads {
        let (mut raw, mut none, mut approx) = (Vec::new(), Vec::new(), Vec::new());
        let mut in_memory = Vec::new();
        let (mut changelog, mut stalls) = (Vec::new(), Vec::new());
        let (mut none_stop, mut approx_stop) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            run_id += 1;
            raw.push(raw_consumption(&workload.config, &workload.topic, run_id));
            run_id += 1;
            let run = pipeline(&workload.config, &workload.topic, ModeName::None, Some(&state), run_id);
            none.push(run.items_per_s);
            none_stop.push(run.stop_seconds);
            if workload.store_backed {
                run_id += 1;
                in_memory.push(pipeline(&workload.config, &workload.topic, ModeName::None, None, run_id).items_per_s);
            }
            run_id += 1;
            let run = pipeline(
                &workload.config,
                &workload.topic,
                ModeName::Approximate,
                Some(&state),
                run_id,
            );
            approx.push(run.items_per_s);
            approx_stop.push(run.stop_seconds);
            changelog.push(run.changelog_per_item);
            stalls.push(run.stall_share);
        }
        let (raw, none, approx) = (median(&mut raw), median(&mut none), median(&mut approx));
        println!("| {} | raw consumption | {raw:.0} | 1 | | | | |", workload.name);
        let store = if workload.store_backed { ", RocksDB" } else { "" };
        if workload.store_backed {
            let in_memory = median(&mut in_memory);
            println!(
                "| {} | none, state in memory | {in_memory:.0} | {:.3} | {:.3} | 0 | | |",
                workload.name,
                in_memory / raw,
                in_memory / none
            );
        }
        println!(
            "| {} | none{store} | {none:.0} | {:.3} | 1 | 0 | | {:.2} |",
            workload.name,
            none / raw,
            median(&mut none_stop)
        );
        println!(
            "| {} | approximate{store} | {approx:.0} | {:.3} | {:.3} | {:.4} | {:.2}% | {:.2} |",
            workload.name,
            approx / raw,
            approx / none,
            median(&mut changelog),
            100.0 * median(&mut stalls),
            median(&mut approx_stop)
        );
    }
    drop(broker);
}
