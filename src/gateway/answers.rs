//! The answers the gateway makes itself (a refusal, a failure): a JSON body whose `error` is
//! its code and a `Proxy-Status` naming the gateway (RFC 9209), never on a target's answer; the
//! headers that name the upstream and the lease on every answer; and how a request ended, the
//! label of its counter.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::header::{HeaderValue, PROXY_AUTHENTICATE, RETRY_AFTER};
use hyper::{Response, StatusCode};
use serde_json::json;

use super::choice::{Held, Refusal};
use super::intercept::TargetRefused;
use crate::egress::Refused;
use crate::ledger::{LedgerError, NoMatch};
use crate::resources::proxy::ProxyId;
use crate::serving::no_match::NoMatchBody;
use crate::serving::retry_after;
use crate::serving::tenants::QuotaExceededBody;

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
pub(super) const PROXY_STATUS_NAME: &str = "proxy-operator";
/// The error code of a refusal for a tenant's quota.
pub(super) const QUOTA_EXCEEDED: &str = "quota_exceeded";
/// The error code of a refusal for a destination the policy denies (see [`crate::egress`]).
pub const DESTINATION_NOT_ALLOWED: &str = "destination_not_allowed";
/// The error code of a refusal for a target name that does not resolve.
pub const DESTINATION_UNRESOLVABLE: &str = "destination_unresolvable";
/// The error code of an intercepted CONNECT whose target refused the gateway's TLS.
pub const TARGET_TLS_FAILED: &str = "target_tls_failed";
/// The error code of a request for interception the gateway cannot or may not make.
pub const INTERCEPTION_REFUSED: &str = "interception_refused";
/// The error code of a refusal for a connection over a cap.
pub const TOO_MANY_CONNECTIONS: &str = "too_many_connections";

/// The body of every gateway answer.
pub type Body = BoxBody<Bytes, hyper::Error>;

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
    /// An intercepted tunnel was opened (`tls=inspect`).
    Intercepted,
    /// 403 `interception_refused`: interception asked for, without a CA or not allowed.
    InterceptionRefused,
}

impl RequestOutcome {
    /// Every outcome.
    pub const ALL: [RequestOutcome; 13] = [
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
        RequestOutcome::Intercepted,
        RequestOutcome::InterceptionRefused,
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
            RequestOutcome::Intercepted => "intercepted",
            RequestOutcome::InterceptionRefused => "interception_refused",
        }
    }
}

/// Names the proxy and the lease an answer went through, and the proxy a session left.
pub(super) fn lease_headers<B>(
    response: &mut Response<B>,
    held: &Held,
    moved_from: Option<ProxyId>,
) {
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
pub(super) fn proxy_auth_required() -> Response<Body> {
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
pub(super) fn error(status: StatusCode, code: &str, message: &str) -> Response<Body> {
    json_response(status, &json!({"error": code, "message": message}))
}

/// An answer the gateway makes itself, never a target's: a JSON body whose `error` is its
/// code, and a `Proxy-Status` header (RFC 9209) naming the gateway and that code, so a
/// crawler tells it from anything a target answered (see `PROXY_STATUS`).
pub(super) fn json_response(status: StatusCode, body: &serde_json::Value) -> Response<Body> {
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
pub(super) fn proxy_status(code: &str) -> String {
    let error = match code {
        QUOTA_EXCEEDED | TOO_MANY_CONNECTIONS | INTERCEPTION_REFUSED => Some("http_request_denied"),
        TARGET_TLS_FAILED => Some("tls_certificate_error"),
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
pub(super) fn destination_refusal(refused: &Refused) -> Response<Body> {
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
pub(super) fn too_many_connections(tenant: &str, cap: usize) -> Response<Body> {
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
pub(super) fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed()
}

/// The answer to a refused lease: 503 with `Retry-After`; for no match, the same counts as the
/// lease API's 409.
pub(super) fn refusal(refusal: &Refusal, now: jiff::Timestamp) -> (RequestOutcome, Response<Body>) {
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
        Refusal::Username(unspellable) => (
            RequestOutcome::BadRequest,
            error(
                StatusCode::BAD_REQUEST,
                "vendor_username",
                &unspellable.to_string(),
            ),
        ),
        Refusal::UnknownChain(name) => (
            RequestOutcome::BadRequest,
            error(
                StatusCode::BAD_REQUEST,
                "unknown_fallback",
                &format!("fallback {name:?} names no chain of --gateway-rules-file"),
            ),
        ),
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

pub(super) fn no_match_response(no_match: &NoMatch, now: jiff::Timestamp) -> Response<Body> {
    let body = NoMatchBody::of(no_match, now);
    let mut response = json_response(
        StatusCode::SERVICE_UNAVAILABLE,
        &serde_json::to_value(&body).unwrap_or_default(),
    );
    let seconds = body.retry_after_seconds.unwrap_or(1);
    response
        .headers_mut()
        .insert(RETRY_AFTER, HeaderValue::from(seconds));
    response
}

pub(super) fn set_retry_after(response: &mut Response<Body>, wait: Duration) {
    response
        .headers_mut()
        .insert(RETRY_AFTER, HeaderValue::from(retry_after::seconds(wait)));
}

/// `502 target_tls_failed` for an intercepted CONNECT whose target refused the gateway's TLS:
/// nothing was relayed, and it is never a ban (every exit would meet the same certificate).
pub(super) fn target_refusal(refused: &TargetRefused) -> Response<Body> {
    json_response(
        StatusCode::BAD_GATEWAY,
        &json!({
            "error": TARGET_TLS_FAILED,
            "reason": refused.reason(),
            "message": format!(
                "the gateway's TLS to the target failed ({refused}): nothing was relayed"
            ),
        }),
    )
}

/// `403 interception_refused` for a request asking for `tls=inspect` that the gateway cannot
/// (it has no CA) or may not (the caller's tenant is not allowed) serve: never a silent tunnel.
pub(super) fn interception_refused(why: &str) -> Response<Body> {
    error(StatusCode::FORBIDDEN, INTERCEPTION_REFUSED, why)
}
