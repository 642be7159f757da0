//! Side by side on a real broker (issue 5): for each workload one dataset is
//! preloaded, then every round runs each case over it in turn, so that the
//! ratios compare runs made minutes apart on the same machine:
//!
//! * raw consumption: rdkafka reading the topic and doing nothing else (the
//!   limit here);
//! * `afstream run` in mode `none` (no fault tolerance: the baseline);
//! * `approximate` at the config's thresholds, and tight (Θ/10, L/10);
//! * `exact` every 100 ms and every 30 s (Kafka Streams' exactly-once and
//!   at-least-once commit intervals);
//! * an every-change changelog: approximate with Θ at the smallest positive
//!   number, so every item's changed entries are written (coalesced while a
//!   backup is open, so it writes at most what Kafka Streams' store logging
//!   without a cache writes: a conservative baseline).
//!
//! Each case reports items/s and MB/s end to end (first assignment until
//! every output of every item is acknowledged; the clean stop's final complete
//! backup, a one-off per stop, is reported apart), the process's
//! CPU seconds per million items, changelog records and bytes, commits, peak
//! RSS and input stalls; medians over the rounds, a Markdown table on stdout
//! and JSON beside it.
//!
//! `cargo bench --bench kafka`; AFSTREAM_BENCH_ITEMS (default 300 000 per
//! workload), AFSTREAM_BENCH_ROUNDS (default 3), AFSTREAM_BENCH_WORKLOADS
//! (comma-separated names: word-count, heavy-hitters, online-join,
//! logistic-regression, distributed-sgd; default all), AFSTREAM_BENCH_CASES (comma-separated:
//! raw, none, approximate, tight, loose, exact-100, exact-30000, every-change;
//! default all; none always runs), AFSTREAM_BENCH_THETA and
//! AFSTREAM_BENCH_MAX_UNCOVERED (Θ and L instead of each config's; the tight
//! and loose cases scale from them), AFSTREAM_BENCH_JSON (default
//! `<target dir>/afstream-bench/kafka.json`); AFSTREAM_TEST_BOOTSTRAP points it
//! at a cluster instead of the project's own broker.

#[path = "../tests/common/mod.rs"]
mod common;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use afstream::eval::produce::{produce, Encoder};
use afstream::operators::Consistency;
use afstream::service::clients::assigned_reader;
use afstream::service::config::{self, Config, ModeName, OperatorConfig};
use afstream::service::kafka::partition_count;
use afstream::service::{run, RunOptions};
use rdkafka::consumer::Consumer;
use rdkafka::{Message, Offset, TopicPartitionList};
use serde_json::json;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn env_number(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// A config of `configs/` (its pipeline `pipeline`, when it has several).
fn load_config(name: &str, pipeline: Option<&str>, address: &str, own_broker: bool) -> Config {
    let path = repo().join("configs").join(name);
    let mut config = config::load_named(&path, &|_| None, pipeline).unwrap_or_else(|e| panic!("{e}"));
    config.kafka.bootstrap_servers = address.to_string();
    if own_broker {
        config
            .kafka
            .properties
            .insert("consumer.fetch.wait.max.ms".into(), "10".into());
        // With 200 000 items preloaded, the project's broker left the
        // member's heartbeats unanswered past the 6 s session while a task
        // started, and the group dropped it every 6 s for good (the bench's
        // first case never ended); a cluster is left at the default.
        config
            .kafka
            .properties
            .insert("consumer.session.timeout.ms".into(), "30000".into());
    }
    // Thresholds to try instead of the file's (the cases scale from them).
    let ft = &mut config.pipeline.fault_tolerance;
    if let Some(theta) = std::env::var("AFSTREAM_BENCH_THETA").ok().and_then(|v| v.parse().ok()) {
        ft.theta = theta;
    }
    if let Some(items) = std::env::var("AFSTREAM_BENCH_MAX_UNCOVERED")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        ft.max_uncovered = items;
    }
    config
}

/// The process's CPU time so far (user + system), from `/proc/self/stat`.
fn cpu_seconds() -> f64 {
    process_cpu_seconds("self")
}

/// The broker's CPU seconds so far (0 when it is not the project's own).
fn broker_cpu_seconds() -> f64 {
    BROKER_PID
        .get()
        .copied()
        .flatten()
        .map_or(0.0, |pid| process_cpu_seconds(&pid.to_string()))
}

static BROKER_PID: std::sync::OnceLock<Option<u32>> = std::sync::OnceLock::new();

/// User and system CPU seconds of a process (`self` or a pid).
fn process_cpu_seconds(process: &str) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{process}/stat")).unwrap_or_default();
    // Fields after the command name (which may hold spaces) start at `state`;
    // utime and stime are the 14th and 15th fields, in clock ticks (100 a second).
    let rest = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}

/// Resets the peak RSS (`VmHWM`) so that the next reading is this case's own.
fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

fn peak_rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(0.0, |kib| kib / 1024.0)
}

#[derive(Clone, Copy, Debug, Default)]
struct Measure {
    items_per_s: f64,
    mb_per_s: f64,
    cpu_s_per_million: f64,
    /// The broker's CPU per million items (its own broker only).
    broker_cpu_s_per_million: f64,
    changelog_records: f64,
    changelog_mb: f64,
    commits: f64,
    peak_rss_mib: f64,
    stall_share: f64,
    /// Of the rounds that waited, the share that waited for outputs (γ).
    output_stall_share: f64,
    /// Mean time from a marker's send to its acknowledgement.
    marker_ms: f64,
    /// From the first task's start to the first item taken (a one-off).
    start_seconds: f64,
    stop_seconds: f64,
}

/// Reads every record of the topic with no processing at all: one consumer
/// assigned every partition from the beginning, polled until it has them all.
fn raw_consumption(config: &Config, topic: &str, run: usize, items: u64, bytes_in: u64) -> Measure {
    let mut kafka = config.kafka.clone();
    kafka.group_id = format!("bench-raw-{run}-{}", std::process::id());
    let partitions = partition_count(&kafka, topic).expect("metadata").expect("topic");
    let consumer = assigned_reader(&kafka, &kafka.group_id, false).expect("a consumer");
    let mut assignment = TopicPartitionList::new();
    for partition in 0..partitions as i32 {
        assignment
            .add_partition_offset(topic, partition, Offset::Beginning)
            .expect("an assignment");
    }
    reset_peak_rss();
    let (cpu, broker_cpu) = (cpu_seconds(), broker_cpu_seconds());
    let started = Instant::now();
    consumer.assign(&assignment).expect("assign");
    let (mut read, mut bytes) = (0u64, 0u64);
    while read < items {
        assert!(
            started.elapsed() < Duration::from_secs(300),
            "raw consumption: {read} of {items} records after 300 s"
        );
        match consumer.poll(Duration::from_millis(100)) {
            Some(Ok(m)) => {
                read += 1;
                bytes += m.payload().map_or(0, <[u8]>::len) as u64;
            }
            Some(Err(e)) => panic!("raw consumption: {e}"),
            None => {}
        }
    }
    std::hint::black_box(bytes);
    let seconds = started.elapsed().as_secs_f64().max(1e-9);
    Measure {
        items_per_s: read as f64 / seconds,
        mb_per_s: bytes_in as f64 / seconds / 1e6,
        cpu_s_per_million: (cpu_seconds() - cpu) / read.max(1) as f64 * 1e6,
        broker_cpu_s_per_million: (broker_cpu_seconds() - broker_cpu) / read.max(1) as f64 * 1e6,
        peak_rss_mib: peak_rss_mib(),
        ..Measure::default()
    }
}

/// How a case runs the pipeline.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Case {
    Raw,
    None,
    Approximate,
    /// Θ/10 and L/10.
    Tight,
    /// L×10: markers ten times as far apart (a recovery replays ten times as
    /// many items).
    Loose,
    Exact {
        millis: u64,
    },
    EveryChange,
}

impl Case {
    const ALL: [Case; 8] = [
        Case::Raw,
        Case::None,
        Case::Approximate,
        Case::Tight,
        Case::Loose,
        Case::Exact { millis: 100 },
        Case::Exact { millis: 30_000 },
        Case::EveryChange,
    ];

    fn name(self) -> String {
        match self {
            Case::Raw => "raw consumption".into(),
            Case::None => "none".into(),
            Case::Approximate => "approximate".into(),
            Case::Tight => "approximate, Θ/10 and L/10".into(),
            Case::Loose => "approximate, L×10".into(),
            Case::Exact { millis } => format!("exact every {millis} ms"),
            Case::EveryChange => "every-change changelog".into(),
        }
    }

    /// Its name in `AFSTREAM_BENCH_CASES`.
    fn key(self) -> String {
        match self {
            Case::Raw => "raw".into(),
            Case::None => "none".into(),
            Case::Approximate => "approximate".into(),
            Case::Tight => "tight".into(),
            Case::Loose => "loose".into(),
            Case::Exact { millis } => format!("exact-{millis}"),
            Case::EveryChange => "every-change".into(),
        }
    }

    fn configure(self, config: &mut Config) {
        let ft = &mut config.pipeline.fault_tolerance;
        match self {
            Case::Raw | Case::None => ft.mode = ModeName::None,
            Case::Approximate => ft.mode = ModeName::Approximate,
            Case::Tight => {
                ft.mode = ModeName::Approximate;
                ft.theta /= 10.0;
                ft.max_uncovered = (ft.max_uncovered / 10).max(1);
            }
            Case::Loose => {
                ft.mode = ModeName::Approximate;
                ft.max_uncovered = ft.max_uncovered.saturating_mul(10);
            }
            Case::Exact { millis } => {
                ft.mode = ModeName::Exact;
                ft.exact_interval_items = None;
                ft.exact_interval_ms = Some(millis);
            }
            Case::EveryChange => {
                ft.mode = ModeName::Approximate;
                ft.theta = f64::MIN_POSITIVE;
            }
        }
    }
}

/// The longest a case may run.
const RUN_DEADLINE: Duration = Duration::from_secs(600);

fn pipeline(workload: &BenchWorkload, case: Case, state_dir: Option<&Path>, run_id: usize) -> Measure {
    let mut config = workload.config.clone();
    config.pipeline.state_dir = state_dir.map(Path::to_path_buf);
    config.kafka.group_id = format!("bench-{run_id}-{}", std::process::id());
    config.pipeline.input_topic = workload.topic.clone();
    config.pipeline.output_topic = format!("{}-out", config.kafka.group_id);
    config.pipeline.changelog_topic = None;
    if config.pipeline.feedback_topic.is_some() {
        config.pipeline.feedback_topic = Some(format!("{}-feedback", config.kafka.group_id));
    }
    case.configure(&mut config);
    let stop = AtomicBool::new(false);
    reset_peak_rss();
    let (cpu, broker_cpu) = (cpu_seconds(), broker_cpu_seconds());
    let started = Instant::now();
    let finished = AtomicBool::new(false);
    let report = std::thread::scope(|scope| {
        // Nothing waits forever: a run past its deadline is stopped and the
        // bench fails, naming it.
        scope.spawn(|| {
            while !finished.load(Ordering::Relaxed) && started.elapsed() < RUN_DEADLINE {
                std::thread::sleep(Duration::from_millis(200));
            }
            stop.store(true, Ordering::Relaxed);
        });
        let report = run(&config, &stop, RunOptions { stop_at_end: true });
        finished.store(true, Ordering::Relaxed);
        report
    })
    .unwrap_or_else(|e| panic!("afstream run: {e}"));
    assert!(
        started.elapsed() < RUN_DEADLINE,
        "{} ({}): the run did not reach the end of its input within {RUN_DEADLINE:?}",
        workload.name,
        case.key()
    );
    let cpu = cpu_seconds() - cpu;
    let broker_cpu = broker_cpu_seconds() - broker_cpu;
    // Changelog records up to the clean stop, whose final complete backup (every
    // key once) is a one-off that a short run would otherwise count per item.
    let (marker_total, markers) = report.tasks.iter().fold((Duration::ZERO, 0u64), |(total, n), t| {
        (total + t.markers.total, n + t.markers.acknowledged)
    });
    let stats = report.tasks.iter().map(|t| t.before_stop);
    let (mut items, mut records, mut bytes, mut commits, mut stalls) = (0u64, 0u64, 0u64, 0u64, 0u64);
    let mut output_stalls = 0u64;
    for s in stats {
        items += s.items;
        records += s.backup_entries + s.markers;
        bytes += s.backup_bytes;
        commits += s.commits;
        stalls += s.stalls;
        output_stalls += s.stalls_for_outputs;
    }
    // End to end: from the first item taken until every output of every item
    // is acknowledged. A start (the restore, then the start marker's round
    // trip or the first fetch) and the clean stop's final complete backup are
    // one-offs per run, not costs per item; they are reported apart ("start",
    // "clean stop").
    let seconds = (report.processing + report.drained).as_secs_f64().max(1e-9);
    Measure {
        items_per_s: items as f64 / seconds,
        mb_per_s: workload.bytes as f64 / seconds / 1e6,
        cpu_s_per_million: cpu / items.max(1) as f64 * 1e6,
        broker_cpu_s_per_million: broker_cpu / items.max(1) as f64 * 1e6,
        changelog_records: records as f64,
        changelog_mb: bytes as f64 / 1e6,
        commits: commits as f64,
        peak_rss_mib: peak_rss_mib(),
        stall_share: stalls as f64 / items.max(1) as f64,
        output_stall_share: output_stalls as f64 / stalls.max(1) as f64,
        marker_ms: marker_total.as_secs_f64() * 1e3 / markers.max(1) as f64,
        start_seconds: report.starting.as_secs_f64(),
        stop_seconds: report.stop.as_secs_f64(),
    }
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(f64::NAN)
}

/// The median of each figure over the rounds.
fn medians(runs: &[Measure]) -> Measure {
    let of = |f: fn(&Measure) -> f64| median(runs.iter().map(f).collect());
    Measure {
        items_per_s: of(|m| m.items_per_s),
        mb_per_s: of(|m| m.mb_per_s),
        cpu_s_per_million: of(|m| m.cpu_s_per_million),
        broker_cpu_s_per_million: of(|m| m.broker_cpu_s_per_million),
        changelog_records: of(|m| m.changelog_records),
        changelog_mb: of(|m| m.changelog_mb),
        commits: of(|m| m.commits),
        peak_rss_mib: of(|m| m.peak_rss_mib),
        stall_share: of(|m| m.stall_share),
        output_stall_share: of(|m| m.output_stall_share),
        marker_ms: of(|m| m.marker_ms),
        start_seconds: of(|m| m.start_seconds),
        stop_seconds: of(|m| m.stop_seconds),
    }
}

struct BenchWorkload {
    name: &'static str,
    config: Config,
    topic: String,
    /// Keeps its state in local RocksDB stores (with a state directory).
    store_backed: bool,
    items: u64,
    bytes: u64,
}

fn json_path() -> PathBuf {
    if let Ok(path) = std::env::var("AFSTREAM_BENCH_JSON") {
        return PathBuf::from(path);
    }
    let target = std::env::var("CARGO_TARGET_DIR").map_or_else(|_| repo().join("target"), PathBuf::from);
    target.join("afstream-bench").join("kafka.json")
}

fn main() {
    // RUST_LOG=afstream=info shows what a run does.
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    // `cargo bench` passes `--bench`; this bench always runs in full.
    let items = env_number("AFSTREAM_BENCH_ITEMS", 300_000);
    let rounds = env_number("AFSTREAM_BENCH_ROUNDS", 3).max(1);
    let chosen = std::env::var("AFSTREAM_BENCH_WORKLOADS").unwrap_or_default();
    // `none` always runs: every ratio is to it.
    let cases = std::env::var("AFSTREAM_BENCH_CASES").unwrap_or_default();
    let runs_case =
        |case: Case| case == Case::None || cases.is_empty() || cases.split(',').any(|c| c.trim() == case.key());
    let dir = std::env::temp_dir().join(format!("afstream-bench-{}", std::process::id()));
    let broker = common::Broker::start(&dir);
    let _ = BROKER_PID.set(broker.pid());
    let (address, own_broker) = (broker.address.clone(), broker.is_own());
    let stamp = std::process::id();
    // (config, its pipeline, name, partitions, state in RocksDB)
    let specs = [
        ("word-count", None, "WordCount (lines of 1-8 words)", 1, true),
        ("heavy-hitters", None, "heavy hitters (JSON packets)", 2, false),
        ("online-join", None, "online join (JSON tuples)", 2, false),
        (
            "logistic-regression",
            None,
            "logistic regression (JSON vectors)",
            1,
            false,
        ),
        // The workers' stage of the distributed learner, where the items flow
        // (its averager takes one model per worker per 1 000 items): under ASP,
        // which never waits for an averager, so that what is measured is the
        // workers' own cost of fault tolerance (issue 6's bar).
        (
            "distributed-sgd",
            Some("workers"),
            "distributed SGD workers (ASP, JSON vectors)",
            2,
            false,
        ),
    ];
    let mut workloads = Vec::new();
    for (file, pipeline, name, partitions, store_backed) in specs {
        if !chosen.is_empty() && !chosen.split(',').any(|c| c.trim() == file) {
            continue;
        }
        let mut config = load_config(&format!("{file}.toml"), pipeline, &address, own_broker);
        if let OperatorConfig::SgdWorker(sgd) = &mut config.pipeline.operator {
            sgd.consistency = Consistency::Asp;
            sgd.workers = partitions as u32;
        }
        let pipeline = &config.pipeline;
        let encoder = Encoder::new(
            afstream::eval::exact::producer_workload(&pipeline.operator),
            pipeline.format,
            pipeline.avro.as_ref(),
        )
        .expect("an encoder for the workload");
        let records = encoder.synthetic(items, 1).expect("the dataset");
        let topic = format!("bench-{file}-{stamp}");
        // The records are dropped once produced: the peak RSS is the pipeline's.
        let summary = produce(&config.kafka, &topic, partitions, &records).expect("produce the dataset");
        workloads.push(BenchWorkload {
            name,
            config,
            topic,
            store_backed,
            items: summary.records,
            bytes: summary.bytes,
        });
    }
    eprintln!("broker {address}: {items} items per workload, {rounds} rounds");
    println!("| workload | case | items/s | MB/s | / none | CPU s per M items | broker CPU s per M items | changelog records (per item) | changelog MB | commits | peak RSS (MiB) | input waited (of it for γ) | marker round trip (ms) | start (s) | clean stop (s) |");
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    let mut run_id = 0;
    let state = dir.join("state");
    let mut report = Vec::new();
    for workload in &workloads {
        let mut runs: Vec<Vec<Measure>> = vec![Vec::new(); Case::ALL.len()];
        for _ in 0..rounds {
            for (i, case) in Case::ALL.into_iter().enumerate() {
                if !runs_case(case) {
                    continue;
                }
                run_id += 1;
                let measure = match case {
                    Case::Raw => raw_consumption(
                        &workload.config,
                        &workload.topic,
                        run_id,
                        workload.items,
                        workload.bytes,
                    ),
                    _ => {
                        let state_dir = workload.store_backed.then_some(state.as_path());
                        pipeline(workload, case, state_dir, run_id)
                    }
                };
                runs[i].push(measure);
            }
        }
        let results: Vec<Measure> = runs.iter().map(|r| medians(r)).collect();
        let of = |wanted: Case| {
            let index = Case::ALL.iter().position(|&c| c == wanted).unwrap_or(0);
            results[index].items_per_s
        };
        let none = of(Case::None);
        for ((case, m), samples) in Case::ALL.into_iter().zip(&results).zip(&runs) {
            if samples.is_empty() {
                continue;
            }
            let raw = matches!(case, Case::Raw);
            println!(
                "| {} | {} | {:.0} | {:.2} | {:.3} | {:.1} | {:.1} | {} | {} | {} | {:.0} | {} | {} | {} | {} |",
                workload.name,
                case.name(),
                m.items_per_s,
                m.mb_per_s,
                m.items_per_s / none,
                m.cpu_s_per_million,
                m.broker_cpu_s_per_million,
                if raw {
                    String::new()
                } else {
                    format!(
                        "{:.0} ({:.3})",
                        m.changelog_records,
                        m.changelog_records / workload.items.max(1) as f64
                    )
                },
                if raw {
                    String::new()
                } else {
                    format!("{:.2}", m.changelog_mb)
                },
                if raw {
                    String::new()
                } else {
                    format!("{:.0}", m.commits)
                },
                m.peak_rss_mib,
                if raw {
                    String::new()
                } else {
                    format!("{:.2}% (γ {:.0}%)", 100.0 * m.stall_share, 100.0 * m.output_stall_share)
                },
                if raw {
                    String::new()
                } else {
                    format!("{:.1}", m.marker_ms)
                },
                if raw {
                    String::new()
                } else {
                    format!("{:.2}", m.start_seconds)
                },
                if raw {
                    String::new()
                } else {
                    format!("{:.2}", m.stop_seconds)
                },
            );
            report.push(json!({
                "workload": workload.name,
                "case": case.name(),
                "items": workload.items,
                "input_bytes": workload.bytes,
                "items_per_s": m.items_per_s,
                "mb_per_s": m.mb_per_s,
                "ratio_to_none": m.items_per_s / none,
                "cpu_s_per_million_items": m.cpu_s_per_million,
                "broker_cpu_s_per_million_items": m.broker_cpu_s_per_million,
                "changelog_records": m.changelog_records,
                "changelog_mb": m.changelog_mb,
                "commits": m.commits,
                "peak_rss_mib": m.peak_rss_mib,
                "input_waited_share": m.stall_share,
                "input_waited_for_outputs_share": m.output_stall_share,
                "start_s": m.start_seconds,
                "clean_stop_s": m.stop_seconds,
                "marker_round_trip_ms": m.marker_ms,
                "items_per_s_runs": samples.iter().map(|s| s.items_per_s).collect::<Vec<_>>(),
            }));
        }
        let (approx, every_change, raw) = (of(Case::Approximate), of(Case::EveryChange), of(Case::Raw));
        eprintln!(
            "{}: approximate / none {:.3} (target ≥ 0.97); approximate / every-change {:.2} (target ≥ 4); none / raw {:.3} (target ≥ 0.80)",
            workload.name,
            approx / none,
            approx / every_change,
            none / raw
        );
    }
    let path = json_path();
    if let Some(parent) = path.parent() {
        let _ = std::fs::create_dir_all(parent);
    }
    let document = json!({ "items_per_workload": items, "rounds": rounds, "results": report });
    match std::fs::write(&path, serde_json::to_string_pretty(&document).unwrap_or_default()) {
        Ok(()) => eprintln!("JSON: {}", path.display()),
        Err(e) => eprintln!("could not write {}: {e}", path.display()),
    }
    drop(broker);
}
