//! Errors of the lease ledger.

use std::path::PathBuf;
use std::sync::Arc;
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
    /// The writer's queue is full, or the write waited longer than `queue_deadline` for its
    /// turn; nothing was decided or recorded, so the call can simply be retried.
    #[error("the lease ledger is overloaded; retry in {retry_after:?}")]
    Overloaded {
        /// How long the caller should wait before retrying.
        retry_after: Duration,
    },
    /// The request ID names a lease still within its window that was acquired for a different
    /// request (another selector, target or TTL).
    #[error("request ID {request_id:?} was already used for a different acquire")]
    RequestIdReused {
        /// The request ID.
        request_id: String,
    },
    /// The transaction of the batch this write was part of failed; nothing of the batch was
    /// recorded and the writer's memory was rolled back to match the file. Shared by every
    /// caller of the batch.
    #[error("the ledger could not record this write's batch (nothing of it was recorded): {0}")]
    BatchFailed(Arc<rusqlite::Error>),
    /// The batch this write was part of found the ledger full: SQLite answered SQLITE_FULL
    /// because the disk is full or the file reached its size bound (`max_size`). Nothing of
    /// the batch was recorded and memory was rolled back, as for [`LedgerError::BatchFailed`];
    /// the writer prunes the oldest history at once, so a retry may well succeed.
    #[error("the lease ledger is full (disk full or at its size bound); retry in {retry_after:?}")]
    Full {
        /// How long the caller should wait before retrying.
        retry_after: Duration,
    },
    /// The ledger's database cannot be reached (refused, lost or timed-out connections, tried
    /// again within a bound); nothing of the write was recorded, or, for a COMMIT whose answer
    /// was lost, a retry finds what was. Answered 503 with `Retry-After`; the pool connects
    /// again by itself once the database answers.
    #[error("the ledger's database cannot be reached ({reason}); retry in {retry_after:?}")]
    Unavailable {
        /// How long the caller should wait before retrying.
        retry_after: Duration,
        /// What the connection attempts met (never a password).
        reason: String,
    },
    /// The PostgreSQL ledger could not be opened: its database did not answer, refused the
    /// login, or could not be migrated.
    #[error("cannot open the ledger's database ({0})")]
    Connect(String),
    /// A PostgreSQL statement failed for a reason a retry would not mend.
    #[error("ledger database error: {0}")]
    Postgres(String),
    /// The ledger was shut down (or its writer stopped); no write is accepted any more.
    #[error("the lease ledger is shut down")]
    Closed,
    /// The writer thread could not be started.
    #[error("cannot start the ledger writer thread: {0}")]
    Writer(#[source] std::io::Error),
    /// The writer's in-memory state differs from the file (found by a self-check).
    #[error("ledger memory and file disagree: {0}")]
    Inconsistent(String),
    /// A release reason must be a short machine code (1-64 of `a-z`, `0-9`, `_`, `-`, `.`) so
    /// the history can be grouped by it; nothing was recorded.
    #[error(
        "release reason {0:?} is not a machine code (1 to 64 characters of a-z, 0-9, _, - and .)"
    )]
    InvalidReason(String),
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
    /// A read could not run (its blocking thread panicked, or the runtime is shutting down).
    #[error("the ledger read could not run: {0}")]
    Read(String),
    /// No database connection could be had.
    #[error("ledger connection pool: {0}")]
    Pool(#[from] r2d2::Error),
}

impl LedgerError {
    /// The same failure for another caller of a batch that failed as a whole (the errors a
    /// database transaction can end with are plain data; anything else is passed on as its
    /// message).
    pub(crate) fn shared(&self) -> LedgerError {
        match self {
            LedgerError::Overloaded { retry_after } => LedgerError::Overloaded {
                retry_after: *retry_after,
            },
            LedgerError::Full { retry_after } => LedgerError::Full {
                retry_after: *retry_after,
            },
            LedgerError::Unavailable {
                retry_after,
                reason,
            } => LedgerError::Unavailable {
                retry_after: *retry_after,
                reason: reason.clone(),
            },
            LedgerError::Inconsistent(message) => LedgerError::Inconsistent(message.clone()),
            other => LedgerError::Postgres(other.to_string()),
        }
    }
}
