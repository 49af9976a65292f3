//! A pool's status, built in one place from what one reconcile saw and decided (pure), and the
//! merge patch that writes it.

use jiff::Timestamp;
use serde_json::{Value, json};

use super::autoscale::{ScaleDecision, ScaleReason};
use super::members::Member;
use super::plan::Plan;
use crate::resources::pool::{
    CONDITION_AVAILABLE, CONDITION_PROGRESSING, CONDITION_SCALING_LIMITED, ProxyPoolStatus,
};
use crate::resources::proxy::{Condition, ConditionStatus, set_condition};

/// `ScalingLimited` reason: the provider refused a member's machine for quota.
pub const REASON_PROVIDER_QUOTA: &str = "ProviderQuota";
/// `ScalingLimited` reason: the replacement budget has no free slot for a removal.
pub const REASON_BUDGET: &str = "Budget";
/// `desiredReason` of a pool without autoscaling: `spec.replicas` as set.
pub const REASON_MANUAL: &str = "Manual";

/// What the status is built from.
#[derive(Debug, Clone)]
pub struct StatusInputs<'a> {
    /// The status as read.
    pub current: &'a ProxyPoolStatus,
    /// Every member that exists.
    pub members: &'a [Member],
    /// `spec.replicas` as it will be after this reconcile.
    pub desired: u32,
    /// `maxUnavailable` resolved for `desired`.
    pub unavailable: u32,
    /// This reconcile's plan.
    pub plan: &'a Plan,
    /// The autoscaler's decision, for an autoscaled pool.
    pub scale: Option<&'a ScaleDecision>,
    /// Whether this reconcile changed `spec.replicas`.
    pub scaled: bool,
    /// The members' label selector.
    pub selector: String,
    /// The pool's generation.
    pub generation: Option<i64>,
    /// Now.
    pub now: Timestamp,
}

/// The whole status after one reconcile.
pub fn pool_status(inputs: &StatusInputs<'_>) -> ProxyPoolStatus {
    let live: Vec<&Member> = inputs.members.iter().filter(|m| !m.deleting).collect();
    let ready: Vec<&&Member> = live.iter().filter(|m| m.ready).collect();
    let replicas = count(live.len());
    let ready_replicas = count(ready.len());
    let updated = count(live.iter().filter(|m| m.current).count());
    let capacity: u64 = ready.iter().map(|m| u64::from(m.capacity)).sum();
    let active: u64 = live.iter().map(|m| u64::from(m.leases)).sum();
    let utilization = (capacity > 0).then(|| round(active as f64 / capacity as f64));
    let mut status = ProxyPoolStatus {
        replicas,
        ready_replicas,
        updated_replicas: updated,
        selector: inputs.selector.clone(),
        utilization,
        desired_replicas: Some(i32::try_from(inputs.desired).unwrap_or(i32::MAX)),
        desired_reason: Some(
            inputs
                .scale
                .map_or(REASON_MANUAL, |s| s.reason.as_str())
                .to_owned(),
        ),
        last_scale_time: if inputs.scaled {
            Some(inputs.now)
        } else {
            inputs.current.last_scale_time
        },
        below_target_since: inputs.scale.and_then(|s| s.below_target_since),
        conditions: inputs.current.conditions.clone(),
        observed_generation: inputs.generation,
    };
    let condition = |type_: &str, holds: bool, reason: &str, message: String| Condition {
        type_: type_.to_owned(),
        status: if holds {
            ConditionStatus::True
        } else {
            ConditionStatus::False
        },
        reason: reason.to_owned(),
        message,
        last_transition_time: inputs.now,
        observed_generation: inputs.generation,
    };

    let desired = count(inputs.desired as usize);
    let needed = count(inputs.desired.saturating_sub(inputs.unavailable) as usize);
    let available = ready_replicas >= needed;
    set_condition(
        &mut status.conditions,
        condition(
            CONDITION_AVAILABLE,
            available,
            if available {
                "MinimumReplicasAvailable"
            } else {
                "MinimumReplicasUnavailable"
            },
            format!(
                "{ready_replicas} of {} members Ready (at least {needed} needed)",
                inputs.desired
            ),
        ),
    );

    let draining = inputs.members.iter().filter(|m| m.deleting).count();
    let (progressing, reason, message) = if updated < desired && updated < replicas {
        (
            true,
            "RollingOut",
            format!("{updated} of {replicas} members on the current template"),
        )
    } else if replicas < desired {
        (
            true,
            "ScalingUp",
            format!("{replicas} of {} members exist", inputs.desired),
        )
    } else if replicas > desired || draining > 0 {
        (
            true,
            "ScalingDown",
            format!("{draining} members draining before they go"),
        )
    } else if ready_replicas < desired {
        (
            true,
            "WaitingForReady",
            format!("{ready_replicas} of {} members Ready", inputs.desired),
        )
    } else {
        (
            true,
            "Complete",
            format!("{replicas} members, all Ready and current"),
        )
    };
    let reason = if inputs.plan.held_by_budget {
        REASON_BUDGET
    } else {
        reason
    };
    set_condition(
        &mut status.conditions,
        condition(CONDITION_PROGRESSING, progressing, reason, message),
    );

    let quota = inputs.members.iter().filter(|m| m.quota_refused).count();
    let limited = if quota > 0 {
        Some((
            REASON_PROVIDER_QUOTA,
            format!("the provider refused {quota} member machines for quota; retried in minutes"),
        ))
    } else if inputs.plan.held_by_budget {
        Some((
            REASON_BUDGET,
            "the fleet's replacement budget has no free slot for a removal".to_owned(),
        ))
    } else {
        inputs.scale.and_then(|s| match s.limit {
            Some(ScaleReason::AtMax) => Some((
                ScaleReason::AtMax.as_str(),
                format!(
                    "demand asks for {} members; maxReplicas is the limit",
                    s.wanted
                ),
            )),
            Some(ScaleReason::AtMin) => Some((
                ScaleReason::AtMin.as_str(),
                format!(
                    "demand asks for {} members; minReplicas is the floor",
                    s.wanted
                ),
            )),
            _ => None,
        })
    };
    let (holds, reason, message) = match limited {
        Some((reason, message)) => (true, reason, message),
        None => (
            false,
            "WithinLimits",
            "the pool has the members it asks for".to_owned(),
        ),
    };
    set_condition(
        &mut status.conditions,
        condition(CONDITION_SCALING_LIMITED, holds, reason, message),
    );
    status
}

/// The JSON merge patch writing `status` whole: every field spelled out, so one left out is
/// cleared instead of kept.
pub fn status_patch(status: &ProxyPoolStatus) -> Value {
    json!({
        "status": {
            "replicas": status.replicas,
            "readyReplicas": status.ready_replicas,
            "updatedReplicas": status.updated_replicas,
            "selector": status.selector,
            "utilization": status.utilization,
            "desiredReplicas": status.desired_replicas,
            "desiredReason": status.desired_reason,
            "lastScaleTime": status.last_scale_time,
            "belowTargetSince": status.below_target_since,
            "conditions": status.conditions,
            "observedGeneration": status.observed_generation,
        }
    })
}

fn count(n: usize) -> i32 {
    i32::try_from(n).unwrap_or(i32::MAX)
}

/// Two decimals: the status changes when utilisation does, not on every lease.
fn round(value: f64) -> f64 {
    (value * 100.0).round() / 100.0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(name: &str, ready: bool, leases: u32, deleting: bool) -> Member {
        Member {
            name: name.to_owned(),
            current: true,
            index: None,
            ready,
            leases,
            capacity: 5,
            created: Timestamp::UNIX_EPOCH,
            deleting,
            quota_refused: false,
        }
    }

    fn build(
        members: &[Member],
        desired: u32,
        plan: &Plan,
        scale: Option<&ScaleDecision>,
    ) -> ProxyPoolStatus {
        pool_status(&StatusInputs {
            current: &ProxyPoolStatus::default(),
            members,
            desired,
            unavailable: 0,
            plan,
            scale,
            scaled: false,
            selector: "crawl.example.com/pool=eu".into(),
            generation: Some(3),
            now: Timestamp::UNIX_EPOCH,
        })
    }

    fn reason(status: &ProxyPoolStatus, type_: &str) -> (ConditionStatus, String) {
        let c = status.condition(type_).expect(type_);
        (c.status, c.reason.clone())
    }

    #[test]
    fn counts_utilisation_and_conditions() {
        let members = [
            member("a", true, 4, false),
            member("b", true, 1, false),
            member("c", false, 0, false),
            member("d", true, 2, true),
        ];
        let status = build(&members, 3, &Plan::default(), None);
        assert_eq!(
            (
                status.replicas,
                status.ready_replicas,
                status.updated_replicas
            ),
            (3, 2, 3)
        );
        assert_eq!(status.utilization, Some(0.5), "5 leases over 2 Ready × 5");
        assert_eq!(status.selector, "crawl.example.com/pool=eu");
        assert_eq!(status.desired_reason.as_deref(), Some(REASON_MANUAL));
        assert_eq!(status.observed_generation, Some(3));
        assert_eq!(
            reason(&status, CONDITION_AVAILABLE),
            (ConditionStatus::False, "MinimumReplicasUnavailable".into())
        );
        assert_eq!(
            reason(&status, CONDITION_PROGRESSING),
            (ConditionStatus::True, "ScalingDown".into())
        );
        assert_eq!(
            reason(&status, CONDITION_SCALING_LIMITED),
            (ConditionStatus::False, "WithinLimits".into())
        );
        let empty = build(&[], 0, &Plan::default(), None);
        assert_eq!(empty.utilization, None);
        assert_eq!(reason(&empty, CONDITION_AVAILABLE).0, ConditionStatus::True);
        assert_eq!(reason(&empty, CONDITION_PROGRESSING).1, "Complete");
    }

    #[test]
    fn scaling_limited_names_quota_then_budget_then_the_range() {
        let at_max = ScaleDecision {
            replicas: 4,
            wanted: 9,
            reason: ScaleReason::AtMax,
            below_target_since: None,
            limit: Some(ScaleReason::AtMax),
            overruled: false,
        };
        let members = [member("a", true, 5, false)];
        let status = build(&members, 4, &Plan::default(), Some(&at_max));
        assert_eq!(
            reason(&status, CONDITION_SCALING_LIMITED),
            (ConditionStatus::True, "AtMax".into())
        );
        assert_eq!(status.desired_reason.as_deref(), Some("AtMax"));
        let held = Plan {
            held_by_budget: true,
            ..Plan::default()
        };
        let status = build(&members, 4, &held, Some(&at_max));
        assert_eq!(reason(&status, CONDITION_SCALING_LIMITED).1, REASON_BUDGET);
        assert_eq!(reason(&status, CONDITION_PROGRESSING).1, REASON_BUDGET);
        let mut refused = member("b", false, 0, false);
        refused.quota_refused = true;
        let status = build(&[members[0].clone(), refused], 4, &held, Some(&at_max));
        assert_eq!(
            reason(&status, CONDITION_SCALING_LIMITED).1,
            REASON_PROVIDER_QUOTA
        );
    }
}
