//! The tokens that grant access to the lease API and the crawler gateway: where they come from
//! (`DISCOVERY_TOKEN`, `--discovery-token-file`, re-read when it changes; `source`) and how a
//! presented token is checked. Start-up fails closed: no usable token stops the process unless
//! `--insecure-no-auth` is given.

mod source;

use std::sync::{Arc, PoisonError, RwLock};

use sha2::{Digest, Sha256};
use subtle::{Choice, ConditionallySelectable, ConstantTimeEq};

pub use source::{
    LoadedTokens, MIN_TOKEN_BYTES, TOKEN_ENV, TokenError, TokenSet, TokenSources, load, watch_file,
};

use super::tenants::Tenant;
pub use super::tenants::TokenDigest;

/// Who made a request: the token it presented (its identity, never the token) and the tenant
/// that token belongs to.
#[derive(Debug, Clone, PartialEq)]
pub struct Caller {
    /// The token's identity: a crawler's gateway sessions are its token's.
    pub token: TokenId,
    /// The token's tenant.
    pub tenant: Arc<Tenant>,
}

impl Caller {
    /// The tenant's name.
    pub fn tenant_name(&self) -> &str {
        &self.tenant.name
    }
}

/// The SHA-256 of `token`.
pub fn digest(token: &[u8]) -> TokenDigest {
    Sha256::digest(token).into()
}

/// The tokens every API request and every gateway connection must present one of, each with
/// its tenant; open (no check) only when built with [`ApiToken::open`] (`--insecure-no-auth`).
/// Clones share the set, so [`ApiToken::replace`] (a re-read token file) and
/// [`ApiToken::replace_tenants`] (a re-read tenants file) apply to the running server.
#[derive(Clone)]
pub struct ApiToken(Option<Arc<RwLock<Access>>>);

/// The valid tokens, as digests.
#[derive(Debug, Default)]
struct Access {
    /// The tokens of `DISCOVERY_TOKEN` and the token file: the default tenant's.
    plain: Vec<TokenDigest>,
    /// The tenants file's tokens, each with its tenant.
    tenants: Vec<(TokenDigest, Arc<Tenant>)>,
    /// The default tenant, shared by every plain token.
    default: Option<Arc<Tenant>>,
}

impl Access {
    fn default_tenant(&mut self) -> Arc<Tenant> {
        self.default
            .get_or_insert_with(Tenant::unrestricted)
            .clone()
    }

    /// Every valid digest with its tenant.
    fn entries(&self) -> impl Iterator<Item = (&TokenDigest, Option<&Arc<Tenant>>)> {
        self.plain
            .iter()
            .map(|d| (d, self.default.as_ref()))
            .chain(self.tenants.iter().map(|(d, t)| (d, Some(t))))
    }
}

impl std::fmt::Debug for ApiToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = if self.0.is_some() { "set" } else { "open" };
        f.debug_tuple("ApiToken").field(&state).finish()
    }
}

impl ApiToken {
    /// Requests must present one of `tokens` (the default tenant's).
    pub fn new(tokens: TokenSet) -> Self {
        let token = ApiToken(Some(Arc::default()));
        token.replace(tokens);
        token
    }

    /// Requests must present one of the tenants' tokens (and no plain token is valid).
    pub fn of_tenants(tenants: Vec<(TokenDigest, Arc<Tenant>)>) -> Self {
        let token = ApiToken(Some(Arc::default()));
        token.replace_tenants(tenants);
        token
    }

    /// No authentication at all (`--insecure-no-auth`).
    pub fn open() -> Self {
        ApiToken(None)
    }

    /// Whether requests must authenticate.
    pub fn is_required(&self) -> bool {
        self.0.is_some()
    }

    fn access(&self) -> Option<std::sync::RwLockReadGuard<'_, Access>> {
        Some(
            self.0
                .as_ref()?
                .read()
                .unwrap_or_else(PoisonError::into_inner),
        )
    }

    /// Makes `tokens` the default tenant's valid set (no effect on an open API).
    pub fn replace(&self, tokens: TokenSet) {
        if let Some(access) = &self.0 {
            let mut access = access.write().unwrap_or_else(PoisonError::into_inner);
            access.default_tenant();
            access.plain = tokens.tokens().iter().map(|t| digest(t)).collect();
        }
    }

    /// Makes `tenants` the tenants file's tokens (no effect on an open API).
    pub fn replace_tenants(&self, tenants: Vec<(TokenDigest, Arc<Tenant>)>) {
        if let Some(access) = &self.0 {
            access
                .write()
                .unwrap_or_else(PoisonError::into_inner)
                .tenants = tenants;
        }
    }

    /// The caller an `Authorization` header value (`Bearer <token>`) presents, if its token
    /// grants access (on an open API, the anonymous caller of the default tenant whatever is
    /// sent).
    pub fn bearer(&self, authorization: Option<&[u8]>) -> Option<Caller> {
        match (
            &self.0,
            authorization.and_then(|h| h.strip_prefix(b"Bearer ")),
        ) {
            (None, _) => Some(anonymous()),
            (Some(_), None) => None,
            (Some(_), Some(presented)) => self.check(presented),
        }
    }

    /// Which caller `presented` makes (`None`: no valid token). Every valid digest is
    /// compared, each in constant time, whatever the outcome of the others. On an open API
    /// every token (or none) is the same anonymous caller.
    pub fn check(&self, presented: &[u8]) -> Option<Caller> {
        let Some(access) = self.access() else {
            return Some(anonymous());
        };
        let presented = digest(presented);
        let mut found = Choice::from(0);
        let mut position = 0u32;
        for (index, (expected, _)) in access.entries().enumerate() {
            let equal = presented.ct_eq(expected);
            position.conditional_assign(&u32::try_from(index).unwrap_or(u32::MAX), equal);
            found |= equal;
        }
        if !bool::from(found) {
            return None;
        }
        let (_, tenant) = access.entries().nth(usize::try_from(position).ok()?)?;
        Some(Caller {
            token: TokenId::of_digest(&presented),
            tenant: tenant?.clone(),
        })
    }

    /// Every tenant with a valid token, each once, in the order of their tokens: the default
    /// tenant first when plain tokens are valid. An open API has only the default tenant.
    pub fn tenants(&self) -> Vec<Arc<Tenant>> {
        let Some(access) = self.access() else {
            return vec![Tenant::unrestricted()];
        };
        let mut tenants: Vec<Arc<Tenant>> = Vec::new();
        for (_, tenant) in access.entries() {
            if let Some(tenant) = tenant
                && !tenants.iter().any(|t| t.name == tenant.name)
            {
                tenants.push(tenant.clone());
            }
        }
        tenants
    }

    /// The caller whose token has the identity `id`, while that token is valid (`None` on an
    /// open API): who a status-page session is.
    pub fn caller(&self, id: &TokenId) -> Option<Caller> {
        let access = self.access()?;
        let (_, tenant) = access
            .entries()
            .find(|(digest, _)| TokenId::of_digest(digest) == *id)?;
        Some(Caller {
            token: id.clone(),
            tenant: tenant?.clone(),
        })
    }

    /// Runs `with` on the digest of the valid token whose identity is `id` (`None` when no
    /// valid token has it, or on an open API): what seals and opens a value only that token's
    /// holder (or a reader of its digest) could have made, such as the status page's sign-in
    /// cookie. A token rotated away unseals nothing any more.
    pub fn with_token<T>(&self, id: &TokenId, with: impl FnOnce(&[u8]) -> T) -> Option<T> {
        let access = self.access()?;
        let (digest, _) = access
            .entries()
            .find(|(digest, _)| TokenId::of_digest(digest) == *id)?;
        Some(with(digest))
    }
}

/// The caller of an open API (`--insecure-no-auth`): no token, the default tenant.
fn anonymous() -> Caller {
    Caller {
        token: TokenId::of_digest(&digest(b"")),
        tenant: Tenant::unrestricted(),
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

    fn of_digest(digest: &TokenDigest) -> Self {
        TokenId(hex::encode(&digest[..16]))
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
        let one = token.check(b"s3cret-0123456789").unwrap().token;
        let other = token.check(b"other-0123456789ab").unwrap().token;
        assert_ne!(one, other);
        assert_eq!(
            token.check(b"s3cret-0123456789").map(|c| c.token),
            Some(one.clone())
        );
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

    #[test]
    fn a_tenants_token_makes_a_caller_of_that_tenant_and_a_plain_one_of_the_default() {
        let team = Arc::new(Tenant {
            name: "team-a".into(),
            ..Tenant::clone(&Tenant::unrestricted())
        });
        let token = ApiToken::new(set(&["plain-token-0123456789"]));
        token.replace_tenants(vec![(digest(b"team-a-token-0123456789"), team.clone())]);
        let plain = token.check(b"plain-token-0123456789").unwrap();
        assert_eq!(plain.tenant_name(), "default");
        let caller = token.check(b"team-a-token-0123456789").unwrap();
        assert_eq!(caller.tenant, team);
        assert_eq!(token.caller(&caller.token), Some(caller.clone()));
        // Rotated away: the token, its identity and its cookie key are gone.
        token.replace_tenants(Vec::new());
        assert!(token.check(b"team-a-token-0123456789").is_none());
        assert!(token.caller(&caller.token).is_none());
        assert!(token.with_token(&caller.token, |_| ()).is_none());
        let only_tenants = ApiToken::of_tenants(vec![(digest(b"team-a-token-0123456789"), team)]);
        assert!(only_tenants.check(b"plain-token-0123456789").is_none());
        assert!(only_tenants.check(b"team-a-token-0123456789").is_some());
    }
}
