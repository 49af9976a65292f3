//! Acquires decided a batch at a time, as SQLite's writer batches them: one transaction reads
//! the loads once, decides every acquire of the batch in arrival order with the same pure
//! [`select`] (each grant counting for the next, so concurrent acquires spread over proxies
//! as on SQLite), locks the rows of the proxies it chose (in UID order, so replicas never
//! deadlock), checks under those locks what other replicas committed meanwhile, and inserts
//! the grants that still fit. A grant that no longer fits (another replica's batch took the
//! slot, a cooldown started) is decided again in the next batch, on fresh loads: nothing is
//! refused because of a lock.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use deadpool_postgres::Transaction;
use jiff::Timestamp;
use tokio::sync::oneshot;
use tokio_postgres::Row;

use super::store::{self, StoreError, lease_by_ids, query};
use crate::ledger::config::LedgerConfig;
use crate::ledger::error::LedgerError;
use crate::ledger::lease::{AcquireOutcome, AcquireRequest, Lease, LeaseState};
use crate::ledger::selection::{ProxyLoad, Selection, select};
use crate::proxy::ProxyId;

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
}

type Result<T> = std::result::Result<T, StoreError>;

/// Decides `batch` at `now` in the transaction `tx`; one verdict per acquire, in order.
pub(crate) async fn decide(
    tx: &Transaction<'_>,
    batch: &[Pending],
    config: &LedgerConfig,
    now: i64,
) -> Result<Vec<Verdict>> {
    let mut verdicts: Vec<Option<Verdict>> = batch.iter().map(|_| None).collect();
    let ids: Vec<&str> = batch.iter().map(|p| p.id.as_str()).collect();
    let keys: Vec<&str> = batch
        .iter()
        .filter_map(|p| p.request.request.as_ref().map(|k| k.id.as_str()))
        .collect();
    let targets: Vec<&str> = batch.iter().filter_map(|p| target_of(&p.request)).collect();
    // The reads are independent: sent together, they cost one round trip. (Each in a block of
    // its own, so its parameters live as long as its query.)
    let (earlier, open, loads, cooldowns, mut for_target) = tokio::try_join!(
        // Grants of an earlier attempt whose answer was lost.
        lease_by_ids(tx, &ids, now),
        // Request IDs whose window is open.
        async {
            query_if(
                !keys.is_empty(),
                tx,
                "SELECT request_id, lease_id, fingerprint FROM acquire_requests \
                 WHERE request_id = ANY($1) AND expires_at > $2",
                &[&keys, &now],
            )
            .await
        },
        async {
            query(
                tx,
                "SELECT proxy_uid, count(*), min(expires_at) FROM leases \
                 WHERE state = 'active' AND expires_at > $1 GROUP BY proxy_uid",
                &[&now],
            )
            .await
        },
        async {
            query_if(
                !targets.is_empty(),
                tx,
                "SELECT proxy_uid, target, until FROM cooldowns \
                 WHERE target = ANY($1) AND until > $2",
                &[&targets, &now],
            )
            .await
        },
        target_loads(tx, config, &targets, now),
    )?;
    for lease in earlier {
        if let Some(i) = batch.iter().position(|p| p.id == lease.id) {
            verdicts[i] = Some(Verdict::Answer(Ok(AcquireOutcome::Granted(lease))));
        }
    }
    let open: HashMap<String, (String, String)> = open
        .iter()
        .map(|row| (row.get(0), (row.get(1), row.get(2))))
        .collect();
    let replayed_ids: Vec<&str> = open.values().map(|(lease, _)| lease.as_str()).collect();
    let replayed: HashMap<String, Lease> = lease_by_ids(tx, &replayed_ids, now)
        .await?
        .into_iter()
        .map(|lease| (lease.id.clone(), lease))
        .collect();
    let mut loads = loads_of(loads);
    let cooldowns: HashMap<(String, String), i64> = cooldowns
        .iter()
        .map(|row| ((row.get(0), row.get(1)), row.get(2)))
        .collect();

    // Every acquire in arrival order, each grant counting for the next.
    let mut planned: Vec<Planned> = Vec::new();
    let mut keys_seen: HashSet<&str> = HashSet::new();
    for (i, pending) in batch.iter().enumerate() {
        if verdicts[i].is_some() {
            continue;
        }
        let request = &pending.request;
        if let Some(key) = &request.request {
            if !keys_seen.insert(key.id.as_str()) {
                // The same request ID earlier in this batch: the next batch replays it.
                verdicts[i] = Some(Verdict::Again);
                continue;
            }
            if let Some((lease_id, fingerprint)) = open.get(&key.id) {
                verdicts[i] = Some(Verdict::Answer(if *fingerprint != key.fingerprint {
                    Err(LedgerError::RequestIdReused {
                        request_id: key.id.clone(),
                    })
                } else {
                    match replayed.get(lease_id) {
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
        let target = target_of(request);
        let empty = HashMap::new();
        let by_uid = target.and_then(|t| for_target.get(t)).unwrap_or(&empty);
        let hold = TargetHold::new(config, by_uid, target.is_some());
        let selection = select(
            &request.candidates,
            |uid| loads.get(uid).copied().unwrap_or_default(),
            |uid| {
                target
                    .and_then(|t| cooldowns.get(&(uid.to_owned(), t.to_owned())))
                    .and_then(|&ms| Timestamp::from_millisecond(ms).ok())
            },
            |uid| hold.of(uid),
        );
        match selection {
            Selection::NoMatch(stats) => {
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
                });
            }
        }
    }

    if !planned.is_empty() {
        for (plan, verdict) in check_under_locks(tx, batch, &planned, config, now).await? {
            verdicts[plan] = Some(verdict);
        }
    }
    Ok(verdicts
        .into_iter()
        .map(|v| v.unwrap_or(Verdict::Again))
        .collect())
}

/// Locks the planned grants' proxies (and, under a fleet-wide per-target limit, targets),
/// keeps those that still fit what is committed, records them, and returns each planned
/// acquire's verdict by its index in the batch.
async fn check_under_locks(
    tx: &Transaction<'_>,
    batch: &[Pending],
    planned: &[Planned],
    config: &LedgerConfig,
    now: i64,
) -> Result<Vec<(usize, Verdict)>> {
    let mut uids: Vec<&str> = planned.iter().map(|p| p.uid.as_str()).collect();
    uids.sort_unstable();
    uids.dedup();
    let mut targets: Vec<&str> = planned.iter().filter_map(|p| p.target.as_deref()).collect();
    targets.sort_unstable();
    targets.dedup();
    if config.max_leases_per_target.is_some() && !targets.is_empty() {
        store::execute(
            tx,
            "INSERT INTO target_locks (target, acquires) \
             SELECT t, 1 FROM unnest($1::text[]) AS t ORDER BY t \
             ON CONFLICT (target) DO UPDATE SET acquires = target_locks.acquires + 1",
            &[&targets],
        )
        .await?;
    }
    store::execute(
        tx,
        "INSERT INTO proxy_locks (proxy_uid, acquires) \
         SELECT u, 1 FROM unnest($1::text[]) AS u ORDER BY u \
         ON CONFLICT (proxy_uid) DO UPDATE SET acquires = proxy_locks.acquires + 1",
        &[&uids],
    )
    .await?;
    // Under the locks: what the proxies hold now, committed by any replica (read together).
    let (held, cooled, mut per_target) = tokio::try_join!(
        async {
            query(
                tx,
                "SELECT proxy_uid, count(*) FROM leases WHERE proxy_uid = ANY($1) \
                 AND state = 'active' AND expires_at > $2 GROUP BY proxy_uid",
                &[&uids, &now],
            )
            .await
        },
        async {
            query_if(
                !targets.is_empty(),
                tx,
                "SELECT proxy_uid, target FROM cooldowns WHERE proxy_uid = ANY($1) \
                 AND target = ANY($2) AND until > $3",
                &[&uids, &targets, &now],
            )
            .await
        },
        target_loads(tx, config, &targets, now),
    )?;
    let mut held: HashMap<String, i64> = held.iter().map(|row| (row.get(0), row.get(1))).collect();
    let cooled: HashSet<(String, String)> =
        cooled.iter().map(|row| (row.get(0), row.get(1))).collect();

    let mut verdicts = Vec::with_capacity(planned.len());
    let mut accepted: Vec<&Planned> = Vec::new();
    for plan in planned {
        let pending = &batch[plan.pending];
        let max = pending
            .request
            .candidates
            .get(plan.candidate)
            .map_or(0, |c| i64::from(c.max_leases));
        let holds = held.entry(plan.uid.clone()).or_default();
        let fits_proxy = *holds < max;
        let (fits_target, cooled_down) = match &plan.target {
            Some(target) => {
                let by_uid = per_target.entry(target.clone()).or_default();
                let fleet: u64 = by_uid.values().map(|l| u64::from(l.active)).sum();
                let on_proxy = by_uid.get(&plan.uid).map_or(0, |l| l.active);
                let fits = config
                    .max_leases_per_target
                    .is_none_or(|cap| fleet < u64::from(cap))
                    && config
                        .max_leases_per_proxy_target
                        .is_none_or(|cap| on_proxy < cap);
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
                tx,
                "INSERT INTO acquire_requests (request_id, lease_id, fingerprint, expires_at) \
                 VALUES ($1, $2, $3, $4) ON CONFLICT (request_id) DO UPDATE SET \
                 lease_id = excluded.lease_id, fingerprint = excluded.fingerprint, \
                 expires_at = excluded.expires_at WHERE acquire_requests.expires_at <= $5",
                &[
                    &key.id,
                    &pending.id,
                    &key.fingerprint,
                    &now.saturating_add(pending.ttl_ms),
                    &now,
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
        accepted.push(plan);
    }
    if accepted.is_empty() {
        return Ok(verdicts);
    }
    let leases = insert_leases(tx, batch, &accepted, now).await?;
    for (plan, lease) in accepted.iter().zip(leases) {
        verdicts.push((
            plan.pending,
            Verdict::Answer(Ok(AcquireOutcome::Granted(lease))),
        ));
    }
    Ok(verdicts)
}

/// Inserts the accepted grants and their `acquired` events in two statements.
async fn insert_leases(
    tx: &Transaction<'_>,
    batch: &[Pending],
    accepted: &[&Planned],
    now: i64,
) -> Result<Vec<Lease>> {
    let mut leases = Vec::with_capacity(accepted.len());
    for plan in accepted {
        let pending = &batch[plan.pending];
        let Some(candidate) = pending.request.candidates.get(plan.candidate) else {
            return Err(LedgerError::Inconsistent("a planned candidate vanished".into()).into());
        };
        leases.push(Lease {
            id: pending.id.clone(),
            proxy: ProxyId::clone(&candidate.proxy),
            target: plan.target.clone(),
            state: LeaseState::Active,
            acquired_at: store::timestamp(now)?,
            expires_at: store::timestamp(now.saturating_add(pending.ttl_ms))?,
            ttl: Duration::from_millis(pending.ttl_ms.unsigned_abs()),
            released_at: None,
            release_reason: None,
            client: pending.request.client.clone(),
        });
    }
    let column =
        |f: fn(&Lease) -> Option<&str>| -> Vec<Option<&str>> { leases.iter().map(f).collect() };
    let ids = column(|l| Some(l.id.as_str()));
    let namespaces = column(|l| Some(l.proxy.namespace.as_str()));
    let names = column(|l| Some(l.proxy.name.as_str()));
    let uids = column(|l| Some(l.proxy.uid.as_str()));
    let targets = column(|l| l.target.as_deref());
    let clients = column(|l| l.client.as_deref());
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
    store::execute(
        tx,
        "WITH granted AS (INSERT INTO leases (id, proxy_namespace, proxy_name, proxy_uid, target, \
         state, acquired_at, expires_at, ttl_ms, request_id, request_fingerprint, client) \
         SELECT id, ns, name, uid, target, 'active', $1, expires_at, ttl_ms, request_id, \
         fingerprint, client FROM unnest($2::text[], $3::text[], $4::text[], $5::text[], \
         $6::text[], $7::bigint[], $8::bigint[], $9::text[], $10::text[], $11::text[]) \
         AS g(id, ns, name, uid, target, expires_at, ttl_ms, request_id, fingerprint, client) \
         RETURNING id, proxy_namespace, proxy_name, proxy_uid, target, expires_at, client) \
         INSERT INTO lease_events (at, lease_id, kind, proxy_namespace, proxy_name, proxy_uid, \
         target, expires_at, client) SELECT $1, id, 'acquired', proxy_namespace, proxy_name, \
         proxy_uid, target, expires_at, client FROM granted ORDER BY id",
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
        ],
    )
    .await?;
    Ok(leases)
}

/// The acquire's target; an empty one is none.
fn target_of(request: &AcquireRequest) -> Option<&str> {
    request.target.as_deref().filter(|t| !t.is_empty())
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
    tx: &Transaction<'_>,
    config: &LedgerConfig,
    targets: &[&str],
    now: i64,
) -> Result<HashMap<String, HashMap<String, ProxyLoad>>> {
    let limited =
        config.max_leases_per_target.is_some() || config.max_leases_per_proxy_target.is_some();
    let rows = query_if(
        limited && !targets.is_empty(),
        tx,
        "SELECT target, proxy_uid, count(*), min(expires_at) FROM leases \
         WHERE state = 'active' AND expires_at > $1 AND target = ANY($2) \
         GROUP BY target, proxy_uid",
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
    tx: &Transaction<'_>,
    sql: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> Result<Vec<Row>> {
    if run {
        query(tx, sql, params).await
    } else {
        Ok(Vec::new())
    }
}

/// What the per-target limits hold back for an acquire's target, from its counts.
struct TargetHold<'a> {
    per_proxy: Option<u32>,
    by_uid: &'a HashMap<String, ProxyLoad>,
    /// The fleet holds its limit for the target: when the earliest of its leases expires.
    fleet_full: Option<Option<Timestamp>>,
}

impl<'a> TargetHold<'a> {
    fn new(config: &LedgerConfig, by_uid: &'a HashMap<String, ProxyLoad>, named: bool) -> Self {
        let fleet_full = config
            .max_leases_per_target
            .filter(|_| named)
            .and_then(|cap| {
                let total: u64 = by_uid.values().map(|l| u64::from(l.active)).sum();
                (total >= u64::from(cap))
                    .then(|| by_uid.values().filter_map(|l| l.earliest_expiry).min())
            });
        TargetHold {
            per_proxy: config.max_leases_per_proxy_target.filter(|_| named),
            by_uid,
            fleet_full,
        }
    }

    fn of(&self, uid: &str) -> Option<Option<Timestamp>> {
        if let Some(frees_at) = self.fleet_full {
            return Some(frees_at);
        }
        let cap = self.per_proxy?;
        let load = self.by_uid.get(uid).copied().unwrap_or_default();
        (load.active >= cap).then_some(load.earliest_expiry)
    }
}
