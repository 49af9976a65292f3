//! The spec hash: what decides that a Managed proxy's machine must be replaced.
//!
//! It covers an explicit struct — placement, the *resolved* cloud-init content and the port —
//! not the whole spec, so lease capacity, cordoning, price or health-check edits never replace a
//! machine, and a change to a referenced Secret does.

use serde::Serialize;
use serde_json::Value;
use sha2::{Digest, Sha256};

use super::proxy::{Placement, ProxySpec};

/// Version of the hash inputs. Bump it when [`SpecHashInput`] gains or loses a field; the
/// reconciler treats a version mismatch as "adopt" (re-record the hash), not as drift.
pub const SPEC_HASH_VERSION: &str = "1";

/// Everything that, when changed, requires a new machine.
#[derive(Serialize, Debug, Clone, PartialEq)]
pub struct SpecHashInput<'a> {
    /// Provider-specific placement.
    pub placement: Option<&'a Placement>,
    /// cloud-init content after resolving a Secret reference.
    pub cloud_init: Option<&'a str>,
    /// Squid listen port.
    pub port: i32,
}

impl<'a> SpecHashInput<'a> {
    /// The hash inputs of a spec whose cloud-init has been resolved to `cloud_init`.
    pub fn new(spec: &'a ProxySpec, cloud_init: Option<&'a str>) -> Self {
        SpecHashInput {
            placement: spec.placement.as_ref(),
            cloud_init,
            port: spec.port,
        }
    }

    /// Lowercase hex SHA-256 of the canonical JSON of the inputs.
    pub fn hash(&self) -> String {
        let value = serde_json::to_value(self).unwrap_or(Value::Null);
        let canonical = canonical_json(&value);
        let digest = Sha256::digest(canonical.as_bytes());
        hex::encode(digest)
    }
}

/// JSON with object keys sorted at every level and no insignificant whitespace.
fn canonical_json(value: &Value) -> String {
    match value {
        Value::Object(map) => {
            let mut entries: Vec<_> = map.iter().collect();
            entries.sort_by(|a, b| a.0.cmp(b.0));
            let body: Vec<String> = entries
                .into_iter()
                .map(|(k, v)| format!("{}:{}", Value::String(k.clone()), canonical_json(v)))
                .collect();
            format!("{{{}}}", body.join(","))
        }
        Value::Array(items) => {
            let body: Vec<String> = items.iter().map(canonical_json).collect();
            format!("[{}]", body.join(","))
        }
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn spec(value: Value) -> ProxySpec {
        serde_json::from_value(value).unwrap()
    }

    fn managed() -> Value {
        json!({
            "mode": "Managed",
            "provider": "gcp-eu",
            "placement": {"zone": "europe-west1-b", "machineType": "e2-small", "tags": ["proxy"]},
            "cloudInit": {"inline": "#cloud-config\n"}
        })
    }

    fn hash_of(value: Value, cloud_init: Option<&str>) -> String {
        let s = spec(value);
        SpecHashInput::new(&s, cloud_init).hash()
    }

    #[test]
    fn canonical_json_sorts_keys_at_every_level() {
        let a = json!({"b": 1, "a": {"d": [1, {"z": 1, "y": 2}], "c": null}});
        assert_eq!(
            canonical_json(&a),
            r#"{"a":{"c":null,"d":[1,{"y":2,"z":1}]},"b":1}"#
        );
        let b: Value =
            serde_json::from_str(r#"{"a":{"d":[1,{"y":2,"z":1}],"c":null},"b":1}"#).unwrap();
        assert_eq!(canonical_json(&a), canonical_json(&b));
    }

    #[test]
    fn hash_is_stable_and_hex() {
        let h = hash_of(managed(), Some("#cloud-config\n"));
        assert_eq!(h, hash_of(managed(), Some("#cloud-config\n")));
        assert_eq!(h.len(), 64);
        assert!(h.bytes().all(|b| b.is_ascii_hexdigit()));
    }

    #[test]
    fn hash_changes_with_every_input() {
        let base = hash_of(managed(), Some("a"));
        let mut zone = managed();
        zone["placement"]["zone"] = json!("us-central1-a");
        let mut port = managed();
        port["port"] = json!(8080);
        let mut tags = managed();
        tags["placement"]["tags"] = json!(["proxy", "eu"]);
        for (what, changed) in [
            ("zone", hash_of(zone, Some("a"))),
            ("port", hash_of(port, Some("a"))),
            ("tags", hash_of(tags, Some("a"))),
            ("cloud-init", hash_of(managed(), Some("b"))),
            ("no cloud-init", hash_of(managed(), None)),
        ] {
            assert_ne!(base, changed, "{what} must change the hash");
        }
    }

    #[test]
    fn hash_ignores_fields_that_do_not_need_a_new_machine() {
        let base = hash_of(managed(), Some("a"));
        let mut other = managed();
        other["maxLeases"] = json!(0);
        other["healthCheck"] = json!({"interval": "5s", "failureThreshold": 9});
        assert_eq!(base, hash_of(other, Some("a")));
    }

    #[test]
    fn cordoning_never_changes_the_hash() {
        let base = hash_of(managed(), Some("a"));
        for cordoned in [true, false] {
            let mut toggled = managed();
            toggled["cordoned"] = json!(cordoned);
            let parsed = spec(toggled.clone());
            assert_eq!(parsed.cordoned, cordoned);
            assert_eq!(base, hash_of(toggled, Some("a")), "cordoned: {cordoned}");
        }
    }

    /// Rotation replaces machines through the budget on its own schedule: setting or changing
    /// `maxLifetime` must not also replace every machine at once as spec drift.
    #[test]
    fn max_lifetime_never_changes_the_hash() {
        let base = hash_of(managed(), Some("a"));
        let cases = [
            ("1m", std::time::Duration::from_secs(60)),
            ("90s", std::time::Duration::from_secs(90)),
            ("24h", std::time::Duration::from_secs(86_400)),
        ];
        for (value, expected) in cases {
            let mut with_lifetime = managed();
            with_lifetime["maxLifetime"] = json!(value);
            let parsed = spec(with_lifetime.clone());
            assert_eq!(parsed.max_lifetime(), Some(expected), "{value}");
            assert_eq!(
                base,
                hash_of(with_lifetime, Some("a")),
                "maxLifetime: {value}"
            );
        }
        assert_eq!(spec(managed()).max_lifetime(), None);
    }

    /// A new price is bookkeeping: it must never replace a machine.
    #[test]
    fn cost_never_changes_the_hash() {
        let base = hash_of(managed(), Some("a"));
        for cost in [
            json!({"perGB": "8.40"}),
            json!({"perHour": "0.0067"}),
            json!({"perGB": "0", "perHour": "12.5"}),
            json!({}),
        ] {
            let mut priced = managed();
            priced["cost"] = cost.clone();
            assert!(spec(priced.clone()).cost.is_some(), "{cost}");
            assert_eq!(base, hash_of(priced, Some("a")), "cost: {cost}");
        }
    }
}
