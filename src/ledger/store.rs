//! The SQLite side of the ledger: opening and migrating the file, the readers' pool, loading
//! the writer's state at open, and the statements each write runs inside the writer's batch
//! transaction.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use jiff::Timestamp;
use r2d2::Pool;
use r2d2_sqlite::SqliteConnectionManager;
use rusqlite::types::Type;
use rusqlite::{Connection, OpenFlags, OptionalExtension, Row};

use super::config::Durability;
use super::error::LedgerError;
use super::lease::{Lease, LeaseState, ReportResult, SweepStats};
use super::schema;
use super::state::{ActiveLease, LedgerState, RequestEntry};
use crate::proxy::ProxyId;

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

/// Opens (creating if needed) the file, switches it to WAL and applies pending migrations;
/// returns the connection the writer will own. Refuses a file written by a newer binary.
pub(crate) fn open_writer(path: &Path, durability: Durability) -> Result<Connection, LedgerError> {
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
    Ok(conn)
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

/// Per-connection settings (the journal mode is a property of the file, set at open).
fn configure(conn: &Connection, durability: Durability) -> rusqlite::Result<()> {
    conn.busy_timeout(BUSY_TIMEOUT)?;
    conn.pragma_update(None, "foreign_keys", true)?;
    conn.pragma_update(None, "synchronous", durability.synchronous())
}

/// Everything the writer keeps in memory, read from the file: leases whose row says active
/// (past their expiry or not: the sweep marks those), every cooldown row, and the request IDs
/// whose lease is not past its expiry at `now` (the latest lease of an ID wins).
pub(crate) fn load_state(conn: &Connection, now: i64) -> rusqlite::Result<LedgerState> {
    let mut state = LedgerState::default();
    let mut leases = conn.prepare(
        "SELECT id, proxy_namespace, proxy_name, proxy_uid, target, acquired_at, expires_at, \
         ttl_ms, request_id FROM leases WHERE state = 'active'",
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
        "SELECT request_id, id, request_fingerprint, expires_at FROM leases \
         WHERE request_id IS NOT NULL AND expires_at > ?1 ORDER BY acquired_at, id",
    )?;
    let mut rows = requests.query([now])?;
    while let Some(row) = rows.next()? {
        let request_id: String = row.get(0)?;
        let entry = RequestEntry {
            lease_id: row.get::<_, String>(1)?.into(),
            fingerprint: row.get::<_, String>(2)?.into(),
            expires_at: row.get(3)?,
        };
        state.restore_request(request_id.into(), entry);
    }
    Ok(state)
}

/// Inserts a granted lease and its `acquired` event.
pub(crate) fn insert_lease(
    conn: &Connection,
    id: &str,
    lease: &ActiveLease,
    fingerprint: Option<&str>,
) -> rusqlite::Result<()> {
    conn.prepare_cached(
        "INSERT INTO leases (id, proxy_namespace, proxy_name, proxy_uid, target, state, \
         acquired_at, expires_at, ttl_ms, request_id, request_fingerprint) \
         VALUES (?1, ?2, ?3, ?4, ?5, 'active', ?6, ?7, ?8, ?9, ?10)",
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
    ])?;
    record(
        conn,
        &Event::of(EventKind::Acquired, lease.acquired_at, id, lease),
    )
}

/// Marks a lease released at `now`, with its `released` event.
pub(crate) fn release_lease(
    conn: &Connection,
    id: &str,
    lease: &ActiveLease,
    now: i64,
) -> rusqlite::Result<()> {
    conn.prepare_cached("UPDATE leases SET state = 'released', released_at = ?2 WHERE id = ?1")?
        .execute(rusqlite::params![id, now])?;
    record(conn, &Event::of(EventKind::Released, now, id, lease))
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
    record(conn, &Event::of(EventKind::Renewed, now, id, lease))
}

/// Records a report; `cooldown_until` puts `(proxy, target)` into cooldown (keeping a later
/// end already stored).
pub(crate) fn report(
    conn: &Connection,
    lease: &Lease,
    target: Option<&str>,
    result: ReportResult,
    now: i64,
    cooldown_until: Option<i64>,
) -> rusqlite::Result<()> {
    record(
        conn,
        &Event {
            kind: EventKind::Reported,
            at: now,
            lease_id: &lease.id,
            proxy: &lease.proxy,
            target,
            result: Some(result),
            expires_at: lease.expires_at.as_millisecond(),
        },
    )?;
    if let (Some(until), Some(target)) = (cooldown_until, target) {
        conn.prepare_cached(
            "INSERT INTO cooldowns (proxy_uid, target, proxy_namespace, proxy_name, \
             until, result, lease_id) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7) \
             ON CONFLICT (proxy_uid, target) DO UPDATE SET \
             until = max(until, excluded.until), result = excluded.result, \
             lease_id = excluded.lease_id, proxy_namespace = excluded.proxy_namespace, \
             proxy_name = excluded.proxy_name",
        )?
        .execute(rusqlite::params![
            lease.proxy.uid,
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

/// Marks leases past their expiry as expired (one `expired` event each, timed at the expiry),
/// deletes finished leases whose expiry is older than `retained_ms`, ended cooldowns, and
/// history older than `retention_ms`. History is deleted from its start up to the first row
/// inside the retention period, so the scan touches only what it deletes.
pub(crate) fn sweep(
    conn: &Connection,
    now: i64,
    retained_ms: i64,
    retention_ms: i64,
) -> rusqlite::Result<SweepStats> {
    conn.prepare_cached(
        "INSERT INTO lease_events (at, lease_id, kind, proxy_namespace, proxy_name, \
         proxy_uid, target, expires_at) \
         SELECT expires_at, id, 'expired', proxy_namespace, proxy_name, proxy_uid, \
         target, expires_at FROM leases \
         WHERE state = 'active' AND expires_at <= ?1 ORDER BY expires_at",
    )?
    .execute([now])?;
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
    let count = |n: usize| u64::try_from(n).unwrap_or(u64::MAX);
    Ok(SweepStats {
        expired: count(expired),
        leases_pruned: count(leases_pruned),
        cooldowns_pruned: count(cooldowns_pruned),
        events_pruned: count(events_pruned),
    })
}

/// What happened to a lease, as written to `lease_events.kind`.
#[derive(Debug, Clone, Copy)]
enum EventKind {
    Acquired,
    Renewed,
    Released,
    Reported,
}

impl EventKind {
    fn as_str(self) -> &'static str {
        match self {
            EventKind::Acquired => "acquired",
            EventKind::Renewed => "renewed",
            EventKind::Released => "released",
            EventKind::Reported => "reported",
        }
    }
}

/// One history row, borrowed from whatever the writer holds.
struct Event<'a> {
    kind: EventKind,
    at: i64,
    lease_id: &'a str,
    proxy: &'a ProxyId,
    target: Option<&'a str>,
    result: Option<ReportResult>,
    expires_at: i64,
}

impl<'a> Event<'a> {
    fn of(kind: EventKind, at: i64, lease_id: &'a str, lease: &'a ActiveLease) -> Self {
        Event {
            kind,
            at,
            lease_id,
            proxy: &lease.proxy,
            target: lease.target.as_deref(),
            result: None,
            expires_at: lease.expires_at,
        }
    }
}

/// Appends one row to the lease history.
fn record(conn: &Connection, event: &Event<'_>) -> rusqlite::Result<()> {
    conn.prepare_cached(
        "INSERT INTO lease_events (at, lease_id, kind, proxy_namespace, proxy_name, proxy_uid, \
         target, result, expires_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
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
        event.expires_at
    ])?;
    Ok(())
}

/// The lease with this ID if its row is retained. An active lease past its expiry reads as
/// expired even before the sweep marks it.
pub(crate) fn lease_by_id(
    conn: &Connection,
    id: &str,
    now: i64,
) -> rusqlite::Result<Option<Lease>> {
    conn.prepare_cached(
        "SELECT id, proxy_namespace, proxy_name, proxy_uid, target, state, acquired_at, \
         expires_at, ttl_ms, released_at FROM leases WHERE id = ?1",
    )?
    .query_row([id], |row| lease_from_row(row, now))
    .optional()
}

fn lease_from_row(row: &Row<'_>, now: i64) -> rusqlite::Result<Lease> {
    let state_text: String = row.get(5)?;
    let mut state: LeaseState = state_text
        .parse()
        .map_err(|e| rusqlite::Error::FromSqlConversionFailure(5, Type::Text, Box::new(e)))?;
    let expires_at: i64 = row.get(7)?;
    if state == LeaseState::Active && expires_at <= now {
        state = LeaseState::Expired;
    }
    let ttl_ms: i64 = row.get(8)?;
    Ok(Lease {
        id: row.get(0)?,
        proxy: ProxyId {
            namespace: row.get(1)?,
            name: row.get(2)?,
            uid: row.get(3)?,
        },
        target: row.get(4)?,
        state,
        acquired_at: timestamp(row.get(6)?)?,
        expires_at: timestamp(expires_at)?,
        ttl: Duration::from_millis(ttl_ms.unsigned_abs()),
        released_at: row.get::<_, Option<i64>>(9)?.map(timestamp).transpose()?,
    })
}

/// The lease an in-memory active lease describes, as of `now`.
pub(crate) fn lease_of(id: &str, lease: &ActiveLease, now: i64) -> rusqlite::Result<Lease> {
    Ok(Lease {
        id: id.to_owned(),
        proxy: ProxyId::clone(&lease.proxy),
        target: lease.target.as_deref().map(str::to_owned),
        state: if lease.expires_at > now {
            LeaseState::Active
        } else {
            LeaseState::Expired
        },
        acquired_at: timestamp(lease.acquired_at)?,
        expires_at: timestamp(lease.expires_at)?,
        ttl: Duration::from_millis(lease.ttl_ms.unsigned_abs()),
        released_at: None,
    })
}

/// A stored time (milliseconds since the epoch) as a timestamp.
fn timestamp(ms: i64) -> rusqlite::Result<Timestamp> {
    Timestamp::from_millisecond(ms)
        .map_err(|e| rusqlite::Error::FromSqlConversionFailure(0, Type::Integer, Box::new(e)))
}
