//! Per-item cost of each operator run by the task driver the service uses, in
//! mode `none` and in `approximate` at the default thresholds, engine only (no
//! broker: backups, markers and outputs are acknowledged after each poll batch). A plain Count-Min sketch with no
//! drift tracking at all is measured beside them as the floor.
//!
//! `cargo bench --bench operators` (add `-- --quick` for a short run).

use std::hint::black_box;

use afstream::core::{Mode, Operator};
use afstream::operators::*;
use afstream::workloads;
use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use xxhash_rust::xxh3::xxh3_64;

#[path = "support/engine.rs"]
mod engine;

use engine::Engine;

/// The floor: a Count-Min sketch of plain counters, no fault tolerance at all.
struct PlainCountMin {
    counters: Vec<f64>,
    width: u64,
}

impl PlainCountMin {
    #[inline]
    fn add(&mut self, flow: &[u8], bytes: f64) -> f64 {
        let hash = xxh3_64(flow);
        let mut estimate = f64::INFINITY;
        for row in 0..4u64 {
            let h = hash.wrapping_add(row.wrapping_mul(hash.rotate_left(32) | 1));
            let cell = (row * self.width + ((h as u128 * self.width as u128) >> 64) as u64) as usize;
            self.counters[cell] += bytes;
            estimate = estimate.min(self.counters[cell]);
        }
        estimate
    }
}

const BATCH: usize = 100_000;

fn bench_operator<O, F>(c: &mut Criterion, name: &str, build: F, items: &[O::Input], thresholds: (f64, u64, u64))
where
    O: Operator,
    F: Fn() -> O,
{
    let mut group = c.benchmark_group(name);
    group.throughput(Throughput::Elements(items.len() as u64));
    let (theta, l, gamma) = thresholds;
    for (label, mode) in [("none", Mode::None), ("approximate", Mode::Approximate)] {
        group.bench_function(label, |b| {
            b.iter_batched_ref(
                || Engine::one_of(build(), mode, (theta, l, gamma), 1),
                |engine| engine.run(items, |_| {}),
                BatchSize::LargeInput,
            )
        });
    }
    group.finish();
}

fn heavy_hitters(c: &mut Criterion) {
    let packets = workloads::zipf_flows(BATCH, 100_000, 1.1, 1);
    let mut group = c.benchmark_group("heavy_hitters");
    group.throughput(Throughput::Elements(packets.len() as u64));
    group.bench_function("plain_count_min", |b| {
        b.iter_batched_ref(
            || PlainCountMin {
                counters: vec![0.0; 4 * 8192],
                width: 8192,
            },
            |sketch| {
                for p in &packets {
                    black_box(sketch.add(&p.flow, p.bytes as f64));
                }
            },
            BatchSize::LargeInput,
        )
    });
    group.finish();
    // The papers' thresholds: Θ = 10^5 bytes, L = 10^3, Γ = 10^3.
    bench_operator(
        c,
        "heavy_hitters",
        || HeavyHitters::new(HeavyHitterConfig::default()).expect("config"),
        &packets,
        (1e5, 1000, 1000),
    );
}

fn logistic_regression(c: &mut Criterion) {
    let (items, _) = workloads::separable_vectors(BATCH, 1 << 16, 10, 2);
    // Θ = 10 (the papers' loose setting) on the Euclidean distance of the weights.
    bench_operator(
        c,
        "logistic_regression",
        || OnlineLogisticRegression::new(LogisticConfig::default()).expect("config"),
        &items,
        (10.0, 1000, 1000),
    );
}

fn online_join(c: &mut Criterion) {
    let tuples = workloads::join_streams(BATCH, 10_000, 3);
    bench_operator(
        c,
        "online_join",
        || OnlineJoin::new(JoinConfig::default()).expect("config"),
        &tuples,
        (1e3, 1000, 1000),
    );
}

fn word_count(c: &mut Criterion) {
    let lines = workloads::text_lines(BATCH / 10, 10, 50_000, 4);
    bench_operator(
        c,
        "word_count",
        || WordCount::new(WordCountConfig::default()).expect("config"),
        &lines,
        (1e4, 1000, 20_000),
    );
}

fn keyed_sum(c: &mut Criterion) {
    let values = workloads::keyed_values(BATCH, 100_000, 5);
    let config = KeyedAggregationConfig {
        aggregate: Aggregate::Sum,
        ..Default::default()
    };
    bench_operator(
        c,
        "keyed_sum",
        || KeyedAggregation::new(config).expect("config"),
        &values,
        (1e6, 1000, 1000),
    );
}

fn grep(c: &mut Criterion) {
    let lines = workloads::text_lines(BATCH, 10, 50_000, 6);
    bench_operator(
        c,
        "grep",
        || Grep::new(r"\bw7\b").expect("pattern"),
        &lines,
        (0.0, 1000, 1000),
    );
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).measurement_time(std::time::Duration::from_secs(3));
    targets = heavy_hitters, logistic_regression, online_join, word_count, keyed_sum, grep
}
criterion_main!(benches);
