//! Building the Proxy's status and the patches that write it, as pure functions.
//!
//! The reconciler is the only status writer. It computes the whole desired status from the
//! current one, what the action did and the last health transition, and writes it only when it
//! differs — as a JSON merge patch with explicit `null`s, because a merge patch that merely
//! omits a field leaves the old value in place.

use jiff::Timestamp;
use serde_json::{Value, json};

use crate::health::HealthTransition;
use crate::resources::phase::{Provisioning, compute_phase};
use crate::resources::proxy::{
    CONDITION_HEALTHY, CONDITION_PROVISIONED, Condition, ConditionStatus, Disruption, ProxySpec,
    ProxyStatus, set_condition,
};

/// `Provisioned` reason: the machine runs with an address.
pub const REASON_RUNNING: &str = "Running";
/// `Provisioned` reason: the machine is being created.
pub const REASON_PROVISIONING: &str = "Provisioning";
/// `Provisioned` reason: the machine is being replaced after a spec change.
pub const REASON_REPLACING: &str = "Replacing";
/// `Provisioned` reason: the machine stopped or terminated and is being deleted.
pub const REASON_MACHINE_STOPPED: &str = "MachineStopped";
/// `Provisioned` reason: the machine disappeared; a new one will be created.
pub const REASON_MACHINE_GONE: &str = "MachineGone";
/// `Provisioned` reason: the Proxy is being deleted.
pub const REASON_DELETING: &str = "Deleting";
/// `Provisioned` reason: an External proxy is provisioned by definition.
pub const REASON_EXTERNAL: &str = "ExternalEndpoint";
/// `Provisioned` reason: the provider refused permanently; no retry until the spec changes.
pub const REASON_PROVIDER_FAILED: &str = "ProviderFailed";
/// `Provisioned` reason: the platform's policy (admission, authorization) refused a provider
/// call; retried with backoff.
pub const REASON_REFUSED: &str = "Refused";
/// `Provisioned` reason: the machine did not run within the start-up timeout and is replaced.
pub const REASON_STARTUP_TIMEOUT: &str = "StartupTimeout";
/// `Provisioned` reason: the provider accepted a create, then the machine vanished before it
/// ran; retried with backoff.
pub const REASON_CREATE_FAILED: &str = "CreateFailed";
/// `Provisioned` reason: the machine's deletion was stuck past its deadline (a lost node) and
/// it was force-deleted.
pub const REASON_MACHINE_LOST: &str = "MachineLost";
/// `Provisioned` reason: the machine is being deleted by someone else (an eviction, a node
/// drain, `kubectl delete pod`); it is replaced once gone, force-deleted if it gets stuck.
pub const REASON_MACHINE_TERMINATING: &str = "MachineTerminating";
/// `Provisioned` reason (True): a voluntary replacement is due but the replacement budget is
/// full (or paused); the machine keeps serving meanwhile.
pub const REASON_REPLACEMENT_PENDING: &str = "ReplacementPending";
/// `Provisioned` reason (True) and Event reason: the machine fails health checks past the
/// remediation threshold, but too many of its provider's proxies do for it to be replaced.
pub const REASON_REMEDIATION_PAUSED: &str = "RemediationPaused";
/// Event reason: a stuck machine was force-deleted.
pub const REASON_FORCE_DELETED: &str = "ForceDeleted";
/// `Provisioned` reason: the cloud-init Secret or key is missing.
pub const REASON_CLOUD_INIT: &str = "CloudInitUnavailable";
/// `Provisioned` reason: `spec.provider` names no entry in the providers config.
pub const REASON_UNKNOWN_PROVIDER: &str = "UnknownProvider";
/// `Healthy` reason: the last status-affecting probe succeeded.
pub const REASON_PROBE_SUCCEEDED: &str = "ProbeSucceeded";
/// `Healthy` reason: the last status-affecting probe failed.
pub const REASON_PROBE_FAILED: &str = "ProbeFailed";
/// `Healthy` reason: no probe result yet.
pub const REASON_NOT_PROBED: &str = "NotProbed";

/// A change to one optional status field.
#[derive(Debug, Clone, PartialEq)]
pub enum FieldChange<T = String> {
    /// Leave the current value.
    Keep,
    /// Set this value.
    Set(T),
    /// Remove the value.
    Clear,
}

impl<T: Clone> FieldChange<T> {
    fn apply(&self, current: &Option<T>) -> Option<T> {
        match self {
            FieldChange::Keep => current.clone(),
            FieldChange::Set(value) => Some(value.clone()),
            FieldChange::Clear => None,
        }
    }

    /// `Set` for a value, `Clear` for none.
    pub fn to(value: Option<T>) -> Self {
        value.map_or(FieldChange::Clear, FieldChange::Set)
    }
}

/// What an executed action means for status: every field the reconciler writes besides the
/// health it takes from the health engine. [`desired_status`] applies it.
#[derive(Debug, Clone, PartialEq)]
pub struct StatusChange {
    /// Where the machine now is.
    pub provisioning: Provisioning,
    /// `status.providerID`.
    pub provider_id: FieldChange,
    /// `status.ip`.
    pub ip: FieldChange,
    /// The `Provisioned` condition's status.
    pub provisioned: ConditionStatus,
    /// The `Provisioned` condition's reason.
    pub reason: String,
    /// The `Provisioned` condition's message.
    pub message: String,
    /// `status.port`: the port the machine was created with.
    pub port: FieldChange<i32>,
    /// `status.machineCreatedAt`, from the provider's answer.
    pub machine_created_at: FieldChange<Timestamp>,
    /// `status.disruption`: the voluntary replacement under way.
    pub disruption: FieldChange<Disruption>,
}

impl StatusChange {
    /// `Provisioned=<provisioned>/<reason>` with `message` while the machine is where
    /// `provisioning` says; every other field kept.
    pub fn new(
        provisioning: Provisioning,
        provisioned: ConditionStatus,
        reason: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        StatusChange {
            provisioning,
            provider_id: FieldChange::Keep,
            ip: FieldChange::Keep,
            provisioned,
            reason: reason.into(),
            message: message.into(),
            port: FieldChange::Keep,
            machine_created_at: FieldChange::Keep,
            disruption: FieldChange::Keep,
        }
    }

    /// With `status.providerID` changed.
    pub fn provider_id(self, provider_id: FieldChange) -> Self {
        StatusChange {
            provider_id,
            ..self
        }
    }

    /// With `status.ip` changed.
    pub fn ip(self, ip: FieldChange) -> Self {
        StatusChange { ip, ..self }
    }
}

/// The whole desired status: `current` with `change` and `health` applied.
///
/// A health signal counts only for the address it was probed at (`spec` and the new status
/// say where the proxy is now). When the address changes — a new machine, a moved endpoint —
/// or the last signal is about another address, Healthy goes back to `Unknown/NotProbed`, so a
/// machine nobody has probed is never shown (nor, after a restart, seeded) as healthy.
/// Otherwise, without a signal the current Healthy condition is kept (no flap to Unknown after
/// a restart); a proxy never probed gets `Healthy=Unknown/NotProbed`.
pub fn desired_status(
    current: &ProxyStatus,
    change: &StatusChange,
    spec: &ProxySpec,
    health: Option<&HealthTransition>,
    generation: Option<i64>,
    now: jiff::Timestamp,
) -> ProxyStatus {
    let mut status = current.clone();
    status.provider_id = change.provider_id.apply(&current.provider_id);
    status.ip = change.ip.apply(&current.ip);
    status.port = change.port.apply(&current.port);
    status.machine_created_at = change.machine_created_at.apply(&current.machine_created_at);
    status.disruption = change.disruption.apply(&current.disruption);
    status.observed_generation = generation;
    set_condition(
        &mut status.conditions,
        Condition {
            type_: CONDITION_PROVISIONED.to_owned(),
            status: change.provisioned,
            reason: change.reason.clone(),
            message: change.message.clone(),
            last_transition_time: now,
            observed_generation: generation,
        },
    );
    let host_and_port = |s| (spec.effective_host(Some(s)), spec.effective_port(Some(s)));
    let moved = host_and_port(current) != host_and_port(&status);
    let address = spec.proxy_url(Some(&status));
    let signal = health.filter(|s| address.as_ref() == Some(&s.proxy_url));
    let stale = moved || (health.is_some() && signal.is_none());
    match signal {
        Some(signal) => {
            let (value, reason) = if signal.healthy {
                (ConditionStatus::True, REASON_PROBE_SUCCEEDED)
            } else {
                (ConditionStatus::False, REASON_PROBE_FAILED)
            };
            set_condition(
                &mut status.conditions,
                Condition {
                    type_: CONDITION_HEALTHY.to_owned(),
                    status: value,
                    reason: reason.to_owned(),
                    message: signal.message.clone(),
                    last_transition_time: signal.at,
                    observed_generation: generation,
                },
            );
            status.latency_ms = Some(i64::try_from(signal.latency.as_millis()).unwrap_or(i64::MAX));
            status.last_health_check_time = Some(signal.at);
        }
        None if stale || status.condition(CONDITION_HEALTHY).is_none() => {
            let message = match (&address, stale) {
                (Some(url), true) => format!("no probe result yet at its new address {url}"),
                (None, true) => "no address to probe".to_owned(),
                (_, false) => "no probe result yet".to_owned(),
            };
            set_condition(
                &mut status.conditions,
                Condition {
                    type_: CONDITION_HEALTHY.to_owned(),
                    status: ConditionStatus::Unknown,
                    reason: REASON_NOT_PROBED.to_owned(),
                    message,
                    last_transition_time: now,
                    observed_generation: generation,
                },
            );
        }
        None => {}
    }
    status.phase = Some(compute_phase(change.provisioning, status.healthy()));
    status
}

/// The JSON merge patch that makes the status subresource equal `status`: every field is
/// present, `null` where unset, so stale values are removed. It carries `resource_version`, the
/// newest this reconcile knows, so the server refuses it (409) if the object changed since:
/// a reconcile working from a stale copy must not write back old machine fields.
pub fn status_patch(status: &ProxyStatus, resource_version: Option<&str>) -> Value {
    let mut patch = json!({
        "status": {
            "phase": status.phase,
            "providerID": status.provider_id,
            "ip": status.ip,
            "observedGeneration": status.observed_generation,
            "conditions": status.conditions,
            "latencyMs": status.latency_ms,
            "lastHealthCheckTime": status.last_health_check_time,
            "port": status.port,
            "machineCreatedAt": status.machine_created_at,
            "exitIP": status.exit_ip,
            "exitIPChangedAt": status.exit_ip_changed_at,
            "exitCountry": status.exit_country,
            "exitASN": status.exit_asn,
            "exitOrganization": status.exit_organization,
            // Spelled out: a merge patch merges nested objects, so an absent `replacedAt` would
            // leave an old one in place.
            "disruption": status.disruption.as_ref().map(|d| json!({
                "reason": d.reason,
                "since": d.since,
                "replacedAt": d.replaced_at,
            })),
        }
    });
    // A `null` resourceVersion is refused outright (422), so it is left out when unknown.
    if let Some(version) = resource_version {
        patch["metadata"] = json!({ "resourceVersion": version });
    }
    patch
}

/// A JSON merge patch setting (`Some`) or removing (`None`) annotations.
pub fn annotations_patch(changes: &[(&str, Option<&str>)]) -> Value {
    let annotations: serde_json::Map<String, Value> = changes
        .iter()
        .map(|(key, value)| ((*key).to_owned(), json!(value)))
        .collect();
    json!({ "metadata": { "annotations": annotations } })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::proxy::{Disruption, DisruptionReason, Phase};

    fn ts(seconds: i64) -> jiff::Timestamp {
        jiff::Timestamp::from_second(seconds).unwrap()
    }

    /// A Managed proxy listening on 3128.
    fn managed() -> ProxySpec {
        serde_json::from_value(json!({"mode": "Managed", "provider": "local", "port": 3128}))
            .unwrap()
    }

    /// A health transition probed through `proxy_url`, finished at `at`.
    fn signal(healthy: bool, proxy_url: &str, at: i64) -> HealthTransition {
        HealthTransition {
            message: "204".into(),
            ..crate::fixtures::transition(healthy, proxy_url, ts(at))
        }
    }

    /// The machine disappeared: address and provider ID cleared.
    fn gone() -> StatusChange {
        StatusChange::new(
            Provisioning::InProgress,
            ConditionStatus::False,
            REASON_MACHINE_GONE,
            "",
        )
        .provider_id(FieldChange::Clear)
        .ip(FieldChange::Clear)
    }

    fn running(ip: &str) -> StatusChange {
        StatusChange::new(
            Provisioning::Done,
            ConditionStatus::True,
            REASON_RUNNING,
            "machine is running",
        )
        .ip(FieldChange::Set(ip.into()))
    }

    #[test]
    fn transition_time_moves_only_when_the_status_changes() {
        let mut conditions = Vec::new();
        let cond = |status, reason: &str, at, generation| Condition {
            type_: CONDITION_PROVISIONED.into(),
            status,
            reason: reason.into(),
            message: String::new(),
            last_transition_time: at,
            observed_generation: Some(generation),
        };
        set_condition(
            &mut conditions,
            cond(ConditionStatus::False, "Provisioning", ts(10), 1),
        );
        set_condition(
            &mut conditions,
            cond(ConditionStatus::False, "QuotaExceeded", ts(20), 2),
        );
        assert_eq!(conditions.len(), 1);
        assert_eq!(conditions[0].last_transition_time, ts(10));
        assert_eq!(conditions[0].reason, "QuotaExceeded");
        assert_eq!(conditions[0].observed_generation, Some(2));
        set_condition(
            &mut conditions,
            cond(ConditionStatus::True, "Running", ts(30), 2),
        );
        assert_eq!(conditions[0].last_transition_time, ts(30));
    }

    #[test]
    fn desired_status_is_stable_when_nothing_changed() {
        let spec = managed();
        let first = desired_status(
            &ProxyStatus::default(),
            &running("10.0.0.1"),
            &spec,
            None,
            Some(3),
            ts(100),
        );
        assert_eq!(first.phase, Some(Phase::Provisioning));
        assert_eq!(first.ip.as_deref(), Some("10.0.0.1"));
        assert_eq!(first.observed_generation, Some(3));
        assert_eq!(first.healthy(), None);
        let second = desired_status(&first, &running("10.0.0.1"), &spec, None, Some(3), ts(200));
        assert_eq!(first, second, "a later pass with no change must not differ");
    }

    #[test]
    fn health_signal_drives_phase_latency_and_check_time() {
        let spec = managed();
        let up = signal(true, "http://10.0.0.1:3128", 150);
        let status = desired_status(
            &ProxyStatus::default(),
            &running("10.0.0.1"),
            &spec,
            Some(&up),
            Some(1),
            ts(160),
        );
        assert_eq!(status.phase, Some(Phase::Ready));
        assert_eq!(status.latency_ms, Some(42));
        assert_eq!(status.last_health_check_time, Some(ts(150)));
        let healthy = status.condition(CONDITION_HEALTHY).unwrap();
        assert_eq!(healthy.reason, REASON_PROBE_SUCCEEDED);
        assert_eq!(healthy.last_transition_time, ts(150));
        // Without a new signal the seeded condition is kept, not reset to Unknown.
        let later = desired_status(&status, &running("10.0.0.1"), &spec, None, Some(1), ts(500));
        assert_eq!(later, status);
        let down = signal(false, "http://10.0.0.1:3128", 550);
        let unhealthy = desired_status(
            &status,
            &running("10.0.0.1"),
            &spec,
            Some(&down),
            Some(1),
            ts(600),
        );
        assert_eq!(unhealthy.phase, Some(Phase::Unhealthy));
    }

    /// A verdict is about the address it was probed at: a new machine (a repair, a replacement)
    /// or a moved endpoint starts `Unknown` until probed there, whatever the last signal says.
    #[test]
    fn health_holds_only_for_the_address_it_was_probed_at() {
        let spec = managed();
        let ready = desired_status(
            &ProxyStatus::default(),
            &running("10.0.0.1"),
            &spec,
            Some(&signal(true, "http://10.0.0.1:3128", 10)),
            Some(1),
            ts(10),
        );
        assert_eq!(ready.phase, Some(Phase::Ready));
        let old_up = signal(true, "http://10.0.0.1:3128", 20);
        let old_down = signal(false, "http://10.0.0.1:3128", 20);
        let new_up = signal(true, "http://10.0.0.2:3128", 30);
        // (case, change, last signal, phase, Healthy status, message contains)
        let cases = [
            (
                "same machine, no signal: kept",
                &running("10.0.0.1"),
                None,
                Phase::Ready,
                ConditionStatus::True,
                "204",
            ),
            (
                "same machine, its signal",
                &running("10.0.0.1"),
                Some(&old_down),
                Phase::Unhealthy,
                ConditionStatus::False,
                "204",
            ),
            (
                "new machine, no signal",
                &running("10.0.0.2"),
                None,
                Phase::Provisioning,
                ConditionStatus::Unknown,
                "new address http://10.0.0.2:3128",
            ),
            (
                "new machine, the old one's signal",
                &running("10.0.0.2"),
                Some(&old_up),
                Phase::Provisioning,
                ConditionStatus::Unknown,
                "new address http://10.0.0.2:3128",
            ),
            (
                "new machine, probed",
                &running("10.0.0.2"),
                Some(&new_up),
                Phase::Ready,
                ConditionStatus::True,
                "204",
            ),
            (
                "machine gone",
                &gone(),
                Some(&old_up),
                Phase::Provisioning,
                ConditionStatus::Unknown,
                "no address to probe",
            ),
        ];
        for (case, change, health, phase, healthy, message) in cases {
            let status = desired_status(&ready, change, &spec, health, Some(1), ts(40));
            assert_eq!(status.phase, Some(phase), "{case}");
            let condition = status.condition(CONDITION_HEALTHY).unwrap();
            assert_eq!(condition.status, healthy, "{case}");
            assert!(condition.message.contains(message), "{case}: {condition:?}");
            let again = desired_status(&status, change, &spec, health, Some(1), ts(50));
            assert_eq!(again, status, "{case}: stable on the next pass");
        }
        // Stored signal about another address on a later pass (the address changed before):
        // still Unknown, not the old verdict.
        let moved = desired_status(&ready, &running("10.0.0.2"), &spec, None, Some(1), ts(40));
        let later = desired_status(
            &moved,
            &running("10.0.0.2"),
            &spec,
            Some(&old_up),
            Some(1),
            ts(50),
        );
        assert_eq!(later.healthy(), None);
        // An External endpoint edited: the old endpoint's verdict no longer counts.
        let external = |host: &str| -> ProxySpec {
            serde_json::from_value(
                json!({"mode": "External", "endpoint": {"host": host, "port": 8080}}),
            )
            .unwrap()
        };
        let listed = StatusChange::new(
            Provisioning::Done,
            ConditionStatus::True,
            REASON_EXTERNAL,
            "",
        );
        let old_endpoint = signal(true, "http://proxy-a:8080", 10);
        let external_ready = desired_status(
            &ProxyStatus::default(),
            &listed,
            &external("proxy-a"),
            Some(&old_endpoint),
            Some(1),
            ts(10),
        );
        assert_eq!(external_ready.phase, Some(Phase::Ready));
        let edited = desired_status(
            &external_ready,
            &listed,
            &external("proxy-b"),
            Some(&old_endpoint),
            Some(2),
            ts(20),
        );
        assert_eq!(edited.healthy(), None);
        assert_eq!(edited.phase, Some(Phase::Provisioning));
    }

    #[test]
    fn clearing_fields_sends_explicit_nulls() {
        let spec = managed();
        let current = desired_status(
            &ProxyStatus::default(),
            &running("10.0.0.1"),
            &spec,
            None,
            Some(1),
            ts(1),
        );
        let status = desired_status(&current, &gone(), &spec, None, Some(1), ts(2));
        let patch = status_patch(&status, Some("42"));
        assert_eq!(patch["metadata"]["resourceVersion"], "42");
        assert!(status_patch(&status, None).get("metadata").is_none());
        assert_eq!(patch["status"]["ip"], Value::Null);
        assert_eq!(patch["status"]["providerID"], Value::Null);
        assert!(patch["status"].as_object().unwrap().contains_key("ip"));
        assert_eq!(patch["status"]["phase"], "Provisioning");
        assert_eq!(patch["status"]["disruption"], Value::Null);
        assert!(
            patch["status"]
                .as_object()
                .unwrap()
                .contains_key("disruption")
        );

        // A new drain over a finished replacement's record clears its `replacedAt`.
        let drain = ProxyStatus {
            disruption: Some(Disruption {
                reason: DisruptionReason::SpecChange,
                since: ts(3),
                replaced_at: None,
            }),
            ..status
        };
        let patch = status_patch(&drain, None);
        assert_eq!(patch["status"]["disruption"]["reason"], "SpecChange");
        assert_eq!(patch["status"]["disruption"]["replacedAt"], Value::Null);
        assert!(
            patch["status"]["disruption"]
                .as_object()
                .unwrap()
                .contains_key("replacedAt")
        );
    }

    #[test]
    fn annotation_patch_sets_and_removes() {
        let patch = annotations_patch(&[("a", Some("1")), ("b", None)]);
        assert_eq!(
            patch,
            json!({"metadata": {"annotations": {"a": "1", "b": null}}})
        );
    }
}
