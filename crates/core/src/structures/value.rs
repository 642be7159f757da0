//! A single number.

use super::BackupScope;
use super::{check_tag, Tracked};
use crate::batch::BackupBatch;
use crate::entry::{decode_f64, BackupEntry};
use crate::error::CoreError;

/// One number whose divergence is the absolute difference from its last backup
/// issued.
#[derive(Clone, Debug)]
pub struct TrackedValue {
    tag: u8,
    live: f64,
    backed: f64,
    /// Backups in flight that wrote the value, oldest first.
    pending: Vec<u64>,
    /// A failed backup wrote the value: the store may hold it, so the next backup
    /// writes the value again even if it equals the baseline.
    owed: bool,
    /// The log has held the value (restored from it, or written): before
    /// that, a backup's prior is "no key", as the log says.
    logged: bool,
}

impl TrackedValue {
    pub fn new(tag: u8) -> Self {
        TrackedValue {
            tag,
            live: 0.0,
            backed: 0.0,
            pending: Vec::new(),
            owed: false,
            logged: false,
        }
    }

    #[inline]
    pub fn get(&self) -> f64 {
        self.live
    }

    #[inline]
    pub fn set(&mut self, value: f64) {
        self.live = value;
    }

    #[inline]
    pub fn add(&mut self, delta: f64) {
        self.live += delta;
    }

    pub fn distance(&self, other: &TrackedValue) -> f64 {
        (self.live - other.live).abs()
    }
}

impl Tracked for TrackedValue {
    fn tag(&self) -> u8 {
        self.tag
    }

    #[inline]
    fn divergence(&self) -> f64 {
        (self.live - self.backed).abs()
    }

    fn set_theta(&mut self, _theta: f64) {}

    fn backup(&mut self, seq: u64, _scope: BackupScope, out: &mut BackupBatch) {
        if self.backed == self.live && !self.owed {
            return;
        }
        self.owed = false;
        out.push_f64(self.tag, |_| {}, self.live, self.logged.then_some(self.backed));
        self.logged = true;
        // Measured from the last backup issued (see `DriftSlots`).
        self.backed = self.live;
        self.pending.push(seq);
    }

    fn acknowledge(&mut self, seq: u64) {
        self.pending.retain(|&s| s > seq);
    }

    fn fail(&mut self, seq: u64) {
        let before = self.pending.len();
        self.pending.retain(|&s| s != seq);
        self.owed |= self.pending.len() != before;
    }

    fn restore(&mut self, entry: &BackupEntry) -> Result<(), CoreError> {
        check_tag(entry, self.tag)?;
        let value = match &entry.value {
            Some(bytes) => decode_f64(bytes)?,
            None => 0.0,
        };
        self.live = value;
        self.backed = value;
        self.logged = entry.value.is_some();
        Ok(())
    }
}
