//! The controller around the reconciler: one reconcile from start to end ([`reconcile`]:
//! gather, decide, execute, write), the backoff after its errors, the trigger streams that
//! start reconciles (the Proxy store, cloud-init Secrets, managed Pods, health transitions),
//! and the leases of deleted Proxies (`deleted`).

use std::collections::HashSet;
use std::sync::Arc;

use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::runtime::controller::{self, Controller};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use kube::{Api, ResourceExt};
use tokio::sync::mpsc;

use super::context::Context;
use super::decide::decide;
use super::deleted;
use super::error::Error;
use super::execute::{self, RetryEffect};
use super::observe::{self, Gathered};
use super::write;
use crate::provider::INSTALL_LABEL;
use crate::resources::proxy::{
    CLOUD_INIT_SECRET_LABEL, MANAGED_LABEL, PROXY_ANNOTATION, PROXY_UID_LABEL, Proxy,
};

/// One reconcile of one Proxy: gather what is known about it and its machine, [`decide`] the
/// one action, execute it, and write the result (at most one status write, guarded by the
/// resourceVersion, then the annotations, then an Event). A Proxy deleted while its reconcile
/// ran is no failure: its delete event ends what is left ([`Error::is_gone`]).
pub async fn reconcile(proxy: Arc<Proxy>, ctx: Arc<Context>) -> Result<controller::Action, Error> {
    let _timer = ctx.metrics.reconcile_timer();
    match reconcile_once(&proxy, &ctx).await {
        Err(e) if e.is_gone(&proxy.name_any()) => {
            log::debug!(
                "Proxy {} was deleted during its reconcile: {e}",
                proxy.key()
            );
            Ok(controller::Action::await_change())
        }
        done => done,
    }
}

/// The steps of [`reconcile`].
async fn reconcile_once(proxy: &Proxy, ctx: &Context) -> Result<controller::Action, Error> {
    let namespace = proxy
        .namespace()
        .ok_or(Error::MissingField("metadata.namespace"))?;
    let api: Api<Proxy> = Api::namespaced(ctx.client.clone(), &namespace);
    let current = proxy.status.clone().unwrap_or_default();
    let step = match observe::gather(proxy, &current, ctx).await? {
        Gathered::UnknownProvider => execute::unknown_provider(&proxy.spec, ctx),
        Gathered::Facts(facts) => {
            let action = decide(&facts.inputs(proxy, &current));
            log::debug!("Proxy {}: {action:?}", proxy.key());
            ctx.metrics.action_decided(action.label());
            execute::execute(action, &facts.machine(proxy, ctx), &current, &api).await?
        }
    };
    let uid = proxy.uid().unwrap_or_default();
    match step.retry {
        RetryEffect::Progress => ctx.pacing.succeeded(&uid, false),
        RetryEffect::Running => ctx.pacing.succeeded(&uid, true),
        RetryEffect::Neutral => {}
    }
    write::write(proxy, &current, step, &api, ctx).await
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

/// How often health and retry memory of deleted Proxies is dropped, and the leases of deleted
/// Proxies no delete event reported are looked for.
const FORGET_PERIOD: std::time::Duration = std::time::Duration::from_secs(60);

/// Once the store has its first list, publishes it as the fleet view (`Context::fleet`), then
/// at once and every [`FORGET_PERIOD`] drops the health transitions, retry memory and budget
/// grants of Proxies no longer in it and ends the leases of Proxies the API server no longer
/// has ([`deleted::sweep`]; `namespace` is the watch's).
async fn track_fleet(store: Store<Proxy>, ctx: Arc<Context>, namespace: Option<String>) {
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
        ctx.exits.retain(&live);
        ctx.pacing.retain(&live);
        ctx.grants.retain(&live);
        deleted::sweep(&ctx, &store, namespace.as_deref()).await;
    }
}

/// Runs the Proxy controller until the trigger streams end: reconciles the Proxies in `store`
/// (kept by the one Proxy watch, `proxy_watch`, which also yields `proxies`, each Proxy it
/// stores), re-triggers on cloud-init Secrets and on this install's machine Pods (in
/// `namespace`, or in all namespaces) and on `health` transitions, at most
/// [`ReconcilerConfig::concurrency`] at once. A Proxy that is not in the store (deleted, or
/// skipped as undecodable) is never reconciled; the leases of one the watch reports
/// `deleted` (by UID) end.
///
/// [`ReconcilerConfig::concurrency`]: super::ReconcilerConfig::concurrency
pub async fn run_controller(
    ctx: Arc<Context>,
    store: Store<Proxy>,
    proxies: impl Stream<Item = Arc<Proxy>> + Send + 'static,
    namespace: Option<&str>,
    health: impl Stream<Item = ObjectRef<Proxy>> + Send + 'static,
    deletions: mpsc::Receiver<String>,
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
    let tracking = track_fleet(store.clone(), ctx.clone(), namespace.map(str::to_owned));
    let following = {
        let ctx = ctx.clone();
        async move { deleted::follow(&ctx, deletions).await }
    };
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
        () = following => {}
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
