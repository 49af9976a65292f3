//! The crawler gateway (`--gateway-addr`, default `:8888`): one forward-proxy address any HTTP
//! client can use (curl, requests, Scrapy, Playwright), which leases an upstream proxy for the
//! crawler. It serves HTTP/1.1 `CONNECT host:port` tunnels and absolute-form requests
//! (`GET http://…`), keeps client connections alive, and reads the same inventory, health
//! snapshot and ledger as the lease API (parsing is hyper's; tunnels are byte copies).
//!
//! - **Who**: `Proxy-Authorization: Basic` whose password is an API token; the user part holds
//!   the options (`user`): a crawler name, `session`, `sessionTTL` and selector labels.
//! - **Which upstream** (`choice`): a lease through the ledger, with the API's selection rules,
//!   for the target (the CONNECT host or the request's host): one per client connection and
//!   target, released when the connection closes; or one per (token, session), kept while its
//!   proxy stays usable for the target and moved (said in `X-Proxy-Session-Moved`) when not.
//! - **Failures** (`tunnel`, `forward`): an upstream that refuses, times out or answers the
//!   CONNECT with a non-2xx is reported `error` and another proxy is tried (`--gateway-retries`);
//!   then `502` saying what was tried. No usable proxy: `503` with `Retry-After`.
//! - **Bans** (`bans`): on plain HTTP, a target status in the ban rule is reported for that
//!   (proxy, target), cooling it down for as long as the target's `Retry-After` asks.
//! - **Waking pools** (`hold`): a request refused because the ProxyPool it would be served by
//!   has no Ready member is held, connection open, until one is (at most the pool's
//!   `wakeTimeout`), then relayed; its refusal is recorded as the pool's demand.
//! - **Drains** (`upstream`): a draining or deleted proxy's idle upstream connections are
//!   closed at once, so a drain does not wait for keep-alive.

mod auth;
mod bans;
mod choice;
mod drain;
mod forward;
mod hold;
mod limits;
mod metrics;
mod timeouts;
mod tunnel;
mod upstream;
pub mod user;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::header::{HeaderValue, PROXY_AUTHENTICATE, PROXY_AUTHORIZATION, RETRY_AFTER};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::json;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use bans::BanRule;
pub use metrics::GatewayMetrics;
use metrics::{HOLD_RELAYED, HOLD_TIMED_OUT};
pub use timeouts::Timeouts;

use crate::credentials::CredentialStore;
use crate::egress::{Destinations, IpNet, Refused};
use crate::health::HealthSnapshot;
use crate::inventory::Inventory;
use crate::ledger::{Clock, LeaseReport, Ledger, LedgerError, NoMatch, ReportResult};
use crate::resources::proxy::ProxyId;
use crate::serving::candidates::CandidateIndex;
use crate::serving::outcomes::{Outcome, Outcomes};
use crate::serving::pools::PoolDirectory;
use crate::serving::retry_after;
use crate::serving::sessions::Sessions;
use crate::serving::tenants::QuotaExceededBody;
use crate::serving::tokens::ApiToken;
use choice::{Ask, ClientConnection, Held, Refusal, Target, TargetError};
use limits::Limits;
use timeouts::{Activity, Timed};
use upstream::{Upstream, UpstreamFailure};

/// Header naming the upstream proxy a request went through (`namespace/name`).
pub const PROXY_NAME_HEADER: &str = "x-proxy-name";
/// Header carrying the lease a request went through (for reports through the lease API).
pub const PROXY_LEASE_HEADER: &str = "x-proxy-lease";
/// Header naming the proxy a session left, on the first answer through its new one.
pub const SESSION_MOVED_HEADER: &str = "x-proxy-session-moved";
/// Header on a target's answer the gateway reported as a ban (`blocked`, `rate_limited`), so
/// a crawler does not report it again.
pub const BAN_REPORTED_HEADER: &str = "x-proxy-ban-reported";
/// RFC 9209's header on every answer the gateway makes itself (a refusal, an error), never on
/// a target's: `proxy-operator; details="<code>"`. A refusal for a tenant's quota is a `503`
/// with `Retry-After` and `proxy-operator; error=http_request_denied;
/// details="quota_exceeded"`: neither the status nor the header is a ban a target could send.
pub const PROXY_STATUS: &str = "proxy-status";
/// The gateway's name in `Proxy-Status`.
const PROXY_STATUS_NAME: &str = "proxy-operator";
/// The error code of a refusal for a tenant's quota.
const QUOTA_EXCEEDED: &str = "quota_exceeded";
/// The error code of a refusal for a destination the policy denies (see [`crate::egress`]).
pub const DESTINATION_NOT_ALLOWED: &str = "destination_not_allowed";
/// The error code of a refusal for a target name that does not resolve.
pub const DESTINATION_UNRESOLVABLE: &str = "destination_unresolvable";
/// The error code of a refusal for a connection over a cap.
pub const TOO_MANY_CONNECTIONS: &str = "too_many_connections";

/// The body of every gateway answer.
pub type Body = BoxBody<Bytes, hyper::Error>;

/// How the gateway behaves.
#[derive(Debug, Clone)]
pub struct GatewayConfig {
    /// Ports a crawler may reach through the gateway (`CONNECT` and plain HTTP alike), so a
    /// token holder cannot relay to anything else.
    pub allowed_ports: Vec<u16>,
    /// Other proxies tried after an upstream failed before anything reached the crawler.
    pub retries: u32,
    /// Longest wait for an upstream proxy: connecting, its answer to a CONNECT, and the
    /// response head of a plain request.
    pub upstream_timeout: Duration,
    /// Target statuses reported as bans.
    pub ban_rule: BanRule,
    /// Idle lifetime of a session whose user part names no `sessionTTL`.
    pub session_ttl: Duration,
    /// TTL of the lease a connection holds without a session, renewed while it is used.
    pub connection_lease_ttl: Duration,
    /// Largest plain-HTTP request body, buffered so the request can be tried on another
    /// proxy.
    pub max_request_body: usize,
    /// Non-public destination ranges opened to crawlers (every other one is refused).
    pub allowed_destinations: Vec<IpNet>,
    /// Whether a target name the gateway cannot resolve goes on to the upstream to resolve.
    pub pass_unresolved: bool,
    /// How long a request head and an idle kept-alive connection may take.
    pub timeouts: Timeouts,
    /// Most client connections open at once.
    pub max_connections: usize,
    /// Most client connections open at once for one tenant of the tenants file.
    pub max_tenant_connections: usize,
    /// Most leases one client connection without a session holds (one per target); the
    /// least recently used one goes back first.
    pub max_connection_leases: usize,
    /// Most requests held at once while their pools wake.
    pub max_held: usize,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        GatewayConfig {
            allowed_ports: vec![80, 443],
            retries: 2,
            upstream_timeout: Duration::from_secs(10),
            ban_rule: BanRule::default(),
            session_ttl: Duration::from_secs(300),
            connection_lease_ttl: Duration::from_secs(300),
            max_request_body: 16 << 20,
            allowed_destinations: Vec::new(),
            pass_unresolved: false,
            timeouts: Timeouts {
                header: Duration::from_secs(10),
                idle: Duration::from_secs(60),
            },
            max_connections: 8192,
            max_tenant_connections: 2048,
            max_connection_leases: 4,
            max_held: 1024,
        }
    }
}

/// What the gateway reads and writes, shared by every connection.
pub struct Gateway {
    /// Proxies known to the process.
    pub inventory: Inventory,
    /// Their health.
    pub health: HealthSnapshot,
    /// The lease ledger.
    pub ledger: Arc<dyn Ledger>,
    /// Selector matches and health positions, kept per inventory snapshot.
    pub candidates: CandidateIndex,
    /// Upstream credentials.
    pub credentials: CredentialStore,
    /// The tokens that grant access.
    pub tokens: ApiToken,
    /// Sticky sessions.
    pub sessions: Sessions,
    /// Counters.
    pub metrics: GatewayMetrics,
    /// How requests through each proxy ended (shared with the API's reports).
    pub outcomes: Outcomes,
    /// The ledger's clock (for `Retry-After` dates).
    pub clock: Arc<dyn Clock>,
    /// Settings.
    pub config: GatewayConfig,
    /// The pools a refused request may wait for, and where refusals become their demand.
    pub pools: PoolDirectory,
    /// What crawlers may reach.
    destinations: Destinations,
    /// The caps on connections and held requests.
    limits: Arc<Limits>,
    /// Upstream connections, for closing a draining proxy's idle ones.
    upstreams: drain::Upstreams,
    /// Client connections and tunnels, awaited at shutdown.
    tasks: TaskTracker,
    /// Fired at shutdown: connections and tunnels end and give their leases back.
    stopping: CancellationToken,
}

impl Gateway {
    /// A gateway over the process's parts.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        inventory: Inventory,
        health: HealthSnapshot,
        ledger: Arc<dyn Ledger>,
        credentials: CredentialStore,
        tokens: ApiToken,
        sessions: Sessions,
        metrics: GatewayMetrics,
        outcomes: Outcomes,
        clock: Arc<dyn Clock>,
        config: GatewayConfig,
    ) -> Self {
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
            inventory,
            health,
            ledger,
            candidates: CandidateIndex::default(),
            credentials,
            tokens,
            sessions,
            metrics,
            outcomes,
            clock,
            config,
            pools: PoolDirectory::default(),
            upstreams: drain::Upstreams::default(),
            tasks: TaskTracker::new(),
            stopping: CancellationToken::new(),
        }
    }

    /// The gateway holding requests for the waking pools of `pools`.
    pub fn holding_for(self, pools: PoolDirectory) -> Self {
        Gateway { pools, ..self }
    }
}

/// How a gateway request ended (the `outcome` label of its counter).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestOutcome {
    /// A tunnel was opened.
    Tunneled,
    /// A plain request was answered by its target.
    Forwarded,
    /// 407: no valid token.
    AuthRequired,
    /// 400: a malformed request or user part.
    BadRequest,
    /// 403: a port the gateway does not relay to.
    PortRefused,
    /// 503: no proxy can take a lease.
    NoProxy,
    /// 503: the ledger could not take the lease (overloaded, full).
    Unavailable,
    /// 502: every upstream tried failed.
    UpstreamFailed,
    /// 503 with `Proxy-Status` `quota_exceeded`: the caller's tenant is at a quota.
    QuotaExceeded,
    /// 403 `destination_not_allowed` or 502 `destination_unresolvable`: the destination
    /// policy refused the target.
    DestinationRefused,
    /// 503 `too_many_connections`: the caller's tenant holds as many connections as it may.
    TooManyConnections,
}

impl RequestOutcome {
    /// Every outcome.
    pub const ALL: [RequestOutcome; 11] = [
        RequestOutcome::Tunneled,
        RequestOutcome::Forwarded,
        RequestOutcome::AuthRequired,
        RequestOutcome::BadRequest,
        RequestOutcome::PortRefused,
        RequestOutcome::NoProxy,
        RequestOutcome::Unavailable,
        RequestOutcome::UpstreamFailed,
        RequestOutcome::QuotaExceeded,
        RequestOutcome::DestinationRefused,
        RequestOutcome::TooManyConnections,
    ];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            RequestOutcome::Tunneled => "tunneled",
            RequestOutcome::Forwarded => "forwarded",
            RequestOutcome::AuthRequired => "auth_required",
            RequestOutcome::BadRequest => "bad_request",
            RequestOutcome::PortRefused => "port_refused",
            RequestOutcome::NoProxy => "no_proxy",
            RequestOutcome::Unavailable => "unavailable",
            RequestOutcome::UpstreamFailed => "upstream_failed",
            RequestOutcome::QuotaExceeded => "quota_exceeded",
            RequestOutcome::DestinationRefused => "destination_refused",
            RequestOutcome::TooManyConnections => "too_many_connections",
        }
    }
}

/// How long connections and tunnels get to give their leases back at shutdown.
const STOP_GRACE: Duration = Duration::from_secs(5);

/// Serves the gateway on `listener` until `shutdown` fires; then stops accepting, ends the
/// connections and tunnels under way and gives their leases back (a session's stays, so the
/// session finds it again after a restart).
pub async fn serve(listener: TcpListener, gateway: Arc<Gateway>, shutdown: CancellationToken) {
    let housekeeping = tokio::spawn(choice::release_idle_sessions(
        gateway.clone(),
        shutdown.clone(),
    ));
    let drains = tokio::spawn(drain::close_on_drain(gateway.clone(), shutdown.clone()));
    loop {
        let accepted = tokio::select! {
            () = shutdown.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, peer)) => {
                let _ = stream.set_nodelay(true);
                gateway.metrics.connection();
                match gateway.limits.connection() {
                    Some(slot) => {
                        gateway
                            .tasks
                            .spawn(serve_connection(stream, peer, gateway.clone(), slot));
                    }
                    None => {
                        gateway.metrics.connection_refused(limits::PROCESS_LIMIT);
                        gateway
                            .tasks
                            .spawn(refuse_connection(stream, gateway.limits.max_connections()));
                    }
                }
            }
            Err(e) => {
                log::warn!("gateway: accepting a connection failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    housekeeping.abort();
    drains.abort();
    gateway.stopping.cancel();
    gateway.tasks.close();
    if tokio::time::timeout(STOP_GRACE, gateway.tasks.wait())
        .await
        .is_err()
    {
        log::warn!("gateway: connections did not end within {STOP_GRACE:?}; their leases expire");
    }
}

/// How long a connection over the cap gets to read its refusal.
const REFUSAL_WRITE_TIMEOUT: Duration = Duration::from_secs(1);

/// Answers a connection over the process's cap with `503 too_many_connections` and closes it,
/// without reading its request.
async fn refuse_connection(mut stream: tokio::net::TcpStream, cap: usize) {
    use tokio::io::AsyncWriteExt;
    let body = json!({
        "error": TOO_MANY_CONNECTIONS,
        "message": format!(
            "the gateway holds {cap} client connections, as many as it may \
             (--gateway-max-connections); retry later"
        ),
    })
    .to_string();
    let answer = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         {PROXY_STATUS}: {}\r\nretry-after: 1\r\nconnection: close\r\n\
         content-length: {}\r\n\r\n{body}",
        proxy_status(TOO_MANY_CONNECTIONS),
        body.len()
    );
    let _ = tokio::time::timeout(REFUSAL_WRITE_TIMEOUT, async {
        stream.write_all(answer.as_bytes()).await?;
        stream.shutdown().await
    })
    .await;
}

/// Serves one client connection, then gives back the leases it held.
async fn serve_connection(
    stream: tokio::net::TcpStream,
    peer: SocketAddr,
    gateway: Arc<Gateway>,
    _slot: limits::Slot,
) {
    let _open = gateway.metrics.open_connection();
    let activity = Arc::new(Activity::default());
    let stream = Timed::new(stream, activity.clone(), gateway.config.timeouts);
    let connection = Arc::new(ClientConnection::new(gateway.clone(), activity.clone()));
    let registered = gateway.upstreams.add(&connection);
    let service = {
        let connection = connection.clone();
        service_fn(move |request| {
            let connection = connection.clone();
            async move { Ok::<_, Infallible>(connection.handle(request).await) }
        })
    };
    let served = http1::Builder::new()
        .keep_alive(true)
        .serve_connection(TokioIo::new(stream), service)
        .with_upgrades();
    tokio::select! {
        () = gateway.stopping.cancelled() => {}
        served = served => if let Err(e) = served {
            log::debug!("gateway: connection from {peer} ended: {e}");
        },
    }
    if let Some(expired) = activity.expired() {
        gateway.metrics.connection_closed(expired);
    }
    gateway.upstreams.remove(registered);
    connection.close().await;
}

impl ClientConnection {
    /// Answers one request.
    async fn handle(&self, request: Request<Incoming>) -> Response<Body> {
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

    async fn route(&self, request: Request<Incoming>) -> (RequestOutcome, Response<Body>) {
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
        let ask = choice::Ask {
            caller: caller.caller,
            options,
            target,
        };
        if request.method() == Method::CONNECT {
            tunnel::open(self, request, &ask).await
        } else {
            forward::send(self, request, &ask).await
        }
    }
}

impl Gateway {
    /// Reports what went wrong upstream on `held` for `target` (logged when the ledger cannot
    /// take it).
    async fn report_failure(&self, held: &Held, target: &str, result: ReportResult) {
        let report = LeaseReport {
            result,
            target: Some(target.to_owned()),
            cooldown: None,
        };
        if let Err(e) = self
            .ledger
            .report(&held.lease_id, &held.tenant, report)
            .await
        {
            log::warn!("gateway: reporting lease {} failed: {e}", held.lease_id);
        }
    }

    /// Keeps a lease in use alive: a session's is touched and renewed when due; a tunnel's
    /// own is renewed.
    async fn keep(&self, held: &Held) {
        let now = std::time::Instant::now();
        match &held.session {
            Some(key) => {
                let Some(session) = self.sessions.get(key) else {
                    return;
                };
                if session.lease_id != held.lease_id {
                    return;
                }
                let renewed = session.renewal_due(now)
                    && self
                        .ledger
                        .renew(&held.lease_id, &held.tenant, held.ttl)
                        .await
                        .is_ok();
                self.sessions.touch(key, &held.lease_id, now, renewed);
            }
            None => {
                if let Err(e) = self
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
    async fn done_with(&self, held: &Held) {
        match &held.session {
            Some(key) => {
                self.sessions
                    .touch(key, &held.lease_id, std::time::Instant::now(), false);
            }
            None => self.give_back(&held.lease_id, &held.tenant).await,
        }
    }
}

/// Why one upstream could not carry a request, and whether another may be tried (nothing
/// reached the crawler, and the request did not reach the target or may reach it again).
struct Failed {
    failure: UpstreamFailure,
    retriable: bool,
}

/// What went through an upstream: the attempt's result, the lease it used, and the proxy a
/// session left for it.
struct Through<T> {
    value: T,
    held: Held,
    moved_from: Option<ProxyId>,
}

/// Which lease a request goes through (see [`ClientConnection::choose`] and
/// [`ClientConnection::choose_for_tunnel`]).
#[derive(Clone, Copy)]
enum LeaseFor {
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

impl ClientConnection {
    /// Runs `attempt` through an upstream chosen for `ask`; when one fails in a way that may
    /// be retried, reports it `error`, lets go of its lease and tries another, up to
    /// `--gateway-retries` more. The answer when none carried it: the refusal of the first
    /// choice, else `502` with what was tried. `what` names the request in the log.
    async fn through_upstream<T, Fut>(
        &self,
        ask: &Ask,
        lease_for: LeaseFor,
        what: &str,
        mut attempt: impl FnMut(Held, Upstream) -> Fut,
    ) -> Result<Through<T>, (RequestOutcome, Response<Body>)>
    where
        Fut: std::future::Future<Output = Result<T, Failed>>,
    {
        let gateway = &self.gateway;
        let mut tried = std::collections::HashSet::new();
        let mut attempts = Attempts::default();
        let mut hold: Option<hold::Hold> = None;
        loop {
            let chosen = match lease_for {
                LeaseFor::Request => self.choose(ask, &tried).await,
                LeaseFor::Tunnel => self.choose_for_tunnel(ask, &tried).await,
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
                        Refusal::Ledger(_) => {}
                    }
                    return Err(refusal(&refused, gateway.clock.now()));
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
                Err(Failed { failure, retriable }) => {
                    log::info!("gateway: {what} through {} failed: {failure}", held.proxy);
                    gateway.outcomes.record(
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

/// Names the proxy and the lease an answer went through, and the proxy a session left.
fn lease_headers<B>(response: &mut Response<B>, held: &Held, moved_from: Option<ProxyId>) {
    let headers = response.headers_mut();
    for (name, value) in [
        (PROXY_NAME_HEADER, Some(held.proxy.to_string())),
        (PROXY_LEASE_HEADER, Some(held.lease_id.clone())),
        (SESSION_MOVED_HEADER, moved_from.map(|p| p.to_string())),
    ] {
        if let Some(value) = value.and_then(|v| HeaderValue::try_from(v).ok()) {
            headers.insert(name, value);
        }
    }
}

/// 407 with the challenge clients answer with the token.
fn proxy_auth_required() -> Response<Body> {
    let mut response = error(
        StatusCode::PROXY_AUTHENTICATION_REQUIRED,
        "proxy_auth_required",
        "send Proxy-Authorization: Basic with an API token as the password (e.g. \
         http://crawler:TOKEN@gateway:8888)",
    );
    response.headers_mut().insert(
        PROXY_AUTHENTICATE,
        HeaderValue::from_static("Basic realm=\"proxy-operator\""),
    );
    response
}

/// A JSON error answer `{"error": code, "message": message}`.
fn error(status: StatusCode, code: &str, message: &str) -> Response<Body> {
    json_response(status, &json!({"error": code, "message": message}))
}

/// An answer the gateway makes itself, never a target's: a JSON body whose `error` is its
/// code, and a `Proxy-Status` header (RFC 9209) naming the gateway and that code, so a
/// crawler tells it from anything a target answered (see `PROXY_STATUS`).
fn json_response(status: StatusCode, body: &serde_json::Value) -> Response<Body> {
    let mut response = Response::new(full(body.to_string()));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(
        hyper::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    if let Some(value) = body["error"]
        .as_str()
        .and_then(|code| HeaderValue::try_from(proxy_status(code)).ok())
    {
        headers.insert(PROXY_STATUS, value);
    }
    response
}

/// The `Proxy-Status` of an answer the gateway made with error `code`: a refusal for a quota
/// is RFC 9209's `http_request_denied`, the rest say only the code.
fn proxy_status(code: &str) -> String {
    let error = match code {
        QUOTA_EXCEEDED | TOO_MANY_CONNECTIONS => Some("http_request_denied"),
        DESTINATION_NOT_ALLOWED => Some("destination_ip_prohibited"),
        DESTINATION_UNRESOLVABLE => Some("dns_error"),
        _ => None,
    };
    match error {
        Some(error) => format!("{PROXY_STATUS_NAME}; error={error}; details=\"{code}\""),
        None => format!("{PROXY_STATUS_NAME}; details=\"{code}\""),
    }
}

/// The answer to a target the destination policy refuses: `403 destination_not_allowed`
/// naming the address and its range, or `502 destination_unresolvable` for a name that does
/// not resolve.
fn destination_refusal(refused: &Refused) -> Response<Body> {
    match refused {
        Refused::Denied { address, .. } => json_response(
            StatusCode::FORBIDDEN,
            &json!({
                "error": DESTINATION_NOT_ALLOWED,
                "reason": refused.reason(),
                "address": address.to_string(),
                "message": refused.message(),
            }),
        ),
        Refused::Unresolvable { .. } => json_response(
            StatusCode::BAD_GATEWAY,
            &json!({
                "error": DESTINATION_UNRESOLVABLE,
                "reason": refused.reason(),
                "message": refused.message(),
            }),
        ),
    }
}

/// `503 too_many_connections` for a tenant at its cap of connections; the connection closes
/// after it.
fn too_many_connections(tenant: &str, cap: usize) -> Response<Body> {
    let mut response = error(
        StatusCode::SERVICE_UNAVAILABLE,
        TOO_MANY_CONNECTIONS,
        &format!(
            "tenant {tenant} holds {cap} connections to the gateway, as many as it may \
             (--gateway-max-tenant-connections); close one or retry later"
        ),
    );
    let headers = response.headers_mut();
    headers.insert(hyper::header::CONNECTION, HeaderValue::from_static("close"));
    headers.insert(RETRY_AFTER, HeaderValue::from_static("1"));
    response
}

/// A body from bytes.
fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed()
}

/// The answer to a refused lease: 503 with `Retry-After`; for no match, the same counts as the
/// lease API's 409.
fn refusal(refusal: &Refusal, now: jiff::Timestamp) -> (RequestOutcome, Response<Body>) {
    match refusal {
        Refusal::NoMatch(no_match) => (RequestOutcome::NoProxy, no_match_response(no_match, now)),
        Refusal::Quota(refused) => {
            let body = serde_json::to_value(QuotaExceededBody::of(refused)).unwrap_or_default();
            let mut response = json_response(StatusCode::SERVICE_UNAVAILABLE, &body);
            set_retry_after(&mut response, refused.retry_after);
            (RequestOutcome::QuotaExceeded, response)
        }
        Refusal::Ledger(LedgerError::Overloaded { retry_after })
        | Refusal::Ledger(LedgerError::Full { retry_after })
        | Refusal::Ledger(LedgerError::Unavailable { retry_after, .. }) => {
            let mut response = error(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable",
                "the lease ledger could not take the lease; retry later",
            );
            set_retry_after(&mut response, *retry_after);
            (RequestOutcome::Unavailable, response)
        }
        Refusal::Ledger(e) => {
            log::error!("gateway: acquiring a lease failed: {e}");
            let mut response = error(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable",
                "the lease ledger failed; retry later",
            );
            set_retry_after(&mut response, Duration::from_secs(1));
            (RequestOutcome::Unavailable, response)
        }
    }
}

fn no_match_response(no_match: &NoMatch, now: jiff::Timestamp) -> Response<Body> {
    let mut response = json_response(
        StatusCode::SERVICE_UNAVAILABLE,
        &json!({
            "error": "no_match",
            "reason": no_match.reason().as_str(),
            "message": no_match.message(),
            "considered": no_match.considered,
            "cordoned": no_match.cordoned,
            "draining": no_match.draining,
            "unhealthy": no_match.unhealthy,
            "atCapacity": no_match.at_capacity,
            "atTargetLimit": no_match.at_target_limit,
            "inCooldown": no_match.in_cooldown,
        }),
    );
    let wait = no_match
        .retry_after
        .map_or(Duration::ZERO, |at| retry_after::until(at, now));
    set_retry_after(&mut response, wait);
    response
}

fn set_retry_after(response: &mut Response<Body>, wait: Duration) {
    response
        .headers_mut()
        .insert(RETRY_AFTER, HeaderValue::from(retry_after::seconds(wait)));
}
