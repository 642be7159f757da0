//! The simulated broker of the harness: a changelog partition compacted at
//! random, an output topic and a committed offset; acknowledgements arrive
//! late and in batches, and a failed write may have reached the log all the
//! same (a prefix of the writes in flight: the changelog is gapless).

use super::*;

pub(crate) enum Write {
    Backup { seq: u64, records: Vec<BackupEntry> },
    Marker { seq: u64, record: BackupEntry },
}

pub(crate) struct Due<T> {
    at: u64,
    what: T,
}

/// Delivered outputs with the offset of their item.
pub type Delivered<Out> = Vec<(u64, Out)>;

/// The simulated broker: what the driver's writes do.
pub(crate) struct SimBroker<Out> {
    pub(crate) rng: StdRng,
    pub(crate) step: u64,
    pub(super) max_ack_delay: u64,
    pub(super) write_failure_rate: f64,
    pub(super) drop_backups: bool,
    /// The changelog partition, oldest first.
    pub(crate) log: Vec<BackupEntry>,
    /// Every record that ever landed, in log order: never compacted.
    pub(crate) landed: Vec<BackupEntry>,
    /// Whether each record of `landed` was written by a zombie owner.
    pub(super) by_zombie: Vec<bool>,
    /// Writes of crashed owners that are still on their way.
    pub(super) zombie: Vec<Write>,
    pub(super) zombie_writes: bool,
    /// The current run has landed a record.
    pub(super) run_landed: bool,
    /// With zombies: how much of `log` compaction may touch: what landed
    /// before the last recovery whose run got its start marker into the log
    /// (that run rewrote every key a late write superseded, see
    /// [`crate::fence`]; `min.compaction.lag.ms` spares the rest).
    pub(super) compactable: usize,
    /// Where `log` ended at the last crash: compactable once the run after
    /// it has written its start marker.
    pub(super) compactable_once_started: usize,
    /// Changelog writes in flight, in the producer's order.
    pub(crate) writes: VecDeque<Due<Write>>,
    pub(crate) outputs: Vec<Due<(u64, Out)>>,
    pub(crate) committed: Option<u64>,
    /// Delivered outputs with the offset of their item, as of the last recovery
    /// point.
    pub(crate) sink: Vec<(u64, Out)>,
    /// Delivered outputs of items a recovery replayed.
    pub(super) replayed: Vec<(u64, Out)>,
    pub(super) changelog_records: u64,
    pub(crate) acks: Vec<Ack>,
    /// A write failed and the task has not heard of it yet: what it sends
    /// meanwhile fails too (the changelog is gapless: its producer stops).
    pub(super) failing: bool,
    /// Changelog writes wait in `held` until the task's local store is
    /// written ([`SimBroker::release`]).
    pub(super) holding: bool,
    pub(super) held: Vec<Write>,
}

impl<Out> SimBroker<Out> {
    pub(crate) fn new(options: &SimulationOptions) -> Self {
        SimBroker {
            rng: StdRng::seed_from_u64(options.seed),
            step: 0,
            max_ack_delay: options.max_ack_delay,
            write_failure_rate: options.write_failure_rate,
            drop_backups: options.drop_backups,
            log: Vec::new(),
            landed: Vec::new(),
            by_zombie: Vec::new(),
            zombie: Vec::new(),
            zombie_writes: options.zombie_writes,
            run_landed: false,
            compactable: 0,
            compactable_once_started: 0,
            writes: VecDeque::new(),
            outputs: Vec::new(),
            committed: None,
            sink: Vec::new(),
            replayed: Vec::new(),
            changelog_records: 0,
            acks: Vec::new(),
            failing: false,
            holding: false,
            held: Vec::new(),
        }
    }

    /// Sends the changelog writes held for the store's write, in order.
    pub(super) fn release(&mut self) {
        for write in std::mem::take(&mut self.held) {
            self.send(write);
        }
    }

    pub(super) fn send(&mut self, write: Write) {
        if self.fails_at_once(&write) {
            return;
        }
        let at = self.due().max(self.writes.back().map_or(0, |w| w.at));
        self.writes.push_back(Due { at, what: write });
    }

    /// A write while a failure's report is on its way fails at once.
    pub(super) fn fails_at_once(&mut self, write: &Write) -> bool {
        if !self.failing {
            return false;
        }
        self.acks.push(match write {
            Write::Backup { seq, .. } => Ack::BackupFailed(*seq),
            Write::Marker { seq, .. } => Ack::MarkerFailed(*seq),
        });
        true
    }

    pub(super) fn write(&mut self, write: Write) {
        if self.holding {
            self.held.push(write);
        } else {
            self.send(write);
        }
    }

    /// Hands the driver the acknowledgements that arrived. Writes it sends
    /// while a failure's reports come in fail too (and report so at once);
    /// once it has heard of the failure, writes land again.
    pub(crate) fn report_to<O: Operator<Output = Out>>(&mut self, driver: &mut TaskDriver<O>) {
        for ack in std::mem::take(&mut self.acks) {
            driver.acknowledge(ack, self);
        }
        self.failing = false;
        for ack in std::mem::take(&mut self.acks) {
            driver.acknowledge(ack, self);
        }
    }

    /// Whether nothing is in flight.
    pub(crate) fn idle(&self) -> bool {
        self.writes.is_empty() && self.outputs.is_empty()
    }

    pub(super) fn due(&mut self) -> u64 {
        // Acknowledgements come no sooner than the next poll, so several arrive
        // together.
        self.step + self.rng.gen_range(1..=self.max_ack_delay.max(1))
    }

    pub(super) fn fails(&mut self) -> bool {
        self.rng.gen_bool(self.write_failure_rate.clamp(0.0, 1.0))
    }

    pub(super) fn land(&mut self, records: &[BackupEntry]) {
        self.log.extend_from_slice(records);
        self.landed.extend_from_slice(records);
        self.by_zombie.resize(self.landed.len(), false);
        self.run_landed |= !records.is_empty();
    }

    /// Once the current run has written the changelog, now and then, the
    /// crashed owners' writes still on their way land, in their order.
    fn land_zombie_writes(&mut self) {
        if self.zombie.is_empty() || !self.run_landed || !self.rng.gen_bool(0.25) {
            return;
        }
        for write in std::mem::take(&mut self.zombie) {
            let records = match write {
                Write::Backup { records, .. } => records,
                Write::Marker { record, .. } => vec![record],
            };
            self.log.extend_from_slice(&records);
            self.landed.extend_from_slice(&records);
            self.by_zombie.resize(self.landed.len(), true);
        }
    }

    /// The state logged at the last marker, from every record that landed
    /// (compaction aside): each key's latest record before that marker, as
    /// its value decodes. What a recovery must restore, found by position
    /// instead of by the sequences and priors the records carry.
    /// A zombie owner's records are no one's state: they are left out.
    pub(crate) fn state_at_last_marker(&self) -> Vec<BackupEntry> {
        let owners: Vec<&BackupEntry> = self
            .landed
            .iter()
            .zip(&self.by_zombie)
            .filter(|(_, zombie)| !**zombie)
            .map(|(record, _)| record)
            .collect();
        let last = owners.iter().rposition(|r| BackupMarker::is_marker(r));
        let before = last.map_or(&owners[..], |at| &owners[..at]);
        let mut latest = std::collections::BTreeMap::new();
        for record in before.iter().filter(|r| !BackupMarker::is_marker(r)) {
            latest.insert(record.key.clone(), record.value.clone());
        }
        latest
            .into_iter()
            .filter_map(|(key, value)| {
                let logged = crate::logged::LoggedValue::decode(value.as_deref()).ok()?;
                logged.value.map(|value| BackupEntry::new(key, Some(value)))
            })
            .collect()
    }

    /// What lands of a failed write: any prefix, the whole of it included.
    pub(super) fn land_prefix(&mut self, records: &[BackupEntry]) {
        let keep = self.rng.gen_range(0..=records.len());
        self.land(&records[..keep]);
    }

    /// Completes the writes and outputs due by now (with `force`, the earliest
    /// one even if it is not due, as time jumps ahead while the task waits).
    pub(crate) fn deliver(&mut self, force: bool) -> bool {
        let now = self.step;
        let mut delivered = false;
        while let Some(front) = self.writes.front() {
            if !(front.at <= now || (force && !delivered)) {
                break;
            }
            let Some(Due { what, .. }) = self.writes.pop_front() else {
                break;
            };
            delivered = true;
            let failed = self.fails();
            self.failing |= failed;
            // The changelog is gapless: a failed write fails every write behind
            // it, and none of them lands.
            let behind: Vec<Ack> = if failed {
                self.writes
                    .drain(..)
                    .map(|Due { what, .. }| match what {
                        Write::Backup { seq, .. } => Ack::BackupFailed(seq),
                        Write::Marker { seq, .. } => Ack::MarkerFailed(seq),
                    })
                    .collect()
            } else {
                Vec::new()
            };
            match what {
                Write::Backup { seq, records } => {
                    if failed {
                        self.land_prefix(&records);
                        self.acks.push(Ack::BackupFailed(seq));
                    } else {
                        if !self.drop_backups {
                            self.land(&records);
                        }
                        self.acks.push(Ack::BackupWritten(seq));
                    }
                }
                Write::Marker { seq, record } => {
                    if failed {
                        if self.rng.gen_bool(0.5) {
                            self.land(&[record]);
                        }
                        self.acks.push(Ack::MarkerFailed(seq));
                    } else {
                        self.land(&[record]);
                        self.acks.push(Ack::MarkerWritten(seq));
                    }
                }
            }
            self.acks.extend(behind);
        }
        self.land_zombie_writes();
        let mut index = 0;
        while index < self.outputs.len() {
            if self.outputs[index].at <= now || (force && !delivered) {
                let Due {
                    what: (offset, output), ..
                } = self.outputs.swap_remove(index);
                delivered = true;
                self.sink.push((offset, output));
                self.acks.push(Ack::Output {
                    item_offset: offset,
                    count: 1,
                });
            } else {
                index += 1;
            }
        }
        delivered
    }

    /// The crash: a prefix of the writes in flight lands (one producer, one order),
    /// each output in flight may or may not; the returned outputs were lost.
    pub(crate) fn crash(&mut self) -> Vec<u64> {
        self.held.clear();
        let writes: Vec<_> = self.writes.drain(..).collect();
        let landing = self.rng.gen_range(0..=writes.len());
        for (index, Due { what, .. }) in writes.into_iter().enumerate() {
            if self.zombie_writes && index >= landing {
                // The owner is stalled, not dead: the rest is still on its way.
                self.zombie.push(what);
                continue;
            }
            if index > landing {
                break;
            }
            match what {
                Write::Backup { records, .. } if index == landing => self.land_prefix(&records),
                Write::Backup { records, .. } => {
                    if !self.drop_backups {
                        self.land(&records)
                    }
                }
                Write::Marker { record, .. } if index < landing => self.land(&[record]),
                Write::Marker { .. } => {}
            }
        }
        self.run_landed = false;
        let mut lost = Vec::new();
        for Due {
            what: (offset, output), ..
        } in std::mem::take(&mut self.outputs)
        {
            if self.rng.gen_bool(0.5) {
                self.sink.push((offset, output));
            } else {
                lost.push(offset);
            }
        }
        self.acks.clear();
        lost
    }

    /// Compaction as Kafka does it, at a random point: the latest record per key
    /// survives, in log order; deletions may survive a while or go.
    /// With zombies, only what is `compactable` is compacted.
    pub(crate) fn compact(&mut self) {
        let drop_tombstones = self.rng.gen_bool(0.5);
        let end = if self.zombie_writes {
            self.compactable
        } else {
            self.log.len()
        };
        let recent = self.log.split_off(end);
        let mut kept = crate::recovery::compacted(std::mem::take(&mut self.log), drop_tombstones);
        // What compaction removed lay before both marks.
        let removed = end - kept.len();
        self.compactable = self.compactable.saturating_sub(removed);
        self.compactable_once_started = self.compactable_once_started.saturating_sub(removed);
        kept.extend(recent);
        self.log = kept;
    }
}

impl<Out> TaskIo<Out> for SimBroker<Out> {
    fn send_output(&mut self, item_offset: u64, output: Out) {
        let at = self.due();
        self.outputs.push(Due {
            at,
            what: (item_offset, output),
        });
    }

    fn write_backup(&mut self, seq: u64, records: &BackupBatch) {
        self.changelog_records += records.len() as u64;
        self.write(Write::Backup {
            seq,
            records: records.iter().map(|record| record.to_entry()).collect(),
        });
    }

    fn write_marker(&mut self, marker: &BackupMarker) {
        self.changelog_records += 1;
        self.write(Write::Marker {
            seq: marker.seq,
            record: marker.to_entry(),
        });
    }

    fn commit(&mut self, offset: u64) {
        self.committed = Some(self.committed.map_or(offset, |c| c.max(offset)));
    }
}
