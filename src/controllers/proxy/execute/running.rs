//! A machine that runs: its address and the end of a finished replacement, remediation that
//! pauses when too many proxies fail at once, and the start of a voluntary replacement within
//! the replacement budget.

use jiff::Timestamp;
use kube::runtime::controller;
use kube::runtime::events::EventType;

use super::drain::{cause, draining, leases_text, why};
use super::machine::Machine;
use super::step::{RetryEffect, Step, new_reason_event, poll_or_at};
use crate::controllers::budget::{self, Admission, Share};
use crate::controllers::proxy::status::{
    FieldChange, REASON_REMEDIATION_PAUSED, REASON_REPLACEMENT_PENDING, REASON_RUNNING,
    StatusChange,
};
use crate::controllers::proxy::time::after;
use crate::events::event;
use crate::resources::phase::Provisioning;
use crate::resources::proxy::{
    ConditionStatus, Disruption, DisruptionReason, ProxyStatus, REASON_DRAINING,
};

/// The machine runs: record its address; end a finished replacement (freeing its budget
/// slot); say when remediation is paused; look again when rotation or remediation falls due.
pub(super) fn running(
    machine: &Machine<'_>,
    current: &ProxyStatus,
    ip: Option<String>,
    replaced: bool,
    recheck: Option<Timestamp>,
    remediation_paused: Option<(usize, usize)>,
) -> Step {
    let config = &machine.ctx.config;
    let mut poll = config.drift_poll;
    let (reason, message, event) = match remediation_paused {
        Some((unhealthy, managed)) => {
            poll = config.provisioning_poll;
            let provider = machine.proxy.spec.provider.as_deref().unwrap_or_default();
            let message = format!(
                "machine is running but failing health checks for longer than {}; not replaced \
                 while {unhealthy} of the {managed} Managed proxies of provider {provider} are \
                 unhealthy (more than --max-unhealthy {}): the fault is likely the network or \
                 the probe target",
                humantime::format_duration(config.remediate_after),
                config.max_unhealthy,
            );
            let event = new_reason_event(
                current,
                EventType::Warning,
                REASON_REMEDIATION_PAUSED,
                "Remediate",
                &message,
            );
            if event.is_some() {
                log::warn!("Proxy {}: {message}", machine.proxy.key());
            }
            (REASON_REMEDIATION_PAUSED, message, event)
        }
        None => (REASON_RUNNING, "machine is running".to_owned(), None),
    };
    let mut step = Step::new(
        Some(
            StatusChange::new(Provisioning::Done, ConditionStatus::True, reason, message)
                .ip(FieldChange::to(ip)),
        ),
        poll_or_at(poll, recheck, machine.now),
    )
    .with_event(event)
    .with_retry(RetryEffect::Running);
    // A machine from before `status.port` existed: its spec hash is current (or this would
    // be a replacement), so it listens on `spec.port`.
    if current.port.is_none() {
        step = step.with_port(machine.proxy.spec.port);
    }
    if !replaced {
        return step;
    }
    machine.ctx.grants.release(&machine.uid());
    log::info!(
        "Proxy {}: its new machine runs and passes health checks; the replacement is over",
        machine.proxy.key()
    );
    step.with_disruption(None)
}

/// A voluntary replacement is due: start its drain if the replacement budget has a slot,
/// otherwise say it waits.
pub(super) fn disrupt(
    machine: &Machine<'_>,
    current: &ProxyStatus,
    reason: DisruptionReason,
) -> Step {
    let ctx = machine.ctx;
    let Some(fleet) = ctx.fleet() else {
        // Right after start-up: the holders are not known until the first list is in.
        return Step::requeue(controller::Action::requeue(ctx.config.provisioning_poll))
            .with_retry(RetryEffect::Neutral);
    };
    let limit = ctx
        .config
        .replacement_budget
        .budget(budget::managed(fleet.iter().map(AsRef::as_ref)));
    let holders = budget::holders(fleet.iter().map(AsRef::as_ref));
    let why = why(reason);
    match ctx.grants.try_admit(&machine.uid(), holders, limit) {
        Admission::Granted | Admission::AlreadyHeld => {
            let leases = ctx.ledger.counts().active_count(&machine.uid());
            let deadline = after(machine.now, ctx.config.drain_timeout);
            let cause = cause(reason);
            log::info!(
                "Proxy {}: {why}; draining ({}) before replacing its machine",
                machine.proxy.key(),
                leases_text(leases)
            );
            let mut step = draining(machine, cause, leases, deadline, false);
            step.disruption_started = Some(reason.label());
            step.with_disruption(Some(Disruption {
                reason,
                since: machine.now,
                replaced_at: None,
            }))
            .with_event(Some(event(
                EventType::Normal,
                REASON_DRAINING,
                "Drain",
                format!("{why}; draining before {cause}: {}", leases_text(leases)),
            )))
        }
        Admission::Wait { in_use, limit } => {
            let message = budget_wait_message(why, in_use, limit, ctx.config.replacement_budget);
            let event = new_reason_event(
                current,
                EventType::Normal,
                REASON_REPLACEMENT_PENDING,
                "Replace",
                &message,
            );
            Step::new(
                Some(StatusChange::new(
                    Provisioning::Done,
                    ConditionStatus::True,
                    REASON_REPLACEMENT_PENDING,
                    message,
                )),
                controller::Action::requeue(ctx.config.provisioning_poll),
            )
            .with_event(event)
            .with_retry(RetryEffect::Neutral)
        }
    }
}

/// Why an admitted replacement waits: the budget is full, or replacements are paused.
fn budget_wait_message(why: &str, in_use: usize, limit: usize, budget: Share) -> String {
    if limit == 0 {
        format!("{why}; replacements are paused (--replacement-budget {budget})")
    } else {
        format!(
            "{why}; waiting for the replacement budget ({in_use} of {limit} in use, \
             --replacement-budget {budget})"
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_waiting_replacement_says_whether_the_budget_is_full_or_paused() {
        let paused = budget_wait_message("spec changed", 0, 0, Share::Count(0));
        assert_eq!(
            paused,
            "spec changed; replacements are paused (--replacement-budget 0)"
        );
        let full = budget_wait_message("spec changed", 2, 2, Share::Percent(10));
        assert_eq!(
            full,
            "spec changed; waiting for the replacement budget (2 of 2 in use, \
             --replacement-budget 10%)"
        );
    }
}
