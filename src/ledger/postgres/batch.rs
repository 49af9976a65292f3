//! Acquires decided a batch at a time, as SQLite's writer batches them: every acquire of the
//! batch decided in arrival order with the same pure [`select`] (each grant counting for the
//! next, so concurrent acquires spread over proxies as on SQLite), the rows of the proxies it
//! chose locked (in UID order, so replicas never deadlock), what other replicas committed
//! meanwhile checked under those locks, and the grants that still fit inserted, in one
//! transaction. A grant that no longer fits (another replica's batch took the slot, a
//! cooldown started) is decided again in the next batch, on loads read from the database:
//! nothing is refused because of a lock.
//!
//! Batches without request IDs, per-target limits or tenants' quotas (the common case) are
//! checked by the insert itself, so BEGIN, the locks, the insert and COMMIT go out together:
//! one round trip. The others are checked here, between the locks and the insert (three).
//! A tenant's quotas are decided under its row of `tenant_quotas`, locked before any proxy
//! (in name order, so replicas never deadlock), which also holds its token bucket; its bytes
//! of the day (`bytesPerDay`) are summed from `traffic_hours` under that lock.

use std::collections::{HashMap, HashSet};
use std::sync::LazyLock;
use std::time::Instant;

use deadpool_postgres::GenericClient;
use jiff::Timestamp;
use tokio::sync::oneshot;
use tokio_postgres::Row;

use super::pipelined::Pipelined;
use super::store::{self, StoreError, lease_by_ids, query};
use crate::ledger::candidates::Candidate;
use crate::ledger::config::LedgerConfig;
use crate::ledger::error::LedgerError;
use crate::ledger::lease::{AcquireOutcome, AcquireRequest, Lease, LeaseRow, LeaseState};
use crate::ledger::quota::{self, Bucket, TenantUsage};
use crate::ledger::selection::{ProxyLoad, Selection, select};
use crate::ledger::target_hold::{TargetHold, TargetLimits, total_load};
use crate::ledger::traffic;
use crate::resources::proxy::ProxyId;

/// One acquire waiting for its batch.
#[derive(Debug)]
pub(crate) struct Pending {
    pub request: AcquireRequest,
    pub ttl_ms: i64,
    /// Drawn once, kept for every attempt: a batch whose COMMIT went through but whose answer
    /// was lost is found by the next attempt instead of granting twice.
    pub id: String,
    /// Batches that decided it again after a lost race.
    pub retries: u32,
    pub queued_at: Instant,
    pub reply: oneshot::Sender<std::result::Result<AcquireOutcome, LedgerError>>,
}

/// What a batch decided for one acquire.
#[derive(Debug)]
#[expect(
    clippy::large_enum_variant,
    reason = "one short-lived verdict per acquire of a batch, moved once into its reply"
)]
pub(crate) enum Verdict {
    /// The answer (committed with the batch when it is a grant).
    Answer(std::result::Result<AcquireOutcome, LedgerError>),
    /// Not decided in this batch: the next one decides it again.
    Again,
}

/// A grant the selection planned, before the check under the locks.
struct Planned {
    pending: usize,
    candidate: usize,
    uid: String,
    target: Option<String>,
    /// Its tenant has a quota: it is checked under the tenant's lock.
    quota: bool,
}

impl Planned {
    /// The candidate it chose, from its acquire in `batch`.
    fn candidate<'a>(&self, batch: &'a [Pending]) -> Option<&'a Candidate> {
        batch[self.pending].request.candidates.get(self.candidate)
    }
}

type Result<T> = std::result::Result<T, StoreError>;

/// The counting leases of every proxy that has one.
const LOADS: &str = "SELECT proxy_uid, count(*), min(expires_at) FROM leases \
     WHERE state = 'active' AND expires_at > $1 GROUP BY proxy_uid";
/// The request IDs (`$1`, of the tenants `$3` at the same positions) whose window is open,
/// with the leases they name (their columns first).
static OPEN_REQUESTS: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT {}, r.tenant, r.request_id, r.lease_id, r.fingerprint FROM acquire_requests r \
         LEFT JOIN leases l ON l.id = r.lease_id \
         WHERE (r.tenant, r.request_id) IN (SELECT * FROM unnest($3::text[], $1::text[])) \
         AND r.expires_at > $2",
        store::lease_columns_of("l")
    )
});
/// The position of `r.tenant` in a row of [`OPEN_REQUESTS`]: after the lease's columns.
const OPEN_REQUEST_TENANT: usize = 14;
/// What each tenant (`$1`) holds: its counting leases, those of them a session's, and the
/// earliest expiry of each.
const TENANT_USAGE: &str = "SELECT tenant, count(*), count(session), min(expires_at), \
     min(expires_at) FILTER (WHERE session IS NOT NULL) FROM leases \
     WHERE tenant = ANY($1) AND state = 'active' AND expires_at > $2 GROUP BY tenant";
/// The bytes of the tenants (`$1`) on the UTC day starting `$2`: what their `bytesPerDay`
/// quota counts, read under their rows' locks in [`check_under_locks`].
const TENANT_BYTES: &str = "SELECT tenant, sum(up + down)::BIGINT FROM traffic_hours \
     WHERE tenant = ANY($1) AND hour_ms >= $2 GROUP BY tenant";
/// The tenants' token buckets.
const TENANT_BUCKETS: &str =
    "SELECT tenant, tokens, refilled_at FROM tenant_quotas WHERE tenant = ANY($1)";
/// Locks the tenants' rows, in order (a new row starts with a full bucket: `$3`, at `$2`),
/// returning their buckets.
const LOCK_TENANTS: &str = "INSERT INTO tenant_quotas (tenant, tokens, refilled_at, acquires) \
     SELECT t, b, $2, 1 FROM unnest($1::text[], $3::float8[]) AS x(t, b) ORDER BY t \
     ON CONFLICT (tenant) DO UPDATE SET acquires = tenant_quotas.acquires + 1 \
     RETURNING tenant, tokens, refilled_at";
/// Keeps the tenants' buckets as the batch's grants left them.
const SPEND_TOKENS: &str = "UPDATE tenant_quotas SET tokens = v.tokens, refilled_at = v.at \
     FROM unnest($1::text[], $2::float8[], $3::bigint[]) AS v(t, tokens, at) \
     WHERE tenant_quotas.tenant = v.t";
/// The cooldowns in force for the targets.
const COOLDOWNS: &str = "SELECT proxy_uid, target, until FROM cooldowns \
     WHERE target = ANY($1) AND until > $2";
/// Locks the targets' rows (under a fleet-wide per-target limit), in order.
const LOCK_TARGETS: &str = "INSERT INTO target_locks (target, acquires) \
     SELECT t, 1 FROM unnest($1::text[]) AS t ORDER BY t \
     ON CONFLICT (target) DO UPDATE SET acquires = target_locks.acquires + 1";
/// Locks the proxies' rows, in UID order (so replicas never deadlock).
const LOCK_PROXIES: &str = "INSERT INTO proxy_locks (proxy_uid, acquires) \
     SELECT u, 1 FROM unnest($1::text[]) AS u ORDER BY u \
     ON CONFLICT (proxy_uid) DO UPDATE SET acquires = proxy_locks.acquires + 1";
/// The counting leases of the proxies.
const HELD: &str = "SELECT proxy_uid, count(*) FROM leases WHERE proxy_uid = ANY($1) \
     AND state = 'active' AND expires_at > $2 GROUP BY proxy_uid";
/// The (proxy, target) pairs in cooldown.
const COOLED: &str = "SELECT proxy_uid, target FROM cooldowns WHERE proxy_uid = ANY($1) \
     AND target = ANY($2) AND until > $3";
/// The counting leases naming each target, per proxy.
const TARGET_LOADS: &str = "SELECT target, proxy_uid, count(*), min(expires_at) FROM leases \
     WHERE state = 'active' AND expires_at > $1 AND target = ANY($2) \
     GROUP BY target, proxy_uid";
/// A statement inserting grants (their rows `g`: `$2`..`$15`, at `$1`) and their `acquired`
/// events (with the fallback step of the row in `g`), returning the IDs inserted: those of
/// `$source` after the CTEs `$checks`.
macro_rules! grant_sql {
    ($checks:literal, $source:literal) => {
        concat!(
            "WITH g AS (SELECT * FROM unnest($2::text[], $3::text[], $4::text[], $5::text[], \
             $6::text[], $7::bigint[], $8::bigint[], $9::text[], $10::text[], $11::text[], \
             $12::bigint[], $13::text[], $14::text[], $15::bigint[]) WITH ORDINALITY AS g(id, ns, \
             name, uid, target, expires_at, ttl_ms, request_id, fingerprint, client, max_leases, \
             tenant, session, fallback_step, ord))",
            $checks,
            ", granted AS (INSERT INTO leases (id, proxy_namespace, proxy_name, proxy_uid, \
             target, state, acquired_at, expires_at, ttl_ms, request_id, request_fingerprint, \
             client, tenant, session) SELECT id, ns, name, uid, target, 'active', $1, \
             expires_at, ttl_ms, request_id, fingerprint, client, tenant, session FROM ",
            $source,
            " RETURNING id, proxy_namespace, proxy_name, proxy_uid, target, expires_at, client, \
             tenant) INSERT INTO lease_events (at, lease_id, kind, proxy_namespace, proxy_name, \
             proxy_uid, target, expires_at, client, tenant, fallback_step) SELECT $1, \
             granted.id, 'acquired', granted.proxy_namespace, granted.proxy_name, \
             granted.proxy_uid, granted.target, granted.expires_at, granted.client, \
             granted.tenant, g.fallback_step FROM granted JOIN g ON g.id = granted.id \
             ORDER BY granted.id RETURNING lease_id"
        )
    };
}
/// The grants, checked already.
const INSERT_LEASES: &str = grant_sql!("", "g");
/// The grants that still fit, checked by the statement itself under the proxies' locks:
/// outside a cooldown, and, in arrival order per proxy, within its `maxLeases` on top of the
/// counting leases committed.
const INSERT_FITTING_LEASES: &str = grant_sql!(
    ", free AS (SELECT * FROM g WHERE NOT EXISTS (SELECT 1 FROM cooldowns c \
     WHERE c.proxy_uid = g.uid AND c.target = g.target AND c.until > $1)), \
     held AS (SELECT proxy_uid, count(*) AS n FROM leases \
     WHERE proxy_uid IN (SELECT uid FROM free) AND state = 'active' AND expires_at > $1 \
     GROUP BY proxy_uid), \
     fits AS (SELECT f.* FROM (SELECT free.*, row_number() OVER (PARTITION BY uid ORDER BY ord) \
     AS k FROM free) f LEFT JOIN held h ON h.proxy_uid = f.uid \
     WHERE coalesce(h.n, 0) + f.k <= f.max_leases)",
    "fits"
);

/// Decides `batch` at `now` on `conn`; one verdict per acquire, in order.
///
/// The loads the selection starts from are `snapshot` (this replica's counts: its own grants
/// at once, other replicas' within a refresh) when given, else read from the database; the
/// check under the locks is what decides either way, so a snapshot that is behind costs a
/// decision again, never a wrong grant. A batch that would refuse an acquire on the snapshot
/// is planned again on the loads read from the database, so a 409 always comes from what is
/// committed. (Reading the loads means reading the index of active leases, which holds an
/// entry for every lease of the last TTL until a vacuum: the snapshot spares that per batch.)
///
/// Round trips: the reads, when the batch has anything to look up (outside the transaction:
/// each statement reads what is committed, as it would inside one in READ COMMITTED); then one
/// for the common batch ([`grant_at_once`]), or two for one with request IDs or under a
/// per-target limit ([`check_under_locks`]). `retried`: an earlier attempt of this batch
/// failed, perhaps after its COMMIT went through, so its grants are looked for first.
/// `releasing`: releases to commit in the grants' transaction (only for a batch decided
/// [`at_once`]), or in a statement of their own when nothing is granted.
pub(crate) async fn decide(
    conn: &Pipelined<'_>,
    batch: &[Pending],
    releasing: &Releasing<'_>,
    config: &LedgerConfig,
    snapshot: Option<HashMap<String, ProxyLoad>>,
    retried: bool,
    now: i64,
) -> Result<Decided> {
    let client = conn.client();
    let ids: Vec<&str> = batch.iter().map(|p| p.id.as_str()).collect();
    let (keys, key_tenants): (Vec<&str>, Vec<&str>) = batch
        .iter()
        .filter_map(|p| {
            let key = p.request.request.as_ref()?;
            Some((key.id.as_str(), &*p.request.tenant.name))
        })
        .unzip();
    let targets: Vec<&str> = batch.iter().filter_map(|p| target_of(&p.request)).collect();
    let limited = quota_tenants(batch);
    // The reads are independent: sent together, they cost one round trip. (Each in a block of
    // its own, so its parameters live as long as its query.)
    let budgeted = budget_tenants(batch);
    let day = traffic::day_start(now);
    let (
        earlier,
        open_rows,
        load_rows,
        cooldown_rows,
        for_target,
        usage_rows,
        bucket_rows,
        bytes_rows,
    ) = tokio::try_join!(
        // Grants of an earlier attempt of this batch whose answer was lost.
        async {
            match retried {
                true => lease_by_ids(client, &ids, now).await,
                false => Ok(Vec::new()),
            }
        },
        // Request IDs whose window is open, with the leases they name.
        async {
            let params: [&(dyn tokio_postgres::types::ToSql + Sync); 3] =
                [&keys, &now, &key_tenants];
            query_if(!keys.is_empty(), client, &OPEN_REQUESTS, &params).await
        },
        async { query_if(snapshot.is_none(), client, LOADS, &[&now]).await },
        async { query_if(!targets.is_empty(), client, COOLDOWNS, &[&targets, &now]).await },
        target_loads(client, config, &targets, now),
        // What the tenants with a quota hold, and their buckets.
        async { query_if(!limited.is_empty(), client, TENANT_USAGE, &[&limited, &now]).await },
        async { query_if(!limited.is_empty(), client, TENANT_BUCKETS, &[&limited]).await },
        async {
            query_if(
                !budgeted.is_empty(),
                client,
                TENANT_BYTES,
                &[&budgeted, &day],
            )
            .await
        },
    )?;
    let mut known = Known {
        granted: earlier.into_iter().map(|l| (l.id.clone(), l)).collect(),
        open: HashMap::new(),
        cooldowns: cooldown_rows
            .iter()
            .map(|row| ((row.get(0), row.get(1)), row.get(2)))
            .collect(),
        for_target,
        usage: with_bytes(usage_of(&usage_rows), &bytes_rows),
        buckets: buckets_of(&bucket_rows),
    };
    for row in &open_rows {
        let lease = match row.get::<_, Option<String>>(0) {
            Some(_) => Some(store::lease_from_row(row, now)?),
            None => None,
        };
        let at = OPEN_REQUEST_TENANT;
        known.open.insert(
            (row.get(at), row.get(at + 1)),
            (row.get(at + 2), row.get(at + 3), lease),
        );
    }
    let mut planning = match snapshot {
        Some(loads) => {
            let planning = plan(batch, &known, loads, config, now);
            if planning.refuses {
                let rows = query(client, LOADS, &[&now]).await?;
                plan(batch, &known, loads_of(rows), config, now)
            } else {
                planning
            }
        }
        None => plan(batch, &known, loads_of(load_rows), config, now),
    };
    let mut released_with_grants = None;
    if !planning.planned.is_empty() {
        let keyed = planning
            .planned
            .iter()
            .any(|p| batch[p.pending].request.request.is_some() || p.quota);
        let checked = if TargetLimits::of(config).any() || keyed {
            check_under_locks(conn, batch, &planning.planned, config, now).await?
        } else {
            let (checked, ended) =
                grant_at_once(conn, batch, &planning.planned, releasing, now).await?;
            released_with_grants = Some(ended);
            checked
        };
        for (i, verdict) in checked {
            planning.verdicts[i] = Some(verdict);
        }
    }
    let released = match released_with_grants {
        Some(ended) => ended,
        None => release(client, releasing, now).await?,
    };
    Ok(Decided {
        verdicts: planning
            .verdicts
            .into_iter()
            .map(|v| v.unwrap_or(Verdict::Again))
            .collect(),
        released,
    })
}

/// The releases a batch carries: lease IDs, each of the tenant at the same position.
pub(crate) struct Releasing<'a> {
    pub ids: Vec<&'a str>,
    pub tenants: Vec<&'a str>,
}

/// What a batch decided: a verdict per acquire, in order, and the (proxy UID, lease ID) of
/// each lease its releases ended.
pub(crate) struct Decided {
    pub verdicts: Vec<Verdict>,
    pub released: Vec<(String, String)>,
}

/// Whether `batch` can be decided in the one round trip of [`grant_at_once`] (no request IDs,
/// tenants' quotas or per-target limits to check between the locks and the insert), where
/// releases can commit with the grants at no cost.
pub(crate) fn at_once(batch: &[Pending], config: &LedgerConfig) -> bool {
    !TargetLimits::of(config).any()
        && batch
            .iter()
            .all(|p| p.request.request.is_none() && !p.request.tenant.quotas.any())
}

/// Ends the leases `releasing` names, in a statement of its own (none when it names none).
pub(crate) async fn release(
    client: &impl GenericClient,
    releasing: &Releasing<'_>,
    now: i64,
) -> Result<Vec<(String, String)>> {
    if releasing.ids.is_empty() {
        return Ok(Vec::new());
    }
    store::release(client, releasing.ended(), None, now).await
}

impl Releasing<'_> {
    fn ended(&self) -> store::Ended<'_> {
        store::Ended::Leases {
            ids: &self.ids,
            tenants: &self.tenants,
        }
    }
}

/// What a batch's reads found, besides the loads.
struct Known {
    /// Leases already granted to acquires of the batch (an earlier attempt's), by ID.
    granted: HashMap<String, Lease>,
    /// (Tenant, request ID) -> (lease ID, fingerprint, the lease if its row is retained).
    open: HashMap<(String, String), (String, String, Option<Lease>)>,
    /// Cooldown end by (proxy UID, target).
    cooldowns: HashMap<(String, String), i64>,
    /// Counting leases per proxy, by target (under a per-target limit).
    for_target: HashMap<String, HashMap<String, ProxyLoad>>,
    /// What each tenant with a quota holds (absent: nothing).
    usage: HashMap<String, TenantUsage>,
    /// Their token buckets as stored (absent: never acquired, a full bucket).
    buckets: HashMap<String, Bucket>,
}

/// A batch's decisions before the check under the locks.
struct Planning {
    /// The verdicts decided without a grant (`None` for a planned grant).
    verdicts: Vec<Option<Verdict>>,
    planned: Vec<Planned>,
    /// Some acquire was answered `NoMatch`.
    refuses: bool,
}

/// Decides every acquire of `batch` in arrival order on `loads`, each grant counting for the
/// next: answers replays, refusals and grants found already made, plans the rest.
fn plan(
    batch: &[Pending],
    known: &Known,
    mut loads: HashMap<String, ProxyLoad>,
    config: &LedgerConfig,
    now: i64,
) -> Planning {
    let mut verdicts: Vec<Option<Verdict>> = batch.iter().map(|_| None).collect();
    let mut for_target = known.for_target.clone();
    let mut usage = known.usage.clone();
    let mut buckets = known.buckets.clone();
    let mut planned: Vec<Planned> = Vec::new();
    let mut refuses = false;
    let mut keys_seen: HashSet<(&str, &str)> = HashSet::new();
    for (i, pending) in batch.iter().enumerate() {
        if let Some(lease) = known.granted.get(&pending.id) {
            verdicts[i] = Some(Verdict::Answer(Ok(AcquireOutcome::Granted(lease.clone()))));
            continue;
        }
        let request = &pending.request;
        let tenant = &request.tenant;
        if let Some(key) = &request.request {
            if !keys_seen.insert((&tenant.name, key.id.as_str())) {
                // The same request ID earlier in this batch: the next batch replays it.
                verdicts[i] = Some(Verdict::Again);
                continue;
            }
            let name = (tenant.name.to_string(), key.id.clone());
            if let Some((lease_id, fingerprint, lease)) = known.open.get(&name) {
                verdicts[i] = Some(Verdict::Answer(if *fingerprint != key.fingerprint {
                    Err(LedgerError::RequestIdReused {
                        request_id: key.id.clone(),
                    })
                } else {
                    match lease {
                        Some(lease) => Ok(AcquireOutcome::Replayed(lease.clone())),
                        None => Err(LedgerError::Inconsistent(format!(
                            "request ID {:?} names lease {lease_id} that the ledger no longer holds",
                            key.id
                        ))),
                    }
                }));
                continue;
            }
        }
        let quota = tenant.quotas.any();
        let bucket = tenant
            .quotas
            .rate
            .map(|rate| bucket_at(buckets.get(&*tenant.name), &rate, now));
        if quota {
            let held = usage.get(&*tenant.name).copied().unwrap_or_default();
            let session = request.session.is_some();
            if let Err(refused) = quota::check(tenant, &held, bucket.as_ref(), session, now) {
                verdicts[i] = Some(Verdict::Answer(Ok(AcquireOutcome::QuotaExceeded(refused))));
                continue;
            }
        }
        let target = target_of(request);
        let empty = HashMap::new();
        let by_uid = target.and_then(|t| for_target.get(t)).unwrap_or(&empty);
        let selection = {
            let hold = target.and_then(|_| target_hold(config, by_uid));
            select(
                &request.candidates,
                |uid| loads.get(uid).copied().unwrap_or_default(),
                |uid| {
                    target
                        .and_then(|t| known.cooldowns.get(&(uid.to_owned(), t.to_owned())))
                        .and_then(|&ms| Timestamp::from_millisecond(ms).ok())
                },
                |uid| hold.as_ref().and_then(|hold| hold.of(uid)),
            )
        };
        match selection {
            Selection::NoMatch(stats) => {
                refuses = true;
                verdicts[i] = Some(Verdict::Answer(Ok(AcquireOutcome::NoMatch(stats))));
            }
            Selection::Chosen(candidate) => {
                let Some(chosen) = request.candidates.get(candidate) else {
                    verdicts[i] = Some(Verdict::Answer(Err(LedgerError::Inconsistent(format!(
                        "selection chose candidate {candidate} of {}",
                        request.candidates.len()
                    )))));
                    continue;
                };
                let uid = chosen.proxy.uid.clone();
                let expires_at = now.saturating_add(pending.ttl_ms);
                count_grant(loads.entry(uid.clone()).or_default(), expires_at);
                if quota {
                    usage
                        .entry(tenant.name.to_string())
                        .or_default()
                        .count(expires_at, request.session.is_some());
                }
                if let Some(bucket) = bucket {
                    buckets.insert(tenant.name.to_string(), bucket.taken());
                }
                if let Some(target) = target {
                    count_grant(
                        for_target
                            .entry(target.to_owned())
                            .or_default()
                            .entry(uid.clone())
                            .or_default(),
                        expires_at,
                    );
                }
                planned.push(Planned {
                    pending: i,
                    candidate,
                    uid,
                    target: target.map(str::to_owned),
                    quota,
                });
            }
        }
    }
    Planning {
        verdicts,
        planned,
        refuses,
    }
}

/// Locks the planned grants' tenants with a quota, then (under a fleet-wide per-target limit)
/// their targets, then their proxies; keeps the grants that still fit what is committed,
/// records them with the tenants' buckets, and returns each planned acquire's verdict by its
/// index in the batch. Under its tenant's lock a quota refuses for good: what it counts is
/// committed.
async fn check_under_locks(
    conn: &Pipelined<'_>,
    batch: &[Pending],
    planned: &[Planned],
    config: &LedgerConfig,
    now: i64,
) -> Result<Vec<(usize, Verdict)>> {
    let client = conn.client();
    let uids = in_lock_order(planned.iter().map(|p| p.uid.as_str()));
    let targets = in_lock_order(planned.iter().filter_map(|p| p.target.as_deref()));
    let tenants = in_lock_order(
        planned
            .iter()
            .filter(|p| p.quota)
            .map(|p| &*batch[p.pending].request.tenant.name),
    );
    let bursts: Vec<f64> = tenants
        .iter()
        .map(|name| {
            let rate = planned
                .iter()
                .map(|p| &batch[p.pending].request.tenant)
                .find(|t| &*t.name == *name)
                .and_then(|t| t.quotas.rate);
            rate.map_or(0.0, |r| f64::from(r.burst))
        })
        .collect();
    let budgeted: Vec<&str> = tenants
        .iter()
        .copied()
        .filter(|name| {
            planned
                .iter()
                .map(|p| &batch[p.pending].request.tenant)
                .any(|t| &*t.name == *name && t.quotas.bytes_per_day.is_some())
        })
        .collect();
    let day = traffic::day_start(now);
    conn.prepare(&[
        LOCK_TENANTS,
        TENANT_USAGE,
        TENANT_BYTES,
        LOCK_TARGETS,
        LOCK_PROXIES,
        HELD,
        COOLED,
        TARGET_LOADS,
    ])
    .await?;
    // BEGIN, the locks, then under them what the tenants and proxies hold now, committed by
    // any replica: one round trip, run by the server in this order.
    let (_, stored_buckets, tenant_usage, tenant_bytes, _, _, held, cooled, mut per_target) = tokio::try_join!(
        conn.begin(),
        async {
            let params: [&(dyn tokio_postgres::types::ToSql + Sync); 3] = [&tenants, &now, &bursts];
            query_if(!tenants.is_empty(), client, LOCK_TENANTS, &params).await
        },
        async { query_if(!tenants.is_empty(), client, TENANT_USAGE, &[&tenants, &now]).await },
        async {
            query_if(
                !budgeted.is_empty(),
                client,
                TENANT_BYTES,
                &[&budgeted, &day],
            )
            .await
        },
        async {
            let limited = config.max_leases_per_target.is_some() && !targets.is_empty();
            query_if(limited, client, LOCK_TARGETS, &[&targets]).await
        },
        async { query(client, LOCK_PROXIES, &[&uids]).await },
        async { query(client, HELD, &[&uids, &now]).await },
        async {
            query_if(
                !targets.is_empty(),
                client,
                COOLED,
                &[&uids, &targets, &now],
            )
            .await
        },
        target_loads(client, config, &targets, now),
    )?;
    let mut held: HashMap<String, i64> = held.iter().map(|row| (row.get(0), row.get(1))).collect();
    let cooled: HashSet<(String, String)> =
        cooled.iter().map(|row| (row.get(0), row.get(1))).collect();
    let mut usage = with_bytes(usage_of(&tenant_usage), &tenant_bytes);
    let mut buckets = buckets_of(&stored_buckets);
    let mut spent: HashMap<String, Bucket> = HashMap::new();
    // A replica whose clock read came before another's may get a tenant's lock after it: its
    // grants are then timed at the bucket's time, so their history is in the order the bucket
    // spent its tokens and every window of it holds at most burst + rate × its length.
    let now = buckets.values().map(|b| b.at).fold(now, i64::max);

    let mut verdicts = Vec::with_capacity(planned.len());
    let mut accepted: Vec<&Planned> = Vec::new();
    for plan in planned {
        let pending = &batch[plan.pending];
        let tenant = &pending.request.tenant;
        let session = pending.request.session.is_some();
        let bucket = tenant
            .quotas
            .rate
            .map(|rate| bucket_at(buckets.get(&*tenant.name), &rate, now));
        if plan.quota {
            let holds = usage.get(&*tenant.name).copied().unwrap_or_default();
            if let Err(refused) = quota::check(tenant, &holds, bucket.as_ref(), session, now) {
                let answer = Ok(AcquireOutcome::QuotaExceeded(refused));
                verdicts.push((plan.pending, Verdict::Answer(answer)));
                continue;
            }
        }
        let max = plan.candidate(batch).map_or(0, |c| i64::from(c.max_leases));
        let holds = held.entry(plan.uid.clone()).or_default();
        let fits_proxy = *holds < max;
        let (fits_target, cooled_down) = match &plan.target {
            Some(target) => {
                let by_uid = per_target.entry(target.clone()).or_default();
                let fits =
                    target_hold(config, by_uid).is_none_or(|hold| hold.of(&plan.uid).is_none());
                (fits, cooled.contains(&(plan.uid.clone(), target.clone())))
            }
            None => (true, false),
        };
        if !(fits_proxy && fits_target) || cooled_down {
            verdicts.push((plan.pending, Verdict::Again));
            continue;
        }
        if let Some(key) = &pending.request.request {
            let taken = store::execute(
                client,
                "INSERT INTO acquire_requests (tenant, request_id, lease_id, fingerprint, \
                 expires_at) VALUES ($6, $1, $2, $3, $4) ON CONFLICT (tenant, request_id) \
                 DO UPDATE SET lease_id = excluded.lease_id, \
                 fingerprint = excluded.fingerprint, expires_at = excluded.expires_at \
                 WHERE acquire_requests.expires_at <= $5",
                &[
                    &key.id,
                    &pending.id,
                    &key.fingerprint,
                    &now.saturating_add(pending.ttl_ms),
                    &now,
                    &&*tenant.name,
                ],
            )
            .await?;
            if taken == 0 {
                // Another replica took the request ID first: the next batch replays it.
                verdicts.push((plan.pending, Verdict::Again));
                continue;
            }
        }
        *holds += 1;
        if let Some(target) = &plan.target {
            let by_uid = per_target.entry(target.clone()).or_default();
            count_grant(by_uid.entry(plan.uid.clone()).or_default(), i64::MAX);
        }
        if plan.quota {
            let expires_at = now.saturating_add(pending.ttl_ms);
            usage
                .entry(tenant.name.to_string())
                .or_default()
                .count(expires_at, session);
        }
        if let Some(bucket) = bucket {
            let taken = bucket.taken();
            buckets.insert(tenant.name.to_string(), taken);
            spent.insert(tenant.name.to_string(), taken);
        }
        accepted.push(plan);
    }
    if accepted.is_empty() {
        conn.commit().await?;
        return Ok(verdicts);
    }
    let (spent_tenants, (tokens, refilled)): (Vec<&str>, (Vec<f64>, Vec<i64>)) = spent
        .iter()
        .map(|(tenant, b)| (tenant.as_str(), (b.tokens, b.at)))
        .unzip();
    conn.prepare(&[INSERT_LEASES, SPEND_TOKENS]).await?;
    let (granted, _, ()) = tokio::try_join!(
        insert_leases(client, INSERT_LEASES, batch, &accepted, now),
        async {
            let params: [&(dyn tokio_postgres::types::ToSql + Sync); 3] =
                [&spent_tenants, &tokens, &refilled];
            query_if(!spent_tenants.is_empty(), client, SPEND_TOKENS, &params).await
        },
        conn.commit()
    )?;
    verdicts.extend(answers(batch, &accepted, granted));
    Ok(verdicts)
}

/// The common batch (no request IDs, no per-target limit) in one round trip: BEGIN, the
/// proxies' locks, the grants that still fit inserted by a statement that checks them itself
/// under those locks, COMMIT. A plan it left out is decided again in the next batch.
async fn grant_at_once(
    conn: &Pipelined<'_>,
    batch: &[Pending],
    planned: &[Planned],
    releasing: &Releasing<'_>,
    now: i64,
) -> Result<(Vec<(usize, Verdict)>, Vec<(String, String)>)> {
    let client = conn.client();
    let uids = in_lock_order(planned.iter().map(|p| p.uid.as_str()));
    let plans: Vec<&Planned> = planned.iter().collect();
    conn.prepare(&[LOCK_PROXIES, INSERT_FITTING_LEASES, &store::RELEASE_LEASES])
        .await?;
    let (_, released, _, granted, ()) = tokio::try_join!(
        conn.begin(),
        release(client, releasing, now),
        async { query(client, LOCK_PROXIES, &[&uids]).await },
        insert_leases(client, INSERT_FITTING_LEASES, batch, &plans, now),
        conn.commit(),
    )?;
    Ok((answers(batch, &plans, granted), released))
}

/// The rows to lock, each once, in the order every replica locks them (so none deadlock).
fn in_lock_order<'a>(keys: impl Iterator<Item = &'a str>) -> Vec<&'a str> {
    let mut keys: Vec<&str> = keys.collect();
    keys.sort_unstable();
    keys.dedup();
    keys
}

/// Each plan's verdict: its lease if `granted` holds it, else decided again.
fn answers(
    batch: &[Pending],
    plans: &[&Planned],
    mut granted: HashMap<String, Lease>,
) -> Vec<(usize, Verdict)> {
    plans
        .iter()
        .map(|plan| match granted.remove(&batch[plan.pending].id) {
            Some(lease) => (
                plan.pending,
                Verdict::Answer(Ok(AcquireOutcome::Granted(lease))),
            ),
            None => (plan.pending, Verdict::Again),
        })
        .collect()
}

/// Inserts the planned grants and their `acquired` events in the statement `sql` (one of
/// `grant_sql!`); returns the leases it inserted, by ID.
async fn insert_leases(
    client: &impl GenericClient,
    sql: &str,
    batch: &[Pending],
    accepted: &[&Planned],
    now: i64,
) -> Result<HashMap<String, Lease>> {
    let mut leases = Vec::with_capacity(accepted.len());
    let mut max_leases: Vec<i64> = Vec::with_capacity(accepted.len());
    for plan in accepted {
        let pending = &batch[plan.pending];
        let Some(candidate) = plan.candidate(batch) else {
            return Err(LedgerError::Inconsistent("a planned candidate vanished".into()).into());
        };
        max_leases.push(i64::from(candidate.max_leases));
        let lease = LeaseRow {
            id: pending.id.clone(),
            proxy: ProxyId::clone(&candidate.proxy),
            target: plan.target.clone(),
            state: LeaseState::Active.as_str(),
            acquired_at: now,
            expires_at: now.saturating_add(pending.ttl_ms),
            ttl_ms: pending.ttl_ms,
            released_at: None,
            release_reason: None,
            client: pending.request.client.clone(),
            tenant: pending.request.tenant.name.to_string(),
            session: pending.request.session.clone(),
        };
        leases.push(lease.decode(now)?);
    }
    let column =
        |f: fn(&Lease) -> Option<&str>| -> Vec<Option<&str>> { leases.iter().map(f).collect() };
    let ids = column(|l| Some(l.id.as_str()));
    let namespaces = column(|l| Some(l.proxy.namespace.as_str()));
    let names = column(|l| Some(l.proxy.name.as_str()));
    let uids = column(|l| Some(l.proxy.uid.as_str()));
    let targets = column(|l| l.target.as_deref());
    let clients = column(|l| l.client.as_deref());
    let tenants = column(|l| Some(l.tenant.as_str()));
    let sessions = column(|l| l.session.as_deref());
    let expiries: Vec<i64> = leases
        .iter()
        .map(|l| l.expires_at.as_millisecond())
        .collect();
    let ttls: Vec<i64> = accepted.iter().map(|p| batch[p.pending].ttl_ms).collect();
    let keys = |f: fn(&crate::ledger::lease::RequestKey) -> &str| -> Vec<Option<&str>> {
        accepted
            .iter()
            .map(|p| batch[p.pending].request.request.as_ref().map(f))
            .collect()
    };
    let request_ids = keys(|k| k.id.as_str());
    let fingerprints = keys(|k| k.fingerprint.as_str());
    let fallback_steps: Vec<Option<i64>> = accepted
        .iter()
        .map(|p| batch[p.pending].request.fallback_step.map(i64::from))
        .collect();
    let inserted = query(
        client,
        sql,
        &[
            &now,
            &ids,
            &namespaces,
            &names,
            &uids,
            &targets,
            &expiries,
            &ttls,
            &request_ids,
            &fingerprints,
            &clients,
            &max_leases,
            &tenants,
            &sessions,
            &fallback_steps,
        ],
    )
    .await?;
    let inserted: HashSet<String> = inserted.iter().map(|row| row.get(0)).collect();
    Ok(leases
        .into_iter()
        .filter(|lease| inserted.contains(&lease.id))
        .map(|lease| (lease.id.clone(), lease))
        .collect())
}

/// The acquire's target; an empty one is none.
fn target_of(request: &AcquireRequest) -> Option<&str> {
    request.target.as_deref().filter(|t| !t.is_empty())
}

/// The tenants of `batch` that have a quota, each once.
fn quota_tenants(batch: &[Pending]) -> Vec<&str> {
    in_lock_order(
        batch
            .iter()
            .map(|p| &p.request.tenant)
            .filter(|t| t.quotas.any())
            .map(|t| &*t.name),
    )
}

/// The tenants of `batch` that have a `bytesPerDay` quota, each once.
fn budget_tenants(batch: &[Pending]) -> Vec<&str> {
    in_lock_order(
        batch
            .iter()
            .map(|p| &p.request.tenant)
            .filter(|t| t.quotas.bytes_per_day.is_some())
            .map(|t| &*t.name),
    )
}

/// `usage` with the day's bytes of [`TENANT_BYTES`] rows.
fn with_bytes(
    mut usage: HashMap<String, TenantUsage>,
    rows: &[Row],
) -> HashMap<String, TenantUsage> {
    for row in rows {
        usage.entry(row.get(0)).or_default().bytes_today = traffic::from_sql(row.get(1));
    }
    usage
}

/// A tenant's bucket at `now`: the stored one refilled, or a full one for a tenant that never
/// acquired.
fn bucket_at(stored: Option<&Bucket>, rate: &quota::Rate, now: i64) -> Bucket {
    stored.map_or_else(|| Bucket::full(rate, now), |b| b.refilled(rate, now))
}

/// [`TENANT_USAGE`] rows as usage by tenant.
fn usage_of(rows: &[Row]) -> HashMap<String, TenantUsage> {
    rows.iter()
        .map(|row| {
            let count = |i: usize| u32::try_from(row.get::<_, i64>(i)).unwrap_or(u32::MAX);
            let usage = TenantUsage {
                leases: count(1),
                sessions: count(2),
                earliest_expiry: row.get(3),
                earliest_session_expiry: row.get(4),
                bytes_today: 0,
            };
            (row.get(0), usage)
        })
        .collect()
}

/// `(tenant, tokens, refilled_at)` rows as buckets by tenant.
fn buckets_of(rows: &[Row]) -> HashMap<String, Bucket> {
    rows.iter()
        .map(|row| {
            let bucket = Bucket {
                tokens: row.get(1),
                at: row.get(2),
            };
            (row.get(0), bucket)
        })
        .collect()
}

/// Counts one more lease, expiring at `expires_at`, in `load`.
fn count_grant(load: &mut ProxyLoad, expires_at: i64) {
    load.active = load.active.saturating_add(1);
    let expiry = Timestamp::from_millisecond(expires_at).ok();
    load.earliest_expiry = match (load.earliest_expiry, expiry) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
}

/// The counting leases naming each of `targets`, per proxy; nothing to read (and empty)
/// without a per-target limit.
async fn target_loads(
    client: &impl GenericClient,
    config: &LedgerConfig,
    targets: &[&str],
    now: i64,
) -> Result<HashMap<String, HashMap<String, ProxyLoad>>> {
    let rows = query_if(
        TargetLimits::of(config).any() && !targets.is_empty(),
        client,
        TARGET_LOADS,
        &[&now, &targets],
    )
    .await?;
    let mut by_target: HashMap<String, HashMap<String, ProxyLoad>> = HashMap::new();
    for row in &rows {
        let target: String = row.get(0);
        by_target
            .entry(target)
            .or_default()
            .insert(row.get(1), load_of(row.get(2), row.get(3)));
    }
    Ok(by_target)
}

/// `(proxy UID, count, earliest expiry)` rows as loads by UID.
fn loads_of(rows: Vec<Row>) -> HashMap<String, ProxyLoad> {
    rows.iter()
        .map(|row| (row.get(0), load_of(row.get(1), row.get(2))))
        .collect()
}

/// A `count(*)` of counting leases and their `min(expires_at)` as a load.
fn load_of(active: i64, earliest: i64) -> ProxyLoad {
    ProxyLoad {
        active: u32::try_from(active).unwrap_or(u32::MAX),
        earliest_expiry: Timestamp::from_millisecond(earliest).ok(),
    }
}

/// `sql`'s rows, or none without asking when `run` is false (a batch with nothing to look
/// up, e.g. no request IDs).
async fn query_if(
    run: bool,
    client: &impl GenericClient,
    sql: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> Result<Vec<Row>> {
    if run {
        query(client, sql, params).await
    } else {
        Ok(Vec::new())
    }
}

/// What the per-target limits hold back for a target, from its leases counting per proxy.
fn target_hold<'a>(
    config: &LedgerConfig,
    by_uid: &'a HashMap<String, ProxyLoad>,
) -> Option<TargetHold<impl Fn(&str) -> ProxyLoad + 'a>> {
    TargetHold::new(
        TargetLimits::of(config),
        || total_load(by_uid.values().copied()),
        |uid| by_uid.get(uid).copied().unwrap_or_default(),
    )
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::ledger::Candidates;
    use crate::ledger::lease::RequestKey;

    fn proxies(count: usize, max_leases: u32) -> Candidates {
        (0..count)
            .map(|i| crate::fixtures::candidate(&format!("p{i}"), max_leases))
            .collect()
    }

    fn pending(id: &str, candidates: &Candidates, key: Option<&str>) -> Pending {
        Pending {
            request: AcquireRequest {
                candidates: candidates.clone(),
                target: None,
                ttl: Duration::from_secs(60),
                request: key.map(|k| RequestKey {
                    id: k.into(),
                    fingerprint: "fp".into(),
                }),
                client: None,
                tenant: crate::ledger::quota::Tenancy::unrestricted(),
                session: None,
                fallback_step: None,
            },
            ttl_ms: 60_000,
            id: id.into(),
            retries: 0,
            queued_at: Instant::now(),
            reply: oneshot::channel().0,
        }
    }

    fn known() -> Known {
        Known {
            granted: HashMap::new(),
            open: HashMap::new(),
            cooldowns: HashMap::new(),
            for_target: HashMap::new(),
            usage: HashMap::new(),
            buckets: HashMap::new(),
        }
    }

    /// `pending` of tenant `team-a`, held to at most `leases` leases.
    fn limited(id: &str, candidates: &Candidates, leases: u32) -> Pending {
        let mut pending = pending(id, candidates, None);
        pending.request.tenant = crate::ledger::quota::Tenancy {
            name: "team-a".into(),
            quotas: crate::ledger::quota::Quotas {
                leases: Some(leases),
                ..Default::default()
            },
        };
        pending
    }

    fn held(uid: &str, active: u32) -> (String, ProxyLoad) {
        let load = ProxyLoad {
            active,
            earliest_expiry: Timestamp::from_millisecond(90_000).ok(),
        };
        (uid.to_owned(), load)
    }

    /// What `plan` made of each acquire: the UID planned, "no match", "granted" (found
    /// already), "again".
    fn outcomes(batch: &[Pending], planning: &Planning) -> Vec<String> {
        (0..batch.len())
            .map(|i| {
                if let Some(plan) = planning.planned.iter().find(|p| p.pending == i) {
                    return plan.uid.clone();
                }
                match &planning.verdicts[i] {
                    Some(Verdict::Answer(Ok(AcquireOutcome::NoMatch(_)))) => "no match".into(),
                    Some(Verdict::Answer(Ok(AcquireOutcome::Granted(_)))) => "granted".into(),
                    Some(Verdict::Answer(Ok(AcquireOutcome::QuotaExceeded(_)))) => "quota".into(),
                    Some(Verdict::Again) => "again".into(),
                    other => format!("{other:?}"),
                }
            })
            .collect()
    }

    struct Case {
        name: &'static str,
        batch: Vec<Pending>,
        known: Known,
        loads: Vec<(String, ProxyLoad)>,
        expected: Vec<&'static str>,
        refuses: bool,
    }

    #[test]
    fn only_a_batch_without_checks_between_locks_and_insert_is_decided_at_once() {
        let two = proxies(2, 1);
        let limits = LedgerConfig {
            max_leases_per_proxy_target: Some(1),
            ..LedgerConfig::default()
        };
        let cases: [(&str, Vec<Pending>, &LedgerConfig, bool); 4] = [
            (
                "plain acquires",
                vec![pending("a", &two, None), pending("b", &two, None)],
                &LedgerConfig::default(),
                true,
            ),
            (
                "one with a request ID",
                vec![pending("a", &two, None), pending("b", &two, Some("r"))],
                &LedgerConfig::default(),
                false,
            ),
            (
                "one of a tenant with a quota",
                vec![pending("a", &two, None), limited("b", &two, 2)],
                &LedgerConfig::default(),
                false,
            ),
            (
                "under a per-target limit",
                vec![pending("a", &two, None)],
                &limits,
                false,
            ),
        ];
        for (name, batch, config, expected) in cases {
            assert_eq!(at_once(&batch, config), expected, "{name}");
        }
    }

    #[test]
    fn a_batch_is_planned_in_arrival_order_each_grant_counting_for_the_next() {
        let two = proxies(2, 1);
        let already = Lease {
            id: "a".into(),
            proxy: ProxyId::clone(&two.get(0).unwrap().proxy),
            target: None,
            state: LeaseState::Active,
            acquired_at: Timestamp::UNIX_EPOCH,
            expires_at: Timestamp::UNIX_EPOCH,
            ttl: Duration::from_secs(60),
            released_at: None,
            release_reason: None,
            client: None,
            tenant: crate::ledger::DEFAULT_TENANT.into(),
            session: None,
        };
        let cases = [
            Case {
                name: "two free slots, three acquires: the third is refused",
                batch: vec![
                    pending("a", &two, None),
                    pending("b", &two, None),
                    pending("c", &two, None),
                ],
                known: known(),
                loads: vec![],
                expected: vec!["uid-p0", "uid-p1", "no match"],
                refuses: true,
            },
            Case {
                name: "a slot held by the loads is not planned",
                batch: vec![pending("a", &two, None), pending("b", &two, None)],
                known: known(),
                loads: vec![held("uid-p0", 1)],
                expected: vec!["uid-p1", "no match"],
                refuses: true,
            },
            Case {
                name: "an acquire an earlier attempt granted is answered with that lease",
                batch: vec![pending("a", &two, None), pending("b", &two, None)],
                known: Known {
                    granted: HashMap::from([("a".to_owned(), already)]),
                    ..known()
                },
                loads: vec![],
                expected: vec!["granted", "uid-p0"],
                refuses: false,
            },
            Case {
                name: "a request ID twice in a batch: the second is decided again",
                batch: vec![pending("a", &two, Some("r")), pending("b", &two, Some("r"))],
                known: known(),
                loads: vec![],
                expected: vec!["uid-p0", "again"],
                refuses: false,
            },
            Case {
                name: "a tenant's quota counts the batch's own grants",
                batch: vec![
                    limited("a", &proxies(3, 1), 2),
                    limited("b", &proxies(3, 1), 2),
                    limited("c", &proxies(3, 1), 2),
                    pending("d", &proxies(3, 1), None),
                ],
                known: known(),
                loads: vec![],
                expected: vec!["uid-p0", "uid-p1", "quota", "uid-p2"],
                refuses: false,
            },
            Case {
                name: "and what the tenant holds already",
                batch: vec![limited("a", &two, 2), limited("b", &two, 2)],
                known: Known {
                    usage: HashMap::from([(
                        "team-a".to_owned(),
                        TenantUsage {
                            leases: 1,
                            earliest_expiry: Some(9_000),
                            ..TenantUsage::default()
                        },
                    )]),
                    ..known()
                },
                loads: vec![],
                expected: vec!["uid-p0", "quota"],
                refuses: false,
            },
        ];
        for Case {
            name,
            batch,
            known,
            loads,
            expected,
            refuses,
        } in cases
        {
            let planning = plan(
                &batch,
                &known,
                loads.into_iter().collect(),
                &LedgerConfig::default(),
                0,
            );
            assert_eq!(outcomes(&batch, &planning), expected, "{name}");
            assert_eq!(planning.refuses, refuses, "{name}");
        }
    }
}
