//! Errors of the lease ledger.

use std::path::PathBuf;
use std::time::Duration;

use super::lease::LeaseState;

/// Why a ledger operation failed.
#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    /// No lease has this ID (never issued, or pruned after the cooldown window).
    #[error("unknown lease {0:?}")]
    UnknownLease(String),
    /// The lease exists but no longer counts (released or expired), so it cannot be renewed.
    #[error("lease {id:?} is {state}, not active")]
    NotActive {
        /// The lease ID.
        id: String,
        /// Its state at the time of the call.
        state: LeaseState,
    },
    /// The requested TTL rounds down to nothing.
    #[error("lease TTL {0:?} is too short: it must be at least 1 ms")]
    InvalidTtl(Duration),
    /// The ledger configuration cannot work.
    #[error("invalid ledger configuration: {0}")]
    Config(String),
    /// The file was written by a newer binary; opening it could corrupt it.
    #[error(
        "ledger {path} has schema version {found}, newer than version {supported} this binary \
         supports; run a newer proxy-operator or point --ledger at another file"
    )]
    Newer {
        /// The ledger file.
        path: PathBuf,
        /// The file's schema version.
        found: u32,
        /// The newest schema version this binary knows.
        supported: u32,
    },
    /// The file could not be opened, set up or migrated.
    #[error("cannot open ledger {path}: {source}")]
    Open {
        /// The ledger file.
        path: PathBuf,
        /// What SQLite said.
        #[source]
        source: rusqlite::Error,
    },
    /// A query failed.
    #[error("ledger database error: {0}")]
    Database(#[from] rusqlite::Error),
    /// No database connection could be had.
    #[error("ledger connection pool: {0}")]
    Pool(#[from] r2d2::Error),
}
