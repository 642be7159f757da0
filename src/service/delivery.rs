//! What a produced record is for and who sent it, and the delivery reports
//! that say whether it landed. A report names the task incarnation that sent
//! its record, so that only that run of the task acts on it (the task
//! manager routes by incarnation, never by partition).

use std::sync::Mutex;

use rdkafka::client::ClientContext;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Message, OwnedHeaders};
use rdkafka::producer::{DeliveryResult, ProducerContext};

/// One run of a task in this process: every task start gets a new one, so a
/// delivery report names the run that sent its record. A report of a task
/// that was revoked, lost or restarted since is nobody's: its sequences and
/// offsets mean nothing to the task that owns the partition now. Wraps after
/// 65 536 starts, long after any report of a run could still arrive.
/// Process-local: the changelog numbers a partition's runs across processes
/// with the incarnation in its sequences ([`crate::core::fence`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct TaskIncarnation(pub u16);

impl TaskIncarnation {
    /// The incarnation after this one.
    pub fn next(self) -> Self {
        TaskIncarnation(self.0.wrapping_add(1))
    }
}

/// What a produced record is for, and which task incarnation sent it. Packed
/// into the `usize` the producer carries to the delivery report, so sending
/// allocates nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Delivery {
    /// An output of the input item at `offset`.
    Output { task: TaskIncarnation, offset: u64 },
    /// One record of backup `seq`.
    BackupRecord { task: TaskIncarnation, seq: u64 },
    /// The marker of backup `seq`.
    Marker { task: TaskIncarnation, seq: u64 },
    /// The dead letter of the refused input record at `offset`.
    DeadLetter { task: TaskIncarnation, offset: u64 },
}

const VALUE_BITS: u32 = 46;
const COUNTER_MASK: u64 = (1 << crate::core::fence::COUNTER_BITS) - 1;
const TASK_BITS: u32 = 16;

impl Delivery {
    /// The largest offset or sequence number that packs.
    pub const MAX_VALUE: u64 = (1 << VALUE_BITS) - 1;

    /// A changelog record's sequence packs as its place within its
    /// incarnation ([`crate::core::fence`]): [`Delivery::in_incarnation_of`]
    /// gives it back its incarnation.
    pub fn pack(self) -> usize {
        let (kind, task, value) = match self {
            Delivery::Output { task, offset } => (0u64, task, offset),
            Delivery::BackupRecord { task, seq } => (1, task, seq & COUNTER_MASK),
            Delivery::Marker { task, seq } => (2, task, seq & COUNTER_MASK),
            Delivery::DeadLetter { task, offset } => (3, task, offset),
        };
        ((kind << (VALUE_BITS + TASK_BITS)) | (u64::from(task.0) << VALUE_BITS) | (value & Self::MAX_VALUE)) as usize
    }

    /// The delivery with a changelog record's sequence in the incarnation of
    /// `seq`: that of the task the report reached, which sent it.
    pub fn in_incarnation_of(self, seq: u64) -> Self {
        let full = |of: u64| (seq & !COUNTER_MASK) | (of & COUNTER_MASK);
        match self {
            Delivery::BackupRecord { task, seq: of } => Delivery::BackupRecord { task, seq: full(of) },
            Delivery::Marker { task, seq: of } => Delivery::Marker { task, seq: full(of) },
            other => other,
        }
    }

    /// The task incarnation that sent the record.
    pub fn task(self) -> TaskIncarnation {
        match self {
            Delivery::Output { task, .. }
            | Delivery::BackupRecord { task, .. }
            | Delivery::Marker { task, .. }
            | Delivery::DeadLetter { task, .. } => task,
        }
    }

    pub fn unpack(packed: usize) -> Self {
        let packed = packed as u64;
        let value = packed & Self::MAX_VALUE;
        let task = TaskIncarnation(((packed >> VALUE_BITS) & ((1 << TASK_BITS) - 1)) as u16);
        match packed >> (VALUE_BITS + TASK_BITS) {
            0 => Delivery::Output { task, offset: value },
            1 => Delivery::BackupRecord { task, seq: value },
            2 => Delivery::Marker { task, seq: value },
            _ => Delivery::DeadLetter { task, offset: value },
        }
    }
}

/// A failed record, kept so that an output or a dead letter can be sent again.
#[derive(Clone, Debug)]
pub struct FailedRecord {
    pub error: String,
    pub code: Option<RDKafkaErrorCode>,
    pub topic: String,
    pub partition: i32,
    pub key: Option<Vec<u8>>,
    pub value: Option<Vec<u8>>,
    pub headers: Option<OwnedHeaders>,
}

/// Whether a failed delivery would fail again however often it is sent: the
/// record or the topic is refused for good (too large, invalid, not allowed,
/// gone). Everything else (timeouts, a broker away, leadership moving) may
/// pass, so it is sent again.
pub fn is_permanent(code: RDKafkaErrorCode) -> bool {
    matches!(
        code,
        RDKafkaErrorCode::MessageSizeTooLarge
            | RDKafkaErrorCode::InvalidMessageSize
            | RDKafkaErrorCode::MessageBatchTooLarge
            | RDKafkaErrorCode::InvalidRecord
            | RDKafkaErrorCode::InvalidTopic
            | RDKafkaErrorCode::TopicAuthorizationFailed
            | RDKafkaErrorCode::ClusterAuthorizationFailed
            | RDKafkaErrorCode::UnknownTopic
            | RDKafkaErrorCode::UnknownPartition
    )
}

/// A delivery report.
#[derive(Clone, Debug)]
pub struct DeliveryEvent {
    pub delivery: Delivery,
    pub failure: Option<FailedRecord>,
}

/// Collects delivery reports; the task loop drains them after each producer poll.
#[derive(Default)]
pub struct DeliveryReports {
    events: Mutex<Vec<DeliveryEvent>>,
}

impl DeliveryReports {
    pub fn drain_into(&self, out: &mut Vec<DeliveryEvent>) {
        if let Ok(mut events) = self.events.lock() {
            out.append(&mut events);
        }
    }
}

impl ClientContext for DeliveryReports {
    fn error(&self, error: KafkaError, reason: &str) {
        super::metrics::broker_error("producer", &error, reason);
    }
}

impl ProducerContext for DeliveryReports {
    type DeliveryOpaque = usize;

    fn delivery(&self, result: &DeliveryResult<'_>, packed: usize) {
        let failure = match result {
            Ok(_) => None,
            Err((error, message)) => Some(FailedRecord {
                error: error.to_string(),
                code: error.rdkafka_error_code(),
                topic: message.topic().to_string(),
                partition: message.partition(),
                key: message.key().map(<[u8]>::to_vec),
                value: message.payload().map(<[u8]>::to_vec),
                headers: message.headers().map(|headers| headers.detach()),
            }),
        };
        if let Ok(mut events) = self.events.lock() {
            events.push(DeliveryEvent {
                delivery: Delivery::unpack(packed),
                failure,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deliveries_pack_into_a_usize_and_back() {
        for delivery in [
            Delivery::Output {
                task: TaskIncarnation(0),
                offset: 0,
            },
            Delivery::Output {
                task: TaskIncarnation(u16::MAX),
                offset: Delivery::MAX_VALUE,
            },
            Delivery::BackupRecord {
                task: TaskIncarnation(7),
                seq: 123_456,
            },
            Delivery::Marker {
                task: TaskIncarnation(3),
                seq: 9,
            },
            Delivery::DeadLetter {
                task: TaskIncarnation(u16::MAX),
                offset: 17,
            },
        ] {
            assert_eq!(Delivery::unpack(delivery.pack()), delivery);
        }
    }

    #[test]
    fn a_changelog_sequence_of_any_incarnation_comes_back_whole() {
        let shift = crate::core::fence::COUNTER_BITS;
        let seq = (5_000_000 << shift) | 77;
        let task = TaskIncarnation(4);
        for delivery in [Delivery::BackupRecord { task, seq }, Delivery::Marker { task, seq }] {
            let reported = Delivery::unpack(delivery.pack());
            assert_eq!(reported.in_incarnation_of((5_000_000 << shift) | 3), delivery);
        }
        let output = Delivery::Output { task, offset: 12 };
        assert_eq!(output.in_incarnation_of(seq), output);
    }
}
