//! Counters per tenant, shared by the lease API and the gateway: acquires refused (for a
//! quota, or for want of a proxy in the tenant's scope) and bytes relayed. Tenants come from
//! the tenants file (at most [`MAX_TENANTS`](super::file::MAX_TENANTS)), so the labels stay
//! bounded. The leases and sessions each tenant holds are gauges of the ledger's counts
//! (`metrics`), taken at scrape time.

use prometheus::{IntCounterVec, Opts, Registry};

use crate::ledger::{NoMatch, QuotaExceeded};

/// The per-tenant counters. Cheap to clone; clones count together.
#[derive(Clone, Debug)]
pub struct TenantMetrics {
    refusals: IntCounterVec,
    bytes: IntCounterVec,
}

impl TenantMetrics {
    /// Creates the counters and registers them in `registry`.
    pub fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let refusals = IntCounterVec::new(
            Opts::new(
                "proxy_operator_tenant_refusals_total",
                "Acquires (API and gateway) refused, by tenant and reason: quota_leases, \
                 quota_sessions, quota_acquiresPerSecond, quota_bytesPerDay, or why no proxy \
                 in the tenant's scope was free (no_proxies, capacity, cooldown, ...).",
            ),
            &["tenant", "reason"],
        )?;
        let bytes = IntCounterVec::new(
            Opts::new(
                "proxy_operator_tenant_gateway_bytes_total",
                "Bytes the gateway relayed for each tenant: up (to the target) and down (to \
                 the crawler).",
            ),
            &["tenant", "direction"],
        )?;
        registry.register(Box::new(refusals.clone()))?;
        registry.register(Box::new(bytes.clone()))?;
        Ok(TenantMetrics { refusals, bytes })
    }

    /// Counts an acquire refused for a quota.
    pub fn quota_refused(&self, refused: &QuotaExceeded) {
        let reason = format!("quota_{}", refused.quota.as_str());
        self.refusals
            .with_label_values(&[&*refused.tenant, &reason])
            .inc();
    }

    /// Counts an acquire of `tenant` refused because nothing in its scope was free.
    pub fn no_match(&self, tenant: &str, no_match: &NoMatch) {
        self.refusals
            .with_label_values(&[tenant, no_match.reason().as_str()])
            .inc();
    }

    /// Counts bytes the gateway relayed for `tenant`.
    pub fn relayed(&self, tenant: &str, up: u64, down: u64) {
        self.bytes.with_label_values(&[tenant, "up"]).inc_by(up);
        self.bytes.with_label_values(&[tenant, "down"]).inc_by(down);
    }
}
