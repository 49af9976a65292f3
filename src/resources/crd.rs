//! The CustomResourceDefinitions as generated from the Rust types: `Proxy` and `ProxyPool`.
//!
//! `proxy-operator crd` prints [`all_yaml`] (both, as two YAML documents); `crd/proxy.yaml` and
//! `crd/proxypool.yaml` are [`Kind::yaml`] of each, committed, and a test fails when they drift.

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt;
use serde_json::Value;

use super::pool::ProxyPool;
use super::proxy::Proxy;

/// One of the operator's resources.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Kind {
    /// `proxies.crawl.example.com`.
    Proxy,
    /// `proxypools.crawl.example.com`.
    #[value(name = "proxypool")]
    ProxyPool,
}

impl Kind {
    /// Every resource, in the order `proxy-operator crd` prints them.
    pub const ALL: [Kind; 2] = [Kind::Proxy, Kind::ProxyPool];

    /// The CRD object.
    pub fn crd(self) -> CustomResourceDefinition {
        match self {
            Kind::Proxy => Proxy::crd(),
            Kind::ProxyPool => without_nullable_int_or_string(ProxyPool::crd()),
        }
    }

    /// The CRD rendered as YAML, exactly as committed in `crd/`.
    pub fn yaml(self) -> Result<String, serde_saphyr::ser::Error> {
        serde_saphyr::to_string(&self.crd())
    }

    /// The committed file under `crd/`.
    pub fn file(self) -> &'static str {
        match self {
            Kind::Proxy => "crd/proxy.yaml",
            Kind::ProxyPool => "crd/proxypool.yaml",
        }
    }
}

/// `crd` without `nullable` on int-or-string fields. kube marks a field without a `type` as
/// nullable, so the API server would keep an explicit `null` in `maxSurge` instead of applying
/// its default (see `schema::strip_nullable` for the same on every other field).
fn without_nullable_int_or_string(crd: CustomResourceDefinition) -> CustomResourceDefinition {
    fn strip(value: &mut Value) {
        match value {
            Value::Object(object) => {
                if object.contains_key("x-kubernetes-int-or-string") {
                    object.remove("nullable");
                }
                object.values_mut().for_each(strip);
            }
            Value::Array(items) => items.iter_mut().for_each(strip),
            _ => {}
        }
    }
    let Ok(mut value) = serde_json::to_value(&crd) else {
        return crd;
    };
    strip(&mut value);
    serde_json::from_value(value).unwrap_or(crd)
}

/// The CRD object for `proxies.crawl.example.com`.
pub fn crd() -> CustomResourceDefinition {
    Kind::Proxy.crd()
}

/// The `Proxy` CRD rendered as YAML, exactly as committed in `crd/proxy.yaml`.
pub fn crd_yaml() -> Result<String, serde_saphyr::ser::Error> {
    Kind::Proxy.yaml()
}

/// `kinds` rendered as YAML documents separated by `---`: what `proxy-operator crd` prints.
pub fn all_yaml(kinds: &[Kind]) -> Result<String, serde_saphyr::ser::Error> {
    let documents = kinds
        .iter()
        .map(|kind| kind.yaml())
        .collect::<Result<Vec<_>, _>>()?;
    Ok(documents.join("---\n"))
}

/// The `openAPIV3Schema` of the served version of `kind`, as JSON (what CEL rules are
/// evaluated over).
pub fn schema_of(kind: Kind) -> Value {
    kind.crd()
        .spec
        .versions
        .first()
        .and_then(|v| v.schema.as_ref())
        .and_then(|s| s.open_api_v3_schema.as_ref())
        .and_then(|s| serde_json::to_value(s).ok())
        .unwrap_or(Value::Null)
}

/// The `openAPIV3Schema` of the `Proxy` CRD.
pub fn openapi_schema() -> Value {
    schema_of(Kind::Proxy)
}
