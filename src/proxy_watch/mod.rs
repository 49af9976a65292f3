//! Operator mode's one watch of Proxies, shared by the reconciler and the inventory.
//!
//! The API server can hold a Proxy this operator cannot decode: one stored before the CRD
//! validated a field (`healthCheck.interval: "30"` under a CRD that only said `string`). A
//! typed watch decodes a whole list at once, so that one object fails every list: nothing is
//! reconciled or served and `/readyz` never turns ready. This watch lists raw objects and
//! decodes each one alone ([`skip`]); an undecodable Proxy is left out — named in a warning log
//! line, a Warning Event on it (reason [`REASON_INVALID_SPEC`]) and the
//! [`UNDECODABLE_METRIC`] gauge — and every other Proxy carries on.
//!
//! Decoded Proxies go into one reflector store. The inventory (health engine, lease API) is
//! rebuilt from it at most once per [`INVENTORY_BATCH`], sharing the store's `Arc`s; the
//! reconciler reads the same store and is triggered with the same `Arc`s.

pub mod skip;

use std::sync::Arc;
use std::time::Duration;

use futures::{Stream, StreamExt};
use kube::api::{ApiResource, DynamicObject};
use kube::runtime::events::{Event, EventType, Recorder};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use prometheus::{IntGauge, Registry};
use tokio::sync::{broadcast, mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

pub use skip::{DecodeError, SkipList, StoreChange, Triage, Undecodable, decode};

use crate::inventory::Inventory;
use crate::resources::proxy::Proxy;

/// Longest a change waits before the inventory is rebuilt: a burst of N events costs one
/// rebuild per batch instead of N.
pub const INVENTORY_BATCH: Duration = Duration::from_millis(100);

/// Reconcile triggers buffered for the reconciler before the watch waits for it.
const TRIGGER_BUFFER: usize = 1024;

/// Deletions buffered for the reconciler; beyond that one is left to its sweep.
const DELETED_BUFFER: usize = 1024;

/// Reports buffered for the Event publisher; beyond that a report is only logged.
pub const REPORT_BUFFER: usize = 256;

/// Reason of the Warning Event on a Proxy the operator cannot decode.
pub const REASON_INVALID_SPEC: &str = "InvalidSpec";

/// Action of that Event.
pub const ACTION_DECODE: &str = "Decode";

/// Gauge of the Proxies skipped because they do not decode.
pub const UNDECODABLE_METRIC: &str = "proxy_operator_proxies_undecodable";

/// The Proxy resource, for the raw (untyped) list and watch: same URL, same RBAC as a typed one.
pub fn api_resource() -> ApiResource {
    ApiResource::erase::<Proxy>(&())
}

/// The raw watch of Proxies in `namespace` (or all namespaces), retried with backoff.
pub fn raw_watch(
    client: Client,
    namespace: Option<&str>,
) -> impl Stream<Item = watcher::Result<watcher::Event<DynamicObject>>> + Send + 'static {
    let resource = api_resource();
    let api: Api<DynamicObject> = match namespace {
        Some(ns) => Api::namespaced_with(client, ns, &resource),
        None => Api::all_with(client, &resource),
    };
    watcher(api, watcher::Config::default()).default_backoff()
}

/// The watch's metrics.
#[derive(Clone, Debug)]
pub struct WatchMetrics {
    undecodable: IntGauge,
}

impl WatchMetrics {
    /// Creates the gauge and registers it in `registry`.
    pub fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let undecodable = IntGauge::new(
            UNDECODABLE_METRIC,
            "Proxies the operator cannot decode and skips (see their InvalidSpec Warning Events).",
        )?;
        registry.register(Box::new(undecodable.clone()))?;
        Ok(WatchMetrics { undecodable })
    }

    fn set_undecodable(&self, count: usize) {
        self.undecodable
            .set(i64::try_from(count).unwrap_or(i64::MAX));
    }
}

/// What the reconciler runs from: the shared store and a trigger per applied Proxy.
pub struct ReconcilerFeed {
    /// Decoded Proxies, the same store the inventory is rebuilt from.
    pub store: Store<Proxy>,
    /// Every Proxy applied to the store (each one once after every complete list).
    pub triggers: mpsc::Receiver<Arc<Proxy>>,
    /// The UID of every Proxy the API server deleted, as the watch reports it (a full buffer
    /// drops some: the reconciler's sweep finds those).
    pub deleted: mpsc::Receiver<String>,
}

/// Changes buffered per [`ProxyWatch::subscribe`]r; a slower one misses the oldest (the pool
/// controller, the one subscriber, also looks again on a timer).
const CHANGE_BUFFER: usize = 1024;

/// The writing side of the watch, run by [`run`].
pub struct ProxyWatch {
    writer: reflector::store::Writer<Proxy>,
    store: Store<Proxy>,
    triggers: mpsc::Sender<Arc<Proxy>>,
    changes: broadcast::Sender<Arc<Proxy>>,
    deleted: mpsc::Sender<String>,
}

impl ProxyWatch {
    /// Every Proxy applied or deleted after the first complete list, for a reader besides the
    /// reconciler (the pool controller recounts a pool when one of its members changes).
    pub fn subscribe(&self) -> broadcast::Receiver<Arc<Proxy>> {
        self.changes.subscribe()
    }
}

/// Creates the shared store: the watch side for [`run`], the reading side for the reconciler.
pub fn shared_store() -> (ProxyWatch, ReconcilerFeed) {
    let (store, writer) = reflector::store();
    let (triggers, receiver) = mpsc::channel(TRIGGER_BUFFER);
    let (deleted, deletions) = mpsc::channel(DELETED_BUFFER);
    (
        ProxyWatch {
            writer,
            store: store.clone(),
            triggers,
            changes: broadcast::channel(CHANGE_BUFFER).0,
            deleted,
        },
        ReconcilerFeed {
            store,
            triggers: receiver,
            deleted: deletions,
        },
    )
}

/// Runs the watch until `shutdown`: decodes each raw event, keeps the store, rebuilds
/// `inventory` (synced once the first complete list is in), triggers the reconciler, tells it
/// of deletions, counts and reports undecodable Proxies. Returns an error if the watch stream
/// ends.
pub async fn run(
    watch: ProxyWatch,
    raw: impl Stream<Item = watcher::Result<watcher::Event<DynamicObject>>> + Send + 'static,
    inventory: Inventory,
    metrics: WatchMetrics,
    reports: mpsc::Sender<Undecodable>,
    shutdown: CancellationToken,
) -> Result<(), String> {
    let ProxyWatch {
        writer,
        store,
        triggers,
        changes,
        deleted,
    } = watch;
    let decoded = decoded(raw, store.clone(), metrics, reports, deleted);
    let mut events = std::pin::pin!(reflector::reflector(writer, decoded));
    let mut listed = false;
    let mut rebuild_at: Option<Instant> = None;
    loop {
        let due = async {
            match rebuild_at {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        let event = tokio::select! {
            () = shutdown.cancelled() => return Ok(()),
            () = due => {
                rebuild_at = None;
                inventory.replace_shared(store.state());
                continue;
            }
            event = events.next() => event,
        };
        match event {
            None => return Err("the Proxy watch ended".into()),
            Some(Err(e)) => log::warn!("Proxy watch: {e} (retrying)"),
            Some(Ok(watcher::Event::InitDone)) => {
                listed = true;
                rebuild_at = None;
                let proxies = store.state();
                inventory.replace_shared(proxies.iter().cloned());
                for proxy in proxies {
                    trigger(&triggers, proxy).await;
                }
            }
            Some(Ok(watcher::Event::Apply(proxy))) if listed => {
                rebuild_at.get_or_insert_with(|| Instant::now() + INVENTORY_BATCH);
                if let Some(stored) = store.get(&ObjectRef::from_obj(&proxy)) {
                    // No subscriber is not an error.
                    let _ = changes.send(stored.clone());
                    trigger(&triggers, stored).await;
                }
            }
            Some(Ok(watcher::Event::Delete(proxy))) if listed => {
                rebuild_at.get_or_insert_with(|| Instant::now() + INVENTORY_BATCH);
                let _ = changes.send(Arc::new(proxy));
            }
            Some(Ok(_)) => {}
        }
    }
}

/// Hands a Proxy to the reconciler. A closed channel means the reconciler has stopped, which
/// the supervisor handles.
async fn trigger(triggers: &mpsc::Sender<Arc<Proxy>>, proxy: Arc<Proxy>) {
    if triggers.send(proxy).await.is_err() {
        log::debug!("Proxy watch: the reconciler is not taking triggers");
    }
}

/// The raw events decoded one object at a time: undecodable objects are skipped (evicting an
/// earlier good version from `store`), counted and reported; the UIDs of deleted Proxies go to
/// `deleted`.
fn decoded(
    raw: impl Stream<Item = watcher::Result<watcher::Event<DynamicObject>>> + Send + 'static,
    store: Store<Proxy>,
    metrics: WatchMetrics,
    reports: mpsc::Sender<Undecodable>,
    deleted: mpsc::Sender<String>,
) -> impl Stream<Item = watcher::Result<watcher::Event<Proxy>>> + Send + 'static {
    let mut skipped = SkipList::default();
    raw.filter_map(move |item| {
        let out = match item {
            Err(e) => Some(Err(e)),
            Ok(event) => {
                let triage = skipped.triage(event);
                metrics.set_undecodable(skipped.len());
                if let Some(key) = &triage.recovered {
                    log::info!("Proxy {key} decodes again; no longer skipped");
                }
                if let Some(report) = triage.report {
                    log::warn!("{}", log_line(&report));
                    if reports.try_send(report).is_err() {
                        log::debug!("Proxy watch: the Event publisher is behind; Event dropped");
                    }
                }
                if let Some(uid) = triage.deleted
                    && deleted.try_send(uid).is_err()
                {
                    log::debug!("Proxy watch: the reconciler is behind on deletions; one dropped");
                }
                match triage.change {
                    StoreChange::Forward(event) => Some(Ok(*event)),
                    StoreChange::Evict(key) => store
                        .get(&key)
                        .map(|last| Ok(watcher::Event::Delete(Proxy::clone(&last)))),
                    StoreChange::None => None,
                }
            }
        };
        std::future::ready(out)
    })
}

/// The warning logged for an undecodable Proxy.
pub fn log_line(report: &Undecodable) -> String {
    format!(
        "Proxy {} (resourceVersion {}) cannot be decoded; skipping it until it is fixed: {}",
        report.key,
        report.reference.resource_version.as_deref().unwrap_or("?"),
        report.error
    )
}

/// The Warning Event put on an undecodable Proxy.
pub fn warning_event(report: &Undecodable) -> Event {
    let note = format!(
        "proxy-operator cannot read this Proxy and skips it until it is fixed: {}. Until then it \
         gets no health checks, leases or reconciles; its machine, if any, is kept. The API \
         server validates every field on each update (no validation ratcheting), so fix this \
         first: other edits to the object are refused while it is invalid.",
        report.error
    );
    crate::events::event(EventType::Warning, REASON_INVALID_SPEC, ACTION_DECODE, note)
}

/// Publishes a Warning Event for each report while this process holds the leader Lease, until
/// `shutdown`. A failed publish is logged; the log line already named the Proxy.
pub async fn publish_reports(
    recorder: Recorder,
    mut reports: mpsc::Receiver<Undecodable>,
    mut leader: watch::Receiver<bool>,
    shutdown: CancellationToken,
) -> Result<(), String> {
    loop {
        // Events come from the Lease holder only, as the reconciler's do: a follower's reports
        // wait in the channel (the watch drops what does not fit) until it holds the Lease.
        let report = tokio::select! {
            () = shutdown.cancelled() => return Ok(()),
            report = async {
                if crate::leader::until_leader(&mut leader).await {
                    reports.recv().await
                } else {
                    None
                }
            } => report,
        };
        let Some(report) = report else {
            shutdown.cancelled().await;
            return Ok(());
        };
        if let Err(e) = recorder
            .publish(&warning_event(&report), &report.reference)
            .await
        {
            log::warn!(
                "cannot publish the {REASON_INVALID_SPEC} Event for Proxy {}: {e}",
                report.key
            );
        }
    }
}

#[cfg(test)]
mod tests;
