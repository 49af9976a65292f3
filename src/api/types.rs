//! Request and response bodies of the API (their JSON shapes are the API contract, and the
//! OpenAPI document is generated from them).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use crate::health::ProbeErrorKind;

/// Query of `GET /v1/proxies`.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ListQuery {
    /// `true` lists only healthy proxies, `false` only the others.
    pub healthy: Option<String>,
    /// Label selector `k=v,k2=v2`; every pair must match.
    pub selector: Option<String>,
}

/// One proxy as crawlers see it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProxyView {
    /// Name of the Proxy.
    pub name: String,
    /// Namespace of the Proxy.
    pub namespace: String,
    /// Address to connect to.
    pub host: String,
    /// Port to connect to.
    pub port: i32,
    /// `http://host:port`, ready for an HTTP client's proxy setting.
    pub url: String,
    /// Whether it passes health checks.
    pub healthy: bool,
    /// Latency of the last probe, in milliseconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub latency_ms: Option<u64>,
    /// Why and when its most recent probe failure happened; present only while it is
    /// unhealthy (absent when healthy or not checked yet).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_failure: Option<LastFailureView>,
    /// Leases currently held on it.
    pub active_leases: u32,
    /// How many leases it grants at once (0: never).
    pub max_leases: u32,
    /// Its selection labels.
    pub labels: BTreeMap<String, String>,
}

/// The most recent failed health probe of an unhealthy proxy.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct LastFailureView {
    /// Why the probe failed.
    pub kind: ProbeErrorKind,
    /// When that probe finished (RFC 3339).
    #[schema(example = "2026-11-30T22:00:00.123Z")]
    pub at: String,
}

/// Answer of `GET /v1/proxies`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct ProxyList {
    /// Matching proxies, sorted by namespace/name.
    pub proxies: Vec<ProxyView>,
    /// Number of proxies.
    pub count: usize,
}

/// Body of `POST /v1/leases`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct AcquireRequest {
    /// Labels the proxy must carry (all of them); absent or empty matches every proxy.
    #[serde(default)]
    pub selector: BTreeMap<String, String>,
    /// The site the crawler will visit; proxies cooling down for it are skipped.
    pub target: Option<String>,
    /// Requested lifetime; capped by the server's maximum. Defaults to the server's default.
    #[schema(minimum = 1)]
    pub ttl_seconds: Option<u64>,
    /// Makes the acquire idempotent: a retry with the same `requestID` and the same
    /// selector, target and `ttlSeconds` answers 200 with the lease of the first attempt (as
    /// it is now, even if released) instead of granting another; the same `requestID` with a
    /// different question answers 422 `request_id_reused`. 1 to 128 printable ASCII
    /// characters; remembered until the lease it got expires.
    #[serde(rename = "requestID")]
    #[schema(pattern = "^[ -~]{1,128}$", min_length = 1, max_length = 128)]
    pub request_id: Option<String>,
}

/// Body of `POST /v1/leases/{id}/renew`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct RenewRequest {
    /// New lifetime from now; capped by the server's maximum. Defaults to the server's default.
    #[schema(minimum = 1)]
    pub ttl_seconds: Option<u64>,
}

/// Body of `POST /v1/leases/{id}/report`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReportRequest {
    /// `ok`, `rate_limited`, `blocked` or `error`; `rate_limited` and `blocked` put the
    /// (proxy, target) pair into cooldown.
    pub result: String,
    /// The site the result is about; defaults to the lease's target.
    pub target: Option<String>,
}

/// The leased proxy inside a lease answer.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct LeaseProxy {
    /// Name of the Proxy.
    pub name: String,
    /// Namespace of the Proxy.
    pub namespace: String,
    /// Address to connect to (absent when the proxy has left the inventory).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    /// Port to connect to.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub port: Option<i32>,
    /// `http://host:port`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
}

/// A lease.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct LeaseView {
    /// The lease ID: a capability, needed to renew, release and report.
    #[serde(rename = "leaseID")]
    pub lease_id: String,
    /// The leased proxy.
    pub proxy: LeaseProxy,
    /// Target named when acquiring.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
    /// `active`, `released` or `expired`.
    pub state: String,
    /// When the lease was granted (RFC 3339).
    pub acquired_at: String,
    /// When it stops counting (RFC 3339).
    pub expires_at: String,
    /// Lifetime granted by the last acquire or renew, in seconds.
    pub ttl_seconds: u64,
    /// When it was released (RFC 3339).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub released_at: Option<String>,
}

/// Answer of `/healthz` and `/readyz`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct StatusBody {
    /// `ok` or `ready`.
    pub status: String,
}
