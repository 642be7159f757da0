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
//! backups were pipelined) and with the default four, and with four while the
//! outputs linger 5 ms before their round trip (as the service's outputs do;
//! a marker waits for the outputs before it), side by side in one run for each
//! round trip; medians of the rounds, each ratio to `none`.
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

/// Acknowledges every changelog write one round trip after it, and every
/// output one round trip and the outputs' linger after it, each in the order
/// written.
struct DelayedIo {
    round_trip: Duration,
    output_linger: Duration,
    changelog: VecDeque<(Instant, Ack)>,
    outputs: VecDeque<(Instant, Ack)>,
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

    fn write_backup(&mut self, seq: u64, entries: &[BackupEntry]) {
        black_box(entries);
        let at = Instant::now() + self.round_trip;
        self.changelog.push_back((at, Ack::BackupWritten(seq)));
    }

    fn write_marker(&mut self, marker: &BackupMarker) {
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

/// How long one task takes to process every item, and its l.
fn run_case<O: Operator>(
    operator: O,
    items: &[O::Input],
    mode: Mode,
    thresholds: (f64, u64, u64),
    in_flight: usize,
    (round_trip, output_linger): (Duration, Duration),
) -> (Duration, u64) {
    let (theta, l, gamma) = thresholds;
    let global = GlobalThresholds::new(theta, l, gamma).expect("valid thresholds");
    let config = ControllerConfig::single_task(mode, global, operator.constants(), operator.norm().is_additive())
        .expect("valid policy")
        .with_max_backups_in_flight(in_flight);
    let mut io = DelayedIo {
        round_trip,
        output_linger,
        changelog: VecDeque::new(),
        outputs: VecDeque::new(),
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
            let Some(at) = io.next_due() else {
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
    let together = DEFAULT_MAX_BACKUPS_IN_FLIGHT;
    // (label, mode, backups in flight at most, the outputs' linger in µs)
    let cases = [
        ("none", Mode::None, 1, 0),
        ("approximate, one backup in flight", Mode::Approximate, 1, 0),
        (
            "approximate, backups in flight together",
            Mode::Approximate,
            together,
            0,
        ),
        (
            "approximate, backups in flight together, outputs lingering 5 ms (the service's linger.ms)",
            Mode::Approximate,
            together,
            5_000,
        ),
    ];
    for &rtt_us in &round_trips {
        let round_trip = Duration::from_micros(rtt_us);
        let mut rates: Vec<Vec<f64>> = vec![Vec::new(); cases.len()];
        let mut task_l = 0;
        for _ in 0..rounds {
            for (case, &(_, mode, in_flight, linger_us)) in cases.iter().enumerate() {
                let delays = (round_trip, Duration::from_micros(linger_us));
                let (took, l) = run_case(build(), items, mode, thresholds, in_flight, delays);
                rates[case].push(items.len() as f64 / took.as_secs_f64());
                if mode == Mode::Approximate {
                    task_l = l;
                }
            }
        }
        let none = median(rates[0].clone());
        for (case, &(label, _, _, _)) in cases.iter().enumerate() {
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
