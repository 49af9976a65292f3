//! What executing an action leaves to write ([`Step`]), and the small rules every job
//! shares: when to look again, how a hold and a provider's waiting reason read, and when an
//! Event is new.

use std::time::Duration;

use jiff::Timestamp;
use kube::runtime::controller;
use kube::runtime::events::{Event, EventType};
use serde_json::Value;

use crate::controllers::proxy::pacing::Hold;
use crate::controllers::proxy::status::{FieldChange, StatusChange};
use crate::controllers::proxy::time::after;
use crate::events::event;
use crate::provider::Waiting;
use crate::resources::proxy::{CONDITION_PROVISIONED, Disruption, ProxyStatus};

/// What a reconcile's outcome means for the retry memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RetryEffect {
    /// It did what it set out to: failures in a row start over.
    Progress,
    /// The machine runs: machines that never ran are forgiven too.
    Running,
    /// It waited, or already counted its own failure.
    Neutral,
}

/// What executing an action leaves to write.
pub(crate) struct Step {
    /// Status change, or `None` to leave status alone.
    pub status: Option<StatusChange>,
    /// Annotation patch applied after the status write.
    pub annotations: Option<Value>,
    /// Event to publish last.
    pub event: Option<Event>,
    /// When to look again.
    pub requeue: controller::Action,
    /// What it means for the retry memory.
    pub retry: RetryEffect,
    /// The resourceVersion returned by a metadata patch made before the status write.
    pub resource_version: Option<String>,
    /// The disruption (its metric label) this step starts: counted once its status is written,
    /// so a write that lost a race (and is redone) counts nothing.
    pub disruption_started: Option<&'static str>,
}

impl Step {
    pub(super) fn new(status: Option<StatusChange>, requeue: controller::Action) -> Self {
        Step {
            status,
            annotations: None,
            event: None,
            requeue,
            retry: RetryEffect::Progress,
            resource_version: None,
            disruption_started: None,
        }
    }

    pub(super) fn requeue(requeue: controller::Action) -> Self {
        Step::new(None, requeue)
    }

    pub(super) fn with_event(mut self, event: Option<Event>) -> Self {
        self.event = event;
        self
    }

    pub(super) fn with_annotations(mut self, annotations: Option<Value>) -> Self {
        self.annotations = annotations;
        self
    }

    pub(super) fn with_retry(mut self, retry: RetryEffect) -> Self {
        self.retry = retry;
        self
    }

    /// Sets (`Some`) or clears (`None`) `status.disruption` with the status change.
    pub(super) fn with_disruption(mut self, disruption: Option<Disruption>) -> Self {
        if let Some(status) = &mut self.status {
            status.disruption = FieldChange::to(disruption);
        }
        self
    }

    /// Records the port a machine was created with, with the status change.
    pub(super) fn with_port(mut self, port: i32) -> Self {
        if let Some(status) = &mut self.status {
            status.port = FieldChange::Set(port);
        }
        self
    }
}

/// A requeue after `until`, from `now`.
pub(super) fn requeue_at(until: Timestamp, now: Timestamp) -> controller::Action {
    let wait = until
        .duration_since(now)
        .try_into()
        .unwrap_or(Duration::ZERO);
    controller::Action::requeue(wait)
}

/// A requeue after `poll`, or at `deadline` if that comes first.
pub(super) fn poll_or_at(
    poll: Duration,
    deadline: Option<Timestamp>,
    now: Timestamp,
) -> controller::Action {
    match deadline {
        Some(deadline) if after(now, poll) > deadline => requeue_at(deadline, now),
        _ => controller::Action::requeue(poll),
    }
}

/// The condition message of a hold: what happened and when the next try is.
pub(super) fn hold_message(hold: &Hold) -> String {
    let next = hold.until.round(jiff::Unit::Second).unwrap_or(hold.until);
    format!("{}; next attempt at {next}", hold.message)
}

/// `reason: message` of a provider's waiting reason.
pub(super) fn waiting_text(waiting: &Waiting) -> String {
    if waiting.message.is_empty() {
        waiting.reason.clone()
    } else {
        format!("{}: {}", waiting.reason, waiting.message)
    }
}

/// Whether the `Provisioned` condition already has `reason` (so its Event went out).
pub(super) fn condition_reason_is(current: &ProxyStatus, reason: &str) -> bool {
    current
        .condition(CONDITION_PROVISIONED)
        .is_some_and(|c| c.reason == reason)
}

/// The Event `reason` with `note`, unless the `Provisioned` condition already has that reason:
/// its Event went out when the condition got it, and a reconcile that finds the same situation
/// again does not repeat it.
pub(super) fn new_reason_event(
    current: &ProxyStatus,
    event_type: EventType,
    reason: &str,
    action: &str,
    note: &str,
) -> Option<Event> {
    (!condition_reason_is(current, reason))
        .then(|| event(event_type, reason, action, note.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::proxy::{Condition, ConditionStatus};

    fn at(second: i64) -> Timestamp {
        Timestamp::from_second(second).unwrap()
    }

    #[test]
    fn requeues_wait_until_a_time_or_a_poll_whichever_comes_first() {
        let secs = |s| controller::Action::requeue(Duration::from_secs(s));
        assert_eq!(requeue_at(at(130), at(100)), secs(30));
        assert_eq!(requeue_at(at(90), at(100)), secs(0), "a time passed");
        let poll = Duration::from_secs(10);
        let cases = [
            (None, secs(10)),
            (Some(at(105)), secs(5)),
            (Some(at(110)), secs(10)),
            (Some(at(200)), secs(10)),
            (Some(at(50)), secs(0)),
        ];
        for (deadline, want) in cases {
            assert_eq!(poll_or_at(poll, deadline, at(100)), want, "{deadline:?}");
        }
    }

    #[test]
    fn holds_and_waiting_reasons_read_as_one_line() {
        let hold = Hold {
            until: Timestamp::from_millisecond(1_700_000_000_400).unwrap(),
            generation: Some(1),
            reason: "Refused".into(),
            message: "quota".into(),
        };
        assert_eq!(
            hold_message(&hold),
            "quota; next attempt at 2023-11-14T22:13:20Z"
        );
        let waiting = |message: &str| Waiting {
            reason: "Unschedulable".into(),
            message: message.into(),
        };
        assert_eq!(waiting_text(&waiting("")), "Unschedulable");
        assert_eq!(
            waiting_text(&waiting("0/3 nodes")),
            "Unschedulable: 0/3 nodes"
        );
    }

    #[test]
    fn an_event_goes_out_only_when_the_condition_gets_a_new_reason() {
        let current = ProxyStatus {
            conditions: vec![Condition {
                type_: CONDITION_PROVISIONED.into(),
                status: ConditionStatus::False,
                reason: "Refused".into(),
                message: String::new(),
                last_transition_time: at(0),
                observed_generation: None,
            }],
            ..ProxyStatus::default()
        };
        let event =
            |reason| new_reason_event(&current, EventType::Warning, reason, "Provision", "n");
        assert!(event("Refused").is_none());
        let new = event("QuotaExceeded").unwrap();
        assert_eq!(
            (new.reason.as_str(), new.note.as_deref()),
            ("QuotaExceeded", Some("n"))
        );
        assert!(
            new_reason_event(
                &ProxyStatus::default(),
                EventType::Normal,
                "Refused",
                "Provision",
                "n"
            )
            .is_some(),
            "no condition yet"
        );
    }
}
