//! The phase shown in `status.phase`, derived from provisioning and health only, so that no
//! code path sets a phase by hand and two paths can never disagree.

use crate::proxy::Phase;

/// Where the machine behind a proxy is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Provisioning {
    /// Nothing created yet (waiting for a finalizer, quota or cloud-init).
    Waiting,
    /// Created, not yet running with an address.
    InProgress,
    /// Running with an address (or an External endpoint).
    Done,
    /// Being deleted to make way for a new machine.
    Replacing,
    /// Being deleted because the Proxy is.
    Deleting,
    /// The provider refused permanently.
    Failed,
}

/// The phase for a provisioning state and the Healthy condition (`None` = not probed yet).
pub fn compute_phase(provisioning: Provisioning, healthy: Option<bool>) -> Phase {
    match (provisioning, healthy) {
        (Provisioning::Waiting, _) => Phase::Pending,
        (Provisioning::InProgress, _) => Phase::Provisioning,
        (Provisioning::Replacing, _) => Phase::Replacing,
        (Provisioning::Deleting, _) => Phase::Deleting,
        (Provisioning::Failed, _) => Phase::Failed,
        (Provisioning::Done, Some(true)) => Phase::Ready,
        (Provisioning::Done, Some(false)) => Phase::Unhealthy,
        // Running but not probed yet: not reachable as far as anyone knows.
        (Provisioning::Done, None) => Phase::Provisioning,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truth_table() {
        use Provisioning::*;
        let cases = [
            (Waiting, None, Phase::Pending),
            (Waiting, Some(true), Phase::Pending),
            (InProgress, None, Phase::Provisioning),
            (InProgress, Some(true), Phase::Provisioning),
            (Done, None, Phase::Provisioning),
            (Done, Some(true), Phase::Ready),
            (Done, Some(false), Phase::Unhealthy),
            (Replacing, Some(true), Phase::Replacing),
            (Replacing, None, Phase::Replacing),
            (Deleting, Some(true), Phase::Deleting),
            (Deleting, Some(false), Phase::Deleting),
            (Failed, None, Phase::Failed),
            (Failed, Some(true), Phase::Failed),
        ];
        for (provisioning, healthy, expected) in cases {
            assert_eq!(
                compute_phase(provisioning, healthy),
                expected,
                "{provisioning:?} {healthy:?}"
            );
        }
    }
}
