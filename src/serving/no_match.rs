//! The answer to an acquire that found nothing, one body for the lease API (`409`) and the
//! gateway (`503`, with `Proxy-Status`): its main reason and why each matching proxy was
//! passed over.

use serde::Serialize;
use utoipa::ToSchema;
use utoipa::openapi::schema::{Object, ObjectBuilder, Type};

use super::retry_after;
use crate::ledger::{NoMatch, NoMatchReason};

/// The body of an acquire that found nothing (the API's `409`, the gateway's `503`): why each
/// matching proxy was skipped.
#[derive(Debug, Clone, Serialize, PartialEq, Eq, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct NoMatchBody {
    /// Always `no_match`.
    pub error: String,
    /// The main reason, the one `proxy_operator_lease_rejections_total` counts.
    #[schema(schema_with = reason_schema)]
    pub reason: String,
    /// Human-readable explanation.
    pub message: String,
    /// Proxies matching the selector.
    pub considered: u32,
    /// Cordoned proxies (`spec.cordoned: true`); each is counted here only, whatever its
    /// health or load.
    pub cordoned: u32,
    /// Uncordoned proxies that are draining (being deleted, or their machine about to be
    /// replaced); each is counted here only, whatever its health or load.
    pub draining: u32,
    /// Healthy proxies with every lease slot taken (or `maxLeases: 0`).
    pub at_capacity: u32,
    /// Healthy proxies with a free slot that hold as many leases for the target as the
    /// per-target limits allow (`--max-leases-per-target`, `--max-leases-per-proxy-target`).
    pub at_target_limit: u32,
    /// Healthy proxies with a free slot that are cooling down for the target.
    pub in_cooldown: u32,
    /// Proxies neither cordoned nor draining that fail health checks (or are not yet checked).
    pub unhealthy: u32,
    /// Seconds until a proxy frees up by itself (also sent as `Retry-After`); absent when
    /// nothing will.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retry_after_seconds: Option<u64>,
}

impl NoMatchBody {
    /// The body of `no_match` at `now`.
    pub fn of(no_match: &NoMatch, now: jiff::Timestamp) -> Self {
        NoMatchBody {
            error: "no_match".into(),
            reason: no_match.reason().as_str().into(),
            message: no_match.message(),
            considered: no_match.considered,
            cordoned: no_match.cordoned,
            draining: no_match.draining,
            at_capacity: no_match.at_capacity,
            at_target_limit: no_match.at_target_limit,
            in_cooldown: no_match.in_cooldown,
            unhealthy: no_match.unhealthy,
            retry_after_seconds: no_match
                .retry_after
                .map(|at| retry_after::seconds(retry_after::until(at, now))),
        }
    }
}

fn reason_schema() -> Object {
    ObjectBuilder::new()
        .schema_type(Type::String)
        .enum_values(Some(NoMatchReason::ALL.map(NoMatchReason::as_str)))
        .description(Some(
            "The main reason, the one `proxy_operator_lease_rejections_total` counts: \
             `no_proxies` (nothing matches), `cordoned`, `draining`, `unhealthy`, `capacity`, \
             `target_limit` (the per-target caps) or `cooldown`.",
        ))
        .build()
}
