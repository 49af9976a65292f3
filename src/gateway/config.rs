//! How the gateway behaves: its settings, from the command line.

use std::time::Duration;

use super::bans::BanRule;
use super::rules::HostPattern;
use super::timeouts::Timeouts;
use crate::egress::IpNet;

/// How the gateway behaves.
#[derive(Debug, Clone)]
pub struct GatewayConfig {
    /// Ports a crawler may reach through the gateway (`CONNECT` and plain HTTP alike), so a
    /// token holder cannot relay to anything else.
    pub allowed_ports: Vec<u16>,
    /// Other proxies tried after an upstream failed before anything reached the crawler.
    pub retries: u32,
    /// Longest wait for an upstream proxy: connecting, its answer to a CONNECT, and the
    /// response head of a plain request.
    pub upstream_timeout: Duration,
    /// Target statuses reported as bans.
    pub ban_rule: BanRule,
    /// Idle lifetime of a session whose user part names no `sessionTTL`.
    pub session_ttl: Duration,
    /// TTL of the lease a connection holds without a session, renewed while it is used.
    pub connection_lease_ttl: Duration,
    /// Largest plain-HTTP request body, buffered so the request can be tried on another
    /// proxy.
    pub max_request_body: usize,
    /// Non-public destination ranges opened to crawlers (every other one is refused).
    pub allowed_destinations: Vec<IpNet>,
    /// Whether a target name the gateway cannot resolve goes on to the upstream to resolve.
    pub pass_unresolved: bool,
    /// Whether the bytes relayed go to the ledger's hourly traffic rows (and so count towards
    /// the tenants' `bytesPerDay` quotas).
    pub traffic_ledger: bool,
    /// How long a request head and an idle kept-alive connection may take.
    pub timeouts: Timeouts,
    /// Most client connections open at once.
    pub max_connections: usize,
    /// Most client connections open at once for one tenant of the tenants file.
    pub max_tenant_connections: usize,
    /// Most leases one client connection without a session holds (one per target); the
    /// least recently used one goes back first.
    pub max_connection_leases: usize,
    /// Most requests held at once while their pools wake.
    pub max_held: usize,
    /// Hosts never intercepted, even when asked (`--gateway-intercept-exclude`).
    pub intercept_exclude: Vec<HostPattern>,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        GatewayConfig {
            allowed_ports: vec![80, 443],
            retries: 2,
            upstream_timeout: Duration::from_secs(10),
            ban_rule: BanRule::default(),
            session_ttl: Duration::from_secs(300),
            connection_lease_ttl: Duration::from_secs(300),
            max_request_body: 16 << 20,
            allowed_destinations: Vec::new(),
            pass_unresolved: false,
            traffic_ledger: true,
            timeouts: Timeouts {
                header: Duration::from_secs(10),
                idle: Duration::from_secs(60),
            },
            max_connections: 8192,
            max_tenant_connections: 2048,
            max_connection_leases: 4,
            max_held: 1024,
            intercept_exclude: Vec::new(),
        }
    }
}
