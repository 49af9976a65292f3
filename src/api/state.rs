//! What every handler shares.

use std::time::Duration;

use super::list::ProxyListCache;
use super::metrics::LeaseMetrics;
use super::status::KubeEvents;
use crate::serving::Fleet;

/// The fleet the API reads and writes, and what only the API keeps.
#[derive(Clone)]
pub struct ApiState {
    /// The fleet, shared with the gateway.
    pub fleet: Fleet,
    /// Lease counters.
    pub metrics: LeaseMetrics,
    /// TTL of a lease whose request names none.
    pub default_ttl: Duration,
    /// The serialised entries of the proxy list, kept per inventory snapshot.
    pub proxy_list: ProxyListCache,
    /// Whether lease answers carry the upstream's credentials (`--lease-credentials`).
    pub lease_credentials: bool,
    /// Where the status page reads a Proxy's Kubernetes Events (nowhere in standalone mode).
    pub kube_events: KubeEvents,
}

impl ApiState {
    /// The API over `fleet`, counting into `metrics`, leasing for `default_ttl` when a request
    /// names no TTL; no credentials in lease answers, no Kubernetes Events.
    pub fn new(fleet: Fleet, metrics: LeaseMetrics, default_ttl: Duration) -> Self {
        ApiState {
            fleet,
            metrics,
            default_ttl,
            proxy_list: ProxyListCache::default(),
            lease_credentials: false,
            kube_events: KubeEvents::default(),
        }
    }
}
