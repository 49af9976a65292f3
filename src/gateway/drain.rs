//! The drain sweep: the gateway gives back the leases it holds on a draining or deleted proxy
//! and closes its idle upstream connections, so a drain does not wait for keep-alive.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::choice::Gateway;
use super::connection::ClientConnection;
use crate::resources::proxy::ProxyId;

/// How often the drain sweep runs besides on every inventory change (a lease in use when a
/// drain began is given back once its last request ends).
const DRAIN_SWEEP: Duration = Duration::from_secs(1);

/// The client connections being served, for the drain sweep.
#[derive(Default)]
pub struct Connections {
    connections: Mutex<HashMap<u64, Weak<ClientConnection>>>,
    next: AtomicU64,
}

impl Connections {
    /// Adds a client connection; its number takes it out again.
    pub fn add(&self, connection: &Arc<ClientConnection>) -> u64 {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.lock().insert(id, Arc::downgrade(connection));
        id
    }

    /// Takes a client connection out.
    pub fn remove(&self, id: u64) {
        self.lock().remove(&id);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Weak<ClientConnection>>> {
        self.connections
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn live(&self) -> Vec<Arc<ClientConnection>> {
        self.lock().values().filter_map(Weak::upgrade).collect()
    }
}

/// On every inventory change (and every [`DRAIN_SWEEP`]) until `shutdown`: gives back the
/// unused leases the gateway holds on draining or deleted proxies, sessions' included, and
/// closes their idle upstream connections.
pub(super) async fn close_on_drain(
    gateway: Arc<Gateway>,
    connections: Arc<Connections>,
    shutdown: CancellationToken,
) {
    let mut changes = gateway.fleet.inventory.subscribe();
    let mut ticker = tokio::time::interval(DRAIN_SWEEP);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            changed = changes.changed() => if changed.is_err() { return },
            _ = ticker.tick() => {}
        }
        let snapshot = gateway.fleet.inventory.snapshot();
        let gone =
            |proxy: &ProxyId| snapshot.position(proxy).is_none() || snapshot.is_draining(proxy);
        for (lease_id, tenant) in gateway.fleet.sessions.release_where(gone) {
            gateway.give_back(&lease_id, &tenant).await;
        }
        for connection in connections.live() {
            connection.let_go_of(gone).await;
        }
    }
}
