//! The engine's own work on one workload in one mode, run once, for an
//! instruction counter: the wall clock of a shared machine moves by a third
//! between runs, where callgrind's instruction counts repeat exactly, so what
//! approximate mode adds to `none` is measured as the difference of two
//! counts of this program.
//!
//! The task driver the service uses, one task unless told otherwise,
//! acknowledgements after each
//! poll of 500 items (as `cargo bench --bench operators` runs it), the
//! workload's items as `cargo bench --bench latency` makes them, at its
//! shipped config's thresholds (`configs/`):
//!
//! ```sh
//! cargo bench --bench instructions --no-run   # prints the binary's path
//! AFSTREAM_BENCH_WORKLOAD=online-join AFSTREAM_BENCH_MODE=approximate \
//!   valgrind --tool=callgrind --toggle-collect='instructions::run_once*' <binary>
//! ```
//!
//! AFSTREAM_BENCH_WORKLOAD: heavy-hitters, logistic-regression, online-join,
//! word-count or keyed-sum (default online-join); AFSTREAM_BENCH_MODE: none or
//! approximate (default); AFSTREAM_BENCH_ITEMS (default 1 000 000; WordCount
//! takes a tenth as many lines of ten words); AFSTREAM_BENCH_THETA (Θ instead
//! of the config's); AFSTREAM_BENCH_TASKS (default 1: that many tasks, each
//! on a contiguous share of the items, splitting the thresholds as the
//! service's tasks do, as `cargo bench --bench latency` runs four). Prints
//! the backups, changelog records and markers they wrote. Only `run_once`
//! is worth counting: the rest makes the items.

use std::hint::black_box;

use afstream::core::{Mode, Operator};
use afstream::operators::*;
use afstream::workloads;

#[path = "support/engine.rs"]
mod engine;
#[path = "support/shipped.rs"]
mod shipped;

use engine::Engine;
use shipped::shipped_thresholds;

/// Runs each engine over its share of the items, once; what callgrind counts.
#[inline(never)]
fn run_once<O: Operator>(engines: &mut [Engine<O>], items: &[O::Input]) {
    let share = items.len().div_ceil(engines.len());
    for (engine, part) in engines.iter_mut().zip(items.chunks(share)) {
        engine.run(part, |_| {});
    }
}

fn measure<O: Operator>(build: impl Fn() -> O, items: &[O::Input], config: &str) {
    let (theta, l, gamma) = shipped_thresholds(config);
    let theta = std::env::var("AFSTREAM_BENCH_THETA")
        .ok()
        .map(|v| v.parse().expect("AFSTREAM_BENCH_THETA is a number"))
        .unwrap_or(theta);
    let mode = match std::env::var("AFSTREAM_BENCH_MODE").as_deref() {
        Ok("none") => Mode::None,
        Ok("approximate") | Err(_) => Mode::Approximate,
        Ok(other) => panic!("AFSTREAM_BENCH_MODE is none or approximate, not {other:?}"),
    };
    let tasks: u32 = std::env::var("AFSTREAM_BENCH_TASKS")
        .ok()
        .map(|v| v.parse().expect("AFSTREAM_BENCH_TASKS is a count"))
        .unwrap_or(1)
        .max(1);
    let mut engines: Vec<Engine<O>> = (0..tasks)
        .map(|_| Engine::one_of(build(), mode, (theta, l, gamma), tasks))
        .collect();
    run_once(&mut engines, black_box(items));
    let (mut items, mut backups, mut records, mut markers) = (0, 0, 0, 0);
    for stats in engines.iter().map(|engine| engine.driver.stats()) {
        (items, backups) = (items + stats.items, backups + stats.backups);
        (records, markers) = (records + stats.backup_entries, markers + stats.markers);
    }
    println!(
        "{config} ({mode:?}, Θ = {theta}, L = {l}, Γ = {gamma}, {tasks} tasks): {items} items, {backups} backups, {records} records, {markers} markers"
    );
}

fn main() {
    let count: usize = std::env::var("AFSTREAM_BENCH_ITEMS")
        .ok()
        .map(|v| v.parse().expect("AFSTREAM_BENCH_ITEMS is a count"))
        .unwrap_or(1_000_000);
    let workload = std::env::var("AFSTREAM_BENCH_WORKLOAD").unwrap_or_else(|_| "online-join".into());
    match workload.as_str() {
        "heavy-hitters" => measure(
            || HeavyHitters::new(HeavyHitterConfig::default()).expect("config"),
            &workloads::zipf_flows(count, 100_000, 1.1, 1),
            "heavy-hitters.toml",
        ),
        "logistic-regression" => measure(
            || OnlineLogisticRegression::new(LogisticConfig::default()).expect("config"),
            &workloads::separable_vectors(count, 1 << 16, 10, 2).0,
            "logistic-regression.toml",
        ),
        "online-join" => measure(
            || OnlineJoin::new(JoinConfig::default()).expect("config"),
            &workloads::join_streams(count, 10_000, 3),
            "online-join.toml",
        ),
        "word-count" => measure(
            || WordCount::new(WordCountConfig::default()).expect("config"),
            &workloads::text_lines(count / 10, 10, 50_000, 4),
            "word-count.toml",
        ),
        "keyed-sum" => {
            let sum = KeyedAggregationConfig {
                aggregate: Aggregate::Sum,
                ..Default::default()
            };
            measure(
                || KeyedAggregation::new(sum).expect("config"),
                &workloads::keyed_values(count, 100_000, 5),
                "keyed-aggregation.toml",
            )
        }
        other => panic!("unknown AFSTREAM_BENCH_WORKLOAD {other:?}"),
    }
}
