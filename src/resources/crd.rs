//! The `Proxy` CustomResourceDefinition as generated from the Rust types.
//!
//! `proxy-operator crd` prints [`crd_yaml`]; `crd/proxy.yaml` is that output committed, and a
//! test fails when the two drift.

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt;
use serde_json::Value;

use super::proxy::Proxy;

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
