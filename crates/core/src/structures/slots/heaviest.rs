//! A drifted L1 or L2 backup: the largest drifts until what stays unwritten
//! is within θ·WRITE_FRACTION.
//!
//! Drifts are ranked by binary order of magnitude (their *class*), not
//! sorted: whole classes are taken from the largest down, and the class
//! where the cut falls is taken in part, so each record written removes at
//! least half as much drift as the best choice would.
//!
//! The slots a backup leaves unwritten are *cold*: still dirty, kept apart in
//! a bucket per class with each class's sum, so that the next backup ranks
//! only the slots changed since (the hot list) and reads a cold one only to
//! take it. Every change to a cold slot makes it hot again and takes its
//! term out of its class, so a cold slot's drift is what it was when it
//! cooled: its class is the bucket's, and the buckets' sums with the hot
//! list's are the sums a full ranking would find. Without this, every
//! backup read every slot changed since it was last written (one random
//! memory access each), though most stay unwritten backup after backup.
//!
//! A slot that leaves the cold state (changed, written as owed, restored)
//! leaves its entry behind: an entry counts only while its slot is cold and
//! its drift is still of the bucket's class, and a slot that cooled twice in
//! one class is taken or kept once. A bucket holding more than four times
//! its cold slots is compacted, so stale entries stay a bounded share: a
//! compaction reads every entry, and where most cold slots change again
//! before a backup takes them (SGD's weights) compacting at twice cost
//! more than reading past the stale entries.
//!
//! A bucket is in the order its slots cooled. The class cut in part is
//! taken from the front, and only as far as it is taken: the slots behind
//! are not read. So a slot that cools again in a class whose bucket still
//! holds an entry of an earlier stay there counts from that entry and may
//! go before its turn; this is an order of preference, not a rule of the
//! bound, and reading the whole bucket every backup cost more than the
//! records it saved.

use super::bucket::Bucket;
use super::{DriftSlots, COLD, DIRTY, OWED};
use crate::structures::prefetch::fetch_ahead;
use crate::structures::Norm;

/// Drift classes for ranking a backup's candidates: binary orders of magnitude
/// from 2^-64 up, the smaller in the first, the larger in the last.
const DRIFT_CLASSES: usize = 128;

/// A set of drift classes, visited from the largest down: a backup goes
/// through the classes that hold drift, not through all of them (a backup of
/// a few records would otherwise spend most of its time on empty classes).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct ClassSet([u64; 2]);

const _: () = assert!(DRIFT_CLASSES == 2 * u64::BITS as usize);

impl ClassSet {
    // Two words, not a u128: a shift by a variable amount of a u128 is
    // several instructions, and a set is added to once per ranked slot.
    fn insert(&mut self, class: usize) {
        self.0[class >> 6] |= 1 << (class & 63);
    }

    fn remove(&mut self, class: usize) {
        self.0[class >> 6] &= !(1 << (class & 63));
    }

    /// The classes whose sum differs between `before` and `after`: those
    /// the drifts added in between fell in (a term of a class changes a
    /// sum of that class's terms). Built once a backup from the sums, not
    /// slot by slot: a set added to for every ranked slot cost a dozen
    /// instructions each (44 M for logistic regression's 3.5 M on four
    /// tasks).
    fn grown(before: &[f64; DRIFT_CLASSES], after: &[f64; DRIFT_CLASSES]) -> ClassSet {
        let mut set = ClassSet::default();
        for (class, (was, is)) in before.iter().zip(after).enumerate() {
            if was != is {
                set.insert(class);
            }
        }
        set
    }

    fn union(self, other: ClassSet) -> ClassSet {
        ClassSet([self.0[0] | other.0[0], self.0[1] | other.0[1]])
    }

    /// The classes in the set, the largest first.
    fn descending(self) -> impl Iterator<Item = usize> {
        let [low, high] = self.0;
        descending_bits(high).map(|bit| bit + 64).chain(descending_bits(low))
    }
}

/// The set bits of a word, the highest first.
fn descending_bits(word: u64) -> impl Iterator<Item = usize> {
    let mut rest = word;
    std::iter::from_fn(move || {
        let bit = (u64::BITS - 1).checked_sub(rest.leading_zeros())? as usize;
        rest &= !(1 << bit);
        Some(bit)
    })
}

/// A bucket is compacted when its entries exceed four times its cold slots and this.
const STALE_FACTOR: usize = 4;
const STALE_SLACK: usize = 64;

/// The class of a drift's norm term: its binary exponent, clamped to the classes.
fn drift_class(term: f64) -> usize {
    let exponent = ((term.to_bits() >> 52) & 0x7ff) as i64 - 1023;
    (exponent + 64).clamp(0, DRIFT_CLASSES as i64 - 1) as usize
}

/// The cold slots by class (see the module docs).
#[derive(Clone, Debug)]
pub(super) struct ColdSlots {
    buckets: Vec<Bucket>,
    /// Per class, the sum of its cold slots' terms.
    sums: [f64; DRIFT_CLASSES],
    /// Per class, how many slots are cold in it (its entries may be more).
    counts: [usize; DRIFT_CLASSES],
    /// The classes whose buckets hold entries.
    occupied: ClassSet,
}

impl Default for ColdSlots {
    fn default() -> Self {
        ColdSlots {
            buckets: vec![Bucket::default(); DRIFT_CLASSES],
            sums: [0.0; DRIFT_CLASSES],
            counts: [0; DRIFT_CLASSES],
            occupied: ClassSet::default(),
        }
    }
}

impl DriftSlots {
    /// L1 and L2 with θ set: the owed slots, then the dirty slots of largest
    /// drift until what stays unwritten is within θ·WRITE_FRACTION (see
    /// `sum_within`); the rest stay dirty, cold. A skewed stream's few hot
    /// keys carry most of the drift, so this writes far fewer records than
    /// every change.
    pub(super) fn take_heaviest(&mut self, indices: &mut Vec<u32>) {
        let mut remaining = self.sum;
        for position in 0..self.owed.len() {
            let index = self.owed[position];
            self.forget_cold(index);
            self.flags[index as usize] &= !(OWED | DIRTY);
            remaining -= self.norm_term(index);
            indices.push(index);
        }
        self.owed.clear();
        let target = self.sum_within(self.write_threshold());
        let mut class_sums = self.cold.sums;
        let mut ranked = std::mem::take(&mut self.ranked);
        ranked.clear();
        self.rank_hot(&mut ranked, &mut class_sums);
        let everything = !remaining.is_finite();
        let cutoff = if everything {
            0
        } else {
            let hot_classes = ClassSet::grown(&self.cold.sums, &class_sums);
            let classes = self.cold.occupied.union(hot_classes);
            cutoff_class(&class_sums, classes, &mut remaining, target)
        };
        // Of the class cut in part, the slots cold longest go first: a slot
        // changed lately is the likelier to change again and be written
        // twice.
        self.take_cold(indices, cutoff, &mut remaining, target, everything);
        for &(index, class, term) in &ranked {
            let class = usize::from(class);
            let take = everything || class > cutoff || (class == cutoff && remaining > target);
            if take {
                if class == cutoff {
                    remaining -= term;
                }
                indices.push(index);
            } else {
                self.cool(index, class, term);
            }
        }
        self.ranked = ranked;
    }

    /// One pass over the hot list: reads each slot once, takes its dirty
    /// flag (a slot listed twice is ranked once: a restore or an owed-only
    /// backup may have cleaned a listed slot that changed again) and keeps
    /// its term and class beside its index, its term added to its class's
    /// sum. The list is emptied.
    fn rank_hot(&mut self, ranked: &mut Vec<(u32, u8, f64)>, class_sums: &mut [f64; DRIFT_CLASSES]) {
        for position in 0..self.dirty.len() {
            let index = self.dirty[position];
            fetch_ahead(position, |step| self.prefetch_slot(self.dirty.get(step)));
            if self.has(index, DIRTY) {
                self.flags[index as usize] &= !DIRTY;
                let term = self.norm_term(index);
                let class = drift_class(term);
                class_sums[class] += term;
                ranked.push((index, class as u8, term));
            }
        }
        self.dirty.clear();
    }

    /// Takes the cold slots of the classes over `cutoff`, then those of the
    /// cutoff class while more than `target` stays unwritten (every one when
    /// `everything`).
    fn take_cold(&mut self, indices: &mut Vec<u32>, cutoff: usize, remaining: &mut f64, target: f64, everything: bool) {
        for class in self.cold.occupied.descending() {
            if !everything && class < cutoff {
                break;
            }
            if everything || class > cutoff {
                self.sift_bucket(class, true, indices);
            } else {
                self.take_oldest(class, remaining, target, indices);
            }
        }
    }

    /// The class cut in part: its cold slots from the oldest on while more
    /// than `target` stays unwritten. The entries after the last one taken
    /// are not read: a skewed stream leaves thousands of slots of a drift or
    /// two cold in the class cut, backup after backup, and going through
    /// them all (one random memory access each) cost more than the records
    /// they saved.
    fn take_oldest(&mut self, class: usize, remaining: &mut f64, target: f64, indices: &mut Vec<u32>) {
        let mut bucket = std::mem::take(&mut self.cold.buckets[class]);
        let mut position = 0;
        while *remaining > target {
            // The bucket's front is the entry at `position`.
            fetch_ahead(position, |step| self.prefetch_slot(bucket.get(step - position)));
            let Some(index) = bucket.pop_front() else { break };
            position += 1;
            let Some(term) = self.cold_term(index, class) else {
                continue;
            };
            self.flags[index as usize] &= !(COLD | DIRTY);
            self.cold.sums[class] -= term;
            self.cold.counts[class] = self.cold.counts[class].saturating_sub(1);
            *remaining -= term;
            indices.push(index);
        }
        if bucket.is_empty() {
            self.cold.occupied.remove(class);
            self.cold.sums[class] = 0.0;
            self.cold.counts[class] = 0;
        }
        bucket.settle();
        self.cold.buckets[class] = bucket;
    }

    /// The term of a slot listed in `class`'s bucket, if the entry counts:
    /// the slot is cold and its drift still of that class.
    fn cold_term(&self, index: u32, class: usize) -> Option<f64> {
        if !self.has(index, COLD) {
            return None;
        }
        let term = self.norm_term(index);
        (drift_class(term) == class).then_some(term)
    }

    /// Every cold slot, whatever its class: a backup that writes every dirty
    /// slot.
    pub(super) fn take_all_cold(&mut self, indices: &mut Vec<u32>) {
        let mut remaining = 0.0;
        self.take_cold(indices, 0, &mut remaining, 0.0, true);
    }

    /// Goes through every entry of class `class` in order: a cold slot of the
    /// class is taken into `indices` when `take` (it is clean then) and stays
    /// otherwise; stale entries and repeats go. The class's sum and count
    /// are set from what stays.
    fn sift_bucket(&mut self, class: usize, take: bool, indices: &mut Vec<u32>) {
        let mut bucket = std::mem::take(&mut self.cold.buckets[class]);
        let entries = bucket.as_mut_slice();
        let (mut kept, mut sum) = (0, 0.0);
        for position in 0..entries.len() {
            let index = entries[position];
            fetch_ahead(position, |step| self.prefetch_slot(entries.get(step)));
            let Some(term) = self.cold_term(index, class) else {
                continue;
            };
            // Cold no more either way: a repeat of this slot further on is
            // skipped; those kept turn cold again below.
            self.flags[index as usize] &= !COLD;
            if take {
                self.flags[index as usize] &= !DIRTY;
                indices.push(index);
            } else {
                entries[kept] = index;
                kept += 1;
                sum += term;
            }
        }
        for &index in &entries[..kept] {
            self.flags[index as usize] |= COLD;
        }
        bucket.truncate(kept);
        if bucket.is_empty() {
            self.cold.occupied.remove(class);
        }
        self.cold.buckets[class] = bucket;
        self.cold.sums[class] = sum;
        self.cold.counts[class] = kept;
    }

    /// A ranked slot the backup leaves unwritten: dirty still, and cold.
    fn cool(&mut self, index: u32, class: usize, term: f64) {
        self.flags[index as usize] |= DIRTY | COLD;
        let cold = &mut self.cold;
        cold.buckets[class].push_back(index);
        cold.occupied.insert(class);
        cold.sums[class] += term;
        cold.counts[class] += 1;
        if cold.buckets[class].len() > STALE_FACTOR * cold.counts[class] + STALE_SLACK {
            self.sift_bucket(class, false, &mut Vec::new());
        }
    }

    /// A cold slot whose term was `term` changes: it is hot again, listed
    /// and dirty; its entry goes stale.
    #[inline]
    pub(super) fn reheat(&mut self, index: u32, term: f64) {
        self.leave_cold(index, term);
        self.dirty.push(index);
    }

    /// A slot about to be written as owed or restored leaves the cold state,
    /// if it is in it: its drift is still its cold term.
    pub(super) fn forget_cold(&mut self, index: u32) {
        if self.has(index, COLD) {
            let term = self.norm_term(index);
            self.leave_cold(index, term);
        }
    }

    fn leave_cold(&mut self, index: u32, term: f64) {
        self.flags[index as usize] &= !COLD;
        let class = drift_class(term);
        self.cold.sums[class] -= term;
        self.cold.counts[class] = self.cold.counts[class].saturating_sub(1);
    }

    /// The slot's term of the running sum (|d| for L1, d² for L2).
    pub(super) fn norm_term(&self, index: u32) -> f64 {
        let slot = self.slots[index as usize];
        let drift = slot.live - slot.backed;
        match self.norm {
            Norm::L2 => drift * drift,
            _ => drift.abs(),
        }
    }

    /// The running sum at which the divergence is `divergence`.
    pub(super) fn sum_within(&self, divergence: f64) -> f64 {
        match self.norm {
            Norm::L2 => divergence * divergence,
            _ => divergence,
        }
    }
}

/// The class taken in part: whole classes from the largest down are taken
/// (their sums come off `remaining`) until taking the next would leave at
/// most `target`. `classes` holds every class whose sum is not zero: one of
/// sum zero is the cut only when nothing is to be taken at all, and then
/// the largest class is, as a walk through every class finds.
fn cutoff_class(class_sums: &[f64; DRIFT_CLASSES], classes: ClassSet, remaining: &mut f64, target: f64) -> usize {
    if *remaining <= target {
        return DRIFT_CLASSES - 1;
    }
    for class in classes.descending() {
        if *remaining - class_sums[class] <= target {
            return class;
        }
        *remaining -= class_sums[class];
    }
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_class_set_gives_its_classes_largest_first() {
        let mut set = ClassSet::default();
        for class in [0, 5, 64, 70, 127, 5, 9] {
            set.insert(class);
        }
        set.remove(64);
        set.remove(70);
        set.remove(9);
        assert_eq!(set.descending().collect::<Vec<_>>(), [127, 5, 0]);
        assert_eq!(ClassSet::default().descending().count(), 0);
    }

    #[test]
    fn the_classes_grown_are_those_whose_sums_moved() {
        let before = [0.0; DRIFT_CLASSES];
        let mut after = before;
        after[3] += 0.5;
        after[100] += 2.0;
        assert_eq!(
            ClassSet::grown(&before, &after).descending().collect::<Vec<_>>(),
            [100, 3]
        );
        assert_eq!(ClassSet::grown(&after, &after), ClassSet::default());
    }

    #[test]
    fn a_bucket_whose_slots_keep_changing_is_compacted() {
        use crate::operator::BackupScope;
        let mut slots = DriftSlots::new(Norm::L1, 30);
        slots.set_theta(100.0);
        let class = drift_class(1.0);
        for round in 0..20u32 {
            // Every cold slot changes within its class (within θ/2 = 50 in
            // all) and cools again: each round leaves 30 stale entries behind.
            let value = if round % 2 == 0 { 1.0 } else { 1.5 };
            for index in 0..30 {
                slots.set(index, value);
            }
            assert!(slots.backup(u64::from(round), BackupScope::Drifted).is_empty());
            slots.acknowledge(u64::from(round));
            let entries = slots.cold.buckets[class].len();
            assert!(
                entries <= STALE_FACTOR * 30 + STALE_SLACK,
                "round {round}: {entries} entries"
            );
            assert_eq!(slots.cold.counts[class], 30);
            assert_eq!(slots.cold.sums[class], 30.0 * value, "round {round}: the class sum");
            assert_eq!(slots.divergence(), 30.0 * value);
        }
    }

    #[test]
    fn the_cut_falls_in_the_class_that_brings_the_rest_within_the_target() {
        let mut sums = [0.0; DRIFT_CLASSES];
        let mut classes = ClassSet::default();
        for (class, sum) in [(70, 8.0), (66, 4.0), (65, 2.0)] {
            sums[class] = sum;
            classes.insert(class);
        }
        let mut remaining = 14.0;
        // Class 70 taken whole (6 left), class 66 would leave 2: cut there.
        assert_eq!(cutoff_class(&sums, classes, &mut remaining, 3.0), 66);
        assert_eq!(remaining, 6.0);
        let mut nothing_due = 2.0;
        assert_eq!(cutoff_class(&sums, classes, &mut nothing_due, 3.0), DRIFT_CLASSES - 1);
    }
}
