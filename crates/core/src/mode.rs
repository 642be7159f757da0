//! The fault-tolerance modes a pipeline can run in, side by side.

use serde::{Deserialize, Serialize};

use super::error::CoreError;

/// When exact mode backs up.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExactInterval {
    /// Back up after this many items.
    pub items: Option<u64>,
    /// Back up after this many milliseconds.
    pub millis: Option<u64>,
}

/// The fault-tolerance mode of a pipeline.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Mode {
    /// No backups and no markers; the group's offset is committed at a clean stop:
    /// the no-fault-tolerance baseline.
    None,
    /// Backups when the divergence crosses θ or ⌈l/4⌉ items have passed, a marker
    /// after each.
    Approximate,
    /// A complete backup and its marker every interval (Kafka Streams style).
    Exact(ExactInterval),
}

impl Mode {
    pub fn validate(&self) -> Result<(), CoreError> {
        if let Mode::Exact(interval) = self {
            let zero = interval.items == Some(0) || interval.millis == Some(0);
            if zero || (interval.items.is_none() && interval.millis.is_none()) {
                return Err(CoreError::parameter(
                    "exact interval",
                    format!("{interval:?}"),
                    "set a positive number of items, of milliseconds, or both",
                ));
            }
        }
        Ok(())
    }
}
