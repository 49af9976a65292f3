//! The `Proxy` CustomResourceDefinition as generated from the Rust types.
//!
//! `proxy-operator crd` prints [`crd_yaml`]; `crd/proxy.yaml` is that output committed, and a
//! test fails when the two drift.

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt;
use serde_json::Value;

use crate::proxy::Proxy;

/// The CRD object for `proxies.crawl.example.com`.
pub fn crd() -> CustomResourceDefinition {
    Proxy::crd()
}

/// The CRD rendered as YAML, exactly as committed in `crd/proxy.yaml`.
pub fn crd_yaml() -> Result<String, serde_saphyr::ser::Error> {
    serde_saphyr::to_string(&crd())
}

/// The `openAPIV3Schema` of the served version, as JSON (what CEL rules are evaluated over).
pub fn openapi_schema() -> Value {
    crd()
        .spec
        .versions
        .first()
        .and_then(|v| v.schema.as_ref())
        .and_then(|s| s.open_api_v3_schema.as_ref())
        .and_then(|s| serde_json::to_value(s).ok())
        .unwrap_or(Value::Null)
}

/// schemars transform that removes `null` from every `type` array, `enum` list and
/// `anyOf`/`oneOf` alternative below the annotated struct.
///
/// Without it kube marks every `Option` field `nullable: true`, and the API server then keeps an
/// explicit `null` sent by a client instead of dropping it and applying the field's default.
pub fn strip_nullable(schema: &mut schemars::Schema) {
    if let Some(obj) = schema.as_object_mut() {
        strip_null_object(obj);
    }
}

fn strip_null_value(value: &mut Value) {
    if let Some(obj) = value.as_object_mut() {
        strip_null_object(obj);
    }
}

fn strip_null_object(obj: &mut serde_json::Map<String, Value>) {
    if let Some(Value::Array(types)) = obj.get_mut("type") {
        types.retain(|t| t != "null");
        if types.len() == 1 {
            let only = types.remove(0);
            obj.insert("type".into(), only);
        }
    }
    if let Some(Value::Array(values)) = obj.get_mut("enum") {
        values.retain(|v| !v.is_null());
    }
    obj.remove("nullable");
    for key in ["anyOf", "oneOf"] {
        let Some(Value::Array(alternatives)) = obj.get_mut(key) else {
            continue;
        };
        alternatives.retain(|alt| !is_null_schema(alt));
        if alternatives.len() == 1 {
            let only = match obj.remove(key) {
                Some(Value::Array(mut alternatives)) => alternatives.pop(),
                _ => None,
            };
            if let Some(Value::Object(only)) = only {
                for (k, v) in only {
                    obj.entry(k).or_insert(v);
                }
            }
        }
    }
    for child in obj.values_mut() {
        match child {
            Value::Object(_) => strip_null_value(child),
            Value::Array(items) => items.iter_mut().for_each(strip_null_value),
            _ => {}
        }
    }
}

fn is_null_schema(schema: &Value) -> bool {
    schema.get("type") == Some(&Value::String("null".into()))
        || schema.get("enum") == Some(&Value::Array(vec![Value::Null]))
        || schema.get("const") == Some(&Value::Null)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn strip_nullable_removes_null_from_types_enums_and_alternatives() {
        let mut schema = schemars::Schema::try_from(json!({
            "properties": {
                "a": {"type": ["string", "null"], "nullable": true},
                "b": {"enum": ["X", null]},
                "c": {"anyOf": [{"type": "object", "properties": {}}, {"type": "null"}]},
                "d": {"type": "array", "items": {"type": ["integer", "null"]}}
            }
        }))
        .unwrap();
        strip_nullable(&mut schema);
        assert_eq!(
            schema.as_value(),
            &json!({
                "properties": {
                    "a": {"type": "string"},
                    "b": {"enum": ["X"]},
                    "c": {"type": "object", "properties": {}},
                    "d": {"type": "array", "items": {"type": "integer"}}
                }
            })
        );
    }
}
