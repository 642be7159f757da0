//! Fencing: one writer per changelog partition, whatever the broker lets
//! through late.
//!
//! A previous owner of a partition can still be writing its changelog after
//! a new owner has restored from it: a member that stalled past its session
//! and was dropped from the group, or a revoked task whose queued records
//! land after the partition moved. Its records and markers, landing behind
//! the new owner's, would otherwise make the next recovery resume at the old
//! owner's offset over a mix of both states. The broker offers no fence here
//! (no transactions are assumed), so the log carries one.
//!
//! **Incarnations.** Every start of a task (a recovery, a restart on a local
//! store, a first start) is a new incarnation, numbered above every one its
//! changelog holds. A backup's sequence number carries its writer's
//! incarnation in its high bits (`incarnation << COUNTER_BITS | n`), so every
//! changelog record and marker names its writer without a change of format,
//! sequences still grow across runs, and a log written before incarnations
//! existed reads as incarnation 0. Every marker also carries what its
//! incarnation inherited: the last backup of earlier incarnations that the
//! state it restored includes (every one, `u64::MAX`, when it restored the
//! log as it was, or started on its own local store).
//!
//! **Which records a recovery uses.** A record is *admitted* when
//!
//! 1. no record before it in the log belongs to a newer incarnation (a newer
//!    incarnation had started when it landed: it was written by a zombie,
//!    and nobody restored from it); and
//! 2. relative to the marker the recovery resumes from (incarnation I,
//!    inheriting backups up to h): its incarnation is not older than I, or
//!    its backup is at most h. An older record above h was written after
//!    the state I restored (I rewrote the keys it restored from priors, so
//!    the older record is not the key's latest unless a zombie wrote it).
//!    A newer one belongs to a start that wrote no marker: it is past the
//!    marker and restores as its prior ([`crate::logged`]), which survives
//!    compaction because it travels in the record itself.
//!
//! The marker a recovery resumes from is the last one rule 1 admits, so a
//! zombie's marker is never it. A recovery leaves out what is not admitted,
//! and writes every key whose latest record it left out again, at the value
//! it restored, before its start marker: the fenced record stops being the
//! key's latest, and compaction removes it. Why that is enough:
//! a zombie's records landing after the new incarnation's first record fail
//! rule 1 forever; those landing earlier but after its restore read fail
//! rule 2 under its markers (they are above what it inherited); and the next
//! incarnation rewrites their keys, so when its own markers inherit past
//! them they are no key's latest any more.
//!
//! What this cannot undo: a zombie's record supersedes the new owner's
//! record of the same key at once, and compaction may remove the new
//! owner's record before the next recovery reads the log. That key then has
//! no admitted record and restores as absent. Kafka keeps a record from
//! compaction for `min.compaction.lag.ms` and never compacts the active
//! segment; a recovery counts the records it fenced so that this shows.

/// The low bits of a sequence number count the backups of one incarnation:
/// 2^40 of them (over 30 years at 1 000 backups a second).
pub const COUNTER_BITS: u32 = 40;

/// The incarnation that wrote the backup or marker with sequence `seq`.
#[inline]
pub fn incarnation(seq: u64) -> u64 {
    seq >> COUNTER_BITS
}

/// The first sequence of the incarnation after the one that wrote `seq`:
/// above every sequence of `seq`'s incarnation and of those before it.
/// Counters start at 1 (0 is the certain prior, [`crate::logged::CERTAIN`]).
/// After the last incarnation (2^24 starts of one partition) starts reuse
/// it: its records then fence nothing, as before incarnations existed.
pub fn next_incarnation(seq: u64) -> u64 {
    let next = (incarnation(seq) + 1).min(LAST_INCARNATION);
    (next << COUNTER_BITS) | 1
}

/// The newest incarnation a sequence can name.
const LAST_INCARNATION: u64 = u64::MAX >> COUNTER_BITS;

/// Rule 1: the newest incarnation seen so far in log order.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LogOrder {
    newest: u64,
}

impl LogOrder {
    /// Takes the sequence of the log's next record; whether no record before
    /// it belongs to a newer incarnation.
    #[inline]
    pub fn admits(&mut self, seq: u64) -> bool {
        let of = incarnation(seq);
        if of < self.newest {
            return false;
        }
        self.newest = of;
        true
    }
}

/// Rule 2, for the marker a recovery resumes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fence {
    /// The marker's incarnation.
    incarnation: u64,
    /// The last backup of earlier incarnations its state includes.
    inherited: u64,
}

impl Fence {
    /// No marker: every record is used as it is.
    pub const NONE: Fence = Fence {
        incarnation: 0,
        inherited: u64::MAX,
    };

    /// The fence of a recovery that resumes from the marker of sequence
    /// `marker_seq` whose incarnation inherited backups up to `inherited`.
    pub fn new(marker_seq: u64, inherited: u64) -> Self {
        Fence {
            incarnation: incarnation(marker_seq),
            inherited,
        }
    }

    /// Whether a record of backup `seq` belongs to the state logged at the
    /// marker (covered or not: [`crate::logged`] decides that).
    #[inline]
    pub fn admits(&self, seq: u64) -> bool {
        incarnation(seq) >= self.incarnation || seq <= self.inherited
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequences_carry_their_incarnation_and_grow_across_incarnations() {
        let first = next_incarnation(0);
        assert_eq!(incarnation(first), 1);
        assert_eq!(first & ((1 << COUNTER_BITS) - 1), 1);
        let second = next_incarnation(first + 500);
        assert_eq!(incarnation(second), 2);
        assert!(second > first + 500);
        // A log written before incarnations: its sequences are incarnation 0.
        assert_eq!(incarnation(123_456), 0);
        let last = next_incarnation(u64::MAX);
        assert_eq!(incarnation(last), LAST_INCARNATION);
        assert_eq!(next_incarnation(last), last);
    }

    #[test]
    fn a_record_behind_a_newer_incarnation_is_not_admitted() {
        let (one, two) = (1 << COUNTER_BITS, 2 << COUNTER_BITS);
        let mut order = LogOrder::default();
        assert!(order.admits(one | 5));
        assert!(order.admits(two | 1));
        assert!(!order.admits(one | 6));
        assert!(order.admits(two | 2));
    }

    #[test]
    fn under_a_marker_older_records_count_up_to_what_it_inherited() {
        let (one, two, three) = (1 << COUNTER_BITS, 2 << COUNTER_BITS, 3 << COUNTER_BITS);
        let fence = Fence::new(two | 4, one | 7);
        assert!(fence.admits(one | 7));
        assert!(!fence.admits(one | 8));
        assert!(fence.admits(two | 9));
        assert!(fence.admits(three | 1), "a later start's record: past the marker");
        assert!(Fence::NONE.admits(one | 8));
    }
}
