//! The task driver against a broker whose acknowledgements come one round trip
//! after each write, however many writes are in flight: a Kafka cluster whose
//! produce latency is replication and network, not load. Input never waits
//! for a marker (a recovery restores the state logged at its marker, so the
//! state bound does not depend on how many items are past it); it waits only
//! while γ outputs are unacknowledged. So approximate mode should run near
//! `none` whatever the round trip, on one task or several.
//!
//! Every workload at the thresholds of its shipped config (`configs/`, as
//! `cargo bench --bench kafka` runs them; γ bounds the outputs in flight, so
//! a task takes at most γ outputs a round trip and Γ must be sized to the
//! rate), items in poll batches of 500, on 1 and on 4 tasks (the input split in four
//! partitions, the tasks served round robin by one thread, as a consumer
//! thread serves its partitions): mode `none`, `approximate`, and
//! `approximate` while the outputs linger 1 ms before their round trip (as the
//! service's outputs do where markers wait for them), and an every-change
//! changelog (approximate with Θ at the smallest positive number, as `cargo
//! bench --bench kafka` runs it: every changed entry is written, coalesced
//! while a backup is open), side by side in one run for each round trip;
//! timed from when every task's start marker is acknowledged;
//! medians of the rounds (5, or more where `none` would run under 2 s in
//! all), each ratio to `none`, the share of the run in
//! which every task's input waited for an acknowledgement (and of the polls
//! that waited, the share that waited for outputs, γ), the changelog records
//! (entries and markers) per item, with approximate's records over the
//! every-change changelog's and over a record per change (the entries of a
//! run where every item's changes are a backup of their own, not timed:
//! Kafka Streams' store logging with no cache, which the every-change
//! changelog writes only where it keeps up with the input).
//!
//! `cargo bench --bench latency`; AFSTREAM_BENCH_ITEMS (default 1 000 000),
//! AFSTREAM_BENCH_ROUNDS (the fewest; default 5), AFSTREAM_BENCH_RTT_US (comma-separated
//! round trips in µs, default 500,2000), AFSTREAM_BENCH_WORKLOADS
//! (comma-separated names as printed, default all).

use std::collections::VecDeque;
use std::hint::black_box;
use std::time::{Duration, Instant};

use afstream::core::{
    read_changelog, Ack, BackupBatch, BackupMarker, ControllerConfig, GlobalThresholds, Mode, Operator, Placement,
    TaskDriver, TaskIo, ThresholdPolicy,
};
use afstream::operators::*;
use afstream::workloads;

#[path = "support/shipped.rs"]
mod shipped;

use shipped::shipped_thresholds;

const POLL: usize = 500;

/// Acknowledges every changelog write one round trip after it, and every
/// output one round trip and the outputs' linger after it, each in the order
/// written.
struct DelayedIo {
    round_trip: Duration,
    output_linger: Duration,
    changelog: VecDeque<(Instant, Ack)>,
    outputs: VecDeque<(Instant, Ack)>,
    /// Changelog records written: backup entries and markers.
    records: u64,
    /// Of those, backup entries.
    entries: u64,
}

impl DelayedIo {
    /// When the next acknowledgement is due.
    fn next_due(&self) -> Option<Instant> {
        let first = |queue: &VecDeque<(Instant, Ack)>| queue.front().map(|(at, _)| *at);
        match (first(&self.changelog), first(&self.outputs)) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}

impl<Out> TaskIo<Out> for DelayedIo {
    fn send_output(&mut self, item_offset: u64, output: Out) {
        black_box(output);
        let at = Instant::now() + self.round_trip + self.output_linger;
        self.outputs.push_back((at, Ack::Output { item_offset, count: 1 }));
    }

    fn write_backup(&mut self, seq: u64, records: &BackupBatch) {
        self.records += records.len() as u64;
        self.entries += records.len() as u64;
        black_box(records);
        let at = Instant::now() + self.round_trip;
        self.changelog.push_back((at, Ack::BackupWritten(seq)));
    }

    fn write_marker(&mut self, marker: &BackupMarker) {
        self.records += 1;
        black_box(marker.to_entry());
        let at = Instant::now() + self.round_trip;
        self.changelog.push_back((at, Ack::MarkerWritten(marker.seq)));
    }

    fn commit(&mut self, offset: u64) {
        black_box(offset);
    }
}

/// Hands the driver every acknowledgement that is due.
fn deliver<O: Operator>(driver: &mut TaskDriver<O>, io: &mut DelayedIo) {
    let now = Instant::now();
    let mut due = Vec::new();
    for queue in [&mut io.outputs, &mut io.changelog] {
        while queue.front().is_some_and(|(at, _)| *at <= now) {
            due.extend(queue.pop_front().map(|(_, ack)| ack));
        }
    }
    for ack in due {
        driver.acknowledge(ack, io);
    }
}

/// One task of a case: its driver, its broker and its partition's items.
struct Task<'a, O: Operator> {
    driver: TaskDriver<O>,
    io: DelayedIo,
    items: &'a [O::Input],
    next: usize,
}

impl<O: Operator> Task<'_, O> {
    fn done(&self) -> bool {
        self.next >= self.items.len()
    }

    /// One poll: the acknowledgements due, then a batch. Returns whether
    /// input had to wait.
    fn poll(&mut self, started: Instant) -> bool {
        deliver(&mut self.driver, &mut self.io);
        let end = (self.next + POLL).min(self.items.len());
        let batch = self.items[self.next..end]
            .iter()
            .enumerate()
            .map(|(i, item)| ((self.next + i) as u64, item));
        let now_ms = started.elapsed().as_millis() as u64;
        let taken = self
            .driver
            .process(batch, now_ms, &mut self.io)
            .expect("the state reads");
        self.next += taken;
        taken == 0 && !self.done()
    }
}

/// A case: how the tasks run.
#[derive(Clone, Copy)]
struct Case {
    label: &'static str,
    mode: Mode,
    output_linger: Duration,
    /// Θ instead of the config's.
    theta: Option<f64>,
    /// Backups in flight at most, instead of the default.
    in_flight: Option<usize>,
}

/// What one run of a case measured.
struct Run {
    took: Duration,
    /// Changelog records written by every task.
    records: u64,
    /// Of those, backup entries.
    entries: u64,
    /// How long every task's input waited for an acknowledgement.
    waited: Duration,
    /// Polls in which input waited, and of them those in which it waited
    /// for outputs (γ), over every task.
    stalls: u64,
    stalls_for_outputs: u64,
}

/// How long `tasks` tasks take to process every item between them, and what
/// they wrote to the changelog.
fn run_case<O: Operator>(
    build: &dyn Fn() -> O,
    items: &[O::Input],
    case: Case,
    tasks: usize,
    thresholds: (f64, u64, u64),
    round_trip: Duration,
) -> Run {
    let (theta, l, gamma) = thresholds;
    let theta = case.theta.unwrap_or(theta);
    let global = GlobalThresholds::new(theta, l, gamma).expect("valid thresholds");
    let constants = build().constants();
    let norm = build().norm();
    let placement = Placement {
        parallelism: tasks as u32,
        ..Placement::default()
    };
    let policy = ThresholdPolicy::new(global, Default::default(), placement, norm, constants).expect("valid policy");
    let mut config = ControllerConfig::new(case.mode, policy, constants);
    if let Some(backups) = case.in_flight {
        config = config.with_max_backups_in_flight(backups);
    }
    let empty = read_changelog(&[]).expect("empty changelog");
    let share = items.len().div_ceil(tasks);
    let mut running: Vec<Task<'_, O>> = items
        .chunks(share)
        .map(|part| {
            let mut io = DelayedIo {
                round_trip,
                output_linger: case.output_linger,
                changelog: VecDeque::new(),
                outputs: VecDeque::new(),
                records: 0,
                entries: 0,
            };
            let (driver, _) = TaskDriver::recover(config, build(), &empty, None, 0, 0, &mut io).expect("start");
            Task {
                driver,
                io,
                items: part,
                next: 0,
            }
        })
        .collect();
    // The start markers (approximate mode) are acknowledged before the clock
    // starts: a start waits one round trip once, which is a start's latency,
    // not throughput, and would be a tenth of a run of the fastest workloads.
    for task in &mut running {
        while let Some(at) = task.io.next_due() {
            spin_until(at);
            deliver(&mut task.driver, &mut task.io);
        }
    }
    let started = Instant::now();
    let mut waited = Duration::ZERO;
    while running.iter().any(|task| !task.done()) {
        let mut all_wait = true;
        for task in running.iter_mut().filter(|task| !task.done()) {
            all_wait &= task.poll(started);
        }
        if all_wait {
            // Every task waits: until the next acknowledgement is due.
            let Some(at) = running.iter().filter_map(|task| task.io.next_due()).min() else {
                panic!("input waits with nothing in flight")
            };
            let spin = Instant::now();
            spin_until(at);
            waited += spin.elapsed();
        }
    }
    let stats: Vec<_> = running.iter().map(|task| task.driver.stats()).collect();
    Run {
        took: started.elapsed(),
        records: running.iter().map(|task| task.io.records).sum(),
        entries: running.iter().map(|task| task.io.entries).sum(),
        waited,
        stalls: stats.iter().map(|s| s.stalls).sum(),
        stalls_for_outputs: stats.iter().map(|s| s.stalls_for_outputs).sum(),
    }
}

/// Waits for `at` by spinning, so that the timer's granularity is not measured.
fn spin_until(at: Instant) {
    while Instant::now() < at {
        std::hint::spin_loop();
    }
}

fn env_number(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Rounds enough for `none` to have run `MIN_NONE_SECONDS` in all, judged
/// from its runs so far: a workload whose run is a few
/// tens of milliseconds would otherwise be measured on a quarter of a
/// second, shorter than the spread between runs settles in (see
/// docs/benchmarks.md, "The latency bench timed from the start markers").
fn rounds_for(none_runs: &[Run]) -> usize {
    const MIN_NONE_SECONDS: f64 = 2.0;
    const MOST_ROUNDS: usize = 41;
    if none_runs.is_empty() {
        return 1;
    }
    let took: f64 = none_runs.iter().map(|run| run.took.as_secs_f64()).sum();
    let per_round = took / none_runs.len() as f64;
    // Odd, so that the median is a round of its own.
    ((MIN_NONE_SECONDS / per_round).ceil() as usize | 1).min(MOST_ROUNDS)
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn workload<O: Operator>(workload: &str, build: impl Fn() -> O, items: &[O::Input], thresholds: (f64, u64, u64)) {
    let chosen = std::env::var("AFSTREAM_BENCH_WORKLOADS")
        .map(|names| names.split(',').any(|name| name.trim() == workload))
        .unwrap_or(true);
    if !chosen {
        return;
    }
    let (theta, l, gamma) = thresholds;
    let name = format!("{workload} (Θ = {theta}, L = {l}, Γ = {gamma})");
    let rounds = env_number("AFSTREAM_BENCH_ROUNDS", 5).max(1);
    let round_trips: Vec<u64> = std::env::var("AFSTREAM_BENCH_RTT_US")
        .ok()
        .map(|v| v.split(',').filter_map(|s| s.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![500, 2000]);
    let cases = [
        Case {
            label: "none",
            mode: Mode::None,
            output_linger: Duration::ZERO,
            theta: None,
            in_flight: None,
        },
        Case {
            label: "approximate",
            mode: Mode::Approximate,
            output_linger: Duration::ZERO,
            theta: None,
            in_flight: None,
        },
        Case {
            label: "approximate, outputs lingering 1 ms",
            mode: Mode::Approximate,
            output_linger: Duration::from_millis(1),
            theta: None,
            in_flight: None,
        },
        Case {
            label: "every-change changelog",
            mode: Mode::Approximate,
            output_linger: Duration::ZERO,
            theta: Some(f64::MIN_POSITIVE),
            in_flight: None,
        },
    ];
    // Every item's changes in a backup of their own: the entries a
    // changelog of every change writes (Kafka Streams' store logging with
    // no cache: a record per put, less a key an item changes twice). No
    // coalescing, so the count does not depend on the round trip or the
    // rate; the markers are left out (such a changelog has none).
    let per_change = Case {
        label: "a record per change",
        mode: Mode::Approximate,
        output_linger: Duration::ZERO,
        theta: Some(f64::MIN_POSITIVE),
        in_flight: Some(usize::MAX),
    };
    const APPROXIMATE: usize = 1;
    const EVERY_CHANGE: usize = 3;
    const TASKS: [usize; 2] = [1, 4];
    // Once for each number of tasks: with every item a backup of its own
    // the count does not depend on the round trip.
    let per_change_records = TASKS.map(|tasks| {
        let entries = run_case(&build, items, per_change, tasks, thresholds, Duration::ZERO).entries;
        entries as f64 / items.len() as f64
    });
    for &rtt_us in &round_trips {
        let round_trip = Duration::from_micros(rtt_us);
        for (tasks, changes) in TASKS.into_iter().zip(per_change_records) {
            let mut runs: Vec<Vec<Run>> = cases.iter().map(|_| Vec::new()).collect();
            while runs[0].len() < rounds.max(rounds_for(&runs[0])) {
                for (case_runs, &case) in runs.iter_mut().zip(&cases) {
                    case_runs.push(run_case(&build, items, case, tasks, thresholds, round_trip));
                }
            }
            let count = items.len() as f64;
            let median_of =
                |index: usize, measure: &dyn Fn(&Run) -> f64| median(runs[index].iter().map(measure).collect());
            let rate_of = |run: &Run| count / run.took.as_secs_f64();
            let none = median_of(0, &rate_of);
            let per_item: Vec<f64> = (0..cases.len())
                .map(|index| median_of(index, &|run| run.records as f64 / count))
                .collect();
            for (index, case) in cases.iter().enumerate() {
                let rate = median_of(index, &rate_of);
                let versus = match index {
                    APPROXIMATE => format!(
                        "{:.3} | {:.3}",
                        per_item[APPROXIMATE] / per_item[EVERY_CHANGE],
                        per_item[APPROXIMATE] / changes
                    ),
                    EVERY_CHANGE => format!(" | {:.3}", per_item[EVERY_CHANGE] / changes),
                    _ => " | ".into(),
                };
                println!(
                    "| {name} | {rtt_us} | {tasks} | {} | {rate:.0} | {:.3} | {:.1}% ({:.0}%) | {:.4} | {versus} |",
                    case.label,
                    rate / none,
                    100.0 * median_of(index, &|run| run.waited.as_secs_f64() / run.took.as_secs_f64()),
                    100.0 * median_of(index, &|run| run.stalls_for_outputs as f64 / run.stalls.max(1) as f64),
                    per_item[index]
                );
            }
        }
    }
}

fn main() {
    let count = env_number("AFSTREAM_BENCH_ITEMS", 1_000_000);
    println!(
        "| workload | round trip (µs) | tasks | case | items/s | / none | input waited (of its waits, for γ) | changelog records per item | / every-change | / a record per change |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    let packets = workloads::zipf_flows(count, 100_000, 1.1, 1);
    workload(
        "heavy hitters",
        || HeavyHitters::new(HeavyHitterConfig::default()).expect("config"),
        &packets,
        shipped_thresholds("heavy-hitters.toml"),
    );
    let (vectors, _) = workloads::separable_vectors(count, 1 << 16, 10, 2);
    workload(
        "logistic regression",
        || OnlineLogisticRegression::new(LogisticConfig::default()).expect("config"),
        &vectors,
        shipped_thresholds("logistic-regression.toml"),
    );
    let tuples = workloads::join_streams(count, 10_000, 3);
    workload(
        "online join",
        || OnlineJoin::new(JoinConfig::default()).expect("config"),
        &tuples,
        shipped_thresholds("online-join.toml"),
    );
    let lines = workloads::text_lines(count / 10, 10, 50_000, 4);
    workload(
        "WordCount",
        || WordCount::new(WordCountConfig::default()).expect("config"),
        &lines,
        shipped_thresholds("word-count.toml"),
    );
    let values = workloads::keyed_values(count, 100_000, 5);
    let sum = KeyedAggregationConfig {
        aggregate: Aggregate::Sum,
        ..Default::default()
    };
    workload(
        "keyed sum",
        || KeyedAggregation::new(sum).expect("config"),
        &values,
        shipped_thresholds("keyed-aggregation.toml"),
    );
}
