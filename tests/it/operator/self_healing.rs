//! Self-healing end to end on a real Kubernetes API server: the `proxy-operator run` binary as a
//! process, and the test kubelet playing the nodes that fail. A real cluster loses nodes (a Pod
//! stays Terminating for ever), cannot pull images, cannot schedule, and crash-loops; an admin
//! deletes Pods by hand; a crash leaves a create half done. Each test plays one of those and
//! checks the operator gets the Proxy back (or gone) without help.
//!
//! Needs `KUBEBUILDER_ASSETS` (kube-apiserver + etcd); without it every test here passes as
//! skipped and says how to get the binaries, unless `CI` is set.

use crate::support;

use std::time::{Duration, Instant};

use kube::ResourceExt;
use kube::api::{DeleteParams, EvictParams, Patch, PatchParams, PostParams};
use proxy_operator::resources::naming::machine_name;
use proxy_operator::resources::proxy::FINALIZER;
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use support::Behaviour;
use support::operator::OperatorProcess;
use support::world::{SLOW, World, eventually, within};

/// The annotation a create is marked pending with before the provider is called (the design's
/// "create pending"), spelled out here so a rename in the operator fails this test.
const CREATE_PENDING_ANNOTATION: &str = "crawl.example.com/create-pending";

/// The reconciler's own defaults (`src/cli.rs`) for every delay that `FAST_FLAGS` shrinks, plus
/// the self-healing ones, for a test that must hold "with default settings". Passed after
/// `FAST_FLAGS`, so they win.
const DEFAULT_DELAYS: &[&str] = &[
    "--provisioning-poll",
    "10s",
    "--drift-poll",
    "5m",
    "--deletion-poll",
    "5s",
    "--error-requeue",
    "5s",
    "--error-requeue-max",
    "5m",
    "--quota-requeue",
    "5m",
    "--force-delete-margin",
    "30s",
    "--startup-timeout",
    "10m",
];

/// A lost node costs the Pod's grace period (10 s) plus the force-delete margin (30 s), then
/// polls and a start-up; the issue allows two minutes.
const LOST_NODE_DEADLINE: Duration = Duration::from_secs(120);

/// The condition of type `kind` in a Proxy's status.
fn condition<'a>(status: &'a Value, kind: &str) -> Option<&'a Value> {
    status["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == kind)
}

/// The Proxy's UID, from the object the server answered a create with.
fn uid_of(object: &kube::api::DynamicObject) -> String {
    object.metadata.uid.clone().expect("the server sets a UID")
}

/// Acquires a lease on the only Proxy of the world (selector `pool=envtest`), retrying while
/// the answer is 409 (no healthy proxy yet); returns the lease.
async fn acquire(operator: &OperatorProcess, what: &str) -> Value {
    operator
        .acquire_retrying(
            &json!({"selector": {"pool": "envtest"}, "ttlSeconds": 600}),
            what,
        )
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evicted_pod_on_a_lost_node_is_force_deleted_and_replaced() {
    let Some(world) = World::new("lostnode").await else {
        return;
    };
    let operator = world.operator(DEFAULT_DELAYS).await;
    world
        .create("px", world.managed_spec(3128))
        .await
        .expect("create the Proxy");
    let ready = world.wait_ready("px").await;
    let pod = world.pod_of(&ready).await.expect("the machine Pod");
    let pod_name = pod.name_any();
    let old_uid = pod.uid().expect("a Pod UID");
    let lease = acquire(&operator, "a lease on the Ready proxy").await;
    assert_eq!(lease["proxy"]["name"], "px", "{lease}");
    let lease_id = lease["leaseID"].as_str().expect("a lease ID").to_owned();

    // The node goes away: the squid dies, nothing reports or confirms for this Pod any more.
    let lost = world
        .kubelet
        .lose_node_of(&world.ns, &pod_name)
        .expect("the kubelet knows the Pod");
    assert_eq!(lost, old_uid);
    // A drain (or the taint manager) evicts it: graceful, so only a deletionTimestamp is set.
    world
        .pods()
        .evict(&pod_name, &EvictParams::default())
        .await
        .expect("evict the Pod");
    let evicted = Instant::now();
    let terminating = world.pods().get(&pod_name).await.expect("the evicted Pod");
    assert_eq!(terminating.uid().as_deref(), Some(old_uid.as_str()));
    assert!(
        terminating.metadata.deletion_timestamp.is_some(),
        "eviction of a bound Pod is graceful: {:?}",
        terminating.metadata
    );

    // Until then the Proxy says its machine is being deleted and when it will be forced.
    let condition = |s: &Value| {
        s["conditions"]
            .as_array()
            .and_then(|c| c.iter().find(|c| c["type"] == "Provisioned"))
            .cloned()
            .unwrap_or(Value::Null)
    };
    let waiting = world
        .wait_proxy("px", "Provisioned=False/MachineTerminating", |s| {
            condition(s)["reason"] == "MachineTerminating"
        })
        .await;
    assert_eq!(waiting["status"]["phase"], "Replacing");
    let message = condition(&waiting["status"])["message"].to_string();
    assert!(
        message.contains("force-deleted if still there at"),
        "{message}"
    );

    // Force-deleted past its grace period plus the margin, then replaced and Ready again.
    let (proxy, new_pod) = world
        .wait_ready_on_new_pod("px", &old_uid, LOST_NODE_DEADLINE)
        .await;
    let took = evicted.elapsed();
    eprintln!("lost node: Ready again on a new Pod {took:?} after the eviction");
    assert_eq!(new_pod.name_any(), pod_name, "same deterministic name");
    assert_ne!(new_pod.uid().as_deref(), Some(old_uid.as_str()));
    assert!(
        world.kubelet.started(&world.ns, &pod_name).len() >= 2,
        "the replacement runs squid"
    );
    // The old Pod is gone: the one Pod of that name is the new one.
    let now = world
        .pods()
        .get(&pod_name)
        .await
        .expect("the Pod of that name");
    assert_ne!(
        now.uid().as_deref(),
        Some(old_uid.as_str()),
        "old Pod still there"
    );
    assert_eq!(proxy["status"]["phase"], "Ready");

    // On record: an Event, a log line, and the lease ended in the ledger.
    let force_deleted = world.events_with_reason("px", "ForceDeleted").await;
    assert!(
        !force_deleted.is_empty(),
        "no ForceDeleted Event; reasons: {:?}",
        world.event_reasons("px").await
    );
    let (kind, note) = &force_deleted[0];
    eprintln!("lost node: ForceDeleted Event: {note}");
    assert_eq!(kind, "Warning", "{note}");
    assert!(
        note.contains('1') && note.contains("lease"),
        "the note says how many leases were ended: {note:?}"
    );
    let log = operator.log_text();
    assert!(
        log.contains("force-deleted"),
        "no 'force-deleted' in the log"
    );
    let ledger = operator.ledger();
    let row = eventually("the lease ended by the operator in the ledger", || async {
        let row = support::sqlite3(
            &ledger,
            &format!("SELECT state, release_reason FROM leases WHERE id = '{lease_id}'"),
        );
        (row == "released|machine_lost").then_some(row)
    })
    .await;
    assert_eq!(row, "released|machine_lost");
    let history = support::sqlite3(
        &ledger,
        &format!(
            "SELECT kind, reason FROM lease_history WHERE lease_id = '{lease_id}' \
             AND kind = 'released'"
        ),
    );
    assert_eq!(history, "released|machine_lost", "lease_history");
    let (status, view) = operator
        .call(Method::GET, &format!("/v1/leases/{lease_id}"), None)
        .await;
    assert_eq!(status, StatusCode::OK, "{view}");
    assert_eq!(view["state"], "released", "{view}");

    // And the proxy is leasable again.
    let again = acquire(&operator, "a new lease on the replaced proxy").await;
    assert_eq!(again["proxy"]["name"], "px", "{again}");
    assert_eq!(
        again["proxy"]["host"], proxy["status"]["ip"],
        "the lease points at the new Pod: {again}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_proxy_on_a_lost_node_completes() {
    let Some(world) = World::new("lostdelete").await else {
        return;
    };
    let operator = world.operator(&[]).await;
    world
        .create("px", world.managed_spec(3128))
        .await
        .expect("create the Proxy");
    let ready = world.wait_ready("px").await;
    let pod = world.pod_of(&ready).await.expect("the machine Pod");
    let pod_name = pod.name_any();
    world
        .kubelet
        .lose_node_of(&world.ns, &pod_name)
        .expect("the kubelet knows the Pod");

    world
        .proxies()
        .delete("px", &DeleteParams::default())
        .await
        .expect("delete the Proxy");
    let deleted = Instant::now();
    let proxies = world.proxies();
    within(
        LOST_NODE_DEADLINE,
        "the Proxy on a lost node to be gone",
        || async { proxies.get_opt("px").await.ok()?.is_none().then_some(()) },
    )
    .await;
    eprintln!(
        "lost node: Proxy gone {:?} after its delete",
        deleted.elapsed()
    );
    assert!(
        world
            .pods()
            .get_opt(&pod_name)
            .await
            .expect("read the Pod")
            .is_none(),
        "the Pod outlived its Proxy"
    );
    assert!(
        operator.log_text().contains("force-deleted"),
        "no 'force-deleted' in the log"
    );
    let reasons = world.event_reasons("px").await;
    assert!(reasons.iter().any(|r| r == "ForceDeleted"), "{reasons:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_reasons_show_in_the_condition() {
    let Some(world) = World::new("waiting").await else {
        return;
    };
    let cases = [
        ("pull", Behaviour::ImagePullError, "ErrImagePull"),
        ("crash", Behaviour::CrashLoop, "CrashLoopBackOff"),
        ("unsched", Behaviour::Unschedulable, "Unschedulable"),
    ];
    for (name, behaviour, _) in cases {
        world
            .kubelet
            .set_proxy_behaviour(&world.ns, name, behaviour);
    }
    let _operator = world.operator(&[]).await;
    for (name, _, _) in cases {
        world
            .create(name, world.managed_spec(3128))
            .await
            .unwrap_or_else(|e| panic!("create {name}: {e}"));
    }

    for (name, behaviour, reason) in cases {
        // The kubelet's messages end with the behaviour's name.
        let pod_message = format!("test kubelet behaviour {behaviour:?}");
        let proxy = world
            .wait_proxy(name, &format!("{name}: Provisioned False/{reason}"), |s| {
                condition(s, "Provisioned").is_some_and(|c| {
                    c["status"] == "False"
                        && c["reason"] == reason
                        && c["message"]
                            .as_str()
                            .is_some_and(|m| m.contains(&pod_message))
                })
            })
            .await;
        assert_eq!(
            proxy["status"]["phase"], "Provisioning",
            "{name}: {}",
            proxy["status"]
        );
        let events = eventually(&format!("{name}: a {reason} Event"), || async {
            let events = world.events_with_reason(name, reason).await;
            (!events.is_empty()).then_some(events)
        })
        .await;
        assert!(
            events.iter().any(|(kind, _)| kind == "Warning"),
            "{name}: {events:?}"
        );
    }

    // It stays so: a crash-looping squid (Running with an IP) is never Ready nor Unhealthy.
    // Sampled over a few drift polls (2 s) and crash-loop restarts (1 s).
    let api = world.raw_proxies();
    let until = Instant::now() + Duration::from_secs(5);
    while Instant::now() < until {
        for (name, _, reason) in cases {
            let object = api.get(name).await.expect("read the Proxy");
            let status = &serde_json::to_value(&object).expect("JSON")["status"];
            assert_eq!(status["phase"], "Provisioning", "{name}: {status}");
            let provisioned = condition(status, "Provisioned").expect("a Provisioned condition");
            assert_eq!(provisioned["reason"], reason, "{name}: {status}");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_machine_that_never_runs_is_replaced_after_the_startup_timeout() {
    let Some(world) = World::new("startup").await else {
        return;
    };
    world
        .kubelet
        .set_proxy_behaviour(&world.ns, "px", Behaviour::ImagePullError);
    let _operator = world
        .operator(&[
            "--startup-timeout",
            "3s",
            "--error-requeue",
            "1s",
            "--error-requeue-max",
            "4s",
        ])
        .await;
    let created = world
        .create("px", world.managed_spec(3128))
        .await
        .expect("create the Proxy");
    let pod_name = machine_name(&uid_of(&created));

    // When each Pod of the name first reached the kubelet (its watch, within ~100 ms of the
    // create). Four Pods give three gaps.
    let mut first_seen: Vec<(String, Instant)> = Vec::new();
    let start = Instant::now();
    while first_seen.len() < 4 {
        for uid in world.kubelet.seen(&world.ns, &pod_name) {
            if !first_seen.iter().any(|(u, _)| *u == uid) {
                first_seen.push((uid, Instant::now()));
            }
        }
        assert!(
            start.elapsed() < SLOW,
            "only {} Pods of {pod_name} in {SLOW:?}; expected a replacement every start-up \
             timeout (3 s) plus backoff",
            first_seen.len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let gaps: Vec<Duration> = first_seen
        .windows(2)
        .map(|pair| pair[1].1 - pair[0].1)
        .collect();
    eprintln!("start-up timeout: gaps between Pod creations {gaps:?}");
    // No Pod is replaced before it is due: each gap is at least the start-up timeout (3 s),
    // less a second for a creationTimestamp's whole-second resolution.
    for gap in &gaps {
        assert!(*gap >= Duration::from_secs(2), "{gaps:?}");
    }
    // Backoff before re-creating (1 s, 2 s, 4 s): the third gap is not shorter than the first.
    // Load only stretches gaps, so the bound is in the safe direction except for a stall during
    // the first one; allow it a second.
    assert!(
        gaps[2] + Duration::from_secs(1) >= gaps[0],
        "no backoff between replacements: {gaps:?}"
    );

    let reasons = world.event_reasons("px").await;
    assert!(reasons.iter().any(|r| r == "StartupTimeout"), "{reasons:?}");

    // The image becomes pullable: the next Pod runs and the Proxy is Ready.
    world
        .kubelet
        .set_proxy_behaviour(&world.ns, "px", Behaviour::Healthy);
    let ready = world.wait_ready("px").await;
    let pod = world.pod_of(&ready).await.expect("the Pod");
    assert!(
        world
            .kubelet
            .started(&world.ns, &pod_name)
            .contains(&pod.uid().expect("a UID")),
        "Ready on a Pod whose squid runs"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_pod_is_noticed_at_once() {
    let Some(world) = World::new("poddelete").await else {
        return;
    };
    // The drift poll would take five minutes: only the Pod watch can be this quick.
    let _operator = world.operator(&["--drift-poll", "300s"]).await;
    world
        .create("px", world.managed_spec(3128))
        .await
        .expect("create the Proxy");
    let ready = world.wait_ready("px").await;
    let pod = world.pod_of(&ready).await.expect("the machine Pod");
    let old_uid = pod.uid().expect("a Pod UID");

    world
        .pods()
        .delete(&pod.name_any(), &DeleteParams::default())
        .await
        .expect("delete the Pod by hand");
    let deleted = Instant::now();
    let (_, new_pod) = world
        .wait_ready_on_new_pod("px", &old_uid, Duration::from_secs(30))
        .await;
    eprintln!(
        "deleted Pod: Ready again on a new Pod {:?} after the delete",
        deleted.elapsed()
    );
    assert_ne!(new_pod.uid(), Some(old_uid));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_proxy_with_a_pending_create_deletes_its_machine_first() {
    let Some(world) = World::new("pendingdelete").await else {
        return;
    };
    // What a crash between "mark the create pending" and "record the providerID" leaves: the
    // finalizer, the marker, a machine of the deterministic name, and no status.providerID.
    let created = world
        .create("px", world.managed_spec(3128))
        .await
        .expect("create the Proxy");
    let uid = uid_of(&created);
    world
        .raw_proxies()
        .patch(
            "px",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {
                "finalizers": [FINALIZER],
                "annotations": {CREATE_PENDING_ANNOTATION: "4f1c0ffee0ddba11c0ffee0ddba11c0ffee0ddba11c0ffee0ddba11c0ffee0d"},
            }})),
        )
        .await
        .expect("add the finalizer and the create-pending marker");
    let pod = world.machine_pod("px", &uid);
    let pod_name = pod.name_any();
    let pods = world.pods();
    pods.create(&PostParams::default(), &pod)
        .await
        .expect("create the machine Pod");
    // Bound and running, so its deletion is graceful and confirmed by the kubelet.
    eventually("the kubelet runs the machine Pod", || async {
        world
            .kubelet
            .squid_running(&world.ns, &pod_name)
            .then_some(())
    })
    .await;
    let proxies = world.proxies();
    proxies
        .delete("px", &DeleteParams::default())
        .await
        .expect("delete the Proxy");
    let held = proxies
        .get("px")
        .await
        .expect("the finalizer holds the Proxy");
    assert!(held.metadata.deletion_timestamp.is_some());
    assert!(
        held.status
            .as_ref()
            .and_then(|s| s.provider_id.as_deref())
            .unwrap_or_default()
            .is_empty(),
        "no providerID recorded"
    );

    let _operator = world.operator(&[]).await;
    // Sampled Proxy first, then Pod: a Pod seen after its Proxy was seen gone outlived it.
    let outlived = eventually("the Proxy with a pending create to be gone", || async {
        if proxies.get_opt("px").await.ok()?.is_some() {
            return None;
        }
        Some(pods.get_opt(&pod_name).await.expect("read the Pod"))
    })
    .await;
    assert!(
        outlived.is_none(),
        "the Proxy was gone while its machine Pod was still there: {:?}",
        outlived.map(|p| p.metadata)
    );
    // The kubelet saw the deletion: it stopped the machine's squid (and forgot the Pod).
    eventually(
        "the kubelet to stop the deleted machine's squid",
        || async { (!world.kubelet.squid_running(&world.ns, &pod_name)).then_some(()) },
    )
    .await;
    assert_eq!(
        world.kubelet.seen(&world.ns, &pod_name).len(),
        1,
        "the operator created no machine of its own for a Proxy being deleted"
    );
}
