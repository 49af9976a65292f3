//! The ledger itself: the SQLite file, its connection pool, and every lease operation as one
//! short transaction.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use jiff::Timestamp;
use r2d2::{Pool, PooledConnection};
use r2d2_sqlite::SqliteConnectionManager;
use rusqlite::types::Type;
use rusqlite::{Connection, OpenFlags, OptionalExtension, Row, Transaction, TransactionBehavior};

use super::clock::Clock;
use super::error::LedgerError;
use super::lease::{
    AcquireOutcome, Candidate, Lease, LeaseState, ReportResult, SweepStats, new_lease_id,
};
use super::schema;
use super::selection::{ProxyLoad, Selection, select};
use crate::proxy::ProxyId;

/// How long a connection waits for another process's write lock before failing.
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);
/// Connections in the pool: one is held by the writer, the rest serve reads.
const POOL_SIZE: u32 = 8;
/// Page cache of the writer connection, in KiB. The writer keeps its cache across
/// transactions because no other connection of the process writes, so a larger one keeps the
/// hot index pages in memory.
const WRITER_CACHE_KIB: i64 = 32 * 1024;
/// Upper bound of every configured duration, so timestamps stay in range.
const MAX_CONFIG_DURATION: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

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
    /// leases also survive a power loss, at the cost of one fsync per operation.
    Full,
}

impl Durability {
    fn synchronous(self) -> &'static str {
        match self {
            Durability::Normal => "NORMAL",
            Durability::Full => "FULL",
        }
    }
}

/// Tunables of the ledger.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LedgerConfig {
    /// Longest TTL granted; longer requests are cut to it (`--max-lease-ttl`).
    pub max_ttl: Duration,
    /// How long a `rate_limited`/`blocked` (proxy, target) pair is skipped, and how long
    /// finished leases are retained so late reports land (`--lease-cooldown`).
    pub cooldown: Duration,
    /// How long lease history is kept.
    pub history_retention: Duration,
    /// What an acknowledged write survives.
    pub durability: Durability,
}

impl Default for LedgerConfig {
    fn default() -> Self {
        Self {
            max_ttl: Duration::from_secs(3600),
            cooldown: Duration::from_secs(600),
            history_retention: Duration::from_secs(7 * 24 * 3600),
            durability: Durability::Normal,
        }
    }
}

impl LedgerConfig {
    fn validate(&self) -> Result<(), LedgerError> {
        if self.max_ttl < Duration::from_millis(1) {
            return Err(LedgerError::Config(format!(
                "max_ttl {:?} must be at least 1 ms",
                self.max_ttl
            )));
        }
        for (name, value) in [
            ("max_ttl", self.max_ttl),
            ("cooldown", self.cooldown),
            ("history_retention", self.history_retention),
        ] {
            if value > MAX_CONFIG_DURATION {
                return Err(LedgerError::Config(format!(
                    "{name} {value:?} is longer than 100 years"
                )));
            }
        }
        Ok(())
    }
}

/// Handle on the on-disk lease ledger. Cheap to clone; every clone shares one pool. All
/// methods block on SQLite, so async callers run them on a blocking thread.
#[derive(Clone)]
pub struct Ledger {
    inner: Arc<Inner>,
}

struct Inner {
    path: PathBuf,
    pool: Pool<SqliteConnectionManager>,
    clock: Arc<dyn Clock>,
    config: LedgerConfig,
    /// The one connection every write goes through. Writers queue on the mutex instead of
    /// spinning on SQLite's busy handler, and the connection's page cache stays valid because
    /// no other connection of this process writes. `BEGIN IMMEDIATE` still guards against
    /// other processes opening the same file.
    writer: Mutex<PooledConnection<SqliteConnectionManager>>,
}

impl std::fmt::Debug for Ledger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ledger")
            .field("path", &self.inner.path)
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

/// The columns `lease_from_row` reads, in order.
macro_rules! lease_columns {
    () => {
        "id, proxy_namespace, proxy_name, proxy_uid, target, state, acquired_at, expires_at, \
         ttl_ms, released_at"
    };
}

impl Ledger {
    /// Opens (creating if needed) the ledger file at `path`, switches it to WAL, applies
    /// pending migrations and builds the connection pool. Refuses a file written by a newer
    /// binary.
    pub fn open(
        path: &Path,
        config: LedgerConfig,
        clock: Arc<dyn Clock>,
    ) -> Result<Ledger, LedgerError> {
        config.validate()?;
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
        configure(&conn, config.durability).map_err(open_error)?;
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
            config.durability.synchronous()
        );
        drop(conn);

        let durability = config.durability;
        let manager = SqliteConnectionManager::file(path)
            .with_flags(OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX)
            .with_init(move |conn| configure(conn, durability));
        let pool = Pool::builder()
            .max_size(POOL_SIZE)
            .min_idle(Some(1))
            .test_on_check_out(false)
            .build(manager)?;
        let writer = pool.get()?;
        writer.pragma_update(None, "cache_size", -WRITER_CACHE_KIB)?;
        Ok(Ledger {
            inner: Arc::new(Inner {
                path: path.to_owned(),
                pool,
                clock,
                config,
                writer: Mutex::new(writer),
            }),
        })
    }

    /// The ledger file.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// Grants a lease on the best candidate (see the selection order) or says why none could
    /// be granted. `candidates` are all proxies matching the crawler's selector, healthy or
    /// not. Counting and inserting happen in one write transaction, so concurrent acquires
    /// never exceed a proxy's `max_leases`. With a `target`, proxies cooling down for that
    /// target are skipped. The TTL is capped by the configured maximum.
    pub fn acquire(
        &self,
        candidates: &[Candidate],
        target: Option<&str>,
        ttl: Duration,
    ) -> Result<AcquireOutcome, LedgerError> {
        let ttl_ms = self.capped_ttl_ms(ttl)?;
        let target = non_empty(target);
        self.write(|tx, now| {
            let loads = active_loads(tx, now)?;
            let cooldowns = match target {
                Some(target) => cooldowns_for(tx, target, now)?,
                None => HashMap::new(),
            };
            let selection = select(
                candidates,
                |uid| loads.get(uid).copied().unwrap_or_default(),
                |uid| cooldowns.get(uid).copied(),
            );
            let index = match selection {
                Selection::Chosen(index) => index,
                Selection::NoMatch(stats) => return Ok(AcquireOutcome::NoMatch(stats)),
            };
            let proxy = candidates[index].proxy.clone();
            let expires_at = now.saturating_add(ttl_ms);
            let id = new_lease_id(now);
            tx.prepare_cached(
                "INSERT INTO leases (id, proxy_namespace, proxy_name, proxy_uid, target, state, \
                 acquired_at, expires_at, ttl_ms) \
                 VALUES (?1, ?2, ?3, ?4, ?5, 'active', ?6, ?7, ?8)",
            )?
            .execute(rusqlite::params![
                id,
                proxy.namespace,
                proxy.name,
                proxy.uid,
                target,
                now,
                expires_at,
                ttl_ms
            ])?;
            let lease = Lease {
                id,
                proxy,
                target: target.map(str::to_owned),
                state: LeaseState::Active,
                acquired_at: timestamp(now)?,
                expires_at: timestamp(expires_at)?,
                ttl: Duration::from_millis(ttl_ms.unsigned_abs()),
                released_at: None,
            };
            record(tx, EventKind::Acquired, now, &lease, target, None)?;
            Ok(AcquireOutcome::Granted(lease))
        })
    }

    /// Extends an active lease to `ttl` from now (capped), for sticky sessions. Released and
    /// expired leases cannot be renewed.
    pub fn renew(&self, id: &str, ttl: Duration) -> Result<Lease, LedgerError> {
        let ttl_ms = self.capped_ttl_ms(ttl)?;
        self.write(|tx, now| {
            let mut lease = lease_by_id(tx, id, now)?
                .ok_or_else(|| LedgerError::UnknownLease(id.to_owned()))?;
            if lease.state != LeaseState::Active {
                return Err(LedgerError::NotActive {
                    id: id.to_owned(),
                    state: lease.state,
                });
            }
            let expires_at = now.saturating_add(ttl_ms);
            tx.prepare_cached("UPDATE leases SET expires_at = ?2, ttl_ms = ?3 WHERE id = ?1")?
                .execute(rusqlite::params![id, expires_at, ttl_ms])?;
            lease.expires_at = timestamp(expires_at)?;
            lease.ttl = Duration::from_millis(ttl_ms.unsigned_abs());
            record(
                tx,
                EventKind::Renewed,
                now,
                &lease,
                lease.target.as_deref(),
                None,
            )?;
            Ok(lease)
        })
    }

    /// Gives a lease back. Idempotent: releasing a released, expired or unknown lease does
    /// nothing and succeeds.
    pub fn release(&self, id: &str) -> Result<(), LedgerError> {
        self.write(|tx, now| {
            let released = tx
                .prepare_cached(concat!(
                    "UPDATE leases SET state = 'released', released_at = ?2 \
                     WHERE id = ?1 AND state = 'active' AND expires_at > ?2 RETURNING ",
                    lease_columns!()
                ))?
                .query_row(rusqlite::params![id, now], |row| lease_from_row(row, now))
                .optional()?;
            if let Some(lease) = released {
                record(
                    tx,
                    EventKind::Released,
                    now,
                    &lease,
                    lease.target.as_deref(),
                    None,
                )?;
            }
            Ok(())
        })
    }

    /// Records what a crawler observed on a lease, in any state as long as it is retained.
    /// `rate_limited` and `blocked` put (proxy, target) into cooldown; `target` defaults to
    /// the lease's target, and without either no cooldown can be keyed, so only the report is
    /// recorded. Returns the lease.
    pub fn report(
        &self,
        id: &str,
        result: ReportResult,
        target: Option<&str>,
    ) -> Result<Lease, LedgerError> {
        let cooldown_ms = millis(self.inner.config.cooldown);
        self.write(|tx, now| {
            let lease = lease_by_id(tx, id, now)?
                .ok_or_else(|| LedgerError::UnknownLease(id.to_owned()))?;
            let target = non_empty(target).or(lease.target.as_deref());
            record(tx, EventKind::Reported, now, &lease, target, Some(result))?;
            if let (true, Some(target)) = (result.starts_cooldown(), target) {
                tx.prepare_cached(
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
                    now.saturating_add(cooldown_ms),
                    result.as_str(),
                    lease.id
                ])?;
            }
            Ok(lease)
        })
    }

    /// The lease with this ID, if it is still retained. A lease past its expiry reads as
    /// expired even before the sweep marks it.
    pub fn get(&self, id: &str) -> Result<Option<Lease>, LedgerError> {
        let now = self.now_ms();
        let conn = self.read()?;
        Ok(lease_by_id(&conn, id, now)?)
    }

    /// Marks leases past their expiry as expired (one `expired` event each, timed at the
    /// expiry), deletes finished leases whose expiry is older than the cooldown window, ended
    /// cooldowns, and history older than the retention period. History is deleted from its
    /// start up to the first row inside the retention period, so the scan touches only what
    /// it deletes.
    pub fn sweep(&self) -> Result<SweepStats, LedgerError> {
        let config = &self.inner.config;
        let retained_after = millis(config.cooldown);
        let retention = millis(config.history_retention);
        self.write(|tx, now| {
            tx.prepare_cached(
                "INSERT INTO lease_events (at, lease_id, kind, proxy_namespace, proxy_name, \
                 proxy_uid, target, expires_at) \
                 SELECT expires_at, id, 'expired', proxy_namespace, proxy_name, proxy_uid, \
                 target, expires_at FROM leases \
                 WHERE state = 'active' AND expires_at <= ?1 ORDER BY expires_at",
            )?
            .execute([now])?;
            let expired = tx
                .prepare_cached(
                    "UPDATE leases SET state = 'expired' \
                     WHERE state = 'active' AND expires_at <= ?1",
                )?
                .execute([now])?;
            let leases_pruned = tx
                .prepare_cached("DELETE FROM leases WHERE state <> 'active' AND expires_at < ?1")?
                .execute([now.saturating_sub(retained_after)])?;
            let cooldowns_pruned = tx
                .prepare_cached("DELETE FROM cooldowns WHERE until <= ?1")?
                .execute([now])?;
            let events_pruned = tx
                .prepare_cached(
                    "DELETE FROM lease_events WHERE seq < coalesce(\
                     (SELECT seq FROM lease_events WHERE at >= ?1 ORDER BY seq LIMIT 1), \
                     (SELECT max(seq) + 1 FROM lease_events), 0)",
                )?
                .execute([now.saturating_sub(retention)])?;
            Ok(SweepStats {
                expired: expired as u64,
                leases_pruned: leases_pruned as u64,
                cooldowns_pruned: cooldowns_pruned as u64,
                events_pruned: events_pruned as u64,
            })
        })
    }

    /// Active leases per proxy UID (proxies without any are absent), for metrics.
    pub fn active_counts(&self) -> Result<HashMap<String, u32>, LedgerError> {
        let now = self.now_ms();
        let conn = self.read()?;
        Ok(active_loads(&conn, now)?
            .into_iter()
            .map(|(uid, load)| (uid, load.active))
            .collect())
    }

    /// Number of active leases, for metrics.
    pub fn active_total(&self) -> Result<u64, LedgerError> {
        let now = self.now_ms();
        let conn = self.read()?;
        let total: i64 = conn
            .prepare_cached(
                "SELECT COUNT(*) FROM leases WHERE state = 'active' AND expires_at > ?1",
            )?
            .query_row([now], |row| row.get(0))?;
        Ok(total.unsigned_abs())
    }

    /// Number of (proxy, target) pairs in cooldown, for metrics.
    pub fn cooldowns_active(&self) -> Result<u64, LedgerError> {
        let now = self.now_ms();
        let conn = self.read()?;
        let total: i64 = conn
            .prepare_cached("SELECT COUNT(*) FROM cooldowns WHERE until > ?1")?
            .query_row([now], |row| row.get(0))?;
        Ok(total.unsigned_abs())
    }

    /// Runs `op` in a `BEGIN IMMEDIATE` transaction with the time read after the write lock
    /// is held, and commits if it succeeds.
    fn write<T>(
        &self,
        op: impl FnOnce(&Transaction<'_>, i64) -> Result<T, LedgerError>,
    ) -> Result<T, LedgerError> {
        let mut conn = self
            .inner
            .writer
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let now = self.now_ms();
        let value = op(&tx, now)?;
        tx.commit()?;
        Ok(value)
    }

    fn read(&self) -> Result<PooledConnection<SqliteConnectionManager>, LedgerError> {
        Ok(self.inner.pool.get()?)
    }

    fn now_ms(&self) -> i64 {
        self.inner.clock.now().as_millisecond()
    }

    fn capped_ttl_ms(&self, ttl: Duration) -> Result<i64, LedgerError> {
        let capped = ttl.min(self.inner.config.max_ttl);
        match millis(capped) {
            0 => Err(LedgerError::InvalidTtl(ttl)),
            ms => Ok(ms),
        }
    }
}

/// Per-connection settings (the journal mode is a property of the file, set at open).
fn configure(conn: &Connection, durability: Durability) -> rusqlite::Result<()> {
    conn.busy_timeout(BUSY_TIMEOUT)?;
    conn.pragma_update(None, "foreign_keys", true)?;
    conn.pragma_update(None, "synchronous", durability.synchronous())
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

/// Appends one row to the lease history.
fn record(
    tx: &Transaction<'_>,
    kind: EventKind,
    at: i64,
    lease: &Lease,
    target: Option<&str>,
    result: Option<ReportResult>,
) -> Result<(), LedgerError> {
    tx.prepare_cached(
        "INSERT INTO lease_events (at, lease_id, kind, proxy_namespace, proxy_name, proxy_uid, \
         target, result, expires_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
    )?
    .execute(rusqlite::params![
        at,
        lease.id,
        kind.as_str(),
        lease.proxy.namespace,
        lease.proxy.name,
        lease.proxy.uid,
        target,
        result.map(ReportResult::as_str),
        lease.expires_at.as_millisecond()
    ])?;
    Ok(())
}

/// Active lease count and earliest expiry of every proxy holding at least one lease.
fn active_loads(conn: &Connection, now: i64) -> rusqlite::Result<HashMap<String, ProxyLoad>> {
    let mut stmt = conn.prepare_cached(
        "SELECT proxy_uid, COUNT(*), MIN(expires_at) FROM leases \
         WHERE state = 'active' AND expires_at > ?1 GROUP BY proxy_uid",
    )?;
    let rows = stmt.query_map([now], |row| {
        let active: i64 = row.get(1)?;
        let load = ProxyLoad {
            active: u32::try_from(active).unwrap_or(u32::MAX),
            earliest_expiry: Some(timestamp_column(row, 2)?),
        };
        Ok((row.get::<_, String>(0)?, load))
    })?;
    rows.collect()
}

/// End of the cooldown in force for `target`, by proxy UID.
fn cooldowns_for(
    conn: &Connection,
    target: &str,
    now: i64,
) -> rusqlite::Result<HashMap<String, Timestamp>> {
    let mut stmt = conn.prepare_cached(
        "SELECT proxy_uid, until FROM cooldowns WHERE target = ?1 AND until > ?2",
    )?;
    let rows = stmt.query_map(rusqlite::params![target, now], |row| {
        Ok((row.get::<_, String>(0)?, timestamp_column(row, 1)?))
    })?;
    rows.collect()
}

fn lease_by_id(conn: &Connection, id: &str, now: i64) -> rusqlite::Result<Option<Lease>> {
    conn.prepare_cached(concat!(
        "SELECT ",
        lease_columns!(),
        " FROM leases WHERE id = ?1"
    ))?
    .query_row([id], |row| lease_from_row(row, now))
    .optional()
}

/// Reads a lease selected with `lease_columns!`; an active lease past its expiry reads as
/// expired.
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
        acquired_at: timestamp_column(row, 6)?,
        expires_at: timestamp(expires_at)?,
        ttl: Duration::from_millis(ttl_ms.unsigned_abs()),
        released_at: row.get::<_, Option<i64>>(9)?.map(timestamp).transpose()?,
    })
}

fn timestamp_column(row: &Row<'_>, index: usize) -> rusqlite::Result<Timestamp> {
    timestamp(row.get(index)?)
}

/// A stored time (milliseconds since the epoch) as a timestamp.
fn timestamp(ms: i64) -> rusqlite::Result<Timestamp> {
    Timestamp::from_millisecond(ms)
        .map_err(|e| rusqlite::Error::FromSqlConversionFailure(0, Type::Integer, Box::new(e)))
}

/// A duration in whole milliseconds (configured durations are bounded, so this never clips).
fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

/// An empty target is no target.
fn non_empty(target: Option<&str>) -> Option<&str> {
    target.filter(|t| !t.is_empty())
}
