//! Reading a squid Pod's state: what the kubernetes provider reports as the machine's state,
//! and why a Pod that is not running is not (an image that cannot be pulled, a Pod no node
//! can take, a crash-looping squid), so the Proxy's condition can say it.

use k8s_openapi::api::core::v1::{ContainerStatus, Pod, PodStatus};

use super::{Instance, InstanceState, Waiting};
use crate::resources::proxy::PROXY_UID_LABEL;

/// Container waiting reasons that are part of a normal start and explain nothing.
const ROUTINE_WAITING: &[&str] = &["ContainerCreating", "PodInitializing"];

/// The machine state a Pod means: Pending, or Running without an IP or with its container not
/// running, is still provisioning (an empty IP is never published); a Pod being deleted, or
/// finished, is terminated.
pub fn pod_state(
    phase: Option<&str>,
    pod_ip: Option<&str>,
    container_running: bool,
    deleting: bool,
) -> InstanceState {
    if deleting {
        return InstanceState::Terminated;
    }
    match (phase, pod_ip) {
        (Some("Succeeded" | "Failed" | "Unknown"), _) => InstanceState::Terminated,
        (Some("Running"), Some(ip)) if !ip.is_empty() && container_running => {
            InstanceState::Running
        }
        _ => InstanceState::Provisioning,
    }
}

/// Why a Pod's squid is not running: its container's waiting (or last terminated) state, or
/// the scheduler's verdict. `None` when nothing unusual is known.
pub fn pod_waiting(status: &PodStatus) -> Option<Waiting> {
    let container = status.container_statuses.iter().flatten().next();
    if let Some(waiting) = container.and_then(container_waiting) {
        return Some(waiting);
    }
    status
        .conditions
        .iter()
        .flatten()
        .find(|c| c.type_ == "PodScheduled" && c.status == "False")
        .map(|c| Waiting {
            reason: c
                .reason
                .clone()
                .filter(|r| !r.is_empty())
                .unwrap_or_else(|| "Unschedulable".to_owned()),
            message: c.message.clone().unwrap_or_default(),
        })
}

/// A container's waiting reason (or, between restarts, how it last ended).
fn container_waiting(container: &ContainerStatus) -> Option<Waiting> {
    let state = container.state.as_ref()?;
    if let Some(waiting) = &state.waiting {
        let reason = waiting.reason.clone().filter(|r| !r.is_empty())?;
        if ROUTINE_WAITING.contains(&reason.as_str()) {
            return None;
        }
        return Some(Waiting {
            reason,
            message: waiting.message.clone().unwrap_or_default(),
        });
    }
    let terminated = state.terminated.as_ref()?;
    Some(Waiting {
        reason: terminated
            .reason
            .clone()
            .filter(|r| !r.is_empty())
            .unwrap_or_else(|| "Terminated".to_owned()),
        message: match &terminated.message {
            Some(message) if !message.is_empty() => message.clone(),
            _ => format!("squid exited with code {}", terminated.exit_code),
        },
    })
}

/// The [`Instance`] a Pod describes.
pub fn instance_from_pod(pod: &Pod) -> Instance {
    let meta = &pod.metadata;
    let name = meta.name.clone().unwrap_or_default();
    let namespace = meta.namespace.clone().unwrap_or_default();
    let status = pod.status.as_ref();
    let phase = status.and_then(|s| s.phase.as_deref());
    let pod_ip = status.and_then(|s| s.pod_ip.as_deref());
    let waiting = status.and_then(pod_waiting);
    let deletion_deadline = meta.deletion_timestamp.as_ref().map(|t| t.0);
    let state = pod_state(
        phase,
        pod_ip,
        waiting.is_none(),
        deletion_deadline.is_some(),
    );
    Instance {
        provider_id: format!("{namespace}/{name}"),
        name,
        state,
        ip: (state == InstanceState::Running)
            .then(|| pod_ip.map(str::to_owned))
            .flatten(),
        uid: meta
            .labels
            .as_ref()
            .and_then(|l| l.get(PROXY_UID_LABEL))
            .cloned(),
        created_at: meta.creation_timestamp.as_ref().map(|t| t.0),
        waiting: (state == InstanceState::Provisioning)
            .then_some(waiting)
            .flatten(),
        deletion_deadline,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn pod_state_table() {
        use InstanceState::*;
        let cases = [
            (None, None, true, false, Provisioning),
            (Some("Pending"), None, true, false, Provisioning),
            (Some("Pending"), Some("10.0.0.5"), true, false, Provisioning),
            (Some("Running"), None, true, false, Provisioning),
            (Some("Running"), Some(""), true, false, Provisioning),
            (Some("Running"), Some("10.0.0.5"), true, false, Running),
            (
                Some("Running"),
                Some("10.0.0.5"),
                false,
                false,
                Provisioning,
            ),
            (Some("Running"), Some("10.0.0.5"), true, true, Terminated),
            (Some("Succeeded"), None, true, false, Terminated),
            (Some("Failed"), Some("10.0.0.5"), true, false, Terminated),
            (Some("Unknown"), None, true, false, Terminated),
        ];
        for (phase, ip, container_running, deleting, want) in cases {
            assert_eq!(
                pod_state(phase, ip, container_running, deleting),
                want,
                "phase {phase:?} ip {ip:?} container running {container_running} deleting {deleting}"
            );
        }
    }

    fn status(value: serde_json::Value) -> PodStatus {
        serde_json::from_value(value).unwrap()
    }

    fn container(state: serde_json::Value) -> serde_json::Value {
        json!({"name": "squid", "image": "ubuntu/squid", "imageID": "", "ready": false,
               "restartCount": 3, "state": state})
    }

    #[test]
    fn waiting_reason_table() {
        let waiting = |reason: &str, message: &str| {
            Some(Waiting {
                reason: reason.into(),
                message: message.into(),
            })
        };
        let cases = [
            ("nothing known", json!({"phase": "Pending"}), None),
            (
                "image pull",
                json!({"phase": "Pending", "containerStatuses": [container(json!({"waiting": {
                    "reason": "ErrImagePull", "message": "pull access denied"}}))]}),
                waiting("ErrImagePull", "pull access denied"),
            ),
            (
                "crash loop",
                json!({"phase": "Running", "podIP": "10.0.0.5", "containerStatuses": [container(
                    json!({"waiting": {"reason": "CrashLoopBackOff",
                    "message": "back-off 10s restarting failed container"}}))]}),
                waiting(
                    "CrashLoopBackOff",
                    "back-off 10s restarting failed container",
                ),
            ),
            (
                "creating is routine",
                json!({"phase": "Pending", "containerStatuses": [container(json!({"waiting": {
                    "reason": "ContainerCreating"}}))]}),
                None,
            ),
            (
                "between restarts",
                json!({"phase": "Running", "containerStatuses": [container(json!({"terminated": {
                    "reason": "Error", "exitCode": 1}}))]}),
                waiting("Error", "squid exited with code 1"),
            ),
            (
                "running container",
                json!({"phase": "Running", "containerStatuses": [container(json!({"running": {}}))]}),
                None,
            ),
            (
                "unschedulable",
                json!({"phase": "Pending", "conditions": [{"type": "PodScheduled",
                    "status": "False", "reason": "Unschedulable",
                    "message": "0/3 nodes are available: 3 Insufficient cpu."}]}),
                waiting(
                    "Unschedulable",
                    "0/3 nodes are available: 3 Insufficient cpu.",
                ),
            ),
            (
                "scheduled",
                json!({"phase": "Pending", "conditions": [{"type": "PodScheduled",
                    "status": "True"}]}),
                None,
            ),
        ];
        for (name, value, want) in cases {
            assert_eq!(pod_waiting(&status(value)), want, "{name}");
        }
    }

    #[test]
    fn instance_carries_the_reason_and_the_deletion_deadline() {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": "proxy-a", "namespace": "crawl",
                         "labels": {PROXY_UID_LABEL: "u1"},
                         "creationTimestamp": "2026-01-01T00:00:00Z"},
            "status": {"phase": "Running", "podIP": "10.0.0.5", "containerStatuses": [container(
                json!({"waiting": {"reason": "CrashLoopBackOff", "message": "back-off"}}))]},
        }))
        .unwrap();
        let instance = instance_from_pod(&pod);
        assert_eq!(instance.provider_id, "crawl/proxy-a");
        assert_eq!(instance.state, InstanceState::Provisioning);
        assert_eq!(instance.ip, None);
        assert_eq!(instance.uid.as_deref(), Some("u1"));
        assert_eq!(instance.waiting.unwrap().reason, "CrashLoopBackOff");
        assert_eq!(instance.deletion_deadline, None);

        let deleting: Pod = serde_json::from_value(json!({
            "metadata": {"name": "proxy-a", "namespace": "crawl",
                         "deletionTimestamp": "2026-01-01T00:00:40Z"},
            "status": {"phase": "Running", "podIP": "10.0.0.5"},
        }))
        .unwrap();
        let instance = instance_from_pod(&deleting);
        assert_eq!(instance.state, InstanceState::Terminated);
        assert_eq!(instance.waiting, None);
        assert_eq!(
            instance.deletion_deadline,
            Some("2026-01-01T00:00:40Z".parse().unwrap())
        );
    }
}
