//! Bearer-token authentication of the `/v1` routes (tokens from `DISCOVERY_TOKEN` and
//! `--discovery-token-file`; see [`crate::serving::tokens`]).

use actix_web::body::BoxBody;
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::StatusCode;
use actix_web::http::header::{AUTHORIZATION, HeaderValue, WWW_AUTHENTICATE};
use actix_web::middleware::Next;
use actix_web::{Error, HttpMessage, ResponseError, web};

use super::error::ApiError;
use crate::serving::tokens::ApiToken;

/// Middleware answering 401 unless the request carries a valid bearer token; the caller (the
/// token's identity and its tenant) goes with the request: a crawler's gateway sessions are
/// its token's, its leases and scope its tenant's.
pub async fn require_token(
    req: ServiceRequest,
    next: Next<BoxBody>,
) -> Result<ServiceResponse<BoxBody>, Error> {
    // No token configured on the app denies every request (fails closed).
    let presented = req
        .app_data::<web::Data<ApiToken>>()
        .and_then(|token| token.bearer(req.headers().get(AUTHORIZATION).map(|h| h.as_bytes())));
    if let Some(token) = presented {
        req.extensions_mut().insert(token);
        return next.call(req).await;
    }
    let mut response = ApiError::new(
        StatusCode::UNAUTHORIZED,
        "unauthorized",
        "missing or wrong bearer token: send `Authorization: Bearer <token>`",
    )
    .error_response();
    response
        .headers_mut()
        .insert(WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    Ok(req.into_response(response))
}
