//! What is known of each proxy's exit, published by the exit checker and read by the API,
//! the status page and the metrics; and the report the reconciler writes to status.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, PoisonError, RwLock};

use crate::geoip::ExitNetwork;
use crate::resources::proxy::ProxyId;

/// One proxy's exit, from its last successful check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExitView {
    /// The address targets see.
    pub ip: IpAddr,
    /// When it last changed (`None` for a rotating upstream's sample).
    pub changed_at: Option<jiff::Timestamp>,
    /// A rotating upstream's exit: one vendor session's, sampled, not tracked.
    pub sampled: bool,
    /// Its country and network, when the databases know them.
    pub network: ExitNetwork,
    /// The other Ready proxies exiting from the same address (`namespace/name`, sorted).
    pub shared_with: Vec<String>,
    /// When it was last checked (successfully or not).
    pub checked_at: jiff::Timestamp,
    /// Why the last check failed, when it did (the exit shown is the last one found).
    pub last_error: Option<String>,
}

impl ExitView {
    /// What status shows of it: everything but the time and outcome of the last check, so a
    /// check that confirms the exit writes nothing.
    pub fn report(&self, id: &ProxyId) -> ExitReport {
        ExitReport {
            id: id.clone(),
            ip: self.ip,
            changed_at: self.changed_at,
            sampled: self.sampled,
            network: self.network.clone(),
            shared_with: self.shared_with.clone(),
        }
    }
}

/// What the reconciler writes to a proxy's status about its exit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExitReport {
    /// The proxy.
    pub id: ProxyId,
    /// `status.exitIP`.
    pub ip: IpAddr,
    /// `status.exitIPChangedAt`.
    pub changed_at: Option<jiff::Timestamp>,
    /// A rotating upstream's sample.
    pub sampled: bool,
    /// `status.exitCountry`, `exitASN`, `exitOrganization`.
    pub network: ExitNetwork,
    /// The `SharedExit` condition's other proxies.
    pub shared_with: Vec<String>,
}

/// Every proxy's exit, shared between the exit checker (the writer) and its readers.
#[derive(Debug, Clone, Default)]
pub struct ExitTable {
    inner: Arc<RwLock<HashMap<ProxyId, ExitView>>>,
}

impl ExitTable {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// The exit of one proxy.
    pub fn get(&self, id: &ProxyId) -> Option<ExitView> {
        self.inner
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(id)
            .cloned()
    }

    /// Every exit known, for a scrape or a page.
    pub fn all(&self) -> HashMap<ProxyId, ExitView> {
        self.inner
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Sets one proxy's exit.
    pub fn set(&self, id: ProxyId, view: ExitView) {
        self.inner
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(id, view);
    }

    /// Keeps only the proxies `keep` says.
    pub fn retain(&self, mut keep: impl FnMut(&ProxyId) -> bool) {
        self.inner
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|id, _| keep(id));
    }
}
