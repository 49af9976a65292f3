//! Health remediation: when a Managed proxy that fails its health checks is replaced, and when
//! it is not.
//!
//! A failing proxy is replaced after a grace time, but not while a large part of its
//! provider's fleet fails at once: then the fault is most likely the network, the probe target
//! or the provider, and replacing machines would only add churn (and lose their IPs).

use std::time::Duration;

use jiff::Timestamp;

use super::time::after;
use crate::controllers::budget::Share;
use crate::resources::proxy::{Mode, Proxy};

/// Health of one provider's Managed proxies that are not being deleted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProviderHealth {
    /// How many have their Healthy condition False.
    pub unhealthy: usize,
    /// How many there are.
    pub managed: usize,
}

/// Counts the Managed proxies of `provider` not being deleted, and the unhealthy ones among
/// them (Healthy condition False; unknown health is not counted as unhealthy).
pub fn provider_health<'a>(
    proxies: impl IntoIterator<Item = &'a Proxy>,
    provider: &str,
) -> ProviderHealth {
    proxies
        .into_iter()
        .filter(|p| {
            p.spec.mode == Mode::Managed
                && p.spec.provider.as_deref() == Some(provider)
                && p.metadata.deletion_timestamp.is_none()
        })
        .fold(ProviderHealth::default(), |mut health, p| {
            health.managed += 1;
            if p.status.as_ref().and_then(|s| s.healthy()) == Some(false) {
                health.unhealthy += 1;
            }
            health
        })
}

/// Whether remediation may replace a machine of the provider.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gate {
    /// Few enough are unhealthy: replace.
    Allowed,
    /// More than the allowed share is unhealthy: replace nothing, `unhealthy` of `managed`.
    Paused {
        /// Unhealthy proxies of the provider.
        unhealthy: usize,
        /// Managed proxies of the provider.
        managed: usize,
    },
}

/// Paused when more than `max_unhealthy` of the provider's proxies are unhealthy.
pub fn gate(health: ProviderHealth, max_unhealthy: Share) -> Gate {
    if max_unhealthy.exceeded_by(health.unhealthy, health.managed) {
        Gate::Paused {
            unhealthy: health.unhealthy,
            managed: health.managed,
        }
    } else {
        Gate::Allowed
    }
}

/// When an unhealthy proxy is due for replacement: `after` past the later of the time it
/// turned unhealthy and its machine's creation (a new machine gets the whole grace time even
/// if the Healthy condition is older), saturating.
pub fn due_at(
    unhealthy_since: Timestamp,
    machine_created: Option<Timestamp>,
    after_duration: Duration,
) -> Timestamp {
    let from = machine_created.map_or(unhealthy_since, |created| created.max(unhealthy_since));
    after(from, after_duration)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::proxy::{CONDITION_HEALTHY, Condition, ConditionStatus, ProxyStatus};

    fn proxy(
        name: &str,
        provider: Option<&str>,
        health: Option<ConditionStatus>,
        deleting: bool,
    ) -> Proxy {
        let mut proxy = match provider {
            Some(provider) => crate::fixtures::managed(name, provider),
            None => crate::fixtures::external(name, "10.0.0.1", 3128),
        };
        if deleting {
            proxy = proxy.deleting();
        }
        let conditions = health
            .map(|status| {
                serde_json::from_value::<Condition>(serde_json::json!({
                    "type": CONDITION_HEALTHY,
                    "status": status,
                    "reason": "Probe",
                    "message": "",
                    "lastTransitionTime": "2026-01-01T00:00:00Z",
                }))
                .unwrap_or_else(|e| panic!("condition: {e}"))
            })
            .into_iter()
            .collect();
        proxy
            .status(ProxyStatus {
                conditions,
                ..ProxyStatus::default()
            })
            .build()
    }

    #[test]
    fn provider_health_counts_that_providers_live_managed_proxies() {
        use ConditionStatus::{False, True, Unknown};
        let fleet = [
            proxy("sick", Some("gcp"), Some(False), false),
            proxy("sick-2", Some("gcp"), Some(False), false),
            proxy("well", Some("gcp"), Some(True), false),
            proxy("unknown", Some("gcp"), Some(Unknown), false),
            proxy("unprobed", Some("gcp"), None, false),
            proxy("sick-deleting", Some("gcp"), Some(False), true),
            proxy("sick-elsewhere", Some("local"), Some(False), false),
            proxy("external", None, Some(False), false),
        ];
        let cases = [("gcp", 2, 5), ("local", 1, 1), ("absent", 0, 0), ("", 0, 0)];
        for (provider, unhealthy, managed) in cases {
            assert_eq!(
                provider_health(&fleet, provider),
                ProviderHealth { unhealthy, managed },
                "{provider}"
            );
        }
    }

    #[test]
    fn gate_pauses_only_above_the_share() {
        let cases = [
            (2, 5, Share::Percent(40), Gate::Allowed),
            (
                3,
                5,
                Share::Percent(40),
                Gate::Paused {
                    unhealthy: 3,
                    managed: 5,
                },
            ),
            (1, 1, Share::Percent(100), Gate::Allowed),
            (
                1,
                1,
                Share::Percent(40),
                Gate::Paused {
                    unhealthy: 1,
                    managed: 1,
                },
            ),
            (0, 0, Share::Percent(40), Gate::Allowed),
            (5, 100, Share::Count(5), Gate::Allowed),
            (
                6,
                100,
                Share::Count(5),
                Gate::Paused {
                    unhealthy: 6,
                    managed: 100,
                },
            ),
            (
                1,
                10,
                Share::Count(0),
                Gate::Paused {
                    unhealthy: 1,
                    managed: 10,
                },
            ),
        ];
        for (unhealthy, managed, share, expected) in cases {
            assert_eq!(
                gate(ProviderHealth { unhealthy, managed }, share),
                expected,
                "{unhealthy}/{managed} against {share}"
            );
        }
    }

    #[test]
    fn due_counts_from_the_later_of_unhealthy_and_machine_creation() {
        let at = |s: &str| -> Timestamp { s.parse().unwrap_or_else(|e| panic!("{s}: {e}")) };
        let ten = Duration::from_secs(600);
        let cases = [
            (
                "2026-01-01T10:00:00Z",
                None,
                ten,
                at("2026-01-01T10:10:00Z"),
            ),
            (
                "2026-01-01T10:00:00Z",
                Some("2026-01-01T09:00:00Z"),
                ten,
                at("2026-01-01T10:10:00Z"),
            ),
            (
                "2026-01-01T10:00:00Z",
                Some("2026-01-01T10:05:00Z"),
                ten,
                at("2026-01-01T10:15:00Z"),
            ),
            (
                "2026-01-01T10:00:00Z",
                None,
                Duration::ZERO,
                at("2026-01-01T10:00:00Z"),
            ),
            ("2026-01-01T10:00:00Z", None, Duration::MAX, Timestamp::MAX),
        ];
        for (since, created, grace, expected) in cases {
            assert_eq!(
                due_at(at(since), created.map(at), grace),
                expected,
                "{since} / {created:?} + {grace:?}"
            );
        }
    }
}
