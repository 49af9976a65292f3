//! Metrics of the reconciler: how long reconciles take, which actions they decide and which
//! errors they meet (the three figures an SRE graphs first); counters of drains (by why the
//! machine goes) and of drains that timed out; and a scrape-time gauge of providers whose
//! remediation is paused.

use std::sync::Arc;

use kube::runtime::reflector::Store;
use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{
    Histogram, HistogramOpts, HistogramTimer, IntCounter, IntCounterVec, IntGaugeVec, Opts,
    Registry,
};

use super::decide::Action;
use super::error::Error;
use super::remediation::{self, Gate};
use crate::controllers::budget::Share;
use crate::resources::proxy::{DisruptionReason, Proxy};

/// Label of drains before a Proxy's deletion (the others are [`DisruptionReason::label`]s).
pub const DELETED: &str = "deleted";

/// Buckets of `proxy_operator_reconcile_duration_seconds`: a reconcile is one or two API round
/// trips plus, sometimes, a provider call (a cloud API answers in hundreds of milliseconds).
const RECONCILE_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// Counters and the histogram the reconciler updates.
#[derive(Clone, Debug)]
pub struct ReconcilerMetrics {
    reconcile_duration: Histogram,
    reconcile_errors: IntCounterVec,
    actions: IntCounterVec,
    disruptions: IntCounterVec,
    drain_timeouts: IntCounter,
}

impl ReconcilerMetrics {
    /// Creates the metrics and registers them in `registry`. Every label value is known up
    /// front (error kinds, actions, drain reasons), so each series exists from the start.
    pub fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let reconcile_duration = Histogram::with_opts(
            HistogramOpts::new(
                "proxy_operator_reconcile_duration_seconds",
                "Time one reconcile of a Proxy took, its API and provider calls included.",
            )
            .buckets(RECONCILE_BUCKETS.to_vec()),
        )?;
        let reconcile_errors = IntCounterVec::new(
            Opts::new(
                "proxy_operator_reconcile_errors_total",
                "Reconciles that failed and were retried with backoff, by kind: kube (a \
                 Kubernetes API call), provider (a transient provider failure), missing_field.",
            ),
            &["kind"],
        )?;
        let actions = IntCounterVec::new(
            Opts::new(
                "proxy_operator_reconcile_actions_total",
                "Reconciles by the action decided (create, running, replace, drain, ...).",
            ),
            &["action"],
        )?;
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
        registry.register(Box::new(reconcile_duration.clone()))?;
        registry.register(Box::new(reconcile_errors.clone()))?;
        registry.register(Box::new(actions.clone()))?;
        registry.register(Box::new(disruptions.clone()))?;
        registry.register(Box::new(drain_timeouts.clone()))?;
        for kind in Error::KINDS {
            reconcile_errors.with_label_values(&[kind]);
        }
        for action in Action::LABELS {
            actions.with_label_values(&[action]);
        }
        for reason in DisruptionReason::ALL {
            disruptions.with_label_values(&[reason.label()]);
        }
        disruptions.with_label_values(&[DELETED]);
        Ok(ReconcilerMetrics {
            reconcile_duration,
            reconcile_errors,
            actions,
            disruptions,
            drain_timeouts,
        })
    }

    /// Times one reconcile: observed when the timer is dropped, however the reconcile ends.
    pub fn reconcile_timer(&self) -> HistogramTimer {
        self.reconcile_duration.start_timer()
    }

    /// Counts a failed reconcile by its error kind ([`Error::metric_label`]).
    pub fn reconcile_failed(&self, kind: &str) {
        self.reconcile_errors.with_label_values(&[kind]).inc();
    }

    /// Counts a decided action by its label ([`Action::label`]).
    pub fn action_decided(&self, action: &str) {
        self.actions.with_label_values(&[action]).inc();
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
