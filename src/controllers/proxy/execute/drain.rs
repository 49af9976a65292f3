//! Drains: a machine about to be deleted or replaced keeps serving its leases, takes no new
//! ones, and is deleted when they end or at a deadline; a drain that times out ends them.

use jiff::Timestamp;
use kube::runtime::events::EventType;

use super::machine::Machine;
use super::step::{Step, condition_reason_is, poll_or_at};
use super::{LEASES_DRAIN_TIMEOUT, REASON_DRAIN_TIMED_OUT};
use crate::controllers::proxy::metrics::DELETED;
use crate::controllers::proxy::status::StatusChange;
use crate::events::event;
use crate::resources::phase::Provisioning;
use crate::resources::pool::{REMOVAL_ANNOTATION, Removal};
use crate::resources::proxy::{ConditionStatus, DisruptionReason, ProxyStatus, REASON_DRAINING};

/// Drains before a deletion or a replacement already admitted: the status says so, and the
/// Event goes out the first time.
pub(super) fn drain(
    machine: &Machine<'_>,
    current: &ProxyStatus,
    leases: u32,
    deadline: Timestamp,
) -> Step {
    let deleting = machine.proxy.metadata.deletion_timestamp.is_some();
    let removal = machine
        .proxy
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(REMOVAL_ANNOTATION))
        .and_then(|value| Removal::parse(value));
    let cause = drain_cause(deleting, removal, current);
    let first = !condition_reason_is(current, REASON_DRAINING);
    let mut step = draining(machine, cause, leases, deadline, deleting);
    if first && deleting {
        step.disruption_started = Some(DELETED);
    }
    step.with_event(first.then(|| {
        event(
            EventType::Normal,
            REASON_DRAINING,
            "Drain",
            format!("draining before {cause}: {}", leases_text(leases)),
        )
    }))
}

/// What a drain comes before: the Proxy's deletion (by its pool, when a pool removes it), or
/// the replacement it is draining for.
fn drain_cause(deleting: bool, removal: Option<Removal>, current: &ProxyStatus) -> &'static str {
    if deleting {
        removal.map_or("the Proxy's deletion", Removal::cause)
    } else {
        current
            .disruption
            .as_ref()
            .map_or("a replacement", |d| cause(d.reason))
    }
}

/// The status of a draining proxy: its machine still serves the leases it has (the address
/// stays) and is deleted when they end or at `deadline`.
pub(super) fn draining(
    machine: &Machine<'_>,
    cause: &str,
    leases: u32,
    deadline: Timestamp,
    deleting: bool,
) -> Step {
    let at = deadline.round(jiff::Unit::Second).unwrap_or(deadline);
    let requeue = poll_or_at(
        machine.ctx.config.deletion_poll,
        Some(deadline),
        machine.now,
    );
    Step::new(
        Some(StatusChange::new(
            if deleting {
                Provisioning::Deleting
            } else {
                Provisioning::Replacing
            },
            ConditionStatus::False,
            REASON_DRAINING,
            format!(
                "draining before {cause}: {}; no new leases or renewals; the machine is \
                 deleted when they end or at {at}",
                leases_text(leases)
            ),
        )),
        requeue,
    )
}

/// Ends the leases a timed-out drain leaves; returns how many.
pub(super) async fn end_drain(machine: &Machine<'_>, timed_out: bool) -> Option<u64> {
    if !timed_out {
        return None;
    }
    machine.ctx.metrics.drain_timed_out();
    Some(machine.end_leases(LEASES_DRAIN_TIMEOUT).await)
}

/// A deletion after a timed-out drain: its Event says so.
pub(super) fn with_drain_timeout(step: Step, ended: Option<u64>, machine: &Machine<'_>) -> Step {
    let Some(ended) = ended else {
        return step;
    };
    let timeout = humantime::format_duration(machine.ctx.config.drain_timeout);
    let message = format!(
        "drain timed out after {timeout}; ended {} and deleted the machine",
        leases_text(u32::try_from(ended).unwrap_or(u32::MAX))
    );
    log::warn!("Proxy {}: {message}", machine.proxy.key());
    step.with_event(Some(event(
        EventType::Warning,
        REASON_DRAIN_TIMED_OUT,
        "Drain",
        message,
    )))
}

/// "1 active lease", "3 active leases".
pub(super) fn leases_text(leases: u32) -> String {
    let noun = if leases == 1 { "lease" } else { "leases" };
    format!("{leases} active {noun}")
}

/// What a voluntary replacement is, for messages ("draining before …").
pub(super) fn cause(reason: DisruptionReason) -> &'static str {
    match reason {
        DisruptionReason::SpecChange => "a replacement for a spec change",
        DisruptionReason::MaxLifetime | DisruptionReason::RotateRequested => "a rotation",
        DisruptionReason::Unhealthy => "a remediation",
    }
}

/// Why a voluntary replacement happens, for messages.
pub(super) fn why(reason: DisruptionReason) -> &'static str {
    match reason {
        DisruptionReason::SpecChange => "spec changed",
        DisruptionReason::MaxLifetime => "machine reached spec.maxLifetime",
        DisruptionReason::RotateRequested => "rotation requested by annotation",
        DisruptionReason::Unhealthy => "machine failed health checks for too long",
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;
    use crate::resources::proxy::Disruption;

    const REASONS: [DisruptionReason; 4] = [
        DisruptionReason::SpecChange,
        DisruptionReason::MaxLifetime,
        DisruptionReason::RotateRequested,
        DisruptionReason::Unhealthy,
    ];

    #[test]
    fn lease_counts_read_in_the_singular_and_plural() {
        assert_eq!(leases_text(0), "0 active leases");
        assert_eq!(leases_text(1), "1 active lease");
        assert_eq!(leases_text(3), "3 active leases");
    }

    #[test]
    fn a_drain_names_what_it_comes_before() {
        use DisruptionReason::{MaxLifetime, RotateRequested, SpecChange, Unhealthy};
        let cases = [
            (true, None, None, "the Proxy's deletion"),
            (true, Some(SpecChange), None, "the Proxy's deletion"),
            (true, None, Some(Removal::ScaleDown), "a pool scale-down"),
            (true, None, Some(Removal::Rollout), "a pool roll-out"),
            (false, None, None, "a replacement"),
            (
                false,
                Some(SpecChange),
                None,
                "a replacement for a spec change",
            ),
            (false, Some(MaxLifetime), None, "a rotation"),
            (false, Some(RotateRequested), None, "a rotation"),
            (false, Some(Unhealthy), None, "a remediation"),
        ];
        for (deleting, reason, removal, want) in cases {
            let status = ProxyStatus {
                disruption: reason.map(|reason| Disruption {
                    reason,
                    since: Timestamp::UNIX_EPOCH,
                    replaced_at: None,
                }),
                ..ProxyStatus::default()
            };
            assert_eq!(
                drain_cause(deleting, removal, &status),
                want,
                "{deleting} {reason:?}"
            );
        }
    }

    #[test]
    fn every_replacement_reason_says_why_in_its_own_words() {
        let whys: HashSet<&str> = REASONS.into_iter().map(why).collect();
        assert_eq!(whys.len(), REASONS.len());
    }
}
