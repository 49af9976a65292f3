//! `CONNECT host:port` with `tls=inspect`: the gateway opens its own TLS to the target through
//! an upstream's tunnel (verified: a target that does not verify is `502`, nothing relayed),
//! answers `200`, takes the crawler's TLS with a leaf for the host, and serves the crawler's
//! requests inside as it serves plain HTTP: each target answer judged by the rules, bans
//! reported for (exit, target), outcomes counted per page, the gateway's headers on every
//! answer, and an idempotent request moved to another exit when the rule says so (the ban is
//! passed on when no other exit answers). Each request checks that the tunnel's exit is still
//! usable for the target: a kept-alive tunnel leaves an exit that is cooling down, cordoned
//! or unhealthy for another, as a session would. HTTP/1.1 on both sides, kept alive; bodies
//! stream (only a rule's body prefix is held back).

use std::collections::HashSet;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::client::conn::http1::{self as client_http1, SendRequest};
use hyper::header::{HOST, HeaderValue};
use hyper::server::conn::http1 as server_http1;
use hyper::service::service_fn;
use hyper::upgrade::OnUpgrade;
use hyper::{Request, Response, Uri};
use hyper_util::rt::TokioIo;
use tokio::sync::Mutex;

use super::answer::{self, Retried, drop_hop_by_hop};
use super::forward::{idempotent, read_body, request};
use super::{ClientConnection, Failed, LeaseFor, Through};
use crate::gateway::answers::{Body, RequestOutcome, full, lease_headers};
use crate::gateway::ask::Ask;
use crate::gateway::choice::Held;
use crate::gateway::intercept::{Interception, Leaf};
use crate::gateway::rules::Action;
use crate::gateway::timeouts::{Activity, Finishing, Timed};
use crate::gateway::upstream::{self, Upstream, UpstreamFailure};
use crate::resources::proxy::ProxyId;
use crate::serving::sessions::InUse;

/// Opens the intercepted tunnel `request` asks for and answers it.
pub(super) async fn open(
    connection: &Arc<ClientConnection>,
    mut request: Request<Incoming>,
    ask: &Ask,
    interception: Arc<Interception>,
) -> (RequestOutcome, Response<Body>) {
    let gateway = &connection.gateway;
    let through = Origin::through(connection, &interception, ask, &HashSet::new()).await;
    let Through {
        value: origin,
        held,
        moved_from,
    } = match through {
        Ok(through) => through,
        Err(answer) => return answer,
    };
    let mut response = Response::new(full(""));
    lease_headers(&mut response, &held, moved_from);
    let client = hyper::upgrade::on(&mut request);
    let inside = Inside {
        connection: connection.clone(),
        interception,
        ask: ask.clone(),
        ttl: held.ttl,
        exit: Mutex::new(Exit {
            current: Some(Current::new(held, origin)),
            left: None,
        }),
    };
    gateway.tasks.spawn(inside.serve(client));
    (RequestOutcome::Intercepted, response)
}

/// The gateway's HTTP/1.1 connection to the target, over its own TLS through an upstream's
/// tunnel.
struct Origin {
    sender: SendRequest<Full<Bytes>>,
}

impl Origin {
    /// An origin for `ask` through an exit the connection's retry loop chooses, none of
    /// `excluding`, with the lease it holds.
    async fn through(
        connection: &ClientConnection,
        interception: &Interception,
        ask: &Ask,
        excluding: &HashSet<String>,
    ) -> Result<Through<Origin>, (RequestOutcome, Response<Body>)> {
        let timeout = connection.gateway.config.upstream_timeout;
        let what = format!("intercepted tunnel to {}", ask.target.authority());
        connection
            .through_upstream(ask, LeaseFor::Tunnel, &what, excluding, |_, upstream| {
                Origin::open(interception, upstream, ask, timeout)
            })
            .await
    }

    /// Opens a tunnel to `ask`'s target through `upstream` and the gateway's verified TLS in
    /// it, within `timeout` each.
    async fn open(
        interception: &Interception,
        upstream: Upstream,
        ask: &Ask,
        timeout: Duration,
    ) -> Result<Origin, Failed> {
        let failed = |failure, retriable| Failed { failure, retriable };
        let tunnel = upstream::tunnel(&upstream, &ask.target.authority(), timeout)
            .await
            .map_err(|f| failed(f, true))?;
        if !tunnel.early.is_empty() {
            // TLS has the client speak first: bytes before its hello are the proxy's confusion.
            let early = std::io::Error::other("the target spoke before the TLS handshake");
            return Err(failed(UpstreamFailure::Connect(early), true));
        }
        let tls = tokio::time::timeout(
            timeout,
            interception.connect_target(tunnel.stream, &ask.target.host),
        )
        .await
        .map_err(|_| failed(UpstreamFailure::Timeout, true))?
        // Every exit meets the same certificate: no other is tried.
        .map_err(|refused| failed(UpstreamFailure::Target(refused), false))?;
        let (sender, connection) = client_http1::handshake(TokioIo::new(tls))
            .await
            .map_err(|e| failed(UpstreamFailure::Http(e), true))?;
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                log::debug!("gateway: connection to an intercepted target ended: {e}");
            }
        });
        Ok(Origin { sender })
    }

    /// Sends `request`; its answer's head must come within `timeout`.
    async fn send(
        &mut self,
        request: Request<Full<Bytes>>,
        timeout: Duration,
    ) -> Result<Response<Incoming>, UpstreamFailure> {
        tokio::time::timeout(timeout, self.sender.send_request(request))
            .await
            .map_err(|_| UpstreamFailure::Timeout)?
            .map_err(UpstreamFailure::Http)
    }
}

/// The exit an intercepted tunnel's requests go through, with its connection to the target.
struct Current {
    held: Held,
    origin: Origin,
    /// The lease is in use while the tunnel holds it.
    _in_use: InUse,
}

impl Current {
    fn new(held: Held, origin: Origin) -> Self {
        let in_use = held.uses.begin();
        Current {
            held,
            origin,
            _in_use: in_use,
        }
    }
}

/// Where an intercepted tunnel's requests go: the exit it holds, if any (a request finds
/// another when that one is no longer usable for the target, or a rule's retry left it), and
/// the proxy it left, said on the next answer.
#[derive(Default)]
struct Exit {
    current: Option<Current>,
    left: Option<ProxyId>,
}

/// An intercepted tunnel: the crawler's requests, sent through the exit it holds.
struct Inside {
    /// The client connection the CONNECT came on: its retry loop chooses another exit.
    connection: Arc<ClientConnection>,
    interception: Arc<Interception>,
    ask: Ask,
    /// The lease time of the tunnel's leases, renewed at half of it.
    ttl: Duration,
    exit: Mutex<Exit>,
}

impl Inside {
    /// Takes the crawler's TLS on `client` and serves its requests until either side closes,
    /// renewing the lease meanwhile; then gives the tunnel's own lease back (a session's stays
    /// with the session).
    async fn serve(self, client: OnUpgrade) {
        let gateway = self.connection.gateway.clone();
        let accepted = async {
            let client = client
                .await
                .map_err(|e| format!("the crawler's connection: {e}"))?;
            self.interception
                .accept_client(TokioIo::new(client), &self.ask.target.host)
                .await
                .map_err(|refused| {
                    gateway.metrics.handshake_failed("client", refused.reason());
                    refused.to_string()
                })
        };
        let (tls, leaf) = match accepted.await {
            Ok(accepted) => accepted,
            Err(problem) => {
                log::debug!(
                    "gateway: intercepting a tunnel to {}: {problem}",
                    self.ask.target.authority()
                );
                if let Some(current) = self.exit.into_inner().current {
                    gateway.done_with(&current.held).await;
                }
                return;
            }
        };
        gateway.metrics.intercepted(match leaf {
            Leaf::Minted => "minted",
            Leaf::Cached => "cached",
        });
        let activity = Arc::new(Activity::default());
        let stream = Timed::new(tls, activity.clone(), gateway.config.timeouts);
        let inside = Arc::new(self);
        let service = {
            let inside = inside.clone();
            service_fn(move |request| {
                let (inside, activity) = (inside.clone(), activity.clone());
                async move { Ok::<_, Infallible>(inside.handle(request, &activity).await) }
            })
        };
        let served = server_http1::Builder::new()
            .keep_alive(true)
            .serve_connection(TokioIo::new(stream), service);
        tokio::pin!(served);
        let mut renewals = tokio::time::interval_at(
            tokio::time::Instant::now() + inside.ttl / 2,
            (inside.ttl / 2).max(Duration::from_secs(1)),
        );
        loop {
            tokio::select! {
                served = &mut served => {
                    if let Err(e) = served {
                        log::debug!("gateway: intercepted tunnel ended: {e}");
                    }
                    break;
                }
                _ = renewals.tick() => {
                    if let Some(held) = inside.held().await {
                        gateway.keep(&held).await;
                    }
                }
                () = gateway.stopping.cancelled() => break,
            }
        }
        if let Some(held) = inside.held().await {
            gateway.done_with(&held).await;
        }
    }

    /// The lease the tunnel holds now, if any.
    async fn held(&self) -> Option<Held> {
        let exit = self.exit.lock().await;
        exit.current.as_ref().map(|current| current.held.clone())
    }

    /// Answers one request of the crawler inside the tunnel.
    async fn handle(&self, request: Request<Incoming>, activity: &Arc<Activity>) -> Response<Body> {
        let under_way = activity.begin();
        let (outcome, response) = self.exchange(request).await;
        self.connection
            .gateway
            .metrics
            .request("inspected", outcome);
        response.map(|body| Finishing::new(body, under_way).boxed())
    }

    async fn exchange(&self, asked: Request<Incoming>) -> (RequestOutcome, Response<Body>) {
        let gateway = &self.connection.gateway;
        let (mut parts, body) = asked.into_parts();
        let body = match read_body(gateway, body).await {
            Ok(body) => body,
            Err(answer) => return answer,
        };
        drop_hop_by_hop(&mut parts.headers);
        // Inside the tunnel the target is known: a request names its path only.
        let path = parts
            .uri
            .path_and_query()
            .map_or("/", |p| p.as_str())
            .to_owned();
        parts.uri = path.parse::<Uri>().unwrap_or_default();
        if !parts.headers.contains_key(HOST)
            && let Ok(host) = HeaderValue::try_from(self.ask.target.authority())
        {
            parts.headers.insert(HOST, host);
        }
        let may_resend = idempotent(&parts.method);
        let timeout = gateway.config.upstream_timeout;
        let target = self.ask.target.host.as_str();
        let up = body.len() as u64;
        // Exits this request left (a ban the rule retries, a connection that could not be
        // opened again): none of them is chosen again for it.
        let mut excluded: HashSet<String> = HashSet::new();
        let mut retries = 0;
        let mut retried: Option<Retried> = None;
        let mut exit = self.exit.lock().await;
        loop {
            let current = match self.ensure_exit(&mut exit, &excluded).await {
                Ok(current) => current,
                // No other exit carried it: the target's own answer is the one to give.
                Err(answer) => return retried.map_or(answer, |r| r.hand_on(gateway, up)),
            };
            let response = match current.origin.send(request(&parts, &body), timeout).await {
                Ok(response) => response,
                // The exit's connection closed (the target ended its keep-alive): once more on
                // a new one through the same exit; an exit that cannot open one is left.
                Err(_) if current.origin.sender.is_closed() || may_resend => {
                    if !self.reopen(current).await {
                        excluded.insert(current.held.proxy.uid.clone());
                        self.leave(&mut exit).await;
                        continue;
                    }
                    match current.origin.send(request(&parts, &body), timeout).await {
                        Ok(response) => response,
                        Err(failure) => return failed_inside(&failure),
                    }
                }
                Err(failure) => return failed_inside(&failure),
            };
            let held = current.held.clone();
            let in_use = held.uses.begin();
            let judged = answer::judge(gateway, target, response, timeout).await;
            let reported = answer::record(gateway, &held, target, &judged).await;
            if judged.ban.is_some()
                && may_resend
                && let Action::Retry { times } = judged.action
                && retries < times
            {
                // Another exit, as the rule asks: this one is let go (a session moves), its
                // answer kept in case no other exit answers.
                retries += 1;
                excluded.insert(held.proxy.uid.clone());
                gateway.metrics.retried();
                let moved_from = exit.left.take();
                self.leave(&mut exit).await;
                retried = Some(Retried {
                    held,
                    judged,
                    reported,
                    moved_from,
                    keep: Box::new(in_use),
                });
                continue;
            }
            let moved_from = exit.left.take();
            let keep = Box::new(in_use);
            let response = answer::hand_on(gateway, &held, judged, reported, moved_from, up, keep);
            return (RequestOutcome::Forwarded, response);
        }
    }

    /// The exit the tunnel's next request goes through: the one it holds while that is usable
    /// for the target (not cordoned, healthy, not cooling down for it) and none of `excluded`;
    /// else that one is let go and another chosen through the connection's retry loop.
    async fn ensure_exit<'a>(
        &self,
        exit: &'a mut Exit,
        excluded: &HashSet<String>,
    ) -> Result<&'a mut Current, (RequestOutcome, Response<Body>)> {
        let gateway = &self.connection.gateway;
        let keep = exit.current.as_ref().is_some_and(|current| {
            !excluded.contains(&current.held.proxy.uid)
                && gateway
                    .usable(&current.held.proxy, &current.held.lease_id, &self.ask)
                    .is_some()
        });
        if !keep {
            self.leave(exit).await;
        }
        match exit.current {
            Some(ref mut current) => Ok(current),
            None => {
                let Through {
                    value: origin,
                    held,
                    moved_from,
                } = Origin::through(&self.connection, &self.interception, &self.ask, excluded)
                    .await?;
                if exit.left.is_none() {
                    exit.left = moved_from;
                }
                Ok(exit.current.insert(Current::new(held, origin)))
            }
        }
    }

    /// A new connection to the target through `current`'s exit, when that is still usable.
    async fn reopen(&self, current: &mut Current) -> bool {
        let gateway = &self.connection.gateway;
        let Some(upstream) = gateway.usable(&current.held.proxy, &current.held.lease_id, &self.ask)
        else {
            return false;
        };
        let timeout = gateway.config.upstream_timeout;
        match Origin::open(&self.interception, upstream, &self.ask, timeout).await {
            Ok(origin) => {
                current.origin = origin;
                true
            }
            Err(failed) => {
                log::debug!(
                    "gateway: reopening an intercepted tunnel through {}: {}",
                    current.held.proxy,
                    failed.failure
                );
                false
            }
        }
    }

    /// Lets go of the exit the tunnel holds (its lease goes back; a session moves), to be
    /// said on the next answer.
    async fn leave(&self, exit: &mut Exit) {
        if let Some(current) = exit.current.take() {
            self.connection.gateway.let_go(&current.held).await;
            exit.left.get_or_insert(current.held.proxy);
        }
    }
}

/// The answer inside the tunnel when the target's connection failed mid-request.
fn failed_inside(failure: &UpstreamFailure) -> (RequestOutcome, Response<Body>) {
    let message = format!("the intercepted target's connection failed: {failure}");
    (
        RequestOutcome::UpstreamFailed,
        crate::gateway::answers::error(hyper::StatusCode::BAD_GATEWAY, "upstream_failed", &message),
    )
}
