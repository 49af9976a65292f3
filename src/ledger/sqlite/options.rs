//! The settings only the SQLite ledger has: where its file's bytes stop, and what a commit
//! survives. PostgreSQL's room and durability are the database's own.

use crate::ledger::error::LedgerError;

/// Smallest size bound accepted (`max_size`): room for the schema, the WAL allowance and a
/// few thousand leases.
pub const MIN_MAX_SIZE: u64 = 1 << 20;
/// Default size bound: half of the 1 GiB volume the manifests ship, leaving the other half for
/// the `-shm` file, a temporary copy by an offline `VACUUM`, and slack.
pub const DEFAULT_MAX_SIZE: u64 = 512 << 20;

/// What a commit must survive.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Durability {
    /// WAL with `synchronous = NORMAL`: a commit is in the WAL file (the OS page cache) before
    /// the call returns, so an acknowledged lease survives the process being killed (`kill -9`,
    /// OOM, crash). A power loss or kernel crash may lose the last commits; the file stays
    /// consistent. No fsync per commit.
    #[default]
    Normal,
    /// WAL with `synchronous = FULL`: the WAL is fsynced at every commit, so acknowledged
    /// leases also survive a power loss, at the cost of one fsync per batch.
    Full,
}

impl Durability {
    pub(crate) fn synchronous(self) -> &'static str {
        match self {
            Durability::Normal => "NORMAL",
            Durability::Full => "FULL",
        }
    }
}

/// How the SQLite ledger keeps its file (`--ledger-max-size`, `--ledger-durability`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SqliteOptions {
    /// Bytes the database file and its WAL may take together; the oldest history is pruned
    /// to stay within it (see the `bound` module).
    pub max_size: u64,
    /// What an acknowledged write survives.
    pub durability: Durability,
}

impl Default for SqliteOptions {
    fn default() -> Self {
        SqliteOptions {
            max_size: DEFAULT_MAX_SIZE,
            durability: Durability::Normal,
        }
    }
}

impl SqliteOptions {
    pub(crate) fn validate(&self) -> Result<(), LedgerError> {
        check_max_size(self.max_size).map_err(LedgerError::Config)
    }
}

/// Refuses a bound too small to hold anything.
pub(crate) fn check_max_size(max_size: u64) -> Result<(), String> {
    if max_size < MIN_MAX_SIZE {
        return Err(format!(
            "max_size {max_size} bytes is too small for the ledger: at least {MIN_MAX_SIZE} \
             bytes (1 MiB) hold the schema, the WAL and a few thousand leases"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_size_bound_that_holds_nothing_is_refused() {
        let cases = [
            (DEFAULT_MAX_SIZE, true),
            (MIN_MAX_SIZE, true),
            (MIN_MAX_SIZE - 1, false),
            (64 * 1024, false),
        ];
        for (max_size, ok) in cases {
            let options = SqliteOptions {
                max_size,
                ..SqliteOptions::default()
            };
            assert_eq!(options.validate().is_ok(), ok, "{max_size}");
        }
    }
}
