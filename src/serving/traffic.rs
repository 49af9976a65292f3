//! Bytes through the gateway per proxy: up (the crawler's request bodies and tunnel bytes, to
//! the target) and down (the target's answer bodies and tunnel bytes, to the crawler), added as
//! each answer or tunnel ends, and per tenant that sent them (up and down together: what a
//! price per GB bills). A pool's and a vendor endpoint's bytes are their proxies'. The table is
//! keyed by UID and read once a scrape for the proxies in the inventory (see
//! `metrics::FleetCollector`), which also drops the entries of proxies gone from it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};

/// One proxy's bytes so far.
#[derive(Debug, Default)]
struct Counted {
    up: AtomicU64,
    down: AtomicU64,
    /// Bytes (up and down) per tenant; tenants are few (the tenants file bounds them).
    tenants: Mutex<Vec<(Arc<str>, u64)>>,
}

impl Counted {
    fn add(&self, tenant: &Arc<str>, up: u64, down: u64) {
        self.up.fetch_add(up, Ordering::Relaxed);
        self.down.fetch_add(down, Ordering::Relaxed);
        let bytes = up.saturating_add(down);
        let mut tenants = self.tenants.lock().unwrap_or_else(PoisonError::into_inner);
        match tenants.iter_mut().find(|(name, _)| name == tenant) {
            Some((_, sum)) => *sum = sum.saturating_add(bytes),
            None => tenants.push((tenant.clone(), bytes)),
        }
    }

    fn read(&self) -> Counts {
        Counts {
            up: self.up.load(Ordering::Relaxed),
            down: self.down.load(Ordering::Relaxed),
            tenants: self
                .tenants
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone(),
        }
    }
}

/// What one proxy carried so far.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Counts {
    /// Bytes to the targets.
    pub up: u64,
    /// Bytes to the crawlers.
    pub down: u64,
    /// Bytes both ways per tenant.
    pub tenants: Vec<(Arc<str>, u64)>,
}

/// Bytes per proxy (by UID). Cheap to clone; every clone counts into the same table.
#[derive(Debug, Clone, Default)]
pub struct Traffic {
    table: Arc<RwLock<HashMap<String, Counted>>>,
}

impl Traffic {
    /// Adds `up` and `down` bytes relayed for `tenant` to the proxy `uid`'s.
    pub fn add(&self, uid: &str, tenant: &Arc<str>, up: u64, down: u64) {
        {
            let table = self.table.read().unwrap_or_else(PoisonError::into_inner);
            if let Some(counted) = table.get(uid) {
                counted.add(tenant, up, down);
                return;
            }
        }
        let mut table = self.table.write().unwrap_or_else(PoisonError::into_inner);
        table
            .entry(uid.to_owned())
            .or_default()
            .add(tenant, up, down);
    }

    /// Every proxy's bytes so far, by UID: those that carried some.
    pub fn counts(&self) -> HashMap<String, Counts> {
        let table = self.table.read().unwrap_or_else(PoisonError::into_inner);
        table
            .iter()
            .map(|(uid, counted)| (uid.clone(), counted.read()))
            .collect()
    }

    /// Forgets the proxies `gone` (UIDs).
    pub fn forget(&self, gone: &[String]) {
        if gone.is_empty() {
            return;
        }
        let mut table = self.table.write().unwrap_or_else(PoisonError::into_inner);
        for uid in gone {
            table.remove(uid);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_add_up_per_proxy_and_tenant_until_the_proxy_is_forgotten() {
        let traffic = Traffic::default();
        assert!(traffic.counts().is_empty());
        let (a, b): (Arc<str>, Arc<str>) = ("team-a".into(), "team-b".into());
        traffic.add("p", &a, 10, 1000);
        traffic.clone().add("p", &b, 5, 24);
        traffic.add("p", &a, 0, 6);
        traffic.add("q", &b, 1, 2);
        let counts = traffic.counts();
        assert_eq!(
            counts["p"],
            Counts {
                up: 15,
                down: 1030,
                tenants: vec![(a.clone(), 1016), (b.clone(), 29)],
            }
        );
        assert_eq!((counts["q"].up, counts["q"].down), (1, 2));
        traffic.forget(&["p".to_owned()]);
        assert_eq!(traffic.counts().into_keys().collect::<Vec<_>>(), ["q"]);
    }
}
