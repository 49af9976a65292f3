//! Which upstream proxy a gateway request goes through, and the lease it holds there: the
//! [`Gateway`], what every connection shares, chooses, keeps and gives back leases.
//!
//! A lease is one crawler's claim on a proxy, as in the lease API: without a session, a client
//! connection holds one lease per target (see `connection`); with a session, one lease per
//! (token, session name) serves every connection of the session (see
//! [`crate::serving::sessions`]). Either is kept while its proxy stays usable for the target:
//! in the inventory, healthy, not cordoned or draining, and not cooling down for the target.
//! Otherwise it is given back and another proxy is leased, through the same selection as the
//! API's.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::accounting::Accounting;
use super::ask::Ask;
use super::config::GatewayConfig;
use super::intercept::Interception;
use super::limits::Limits;
use super::metrics::GatewayMetrics;
use super::rules::{RuleSet, Rules};
use super::upstream::Upstream;
use crate::egress::Destinations;
use crate::ledger::{
    AcquireOutcome, LeaseReport, LeaseState, LedgerError, NoMatch, QuotaExceeded, ReportResult,
    RequestKey, cooldown_key,
};
use crate::resources::proxy::ProxyId;
use crate::resources::rotating::FillError;
use crate::serving::Fleet;
use crate::serving::candidates::Selector;
use crate::serving::fleet::{Acquire, lease_exit};
use crate::serving::sessions::{self, Session, SessionKey, Uses};
use crate::serving::tokens::ApiToken;

/// How many epochs a session's acquire walks through to find (after a restart) the lease its
/// last move got, before it gives up.
const MAX_EPOCH_STEPS: u32 = 16;

/// How often idle sessions are looked for: well within the half of the shortest `sessionTTL`
/// by which a session's lease outlives its idle lifetime.
const IDLE_SWEEP: Duration = Duration::from_millis(250);

/// What the gateway reads and writes, shared by every connection.
pub struct Gateway {
    /// The fleet, shared with the lease API.
    pub fleet: Fleet,
    /// The tokens that grant access.
    pub tokens: ApiToken,
    /// Counters.
    pub metrics: GatewayMetrics,
    /// Settings.
    pub config: GatewayConfig,
    /// The per-target rules in force (`--gateway-rules-file`, `--gateway-ban-statuses`).
    pub rules: Rules,
    /// Interception of HTTPS, when the operator has a CA.
    pub interception: Option<Arc<Interception>>,
    /// What crawlers may reach.
    pub(super) destinations: Destinations,
    /// The caps on connections and held requests.
    pub(super) limits: Arc<Limits>,
    /// Client connections and tunnels, awaited at shutdown.
    pub(super) tasks: TaskTracker,
    /// Fired at shutdown: connections and tunnels end and give their leases back.
    pub(super) stopping: CancellationToken,
    /// Bytes relayed, on their way to the ledger's hourly traffic rows.
    pub(super) accounting: Accounting,
}

impl Gateway {
    /// A gateway over `fleet`, admitting `tokens`.
    pub fn new(
        fleet: Fleet,
        tokens: ApiToken,
        metrics: GatewayMetrics,
        config: GatewayConfig,
    ) -> Self {
        let accounting = Accounting::new(config.traffic_ledger);
        Gateway {
            destinations: Destinations::new(
                config.allowed_destinations.clone(),
                config.pass_unresolved,
            ),
            limits: Limits::new(
                config.max_connections,
                config.max_tenant_connections,
                config.max_held,
            ),
            rules: Rules::new(RuleSet::new(&config.ban_rule, Vec::new())),
            interception: None,
            fleet,
            tokens,
            metrics,
            config,
            tasks: TaskTracker::new(),
            stopping: CancellationToken::new(),
            accounting,
        }
    }

    /// Counts `up` and `down` bytes relayed `for_`: in the metrics, and towards the ledger's
    /// hourly traffic rows. Tunnels and relayed answer bodies both count here.
    pub(super) fn relayed(&self, for_: RelayedFor<'_>, up: u64, down: u64) {
        self.metrics.relayed(for_.tenant, &for_.proxy.uid, up, down);
        self.accounting
            .add(for_.tenant, for_.proxy, for_.target, up, down);
    }

    /// Writes the bytes relayed since the last flush to the ledger.
    pub(super) async fn flush_traffic(&self) {
        let inventory = self.fleet.inventory.snapshot();
        let now = self.fleet.clock.now().as_millisecond();
        self.accounting
            .flush(self.fleet.ledger.as_ref(), &inventory, now)
            .await;
    }

    /// Why `ask`'s tenant may start no new work: its bytes of the day reached its
    /// `bytesPerDay` quota (see `accounting`).
    pub(super) fn budget_spent(&self, ask: &Ask) -> Option<QuotaExceeded> {
        let now = self.fleet.clock.now().as_millisecond();
        self.accounting.budget_spent(&ask.caller.tenant, now)
    }

    /// Whether `host` is never intercepted (`--gateway-intercept-exclude`).
    pub(super) fn excluded_from_interception(&self, host: &str) -> bool {
        let host = host.strip_suffix('.').unwrap_or(host);
        self.config
            .intercept_exclude
            .iter()
            .any(|pattern| pattern.matches(host))
    }

    /// The gateway judging answers by `rules`.
    pub fn with_rules(self, rules: Rules) -> Self {
        Gateway { rules, ..self }
    }

    /// The gateway intercepting with `interception`.
    pub fn with_interception(self, interception: Arc<Interception>) -> Self {
        Gateway {
            interception: Some(interception),
            ..self
        }
    }

    /// Where `proxy` is, if it may carry `ask`'s request on lease `lease_id` now: for its
    /// target, and within its tenant's scope (which may have shrunk since the lease was taken).
    pub(super) fn usable(&self, proxy: &ProxyId, lease_id: &str, ask: &Ask) -> Option<Upstream> {
        self.upstream(proxy, lease_id, ask).ok().flatten()
    }

    /// [`usable`](Self::usable), saying when a rotating upstream's username cannot be spelled
    /// for the request (a field without a value, or an unsafe one).
    fn upstream(
        &self,
        proxy: &ProxyId,
        lease_id: &str,
        ask: &Ask,
    ) -> Result<Option<Upstream>, FillError> {
        let target = ask.target.host.as_str();
        let snapshot = self.fleet.inventory.snapshot();
        let Some(position) = snapshot.position(proxy) else {
            return Ok(None);
        };
        let (Some(leasable), Some(object)) = (
            snapshot.leasable().get(position),
            snapshot.proxies().get(position),
        ) else {
            return Ok(None);
        };
        if leasable.cordoned || leasable.draining || !leasable.has_address {
            return Ok(None);
        }
        if self.fleet.health.get(proxy).and_then(|h| h.healthy) != Some(true) {
            return Ok(None);
        }
        let exit = lease_exit(object, proxy, lease_id);
        let cooled = cooldown_key(&proxy.uid, exit.as_deref());
        if self.fleet.ledger.counts().in_cooldown(&cooled, target) {
            return Ok(None);
        }
        let labels = object.metadata.labels.as_ref();
        if !ask.caller.tenant.sees(proxy, labels) {
            return Ok(None);
        }
        let status = object.status.as_ref();
        let (Some(host), Ok(port)) = (
            object.spec.effective_host(status),
            u16::try_from(object.spec.effective_port(status)),
        ) else {
            return Ok(None);
        };
        let credentials =
            self.fleet
                .upstream_credentials(object, exit.as_deref(), &ask.options.selector)?;
        Ok(Some(Upstream {
            host: host.to_owned(),
            port,
            protocol: object.spec.protocol(),
            credentials,
        }))
    }

    /// The session's lease if its proxy is still usable for the target; else the session
    /// moves: its lease goes back and the next epoch's lease is taken (or found again, after a
    /// restart, by walking the epochs: a replay of an active lease on a usable proxy is it).
    pub(super) async fn session_lease(
        &self,
        ask: &Ask,
        key: SessionKey,
        tried: &HashSet<String>,
    ) -> Result<(Held, Upstream), Refusal> {
        let selector = ask.selector_text();
        let idle_ttl = ask.options.session_ttl.unwrap_or(self.config.session_ttl);
        let ttl = Session::lease_ttl(idle_ttl);
        let now = Instant::now();
        let mut epoch = 0;
        let mut moved_from = None;
        if let Some(session) = self.fleet.sessions.get(&key) {
            if session.selector == selector
                && !session.released
                && !tried.contains(&session.proxy.uid)
                && let Some(upstream) = self.usable(&session.proxy, &session.lease_id, ask)
            {
                let renewed = session.renewal_due(now);
                let alive = !renewed
                    || self
                        .fleet
                        .ledger
                        .renew(&session.lease_id, &session.tenant, ttl)
                        .await
                        .is_ok();
                if alive {
                    self.fleet
                        .sessions
                        .touch(&key, &session.lease_id, now, renewed);
                    let held = Held {
                        lease_id: session.lease_id,
                        tenant: session.tenant,
                        proxy: session.proxy,
                        target: ask.target.host.as_str().into(),
                        session: Some(key),
                        ttl,
                        renewed: now,
                        moved_from: None,
                        uses: session.uses,
                    };
                    return Ok((held, upstream));
                }
            }
            self.fleet.sessions.remove(&key, &session.lease_id);
            self.give_back(&session.lease_id, &session.tenant).await;
            epoch = session.epoch.saturating_add(1);
            moved_from = Some(session.proxy);
        }
        for _ in 0..MAX_EPOCH_STEPS {
            let request = RequestKey {
                id: sessions::request_id(&key, &selector, epoch),
                fingerprint: format!("gateway-session|{selector}|{}", ttl.as_millis()),
            };
            match self.acquire(ask, Some(request), ttl, tried).await {
                Ok(Acquired::Usable(lease_id, proxy, upstream)) => {
                    let uses = Uses::default();
                    self.fleet.sessions.put(
                        key.clone(),
                        Session {
                            lease_id: lease_id.clone(),
                            tenant: ask.caller.tenant.name.clone(),
                            proxy: proxy.clone(),
                            selector,
                            epoch,
                            idle_ttl,
                            last_used: now,
                            renewed: now,
                            uses: uses.clone(),
                            released: false,
                        },
                    );
                    let held = Held {
                        lease_id,
                        tenant: ask.caller.tenant.name.clone(),
                        proxy,
                        target: ask.target.host.as_str().into(),
                        session: Some(key),
                        ttl,
                        renewed: now,
                        moved_from,
                        uses,
                    };
                    return Ok((held, upstream));
                }
                Ok(Acquired::Unusable(lease_id)) => {
                    self.give_back(&lease_id, ask.caller.tenant_name()).await;
                }
                // The epoch's ID answers a question asked differently (another sessionTTL).
                Err(Refusal::Ledger(LedgerError::RequestIdReused { .. })) => {}
                Err(refusal) => return Err(refusal),
            }
            epoch = epoch.saturating_add(1);
        }
        Err(Refusal::NoMatch(NoMatch::default()))
    }

    /// The lease and upstream for a tunnel of `ask`, on none of `tried`: the session's, or one
    /// of the tunnel's own (the client connection becomes the tunnel, so the lease lives and
    /// ends with it).
    pub(super) async fn tunnel_lease(
        &self,
        ask: &Ask,
        tried: &HashSet<String>,
    ) -> Result<(Held, Upstream), Refusal> {
        if let Some(key) = ask.session_key() {
            return self.session_lease(ask, key, tried).await;
        }
        self.own_lease(ask, tried, None).await
    }

    /// A new lease of the connection's own (no session) for `ask`, on none of `tried`;
    /// `moved_from`: the proxy the connection's lease for the target was on before.
    pub(super) async fn own_lease(
        &self,
        ask: &Ask,
        tried: &HashSet<String>,
        moved_from: Option<ProxyId>,
    ) -> Result<(Held, Upstream), Refusal> {
        let ttl = self.config.connection_lease_ttl;
        match self.acquire(ask, None, ttl, tried).await? {
            Acquired::Usable(lease_id, proxy, upstream) => Ok((
                Held {
                    lease_id,
                    tenant: ask.caller.tenant.name.clone(),
                    proxy,
                    target: ask.target.host.as_str().into(),
                    session: None,
                    ttl,
                    renewed: Instant::now(),
                    moved_from,
                    uses: Uses::default(),
                },
                upstream,
            )),
            Acquired::Unusable(lease_id) => {
                self.give_back(&lease_id, ask.caller.tenant_name()).await;
                Err(Refusal::NoMatch(NoMatch::default()))
            }
        }
    }

    /// Lets go of `held`, whose proxy failed or was banned: a session's lease leaves the session
    /// (which moves on its next request) and goes back, as a connection's own does.
    pub(super) async fn let_go(&self, held: &Held) {
        if let Some(key) = &held.session {
            self.fleet.sessions.remove(key, &held.lease_id);
        }
        self.give_back(&held.lease_id, &held.tenant).await;
    }

    /// Acquires a lease for `ask` (on a proxy of its tenant's scope, none of `tried`), with
    /// `request` when it is a session's.
    ///
    /// With a fallback chain (the proxy URL's `fallback=`, else the target's rule's), each
    /// step's selector is added to the request's in turn until one grants: the ledger records
    /// the step, and a metric counts it.
    async fn acquire(
        &self,
        ask: &Ask,
        request: Option<RequestKey>,
        ttl: Duration,
        tried: &HashSet<String>,
    ) -> Result<Acquired, Refusal> {
        let own = Selector::from(ask.options.selector.clone());
        let rules = self.rules.current();
        let chain = match &ask.options.fallback {
            Some(name) => Some(
                rules
                    .chain(name)
                    .ok_or_else(|| Refusal::UnknownChain(name.clone()))?,
            ),
            None => rules.for_host(&ask.target.host).fallback(),
        };
        let Some(chain) = chain else {
            return self.acquire_step(ask, own, None, request, ttl, tried).await;
        };
        let mut refused = NoMatch::default();
        for (number, step) in (1..).zip(&chain.steps) {
            let selector = own.within(step);
            match self
                .acquire_step(ask, selector, Some(number), request.clone(), ttl, tried)
                .await
            {
                Err(Refusal::NoMatch(no_match)) => refused = refused.and(no_match),
                Ok(acquired) => {
                    self.metrics.fallback_step(&chain.name, number);
                    return Ok(acquired);
                }
                Err(other) => return Err(other),
            }
        }
        Err(Refusal::NoMatch(refused))
    }

    /// One acquire for `ask` with `selector` (`step`: of a fallback chain).
    async fn acquire_step(
        &self,
        ask: &Ask,
        selector: Selector,
        step: Option<u32>,
        request: Option<RequestKey>,
        ttl: Duration,
        tried: &HashSet<String>,
    ) -> Result<Acquired, Refusal> {
        let outcome = self
            .fleet
            .acquire(Acquire {
                tenant: &ask.caller.tenant,
                selector,
                excluding: tried,
                target: Some(ask.target.host.clone()),
                ttl,
                session: ask.options.session.clone().filter(|_| request.is_some()),
                request,
                client: Some(ask.options.client.clone()).filter(|c| !c.is_empty()),
                fallback_step: step,
            })
            .await
            .map_err(Refusal::Ledger)?;
        let lease = match outcome {
            AcquireOutcome::Granted(lease) => lease,
            // A session's earlier lease: it is the session's only while it still counts.
            AcquireOutcome::Replayed(lease) if lease.state == LeaseState::Active => lease,
            AcquireOutcome::Replayed(lease) => return Ok(Acquired::Unusable(lease.id)),
            AcquireOutcome::NoMatch(no_match) => return Err(Refusal::NoMatch(no_match)),
            AcquireOutcome::QuotaExceeded(refused) => return Err(Refusal::Quota(refused)),
        };
        if tried.contains(&lease.proxy.uid) {
            return Ok(Acquired::Unusable(lease.id));
        }
        match self.upstream(&lease.proxy, &lease.id, ask) {
            Ok(Some(upstream)) => Ok(Acquired::Usable(lease.id, lease.proxy, upstream)),
            Ok(None) => Ok(Acquired::Unusable(lease.id)),
            Err(unspellable) => {
                self.give_back(&lease.id, ask.caller.tenant_name()).await;
                Err(Refusal::Username(unspellable))
            }
        }
    }

    /// Releases `tenant`'s lease the gateway no longer uses (logged when the ledger cannot
    /// take it: the lease then expires by itself).
    pub(super) async fn give_back(&self, lease_id: &str, tenant: &str) {
        if let Err(e) = self.fleet.ledger.release(lease_id, tenant).await {
            log::warn!("gateway: releasing lease {lease_id} failed (it expires by itself): {e}");
        }
    }

    /// Reports what went wrong upstream on `held` for `target` (logged when the ledger cannot
    /// take it).
    pub(super) async fn report_failure(&self, held: &Held, target: &str, result: ReportResult) {
        let report = LeaseReport {
            result,
            target: Some(target.to_owned()),
            cooldown: None,
            exit: self.fleet.exit_of(&held.proxy, &held.lease_id),
        };
        if let Err(e) = self
            .fleet
            .ledger
            .report(&held.lease_id, &held.tenant, report)
            .await
        {
            log::warn!("gateway: reporting lease {} failed: {e}", held.lease_id);
        }
    }

    /// Keeps a lease in use alive: a session's is touched and renewed when due; a tunnel's
    /// own is renewed.
    pub(super) async fn keep(&self, held: &Held) {
        let now = std::time::Instant::now();
        match &held.session {
            Some(key) => {
                let Some(session) = self.fleet.sessions.get(key) else {
                    return;
                };
                if session.lease_id != held.lease_id {
                    return;
                }
                let renewed = session.renewal_due(now)
                    && self
                        .fleet
                        .ledger
                        .renew(&held.lease_id, &held.tenant, held.ttl)
                        .await
                        .is_ok();
                self.fleet.sessions.touch(key, &held.lease_id, now, renewed);
            }
            None => {
                if let Err(e) = self
                    .fleet
                    .ledger
                    .renew(&held.lease_id, &held.tenant, held.ttl)
                    .await
                {
                    log::warn!("gateway: renewing lease {} failed: {e}", held.lease_id);
                }
            }
        }
    }

    /// A tunnel ended: its own lease goes back; a session's idle time starts now.
    pub(super) async fn done_with(&self, held: &Held) {
        match &held.session {
            Some(key) => {
                self.fleet
                    .sessions
                    .touch(key, &held.lease_id, std::time::Instant::now(), false);
            }
            None => self.give_back(&held.lease_id, &held.tenant).await,
        }
    }
}

/// What bytes relayed are counted for: the tenant, the proxy they went through and the target.
pub(super) struct RelayedFor<'a> {
    pub tenant: &'a Arc<str>,
    pub proxy: &'a ProxyId,
    pub target: &'a Arc<str>,
}

impl<'a> From<&'a Held> for RelayedFor<'a> {
    fn from(held: &'a Held) -> Self {
        RelayedFor {
            tenant: &held.tenant,
            proxy: &held.proxy,
            target: &held.target,
        }
    }
}

/// A lease a request goes through.
#[derive(Debug, Clone)]
pub struct Held {
    /// The lease.
    pub lease_id: String,
    /// The tenant it belongs to.
    pub tenant: Arc<str>,
    /// Its proxy.
    pub proxy: ProxyId,
    /// The target (host) of the request it serves now.
    pub target: Arc<str>,
    /// The session it belongs to; `None`: the connection's own.
    pub session: Option<SessionKey>,
    /// TTL it is renewed with.
    pub ttl: Duration,
    /// When it was last renewed (connection leases; a session's is in the table).
    pub renewed: Instant,
    /// The proxy a session left for this one, on its first use.
    pub moved_from: Option<ProxyId>,
    /// Requests and tunnels using it now (a session's are the session's).
    pub uses: Uses,
}

/// Why no lease could be had.
#[derive(Debug)]
pub enum Refusal {
    /// No proxy can take one; why.
    NoMatch(NoMatch),
    /// The caller's tenant is at a quota.
    Quota(QuotaExceeded),
    /// The ledger failed.
    Ledger(LedgerError),
    /// A rotating upstream's username cannot be spelled for the request.
    Username(FillError),
    /// The proxy URL's `fallback=` names no chain of the rules file.
    UnknownChain(String),
}

/// What an acquire got.
enum Acquired {
    /// A lease on a proxy that can carry the request.
    Usable(String, ProxyId, Upstream),
    /// A lease on a proxy that cannot (it changed since the candidates were read).
    Unusable(String),
}

/// Releases the leases of sessions idle past their lifetime, every [`IDLE_SWEEP`], until
/// `shutdown`.
pub(super) async fn release_idle_sessions(gateway: Arc<Gateway>, shutdown: CancellationToken) {
    let mut ticker = tokio::time::interval(IDLE_SWEEP);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = ticker.tick() => {}
        }
        for (_, session) in gateway.fleet.sessions.take_idle(Instant::now()) {
            gateway.give_back(&session.lease_id, &session.tenant).await;
        }
    }
}
