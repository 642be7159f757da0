//! Fault switches the tests set through the environment (a restore that
//! fails, backups that write nothing, a slow start, a SIGKILL in a backup).

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
