//! Who a gateway request comes from: `Proxy-Authorization: Basic` whose password is an API
//! token (the same tokens as the lease API, rotation and tenants included) and whose user part
//! carries the request's options (see [`super::user`]).

use base64::Engine;
use base64::engine::general_purpose::STANDARD;

use crate::serving::tokens::ApiToken;
use crate::serving::tokens::Caller;

/// The caller a request's token makes and the user part it came with.
#[derive(Debug, Clone, PartialEq)]
pub struct Credentials {
    /// The token's identity and tenant.
    pub caller: Caller,
    /// The user part, as sent.
    pub user: String,
}

/// The caller of a request whose `Proxy-Authorization` header is `header`, or `None` when it
/// presents no valid token (the gateway answers 407). An open gateway (`--insecure-no-auth`)
/// takes a request without the header as the anonymous caller with no options.
pub fn caller(tokens: &ApiToken, header: Option<&[u8]>) -> Option<Credentials> {
    let Some(header) = header else {
        return tokens
            .check(b"")
            .filter(|_| !tokens.is_required())
            .map(|caller| Credentials {
                caller,
                user: String::new(),
            });
    };
    let encoded = header
        .strip_prefix(b"Basic ")
        .or_else(|| header.strip_prefix(b"basic "))?;
    let decoded = STANDARD.decode(encoded.trim_ascii()).ok()?;
    let colon = decoded.iter().position(|&b| b == b':')?;
    let (user, password) = (&decoded[..colon], &decoded[colon + 1..]);
    let caller = tokens.check(password)?;
    let user = String::from_utf8(user.to_vec()).ok()?;
    Some(Credentials { caller, user })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serving::tokens::TokenSet;

    const TOKEN: &str = "gateway-token-0123456789";

    fn basic(pair: &str) -> Vec<u8> {
        format!("Basic {}", STANDARD.encode(pair)).into_bytes()
    }

    #[test]
    fn the_password_is_the_token_and_the_user_part_is_kept_as_sent() {
        let tokens = ApiToken::new(TokenSet::single(TOKEN.as_bytes(), "t").unwrap());
        let ok = caller(
            &tokens,
            Some(&basic(&format!("crawler;session=s1;geo=eu:{TOKEN}"))),
        )
        .unwrap();
        assert_eq!(ok.user, "crawler;session=s1;geo=eu");
        assert_eq!(Some(ok.caller), tokens.check(TOKEN.as_bytes()));
        // Only the first colon splits: a token may hold none, but the rest is the password.
        assert!(caller(&tokens, Some(&basic(&format!("a:{TOKEN}:x")))).is_none());
        for refused in [
            None,
            Some(basic("crawler:wrong-token-0123456789")),
            Some(basic("no-colon")),
            Some(format!("Bearer {TOKEN}").into_bytes()),
            Some(b"Basic !!!".to_vec()),
        ] {
            assert!(caller(&tokens, refused.as_deref()).is_none(), "{refused:?}");
        }
        let open = ApiToken::open();
        assert_eq!(caller(&open, None).map(|c| c.user), Some(String::new()));
        assert_eq!(
            caller(&open, Some(&basic("c;geo=eu:anything"))).map(|c| c.user),
            Some("c;geo=eu".to_owned())
        );
    }
}
