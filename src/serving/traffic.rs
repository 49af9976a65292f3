//! Bytes through the gateway per proxy: up (the crawler's request bodies and tunnel bytes, to
//! the target) and down (the target's answer bodies and tunnel bytes, to the crawler), added as
//! each answer or tunnel ends. A pool's and a vendor endpoint's bytes are their proxies'. The
//! table is keyed by UID and read once a scrape for the proxies in the inventory (see
//! `metrics::FleetCollector`), which also drops the entries of proxies gone from it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock};

/// One proxy's bytes so far.
#[derive(Debug, Default)]
struct Counted {
    up: AtomicU64,
    down: AtomicU64,
}

/// Bytes per proxy (by UID). Cheap to clone; every clone counts into the same table.
#[derive(Debug, Clone, Default)]
pub struct Traffic {
    table: Arc<RwLock<HashMap<String, Counted>>>,
}

impl Traffic {
    /// Adds `up` and `down` bytes to the proxy `uid`'s.
    pub fn add(&self, uid: &str, up: u64, down: u64) {
        {
            let table = self.table.read().unwrap_or_else(PoisonError::into_inner);
            if let Some(counted) = table.get(uid) {
                counted.up.fetch_add(up, Ordering::Relaxed);
                counted.down.fetch_add(down, Ordering::Relaxed);
                return;
            }
        }
        let mut table = self.table.write().unwrap_or_else(PoisonError::into_inner);
        let counted = table.entry(uid.to_owned()).or_default();
        counted.up.fetch_add(up, Ordering::Relaxed);
        counted.down.fetch_add(down, Ordering::Relaxed);
    }

    /// Every proxy's bytes so far, `(up, down)` by UID: those that carried some.
    pub fn counts(&self) -> HashMap<String, (u64, u64)> {
        let table = self.table.read().unwrap_or_else(PoisonError::into_inner);
        table
            .iter()
            .map(|(uid, counted)| {
                let up = counted.up.load(Ordering::Relaxed);
                (uid.clone(), (up, counted.down.load(Ordering::Relaxed)))
            })
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
    fn bytes_add_up_per_proxy_until_it_is_forgotten() {
        let traffic = Traffic::default();
        assert!(traffic.counts().is_empty());
        traffic.add("a", 10, 1000);
        traffic.clone().add("a", 5, 24);
        traffic.add("b", 1, 2);
        let expected = |pairs: &[(&str, (u64, u64))]| -> HashMap<String, (u64, u64)> {
            pairs
                .iter()
                .map(|(uid, c)| ((*uid).to_owned(), *c))
                .collect()
        };
        assert_eq!(
            traffic.counts(),
            expected(&[("a", (15, 1024)), ("b", (1, 2))])
        );
        traffic.forget(&["a".to_owned()]);
        assert_eq!(traffic.counts(), expected(&[("b", (1, 2))]));
    }
}
