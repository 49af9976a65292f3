//! The status page's sign-in: a person exchanges an API token for a session cookie, so the
//! token is typed once and never sits in a URL, the page or the browser's storage.
//!
//! The cookie holds no state of its own to share: it is `<expiry ms>.<token identity>.<mac>`,
//! the MAC an HMAC-SHA256 of the first two keyed by the token's SHA-256 (all the process keeps
//! of a token; a tenants file lists only that). Every replica holds the same tokens, so every
//! replica opens it; a token rotated away (the token or tenants file re-read) opens nothing
//! any more, which ends its sessions at once; and nobody without the token (or its digest)
//! can make one. The identity is a digest prefix ([`TokenId`]), not usable as a token.

use std::time::Duration;

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

use crate::serving::tokens::{ApiToken, TokenId};

/// The cookie's name.
pub const COOKIE: &str = "proxy_operator_session";

/// How long a sign-in lasts.
pub const SESSION_TTL: Duration = Duration::from_secs(8 * 3600);

/// What the MAC covers besides the value, so a MAC made for anything else never opens.
const CONTEXT: &[u8] = b"proxy-operator status session v1\n";

/// The cookie value for a sign-in with the token `id` names at `now_ms`, expiring
/// [`SESSION_TTL`] later; `None` when `id` is no valid token (or the API is open).
pub fn seal(token: &ApiToken, id: &TokenId, now_ms: i64) -> Option<String> {
    let payload = format!("{}.{}", now_ms.saturating_add(ttl_ms()), id.as_str());
    let mac = token.with_token(id, |key| mac(key, &payload))??;
    Some(format!("{payload}.{}", hex::encode(&mac)))
}

/// The token a cookie value was sealed for, while it has not expired at `now_ms` and that
/// token is still valid; `None` for anything else (malformed, forged, expired, rotated away,
/// or expiring later than a sign-in made now would, give or take [`CLOCK_SKEW`] between
/// replicas: no cookie outlives [`SESSION_TTL`], whoever sealed it).
pub fn open(token: &ApiToken, value: &str, now_ms: i64) -> Option<TokenId> {
    let (payload, presented) = value.rsplit_once('.')?;
    let (expiry, id) = payload.split_once('.')?;
    let expiry: i64 = expiry.parse().ok()?;
    let id = TokenId::parse(id)?;
    let latest = now_ms.saturating_add(ttl_ms()).saturating_add(skew_ms());
    if expiry <= now_ms || expiry > latest {
        return None;
    }
    let presented = hex::decode(presented).ok()?;
    let verified = token.with_token(&id, |key| {
        let mut check = keyed(key)?;
        check.update(CONTEXT);
        check.update(payload.as_bytes());
        // Constant time, in the hmac crate.
        Some(check.verify_slice(&presented).is_ok())
    })??;
    verified.then_some(id)
}

/// How far apart the clocks of two replicas may be: a cookie one sealed opens at another whose
/// clock is behind by up to this much.
pub const CLOCK_SKEW: Duration = Duration::from_secs(300);

fn skew_ms() -> i64 {
    i64::try_from(CLOCK_SKEW.as_millis()).unwrap_or(i64::MAX)
}

/// [`SESSION_TTL`] in milliseconds.
fn ttl_ms() -> i64 {
    i64::try_from(SESSION_TTL.as_millis()).unwrap_or(i64::MAX)
}

fn keyed(key: &[u8]) -> Option<Hmac<Sha256>> {
    Hmac::<Sha256>::new_from_slice(key).ok()
}

fn mac(key: &[u8], payload: &str) -> Option<Vec<u8>> {
    let mut mac = keyed(key)?;
    mac.update(CONTEXT);
    mac.update(payload.as_bytes());
    Some(mac.finalize().into_bytes().to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serving::tokens::TokenSet;

    fn tokens(list: &[&str]) -> TokenSet {
        TokenSet::from_file_content(list.join("\n").as_bytes(), std::path::Path::new("t")).unwrap()
    }

    const A: &str = "first-token-0123456789";
    const B: &str = "second-token-0123456789";

    fn id_of(token: &ApiToken, text: &str) -> TokenId {
        token.check(text.as_bytes()).unwrap().token
    }

    #[test]
    fn a_sealed_cookie_opens_until_it_expires() {
        let token = ApiToken::new(tokens(&[A, B]));
        let id = id_of(&token, A);
        let cookie = seal(&token, &id, 1_000).unwrap();
        let ttl = SESSION_TTL.as_millis() as i64;
        let cases = [
            (1_000, true),
            (1_000 + ttl - 1, true),
            (1_000 + ttl, false),
            (1_000 + ttl + 1, false),
        ];
        for (now, opens) in cases {
            assert_eq!(
                open(&token, &cookie, now),
                opens.then(|| id.clone()),
                "{now}"
            );
        }
        assert!(!cookie.contains(A), "the token is not in the cookie");
    }

    #[test]
    fn a_cookie_expiring_later_than_a_sign_in_made_now_is_refused() {
        let token = ApiToken::new(tokens(&[A]));
        let id = id_of(&token, A);
        let ttl = SESSION_TTL.as_millis() as i64;
        // Sealed with the token's own key, as only a holder of the token could: an hour
        // "from the future" is an expiry no sign-in made now would have.
        let hour = 3_600_000;
        let far = seal(&token, &id, 1_000 + hour).unwrap();
        assert_eq!(open(&token, &far, 1_000), None);
        assert_eq!(open(&token, &far, 1_000 + hour), Some(id.clone()));
        // Another replica's clock a little ahead is no reason to sign out.
        let skew = CLOCK_SKEW.as_millis() as i64;
        let ahead = seal(&token, &id, 1_000 + skew).unwrap();
        assert_eq!(open(&token, &ahead, 1_000), Some(id.clone()));
        let too_far = seal(&token, &id, 1_001 + skew).unwrap();
        assert_eq!(open(&token, &too_far, 1_000), None);
        let ten_years = seal(&token, &id, 10 * 365 * 24 * hour).unwrap();
        assert_eq!(open(&token, &ten_years, 1_000), None);
        let now = seal(&token, &id, 1_000).unwrap();
        assert_eq!(open(&token, &now, 1_000 + ttl - 1), Some(id));
    }

    #[test]
    fn anything_but_the_sealed_value_is_refused() {
        let token = ApiToken::new(tokens(&[A, B]));
        let a = id_of(&token, A);
        let b = id_of(&token, B);
        let cookie = seal(&token, &a, 0).unwrap();
        let (payload, mac) = cookie.rsplit_once('.').unwrap();
        let (expiry, _) = payload.split_once('.').unwrap();
        let longer: i64 = expiry.parse::<i64>().unwrap() + 1;
        let forged = [
            String::new(),
            "garbage".to_owned(),
            format!("{payload}."),
            format!("{payload}.{}", "0".repeat(64)),
            // Another token's identity with A's MAC.
            format!("{expiry}.{}.{mac}", b.as_str()),
            // A longer expiry with the MAC of the shorter one.
            format!("{longer}.{}.{mac}", a.as_str()),
            format!("{cookie}0"),
            cookie.to_uppercase(),
        ];
        for value in forged {
            assert_eq!(open(&token, &value, 1), None, "{value}");
        }
    }

    #[test]
    fn a_token_rotated_away_ends_its_sessions() {
        let token = ApiToken::new(tokens(&[A, B]));
        let a = id_of(&token, A);
        let b = id_of(&token, B);
        let with_a = seal(&token, &a, 0).unwrap();
        let with_b = seal(&token, &b, 0).unwrap();
        token.replace(tokens(&[B]));
        assert_eq!(open(&token, &with_a, 1), None);
        assert_eq!(open(&token, &with_b, 1), Some(b));
        assert_eq!(
            seal(&token, &a, 1),
            None,
            "no new session for a removed token"
        );
    }

    #[test]
    fn every_replica_opens_the_same_cookie() {
        let here = ApiToken::new(tokens(&[A]));
        let there = ApiToken::new(tokens(&[A]));
        let cookie = seal(&here, &id_of(&here, A), 0).unwrap();
        assert_eq!(open(&there, &cookie, 1), Some(id_of(&there, A)));
    }

    #[test]
    fn an_open_api_seals_nothing() {
        let token = ApiToken::open();
        let id = token.check(b"").unwrap().token;
        assert_eq!(seal(&token, &id, 0), None);
    }
}
