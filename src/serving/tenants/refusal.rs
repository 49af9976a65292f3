//! The answer to an acquire refused for its tenant's quota, the same body from the lease API
//! (`429`) and the gateway (`503`, with `Proxy-Status`).

use serde::{Serialize, Serializer};
use utoipa::ToSchema;

use crate::ledger::QuotaExceeded;

/// The 429 body of an acquire refused because the caller's tenant is at one of its quotas
/// (`--tenants-file`). Nothing was looked at and nothing counts as demand: retry after
/// `Retry-After`, or release a lease first.
#[derive(Debug, Clone, Serialize, PartialEq, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct QuotaExceededBody {
    /// Always `quota_exceeded`.
    pub error: String,
    /// Human-readable explanation.
    pub message: String,
    /// The caller's tenant.
    pub tenant: String,
    /// The quota: `leases` (leases at once, a gateway session's included), `sessions`
    /// (gateway sessions at once), `acquiresPerSecond`, or `bytesPerDay` (bytes through the
    /// gateway per UTC day; it frees at midnight UTC).
    pub quota: String,
    /// Its limit: leases or sessions (a whole number), acquires per second, or bytes.
    #[serde(serialize_with = "whole_when_it_is")]
    pub limit: f64,
    /// The burst of the `acquiresPerSecond` quota.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub burst: Option<u32>,
    /// Seconds until the quota lets an acquire through by itself (also sent as
    /// `Retry-After`).
    pub retry_after_seconds: u64,
}

impl QuotaExceededBody {
    /// The body of `refused`.
    pub fn of(refused: &QuotaExceeded) -> Self {
        QuotaExceededBody {
            error: "quota_exceeded".into(),
            message: refused.message(),
            tenant: refused.tenant.to_string(),
            quota: refused.quota.as_str().into(),
            limit: refused.limit,
            burst: refused.burst,
            retry_after_seconds: crate::serving::retry_after::seconds(refused.retry_after),
        }
    }
}

/// A number as JSON writes it plainly: `20` for a whole number of leases, `2.5` for a rate.
fn whole_when_it_is<S: Serializer>(value: &f64, serializer: S) -> Result<S::Ok, S::Error> {
    let whole = value.fract() == 0.0 && value.is_finite() && (0.0..9e15).contains(value);
    match whole {
        #[expect(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            reason = "a whole number between 0 and 9e15"
        )]
        true => serializer.serialize_u64(*value as u64),
        false => serializer.serialize_f64(*value),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::ledger::QuotaKind;

    #[test]
    fn a_whole_limit_is_a_whole_number_and_a_burst_only_comes_with_a_rate() {
        let leases = QuotaExceeded {
            tenant: "team-a".into(),
            quota: QuotaKind::Leases,
            limit: 20.0,
            burst: None,
            retry_after: Duration::from_millis(1500),
        };
        let json = serde_json::to_value(QuotaExceededBody::of(&leases)).unwrap();
        assert_eq!(json["limit"], serde_json::json!(20));
        assert_eq!(json["retryAfterSeconds"], 2);
        assert!(json.get("burst").is_none(), "{json}");
        let rate = QuotaExceeded {
            quota: QuotaKind::Rate,
            limit: 2.5,
            burst: Some(5),
            ..leases
        };
        let json = serde_json::to_value(QuotaExceededBody::of(&rate)).unwrap();
        assert_eq!(json["limit"], serde_json::json!(2.5));
        assert_eq!(
            (json["quota"].as_str(), json["burst"].as_u64()),
            (Some("acquiresPerSecond"), Some(5))
        );
    }
}
