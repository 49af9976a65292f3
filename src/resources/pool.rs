//! The `ProxyPool` custom resource (`crawl.example.com/v1alpha1`): a replicated, optionally
//! autoscaled set of Managed Proxies made from one template, the way a Deployment is a set of
//! Pods. Its members are ordinary `Proxy` objects (see `crate::controllers::pool` for the controller).
//!
//! The doc comments on fields become `kubectl explain` text, so they are written for users.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

use super::proxy::{Condition, Proxy, ProxySpec};

/// Label on every member Proxy naming its pool (in the pool's namespace).
pub const POOL_LABEL: &str = "crawl.example.com/pool";
/// The pool `proxy` is a member of (its [`POOL_LABEL`]), if any.
pub fn member_of(proxy: &Proxy) -> Option<&str> {
    proxy
        .metadata
        .labels
        .as_ref()?
        .get(POOL_LABEL)
        .map(String::as_str)
}

/// Label on every member Proxy carrying the hash of the template it was made from.
pub const TEMPLATE_HASH_LABEL: &str = "crawl.example.com/template-hash";
/// Finalizer on a pool: its members (and through theirs, their machines) are deleted first.
pub const POOL_FINALIZER: &str = "crawl.example.com/pool-members";

/// Annotation the pool puts on a member before deleting it: why it goes ([`Removal`]), so the
/// member's drain says so and holds a slot of the replacement budget while it drains.
pub const REMOVAL_ANNOTATION: &str = "crawl.example.com/pool-removal";

/// Default `spec.replicas`.
pub const DEFAULT_REPLICAS: i32 = 1;
/// Default `autoscaling.targetUtilization`.
pub const DEFAULT_TARGET_UTILIZATION: f64 = 0.7;
/// Default `autoscaling.scaleDownAfter`.
pub const DEFAULT_SCALE_DOWN_AFTER: Duration = Duration::from_secs(600);
/// Default `autoscaling.wakeTimeout`.
pub const DEFAULT_WAKE_TIMEOUT: Duration = Duration::from_secs(60);
/// Longest pool name: it is a label value on every member (at most 63 characters).
pub const MAX_POOL_NAME: usize = 63;

/// Condition type: enough members are Ready (`readyReplicas >= replicas - maxUnavailable`).
pub const CONDITION_AVAILABLE: &str = "Available";
/// Condition type: members are being created, rolled or removed towards the desired state.
pub const CONDITION_PROGRESSING: &str = "Progressing";
/// Condition type: the pool wants more members than it may have (its reason says why).
pub const CONDITION_SCALING_LIMITED: &str = "ScalingLimited";

/// A set of Managed Proxies made from one template.
// Every `printcolumn(...)` repeats `type_ = ...`; that is the derive's syntax, not a mistake.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "crawl.example.com",
    version = "v1alpha1",
    kind = "ProxyPool",
    namespaced,
    shortname = "pxp",
    status = "ProxyPoolStatus",
    derive = "PartialEq",
    doc = "A replicated, optionally autoscaled set of Managed Proxies made from one template: \
           scale it with `kubectl scale`, an HPA or its own autoscaling (down to zero, woken by \
           requests).",
    scale(
        spec_replicas_path = ".spec.replicas",
        status_replicas_path = ".status.replicas",
        label_selector_path = ".status.selector"
    ),
    validation = Rule::new(format!("self.metadata.name.size() <= {MAX_POOL_NAME}"))
        .message("a pool's name is a label value on its members: at most 63 characters"),
    printcolumn(name = "Desired", type_ = "integer", json_path = ".spec.replicas"),
    printcolumn(name = "Ready", type_ = "integer", json_path = ".status.readyReplicas"),
    printcolumn(name = "Utilization", type_ = "number", json_path = ".status.utilization"),
    printcolumn(
        name = "Reason",
        type_ = "string",
        json_path = ".status.desiredReason",
        priority = 1
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[x_kube(
    validation = Rule::new("!has(self.autoscaling) || self.template.spec.maxLeases > 0")
        .message("autoscaling needs template.spec.maxLeases above 0 (it scales by lease capacity)")
)]
#[schemars(transform = super::schema::strip_nullable)]
#[serde(rename_all = "camelCase")]
pub struct ProxyPoolSpec {
    /// How many members the pool keeps. With `autoscaling` the operator writes it itself;
    /// otherwise `kubectl scale`, an HPA or KEDA may (through the `/scale` subresource).
    #[serde(default = "default_replicas")]
    #[schemars(range(min = 0))]
    pub replicas: i32,

    /// What every member is made from: its labels, annotations and Managed Proxy spec. A change
    /// rolls the pool (new members, then the old ones drain and go); members are never edited.
    pub template: ProxyTemplate,

    /// How a template change rolls.
    #[serde(default)]
    #[schemars(extend("default" = {}))]
    pub strategy: Strategy,

    /// Scaling to demand (active leases and refused requests), down to zero with
    /// `minReplicas: 0`. The autoscaler writes `spec.replicas`; do not also give the pool to an
    /// HPA or KEDA.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autoscaling: Option<Autoscaling>,
}

/// A member's labels, annotations and spec.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[x_kube(
    validation = Rule::new("self.spec.mode == 'Managed'")
        .message("a pool's members are Managed proxies: template.spec.mode must be Managed")
)]
#[schemars(transform = template_transform)]
#[serde(rename_all = "camelCase")]
pub struct ProxyTemplate {
    /// Labels and annotations of every member.
    #[serde(default)]
    #[schemars(extend("default" = {}))]
    pub metadata: TemplateMetadata,
    /// The Managed Proxy spec of every member.
    pub spec: ProxySpec,
}

/// The metadata a member takes from the template.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[x_kube(
    validation = Rule::new(format!(
        "!has(self.labels) || !('{POOL_LABEL}' in self.labels || '{TEMPLATE_HASH_LABEL}' in self.labels)"
    ))
    .message("template labels must not set crawl.example.com/pool or crawl.example.com/template-hash: the operator sets them")
)]
#[schemars(transform = super::schema::strip_nullable)]
#[serde(rename_all = "camelCase")]
pub struct TemplateMetadata {
    /// Labels of every member: what crawlers select on (e.g. `geo: eu`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// Annotations of every member.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

/// How many members a roll-out may add above `replicas` and take out of service at once.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[x_kube(
    validation = Rule::new(
        "!has(self.maxSurge) || !has(self.maxUnavailable) || !(string(self.maxSurge) in ['0', '0%'] && string(self.maxUnavailable) in ['0', '0%'])"
    )
    .message("maxSurge and maxUnavailable must not both be 0: nothing could roll")
)]
#[schemars(transform = super::schema::strip_nullable)]
#[serde(rename_all = "camelCase")]
pub struct Strategy {
    /// Members a roll-out may create above `replicas`: a count (`1`) or a percentage of
    /// `replicas` (`25%`, rounded up).
    #[serde(default = "default_max_surge")]
    #[schemars(schema_with = "count_or_percent")]
    pub max_surge: IntOrString,
    /// Members a roll-out may take out of service below `replicas`: a count (`0`) or a
    /// percentage of `replicas` (rounded down).
    #[serde(default = "default_max_unavailable")]
    #[schemars(schema_with = "count_or_percent")]
    pub max_unavailable: IntOrString,
}

impl Default for Strategy {
    fn default() -> Self {
        Strategy {
            max_surge: default_max_surge(),
            max_unavailable: default_max_unavailable(),
        }
    }
}

/// Scaling to demand.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[x_kube(
    validation = Rule::new("self.minReplicas <= self.maxReplicas")
        .message("minReplicas must not be above maxReplicas")
)]
#[schemars(transform = super::schema::strip_nullable)]
#[serde(rename_all = "camelCase")]
pub struct Autoscaling {
    /// Fewest members; 0 lets an idle pool sleep with no machine running.
    #[serde(default = "default_min_replicas")]
    #[schemars(range(min = 0))]
    pub min_replicas: i32,
    /// Most members (a roll-out may add `maxSurge` above it).
    #[schemars(range(min = 1))]
    pub max_replicas: i32,
    /// Active leases ÷ lease capacity the pool aims for, above 0 and at most 1.
    #[serde(default = "default_target_utilization")]
    #[schemars(range(min = 0.01, max = 1.0))]
    pub target_utilization: f64,
    /// How long demand must stay below target before one member goes, in the syntax of a
    /// Proxy's `healthCheck.interval`. Refused requests count as demand for a minute, so a pool
    /// that refused requests stays up at least that minute plus this.
    #[serde(
        default = "default_scale_down_after",
        deserialize_with = "super::duration::deserialize"
    )]
    #[schemars(length(max = 64))]
    #[x_kube(
        validation = Rule::new(super::duration::field_rule()).message(super::duration::FIELD_MESSAGE)
    )]
    pub scale_down_after: kube::core::Duration,
    /// How long a request for a pool with no Ready member may wait while it wakes: the
    /// gateway holds the connection that long, the API answers `503 pool_waking`.
    #[serde(
        default = "default_wake_timeout",
        deserialize_with = "super::duration::deserialize"
    )]
    #[schemars(length(max = 64))]
    #[x_kube(
        validation = Rule::new(super::duration::field_rule()).message(super::duration::FIELD_MESSAGE)
    )]
    pub wake_timeout: kube::core::Duration,
}

impl Autoscaling {
    /// `scaleDownAfter` as a std duration.
    pub fn scale_down_after(&self) -> Duration {
        self.scale_down_after.into()
    }

    /// `wakeTimeout` as a std duration.
    pub fn wake_timeout(&self) -> Duration {
        self.wake_timeout.into()
    }
}

/// Observed state, written only by the pool controller.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[schemars(transform = super::schema::strip_nullable)]
#[serde(rename_all = "camelCase")]
pub struct ProxyPoolStatus {
    /// Members that exist and are not being deleted.
    #[serde(default)]
    pub replicas: i32,
    /// Members in phase Ready.
    #[serde(default)]
    pub ready_replicas: i32,
    /// Members made from the current template.
    #[serde(default)]
    pub updated_replicas: i32,
    /// The label selector of the members, as a string (what an HPA reads through `/scale`).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub selector: String,
    /// Active leases ÷ lease capacity of the Ready members, when there is capacity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub utilization: Option<f64>,
    /// How many members the autoscaler (or `spec.replicas`) asks for now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub desired_replicas: Option<i32>,
    /// Why that many: `Manual` (no autoscaling: `spec.replicas` as set), or the autoscaler's
    /// `ScaleUp`, `ScaleDown`, `BelowTarget`, `AtTarget`, `AtMax`, `AtMin`, `OutOfRange`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub desired_reason: Option<String>,
    /// When `spec.replicas` last changed by the autoscaler.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<String>", extend("format" = "date-time"))]
    pub last_scale_time: Option<jiff::Timestamp>,
    /// Since when demand has been below what the current members serve at target: a member
    /// goes once this is `scaleDownAfter` old.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<String>", extend("format" = "date-time"))]
    pub below_target_since: Option<jiff::Timestamp>,
    /// Available, Progressing and ScalingLimited.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["type".into()]))]
    pub conditions: Vec<Condition>,
    /// Generation of the spec this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

impl ProxyPoolStatus {
    /// The condition of the given type, if present.
    pub fn condition(&self, type_: &str) -> Option<&Condition> {
        self.conditions.iter().find(|c| c.type_ == type_)
    }
}

impl Strategy {
    /// `maxSurge` for `replicas` members (percentages round up), or why it cannot be read.
    pub fn surge(&self, replicas: u32) -> Result<u32, String> {
        resolve(&self.max_surge, replicas, true).map_err(|e| format!("maxSurge: {e}"))
    }

    /// `maxUnavailable` for `replicas` members (percentages round down).
    pub fn unavailable(&self, replicas: u32) -> Result<u32, String> {
        resolve(&self.max_unavailable, replicas, false).map_err(|e| format!("maxUnavailable: {e}"))
    }
}

/// A count, or a percentage of `replicas` rounded up or down.
fn resolve(value: &IntOrString, replicas: u32, round_up: bool) -> Result<u32, String> {
    let text = match value {
        IntOrString::Int(n) => return u32::try_from(*n).map_err(|_| format!("{n} is negative")),
        IntOrString::String(text) => text,
    };
    let (digits, percent) = match text.strip_suffix('%') {
        Some(digits) => (digits, true),
        None => (text.as_str(), false),
    };
    let number: u32 = digits
        .parse()
        .ok()
        .filter(|_| digits.bytes().all(|b| b.is_ascii_digit()))
        .ok_or_else(|| format!("{text:?} is not a count or a percentage (e.g. 1 or 25%)"))?;
    if !percent {
        return Ok(number);
    }
    if number > 100 {
        return Err(format!("{text:?} is more than 100%"));
    }
    let scaled = u64::from(replicas) * u64::from(number);
    let whole = if round_up {
        scaled.div_ceil(100)
    } else {
        scaled / 100
    };
    Ok(u32::try_from(whole).unwrap_or(u32::MAX))
}

/// The schema of an int-or-string field holding a count or a percentage.
fn count_or_percent(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "x-kubernetes-int-or-string": true,
        "x-kubernetes-validations": [{
            "rule": "type(self) == int ? self >= 0 : self.matches('^(100|[1-9]?[0-9])%$')",
            "message": "must be a count (e.g. 1) or a percentage from 0% to 100% (e.g. 25%)"
        }]
    })
}

/// The template's schema: the Proxy spec's rules that compare with `oldSelf` (a Proxy's mode
/// and provider are immutable) do not apply to a template, whose every change rolls the pool.
fn template_transform(schema: &mut schemars::Schema) {
    super::schema::strip_nullable(schema);
    let rules = schema
        .as_object_mut()
        .and_then(|o| o.get_mut("properties"))
        .and_then(|p| p.get_mut("spec"))
        .and_then(|s| s.get_mut("x-kubernetes-validations"))
        .and_then(serde_json::Value::as_array_mut);
    if let Some(rules) = rules {
        rules.retain(|rule| {
            !rule
                .get("rule")
                .and_then(serde_json::Value::as_str)
                .is_some_and(|text| text.contains("oldSelf"))
        });
    }
}

fn default_replicas() -> i32 {
    DEFAULT_REPLICAS
}

fn default_max_surge() -> IntOrString {
    IntOrString::Int(1)
}

fn default_max_unavailable() -> IntOrString {
    IntOrString::Int(0)
}

fn default_min_replicas() -> i32 {
    1
}

fn default_target_utilization() -> f64 {
    DEFAULT_TARGET_UTILIZATION
}

fn default_scale_down_after() -> kube::core::Duration {
    DEFAULT_SCALE_DOWN_AFTER.into()
}

fn default_wake_timeout() -> kube::core::Duration {
    DEFAULT_WAKE_TIMEOUT.into()
}

impl ProxyPool {
    /// `namespace/name` of the pool (the key its demand is recorded under).
    pub fn key(&self) -> String {
        format!(
            "{}/{}",
            self.metadata
                .namespace
                .as_deref()
                .unwrap_or(super::proxy::DEFAULT_NAMESPACE),
            self.metadata.name.as_deref().unwrap_or_default()
        )
    }

    /// The label selector of its members, as `status.selector` carries it.
    pub fn selector(&self) -> String {
        format!(
            "{POOL_LABEL}={}",
            self.metadata.name.as_deref().unwrap_or_default()
        )
    }
}

/// Why the pool removes a member.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Removal {
    /// The pool has more members than it wants.
    ScaleDown,
    /// The member was made from an older template (or edited by hand) and a new one replaces it.
    Rollout,
}

impl Removal {
    /// The value of [`REMOVAL_ANNOTATION`] and the metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Removal::ScaleDown => "scale_down",
            Removal::Rollout => "rollout",
        }
    }

    /// What a member's drain comes before, in words.
    pub fn cause(self) -> &'static str {
        match self {
            Removal::ScaleDown => "a pool scale-down",
            Removal::Rollout => "a pool roll-out",
        }
    }

    /// The removal an annotation value names.
    pub fn parse(value: &str) -> Option<Removal> {
        [Removal::ScaleDown, Removal::Rollout]
            .into_iter()
            .find(|r| r.as_str() == value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn removals_round_trip_their_annotation() {
        for removal in [Removal::ScaleDown, Removal::Rollout] {
            assert_eq!(Removal::parse(removal.as_str()), Some(removal));
        }
        assert_eq!(Removal::parse("other"), None);
    }

    #[test]
    fn surge_and_unavailable_resolve_counts_and_percentages() {
        let strategy = |surge: IntOrString, unavailable: IntOrString| Strategy {
            max_surge: surge,
            max_unavailable: unavailable,
        };
        let pct = |s: &str| IntOrString::String(s.to_owned());
        for (strategy, replicas, surge, unavailable) in [
            (Strategy::default(), 3, 1, 0),
            (strategy(pct("25%"), pct("25%")), 10, 3, 2),
            (strategy(pct("100%"), IntOrString::Int(2)), 3, 3, 2),
            (strategy(pct("10%"), pct("10%")), 0, 0, 0),
            (strategy(pct("3"), pct("0%")), 5, 3, 0),
        ] {
            assert_eq!(strategy.surge(replicas), Ok(surge), "{strategy:?}");
            assert_eq!(
                strategy.unavailable(replicas),
                Ok(unavailable),
                "{strategy:?}"
            );
        }
        assert!(strategy(IntOrString::Int(-1), pct("0")).surge(3).is_err());
        assert!(strategy(pct("x%"), pct("0")).surge(3).is_err());
    }

    #[test]
    fn the_template_schema_drops_the_proxy_transition_rules_only() {
        let crd = serde_json::to_value(<ProxyPool as kube::CustomResourceExt>::crd())
            .expect("the CRD serializes");
        let spec = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
            ["template"]["properties"]["spec"];
        let rules: Vec<&str> = spec["x-kubernetes-validations"]
            .as_array()
            .expect("the Proxy spec rules")
            .iter()
            .filter_map(|r| r["rule"].as_str())
            .collect();
        assert!(!rules.is_empty());
        assert!(rules.iter().all(|r| !r.contains("oldSelf")), "{rules:?}");
        assert!(
            rules.iter().any(|r| r.contains("has(self.provider)")),
            "{rules:?}"
        );
    }
}
