//! The drift-tracking engine shared by vectors and hash tables.
//!
//! Every slot holds its live value beside the value of the last backup *issued*
//! that wrote it, so the divergence can be kept up to date on every update
//! (D' = D + Δ) with no rescan. A backup snapshots the entries it writes and the
//! baseline moves to that snapshot at once: several backups may be in flight,
//! and the changelog is gapless (a write that fails fails every write behind
//! it), so a marker in the log has every backup issued before it in the log,
//! and the state it logs is the baseline as it was when the marker was issued.
//! A backup that fails may still have reached the log, or not: its slots are
//! owed, and the next backup writes them whatever their drift (the controller
//! issues one at once), so the first marker that counts after a failure has
//! them logged at their live values.

use std::collections::VecDeque;

mod bucket;
mod heaviest;

use heaviest::ColdSlots;

use super::prefetch::{fetch_ahead, prefetch};
use super::BackupScope;
use super::Norm;
use crate::spares::Spares;

const DIRTY: u8 = 1; // changed since it was last included in a backup (L1, L2, key count)
const OVER: u8 = 2; // |live - backed| > θ·WRITE_FRACTION (max difference): written by the next backup
const PRESENT: u8 = 4; // included in a backup issued
const OWED: u8 = 8; // written by a backup that failed (or in flight at a crash), so possibly in the store
const CHANGED: u8 = 16; // store-backed: changed since it was last staged for the local store
const PINNED: u8 = 32; // store-backed, transient: held by a backup in flight
const FREE: u8 = 64; // store-backed: evicted; the index waits for reuse
const COLD: u8 = 128; // dirty, left unwritten by a drifted backup (L1, L2): see `heaviest`

/// How far a drifted backup takes the divergence. Max difference: a backup
/// writes every slot whose drift exceeds this share of θ, not only those over θ.
/// Left at just under θ, drifts would pile up there and every later item would
/// push one slot over and trigger a backup of it alone; with half of θ written,
/// a slot must drift θ/2 again before the next. L1 and L2: a backup writes the
/// largest drifts until the divergence left is within this share of θ, so the
/// next one is θ/2 of drift away; the state a marker logs is within θ of the
/// live one all the same, since a backup goes out whenever it passes θ.
const WRITE_FRACTION: f64 = 0.5;

#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Slot {
    live: f64,
    backed: f64,
}

/// A slot a backup wrote: its value, and what the last backup issued before
/// held for it (`None`: none held it), which the changelog logs as the entry's
/// prior (see [`crate::logged`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Written {
    pub index: u32,
    pub value: f64,
    pub prior: Option<f64>,
}

/// A backup in flight: what it wrote, owed again should it fail.
#[derive(Clone, Debug)]
struct Pending {
    seq: u64,
    values: Vec<Written>,
}

/// Dense slots with a divergence kept incrementally against the last backup
/// issued.
#[derive(Clone, Debug)]
pub struct DriftSlots {
    norm: Norm,
    slots: Vec<Slot>,
    flags: Vec<u8>,
    dirty: Vec<u32>,
    over: Vec<u32>,
    /// Slots a failed backup wrote (or that one in flight at a crash may have).
    /// The store may hold what it wrote although it was reported failed, so the
    /// next backup of any scope writes them again whatever their drift.
    owed: Vec<u32>,
    /// L1: Σ|d|; L2: Σd²; key count: slots never acknowledged.
    sum: f64,
    /// Max difference: the largest |d| among the slots flagged (over θ·WRITE_FRACTION).
    over_max: f64,
    /// Max difference: an upper bound of |d| over the slots not flagged.
    running_max: f64,
    theta: f64,
    pending: VecDeque<Pending>,
    /// Store-backed structures only: slots to stage for the local store, and
    /// evicted indices for reuse.
    tracking: bool,
    changed: Vec<u32>,
    free: Vec<u32>,
    /// Store-backed, max difference: more keys are in memory than the budget allows.
    pressure: bool,
    /// The slots a backup writes, kept to reuse its buffer.
    scratch: Vec<u32>,
    /// The dirty slots, their classes and norm terms while a drifted backup ranks them,
    /// kept to reuse its buffer.
    ranked: Vec<(u32, u8, f64)>,
    /// Buffers of acknowledged backups' slots, for reuse (see `recycle`).
    spare: Spares<Vec<Written>, SPARE_BUFFERS, SPARE_WRITTEN>,
    /// The dirty slots the last drifted backups left unwritten (L1, L2).
    cold: ColdSlots,
}

/// Buffers of done backups' slots kept for reuse (see [`crate::spares`]):
/// up to 65 536 slots (1 MiB) a structure.
const SPARE_BUFFERS: usize = 32;
const SPARE_WRITTEN: usize = 1 << 16;

/// A slot as the local store keeps it: the live value, and while it differs from
/// (or may differ from) the last acknowledged backup, what drift tracking needs to
/// go on after a restart (such a slot is owed to the next backup).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StoredSlot {
    pub live: f64,
    pub drift: Option<StoredDrift>,
}

/// The baseline of a slot that is not clean: the value of the last backup issued
/// that wrote it, and whether a backup issued holds the key at all (key-count
/// tables).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StoredDrift {
    pub backed: f64,
    pub present: bool,
}

impl DriftSlots {
    pub fn new(norm: Norm, len: usize) -> Self {
        DriftSlots {
            norm,
            slots: vec![Slot::default(); len],
            flags: vec![0; len],
            dirty: Vec::new(),
            over: Vec::new(),
            owed: Vec::new(),
            sum: 0.0,
            over_max: 0.0,
            running_max: 0.0,
            theta: f64::INFINITY,
            pending: VecDeque::new(),
            tracking: false,
            changed: Vec::new(),
            free: Vec::new(),
            pressure: false,
            scratch: Vec::new(),
            ranked: Vec::new(),
            spare: Spares::default(),
            cold: ColdSlots::default(),
        }
    }

    /// Turns on what a store-backed structure needs: the list of slots changed
    /// since they were last staged, and reuse of evicted slots.
    pub fn track_changes(&mut self) {
        self.tracking = true;
    }

    pub fn norm(&self) -> Norm {
        self.norm
    }

    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Appends a slot with value zero that no backup holds yet.
    pub fn push(&mut self) -> u32 {
        let index = match self.free.pop() {
            Some(index) => {
                self.slots[index as usize] = Slot::default();
                self.flags[index as usize] = 0;
                index
            }
            None => {
                self.slots.push(Slot::default());
                self.flags.push(0);
                self.slots.len() as u32 - 1
            }
        };
        self.mark_changed(index);
        if self.norm == Norm::KeyCount {
            self.sum += 1.0;
            self.mark_dirty(index);
        }
        index
    }

    /// Asks for the memory of a listed slot, if the list has one there.
    #[inline(always)]
    fn prefetch_slot(&self, listed: Option<&u32>) {
        if let Some(&index) = listed {
            prefetch(&self.slots, index as usize);
            prefetch(&self.flags, index as usize);
        }
    }

    /// The slot's live value. Its flags are fetched too: a read is most
    /// often followed by a write of the same slot (an operator reads, then
    /// updates), and `set` branches on the flags, which it cannot predict,
    /// so a flags byte still in memory then costs the wait and a pipeline
    /// flush; fetched here, the wait overlaps the operator's work between.
    #[inline]
    pub fn get(&self, index: u32) -> f64 {
        prefetch(&self.flags, index as usize);
        self.slots[index as usize].live
    }

    /// Live values, slot by slot.
    pub fn values(&self) -> impl Iterator<Item = f64> + '_ {
        self.slots.iter().map(|slot| slot.live)
    }

    #[inline]
    pub fn add(&mut self, index: u32, delta: f64) {
        let old = self.slots[index as usize].live;
        self.set(index, old + delta);
    }

    #[inline]
    pub fn set(&mut self, index: u32, value: f64) {
        self.mark_changed(index);
        let slot = &mut self.slots[index as usize];
        let old = slot.live;
        slot.live = value;
        let backed = slot.backed;
        match self.norm {
            Norm::L1 => {
                let old_term = (old - backed).abs();
                self.sum += (value - backed).abs() - old_term;
                self.mark_dirty_from(index, old_term);
            }
            Norm::L2 => {
                let (before, after) = (old - backed, value - backed);
                self.sum += after * after - before * before;
                self.mark_dirty_from(index, before * before);
            }
            Norm::KeyCount => self.mark_dirty(index),
            Norm::Max => {
                let drift = (value - backed).abs();
                self.running_max = self.running_max.max(drift);
                if self.has(index, OVER) {
                    if drift >= self.over_max {
                        // A listed slot growing past the maximum (a hot counter):
                        // every listed drift is over the threshold, so this one is.
                        self.over_max = drift;
                    } else if drift <= self.write_threshold() || (old - backed).abs() >= self.over_max {
                        // It leaves the list, or it held the maximum and shrank.
                        self.update_over(index, (old - backed).abs(), drift);
                    }
                    // Otherwise it stays listed under the maximum: nothing moves.
                } else if drift > self.write_threshold() {
                    self.update_over(index, (old - backed).abs(), drift);
                }
            }
        }
    }

    /// The next backup, whatever its scope, writes this slot whatever its drift.
    fn owe(&mut self, index: u32) {
        if !self.has(index, OWED) {
            self.flags[index as usize] |= OWED;
            self.owed.push(index);
        }
    }

    #[inline]
    fn has(&self, index: u32, flag: u8) -> bool {
        self.flags[index as usize] & flag != 0
    }

    #[inline]
    fn mark_changed(&mut self, index: u32) {
        if self.tracking {
            let flags = &mut self.flags[index as usize];
            if *flags & CHANGED == 0 {
                *flags |= CHANGED;
                self.changed.push(index);
            }
        }
    }

    /// L1 and L2: as `mark_dirty`, for a slot whose term was `old_term`; a
    /// cold slot turns hot (see `heaviest`).
    #[inline]
    fn mark_dirty_from(&mut self, index: u32, old_term: f64) {
        let flags = self.flags[index as usize];
        if flags & DIRTY == 0 {
            self.flags[index as usize] |= DIRTY;
            self.dirty.push(index);
        } else if flags & COLD != 0 {
            self.reheat(index, old_term);
        }
    }

    #[inline]
    fn mark_dirty(&mut self, index: u32) {
        let flags = &mut self.flags[index as usize];
        if *flags & DIRTY == 0 {
            *flags |= DIRTY;
            self.dirty.push(index);
        }
    }

    /// Max difference: slots drifting more than this are listed for the next backup.
    #[inline]
    fn write_threshold(&self) -> f64 {
        self.theta * WRITE_FRACTION
    }

    /// Keeps the list of slots over the write threshold and its maximum exact when
    /// a listed slot, or one crossing the threshold, changes. Only such slots take
    /// this path, and a growing drift (a counter) costs O(1): the maximum is
    /// searched again only when the slot that held it shrinks.
    #[cold]
    fn update_over(&mut self, index: u32, old_drift: f64, drift: f64) {
        let flagged = self.has(index, OVER);
        // Only a flagged slot can hold the maximum (an unflagged drift is under
        // the threshold, every flagged one over it); with none flagged the
        // maximum is 0 and searching the empty list again costs nothing.
        let held_max = old_drift >= self.over_max;
        if drift > self.write_threshold() {
            if !flagged {
                self.flags[index as usize] |= OVER;
                self.over.push(index);
            }
            if drift >= self.over_max {
                self.over_max = drift;
                return;
            }
        } else {
            // Moved back within the threshold: no backup owes it any more.
            self.flags[index as usize] &= !OVER;
            self.over.retain(|&i| i != index);
        }
        if held_max {
            self.over_max = self.largest_over_drift();
        }
    }

    fn largest_over_drift(&self) -> f64 {
        self.over
            .iter()
            .map(|&i| {
                let slot = self.slots[i as usize];
                (slot.live - slot.backed).abs()
            })
            .fold(0.0, f64::max)
    }

    /// The divergence from the last backup issued.
    ///
    /// Exact for L1, L2 and key count. For the max difference it is exact whenever
    /// it exceeds θ (the only case that triggers a backup) and otherwise an upper
    /// bound that never exceeds θ once a partial backup left small drifts behind.
    /// A sum that is not a number (a value that is not one) is an infinite
    /// divergence: a backup at once, where `max` would have made it 0 for good.
    #[inline]
    pub fn divergence(&self) -> f64 {
        let sum = if self.sum.is_nan() {
            f64::INFINITY
        } else {
            self.sum.max(0.0)
        };
        match self.norm {
            Norm::L1 | Norm::KeyCount => sum,
            Norm::L2 => sum.sqrt(),
            Norm::Max => {
                if self.over.is_empty() {
                    self.running_max.min(self.write_threshold())
                } else {
                    self.over_max
                }
            }
        }
    }

    /// θ decides which slots a max-difference backup must hold; changing it (after a
    /// recovery or a window reset) rescans the slots once.
    pub fn set_theta(&mut self, theta: f64) {
        self.theta = theta;
        if self.norm != Norm::Max {
            return;
        }
        for &index in &self.over {
            self.flags[index as usize] &= !OVER;
        }
        self.over.clear();
        self.over_max = 0.0;
        let threshold = self.write_threshold();
        for index in 0..self.slots.len() {
            let slot = self.slots[index];
            let drift = (slot.live - slot.backed).abs();
            if drift > threshold {
                self.update_over(index as u32, 0.0, drift);
            }
        }
    }

    /// Snapshots the entries a backup must write and returns their slot indices and
    /// values. `Drifted` holds what the divergence counts (for the max difference
    /// the slots over θ/2, see `WRITE_FRACTION`); `Complete` holds every slot that differs from the backup, so
    /// that after its acknowledgement the backup equals the state at this moment.
    pub fn backup(&mut self, seq: u64, scope: BackupScope) -> &[Written] {
        // Under memory pressure a max-difference backup also writes the small
        // drifts (it becomes complete), so that their slots turn clean and can be
        // evicted once it is acknowledged.
        // Likewise an owed-only backup writes the drifted slots under pressure,
        // so that they turn clean. A max-difference state writes its slots over
        // θ/2 either way: they are few, and writing them keeps θ-triggered
        // backups rare.
        let scope = match (self.pressure, self.norm, scope) {
            (true, Norm::Max, _) => BackupScope::Complete,
            (true, _, BackupScope::Owed) | (false, Norm::Max, BackupScope::Owed) => BackupScope::Drifted,
            _ => scope,
        };
        // The slots to write first, then their values: a slot's flags say
        // whether it is listed already, so none is rebased before all are.
        let mut indices = std::mem::take(&mut self.scratch);
        indices.clear();
        match (self.norm, scope) {
            (_, BackupScope::Owed) => {
                // The divergence is within θ: only what a failed write may have
                // left in the store must go; the drifted slots stay dirty.
                for position in 0..self.owed.len() {
                    let index = self.owed[position];
                    self.forget_cold(index);
                    self.flags[index as usize] &= !(OWED | DIRTY);
                    indices.push(index);
                }
                self.owed.clear();
            }
            (Norm::Max, BackupScope::Drifted) => {
                indices.extend_from_slice(&self.over);
                self.take_owed(&mut indices, false);
            }
            (Norm::Max, BackupScope::Complete) => {
                // Max-difference slots keep no dirty list (it would cost a second
                // memory access per update); complete backups are rare, so scan.
                indices.extend(
                    self.slots
                        .iter()
                        .enumerate()
                        .filter(|(_, slot)| slot.live != slot.backed)
                        .map(|(i, _)| i as u32),
                );
                self.take_owed(&mut indices, true);
                // Every slot that differs is written: none drifts once rebased.
                self.running_max = 0.0;
            }
            (Norm::L1 | Norm::L2, BackupScope::Drifted) if self.theta.is_finite() && !self.pressure => {
                self.take_heaviest(&mut indices);
            }
            _ => {
                // Owed slots are dirty too, unless an owed-only backup wrote
                // them since; those are written here once.
                for index in self.owed.drain(..) {
                    let flags = &mut self.flags[index as usize];
                    *flags &= !OWED;
                    if *flags & DIRTY == 0 {
                        indices.push(index);
                    }
                }
                for &index in &self.dirty {
                    let flags = &mut self.flags[index as usize];
                    // A restore may have cleaned a slot that is still listed.
                    if *flags & DIRTY != 0 {
                        *flags &= !DIRTY;
                        indices.push(index);
                    }
                }
                self.dirty.clear();
                self.take_all_cold(&mut indices);
            }
        }
        // The baseline moves now: the next backup is measured from this one (see
        // the module docs for why that holds while it is in flight).
        let mut values = self.spare.take();
        values.reserve(indices.len());
        for (position, &index) in indices.iter().enumerate() {
            fetch_ahead(position, |step| self.prefetch_slot(indices.get(step)));
            let prior = self.has(index, PRESENT).then(|| self.slots[index as usize].backed);
            let value = self.slots[index as usize].live;
            self.rebase(index);
            values.push(Written { index, value, prior });
        }
        self.scratch = indices;
        if self.norm == Norm::Max {
            let flags = &self.flags;
            self.over.retain(|&i| flags[i as usize] & OVER != 0);
            self.over_max = self.largest_over_drift();
        }
        self.pending.push_back(Pending { seq, values });
        self.pending.back().map(|p| p.values.as_slice()).unwrap_or_default()
    }

    /// Adds the owed slots that `indices` does not hold yet, and clears the
    /// debt. `complete` says which slots `indices` holds already: those that
    /// differ from the baseline (a complete backup) or those over θ (a
    /// drifted one).
    fn take_owed(&mut self, indices: &mut Vec<u32>, complete: bool) {
        for index in self.owed.drain(..) {
            let flags = &mut self.flags[index as usize];
            *flags &= !OWED;
            let slot = self.slots[index as usize];
            let included = if complete {
                slot.live != slot.backed
            } else {
                *flags & OVER != 0
            };
            if !included {
                indices.push(index);
            }
        }
    }

    /// Every pending backup up to and including `seq` reached the log: its
    /// slots are no longer in flight (a store-backed slot is staged again, now
    /// clean).
    pub fn acknowledge(&mut self, seq: u64) {
        while self.pending.front().is_some_and(|p| p.seq <= seq) {
            let Some(done) = self.pending.pop_front() else { break };
            for written in &done.values {
                self.mark_changed(written.index);
            }
            self.recycle(done.values);
        }
    }

    fn recycle(&mut self, mut values: Vec<Written>) {
        values.clear();
        self.spare.give(values);
    }

    /// A backup just took the slot's live value: that is its baseline now, and
    /// it drifts no more (the caller drops it from the over-θ/2 list).
    fn rebase(&mut self, index: u32) {
        self.mark_changed(index);
        let slot = &mut self.slots[index as usize];
        let drift = slot.live - slot.backed;
        slot.backed = slot.live;
        let flags = &mut self.flags[index as usize];
        let was_present = *flags & PRESENT != 0;
        *flags |= PRESENT;
        match self.norm {
            Norm::L1 => self.sum -= drift.abs(),
            Norm::L2 => self.sum -= drift * drift,
            Norm::KeyCount if !was_present => self.sum -= 1.0,
            Norm::KeyCount => {}
            Norm::Max => *flags &= !OVER,
        }
    }

    /// Forgets a pending backup that the store refused: the log may hold what it
    /// wrote or the values before, so its slots are owed to the next backup.
    pub fn fail(&mut self, seq: u64) {
        let Some(position) = self.pending.iter().position(|p| p.seq == seq) else {
            return;
        };
        let Some(failed) = self.pending.remove(position) else {
            return;
        };
        // The store may hold what the failed backup wrote (a timed-out write can
        // still land) or what was there before it, so every slot it wrote is owed
        // again, even one whose drift from the baseline is now small.
        for &Written { index, .. } in &failed.values {
            self.mark_changed(index);
            self.owe(index);
            if self.norm != Norm::Max {
                self.mark_dirty(index);
            }
        }
        self.recycle(failed.values);
    }

    /// Sets a slot from a backup: live and backed agree, so it adds no divergence.
    /// Meant for a freshly built structure.
    pub fn restore(&mut self, index: u32, value: f64) {
        self.mark_changed(index);
        self.forget_cold(index);
        let slot = &mut self.slots[index as usize];
        let old_drift = slot.live - slot.backed;
        slot.live = value;
        slot.backed = value;
        let flags = &mut self.flags[index as usize];
        *flags &= !DIRTY;
        let was_present = *flags & PRESENT != 0;
        *flags |= PRESENT;
        match self.norm {
            Norm::L1 => self.sum -= old_drift.abs(),
            Norm::L2 => self.sum -= old_drift * old_drift,
            Norm::KeyCount if !was_present => self.sum -= 1.0,
            Norm::KeyCount => {}
            Norm::Max => *flags &= !OVER,
        }
        if self.norm == Norm::Max {
            let flags = &self.flags;
            self.over.retain(|&i| flags[i as usize] & OVER != 0);
        }
    }

    /// Store-backed: says whether more keys are in memory than the budget allows
    /// (see [`DriftSlots::backup`]).
    pub fn set_pressure(&mut self, pressure: bool) {
        self.pressure = pressure;
    }

    /// A slot read back from the local store. A clean one (no drift) equals the
    /// last acknowledged backup; a drifted one is owed to the next backup, whatever
    /// its drift, since a backup in flight at the crash may have reached the
    /// changelog. Meant for a freshly pushed slot.
    pub fn load(&mut self, index: u32, stored: StoredSlot) {
        let i = index as usize;
        match stored.drift {
            None => self.restore(index, stored.live),
            Some(drift) => {
                self.slots[i] = Slot {
                    live: stored.live,
                    backed: drift.backed,
                };
                let d = stored.live - drift.backed;
                if drift.present {
                    self.flags[i] |= PRESENT;
                }
                match self.norm {
                    Norm::L1 => self.sum += d.abs(),
                    Norm::L2 => self.sum += d * d,
                    Norm::KeyCount => {
                        if drift.present {
                            self.sum -= 1.0;
                        }
                    }
                    Norm::Max => {
                        self.running_max = self.running_max.max(d.abs());
                        self.owe(index);
                        if d.abs() > self.write_threshold() {
                            self.update_over(index, 0.0, d.abs());
                        }
                    }
                }
                if self.norm != Norm::Max {
                    self.owe(index);
                    self.mark_dirty(index);
                }
            }
        }
        // The store holds it as it is.
        self.flags[i] &= !CHANGED;
    }

    /// Hands every slot changed since the last call to `stage`, as the store must
    /// keep it.
    pub fn take_changed(&mut self, mut stage: impl FnMut(u32, StoredSlot)) {
        self.pin_pending(true);
        let mut changed = std::mem::take(&mut self.changed);
        for &index in &changed {
            let i = index as usize;
            if !self.has(index, CHANGED) {
                continue;
            }
            self.flags[i] &= !CHANGED;
            stage(index, self.stored(i));
        }
        changed.clear();
        self.changed = changed;
        self.pin_pending(false);
    }

    /// Frees every clean slot whose last change was staged (and, the caller
    /// says, written) and that no backup in flight holds; calls `evicted` with
    /// each index.
    pub fn evict(&mut self, mut evicted: impl FnMut(u32)) {
        self.pin_pending(true);
        for i in 0..self.slots.len() {
            if self.flags[i] & (FREE | CHANGED) != 0 || !self.is_clean(i) {
                continue;
            }
            self.flags[i] = FREE;
            self.free.push(i as u32);
            evicted(i as u32);
        }
        self.pin_pending(false);
    }

    fn stored(&self, i: usize) -> StoredSlot {
        let slot = self.slots[i];
        StoredSlot {
            live: slot.live,
            drift: (!self.is_clean(i)).then_some(StoredDrift {
                backed: slot.backed,
                present: self.flags[i] & PRESENT != 0,
            }),
        }
    }

    /// Whether the slot equals its acknowledged backup and nothing is owed or in
    /// flight for it: then the store's live value is all there is to keep.
    fn is_clean(&self, i: usize) -> bool {
        let (slot, flags) = (self.slots[i], self.flags[i]);
        slot.live == slot.backed
            && flags & (DIRTY | OVER | OWED | PINNED) == 0
            && (self.norm != Norm::KeyCount || flags & PRESENT != 0)
    }

    fn pin_pending(&mut self, pin: bool) {
        for pending in &self.pending {
            for &Written { index, .. } in &pending.values {
                let flags = &mut self.flags[index as usize];
                if pin {
                    *flags |= PINNED;
                } else {
                    *flags &= !PINNED;
                }
            }
        }
    }

    /// The divergence function between two states of the same shape.
    pub fn distance(&self, other: &DriftSlots) -> f64 {
        let len = self.slots.len().max(other.slots.len());
        let value = |slots: &[Slot], i: usize| slots.get(i).map_or(0.0, |s| s.live);
        let diffs = (0..len).map(|i| (value(&self.slots, i) - value(&other.slots, i)).abs());
        match self.norm {
            Norm::L1 => diffs.sum(),
            Norm::L2 => diffs.map(|d| d * d).sum::<f64>().sqrt(),
            Norm::Max => diffs.fold(0.0, f64::max),
            Norm::KeyCount => self.slots.len().abs_diff(other.slots.len()) as f64,
        }
    }
}

#[cfg(test)]
mod tests;
