//! WordCount's keyed state in memory against a local RocksDB store, engine only
//! (the service's task driver, a broker that acknowledges at once, a store
//! write after every poll batch of 500 lines as the service does):
//! throughput and peak memory over many distinct words, and the time to bring
//! back a state from the local store and from its changelog records.
//!
//! `cargo bench --bench keyed_state` (`AFSTREAM_BENCH_KEYS`, default 10 000 000
//! distinct words; `AFSTREAM_BENCH_RESTORE_KEYS`, default 1 000 000). Each case
//! runs in a child process of its own, so that its peak RSS is its own.

#[path = "support/engine.rs"]
mod engine;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use afstream::core::{BackupBatch, BackupScope, Mode, Operator};
use afstream::operators::{WordCount, WordCountConfig};
use afstream::service::store::{StoreBudget, TaskStore};
use engine::Engine;

const CASE: &str = "AFSTREAM_STORE_BENCH_CASE";
const WORDS_PER_LINE: usize = 10;
const BUDGET: StoreBudget = StoreBudget {
    cache_bytes: 64 << 20,
    resident_keys: 100_000,
};
/// `configs/word-count.toml`'s thresholds on one partition.
const THRESHOLDS: (f64, u64, u64) = (10_000.0, 1_000, 20_000);

fn env_number(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Lines of ten words each, `keys` distinct words in all, a word of every line
/// a common one (so some keys stay hot).
fn lines(keys: usize) -> Vec<String> {
    (0..keys / WORDS_PER_LINE)
        .map(|line| {
            let mut text = String::from("the");
            for i in 1..WORDS_PER_LINE {
                text.push_str(&format!(" w{}", line * WORDS_PER_LINE + i));
            }
            text
        })
        .collect()
}

fn config() -> WordCountConfig {
    WordCountConfig {
        max_words_per_line: WORDS_PER_LINE as u64,
        ..WordCountConfig::default()
    }
}

/// A memory figure of this process from /proc (`VmHWM`: the peak so far,
/// `VmRSS`: now), in MiB.
fn memory_mib(field: &str) -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix(field))
        .and_then(|rest| {
            rest.trim_start_matches(':')
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<f64>()
                .ok()
        })
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

fn dir_mib(path: &Path) -> f64 {
    let bytes: u64 = std::fs::read_dir(path)
        .map(|entries| {
            entries
                .flatten()
                .filter_map(|e| e.metadata().ok())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0);
    bytes as f64 / (1 << 20) as f64
}

/// Runs `lines` through a task in approximate mode; with a store, writes it
/// after every poll batch. Returns words per second.
fn ingest(operator: WordCount, lines: &[String], store: Option<&TaskStore>) -> (f64, Engine<WordCount>) {
    let (theta, items, outputs) = THRESHOLDS;
    let mut engine = Engine::one_of(operator, Mode::Approximate, (theta, items, outputs), 1);
    let mut meta = TaskStore::new_meta(0);
    let started = Instant::now();
    engine.run(lines, |driver| {
        if let Some(store) = store {
            driver.stage_state();
            driver.checkpoint(&mut meta.checkpoint);
            store.write(&meta).expect("store write");
            driver.state_durable();
        }
    });
    let words = (lines.len() * WORDS_PER_LINE) as f64;
    (words / started.elapsed().as_secs_f64(), engine)
}

fn run_case(case: &str, dir: &Path) {
    match case {
        "memory" => {
            let lines = lines(env_number("AFSTREAM_BENCH_KEYS", 10_000_000));
            let dataset = memory_mib("VmRSS");
            let operator = WordCount::new(config()).expect("word count");
            let (rate, engine) = ingest(operator, &lines, None);
            let words = engine.driver.operator().iter().count();
            println!("{rate} {} {words} 0 {dataset}", memory_mib("VmHWM"));
        }
        "rocksdb" => {
            let lines = lines(env_number("AFSTREAM_BENCH_KEYS", 10_000_000));
            let dataset = memory_mib("VmRSS");
            let path = dir.join("ingest");
            let (store, _) = TaskStore::open(&path, BUDGET).expect("open the store");
            let operator =
                WordCount::with_store(config(), store.key_store(), BUDGET.resident_keys).expect("word count");
            let (rate, engine) = ingest(operator, &lines, Some(&store));
            println!(
                "{rate} {} {} {} {dataset}",
                memory_mib("VmHWM"),
                engine.driver.operator().iter().count(),
                dir_mib(&path)
            );
        }
        "restore" => {
            let keys = env_number("AFSTREAM_BENCH_RESTORE_KEYS", 1_000_000);
            let lines = lines(keys);
            let path = dir.join("restore");
            let (store, _) = TaskStore::open(&path, BUDGET).expect("open the store");
            let operator =
                WordCount::with_store(config(), store.key_store(), BUDGET.resident_keys).expect("word count");
            let (_, engine) = ingest(operator, &lines, Some(&store));
            // Its changelog, as a restore would read it: every word once.
            let mut twin = WordCount::new(config()).expect("word count");
            let mut outputs = Vec::new();
            for line in &lines {
                twin.process(line, &mut outputs).expect("line");
                outputs.clear();
            }
            let mut backup = BackupBatch::new(1);
            twin.backup(1, BackupScope::Complete, &mut backup);
            let changelog = backup.entries().expect("a backup decodes");
            drop((engine, store));

            let started = Instant::now();
            let (store, _) = TaskStore::open(&path, BUDGET).expect("reopen the store");
            let mut reopened =
                WordCount::with_store(config(), store.key_store(), BUDGET.resident_keys).expect("word count");
            let drifted = reopened.load_local_state().expect("drifted words");
            let local = started.elapsed().as_secs_f64();
            drop((reopened, store));

            let started = Instant::now();
            let (store, _) = TaskStore::open(&dir.join("from-changelog"), BUDGET).expect("a new store");
            let mut restored =
                WordCount::with_store(config(), store.key_store(), BUDGET.resident_keys).expect("word count");
            restored.restore(&changelog).expect("restore");
            restored.stage_state();
            store.write(&TaskStore::new_meta(keys as u64)).expect("store write");
            restored.state_durable();
            let from_changelog = started.elapsed().as_secs_f64();
            println!("{local} {from_changelog} {drifted} {}", changelog.len());
        }
        other => panic!("unknown case {other}"),
    }
}

fn child(case: &str, dir: &Path) -> Vec<f64> {
    let output = Command::new(std::env::current_exe().expect("this bench"))
        .env(CASE, case)
        .env("AFSTREAM_STORE_BENCH_DIR", dir)
        .output()
        .expect("run a case");
    assert!(
        output.status.success(),
        "case {case} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout)
        .split_whitespace()
        .map(|field| field.parse().unwrap_or(f64::NAN))
        .collect()
}

fn main() {
    if let Ok(case) = std::env::var(CASE) {
        let dir = PathBuf::from(std::env::var("AFSTREAM_STORE_BENCH_DIR").expect("the bench directory"));
        run_case(&case, &dir);
        return;
    }
    let keys = env_number("AFSTREAM_BENCH_KEYS", 10_000_000);
    let restore_keys = env_number("AFSTREAM_BENCH_RESTORE_KEYS", 1_000_000);
    let dir = std::env::temp_dir().join(format!("afstream-store-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("the bench directory");
    eprintln!("WordCount, {keys} distinct words in lines of {WORDS_PER_LINE}, approximate mode");

    let memory = child("memory", &dir);
    let rocksdb = child("rocksdb", &dir);
    println!(
        "| state | words/s | / in memory | peak RSS (MiB) | of which the input lines (MiB) | words in memory at the end | store on disk (MiB) |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    println!(
        "| in memory | {:.0} | 1 | {:.0} | {:.0} | {:.0} | |",
        memory[0], memory[1], memory[4], memory[2]
    );
    println!(
        "| RocksDB (cache {} MiB, {} resident words) | {:.0} | {:.3} | {:.0} | {:.0} | {:.0} | {:.0} |",
        BUDGET.cache_bytes >> 20,
        BUDGET.resident_keys,
        rocksdb[0],
        rocksdb[0] / memory[0],
        rocksdb[1],
        rocksdb[4],
        rocksdb[2],
        rocksdb[3]
    );
    let restore = child("restore", &dir);
    println!();
    println!("| restore of {restore_keys} words | seconds |");
    println!("| --- | --- |");
    println!(
        "| local store: open, reload {:.0} drifted words | {:.3} |",
        restore[2], restore[0]
    );
    println!(
        "| changelog: apply {:.0} records, write them to a new store | {:.3} |",
        restore[3], restore[1]
    );
    let _ = std::fs::remove_dir_all(&dir);
}
