//! Bearer-token authentication of the `/v1` routes (token from `DISCOVERY_TOKEN`).

use actix_web::body::BoxBody;
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::StatusCode;
use actix_web::http::header::{AUTHORIZATION, HeaderValue, WWW_AUTHENTICATE};
use actix_web::middleware::Next;
use actix_web::{Error, ResponseError, web};
use subtle::ConstantTimeEq;

use super::error::ApiError;

/// The token every `/v1` request must present; `None` leaves the API open.
#[derive(Clone, Default)]
pub struct ApiToken(Option<Vec<u8>>);

impl std::fmt::Debug for ApiToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = if self.0.is_some() { "set" } else { "open" };
        f.debug_tuple("ApiToken").field(&state).finish()
    }
}

impl ApiToken {
    /// A token from its text; an empty text means no authentication.
    pub fn new(token: &str) -> Self {
        let token = token.trim();
        ApiToken((!token.is_empty()).then(|| token.as_bytes().to_vec()))
    }

    /// Whether requests must authenticate.
    pub fn is_required(&self) -> bool {
        self.0.is_some()
    }

    /// Whether an `Authorization` header value grants access (constant-time comparison).
    pub fn allows(&self, authorization: Option<&[u8]>) -> bool {
        let Some(expected) = &self.0 else {
            return true;
        };
        let Some(presented) = authorization.and_then(|h| h.strip_prefix(b"Bearer ")) else {
            return false;
        };
        presented.ct_eq(expected).into()
    }
}

/// Middleware answering 401 unless the request carries the bearer token.
pub async fn require_token(
    req: ServiceRequest,
    next: Next<BoxBody>,
) -> Result<ServiceResponse<BoxBody>, Error> {
    let allowed = req
        .app_data::<web::Data<ApiToken>>()
        .is_none_or(|token| token.allows(req.headers().get(AUTHORIZATION).map(|h| h.as_bytes())));
    if allowed {
        return next.call(req).await;
    }
    let mut response = ApiError::new(
        StatusCode::UNAUTHORIZED,
        "unauthorized",
        "missing or wrong bearer token: send `Authorization: Bearer <DISCOVERY_TOKEN>`",
    )
    .error_response();
    response
        .headers_mut()
        .insert(WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    Ok(req.into_response(response))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allows_table() {
        let token = ApiToken::new("s3cret");
        let cases: [(Option<&[u8]>, bool); 6] = [
            (Some(b"Bearer s3cret"), true),
            (Some(b"Bearer s3cret2"), false),
            (Some(b"Bearer s3cre"), false),
            (Some(b"bearer s3cret"), false),
            (Some(b"s3cret"), false),
            (None, false),
        ];
        for (header, expected) in cases {
            assert_eq!(token.allows(header), expected, "{header:?}");
        }
    }

    #[test]
    fn empty_token_leaves_the_api_open() {
        let open = ApiToken::new("  ");
        assert!(!open.is_required());
        assert!(open.allows(None));
        assert_eq!(format!("{open:?}"), "ApiToken(\"open\")");
        assert_eq!(format!("{:?}", ApiToken::new("x")), "ApiToken(\"set\")");
    }
}
