//! The PostgreSQL ledger's schema: the SQL files in `migrations/postgres/`, applied in order
//! at start. The version reached is the one row of `ledger_schema`, and that row is also the
//! lock: a start locks it (`SELECT … FOR UPDATE`) for the whole migration, so replicas that
//! start together migrate once and the others wait, then find nothing to do. A row lock,
//! not an advisory lock, because CockroachDB's advisory locks lock nothing.

use tokio_postgres::error::SqlState;

use crate::ledger::migration::Migration;
use crate::ledger::postgres::connect;

/// Every migration, in order; migration `i` brings the schema to version `i + 1`.
pub(crate) const MIGRATIONS: &[Migration] = &[
    Migration {
        name: "0001_lease_ledger.sql",
        sql: include_str!("../../../migrations/postgres/0001_lease_ledger.sql"),
    },
    Migration {
        name: "0002_pool_demand.sql",
        sql: include_str!("../../../migrations/postgres/0002_pool_demand.sql"),
    },
    Migration {
        name: "0003_tenants.sql",
        sql: include_str!("../../../migrations/postgres/0003_tenants.sql"),
    },
    Migration {
        name: "0004_fallback_steps.sql",
        sql: include_str!("../../../migrations/postgres/0004_fallback_steps.sql"),
    },
    Migration {
        name: "0005_traffic_hours.sql",
        sql: include_str!("../../../migrations/postgres/0005_traffic_hours.sql"),
    },
];

/// The schema version this binary reads and writes.
pub const POSTGRES_SCHEMA_VERSION: u32 = MIGRATIONS.len() as u32;

/// Creates the version row if this is a new database. Replicas creating the table at once
/// meet PostgreSQL's catalog race (`CREATE TABLE IF NOT EXISTS` is not atomic: a unique
/// violation on the type's name, or the type already existing); the table is there either
/// way, so that is tried again.
async fn ensure_version_row(client: &tokio_postgres::Client) -> Result<(), tokio_postgres::Error> {
    let create = "CREATE TABLE IF NOT EXISTS ledger_schema (\
                  id INT NOT NULL PRIMARY KEY CHECK (id = 1), version INT NOT NULL); \
                  INSERT INTO ledger_schema (id, version) VALUES (1, 0) ON CONFLICT (id) DO NOTHING";
    let mut attempts = 0;
    loop {
        attempts += 1;
        match client.batch_execute(create).await {
            Err(e) if attempts < 5 && is_creation_race(&e) => continue,
            other => return other,
        }
    }
}

/// Whether `error` is a concurrent creation of the same catalog object.
fn is_creation_race(error: &tokio_postgres::Error) -> bool {
    [
        SqlState::UNIQUE_VIOLATION,
        SqlState::DUPLICATE_OBJECT,
        SqlState::DUPLICATE_TABLE,
    ]
    .iter()
    .any(|code| error.code() == Some(code))
}

/// Brings the database to [`POSTGRES_SCHEMA_VERSION`] under the version row's lock; returns
/// how many migrations ran. Refuses a database a newer binary migrated.
pub(crate) async fn migrate(
    client: &mut tokio_postgres::Client,
    target: &str,
) -> Result<usize, String> {
    let failed = |e: tokio_postgres::Error| format!("migrating {target}: {}", connect::explain(&e));
    ensure_version_row(client).await.map_err(failed)?;
    let tx = client.transaction().await.map_err(failed)?;
    let found: i32 = tx
        .query_one(
            "SELECT version FROM ledger_schema WHERE id = 1 FOR UPDATE",
            &[],
        )
        .await
        .map_err(failed)?
        .get(0);
    let found = u32::try_from(found).unwrap_or(0);
    if found > POSTGRES_SCHEMA_VERSION {
        return Err(format!(
            "{target} has ledger schema version {found}, newer than version \
             {POSTGRES_SCHEMA_VERSION} this binary supports; run a newer proxy-operator"
        ));
    }
    let pending = &MIGRATIONS[found as usize..];
    for (version, migration) in (found + 1..).zip(pending) {
        log::info!("ledger {target}: applying migration {}", migration.name);
        tx.batch_execute(migration.sql).await.map_err(failed)?;
        let version = i32::try_from(version).unwrap_or(i32::MAX);
        tx.execute(
            "UPDATE ledger_schema SET version = $1 WHERE id = 1",
            &[&version],
        )
        .await
        .map_err(failed)?;
    }
    tx.commit().await.map_err(failed)?;
    Ok(pending.len())
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    #[test]
    fn every_file_in_migrations_postgres_is_applied_in_order() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations/postgres");
        crate::ledger::migration::assert_lists_directory(&dir, MIGRATIONS);
    }
}
