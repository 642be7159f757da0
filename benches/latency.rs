//! The task driver against a broker whose acknowledgements come one round trip
//! after each write, however many writes are in flight: a Kafka cluster whose
//! produce latency is replication and network, not load. Input waits once l
//! items are past the last acknowledged marker, so the window caps a task at
//! about l items a round trip; with backups in flight together a task comes
//! near that cap, with one backup at a time it reached about half of it (a
//! marker every two round trips).
//!
//! Heavy hitters and logistic regression at the engine benchmark's thresholds
//! (`benches/operators.rs`), one task, items in poll batches of 500: mode
//! `none`, `approximate` with one backup in flight (the controller before
//! backups were pipelined) and with the default four, side by side in one run
//! for each round trip; medians of the rounds, each ratio to `none`.
//!
//! `cargo bench --bench latency`; AFSTREAM_BENCH_ITEMS (default 1 000 000),
//! AFSTREAM_BENCH_ROUNDS (default 5), AFSTREAM_BENCH_RTT_US (comma-separated
//! round trips in µs, default 500,2000).

use std::collections::VecDeque;
use std::hint::black_box;
use std::time::{Duration, Instant};

use afstream::core::{
    read_changelog, Ack, BackupEntry, BackupMarker, ControllerConfig, GlobalThresholds, Mode, Operator, TaskDriver,
    TaskIo, DEFAULT_MAX_BACKUPS_IN_FLIGHT,
};
use afstream::operators::*;
use afstream::workloads;

const POLL: usize = 500;

/// Acknowledges every write one round trip after it, in the order written.
struct DelayedIo {
    round_trip: Duration,
    due: VecDeque<(Instant, Ack)>,
}

impl DelayedIo {
    fn later(&mut self, ack: Ack) {
        self.due.push_back((Instant::now() + self.round_trip, ack));
    }
}

impl<Out> TaskIo<Out> for DelayedIo {
    fn send_output(&mut self, item_offset: u64, output: Out) {
        black_box(output);
        self.later(Ack::Output { item_offset, count: 1 });
    }

    fn write_backup(&mut self, seq: u64, entries: &[BackupEntry]) {
        black_box(entries);
        self.later(Ack::BackupWritten(seq));
    }

    fn write_marker(&mut self, marker: &BackupMarker) {
        black_box(marker.to_entry());
        self.later(Ack::MarkerWritten(marker.seq));
    }

    fn commit(&mut self, offset: u64) {
        black_box(offset);
    }
}

/// Hands the driver every acknowledgement that is due.
fn deliver<O: Operator>(driver: &mut TaskDriver<O>, io: &mut DelayedIo) {
    let now = Instant::now();
    while io.due.front().is_some_and(|(at, _)| *at <= now) {
        if let Some((_, ack)) = io.due.pop_front() {
            driver.acknowledge(ack, io);
        }
    }
}

/// How long one task takes to process every item, and its l.
fn run_case<O: Operator>(
    operator: O,
    items: &[O::Input],
    mode: Mode,
    thresholds: (f64, u64, u64),
    in_flight: usize,
    round_trip: Duration,
) -> (Duration, u64) {
    let (theta, l, gamma) = thresholds;
    let global = GlobalThresholds::new(theta, l, gamma).expect("valid thresholds");
    let config = ControllerConfig::single_task(mode, global, operator.constants(), operator.norm().is_additive())
        .expect("valid policy")
        .with_max_backups_in_flight(in_flight);
    let mut io = DelayedIo {
        round_trip,
        due: VecDeque::new(),
    };
    let empty = read_changelog(&[]).expect("empty changelog");
    let (mut driver, _) = TaskDriver::recover(config, operator, &empty, None, 0, 0, &mut io).expect("start");
    let task_l = driver.controller().thresholds().items;
    let started = Instant::now();
    let mut next = 0;
    while next < items.len() {
        deliver(&mut driver, &mut io);
        let end = (next + POLL).min(items.len());
        let batch = items[next..end]
            .iter()
            .enumerate()
            .map(|(i, item)| ((next + i) as u64, item));
        let now_ms = started.elapsed().as_millis() as u64;
        let taken = driver.process(batch, now_ms, &mut io).expect("the state reads");
        next += taken;
        if taken == 0 {
            // Input waits: until the next acknowledgement is due (a spin, so
            // that the timer's granularity is not measured).
            let Some(&(at, _)) = io.due.front() else {
                panic!("input waits with nothing in flight")
            };
            while Instant::now() < at {
                std::hint::spin_loop();
            }
        }
    }
    (started.elapsed(), task_l)
}

fn env_number(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn workload<O: Operator>(name: &str, build: impl Fn() -> O, items: &[O::Input], thresholds: (f64, u64, u64)) {
    let rounds = env_number("AFSTREAM_BENCH_ROUNDS", 5).max(1);
    let round_trips: Vec<u64> = std::env::var("AFSTREAM_BENCH_RTT_US")
        .ok()
        .map(|v| v.split(',').filter_map(|s| s.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![500, 2000]);
    let cases = [
        ("none", Mode::None, 1),
        ("approximate, one backup in flight", Mode::Approximate, 1),
        (
            "approximate, backups in flight together",
            Mode::Approximate,
            DEFAULT_MAX_BACKUPS_IN_FLIGHT,
        ),
    ];
    for &rtt_us in &round_trips {
        let round_trip = Duration::from_micros(rtt_us);
        let mut rates: Vec<Vec<f64>> = vec![Vec::new(); cases.len()];
        let mut task_l = 0;
        for _ in 0..rounds {
            for (case, &(_, mode, in_flight)) in cases.iter().enumerate() {
                let (took, l) = run_case(build(), items, mode, thresholds, in_flight, round_trip);
                rates[case].push(items.len() as f64 / took.as_secs_f64());
                if mode == Mode::Approximate {
                    task_l = l;
                }
            }
        }
        let none = median(rates[0].clone());
        for (case, &(label, _, _)) in cases.iter().enumerate() {
            let rate = median(rates[case].clone());
            println!(
                "| {name} | {rtt_us} | {label} | {rate:.0} | {:.3} | {:.0} |",
                rate / none,
                task_l as f64 / round_trip.as_secs_f64(),
            );
        }
    }
}

fn main() {
    let count = env_number("AFSTREAM_BENCH_ITEMS", 1_000_000);
    println!("| workload | round trip (µs) | case | items/s | / none | l per round trip (items/s) |");
    println!("| --- | --- | --- | --- | --- | --- |");
    let packets = workloads::zipf_flows(count, 100_000, 1.1, 1);
    workload(
        "heavy hitters (Θ = 10^5 B, L = 10^3, Γ = 10^3)",
        || HeavyHitters::new(HeavyHitterConfig::default()).expect("config"),
        &packets,
        (1e5, 1000, 1000),
    );
    let (vectors, _) = workloads::separable_vectors(count, 1 << 16, 10, 2);
    workload(
        "logistic regression (Θ = 10, L = 10^3, Γ = 10^3)",
        || OnlineLogisticRegression::new(LogisticConfig::default()).expect("config"),
        &vectors,
        (10.0, 1000, 1000),
    );
}
