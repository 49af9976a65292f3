//! The controller around the reconciler: what every reconcile shares ([`Context`]), one
//! reconcile from start to end ([`reconcile`]: gather, decide, execute, write), its errors and
//! their backoff, and the trigger streams that start reconciles (the Proxy store, cloud-init
//! Secrets, managed Pods, health transitions).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::runtime::controller::{self, Controller};
use kube::runtime::events::Recorder;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use kube::{Api, Client, ResourceExt};

use super::budget::{self, Share};
use super::decide::decide;
use super::execute::{self, Outcome};
use super::health::HealthStates;
use super::metrics::ReconcilerMetrics;
use super::observe::{self, Gathered};
use super::pacing::Pacing;
use super::write;
use crate::ledger::Ledger;
use crate::provider::{INSTALL_LABEL, Provider};
use crate::proxy::{
    CLOUD_INIT_SECRET_LABEL, MANAGED_LABEL, PROXY_ANNOTATION, PROXY_UID_LABEL, Proxy,
};

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
    /// First wait after a failure; doubles per failure in a row up to `error_requeue_max`.
    pub error_requeue: Duration,
    /// Longest wait after failures in a row.
    pub error_requeue_max: Duration,
    /// How long a machine may take to run before it is replaced.
    pub startup_timeout: Duration,
    /// How long past its deletion deadline a machine is left before it is force-deleted.
    pub force_delete_margin: Duration,
    /// How often a permanent provider refusal is tried again.
    pub permanent_failure_retry: Duration,
    /// Longest drain before a machine is deleted anyway.
    pub drain_timeout: Duration,
    /// Most voluntary replacements under way at once.
    pub replacement_budget: Share,
    /// How long a proxy may fail health checks before its machine is replaced.
    pub remediate_after: Duration,
    /// Above this share of a provider's proxies unhealthy, none is remediated.
    pub max_unhealthy: Share,
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
            error_requeue: Duration::from_secs(5),
            error_requeue_max: Duration::from_secs(300),
            startup_timeout: Duration::from_secs(600),
            force_delete_margin: Duration::from_secs(30),
            permanent_failure_retry: Duration::from_secs(1800),
            drain_timeout: Duration::from_secs(900),
            replacement_budget: Share::Percent(10),
            remediate_after: Duration::from_secs(600),
            max_unhealthy: Share::Percent(40),
            concurrency: 16,
        }
    }
}

/// Source of "now" for condition transition times; injected so tests are deterministic.
pub type Clock = fn() -> jiff::Timestamp;

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
    /// Retry memory: failures in a row and holds on creates.
    pub pacing: Pacing,
    /// The lease ledger, to end the leases of machines that are gone.
    pub ledger: Arc<dyn Ledger>,
    /// Publishes Kubernetes Events.
    pub recorder: Recorder,
    /// Current time.
    pub clock: Clock,
    /// Replacement budget slots granted by this process and not yet visible in the store.
    pub grants: budget::Grants,
    /// Every Proxy, as the controller's store has them: set once the store has its first
    /// complete list, so the replacement budget never counts from a partial one.
    pub fleet: OnceLock<Store<Proxy>>,
    /// Reconcile timings, errors and actions; drains and their timeouts.
    pub metrics: ReconcilerMetrics,
}

impl Context {
    /// A context with empty health and retry memory, publishing Events as `proxy-operator`,
    /// on the system clock.
    pub fn new(
        client: Client,
        providers: HashMap<String, Arc<dyn Provider>>,
        install: String,
        config: ReconcilerConfig,
        ledger: Arc<dyn Ledger>,
        metrics: ReconcilerMetrics,
    ) -> Self {
        Context {
            recorder: Recorder::new(client.clone(), "proxy-operator".into()),
            client,
            providers,
            install,
            config,
            health: HealthStates::default(),
            pacing: Pacing::default(),
            ledger,
            clock: jiff::Timestamp::now,
            grants: budget::Grants::default(),
            fleet: OnceLock::new(),
            metrics,
        }
    }

    /// Every Proxy the controller knows now; `None` until the store has its first complete
    /// list.
    pub fn fleet(&self) -> Option<Vec<Arc<Proxy>>> {
        self.fleet.get().map(Store::state)
    }
}

/// One reconcile of one Proxy: gather what is known about it and its machine, [`decide`] the
/// one action, execute it, and write the result (at most one status write, guarded by the
/// resourceVersion, then the annotations, then an Event).
pub async fn reconcile(proxy: Arc<Proxy>, ctx: Arc<Context>) -> Result<controller::Action, Error> {
    let _timer = ctx.metrics.reconcile_timer();
    let namespace = proxy
        .namespace()
        .ok_or(Error::MissingField("metadata.namespace"))?;
    let api: Api<Proxy> = Api::namespaced(ctx.client.clone(), &namespace);
    let current = proxy.status.clone().unwrap_or_default();
    let step = match observe::gather(&proxy, &current, &ctx).await? {
        Gathered::UnknownProvider => execute::unknown_provider(&proxy.spec, &ctx),
        Gathered::Facts(facts) => {
            let action = decide(&facts.inputs(&proxy, &current));
            log::debug!("Proxy {}: {action:?}", proxy.key());
            ctx.metrics.action_decided(action.label());
            execute::execute(action, &facts.machine(&proxy, &ctx), &current, &api).await?
        }
    };
    let uid = proxy.uid().unwrap_or_default();
    match step.outcome {
        Outcome::Progress => ctx.pacing.succeeded(&uid, false),
        Outcome::Running => ctx.pacing.succeeded(&uid, true),
        Outcome::Neutral => {}
    }
    write::write(&proxy, &current, step, &api, &ctx).await
}

/// Why a reconcile failed; the controller retries with exponential backoff from
/// [`ReconcilerConfig::error_requeue`].
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
    /// The machine's credentials cannot be made or read.
    #[error("machine credentials: {0}")]
    Credentials(String),
}

impl Error {
    /// Every [`Error::metric_label`].
    pub const KINDS: [&'static str; 4] = ["kube", "provider", "missing_field", "credentials"];

    /// Short label for metrics and logs.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::Kube(_) => "kube",
            Error::Provider(_) => "provider",
            Error::MissingField(_) => "missing_field",
            Error::Credentials(_) => "credentials",
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

/// The Proxy a managed Pod serves: named by the Pod's `crawl.example.com/proxy` annotation, or
/// found in `proxies` by the Pod's proxy-uid label (a Pod made before the annotation existed).
pub fn proxy_of_pod<'a>(
    pod: &Pod,
    proxies: impl IntoIterator<Item = &'a Proxy>,
) -> Option<ObjectRef<Proxy>> {
    let namespace = pod.namespace()?;
    if let Some(name) = pod.annotations().get(PROXY_ANNOTATION) {
        return Some(ObjectRef::new(name).within(&namespace));
    }
    let uid = pod.labels().get(PROXY_UID_LABEL)?;
    proxies
        .into_iter()
        .find(|p| p.uid().as_deref() == Some(uid) && p.namespace().as_deref() == Some(&namespace))
        .map(ObjectRef::from_obj)
}

/// What to do after a failed reconcile: log it and retry after a backoff that doubles with each
/// failure in a row.
fn error_policy(proxy: Arc<Proxy>, error: &Error, ctx: Arc<Context>) -> controller::Action {
    ctx.metrics.reconcile_failed(error.metric_label());
    let delay = ctx.pacing.failed(
        &proxy.uid().unwrap_or_default(),
        ctx.config.error_requeue,
        ctx.config.error_requeue_max,
    );
    log::warn!(
        "reconcile of Proxy {} failed ({}); retrying in {}: {error}",
        proxy.key(),
        error.metric_label(),
        humantime::format_duration(delay)
    );
    controller::Action::requeue(delay)
}

/// How often health and retry memory of deleted Proxies is dropped.
const FORGET_PERIOD: std::time::Duration = std::time::Duration::from_secs(60);

/// Once the store has its first list, publishes it as the fleet view (`Context::fleet`) and
/// then drops the health transitions, retry memory and budget grants of Proxies no longer in
/// it, every [`FORGET_PERIOD`].
async fn track_fleet(store: Store<Proxy>, ctx: Arc<Context>) {
    if store.wait_until_ready().await.is_err() {
        return;
    }
    if ctx.fleet.set(store.clone()).is_err() {
        log::warn!("the Proxy controller was started twice on one context");
    }
    let mut tick = tokio::time::interval(FORGET_PERIOD);
    loop {
        tick.tick().await;
        let state = store.state();
        let uids: Vec<String> = state.iter().filter_map(|p| p.uid()).collect();
        let live: HashSet<&str> = uids.iter().map(String::as_str).collect();
        ctx.health.retain(&live);
        ctx.pacing.retain(&live);
        ctx.grants.retain(&live);
    }
}

/// Runs the Proxy controller until the trigger streams end: reconciles the Proxies in `store`
/// (kept by the one Proxy watch, `proxy_watch`, which also yields `proxies`, each Proxy it
/// stores), re-triggers on cloud-init Secrets and on this install's machine Pods (in
/// `namespace`, or in all namespaces) and on `health` transitions, at most
/// [`ReconcilerConfig::concurrency`] at once. A Proxy that is not in the store (deleted, or
/// skipped as undecodable) is never reconciled.
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
    let pods: Api<Pod> = match namespace {
        Some(ns) => Api::namespaced(ctx.client.clone(), ns),
        None => Api::all(ctx.client.clone()),
    };
    let pod_selector = watcher::Config::default().labels(&format!(
        "{MANAGED_LABEL}=true,{INSTALL_LABEL}={}",
        ctx.install
    ));
    let pod_store = store.clone();
    let tracking = track_fleet(store.clone(), ctx.clone());
    let controller = Controller::for_shared_stream(proxies, store.clone())
        .with_config(controller::Config::default().concurrency(ctx.config.concurrency));
    let secret_selector =
        watcher::Config::default().labels(&format!("{CLOUD_INIT_SECRET_LABEL}=true"));
    let reconciling = controller
        .watches(secrets, secret_selector, move |secret: Secret| {
            let namespace = secret.namespace().unwrap_or_default();
            let name = secret.name_any();
            let state = store.state();
            proxies_using_secret(state.iter().map(|p| p.as_ref()), &namespace, &name)
        })
        .watches(pods, pod_selector, move |pod: Pod| {
            let state = pod_store.state();
            proxy_of_pod(&pod, state.iter().map(|p| p.as_ref()))
        })
        .reconcile_on(health)
        .run(reconcile, error_policy, ctx)
        .for_each(|result| async move {
            match result {
                Ok((object, _)) => log::debug!("reconciled Proxy {object}"),
                Err(e) => log::debug!("reconcile error: {e}"),
            }
        });
    tokio::select! {
        () = reconciling => {}
        () = tracking => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures;

    fn proxy(ns: &str, name: &str, secret: Option<&str>) -> Proxy {
        let mut proxy = fixtures::managed(name, "local").namespace(ns).uid(None);
        if let Some(secret) = secret {
            proxy = proxy.spec(
                "cloudInit",
                serde_json::json!({"secretRef": {"name": secret, "key": "user-data"}}),
            );
        }
        proxy.build()
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

    #[test]
    fn pods_map_to_the_proxy_they_serve() {
        let mut by_uid = proxy("crawl", "old-pod-owner", None);
        by_uid.metadata.uid = Some("u-old".into());
        let proxies = [proxy("crawl", "p1", None), by_uid];
        let pod = |annotations: serde_json::Value, uid: &str| -> Pod {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "proxy-x", "namespace": "crawl",
                             "annotations": annotations,
                             "labels": {PROXY_UID_LABEL: uid}},
            }))
            .unwrap()
        };
        let named = proxy_of_pod(
            &pod(serde_json::json!({PROXY_ANNOTATION: "p1"}), "u1"),
            &proxies,
        );
        assert_eq!(named, Some(ObjectRef::new("p1").within("crawl")));
        let found = proxy_of_pod(&pod(serde_json::json!({}), "u-old"), &proxies);
        assert_eq!(found, Some(ObjectRef::new("old-pod-owner").within("crawl")));
        assert_eq!(
            proxy_of_pod(&pod(serde_json::json!({}), "u-none"), &proxies),
            None
        );
    }
}
