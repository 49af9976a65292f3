//! Request and response bodies of the API (their JSON shapes are the API contract, and the
//! OpenAPI document is generated from them).
//!
//! Each field's schema states exactly what the server accepts (the functions below build the
//! ones attributes cannot express from the same constants the checks use), so a client
//! generated from the document, or a fuzzer driven by it, is never refused a request the
//! document allows.

use std::collections::BTreeMap;
use std::fmt;

use serde::de::{self, Deserializer, Unexpected, Visitor};
use serde::{Deserialize, Serialize};
use utoipa::openapi::schema::{KnownFormat, Object, ObjectBuilder, SchemaFormat, SchemaType, Type};
use utoipa::{IntoParams, ToSchema};

use super::error::ApiError;
use crate::health::{LastFailure, ProbeErrorKind};
use crate::ledger::ReportResult;
use crate::serving::candidates::selector_pattern;

/// Longest `target`, in bytes: a DNS name's limit.
pub const MAX_TARGET_LEN: usize = 253;

/// What a `target` may be: printable ASCII (space to `~`), not only spaces. Surrounding
/// spaces are trimmed. Non-ASCII host names go in their ASCII (punycode) form, so the length
/// limit means the same in bytes and in characters.
pub const TARGET_PATTERN: &str = "^[ -~]*[!-~][ -~]*$";

/// Largest `ttlSeconds` accepted (2^53 - 1, the largest integer every JSON parser reads
/// exactly; the document's `maximum`); any TTL above `--max-lease-ttl` is cut to it anyway.
pub const MAX_TTL_SECONDS: u64 = (1 << 53) - 1;

/// Query of `GET /v1/proxies`.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ListQuery {
    /// `true` lists only healthy proxies, `false` only the others; empty or absent lists both.
    #[param(schema_with = healthy_schema)]
    pub healthy: Option<String>,
    /// Label selector `k=v,k2=v2`; every pair must match.
    #[param(schema_with = selector_schema)]
    pub selector: Option<String>,
}

// The schemas built by hand carry their own descriptions: utoipa drops a field's doc comment
// when `schema_with` replaces its schema.

fn healthy_schema() -> Object {
    ObjectBuilder::new()
        .schema_type(Type::String)
        .enum_values(Some(["true", "false", ""]))
        .description(Some(
            "`true` lists only healthy proxies, `false` only the others; empty or absent lists both.",
        ))
        .build()
}

pub(crate) fn selector_schema() -> Object {
    ObjectBuilder::new()
        .schema_type(Type::String)
        .pattern(Some(selector_pattern()))
        .description(Some(
            "Label selector `k=v,k2=v2`: every pair must match (so one key with two values \
             matches nothing). Blank terms and ASCII whitespace around keys and values are \
             ignored; a key is not blank and holds neither `,` nor `=`.",
        ))
        .examples(["geo=eu,tier=a"])
        .build()
}

fn target_schema(description: &str) -> Object {
    ObjectBuilder::new()
        .schema_type(SchemaType::from_iter([Type::String, Type::Null]))
        .min_length(Some(1))
        .max_length(Some(MAX_TARGET_LEN))
        .pattern(Some(TARGET_PATTERN))
        .description(Some(format!(
            "{description} A host name: 1 to {MAX_TARGET_LEN} printable ASCII characters, not \
             only spaces; surrounding spaces are trimmed and it is lower-cased."
        )))
        .examples(["example.com"])
        .build()
}

fn acquire_target_schema() -> Object {
    target_schema("The site the crawler will visit; proxies cooling down for it are skipped.")
}

fn report_target_schema() -> Object {
    target_schema("The site the result is about; defaults to the lease's target.")
}

fn ttl_schema(description: &str) -> Object {
    ObjectBuilder::new()
        .schema_type(SchemaType::from_iter([Type::Integer, Type::Null]))
        .format(Some(SchemaFormat::KnownFormat(KnownFormat::Int64)))
        .minimum(Some(1))
        .maximum(Some(MAX_TTL_SECONDS))
        .description(Some(format!(
            "{description}, in whole seconds (`300.0` is read as 300); capped by the server's \
             maximum (`--max-lease-ttl`). Absent or null: the server's default."
        )))
        .examples([300])
        .build()
}

fn acquire_ttl_schema() -> Object {
    ttl_schema("Requested lifetime")
}

fn renew_ttl_schema() -> Object {
    ttl_schema("New lifetime from now")
}

fn retry_after_schema() -> Object {
    ObjectBuilder::new()
        .schema_type(SchemaType::from_iter([Type::Integer, Type::Null]))
        .format(Some(SchemaFormat::KnownFormat(KnownFormat::Int64)))
        .minimum(Some(1))
        .maximum(Some(MAX_TTL_SECONDS))
        .description(Some(
            "How long the target asked to be left alone (its `Retry-After`), in whole seconds \
             (`120.0` is read as 120): the length of the cooldown a `rate_limited` or \
             `blocked` report starts, capped by the server's maximum \
             (`--max-lease-cooldown`). Absent or null: the server's default \
             (`--lease-cooldown`).",
        ))
        .examples([120])
        .build()
}

fn report_result_schema() -> Object {
    ObjectBuilder::new()
        .schema_type(Type::String)
        .enum_values(Some(ReportResult::ALL.map(ReportResult::as_str)))
        .description(Some(
            "What the target did: `rate_limited` and `blocked` put the (proxy, target) pair \
             into cooldown.",
        ))
        .build()
}

/// Checks and normalises a `target`: see [`TARGET_PATTERN`] and [`MAX_TARGET_LEN`]; answers
/// it trimmed and lower-cased.
pub fn parse_target(target: Option<String>) -> Result<Option<String>, ApiError> {
    let Some(target) = target else {
        return Ok(None);
    };
    let printable = target.bytes().all(|b| (b' '..=b'~').contains(&b));
    let trimmed = target.trim_matches(' ');
    if !printable || trimmed.is_empty() || target.len() > MAX_TARGET_LEN {
        return Err(ApiError::bad_request(
            "invalid_target",
            format!(
                "`target` must be 1 to {MAX_TARGET_LEN} printable ASCII characters (space \
                 through `~`), not only spaces: a host name such as example.com (omit it to \
                 acquire for any target)"
            ),
        ));
    }
    Ok(Some(trimmed.to_ascii_lowercase()))
}

/// Reads `ttlSeconds`: a whole number from 1 to [`MAX_TTL_SECONDS`], or `null`. JSON has one
/// number type and JSON Schema counts `300.0` as an integer, so an integral float is read as
/// that integer rather than refused.
fn whole_seconds<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<u64>, D::Error> {
    struct Seconds;

    impl Visitor<'_> for Seconds {
        type Value = u64;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            write!(f, "a whole number of seconds from 1 to {MAX_TTL_SECONDS}")
        }

        fn visit_u64<E: de::Error>(self, v: u64) -> Result<u64, E> {
            if (1..=MAX_TTL_SECONDS).contains(&v) {
                Ok(v)
            } else {
                Err(E::invalid_value(Unexpected::Unsigned(v), &self))
            }
        }

        fn visit_i64<E: de::Error>(self, v: i64) -> Result<u64, E> {
            u64::try_from(v)
                .map_err(|_| E::invalid_value(Unexpected::Signed(v), &self))
                .and_then(|v| self.visit_u64(v))
        }

        fn visit_f64<E: de::Error>(self, v: f64) -> Result<u64, E> {
            // Exact: every integer up to 2^53 is a float, and the range check comes first.
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
            if v.fract() == 0.0 && (1.0..=MAX_TTL_SECONDS as f64).contains(&v) {
                Ok(v as u64)
            } else {
                Err(E::invalid_value(Unexpected::Float(v), &self))
            }
        }
    }

    struct Whole(u64);

    impl<'de> Deserialize<'de> for Whole {
        fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
            deserializer.deserialize_any(Seconds).map(Whole)
        }
    }

    Ok(Option::<Whole>::deserialize(deserializer)?.map(|w| w.0))
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
    /// Whether it is cordoned (`spec.cordoned`): no new leases, while the leases it holds go
    /// on and it is still health-checked.
    pub cordoned: bool,
    /// Whether it is draining (its Proxy is being deleted, or its machine is about to be
    /// replaced): no new leases, and its leases cannot be renewed (`proxy_draining`); release
    /// them and acquire another proxy.
    pub draining: bool,
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
    /// The status the probe URL answered, for `unexpected_status`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(example = 503)]
    pub status: Option<u16>,
}

impl From<LastFailure> for LastFailureView {
    fn from(failure: LastFailure) -> Self {
        LastFailureView {
            kind: failure.kind,
            at: failure.at.to_string(),
            status: failure.status,
        }
    }
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
    #[schema(schema_with = acquire_target_schema)]
    pub target: Option<String>,
    /// Requested lifetime in seconds; capped by the server's maximum. Defaults to the
    /// server's default.
    #[serde(default, deserialize_with = "whole_seconds")]
    #[schema(schema_with = acquire_ttl_schema)]
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
    /// New lifetime from now, in seconds; capped by the server's maximum. Defaults to the
    /// server's default.
    #[serde(default, deserialize_with = "whole_seconds")]
    #[schema(schema_with = renew_ttl_schema)]
    pub ttl_seconds: Option<u64>,
}

/// Body of `POST /v1/leases/{id}/report`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReportRequest {
    /// `ok`, `rate_limited`, `blocked` or `error`; `rate_limited` and `blocked` put the
    /// (proxy, target) pair into cooldown. A string here, so that any other value is answered
    /// `unknown_result` rather than a generic body error.
    #[schema(schema_with = report_result_schema)]
    pub result: String,
    /// The site the result is about; defaults to the lease's target.
    #[schema(schema_with = report_target_schema)]
    pub target: Option<String>,
    /// How long the target asked to be left alone (its `Retry-After`), in seconds.
    #[serde(
        rename = "retryAfterSeconds",
        default,
        deserialize_with = "whole_seconds"
    )]
    #[schema(schema_with = retry_after_schema)]
    pub retry_after_seconds: Option<u64>,
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
    /// User name the proxy asks for; only where the install gives credentials out
    /// (`--lease-credentials`) and the proxy has them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub username: Option<String>,
    /// Password the proxy asks for, given out like `username`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub password: Option<String>,
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
#[serde(rename_all = "camelCase")]
pub struct StatusBody {
    /// `ok` or `ready`.
    pub status: String,
    /// `/readyz` with a PostgreSQL ledger: `up` while its database answers, `down` while it
    /// does not (lease writes are answered 503 `ledger_unavailable` meanwhile; the replica
    /// stays ready, since every replica shares the database).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub database: Option<String>,
    /// Why the database does not answer, while it does not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub database_error: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ttl(body: &str) -> Result<Option<u64>, String> {
        serde_json::from_str::<RenewRequest>(body)
            .map(|r| r.ttl_seconds)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn ttl_seconds_takes_whole_numbers_in_range_also_written_as_floats() {
        let ok = [
            (r#"{}"#, None),
            (r#"{"ttlSeconds":null}"#, None),
            (r#"{"ttlSeconds":1}"#, Some(1)),
            (r#"{"ttlSeconds":4897}"#, Some(4897)),
            (r#"{"ttlSeconds":4897.0}"#, Some(4897)),
            (r#"{"ttlSeconds":4.897e3}"#, Some(4897)),
            (r#"{"ttlSeconds":1E0}"#, Some(1)),
            (r#"{"ttlSeconds":9007199254740991}"#, Some(MAX_TTL_SECONDS)),
            (
                r#"{"ttlSeconds":9007199254740991.0}"#,
                Some(MAX_TTL_SECONDS),
            ),
        ];
        for (body, expected) in ok {
            assert_eq!(ttl(body), Ok(expected), "{body}");
        }
        for body in [
            r#"{"ttlSeconds":0}"#,
            r#"{"ttlSeconds":0.0}"#,
            r#"{"ttlSeconds":-0.0}"#,
            r#"{"ttlSeconds":-5}"#,
            r#"{"ttlSeconds":4897.5}"#,
            r#"{"ttlSeconds":0.5}"#,
            r#"{"ttlSeconds":9007199254740992}"#,
            r#"{"ttlSeconds":18446744073709551615}"#,
            r#"{"ttlSeconds":1e300}"#,
            r#"{"ttlSeconds":"60"}"#,
            r#"{"ttlSeconds":true}"#,
        ] {
            let error = ttl(body).unwrap_err();
            assert!(error.contains("whole number of seconds"), "{body}: {error}");
        }
    }

    #[test]
    fn targets_are_printable_ascii_up_to_253_bytes() {
        let longest = "a".repeat(MAX_TARGET_LEN);
        let ok = [
            ("example.com", "example.com"),
            (" Example.COM ", "example.com"),
            ("a", "a"),
            ("example.com:443", "example.com:443"),
            (longest.as_str(), longest.as_str()),
        ];
        for (target, expected) in ok {
            assert_eq!(
                parse_target(Some(target.to_owned())),
                Ok(Some(expected.to_owned())),
                "{target:?}"
            );
        }
        assert_eq!(parse_target(None), Ok(None));
        let too_long = "a".repeat(MAX_TARGET_LEN + 1);
        for target in [
            "",
            " ",
            "   ",
            "\texample.com",
            "bücher.de",
            "a\u{7f}",
            &too_long,
        ] {
            let error = parse_target(Some(target.to_owned())).unwrap_err();
            assert!(
                error.to_string().starts_with("invalid_target:"),
                "{target:?}: {error}"
            );
        }
    }

    /// The documented pattern and length accept exactly the targets the server accepts:
    /// every string up to four characters over the characters that matter, and the length
    /// limit at its edge.
    #[test]
    fn the_target_schema_accepts_exactly_what_parse_target_accepts() {
        let pattern = regex::Regex::new(TARGET_PATTERN).unwrap();
        let documented =
            |t: &str| pattern.is_match(t) && (1..=MAX_TARGET_LEN).contains(&t.chars().count());
        let alphabet = ['a', 'B', ' ', '~', '\t', '\n', '\u{7f}', 'é'];
        let mut strings = vec![String::new()];
        for _ in 0..4 {
            let mut longer = Vec::new();
            for s in &strings {
                for c in alphabet {
                    let mut t = s.clone();
                    t.push(c);
                    longer.push(t);
                }
            }
            strings.extend(longer);
        }
        strings.push(" ".repeat(MAX_TARGET_LEN - 1) + "a");
        strings.push(" ".repeat(MAX_TARGET_LEN) + "a");
        for target in strings {
            assert_eq!(
                documented(&target),
                parse_target(Some(target.clone())).is_ok(),
                "{target:?}"
            );
        }
    }
}
