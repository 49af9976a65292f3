//! A target's answer on its way to the crawler, plain HTTP and intercepted HTTPS alike: judged
//! by the rule for its host (its body's first KiB read first when the rule looks there), its
//! ban reported for the (proxy, target) with the target's `Retry-After` or the rule's
//! cooldown, its outcome counted, then handed on with the gateway's own headers and its bytes
//! counted until it is sent.

use std::any::Any;
use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Frame, SizeHint};
use http_body_util::BodyExt;
use hyper::Response;
use hyper::body::Incoming;
use hyper::header::{
    CONNECTION, HeaderMap, HeaderName, HeaderValue, PROXY_AUTHENTICATE, RETRY_AFTER, TE, TRAILER,
    TRANSFER_ENCODING, UPGRADE,
};

use crate::gateway::answers::{
    BAN_REPORTED_HEADER, Body, PROXY_STATUS, PROXY_STATUS_NAME, RequestOutcome, lease_headers,
};
use crate::gateway::bans;
use crate::gateway::choice::{Gateway, Held, RelayedFor};
use crate::gateway::rules::{Action, BODY_PREFIX, Ban};
use crate::ledger::{LeaseReport, ReportResult};
use crate::resources::proxy::ProxyId;
use crate::serving::outcomes::Outcome;

/// The header squid puts on the error pages it makes itself: such a page is the proxy's
/// answer, not the target's, and never a ban.
const SQUID_ERROR: &str = "x-squid-error";

/// A target's answer and what its host's rule says of it.
pub(in crate::gateway) struct Judged {
    /// The answer, with what was read of its body held for the crawler.
    pub response: Response<Prefixed>,
    /// The ban it is, if any.
    pub ban: Option<Ban>,
    /// What the rule does with a ban.
    pub action: Action,
}

/// Judges `response`, an answer of `target`, by the rules in force; reads its body's first
/// [`BODY_PREFIX`] bytes (within `timeout`) only when the rule looks there.
pub(in crate::gateway) async fn judge(
    gateway: &Gateway,
    target: &str,
    response: Response<Incoming>,
    timeout: Duration,
) -> Judged {
    let rules = gateway.rules.current();
    let rule = rules.for_host(target);
    let (parts, body) = response.into_parts();
    let mut body = Prefixed {
        read: VecDeque::new(),
        rest: body,
    };
    if parts.headers.contains_key(SQUID_ERROR) {
        return Judged {
            response: Response::from_parts(parts, body),
            ban: None,
            action: rule.action(),
        };
    }
    let prefix = if rule.reads_body() {
        body.read_prefix(timeout).await
    } else {
        Vec::new()
    };
    let ban = rule.judge(parts.status.as_u16(), &parts.headers, &prefix);
    Judged {
        response: Response::from_parts(parts, body),
        ban,
        action: rule.action(),
    }
}

/// Counts `judged` in the outcomes of (`held`'s proxy, `target`) and reports its ban, if it
/// is one; returns what was reported (a failed report is logged, and the answer goes on).
pub(in crate::gateway) async fn record(
    gateway: &Gateway,
    held: &Held,
    target: &str,
    judged: &Judged,
) -> Option<ReportResult> {
    let status = judged.response.status().as_u16();
    let outcome = Outcome::Http {
        status,
        banned: judged.ban.is_some(),
    };
    gateway
        .fleet
        .outcomes
        .record(&held.tenant, &held.proxy, Some(target), outcome);
    let ban = judged.ban.as_ref()?;
    gateway.metrics.rule_matched(&ban.rule, ban.result);
    let asked = judged
        .response
        .headers()
        .get(RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| bans::retry_after(v, gateway.fleet.clock.now()));
    let report = LeaseReport {
        result: ban.result,
        target: Some(target.to_owned()),
        cooldown: asked.or(ban.cooldown),
        exit: gateway.fleet.exit_of(&held.proxy, &held.lease_id),
    };
    match gateway
        .fleet
        .ledger
        .report(&held.lease_id, &held.tenant, report)
        .await
    {
        Ok(_) => {
            gateway.metrics.banned(ban.result);
            Some(ban.result)
        }
        Err(e) => {
            log::warn!(
                "gateway: reporting {status} from {target} through {} failed: {e}",
                held.proxy
            );
            None
        }
    }
}

/// A banned answer a rule retries on another exit, kept until another exit answers: when none
/// can, the crawler gets this one (reported, as `action: pass` would give it) rather than a
/// refusal that hides what the target said.
pub(super) struct Retried {
    pub held: Held,
    pub judged: Judged,
    pub reported: Option<ReportResult>,
    /// The proxy a session left for `held`'s, as its answer says.
    pub moved_from: Option<ProxyId>,
    /// Held until the answer is sent: the upstream connection busy, the lease in use.
    pub keep: Box<dyn Any + Send + Sync>,
}

impl Retried {
    /// The kept answer, handed on (`up` bytes were sent up).
    pub(super) fn hand_on(
        self,
        gateway: &Arc<Gateway>,
        up: u64,
    ) -> (RequestOutcome, Response<Body>) {
        let response = hand_on(
            gateway,
            &self.held,
            self.judged,
            self.reported,
            self.moved_from,
            up,
            self.keep,
        );
        (RequestOutcome::Forwarded, response)
    }
}

/// `judged` as the crawler gets it: the hop-by-hop headers and whatever the target forged of
/// the gateway's dropped, the lease (and the proxy a session left) named, a reported ban said;
/// its bytes counted for `held`'s tenant once sent (`up` were sent up), with `keep` held until
/// then (the upstream connection busy, the lease in use).
pub(in crate::gateway) fn hand_on(
    gateway: &Arc<Gateway>,
    held: &Held,
    judged: Judged,
    reported: Option<ReportResult>,
    moved_from: Option<ProxyId>,
    up: u64,
    keep: Box<dyn Any + Send + Sync>,
) -> Response<Body> {
    let mut response = judged.response;
    let headers = response.headers_mut();
    drop_hop_by_hop(headers);
    headers.remove(PROXY_AUTHENTICATE);
    drop_forged(headers);
    lease_headers(&mut response, held, moved_from);
    if let Some(result) = reported {
        response.headers_mut().insert(
            BAN_REPORTED_HEADER,
            HeaderValue::from_static(result.as_str()),
        );
    }
    response.map(|body| {
        Relayed {
            inner: body,
            up,
            down: 0,
            gateway: gateway.clone(),
            tenant: held.tenant.clone(),
            proxy: held.proxy.clone(),
            target: held.target.clone(),
            _keep: keep,
        }
        .boxed()
    })
}

/// A target's body, with the frames read to judge it given first.
pub(in crate::gateway) struct Prefixed {
    read: VecDeque<Frame<Bytes>>,
    rest: Incoming,
}

impl Prefixed {
    /// Reads frames until [`BODY_PREFIX`] bytes of data, the end, an error or `timeout`; keeps
    /// them to give first, and returns the data read (at most [`BODY_PREFIX`] bytes).
    async fn read_prefix(&mut self, timeout: Duration) -> Vec<u8> {
        let mut prefix = Vec::new();
        let reading = async {
            while prefix.len() < BODY_PREFIX {
                match self.rest.frame().await {
                    Some(Ok(frame)) => {
                        if let Some(data) = frame.data_ref() {
                            let room = BODY_PREFIX - prefix.len();
                            prefix.extend_from_slice(&data[..data.len().min(room)]);
                        }
                        self.read.push_back(frame);
                    }
                    // The error comes again when the crawler reads the rest.
                    Some(Err(_)) | None => return,
                }
            }
        };
        let _ = tokio::time::timeout(timeout, reading).await;
        prefix
    }
}

impl http_body::Body for Prefixed {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        if let Some(frame) = self.read.pop_front() {
            return Poll::Ready(Some(Ok(frame)));
        }
        Pin::new(&mut self.rest).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.read.is_empty() && self.rest.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let held: u64 = self
            .read
            .iter()
            .filter_map(|f| f.data_ref().map(|d| d.len() as u64))
            .sum();
        let rest = self.rest.size_hint();
        let mut hint = SizeHint::new();
        hint.set_lower(rest.lower() + held);
        if let Some(upper) = rest.upper() {
            hint.set_upper(upper + held);
        }
        hint
    }
}

/// A response body on its way to the crawler: counts the bytes, and keeps what it must hold
/// (the upstream connection busy, the lease in use) until it is done.
struct Relayed {
    inner: Prefixed,
    up: u64,
    down: u64,
    /// Where the bytes are counted (one reference, not a copy of each counter).
    gateway: Arc<Gateway>,
    tenant: Arc<str>,
    /// The proxy it came through.
    proxy: ProxyId,
    /// The target it came from.
    target: Arc<str>,
    _keep: Box<dyn Any + Send + Sync>,
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
        let for_ = RelayedFor {
            tenant: &self.tenant,
            proxy: &self.proxy,
            target: &self.target,
        };
        self.gateway.relayed(for_, self.up, self.down);
    }
}

/// Drops the headers that concern one connection only (RFC 9110 7.6.1): those `Connection`
/// names, and the usual ones.
pub(super) fn drop_hop_by_hop(headers: &mut HeaderMap) {
    if headers.contains_key(CONNECTION) {
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
    }
    for name in [CONNECTION, TE, TRAILER, TRANSFER_ENCODING, UPGRADE] {
        headers.remove(name);
    }
    for name in ["keep-alive", "proxy-connection"] {
        headers.remove(name);
    }
}

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
}
