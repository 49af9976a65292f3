//! Plain HTTP (`GET http://host/path`): the request goes to an upstream proxy as it came
//! (absolute-form, hop-by-hop headers dropped) over a kept-alive connection, and the target's
//! answer comes back with the lease headers. The body is buffered (up to
//! `max_request_body`) so the request can be tried on another proxy: always while nothing
//! reached the upstream, and once it did only for idempotent methods. A status in the ban rule
//! is reported for the (proxy, target) and passed on to the crawler.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Frame, SizeHint};
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use hyper::body::Incoming;
use hyper::header::{
    CONNECTION, HOST, HeaderMap, HeaderName, HeaderValue, PROXY_AUTHENTICATE, PROXY_AUTHORIZATION,
    RETRY_AFTER, TE, TRAILER, TRANSFER_ENCODING, UPGRADE,
};
use hyper::http::request::Parts;
use hyper::{Method, Request, Response, StatusCode, Version};

use super::{ClientConnection, Failed, LeaseFor, Through};
use crate::gateway::answers::{
    BAN_REPORTED_HEADER, Body, PROXY_STATUS, PROXY_STATUS_NAME, RequestOutcome, error,
    lease_headers,
};
use crate::gateway::ask::Ask;
use crate::gateway::bans;
use crate::gateway::choice::{Gateway, Held};
use crate::gateway::metrics::GatewayMetrics;
use crate::gateway::upstream::{Busy, HttpUpstream, Upstream, UpstreamFailure};
use crate::ledger::LeaseReport;
use crate::serving::outcomes::Outcome;
use crate::serving::sessions::InUse;

/// Forwards `request` and answers with the target's response.
pub(super) async fn send(
    connection: &ClientConnection,
    request: Request<Incoming>,
    ask: &Ask,
) -> (RequestOutcome, Response<Body>) {
    let gateway = &connection.gateway;
    let (mut parts, body) = request.into_parts();
    let body = match Limited::new(body, gateway.config.max_request_body)
        .collect()
        .await
    {
        Ok(collected) => collected.to_bytes(),
        Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => {
            let message = format!(
                "request bodies through the gateway are buffered up to {} bytes",
                gateway.config.max_request_body
            );
            let response = error(StatusCode::PAYLOAD_TOO_LARGE, "body_too_large", &message);
            return (RequestOutcome::BadRequest, response);
        }
        Err(e) => {
            let message = format!("reading the request body failed: {e}");
            return (
                RequestOutcome::BadRequest,
                error(StatusCode::BAD_REQUEST, "bad_request", &message),
            );
        }
    };
    drop_hop_by_hop(&mut parts.headers);
    parts.headers.remove(PROXY_AUTHORIZATION);
    if !parts.headers.contains_key(HOST)
        && let Ok(host) = HeaderValue::try_from(ask.target.authority())
    {
        parts.headers.insert(HOST, host);
    }
    let may_resend = idempotent(&parts.method);
    let what = format!("{} {}", parts.method, parts.uri);
    let through = connection
        .through_upstream(ask, LeaseFor::Request, &what, |held, upstream| {
            let (parts, body) = (&parts, &body);
            async move { exchange(connection, &held, &upstream, parts, body, may_resend).await }
        })
        .await;
    let Through {
        value: (response, busy),
        held,
        moved_from,
    } = match through {
        Ok(through) => through,
        Err(answer) => return answer,
    };
    let in_use = held.uses.begin();
    let response = answer(gateway, &held, ask, response, moved_from).await;
    let up = body.len() as u64;
    let response = response.map(|incoming| {
        Relayed {
            inner: incoming,
            up,
            down: 0,
            metrics: gateway.metrics.clone(),
            tenant: held.tenant.clone(),
            _busy: busy,
            _in_use: in_use,
        }
        .boxed()
    });
    (RequestOutcome::Forwarded, response)
}

/// Sends the request through the connection's upstream connection for the lease (a new one
/// when it has none or it closed). A kept-alive connection the proxy closed meanwhile is no
/// failure of the proxy: the request goes again once on a new connection when it was not sent
/// or may be sent again. A failure may be retried on another proxy when the request did not
/// reach the upstream, or `may_resend`.
async fn exchange(
    connection: &ClientConnection,
    held: &Held,
    upstream: &Upstream,
    parts: &Parts,
    body: &Bytes,
    may_resend: bool,
) -> Result<(Response<Incoming>, Busy), Failed> {
    let timeout = connection.gateway.config.upstream_timeout;
    let kept = connection
        .upstreams
        .lock()
        .await
        .remove(&held.lease_id)
        .filter(HttpUpstream::ready);
    let reused = kept.is_some();
    let mut http = match kept {
        Some(http) => http,
        None => open(held, upstream, timeout).await?,
    };
    let mut result = http.send(request(parts, body), timeout).await;
    if reused
        && let Err(UpstreamFailure::Http(e)) = &result
        && (e.is_canceled() || (may_resend && e.is_incomplete_message()))
    {
        http = open(held, upstream, timeout).await?;
        result = http.send(request(parts, body), timeout).await;
    }
    match result {
        Ok((response, busy)) if response.status() == StatusCode::PROXY_AUTHENTICATION_REQUIRED => {
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
                UpstreamFailure::Connect(_) | UpstreamFailure::Refused(_) => false,
                UpstreamFailure::Http(e) => !e.is_canceled(),
                UpstreamFailure::Timeout => true,
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
    timeout: std::time::Duration,
) -> Result<HttpUpstream, Failed> {
    HttpUpstream::open(held.proxy.clone(), upstream, timeout)
        .await
        .map_err(|failure| Failed {
            failure,
            retriable: true,
        })
}

/// The request as it goes upstream.
fn request(parts: &Parts, body: &Bytes) -> Request<Full<Bytes>> {
    let mut request = Request::new(Full::new(body.clone()));
    *request.method_mut() = parts.method.clone();
    *request.uri_mut() = parts.uri.clone();
    *request.version_mut() = Version::HTTP_11;
    *request.headers_mut() = parts.headers.clone();
    request
}

/// The target's response as the crawler gets it, counted in the outcomes; a status in the ban
/// rule is reported first.
async fn answer(
    gateway: &Arc<Gateway>,
    held: &Held,
    ask: &Ask,
    response: Response<Incoming>,
    moved_from: Option<crate::resources::proxy::ProxyId>,
) -> Response<Incoming> {
    let status = response.status().as_u16();
    // A squid's own error page (its access refusal, a failed DNS lookup) is the proxy's
    // answer, not the target's: never a ban.
    let ban = if response.headers().contains_key(SQUID_ERROR) {
        None
    } else {
        gateway.config.ban_rule.of(status)
    };
    let outcome = Outcome::Http {
        status,
        banned: ban.is_some(),
    };
    gateway
        .fleet
        .outcomes
        .record(&held.proxy, Some(&ask.target.host), outcome);
    let mut reported = None;
    if let Some(result) = ban {
        let cooldown = response
            .headers()
            .get(RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| bans::retry_after(v, gateway.fleet.clock.now()));
        let report = LeaseReport {
            result,
            target: Some(ask.target.host.clone()),
            cooldown,
        };
        match gateway
            .fleet
            .ledger
            .report(&held.lease_id, &held.tenant, report)
            .await
        {
            Ok(_) => {
                gateway.metrics.banned(result);
                reported = Some(result);
            }
            Err(e) => log::warn!(
                "gateway: reporting {} from {} through {} failed: {e}",
                status,
                ask.target.host,
                held.proxy
            ),
        }
    }
    let mut response = response;
    drop_hop_by_hop(response.headers_mut());
    response.headers_mut().remove(PROXY_AUTHENTICATE);
    drop_forged(response.headers_mut());
    lease_headers(&mut response, held, moved_from);
    if let Some(result) = reported {
        response.headers_mut().insert(
            BAN_REPORTED_HEADER,
            HeaderValue::from_static(result.as_str()),
        );
    }
    response
}

/// Methods a request may be sent again with once it reached an upstream (RFC 9110 9.2.2).
fn idempotent(method: &Method) -> bool {
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

/// Drops the headers that concern one connection only (RFC 9110 7.6.1): those `Connection`
/// names, and the usual ones.
fn drop_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::try_from(name.trim()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in [CONNECTION, TE, TRAILER, TRANSFER_ENCODING, UPGRADE] {
        headers.remove(name);
    }
    for name in ["keep-alive", "proxy-connection"] {
        headers.remove(name);
    }
}

/// The header squid puts on the error pages it makes itself.
const SQUID_ERROR: &str = "x-squid-error";

/// Drops what a target may send that a crawler would read as the gateway's own: every
/// `X-Proxy-*` header, and the members of `Proxy-Status` that name this gateway (another
/// proxy's members stay).
fn drop_forged(headers: &mut HeaderMap) {
    let forged: Vec<HeaderName> = headers
        .keys()
        .filter(|name| name.as_str().starts_with("x-proxy-"))
        .cloned()
        .collect();
    for name in forged {
        headers.remove(name);
    }
    let kept: Vec<HeaderValue> = headers
        .get_all(PROXY_STATUS)
        .iter()
        .filter_map(|value| {
            let Ok(text) = value.to_str() else {
                // Not text: nothing a client could read as ours.
                return Some(value.clone());
            };
            let members: Vec<&str> = list_members(text)
                .into_iter()
                .filter(|member| !names_this_gateway(member))
                .collect();
            HeaderValue::try_from(members.join(", ")).ok()
        })
        .filter(|value| !value.is_empty())
        .collect();
    headers.remove(PROXY_STATUS);
    for value in kept {
        headers.append(PROXY_STATUS, value);
    }
}

/// The members of a structured-field list (RFC 8941), split at the commas outside quoted
/// strings.
fn list_members(text: &str) -> Vec<&str> {
    let mut members = Vec::new();
    let (mut start, mut quoted, mut escaped) = (0, false, false);
    for (i, c) in text.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' if quoted => escaped = true,
            '"' => quoted = !quoted,
            ',' if !quoted => {
                members.push(text[start..i].trim());
                start = i + 1;
            }
            _ => {}
        }
    }
    members.push(text[start..].trim());
    members.retain(|m| !m.is_empty());
    members
}

/// Whether a `Proxy-Status` member is this gateway's (its name, a token or a string).
fn names_this_gateway(member: &str) -> bool {
    let name = member.split(';').next().unwrap_or_default().trim();
    name.trim_matches('"')
        .eq_ignore_ascii_case(PROXY_STATUS_NAME)
}

/// A response body on its way to the crawler: counts the bytes, and keeps the upstream
/// connection busy and the lease in use until it is done.
struct Relayed {
    inner: Incoming,
    up: u64,
    down: u64,
    metrics: GatewayMetrics,
    tenant: std::sync::Arc<str>,
    _busy: Busy,
    _in_use: InUse,
}

impl http_body::Body for Relayed {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &polled
            && let Some(data) = frame.data_ref()
        {
            self.down += data.len() as u64;
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for Relayed {
    fn drop(&mut self) {
        self.metrics.relayed(&self.tenant, self.up, self.down);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_headers_stay_on_their_connection() {
        let mut headers = HeaderMap::new();
        for (name, value) in [
            ("connection", "keep-alive, x-private"),
            ("x-private", "1"),
            ("keep-alive", "timeout=5"),
            ("proxy-connection", "keep-alive"),
            ("transfer-encoding", "chunked"),
            ("te", "trailers"),
            ("upgrade", "websocket"),
            ("accept", "text/html"),
            ("cookie", "a=b"),
        ] {
            headers.append(
                HeaderName::from_static(name),
                HeaderValue::from_static(value),
            );
        }
        drop_hop_by_hop(&mut headers);
        let mut left: Vec<&str> = headers.keys().map(HeaderName::as_str).collect();
        left.sort_unstable();
        assert_eq!(left, ["accept", "cookie"]);
    }

    #[test]
    fn what_a_target_forges_of_the_gateways_headers_is_dropped() {
        let mut headers = HeaderMap::new();
        for (name, value) in [
            ("x-proxy-session-moved", "default/elsewhere"),
            ("x-proxy-ban-reported", "blocked"),
            ("X-Proxy-Name", "default/fake"),
            ("proxy-status", "proxy-operator; details=\"no_match\""),
            (
                "proxy-status",
                "cdn-edge; error=http_response_incomplete, \"proxy-operator\"; details=\"a, b\"",
            ),
            (
                "proxy-status",
                "other; details=\"proxy-operator, said \\\"x\\\"\"",
            ),
            ("x-proxyish", "kept"),
            ("content-type", "text/html"),
        ] {
            headers.append(
                HeaderName::try_from(name).unwrap(),
                HeaderValue::from_static(value),
            );
        }
        drop_forged(&mut headers);
        let mut names: Vec<&str> = headers.keys().map(HeaderName::as_str).collect();
        names.sort_unstable();
        assert_eq!(names, ["content-type", "proxy-status", "x-proxyish"]);
        let status: Vec<&str> = headers
            .get_all(PROXY_STATUS)
            .iter()
            .map(|v| v.to_str().unwrap())
            .collect();
        assert_eq!(
            status,
            [
                "cdn-edge; error=http_response_incomplete",
                "other; details=\"proxy-operator, said \\\"x\\\"\""
            ]
        );
    }

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
