//! The lease state the writer decides on, in memory and without I/O: leases that may count
//! towards capacity, cooldowns, the request-ID index (per tenant), the tenants' token
//! buckets and their bytes of the current UTC day. It is rebuilt from the file at open
//! and changed only by the writer, which journals every change of a batch so that a batch
//! whose transaction fails can be undone and memory matches the file again.

use std::collections::HashSet;
use std::sync::Arc;

use jiff::Timestamp;

use super::tenant_leases::TenantLeases;
use crate::ledger::candidates::Candidates;
use crate::ledger::lease::{NoMatch, RequestKey};
use crate::ledger::quota::{self, Bucket, QuotaExceeded, Tenancy, TenantUsage};
use crate::ledger::selection::{ProxyLoad, Selection, select};
use crate::ledger::target_hold::{TargetHold, TargetLimits, total_load};
use crate::ledger::traffic::DayBytes;
use crate::resources::proxy::ProxyId;

/// The maps of the state. An acquire looks every candidate's UID up, so the hasher matters:
/// foldhash is several times faster than SipHash on UID-sized keys and still seeded per
/// process (targets and request IDs come from clients).
type FastMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

/// A lease whose row says `active`. It counts towards capacity while `expires_at > now`; one
/// past its expiry stays here (not counting) until the sweep marks it expired in the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ActiveLease {
    pub proxy: Arc<ProxyId>,
    pub target: Option<Arc<str>>,
    pub acquired_at: i64,
    pub expires_at: i64,
    pub ttl_ms: i64,
    pub request_id: Option<Arc<str>>,
    /// The crawler that took it, when it said.
    pub client: Option<Arc<str>>,
    /// The tenant that holds it.
    pub tenant: Arc<str>,
    /// The gateway session it serves.
    pub session: Option<Arc<str>>,
}

/// A request ID within its tenant: `(tenant, request ID)`.
pub(crate) type RequestName = (Arc<str>, Arc<str>);

/// Which lease a request ID got, while its window is open (until the lease's `expires_at`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RequestEntry {
    pub lease_id: Arc<str>,
    pub fingerprint: Arc<str>,
    pub expires_at: i64,
}

/// What an acquire does, decided against the state in arrival order.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum AcquireDecision {
    /// The request ID's window is open and the fingerprint matches: answer with that lease.
    Replay(Arc<str>),
    /// The request ID's window is open for a different request.
    Reused,
    /// Grant a lease on `candidates[index]`; `bucket` is the tenant's token bucket once the
    /// grant took its token (under a rate quota).
    Grant {
        index: usize,
        bucket: Option<Bucket>,
    },
    /// Grant nothing.
    NoMatch(NoMatch),
    /// The tenant is at a quota.
    Quota(QuotaExceeded),
}

/// What a renew found in memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RenewOutcome {
    /// Extended; the lease as it is now.
    Renewed(ActiveLease),
    /// The lease is active in the file but past its expiry.
    Expired,
    /// Not an active lease: the file says whether it is released, expired or unknown.
    NotHeld,
}

/// What a sweep removed from memory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct SweptMemory {
    pub expired: u64,
    pub cooldowns: u64,
}

/// Proxies and cooldown keys a batch changed, so the readers' view is refreshed for exactly
/// those after the commit.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Touched {
    pub proxies: HashSet<Arc<str>>,
    /// `(proxy UID, target)`.
    pub cooldowns: HashSet<(Arc<str>, Arc<str>)>,
    /// Tenants whose leases changed.
    pub tenants: HashSet<Arc<str>>,
}

/// How to undo one change.
#[derive(Debug)]
enum Undo {
    Inserted(Arc<str>),
    Removed(Arc<str>, ActiveLease),
    Renewed {
        id: Arc<str>,
        expires_at: i64,
        ttl_ms: i64,
    },
    Cooldown {
        uid: Arc<str>,
        target: Arc<str>,
        previous: Option<i64>,
    },
    Request {
        id: RequestName,
        previous: Option<RequestEntry>,
    },
    Bucket {
        tenant: Arc<str>,
        previous: Option<Bucket>,
    },
    DayBytes {
        tenant: Arc<str>,
        previous: Option<DayBytes>,
    },
}

/// `(expires_at, lease ID)` of active leases, by proxy UID.
type ExpiriesByProxy = FastMap<Arc<str>, Vec<(i64, Arc<str>)>>;

/// The writer's lease state. Every change made since the last [`commit`](Self::commit) can be
/// undone with [`rollback`](Self::rollback).
#[derive(Debug, Default)]
pub(crate) struct LedgerState {
    /// Leases with state `active` in the file, by lease ID.
    active: FastMap<Arc<str>, ActiveLease>,
    /// `(expires_at, lease ID)` of those leases, by proxy UID: what capacity is counted on.
    by_proxy: ExpiriesByProxy,
    /// The same entries of the leases naming a target, by target then proxy UID: what the
    /// per-target limits count on. Kept only while a limit is set.
    by_target: FastMap<Arc<str>, ExpiriesByProxy>,
    limits: TargetLimits,
    /// Cooldown end by target, then proxy UID (an acquire looks its target up once).
    cooldowns: FastMap<Arc<str>, FastMap<Arc<str>, i64>>,
    /// Request IDs whose window may still be open, by tenant and ID.
    requests: FastMap<RequestName, RequestEntry>,
    /// Those leases by tenant, by expiry: what the quotas count on.
    by_tenant: FastMap<Arc<str>, TenantLeases>,
    /// Token buckets of the tenants with a rate quota that acquired since the file was
    /// opened (a restart starts them full).
    buckets: FastMap<Arc<str>, Bucket>,
    /// Bytes through the gateway per tenant on the day of its last traffic (rebuilt from the
    /// hourly rows at open): what the `bytesPerDay` quota counts.
    day_bytes: FastMap<Arc<str>, DayBytes>,
    undo: Vec<Undo>,
    touched: Touched,
}

/// The comparable content of a state at one moment, for self-checks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Summary {
    /// Active leases, sorted by ID.
    pub active: Vec<SummaryLease>,
    /// `(proxy UID, target, until)`, sorted.
    pub cooldowns: Vec<(String, String, i64)>,
    /// `(tenant, request ID, lease ID, fingerprint, expires_at)` of open windows, sorted.
    pub requests: Vec<(String, String, String, String, i64)>,
}

/// One active lease in a [`Summary`].
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct SummaryLease {
    pub id: String,
    pub uid: String,
    pub target: Option<String>,
    pub acquired_at: i64,
    pub expires_at: i64,
    pub ttl_ms: i64,
    pub request_id: Option<String>,
    pub tenant: String,
    pub session: Option<String>,
}

impl LedgerState {
    /// The per-target limits acquires are held to.
    pub fn limits(&self) -> TargetLimits {
        self.limits
    }

    /// An empty state that holds acquires to `limits`.
    pub fn new(limits: TargetLimits) -> Self {
        LedgerState {
            limits,
            ..LedgerState::default()
        }
    }

    /// Decides an acquire of `tenant` (for a gateway session when `session`): a request ID
    /// with an open window replays (or is refused when the fingerprint differs); then the
    /// tenant's quotas are checked; then the selection picks among the candidates.
    pub fn decide_acquire(
        &self,
        candidates: &Candidates,
        target: Option<&str>,
        request: Option<&RequestKey>,
        tenant: &Tenancy,
        session: bool,
        now: i64,
    ) -> AcquireDecision {
        if let Some(entry) = request.and_then(|r| self.open_request(&tenant.name, &r.id, now)) {
            return match request {
                Some(r) if *entry.fingerprint == *r.fingerprint => {
                    AcquireDecision::Replay(entry.lease_id.clone())
                }
                _ => AcquireDecision::Reused,
            };
        }
        let bucket = tenant.quotas.rate.map(|rate| {
            self.buckets
                .get(&tenant.name)
                .map_or_else(|| Bucket::full(&rate, now), |b| b.refilled(&rate, now))
        });
        if tenant.quotas.any() {
            let usage = self.usage(&tenant.name, now);
            if let Err(refused) = quota::check(tenant, &usage, bucket.as_ref(), session, now) {
                return AcquireDecision::Quota(refused);
            }
        }
        let cooled = target.and_then(|t| self.cooldowns.get(t));
        let held = target.and_then(|t| self.target_hold(t, now));
        let selection = select(
            candidates,
            |uid| self.load(uid, now),
            |uid| {
                cooled
                    .and_then(|by_uid| by_uid.get(uid))
                    .filter(|&&until| until > now)
                    .and_then(|&until| Timestamp::from_millisecond(until).ok())
            },
            |uid| held.as_ref().and_then(|held| held.of(uid)),
        );
        match selection {
            Selection::Chosen(index) => AcquireDecision::Grant {
                index,
                bucket: bucket.map(Bucket::taken),
            },
            Selection::NoMatch(stats) => AcquireDecision::NoMatch(stats),
        }
    }

    /// What the per-target limits hold back for `target` at `now`, when a limit is set.
    fn target_hold(
        &self,
        target: &str,
        now: i64,
    ) -> Option<TargetHold<impl Fn(&str) -> ProxyLoad + '_>> {
        let by_uid = self.by_target.get(target);
        TargetHold::new(
            self.limits,
            || {
                total_load(
                    by_uid
                        .into_iter()
                        .flat_map(|m| m.values())
                        .map(|l| counting_load(l, now)),
                )
            },
            move |uid| {
                by_uid
                    .and_then(|m| m.get(uid))
                    .map_or_else(ProxyLoad::default, |l| counting_load(l, now))
            },
        )
    }

    /// The tenant's request ID's entry if its window is still open at `now`.
    fn open_request(&self, tenant: &Arc<str>, id: &str, now: i64) -> Option<&RequestEntry> {
        self.requests
            .get(&(tenant.clone(), Arc::from(id)))
            .filter(|e| e.expires_at > now)
    }

    /// What `tenant` holds at `now`: its leases that count, and its sessions' among them.
    pub fn usage(&self, tenant: &str, now: i64) -> TenantUsage {
        self.by_tenant
            .get(tenant)
            .map_or_else(TenantUsage::default, |leases| leases.usage(now))
    }

    /// Keeps `tenant`'s token bucket as a grant left it.
    pub fn spend(&mut self, tenant: &Arc<str>, bucket: Bucket) {
        let previous = self.buckets.insert(tenant.clone(), bucket);
        self.undo.push(Undo::Bucket {
            tenant: tenant.clone(),
            previous,
        });
    }

    /// Adds `bytes` relayed for `tenant` at `now` to its day; returns its bytes today.
    pub fn count_bytes(&mut self, tenant: &str, bytes: u64, now: i64) -> u64 {
        let tenant: Arc<str> = self
            .day_bytes
            .get_key_value(tenant)
            .map_or_else(|| Arc::from(tenant), |(name, _)| name.clone());
        let previous = self.day_bytes.get(&tenant).copied();
        let counted = previous.unwrap_or_default().added(bytes, now);
        self.day_bytes.insert(tenant.clone(), counted);
        self.undo.push(Undo::DayBytes { tenant, previous });
        counted.bytes
    }

    /// Loads a tenant's bytes of the day holding `now`, read from the file (at open; not
    /// journaled).
    pub fn restore_day_bytes(&mut self, tenant: Arc<str>, bytes: u64, now: i64) {
        self.day_bytes
            .insert(tenant, DayBytes::default().added(bytes, now));
    }

    /// Leases counting towards `uid`'s capacity at `now`, and the earliest of their expiries.
    pub fn load(&self, uid: &str, now: i64) -> ProxyLoad {
        if self.by_proxy.is_empty() {
            return ProxyLoad::default();
        }
        self.by_proxy
            .get(uid)
            .map_or_else(ProxyLoad::default, |leases| counting_load(leases, now))
    }

    /// The active lease with this ID, counting or not.
    pub fn lease(&self, id: &str) -> Option<&ActiveLease> {
        self.active.get(id)
    }

    /// Records a granted lease (and its request ID, whose window opens).
    pub fn grant(&mut self, id: Arc<str>, lease: ActiveLease, fingerprint: Option<Arc<str>>) {
        if let (Some(request_id), Some(fingerprint)) = (lease.request_id.clone(), fingerprint) {
            let entry = RequestEntry {
                lease_id: id.clone(),
                fingerprint,
                expires_at: lease.expires_at,
            };
            let name = (lease.tenant.clone(), request_id);
            let previous = self.requests.insert(name.clone(), entry);
            self.undo.push(Undo::Request { id: name, previous });
        }
        self.insert_lease(id.clone(), lease);
        self.undo.push(Undo::Inserted(id));
    }

    /// Releases `tenant`'s lease that counts at `now` and returns it; anything else is left
    /// alone (release is idempotent, a lease past its expiry has already stopped counting,
    /// and another tenant's lease is not this tenant's to release). The request ID keeps
    /// answering with the released lease until its window closes.
    pub fn release(&mut self, id: &str, tenant: &str, now: i64) -> Option<ActiveLease> {
        let (id, lease) = self.active.get_key_value(id)?;
        if lease.expires_at <= now || *lease.tenant != *tenant {
            return None;
        }
        let id = id.clone();
        let lease = self.remove_lease(&id)?;
        self.undo.push(Undo::Removed(id, lease.clone()));
        Some(lease)
    }

    /// Ends every lease of proxy `uid` that counts at `now`, exactly as
    /// [`release`](Self::release) would one by one (journaled, request IDs kept), and returns
    /// them in lease-ID order (acquisition order, to the millisecond), so the history is
    /// deterministic. Leases past their expiry are left alone: they already stopped counting,
    /// and the sweep marks them expired as it would have anyway.
    pub fn end_leases(&mut self, uid: &str, now: i64) -> Vec<(Arc<str>, ActiveLease)> {
        let mut ids: Vec<Arc<str>> = self
            .by_proxy
            .get(uid)
            .into_iter()
            .flatten()
            .filter(|(expires_at, _)| *expires_at > now)
            .map(|(_, id)| id.clone())
            .collect();
        ids.sort_unstable();
        ids.into_iter()
            .filter_map(|id| {
                let lease = self.remove_lease(&id)?;
                self.undo.push(Undo::Removed(id.clone(), lease.clone()));
                Some((id, lease))
            })
            .collect()
    }

    /// Extends `tenant`'s lease that counts at `now` to `expires_at`; its request ID's window
    /// moves with it. Another tenant's lease is not held.
    pub fn renew(
        &mut self,
        id: &str,
        tenant: &str,
        now: i64,
        expires_at: i64,
        ttl_ms: i64,
    ) -> RenewOutcome {
        let Some((id, lease)) = self.active.get_key_value(id) else {
            return RenewOutcome::NotHeld;
        };
        if *lease.tenant != *tenant {
            return RenewOutcome::NotHeld;
        }
        if lease.expires_at <= now {
            return RenewOutcome::Expired;
        }
        let id = id.clone();
        let (old_expires, old_ttl) = (lease.expires_at, lease.ttl_ms);
        let request_id = lease
            .request_id
            .clone()
            .map(|request_id| (lease.tenant.clone(), request_id));
        self.set_expiry(&id, expires_at, ttl_ms);
        self.undo.push(Undo::Renewed {
            id: id.clone(),
            expires_at: old_expires,
            ttl_ms: old_ttl,
        });
        if let Some(request_id) = request_id
            && let Some(entry) = self.requests.get(&request_id)
            && entry.lease_id == id
        {
            let previous = entry.clone();
            let moved = RequestEntry {
                expires_at,
                ..previous.clone()
            };
            self.requests.insert(request_id.clone(), moved);
            self.undo.push(Undo::Request {
                id: request_id,
                previous: Some(previous),
            });
        }
        match self.active.get(&*id) {
            Some(lease) => RenewOutcome::Renewed(lease.clone()),
            None => RenewOutcome::NotHeld,
        }
    }

    /// Puts `(uid, target)` into cooldown until `until`, or keeps a later end already set.
    pub fn cool_down(&mut self, uid: &str, target: &str, until: i64) {
        let previous = self.cooldown(uid, target);
        let until = previous.map_or(until, |p| p.max(until));
        let (uid, target): (Arc<str>, Arc<str>) = (uid.into(), target.into());
        self.set_cooldown(&uid, &target, Some(until));
        self.undo.push(Undo::Cooldown {
            uid,
            target,
            previous,
        });
    }

    /// The stored end of `(uid, target)`'s cooldown, in force or not.
    pub fn cooldown(&self, uid: &str, target: &str) -> Option<i64> {
        self.cooldowns.get(target)?.get(uid).copied()
    }

    /// What the sweep does to memory at `now`: leases past their expiry are no longer active,
    /// ended cooldowns go, and request IDs whose window closed are forgotten.
    pub fn sweep(&mut self, now: i64) -> SweptMemory {
        let mut swept = SweptMemory::default();
        let expired: Vec<Arc<str>> = self
            .active
            .iter()
            .filter(|(_, lease)| lease.expires_at <= now)
            .map(|(id, _)| id.clone())
            .collect();
        for id in expired {
            if let Some(lease) = self.remove_lease(&id) {
                self.undo.push(Undo::Removed(id, lease));
                swept.expired += 1;
            }
        }
        let ended: Vec<(Arc<str>, Arc<str>, i64)> = self
            .cooldowns
            .iter()
            .flat_map(|(target, by_uid)| {
                by_uid
                    .iter()
                    .filter(|(_, until)| **until <= now)
                    .map(|(uid, until)| (uid.clone(), target.clone(), *until))
            })
            .collect();
        for (uid, target, until) in ended {
            self.set_cooldown(&uid, &target, None);
            self.undo.push(Undo::Cooldown {
                uid,
                target,
                previous: Some(until),
            });
            swept.cooldowns += 1;
        }
        let closed: Vec<RequestName> = self
            .requests
            .iter()
            .filter(|(_, entry)| entry.expires_at <= now)
            .map(|(id, _)| id.clone())
            .collect();
        for id in closed {
            let previous = self.requests.remove(&id);
            self.undo.push(Undo::Request { id, previous });
        }
        swept
    }

    /// Makes the batch's changes permanent; returns what the readers' view must refresh.
    pub fn commit(&mut self) -> Touched {
        self.undo.clear();
        std::mem::take(&mut self.touched)
    }

    /// Undoes every change since the last commit.
    pub fn rollback(&mut self) {
        while let Some(undo) = self.undo.pop() {
            match undo {
                Undo::Inserted(id) => {
                    self.remove_lease(&id);
                }
                Undo::Removed(id, lease) => self.insert_lease(id, lease),
                Undo::Renewed {
                    id,
                    expires_at,
                    ttl_ms,
                } => self.set_expiry(&id, expires_at, ttl_ms),
                Undo::Cooldown {
                    uid,
                    target,
                    previous,
                } => self.set_cooldown(&uid, &target, previous),
                Undo::Request { id, previous } => match previous {
                    Some(entry) => {
                        self.requests.insert(id, entry);
                    }
                    None => {
                        self.requests.remove(&id);
                    }
                },
                Undo::Bucket { tenant, previous } => match previous {
                    Some(bucket) => {
                        self.buckets.insert(tenant, bucket);
                    }
                    None => {
                        self.buckets.remove(&tenant);
                    }
                },
                Undo::DayBytes { tenant, previous } => match previous {
                    Some(day) => {
                        self.day_bytes.insert(tenant, day);
                    }
                    None => {
                        self.day_bytes.remove(&tenant);
                    }
                },
            }
        }
        self.touched = Touched::default();
    }

    /// Loads a lease read from the file (at open; not journaled).
    pub fn restore_lease(&mut self, id: Arc<str>, lease: ActiveLease) {
        self.insert_lease(id, lease);
        self.touched = Touched::default();
    }

    /// Loads a cooldown read from the file (at open; not journaled).
    pub fn restore_cooldown(&mut self, uid: &str, target: &str, until: i64) {
        self.set_cooldown(&uid.into(), &target.into(), Some(until));
        self.touched = Touched::default();
    }

    /// Loads a request ID read from the file (at open; not journaled).
    pub fn restore_request(&mut self, id: RequestName, entry: RequestEntry) {
        self.requests.insert(id, entry);
    }

    /// `tenant`'s active leases, counting or not (a copy in constant time).
    pub fn tenant_leases(&self, tenant: &str) -> Option<TenantLeases> {
        self.by_tenant.get(tenant).cloned()
    }

    /// Expiries of `uid`'s active leases, counting or not.
    pub fn expiries(&self, uid: &str) -> impl Iterator<Item = i64> + '_ {
        self.by_proxy
            .get(uid)
            .into_iter()
            .flatten()
            .map(|(expires_at, _)| *expires_at)
    }

    /// Every proxy with an active lease and every cooldown, for building the readers' view.
    pub fn everything(&self) -> Touched {
        Touched {
            proxies: self.by_proxy.keys().cloned().collect(),
            tenants: self.by_tenant.keys().cloned().collect(),
            cooldowns: self
                .cooldowns
                .iter()
                .flat_map(|(target, by_uid)| by_uid.keys().map(|uid| (uid.clone(), target.clone())))
                .collect(),
        }
    }

    /// The state's content at `now` (request IDs only while their window is open).
    pub fn summary(&self, now: i64) -> Summary {
        let text = |s: &Option<Arc<str>>| s.as_deref().map(str::to_owned);
        let mut summary = Summary {
            active: self
                .active
                .iter()
                .map(|(id, l)| SummaryLease {
                    id: id.to_string(),
                    uid: l.proxy.uid.clone(),
                    target: text(&l.target),
                    acquired_at: l.acquired_at,
                    expires_at: l.expires_at,
                    ttl_ms: l.ttl_ms,
                    request_id: text(&l.request_id),
                    tenant: l.tenant.to_string(),
                    session: text(&l.session),
                })
                .collect(),
            cooldowns: self
                .cooldowns
                .iter()
                .flat_map(|(target, by_uid)| {
                    by_uid
                        .iter()
                        .map(|(uid, until)| (uid.to_string(), target.to_string(), *until))
                })
                .collect(),
            requests: self
                .requests
                .iter()
                .filter(|(_, e)| e.expires_at > now)
                .map(|((tenant, id), e)| {
                    (
                        tenant.to_string(),
                        id.to_string(),
                        e.lease_id.to_string(),
                        e.fingerprint.to_string(),
                        e.expires_at,
                    )
                })
                .collect(),
        };
        summary.active.sort();
        summary.cooldowns.sort();
        summary.requests.sort();
        summary
    }

    /// The `by_proxy` key of the lease's proxy: the stored one when there is one, so a busy
    /// proxy's UID is allocated once.
    fn proxy_key(&self, lease: &ActiveLease) -> Arc<str> {
        match self.by_proxy.get_key_value(lease.proxy.uid.as_str()) {
            Some((uid, _)) => uid.clone(),
            None => lease.proxy.uid.as_str().into(),
        }
    }

    fn insert_lease(&mut self, id: Arc<str>, lease: ActiveLease) {
        let uid = self.proxy_key(&lease);
        self.by_proxy
            .entry(uid.clone())
            .or_default()
            .push((lease.expires_at, id.clone()));
        if let Some(target) = lease.target.as_ref().filter(|_| self.limits.any()) {
            self.by_target
                .entry(target.clone())
                .or_default()
                .entry(uid.clone())
                .or_default()
                .push((lease.expires_at, id.clone()));
        }
        self.touched.proxies.insert(uid);
        self.touched.tenants.insert(lease.tenant.clone());
        self.by_tenant
            .entry(lease.tenant.clone())
            .or_default()
            .insert(id.clone(), lease.expires_at, lease.session.is_some());
        self.active.insert(id, lease);
    }

    fn remove_lease(&mut self, id: &str) -> Option<ActiveLease> {
        let (key, lease) = self.active.remove_entry(id)?;
        self.touched.tenants.insert(lease.tenant.clone());
        if let Some(leases) = self.by_tenant.get_mut(&lease.tenant) {
            leases.remove(&key, lease.expires_at);
            if leases.is_empty() {
                self.by_tenant.remove(&lease.tenant);
            }
        }
        let uid = self.proxy_key(&lease);
        if let Some(leases) = self.by_proxy.get_mut(&uid) {
            leases.retain(|(_, lease_id)| &**lease_id != id);
            if leases.is_empty() {
                self.by_proxy.remove(&uid);
            }
            self.touched.proxies.insert(uid.clone());
        }
        if let Some(target) = &lease.target
            && let Some(by_uid) = self.by_target.get_mut(&**target)
        {
            if let Some(leases) = by_uid.get_mut(&uid) {
                leases.retain(|(_, lease_id)| &**lease_id != id);
                if leases.is_empty() {
                    by_uid.remove(&uid);
                }
            }
            if by_uid.is_empty() {
                self.by_target.remove(&**target);
            }
        }
        Some(lease)
    }

    fn set_expiry(&mut self, id: &Arc<str>, expires_at: i64, ttl_ms: i64) {
        let Some(uid) = self.active.get(&**id).map(|lease| self.proxy_key(lease)) else {
            return;
        };
        if let Some(lease) = self.active.get_mut(&**id) {
            if let Some(leases) = self.by_tenant.get_mut(&lease.tenant) {
                leases.renew(id, lease.expires_at, expires_at);
            }
            lease.expires_at = expires_at;
            lease.ttl_ms = ttl_ms;
            self.touched.tenants.insert(lease.tenant.clone());
        }
        if let Some(leases) = self.by_proxy.get_mut(&uid) {
            for entry in leases.iter_mut().filter(|(_, lease_id)| lease_id == id) {
                entry.0 = expires_at;
            }
        }
        let target = self.active.get(&**id).and_then(|l| l.target.clone());
        if let Some(leases) = target
            .and_then(|t| self.by_target.get_mut(&*t))
            .and_then(|by_uid| by_uid.get_mut(&uid))
        {
            for entry in leases.iter_mut().filter(|(_, lease_id)| lease_id == id) {
                entry.0 = expires_at;
            }
        }
        self.touched.proxies.insert(uid);
    }

    fn set_cooldown(&mut self, uid: &Arc<str>, target: &Arc<str>, until: Option<i64>) {
        match until {
            Some(until) => {
                self.cooldowns
                    .entry(target.clone())
                    .or_default()
                    .insert(uid.clone(), until);
            }
            None => {
                if let Some(by_uid) = self.cooldowns.get_mut(&**target) {
                    by_uid.remove(&**uid);
                    if by_uid.is_empty() {
                        self.cooldowns.remove(&**target);
                    }
                }
            }
        }
        self.touched.cooldowns.insert((uid.clone(), target.clone()));
    }
}

/// How many of `leases` (`(expires_at, lease ID)`) count at `now`, and the earliest expiry
/// among those.
fn counting_load(leases: &[(i64, Arc<str>)], now: i64) -> ProxyLoad {
    let (active, earliest) = leases.iter().filter(|(e, _)| *e > now).fold(
        (0u32, None::<i64>),
        |(n, earliest), &(expires_at, _)| {
            (
                n.saturating_add(1),
                Some(earliest.map_or(expires_at, |e| e.min(expires_at))),
            )
        },
    );
    ProxyLoad {
        active,
        earliest_expiry: earliest.and_then(|ms| Timestamp::from_millisecond(ms).ok()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: i64 = 60_000;

    fn proxy(name: &str) -> Arc<ProxyId> {
        Arc::new(ProxyId {
            namespace: "crawl".into(),
            name: name.into(),
            uid: format!("uid-{name}"),
        })
    }

    fn candidates(names: &[(&str, u32)]) -> Candidates {
        names
            .iter()
            .map(|&(name, max_leases)| crate::fixtures::candidate(name, max_leases))
            .collect()
    }

    fn lease(name: &str, expires_at: i64, request: Option<&str>) -> ActiveLease {
        ActiveLease {
            client: None,
            proxy: proxy(name),
            target: None,
            acquired_at: 0,
            expires_at,
            ttl_ms: expires_at,
            request_id: request.map(Arc::from),
            tenant: DEFAULT.into(),
            session: None,
        }
    }

    const DEFAULT: &str = crate::ledger::quota::DEFAULT_TENANT;

    fn anyone() -> Tenancy {
        Tenancy::unrestricted()
    }

    fn grant(index: usize) -> AcquireDecision {
        AcquireDecision::Grant {
            index,
            bucket: None,
        }
    }

    fn key(id: &str, fingerprint: &str) -> RequestKey {
        RequestKey {
            id: id.into(),
            fingerprint: fingerprint.into(),
        }
    }

    /// A state holding lease "l1" on proxy a (expiring at 1 min, request "r1" with fingerprint
    /// "f"), "l2" on b (2 min), and a cooldown of (a, "t") until 5 min; committed.
    fn state() -> LedgerState {
        let mut s = LedgerState::default();
        s.grant("l1".into(), lease("a", MIN, Some("r1")), Some("f".into()));
        s.grant("l2".into(), lease("b", 2 * MIN, None), None);
        s.cool_down("uid-a", "t", 5 * MIN);
        s.commit();
        s
    }

    /// `(case, target, request key, now, expected decision)`.
    type AcquireCase = (
        &'static str,
        Option<&'static str>,
        Option<RequestKey>,
        i64,
        AcquireDecision,
    );

    #[test]
    fn acquire_decisions() {
        let c = candidates(&[("a", 1), ("b", 2)]);
        let cases: [AcquireCase; 7] = [
            ("a is full: b", None, None, 0, grant(1)),
            (
                "same request ID and fingerprint in the window: replay",
                None,
                Some(key("r1", "f")),
                MIN - 1,
                AcquireDecision::Replay("l1".into()),
            ),
            (
                "same request ID, other fingerprint: refused",
                None,
                Some(key("r1", "g")),
                0,
                AcquireDecision::Reused,
            ),
            (
                "the window closes at the lease's expiry: decided afresh, a is free again",
                None,
                Some(key("r1", "g")),
                MIN,
                grant(0),
            ),
            (
                "an unknown request ID is decided afresh",
                None,
                Some(key("r2", "f")),
                0,
                grant(1),
            ),
            (
                "a cools down for t after its lease expired",
                Some("t"),
                None,
                MIN,
                grant(1),
            ),
            (
                "the cooldown ends at 5 min",
                Some("t"),
                None,
                5 * MIN,
                grant(0),
            ),
        ];
        let s = state();
        for (name, target, request, now, expected) in cases {
            assert_eq!(
                s.decide_acquire(&c, target, request.as_ref(), &anyone(), false, now),
                expected,
                "{name}"
            );
        }
        let full = candidates(&[("a", 1), ("b", 1)]);
        let AcquireDecision::NoMatch(stats) =
            s.decide_acquire(&full, None, None, &anyone(), false, 0)
        else {
            panic!("both proxies are full");
        };
        assert_eq!((stats.considered, stats.at_capacity), (2, 2));
        assert_eq!(stats.retry_after, Timestamp::from_millisecond(MIN).ok());
    }

    #[test]
    fn load_counts_only_leases_before_their_expiry() {
        let s = state();
        let cases = [(0, 1, Some(MIN)), (MIN - 1, 1, Some(MIN)), (MIN, 0, None)];
        for (now, active, earliest) in cases {
            let load = s.load("uid-a", now);
            assert_eq!(load.active, active, "at {now}");
            assert_eq!(
                load.earliest_expiry,
                earliest.and_then(|ms| Timestamp::from_millisecond(ms).ok())
            );
        }
        assert_eq!(s.load("uid-nobody", 0), ProxyLoad::default());
    }

    #[test]
    fn release_and_renew_only_touch_leases_that_count() {
        let mut s = state();
        assert_eq!(s.release("l1", DEFAULT, MIN), None, "past its expiry");
        assert_eq!(s.release("nope", DEFAULT, 0), None);
        assert_eq!(
            s.renew("l1", DEFAULT, MIN, 3 * MIN, 2 * MIN),
            RenewOutcome::Expired
        );
        assert_eq!(s.renew("nope", DEFAULT, 0, MIN, MIN), RenewOutcome::NotHeld);

        let RenewOutcome::Renewed(renewed) = s.renew("l1", DEFAULT, 10, 3 * MIN, 3 * MIN - 10)
        else {
            panic!("l1 counts at 10 ms");
        };
        assert_eq!(
            (renewed.expires_at, renewed.ttl_ms),
            (3 * MIN, 3 * MIN - 10)
        );
        assert_eq!(s.load("uid-a", 2 * MIN).active, 1);
        assert_eq!(
            s.decide_acquire(
                &Candidates::default(),
                None,
                Some(&key("r1", "f")),
                &anyone(),
                false,
                2 * MIN
            ),
            AcquireDecision::Replay("l1".into()),
            "renewing moves the request ID's window"
        );

        let released = s.release("l1", DEFAULT, 20).map(|l| l.expires_at);
        assert_eq!(released, Some(3 * MIN));
        assert_eq!(s.load("uid-a", 20).active, 0);
        assert_eq!(s.lease("l1"), None);
        assert_eq!(
            s.decide_acquire(
                &Candidates::default(),
                None,
                Some(&key("r1", "f")),
                &anyone(),
                false,
                20
            ),
            AcquireDecision::Replay("l1".into()),
            "a released lease is still the answer to its request ID"
        );
        assert_eq!(s.renew("l1", DEFAULT, 20, MIN, MIN), RenewOutcome::NotHeld);
    }

    #[test]
    fn ending_a_proxys_leases_releases_those_that_count_and_nothing_else() {
        let mut s = state();
        s.grant(
            "l3".into(),
            lease("a", 3 * MIN, Some("r3")),
            Some("f".into()),
        );
        s.grant("l0".into(), lease("a", 2 * MIN, None), None);
        s.commit();
        // At 1 min, l1 is past its expiry (left for the sweep); l0 and l3 count.
        let ended: Vec<(String, i64)> = s
            .end_leases("uid-a", MIN)
            .into_iter()
            .map(|(id, lease)| (id.to_string(), lease.expires_at))
            .collect();
        assert_eq!(
            ended,
            [("l0".to_owned(), 2 * MIN), ("l3".to_owned(), 3 * MIN)]
        );
        assert_eq!(s.load("uid-a", MIN).active, 0);
        assert_eq!(s.load("uid-b", MIN).active, 1, "other proxies keep theirs");
        assert!(
            s.lease("l1").is_some(),
            "the expired lease waits for the sweep"
        );
        assert_eq!(
            s.decide_acquire(
                &Candidates::default(),
                None,
                Some(&key("r3", "f")),
                &anyone(),
                false,
                MIN
            ),
            AcquireDecision::Replay("l3".into()),
            "an ended lease still answers its request ID"
        );
        assert_eq!(
            s.commit().proxies,
            HashSet::from([Arc::from("uid-a")]),
            "the readers' view of the proxy is refreshed"
        );
        assert!(s.end_leases("uid-a", MIN).is_empty(), "idempotent");
        assert!(s.end_leases("uid-nobody", 0).is_empty());
        assert_eq!(s.sweep(MIN).expired, 1, "the sweep still expires l1");
    }

    #[test]
    fn cooldowns_keep_the_later_end() {
        let mut s = state();
        s.cool_down("uid-a", "t", 4 * MIN);
        assert_eq!(s.cooldown("uid-a", "t"), Some(5 * MIN));
        s.cool_down("uid-a", "t", 6 * MIN);
        assert_eq!(s.cooldown("uid-a", "t"), Some(6 * MIN));
        assert_eq!(s.cooldown("uid-a", "u"), None);
    }

    #[test]
    fn sweep_drops_expired_leases_ended_cooldowns_and_closed_windows() {
        let cases = [
            (0, SweptMemory::default(), 2, 1, 1),
            (
                MIN,
                SweptMemory {
                    expired: 1,
                    cooldowns: 0,
                },
                1,
                1,
                0,
            ),
            (
                5 * MIN,
                SweptMemory {
                    expired: 2,
                    cooldowns: 1,
                },
                0,
                0,
                0,
            ),
        ];
        for (now, expected, leases, cooldowns, requests) in cases {
            let mut s = state();
            assert_eq!(s.sweep(now), expected, "at {now}");
            let summary = s.summary(0);
            assert_eq!(summary.active.len(), leases, "at {now}");
            assert_eq!(summary.cooldowns.len(), cooldowns, "at {now}");
            assert_eq!(summary.requests.len(), requests, "at {now}");
        }
    }

    #[test]
    fn rollback_restores_the_committed_state_exactly() {
        type Step = fn(&mut LedgerState);
        let steps: [(&str, Step); 8] = [
            ("grant", |s| {
                s.grant(
                    "l3".into(),
                    lease("a", 9 * MIN, Some("r3")),
                    Some("f".into()),
                );
            }),
            ("grant reusing a closed request ID", |s| {
                s.grant(
                    "l4".into(),
                    lease("c", 9 * MIN, Some("r1")),
                    Some("g".into()),
                );
            }),
            ("release", |s| {
                s.release("l2", DEFAULT, 0);
            }),
            ("renew", |s| {
                s.renew("l1", DEFAULT, 0, 7 * MIN, 7 * MIN);
            }),
            ("cooldown", |s| {
                s.cool_down("uid-b", "t", 7 * MIN);
                s.cool_down("uid-a", "t", 8 * MIN);
            }),
            ("sweep", |s| {
                s.sweep(6 * MIN);
            }),
            ("end a proxy's leases", |s| {
                s.grant("l6".into(), lease("b", 9 * MIN, None), None);
                s.end_leases("uid-b", 0);
            }),
            ("grant then release in one batch", |s| {
                s.grant("l5".into(), lease("a", 9 * MIN, None), None);
                s.release("l5", DEFAULT, 0);
            }),
        ];
        let before = state().summary(0);
        let mut s = state();
        for (name, step) in &steps {
            step(&mut s);
            assert_ne!(s.summary(0), before, "{name} changed nothing");
        }
        assert!(!s.touched.proxies.is_empty());
        s.rollback();
        assert_eq!(s.summary(0), before);
        assert_eq!(s.load("uid-a", 0).active, 1);
        assert_eq!(s.load("uid-b", 0).active, 1);
        assert_eq!(s.load("uid-c", 0).active, 0);
        assert_eq!(
            s.commit(),
            Touched::default(),
            "a rollback publishes nothing"
        );
        for (name, step) in steps {
            let mut one = state();
            step(&mut one);
            one.rollback();
            assert_eq!(one.summary(0), before, "{name}");
        }
    }

    #[test]
    fn commit_reports_what_changed() {
        let mut s = state();
        s.release("l2", DEFAULT, 0);
        s.cool_down("uid-c", "u", MIN);
        let touched = s.commit();
        assert_eq!(touched.proxies, HashSet::from([Arc::from("uid-b")]));
        assert_eq!(
            touched.cooldowns,
            HashSet::from([(Arc::from("uid-c"), Arc::from("u"))])
        );
        s.rollback();
        assert_eq!(s.load("uid-b", 0).active, 0, "committed changes stay");
    }

    fn team(
        name: &str,
        leases: Option<u32>,
        sessions: Option<u32>,
        rate: Option<(f64, u32)>,
    ) -> Tenancy {
        Tenancy {
            name: name.into(),
            quotas: crate::ledger::quota::Quotas {
                leases,
                sessions,
                rate: rate
                    .map(|(per_second, burst)| crate::ledger::quota::Rate { per_second, burst }),
            },
        }
    }

    fn tenant_lease(
        name: &str,
        tenant: &str,
        expires_at: i64,
        session: Option<&str>,
    ) -> ActiveLease {
        ActiveLease {
            tenant: tenant.into(),
            session: session.map(Arc::from),
            ..lease(name, expires_at, None)
        }
    }

    #[test]
    fn another_tenants_lease_is_neither_released_nor_renewed_nor_its_request_id_replayed() {
        let mut s = LedgerState::default();
        let mut a = tenant_lease("a", "team-a", 2 * MIN, None);
        a.request_id = Some("r".into());
        s.grant("la".into(), a, Some("f".into()));
        s.commit();
        assert_eq!(s.release("la", "team-b", 0), None);
        assert_eq!(
            s.renew("la", "team-b", 0, 3 * MIN, 3 * MIN),
            RenewOutcome::NotHeld
        );
        assert_eq!(s.load("uid-a", 0).active, 1, "still team-a's");
        let c = candidates(&[("a", 5), ("b", 5)]);
        let key = key("r", "f");
        // The same request ID and body from team-b is a new acquire, never team-a's lease.
        assert_eq!(
            s.decide_acquire(
                &c,
                None,
                Some(&key),
                &team("team-b", None, None, None),
                false,
                0
            ),
            grant(1)
        );
        assert_eq!(
            s.decide_acquire(
                &c,
                None,
                Some(&key),
                &team("team-a", None, None, None),
                false,
                0
            ),
            AcquireDecision::Replay("la".into())
        );
        assert!(s.release("la", "team-a", 0).is_some());
    }

    #[test]
    fn quotas_count_the_tenants_leases_and_sessions_that_count() {
        let mut s = LedgerState::default();
        s.grant("l1".into(), tenant_lease("a", "team-a", MIN, None), None);
        s.grant(
            "l2".into(),
            tenant_lease("b", "team-a", 2 * MIN, Some("s1")),
            None,
        );
        s.grant(
            "l3".into(),
            tenant_lease("c", "team-b", 2 * MIN, Some("s1")),
            None,
        );
        s.commit();
        let c = candidates(&[("d", 5)]);
        let quota = |decision: AcquireDecision| match decision {
            AcquireDecision::Quota(refused) => Some(refused.quota),
            _ => None,
        };
        let leases = team("team-a", Some(2), None, None);
        assert_eq!(
            quota(s.decide_acquire(&c, None, None, &leases, false, 0)),
            Some(crate::ledger::quota::QuotaKind::Leases)
        );
        // At 1 min l1 stopped counting: a slot is free.
        assert_eq!(
            s.decide_acquire(&c, None, None, &leases, false, MIN),
            grant(0)
        );
        let sessions = team("team-a", None, Some(1), None);
        assert_eq!(
            quota(s.decide_acquire(&c, None, None, &sessions, true, 0)),
            Some(crate::ledger::quota::QuotaKind::Sessions)
        );
        assert_eq!(
            s.decide_acquire(&c, None, None, &sessions, false, 0),
            grant(0)
        );
        assert_eq!(
            s.decide_acquire(
                &c,
                None,
                None,
                &team("team-c", Some(1), Some(1), None),
                true,
                0
            ),
            grant(0),
            "another tenant's leases are not counted"
        );
        assert_eq!(
            s.usage("team-a", 0),
            TenantUsage {
                leases: 2,
                sessions: 1,
                earliest_expiry: Some(MIN),
                earliest_session_expiry: Some(2 * MIN),
            }
        );
        s.release("l2", "team-a", 0);
        assert_eq!(s.usage("team-a", 0).sessions, 0);
    }

    #[test]
    fn a_grant_spends_a_token_and_a_rollback_gives_it_back() {
        let mut s = LedgerState::default();
        let rated = team("team-a", None, None, Some((1.0, 2)));
        let c = candidates(&[("a", 9)]);
        let mut granted = 0;
        for _ in 0..3 {
            match s.decide_acquire(&c, None, None, &rated, false, 0) {
                AcquireDecision::Grant {
                    bucket: Some(bucket),
                    ..
                } => {
                    s.spend(&rated.name, bucket);
                    granted += 1;
                }
                AcquireDecision::Quota(refused) => {
                    assert_eq!(refused.retry_after, std::time::Duration::from_secs(1));
                }
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(granted, 2, "the burst");
        s.rollback();
        assert!(matches!(
            s.decide_acquire(&c, None, None, &rated, false, 0),
            AcquireDecision::Grant { .. }
        ));
        let Some(rate) = rated.quotas.rate else {
            unreachable!()
        };
        s.spend(&rated.name, Bucket::full(&rate, 0).taken().taken());
        s.commit();
        assert!(matches!(
            s.decide_acquire(&c, None, None, &rated, false, 999),
            AcquireDecision::Quota(_)
        ));
        assert!(
            matches!(
                s.decide_acquire(&c, None, None, &rated, false, 1_000),
                AcquireDecision::Grant { .. }
            ),
            "refilled at one token a second"
        );
    }
}
