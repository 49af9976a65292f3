//! The duration table (`tests/data/durations.json`) against every parser on this side of the
//! API server: the operator's decoder, kube's own parser (why the decoder checks the syntax
//! first), the CRD's rules evaluated client-side (OpenAPI constraints + CEL, what standalone
//! inventories are checked with), and the standalone inventory file. The real API server's
//! verdicts on the same table are checked by the envtest suite for the health check, and here
//! for `spec.maxLifetime` (the same syntax, at least `1m`, Managed only), which needs
//! `KUBEBUILDER_ASSETS` (skipped without it unless `CI` is set).

use crate::support;

use std::panic::{AssertUnwindSafe, catch_unwind};

use kube::api::{Api, ApiResource, DynamicObject, PostParams};
use proxy_operator::inventory::file::InventoryFile;
use proxy_operator::resources::duration;
use proxy_operator::resources::proxy::Proxy;
use proxy_operator::resources::validation::{ProxyValidator, RuleViolation};
use serde::Deserialize;
use serde_json::{Value, json};

#[derive(Deserialize)]
struct Table {
    strings: Vec<StringCase>,
    pairs: Vec<PairCase>,
}

#[derive(Deserialize)]
struct StringCase {
    value: String,
    decodes: bool,
    accepted: bool,
    kube: String,
    ns: Option<u64>,
    note: String,
}

#[derive(Deserialize)]
struct PairCase {
    interval: Option<String>,
    timeout: Option<String>,
    accepted: bool,
    note: String,
}

fn table() -> Table {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/durations.json");
    let text = std::fs::read_to_string(path).expect("tests/data/durations.json");
    serde_json::from_str(&text).expect("the duration table parses")
}

fn object(health_check: Value) -> Value {
    json!({
        "apiVersion": "crawl.example.com/v1alpha1",
        "kind": "Proxy",
        "metadata": {"name": "p", "namespace": "default"},
        "spec": {
            "mode": "External",
            "endpoint": {"host": "127.0.0.1", "port": 3128},
            "healthCheck": health_check,
        },
    })
}

fn both(value: &str) -> Value {
    object(json!({"interval": value, "timeout": value}))
}

fn case_name(case: &StringCase) -> String {
    format!("{:?} ({})", case.value, case.note)
}

#[test]
fn the_table_is_consistent() {
    let table = table();
    assert!(table.strings.len() >= 40, "the table lost its cases");
    for case in &table.strings {
        let name = case_name(case);
        assert!(
            !case.accepted || case.decodes,
            "{name}: accepted but not decodable"
        );
        assert!(
            ["ok", "error", "panic"].contains(&case.kube.as_str()),
            "{name}: kube is {}",
            case.kube
        );
        // Everything the decoder reads, kube's parser reads too: the syntax only narrows it.
        assert!(!case.decodes || case.kube == "ok", "{name}");
    }
    for verdict in [true, false] {
        assert!(table.strings.iter().any(|c| c.accepted == verdict));
        assert!(table.strings.iter().any(|c| c.decodes == verdict));
        assert!(table.pairs.iter().any(|c| c.accepted == verdict));
    }
    assert!(table.strings.iter().any(|c| c.decodes && !c.accepted));
}

#[test]
fn the_operator_decodes_exactly_the_decodable_strings() {
    for case in table().strings {
        let name = case_name(&case);
        let parsed = duration::parse(&case.value);
        assert_eq!(parsed.is_ok(), case.decodes, "{name}: {parsed:?}");
        if let (Ok(parsed), Some(ns)) = (&parsed, case.ns) {
            let got = std::time::Duration::from(*parsed).as_nanos();
            assert!(got.abs_diff(u128::from(ns)) <= 1, "{name}: {got} ns");
        }
        // The same verdict when the string arrives inside a whole Proxy.
        let decoded = serde_json::from_value::<Proxy>(both(&case.value));
        assert_eq!(decoded.is_ok(), case.decodes, "{name}: {decoded:?}");
        if let Err(e) = decoded {
            assert!(e.to_string().contains("is not a duration"), "{name}: {e}");
        }
    }
}

#[test]
fn kube_parser_verdicts_are_as_recorded() {
    // Why the decoder checks the syntax before kube's parser: it reads several strings Go and
    // the API server refuse, and panics on others.
    for case in table().strings {
        let name = case_name(&case);
        let value = case.value.clone();
        let verdict = match catch_unwind(AssertUnwindSafe(|| value.parse::<kube::core::Duration>()))
        {
            Ok(Ok(_)) => "ok",
            Ok(Err(_)) => "error",
            Err(_) => "panic",
        };
        assert_eq!(verdict, case.kube, "{name}");
    }
}

/// The validator's verdict, with no rule failing to evaluate (the rules guard `duration()`).
fn verdict(validator: &ProxyValidator, object: &Value, name: &str) -> Vec<RuleViolation> {
    match validator.validate_create(object) {
        Ok(()) => Vec::new(),
        Err(violations) => {
            for v in &violations {
                assert!(
                    !v.message.contains("evaluation error"),
                    "{name}: a rule failed to evaluate: {v}"
                );
            }
            violations
        }
    }
}

#[test]
fn the_crd_accepts_exactly_the_accepted_strings() {
    let validator = ProxyValidator::new().unwrap();
    for case in table().strings {
        let name = case_name(&case);
        let violations = verdict(&validator, &both(&case.value), &name);
        assert_eq!(
            violations.is_empty(),
            case.accepted,
            "{name}: {violations:?}"
        );
        if !case.accepted {
            for field in ["interval", "timeout"] {
                assert!(
                    violations.iter().any(|v| {
                        let path = v.path.replace('/', ".");
                        path.ends_with(&format!("spec.healthCheck.{field}"))
                    }),
                    "{name}: nothing names {field}: {violations:?}"
                );
            }
        }
        // Each field on its own, the other one valid.
        let interval_only = object(json!({"interval": case.value, "timeout": "1ns"}));
        let violations = verdict(&validator, &interval_only, &name);
        assert_eq!(
            violations.is_empty(),
            case.accepted,
            "{name}: {violations:?}"
        );
    }
}

#[test]
fn rejections_say_what_a_duration_is() {
    let validator = ProxyValidator::new().unwrap();
    for value in ["30", "1d", "0", "-5s", "12µs"] {
        let violations = verdict(&validator, &both(value), value);
        let interval = violations
            .iter()
            .find(|v| v.path == "spec.healthCheck.interval")
            .unwrap_or_else(|| panic!("{value}: {violations:?}"));
        assert_eq!(interval.message, duration::FIELD_MESSAGE, "{value}");
    }
}

#[test]
fn the_crd_keeps_timeout_within_interval() {
    let validator = ProxyValidator::new().unwrap();
    for case in table().pairs {
        let name = format!(
            "interval {:?} timeout {:?} ({})",
            case.interval, case.timeout, case.note
        );
        let mut health_check = json!({});
        if let Some(interval) = &case.interval {
            health_check["interval"] = json!(interval);
        }
        if let Some(timeout) = &case.timeout {
            health_check["timeout"] = json!(timeout);
        }
        let violations = verdict(&validator, &object(health_check), &name);
        assert_eq!(
            violations.is_empty(),
            case.accepted,
            "{name}: {violations:?}"
        );
        if !case.accepted {
            assert!(
                violations.iter().all(|v| v.path == "spec.healthCheck"
                    && v.message == duration::TIMEOUT_MESSAGE),
                "{name}: {violations:?}"
            );
        }
    }
}

#[test]
fn standalone_inventories_refuse_what_the_crd_refuses() {
    let file = InventoryFile::new("/srv/inventory.yaml").unwrap();
    for case in table().strings {
        let name = case_name(&case);
        let document = format!(
            "apiVersion: crawl.example.com/v1alpha1\nkind: Proxy\nmetadata: {{name: p}}\n\
             spec:\n  mode: External\n  endpoint: {{host: 127.0.0.1, port: 3128}}\n  \
             healthCheck: {{interval: {value}, timeout: {value}}}\n",
            value = serde_json::to_string(&case.value).unwrap()
        );
        match file.parse(&document) {
            Ok(loaded) => {
                assert!(case.accepted, "{name}: accepted by the inventory");
                assert_eq!(loaded.proxies.len(), 1);
            }
            Err(e) => {
                assert!(!case.accepted, "{name}: refused: {e}");
                let message = e.to_string();
                assert!(
                    message.contains("document 1 (default/p)")
                        && message.contains("healthCheck")
                        && message.contains("interval"),
                    "{name}: {message}"
                );
            }
        }
    }
}

/// A Managed Proxy named `name` with `spec.maxLifetime` set to `value`.
fn with_lifetime(name: &str, mode: &str, value: &str) -> Value {
    let mut spec = match mode {
        "Managed" => json!({"mode": "Managed", "provider": "local"}),
        _ => json!({"mode": "External", "endpoint": {"host": "127.0.0.1", "port": 3128}}),
    };
    spec["maxLifetime"] = json!(value);
    json!({
        "apiVersion": "crawl.example.com/v1alpha1",
        "kind": "Proxy",
        "metadata": {"name": name, "namespace": "default"},
        "spec": spec,
    })
}

/// Whether the CRD should accept `case` as a `maxLifetime`: an accepted duration of 1m or more.
fn lifetime_accepted(case: &StringCase) -> bool {
    case.accepted
        && duration::parse(&case.value)
            .is_ok_and(|d| std::time::Duration::from(d) >= duration::MIN_MAX_LIFETIME_VALUE)
}

/// The brief's named cases on top of the table: (value, mode, accepted).
const LIFETIME_CASES: [(&str, &str, bool); 8] = [
    ("1m", "Managed", true),
    ("90s", "Managed", true),
    ("24h", "Managed", true),
    ("59s", "Managed", false),
    ("30", "Managed", false),
    ("1x", "Managed", false),
    ("24h", "External", false),
    ("1m", "External", false),
];

#[test]
fn max_lifetime_decodes_like_the_health_check_durations() {
    for case in table().strings {
        let name = case_name(&case);
        let decoded = serde_json::from_value::<Proxy>(with_lifetime("p", "Managed", &case.value));
        assert_eq!(decoded.is_ok(), case.decodes, "{name}: {decoded:?}");
        match decoded {
            Ok(proxy) => {
                let parsed = proxy.spec.max_lifetime();
                let floor = duration::MIN_MAX_LIFETIME_VALUE;
                assert!(parsed.is_some_and(|d| d >= floor), "{name}: {parsed:?}");
            }
            Err(e) => assert!(e.to_string().contains("is not a duration"), "{name}: {e}"),
        }
    }
}

#[test]
fn the_crd_accepts_exactly_the_lifetimes_of_a_minute_or_more() {
    let validator = ProxyValidator::new().unwrap();
    let table = table();
    let mut cases: Vec<(String, &str, bool)> = table
        .strings
        .iter()
        .map(|c| (c.value.clone(), "Managed", lifetime_accepted(c)))
        .collect();
    cases.extend(
        LIFETIME_CASES
            .iter()
            .map(|(value, mode, accepted)| ((*value).to_owned(), *mode, *accepted)),
    );
    assert!(cases.iter().any(|c| c.2) && cases.iter().any(|c| !c.2));
    for (value, mode, accepted) in cases {
        let name = format!("{value:?} on {mode}");
        let violations = verdict(&validator, &with_lifetime("p", mode, &value), &name);
        assert_eq!(violations.is_empty(), accepted, "{name}: {violations:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_accepts_exactly_the_lifetimes_of_a_minute_or_more() {
    let Some(plane) = support::ControlPlane::shared() else {
        return;
    };
    plane.apply_crd().await;
    let namespace = plane.new_namespace("max-lifetime").await;
    let proxies: Api<DynamicObject> = Api::namespaced_with(
        plane.admin_client(),
        &namespace,
        &ApiResource::erase::<Proxy>(&()),
    );
    let table = table();
    let from_table = table.strings.iter().map(|c| {
        let expected = if lifetime_accepted(c) {
            Ok(())
        } else if c.accepted {
            Err(duration::MAX_LIFETIME_MESSAGE)
        } else {
            Err("spec.maxLifetime")
        };
        (c.value.as_str(), "Managed", expected)
    });
    let named = LIFETIME_CASES.iter().map(|(value, mode, accepted)| {
        let expected = match (*accepted, *mode, *value) {
            (true, _, _) => Ok(()),
            (false, "External", _) => Err("maxLifetime must not be set when mode is External"),
            (false, _, "59s") => Err(duration::MAX_LIFETIME_MESSAGE),
            (false, _, _) => Err(duration::FIELD_MESSAGE),
        };
        (*value, *mode, expected)
    });
    for (i, (value, mode, expected)) in from_table.chain(named).enumerate() {
        let mut object = with_lifetime(&format!("l{i}"), mode, value);
        object["metadata"]["namespace"] = json!(namespace);
        let object: DynamicObject = serde_json::from_value(object)
            .unwrap_or_else(|e| panic!("{value:?}: not an object: {e}"));
        let result = proxies.create(&PostParams::default(), &object).await;
        let name = format!("{value:?} on {mode}");
        match (result, expected) {
            (Ok(created), Ok(())) => {
                // Stored as written, and the operator decodes what the server stored.
                assert_eq!(created.data["spec"]["maxLifetime"], json!(value), "{name}");
                let stored = serde_json::to_value(&created).unwrap_or(Value::Null);
                let proxy = serde_json::from_value::<Proxy>(stored)
                    .unwrap_or_else(|e| panic!("{name}: stored but undecodable: {e}"));
                assert!(proxy.spec.max_lifetime().is_some(), "{name}");
            }
            (Ok(_), Err(message)) => panic!("{name}: accepted, expected {message:?}"),
            (Err(kube::Error::Api(status)), Err(message)) => {
                assert!(
                    status.message.contains(message),
                    "{name}: {}",
                    status.message
                );
                assert!(
                    !status.message.contains("compilation")
                        && !status.message.contains("error evaluating"),
                    "{name}: {}",
                    status.message
                );
            }
            (Err(e), _) => panic!("{name}: {e}"),
        }
    }
}
