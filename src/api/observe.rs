//! The outermost middleware: one log line per request, and a panic in a handler answered with
//! a JSON 500 instead of a dropped connection (the server keeps serving).

use std::panic::AssertUnwindSafe;
use std::time::Instant;

use actix_web::Error;
use actix_web::body::BoxBody;
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::StatusCode;
use actix_web::middleware::Next;
use futures_util::FutureExt;

use super::error::ApiError;

/// Logs `method path status latency` at info (never headers, so never the token) and turns a
/// handler panic into a 500.
pub async fn observe(
    req: ServiceRequest,
    next: Next<BoxBody>,
) -> Result<ServiceResponse<BoxBody>, Error> {
    let started = Instant::now();
    let method = req.method().clone();
    let path = req.path().to_owned();
    // The request cannot be cloned here (routing needs it unshared), so a caught panic is
    // returned as an error, which actix renders with `ApiError::error_response`.
    let result = match AssertUnwindSafe(next.call(req)).catch_unwind().await {
        Ok(result) => result,
        Err(_) => {
            log::error!("{method} {path}: handler panicked");
            Err(ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                "the request handler failed; see the server log",
            )
            .into())
        }
    };
    let status = match &result {
        Ok(response) => response.status(),
        Err(e) => e.as_response_error().status_code(),
    };
    log::info!(
        "{method} {path} {} {:.1}ms",
        status.as_u16(),
        started.elapsed().as_secs_f64() * 1000.0
    );
    result
}
