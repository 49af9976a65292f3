//! The options a crawler gives in the user part of its proxy URL, e.g.
//! `http://crawler;session=s1;geo=eu:TOKEN@gateway:8888`: a free-text name, then `;key=value`
//! pairs. `session` names a sticky session, `sessionTTL` its idle lifetime and `tls=inspect`
//! asks the gateway to intercept a CONNECT's TLS; every other pair is a selector label. Clients have already percent-decoded the URL's userinfo before they
//! send it in `Proxy-Authorization`, so it is read as it comes, never decoded again.

use std::collections::BTreeMap;
use std::time::Duration;

/// Longest session name accepted, in bytes.
pub const MAX_SESSION_LEN: usize = 128;
/// Longest fallback chain name (a rule name's length in the rules file).
const MAX_CHAIN_NAME_LEN: usize = 63;
/// Longest crawler name accepted, in bytes: it is written with every lease and its history.
pub const MAX_CLIENT_LEN: usize = 128;
/// Longest user part accepted, in bytes (name, session and labels together).
pub const MAX_USER_LEN: usize = 1024;
/// Longest selector key: a Kubernetes label key (a 253-byte prefix, `/`, a 63-byte name).
const MAX_LABEL_KEY_LEN: usize = 317;
/// Longest selector value: a Kubernetes label value.
const MAX_LABEL_VALUE_LEN: usize = 63;
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
    /// `tls=inspect`: the gateway takes the CONNECT's TLS and sees the requests inside.
    pub inspect: bool,
    /// Labels the upstream proxy must carry.
    pub selector: BTreeMap<String, String>,
    /// `fallback=NAME`: the fallback chain of the rules file its acquires walk.
    pub fallback: Option<String>,
}

/// Reads the user part `user`; the error names what is wrong, for a `400` answer.
pub fn parse(user: &str) -> Result<Options, String> {
    if user.len() > MAX_USER_LEN {
        return Err(format!(
            "the user part of the proxy URL is {} bytes; at most {MAX_USER_LEN}",
            user.len()
        ));
    }
    let mut parts = user.split(';');
    let client = parts.next().unwrap_or_default();
    if !printable(client) {
        return Err(format!(
            "the crawler name {client:?} in front of the options must be printable ASCII"
        ));
    }
    if client.len() > MAX_CLIENT_LEN {
        return Err(format!(
            "the crawler name in front of the options is {} bytes; at most {MAX_CLIENT_LEN}",
            client.len()
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
            "tls" => {
                options.inspect = match value {
                    "inspect" => true,
                    "tunnel" => false,
                    _ => {
                        return Err(format!(
                            "tls {value:?} is neither `inspect` (the gateway intercepts) nor \
                             `tunnel` (a byte tunnel, the default)"
                        ));
                    }
                };
            }
            "fallback" => {
                if value.is_empty() || value.len() > MAX_CHAIN_NAME_LEN {
                    return Err(format!(
                        "fallback {value:?} must name a chain of --gateway-rules-file (1 to \
                         {MAX_CHAIN_NAME_LEN} characters)"
                    ));
                }
                options.fallback = Some(value.to_owned());
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
                if label.len() > MAX_LABEL_KEY_LEN || value.len() > MAX_LABEL_VALUE_LEN {
                    return Err(format!(
                        "label {:?}: a key is at most {MAX_LABEL_KEY_LEN} bytes and a value at \
                         most {MAX_LABEL_VALUE_LEN}, as in Kubernetes labels",
                        truncated(label)
                    ));
                }
                options.selector.insert(label.to_owned(), value.to_owned());
            }
        }
    }
    if options.session_ttl.is_some() && options.session.is_none() {
        return Err("sessionTTL without session: name the session it is for".to_owned());
    }
    Ok(options)
}

/// The first bytes of a long text, for a message that names it.
fn truncated(text: &str) -> String {
    match text.get(..32) {
        Some(head) if text.len() > 32 => format!("{head}..."),
        _ => text.to_owned(),
    }
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
                    ..Options::default()
                },
            ),
            (
                "c;tls=inspect;geo=eu",
                Options {
                    client: "c".into(),
                    inspect: true,
                    selector: labels(&[("geo", "eu")]),
                    ..Options::default()
                },
            ),
            (
                "c;tls=tunnel",
                Options {
                    client: "c".into(),
                    ..Options::default()
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
        let longest = format!("{};geo={}", "c".repeat(MAX_CLIENT_LEN), "e".repeat(63));
        assert!(parse(&longest).is_ok());
    }

    #[test]
    fn a_malformed_user_part_says_what_is_wrong() {
        let long = format!("c;session={}", "s".repeat(MAX_SESSION_LEN + 1));
        let long_name = format!("{};geo=eu", "c".repeat(MAX_CLIENT_LEN + 1));
        let long_user = format!("c;geo={}", "e".repeat(MAX_USER_LEN));
        let long_value = format!("c;geo={}", "e".repeat(64));
        let long_key = format!("c;{}=eu", "k".repeat(318));
        let cases = [
            (
                long_name.as_str(),
                "crawler name in front of the options is 129 bytes; at most 128",
            ),
            (
                long_user.as_str(),
                "user part of the proxy URL is 1030 bytes; at most 1024",
            ),
            (long_value.as_str(), "label \"geo\": a key is at most"),
            (
                long_key.as_str(),
                "label \"kkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkk...\"",
            ),
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
            ("c;tls=mitm", "neither `inspect`"),
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
