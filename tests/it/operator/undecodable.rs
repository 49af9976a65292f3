//! A Proxy the operator cannot decode (stored before the CRD validated its durations) must not
//! take the fleet down: on a real API server, the bad object is stored under a looser CRD, the
//! real CRD is applied, and the `proxy-operator run` binary starts. On a control plane of its
//! own: it swaps the cluster-wide CRD.
//!
//! Needs `KUBEBUILDER_ASSETS`, like `operator::lifecycle`.

use crate::support;

use std::time::{Duration, Instant};

use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, ApiResource, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use proxy_operator::proxy_watch::{REASON_INVALID_SPEC, UNDECODABLE_METRIC};
use proxy_operator::resources::proxy::Proxy;
use reqwest::{Method, StatusCode};
use serde_json::json;
use support::envtest::{ControlPlane, parse_yaml_documents};
use support::operator::{OperatorProcess, metric_sum};
use support::{Squid, Target};

const SLOW: Duration = Duration::from_secs(90);

/// `crd/proxy.yaml` without the duration rules: what a cluster ran before they existed.
fn looser_crd() -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/crd/proxy.yaml");
    let yaml = std::fs::read_to_string(path).expect("read crd/proxy.yaml");
    let mut crd = parse_yaml_documents(&yaml)
        .into_iter()
        .next()
        .expect("the CRD document");
    for version in crd["spec"]["versions"]
        .as_array_mut()
        .expect("CRD versions")
    {
        let check = &mut version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["healthCheck"];
        let object = check.as_object_mut().expect("the healthCheck schema");
        object.remove("x-kubernetes-validations");
        for field in ["interval", "timeout"] {
            let field = object["properties"][field]
                .as_object_mut()
                .expect("a duration field schema");
            field.remove("x-kubernetes-validations");
            field.remove("maxLength");
        }
    }
    // JSON is YAML.
    crd.to_string()
}

fn proxy(name: &str, port: u16, probe_url: &str, interval: &str) -> DynamicObject {
    serde_json::from_value(json!({
        "apiVersion": "crawl.example.com/v1alpha1",
        "kind": "Proxy",
        "metadata": {"name": name, "labels": {"pool": "poison"}},
        "spec": {
            "mode": "External",
            "endpoint": {"host": "127.0.0.1", "port": port},
            "healthCheck": {"probeURL": probe_url, "interval": interval, "timeout": "500ms"},
        },
    }))
    .expect("a Proxy object")
}

/// Polls `probe` until it yields a value, panicking with `what` after [`SLOW`].
async fn eventually<T, Fut>(what: &str, mut probe: impl FnMut() -> Fut) -> T
where
    Fut: std::future::Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        if let Some(value) = probe().await {
            return value;
        }
        assert!(start.elapsed() < SLOW, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn served_names(operator: &OperatorProcess) -> Vec<String> {
    let (status, list) = operator
        .call(Method::GET, "/v1/proxies?selector=pool=poison", None)
        .await;
    assert_eq!(status, StatusCode::OK, "{list}");
    let mut names: Vec<String> = list["proxies"]
        .as_array()
        .map(|ps| {
            ps.iter()
                .filter_map(|p| p["name"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undecodable_proxy_is_skipped_and_named_while_the_rest_is_served() {
    // It swaps the cluster-wide CRD: a control plane of its own.
    let Some(cp) = ControlPlane::dedicated("crd-swap", &[]) else {
        return;
    };
    let squid = Squid::start();
    let target = Target::start();
    let probe_url = target.https_url();

    // Stored under a CRD that did not check durations yet.
    cp.apply_crd_yaml(&looser_crd()).await;
    let ns = cp.new_namespace("poison").await;
    let client = cp.admin_client();
    let api: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), &ns, &ApiResource::erase::<Proxy>(&()));
    api.create(
        &PostParams::default(),
        &proxy("typo", squid.port(), &probe_url, "30"),
    )
    .await
    .expect("the looser CRD stores interval \"30\"");
    api.create(
        &PostParams::default(),
        &proxy("good", squid.port(), &probe_url, "500ms"),
    )
    .await
    .expect("create the good Proxy");

    // Today's CRD; the stored object stays as it is (no ratcheting, no migration).
    cp.apply_crd().await;
    let refused = api
        .create(
            &PostParams::default(),
            &proxy("typo-again", squid.port(), &probe_url, "30"),
        )
        .await;
    assert!(refused.is_err(), "today's CRD refuses interval \"30\"");

    let dir = tempfile::tempdir().expect("temp dir");
    // Ready despite the bad object, and the good one is reconciled and served.
    let mut operator =
        OperatorProcess::start_ready(cp, dir.path(), &target, &ns, Some(&ns), &[]).await;
    eventually("the good Proxy to be Ready", || async {
        let object = api.get("good").await.ok()?;
        (object.data["status"]["phase"] == "Ready").then_some(())
    })
    .await;
    assert_eq!(served_names(&operator).await, ["good"]);

    // Named in the log, in a Warning Event on the object, and in the gauge.
    let log = operator.log_text();
    assert!(
        log.contains(&format!("Proxy {ns}/typo")) && log.contains("cannot be decoded"),
        "{log}"
    );
    let events: Api<Event> = Api::namespaced(client.clone(), &ns);
    let warning = eventually("a Warning Event on the bad Proxy", || async {
        let list = events.list(&ListParams::default()).await.ok()?;
        list.items.into_iter().find(|e| {
            e.reason.as_deref() == Some(REASON_INVALID_SPEC)
                && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("typo")
        })
    })
    .await;
    assert_eq!(warning.type_.as_deref(), Some("Warning"));
    let note = warning.note.unwrap_or_default();
    assert!(
        note.contains("interval") && note.contains("fix"),
        "the Event says what to fix: {note}"
    );
    let metrics = operator.metrics().await;
    assert_eq!(
        metric_sum(&metrics, UNDECODABLE_METRIC, &[]),
        1.0,
        "{metrics}"
    );

    // Fixed: decoded, served and reconciled; the gauge drops.
    api.patch(
        "typo",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"healthCheck": {"interval": "30s"}}})),
    )
    .await
    .expect("fix the interval");
    eventually("the fixed Proxy to be Ready", || async {
        let object = api.get("typo").await.ok()?;
        (object.data["status"]["phase"] == "Ready").then_some(())
    })
    .await;
    assert_eq!(served_names(&operator).await, ["good", "typo"]);
    let metrics = operator.metrics().await;
    assert_eq!(
        metric_sum(&metrics, UNDECODABLE_METRIC, &[]),
        0.0,
        "{metrics}"
    );
    let status = operator.terminate();
    assert!(status.success(), "clean exit on SIGTERM: {status}");
}
