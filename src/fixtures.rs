//! Builders of the objects tests and benches start from, in one place (behind the `fixtures`
//! feature, which the crate's own tests and benches turn on): Proxies in the state a test
//! needs, the reconciler's inputs for a settled machine, a provider's instance, a health
//! transition, a lease candidate. Each builder starts from the common case; a test says only what differs.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde_json::{Value, json};

use crate::controllers::proxy::remediation::Gate;
use crate::controllers::proxy::{Inputs, Limits, Observation};
use crate::health::HealthTransition;
use crate::ledger::Candidate;
use crate::provider::{Instance, InstanceState};
use crate::resources::proxy::{Proxy, ProxyId, ProxySpec, ProxyStatus};
use crate::resources::spec_hash::SPEC_HASH_VERSION;

/// Namespace of every fixture Proxy unless a test picks another.
pub const NAMESPACE: &str = "crawl";

/// `pairs` as a label map (labels, selectors).
pub fn label_map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

/// A Proxy under construction: `Proxy::test`-style, each method sets one thing.
#[derive(Debug, Clone)]
pub struct ProxyBuilder {
    name: String,
    spec: Value,
    namespace: String,
    uid: Option<String>,
    labels: BTreeMap<String, String>,
    status: Option<ProxyStatus>,
    deleting: bool,
    finalizers: Vec<String>,
}

/// An External Proxy `name` at `host:port`, in [`NAMESPACE`], with UID `uid-<name>`.
pub fn external(name: &str, host: &str, port: u16) -> ProxyBuilder {
    ProxyBuilder::new(
        name,
        json!({"mode": "External", "endpoint": {"host": host, "port": port}}),
    )
}

/// A Managed Proxy `name` of provider `provider`, in [`NAMESPACE`], with UID `uid-<name>`.
pub fn managed(name: &str, provider: &str) -> ProxyBuilder {
    ProxyBuilder::new(name, json!({"mode": "Managed", "provider": provider}))
}

impl ProxyBuilder {
    fn new(name: &str, spec: Value) -> Self {
        ProxyBuilder {
            name: name.to_owned(),
            spec,
            namespace: NAMESPACE.to_owned(),
            uid: Some(format!("uid-{name}")),
            labels: BTreeMap::new(),
            status: None,
            deleting: false,
            finalizers: Vec::new(),
        }
    }

    /// In namespace `namespace`.
    pub fn namespace(mut self, namespace: &str) -> Self {
        self.namespace = namespace.to_owned();
        self
    }

    /// With UID `uid` (`None`: an object not yet stored).
    pub fn uid(mut self, uid: Option<&str>) -> Self {
        self.uid = uid.map(str::to_owned);
        self
    }

    /// With these labels (what selectors match).
    pub fn labels(mut self, labels: &[(&str, &str)]) -> Self {
        self.labels.extend(label_map(labels));
        self
    }

    /// With one more spec field, as `kubectl apply` would send it (`spec.<field> = value`).
    pub fn spec(mut self, field: &str, value: Value) -> Self {
        self.spec[field] = value;
        self
    }

    /// With `spec.maxLeases`.
    pub fn max_leases(self, max_leases: i32) -> Self {
        self.spec("maxLeases", json!(max_leases))
    }

    /// Probed through `probe_url` every `interval` (timeout 5 s), healthy after one success
    /// and unhealthy after one failure.
    pub fn probed(self, probe_url: &str, interval: &str) -> Self {
        self.spec(
            "healthCheck",
            json!({
                "probeURL": probe_url, "interval": interval, "timeout": "5s",
                "successThreshold": 1, "failureThreshold": 1,
            }),
        )
    }

    /// With this status.
    pub fn status(mut self, status: ProxyStatus) -> Self {
        self.status = Some(status);
        self
    }

    /// With our finalizer.
    pub fn finalized(mut self) -> Self {
        self.finalizers
            .push(crate::resources::proxy::FINALIZER.to_owned());
        self
    }

    /// Being deleted (a deletionTimestamp at the Unix epoch).
    pub fn deleting(mut self) -> Self {
        self.deleting = true;
        self
    }

    /// The Proxy; panics on a spec the types refuse (a test's own mistake).
    pub fn build(self) -> Proxy {
        let spec: ProxySpec = serde_json::from_value(self.spec.clone())
            .unwrap_or_else(|e| panic!("fixture spec {}: {e}", self.spec));
        let mut proxy = Proxy::new(&self.name, spec);
        proxy.metadata.namespace = Some(self.namespace);
        proxy.metadata.uid = self.uid;
        if !self.labels.is_empty() {
            proxy.metadata.labels = Some(self.labels);
        }
        if !self.finalizers.is_empty() {
            proxy.metadata.finalizers = Some(self.finalizers);
        }
        if self.deleting {
            proxy.metadata.deletion_timestamp = Some(Time(Timestamp::UNIX_EPOCH));
        }
        proxy.status = self.status;
        proxy
    }
}

/// The ID of a fixture proxy `name`: in [`NAMESPACE`], UID `uid-<name>`.
pub fn proxy_id(name: &str) -> ProxyId {
    ProxyId {
        namespace: NAMESPACE.to_owned(),
        name: name.to_owned(),
        uid: format!("uid-{name}"),
    }
}

/// A health transition of proxy `p1` probed through `proxy_url`, finished at `at`, with 42 ms
/// latency.
pub fn transition(healthy: bool, proxy_url: &str, at: Timestamp) -> HealthTransition {
    HealthTransition {
        id: proxy_id("p1"),
        healthy,
        latency: Duration::from_millis(42),
        at,
        message: if healthy { "204" } else { "connection refused" }.to_owned(),
        proxy_url: proxy_url.to_owned(),
    }
}

/// The machine `proxy-x` of provider ID `ns/proxy-x` in `state`, created a minute before
/// `now`; a running one has the address `10.0.0.9`.
pub fn instance(state: InstanceState, now: Timestamp) -> Instance {
    Instance {
        provider_id: "ns/proxy-x".to_owned(),
        name: "proxy-x".to_owned(),
        state,
        ip: (state == InstanceState::Running).then(|| "10.0.0.9".to_owned()),
        uid: Some("u".to_owned()),
        created_at: now.checked_sub(Duration::from_secs(60)).ok(),
        waiting: None,
        deletion_deadline: None,
    }
}

/// The spec hash every [`settled`] input records and asks for.
pub const HASH: &str = "hash-new";

/// The self-healing limits of the defaults: start-up 10 min, force-delete margin 30 s, drain
/// 15 min, remediation after 10 min.
pub fn limits() -> Limits {
    Limits {
        startup_timeout: Duration::from_secs(600),
        force_delete_margin: Duration::from_secs(30),
        drain_timeout: Duration::from_secs(900),
        remediate_after: Duration::from_secs(600),
    }
}

/// What [`decide`](crate::controllers::proxy::decide) sees of a settled Managed proxy at `now`: the
/// finalizer on, its machine `ns/proxy-x` recorded with hash A == H ([`HASH`]) of the current
/// hash version, phase Ready with an address, nothing pending, held, draining or due, no lease,
/// no health verdict yet; `observation` is what the provider said.
pub fn settled(observation: &Observation, now: Timestamp) -> Inputs<'_> {
    Inputs {
        mode: crate::resources::proxy::Mode::Managed,
        deleting: false,
        deletion_requested: None,
        finalizer_present: true,
        provider_id: Some("ns/proxy-x"),
        recorded_hash: Some(HASH),
        recorded_hash_version: Some(SPEC_HASH_VERSION),
        create_pending: None,
        desired_hash: Some(HASH),
        cloud_init_problem: None,
        failed_this_generation: false,
        phase: Some(crate::resources::proxy::Phase::Ready),
        had_ip: true,
        not_provisioned_since: None,
        hold_until: None,
        now,
        limits: limits(),
        observation,
        disruption: None,
        active_leases: 0,
        uid: "uid-1",
        max_lifetime: None,
        rotate_requested: false,
        unhealthy_since: None,
        health: None,
        remediation: Gate::Allowed,
    }
}

/// A healthy proxy `crawl/<name>` (UID `uid-<name>`) without a measured latency, granting
/// `max_leases` at once: the candidate of an acquire. Tests that need another health or a
/// latency set those fields with `Candidate { .., ..candidate(name, max_leases) }`.
pub fn candidate(name: &str, max_leases: u32) -> Candidate {
    Candidate {
        proxy: Arc::new(ProxyId {
            namespace: NAMESPACE.into(),
            name: name.into(),
            uid: format!("uid-{name}"),
        }),
        max_leases,
        healthy: true,
        cordoned: false,
        draining: false,
        latency: None,
    }
}
