//! The reconciler: the only writer of Proxy status, and the only caller of providers'
//! `create`/`delete` for live Proxies.
//!
//! Data flows one way: the object and the provider's answer go into the pure [`decide`], the
//! chosen [`Action`] is executed by [`apply`], and the status is built by the pure [`status`]
//! functions and written at most once per reconcile.

pub mod apply;
pub mod decide;
pub mod phase;
pub mod status;

use std::collections::HashMap;
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::Secret;
use kube::runtime::controller::{self, Controller};
use kube::runtime::events::Recorder;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use kube::{Api, Client, ResourceExt};
use tokio::sync::mpsc;

pub use apply::reconcile;
pub use decide::{Action, Inputs, Observation, decide, on_provider_error};
pub use phase::{Provisioning, compute_phase};
pub use status::HealthSignal;

use crate::provider::Provider;
use crate::proxy::{CLOUD_INIT_SECRET_LABEL, Proxy, ProxyId};

/// Annotation written before a provider `create` and cleared once the machine's ID is recorded.
/// Its value is the spec hash the create was started with.
pub const CREATE_PENDING_ANNOTATION: &str = "crawl.example.com/create-pending";

/// How often the reconciler looks again, per situation. Configuration so tests can shrink them.
#[derive(Debug, Clone, PartialEq)]
pub struct ReconcilerConfig {
    /// While a machine is being created.
    pub provisioning_poll: Duration,
    /// While a machine runs (catches machines that die or vanish).
    pub drift_poll: Duration,
    /// While a machine is being deleted (replacement or Proxy deletion).
    pub deletion_poll: Duration,
    /// After the provider refused for quota.
    pub quota_requeue: Duration,
    /// After a transient failure.
    pub error_requeue: Duration,
    /// Most reconciles running at once.
    pub concurrency: u16,
}

impl Default for ReconcilerConfig {
    fn default() -> Self {
        ReconcilerConfig {
            provisioning_poll: Duration::from_secs(10),
            drift_poll: Duration::from_secs(300),
            deletion_poll: Duration::from_secs(5),
            quota_requeue: Duration::from_secs(300),
            error_requeue: Duration::from_secs(15),
            concurrency: 16,
        }
    }
}

/// Source of "now" for condition transition times; injected so tests are deterministic.
pub type Clock = fn() -> jiff::Timestamp;

/// The last health transition per proxy, fed by the health engine and read by reconciles.
#[derive(Debug, Clone, Default)]
pub struct HealthStates {
    inner: Arc<RwLock<HashMap<ProxyId, HealthSignal>>>,
}

impl HealthStates {
    /// Records a transition.
    pub fn record(&self, id: ProxyId, signal: HealthSignal) {
        self.inner
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(id, signal);
    }

    /// The last transition of a proxy.
    pub fn get(&self, id: &ProxyId) -> Option<HealthSignal> {
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
}

/// Everything a reconcile needs; one per process, shared by every reconcile.
pub struct Context {
    /// Kubernetes client.
    pub client: Client,
    /// Providers by their config name.
    pub providers: HashMap<String, Arc<dyn Provider>>,
    /// Value of the install label put on every machine.
    pub install: String,
    /// Poll intervals.
    pub config: ReconcilerConfig,
    /// Last health transitions.
    pub health: HealthStates,
    /// Publishes Kubernetes Events.
    pub recorder: Recorder,
    /// Current time.
    pub clock: Clock,
}

/// Why a reconcile failed; the controller retries after [`ReconcilerConfig::error_requeue`].
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A Kubernetes API call failed.
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    /// A provider call failed transiently (or answered nothing usable).
    #[error("provider: {0}")]
    Provider(String),
    /// The object lacks a field the API server always sets.
    #[error("object has no {0}")]
    MissingField(&'static str),
}

impl Error {
    /// Short label for metrics and logs.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::Kube(_) => "kube",
            Error::Provider(_) => "provider",
            Error::MissingField(_) => "missing_field",
        }
    }
}

/// The Proxies in `namespace` whose cloud-init comes from the Secret `name`: the objects to
/// reconcile again when that Secret changes.
pub fn proxies_using_secret<'a>(
    proxies: impl IntoIterator<Item = &'a Proxy>,
    namespace: &str,
    name: &str,
) -> Vec<ObjectRef<Proxy>> {
    proxies
        .into_iter()
        .filter(|p| p.namespace().as_deref() == Some(namespace))
        .filter(|p| {
            p.spec
                .cloud_init
                .as_ref()
                .and_then(|c| c.secret_ref.as_ref())
                .is_some_and(|r| r.name == name)
        })
        .map(ObjectRef::from_obj)
        .collect()
}

/// Turns the health engine's transitions into reconcile triggers, recording each in `states`
/// first so the reconcile it causes sees it.
pub fn health_triggers(
    transitions: mpsc::Receiver<(ProxyId, HealthSignal)>,
    states: HealthStates,
) -> impl Stream<Item = ObjectRef<Proxy>> + Send + 'static {
    futures::stream::unfold(transitions, |mut rx| async move {
        let (id, signal) = rx.recv().await?;
        Some(((id, signal), rx))
    })
    .map(move |(id, signal)| {
        let object = ObjectRef::new(&id.name).within(&id.namespace);
        states.record(id, signal);
        object
    })
}

/// What to do after a failed reconcile: log it and retry later.
fn error_policy(proxy: Arc<Proxy>, error: &Error, ctx: Arc<Context>) -> controller::Action {
    log::warn!(
        "reconcile of Proxy {} failed ({}): {error}",
        proxy.key(),
        error.metric_label()
    );
    controller::Action::requeue(ctx.config.error_requeue)
}

/// Runs the Proxy controller until the trigger streams end: reconciles the Proxies in `store`
/// (kept by the one Proxy watch, `proxy_watch`, which also yields `proxies`, each Proxy it
/// stores), re-triggers on cloud-init Secrets (in `namespace`, or in all namespaces) and on
/// `health` transitions, at most [`ReconcilerConfig::concurrency`] at once. A Proxy that is
/// not in the store (deleted, or skipped as undecodable) is never reconciled.
pub async fn run_controller(
    ctx: Arc<Context>,
    store: Store<Proxy>,
    proxies: impl Stream<Item = Arc<Proxy>> + Send + 'static,
    namespace: Option<&str>,
    health: impl Stream<Item = ObjectRef<Proxy>> + Send + 'static,
) {
    let secrets: Api<Secret> = match namespace {
        Some(ns) => Api::namespaced(ctx.client.clone(), ns),
        None => Api::all(ctx.client.clone()),
    };
    let controller = Controller::for_shared_stream(proxies, store.clone())
        .with_config(controller::Config::default().concurrency(ctx.config.concurrency));
    let secret_selector =
        watcher::Config::default().labels(&format!("{CLOUD_INIT_SECRET_LABEL}=true"));
    controller
        .watches(secrets, secret_selector, move |secret: Secret| {
            let namespace = secret.namespace().unwrap_or_default();
            let name = secret.name_any();
            let state = store.state();
            proxies_using_secret(state.iter().map(|p| p.as_ref()), &namespace, &name)
        })
        .reconcile_on(health)
        .run(reconcile, error_policy, ctx)
        .for_each(|result| async move {
            match result {
                Ok((object, _)) => log::debug!("reconciled Proxy {object}"),
                Err(e) => log::debug!("reconcile error: {e}"),
            }
        })
        .await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::ProxySpec;

    fn proxy(ns: &str, name: &str, secret: Option<&str>) -> Proxy {
        let mut spec = serde_json::json!({"mode": "Managed", "provider": "local"});
        if let Some(secret) = secret {
            spec["cloudInit"] =
                serde_json::json!({"secretRef": {"name": secret, "key": "user-data"}});
        }
        let spec: ProxySpec = serde_json::from_value(spec).unwrap();
        let mut p = Proxy::new(name, spec);
        p.metadata.namespace = Some(ns.into());
        p
    }

    #[test]
    fn secret_changes_map_to_the_proxies_that_use_them() {
        let proxies = [
            proxy("a", "uses", Some("ci")),
            proxy("a", "other-secret", Some("ci2")),
            proxy("b", "other-namespace", Some("ci")),
            proxy("a", "inline", None),
            proxy("a", "uses-too", Some("ci")),
        ];
        let refs = proxies_using_secret(&proxies, "a", "ci");
        let names: Vec<&str> = refs.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, ["uses", "uses-too"]);
        assert!(refs.iter().all(|r| r.namespace.as_deref() == Some("a")));
        assert!(proxies_using_secret(&proxies, "c", "ci").is_empty());
    }

    #[tokio::test]
    async fn health_transitions_are_recorded_then_trigger() {
        let (tx, rx) = mpsc::channel(4);
        let states = HealthStates::default();
        let mut triggers = Box::pin(health_triggers(rx, states.clone()));
        let id = ProxyId {
            namespace: "crawl".into(),
            name: "p1".into(),
            uid: "u1".into(),
        };
        let signal = HealthSignal {
            healthy: false,
            latency: Duration::from_millis(5),
            at: jiff::Timestamp::UNIX_EPOCH,
            message: "refused".into(),
        };
        tx.send((id.clone(), signal.clone())).await.unwrap();
        drop(tx);
        let object = triggers.next().await.unwrap();
        assert_eq!(object.name, "p1");
        assert_eq!(object.namespace.as_deref(), Some("crawl"));
        assert_eq!(states.get(&id), Some(signal));
        assert!(triggers.next().await.is_none(), "ends with the channel");
        states.forget(&id);
        assert_eq!(states.get(&id), None);
    }
}
