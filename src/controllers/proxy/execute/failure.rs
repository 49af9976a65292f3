//! Failures: a provider call that failed, a Proxy that waits for something outside it (its
//! cloud-init, its provider's entry in the config), and the hold that keeps a failure from
//! being tried again at once.

use std::time::Duration;

use kube::runtime::controller;
use kube::runtime::events::EventType;

use super::machine::Machine;
use super::step::{RetryEffect, Step, hold_message, new_reason_event};
use crate::controllers::proxy::context::{Context, ReconcilerConfig};
use crate::controllers::proxy::decide::{Action, on_provider_error};
use crate::controllers::proxy::error::Error;
use crate::controllers::proxy::pacing::hold_for;
use crate::controllers::proxy::status::{
    REASON_CLOUD_INIT, REASON_PROVIDER_FAILED, REASON_REFUSED, REASON_UNKNOWN_PROVIDER,
    StatusChange,
};
use crate::provider::ProviderError;
use crate::resources::phase::Provisioning;
use crate::resources::proxy::{ConditionStatus, ProxySpec, ProxyStatus, REASON_QUOTA};

/// The step for a failed provider call.
pub(super) fn failure(
    machine: &Machine<'_>,
    current: &ProxyStatus,
    error: ProviderError,
) -> Result<Step, Error> {
    failure_step(
        on_provider_error(error.class, error.to_string()),
        machine,
        current,
    )
}

/// How long a failure holds the next try.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wait {
    /// `--quota-requeue`: quota comes back slowly.
    Quota,
    /// The failure backoff, doubling with each refusal in a row.
    Backoff,
    /// The slow retry of a permanent failure.
    PermanentRetry,
}

/// What a failure action means for the status: the provisioning state, the condition reason,
/// the message and the wait. Transient failures are errors (the controller backs off).
fn classify(
    action: Action,
    current: &ProxyStatus,
) -> Result<(Provisioning, &'static str, String, Wait), Error> {
    // A machine already asked for stays in progress; none yet waits.
    let keep_state = if current.provider_id.is_some() {
        Provisioning::InProgress
    } else {
        Provisioning::Waiting
    };
    match action {
        Action::Backoff { message } => Err(Error::Provider(message)),
        Action::QuotaWait { message } => Ok((keep_state, REASON_QUOTA, message, Wait::Quota)),
        Action::Refused { message } => Ok((keep_state, REASON_REFUSED, message, Wait::Backoff)),
        Action::Fail { message } => Ok((
            Provisioning::Failed,
            REASON_PROVIDER_FAILED,
            message,
            Wait::PermanentRetry,
        )),
        other => Err(Error::Provider(format!(
            "unexpected failure action {other:?}"
        ))),
    }
}

/// Executes a failure action: transient → error (the controller backs off); refused → the
/// condition and a backoff hold; quota → the condition and a long hold; permanent → Failed
/// and a slow retry. A hold keeps the status write's own re-trigger from trying again at once.
pub(super) fn failure_step(
    action: Action,
    machine: &Machine<'_>,
    current: &ProxyStatus,
) -> Result<Step, Error> {
    let proxy = machine.proxy;
    let config = &machine.ctx.config;
    let uid = machine.uid();
    let (provisioning, reason, message, wait) = classify(action, current)?;
    let delay = match wait {
        Wait::Quota => {
            log::warn!("Proxy {}: quota exceeded: {message}", proxy.key());
            config.quota_requeue
        }
        Wait::Backoff => {
            let (base, cap) = machine.backoff();
            log::warn!("Proxy {}: refused: {message}", proxy.key());
            machine.ctx.pacing.failed(&uid, base, cap)
        }
        Wait::PermanentRetry => {
            log::error!(
                "Proxy {}: provider failed permanently: {message}",
                proxy.key()
            );
            config.permanent_failure_retry
        }
    };
    // The hold this failure follows, if it was for the same reason, already had its Event: the
    // condition may not show it yet when this reconcile read a copy older than that write.
    let reported = machine
        .ctx
        .pacing
        .get(&uid)
        .hold
        .is_some_and(|h| h.reason == reason && h.generation == proxy.metadata.generation);
    let hold = hold_for(machine.at(), delay, reason, message);
    machine.ctx.pacing.hold(&uid, hold.clone());
    let event = new_reason_event(
        current,
        EventType::Warning,
        reason,
        "Provision",
        &hold.message,
    )
    .filter(|_| !reported);
    Ok(Step::new(
        Some(StatusChange::new(
            provisioning,
            ConditionStatus::False,
            reason,
            hold_message(&hold),
        )),
        controller::Action::requeue(delay),
    )
    .with_event(event)
    .with_retry(RetryEffect::Neutral))
}

/// The cloud-init a Managed Proxy names cannot be read yet.
pub(super) fn cloud_init_missing(message: &str, config: &ReconcilerConfig) -> Step {
    waiting(
        REASON_CLOUD_INIT,
        message.to_owned(),
        config.provisioning_poll,
    )
}

/// `spec.provider` names no entry of the providers config: say so and look again at the drift
/// poll (a config change restarts the operator).
pub(crate) fn unknown_provider(spec: &ProxySpec, ctx: &Context) -> Step {
    let message = format!(
        "provider {:?} is not in the operator's providers config",
        spec.provider.as_deref().unwrap_or_default()
    );
    waiting(REASON_UNKNOWN_PROVIDER, message, ctx.config.drift_poll)
}

/// A Proxy that cannot be provisioned until something outside it changes: condition
/// `Provisioned=False/<reason>`, machine fields untouched, a check again after `requeue`.
fn waiting(reason: &'static str, message: String, requeue: Duration) -> Step {
    Step::new(
        Some(StatusChange::new(
            Provisioning::Waiting,
            ConditionStatus::False,
            reason,
            message,
        )),
        controller::Action::requeue(requeue),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(provider_id: Option<&str>) -> ProxyStatus {
        ProxyStatus {
            provider_id: provider_id.map(str::to_owned),
            ..ProxyStatus::default()
        }
    }

    #[test]
    fn failures_classify_by_action_and_whether_a_machine_was_asked_for() {
        type Make = fn(String) -> Action;
        let quota: Make = |message| Action::QuotaWait { message };
        let refused: Make = |message| Action::Refused { message };
        let fail: Make = |message| Action::Fail { message };
        use Provisioning::{Failed, InProgress, Waiting};
        // (action, reason, wait, state with no machine yet, state with one asked for)
        let cases = [
            (quota, REASON_QUOTA, Wait::Quota, Waiting, InProgress),
            (refused, REASON_REFUSED, Wait::Backoff, Waiting, InProgress),
            (
                fail,
                REASON_PROVIDER_FAILED,
                Wait::PermanentRetry,
                Failed,
                Failed,
            ),
        ];
        for (make, reason, wait, without, with) in cases {
            for (provider_id, state) in [(None, without), (Some("vm-1"), with)] {
                let action = make("m".into());
                let label = format!("{action:?} with {provider_id:?}");
                let got = classify(action, &status(provider_id)).unwrap();
                assert_eq!(got, (state, reason, "m".to_owned(), wait), "{label}");
            }
        }
    }

    #[test]
    fn transient_failures_and_other_actions_are_errors() {
        let transient = classify(
            Action::Backoff {
                message: "timeout".into(),
            },
            &status(None),
        );
        assert!(matches!(transient, Err(Error::Provider(m)) if m == "timeout"));
        let other = classify(Action::AddFinalizer, &status(None));
        assert!(matches!(other, Err(Error::Provider(m)) if m.contains("AddFinalizer")));
    }
}
