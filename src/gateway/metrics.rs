//! The gateway's figures, with bounded labels only (never a crawler's name, a target or a
//! session): requests by kind and outcome, bytes relayed, upstream retries, bans seen, and the
//! sessions held, read at scrape time.

use std::sync::Arc;

use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{
    HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts, Registry,
};

use super::RequestOutcome;
use super::limits::{PROCESS_LIMIT, TENANT_LIMIT};
use super::timeouts::Expired;
use crate::egress::{Kind, UNRESOLVABLE};
use crate::ledger::ReportResult;
use crate::serving::sessions::Sessions;
use crate::serving::tenants::TenantMetrics;
use crate::serving::traffic::Traffic;

/// Counters the gateway increments.
#[derive(Clone, Debug)]
pub struct GatewayMetrics {
    connections: IntCounter,
    rule_matches: IntCounterVec,
    fallback_steps: IntCounterVec,
    intercepted: IntCounter,
    handshake_failures: IntCounterVec,
    certificates: IntCounterVec,
    open: IntGauge,
    refused_connections: IntCounterVec,
    closed_connections: IntCounterVec,
    refused_destinations: IntCounterVec,
    requests: IntCounterVec,
    /// `bytes_total{direction="up"}` and `{direction="down"}`, resolved once: every answer
    /// counts both.
    bytes_up: IntCounter,
    bytes_down: IntCounter,
    retries: IntCounter,
    bans: IntCounterVec,
    held: HistogramVec,
    /// The counters per tenant, shared with the lease API.
    pub tenants: TenantMetrics,
    /// Bytes per proxy, shared with the fleet's scrape-time series.
    traffic: Traffic,
}

/// Label value of a hold that ended with a member to relay through.
pub const HOLD_RELAYED: &str = "relayed";
/// Label value of a hold that reached its wake timeout without a member.
pub const HOLD_TIMED_OUT: &str = "timed_out";
/// Label value of a request not held because as many as may be were held already.
pub const HOLD_REFUSED: &str = "refused";

impl GatewayMetrics {
    /// Creates the metrics, registers them in `registry` with the gauge of `sessions`.
    pub fn register(
        registry: &Registry,
        sessions: Sessions,
        tenants: TenantMetrics,
        traffic: Traffic,
    ) -> Result<Self, prometheus::Error> {
        let connections = IntCounter::new(
            "proxy_operator_gateway_connections_total",
            "Client connections the gateway accepted.",
        )?;
        let open = IntGauge::new(
            "proxy_operator_gateway_connections_open",
            "Client connections open now (--gateway-max-connections caps them).",
        )?;
        let refused_connections = IntCounterVec::new(
            Opts::new(
                "proxy_operator_gateway_connections_refused_total",
                "Client connections refused with 503 too_many_connections, by cap: \
                 process_limit (--gateway-max-connections) or tenant_limit \
                 (--gateway-max-tenant-connections).",
            ),
            &["reason"],
        )?;
        let closed_connections = IntCounterVec::new(
            Opts::new(
                "proxy_operator_gateway_connections_timed_out_total",
                "Client connections the gateway closed by a timeout: header_timeout (a request \
                 head not whole within --gateway-header-timeout) or idle_timeout (no request \
                 within --gateway-idle-timeout).",
            ),
            &["reason"],
        )?;
        let refused_destinations = IntCounterVec::new(
            Opts::new(
                "proxy_operator_gateway_destinations_refused_total",
                "Gateway requests whose target the destination policy refused, by reason: the \
                 range of the address refused (loopback, link_local, private, ...) or \
                 unresolvable.",
            ),
            &["reason"],
        )?;
        let rule_matches = IntCounterVec::new(
            Opts::new(
                "proxy_operator_gateway_rule_matches_total",
                "Target answers a per-target rule judged a ban, by rule (its name in \
                 --gateway-rules-file, or default: --gateway-ban-statuses) and result.",
            ),
            &["rule", "result"],
        )?;
        let fallback_steps = IntCounterVec::new(
            Opts::new(
                "proxy_operator_gateway_fallback_steps_total",
                "Leases taken through a fallback chain (--gateway-rules-file `chains`), by \
                 chain and the step that served (1: the first).",
            ),
            &["chain", "step"],
        )?;
        let intercepted = IntCounter::new(
            "proxy_operator_gateway_intercepted_total",
            "CONNECT tunnels the gateway intercepted (tls=inspect): both TLS handshakes done.",
        )?;
        let handshake_failures = IntCounterVec::new(
            Opts::new(
                "proxy_operator_gateway_tls_handshake_failures_total",
                "Intercepted CONNECTs whose TLS failed, by side (client: the crawler's \
                 handshake with the gateway; target: the gateway's with the target) and reason \
                 (client: sni_mismatch, leaf, handshake; target: certificate, handshake).",
            ),
            &["side", "reason"],
        )?;
        let certificates = IntCounterVec::new(
            Opts::new(
                "proxy_operator_gateway_certificates_total",
                "Leaf certificates the gateway served to intercepted clients, by how they were \
                 had: minted (signed now) or cached.",
            ),
            &["result"],
        )?;
        let requests = IntCounterVec::new(
            Opts::new(
                "proxy_operator_gateway_requests_total",
                "Gateway requests by kind (connect, http, inspected: inside an intercepted tunnel) and \
                 outcome: tunneled, intercepted, forwarded, \
                 auth_required (407), bad_request (400), port_refused (403), no_proxy (503), \
                 unavailable (503: the ledger could not take the lease), upstream_failed (502), \
                 quota_exceeded (503), destination_refused (403, or 502 for a name that does \
                 not resolve), too_many_connections (503), interception_refused (403).",
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
                 timed_out, or refused: as many held as --gateway-max-held-requests allows), \
                 and how long they waited.",
            )
            .buckets(vec![
                0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0,
            ]),
            &["outcome"],
        )?;
        for outcome in [HOLD_RELAYED, HOLD_TIMED_OUT, HOLD_REFUSED] {
            held.with_label_values(&[outcome]);
        }
        for metric in [
            Box::new(held.clone()) as Box<dyn Collector>,
            Box::new(connections.clone()),
            Box::new(rule_matches.clone()),
            Box::new(fallback_steps.clone()),
            Box::new(intercepted.clone()),
            Box::new(handshake_failures.clone()),
            Box::new(certificates.clone()),
            Box::new(open.clone()),
            Box::new(refused_connections.clone()),
            Box::new(closed_connections.clone()),
            Box::new(refused_destinations.clone()),
            Box::new(requests.clone()),
            Box::new(bytes.clone()),
            Box::new(retries.clone()),
            Box::new(bans.clone()),
            Box::new(SessionGauge::new(sessions)?),
        ] {
            registry.register(metric)?;
        }
        for kind in ["connect", "http", "inspected"] {
            for outcome in RequestOutcome::ALL {
                requests.with_label_values(&[kind, outcome.as_str()]);
            }
        }
        for reason in [PROCESS_LIMIT, TENANT_LIMIT] {
            refused_connections.with_label_values(&[reason]);
        }
        for expired in Expired::ALL {
            closed_connections.with_label_values(&[expired.as_str()]);
        }
        for reason in Kind::ALL
            .map(Kind::as_str)
            .into_iter()
            .chain([UNRESOLVABLE])
        {
            refused_destinations.with_label_values(&[reason]);
        }
        for result in [ReportResult::RateLimited, ReportResult::Blocked] {
            bans.with_label_values(&[result.as_str()]);
        }
        for (side, reasons) in [
            ("client", ["sni_mismatch", "leaf", "handshake"].as_slice()),
            ("target", ["certificate", "handshake"].as_slice()),
        ] {
            for reason in reasons {
                handshake_failures.with_label_values(&[side, reason]);
            }
        }
        for result in ["minted", "cached"] {
            certificates.with_label_values(&[result]);
        }
        Ok(GatewayMetrics {
            connections,
            rule_matches,
            fallback_steps,
            intercepted,
            handshake_failures,
            certificates,
            open,
            refused_connections,
            closed_connections,
            refused_destinations,
            requests,
            bytes_up: bytes.with_label_values(&["up"]),
            bytes_down: bytes.with_label_values(&["down"]),
            retries,
            bans,
            held,
            tenants,
            traffic,
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

    /// Counts a connection open until the guard drops.
    pub fn open_connection(&self) -> OpenConnection {
        self.open.inc();
        OpenConnection(self.open.clone())
    }

    /// Counts a connection refused at the cap `reason` names.
    pub fn connection_refused(&self, reason: &str) {
        self.refused_connections.with_label_values(&[reason]).inc();
    }

    /// Counts a connection closed by a timeout.
    pub fn connection_closed(&self, expired: Expired) {
        self.closed_connections
            .with_label_values(&[expired.as_str()])
            .inc();
    }

    /// Counts a target the destination policy refused, by reason.
    pub fn destination_refused(&self, reason: &str) {
        self.refused_destinations.with_label_values(&[reason]).inc();
    }

    /// Counts a request of `kind` (`connect`, `http`, `inspected`) that ended with `outcome`.
    pub fn request(&self, kind: &str, outcome: RequestOutcome) {
        self.requests
            .with_label_values(&[kind, outcome.as_str()])
            .inc();
    }

    /// Counts bytes relayed for `tenant` through the proxy `proxy_uid`.
    pub fn relayed(&self, tenant: &Arc<str>, proxy_uid: &str, up: u64, down: u64) {
        self.bytes_up.inc_by(up);
        self.bytes_down.inc_by(down);
        self.tenants.relayed(tenant, up, down);
        self.traffic.add(proxy_uid, tenant, up, down);
    }

    /// Counts a try on another proxy.
    pub fn retried(&self) {
        self.retries.inc();
    }

    /// Counts an answer `rule` judged a ban reported as `result`.
    pub fn rule_matched(&self, rule: &str, result: ReportResult) {
        self.rule_matches
            .with_label_values(&[rule, result.as_str()])
            .inc();
    }

    /// Counts a lease taken through step `step` (1: the first) of fallback chain `chain`.
    pub fn fallback_step(&self, chain: &str, step: u32) {
        self.fallback_steps
            .with_label_values(&[chain, &step.to_string()])
            .inc();
    }

    /// Counts a CONNECT intercepted, with how its leaf was had (`minted`, `cached`).
    pub fn intercepted(&self, leaf: &str) {
        self.intercepted.inc();
        self.certificates.with_label_values(&[leaf]).inc();
    }

    /// Counts a failed TLS handshake of an intercepted CONNECT, by side and reason.
    pub fn handshake_failed(&self, side: &str, reason: &str) {
        self.handshake_failures
            .with_label_values(&[side, reason])
            .inc();
    }

    /// Counts a ban reported.
    pub fn banned(&self, result: ReportResult) {
        self.bans.with_label_values(&[result.as_str()]).inc();
    }
}

/// An open connection in `proxy_operator_gateway_connections_open`, until dropped.
pub struct OpenConnection(IntGauge);

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.0.dec();
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
