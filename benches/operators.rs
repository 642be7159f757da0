//! Per-item cost of each operator with its task controller, in mode `none` and in
//! `approximate` at the default thresholds, engine only (no broker: backups,
//! commits and outputs are acknowledged at once). A plain Count-Min sketch with no
//! drift tracking at all is measured beside them as the floor.
//!
//! `cargo bench --bench operators` (add `-- --quick` for a short run).

use std::hint::black_box;

use afstream::core::{
    Action, BackupEntry, ControllerConfig, GlobalThresholds, Mode, Operator, RecoveryPlan, TaskController,
};
use afstream::operators::*;
use afstream::workloads;
use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use xxhash_rust::xxh3::xxh3_64;

/// One task: the operator, its controller and reusable buffers.
struct Engine<O: Operator> {
    operator: O,
    controller: TaskController,
    next_offset: u64,
    outputs: Vec<O::Output>,
    actions: Vec<Action>,
    entries: Vec<BackupEntry>,
}

impl<O: Operator> Engine<O> {
    fn new(mut operator: O, mode: Mode, theta: f64, items: u64, outputs: u64) -> Self {
        let global = GlobalThresholds::new(theta, items, outputs).expect("valid thresholds");
        let config = ControllerConfig::single_task(mode, global, operator.constants(), operator.norm().is_additive())
            .expect("valid policy");
        let mut actions = Vec::new();
        let controller = TaskController::start(config, &RecoveryPlan::fresh(0), 0, &mut actions).expect("start");
        operator.set_theta(controller.operator_theta());
        Engine {
            operator,
            controller,
            next_offset: 0,
            outputs: Vec::new(),
            actions,
            entries: Vec::new(),
        }
    }

    #[inline]
    fn run(&mut self, items: &[O::Input]) {
        for item in items {
            let offset = self.next_offset;
            self.next_offset += 1;
            self.outputs.clear();
            if self.operator.process(item, &mut self.outputs).is_err() {
                continue;
            }
            let made = self.outputs.len() as u64;
            self.controller
                .item_processed(offset, made, self.operator.divergence(), 0, &mut self.actions);
            if made > 0 {
                self.controller.outputs_acknowledged(offset, made, &mut self.actions);
            }
            while let Some(action) = self.actions.pop() {
                match action {
                    Action::Backup { seq, scope, marker } => {
                        self.entries.clear();
                        self.operator.backup(seq, scope, &mut self.entries);
                        self.entries.push(marker.to_entry());
                        black_box(&self.entries);
                        self.operator.acknowledge_backup(seq);
                        self.controller
                            .backup_acknowledged(seq, self.operator.divergence(), &mut self.actions);
                    }
                    Action::Commit { offset } => self.controller.commit_acknowledged(offset, &mut self.actions),
                }
            }
        }
    }
}

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
                || Engine::new(build(), mode, theta, l, gamma),
                |engine| engine.run(items),
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
