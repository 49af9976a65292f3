//! End to end on a real Kubernetes API server: the `proxy-operator run` binary as a process,
//! with the identity and RBAC of `manifests/`, the CRD from `crd/`, a test kubelet running each
//! managed Pod's squid config with real squid, and a loopback HTTPS probe target.
//!
//! Needs `KUBEBUILDER_ASSETS` (kube-apiserver + etcd); without it every test here passes as
//! skipped and says how to get the binaries, unless `CI` is set.

use crate::support;

use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Secret;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use proxy_operator::credentials::machine_secret_name;
use proxy_operator::resources::naming::machine_name;
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use support::Squid;
use support::operator::metric_sum;
use support::world::{SLOW, World, refusal, wait_gone};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crd_rules_and_defaults_are_enforced_by_the_server() {
    let Some(world) = World::new("crd").await else {
        return;
    };
    let endpoint = json!({"host": "127.0.0.1", "port": 3128});
    // Each create-time CEL rule, seen from the server.
    for (name, spec, expected) in [
        (
            "managed-no-provider",
            json!({"mode": "Managed"}),
            "provider is required",
        ),
        (
            "external-with-provider",
            json!({"mode": "External", "provider": "local", "endpoint": endpoint}),
            "provider",
        ),
        (
            "external-no-endpoint",
            json!({"mode": "External"}),
            "endpoint is required",
        ),
        (
            "managed-with-endpoint",
            json!({"mode": "Managed", "provider": "local", "endpoint": endpoint}),
            "endpoint",
        ),
        (
            "cloud-init-both",
            json!({"mode": "Managed", "provider": "local", "cloudInit": {
                "inline": "#cloud-config", "secretRef": {"name": "s", "key": "k"}}}),
            "cloudInit",
        ),
        (
            "cloud-init-neither",
            json!({"mode": "Managed", "provider": "local", "cloudInit": {}}),
            "cloudInit",
        ),
        (
            "negative-max-leases",
            json!({"mode": "External", "endpoint": endpoint, "maxLeases": -1}),
            "maxLeases",
        ),
    ] {
        let message = refusal(world.create(name, spec).await);
        assert!(
            message.contains(expected),
            "{name}: refusal {message:?} does not mention {expected:?}"
        );
    }

    // Server-side defaults: an explicit 0 survives, omitted fields are filled.
    let zero = world
        .create(
            "zero",
            json!({"mode": "External", "endpoint": endpoint, "maxLeases": 0}),
        )
        .await
        .expect("create a Proxy with maxLeases 0");
    assert_eq!(zero.data["spec"]["maxLeases"], 0);
    let defaults = world
        .create(
            "defaults",
            json!({"mode": "External", "endpoint": endpoint}),
        )
        .await
        .expect("create a Proxy with defaults");
    let spec = &defaults.data["spec"];
    assert_eq!(spec["maxLeases"], 5);
    assert_eq!(spec["port"], 3128);
    assert_eq!(
        spec["healthCheck"],
        json!({
            "probeURL": "https://www.gstatic.com/generate_204",
            "interval": "30s",
            "timeout": "5s",
            "failureThreshold": 3,
            "successThreshold": 1,
            "expectedStatusCodes": [200, 204],
        })
    );

    // Transition rules: mode and provider are immutable.
    let managed = world
        .create("managed", json!({"mode": "Managed", "provider": "local"}))
        .await
        .expect("create a Managed Proxy");
    let api = world.raw_proxies();
    for (patch, expected) in [
        (
            json!({"spec": {"mode": "External", "provider": null, "endpoint": endpoint}}),
            "mode is immutable",
        ),
        (
            json!({"spec": {"provider": "other"}}),
            "provider is immutable",
        ),
    ] {
        let result = api
            .patch(
                &managed.name_any(),
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .await;
        let message = refusal(result);
        assert!(message.contains(expected), "{patch}: {message}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn external_and_managed_proxies_reach_ready_and_are_leased() {
    let Some(world) = World::new("ready").await else {
        return;
    };
    let squid = Squid::start();
    let operator = world.operator(&[]).await;
    world
        .create("ext", world.external_spec(&squid, "500ms"))
        .await
        .expect("create the External Proxy");
    world
        .create("managed", world.managed_spec(3128))
        .await
        .expect("create the Managed Proxy");

    let ext = world.wait_ready("ext").await;
    assert_eq!(ext["status"]["ip"], "127.0.0.1");
    assert!(
        ext["metadata"]["finalizers"].is_null(),
        "an External Proxy gets no finalizer: {ext}"
    );
    let managed = world.wait_ready("managed").await;
    let pod = world.pod_of(&managed).await.expect("the managed Pod");
    let pod_ip = world
        .kubelet
        .address(&world.ns, &pod.name_any())
        .expect("the kubelet published the Pod's IP");
    assert_eq!(managed["status"]["ip"], pod_ip.to_string());
    assert_eq!(
        managed["status"]["providerID"],
        format!("{}/{}", world.ns, pod.name_any())
    );
    assert_eq!(
        managed["metadata"]["finalizers"],
        json!(["crawl.example.com/finalizer"])
    );
    let labels = pod.labels();
    assert_eq!(labels["crawl.example.com/managed"], "true");
    assert_eq!(
        labels["crawl.example.com/proxy-uid"],
        managed["metadata"]["uid"].as_str().unwrap_or_default()
    );

    // The lease API serves both.
    let (status, list) = operator
        .call(
            Method::GET,
            "/v1/proxies?healthy=true&selector=pool=envtest",
            None,
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{list}");
    assert_eq!(list["count"], 2, "{list}");
    let (status, lease) = operator
        .call(
            Method::POST,
            "/v1/leases",
            Some(
                json!({"selector": {"pool": "envtest"}, "target": "example.com", "ttlSeconds": 60}),
            ),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{lease}");
    let id = lease["leaseID"].as_str().expect("a lease ID").to_owned();
    operator
        .report(
            &id,
            json!({"result": "rate_limited", "target": "example.com"}),
        )
        .await;
    operator.release(&id).await;
    let released = operator.lease(&id).await;
    assert_eq!(released["state"], "released", "{released}");

    // Creation is on record as an Event.
    let reasons = world.event_reasons("managed").await;
    assert!(reasons.iter().any(|r| r == "Created"), "{reasons:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_managed_squid_asks_for_its_generated_credentials_and_the_gateway_sends_them() {
    let Some(world) = World::new("locked").await else {
        return;
    };
    let target_url = world.target.http_url();
    let target_port = reqwest::Url::parse(&target_url)
        .ok()
        .and_then(|u| u.port())
        .expect("the target's port");
    let operator = world
        .operator(&[
            "--gateway-allowed-ports",
            &target_port.to_string(),
            "--gateway-allowed-destinations",
            "127.0.0.0/8",
        ])
        .await;
    world
        .create_in_pool("locked", "locked", &[], world.managed_spec(3128))
        .await;
    let proxy = world.wait_ready("locked").await;
    let uid = proxy["metadata"]["uid"].as_str().unwrap().to_owned();

    // The credentials live in a Secret the Proxy owns, labelled for the operator's watch; the
    // Pod reads them from it, so its spec holds none.
    let secrets: Api<Secret> = Api::namespaced(world.client.clone(), &world.ns);
    let secret = secrets
        .get(&machine_secret_name(&uid))
        .await
        .expect("the machines' credentials Secret");
    assert_eq!(
        secret.labels()["crawl.example.com/proxy-credentials"],
        "true"
    );
    let owner = &secret.owner_references()[0];
    assert_eq!(
        (owner.uid.as_str(), owner.controller),
        (uid.as_str(), Some(true))
    );
    let data = secret.data.clone().unwrap_or_default();
    let value = |key: &str| String::from_utf8(data[key].0.clone()).unwrap();
    let (username, password) = (value("username"), value("password"));
    assert!(value("htpasswd").starts_with(&format!("{username}:$6$")));
    let pod = world.pod_of(&proxy).await.expect("the Pod");
    let env = pod.spec.as_ref().unwrap().containers[0]
        .env
        .clone()
        .unwrap_or_default();
    let passwd = env
        .iter()
        .find(|e| e.name == "SQUID_PASSWD")
        .expect("the password file's variable");
    assert!(passwd.value.is_none());
    let reference = passwd
        .value_from
        .as_ref()
        .and_then(|v| v.secret_key_ref.as_ref())
        .expect("a secretKeyRef");
    assert_eq!(reference.name, machine_secret_name(&uid));

    // Straight to the squid: 407 without the credentials, served with them.
    let squid = format!("http://{}:3128", proxy["status"]["ip"].as_str().unwrap());
    let through = |proxy_url: String| {
        reqwest::Client::builder()
            .proxy(reqwest::Proxy::all(proxy_url).unwrap())
            .build()
            .unwrap()
    };
    let open = through(squid.clone())
        .get(&target_url)
        .send()
        .await
        .unwrap();
    assert_eq!(open.status(), StatusCode::PROXY_AUTHENTICATION_REQUIRED);
    let authenticated = squid.replacen("http://", &format!("http://{username}:{password}@"), 1);
    let served = through(authenticated)
        .get(&target_url)
        .send()
        .await
        .unwrap();
    assert_eq!(served.status(), StatusCode::NO_CONTENT);

    // The gateway sends them for the crawler, who never sees them.
    let gateway = format!(
        "http://crawler;pool=locked:{}@{}",
        support::operator::API_TOKEN,
        operator.gateway()
    );
    let response = through(gateway).get(&target_url).send().await.unwrap();
    assert_eq!(response.status(), StatusCode::NO_CONTENT);
    assert_eq!(
        response.headers()["x-proxy-name"],
        format!("{}/locked", world.ns).as_str()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spec_and_secret_changes_replace_the_pod_and_delete_cleans_up() {
    let Some(world) = World::new("replace").await else {
        return;
    };
    let secrets: Api<Secret> = Api::namespaced(world.client.clone(), &world.ns);
    let secret: Secret = serde_json::from_value(json!({
        "metadata": {"name": "init", "labels": {"crawl.example.com/cloud-init": "true"}},
        "stringData": {"user-data": "#cloud-config\n# v1\n"},
    }))
    .expect("a Secret");
    secrets
        .create(&PostParams::default(), &secret)
        .await
        .expect("create the cloud-init Secret");
    let _operator = world.operator(&[]).await;
    let mut spec = world.managed_spec(3128);
    spec["cloudInit"] = json!({"secretRef": {"name": "init", "key": "user-data"}});
    world.create("px", spec).await.expect("create the Proxy");
    let first = world.wait_ready("px").await;
    let first_pod = world.pod_of(&first).await.expect("the first Pod");
    let first_ip = first["status"]["ip"].clone();

    // A port change replaces the Pod: a new Pod (new UID) on a new IP, Ready again.
    world
        .proxies()
        .patch(
            "px",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"port": 3129}})),
        )
        .await
        .expect("change the port");
    let second = world
        .wait_proxy("px", "Ready on a new Pod after the port change", |s| {
            s["phase"] == "Ready" && s["ip"].is_string() && s["ip"] != first_ip
        })
        .await;
    let second_pod = world.pod_of(&second).await.expect("the second Pod");
    assert_ne!(second_pod.uid(), first_pod.uid());
    let container = &second_pod.spec.as_ref().expect("a Pod spec").containers[0];
    assert_eq!(
        container.ports.as_ref().expect("ports")[0].container_port,
        3129
    );
    let reasons = world.event_reasons("px").await;
    assert!(reasons.iter().any(|r| r == "Replacing"), "{reasons:?}");

    // Editing the referenced Secret replaces it again.
    secrets
        .patch(
            "init",
            &PatchParams::default(),
            &Patch::Merge(json!({"stringData": {"user-data": "#cloud-config\n# v2\n"}})),
        )
        .await
        .expect("edit the Secret");
    let second_ip = second["status"]["ip"].clone();
    let third = world
        .wait_proxy("px", "Ready on a new Pod after the Secret edit", |s| {
            s["phase"] == "Ready" && s["ip"].is_string() && s["ip"] != second_ip
        })
        .await;
    let third_pod = world.pod_of(&third).await.expect("the third Pod");
    assert_ne!(third_pod.uid(), second_pod.uid());

    // Deleting the Proxy removes the Pod first, then the Proxy.
    world
        .proxies()
        .delete("px", &DeleteParams::default())
        .await
        .expect("delete the Proxy");
    wait_gone(&world.pods(), &third_pod.name_any()).await;
    wait_gone(&world.proxies(), "px").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orphan_pods_are_collected_while_holding_the_lease() {
    let Some(world) = World::new("gc").await else {
        return;
    };
    let operator = world
        .operator(&["--gc-interval", "1s", "--gc-min-age", "0s"])
        .await;
    world
        .create("live", world.managed_spec(3128))
        .await
        .expect("create a live Proxy");
    let live = world.wait_ready("live").await;

    // A Pod with this install's labels whose Proxy never existed.
    let orphan_uid = "00000000-0000-4000-8000-00000000dead";
    let orphan = world.machine_pod("gone", orphan_uid);
    let pods = world.pods();
    pods.create(&PostParams::default(), &orphan)
        .await
        .expect("plant the orphan Pod");
    wait_gone(&pods, &machine_name(orphan_uid)).await;

    // Collected by the Lease holder; the live Proxy's Pod stays.
    let leases: Api<Lease> = Api::namespaced(world.client.clone(), "proxy-operator");
    let lease = leases
        .get(&format!("leader-{}", world.ns))
        .await
        .expect("the leader Lease exists");
    assert_eq!(
        lease.spec.and_then(|s| s.holder_identity),
        Some(operator.identity())
    );
    assert!(world.pod_of(&live).await.is_some(), "the live Pod was kept");
    // The holder says so on /metrics: what the no-leader alert sums.
    let start = Instant::now();
    while metric_sum(&operator.metrics().await, "proxy_operator_leader", &[]) != 1.0 {
        assert!(start.elapsed() < SLOW, "proxy_operator_leader is not 1");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_and_restart_keeps_pods_and_leases() {
    let Some(world) = World::new("restart").await else {
        return;
    };
    let mut operator = world.operator(&[]).await;
    world
        .create("px", world.managed_spec(3128))
        .await
        .expect("create the Proxy");
    let before = world.wait_ready("px").await;
    let pod = world.pod_of(&before).await.expect("the Pod");
    let (status, lease) = operator
        .call(
            Method::POST,
            "/v1/leases",
            Some(json!({"selector": {"pool": "envtest"}, "ttlSeconds": 600})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{lease}");
    let id = lease["leaseID"].as_str().expect("a lease ID").to_owned();

    operator.restart();
    operator.wait_ready(SLOW).await;
    let (status, after_lease) = operator
        .call(Method::GET, &format!("/v1/leases/{id}"), None)
        .await;
    assert_eq!(status, StatusCode::OK, "{after_lease}");
    assert_eq!(after_lease["state"], "active", "{after_lease}");

    // Ready again on the same Pod, and no create was attempted by the new process.
    let after = world
        .wait_proxy("px", "Ready after the restart", |s| s["phase"] == "Ready")
        .await;
    assert_eq!(after["status"]["ip"], before["status"]["ip"]);
    let same = world.pod_of(&after).await.expect("the Pod after restart");
    assert_eq!(same.uid(), pod.uid());
    assert_eq!(world.kubelet.started(&world.ns, &pod.name_any()).len(), 1);
    // Let at least one drift poll (2 s) pass, then read the provider counters.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let metrics = operator.metrics().await;
    assert_eq!(
        metric_sum(
            &metrics,
            "proxy_operator_provider_requests_total",
            &["op=\"create\""]
        ),
        0.0,
        "{metrics}"
    );
    assert!(
        metric_sum(
            &metrics,
            "proxy_operator_provider_requests_total",
            &["op=\"get\""]
        ) > 0.0,
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn steady_health_causes_no_status_writes() {
    let Some(world) = World::new("steady").await else {
        return;
    };
    let squid = Squid::start();
    let _operator = world.operator(&[]).await;
    world
        .create("ext", world.external_spec(&squid, "1s"))
        .await
        .expect("create the Proxy");
    let ready = world.wait_ready("ext").await;
    let version = ready["metadata"]["resourceVersion"].clone();
    let connects = || squid.access_log().matches("CONNECT").count();
    let start = connects();

    // 20 more probes; the latency rule allows at most one status write per 60 s.
    let api = world.raw_proxies();
    let mut versions = vec![version];
    let began = Instant::now();
    while connects() < start + 20 {
        assert!(began.elapsed() < SLOW, "fewer than 20 probes in {SLOW:?}");
        let object = api.get("ext").await.expect("read the Proxy");
        let rv = json!(object.resource_version());
        if versions.last() != Some(&rv) {
            versions.push(rv);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        versions.len() <= 2,
        "status written {} times during 20 steady probes: {versions:?}",
        versions.len() - 1
    );
}

/// The shared duration table (`tests/data/durations.json`), as the server judges it.
#[derive(serde::Deserialize)]
struct DurationTable {
    strings: Vec<DurationCase>,
    pairs: Vec<DurationPair>,
}

#[derive(serde::Deserialize)]
struct DurationCase {
    value: String,
    accepted: bool,
}

#[derive(serde::Deserialize)]
struct DurationPair {
    interval: Option<String>,
    timeout: Option<String>,
    accepted: bool,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_accepts_exactly_the_durations_the_operator_decodes() {
    let Some(world) = World::new("durations").await else {
        return;
    };
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/durations.json");
    let table: DurationTable =
        serde_json::from_str(&std::fs::read_to_string(path).expect("read the duration table"))
            .expect("parse the duration table");
    let spec = |health_check: Value| {
        json!({
            "mode": "External",
            "endpoint": {"host": "127.0.0.1", "port": 3128},
            "healthCheck": health_check,
        })
    };
    for (i, case) in table.strings.iter().enumerate() {
        let result = world
            .create(
                &format!("s{i}"),
                spec(json!({"interval": case.value, "timeout": case.value})),
            )
            .await;
        if case.accepted {
            result.unwrap_or_else(|e| panic!("{:?} refused by the server: {e}", case.value));
        } else {
            let message = refusal(result);
            assert!(
                message.contains("spec.healthCheck.interval")
                    && message.contains("spec.healthCheck.timeout"),
                "{:?}: the refusal names neither field: {message}",
                case.value
            );
        }
    }
    for (i, pair) in table.pairs.iter().enumerate() {
        let mut check = serde_json::Map::new();
        if let Some(interval) = &pair.interval {
            check.insert("interval".into(), json!(interval));
        }
        if let Some(timeout) = &pair.timeout {
            check.insert("timeout".into(), json!(timeout));
        }
        let result = world
            .create(&format!("p{i}"), spec(Value::Object(check)))
            .await;
        let what = format!("interval {:?}, timeout {:?}", pair.interval, pair.timeout);
        if pair.accepted {
            result.unwrap_or_else(|e| panic!("{what} refused by the server: {e}"));
        } else {
            let message = refusal(result);
            assert!(
                message.contains("spec.healthCheck")
                    && message.contains("timeout must not be longer than interval"),
                "{what}: {message}"
            );
        }
    }
}
