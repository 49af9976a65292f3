//! The phase shown in `status.phase`, derived from provisioning and health only, so that no
//! code path sets a phase by hand and two paths can never disagree.

use crate::resources::proxy::{Mode, Phase, Proxy};

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

/// The phase a proxy shows: its status phase once the reconciler wrote one, otherwise (in
/// standalone mode, or before the first reconcile) [`compute_phase`] of it as it stands: an
/// External endpoint is provisioned, a Managed proxy has no machine yet; `healthy` is the
/// health engine's verdict.
pub fn shown_phase(proxy: &Proxy, healthy: Option<bool>) -> Phase {
    if let Some(phase) = proxy.status.as_ref().and_then(|s| s.phase) {
        return phase;
    }
    let provisioning = match proxy.spec.mode {
        Mode::External => Provisioning::Done,
        Mode::Managed => Provisioning::Waiting,
    };
    compute_phase(provisioning, healthy)
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

    #[test]
    fn a_proxy_without_a_status_shows_the_phase_compute_phase_gives() {
        use crate::fixtures;
        let external = fixtures::external("e", "10.0.0.1", 3128).build();
        let managed = fixtures::managed("m", "local").build();
        let cases = [
            (&external, None, Phase::Provisioning),
            (&external, Some(true), Phase::Ready),
            (&external, Some(false), Phase::Unhealthy),
            (&managed, None, Phase::Pending),
            (&managed, Some(true), Phase::Pending),
        ];
        for (proxy, healthy, expected) in cases {
            assert_eq!(
                shown_phase(proxy, healthy),
                expected,
                "{proxy:?} {healthy:?}"
            );
        }
        let written = fixtures::managed("w", "local")
            .status(crate::resources::proxy::ProxyStatus {
                phase: Some(Phase::Replacing),
                ..Default::default()
            })
            .build();
        assert_eq!(shown_phase(&written, Some(true)), Phase::Replacing);
    }
}
