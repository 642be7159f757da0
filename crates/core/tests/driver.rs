//! The task driver's handling of refused records: what does not decode and what
//! the operator rejects is read like an item, and whatever the adapter sends for
//! it (a dead letter) is held like an output: no marker passes it unacknowledged.
//! Also side inputs (a distributed worker's global model) and operators that
//! wait for them, and a chain stage skipping what an upstream replay sends
//! again.

use afstream_core::operators::{
    Consistency, DistributedSgdConfig, GlobalModel, LabeledVector, SgdWorker, WordCount, WordCountConfig,
};
use afstream_core::{
    Ack, AnalysisConstants, BackupBatch, BackupMarker, Blocked, ControllerConfig, GlobalThresholds, Item, Mode, Norm,
    Operator, RecoveryPlan, Rejected, SourcePosition, StoreCheckpoint, TaskDriver, TaskIo,
};

/// Records what the driver asks for; every refused record gets one dead letter.
#[derive(Default)]
struct Recorder {
    outputs: Vec<u64>,
    dead_letters: Vec<(u64, String)>,
    markers: Vec<BackupMarker>,
    backups: Vec<u64>,
    commits: Vec<u64>,
}

impl<Output> TaskIo<Output> for Recorder {
    fn send_output(&mut self, item_offset: u64, _output: Output) {
        self.outputs.push(item_offset);
    }
    fn write_backup(&mut self, seq: u64, _records: &BackupBatch) {
        self.backups.push(seq);
    }
    fn write_marker(&mut self, marker: &BackupMarker) {
        self.markers.push(marker.clone());
    }
    fn commit(&mut self, offset: u64) {
        self.commits.push(offset);
    }
    fn rejected(&mut self, offset: u64, reason: &Rejected) -> u64 {
        self.dead_letters.push((offset, reason.to_string()));
        1
    }
}

fn word_count() -> WordCount {
    WordCount::new(WordCountConfig {
        max_words_per_line: 3,
        ..WordCountConfig::default()
    })
    .expect("a valid WordCount")
}

fn approximate(constants: AnalysisConstants, max_uncovered: u64, max_unacked: u64) -> ControllerConfig {
    let global = GlobalThresholds::new(1e9, max_uncovered, max_unacked).expect("valid thresholds");
    ControllerConfig::single_task(Mode::Approximate, global, constants, Norm::L1).expect("a valid policy")
}

fn word_count_driver(io: &mut Recorder, max_uncovered: u64, max_unacked: u64) -> TaskDriver<WordCount> {
    let operator = word_count();
    let config = approximate(operator.constants(), max_uncovered, max_unacked);
    let mut driver =
        TaskDriver::start(config, operator, &RecoveryPlan::fresh(0), Vec::new(), 0, io).expect("a started driver");
    let start = io.markers.pop().expect("a start marker");
    driver.acknowledge(Ack::MarkerWritten(start.seq), io);
    driver
}

/// Acknowledges one output of the item at `offset`, then every backup written
/// so far.
fn acknowledge_output(driver: &mut TaskDriver<WordCount>, io: &mut Recorder, offset: u64) {
    acknowledge_output_of(driver, io, offset);
    acknowledge_backups(driver, io);
}

/// Acknowledges every backup written so far.
fn acknowledge_backups(driver: &mut TaskDriver<WordCount>, io: &mut Recorder) {
    for seq in std::mem::take(&mut io.backups) {
        driver.acknowledge(Ack::BackupWritten(seq), io);
    }
}

#[test]
fn refused_records_are_read_and_their_dead_letters_hold_back_the_marker() {
    let mut io = Recorder::default();
    let mut driver = word_count_driver(&mut io, 8, 1_000);
    let lines = ["a b".to_string(), "one two three four".to_string(), "c".to_string()];
    let taken = driver
        .process([(0, &lines[0]), (1, &lines[1]), (2, &lines[2])], 0, &mut io)
        .expect("processed");
    assert_eq!(taken, 3);
    assert!(driver.refuse(3, &Rejected("not UTF-8 text".into()), 0, &mut io));
    assert_eq!(
        io.dead_letters,
        vec![
            (1, "line has 4 words, over max_words_per_line = 3".to_string()),
            (3, "not UTF-8 text".to_string())
        ],
        "the operator's rejection and the undecodable record each get a dead letter"
    );
    let stats = driver.stats();
    assert_eq!(
        (stats.items, stats.rejected, stats.outputs, stats.dead_letters),
        (4, 2, 3, 2)
    );
    assert_eq!(driver.controller().processed().offset, 4, "a refused record is read");
    assert_eq!(driver.controller().unacknowledged_outputs(), 5);

    // L = 8 gives this task l = 4: a backup is due every two records, issued
    // at the end of a run (the first covers the run of three). A backup's
    // entries and then its marker wait for every output and dead letter before
    // its offset.
    acknowledge_backups(&mut driver, &mut io);
    for offset in [0, 0, 2, 1] {
        acknowledge_output(&mut driver, &mut io, offset);
    }
    assert!(
        io.markers.iter().all(|m| m.input_offset <= 3),
        "a marker passed the dead letter of offset 3 unacknowledged: {:?}",
        io.markers
    );
    assert_eq!(io.markers.last().map(|m| m.input_offset), Some(3));
    // One more line: a backup past the dead letter is due.
    let more = "d".to_string();
    assert_eq!(driver.process([(4, &more)], 0, &mut io).expect("processed"), 1);
    acknowledge_output(&mut driver, &mut io, 4);
    assert_eq!(
        io.markers.last().map(|m| m.input_offset),
        Some(3),
        "a marker passed the dead letter of offset 3 unacknowledged"
    );
    acknowledge_output(&mut driver, &mut io, 3);
    assert_eq!(
        io.markers.last().map(|m| m.input_offset),
        Some(5),
        "the marker past offset 3 follows its dead letter"
    );
}

#[test]
fn refused_records_count_towards_the_items_past_the_stores_last_write() {
    let mut io = Recorder::default();
    let mut driver = word_count_driver(&mut io, 1_000, 1_000);
    driver.write_store_every(3);
    let line = "a".to_string();
    assert_eq!(driver.process([(0, &line)], 0, &mut io).expect("processed"), 1);
    assert!(driver.refuse(1, &Rejected("not UTF-8 text".into()), 0, &mut io));
    assert!(driver.refuse(2, &Rejected("not UTF-8 text".into()), 0, &mut io));
    // A restart on the store replays what is past its last write: one item and
    // two refused records fill the limit of three.
    assert_eq!(driver.readiness(), Err(Blocked::StoreWrite));
    assert!(!driver.refuse(3, &Rejected("not UTF-8 text".into()), 0, &mut io));
    assert_eq!(driver.process([(3, &line)], 0, &mut io).expect("processed"), 0);
    driver.checkpoint(&mut StoreCheckpoint::default());
    assert_eq!(driver.readiness(), Ok(()), "the store's write lets input go on");
    assert!(driver.refuse(3, &Rejected("not UTF-8 text".into()), 0, &mut io));
}

#[test]
fn a_refused_record_waits_like_an_item_when_input_must() {
    let mut io = Recorder::default();
    // Γ = 4: γ = 2 outputs unacknowledged at most, one per line.
    let mut driver = word_count_driver(&mut io, 2, 4);
    let line = "x".to_string();
    let mut offset = 0;
    // Take input, never acknowledging an output, until the driver must wait.
    while driver.process([(offset, &line)], 0, &mut io).expect("processed") == 1 {
        offset += 1;
        assert!(offset < 100, "input never had to wait");
    }
    let before = driver.stats();
    assert!(!driver.refuse(offset, &Rejected("bad".into()), 0, &mut io));
    assert!(io.dead_letters.is_empty(), "nothing is sent for a record not taken");
    assert_eq!(driver.stats().items, before.items);
    assert_eq!(driver.stats().stalls, before.stalls + 1);
}

#[test]
fn a_waiting_operator_takes_no_input_and_a_side_input_past_theta_is_backed_up_at_once() {
    let sgd = DistributedSgdConfig {
        feature_bits: 4,
        workers: 1,
        publish_every: 2,
        consistency: Consistency::Bsp,
        ..DistributedSgdConfig::default()
    };
    let operator = SgdWorker::new(sgd, 0).expect("a valid worker");
    let constants = operator.constants();
    let global = GlobalThresholds::new(1.0, 1_000, 1_000).expect("valid thresholds");
    let config =
        ControllerConfig::single_task(Mode::Approximate, global, constants, operator.norm()).expect("a valid policy");
    let io = &mut Recorder::default();
    let mut driver =
        TaskDriver::start(config, operator, &RecoveryPlan::fresh(0), Vec::new(), 0, io).expect("a started driver");
    let start = io.markers.pop().expect("a start marker");
    driver.acknowledge(Ack::MarkerWritten(start.seq), io);

    let item = LabeledVector {
        label: true,
        features: vec![(1, 0.1)],
    };
    let items: Vec<(u64, &LabeledVector)> = (0..5).map(|offset| (offset, &item)).collect();
    let taken = driver.process(items.iter().copied(), 0, io).expect("processed");
    assert_eq!(taken, 2, "BSP: the worker waits after its first model");
    assert_eq!(io.outputs, vec![1]);
    assert!(!driver.operator_ready());
    assert_eq!(driver.stats().operator_waits, 1);
    assert_eq!(driver.stats().backups, 0, "two small steps stay within θ = 0.5");

    let moved = driver.side_input(
        |worker| {
            worker.adopt(&GlobalModel {
                clock: 1,
                version: 1,
                workers: 1,
                items: 2,
                loss: 0.5,
                accuracy: 0.5,
                weights_l1: 3.0,
                weights: vec![(2, 3.0)],
                iterations: vec![1],
            })
        },
        io,
    );
    assert!(moved > 0.5, "moved {moved}");
    assert_eq!(driver.stats().backups, 1, "the move passed θ: backed up at once");
    assert!(io.backups.is_empty(), "its entries wait for the output before them");
    acknowledge_output_of(&mut driver, io, 1);
    assert_eq!(io.backups.len(), 1);
    assert!(driver.operator_ready());
    assert_eq!(driver.process(items[2..].iter().copied(), 0, io).expect("processed"), 2);
}

/// Acknowledges one output of the item at `offset`.
fn acknowledge_output_of<O: Operator>(driver: &mut TaskDriver<O>, io: &mut Recorder, offset: u64) {
    driver.acknowledge(
        Ack::Output {
            item_offset: offset,
            count: 1,
        },
        io,
    );
}

fn from_upstream(offset: u64, index: u32) -> SourcePosition {
    SourcePosition {
        source: 42,
        offset,
        index,
    }
}

#[test]
fn a_repeated_source_position_is_read_but_not_applied_and_a_marker_carries_the_table_of_its_state() {
    let mut io = Recorder::default();
    let mut driver = word_count_driver(&mut io, 8, 1_000);
    let (a, b, c) = ("a".to_string(), "b".to_string(), "c".to_string());
    let item = |offset, source, input| Item { offset, source, input };
    // Upstream item 10 made "a" and "b"; its replay sends "a" again.
    let taken = driver
        .process(
            [
                item(0, Some(from_upstream(10, 0)), &a),
                item(1, Some(from_upstream(10, 1)), &b),
                item(2, Some(from_upstream(10, 0)), &a),
            ],
            0,
            &mut io,
        )
        .expect("processed");
    assert_eq!(taken, 3);
    assert_eq!(driver.stats().repeats, 1);
    assert_eq!(driver.controller().processed().offset, 3, "a repeat is read");
    assert_eq!(
        driver.operator().count("a").expect("a count"),
        1.0,
        "the replayed output is not counted again"
    );
    assert_eq!(driver.stats().backups, 1, "l = 4: a backup at the end of the run");
    // The next item moves the table while that backup waits for its outputs.
    assert_eq!(
        driver
            .process([item(3, Some(from_upstream(11, 0)), &c)], 0, &mut io)
            .expect("processed"),
        1
    );
    acknowledge_output_of(&mut driver, &mut io, 0);
    acknowledge_output_of(&mut driver, &mut io, 1);
    let marker = io.markers.last().expect("the backup's marker").clone();
    assert_eq!(marker.input_offset, 3);
    assert_eq!(
        marker.sources.as_slice(),
        &[from_upstream(10, 1)],
        "the marker logs the table of the state it covers, not the live one"
    );
    assert_eq!(driver.sources().as_slice(), &[from_upstream(11, 0)]);

    // A recovery from that marker resumes with its table: the replay of
    // upstream item 10 is skipped, item 11 (past the marker) applies.
    let operator = word_count();
    let config = approximate(operator.constants(), 8, 1_000);
    let plan = RecoveryPlan::decide(Mode::Approximate, Some(&marker), None, 0, operator.constants());
    let mut io = Recorder::default();
    let mut recovered = TaskDriver::start(config, operator, &plan, Vec::new(), 0, &mut io).expect("started");
    let start = io.markers.pop().expect("a start marker");
    assert_eq!(
        start.sources, marker.sources,
        "the start marker logs the table restored"
    );
    recovered.acknowledge(Ack::MarkerWritten(start.seq), &mut io);
    recovered
        .process(
            [
                item(3, Some(from_upstream(10, 1)), &b),
                item(4, Some(from_upstream(11, 0)), &c),
                item(5, None, &c),
            ],
            0,
            &mut io,
        )
        .expect("processed");
    assert_eq!(recovered.stats().repeats, 1);
    assert_eq!(recovered.operator().count("b").expect("a count"), 0.0, "b was skipped");
    assert_eq!(
        recovered.operator().count("c").expect("a count"),
        2.0,
        "new positions and unpositioned items apply"
    );
}
