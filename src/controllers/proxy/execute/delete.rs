//! Deleting a machine: the dead or stuck one that is replaced, the old one of a replacement
//! after its drain, the Proxy's own at its deletion, the force-delete of one whose node is
//! lost, and forgetting a machine once it is gone (its leases end with it).

use std::time::Duration;

use jiff::Timestamp;
use kube::Api;
use kube::runtime::controller;
use kube::runtime::events::EventType;

use super::create::record_hash;
use super::drain::{end_drain, why, with_drain_timeout};
use super::failure::failure;
use super::finalizer::remove_finalizer;
use super::machine::{Machine, find_by_name};
use super::step::{
    RetryEffect, Step, condition_reason_is, hold_message, new_reason_event, poll_or_at, requeue_at,
    waiting_text,
};
use super::{LEASES_MACHINE_GONE, LEASES_MACHINE_LOST, LEASES_MACHINE_REPLACED};
use crate::controllers::proxy::decide::Loss;
use crate::controllers::proxy::error::Error;
use crate::controllers::proxy::status::{
    FieldChange, REASON_CREATE_FAILED, REASON_DELETING, REASON_FORCE_DELETED, REASON_MACHINE_GONE,
    REASON_MACHINE_LOST, REASON_MACHINE_STOPPED, REASON_MACHINE_TERMINATING, REASON_REPLACING,
    REASON_STARTUP_TIMEOUT, StatusChange,
};
use crate::events::event;
use crate::provider::Waiting;
use crate::resources::phase::Provisioning;
use crate::resources::proxy::{
    ConditionStatus, Disruption, DisruptionReason, Phase, Proxy, ProxyStatus, REASON_DRAINING,
};

/// A machine that did not run within `--startup-timeout`: hold the next create for a
/// backoff and delete it to create a new one.
pub(super) async fn replace_stuck(
    machine: &Machine<'_>,
    current: &ProxyStatus,
    waiting: Option<Waiting>,
) -> Result<Step, Error> {
    let id = machine.provider_id()?;
    let timeout = humantime::format_duration(machine.ctx.config.startup_timeout);
    let why = waiting
        .as_ref()
        .map(|w| format!(" ({})", waiting_text(w)))
        .unwrap_or_default();
    let message = format!("machine {id} did not run within {timeout}{why}; replacing it");
    log::warn!("Proxy {}: {message}", machine.proxy.key());
    machine.ctx.pacing.machine_failed(
        &machine.uid(),
        machine.backoff(),
        machine.at(),
        REASON_STARTUP_TIMEOUT,
        message.clone(),
    );
    delete(
        machine,
        current,
        Provisioning::Replacing,
        (EventType::Warning, REASON_STARTUP_TIMEOUT),
        &message,
    )
    .await
}

/// A machine that stopped, terminated or is being deleted: delete it (again) to create a new
/// one, and look again by `force_at` at the latest.
pub(super) async fn delete_dead(
    machine: &Machine<'_>,
    current: &ProxyStatus,
    force_at: Option<Timestamp>,
) -> Result<Step, Error> {
    let requeue = poll_or_at(machine.ctx.config.deletion_poll, force_at, machine.now);
    let mut step = if current.phase == Some(Phase::Replacing) {
        // Already being replaced (its deletion shows as Terminated): keep the reason
        // given when the replacement started, ask again, wait.
        delete_again(machine, current).await?
    } else if let Some(at) = force_at {
        let id = machine.provider_id()?;
        let at = at.round(jiff::Unit::Second).unwrap_or(at);
        let message = format!(
            "machine {id} is being deleted; a new one is created once it is gone, and \
             it is force-deleted if still there at {at}"
        );
        delete(
            machine,
            current,
            Provisioning::Replacing,
            (EventType::Warning, REASON_MACHINE_TERMINATING),
            &message,
        )
        .await?
    } else {
        delete(
            machine,
            current,
            Provisioning::Replacing,
            (EventType::Normal, REASON_MACHINE_STOPPED),
            "machine stopped or terminated; deleting it to create a new one",
        )
        .await?
    };
    if step.retry == RetryEffect::Progress {
        step.requeue = requeue;
    }
    Ok(step)
}

/// A voluntary replacement whose drain is over: delete the machine to create a new one.
pub(super) async fn replace(
    machine: &Machine<'_>,
    current: &ProxyStatus,
    reason: DisruptionReason,
    drain_timed_out: bool,
) -> Result<Step, Error> {
    let ended = end_drain(machine, drain_timed_out).await;
    let message = format!("{}; deleting the machine to create a new one", why(reason));
    let step = delete(
        machine,
        current,
        Provisioning::Replacing,
        (EventType::Normal, REASON_REPLACING),
        &message,
    )
    .await?;
    Ok(with_drain_timeout(step, ended, machine))
}

/// The Proxy is being deleted and its drain is over: delete its machine.
pub(super) async fn delete_for_cleanup(
    machine: &Machine<'_>,
    current: &ProxyStatus,
    drain_timed_out: bool,
) -> Result<Step, Error> {
    let ended = end_drain(machine, drain_timed_out).await;
    let step = delete(
        machine,
        current,
        Provisioning::Deleting,
        (EventType::Normal, REASON_DELETING),
        "Proxy is being deleted; deleting its machine",
    )
    .await?;
    Ok(with_drain_timeout(step, ended, machine))
}

/// The Proxy is being deleted during a create whose machine was never recorded: delete the
/// machine it may have made (found by name), or let the Proxy go.
pub(super) async fn cleanup_pending(
    machine: &Machine<'_>,
    current: &ProxyStatus,
    api: &Api<Proxy>,
) -> Result<Step, Error> {
    let provider = machine.provider()?;
    match find_by_name(machine, provider).await {
        Ok(Some(instance)) => {
            let id = instance.provider_id;
            log::info!(
                "Proxy {}: deleting machine {id} of an interrupted create before the \
                 Proxy goes",
                machine.proxy.key()
            );
            match provider.delete(&id).await {
                Ok(()) => Ok(deleting(machine, FieldChange::Set(id))),
                Err(e) => failure(machine, current, e),
            }
        }
        Ok(None) => remove_finalizer(machine, api).await,
        Err(e) => failure(machine, current, e),
    }
}

/// Deletes the machine and reports the given provisioning state; the Event (`event`) goes out
/// when the phase first changes.
async fn delete(
    machine: &Machine<'_>,
    current: &ProxyStatus,
    state: Provisioning,
    (event_type, reason): (EventType, &'static str),
    message: &str,
) -> Result<Step, Error> {
    let provider = machine.provider()?;
    let id = machine.provider_id()?;
    if let Err(e) = provider.delete(id).await
        && !e.is_not_found()
    {
        return failure(machine, current, e);
    }
    let first = first_deletion(current, state);
    Ok(Step::new(
        Some(
            StatusChange::new(state, ConditionStatus::False, reason, message)
                .ip(FieldChange::Clear),
        ),
        controller::Action::requeue(machine.ctx.config.deletion_poll),
    )
    .with_event(first.then(|| {
        event(
            event_type,
            reason,
            "Delete",
            format!("deleting machine {id}: {message}"),
        )
    })))
}

/// Whether a deletion into `state` is new (its Event goes out): the phase changes, or a
/// drain just ended.
fn first_deletion(current: &ProxyStatus, state: Provisioning) -> bool {
    let phase = if state == Provisioning::Deleting {
        Phase::Deleting
    } else {
        Phase::Replacing
    };
    current.phase != Some(phase) || condition_reason_is(current, REASON_DRAINING)
}

/// Asks again for the deletion of a machine already being replaced; status stays as it is.
async fn delete_again(machine: &Machine<'_>, current: &ProxyStatus) -> Result<Step, Error> {
    let provider = machine.provider()?;
    let id = machine.provider_id()?;
    if let Err(e) = provider.delete(id).await
        && !e.is_not_found()
    {
        return failure(machine, current, e);
    }
    Ok(Step::requeue(controller::Action::requeue(
        machine.ctx.config.deletion_poll,
    )))
}

/// The Proxy is being deleted and its machine `provider_id` is going: record the ID so later
/// passes follow the machine until it is gone.
fn deleting(machine: &Machine<'_>, provider_id: FieldChange) -> Step {
    Step::new(
        Some(
            StatusChange::new(
                Provisioning::Deleting,
                ConditionStatus::False,
                REASON_DELETING,
                "Proxy is being deleted; deleting its machine",
            )
            .provider_id(provider_id)
            .ip(FieldChange::Clear),
        ),
        controller::Action::requeue(machine.ctx.config.deletion_poll),
    )
}

/// Force-deletes a machine whose deletion is stuck past `deadline` (its node is gone and will
/// never confirm it) and ends its leases, so the new machine starts with full capacity.
pub(super) async fn force_delete(
    machine: &Machine<'_>,
    current: &ProxyStatus,
    deadline: Timestamp,
) -> Result<Step, Error> {
    let provider = machine.provider()?;
    let id = machine.provider_id()?;
    let proxy = machine.proxy;
    if let Err(e) = provider.force_delete(id).await
        && !e.is_not_found()
    {
        return failure(machine, current, e);
    }
    let ended = machine.end_leases(LEASES_MACHINE_LOST).await;
    let margin = humantime::format_duration(machine.ctx.config.force_delete_margin);
    let leases = if ended == 1 { "lease" } else { "leases" };
    let message = format!(
        "machine {id} was still terminating {margin} after its deletion deadline {deadline} \
         (a lost node?); force-deleted it and ended {ended} active {leases} on it"
    );
    log::warn!("Proxy {}: {message}", proxy.key());
    let deleting_proxy = proxy.metadata.deletion_timestamp.is_some();
    Ok(Step::new(
        Some(
            StatusChange::new(
                if deleting_proxy {
                    Provisioning::Deleting
                } else {
                    Provisioning::Replacing
                },
                ConditionStatus::False,
                REASON_MACHINE_LOST,
                message.clone(),
            )
            .ip(FieldChange::Clear),
        ),
        controller::Action::requeue(machine.ctx.config.deletion_poll),
    )
    .with_event(Some(event(
        EventType::Warning,
        REASON_FORCE_DELETED,
        "Delete",
        message,
    ))))
}

/// The machine is gone: end its leases, forget its ID and IP. One that vanished before it ever
/// ran (a create the provider accepted and then failed) holds the next create for a backoff.
pub(super) async fn forget(
    machine: &Machine<'_>,
    current: &ProxyStatus,
    hash: Option<String>,
    loss: Loss,
) -> Step {
    let id = machine.provider_id.unwrap_or_default();
    machine.end_leases(lease_end_reason(loss)).await;
    let annotations = hash.as_deref().map(record_hash);
    // The old machine of a voluntary replacement is gone: what runs next is its replacement.
    let replaced = replaced(current, machine.now);
    if loss != Loss::BeforeRunning {
        let step = Step::new(
            Some(
                StatusChange::new(
                    Provisioning::InProgress,
                    ConditionStatus::False,
                    REASON_MACHINE_GONE,
                    "machine is gone; creating a new one",
                )
                .provider_id(FieldChange::Clear)
                .ip(FieldChange::Clear),
            ),
            controller::Action::requeue(Duration::ZERO),
        )
        .with_annotations(annotations);
        return match replaced {
            Some(disruption) => step.with_disruption(Some(disruption)),
            None => step,
        };
    }
    let message = format!(
        "machine {id} vanished before it ran (the provider accepted the create, then failed it)"
    );
    log::warn!("Proxy {}: {message}", machine.proxy.key());
    let hold = machine.ctx.pacing.machine_failed(
        &machine.uid(),
        machine.backoff(),
        machine.at(),
        REASON_CREATE_FAILED,
        message,
    );
    let event = new_reason_event(
        current,
        EventType::Warning,
        REASON_CREATE_FAILED,
        "Provision",
        &hold_message(&hold),
    );
    Step::new(
        Some(
            StatusChange::new(
                Provisioning::Waiting,
                ConditionStatus::False,
                REASON_CREATE_FAILED,
                hold_message(&hold),
            )
            .provider_id(FieldChange::Clear)
            .ip(FieldChange::Clear),
        ),
        requeue_at(hold.until, machine.now),
    )
    .with_annotations(annotations)
    .with_event(event)
}

/// The ledger reason of the leases a gone machine leaves.
fn lease_end_reason(loss: Loss) -> &'static str {
    match loss {
        Loss::Expected => LEASES_MACHINE_REPLACED,
        Loss::WhileServing | Loss::BeforeRunning => LEASES_MACHINE_GONE,
    }
}

/// The disruption of a voluntary replacement whose old machine is now gone, marked replaced
/// at `now`; `None` when there is none or it was marked already.
fn replaced(current: &ProxyStatus, now: Timestamp) -> Option<Disruption> {
    current
        .disruption
        .as_ref()
        .filter(|d| d.replaced_at.is_none())
        .map(|d| Disruption {
            replaced_at: Some(now),
            ..d.clone()
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::proxy::{CONDITION_PROVISIONED, Condition};

    fn status(phase: Option<Phase>, reason: &str) -> ProxyStatus {
        ProxyStatus {
            phase,
            conditions: vec![Condition {
                type_: CONDITION_PROVISIONED.into(),
                status: ConditionStatus::False,
                reason: reason.into(),
                message: String::new(),
                last_transition_time: Timestamp::UNIX_EPOCH,
                observed_generation: None,
            }],
            ..ProxyStatus::default()
        }
    }

    #[test]
    fn a_deletion_is_new_when_the_phase_changes_or_a_drain_just_ended() {
        use Provisioning::{Deleting, Replacing};
        let cases = [
            (status(Some(Phase::Ready), "Running"), Replacing, true),
            (
                status(Some(Phase::Replacing), "Replacing"),
                Replacing,
                false,
            ),
            (
                status(Some(Phase::Replacing), REASON_DRAINING),
                Replacing,
                true,
            ),
            (status(Some(Phase::Replacing), "Replacing"), Deleting, true),
            (status(Some(Phase::Deleting), "Deleting"), Deleting, false),
            (
                status(Some(Phase::Deleting), REASON_DRAINING),
                Deleting,
                true,
            ),
            (status(None, ""), Deleting, true),
        ];
        for (current, state, want) in cases {
            assert_eq!(
                first_deletion(&current, state),
                want,
                "{:?} {:?} -> {state:?}",
                current.phase,
                current.conditions[0].reason
            );
        }
    }

    #[test]
    fn the_leases_of_a_gone_machine_end_with_why_it_went() {
        assert_eq!(lease_end_reason(Loss::Expected), LEASES_MACHINE_REPLACED);
        assert_eq!(lease_end_reason(Loss::WhileServing), LEASES_MACHINE_GONE);
        assert_eq!(lease_end_reason(Loss::BeforeRunning), LEASES_MACHINE_GONE);
    }

    #[test]
    fn a_replacement_is_marked_replaced_once() {
        let since = Timestamp::from_second(100).unwrap();
        let now = Timestamp::from_second(200).unwrap();
        let disruption = |replaced_at| ProxyStatus {
            disruption: Some(Disruption {
                reason: DisruptionReason::SpecChange,
                since,
                replaced_at,
            }),
            ..ProxyStatus::default()
        };
        let marked = replaced(&disruption(None), now).unwrap();
        assert_eq!((marked.since, marked.replaced_at), (since, Some(now)));
        assert_eq!(replaced(&disruption(Some(since)), now), None);
        assert_eq!(replaced(&ProxyStatus::default(), now), None);
    }
}
