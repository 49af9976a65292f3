//! What every handler shares.

use std::sync::Arc;
use std::time::Duration;

use super::list::ProxyListCache;
use super::metrics::LeaseMetrics;
use super::status::KubeEvents;
use crate::credentials::CredentialStore;
use crate::health::HealthSnapshot;
use crate::inventory::Inventory;
use crate::ledger::{Clock, Ledger};
use crate::serving::candidates::CandidateIndex;
use crate::serving::outcomes::Outcomes;
use crate::serving::pools::PoolDirectory;
use crate::serving::sessions::Sessions;

/// The inventory, health snapshot and ledger the API reads and writes.
#[derive(Clone)]
pub struct ApiState {
    /// Proxies known to the process.
    pub inventory: Inventory,
    /// Their health, as the engine last saw it.
    pub health: HealthSnapshot,
    /// The lease ledger.
    pub ledger: Arc<dyn Ledger>,
    /// The ledger's clock (for `Retry-After`).
    pub clock: Arc<dyn Clock>,
    /// Lease counters.
    pub metrics: LeaseMetrics,
    /// TTL of a lease whose request names none.
    pub default_ttl: Duration,
    /// The serialised entries of the proxy list, kept per inventory snapshot.
    pub proxy_list: ProxyListCache,
    /// Selector matches and health positions, kept per inventory snapshot.
    pub candidates: CandidateIndex,
    /// The gateway's sticky sessions, for reports naming a session.
    pub sessions: Sessions,
    /// Upstream credentials given out in lease answers (`--lease-credentials`); `None`: not
    /// given out.
    pub lease_credentials: Option<CredentialStore>,
    /// The ProxyPools an acquire may wake (empty in standalone mode).
    pub pools: PoolDirectory,
    /// How requests through each proxy ended: the reports taken add to the gateway's counts.
    pub outcomes: Outcomes,
    /// Where the status page reads a Proxy's Kubernetes Events (nowhere in standalone mode).
    pub kube_events: KubeEvents,
}
