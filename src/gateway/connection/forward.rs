//! Plain HTTP (`GET http://host/path`): the request goes to an upstream proxy as it came
//! (absolute-form, hop-by-hop headers dropped) over a kept-alive connection, and the target's
//! answer comes back with the lease headers. The body is buffered (up to
//! `max_request_body`) so the request can be tried on another proxy: always while nothing
//! reached the upstream, and once it did only for idempotent methods. An answer a rule calls a
//! ban is reported for the (proxy, target) and passed on to the crawler, or, when the rule
//! retries, the request goes through another exit and the ban is passed on only if none
//! answers.

use std::collections::HashSet;
use std::fmt;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use hyper::body::Incoming;
use hyper::header::{HOST, HeaderValue, PROXY_AUTHORIZATION};
use hyper::http::request::Parts;
use hyper::{Method, Request, Response, StatusCode, Version};

use super::answer::{self, Retried, drop_hop_by_hop};
use super::{ClientConnection, Failed, LeaseFor, Through};
use crate::gateway::answers::{Body, RequestOutcome, error};
use crate::gateway::ask::Ask;
use crate::gateway::choice::{Gateway, Held};
use crate::gateway::rules::Action;
use crate::gateway::upstream::{Busy, HttpUpstream, Upstream, UpstreamFailure};
use crate::resources::proxy::ProxyId;

/// Forwards `request` and answers with the target's response.
pub(super) async fn send(
    connection: &ClientConnection,
    request: Request<Incoming>,
    ask: &Ask,
) -> (RequestOutcome, Response<Body>) {
    let gateway = &connection.gateway;
    let (mut parts, body) = request.into_parts();
    let body = match read_body(gateway, body).await {
        Ok(body) => body,
        Err(answer) => return answer,
    };
    drop_hop_by_hop(&mut parts.headers);
    parts.headers.remove(PROXY_AUTHORIZATION);
    if !parts.headers.contains_key(HOST)
        && let Ok(host) = HeaderValue::try_from(ask.target.authority())
    {
        parts.headers.insert(HOST, host);
    }
    let may_resend = idempotent(&parts.method);
    let what = RequestLine(&parts);
    let authority = ask.target.authority();
    let up = body.len() as u64;
    let target = ask.target.host.as_str();
    // Exits a rule's retry left, and the first of them (the session moved from it).
    let mut banned: HashSet<String> = HashSet::new();
    let mut left_for_retry: Option<ProxyId> = None;
    let mut retried: Option<Retried> = None;
    loop {
        let through = connection
            .through_upstream(ask, LeaseFor::Request, &what, &banned, |held, upstream| {
                let (parts, body, authority) = (&parts, &body, authority.as_str());
                async move {
                    exchange(
                        connection, &held, &upstream, parts, body, authority, may_resend,
                    )
                    .await
                }
            })
            .await;
        let Through {
            value: (response, busy),
            held,
            moved_from,
        } = match through {
            Ok(through) => through,
            // No other exit carried it: the target's own answer is the one to give.
            Err(answer) => return retried.map_or(answer, |r| r.hand_on(gateway, up)),
        };
        let in_use = held.uses.begin();
        let timeout = gateway.config.upstream_timeout;
        let judged = answer::judge(gateway, target, response, timeout).await;
        let reported = answer::record(gateway, &held, target, &judged).await;
        if judged.ban.is_some()
            && may_resend
            && let Action::Retry { times } = judged.action
            && banned.len() < times as usize
        {
            // Another exit, as the rule asks: this one is given back (a session moves), its
            // answer kept in case no other exit answers.
            banned.insert(held.proxy.uid.clone());
            let said = moved_from.or_else(|| left_for_retry.clone());
            left_for_retry.get_or_insert(held.proxy.clone());
            connection.drop_lease(&held).await;
            gateway.metrics.retried();
            retried = Some(Retried {
                held,
                judged,
                reported,
                moved_from: said,
                keep: Box::new((busy, in_use)),
            });
            continue;
        }
        let moved_from = moved_from.or(left_for_retry);
        let keep = Box::new((busy, in_use));
        let response = answer::hand_on(gateway, &held, judged, reported, moved_from, up, keep);
        return (RequestOutcome::Forwarded, response);
    }
}

/// A request as the log names it (`GET http://...`), spelled only when a line is written.
struct RequestLine<'a>(&'a Parts);

impl fmt::Display for RequestLine<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.0.method, self.0.uri)
    }
}

/// A request's body, buffered (at most `--gateway-max-request-body`, else `413`) so that it
/// can be sent again on another exit.
pub(super) async fn read_body(
    gateway: &Gateway,
    body: Incoming,
) -> Result<Bytes, (RequestOutcome, Response<Body>)> {
    match Limited::new(body, gateway.config.max_request_body)
        .collect()
        .await
    {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => {
            let message = format!(
                "request bodies through the gateway are buffered up to {} bytes",
                gateway.config.max_request_body
            );
            let response = error(StatusCode::PAYLOAD_TOO_LARGE, "body_too_large", &message);
            Err((RequestOutcome::BadRequest, response))
        }
        Err(e) => {
            let message = format!("reading the request body failed: {e}");
            Err((
                RequestOutcome::BadRequest,
                error(StatusCode::BAD_REQUEST, "bad_request", &message),
            ))
        }
    }
}

/// Sends the request through the connection's upstream connection for the lease (a new one
/// when it has none, it closed, or it leads through a SOCKS5 proxy to another target than
/// `authority`). A kept-alive connection the proxy closed meanwhile is no
/// failure of the proxy: the request goes again once on a new connection when it was not sent
/// or may be sent again. A failure may be retried on another proxy when the request did not
/// reach the upstream, or `may_resend`.
async fn exchange(
    connection: &ClientConnection,
    held: &Held,
    upstream: &Upstream,
    parts: &Parts,
    body: &Bytes,
    authority: &str,
    may_resend: bool,
) -> Result<(Response<Incoming>, Busy), Failed> {
    let timeout = connection.gateway.config.upstream_timeout;
    let kept = connection
        .upstreams
        .lock()
        .await
        .remove(&held.lease_id)
        .filter(|http| http.ready() && http.leads_to(authority));
    let reused = kept.is_some();
    let mut http = match kept {
        Some(http) => http,
        None => open(held, upstream, authority, timeout).await?,
    };
    let mut result = http.send(request(parts, body), timeout).await;
    if reused
        && let Err(UpstreamFailure::Http(e)) = &result
        && (e.is_canceled() || (may_resend && e.is_incomplete_message()))
    {
        http = open(held, upstream, authority, timeout).await?;
        result = http.send(request(parts, body), timeout).await;
    }
    match result {
        Ok((response, busy))
            if http.via_proxy()
                && response.status() == StatusCode::PROXY_AUTHENTICATION_REQUIRED =>
        {
            drop(busy);
            Err(Failed {
                failure: UpstreamFailure::Refused(response.status()),
                retriable: true,
            })
        }
        Ok(answered) => {
            connection
                .upstreams
                .lock()
                .await
                .insert(held.lease_id.clone(), http);
            Ok(answered)
        }
        Err(failure) => {
            let sent = match &failure {
                UpstreamFailure::Connect(_)
                | UpstreamFailure::Refused(_)
                | UpstreamFailure::SocksRefused(_) => false,
                UpstreamFailure::Http(e) => !e.is_canceled(),
                UpstreamFailure::Timeout | UpstreamFailure::Target(_) => true,
            };
            Err(Failed {
                failure,
                retriable: !sent || may_resend,
            })
        }
    }
}

async fn open(
    held: &Held,
    upstream: &Upstream,
    authority: &str,
    timeout: std::time::Duration,
) -> Result<HttpUpstream, Failed> {
    HttpUpstream::open(held.proxy.clone(), upstream, authority, timeout)
        .await
        .map_err(|failure| Failed {
            failure,
            retriable: true,
        })
}

/// The request as it goes upstream.
pub(super) fn request(parts: &Parts, body: &Bytes) -> Request<Full<Bytes>> {
    let mut request = Request::new(Full::new(body.clone()));
    *request.method_mut() = parts.method.clone();
    *request.uri_mut() = parts.uri.clone();
    *request.version_mut() = Version::HTTP_11;
    *request.headers_mut() = parts.headers.clone();
    request
}

/// Methods a request may be sent again with once it reached an upstream (RFC 9110 9.2.2).
pub(super) fn idempotent(method: &Method) -> bool {
    [
        Method::GET,
        Method::HEAD,
        Method::OPTIONS,
        Method::TRACE,
        Method::PUT,
        Method::DELETE,
    ]
    .contains(method)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_idempotent_methods_go_again_once_sent() {
        for method in [Method::GET, Method::HEAD, Method::PUT, Method::DELETE] {
            assert!(idempotent(&method), "{method}");
        }
        for method in [Method::POST, Method::PATCH, Method::CONNECT] {
            assert!(!idempotent(&method), "{method}");
        }
    }
}
