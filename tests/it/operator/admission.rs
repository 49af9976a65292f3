//! End to end on a real Kubernetes API server with the ServiceAccount admission plugin on:
//! a managed Pod create that admission refuses (no `default` ServiceAccount yet, a LimitRange
//! the squid Pod exceeds) is classified `Refused`: shown in the `Provisioned` condition with
//! the server's text, published once as a Warning Event, retried with backoff (never hammered),
//! never latched into `Failed`, and the Proxy becomes Ready once the cause is fixed.
//!
//! Every test here runs on a control plane of its own, started with
//! `--enable-admission-plugins=ServiceAccount` (the harness's default disables that plugin);
//! LimitRanger is on by default either way. Needs `KUBEBUILDER_ASSETS` (kube-apiserver +
//! etcd); without it every test here passes as skipped, unless `CI` is set.

use crate::support;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{LimitRange, ServiceAccount};
use k8s_openapi::api::events::v1::Event;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher;
use serde_json::{Value, json};
use support::ControlPlane;
use support::operator::{OperatorProcess, metric_sum};
use support::world::{World, eventually};

/// The API server flags of that control plane: ServiceAccount admission on.
const APISERVER_ARGS: &[&str] = &["--enable-admission-plugins=ServiceAccount"];
/// The provider-call counter and the labels of a refused create.
const PROVIDER_REQUESTS: &str = "proxy_operator_provider_requests_total";
const REFUSED_CREATE: &[&str] = &["op=\"create\"", "result=\"refused\""];
/// What LimitRanger answers for the squid container (limit cpu 500m) under `max: {cpu: 100m}`.
const LIMIT_RANGE_REFUSAL: &str = "maximum cpu usage per Container is 100m, but limit is 500m";
/// `reason` of the `Provisioned` condition and of the Warning Event for an admission refusal.
const REFUSED: &str = "Refused";

/// A fresh namespace on the admission tests' own control plane (ServiceAccount admission on), or `None`
/// when there is no control plane (skipped). The namespace has its `default` ServiceAccount.
async fn world(prefix: &str) -> Option<World> {
    Some(
        World::on(
            ControlPlane::dedicated("service-account-admission", APISERVER_ARGS)?,
            prefix,
        )
        .await,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_service_account_is_retried_until_it_exists() {
    let Some(world) = world("admission-sa").await else {
        return;
    };
    // `new_namespace` plays kube-controller-manager and creates `default`; this test is about
    // the time before that controller gets to the namespace.
    let accounts: Api<ServiceAccount> = Api::namespaced(world.client.clone(), &world.ns);
    accounts
        .delete("default", &DeleteParams::default())
        .await
        .expect("delete the namespace's default ServiceAccount");
    let expected = format!("error looking up service account {}/default", world.ns);
    let server_says = wait_server_refuses(&world, &expected).await;
    eprintln!("the API server refuses the squid Pod with: {server_says}");

    let phases = PhaseLog::start(&world, "px");
    let operator = world.operator(&[]).await;
    world
        .create("px", world.managed_spec(3128))
        .await
        .expect("create the Proxy");
    assert_refused_and_retried(&world, &operator, "px", &expected, &phases).await;

    // The controller-manager's part arrives: the next retry is admitted.
    let account: ServiceAccount =
        serde_json::from_value(json!({"metadata": {"name": "default"}})).expect("an account");
    accounts
        .create(&PostParams::default(), &account)
        .await
        .expect("create the default ServiceAccount");
    let ready = world.wait_ready("px").await;
    assert_provisioned_on_a_running_pod(&world, &ready).await;
    let pod = world.pod_of(&ready).await.expect("the Pod");
    let spec = pod.spec.expect("a Pod spec");
    assert_eq!(
        spec.service_account_name.as_deref(),
        Some("default"),
        "ServiceAccount admission ran on the Pod"
    );
    assert_eq!(spec.automount_service_account_token, Some(false));
    assert!(
        spec.volumes.unwrap_or_default().is_empty(),
        "no token volume is mounted into the squid Pod"
    );
    phases.assert_never_failed();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limit_range_refusal_is_retried_until_relaxed() {
    let Some(world) = world("admission-limits").await else {
        return;
    };
    create_cpu_limit_range(&world).await;
    let server_says = wait_server_refuses(&world, LIMIT_RANGE_REFUSAL).await;
    eprintln!("the API server refuses the squid Pod with: {server_says}");

    let phases = PhaseLog::start(&world, "px");
    let operator = world.operator(&[]).await;
    world
        .create("px", world.managed_spec(3128))
        .await
        .expect("create the Proxy");
    assert_refused_and_retried(&world, &operator, "px", LIMIT_RANGE_REFUSAL, &phases).await;

    // Relaxed: LimitRanger may answer from a live-lookup cache for up to 30 s after the
    // delete, well inside the wait's deadline.
    Api::<LimitRange>::namespaced(world.client.clone(), &world.ns)
        .delete(LIMIT_RANGE, &DeleteParams::default())
        .await
        .expect("delete the LimitRange");
    let ready = world.wait_ready("px").await;
    assert_provisioned_on_a_running_pod(&world, &ready).await;
    phases.assert_never_failed();
}

/// The backoff of the operator's refused creates: the test helper's `FAST_FLAGS`
/// (`--error-requeue 500ms --error-requeue-max 2s`). The helper puts extra flags after those,
/// but `run` refuses a flag given twice, so a test cannot pick its own values.
const BACKOFF_BASE: Duration = Duration::from_millis(500);
const BACKOFF_CAP: Duration = Duration::from_secs(2);
/// The measured window (a fixed span on purpose: it counts what happens in that time).
const BACKOFF_WINDOW: Duration = Duration::from_secs(12);
/// Creates the bound allows beyond the backoff schedule: a reconcile re-triggered by the
/// condition's status write, the Event, timer slop.
const BACKOFF_SLACK: u32 = 3;

/// The most refused creates a window of `window`, starting just after the first refusal, may
/// hold with backoff: the retries of the schedule base, 2·base, 4·base, … capped at `cap`
/// (500ms..2s: +0.5, +1.5, +3.5, +5.5, … s, so 7 in 12 s), plus [`BACKOFF_SLACK`]. A slow
/// machine only delays retries, and a longer window is measured, not assumed. Without backoff
/// the retries come at least every `base` (24 in 12 s), or many per second.
fn max_creates_in(window: Duration, base: Duration, cap: Duration) -> u32 {
    let (mut at, mut delay, mut creates) = (Duration::ZERO, base, 0);
    while at + delay <= window {
        at += delay;
        creates += 1;
        delay = (delay * 2).min(cap);
    }
    creates + BACKOFF_SLACK
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusal_is_retried_with_backoff_not_hammered() {
    let Some(world) = world("admission-backoff").await else {
        return;
    };
    // LimitRanger answers at once (ServiceAccount admission itself waits 1–2 s per refusal,
    // which would hide hammering).
    create_cpu_limit_range(&world).await;
    wait_server_refuses(&world, LIMIT_RANGE_REFUSAL).await;

    let phases = PhaseLog::start(&world, "px");
    let operator = world.operator(&[]).await;
    world
        .create("px", world.managed_spec(3128))
        .await
        .expect("create the Proxy");
    eventually("the first refused create", || async {
        (refused_creates(&operator).await >= 1.0).then_some(())
    })
    .await;

    // Measure the creates over a window (a fixed sleep on purpose: this counts what happens
    // in a span of time, it does not wait for something).
    let before = refused_creates(&operator).await;
    let started = Instant::now();
    tokio::time::sleep(BACKOFF_WINDOW).await;
    let after = refused_creates(&operator).await;
    let window = started.elapsed();
    let attempts = after - before;
    let bound = max_creates_in(window, BACKOFF_BASE, BACKOFF_CAP);
    eprintln!("{attempts} refused creates in {window:?} (bound {bound})");
    assert!(
        attempts <= f64::from(bound),
        "{attempts} refused creates in {window:?} (at most {bound} with backoff \
         {BACKOFF_BASE:?}..{BACKOFF_CAP:?}): the refusal is retried without backoff"
    );
    assert!(
        attempts >= 2.0,
        "only {attempts} refused creates in {window:?}: the refusal is not retried"
    );

    // And it is shown as a refusal, not latched.
    world
        .wait_proxy("px", "the Provisioned condition Refused", |s| {
            provisioned(s).is_some_and(|c| c["reason"] == REFUSED)
        })
        .await;
    let status = current_status(&world, "px").await;
    assert_eq!(status["phase"], "Pending", "{status}");
    phases.assert_never_failed();
}

// ---------------------------------------------------------------------------------------------
// Helpers.

const LIMIT_RANGE: &str = "cpu-max";

/// A LimitRange allowing each Container at most 100m of CPU (the squid Pod's limit is 500m).
async fn create_cpu_limit_range(world: &World) {
    let limits: LimitRange = serde_json::from_value(json!({
        "metadata": {"name": LIMIT_RANGE},
        "spec": {"limits": [{"type": "Container", "max": {"cpu": "100m"}}]},
    }))
    .expect("a LimitRange");
    Api::<LimitRange>::namespaced(world.client.clone(), &world.ns)
        .create(&PostParams::default(), &limits)
        .await
        .expect("create the LimitRange");
}

/// Waits until the API server refuses, as `admin`, a dry-run create of the Pod the operator
/// would make, with a 403 whose message contains `expected` (admission plugins read their
/// objects through informers, so a just-written ServiceAccount or LimitRange may take a moment
/// to count); returns the server's message.
async fn wait_server_refuses(world: &World, expected: &str) -> String {
    let uid = "00000000-0000-4000-8000-0000000000ad";
    let pod = world.machine_pod("probe", uid);
    let dry_run = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    let pods = world.pods();
    let what = format!("the server to refuse the squid Pod with 403 {expected:?}");
    eventually(&what, || async {
        match pods.create(&dry_run, &pod).await {
            Err(kube::Error::Api(status))
                if status.code == 403 && status.message.contains(expected) =>
            {
                Some(status.message)
            }
            Err(kube::Error::Api(status)) => {
                eprintln!("dry-run create: {} {}", status.code, status.message);
                None
            }
            Err(e) => panic!("dry-run create failed outside the API: {e}"),
            Ok(_) => None,
        }
    })
    .await
}

/// While the refusal stands: the `Provisioned` condition says `Refused` with the server's
/// text, the phase is `Pending` every time it is looked at over a few seconds, there is no Pod,
/// the create was retried (the counter shows two refused creates or more), and one Warning
/// Event `Refused` was published, once.
async fn assert_refused_and_retried(
    world: &World,
    operator: &OperatorProcess,
    name: &str,
    expected: &str,
    phases: &PhaseLog,
) {
    let status = world
        .wait_proxy(
            name,
            &format!("the Provisioned condition False/{REFUSED} with {expected:?}"),
            |s| {
                provisioned(s).is_some_and(|c| {
                    c["status"] == "False"
                        && c["reason"] == REFUSED
                        && c["message"].as_str().is_some_and(|m| m.contains(expected))
                })
            },
        )
        .await["status"]
        .clone();
    assert_eq!(status["phase"], "Pending", "{status}");

    // Sampled over ~3 s: still refused, still Pending, never a Pod.
    for _ in 0..10 {
        let status = current_status(world, name).await;
        assert_eq!(status["phase"], "Pending", "latched? {status}");
        let condition = provisioned(&status).cloned().unwrap_or_default();
        assert_eq!(condition["reason"], REFUSED, "{status}");
        let pods = world
            .pods()
            .list(&ListParams::default())
            .await
            .expect("list Pods");
        assert!(
            pods.items.is_empty(),
            "a Pod exists although admission refuses it: {:?}",
            pods.items.iter().map(|p| p.name_any()).collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    phases.assert_never_failed();

    eventually("two refused creates or more (retried)", || async {
        (refused_creates(operator).await >= 2.0).then_some(())
    })
    .await;
    eventually(&format!("a Warning Event {REFUSED}"), || async {
        let events = world.events_about(name).await;
        events
            .iter()
            .any(|e| e.reason.as_deref() == Some(REFUSED))
            .then_some(())
    })
    .await;
    // Published once although the create was refused twice or more: one Event, no series.
    let refused: Vec<Event> = world
        .events_about(name)
        .await
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some(REFUSED))
        .collect();
    let [event] = refused.as_slice() else {
        panic!("expected one Refused Event: {refused:?}");
    };
    assert_eq!(event.type_.as_deref(), Some("Warning"), "{event:?}");
    assert!(
        event.series.is_none(),
        "the Refused Event was published more than once: {event:?}"
    );
    let note = event.note.clone().unwrap_or_default();
    assert!(note.contains(expected), "the Event's note: {note:?}");
}

/// Ready on a Pod the test kubelet runs, and the `Provisioned` condition True.
async fn assert_provisioned_on_a_running_pod(world: &World, ready: &Value) {
    let condition = provisioned(&ready["status"]).cloned().unwrap_or_default();
    assert_eq!(condition["status"], "True", "{ready}");
    let pod = world.pod_of(ready).await.expect("the Proxy's Pod");
    let ip = world
        .kubelet
        .address(&world.ns, &pod.name_any())
        .expect("the kubelet runs the Pod");
    assert_eq!(ready["status"]["ip"], ip.to_string(), "{ready}");
}

/// The `Provisioned` condition of a status.
fn provisioned(status: &Value) -> Option<&Value> {
    status["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == "Provisioned")
}

async fn current_status(world: &World, name: &str) -> Value {
    let object = world.raw_proxies().get(name).await.expect("read the Proxy");
    serde_json::to_value(&object).expect("a Proxy as JSON")["status"].clone()
}

/// The operator's count of refused Pod creates.
async fn refused_creates(operator: &OperatorProcess) -> f64 {
    metric_sum(&operator.metrics().await, PROVIDER_REQUESTS, REFUSED_CREATE)
}

/// Every `status.phase` a Proxy had, as seen by a watch from before its creation: sampling
/// alone could miss a short-lived `Failed`.
struct PhaseLog {
    phases: Arc<Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl PhaseLog {
    fn start(world: &World, name: &str) -> PhaseLog {
        let phases = Arc::new(Mutex::new(Vec::new()));
        let seen = phases.clone();
        let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
        let stream = watcher(world.raw_proxies(), config).applied_objects();
        let task = tokio::spawn(async move {
            let mut stream = std::pin::pin!(stream);
            while let Some(item) = stream.next().await {
                let Ok(object) = item else { continue };
                if let Some(phase) = object.data["status"]["phase"].as_str() {
                    let mut phases = seen.lock().unwrap_or_else(|e| e.into_inner());
                    if phases.last().map(String::as_str) != Some(phase) {
                        phases.push(phase.to_owned());
                    }
                }
            }
        });
        PhaseLog { phases, task }
    }

    fn assert_never_failed(&self) {
        let phases = self
            .phases
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        assert!(
            !phases.iter().any(|p| p == "Failed"),
            "the Proxy was latched into Failed; phases seen: {phases:?}"
        );
    }
}

impl Drop for PhaseLog {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[test]
fn the_backoff_bound_tells_backoff_from_none() {
    let bound = max_creates_in(BACKOFF_WINDOW, BACKOFF_BASE, BACKOFF_CAP);
    assert_eq!(bound, 7 + BACKOFF_SLACK);
    let without = u32::try_from(BACKOFF_WINDOW.as_millis() / BACKOFF_BASE.as_millis())
        .expect("a small count");
    assert!(
        bound * 2 <= without,
        "bound {bound} is too close to the {without} creates of no backoff"
    );
}
