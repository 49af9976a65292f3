//! Rotating upstreams: a vendor endpoint (one `host:port`) whose exit is chosen by the
//! username, spelled from a template with the vendor session, the request's selector values and
//! the vendor's own fields. Every lease on such an endpoint is its own vendor session.
//!
//! A template is literal text with `{name}` fields: `{session}` (the vendor session id),
//! `{lifetime}` (`sessionMinutes`), `{username}` and `{password}` (from the credentials
//! Secret), and any other name, filled from the request's selector, else the Proxy's labels,
//! else `defaults`. A selector naming such a field matches the endpoint whatever its value (the
//! vendor picks the exit for it); a value from a request must be ASCII letters and digits, so a
//! crawler cannot spell another zone or customer into the username.

use std::collections::BTreeMap;

use kube::KubeSchema;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Default of `sessionMinutes`.
pub const DEFAULT_SESSION_MINUTES: i32 = 10;
/// Default of `maxSessions`.
pub const DEFAULT_MAX_SESSIONS: i32 = 1000;
/// Length of a vendor session id (lowercase letters and digits; vendors take 8 and more).
pub const SESSION_ID_LENGTH: usize = 8;

/// How an External proxy's username (and password) pick the vendor's exit.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Hash)]
#[x_kube(
    validation = Rule::new("self.usernameTemplate.contains('{session}') || (has(self.passwordTemplate) && self.passwordTemplate.contains('{session}'))")
        .message("usernameTemplate or passwordTemplate must contain {session}")
)]
#[schemars(transform = super::schema::strip_nullable)]
#[serde(rename_all = "camelCase")]
pub struct Rotating {
    /// The username sent to the vendor, e.g.
    /// `brd-customer-acme-zone-res-country-{geo}-session-{session}`.
    #[schemars(length(min = 1, max = 512))]
    pub username_template: String,
    /// The password sent to the vendor; default `{password}` (the Secret's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 512))]
    pub password_template: Option<String>,
    /// How long the vendor keeps a session's exit, in minutes: the value of `{lifetime}`.
    #[serde(default = "default_session_minutes")]
    #[schemars(range(min = 1, max = 1440))]
    pub session_minutes: i32,
    /// Values of template fields that neither the request's selector nor the Proxy's labels
    /// give.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub defaults: BTreeMap<String, String>,
    /// How many vendor sessions (leases) the endpoint carries at once; replaces `maxLeases`.
    #[serde(default = "default_max_sessions")]
    #[schemars(range(min = 1))]
    pub max_sessions: i32,
}

fn default_session_minutes() -> i32 {
    DEFAULT_SESSION_MINUTES
}

fn default_max_sessions() -> i32 {
    DEFAULT_MAX_SESSIONS
}

/// Why a vendor username could not be spelled.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FillError {
    /// A field has no value anywhere.
    #[error(
        "the vendor username needs a value for {{{0}}}: name it in the selector ({0}=...) or set rotating.defaults.{0}"
    )]
    Missing(String),
    /// A request's value is not ASCII letters and digits.
    #[error("the value of {0} must be ASCII letters and digits to go into a vendor username")]
    Unsafe(String),
}

/// One piece of a template.
enum Piece<'a> {
    Text(&'a str),
    Field(&'a str),
}

/// Whether `c` may be part of a field name (label keys: letters, digits, `_ - . /`).
fn name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | '/')
}

/// The pieces of `template`: `{name}` is a field; any other brace is text.
fn pieces(template: &str) -> Vec<Piece<'_>> {
    let mut out = Vec::new();
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        let after = &rest[open + 1..];
        let name_len = after.find(|c: char| !name_char(c)).unwrap_or(after.len());
        if name_len > 0 && after[name_len..].starts_with('}') {
            if open > 0 {
                out.push(Piece::Text(&rest[..open]));
            }
            out.push(Piece::Field(&after[..name_len]));
            rest = &after[name_len + 1..];
        } else {
            out.push(Piece::Text(&rest[..=open]));
            rest = after;
        }
    }
    if !rest.is_empty() {
        out.push(Piece::Text(rest));
    }
    out
}

/// Fields every template may use that no selector fills.
const RESERVED: [&str; 4] = ["session", "lifetime", "username", "password"];

/// What fills a template for one lease.
pub struct Fill<'a> {
    /// The vendor session id.
    pub session: &'a str,
    /// The request's selector pairs.
    pub selector: &'a BTreeMap<String, String>,
    /// The Proxy's labels.
    pub labels: Option<&'a BTreeMap<String, String>>,
    /// The credentials Secret's `(username, password)`, if it names one.
    pub secret: Option<(&'a str, &'a str)>,
}

impl Rotating {
    /// The fields its templates fill from a selector (the reserved ones excluded): a selector
    /// naming one matches the endpoint whatever the value.
    pub fn selector_fields(&self) -> Vec<String> {
        let mut names: Vec<String> = [
            Some(&self.username_template),
            self.password_template.as_ref(),
        ]
        .into_iter()
        .flatten()
        .flat_map(|t| pieces(t))
        .filter_map(|piece| match piece {
            Piece::Field(name) if !RESERVED.contains(&name) => Some(name.to_owned()),
            _ => None,
        })
        .collect();
        names.sort();
        names.dedup();
        names
    }

    /// The `(username, password)` for one vendor session.
    pub fn credentials(&self, fill: &Fill<'_>) -> Result<(String, String), FillError> {
        let password_template = self.password_template.as_deref().unwrap_or("{password}");
        Ok((
            self.spell(&self.username_template, fill)?,
            self.spell(password_template, fill)?,
        ))
    }

    fn spell(&self, template: &str, fill: &Fill<'_>) -> Result<String, FillError> {
        let mut out = String::with_capacity(template.len() + 16);
        for piece in pieces(template) {
            match piece {
                Piece::Text(text) => out.push_str(text),
                Piece::Field("session") => out.push_str(fill.session),
                Piece::Field("lifetime") => out.push_str(&self.session_minutes.to_string()),
                Piece::Field("username") => out.push_str(fill.secret.map_or("", |s| s.0)),
                Piece::Field("password") => out.push_str(fill.secret.map_or("", |s| s.1)),
                Piece::Field(name) => out.push_str(self.value(name, fill)?),
            }
        }
        Ok(out)
    }

    /// A field's value: the request's (checked), else the Proxy's label, else the default.
    fn value<'a>(&'a self, name: &str, fill: &'a Fill<'_>) -> Result<&'a str, FillError> {
        if let Some(value) = fill.selector.get(name) {
            if value.is_empty() || !value.bytes().all(|b| b.is_ascii_alphanumeric()) {
                return Err(FillError::Unsafe(name.to_owned()));
            }
            return Ok(value);
        }
        fill.labels
            .and_then(|labels| labels.get(name))
            .or_else(|| self.defaults.get(name))
            .map(String::as_str)
            .ok_or_else(|| FillError::Missing(name.to_owned()))
    }
}

/// The vendor session id of a lease on the endpoint of the Proxy with UID `uid`: derived from
/// `seed` (a gateway session's request ID, stable across restarts; else the lease's ID), so
/// the same seed always spells the same exit and another seed another one.
pub fn vendor_session(uid: &str, seed: &str) -> String {
    let digest = Sha256::new()
        .chain_update(uid.as_bytes())
        .chain_update([0])
        .chain_update(seed.as_bytes())
        .finalize();
    let encoded = base32::encode(base32::Alphabet::Rfc4648 { padding: false }, &digest);
    encoded[..SESSION_ID_LENGTH].to_ascii_lowercase()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rotating(username: &str, password: Option<&str>) -> Rotating {
        Rotating {
            username_template: username.to_owned(),
            password_template: password.map(str::to_owned),
            session_minutes: 10,
            defaults: BTreeMap::from([("geo".to_owned(), "us".to_owned())]),
            max_sessions: 100,
        }
    }

    fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn templates_are_spelled_from_the_session_the_request_the_labels_and_the_defaults() {
        let labels = map(&[("zone", "res"), ("geo", "fr")]);
        /// Username and password templates, the request's selector, whether the Proxy's labels
        /// are there, and what is spelled.
        type Case<'a> = (
            &'a str,
            Option<&'a str>,
            &'a [(&'a str, &'a str)],
            bool,
            Result<(&'a str, &'a str), FillError>,
        );
        let cases: [Case<'_>; 7] = [
            (
                "brd-customer-{username}-zone-{zone}-country-{geo}-session-{session}",
                None,
                &[("geo", "de")],
                true,
                Ok((
                    "brd-customer-acme-zone-res-country-de-session-abcd2345",
                    "pw",
                )),
            ),
            (
                "customer-{username}-cc-{geo}-sessid-{session}-sesstime-{lifetime}",
                None,
                &[],
                true,
                Ok(("customer-acme-cc-fr-sessid-abcd2345-sesstime-10", "pw")),
            ),
            (
                "{username}",
                Some("{password}_country-{geo}_session-{session}_lifetime-{lifetime}m"),
                &[],
                false,
                Ok(("acme", "pw_country-us_session-abcd2345_lifetime-10m")),
            ),
            (
                "user-{username}-{nope-session-{session}",
                None,
                &[],
                false,
                Ok(("user-acme-{nope-session-abcd2345", "pw")),
            ),
            (
                "u-{city}-{session}",
                None,
                &[],
                false,
                Err(FillError::Missing("city".to_owned())),
            ),
            (
                "u-{geo}-{session}",
                None,
                &[("geo", "us-zone-premium")],
                false,
                Err(FillError::Unsafe("geo".to_owned())),
            ),
            (
                "u-{geo}-{session}",
                None,
                &[("geo", "")],
                false,
                Err(FillError::Unsafe("geo".to_owned())),
            ),
        ];
        for (username, password, selector, with_labels, expected) in cases {
            let selector = map(selector);
            let fill = Fill {
                session: "abcd2345",
                selector: &selector,
                labels: with_labels.then_some(&labels),
                secret: Some(("acme", "pw")),
            };
            let got = rotating(username, password).credentials(&fill);
            let expected = expected.map(|(u, p)| (u.to_owned(), p.to_owned()));
            assert_eq!(got, expected, "{username}");
        }
    }

    #[test]
    fn selector_fields_are_the_templates_own_names() {
        let r = rotating(
            "a-{zone}-{geo}-{session}-{lifetime}",
            Some("{password}-{geo}-{city}"),
        );
        assert_eq!(r.selector_fields(), ["city", "geo", "zone"]);
    }

    #[test]
    fn vendor_sessions_are_stable_per_seed_and_differ_between_seeds() {
        let a = vendor_session("uid-1", "seed-a");
        assert_eq!(a, vendor_session("uid-1", "seed-a"));
        assert_eq!(a.len(), SESSION_ID_LENGTH);
        assert!(
            a.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        );
        assert_ne!(a, vendor_session("uid-1", "seed-b"));
        assert_ne!(a, vendor_session("uid-2", "seed-a"));
    }
}
