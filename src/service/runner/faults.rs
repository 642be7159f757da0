//! Fault switches the tests set through the environment (a restore that
//! fails, backups that write nothing, a slow start, a SIGKILL in a backup,
//! changelog writes held back and landing late).

#[cfg(feature = "fault-injection")]
use std::sync::atomic::{AtomicU32, Ordering};

#[cfg(feature = "fault-injection")]
use rdkafka::error::{KafkaError, RDKafkaErrorCode};

use crate::service::kafka::KafkaSetupError;

/// Set in the environment of a build with the `fault-injection` feature to N,
/// the first N reads of a changelog for a restore fail as a broker that times
/// out does.
#[cfg(feature = "fault-injection")]
pub const FAULT_RESTORE_FAILURES: &str = "AFSTREAM_FAULT_RESTORE_FAILURES";

/// A changelog read that the fault-injection switch fails, if it does.
pub(super) fn injected_restore_failure() -> Option<KafkaSetupError> {
    #[cfg(feature = "fault-injection")]
    {
        static INJECTED: AtomicU32 = AtomicU32::new(0);
        let failures: u32 = std::env::var(FAULT_RESTORE_FAILURES)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        if INJECTED.fetch_add(1, Ordering::Relaxed) < failures {
            return Some(KafkaSetupError::Kafka(KafkaError::MetadataFetch(
                RDKafkaErrorCode::OperationTimedOut,
            )));
        }
    }
    None
}

/// Set in the environment of a build with the `fault-injection` feature, it
/// makes every task's backups write nothing (for tests that must fail).
#[cfg(feature = "fault-injection")]
pub const FAULT_SKIP_BACKUPS: &str = "AFSTREAM_FAULT_SKIP_BACKUPS";

/// Set in the environment of a build with the `fault-injection` feature, the
/// tasks keep the thresholds of failure 0 after every recovery (a broken
/// controller, for tests that must catch it).
#[cfg(feature = "fault-injection")]
pub const FAULT_NEVER_HALVE: &str = "AFSTREAM_FAULT_NEVER_HALVE";

/// `controller` with the faults the environment asks for (test builds only).
pub(super) fn with_controller_faults(controller: crate::core::ControllerConfig) -> crate::core::ControllerConfig {
    #[cfg(feature = "fault-injection")]
    if std::env::var_os(FAULT_NEVER_HALVE).is_some() {
        tracing::warn!("{FAULT_NEVER_HALVE} is set: the thresholds never halve");
        return controller.with_faults(crate::core::ControllerFaults {
            never_halve: true,
            ..crate::core::ControllerFaults::default()
        });
    }
    controller
}

/// Set in the environment of a build with the `fault-injection` feature to N,
/// every task takes N ms more to start, as a long restore does.
#[cfg(feature = "fault-injection")]
pub const FAULT_SLOW_TASK_START_MS: &str = "AFSTREAM_FAULT_SLOW_TASK_START_MS";

/// A crash at the worst point of a backup, for failure experiments (`afstream
/// experiment --kill-mid-backup`): set to N, the process SIGKILLs itself once
/// the entries of its N-th backup that writes any are acknowledged and before
/// its marker goes out, so the changelog ends with an incomplete backup after
/// the last marker. Counted over the process's tasks; a marker-only backup
/// does not count.
pub const CRASH_IN_BACKUP: &str = "AFSTREAM_CRASH_IN_BACKUP";

/// The backup [`CRASH_IN_BACKUP`] asks this process to die in, if any.
pub(super) fn crash_in_backup() -> Result<Option<u64>, crate::service::ServiceError> {
    let Ok(value) = std::env::var(CRASH_IN_BACKUP) else {
        return Ok(None);
    };
    let at = value.trim().parse::<u64>().map_err(|e| {
        crate::service::ServiceError::Unsupported(format!(
            "{CRASH_IN_BACKUP}={value:?}: a backup number is expected ({e})"
        ))
    })?;
    tracing::warn!("{CRASH_IN_BACKUP} is set: this process SIGKILLs itself in the middle of backup {at}");
    Ok(Some(at))
}

/// Set in the environment of a build with the `fault-injection` feature to a
/// file's path: while that file exists, the process holds its changelog
/// records instead of handing them to the producer (as if acknowledgements
/// were on their way), and once the file is gone it sends them, in order,
/// before any other: a stalled owner whose writes land late (a zombie).
#[cfg(feature = "fault-injection")]
pub const FAULT_HOLD_CHANGELOG: &str = "AFSTREAM_FAULT_HOLD_CHANGELOG";

#[cfg(feature = "fault-injection")]
mod hold {
    use std::path::PathBuf;
    use std::sync::{Mutex, OnceLock};

    use rdkafka::error::KafkaError;

    use super::FAULT_HOLD_CHANGELOG;
    use crate::core::BackupEntry;
    use crate::service::delivery::Delivery;

    /// A changelog record held back: its partition, the record, its report.
    type Held = (i32, BackupEntry, Delivery);

    static HELD: Mutex<Vec<Held>> = Mutex::new(Vec::new());

    fn hold_file() -> Option<&'static PathBuf> {
        static FILE: OnceLock<Option<PathBuf>> = OnceLock::new();
        FILE.get_or_init(|| std::env::var_os(FAULT_HOLD_CHANGELOG).map(PathBuf::from))
            .as_ref()
    }

    /// Whether the record is held back: the hold file exists.
    pub(crate) fn held(partition: i32, entry: &BackupEntry, delivery: Delivery) -> bool {
        let Some(file) = hold_file() else { return false };
        if !file.exists() {
            return false;
        }
        if let Ok(mut held) = HELD.lock() {
            held.push((partition, entry.clone(), delivery));
        }
        true
    }

    /// Once the hold file is gone, sends what was held through `send`.
    pub(crate) fn release(mut send: impl FnMut(i32, &BackupEntry, Delivery) -> Result<(), KafkaError>) {
        if hold_file().is_none_or(|file| file.exists()) {
            return;
        }
        let held = HELD
            .lock()
            .map(|mut held| std::mem::take(&mut *held))
            .unwrap_or_default();
        if held.is_empty() {
            return;
        }
        tracing::warn!(
            records = held.len(),
            "{FAULT_HOLD_CHANGELOG}: releasing the changelog records held back"
        );
        for (partition, entry, delivery) in &held {
            if let Err(error) = send(*partition, entry, *delivery) {
                tracing::warn!(partition, %error, "{FAULT_HOLD_CHANGELOG}: a held record was not sent");
            }
        }
    }
}

#[cfg(feature = "fault-injection")]
pub(super) use hold::{held as changelog_record_held, release as release_held_changelog};
