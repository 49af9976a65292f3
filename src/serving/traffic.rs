//! Bytes through the gateway per proxy: up (the crawler's request bodies and tunnel bytes, to
//! the target) and down (the target's answer bodies and tunnel bytes, to the crawler), added as
//! each answer or tunnel ends. A pool's and a vendor endpoint's bytes are their proxies'. The
//! table is keyed by UID and read at scrape time for the proxies in the inventory (see
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

    /// The proxy `uid`'s bytes so far, `(up, down)`.
    pub fn of(&self, uid: &str) -> (u64, u64) {
        let table = self.table.read().unwrap_or_else(PoisonError::into_inner);
        table.get(uid).map_or((0, 0), |counted| {
            (
                counted.up.load(Ordering::Relaxed),
                counted.down.load(Ordering::Relaxed),
            )
        })
    }

    /// Forgets the proxies `live` says are gone.
    pub fn retain(&self, live: impl Fn(&str) -> bool) {
        let mut table = self.table.write().unwrap_or_else(PoisonError::into_inner);
        table.retain(|uid, _| live(uid));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_add_up_per_proxy_until_it_is_forgotten() {
        let traffic = Traffic::default();
        assert_eq!(traffic.of("a"), (0, 0));
        traffic.add("a", 10, 1000);
        traffic.clone().add("a", 5, 24);
        traffic.add("b", 1, 2);
        assert_eq!(traffic.of("a"), (15, 1024));
        assert_eq!(traffic.of("b"), (1, 2));
        traffic.retain(|uid| uid == "b");
        assert_eq!(traffic.of("a"), (0, 0));
        assert_eq!(traffic.of("b"), (1, 2));
    }
}
