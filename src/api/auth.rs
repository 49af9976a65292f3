//! Bearer-token authentication of the `/v1` routes (tokens from `DISCOVERY_TOKEN` and
//! `--discovery-token-file`; see [`super::token`]).

use actix_web::body::BoxBody;
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::StatusCode;
use actix_web::http::header::{AUTHORIZATION, HeaderValue, WWW_AUTHENTICATE};
use actix_web::middleware::Next;
use actix_web::{Error, ResponseError, web};
use std::sync::{Arc, PoisonError, RwLock};

use subtle::{Choice, ConstantTimeEq};

use super::error::ApiError;
use super::token::TokenSet;

/// The tokens every `/v1` request must present one of; open (no check) only when built with
/// [`ApiToken::open`] (`--insecure-no-auth`). Clones share the set, so [`ApiToken::replace`]
/// (a re-read token file) applies to the running server.
#[derive(Clone)]
pub struct ApiToken(Option<Arc<RwLock<TokenSet>>>);

impl std::fmt::Debug for ApiToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = if self.0.is_some() { "set" } else { "open" };
        f.debug_tuple("ApiToken").field(&state).finish()
    }
}

impl ApiToken {
    /// Requests must present one of `tokens`.
    pub fn new(tokens: TokenSet) -> Self {
        ApiToken(Some(Arc::new(RwLock::new(tokens))))
    }

    /// No authentication at all (`--insecure-no-auth`).
    pub fn open() -> Self {
        ApiToken(None)
    }

    /// Whether requests must authenticate.
    pub fn is_required(&self) -> bool {
        self.0.is_some()
    }

    /// Makes `tokens` the valid set (no effect on an open API).
    pub fn replace(&self, tokens: TokenSet) {
        if let Some(set) = &self.0 {
            *set.write().unwrap_or_else(PoisonError::into_inner) = tokens;
        }
    }

    /// Whether an `Authorization` header value grants access. Every valid token is compared,
    /// each in constant time, whatever the outcome of the others.
    pub fn allows(&self, authorization: Option<&[u8]>) -> bool {
        let Some(set) = &self.0 else {
            return true;
        };
        let Some(presented) = authorization.and_then(|h| h.strip_prefix(b"Bearer ")) else {
            return false;
        };
        let set = set.read().unwrap_or_else(PoisonError::into_inner);
        let mut allowed = Choice::from(0);
        for expected in set.tokens() {
            allowed |= presented.ct_eq(expected);
        }
        allowed.into()
    }
}

/// Middleware answering 401 unless the request carries the bearer token.
pub async fn require_token(
    req: ServiceRequest,
    next: Next<BoxBody>,
) -> Result<ServiceResponse<BoxBody>, Error> {
    // No token configured on the app denies every request (fails closed).
    let allowed = req
        .app_data::<web::Data<ApiToken>>()
        .is_some_and(|token| token.allows(req.headers().get(AUTHORIZATION).map(|h| h.as_bytes())));
    if allowed {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn set(tokens: &[&str]) -> TokenSet {
        let content = tokens.join("\n");
        TokenSet::from_file_content(content.as_bytes(), std::path::Path::new("t")).unwrap()
    }

    #[test]
    fn allows_table() {
        let token = ApiToken::new(set(&["s3cret-0123456789", "other-0123456789ab"]));
        let cases: [(Option<&[u8]>, bool); 8] = [
            (Some(b"Bearer s3cret-0123456789"), true),
            (Some(b"Bearer other-0123456789ab"), true),
            (Some(b"Bearer s3cret-01234567890"), false),
            (Some(b"Bearer s3cret-012345678"), false),
            (Some(b"bearer s3cret-0123456789"), false),
            (Some(b"s3cret-0123456789"), false),
            (Some(b"Bearer "), false),
            (None, false),
        ];
        for (header, expected) in cases {
            assert_eq!(token.allows(header), expected, "{header:?}");
        }
    }

    #[test]
    fn replace_applies_to_every_clone() {
        let token = ApiToken::new(set(&["old-token-0123456789"]));
        let served = token.clone();
        token.replace(set(&["new-token-0123456789"]));
        assert!(!served.allows(Some(b"Bearer old-token-0123456789")));
        assert!(served.allows(Some(b"Bearer new-token-0123456789")));
    }

    #[test]
    fn only_an_explicitly_open_api_is_open() {
        let open = ApiToken::open();
        assert!(!open.is_required());
        assert!(open.allows(None));
        assert_eq!(format!("{open:?}"), "ApiToken(\"open\")");
        let token = ApiToken::new(set(&["0123456789abcdef"]));
        assert!(token.is_required());
        assert_eq!(format!("{token:?}"), "ApiToken(\"set\")");
    }
}
