//! Label selectors crawlers filter proxies with: `geo=eu,tier=a` in a query string, or a JSON
//! object `{"geo":"eu","tier":"a"}` in a lease request. Every pair must match (equality only).
//! A tenant's scope narrows a selector further ([`Selector::within`]): its own pairs, and the
//! namespaces its proxies must be in.

use std::collections::{BTreeMap, BTreeSet};

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

/// A set of required `label = value` pairs, and optionally the namespaces a proxy must be in;
/// empty matches everything.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Selector {
    pairs: BTreeMap<String, String>,
    /// A key was required to have two different values: nothing can match.
    contradictory: bool,
    /// Only proxies in these namespaces match; `None`: any namespace.
    namespaces: Option<BTreeSet<String>>,
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

    /// Whether the selector names no pair (it matches every proxy of its namespaces).
    pub fn is_empty(&self) -> bool {
        self.pairs.is_empty()
    }

    /// Whether a proxy in `namespace` with `labels` matches: in one of the namespaces (when
    /// the selector names any) and every pair present in `labels`.
    pub fn matches(&self, namespace: &str, labels: Option<&BTreeMap<String, String>>) -> bool {
        self.matches_filling(namespace, labels, &[])
    }

    /// [`matches`](Self::matches) for a rotating upstream whose username template fills
    /// `fields`: a pair naming a field the proxy has no label for matches whatever its value
    /// (the vendor picks the exit for it).
    pub fn matches_filling(
        &self,
        namespace: &str,
        labels: Option<&BTreeMap<String, String>>,
        fields: &[String],
    ) -> bool {
        !self.contradictory
            && self
                .namespaces
                .as_ref()
                .is_none_or(|namespaces| namespaces.contains(namespace))
            && self
                .pairs
                .iter()
                .all(|(k, v)| match labels.and_then(|l| l.get(k)) {
                    Some(label) => label == v,
                    None => fields.contains(k),
                })
    }

    /// This selector narrowed to `scope`: its pairs and the scope's must all match (a key
    /// both name with different values matches nothing), and the proxy must be in one of the
    /// scope's namespaces, when it names any (and in this selector's, when this one does).
    pub fn within(&self, scope: &Selector) -> Selector {
        let mut narrowed = self.clone();
        for (key, value) in &scope.pairs {
            if let Some(earlier) = narrowed.pairs.insert(key.clone(), value.clone()) {
                narrowed.contradictory |= earlier != *value;
            }
        }
        narrowed.contradictory |= scope.contradictory;
        narrowed.namespaces = match (&self.namespaces, &scope.namespaces) {
            (Some(a), Some(b)) => Some(a.intersection(b).cloned().collect()),
            (a, b) => a.clone().or_else(|| b.clone()),
        };
        narrowed
    }

    /// The selector that also requires one of `namespaces` (the scope of a tenant).
    pub fn in_namespaces(mut self, namespaces: impl IntoIterator<Item = String>) -> Selector {
        self.namespaces = Some(namespaces.into_iter().collect());
        self
    }

    /// Whether it holds no condition at all: every proxy matches.
    pub fn is_unrestricted(&self) -> bool {
        self.pairs.is_empty() && !self.contradictory && self.namespaces.is_none()
    }
}

/// For people: `namespace in (a, b), team=a`; `any proxy` when it holds no condition.
impl std::fmt::Display for Selector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut parts: Vec<String> = Vec::new();
        if let Some(namespaces) = &self.namespaces {
            let list: Vec<&str> = namespaces.iter().map(String::as_str).collect();
            parts.push(format!("namespace in ({})", list.join(", ")));
        }
        parts.extend(self.pairs.iter().map(|(k, v)| format!("{k}={v}")));
        if parts.is_empty() {
            return f.write_str("any proxy");
        }
        f.write_str(&parts.join(", "))
    }
}

impl From<BTreeMap<String, String>> for Selector {
    fn from(pairs: BTreeMap<String, String>) -> Self {
        Selector {
            pairs,
            contradictory: false,
            namespaces: None,
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
            assert_eq!(selector.matches("crawl", labels), expected, "{text:?}");
        }
    }

    #[test]
    fn a_scope_narrows_a_selector() {
        let proxy = labels(&[("geo", "eu"), ("team", "a")]);
        let scope = Selector::parse("team=a")
            .unwrap()
            .in_namespaces(["crawl-a".to_owned()]);
        let cases = [
            ("", "crawl-a", true),
            ("geo=eu", "crawl-a", true),
            ("geo=eu", "crawl-b", false),
            ("geo=us", "crawl-a", false),
            ("team=a", "crawl-a", true),
            // A crawler cannot ask its way out of its scope.
            ("team=b", "crawl-a", false),
        ];
        for (text, namespace, expected) in cases {
            let narrowed = Selector::parse(text).unwrap().within(&scope);
            assert_eq!(
                narrowed.matches(namespace, Some(&proxy)),
                expected,
                "{text:?} in {namespace}"
            );
        }
        let both = Selector::default()
            .in_namespaces(["a".to_owned(), "b".to_owned()])
            .within(&Selector::default().in_namespaces(["b".to_owned(), "c".to_owned()]));
        assert!(both.matches("b", None));
        assert!(!both.matches("a", None) && !both.matches("c", None));
        assert!(
            Selector::default()
                .within(&Selector::default())
                .is_unrestricted()
        );
        assert!(!scope.is_unrestricted());
        assert_eq!(scope.to_string(), "namespace in (crawl-a), team=a");
        assert_eq!(Selector::default().to_string(), "any proxy");
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
