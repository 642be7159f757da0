//! Where a newly assigned partition resumes: decided on the restore
//! thread, not in the rebalance callback.
//!
//! The callback runs inside the consumer's poll, on the loop's thread;
//! anything slow there (a previous owner's changelog that must fall quiet
//! first, up to [`HANDOFF_PATIENCE`]; a RocksDB store to open) stops the
//! loop: the member's other tasks take no input and no delivery reports, a
//! SIGTERM waits, and the next rebalance cannot go on until it returns. So
//! the callback only records what the group said (the partition, its
//! committed offset, the input's end) and assigns the partition at the
//! offset it would resume from with no marker; this module decides the real
//! plan beside the restore, which then seeks the fetch there if it differs
//! ([`super::TaskStarter`]).
//!
//! Decided here, for partitions assigned together: once their changelogs
//! have been unchanged for `pipeline.handoff_quiet_ms` (a previous owner
//! that has not stopped writing; waited for together), each one's last
//! marker; its local store, used only when the changelog's last marker is
//! the store's own and the machine has not restarted since the store's last
//! write (else recreated empty and restored from the changelog); and its
//! recovery plan.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::core::{BackupMarker, ControllerConfig, Mode, RecoveryPlan, StoreWrites};
use crate::service::codec::ServiceOperator;
use crate::service::config::Config;
use crate::service::kafka::ChangelogLoader;
use crate::service::store::{StoreBudget, StoreMeta, TaskStore};
use crate::service::ServiceError;

use super::restore::PlanInputs;
use super::{Assigned, POLL_BATCH};

/// The longest a newly assigned partition waits for its previous owner to
/// stop writing its changelog (see `ChangelogLoader::settled_markers`).
pub(super) const HANDOFF_PATIENCE: Duration = Duration::from_secs(20);

/// A partition the group assigned, before where it resumes is decided.
#[derive(Clone, Debug)]
pub(super) struct Assignment {
    pub(super) partition: i32,
    /// The input partition's end when it was assigned.
    pub(super) end: u64,
    /// The group's committed offset of the partition.
    pub(super) committed: Option<u64>,
    /// Where the partition is assigned at, and fetched from while its plan
    /// is decided ([`ResumePlanner::provisional_offset`]).
    pub(super) fetch_from: u64,
    pub(super) at: Instant,
}

impl Assignment {
    /// The partition with its plan: from its local store when `inputs` is
    /// none, else from the changelog as `inputs` decide.
    fn decided(
        self,
        plan: RecoveryPlan,
        store: Option<(TaskStore, StoreMeta)>,
        inputs: Option<PlanInputs>,
    ) -> Assigned {
        Assigned {
            partition: self.partition,
            end: self.end,
            restore_seconds: self.at.elapsed().as_secs_f64(),
            plan,
            store,
            local: inputs.is_none(),
            inputs,
        }
    }
}

/// Where the local stores of the pipeline's tasks live, and their budget.
#[derive(Clone, Debug)]
pub(super) struct LocalStores {
    root: PathBuf,
    budget: StoreBudget,
}

impl LocalStores {
    /// The stores of an operator that keeps its state in one, with a state directory.
    pub(super) fn of<O: ServiceOperator>(config: &Config) -> Option<Self> {
        let pipeline = &config.pipeline;
        match &pipeline.state_dir {
            Some(dir) if O::STORE_BACKED => Some(LocalStores {
                root: dir.join(&config.kafka.group_id),
                budget: StoreBudget {
                    cache_bytes: pipeline.store.cache_mib << 20,
                    resident_keys: pipeline.store.resident_keys,
                },
            }),
            _ => None,
        }
    }
}

/// What deciding a partition's resume point needs; cloned into each
/// restore thread.
#[derive(Clone, Debug)]
pub(super) struct ResumePlanner {
    input_topic: String,
    controller: ControllerConfig,
    stores: Option<LocalStores>,
    /// How long a changelog partition must stay unchanged before a task
    /// resumes from a marker that is not clean (`pipeline.handoff_quiet_ms`).
    handoff_quiet: Duration,
}

/// A task's local store as found.
enum OpenedStore {
    /// Exact at its offset; the changelog's last marker is its own (in mode
    /// none, with no changelog, the store is all there is).
    Usable { store: TaskStore, meta: StoreMeta },
    /// Empty: the task restores from the changelog into it.
    Fresh(TaskStore),
}

impl ResumePlanner {
    pub(super) fn new(config: &Config, controller: ControllerConfig, stores: Option<LocalStores>) -> Self {
        ResumePlanner {
            input_topic: config.pipeline.input_topic.clone(),
            controller,
            stores,
            handoff_quiet: Duration::from_millis(config.pipeline.handoff_quiet_ms),
        }
    }

    /// Where a partition's fetch starts while its plan is decided: where it
    /// resumes if its changelog holds no marker. (librdkafka seeks only a
    /// partition whose fetch has started, and with no offset given it would
    /// first look the committed offset up.)
    pub(super) fn provisional_offset(&self, committed: Option<u64>) -> u64 {
        self.inputs(committed, None).decide().resume_offset
    }

    fn inputs(&self, committed: Option<u64>, marker: Option<BackupMarker>) -> PlanInputs {
        PlanInputs {
            mode: self.controller.mode,
            committed,
            constants: self.controller.constants,
            marker,
        }
    }

    /// Decides where each partition of `batch` resumes, reading the last
    /// markers through `loader`.
    pub(super) fn decide(
        &self,
        loader: &ChangelogLoader,
        batch: Vec<Assignment>,
    ) -> Result<Vec<Assigned>, ServiceError> {
        let partitions: Vec<i32> = batch.iter().map(|a| a.partition).collect();
        let markers = loader.settled_markers(&partitions, self.handoff_quiet, HANDOFF_PATIENCE)?;
        batch
            .into_iter()
            .zip(markers)
            .map(|(assignment, marker)| self.plan(assignment, marker))
            .collect()
    }

    fn plan(&self, assignment: Assignment, marker: Option<BackupMarker>) -> Result<Assigned, ServiceError> {
        let partition = assignment.partition;
        let opened = match &self.stores {
            Some(stores) => Some(
                self.open_store(stores, partition, marker.as_ref())
                    .map_err(|message| ServiceError::Task { partition, message })?,
            ),
            None => None,
        };
        let store = match opened {
            Some(OpenedStore::Usable { store, meta }) => {
                let marker = marker.filter(|_| self.controller.mode != Mode::None);
                let writes = StoreWrites {
                    max_unwritten_items: POLL_BATCH as u64,
                    largest_gamma: self.controller.policy.for_failures(0).max_unacked,
                };
                let plan = RecoveryPlan::local(&meta.checkpoint, marker.as_ref(), writes, self.controller.constants);
                return Ok(assignment.decided(plan, Some((store, meta)), None));
            }
            Some(OpenedStore::Fresh(store)) => Some((store, TaskStore::new_meta(0))),
            None => None,
        };
        let inputs = self.inputs(assignment.committed, marker);
        Ok(assignment.decided(inputs.decide(), store, Some(inputs)))
    }

    fn open_store(
        &self,
        stores: &LocalStores,
        partition: i32,
        marker: Option<&BackupMarker>,
    ) -> Result<OpenedStore, String> {
        let path = stores.root.join(format!("{}-{partition}", self.input_topic));
        let (store, meta) = TaskStore::open(&path, stores.budget).map_err(|e| e.to_string())?;
        let Some(meta) = meta else {
            return Ok(OpenedStore::Fresh(store));
        };
        let refused = if !meta.trusted_after_crash() {
            "the machine restarted since its last write"
        } else if self.controller.mode == Mode::None || marker.map(|m| m.writer) == Some(meta.store_id) {
            return Ok(OpenedStore::Usable { store, meta });
        } else {
            "the changelog's last marker is not this store's (the partition moved, or the store is older)"
        };
        tracing::info!(partition, path = %path.display(), reason = refused, "local store not used; restoring from the changelog");
        drop(store);
        let store = TaskStore::recreate(&path, stores.budget).map_err(|e| e.to_string())?;
        Ok(OpenedStore::Fresh(store))
    }
}
