//! The schema transform every CRD type of this crate carries: kube marks each `Option` field
//! `nullable`, which would make the API server keep an explicit `null` instead of applying the
//! field's default.

use serde_json::Value;

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
