//! How much one gateway may be asked to hold at once: open client connections (per process,
//! and per tenant of a tenants file), and requests held while a pool wakes. A slot is taken
//! before the work and given back when its guard drops, so a refusal costs nothing but the
//! answer.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

/// The label of a connection refused at the process's cap.
pub const PROCESS_LIMIT: &str = "process_limit";
/// The label of a connection refused at its tenant's cap.
pub const TENANT_LIMIT: &str = "tenant_limit";

/// The caps and what is open now.
#[derive(Debug)]
pub struct Limits {
    max_connections: usize,
    max_tenant_connections: usize,
    max_held: usize,
    connections: AtomicUsize,
    held: AtomicUsize,
    tenants: Mutex<HashMap<Arc<str>, usize>>,
}

/// A counted connection or held request; given back when dropped.
#[derive(Debug)]
pub struct Slot {
    limits: Arc<Limits>,
    kind: SlotKind,
}

#[derive(Debug)]
enum SlotKind {
    Connection,
    Held,
    Tenant(Arc<str>),
}

impl Limits {
    /// Caps of `max_connections` open connections, `max_tenant_connections` per tenant, and
    /// `max_held` requests held at once.
    pub fn new(
        max_connections: usize,
        max_tenant_connections: usize,
        max_held: usize,
    ) -> Arc<Self> {
        Arc::new(Limits {
            max_connections,
            max_tenant_connections,
            max_held,
            connections: AtomicUsize::new(0),
            held: AtomicUsize::new(0),
            tenants: Mutex::default(),
        })
    }

    /// A slot for a new client connection, unless the process holds its cap.
    pub fn connection(self: &Arc<Self>) -> Option<Slot> {
        take(&self.connections, self.max_connections).then(|| Slot {
            limits: self.clone(),
            kind: SlotKind::Connection,
        })
    }

    /// A slot for one more connection of `tenant`, unless it holds its cap.
    pub fn tenant_connection(self: &Arc<Self>, tenant: &Arc<str>) -> Option<Slot> {
        let mut tenants = self.tenants.lock().unwrap_or_else(PoisonError::into_inner);
        let open = tenants.entry(tenant.clone()).or_default();
        if *open >= self.max_tenant_connections {
            return None;
        }
        *open += 1;
        Some(Slot {
            limits: self.clone(),
            kind: SlotKind::Tenant(tenant.clone()),
        })
    }

    /// A slot for one more request held while a pool wakes, unless as many are held as may be.
    pub fn held(self: &Arc<Self>) -> Option<Slot> {
        take(&self.held, self.max_held).then(|| Slot {
            limits: self.clone(),
            kind: SlotKind::Held,
        })
    }

    /// The cap of open connections per tenant.
    pub fn max_tenant_connections(&self) -> usize {
        self.max_tenant_connections
    }

    /// The cap of open connections.
    pub fn max_connections(&self) -> usize {
        self.max_connections
    }
}

/// Adds one to `count` unless it is at `max`.
fn take(count: &AtomicUsize, max: usize) -> bool {
    count
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
            (n < max).then_some(n + 1)
        })
        .is_ok()
}

impl Drop for Slot {
    fn drop(&mut self) {
        match &self.kind {
            SlotKind::Connection => {
                self.limits.connections.fetch_sub(1, Ordering::AcqRel);
            }
            SlotKind::Held => {
                self.limits.held.fetch_sub(1, Ordering::AcqRel);
            }
            SlotKind::Tenant(tenant) => {
                let mut tenants = self
                    .limits
                    .tenants
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                if let Some(open) = tenants.get_mut(tenant) {
                    *open = open.saturating_sub(1);
                    if *open == 0 {
                        tenants.remove(tenant);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_capped_and_come_back_when_dropped() {
        let limits = Limits::new(2, 1, 1);
        let a = limits.connection().unwrap();
        let _b = limits.connection().unwrap();
        assert!(limits.connection().is_none());
        assert_eq!(limits.connections.load(Ordering::Relaxed), 2);
        drop(a);
        assert!(limits.connection().is_some());

        let team: Arc<str> = "team-a".into();
        let other: Arc<str> = "team-b".into();
        let first = limits.tenant_connection(&team).unwrap();
        assert!(limits.tenant_connection(&team).is_none());
        assert!(limits.tenant_connection(&other).is_some());
        drop(first);
        assert!(limits.tenant_connection(&team).is_some());
        assert!(
            limits.tenants.lock().unwrap().is_empty(),
            "no empty entries kept"
        );

        let held = limits.held().unwrap();
        assert!(limits.held().is_none());
        drop(held);
        assert!(limits.held().is_some());
    }
}
