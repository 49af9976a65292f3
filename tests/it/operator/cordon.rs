//! `spec.cordoned` end to end on a real Kubernetes API server: the `proxy-operator run` binary
//! as a process, a real squid behind an External Proxy and the test kubelet behind a Managed
//! one. Cordoning with `kubectl patch` stops new leases and nothing else: the lease held goes
//! on, health checks go on, a Managed proxy's machine is not replaced, and `kubectl get px`
//! shows the column.
//!
//! Needs `KUBEBUILDER_ASSETS` (kube-apiserver + etcd); without it the test passes as skipped,
//! unless `CI` is set. `kubectl` is used when it is on the PATH; without it the same merge
//! patch goes through the client and the server-side table (what `kubectl get` prints) is
//! still checked.

use crate::support;

use std::path::Path;

use kube::ResourceExt;
use proxy_operator::resources::proxy::SPEC_HASH_ANNOTATION;
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use support::Squid;
use support::operator::OperatorProcess;
use support::world::World;

/// `kubectl patch px <name> --type merge -p '{"spec":{"cordoned":<value>}}'` (through the
/// client when kubectl is missing); returns the Proxy's new generation.
async fn set_cordoned(world: &World, kubeconfig: &Path, name: &str, value: bool) -> i64 {
    world
        .patch_proxy(kubeconfig, name, &json!({"spec": {"cordoned": value}}))
        .await;
    let proxy = world.proxies().get(name).await.expect("read the Proxy");
    assert_eq!(proxy.spec.cordoned, value);
    proxy.metadata.generation.expect("a generation")
}

/// Asserts an acquire on `pool` is refused with every proxy counted as cordoned.
async fn assert_refused_as_cordoned(operator: &OperatorProcess, pool: &str) {
    let (status, body) = operator
        .call(
            Method::POST,
            "/v1/leases",
            Some(json!({"selector": {"pool": pool}})),
        )
        .await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert_eq!(body["error"], "no_match", "{body}");
    assert_eq!(body["considered"], 1, "{body}");
    assert_eq!(body["cordoned"], 1, "{body}");
    assert_eq!(body["unhealthy"], 0, "{body}");
    assert_eq!(body["atCapacity"], 0, "{body}");
    assert_eq!(body["inCooldown"], 0, "{body}");
    assert!(body.get("retryAfterSeconds").is_none(), "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cordoning_stops_new_leases_and_nothing_else() {
    let Some(world) = World::new("cordon").await else {
        return;
    };
    let kubeconfig = world.admin_kubeconfig();
    let mut squid = Squid::start();
    let operator = world.operator(&[]).await;
    world
        .create_in_pool(
            "ext",
            "cordon-ext",
            &[],
            world.external_spec(&squid, "500ms"),
        )
        .await;
    world
        .create_in_pool("managed", "cordon-managed", &[], world.managed_spec(3128))
        .await;
    let ext = world.wait_ready("ext").await;
    assert_eq!(ext["spec"]["cordoned"], false, "the server defaults it");
    let managed = world.wait_ready("managed").await;
    let pod = world.pod_of(&managed).await.expect("the managed Pod");
    let hash = managed["metadata"]["annotations"][SPEC_HASH_ANNOTATION].clone();
    assert!(hash.is_string(), "{managed}");

    // A lease on the External proxy before the cordon, with a request ID.
    let before =
        json!({"selector": {"pool": "cordon-ext"}, "ttlSeconds": 60, "requestID": "pre-cordon"});
    let (status, lease) = operator
        .call(Method::POST, "/v1/leases", Some(before.clone()))
        .await;
    assert_eq!(status, StatusCode::CREATED, "{lease}");
    assert_eq!(lease["proxy"]["name"], "ext");
    let id = lease["leaseID"].as_str().expect("a lease ID").to_owned();
    let listed = operator
        .wait_listed("cordon-ext", "ext", "cordoned", false)
        .await;
    assert_eq!(listed["activeLeases"], 1, "{listed}");

    set_cordoned(&world, &kubeconfig, "ext", true).await;
    let listed = operator
        .wait_listed("cordon-ext", "ext", "cordoned", true)
        .await;
    assert_eq!(listed["healthy"], true, "{listed}");
    assert_eq!(listed["activeLeases"], 1, "{listed}");
    assert_refused_as_cordoned(&operator, "cordon-ext").await;

    // The lease granted before goes on: its request ID replays it, it renews, takes a report.
    let (status, replay) = operator
        .call(Method::POST, "/v1/leases", Some(before.clone()))
        .await;
    assert_eq!(status, StatusCode::OK, "{replay}");
    assert_eq!(replay["leaseID"], id.as_str(), "{replay}");
    let (status, renewed) = operator.renew(&id, 120).await;
    assert_eq!(status, StatusCode::OK, "{renewed}");
    assert_eq!(renewed["state"], "active", "{renewed}");
    assert_eq!(renewed["ttlSeconds"], 120, "{renewed}");
    operator.report(&id, json!({"result": "ok"})).await;

    // Health checks go on and the status follows them: down, then Ready again.
    let ready = world
        .wait_proxy("ext", "ext Ready while cordoned", |s| s["phase"] == "Ready")
        .await;
    assert_eq!(ready["spec"]["cordoned"], true);
    squid.kill();
    world
        .wait_proxy("ext", "the cordoned ext to turn Unhealthy", |s| {
            s["phase"] == "Unhealthy"
        })
        .await;
    squid.restart();
    world
        .wait_proxy("ext", "the cordoned ext Ready again", |s| {
            s["phase"] == "Ready"
        })
        .await;
    assert_refused_as_cordoned(&operator, "cordon-ext").await;

    // A Managed proxy: cordoning is not a spec change that replaces the machine.
    let generation = set_cordoned(&world, &kubeconfig, "managed", true).await;
    let after = world
        .wait_proxy("managed", "the cordon observed", |s| {
            s["observedGeneration"] == generation && s["phase"] == "Ready"
        })
        .await;
    assert_eq!(
        after["metadata"]["annotations"][SPEC_HASH_ANNOTATION], hash,
        "{after}"
    );
    let same = world.pod_of(&after).await.expect("the managed Pod");
    assert_eq!(same.uid(), pod.uid(), "the Pod was not replaced");
    assert_eq!(after["status"]["ip"], managed["status"]["ip"]);
    operator
        .wait_listed("cordon-managed", "managed", "cordoned", true)
        .await;
    assert_refused_as_cordoned(&operator, "cordon-managed").await;
    let reasons = world.event_reasons("managed").await;
    assert!(!reasons.iter().any(|r| r == "Replacing"), "{reasons:?}");

    // The printer column, as the server renders it for `kubectl get px`.
    let path = format!(
        "/apis/crawl.example.com/v1alpha1/namespaces/{}/proxies",
        world.ns
    );
    let request = http::Request::get(path)
        .header(
            http::header::ACCEPT,
            "application/json;as=Table;v=v1;g=meta.k8s.io",
        )
        .body(Vec::new())
        .expect("a Table request");
    let table: Value = serde_json::from_str(
        &world
            .client
            .request_text(request)
            .await
            .expect("list Proxies as a Table"),
    )
    .expect("a Table");
    let columns: Vec<&str> = table["columnDefinitions"]
        .as_array()
        .expect("column definitions")
        .iter()
        .filter_map(|c| c["name"].as_str())
        .collect();
    let at = columns
        .iter()
        .position(|c| *c == "Cordoned")
        .unwrap_or_else(|| panic!("no Cordoned column: {columns:?}"));
    assert_eq!(table["columnDefinitions"][at]["type"], "boolean");
    assert_eq!(table["columnDefinitions"][at]["priority"], 0, "{table}");
    let rows = table["rows"].as_array().expect("rows");
    assert_eq!(rows.len(), 2, "{table}");
    for row in rows {
        assert_eq!(row["cells"][at], true, "{row}");
    }

    // Uncordoned, the External proxy takes new leases again.
    set_cordoned(&world, &kubeconfig, "ext", false).await;
    operator
        .wait_listed("cordon-ext", "ext", "cordoned", false)
        .await;
    let (status, lease) = operator
        .call(
            Method::POST,
            "/v1/leases",
            Some(json!({"selector": {"pool": "cordon-ext"}})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{lease}");

    // And kubectl shows it (when installed): ext false, managed true.
    if let Some(out) = world.kubectl(&kubeconfig, &["get", "px"]) {
        // Cells are aligned under their header (an empty cell would break a split).
        let mut lines = out.lines();
        let header = lines.next().unwrap_or_default();
        let at = header
            .find("CORDONED")
            .unwrap_or_else(|| panic!("no CORDONED column:\n{out}"));
        let cordoned: Vec<(String, String)> = lines
            .map(|l| {
                let name = l.split_whitespace().next().unwrap_or_default();
                let cell = l.get(at..).unwrap_or_default().split_whitespace().next();
                (name.to_owned(), cell.unwrap_or_default().to_owned())
            })
            .collect();
        assert_eq!(
            cordoned,
            [
                ("ext".to_owned(), "false".to_owned()),
                ("managed".to_owned(), "true".to_owned())
            ],
            "{out}"
        );
    }
    drop(operator);
}
