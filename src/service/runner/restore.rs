//! Restoring tasks: several partitions' changelogs read side by side into
//! fresh operators, each the state logged at its last marker.

use std::collections::VecDeque;
use std::sync::Mutex;

use crate::core::BackupEntry;
use crate::service::codec::ServiceOperator;
use crate::service::kafka::{ChangelogLoader, ReaderPool};
use crate::service::ServiceError;

use super::task::Task;
use super::Assigned;

/// A task's operator with its state restored, before its driver starts.
pub(super) struct Restored<O> {
    pub(super) operator: O,
    pub(super) assigned: Assigned,
    pub(super) restored_records: u64,
    /// The changelog offset a restore from the changelog read to (the state is
    /// its records before it), for the experiment's check of a recovery.
    pub(super) changelog_end: Option<u64>,
    pub(super) restore_seconds: f64,
    /// The keys restored from priors, written before the start marker.
    pub(super) rolled_back: Vec<BackupEntry>,
}

/// At most this many tasks restore at once (each with a changelog reader of
/// its own): a rebalance that hands over many partitions neither opens a
/// client per partition nor restores them one after another.
pub(super) const RESTORE_PARALLELISM: usize = 4;

/// Restores the tasks assigned together side by side, in the order given.
/// A single one restores through `loader` (the one the rebalance read the
/// markers with, connected); several share a few workers, the first with
/// `loader`, the others with readers from `pool`.
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
            .map(|assigned| Task::<O>::restore(loader, operator_config, assigned, resident_keys))
            .collect();
    }
    let count = batch.len();
    let work = Mutex::new(batch.into_iter().enumerate().collect::<VecDeque<_>>());
    // (its place in the batch, its restore)
    type Outcome<O> = (usize, Result<Restored<O>, ServiceError>);
    let done: Mutex<Vec<Outcome<O>>> = Mutex::new(Vec::with_capacity(count));
    let restore_with = |reader: &ChangelogLoader| {
        while let Some((index, assigned)) = work.lock().ok().and_then(|mut w| w.pop_front()) {
            let result = Task::<O>::restore(reader, operator_config, assigned, resident_keys);
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
