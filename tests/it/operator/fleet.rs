//! The fleet lifecycle end to end on a real Kubernetes API server: the `proxy-operator run`
//! binary as a process, and the test kubelet running real squid for each machine Pod. Every
//! voluntary replacement (spec change, the rotate annotation, `spec.maxLifetime`, health
//! remediation) and every `kubectl delete` of a Managed proxy drains its leases first, within a
//! fleet-wide replacement budget; remediation stops when too many proxies of a provider are
//! unhealthy at once.
//!
//! What the tests watch is what an SRE would: the Proxy's status and Events, the machine Pod's
//! UID, the lease API's answers, the ledger file through `sqlite3` and the operator's
//! `/metrics`. States that last only a few seconds (a drain cut short by its timeout) are read
//! from a watch on the Proxies, which sees every status write in order, never from a lucky poll.
//!
//! Needs `KUBEBUILDER_ASSETS` (kube-apiserver + etcd); without it every test here passes as
//! skipped, unless `CI` is set. `kubectl` is used when it is on the PATH; without it the same
//! requests go through the client.

use crate::support;

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{DeleteParams, Patch, PatchParams};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher;
use proxy_operator::resources::naming::machine_name;
use proxy_operator::resources::proxy::{
    ROTATE_ANNOTATION, ROTATED_ANNOTATION, SPEC_HASH_ANNOTATION,
};
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use support::operator::{OperatorProcess, lease_id, metric_sum};
use support::world::{SLOW, World, eventually, within};

/// Lease TTL in these tests: far longer than any of them, so only a release, the operator or a
/// drain timeout ends a lease.
const LEASE_TTL: u64 = 600;

/// A new container image for the squid Pods (`spec.placement.image`): the spec change of a
/// fleet-wide image upgrade. The test kubelet runs the Pod's squid configuration whatever the
/// image, so only the Pod shows it.
const NEW_IMAGE: &str = "ubuntu/squid:6.10-24.10_edge";

/// Operator flags for one replacement at a time, with a drain timeout longer than any test:
/// only the end of its leases ends a drain.
const ONE_AT_A_TIME: &[&str] = &["--replacement-budget", "1", "--drain-timeout", "10m"];

/// Operator flags for a budget of 0: replacements wait, repairs do not.
const NO_REPLACEMENTS: &[&str] = &["--replacement-budget", "0"];

/// Operator flags for remediation 3 s after a machine turns unhealthy, unless more than half of
/// a provider's proxies are.
const REMEDIATION: &[&str] = &["--remediate-after", "3s", "--max-unhealthy", "50%"];

/// A Managed spec for the remediation tests: unhealthy only after 2 s of failed probes, so only
/// a frozen squid turns a proxy unhealthy (and is replaced 3 s later), never a slow probe on a
/// loaded machine.
fn remediation_spec(world: &World) -> Value {
    let mut spec = world.managed_spec(3128);
    spec["healthCheck"]["failureThreshold"] = json!(4);
    spec
}

/// The image of a Pod's first container.
fn image_of(pod: &Pod) -> Option<String> {
    pod.spec.as_ref()?.containers.first()?.image.clone()
}

// ---------------------------------------------------------------------------------------------
// Helpers

/// The condition of type `kind` in a Proxy's status, or `Null`.
fn condition(status: &Value, kind: &str) -> Value {
    status["conditions"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["type"] == kind))
        .cloned()
        .unwrap_or(Value::Null)
}

fn provisioned(status: &Value) -> Value {
    condition(status, "Provisioned")
}

/// A timestamp field (RFC 3339) of a status.
fn timestamp(value: &Value) -> Option<jiff::Timestamp> {
    value.as_str()?.parse().ok()
}

/// `status.machineCreatedAt` of a Proxy.
fn machine_created_at(proxy: &Value) -> jiff::Timestamp {
    timestamp(&proxy["status"]["machineCreatedAt"])
        .unwrap_or_else(|| panic!("no status.machineCreatedAt: {}", proxy["status"]))
}

/// `b - a` in milliseconds.
fn millis_between(a: jiff::Timestamp, b: jiff::Timestamp) -> i64 {
    b.as_millisecond() - a.as_millisecond()
}

/// A test's world (`None`: no control plane, the test is skipped), its admin kubeconfig for
/// `kubectl`, and the operator started with `flags`.
async fn start(prefix: &str, flags: &[&str]) -> Option<(World, PathBuf, OperatorProcess)> {
    let world = World::new(prefix).await?;
    let kubeconfig = world.admin_kubeconfig();
    let operator = world.operator(flags).await;
    Some((world, kubeconfig, operator))
}

/// Runs `check` every 250 ms for `period`.
async fn throughout<F, Fut>(period: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = ()>,
{
    let until = Instant::now() + period;
    while Instant::now() < until {
        check().await;
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Gives the Proxy `name` [`NEW_IMAGE`]: a spec change that replaces its machine.
async fn set_new_image(world: &World, kubeconfig: &Path, name: &str) {
    let patch = json!({"spec": {"placement": {"image": NEW_IMAGE}}});
    world.patch_proxy(kubeconfig, name, &patch).await;
}

/// `kubectl annotate --overwrite px <name> k=v...` (through the client without kubectl).
async fn annotate(world: &World, kubeconfig: &Path, name: &str, pairs: &[(&str, &str)]) {
    let mut args = vec![
        "annotate".to_owned(),
        "--overwrite".to_owned(),
        "px".to_owned(),
        name.to_owned(),
    ];
    args.extend(pairs.iter().map(|(k, v)| format!("{k}={v}")));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    if world.kubectl(kubeconfig, &args).is_none() {
        let annotations: serde_json::Map<String, Value> = pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), json!(v)))
            .collect();
        world
            .raw_proxies()
            .patch(
                name,
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"annotations": annotations}})),
            )
            .await
            .unwrap_or_else(|e| panic!("annotate Proxy {name}: {e}"));
    }
}

/// `kubectl delete px <name> --wait=false` (through the client without kubectl).
async fn delete_proxy(world: &World, kubeconfig: &Path, name: &str) {
    let args = ["delete", "px", name, "--wait=false"];
    if world.kubectl(kubeconfig, &args).is_none() {
        world
            .proxies()
            .delete(name, &DeleteParams::default())
            .await
            .unwrap_or_else(|e| panic!("delete Proxy {name}: {e}"));
    }
}

/// A Managed proxy Ready on its first machine.
struct FirstMachine {
    /// The Proxy once Ready.
    ready: Value,
    pod_name: String,
    uid: String,
}

/// Creates the Managed proxy `name` (port 3128) in `pool` with `annotations` and waits until it
/// is Ready on its first machine.
async fn ready_managed(
    world: &World,
    name: &str,
    pool: &str,
    annotations: &[(&str, &str)],
) -> FirstMachine {
    world
        .create_in_pool(name, pool, annotations, world.managed_spec(3128))
        .await;
    let ready = world.wait_ready(name).await;
    let pod = world.pod_of(&ready).await.expect("the machine Pod");
    FirstMachine {
        pod_name: pod.name_any(),
        uid: pod.uid().expect("a Pod UID"),
        ready,
    }
}

/// Creates `names` (each in a pool of its name) and waits until all are Ready; returns each
/// name's Pod name and UID.
async fn ready_fleet(world: &World, names: &[&str]) -> BTreeMap<String, (String, String)> {
    ready_fleet_of(world, names, world.managed_spec(3128)).await
}

/// [`ready_fleet`] with each Proxy's `spec`.
async fn ready_fleet_of(
    world: &World,
    names: &[&str],
    spec: Value,
) -> BTreeMap<String, (String, String)> {
    for name in names {
        world.create_in_pool(name, name, &[], spec.clone()).await;
    }
    let mut pods = BTreeMap::new();
    for name in names {
        let ready = world.wait_ready(name).await;
        let pod = world.pod_of(&ready).await.expect("the machine Pod");
        pods.insert(
            (*name).to_owned(),
            (pod.name_any(), pod.uid().expect("a Pod UID")),
        );
    }
    pods
}

/// Proxies Ready on their first machines, each holding one lease.
struct LeasedFleet {
    /// Each name's first Pod: name and UID.
    pods: BTreeMap<String, (String, String)>,
    /// Each name's lease ID.
    leases: BTreeMap<String, String>,
}

/// [`ready_fleet`], then a lease on each proxy (through its pool).
async fn leased_fleet(world: &World, operator: &OperatorProcess, names: &[&str]) -> LeasedFleet {
    let pods = ready_fleet(world, names).await;
    let mut leases = BTreeMap::new();
    for name in names {
        leases.insert((*name).to_owned(), lease_id(&acquire(operator, name).await));
    }
    LeasedFleet { pods, leases }
}

/// With a budget of 1, gives `a` and then `b` (both leased) the new image; returns `a`'s Proxy
/// once it drains, when `b` waits for the budget.
async fn replace_a_while_b_waits(world: &World, kubeconfig: &Path) -> Value {
    set_new_image(world, kubeconfig, "a").await;
    let draining = wait_provisioned_reason(world, "a", "Draining", "a draining").await;
    set_new_image(world, kubeconfig, "b").await;
    wait_provisioned_reason(world, "b", "ReplacementPending", "b waiting for the budget").await;
    draining
}

/// Waits until `name` drains (`what`), ends its lease and waits until its replacement is done:
/// Ready on a new Pod, `status.disruption` cleared.
async fn drain_and_replace(
    world: &World,
    operator: &OperatorProcess,
    fleet: &LeasedFleet,
    name: &str,
    what: &str,
) {
    wait_provisioned_reason(world, name, "Draining", what).await;
    operator.release(&fleet.leases[name]).await;
    world
        .wait_ready_on_new_pod(name, &fleet.pods[name].1, SLOW)
        .await;
    wait_disruption_cleared(world, name).await;
}

/// The Proxy `name` as JSON, if it exists.
async fn proxy_value(world: &World, name: &str) -> Option<Value> {
    let object = world
        .raw_proxies()
        .get_opt(name)
        .await
        .unwrap_or_else(|e| panic!("read Proxy {name}: {e}"))?;
    Some(serde_json::to_value(&object).expect("a Proxy as JSON"))
}

/// Waits until the Proxy's Provisioned condition has `reason`; returns the Proxy.
async fn wait_provisioned_reason(world: &World, name: &str, reason: &str, what: &str) -> Value {
    world
        .wait_proxy(name, what, |s| provisioned(s)["reason"] == reason)
        .await
}

/// Waits until the Proxy is Provisioned=True with no replacement pending any more.
async fn wait_nothing_pending(world: &World, name: &str) -> Value {
    world
        .wait_proxy(name, "Provisioned=True, nothing pending", |s| {
            provisioned(s)["status"] == "True" && provisioned(s)["reason"] != "ReplacementPending"
        })
        .await
}

/// Waits until the Proxy drains its machine (Provisioned=False/Draining) for 1 active lease.
async fn wait_draining_one_lease(world: &World, name: &str) -> Value {
    world
        .wait_proxy(
            name,
            "Provisioned=False/Draining with 1 active lease",
            |s| {
                let p = provisioned(s);
                p["reason"] == "Draining"
                    && p["message"]
                        .as_str()
                        .is_some_and(|m| m.contains("1 active lease"))
            },
        )
        .await
}

/// The UID of the Pod of this name now, and whether it is being deleted.
async fn pod_now(world: &World, pod_name: &str) -> Option<(String, bool)> {
    let pod = world
        .pods()
        .get_opt(pod_name)
        .await
        .unwrap_or_else(|e| panic!("read Pod {pod_name}: {e}"))?;
    Some((
        pod.uid().unwrap_or_default(),
        pod.metadata.deletion_timestamp.is_some(),
    ))
}

/// Waits (up to `deadline`, failing with `what`) until the Pod `pod_name` is no longer `uid`
/// running (it is being deleted, gone or another); returns when that was seen.
async fn wait_pod_deleted(
    world: &World,
    pod_name: &str,
    uid: &str,
    deadline: Duration,
    what: &str,
) -> jiff::Timestamp {
    within(deadline, what, || async {
        match pod_now(world, pod_name).await {
            Some((now, false)) if now == uid => None,
            _ => Some(jiff::Timestamp::now()),
        }
    })
    .await
}

/// Asserts that the Pod `pod_name` is still the one with UID `uid`, running, not deleted.
async fn assert_same_pod(world: &World, pod_name: &str, uid: &str, when: &str) {
    let now = pod_now(world, pod_name).await;
    assert_eq!(
        now,
        Some((uid.to_owned(), false)),
        "{when}: the machine Pod {pod_name} is no longer {uid} (or is being deleted)"
    );
    assert!(
        world.kubelet.squid_running(&world.ns, pod_name),
        "{when}: the squid of {pod_name} stopped"
    );
}

/// Asserts, for `period`, that each `(proxy, pod UID)` keeps its Pod and no disruption.
async fn assert_not_replaced_for(world: &World, proxies: &[(&str, &str)], period: Duration) {
    throughout(period, || async {
        for (name, uid) in proxies {
            let proxy = proxy_value(world, name).await.expect("the Proxy");
            assert!(
                proxy["status"]["disruption"].is_null(),
                "{name} is being replaced: {}",
                proxy["status"]
            );
            let pod_name = machine_name(proxy["metadata"]["uid"].as_str().expect("a UID"));
            assert_same_pod(world, &pod_name, uid, &format!("{name} left alone")).await;
        }
    })
    .await;
}

/// Waits until the Proxy `name` is Ready on a Pod other than `old_uid` that runs
/// [`NEW_IMAGE`].
async fn wait_ready_on_new_image(world: &World, name: &str, old_uid: &str) {
    let (_, new_pod) = world.wait_ready_on_new_pod(name, old_uid, SLOW).await;
    assert_eq!(image_of(&new_pod).as_deref(), Some(NEW_IMAGE));
}

/// Waits until the Proxy's `status.disruption` is gone (the replacement finished), returning
/// the Proxy.
async fn wait_disruption_cleared(world: &World, name: &str) -> Value {
    world
        .wait_proxy(name, &format!("{name}: status.disruption cleared"), |s| {
            s["phase"] == "Ready" && s["disruption"].is_null()
        })
        .await
}

/// Acquires a lease on `pool`, retrying while the answer is 409 (not healthy yet).
async fn acquire(operator: &OperatorProcess, pool: &str) -> Value {
    acquire_with(
        operator,
        &json!({"selector": {"pool": pool}, "ttlSeconds": LEASE_TTL}),
    )
    .await
}

/// Acquires a lease with the request `body`, retrying while the answer is 409.
async fn acquire_with(operator: &OperatorProcess, body: &Value) -> Value {
    operator
        .acquire_retrying(body, &format!("a lease for {body}"))
        .await
}

/// Asserts a renewal of the lease `id` is refused: 409 with the error code `error`.
async fn assert_renew_refused(operator: &OperatorProcess, id: &str, error: &str) {
    let (status, body) = operator.renew(id, 60).await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert_eq!(body["error"], error, "{body}");
}

/// Waits until the ledger shows the lease `id` ended by the drain timeout.
async fn wait_ended_by_drain_timeout(operator: &OperatorProcess, id: &str) {
    let ledger = operator.ledger();
    eventually("the lease ended by the drain timeout", || async {
        let row = support::sqlite3(
            &ledger,
            &format!("SELECT state, release_reason FROM leases WHERE id = '{id}'"),
        );
        (row == "released|drain_timeout").then_some(())
    })
    .await;
}

/// Waits for at least one Event `reason` about `name`; returns them all.
async fn wait_event(world: &World, name: &str, reason: &str) -> Vec<(String, String)> {
    eventually(&format!("an Event {reason} about {name}"), || async {
        let events = world.events_with_reason(name, reason).await;
        (!events.is_empty()).then_some(events)
    })
    .await
}

/// Waits until `metric` with `labels` sums to `value` in the operator's `/metrics` (and, for a
/// value other than 0, until such a series exists).
async fn wait_metric(operator: &OperatorProcess, metric: &str, labels: &[&str], value: f64) {
    let start = Instant::now();
    loop {
        let text = operator.metrics().await;
        let has_series = text
            .lines()
            .any(|l| l.starts_with(metric) && labels.iter().all(|p| l.contains(p)));
        if metric_sum(&text, metric, labels) == value && (value == 0.0 || has_series) {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{metric}{labels:?} is not {value} after 30 s:\n{}",
            text.lines()
                .filter(|l| l.contains(metric))
                .collect::<Vec<_>>()
                .join("\n")
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

const DISRUPTIONS: &str = "proxy_operator_disruptions_total";

/// The operator's count of disruptions now, of one `reason` (its metric label) or of all.
async fn disruptions(operator: &OperatorProcess, reason: Option<&str>) -> f64 {
    let label = reason.map(|r| format!("reason=\"{r}\""));
    let labels: Vec<&str> = label.iter().map(String::as_str).collect();
    metric_sum(&operator.metrics().await, DISRUPTIONS, &labels)
}

/// Waits until the operator counts `value` disruptions of `reason` (its metric label).
async fn wait_disruptions(operator: &OperatorProcess, reason: &str, value: f64) {
    wait_metric(
        operator,
        DISRUPTIONS,
        &[&format!("reason=\"{reason}\"")],
        value,
    )
    .await;
}

/// Waits until the operator's remediation of the `local` provider is paused (1) or not (0).
async fn wait_remediation_paused(operator: &OperatorProcess, value: f64) {
    let labels = ["provider=\"local\""];
    wait_metric(
        operator,
        "proxy_operator_remediation_paused",
        &labels,
        value,
    )
    .await;
}

/// Waits (up to `deadline`) until the Proxy `name` is gone.
async fn wait_gone_within(world: &World, name: &str, deadline: Duration) {
    let proxies = world.proxies();
    within(deadline, &format!("Proxy {name} to be gone"), || async {
        proxies.get_opt(name).await.ok()?.is_none().then_some(())
    })
    .await;
}

/// Waits until the Proxy's Healthy condition is `value` ("True"/"False").
async fn wait_healthy(world: &World, name: &str, value: &str) -> Value {
    world
        .wait_proxy(name, &format!("{name}: Healthy={value}"), |s| {
            condition(s, "Healthy")["status"] == value
        })
        .await
}

/// Every version of every Proxy of a namespace, in the order the API server wrote them (one
/// watch: resourceVersion order), with the instant each arrived here.
struct Recorder {
    history: Arc<Mutex<Vec<Seen>>>,
    synced: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

#[derive(Clone, Debug)]
struct Seen {
    at: Instant,
    name: String,
    /// The object; `None` when it was deleted.
    object: Option<Value>,
}

impl Recorder {
    /// Starts watching the world's Proxies and waits until the watch has its initial list.
    async fn start(world: &World) -> Recorder {
        let history = Arc::new(Mutex::new(Vec::new()));
        let synced = Arc::new(AtomicBool::new(false));
        let api = world.raw_proxies();
        let task = {
            let history = history.clone();
            let synced = synced.clone();
            tokio::spawn(async move {
                let mut events = watcher::watcher(api, watcher::Config::default())
                    .default_backoff()
                    .boxed();
                while let Some(event) = events.next().await {
                    let (object, deleted) = match event {
                        Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o)) => (o, false),
                        Ok(watcher::Event::Delete(o)) => (o, true),
                        Ok(watcher::Event::InitDone) => {
                            synced.store(true, Ordering::SeqCst);
                            continue;
                        }
                        Ok(watcher::Event::Init) => continue,
                        Err(e) => {
                            eprintln!("proxy watch error (retrying): {e}");
                            continue;
                        }
                    };
                    let seen = Seen {
                        at: Instant::now(),
                        name: object.name_any(),
                        object: (!deleted)
                            .then(|| serde_json::to_value(&object).expect("a Proxy as JSON")),
                    };
                    history.lock().unwrap_or_else(|e| e.into_inner()).push(seen);
                }
            })
        };
        let recorder = Recorder {
            history,
            synced,
            task,
        };
        eventually("the Proxy watch to list", || async {
            recorder.synced.load(Ordering::SeqCst).then_some(())
        })
        .await;
        recorder
    }

    fn history(&self) -> Vec<Seen> {
        self.history
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Waits (up to `deadline`) until a version of `name` satisfying `check` was written;
    /// returns the first such version.
    async fn wait_for(
        &self,
        name: &str,
        deadline: Duration,
        what: &str,
        check: impl Fn(&Value) -> bool,
    ) -> Seen {
        within(deadline, what, || {
            let found = self
                .history()
                .into_iter()
                .find(|s| s.name == name && s.object.as_ref().is_some_and(&check));
            async move { found }
        })
        .await
    }

    /// The versions of `name`, in order (`None`: deleted).
    fn versions(&self, name: &str) -> Vec<Option<Value>> {
        self.history()
            .into_iter()
            .filter(|s| s.name == name)
            .map(|s| s.object)
            .collect()
    }

    /// The status changes of each of `names`, for failure messages.
    fn describe_all(&self, names: &[&str]) -> String {
        names
            .iter()
            .map(|n| format!("{n}:\n  {}", describe(&self.versions(n))))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Asserts that no version written shows two of `names` disrupted at once (a budget of 1).
    fn assert_one_disruption_at_a_time(&self, names: &[&str]) {
        let mut disrupted: BTreeMap<String, bool> = BTreeMap::new();
        for seen in self.history() {
            let Some(object) = &seen.object else {
                continue;
            };
            disrupted.insert(seen.name.clone(), !object["status"]["disruption"].is_null());
            let now: Vec<&String> = disrupted
                .iter()
                .filter(|(_, d)| **d)
                .map(|(n, _)| n)
                .collect();
            assert!(
                now.len() <= 1,
                "{now:?} disrupted at once with a budget of 1; versions:\n{}",
                self.describe_all(names)
            );
        }
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Compact text of the status changes of one proxy, for failure messages.
fn describe(versions: &[Option<Value>]) -> String {
    let mut out = Vec::new();
    let mut last = String::new();
    for version in versions {
        let line = match version {
            None => "deleted".to_owned(),
            Some(v) => {
                let s = &v["status"];
                let p = provisioned(s);
                format!(
                    "phase={} provisioned={}/{} {:?} disruption={} deleting={}",
                    s["phase"],
                    p["status"],
                    p["reason"],
                    p["message"].as_str().unwrap_or_default(),
                    s["disruption"],
                    !v["metadata"]["deletionTimestamp"].is_null()
                )
            }
        };
        if line != last {
            out.push(line.clone());
            last = line;
        }
    }
    out.join("\n  ")
}

// ---------------------------------------------------------------------------------------------
// 1. A spec change drains the proxy's leases before its machine is replaced.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spec_change_drains_leases_before_the_machine_is_replaced() {
    let Some((world, kubeconfig, operator)) = start("fleet-spec", ONE_AT_A_TIME).await else {
        return;
    };
    let FirstMachine {
        ready,
        pod_name,
        uid: old_uid,
    } = ready_managed(&world, "px", "spec", &[]).await;
    let created_before = machine_created_at(&ready);
    assert!(
        ready["status"]["disruption"].is_null(),
        "{}",
        ready["status"]
    );
    let old_hash = ready["metadata"]["annotations"][SPEC_HASH_ANNOTATION].clone();
    assert!(old_hash.is_string(), "{ready}");

    let first =
        json!({"selector": {"pool": "spec"}, "ttlSeconds": LEASE_TTL, "requestID": "spec-1"});
    let lease = acquire_with(&operator, &first).await;
    assert_eq!(lease["proxy"]["name"], "px", "{lease}");
    assert_eq!(lease["proxy"]["port"], 3128, "{lease}");
    let id = lease_id(&lease);

    // A new port is a new spec hash: the machine must be replaced, but it holds a lease.
    world
        .patch_proxy(&kubeconfig, "px", &json!({"spec": {"port": 3129}}))
        .await;
    let changed = Instant::now();
    let draining = wait_draining_one_lease(&world, "px").await;
    eprintln!(
        "spec change: Draining {:?} after the patch",
        changed.elapsed()
    );
    let status = &draining["status"];
    assert_eq!(provisioned(status)["status"], "False", "{status}");
    assert_eq!(status["phase"], "Replacing", "{status}");
    assert_eq!(
        status["ip"], ready["status"]["ip"],
        "the IP is kept while draining"
    );
    assert_eq!(status["disruption"]["reason"], "SpecChange", "{status}");
    assert!(
        timestamp(&status["disruption"]["since"]).is_some(),
        "disruption.since: {status}"
    );
    assert_same_pod(&world, &pod_name, &old_uid, "while draining").await;

    // The lease API: no new lease, no renewal, but reports and the lease itself go on.
    let listed = operator.wait_listed("spec", "px", "draining", true).await;
    assert_eq!(listed["activeLeases"], 1, "{listed}");
    // The draining machine still listens on the port it was made with, and is probed there.
    assert_eq!(listed["port"], 3128, "{listed}");
    throughout(Duration::from_secs(3), || async {
        let listed = operator.wait_listed("spec", "px", "draining", true).await;
        assert_eq!(
            listed["healthy"], true,
            "the draining machine serves: {listed}"
        );
    })
    .await;
    let (status, body) = operator
        .call(
            Method::POST,
            "/v1/leases",
            Some(json!({"selector": {"pool": "spec"}, "ttlSeconds": 60})),
        )
        .await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert_eq!(body["error"], "no_match", "{body}");
    assert_eq!(body["considered"], 1, "{body}");
    assert_eq!(body["draining"], 1, "{body}");
    assert_eq!(body["unhealthy"], 0, "{body}");
    assert_eq!(body["atCapacity"], 0, "{body}");
    assert_renew_refused(&operator, &id, "proxy_draining").await;
    operator
        .report(&id, json!({"result": "ok", "target": "example.com"}))
        .await;
    let view = operator.lease(&id).await;
    assert_eq!(view["state"], "active", "{view}");
    // A retried acquire (same requestID) still answers with the lease it got.
    let (status, replay) = operator
        .call(Method::POST, "/v1/leases", Some(first.clone()))
        .await;
    assert_eq!(status, StatusCode::OK, "{replay}");
    assert_eq!(replay["leaseID"], id.as_str(), "{replay}");

    let events = wait_event(&world, "px", "Draining").await;
    assert!(events.iter().any(|(t, _)| t == "Normal"), "{events:?}");
    wait_disruptions(&operator, "spec_change", 1.0).await;
    let metrics = operator.metrics().await;
    assert!(
        metric_sum(
            &metrics,
            "proxy_operator_lease_rejections_total",
            &["reason=\"draining\""]
        ) >= 1.0,
        "no draining rejection counted:\n{}",
        metrics
            .lines()
            .filter(|l| l.contains("lease_rejections"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    // The lease keeps the old machine: a few drift polls (2 s) later it is still there.
    throughout(Duration::from_secs(4), || {
        assert_same_pod(&world, &pod_name, &old_uid, "while a lease holds the drain")
    })
    .await;

    // The last lease ends: the machine goes and a new one on the new port takes its place.
    operator.release(&id).await;
    let released = Instant::now();
    let (proxy, new_pod) = world.wait_ready_on_new_pod("px", &old_uid, SLOW).await;
    eprintln!(
        "spec change: Ready on a new Pod {:?} after the release",
        released.elapsed()
    );
    assert_eq!(new_pod.name_any(), pod_name, "same deterministic name");
    assert!(
        world.kubelet.started(&world.ns, &pod_name).len() >= 2,
        "the replacement runs squid"
    );
    assert_ne!(
        proxy["metadata"]["annotations"][SPEC_HASH_ANNOTATION], old_hash,
        "{proxy}"
    );
    let done = wait_disruption_cleared(&world, "px").await;
    let status = &done["status"];
    assert_eq!(provisioned(status)["status"], "True", "{status}");
    let created_after = machine_created_at(&done);
    assert!(
        created_after > created_before,
        "machineCreatedAt {created_after} not newer than {created_before}"
    );

    // Leasable again, on the new machine and port; the ledger kept the client's release.
    let again = acquire(&operator, "spec").await;
    assert_eq!(again["proxy"]["port"], 3129, "{again}");
    assert_eq!(again["proxy"]["host"], status["ip"], "{again}");
    let row = support::sqlite3(
        &operator.ledger(),
        &format!("SELECT state, IFNULL(release_reason, '-') FROM leases WHERE id = '{id}'"),
    );
    assert_eq!(
        row, "released|-",
        "released by its client, not by the operator"
    );
    assert_eq!(
        disruptions(&operator, Some("spec_change")).await,
        1.0,
        "one disruption for one spec change"
    );
}

/// Crawlers whose renewals are refused let their leases run out: the drain ends when the last
/// one expires, long before the drain timeout, and nothing is ended by the operator.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_ends_when_the_last_lease_expires() {
    let Some((world, kubeconfig, operator)) = start("fleet-expiry", ONE_AT_A_TIME).await else {
        return;
    };
    let FirstMachine {
        pod_name,
        uid: old_uid,
        ..
    } = ready_managed(&world, "px", "expiry", &[]).await;
    let lease = acquire_with(
        &operator,
        &json!({"selector": {"pool": "expiry"}, "ttlSeconds": 10}),
    )
    .await;
    let id = lease_id(&lease);
    let expires_at = timestamp(&lease["expiresAt"]).expect("expiresAt");

    set_new_image(&world, &kubeconfig, "px").await;
    wait_draining_one_lease(&world, "px").await;
    let pod_deleted_at = wait_pod_deleted(
        &world,
        &pod_name,
        &old_uid,
        Duration::from_secs(120),
        "the machine Pod to be deleted once the lease expired",
    )
    .await;
    let after_expiry = millis_between(expires_at, pod_deleted_at);
    eprintln!("lease expiry: the machine was deleted {after_expiry} ms after the lease expired");
    assert!(
        after_expiry >= -200,
        "the machine was deleted {} ms before its lease expired",
        -after_expiry
    );
    wait_ready_on_new_image(&world, "px", &old_uid).await;
    wait_disruption_cleared(&world, "px").await;
    let reason = support::sqlite3(
        &operator.ledger(),
        &format!("SELECT IFNULL(release_reason, '-') FROM leases WHERE id = '{id}'"),
    );
    assert_eq!(reason, "-", "the lease expired; the operator ended nothing");
    let metrics = operator.metrics().await;
    assert_eq!(
        metric_sum(&metrics, "proxy_operator_drain_timeouts_total", &[]),
        0.0
    );
}

/// A replacement's drain cut short by `--drain-timeout`: the machine goes with its lease still
/// held, and the lease is ended as `drain_timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replacement_drain_ends_at_the_drain_timeout() {
    let Some((world, kubeconfig, operator)) = start(
        "fleet-timeout",
        &["--replacement-budget", "1", "--drain-timeout", "3s"],
    )
    .await
    else {
        return;
    };
    let FirstMachine {
        pod_name,
        uid: old_uid,
        ..
    } = ready_managed(&world, "px", "timeout", &[]).await;
    let id = lease_id(&acquire(&operator, "timeout").await);
    let recorder = Recorder::start(&world).await;

    set_new_image(&world, &kubeconfig, "px").await;
    let pod_deleted_at = wait_pod_deleted(
        &world,
        &pod_name,
        &old_uid,
        Duration::from_secs(60),
        "the machine Pod to be deleted at the drain timeout",
    )
    .await;
    let draining = recorder
        .wait_for(
            "px",
            Duration::from_secs(5),
            "a Proxy version showing the drain",
            |v| provisioned(&v["status"])["reason"] == "Draining",
        )
        .await
        .object
        .expect("a version");
    let since = timestamp(&draining["status"]["disruption"]["since"]).expect("disruption.since");
    let waited = millis_between(since, pod_deleted_at);
    eprintln!(
        "replacement drain timeout: the machine was deleted {waited} ms after the drain began"
    );
    assert!(
        waited >= 2_800,
        "the machine was deleted {waited} ms into a 3 s drain with a lease held; versions:\n  {}",
        describe(&recorder.versions("px"))
    );
    wait_ready_on_new_image(&world, "px", &old_uid).await;
    wait_disruption_cleared(&world, "px").await;

    wait_ended_by_drain_timeout(&operator, &id).await;
    assert_renew_refused(&operator, &id, "lease_not_active").await;
    let events = wait_event(&world, "px", "DrainTimedOut").await;
    assert!(events.iter().any(|(t, _)| t == "Warning"), "{events:?}");
    wait_metric(&operator, "proxy_operator_drain_timeouts_total", &[], 1.0).await;
}

/// A drain and the budget live in the Proxies' status, not in the process: after a `kill -9`
/// the drain goes on (same start, the lease still holds it) and the waiting proxy still waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_keeps_the_drain_and_the_budget() {
    let Some((world, kubeconfig, mut operator)) = start("fleet-restart", ONE_AT_A_TIME).await
    else {
        return;
    };
    let names = ["a", "b"];
    let fleet = leased_fleet(&world, &operator, &names).await;
    let recorder = Recorder::start(&world).await;
    let draining = replace_a_while_b_waits(&world, &kubeconfig).await;
    let since = draining["status"]["disruption"]["since"].clone();

    operator.restart();
    operator.wait_ready(Duration::from_secs(90)).await;
    // Several drift polls after the restart: a still drains from the same start, b waits.
    throughout(Duration::from_secs(6), || async {
        let a = proxy_value(&world, "a").await.expect("a");
        assert_eq!(
            provisioned(&a["status"])["reason"],
            "Draining",
            "{}",
            a["status"]
        );
        assert_eq!(a["status"]["disruption"]["since"], since, "{}", a["status"]);
        let b = proxy_value(&world, "b").await.expect("b");
        assert!(
            b["status"]["disruption"].is_null(),
            "b admitted: {}",
            b["status"]
        );
        for name in names {
            let (pod_name, uid) = &fleet.pods[name];
            assert_same_pod(&world, pod_name, uid, "after the restart").await;
        }
    })
    .await;
    // The restarted API knows a is draining.
    operator.wait_listed("a", "a", "draining", true).await;
    assert_renew_refused(&operator, &fleet.leases["a"], "proxy_draining").await;

    // a's lease ends: a is replaced, then b drains and is replaced, one at a time.
    operator.release(&fleet.leases["a"]).await;
    world
        .wait_ready_on_new_pod("a", &fleet.pods["a"].1, SLOW)
        .await;
    drain_and_replace(
        &world,
        &operator,
        &fleet,
        "b",
        "b draining after a finished",
    )
    .await;

    recorder.assert_one_disruption_at_a_time(&names);
    // This process started one drain (b's); a's was started by the one before.
    assert_eq!(
        disruptions(&operator, Some("spec_change")).await,
        1.0,
        "a drain carried over a restart is not a new disruption"
    );
}

/// A machine that dies in the middle of its drain is repaired at once (a repair never waits for
/// leases), and the replacement it was draining for is thereby done: the slot is freed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_machine_lost_during_its_drain_is_repaired_at_once() {
    let Some((world, kubeconfig, operator)) = start("fleet-lost", ONE_AT_A_TIME).await else {
        return;
    };
    let fleet = leased_fleet(&world, &operator, &["a", "b"]).await;
    replace_a_while_b_waits(&world, &kubeconfig).await;

    // a's machine is deleted by hand while its lease still holds the drain.
    let (a_pod, a_uid) = &fleet.pods["a"];
    world
        .pods()
        .delete(a_pod, &DeleteParams::default())
        .await
        .expect("delete a's Pod by hand");
    let deleted = Instant::now();
    wait_ready_on_new_image(&world, "a", a_uid).await;
    eprintln!(
        "lost during drain: a Ready on a new Pod {:?} after its Pod was deleted",
        deleted.elapsed()
    );
    wait_disruption_cleared(&world, "a").await;
    // The slot is free: b drains now, and its replacement completes once its lease ends.
    drain_and_replace(&world, &operator, &fleet, "b", "b draining once a is done").await;
    // a's lease on the machine that vanished: not active any more (ended, with a reason).
    let lease_a = &fleet.leases["a"];
    let row = eventually("a's lease ended", || async {
        let row = support::sqlite3(
            &operator.ledger(),
            &format!(
                "SELECT state || '|' || IFNULL(release_reason, '-') FROM leases WHERE id = '{lease_a}'"
            ),
        );
        (!row.starts_with("active")).then_some(row)
    })
    .await;
    eprintln!("lost during drain: a's lease is now {row}");
}

/// A Proxy deleted while it drains for a replacement: the delete goes on from there (its lease
/// still holds it), and its budget slot goes with it, so the next proxy waiting is admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_proxy_mid_replacement_frees_its_budget_slot() {
    let Some((world, kubeconfig, operator)) = start("fleet-delmid", ONE_AT_A_TIME).await else {
        return;
    };
    let fleet = leased_fleet(&world, &operator, &["a", "b"]).await;
    replace_a_while_b_waits(&world, &kubeconfig).await;

    delete_proxy(&world, &kubeconfig, "a").await;
    let deleting = world
        .wait_proxy("a", "a draining for its delete", |s| {
            s["phase"] == "Deleting" && provisioned(s)["reason"] == "Draining"
        })
        .await;
    assert!(!deleting["metadata"]["deletionTimestamp"].is_null());
    let (a_pod, a_uid) = &fleet.pods["a"];
    assert_same_pod(&world, a_pod, a_uid, "a's lease holds the delete").await;
    operator.release(&fleet.leases["a"]).await;
    let released = Instant::now();
    wait_gone_within(&world, "a", SLOW).await;
    eprintln!(
        "delete mid-replacement: a gone {:?} after its lease ended",
        released.elapsed()
    );
    assert!(
        pod_now(&world, a_pod).await.is_none(),
        "a's Pod outlived it"
    );

    drain_and_replace(&world, &operator, &fleet, "b", "b draining once a is gone").await;
}

// ---------------------------------------------------------------------------------------------
// 2. `kubectl delete` drains too, and the drain timeout ends the leases still held.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_proxy_drains_until_the_drain_timeout() {
    let drain_timeout = Duration::from_secs(3);
    // A delete takes no slot of the budget: with a budget of 0 it still drains and completes.
    let Some((world, kubeconfig, operator)) = start(
        "fleet-delete",
        &["--drain-timeout", "3s", "--replacement-budget", "0"],
    )
    .await
    else {
        return;
    };
    let FirstMachine {
        pod_name,
        uid: pod_uid,
        ..
    } = ready_managed(&world, "px", "delete", &[]).await;
    let lease = acquire(&operator, "delete").await;
    let id = lease_id(&lease);
    let recorder = Recorder::start(&world).await;

    delete_proxy(&world, &kubeconfig, "px").await;
    let deleted = Instant::now();

    // The Pod must outlive the drain: watch it until it is deleted (or gone), noting when.
    let pod_deleted_at = wait_pod_deleted(
        &world,
        &pod_name,
        &pod_uid,
        Duration::from_secs(60),
        "the machine Pod to be deleted after the drain",
    )
    .await;
    let draining = recorder
        .wait_for(
            "px",
            Duration::from_secs(5),
            "a Proxy version showing the drain of a delete",
            |v| {
                let s = &v["status"];
                !v["metadata"]["deletionTimestamp"].is_null()
                    && s["phase"] == "Deleting"
                    && provisioned(s)["reason"] == "Draining"
                    && provisioned(s)["status"] == "False"
            },
        )
        .await;
    let object = draining.object.expect("a version");
    let message = provisioned(&object["status"])["message"].to_string();
    assert!(message.contains("1 active lease"), "{message}");
    let deletion_timestamp =
        timestamp(&object["metadata"]["deletionTimestamp"]).expect("a deletionTimestamp");
    let waited = millis_between(deletion_timestamp, pod_deleted_at);
    eprintln!(
        "delete: Draining seen {:?} after the delete; Pod deleted {waited} ms after the \
         deletionTimestamp",
        draining.at - deleted
    );
    assert!(
        waited + 200 >= drain_timeout.as_millis() as i64,
        "the Pod was deleted {waited} ms after the deletionTimestamp, before the drain timeout \
         ({drain_timeout:?}) with a lease held; versions:\n  {}",
        describe(&recorder.versions("px"))
    );

    // Then the Proxy goes, within a deadline.
    wait_gone_within(&world, "px", Duration::from_secs(60)).await;
    eprintln!(
        "delete: Proxy gone {:?} after the delete",
        deleted.elapsed()
    );
    assert!(
        pod_now(&world, &pod_name).await.is_none(),
        "the Pod outlived its Proxy"
    );

    // The lease was ended by the timeout, on record in the ledger, and an Event says so.
    wait_ended_by_drain_timeout(&operator, &id).await;
    let history = support::sqlite3(
        &operator.ledger(),
        &format!(
            "SELECT kind, reason FROM lease_history WHERE lease_id = '{id}' AND kind = 'released'"
        ),
    );
    assert_eq!(history, "released|drain_timeout", "lease_history");
    let events = wait_event(&world, "px", "DrainTimedOut").await;
    assert!(events.iter().any(|(t, _)| t == "Warning"), "{events:?}");
    wait_metric(&operator, "proxy_operator_drain_timeouts_total", &[], 1.0).await;
    wait_disruptions(&operator, "deleted", 1.0).await;
}

// ---------------------------------------------------------------------------------------------
// 3. The replacement budget: one replacement at a time, and 0 pauses them (not repairs).

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spec_changes_are_replaced_one_at_a_time_within_the_budget() {
    let Some((world, kubeconfig, operator)) = start("fleet-budget", ONE_AT_A_TIME).await else {
        return;
    };
    let names = ["a", "b", "c"];
    let fleet = leased_fleet(&world, &operator, &names).await;
    let recorder = Recorder::start(&world).await;

    // All three specs change at once: a new image for the fleet.
    let start = Instant::now();
    for name in names {
        set_new_image(&world, &kubeconfig, name).await;
    }

    // Drive: each proxy admitted to drain keeps its lease for 3 s (the others must stay
    // pending meanwhile), then its lease is released; done when all three run new Pods.
    let mut admitted: Vec<(&str, Instant)> = Vec::new();
    let mut released = BTreeSet::new();
    let deadline = Duration::from_secs(240);
    loop {
        let mut done = 0;
        for name in names {
            let proxy = proxy_value(&world, name).await.expect("the Proxy");
            let status = &proxy["status"];
            if !status["disruption"].is_null() && !admitted.iter().any(|(n, _)| *n == name) {
                admitted.push((name, Instant::now()));
            }
            if let Some((_, at)) = admitted.iter().find(|(n, _)| *n == name)
                && at.elapsed() >= Duration::from_secs(3)
                && released.insert(name)
            {
                operator.release(&fleet.leases[name]).await;
            }
            if status["phase"] == "Ready" && status["disruption"].is_null() {
                let pod = world.pod_of(&proxy).await;
                if pod.is_some_and(|p| {
                    p.metadata.deletion_timestamp.is_none()
                        && p.uid() != Some(fleet.pods[name].1.clone())
                }) && proxy["metadata"]["generation"] == status["observedGeneration"]
                {
                    done += 1;
                }
            }
        }
        if done == names.len() {
            break;
        }
        assert!(
            start.elapsed() < deadline,
            "not all three replaced after {deadline:?}; admitted {:?}; released {released:?}; \
             versions:\n{}",
            admitted.iter().map(|(n, _)| *n).collect::<Vec<_>>(),
            recorder.describe_all(&names)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    eprintln!(
        "budget: three replacements one at a time in {:?}; order {:?}",
        start.elapsed(),
        admitted
            .iter()
            .map(|(n, at)| (*n, *at - start))
            .collect::<Vec<_>>()
    );
    let order: Vec<&str> = admitted.iter().map(|(n, _)| *n).collect();
    assert_eq!(
        order.len(),
        3,
        "each was drained before its replacement: {order:?}"
    );

    // Replay every version the API server wrote: never two disruptions at once, and the ones
    // waiting showed ReplacementPending while their machine kept serving.
    recorder.assert_one_disruption_at_a_time(&names);
    let mut pending_seen: BTreeSet<String> = BTreeSet::new();
    for seen in recorder.history() {
        let Some(object) = &seen.object else {
            continue;
        };
        let status = &object["status"];
        let p = provisioned(status);
        if p["reason"] == "ReplacementPending" {
            pending_seen.insert(seen.name.clone());
            assert_eq!(p["status"], "True", "{}: {status}", seen.name);
            assert_eq!(status["phase"], "Ready", "{}: {status}", seen.name);
            assert!(status["disruption"].is_null(), "{}: {status}", seen.name);
            let message = p["message"].as_str().unwrap_or_default();
            assert!(message.contains("1 of 1"), "{}: {message:?}", seen.name);
        }
    }
    for name in &order[1..] {
        assert!(
            pending_seen.contains(*name),
            "{name} (admitted after {:?}) never showed ReplacementPending; versions:\n  {}",
            order[0],
            describe(&recorder.versions(name))
        );
    }
    assert_eq!(disruptions(&operator, Some("spec_change")).await, 3.0);
    for name in names {
        let proxy = proxy_value(&world, name).await.expect("the Proxy");
        let pod = world.pod_of(&proxy).await.expect("the new Pod");
        assert_eq!(image_of(&pod).as_deref(), Some(NEW_IMAGE), "{name}");
        let again = acquire(&operator, name).await;
        assert_eq!(again["proxy"]["host"], proxy["status"]["ip"], "{again}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zero_budget_pauses_replacements_but_not_repairs() {
    let Some((world, kubeconfig, operator)) = start("fleet-budget0", NO_REPLACEMENTS).await else {
        return;
    };
    let FirstMachine {
        ready,
        pod_name,
        uid: old_uid,
    } = ready_managed(&world, "px", "zero", &[]).await;
    let old_hash = ready["metadata"]["annotations"][SPEC_HASH_ANNOTATION].clone();

    set_new_image(&world, &kubeconfig, "px").await;
    let pending = wait_provisioned_reason(
        &world,
        "px",
        "ReplacementPending",
        "Provisioned=True/ReplacementPending",
    )
    .await;
    let status = &pending["status"];
    assert_eq!(provisioned(status)["status"], "True", "{status}");
    assert_eq!(status["phase"], "Ready", "the machine serves: {status}");
    assert!(status["disruption"].is_null(), "{status}");
    eprintln!(
        "budget 0: pending message {:?}",
        provisioned(status)["message"]
    );
    // Paused: several drift polls (2 s) later, still the same machine, still pending, and
    // still serving.
    assert_not_replaced_for(&world, &[("px", &old_uid)], Duration::from_secs(6)).await;
    let still = proxy_value(&world, "px").await.expect("the Proxy");
    assert_eq!(
        provisioned(&still["status"])["reason"],
        "ReplacementPending",
        "{}",
        still["status"]
    );
    assert_eq!(still["status"]["phase"], "Ready", "{}", still["status"]);
    let (status, listed) = operator
        .call(Method::GET, "/v1/proxies?selector=pool=zero", None)
        .await;
    assert_eq!(status, StatusCode::OK, "{listed}");
    assert_eq!(listed["proxies"][0]["draining"], false, "{listed}");

    // A repair does not wait for the budget: the Pod deleted by hand comes back at once, with
    // the new spec, and nothing is pending any more.
    let recorder = Recorder::start(&world).await;
    world
        .pods()
        .delete(&pod_name, &DeleteParams::default())
        .await
        .expect("delete the Pod by hand");
    let deleted = Instant::now();
    let (proxy, new_pod) = world.wait_ready_on_new_pod("px", &old_uid, SLOW).await;
    eprintln!(
        "budget 0: repaired, Ready on a new Pod {:?} after the Pod's delete",
        deleted.elapsed()
    );
    assert_eq!(image_of(&new_pod).as_deref(), Some(NEW_IMAGE));
    let status = &proxy["status"];
    assert_ne!(
        proxy["metadata"]["annotations"][SPEC_HASH_ANNOTATION], old_hash,
        "the repair made the new spec"
    );
    let settled = wait_nothing_pending(&world, "px").await;
    assert!(settled["status"]["disruption"].is_null(), "{status}");
    // The new machine was not shown healthy on the old one's verdict: its first version with
    // the new IP is Healthy=Unknown until a probe at that address, so Ready means the operator
    // probes (and leases) that address.
    let new_ip = &status["ip"];
    let first_on_new_ip = recorder
        .versions("px")
        .into_iter()
        .flatten()
        .find(|v| v["status"]["ip"] == *new_ip)
        .expect("a version with the new IP");
    let healthy = condition(&first_on_new_ip["status"], "Healthy");
    assert_eq!(healthy["status"], "Unknown", "{first_on_new_ip}");
    assert_eq!(healthy["reason"], "NotProbed", "{first_on_new_ip}");
    assert_eq!(
        first_on_new_ip["status"]["phase"], "Provisioning",
        "{first_on_new_ip}"
    );
    let lease = acquire(&operator, "zero").await;
    assert_eq!(lease["proxy"]["host"], settled["status"]["ip"], "{lease}");
    assert_eq!(
        disruptions(&operator, None).await,
        0.0,
        "a repair is no disruption"
    );
}

/// A port change waiting for the budget: until the machine is replaced it still listens on the
/// old port, so that is where it must be probed and where leases must send crawlers ("phase
/// stays Ready/Unhealthy (the machine serves)").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pending_port_change_keeps_serving_on_the_running_port() {
    let Some((world, kubeconfig, operator)) = start("fleet-port", NO_REPLACEMENTS).await else {
        return;
    };
    let FirstMachine {
        ready,
        pod_name,
        uid: old_uid,
    } = ready_managed(&world, "px", "port", &[]).await;
    let ip = ready["status"]["ip"].as_str().expect("an IP").to_owned();

    world
        .patch_proxy(&kubeconfig, "px", &json!({"spec": {"port": 3129}}))
        .await;
    wait_provisioned_reason(
        &world,
        "px",
        "ReplacementPending",
        "Provisioned=True/ReplacementPending",
    )
    .await;
    // Several probe intervals (0.5 s, failure threshold 2): still Ready, still healthy.
    throughout(Duration::from_secs(5), || async {
        let proxy = proxy_value(&world, "px").await.expect("the Proxy");
        let status = &proxy["status"];
        assert_eq!(
            status["phase"], "Ready",
            "the machine still serves on 3128 while its replacement waits: {status}"
        );
        assert_same_pod(&world, &pod_name, &old_uid, "pending").await;
    })
    .await;
    let lease = acquire(&operator, "port").await;
    assert_eq!(lease["proxy"]["host"], ip.as_str(), "{lease}");
    assert_eq!(
        lease["proxy"]["port"], 3128,
        "the lease must name the port the running machine listens on: {lease}"
    );
    std::net::TcpStream::connect((ip.as_str(), 3128)).expect("the machine listens on 3128");
}

/// The budget slot is held until the new machine passes a health check, not merely until it
/// runs: a fleet roll must not outrun machines that come up broken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_budget_slot_is_held_until_the_new_machine_is_healthy() {
    let Some((world, kubeconfig, operator)) = start("fleet-slot", ONE_AT_A_TIME).await else {
        return;
    };
    let fleet = leased_fleet(&world, &operator, &["a", "b"]).await;
    replace_a_while_b_waits(&world, &kubeconfig).await;

    // Every probe fails from now on (the probe target answers 500).
    world.target.set_status(500);
    wait_healthy(&world, "a", "False").await;
    operator.release(&fleet.leases["a"]).await;
    // a's new machine runs (its squid started, its IP published) but fails its probes.
    let new_uid = eventually("a's new machine running", || async {
        let proxy = proxy_value(&world, "a").await?;
        let pod = world.pod_of(&proxy).await?;
        let uid = pod.uid()?;
        let address = world.kubelet.address(&world.ns, &pod.name_any())?;
        (uid != fleet.pods["a"].1
            && pod.metadata.deletion_timestamp.is_none()
            && world
                .kubelet
                .started(&world.ns, &pod.name_any())
                .contains(&uid)
            && proxy["status"]["ip"] == address.to_string())
        .then_some(uid)
    })
    .await;
    throughout(Duration::from_secs(5), || async {
        let a = proxy_value(&world, "a").await.expect("a");
        assert!(
            !a["status"]["disruption"].is_null(),
            "a's disruption cleared while its new machine fails every probe: {}",
            a["status"]
        );
        let b = proxy_value(&world, "b").await.expect("b");
        assert!(
            b["status"]["disruption"].is_null(),
            "b admitted while a's new machine is unhealthy: {}",
            b["status"]
        );
    })
    .await;

    // Probes pass again: a is done, b's turn.
    world.target.set_status(204);
    let done = wait_disruption_cleared(&world, "a").await;
    assert_eq!(
        world.pod_of(&done).await.and_then(|p| p.uid()),
        Some(new_uid),
        "a kept the machine it was given"
    );
    drain_and_replace(
        &world,
        &operator,
        &fleet,
        "b",
        "b draining once a is healthy",
    )
    .await;
}

/// A spec change reverted while it waits for the budget is no change: nothing is replaced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spec_change_reverted_while_pending_replaces_nothing() {
    let Some((world, kubeconfig, _operator)) = start("fleet-revert", NO_REPLACEMENTS).await else {
        return;
    };
    let FirstMachine { ready, uid, .. } = ready_managed(&world, "px", "revert", &[]).await;
    let hash = ready["metadata"]["annotations"][SPEC_HASH_ANNOTATION].clone();
    set_new_image(&world, &kubeconfig, "px").await;
    wait_provisioned_reason(&world, "px", "ReplacementPending", "ReplacementPending").await;
    world
        .patch_proxy(&kubeconfig, "px", &json!({"spec": {"placement": null}}))
        .await;
    let settled = wait_nothing_pending(&world, "px").await;
    assert_eq!(settled["status"]["phase"], "Ready", "{}", settled["status"]);
    assert_eq!(
        settled["metadata"]["annotations"][SPEC_HASH_ANNOTATION],
        hash
    );
    assert_not_replaced_for(&world, &[("px", &uid)], Duration::from_secs(4)).await;
}

// ---------------------------------------------------------------------------------------------
// 4. Remediation of unhealthy machines, and its short-circuit.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unhealthy_machine_is_replaced_after_remediate_after() {
    let Some((world, _, operator)) = start("fleet-remedy", REMEDIATION).await else {
        return;
    };
    let names = ["a", "b", "c"];
    let pods = ready_fleet_of(&world, &names, remediation_spec(&world)).await;

    // b's squid hangs: its Pod still says Running and Ready, only probes can tell.
    let (b_pod, b_uid) = pods["b"].clone();
    let frozen = world
        .kubelet
        .freeze_squid_of(&world.ns, &b_pod)
        .expect("b's squid runs");
    assert_eq!(frozen, b_uid);
    let froze = Instant::now();
    let unhealthy = wait_healthy(&world, "b", "False").await;
    let seen_unhealthy = Instant::now();
    eprintln!(
        "remediation: b unhealthy {:?} after its squid froze",
        seen_unhealthy - froze
    );
    assert_eq!(
        unhealthy["status"]["phase"], "Unhealthy",
        "{}",
        unhealthy["status"]
    );

    let (proxy, new_pod) = world.wait_ready_on_new_pod("b", &b_uid, SLOW).await;
    let replaced_after = seen_unhealthy.elapsed();
    eprintln!("remediation: b Ready on a new Pod {replaced_after:?} after it was seen unhealthy");
    assert_ne!(new_pod.uid(), Some(b_uid.clone()));
    assert!(
        replaced_after >= Duration::from_secs(2),
        "replaced {replaced_after:?} after turning unhealthy, before --remediate-after (3 s)"
    );
    assert_eq!(condition(&proxy["status"], "Healthy")["status"], "True");
    wait_disruption_cleared(&world, "b").await;
    let events = wait_event(&world, "b", "Draining").await;
    assert!(!events.is_empty());
    wait_disruptions(&operator, "unhealthy", 1.0).await;
    wait_remediation_paused(&operator, 0.0).await;
    // The healthy ones were left alone.
    for name in ["a", "c"] {
        let (pod_name, uid) = &pods[name];
        assert_same_pod(&world, pod_name, uid, name).await;
    }
    let reasons = world.event_reasons("b").await;
    assert!(
        !reasons.iter().any(|r| r == "RemediationPaused"),
        "{reasons:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remediation_pauses_when_too_many_are_unhealthy() {
    let Some((world, _, operator)) = start("fleet-pause", REMEDIATION).await else {
        return;
    };
    let names = ["a", "b", "c"];
    let pods = ready_fleet_of(&world, &names, remediation_spec(&world)).await;

    // Two of three hang at once: 67 % > 50 %, a sign of something wider than two machines.
    for name in ["a", "b"] {
        let (pod_name, uid) = &pods[name];
        let frozen = world
            .kubelet
            .freeze_squid_of(&world.ns, pod_name)
            .unwrap_or_else(|| panic!("{name}'s squid runs"));
        assert_eq!(&frozen, uid);
    }
    wait_healthy(&world, "a", "False").await;
    wait_healthy(&world, "b", "False").await;
    let both_unhealthy = Instant::now();

    let paused = eventually("a RemediationPaused Event on a or b", || async {
        let mut events = world.events_with_reason("a", "RemediationPaused").await;
        events.extend(world.events_with_reason("b", "RemediationPaused").await);
        (!events.is_empty()).then_some(events)
    })
    .await;
    assert!(paused.iter().all(|(t, _)| t == "Warning"), "{paused:?}");
    eprintln!(
        "remediation paused: Event {:?} after both were unhealthy: {paused:?}",
        both_unhealthy.elapsed()
    );
    wait_remediation_paused(&operator, 1.0).await;
    // Well past --remediate-after (3 s): nothing replaced.
    assert_not_replaced_for(
        &world,
        &[
            ("a", &pods["a"].1),
            ("b", &pods["b"].1),
            ("c", &pods["c"].1),
        ],
        Duration::from_secs(8),
    )
    .await;
    assert_eq!(
        disruptions(&operator, None).await,
        0.0,
        "nothing may be disrupted while remediation is paused"
    );
    // Once per wait: one Event per proxy, not one per reconcile.
    for name in ["a", "b"] {
        let events = world.events_with_reason(name, "RemediationPaused").await;
        assert!(events.len() <= 1, "{name}: {events:?}");
    }

    // a recovers: one of three unhealthy is within 50 %, so b is remediated now.
    let (a_pod, a_uid) = &pods["a"];
    world
        .kubelet
        .thaw_squid_of(&world.ns, a_pod)
        .expect("a's squid still runs");
    let thawed = Instant::now();
    wait_healthy(&world, "a", "True").await;
    let (_, _) = world.wait_ready_on_new_pod("b", &pods["b"].1, SLOW).await;
    eprintln!(
        "remediation resumed: b Ready on a new Pod {:?} after a recovered",
        thawed.elapsed()
    );
    assert_same_pod(&world, a_pod, a_uid, "a recovered").await;
    wait_remediation_paused(&operator, 0.0).await;
    wait_disruptions(&operator, "unhealthy", 1.0).await;
}

// ---------------------------------------------------------------------------------------------
// 5. Rotation: the rotate annotation and spec.maxLifetime.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rotate_annotation_replaces_the_machine_once_per_value() {
    let Some((world, kubeconfig, operator)) = start("fleet-rotate", &[]).await else {
        return;
    };
    // Created with a rotate value: the first machine records it, nothing rotates.
    let FirstMachine {
        ready,
        uid: first_uid,
        ..
    } = ready_managed(&world, "px", "rotate", &[(ROTATE_ANNOTATION, "r0")]).await;
    let annotations = &ready["metadata"]["annotations"];
    assert_eq!(annotations[ROTATED_ANNOTATION], "r0", "{annotations}");
    assert_not_replaced_for(&world, &[("px", &first_uid)], Duration::from_secs(3)).await;
    let created_before = machine_created_at(&ready);

    // A new value rotates now, through a drain (a lease shows it).
    let lease = acquire(&operator, "rotate").await;
    annotate(&world, &kubeconfig, "px", &[(ROTATE_ANNOTATION, "r1")]).await;
    let annotated = Instant::now();
    let draining =
        wait_provisioned_reason(&world, "px", "Draining", "a drain for the rotation").await;
    assert_eq!(
        draining["status"]["disruption"]["reason"], "RotateRequested",
        "{}",
        draining["status"]
    );
    operator.release(&lease_id(&lease)).await;
    let (proxy, _) = world.wait_ready_on_new_pod("px", &first_uid, SLOW).await;
    eprintln!(
        "rotate: Ready on a new Pod {:?} after the annotation",
        annotated.elapsed()
    );
    assert_eq!(
        proxy["metadata"]["annotations"][ROTATED_ANNOTATION], "r1",
        "{}",
        proxy["metadata"]
    );
    let done = wait_disruption_cleared(&world, "px").await;
    let created_after = machine_created_at(&done);
    assert!(
        created_after > created_before,
        "{created_after} vs {created_before}"
    );
    let second_uid = world
        .pod_of(&done)
        .await
        .expect("the new Pod")
        .uid()
        .expect("a UID");
    wait_disruptions(&operator, "rotate_requested", 1.0).await;

    // The same value again (with another annotation, so the object does change) rotates
    // nothing.
    annotate(
        &world,
        &kubeconfig,
        "px",
        &[(ROTATE_ANNOTATION, "r1"), ("example.com/touched", "1")],
    )
    .await;
    assert_not_replaced_for(&world, &[("px", &second_uid)], Duration::from_secs(6)).await;
    // Removing the annotation (a GitOps revert) asks for nothing either.
    let removed = format!("{ROTATE_ANNOTATION}-");
    if world
        .kubectl(&kubeconfig, &["annotate", "px", "px", &removed])
        .is_none()
    {
        world
            .raw_proxies()
            .patch(
                "px",
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"annotations": {ROTATE_ANNOTATION: null}}})),
            )
            .await
            .expect("remove the rotate annotation");
    }
    assert_not_replaced_for(&world, &[("px", &second_uid)], Duration::from_secs(6)).await;
    assert_eq!(disruptions(&operator, Some("rotate_requested")).await, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_lifetime_rotates_the_machine_at_its_age() {
    let Some((world, kubeconfig, operator)) = start("fleet-lifetime", &[]).await else {
        return;
    };

    // The server refuses a life shorter than a minute.
    let mut short = world.managed_spec(3128);
    short["maxLifetime"] = json!("30s");
    let refused = world.create("short", short).await;
    let message = support::world::refusal(refused);
    assert!(message.contains("at least 1m"), "{message}");

    let FirstMachine {
        ready,
        pod_name,
        uid: old_uid,
    } = ready_managed(&world, "px", "life", &[]).await;
    let created = machine_created_at(&ready);
    let lease = acquire(&operator, "life").await;

    // maxLifetime is not in the spec hash: setting it replaces nothing by itself.
    world
        .patch_proxy(&kubeconfig, "px", &json!({"spec": {"maxLifetime": "1m"}}))
        .await;
    let hash = ready["metadata"]["annotations"][SPEC_HASH_ANNOTATION].clone();
    assert_not_replaced_for(&world, &[("px", &old_uid)], Duration::from_secs(3)).await;
    let after = proxy_value(&world, "px").await.expect("the Proxy");
    assert_eq!(after["metadata"]["annotations"][SPEC_HASH_ANNOTATION], hash);

    // At 54 to 60 s of age (a jitter of up to 10 %), the drain starts; the lease holds it, so
    // the disruption can be read.
    let rotating = within(
        Duration::from_secs(100),
        "the maxLifetime drain",
        || async {
            let proxy = proxy_value(&world, "px").await?;
            if proxy["status"]["disruption"].is_null() {
                // Until then the machine is the old one.
                assert_same_pod(&world, &pod_name, &old_uid, "before maxLifetime").await;
                return None;
            }
            Some(proxy)
        },
    )
    .await;
    let status = &rotating["status"];
    assert_eq!(status["disruption"]["reason"], "MaxLifetime", "{status}");
    assert_eq!(provisioned(status)["reason"], "Draining", "{status}");
    let since = timestamp(&status["disruption"]["since"]).expect("disruption.since");
    let age = millis_between(created, since);
    eprintln!("maxLifetime 1m: drain started at a machine age of {age} ms");
    assert!(
        (53_000..=70_000).contains(&age),
        "drain started at age {age} ms; expected 54-60 s (plus slack for a requeue)"
    );
    assert_same_pod(&world, &pod_name, &old_uid, "draining").await;

    operator.release(&lease_id(&lease)).await;
    let (_, new_pod) = world.wait_ready_on_new_pod("px", &old_uid, SLOW).await;
    assert_ne!(new_pod.uid(), Some(old_uid));
    let done = wait_disruption_cleared(&world, "px").await;
    let created_after = machine_created_at(&done);
    assert!(created_after > created, "{created_after} vs {created}");
    wait_disruptions(&operator, "max_lifetime", 1.0).await;
}
