//! One client connection and its requests, one after the other: who asks (the token, the
//! user part, the tenant's cap of connections), for which target (the port and the
//! destination policy), then the request sent through an upstream (`tunnel`, `forward`), with
//! another tried when one fails before anything reached the crawler. Without a session the
//! connection holds its own leases, one per target, the least recently used given back first
//! at its cap; a session's lease is the gateway's (see `choice`).

mod answer;
mod forward;
mod inspect;
mod tunnel;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::header::{HeaderValue, PROXY_AUTHORIZATION};
use hyper::{Method, Request, Response, StatusCode};
use serde_json::json;
use tokio::sync::Mutex;

use super::answers::{
    Body, RequestOutcome, destination_refusal, error, interception_refused, json_response,
    proxy_auth_required, refusal, target_refusal, too_many_connections,
};
use super::ask::{Ask, Target, TargetError};
use super::choice::{Gateway, Held, Refusal};
use super::intercept::Interception;
use super::limits::Slot;
use super::metrics::{HOLD_RELAYED, HOLD_TIMED_OUT};
use super::timeouts::{self, Activity};
use super::upstream::{HttpUpstream, Upstream, UpstreamFailure};
use super::{auth, hold, user};
use crate::ledger::{DEFAULT_TENANT, ReportResult};
use crate::resources::proxy::ProxyId;
use crate::serving::outcomes::Outcome;
use crate::serving::tenants::Tenant;

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

    /// Answers one request.
    pub(super) async fn handle(self: &Arc<Self>, request: Request<Incoming>) -> Response<Body> {
        let under_way = self.activity.begin();
        let kind = if request.method() == Method::CONNECT {
            "connect"
        } else {
            "http"
        };
        let (outcome, response) = self.route(request).await;
        self.gateway.metrics.request(kind, outcome);
        response.map(|body| timeouts::Finishing::new(body, under_way).boxed())
    }

    async fn route(
        self: &Arc<Self>,
        request: Request<Incoming>,
    ) -> (RequestOutcome, Response<Body>) {
        let gateway = &self.gateway;
        let header = request
            .headers()
            .get(PROXY_AUTHORIZATION)
            .map(HeaderValue::as_bytes);
        let Some(caller) = auth::caller(&gateway.tokens, header) else {
            return (RequestOutcome::AuthRequired, proxy_auth_required());
        };
        if !self.admit(&caller.caller.tenant) {
            return (
                RequestOutcome::TooManyConnections,
                too_many_connections(
                    &caller.caller.tenant.name,
                    gateway.limits.max_tenant_connections(),
                ),
            );
        }
        let options = match user::parse(&caller.user) {
            Ok(options) => options,
            Err(problem) => {
                return (
                    RequestOutcome::BadRequest,
                    error(StatusCode::BAD_REQUEST, "bad_proxy_user", &problem),
                );
            }
        };
        let allowed_ports = &gateway.config.allowed_ports;
        let target = match Target::of(request.method(), request.uri(), allowed_ports) {
            Ok(target) => target,
            Err(TargetError::Bad(problem)) => {
                return (
                    RequestOutcome::BadRequest,
                    error(StatusCode::BAD_REQUEST, "bad_request", problem),
                );
            }
            Err(TargetError::BadHost(problem)) => {
                return (
                    RequestOutcome::BadRequest,
                    error(StatusCode::BAD_REQUEST, "bad_request", &problem),
                );
            }
            Err(TargetError::PortNotAllowed(port)) => {
                let message = format!(
                    "the gateway relays to ports {allowed_ports:?} only \
                     (--gateway-allowed-ports), not {port}"
                );
                return (
                    RequestOutcome::PortRefused,
                    error(StatusCode::FORBIDDEN, "port_not_allowed", &message),
                );
            }
        };
        if let Err(refused) = gateway
            .destinations
            .check(&target.destination, target.port)
            .await
        {
            gateway.metrics.destination_refused(refused.reason());
            return (
                RequestOutcome::DestinationRefused,
                destination_refusal(&refused),
            );
        }
        let ask = Ask {
            caller: caller.caller,
            options,
            target,
        };
        if request.method() != Method::CONNECT {
            return forward::send(self, request, &ask).await;
        }
        match self.interception_for(&ask) {
            Ok(Some(interception)) => inspect::open(self, request, &ask, interception).await,
            Ok(None) => tunnel::open(self, request, &ask).await,
            Err(why) => (
                RequestOutcome::InterceptionRefused,
                interception_refused(&why),
            ),
        }
    }

    /// What intercepts `ask`'s CONNECT: nothing unless it asks (`tls=inspect`) and its host
    /// is not excluded; then the gateway's interception, or why it refuses (no CA, a tenant
    /// not allowed): never a silent tunnel.
    fn interception_for(&self, ask: &Ask) -> Result<Option<Arc<Interception>>, String> {
        let gateway = &self.gateway;
        if !ask.options.inspect || gateway.excluded_from_interception(&ask.target.host) {
            return Ok(None);
        }
        let Some(interception) = &gateway.interception else {
            return Err(
                "this gateway has no CA to intercept with (--gateway-ca-cert): ask \
                        without tls=inspect for a byte tunnel"
                    .to_owned(),
            );
        };
        if !ask.caller.tenant.interception {
            return Err(format!(
                "tenant {} may not ask for interception (interception: true in the tenants \
                 file allows it): ask without tls=inspect for a byte tunnel",
                ask.caller.tenant.name
            ));
        }
        Ok(Some(interception.clone()))
    }

    /// Runs `attempt` through an upstream chosen for `ask`; when one fails in a way that may
    /// be retried, reports it `error`, lets go of its lease and tries another, up to
    /// `--gateway-retries` more. The answer when none carried it: the refusal of the first
    /// choice, else `502` with what was tried. `what` names the request in the log; no proxy
    /// of `excluding` (by UID) is chosen.
    pub(super) async fn through_upstream<T, Fut>(
        &self,
        ask: &Ask,
        lease_for: LeaseFor,
        what: &(dyn std::fmt::Display + Sync),
        excluding: &HashSet<String>,
        mut attempt: impl FnMut(Held, Upstream) -> Fut,
    ) -> Result<Through<T>, (RequestOutcome, Response<Body>)>
    where
        Fut: std::future::Future<Output = Result<T, Failed>>,
    {
        let gateway = &self.gateway;
        let mut tried = excluding.clone();
        let mut attempts = Attempts::default();
        let mut hold: Option<hold::Hold> = None;
        loop {
            let chosen = match (gateway.budget_spent(ask), lease_for) {
                (Some(spent), _) => Err(Refusal::Quota(spent)),
                (None, LeaseFor::Request) => self.choose(ask, &tried).await,
                (None, LeaseFor::Tunnel) => self.gateway.tunnel_lease(ask, &tried).await,
            };
            let (held, upstream) = match chosen {
                Ok(chosen) => chosen,
                Err(refused) if attempts.is_empty() => {
                    if hold::wait_for_pool(gateway, ask, &refused, &mut hold).await {
                        continue;
                    }
                    if let Some(hold) = hold {
                        gateway.metrics.held(HOLD_TIMED_OUT, hold.waited());
                    }
                    match &refused {
                        Refusal::NoMatch(no_match) => {
                            let tenant = ask.caller.tenant_name();
                            gateway.metrics.tenants.no_match(tenant, no_match);
                        }
                        Refusal::Quota(refused) => gateway.metrics.tenants.quota_refused(refused),
                        Refusal::Ledger(_) | Refusal::Username(_) | Refusal::UnknownChain(_) => {}
                    }
                    return Err(refusal(&refused, gateway.fleet.clock.now()));
                }
                Err(_) => return Err(attempts.failed()),
            };
            if let Some(waited) = hold.take().map(|h| h.waited()) {
                gateway.metrics.held(HOLD_RELAYED, waited);
            }
            if !attempts.is_empty() {
                gateway.metrics.retried();
            }
            match attempt(held.clone(), upstream).await {
                Ok(value) => {
                    let moved_from = attempts.moved_from(&held);
                    return Ok(Through {
                        value,
                        held,
                        moved_from,
                    });
                }
                // The target refused the gateway's TLS: no fault of the proxy, and no other
                // exit would do better.
                Err(Failed {
                    failure: UpstreamFailure::Target(refused),
                    ..
                }) => {
                    log::info!("gateway: {what} through {}: {refused}", held.proxy);
                    gateway.metrics.handshake_failed("target", refused.reason());
                    self.drop_lease(&held).await;
                    return Err((RequestOutcome::UpstreamFailed, target_refusal(&refused)));
                }
                Err(Failed { failure, retriable }) => {
                    log::info!("gateway: {what} through {} failed: {failure}", held.proxy);
                    gateway.fleet.outcomes.record(
                        &held.tenant,
                        &held.proxy,
                        Some(&ask.target.host),
                        lease_for.failed(),
                    );
                    gateway
                        .report_failure(&held, &ask.target.host, ReportResult::Error)
                        .await;
                    self.drop_lease(&held).await;
                    tried.insert(held.proxy.uid.clone());
                    attempts.push(&held, &failure);
                    if !retriable || attempts.len() > gateway.config.retries as usize {
                        return Err(attempts.failed());
                    }
                }
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
                && let Some(upstream) = gateway.usable(&held.proxy, &held.lease_id, ask)
            {
                if now.saturating_duration_since(held.renewed) < held.ttl / 2 {
                    let held = held.clone();
                    leases.insert(ask.target.host.clone(), (held.clone(), now));
                    return Ok((held, upstream));
                }
                if gateway
                    .fleet
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
        let (held, upstream) = gateway.own_lease(ask, tried, moved_from).await?;
        leases.insert(ask.target.host.clone(), (held.clone(), now));
        Ok((held, upstream))
    }

    /// Lets go of a lease that failed upstream (a session moves on its next request).
    pub(super) async fn drop_lease(&self, held: &Held) {
        self.upstreams.lock().await.remove(&held.lease_id);
        if held.session.is_none() {
            self.leases
                .lock()
                .await
                .retain(|_, (h, _)| h.lease_id != held.lease_id);
        }
        self.gateway.let_go(held).await;
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

/// Why one upstream could not carry a request, and whether another may be tried (nothing
/// reached the crawler, and the request did not reach the target or may reach it again).
pub(super) struct Failed {
    pub(super) failure: UpstreamFailure,
    pub(super) retriable: bool,
}

/// What went through an upstream: the attempt's result, the lease it used, and the proxy a
/// session left for it.
pub(super) struct Through<T> {
    pub(super) value: T,
    pub(super) held: Held,
    pub(super) moved_from: Option<ProxyId>,
}

/// Which lease a request goes through (see [`ClientConnection::choose`] and
/// [`Gateway::tunnel_lease`]).
#[derive(Clone, Copy)]
pub(super) enum LeaseFor {
    Request,
    Tunnel,
}

impl LeaseFor {
    /// What an upstream that could not carry the request counts as.
    fn failed(self) -> Outcome {
        match self {
            LeaseFor::Request => Outcome::UpstreamFailed,
            LeaseFor::Tunnel => Outcome::TunnelFailed,
        }
    }
}

/// The upstreams one request tried and how each failed.
#[derive(Default)]
struct Attempts {
    tried: Vec<(ProxyId, String)>,
    /// The session proxy the request started on, when that one failed.
    session_left: Option<ProxyId>,
}

impl Attempts {
    fn push(&mut self, held: &Held, failure: &UpstreamFailure) {
        if held.session.is_some() && self.session_left.is_none() {
            // Where the session was before this request: the proxy it had just left for this
            // one, or this one.
            self.session_left = Some(held.moved_from.clone().unwrap_or(held.proxy.clone()));
        }
        self.tried.push((held.proxy.clone(), failure.to_string()));
    }

    fn is_empty(&self) -> bool {
        self.tried.is_empty()
    }

    fn len(&self) -> usize {
        self.tried.len()
    }

    /// The proxy a session left for `held`'s, if it moved.
    fn moved_from(&self, held: &Held) -> Option<ProxyId> {
        held.moved_from
            .clone()
            .or_else(|| self.session_left.clone())
    }

    /// 502 saying what was tried.
    fn failed(&self) -> (RequestOutcome, Response<Body>) {
        let tried: Vec<serde_json::Value> = self
            .tried
            .iter()
            .map(|(proxy, problem)| json!({"proxy": proxy.to_string(), "problem": problem}))
            .collect();
        let summary: Vec<String> = self
            .tried
            .iter()
            .map(|(proxy, problem)| format!("{proxy}: {problem}"))
            .collect();
        let body = json!({
            "error": "upstream_failed",
            "message": format!("every upstream proxy tried failed ({})", summary.join("; ")),
            "tried": tried,
        });
        (
            RequestOutcome::UpstreamFailed,
            json_response(StatusCode::BAD_GATEWAY, &body),
        )
    }
}
