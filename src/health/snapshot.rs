//! The read-only view of proxy health that the health engine publishes and the API reads.

use std::collections::HashMap;
use std::sync::{Arc, PoisonError, RwLock, RwLockReadGuard};
use std::time::Duration;

use crate::proxy::ProxyId;

/// What is known about one proxy's health.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ProxyHealth {
    /// `Some(true)` healthy, `Some(false)` unhealthy, `None` not decided yet.
    pub healthy: Option<bool>,
    /// Latency of the last probe.
    pub latency: Option<Duration>,
    /// When the last probe finished.
    pub last_probe: Option<jiff::Timestamp>,
    /// Why the last probe failed, if it did.
    pub last_error: Option<String>,
}

/// Shared map of proxy identity to health. The engine is the only writer.
#[derive(Debug, Clone, Default)]
pub struct HealthSnapshot {
    inner: Arc<RwLock<HashMap<ProxyId, ProxyHealth>>>,
}

impl HealthSnapshot {
    /// An empty snapshot.
    pub fn new() -> Self {
        Self::default()
    }

    /// Health of one proxy.
    pub fn get(&self, id: &ProxyId) -> Option<ProxyHealth> {
        self.read().get(id).cloned()
    }

    /// A read guard over the whole map, for readers that look up many proxies at once.
    pub fn read(&self) -> RwLockReadGuard<'_, HashMap<ProxyId, ProxyHealth>> {
        self.inner.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// Records the health of one proxy.
    pub fn set(&self, id: ProxyId, health: ProxyHealth) {
        self.inner
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(id, health);
    }

    /// Drops every proxy for which `keep` is false.
    pub fn retain(&self, mut keep: impl FnMut(&ProxyId) -> bool) {
        self.inner
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|id, _| keep(id));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(name: &str) -> ProxyId {
        ProxyId {
            namespace: "default".into(),
            name: name.into(),
            uid: format!("uid-{name}"),
        }
    }

    #[test]
    fn set_get_and_retain() {
        let snapshot = HealthSnapshot::new();
        let healthy = ProxyHealth {
            healthy: Some(true),
            latency: Some(Duration::from_millis(12)),
            ..Default::default()
        };
        snapshot.set(id("a"), healthy.clone());
        snapshot.set(id("b"), ProxyHealth::default());
        assert_eq!(snapshot.get(&id("a")), Some(healthy));
        snapshot.retain(|i| i.name == "b");
        assert_eq!(snapshot.get(&id("a")), None);
        assert_eq!(snapshot.read().len(), 1);
    }
}
