//! The in-memory inventory of Proxy objects: the one place the health engine and the API read
//! proxies from. A feeder (the standalone file loader, or the Kubernetes watcher in operator
//! mode) replaces the whole set; readers get cheap immutable snapshots.

pub mod file;

use std::collections::HashMap;
use std::sync::Arc;

use tokio::sync::watch;

use crate::proxy::{Proxy, ProxyId};

/// One immutable view of the inventory.
#[derive(Debug, Default)]
pub struct InventorySnapshot {
    /// Proxies sorted by namespace/name.
    proxies: Vec<Arc<Proxy>>,
    /// Identity of each proxy in `proxies`, computed once per replacement (the API and the
    /// health engine look proxies up by identity on every request and tick).
    ids: Vec<ProxyId>,
    /// Position of each proxy in `proxies`, by identity.
    by_id: HashMap<ProxyId, usize>,
    /// Whether the feeder has delivered its first complete set (drives `/readyz`).
    synced: bool,
}

impl InventorySnapshot {
    /// Every proxy, sorted by namespace/name.
    pub fn proxies(&self) -> &[Arc<Proxy>] {
        &self.proxies
    }

    /// Every proxy with its identity, sorted by namespace/name.
    pub fn entries(&self) -> impl Iterator<Item = (&ProxyId, &Arc<Proxy>)> {
        self.ids.iter().zip(&self.proxies)
    }

    /// The proxy with this identity, if present.
    pub fn get(&self, id: &ProxyId) -> Option<&Arc<Proxy>> {
        self.by_id.get(id).map(|&i| &self.proxies[i])
    }

    /// Whether a first complete set has been loaded.
    pub fn is_synced(&self) -> bool {
        self.synced
    }

    /// Number of proxies.
    pub fn len(&self) -> usize {
        self.proxies.len()
    }

    /// Whether there are no proxies.
    pub fn is_empty(&self) -> bool {
        self.proxies.is_empty()
    }
}

/// Shared handle to the inventory. Cloning is cheap; all clones see the same set.
#[derive(Clone, Debug)]
pub struct Inventory {
    sender: Arc<watch::Sender<Arc<InventorySnapshot>>>,
}

impl Default for Inventory {
    fn default() -> Self {
        Self::new()
    }
}

impl Inventory {
    /// An empty, not yet synced inventory.
    pub fn new() -> Self {
        let (sender, _) = watch::channel(Arc::new(InventorySnapshot::default()));
        Inventory {
            sender: Arc::new(sender),
        }
    }

    /// Replaces the whole set and marks the inventory synced.
    pub fn replace(&self, proxies: impl IntoIterator<Item = Proxy>) {
        let mut proxies: Vec<Arc<Proxy>> = proxies.into_iter().map(Arc::new).collect();
        proxies.sort_by_key(|p| p.key());
        let ids: Vec<ProxyId> = proxies.iter().map(|p| p.id()).collect();
        let by_id = ids
            .iter()
            .enumerate()
            .map(|(i, id)| (id.clone(), i))
            .collect();
        self.sender.send_replace(Arc::new(InventorySnapshot {
            proxies,
            ids,
            by_id,
            synced: true,
        }));
    }

    /// The current set.
    pub fn snapshot(&self) -> Arc<InventorySnapshot> {
        self.sender.borrow().clone()
    }

    /// A receiver that is notified on every replacement (for the health engine's loop).
    pub fn subscribe(&self) -> watch::Receiver<Arc<InventorySnapshot>> {
        self.sender.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::ProxySpec;

    fn proxy(ns: &str, name: &str) -> Proxy {
        let spec: ProxySpec = serde_json::from_value(serde_json::json!({
            "mode": "External", "endpoint": {"host": "127.0.0.1", "port": 3128}
        }))
        .unwrap();
        let mut p = Proxy::new(name, spec);
        p.metadata.namespace = Some(ns.into());
        p
    }

    #[test]
    fn replace_sorts_indexes_and_marks_synced() {
        let inventory = Inventory::new();
        assert!(!inventory.snapshot().is_synced());
        inventory.replace([proxy("b", "x"), proxy("a", "y"), proxy("a", "x")]);
        let snap = inventory.snapshot();
        assert!(snap.is_synced());
        let keys: Vec<String> = snap.proxies().iter().map(|p| p.key()).collect();
        assert_eq!(keys, ["a/x", "a/y", "b/x"]);
        let id = proxy("a", "y").id();
        assert_eq!(snap.get(&id).unwrap().key(), "a/y");
        let ids: Vec<String> = snap.entries().map(|(id, _)| id.key()).collect();
        assert_eq!(ids, keys);
        assert_eq!(snap.len(), 3);
    }

    #[tokio::test]
    async fn subscribers_see_replacements() {
        let inventory = Inventory::new();
        let mut rx = inventory.subscribe();
        inventory.replace([proxy("a", "x")]);
        rx.changed().await.unwrap();
        assert_eq!(rx.borrow().len(), 1);
    }
}
