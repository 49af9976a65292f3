//! The ledger's schema: the SQL files in `migrations/`, applied in order when the file is
//! opened. The version reached is recorded in `PRAGMA user_version`.

use std::path::Path;

use rusqlite::{Connection, TransactionBehavior};

use crate::ledger::error::LedgerError;
use crate::ledger::migration::Migration;

/// Every migration, in order; migration `i` brings the schema to version `i + 1`.
pub(crate) const MIGRATIONS: &[Migration] = &[
    Migration {
        name: "0001_lease_ledger.sql",
        sql: include_str!("../../../migrations/0001_lease_ledger.sql"),
    },
    Migration {
        name: "0002_acquire_request_ids.sql",
        sql: include_str!("../../../migrations/0002_acquire_request_ids.sql"),
    },
    Migration {
        name: "0003_release_reasons.sql",
        sql: include_str!("../../../migrations/0003_release_reasons.sql"),
    },
    Migration {
        name: "0004_clients_and_cooldown_lengths.sql",
        sql: include_str!("../../../migrations/0004_clients_and_cooldown_lengths.sql"),
    },
    Migration {
        name: "0005_pool_demand.sql",
        sql: include_str!("../../../migrations/0005_pool_demand.sql"),
    },
    Migration {
        name: "0006_tenants.sql",
        sql: include_str!("../../../migrations/0006_tenants.sql"),
    },
    Migration {
        name: "0007_fallback_steps.sql",
        sql: include_str!("../../../migrations/0007_fallback_steps.sql"),
    },
    Migration {
        name: "0008_traffic_hours.sql",
        sql: include_str!("../../../migrations/0008_traffic_hours.sql"),
    },
];

/// The schema version this binary reads and writes.
pub const SCHEMA_VERSION: u32 = MIGRATIONS.len() as u32;

/// Brings the database to [`SCHEMA_VERSION`] in one write transaction, so two processes
/// opening the same file cannot both migrate it. Returns how many migrations ran; refuses a
/// database whose version is newer than this binary's.
pub(crate) fn migrate(conn: &mut Connection, path: &Path) -> Result<usize, LedgerError> {
    let open_error = |source| LedgerError::Open {
        path: path.to_owned(),
        source,
    };
    let tx = conn
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .map_err(open_error)?;
    let found: u32 = tx
        .pragma_query_value(None, "user_version", |row| row.get(0))
        .map_err(open_error)?;
    if found > SCHEMA_VERSION {
        return Err(LedgerError::Newer {
            path: path.to_owned(),
            found,
            supported: SCHEMA_VERSION,
        });
    }
    let pending = &MIGRATIONS[found as usize..];
    for (version, migration) in (found + 1..).zip(pending) {
        log::info!(
            "ledger {}: applying migration {}",
            path.display(),
            migration.name
        );
        tx.execute_batch(migration.sql).map_err(open_error)?;
        tx.pragma_update(None, "user_version", version)
            .map_err(open_error)?;
    }
    tx.commit().map_err(open_error)?;
    Ok(pending.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_file_in_migrations_is_applied_in_order() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations");
        crate::ledger::migration::assert_lists_directory(&dir, MIGRATIONS);
    }
}
