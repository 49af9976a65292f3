//! Pod Security admission against the real API server: the kubernetes provider's default squid
//! Pod passes `baseline` and is refused by `restricted` (the Proxy waits, it does not fail), and
//! a provider with `podSecurity: restricted` makes a Pod that `restricted` admits and the test
//! kubelet runs; such a provider refuses a privileged listen port before asking the server.
//!
//! The `proxy-operator run` binary runs as a process with the identity and RBAC of
//! `manifests/`; each test labels its own namespace `pod-security.kubernetes.io/enforce=<level>`
//! with the admin client. Needs `KUBEBUILDER_ASSETS` (kube-apiserver + etcd); without it every
//! test here passes as skipped and says how to get the binaries, unless `CI` is set.

use crate::support;

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Namespace, Pod, PodSecurityContext, SecurityContext};
use kube::api::{Api, ListParams, Patch, PatchParams};
use serde_json::{Value, json};
use support::operator::LOOPBACK_EGRESS;
use support::world::{World, eventually};

/// The providers config of a provider `local` whose Pods pass `restricted` (and whose squids
/// reach the loopback probe target).
fn restricted_provider() -> String {
    format!(
        "{LOOPBACK_EGRESS}providers:\n  - name: local\n    type: kubernetes\n    \
         kubernetes:\n      image: ubuntu/squid\n      podSecurity: restricted\n"
    )
}

/// How long a refused Proxy is watched for a phase it must never reach (every other wait polls
/// up to `support::world::SLOW`).
const OBSERVE: Duration = Duration::from_secs(5);

/// Enforces the Pod Security Standards `level` on the world's namespace.
async fn enforce(world: &World, level: &str) {
    let namespaces: Api<Namespace> = Api::all(world.client.clone());
    let patch = json!({"metadata": {"labels": {
        "pod-security.kubernetes.io/enforce": level,
        "pod-security.kubernetes.io/enforce-version": "latest",
    }}});
    namespaces
        .patch(&world.ns, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap_or_else(|e| panic!("label namespace {} enforce={level}: {e}", world.ns));
}

/// Makes the world's operator use `config` as its providers config (the operator helper writes
/// its default one only when the file is not there yet).
fn providers_config(world: &World, config: &str) {
    std::fs::write(world.dir.path().join("providers.yaml"), config)
        .expect("write the providers config");
}

/// The condition `type_` of a Proxy's status, if it is there.
fn condition<'a>(status: &'a Value, type_: &str) -> Option<&'a Value> {
    status["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)
}

/// The managed Pods in the world's namespace.
async fn managed_pods(world: &World) -> Vec<Pod> {
    world
        .pods()
        .list(&ListParams::default().labels("crawl.example.com/managed=true"))
        .await
        .expect("list the managed Pods")
        .items
}

/// Waits until an Event with `reason` exists about the object `name`.
async fn wait_event(world: &World, name: &str, reason: &str) {
    eventually(&format!("an Event {reason} about {name}"), || async {
        world
            .event_reasons(name)
            .await
            .iter()
            .any(|r| r == reason)
            .then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_pod_is_admitted_by_baseline_and_reaches_ready() {
    let Some(world) = World::new("psa-baseline").await else {
        return;
    };
    enforce(&world, "baseline").await;
    let _operator = world.operator(&[]).await;
    world
        .create("baseline", world.managed_spec(3128))
        .await
        .expect("create the Managed Proxy");

    let proxy = world.wait_ready("baseline").await;
    let pod = world.pod_of(&proxy).await.expect("the admitted Pod");
    // The default Pod: squid starts as the image's user and drops to `proxy` itself (the
    // server stores an empty Pod securityContext `{}` where none was sent).
    let spec = pod.spec.expect("a Pod spec");
    assert_eq!(
        spec.security_context.unwrap_or_default(),
        PodSecurityContext::default()
    );
    assert_eq!(
        spec.containers[0]
            .security_context
            .clone()
            .unwrap_or_default(),
        SecurityContext::default()
    );
    let provisioned = condition(&proxy["status"], "Provisioned").expect("Provisioned");
    assert_eq!(provisioned["status"], "True", "{proxy}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_pod_refused_by_restricted_leaves_the_proxy_pending() {
    let Some(world) = World::new("psa-refused").await else {
        return;
    };
    enforce(&world, "restricted").await;
    let _operator = world.operator(&[]).await;
    world
        .create("refused", world.managed_spec(3128))
        .await
        .expect("create the Managed Proxy");

    let proxy = world
        .wait_proxy(
            "refused",
            "Provisioned=False reason Refused on Proxy refused",
            |s| {
                condition(s, "Provisioned")
                    .is_some_and(|c| c["status"] == "False" && c["reason"] == "Refused")
            },
        )
        .await;
    let provisioned = condition(&proxy["status"], "Provisioned").expect("Provisioned");
    let message = provisioned["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("PodSecurity") && message.contains("restricted"),
        "the condition should carry the server's refusal: {proxy}"
    );

    // A refusal is policy that may change: the Proxy waits, it is never latched into Failed.
    let start = Instant::now();
    while start.elapsed() < OBSERVE {
        let object = world
            .raw_proxies()
            .get("refused")
            .await
            .expect("read the Proxy");
        let status = &object.data["status"];
        assert_eq!(
            status["phase"], "Pending",
            "a refused Proxy must stay Pending: {status}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    wait_event(&world, "refused", "Refused").await;
    assert!(
        world.pod_of(&proxy).await.is_none(),
        "the server refused the Pod, yet it exists"
    );
    assert!(managed_pods(&world).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_pod_is_created_once_the_namespace_allows_it() {
    let Some(world) = World::new("psa-relabel").await else {
        return;
    };
    enforce(&world, "restricted").await;
    let _operator = world.operator(&[]).await;
    world
        .create("relabel", world.managed_spec(3128))
        .await
        .expect("create the Managed Proxy");
    world
        .wait_proxy(
            "relabel",
            "Provisioned reason Refused on Proxy relabel",
            |s| condition(s, "Provisioned").is_some_and(|c| c["reason"] == "Refused"),
        )
        .await;

    // Someone relaxes the namespace: the retried create goes through.
    enforce(&world, "baseline").await;
    let proxy = world.wait_ready("relabel").await;
    assert!(world.pod_of(&proxy).await.is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restricted_provider_pod_is_admitted_by_restricted_and_reaches_ready() {
    let Some(world) = World::new("psa-restricted").await else {
        return;
    };
    enforce(&world, "restricted").await;
    providers_config(&world, &restricted_provider());
    let _operator = world.operator(&[]).await;
    world
        .create("restricted", world.managed_spec(3128))
        .await
        .expect("create the Managed Proxy");

    // Admitted: the Pod exists (a refused Pod never does).
    let pod = eventually("the restricted Pod to exist", || async {
        managed_pods(&world).await.into_iter().next()
    })
    .await;
    let spec = pod.spec.as_ref().expect("a Pod spec");
    let security = spec
        .security_context
        .as_ref()
        .expect("a Pod securityContext");
    assert_eq!(security.run_as_non_root, Some(true));
    assert_eq!(security.run_as_user, Some(13));
    let container = spec.containers[0]
        .security_context
        .as_ref()
        .expect("a container securityContext");
    assert_eq!(container.allow_privilege_escalation, Some(false));

    // The test kubelet runs the Pod's own config with real squid, and the probes pass.
    let proxy = world.wait_ready("restricted").await;
    let pod_name = pod.metadata.name.as_deref().expect("a Pod name");
    assert_eq!(
        world.pod_of(&proxy).await.and_then(|p| p.metadata.name),
        Some(pod_name.to_owned())
    );
    assert!(world.kubelet.squid_running(&world.ns, pod_name));
    let reasons = world.event_reasons("restricted").await;
    assert!(!reasons.iter().any(|r| r == "Refused"), "{reasons:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restricted_provider_fails_a_privileged_port_without_a_pod() {
    let Some(world) = World::new("psa-port").await else {
        return;
    };
    enforce(&world, "restricted").await;
    providers_config(&world, &restricted_provider());
    let _operator = world.operator(&[]).await;
    world
        .create("port80", world.managed_spec(80))
        .await
        .expect("create the Managed Proxy");

    let proxy = world
        .wait_proxy(
            "port80",
            "phase Failed, Provisioned reason ProviderFailed",
            |s| {
                s["phase"] == "Failed"
                    && condition(s, "Provisioned").is_some_and(|c| c["reason"] == "ProviderFailed")
            },
        )
        .await;
    let provisioned = condition(&proxy["status"], "Provisioned").expect("Provisioned");
    assert_eq!(provisioned["status"], "False", "{proxy}");
    let message = provisioned["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("spec.port 80") && message.contains("1024"),
        "the condition should say the port is the problem: {proxy}"
    );
    assert!(world.pod_of(&proxy).await.is_none());
    assert!(managed_pods(&world).await.is_empty());
}
