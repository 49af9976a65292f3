//! The gateway's figures, with bounded labels only (never a crawler's name, a target or a
//! session): requests by kind and outcome, bytes relayed, upstream retries, bans seen, and the
//! sessions held, read at scrape time.

use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{
    HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts, Registry,
};

use super::RequestOutcome;
use crate::ledger::ReportResult;
use crate::serving::sessions::Sessions;
use crate::serving::tenants::TenantMetrics;

/// Counters the gateway increments.
#[derive(Clone, Debug)]
pub struct GatewayMetrics {
    connections: IntCounter,
    requests: IntCounterVec,
    bytes: IntCounterVec,
    retries: IntCounter,
    bans: IntCounterVec,
    held: HistogramVec,
    /// The counters per tenant, shared with the lease API.
    pub tenants: TenantMetrics,
}

/// Label value of a hold that ended with a member to relay through.
pub const HOLD_RELAYED: &str = "relayed";
/// Label value of a hold that reached its wake timeout without a member.
pub const HOLD_TIMED_OUT: &str = "timed_out";

impl GatewayMetrics {
    /// Creates the metrics, registers them in `registry` with the gauge of `sessions`.
    pub fn register(
        registry: &Registry,
        sessions: Sessions,
        tenants: TenantMetrics,
    ) -> Result<Self, prometheus::Error> {
        let connections = IntCounter::new(
            "proxy_operator_gateway_connections_total",
            "Client connections the gateway accepted.",
        )?;
        let requests = IntCounterVec::new(
            Opts::new(
                "proxy_operator_gateway_requests_total",
                "Gateway requests by kind (connect, http) and outcome: tunneled, forwarded, \
                 auth_required (407), bad_request (400), port_refused (403), no_proxy (503), \
                 unavailable (503: the ledger could not take the lease), upstream_failed (502).",
            ),
            &["kind", "outcome"],
        )?;
        let bytes = IntCounterVec::new(
            Opts::new(
                "proxy_operator_gateway_bytes_total",
                "Bytes relayed between crawlers and upstream proxies: up (to the target) and \
                 down (to the crawler).",
            ),
            &["direction"],
        )?;
        let retries = IntCounter::new(
            "proxy_operator_gateway_upstream_retries_total",
            "Requests tried again on another proxy after an upstream failed before anything \
             reached the crawler.",
        )?;
        let bans = IntCounterVec::new(
            Opts::new(
                "proxy_operator_gateway_bans_total",
                "Target answers the gateway reported as bans, by result (see \
                 --gateway-ban-statuses).",
            ),
            &["result"],
        )?;
        let held = HistogramVec::new(
            HistogramOpts::new(
                "proxy_operator_gateway_held_seconds",
                "Gateway requests held while a pool woke, by how the hold ended (relayed, \
                 timed_out), and how long they waited.",
            )
            .buckets(vec![
                0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0,
            ]),
            &["outcome"],
        )?;
        for outcome in [HOLD_RELAYED, HOLD_TIMED_OUT] {
            held.with_label_values(&[outcome]);
        }
        for metric in [
            Box::new(held.clone()) as Box<dyn Collector>,
            Box::new(connections.clone()),
            Box::new(requests.clone()),
            Box::new(bytes.clone()),
            Box::new(retries.clone()),
            Box::new(bans.clone()),
            Box::new(SessionGauge::new(sessions)?),
        ] {
            registry.register(metric)?;
        }
        for kind in ["connect", "http"] {
            for outcome in RequestOutcome::ALL {
                requests.with_label_values(&[kind, outcome.as_str()]);
            }
        }
        for direction in ["up", "down"] {
            bytes.with_label_values(&[direction]);
        }
        for result in [ReportResult::RateLimited, ReportResult::Blocked] {
            bans.with_label_values(&[result.as_str()]);
        }
        Ok(GatewayMetrics {
            connections,
            requests,
            bytes,
            retries,
            bans,
            held,
            tenants,
        })
    }

    /// Records a request held while a pool woke: how it ended and how long it waited.
    pub fn held(&self, outcome: &str, waited: std::time::Duration) {
        self.held
            .with_label_values(&[outcome])
            .observe(waited.as_secs_f64());
    }

    /// Counts an accepted connection.
    pub fn connection(&self) {
        self.connections.inc();
    }

    /// Counts a request of `kind` (`connect`, `http`) that ended with `outcome`.
    pub fn request(&self, kind: &str, outcome: RequestOutcome) {
        self.requests
            .with_label_values(&[kind, outcome.as_str()])
            .inc();
    }

    /// Counts bytes relayed for `tenant`.
    pub fn relayed(&self, tenant: &str, up: u64, down: u64) {
        self.bytes.with_label_values(&["up"]).inc_by(up);
        self.bytes.with_label_values(&["down"]).inc_by(down);
        self.tenants.relayed(tenant, up, down);
    }

    /// Counts a try on another proxy.
    pub fn retried(&self) {
        self.retries.inc();
    }

    /// Counts a ban reported.
    pub fn banned(&self, result: ReportResult) {
        self.bans.with_label_values(&[result.as_str()]).inc();
    }
}

/// `proxy_operator_gateway_sessions_active`, read from the session table at scrape time.
struct SessionGauge {
    sessions: Sessions,
    gauge: IntGauge,
}

impl SessionGauge {
    fn new(sessions: Sessions) -> Result<Self, prometheus::Error> {
        Ok(SessionGauge {
            sessions,
            gauge: IntGauge::new(
                "proxy_operator_gateway_sessions_active",
                "Sticky sessions the gateway holds a lease for.",
            )?,
        })
    }
}

impl Collector for SessionGauge {
    fn desc(&self) -> Vec<&Desc> {
        self.gauge.desc()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        self.gauge
            .set(i64::try_from(self.sessions.len()).unwrap_or(i64::MAX));
        self.gauge.collect()
    }
}
