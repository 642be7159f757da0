//! Typed errors of the approximate-fault-tolerance core.

use thiserror::Error;

/// Everything the core can refuse. Every variant names what was wrong and why, so a
/// service can print it as is.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum CoreError {
    /// A threshold or parameter that can give no bound (negative, NaN, zero where a
    /// positive value is needed).
    #[error("invalid threshold `{name}` = {value}: {reason}")]
    InvalidThreshold {
        name: &'static str,
        value: String,
        reason: &'static str,
    },

    /// An operator or structure parameter that cannot work.
    #[error("invalid parameter `{name}` = {value}: {reason}")]
    InvalidParameter {
        name: &'static str,
        value: String,
        reason: String,
    },

    /// A backup entry written with an encoding this build does not know.
    #[error("backup entry uses encoding version {found}, this build reads version {supported}")]
    UnknownEncodingVersion { found: u8, supported: u8 },

    /// A backup entry that cannot be decoded.
    #[error("undecodable backup entry ({what}): {reason}")]
    Undecodable { what: &'static str, reason: String },
}

impl CoreError {
    pub(crate) fn undecodable(what: &'static str, reason: impl Into<String>) -> Self {
        CoreError::Undecodable {
            what,
            reason: reason.into(),
        }
    }

    pub(crate) fn parameter(name: &'static str, value: impl ToString, reason: impl Into<String>) -> Self {
        CoreError::InvalidParameter {
            name,
            value: value.to_string(),
            reason: reason.into(),
        }
    }
}
