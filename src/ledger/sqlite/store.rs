//! The SQLite side of the ledger: opening and migrating the file, the readers' pool, loading
//! the writer's state at open, and the statements each write runs inside the writer's batch
//! transaction.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use r2d2::Pool;
use r2d2_sqlite::SqliteConnectionManager;
use rusqlite::types::Type;
use rusqlite::{Connection, OpenFlags, OptionalExtension, Row};

use super::bound::{SizeBound, Usage};
use super::checkpoint;
use super::options::Durability;
use super::schema;
use super::state::{ActiveLease, LedgerState, RequestEntry};
use crate::ledger::activity::{self, ActiveCooldown, Activity, EventEntry, EventsQuery};
use crate::ledger::demand;
use crate::ledger::error::LedgerError;
use crate::ledger::exits::{self, ExitChange, ExitRecord, ExitSeen, ExitWrite};
use crate::ledger::history::{Event, EventKind};
use crate::ledger::lease::{Lease, LeaseRow, LeaseRowError, LeaseState, ReportResult, SweepStats};
use crate::ledger::target_hold::TargetLimits;
use crate::ledger::traffic::{self, TrafficBytes, TrafficHour};
use crate::resources::proxy::ProxyId;

/// How long a connection waits for another process's write lock before failing.
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);
/// Connections in the readers' pool (`get` only; counts come from memory).
const POOL_SIZE: u32 = 4;
/// Page cache of the writer connection, in KiB. The writer keeps its cache across
/// transactions because no other connection of the process writes, so a larger one keeps the
/// hot index pages in memory.
const WRITER_CACHE_KIB: i64 = 32 * 1024;

/// The readers' connection pool.
pub(crate) type ReaderPool = Pool<SqliteConnectionManager>;

/// Opens (creating if needed) the file, switches it to WAL, applies pending migrations and
/// the size bound of `max_size` bytes; returns the connection the writer will own and the
/// bound's limits. Refuses a file written by a newer binary.
pub(crate) fn open_writer(
    path: &Path,
    durability: Durability,
    max_size: u64,
) -> Result<(Connection, SizeBound), LedgerError> {
    let open_error = |source| LedgerError::Open {
        path: path.to_owned(),
        source,
    };
    let mut conn = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_WRITE
            | OpenFlags::SQLITE_OPEN_CREATE
            | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .map_err(open_error)?;
    configure(&conn, durability).map_err(open_error)?;
    let mode: String = conn
        .pragma_update_and_check(None, "journal_mode", "WAL", |row| row.get(0))
        .map_err(open_error)?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(LedgerError::Config(format!(
            "ledger {} cannot use write-ahead logging (journal mode is {mode})",
            path.display()
        )));
    }
    let applied = schema::migrate(&mut conn, path)?;
    log::info!(
        "ledger {}: schema version {} ({applied} migrations applied), synchronous={}",
        path.display(),
        schema::SCHEMA_VERSION,
        durability.synchronous()
    );
    conn.pragma_update(None, "cache_size", -WRITER_CACHE_KIB)
        .map_err(open_error)?;
    let page_size: i64 = conn
        .pragma_query_value(None, "page_size", |row| row.get(0))
        .map_err(open_error)?;
    let page_size = from_sql_int(page_size);
    let bound = SizeBound::new(max_size, page_size).map_err(LedgerError::Config)?;
    apply_bound(&conn, &bound).map_err(open_error)?;
    let usage = usage(&conn).map_err(open_error)?;
    if usage.pages > bound.housekeeping_pages {
        log::warn!(
            "ledger {} is {} bytes, more than its size bound leaves the file ({} bytes): the \
             oldest history is pruned to make room, but the file only shrinks with an offline \
             VACUUM",
            path.display(),
            usage.pages * page_size,
            bound.housekeeping_pages * page_size
        );
    }
    Ok((conn, bound))
}

/// Keeps the WAL within its allowance (the writer checkpoints at half of it, a reset truncates
/// it back to it) and caps the file at the client writes' page limit.
fn apply_bound(conn: &Connection, bound: &SizeBound) -> rusqlite::Result<()> {
    conn.pragma_update(None, "journal_size_limit", to_sql_int(bound.wal_limit))?;
    checkpoint::take_over(conn)?;
    set_page_limit(conn, bound.client_pages)
}

/// Caps the database at `pages` (`max_page_count`): a write needing a page past it fails
/// with SQLITE_FULL. SQLite never sets it below the current page count.
pub(crate) fn set_page_limit(conn: &Connection, pages: u64) -> rusqlite::Result<()> {
    conn.pragma_update(None, "max_page_count", to_sql_int(pages))
}

/// Pages of the database and how many are free, as this connection sees them.
pub(crate) fn usage(conn: &Connection) -> rusqlite::Result<Usage> {
    conn.prepare_cached(
        "SELECT (SELECT page_count FROM pragma_page_count()), \
         (SELECT freelist_count FROM pragma_freelist_count())",
    )?
    .query_row([], |row| {
        Ok(Usage {
            pages: from_sql_int(row.get(0)?),
            free: from_sql_int(row.get(1)?),
        })
    })
}

/// Rows of lease history. History is deleted only from its start, so the span of `seq` is
/// its size, read from the two ends of the table instead of a scan.
pub(crate) fn history_rows(conn: &Connection) -> rusqlite::Result<u64> {
    conn.prepare_cached("SELECT coalesce(max(seq) - min(seq) + 1, 0) FROM lease_events")?
        .query_row([], |row| row.get(0).map(from_sql_int))
}

/// What one prune step deleted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Pruned {
    pub events: u64,
    pub traffic: u64,
    pub leases: u64,
}

/// Deletes up to `rows` of the oldest history, then of the oldest hourly traffic rows before
/// the current UTC day (today's count towards the budgets). Only when both run out does it go
/// on to finished leases, oldest expiry first, which late reports could still have named: never
/// an active lease, and never a released lease whose request ID may still be replayed (its
/// window, up to `expires_at`, is open at `now`).
pub(crate) fn prune_oldest(conn: &Connection, rows: u64, now: i64) -> rusqlite::Result<Pruned> {
    let count = |n: usize| u64::try_from(n).unwrap_or(u64::MAX);
    let events = count(
        conn.prepare_cached(
            "DELETE FROM lease_events WHERE seq < \
             (SELECT min(seq) FROM lease_events) + ?1",
        )?
        .execute([to_sql_int(rows)])?,
    );
    let traffic = match rows.saturating_sub(events) {
        0 => 0,
        rest => count(
            conn.prepare_cached(
                "DELETE FROM traffic_hours WHERE (hour_ms, tenant, namespace, name, pool, target) \
                 IN (SELECT hour_ms, tenant, namespace, name, pool, target FROM traffic_hours \
                 WHERE hour_ms < ?1 ORDER BY hour_ms LIMIT ?2)",
            )?
            .execute(rusqlite::params![traffic::day_start(now), to_sql_int(rest)])?,
        ),
    };
    let leases = match rows.saturating_sub(events).saturating_sub(traffic) {
        0 => 0,
        rest => count(
            conn.prepare_cached(
                "DELETE FROM leases WHERE id IN (SELECT id FROM leases \
                 WHERE state <> 'active' AND (request_id IS NULL OR expires_at <= ?1) \
                 ORDER BY expires_at LIMIT ?2)",
            )?
            .execute(rusqlite::params![now, to_sql_int(rest)])?,
        ),
    };
    Ok(Pruned {
        events,
        traffic,
        leases,
    })
}

/// A count or size as an SQL integer (saturating; the sizes here are far below the limit).
fn to_sql_int(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

/// An SQL count or size (never negative) as a count.
fn from_sql_int(value: i64) -> u64 {
    u64::try_from(value).unwrap_or(0)
}

/// The pool `get` reads through: WAL readers never wait for the writer.
pub(crate) fn reader_pool(path: &Path, durability: Durability) -> Result<ReaderPool, LedgerError> {
    let manager = SqliteConnectionManager::file(path)
        .with_flags(OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX)
        .with_init(move |conn| configure(conn, durability));
    Ok(Pool::builder()
        .max_size(POOL_SIZE)
        .min_idle(Some(1))
        .test_on_check_out(false)
        .build(manager)?)
}

/// The background checkpoint's own connection to the ledger at `path`.
pub(crate) fn checkpoint_connection(
    path: &Path,
    durability: Durability,
) -> rusqlite::Result<Connection> {
    let conn = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )?;
    configure(&conn, durability)?;
    Ok(conn)
}

/// Per-connection settings (the journal mode is a property of the file, set at open).
fn configure(conn: &Connection, durability: Durability) -> rusqlite::Result<()> {
    conn.busy_timeout(BUSY_TIMEOUT)?;
    conn.pragma_update(None, "foreign_keys", true)?;
    conn.pragma_update(None, "synchronous", durability.synchronous())
}

/// Everything the writer keeps in memory, read from the file: leases whose row says active
/// (past their expiry or not: the sweep marks those), every cooldown row, and the request IDs
/// whose lease is not past its expiry at `now` (the latest lease of an ID wins).
pub(crate) fn load_state(
    conn: &Connection,
    now: i64,
    limits: TargetLimits,
) -> rusqlite::Result<LedgerState> {
    let mut state = LedgerState::new(limits);
    let mut leases = conn.prepare(
        "SELECT id, proxy_namespace, proxy_name, proxy_uid, target, acquired_at, expires_at, \
         ttl_ms, request_id, client, tenant, session FROM leases WHERE state = 'active'",
    )?;
    let mut rows = leases.query([])?;
    while let Some(row) = rows.next()? {
        let id: String = row.get(0)?;
        let lease = ActiveLease {
            proxy: Arc::new(ProxyId {
                namespace: row.get(1)?,
                name: row.get(2)?,
                uid: row.get(3)?,
            }),
            target: row.get::<_, Option<String>>(4)?.map(Arc::from),
            acquired_at: row.get(5)?,
            expires_at: row.get(6)?,
            ttl_ms: row.get(7)?,
            request_id: row.get::<_, Option<String>>(8)?.map(Arc::from),
            client: row.get::<_, Option<String>>(9)?.map(Arc::from),
            tenant: row.get::<_, String>(10)?.into(),
            session: row.get::<_, Option<String>>(11)?.map(Arc::from),
        };
        state.restore_lease(id.into(), lease);
    }
    let mut cooldowns = conn.prepare("SELECT proxy_uid, target, until FROM cooldowns")?;
    let mut rows = cooldowns.query([])?;
    while let Some(row) = rows.next()? {
        let (uid, target): (String, String) = (row.get(0)?, row.get(1)?);
        state.restore_cooldown(&uid, &target, row.get(2)?);
    }
    let mut requests = conn.prepare(
        "SELECT tenant, request_id, id, request_fingerprint, expires_at FROM leases \
         WHERE request_id IS NOT NULL AND expires_at > ?1 ORDER BY acquired_at, id",
    )?;
    let mut rows = requests.query([now])?;
    while let Some(row) = rows.next()? {
        let (tenant, request_id): (String, String) = (row.get(0)?, row.get(1)?);
        let entry = RequestEntry {
            lease_id: row.get::<_, String>(2)?.into(),
            fingerprint: row.get::<_, String>(3)?.into(),
            expires_at: row.get(4)?,
        };
        state.restore_request((tenant.into(), request_id.into()), entry);
    }
    for (tenant, bytes) in bytes_today(conn, now)? {
        state.restore_day_bytes(tenant.into(), bytes, now);
    }
    Ok(state)
}

/// Each tenant's bytes through the gateway on the UTC day holding `now`.
fn bytes_today(conn: &Connection, now: i64) -> rusqlite::Result<Vec<(String, u64)>> {
    conn.prepare(
        "SELECT tenant, SUM(up + down) FROM traffic_hours INDEXED BY traffic_hours_by_tenant          WHERE hour_ms >= ?1 GROUP BY tenant",
    )?
    .query_map([traffic::day_start(now)], |row| {
        Ok((row.get(0)?, from_sql_int(row.get(1)?)))
    })?
    .collect()
}

/// Inserts a granted lease and its `acquired` event (with the fallback chain's step that
/// served it, if any).
pub(crate) fn insert_lease(
    conn: &Connection,
    id: &str,
    lease: &ActiveLease,
    fingerprint: Option<&str>,
    fallback_step: Option<u32>,
) -> rusqlite::Result<()> {
    conn.prepare_cached(
        "INSERT INTO leases (id, proxy_namespace, proxy_name, proxy_uid, target, state, \
         acquired_at, expires_at, ttl_ms, request_id, request_fingerprint, client, tenant, \
         session) VALUES (?1, ?2, ?3, ?4, ?5, 'active', ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13)",
    )?
    .execute(rusqlite::params![
        id,
        lease.proxy.namespace,
        lease.proxy.name,
        lease.proxy.uid,
        lease.target.as_deref(),
        lease.acquired_at,
        lease.expires_at,
        lease.ttl_ms,
        lease.request_id.as_deref(),
        fingerprint,
        lease.client.as_deref(),
        lease.tenant,
        lease.session.as_deref(),
    ])?;
    record(
        conn,
        &Event {
            fallback_step,
            ..event_of(EventKind::Acquired, lease.acquired_at, id, lease)
        },
    )
}

/// Marks a lease released at `now`, with its `released` event; both carry `reason` when the
/// operator ended the lease (a crawler's release has none).
pub(crate) fn release_lease(
    conn: &Connection,
    id: &str,
    lease: &ActiveLease,
    now: i64,
    reason: Option<&str>,
) -> rusqlite::Result<()> {
    conn.prepare_cached(
        "UPDATE leases SET state = 'released', released_at = ?2, release_reason = ?3 \
         WHERE id = ?1",
    )?
    .execute(rusqlite::params![id, now, reason])?;
    record(
        conn,
        &Event {
            reason,
            ..event_of(EventKind::Released, now, id, lease)
        },
    )
}

/// Marks the leases the operator ended (see `LedgerState::end_leases`) released at `now`
/// with `reason`, one `released` event each carrying it.
pub(crate) fn end_leases(
    conn: &Connection,
    ended: &[(Arc<str>, ActiveLease)],
    reason: &str,
    now: i64,
) -> rusqlite::Result<()> {
    for (id, lease) in ended {
        release_lease(conn, id, lease, now, Some(reason))?;
    }
    Ok(())
}

/// Moves a lease's expiry (renew), with its `renewed` event.
pub(crate) fn renew_lease(
    conn: &Connection,
    id: &str,
    lease: &ActiveLease,
    now: i64,
) -> rusqlite::Result<()> {
    conn.prepare_cached("UPDATE leases SET expires_at = ?2, ttl_ms = ?3 WHERE id = ?1")?
        .execute(rusqlite::params![id, lease.expires_at, lease.ttl_ms])?;
    record(conn, &event_of(EventKind::Renewed, now, id, lease))
}

/// Records a report; a `cooldown_ms` puts `(cooled, target)` into cooldown until `now` plus
/// that long (keeping a later end already stored), recorded with the report. `cooled` is the
/// proxy's UID or one of its exits' key ([`LeaseReport::cooled`](crate::ledger::LeaseReport::cooled)).
pub(crate) fn report(
    conn: &Connection,
    lease: &Lease,
    cooled: &str,
    target: Option<&str>,
    result: ReportResult,
    now: i64,
    cooldown_ms: Option<i64>,
) -> rusqlite::Result<()> {
    record(
        conn,
        &Event {
            result: Some(result),
            cooldown_ms,
            ..Event::new(
                EventKind::Reported,
                now,
                &lease.id,
                &lease.tenant,
                &lease.proxy,
                target,
                lease.expires_at.as_millisecond(),
            )
        },
    )?;
    let until = cooldown_ms.map(|ms| now.saturating_add(ms));
    if let (Some(until), Some(target)) = (until, target) {
        conn.prepare_cached(
            "INSERT INTO cooldowns (proxy_uid, target, proxy_namespace, proxy_name, \
             until, result, lease_id) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7) \
             ON CONFLICT (proxy_uid, target) DO UPDATE SET \
             until = max(until, excluded.until), result = excluded.result, \
             lease_id = excluded.lease_id, proxy_namespace = excluded.proxy_namespace, \
             proxy_name = excluded.proxy_name",
        )?
        .execute(rusqlite::params![
            cooled,
            target,
            lease.proxy.namespace,
            lease.proxy.name,
            until,
            result.as_str(),
            lease.id
        ])?;
    }
    Ok(())
}

/// Marks leases past their expiry as expired (with one `expired` event each, timed at the
/// expiry, when `expiry_events`), deletes finished leases whose expiry is older than
/// `retained_ms`, ended cooldowns, and history older than `retention_ms`. History is deleted
/// from its start up to the first row inside the retention period, so the scan touches only
/// what it deletes.
pub(crate) fn sweep(
    conn: &Connection,
    now: i64,
    retained_ms: i64,
    retention_ms: i64,
    expiry_events: bool,
) -> rusqlite::Result<SweepStats> {
    if expiry_events {
        conn.prepare_cached(
            "INSERT INTO lease_events (at, lease_id, kind, proxy_namespace, proxy_name, \
         proxy_uid, target, expires_at, tenant) \
         SELECT expires_at, id, 'expired', proxy_namespace, proxy_name, proxy_uid, \
         target, expires_at, tenant FROM leases \
         WHERE state = 'active' AND expires_at <= ?1 ORDER BY expires_at",
        )?
        .execute([now])?;
    }
    let expired = conn
        .prepare_cached(
            "UPDATE leases SET state = 'expired' WHERE state = 'active' AND expires_at <= ?1",
        )?
        .execute([now])?;
    let leases_pruned = conn
        .prepare_cached("DELETE FROM leases WHERE state <> 'active' AND expires_at < ?1")?
        .execute([now.saturating_sub(retained_ms)])?;
    let cooldowns_pruned = conn
        .prepare_cached("DELETE FROM cooldowns WHERE until <= ?1")?
        .execute([now])?;
    let events_pruned = conn
        .prepare_cached(
            "DELETE FROM lease_events WHERE seq < coalesce(\
             (SELECT seq FROM lease_events WHERE at >= ?1 ORDER BY seq LIMIT 1), \
             (SELECT max(seq) + 1 FROM lease_events), 0)",
        )?
        .execute([now.saturating_sub(retention_ms)])?;
    let demand_pruned = conn
        .prepare_cached("DELETE FROM pool_demand WHERE bucket_start_ms <= ?1")?
        .execute([demand::retention_cutoff(now)])?;
    let traffic_pruned = conn
        .prepare_cached("DELETE FROM traffic_hours WHERE hour_ms <= ?1")?
        .execute([traffic::retention_cutoff(now, retention_ms)])?;
    let history_cutoff = now.saturating_sub(retention_ms);
    conn.prepare_cached(exits::PRUNE_CHANGES_SQL)?
        .execute([history_cutoff])?;
    conn.prepare_cached(exits::PRUNE_EXITS_SQL)?
        .execute([history_cutoff])?;
    let count = |n: usize| u64::try_from(n).unwrap_or(u64::MAX);
    Ok(SweepStats {
        expired: count(expired),
        leases_pruned: count(leases_pruned),
        cooldowns_pruned: count(cooldowns_pruned),
        events_pruned: count(events_pruned),
        demand_pruned: count(demand_pruned),
        traffic_pruned: count(traffic_pruned),
    })
}

/// Counts one refused request for each of `pools` (distinct) in the bucket holding `now`.
pub(crate) fn record_demand(
    conn: &Connection,
    pools: &[impl AsRef<str>],
    now: i64,
) -> rusqlite::Result<()> {
    let mut upsert = conn.prepare_cached(
        "INSERT INTO pool_demand (pool, bucket_start_ms, requests) VALUES (?1, ?2, 1) \
         ON CONFLICT (pool, bucket_start_ms) DO UPDATE SET requests = requests + 1",
    )?;
    let bucket = demand::bucket_start(now);
    for pool in pools {
        upsert.execute(rusqlite::params![pool.as_ref(), bucket])?;
    }
    Ok(())
}

/// The refusals per pool in the buckets overlapping the last `window` at `now`.
pub(crate) fn recent_demand(
    conn: &Connection,
    window: Duration,
    now: i64,
) -> rusqlite::Result<HashMap<String, u64>> {
    let (after, until) = demand::window_bounds(now, window);
    conn.prepare_cached(
        "SELECT pool, SUM(requests) FROM pool_demand \
         WHERE bucket_start_ms > ?1 AND bucket_start_ms <= ?2 GROUP BY pool",
    )?
    .query_map([after, until], |row| {
        Ok((row.get::<_, String>(0)?, from_sql_int(row.get(1)?)))
    })?
    .collect()
}

/// Adds `bytes` (merged by row) to the rows of the hour holding `now`; returns the bytes per
/// tenant it added.
pub(crate) fn record_traffic(
    conn: &Connection,
    bytes: &[TrafficBytes],
    now: i64,
) -> rusqlite::Result<HashMap<String, u64>> {
    let rows = traffic::merged(bytes);
    let mut upsert = conn.prepare_cached(
        "INSERT INTO traffic_hours (hour_ms, tenant, namespace, name, pool, target, up, down) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8) \
         ON CONFLICT (hour_ms, tenant, namespace, name, pool, target) DO UPDATE \
         SET up = up + excluded.up, down = down + excluded.down",
    )?;
    let hour = traffic::hour_start(now);
    for ((tenant, namespace, name, pool, target), up, down) in &rows {
        upsert.execute(rusqlite::params![
            hour,
            tenant,
            namespace,
            name,
            pool,
            target,
            traffic::to_sql(*up),
            traffic::to_sql(*down),
        ])?;
    }
    Ok(traffic::per_tenant(&rows)
        .into_iter()
        .map(|(tenant, bytes)| (tenant.to_owned(), bytes))
        .collect())
}

/// The hourly traffic rows whose hour starts at or after `since`, oldest first.
pub(crate) fn traffic(conn: &Connection, since: i64) -> rusqlite::Result<Vec<TrafficHour>> {
    conn.prepare_cached(
        "SELECT hour_ms, tenant, namespace, name, pool, target, up, down FROM traffic_hours \
         WHERE hour_ms >= ?1 ORDER BY hour_ms, tenant, namespace, name, pool, target",
    )?
    .query_map([since], |row| {
        Ok(TrafficHour {
            hour_ms: row.get(0)?,
            bytes: TrafficBytes {
                tenant: row.get(1)?,
                namespace: row.get(2)?,
                name: row.get(3)?,
                pool: traffic::pool_of(row.get(4)?),
                target: row.get(5)?,
                up: traffic::from_sql(row.get(6)?),
                down: traffic::from_sql(row.get(7)?),
            },
        })
    })?
    .collect()
}

/// Acquires and reports per target since `since` (ms) and the cooldowns in force at `now`
/// (see [`activity`]).
pub(crate) fn activity(
    conn: &Connection,
    since: i64,
    now: i64,
    tenant: Option<&str>,
) -> rusqlite::Result<Activity> {
    let mut found = Activity::default();
    let mut counts = conn.prepare_cached(activity::TARGET_COUNTS_SQL)?;
    let mut rows = counts.query((activity::SCAN_EVENTS, since, tenant))?;
    while let Some(row) = rows.next()? {
        let kind: String = row.get(1)?;
        let result: Option<String> = row.get(2)?;
        found.add(
            row.get(0)?,
            &kind,
            result.as_deref(),
            from_sql_int(row.get(3)?),
        );
    }
    found.cooldowns = conn
        .prepare_cached(activity::COOLDOWNS_SQL)?
        .query_map((now, activity::MAX_COOLDOWNS), |row| {
            Ok(ActiveCooldown {
                target: row.get(0)?,
                namespace: row.get(1)?,
                name: row.get(2)?,
                until_ms: row.get(3)?,
                result: row.get(4)?,
            })
        })?
        .collect::<rusqlite::Result<_>>()?;
    Ok(found)
}

/// The newest history events `query` asks for.
pub(crate) fn events(conn: &Connection, query: &EventsQuery) -> rusqlite::Result<Vec<EventEntry>> {
    let decode = |row: &Row<'_>| {
        Ok(EventEntry {
            seq: row.get(0)?,
            at_ms: row.get(1)?,
            lease_id: row.get(2)?,
            kind: row.get(3)?,
            namespace: row.get(4)?,
            name: row.get(5)?,
            target: row.get(6)?,
            result: row.get(7)?,
            reason: row.get(8)?,
            client: row.get(9)?,
            tenant: row.get(10)?,
        })
    };
    match (&query.proxy, &query.tenant) {
        (None, None) => conn
            .prepare_cached(activity::EVENTS_SQL)?
            .query_map([query.bound()], decode)?
            .collect(),
        (None, Some(tenant)) => conn
            .prepare_cached(activity::TENANT_EVENTS_SQL)?
            .query_map((tenant, activity::SCAN_EVENTS, query.bound()), decode)?
            .collect(),
        (Some((namespace, name)), tenant) => conn
            .prepare_cached(activity::PROXY_EVENTS_SQL)?
            .query_map(
                (
                    namespace,
                    name,
                    activity::SCAN_EVENTS,
                    tenant.as_deref(),
                    query.bound(),
                ),
                decode,
            )?
            .collect(),
    }
}

/// Records the exit a check found (see `Ledger::record_exit`), inside the writer's batch.
pub(crate) fn record_exit(
    conn: &Connection,
    exit: &ExitRecord,
    now: i64,
    confirm_after_ms: i64,
) -> rusqlite::Result<ExitSeen> {
    let row: Option<(String, i64, i64)> = conn
        .prepare_cached(exits::SELECT_EXIT_SQL)?
        .query_row([&exit.proxy.uid], |row| {
            Ok((row.get(0)?, row.get(1)?, row.get(2)?))
        })
        .optional()?;
    let current = row
        .as_ref()
        .map(|(ip, changed, confirmed)| (ip.as_str(), *changed, *confirmed));
    let write = exits::exit_write(current, &exit.exit_ip, now, confirm_after_ms);
    let changed_at = match write {
        ExitWrite::Keep { changed_at } => {
            return Ok(ExitSeen {
                changed_at_ms: changed_at,
                changed: false,
            });
        }
        ExitWrite::Confirm { changed_at } => changed_at,
        ExitWrite::Change => {
            conn.prepare_cached(exits::INSERT_CHANGE_SQL)?.execute((
                now,
                &exit.proxy.namespace,
                &exit.proxy.name,
                &exit.proxy.uid,
                row.as_ref().map(|(ip, _, _)| ip.as_str()),
                &exit.exit_ip,
                exit.country.as_deref(),
                exit.asn,
            ))?;
            now
        }
    };
    conn.prepare_cached(exits::UPSERT_EXIT_SQL)?.execute((
        &exit.proxy.uid,
        &exit.exit_ip,
        changed_at,
        now,
    ))?;
    Ok(ExitSeen {
        changed_at_ms: changed_at,
        changed: write == ExitWrite::Change,
    })
}

/// The newest exit changes, of every proxy or of one.
pub(crate) fn exit_changes(
    conn: &Connection,
    proxy: Option<&(String, String)>,
    limit: i64,
) -> rusqlite::Result<Vec<ExitChange>> {
    let decode = |row: &Row<'_>| {
        Ok(ExitChange {
            seq: row.get(0)?,
            at_ms: row.get(1)?,
            namespace: row.get(2)?,
            name: row.get(3)?,
            previous_ip: row.get(4)?,
            exit_ip: row.get(5)?,
            country: row.get(6)?,
            asn: row.get(7)?,
        })
    };
    match proxy {
        None => conn
            .prepare_cached(exits::CHANGES_SQL)?
            .query_map([limit], decode)?
            .collect(),
        Some((namespace, name)) => conn
            .prepare_cached(exits::PROXY_CHANGES_SQL)?
            .query_map((namespace, name, limit), decode)?
            .collect(),
    }
}

/// A `kind` event on an in-memory lease; an `acquired` one names the crawler that took it.
fn event_of<'a>(kind: EventKind, at: i64, lease_id: &'a str, lease: &'a ActiveLease) -> Event<'a> {
    Event {
        client: match kind {
            EventKind::Acquired => lease.client.as_deref(),
            _ => None,
        },
        ..Event::new(
            kind,
            at,
            lease_id,
            &lease.tenant,
            &lease.proxy,
            lease.target.as_deref(),
            lease.expires_at,
        )
    }
}

/// Appends one row to the lease history.
fn record(conn: &Connection, event: &Event<'_>) -> rusqlite::Result<()> {
    conn.prepare_cached(
        "INSERT INTO lease_events (at, lease_id, kind, proxy_namespace, proxy_name, proxy_uid, \
         target, result, expires_at, reason, cooldown_ms, client, tenant, fallback_step) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14)",
    )?
    .execute(rusqlite::params![
        event.at,
        event.lease_id,
        event.kind.as_str(),
        event.proxy.namespace,
        event.proxy.name,
        event.proxy.uid,
        event.target,
        event.result.map(ReportResult::as_str),
        event.expires_at,
        event.reason,
        event.cooldown_ms,
        event.client,
        event.tenant,
        event.fallback_step
    ])?;
    Ok(())
}

/// The lease with this ID if its row is retained, whatever its tenant (the callers compare
/// it). An active lease past its expiry reads as expired even before the sweep marks it.
pub(crate) fn lease_by_id(
    conn: &Connection,
    id: &str,
    now: i64,
) -> rusqlite::Result<Option<Lease>> {
    conn.prepare_cached(
        "SELECT id, proxy_namespace, proxy_name, proxy_uid, target, state, acquired_at, \
         expires_at, ttl_ms, released_at, release_reason, client, tenant, session FROM leases \
         WHERE id = ?1",
    )?
    .query_row([id], |row| lease_from_row(row, now))
    .optional()
}

fn lease_from_row(row: &Row<'_>, now: i64) -> rusqlite::Result<Lease> {
    let state: String = row.get(5)?;
    LeaseRow {
        id: row.get(0)?,
        proxy: ProxyId {
            namespace: row.get(1)?,
            name: row.get(2)?,
            uid: row.get(3)?,
        },
        target: row.get(4)?,
        state: &state,
        acquired_at: row.get(6)?,
        expires_at: row.get(7)?,
        ttl_ms: row.get(8)?,
        released_at: row.get(9)?,
        release_reason: row.get(10)?,
        client: row.get(11)?,
        tenant: row.get(12)?,
        session: row.get(13)?,
    }
    .decode(now)
    .map_err(row_error)
}

/// The lease an in-memory active lease describes, as of `now`.
pub(crate) fn lease_of(id: &str, lease: &ActiveLease, now: i64) -> rusqlite::Result<Lease> {
    LeaseRow {
        id: id.to_owned(),
        proxy: ProxyId::clone(&lease.proxy),
        target: lease.target.as_deref().map(str::to_owned),
        state: LeaseState::Active.as_str(),
        acquired_at: lease.acquired_at,
        expires_at: lease.expires_at,
        ttl_ms: lease.ttl_ms,
        released_at: None,
        release_reason: None,
        client: lease.client.as_deref().map(str::to_owned),
        tenant: lease.tenant.to_string(),
        session: lease.session.as_deref().map(str::to_owned),
    }
    .decode(now)
    .map_err(row_error)
}

/// A row that names no lease, as the conversion failure of the column at fault.
fn row_error(error: LeaseRowError) -> rusqlite::Error {
    match error {
        LeaseRowError::State(e) => {
            rusqlite::Error::FromSqlConversionFailure(5, Type::Text, Box::new(e))
        }
        LeaseRowError::Time { source, .. } => {
            rusqlite::Error::FromSqlConversionFailure(0, Type::Integer, Box::new(source))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(uid: &str, expires_at: i64, request_id: Option<&str>) -> ActiveLease {
        ActiveLease {
            client: None,
            proxy: Arc::new(ProxyId {
                namespace: "crawl".into(),
                name: uid.into(),
                uid: uid.into(),
            }),
            target: Some("t.example".into()),
            acquired_at: 10,
            expires_at,
            ttl_ms: expires_at - 10,
            request_id: request_id.map(Arc::from),
            tenant: crate::ledger::DEFAULT_TENANT.into(),
            session: None,
        }
    }

    fn ids(conn: &Connection) -> Vec<String> {
        let mut statement = conn.prepare("SELECT id FROM leases ORDER BY id").unwrap();
        statement
            .query_map([], |r| r.get(0))
            .unwrap()
            .map(Result::unwrap)
            .collect()
    }

    #[test]
    fn pruning_takes_history_first_then_finished_leases_no_replay_can_name() {
        let dir = tempfile::tempdir().unwrap();
        let (conn, _) = open_writer(
            &dir.path().join("ledger.db"),
            Durability::Normal,
            crate::ledger::DEFAULT_MAX_SIZE,
        )
        .unwrap();
        let now = 1_000;
        // (id, expiry, request ID, released at `now - 1`)
        let leases = [
            ("active", 5_000, None, false),
            ("released-open-window", 4_000, Some("r1"), true),
            ("released-closed-window", 300, Some("r2"), true),
            ("released-no-request", 200, None, true),
            ("expired", 400, None, false),
        ];
        for (id, expires_at, request_id, released) in leases {
            let lease = lease(id, expires_at, request_id);
            insert_lease(&conn, id, &lease, request_id.map(|_| "fp"), None).unwrap();
            if released {
                release_lease(&conn, id, &lease, now - 1, None).unwrap();
            }
        }
        sweep(&conn, now, 1_000_000, 1_000_000, true).unwrap();
        assert_eq!(history_rows(&conn).unwrap(), 9);

        let bytes = |target: &str| TrafficBytes {
            tenant: "team-a".into(),
            namespace: "crawl".into(),
            name: "p".into(),
            pool: None,
            target: target.into(),
            up: 1,
            down: 2,
        };
        record_traffic(&conn, &[bytes("yesterday.example")], now - traffic::DAY_MS).unwrap();
        record_traffic(&conn, &[bytes("today.example")], now).unwrap();
        // History goes first, oldest first.
        let pruned = prune_oldest(&conn, 4, now).unwrap();
        assert_eq!(
            pruned,
            Pruned {
                events: 4,
                traffic: 0,
                leases: 0
            }
        );
        let first: i64 = conn
            .query_row("SELECT min(seq) FROM lease_events", [], |r| r.get(0))
            .unwrap();
        assert_eq!(first, 5);
        // Then traffic rows before today, then finished leases, oldest expiry first, once
        // the history has run out.
        let pruned = prune_oldest(&conn, 8, now).unwrap();
        assert_eq!(
            pruned,
            Pruned {
                events: 5,
                traffic: 1,
                leases: 2
            }
        );
        assert_eq!(
            ids(&conn),
            ["active", "expired", "released-open-window"],
            "the two oldest finished leases went"
        );
        // Never an active lease, nor one whose request ID may still be replayed.
        let pruned = prune_oldest(&conn, 100, now).unwrap();
        assert_eq!(
            pruned,
            Pruned {
                events: 0,
                traffic: 0,
                leases: 1
            }
        );
        assert_eq!(ids(&conn), ["active", "released-open-window"]);
        assert_eq!(prune_oldest(&conn, 100, now).unwrap(), Pruned::default());
        let kept: Vec<String> = traffic(&conn, 0)
            .unwrap()
            .into_iter()
            .map(|row| row.bytes.target)
            .collect();
        assert_eq!(kept, ["today.example"], "today's bytes are never pruned");
        assert_eq!(history_rows(&conn).unwrap(), 0);
    }

    #[test]
    fn demand_is_one_row_per_pool_and_bucket_read_by_window_and_swept_after_the_retention() {
        let dir = tempfile::tempdir().unwrap();
        let (conn, _) = open_writer(
            &dir.path().join("ledger.db"),
            Durability::Normal,
            crate::ledger::DEFAULT_MAX_SIZE,
        )
        .unwrap();
        let rows = || -> Vec<(String, i64, i64)> {
            let mut statement = conn
                .prepare("SELECT pool, bucket_start_ms, requests FROM pool_demand ORDER BY 1, 2")
                .unwrap();
            statement
                .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
                .unwrap()
                .map(Result::unwrap)
                .collect()
        };
        let bucket = 1_767_225_600_000;
        record_demand(&conn, &["crawl/a", "crawl/b"], bucket + 1).unwrap();
        record_demand(&conn, &["crawl/a"], bucket + 9_999).unwrap();
        record_demand(&conn, &["crawl/a"], bucket + 10_000).unwrap();
        assert_eq!(
            rows(),
            [
                ("crawl/a".to_owned(), bucket, 2),
                ("crawl/a".to_owned(), bucket + 10_000, 1),
                ("crawl/b".to_owned(), bucket, 1),
            ]
        );
        let now = bucket + 15_000;
        let recent = |window| recent_demand(&conn, Duration::from_secs(window), now).unwrap();
        assert_eq!(recent(5), HashMap::from([("crawl/a".to_owned(), 1)]));
        assert_eq!(
            recent(6),
            HashMap::from([("crawl/a".to_owned(), 3), ("crawl/b".to_owned(), 1)])
        );
        // The first bucket ended 10 minutes before `bucket + 610 s`.
        let swept = sweep(&conn, bucket + 610_000, 1, 1, true).unwrap();
        assert_eq!(swept.demand_pruned, 2);
        assert_eq!(rows(), [("crawl/a".to_owned(), bucket + 10_000, 1)]);
        // Counts only ever grow by whole refusals: zero and negative counts are refused.
        assert!(
            conn.execute(
                "INSERT INTO pool_demand (pool, bucket_start_ms, requests) VALUES ('x', 0, 0)",
                []
            )
            .is_err()
        );
    }

    #[test]
    fn the_writer_connection_carries_the_bound() {
        let dir = tempfile::tempdir().unwrap();
        let (conn, bound) =
            open_writer(&dir.path().join("ledger.db"), Durability::Normal, 16 << 20).unwrap();
        let pragma =
            |name: &str| -> i64 { conn.pragma_query_value(None, name, |r| r.get(0)).unwrap() };
        assert_eq!(pragma("journal_size_limit"), 2 << 20);
        // The writer checkpoints itself, between batches.
        assert_eq!(pragma("wal_autocheckpoint"), 0);
        assert_eq!(pragma("max_page_count"), to_sql_int(bound.client_pages));
        let usage = usage(&conn).unwrap();
        assert!(usage.pages > 0 && usage.used() <= usage.pages, "{usage:?}");
    }
}
