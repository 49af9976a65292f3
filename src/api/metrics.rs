//! The lease API's counters: leases granted and replayed, refusals by their main reason,
//! reports by result, and writes the ledger could not take.

use prometheus::{IntCounter, IntCounterVec, Opts, Registry};

use crate::ledger::{NoMatch, NoMatchReason, QuotaExceeded, ReportResult};
use crate::serving::tenants::TenantMetrics;

/// Counters the lease API increments.
#[derive(Clone, Debug)]
pub struct LeaseMetrics {
    granted: IntCounter,
    replayed: IntCounter,
    overloaded: IntCounter,
    full: IntCounter,
    unavailable: IntCounter,
    rejections: IntCounterVec,
    reports: IntCounterVec,
    /// The counters per tenant, shared with the gateway.
    pub tenants: TenantMetrics,
}

impl LeaseMetrics {
    /// Creates the counters and registers them in `registry`.
    pub fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let granted = IntCounter::new(
            "proxy_operator_leases_granted_total",
            "Leases granted by the API.",
        )?;
        let replayed = IntCounter::new(
            "proxy_operator_leases_replayed_total",
            "Acquires answered with the lease of an earlier acquire with the same requestID.",
        )?;
        let overloaded = IntCounter::new(
            "proxy_operator_ledger_overloaded_total",
            "Lease API writes answered 503 because the ledger's queue was full or the write \
             waited past its deadline.",
        )?;
        let full = IntCounter::new(
            "proxy_operator_ledger_full_total",
            "Lease API writes answered 503 ledger_full because the ledger's disk or size bound \
             was full.",
        )?;
        let unavailable = IntCounter::new(
            "proxy_operator_ledger_unavailable_total",
            "Lease API writes answered 503 ledger_unavailable because the ledger's database \
             could not be reached.",
        )?;
        let rejections = IntCounterVec::new(
            Opts::new(
                "proxy_operator_lease_rejections_total",
                "Lease requests answered 409, by the main reason nothing was free.",
            ),
            &["reason"],
        )?;
        let reports = IntCounterVec::new(
            Opts::new(
                "proxy_operator_lease_reports_total",
                "Lease reports received, by result.",
            ),
            &["result"],
        )?;
        registry.register(Box::new(granted.clone()))?;
        registry.register(Box::new(replayed.clone()))?;
        registry.register(Box::new(overloaded.clone()))?;
        registry.register(Box::new(full.clone()))?;
        registry.register(Box::new(unavailable.clone()))?;
        registry.register(Box::new(rejections.clone()))?;
        registry.register(Box::new(reports.clone()))?;
        let tenants = TenantMetrics::register(registry)?;
        for result in ReportResult::ALL {
            reports.with_label_values(&[result.as_str()]);
        }
        for reason in NoMatchReason::ALL {
            rejections.with_label_values(&[reason.as_str()]);
        }
        Ok(LeaseMetrics {
            granted,
            replayed,
            overloaded,
            full,
            unavailable,
            rejections,
            reports,
            tenants,
        })
    }

    /// Counts a granted lease.
    pub fn lease_granted(&self) {
        self.granted.inc();
    }

    /// Counts an acquire answered with an earlier acquire's lease.
    pub fn lease_replayed(&self) {
        self.replayed.inc();
    }

    /// Counts a write refused because the ledger was overloaded.
    pub fn write_overloaded(&self) {
        self.overloaded.inc();
    }

    /// Counts a write refused because the ledger was full.
    pub fn write_refused_full(&self) {
        self.full.inc();
    }

    /// Counts a write refused because the ledger's database could not be reached.
    pub fn write_unavailable(&self) {
        self.unavailable.inc();
    }

    /// Counts a refused acquire.
    pub fn lease_rejected(&self, tenant: &str, no_match: &NoMatch) {
        self.rejections
            .with_label_values(&[no_match.reason().as_str()])
            .inc();
        self.tenants.no_match(tenant, no_match);
    }

    /// Counts an acquire refused for its tenant's quota.
    pub fn quota_refused(&self, refused: &QuotaExceeded) {
        self.tenants.quota_refused(refused);
    }

    /// Counts a report.
    pub fn report_received(&self, result: ReportResult) {
        self.reports.with_label_values(&[result.as_str()]).inc();
    }
}
