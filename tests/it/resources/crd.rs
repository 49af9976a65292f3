//! The committed CRD matches the Rust types, and its schema is one the API server accepts.

use proxy_operator::resources::crd::{self, Kind};
use serde_json::Value;

fn committed() -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/crd/proxy.yaml");
    std::fs::read_to_string(path).expect("crd/proxy.yaml is committed")
}

#[test]
fn committed_crds_match_the_types() {
    for (kind, name) in [(Kind::Proxy, "proxy"), (Kind::ProxyPool, "proxypool")] {
        let path = format!("{}/{}", env!("CARGO_MANIFEST_DIR"), kind.file());
        let committed = std::fs::read_to_string(&path).expect("the CRD is committed");
        assert!(
            committed == kind.yaml().unwrap(),
            "{} is stale: regenerate it with `cargo run -- crd {name} > {}`",
            kind.file(),
            kind.file()
        );
    }
}

/// `docs/install.md` says the CRDs fit client-side apply's annotation (256 KiB) with room to
/// spare; the YAML is larger than the compact JSON the annotation holds.
#[test]
fn every_crd_is_as_small_as_the_install_page_says() {
    const LIMIT: usize = 40 * 1024;
    for kind in Kind::ALL {
        let size = kind.yaml().unwrap().len();
        assert!(size < LIMIT, "{}: {size} bytes", kind.file());
    }
    let page = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/install.md"))
        .expect("docs/install.md");
    assert!(
        page.contains("under 40 KB"),
        "docs/install.md names the CRDs' size"
    );
}

#[test]
fn crd_binary_output_is_both_committed_files() {
    let run = |args: &[&str]| {
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_proxy-operator"))
            .args(args)
            .output()
            .unwrap();
        assert!(output.status.success(), "{args:?}");
        String::from_utf8(output.stdout).unwrap()
    };
    let read = |kind: Kind| {
        std::fs::read_to_string(format!("{}/{}", env!("CARGO_MANIFEST_DIR"), kind.file())).unwrap()
    };
    assert_eq!(run(&["crd", "proxy"]), committed());
    assert_eq!(run(&["crd", "proxypool"]), read(Kind::ProxyPool));
    assert_eq!(
        run(&["crd"]),
        format!("{}---\n{}", committed(), read(Kind::ProxyPool))
    );
}

#[test]
fn crd_names_scope_and_printer_columns() {
    let crd = crd::crd();
    assert_eq!(
        crd.metadata.name.as_deref(),
        Some("proxies.crawl.example.com")
    );
    assert_eq!(crd.spec.group, "crawl.example.com");
    assert_eq!(crd.spec.scope, "Namespaced");
    assert_eq!(crd.spec.names.kind, "Proxy");
    assert_eq!(crd.spec.names.short_names, Some(vec!["px".to_owned()]));
    let version = &crd.spec.versions[0];
    assert_eq!(version.name, "v1alpha1");
    assert!(version.subresources.as_ref().unwrap().status.is_some());
    let columns: Vec<&str> = version
        .additional_printer_columns
        .as_ref()
        .unwrap()
        .iter()
        .map(|c| c.name.as_str())
        .collect();
    assert_eq!(
        columns,
        [
            "Mode", "Provider", "Phase", "IP", "Exit", "Healthy", "Cordoned", "Age"
        ]
    );
}

/// Walks every schema node and collects violations of the API server's structural-schema rules.
fn structural_violations(node: &Value, path: &str, out: &mut Vec<String>) {
    let Some(obj) = node.as_object() else {
        out.push(format!("{path}: schema is not an object"));
        return;
    };
    if obj.contains_key("$ref") {
        out.push(format!("{path}: $ref is not allowed"));
    }
    let typed = obj.get("type").and_then(Value::as_str).is_some();
    let escape = obj.contains_key("x-kubernetes-int-or-string")
        || obj.contains_key("x-kubernetes-preserve-unknown-fields");
    if !typed && !escape {
        out.push(format!("{path}: no type"));
    }
    for key in ["anyOf", "oneOf", "allOf", "not"] {
        if obj.contains_key(key) && !typed {
            out.push(format!("{path}: untyped {key}"));
        }
    }
    if obj.get("nullable") == Some(&Value::Bool(true)) && path.starts_with("spec") {
        out.push(format!(
            "{path}: nullable spec field (explicit nulls would skip defaults)"
        ));
    }
    if let Some(Value::Array(types)) = obj.get("type") {
        out.push(format!("{path}: type array {types:?}"));
    }
    if obj.contains_key("x-kubernetes-list-map-keys")
        && obj.get("x-kubernetes-list-type") != Some(&Value::String("map".into()))
    {
        out.push(format!("{path}: list-map-keys without list-type map"));
    }
    if let Some(Value::Object(props)) = obj.get("properties") {
        if obj.get("type").and_then(Value::as_str) != Some("object") {
            out.push(format!("{path}: properties on a non-object"));
        }
        for (name, child) in props {
            let child_path = if path.is_empty() {
                name.clone()
            } else {
                format!("{path}.{name}")
            };
            structural_violations(child, &child_path, out);
        }
    }
    if let Some(items) = obj.get("items") {
        structural_violations(items, &format!("{path}[]"), out);
    }
}

#[test]
fn schema_is_structural() {
    let schema = crd::openapi_schema();
    let mut violations = Vec::new();
    structural_violations(&schema, "", &mut violations);
    assert!(violations.is_empty(), "{violations:#?}");
}

#[test]
fn structural_check_catches_a_bad_schema() {
    let bad = serde_json::json!({
        "type": "object",
        "properties": {
            "spec": {"type": "object", "properties": {
                "a": {"$ref": "#/definitions/A"},
                "b": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
                "c": {"type": ["string", "null"]}
            }}
        }
    });
    let mut violations = Vec::new();
    structural_violations(&bad, "", &mut violations);
    for expected in [
        "spec.a: $ref is not allowed",
        "spec.b: untyped anyOf",
        "spec.c: no type",
    ] {
        assert!(
            violations.iter().any(|v| v == expected),
            "{expected} missing from {violations:#?}"
        );
    }
}

#[test]
fn defaults_are_in_the_schema() {
    let schema = crd::openapi_schema();
    let spec = &schema["properties"]["spec"]["properties"];
    assert_eq!(spec["port"]["default"], 3128);
    assert_eq!(spec["maxLeases"]["default"], 5);
    assert_eq!(spec["maxLeases"]["minimum"], 0.0);
    assert_eq!(spec["healthCheck"]["default"], serde_json::json!({}));
    assert_eq!(spec["cordoned"]["type"], "boolean");
    assert_eq!(spec["cordoned"]["default"], false);
    let required = schema["properties"]["spec"]["required"].as_array().unwrap();
    assert!(!required.contains(&"cordoned".into()), "{required:?}");
    let hc = &spec["healthCheck"]["properties"];
    assert_eq!(
        hc["probeURL"]["default"],
        "https://www.gstatic.com/generate_204"
    );
    assert_eq!(hc["interval"]["default"], "30s");
    assert_eq!(hc["timeout"]["default"], "5s");
    assert_eq!(hc["failureThreshold"]["default"], 3);
    assert_eq!(hc["successThreshold"]["default"], 1);
    assert_eq!(
        hc["expectedStatusCodes"]["default"],
        serde_json::json!([200, 204])
    );
    assert_eq!(spec["provider"]["minLength"], 1);
    assert_eq!(spec["cloudInit"]["properties"]["inline"]["minLength"], 1);
}

#[test]
fn conditions_are_a_list_map_keyed_by_type() {
    let schema = crd::openapi_schema();
    let conditions = &schema["properties"]["status"]["properties"]["conditions"];
    assert_eq!(conditions["x-kubernetes-list-type"], "map");
    assert_eq!(
        conditions["x-kubernetes-list-map-keys"],
        serde_json::json!(["type"])
    );
}

#[test]
fn every_spec_field_is_documented() {
    fn undocumented(node: &Value, path: &str, out: &mut Vec<String>) {
        if let Some(Value::Object(props)) = node.get("properties") {
            for (name, child) in props {
                let p = format!("{path}.{name}");
                if child
                    .get("description")
                    .and_then(Value::as_str)
                    .is_none_or(str::is_empty)
                {
                    out.push(p.clone());
                }
                undocumented(child, &p, out);
                if let Some(items) = child.get("items") {
                    undocumented(items, &p, out);
                }
            }
        }
    }
    let schema = crd::openapi_schema();
    let mut missing = Vec::new();
    undocumented(&schema["properties"]["spec"], "spec", &mut missing);
    undocumented(&schema["properties"]["status"], "status", &mut missing);
    assert!(
        missing.is_empty(),
        "fields without a description: {missing:?}"
    );
}

/// Removes every `default` below `node`: the API server checks a default value against the
/// rules as it is written, without filling the defaults nested inside it.
fn without_defaults(node: &Value) -> Value {
    match node {
        Value::Object(map) => Value::Object(
            map.iter()
                .filter(|(k, _)| *k != "default")
                .map(|(k, v)| (k.clone(), without_defaults(v)))
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.iter().map(without_defaults).collect()),
        other => other.clone(),
    }
}

/// Every schema node with a `default`, as (path, node).
fn defaulted_nodes<'a>(node: &'a Value, path: &str, out: &mut Vec<(String, &'a Value)>) {
    if node.get("default").is_some() {
        out.push((path.to_owned(), node));
    }
    if let Some(Value::Object(props)) = node.get("properties") {
        for (name, child) in props {
            defaulted_nodes(child, &format!("{path}.{name}"), out);
        }
    }
    if let Some(items) = node.get("items") {
        defaulted_nodes(items, &format!("{path}[]"), out);
    }
}

#[test]
fn every_default_passes_the_rules_of_its_own_schema() {
    // The API server refuses a CRD whose default breaks a rule at the default's level, and it
    // evaluates the rule on the default as written: `healthCheck: {}` has no `interval` yet.
    let schema = crd::openapi_schema();
    let mut nodes = Vec::new();
    defaulted_nodes(&schema, "", &mut nodes);
    assert!(
        nodes.iter().any(|(p, _)| p == ".spec.healthCheck"),
        "{:?}",
        nodes.iter().map(|(p, _)| p).collect::<Vec<_>>()
    );
    for (path, node) in nodes {
        let compiled = kube_cel::compile_schema(&without_defaults(node));
        assert!(!compiled.has_errors(), "{path}: rules do not compile");
        let result =
            kube_cel::Validator::new().validate_compiled(&compiled, &node["default"], None);
        assert!(
            result.is_ok(),
            "{path}: default {}: {result:?}",
            node["default"]
        );
    }
}

#[test]
fn max_lifetime_is_checked_like_the_health_check_durations() {
    use proxy_operator::resources::duration;
    let schema = crd::openapi_schema();
    let spec = &schema["properties"]["spec"];
    let lifetime = &spec["properties"]["maxLifetime"];
    let interval = &spec["properties"]["healthCheck"]["properties"]["interval"];
    assert_eq!(lifetime["type"], "string");
    assert_eq!(lifetime["maxLength"], interval["maxLength"]);
    assert_eq!(lifetime["maxLength"], duration::MAX_LENGTH);
    assert!(lifetime.get("default").is_none(), "{lifetime}");
    let required = spec["required"].as_array().cloned().unwrap_or_default();
    assert!(!required.contains(&"maxLifetime".into()), "{required:?}");
    let rules = |node: &Value| -> Vec<(String, String)> {
        node["x-kubernetes-validations"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|r| {
                (
                    r["rule"].as_str().unwrap_or_default().to_owned(),
                    r["message"].as_str().unwrap_or_default().to_owned(),
                )
            })
            .collect()
    };
    let expected = [
        (duration::field_rule(), duration::FIELD_MESSAGE.to_owned()),
        (
            duration::at_least_rule(duration::MIN_MAX_LIFETIME),
            duration::MAX_LIFETIME_MESSAGE.to_owned(),
        ),
    ];
    assert_eq!(rules(lifetime), expected);
    // The syntax rule is the interval's, word for word.
    assert_eq!(rules(interval), expected[..1]);
    assert!(
        rules(spec).contains(&(
            "self.mode != 'External' || !has(self.maxLifetime)".to_owned(),
            "maxLifetime must not be set when mode is External".to_owned()
        )),
        "{:?}",
        rules(spec)
    );
}
