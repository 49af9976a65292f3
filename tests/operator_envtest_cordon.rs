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

mod support;

use std::path::Path;
use std::process::Command;

use kube::ResourceExt;
use kube::api::{Patch, PatchParams, PostParams};
use proxy_operator::proxy::SPEC_HASH_ANNOTATION;
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use support::Squid;
use support::operator::OperatorProcess;
use support::world::{World, eventually};

/// Creates a Proxy labelled `pool: <pool>`, so each proxy of this test has a selector of its
/// own.
async fn create_in_pool(world: &World, name: &str, pool: &str, spec: Value) {
    let object = serde_json::from_value(json!({
        "apiVersion": "crawl.example.com/v1alpha1",
        "kind": "Proxy",
        "metadata": {"name": name, "labels": {"pool": pool}},
        "spec": spec,
    }))
    .expect("a Proxy object");
    world
        .raw_proxies()
        .create(&PostParams::default(), &object)
        .await
        .unwrap_or_else(|e| panic!("create Proxy {name}: {e}"));
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

/// `kubectl patch px <name> --type merge -p '{"spec":{"cordoned":<value>}}'` (through the
/// client when kubectl is missing); returns the Proxy's new generation.
async fn set_cordoned(world: &World, kubeconfig: &Path, name: &str, value: bool) -> i64 {
    let patch = json!({"spec": {"cordoned": value}});
    let by_kubectl = kubectl(
        kubeconfig,
        &world.ns,
        &[
            "patch",
            "px",
            name,
            "--type",
            "merge",
            "-p",
            &patch.to_string(),
        ],
    );
    if by_kubectl.is_none() {
        world
            .proxies()
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .expect("patch spec.cordoned");
    }
    let proxy = world.proxies().get(name).await.expect("read the Proxy");
    assert_eq!(proxy.spec.cordoned, value);
    proxy.metadata.generation.expect("a generation")
}

/// The listed proxy `name` of `pool`, once it shows `cordoned: <value>`.
async fn wait_listed(operator: &OperatorProcess, pool: &str, name: &str, value: bool) -> Value {
    eventually(&format!("{name} listed with cordoned: {value}"), || async {
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
            .find(|p| p["name"] == name && p["cordoned"] == value)
            .cloned()
    })
    .await
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
    let kubeconfig = world.dir.path().join("admin.kubeconfig");
    world.cp.write_admin_kubeconfig(&kubeconfig);
    let mut squid = Squid::start();
    let operator = world.operator(&[]).await;
    create_in_pool(
        &world,
        "ext",
        "cordon-ext",
        world.external_spec(&squid, "500ms"),
    )
    .await;
    create_in_pool(
        &world,
        "managed",
        "cordon-managed",
        world.managed_spec(3128),
    )
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
    let listed = wait_listed(&operator, "cordon-ext", "ext", false).await;
    assert_eq!(listed["activeLeases"], 1, "{listed}");

    set_cordoned(&world, &kubeconfig, "ext", true).await;
    let listed = wait_listed(&operator, "cordon-ext", "ext", true).await;
    assert_eq!(listed["healthy"], true, "{listed}");
    assert_eq!(listed["activeLeases"], 1, "{listed}");
    assert_refused_as_cordoned(&operator, "cordon-ext").await;

    // The lease granted before goes on: its request ID replays it, it renews, takes a report.
    let (status, replay) = operator
        .call(Method::POST, "/v1/leases", Some(before.clone()))
        .await;
    assert_eq!(status, StatusCode::OK, "{replay}");
    assert_eq!(replay["leaseID"], id.as_str(), "{replay}");
    let (status, renewed) = operator
        .call(
            Method::POST,
            &format!("/v1/leases/{id}/renew"),
            Some(json!({"ttlSeconds": 120})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{renewed}");
    assert_eq!(renewed["state"], "active", "{renewed}");
    assert_eq!(renewed["ttlSeconds"], 120, "{renewed}");
    let (status, body) = operator
        .call(
            Method::POST,
            &format!("/v1/leases/{id}/report"),
            Some(json!({"result": "ok"})),
        )
        .await;
    assert_eq!(status, StatusCode::NO_CONTENT, "{body}");

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
    wait_listed(&operator, "cordon-managed", "managed", true).await;
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
    wait_listed(&operator, "cordon-ext", "ext", false).await;
    let (status, lease) = operator
        .call(
            Method::POST,
            "/v1/leases",
            Some(json!({"selector": {"pool": "cordon-ext"}})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{lease}");

    // And kubectl shows it (when installed): ext false, managed true.
    if let Some(out) = kubectl(&kubeconfig, &world.ns, &["get", "px"]) {
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
