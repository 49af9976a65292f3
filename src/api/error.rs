//! The API's error type: every non-2xx answer is `{"error":"<code>","message":"<text>"}`
//! (a 409 on acquire adds the counts of why nothing was free).

use actix_web::http::StatusCode;
use actix_web::http::header::{self, HeaderValue};
use actix_web::{HttpResponse, ResponseError};
use serde::Serialize;
use utoipa::ToSchema;

pub use crate::serving::no_match::NoMatchBody;
pub use crate::serving::tenants::QuotaExceededBody;

/// The JSON body of every error answer.
#[derive(Debug, Clone, Serialize, PartialEq, Eq, ToSchema)]
pub struct ErrorBody {
    /// Machine-readable code, e.g. `no_match`, `invalid_body`, `unauthorized`.
    pub error: String,
    /// Human-readable explanation.
    pub message: String,
}

/// The 503 body of an acquire for a ProxyPool that is waking (no member Ready yet): the pool
/// was asked for a member; ask again after `Retry-After`, for up to `wakeTimeoutSeconds`.
#[derive(Debug, Clone, Serialize, PartialEq, Eq, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct PoolWakingBody {
    /// Always `pool_waking`.
    pub error: String,
    /// Human-readable explanation.
    pub message: String,
    /// The waking pools the selector matches (`namespace/name`).
    pub pools: Vec<String>,
    /// How long the pools may take to wake (the longest of their `wakeTimeout`s).
    pub wake_timeout_seconds: u64,
}

/// Seconds a client waits before asking a waking pool again.
pub const POOL_WAKING_RETRY_AFTER: u64 = 2;

/// An error answer.
#[derive(Debug, Clone, PartialEq)]
pub enum ApiError {
    /// A plain error with a status, a code and a message.
    Plain {
        /// HTTP status.
        status: StatusCode,
        /// Machine-readable code.
        code: &'static str,
        /// Human-readable message.
        message: String,
    },
    /// An acquire that found nothing (409).
    NoMatch(NoMatchBody),
    /// An acquire for a pool that is waking (503 with `Retry-After`).
    PoolWaking(PoolWakingBody),
    /// An acquire over its tenant's quota (429 with `Retry-After`).
    QuotaExceeded(QuotaExceededBody),
    /// The ledger cannot take the write now and nothing was recorded (503 with
    /// `Retry-After`): its write queue is full or the write waited past its deadline
    /// (`overloaded`), the ledger is full (`ledger_full`), or its database cannot be reached
    /// (`ledger_unavailable`).
    Unavailable {
        /// Machine-readable code.
        code: &'static str,
        /// Whole seconds to wait before retrying, at least 1.
        retry_after_seconds: u64,
        /// Human-readable message.
        message: String,
    },
}

impl ApiError {
    /// An error with the given status, code and message.
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ApiError::Plain {
            status,
            code,
            message: message.into(),
        }
    }

    /// 400 for a request that is malformed or names a bad value.
    pub fn bad_request(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, code, message)
    }

    /// 404 for an unknown lease.
    pub fn unknown_lease(id: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "unknown_lease",
            format!("no lease {id:?} (never issued, or pruned after the cooldown window)"),
        )
    }

    /// 503 `overloaded` for a write the ledger could not take in time; `retry_after` is
    /// rounded up to whole seconds, at least 1.
    pub fn overloaded(retry_after: std::time::Duration) -> Self {
        let retry_after_seconds = crate::serving::retry_after::seconds(retry_after);
        ApiError::Unavailable {
            code: "overloaded",
            retry_after_seconds,
            message: format!(
                "the lease ledger is busy; retry in {retry_after_seconds} s (nothing was granted)"
            ),
        }
    }

    /// 503 `ledger_full` for a write the ledger could not record because its disk or its size
    /// bound is full; `retry_after` is rounded up to whole seconds, at least 1.
    pub fn ledger_full(retry_after: std::time::Duration) -> Self {
        let retry_after_seconds = crate::serving::retry_after::seconds(retry_after);
        ApiError::Unavailable {
            code: "ledger_full",
            retry_after_seconds,
            message: format!(
                "the lease ledger is full (its disk, or --ledger-max-size); nothing was \
                 recorded; retry in {retry_after_seconds} s"
            ),
        }
    }

    /// 503 `ledger_unavailable` for a write the ledger's database could not be reached for
    /// (PostgreSQL); `retry_after` is rounded up to whole seconds, at least 1.
    pub fn ledger_unavailable(retry_after: std::time::Duration) -> Self {
        let retry_after_seconds = crate::serving::retry_after::seconds(retry_after);
        ApiError::Unavailable {
            code: "ledger_unavailable",
            retry_after_seconds,
            message: format!(
                "the lease ledger's database cannot be reached; nothing was recorded; retry in \
                 {retry_after_seconds} s"
            ),
        }
    }

    /// 500 for a failure on our side; the details go to the log, not to the client.
    pub fn internal(context: &str, error: impl std::fmt::Display) -> Self {
        log::error!("{context}: {error}");
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            format!("{context}; see the server log"),
        )
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ApiError::Plain { code, message, .. } => write!(f, "{code}: {message}"),
            ApiError::NoMatch(body) => write!(f, "{}: {}", body.error, body.message),
            ApiError::PoolWaking(body) => write!(f, "{}: {}", body.error, body.message),
            ApiError::QuotaExceeded(body) => write!(f, "{}: {}", body.error, body.message),
            ApiError::Unavailable { code, message, .. } => write!(f, "{code}: {message}"),
        }
    }
}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        match self {
            ApiError::Plain { status, .. } => *status,
            ApiError::NoMatch(_) => StatusCode::CONFLICT,
            ApiError::QuotaExceeded(_) => StatusCode::TOO_MANY_REQUESTS,
            ApiError::PoolWaking(_) | ApiError::Unavailable { .. } => {
                StatusCode::SERVICE_UNAVAILABLE
            }
        }
    }

    fn error_response(&self) -> HttpResponse {
        match self {
            ApiError::Plain {
                status,
                code,
                message,
            } => HttpResponse::build(*status).json(ErrorBody {
                error: (*code).to_owned(),
                message: message.clone(),
            }),
            ApiError::NoMatch(body) => {
                let mut response = HttpResponse::Conflict();
                if let Some(seconds) = body.retry_after_seconds {
                    response.insert_header((header::RETRY_AFTER, HeaderValue::from(seconds)));
                }
                response.json(body)
            }
            ApiError::QuotaExceeded(body) => HttpResponse::TooManyRequests()
                .insert_header((
                    header::RETRY_AFTER,
                    HeaderValue::from(body.retry_after_seconds),
                ))
                .json(body),
            ApiError::PoolWaking(body) => HttpResponse::ServiceUnavailable()
                .insert_header((
                    header::RETRY_AFTER,
                    HeaderValue::from(POOL_WAKING_RETRY_AFTER),
                ))
                .json(body),
            ApiError::Unavailable {
                code,
                retry_after_seconds,
                message,
            } => HttpResponse::ServiceUnavailable()
                .insert_header((header::RETRY_AFTER, HeaderValue::from(*retry_after_seconds)))
                .json(ErrorBody {
                    error: (*code).to_owned(),
                    message: message.clone(),
                }),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn unavailable_rounds_retry_after_up_to_whole_seconds() {
        let cases = [
            (Duration::ZERO, 1),
            (Duration::from_millis(1), 1),
            (Duration::from_millis(1000), 1),
            (Duration::from_millis(1001), 2),
            (Duration::from_secs(7), 7),
        ];
        for (retry_after, seconds) in cases {
            for (error, code) in [
                (ApiError::overloaded(retry_after), "overloaded"),
                (ApiError::ledger_full(retry_after), "ledger_full"),
                (
                    ApiError::ledger_unavailable(retry_after),
                    "ledger_unavailable",
                ),
            ] {
                assert_eq!(error.status_code(), StatusCode::SERVICE_UNAVAILABLE);
                assert!(error.to_string().starts_with(code), "{error}");
                let response = error.error_response();
                assert_eq!(
                    response.headers().get(header::RETRY_AFTER),
                    Some(&HeaderValue::from(seconds)),
                    "{code} {retry_after:?}"
                );
            }
        }
    }
}
