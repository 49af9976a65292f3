//! Label selectors crawlers filter proxies with: `geo=eu,tier=a` in a query string, or a JSON
//! object `{"geo":"eu","tier":"a"}` in a lease request. Every pair must match (equality only).

use std::collections::BTreeMap;

/// A set of required `label = value` pairs; empty matches everything.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Selector(BTreeMap<String, String>);

/// Why a selector string was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SelectorError {
    /// A term without `=`.
    #[error("selector term {0:?} is not key=value")]
    NotAPair(String),
    /// A term with an empty key.
    #[error("selector term {0:?} has an empty key")]
    EmptyKey(String),
    /// The same key twice with different values (can never match).
    #[error("selector names key {0:?} twice")]
    RepeatedKey(String),
}

impl Selector {
    /// Parses `k=v,k2=v2` (whitespace around terms is ignored; an empty string selects all).
    pub fn parse(text: &str) -> Result<Self, SelectorError> {
        let mut pairs = BTreeMap::new();
        for term in text.split(',').map(str::trim).filter(|t| !t.is_empty()) {
            let (key, value) = term
                .split_once('=')
                .ok_or_else(|| SelectorError::NotAPair(term.to_owned()))?;
            let (key, value) = (key.trim(), value.trim());
            if key.is_empty() {
                return Err(SelectorError::EmptyKey(term.to_owned()));
            }
            if pairs.insert(key.to_owned(), value.to_owned()).is_some() {
                return Err(SelectorError::RepeatedKey(key.to_owned()));
            }
        }
        Ok(Selector(pairs))
    }

    /// Whether every pair is present in `labels`.
    pub fn matches(&self, labels: Option<&BTreeMap<String, String>>) -> bool {
        self.0
            .iter()
            .all(|(k, v)| labels.and_then(|l| l.get(k)) == Some(v))
    }
}

impl From<BTreeMap<String, String>> for Selector {
    fn from(pairs: BTreeMap<String, String>) -> Self {
        Selector(pairs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn parse_table() {
        let ok = [
            ("", vec![]),
            ("geo=eu", vec![("geo", "eu")]),
            (" geo = eu , tier=a,", vec![("geo", "eu"), ("tier", "a")]),
            ("empty=", vec![("empty", "")]),
        ];
        for (text, pairs) in ok {
            assert_eq!(
                Selector::parse(text).unwrap(),
                Selector(labels(&pairs)),
                "{text:?}"
            );
        }
        let bad = [
            ("geo", SelectorError::NotAPair("geo".into())),
            ("=eu", SelectorError::EmptyKey("=eu".into())),
            ("geo=eu,geo=us", SelectorError::RepeatedKey("geo".into())),
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
            ("geo=us", Some(&proxy), false),
            ("geo=eu,tier=b", Some(&proxy), false),
            ("zone=x", Some(&proxy), false),
            ("geo=eu", None, false),
        ];
        for (text, labels, expected) in cases {
            let selector = Selector::parse(text).unwrap();
            assert_eq!(selector.matches(labels), expected, "{text:?}");
        }
    }
}
