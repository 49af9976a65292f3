//! `proxy-operator run` in-process against a mock Kubernetes API server (tower-test): start-up
//! lists and watches Proxies, `/readyz` turns ready once the watch has synced, and an External
//! proxy backed by a real squid is reconciled to `Ready` with one status write — no finalizer,
//! no provider call. Every request must be granted by the install's RBAC (`rbac::API_CALLS`).

mod support;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use http::{Request, Response, StatusCode};
use kube::Client;
use kube::client::Body;
use proxy_operator::cli::{Cli, Command};
use proxy_operator::process::{Exit, operator};
use proxy_operator::rbac;
use serde_json::{Value, json};
use support::{DEADLINE, Squid, Target, free_port};
use tower_test::mock;

type Requests = Arc<Mutex<Vec<(String, String, Value)>>>;

fn proxy(squid_port: u16, probe_url: &str) -> Value {
    json!({
        "apiVersion": "crawl.example.com/v1alpha1",
        "kind": "Proxy",
        "metadata": {
            "name": "ext", "namespace": "crawl", "uid": "5d0c1c1e-0000-4000-8000-000000000001",
            "resourceVersion": "7", "generation": 1,
            "creationTimestamp": "2026-11-30T00:00:00Z",
            "labels": {"geo": "eu"}
        },
        "spec": {
            "mode": "External",
            "endpoint": {"host": "127.0.0.1", "port": squid_port},
            "maxLeases": 2,
            "healthCheck": {"probeURL": probe_url, "interval": "300ms", "timeout": "2s"}
        }
    })
}

fn reply(status: StatusCode, body: &Value) -> Response<Body> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Body::from(serde_json::to_vec(body).unwrap()))
        .unwrap()
}

/// Answers like an API server holding one External Proxy and nothing else. Watches are held
/// open without events, as a quiet cluster's are.
async fn api_server(
    mut handle: mock::Handle<Request<Body>, Response<Body>>,
    proxy: Value,
    requests: Requests,
) {
    let mut open_watches = Vec::new();
    while let Some((request, send)) = handle.next_request().await {
        let method = request.method().as_str().to_owned();
        let target = request
            .uri()
            .path_and_query()
            .map_or(String::new(), |p| p.as_str().to_owned());
        let path = request.uri().path().to_owned();
        let watch = target.contains("watch=true");
        let bytes = request.into_body().collect_bytes().await.unwrap();
        let body: Value = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes).unwrap()
        };
        assert!(
            rbac::permits(&method, &target),
            "{method} {target} is not granted by the install's RBAC"
        );
        requests
            .lock()
            .unwrap()
            .push((method.clone(), target.clone(), body.clone()));
        if watch {
            open_watches.push(send);
            continue;
        }
        let response = match (method.as_str(), path.as_str()) {
            ("GET", "/apis/crawl.example.com/v1alpha1/proxies") => reply(
                StatusCode::OK,
                &json!({"apiVersion": "crawl.example.com/v1alpha1", "kind": "ProxyList",
                        "metadata": {"resourceVersion": "7"}, "items": [proxy]}),
            ),
            ("GET", "/api/v1/secrets") => reply(
                StatusCode::OK,
                &json!({"apiVersion": "v1", "kind": "SecretList", "metadata": {"resourceVersion": "7"}, "items": []}),
            ),
            ("PATCH", "/apis/crawl.example.com/v1alpha1/namespaces/crawl/proxies/ext/status") => {
                let mut updated = proxy.clone();
                updated["status"] = body["status"].clone();
                reply(StatusCode::OK, &updated)
            }
            ("GET", p) if p.contains("/leases/") => reply(
                StatusCode::NOT_FOUND,
                &json!({"apiVersion": "v1", "kind": "Status", "status": "Failure", "reason": "NotFound", "code": 404}),
            ),
            ("POST" | "PATCH" | "PUT", p) if p.contains("/leases") || p.contains("/events") => {
                let mut created = body.clone();
                created["metadata"]["resourceVersion"] = json!("1");
                reply(
                    if method == "POST" {
                        StatusCode::CREATED
                    } else {
                        StatusCode::OK
                    },
                    &created,
                )
            }
            _ => panic!("unexpected request {method} {target}"),
        };
        send.send_response(response);
    }
}

fn status_writes(requests: &Requests) -> Vec<Value> {
    requests
        .lock()
        .unwrap()
        .iter()
        .filter(|(m, t, _)| m == "PATCH" && t.contains("/proxies/ext/status"))
        .map(|(_, _, b)| b["status"].clone())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_reconciles_an_external_proxy_to_ready() {
    let dir = tempfile::tempdir().unwrap();
    let target = Target::start();
    let squid = Squid::start();
    let ca = dir.path().join("ca.pem");
    std::fs::write(&ca, target.ca_cert_pem()).unwrap();
    let providers = dir.path().join("providers.yaml");
    std::fs::write(&providers, "providers: []\n").unwrap();
    let api_port = free_port();
    let ledger = dir.path().join("ledger.db");
    let cli = Cli::try_parse_from([
        "proxy-operator",
        "run",
        "--providers-config",
        providers.to_str().unwrap(),
        "--ledger",
        ledger.to_str().unwrap(),
        "--probe-ca-file",
        ca.to_str().unwrap(),
        "--discovery-addr",
        &format!("127.0.0.1:{api_port}"),
        "--metrics-addr",
        &format!("127.0.0.1:{}", free_port()),
        "--leader-namespace",
        "proxy-operator",
    ])
    .unwrap();
    let Command::Run(args) = cli.command else {
        panic!("not run")
    };

    let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
    let client = Client::new(service, "default");
    let requests: Requests = Arc::default();
    let server = tokio::spawn(api_server(
        handle,
        proxy(squid.port(), &target.https_url()),
        requests.clone(),
    ));
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let operator = tokio::spawn(operator::run_with_client(args, client, async move {
        let _ = stop_rx.await;
    }));

    // Ready once the Proxy watch has listed.
    let http = reqwest::Client::new();
    let start = Instant::now();
    loop {
        let ready = http
            .get(format!("http://127.0.0.1:{api_port}/readyz"))
            .send()
            .await;
        if ready.is_ok_and(|r| r.status() == reqwest::StatusCode::OK) {
            break;
        }
        assert!(start.elapsed() < DEADLINE, "/readyz never became ready");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // The probe through the real squid makes it healthy; the reconciler writes Ready.
    let start = Instant::now();
    let ready = loop {
        if let Some(status) = status_writes(&requests)
            .into_iter()
            .find(|s| s["phase"] == "Ready")
        {
            break status;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "no Ready status write; requests: {:#?}",
            requests.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(ready["ip"], "127.0.0.1");
    assert_eq!(ready["observedGeneration"], 1);
    let condition = |t: &str| {
        ready["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["type"] == t)
            .cloned()
            .unwrap()
    };
    assert_eq!(condition("Provisioned")["status"], "True");
    assert_eq!(condition("Provisioned")["reason"], "ExternalEndpoint");
    assert_eq!(condition("Healthy")["status"], "True");
    assert!(ready.get("providerID").is_none_or(Value::is_null));

    // The API serves it as a healthy candidate.
    let list: Value = http
        .get(format!(
            "http://127.0.0.1:{api_port}/v1/proxies?healthy=true"
        ))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(list["count"], 1);
    assert_eq!(list["proxies"][0]["name"], "ext");

    // An External proxy never gets a finalizer, and nothing touches Pods.
    for (method, target, _) in requests.lock().unwrap().iter() {
        assert!(
            !(method == "PATCH"
                && target
                    .starts_with("/apis/crawl.example.com/v1alpha1/namespaces/crawl/proxies/ext?")),
            "metadata patch on an External proxy: {target}"
        );
        assert!(!target.contains("/pods"), "{method} {target}");
    }

    stop_tx.send(()).unwrap();
    let exit = tokio::time::timeout(DEADLINE, operator)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(exit, Exit::Clean);
    server.abort();
}
