//! The `Proxy` custom resource (`crawl.example.com/v1alpha1`) and the helpers every other
//! module uses to read it (effective host/port, health-check and lease defaults).
//!
//! The doc comments on fields become `kubectl explain` text, so they are written for users.

use std::collections::BTreeMap;
use std::time::Duration;

use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Finalizer the reconciler puts on Managed proxies so the machine is deleted first.
pub const FINALIZER: &str = "crawl.example.com/finalizer";
/// Annotation holding the spec hash of the machine that currently backs the proxy.
pub const SPEC_HASH_ANNOTATION: &str = "crawl.example.com/spec-hash";
/// Annotation holding the version of the hash inputs used for [`SPEC_HASH_ANNOTATION`].
pub const SPEC_HASH_VERSION_ANNOTATION: &str = "crawl.example.com/spec-hash-version";
/// Annotation written before a provider `create` and cleared once the machine's ID is recorded.
/// Its value is the spec hash the create was started with.
pub const CREATE_PENDING_ANNOTATION: &str = "crawl.example.com/create-pending";
/// Label set on every machine the operator creates.
pub const MANAGED_LABEL: &str = "crawl.example.com/managed";
/// Label carrying the UID of the Proxy a machine belongs to (used by orphan GC).
pub const PROXY_UID_LABEL: &str = "crawl.example.com/proxy-uid";

/// Annotation on a machine Pod naming the Proxy it serves (in the Pod's namespace), so a Pod
/// event maps to its Proxy without a lookup.
pub const PROXY_ANNOTATION: &str = "crawl.example.com/proxy";
/// Label on Secrets whose content is used as cloud-init by some Proxy.
pub const CLOUD_INIT_SECRET_LABEL: &str = "crawl.example.com/cloud-init";
/// Annotation a user sets on a Managed Proxy to rotate its machine now: every new value
/// replaces the machine once (through the drain and the replacement budget).
pub const ROTATE_ANNOTATION: &str = "crawl.example.com/rotate";
/// Annotation the operator writes when it creates a machine: the value `ROTATE_ANNOTATION`
/// had then, so only a new value rotates.
pub const ROTATED_ANNOTATION: &str = "crawl.example.com/rotated";

/// Default listen port of a Managed proxy.
pub const DEFAULT_PORT: i32 = 3128;
/// Default number of concurrent leases a proxy accepts.
pub const DEFAULT_MAX_LEASES: i32 = 5;
/// Default URL probed through the proxy.
pub const DEFAULT_PROBE_URL: &str = "https://www.gstatic.com/generate_204";
/// Default probe interval.
pub const DEFAULT_PROBE_INTERVAL: Duration = Duration::from_secs(30);
/// Default probe timeout.
pub const DEFAULT_PROBE_TIMEOUT: Duration = Duration::from_secs(5);
/// Default consecutive failures before a proxy is marked unhealthy.
pub const DEFAULT_FAILURE_THRESHOLD: i32 = 3;
/// Default consecutive successes before a proxy is marked healthy.
pub const DEFAULT_SUCCESS_THRESHOLD: i32 = 1;
/// Default HTTP statuses that count as a successful probe.
pub const DEFAULT_EXPECTED_STATUS_CODES: [i32; 2] = [200, 204];

/// Desired state of an egress proxy.
// Every `printcolumn(...)` repeats `type_ = ...`; that is the derive's syntax, not a mistake.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "crawl.example.com",
    version = "v1alpha1",
    kind = "Proxy",
    namespaced,
    shortname = "px",
    status = "ProxyStatus",
    derive = "PartialEq",
    doc = "An HTTP(S) egress proxy used by crawlers: either a machine the operator creates and \
           replaces (Managed) or an existing host:port it only health-checks (External).",
    printcolumn(name = "Mode", type_ = "string", json_path = ".spec.mode"),
    printcolumn(name = "Provider", type_ = "string", json_path = ".spec.provider"),
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(name = "IP", type_ = "string", json_path = ".status.ip"),
    printcolumn(name = "Exit", type_ = "string", json_path = ".status.exitIP"),
    printcolumn(
        name = "Healthy",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Healthy\")].status"
    ),
    printcolumn(name = "Cordoned", type_ = "boolean", json_path = ".spec.cordoned"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[x_kube(validation = Rule::new("self.mode == oldSelf.mode").message("mode is immutable"))]
#[x_kube(
    validation = Rule::new("has(self.provider) == has(oldSelf.provider) && (!has(self.provider) || self.provider == oldSelf.provider)")
        .message("provider is immutable")
)]
#[x_kube(
    validation = Rule::new("self.mode != 'Managed' || has(self.provider)")
        .message("provider is required when mode is Managed")
)]
#[x_kube(
    validation = Rule::new("self.mode != 'External' || !has(self.provider)")
        .message("provider must not be set when mode is External")
)]
#[x_kube(
    validation = Rule::new("self.mode != 'External' || has(self.endpoint)")
        .message("endpoint is required when mode is External")
)]
#[x_kube(
    validation = Rule::new("self.mode != 'Managed' || !has(self.endpoint)")
        .message("endpoint must not be set when mode is Managed")
)]
#[x_kube(
    validation = Rule::new("self.mode != 'External' || !has(self.maxLifetime)")
        .message("maxLifetime must not be set when mode is External")
)]
#[schemars(transform = super::schema::strip_nullable)]
#[serde(rename_all = "camelCase")]
pub struct ProxySpec {
    /// Managed: the operator creates the machine through `provider` and replaces it on any
    /// spec change. External: an existing `endpoint` that is only health-checked. Immutable.
    pub mode: Mode,

    /// Name of an entry in the operator's providers config. Required when mode is Managed,
    /// forbidden when External. Immutable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1))]
    pub provider: Option<String>,

    /// Address of an External proxy. Required when mode is External, forbidden when Managed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<Endpoint>,

    /// Listen port of a Managed proxy's squid.
    #[serde(default = "default_port")]
    #[schemars(range(min = 1, max = 65535))]
    pub port: i32,

    /// Where and how a Managed proxy's machine is created (provider-specific). Any change
    /// replaces the machine.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placement: Option<Placement>,

    /// cloud-init user data for a Managed machine, inline or from a Secret. Any change to the
    /// resolved content (including the Secret's) replaces the machine.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cloud_init: Option<CloudInit>,

    /// How many leases the proxy grants at once. 0 makes the proxy unleasable (it is still
    /// health-checked and listed). A rotating upstream's `endpoint.rotating.maxSessions`
    /// replaces it.
    #[serde(
        default = "default_max_leases",
        skip_serializing_if = "Option::is_none"
    )]
    #[schemars(range(min = 0))]
    pub max_leases: Option<i32>,

    /// Stops new leases on the proxy and changes nothing else: leases already held keep
    /// working (renew, report, release), health checks go on, and a Managed proxy's machine
    /// is not replaced (this field is not part of the spec hash). Set it back to `false` to
    /// lease the proxy again.
    #[serde(default)]
    pub cordoned: bool,

    /// Longest life of a Managed proxy's machine (IP rotation), in the syntax of
    /// `healthCheck.interval`, at least `1m`. The machine is replaced, through the drain and the
    /// replacement budget, at this age minus a fixed per-proxy jitter of up to 10 %. Not part
    /// of the spec hash: setting or changing it never replaces a machine by itself.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "super::duration::deserialize_option"
    )]
    #[schemars(length(max = 64))]
    #[x_kube(
        validation = Rule::new(super::duration::field_rule()).message(super::duration::FIELD_MESSAGE),
        validation = Rule::new(super::duration::at_least_rule(super::duration::MIN_MAX_LIFETIME))
            .message(super::duration::MAX_LIFETIME_MESSAGE)
    )]
    pub max_lifetime: Option<kube::core::Duration>,

    /// How the proxy is probed. Every nested field has a default.
    #[serde(default)]
    #[schemars(extend("default" = {}))]
    pub health_check: HealthCheck,

    /// Which address targets see through the proxy, checked at its own interval (none by
    /// default). Not part of the spec hash: setting or changing it never replaces a machine.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_check: Option<super::exit_check::ExitCheck>,
    /// Prices in `--cost-currency`; not in the spec hash.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost: Option<super::cost::Cost>,
}

/// Whether the operator owns the machine behind a proxy.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mode {
    /// The operator creates, replaces and deletes the machine.
    Managed,
    /// The proxy exists elsewhere; the operator only probes it.
    External,
}

/// A `host:port` an External proxy listens on.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Hash)]
#[schemars(transform = super::schema::strip_nullable)]
#[serde(rename_all = "camelCase")]
pub struct Endpoint {
    /// Hostname or IP address of the proxy.
    #[schemars(length(min = 1))]
    pub host: String,
    /// TCP port of the proxy.
    #[schemars(range(min = 1, max = 65535))]
    pub port: i32,
    /// A Secret in the Proxy's namespace with the keys `username` and `password`, for a proxy
    /// that asks for credentials: the health probe and the gateway send them upstream
    /// (`Proxy-Authorization: Basic`); crawlers behind the gateway never see them. Label the
    /// Secret `crawl.example.com/proxy-credentials=true`: the operator watches those, so an
    /// edit takes effect without a restart.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credentials_secret_ref: Option<SecretRef>,
    /// What the proxy speaks: `http` (a forward proxy: `CONNECT` and absolute-form requests)
    /// or `socks5` (RFC 1928, with the credentials as RFC 1929 username/password; names are
    /// resolved by the proxy, as `socks5h://`).
    #[serde(default, skip_serializing_if = "EndpointProtocol::is_http")]
    pub protocol: EndpointProtocol,
    /// A vendor endpoint whose exit is chosen by the username: every lease on it is its own
    /// vendor session, spelled into the username from a template. See `docs/rented-exits.md`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rotating: Option<super::rotating::Rotating>,
}

/// The protocol an External proxy speaks.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[serde(rename_all = "lowercase")]
pub enum EndpointProtocol {
    /// An HTTP forward proxy.
    #[default]
    Http,
    /// A SOCKS5 proxy.
    Socks5,
}

impl EndpointProtocol {
    /// Whether it is the default, `http` (left out when serialized).
    pub fn is_http(&self) -> bool {
        *self == EndpointProtocol::Http
    }

    /// The scheme of the proxy's URL: `socks5h` for SOCKS5, since the proxy resolves the names.
    pub fn scheme(self) -> &'static str {
        match self {
            EndpointProtocol::Http => "http",
            EndpointProtocol::Socks5 => "socks5h",
        }
    }
}

/// A Secret of the Proxy's namespace.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Hash)]
#[schemars(transform = super::schema::strip_nullable)]
pub struct SecretRef {
    /// Name of the Secret.
    #[schemars(length(min = 1))]
    pub name: String,
}

/// Provider-specific placement of a Managed machine. Every field is part of the spec hash.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, Hash)]
#[schemars(transform = super::schema::strip_nullable)]
#[serde(rename_all = "camelCase")]
pub struct Placement {
    /// Zone to create the machine in (gcp), e.g. `europe-west1-b`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zone: Option<String>,
    /// Machine type (gcp), e.g. `e2-small`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub machine_type: Option<String>,
    /// Boot image (gcp image URL or family), or the container image (kubernetes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// Boot disk size in GB (gcp).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub disk_size_gb: Option<i32>,
    /// VPC network (gcp).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<String>,
    /// VPC subnetwork (gcp).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subnetwork: Option<String>,
    /// Network tags applied to the machine (gcp firewall rules select on these).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tags: Vec<String>,
    /// Service account e-mail attached to the machine (gcp).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_account: Option<String>,
}

/// cloud-init user data: exactly one of `inline` or `secretRef`.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Hash)]
#[x_kube(
    validation = Rule::new("has(self.inline) != has(self.secretRef)")
        .message("exactly one of inline or secretRef must be set")
)]
#[schemars(transform = super::schema::strip_nullable)]
#[serde(rename_all = "camelCase")]
pub struct CloudInit {
    /// The cloud-init document itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1))]
    pub inline: Option<String>,
    /// A key of a Secret in the Proxy's namespace holding the cloud-init document. Label the
    /// Secret `crawl.example.com/cloud-init=true` so edits to it replace the machine.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_ref: Option<SecretKeyRef>,
}

/// A key in a Secret of the Proxy's namespace.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Hash)]
#[schemars(transform = super::schema::strip_nullable)]
pub struct SecretKeyRef {
    /// Name of the Secret.
    #[schemars(length(min = 1))]
    pub name: String,
    /// Key within the Secret's data.
    #[schemars(length(min = 1))]
    pub key: String,
}

/// How a proxy is probed: a request to `probeURL` sent *through* the proxy.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[x_kube(
    validation = Rule::new(super::duration::timeout_rule()).message(super::duration::TIMEOUT_MESSAGE)
)]
#[schemars(transform = super::schema::strip_nullable)]
#[serde(rename_all = "camelCase")]
pub struct HealthCheck {
    /// URL requested through the proxy; `https://` URLs go through a CONNECT tunnel.
    #[serde(rename = "probeURL", default = "default_probe_url")]
    #[schemars(length(min = 1))]
    pub probe_url: String,
    /// Time between probes, above zero: numbers each followed by a unit (`h`, `m`, `s`, `ms`,
    /// `us`, `ns`), e.g. `30s`, `1m30s`, `1.5h`.
    #[serde(
        default = "default_probe_interval",
        deserialize_with = "super::duration::deserialize"
    )]
    #[schemars(length(max = 64))]
    #[x_kube(
        validation = Rule::new(super::duration::field_rule()).message(super::duration::FIELD_MESSAGE)
    )]
    pub interval: kube::core::Duration,
    /// Connect, TLS and response timeout of one probe, above zero and at most `interval`, in
    /// the same syntax as `interval`.
    #[serde(
        default = "default_probe_timeout",
        deserialize_with = "super::duration::deserialize"
    )]
    #[schemars(length(max = 64))]
    #[x_kube(
        validation = Rule::new(super::duration::field_rule()).message(super::duration::FIELD_MESSAGE)
    )]
    pub timeout: kube::core::Duration,
    /// Consecutive failed probes that mark the proxy unhealthy.
    #[serde(default = "default_failure_threshold")]
    #[schemars(range(min = 1))]
    pub failure_threshold: i32,
    /// Consecutive successful probes that mark the proxy healthy.
    #[serde(default = "default_success_threshold")]
    #[schemars(range(min = 1))]
    pub success_threshold: i32,
    /// HTTP statuses that count as a successful probe.
    #[serde(default = "default_expected_status_codes")]
    #[schemars(inner(range(min = 100, max = 599)))]
    pub expected_status_codes: Vec<i32>,
}

impl Default for HealthCheck {
    fn default() -> Self {
        HealthCheck {
            probe_url: default_probe_url(),
            interval: default_probe_interval(),
            timeout: default_probe_timeout(),
            failure_threshold: DEFAULT_FAILURE_THRESHOLD,
            success_threshold: DEFAULT_SUCCESS_THRESHOLD,
            expected_status_codes: default_expected_status_codes(),
        }
    }
}

impl HealthCheck {
    /// Probe interval as a std duration (negative durations count as zero).
    pub fn interval(&self) -> Duration {
        self.interval.into()
    }

    /// Probe timeout as a std duration (negative durations count as zero).
    pub fn timeout(&self) -> Duration {
        self.timeout.into()
    }

    /// Failure threshold, at least 1.
    pub fn failure_threshold(&self) -> u32 {
        self.failure_threshold.max(1).unsigned_abs()
    }

    /// Success threshold, at least 1.
    pub fn success_threshold(&self) -> u32 {
        self.success_threshold.max(1).unsigned_abs()
    }
}

/// Observed state, written only by the reconciler.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[schemars(transform = super::schema::strip_nullable)]
#[serde(rename_all = "camelCase")]
pub struct ProxyStatus {
    /// Lifecycle phase derived from provisioning and health.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<Phase>,
    /// Provider's ID of the machine backing a Managed proxy.
    #[serde(
        rename = "providerID",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub provider_id: Option<String>,
    /// Address crawlers connect to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ip: Option<String>,
    /// Generation of the spec this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Provisioned and Healthy conditions; SharedExit and GeoMismatch for a proxy with an exit
    /// check.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["type".into()]))]
    pub conditions: Vec<Condition>,
    /// Latency of the last status-affecting probe, in milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latency_ms: Option<i64>,
    /// Time of the last status-affecting probe (not of every probe: see the metrics for that).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<String>", extend("format" = "date-time"))]
    pub last_health_check_time: Option<jiff::Timestamp>,
    /// The port the machine behind a Managed proxy listens on: `spec.port` when it was created.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<i32>,
    /// When the machine behind a Managed proxy was created (its age drives `maxLifetime`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<String>", extend("format" = "date-time"))]
    pub machine_created_at: Option<jiff::Timestamp>,
    /// The voluntary replacement under way, from the start of its drain until the new machine
    /// runs and passes health checks; it holds a slot of the replacement budget meanwhile.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disruption: Option<Disruption>,
    /// The address targets see, from the last successful `spec.exitCheck` (for a rotating
    /// upstream: the last sampled exit, one vendor session of many).
    #[serde(rename = "exitIP", default, skip_serializing_if = "Option::is_none")]
    pub exit_ip: Option<String>,
    /// When `exitIP` last changed (unset for a rotating upstream, whose exits are sampled).
    #[serde(
        rename = "exitIPChangedAt",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    #[schemars(with = "Option<String>", extend("format" = "date-time"))]
    pub exit_ip_changed_at: Option<jiff::Timestamp>,
    /// ISO 3166-1 country code of `exitIP`, from the `--geoip-database` files.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_country: Option<String>,
    /// Autonomous system number of `exitIP`, from the `--geoip-database` files.
    #[serde(rename = "exitASN", default, skip_serializing_if = "Option::is_none")]
    pub exit_asn: Option<i64>,
    /// Organisation of that autonomous system, from the `--geoip-database` files.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_organization: Option<String>,
}

/// A voluntary replacement of a Managed proxy's machine.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[schemars(transform = super::schema::strip_nullable)]
#[serde(rename_all = "camelCase")]
pub struct Disruption {
    /// Why the machine is replaced.
    pub reason: DisruptionReason,
    /// When its drain started.
    #[schemars(with = "String", extend("format" = "date-time"))]
    pub since: jiff::Timestamp,
    /// When the old machine was found gone: the machine since is its replacement, and the
    /// disruption ends once that one passes a health check.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<String>", extend("format" = "date-time"))]
    pub replaced_at: Option<jiff::Timestamp>,
}

/// Why a machine is replaced voluntarily.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DisruptionReason {
    /// The spec hash changed.
    SpecChange,
    /// The machine reached `spec.maxLifetime`.
    MaxLifetime,
    /// The `crawl.example.com/rotate` annotation got a new value.
    RotateRequested,
    /// The proxy failed health checks for longer than the remediation threshold.
    Unhealthy,
}

impl DisruptionReason {
    /// Every reason, for metric series.
    pub const ALL: [DisruptionReason; 4] = [
        DisruptionReason::SpecChange,
        DisruptionReason::MaxLifetime,
        DisruptionReason::RotateRequested,
        DisruptionReason::Unhealthy,
    ];

    /// The reason as a metric label.
    pub fn label(self) -> &'static str {
        match self {
            DisruptionReason::SpecChange => "spec_change",
            DisruptionReason::MaxLifetime => "max_lifetime",
            DisruptionReason::RotateRequested => "rotate_requested",
            DisruptionReason::Unhealthy => "unhealthy",
        }
    }
}

/// Lifecycle phase of a proxy.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Phase {
    /// Accepted, nothing done yet.
    Pending,
    /// The machine is being created or is not yet reachable.
    Provisioning,
    /// Provisioned and passing health checks.
    Ready,
    /// Provisioned but failing health checks.
    Unhealthy,
    /// The machine is being replaced after a spec change.
    Replacing,
    /// The Proxy is being deleted and its machine torn down.
    Deleting,
    /// The provider refused permanently; see the Provisioned condition.
    Failed,
}

impl Phase {
    /// Every phase, in lifecycle order (used to export one metric series per phase).
    pub const ALL: [Phase; 7] = [
        Phase::Pending,
        Phase::Provisioning,
        Phase::Ready,
        Phase::Unhealthy,
        Phase::Replacing,
        Phase::Deleting,
        Phase::Failed,
    ];

    /// The phase's name as written in status.
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Pending => "Pending",
            Phase::Provisioning => "Provisioning",
            Phase::Ready => "Ready",
            Phase::Unhealthy => "Unhealthy",
            Phase::Replacing => "Replacing",
            Phase::Deleting => "Deleting",
            Phase::Failed => "Failed",
        }
    }
}

/// A status condition (the Kubernetes `metav1.Condition` shape).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[schemars(transform = super::schema::strip_nullable)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    /// Condition type: `Provisioned`, `Healthy`, `SharedExit` or `GeoMismatch`.
    #[serde(rename = "type")]
    pub type_: String,
    /// `True`, `False` or `Unknown`.
    pub status: ConditionStatus,
    /// Machine-readable reason for the last transition, CamelCase.
    #[serde(default)]
    pub reason: String,
    /// Human-readable details.
    #[serde(default)]
    pub message: String,
    /// When the status last changed.
    #[schemars(with = "String", extend("format" = "date-time"))]
    pub last_transition_time: jiff::Timestamp,
    /// Generation of the spec the condition was computed from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// Value of a condition.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ConditionStatus {
    /// The condition holds.
    True,
    /// The condition does not hold.
    False,
    /// Not known yet.
    Unknown,
}

/// Condition type set by provisioning.
pub const CONDITION_PROVISIONED: &str = "Provisioned";
/// Condition type set from health transitions.
pub const CONDITION_HEALTHY: &str = "Healthy";
/// Condition type set from exit checks: `True` while another Ready proxy exits from the same
/// address (its message names them).
pub const CONDITION_SHARED_EXIT: &str = "SharedExit";
/// Condition type set from exit checks: `True` while the proxy's `geo` label names another
/// country than its exit's.
pub const CONDITION_GEO_MISMATCH: &str = "GeoMismatch";
/// `Provisioned` reason while a proxy drains before its machine is deleted: it takes no new
/// leases and its leases cannot be renewed.
pub const REASON_DRAINING: &str = "Draining";
/// `Provisioned` reason: the provider refused for quota; retried in minutes (a ProxyPool
/// reads it of its members).
pub const REASON_QUOTA: &str = "QuotaExceeded";

/// Sets a condition in a list-map keyed by type. `lastTransitionTime` moves only when the
/// condition's status changes; reason, message and observedGeneration always follow.
pub fn set_condition(conditions: &mut Vec<Condition>, new: Condition) {
    match conditions.iter_mut().find(|c| c.type_ == new.type_) {
        Some(existing) => {
            let transition_time = if existing.status == new.status {
                existing.last_transition_time
            } else {
                new.last_transition_time
            };
            *existing = Condition {
                last_transition_time: transition_time,
                ..new
            };
        }
        None => conditions.push(new),
    }
}

fn default_port() -> i32 {
    DEFAULT_PORT
}

fn default_max_leases() -> Option<i32> {
    Some(DEFAULT_MAX_LEASES)
}

fn default_probe_url() -> String {
    DEFAULT_PROBE_URL.to_owned()
}

fn default_probe_interval() -> kube::core::Duration {
    DEFAULT_PROBE_INTERVAL.into()
}

fn default_probe_timeout() -> kube::core::Duration {
    DEFAULT_PROBE_TIMEOUT.into()
}

fn default_failure_threshold() -> i32 {
    DEFAULT_FAILURE_THRESHOLD
}

fn default_success_threshold() -> i32 {
    DEFAULT_SUCCESS_THRESHOLD
}

fn default_expected_status_codes() -> Vec<i32> {
    DEFAULT_EXPECTED_STATUS_CODES.to_vec()
}

/// `http://host:port` (`socks5h://` for a SOCKS5 proxy), with brackets around an IPv6 host
/// that has none yet.
pub fn proxy_url(protocol: EndpointProtocol, host: &str, port: i32) -> String {
    let scheme = protocol.scheme();
    if host.contains(':') && !host.starts_with('[') {
        format!("{scheme}://[{host}]:{port}")
    } else {
        format!("{scheme}://{host}:{port}")
    }
}

impl ProxySpec {
    /// The port crawlers connect to: `endpoint.port` for External; for Managed the port its
    /// current machine was created with (`status.port`), so a port change waiting for its
    /// replacement does not send probes and crawlers to a port nothing listens on, else
    /// `spec.port`.
    pub fn effective_port(&self, status: Option<&ProxyStatus>) -> i32 {
        match (self.mode, &self.endpoint) {
            (Mode::External, Some(endpoint)) => endpoint.port,
            _ => status.and_then(|s| s.port).unwrap_or(self.port),
        }
    }

    /// The host crawlers connect to: the endpoint host for External, the observed IP for
    /// Managed (none until the machine is running).
    pub fn effective_host<'a>(&'a self, status: Option<&'a ProxyStatus>) -> Option<&'a str> {
        match self.mode {
            Mode::External => self.endpoint.as_ref().map(|e| e.host.as_str()),
            Mode::Managed => status.and_then(|s| s.ip.as_deref()),
        }
    }

    /// `http://host:port` (`socks5h://` for a SOCKS5 endpoint) crawlers and probes go
    /// through, or `None` while there is no host (a Managed proxy without a running machine).
    pub fn proxy_url(&self, status: Option<&ProxyStatus>) -> Option<String> {
        let host = self.effective_host(status).filter(|h| !h.is_empty())?;
        Some(proxy_url(
            self.protocol(),
            host,
            self.effective_port(status),
        ))
    }

    /// What the proxy speaks: its endpoint's protocol for External, HTTP for Managed (squid).
    pub fn protocol(&self) -> EndpointProtocol {
        match (self.mode, &self.endpoint) {
            (Mode::External, Some(endpoint)) => endpoint.protocol,
            _ => EndpointProtocol::Http,
        }
    }

    /// Lease capacity with the default applied; 0 means unleasable.
    pub fn max_leases(&self) -> u32 {
        self.rotating()
            .map_or(self.max_leases.unwrap_or(DEFAULT_MAX_LEASES), |r| {
                r.max_sessions
            })
            .max(0)
            .unsigned_abs()
    }

    /// The rotating upstream an External proxy's endpoint is, if it is one.
    pub fn rotating(&self) -> Option<&super::rotating::Rotating> {
        match self.mode {
            Mode::External => self.endpoint.as_ref()?.rotating.as_ref(),
            Mode::Managed => None,
        }
    }

    /// The health check with every default materialized.
    pub fn health_check(&self) -> &HealthCheck {
        &self.health_check
    }

    /// `maxLifetime` as a std duration; `None` when unset. The CRD refuses values under `1m`;
    /// one that never met it (no API server in between) counts as `1m`, so it can never turn
    /// into a replacement loop.
    pub fn max_lifetime(&self) -> Option<Duration> {
        self.max_lifetime
            .map(|lifetime| Duration::from(lifetime).max(super::duration::MIN_MAX_LIFETIME_VALUE))
    }
}

impl ProxyStatus {
    /// The condition of the given type, if present.
    pub fn condition(&self, type_: &str) -> Option<&Condition> {
        self.conditions.iter().find(|c| c.type_ == type_)
    }

    /// The Healthy condition as a bool: `Some(true)`/`Some(false)`, or `None` when unknown.
    pub fn healthy(&self) -> Option<bool> {
        match self.condition(CONDITION_HEALTHY)?.status {
            ConditionStatus::True => Some(true),
            ConditionStatus::False => Some(false),
            ConditionStatus::Unknown => None,
        }
    }
}

/// Identity of a Proxy object: namespace/name **and** UID, so a Proxy deleted and re-created
/// under the same name is a different proxy (fresh health counters, separate lease capacity).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ProxyId {
    /// Namespace of the Proxy.
    pub namespace: String,
    /// Name of the Proxy.
    pub name: String,
    /// UID of the Proxy object.
    pub uid: String,
}

impl ProxyId {
    /// `namespace/name`.
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

impl std::fmt::Display for ProxyId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// Namespace of a Proxy whose manifest names none.
pub const DEFAULT_NAMESPACE: &str = "default";

impl Proxy {
    /// The object's namespace (`default` when unset).
    pub fn namespace_or_default(&self) -> &str {
        self.metadata
            .namespace
            .as_deref()
            .unwrap_or(DEFAULT_NAMESPACE)
    }

    /// `namespace/name` of the object (namespace `default` when unset).
    pub fn key(&self) -> String {
        format!(
            "{}/{}",
            self.namespace_or_default(),
            self.metadata.name.as_deref().unwrap_or_default()
        )
    }

    /// The object's identity. Objects that never passed through an API server (the standalone
    /// inventory file) have no UID; they get a stable one derived from namespace/name.
    pub fn id(&self) -> ProxyId {
        let namespace = self.namespace_or_default().to_owned();
        let name = self.metadata.name.clone().unwrap_or_default();
        let uid = match &self.metadata.uid {
            Some(uid) if !uid.is_empty() => uid.clone(),
            _ => local_uid(&namespace, &name),
        };
        ProxyId {
            namespace,
            name,
            uid,
        }
    }

    /// Whether the proxy is draining: its Proxy is being deleted, or its machine is about to be
    /// replaced. A draining proxy takes no new leases and refuses renewals.
    pub fn is_draining(&self) -> bool {
        self.metadata.deletion_timestamp.is_some()
            || self
                .status
                .as_ref()
                .and_then(|s| s.condition(CONDITION_PROVISIONED))
                .is_some_and(|c| c.reason == REASON_DRAINING)
    }

    /// The selection labels crawlers filter on.
    pub fn labels(&self) -> BTreeMap<String, String> {
        self.metadata.labels.clone().unwrap_or_default()
    }
}

/// UID of a Proxy that has none: `local-` + hex SHA-256 of `namespace/name`, truncated.
fn local_uid(namespace: &str, name: &str) -> String {
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest(format!("{namespace}/{name}").as_bytes());
    format!("local-{}", hex::encode(&digest[..16]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn id_uses_the_uid_or_a_stable_local_one() {
        let mut p = Proxy::new("a", spec(Mode::External));
        let local = p.id();
        assert_eq!(local.namespace, "default");
        assert!(local.uid.starts_with("local-"), "{}", local.uid);
        assert_eq!(local, p.id());
        p.metadata.namespace = Some("crawl".into());
        assert_ne!(p.id().uid, local.uid);
        p.metadata.uid = Some("0f8c7e4a".into());
        assert_eq!(p.id().uid, "0f8c7e4a");
        assert_eq!(p.id().key(), "crawl/a");
    }

    fn spec(mode: Mode) -> ProxySpec {
        serde_json::from_value(serde_json::json!({"mode": mode})).unwrap()
    }

    #[test]
    fn defaults_materialize_when_fields_are_absent() {
        let s = spec(Mode::Managed);
        assert_eq!(s.port, 3128);
        assert_eq!(s.max_leases, Some(5));
        assert_eq!(s.max_leases(), 5);
        assert!(!s.cordoned);
        let hc = s.health_check();
        assert_eq!(hc.probe_url, "https://www.gstatic.com/generate_204");
        assert_eq!(hc.interval(), Duration::from_secs(30));
        assert_eq!(hc.timeout(), Duration::from_secs(5));
        assert_eq!(hc.failure_threshold(), 3);
        assert_eq!(hc.success_threshold(), 1);
        assert_eq!(hc.expected_status_codes, vec![200, 204]);
    }

    #[test]
    fn nested_health_check_defaults_fill_partial_objects() {
        let s: ProxySpec = serde_json::from_value(serde_json::json!({
            "mode": "External",
            "endpoint": {"host": "h", "port": 1},
            "healthCheck": {"interval": "1m30s", "failureThreshold": 5}
        }))
        .unwrap();
        let hc = s.health_check();
        assert_eq!(hc.interval(), Duration::from_secs(90));
        assert_eq!(hc.failure_threshold(), 5);
        assert_eq!(hc.timeout(), Duration::from_secs(5));
        assert_eq!(hc.expected_status_codes, vec![200, 204]);
    }

    #[test]
    fn max_leases_zero_round_trips() {
        let mut s = spec(Mode::Managed);
        s.max_leases = Some(0);
        let json = serde_json::to_value(&s).unwrap();
        assert_eq!(json["maxLeases"], 0);
        let back: ProxySpec = serde_json::from_value(json).unwrap();
        assert_eq!(back.max_leases, Some(0));
        assert_eq!(back.max_leases(), 0);
    }

    #[test]
    fn effective_port_and_host_follow_the_mode() {
        let cases = [
            (
                Mode::Managed,
                None,
                Some("10.0.0.7"),
                3128,
                Some("10.0.0.7"),
            ),
            (Mode::Managed, None, None, 3128, None),
            (
                Mode::External,
                Some(("proxy.example", 8080)),
                Some("10.0.0.7"),
                8080,
                Some("proxy.example"),
            ),
        ];
        for (mode, endpoint, ip, port, host) in cases {
            let mut s = spec(mode);
            s.endpoint = endpoint.map(|(h, p)| Endpoint {
                host: h.to_owned(),
                port: p,
                credentials_secret_ref: None,
                protocol: EndpointProtocol::Http,
                rotating: None,
            });
            let mut status = ProxyStatus {
                ip: ip.map(str::to_owned),
                ..Default::default()
            };
            assert_eq!(s.effective_port(Some(&status)), port, "{mode:?}");
            assert_eq!(s.effective_port(None), port, "{mode:?}");
            assert_eq!(s.effective_host(Some(&status)), host, "{mode:?}");
            // A Managed machine keeps the port it was created with until it is replaced.
            status.port = Some(3130);
            let machine_port = if mode == Mode::Managed { 3130 } else { port };
            assert_eq!(s.effective_port(Some(&status)), machine_port, "{mode:?}");
        }
    }

    #[test]
    fn healthy_condition_reads_as_tristate() {
        let mut status = ProxyStatus::default();
        assert_eq!(status.healthy(), None);
        for (value, expected) in [
            (ConditionStatus::True, Some(true)),
            (ConditionStatus::False, Some(false)),
            (ConditionStatus::Unknown, None),
        ] {
            status.conditions = vec![Condition {
                type_: CONDITION_HEALTHY.into(),
                status: value,
                reason: String::new(),
                message: String::new(),
                last_transition_time: jiff::Timestamp::UNIX_EPOCH,
                observed_generation: None,
            }];
            assert_eq!(status.healthy(), expected);
        }
    }
}
