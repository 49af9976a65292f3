//! The autoscaler's rule, pure: how many members a pool with `spec.autoscaling` should have.
//!
//! desired = ceil((active leases + unmet demand) ÷ (maxLeases × targetUtilization)), clamped to
//! `[minReplicas, maxReplicas]`. Unmet demand is the requests refused in the last minute that a
//! member would have served, as the ledger recorded them on every replica. Up is at once; down
//! is one member at a time, each after `scaleDownAfter` with demand below what the members
//! serve at target.

use std::time::Duration;

use jiff::Timestamp;

/// Why the autoscaler chose a count (also `status.desiredReason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ScaleReason {
    /// Demand needs more members: scaled up.
    ScaleUp,
    /// Demand stayed below target for `scaleDownAfter`: one member less.
    ScaleDown,
    /// Demand is below target, not yet for `scaleDownAfter`.
    BelowTarget,
    /// The members serve demand at target.
    AtTarget,
    /// Demand needs more than `maxReplicas`.
    AtMax,
    /// Demand needs fewer than `minReplicas`.
    AtMin,
    /// `spec.replicas` was outside `[minReplicas, maxReplicas]` (a manual scale): clamped.
    OutOfRange,
}

impl ScaleReason {
    /// The reason as written in status, Events and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            ScaleReason::ScaleUp => "ScaleUp",
            ScaleReason::ScaleDown => "ScaleDown",
            ScaleReason::BelowTarget => "BelowTarget",
            ScaleReason::AtTarget => "AtTarget",
            ScaleReason::AtMax => "AtMax",
            ScaleReason::AtMin => "AtMin",
            ScaleReason::OutOfRange => "OutOfRange",
        }
    }
}

/// What the autoscaler reads.
#[derive(Debug, Clone, PartialEq)]
pub struct ScaleInputs {
    /// `spec.replicas` now.
    pub replicas: u32,
    /// The last decision (`status.desiredReplicas`). A `spec.replicas` that differs was set by
    /// someone else (`kubectl scale`, an HPA): the rule starts from the decision instead, and
    /// the write overrules it.
    pub decided: Option<u32>,
    /// `minReplicas`.
    pub min: u32,
    /// `maxReplicas`.
    pub max: u32,
    /// `targetUtilization`, above 0 and at most 1.
    pub target: f64,
    /// The template's `maxLeases`.
    pub max_leases: u32,
    /// Active leases on the pool's members.
    pub active: u64,
    /// Requests refused in the last minute that a member would have served.
    pub unmet: u64,
    /// `status.belowTargetSince`.
    pub below_target_since: Option<Timestamp>,
    /// `scaleDownAfter`.
    pub scale_down_after: Duration,
    /// Now.
    pub now: Timestamp,
}

/// What the autoscaler decides.
#[derive(Debug, Clone, PartialEq)]
pub struct ScaleDecision {
    /// The `spec.replicas` to have.
    pub replicas: u32,
    /// What demand alone asks for, before clamping.
    pub wanted: u32,
    /// Why.
    pub reason: ScaleReason,
    /// The new `status.belowTargetSince`.
    pub below_target_since: Option<Timestamp>,
    /// `AtMax` or `AtMin` when demand is outside the range (for `ScalingLimited`).
    pub limit: Option<ScaleReason>,
    /// Whether `spec.replicas` had been set by someone else and is overruled.
    pub overruled: bool,
}

/// Applies the rule (see the module doc).
pub fn autoscale(inputs: &ScaleInputs) -> ScaleDecision {
    let per_member = f64::from(inputs.max_leases.max(1)) * inputs.target.clamp(0.01, 1.0);
    let demand = inputs.active.saturating_add(inputs.unmet) as f64;
    let wanted = (demand / per_member).ceil().min(f64::from(u32::MAX)) as u32;
    let (min, max) = (inputs.min, inputs.max.max(inputs.min));
    let clamped = wanted.clamp(min, max);
    let limit = if wanted > max {
        Some(ScaleReason::AtMax)
    } else if wanted < min {
        Some(ScaleReason::AtMin)
    } else {
        None
    };
    let overruled = inputs.decided.is_some_and(|d| d != inputs.replicas);
    let decide = |replicas, reason, below_target_since| ScaleDecision {
        replicas,
        wanted,
        reason,
        below_target_since,
        limit,
        overruled,
    };
    let current = inputs.decided.unwrap_or(inputs.replicas);
    if !(min..=max).contains(&current) {
        return decide(current.clamp(min, max), ScaleReason::OutOfRange, None);
    }
    if clamped > current {
        let reason = if limit == Some(ScaleReason::AtMax) {
            ScaleReason::AtMax
        } else {
            ScaleReason::ScaleUp
        };
        return decide(clamped, reason, None);
    }
    if clamped == current {
        let reason = limit.unwrap_or(ScaleReason::AtTarget);
        return decide(current, reason, None);
    }
    let since = inputs.below_target_since.unwrap_or(inputs.now);
    let below_for = inputs.now.duration_since(since);
    if below_for >= jiff::SignedDuration::try_from(inputs.scale_down_after).unwrap_or_default() {
        // One member now; the clock starts again for the next one.
        decide(current - 1, ScaleReason::ScaleDown, Some(inputs.now))
    } else {
        decide(current, ScaleReason::BelowTarget, Some(since))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(second: i64) -> Timestamp {
        Timestamp::from_second(second).unwrap()
    }

    fn inputs(replicas: u32, active: u64, unmet: u64, since: Option<i64>, now: i64) -> ScaleInputs {
        ScaleInputs {
            replicas,
            decided: None,
            min: 0,
            max: 4,
            target: 0.7,
            max_leases: 5,
            active,
            unmet,
            below_target_since: since.map(at),
            scale_down_after: Duration::from_secs(60),
            now: at(now),
        }
    }

    #[test]
    fn the_rule_table() {
        use ScaleReason::*;
        // (replicas, active, unmet, belowTargetSince, now) -> (replicas, reason, since, limit)
        type Case = (
            (u32, u64, u64, Option<i64>, i64),
            (u32, ScaleReason, Option<i64>, Option<ScaleReason>),
        );
        let cases: [Case; 11] = [
            // 3.5 leases per member at 0.7 of 5.
            ((1, 3, 0, None, 100), (1, AtTarget, None, None)),
            ((1, 4, 0, None, 100), (2, ScaleUp, None, None)),
            // Waking: a pool at 0 with one refused request gets a member at once.
            ((0, 0, 1, None, 100), (1, ScaleUp, None, None)),
            ((0, 0, 0, None, 100), (0, AtTarget, None, None)),
            // Up is at once and all the way, clamped at max.
            ((1, 20, 5, None, 100), (4, AtMax, None, Some(AtMax))),
            ((4, 20, 5, None, 100), (4, AtMax, None, Some(AtMax))),
            // Down: the clock starts, then one member per scaleDownAfter.
            ((3, 0, 0, None, 100), (3, BelowTarget, Some(100), None)),
            ((3, 0, 0, Some(100), 159), (3, BelowTarget, Some(100), None)),
            ((3, 0, 0, Some(100), 160), (2, ScaleDown, Some(160), None)),
            // Demand back at target stops the clock.
            ((3, 8, 0, Some(100), 150), (3, AtTarget, None, None)),
            // A manual scale beyond max is clamped.
            ((9, 0, 0, None, 100), (4, OutOfRange, None, None)),
        ];
        for ((replicas, active, unmet, since, now), (want, reason, want_since, limit)) in cases {
            let decision = autoscale(&inputs(replicas, active, unmet, since, now));
            assert_eq!(
                (
                    decision.replicas,
                    decision.reason,
                    decision.below_target_since,
                    decision.limit
                ),
                (want, reason, want_since.map(at), limit),
                "replicas {replicas}, active {active}, unmet {unmet}, since {since:?}, now {now}"
            );
        }
    }

    #[test]
    fn a_manual_scale_is_overruled_from_the_last_decision() {
        // Someone scaled 2 to 4; demand wants 2: back to 2 at once, not one member a time.
        let mut manual = inputs(4, 7, 0, None, 100);
        manual.decided = Some(2);
        let decision = autoscale(&manual);
        assert_eq!(
            (decision.replicas, decision.reason, decision.overruled),
            (2, ScaleReason::AtTarget, true)
        );
        // Our own last write, seen back: nothing is overruled.
        let mut ours = inputs(2, 7, 0, None, 100);
        ours.decided = Some(2);
        assert!(!autoscale(&ours).overruled);
        // A manual scale below what demand needs: up again at once.
        let mut low = inputs(1, 7, 0, None, 100);
        low.decided = Some(2);
        assert_eq!(autoscale(&low).replicas, 2);
    }

    #[test]
    fn a_minimum_holds_and_says_so() {
        let mut at_min = inputs(2, 0, 0, Some(0), 1_000);
        at_min.min = 2;
        let decision = autoscale(&at_min);
        assert_eq!(
            (decision.replicas, decision.reason, decision.limit),
            (2, ScaleReason::AtMin, Some(ScaleReason::AtMin))
        );
        assert_eq!(decision.below_target_since, None);
    }
}
