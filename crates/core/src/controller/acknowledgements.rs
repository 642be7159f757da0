//! What the controller does with the broker's acknowledgements and failures
//! of backups, markers and outputs (the module docs of
//! [`crate::controller`] state the rules).

use super::*;

impl TaskController {
    /// Backup `seq`'s entries were acknowledged: its marker counts once it is
    /// acknowledged too (it may be already).
    pub fn backup_written(&mut self, seq: u64, actions: &mut Vec<Action>) {
        let Some(index) = self.open.iter().position(|o| o.seq == seq && o.sent) else {
            return;
        };
        self.open.remove(index);
        let marker = self.markers.iter_mut().find(|m| m.entries_of == Some(seq));
        if let Some(marker) = marker {
            marker.entries_of = None;
            if marker.acknowledged {
                let marker_seq = marker.seq;
                self.marker_written(marker_seq, actions);
            }
        }
        self.advance(actions);
    }

    /// Backup `seq`'s entries were not acknowledged: some may be in the log. The
    /// operator owes them again; a new backup follows once every write in
    /// flight is reported. The marker sent behind them never counts: the log's
    /// order lands it only after all of them (see `TaskIo::write_marker`), and
    /// the new backup's marker covers the same items.
    pub fn backup_failed(&mut self, seq: u64, actions: &mut Vec<Action>) {
        let Some(index) = self.open.iter().position(|o| o.seq == seq && o.sent) else {
            return;
        };
        let Some(failed) = self.open.remove(index) else { return };
        self.markers.retain(|m| m.entries_of != Some(seq));
        if self.phase == Phase::Starting {
            // The rollback failed: it goes out again, with a start marker.
            self.send_start(actions);
            return;
        }
        self.write_failed(failed.scope, actions);
        self.advance(actions);
    }

    /// The marker `seq` was acknowledged: the recovery point moves to it (once
    /// the entries sent before it are acknowledged too).
    pub fn marker_written(&mut self, seq: u64, actions: &mut Vec<Action>) {
        // An acknowledgement of a marker this task never wrote (a report meant
        // for an earlier task on the partition) says nothing about its own.
        let Some(marker) = self.markers.iter_mut().find(|m| m.seq == seq) else {
            return;
        };
        if marker.entries_of.is_some() {
            marker.acknowledged = true;
            return;
        }
        let mut acknowledged = None;
        while self.markers.front().is_some_and(|m| m.seq <= seq) {
            acknowledged = self.markers.pop_front();
        }
        let Some(marker) = acknowledged.filter(|m| m.seq == seq) else {
            return;
        };
        if marker.covers.items >= self.marked.items {
            self.marked = marker.covers;
        }
        if self.mode != Mode::None {
            actions.push(Action::Commit {
                offset: marker.covers.offset,
            });
        }
        match self.phase {
            Phase::Starting => {
                self.phase = Phase::Running;
                self.rollback = false;
            }
            Phase::Stopping if marker.clean => self.phase = Phase::Stopped,
            _ => {}
        }
    }

    /// The marker `seq` was not acknowledged (it may be in the log). A new marker
    /// must cover its items: the start marker is sent again, and otherwise a new
    /// backup is issued (its marker follows it).
    pub fn marker_failed(&mut self, seq: u64, actions: &mut Vec<Action>) {
        let Some(index) = self.markers.iter().position(|m| m.seq == seq) else {
            return;
        };
        if self.markers.remove(index).is_none() {
            return;
        }
        match self.phase {
            Phase::Starting => self.send_start(actions),
            Phase::Running | Phase::Stopping => {
                let scope = self.regular_scope();
                self.write_failed(scope, actions);
                self.advance(actions);
            }
            Phase::Stopped => {}
        }
    }

    /// The outputs of the item at `offset` were acknowledged (`count` of them).
    pub fn outputs_acknowledged(&mut self, offset: u64, count: u64, actions: &mut Vec<Action>) {
        // Acknowledgements come in the order sent, nearly always for the
        // oldest item in flight: look there before searching.
        let index = match self.outputs.front() {
            Some(oldest) if oldest.before.offset == offset => 0,
            _ => self.outputs.partition_point(|o| o.before.offset < offset),
        };
        let Some(item) = self.outputs.get_mut(index).filter(|o| o.before.offset == offset) else {
            return;
        };
        let count = count.min(item.remaining);
        item.remaining -= count;
        self.unacked_outputs -= count;
        let mut settled = false;
        while self.outputs.front().is_some_and(|o| o.remaining == 0) {
            self.outputs.pop_front();
            settled = true;
        }
        // Until the oldest item's outputs are all acknowledged no marker can go
        // out and a stop cannot finish (its last output is still unacknowledged):
        // an item of many outputs advances once, not once per output.
        if settled {
            self.advance(actions);
        }
    }
}
