//! How the controller issues backups and sends them and their markers (the
//! module docs of [`crate::controller`] state the rules).

use super::*;

impl TaskController {
    /// A backup is due: issue it now, or once one of the backups in flight
    /// closes (after a failure: once every write in flight is reported).
    pub(super) fn trigger(&mut self, scope: BackupScope, actions: &mut Vec<Action>) {
        if self.phase != Phase::Running {
            return;
        }
        if self.after_failure || self.open.len() >= self.max_open {
            self.defer(scope);
        } else {
            self.issue_backup(scope, false, actions);
        }
    }

    /// A backup with this scope is due later: with the widest scope asked for.
    pub(super) fn defer(&mut self, scope: BackupScope) {
        self.deferred = Some(self.deferred.map_or(scope, |deferred| widest(deferred, scope)));
    }

    pub(super) fn regular_scope(&self) -> BackupScope {
        match self.mode {
            Mode::Exact(_) => BackupScope::Complete,
            _ => BackupScope::Drifted,
        }
    }

    pub(super) fn issue_backup(&mut self, scope: BackupScope, clean: bool, actions: &mut Vec<Action>) {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.deferred = None;
        self.last_issued = self.processed;
        self.open.push_back(OpenBackup {
            seq,
            covers: self.processed,
            scope,
            sent: false,
            clean,
        });
        self.first_unsent = self.first_unsent.or(Some(self.processed));
        actions.push(Action::Backup { seq, scope });
        self.send_when_outputs_done(actions);
    }

    /// Sends the open backups' entries, each with its marker right behind them,
    /// in the order they were taken, each once the outputs before it are
    /// acknowledged.
    pub(super) fn send_when_outputs_done(&mut self, actions: &mut Vec<Action>) {
        debug_assert_eq!(
            self.first_unsent,
            self.open.iter().find(|o| !o.sent).map(|o| o.covers),
            "first_unsent names the oldest open backup not sent"
        );
        // Called for every output acknowledged: nearly always nothing is
        // unsent, or the oldest unsent still waits.
        if !self.first_unsent.is_some_and(|covers| self.outputs_done_before(covers)) {
            return;
        }
        // The sent ones are a prefix.
        let first_unsent = self.open.partition_point(|o| o.sent);
        self.first_unsent = None;
        for index in first_unsent..self.open.len() {
            let open = self.open[index];
            if !self.outputs_done_before(open.covers) {
                self.first_unsent = Some(open.covers);
                break;
            }
            self.open[index].sent = true;
            actions.push(Action::SendBackup { seq: open.seq });
            self.send_marker(open.covers, open.clean, Some(open.seq), actions);
        }
    }

    /// A write failed (`scope` is what the failed backup wrote). Backups taken
    /// but not sent are abandoned (their entries owed again), and the next
    /// backup waits until every write in flight is reported (see the module
    /// docs).
    pub(super) fn write_failed(&mut self, scope: BackupScope, actions: &mut Vec<Action>) {
        let mut widest_scope = scope;
        while self.open.back().is_some_and(|o| !o.sent) {
            let Some(abandoned) = self.open.pop_back() else { break };
            widest_scope = widest(widest_scope, abandoned.scope);
            actions.push(Action::AbandonBackup { seq: abandoned.seq });
        }
        self.first_unsent = None;
        if self.phase == Phase::Running {
            self.after_failure = true;
            self.defer(widest_scope);
        }
    }

    /// Sends a marker right behind the entries of backup `entries_of`, which it
    /// covers with every backup before it (without entries: the backups the
    /// last marker sent covered).
    pub(super) fn send_marker(
        &mut self,
        covers: Position,
        clean: bool,
        entries_of: Option<u64>,
        actions: &mut Vec<Action>,
    ) {
        let seq = self.next_seq;
        self.next_seq += 1;
        let covers_backup = entries_of.unwrap_or(self.covers_backup);
        self.covers_backup = covers_backup;
        self.markers.push_back(MarkerInFlight {
            seq,
            covers,
            clean,
            entries_of,
            acknowledged: false,
        });
        actions.push(Action::Marker(Box::new(BackupMarker {
            seq,
            input_offset: covers.offset,
            failures: self.failures,
            thresholds: self.thresholds,
            clean,
            recent: self.recent,
            writer: self.writer,
            covers: covers_backup,
            // The driver fills in the table of the state the marker covers.
            sources: SourcePositions::default(),
            inherited: self.inherited,
        })));
    }

    /// Every output of the items before this position is acknowledged.
    pub(super) fn outputs_done_before(&self, position: Position) -> bool {
        self.faults.marker_before_outputs || self.outputs.front().is_none_or(|o| o.before.items >= position.items)
    }

    /// Sends the backups whose outputs are acknowledged and issues a backup
    /// that waited: for a failure's writes to be reported (the failure
    /// deferred it), for room, or, stopping, the final one.
    pub(super) fn advance(&mut self, actions: &mut Vec<Action>) {
        if self.after_failure {
            if !self.open.is_empty() {
                return;
            }
            self.after_failure = false;
        }
        self.send_when_outputs_done(actions);
        match self.phase {
            Phase::Running => self.run_ended(actions),
            Phase::Stopping => self.advance_stop(actions),
            _ => {}
        }
    }
}
