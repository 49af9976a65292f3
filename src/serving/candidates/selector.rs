//! Label selectors crawlers filter proxies with: `geo=eu,tier=a` in a query string, or a JSON
//! object `{"geo":"eu","tier":"a"}` in a lease request. Every pair must match (equality only).

use std::collections::BTreeMap;

/// The characters trimmed around terms, keys and values: ASCII whitespace
/// ([`u8::is_ascii_whitespace`]), spelled for a regular-expression class.
const BLANK: &str = r"\t\n\f\r ";

/// The query selector's grammar as the OpenAPI document states it, matching exactly the
/// strings [`Selector::parse`] accepts: comma-separated terms, each blank (skipped) or
/// `key=value` with a key that is not blank and holds neither `,` nor `=`.
pub fn selector_pattern() -> String {
    let term = format!("(?:[{BLANK}]*|[^,=]*[^{BLANK},=][^,=]*=[^,]*)");
    format!("^{term}(?:,{term})*$")
}

/// A set of required `label = value` pairs; empty matches everything.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Selector {
    pairs: BTreeMap<String, String>,
    /// A key was required to have two different values: nothing can match.
    contradictory: bool,
}

/// Why a selector string was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SelectorError {
    /// A term without `=`.
    #[error("selector term {0:?} is not key=value")]
    NotAPair(String),
    /// A term with an empty key.
    #[error("selector term {0:?} has an empty key")]
    EmptyKey(String),
}

impl Selector {
    /// Parses `k=v,k2=v2` (ASCII whitespace around terms, keys and values is ignored; an
    /// empty string selects all). A key named twice with different values is not an error:
    /// every pair must match, so such a selector matches nothing.
    pub fn parse(text: &str) -> Result<Self, SelectorError> {
        let mut selector = Selector::default();
        for term in text.split(',').map(str::trim_ascii) {
            if term.is_empty() {
                continue;
            }
            let (key, value) = term
                .split_once('=')
                .ok_or_else(|| SelectorError::NotAPair(term.to_owned()))?;
            let (key, value) = (key.trim_ascii(), value.trim_ascii());
            if key.is_empty() {
                return Err(SelectorError::EmptyKey(term.to_owned()));
            }
            if let Some(earlier) = selector.pairs.insert(key.to_owned(), value.to_owned()) {
                selector.contradictory |= earlier != value;
            }
        }
        Ok(selector)
    }

    /// Whether the selector names no pair (it matches every proxy).
    pub fn is_empty(&self) -> bool {
        self.pairs.is_empty()
    }

    /// Whether every pair is present in `labels`.
    pub fn matches(&self, labels: Option<&BTreeMap<String, String>>) -> bool {
        !self.contradictory
            && self
                .pairs
                .iter()
                .all(|(k, v)| labels.and_then(|l| l.get(k)) == Some(v))
    }
}

impl From<BTreeMap<String, String>> for Selector {
    fn from(pairs: BTreeMap<String, String>) -> Self {
        Selector {
            pairs,
            contradictory: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::label_map as labels;

    #[test]
    fn parse_table() {
        let ok = [
            ("", vec![]),
            ("geo=eu", vec![("geo", "eu")]),
            (" geo = eu , tier=a,", vec![("geo", "eu"), ("tier", "a")]),
            ("\tgeo=eu\r\n,,", vec![("geo", "eu")]),
            ("empty=", vec![("empty", "")]),
            ("k=a=b", vec![("k", "a=b")]),
            ("geo=eu,geo=eu", vec![("geo", "eu")]),
        ];
        for (text, pairs) in ok {
            assert_eq!(
                Selector::parse(text).unwrap(),
                Selector::from(labels(&pairs)),
                "{text:?}"
            );
        }
        let bad = [
            ("geo", SelectorError::NotAPair("geo".into())),
            ("=eu", SelectorError::EmptyKey("=eu".into())),
            (" \t=eu", SelectorError::EmptyKey("=eu".into())),
            ("geo=eu,tier", SelectorError::NotAPair("tier".into())),
        ];
        for (text, error) in bad {
            assert_eq!(Selector::parse(text).unwrap_err(), error, "{text:?}");
        }
    }

    #[test]
    fn matches_table() {
        let proxy = labels(&[("geo", "eu"), ("tier", "a")]);
        let cases = [
            ("", Some(&proxy), true),
            ("", None, true),
            ("geo=eu", Some(&proxy), true),
            ("geo=eu,tier=a", Some(&proxy), true),
            ("geo=eu,geo=eu", Some(&proxy), true),
            ("geo=us", Some(&proxy), false),
            ("geo=eu,tier=b", Some(&proxy), false),
            ("zone=x", Some(&proxy), false),
            ("geo=eu", None, false),
            // Every pair must match: one key with two values never does.
            ("geo=eu,geo=us", Some(&proxy), false),
            ("geo=us,geo=eu", Some(&proxy), false),
        ];
        for (text, labels, expected) in cases {
            let selector = Selector::parse(text).unwrap();
            assert_eq!(selector.matches(labels), expected, "{text:?}");
        }
    }

    /// Every string up to five characters over an alphabet of the characters that matter
    /// (separators, ASCII and other whitespace, a letter, a non-ASCII letter): the documented
    /// pattern accepts exactly the strings the parser accepts.
    #[test]
    fn the_pattern_accepts_exactly_what_parse_accepts() {
        let pattern = regex::Regex::new(&selector_pattern()).unwrap();
        let alphabet = ['a', '=', ',', ' ', '\t', '\n', '\u{a0}', 'é'];
        let mut strings = vec![String::new()];
        let mut checked = 0;
        for _ in 0..5 {
            let mut longer = Vec::new();
            for s in &strings {
                for c in alphabet {
                    let mut t = s.clone();
                    t.push(c);
                    assert_eq!(
                        pattern.is_match(&t),
                        Selector::parse(&t).is_ok(),
                        "{t:?}: {:?}",
                        Selector::parse(&t)
                    );
                    checked += 1;
                    longer.push(t);
                }
            }
            strings = longer;
        }
        assert!(checked > 30_000, "{checked}");
        assert!(pattern.is_match(""));
    }
}
