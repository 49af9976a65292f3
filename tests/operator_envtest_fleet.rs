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

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::events::v1::Event;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher;
use proxy_operator::naming::machine_name;
use proxy_operator::proxy::{ROTATE_ANNOTATION, ROTATED_ANNOTATION, SPEC_HASH_ANNOTATION};
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use support::operator::{OperatorProcess, metric_sum};
use support::world::{SLOW, World, eventually, within};

/// Lease TTL in these tests: far longer than any of them, so only a release, the operator or a
/// drain timeout ends a lease.
const LEASE_TTL: u64 = 600;

/// A new container image for the squid Pods (`spec.placement.image`): the spec change of a
/// fleet-wide image upgrade. The test kubelet runs the Pod's squid configuration whatever the
/// image, so only the Pod shows it.
const NEW_IMAGE: &str = "ubuntu/squid:6.10-24.10_edge";

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

/// `b - a` in milliseconds.
fn millis_between(a: jiff::Timestamp, b: jiff::Timestamp) -> i64 {
    b.as_millisecond() - a.as_millisecond()
}

/// Writes the admin kubeconfig for `kubectl` into the world's directory.
fn admin_kubeconfig(world: &World) -> PathBuf {
    let path = world.dir.path().join("admin.kubeconfig");
    world.cp.write_admin_kubeconfig(&path);
    path
}

/// Runs `kubectl` with the admin kubeconfig in the world's namespace; `None` when kubectl is
/// not installed.
fn kubectl(kubeconfig: &Path, ns: &str, args: &[&str]) -> Option<String> {
    let output = match Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(["-n", ns])
        .args(args)
        .output()
    {
        Ok(output) => output,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => panic!("run kubectl: {e}"),
    };
    assert!(
        output.status.success(),
        "kubectl {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Some(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// `kubectl patch px <name> --type merge -p <patch>` (through the client without kubectl).
async fn patch_proxy(world: &World, kubeconfig: &Path, name: &str, patch: Value) {
    let text = patch.to_string();
    let args = ["patch", "px", name, "--type", "merge", "-p", text.as_str()];
    if kubectl(kubeconfig, &world.ns, &args).is_none() {
        world
            .raw_proxies()
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .unwrap_or_else(|e| panic!("patch Proxy {name} with {patch}: {e}"));
    }
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
    if kubectl(kubeconfig, &world.ns, &args).is_none() {
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
    if kubectl(
        kubeconfig,
        &world.ns,
        &["delete", "px", name, "--wait=false"],
    )
    .is_none()
    {
        world
            .proxies()
            .delete(name, &DeleteParams::default())
            .await
            .unwrap_or_else(|e| panic!("delete Proxy {name}: {e}"));
    }
}

/// Creates a Proxy labelled `pool: <pool>` (each proxy of a test a selector of its own), with
/// extra `annotations`.
async fn create_in_pool(
    world: &World,
    name: &str,
    pool: &str,
    annotations: Value,
    spec: Value,
) -> String {
    let object = serde_json::from_value(json!({
        "apiVersion": "crawl.example.com/v1alpha1",
        "kind": "Proxy",
        "metadata": {"name": name, "labels": {"pool": pool}, "annotations": annotations},
        "spec": spec,
    }))
    .expect("a Proxy object");
    let created = world
        .raw_proxies()
        .create(&PostParams::default(), &object)
        .await
        .unwrap_or_else(|e| panic!("create Proxy {name}: {e}"));
    created.metadata.uid.expect("the server sets a UID")
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
    let until = Instant::now() + period;
    while Instant::now() < until {
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
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Waits (up to `deadline`) until the Proxy `name` is Ready on a Pod other than `old_uid`, with
/// the IP the kubelet published for that Pod; returns the Proxy and the new Pod.
async fn wait_ready_on_new_pod(
    world: &World,
    name: &str,
    old_uid: &str,
    deadline: Duration,
) -> (Value, Pod) {
    within(
        deadline,
        &format!("Proxy {name} Ready again on a Pod other than {old_uid}"),
        || async {
            let proxy = proxy_value(world, name).await?;
            let status = &proxy["status"];
            if status["phase"] != "Ready" {
                return None;
            }
            let pod = world.pod_of(&proxy).await?;
            if pod.metadata.uid.as_deref() == Some(old_uid)
                || pod.metadata.deletion_timestamp.is_some()
            {
                return None;
            }
            let address = world.kubelet.address(&world.ns, &pod.name_any())?;
            (status["ip"] == address.to_string()).then_some((proxy, pod))
        },
    )
    .await
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
        json!({"selector": {"pool": pool}, "ttlSeconds": LEASE_TTL}),
    )
    .await
}

/// Acquires a lease with the request `body`, retrying while the answer is 409.
async fn acquire_with(operator: &OperatorProcess, body: Value) -> Value {
    within(SLOW, &format!("a lease for {body}"), || async {
        let (status, lease) = operator
            .call(Method::POST, "/v1/leases", Some(body.clone()))
            .await;
        match status {
            StatusCode::CREATED => Some(lease),
            StatusCode::CONFLICT => None,
            other => panic!("acquire {body} answered {other}: {lease}"),
        }
    })
    .await
}

fn lease_id(lease: &Value) -> String {
    lease["leaseID"].as_str().expect("a lease ID").to_owned()
}

async fn release(operator: &OperatorProcess, id: &str) {
    let (status, body) = operator
        .call(Method::DELETE, &format!("/v1/leases/{id}"), None)
        .await;
    assert_eq!(status, StatusCode::NO_CONTENT, "release {id}: {body}");
}

/// The listed proxy `name` of `pool`, once it shows `draining: <value>`.
async fn wait_listed_draining(
    operator: &OperatorProcess,
    pool: &str,
    name: &str,
    value: bool,
) -> Value {
    eventually(
        &format!("{name} listed by the API with draining: {value}"),
        || async {
            let (status, list) = operator
                .call(
                    Method::GET,
                    &format!("/v1/proxies?selector=pool={pool}"),
                    None,
                )
                .await;
            assert_eq!(status, StatusCode::OK, "{list}");
            list["proxies"]
                .as_array()?
                .iter()
                .find(|p| p["name"] == name && p["draining"] == value)
                .cloned()
        },
    )
    .await
}

/// `(type, note)` of every Event about the object `name` with this `reason`.
async fn events_with_reason(world: &World, name: &str, reason: &str) -> Vec<(String, String)> {
    let events: Api<Event> = Api::namespaced(world.client.clone(), &world.ns);
    events
        .list(&ListParams::default())
        .await
        .expect("list events")
        .items
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
        .filter(|e| e.reason.as_deref() == Some(reason))
        .map(|e| (e.type_.unwrap_or_default(), e.note.unwrap_or_default()))
        .collect()
}

/// Waits for at least one Event `reason` about `name`; returns them all.
async fn wait_event(world: &World, name: &str, reason: &str) -> Vec<(String, String)> {
    eventually(&format!("an Event {reason} about {name}"), || async {
        let events = events_with_reason(world, name, reason).await;
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
    let Some(world) = World::new("fleet-spec").await else {
        return;
    };
    let kubeconfig = admin_kubeconfig(&world);
    let operator = world
        .operator(&["--replacement-budget", "1", "--drain-timeout", "10m"])
        .await;
    create_in_pool(&world, "px", "spec", json!({}), world.managed_spec(3128)).await;
    let ready = world.wait_ready("px").await;
    let old_pod = world.pod_of(&ready).await.expect("the machine Pod");
    let pod_name = old_pod.name_any();
    let old_uid = old_pod.uid().expect("a Pod UID");
    let created_before = timestamp(&ready["status"]["machineCreatedAt"])
        .unwrap_or_else(|| panic!("no status.machineCreatedAt: {}", ready["status"]));
    assert!(
        ready["status"]["disruption"].is_null(),
        "{}",
        ready["status"]
    );
    let old_hash = ready["metadata"]["annotations"][SPEC_HASH_ANNOTATION].clone();
    assert!(old_hash.is_string(), "{ready}");

    let first =
        json!({"selector": {"pool": "spec"}, "ttlSeconds": LEASE_TTL, "requestID": "spec-1"});
    let lease = acquire_with(&operator, first.clone()).await;
    assert_eq!(lease["proxy"]["name"], "px", "{lease}");
    assert_eq!(lease["proxy"]["port"], 3128, "{lease}");
    let id = lease_id(&lease);

    // A new port is a new spec hash: the machine must be replaced, but it holds a lease.
    patch_proxy(&world, &kubeconfig, "px", json!({"spec": {"port": 3129}})).await;
    let changed = Instant::now();
    let draining = world
        .wait_proxy(
            "px",
            "Provisioned=False/Draining with 1 active lease",
            |s| {
                let p = provisioned(s);
                p["reason"] == "Draining"
                    && p["message"]
                        .as_str()
                        .is_some_and(|m| m.contains("1 active lease"))
            },
        )
        .await;
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
    let listed = wait_listed_draining(&operator, "spec", "px", true).await;
    assert_eq!(listed["activeLeases"], 1, "{listed}");
    // The draining machine still listens on the port it was made with, and is probed there.
    assert_eq!(listed["port"], 3128, "{listed}");
    let settled = Instant::now() + Duration::from_secs(3);
    while Instant::now() < settled {
        let listed = wait_listed_draining(&operator, "spec", "px", true).await;
        assert_eq!(
            listed["healthy"], true,
            "the draining machine serves: {listed}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
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
    let (status, body) = operator
        .call(
            Method::POST,
            &format!("/v1/leases/{id}/renew"),
            Some(json!({"ttlSeconds": 120})),
        )
        .await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert_eq!(body["error"], "proxy_draining", "{body}");
    let (status, body) = operator
        .call(
            Method::POST,
            &format!("/v1/leases/{id}/report"),
            Some(json!({"result": "ok", "target": "example.com"})),
        )
        .await;
    assert_eq!(status, StatusCode::NO_CONTENT, "{body}");
    let (status, view) = operator
        .call(Method::GET, &format!("/v1/leases/{id}"), None)
        .await;
    assert_eq!(status, StatusCode::OK, "{view}");
    assert_eq!(view["state"], "active", "{view}");
    // A retried acquire (same requestID) still answers with the lease it got.
    let (status, replay) = operator
        .call(Method::POST, "/v1/leases", Some(first.clone()))
        .await;
    assert_eq!(status, StatusCode::OK, "{replay}");
    assert_eq!(replay["leaseID"], id.as_str(), "{replay}");

    let events = wait_event(&world, "px", "Draining").await;
    assert!(events.iter().any(|(t, _)| t == "Normal"), "{events:?}");
    wait_metric(
        &operator,
        "proxy_operator_disruptions_total",
        &["reason=\"spec_change\""],
        1.0,
    )
    .await;
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
    assert_not_replaced_for_draining(&world, &pod_name, &old_uid, Duration::from_secs(4)).await;

    // The last lease ends: the machine goes and a new one on the new port takes its place.
    release(&operator, &id).await;
    let released = Instant::now();
    let (proxy, new_pod) = wait_ready_on_new_pod(&world, "px", &old_uid, SLOW).await;
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
    let created_after = timestamp(&status["machineCreatedAt"])
        .unwrap_or_else(|| panic!("no status.machineCreatedAt: {status}"));
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
    let metrics = operator.metrics().await;
    assert_eq!(
        metric_sum(
            &metrics,
            "proxy_operator_disruptions_total",
            &["reason=\"spec_change\""]
        ),
        1.0,
        "one disruption for one spec change"
    );
}

/// Asserts, for `period`, that the draining proxy's Pod `uid` is still there and running.
async fn assert_not_replaced_for_draining(
    world: &World,
    pod_name: &str,
    uid: &str,
    period: Duration,
) {
    let until = Instant::now() + period;
    while Instant::now() < until {
        assert_same_pod(world, pod_name, uid, "while a lease holds the drain").await;
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Crawlers whose renewals are refused let their leases run out: the drain ends when the last
/// one expires, long before the drain timeout, and nothing is ended by the operator.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_ends_when_the_last_lease_expires() {
    let Some(world) = World::new("fleet-expiry").await else {
        return;
    };
    let kubeconfig = admin_kubeconfig(&world);
    let operator = world
        .operator(&["--replacement-budget", "1", "--drain-timeout", "10m"])
        .await;
    create_in_pool(&world, "px", "expiry", json!({}), world.managed_spec(3128)).await;
    let ready = world.wait_ready("px").await;
    let pod = world.pod_of(&ready).await.expect("the machine Pod");
    let pod_name = pod.name_any();
    let old_uid = pod.uid().expect("a Pod UID");
    let lease = acquire_with(
        &operator,
        json!({"selector": {"pool": "expiry"}, "ttlSeconds": 10}),
    )
    .await;
    let id = lease_id(&lease);
    let expires_at = timestamp(&lease["expiresAt"]).expect("expiresAt");

    patch_proxy(
        &world,
        &kubeconfig,
        "px",
        json!({"spec": {"placement": {"image": NEW_IMAGE}}}),
    )
    .await;
    world
        .wait_proxy(
            "px",
            "Provisioned=False/Draining with 1 active lease",
            |s| {
                let p = provisioned(s);
                p["reason"] == "Draining"
                    && p["message"]
                        .as_str()
                        .is_some_and(|m| m.contains("1 active lease"))
            },
        )
        .await;
    let pod_deleted_at = within(
        Duration::from_secs(120),
        "the machine Pod to be deleted once the lease expired",
        || async {
            match pod_now(&world, &pod_name).await {
                Some((uid, false)) if uid == old_uid => None,
                _ => Some(jiff::Timestamp::now()),
            }
        },
    )
    .await;
    let after_expiry = millis_between(expires_at, pod_deleted_at);
    eprintln!("lease expiry: the machine was deleted {after_expiry} ms after the lease expired");
    assert!(
        after_expiry >= -200,
        "the machine was deleted {} ms before its lease expired",
        -after_expiry
    );
    let (_, new_pod) = wait_ready_on_new_pod(&world, "px", &old_uid, SLOW).await;
    assert_eq!(image_of(&new_pod).as_deref(), Some(NEW_IMAGE));
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
    let Some(world) = World::new("fleet-timeout").await else {
        return;
    };
    let kubeconfig = admin_kubeconfig(&world);
    let operator = world
        .operator(&["--replacement-budget", "1", "--drain-timeout", "3s"])
        .await;
    create_in_pool(&world, "px", "timeout", json!({}), world.managed_spec(3128)).await;
    let ready = world.wait_ready("px").await;
    let pod = world.pod_of(&ready).await.expect("the machine Pod");
    let pod_name = pod.name_any();
    let old_uid = pod.uid().expect("a Pod UID");
    let id = lease_id(&acquire(&operator, "timeout").await);
    let recorder = Recorder::start(&world).await;

    patch_proxy(
        &world,
        &kubeconfig,
        "px",
        json!({"spec": {"placement": {"image": NEW_IMAGE}}}),
    )
    .await;
    let pod_deleted_at = within(
        Duration::from_secs(60),
        "the machine Pod to be deleted at the drain timeout",
        || async {
            match pod_now(&world, &pod_name).await {
                Some((uid, false)) if uid == old_uid => None,
                _ => Some(jiff::Timestamp::now()),
            }
        },
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
    let (_, new_pod) = wait_ready_on_new_pod(&world, "px", &old_uid, SLOW).await;
    assert_eq!(image_of(&new_pod).as_deref(), Some(NEW_IMAGE));
    wait_disruption_cleared(&world, "px").await;

    let ledger = operator.ledger();
    eventually("the lease ended by the drain timeout", || async {
        let row = support::sqlite3(
            &ledger,
            &format!("SELECT state, release_reason FROM leases WHERE id = '{id}'"),
        );
        (row == "released|drain_timeout").then_some(())
    })
    .await;
    let (status, body) = operator
        .call(
            Method::POST,
            &format!("/v1/leases/{id}/renew"),
            Some(json!({"ttlSeconds": 60})),
        )
        .await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert_eq!(body["error"], "lease_not_active", "{body}");
    let events = wait_event(&world, "px", "DrainTimedOut").await;
    assert!(events.iter().any(|(t, _)| t == "Warning"), "{events:?}");
    wait_metric(&operator, "proxy_operator_drain_timeouts_total", &[], 1.0).await;
}

/// A drain and the budget live in the Proxies' status, not in the process: after a `kill -9`
/// the drain goes on (same start, the lease still holds it) and the waiting proxy still waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_keeps_the_drain_and_the_budget() {
    let Some(world) = World::new("fleet-restart").await else {
        return;
    };
    let kubeconfig = admin_kubeconfig(&world);
    let mut operator = world
        .operator(&["--replacement-budget", "1", "--drain-timeout", "10m"])
        .await;
    let names = ["a", "b"];
    let mut uids = BTreeMap::new();
    let mut leases = BTreeMap::new();
    for name in names {
        create_in_pool(&world, name, name, json!({}), world.managed_spec(3128)).await;
    }
    for name in names {
        let ready = world.wait_ready(name).await;
        let pod = world.pod_of(&ready).await.expect("the machine Pod");
        uids.insert(name, pod.uid().expect("a Pod UID"));
        leases.insert(name, lease_id(&acquire(&operator, name).await));
    }
    let recorder = Recorder::start(&world).await;
    let image = json!({"spec": {"placement": {"image": NEW_IMAGE}}});
    patch_proxy(&world, &kubeconfig, "a", image.clone()).await;
    let draining = world
        .wait_proxy("a", "a draining", |s| {
            provisioned(s)["reason"] == "Draining"
        })
        .await;
    let since = draining["status"]["disruption"]["since"].clone();
    patch_proxy(&world, &kubeconfig, "b", image).await;
    world
        .wait_proxy("b", "b waiting for the budget", |s| {
            provisioned(s)["reason"] == "ReplacementPending"
        })
        .await;

    operator.restart();
    operator.wait_ready(Duration::from_secs(90)).await;
    let restarted = Instant::now();
    // Several drift polls after the restart: a still drains from the same start, b waits.
    while restarted.elapsed() < Duration::from_secs(6) {
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
            let pod_name = machine_name(if name == "a" {
                a["metadata"]["uid"].as_str().expect("a UID")
            } else {
                b["metadata"]["uid"].as_str().expect("a UID")
            });
            assert_same_pod(&world, &pod_name, &uids[name], "after the restart").await;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    // The restarted API knows a is draining.
    wait_listed_draining(&operator, "a", "a", true).await;
    let (status, body) = operator
        .call(
            Method::POST,
            &format!("/v1/leases/{}/renew", leases["a"]),
            Some(json!({"ttlSeconds": 60})),
        )
        .await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert_eq!(body["error"], "proxy_draining", "{body}");

    // a's lease ends: a is replaced, then b drains and is replaced, one at a time.
    release(&operator, &leases["a"]).await;
    wait_ready_on_new_pod(&world, "a", &uids["a"], SLOW).await;
    world
        .wait_proxy("b", "b draining after a finished", |s| {
            provisioned(s)["reason"] == "Draining"
        })
        .await;
    release(&operator, &leases["b"]).await;
    wait_ready_on_new_pod(&world, "b", &uids["b"], SLOW).await;
    wait_disruption_cleared(&world, "b").await;

    let mut disrupted: BTreeMap<String, bool> = BTreeMap::new();
    for seen in recorder.history() {
        let Some(object) = &seen.object else {
            continue;
        };
        disrupted.insert(seen.name.clone(), !object["status"]["disruption"].is_null());
        assert!(
            disrupted.values().filter(|d| **d).count() <= 1,
            "a and b disrupted at once with a budget of 1; versions:\na:\n  {}\nb:\n  {}",
            describe(&recorder.versions("a")),
            describe(&recorder.versions("b"))
        );
    }
    // This process started one drain (b's); a's was started by the one before.
    let metrics = operator.metrics().await;
    assert_eq!(
        metric_sum(
            &metrics,
            "proxy_operator_disruptions_total",
            &["reason=\"spec_change\""]
        ),
        1.0,
        "a drain carried over a restart is not a new disruption"
    );
}

/// A machine that dies in the middle of its drain is repaired at once (a repair never waits for
/// leases), and the replacement it was draining for is thereby done: the slot is freed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_machine_lost_during_its_drain_is_repaired_at_once() {
    let Some(world) = World::new("fleet-lost").await else {
        return;
    };
    let kubeconfig = admin_kubeconfig(&world);
    let operator = world
        .operator(&["--replacement-budget", "1", "--drain-timeout", "10m"])
        .await;
    for name in ["a", "b"] {
        create_in_pool(&world, name, name, json!({}), world.managed_spec(3128)).await;
    }
    let mut uids = BTreeMap::new();
    for name in ["a", "b"] {
        let ready = world.wait_ready(name).await;
        let pod = world.pod_of(&ready).await.expect("the machine Pod");
        uids.insert(name, (pod.name_any(), pod.uid().expect("a Pod UID")));
    }
    let lease_a = lease_id(&acquire(&operator, "a").await);
    let lease_b = lease_id(&acquire(&operator, "b").await);
    let image = json!({"spec": {"placement": {"image": NEW_IMAGE}}});
    patch_proxy(&world, &kubeconfig, "a", image.clone()).await;
    world
        .wait_proxy("a", "a draining", |s| {
            provisioned(s)["reason"] == "Draining"
        })
        .await;
    patch_proxy(&world, &kubeconfig, "b", image).await;
    world
        .wait_proxy("b", "b waiting for the budget", |s| {
            provisioned(s)["reason"] == "ReplacementPending"
        })
        .await;

    // a's machine is deleted by hand while its lease still holds the drain.
    let (a_pod, a_uid) = uids["a"].clone();
    world
        .pods()
        .delete(&a_pod, &DeleteParams::default())
        .await
        .expect("delete a's Pod by hand");
    let deleted = Instant::now();
    let (_, new_pod) = wait_ready_on_new_pod(&world, "a", &a_uid, SLOW).await;
    eprintln!(
        "lost during drain: a Ready on a new Pod {:?} after its Pod was deleted",
        deleted.elapsed()
    );
    assert_eq!(image_of(&new_pod).as_deref(), Some(NEW_IMAGE));
    wait_disruption_cleared(&world, "a").await;
    // The slot is free: b drains now, and its replacement completes once its lease ends.
    world
        .wait_proxy("b", "b draining once a is done", |s| {
            provisioned(s)["reason"] == "Draining"
        })
        .await;
    release(&operator, &lease_b).await;
    wait_ready_on_new_pod(&world, "b", &uids["b"].1, SLOW).await;
    wait_disruption_cleared(&world, "b").await;
    // a's lease on the machine that vanished: not active any more (ended, with a reason).
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
    let Some(world) = World::new("fleet-delmid").await else {
        return;
    };
    let kubeconfig = admin_kubeconfig(&world);
    let operator = world
        .operator(&["--replacement-budget", "1", "--drain-timeout", "10m"])
        .await;
    for name in ["a", "b"] {
        create_in_pool(&world, name, name, json!({}), world.managed_spec(3128)).await;
    }
    let mut uids = BTreeMap::new();
    for name in ["a", "b"] {
        let ready = world.wait_ready(name).await;
        let pod = world.pod_of(&ready).await.expect("the machine Pod");
        uids.insert(name, (pod.name_any(), pod.uid().expect("a Pod UID")));
    }
    let lease_a = lease_id(&acquire(&operator, "a").await);
    let lease_b = lease_id(&acquire(&operator, "b").await);
    let image = json!({"spec": {"placement": {"image": NEW_IMAGE}}});
    patch_proxy(&world, &kubeconfig, "a", image.clone()).await;
    world
        .wait_proxy("a", "a draining", |s| {
            provisioned(s)["reason"] == "Draining"
        })
        .await;
    patch_proxy(&world, &kubeconfig, "b", image).await;
    world
        .wait_proxy("b", "b waiting for the budget", |s| {
            provisioned(s)["reason"] == "ReplacementPending"
        })
        .await;

    delete_proxy(&world, &kubeconfig, "a").await;
    let deleting = world
        .wait_proxy("a", "a draining for its delete", |s| {
            s["phase"] == "Deleting" && provisioned(s)["reason"] == "Draining"
        })
        .await;
    assert!(!deleting["metadata"]["deletionTimestamp"].is_null());
    let (a_pod, a_uid) = &uids["a"];
    assert_same_pod(&world, a_pod, a_uid, "a's lease holds the delete").await;
    release(&operator, &lease_a).await;
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

    world
        .wait_proxy("b", "b draining once a is gone", |s| {
            provisioned(s)["reason"] == "Draining"
        })
        .await;
    release(&operator, &lease_b).await;
    wait_ready_on_new_pod(&world, "b", &uids["b"].1, SLOW).await;
    wait_disruption_cleared(&world, "b").await;
}

/// Waits (up to `deadline`) until the Proxy `name` is gone.
async fn wait_gone_within(world: &World, name: &str, deadline: Duration) {
    let proxies = world.proxies();
    within(deadline, &format!("Proxy {name} to be gone"), || async {
        proxies.get_opt(name).await.ok()?.is_none().then_some(())
    })
    .await;
}

// ---------------------------------------------------------------------------------------------
// 2. `kubectl delete` drains too, and the drain timeout ends the leases still held.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_proxy_drains_until_the_drain_timeout() {
    let Some(world) = World::new("fleet-delete").await else {
        return;
    };
    let kubeconfig = admin_kubeconfig(&world);
    let drain_timeout = Duration::from_secs(3);
    // A delete takes no slot of the budget: with a budget of 0 it still drains and completes.
    let operator = world
        .operator(&["--drain-timeout", "3s", "--replacement-budget", "0"])
        .await;
    create_in_pool(&world, "px", "delete", json!({}), world.managed_spec(3128)).await;
    let ready = world.wait_ready("px").await;
    let pod = world.pod_of(&ready).await.expect("the machine Pod");
    let pod_name = pod.name_any();
    let pod_uid = pod.uid().expect("a Pod UID");
    let lease = acquire(&operator, "delete").await;
    let id = lease_id(&lease);
    let recorder = Recorder::start(&world).await;

    delete_proxy(&world, &kubeconfig, "px").await;
    let deleted = Instant::now();

    // The Pod must outlive the drain: watch it until it is deleted (or gone), noting when.
    let pod_deleted_at = within(
        Duration::from_secs(60),
        "the machine Pod to be deleted after the drain",
        || async {
            match pod_now(&world, &pod_name).await {
                Some((uid, false)) if uid == pod_uid => None,
                _ => Some(jiff::Timestamp::now()),
            }
        },
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
    let proxies = world.proxies();
    within(Duration::from_secs(60), "the Proxy to be gone", || async {
        proxies.get_opt("px").await.ok()?.is_none().then_some(())
    })
    .await;
    eprintln!(
        "delete: Proxy gone {:?} after the delete",
        deleted.elapsed()
    );
    assert!(
        pod_now(&world, &pod_name).await.is_none(),
        "the Pod outlived its Proxy"
    );

    // The lease was ended by the timeout, on record in the ledger, and an Event says so.
    let ledger = operator.ledger();
    let row = eventually("the lease ended by the drain timeout", || async {
        let row = support::sqlite3(
            &ledger,
            &format!("SELECT state, release_reason FROM leases WHERE id = '{id}'"),
        );
        (row == "released|drain_timeout").then_some(row)
    })
    .await;
    assert_eq!(row, "released|drain_timeout");
    let history = support::sqlite3(
        &ledger,
        &format!(
            "SELECT kind, reason FROM lease_history WHERE lease_id = '{id}' AND kind = 'released'"
        ),
    );
    assert_eq!(history, "released|drain_timeout", "lease_history");
    let events = wait_event(&world, "px", "DrainTimedOut").await;
    assert!(events.iter().any(|(t, _)| t == "Warning"), "{events:?}");
    wait_metric(&operator, "proxy_operator_drain_timeouts_total", &[], 1.0).await;
    wait_metric(
        &operator,
        "proxy_operator_disruptions_total",
        &["reason=\"deleted\""],
        1.0,
    )
    .await;
}

// ---------------------------------------------------------------------------------------------
// 3. The replacement budget: one replacement at a time, and 0 pauses them (not repairs).

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spec_changes_are_replaced_one_at_a_time_within_the_budget() {
    let Some(world) = World::new("fleet-budget").await else {
        return;
    };
    let kubeconfig = admin_kubeconfig(&world);
    let operator = world
        .operator(&["--replacement-budget", "1", "--drain-timeout", "10m"])
        .await;
    let names = ["a", "b", "c"];
    for name in names {
        create_in_pool(&world, name, name, json!({}), world.managed_spec(3128)).await;
    }
    let mut old_uids = BTreeMap::new();
    let mut leases = BTreeMap::new();
    for name in names {
        let ready = world.wait_ready(name).await;
        let pod = world.pod_of(&ready).await.expect("the machine Pod");
        old_uids.insert(name, pod.uid().expect("a Pod UID"));
        leases.insert(name, lease_id(&acquire(&operator, name).await));
    }
    let recorder = Recorder::start(&world).await;

    // All three specs change at once: a new image for the fleet.
    let start = Instant::now();
    for name in names {
        patch_proxy(
            &world,
            &kubeconfig,
            name,
            json!({"spec": {"placement": {"image": NEW_IMAGE}}}),
        )
        .await;
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
                release(&operator, &leases[name]).await;
            }
            if status["phase"] == "Ready" && status["disruption"].is_null() {
                let pod = world.pod_of(&proxy).await;
                if pod.is_some_and(|p| {
                    p.metadata.deletion_timestamp.is_none()
                        && p.uid() != Some(old_uids[name].clone())
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
            names
                .iter()
                .map(|n| format!("{n}:\n  {}", describe(&recorder.versions(n))))
                .collect::<Vec<_>>()
                .join("\n")
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
    let mut disrupted: BTreeMap<String, bool> = BTreeMap::new();
    let mut pending_seen: BTreeSet<String> = BTreeSet::new();
    for seen in recorder.history() {
        let Some(object) = &seen.object else {
            continue;
        };
        let status = &object["status"];
        disrupted.insert(seen.name.clone(), !status["disruption"].is_null());
        let now: Vec<&String> = disrupted
            .iter()
            .filter(|(_, d)| **d)
            .map(|(n, _)| n)
            .collect();
        assert!(
            now.len() <= 1,
            "{now:?} disrupted at once with a budget of 1; versions:\n{}",
            names
                .iter()
                .map(|n| format!("{n}:\n  {}", describe(&recorder.versions(n))))
                .collect::<Vec<_>>()
                .join("\n")
        );
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
    let metrics = operator.metrics().await;
    assert_eq!(
        metric_sum(
            &metrics,
            "proxy_operator_disruptions_total",
            &["reason=\"spec_change\""]
        ),
        3.0
    );
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
    let Some(world) = World::new("fleet-budget0").await else {
        return;
    };
    let kubeconfig = admin_kubeconfig(&world);
    let operator = world.operator(&["--replacement-budget", "0"]).await;
    create_in_pool(&world, "px", "zero", json!({}), world.managed_spec(3128)).await;
    let ready = world.wait_ready("px").await;
    let pod = world.pod_of(&ready).await.expect("the machine Pod");
    let pod_name = pod.name_any();
    let old_uid = pod.uid().expect("a Pod UID");
    let old_hash = ready["metadata"]["annotations"][SPEC_HASH_ANNOTATION].clone();

    patch_proxy(
        &world,
        &kubeconfig,
        "px",
        json!({"spec": {"placement": {"image": NEW_IMAGE}}}),
    )
    .await;
    let pending = world
        .wait_proxy("px", "Provisioned=True/ReplacementPending", |s| {
            provisioned(s)["reason"] == "ReplacementPending"
        })
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
    world
        .pods()
        .delete(&pod_name, &DeleteParams::default())
        .await
        .expect("delete the Pod by hand");
    let deleted = Instant::now();
    let (proxy, new_pod) = wait_ready_on_new_pod(&world, "px", &old_uid, SLOW).await;
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
    let settled = world
        .wait_proxy("px", "Provisioned=True, nothing pending", |s| {
            provisioned(s)["status"] == "True" && provisioned(s)["reason"] != "ReplacementPending"
        })
        .await;
    assert!(settled["status"]["disruption"].is_null(), "{status}");
    let lease = acquire(&operator, "zero").await;
    assert_eq!(lease["proxy"]["host"], settled["status"]["ip"], "{lease}");
    let metrics = operator.metrics().await;
    assert_eq!(
        metric_sum(&metrics, "proxy_operator_disruptions_total", &[]),
        0.0,
        "a repair is no disruption"
    );
}

/// A port change waiting for the budget: until the machine is replaced it still listens on the
/// old port, so that is where it must be probed and where leases must send crawlers ("phase
/// stays Ready/Unhealthy (the machine serves)").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pending_port_change_keeps_serving_on_the_running_port() {
    let Some(world) = World::new("fleet-port").await else {
        return;
    };
    let kubeconfig = admin_kubeconfig(&world);
    let operator = world.operator(&["--replacement-budget", "0"]).await;
    create_in_pool(&world, "px", "port", json!({}), world.managed_spec(3128)).await;
    let ready = world.wait_ready("px").await;
    let pod = world.pod_of(&ready).await.expect("the machine Pod");
    let old_uid = pod.uid().expect("a Pod UID");
    let ip = ready["status"]["ip"].as_str().expect("an IP").to_owned();

    patch_proxy(&world, &kubeconfig, "px", json!({"spec": {"port": 3129}})).await;
    world
        .wait_proxy("px", "Provisioned=True/ReplacementPending", |s| {
            provisioned(s)["reason"] == "ReplacementPending"
        })
        .await;
    // Several probe intervals (0.5 s, failure threshold 2): still Ready, still healthy.
    let until = Instant::now() + Duration::from_secs(5);
    while Instant::now() < until {
        let proxy = proxy_value(&world, "px").await.expect("the Proxy");
        let status = &proxy["status"];
        assert_eq!(
            status["phase"], "Ready",
            "the machine still serves on 3128 while its replacement waits: {status}"
        );
        assert_same_pod(&world, &pod.name_any(), &old_uid, "pending").await;
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
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
    let Some(world) = World::new("fleet-slot").await else {
        return;
    };
    let kubeconfig = admin_kubeconfig(&world);
    let operator = world
        .operator(&["--replacement-budget", "1", "--drain-timeout", "10m"])
        .await;
    for name in ["a", "b"] {
        create_in_pool(&world, name, name, json!({}), world.managed_spec(3128)).await;
    }
    let mut uids = BTreeMap::new();
    for name in ["a", "b"] {
        let ready = world.wait_ready(name).await;
        let pod = world.pod_of(&ready).await.expect("the machine Pod");
        uids.insert(name, pod.uid().expect("a Pod UID"));
    }
    let lease_a = lease_id(&acquire(&operator, "a").await);
    let lease_b = lease_id(&acquire(&operator, "b").await);
    let image = json!({"spec": {"placement": {"image": NEW_IMAGE}}});
    patch_proxy(&world, &kubeconfig, "a", image.clone()).await;
    world
        .wait_proxy("a", "a draining", |s| {
            provisioned(s)["reason"] == "Draining"
        })
        .await;
    patch_proxy(&world, &kubeconfig, "b", image).await;
    world
        .wait_proxy("b", "b waiting for the budget", |s| {
            provisioned(s)["reason"] == "ReplacementPending"
        })
        .await;

    // Every probe fails from now on (the probe target answers 500).
    world.target.set_status(500);
    wait_healthy(&world, "a", "False").await;
    release(&operator, &lease_a).await;
    // a's new machine runs (its squid started, its IP published) but fails its probes.
    let new_uid = eventually("a's new machine running", || async {
        let proxy = proxy_value(&world, "a").await?;
        let pod = world.pod_of(&proxy).await?;
        let uid = pod.uid()?;
        let address = world.kubelet.address(&world.ns, &pod.name_any())?;
        (uid != uids["a"]
            && pod.metadata.deletion_timestamp.is_none()
            && world
                .kubelet
                .started(&world.ns, &pod.name_any())
                .contains(&uid)
            && proxy["status"]["ip"] == address.to_string())
        .then_some(uid)
    })
    .await;
    let until = Instant::now() + Duration::from_secs(5);
    while Instant::now() < until {
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
        tokio::time::sleep(Duration::from_millis(250)).await;
    }

    // Probes pass again: a is done, b's turn.
    world.target.set_status(204);
    let done = wait_disruption_cleared(&world, "a").await;
    assert_eq!(
        world.pod_of(&done).await.and_then(|p| p.uid()),
        Some(new_uid),
        "a kept the machine it was given"
    );
    world
        .wait_proxy("b", "b draining once a is healthy", |s| {
            provisioned(s)["reason"] == "Draining"
        })
        .await;
    release(&operator, &lease_b).await;
    wait_ready_on_new_pod(&world, "b", &uids["b"], SLOW).await;
    wait_disruption_cleared(&world, "b").await;
}

/// A spec change reverted while it waits for the budget is no change: nothing is replaced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spec_change_reverted_while_pending_replaces_nothing() {
    let Some(world) = World::new("fleet-revert").await else {
        return;
    };
    let kubeconfig = admin_kubeconfig(&world);
    let _operator = world.operator(&["--replacement-budget", "0"]).await;
    create_in_pool(&world, "px", "revert", json!({}), world.managed_spec(3128)).await;
    let ready = world.wait_ready("px").await;
    let pod = world.pod_of(&ready).await.expect("the machine Pod");
    let uid = pod.uid().expect("a Pod UID");
    let hash = ready["metadata"]["annotations"][SPEC_HASH_ANNOTATION].clone();
    patch_proxy(
        &world,
        &kubeconfig,
        "px",
        json!({"spec": {"placement": {"image": NEW_IMAGE}}}),
    )
    .await;
    world
        .wait_proxy("px", "ReplacementPending", |s| {
            provisioned(s)["reason"] == "ReplacementPending"
        })
        .await;
    patch_proxy(
        &world,
        &kubeconfig,
        "px",
        json!({"spec": {"placement": null}}),
    )
    .await;
    let settled = world
        .wait_proxy("px", "Provisioned=True, nothing pending", |s| {
            provisioned(s)["status"] == "True" && provisioned(s)["reason"] != "ReplacementPending"
        })
        .await;
    assert_eq!(settled["status"]["phase"], "Ready", "{}", settled["status"]);
    assert_eq!(
        settled["metadata"]["annotations"][SPEC_HASH_ANNOTATION],
        hash
    );
    assert_not_replaced_for(&world, &[("px", &uid)], Duration::from_secs(4)).await;
}

// ---------------------------------------------------------------------------------------------
// 4. Remediation of unhealthy machines, and its short-circuit.

/// Creates `names` (each in a pool of its name) and waits until all are Ready; returns each
/// name's Pod name and UID.
async fn ready_fleet(world: &World, names: &[&str]) -> BTreeMap<String, (String, String)> {
    for name in names {
        create_in_pool(world, name, name, json!({}), world.managed_spec(3128)).await;
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

/// Waits until the Proxy's Healthy condition is `value` ("True"/"False").
async fn wait_healthy(world: &World, name: &str, value: &str) -> Value {
    world
        .wait_proxy(name, &format!("{name}: Healthy={value}"), |s| {
            condition(s, "Healthy")["status"] == value
        })
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unhealthy_machine_is_replaced_after_remediate_after() {
    let Some(world) = World::new("fleet-remedy").await else {
        return;
    };
    let operator = world
        .operator(&["--remediate-after", "3s", "--max-unhealthy", "50%"])
        .await;
    let names = ["a", "b", "c"];
    let pods = ready_fleet(&world, &names).await;

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

    let (proxy, new_pod) = wait_ready_on_new_pod(&world, "b", &b_uid, SLOW).await;
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
    wait_metric(
        &operator,
        "proxy_operator_disruptions_total",
        &["reason=\"unhealthy\""],
        1.0,
    )
    .await;
    wait_metric(
        &operator,
        "proxy_operator_remediation_paused",
        &["provider=\"local\""],
        0.0,
    )
    .await;
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
    let Some(world) = World::new("fleet-pause").await else {
        return;
    };
    let operator = world
        .operator(&["--remediate-after", "3s", "--max-unhealthy", "50%"])
        .await;
    let names = ["a", "b", "c"];
    let pods = ready_fleet(&world, &names).await;

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
        let mut events = events_with_reason(&world, "a", "RemediationPaused").await;
        events.extend(events_with_reason(&world, "b", "RemediationPaused").await);
        (!events.is_empty()).then_some(events)
    })
    .await;
    assert!(paused.iter().all(|(t, _)| t == "Warning"), "{paused:?}");
    eprintln!(
        "remediation paused: Event {:?} after both were unhealthy: {paused:?}",
        both_unhealthy.elapsed()
    );
    wait_metric(
        &operator,
        "proxy_operator_remediation_paused",
        &["provider=\"local\""],
        1.0,
    )
    .await;
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
    let metrics = operator.metrics().await;
    assert_eq!(
        metric_sum(&metrics, "proxy_operator_disruptions_total", &[]),
        0.0,
        "nothing may be disrupted while remediation is paused"
    );
    // Once per wait: one Event per proxy, not one per reconcile.
    for name in ["a", "b"] {
        let events = events_with_reason(&world, name, "RemediationPaused").await;
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
    let (_, _) = wait_ready_on_new_pod(&world, "b", &pods["b"].1, SLOW).await;
    eprintln!(
        "remediation resumed: b Ready on a new Pod {:?} after a recovered",
        thawed.elapsed()
    );
    assert_same_pod(&world, a_pod, a_uid, "a recovered").await;
    wait_metric(
        &operator,
        "proxy_operator_remediation_paused",
        &["provider=\"local\""],
        0.0,
    )
    .await;
    wait_metric(
        &operator,
        "proxy_operator_disruptions_total",
        &["reason=\"unhealthy\""],
        1.0,
    )
    .await;
}

// ---------------------------------------------------------------------------------------------
// 5. Rotation: the rotate annotation and spec.maxLifetime.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rotate_annotation_replaces_the_machine_once_per_value() {
    let Some(world) = World::new("fleet-rotate").await else {
        return;
    };
    let kubeconfig = admin_kubeconfig(&world);
    let operator = world.operator(&[]).await;
    // Created with a rotate value: the first machine records it, nothing rotates.
    create_in_pool(
        &world,
        "px",
        "rotate",
        json!({ROTATE_ANNOTATION: "r0"}),
        world.managed_spec(3128),
    )
    .await;
    let ready = world.wait_ready("px").await;
    let pod = world.pod_of(&ready).await.expect("the machine Pod");
    let first_uid = pod.uid().expect("a Pod UID");
    let annotations = &ready["metadata"]["annotations"];
    assert_eq!(annotations[ROTATED_ANNOTATION], "r0", "{annotations}");
    assert_not_replaced_for(&world, &[("px", &first_uid)], Duration::from_secs(3)).await;
    let created_before =
        timestamp(&ready["status"]["machineCreatedAt"]).expect("status.machineCreatedAt");

    // A new value rotates now, through a drain (a lease shows it).
    let lease = acquire(&operator, "rotate").await;
    annotate(&world, &kubeconfig, "px", &[(ROTATE_ANNOTATION, "r1")]).await;
    let annotated = Instant::now();
    let draining = world
        .wait_proxy("px", "a drain for the rotation", |s| {
            provisioned(s)["reason"] == "Draining"
        })
        .await;
    assert_eq!(
        draining["status"]["disruption"]["reason"], "RotateRequested",
        "{}",
        draining["status"]
    );
    release(&operator, &lease_id(&lease)).await;
    let (proxy, _) = wait_ready_on_new_pod(&world, "px", &first_uid, SLOW).await;
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
    let created_after =
        timestamp(&done["status"]["machineCreatedAt"]).expect("status.machineCreatedAt");
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
    wait_metric(
        &operator,
        "proxy_operator_disruptions_total",
        &["reason=\"rotate_requested\""],
        1.0,
    )
    .await;

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
    if kubectl(&kubeconfig, &world.ns, &["annotate", "px", "px", &removed]).is_none() {
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
    let metrics = operator.metrics().await;
    assert_eq!(
        metric_sum(
            &metrics,
            "proxy_operator_disruptions_total",
            &["reason=\"rotate_requested\""]
        ),
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_lifetime_rotates_the_machine_at_its_age() {
    let Some(world) = World::new("fleet-lifetime").await else {
        return;
    };
    let kubeconfig = admin_kubeconfig(&world);
    let operator = world.operator(&[]).await;

    // The server refuses a life shorter than a minute.
    let mut short = world.managed_spec(3128);
    short["maxLifetime"] = json!("30s");
    let refused = world.create("short", short).await;
    let message = support::world::refusal(refused);
    assert!(message.contains("at least 1m"), "{message}");

    create_in_pool(&world, "px", "life", json!({}), world.managed_spec(3128)).await;
    let ready = world.wait_ready("px").await;
    let pod = world.pod_of(&ready).await.expect("the machine Pod");
    let pod_name = pod.name_any();
    let old_uid = pod.uid().expect("a Pod UID");
    let created = timestamp(&ready["status"]["machineCreatedAt"]).expect("status.machineCreatedAt");
    let lease = acquire(&operator, "life").await;

    // maxLifetime is not in the spec hash: setting it replaces nothing by itself.
    patch_proxy(
        &world,
        &kubeconfig,
        "px",
        json!({"spec": {"maxLifetime": "1m"}}),
    )
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

    release(&operator, &lease_id(&lease)).await;
    let (_, new_pod) = wait_ready_on_new_pod(&world, "px", &old_uid, SLOW).await;
    assert_ne!(new_pod.uid(), Some(old_uid));
    let done = wait_disruption_cleared(&world, "px").await;
    let created_after =
        timestamp(&done["status"]["machineCreatedAt"]).expect("status.machineCreatedAt");
    assert!(created_after > created, "{created_after} vs {created}");
    wait_metric(
        &operator,
        "proxy_operator_disruptions_total",
        &["reason=\"max_lifetime\""],
        1.0,
    )
    .await;
}
