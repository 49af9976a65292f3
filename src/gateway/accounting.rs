//! Bytes through the gateway for the ledger's hourly traffic rows: added up in memory per
//! (tenant, proxy, target) as each answer or tunnel ends, and written to the ledger in one
//! batch every [`FLUSH_INTERVAL`] and once more when the gateway stops, never one write per
//! request. A batch the ledger refuses (overloaded, full, unreachable) is kept and goes with
//! the next one.
//!
//! The ledger answers each flush with the day's bytes of the tenants it named, every
//! replica's included. A tenant whose bytes reached its `bytesPerDay` quota is refused new
//! work here until the day's turn, also on a session or a connection that holds its lease
//! already (new leases the ledger refuses itself): within one flush interval of the ledger
//! counting the bytes that spent it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::inventory::InventorySnapshot;

use crate::ledger::traffic::{DayBytes, day_start};
use crate::ledger::{Ledger, QuotaExceeded, TrafficBytes, bytes_spent};
use crate::resources::pool::member_of;
use crate::resources::proxy::ProxyId;
use crate::serving::tenants::Tenant;

/// How often the bytes added up go to the ledger.
pub const FLUSH_INTERVAL: Duration = Duration::from_secs(1);

/// One row's key: the tenant, the proxy and the target (host).
type Key = (Arc<str>, ProxyId, Arc<str>);

/// Bytes not yet in the ledger, `(up, down)` by row: the gateway's, added to by every
/// serving thread.
#[derive(Debug)]
pub struct Accounting {
    /// Whether bytes go to the ledger at all (`--gateway-no-traffic-ledger` turns it off).
    enabled: bool,
    pending: Mutex<HashMap<Key, (u64, u64)>>,
    /// Each tenant's bytes of the day as the ledger last answered them.
    today: Mutex<HashMap<String, DayBytes>>,
}

impl Accounting {
    /// Accounting that writes to the ledger when `enabled`, and otherwise adds up nothing.
    pub fn new(enabled: bool) -> Self {
        Accounting {
            enabled,
            pending: Mutex::default(),
            today: Mutex::default(),
        }
    }

    /// Adds `up` and `down` bytes relayed for `tenant` through `proxy` to `target`.
    pub fn add(&self, tenant: &Arc<str>, proxy: &ProxyId, target: &Arc<str>, up: u64, down: u64) {
        if !self.enabled || (up == 0 && down == 0) {
            return;
        }
        let mut pending = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
        let key = (tenant.clone(), proxy.clone(), target.clone());
        let row = pending.entry(key).or_default();
        row.0 = row.0.saturating_add(up);
        row.1 = row.1.saturating_add(down);
    }

    /// Takes what was added so far.
    fn take(&self) -> HashMap<Key, (u64, u64)> {
        std::mem::take(&mut *self.pending.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// Puts a batch the ledger did not take back, to go with the next one.
    fn keep(&self, batch: HashMap<Key, (u64, u64)>) {
        let mut pending = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
        for (key, (up, down)) in batch {
            let row = pending.entry(key).or_default();
            row.0 = row.0.saturating_add(up);
            row.1 = row.1.saturating_add(down);
        }
    }

    /// Writes what was added so far to `ledger`, each proxy with the pool `inventory` gives
    /// it, at `now_ms` (the ledger's clock, read before the write: the day the ledger counts
    /// in is never an earlier one), and keeps each tenant's bytes today as the ledger answers
    /// them. When the ledger refuses, the bytes are kept for the next flush.
    pub async fn flush(&self, ledger: &dyn Ledger, inventory: &InventorySnapshot, now_ms: i64) {
        let batch = self.take();
        if batch.is_empty() {
            return;
        }
        match ledger.record_traffic(rows(&batch, inventory)).await {
            Ok(answered) => {
                let mut today = self.today.lock().unwrap_or_else(PoisonError::into_inner);
                let day_ms = day_start(now_ms);
                today.retain(|_, day| day.day_ms == day_ms);
                for (tenant, bytes) in answered {
                    today.insert(tenant, DayBytes { day_ms, bytes });
                }
            }
            Err(error) => {
                log::warn!("gateway: the ledger did not take the bytes relayed, kept: {error}");
                self.keep(batch);
            }
        }
    }

    /// Why `tenant` may start no new work at `now_ms`: its bytes of the day, as the ledger
    /// last answered them, reached its `bytesPerDay` quota.
    pub fn budget_spent(&self, tenant: &Tenant, now_ms: i64) -> Option<QuotaExceeded> {
        tenant.quotas.bytes_per_day?;
        let bytes = self
            .today
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&*tenant.name)
            .map_or(0, |day| day.at(now_ms));
        bytes_spent(&tenant.tenancy(), bytes, now_ms)
    }
}

/// The ledger's rows of a batch.
fn rows(batch: &HashMap<Key, (u64, u64)>, inventory: &InventorySnapshot) -> Vec<TrafficBytes> {
    batch
        .iter()
        .map(|((tenant, proxy, target), (up, down))| TrafficBytes {
            tenant: tenant.to_string(),
            namespace: proxy.namespace.clone(),
            name: proxy.name.clone(),
            pool: inventory
                .get(proxy)
                .and_then(|p| member_of(p).map(str::to_owned)),
            target: target.to_string(),
            up: *up,
            down: *down,
        })
        .collect()
}

/// Flushes `gateway`'s bytes every [`FLUSH_INTERVAL`] until `shutdown`; the last flush is the
/// server's, once the connections under way ended.
pub(super) async fn flush_every_interval(
    gateway: Arc<super::Gateway>,
    shutdown: CancellationToken,
) {
    let mut ticker = tokio::time::interval(FLUSH_INTERVAL);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = ticker.tick() => gateway.flush_traffic().await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn proxy(name: &str) -> ProxyId {
        ProxyId {
            namespace: "crawl".into(),
            name: name.into(),
            uid: format!("uid-{name}"),
        }
    }

    #[test]
    fn bytes_add_up_per_tenant_proxy_and_target_until_taken_and_a_kept_batch_adds_back() {
        let off = Accounting::new(false);
        off.add(&"team-a".into(), &proxy("p1"), &"example.com".into(), 1, 1);
        assert!(off.take().is_empty(), "accounting off adds nothing");
        let accounting = Accounting::new(true);
        let (a, b): (Arc<str>, Arc<str>) = ("team-a".into(), "team-b".into());
        let target: Arc<str> = "example.com".into();
        accounting.add(&a, &proxy("p1"), &target, 10, 100);
        accounting.add(&a, &proxy("p1"), &target, 1, 2);
        accounting.add(&b, &proxy("p1"), &target, 5, 6);
        accounting.add(&b, &proxy("p2"), &target, 0, 0);
        let batch = accounting.take();
        assert_eq!(batch.len(), 2, "{batch:?}");
        assert_eq!(
            batch.get(&(a.clone(), proxy("p1"), target.clone())),
            Some(&(11, 102))
        );
        assert!(accounting.take().is_empty());
        accounting.add(&a, &proxy("p1"), &target, 1, 1);
        accounting.keep(batch);
        let again = accounting.take();
        assert_eq!(again.get(&(a, proxy("p1"), target)), Some(&(12, 103)));
    }
}
