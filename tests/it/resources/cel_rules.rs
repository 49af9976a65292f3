//! The CRD's CEL rules, read from the generated CRD and evaluated client-side the way the API
//! server evaluates them (defaults first; `oldSelf` rules skipped on create).

use proxy_operator::resources::validation::ProxyValidator;
use serde_json::{Value, json};

fn object(spec: Value) -> Value {
    json!({
        "apiVersion": "crawl.example.com/v1alpha1",
        "kind": "Proxy",
        "metadata": {"name": "p", "namespace": "default", "uid": "u"},
        "spec": spec,
    })
}

fn managed() -> Value {
    json!({"mode": "Managed", "provider": "local"})
}

fn external() -> Value {
    json!({"mode": "External", "endpoint": {"host": "10.0.0.1", "port": 3128}})
}

fn with(mut spec: Value, key: &str, value: Value) -> Value {
    if value.is_null() {
        spec.as_object_mut().unwrap().remove(key);
    } else {
        spec[key] = value;
    }
    spec
}

/// Asserts the verdict; on rejection, that some violation message contains `expected`.
fn check(
    result: Result<(), Vec<proxy_operator::resources::validation::RuleViolation>>,
    expected: Option<&str>,
    case: &str,
) {
    match (result, expected) {
        (Ok(()), None) => {}
        (Ok(()), Some(msg)) => panic!("{case}: accepted, expected rejection with {msg:?}"),
        (Err(v), None) => panic!("{case}: rejected: {v:?}"),
        (Err(v), Some(msg)) => assert!(
            v.iter().any(|x| x.message.contains(msg)),
            "{case}: expected {msg:?}, got {v:?}"
        ),
    }
}

#[test]
fn value_constraints_are_checked_too() {
    let v = ProxyValidator::new().unwrap();
    let cases: Vec<(&str, Value, &str)> = vec![
        (
            "port out of range",
            with(external(), "endpoint", json!({"host": "h", "port": 70000})),
            "/spec/endpoint/port",
        ),
        (
            "empty host",
            with(external(), "endpoint", json!({"host": "", "port": 1})),
            "/spec/endpoint/host",
        ),
        (
            "negative maxLeases",
            with(external(), "maxLeases", json!(-1)),
            "/spec/maxLeases",
        ),
        (
            "empty provider",
            with(managed(), "provider", json!("")),
            "/spec/provider",
        ),
        (
            "unknown mode",
            with(managed(), "mode", json!("Borrowed")),
            "/spec/mode",
        ),
        (
            "zero failure threshold",
            with(external(), "healthCheck", json!({"failureThreshold": 0})),
            "/spec/healthCheck/failureThreshold",
        ),
        (
            "negative price",
            with(external(), "cost", json!({"perGB": "-1"})),
            "/spec/cost/perGB",
        ),
        (
            "price as a number",
            with(external(), "cost", json!({"perHour": 0.5})),
            "/spec/cost/perHour",
        ),
        (
            "price in exponent form",
            with(managed(), "cost", json!({"perHour": "1e3"})),
            "/spec/cost/perHour",
        ),
    ];
    for (case, spec, path) in cases {
        let violations = v.validate_create(&object(spec)).expect_err(case);
        assert!(
            violations.iter().any(|x| x.path == path),
            "{case}: {violations:?}"
        );
    }
}

#[test]
fn create_rules() {
    let v = ProxyValidator::new().unwrap();
    let cases: Vec<(&str, Value, Option<&str>)> = vec![
        ("managed is valid", managed(), None),
        ("external is valid", external(), None),
        (
            "a price per GB and per hour is valid",
            with(
                external(),
                "cost",
                json!({"perGB": "8.40", "perHour": "0.0067"}),
            ),
            None,
        ),
        (
            "managed with placement and inline cloud-init is valid",
            with(managed(), "cloudInit", json!({"inline": "#cloud-config"})),
            None,
        ),
        (
            "managed with secretRef cloud-init is valid",
            with(
                managed(),
                "cloudInit",
                json!({"secretRef": {"name": "s", "key": "k"}}),
            ),
            None,
        ),
        (
            "managed without provider",
            with(managed(), "provider", Value::Null),
            Some("provider is required when mode is Managed"),
        ),
        (
            "external with provider",
            with(external(), "provider", json!("local")),
            Some("provider must not be set when mode is External"),
        ),
        (
            "external without endpoint",
            with(external(), "endpoint", Value::Null),
            Some("endpoint is required when mode is External"),
        ),
        (
            "managed with endpoint",
            with(managed(), "endpoint", json!({"host": "h", "port": 1})),
            Some("endpoint must not be set when mode is Managed"),
        ),
        (
            "cloudInit with both",
            with(
                managed(),
                "cloudInit",
                json!({"inline": "x", "secretRef": {"name": "s", "key": "k"}}),
            ),
            Some("exactly one of inline or secretRef"),
        ),
        (
            "cloudInit with neither",
            with(managed(), "cloudInit", json!({})),
            Some("exactly one of inline or secretRef"),
        ),
    ];
    for (case, spec, expected) in cases {
        check(v.validate_create(&object(spec)), expected, case);
    }
}

#[test]
fn transition_rules_are_not_evaluated_on_create() {
    // On create there is no oldSelf; were the immutability rules evaluated against nothing,
    // every valid object would be rejected. The validator must skip them, as the server does.
    let v = ProxyValidator::new().unwrap();
    for spec in [managed(), external()] {
        check(v.validate_create(&object(spec)), None, "create");
    }
}

#[test]
fn update_rules() {
    let v = ProxyValidator::new().unwrap();
    let gcp = with(managed(), "provider", json!("gcp-eu"));
    let cases: Vec<(&str, Value, Value, Option<&str>)> = vec![
        ("unchanged managed", managed(), managed(), None),
        (
            "maxLeases change is allowed",
            managed(),
            with(managed(), "maxLeases", json!(0)),
            None,
        ),
        (
            "port change is allowed (it replaces the machine)",
            managed(),
            with(managed(), "port", json!(8080)),
            None,
        ),
        (
            "mode change",
            managed(),
            external(),
            Some("mode is immutable"),
        ),
        (
            "provider change",
            managed(),
            gcp,
            Some("provider is immutable"),
        ),
        (
            "provider removed",
            managed(),
            with(managed(), "provider", Value::Null),
            Some("provider is immutable"),
        ),
        (
            "provider added",
            external(),
            with(external(), "provider", json!("local")),
            Some("provider is immutable"),
        ),
        (
            "endpoint change on external is allowed",
            external(),
            with(
                external(),
                "endpoint",
                json!({"host": "10.0.0.2", "port": 8080}),
            ),
            None,
        ),
    ];
    for (case, old, new, expected) in cases {
        check(
            v.validate_update(&object(new), &object(old)),
            expected,
            case,
        );
    }
}

#[test]
fn defaults_are_applied_before_rules() {
    // An External object without healthCheck gets `{}` and then its nested defaults; the rules
    // see the defaulted object, and nothing about the defaulting may trip a rule.
    let v = ProxyValidator::new().unwrap();
    let spec = json!({"mode": "External", "endpoint": {"host": "h", "port": 1}});
    check(v.validate_create(&object(spec)), None, "defaulted external");
}

#[test]
fn max_lifetime_rules() {
    use proxy_operator::resources::duration::{FIELD_MESSAGE, MAX_LIFETIME_MESSAGE};
    let v = ProxyValidator::new().unwrap();
    let external_set = "maxLifetime must not be set when mode is External";
    let cases: Vec<(&str, Value, Option<&str>)> = vec![
        ("1m", with(managed(), "maxLifetime", json!("1m")), None),
        ("90s", with(managed(), "maxLifetime", json!("90s")), None),
        ("24h", with(managed(), "maxLifetime", json!("24h")), None),
        (
            "1m0.5s",
            with(managed(), "maxLifetime", json!("1m0.5s")),
            None,
        ),
        ("absent on Managed", managed(), None),
        ("absent on External", external(), None),
        (
            "59s",
            with(managed(), "maxLifetime", json!("59s")),
            Some(MAX_LIFETIME_MESSAGE),
        ),
        (
            "59.999s",
            with(managed(), "maxLifetime", json!("59.999s")),
            Some(MAX_LIFETIME_MESSAGE),
        ),
        (
            "30 (no unit)",
            with(managed(), "maxLifetime", json!("30")),
            Some(FIELD_MESSAGE),
        ),
        (
            "1x (unknown unit)",
            with(managed(), "maxLifetime", json!("1x")),
            Some(FIELD_MESSAGE),
        ),
        (
            "0s",
            with(managed(), "maxLifetime", json!("0s")),
            Some(FIELD_MESSAGE),
        ),
        (
            "-1h",
            with(managed(), "maxLifetime", json!("-1h")),
            Some(MAX_LIFETIME_MESSAGE),
        ),
        (
            "on External",
            with(external(), "maxLifetime", json!("24h")),
            Some(external_set),
        ),
        (
            "too long",
            with(managed(), "maxLifetime", json!("1h".repeat(33))),
            Some("longer than 64"),
        ),
    ];
    for (case, spec, expected) in cases {
        let result = v.validate_create(&object(spec));
        if let Err(violations) = &result {
            assert!(
                violations
                    .iter()
                    .all(|x| !x.message.contains("evaluation error")),
                "{case}: a rule failed to evaluate: {violations:?}"
            );
            assert!(
                violations
                    .iter()
                    .all(|x| x.message == external_set || x.path.contains("maxLifetime")),
                "{case}: a violation does not name maxLifetime: {violations:?}"
            );
        }
        check(result, expected, case);
    }
}

#[test]
fn max_lifetime_may_be_set_changed_and_removed() {
    let v = ProxyValidator::new().unwrap();
    let day = with(managed(), "maxLifetime", json!("24h"));
    let cases: Vec<(&str, Value, Value, Option<&str>)> = vec![
        ("set", managed(), day.clone(), None),
        (
            "changed",
            day.clone(),
            with(managed(), "maxLifetime", json!("12h")),
            None,
        ),
        ("removed", day.clone(), managed(), None),
        (
            "set on External",
            external(),
            with(external(), "maxLifetime", json!("24h")),
            Some("maxLifetime must not be set when mode is External"),
        ),
    ];
    for (case, old, new, expected) in cases {
        check(
            v.validate_update(&object(new), &object(old)),
            expected,
            case,
        );
    }
}
