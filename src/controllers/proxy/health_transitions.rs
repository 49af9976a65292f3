//! What the reconciler knows of health and exits: the last transition the health engine, and
//! the last exit report the exit checker, pushed per proxy, recorded before the reconcile it
//! triggers runs, so that reconcile writes it.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, PoisonError, RwLock};

use futures::{Stream, StreamExt};
use kube::runtime::reflector::ObjectRef;
use tokio::sync::mpsc;

use crate::health::HealthTransition;
use crate::health::exits::ExitReport;
use crate::resources::proxy::{Proxy, ProxyId};

/// Something pushed to the reconciler about one proxy.
pub trait ProxyReport: Clone + Send + Sync + 'static {
    /// The proxy it is about.
    fn proxy(&self) -> &ProxyId;
}

impl ProxyReport for HealthTransition {
    fn proxy(&self) -> &ProxyId {
        &self.id
    }
}

impl ProxyReport for ExitReport {
    fn proxy(&self) -> &ProxyId {
        &self.id
    }
}

/// The last report of each proxy, fed by the health engine or the exit checker and read by
/// reconciles.
#[derive(Debug, Clone)]
pub struct LastReports<T> {
    inner: Arc<RwLock<HashMap<ProxyId, T>>>,
}

impl<T> Default for LastReports<T> {
    fn default() -> Self {
        LastReports {
            inner: Arc::default(),
        }
    }
}

/// The last health transition per proxy.
pub type HealthStates = LastReports<HealthTransition>;
/// The last exit report per proxy.
pub type ExitStates = LastReports<ExitReport>;

impl<T: ProxyReport> LastReports<T> {
    /// Records a report.
    pub fn record(&self, report: T) {
        self.inner
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(report.proxy().clone(), report);
    }

    /// The last report of a proxy.
    pub fn get(&self, id: &ProxyId) -> Option<T> {
        self.inner
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(id)
            .cloned()
    }

    /// Drops a proxy that is gone.
    pub fn forget(&self, id: &ProxyId) {
        self.inner
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(id);
    }

    /// Drops every proxy whose UID is not in `live` (External proxies have no finalizer, so
    /// nothing else notices they are gone).
    pub fn retain(&self, live: &HashSet<&str>) {
        self.inner
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|id, _| live.contains(id.uid.as_str()));
    }

    /// How many proxies have a recorded transition.
    pub fn len(&self) -> usize {
        self.inner
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// Whether no proxy has a recorded transition.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Turns the health engine's transitions (or the exit checker's reports) into reconcile
/// triggers, recording each in `states` first so the reconcile it causes sees it.
pub fn health_triggers<T: ProxyReport>(
    mut transitions: mpsc::Receiver<T>,
    states: LastReports<T>,
) -> impl Stream<Item = ObjectRef<Proxy>> + Send + 'static {
    futures::stream::poll_fn(move |cx| transitions.poll_recv(cx)).map(move |transition| {
        let id = transition.proxy();
        let object = ObjectRef::new(&id.name).within(&id.namespace);
        states.record(transition);
        object
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn transition(uid: &str, healthy: bool) -> HealthTransition {
        HealthTransition {
            id: ProxyId {
                namespace: "crawl".into(),
                name: format!("p-{uid}"),
                uid: uid.into(),
            },
            healthy,
            latency: Duration::from_millis(1),
            at: jiff::Timestamp::UNIX_EPOCH,
            message: if healthy { "204" } else { "refused" }.into(),
            proxy_url: "http://10.0.0.1:3128".into(),
        }
    }

    #[test]
    fn health_of_deleted_proxies_is_dropped() {
        let states = HealthStates::default();
        let live = transition("live", true);
        let deleted = transition("external-deleted", true);
        states.record(deleted.clone());
        states.record(live.clone());
        states.retain(&HashSet::from(["live"]));
        assert_eq!(states.len(), 1);
        assert_eq!(states.get(&live.id), Some(live));
        assert_eq!(states.get(&deleted.id), None);
    }

    #[tokio::test]
    async fn health_transitions_are_recorded_then_trigger() {
        let (tx, rx) = mpsc::channel(4);
        let states = HealthStates::default();
        let mut triggers = Box::pin(health_triggers(rx, states.clone()));
        let transition = transition("u1", false);
        tx.send(transition.clone()).await.unwrap();
        drop(tx);
        let object = triggers.next().await.unwrap();
        assert_eq!(object.name, "p-u1");
        assert_eq!(object.namespace.as_deref(), Some("crawl"));
        assert_eq!(states.get(&transition.id), Some(transition.clone()));
        assert!(triggers.next().await.is_none(), "ends with the channel");
        states.forget(&transition.id);
        assert_eq!(states.get(&transition.id), None);
    }
}
