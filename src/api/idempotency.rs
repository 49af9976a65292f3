//! Idempotent acquire: a crawler that names a `requestID` can retry `POST /v1/leases` after a
//! timeout or a dropped connection and get the lease of its first attempt instead of a
//! second one. The ledger keeps the ID with a fingerprint of what was asked, so the same ID
//! with a different question is refused rather than answered with an unrelated lease.

use std::collections::BTreeMap;

use sha2::{Digest, Sha256};

use super::error::ApiError;

/// Longest `requestID` accepted.
pub const MAX_REQUEST_ID_LEN: usize = 128;

/// The `requestID` pattern as the OpenAPI document states it: 1 to 128 printable ASCII
/// characters (space to `~`).
pub const REQUEST_ID_PATTERN: &str = "^[ -~]{1,128}$";

/// Checks a `requestID`: 1–128 printable ASCII characters (space through `~`).
pub fn parse_request_id(id: Option<String>) -> Result<Option<String>, ApiError> {
    let Some(id) = id else {
        return Ok(None);
    };
    let printable = id.bytes().all(|b| (b' '..=b'~').contains(&b));
    if id.is_empty() || id.len() > MAX_REQUEST_ID_LEN || !printable {
        return Err(ApiError::bad_request(
            "invalid_body",
            format!(
                "`requestID` must be 1 to {MAX_REQUEST_ID_LEN} printable ASCII characters \
                 (space through `~`)"
            ),
        ));
    }
    Ok(Some(id))
}

/// Longest fingerprint kept as readable JSON; a longer canonical form is kept as its hash, so
/// a lease row stays small whatever selector a request carries.
pub const MAX_READABLE_FINGERPRINT: usize = 256;

/// What an acquire asked for, as the crawler sent it (the target after the API's trimming and
/// lower-casing, the TTL before defaults and the cap): a retry must ask the same.
///
/// The canonical form is JSON with the selector's keys sorted, e.g.
/// `{"selector":{"geo":"eu"},"target":"example.com","ttlSeconds":60}`, kept as is so an
/// engineer reading the ledger with `sqlite3` sees what the ID was first used for; when it is
/// longer than [`MAX_READABLE_FINGERPRINT`] bytes, `sha256:` and its hex digest instead (the
/// two forms cannot collide: one starts with `{`).
pub fn fingerprint(
    selector: &BTreeMap<String, String>,
    target: Option<&str>,
    ttl_seconds: Option<u64>,
) -> String {
    // The map is sorted by key, and `json!` keeps the field order fixed.
    let canonical = serde_json::json!({
        "selector": selector,
        "target": target,
        "ttlSeconds": ttl_seconds,
    })
    .to_string();
    if canonical.len() <= MAX_READABLE_FINGERPRINT {
        return canonical;
    }
    let digest = Sha256::digest(canonical.as_bytes());
    format!("sha256:{}", hex::encode(digest))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_ids_table() {
        let ok = ["a", " ", "~", "retry-1/2:3", &"x".repeat(128)];
        for id in ok {
            assert_eq!(
                parse_request_id(Some(id.to_owned())).unwrap(),
                Some(id.to_owned())
            );
        }
        assert_eq!(parse_request_id(None).unwrap(), None);
        let bad = ["", "tab\t", "new\nline", "é", "\u{7f}", &"x".repeat(129)];
        for id in bad {
            let err = parse_request_id(Some(id.to_owned()))
                .unwrap_err()
                .to_string();
            assert!(err.starts_with("invalid_body"), "{id:?}: {err}");
            assert!(err.contains("`requestID`"), "{id:?}: {err}");
        }
    }

    #[test]
    fn the_pattern_agrees_with_the_check() {
        let pattern = regex::Regex::new(REQUEST_ID_PATTERN).unwrap();
        for id in [
            "a",
            " ",
            "~",
            "",
            "tab\t",
            "é",
            &"x".repeat(128),
            &"x".repeat(129),
        ] {
            assert_eq!(
                pattern.is_match(id),
                parse_request_id(Some(id.to_owned())).is_ok(),
                "{id:?}"
            );
        }
    }

    #[test]
    fn fingerprints_tell_questions_apart() {
        let eu = BTreeMap::from([("geo".to_owned(), "eu".to_owned())]);
        let eu_a = BTreeMap::from([
            ("tier".to_owned(), "a".to_owned()),
            ("geo".to_owned(), "eu".to_owned()),
        ]);
        let base = fingerprint(&eu, Some("example.com"), Some(60));
        assert_eq!(
            base,
            r#"{"selector":{"geo":"eu"},"target":"example.com","ttlSeconds":60}"#
        );
        assert_eq!(
            fingerprint(&BTreeMap::new(), None, None),
            r#"{"selector":{},"target":null,"ttlSeconds":null}"#
        );
        assert_eq!(
            base,
            fingerprint(&eu.clone(), Some("example.com"), Some(60))
        );
        let different = [
            fingerprint(&eu_a, Some("example.com"), Some(60)),
            fingerprint(&BTreeMap::new(), Some("example.com"), Some(60)),
            fingerprint(&eu, None, Some(60)),
            fingerprint(&eu, Some("example.org"), Some(60)),
            fingerprint(&eu, Some("example.com"), Some(61)),
            // Asking for the default is not the same question as naming a TTL.
            fingerprint(&eu, Some("example.com"), None),
        ];
        for (i, other) in different.iter().enumerate() {
            assert_ne!(&base, other, "case {i}");
        }
        // A long question is kept as its hash, still telling questions apart.
        let long = |value: &str| BTreeMap::from([("k".repeat(300), value.to_owned())]);
        let hashed = fingerprint(&long("a"), None, None);
        assert!(hashed.starts_with("sha256:"), "{hashed}");
        assert_eq!(hashed.len(), 7 + 64);
        assert_eq!(hashed, fingerprint(&long("a"), None, None));
        assert_ne!(hashed, fingerprint(&long("b"), None, None));

        // Key order in the request does not matter: the map is canonical.
        let reordered: BTreeMap<String, String> = [("geo", "eu"), ("tier", "a")]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect();
        assert_eq!(
            fingerprint(&eu_a, None, None),
            fingerprint(&reordered, None, None)
        );
    }
}
