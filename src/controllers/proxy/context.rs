//! What every reconcile shares: its configuration ([`ReconcilerConfig`]) and the one
//! [`Context`] per process.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use kube::Client;
use kube::runtime::events::Recorder;
use kube::runtime::reflector::Store;

use super::health_transitions::{ExitStates, HealthStates};
use super::metrics::ReconcilerMetrics;
use super::pacing::Pacing;
use crate::controllers::budget::{self, Share};
use crate::ledger::Ledger;
use crate::provider::Provider;
use crate::resources::proxy::Proxy;

/// How often the reconciler looks again, per situation. Configuration so tests can shrink them.
#[derive(Debug, Clone, PartialEq)]
pub struct ReconcilerConfig {
    /// While a machine is being created.
    pub provisioning_poll: Duration,
    /// While a machine runs (catches machines that die or vanish).
    pub drift_poll: Duration,
    /// While a machine is being deleted (replacement or Proxy deletion).
    pub deletion_poll: Duration,
    /// After the provider refused for quota.
    pub quota_requeue: Duration,
    /// First wait after a failure; doubles per failure in a row up to `error_requeue_max`.
    pub error_requeue: Duration,
    /// Longest wait after failures in a row.
    pub error_requeue_max: Duration,
    /// How long a machine may take to run before it is replaced.
    pub startup_timeout: Duration,
    /// How long past its deletion deadline a machine is left before it is force-deleted.
    pub force_delete_margin: Duration,
    /// How often a permanent provider refusal is tried again.
    pub permanent_failure_retry: Duration,
    /// Longest drain before a machine is deleted anyway.
    pub drain_timeout: Duration,
    /// Most voluntary replacements under way at once.
    pub replacement_budget: Share,
    /// How long a proxy may fail health checks before its machine is replaced.
    pub remediate_after: Duration,
    /// Above this share of a provider's proxies unhealthy, none is remediated.
    pub max_unhealthy: Share,
    /// Most reconciles running at once.
    pub concurrency: u16,
}

impl Default for ReconcilerConfig {
    fn default() -> Self {
        ReconcilerConfig {
            provisioning_poll: Duration::from_secs(10),
            drift_poll: Duration::from_secs(300),
            deletion_poll: Duration::from_secs(5),
            quota_requeue: Duration::from_secs(300),
            error_requeue: Duration::from_secs(5),
            error_requeue_max: Duration::from_secs(300),
            startup_timeout: Duration::from_secs(600),
            force_delete_margin: Duration::from_secs(30),
            permanent_failure_retry: Duration::from_secs(1800),
            drain_timeout: Duration::from_secs(900),
            replacement_budget: Share::Percent(10),
            remediate_after: Duration::from_secs(600),
            max_unhealthy: Share::Percent(40),
            concurrency: 16,
        }
    }
}

/// Source of "now" for condition transition times; injected so tests are deterministic.
pub type TimeSource = fn() -> jiff::Timestamp;

/// Everything a reconcile needs; one per process, shared by every reconcile.
pub struct Context {
    /// Kubernetes client.
    pub client: Client,
    /// Providers by their config name.
    pub providers: HashMap<String, Arc<dyn Provider>>,
    /// Value of the install label put on every machine.
    pub install: String,
    /// Poll intervals.
    pub config: ReconcilerConfig,
    /// Last health transitions.
    pub health: HealthStates,
    /// Last exit reports.
    pub exits: ExitStates,
    /// Retry memory: failures in a row and holds on creates.
    pub pacing: Pacing,
    /// The lease ledger, to end the leases of machines that are gone.
    pub ledger: Arc<dyn Ledger>,
    /// Publishes Kubernetes Events.
    pub recorder: Recorder,
    /// Current time.
    pub clock: TimeSource,
    /// Replacement budget slots granted by this process and not yet visible in the store.
    pub grants: budget::Grants,
    /// Every Proxy, as the controller's store has them: set once the store has its first
    /// complete list, so the replacement budget never counts from a partial one.
    pub fleet: OnceLock<Store<Proxy>>,
    /// Reconcile timings, errors and actions; drains and their timeouts.
    pub metrics: ReconcilerMetrics,
}

impl Context {
    /// A context with empty health and retry memory, publishing Events as `proxy-operator`,
    /// on the system clock.
    pub fn new(
        client: Client,
        providers: HashMap<String, Arc<dyn Provider>>,
        install: String,
        config: ReconcilerConfig,
        ledger: Arc<dyn Ledger>,
        metrics: ReconcilerMetrics,
    ) -> Self {
        Context {
            recorder: Recorder::new(client.clone(), "proxy-operator".into()),
            client,
            providers,
            install,
            config,
            health: HealthStates::default(),
            exits: ExitStates::default(),
            pacing: Pacing::default(),
            ledger,
            clock: jiff::Timestamp::now,
            grants: budget::Grants::default(),
            fleet: OnceLock::new(),
            metrics,
        }
    }

    /// Every Proxy the controller knows now; `None` until the store has its first complete
    /// list.
    pub fn fleet(&self) -> Option<Vec<Arc<Proxy>>> {
        self.fleet.get().map(Store::state)
    }
}
