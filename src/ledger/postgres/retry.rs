//! What a failed PostgreSQL statement means for the ledger, and how often it is tried again.
//!
//! A transaction the database aborted to keep replicas consistent (a serialization failure,
//! a deadlock) decided nothing and runs again at once, a bounded number of times. A lost or
//! refused connection is tried again on a fresh connection, fewer times; when that fails too,
//! the caller is answered [`Unavailable`](crate::ledger::LedgerError::Unavailable) with a
//! `Retry-After`, and the pool connects again by itself when the database is back.

use std::time::Duration;

use tokio_postgres::error::SqlState;

/// Attempts of a transaction the database aborted for a conflict with another.
pub(crate) const CONFLICT_ATTEMPTS: u32 = 16;
/// Attempts over a lost or refused connection.
pub(crate) const CONNECTION_ATTEMPTS: u32 = 3;
/// What a caller answered 503 for a database that cannot be reached is told to wait.
pub(crate) const UNAVAILABLE_RETRY_AFTER: Duration = Duration::from_secs(1);

/// What a failed statement means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Failure {
    /// Aborted for a conflict with a concurrent transaction: nothing was decided, run again.
    Conflict,
    /// The connection is gone or the server cannot serve now: try another connection.
    Connection,
    /// The server's disk is full: nothing was recorded.
    Full,
    /// Anything else: a bug or a schema that does not match, not retried.
    Other,
}

impl Failure {
    /// Classifies a driver error.
    pub fn of(error: &tokio_postgres::Error) -> Failure {
        match error.code() {
            Some(code) => Failure::of_code(code),
            // No SQLSTATE: the driver lost the connection or could not make one.
            None => Failure::Connection,
        }
    }

    /// Classifies a server error code.
    pub fn of_code(code: &SqlState) -> Failure {
        let class = code.code().get(..2).unwrap_or_default();
        if *code == SqlState::T_R_SERIALIZATION_FAILURE || *code == SqlState::T_R_DEADLOCK_DETECTED
        {
            Failure::Conflict
        } else if *code == SqlState::DISK_FULL {
            Failure::Full
        } else if class == "08"
            || *code == SqlState::ADMIN_SHUTDOWN
            || *code == SqlState::CRASH_SHUTDOWN
            || *code == SqlState::CANNOT_CONNECT_NOW
            || *code == SqlState::TOO_MANY_CONNECTIONS
            || *code == SqlState::READ_ONLY_SQL_TRANSACTION
        {
            // A read-only transaction means the server became a standby in a failover: the
            // next connection finds the new primary.
            Failure::Connection
        } else {
            Failure::Other
        }
    }

    /// How long to wait before attempt `attempt` (1-based, the first retry is attempt 2) of
    /// a transaction that failed this way: a little longer each time, so replicas that
    /// conflicted do not meet again at once.
    pub fn backoff(self, attempt: u32) -> Duration {
        let step = match self {
            Failure::Conflict => Duration::from_millis(1),
            Failure::Connection => Duration::from_millis(100),
            Failure::Full | Failure::Other => Duration::ZERO,
        };
        step.saturating_mul(attempt.saturating_sub(1).min(8))
    }

    /// How many attempts a transaction failing this way gets in all.
    pub fn attempts(self) -> u32 {
        match self {
            Failure::Conflict => CONFLICT_ATTEMPTS,
            Failure::Connection => CONNECTION_ATTEMPTS,
            Failure::Full | Failure::Other => 1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_codes_are_retried_as_what_they_mean() {
        let cases = [
            ("40001", Failure::Conflict),
            ("40P01", Failure::Conflict),
            ("08006", Failure::Connection),
            ("08001", Failure::Connection),
            ("57P01", Failure::Connection),
            ("57P03", Failure::Connection),
            ("53300", Failure::Connection),
            ("25006", Failure::Connection),
            ("53100", Failure::Full),
            ("23505", Failure::Other),
            ("42P01", Failure::Other),
            ("22003", Failure::Other),
        ];
        for (code, failure) in cases {
            assert_eq!(
                Failure::of_code(&SqlState::from_code(code)),
                failure,
                "{code}"
            );
        }
    }

    #[test]
    fn retries_are_bounded_and_back_off() {
        assert_eq!(Failure::Conflict.attempts(), 16);
        assert_eq!(Failure::Connection.attempts(), 3);
        assert_eq!(Failure::Other.attempts(), 1);
        assert_eq!(Failure::Full.attempts(), 1);
        assert_eq!(Failure::Conflict.backoff(1), Duration::ZERO);
        assert_eq!(Failure::Conflict.backoff(3), Duration::from_millis(2));
        assert_eq!(Failure::Conflict.backoff(100), Duration::from_millis(8));
        assert_eq!(Failure::Connection.backoff(2), Duration::from_millis(100));
    }
}
