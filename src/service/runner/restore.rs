//! Restoring tasks: the changelog reader. Several partitions' changelogs
//! are read side by side into fresh operators, each the state logged at its
//! last marker.
//!
//! The marker a task resumes from is decided first, on the same thread
//! ([`super::resume`]), from the changelog's end read backwards
//! ([`ChangelogLoader::last_marker`]); the full read that restores the state
//! checks it: if the log's order admits another last marker
//! ([`crate::core::fence`]: a zombie's records past the window read
//! backwards, or records a previous owner wrote since), the plan is decided
//! again from that one and the state read again (from an empty store, when
//! the task keeps one). Keys whose latest record the read fenced are written
//! again before the start marker; when their restored value came from a
//! record already applied, a second read finds it.

use std::collections::{HashMap, VecDeque};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::core::{AnalysisConstants, BackupEntry, BackupMarker, CoreError, MarkedState, Mode, RecoveryPlan, Restart};
use crate::service::codec::ServiceOperator;
use crate::service::kafka::{ChangelogLoader, KafkaSetupError, ReaderPool, Streamed};
use crate::service::ServiceError;

use super::faults::injected_restore_failure;
#[cfg(feature = "fault-injection")]
use super::faults::FAULT_SLOW_TASK_START_MS;
use super::resume::{Assignment, ResumePlanner};
use super::{Assigned, RESTORE_ATTEMPTS, RESTORE_CHUNK, RESTORE_RETRY_WAIT, START_OFFSET};

/// A task's operator with its state restored, before its driver starts.
pub(super) struct Restored<O> {
    pub(super) operator: O,
    pub(super) assigned: Assigned,
    pub(super) restored_records: u64,
    /// The changelog offset a restore from the changelog read to (the state is
    /// its records before it), for the experiment's check of a recovery.
    pub(super) changelog_end: Option<u64>,
    pub(super) restore_seconds: f64,
    /// The keys restored from priors or whose latest record was fenced,
    /// written before the start marker.
    pub(super) rolled_back: Vec<BackupEntry>,
    /// Changelog records left out: written by a previous owner after a newer
    /// one started ([`crate::core::fence`]).
    pub(super) fenced: u64,
}

/// What a changelog restore's plan was decided from, so that it can be
/// decided again from the marker the full read finds.
#[derive(Clone, Debug)]
pub(super) struct PlanInputs {
    pub(super) mode: Mode,
    pub(super) committed: Option<u64>,
    pub(super) constants: AnalysisConstants,
    /// The marker the plan resumes from, as read back from the log's end.
    pub(super) marker: Option<BackupMarker>,
}

impl PlanInputs {
    pub(super) fn decide(&self) -> RecoveryPlan {
        RecoveryPlan::decide(
            self.mode,
            self.marker.as_ref(),
            self.committed,
            START_OFFSET,
            self.constants,
        )
    }
}

/// At most this many tasks restore at once (each with a changelog reader of
/// its own): a rebalance that hands over many partitions neither opens a
/// client per partition nor restores them one after another.
pub(super) const RESTORE_PARALLELISM: usize = 4;

/// Restores running on a thread of their own, each batch first deciding
/// where its partitions resume ([`super::resume`]), so that the loop keeps
/// polling while they wait and read: a restore longer than `max.poll.interval.ms`
/// on the loop would make the member leave the group, its partitions move
/// and the restore start over. The partitions assigned together restore on
/// one thread, side by side within it ([`restore_all`]); the loop takes
/// what is done each round, and drops the restore of a partition revoked or
/// lost meanwhile.
pub(super) struct Restores<O> {
    /// The partitions whose restore runs, with the batch it belongs to.
    pending: HashMap<i32, u64>,
    next_batch: u64,
    done: Sender<Finished<O>>,
    finished: Receiver<Finished<O>>,
}

/// A batch's restores, done.
struct Finished<O> {
    batch: u64,
    restored: Result<Vec<Restored<O>>, ServiceError>,
}

impl<O: ServiceOperator> Restores<O> {
    pub(super) fn new() -> Self {
        let (done, finished) = channel();
        Restores {
            pending: HashMap::new(),
            next_batch: 0,
            done,
            finished,
        }
    }

    /// Starts restoring `batch` on a thread, with changelog readers of
    /// `pool` (never the rebalance's own, which the loop's thread uses).
    pub(super) fn spawn(
        &mut self,
        pool: &Arc<ReaderPool>,
        planner: &ResumePlanner,
        operator_config: &O::Config,
        batch: Vec<Assignment>,
        resident_keys: usize,
    ) -> Result<(), ServiceError> {
        let id = self.next_batch;
        self.next_batch += 1;
        for assigned in &batch {
            self.pending.insert(assigned.partition, id);
        }
        let (pool, planner, config, done) = (
            Arc::clone(pool),
            planner.clone(),
            operator_config.clone(),
            self.done.clone(),
        );
        // Its log lines name the pipeline as the loop's do.
        let span = tracing::Span::current();
        std::thread::Builder::new()
            .name("afstream-restore".into())
            .spawn(move || {
                let _span = span.enter();
                let restored = pool.take().map_err(ServiceError::from).and_then(|reader| {
                    let restored = planner
                        .decide(&reader, batch)
                        .and_then(|batch| restore_all::<O>(&reader, &pool, &config, batch, resident_keys));
                    pool.give_back(reader);
                    restored
                });
                // The loop is gone when it stopped: nothing waits for it.
                let _ = done.send(Finished { batch: id, restored });
            })
            .map(drop)
            .map_err(|e| ServiceError::Unsupported(format!("starting a restore thread: {e}")))
    }

    /// Drops the restores of partitions revoked or lost while they run.
    pub(super) fn cancel(&mut self, partitions: &[i32]) {
        for partition in partitions {
            if self.pending.remove(partition).is_some() {
                tracing::info!(partition, "partition revoked while it restores: its restore is dropped");
            }
        }
    }

    /// The restores done since the last call, of partitions still waiting
    /// for them. A failed restore of a partition still waiting ends the run.
    pub(super) fn finished(&mut self) -> Result<Vec<Restored<O>>, ServiceError> {
        let mut ready = Vec::new();
        while let Ok(Finished { batch, restored }) = self.finished.try_recv() {
            match restored {
                Ok(restored) => {
                    for task in restored {
                        // Not assigned again since, nor revoked or lost.
                        if self.pending.get(&task.assigned.partition) == Some(&batch) {
                            self.pending.remove(&task.assigned.partition);
                            ready.push(task);
                        }
                    }
                }
                Err(error) if self.pending.values().any(|b| *b == batch) => return Err(error),
                Err(error) => tracing::info!(%error, "a restore of partitions revoked meanwhile failed"),
            }
        }
        Ok(ready)
    }
}

/// Restores the tasks assigned together side by side, in the order given.
/// A single one restores through `loader`; several share a few workers, the
/// first with `loader`, the others with readers from `pool`.
pub(super) fn restore_all<O: ServiceOperator>(
    loader: &ChangelogLoader,
    pool: &ReaderPool,
    operator_config: &O::Config,
    batch: Vec<Assigned>,
    resident_keys: usize,
) -> Result<Vec<Restored<O>>, ServiceError> {
    if batch.len() <= 1 {
        return batch
            .into_iter()
            .map(|assigned| restore(loader, operator_config, assigned, resident_keys))
            .collect();
    }
    let count = batch.len();
    let work = Mutex::new(batch.into_iter().enumerate().collect::<VecDeque<_>>());
    // (its place in the batch, its restore)
    type Outcome<O> = (usize, Result<Restored<O>, ServiceError>);
    let done: Mutex<Vec<Outcome<O>>> = Mutex::new(Vec::with_capacity(count));
    let restore_with = |reader: &ChangelogLoader| {
        while let Some((index, assigned)) = work.lock().ok().and_then(|mut w| w.pop_front()) {
            let result = restore(reader, operator_config, assigned, resident_keys);
            if let Ok(mut done) = done.lock() {
                done.push((index, result));
            }
        }
    };
    // Their log lines name the pipeline as the loop's do.
    let span = tracing::Span::current();
    // A worker that panics makes the scope panic: every item is done after it.
    std::thread::scope(|scope| {
        for _ in 1..count.min(RESTORE_PARALLELISM) {
            scope.spawn(|| {
                let _span = span.enter();
                match pool.take() {
                    Ok(reader) => {
                        restore_with(&reader);
                        pool.give_back(reader);
                    }
                    // The other workers restore its share.
                    Err(error) => tracing::warn!(%error, "no second changelog reader; restoring with fewer"),
                }
            });
        }
        restore_with(loader);
    });
    let mut done = done.into_inner().unwrap_or_else(std::sync::PoisonError::into_inner);
    done.sort_by_key(|(index, _)| *index);
    done.into_iter().map(|(_, result)| result).collect()
}

/// Builds a task's operator and restores its state: from its local store,
/// or by streaming its changelog partition through `loader`. Needs nothing
/// of the running loop, so tasks assigned together restore side by side
/// ([`restore_all`]).
pub(super) fn restore<O: ServiceOperator>(
    loader: &ChangelogLoader,
    operator_config: &O::Config,
    mut assigned: Assigned,
    resident_keys: usize,
) -> Result<Restored<O>, ServiceError> {
    let partition = assigned.partition;
    slow_start_fault();
    let store = assigned.store.as_ref().map(|(store, _)| store.clone());
    // A fresh state, on the task's local store if it has one.
    let new_operator = || {
        O::for_partition(
            operator_config,
            partition as u32,
            store.as_ref().map(|store| (store.key_store(), resident_keys)),
        )
    };
    if assigned.local {
        let mut operator = new_operator()?;
        let drifted = operator
            .load_local_state()
            .map_err(|source| ServiceError::Restore { partition, source })?;
        tracing::info!(
            partition,
            drifted,
            "local store reopened; its drifted keys are owed to the next backup"
        );
        return Ok(Restored {
            operator,
            restored_records: 0,
            changelog_end: None,
            restore_seconds: assigned.restore_seconds,
            rolled_back: Vec::new(),
            fenced: 0,
            assigned,
        });
    }
    let started = Instant::now();
    let read = read_changelog(loader, &mut assigned, &new_operator)?;
    Ok(Restored {
        operator: read.operator,
        restored_records: read.streamed.records,
        changelog_end: Some(read.streamed.end_offset),
        restore_seconds: assigned.restore_seconds + started.elapsed().as_secs_f64(),
        rolled_back: read.restart.rolled_back,
        fenced: read.restart.fenced,
        assigned,
    })
}

fn slow_start_fault() {
    #[cfg(feature = "fault-injection")]
    if let Some(ms) = std::env::var(FAULT_SLOW_TASK_START_MS)
        .ok()
        .and_then(|v| v.parse().ok())
    {
        // Test builds only: a slow restore, while the consumer fetches the
        // partitions assigned with this one.
        std::thread::sleep(std::time::Duration::from_millis(ms));
    }
}

/// A changelog read into an operator.
struct ChangelogRead<O> {
    operator: O,
    restart: Restart,
    streamed: Streamed,
}

/// A read that failed, and whether the state refused what was read (reading
/// again would not help).
struct ReadFailure {
    error: KafkaSetupError,
    refused: bool,
}

/// Reads the changelog into a fresh operator as the plan says, again after a
/// broker error (a broker that times out or goes away for a moment) and once
/// more if the read finds another last marker than the plan's.
fn read_changelog<O: ServiceOperator>(
    loader: &ChangelogLoader,
    assigned: &mut Assigned,
    new_operator: &dyn Fn() -> Result<O, CoreError>,
) -> Result<ChangelogRead<O>, ServiceError> {
    let partition = assigned.partition;
    let mut attempt = 1;
    // Every read after the first stops where the first did.
    let mut end = None;
    loop {
        let failure = match read_once(loader, assigned, new_operator()?, end) {
            Ok(read) => {
                end = Some(read.streamed.end_offset as i64);
                if !decided_again(assigned, &read.restart)? {
                    return with_fenced_values(loader, assigned, read);
                }
                continue;
            }
            Err(failure) => failure,
        };
        if failure.refused || attempt >= RESTORE_ATTEMPTS {
            return Err(ServiceError::Task {
                partition,
                message: format!("restoring from the changelog (attempt {attempt}): {}", failure.error),
            });
        }
        // Read again from the start into a fresh state (later records for a
        // key win, so what a partial read applied, or wrote to the store, is
        // rewritten).
        let wait = RESTORE_RETRY_WAIT.saturating_mul(1 << (attempt - 1));
        tracing::warn!(
            partition,
            attempt,
            of = RESTORE_ATTEMPTS,
            error = %failure.error,
            retry_in_ms = wait.as_millis() as u64,
            "restoring from the changelog failed; reading it again"
        );
        std::thread::sleep(wait);
        attempt += 1;
    }
}

/// One read of the changelog, to `end` (its end now when `None`).
fn read_once<O: ServiceOperator>(
    loader: &ChangelogLoader,
    assigned: &Assigned,
    mut operator: O,
    end: Option<i64>,
) -> Result<ChangelogRead<O>, ReadFailure> {
    let plan = &assigned.plan;
    // The state logged at the marker the plan resumes from.
    let mut marked = MarkedState::for_plan(plan);
    let mut resolved = Vec::with_capacity(RESTORE_CHUNK);
    let mut apply = |records: &[BackupEntry]| -> Result<(), String> {
        resolved.clear();
        marked.resolve(records, &mut resolved).map_err(|e| e.to_string())?;
        operator.restore(&resolved).map_err(|e| e.to_string())?;
        if let Some((store, meta)) = &assigned.store {
            // Written as it is read, so memory holds one chunk; the offset is
            // the one the task resumes at.
            operator.stage_state();
            let mut meta = meta.clone();
            meta.checkpoint.next_offset = plan.resume_offset;
            store.write(&meta).map_err(|e| e.to_string())?;
            operator.state_durable();
        }
        Ok(())
    };
    let mut refused = false;
    let streamed = match injected_restore_failure() {
        Some(error) => Err(error),
        None => loader.stream(assigned.partition, end, RESTORE_CHUNK, |entries| {
            apply(entries).inspect_err(|_| refused = true)
        }),
    };
    match streamed {
        Ok(streamed) => Ok(ChangelogRead {
            operator,
            restart: marked.finish(),
            streamed,
        }),
        Err(error) => Err(ReadFailure { error, refused }),
    }
}

/// Whether the read found another last marker than the one the plan was
/// decided from; if so the plan is decided again from the one found, the
/// task's store emptied, and the plan continues above the sequences read.
fn decided_again(assigned: &mut Assigned, restart: &Restart) -> Result<bool, ServiceError> {
    let Some(inputs) = assigned.inputs.as_mut().filter(|i| i.marker != restart.last_marker) else {
        assigned.plan = assigned.plan.clone().continuing(restart);
        return Ok(false);
    };
    tracing::warn!(
        partition = assigned.partition,
        read_back = ?inputs.marker.as_ref().map(|m| m.input_offset),
        found = ?restart.last_marker.as_ref().map(|m| m.input_offset),
        "the changelog's last marker is not the one read back from its end (a previous owner wrote \
         behind a newer one, or wrote since); resuming from the one its order admits"
    );
    inputs.marker = restart.last_marker.clone();
    assigned.plan = inputs.decide();
    if let Some((store, _)) = &assigned.store {
        store.clear()?;
    }
    Ok(true)
}

/// Finds, by a second read to the same end, the restored value of the keys
/// whose latest record was fenced and whose value came from a record the
/// first read had already applied: they are written again with it.
fn with_fenced_values<O>(
    loader: &ChangelogLoader,
    assigned: &Assigned,
    mut read: ChangelogRead<O>,
) -> Result<ChangelogRead<O>, ServiceError> {
    if read.restart.unresolved.is_empty() {
        return Ok(read);
    }
    let mut watching = MarkedState::for_plan(&assigned.plan).watching(&read.restart.unresolved);
    let mut ignored = Vec::new();
    loader
        .stream(
            assigned.partition,
            Some(read.streamed.end_offset as i64),
            RESTORE_CHUNK,
            |entries| {
                ignored.clear();
                watching.resolve(entries, &mut ignored).map_err(|e| e.to_string())
            },
        )
        .map_err(|e| ServiceError::Task {
            partition: assigned.partition,
            message: format!("reading the changelog again for the keys a previous owner wrote late: {e}"),
        })?;
    read.restart.rolled_back = watching.finish().rolled_back;
    read.restart.unresolved.clear();
    Ok(read)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::{RecoveryPlan, TaskThresholds};

    fn marker(seq: u64, input_offset: u64) -> BackupMarker {
        BackupMarker {
            seq,
            input_offset,
            failures: 0,
            thresholds: TaskThresholds {
                theta: 1.0,
                max_uncovered: 1,
                max_unacked: 1,
            },
            clean: false,
            recent: Default::default(),
            writer: 0,
            covers: seq - 1,
            sources: Default::default(),
            inherited: u64::MAX,
        }
    }

    fn assigned(read_back: Option<BackupMarker>) -> Assigned {
        let inputs = PlanInputs {
            mode: Mode::Approximate,
            committed: None,
            constants: AnalysisConstants { alpha: 1.0, beta: 1 },
            marker: read_back,
        };
        Assigned {
            partition: 3,
            end: 0,
            restore_seconds: 0.0,
            plan: inputs.decide(),
            store: None,
            local: false,
            inputs: Some(inputs),
        }
    }

    #[test]
    fn a_full_read_that_finds_another_last_marker_decides_the_plan_again() {
        let one = 1 << crate::core::fence::COUNTER_BITS;
        // Read back from the end: a previous owner's marker (incarnation 1)
        // that the full read finds behind a newer owner's (incarnation 2).
        let zombie = marker(one | 9, 500);
        let newer = marker((2 * one) | 4, 800);
        let mut task = assigned(Some(zombie));
        assert_eq!(task.plan.resume_offset, 500);
        let found = Restart {
            last_marker: Some(newer.clone()),
            next_seq: (3 * one) | 1,
            ..Restart::default()
        };
        assert!(decided_again(&mut task, &found).unwrap());
        assert_eq!(task.plan.resume_offset, 800, "the newer owner's marker");
        assert_eq!(task.inputs.as_ref().and_then(|i| i.marker.clone()), Some(newer));
        assert!(!decided_again(&mut task, &found).unwrap(), "the second read agrees");
        assert_eq!(task.plan.next_seq, (3 * one) | 1, "above every sequence read");
    }

    #[test]
    fn a_full_read_that_agrees_keeps_the_plan() {
        let one = 1 << crate::core::fence::COUNTER_BITS;
        let last = marker(one | 9, 500);
        let mut task = assigned(Some(last.clone()));
        let before: RecoveryPlan = task.plan.clone();
        let found = Restart {
            last_marker: Some(last),
            next_seq: (2 * one) | 1,
            ..Restart::default()
        };
        assert!(!decided_again(&mut task, &found).unwrap());
        assert_eq!(task.plan.resume_offset, before.resume_offset);
    }
}
