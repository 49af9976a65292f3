//! The options a crawler gives in the user part of its proxy URL, e.g.
//! `http://crawler;session=s1;geo=eu:TOKEN@gateway:8888`: a free-text name, then `;key=value`
//! pairs. `session` names a sticky session and `sessionTTL` its idle lifetime; every other pair
//! is a selector label. Clients have already percent-decoded the URL's userinfo before they
//! send it in `Proxy-Authorization`, so it is read as it comes, never decoded again.

use std::collections::BTreeMap;
use std::time::Duration;

/// Longest session name accepted, in bytes.
pub const MAX_SESSION_LEN: usize = 128;
/// Shortest `sessionTTL` accepted: the idle sweep (every quarter second) must find an idle
/// session well before its lease (`1.5 T`) runs out.
pub const MIN_SESSION_TTL: Duration = Duration::from_secs(1);
/// Longest `sessionTTL` accepted.
pub const MAX_SESSION_TTL: Duration = Duration::from_secs(24 * 3600);

/// What a crawler asked for.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Options {
    /// The crawler's name (may be empty): recorded with its leases and logged, never a metric
    /// label.
    pub client: String,
    /// The sticky session, if it names one.
    pub session: Option<String>,
    /// How long the session may stay idle before its lease is given back; `None`: the
    /// gateway's default.
    pub session_ttl: Option<Duration>,
    /// Labels the upstream proxy must carry.
    pub selector: BTreeMap<String, String>,
}

/// Reads the user part `user`; the error names what is wrong, for a `400` answer.
pub fn parse(user: &str) -> Result<Options, String> {
    let mut parts = user.split(';');
    let client = parts.next().unwrap_or_default();
    if !printable(client) {
        return Err(format!(
            "the crawler name {client:?} in front of the options must be printable ASCII"
        ));
    }
    let mut options = Options {
        client: client.to_owned(),
        ..Options::default()
    };
    let mut seen = BTreeMap::new();
    for part in parts {
        let Some((key, value)) = part.split_once('=') else {
            return Err(format!(
                "option {part:?} is not key=value (the user part is name;key=value;...)"
            ));
        };
        if key.is_empty() {
            return Err(format!("option {part:?} has an empty key"));
        }
        if !printable(key) || !printable(value) {
            return Err(format!("option {part:?} must be printable ASCII"));
        }
        if seen.insert(key, ()).is_some() {
            return Err(format!("option {key:?} is given twice"));
        }
        match key {
            "session" => {
                if value.is_empty() || value.len() > MAX_SESSION_LEN {
                    return Err(format!(
                        "session name {value:?} must be 1 to {MAX_SESSION_LEN} characters"
                    ));
                }
                options.session = Some(value.to_owned());
            }
            "sessionTTL" => {
                let ttl = humantime::parse_duration(value).map_err(|e| {
                    format!("sessionTTL {value:?} is not a duration (5m, 30s): {e}")
                })?;
                if !(MIN_SESSION_TTL..=MAX_SESSION_TTL).contains(&ttl) {
                    return Err(format!(
                        "sessionTTL {value:?} must be at least 1s and at most 24h"
                    ));
                }
                options.session_ttl = Some(ttl);
            }
            label => {
                options.selector.insert(label.to_owned(), value.to_owned());
            }
        }
    }
    if options.session_ttl.is_some() && options.session.is_none() {
        return Err("sessionTTL without session: name the session it is for".to_owned());
    }
    Ok(options)
}

/// Printable ASCII without spaces (what a URL's userinfo carries once decoded).
fn printable(text: &str) -> bool {
    text.bytes().all(|b| b.is_ascii_graphic())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::label_map as labels;

    #[test]
    fn the_user_part_is_a_name_then_options() {
        let cases = [
            (
                "crawler",
                Options {
                    client: "crawler".into(),
                    ..Options::default()
                },
            ),
            ("", Options::default()),
            (
                "crawler;session=s1;geo=eu",
                Options {
                    client: "crawler".into(),
                    session: Some("s1".into()),
                    selector: labels(&[("geo", "eu")]),
                    ..Options::default()
                },
            ),
            (
                "c;geo=eu;tier=a;session=x;sessionTTL=30s",
                Options {
                    client: "c".into(),
                    session: Some("x".into()),
                    session_ttl: Some(Duration::from_secs(30)),
                    selector: labels(&[("geo", "eu"), ("tier", "a")]),
                },
            ),
            (
                "c;env=",
                Options {
                    client: "c".into(),
                    selector: labels(&[("env", "")]),
                    ..Options::default()
                },
            ),
        ];
        for (user, want) in cases {
            assert_eq!(parse(user), Ok(want), "{user}");
        }
    }

    #[test]
    fn a_malformed_user_part_says_what_is_wrong() {
        let long = format!("c;session={}", "s".repeat(MAX_SESSION_LEN + 1));
        let cases = [
            ("c;geo", "is not key=value"),
            ("c;=eu", "empty key"),
            ("c;geo=eu;geo=us", "given twice"),
            ("c;session=", "must be 1 to 128"),
            (long.as_str(), "must be 1 to 128"),
            ("c;session=s;sessionTTL=soon", "not a duration"),
            ("c;session=s;sessionTTL=0s", "at least 1s"),
            ("c;session=s;sessionTTL=999ms", "at least 1s"),
            ("c;session=s;sessionTTL=2days", "at most 24h"),
            ("c;sessionTTL=5m", "without session"),
            ("c r;geo=eu", "printable ASCII"),
            ("c;geo=e u", "printable ASCII"),
            ("c;geo=é", "printable ASCII"),
        ];
        for (user, problem) in cases {
            let err = parse(user).unwrap_err();
            assert!(err.contains(problem), "{user}: {err}");
        }
    }
}
