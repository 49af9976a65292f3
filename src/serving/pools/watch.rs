//! Every replica's one watch of ProxyPools: it keeps the store the leader's pool controller
//! reconciles from, and the [`PoolDirectory`] the API and the gateway read (they hold requests
//! for waking pools on followers too).
//!
//! Objects are listed raw and decoded one by one, so one pool that does not decode (written
//! under an older CRD) is skipped and named in a warning instead of failing every list.

use std::sync::Arc;

use futures::{Stream, StreamExt};
use kube::api::{ApiResource, DynamicObject};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::directory::PoolDirectory;
use crate::resources::pool::ProxyPool;

/// Pool triggers buffered for the controller before the watch waits for it.
const TRIGGER_BUFFER: usize = 256;

/// The reading side: the store and a trigger per applied pool (each once after every list).
pub struct PoolFeed {
    /// Decoded pools.
    pub store: Store<ProxyPool>,
    /// Every pool applied to the store.
    pub triggers: mpsc::Receiver<Arc<ProxyPool>>,
}

/// The writing side, run by [`run`].
pub struct PoolWatch {
    writer: reflector::store::Writer<ProxyPool>,
    store: Store<ProxyPool>,
    triggers: mpsc::Sender<Arc<ProxyPool>>,
}

/// Creates the shared store.
pub fn shared_store() -> (PoolWatch, PoolFeed) {
    let (store, writer) = reflector::store();
    let (triggers, receiver) = mpsc::channel(TRIGGER_BUFFER);
    (
        PoolWatch {
            writer,
            store: store.clone(),
            triggers,
        },
        PoolFeed {
            store,
            triggers: receiver,
        },
    )
}

/// The raw watch of ProxyPools in `namespace` (or all), retried with backoff.
pub fn raw_watch(
    client: Client,
    namespace: Option<&str>,
) -> impl Stream<Item = watcher::Result<watcher::Event<DynamicObject>>> + Send + 'static {
    let resource = ApiResource::erase::<ProxyPool>(&());
    let api: Api<DynamicObject> = match namespace {
        Some(ns) => Api::namespaced_with(client, ns, &resource),
        None => Api::all_with(client, &resource),
    };
    watcher(api, watcher::Config::default()).default_backoff()
}

/// Runs the watch until `shutdown`: keeps the store, rebuilds `directory` on every change and
/// triggers the controller. Returns an error if the watch stream ends.
pub async fn run(
    watch: PoolWatch,
    raw: impl Stream<Item = watcher::Result<watcher::Event<DynamicObject>>> + Send + 'static,
    directory: PoolDirectory,
    shutdown: CancellationToken,
) -> Result<(), String> {
    let PoolWatch {
        writer,
        store,
        triggers,
    } = watch;
    let decoded = raw.filter_map(|event| std::future::ready(decode(event)));
    let mut events = std::pin::pin!(reflector::reflector(writer, decoded));
    let mut listed = false;
    loop {
        let event = tokio::select! {
            () = shutdown.cancelled() => return Ok(()),
            event = events.next() => event,
        };
        match event {
            None => return Err("the ProxyPool watch ended".into()),
            Some(Err(e)) => log::warn!("ProxyPool watch: {e} (retrying)"),
            Some(Ok(watcher::Event::InitDone)) => {
                listed = true;
                let pools = store.state();
                directory.replace(pools.iter().map(AsRef::as_ref));
                for pool in pools {
                    // A closed channel: the controller stopped, which the supervisor sees.
                    let _ = triggers.send(pool).await;
                }
            }
            Some(Ok(watcher::Event::Apply(pool))) if listed => {
                directory.replace(store.state().iter().map(AsRef::as_ref));
                if let Some(stored) = store.get(&reflector::ObjectRef::from_obj(&pool)) {
                    let _ = triggers.send(stored).await;
                }
            }
            Some(Ok(watcher::Event::Delete(_))) if listed => {
                directory.replace(store.state().iter().map(AsRef::as_ref));
            }
            Some(Ok(_)) => {}
        }
    }
}

/// One raw event decoded; an object that does not decode is logged and left out.
fn decode(
    event: watcher::Result<watcher::Event<DynamicObject>>,
) -> Option<watcher::Result<watcher::Event<ProxyPool>>> {
    let one = |object: DynamicObject| -> Option<ProxyPool> {
        let key = format!(
            "{}/{}",
            object.namespace().unwrap_or_default(),
            object.name_any()
        );
        let value = serde_json::to_value(object).ok()?;
        match serde_json::from_value(value) {
            Ok(pool) => Some(pool),
            Err(e) => {
                log::warn!("ProxyPool {key} cannot be decoded; skipping it until it is fixed: {e}");
                None
            }
        }
    };
    Some(match event {
        Err(e) => Err(e),
        Ok(watcher::Event::Apply(o)) => Ok(watcher::Event::Apply(one(o)?)),
        Ok(watcher::Event::Delete(o)) => Ok(watcher::Event::Delete(one(o)?)),
        Ok(watcher::Event::InitApply(o)) => Ok(watcher::Event::InitApply(one(o)?)),
        Ok(watcher::Event::Init) => Ok(watcher::Event::Init),
        Ok(watcher::Event::InitDone) => Ok(watcher::Event::InitDone),
    })
}
