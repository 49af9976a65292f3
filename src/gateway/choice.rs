//! Which upstream proxy a gateway request goes through, and the lease it holds there.
//!
//! A lease is one crawler's claim on a proxy, as in the lease API: without a session, a client
//! connection holds one lease per target, for as long as the connection lives (renewed by use
//! at most once per half TTL, released when the connection closes); with a session, one lease
//! per (token, session name) serves every connection of the session (see [`crate::serving::sessions`]).
//! Either is kept while its proxy stays usable for the target: in the inventory, healthy, not
//! cordoned or draining, and not cooling down for the target. Otherwise it is given back and
//! another proxy is leased, through the same selection as the API's.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hyper::{Method, Uri};
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;

use super::Gateway;
use super::limits::Slot;
use super::timeouts::Activity;
use super::upstream::{HttpUpstream, Upstream};
use super::user::Options;
use crate::egress::host::{self, Host};
use crate::ledger::DEFAULT_TENANT;
use crate::ledger::{
    AcquireOutcome, AcquireRequest, Candidate, LeaseState, LedgerError, NoMatch, QuotaExceeded,
    RequestKey,
};
use crate::resources::proxy::ProxyId;
use crate::serving::candidates::Selector;
use crate::serving::sessions::{self, Session, SessionKey, Uses};
use crate::serving::tenants::Tenant;
use crate::serving::tokens::Caller;

/// How many epochs a session's acquire walks through to find (after a restart) the lease its
/// last move got, before it gives up.
const MAX_EPOCH_STEPS: u32 = 16;
/// How often idle sessions are looked for: well within the half of the shortest `sessionTTL`
/// by which a session's lease outlives its idle lifetime.
const IDLE_SWEEP: Duration = Duration::from_millis(250);

/// What a request is for: the target host and the port on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// Lower-cased host, an address in its usual spelling: the lease's target and the
    /// cooldown key.
    pub host: String,
    /// The port on the target.
    pub port: u16,
    /// What the host names, for the destination policy.
    pub destination: Host,
}

/// Why a request names no target the gateway relays to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TargetError {
    /// A malformed or unsupported request (400).
    Bad(&'static str),
    /// A port outside `--gateway-allowed-ports` (403).
    PortNotAllowed(u16),
    /// A host that is no host (400): a name ending in a number that is no IPv4 address.
    BadHost(String),
}

impl Target {
    /// The target of a `CONNECT host:port` or of an absolute-form `http://` request, if it is
    /// one the gateway relays to.
    pub fn of(method: &Method, uri: &Uri, allowed_ports: &[u16]) -> Result<Target, TargetError> {
        use TargetError::Bad;
        let (host, port) = if method == Method::CONNECT {
            let authority = uri.authority().ok_or(Bad("CONNECT needs host:port"))?;
            let port = authority.port_u16().ok_or(Bad("CONNECT needs host:port"))?;
            (authority.host(), port)
        } else {
            match uri.scheme_str() {
                Some("http") => {}
                Some(_) => {
                    return Err(Bad(
                        "only http:// is forwarded as is; use CONNECT for https",
                    ));
                }
                None => {
                    return Err(Bad(
                        "this is a forward proxy: send an absolute URL (GET http://host/path) \
                         or CONNECT host:port",
                    ));
                }
            }
            let authority = uri.authority().ok_or(Bad("the URL has no host"))?;
            (authority.host(), authority.port_u16().unwrap_or(80))
        };
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if host.is_empty() {
            return Err(Bad("the target has no host"));
        }
        if !allowed_ports.contains(&port) {
            return Err(TargetError::PortNotAllowed(port));
        }
        let destination = host::parse(host).map_err(TargetError::BadHost)?;
        let host = match &destination {
            Host::Ip(ip) => ip.to_string(),
            Host::Metadata(_) | Host::Name(_) => host.to_ascii_lowercase(),
        };
        Ok(Target {
            host,
            port,
            destination,
        })
    }

    /// `host:port`, as a CONNECT names it (brackets around an IPv6 host).
    pub fn authority(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

/// One request's question: who asks, with which options, for which target.
#[derive(Debug, Clone)]
pub struct Ask {
    /// The token's identity and its tenant.
    pub caller: Caller,
    /// The user part's options.
    pub options: Options,
    /// The target.
    pub target: Target,
}

impl Ask {
    fn session_key(&self) -> Option<SessionKey> {
        self.options.session.as_ref().map(|name| SessionKey {
            token: self.caller.token.clone(),
            name: name.clone(),
        })
    }

    /// The selector in canonical form (`k=v,k=v`, sorted): part of a session's identity.
    fn selector_text(&self) -> String {
        self.options
            .selector
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(",")
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
}

/// One client connection: the leases it holds without a session (by target, with when each
/// was last used) and its open upstream connections for plain HTTP (by lease). Requests of one
/// HTTP/1 connection come one after the other, so the locks are never contended.
pub struct ClientConnection {
    pub(super) gateway: Arc<Gateway>,
    /// Its requests under way, for its stream's timers.
    pub(super) activity: Arc<Activity>,
    leases: Mutex<HashMap<String, (Held, Instant)>>,
    pub(super) upstreams: Mutex<HashMap<String, HttpUpstream>>,
    /// The tenants it counts against (see [`ClientConnection::admit`]).
    tenants: std::sync::Mutex<Vec<(Arc<str>, Slot)>>,
}

impl ClientConnection {
    pub(super) fn new(gateway: Arc<Gateway>, activity: Arc<Activity>) -> Self {
        ClientConnection {
            gateway,
            activity,
            leases: Mutex::new(HashMap::new()),
            upstreams: Mutex::new(HashMap::new()),
            tenants: std::sync::Mutex::new(Vec::new()),
        }
    }

    /// Whether the connection may serve `tenant`: it counts against each tenant of the
    /// tenants file it served, from that tenant's first request on, and the first request over
    /// a tenant's cap is refused (the default tenant, the operators', has only the process's
    /// cap).
    pub(super) fn admit(&self, tenant: &Tenant) -> bool {
        if &*tenant.name == DEFAULT_TENANT {
            return true;
        }
        let mut counted = self
            .tenants
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if counted.iter().any(|(name, _)| *name == tenant.name) {
            return true;
        }
        match self.gateway.limits.tenant_connection(&tenant.name) {
            Some(slot) => {
                counted.push((tenant.name.clone(), slot));
                true
            }
            None => {
                self.gateway
                    .metrics
                    .connection_refused(super::limits::TENANT_LIMIT);
                false
            }
        }
    }

    /// The lease and upstream for a plain request of `ask`, skipping the proxies in `tried`:
    /// the session's, or the connection's for the target.
    pub(super) async fn choose(
        &self,
        ask: &Ask,
        tried: &HashSet<String>,
    ) -> Result<(Held, Upstream), Refusal> {
        match ask.session_key() {
            Some(key) => self.gateway.session_lease(ask, key, tried).await,
            None => self.connection_lease(ask, tried).await,
        }
    }

    /// The lease and upstream for a tunnel of `ask`: the session's, or one of the tunnel's own
    /// (the client connection becomes the tunnel, so the lease lives and ends with it).
    pub(super) async fn choose_for_tunnel(
        &self,
        ask: &Ask,
        tried: &HashSet<String>,
    ) -> Result<(Held, Upstream), Refusal> {
        if let Some(key) = ask.session_key() {
            return self.gateway.session_lease(ask, key, tried).await;
        }
        let ttl = self.gateway.config.connection_lease_ttl;
        match self.gateway.acquire(ask, None, ttl, tried).await? {
            Acquired::Usable(lease_id, proxy, upstream) => Ok((
                Held {
                    lease_id,
                    tenant: ask.caller.tenant.name.clone(),
                    proxy,
                    session: None,
                    ttl,
                    renewed: Instant::now(),
                    moved_from: None,
                    uses: Uses::default(),
                },
                upstream,
            )),
            Acquired::Unusable(lease_id) => {
                self.gateway
                    .give_back(&lease_id, ask.caller.tenant_name())
                    .await;
                Err(Refusal::NoMatch(NoMatch::default()))
            }
        }
    }

    /// The connection's lease for the target, or a new one.
    async fn connection_lease(
        &self,
        ask: &Ask,
        tried: &HashSet<String>,
    ) -> Result<(Held, Upstream), Refusal> {
        let gateway = &self.gateway;
        let mut leases = self.leases.lock().await;
        let mut moved_from = None;
        let now = Instant::now();
        if let Some((held, _)) = leases.get(&ask.target.host) {
            if !tried.contains(&held.proxy.uid)
                && let Some(upstream) = gateway.usable(&held.proxy, ask)
            {
                if now.saturating_duration_since(held.renewed) < held.ttl / 2 {
                    let held = held.clone();
                    leases.insert(ask.target.host.clone(), (held.clone(), now));
                    return Ok((held, upstream));
                }
                if gateway
                    .ledger
                    .renew(&held.lease_id, &held.tenant, held.ttl)
                    .await
                    .is_ok()
                {
                    let held = Held {
                        renewed: now,
                        ..held.clone()
                    };
                    leases.insert(ask.target.host.clone(), (held.clone(), now));
                    return Ok((held, upstream));
                }
            }
            if let Some((old, _)) = leases.remove(&ask.target.host) {
                gateway.give_back(&old.lease_id, &old.tenant).await;
                moved_from = Some(old.proxy);
            }
        }
        // At the cap, the lease used longest ago goes back first.
        while leases.len() >= gateway.config.max_connection_leases.max(1) {
            let Some(oldest) = leases
                .iter()
                .min_by_key(|(_, (_, used))| *used)
                .map(|(target, _)| target.clone())
            else {
                break;
            };
            if let Some((old, _)) = leases.remove(&oldest) {
                gateway.give_back(&old.lease_id, &old.tenant).await;
            }
        }
        let ttl = gateway.config.connection_lease_ttl;
        let (lease_id, proxy, upstream) = match gateway.acquire(ask, None, ttl, tried).await? {
            Acquired::Usable(lease_id, proxy, upstream) => (lease_id, proxy, upstream),
            Acquired::Unusable(lease_id) => {
                gateway.give_back(&lease_id, ask.caller.tenant_name()).await;
                return Err(Refusal::NoMatch(NoMatch::default()));
            }
        };
        let held = Held {
            lease_id,
            tenant: ask.caller.tenant.name.clone(),
            proxy,
            session: None,
            ttl,
            renewed: Instant::now(),
            moved_from,
            uses: Uses::default(),
        };
        leases.insert(ask.target.host.clone(), (held.clone(), now));
        Ok((held, upstream))
    }

    /// Lets go of a lease that failed upstream (a session moves on its next request).
    pub(super) async fn drop_lease(&self, held: &Held) {
        self.upstreams.lock().await.remove(&held.lease_id);
        match &held.session {
            Some(key) => {
                self.gateway.sessions.remove(key, &held.lease_id);
                self.gateway.give_back(&held.lease_id, &held.tenant).await;
            }
            None => {
                let mut leases = self.leases.lock().await;
                if let Some(host) = leases
                    .iter()
                    .find(|(_, (h, _))| h.lease_id == held.lease_id)
                    .map(|(host, _)| host.clone())
                {
                    leases.remove(&host);
                }
                drop(leases);
                self.gateway.give_back(&held.lease_id, &held.tenant).await;
            }
        }
    }

    /// Gives back the leases on proxies `gone` says are draining or gone that no request is
    /// using, and closes their idle upstream connections; skipped while a request is choosing
    /// (the next sweep comes soon).
    pub(super) async fn let_go_of(&self, gone: impl Fn(&ProxyId) -> bool) {
        self.upstreams
            .lock()
            .await
            .retain(|_, upstream| upstream.busy() || !gone(upstream.proxy()));
        let Ok(mut leases) = self.leases.try_lock() else {
            return;
        };
        let released: Vec<Held> = leases
            .extract_if(|_, (held, _)| held.uses.idle() && gone(&held.proxy))
            .map(|(_, (held, _))| held)
            .collect();
        drop(leases);
        for held in released {
            self.gateway.give_back(&held.lease_id, &held.tenant).await;
        }
    }

    /// The connection closed: its own leases go back (a session's stay with the session).
    pub(super) async fn close(&self) {
        self.upstreams.lock().await.clear();
        let leases: Vec<Held> = self
            .leases
            .lock()
            .await
            .drain()
            .map(|(_, (h, _))| h)
            .collect();
        for held in leases {
            self.gateway.give_back(&held.lease_id, &held.tenant).await;
        }
    }
}

/// What an acquire got.
enum Acquired {
    /// A lease on a proxy that can carry the request.
    Usable(String, ProxyId, Upstream),
    /// A lease on a proxy that cannot (it changed since the candidates were read).
    Unusable(String),
}

impl Gateway {
    /// Where `proxy` is, if it may carry `ask`'s request now: for its target, and within its
    /// tenant's scope (which may have shrunk since the lease was taken).
    pub(super) fn usable(&self, proxy: &ProxyId, ask: &Ask) -> Option<Upstream> {
        let target = ask.target.host.as_str();
        let snapshot = self.inventory.snapshot();
        let position = snapshot.position(proxy)?;
        let leasable = snapshot.leasable().get(position)?;
        if leasable.cordoned || leasable.draining || !leasable.has_address {
            return None;
        }
        if self.health.get(proxy).and_then(|h| h.healthy) != Some(true) {
            return None;
        }
        if self.ledger.counts().in_cooldown(&proxy.uid, target) {
            return None;
        }
        let object = snapshot.proxies().get(position)?;
        if !ask
            .caller
            .tenant
            .sees(proxy, object.metadata.labels.as_ref())
        {
            return None;
        }
        let host = object
            .spec
            .effective_host(object.status.as_ref())?
            .to_owned();
        let port = u16::try_from(object.spec.effective_port(object.status.as_ref())).ok()?;
        Some(Upstream {
            host,
            port,
            credentials: self.credentials.for_proxy(object),
        })
    }

    /// The session's lease if its proxy is still usable for the target; else the session
    /// moves: its lease goes back and the next epoch's lease is taken (or found again, after a
    /// restart, by walking the epochs: a replay of an active lease on a usable proxy is it).
    async fn session_lease(
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
        if let Some(session) = self.sessions.get(&key) {
            if session.selector == selector
                && !session.released
                && !tried.contains(&session.proxy.uid)
                && let Some(upstream) = self.usable(&session.proxy, ask)
            {
                let renewed = session.renewal_due(now);
                let alive = !renewed
                    || self
                        .ledger
                        .renew(&session.lease_id, &session.tenant, ttl)
                        .await
                        .is_ok();
                if alive {
                    self.sessions.touch(&key, &session.lease_id, now, renewed);
                    let held = Held {
                        lease_id: session.lease_id,
                        tenant: session.tenant,
                        proxy: session.proxy,
                        session: Some(key),
                        ttl,
                        renewed: now,
                        moved_from: None,
                        uses: session.uses,
                    };
                    return Ok((held, upstream));
                }
            }
            self.sessions.remove(&key, &session.lease_id);
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
                    self.sessions.put(
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

    /// Acquires a lease for `ask` (on a proxy of its tenant's scope, none of `tried`), with
    /// `request` when it is a session's.
    async fn acquire(
        &self,
        ask: &Ask,
        request: Option<RequestKey>,
        ttl: Duration,
        tried: &HashSet<String>,
    ) -> Result<Acquired, Refusal> {
        let selector = ask
            .caller
            .tenant
            .narrow(&Selector::from(ask.options.selector.clone()));
        let snapshot = self.inventory.snapshot();
        let mut candidates = self
            .candidates
            .candidates(&snapshot, &self.health, &selector);
        drop(snapshot);
        if !tried.is_empty() {
            let left: Vec<Candidate> = candidates
                .iter()
                .filter(|c| !tried.contains(&c.proxy.uid))
                .cloned()
                .collect();
            candidates = left.into();
        }
        let outcome = self
            .ledger
            .acquire(AcquireRequest {
                candidates,
                target: Some(ask.target.host.clone()),
                ttl,
                session: ask.options.session.clone().filter(|_| request.is_some()),
                request,
                client: Some(ask.options.client.clone()).filter(|c| !c.is_empty()),
                tenant: ask.caller.tenant.tenancy(),
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
        Ok(match self.usable(&lease.proxy, ask) {
            Some(upstream) => Acquired::Usable(lease.id, lease.proxy, upstream),
            None => Acquired::Unusable(lease.id),
        })
    }

    /// Releases `tenant`'s lease the gateway no longer uses (logged when the ledger cannot
    /// take it: the lease then expires by itself).
    pub(super) async fn give_back(&self, lease_id: &str, tenant: &str) {
        if let Err(e) = self.ledger.release(lease_id, tenant).await {
            log::warn!("gateway: releasing lease {lease_id} failed (it expires by itself): {e}");
        }
    }
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
        for (_, session) in gateway.sessions.take_idle(Instant::now()) {
            gateway.give_back(&session.lease_id, &session.tenant).await;
        }
    }
}
