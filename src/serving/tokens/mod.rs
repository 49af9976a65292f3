//! The tokens that grant access to the lease API and the crawler gateway: where they come from
//! (`DISCOVERY_TOKEN`, `--discovery-token-file`, re-read when it changes; `source`) and how a
//! presented token is checked. Start-up fails closed: no usable token stops the process unless
//! `--insecure-no-auth` is given.

mod source;

use std::sync::{Arc, PoisonError, RwLock};

use sha2::{Digest, Sha256};
use subtle::{Choice, ConstantTimeEq};

pub use source::{
    LoadedTokens, MIN_TOKEN_BYTES, TOKEN_ENV, TokenError, TokenSet, TokenSources, load, watch_file,
};

/// The tokens every API request and every gateway connection must present one of; open (no
/// check) only when built with [`ApiToken::open`] (`--insecure-no-auth`). Clones share the set, so [`ApiToken::replace`]
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

    /// The token an `Authorization` header value (`Bearer <token>`) presents, if it grants
    /// access (on an open API, the anonymous one whatever is sent).
    pub fn bearer(&self, authorization: Option<&[u8]>) -> Option<TokenId> {
        match (
            &self.0,
            authorization.and_then(|h| h.strip_prefix(b"Bearer ")),
        ) {
            (None, _) => Some(TokenId::of(b"")),
            (Some(_), None) => None,
            (Some(_), Some(presented)) => self.check(presented),
        }
    }

    /// Which valid token `presented` is, as a [`TokenId`] (`None`: none). Every valid token is
    /// compared, each in constant time, whatever the outcome of the others. On an open API
    /// every token (or none) is the same anonymous one.
    pub fn check(&self, presented: &[u8]) -> Option<TokenId> {
        let Some(set) = &self.0 else {
            return Some(TokenId::of(b""));
        };
        let set = set.read().unwrap_or_else(PoisonError::into_inner);
        let mut allowed = Choice::from(0);
        for expected in set.tokens() {
            allowed |= presented.ct_eq(expected);
        }
        bool::from(allowed).then(|| TokenId::of(presented))
    }
}

impl ApiToken {
    /// Runs `with` on the valid token whose identity is `id` (`None` when no valid token has
    /// it, or on an open API): what seals and opens a value only that token's holder could
    /// have made, such as the status page's sign-in cookie. A token rotated away unseals
    /// nothing any more.
    pub fn with_token<T>(&self, id: &TokenId, with: impl FnOnce(&[u8]) -> T) -> Option<T> {
        let set = self.0.as_ref()?;
        let set = set.read().unwrap_or_else(PoisonError::into_inner);
        let token = set
            .tokens()
            .iter()
            .find(|token| TokenId::of(token) == *id)?;
        Some(with(token))
    }
}

/// A token's identity, never the token: the first 16 bytes of its SHA-256, in hex. What keys
/// the gateway's sessions (one set of sessions per token), safe to keep and compare.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TokenId(String);

impl TokenId {
    /// The identity as written by [`TokenId::as_str`], if `text` is one (32 lowercase hex
    /// digits).
    pub fn parse(text: &str) -> Option<TokenId> {
        let valid =
            text.len() == 32 && text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
        valid.then(|| TokenId(text.to_owned()))
    }

    fn of(token: &[u8]) -> Self {
        let digest = Sha256::digest(token);
        TokenId(digest[..16].iter().map(|b| format!("{b:02x}")).collect())
    }

    /// The identity as text (32 hex digits).
    pub fn as_str(&self) -> &str {
        &self.0
    }
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
            assert_eq!(token.bearer(header).is_some(), expected, "{header:?}");
        }
    }

    #[test]
    fn replace_applies_to_every_clone() {
        let token = ApiToken::new(set(&["old-token-0123456789"]));
        let served = token.clone();
        token.replace(set(&["new-token-0123456789"]));
        assert!(
            served
                .bearer(Some(b"Bearer old-token-0123456789"))
                .is_none()
        );
        assert!(
            served
                .bearer(Some(b"Bearer new-token-0123456789"))
                .is_some()
        );
    }

    #[test]
    fn a_token_is_known_by_its_digest_never_by_itself() {
        let token = ApiToken::new(set(&["s3cret-0123456789", "other-0123456789ab"]));
        let one = token.check(b"s3cret-0123456789").unwrap();
        let other = token.check(b"other-0123456789ab").unwrap();
        assert_ne!(one, other);
        assert_eq!(token.check(b"s3cret-0123456789"), Some(one.clone()));
        assert_eq!(one.as_str().len(), 32);
        assert!(!one.as_str().contains("s3cret"));
        assert_eq!(token.check(b"s3cret-012345678"), None);
        assert_eq!(token.check(b""), None);
        assert!(ApiToken::open().check(b"anything").is_some());
    }

    #[test]
    fn only_an_explicitly_open_api_is_open() {
        let open = ApiToken::open();
        assert!(!open.is_required());
        assert!(open.bearer(None).is_some());
        assert_eq!(format!("{open:?}"), "ApiToken(\"open\")");
        let token = ApiToken::new(set(&["0123456789abcdef"]));
        assert!(token.is_required());
        assert_eq!(format!("{token:?}"), "ApiToken(\"set\")");
    }
}
