//! A set of members.

use std::collections::VecDeque;

use rustc_hash::FxHashSet;

use super::BackupScope;
use super::{check_tag, TableKey, Tracked};
use crate::batch::BackupBatch;
use crate::entry::BackupEntry;
use crate::error::CoreError;

/// A set whose divergence is the number of members added or removed since the last
/// backup issued: the member-count difference for sets that only grow, and an
/// upper bound of it otherwise. A removed member is backed up as a deletion.
#[derive(Clone, Debug)]
pub struct TrackedSet<K: TableKey> {
    tag: u8,
    members: FxHashSet<K>,
    /// Members whose presence differs from the last backup issued.
    changed: FxHashSet<K>,
    /// Members a failed backup wrote: the store may hold them although the write
    /// was reported failed, so the next backup writes them again.
    owed: FxHashSet<K>,
    /// Backups in flight and the members they wrote (owed again should one fail).
    pending: VecDeque<(u64, Vec<K>)>,
}

impl<K: TableKey> TrackedSet<K> {
    pub fn new(tag: u8) -> Self {
        TrackedSet {
            tag,
            members: FxHashSet::default(),
            changed: FxHashSet::default(),
            owed: FxHashSet::default(),
            pending: VecDeque::new(),
        }
    }

    fn toggle(&mut self, member: K) {
        if !self.changed.remove(&member) {
            self.changed.insert(member);
        }
    }

    /// Adds a member; returns whether it was new.
    pub fn insert(&mut self, member: K) -> bool {
        let new = self.members.insert(member.clone());
        if new {
            self.toggle(member);
        }
        new
    }

    /// Removes a member; returns whether it was there.
    pub fn remove(&mut self, member: &K) -> bool {
        let was = self.members.remove(member);
        if was {
            self.toggle(member.clone());
        }
        was
    }

    pub fn contains(&self, member: &K) -> bool {
        self.members.contains(member)
    }

    pub fn len(&self) -> usize {
        self.members.len()
    }

    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = &K> {
        self.members.iter()
    }

    /// The size of the symmetric difference of two sets.
    pub fn distance(&self, other: &TrackedSet<K>) -> f64 {
        let only_mine = self.members.difference(&other.members).count();
        let only_theirs = other.members.difference(&self.members).count();
        (only_mine + only_theirs) as f64
    }
}

impl<K: TableKey> Tracked for TrackedSet<K> {
    fn tag(&self) -> u8 {
        self.tag
    }

    fn divergence(&self) -> f64 {
        self.changed.len() as f64
    }

    fn set_theta(&mut self, _theta: f64) {}

    fn backup(&mut self, seq: u64, _scope: BackupScope, out: &mut BackupBatch) {
        let mut snapshot = Vec::with_capacity(self.changed.len() + self.owed.len());
        let owed = self.owed.iter().filter(|member| !self.changed.contains(*member));
        for member in self.changed.iter().chain(owed) {
            let present = self.members.contains(member);
            // A changed member's presence differs from the last backup's.
            let present_before = present != self.changed.contains(member);
            let key = |bytes: &mut Vec<u8>| member.write_key(bytes);
            out.push(self.tag, key, present.then_some(&[]), present_before.then_some(&[]));
            snapshot.push(member.clone());
        }
        self.owed.clear();
        // Measured from the last backup issued (see `DriftSlots`).
        self.changed.clear();
        self.pending.push_back((seq, snapshot));
    }

    fn acknowledge(&mut self, seq: u64) {
        while self.pending.front().is_some_and(|(s, _)| *s <= seq) {
            self.pending.pop_front();
        }
    }

    fn fail(&mut self, seq: u64) {
        // The store may hold what the failed backup wrote, so each of its members is
        // owed again, even one whose presence is back at the baseline's.
        let Some(position) = self.pending.iter().position(|(s, _)| *s == seq) else {
            return;
        };
        if let Some((_, snapshot)) = self.pending.remove(position) {
            self.owed.extend(snapshot);
        }
    }

    fn restore(&mut self, entry: &BackupEntry) -> Result<(), CoreError> {
        check_tag(entry, self.tag)?;
        let member = K::read_key(entry.key_body())?;
        match &entry.value {
            Some(bytes) => {
                crate::entry::payload(bytes)?;
                self.members.insert(member.clone());
            }
            None => {
                self.members.remove(&member);
            }
        }
        self.changed.remove(&member);
        Ok(())
    }
}
