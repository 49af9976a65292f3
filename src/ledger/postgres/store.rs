//! The statements of the PostgreSQL ledger's writes other than acquire (`batch`), one
//! transaction per call. Each takes the time from the caller (the ledger's injected clock),
//! never from the database.

use std::collections::HashMap;
use std::sync::LazyLock;
use std::time::Duration;

use deadpool_postgres::GenericClient;
use tokio_postgres::Row;
use tokio_postgres::types::ToSql;

use super::retry::Failure;
use crate::ledger::activity::{self, ActiveCooldown, Activity, EventEntry, EventsQuery};
use crate::ledger::config::LedgerConfig;
use crate::ledger::demand;
use crate::ledger::error::LedgerError;
use crate::ledger::exits::{self, ExitChange, ExitRecord, ExitSeen, ExitWrite};
use crate::ledger::history::{Event, EventKind};
use crate::ledger::lease::{Lease, LeaseReport, LeaseRow, LeaseRowError, ReportResult, SweepStats};
use crate::ledger::traffic::{self, TrafficBytes, TrafficHour};
use crate::resources::proxy::ProxyId;

/// A statement that failed: the driver's error, or an answer for the caller.
#[derive(Debug)]
pub(crate) enum StoreError {
    Db(tokio_postgres::Error),
    Ledger(LedgerError),
}

impl StoreError {
    /// Whether the connection it came from must not be used again.
    pub(crate) fn breaks_connection(&self) -> bool {
        matches!(self, StoreError::Db(e) if Failure::of(e) == Failure::Connection)
    }
}

impl From<tokio_postgres::Error> for StoreError {
    fn from(error: tokio_postgres::Error) -> Self {
        StoreError::Db(error)
    }
}

/// A lease row that names no lease: the database holds what no binary of ours wrote.
impl From<LeaseRowError> for StoreError {
    fn from(error: LeaseRowError) -> Self {
        StoreError::Ledger(LedgerError::Inconsistent(error.to_string()))
    }
}

impl From<LedgerError> for StoreError {
    fn from(error: LedgerError) -> Self {
        StoreError::Ledger(error)
    }
}

type Result<T> = std::result::Result<T, StoreError>;

const LEASE_COLUMNS: &str = "id, proxy_namespace, proxy_name, proxy_uid, target, state, \
                             acquired_at, expires_at, ttl_ms, released_at, release_reason, client, \
                             tenant, session";

/// The columns [`lease_from_row`] reads, of the table `alias` names (for joins).
pub(crate) fn lease_columns_of(alias: &str) -> String {
    LEASE_COLUMNS
        .split(", ")
        .map(|column| format!("{alias}.{column}"))
        .collect::<Vec<_>>()
        .join(", ")
}

pub(crate) async fn query(
    tx: &impl GenericClient,
    sql: &str,
    params: &[&(dyn ToSql + Sync)],
) -> Result<Vec<Row>> {
    let statement = tx.prepare_cached(sql).await?;
    Ok(tx.query(&statement, params).await?)
}

pub(crate) async fn execute(
    tx: &impl GenericClient,
    sql: &str,
    params: &[&(dyn ToSql + Sync)],
) -> Result<u64> {
    let statement = tx.prepare_cached(sql).await?;
    Ok(tx.execute(&statement, params).await?)
}

/// Extends `tenant`'s active lease to `expires_at`; its request ID's window moves with it.
pub(crate) async fn renew(
    tx: &impl GenericClient,
    id: &str,
    tenant: &str,
    ttl_ms: i64,
    now: i64,
) -> Result<Lease> {
    let expires_at = now.saturating_add(ttl_ms);
    let rows = query(
        tx,
        &format!(
            "UPDATE leases SET expires_at = $2, ttl_ms = $3 WHERE id = $1 AND tenant = $5 \
             AND state = 'active' AND expires_at > $4 RETURNING {LEASE_COLUMNS}"
        ),
        &[&id, &expires_at, &ttl_ms, &now, &tenant],
    )
    .await?;
    let Some(row) = rows.first() else {
        return Err(match lease_by_id(tx, id, tenant, now).await? {
            Some(lease) => LedgerError::NotActive {
                id: id.to_owned(),
                state: lease.state,
            },
            None => LedgerError::UnknownLease(id.to_owned()),
        }
        .into());
    };
    let lease = lease_from_row(row, now)?;
    execute(
        tx,
        "UPDATE acquire_requests SET expires_at = $2 WHERE lease_id = $1",
        &[&id, &expires_at],
    )
    .await?;
    record(
        tx,
        &Event::new(
            EventKind::Renewed,
            now,
            id,
            &lease.tenant,
            &lease.proxy,
            lease.target.as_deref(),
            expires_at,
        ),
    )
    .await?;
    Ok(lease)
}

/// Releases the counting leases `ended` picks (leases by ID within their tenant, or a
/// proxy's) at `now`, with one `released` event each in lease-ID order, carrying `reason`
/// when the operator ended them. Returns the proxy UIDs and IDs of those leases.
pub(crate) async fn release(
    tx: &impl GenericClient,
    ended: Ended<'_>,
    reason: Option<&str>,
    now: i64,
) -> Result<Vec<(String, String)>> {
    let (sql, key, tenants): (&str, &(dyn ToSql + Sync), &(dyn ToSql + Sync)) = match &ended {
        Ended::Leases { ids, tenants } => (&RELEASE_LEASES, ids, tenants),
        Ended::Proxy(uid) => (&RELEASE_PROXY, uid, &NO_TENANTS),
    };
    let rows = query(tx, sql, &[key, &now, &reason, tenants]).await?;
    Ok(rows.iter().map(|row| (row.get(0), row.get(1))).collect())
}

/// Releases the leases `$1` names, each of the tenant at the same position of `$4`.
pub(crate) static RELEASE_LEASES: LazyLock<String> =
    LazyLock::new(|| release_sql("(id, tenant) IN (SELECT * FROM unnest($1::text[], $4::text[]))"));
/// Releases the leases of the proxy with UID `$1` (`$4` is NULL).
static RELEASE_PROXY: LazyLock<String> =
    LazyLock::new(|| release_sql("proxy_uid = $1 AND $4::text[] IS NULL"));

/// The release of the counting leases `which` picks, at `$2` with the reason `$3`: the leases
/// and their `released` events (in lease-ID order, so the history is deterministic) in one
/// statement, a single round trip however many end.
fn release_sql(which: &str) -> String {
    format!(
        "WITH ended AS (UPDATE leases SET state = 'released', released_at = $2, \
         release_reason = $3 WHERE {which} AND state = 'active' AND expires_at > $2 \
         RETURNING id, proxy_namespace, proxy_name, proxy_uid, target, expires_at, tenant) \
         INSERT INTO lease_events (at, lease_id, kind, proxy_namespace, proxy_name, \
         proxy_uid, target, expires_at, reason, tenant) SELECT $2, id, 'released', \
         proxy_namespace, proxy_name, proxy_uid, target, expires_at, $3, tenant FROM ended \
         ORDER BY id RETURNING proxy_uid, lease_id"
    )
}

/// The tenants parameter of a release that names none.
const NO_TENANTS: Option<Vec<&str>> = None;

/// Which leases a release ends.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Ended<'a> {
    /// The leases with these IDs, each of the tenant at the same position (another tenant's
    /// lease of that ID is left alone).
    Leases {
        ids: &'a [&'a str],
        tenants: &'a [&'a str],
    },
    /// Every counting lease of the proxy with this UID, whatever its tenant.
    Proxy(&'a str),
}

/// Records a report on a retained lease; `rate_limited` and `blocked` put (proxy, target)
/// into cooldown. Returns the lease and the cooldown's `(target, until)` if one started.
pub(crate) async fn report(
    tx: &impl GenericClient,
    config: &LedgerConfig,
    id: &str,
    tenant: &str,
    report: &LeaseReport,
    now: i64,
) -> Result<(Lease, Option<(String, i64)>)> {
    let Some(lease) = lease_by_id(tx, id, tenant, now).await? else {
        return Err(LedgerError::UnknownLease(id.to_owned()).into());
    };
    let (target, cooldown_ms) = config.report_cooldown(report, lease.target.as_deref());
    record(
        tx,
        &Event {
            result: Some(report.result),
            cooldown_ms,
            ..Event::new(
                EventKind::Reported,
                now,
                id,
                &lease.tenant,
                &lease.proxy,
                target,
                lease.expires_at.as_millisecond(),
            )
        },
    )
    .await?;
    let mut cooldown = None;
    if let (Some(ms), Some(target)) = (cooldown_ms, target) {
        let until = now.saturating_add(ms);
        execute(
            tx,
            "INSERT INTO cooldowns (proxy_uid, target, proxy_namespace, proxy_name, until, \
             result, lease_id) VALUES ($1, $2, $3, $4, $5, $6, $7) \
             ON CONFLICT (proxy_uid, target) DO UPDATE SET \
             until = greatest(cooldowns.until, excluded.until), result = excluded.result, \
             lease_id = excluded.lease_id, proxy_namespace = excluded.proxy_namespace, \
             proxy_name = excluded.proxy_name",
            &[
                &report.cooled(&lease.proxy.uid),
                &target,
                &lease.proxy.namespace,
                &lease.proxy.name,
                &until,
                &report.result.as_str(),
                &lease.id,
            ],
        )
        .await?;
        cooldown = Some((target.to_owned(), until));
    }
    Ok((lease, cooldown))
}

/// Marks leases past their expiry expired (one `expired` event each, timed at the expiry),
/// deletes finished leases whose expiry is older than the cooldown window, closed request
/// windows, ended cooldowns and history older than the retention period. Safe when several
/// replicas sweep at once: a lease's row is marked by whichever gets its lock first, and the
/// other finds it no longer active.
pub(crate) async fn sweep(
    tx: &impl GenericClient,
    config: &LedgerConfig,
    now: i64,
) -> Result<SweepStats> {
    let expired = execute(
        tx,
        "WITH expired AS (UPDATE leases SET state = 'expired' \
         WHERE state = 'active' AND expires_at <= $1 \
         RETURNING id, proxy_namespace, proxy_name, proxy_uid, target, expires_at, tenant) \
         INSERT INTO lease_events (at, lease_id, kind, proxy_namespace, proxy_name, proxy_uid, \
         target, expires_at, tenant) \
         SELECT expires_at, id, 'expired', proxy_namespace, proxy_name, proxy_uid, target, \
         expires_at, tenant FROM expired ORDER BY expires_at, id",
        &[&now],
    )
    .await?;
    let retained_since = now.saturating_sub(crate::ledger::config::millis(config.cooldown));
    let leases_pruned = execute(
        tx,
        "DELETE FROM leases WHERE state <> 'active' AND expires_at < $1",
        &[&retained_since],
    )
    .await?;
    execute(
        tx,
        "DELETE FROM acquire_requests WHERE expires_at <= $1",
        &[&now],
    )
    .await?;
    let cooldowns_pruned = execute(tx, "DELETE FROM cooldowns WHERE until <= $1", &[&now]).await?;
    let history_since = now.saturating_sub(crate::ledger::config::millis(config.history_retention));
    let events_pruned = execute(
        tx,
        "DELETE FROM lease_events WHERE at < $1",
        &[&history_since],
    )
    .await?;
    let demand_pruned = execute(
        tx,
        "DELETE FROM pool_demand WHERE bucket_start_ms <= $1",
        &[&demand::retention_cutoff(now)],
    )
    .await?;
    let traffic_pruned = execute(
        tx,
        "DELETE FROM traffic_hours WHERE hour_ms <= $1",
        &[&traffic::retention_cutoff(
            now,
            crate::ledger::config::millis(config.history_retention),
        )],
    )
    .await?;
    execute(tx, exits::PRUNE_CHANGES_SQL, &[&history_since]).await?;
    execute(tx, exits::PRUNE_EXITS_SQL, &[&history_since]).await?;
    Ok(SweepStats {
        expired,
        leases_pruned,
        cooldowns_pruned,
        events_pruned,
        demand_pruned,
        traffic_pruned,
    })
}

/// Counts one refused request for each of `pools` (distinct) in the bucket holding `now`, in
/// one statement. The rows are upserted in pool order, so replicas counting refusals of the
/// same pools at once take the rows' locks in the same order and never deadlock.
pub(crate) async fn record_demand(tx: &impl GenericClient, pools: &[&str], now: i64) -> Result<()> {
    execute(
        tx,
        "INSERT INTO pool_demand (pool, bucket_start_ms, requests) \
         SELECT pool, $2, 1 FROM unnest($1::TEXT[]) AS p (pool) ORDER BY pool \
         ON CONFLICT (pool, bucket_start_ms) DO UPDATE \
         SET requests = pool_demand.requests + excluded.requests",
        &[&pools, &demand::bucket_start(now)],
    )
    .await?;
    Ok(())
}

/// Adds `bytes` (merged by row) to the rows of the hour holding `now` in one statement, rows
/// in key order (so replicas adding to the same rows never deadlock); returns the bytes of the
/// UTC day holding `now` of each tenant it named, as committed by every replica and this
/// transaction.
pub(crate) async fn record_traffic(
    tx: &impl GenericClient,
    bytes: &[TrafficBytes],
    now: i64,
) -> Result<HashMap<String, u64>> {
    let rows = traffic::merged(bytes);
    if rows.is_empty() {
        return Ok(HashMap::new());
    }
    let tenants: Vec<&str> = rows.iter().map(|(k, ..)| k.0).collect();
    let namespaces: Vec<&str> = rows.iter().map(|(k, ..)| k.1).collect();
    let names: Vec<&str> = rows.iter().map(|(k, ..)| k.2).collect();
    let pools: Vec<&str> = rows.iter().map(|(k, ..)| k.3).collect();
    let targets: Vec<&str> = rows.iter().map(|(k, ..)| k.4).collect();
    let ups: Vec<i64> = rows.iter().map(|r| traffic::to_sql(r.1)).collect();
    let downs: Vec<i64> = rows.iter().map(|r| traffic::to_sql(r.2)).collect();
    execute(
        tx,
        "INSERT INTO traffic_hours (hour_ms, tenant, namespace, name, pool, target, up, down) \
         SELECT $1, t, ns, n, p, tg, u, d \
         FROM unnest($2::TEXT[], $3::TEXT[], $4::TEXT[], $5::TEXT[], $6::TEXT[], \
         $7::BIGINT[], $8::BIGINT[]) AS r (t, ns, n, p, tg, u, d) ORDER BY t, ns, n, p, tg \
         ON CONFLICT (hour_ms, tenant, namespace, name, pool, target) DO UPDATE \
         SET up = traffic_hours.up + excluded.up, down = traffic_hours.down + excluded.down",
        &[
            &traffic::hour_start(now),
            &tenants,
            &namespaces,
            &names,
            &pools,
            &targets,
            &ups,
            &downs,
        ],
    )
    .await?;
    let mut named = tenants;
    named.dedup();
    bytes_today(tx, &named, now).await
}

/// The bytes of the UTC day holding `now` of each of `tenants` that has some.
pub(crate) async fn bytes_today(
    tx: &impl GenericClient,
    tenants: &[&str],
    now: i64,
) -> Result<HashMap<String, u64>> {
    let rows = query(
        tx,
        "SELECT tenant, sum(up + down)::BIGINT FROM traffic_hours \
         WHERE tenant = ANY($1) AND hour_ms >= $2 GROUP BY tenant",
        &[&tenants, &traffic::day_start(now)],
    )
    .await?;
    Ok(rows
        .iter()
        .map(|row| (row.get(0), traffic::from_sql(row.get(1))))
        .collect())
}

/// The hourly traffic rows whose hour starts at or after `since`, oldest first.
pub(crate) async fn traffic(tx: &impl GenericClient, since: i64) -> Result<Vec<TrafficHour>> {
    let rows = query(
        tx,
        "SELECT hour_ms, tenant, namespace, name, pool, target, up, down FROM traffic_hours \
         WHERE hour_ms >= $1 ORDER BY hour_ms, tenant, namespace, name, pool, target",
        &[&since],
    )
    .await?;
    Ok(rows
        .iter()
        .map(|row| TrafficHour {
            hour_ms: row.get(0),
            bytes: TrafficBytes {
                tenant: row.get(1),
                namespace: row.get(2),
                name: row.get(3),
                pool: traffic::pool_of(row.get(4)),
                target: row.get(5),
                up: traffic::from_sql(row.get(6)),
                down: traffic::from_sql(row.get(7)),
            },
        })
        .collect())
}

/// The refusals per pool in the buckets overlapping the last `window` at `now`.
pub(crate) async fn recent_demand(
    tx: &impl GenericClient,
    window: Duration,
    now: i64,
) -> Result<HashMap<String, u64>> {
    let (after, until) = demand::window_bounds(now, window);
    let rows = query(
        tx,
        "SELECT pool, sum(requests)::BIGINT FROM pool_demand \
         WHERE bucket_start_ms > $1 AND bucket_start_ms <= $2 GROUP BY pool",
        &[&after, &until],
    )
    .await?;
    Ok(rows
        .iter()
        .map(|row| {
            let requests: i64 = row.get(1);
            (row.get(0), u64::try_from(requests).unwrap_or(0))
        })
        .collect())
}

/// Acquires and reports per target since `since` (ms) and the cooldowns in force at `now`
/// (see [`activity`]).
pub(crate) async fn activity(
    tx: &impl GenericClient,
    since: i64,
    now: i64,
    tenant: Option<&str>,
) -> Result<Activity> {
    let mut found = Activity::default();
    for row in query(
        tx,
        activity::TARGET_COUNTS_SQL,
        &[&activity::SCAN_EVENTS, &since, &tenant],
    )
    .await?
    {
        let kind: String = row.get(1);
        let result: Option<String> = row.get(2);
        let count: i64 = row.get(3);
        found.add(
            row.get(0),
            &kind,
            result.as_deref(),
            u64::try_from(count).unwrap_or(0),
        );
    }
    found.cooldowns = query(
        tx,
        activity::COOLDOWNS_SQL,
        &[&now, &activity::MAX_COOLDOWNS],
    )
    .await?
    .iter()
    .map(|row| ActiveCooldown {
        target: row.get(0),
        namespace: row.get(1),
        name: row.get(2),
        until_ms: row.get(3),
        result: row.get(4),
    })
    .collect();
    Ok(found)
}

/// The newest history events `query` asks for.
pub(crate) async fn events(
    tx: &impl GenericClient,
    query: &EventsQuery,
) -> Result<Vec<EventEntry>> {
    let limit = query.bound();
    let rows = match (&query.proxy, &query.tenant) {
        (None, None) => self::query(tx, activity::EVENTS_SQL, &[&limit]).await?,
        (None, Some(tenant)) => {
            self::query(
                tx,
                activity::TENANT_EVENTS_SQL,
                &[tenant, &activity::SCAN_EVENTS, &limit],
            )
            .await?
        }
        (Some((namespace, name)), tenant) => {
            self::query(
                tx,
                activity::PROXY_EVENTS_SQL,
                &[namespace, name, &activity::SCAN_EVENTS, tenant, &limit],
            )
            .await?
        }
    };
    Ok(rows
        .iter()
        .map(|row| EventEntry {
            seq: row.get(0),
            at_ms: row.get(1),
            lease_id: row.get(2),
            kind: row.get(3),
            namespace: row.get(4),
            name: row.get(5),
            target: row.get(6),
            result: row.get(7),
            reason: row.get(8),
            client: row.get(9),
            tenant: row.get(10),
        })
        .collect())
}

/// Records the exit a check found (see `Ledger::record_exit`) in the transaction `tx`: a
/// first row is inserted (once, whichever replica wins); an existing one is locked first, so
/// replicas recording the same change one after the other find it recorded.
pub(crate) async fn record_exit(
    tx: &impl GenericClient,
    exit: &ExitRecord,
    now: i64,
    confirm_after_ms: i64,
) -> Result<ExitSeen> {
    let first = query(
        tx,
        "INSERT INTO proxy_exits (proxy_uid, exit_ip, changed_at, confirmed_at)          VALUES ($1, $2, $3, $3) ON CONFLICT (proxy_uid) DO NOTHING RETURNING proxy_uid",
        &[&exit.proxy.uid, &exit.exit_ip, &now],
    )
    .await?;
    let previous = if first.is_empty() {
        let row = query(
            tx,
            concat!(
                "SELECT exit_ip, changed_at, confirmed_at FROM proxy_exits WHERE proxy_uid = $1",
                " FOR UPDATE"
            ),
            &[&exit.proxy.uid],
        )
        .await?;
        let row = row.first().map(|row| {
            let ip: String = row.get(0);
            (ip, row.get::<_, i64>(1), row.get::<_, i64>(2))
        });
        let current = row
            .as_ref()
            .map(|(ip, changed, confirmed)| (ip.as_str(), *changed, *confirmed));
        match exits::exit_write(current, &exit.exit_ip, now, confirm_after_ms) {
            ExitWrite::Keep { changed_at } => {
                return Ok(ExitSeen {
                    changed_at_ms: changed_at,
                    changed: false,
                });
            }
            ExitWrite::Confirm { changed_at } => {
                execute(
                    tx,
                    exits::UPSERT_EXIT_SQL,
                    &[&exit.proxy.uid, &exit.exit_ip, &changed_at, &now],
                )
                .await?;
                return Ok(ExitSeen {
                    changed_at_ms: changed_at,
                    changed: false,
                });
            }
            ExitWrite::Change => {
                execute(
                    tx,
                    exits::UPSERT_EXIT_SQL,
                    &[&exit.proxy.uid, &exit.exit_ip, &now, &now],
                )
                .await?;
                row.map(|(ip, _, _)| ip)
            }
        }
    } else {
        None
    };
    execute(
        tx,
        exits::INSERT_CHANGE_SQL,
        &[
            &now,
            &exit.proxy.namespace,
            &exit.proxy.name,
            &exit.proxy.uid,
            &previous,
            &exit.exit_ip,
            &exit.country,
            &exit.asn,
        ],
    )
    .await?;
    Ok(ExitSeen {
        changed_at_ms: now,
        changed: true,
    })
}

/// The newest exit changes, of every proxy or of one.
pub(crate) async fn exit_changes(
    tx: &impl GenericClient,
    proxy: Option<&(String, String)>,
    limit: i64,
) -> Result<Vec<ExitChange>> {
    let rows = match proxy {
        None => query(tx, exits::CHANGES_SQL, &[&limit]).await?,
        Some((namespace, name)) => {
            query(tx, exits::PROXY_CHANGES_SQL, &[namespace, name, &limit]).await?
        }
    };
    Ok(rows
        .iter()
        .map(|row| ExitChange {
            seq: row.get(0),
            at_ms: row.get(1),
            namespace: row.get(2),
            name: row.get(3),
            previous_ip: row.get(4),
            exit_ip: row.get(5),
            country: row.get(6),
            asn: row.get(7),
        })
        .collect())
}

/// The active leases and the cooldowns in force at `now`, for the counts' refresh.
pub(crate) async fn counting(tx: &impl GenericClient, now: i64) -> Result<super::counts::Snapshot> {
    let leases = query(
        tx,
        "SELECT id, proxy_uid, expires_at, tenant, session IS NOT NULL FROM leases \
         WHERE state = 'active' AND expires_at > $1",
        &[&now],
    )
    .await?
    .iter()
    .map(|row| (row.get(0), row.get(1), row.get(2), row.get(3), row.get(4)))
    .collect();
    let cooldowns = query(
        tx,
        "SELECT proxy_uid, target, until FROM cooldowns WHERE until > $1",
        &[&now],
    )
    .await?
    .iter()
    .map(|row| (row.get(0), row.get(1), row.get(2)))
    .collect();
    Ok(super::counts::Snapshot { leases, cooldowns })
}

/// The retained leases with these IDs (in no particular order), as of `now`.
pub(crate) async fn lease_by_ids(
    tx: &impl GenericClient,
    ids: &[&str],
    now: i64,
) -> Result<Vec<Lease>> {
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    let rows = query(
        tx,
        &format!("SELECT {LEASE_COLUMNS} FROM leases WHERE id = ANY($1)"),
        &[&ids],
    )
    .await?;
    rows.iter().map(|row| lease_from_row(row, now)).collect()
}

/// `tenant`'s lease with this ID if its row is retained. An active lease past its expiry
/// reads as expired even before the sweep marks it.
pub(crate) async fn lease_by_id(
    tx: &impl GenericClient,
    id: &str,
    tenant: &str,
    now: i64,
) -> Result<Option<Lease>> {
    let rows = query(
        tx,
        &format!("SELECT {LEASE_COLUMNS} FROM leases WHERE id = $1 AND tenant = $2"),
        &[&id, &tenant],
    )
    .await?;
    rows.first().map(|row| lease_from_row(row, now)).transpose()
}

pub(crate) fn lease_from_row(row: &Row, now: i64) -> Result<Lease> {
    Ok(LeaseRow {
        id: row.get(0),
        proxy: ProxyId {
            namespace: row.get(1),
            name: row.get(2),
            uid: row.get(3),
        },
        target: row.get(4),
        state: row.get(5),
        acquired_at: row.get(6),
        expires_at: row.get(7),
        ttl_ms: row.get(8),
        released_at: row.get(9),
        release_reason: row.get(10),
        client: row.get(11),
        tenant: row.get(12),
        session: row.get(13),
    }
    .decode(now)?)
}

/// Appends one row to the lease history.
async fn record(tx: &impl GenericClient, event: &Event<'_>) -> Result<()> {
    let kind = event.kind.as_str();
    let result = event.result.map(ReportResult::as_str);
    execute(
        tx,
        "INSERT INTO lease_events (at, lease_id, kind, proxy_namespace, proxy_name, proxy_uid, \
         target, result, expires_at, reason, cooldown_ms, client, tenant) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)",
        &[
            &event.at,
            &event.lease_id,
            &kind,
            &event.proxy.namespace,
            &event.proxy.name,
            &event.proxy.uid,
            &event.target,
            &result,
            &event.expires_at,
            &event.reason,
            &event.cooldown_ms,
            &event.client,
            &event.tenant,
        ],
    )
    .await?;
    Ok(())
}
