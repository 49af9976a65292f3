//! Metrics of the fleet's lifecycle: counters of drains (by why the machine goes) and of drains
//! that timed out, and a scrape-time gauge of providers whose remediation is paused.

use std::sync::Arc;

use kube::runtime::reflector::Store;
use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{IntCounter, IntCounterVec, IntGaugeVec, Opts, Registry};

use super::budget::Share;
use super::remediation::{self, Gate};
use crate::proxy::{DisruptionReason, Proxy};

/// Label of drains before a Proxy's deletion (the others are [`DisruptionReason::label`]s).
pub const DELETED: &str = "deleted";

/// Counters the reconciler increments.
#[derive(Clone, Debug)]
pub struct FleetMetrics {
    disruptions: IntCounterVec,
    drain_timeouts: IntCounter,
}

impl FleetMetrics {
    /// Creates the counters and registers them in `registry`.
    pub fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let disruptions = IntCounterVec::new(
            Opts::new(
                "proxy_operator_disruptions_total",
                "Drains started, by why the machine goes: spec_change, max_lifetime, \
                 rotate_requested, unhealthy (remediation) or deleted (the Proxy).",
            ),
            &["reason"],
        )?;
        let drain_timeouts = IntCounter::new(
            "proxy_operator_drain_timeouts_total",
            "Drains that reached --drain-timeout with leases still active (the leases were ended).",
        )?;
        registry.register(Box::new(disruptions.clone()))?;
        registry.register(Box::new(drain_timeouts.clone()))?;
        for reason in DisruptionReason::ALL {
            disruptions.with_label_values(&[reason.label()]);
        }
        disruptions.with_label_values(&[DELETED]);
        Ok(FleetMetrics {
            disruptions,
            drain_timeouts,
        })
    }

    /// Counts a drain that starts, by its label.
    pub fn disruption_started(&self, reason: &str) {
        self.disruptions.with_label_values(&[reason]).inc();
    }

    /// Counts a drain that timed out.
    pub fn drain_timed_out(&self) {
        self.drain_timeouts.inc();
    }
}

/// `proxy_operator_remediation_paused{provider}`, computed at scrape time from the Proxies in
/// the store: 1 while more than `--max-unhealthy` of the provider's Managed proxies are
/// unhealthy (no machine of it is replaced for health), else 0.
pub struct RemediationGauge {
    store: Store<Proxy>,
    providers: Vec<String>,
    max_unhealthy: Share,
    gauge: IntGaugeVec,
}

impl RemediationGauge {
    /// Registers the gauge for `providers` (the providers config's names) in `registry`.
    pub fn register(
        registry: &Registry,
        store: Store<Proxy>,
        providers: Vec<String>,
        max_unhealthy: Share,
    ) -> Result<(), prometheus::Error> {
        let gauge = IntGaugeVec::new(
            Opts::new(
                "proxy_operator_remediation_paused",
                "1 while more than --max-unhealthy of a provider's Managed proxies fail health \
                 checks, so none of them is replaced for it; 0 otherwise.",
            ),
            &["provider"],
        )?;
        registry.register(Box::new(RemediationGauge {
            store,
            providers,
            max_unhealthy,
            gauge,
        }))
    }
}

impl Collector for RemediationGauge {
    fn desc(&self) -> Vec<&Desc> {
        self.gauge.desc()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let fleet: Vec<Arc<Proxy>> = self.store.state();
        for provider in &self.providers {
            let health = remediation::provider_health(fleet.iter().map(AsRef::as_ref), provider);
            let paused = matches!(
                remediation::gate(health, self.max_unhealthy),
                Gate::Paused { .. }
            );
            self.gauge
                .with_label_values(&[provider.as_str()])
                .set(i64::from(paused));
        }
        self.gauge.collect()
    }
}
