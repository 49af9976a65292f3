//! Tests of the test harness itself: the envtest control plane (`support::envtest`) and the
//! test kubelet (`support::kubelet`), against the real kube-apiserver and real squid.
//!
//! Every test is skipped (passes, printing how to get the binaries) when `KUBEBUILDER_ASSETS`
//! is unset and `CI` is not; with `CI` set, a missing control plane fails them.

use crate::support;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Namespace, Pod, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use proxy_operator::provider::kubernetes::build_pod;
use proxy_operator::provider::{CreateRequest, machine_labels};
use proxy_operator::resources::naming::machine_name;
use serde_json::json;

use support::envtest::parse_yaml_documents;
use support::{Behaviour, ControlPlane, DEADLINE, Kubelet};

/// Port of the test Pods' squid (each Pod has an address of its own, so they never clash).
const PORT: i32 = 3129;

fn proxy_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("crawl.example.com", "v1alpha1", "Proxy"),
        "proxies",
    )
}

/// A managed squid Pod as the kubernetes provider builds it, for a made-up Proxy `proxy`.
fn managed_pod(namespace: &str, proxy: &str) -> Pod {
    let uid = uuid::Uuid::new_v4().to_string();
    build_pod(
        &CreateRequest {
            namespace: namespace.to_owned(),
            proxy_name: proxy.to_owned(),
            proxy_uid: uid.clone(),
            machine_name: machine_name(&uid),
            port: PORT,
            placement: None,
            cloud_init: None,
            labels: machine_labels(&uid, "envtest-harness"),
            credentials: None,
        },
        "ubuntu/squid",
        "envtest-harness",
    )
}

async fn create_pod(client: &kube::Client, pod: &Pod) -> Pod {
    let namespace = pod.metadata.namespace.as_deref().unwrap();
    Api::<Pod>::namespaced(client.clone(), namespace)
        .create(&PostParams::default(), pod)
        .await
        .unwrap_or_else(|e| panic!("create Pod {:?}: {e}", pod.metadata.name))
}

/// Polls the Pod until `condition` holds on it (`None` = the Pod is gone).
async fn wait_pod(
    pods: &Api<Pod>,
    name: &str,
    what: &str,
    condition: impl Fn(Option<&Pod>) -> bool,
) -> Option<Pod> {
    let start = Instant::now();
    loop {
        let pod = pods
            .get_opt(name)
            .await
            .unwrap_or_else(|e| panic!("get Pod {name}: {e}"));
        if condition(pod.as_ref()) {
            return pod;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "timed out after {DEADLINE:?} waiting for Pod {name}: {what}; last seen: {:#?}",
            pod.map(|p| p.status)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn phase(pod: &Pod) -> Option<&str> {
    pod.status.as_ref()?.phase.as_deref()
}

fn condition<'a>(pod: &'a Pod, kind: &str) -> Option<(&'a str, Option<&'a str>)> {
    pod.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == kind)
        .map(|c| (c.status.as_str(), c.reason.as_deref()))
}

fn waiting_reason(pod: &Pod) -> Option<&str> {
    pod.status.as_ref()?.container_statuses.as_ref()?[0]
        .state
        .as_ref()?
        .waiting
        .as_ref()?
        .reason
        .as_deref()
}

fn restart_count(pod: &Pod) -> i32 {
    pod.status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .map_or(0, |c| c[0].restart_count)
}

fn pod_ip(pod: &Pod) -> Option<IpAddr> {
    pod.status.as_ref()?.pod_ip.as_deref()?.parse().ok()
}

/// One plain-HTTP request through the proxy at `addr`; returns squid's answer.
fn ask_squid(addr: SocketAddr) -> String {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5))
        .unwrap_or_else(|e| panic!("connect to squid at {addr}: {e}"));
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    // Port 9 on loopback refuses: squid answers itself, with its error page.
    stream
        .write_all(
            b"GET http://127.0.0.1:9/ HTTP/1.1\r\nHost: 127.0.0.1:9\r\nConnection: close\r\n\r\n",
        )
        .unwrap();
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    answer
}

fn refuses(addr: SocketAddr) -> bool {
    TcpStream::connect_timeout(&addr, Duration::from_millis(500)).is_err()
}

#[tokio::test]
async fn admin_client_lists_namespaces_and_kubeconfig_files_work() {
    let Some(plane) = ControlPlane::shared() else {
        return;
    };
    eprintln!(
        "control plane at {} started in {:?}",
        plane.url(),
        plane.startup_time()
    );
    let namespaces = Api::<Namespace>::all(plane.admin_client())
        .list(&ListParams::default())
        .await
        .expect("list namespaces as admin");
    let names: Vec<_> = namespaces
        .items
        .iter()
        .filter_map(|n| n.metadata.name.as_deref())
        .collect();
    assert!(names.contains(&"default"), "{names:?}");

    // The kubeconfig file, loaded the way a spawned process loads it.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("admin.kubeconfig");
    plane.write_admin_kubeconfig(&path);
    let kubeconfig = kube::config::Kubeconfig::read_from(&path).expect("read the kubeconfig");
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .expect("a config from the kubeconfig");
    let client = kube::Client::try_from(config).unwrap();
    let created = plane.new_namespace("Harness_Kubeconfig").await;
    assert!(created.starts_with("harness-kubeconfig-"), "{created}");
    Api::<Namespace>::all(client)
        .get(&created)
        .await
        .expect("the kubeconfig client reads the new namespace");

    // A wrong token is refused by the server (anonymous auth is off: 401, not 403).
    let stranger = plane.client_with_token("not-a-token");
    match Api::<Namespace>::all(stranger)
        .list(&ListParams::default())
        .await
    {
        Err(kube::Error::Api(status)) => assert_eq!(status.code, 401, "{status:?}"),
        other => panic!("a wrong token was not refused: {other:?}"),
    }
}

#[tokio::test]
async fn crd_applies_and_a_proxy_can_be_created() {
    let Some(plane) = ControlPlane::shared() else {
        return;
    };
    plane.apply_crd().await;
    // Idempotent and cheap the second time.
    let again = Instant::now();
    plane.apply_crd().await;
    assert!(again.elapsed() < Duration::from_millis(100));

    let namespace = plane.new_namespace("harness-crd").await;
    let proxies: Api<DynamicObject> =
        Api::namespaced_with(plane.admin_client(), &namespace, &proxy_resource());
    let sample = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("samples/proxy_external.yaml"),
    )
    .unwrap();
    let mut document = parse_yaml_documents(&sample).remove(0);
    document["metadata"]["namespace"] = json!(namespace);
    let proxy: DynamicObject = serde_json::from_value(document).unwrap();
    let created = proxies
        .create(&PostParams::default(), &proxy)
        .await
        .expect("create the sample Proxy");
    assert!(created.metadata.uid.is_some());
    // The server applied the CRD's defaults, so the schema really is the one served.
    let stored = proxies.get("partner-us-1").await.unwrap();
    assert!(
        stored.data["spec"]["healthCheck"].is_object(),
        "{:#?}",
        stored.data
    );
}

#[tokio::test]
async fn operator_identity_has_exactly_the_manifest_rights() {
    let Some(plane) = ControlPlane::shared() else {
        return;
    };
    plane.apply_crd().await;
    let namespace = plane.new_namespace("harness-rbac").await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("operator.kubeconfig");
    plane.operator_kubeconfig(&path).await;
    let kubeconfig = kube::config::Kubeconfig::read_from(&path).unwrap();
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .unwrap();
    let operator = kube::Client::try_from(config).unwrap();

    // Granted by manifests/rbac.yaml.
    Api::<DynamicObject>::all_with(operator.clone(), &proxy_resource())
        .list(&ListParams::default())
        .await
        .expect("the operator lists Proxies cluster-wide");
    let pod = managed_pod(&namespace, "rbac");
    let name = pod.metadata.name.clone().unwrap();
    Api::<Pod>::namespaced(operator.clone(), &namespace)
        .create(&PostParams::default(), &pod)
        .await
        .expect("the operator creates a Pod");

    // Not granted: the server says 403.
    let forbidden = |result: Result<(), kube::Error>, what: &str| match result {
        Err(kube::Error::Api(status)) if status.code == 403 => {}
        other => panic!("{what} was not refused with 403: {other:?}"),
    };
    // A Managed proxy's credentials Secret is created, never changed or deleted by the
    // operator (the Proxy owns it: the garbage collector deletes it with the Proxy).
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some("credentials".to_owned()),
            ..ObjectMeta::default()
        },
        ..Secret::default()
    };
    let secrets = Api::<Secret>::namespaced(operator.clone(), &namespace);
    secrets
        .create(&PostParams::default(), &secret)
        .await
        .expect("the operator creates a Secret");
    forbidden(
        secrets
            .replace("credentials", &PostParams::default(), &secret)
            .await
            .map(drop),
        "update Secret",
    );
    forbidden(
        secrets
            .delete("credentials", &DeleteParams::default())
            .await
            .map(drop),
        "delete Secret",
    );
    // ProxyPools delete their members one by one; nothing deletes Proxies wholesale.
    let proxies =
        Api::<DynamicObject>::namespaced_with(operator.clone(), &namespace, &proxy_resource());
    match proxies.delete("anything", &DeleteParams::default()).await {
        Err(kube::Error::Api(status)) if status.code == 404 => {}
        other => panic!("delete of a missing Proxy was not a 404: {other:?}"),
    }
    forbidden(
        proxies
            .delete_collection(&DeleteParams::default(), &ListParams::default())
            .await
            .map(drop),
        "delete every Proxy",
    );
    forbidden(
        Api::<Pod>::namespaced(operator.clone(), &namespace)
            .patch_status(
                &name,
                &Default::default(),
                &kube::api::Patch::Merge(json!({"status": {"phase": "Running"}})),
            )
            .await
            .map(drop),
        "patch pods/status",
    );
    // The admin still can (so the 403s are about the identity, not the objects).
    Api::<Pod>::namespaced(plane.admin_client(), &namespace)
        .delete(&name, &DeleteParams::default())
        .await
        .expect("the admin deletes the Pod");
}

#[tokio::test]
async fn healthy_pod_runs_real_squid_and_its_deletion_is_confirmed() {
    let Some(plane) = ControlPlane::shared() else {
        return;
    };
    let client = plane.admin_client();
    let namespace = plane.new_namespace("harness-healthy").await;
    let kubelet = Kubelet::start(client.clone(), Some(&namespace));
    let pods: Api<Pod> = Api::namespaced(client.clone(), &namespace);

    let pod = managed_pod(&namespace, "healthy");
    let name = pod.metadata.name.clone().unwrap();
    let first = create_pod(&client, &pod).await;
    let running = wait_pod(&pods, &name, "Running with a podIP", |p| {
        p.is_some_and(|p| phase(p) == Some("Running") && pod_ip(p).is_some())
    })
    .await
    .unwrap();
    let ip = pod_ip(&running).unwrap();
    assert_eq!(kubelet.address(&namespace, &name), Some(ip));
    assert!(
        ip.is_loopback() && ip != IpAddr::from([127, 0, 0, 1]),
        "{ip}"
    );
    assert_eq!(condition(&running, "Ready"), Some(("True", None)));
    assert_eq!(
        running.spec.as_ref().unwrap().node_name.as_deref(),
        Some(kubelet.node_name())
    );
    let status = &running
        .status
        .as_ref()
        .unwrap()
        .container_statuses
        .as_ref()
        .unwrap()[0];
    assert!(status.ready && status.state.as_ref().unwrap().running.is_some());
    let addr = SocketAddr::new(ip, PORT as u16);
    let answer = ask_squid(addr);
    assert!(
        answer.starts_with("HTTP/1.1 ") && answer.contains("squid"),
        "not squid's answer: {answer}"
    );
    assert_eq!(kubelet.squid_count(), 1);
    let uid = first.metadata.uid.clone().unwrap();
    assert_eq!(kubelet.started(&namespace, &name), vec![uid.clone()]);

    // Default grace: the Pod is bound, so deletion waits for the kubelet's confirmation.
    pods.delete(&name, &DeleteParams::default()).await.unwrap();
    wait_pod(&pods, &name, "gone", |p| p.is_none()).await;
    support::wait_until("the squid to stop", || {
        kubelet.squid_count() == 0 && refuses(addr)
    })
    .await;

    // The same Pod created again is a new UID and gets a squid of its own.
    let again = create_pod(&client, &pod).await;
    assert_ne!(again.metadata.uid.as_deref(), Some(uid.as_str()));
    let new_uid = again.metadata.uid.clone().unwrap();
    wait_pod(&pods, &name, "the new Pod Running", |p| {
        p.is_some_and(|p| {
            p.metadata.uid.as_deref() == Some(new_uid.as_str()) && phase(p) == Some("Running")
        })
    })
    .await;
    let started = kubelet.started(&namespace, &name);
    assert_eq!(started, vec![uid, new_uid]);
    let new_addr = SocketAddr::new(kubelet.address(&namespace, &name).unwrap(), PORT as u16);
    assert!(ask_squid(new_addr).contains("squid"));

    drop(kubelet);
    assert!(refuses(new_addr), "the kubelet's drop left squid running");
}

#[tokio::test]
async fn lost_node_leaves_the_pod_terminating_until_a_grace_zero_delete() {
    let Some(plane) = ControlPlane::shared() else {
        return;
    };
    let client = plane.admin_client();
    let namespace = plane.new_namespace("harness-lost").await;
    let kubelet = Kubelet::start(client.clone(), Some(&namespace));
    let pods: Api<Pod> = Api::namespaced(client.clone(), &namespace);
    let pod = create_pod(&client, &managed_pod(&namespace, "lost")).await;
    let name = pod.metadata.name.clone().unwrap();
    wait_pod(&pods, &name, "Running", |p| {
        p.is_some_and(|p| phase(p) == Some("Running"))
    })
    .await;
    let addr = SocketAddr::new(kubelet.address(&namespace, &name).unwrap(), PORT as u16);

    kubelet.set_behaviour(&namespace, &name, Behaviour::LostNode);
    support::wait_until("the lost node's squid to die", || {
        !kubelet.squid_running(&namespace, &name) && refuses(addr)
    })
    .await;
    let params = DeleteParams {
        grace_period_seconds: Some(1),
        ..DeleteParams::default()
    };
    pods.delete(&name, &params).await.unwrap();
    // Observed well past the 1 s grace period: nobody confirms, the Pod stays Terminating.
    let window = Instant::now();
    while window.elapsed() < Duration::from_secs(3) {
        let pod = pods
            .get(&name)
            .await
            .expect("the Pod stays while Terminating");
        assert!(pod.metadata.deletion_timestamp.is_some());
        assert_eq!(phase(&pod), Some("Running"), "status is no longer updated");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let force = DeleteParams {
        grace_period_seconds: Some(0),
        ..DeleteParams::default()
    };
    pods.delete(&name, &force).await.unwrap();
    wait_pod(&pods, &name, "gone after a grace-0 delete", |p| p.is_none()).await;
    assert_eq!(kubelet.squid_count(), 0);
}

#[tokio::test]
async fn failure_behaviours_show_the_statuses_a_cluster_shows() {
    let Some(plane) = ControlPlane::shared() else {
        return;
    };
    let client = plane.admin_client();
    let namespace = plane.new_namespace("harness-failures").await;
    let kubelet = Kubelet::start(client.clone(), Some(&namespace));
    let pods: Api<Pod> = Api::namespaced(client.clone(), &namespace);
    // Set before the Pods exist, by the Proxy each serves.
    kubelet.set_proxy_behaviour(&namespace, "unschedulable", Behaviour::Unschedulable);
    kubelet.set_proxy_behaviour(&namespace, "pull", Behaviour::ImagePullError);
    kubelet.set_proxy_behaviour(&namespace, "crash", Behaviour::CrashLoop);
    let mut names = BTreeMap::new();
    for proxy in ["unschedulable", "pull", "crash"] {
        let pod = create_pod(&client, &managed_pod(&namespace, proxy)).await;
        names.insert(proxy, pod.metadata.name.unwrap());
    }

    let pending = wait_pod(&pods, &names["unschedulable"], "PodScheduled=False", |p| {
        p.is_some_and(|p| condition(p, "PodScheduled") == Some(("False", Some("Unschedulable"))))
    })
    .await
    .unwrap();
    assert_eq!(phase(&pending), Some("Pending"));
    assert!(pending.spec.as_ref().unwrap().node_name.is_none());

    let pulling = wait_pod(&pods, &names["pull"], "ErrImagePull", |p| {
        p.is_some_and(|p| waiting_reason(p) == Some("ErrImagePull"))
    })
    .await
    .unwrap();
    assert_eq!(phase(&pulling), Some("Pending"));
    assert!(pulling.spec.as_ref().unwrap().node_name.is_some());
    assert_eq!(condition(&pulling, "Ready").map(|c| c.0), Some("False"));

    let crashing = wait_pod(&pods, &names["crash"], "CrashLoopBackOff", |p| {
        p.is_some_and(|p| waiting_reason(p) == Some("CrashLoopBackOff"))
    })
    .await
    .unwrap();
    assert_eq!(phase(&crashing), Some("Running"));
    assert_eq!(condition(&crashing, "Ready").map(|c| c.0), Some("False"));
    let restarts = restart_count(&crashing);
    wait_pod(&pods, &names["crash"], "restartCount rising", |p| {
        p.is_some_and(|p| restart_count(p) > restarts)
    })
    .await;
    assert_eq!(kubelet.squid_count(), 0, "no failure behaviour runs squid");
    for name in names.values() {
        assert!(kubelet.started(&namespace, name).is_empty());
    }

    // Back to Healthy: the crash-looping Pod runs squid, on the address it already had.
    let crash_ip = pod_ip(&crashing).unwrap();
    kubelet.set_behaviour(&namespace, &names["crash"], Behaviour::Healthy);
    let healed = wait_pod(&pods, &names["crash"], "Ready", |p| {
        p.is_some_and(|p| condition(p, "Ready").map(|c| c.0) == Some("True"))
    })
    .await
    .unwrap();
    assert_eq!(pod_ip(&healed), Some(crash_ip));
    assert!(ask_squid(SocketAddr::new(crash_ip, PORT as u16)).contains("squid"));
    assert!(restart_count(&healed) > restarts);

    // The unschedulable Pod is deleted at once (never bound).
    pods.delete(&names["unschedulable"], &DeleteParams::default())
        .await
        .unwrap();
    wait_pod(&pods, &names["unschedulable"], "gone", |p| p.is_none()).await;
}
