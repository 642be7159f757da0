//! The record collector: the Kafka side of a task's driver (`TaskIo`), the
//! only code that sends outputs, backups and markers, and the bookkeeping of
//! what is in flight until the producers report it.

use std::collections::VecDeque;
use std::marker::PhantomData;
use std::time::{Duration, Instant};

use rdkafka::consumer::Consumer;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{BaseProducer, BaseRecord};
use rdkafka::{Offset, TopicPartitionList};

use crate::core::{source_identity, Ack, BackupBatch, BackupEntry, BackupMarker, Rejected, SourcePosition, TaskIo};
use crate::service::codec::ServiceOperator;
use crate::service::delivery::{Delivery, DeliveryReports, FailedRecord, TaskIncarnation};

use super::input::{RawRecord, RawRecords};
use super::{
    TaskEnv, DEAD_LETTER_OFFSET_HEADER, DEAD_LETTER_PARTITION_HEADER, DEAD_LETTER_REASON_HEADER,
    DEAD_LETTER_TOPIC_HEADER, SOURCE_POSITION_HEADER,
};

/// Deliveries still owed for a backup in flight.
#[derive(Clone, Copy, Debug)]
pub(super) struct OpenBackup {
    pub(super) seq: u64,
    pub(super) remaining: usize,
    pub(super) failed: bool,
}

/// What a task's I/O left for the loop: acknowledgements known at once, the
/// backups in flight, and an error the task cannot go on with.
#[derive(Default)]
pub(super) struct InFlight {
    /// Backups in flight, in the order they were written: each is reported
    /// once all its records are, and in this order (an acknowledgement covers
    /// every backup before it, see `Operator::acknowledge_backup`).
    pub(super) backups: VecDeque<OpenBackup>,
    pub(super) acks: Vec<Ack>,
    pub(super) fatal: Option<String>,
    /// Changelog records (backup entries, markers) waiting for the task's next
    /// store write: a restart must know every key a backup in the changelog
    /// wrote, so nothing reaches the changelog before the state it covers is in
    /// the store.
    pub(super) changelog: Vec<(BackupEntry, Delivery)>,
    /// Something changed that the next store write must hold.
    pub(super) unwritten: bool,
    /// Outputs and dead letters whose delivery failed, to send again once the
    /// backoff has passed.
    pub(super) resend: Vec<(Delivery, FailedRecord)>,
    /// Dead letters sent and not yet acknowledged. While any is, the task's
    /// local store is not written: a restart on the store resumes at its
    /// offset, and must not pass a dead letter the broker may not have (an
    /// output may be lost there, within γ; a dead letter never).
    pub(super) dead_letters_in_flight: usize,
    pub(super) retry: RetryBackoff,
    pub(super) markers: MarkerRoundTrips,
    pub(super) positions: OutputPositions,
}

/// Numbers a task's outputs with their source positions
/// ([`crate::core::sources`]), so a downstream stage skips those a replay
/// sends again. The driver sends an item's outputs one after another.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct OutputPositions {
    source: u64,
    last: Option<SourcePosition>,
}

impl OutputPositions {
    /// The task of `group` on partition `partition` of `input`: the identity
    /// stays the same across restarts, and changes with the group or topic
    /// (a new group starts its input over, see [`crate::core::sources`]).
    pub(super) fn new(group: &str, input: &str, partition: i32) -> Self {
        let name = format!("{group}\0{input}\0{partition}");
        OutputPositions {
            source: source_identity(name.as_bytes()),
            last: None,
        }
    }

    /// The position of the next output of the item at `offset`.
    pub(super) fn next(&mut self, offset: u64) -> SourcePosition {
        let index = match self.last {
            Some(last) if last.offset == offset => last.index.saturating_add(1),
            _ => 0,
        };
        let position = SourcePosition {
            source: self.source,
            offset,
            index,
        };
        self.last = Some(position);
        position
    }
}

/// How long markers take from the producer to their acknowledgement: a
/// recovery replays the items of the markers in flight at the crash besides
/// the l/2 past the last one issued, so this round trip sizes a replay.
#[derive(Clone, Debug, Default)]
pub struct MarkerRoundTrips {
    /// Markers sent and not yet acknowledged, with when they were sent.
    pub(super) in_flight: VecDeque<(u64, Instant)>,
    pub acknowledged: u64,
    pub total: Duration,
}

impl MarkerRoundTrips {
    pub(super) fn sent(&mut self, seq: u64) {
        self.in_flight.push_back((seq, Instant::now()));
    }

    /// Marker `seq` was acknowledged (or failed: `acknowledged` false).
    pub(super) fn done(&mut self, seq: u64, acknowledged: bool) {
        let Some(index) = self.in_flight.iter().position(|&(s, _)| s == seq) else {
            return;
        };
        let Some((_, sent)) = self.in_flight.remove(index) else {
            return;
        };
        if acknowledged {
            self.acknowledged += 1;
            self.total += sent.elapsed();
        }
    }

    /// The mean round trip, if any marker was acknowledged.
    pub fn mean(&self) -> Option<Duration> {
        (self.acknowledged > 0).then(|| self.total.div_f64(self.acknowledged as f64))
    }
}

/// After a failed delivery, nothing of the task goes out for a while, doubling
/// from `RETRY_BACKOFF_MIN_MS` to `RETRY_BACKOFF_MAX_MS` while failures go on:
/// a broker that answers with errors is not flooded with retries (the
/// controller re-issues a failed backup or marker at once).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct RetryBackoff {
    pub(super) failures: u32,
    pub(super) until_ms: u64,
}

pub(super) const RETRY_BACKOFF_MIN_MS: u64 = 100;
pub(super) const RETRY_BACKOFF_MAX_MS: u64 = 5_000;

impl RetryBackoff {
    pub(super) fn failed(&mut self, now_ms: u64) {
        let delay = RETRY_BACKOFF_MIN_MS
            .saturating_mul(1 << self.failures.min(16))
            .min(RETRY_BACKOFF_MAX_MS);
        self.until_ms = self.until_ms.max(now_ms + delay);
        self.failures = self.failures.saturating_add(1);
    }

    pub(super) fn succeeded(&mut self) {
        self.failures = 0;
    }

    pub(super) fn holds(&self, now_ms: u64) -> bool {
        now_ms < self.until_ms
    }
}

impl InFlight {
    pub(super) fn backup_record_done(&mut self, seq: u64, failed: bool) {
        let Some(open) = self.backups.iter_mut().find(|b| b.seq == seq) else {
            return;
        };
        open.remaining = open.remaining.saturating_sub(1);
        open.failed |= failed;
        self.report_backups();
    }

    /// Reports the backups whose records are all delivered, oldest first, up to
    /// the first that still waits for one.
    pub(super) fn report_backups(&mut self) {
        while let Some(open) = self.backups.front().filter(|b| b.remaining == 0).copied() {
            self.backups.pop_front();
            self.acks.push(if open.failed {
                Ack::BackupFailed(open.seq)
            } else {
                Ack::BackupWritten(open.seq)
            });
        }
    }
}

/// How long an output or a dead letter waits on a full producer queue. The
/// queue drains as the broker acknowledges, and a task has at most γ outputs
/// unacknowledged, so a queue full this long means the broker is not taking
/// records: the send fails (and the task with it) instead of holding the loop,
/// and with it a stop, for as long as the outage lasts.
pub(super) const SEND_PATIENCE: Duration = Duration::from_secs(10);

/// Sends an output or a dead letter, waiting on the producer's queue while it
/// is full, up to [`SEND_PATIENCE`].
pub(super) fn send(
    producer: &BaseProducer<DeliveryReports>,
    mut record: BaseRecord<'_, [u8], [u8], usize>,
) -> Result<(), KafkaError> {
    let started = Instant::now();
    loop {
        match producer.send(record) {
            Ok(()) => return Ok(()),
            Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back))
                if started.elapsed() < SEND_PATIENCE =>
            {
                producer.poll(Duration::from_millis(5));
                record = back;
            }
            Err((error, _)) => return Err(error),
        }
    }
}

/// Sends a failed output or dead letter again, as it was.
pub(super) fn resend(
    producer: &BaseProducer<DeliveryReports>,
    delivery: Delivery,
    failed: &FailedRecord,
) -> Result<(), KafkaError> {
    let mut record = BaseRecord::with_opaque_to(&failed.topic, delivery.pack());
    if let Some(key) = &failed.key {
        record = record.key(key.as_slice());
    }
    if let Some(value) = &failed.value {
        record = record.payload(value.as_slice());
    }
    if let Some(headers) = &failed.headers {
        record = record.headers(headers.clone());
    }
    send(producer, record)
}

/// A failed send, said for a log: a full queue is an outage.
pub(super) fn send_failure(error: &KafkaError) -> String {
    if is_queue_full(error) {
        format!("the producer's queue stayed full for {SEND_PATIENCE:?}: the broker is not taking records ({error})")
    } else {
        error.to_string()
    }
}

/// Whether a send failed only because the producer's queue is full.
pub(super) fn is_queue_full(error: &KafkaError) -> bool {
    matches!(error, KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull))
}

/// The Kafka side of one task, handed to its driver for one call.
pub(super) struct KafkaIo<'a, O> {
    pub(super) shared: &'a TaskEnv<'a>,
    pub(super) partition: i32,
    /// The task's run, named on every record it sends.
    pub(super) incarnation: TaskIncarnation,
    pub(super) in_flight: &'a mut InFlight,
    pub(super) key: &'a mut Vec<u8>,
    pub(super) value: &'a mut Vec<u8>,
    /// The records being processed, as they came (for dead letters).
    pub(super) records: RawRecords<'a>,
    pub(super) operator: PhantomData<O>,
}

/// Sends one record to a task's changelog partition (a tombstone when the
/// entry has no value), without waiting: a full queue is the caller's to
/// handle ([`is_queue_full`]).
pub(super) fn send_to_changelog(
    shared: &TaskEnv<'_>,
    partition: i32,
    entry: &BackupEntry,
    delivery: Delivery,
) -> Result<(), KafkaError> {
    #[cfg(feature = "fault-injection")]
    {
        release_held_changelog_records(shared);
        if super::faults::changelog_record_held(partition, entry, delivery) {
            return Ok(());
        }
    }
    produce_to_changelog(shared, partition, entry, delivery)
}

/// Sends what [`super::faults::FAULT_HOLD_CHANGELOG`] held back, once it no
/// longer holds (test builds only).
#[cfg(feature = "fault-injection")]
pub(super) fn release_held_changelog_records(shared: &TaskEnv<'_>) {
    super::faults::release_held_changelog(|partition, entry, delivery| {
        produce_to_changelog(shared, partition, entry, delivery)
    });
}

fn produce_to_changelog(
    shared: &TaskEnv<'_>,
    partition: i32,
    entry: &BackupEntry,
    delivery: Delivery,
) -> Result<(), KafkaError> {
    let mut record = BaseRecord::with_opaque_to(&shared.topics.changelog, delivery.pack())
        .partition(partition)
        .key(&entry.key[..]);
    if let Some(value) = &entry.value {
        record = record.payload(&value[..]);
    }
    shared.changelog_producer.send(record).map_err(|(error, _)| error)
}

/// What of an oversized output its dead letter keeps: enough to tell which
/// output it was, well under any broker's record limit.
const OVERSIZED_KEPT: usize = 1024;

/// What of a record too large to forward its dead letter keeps.
fn first_bytes(part: Option<&[u8]>) -> Option<&[u8]> {
    part.map(|bytes| &bytes[..bytes.len().min(OVERSIZED_KEPT)])
}

/// The headers of a dead letter: the input record it comes from and why.
fn dead_letter_headers(input: &str, partition: i32, offset: u64, reason: &str) -> OwnedHeaders {
    let (partition, offset) = (partition.to_string(), offset.to_string());
    OwnedHeaders::new_with_capacity(4)
        .insert(Header {
            key: DEAD_LETTER_TOPIC_HEADER,
            value: Some(input),
        })
        .insert(Header {
            key: DEAD_LETTER_PARTITION_HEADER,
            value: Some(partition.as_str()),
        })
        .insert(Header {
            key: DEAD_LETTER_OFFSET_HEADER,
            value: Some(offset.as_str()),
        })
        .insert(Header {
            key: DEAD_LETTER_REASON_HEADER,
            value: Some(reason),
        })
}

impl<O: ServiceOperator> KafkaIo<'_, O> {
    /// Sends the dead letter of the refused input record at `offset`.
    fn send_dead_letter(
        &self,
        delivery: Delivery,
        offset: u64,
        (key, value): RawRecord<'_>,
        reason: &str,
    ) -> Result<(), KafkaError> {
        let topics = self.shared.topics;
        let headers = dead_letter_headers(&topics.input, self.partition, offset, reason);
        let mut record = BaseRecord::with_opaque_to(&topics.dead_letters, delivery.pack()).headers(headers);
        if let Some(key) = key {
            record = record.key(key);
        }
        if let Some(value) = value {
            record = record.payload(value);
        }
        send(self.shared.producer, record)
    }

    /// A record of the item at `offset` could not be sent: the task ends
    /// with this error.
    fn send_failed(&mut self, what: &str, topic: &str, offset: u64, error: &KafkaError) {
        self.in_flight.fatal.get_or_insert(format!(
            "producing {what} to {topic} (input partition {}, offset {offset}): {}",
            self.partition,
            send_failure(error)
        ));
    }

    /// An output larger than the producer's `message.max.bytes` would stop the
    /// task at every restart (the replay makes it again): it goes to the
    /// dead-letter topic instead, cut to its first bytes, with the reason and
    /// the input record it came from. The dead letter carries the output's
    /// delivery, so its acknowledgement counts as the output's.
    fn dead_letter_oversized(&mut self, item_offset: u64, keyed: bool, delivery: Delivery) {
        let size = self.key.len() * usize::from(keyed) + self.value.len();
        let reason = format!(
            "an output of {size} bytes is over the producer's message.max.bytes; its first {} bytes of value \
             (and of key) are kept here",
            OVERSIZED_KEPT
        );
        tracing::warn!(
            partition = self.partition,
            offset = item_offset,
            size,
            "output too large for the broker; it goes to the dead-letter topic {}",
            self.shared.topics.dead_letters
        );
        let topics = self.shared.topics;
        let headers = dead_letter_headers(&topics.input, self.partition, item_offset, &reason);
        let mut record = BaseRecord::with_opaque_to(&topics.dead_letters, delivery.pack()).headers(headers);
        if let Some(value) = first_bytes(Some(self.value.as_slice())) {
            record = record.payload(value);
        }
        if let Some(key) = first_bytes(keyed.then_some(self.key.as_slice())) {
            record = record.key(key);
        }
        if let Err(error) = send(self.shared.producer, record) {
            self.send_failed(
                "the dead letter of an oversized output",
                &topics.dead_letters,
                item_offset,
                &error,
            );
        }
    }
}

impl<O: ServiceOperator> TaskIo<O::Output> for KafkaIo<'_, O> {
    fn send_output(&mut self, item_offset: u64, output: O::Output) {
        if self.in_flight.fatal.is_some() {
            // The task ends with that error; each further send would wait its
            // patience on the same full queue.
            return;
        }
        let keyed = match self.shared.codec.encode::<O>(&output, self.key, self.value) {
            Ok(keyed) => keyed,
            Err(error) => {
                self.in_flight.fatal.get_or_insert(format!(
                    "encoding an output (input partition {}, offset {item_offset}): {error}",
                    self.partition
                ));
                return;
            }
        };
        let delivery = Delivery::Output {
            task: self.incarnation,
            offset: item_offset,
        };
        let mut record =
            BaseRecord::with_opaque_to(&self.shared.topics.output, delivery.pack()).payload(self.value.as_slice());
        if self.shared.source_positions {
            let position = self.in_flight.positions.next(item_offset).encode();
            record = record.headers(OwnedHeaders::new_with_capacity(1).insert(Header {
                key: SOURCE_POSITION_HEADER,
                value: Some(position.as_bytes()),
            }));
        }
        if keyed {
            record = record.key(self.key.as_slice());
        }
        match send(self.shared.producer, record) {
            Ok(()) => {}
            Err(KafkaError::MessageProduction(RDKafkaErrorCode::MessageSizeTooLarge)) => {
                self.dead_letter_oversized(item_offset, keyed, delivery);
            }
            Err(error) => self.send_failed("an output", &self.shared.topics.output, item_offset, &error),
        }
    }

    fn write_backup(&mut self, seq: u64, records: &BackupBatch) {
        self.in_flight.backups.push_back(OpenBackup {
            seq,
            remaining: records.len(),
            failed: false,
        });
        if records.is_empty() {
            // Nothing to deliver: written once the backups before it are.
            self.in_flight.report_backups();
            return;
        }
        let delivery = Delivery::BackupRecord {
            task: self.incarnation,
            seq,
        };
        self.in_flight
            .changelog
            .extend(records.iter().map(|record| (record.to_entry(), delivery)));
    }

    fn write_marker(&mut self, marker: &BackupMarker) {
        let delivery = Delivery::Marker {
            task: self.incarnation,
            seq: marker.seq,
        };
        self.in_flight.changelog.push((marker.to_entry(), delivery));
    }

    fn commit(&mut self, offset: u64) {
        let mut tpl = TopicPartitionList::new();
        let stored = tpl
            .add_partition_offset(&self.shared.topics.input, self.partition, Offset::Offset(offset as i64))
            .and_then(|()| self.shared.consumer.store_offsets(&tpl));
        if let Err(error) = stored {
            tracing::warn!(partition = self.partition, offset, %error, "storing the group's offset");
        }
    }

    fn rejected(&mut self, offset: u64, reason: &Rejected) -> u64 {
        if self.in_flight.fatal.is_some() {
            // The task ends with that error (see `send_output`).
            return 0;
        }
        let topics = self.shared.topics;
        tracing::warn!(
            partition = self.partition, offset, %reason,
            "input record refused; it goes to the dead-letter topic {}", topics.dead_letters
        );
        let (key, value) = self.records.get(offset).unwrap_or_else(|| {
            tracing::error!(
                partition = self.partition,
                offset,
                "the refused record is not in its batch; its dead letter is empty"
            );
            (None, None)
        });
        let delivery = Delivery::DeadLetter {
            task: self.incarnation,
            offset,
        };
        let reason = reason.to_string();
        let sent = match self.send_dead_letter(delivery, offset, (key, value), &reason) {
            // Too large to forward whole: its first bytes, and why.
            Err(KafkaError::MessageProduction(RDKafkaErrorCode::MessageSizeTooLarge)) => {
                let size = key.map_or(0, <[u8]>::len) + value.map_or(0, <[u8]>::len);
                let reason = format!(
                    "{reason}; the record of {size} bytes is over the producer's message.max.bytes: its first \
                     {OVERSIZED_KEPT} bytes of value (and of key) are kept here"
                );
                self.send_dead_letter(delivery, offset, (first_bytes(key), first_bytes(value)), &reason)
            }
            other => other,
        };
        if let Err(error) = sent {
            self.send_failed("a dead letter", &topics.dead_letters, offset, &error);
        }
        self.in_flight.dead_letters_in_flight += 1;
        1
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::service::delivery::is_permanent;
    use rdkafka::error::RDKafkaErrorCode;

    #[test]
    fn a_report_names_the_incarnation_that_sent_its_record() {
        // Routing by incarnation (the task manager's) needs the packed
        // opaque to carry it whole, across the wrap.
        let old = TaskIncarnation(u16::MAX);
        let new = old.next();
        assert_eq!(new, TaskIncarnation(0), "wraps");
        for task in [old, new] {
            let report = Delivery::unpack(Delivery::Marker { task, seq: 1 }.pack());
            assert_eq!(report.task(), task);
        }
    }

    #[test]
    fn an_items_outputs_are_numbered_from_zero_and_tasks_have_their_own_source() {
        let mut positions = OutputPositions::new("g", "lines", 0);
        let numbered: Vec<(u64, u32)> = [7, 7, 7, 9, 12, 12]
            .into_iter()
            .map(|offset| positions.next(offset))
            .map(|p| (p.offset, p.index))
            .collect();
        assert_eq!(numbered, [(7, 0), (7, 1), (7, 2), (9, 0), (12, 0), (12, 1)]);
        let source = positions.next(13).source;
        assert_eq!(OutputPositions::new("g", "lines", 0).next(0).source, source, "stable");
        for other in [
            OutputPositions::new("g", "lines", 1),
            OutputPositions::new("h", "lines", 0),
            OutputPositions::new("g", "words", 0),
        ] {
            assert_ne!(other.clone().next(0).source, source);
        }
    }

    #[test]
    fn backups_in_flight_are_reported_in_the_order_written() {
        let mut in_flight = InFlight::default();
        for (seq, remaining) in [(1, 2), (3, 0), (5, 1)] {
            in_flight.backups.push_back(OpenBackup {
                seq,
                remaining,
                failed: false,
            });
        }
        in_flight.report_backups();
        assert!(
            in_flight.acks.is_empty(),
            "an empty backup waits for the one before it: an acknowledgement covers every backup before it"
        );
        in_flight.backup_record_done(5, true);
        assert!(in_flight.acks.is_empty(), "{:?}", in_flight.acks);
        in_flight.backup_record_done(1, false);
        in_flight.backup_record_done(1, false);
        assert_eq!(
            in_flight.acks,
            [Ack::BackupWritten(1), Ack::BackupWritten(3), Ack::BackupFailed(5)]
        );
        assert!(in_flight.backups.is_empty());
    }

    #[test]
    fn a_failing_broker_is_retried_with_a_doubling_backoff_that_resets_on_success() {
        let mut backoff = RetryBackoff::default();
        assert!(!backoff.holds(0));
        let mut now = 1_000;
        let mut waits = Vec::new();
        for _ in 0..8 {
            backoff.failed(now);
            assert!(backoff.holds(now));
            waits.push(backoff.until_ms - now);
            now = backoff.until_ms;
            assert!(!backoff.holds(now));
        }
        assert_eq!(waits, [100, 200, 400, 800, 1_600, 3_200, 5_000, 5_000]);
        backoff.succeeded();
        backoff.failed(now);
        assert_eq!(backoff.until_ms - now, 100, "a success starts the backoff over");
        // Failures reported together do not shorten a wait already running.
        let until = backoff.until_ms;
        backoff.failed(now - 50);
        assert!(backoff.until_ms >= until);
    }

    #[test]
    fn only_refusals_for_good_stop_the_service() {
        for code in [
            RDKafkaErrorCode::MessageSizeTooLarge,
            RDKafkaErrorCode::TopicAuthorizationFailed,
            RDKafkaErrorCode::UnknownTopic,
        ] {
            assert!(is_permanent(code), "{code:?}");
        }
        for code in [
            RDKafkaErrorCode::MessageTimedOut,
            RDKafkaErrorCode::AllBrokersDown,
            RDKafkaErrorCode::NotLeaderForPartition,
            RDKafkaErrorCode::Unknown,
        ] {
            assert!(!is_permanent(code), "{code:?}");
        }
    }
}
